"""`python -m stack` is the same as the `stack` command."""

from stack.cli import entry

entry()
