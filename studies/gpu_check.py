"""The ready check for the first machine with an NVIDIA GPU (`make gpu-check`).

    python studies/gpu_check.py --preflight        # prints one line naming what is missing, exit 2; silent if ready
    python -m xdeploy.studies.gpu_check --out reports/gpu   # in the GPU env (make gpu-env): the whole check

The whole check runs the `gpu`-marked tests, then `xdeploy run` with the GPU runners on the default
(tiny/small) presets (--smoke) and on the base presets (--full), sampling the GPU's memory with nvidia-smi, then times
the GPU runners interleaved on BERT-base (studies/runner_compare, batch 1 and 8, seq 128), and writes
reports/gpu/verification.md (+ .json): what ran, parity, latency and device memory per runner. A GPU runner this
environment cannot open (no tensorrt package, say) is left out and named with what it lacks; with no NVIDIA
device, or no GPU runner at all, the check stops with one line.

--preflight needs nothing but the standard library (it runs before the GPU env is installed), so this module
imports xdeploy only inside the full check.
"""

from __future__ import annotations

import argparse
import glob
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
# runner_compare candidates per GPU runner: the artifact precisions it is timed on (torch:fp16 runs the fp32
# reference module in half precision); the first available one is the baseline of the ratios
COMPARE = {"ort-cuda": ("ort-cuda", "ort-cuda@fp16"), "trt": ("trt", "trt@fp16"), "ort-trt": ("ort-trt:fp16",),
           "torch:fp16": ("torch:fp16",)}
COMPARE_BATCHES = (1, 8)
# Artifact precisions per preset run. The smoke presets add static Q/DQ int8 (TensorRT's explicit quantization;
# on ort-cuda 33 of 33 tiny-preset parity checks passed with it on an H200, 2026-11-30; fp32, int8 and int8-dynamic
# exported there in 28 s).
# The base presets leave it out: their calibration and sensitivity search take minutes (GPT-2 small: 2 min 41 s on
# 2 Xeon cores, docs/export.md), more than a lease can spare beside fp32 and fp16. int8-dynamic is left out of both:
# TensorRT has no importer for it and onnxruntime's CUDA provider runs its products on the host (docs/runners.md)
PRECISIONS = {"default": "fp32,fp16,int8", "base": "fp32,fp16"}
# --full = the base presets (bert base, gpt small, vit base16, transformer base); it excludes --smoke
PRESET_RUNS = {"default": ["--smoke"], "base": ["--full"]}


def machine_gaps(which: Callable[[str], str | None] = shutil.which,
                 devices: Callable[[str], list[str]] = glob.glob) -> list[str]:
    """What this machine lacks to run GPU code at all (no NVIDIA driver / device)."""
    gaps = []
    if which("nvidia-smi") is None:
        gaps.append("no nvidia-smi on PATH")
    if not devices("/dev/nvidia[0-9]*"):
        gaps.append("no /dev/nvidia0 device")
    return gaps


