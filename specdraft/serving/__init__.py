"""specdraft inside a serving engine (vLLM): the profile's host-side drafters and policy,
per request, as the engine's speculative proposer; the launcher of `specdraft serve`."""
