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
    """The Q/DQ graph from our ranges has the same quantized tensors, scales and zero points as quantize_static
    calibrating by itself (percentile, the default)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    proto, samples = gpt
    options = prec.PrecisionOptions(int8_sensitivity=False)
    ours, _ = prec.to_int8_static(proto, samples, options)

    weights = prec.quantizable_nodes(proto)
    activation_only = [n.name for n in proto.graph.node if n.op_type in prec.INT8_OP_TYPES and n.name not in weights]
    with tempfile.TemporaryDirectory() as d, prec._quiet(), prec._bounded_histograms():
        pre, _ = prec._prepare(proto, Path(d))
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
