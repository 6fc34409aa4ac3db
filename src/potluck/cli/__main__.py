"""`python -m potluck.cli ...`: the same as the `potluck` script."""

from potluck.cli import main

main()
