"""Interleaved, paired timing: comparisons that a burst of load on a shared machine cannot silently skew.

Timing A for five seconds and then B for five seconds divides two measurements taken under different
conditions: a burst of load (another process, a compile, a page-cache flush) lands on whichever of them was
being timed. Here every compared thing is prepared once and timed in alternating *rounds*:

    round 0:  A B C        round 1:  B C A        round 2:  C A B   ...   (order rotated per round)

A round times a block of `calls` consecutive calls per candidate (a block lasts >= `min_block_s`, like
torch.utils.benchmark's blocked_autorange, so the timer's resolution and one-off stalls weigh little); the
round time is the block's median call time (one disturbed call does not move it). A speed-up is the median of
the *paired* ratios baseline round time / candidate round time (same round, seconds apart), with a distribution-free 95%
interval of that median (order statistics of the binomial(n, 1/2) distribution). A burst that hits a share f
of the rounds moves the paired median by at most the spread of the f/2 quantiles around it; it cannot turn a
2x into a 10x.

    from xdeploy.bench.interleave import compare
    cmp = compare({"torch": torch_call, "ort": ort_call}, baseline="torch", max_seconds=5.0)
    cmp.speedups["ort"].median, cmp.speedups["ort"].low, cmp.speedups["ort"].high, cmp.stable

Sequential rounds (MLPerf Inference's early stopping and pyperf's "more values until stable", applied to paired
ratios): after `min_rounds`, the rounds stop as soon as every speed-up's 95% interval is within the target
(`Thresholds.target`, +-10% of its median: (high - low) / 2 <= 10% of the median); while some are wider at
`max_seconds`, rounds go on for at most `extra_s` more seconds with only the baseline and the candidates still
wide (a narrow candidate stops, so the time goes where the intervals are widest; pairs stay paired by round
index). `Budget` shares one run's extra seconds among its comparisons.

Verdicts (every figure records its dispersion and the machine's load while it was taken):
  * per series: IQR / median of the round times, max / min of the round times;
  * per speed-up: its paired ratios' IQR / median, and its 95% interval's half-width relative to its median;
  * the machine: 1-minute load average, and the CPU time *other* processes used during the measurement
    (psutil: system-wide busy CPU time minus this process's own), as a number of cores.
A candidate is *unstable* when its round times or its paired ratios are dispersed (IQR / median over
`Thresholds.series_rel_iqr`), when the CPU was oversubscribed by other processes, or when its interval is wider
than the target while other processes used more than `Thresholds.other_cores` cores (a busy machine: never a
silently skewed figure); the comparison is then re-measured (fresh rounds) up to `attempts` times and the
steadiest attempt is kept. The cause is "load" when other processes used more than `other_cores` meanwhile, else
"noise". A steady candidate on a quiet machine whose interval is still wider than the target when the time is
spent is *wide*: its figure is printed with its interval and the word "wide". The thresholds follow
torch.utils.benchmark (IQR > 10% of the median: a warning, > 25%: "gross") and pyperf's `check` (spread
relative to the centre); see docs/benchmarks.md.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError
from xdeploy.core.fingerprint import usable_cpus

from .latency import LatencyStats, summarize


@dataclass(frozen=True)
class Thresholds:
    """When a comparison is called unstable (documented in docs/benchmarks.md)."""

    series_rel_iqr: float = 0.25  # round times or paired ratios: IQR / median (torch.utils.benchmark's "gross" level)
    target: float = 0.10  # a speed-up's 95% interval within +-target of its median: (high - low) / 2 <= target * median
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
    """One candidate's round times (seconds per call, the median of the round's block)."""

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

    rel_iqr: float = 0.0  # IQR / median of the paired ratios (their dispersion, not the interval's width)

    @property
    def rel_ci(self) -> float:
        return (self.high - self.low) / self.median if self.median > 0 else math.inf

    @property
    def half_width(self) -> float:
        """Half the 95% interval relative to the median: 0.10 = the figure is known to +-10%."""
        return self.rel_ci / 2.0


def paired_speedup(baseline: Sequence[float], candidate: Sequence[float]) -> SpeedUp:
    """Speed-up of `candidate` over `baseline` from rounds paired by index (both in seconds per call)."""
    b, c = np.asarray(baseline, dtype=np.float64), np.asarray(candidate, dtype=np.float64)
    if b.shape != c.shape or b.ndim != 1 or b.size == 0:
        raise XDeployError(f"paired rounds need equal, non-empty series; got {b.shape} and {c.shape}")
    if np.any(b <= 0) or np.any(c <= 0):
        raise XDeployError("round times must be positive")
    med, lo, hi = median_ci(b / c)
    return SpeedUp(median=med, low=lo, high=hi, rounds=int(b.size), rel_iqr=rel_iqr(b / c))


def row_rounds(rounds: Mapping[str, Sequence[float]], ids: Mapping[str, Sequence[int]], names: Sequence[str]
               ) -> dict[int, float]:
    """round index -> the mean round time of `names` (one system's instances, or one name) over the rounds all of
    them took part in (`ids`: each one's round indices; a name without ids took part in every round of its list)."""
    per = [dict(zip(ids.get(n) or range(len(rounds[n])), rounds[n])) for n in names]
    common = set.intersection(*(set(p) for p in per))
    return {i: float(np.mean([p[i] for p in per])) for i in sorted(common)}


def paired_rows(rounds: Mapping[str, Sequence[float]], ids: Mapping[str, Sequence[int]], baseline: Sequence[str],
                candidate: Sequence[str]) -> SpeedUp:
    """`paired_speedup` of one row (its instances' mean rounds, `row_rounds`) over another, over their common
    rounds."""
    b, c = row_rounds(rounds, ids, baseline), row_rounds(rounds, ids, candidate)
    common = sorted(b.keys() & c.keys())
    return paired_speedup([b[i] for i in common], [c[i] for i in common])


def paired(rounds: Mapping[str, Sequence[float]], ids: Mapping[str, Sequence[int]], baseline: str,
           candidate: str) -> SpeedUp:
    """`paired_speedup` over the rounds both took part in."""
    return paired_rows(rounds, ids, [baseline], [candidate])


def instance_spread(aa: SpeedUp | None) -> float:
    """How far two instances of one system, loaded apart and timed in the same rounds, differ: |log| of their
    A/A speed-up's median (0.0 for a single instance). Two compiled instances of one OpenVINO model differed by up
    to 4.5% (BERT-base b1 bf16) and 5-9% (GPT-2 small decoding), so one instance per system cannot tell a
    difference that small between systems from luck (studies/peers.py, studies/peers_generate.py)."""
    return 0.0 if aa is None else abs(math.log(aa.median))


def band_verdict(sp: SpeedUp, *spreads: float) -> tuple[float, str]:
    """(band, verdict) of paired speed-up `sp` of one row over another: the tie band is exp of the rows' larger
    instance spread (>= 1); "ahead" when the whole 95% interval is above the band, "behind" when below 1 / band,
    else "tie"."""
    band = math.exp(max(spreads, default=0.0))
    return band, "ahead" if sp.low > band else "behind" if sp.high < 1 / band else "tie"


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
            return Load(wall_s=0.0, loadavg_1m=la, other_cores=None, own_cores=None, cores=usable_cpus())
        stall = _cpu_stall_us()
        pressure = None if stall is None or self._stall0 is None else min(max(stall - self._stall0, 0.0) * 1e-6 / wall,
                                                                          1.0)
        return Load(wall_s=wall, loadavg_1m=la, other_cores=max(busy - own, 0.0) / wall, own_cores=own / wall,
                    cores=usable_cpus(), cpu_pressure=pressure)


def free_cores(sample_s: float = 0.5) -> int:
    """Cores not used by other processes right now (>= 1): this process's CPUs minus the busy CPU time of the
    whole machine over `sample_s` seconds, rounded to the nearest core. Threads beyond this number would
    share a core with another process: OpenMP-style runtimes that wait for all their threads then stall."""
    meter = LoadMeter().start()
    time.sleep(sample_s)
    load = meter.stop()
    other = load.other_cores or 0.0
    return max(1, min(load.cores, int(math.floor(load.cores - other + 0.5))))


def resolve_threads(threads: int) -> int:
    """The one meaning of a thread request in measurements: `threads` as given, or for 0 the cores free now
    (`free_cores`: never more threads than cores other processes leave)."""
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
        raise XDeployError(f"threads must be an integer >= 0 (0 = the cores free now); got {threads!r}")
    return threads or free_cores()


# ------------------------------------------------------------------------------------------ the comparison ----

@dataclass(frozen=True)
class Attempt:
    """One interleaved measurement of every candidate."""

    rounds: dict[str, list[float]]  # name -> per-round call time (s), rounds in order
    calls: dict[str, list[float]]  # name -> every timed call (s), for per-call percentiles
    calls_per_round: dict[str, int]
    load: Load
    # name -> the indices of the rounds it took part in (sequential rounds leave narrow candidates out);
    # a name missing here took part in every round of its list
    round_ids: dict[str, list[int]] = field(default_factory=dict)
    extra_s: float = 0.0  # seconds spent in sequential rounds after `max_seconds`
    # name -> the seconds waited before each of its timed blocks (`wait_idle`: settle_s, then the process's
    # other threads idle); long waits name the candidate timed before as a pool that spins after its calls
    waits: dict[str, list[float]] = field(default_factory=dict)
    # name -> an observer's per-round call time (s), one per round, timed after the round's candidates (`observe`)
    observed: dict[str, list[float]] = field(default_factory=dict)


class Budget:
    """Extra seconds for sequential rounds, shared by the comparisons of one run: each comparison may take a
    share of what is left (`allowance`) and gives back what it did not use (`spend` the seconds it took), so
    comparisons that are narrow early leave the time to the wide ones."""

    def __init__(self, total_s: float, comparisons: int = 1) -> None:
        if total_s < 0 or comparisons < 1:
            raise XDeployError(f"a budget needs total_s >= 0 and comparisons >= 1; got {total_s}, {comparisons}")
        self.total_s, self.comparisons = float(total_s), int(comparisons)
        self.used_s, self.done = 0.0, 0

    @property
    def left_s(self) -> float:
        return max(self.total_s - self.used_s, 0.0)

    def allowance(self) -> float:
        """What the next comparison may spend: three times an even share of what is left (most comparisons
        need none), never more than is left."""
        share = self.left_s / max(self.comparisons - self.done, 1)
        return min(self.left_s, 3.0 * share)

    def spend(self, seconds: float) -> None:
        self.used_s += max(float(seconds), 0.0)
        self.done += 1


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
    round_ids: dict[str, list[int]] = field(default_factory=dict)  # Attempt.round_ids
    wide: tuple[str, ...] = ()  # steady candidates whose interval is wider than the target (quiet machine)
    extra_s: float = 0.0  # seconds of sequential rounds, over every attempt
    waits: dict[str, list[float]] = field(default_factory=dict)  # the kept attempt's Attempt.waits
    observed: dict[str, list[float]] = field(default_factory=dict)  # the kept attempt's Attempt.observed

    def paired(self, baseline: str, candidate: str) -> SpeedUp:
        """Paired speed-up of any two candidates over the rounds both took part in."""
        return paired(self.rounds, self.round_ids, baseline, candidate)

    def verdict(self, name: str) -> str:
        """"ok" (within the target), "wide" (steady, interval wider than the target) or "unstable"."""
        if any(who in (name, self.baseline) for who, _ in self.reasons):
            return "unstable"
        return "wide" if name in self.wide else "ok"

    def stability(self, name: str) -> dict[str, Any]:
        """JSON-ready stability block for one candidate's record: its own verdict (its series, its speed-up
        and the baseline's series), its dispersion, its speed-up and the machine's load."""
        s, sp = self.series[name], self.speedups.get(name)
        mine = [why for who, why in self.reasons if who in (name, self.baseline)]
        return {"stable": not mine, "cause": self.cause if mine else None, "reasons": mine,
                "verdict": self.verdict(name), "wide": name in self.wide and not mine,
                "target": self.thresholds.target, "attempts": self.attempts, "rounds": s.rounds,
                "calls_per_round": s.calls_per_round, "extra_s": self.extra_s,
                "idle_wait_s": float(np.median(self.waits[name])) if self.waits.get(name) else None,
                "rel_iqr": s.rel_iqr, "max_over_min": s.max_over_min,
                "speedup": None if sp is None else {"median": sp.median, "low": sp.low, "high": sp.high,
                                                    "rounds": sp.rounds, "rel_iqr": sp.rel_iqr},
                "baseline": self.baseline, "load": asdict(self.load), "thresholds": asdict(self.thresholds)}


# The longest wait for this process's other threads to go idle before a block (`wait_idle`). onnxruntime's
# intra-op pool spins ~40 ms after a call by default (AMD Zen 4, BERT-base b1: one core, 36-48 ms); 0.5 s leaves
# room for slower pools and still bounds a thread that never sleeps.
IDLE_WAIT_MAX_S = 0.5


def _running_threads(me: int) -> int | None:
    """How many threads of this process other than `me` are running or runnable now (Linux /proc state R);
    None where /proc/self/task cannot be read (another OS)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    n = 0
    for tid in tids:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as fh:
                # "pid (comm) S ...": the comm may hold spaces or parentheses, the state follows the last ")"
                state = fh.read().rsplit(b")", 1)[1].split(None, 1)[0]
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        n += state == b"R"
    return n


def wait_idle(settle_s: float = 0.002, max_s: float = IDLE_WAIT_MAX_S, poll_s: float = 0.001) -> float:
    """Sleep `settle_s`, then until no other thread of this process is running (at most `max_s` in all); the
    seconds waited.

    Why: an engine's pool that keeps spinning after its call returns (onnxruntime's default: ~40 ms of a core)
    takes a core from the block timed next. run_rounds' rotation keeps each candidate's predecessor fixed, so
    a fixed pause shorter than the spin charged one candidate every round: in the embedding study, the row
    timed after an onnxruntime row ran 15-20% slower than alone (docs/benchmarks.md). Waiting for the threads
    themselves costs a non-spinning predecessor nothing beyond `settle_s`."""
    t0 = time.perf_counter()
    time.sleep(settle_s)
    me = threading.get_native_id()
    while time.perf_counter() - t0 < max_s:
        if not _running_threads(me):  # 0, or None: no /proc to ask
            break
        time.sleep(poll_s)
    return time.perf_counter() - t0


def _block(fn: Callable[[], Any], n: int, clock: Callable[[], int] = time.perf_counter_ns) -> list[float]:
    out = []
    for _ in range(n):
        t0 = clock()
        fn()
        out.append((clock() - t0) * 1e-9)
    return out


def _still_wide(rounds: Mapping[str, list[float]], ids: Mapping[str, list[int]], baseline: str,
                target: float) -> list[str]:
    """Candidates whose paired speed-up interval is wider than +-target of its median so far."""
    return [n for n in rounds if n != baseline and paired(rounds, ids, baseline, n).half_width > target]


def run_rounds(calls: Mapping[str, Callable[[], Any]], *, min_rounds: int = 8, max_rounds: int = 40,
               max_seconds: float = 5.0, min_block_s: float = 0.02, warmup: int = 2,
               settle_s: float = 0.002, idle_max_s: float = IDLE_WAIT_MAX_S, baseline: str | None = None,
               target: float | None = None,
               extra_s: float = 0.0, burn_in: int = 0, clock: Callable[[], int] = time.perf_counter_ns,
               observe: Mapping[str, Callable[[], Any]] | None = None) -> Attempt:
    """Warm up every candidate, size its block, then time rotated rounds: at least `min_rounds`, at most
    `max_rounds`, until `max_seconds`. With a `baseline` and a `target`, rounds are sequential: they stop once
    every candidate's paired speed-up interval is within +-target of its median (after `min_rounds`), and where
    some are still wider at `max_seconds` they go on for at most `extra_s` seconds more with only the baseline
    and those candidates. A round's value for a candidate is the median of its block's calls; each block starts
    after `settle_s` of untimed sleep and once the process's other threads are idle (`wait_idle`, at most
    `idle_max_s`; Attempt.waits); `burn_in` rotated rounds of blocks run untimed first (the engines' pools
    then start the timed rounds in the state they keep between blocks). The collector is paused while timing
    (as in latency.measure). `clock` (nanoseconds) times the calls and the span. `observe`: calls timed once a
    round after the candidates, in blocks sized like theirs, that are not compared (no speed-up, no verdict, no
    say in when rounds stop): what the machine gave in the same rounds, e.g. the read bandwidth
    (studies/peers_generate.py's read probe); Attempt.observed."""
    names = list(calls)
    if not names:
        raise XDeployError("nothing to compare")
    if min_rounds < 1 or max_rounds < min_rounds or not max_seconds > 0 or extra_s < 0:
        raise XDeployError(f"need 1 <= min_rounds <= max_rounds, max_seconds > 0 and extra_s >= 0; got "
                           f"{min_rounds}, {max_rounds}, {max_seconds}, {extra_s}")
    sequential = baseline is not None and target is not None and len(names) > 1
    if baseline is not None and baseline not in calls:
        raise XDeployError(f"baseline {baseline!r} is not among the compared: {', '.join(names)}")
    watch = dict(observe or {})
    if set(watch) & set(names):
        raise XDeployError(f"an observer has a candidate's name: {sorted(set(watch) & set(names))}")
    per: dict[str, int] = {}
    for name in names:  # warm-up doubles as calibration: the fastest warm-up call sizes the block
        ts = _block(calls[name], max(warmup, 1), clock)
        per[name] = max(1, math.ceil(min_block_s / max(min(ts), 1e-9)))
    for name, call in watch.items():
        ts = _block(call, max(warmup, 1), clock)
        per[name] = max(1, math.ceil(min_block_s / max(min(ts), 1e-9)))
    observed: dict[str, list[float]] = {n: [] for n in watch}
    for r in range(burn_in):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            wait_idle(settle_s, idle_max_s)
            _block(calls[name], per[name], clock)
    rounds: dict[str, list[float]] = {n: [] for n in names}
    ids: dict[str, list[int]] = {n: [] for n in names}
    samples: dict[str, list[float]] = {n: [] for n in names}
    waits: dict[str, list[float]] = {n: [] for n in names}
    meter = LoadMeter().start()
    t_start = clock()
    t_extra: int | None = None  # when the sequential rounds began
    active = names
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        r = 0
        while r < max_rounds:
            elapsed = (clock() - t_start) * 1e-9
            if r >= min_rounds:
                if not sequential:
                    if elapsed >= max_seconds:
                        break
                else:
                    assert baseline is not None and target is not None
                    wide = _still_wide(rounds, ids, baseline, target)
                    if not wide or elapsed >= max_seconds + extra_s:
                        break  # every interval within the target, or the time (and its extension) spent
                    if elapsed >= max_seconds:  # sequential rounds: the baseline and the wide ones only
                        t_extra = t_extra if t_extra is not None else clock()
                        active = [baseline] + wide
            k = r % len(active)
            for name in active[k:] + active[:k]:  # rotate: each candidate leads equally often
                # untimed: a short pause, then until the previous runtime's threads are idle (onnxruntime's
                # pool spins ~40 ms after a call by default); they would otherwise hold a core while this
                # block runs, a cost the previous candidate's code leaves on this one's calls
                waits[name].append(wait_idle(settle_s, idle_max_s))
                ts = _block(calls[name], per[name], clock)
                rounds[name].append(statistics.median(ts))  # robust to a disturbed call within the block
                ids[name].append(r)
                samples[name].extend(ts)
            for name, call in watch.items():
                wait_idle(settle_s, idle_max_s)
                observed[name].append(statistics.median(_block(call, per[name], clock)))
            r += 1
    finally:
        if was_enabled:
            gc.enable()
    extra = 0.0 if t_extra is None else (clock() - t_extra) * 1e-9
    return Attempt(rounds=rounds, calls=samples, calls_per_round={n: per[n] for n in names}, load=meter.stop(),
                   round_ids=ids, extra_s=extra, waits=waits, observed=observed)


def run_timed_rounds(timers: Mapping[str, Callable[[], Sequence[float]]], *, rounds: int = 7) -> Attempt:
    """Rotated rounds of candidates that time themselves: each call of `timers[name]` is one round of that
    candidate and returns the seconds of each of its timed calls (e.g. a child process that loads a model once,
    warms up and reports its own per-call times, so its start-up is not timed). The round time is their mean
    (unlike `run_rounds`' median of a block: a child's round is a whole timed run); `judge` gives the paired
    speed-ups and the stability verdict."""
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


def loaded(load: Load, t: Thresholds = DEFAULT_THRESHOLDS) -> bool:
    """Other processes used more than `t.other_cores` cores meanwhile: a cause "load", not "noise"."""
    return load.other_cores is not None and load.other_cores > t.other_cores


def oversubscribed(load: Load, t: Thresholds = DEFAULT_THRESHOLDS) -> str | None:
    """Why rounds taken under `load` are no quiet machine's, however steady (None: they may be)."""
    if loaded(load, t) and load.cpu_pressure is not None and load.cpu_pressure > t.cpu_pressure:
        return (f"CPU oversubscribed {load.cpu_pressure:.0%} of the time > {t.cpu_pressure:.0%} while other "
                f"processes used {load.other_cores:.1f} cores")
    return None


def speedup_reasons(sp: SpeedUp, load: Load, t: Thresholds = DEFAULT_THRESHOLDS) -> list[str]:
    """Why a paired speed-up is no figure on its own terms: its paired ratios are dispersed, or its interval is
    wider than the target while other processes were busy (a busy machine's, not a quiet machine's, figure)."""
    out = [f"paired ratios IQR {sp.rel_iqr:.0%} of median > {t.series_rel_iqr:.0%}"] \
        if sp.rel_iqr > t.series_rel_iqr else []
    if loaded(load, t) and sp.half_width > t.target:
        out.append(f"speed-up 95% interval {sp.low:.2f}-{sp.high:.2f} is wider than +-{t.target:.0%} of its "
                   f"median while other processes used {load.other_cores:.1f} cores")
    return out


def judge(attempt: Attempt, baseline: str | None, thresholds: Thresholds = DEFAULT_THRESHOLDS) -> Comparison:
    """Statistics and the verdict of one attempt (module docstring: unstable, wide, or within the target)."""
    t = thresholds
    series = {n: series_stats(r, attempt.calls_per_round[n]) for n, r in attempt.rounds.items()}
    speedups = {n: paired(attempt.rounds, attempt.round_ids, baseline, n) for n in attempt.rounds
                if baseline is not None and n != baseline}
    reasons = [(n, f"{n}: round times IQR {s.rel_iqr:.0%} of median > {t.series_rel_iqr:.0%}")
               for n, s in series.items() if s.rel_iqr > t.series_rel_iqr]
    reasons += [(n, f"{n}: {why}") for n, sp in speedups.items() for why in speedup_reasons(sp, attempt.load, t)]
    wide = [n for n, sp in speedups.items() if sp.half_width > t.target]
    why = oversubscribed(attempt.load, t)
    if why:  # steady rounds, but not a quiet machine's
        reasons += [(n, why) for n in ([baseline] if baseline is not None else list(attempt.rounds))]
    cause = None if not reasons else ("load" if loaded(attempt.load, t) else "noise")
    flagged = {who for who, _ in reasons}
    return Comparison(baseline=baseline, series=series,
                      latency={n: summarize(c) for n, c in attempt.calls.items()}, speedups=speedups,
                      load=attempt.load, stable=not reasons, reasons=tuple(reasons), cause=cause,
                      attempts=1, thresholds=thresholds, rounds=attempt.rounds, round_ids=attempt.round_ids,
                      wide=tuple(n for n in wide if n not in flagged), extra_s=attempt.extra_s, waits=attempt.waits,
                      observed=attempt.observed)


def pair_reasons(sp: SpeedUp, cmp: Comparison) -> list[str]:
    """Why `sp`, the paired speed-up of one row over another that were timed in `cmp`'s rounds (neither need be
    its baseline), is no figure; empty: it is one.

    It is judged as what it is, the ratio of two rows timed side by side in the same rounds: by the dispersion of
    those ratios and by the machine's load, as `judge` judges a speed-up over the baseline, but not by either
    row's round times over the whole run (drift that both rows share and the pairing cancels) nor by the
    baseline's, which is not in this comparison. In the peers studies a peer verdict had inherited every one of
    them: on Intel Xeon model 207 the PyTorch row's own dispersion (29% in one run) withheld every peer verdict of
    its workload, however steady the two rows' ratio (docs/benchmarks.md)."""
    why = oversubscribed(cmp.load, cmp.thresholds)
    return speedup_reasons(sp, cmp.load, cmp.thresholds) + ([why] if why else [])


def pair_figure(sp: SpeedUp, cmp: Comparison) -> dict[str, Any]:
    """JSON-ready verdict of `sp`, one row's paired speed-up over another timed in `cmp`'s rounds (`pair_reasons`):
    its median and 95% interval, whether it is a figure (`stable`; else its `cause` and `reasons`), its paired
    ratios' dispersion and whether its interval is wider than the target (`wide`)."""
    reasons = pair_reasons(sp, cmp)
    return {"median": sp.median, "low": sp.low, "high": sp.high, "stable": not reasons,
            "cause": None if not reasons else "load" if loaded(cmp.load, cmp.thresholds) else "noise",
            "reasons": reasons, "rel_iqr": sp.rel_iqr, "wide": sp.half_width > cmp.thresholds.target}


def _badness(c: Comparison) -> float:
    """How far past the thresholds the steadiest attempt is (lower is steadier)."""
    t = c.thresholds
    worst = [s.rel_iqr / t.series_rel_iqr for s in c.series.values()]
    worst += [max(sp.rel_iqr / t.series_rel_iqr, sp.half_width / t.target) for sp in c.speedups.values()]
    return max(worst)


def compare(calls: Mapping[str, Callable[[], Any]], *, baseline: str | None = None, attempts: int = 2,
            thresholds: Thresholds = DEFAULT_THRESHOLDS, log: Callable[[str], None] | None = None,
            sequential: bool = True, extra_s: float = 0.0, **rounds_kw: Any) -> Comparison:
    """Interleaved comparison of prepared zero-argument calls; re-measured while unstable, at most `attempts`
    times in all (the steadiest attempt is kept, and the verdict says whether it is stable). With a baseline,
    rounds are sequential (`run_rounds`: they stop once every interval is within the target, or go on for up to
    `extra_s` seconds past `max_seconds` where some are not); `sequential=False` times a fixed span."""
    if baseline is not None and baseline not in calls:
        raise XDeployError(f"baseline {baseline!r} is not among the compared: {', '.join(calls)}")
    if attempts < 1:
        raise XDeployError(f"attempts must be >= 1, got {attempts}")
    best: Comparison | None = None
    done, extra = 0, 0.0
    seq = {"baseline": baseline, "target": thresholds.target} if sequential and baseline is not None else {}
    while done < attempts:
        done += 1
        c = judge(run_rounds(calls, **seq, extra_s=max(extra_s - extra, 0.0), **rounds_kw), baseline, thresholds)
        extra += c.extra_s
        if c.stable or best is None or _badness(c) < _badness(best):
            best = c
        if c.stable:
            break
        if log and done < attempts:
            log(f"unstable ({c.cause}): {'; '.join(w for _, w in c.reasons)}; measuring again "
                f"({done + 1}/{attempts})")
    assert best is not None
    return replace(best, attempts=done, extra_s=extra)
