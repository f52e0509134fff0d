"""The session layer (deploy/sessions.py) is the only place ONNX Runtime sessions and OpenVINO compiles are
configured, and what it configures is what the runners, layerwise, roofline and scale actually get."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from xdeploy.core.errors import XDeployError
from xdeploy.deploy import sessions

ROOT = Path(__file__).resolve().parents[1]
# Triton's Python backend runs this file in Triton's own interpreter, where xdeploy is not installed.
OUTSIDE_XDEPLOY = {"serve/triton_onnx_model.py"}
# static int8 calibration runs the unoptimized graph with onnxruntime's calibrator settings (so its ranges are
# onnxruntime's), below the session layer (export/ does not import deploy/); deploy/sessions.py says so
CALIBRATION = {"export/precision.py"}
SESSION_CALLS = {"InferenceSession", "SessionOptions", "compile_model"}


def _calls(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in SESSION_CALLS:
                found.add(name)
    return found


def test_sessions_are_made_only_in_the_session_layer() -> None:
    offenders = {}
    for folder in ("core", "models", "export", "deploy", "verify", "bench", "serve", "reports", "studies",
                   "xdeploy"):
        for f in (ROOT / folder).rglob("*.py"):
            rel = f.relative_to(ROOT).as_posix()
            if rel in OUTSIDE_XDEPLOY or rel == "deploy/sessions.py":
                continue
            if calls := _calls(f):
                offenders[rel] = sorted(calls)
    assert {f: offenders.pop(f, None) for f in CALIBRATION} == {"export/precision.py": ["InferenceSession",
                                                                                       "SessionOptions"]}
    assert not offenders, f"sessions made outside deploy/sessions.py: {offenders}"
    assert _calls(ROOT / "deploy/sessions.py") == SESSION_CALLS  # the checker sees what it looks for


def _add_model() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "add", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def test_ort_session_gets_the_layer_options() -> None:
    sess = sessions.ort_session(_add_model(), threads=2, opt_level="basic")
    so = sess.get_session_options()
    assert so.intra_op_num_threads == 2 and so.inter_op_num_threads == 1 and so.log_severity_level == 4
    assert str(so.graph_optimization_level).endswith("ORT_ENABLE_BASIC")
    assert sess.run(None, {"x": np.array([1.0, 2.0], np.float32)})[0].tolist() == [2.0, 4.0]
    with pytest.raises(XDeployError, match="onnxruntime cannot load the serialized model"):
        sessions.ort_session(b"not onnx")
    with pytest.raises(XDeployError, match="unknown optimization level 'max'"):
        sessions.ort_session_options(0, "max")
    with pytest.raises(XDeployError, match="threads must be an integer >= 0"):
        sessions.ort_session_options(-1)


def test_runners_use_the_layer(tiny_export) -> None:
    """The ort runner's session and the ov runner's compiled model carry the layer's settings."""
    from xdeploy.deploy.registry import open_runner
    from xdeploy.models.registry import MODELS

    model = next(iter(MODELS))
    art = tiny_export(model, preset=next(iter(MODELS[model].presets)))
    with open_runner("ort", art, threads=1, opt_level="extended") as r:
        so = r.session.get_session_options()
        assert so.intra_op_num_threads == 1 and so.inter_op_num_threads == 1
        assert str(so.graph_optimization_level).endswith("ORT_ENABLE_EXTENDED")
    pytest.importorskip("openvino")
    with open_runner("ov", art, threads=1, hint="throughput") as r:
        assert int(r.compiled.get_property("INFERENCE_NUM_THREADS")) == 1
        assert "THROUGHPUT" in str(r.compiled.get_property("PERFORMANCE_HINT"))


def test_ov_config_and_compile(tmp_path: Path) -> None:
    assert sessions.ov_config("bf16", threads=3, streams=1, cache_dir=tmp_path) == {
        "INFERENCE_PRECISION_HINT": "bf16", "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": 3,
        "NUM_STREAMS": 1, "CACHE_DIR": str(tmp_path)}
    assert "INFERENCE_NUM_THREADS" not in sessions.ov_config()  # 0 = the plugin's default (every core)
    with pytest.raises(XDeployError, match="unknown ov variant 'fp8'"):
        sessions.ov_config("fp8")
    with pytest.raises(XDeployError, match="unknown OpenVINO performance hint 'fast'"):
        sessions.ov_config(hint="fast")
    pytest.importorskip("openvino")
    path = tmp_path / "add.onnx"
    path.write_bytes(_add_model())
    compiled = sessions.ov_compile(path, sessions.ov_config(threads=1, streams=1))
    assert int(compiled.get_property("NUM_STREAMS")) == 1
    assert compiled({"x": np.array([1.0, 2.0], np.float32)})[0].tolist() == [2.0, 4.0]
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    with pytest.raises(XDeployError, match="OpenVINO cannot compile .*bad.onnx for CPU") as e:
        sessions.ov_compile(bad, sessions.ov_config())
    assert "\n" not in str(e.value) and not str(e.value).rstrip().endswith(":")  # a reason, not a header
    onnx.checker.check_model(onnx.load(str(path)))


