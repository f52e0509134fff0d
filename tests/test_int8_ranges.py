"""Streaming calibration (export/precision.py `collect_ranges`) against onnxruntime's own calibrators on the tiny
GPT: the same ranges for every tensor static int8 quantizes, and the same quantized graph, for every method."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from xdeploy.export import precision as prec
from xdeploy.export.artifact import load_artifact
from xdeploy.export.calibration import default_calibration

METHODS = {"minmax": "MinMax", "percentile": "Percentile", "entropy": "Entropy"}


@pytest.fixture(scope="module")
def gpt(tiny_export):
    art = load_artifact(tiny_export("gpt"))
    proto = onnx.load(str(art.onnx_path("model")))
    samples = default_calibration(art.spec).samples["model"][:12]  # three paragraphs among them
    return proto, samples


class Reader:
    """onnxruntime's CalibrationDataReader protocol over feed dicts."""

    def __init__(self, samples: list, names: set[str]) -> None:
        self.items = [{k: v for k, v in s.items() if k in names} for s in samples]
        self.i, self.end = 0, len(self.items)

    def get_next(self):
        self.i += 1
        return self.items[self.i - 1] if self.i <= self.end else None

    def __len__(self) -> int:
        return len(self.items)

    def set_range(self, start_index: int, end_index: int) -> None:
        self.i, self.end = start_index, end_index


def _onnxruntime_ranges(pre: Path, samples: list, method: str) -> dict:
    """What quantize_static's own calibration computes (one sample per range, as the export used to run it)."""
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import create_calibrator

    with tempfile.TemporaryDirectory() as d:
        cal = create_calibrator(pre, list(prec.INT8_OP_TYPES), augmented_model_path=str(Path(d, "aug.onnx")),
                                calibrate_method=getattr(CalibrationMethod, METHODS[method]))
        names = {i.name for i in cal.infer_session.get_inputs()}
        for s in samples:
            cal.collect_data(Reader([s], names))
        return cal.compute_data()


@pytest.mark.parametrize("method", list(METHODS))
def test_streaming_ranges_equal_onnxruntime_calibrators(gpt, method, tmp_path):
    proto, samples = gpt
    with prec._quiet(), prec._bounded_histograms():
        pre, _ = prec._prepare(proto, tmp_path)
        tensors = prec.calibration_tensors(onnx.load(str(pre)))
        ours = prec.collect_ranges(pre, samples, method, tensors)
        theirs = _onnxruntime_ranges(pre, samples, method)
    assert len(tensors) == len(prec.quantizable_nodes(proto)) > 4  # one activation per weight MatMul here
    assert set(ours.keys()) == set(tensors) and set(tensors) < set(theirs.keys())
    assert ours.calibration_method == theirs.calibration_method
    for t in tensors:
        lo, hi = (float(np.ravel(v)[0]) for v in ours[t].range_value)
        ref_lo, ref_hi = (float(np.ravel(v)[0]) for v in theirs[t].range_value)
        assert hi > lo, t  # a real range, not a placeholder
        np.testing.assert_allclose([lo, hi], [ref_lo, ref_hi], rtol=1e-6, err_msg=t)


def _qdq_params(q: onnx.ModelProto) -> dict[str, tuple[float, int]]:
    inits = {i.name: numpy_helper.to_array(i) for i in q.graph.initializer}
    return {n.input[0]: (float(inits[n.input[1]]), int(inits[n.input[2]]))
            for n in q.graph.node if n.op_type == "QuantizeLinear"}


