"""The per-graph pipeline after the torch export (optimize, then precision), and deriving artifacts from an
fp32 artifact without PyTorch:

    convert_artifact("artifacts/bert-fp32", "artifacts/bert-fp16", "fp16")   # = xdeploy convert ... --precision

Both `xdeploy export --precision P` and `xdeploy convert` run `convert_graph`, so an fp16 artifact derived from
an fp32 one is the same graph a direct fp16 export writes (same record in the manifest's `conversion`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx

from xdeploy.core.errors import XDeployError
from xdeploy.models.spec import ExportSpec, Graph

from . import precision as prec
from .artifact import load_artifact
from .optimize import fused_op_counts, optimize_config, strip_value_info
from .optimize import optimize as run_optimizer
from .writer import write_artifact


def convert_graph(proto: onnx.ModelProto, precision: str, *, graph: Graph, spec: ExportSpec, model: str,
                  config: Any, optimizer: str | None = None, optimize: bool = False, opt_level: int = 1,
                  options: prec.PrecisionOptions | None = None, refine: prec.Refiner | None = None
                  ) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """fp32 graph -> (optionally optimized) graph at `precision`, and its manifest record. `optimizer` is the
    model's declared onnxruntime optimizer type (`Capabilities.optimizer`). `refine`: the measured keep-float
    search (verify/sensitivity.refine, passed by xdeploy/api.py and the pipeline)."""
    strip_value_info(proto)
    if optimize:
        if optimizer is None:
            raise XDeployError(f"model {model!r} declares no onnxruntime optimizer type; export it without --optimize")
        proto, _ = run_optimizer(proto, model_type=optimizer, level=opt_level, **optimize_config(config))
    proto, info = prec.convert(proto, precision, graph=graph, spec=spec, options=options, refine=refine)
    info["optimization"] = {"level": opt_level} if optimize else None
    info["fused_ops"] = fused_op_counts(proto)
    return proto, info


def convert_artifact(src: str | Path, out: str | Path, precision: str, *, optimize: bool = False,
                     opt_level: int = 1, options: prec.PrecisionOptions | None = None,
                     force: bool = False, refine: prec.Refiner | None = None) -> Path:
    """Write a new artifact at `precision` (optionally optimized) from an unoptimized fp32 artifact `src`.
    `refine`: the measured keep-float search (verify/sensitivity.refine; xdeploy.api passes it)."""
    prec.check_precision(precision)
    prec.check_options(options)
    art = load_artifact(src)
    if art.precision != "fp32" or art.manifest.get("optimized"):
        raise XDeployError(f"{src} is a {art.precision}{' optimized' if art.manifest.get('optimized') else ''} "
                           "artifact; convert needs an unoptimized fp32 artifact (xdeploy export --precision fp32)")
    out = Path(out)
    if out.resolve() == art.path.resolve():
        raise XDeployError(f"output {out} is the source artifact; choose another --out")
    options = prec.with_calibration(options, precision, art.spec, art.tokenizer_dir)
    # the source's manifest (its extra sections included) with what this conversion changes
    # (not the OpenVINO IR: it holds the fp32 reference weights, which a converted artifact does not compute with)
    manifest = {k: v for k, v in art.manifest.items()
                if k not in ("files", "versions", "export_seconds", "openvino")}
    ir_graphs = (art.manifest.get("openvino") or {}).get("graphs", {})
    ir_files = {f for g in ir_graphs.values() for f in (g["xml"], g["bin"])}
    manifest |= {"precision": precision, "optimized": optimize, "conversion": {},
                 "derived_from": {"path": str(art.path.resolve()), "files": dict(art.manifest["files"])}}
    optimizer = art.capabilities.optimizer if optimize else None
    with write_artifact(out, manifest, force=force) as w:
        # everything but the graphs carries over: reference weights, tokenizer, any extra section's files
        graph_files = {g["file"] for g in art.manifest["graphs"].values()}
        for rel in art.manifest["files"]:
            if rel not in graph_files and rel.removesuffix(".data") not in graph_files and rel not in ir_files:
                w.add_file(rel, art.path / rel)
        for graph in art.spec.graphs:
            proto = onnx.load(str(art.onnx_path(graph.name)))
            proto, info = convert_graph(proto, precision, graph=graph, spec=art.spec, model=art.model,
                                        config=art.manifest["config"], optimizer=optimizer, optimize=optimize,
                                        opt_level=opt_level, options=options, refine=refine)
            w.manifest["conversion"][graph.name] = info
            w.add_graph(graph.name, proto)
        prec.check_requested_nodes(precision, options, w.manifest["conversion"])
    return out
