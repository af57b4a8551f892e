"""``python -m datastores build|info|bench ...``: the datastore commands of rest_core's command line.

The commands live in rest_core.datastore_cli because `--tokenizer default` means the
default model's tokenizer; this script only hands over to them."""
import sys

from rest_core.datastore_cli import main

sys.exit(main())
