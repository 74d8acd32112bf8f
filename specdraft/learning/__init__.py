"""Learning which drafter to use and how far it drafts: alignment feedback (feedback.py),
the round planner (planner.py, over the cost model and acceptance by position of
goodput.py and the early stop of confidence.py), the policies (policies/), and the driver
that runs a policy and its planner through rounds, shared by live decoding and offline
replay (driver.py). Plain Python: nothing here imports torch."""
