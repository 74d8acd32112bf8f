"""specdraft: lossless speculative decoding with a pool of drafters picked online by a policy."""

__version__ = "0.2.0"
