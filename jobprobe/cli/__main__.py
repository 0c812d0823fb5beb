"""`python -m jobprobe.cli ...`: the same as the `jobprobe` command."""
import sys

from jobprobe.cli import main

sys.exit(main())
