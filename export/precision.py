"""Precision conversion of exported fp32 graphs: fp16 with fp32 islands (+ automatic mixed precision), int8.

fp16  `onnxruntime.transformers.float16.convert_float_to_float16`: weights and compute in fp16, graph inputs and
      outputs kept fp32 (`keep_io_types`, so feeds, KV caches and outputs have the same dtypes at every
      precision), overflow-prone ops kept fp32 by op type (`FP16_BLOCK_OPS`, configurable). Then *automatic
      mixed precision*: `bench.layerwise.find_divergence` compares the fp16 graph with the fp32 one node by
      node on example feeds; the first node whose output leaves the fp16 tolerance is kept fp32 and the
      conversion is redone, until the graph is within tolerance (or `amp_max_nodes` nodes were added).
      The native opset-23 `Attention` op converts to fp16 and runs in onnxruntime's CPU kernel (measured).
int8  `onnxruntime.quantization.quantize_dynamic`: int8 weights (per output channel), activations quantized
      at run time (DynamicQuantizeLinear -> MatMulInteger/ConvInteger). Only MatMul and Conv are quantized:
      the quantizer's op registry is keyed by op type alone and would treat the native opset-23 `Attention`
      as com.microsoft.Attention. Sensitive nodes are excluded by name (`int8_exclude`).

Every conversion returns a record for the manifest (`conversion.<graph>`): precision, kept_fp32 nodes
(fp16), excluded/quantized nodes (int8), and the AMP iterations.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from xdeploy.core.errors import XDeployError, one_of
from xdeploy.models.spec import ExportSpec, Graph, Tolerance, make_feeds

EXPORT_PRECISIONS = ("fp32", "fp16", "int8")

# Kept fp32 in fp16 graphs: normalizations and softmax (their sums of squares / exponentials overflow or lose
# the small differences that matter), reductions, and elementwise ops whose fp16 range is easily exceeded.
FP16_BLOCK_OPS: tuple[str, ...] = (
    "LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization", "Softmax", "LogSoftmax",
    "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "ReduceLogSumExp", "ReduceProd",
    "Pow", "Sqrt", "Exp", "Log", "CumSum", "Range",
)
INT8_OP_TYPES: tuple[str, ...] = ("MatMul", "Conv")
FP16_MAX = 65504.0


@dataclass(frozen=True)
class PrecisionOptions:
    fp16_block_ops: tuple[str, ...] = FP16_BLOCK_OPS  # op types kept fp32
    fp16_block_nodes: tuple[str, ...] = ()  # node names kept fp32 (in addition to what AMP finds)
    amp: bool = True  # find diverging nodes layerwise and keep them fp32
    amp_max_nodes: int = 16  # give up (and record it) after keeping this many nodes fp32
    amp_feeds: Mapping[str, np.ndarray] | None = field(default=None, hash=False)  # default: make_feeds
    # onnxruntime providers of the layerwise comparison. On the CPU provider most fp16 nodes have no fp16
    # kernel and run in fp32 between Casts (onnxruntime's InsertCastTransformer), so CPU-side AMP catches
    # fp16 weights/constants out of range and rounding at fp16 boundaries, not fp16 arithmetic overflow inside
    # chains of such nodes; pass ["CUDAExecutionProvider"] on a GPU for real fp16 arithmetic.
    amp_providers: tuple[str, ...] = ("CPUExecutionProvider",)
    int8_per_channel: bool = True
    int8_exclude: tuple[str, ...] = ()  # node names left fp32 in int8 graphs
    int8_op_types: tuple[str, ...] = INT8_OP_TYPES


def check_precision(precision: str) -> None:
    if precision not in EXPORT_PRECISIONS:
        raise one_of("export precision", precision, EXPORT_PRECISIONS)


def convert(proto: onnx.ModelProto, precision: str, *, graph: Graph, spec: ExportSpec,
            options: PrecisionOptions | None = None) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Return the graph at `precision` and a record of what the conversion did (for the manifest)."""
    check_precision(precision)
    options = options or PrecisionOptions()
    if precision == "fp32":
        return proto, {"precision": "fp32", "kept_fp32": []}
    if precision == "fp16":
        feeds = options.amp_feeds if options.amp_feeds is not None else amp_feeds(graph, spec)
        return to_fp16_amp(proto, feeds, spec.tolerances["fp16"], options)
    return to_int8(proto, options)


def amp_feeds(graph: Graph, spec: ExportSpec) -> dict[str, np.ndarray]:
    """Example feeds for the layerwise comparison: batch 2 (one padded row), axes at min(opt, 32)."""
    sizes = {a: min(ax.opt, 32, ax.max) for a, ax in spec.axes.items()} | {"batch": min(2, spec.axes["batch"].max)}
    return make_feeds(graph, sizes, seed=1234)


