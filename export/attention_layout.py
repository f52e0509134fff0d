"""Feed each opset-23 `Attention` its projections as they are, (B, T, C), instead of split into heads.

The dynamo exporter lowers `scaled_dot_product_attention` on heads to

    q (B, T, C) -> Reshape (B, T, nh, hs) -> Transpose (B, nh, T, hs) --+
    k, v alike -----------------------------------------------------> Attention -> (B, nh, T, hs)
                                                 -> Transpose (B, T, nh, hs) -> Reshape (B, T, C)

Opset 23's `Attention` also takes 3D inputs, (B, T, q_num_heads * hs) and (B, S, kv_num_heads * hs), and then
gives a 3D output (B, T, q_num_heads * hs) -- the same numbers in the layout the projections already have. So
the Reshape/Transpose pairs go (four Transposes, each a copy of the activations, less per layer), and the engines
do the head split inside the kernel: on MiniLM's sentences (AMD Zen 4, 2 threads, per-batch interleaved)
onnxruntime's int8-dynamic pass ran 1.06x [1.005-1.10], its fp32 pass 1.03x [0.99-1.06], BERT-base int8 at
batch 1 1.08x [0.99-1.12], and OpenVINO's bf16 pass of the static int8 graph 1.04x [1.02-1.05], the outputs
identical to the last bit (GPT-2's logits within 1.4e-6; docs/benchmarks.md). TensorRT's ONNX parser takes both
forms.

Only the exact pattern is rewritten: a Reshape of a 3D tensor to [B, T, nh, hs] whose first two entries provably
keep (B, T) (Shape slices at their own index, or constants checked against onnx shape inference), then Transpose
perm (0, 2, 1, 3), on all three inputs; the output through Transpose (0, 2, 1, 3) and a Reshape to the model
width, with no other reader. An Attention fed anything else (a cache concatenated in front of the keys, 4D
graph inputs) is left as it is; a head-split tensor another node also reads (a decoder's `present` keys) stays
for that node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .onnx_graph import prune

HEAD_PERM = [0, 2, 1, 3]  # (B, T, nh, hs) <-> (B, nh, T, hs)


def attention_3d(proto: onnx.ModelProto) -> int:
    """Rewrite `proto` in place (see the module docstring); return how many Attention ops now take 3D inputs."""
    g = proto.graph
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, list[Any]] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    # the small integer constants only (shape pieces): weights stay unread, wherever they are stored
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer
              if len(t.dims) <= 1 and int(np.prod(t.dims)) <= 8 and t.data_location != onnx.TensorProto.EXTERNAL}
    for n in g.node:  # Constant nodes: the exporter may emit the [nh] and [hs] pieces either way
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    graph_outputs = {o.name for o in g.output}
    inferred: dict[str, list[int | None]] | None = None

    def dims(name: str) -> list[int | None] | None:
        """Static sizes of the 3D tensor `name` (None per symbolic dim; None if not known as 3D), from shape
        inference run once, on demand: only a constant Reshape target (ViT's [-1, 197, nh, hs]) needs them."""
        nonlocal inferred
        if inferred is None:
            inferred = _inferred_dims(proto)
        d = inferred.get(name)
        return d if d is not None and len(d) == 3 else None

    def split_heads(name: str) -> tuple[str, int, int] | None:
        """`name` = Transpose(HEAD_PERM)(Reshape(x, [B, T, nh, hs])) -> (x, nh, hs)."""
        t = producer.get(name)
        if t is None or t.op_type != "Transpose" or _perm(t) != HEAD_PERM:
            return None
        r = producer.get(t.input[0])
        if r is None or r.op_type != "Reshape":
            return None
        heads = _head_dims(r, producer, consts, dims)
        return None if heads is None else (r.input[0], *heads)

    rewritten, gone = 0, set()  # gone: (op type, output) of the merging Transpose/Reshape pairs
    for att in [n for n in g.node if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]:
        if len(att.input) < 3 or any(att.input[4:]) or any(o for o in att.output[1:]) \
                or any(_attr(att, a) is not None for a in ("q_num_heads", "kv_num_heads")):
            continue  # a past cache fed in, optional outputs asked for, or already 3D
        q, k, v = (split_heads(att.input[i]) for i in range(3))
        if q is None or k is None or v is None or k[1:] != v[1:] or q[2] != k[2]:
            continue
        merged = _merged_output(att.output[0], readers, producer, consts, q[0], q[1] * q[2], dims, graph_outputs)
        if merged is None:
            continue
        for i, src in enumerate((q, k, v)):
            att.input[i] = src[0]
        att.attribute.extend([helper.make_attribute("q_num_heads", q[1]), helper.make_attribute("kv_num_heads", k[1])])
        # the Attention now gives the merged tensor itself, under its name (its readers, or the graph's output,
        # unchanged); the merging Transpose and Reshape go
        gone.update((n.op_type, n.output[0]) for n in merged)  # (the Reshape's name now the Attention's too)
        att.output[0] = merged[1].output[0]
        rewritten += 1
    if rewritten:
        kept = [n for n in g.node if (n.op_type, n.output[0] if n.output else "") not in gone]
        del g.node[:]
        g.node.extend(kept)
        prune(proto)  # the splitting Reshape/Transpose pairs and the shape pieces no output reads any more
    return rewritten


def _inferred_dims(proto: onnx.ModelProto) -> dict[str, list[int | None]]:
    """onnx shape inference on the graph without its weights (their types and shapes stand in for them)."""
    g = proto.graph
    weights = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in g.initializer]
    light = helper.make_model(helper.make_graph(list(g.node), "shapes", [*g.input, *weights], list(g.output)),
                              opset_imports=list(proto.opset_import), ir_version=proto.ir_version,
                              functions=list(proto.functions))
    try:
        values = onnx.shape_inference.infer_shapes(light).graph.value_info
    except Exception:  # onnx raises several types; then no constant-target Reshape is rewritten
        return {}
    return {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
            for v in values}


