"""Precision conversion of exported fp32 graphs, as pure graph transforms: fp16 with fp32 islands, int8 as
static Q/DQ (the default `int8`) or dynamic (`int8-dynamic`). What to keep in floating point is an input here;
*measuring* it (fp16 automatic mixed precision, int8 sensitivity) is verify/sensitivity.py, which calls these
transforms again with longer keep lists (export/ never imports verify/; `convert(..., refine=...)` takes the
search as a function, and xdeploy/api.py's `export`/`convert_artifact` pass it).

fp16          `onnxruntime.transformers.float16.convert_float_to_float16`: weights and compute in fp16, graph
              inputs and outputs kept fp32 (`keep_io_types`, so feeds, KV caches and outputs have the same dtypes
              at every precision), overflow-prone ops kept fp32 by op type (`FP16_BLOCK_OPS`, configurable) and
              nodes kept fp32 by name. The native opset-23 `Attention` op converts to fp16 and runs in
              onnxruntime's CPU kernel (measured).
int8          `onnxruntime.quantization.quantize_static` in QDQ format (chosen over NNCF by measurement:
              docs/export.md): QuantizeLinear -> DequantizeLinear pairs on the inputs of MatMul / Gemm / Conv
              (ViT's patch embedding), int8 weights symmetric per output channel, int8 activations symmetric
              (zero point 0: what TensorRT's explicit quantization requires; OpenVINO and onnxruntime take it),
              scales from calibration data (export/calibration.py) with a selectable method. Runtimes fuse the
              pairs into int8 kernels (onnxruntime QLinearMatMul/MatMulIntegerToFloat, OpenVINO's oneDNN int8,
              TensorRT strongly typed int8). Nodes named in the keep list stay float.
int8-dynamic  `onnxruntime.quantization.quantize_dynamic`: weights per output channel, activations
              quantized at run time (DynamicQuantizeLinear -> MatMulInteger/ConvInteger). Weight type
              (`int8_dynamic_weights`, default "auto"): a decoding step's graph (`Graph.decode_step`) gets uint8
              weights with a zero point per channel, which onnxruntime multiplies as uint8 x uint8 (MLAS U8U8,
              widened to int16 before pairs are added on every x86 class): all 8 bits, exact on AVX2-only CPUs
              too, and as fast there, since a step reads its weights rather than computes (GPT-2 small decode,
              Zen 3: same tokens/s; a 7-bit trained tiny decoder left the fp32 greedy path at its second token,
              the uint8 one at its 16th). Other graphs keep int8 weights of `int8_weight_bits` (U8S8: its AVX2
              kernel saturates 8-bit weights, export/saturation.py), because U8U8 is slower where the
              arithmetic bounds the time (MiniLM b8 x 128 on Zen 3: 0.83x). Only onnxruntime has fast kernels
              for it (OpenVINO runs MatMulInteger at its fp32 rate; TensorRT cannot build it).

Only MatMul, Gemm and Conv are quantized: onnxruntime's quantizer registry is keyed by op type alone and would
treat the native opset-23 `Attention` as com.microsoft.Attention.

Every conversion returns a record for the manifest (`conversion.<graph>`): precision, format ("qdq" for static
int8, "integer-ops" for dynamic), kept_fp32 nodes and why, calibration (method, samples, sha256, and how many
activation ranges were measured on this graph or shared from an earlier graph of the artifact), and the
measured search's iterations when one ran.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import logging
import tempfile
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from xdeploy.core.errors import XDeployError, one_of, ort_reason
from xdeploy.models.spec import ARTIFACT_PRECISIONS, ExportSpec, Graph, make_feeds

from . import saturation
from .onnx_graph import TWO_GB, default_opset, proto_size, prune

EXPORT_PRECISIONS = ARTIFACT_PRECISIONS
INT8_PRECISIONS = ("int8", "int8-dynamic")

# Kept fp32 in fp16 graphs: normalizations and softmax (their sums of squares / exponentials overflow or lose
# the small differences that matter), reductions, and elementwise ops whose fp16 range is easily exceeded.
FP16_BLOCK_OPS: tuple[str, ...] = (
    "LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization", "Softmax", "LogSoftmax",
    "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "ReduceLogSumExp", "ReduceProd",
    "Pow", "Sqrt", "Exp", "Log", "CumSum", "Range",
)
INT8_OP_TYPES: tuple[str, ...] = ("MatMul", "Gemm", "Conv")
DYNAMIC_OP_TYPES: tuple[str, ...] = ("MatMul", "Conv")  # quantize_dynamic has no Gemm kernel path
# Calibration methods (onnxruntime.quantization.CalibrationMethod); the default by measurement (docs/export.md).
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
DEFAULT_CALIBRATION_METHOD = "percentile"
ACTIVATION_TYPES = ("int8", "uint8")
INT8_WEIGHT_BITS = (7, 8)
# int8-dynamic's weights; auto: uint8 for decode steps; blocks: 8-bit blocks (MatMulNBits) for decode steps
DYNAMIC_WEIGHT_TYPES = ("auto", "uint8", "int8", "blocks")
# "blocks": onnxruntime's MatMulNBits at 8 bits, symmetric, one scale per BLOCK_SIZE weights along K, activations
# quantized to int8 per block at run time (accuracy_level 4: MLAS's SQ8BitGemm kernels). 256 by measurement (GPT-2
# small decoding, Zen 4, against int8-dynamic: a token 1.53x faster at 256, 1.47x at 128, 0.99x at 32; a 32-token
# prompt 0.87x, 0.79x, 0.67x; docs/benchmarks.md).
BLOCK_SIZE = 256
BLOCK_ACCURACY_LEVEL = 4
FP16_MAX = 65504.0
# ops through which a constant weight may reach a quantized MatMul/Gemm/Conv (the quantizer's pre-processing
# folds them into one initializer: a tied embedding's Transpose for an lm_head)
WEIGHT_CHAIN_OPS: tuple[str, ...] = ("Transpose", "Reshape", "Cast", "Identity", "Constant")


@dataclass(frozen=True)
class PrecisionOptions:
    fp16_block_ops: tuple[str, ...] = FP16_BLOCK_OPS  # op types kept fp32
    fp16_block_nodes: tuple[str, ...] = ()  # node names kept fp32 (in addition to what AMP finds)
    amp: bool = True  # (verify/sensitivity.py) find diverging nodes layerwise and keep them fp32
    amp_max_nodes: int = 16  # give up (and record it) after keeping this many nodes fp32
    amp_feeds: Mapping[str, np.ndarray] | None = field(default=None, hash=False)  # default: make_feeds
    # onnxruntime providers of the layerwise comparison. On the CPU provider most fp16 nodes have no fp16
    # kernel and run in fp32 between Casts (onnxruntime's InsertCastTransformer), so CPU-side AMP catches
    # fp16 weights/constants out of range and rounding at fp16 boundaries, not fp16 arithmetic overflow inside
    # chains of such nodes; pass ["CUDAExecutionProvider"] on a GPU for real fp16 arithmetic.
    amp_providers: tuple[str, ...] = ("CPUExecutionProvider",)
    int8_per_channel: bool = True
    # int8 weight range: 7 bits (onnxruntime's reduce_range, |w| <= 64) is exact on every x86 CPU; 8 bits is exact
    # only where int8 products accumulate in int32 (VNNI, AMX) and saturates on AVX2-only x86 (export/saturation.py)
    int8_weight_bits: int = 7
    # int8-dynamic's weight type: "uint8" (asymmetric, 8 bits, exact on every x86 class), "int8" (symmetric,
    # `int8_weight_bits` bits), "auto" (uint8 for decode-step graphs, int8 for the rest: module docstring) or
    # "blocks" (8-bit blocks, MatMulNBits, for decode-step graphs, int8 for the rest); static int8 weights are
    # always int8 (symmetric: TensorRT's explicit quantization)
    int8_dynamic_weights: str = "auto"
    int8_exclude: tuple[str, ...] = ()  # node names left float in int8 graphs (in addition to what sensitivity finds)
    int8_op_types: tuple[str, ...] = INT8_OP_TYPES
    int8_method: str = DEFAULT_CALIBRATION_METHOD  # static int8: how activation ranges are chosen
    # static int8 activations: "int8" symmetric (zero point 0: TensorRT's explicit quantization, OpenVINO) or
    # "uint8" asymmetric (onnxruntime's CPU int8 kernels: measured ~2.5x faster there; TensorRT rejects it)
    int8_activations: str = "int8"
    int8_calibration: Any = field(default=None, hash=False)  # a calibration.Calibration; default: the model's set
    int8_calibration_file: str | None = None  # text lines / .npy / .npz (export/calibration.py load_calibration)
    int8_sensitivity: bool = True  # (verify/sensitivity.py) keep the costliest nodes float until within tolerance
    int8_max_excluded: int | None = None  # the sensitivity search's budget per graph (None: a quarter of the nodes)


# refine(fp32 proto, precision, graph=, spec=, options=) -> (proto, record): a measured search (verify/)
Refiner = Callable[..., tuple[onnx.ModelProto, dict[str, Any]]]


def check_precision(precision: str) -> None:
    if precision not in EXPORT_PRECISIONS:
        raise one_of("export precision", precision, EXPORT_PRECISIONS)


def check_options(options: PrecisionOptions | None) -> None:
    if options is not None and options.int8_method not in CALIBRATION_METHODS:
        raise one_of("calibration method", options.int8_method, CALIBRATION_METHODS)
    if options is not None and options.int8_activations not in ACTIVATION_TYPES:
        raise one_of("int8 activation type", options.int8_activations, ACTIVATION_TYPES)
    if options is not None and options.int8_weight_bits not in INT8_WEIGHT_BITS:
        raise one_of("int8 weight bits", options.int8_weight_bits, INT8_WEIGHT_BITS)
    if options is not None and options.int8_dynamic_weights not in DYNAMIC_WEIGHT_TYPES:
        raise one_of("int8-dynamic weight type", options.int8_dynamic_weights, DYNAMIC_WEIGHT_TYPES)


def int8_weights(precision: str, options: PrecisionOptions, graph: Graph | None = None) -> tuple[str, int]:
    """(weight type, bits) of `graph` at an int8 `precision` under `options`: static int8 and int8-dynamic with int8
    weights take `int8_weight_bits`; int8-dynamic's uint8 weights are 8-bit (a bits request with "uint8" asked
    for by name is refused, not ignored: bits are for int8 weights)."""
    kind = options.int8_dynamic_weights
    if kind in ("auto", "blocks"):
        step = graph is not None and graph.decode_step
        kind = ("uint8" if kind == "auto" else "blocks") if step else "int8"
    if precision == "int8-dynamic" and kind == "blocks":
        return "blocks", 8
    if precision == "int8-dynamic" and kind == "uint8":
        if options.int8_dynamic_weights == "uint8" and options.int8_weight_bits != INT8_WEIGHT_BITS[0]:
            raise XDeployError(f"int8 weight bits {options.int8_weight_bits} apply to int8 weights; int8-dynamic's "
                               "uint8 weights are always 8-bit (exact on every x86 CPU); expected the default, or "
                               "int8-dynamic weights 'int8' (--int8-dynamic-weights int8) for int8 weights")
        return "uint8", 8
    return "int8", options.int8_weight_bits


def convert(proto: onnx.ModelProto, precision: str, *, graph: Graph, spec: ExportSpec,
            options: PrecisionOptions | None = None, refine: Refiner | None = None
            ) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Return the graph at `precision` and a record of what the conversion did (for the manifest).

    Without `refine` this is the plain transform (requested keep lists only); with it, the measured search
    `refine(proto, precision, graph=, spec=, options=)` decides (verify/sensitivity.py `refine`)."""
    check_precision(precision)
    options = options or PrecisionOptions()
    check_options(options)
    if precision == "fp32":
        return proto, {"precision": "fp32", "kept_fp32": []}
    if refine is not None:
        return refine(proto, precision, graph=graph, spec=spec, options=options)
    if precision == "fp16":
        return to_fp16_blocked(proto, options)
    if precision == "int8-dynamic":
        q, info = to_int8_dynamic(proto, options, graph=graph)
    else:
        feeds, record = calibration_feeds(graph, spec, options)
        q, info = to_int8_static(proto, feeds, options, calibration_record=record, graph=graph.name)
    info["saturation"] = saturation.record(q, None, weight_bits=info["weight_bits"])
    return q, info


