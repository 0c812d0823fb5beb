# SPDX-License-Identifier: Apache-2.0
"""`python -m jobprobe.cli ...`: the same as the `jobprobe` command."""
import sys

from jobprobe.cli import main

sys.exit(main())
