"""The `trt` runner's whole runtime path on CPU, against SIMULATED TensorRT (tests/sim_tensorrt.py): build ->
engine cache -> deserialize -> context -> set_input_shape -> set_tensor_address -> execute_async_v3 -> outputs,
with "device" buffers in host memory behind the runner's DeviceBuffers seam.

The simulated engine executes the ONNX graph with onnxruntime on CPU, so these tests check OUR code around
TensorRT (shapes, addresses, copies, devices, caches, binding, decoding loops) with the same parity and KV-cache
criteria the CPU runners meet. They are not TensorRT verification: TensorRT's kernels and precision never run
here (the `gpu`-marked tests and `make gpu-check` do that on an NVIDIA machine)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from sim_tensorrt import make_simulated_tensorrt, simulated_backend
from test_runners import _close

from xdeploy.core.errors import XDeployError
from xdeploy.deploy.generate import GenerationConfig, Generator
from xdeploy.deploy.registry import open_runner
from xdeploy.export.artifact import load_artifact, write_manifest_files
from xdeploy.export.convert import convert_artifact
from xdeploy.models.registry import MODELS
from xdeploy.models.spec import DEFAULT_TOLERANCES, make_feeds

SIZES = {"batch": 2, "seq": 5, "src_seq": 4, "cache": 3, "step": 2}  # step: gpt decode takes 2 new tokens
GENERATES = [m for m in MODELS if any(g.name == "decode" for g in MODELS[m].spec(MODELS[m].presets["tiny"]).graphs)]


def _slow(model: str, precision: str) -> list:
    # as in tests/test_runners.py: the encoder-decoder's fp16 conversion (3 graphs, AMP search) costs ~70 s here
    return [pytest.mark.slow] if model == "transformer" and precision == "fp16" else []


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_export):
    """(model, precision) -> artifact, exported lazily once per module; "qdq" is made from the fp32 one."""
    cache: dict[tuple[str, str], object] = {}
    root = tmp_path_factory.mktemp("simtrt")

    def get(model: str, precision: str):
        if (model, precision) not in cache:
            out = root / f"{model}-{precision}"
            if precision == "qdq":
                cache[model, precision] = qdq_artifact(get(model, "fp32"), out)
            elif precision == "dynamic-int8":
                cache[model, precision] = quantized_artifact(get(model, "fp32"), out, static=False)
            elif precision == "fp32":
                cache[model, precision] = load_artifact(tiny_export(model))  # shared read-only (conftest.py)
            else:  # the same conversion `export --precision` applies, without tracing the model again
                cache[model, precision] = load_artifact(convert_artifact(get(model, "fp32").path, out, precision))
        return cache[model, precision]

    return get


def qdq_artifact(src, out):
    """A static Q/DQ int8 artifact the way TensorRT takes them (explicit quantization): symmetric signed int8
    activations and weights on MatMul/Gemm (TensorRT requires zero points of 0), calibrated on seeded feeds.
    Stands in for the int8 engineer's static Q/DQ export (#16) until it lands."""
    return quantized_artifact(src, out, static=True)


