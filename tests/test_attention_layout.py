"""export/attention_layout.py: every opset-23 Attention of an export takes its (B, T, C) projections directly, with
the same outputs, and nothing that only looks like the pattern is rewritten."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from xdeploy.deploy.probes import verify_artifact
from xdeploy.export.artifact import load_artifact
from xdeploy.export.attention_layout import attention_3d

B, T, NH, HS = 2, 5, 2, 4
C = NH * HS


def _graph(*, target: str = "shape", t_dim: int | str = "t", k_perm: tuple[int, ...] = (0, 2, 1, 3),
           extra_reader: bool = False) -> onnx.ModelProto:
    """x (B, T, C) -> q, k, v projections split into heads -> Attention -> heads merged -> y (B, T, C).
    target "shape": Reshape targets built from Shape slices (the dynamo exporter's form); "const": [-1, T, nh, hs]."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((C, C)).astype(np.float32), f"w{n}") for n in "qkv"]
    nodes = [helper.make_node("Shape", ["x"], ["b"], start=0, end=1),
             helper.make_node("Shape", ["x"], ["t"], start=1, end=2)]
    inits += [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("nh", NH), ("hs", HS), ("c", C))]
    if target == "shape":
        nodes += [helper.make_node("Concat", ["b", "t", "nh", "hs"], ["split"], axis=0),
                  helper.make_node("Concat", ["b", "t", "c"], ["merge"], axis=0)]
    else:
        inits += [numpy_helper.from_array(np.array([-1, T, NH, HS], np.int64), "split"),
                  numpy_helper.from_array(np.array([-1, T, C], np.int64), "merge")]
    for n in "qkv":
        perm = k_perm if n == "k" else (0, 2, 1, 3)
        nodes += [helper.make_node("MatMul", ["x", f"w{n}"], [f"{n}3"]),
                  helper.make_node("Reshape", [f"{n}3", "split"], [f"{n}4"]),
                  helper.make_node("Transpose", [f"{n}4"], [f"{n}h"], perm=list(perm))]
    nodes += [helper.make_node("Attention", ["qh", "kh", "vh"], ["a"]),
              helper.make_node("Transpose", ["a"], ["at"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["at", "merge"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", t_dim, C])]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("at", TensorProto.FLOAT, ["b", t_dim, NH, HS]))
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                  ["b", t_dim, C])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.mark.parametrize("target,t_dim", [("shape", "t"), ("const", T)])
def test_the_exporters_pattern_becomes_one_3d_attention_with_the_same_outputs(target: str, t_dim: int | str) -> None:
    model = _graph(target=target, t_dim=t_dim)
    x = np.random.default_rng(1).standard_normal((B, T, C)).astype(np.float32)
    before = _run(model, x)
    rewritten = onnx.ModelProto.FromString(model.SerializeToString())
    assert attention_3d(rewritten) == 1
    ops = [n.op_type for n in rewritten.graph.node]
    assert "Transpose" not in ops and "Reshape" not in ops and "Concat" not in ops, ops
    att = next(n for n in rewritten.graph.node if n.op_type == "Attention")
    attrs = {a.name: helper.get_attribute_value(a) for a in att.attribute}
    assert attrs["q_num_heads"] == NH and attrs["kv_num_heads"] == NH and list(att.input) == ["q3", "k3", "v3"]
    onnx.checker.check_model(rewritten)
    # a head mixed up is off by O(1); another kernel path on another CPU class by a few ulps
    np.testing.assert_allclose(_run(rewritten, x)[0], before[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("why,kwargs", [
    ("a constant target on a symbolic length: nothing proves T is kept", {"target": "const", "t_dim": "t"}),
    ("keys transposed for a product (0, 2, 3, 1), not split into heads", {"k_perm": (0, 2, 3, 1)}),
    ("the head-split output is also a graph output", {"extra_reader": True}),
])
def test_what_only_looks_like_the_pattern_is_left_alone(why: str, kwargs: dict) -> None:
    model = _graph(**kwargs)
    same = onnx.ModelProto.FromString(model.SerializeToString())
    assert attention_3d(same) == 0, why
    assert same == model, why


@pytest.mark.parametrize("family", ["bert", "gpt", "vit", "transformer"])
def test_every_export_feeds_its_attention_3d(tiny_export, family: str) -> None:
    """The exported graphs: each Attention whose keys are split into heads in the graph takes 3D inputs; one fed
    otherwise keeps its 4D inputs (the Transformer's cross-attention reads its layer's keys from the memory's
    stacked projections); the conversion record counts them; the golden probes came from the PyTorch reference,
    and onnxruntime still matches them."""
    art = load_artifact(tiny_export(family))
    for g in art.spec.graphs:
        proto = onnx.load(str(art.onnx_path(g.name)), load_external_data=False)
        atts = [n for n in proto.graph.node if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]
        heads = [n for n in atts if any(a.name == "q_num_heads" for a in n.attribute)]
        assert art.manifest["conversion"][g.name]["attention_3d"] == len(heads)
        producer = {o: n for n in proto.graph.node for o in n.output}
        for n in atts:
            if n not in heads:  # its keys were not split from a (B, S, C) projection in this graph
                k = producer.get(n.input[1])
                assert k is None or k.op_type != "Transpose", (family, g.name, n.name)
        if g.name == "model" and family != "transformer":
            assert atts and len(heads) == len(atts), (family, g.name)
    report = verify_artifact(art, "ort", threads=1, remember=False)
    assert report.passed and report.checks, report
