"""Benchmark harness, memory probe, fingerprint, records and the bench/roofline/scale commands (tiny runs)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from xdeploy.bench.latency import LatencyStats, measure, summarize
from xdeploy.errors import XDeployError


def test_summarize_percentile_math():
    s = summarize([float(x) for x in range(1, 101)])  # 1..100 seconds
    assert s.n == 100 and s.min == 1.0 and s.max == 100.0 and s.total_s == 5050.0
    assert s.mean == pytest.approx(50.5) and s.std == pytest.approx(np.std(np.arange(1, 101)))
    assert s.p50 == pytest.approx(50.5) and s.p90 == pytest.approx(90.1) and s.p99 == pytest.approx(99.01)
    assert s.min <= s.p50 <= s.p90 <= s.p99 <= s.max
    with pytest.raises(XDeployError):
        summarize([])
    with pytest.raises(XDeployError):
        summarize([1.0, math.nan])


def test_measure_counts_warmup_and_bounds():
    calls = itertools.count()
    st = measure(lambda: next(calls), warmup=4, min_iters=5, max_iters=7, max_seconds=10.0)
    assert isinstance(st, LatencyStats) and st.n == 7 and next(calls) == 4 + 7  # max_iters bounds a fast call
    # a slow call stops on the time budget, but never before min_iters
    import time
    st = measure(lambda: time.sleep(0.01), warmup=0, min_iters=3, max_iters=1000, max_seconds=0.05)
    assert 3 <= st.n < 20 and st.min >= 0.009
    with pytest.raises(XDeployError):
        measure(lambda: None, min_iters=5, max_iters=2)


def test_measure_sees_a_known_distribution():
    # 1 call in 10 sleeps 20 ms, the rest ~0: the p50 must be tiny and the p99 must see the slow tail.
    import time
    i = itertools.count()
    st = measure(lambda: time.sleep(0.02) if next(i) % 10 == 9 else None, warmup=0, min_iters=50,
                 max_iters=50, max_seconds=10.0)
    assert st.n == 50 and st.p50 < 0.005 and st.p99 >= 0.019 and st.max >= 0.019
    assert st.mean == pytest.approx(st.total_s / st.n)


# ---------------------------------------------------------------- memory, fingerprint, records ----

def test_isolated_memory_sees_a_bigger_allocation():
    from xdeploy.bench.memory import allocate, run_isolated

    small, _, m_small = run_isolated(allocate, 8 << 20)
    big, phases, m_big = run_isolated(allocate, 160 << 20)
    assert big > small and set(phases) >= {"start", "imported", "loaded", "run", "end"}
    # the run phase touched ~152 MiB more; baseline interpreter noise is a few MiB
    assert m_big.activations_bytes - m_small.activations_bytes > 120 * 2**20
    assert m_big.peak_rss > m_small.peak_rss and m_big.device_bytes is None
    # freed before the mark: still seen by the high-water mark, not by the phase's end RSS
    _, phases, m_freed = run_isolated(allocate, 160 << 20, False)
    assert m_freed.activations_bytes > 120 * 2**20 and phases["run"]["rss"] < phases["run"]["hwm"] - 100 * 2**20


def test_isolated_child_errors_are_reported():
    from xdeploy.bench.memory import allocate, run_isolated

    with pytest.raises(XDeployError, match="nbytes must be >= 0"):  # a user error in the child stays one line
        run_isolated(allocate, -1)


def test_fingerprint_has_cpu_isa_versions_threads():
    from xdeploy.bench.fingerprint import fingerprint

    fp = fingerprint()
    assert fp["cpu_model"] and fp["logical_cpus"] >= 1 and fp["threads"]["affinity_cpus"] >= 1
    assert isinstance(fp["isa"], list) and all(not f.startswith("sse2") for f in fp["isa"])
    assert fp["versions"]["numpy"] and "onnxruntime" in fp["versions"]
    import json
    json.dumps(fp)  # JSON-ready
