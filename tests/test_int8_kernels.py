"""The int8 GEMM kernels this machine runs, against export/saturation.py's numpy model of the AVX2 kernel (issue #27):
onnxruntime's MatMulInteger and static Q/DQ MatMul, and OpenVINO's int8 MatMul, compute the model (saturating int16
pairs) on AVX2-only x86 and the exact product on VNNI/AMX; 7-bit int8 weights and uint8 x uint8 are exact everywhere.

Apart from tests/test_saturation.py (the recipes on every registered family) because tests/test_emulate.py runs this
file as the AVX2 class under QEMU, where every import costs ~10x: it imports no torch and no model (13 s of the
emulated collection) and builds no artifact."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from xdeploy.core.fingerprint import fingerprint, int8_dot
from xdeploy.export import saturation

CLASS = int8_dot(fingerprint())


def _session(nodes: list, inputs: list, outputs: list, inits: list) -> ort.InferenceSession:
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits),
                          opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


def _expected(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """What this machine's onnxruntime must compute for a (uint8) @ w (int8), by its class."""
    if CLASS == "avx2":
        return saturation.pairwise_product(a, w)[0]
    return a.astype(np.int64) @ w.astype(np.int64)


@pytest.mark.skipif(CLASS == "unknown", reason="not an x86 CPU with AVX2, VNNI or AMX")
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 48), (7, 63, 32), (64, 128, 96)])
def test_model_is_what_onnxruntime_computes_here(m, k, n):
    """MatMulInteger on full-range uint8 x int8: bit-identical to the pairwise model on AVX2-only machines and to
    the exact product on VNNI/AMX ones; with 7-bit weights (|w| <= 64) exact everywhere, as the bound says."""
    rng = np.random.default_rng(m * 1000 + k)
    a = rng.integers(0, 256, (m, k), dtype=np.uint8)
    w8 = rng.integers(-128, 128, (k, n), dtype=np.int8)
    sat, saturating, worst = saturation.pairwise_product(a, w8)
    assert saturating > 0 and worst > saturation.INT16_MAX  # full-range data does saturate the model
    assert not np.array_equal(sat, a.astype(np.int64) @ w8.astype(np.int64))
    for w in (w8, np.clip(w8, -64, 64).astype(np.int8)):
        s = _session([helper.make_node("MatMulInteger", ["A", "B"], ["Y"])],
                     [helper.make_tensor_value_info("A", TensorProto.UINT8, [m, k])],
                     [helper.make_tensor_value_info("Y", TensorProto.INT32, [m, n])], [numpy_helper.from_array(w, "B")])
        got = s.run(None, {"A": a})[0]
        assert np.array_equal(got, _expected(a, w)), f"onnxruntime on this {CLASS} machine differs from the model"
    w7 = np.clip(w8, -64, 64).astype(np.int8)
    assert saturation.pairwise_product(a, w7)[1] == 0  # the bound: 2 * 255 * 64 = 32640 <= 32767