def quantized_artifact(src, out, *, static: bool):
    """An int8 copy of an fp32 artifact: static Q/DQ (above) or onnxruntime dynamic quantization
    (DynamicQuantizeLinear + MatMulInteger), made here so the test does not depend on which one `export
    --precision int8` produces."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    class Feeds(CalibrationDataReader):
        def __init__(self, graph) -> None:
            self.it = iter([make_feeds(graph, SIZES, seed=s) for s in range(4)])

        def get_next(self):
            return next(self.it, None)

    shutil.copytree(src.path, out)
    manifest = json.loads((out / "manifest.json").read_text())
    for g in src.spec.graphs:
        path = out / manifest["graphs"][g.name]["file"]
        if not static:
            quantize_dynamic(str(src.onnx_path(g.name)), str(path), weight_type=QuantType.QInt8,
                             op_types_to_quantize=["MatMul"])
            continue
        quantize_static(str(src.onnx_path(g.name)), str(path), Feeds(g), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                        op_types_to_quantize=["MatMul", "Gemm"],
                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
    manifest["precision"] = "int8"
    (out / "manifest.json").write_text(json.dumps(write_manifest_files(out, manifest)))
    return load_artifact(out)


@pytest.fixture(scope="module")
def reference(artifacts):
    cache: dict[tuple[str, str], tuple] = {}

    def get(model: str, graph: str):
        if (model, graph) not in cache:
            art = artifacts(model, "fp32")
            feeds = make_feeds(art.graph(graph), SIZES, seed=7)
            with open_runner("torch", art, graph) as t:
                cache[model, graph] = feeds, t.infer(feeds)
        return cache[model, graph]

    return get


MATRIX = [pytest.param(m, p, id=f"{m}-{p}", marks=_slow(m, p)) for m in MODELS for p in ("fp32", "fp16", "qdq")]


@pytest.mark.parametrize("model,precision", MATRIX)
def test_simulated_trt_matches_torch_fp32(artifacts, reference, model, precision, tmp_path):
    """Every graph of every registered model, fp32 / fp16 / Q/DQ int8 artifacts: infer(), prepare() and bind()
    through the simulated engine, held to the criterion the CPU runners meet (tests/test_runners.py)."""
    art = artifacts(model, precision)
    tol = DEFAULT_TOLERANCES["int8" if precision == "qdq" else precision]
    backend = simulated_backend()
    failures = []
    for graph in art.spec.graphs:
        feeds, ref = reference(model, graph.name)
        with open_runner("trt", art, graph.name, backend=backend, cache_dir=tmp_path) as r:
            assert r.info().precision == art.precision and r.built
            got = r.infer({k: v.copy() for k, v in feeds.items()})
            prepared = r.prepare(feeds)()
            bound = {n: np.full_like(v, 7) for n, v in got.items()}
            r.bind({k: v.copy() for k, v in feeds.items()}, bound)()
        for name in ref:
            ok, why = _close(ref[name], got[name], tol, cosine_only=tol is not DEFAULT_TOLERANCES["fp32"])
            if not ok:
                failures.append(f"{model}/{graph.name}/{name} @ {precision}: {why}")
            np.testing.assert_array_equal(r.buffers.to_host(prepared[name]), got[name])
            np.testing.assert_array_equal(bound[name], got[name])
    assert not failures, "\n".join(failures)
    assert backend.tensorrt.calls["engines_run"] >= 3 * len(art.spec.graphs)
    assert not [m for m in backend.tensorrt.log if m.startswith("[E]")]


def test_trt_fp16_variant_and_tensorrt_11(artifacts, reference, tmp_path):
    """trt:fp16 on an fp32 artifact builds weakly typed with the FP16 flag on 10.x (the simulation then runs the
    graph in fp16) and meets the fp16 tolerance; TensorRT 11's API has no flag, so the runner refuses."""
    art = artifacts("bert", "fp32")
    feeds, ref = reference("bert", "model")
    sim = make_simulated_tensorrt("10.13.0")
    with open_runner("trt:fp16", art, backend=simulated_backend(sim), cache_dir=tmp_path) as r:
        got = r.infer(feeds)
        assert r.info().precision == "fp16" and sim.calls["flags"] == ["FP16"]
    with open_runner("trt", art, backend=simulated_backend(sim), cache_dir=tmp_path) as r:
        exact = r.infer(feeds)
    for name in ref:
        assert _close(ref[name], got[name], DEFAULT_TOLERANCES["fp16"], cosine_only=True)[0], name
        assert got[name].dtype == np.float32 and not np.array_equal(got[name], exact[name])  # fp16 arithmetic
    with pytest.raises(XDeployError, match="no FP16 builder flag"):
        open_runner("trt:fp16", art, backend=simulated_backend(version="11.1.0"), cache_dir=tmp_path)
    with open_runner("trt", artifacts("bert", "qdq"), backend=simulated_backend(version="11.1.0"),
                     cache_dir=tmp_path) as r:  # Q/DQ on 11: strongly typed, no INT8 flag to set
        assert r.info().versions["tensorrt"] == "11.1.0+sim" and r.infer(feeds)


