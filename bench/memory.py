"""Peak host memory of a piece of work, measured in an isolated child process.

Why a child: RSS high-water marks are per process and never go down, so measuring a second model in the same
process would report the first one's peak, and allocator caches (glibc arenas, onnxruntime's arena, torch's
caching) keep memory of earlier runs. A fresh `spawn` child per (runner, config) starts clean.

The work is a module-level function `target(probe, *args)`; it calls `probe.mark("phase")` at phase
boundaries. Each mark records the current RSS and the high-water RSS *since the previous mark*, then resets
the high-water mark (Linux `/proc/self/clear_refs` "5"), so each phase's own peak is known:

    start ──(imports)── "imported" ──(load model)── "loaded" ──(timed runs)── "run"

    weights      = rss(loaded) - rss(imported)     memory the loaded model keeps (weights + runtime state)
    load_peak    = hwm(loaded) - rss(imported)     transient peak while loading (graph optimization copies)
    activations  = hwm(run)    - rss(loaded)       extra memory at the peak of inference

Where the kernel lacks clear_refs the high-water mark cannot be reset and `getrusage` ru_maxrss (peak over
the whole child) is used, so activations may then be under-reported (flagged `hwm_resettable=False`).
GPU device memory is not measured here (no GPU on the machines this ran on): `device_bytes` stays None.
"""

from __future__ import annotations

import os
import re
import resource
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from xdeploy.core.errors import XDeployError
from xdeploy.core.memory import system_available


def _status_kib(field: str) -> float | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return float(m.group(1)) * 1024.0 if m else None


def current_rss() -> float:
    """Resident set size of this process in bytes."""
    rss = _status_kib("VmRSS")
    if rss is None:
        import psutil

        rss = float(psutil.Process().memory_info().rss)
    return rss


def peak_rss() -> float:
    """High-water RSS in bytes since process start or the last reset."""
    hwm = _status_kib("VmHWM")
    return hwm if hwm is not None else float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0


