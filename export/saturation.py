"""Will this int8 graph compute the same on every x86 CPU? A numpy model of the one kernel that differs.

onnxruntime's x86 int8 GEMM (MLAS) multiplies uint8 activations by int8 weights (U8S8: DynamicQuantizeLinear's
output is uint8, and a Q/DQ graph's int8 activations are shifted to uint8 by QDQS8ToU8Transformer). How it adds
the products depends on the CPU:

    AVX-512 VNNI / AVX-VNNI   vpdpbusd: four u8*s8 products added into an int32: exact
    AMX                       tile dot products into int32: exact
    AVX2 (no VNNI)            vpmaddubsw: each *adjacent pair* of u8*s8 products (k = 2i, 2i + 1) is added in
                              int16 and saturated to [-32768, 32767]; vpmaddwd then adds the pairs into int32

    uint8 weights (U8U8)      every class widens both to int16 first (vpmaddwd: pairs added in int32): exact

so on AVX2-only CPUs (AMD Zen 1-3, Intel before Cascade Lake) a pair a0*w0 + a1*w1 beyond 32767 is silently
clipped. With 8-bit weights (|w| <= 127, 128) that needs only a0, a1 near 255 and weights near full scale:
it happens, and a graph that passes parity on the VNNI machine that exported it is wrong on an AVX2 one.
With 7-bit weights (onnxruntime's `reduce_range`: |w| <= 64) a pair is at most 2 * 255 * 64 = 32640, so no input
can saturate it: the artifact is portable *by construction*. That is xdeploy's default (`int8_weight_bits` 7)
for int8 weights. int8-dynamic's default uint8 weights never meet the U8S8 kernel (onnxruntime picks U8U8 for
them: platform.cpp, checked against onnxruntime in tests/test_int8_kernels.py), so they keep all 8 bits on every
class; the bound counts them (`uint8_weight_nodes`) and has nothing to prove for them.

This module reads the quantized graph, no runtime needed:
    weight_bound(q)          the largest pair any input could make, from the int8 weights alone (the proof)
    simulate(nodes, acts)    the AVX2 arithmetic on real activations, exactly: which pairs saturate and how far
                             each node's integer accumulator moves, beside the exact (VNNI/AMX) result
so a VNNI or AMX machine proves what an AVX2 machine would compute (tests/test_int8_kernels.py checks the model
against onnxruntime itself on whatever machine runs it: bit-identical to the AVX2 kernel there, or to the
exact product on VNNI/AMX). Covered: MatMul and Gemm (Q/DQ), MatMulInteger, checked against onnxruntime; Conv and
ConvInteger are covered by the bound (which holds for any order of K) and simulated with the im2col order
(c, kh, kw), which was not checked against onnxruntime's convolution kernels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

INT16_MAX = 32767
U8_MAX = 255
KERNEL_MODEL = "x86 AVX2 U8S8 (vpmaddubsw: adjacent u8*s8 products added in saturating int16)"
# The classes an artifact is proven for, by how the CPU adds int8 products (core/fingerprint.int8_dot).
EXACT_CLASSES = ("vnni", "amx")  # int32 accumulation: every int8 graph is computed exactly
PAIRWISE_CLASS = "avx2"          # saturating int16 pairs: exact only when the bound holds
MAX_ROWS = 96                    # activation rows simulated per node (the largest ones and an even sample)
CHUNK = 1 << 24                  # elements of one pairwise-product block (int32): bounds memory


@dataclass(frozen=True)
class Int8Node:
    """One integer matrix product of a quantized graph: its uint8 activation comes from the float tensor
    `activation` quantized as `mode` says ("static": scale/zero point fixed, int8 shifted by 128 to uint8 as
    onnxruntime does on x86; "dynamic": DynamicQuantizeLinear's per-tensor range at run time)."""

    node: str
    op_type: str
    activation: str
    mode: str
    scale: float | None
    zero_point: int | None
    signed: bool  # the static activation's type was int8 (shifted to uint8 by 128)
    weight: np.ndarray  # int8 as int32, (K, N) in the order the kernel adds products (k fastest-pairing)
    conv: dict[str, Any] | None  # kernel/strides/pads/dilations/group for Conv and ConvInteger


def _init(g: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    return {i.name: i for i in g.initializer}


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _const(name: str, inits: Mapping[str, onnx.TensorProto], producer: Mapping[str, onnx.NodeProto]
           ) -> np.ndarray | None:
    if name in inits:
        return numpy_helper.to_array(inits[name])
    p = producer.get(name)
    if p is not None and p.op_type == "Constant":
        return numpy_helper.to_array(_attr(p, "value", None))
    return None


def _weight_matrix(w: np.ndarray, op_type: str, node: onnx.NodeProto) -> tuple[np.ndarray, dict[str, Any] | None]:
    """The int8 weight as (K, N) in the order the GEMM adds along K, and the conv geometry for convolutions."""
    w = w.astype(np.int32)
    if op_type in ("Conv", "ConvInteger"):
        o = w.shape[0]
        conv = {"kernel": list(w.shape[2:]), "strides": list(_attr(node, "strides", [1] * (w.ndim - 2))),
                "pads": list(_attr(node, "pads", [0] * 2 * (w.ndim - 2))),
                "dilations": list(_attr(node, "dilations", [1] * (w.ndim - 2))), "group": int(_attr(node, "group", 1))}
        return w.reshape(o, -1).T, conv  # (C*kh*kw, O): im2col order (c, kh, kw)
    if op_type == "Gemm" and _attr(node, "transB", 0):
        w = w.T
    return w.reshape(-1, w.shape[-1]) if w.ndim != 2 else w, None


def int8_nodes(q: onnx.ModelProto) -> list[Int8Node]:
    """Every integer matrix product in `q`: Q/DQ MatMul/Gemm/Conv whose both inputs come from DequantizeLinear
    (weight: an int8 initializer), and MatMulInteger/ConvInteger fed by DynamicQuantizeLinear."""
    g = q.graph
    inits = _init(g)
    producer = {o: n for n in g.node for o in n.output}
    out: list[Int8Node] = []
    for n in g.node:
        if n.op_type in ("MatMul", "Gemm", "Conv") and len(n.input) > 1:
            a_dq, w_dq = producer.get(n.input[0]), producer.get(n.input[1])
            if not (a_dq and w_dq and a_dq.op_type == w_dq.op_type == "DequantizeLinear"):
                continue
            qn = producer.get(a_dq.input[0])
            w = _const(w_dq.input[0], inits, producer)
            if qn is None or qn.op_type != "QuantizeLinear" or w is None or w.dtype != np.int8:
                continue
            scale = _const(qn.input[1], inits, producer)
            zp = _const(qn.input[2], inits, producer) if len(qn.input) > 2 and qn.input[2] else None
            if scale is None or scale.size != 1:
                continue
            signed = zp is None or zp.dtype == np.int8
            wm, conv = _weight_matrix(w, n.op_type, n)
            out.append(Int8Node(n.name, n.op_type, qn.input[0], "static", float(scale.ravel()[0]),
                                int(zp.ravel()[0]) if zp is not None else 0, signed, wm, conv))
        elif n.op_type in ("MatMulInteger", "ConvInteger"):
            dq = producer.get(n.input[0])
            w = _const(n.input[1], inits, producer)
            if dq is None or dq.op_type != "DynamicQuantizeLinear" or w is None or w.dtype != np.int8:
                continue
            wm, conv = _weight_matrix(w, n.op_type, n)
            out.append(Int8Node(n.name, n.op_type, dq.input[0], "dynamic", None, None, False, wm, conv))
    return out


def uint8_weight_nodes(q: onnx.ModelProto) -> list[str]:
    """MatMulInteger/ConvInteger nodes whose constant weight is uint8: onnxruntime's U8U8 kernels, exact on every
    x86 class (no pair is added in int16), so outside the bound."""
    inits = _init(q.graph)  # the element type is read from the proto: no weight is decoded
    return [n.name for n in q.graph.node if n.op_type in ("MatMulInteger", "ConvInteger") and len(n.input) > 1
            and n.input[1] in inits and inits[n.input[1]].data_type == onnx.TensorProto.UINT8]


def _even_k(w: np.ndarray) -> np.ndarray:
    """w (K, N) with a zero row appended when K is odd: the kernel zero-pads K to pairs."""
    return np.vstack([w, np.zeros((1, w.shape[1]), w.dtype)]) if w.shape[0] % 2 else w


def weight_bound(q: onnx.ModelProto, nodes: list[Int8Node] | None = None) -> dict[str, Any]:
    """The proof: the largest |a0*w0 + a1*w1| any uint8 input could make with these int8 weights (adjacent
    pairs along K as the kernel takes them), against the int16 limit. `portable` True means no input can
    saturate the AVX2 kernel, so every x86 class computes this graph exactly (uint8-weight products are exact
    anyway and only counted). `nodes`: `int8_nodes(q)` when the caller has them already (reading the weights
    is the costly part)."""
    worst, worst_node, max_w = 0, None, 0
    nodes = int8_nodes(q) if nodes is None else nodes
    for n in nodes:
        w = _even_k(np.abs(n.weight))
        max_w = max(max_w, int(w.max(initial=0)))
        pair = int((w[0::2] + w[1::2]).max(initial=0)) * U8_MAX
        if pair > worst:
            worst, worst_node = pair, n.node
    return {"int8_nodes": len(nodes), "uint8_weight_nodes": len(uint8_weight_nodes(q)), "max_abs_weight": max_w,
            "worst_pair_bound": worst, "worst_node": worst_node, "limit": INT16_MAX, "portable": worst <= INT16_MAX}


# what lies between an int8 weight Constant and the MatMul/Convolution that reads it in an OpenVINO int8 IR
_IR_DEQUANT_CHAIN = ("Convert", "Subtract", "Multiply", "Reshape", "Transpose", "Unsqueeze", "Squeeze")


def ir_weight_bound(model: Any) -> dict[str, Any]:
    """The proof for an OpenVINO int8 IR (an ov.Model, e.g. NNCF's): the int8 weights each MatMul / Convolution
    dequantizes (Constant i8 -> Convert -> Multiply by its scale ...). OpenVINO's CPU plugin adds int8 products in
    saturating int16 pairs on x86 without VNNI or AMX as onnxruntime does (tests/test_emulate.py), but in a K
    order of its own choosing, so the bound pairs the two largest weights: 2 * 255 * max|w| against the int16
    limit (portable iff |w| <= 64, NNCF's overflow fix in every layer)."""
    max_w, worst_node, nodes = 0, None, 0
    for op in model.get_ordered_ops():
        if op.get_type_name() not in ("MatMul", "Convolution", "GroupConvolution"):
            continue
        src = op.input_value(1).get_node()
        while src.get_type_name() in _IR_DEQUANT_CHAIN:
            src = src.input_value(0).get_node()
        if src.get_type_name() != "Constant" or src.get_element_type().get_type_name() != "i8":
            continue
        nodes += 1
        w = int(np.abs(src.get_data().astype(np.int32)).max(initial=0))
        if w > max_w:
            max_w, worst_node = w, op.get_friendly_name()
    worst = 2 * U8_MAX * max_w
    return {"int8_nodes": nodes, "max_abs_weight": max_w, "worst_pair_bound": worst, "worst_node": worst_node,
            "limit": INT16_MAX, "portable": worst <= INT16_MAX}


def quantize_activation(n: Int8Node, x: np.ndarray) -> tuple[np.ndarray, int]:
    """x (float) as the uint8 the kernel reads (int32 array), as onnxruntime computes it, and its zero point
    on that uint8 scale."""
    x = x.astype(np.float32)
    if n.mode == "dynamic":  # DynamicQuantizeLinear: the range always includes 0
        lo, hi = min(float(x.min(initial=0.0)), 0.0), max(float(x.max(initial=0.0)), 0.0)
        scale = (hi - lo) / U8_MAX or 1.0
        zp = int(np.clip(np.rint(-lo / scale), 0, U8_MAX))
        return np.clip(np.rint(x / np.float32(scale)) + zp, 0, U8_MAX).astype(np.int32), zp
    zp = int(n.zero_point or 0)
    if n.signed:  # int8 (zero point in [-128, 127]) shifted to uint8 by +128 (QDQS8ToU8Transformer)
        return (np.clip(np.rint(x / np.float32(n.scale)) + zp, -128, 127) + 128).astype(np.int32), zp + 128
    return np.clip(np.rint(x / np.float32(n.scale)) + zp, 0, U8_MAX).astype(np.int32), zp


def _rows(n: Int8Node, a: np.ndarray) -> np.ndarray:
    """The activation as (rows, K) in the kernel's K order (im2col for convolutions, (c, kh, kw))."""
    if n.conv is None:
        return a.reshape(-1, a.shape[-1])
    c = n.conv
    if c["group"] != 1 or any(d != 1 for d in c["dilations"]) or a.ndim != 4:
        raise ValueError("only ungrouped, undilated 2-D convolutions are simulated")
    pads = c["pads"]
    if any(pads):
        a = np.pad(a, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    kh, kw = c["kernel"]
    sh, sw = c["strides"]
    win = np.lib.stride_tricks.sliding_window_view(a, (kh, kw), axis=(2, 3))[:, :, ::sh, ::sw]  # B,C,H',W',kh,kw
    return win.transpose(0, 2, 3, 1, 4, 5).reshape(-1, a.shape[1] * kh * kw)


def _sample(rows: np.ndarray, most: int) -> np.ndarray:
    """At most `most` rows: the half with the largest activations (they saturate first) and an even spread."""
    if len(rows) <= most:
        return rows
    big = np.argsort(-(rows.astype(np.int64) ** 2).sum(1))[: most // 2]
    even = np.linspace(0, len(rows) - 1, most - len(big)).astype(int)
    return rows[np.unique(np.concatenate([big, even]))]


def pairwise_product(a: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, int, int]:
    """a (M, K) uint8 values @ w (K, N) int8 values as the AVX2 kernel computes it: adjacent products along K
    added in saturating int16, then summed in int32. Returns (the (M, N) int64 result, how many pairs
    saturated, the largest |pair| before saturation)."""
    a, w = _even_k(np.asarray(a, np.int32).T).T, _even_k(np.asarray(w, np.int32))
    a0, a1, w0, w1 = a[:, 0::2], a[:, 1::2], w[0::2], w[1::2]
    out = np.zeros((a.shape[0], w.shape[1]), np.int64)
    saturating = worst = 0
    cols = max(1, CHUNK // max(1, a0.shape[0] * a0.shape[1]))
    for j in range(0, w.shape[1], cols):
        p = a0[:, :, None] * w0[None, :, j:j + cols]  # (M, K/2, n), then the pair's sum in place
        p += a1[:, :, None] * w1[None, :, j:j + cols]
        hi, lo = int(p.max(initial=0)), int(p.min(initial=0))
        worst = max(worst, hi, -lo)
        if hi > INT16_MAX or lo < -INT16_MAX - 1:  # only then is there anything to clip (7-bit weights: never)
            saturating += int(np.count_nonzero(p > INT16_MAX) + np.count_nonzero(p < -INT16_MAX - 1))
            np.clip(p, -INT16_MAX - 1, INT16_MAX, out=p)
        out[:, j:j + cols] = p.sum(1, dtype=np.int64)
    return out, saturating, worst


def simulate_node(n: Int8Node, x: np.ndarray, max_rows: int = MAX_ROWS) -> dict[str, Any]:
    """Run the AVX2 arithmetic for node `n` on the float activation `x`: the share of pairs that saturate, the
    largest pair, and how far the saturated int32 accumulators are from the exact ones, relative to the
    accumulators' zero-point-corrected size (what the float output is proportional to)."""
    u8, zp = quantize_activation(n, x)
    a = _sample(_rows(n, u8), max_rows)  # (R, K) uint8 values
    w = n.weight
    if a.shape[1] != w.shape[0]:
        raise ValueError(f"{n.node}: activation K {a.shape[1]} != weight K {w.shape[0]}")
    # integer products summed in float64 (BLAS) are exact: |sum| <= K * 255 * 128 < 2^53 for any K a layer has
    exact = (a.astype(np.float64) @ w.astype(np.float64)).astype(np.int64)
    centered = exact - zp * w.sum(0, dtype=np.int64)  # what the zero-point correction leaves: ~ the output
    sat, saturating, worst = pairwise_product(a, w)
    scale = float(np.linalg.norm(centered.astype(np.float64))) or 1.0
    pairs = a.shape[0] * ((a.shape[1] + 1) // 2) * w.shape[1]
    return {"node": n.node, "op_type": n.op_type, "rows": int(a.shape[0]), "pairs": pairs,
            "saturating_pairs": saturating, "saturating_share": saturating / pairs if pairs else 0.0,
            "worst_pair": worst, "accumulator_rel_error": float(np.linalg.norm((sat - exact).astype(np.float64)))
            / scale}


def _pool(n: Int8Node, parts: list[dict[str, Any]]) -> dict[str, Any]:
    pairs = sum(p["pairs"] for p in parts)
    sat = sum(p["saturating_pairs"] for p in parts)
    return {"node": n.node, "op_type": n.op_type, "rows": sum(p["rows"] for p in parts), "pairs": pairs,
            "saturating_pairs": sat, "saturating_share": sat / pairs if pairs else 0.0,
            "worst_pair": max(p["worst_pair"] for p in parts),
            "accumulator_rel_error": max(p["accumulator_rel_error"] for p in parts)}


def simulate(nodes: list[Int8Node], activations: Mapping[str, list[np.ndarray]], max_rows: int = MAX_ROWS
             ) -> list[dict[str, Any]]:
    """`simulate_node` for every one of `nodes` (`int8_nodes`) whose activation tensor is in `activations` (tensor
    name -> its values over the calibration samples), each sample quantized on its own (a dynamic range is per
    run), pooled."""
    out = []
    for n in nodes:
        xs = activations.get(n.activation)
        if xs:
            out.append(_pool(n, [simulate_node(n, x, max(8, max_rows // len(xs))) for x in xs]))
    return out


class Simulation:
    """`simulate` one sample at a time: `add` each sample's activations (tensor name -> value) as it is computed,
    then `result()`, equal to `simulate(nodes, {name: [values of every sample]})`, without holding every
    sample's activations at once (GPT-2 small: 49 activations of up to 4 x 1024 x 3072 floats per sample)."""

    def __init__(self, nodes: list[Int8Node], samples: int, max_rows: int = MAX_ROWS) -> None:
        self.nodes, self.rows = nodes, max(8, max_rows // max(samples, 1))
        self.parts: dict[str, list[dict[str, Any]]] = {n.node: [] for n in nodes}

    def add(self, values: Mapping[str, np.ndarray]) -> None:
        for n in self.nodes:
            if n.activation in values:
                self.parts[n.node].append(simulate_node(n, values[n.activation], self.rows))

    def result(self) -> list[dict[str, Any]]:
        return [_pool(n, self.parts[n.node]) for n in self.nodes if self.parts[n.node]]


def record(q: onnx.ModelProto, activations: Mapping[str, list[np.ndarray]] | None, *, weight_bits: int,
           samples: int = 0, top: int = 5, nodes: list[Int8Node] | None = None,
           simulated: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The manifest's verdict for one graph (`conversion.<graph>.saturation`): the bound, the simulation on the
    calibration activations (when given, or `simulated`: a `Simulation.result()`), and the classes the graph is
    proven for. `nodes`: `int8_nodes(q)` when the caller has them already."""
    int8 = int8_nodes(q) if nodes is None else nodes
    bound = weight_bound(q, int8)
    rec: dict[str, Any] = {"kernel_model": KERNEL_MODEL, "weight_bits": weight_bits, **bound}
    if activations is not None or simulated is not None:
        sims = simulated if simulated is not None else simulate(int8, activations or {})
        worst = sorted(sims, key=lambda r: (r["saturating_pairs"], r["accumulator_rel_error"]), reverse=True)
        rec["simulated"] = {
            "samples": samples, "nodes": len(sims),
            "saturating_nodes": sum(1 for r in sims if r["saturating_pairs"]),
            "saturating_pairs": sum(r["saturating_pairs"] for r in sims),
            "pairs": sum(r["pairs"] for r in sims),
            "worst_pair": max((r["worst_pair"] for r in sims), default=0),
            "worst_accumulator_rel_error": max((r["accumulator_rel_error"] for r in sims), default=0.0),
            "worst_nodes": [r for r in worst[:top] if r["saturating_pairs"]]}
    rec["proven_for"] = proven_for(bound["portable"])
    return rec


def proven_for(portable: bool) -> list[str]:
    """The int8 dot-product classes (core/fingerprint.int8_dot) on which a graph computes exactly."""
    return [*EXACT_CLASSES, PAIRWISE_CLASS] if portable else list(EXACT_CLASSES)


def artifact_proven_for(conversion: Mapping[str, Mapping[str, Any]]) -> list[str] | None:
    """The classes every graph of an int8 artifact is proven for (None: no graph recorded a verdict)."""
    sets = [set(r["saturation"]["proven_for"]) for r in conversion.values()
            if isinstance(r, Mapping) and isinstance(r.get("saturation"), Mapping)
            and isinstance(r["saturation"].get("proven_for"), list)]
    if not sets:
        return None
    common = set.intersection(*sets)
    return [c for c in (*EXACT_CLASSES, PAIRWISE_CLASS) if c in common]