def test_quantized_graph_equals_onnxruntime_calibration(gpt):
    """The Q/DQ graph from our pre-processing and ranges has the same quantized tensors, scales, zero points and
    quantized weights as onnxruntime's documented path: `quant_pre_process`, then quantize_static calibrating by
    itself (percentile, the default). Ours runs only the pre-processing's optimization (the tied lm_head's
    Transpose folded) and leaves shape inference to quantize_static."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    proto, samples = gpt
    options = prec.PrecisionOptions(int8_sensitivity=False)
    ours, _ = prec.to_int8_static(proto, samples, options)

    weights = prec.quantizable_nodes(proto)
    activation_only = [n.name for n in proto.graph.node if n.op_type in prec.INT8_OP_TYPES and n.name not in weights]
    with tempfile.TemporaryDirectory() as d, prec._quiet(), prec._bounded_histograms():
        plain = onnx.ModelProto.FromString(proto.SerializeToString())
        del plain.graph.value_info[:]
        onnx.save(plain, str(Path(d, "in.onnx")))
        pre = Path(d, "pre.onnx")
        quant_pre_process(str(Path(d, "in.onnx")), str(pre), skip_symbolic_shape=True)
        reader = Reader(samples, {i.name for i in proto.graph.input})
        quantize_static(str(pre), str(Path(d, "q.onnx")), reader, quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=list(prec.INT8_OP_TYPES), per_channel=True, reduce_range=True,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                        nodes_to_exclude=activation_only, calibrate_method=CalibrationMethod.Percentile,
                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True,
                                       "OpTypesToExcludeOutputQuantization": list(prec.INT8_OP_TYPES),
                                       "CalibStridedMinMax": 1})
        theirs = onnx.load(str(Path(d, "q.onnx")))
    prec._float_for_float_consumers(theirs, prec.INT8_OP_TYPES, activation_only)
    mine, ref = _qdq_params(ours), _qdq_params(theirs)
    assert mine and set(mine) == set(ref)
    for t, (scale, zp) in ref.items():
        assert mine[t][1] == zp and mine[t][0] == pytest.approx(scale, rel=1e-6), t
    assert [n.op_type for n in ours.graph.node] == [n.op_type for n in theirs.graph.node]
    transposes = [sum(n.op_type == "Transpose" for n in m.graph.node) for m in (ours, proto)]
    assert transposes[0] < transposes[1]  # the tied lm_head's weight Transpose was folded
    qw, rw = ({i.name: numpy_helper.to_array(i) for i in m.graph.initializer if i.data_type == onnx.TensorProto.INT8}
              for m in (ours, theirs))
    assert qw and qw.keys() == rw.keys() and all(np.array_equal(qw[k], rw[k]) for k in qw)


def test_calibration_runs_a_graph_pruned_to_the_ranged_tensors(gpt):
    """onnxruntime runs every node whatever is fetched, so calibration runs the graph pruned to the activations it
    ranges: the lm_head (whose logits are a quarter of GPT-2 small's run) is gone, the values are the same."""
    import onnxruntime as ort

    from xdeploy.export.onnx_graph import prune

    proto, samples = gpt
    tensors = prec.calibration_tensors(proto)
    logits = proto.graph.output[0].name
    pruned = prune(onnx.ModelProto.FromString(proto.SerializeToString()), tensors)
    assert [o.name for o in pruned.graph.output] == tensors
    assert not any(logits in n.output for n in pruned.graph.node)
    assert 0 < len(pruned.graph.node) < len(proto.graph.node)
    assert len(pruned.graph.initializer) <= len(proto.graph.initializer)

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    full = onnx.ModelProto.FromString(proto.SerializeToString())
    full.graph.output.extend([onnx.ValueInfoProto(name=t) for t in tensors])
    feeds = samples[3]  # a paragraph sample
    got, want = (ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
                 .run(tensors, {i.name: feeds[i.name] for i in m.graph.input}) for m in (pruned, full))
    for t, a, b in zip(tensors, got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=0, err_msg=t)  # the same kernels on the same inputs


def test_prune_keeps_what_a_subgraph_reads():
    """A tensor read only inside an If branch (outer scope) keeps its producer; an unread node and initializer go."""
    from onnx import TensorProto, helper

    from xdeploy.export.onnx_graph import prune

    branch = lambda name: helper.make_graph(  # noqa: E731
        [helper.make_node("Identity", ["outer"], [f"{name}_out"])], name, [],
        [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [2])])
    nodes = [helper.make_node("Neg", ["x"], ["outer"], name="neg"),
             helper.make_node("Mul", ["x", "unused_w"], ["dead"], name="dead"),
             helper.make_node("If", ["c"], ["y"], name="if", then_branch=branch("then"), else_branch=branch("else"))]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                     helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.ones(2, np.float32), "unused_w")])
    model = prune(helper.make_model(graph))
    assert [n.name for n in model.graph.node] == ["neg", "if"]
    assert not model.graph.initializer
    assert [o.name for o in prune(model, ["outer"]).graph.output] == ["outer"]
    assert [n.name for n in model.graph.node] == ["neg"]

