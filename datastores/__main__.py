"""``python -m datastores build|info|bench ...``"""
import sys

from .cli import main

sys.exit(main())
