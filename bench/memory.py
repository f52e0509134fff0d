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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xdeploy.core.errors import XDeployError


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


if __name__ == "__main__":
    import sys

    _child_main(sys.argv[1])
