"""Optional dependencies: the one place that says whether a package is installed (without importing it).

Backends and exporters import their optional libraries lazily, where they are used; this answers "can it be
used here?" for the code that chooses (an fp32 export writes the OpenVINO IR only where openvino is installed,
`xdeploy doctor` lists what is missing, the server checks for PyTriton), and imports openvino and nncf with
their usage telemetry off (`import_quietly`)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType


def installed(package: str) -> bool:
    """Whether `package` (an importable top-level name, e.g. "openvino", "nncf", "pytriton") is installed."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken parent package, or a module without a spec
        return False


def missing_package(e: ModuleNotFoundError) -> str | None:
    """The top-level package whose absence raised `e`, or None where `e` names a module of an installed package
    (or of xdeploy): a bug, not a missing dependency. What the CLI says in one line instead of a traceback, e.g.
    `xdeploy bench MODEL` (an export) in a lean environment without PyTorch."""
    top = (e.name or "").partition(".")[0]
    return None if not top or top == "xdeploy" or installed(top) else top


# OpenVINO's converter (openvino.tools.ovc) and nncf send usage telemetry by default (openvino-telemetry, a
# dependency of openvino) unless the user opted out or the environment says CI. On Linux every event forks the
# whole process (a child per event, to time out a network call that may hang), and an export sends several per
# graph: measured ~1 s of CPU per `openvino.convert_model` call of a tiny module (0.3 s in the process, 0.7 s in
# its forked children; 3 calls: 4.2 s of CPU with telemetry, 1.1 s without), more than the conversion itself.
# Both packages fall back to a stub of their own when openvino_telemetry cannot be imported, so xdeploy imports
# them with it hidden (for that import only: a later `import openvino_telemetry` of the user's works).
# XDEPLOY_OV_TELEMETRY=1 leaves their telemetry as they configure it; an openvino or nncf imported before
# xdeploy's first use is left as it is.
TELEMETRY_PACKAGE = "openvino_telemetry"


def import_quietly(package: str) -> ModuleType:
    """`package` ("openvino" or "nncf") imported with its usage telemetry off (see above). Raises ImportError
    as `import` does when it is not installed."""
    if package in sys.modules or TELEMETRY_PACKAGE in sys.modules or os.environ.get("XDEPLOY_OV_TELEMETRY") == "1":
        return importlib.import_module(package)
    sys.modules[TELEMETRY_PACKAGE] = None  # type: ignore[assignment]  # import of it raises ImportError
    try:
        return importlib.import_module(package)
    finally:
        if TELEMETRY_PACKAGE in sys.modules and sys.modules[TELEMETRY_PACKAGE] is None:
            del sys.modules[TELEMETRY_PACKAGE]
