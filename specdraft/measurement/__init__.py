"""Measuring: prompt datasets, live benchmarks (against plain decoding and transformers'
own generation modes), traces recorded once and replayed offline for any policy, and
parameter sweeps over replays."""
