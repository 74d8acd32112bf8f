"""`python -m specdraft` runs the command-line interface."""

from specdraft.cli import main

main()
