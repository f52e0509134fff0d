"""TensorRT / GPU-provider logic on CPU: profiles from manifest axes, cache keys and rebuild-on-mismatch, strong
typing vs the FP16 flag across TensorRT 10/11, TF32, timing caches, trtexec command lines, onnxruntime GPU
provider options, Triton's TensorRT accelerator config, and the GPU make targets.

Builder-driving code runs against tests/sim_tensorrt.py, a SIMULATED tensorrt module that follows the real API's
failure behaviour (None / False returns, device binding) and executes engines with onnxruntime on CPU: that
checks our code around TensorRT, never TensorRT itself. The `trt` runner's full runtime path (parity and
KV-cache decoding on every registered model) is in tests/test_trt_simulated.py. The real hardware path is the
`gpu`-marked test at the end (skipped without an NVIDIA GPU)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from sim_tensorrt import make_simulated_tensorrt, simulated_backend

from xdeploy.core.errors import XDeployError
from xdeploy.deploy.ort_gpu_runner import (
    check_available,
    create_cache_dirs,
    host_products_note,
    ort_trt_cache_dir,
    provider_list,
)
from xdeploy.deploy.trt_runner import attach_timing_cache, build_engine
from xdeploy.export.tensorrt import (
    BuildPlan,
    EngineKey,
    ShapeRange,
    build_plan,
    cached_engine,
    engine_dir,
    format_shapes,
    profile_shapes,
    timing_cache_path,
    trtexec_command,
)
from xdeploy.models.registry import MODELS, get_config, get_family
from xdeploy.models.spec import Axis, Graph, TensorSpec

ROOT = Path(__file__).resolve().parents[1]


def _spec(model: str):
    return get_family(model).spec(get_config(model, "tiny"))


def _tiny_onnx(path: Path, *, op: str = "Relu") -> Path:
    """y = op(x) with x [batch, 4] float32 (dynamic batch): the smallest graph the simulation can build."""
    if op == "MatMulInteger":  # what onnxruntime's dynamic int8 quantization emits; TensorRT has no importer
        nodes = [helper.make_node("Cast", ["x"], ["xq"], to=TensorProto.UINT8),
                 helper.make_node("MatMulInteger", ["xq", "w"], ["yi"]),
                 helper.make_node("Cast", ["yi"], ["y"], to=TensorProto.FLOAT)]
        inits = [helper.make_tensor("w", TensorProto.UINT8, [4, 4], [1] * 16)]
    else:
        nodes, inits = [helper.make_node(op, ["x"], ["y"])], []
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


PROFILE = (ShapeRange("x", (1, 4), (2, 4), (8, 4)),)


# ------------------------------------------------------------------------------------------- pure logic ----

def test_profiles_follow_manifest_axes_for_every_graph():
    for model in MODELS:  # every registered family
        spec = _spec(model)
        for g in spec.graphs:
            profiles = profile_shapes(g, spec.axes)
            assert [p.name for p in profiles] == [t.name for t in g.inputs]
            for p, t in zip(profiles, g.inputs):
                for which in ("min", "opt", "max"):
                    want = tuple(d if isinstance(d, int) else getattr(spec.axes[d], which) for d in t.dims)
                    assert getattr(p, which) == want, (model, g.name, t.name, which)
                assert all(a <= b <= c for a, b, c in zip(p.min, p.opt, p.max))
    # inputs sharing an axis get the same size at each profile point (input_ids / attention_mask)
    bert = _spec("bert")
    ids, mask, _ = profile_shapes(bert.graph("model"), bert.axes)
    assert ids.min == mask.min == (1, 1) and ids.opt == mask.opt == (1, 128) and ids.max == (64, 128)


def test_profile_with_undeclared_axis_is_a_clear_error():
    g = Graph("model", "forward", (TensorSpec("x", "float32", ("batch", "time")),), ())
    with pytest.raises(XDeployError, match="axis 'time'"):
        profile_shapes(g, {"batch": Axis(1, 1, 8)})


def test_shape_strings_use_trtexec_syntax():
    ps = (ShapeRange("input_ids", (1, 1), (1, 128), (64, 128)), ShapeRange("pixel_values", (1, 3, 32, 32),
                                                                            (1, 3, 32, 32), (8, 3, 32, 32)))
    assert format_shapes(ps, "min") == "input_ids:1x1,pixel_values:1x3x32x32"
    assert format_shapes(ps, "max") == "input_ids:64x128,pixel_values:8x3x32x32"


@pytest.mark.parametrize("variant,art,has_fp16,want", [
    ("", "fp32", True, BuildPlan(True, False, "fp32")),
    ("", "fp16", False, BuildPlan(True, False, "fp16")),
    ("", "int8", True, BuildPlan(True, False, "int8")),  # Q/DQ: explicit quantization, no INT8 flag
    ("fp16", "fp16", False, BuildPlan(True, False, "fp16")),  # already fp16: strong typing, no flag needed
    ("fp16", "fp32", True, BuildPlan(False, True, "fp16")),  # TensorRT 10: weak typing + FP16 flag
])
def test_build_plan(variant, art, has_fp16, want):
    plan = build_plan(variant, art, has_fp16_flag=has_fp16)
    assert plan == want and plan.tf32 is False  # fp32 tensors compute in fp32 in every plan


def test_build_plan_refuses_fp16_flag_on_tensorrt_11():
    with pytest.raises(XDeployError, match="no FP16 builder flag.*--precision fp16"):
        build_plan("fp16", "fp32", has_fp16_flag=False)
    with pytest.raises(XDeployError, match="no variant 'int8'"):
        build_plan("int8", "fp32", has_fp16_flag=True)


def _key(**kw) -> EngineKey:
    base = dict(onnx_sha256="a" * 64, trt_version="10.13.0", gpu_name="NVIDIA L4", compute_capability="8.9",
                profiles=(ShapeRange("x", (1, 1), (1, 8), (4, 8)),), plan=BuildPlan(True, False, "fp32"))
    return EngineKey(**(base | kw))


def test_engine_key_changes_with_every_field():
    k = _key()
    assert k.digest == _key().digest and len(k.digest) == 64
    variants = [_key(onnx_sha256="b" * 64), _key(trt_version="11.4.0"), _key(gpu_name="NVIDIA A100"),
                _key(compute_capability="8.0"), _key(profiles=(ShapeRange("x", (1, 1), (1, 8), (8, 8)),)),
                _key(plan=BuildPlan(False, True, "fp16")), _key(workspace_mib=1024),
                _key(plan=BuildPlan(True, False, "fp32", tf32=True))]  # TF32 belongs in the key (#18 defect 2)
    digests = {v.digest for v in variants} | {k.digest}
    assert len(digests) == len(variants) + 1


def test_engine_cache_reuses_and_rebuilds_on_mismatch(tmp_path):
    builds = []

    def build(tag):
        return lambda: builds.append(tag) or f"engine-{tag}".encode()

    k = _key()
    d = engine_dir(tmp_path, "bert", "model", "fp32", k)
    assert d.parent == tmp_path and d.name.startswith("bert-model-fp32-")
    blob, built = cached_engine(d, k, build(1), ["trtexec", "--onnx=m.onnx"])
    assert (blob, built) == (b"engine-1", True)
    blob, built = cached_engine(d, k, build(2))
    assert (blob, built, builds) == (b"engine-1", False, [1])  # same key: read back, no build
    meta = json.loads((d / "engine.json").read_text())
    assert meta["key"] == k.digest and meta["trt_version"] == "10.13.0" and meta["gpu_name"] == "NVIDIA L4"
    # a different key in the same directory (e.g. TensorRT upgraded): stale engine is rebuilt, not loaded
    k2 = _key(trt_version="10.14.1")
    blob, built = cached_engine(d, k2, build(3))
    assert (blob, built, builds) == (b"engine-3", True, [1, 3])
    # a crash between writing the plan and the record leaves no record: rebuilt next time
    (d / "engine.json").unlink()
    assert cached_engine(d, k2, build(4))[1] is True


def test_timing_cache_path_is_per_gpu_and_version(tmp_path):
    a = timing_cache_path(tmp_path, "10.13.0", "NVIDIA L4", "8.9")
    assert a.name == "timing-trt10.13.0-nvidia-l4-sm8.9.cache"
    assert a != timing_cache_path(tmp_path, "10.13.0", "NVIDIA A100-SXM4-80GB", "8.0")


def test_trtexec_command_lines():
    spec = _spec("bert")
    prof = profile_shapes(spec.graph("model"), spec.axes)
    cmd = trtexec_command("/a/model.onnx", "/c/engine.plan", prof, BuildPlan(True, False, "fp32"), "10.13.0",
                          timing_cache="/c/t.cache", workspace_mib=2048)
    assert cmd == ["trtexec", "--onnx=/a/model.onnx", "--saveEngine=/c/engine.plan",
                   "--minShapes=input_ids:1x1,attention_mask:1x1,token_type_ids:1x1",
                   "--optShapes=input_ids:1x128,attention_mask:1x128,token_type_ids:1x128",
                   "--maxShapes=input_ids:64x128,attention_mask:64x128,token_type_ids:64x128",
                   "--stronglyTyped", "--noTF32", "--timingCacheFile=/c/t.cache", "--memPoolSize=workspace:2048M"]
    weak = trtexec_command("m.onnx", "e.plan", prof, BuildPlan(False, True, "fp16"), "10.9.0")
    assert "--fp16" in weak and "--stronglyTyped" not in weak
    # TensorRT 11: always strongly typed; --fp16 is gone and --stronglyTyped a deprecated no-op, so neither
    t11 = trtexec_command("m.onnx", "e.plan", prof, BuildPlan(True, False, "fp16"), "11.4.0")
    assert not any(a in t11 for a in ("--fp16", "--stronglyTyped")) and "--noTF32" in t11
    assert "--noTF32" not in trtexec_command("m.onnx", "e.plan", prof, BuildPlan(True, False, "fp32", tf32=True),
                                             "11.4.0")
    with pytest.raises(XDeployError):
        trtexec_command("m.onnx", "e.plan", prof, BuildPlan(False, True, "fp16"), "11.4.0")
    # a fully static graph gets no shape flags; paths with spaces survive shell quoting
    static = (ShapeRange("x", (1, 3), (1, 3), (1, 3)),)
    cmd = trtexec_command("my dir/m.onnx", "e.plan", static, BuildPlan(True, False, "fp32"), "10.13.0")
    assert not any(a.startswith("--minShapes") for a in cmd)
    assert shlex.split(shlex.join(cmd))[1] == "--onnx=my dir/m.onnx"


# ---------------------------------------------------------------------- building (simulated TensorRT) ----

def _entries(path: Path) -> list[str]:
    blob = path.read_bytes()
    return json.loads(blob[blob.index(b"\n") + 1:])["entries"]


@pytest.mark.parametrize("version", ["10.13.0", "11.1.0"])
def test_build_engine_with_simulated_tensorrt(tmp_path, version):
    """Our builder calls against the SIMULATED tensorrt (not a TensorRT verification)."""
    trt = make_simulated_tensorrt(version)
    onnx_path = _tiny_onnx(tmp_path / "model.onnx")
    plan = build_plan("", "fp32", has_fp16_flag=hasattr(trt.BuilderFlag, "FP16"))
    tc = tmp_path / "timing.cache"
    blob = build_engine(trt, onnx_path, PROFILE, plan, tc, workspace_mib=512)
    assert trt.Runtime(trt.Logger()).deserialize_cuda_engine(blob) is not None
    assert trt.calls["network_flags"] == 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    # no FP16 flag for a strongly typed network, and TF32 (on by default) cleared for fp32 (#18 defect 2)
    assert trt.calls["flags"] == []
    assert trt.calls["workspace"] == 512 << 20
    assert trt.calls["profiles"] == [{p.name: (p.min, p.opt, p.max) for p in PROFILE}]
    assert trt.calls["timing_cache_in"] == b"" and _entries(tc) == ["tactic-1"]
    build_engine(trt, onnx_path, PROFILE, plan, tc)  # the second build starts from the first one's timings
    assert _entries(tc) == ["tactic-1", "tactic-2"] and trt.log == []


def test_tf32_stays_only_when_the_plan_asks(tmp_path):
    trt = make_simulated_tensorrt("11.1.0")
    onnx_path = _tiny_onnx(tmp_path / "m.onnx")
    build_engine(trt, onnx_path, PROFILE, BuildPlan(True, False, "fp32", tf32=True), tmp_path / "tc")
    assert trt.calls["flags"] == ["TF32"]  # the builder's default, which fp32 plans clear


def test_timing_cache_corrupt_or_foreign_falls_back_to_empty(tmp_path, monkeypatch):
    """#18 defect 3: create_timing_cache -> None (unreadable file) and set_timing_cache -> False (another device)
    both fall back to an empty cache; with no cache at all the build still runs and nothing is written."""
    onnx_path = _tiny_onnx(tmp_path / "m.onnx")
    plan = BuildPlan(True, False, "fp32")
    tc = tmp_path / "tc"
    tc.write_bytes(b"\x00garbage from a crashed writer")
    trt = make_simulated_tensorrt()
    build_engine(trt, onnx_path, PROFILE, plan, tc)
    assert any("cannot deserialize the timing cache" in m for m in trt.log)
    assert _entries(tc) == ["tactic-1"]  # replaced by a valid cache
    # timings taken on another GPU: TensorRT refuses them (ignore_mismatch=False); start empty, overwrite
    other = make_simulated_tensorrt(devices=(("Simulated GPU B (not TensorRT)", "9.0"),))
    build_engine(other, onnx_path, PROFILE, plan, tc)
    assert any("setTimingCache" in m for m in other.log)
    assert json.loads(tc.read_bytes().split(b"\n", 1)[1])["device"].startswith("Simulated GPU B")
    assert _entries(tc) == ["tactic-1"]  # B's own first tactic, none of A's
    # a TensorRT that gives no timing cache at all: the engine is still built and the file left alone
    trt = make_simulated_tensorrt()
    make_config = trt.Builder.create_builder_config

    def no_cache(self):
        c = make_config(self)
        c.create_timing_cache = lambda blob: None
        return c

    monkeypatch.setattr(trt.Builder, "create_builder_config", no_cache)
    before = tc.read_bytes()
    assert build_engine(trt, onnx_path, PROFILE, plan, tc)
    assert tc.read_bytes() == before
    assert attach_timing_cache(trt, trt.Builder(None).create_builder_config(), tc) is None


def test_fp16_flag_only_where_it_exists(tmp_path):
    onnx_path = _tiny_onnx(tmp_path / "m.onnx")
    trt10 = make_simulated_tensorrt("10.13.0")
    plan = build_plan("fp16", "fp32", has_fp16_flag=hasattr(trt10.BuilderFlag, "FP16"))
    build_engine(trt10, onnx_path, PROFILE, plan, tmp_path / "tc")
    assert trt10.calls["flags"] == ["FP16"] and trt10.calls["network_flags"] == 0  # weakly typed
    trt11 = make_simulated_tensorrt("11.1.0")
    with pytest.raises(XDeployError, match="BuilderFlag.FP16"):
        build_engine(trt11, onnx_path, PROFILE, BuildPlan(False, True, "fp16"), tmp_path / "tc")


def test_build_failures_are_one_line_errors(tmp_path):
    onnx_path = _tiny_onnx(tmp_path / "m.onnx")
    trt = make_simulated_tensorrt()
    # a dynamic input without a profile: build_serialized_network returns None
    with pytest.raises(XDeployError, match="failed to build an engine") as e:
        build_engine(trt, onnx_path, (ShapeRange("other", (1,), (1,), (1,)),), BuildPlan(True, False, "fp32"),
                     tmp_path / "tc")
    assert "\n" not in str(e.value) and not (tmp_path / "tc").exists()


def test_parser_errors_become_one_line(tmp_path):
    onnx_path = _tiny_onnx(tmp_path / "m.onnx", op="MatMulInteger")
    trt = make_simulated_tensorrt()
    with pytest.raises(XDeployError, match="cannot parse .*MatMulInteger") as e:
        build_engine(trt, onnx_path, PROFILE, BuildPlan(True, False, "int8"), tmp_path / "tc")
    assert "\n" not in str(e.value) and trt.calls["builds"] == 0 and not (tmp_path / "tc").exists()


# ------------------------------------------------------------------- onnxruntime GPU providers, Triton ----

def test_gpu_runners_accept_the_options_they_are_timed_with():
    """Found on the first GPU run (H100): `xdeploy run` opens every runner timed beside others with its
    interleaved_options, and ort-cuda / ort-trt inherit `spin_between_runs` from `ort` but refused it, so every
    GPU bench and decode step failed. The session options go to onnxruntime's session, not to the providers."""
    from xdeploy.deploy.registry import runner_class

    for name in ("ort-cuda", "ort-trt"):
        cls = runner_class(name)
        assert cls.interleaved_options and cls.provider_options(cls.interleaved_options) == {}
        assert cls.provider_options({"cache_dir": "/c", "spinning": True}) == {"cache_dir": "/c"}
        with pytest.raises(XDeployError, match="spin_between_runs"):
            cls.provider_options({"graph_sha256": "x"})