def type_contrib_outputs(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Give the outputs of com.microsoft (fused) nodes an element type in value_info, in place.

    onnx shape inference does not know contrib ops, so in an optimized graph everything downstream of a fused
    node is untyped and both the float16 converter and the quantizer mis-handle it. The fused ops used here
    (SkipLayerNormalization, BiasGelu, FastGelu, Attention, ...) output their first input's float type, except
    EmbedLayerNormalization's mask_index (int32). onnxruntime's symbolic shape inference would know them
    but fails on the opset-23 Attention op."""
    for _ in range(len(proto.graph.node)):
        if not any(n.domain == "com.microsoft" for n in proto.graph.node):
            return proto
        g = onnx.shape_inference.infer_shapes(proto).graph
        types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
        types |= {t.name: t.data_type for t in g.initializer}
        added = 0
        for n in g.node:
            if n.domain != "com.microsoft":
                continue
            first = onnx.TensorProto.FLOAT if n.op_type == "EmbedLayerNormalization" else types.get(n.input[0])
            for i, o in enumerate(n.output):
                if o and not types.get(o) and first:
                    t = onnx.TensorProto.INT32 if (n.op_type, i) == ("EmbedLayerNormalization", 1) else first
                    proto.graph.value_info.append(onnx.helper.make_tensor_value_info(o, t, None))
                    types[o], added = t, added + 1
        if not added:
            break
    return proto


# ---------------------------------------------------------------------------------------------- fp16 ----

def _dedupe_and_sort(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The float16 converter appends its Cast nodes at the end of the node list (not topologically sorted,
    which onnx.checker rejects) and adds one Cast per (tensor, blocked consumer), so a tensor feeding two
    blocked nodes gets two identical Casts with the same name and output. Drop exact duplicates, then sort."""
    from onnxruntime.transformers.onnx_model import OnnxModel

    seen: set[bytes] = set()
    nodes = []
    for n in proto.graph.node:
        key = n.SerializeToString(deterministic=True)
        if key not in seen:
            seen.add(key)
            nodes.append(n)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    m = OnnxModel(proto)
    m.remove_cascaded_cast_nodes()  # fp16->fp32->fp16 round trips between neighbouring blocked nodes
    m.topological_sort()
    return m.model


def to_fp16(proto: onnx.ModelProto, *, block_ops: Sequence[str] = FP16_BLOCK_OPS,
            block_nodes: Sequence[str] = ()) -> onnx.ModelProto:
    """fp16 weights and compute with fp32 graph I/O; `block_ops` / `block_nodes` stay fp32. `proto` is not
    modified."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    p = onnx.ModelProto()
    p.CopyFrom(proto)
    del p.graph.value_info[:]  # stale exporter shapes/initializer entries: see optimize.strip_value_info
    type_contrib_outputs(p)
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    try:
        q = convert_float_to_float16(p, keep_io_types=True,
                                     op_block_list=sorted(set(DEFAULT_OP_BLOCK_LIST) | set(block_ops)),
                                     node_block_list=list(block_nodes))
    except Exception as e:  # the converter asserts/raises assorted types
        raise XDeployError(f"fp16 conversion failed: {str(e).splitlines()[0] if str(e) else e!r}") from e
    return _dedupe_and_sort(q)


def _float_nodes(proto: onnx.ModelProto) -> dict[str, str]:
    """name -> op_type of nodes with a floating-point tensor input or output (after shape inference);
    these are the nodes whose precision the fp16 conversion decides."""
    p = onnx.ModelProto()
    p.CopyFrom(proto)
    type_contrib_outputs(p)
    g = (onnx.shape_inference.infer_shapes(p) if p.ByteSize() < 2**31 else p).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
    types |= {t.name: t.data_type for t in g.initializer}
    flt = {onnx.TensorProto.FLOAT}
    return {n.name: n.op_type for n in g.node
            if n.op_type not in ("Constant", "Shape") and any(types.get(t) in flt for t in [*n.input, *n.output])}


def to_fp16_amp(proto: onnx.ModelProto, feeds: Mapping[str, np.ndarray], tol: Tolerance,
                options: PrecisionOptions = PrecisionOptions()) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """fp16 with the op block list, then keep diverging nodes fp32 until the graph is within `tol`."""
    # Node names are per artifact, not per graph: names another graph of the artifact has are skipped here
    # (check_requested_nodes rejects names no graph has).
    names = {n.name for n in proto.graph.node}
    requested = [n for n in options.fp16_block_nodes if n in names]
    float_nodes = _float_nodes(proto)
    by_op = [n for n, op in float_nodes.items() if op in options.fp16_block_ops]
    amp: list[dict[str, Any]] = []
    block_nodes = list(requested)
    producer = {o: n for n in proto.graph.node for o in n.output}
    by_name = {n.name: n for n in proto.graph.node}
    consumers: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
    for n in proto.graph.node:
        for i in n.input:
            consumers[i].append(n)
    out = to_fp16(proto, block_ops=options.fp16_block_ops, block_nodes=block_nodes)
    unresolved = None
    if options.amp:
        from xdeploy.verify.layerwise import find_divergence

        while True:
            d = find_divergence(proto, out, dict(feeds), tol, providers=list(options.amp_providers))
            if d is None:
                break
            blocked = set(block_nodes) | set(by_op)
            if d.node not in blocked:
                add = [d.node]  # keep the diverging node fp32
            elif max(abs(d.ref_range[0]), abs(d.ref_range[1])) > FP16_MAX:
                # Already fp32, but its result does not fit fp16: the Cast back to fp16 overflows, so its
                # consumers must stay fp32 too.
                add = [n.name for n in consumers.get(d.output, []) if n.name in float_nodes and n.name not in blocked]
            else:
                # Already fp32: the error comes from its fp16 inputs, so keep their producers fp32.
                add = [producer[i].name for i in by_name[d.node].input
                       if i in producer and producer[i].name in float_nodes and producer[i].name not in blocked]
            record = {"node": d.node, "op_type": d.op_type, "max_abs": d.max_abs, "cosine": d.cosine,
                      "kept_fp32": add}
            if not add or len(block_nodes) + len(add) > len(requested) + options.amp_max_nodes:
                unresolved = record
                break
            amp.append(record)
            block_nodes += add
            out = to_fp16(proto, block_ops=options.fp16_block_ops, block_nodes=block_nodes)
    kept = sorted(set(by_op) | set(block_nodes))
    info: dict[str, Any] = {
        "precision": "fp16", "io_dtype": "float32", "block_ops": list(options.fp16_block_ops),
        "kept_fp32": [{"node": n, "op_type": float_nodes.get(n, "?"),
                       "reason": "op_block_list" if n in by_op else ("node_block_list" if n in
                                                                     requested else "amp")}
                      for n in kept],
        "amp": {"enabled": options.amp, "providers": list(options.amp_providers),
                "tolerance": {"atol": tol.atol, "rtol": tol.rtol, "cosine": tol.cosine},
                "iterations": amp, "unresolved": unresolved},
        "fp16_nodes": sum(1 for n in float_nodes if n not in kept),
        "requested_nodes_found": requested,
    }
    return out, info


# ---------------------------------------------------------------------------------------------- int8 ----

def to_int8(proto: onnx.ModelProto, options: PrecisionOptions = PrecisionOptions()
            ) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Dynamic int8 quantization of MatMul/Conv weights (per channel), after the quantizer's pre-processing."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    names = {n.name for n in proto.graph.node}
    exclude = [n for n in options.int8_exclude if n in names]  # per artifact, as for fp16_block_nodes
    p = onnx.ModelProto()
    p.CopyFrom(proto)
    del p.graph.value_info[:]
    type_contrib_outputs(p)
    fused = any(n.domain == "com.microsoft" for n in p.graph.node)
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)  # the quantizer warns through the root logger
    large = p.ByteSize() >= 2**31
    with tempfile.TemporaryDirectory(prefix="xdeploy-int8-") as d, contextlib.redirect_stdout(io.StringIO()):
        src, pre, dst = Path(d, "in.onnx"), Path(d, "pre.onnx"), Path(d, "int8.onnx")
        onnx.save_model(p, str(src), save_as_external_data=large, location="in.onnx.data" if large else None)
        try:
            # The docs' recommended pre-processing: onnxruntime basic optimizations + shape inference. Its
            # symbolic shape inference does not know the opset-23 Attention op, so only onnx's is used.
            # An optimized graph skips the pre-processing's optimization pass, which would drop the contrib
            # ops' value_info added above.
            quant_pre_process(str(src), str(pre), skip_symbolic_shape=True, skip_optimization=fused,
                              save_as_external_data=large,
                              all_tensors_to_one_file=True, external_data_location="pre.onnx.data")
            quantize_dynamic(str(pre), str(dst), op_types_to_quantize=list(options.int8_op_types),
                             per_channel=options.int8_per_channel, weight_type=QuantType.QInt8,
                             nodes_to_exclude=exclude, use_external_data_format=large)
        except XDeployError:
            raise
        except Exception as e:
            raise XDeployError(f"int8 quantization failed: {str(e).splitlines()[0] if str(e) else e!r}") from e
        q = onnx.load(str(dst))  # external data (if any) is read into memory before the temp dir goes
    ops = collections.Counter(n.op_type for n in q.graph.node)
    return q, {
        "precision": "int8", "io_dtype": "float32", "method": "dynamic", "weight_type": "int8",
        "per_channel": options.int8_per_channel, "op_types": list(options.int8_op_types),
        "excluded": exclude, "kept_fp32": exclude, "requested_nodes_found": exclude,
        "quantized_ops": {k: ops[k] for k in ("MatMulInteger", "ConvInteger", "DynamicQuantizeLinear") if ops[k]},
    }


def check_requested_nodes(precision: str, options: PrecisionOptions | None, conversion: Mapping[str, Any]) -> None:
    """Reject node names (fp16 block list / int8 exclude list) that no graph of the artifact has."""
    if options is None or precision == "fp32":
        return
    asked = options.fp16_block_nodes if precision == "fp16" else options.int8_exclude
    found = {n for info in conversion.values() for n in info.get("requested_nodes_found", [])}
    missing = [n for n in asked if n not in found]
    if missing:
        what = "fp16 block list" if precision == "fp16" else "int8 exclude list"
        raise XDeployError(f"{what} names nodes no graph has: {', '.join(missing[:3])}; expected node names "
                           "from the fp32 graphs (e.g. onnx.load(...).graph.node[i].name)")