def reset_peak() -> bool:
    """Reset the high-water mark to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Probe:
    """Handed to the target in the child; records (rss, phase peak) at each mark."""

    def __init__(self) -> None:
        self.resettable = reset_peak()
        self.phases: dict[str, dict[str, float]] = {"start": {"rss": current_rss(), "hwm": peak_rss()}}

    def mark(self, phase: str) -> None:
        self.phases[phase] = {"rss": current_rss(), "hwm": peak_rss()}
        reset_peak()


@dataclass(frozen=True)
class MemoryStats:
    """Bytes (floats). See the module docstring for how each is derived."""

    start_rss: float
    weights_bytes: float
    load_peak_bytes: float
    activations_bytes: float
    peak_rss: float  # highest RSS of the child at any time
    hwm_resettable: bool
    device_bytes: float | None = None  # GPU memory; None: no device (CPU run)

    @classmethod
    def from_phases(cls, phases: dict[str, dict[str, float]], resettable: bool) -> MemoryStats:
        p = phases
        base = p.get("imported", p["start"])["rss"]
        loaded = p.get("loaded", p.get("imported", p["start"]))
        run = p.get("run", p.get("end", loaded))
        return cls(start_rss=p["start"]["rss"], weights_bytes=max(0.0, loaded["rss"] - base),
                   load_peak_bytes=max(0.0, loaded["hwm"] - base),
                   activations_bytes=max(0.0, run["hwm"] - loaded["rss"]),
                   peak_rss=max(v["hwm"] for v in p.values()), hwm_resettable=resettable)


def _child_main(result_path: str) -> None:
    """Entry of the child (`python -m xdeploy.bench.memory RESULT`): job pickled on stdin, result to a file."""
    import pickle
    import sys

    probe = Probe()
    target, args = pickle.load(sys.stdin.buffer)
    try:
        out: tuple[Any, ...] = ("ok", target(probe, *args))
        probe.mark("end")
    except XDeployError as e:
        out = ("user", str(e))
    except BaseException:  # report any failure to the parent instead of dying with a bare traceback
        out = ("error", traceback.format_exc(limit=8))
    with open(result_path, "wb") as f:
        pickle.dump((*out, probe.phases, probe.resettable), f)


def run_isolated(target: Callable[..., Any], *args: Any, timeout: float = 1800.0
                 ) -> tuple[Any, dict[str, dict[str, float]], MemoryStats]:
    """Run `target(probe, *args)` in a fresh Python process; return its result, raw phases and MemoryStats.

    `target` must be an importable module-level function and `args` picklable plain data. A subprocess (not
    multiprocessing) so the parent's __main__ is never re-imported (works from pytest, stdin, notebooks).
    A user error raised in the child is re-raised here as XDeployError; a crash (e.g. the OOM killer) or a
    timeout becomes an XDeployError too."""
    import pickle
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="xdeploy-mem-") as tmp:
        result_path = os.path.join(tmp, "result.pkl")
        try:
            proc = subprocess.run([sys.executable, "-m", "xdeploy.bench.memory", result_path],
                                  input=pickle.dumps((target, args)), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise XDeployError(f"isolated benchmark process exceeded {timeout:.0f} s") from None
        if not os.path.exists(result_path):
            tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
            raise XDeployError(f"isolated benchmark process died (exit code {proc.returncode}"
                               f"{'; killed: out of memory?' if proc.returncode < 0 else ''}): {tail[0][:200]}")
        with open(result_path, "rb") as f:
            status, payload, phases, resettable = pickle.load(f)
    if status == "user":
        raise XDeployError(payload)
    if status == "error":
        raise RuntimeError(f"isolated benchmark process failed:\n{payload}")
    return payload, phases, MemoryStats.from_phases(phases, resettable)


# -- a self-contained target: used by the tests and as a sanity check of the probe ----

def allocate(probe: Probe, nbytes: int, keep: bool = True) -> int:
    """Load phase keeps nothing; run phase touches `nbytes` (kept or freed before the mark)."""
    import numpy as np

    if nbytes < 0:
        raise XDeployError(f"nbytes must be >= 0, got {nbytes}")
    probe.mark("imported")
    probe.mark("loaded")
    a = np.ones(int(nbytes) // 8, dtype=np.float64)  # np.ones writes every page, so they become resident
    total = int(a.size)
    if not keep:
        del a
    probe.mark("run")
    return total


# ------------------------------------------------------------------------------------- memory guard ----
# Before a configuration runs, `xdeploy run` estimates its peak from the analytic model below and skips it when
# it would not fit in the memory available, so one too-big configuration cannot take the whole job down.
#
#   peak ≈ runtime + WEIGHT_COPIES · fp32 weights + ACTIVATION_FACTOR · (per-layer activations + scores + outputs)
#
#   per-layer activations = B·T·(4d + d_ff)·4 bytes   (hidden states, q/k/v, the feed-forward intermediate)
#   scores                = 2·B·h·T²·4 bytes          (scores and softmax probabilities, where the lowering
#                                                       materializes them)
#
# with d, d_ff, h as the model's family declares them (models/spec.py Dims) and T the longest of its declared token
# axes (models/spec.py token_axes: an encoder-decoder's source or target length), or the token count its config
# fixes.
#   outputs               = the graph outputs' elements at these sizes · 4 bytes
#
# Calibration (reports/reference, 60 latency records of bert base / gpt small / vit base16 on torch, ort, ov at
# fp32/fp16/int8, this machine): peak RSS minus measured activations was at most 2.7× the fp32 weights (OpenVINO
# int8: dequantized copies) and the import footprint (torch) about 0.22 GiB, so WEIGHT_COPIES = 3 and 0.5 GiB of
# runtime are upper bounds; OpenVINO int8 gpt small at batch 8 measured 1.16 GiB of activations for 0.23 GiB of
# analytic activations + logits, hence ACTIVATION_FACTOR = 4. The estimate is meant to be on the safe side.

RUNTIME_BYTES = 0.5 * 2**30
WEIGHT_COPIES = 3.0
ACTIVATION_FACTOR = 4.0
LIMIT_ENV = "XDEPLOY_MEMORY_LIMIT"  # e.g. "4GiB": the guard treats this as the memory available (tests, CI)
GiB = float(2**30)


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak of one configuration, in bytes (see the formula above)."""

    runtime_bytes: float
    weights_bytes: float  # WEIGHT_COPIES (+ extra copies) × fp32 weights
    activations_bytes: float  # ACTIVATION_FACTOR × (per-layer activations + outputs)
    scores_bytes: float  # ACTIVATION_FACTOR × materialized scores (0 for fused lowerings)
    extra_bytes: float = 0.0  # caller-specific: a KV cache, float64 copies of outputs (parity)

    @property
    def total(self) -> float:
        return self.runtime_bytes + self.weights_bytes + self.activations_bytes + self.scores_bytes + \
            self.extra_bytes


