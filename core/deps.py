"""Optional dependencies: the one place that says whether a package is installed (without importing it).

Backends and exporters import their optional libraries lazily, where they are used; this answers "can it be
used here?" for the code that chooses (an fp32 export writes the OpenVINO IR only where openvino is installed,
`xdeploy doctor` lists what is missing, the server checks for PyTriton)."""

from __future__ import annotations

import importlib.util


def installed(package: str) -> bool:
    """Whether `package` (an importable top-level name, e.g. "openvino", "nncf", "pytriton") is installed."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken parent package, or a module without a spec
        return False