def runner_gaps(specs: Iterable[str]) -> dict[str, list[str]]:
    """spec -> what this environment lacks to open it ([] = ready): the registry's own check, no backend opened."""
    from xdeploy.deploy.registry import gaps

    return {spec: gaps(spec) for spec in specs}


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
    passed / run and the lowest cosine, p50 latency of the first measured shape, the lowest greedy agreement with
    PyTorch of its KV-cache decoding, and the run's GPU memory peak. An fp32 artifact's cache decoding that leaves
    PyTorch's greedy tokens is a failure (graph parity alone passed on a GPU whose decoding loop was wrong:
    reports/gpu/h200-2026-11-30); reduced precisions may diverge and only show their figure."""
    rows: dict[tuple, dict[str, Any]] = {}
    for r in records:
        if r.get("kind") not in ("parity", "latency", "decode") or r.get("runner", "").split(":")[0] not in runners:
            continue
        key = (r["model"], r.get("preset"), r.get("artifact_precision"), r["runner"])
        row = rows.setdefault(key, {"model": key[0], "preset": key[1], "precision": key[2], "runner": key[3],
                                    "parity_passed": 0, "parity_outputs": 0, "min_cosine": None,
                                    "p50_ms": None, "shape": None, "decode_agreement": None,
                                    "decode_tokens_per_s": None, "decode_ttft_ms": None,
                                    "gpu_memory_peak_mib": peak_mib, "first_failure": None})
        if r["kind"] == "parity":
            row["parity_outputs"] += 1
            row["parity_passed"] += bool(r.get("passed"))
            if not r.get("passed") and row["first_failure"] is None:
                row["first_failure"] = r.get("reason") or f"{r.get('output')}: cosine {r.get('cosine')}"
            if r.get("cosine") is not None:
                row["min_cosine"] = min(r["cosine"], row["min_cosine"] if row["min_cosine"] is not None else 2.0)
        elif r["kind"] == "decode":
            # any KV-cache route: the loop's ("cache", "cache (CUDA graphs)" on ort-cuda) or an engine's
            if r.get("mode") == "recompute" or r.get("agreement") is None:
                continue
            agreement = float(r["agreement"])
            if row["decode_agreement"] is None or agreement < row["decode_agreement"]:
                row["decode_agreement"] = agreement
            if row["decode_tokens_per_s"] is None:  # the first cache-mode run: batch 1 where the run has it
                row["decode_tokens_per_s"] = float(r["tokens_per_s"])
                row["decode_ttft_ms"] = 1e3 * float(r["ttft_s"])
            if agreement < 1.0 and key[2] == "fp32" and row["first_failure"] is None:
                row["first_failure"] = (f"KV-cache decoding: greedy tokens {100 * agreement:.1f}% equal to "
                                        "PyTorch's")
        elif row["p50_ms"] is None:
            row["p50_ms"] = 1e3 * float(r["latency_s"]["p50"])
            row["shape"] = r.get("sizes")
    return list(rows.values())


def render(rows: Sequence[Mapping[str, Any]], tests: Mapping[str, Any], meta: Mapping[str, Any]) -> str:
    from xdeploy.reports.render import markdown_table

    header = ("preset", "model", "artifact", "runner", "parity outputs passed", "min cosine", "p50 ms (shape)",
              "greedy agreement, KV cache (lowest)",
              "KV-cache decode tokens/s (TTFT ms)", "GPU memory peak MiB (nvidia-smi, whole run)", "first failure")
    table = [(r["preset"], r["model"], r["precision"], r["runner"], f"{r['parity_passed']}/{r['parity_outputs']}",
              f"{r['min_cosine']:.6f}" if r["min_cosine"] is not None else "-",
              f"{r['p50_ms']:.3f} ({r['shape']})" if r["p50_ms"] is not None else "-",
              f"{100 * r['decode_agreement']:.1f}%" if r.get("decode_agreement") is not None else "-",
              f"{r['decode_tokens_per_s']:.1f} ({r['decode_ttft_ms']:.2f})" if r.get("decode_tokens_per_s") else "-",
              f"{r['gpu_memory_peak_mib']:.0f}" if r["gpu_memory_peak_mib"] == r["gpu_memory_peak_mib"] else "-",
              r.get("first_failure") or "") for r in rows]
    if not rows:
        table = [("(no record from the GPU runners: see the run logs next to this file)", *[""] * (len(header) - 1))]
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


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "not installed"


def compare_timings(out: Path, candidates: Sequence[str]) -> list[dict[str, Any]]:
    """BERT-base seq 128 at each of COMPARE_BATCHES: the GPU candidates timed interleaved in one process
    (studies/runner_compare, its own JSON kept next to the report); a batch whose run fails keeps its error."""
    if not candidates:
        return []
    found = []
    for batch in COMPARE_BATCHES:
        js = out / f"compare-b{batch}.json"
        cmd = [sys.executable, "-m", "xdeploy.studies.runner_compare", "--preset", "base", "--batch", str(batch),
               "--seq", "128", "--rounds", "15", "--per-round", "10", "--warmup", "20",
               "--workdir", str(out / "artifacts" / "compare"), "--runners", ",".join(candidates), "--json", str(js)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        (out / f"compare-b{batch}.log").write_text(" ".join(cmd) + "\n" + r.stdout + r.stderr)
        if r.returncode == 0 and js.is_file():
            found.append(json.loads(js.read_text()))
        else:
            lines = [s for s in (r.stderr or r.stdout).splitlines() if s.strip()]
            found.append({"batch": batch, "error": lines[-1] if lines else f"exit {r.returncode}"})
    return found


def render_extras(not_run: Mapping[str, Sequence[str]], timings: Sequence[Mapping[str, Any]]) -> str:
    """The runners left out (and why) and the interleaved timings, below the verification table."""
    from xdeploy.studies.runner_compare import render as render_compare

    lines = [""]
    if not_run:
        lines += ["Not run here (what this environment lacks):", ""]
        lines += [f"- `{spec}`: {'; '.join(lack)}" for spec, lack in not_run.items()] + [""]
    for t in timings:
        if "error" in t:
            lines += [f"Timing at batch {t['batch']} failed: {t['error']}", ""]
        else:
            lines += ["Interleaved timing (studies/runner_compare): " + render_compare(t), ""]
    return "\n".join(lines)


def run_json(out: Path, name: str) -> Path:
    """Where preset run `name`'s `xdeploy run --json` outcome goes."""
    return out / f"run-{name}.json"


def run_command(name: str, out: Path, runners: str, models: Sequence[str] = (), skip: Sequence[str] = ()
                ) -> list[str]:
    """The `xdeploy run` of preset run `name` (PRESET_RUNS) with the GPU runners; scaling and the roofline are
    always left out (CPU studies), `skip` leaves out more (bench: the PyTorch reference's CPU rounds, most of a
    base preset's time on a lease)."""
    left_out = ",".join(dict.fromkeys(["scale", "roofline", *skip]))
    return [sys.executable, "-m", "xdeploy.cli", "run", *PRESET_RUNS[name], "--runners", runners,
            "--precision", PRECISIONS[name], *(["--models", ",".join(models)] if models else []),
            "--skip", left_out, "--out", str(out / f"report-{name}"), "--artifacts", str(out / "artifacts"),
            "--json", str(run_json(out, name))]