def with_calibration(options: PrecisionOptions | None, precision: str, spec: ExportSpec,
                     tokenizer_dir: Path | None) -> PrecisionOptions:
    """`options` with its Calibration built for a static int8 conversion: from `int8_calibration_file` when
    given, else the default set (tokenized with `tokenizer_dir` when there is one)."""
    import dataclasses

    from .calibration import default_calibration, load_calibration

    options = options or PrecisionOptions()
    if precision != "int8":
        return options
    if options.int8_calibration is not None:  # the caller's set, with this artifact's own (empty) range memo
        return dataclasses.replace(options, int8_calibration=dataclasses.replace(options.int8_calibration,
                                                                                 ranges={}))
    cal = (load_calibration(options.int8_calibration_file, spec, tokenizer_dir) if options.int8_calibration_file
           else default_calibration(spec, tokenizer_dir))
    return dataclasses.replace(options, int8_calibration=cal)


def calibration_feeds(graph: Graph, spec: ExportSpec, options: PrecisionOptions) -> tuple[list, dict[str, Any]]:
    """(feeds, record) of `graph`'s calibration: the options' Calibration, else the default set (no tokenizer:
    a caller with a checkpoint's tokenizer passes its own default_calibration)."""
    from .calibration import default_calibration

    cal = options.int8_calibration or default_calibration(spec)
    return cal.samples[graph.name], cal.record(graph.name)


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
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in m.model.graph.node
           for a in n.attribute):
        # control flow (If / Loop / Scan): OnnxModel's sort sees only a node's explicit inputs, so an If whose
        # branch reads an input the converter cast (`graph_input_cast_0`) could land before that Cast. onnx_ir's
        # sort counts the values a subgraph reads from the outer scope.
        import onnx_ir as ir

        model = ir.from_proto(m.model)
        model.graph.sort()
        return ir.to_proto(model)
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
    g = (onnx.shape_inference.infer_shapes(p) if proto_size(p) < TWO_GB else p).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
    types |= {t.name: t.data_type for t in g.initializer}
    flt = {onnx.TensorProto.FLOAT}
    return {n.name: n.op_type for n in g.node
            if n.op_type not in ("Constant", "Shape") and any(types.get(t) in flt for t in [*n.input, *n.output])}


