"""The decode core: sampling transforms, lossless verification, the round loop, and the
live full-information evaluator. Token ids only; no text, no printing."""