def test_ort_gpu_provider_options(tmp_path):
    spec = _spec("bert")
    g = spec.graph("model")
    trt_list = provider_list("ort-trt", g, spec.axes, "fp16", 1, cache_dir="/tmp/c", workspace_mib=64)
    (name, opts), (fallback, cuda) = trt_list
    assert name == "TensorrtExecutionProvider" and fallback == "CUDAExecutionProvider"
    assert opts["trt_fp16_enable"] == "True" and opts["device_id"] == "1" == cuda["device_id"]
    assert opts["trt_engine_cache_enable"] == opts["trt_timing_cache_enable"] == "True"
    assert opts["trt_engine_cache_path"] == "/tmp/c" and opts["trt_max_workspace_size"] == str(64 << 20)
    prof = profile_shapes(g, spec.axes)
    for which in ("min", "opt", "max"):  # the same profile as the native trt runner
        assert opts[f"trt_profile_{which}_shapes"] == format_shapes(prof, which)
    plain = provider_list("ort-trt", g, spec.axes, "")[0][1]
    assert plain["trt_fp16_enable"] == "False" and plain["trt_int8_enable"] == "False"
    # Q/DQ int8 artifacts: explicit quantization through trt_int8_enable, no calibration table
    q = provider_list("ort-trt", g, spec.axes, "", precision="int8", int8_format="qdq", model="bert",
                      graph_sha256="f" * 64, cache_dir=tmp_path)[0][1]
    assert q["trt_int8_enable"] == "True" and "trt_int8_calibration_table_name" not in q
    # dynamic int8: no scales for TensorRT; its float subgraphs run at their own precision
    dyn = provider_list("ort-trt", g, spec.axes, "", precision="int8", int8_format="dynamic")[0][1]
    assert dyn["trt_int8_enable"] == "False"
    # the cache directory is keyed by the graph's sha256: a re-exported artifact never meets old engines
    assert q["trt_engine_cache_path"] == str(ort_trt_cache_dir(tmp_path, "bert", "model", "int8", "f" * 64))
    (cname, copts), = provider_list("ort-cuda", g, spec.axes)
    assert cname == "CUDAExecutionProvider" and copts["enable_cuda_graph"] == "0" and copts["use_tf32"] == "0"
    # #18 defect 5: CUDA graphs need fixed IO-bound device addresses on every run: ort-cuda turns them on only
    # for its own bind() path (CudaGraphs, tests/test_generate.py); the TensorRT EP's are refused, not half-enabled
    assert provider_list("ort-cuda", g, spec.axes, cuda_graph=True)[0][1]["enable_cuda_graph"] == "1"
    with pytest.raises(XDeployError, match="ort-trt' does not take cuda_graph.*expected runner ort-cuda"):
        provider_list("ort-trt", g, spec.axes, cuda_graph=True)
    with pytest.raises(XDeployError, match="no variant 'fp16'"):
        provider_list("ort-cuda", g, spec.axes, "fp16")
    with pytest.raises(XDeployError, match="unknown ort-trt option"):
        provider_list("ort-trt", g, spec.axes, "", trt_fp8=True)
    with pytest.raises(XDeployError, match="needs onnxruntime-gpu with CUDAExecutionProvider.*offers only"):
        check_available("ort-cuda", ["CPUExecutionProvider"], "1.31.1")
    check_available("ort-trt", ["TensorrtExecutionProvider", "CUDAExecutionProvider"], "1.31.1")