def fp16_record(proto: onnx.ModelProto, options: PrecisionOptions, block_nodes: Sequence[str],
                amp: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The manifest record of an fp16 conversion with `block_nodes` kept fp32 (plus `options.fp16_block_ops`);
    `amp` is the automatic-mixed-precision search's record (verify/sensitivity.py), None when it did not run."""
    names = {n.name for n in proto.graph.node}
    requested = [n for n in options.fp16_block_nodes if n in names]
    float_nodes = _float_nodes(proto)
    by_op = [n for n, op in float_nodes.items() if op in options.fp16_block_ops]
    kept = sorted(set(by_op) | set(block_nodes) | set(requested))
    return {
        "precision": "fp16", "io_dtype": "float32", "block_ops": list(options.fp16_block_ops),
        "kept_fp32": [{"node": n, "op_type": float_nodes.get(n, "?"),
                       "reason": "op_block_list" if n in by_op else ("node_block_list" if n in
                                                                     requested else "amp")}
                      for n in kept],
        "amp": dict(amp) if amp is not None else {"enabled": False},
        "fp16_nodes": sum(1 for n in float_nodes if n not in kept),
        "requested_nodes_found": requested,
    }


def fp16_graph_info(proto: onnx.ModelProto) -> tuple[dict[str, str], dict[str, onnx.NodeProto],
                                                     dict[str, onnx.NodeProto], dict[str, list[onnx.NodeProto]]]:
    """(float node name -> op type, tensor -> producer, name -> node, tensor -> consumers): what the AMP search
    walks to decide which neighbours to keep fp32."""
    producer = {o: n for n in proto.graph.node for o in n.output}
    by_name = {n.name: n for n in proto.graph.node}
    consumers: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
    for n in proto.graph.node:
        for i in n.input:
            consumers[i].append(n)
    return _float_nodes(proto), producer, by_name, consumers


def to_fp16_blocked(proto: onnx.ModelProto, options: PrecisionOptions = PrecisionOptions(),
                    extra_block_nodes: Sequence[str] = ()) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """fp16 with the op block list, the requested node block list (names this graph has) and
    `extra_block_nodes` kept fp32: a pure graph transform; the measured AMP search is verify/sensitivity.py."""
    names = {n.name for n in proto.graph.node}
    block = [n for n in options.fp16_block_nodes if n in names] + [n for n in extra_block_nodes if n in names]
    out = to_fp16(proto, block_ops=options.fp16_block_ops, block_nodes=block)
    return out, fp16_record(proto, options, block)


# ---------------------------------------------------------------------------------------------- int8 ----

def _prepare(proto: onnx.ModelProto, d: Path) -> tuple[Path, bool]:
    """Save `proto` (value_info stripped, contrib outputs typed) and run the optimization step of the quantizer's
    documented pre-processing (onnxruntime's basic optimizations: constant folding, e.g. GPT's tied lm_head
    Transpose into one weight) into d/pre.onnx; returns (path, whether its weights are external).

    Its other step, onnx shape inference, is left to `quantize_static`, which runs it again on load anyway
    (`load_model_with_shape_infer`): `quant_pre_process` saved and re-read the model three more times around it
    (GPT-2 small: ~14 s per graph with it, 4-9 s without; docs/export.md). An optimization failure is an error
    (`quant_pre_process` logged it and went on with the graph as it was). Symbolic shape inference stays off as
    before: it does not know the opset-23 Attention op."""
    import onnxruntime as ort

    fused = any(n.domain == "com.microsoft" for n in proto.graph.node)
    large = proto_size(proto) >= TWO_GB
    src, pre = d / "in.onnx", d / "pre.onnx"
    # Saved as it is, its value_info swapped out for the save (a copy would be one more model in memory), except
    # when large: saving with external data rewrites the initializers in place, so a copy is saved.
    p = proto
    if large:
        p = onnx.ModelProto()
        p.CopyFrom(proto)
    kept = [onnx.ValueInfoProto.FromString(v.SerializeToString()) for v in p.graph.value_info]
    del p.graph.value_info[:]
    try:
        type_contrib_outputs(p)
        onnx.save_model(p, str(src), save_as_external_data=large, location="in.onnx.data" if large else None)
    finally:
        if p is proto:
            del p.graph.value_info[:]
            p.graph.value_info.extend(kept)
    del p
    if fused:  # an optimized graph is not optimized again: that would drop the contrib ops' value_info added above
        return src, large
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(pre)
    so.log_severity_level = 4  # fatal only, as the runners' sessions (deploy/sessions.py): raised, not logged
    if large:  # the optimized model's weights beside it, not pointing at in.onnx.data
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "pre.onnx.data")
    session = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    del session
    return pre, large


