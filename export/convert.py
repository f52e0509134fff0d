"""The per-graph pipeline after the torch export (optimize, then precision), and deriving artifacts from an
fp32 artifact without PyTorch:

    convert_artifact("artifacts/bert-fp32", "artifacts/bert-fp16", "fp16")   # = xdeploy convert ... --precision

Both `xdeploy export --precision P` and `xdeploy convert` run `convert_graph`, so an fp16 artifact derived from
an fp32 one is the same graph a direct fp16 export writes (same record in the manifest's `conversion`).

A static int8 artifact derived from an fp32 artifact that carries an OpenVINO IR also gets an int8 IR: each
graph's fp32 IR quantized by NNCF from the same calibration samples (export/openvino_ir.py `quantize_ir`),
shipped only when the measured check `check_ir` passes (verify/sensitivity.py `check_int8_ir`, passed by
xdeploy/api.py); the manifest's "openvino" section records it, or per graph why it was left out ("skipped"),
in which case the `ov` runner compiles the Q/DQ ONNX graph. An fp16 artifact derived from one gets the same IRs
(the stateful step too) with their weights stored as fp16, an int8-dynamic one with their weights compressed to
int8 by nncf where it is installed (export/openvino_ir.py `compress_irs`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import require_space
from xdeploy.models.spec import ExportSpec, Graph

from . import foreign as foreign_graphs
from . import openvino_ir, saturation
from . import precision as prec
from .artifact import load_artifact
from .attention_layout import attention_3d
from .onnx_graph import default_opset
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
    # each opset-23 Attention fed its (B, T, C) projections, not heads split by Reshape/Transpose pairs: faster on
    # onnxruntime and OpenVINO, the same numbers (export/attention_layout.py)
    heads_3d = attention_3d(proto)
    if optimize:
        if optimizer is None:
            raise XDeployError(f"model {model!r} declares no onnxruntime optimizer type; export it without --optimize")
        proto, _ = run_optimizer(proto, model_type=optimizer, level=opt_level, **optimize_config(config))
    proto, info = prec.convert(proto, precision, graph=graph, spec=spec, options=options, refine=refine)
    info["optimization"] = {"level": opt_level} if optimize else None
    info["fused_ops"] = fused_op_counts(proto)
    info["attention_3d"] = heads_3d
    return proto, info


# check_ir(fp32 proto, int8 xml, graph=, spec=, calibration=, qdq=, kept_float=, reference_ir=) -> record with
# "passed" (and "reason" when not): the measured check of an int8 OpenVINO IR (verify/sensitivity.check_int8_ir)
IrCheck = Callable[..., dict[str, Any]]


def convert_artifact(src: str | Path, out: str | Path, precision: str, *, optimize: bool = False,
                     opt_level: int = 1, options: prec.PrecisionOptions | None = None,
                     force: bool = False, refine: prec.Refiner | None = None,
                     check_ir: IrCheck | None = None, shapes: Any = None,
                     reference: Any = None) -> Path:
    """Write a new artifact at `precision` (optionally optimized) from an unoptimized fp32 artifact `src`.
    `refine`: the measured keep-float search (verify/sensitivity.refine; xdeploy.api passes it). `check_ir`: the
    measured check of an int8 OpenVINO IR (verify/sensitivity.check_int8_ir; xdeploy.api passes it): for static
    int8 from a source that carries an IR, an NNCF-quantized IR is shipped only when it passes (module docstring);
    without `check_ir` none is made.

    `src` may also be another exporter's fp32 ONNX file or directory (export/foreign.py; `shapes`: its --shapes,
    {input: dims}): the new artifact holds the converted graph as model.onnx, the tokenizer under tokenizer/, and
    golden probes from `reference(graph, [feeds])` (onnxruntime CPU fp32 on the source graph: deploy/registry.py
    `reference_outputs`, passed by xdeploy/api.py)."""
    prec.check_precision(precision)
    prec.check_options(options)
    art = load_artifact(src)
    if art.foreign is not None:
        art = foreign_graphs.require_bound(foreign_graphs.bind(art, shapes))
        if reference is None and "probes" not in art.manifest:
            raise XDeployError(f"converting the foreign graph {src} needs its reference for the golden probes "
                               "(xdeploy.api.convert_artifact passes onnxruntime fp32)")
    if art.precision != "fp32" or art.manifest.get("optimized"):
        what = f"{art.precision}{' optimized' if art.manifest.get('optimized') else ''}"
        if art.foreign is not None:  # a user's graph: there is no xdeploy export to redo
            raise XDeployError(f"{src} is an {what} graph; convert needs an fp32 graph (export your model at fp32)")
        raise XDeployError(f"{src} is an {what} artifact; convert needs an unoptimized fp32 artifact "
                           "(xdeploy export --precision fp32)")
    out = Path(out)
    if out.resolve() == art.path.resolve():
        raise XDeployError(f"output {out} is the source artifact; choose another --out")
    options = prec.with_calibration(options, precision, art.spec, art.tokenizer_dir)
    # the source's manifest (its extra sections included) with what this conversion changes
    # (not the OpenVINO IR: it holds the fp32 reference weights, which a converted artifact does not compute with)
    manifest = {k: v for k, v in art.manifest.items()
                if k not in ("files", "versions", "export_seconds", "openvino")}
    ir_graphs = (art.manifest.get("openvino") or {}).get("graphs", {})
    stateful = (art.manifest.get("openvino") or {}).get("stateful")
    ir_files = {f for g in [*ir_graphs.values(), *([stateful] if stateful else [])] for f in (g["xml"], g["bin"])}
    manifest |= {"precision": precision, "optimized": optimize, "conversion": {},
                 "derived_from": {"path": str(art.path.resolve()), "files": dict(art.manifest["files"])}}
    carry: dict[str, str] | None = None  # foreign source: which of its files go where (else all but the graphs)
    if art.foreign is not None:
        manifest, carry = foreign_graphs.converted_manifest(art, manifest)
    optimizer = art.capabilities.optimizer if optimize else None
    # the new artifact is at most the source (its graphs at most as large; the int8 IR at most the fp32 one), and
    # a conversion holds a graph about three times in the temporary directory (saved, pre-processed, converted)
    graph_bytes = [sum(f.stat().st_size for f in (p, p.with_name(p.name + ".data")) if f.is_file())
                   for p in (art.onnx_path(g.name) for g in art.spec.graphs)]
    out_bytes = sum(graph_bytes) if art.foreign is not None else sum(
        (art.path / rel).stat().st_size for rel in art.manifest["files"] if (art.path / rel).is_file())
    require_space({out.absolute().parent: out_bytes, Path(tempfile.gettempdir()): 3 * max(graph_bytes, default=0)},
                  f"converting {src} to {precision}")
    with write_artifact(out, manifest, force=force) as w:
        # everything but the graphs carries over: reference weights, tokenizer, any extra section's files
        graph_files = {g["file"] for g in art.manifest["graphs"].values()}
        for rel in art.manifest["files"]:
            if carry is not None:
                if rel in carry:
                    w.add_file(carry[rel], art.path / rel)
            elif rel not in graph_files and rel.removesuffix(".data") not in graph_files and rel not in ir_files:
                w.add_file(rel, art.path / rel)
        ir_section = _int8_ir_section(art, check_ir) if precision == "int8" and ir_graphs else None
        if precision in openvino_ir.IR_SOURCES and ir_graphs and (precision == "fp16" or openvino_ir.nncf_available()):
            # the same IRs, their weights stored as fp16 (the graphs' rounding) or compressed to int8 by nncf (without
            # nncf an int8-dynamic artifact carries none: the ov runner compiles its ONNX graphs)
            ir_section = openvino_ir.compress_irs(w, art.path, art.manifest["openvino"], precision)
        for graph in art.spec.graphs:
            proto = onnx.load(str(art.onnx_path(graph.name)))
            make_ir = precision == "int8" and ir_section is not None and "reason" not in ir_section
            fp32 = onnx.ModelProto()
            if make_ir:  # the int8 IR's check compares against the fp32 graph (convert_graph edits `proto`)
                fp32.CopyFrom(proto)
            q, info = convert_graph(proto, precision, graph=graph, spec=art.spec, model=art.model,
                                    config=art.manifest["config"], optimizer=optimizer, optimize=optimize,
                                    opt_level=opt_level, options=options, refine=refine)
            if (opset := default_opset(q)) > w.manifest["opset"]:  # static int8 raises an old graph to 13
                info["opset_from"], w.manifest["opset"] = w.manifest["opset"], opset
            w.manifest["conversion"][graph.name] = info
            w.add_graph(graph.name, q)
            if make_ir:
                _add_int8_ir(w, ir_section, art, graph, fp32, q, info, options, check_ir)
        prec.check_requested_nodes(precision, options, w.manifest["conversion"])
        if "probes" not in art.manifest and reference is not None:  # a foreign source: probes from its reference
            from .probes import write_probes

            write_probes(w, art.spec, None, raw=art.capabilities.text is not None,
                         reference=lambda g, feeds: reference(art, g, feeds),
                         reference_name=foreign_graphs.REFERENCE)
        if ir_section is not None:
            w.add_section(openvino_ir.SECTION, ir_section, versions=["openvino"] + (
                ["nncf"] if "quantizer" in ir_section or precision == "int8-dynamic" else []))
    return out


def _int8_ir_section(art: Any, check_ir: IrCheck | None) -> dict[str, Any]:
    """The int8 artifact's "openvino" section before any graph: its settings, or why no IR is made at all."""
    none = {"graphs": {}, "weights": openvino_ir.IR_WEIGHTS["int8"]}
    if not openvino_ir.nncf_available():
        return none | {"reason": "nncf is not installed (pip install 'xdeploy[openvino]')"}
    if check_ir is None:
        return none | {"reason": "no check given (an int8 IR ships only after its measured check; "
                                 "xdeploy.api.convert_artifact runs it)"}
    return {"graphs": {}, "skipped": {}, "source": "nncf.quantize(fp32 artifact's openvino IR)",
            "weights": openvino_ir.IR_WEIGHTS["int8"], "quantizer": f"nncf {openvino_ir.nncf_version()}",
            "preset": openvino_ir.NNCF_PRESET, "model_type": openvino_ir.NNCF_MODEL_TYPE,
            "overflow_fix": openvino_ir.NNCF_OVERFLOW_FIX, "calibration": {}, "check": {}, "saturation": {}}


