"""``python -m allreduce.plan``: the same as ``allreduce-plan``."""
import sys

from .cli import main

sys.exit(main())
