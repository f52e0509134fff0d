"""The ready check for the first machine with an NVIDIA GPU (`make gpu-check`).

    python studies/gpu_check.py --preflight        # prints one line naming what is missing, exit 2; silent if ready
    python -m xdeploy.studies.gpu_check --out reports/gpu   # in the GPU env (make gpu-env): the whole check

The whole check runs the `gpu`-marked tests, then `xdeploy run --smoke --runners trt,ort-cuda,ort-trt` on the
default (tiny/small) presets and on the base presets (--full), sampling the GPU's memory with nvidia-smi, and
writes reports/gpu/verification.md (+ .json): what ran, parity, latency and device memory per runner. That file
is where GPU results go; nothing in this project has run on a GPU before it exists.

--preflight needs nothing but the standard library (it runs before the GPU env is installed), so this module
imports xdeploy only inside the full check.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

RUNNERS = "trt,ort-cuda,ort-trt"
# int8 is left out while `export --precision int8` writes onnxruntime *dynamic* int8, which TensorRT cannot
# import (the trt runner refuses it); add it here once the int8 export writes static Q/DQ graphs (#16)
PRECISIONS = "fp32,fp16"
PRESET_RUNS = {"default": ["--smoke"], "base": ["--smoke", "--full"]}


def machine_gaps(which: Callable[[str], str | None] = shutil.which,
                 devices: Callable[[str], list[str]] = glob.glob) -> list[str]:
    """What this machine lacks to run GPU code at all (no NVIDIA driver / device)."""
    gaps = []
    if which("nvidia-smi") is None:
        gaps.append("no nvidia-smi on PATH")
    if not devices("/dev/nvidia[0-9]*"):
        gaps.append("no /dev/nvidia0 device")
    return gaps


def env_gaps() -> list[str]:
    """What the Python environment lacks (run inside the GPU env)."""
    gaps = []
    if importlib.util.find_spec("tensorrt") is None:
        gaps.append("the tensorrt package is not installed (make gpu-env)")
    try:
        import onnxruntime as ort

        have = ort.get_available_providers()
        for p in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
            if p not in have:
                gaps.append(f"onnxruntime {ort.__version__} lacks {p} (onnxruntime-gpu: make gpu-env)")
    except ImportError:
        gaps.append("onnxruntime(-gpu) is not installed")
    try:
        import torch

        if not torch.cuda.is_available():
            gaps.append(f"torch {torch.__version__} sees no CUDA device")
    except ImportError:
        gaps.append("torch is not installed")
    return gaps


def one_line(gaps: Sequence[str]) -> str:
    return "gpu-check: cannot run here: " + "; ".join(gaps) + " -- nothing was installed or run"


class MemorySampler:
    """Peak GPU memory in use (MiB, whole device, every GPU summed) by polling nvidia-smi: coarse, includes other
    processes; it is the only device-memory figure the report has (latency records measure host memory)."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s, self.peak_mib = period_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True)
            if r.returncode == 0:
                used = sum(float(x) for x in r.stdout.split() if x.strip())
                self.peak_mib = max(self.peak_mib, used)
            self._stop.wait(self.period_s)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def verification_rows(records: Iterable[Mapping[str, Any]], runners: Sequence[str], peak_mib: float
                      ) -> list[dict[str, Any]]:
    """One row per (model, preset, artifact precision, runner) of an `xdeploy run --json` record list: parity cases
    passed / run and the lowest cosine, p50 latency of the first measured shape, and the run's GPU memory peak."""
    rows: dict[tuple, dict[str, Any]] = {}
    for r in records:
        if r.get("kind") not in ("parity", "latency") or r.get("runner", "").split(":")[0] not in runners:
            continue
        key = (r["model"], r.get("preset"), r.get("artifact_precision"), r["runner"])
        row = rows.setdefault(key, {"model": key[0], "preset": key[1], "precision": key[2], "runner": key[3],
                                    "parity_passed": 0, "parity_outputs": 0, "min_cosine": None,
                                    "p50_ms": None, "shape": None, "gpu_memory_peak_mib": peak_mib,
                                    "first_failure": None})
        if r["kind"] == "parity":
            row["parity_outputs"] += 1
            row["parity_passed"] += bool(r.get("passed"))
            if not r.get("passed") and row["first_failure"] is None:
                row["first_failure"] = r.get("reason") or f"{r.get('output')}: cosine {r.get('cosine')}"
            if r.get("cosine") is not None:
                row["min_cosine"] = min(r["cosine"], row["min_cosine"] if row["min_cosine"] is not None else 2.0)
        elif row["p50_ms"] is None:
            row["p50_ms"] = 1e3 * float(r["latency_s"]["p50"])
            row["shape"] = r.get("sizes")
    return list(rows.values())


