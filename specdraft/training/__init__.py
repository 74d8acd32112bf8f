"""Training drafters from the frozen target: the corpus reader (`corpus.py`), what every
`train` command prepares (`prepare.py`: the target, the token sequences, the held-out
split), the target's features cached on disk (`features.py`), the shared loop with
progress, checkpoints and Ctrl-C (`loop.py`), and what each trained kind learns (`head.py`
for head drafters, `steer.py` for steered ones)."""
