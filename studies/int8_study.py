"""Static int8: which quantizer, which calibration method, and how fast the Q/DQ graphs run where.

    python -m xdeploy.studies.int8_study --model bert --preset base          # BERT-base b1 s128
    python -m xdeploy.studies.int8_study --model vit --preset base16 --quantizers ort-minmax
    python -m xdeploy.studies.int8_study --model bert --checkpoint DIR --no-speed   # accuracy on real weights

Quantizers (each without the sensitivity search, so the raw quantizers are compared):
  ort-minmax, ort-entropy, ort-percentile   onnxruntime.quantization.quantize_static, QDQ (export/precision.py)
  ort-percentile-u8                        the same with uint8 asymmetric activations (onnxruntime's fast path)
  nncf                                     NNCF's post-training quantization of the ONNX graph (PERFORMANCE
                                           preset = symmetric int8 activations as TensorRT needs, TRANSFORMER
                                           model type: its SmoothQuant and bias correction), same calibration
  dynamic                                  today's onnxruntime dynamic int8 (int8-dynamic)
Accuracy: `xdeploy parity` on ort and ov (worst cosine over outputs and cases; the cases include the exported
maximum length with padded rows, and real text when the artifact has a tokenizer).
Speed: every candidate (fp32 on ort / ov / ov:bf16, each quantizer's artifact on ort / ov / ov:bf16, and an int8
artifact carrying an OpenVINO IR once more on its Q/DQ ONNX graph) in one process, timed in the shared
interleaved harness (bench/interleave.compare: rotated rounds, block medians, speed-ups as the median of paired
round ratios with a 95% interval, re-measured and flagged `unstable (load|noise)` by the same gate as every other
comparison). Baseline: onnxruntime running the dynamic int8 graph. Achieved FLOP/s are the model's analytic
FLOPs / median latency, against the roofline cache's GEMM peak of the candidate's precision at the same thread
count (if one was measured on this machine).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import atomic_write_json

QUANTIZERS = ("ort-minmax", "ort-entropy", "ort-percentile", "ort-percentile-u8", "nncf", "dynamic")


def _artifact(workdir: Path, name: str, build: Any) -> Path:
    out = workdir / name
    if not (out / "manifest.json").exists():
        print(f"building {out} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        build(out)
        print(f"  {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


def _nncf(fp32: Path, out: Path) -> None:
    """The ORT-minmax artifact's layout with model.onnx replaced by NNCF's quantization of the fp32 graph."""
    import onnx

    from xdeploy.core.deps import import_quietly

    nncf = import_quietly("nncf")

    from xdeploy.core.fsutil import atomic_dir
    from xdeploy.export.artifact import MANIFEST, load_artifact, write_manifest_files
    from xdeploy.export.calibration import default_calibration

    art = load_artifact(fp32)
    cal = default_calibration(art.spec, art.tokenizer_dir)
    m = dict(art.manifest)
    with atomic_dir(out, force=True) as tmp:
        for sub in ("reference", "tokenizer"):
            if (art.path / sub).is_dir():
                shutil.copytree(art.path / sub, tmp / sub)
        conversion = {}
        for g in art.spec.graphs:
            proto = onnx.load(str(art.onnx_path(g.name)))
            q = nncf.quantize(proto, nncf.Dataset(cal.samples[g.name]), preset=nncf.QuantizationPreset.PERFORMANCE,
                              model_type=nncf.ModelType.TRANSFORMER, subset_size=len(cal.samples[g.name]))
            onnx.save(q, str(tmp / m["graphs"][g.name]["file"]))
            conversion[g.name] = {"precision": "int8", "format": "qdq", "quantizer": f"nncf {nncf.__version__}",
                                  "calibration": {"method": "nncf default", **cal.record(g.name)}}
        m |= {"precision": "int8", "conversion": conversion}
        write_manifest_files(tmp, m)
        atomic_write_json(tmp / MANIFEST, m)


def build_artifacts(model: str, preset: str | None, checkpoint: str | None, workdir: Path,
                    quantizers: tuple[str, ...]) -> dict[str, Path]:
    from xdeploy import api
    from xdeploy.export.precision import PrecisionOptions

    tag = f"{model}-{preset or 'ckpt'}"
    from xdeploy.export.openvino_ir import available

    # with the OpenVINO IR where openvino is installed, as `xdeploy export` writes fp32 artifacts
    arts = {"fp32": _artifact(workdir, f"{tag}-fp32", lambda o: api.export(
        model, preset=preset, checkpoint=checkpoint, out=o, force=True, openvino_ir=available()))}
    for qn in quantizers:
        if qn == "dynamic":
            build = lambda o: api.convert_artifact(arts["fp32"], o, "int8-dynamic", force=True)  # noqa: E731
        elif qn == "nncf":
            build = lambda o: _nncf(arts["fp32"], o)  # noqa: E731
        else:
            opts = PrecisionOptions(int8_method=qn.removeprefix("ort-").removesuffix("-u8"), int8_sensitivity=False,
                                    int8_activations="uint8" if qn.endswith("-u8") else "int8")
            build = lambda o, opts=opts: api.convert_artifact(arts["fp32"], o, "int8", options=opts,  # noqa: E731
                                                              force=True)
        arts[qn] = _artifact(workdir, f"{tag}-{qn}", build)
    return arts


def accuracy(arts: dict[str, Path], runners: tuple[str, ...], shapes: list[tuple[int, int | None]]
             ) -> dict[str, Any]:
    from xdeploy.export.artifact import load_artifact
    from xdeploy.verify.parity import check_artifact

    out: dict[str, Any] = {}
    for name, path in arts.items():
        rep = check_artifact(load_artifact(path), list(runners), shapes=shapes)
        for r in runners:
            cs = [c for c in rep.checks if c.runner == r]
            out[f"{name}/{r}"] = {"passed": all(c.passed for c in cs),
                                  # None where the runner could not run the graph (its reason is in failures)
                                  "worst_cosine": _finite(min(c.comparison.cosine for c in cs)),
                                  "worst_max_abs": _finite(max(c.comparison.max_abs for c in cs)),
                                  "failures": [f"{c.case} {c.output}: {c.reason}" for c in cs if not c.passed][:3]}
    return out


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def speed(arts: dict[str, Path], cands: list[tuple[str, str, str, dict[str, Any]]], batch: int, seq: int,
          threads: int, max_seconds: float, baseline: str) -> dict[str, Any]:
    """cands: (label, runner spec, artifact key, runner options). Every candidate in one process, timed in the
    shared interleaved harness (bench/interleave.compare: rotated rounds, block medians, paired ratios with
    their 95% interval, the stability verdict incl. CPU pressure), as every other comparison here."""
    from xdeploy.bench.interleave import compare
    from xdeploy.bench.roofline import peak_for
    from xdeploy.deploy.registry import open_runner
    from xdeploy.export.artifact import load_artifact
    from xdeploy.models.registry import get_family
    from xdeploy.models.spec import make_feeds

    fp32 = load_artifact(arts["fp32"])
    graph = fp32.graph()
    sizes = {a: (batch if a == "batch" else seq) for a in fp32.spec.axes}
    feeds = make_feeds(graph, sizes, seed=0)
    flops = get_family(fp32.model).flops(fp32.config, sizes)
    peaks = _peaks()
    runners, calls, formats, skipped, computed = {}, {}, {}, {}, {}
    try:
        for label, spec, key, options in cands:
            try:  # a runtime that cannot load a graph (NNCF's Q/DQ in onnxruntime) is reported, not fatal
                runners[label] = open_runner(spec, load_artifact(arts[key]), threads=threads, **options)
                calls[label] = runners[label].prepare(feeds)
                calls[label]()
            except XDeployError as e:
                runners.pop(label, None)
                calls.pop(label, None)
                skipped[label] = str(e).splitlines()[0][:300]
                continue
            formats[label] = getattr(runners[label], "graph_format", "onnx")
            # what the runner really computes in: `ov:bf16` runs f32 where the CPU has no bf16 (AVX2-only x86)
            computed[label] = runners[label].info().precision
        c = compare(calls, baseline=baseline, max_seconds=max_seconds, log=lambda m: print(m, file=sys.stderr))
    finally:
        for r in runners.values():
            r.close()
    res = {}
    for label, spec, key, _ in cands:
        if label in skipped:
            continue
        lat, sp, st = c.latency[label], c.speedups.get(label), c.stability(label)
        med = c.series[label].median_s
        # % of the peak of the precision actually computed (a bf16 hint computing f32 against the bf16 peak
        # read 2914% on AMD Zen 3)
        prec = "int8" if key != "fp32" else computed[label]
        peak = peak_for(peaks, prec, threads)
        res[label] = {"runner": spec, "artifact": key, "graph_format": formats[label], "p50_ms": lat.p50 * 1e3,
                      "round_median_ms": med * 1e3, "rel_iqr": c.series[label].rel_iqr,
                      "speedup": None if sp is None else {"median": sp.median, "low": sp.low, "high": sp.high},
                      "stable": st["stable"], "cause": st["cause"], "reasons": st["reasons"],
                      "gflops": flops / med / 1e9, "peak_precision": prec,
                      "pct_of_peak": None if not peak else 100.0 * flops / med / peak}
    return {"flops": flops, "sizes": sizes, "results": res, "skipped": skipped, "stable": c.stable, "cause": c.cause,
            "load": c.stability(baseline)["load"], "attempts": c.attempts}


def speed_candidates(arts: dict[str, Path], quantizers: tuple[str, ...]) -> list[tuple[str, str, str, dict]]:
    """fp32 on ort / ov / ov:bf16 (the ov rows on the artifact's IR when it carries one, as `xdeploy run` runs
    them); each quantizer's artifact on ort, ov and ov:bf16 (the hint for the parts left float); an int8
    artifact that carries an OpenVINO IR (NNCF) on ov:bf16 once more on its Q/DQ ONNX graph."""
    from xdeploy.export.artifact import load_artifact

    cands: list[tuple[str, str, str, dict]] = [("ort fp32", "ort", "fp32", {}), ("ov fp32", "ov", "fp32", {}),
                                               ("ov:bf16 fp32", "ov:bf16", "fp32", {})]
    for q in quantizers:
        cands += [(f"ort {q}", "ort", q, {}), (f"ov {q}", "ov", q, {}), (f"ov:bf16 {q}", "ov:bf16", q, {})]
        if load_artifact(arts[q]).manifest.get("openvino", {}).get("graphs") and q != "dynamic":
            cands.append((f"ov:bf16 {q} (Q/DQ ONNX)", "ov:bf16", q, {"format": "onnx"}))
    return cands


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xdeploy.studies.int8_study", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert")
    p.add_argument("--preset")
    p.add_argument("--checkpoint")
    p.add_argument("--quantizers", default=",".join(QUANTIZERS))
    p.add_argument("--workdir", default="artifacts/int8_study")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-seconds", type=float, default=40.0, help="timed seconds per attempt (bench/interleave)")
    p.add_argument("--shapes", default="1x128,3xmax", help="parity shapes for the accuracy part")
    p.add_argument("--no-accuracy", dest="accuracy", action="store_false")
    p.add_argument("--no-speed", dest="speed", action="store_false")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    from xdeploy.studies import machine, machine_line
    from xdeploy.verify.parity import parse_shapes

    try:
        quantizers = tuple(q for q in a.quantizers.split(",") if q)
        bad = [q for q in quantizers if q not in QUANTIZERS]
        if bad:
            raise XDeployError(f"unknown quantizer {bad[0]!r}; expected some of {', '.join(QUANTIZERS)}")
        arts = build_artifacts(a.model, a.preset, a.checkpoint, Path(a.workdir), quantizers)
        report: dict[str, Any] = {"study": "int8_study", "model": a.model, "preset": a.preset,
                                  "checkpoint": a.checkpoint, "machine": machine(), "threads": a.threads}
        if a.accuracy:
            report["accuracy"] = accuracy(arts, ("ort", "ov"), parse_shapes(a.shapes))
            print(json.dumps(report["accuracy"], indent=1), flush=True)
        if a.speed:
            cands = speed_candidates(arts, quantizers)
            baseline = "ort dynamic" if "dynamic" in quantizers else "ort fp32"
            report["speed"] = speed(arts, cands, a.batch, a.seq, a.threads, a.max_seconds, baseline)
            report["speed"]["baseline"] = baseline
            report["speed"]["peaks"] = _peaks()
            _print_speed(report["speed"], a)
    except XDeployError as e:
        print(f"int8_study: error: {e}", file=sys.stderr)
        return e.exit_code
    report["machine_end"] = machine()
    print(machine_line(report["machine"]))
    if a.json:
        atomic_write_json(a.json, report)
    return 0


def _peaks() -> dict[str, float]:
    from xdeploy.bench.roofline import load_peaks

    try:
        return dict(load_peaks())
    except Exception:  # no roofline cache on this machine: report FLOP/s without a percentage
        return {}


def _print_speed(s: dict[str, Any], a: argparse.Namespace) -> None:
    from xdeploy.reports.text import pct_of_peak, speedup, unstable_text

    base = s["baseline"]
    sizes = ", ".join(f"{k} {v}" for k, v in s["sizes"].items())  # the graph's own axes (no seq for ViT)
    print(f"\n{a.model} {a.preset or 'ckpt'} {sizes}, {a.threads} thread(s), interleaved "
          f"rounds (bench/interleave); speed-up = median paired-round ratio vs {base} [95% interval]; "
          f"load: {s['load']}")
    for label, why in s.get("skipped", {}).items():
        print(f"  {label:30s} not run: {why}")
    for label, r in s["results"].items():
        sp = r["speedup"]
        # an unstable figure is shown after its verdict here (a study's log), never in a table
        ratio = speedup(None) if sp is None else (speedup(sp["median"], (sp["low"], sp["high"])) if r["stable"]
                                                  else f"{unstable_text(r['cause'])}: {speedup(sp['median'])}")
        pct = "" if r["pct_of_peak"] is None else \
            f" ({pct_of_peak(r['pct_of_peak'], 1)} of {r['peak_precision']} peak)"
        print(f"  {label:30s} {r['graph_format']:4s} {r['round_median_ms']:8.2f} ms  IQR {100 * r['rel_iqr']:4.1f}%  "
              f"{ratio:28s} {r['gflops']:.0f} GFLOP/s{pct}")


if __name__ == "__main__":
    sys.exit(main())
