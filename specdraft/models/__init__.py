"""Models: loading from hub cache / folder / GGUF / package file (with the GGUF conversion
cache), and CachedLM, a model with its own KV cache that can feed, crop and catch up."""