def test_dynamic_int8_artifact_is_refused_by_the_parser(artifacts, tmp_path):
    """onnxruntime dynamic quantization (DynamicQuantizeLinear / MatMulInteger) has no TensorRT importer: the
    runner says so before building, and the simulated parser refuses the graph on its own as TensorRT's would."""
    from xdeploy.deploy.trt_runner import build_engine
    from xdeploy.export.tensorrt import BuildPlan, int8_format, profile_shapes

    art = artifacts("bert", "dynamic-int8")
    assert int8_format(art.onnx_path()) == "dynamic" and int8_format(artifacts("bert", "qdq").onnx_path()) == "qdq"
    assert int8_format(artifacts("bert", "fp32").onnx_path()) is None
    with pytest.raises(XDeployError, match="needs a static Q/DQ int8 artifact.* is dynamic int8") as e:
        open_runner("trt", art, backend=simulated_backend(), cache_dir=tmp_path / "c")
    assert "\n" not in str(e.value)
    # what `export/convert --precision int8-dynamic` writes is refused the same way (its precision is not "int8")
    named = artifacts("bert", "int8-dynamic")
    assert named.precision == "int8-dynamic"
    with pytest.raises(XDeployError, match="needs a static Q/DQ int8 artifact.* is dynamic int8"):
        open_runner("trt", named, backend=simulated_backend(), cache_dir=tmp_path / "c2")
    with pytest.raises(XDeployError, match="TensorRT cannot parse .*(DynamicQuantizeLinear|MatMulInteger)"):
        build_engine(make_simulated_tensorrt(), art.onnx_path(), profile_shapes(art.graph(), art.spec.axes),
                     BuildPlan(True, False, "int8"), tmp_path / "tc")


@pytest.mark.parametrize("model", GENERATES)
def test_simulated_trt_kv_cache_decoding_equals_ort(artifacts, model, tmp_path):
    """Greedy, seeded sampling and beam search through the KV-cache loop (prefill + decode engines, bind() on
    caller buffers, beam reorders) give ort's tokens exactly (the decode tests the CPU runners pass)."""
    art = artifacts(model, "fp32")
    prompts = [[5, 9, 13, 40, 77, 21], [30, 44, 6]]
    configs = [GenerationConfig(max_new_tokens=10),
               GenerationConfig(max_new_tokens=10, do_sample=True, temperature=30.0, seed=3, eos_token_id=-1),
               GenerationConfig(max_new_tokens=5, num_beams=3, eos_token_id=-1)]
    with Generator(art, "ort") as g:
        want = [g.generate(prompts, c) for c in configs]
    backend = simulated_backend()
    with Generator(art, "trt", backend=backend, cache_dir=tmp_path) as g:
        assert g.decode is not None and g.decode.info().runner == "trt"
        got = [g.generate(prompts, c) for c in configs]
    for w, r in zip(want, got):
        assert r.tokens == w.tokens
    assert np.allclose(got[2].scores, want[2].scores, atol=1e-4)
    assert len({t for row in got[1].tokens for t in row}) > 5  # sampling exercised many tokens
    assert not [m for m in backend.tensorrt.log if m.startswith("[E]")]


# ------------------------------------------------------------------------------------ runner defects ----

def test_engine_is_built_loaded_and_launched_on_the_runner_device(artifacts, tmp_path):
    """#18 defect 1: the engine, its context and every launch belong to the device the runner was asked for; the
    simulated CUDA runtime refuses a launch with another device current, as a real engine would fail."""
    art = artifacts("vit", "fp32")
    feeds = make_feeds(art.graph(), SIZES, seed=1)
    sim = make_simulated_tensorrt()
    with open_runner("ort", art) as o:
        want = o.infer(feeds)
    with open_runner("trt", art, backend=simulated_backend(sim), cache_dir=tmp_path, device=1) as r:
        assert r.engine.device == 1 and sim.cudart.get_device() == 0  # the caller's current device is restored
        assert r.info().device.startswith("host:1 (Simulated GPU 1")
        got = r.infer(feeds)
        np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-5)
        # the same context launched with device 0 current (what the runner did before the fix): refused
        assert not r.context.execute_async_v3(r.buffers.stream_handle)
        assert "launched with device 0 current" in sim.log[-1]
        with pytest.raises(XDeployError, match="device 5 does not exist|invalid device ordinal"):
            open_runner("trt", art, backend=simulated_backend(sim), cache_dir=tmp_path, device=5)


