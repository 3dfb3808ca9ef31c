"""`python -m stack` is the same as the `stack` command."""

import sys

from stack.cli import main

sys.exit(main())
