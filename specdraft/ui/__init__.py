"""What the terminal shows on stderr: the live panel, result tables, progress bars."""
