"""The memory this process can still allocate: what the system reports available, within a container's limit.

The one reading behind every memory check: example feeds refuse sizes no machine holds (models/spec.py
make_feeds), and the benchmarks' guard adds the configured limit to it (bench/memory.py available_memory)."""

from __future__ import annotations

import math


def cgroup_headroom() -> float | None:
    """memory.max - memory.current of this process's cgroup (v2), where a container limit is set."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            rel = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")), None)
        if rel is None:
            return None
        base = f"/sys/fs/cgroup{rel}"
        with open(f"{base}/memory.max", encoding="ascii") as f:
            mx = f.read().strip()
        if mx == "max":
            return None
        with open(f"{base}/memory.current", encoding="ascii") as f:
            return float(mx) - float(f.read().strip())
    except (OSError, ValueError, IndexError):
        return None


def _meminfo_available() -> float:
    """MemAvailable from /proc/meminfo (where psutil is not installed: the serving environment); unbounded if
    the kernel does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return 1024.0 * float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return math.inf


def system_available() -> float:
    """Bytes new allocations can take: the system's available memory (psutil, else /proc/meminfo) and a
    container's headroom, whichever is smaller."""
    try:
        import psutil
    except ImportError:
        avail = _meminfo_available()
    else:
        avail = float(psutil.virtual_memory().available)
    cg = cgroup_headroom()
    return avail if cg is None else min(avail, cg)
