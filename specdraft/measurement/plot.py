"""`bench --plot`: speedup per task and configuration, and cumulative-regret curves.
matplotlib is optional (pip install 'specdraft[plot]')."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from specdraft.errors import UsageError


def plot_bench(rows: Sequence[dict], samples: Sequence, file: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'specdraft[plot]'") from None
    tasks = sorted({r["task"] for r in rows if r["task"] != "all"}) + ["all"]
    configs = [c for c in dict.fromkeys(r["config"] for r in rows) if c != "plain"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(len(configs), 1)
    for i, config in enumerate(configs):
        values = [next((r["speedup"] or 0 for r in rows if r["task"] == t and r["config"] == config), 0) for t in tasks]
        left.bar([x + i * width for x in range(len(tasks))], values, width, label=config)
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_xticks([x + width * (len(configs) - 1) / 2 for x in range(len(tasks))], tasks)
    left.set_ylabel("speedup vs plain decoding")
    left.legend(fontsize=7)
    colours, units = {}, set()
    for sample in samples:
        if sample.regret_curve and sample.repeat == 1:
            colour = colours.setdefault(sample.config, f"C{len(colours)}")
            units.add(sample.regret_unit)
            right.plot(range(1, len(sample.regret_curve) + 1), sample.regret_curve, color=colour, alpha=0.6,
                       label=sample.config if sample.config not in right.get_legend_handles_labels()[1] else None)
    right.set_xlabel("round")
    # In the unit of each policy's objective: expected accepted tokens, or tokens per second
    # (by the policy's cost model) summed over the evaluated rounds.
    labels = {"tokens": "expected accepted tokens", "tok/s": "tok/s summed over rounds"}
    unit = units.pop() if len(units) == 1 else None
    right.set_ylabel(f"cumulative regret ({labels.get(unit, unit or 'tokens or tok/s, by policy objective')})")
    if colours:
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(file, dpi=110)
    plt.close(fig)
