"""Terminal display: the live Rich panel, always on stderr."""
