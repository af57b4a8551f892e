import sys

from rest_core.cli import main

sys.exit(main())
