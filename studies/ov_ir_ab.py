"""The same engine, two IRs: an xdeploy artifact's OpenVINO IR against another tool's IR of the same checkpoint.

    python -m xdeploy.studies.ov_ir_ab ARTIFACT PEER.xml [--hint f32|bf16] [--batch 1] [--seq 128] [--threads 2]

Where `make peers` has an xdeploy `ov` row trailing optimum-intel's OpenVINO row by its median only (`unstable`),
this says whether the IRs differ or the host did: both are compiled with xdeploy's compile properties
(deploy/sessions.py `ov_config`: the precision hint, the thread count, the latency hint), fed the same seeded
inputs (the artifact's feeds, matched to the peer's inputs by name), timed in interleaved rotated rounds
(bench/interleave.py: paired ratios, 95% interval, stability verdict), and their compiled runtime models are
counted by layer type and execution precision, which is where a real difference would show.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError


def layers(compiled: Any) -> dict[str, Any]:
    """Layer types of a compiled model as the CPU plugin runs it, and the execution precision of its compute
    layers (constants, inputs and outputs left out)."""
    ops = [op.get_rt_info() for op in compiled.get_runtime_model().get_ops()]
    kinds = Counter(r["layerType"].astype(str) for r in ops)
    prec = Counter(r["runtimePrecision"].astype(str) for r in ops
                   if r["layerType"].astype(str) not in ("Const", "Input", "Output"))
    return {"layers": dict(kinds.most_common()), "precisions": dict(prec.most_common())}


def run(artifact: Path, peer: Path, *, hint: str, batch: int, seq: int, threads: int,
        max_seconds: float) -> dict[str, Any]:
    import openvino as ov

    from xdeploy.bench.interleave import compare
    from xdeploy.deploy.sessions import ov_compile, ov_config
    from xdeploy.export.artifact import load_artifact
    from xdeploy.models.spec import make_feeds

    art = load_artifact(artifact)
    irs = (art.manifest.get("openvino") or {}).get("graphs", {})
    if "model" not in irs:
        raise XDeployError(f"{artifact} carries no OpenVINO IR of its model graph (export it with the IR)")
    g = art.graph("model")
    sizes = {name: (batch if name == "batch" else seq) for name in art.spec.axes}
    feeds = make_feeds(g, sizes, seed=0, pad=False)
    cfg = ov_config(hint, threads=threads)
    compiled = {"xdeploy": ov_compile(art.path / irs["model"]["xml"], cfg), "peer": ov_compile(peer, cfg)}
    calls = {}
    for name, c in compiled.items():
        want = [i.get_any_name() for i in c.inputs]
        missing = [n for n in want if n not in feeds]
        if missing:
            raise XDeployError(f"{name} IR input(s) {missing} are not among the artifact's inputs {sorted(feeds)}")
        req, inputs = c.create_infer_request(), {n: feeds[n] for n in want}
        calls[name] = lambda req=req, inputs=inputs: req.infer(inputs)
    cmp = compare(calls, baseline="peer", attempts=2, max_seconds=max_seconds)
    sp, verdict = cmp.speedups["xdeploy"], cmp.verdict("xdeploy")
    row = {"artifact": str(artifact), "peer": str(peer), "hint": hint, "sizes": sizes,
           "threads": threads, "openvino": ov.__version__,
           "xdeploy_s": cmp.series["xdeploy"].median_s, "peer_s": cmp.series["peer"].median_s,
           "speedup": sp.median, "low": sp.low, "high": sp.high, "verdict": verdict, "cause": cmp.cause,
           "loadavg": cmp.load.loadavg_1m,
           "other_cores": cmp.load.other_cores} | {f"{k}_compiled": layers(c) for k, c in compiled.items()}
    figure = (f"unstable ({cmp.cause}; median {sp.median:.3f})" if verdict == "unstable"
              else f"{sp.median:.3f} [{sp.low:.3f}-{sp.high:.3f}]{' wide' if verdict == 'wide' else ''}")
    at = " ".join(f"{k} {v}" for k, v in sizes.items())
    print(f"{art.model} ({at}) {hint}: xdeploy {row['xdeploy_s'] * 1e3:.2f} ms, peer "
          f"{row['peer_s'] * 1e3:.2f} ms, peer/xdeploy {figure}; load {row['loadavg']:.1f}, other "
          f"{row['other_cores']:.1f} cores", flush=True)
    for k in compiled:
        print(f"  {k}: {row[f'{k}_compiled']['layers']} {row[f'{k}_compiled']['precisions']}", flush=True)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("peer", type=Path, help="the other tool's IR (.xml)")
    ap.add_argument("--hint", choices=("f32", "bf16"), default="f32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-seconds", type=float, default=15.0)
    ap.add_argument("--json", type=Path, help="append the row as one JSON line")
    a = ap.parse_args(argv)
    try:
        row = run(a.artifact, a.peer, hint=a.hint, batch=a.batch, seq=a.seq, threads=a.threads,
                  max_seconds=a.max_seconds)
    except XDeployError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        with a.json.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