def test_ov_reason_skips_openvinos_location_headers() -> None:
    """The reason line of an OpenVINO error, not its "Exception from <file>:" headers (the text is the CPU plugin's,
    as a PagedAttention compile with a bf16 cache and f32 arithmetic raised it on OpenVINO 2026.4)."""
    text = ("Exception from src/inference/src/cpp/core.cpp:117:\nException from src/inference/src/dev/plugin.cpp:54:\n"
            "Check 'all_of(ov::element::f32, key_cache_type, value_cache_type)' failed at src/plugins/intel_cpu/"
            "executor_pa.cpp:2938:\nexpect kvcache type f32, current: bf16 , bf16\n\n")
    assert sessions.ov_reason(RuntimeError(text)) == "expect kvcache type f32, current: bf16 , bf16"
    assert sessions.ov_reason(RuntimeError("Exception from a.cpp:1:\n")) == "Exception from a.cpp:1:"
    assert sessions.ov_reason(RuntimeError("")) == "RuntimeError"


def test_ort_spinning_options_reach_the_session_config(tiny_export) -> None:
    """The spin knobs: allow_spinning, and force_spinning_stop (the interleaved comparisons' one, deploy/ort_runner.py
    interleaved_options) on the session the ort runner opens."""
    from xdeploy.deploy.registry import open_runner, runner_class
    from xdeploy.deploy.sessions import ort_session_options

    assert ort_session_options(1, spinning=False).get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert ort_session_options(1, spinning=True).get_session_config_entry("session.intra_op.allow_spinning") == "1"
    stop = "session.force_spinning_stop"
    assert ort_session_options(1, spin_between_runs=False).get_session_config_entry(stop) == "1"
    assert ort_session_options(1, spin_between_runs=True).get_session_config_entry(stop) == "0"
    for key in ("session.intra_op.allow_spinning", stop):
        with pytest.raises(RuntimeError, match="does not have configuration"):  # unset: onnxruntime's default
            ort_session_options(1).get_session_config_entry(key)
    with open_runner("ort", tiny_export("bert"), threads=1, **runner_class("ort").interleaved_options) as r:
        assert r.session.get_session_options().get_session_config_entry(stop) == "1"


def _fused_ops(model: onnx.ModelProto, so, tmp_path: Path) -> list[str]:
    """The op types onnxruntime runs after its graph optimizations under session options `so`."""
    import onnxruntime as ort

    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]


def test_cpu_sessions_leave_out_the_slow_fusions_and_the_names_still_take(tmp_path: Path) -> None:
    """ORT_CPU_SLOW_FUSIONS reach the session config ';'-separated, and each name still changes what onnxruntime
    runs: it ignores an unknown name without a word, so a renamed optimizer would silently come back."""
    h = 8
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "skip"], ["s"]),
         helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)],
        "residual_norm", [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "t", h]) for n in ("x", "skip")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "t", h])],
        [onnx.numpy_helper.from_array(np.ones(h, np.float32), "gamma"),
         onnx.numpy_helper.from_array(np.zeros(h, np.float32), "beta")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    key = "optimization.disable_specified_optimizers"
    assert sessions.ORT_CPU_SLOW_FUSIONS == ("SkipLayerNormFusion",)
    assert sessions.ort_session_options(1).get_session_config_entry(key) == "SkipLayerNormFusion"
    assert sessions.ort_session_options(1, disabled_optimizers=("A", "B")).get_session_config_entry(key) == "A;B"
    with pytest.raises(RuntimeError, match="does not have configuration"):
        sessions.ort_session_options(1, disabled_optimizers=()).get_session_config_entry(key)
    assert _fused_ops(model, sessions.ort_session_options(1), tmp_path) == ["Add", "LayerNormalization"]
    assert _fused_ops(model, sessions.ort_session_options(1, disabled_optimizers=()), tmp_path) == \
        ["SkipLayerNormalization"]
    # the C++ runtime's CPU sessions leave out the same ones (the same graph, the same vectors)
    cpp = (ROOT / "deploy/cpp/src/embedder.cpp").read_text()
    assert f'kCpuSlowFusions = "{";".join(sessions.ORT_CPU_SLOW_FUSIONS)}";' in cpp


def test_ort_runner_fusions_option_and_unknown_options(tiny_export) -> None:
    """The CPU runner's session leaves out the slow fusions unless fuse_skip_layer_norm=True; both give the same
    vectors on an int8-dynamic graph (where onnxruntime would fuse); an option it does not take is one error."""
    from xdeploy.deploy.registry import open_runner
    from xdeploy.models.spec import make_feeds

    art = tiny_export("bert", precision="int8-dynamic")
    key = "optimization.disable_specified_optimizers"
    outs = []
    for fuse in (False, True):
        with open_runner("ort", art, threads=1, fuse_skip_layer_norm=fuse) as r:
            so = r.session.get_session_options()
            if fuse:
                with pytest.raises(RuntimeError, match="does not have configuration"):
                    so.get_session_config_entry(key)
            else:
                assert so.get_session_config_entry(key) == "SkipLayerNormFusion"
            feeds = make_feeds(r.graph, {"batch": 2, "seq": 12}, seed=3)
            outs.append(r.infer(feeds))
    for name, a in outs[0].items():
        assert np.allclose(a, outs[1][name], atol=0.1), name  # int8 re-quantization may round differently
    with pytest.raises(XDeployError, match=r"unknown ort option\(s\) \['frobnicate'\]; expected opt_level"):
        open_runner("ort", art, threads=1, frobnicate=1)