def full_check(out: Path, runs: Sequence[str] = tuple(PRESET_RUNS), tests: bool = True, timing: bool = True,
               models: Sequence[str] = (), skip: Sequence[str] = ()) -> int:
    from xdeploy.core.fsutil import atomic_write_json, atomic_write_text

    gaps = machine_gaps()
    missing = runner_gaps([*RUNNERS.split(","), "torch:fp16"]) if not gaps else {}
    ready = [spec for spec, lack in missing.items() if not lack]
    if gaps or not ready:
        print(one_line(gaps or sorted({g for lack in missing.values() for g in lack})), file=sys.stderr)
        return 2
    import onnxruntime
    import torch

    out.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parents[1]
    runners = ",".join(r for r in RUNNERS.split(",") if r in ready)
    # --continue-on-collection-errors: a test module needing a package this env lacks (tritonclient, the bundled
    # MiniLM) must not stop the gpu tests of the others; its error still shows in the summary and the exit code
    test_result = {"returncode": 0, "summary": "not run (--no-tests)"}
    if tests:
        t = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                            "--continue-on-collection-errors",
                            f"--junitxml={out / 'gpu-tests.xml'}", str(root / "tests")],
                           capture_output=True, text=True, cwd=root)
        (out / "gpu-tests.log").write_text(t.stdout + t.stderr)
        tail = [s for s in t.stdout.splitlines() if s.strip()]
        test_result = {"returncode": t.returncode, "summary": tail[-1] if tail else "no output"}
    rows: list[dict[str, Any]] = []
    for name in runs:
        js = run_json(out, name)
        cmd = run_command(name, out, runners, models, skip)
        with MemorySampler() as mem:
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
        (out / f"run-{name}.log").write_text(" ".join(cmd) + "\n" + r.stdout + r.stderr)
        # `xdeploy run --json` names the report; its records are in the report's results.json
        results = Path(json.loads(js.read_text())["out"]) / "results.json" if js.is_file() else None
        if results is not None and results.is_file():
            rows += verification_rows(json.loads(results.read_text())["records"], runners.split(","), mem.peak_mib)
    timings = compare_timings(out, [c for spec in ready for c in COMPARE.get(spec, ())]) if timing else []
    meta = {"gpu": _nvidia_smi("name"), "driver": _nvidia_smi("driver_version"),
            "tensorrt": _version("tensorrt"),
            "onnxruntime": onnxruntime.__version__, "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    not_run = {spec: lack for spec, lack in missing.items() if lack}
    text = render(rows, test_result, meta) + render_extras(not_run, timings)
    atomic_write_text(out / "verification.md", text)
    atomic_write_json(out / "verification.json", {"meta": meta, "tests": test_result, "rows": rows,
                                                  "not_run": not_run,
                                                  "timings": timings})
    print(f"gpu-check: wrote {out / 'verification.md'} ({len(rows)} rows; gpu tests: {test_result['summary']})")
    ok = (test_result["returncode"] == 0 and (rows or not runs)
          and all(r["parity_passed"] == r["parity_outputs"] and not r["first_failure"] for r in rows)
          and all("error" not in x for x in timings))
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preflight", action="store_true", help="only say what this machine lacks (one line)")
    ap.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT", "reports/gpu"))
    ap.add_argument("--runs", default=",".join(PRESET_RUNS),
                    help=f"which `xdeploy run`s ({', '.join(PRESET_RUNS)}; empty: none)")
    ap.add_argument("--models", default="",
                    help="the `xdeploy run`s' models (default: every registered one; the base presets of all four "
                         "took over 5.5 min on an H200 machine's 16 cores, mostly export)")
    ap.add_argument("--skip", default="", help="more `xdeploy run` phases to leave out (bench, decode; scale and "
                    "roofline always are). On a 15-minute lease: --skip bench (an H200 machine's smoke run took "
                    "over 200 s with it, GPT-2 small's base run 290 s)")
    ap.add_argument("--no-tests", action="store_true", help="skip the gpu-marked tests")
    ap.add_argument("--no-timing", action="store_true", help="skip the interleaved BERT-base timing")
    a = ap.parse_args(argv)
    runs = [r for r in a.runs.split(",") if r]
    if set(runs) - set(PRESET_RUNS):
        ap.error(f"--runs: expected names among {', '.join(PRESET_RUNS)}")
    if a.preflight:
        gaps = machine_gaps()
        if gaps:
            print(one_line(gaps))
            return 2
        return 0
    skip = [p for p in a.skip.split(",") if p]
    if set(skip) - {"bench", "decode"}:
        ap.error("--skip: expected bench and/or decode")
    return full_check(Path(a.out), runs, tests=not a.no_tests, timing=not a.no_timing,
                      models=[m for m in a.models.split(",") if m], skip=skip)


if __name__ == "__main__":
    sys.exit(main())
