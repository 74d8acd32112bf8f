"""The most any policy could reach along a recorded trajectory: every round's choice made
knowing the round's outcome, the best sequence of rounds found exactly.

A prompt is a trajectory of n tokens; at each position a round has some options, each
committing some tokens (at least one: the target's own) in some seconds. A policy is a way of
choosing an option at each position it reaches; the best one in hindsight maximises total
tokens over total seconds across every prompt at once. That is a ratio of sums, so it is
found by Dinkelbach's iteration: for a price r per second, a backward pass per prompt finds
the rounds with the most tokens - r x seconds; the rate of those rounds is the next r, and
when the best sum is 0 the price is the best rate (it rises every step and the rounds are
finitely many). What the options are (which drafters, which draft lengths, at what costs)
is the caller's: `measurement/replay.py` builds them from a trace's lanes and forward costs.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

Option = tuple[int, float]  # (tokens the round commits, at least 1; its seconds)
Options = Callable[[int], Iterable[Option]]  # a prompt's options at a position


def best_rounds(table: Sequence[Sequence[Option]], price: float) -> tuple[float, float]:
    """(tokens, seconds) of the rounds through a trajectory with the most tokens - price x
    seconds, `table` holding each position's options; a round never commits past the end."""
    length = len(table)
    best = [(0.0, 0.0, 0.0)] * (length + 1)  # per position: (value, tokens, seconds) of the best rest
    for position in range(length - 1, -1, -1):
        choices = []
        for tokens, seconds in table[position]:
            step = max(1, min(tokens, length - position))
            value, rest_tokens, rest_seconds = best[position + step]
            choices.append((step - price * seconds + value, step + rest_tokens, seconds + rest_seconds))
        best[position] = max(choices)
    return best[0][1], best[0][2]


def best_rate(prompts: Sequence[tuple[int, Options]], at_least: float = 0.0, max_steps: int = 200) -> float:
    """The highest tokens per second over `prompts` ((length, options) each) of any choice
    of rounds; 0 for no tokens. `at_least`: a rate some choice is known to reach (the
    iteration starts there: fewer passes)."""
    # The options do not depend on the price: listed once, every pass reads them.
    tables = [[list(options(position)) for position in range(length)] for length, options in prompts]
    price, rate = at_least, at_least
    for _ in range(max_steps):
        tokens = seconds = 0.0
        for table in tables:
            t, s = best_rounds(table, price)
            tokens, seconds = tokens + t, seconds + s
        if seconds <= 0:
            return 0.0
        rate = tokens / seconds
        if rate <= price * (1 + 1e-12):
            break
        price = rate
    return rate