@contextlib.contextmanager
def _quiet() -> Any:
    """The quantizer logs through the root logger and prints progress; neither belongs in our output."""
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        root.setLevel(level)


MAX_HISTOGRAM_BINS = 1 << 20  # percentile calibration: bins of one tensor's |x| histogram (8 MB of int64)
_HISTOGRAM_BLOCK = 1 << 18  # values binned at a time by histogram_on_edges (its temporaries stay in L2)


def histogram_on_edges(a: np.ndarray, edges: np.ndarray) -> np.ndarray | None:
    """The counts of `np.histogram(a, bins=edges)` for 1-D float32 `a` and non-decreasing float32 or float64
    `edges` of nearly equal width, without sorting; None where that does not apply (the caller falls back to
    numpy). (onnxruntime's edges are float32, and float64 in a call that grows them.)

    numpy bins against given edges by sorting every block of 65536 values and searching the edges in it (the
    same for edges that are equal-width in all but rounding, as onnxruntime's grown histograms are); that sort
    was 25 of the 56 s of GPT-2 small's percentile calibration. Here each value's bin is first computed as if the
    edges were exactly uniform, then moved down or up until edges[k] <= x < edges[k + 1] (the last bin also
    takes x == edges[-1]) against the real edges: numpy's definition, so the counts are identical (values
    outside [edges[0], edges[-1]] and NaN count nowhere, as there). Comparisons are in the edges' dtype, as
    numpy's (float32 values compare exactly as float64)."""
    if a.ndim != 1 or a.dtype != np.float32 or edges.ndim != 1 or edges.dtype not in (np.float32, np.float64) \
            or edges.size < 2:
        return None
    nb = edges.size - 1
    lo, hi = edges[0], edges[-1]
    if not float(hi) > float(lo) or bool(np.any(edges[:-1] > edges[1:])):
        return None
    scale, lo32 = np.float32(nb / (float(hi) - float(lo))), np.float32(lo)
    counts = np.zeros(nb, np.intp)
    for start in range(0, a.size, _HISTOGRAM_BLOCK):
        x = a[start:start + _HISTOGRAM_BLOCK]
        x = x[(x >= lo) & (x <= hi)]  # (NaN fails both)
        k = ((x - lo32) * scale).astype(np.intp)  # the bin if the edges were exactly uniform (an estimate)
        np.clip(k, 0, nb - 1, out=k)
        for _ in range(8):  # rounding puts k at most a bin or two off; each pass moves every value one bin
            down = x < edges[k]
            up = (x >= edges[k + 1]) & (k < nb - 1)
            if not (down.any() or up.any()):
                break
            k -= down
            k += up
        else:
            return None
        counts += np.bincount(k, minlength=nb)
    return counts