def parse_bytes(text: str | float | int) -> float:
    """'4GiB', '512MiB', '2.5G', '1e9' -> bytes (binary units; a plain number is bytes)."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]?)(i?B?)\s*", text)
        if not m:
            raise XDeployError(f"memory size {text!r} not understood; expected e.g. 4GiB, 512MiB or a byte count")
        value = float(m.group(1)) * 1024 ** "_KMGT".index(m.group(2) or "_")
    if value <= 0:
        raise XDeployError(f"memory size must be positive, got {text!r}")
    return value


def available_memory(limit: float | None = None) -> float:
    """Bytes a new configuration may use: the system's available memory (psutil), a container's headroom, and
    the configured limit (argument, or $XDEPLOY_MEMORY_LIMIT), whichever is smallest."""
    cands = [system_available()]
    if limit is None and os.environ.get(LIMIT_ENV):
        limit = parse_bytes(os.environ[LIMIT_ENV])
    if limit is not None:
        cands.append(float(limit))
    return min(cands)


def room_for_two_more(cost: float, limit: float | None = None) -> bool:
    """Whether two more of something that took `cost` bytes (the most one candidate of an interleaved comparison
    has added so far) still fit, with 1 GiB to spare. Comparisons open their candidates in groups by this rule
    (bench/suite.py compare_child, the main job's decode phase)."""
    return available_memory(limit) >= 2.0 * cost + GiB


def estimate_peak(cfg: Any, sizes: Mapping[str, int], *, weights_fp32_bytes: float, output_elems: float = 0.0,
                  materialized: bool = True, weight_copies: float = WEIGHT_COPIES, extra_bytes: float = 0.0
                  ) -> MemoryEstimate:
    """Peak estimate of one forward of a model with config `cfg` (a registered family's: it declares the sizes)
    at axis `sizes`: the batch and the model's token axes (models/spec.py token_axes; other keys are ignored,
    none given: the token count the config fixes, else 1). `output_elems`: elements of all graph outputs there."""
    from xdeploy.models.registry import family_of
    from xdeploy.models.spec import token_axes

    family = family_of(cfg)
    dims = family.dims(cfg)
    b = int(sizes.get("batch", 1))
    # an encoder-decoder's source and target may differ in length: the longer bounds both stacks' activations
    t = max((int(sizes.get(a) or 0) for a in token_axes(family.capabilities)), default=0) or dims.fixed_tokens or 1
    act = b * t * (4 * dims.width + dims.ffn) * 4.0 + output_elems * 4.0
    scores = 2.0 * b * dims.heads * t * t * 4.0 if materialized else 0.0
    return MemoryEstimate(runtime_bytes=RUNTIME_BYTES, weights_bytes=weight_copies * weights_fp32_bytes,
                          activations_bytes=ACTIVATION_FACTOR * act, scores_bytes=ACTIVATION_FACTOR * scores,
                          extra_bytes=float(extra_bytes))


def output_elems(graph: Any, sizes: Mapping[str, int]) -> float:
    """Elements of every output of `graph` (models/spec.py Graph) at these axis sizes (unknown axes: 1)."""
    total = 0.0
    for t in graph.outputs:
        n = 1.0
        for dim in t.dims:
            n *= dim if isinstance(dim, int) else float(sizes.get(dim, 1))
        total += n
    return total


class MemoryGuard:
    """Decides, per configuration, whether its estimated peak fits in the memory available now."""

    def __init__(self, limit: float | None = None) -> None:
        self.limit = limit

    def available(self) -> float:
        return available_memory(self.limit)

    def check(self, est: MemoryEstimate) -> str | None:
        """None when it fits; otherwise the note the report shows."""
        avail = self.available()
        return None if est.total <= avail else skip_note(est.total, avail)


def _size(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if b >= GiB else f"{b / 2**20:.1f} MiB"


def skip_note(need: float, available: float) -> str:
    """'skipped: needs ≈3.10 GiB, 2.00 GiB available' (MiB below 1 GiB, so close figures stay distinct)."""
    return f"skipped: needs ≈{_size(need)}, {_size(available)} available"


if __name__ == "__main__":
    import sys

    _child_main(sys.argv[1])
