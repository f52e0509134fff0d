"""The per-graph pipeline after the torch export (optimize, then precision), and deriving artifacts from an
fp32 artifact without PyTorch:

    convert_artifact("artifacts/bert-fp32", "artifacts/bert-fp16", "fp16")   # = xdeploy convert ... --precision

Both `xdeploy export --precision P` and `xdeploy convert` run `convert_graph`, so an fp16 artifact derived from
an fp32 one is the same graph a direct fp16 export writes (same record in the manifest's `conversion`).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import onnx

from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import atomic_dir, atomic_write_json
from xdeploy.models.spec import ExportSpec, Graph

from . import precision as prec
from .artifact import MANIFEST, load_artifact, write_manifest_files
from .optimize import fused_op_counts, optimize_config, strip_value_info
from .optimize import optimize as run_optimizer


def convert_graph(proto: onnx.ModelProto, precision: str, *, graph: Graph, spec: ExportSpec, model: str,
                  config: Any, optimize: bool = False, opt_level: int = 1,
                  options: prec.PrecisionOptions | None = None) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """fp32 graph -> (optionally optimized) graph at `precision`, and its manifest record."""
    strip_value_info(proto)
    if optimize:
        proto, _ = run_optimizer(proto, model=model, level=opt_level, **optimize_config(config))
    proto, info = prec.convert(proto, precision, graph=graph, spec=spec, options=options)
    info["optimization"] = {"level": opt_level} if optimize else None
    info["fused_ops"] = fused_op_counts(proto)
    return proto, info


def convert_artifact(src: str | Path, out: str | Path, precision: str, *, optimize: bool = False,
                     opt_level: int = 1, options: prec.PrecisionOptions | None = None,
                     force: bool = False) -> Path:
    """Write a new artifact at `precision` (optionally optimized) from an unoptimized fp32 artifact `src`."""
    from .onnx_export import library_versions, save_onnx, set_metadata

    prec.check_precision(precision)
    art = load_artifact(src)
    if art.precision != "fp32" or art.manifest.get("optimized"):
        raise XDeployError(f"{src} is a {art.precision}{' optimized' if art.manifest.get('optimized') else ''} "
                           "artifact; convert needs an unoptimized fp32 artifact (xdeploy export --precision fp32)")
    m: dict[str, Any] = dict(art.manifest)
    out = Path(out)
    if out.resolve() == art.path.resolve():
        raise XDeployError(f"output {out} is the source artifact; choose another --out")
    t0 = time.perf_counter()
    with atomic_dir(out, force=force) as tmp:
        for sub in ("reference", "tokenizer"):
            if (art.path / sub).is_dir():
                shutil.copytree(art.path / sub, tmp / sub)
        conversion: dict[str, Any] = {}
        for graph in art.spec.graphs:
            proto = onnx.load(str(art.onnx_path(graph.name)))
            meta = {p.key.removeprefix("xdeploy."): p.value for p in proto.metadata_props}
            proto, info = convert_graph(proto, precision, graph=graph, spec=art.spec, model=art.model,
                                        config=m["config"], optimize=optimize, opt_level=opt_level, options=options)
            conversion[graph.name] = info
            set_metadata(proto, meta | {"precision": precision, "optimized": optimize})
            save_onnx(proto, tmp / m["graphs"][graph.name]["file"])
        prec.check_requested_nodes(precision, options, conversion)
        m |= {"precision": precision, "optimized": optimize, "conversion": conversion,
              "derived_from": {"path": str(art.path.resolve()), "files": dict(art.manifest["files"])},
              "versions": library_versions(), "export_seconds": round(time.perf_counter() - t0, 3)}
        write_manifest_files(tmp, m)
        atomic_write_json(tmp / MANIFEST, m)
    return out
