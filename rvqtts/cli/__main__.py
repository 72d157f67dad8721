"""`python -m rvqtts.cli`: the same as the `rvqtts` command."""

from rvqtts.cli import main

main()
