"""The decode core: sampling transforms, lossless verification and the round loop."""