def _qdq_matmul(m: int, sx: np.float32, w: np.ndarray, sw: np.ndarray) -> onnx.ModelProto:
    """Y = DQ(Q(X)) @ DQ(W): int8 activations (scale sx, zero point 0) times int8 weights `w` (K, N), per-column
    scales `sw`; X is (m, K)."""
    k, n = w.shape
    nodes = [helper.make_node("QuantizeLinear", ["X", "sx", "zx"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
             helper.make_node("DequantizeLinear", ["W", "sw", "zw"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["Y"])]
    inits = [numpy_helper.from_array(np.array(sx), "sx"), numpy_helper.from_array(np.array(0, np.int8), "zx"),
             numpy_helper.from_array(w, "W"), numpy_helper.from_array(sw, "sw"),
             numpy_helper.from_array(np.zeros(n, np.int8), "zw")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [m, n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


@pytest.mark.skipif(CLASS == "unknown", reason="not an x86 CPU with AVX2, VNNI or AMX")
def test_qdq_matmul_shifts_int8_activations_to_uint8():
    """A static Q/DQ MatMul with int8 activations (zero point 0) runs as uint8 (+128) x int8 on x86: its float
    output follows the model with that shift (saturating on AVX2-only machines), not the unshifted product."""
    rng = np.random.default_rng(7)
    m, k, n = 16, 64, 32
    sx = np.float32(0.02)
    sw = (rng.uniform(0.5, 1.5, n) / 100).astype(np.float32)
    w = rng.integers(-127, 128, (k, n), dtype=np.int8)
    x = (rng.integers(-127, 128, (m, k)) * sx).astype(np.float32)
    s = ort.InferenceSession(_qdq_matmul(m, sx, w, sw).SerializeToString(), providers=["CPUExecutionProvider"])
    got = s.run(None, {"X": x})[0]
    a = np.rint(x / sx).astype(np.int64) + 128
    acc = _expected(a, w) - 128 * w.astype(np.int64).sum(0)
    want = acc * sx * sw
    exact = (np.rint(x / sx) @ w.astype(np.float64)) * sx * sw
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if CLASS == "avx2":
        assert np.abs(got - exact).max() > 1e-2  # and on this machine that is not the exact product


@pytest.mark.skipif(CLASS == "unknown", reason="not an x86 CPU with AVX2, VNNI or AMX")
def test_openvino_qdq_matmul_here():
    """OpenVINO's CPU plugin on the same static Q/DQ MatMul with full-range int8 activations: with 8-bit weights it
    saturates int16 pairs on AVX2-only machines as onnxruntime does (> 5% of the output's range off the exact
    product: why the ov runner refuses such static int8 graphs there, deploy/saturation_guard.py), exact on
    VNNI/AMX; with 7-bit weights exact everywhere. (tests/test_emulate.py runs this as the AVX2 class.)"""
    ov = pytest.importorskip("openvino")
    rng = np.random.default_rng(5)
    m, k, n = 16, 128, 64
    sx = np.float32(0.02)
    sw = (rng.uniform(0.5, 1.5, n) / 100).astype(np.float32)
    x = (rng.choice([-127, 127], (m, k)) * sx).astype(np.float32)
    core = ov.Core()
    for w in (rng.integers(-127, 128, (k, n)).astype(np.int8), rng.integers(-64, 65, (k, n)).astype(np.int8)):
        model = core.read_model(_qdq_matmul(m, sx, w, sw).SerializeToString(), b"")
        got = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})({"X": x})[0]
        exact = x @ (w.astype(np.float32) * sw)
        err = float(np.abs(got - exact).max() / np.abs(exact).max())
        if CLASS == "avx2" and np.abs(w).max() > 64:
            assert err > 0.05, err
        else:
            assert err < 1e-5, err


@pytest.mark.skipif(CLASS == "unknown", reason="not an x86 CPU with AVX2, VNNI or AMX")
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 48), (7, 63, 32), (64, 768, 96)])
def test_uint8_weights_are_exact_here(m, k, n):
    """MatMulInteger on full-range uint8 x uint8 (the pairs that would break U8S8: 2 * 255 * 255 > 32767), with
    per-column zero points: onnxruntime's result is the exact integer product on this machine, whatever its class
    (the U8U8 kernels widen to int16 before adding pairs)."""
    rng = np.random.default_rng(m * 1000 + k)
    a = rng.integers(0, 256, (m, k), dtype=np.uint8)
    a[0] = 255
    w = rng.integers(0, 256, (k, n), dtype=np.uint8)
    w[:, 0] = 255
    zp = rng.integers(0, 256, n, dtype=np.uint8)
    s = _session([helper.make_node("MatMulInteger", ["A", "B", "", "zb"], ["Y"])],
                 [helper.make_tensor_value_info("A", TensorProto.UINT8, [m, k])],
                 [helper.make_tensor_value_info("Y", TensorProto.INT32, [m, n])],
                 [numpy_helper.from_array(w, "B"), numpy_helper.from_array(zp, "zb")])
    got = s.run(None, {"A": a})[0]
    assert np.array_equal(got, a.astype(np.int64) @ (w.astype(np.int64) - zp.astype(np.int64)))
    assert saturation.pairwise_product(a, (w.astype(np.int32) - 128))[1] > 0  # as int8 it would saturate on AVX2