def test_a_gpu_runner_says_once_when_a_graphs_products_run_on_the_host(tmp_path):
    """Dynamic int8's uint8 MatMulInteger has no CUDA kernel: onnxruntime runs those products on the host without a
    word (GPT-2 small decoded at 0.22x fp32 on an H200). The GPU runners say so once per graph file; Q/DQ int8
    and float graphs run on the GPU and get no note. The format comes from the graph itself (int8_format)."""
    from xdeploy.export.tensorrt import int8_format

    # what onnxruntime's dynamic quantization writes for a product: uint8 activations into MatMulInteger
    w = helper.make_tensor("w", TensorProto.INT8, [4, 2], [1, -2, 3, -4, 5, -6, 7, -8])
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "w", "xz"], ["y"])]
    g = helper.make_graph(nodes, "dyn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 2])], [w])
    graph = str(tmp_path / "dyn.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), graph)
    fmt = int8_format(graph)
    assert fmt == "dynamic"
    note = host_products_note("ort-cuda", fmt, graph)
    assert note is not None and note.startswith(f"xdeploy: note: ort-cuda on {graph}: ") and "\n" not in note
    assert "MatMulInteger" in note and "host" in note
    assert host_products_note("ort-cuda", fmt, graph) is None  # once per (runner, graph file)
    assert host_products_note("ort-trt", fmt, graph) is not None
    for other in ("qdq", None):
        assert host_products_note("ort-cuda", other, graph + other if other else graph + "-fp32") is None


def test_ort_trt_cache_directories_are_created_with_parents(tmp_path):
    """#18 defect 4: the TensorRT EP creates one directory level only; a fresh machine's nested cache path must
    exist before the session is created."""
    spec = _spec("bert")
    nested = tmp_path / "fresh" / "home" / ".cache" / "xdeploy" / "ort-trt"
    plist = provider_list("ort-trt", spec.graph("model"), spec.axes, precision="fp32", model="bert",
                          graph_sha256="e" * 64, cache_dir=nested)
    create_cache_dirs(plist)
    assert Path(plist[0][1]["trt_engine_cache_path"]).is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(XDeployError, match="cannot create the TensorRT cache directory"):
        create_cache_dirs(provider_list("ort-trt", spec.graph("model"), spec.axes, cache_dir=tmp_path / "file" / "c"))


def test_triton_tensorrt_precision_follows_the_artifact():
    """#18 defect 8: fp32 artifacts were given precision_mode FP16 (Triton's onnxruntime backend maps FP16 ->
    trt_fp16_enable, INT8 -> trt_int8_enable, FP32 -> neither)."""
    from xdeploy.serve.triton import trt_precision_mode

    assert [trt_precision_mode(p, "qdq" if p == "int8" else None) for p in ("fp32", "fp16", "int8")] == \
        ["FP32", "FP16", "INT8"]
    with pytest.raises(XDeployError, match="unknown artifact precision for the TensorRT accelerator 'bf16'"):
        trt_precision_mode("bf16")
    with pytest.raises(XDeployError, match="needs a static Q/DQ int8 artifact; this int8 artifact is dynamic"):
        trt_precision_mode("int8", "dynamic")


# ----------------------------------------------------------------------------- GPU install and check ----

def test_gpu_extra_never_installs_both_onnxruntime_wheels():
    """#18 defect 6: onnxruntime and onnxruntime-gpu install the same package directory; the gpu extra must not
    pull onnxruntime-gpu beside the onnxruntime dependency (make gpu-env swaps them instead)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in project["dependencies"]}
    assert "onnxruntime" in base
    for extra, deps in project["optional-dependencies"].items():
        names = {d.split(">")[0].split("=")[0].split("[")[0].split(";")[0].strip() for d in deps}
        assert "onnxruntime-gpu" not in names, extra
    readme = (ROOT / "README.md").read_text()
    assert "\n## GPU notes\n" in readme and "make gpu-env" in readme  # the section pyproject points to


def test_make_gpu_check_says_in_one_line_what_is_missing(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA driver: make gpu-check would run the real check")
    for target in ("gpu-check", "gpu-env"):
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # under make test
        r = subprocess.run(["make", target], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        out = (r.stdout + r.stderr).strip()
        assert r.returncode != 0 and len(out.splitlines()) == 1, out
        assert "cannot run here: no nvidia-smi on PATH" in out and "Traceback" not in out
    assert not (ROOT / ".venv-gpu").exists()  # nothing was installed


# ------------------------------------------------------------------------- from a real artifact ----

@pytest.fixture(scope="module")
def bert_art(tiny_export):
    return tiny_export("bert")


def test_engine_setup_from_a_real_artifact_and_simulated_build(bert_art, tmp_path):
    """From manifest to engine directory: key from the ONNX file's sha256, profile from the axes, trtexec.sh
    written next to the engine, cache hit on reopen, new directory when the GPU differs (SIMULATED tensorrt)."""
    from xdeploy.core.fsutil import sha256_file
    from xdeploy.deploy.trt_runner import engine_setup
    from xdeploy.export.artifact import load_artifact

    art = load_artifact(bert_art)
    kw = dict(trt_version="10.13.0", has_fp16_flag=True, gpu_name="NVIDIA L4", compute_capability="8.9",
              cache_dir=tmp_path)
    setup = engine_setup(art, "model", "", **kw)
    assert setup.key.onnx_sha256 == sha256_file(bert_art / "model.onnx")
    assert setup.key.profiles == profile_shapes(art.graph(), art.spec.axes) and setup.plan.strongly_typed
    assert setup.engine_dir.parent == tmp_path and setup.engine_dir.name.startswith("bert-model-fp32-")
    assert setup.trtexec[1] == f"--onnx={(bert_art / 'model.onnx').resolve()}"
    assert setup.trtexec[2] == f"--saveEngine={setup.engine_dir / 'engine.plan'}"
    assert "--noTF32" in setup.trtexec
    trt = make_simulated_tensorrt("10.13.0")

    def build():
        return build_engine(trt, setup.onnx_path, setup.key.profiles, setup.plan, setup.timing_cache)

    assert cached_engine(setup.engine_dir, setup.key, build, setup.trtexec)[1] is True
    script = (setup.engine_dir / "trtexec.sh").read_text()
    assert shlex.split(script.splitlines()[-1]) == list(setup.trtexec)
    assert cached_engine(setup.engine_dir, setup.key, build, setup.trtexec)[1] is False
    assert trt.calls["builds"] == 1 and setup.timing_cache.exists()
    other = engine_setup(art, "model", "", **(kw | {"gpu_name": "NVIDIA A100", "compute_capability": "8.0"}))
    assert other.engine_dir != setup.engine_dir and other.timing_cache != setup.timing_cache
    fp16 = engine_setup(art, "model", "fp16", **kw)
    assert fp16.plan == BuildPlan(False, True, "fp16") and "--fp16" in fp16.trtexec
    with pytest.raises(XDeployError, match="no FP16 builder flag"):
        engine_setup(art, "model", "fp16", **(kw | {"trt_version": "11.4.0", "has_fp16_flag": False}))


@pytest.mark.gpu
def test_trt_engine_on_gpu_matches_ort(bert_art, tmp_path):
    """Hardware path: build, cache, reload and run a real engine; needs an NVIDIA GPU with TensorRT."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("tensorrt", reason="needs an NVIDIA GPU with TensorRT")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU with TensorRT")
    from xdeploy.deploy.registry import open_runner
    from xdeploy.models.spec import make_feeds

    art = bert_art
    feeds = make_feeds(_spec("bert").graph("model"), {"batch": 2, "seq": 16})
    with open_runner("ort", art) as o, open_runner("trt", art, cache_dir=tmp_path / "c") as t:
        assert t.built and (t.engine_dir / "trtexec.sh").read_text().count("trtexec --onnx=") == 1
        ref, got = o.infer(feeds), t.infer(feeds)
        for k in ref:
            np.testing.assert_allclose(got[k], ref[k], atol=1e-3, rtol=1e-3)
        t.prepare(feeds)()
    with open_runner("trt", art, cache_dir=tmp_path / "c") as t2:
        assert not t2.built  # same key: the cached engine is loaded


def test_simulated_backend_is_named_as_a_simulation():
    backend = simulated_backend()
    assert backend.simulated and backend.tensorrt.__version__.endswith("+sim")
    assert "not TensorRT" in backend.buffers(0).label


def test_gpu_verification_table_from_run_records():
    """make gpu-check's table, built here from the committed reference run's real records (CPU runners stand in
    for the GPU ones: same record kinds): one row per model/preset/precision/runner, parity counted, p50 kept."""
    from xdeploy.studies.gpu_check import render, verification_rows

    records = json.loads((ROOT / "reports" / "reference" / "results.json").read_text())["records"]
    rows = verification_rows(records, ["ort"], peak_mib=1234.0)
    parity = [r for r in records if r["kind"] == "parity" and r["runner"] == "ort"]
    assert rows and sum(r["parity_outputs"] for r in rows) == len(parity)
    assert sum(r["parity_passed"] for r in rows) == sum(bool(r["passed"]) for r in parity)
    assert {(r["model"], r["precision"]) for r in rows} >= {(r["model"], r["artifact_precision"]) for r in parity}
    assert all(r["runner"] == "ort" and r["gpu_memory_peak_mib"] == 1234.0 for r in rows)
    assert any(r["p50_ms"] is not None and r["p50_ms"] > 0 for r in rows)
    text = render(rows, {"summary": "3 passed", "returncode": 0}, {"gpu": "NVIDIA X"})
    assert text.count("\n| ") == len(rows) + 2 and "NVIDIA X" in text and "3 passed" in text
    assert verification_rows(records, ["trt"], 0.0) == []  # no TensorRT record exists yet
    assert "no record from the GPU runners" in render([], {}, {})


def test_gpu_verification_fails_an_fp32_kv_cache_decoding_that_leaves_pytorch():
    """The H200 run's real ort-cuda records (reports/gpu/h200-2026-11-30): every graph passed parity, yet its cache
    decoding agreed with PyTorch on 1 of 16 greedy tokens (the bind-once inputs, since fixed). The check's table
    now shows the agreement and fails an fp32 row that leaves PyTorch's tokens; fp16 rows only show theirs."""
    from xdeploy.studies.gpu_check import render, verification_rows

    run = ROOT / "reports" / "gpu" / "h200-2026-11-30" / "run-default-results.json"
    records = json.loads(run.read_text())["records"]
    rows = {(r["model"], r["precision"]): r for r in verification_rows(records, ["ort-cuda"], float("nan"))}
    assert all(r["parity_passed"] == r["parity_outputs"] > 0 for r in rows.values())
    gpt, seq2seq = rows["gpt", "fp32"], rows["transformer", "fp32"]
    assert gpt["decode_agreement"] == 1 / 16 and "greedy tokens 6.2% equal" in gpt["first_failure"]
    assert seq2seq["decode_agreement"] == 0.0 and seq2seq["first_failure"]
    assert rows["gpt", "fp16"]["decode_agreement"] < 1 and rows["gpt", "fp16"]["first_failure"] is None
    # ort-cuda's steps as CUDA graphs (since 2026-11-30 its default) name themselves in the mode: still counted
    graphed = [r | {"mode": "cache (CUDA graphs)"} if r.get("mode") == "cache" else r for r in records]
    assert verification_rows(graphed, ["ort-cuda"], 0.0) == verification_rows(records, ["ort-cuda"], 0.0)
    assert rows["bert", "fp32"]["decode_agreement"] is None and rows["bert", "fp32"]["first_failure"] is None
    assert gpt["decode_tokens_per_s"] > 0 and gpt["decode_ttft_ms"] > 0
    text = render(list(rows.values()), {}, {"gpu": "NVIDIA H200"})
    speed = f"{gpt['decode_tokens_per_s']:.1f} ({gpt['decode_ttft_ms']:.2f})"
    assert f"| 6.2% | {speed} | - | KV-cache decoding: greedy tokens 6.2% equal to PyTorch's |" in text


def test_gpu_check_names_the_runners_it_leaves_out():
    """make gpu-check runs the GPU runners this environment can open and names the others with what they lack;
    here (no GPU) every GPU spec lacks something and says what."""
    from xdeploy.studies.gpu_check import RUNNERS, render_extras, runner_gaps

    missing = runner_gaps([*RUNNERS.split(","), "torch:fp16"])
    assert set(missing) == {"trt", "ort-cuda", "ort-trt", "torch:fp16"}
    if not shutil.which("nvidia-smi"):
        assert all(missing.values()), missing
    text = render_extras({"trt": ["the tensorrt package is not installed"]}, [{"batch": 8, "error": "boom"}])
    assert "- `trt`: the tensorrt package is not installed" in text and "Timing at batch 8 failed: boom" in text


def test_gpu_check_runs_are_commands_xdeploy_run_takes():
    """gpu-check's `xdeploy run`s, as built for a lease (--skip bench), parse as the run command and become the
    run configuration asked for: the smoke presets, the GPU runner, the models, the phases left out."""
    from pathlib import Path

    from xdeploy.cli import build_parser
    from xdeploy.pipeline import RunConfig
    from xdeploy.studies.gpu_check import run_command

    cmd = run_command("default", Path("/tmp/g"), "ort-cuda", ["gpt", "transformer"], ["bench"])
    assert cmd[1:4] == ["-m", "xdeploy.cli", "run"]
    args = build_parser("run").parse_args(cmd[3:])
    assert args.smoke and args.runners == "ort-cuda" and args.models == "gpt,transformer"
    cfg = RunConfig(out=args.out, skip=tuple(args.skip.split(",")), runners=("ort-cuda",))
    assert set(cfg.skip) == {"scale", "roofline", "bench"} and not cfg.runs("bench") and cfg.runs("decode")
    assert "--full" in run_command("base", Path("/tmp/g"), "ort-cuda")
    # the smoke presets check static Q/DQ int8 on the GPU runners too (TensorRT's explicit quantization); the base
    # presets leave it out (minutes of calibration), and int8-dynamic neither TensorRT nor the CUDA provider runs
    assert args.precisions.split(",") == ["fp32", "fp16", "int8"]
    assert build_parser("run").parse_args(run_command("base", Path("/tmp/g"), "trt")[3:]).precisions == "fp32,fp16"


def test_xdeploy_doctor_lists_runner_gaps_and_refuses_gpu_check_here(capsys):
    from xdeploy.cli import main
    from xdeploy.deploy.registry import RUNNERS

    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA driver")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    lines = dict(line.split(None, 1) for line in out if not line.startswith("emulate "))
    assert set(lines) == set(RUNNERS) and lines["ort"] == "ok"
    assert [line.split()[1] for line in out if line.startswith("emulate ")] == ["avx2:"]  # the emulable classes
    for gpu_runner in ("trt", "ort-cuda", "ort-trt"):
        assert lines[gpu_runner].startswith("unavailable: no nvidia-smi on PATH")
    assert main(["doctor", "--gpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("xdeploy: error: gpu-check: cannot run here: no nvidia-smi") and "\n" not in err


def test_engine_cache_lives_under_the_one_cache_root(monkeypatch, tmp_path):
    from xdeploy.export.cache import cache_root
    from xdeploy.export.tensorrt import default_cache_root

    monkeypatch.setenv("XDEPLOY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # not used: one root for every cache
    assert default_cache_root() == cache_root() / "trt" == tmp_path / "cache" / "trt"


def test_the_gpu_decode_study_runs_its_cpu_path(tmp_path, capsys):
    """studies/gpu_decode.py is run on leased GPU machines, where a broken study wastes the lease: its whole path
    (token checks per placement, the placements' timing, the precisions' timing) runs here on `ort`, at the
    smallest preset of the first generating model, with two precisions; the tokens must agree."""
    import torch
    from families import first, smallest

    from xdeploy.export.precision import EXPORT_PRECISIONS
    from xdeploy.studies import gpu_decode

    model = first(generates=True)
    precisions = ["fp32", *(["fp16"] if "fp16" in EXPORT_PRECISIONS else [])]
    rc = gpu_decode.main(["--runner", "ort", "--models", model, "--presets", smallest(model), "--new", "4",
                          "--prompt", "6", "--max-seconds", "0.3", "--precisions", ",".join(precisions),
                          "--kernels", "--out", str(tmp_path)])
    capsys.readouterr()
    result = json.loads((tmp_path / "gpu_decode.json").read_text())
    assert rc == 0 and result["runner"] == "ort"
    assert result["checks"] and all(r["greedy_equal"] and r["beam_equal"] for r in result["checks"])
    prec = result["precisions"]
    assert set(prec["tokens_per_s"]) == set(precisions) and all(v > 0 for v in prec["tokens_per_s"].values())
    assert prec["agreement_with_torch"]["fp32"] == 1.0 and not prec["failed"]
    assert set(prec["speedups"]) == set(precisions[1:])
    if not torch.cuda.is_available():
        assert prec["kernels"].startswith("left out")
