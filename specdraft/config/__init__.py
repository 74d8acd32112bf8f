"""The TOML profile: a table reader that knows key paths, the model spec shared by the
target and model-backed drafters, and the profile itself. Nothing here loads a model."""