def render(rows: Sequence[Mapping[str, Any]], tests: Mapping[str, Any], meta: Mapping[str, Any]) -> str:
    from xdeploy.reports.render import markdown_table

    header = ("preset", "model", "artifact", "runner", "parity outputs passed", "min cosine", "p50 ms (shape)",
              "GPU memory peak MiB (nvidia-smi, whole run)", "first failure")
    table = [(r["preset"], r["model"], r["precision"], r["runner"], f"{r['parity_passed']}/{r['parity_outputs']}",
              f"{r['min_cosine']:.6f}" if r["min_cosine"] is not None else "-",
              f"{r['p50_ms']:.3f} ({r['shape']})" if r["p50_ms"] is not None else "-",
              f"{r['gpu_memory_peak_mib']:.0f}", r.get("first_failure") or "") for r in rows]
    if not rows:
        table = [("(no record from the GPU runners: see the run logs next to this file)", *[""] * 8)]
    lines = ["# GPU verification (`make gpu-check`)", "",
             f"Machine: {meta.get('gpu', '?')}; driver {meta.get('driver', '?')}; "
             f"TensorRT {meta.get('tensorrt', '?')}; onnxruntime-gpu {meta.get('onnxruntime', '?')}; "
             f"torch {meta.get('torch', '?')}; {meta.get('date', '')}.",
             "", f"`gpu`-marked tests: {tests.get('summary', 'not run')} (exit {tests.get('returncode', '?')}).", "",
             markdown_table(header, table)]
    return "\n".join(lines) + "\n"


def _nvidia_smi(query: str) -> str:
    r = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                       text=True)
    return "; ".join(r.stdout.split("\n")).strip("; ") if r.returncode == 0 else "?"


def full_check(out: Path) -> int:
    from xdeploy.core.fsutil import atomic_write_json, atomic_write_text

    gaps = machine_gaps() + env_gaps()
    if gaps:
        print(one_line(gaps), file=sys.stderr)
        return 2
    import onnxruntime
    import tensorrt
    import torch

    out.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parents[1]
    t = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                        f"--junitxml={out / 'gpu-tests.xml'}", str(root / "tests")],
                       capture_output=True, text=True, cwd=root)
    (out / "gpu-tests.log").write_text(t.stdout + t.stderr)
    tail = [s for s in t.stdout.splitlines() if s.strip()]
    tests = {"returncode": t.returncode, "summary": tail[-1] if tail else "no output"}
    rows: list[dict[str, Any]] = []
    for name, args in PRESET_RUNS.items():
        js = out / f"run-{name}.json"
        cmd = [str(Path(sys.executable).with_name("xdeploy")), "run", *args, "--runners", RUNNERS,
               "--precisions", PRECISIONS,
               "--skip", "scale,roofline", "--out", str(out / f"report-{name}"),
               "--artifacts", str(out / "artifacts"), "--json", str(js)]
        with MemorySampler() as mem:
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
        (out / f"run-{name}.log").write_text(" ".join(cmd) + "\n" + r.stdout + r.stderr)
        if js.is_file():
            rows += verification_rows(json.loads(js.read_text())["records"], RUNNERS.split(","), mem.peak_mib)
    meta = {"gpu": _nvidia_smi("name"), "driver": _nvidia_smi("driver_version"), "tensorrt": tensorrt.__version__,
            "onnxruntime": onnxruntime.__version__, "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    atomic_write_text(out / "verification.md", render(rows, tests, meta))
    atomic_write_json(out / "verification.json", {"meta": meta, "tests": tests, "rows": rows})
    print(f"gpu-check: wrote {out / 'verification.md'} ({len(rows)} rows; gpu tests: {tests['summary']})")
    ok = t.returncode == 0 and rows and all(r["parity_passed"] == r["parity_outputs"] for r in rows)
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preflight", action="store_true", help="only say what this machine lacks (one line)")
    ap.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT", "reports/gpu"))
    a = ap.parse_args(argv)
    if a.preflight:
        gaps = machine_gaps()
        if gaps:
            print(one_line(gaps))
            return 2
        return 0
    return full_check(Path(a.out))


if __name__ == "__main__":
    sys.exit(main())