def _attr(node: Any, name: str) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return None


def _perm(node: Any) -> list[int] | None:
    p = _attr(node, "perm")
    return None if p is None else [int(x) for x in p]


def _scalar(name: str, consts: dict[str, np.ndarray]) -> int | None:
    a = consts.get(name)
    return int(a.reshape(-1)[0]) if a is not None and a.size == 1 and a.dtype.kind in "iu" else None


def _keeps_leading(pieces: list[Any], data_dims: Callable[[], list[int | None] | None]) -> bool:
    """The first two entries of a Reshape target keep its 3D input's (B, T): each one a dimension of a shape at
    its own index ("shape"), or a constant equal to the input's static size there (`data_dims()`, asked only
    then), or -1 beside one that is (the size then fixes it). `pieces`: per entry ("shape", index) or
    ("const", value)."""
    def same(i: int) -> bool:
        kind, v = pieces[i]
        if kind == "shape":
            return v == i
        d = data_dims() if v > 0 else None
        return d is not None and d[i] == v

    def free(i: int) -> bool:
        return pieces[i] == ("const", -1)

    return (same(0) and same(1)) or (same(0) and free(1)) or (free(0) and same(1))


def _pieces(shape: str, producer: dict[str, Any], consts: dict[str, np.ndarray]) -> list[Any] | None:
    """A Reshape target as entries ("shape", index) / ("const", value): a constant, or a Concat of one-element
    constants and Shape(start=i, end=i+1) slices."""
    if shape in consts:
        return [("const", int(x)) for x in consts[shape].reshape(-1)]
    c = producer.get(shape)
    if c is None or c.op_type != "Concat":
        return None
    out = []
    for name in c.input:
        s, v = producer.get(name), _scalar(name, consts)
        if v is not None:
            out.append(("const", v))
        elif s is not None and s.op_type == "Shape" and _attr(s, "start") is not None \
                and _attr(s, "end") == _attr(s, "start") + 1:
            out.append(("shape", _attr(s, "start")))
        else:
            return None
    return out


def _head_dims(r: Any, producer: dict[str, Any], consts: dict[str, np.ndarray],
               dims: Callable[[str], list[int | None] | None]) -> tuple[int, int] | None:
    """Reshape `r` of a 3D tensor to [B, T, nh, hs] -> (nh, hs)."""
    p = _pieces(r.input[1], producer, consts)
    if p is None or len(p) != 4 or p[2][0] != "const" or p[3][0] != "const" or p[2][1] <= 0 or p[3][1] <= 0:
        return None
    return (p[2][1], p[3][1]) if _keeps_leading(p, lambda: dims(r.input[0])) else None


def _merged_output(name: str, readers: dict[str, list[Any]], producer: dict[str, Any],
                   consts: dict[str, np.ndarray], q: str, width: int,
                   dims: Callable[[str], list[int | None] | None], graph_outputs: set[str]) -> tuple[Any, Any] | None:
    """(Transpose, Reshape) that merge the heads of `name` back to (B, T, width), when that is all anyone (a node
    or the graph's outputs) does with it."""
    (t, *more) = readers.get(name, [None])
    if more or name in graph_outputs or t is None or t.op_type != "Transpose" or _perm(t) != HEAD_PERM:
        return None
    (r, *more) = readers.get(t.output[0], [None])
    if more or t.output[0] in graph_outputs or r is None or r.op_type != "Reshape":
        return None
    p = _pieces(r.input[1], producer, consts)
    if p is None or len(p) != 3 or p[2] != ("const", width):
        return None
    # the output's (B, T) are the queries' (B, T): `q` is the 3D tensor they were split from
    return (t, r) if _keeps_leading(p, lambda: dims(q)) else None
