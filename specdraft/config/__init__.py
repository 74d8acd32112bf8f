"""The TOML reading below every other profile part: a table reader that knows key paths,
the model spec shared by the target and model-backed drafters, and in-place edits. The
whole profile (`specdraft/profile.py`) sits above the drafter kinds and policies it
names. Nothing here loads a model."""
