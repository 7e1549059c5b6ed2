"""The speed benches' timing (`lethe bench t3`, `lethe bench engine`): what a variant does once is not counted."""

from __future__ import annotations

import time

from lethe.server.bench.t3 import _paired_ratio, _timed_runs


def test_the_warm_up_round_is_not_timed_and_variants_alternate():
    calls: list[str] = []

    def variant(name: str, first: float):
        def run():
            calls.append(name)
            time.sleep(first if calls.count(name) == 1 else 0.0)  # a one-time cost on the first call only
        return run

    runs = _timed_runs({"a": variant("a", 0.3), "b": variant("b", 0.0)}, repeats=2)
    assert calls == ["a", "b"] * 3  # one warm-up round, then two timed rounds, alternating
    assert len(runs["a"]) == len(runs["b"]) == 2 and max(runs["a"]) < 0.15
    cold = _timed_runs({"a": variant("c", 0.3)}, repeats=1, warmup=0)
    assert cold["a"][0] >= 0.3
    assert _paired_ratio({"x": [2.0, 3.0, 9.0], "y": [1.0, 1.0, 1.0]}, "x", "y") == 3.0  # median of the rounds' ratios
