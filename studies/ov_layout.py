"""OpenVINO: the artifact's ONNX graph vs its IR converted from the reference module (export/openvino_ir.py).

    python -m xdeploy.studies.ov_layout --models bert:base,vit:base16,gpt:small,transformer:base [--threads 2]

Per model: one fp32 artifact exported with the IR; the `ov` runner opened on each format (format="onnx" /
"ir") at the f32 and the bf16 hint; the four timed in interleaved rotated rounds (bench/interleave.py) at the
model's opt sizes; printed: median latency, the paired ratio onnx / ir per hint with its 95% interval (>1: the
IR is faster) or "unstable (cause)", and the compiled runtime model's layout op counts (Transpose, Reorder,
Eltwise, FullyConnected) per format, which is where the difference comes from.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LAYOUT_OPS = ("Transpose", "Reorder", "Eltwise", "FullyConnected", "ScaledDotProductAttention", "MatMul")


def op_counts(runner: Any) -> dict[str, int]:
    """Layer types of the compiled (runtime) model, as the CPU plugin executes it (the layout ones)."""
    from xdeploy.studies.ov_ir_ab import layers

    c = layers(runner.compiled)["layers"]
    return {k: c[k] for k in LAYOUT_OPS if c.get(k)}


def run(models: Sequence[str], *, artifacts: Path, threads: int, max_seconds: float) -> list[dict[str, Any]]:
    from xdeploy.bench.interleave import compare
    from xdeploy.bench.suite import apply_thread_env
    from xdeploy.deploy.registry import open_runner
    from xdeploy.export.artifact import load_artifact
    from xdeploy.export.onnx_export import export
    from xdeploy.models.spec import make_feeds

    apply_thread_env()
    rows = []
    for spec in models:
        model, _, preset = spec.partition(":")
        out = artifacts / f"{model}-{preset}-fp32-ir"
        if not (out / "manifest.json").exists():
            export(model, preset=preset or None, out=out, openvino_ir=True, force=True)
        art = load_artifact(out)
        g = art.graph("model")
        feeds = make_feeds(g, {k: a.opt for k, a in art.spec.axes.items()}, seed=0, pad=False)
        feeds = {t.name: feeds[t.name].astype(t.dtype) for t in g.inputs}
        runners = {f"{fmt} {hint}": open_runner(f"ov:{hint}", art, threads=threads, format=fmt)
                   for hint in ("f32", "bf16") for fmt in ("onnx", "ir")}
        cmp = compare({n: r.prepare(feeds) for n, r in runners.items()}, attempts=2, max_seconds=max_seconds)
        for hint in ("f32", "bf16"):
            sp = cmp.paired(f"onnx {hint}", f"ir {hint}")
            t = cmp.thresholds  # the pair's own verdict: both series steady and a narrow paired interval
            stable = sp.half_width <= t.target and sp.rel_iqr <= t.series_rel_iqr and all(
                cmp.series[f"{fmt} {hint}"].rel_iqr <= t.series_rel_iqr for fmt in ("onnx", "ir"))
            rows.append({"model": spec, "hint": hint, "onnx_s": cmp.series[f"onnx {hint}"].median_s,
                         "ir_s": cmp.series[f"ir {hint}"].median_s, "ratio": sp.median, "low": sp.low,
                         "high": sp.high, "stable": stable,
                         "cause": None if stable else
                         ("load" if (cmp.load.other_cores or 0) > t.other_cores else "noise"),
                         "ops_onnx": op_counts(runners[f"onnx {hint}"]), "ops_ir": op_counts(runners[f"ir {hint}"]),
                         "loadavg": cmp.load.loadavg_1m, "other_cores": cmp.load.other_cores})
            r = rows[-1]
            ratio = f"{sp.median:.3f} ({sp.low:.3f}-{sp.high:.3f})" + ("" if stable else f", unstable ({r['cause']})")
            print(f"{spec} {hint}: onnx {r['onnx_s'] * 1e3:.2f} ms, ir {r['ir_s'] * 1e3:.2f} ms, onnx/ir {ratio}; "
                  f"ops onnx {r['ops_onnx']} ir {r['ops_ir']}; load {r['loadavg']:.1f}, other "
                  f"{r['other_cores']:.1f} cores", flush=True)
        for r in runners.values():
            r.close()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="bert:base,vit:base16,gpt:small,transformer:base")
    ap.add_argument("--artifacts", type=Path, default=Path("artifacts/ov-layout"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-seconds", type=float, default=15.0)
    a = ap.parse_args(argv)
    run([m for m in a.models.split(",") if m], artifacts=a.artifacts, threads=a.threads, max_seconds=a.max_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