def _add_int8_ir(w: Any, section: dict[str, Any], art: Any, graph: Any, fp32: onnx.ModelProto,
                 q: onnx.ModelProto, info: dict[str, Any], options: prec.PrecisionOptions,
                 check_ir: IrCheck) -> None:
    """Quantize graph `graph`'s fp32 IR with the Q/DQ graph's calibration samples, write it beside the graphs and
    check it; a failing (or unquantizable) IR is removed again and the reason recorded under "skipped"."""
    from xdeploy.core.deps import import_quietly

    ov = import_quietly("openvino")

    src = art.openvino_ir(graph.name)
    if src is None:
        section["skipped"][graph.name] = "the fp32 artifact carries no IR for this graph"
        return
    cal = options.int8_calibration
    samples = cal.samples[graph.name]
    section["calibration"][graph.name] = cal.record(graph.name)
    try:
        ir = openvino_ir.quantize_ir(src, graph, samples)
    except XDeployError as e:
        section["skipped"][graph.name] = str(e)
        return
    xml = f"{openvino_ir.FOLDER}/{graph.name}.xml"
    files = {"xml": xml, "bin": xml.removesuffix(".xml") + ".bin"}
    ov.save_model(ir, str(w.path(xml)), compress_to_fp16=False)
    # the IR's own proof for AVX2-only x86 (what the ov runner checks again there from the file, not from here)
    section["saturation"][graph.name] = saturation.ir_weight_bound(ir)
    kept = [k["node"] for k in info.get("kept_fp32", [])]
    try:
        record = check_ir(fp32, w.path(xml), graph=graph, spec=art.spec, calibration=samples, qdq=q,
                          kept_float=kept, reference_ir=src)
    except XDeployError as e:  # e.g. OpenVINO refuses to compile it: not shippable, the conversion goes on
        record = {"passed": False, "reason": f"its check could not run: {e}"}
    section["check"][graph.name] = record
    if record.get("passed"):
        section["graphs"][graph.name] = files
    else:  # never ship an IR that failed its check: the ov runner falls back to the Q/DQ ONNX graph
        for rel in files.values():
            w.path(rel).unlink(missing_ok=True)
        section["skipped"][graph.name] = record.get("reason", "failed its check")
