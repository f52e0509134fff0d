"""Interleaved, paired timing: comparisons that a burst of load on a shared machine cannot silently skew.

Timing A for five seconds and then B for five seconds divides two measurements taken under different
conditions: a burst of load (another process, a compile, a page-cache flush) lands on whichever of them was
being timed. Here every compared thing is prepared once and timed in alternating *rounds*:

    round 0:  A B C        round 1:  B C A        round 2:  C A B   ...   (order rotated per round)

A round times a block of `calls` consecutive calls per candidate (a block lasts >= `min_block_s`, like
torch.utils.benchmark's blocked_autorange, so the timer's resolution and one-off stalls weigh little); the
round time is the block's mean call time. A speed-up is the median of the *paired* ratios
baseline round time / candidate round time (same round, seconds apart), with a distribution-free 95%
interval of that median (order statistics of the binomial(n, 1/2) distribution). A burst that hits a share f
of the rounds moves the paired median by at most the spread of the f/2 quantiles around it; it cannot turn a
2x into a 10x.

    from xdeploy.bench.interleave import compare
    cmp = compare({"torch": torch_call, "ort": ort_call}, baseline="torch", max_seconds=5.0)
    cmp.speedups["ort"].median, cmp.speedups["ort"].low, cmp.speedups["ort"].high, cmp.stable

Stability (every figure records its dispersion and the machine's load while it was taken):
  * per series: IQR / median of the round times, max / min of the round times;
  * per speed-up: the width of its 95% interval relative to its median;
  * the machine: 1-minute load average, and the CPU time *other* processes used during the measurement
    (psutil: system-wide busy CPU time minus this process's own), as a number of cores.
A comparison is *unstable* when any series' IQR / median exceeds `Thresholds.series_rel_iqr` or a speed-up's
interval is wider than `Thresholds.ratio_rel_ci` of its median; it is then re-measured (fresh rounds) up to
`attempts` times and the steadiest attempt is kept. The reason says "load" when other processes used more
than `Thresholds.other_cores` cores meanwhile (a busy machine), else "noise". The thresholds follow
torch.utils.benchmark (IQR > 10% of the median: a warning, > 25%: "gross") and pyperf's `check` (spread
relative to the centre); see docs/benchmarks.md.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError

from .latency import LatencyStats, summarize


@dataclass(frozen=True)
class Thresholds:
    """When a comparison is called unstable (documented in docs/benchmarks.md)."""

    series_rel_iqr: float = 0.25  # a series' round times: IQR / median (torch.utils.benchmark's "gross" level)
    ratio_rel_ci: float = 0.30  # a speed-up's 95% interval: (high - low) / median
    other_cores: float = 0.5  # other processes' CPU use (cores, averaged) above which the cause is "load"
    # tasks waited for a CPU this share of the time while other processes used > other_cores: oversubscribed.
    # Steady but contended rounds are not a quiet machine's figure (a busy loop on one of 2 cores made an
    # onnxruntime fp16 run read 0.34x instead of 1.12x with every round alike)
    cpu_pressure: float = 0.10


DEFAULT_THRESHOLDS = Thresholds()


# ------------------------------------------------------------------------------------------ statistics ----

def median_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high): a distribution-free interval of the median from order statistics.

    The number of values below the true median is binomial(n, 1/2); the interval is [x_(j), x_(n+1-j)] for
    the largest j with P(B < j) <= (1 - confidence) / 2. Below 6 values no j qualifies: (min, max) is
    returned (its coverage is then below `confidence`)."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    n = x.size
    if n == 0:
        raise XDeployError("a median interval needs at least one value")
    alpha = (1.0 - confidence) / 2.0
    cdf, j = 0.0, 0  # cdf = P(B <= j - 1)
    while j < n:
        p_next = cdf + math.comb(n, j) * 0.5**n  # P(B <= j)
        if p_next > alpha:
            break
        cdf, j = p_next, j + 1
    lo_i = max(j - 1, 0)  # x_(j) with 1-based j  ->  index j-1
    hi_i = min(n - j, n - 1) if j > 0 else n - 1
    return float(np.median(x)), float(x[lo_i]), float(x[hi_i])


def rel_iqr(values: Sequence[float]) -> float:
    """Interquartile range / median (0 for a single value)."""
    a = np.asarray(values, dtype=np.float64)
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return float((q3 - q1) / med) if med > 0 else math.inf


@dataclass(frozen=True)
class SeriesStats:
    """One candidate's round times (seconds per call, mean over the round's block)."""

    median_s: float
    rel_iqr: float  # IQR / median of the round times
    max_over_min: float  # slowest round / fastest round
    rounds: int
    calls_per_round: int


@dataclass(frozen=True)
class SpeedUp:
    """Paired ratios baseline round / candidate round: median and its 95% interval."""

    median: float
    low: float
    high: float
    rounds: int

    @property
    def rel_ci(self) -> float:
        return (self.high - self.low) / self.median if self.median > 0 else math.inf


def paired_speedup(baseline: Sequence[float], candidate: Sequence[float]) -> SpeedUp:
    """Speed-up of `candidate` over `baseline` from rounds paired by index (both in seconds per call)."""
    b, c = np.asarray(baseline, dtype=np.float64), np.asarray(candidate, dtype=np.float64)
    if b.shape != c.shape or b.ndim != 1 or b.size == 0:
        raise XDeployError(f"paired rounds need equal, non-empty series; got {b.shape} and {c.shape}")
    if np.any(b <= 0) or np.any(c <= 0):
        raise XDeployError("round times must be positive")
    med, lo, hi = median_ci(b / c)
    return SpeedUp(median=med, low=lo, high=hi, rounds=int(b.size))


def series_stats(rounds: Sequence[float], calls: int) -> SeriesStats:
    a = np.asarray(rounds, dtype=np.float64)
    return SeriesStats(median_s=float(np.median(a)), rel_iqr=rel_iqr(a), max_over_min=float(a.max() / a.min()),
                       rounds=int(a.size), calls_per_round=calls)


# ------------------------------------------------------------------------------------------ machine load ----

@dataclass(frozen=True)
class Load:
    """The machine while something was measured."""

    wall_s: float
    loadavg_1m: float | None  # at the end (the kernel's exponentially damped run-queue length)
    other_cores: float | None  # CPU time other processes used / wall time (cores, averaged)
    own_cores: float | None  # CPU time this process used / wall time
    cores: int  # CPUs this process may run on
    # share of the wall time some runnable task waited for a CPU (Linux PSI, /proc/pressure/cpu "some");
    # None where the kernel does not report it
    cpu_pressure: float | None = None


def _cpu_stall_us() -> float | None:
    """Total microseconds some task waited for a CPU since boot (PSI), or None."""
    try:
        with open("/proc/pressure/cpu", encoding="ascii") as f:
            some = f.readline().split()
        return float(dict(kv.split("=") for kv in some[1:])["total"])
    except (OSError, ValueError, KeyError, IndexError):
        return None


def _affinity() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class LoadMeter:
    """Measures the CPU time other processes used between start() and stop() (psutil)."""

    def start(self) -> LoadMeter:
        import psutil

        self._proc = psutil.Process()
        self._t0 = time.perf_counter()
        self._sys0 = self._busy(psutil.cpu_times())
        c = self._proc.cpu_times()
        self._own0 = c.user + c.system + c.children_user + c.children_system
        self._stall0 = _cpu_stall_us()
        return self

    @staticmethod
    def _busy(t: Any) -> float:
        # everything but idle and iowait (guest time is already counted in user on Linux)
        return sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))

    def stop(self) -> Load:
        import psutil

        wall = time.perf_counter() - self._t0
        busy = self._busy(psutil.cpu_times()) - self._sys0
        c = self._proc.cpu_times()
        own = c.user + c.system + c.children_user + c.children_system - self._own0
        try:
            la: float | None = os.getloadavg()[0]
        except OSError:
            la = None
        if wall <= 0:
            return Load(wall_s=0.0, loadavg_1m=la, other_cores=None, own_cores=None, cores=_affinity())
        stall = _cpu_stall_us()
        pressure = None if stall is None or self._stall0 is None else min(max(stall - self._stall0, 0.0) * 1e-6 / wall,
                                                                          1.0)
        return Load(wall_s=wall, loadavg_1m=la, other_cores=max(busy - own, 0.0) / wall, own_cores=own / wall,
                    cores=_affinity(), cpu_pressure=pressure)


def free_cores(sample_s: float = 0.5) -> int:
    """Cores not used by other processes right now (>= 1): this process's CPUs minus the busy CPU time of the
    whole machine over `sample_s` seconds, rounded to the nearest core. Threads beyond this number would
    share a core with another process: OpenMP-style runtimes that wait for all their threads then stall."""
    meter = LoadMeter().start()
    time.sleep(sample_s)
    load = meter.stop()
    other = load.other_cores or 0.0
    return max(1, min(load.cores, int(math.floor(load.cores - other + 0.5))))


# ------------------------------------------------------------------------------------------ the comparison ----

@dataclass(frozen=True)
class Attempt:
    """One interleaved measurement of every candidate."""

    rounds: dict[str, list[float]]  # name -> per-round mean call time (s), rounds in order
    calls: dict[str, list[float]]  # name -> every timed call (s), for per-call percentiles
    calls_per_round: dict[str, int]
    load: Load


@dataclass(frozen=True)
class Comparison:
    """The kept attempt of an interleaved comparison, with its verdict."""

    baseline: str | None
    series: dict[str, SeriesStats]
    latency: dict[str, LatencyStats]  # per-call statistics over every round
    speedups: dict[str, SpeedUp]  # candidate -> speed-up over the baseline (empty without a baseline)
    load: Load
    stable: bool
    reasons: tuple[tuple[str, str], ...]  # (candidate, why): ("torch", "torch: round times IQR 41% ... > 25%")
    cause: str | None  # "load" | "noise" | None (stable)
    attempts: int
    thresholds: Thresholds = field(default=DEFAULT_THRESHOLDS)
    rounds: dict[str, list[float]] = field(default_factory=dict)  # the kept attempt's round times (s per call)

    def stability(self, name: str) -> dict[str, Any]:
        """JSON-ready stability block for one candidate's record: its own verdict (its series, its speed-up
        and the baseline's series), its dispersion, its speed-up and the machine's load."""
        s, sp = self.series[name], self.speedups.get(name)
        mine = [why for who, why in self.reasons if who in (name, self.baseline)]
        return {"stable": not mine, "cause": self.cause if mine else None, "reasons": mine,
                "attempts": self.attempts, "rounds": s.rounds, "calls_per_round": s.calls_per_round,
                "rel_iqr": s.rel_iqr, "max_over_min": s.max_over_min,
                "speedup": None if sp is None else {"median": sp.median, "low": sp.low, "high": sp.high},
                "baseline": self.baseline, "load": asdict(self.load), "thresholds": asdict(self.thresholds)}


def _block(fn: Callable[[], Any], n: int, clock: Callable[[], int] = time.perf_counter_ns) -> list[float]:
    out = []
    for _ in range(n):
        t0 = clock()
        fn()
        out.append((clock() - t0) * 1e-9)
    return out


def run_rounds(calls: Mapping[str, Callable[[], Any]], *, min_rounds: int = 8, max_rounds: int = 40,
               max_seconds: float = 5.0, min_block_s: float = 0.02, warmup: int = 2,
               settle_s: float = 0.002) -> Attempt:
    """Warm up every candidate, size its block, then time rotated rounds until `max_seconds` (at least
    `min_rounds`, at most `max_rounds`). A round's value for a candidate is the median of its block's calls;
    `settle_s` of untimed sleep precede each block. The collector is paused while timing (as in
    latency.measure)."""
    names = list(calls)
    if not names:
        raise XDeployError("nothing to compare")
    if min_rounds < 1 or max_rounds < min_rounds or not max_seconds > 0:
        raise XDeployError(f"need 1 <= min_rounds <= max_rounds and max_seconds > 0; got {min_rounds}, "
                           f"{max_rounds}, {max_seconds}")
    per: dict[str, int] = {}
    for name in names:  # warm-up doubles as calibration: the fastest warm-up call sizes the block
        ts = _block(calls[name], max(warmup, 1))
        per[name] = max(1, math.ceil(min_block_s / max(min(ts), 1e-9)))
    rounds: dict[str, list[float]] = {n: [] for n in names}
    samples: dict[str, list[float]] = {n: [] for n in names}
    meter = LoadMeter().start()
    t_start = time.perf_counter()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        r = 0
        while r < max_rounds and (r < min_rounds or time.perf_counter() - t_start < max_seconds):
            k = r % len(names)
            for name in names[k:] + names[:k]:  # rotate: each candidate leads equally often
                # a short untimed pause first: the previous runtime's idle threads (onnxruntime's pool spins
                # after a call by default; TBB workers too) would otherwise still hold a core when this
                # block starts, a cost the previous candidate's code leaves on this one's first calls
                time.sleep(settle_s)
                ts = _block(calls[name], per[name])
                rounds[name].append(statistics.median(ts))  # robust to a disturbed call within the block
                samples[name].extend(ts)
            r += 1
    finally:
        if was_enabled:
            gc.enable()
    return Attempt(rounds=rounds, calls=samples, calls_per_round=per, load=meter.stop())


def run_timed_rounds(timers: Mapping[str, Callable[[], Sequence[float]]], *, rounds: int = 7) -> Attempt:
    """Rotated rounds of candidates that time themselves: each call of `timers[name]` is one round of that
    candidate and returns the seconds of each of its timed calls (e.g. a child process that loads a model once,
    warms up and reports its own per-call times, so its start-up is not timed). The round time is their mean,
    as in `run_rounds`; `judge` gives the paired speed-ups and the stability verdict."""
    names = list(timers)
    if not names or rounds < 1:
        raise XDeployError(f"need candidates and rounds >= 1; got {names}, {rounds}")
    out: dict[str, list[float]] = {n: [] for n in names}
    samples: dict[str, list[float]] = {n: [] for n in names}
    per: dict[str, int] = {}
    meter = LoadMeter().start()
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:  # rotate: each candidate leads equally often
            ts = [float(t) for t in timers[name]()]
            if not ts or min(ts) <= 0:
                raise XDeployError(f"{name}: a round needs positive call times; got {ts[:4]}")
            out[name].append(sum(ts) / len(ts))
            samples[name].extend(ts)
            per[name] = len(ts)
    return Attempt(rounds=out, calls=samples, calls_per_round=per, load=meter.stop())


def judge(attempt: Attempt, baseline: str | None, thresholds: Thresholds = DEFAULT_THRESHOLDS) -> Comparison:
    """Statistics and the stability verdict of one attempt."""
    series = {n: series_stats(r, attempt.calls_per_round[n]) for n, r in attempt.rounds.items()}
    speedups = {n: paired_speedup(attempt.rounds[baseline], r) for n, r in attempt.rounds.items()
                if baseline is not None and n != baseline}
    reasons = [(n, f"{n}: round times IQR {s.rel_iqr:.0%} of median > {thresholds.series_rel_iqr:.0%}")
               for n, s in series.items() if s.rel_iqr > thresholds.series_rel_iqr]
    reasons += [(n, f"{n}: speed-up 95% interval {sp.low:.2f}-{sp.high:.2f} is {sp.rel_ci:.0%} of its median "
                    f"> {thresholds.ratio_rel_ci:.0%}") for n, sp in speedups.items()
                if sp.rel_ci > thresholds.ratio_rel_ci]
    other, pressure = attempt.load.other_cores, attempt.load.cpu_pressure
    if pressure is not None and other is not None and pressure > thresholds.cpu_pressure \
            and other > thresholds.other_cores:  # steady rounds, but not a quiet machine's figure
        why = (f"CPU oversubscribed {pressure:.0%} of the time > {thresholds.cpu_pressure:.0%} while other processes "
               f"used {other:.1f} cores")
        reasons += [(n, why) for n in ([baseline] if baseline is not None else list(attempt.rounds))]
    cause = None if not reasons else ("load" if other is not None and other > thresholds.other_cores else "noise")
    return Comparison(baseline=baseline, series=series,
                      latency={n: summarize(c) for n, c in attempt.calls.items()}, speedups=speedups,
                      load=attempt.load, stable=not reasons, reasons=tuple(reasons), cause=cause,
                      attempts=1, thresholds=thresholds, rounds=attempt.rounds)


def _badness(c: Comparison) -> float:
    """How far past the thresholds the steadiest attempt is (lower is steadier)."""
    t = c.thresholds
    worst = [s.rel_iqr / t.series_rel_iqr for s in c.series.values()]
    worst += [sp.rel_ci / t.ratio_rel_ci for sp in c.speedups.values()]
    return max(worst)


def compare(calls: Mapping[str, Callable[[], Any]], *, baseline: str | None = None, attempts: int = 2,
            thresholds: Thresholds = DEFAULT_THRESHOLDS, log: Callable[[str], None] | None = None,
            **rounds_kw: Any) -> Comparison:
    """Interleaved comparison of prepared zero-argument calls; re-measured while unstable, at most `attempts`
    times in all (the steadiest attempt is kept, and the verdict says whether it is stable)."""
    if baseline is not None and baseline not in calls:
        raise XDeployError(f"baseline {baseline!r} is not among the compared: {', '.join(calls)}")
    if attempts < 1:
        raise XDeployError(f"attempts must be >= 1, got {attempts}")
    best: Comparison | None = None
    done = 0
    while done < attempts:
        done += 1
        c = judge(run_rounds(calls, **rounds_kw), baseline, thresholds)
        if c.stable or best is None or _badness(c) < _badness(best):
            best = c
        if c.stable:
            break
        if log and done < attempts:
            log(f"unstable ({c.cause}): {'; '.join(w for _, w in c.reasons)}; measuring again "
                f"({done + 1}/{attempts})")
    assert best is not None
    return replace(best, attempts=done)


def speedup_text(stability: Mapping[str, Any] | None, *, digits: int = 2) -> str:
    """'3.41x (3.30-3.52)', or 'unstable (load)' when the comparison was unstable; '-' without a figure."""
    if not stability or not stability.get("speedup"):
        return "-"
    if not stability["stable"]:
        return f"unstable ({stability['cause']})"
    sp = stability["speedup"]
    return f"{sp['median']:.{digits}f}x ({sp['low']:.{digits}f}-{sp['high']:.{digits}f})"
