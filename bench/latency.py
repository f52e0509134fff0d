"""The timing harness every benchmark uses: warm-up, then iterations bounded by count AND by time.

    from xdeploy.bench.latency import measure
    stats = measure(call, warmup=3, min_iters=10, max_iters=200, max_seconds=5.0)
    stats.p50, stats.p99, stats.mean        # seconds (floats), stats.n iterations, stats.total_s timed

`call` is a zero-argument callable (e.g. `runner.prepare(feeds)`); each iteration is timed on its own with
`time.perf_counter_ns` so the percentiles are of single calls, not of batches. Iteration stops after
`max_iters`, or once `max_seconds` of timed calls have elapsed and at least `min_iters` were taken (a slow
model never runs fewer than `min_iters`, a fast one never more than `max_iters`).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError

STAT_FIELDS = ("p50", "p90", "p99", "mean", "std", "min", "max")


@dataclass(frozen=True)
class LatencyStats:
    """Per-call latency in seconds over `n` timed calls (percentiles: linear interpolation, numpy default)."""

    p50: float
    p90: float
    p99: float
    mean: float
    std: float  # population standard deviation (ddof=0)
    min: float
    max: float
    n: int
    total_s: float  # sum of the timed calls (excludes warm-up)

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}

    def throughput(self, items: float) -> float:
        """Items per second at the median latency (`items` processed per call, e.g. batch or batch*seq)."""
        return items / self.p50 if self.p50 > 0 else math.inf


def summarize(samples: Sequence[float]) -> LatencyStats:
    """Statistics of per-call durations in seconds."""
    a = np.asarray(samples, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise XDeployError("latency statistics need at least one sample")
    if not np.all(np.isfinite(a)) or np.any(a < 0):
        raise XDeployError("latency samples must be finite and non-negative")
    p50, p90, p99 = (float(x) for x in np.percentile(a, [50, 90, 99]))
    return LatencyStats(p50=p50, p90=p90, p99=p99, mean=float(a.mean()), std=float(a.std()),
                        min=float(a.min()), max=float(a.max()), n=int(a.size), total_s=float(a.sum()))


def measure(call: Callable[[], Any], *, warmup: int = 3, min_iters: int = 10, max_iters: int = 1000,
            max_seconds: float = 5.0) -> LatencyStats:
    """Time `call()` after `warmup` untimed calls; see the module docstring for the stopping rule."""
    return summarize(timed_samples(call, warmup=warmup, min_iters=min_iters, max_iters=max_iters,
                                   max_seconds=max_seconds))


def timed_samples(call: Callable[[], Any], *, warmup: int = 3, min_iters: int = 10, max_iters: int = 1000,
                  max_seconds: float = 5.0) -> list[float]:
    """Each timed call's duration in seconds, in call order (`measure`'s samples, with its stopping rule)."""
    if warmup < 0 or min_iters < 1 or max_iters < min_iters or not max_seconds > 0:
        raise XDeployError(f"need warmup >= 0, 1 <= min_iters <= max_iters and max_seconds > 0; got warmup={warmup}"
                           f", min_iters={min_iters}, max_iters={max_iters}, max_seconds={max_seconds}")
    for _ in range(warmup):
        call()
    budget_ns = int(max_seconds * 1e9)
    samples: list[int] = []
    spent = 0
    clock = time.perf_counter_ns
    # The collector would otherwise run inside a timed call at a random iteration and inflate p99.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        while len(samples) < max_iters and (len(samples) < min_iters or spent < budget_ns):
            t0 = clock()
            call()
            dt = clock() - t0
            samples.append(dt)
            spent += dt
    finally:
        if was_enabled:
            gc.enable()
    return [s * 1e-9 for s in samples]