class _NumpyBinningOnEdges(types.ModuleType):
    """numpy as onnxruntime's calibrate module sees it under `_bounded_histograms`: `histogram` on given edges
    counts with histogram_on_edges (the same counts, no sort); everything else is numpy's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def histogram(a: Any, bins: Any = 10, range: Any = None, density: Any = None, weights: Any = None) -> Any:
        if isinstance(bins, np.ndarray) and range is None and not density and weights is None:
            counts = histogram_on_edges(np.asarray(a), bins)
            if counts is not None:
                return counts, bins
        return np.histogram(a, bins=bins, range=range, density=density, weights=weights)


@contextlib.contextmanager
def _bounded_histograms() -> Any:
    """Bound and speed up onnxruntime's percentile histograms (HistogramCollector.collect_absolute_value,
    onnxruntime 1.31), for the duration of our quantizer call only.

    Bounded: its first sample of a tensor fixes the bin width (|x| max / 2048); a later sample with a larger max
    extends the histogram *at that width*. A tensor whose first sample is nearly zero (the trained tiny GPT has
    one) and whose later samples are not asks for ~1e11 bins ('Unable to allocate 859 GiB'). Before such an
    extension the running histogram is coarsened by merging adjacent bins (counts summed, so every percentile
    keeps its place to within one coarse bin, at most max / 2^19 wide).
    Sped up: every later sample is binned on the running edges by `np.histogram(x, bins=edges)`, which sorts;
    the calibrate module's numpy is swapped for one whose `histogram` counts the same without sorting
    (histogram_on_edges)."""
    from onnxruntime.quantization import calibrate

    cls = calibrate.HistogramCollector
    original = cls.collect_absolute_value
    module_numpy = calibrate.np

    def collect(self: Any, name_to_arr: Mapping[str, Any]) -> Any:
        for tensor, arr in name_to_arr.items():
            if tensor not in self.histogram_dict:
                continue
            a = np.asarray(arr).ravel()
            amax = float(np.nanmax(np.abs(a))) if a.size else 0.0
            hist, edges, lo, hi = self.histogram_dict[tensor]
            width = float(edges[1] - edges[0])
            need = len(hist) + max(0.0, (amax - float(edges[-1])) / width) if width > 0 else 0.0
            if need > MAX_HISTOGRAM_BINS:
                f = int(np.ceil(need / (MAX_HISTOGRAM_BINS // 2)))
                padded = np.concatenate([hist, np.zeros(-len(hist) % f, hist.dtype)])
                merged = padded.reshape(-1, f).sum(axis=1)
                coarse = (float(edges[0]) + np.arange(len(merged) + 1) * width * f).astype(edges.dtype)
                self.histogram_dict[tensor] = (merged, coarse, lo, hi)
        return original(self, name_to_arr)

    cls.collect_absolute_value = collect
    calibrate.np = _NumpyBinningOnEdges("numpy")
    try:
        yield
    finally:
        cls.collect_absolute_value = original
        calibrate.np = module_numpy


def _requested(proto: onnx.ModelProto, names: Sequence[str]) -> list[str]:
    have = {n.name for n in proto.graph.node}
    return [n for n in names if n in have]  # per artifact, as for fp16_block_nodes


def quantizable_nodes(proto: onnx.ModelProto, op_types: Sequence[str] = INT8_OP_TYPES) -> dict[str, str]:
    """name -> op type of the nodes static int8 quantizes: MatMul / Gemm / Conv whose second input is a constant
    weight (an initializer, or one reached through Transpose / Reshape / Cast / Identity, which the quantizer's
    pre-processing folds: GPT's tied lm_head). Activation x activation MatMuls are not among them: onnxruntime's
    QDQ quantizer ignores its MatMulConstBOnly option, so these are excluded by name."""
    consts = {i.name for i in proto.graph.initializer}
    producer = {o: n for n in proto.graph.node for o in n.output}

    def constant(name: str) -> bool:
        for _ in range(8):
            if name in consts:
                return True
            n = producer.get(name)
            if n is None or n.op_type not in WEIGHT_CHAIN_OPS:
                return False
            if n.op_type == "Constant":
                return True
            name = n.input[0]
        return False

    return {n.name: n.op_type for n in proto.graph.node
            if n.op_type in op_types and len(n.input) > 1 and constant(n.input[1])}


# Settings of onnxruntime's own calibrators (quantization/calibrate.py create_calibrator, onnxruntime 1.31) for
# the methods we offer; tests/test_int8.py checks the streaming ranges equal onnxruntime's for each method.
_HISTOGRAM_SETTINGS: dict[str, dict[str, Any]] = {
    "percentile": {"symmetric": True, "num_bins": 2048, "num_quantized_bins": 2048, "percentile": 99.999},
    "entropy": {"symmetric": False, "num_bins": 128, "num_quantized_bins": 128, "percentile": 99.999},
}


def _ort_method(method: str) -> Any:
    """onnxruntime's CalibrationMethod for one of CALIBRATION_METHODS."""
    from onnxruntime.quantization import CalibrationMethod

    return {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
            "percentile": CalibrationMethod.Percentile}[method]


def calibration_tensors(model: onnx.ModelProto, op_types: Sequence[str] = INT8_OP_TYPES) -> list[str]:
    """The tensors static int8 needs ranges for: the activation (first) input of every node `quantizable_nodes`
    finds. onnxruntime's calibrators also collect every other input and every output of every MatMul/Gemm/Conv,
    logits (batch, seq, vocab) included, which our Q/DQ placement never quantizes (outputs are excluded,
    activation x activation MatMuls are kept float)."""
    inits = {i.name for i in model.graph.initializer}
    by_name = {n.name: n for n in model.graph.node}
    return sorted({by_name[n].input[0] for n in quantizable_nodes(model, op_types)
                   if by_name[n].input[0] and by_name[n].input[0] not in inits})


def collect_ranges(model_path: Path, samples: Sequence[Mapping[str, np.ndarray]], method: str,
                   tensors: Sequence[str]) -> Any:
    """Streaming calibration: onnxruntime's calibration run, one sample at a time, for `tensors` only.

    Returns the onnxruntime TensorsData quantize_static would compute for these tensors (its calibration cache
    format): the same session settings as its calibrators (no graph optimizations, so the values are the
    unfused graph's), MinMax as a running min/max, Percentile/Entropy through onnxruntime's own HistogramCollector
    fed one sample at a time (what its calibrators do with one sample per range). Only the requested tensors
    are computed (the graph is pruned to them: onnxruntime runs every node whatever is fetched, and GPT-2
    small's lm_head was a quarter of each calibration run) and nothing outlives its sample, so memory is the
    session plus one sample's activations, whatever the number of samples."""
    import onnxruntime as ort
    from onnxruntime.quantization.calibrate import HistogramCollector, TensorsData

    model = prune(onnx.load(str(model_path), load_external_data=False), tensors)  # (no logits computed)
    external = any(i.data_location == onnx.TensorProto.EXTERNAL for i in model.graph.initializer)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # as onnxruntime's calibrators
    so.log_severity_level = 4  # fatal only, as the runners' sessions (deploy/sessions.py): raised, not logged
    if external:  # weights stay in the pre-processed model's data file, next to which this graph is written
        src = model_path.with_name("calibrate.onnx")
        onnx.save_model(model, str(src))
        del model
        session = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    else:
        data = model.SerializeToString()
        del model
        session = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        del data
    names = list(tensors)
    inputs = {i.name for i in session.get_inputs()}
    lows: dict[str, np.ndarray] = {}
    highs: dict[str, np.ndarray] = {}
    collector = (HistogramCollector(method=method, scenario="same", **_HISTOGRAM_SETTINGS[method])
                 if method in _HISTOGRAM_SETTINGS else None)
    for feeds in samples:
        values = session.run(names, {k: v for k, v in feeds.items() if k in inputs})
        if collector is not None:
            with contextlib.redirect_stdout(io.StringIO()):  # it prints per call
                collector.collect({t: [v] for t, v in zip(names, values)})
            continue
        for t, v in zip(names, values):
            if not v.size:
                continue
            # onnxruntime reduces each sample in the graph (ReduceMin/ReduceMax, kept as shape (1,)) and merges
            # with nanmin/nanmax: the same float32 values
            lo, hi = np.min(v, keepdims=True).reshape(1), np.max(v, keepdims=True).reshape(1)
            lows[t] = lo if t not in lows else np.fmin(lows[t], lo)
            highs[t] = hi if t not in highs else np.fmax(highs[t], hi)
    del session
    if collector is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            result = collector.compute_collection_result()
        return TensorsData(_ort_method(method), result)
    return TensorsData(_ort_method("minmax"), {t: (lows[t], highs[t]) for t in names if t in lows})


def _weight_keys(model: onnx.ModelProto, tensors: Sequence[str], op_types: Sequence[str]) -> dict[str, tuple]:
    """activation tensor -> the sorted sha256 digests of the constant weights of the quantized nodes that read
    it: what identifies "the same activation" in another graph of the same module (a decode step runs the prefill
    graph's weights on the same kind of text). Weights are read after the quantizer's pre-processing, which
    folds a tied embedding's Transpose into one initializer, so the digest is of the matrix actually multiplied.
    A key two of this graph's tensors share is left out (ambiguous)."""
    import hashlib

    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    wanted = set(tensors)
    readers: dict[str, list[str]] = collections.defaultdict(list)
    digests: dict[str, str] = {}
    for n in model.graph.node:
        if n.op_type in op_types and len(n.input) > 1 and n.input[0] in wanted and n.input[1] in inits:
            w = n.input[1]
            if w not in digests:
                a = np.ascontiguousarray(numpy_helper.to_array(inits[w]))
                digests[w] = hashlib.sha256(f"{a.dtype}{a.shape}".encode() + a.tobytes()).hexdigest()
            readers[n.input[0]].append(digests[w])
    keys = {t: tuple(sorted(d)) for t, d in readers.items()}
    counts = collections.Counter(keys.values())
    return {t: k for t, k in keys.items() if counts[k] == 1}


def _calibrate(pre: Path, calibration: Sequence[Mapping[str, np.ndarray]], options: PrecisionOptions,
               graph: str | None) -> tuple[Any, dict[str, Any]]:
    """The ranges of the activations `pre` quantizes (onnxruntime's TensorsData), and where they came from.

    One artifact's graphs that run the same weights on the same kind of input (GPT's prefill and decode-step
    graphs: the step's activations are the prefill's, token by token) get the ranges the first of them measured
    (`Calibration.ranges`): the decode graph is then not calibrated at all, which halved GPT-2 small's
    calibration (docs/export.md). Only ranges measured on calibration data of the same source are shared (a file
    given for one graph is that graph's), and only for activations whose reading weights identify them
    (`_weight_keys`); the rest are measured on this graph's own samples."""
    from onnxruntime.quantization.calibrate import TensorsData

    cal = options.int8_calibration
    sharing = cal is not None and graph in cal.source
    model = onnx.load(str(pre), load_external_data=sharing)  # the weights only to identify activations by them
    tensors = calibration_tensors(model, options.int8_op_types)
    memo: dict[tuple, tuple[str, Any]] = cal.ranges if sharing else {}
    keys: dict[str, tuple] = {}
    if sharing:
        prefix = (options.int8_method, cal.source[graph])
        keys = {t: prefix + k for t, k in _weight_keys(model, tensors, options.int8_op_types).items()}
    del model
    shared = {t: memo[keys[t]] for t in tensors if t in keys and keys[t] in memo}
    missing = [t for t in tensors if t not in shared]
    data = {t: value for t, (_, value) in shared.items()}
    if missing:
        measured = collect_ranges(pre, calibration, options.int8_method, missing)
        for t in missing:
            if t in measured:
                data[t] = measured[t]
                if t in keys:
                    memo.setdefault(keys[t], (graph, measured[t]))
    record = {"measured_tensors": len(missing),
              "shared_tensors": dict(collections.Counter(g for g, _ in shared.values()))}
    return TensorsData(_ort_method(options.int8_method), data), record


# DequantizeLinear takes a per-channel `axis` from opset 13 on; onnxruntime's quantizer writes one (per-channel
# weights, Conv biases) whatever the model's opset, so an opset-11 graph (a model zoo's CNN) came out unloadable
QDQ_MIN_OPSET = 13


def _at_least_opset(proto: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """`proto` itself when its default-domain opset is >= `opset`, else onnx's version conversion of it."""
    have = default_opset(proto)
    if not have or have >= opset:
        return proto
    try:
        return onnx.version_converter.convert_version(proto, opset)
    except Exception as e:  # the converter raises assorted types for ops it has no adapter for
        raise XDeployError(f"static int8 needs opset >= {opset} (per-channel DequantizeLinear); the graph is opset "
                           f"{have} and onnx's version converter cannot upgrade it: {ort_reason(e)}") from None


def to_int8_static(proto: onnx.ModelProto, calibration: Sequence[Mapping[str, np.ndarray]],
                   options: PrecisionOptions = PrecisionOptions(), *, extra_exclude: Sequence[str] = (),
                   calibration_record: Mapping[str, Any] | None = None, cache: Path | None = None,
                   graph: str | None = None) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Static int8 Q/DQ quantization of MatMul/Gemm/Conv (see the module docstring).

    `extra_exclude`: more node names kept float (the sensitivity search's). `cache`: a JSON file for the
    calibrated tensor ranges; when it exists calibration is skipped (exclusions do not change the fp32
    activations, so a search re-quantizes in seconds). `graph`: this graph's name in `options.int8_calibration`,
    whose range memo shares ranges between an artifact's graphs (`_calibrate`)."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    check_options(options)
    proto = _at_least_opset(proto, QDQ_MIN_OPSET)
    requested = _requested(proto, options.int8_exclude)
    exclude = list(dict.fromkeys(requested + _requested(proto, extra_exclude)))
    weights = quantizable_nodes(proto, options.int8_op_types)
    activation_only = [n.name for n in proto.graph.node if n.op_type in options.int8_op_types and n.name not in weights]
    if not calibration and not (cache and cache.is_file()):
        raise XDeployError("static int8 needs calibration data; none was given for this graph")
    method = _ort_method(options.int8_method)
    unsigned = options.int8_activations == "uint8"
    provenance: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="xdeploy-int8-") as d, _quiet(), _bounded_histograms():
        dst = Path(d, "int8.onnx")
        ranges = cache if cache is not None else Path(d, "ranges.json")
        try:
            pre, large = _prepare(proto, Path(d))
            if not ranges.is_file():
                # our streaming calibration, handed to quantize_static as its calibration cache: onnxruntime's
                # calibrators keep every MatMul/Gemm/Conv input and output of a sample (GPT-2 small's logits
                # alone are 0.8 GB at batch 4 x 1024) and histogram all of them (docs/export.md)
                from onnxruntime.quantization.calibrate import save_tensors_data

                data, provenance = _calibrate(pre, calibration, options, graph)
                save_tensors_data(data, ranges)
                ranges.with_suffix(".provenance.json").write_text(json.dumps(provenance))
            elif ranges.with_suffix(".provenance.json").is_file():  # a re-quantization from the cached ranges
                provenance = json.loads(ranges.with_suffix(".provenance.json").read_text())
            quantize_static(
                str(pre), str(dst), None, quant_format=QuantFormat.QDQ,
                op_types_to_quantize=list(options.int8_op_types), per_channel=options.int8_per_channel,
                reduce_range=options.int8_weight_bits == 7,
                activation_type=QuantType.QUInt8 if unsigned else QuantType.QInt8, weight_type=QuantType.QInt8,
                nodes_to_exclude=exclude + activation_only,
                use_external_data_format=large, calibrate_method=method,
                calibration_cache_path=str(ranges),
                extra_options={
                    "ActivationSymmetric": not unsigned, "WeightSymmetric": True,  # zero points 0 (TensorRT)
                    # Q/DQ on inputs only: a quantized Conv output (ViT's patch embedding) followed by Reshape
                    # would hand a DequantizeLinear to a Reshape, which onnxruntime 1.31 cannot load at opset 23
                    # (see _float_for_float_consumers); the next MatMul quantizes it anyway.
                    "OpTypesToExcludeOutputQuantization": list(options.int8_op_types),
                })
        except XDeployError:
            raise
        except Exception as e:
            raise XDeployError(f"int8 quantization failed: {ort_reason(e)}") from e
        q = onnx.load(str(dst))  # external data (if any) is read into memory before the temp dir goes
    _float_for_float_consumers(q, options.int8_op_types, exclude + activation_only)
    quantized = qdq_quantized_nodes(q)
    ops = collections.Counter(n.op_type for n in q.graph.node)
    return q, {
        "precision": "int8", "format": "qdq", "io_dtype": "float32", "activation_type": options.int8_activations,
        "activation_symmetric": not unsigned, "weight_type": "int8", "weight_symmetric": True,
        "weight_bits": options.int8_weight_bits, "per_channel": options.int8_per_channel,
        "op_types": list(options.int8_op_types),
        "calibration": {"method": options.int8_method, **dict(calibration_record or {}), **provenance},
        "excluded": exclude, "requested_nodes_found": requested,
        "kept_fp32": [{"node": n, "reason": "requested" if n in requested else "sensitivity"} for n in exclude],
        "quantized_nodes": len(quantized),
        "quantized_ops": {k: ops[k] for k in ("QuantizeLinear", "DequantizeLinear") if ops[k]},
    }


def _float_for_float_consumers(proto: onnx.ModelProto, op_types: Sequence[str], exclude: Sequence[str]) -> None:
    """Give every consumer that is not a quantized op the float tensor back, in place.

    onnxruntime's QDQ quantizer rewires *every* consumer of a quantized activation to the DequantizeLinear
    output, graph outputs included: a post-LN BERT's residual Add would then read the int8-rounded LayerNorm
    output and the graph would return quantized hidden states; a MatMul kept float beside quantized ones that
    share its input would read it too. Only the quantized MatMul/Gemm/Conv the pair was made for should read it
    (the Q/DQ placement TensorRT and OpenVINO expect: on the inputs of quantized ops).

    It also keeps the graphs loadable in onnxruntime 1.31 at its default optimization level: a DequantizeLinear
    read by a Reshape/Transpose/Squeeze/Unsqueeze/Slice (GPT's decode graph: the new key feeds the Unsqueeze that
    stacks the present cache) gets a Q/DQ pair propagated past that op whose QuantizeLinear carries an explicit
    output_dtype INT8 (QDQPropagationTransformer, since microsoft/onnxruntime#28144); QDQS8ToU8Transformer then
    gives the pair a uint8 zero point and leaves output_dtype alone, and the session fails ("output_dtype INT8
    does not match y_zero_point type UINT8"). tests/test_qdq_ort.py holds this."""
    keep = set(exclude)
    g = proto.graph
    producer = {o: n for n in g.node for o in n.output}
    outputs = {o.name for o in g.output}
    for dq in [n for n in g.node if n.op_type == "DequantizeLinear"]:
        q = producer.get(dq.input[0])
        if q is None or q.op_type != "QuantizeLinear":
            continue  # a weight's DequantizeLinear (its input is an initializer)
        x, y = q.input[0], dq.output[0]
        if y in outputs:  # the quantizer renamed the producer's output x -> y_QuantizeLinear_Input
            new_y = f"{y}_dq"
            dq.output[0] = new_y
            for n in g.node:
                if n is not q and n is not dq:
                    n.input[:] = [new_y if i == y else i for i in n.input]
                n.output[:] = [y if o == x else o for o in n.output]
            q.input[0] = y
            x, y = y, new_y
        for n in g.node:
            if (n.op_type not in op_types or n.name in keep) and n is not q and y in n.input:
                n.input[:] = [x if i == y else i for i in n.input]


def qdq_quantized_nodes(proto: onnx.ModelProto) -> dict[str, str]:
    """name -> op type of the compute nodes every float input of which comes from a DequantizeLinear."""
    producer = {o: n for n in proto.graph.node for o in n.output}
    out = {}
    for n in proto.graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        ins = [i for i in n.input[:2] if i]
        if ins and all(i in producer and producer[i].op_type == "DequantizeLinear" for i in ins):
            out[n.name] = n.op_type
    return out


def to_int8_dynamic(proto: onnx.ModelProto, options: PrecisionOptions = PrecisionOptions(), *,
                    graph: Graph | None = None) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Dynamic int8 quantization of MatMul/Conv weights (per channel; uint8 or int8 as `options` say), after the
    quantizer's pre-processing. `graph`: what it is (a decode step's gets uint8 weights under "auto")."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    weight_type, bits = int8_weights("int8-dynamic", options, graph)
    exclude = _requested(proto, options.int8_exclude)
    if weight_type == "blocks":
        return _to_int8_blocks(proto, exclude)
    op_types = [t for t in options.int8_op_types if t in DYNAMIC_OP_TYPES]
    with tempfile.TemporaryDirectory(prefix="xdeploy-int8-") as d, _quiet():
        dst = Path(d, "int8.onnx")
        try:
            pre, large = _prepare(proto, Path(d))
            quantize_dynamic(str(pre), str(dst), op_types_to_quantize=op_types,
                             per_channel=options.int8_per_channel,
                             weight_type=QuantType.QUInt8 if weight_type == "uint8" else QuantType.QInt8,
                             reduce_range=bits == 7,
                             nodes_to_exclude=exclude, use_external_data_format=large)
        except XDeployError:
            raise
        except Exception as e:
            raise XDeployError(f"int8 quantization failed: {ort_reason(e)}") from e
        q = onnx.load(str(dst))
    ops = collections.Counter(n.op_type for n in q.graph.node)
    return q, {
        "precision": "int8-dynamic", "format": "integer-ops", "io_dtype": "float32", "method": "dynamic",
        "weight_type": weight_type, "weight_bits": bits, "per_channel": options.int8_per_channel,
        "op_types": op_types,
        "excluded": exclude, "requested_nodes_found": exclude,
        "kept_fp32": [{"node": n, "reason": "requested"} for n in exclude],
        "quantized_ops": {k: ops[k] for k in ("MatMulInteger", "ConvInteger", "DynamicQuantizeLinear") if ops[k]},
    }


def _to_int8_blocks(proto: onnx.ModelProto, exclude: list[str]) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """int8-dynamic with "blocks" weights: every constant-weight MatMul as onnxruntime's MatMulNBits (8 bits,
    symmetric, BLOCK_SIZE weights per scale along K, int8 activations per block at run time), after the quantizer's
    pre-processing (which folds a tied LM head's Transpose into one weight). A decode step reads its weights once
    a token: MLAS's block kernels read them faster than the per-channel MatMulInteger path, and the per-block scales
    keep the logits closer to fp32; a prompt of many tokens runs slower through them (docs/benchmarks.md). MLAS's
    AVX2 8-bit kernel multiplies each weight byte alone in a 16-bit lane, so no pair saturates on any class (run as
    that class under QEMU: tests/test_emulate.py)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    with tempfile.TemporaryDirectory(prefix="xdeploy-int8-") as d, _quiet():
        try:
            pre, _ = _prepare(proto, Path(d))
            model = onnx.load(str(pre))  # external weights (a large graph's) read into memory here, before d goes
            q = MatMulNBitsQuantizer(model, nodes_to_exclude=exclude, algo_config=DefaultWeightOnlyQuantConfig(
                block_size=BLOCK_SIZE, is_symmetric=True, accuracy_level=BLOCK_ACCURACY_LEVEL, bits=8))
            q.process()
            out = q.model.model
        except XDeployError:
            raise
        except Exception as e:
            raise XDeployError(f"int8 block quantization failed: {ort_reason(e)}") from e
    ops = collections.Counter(n.op_type for n in out.graph.node)
    if not ops["MatMulNBits"]:
        raise XDeployError("int8-dynamic weights 'blocks' found no MatMul with a constant weight to quantize; expected "
                           "a graph with dense layers (or int8-dynamic weights 'auto')")
    return out, {
        "precision": "int8-dynamic", "format": "matmul-nbits", "io_dtype": "float32", "method": "dynamic",
        "weight_type": "blocks", "weight_bits": 8, "block_size": BLOCK_SIZE, "accuracy_level": BLOCK_ACCURACY_LEVEL,
        "per_channel": False, "op_types": ["MatMul"], "excluded": exclude, "requested_nodes_found": exclude,
        "kept_fp32": [{"node": n, "reason": "requested"} for n in exclude],
        "quantized_ops": {"MatMulNBits": ops["MatMulNBits"]},
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
