"""Attention lowering and offline optimization, measured side by side in one run (onnxruntime CPU vs eager):

    python -m xdeploy.studies.export_lowering --model bert --preset base --batch 1 --seq 128 [--json FILE]

Variants (one process, same feeds, timed in short blocks interleaved round-robin so drift and other load on
the machine hit every variant alike; each block starts with an untimed call):
    torch            PyTorch eager (sdpa kernel), the reference
    ort/op18         opset 18: attention decomposed into MatMul/Softmax by the dynamo exporter
    ort/op18+opt     the same after onnxruntime offline optimization + transformer fusions (export/optimize.py)
    ort/op23         opset 23: the native ONNX Attention op
    ort/op23+opt     the same, optimized
    ort/op23/fp16, ort/op23/int8   the default opset at the other export precisions (--precisions)

Prints median / p10 / p90 per call in ms and the ratio of each median to torch's; the figures and the decision
they support (DEFAULT_OPSET, DEFAULT_OPTIMIZE in export/onnx_export.py) are in docs/export.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.bench.latency import summarize
from xdeploy.core.errors import XDeployError
from xdeploy.studies import finish, machine, machine_line


def build_variants(model: str, preset: str | None, workdir: Path, *, opsets: Sequence[int] = (18, 23),
                   precisions: Sequence[str] = ("fp16", "int8"), log: Callable[[str], None] = print
                   ) -> dict[str, Path]:
    """Export the fp32 graphs once per opset, derive optimized / other-precision artifacts from them."""
    from xdeploy.export.convert import convert_artifact
    from xdeploy.export.onnx_export import DEFAULT_OPSET, export

    arts: dict[str, Path] = {}
    for opset in opsets:
        t0 = time.perf_counter()
        arts[f"ort/op{opset}"] = export(model, preset=preset, out=workdir / f"op{opset}", opset=opset)
        log(f"  exported opset {opset} in {time.perf_counter() - t0:.1f} s")
        arts[f"ort/op{opset}+opt"] = convert_artifact(arts[f"ort/op{opset}"], workdir / f"op{opset}-opt", "fp32",
                                                      optimize=True)
    base = DEFAULT_OPSET if DEFAULT_OPSET in opsets else opsets[-1]
    for p in precisions:
        arts[f"ort/op{base}/{p}"] = convert_artifact(arts[f"ort/op{base}"], workdir / f"op{base}-{p}", p)
        log(f"  derived {p}")
    return arts


def run(model: str = "bert", preset: str | None = "base", batch: int = 1, seq: int = 128, *, rounds: int = 10,
        block: int = 3, warmup: int = 3, threads: int = 0, opsets: Sequence[int] = (18, 23),
        precisions: Sequence[str] = ("fp16", "int8"), torch_eager: bool = True,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    from xdeploy.deploy.metrics import compare
    from xdeploy.deploy.registry import open_runner
    from xdeploy.export.artifact import load_artifact
    from xdeploy.models.spec import make_feeds, token_sizes

    if rounds < 1 or block < 1 or warmup < 0:
        raise XDeployError(f"need rounds >= 1, block >= 1 and warmup >= 0; got rounds={rounds}, block={block}, "
                           f"warmup={warmup}")
    at_start = machine()  # the load average before the measurement
    with tempfile.TemporaryDirectory(prefix="xdeploy-lowering-") as d:
        arts = build_variants(model, preset, Path(d), opsets=opsets, precisions=precisions, log=log)
        first = load_artifact(next(iter(arts.values())))
        graph = first.graph()
        # every token axis at `seq`, other axes (a KV cache) at their optimization point
        sizes = {a: min(ax.opt, ax.max) for a, ax in first.spec.axes.items()}
        sizes |= token_sizes(first.capabilities, batch, seq)
        feeds = make_feeds(graph, sizes, seed=0, pad=False)
        runners = {}
        if torch_eager:
            runners["torch"] = open_runner("torch", first, threads=threads)
        for name, path in arts.items():
            runners[name] = open_runner("ort", path, threads=threads)
        try:
            calls = {n: r.prepare(feeds) for n, r in runners.items()}
            ref = runners.get("torch", runners[next(iter(arts))]).infer(feeds)
            out0 = graph.outputs[0].name
            parity = {}
            for n, r in runners.items():
                tol = r.artifact.tolerance
                c = compare(ref[out0], r.infer(feeds)[out0], tol)
                conv = r.artifact.manifest.get("conversion", {}).get(graph.name, {})
                parity[n] = {"cosine": c.cosine, "max_abs": c.max_abs, "passed": c.passed,
                             "fused_ops": conv.get("fused_ops", {}),
                             "kept_fp32": len(conv.get("kept_fp32", [])),
                             "amp_kept": [k["node"] for k in conv.get("kept_fp32", []) if k.get("reason") == "amp"]}
            for _ in range(warmup):
                for call in calls.values():
                    call()
            samples: dict[str, list[float]] = {n: [] for n in calls}
            for _ in range(rounds):  # round-robin: each round times every variant in a short block
                for n, call in calls.items():
                    # One untimed call first: the previous variant's thread pool (onnxruntime and OpenMP
                    # worker threads spin-wait after a run) is still burning the cores for a moment.
                    call()
                    for _ in range(block):
                        t0 = time.perf_counter_ns()
                        call()
                        samples[n].append((time.perf_counter_ns() - t0) * 1e-9)
        finally:
            for r in runners.values():
                r.close()
    base = "torch" if torch_eager else next(iter(samples))
    rows = []
    med0 = float(np.median(samples[base]))
    for n, s in samples.items():
        st = summarize(s)
        rows.append({"variant": n, "p50_ms": st.p50 * 1e3, "p10_ms": float(np.percentile(s, 10)) * 1e3,
                     "p90_ms": st.p90 * 1e3, "vs_" + base: st.p50 / med0, "n": st.n} | parity[n])
    return {"model": model, "preset": preset, "sizes": sizes, "rounds": rounds, "block": block,
            "threads": threads,
            "rows": rows, "machine": at_start}


def render(result: dict[str, Any]) -> str:
    from xdeploy.reports.render import markdown_table

    base = next(k for k in result["rows"][0] if k.startswith("vs_"))
    sizes = " ".join(f"{k}={v}" for k, v in result["sizes"].items())
    rows = [(r["variant"], f"{r['p50_ms']:.1f}", f"{r['p10_ms']:.1f}", f"{r['p90_ms']:.1f}", f"{r[base]:.2f}",
             f"{r['cosine']:.6f}") for r in result["rows"]]
    return "\n".join([f"{result['model']} {result['preset']} ({sizes}), {result['rounds']} rounds x "
                      f"{result['block']} calls interleaved", "",
                      markdown_table(["variant", "p50 ms", "p10 ms", "p90 ms", base.replace("_", " "), "cosine vs ref"],
                                     rows), "", machine_line(result["machine"])])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xdeploy.studies.export_lowering", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert")
    p.add_argument("--preset", default="base")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=10, help="round-robin rounds over the variants")
    p.add_argument("--block", type=int, default=3, help="timed calls per variant per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: all cores)")
    p.add_argument("--precisions", default="fp16,int8", help="extra precisions at the default opset ('' for none)")
    p.add_argument("--no-torch", action="store_true", help="skip the eager PyTorch baseline")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    return finish("export_lowering", lambda: run(
        a.model, a.preset, a.batch, a.seq, rounds=a.rounds, block=a.block, warmup=a.warmup, threads=a.threads,
        precisions=[x for x in a.precisions.split(",") if x], torch_eager=not a.no_torch), render, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
