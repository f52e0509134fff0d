"""Static int8 (Q/DQ) KV-cache decode graphs open and run in onnxruntime at every graph-optimization level, the
default ("all") included (GPT's decode graph is the one that failed; test_int8.py runs every graph's parity).

Why they can fail (onnxruntime 1.31, opset >= 21, int8 activations): when a DequantizeLinear output is read by
a Reshape / Transpose / Squeeze / Unsqueeze / Slice, QDQPropagationTransformer (basic level) inserts a Q/DQ pair
after that op and, since microsoft/onnxruntime#28144 (the fix of #27845), gives the new QuantizeLinear an explicit
`output_dtype` (INT8). QDQS8ToU8Transformer (extended level, CPU) then swaps that pair's int8 zero point for a
new uint8 initializer and leaves `output_dtype` as it was, so the session fails to load with
"QuantizeLinear output_dtype INT8 does not match y_zero_point type UINT8" (onnx's check, onnx/onnx#5956).
In GPT's decode graph the new key feeds both the attention's QK^T MatMul and the Unsqueeze that stacks the
present cache: quantizing that activation x activation MatMul and letting the Unsqueeze read its
DequantizeLinear triggers it. export/precision.py avoids both (only weight MatMul/Gemm/Conv are quantized, and
every other consumer reads the float tensor), so no activation DequantizeLinear reaches an op that
propagation moves through. The test checks that property and the sessions themselves (it fails when both
safeguards are undone: measured by patching them out)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from xdeploy.deploy.sessions import ORT_OPT_LEVELS, ort_session
from xdeploy.export.artifact import load_artifact
from xdeploy.export.precision import PrecisionOptions, calibration_feeds, to_int8_static
from xdeploy.models.registry import MODELS
from xdeploy.models.spec import make_feeds

# ops onnxruntime's QDQPropagationTransformer moves a DequantizeLinear forward through
PROPAGATING_OPS = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice", "MaxPool"}
DECODE = "decode"  # the graph name of KV-cache decoding (models/spec.py)
SIZES = {"batch": 2, "seq": 5, "cache": 7, "step": 3}  # other axes: 4


def _propagation_targets(q: onnx.ModelProto) -> list[str]:
    """Nodes of a propagating op type that read an activation's DequantizeLinear output (its input comes from a
    QuantizeLinear, not from an int8 weight initializer)."""
    producer = {o: n for n in q.graph.node for o in n.output}
    act_dq = {n.output[0] for n in q.graph.node if n.op_type == "DequantizeLinear"
              and n.input[0] in producer and producer[n.input[0]].op_type == "QuantizeLinear"}
    return [f"{n.name} ({n.op_type})" for n in q.graph.node if n.op_type in PROPAGATING_OPS and act_dq & set(n.input)]


def _decoding_models() -> list[str]:
    """Models with a KV-cache decode graph (the graph kind that failed), by what each family declares."""
    return [m for m in sorted(MODELS) if any(g.name == DECODE for g in MODELS[m].spec(
        next(iter(MODELS[m].presets.values()))).graphs)]


@pytest.mark.parametrize("model", _decoding_models())
def test_qdq_decode_graphs_open_at_every_ort_optimization_level(model, tiny_export):
    art = load_artifact(tiny_export(model))  # the shared tiny fp32 export (read only here)
    options = PrecisionOptions(int8_sensitivity=False)
    for g in [g for g in art.spec.graphs if g.name == DECODE]:
        feeds, record = calibration_feeds(g, art.spec, options)
        q, _ = to_int8_static(onnx.load(str(art.onnx_path(g.name))), feeds[:8], options, calibration_record=record)
        assert not _propagation_targets(q), f"{g.name}: {_propagation_targets(q)}"
        blob = q.SerializeToString()
        x = make_feeds(g, {a: min(SIZES.get(a, 4), ax.max) for a, ax in art.spec.axes.items()}, seed=3)
        outs = {}
        for level in ORT_OPT_LEVELS:  # disable, basic, extended, all (the runners' default)
            sess = ort_session(blob, opt_level=level, threads=1, what=f"{model} {g.name} int8 at {level}")
            outs[level] = sess.run(None, {i.name: x[i.name] for i in sess.get_inputs()})
        # the fused int8 kernels compute what the Q/DQ graph as written computes (up to int8 rounding)
        for level, got in outs.items():
            for ref, out in zip(outs["disable"], got):
                assert np.isfinite(out).all(), (g.name, level)
                a, b = ref.astype(np.float64).ravel(), out.astype(np.float64).ravel()
                cos = a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30)
                assert cos > 0.99, (g.name, level, cos)
