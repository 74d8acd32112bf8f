"""The work behind each CLI command, callable from tests without Typer."""