def test_bind_has_the_base_contiguity_and_writeability_checks(artifacts, tmp_path):
    """#18 defect 9: TrtRunner.bind refuses what Runner.bind refuses (a copy would hide the caller's writes)."""
    art = artifacts("gpt", "fp32")
    g = art.graph("decode")
    feeds = make_feeds(g, {"batch": 2, "cache": 6, "step": 1}, seed=3)
    with open_runner("trt", art, "decode", backend=simulated_backend(), cache_dir=tmp_path) as r:
        want = r.infer(feeds)
        out = {n: np.full_like(v, np.nan) for n, v in want.items()}
        call = r.bind(feeds, out)
        call()
        for n in want:
            np.testing.assert_array_equal(out[n], want[n])
        feeds["cache.0.value"] *= 0.5  # in place: the bound call must see it
        call()
        assert not np.allclose(out["logits"], want["logits"])
        np.testing.assert_array_equal(out["logits"], r.infer(feeds)["logits"])
        with pytest.raises(XDeployError, match="must be a C-contiguous"):
            r.bind(feeds | {"cache.0.key": np.asfortranarray(feeds["cache.0.key"])}, {})
        ro = np.zeros_like(want["logits"])
        ro.flags.writeable = False
        with pytest.raises(XDeployError, match="bound output 'logits' must be a writeable C-contiguous"):
            r.bind(feeds, {"logits": ro})
        with pytest.raises(XDeployError, match="bound output 'logits' must be a writeable C-contiguous"):
            r.bind(feeds, {"logits": np.asfortranarray(np.zeros((2, 1, 4, 5), np.float32))[..., 0]})
        with pytest.raises(XDeployError, match=r"bound output 'logits' must be float32 of shape \(2, 1, 512\)"):
            r.bind(feeds, {"logits": np.zeros((2, 2, 512), np.float32)})
        with pytest.raises(XDeployError, match="unknown output"):
            r.bind(feeds, {"hidden": np.zeros(1, np.float32)})


def test_engine_cache_reuse_damage_and_refused_shapes(artifacts, tmp_path):
    art = artifacts("bert", "fp32")
    feeds = make_feeds(art.graph(), SIZES, seed=2)
    backend = simulated_backend()
    with open_runner("trt", art, backend=backend, cache_dir=tmp_path) as r:
        first, edir = r.infer(feeds), r.engine_dir
        # set_input_shape returns False outside the profile: a clear error, never a launch on stale shapes
        refused = r"refused shape \(1, 999\) for input 'input_ids'.*\(1, 1\)\.\.\(64, 128\)"
        with pytest.raises(XDeployError, match=refused):
            r._set_shapes({"input_ids": np.zeros((1, 999), np.int64)})
        assert not r.context.set_tensor_address("no_such_tensor", 1)
    with open_runner("trt", art, backend=backend, cache_dir=tmp_path) as r:
        assert not r.built  # same key: loaded from the cache
        np.testing.assert_array_equal(r.infer(feeds)["pooler_output"], first["pooler_output"])
    plan = edir / "engine.plan"
    plan.write_bytes(plan.read_bytes()[:200])  # damaged on disk: deserialize returns None -> rebuilt once
    with open_runner("trt", art, backend=backend, cache_dir=tmp_path) as r:
        assert r.built and r.engine is not None
    with open_runner("trt", art, backend=simulated_backend(version="10.14.0"), cache_dir=tmp_path) as r:
        assert r.built and r.engine_dir != edir  # another TensorRT version: its own key and directory
