"""`python -m specdraft` runs the command-line interface, started as the `specdraft` command is."""

from specdraft.launch import main

main()
