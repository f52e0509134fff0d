"""Planted defects for the parity/layerwise tests: each returns the name of the node that must be blamed; and
artifacts that load but lie, for the golden probes (tests/test_probes.py, tests/test_cpp.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper


def corrupt_weight(model: onnx.ModelProto, initializer: str, delta: float = 5.0) -> str:
    """Add `delta` to one element of `initializer` (in place); returns the name of the node consuming it."""
    init = next(i for i in model.graph.initializer if i.name == initializer)
    a = numpy_helper.to_array(init).copy()
    a.flat[a.size // 2] += delta
    init.CopyFrom(numpy_helper.from_array(a, init.name))
    consumers = [n.name for n in model.graph.node if initializer in n.input]
    assert len(consumers) == 1, consumers
    return consumers[0]


def scale_up(model: onnx.ModelProto, tensor: str, factor: float = 6e4) -> str:
    """Insert `tensor * factor` before every consumer of `tensor` (in place); returns the new Mul's name.

    With activations of order 1 the product exceeds fp16's 65504: finite in the fp32 graph, ±inf once the
    graph is converted to fp16 (the fp16 converter keeps the planted node and its name)."""
    g = model.graph
    idx = next(i for i, n in enumerate(g.node) if tensor in n.output)
    scaled = f"{tensor}_planted_scaled"
    for n in g.node:
        for k, name in enumerate(n.input):
            if name == tensor:
                n.input[k] = scaled
    g.initializer.append(numpy_helper.from_array(np.array(factor, np.float32), f"{tensor}_planted_factor"))
    g.node.insert(idx + 1, helper.make_node("Mul", [tensor, f"{tensor}_planted_factor"], [scaled],
                                            name="planted_overflow"))
    onnx.checker.check_model(model)
    return "planted_overflow"


def attention_query(model: onnx.ModelProto) -> str:
    """The query projection feeding the first ONNX Attention op (walking back through Reshape/Transpose)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    name = next(n for n in model.graph.node if n.op_type == "Attention").input[0]
    while producer[name].op_type in ("Reshape", "Transpose"):
        name = producer[name].input[0]
    return name


def activation_outlier(model: onnx.ModelProto, matmul: str, channel: int = 0, factor: float = 1e3) -> str:
    """Make input channel `channel` of MatMul (or Gemm) `matmul` an activation outlier without changing the fp32
    result (in place): x -> x * s with s[channel] = factor before the node, and the weight's input row
    `channel` divided by `factor`. One int8 scale for the whole activation then rounds every other channel to
    zero, so this node is the one a sensitivity search must keep float. Returns the node's name."""
    g = model.graph
    node = next(n for n in g.node if n.name == matmul)
    init = next(i for i in g.initializer if i.name == node.input[1])
    w = numpy_helper.to_array(init).copy()
    trans_b = any(a.name == "transB" and a.i for a in node.attribute)  # Gemm: weight (N, K)
    if trans_b:
        w[:, channel] /= factor
    else:
        w[channel, :] /= factor
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    s = np.ones(w.shape[1] if trans_b else w.shape[0], np.float32)
    s[channel] = factor
    g.initializer.append(numpy_helper.from_array(s, f"{matmul}_planted_outlier"))
    scaled = f"{node.input[0]}_planted_outlier"
    idx = next(i for i, n in enumerate(g.node) if n.name == matmul)
    g.node.insert(idx, helper.make_node("Mul", [node.input[0], f"{matmul}_planted_outlier"], [scaled],
                                        name="planted_outlier_scale"))
    node.input[0] = scaled
    onnx.checker.check_model(model)
    return matmul


def refresh_manifest(art: Path) -> None:
    """Rewrite an artifact's manifest sha256s after a file was changed on purpose (it then loads, and lies)."""
    from xdeploy.export.artifact import MANIFEST, write_manifest_files

    m = json.loads((art / MANIFEST).read_text())
    write_manifest_files(art, m)
    (art / MANIFEST).write_text(json.dumps(m, indent=2))


def corrupt_artifact(src: Path, dst: Path, graph: str = "model") -> Path:
    """A copy of artifact `src` whose largest fp32 weight of <graph>.onnx got noise of its own magnitude, sha256s
    fixed up so that it loads: its outputs change, its golden probes' PyTorch references do not."""
    shutil.copytree(src, dst)
    proto = onnx.load(str(dst / f"{graph}.onnx"))
    init = max((t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT),
               key=lambda t: int(np.prod(t.dims)))
    a = numpy_helper.to_array(init).copy()
    a += np.random.default_rng(0).standard_normal(a.shape).astype(np.float32) * a.std()
    init.CopyFrom(numpy_helper.from_array(a, init.name))
    onnx.save(proto, str(dst / f"{graph}.onnx"))
    refresh_manifest(dst)
    return dst


def strip_probes(src: Path, dst: Path) -> Path:
    """A copy of artifact `src` as written before golden probes existed: no "probes" section, no probes/ files."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "probes")
    m = json.loads((dst / "manifest.json").read_text())
    del m["probes"]
    (dst / "manifest.json").write_text(json.dumps(m))
    refresh_manifest(dst)
    return dst
