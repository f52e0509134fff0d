"""Build deploy/cpp once per test process (a no-op when `make cpp` already built it), under the lock `make cpp`
takes, so test_cpp.py, test_tokenizer_exact.py and docs/embedding.md's `make cpp` never build at once."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import onnxruntime

ROOT = Path(__file__).resolve().parents[1]
CPP = ROOT / "deploy" / "cpp"


def build_cpp() -> Path:
    """Configure + build; returns the build directory. Fails, not skips: CI must build it."""
    for tool in ("cmake", "c++"):
        assert shutil.which(tool), f"{tool} is needed to build deploy/cpp (apt-get install cmake g++)"
    build = Path(os.environ.get("XDEPLOY_CPP_BUILD", CPP / "build"))
    lib = next(p for p in sorted((Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so.*"))
               if "providers" not in p.name)
    build.parent.mkdir(parents=True, exist_ok=True)
    with open(build.parent / f".{build.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for cmd in (["cmake", "-S", str(CPP), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                     f"-DORT_LIBRARY={lib}"], ["cmake", "--build", str(build), "-j2"]):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return build
