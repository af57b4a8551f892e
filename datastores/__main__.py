"""``python -m datastores build|info|bench ...``"""
import sys

from rest_core.datastore_cli import main

sys.exit(main())
