"""Learning which drafter to use: alignment feedback (feedback.py), the policies
(policies/), and the driver that runs a policy through rounds, shared by live decoding
and offline replay (driver.py). Plain Python: nothing here imports torch."""
