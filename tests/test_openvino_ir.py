"""The OpenVINO IR an fp32 artifact may carry (export/openvino_ir.py): written through the artifact writer,
checked at load like the ONNX graphs, compiled by the `ov` runner instead of the ONNX graph, equal to PyTorch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from xdeploy.core.errors import XDeployError
from xdeploy.deploy.registry import open_runner
from xdeploy.export import saturation
from xdeploy.export.artifact import load_artifact
from xdeploy.export.convert import convert_artifact
from xdeploy.export.onnx_export import export
from xdeploy.models import registry
from xdeploy.models.spec import make_feeds

pytest.importorskip("openvino")
# any family does (the IR path is the same for every graph): the one with the fewest graphs, for time
MODEL = min(registry.MODELS, key=lambda n: len(registry.MODELS[n].spec(registry.get_config(n, "tiny")).graphs))


@pytest.fixture(scope="module")
def ir_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(MODEL, preset="tiny", out=tmp_path_factory.mktemp("ir") / "a", openvino_ir=True)


def _feeds(art, graph):  # noqa: ANN001, ANN202
    sizes = {k: min(a.opt, 5) for k, a in art.spec.axes.items()}
    f = make_feeds(graph, sizes, seed=3)
    return {t.name: f[t.name].astype(t.dtype) for t in graph.inputs}


def test_manifest_files_and_runner_use_the_ir(ir_artifact: Path) -> None:
    art = load_artifact(ir_artifact)
    sec = art.manifest["openvino"]
    assert set(sec["graphs"]) == {g.name for g in art.spec.graphs}
    for g in sec["graphs"].values():
        assert g["xml"] in art.manifest["files"] and g["bin"] in art.manifest["files"]
    assert "openvino" in art.manifest["versions"]
    torch.manual_seed(0)
    module = registry.build(MODEL, registry.get_config(MODEL, "tiny"), seed=0)
    for graph in art.spec.graphs:
        feeds = _feeds(art, graph)
        ir = open_runner("ov:f32", art, graph=graph.name, threads=1)
        onnx_r = open_runner("ov:f32", art, graph=graph.name, threads=1, format="onnx")
        assert ir.graph_format == "ir" and onnx_r.graph_format == "onnx"
        with torch.no_grad():
            ref = getattr(module, graph.method)(*(torch.from_numpy(feeds[t.name]) for t in graph.inputs))
        ref = ref if isinstance(ref, tuple) else (ref,)
        got = ir.infer(feeds)
        for t, r in zip(graph.outputs, ref):
            np.testing.assert_allclose(got[t.name], r.numpy(), atol=1e-4, rtol=1e-3, err_msg=f"{graph.name}.{t.name}")
        ir.close()
        onnx_r.close()


def test_tampered_or_misplaced_ir_is_refused(ir_artifact: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(ir_artifact, bad)
    with open(bad / "openvino" / "model.bin", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(XDeployError, match="corrupted: sha256 of openvino/model.bin"):
        load_artifact(bad)
    out = tmp_path / "outside"
    shutil.copytree(ir_artifact, out)
    m = json.loads((out / "manifest.json").read_text())
    m["openvino"]["graphs"]["model"]["xml"] = "../elsewhere.xml"
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(XDeployError, match="invalid manifest"):
        load_artifact(out)


def test_only_fp32_fp16_int8_dynamic_and_checked_static_int8_artifacts_carry_an_ir(
        ir_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A static int8 export refuses the reference's IR; a static int8 conversion drops the fp32 IR (its weights are
    not the converted graph's) and may carry one of its own, NNCF-quantized and checked
    (test_int8_artifact_carries_a_checked_nncf_ir): without a check none is made, and the reason is recorded.
    An int8-dynamic conversion without nncf carries none. (fp16:
    test_an_fp16_artifact_carries_the_ir_with_fp16_weights; int8-dynamic with nncf:
    test_an_int8_dynamic_artifact_carries_the_ir_with_int8_weights.)"""
    with pytest.raises(XDeployError, match="carried by fp32, fp16, int8-dynamic artifacts only"):
        export(MODEL, preset="tiny", out=tmp_path / "i8", precision="int8", openvino_ir=True)
    from xdeploy.export import openvino_ir

    with monkeypatch.context() as m:
        m.setattr(openvino_ir, "nncf_available", lambda: False)  # as on an install without the extra
        dyn = load_artifact(convert_artifact(ir_artifact, tmp_path / "d8", "int8-dynamic"))
    assert "openvino" not in dyn.manifest and not any(f.startswith("openvino/") for f in dyn.manifest["files"])
    assert open_runner("ov", dyn, threads=1).graph_format == "onnx"
    conv = load_artifact(convert_artifact(ir_artifact, tmp_path / "c8", "int8"))  # no check_ir: no IR
    assert conv.manifest["openvino"]["graphs"] == {} and "no check" in conv.manifest["openvino"]["reason"]
    assert not any(f.startswith("openvino/") for f in conv.manifest["files"])
    r = open_runner("ov", conv, threads=1)
    assert r.graph_format == "onnx"
    with pytest.raises(XDeployError, match="carries no OpenVINO IR"):
        open_runner("ov", conv, threads=1, format="ir")
    with pytest.raises(XDeployError, match="ov graph format"):
        open_runner("ov", conv, threads=1, format="xml")


def _converted_and_exported(ir_artifact: Path, tmp_path: Path, precision: str):  # noqa: ANN202
    """(the fp32 source, [`precision` converted from it, `precision` exported from PyTorch with the IR], the seeded
    reference module)."""
    conv = load_artifact(convert_artifact(ir_artifact, tmp_path / f"c-{precision}", precision))
    direct = load_artifact(export(MODEL, preset="tiny", out=tmp_path / f"e-{precision}", precision=precision,
                                  openvino_ir=True))
    torch.manual_seed(0)
    return load_artifact(ir_artifact), [conv, direct], registry.build(MODEL, registry.get_config(MODEL, "tiny"), seed=0)


def _ov_ir_matches_module(art, module, what: str) -> None:  # noqa: ANN001
    """Every graph on `ov` (f32) compiles the artifact's IR and computes the module's outputs within the artifact's
    tolerance, not bit-equal to them (`what` changed the weights)."""
    for graph in art.spec.graphs:
        feeds = _feeds(art, graph)
        with open_runner("ov:f32", art, graph=graph.name, threads=1) as r:
            assert r.graph_format == "ir"
            got = r.infer(feeds)
        with torch.no_grad():
            ref = getattr(module, graph.method)(*(torch.from_numpy(feeds[t.name]) for t in graph.inputs))
        ref = ref if isinstance(ref, tuple) else (ref,)
        tol = art.tolerance  # the artifact precision's
        for t, r_ in zip(graph.outputs, ref):
            assert not np.array_equal(got[t.name], r_.numpy()), f"{t.name}: {what} changed nothing"
            np.testing.assert_allclose(got[t.name], r_.numpy(), atol=tol.atol, rtol=tol.rtol, err_msg=t.name)


def test_an_fp16_artifact_carries_the_ir_with_fp16_weights(ir_artifact: Path, tmp_path: Path) -> None:
    """fp16 from the fp32 artifact (`xdeploy convert`) and fp16 straight from PyTorch (`export --precision fp16
    --openvino-ir`) both carry every graph's IR with the weights stored as fp16: each MatMul weight an fp16
    Constant behind a Convert marked as decompression, the bin about half the fp32 one's. The ov runner compiles
    it and computes the module's outputs to fp16 rounding."""
    import openvino as ov

    src, arts, module = _converted_and_exported(ir_artifact, tmp_path, "fp16")
    for art in arts:
        sec = art.manifest["openvino"]
        assert sec["weights"] == "fp16" and "compress_to_fp16" in sec["source"]
        assert set(sec["graphs"]) == {g.name for g in art.spec.graphs}
        for name, g in sec["graphs"].items():
            assert g["xml"] in art.manifest["files"] and g["bin"] in art.manifest["files"]
            fp32_bin = (src.path / src.manifest["openvino"]["graphs"][name]["bin"]).stat().st_size
            assert (art.path / g["bin"]).stat().st_size < 0.6 * fp32_bin
            model = ov.Core().read_model(str(art.path / g["xml"]))
            weights = [m.input_value(1).get_node() for m in model.get_ops() if m.get_type_name() == "MatMul"
                       and m.input_value(1).get_node().get_type_name() == "Convert"]
            assert weights and all("decompression_0" in c.get_rt_info() and
                                   c.input_value(0).get_element_type() == ov.Type.f16 for c in weights)
        _ov_ir_matches_module(art, module, "fp16 weights")


def _u8_matmul_weights(model) -> tuple[int, int]:  # noqa: ANN001
    """(MatMuls whose weight is a constant subgraph, those of them whose weight is stored as u8)."""
    def source(node):  # noqa: ANN001, ANN202 - the Constant behind a decompression chain
        while node.get_type_name() in ("Convert", "Subtract", "Multiply", "Reshape"):
            node = node.input_value(0).get_node()
        return node

    weights = [source(m.input_value(1).get_node()) for m in model.get_ops() if m.get_type_name() == "MatMul"]
    weights = [w for w in weights if w.get_type_name() == "Constant"]
    return len(weights), sum(str(w.get_element_type()) == "<Type: 'uint8_t'>" for w in weights)


def test_an_int8_dynamic_artifact_carries_the_ir_with_int8_weights(ir_artifact: Path, tmp_path: Path) -> None:
    """int8-dynamic from the fp32 artifact (`xdeploy convert`) and straight from PyTorch (`export --precision
    int8-dynamic --openvino-ir`) both carry every graph's IR with the weights compressed to int8 by nncf (every
    constant MatMul weight stored as u8, the bin about a third of the fp32 one's). The ov runner compiles it and
    computes the module's outputs within the int8 tolerance, not bit-equal to f32."""
    import openvino as ov

    src, arts, module = _converted_and_exported(ir_artifact, tmp_path, "int8-dynamic")
    for art in arts:
        sec = art.manifest["openvino"]
        assert sec["weights"] == "int8 weight-only" and "nncf.compress_weights INT8_ASYM" in sec["source"]
        assert set(sec["graphs"]) == {g.name for g in art.spec.graphs}
        assert "nncf" in art.manifest["versions"]
        for name, g in sec["graphs"].items():
            assert g["xml"] in art.manifest["files"] and g["bin"] in art.manifest["files"]
            fp32_bin = (src.path / src.manifest["openvino"]["graphs"][name]["bin"]).stat().st_size
            assert (art.path / g["bin"]).stat().st_size < 0.45 * fp32_bin
            n, u8 = _u8_matmul_weights(ov.Core().read_model(str(art.path / g["xml"])))
            assert n and u8 == n, (name, n, u8)
        _ov_ir_matches_module(art, module, "int8 weights")


def test_a_decoders_stateful_step_gets_int8_weights_and_decodes(tmp_path: Path) -> None:
    """A decoder's int8-dynamic export with the IR: the stateful step (the `ov` decoding loop's engine cache) is
    compressed too, its golden probes pass on `ov` (the Generator verifies before it decodes), and it decodes
    through OpenVINO's PagedAttention form."""
    import openvino as ov

    from xdeploy.deploy.generate import GenerationConfig, Generator

    art = load_artifact(export("gpt", preset="tiny", out=tmp_path / "g8", precision="int8-dynamic",
                               openvino_ir=True))
    st = art.manifest["openvino"]["stateful"]
    n, u8 = _u8_matmul_weights(ov.Core().read_model(str(art.path / st["xml"])))
    assert n and u8 == n
    with Generator(art.path, "ov:f32", threads=1) as g:
        assert g.decode.graph_format == "paged"
        out = g.generate([[5, 6, 7, 8]], GenerationConfig(max_new_tokens=6, eos_token_id=-1))
    assert len(out.tokens[0]) == 6


def test_the_ir_is_the_default_where_a_runner_reads_it() -> None:
    """`xdeploy export` writes the IR for fp32 and fp16 unless told not to (never for int8); `xdeploy run`
    writes it when a selected runner compiles it (the runner class says so, no runner name in the pipeline)."""
    from xdeploy.cli import build_parser
    from xdeploy.commands.export import openvino_ir
    from xdeploy.pipeline import openvino_ir_wanted

    def wanted(*argv: str) -> bool:
        return openvino_ir(build_parser("export").parse_args(["export", MODEL, *argv]))

    assert wanted() and wanted("--precision", "fp32") and wanted("--precision", "fp16")
    assert not wanted("--no-openvino-ir") and not wanted("--precision", "fp16", "--no-openvino-ir")
    assert not wanted("--precision", "int8") and not wanted("--precision", "int8-dynamic")
    assert wanted("--precision", "int8", "--openvino-ir")  # asked for: export() refuses it with one line
    assert openvino_ir_wanted(("ort", "ov:bf16")) and openvino_ir_wanted(("ov",))
    assert not openvino_ir_wanted(("ort",)) and not openvino_ir_wanted(("ort", "torch"))


def test_the_nan_guard_after_attention_is_dropped_from_our_onnx_graphs_only(tiny_export, tmp_path: Path) -> None:
    """OpenVINO's ONNX frontend follows each opset-23 Attention with Select(IsNaN(y), 0, y); the ov runner removes
    it from graphs of our own export (finite masks: no row is all -inf), with outputs unchanged -- an empty
    (fully padded) row included -- and keeps it in a foreign graph, which may mask with -inf."""
    import onnx
    import openvino as ov

    from xdeploy.deploy.ov_runner import drop_nan_guards

    src = tiny_export("bert")
    art = load_artifact(src)
    path = art.onnx_path("model")
    n_attention = sum(n.op_type == "Attention" for n in onnx.load(path, load_external_data=False).graph.node)
    assert n_attention == registry.get_config("bert", "tiny").n_layers
    core = ov.Core()
    plain = core.read_model(str(path))
    assert sum(op.get_type_name() == "IsNaN" for op in plain.get_ops()) == n_attention  # the frontend's guards
    sizes = {k: min(a.opt, 7) for k, a in art.spec.axes.items()}
    feeds = make_feeds(art.spec.graphs[0], {**sizes, "batch": 3}, seed=5)
    feeds["attention_mask"][-1] = 0  # a fully padded row
    want = core.compile_model(plain, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(feeds)
    r = open_runner("ov:f32", art, threads=1, format="onnx")
    assert r.graph_format == "onnx" and r.nan_guards_dropped == n_attention
    kinds = [op.get_rt_info()["layerType"].astype(str) for op in r.compiled.get_runtime_model().get_ops()]
    assert "IsNaN" not in kinds and "Select" not in kinds
    got = r.infer(feeds)
    for port in want:
        name = next(iter(port.get_names()))
        np.testing.assert_allclose(got[name], want[port], atol=1e-6, err_msg=name)
        assert np.isfinite(got[name]).all()
    r.close()
    edited = core.read_model(str(path))
    assert drop_nan_guards(edited) == n_attention and drop_nan_guards(edited) == 0  # idempotent
    # the same graph as a foreign file keeps its guards
    shutil.copytree(src, tmp_path / "f")
    foreign = load_artifact(tmp_path / "f" / path.name)
    assert foreign.foreign is not None
    with open_runner("ov:f32", foreign, threads=1) as fr:
        assert fr.nan_guards_dropped == 0


# ------------------------------------------------------------------------ static int8: an NNCF-quantized IR ----

def _ir_ops(xml: Path) -> dict[str, int]:
    """op type -> count, and int8 constants ("i8"/"u8" element types), of an IR's xml."""
    import collections
    import xml.etree.ElementTree as ET

    layers = ET.parse(xml).getroot().find("layers")
    ops = collections.Counter(layer.get("type") for layer in layers)
    data = [layer.find("data") for layer in layers if layer.get("type") == "Const"]
    ops["int8 Const"] = sum(1 for d in data if d is not None and d.get("element_type") in ("i8", "u8"))
    return dict(ops)


def test_int8_artifact_carries_a_checked_nncf_ir(ir_artifact: Path, tmp_path: Path) -> None:
    """xdeploy.api's convert (the measured one) quantizes the fp32 IR with NNCF on the Q/DQ graph's calibration
    data, checks it and ships it: FakeQuantize (256 levels) and int8 weights in the xml (their saturation bound
    recorded), the files hash-checked at load, compiled by the ov runner, passing parity against PyTorch on ov and
    ov:bf16."""
    import openvino as ov

    from xdeploy import api

    src = load_artifact(ir_artifact)
    art = load_artifact(api.convert_artifact(ir_artifact, tmp_path / "c8", "int8"))
    sec = art.manifest["openvino"]
    assert set(sec["graphs"]) == {g.name for g in art.spec.graphs} and not sec["skipped"]
    assert sec["quantizer"].startswith("nncf ") and "nncf" in art.manifest["versions"]
    assert (sec["preset"], sec["model_type"], sec["weights"]) == ("performance", "transformer", "int8")
    assert sec["overflow_fix"] == "first_layer_only"  # NNCF's default, recorded
    for g in art.spec.graphs:
        # the same calibration data as the Q/DQ graph (its hash), and the check that let it ship
        assert sec["calibration"][g.name]["sha256"] == art.manifest["conversion"][g.name]["calibration"]["sha256"]
        check = sec["check"][g.name]
        assert check["passed"] and set(check["runners"]) == {"ov", "ov:bf16"}
        assert all(c >= art.tolerance.cosine for c in check["worst_cosine"].values())
        files = sec["graphs"][g.name]
        assert files["xml"] in art.manifest["files"] and files["bin"] in art.manifest["files"]
        ops, fp32_ops = _ir_ops(art.openvino_ir(g.name)), _ir_ops(src.openvino_ir(g.name))
        assert ops.get("FakeQuantize", 0) > 0 and ops["int8 Const"] > 0  # NNCF quantized activations and weights
        bound = saturation.ir_weight_bound(ov.Core().read_model(str(art.openvino_ir(g.name))))
        assert bound["int8_nodes"] > 0 and sec["saturation"][g.name] == bound  # the IR's own proof, recorded
        assert fp32_ops.get("FakeQuantize", 0) == 0 and fp32_ops["int8 Const"] == 0
        assert (art.path / files["bin"]).stat().st_size < (src.path / files["bin"]).stat().st_size
        for spec in ("ov", "ov:bf16"):
            r = open_runner(spec, art, graph=g.name, threads=1)
            assert r.graph_format == "ir" and r.info().precision == "int8"
            r.close()
    # the IR cannot mirror float nodes of the Q/DQ graph: when it kept some, the IR must be at least as close to
    # fp32 as the Q/DQ graph (here the "Q/DQ graph" is the fp32 graph itself, which no int8 IR matches)
    import onnx

    from xdeploy.export.calibration import default_calibration
    from xdeploy.verify.sensitivity import check_int8_ir

    g = art.spec.graphs[0]
    fp32 = onnx.load(str(src.onnx_path(g.name)))
    worse = check_int8_ir(fp32, art.openvino_ir(g.name), graph=g, spec=art.spec, qdq=fp32, kept_float=["a node"],
                          calibration=default_calibration(art.spec).samples[g.name], variants=("",))
    assert not worse["passed"] and "cannot mirror" in worse["reason"] and worse["qdq_worst_cosine"] > 0.9999
    report = api.check_artifact(art, ["ov", "ov:bf16"], threads=1)
    assert report.checks and report.passed, [c.reason for c in report.failures()]
    bad = tmp_path / "bad"
    shutil.copytree(art.path, bad)
    with open(bad / sec["graphs"]["model"]["bin"], "r+b") as f:
        f.seek(64)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(XDeployError, match="corrupted: sha256 of openvino/model.bin"):
        load_artifact(bad)


def test_an_8_bit_int8_ir_is_left_for_the_qdq_graph_where_it_saturates(ir_artifact: Path, tmp_path: Path) -> None:
    """NNCF's IR keeps 8-bit weights past its first layer: on AVX2-only x86 (modeled by a Zen 3 fingerprint;
    tests/test_emulate.py runs that class) its bound says it could saturate, so the ov runner compiles the 7-bit
    Q/DQ graph there instead (whose bound holds), and the guard refuses the IR when asked for by name; VNNI / AMX
    classes take it. With NNCF's overflow fix in every layer the IR's bound holds too. Read from the IR files."""
    import nncf
    import openvino as ov
    from test_saturation import XEON_AMX, ZEN3, ZEN5

    from xdeploy import api
    from xdeploy.deploy.saturation_guard import refuse_saturating_int8, saturating_bound

    int8 = load_artifact(api.convert_artifact(ir_artifact, tmp_path / "c8", "int8"))
    g = int8.spec.graphs[0]
    ir = int8.openvino_ir(g.name)
    bound = saturating_bound(int8, g.name, ZEN3, ir=ir)
    assert bound is not None and bound["max_abs_weight"] > 64 and bound["worst_pair_bound"] > 32767
    assert saturating_bound(int8, g.name, ZEN3) is None  # the Q/DQ graph: 7-bit
    with pytest.raises(XDeployError, match=r"> 32767 .* which OpenVINO on this CPU .*no VNNI or AMX") as e:
        refuse_saturating_int8(int8, g.name, ZEN3, runtime="OpenVINO", ir=ir)
    assert "\n" not in str(e.value) and e.value.exit_code == 1
    for fp in (ZEN5, XEON_AMX):
        assert saturating_bound(int8, g.name, fp, ir=ir) is None
    src = load_artifact(ir_artifact)
    samples = [_feeds(src, g) for _ in range(2)]
    fixed = nncf.quantize(ov.Core().read_model(str(src.openvino_ir(g.name))), nncf.Dataset(samples),
                          preset=nncf.QuantizationPreset.PERFORMANCE, model_type=nncf.ModelType.TRANSFORMER,
                          subset_size=len(samples), advanced_parameters=nncf.AdvancedQuantizationParameters(
                              overflow_fix=nncf.OverflowFix.ENABLE))
    ov.save_model(fixed, str(tmp_path / "ir7.xml"), compress_to_fp16=False)
    assert saturation.ir_weight_bound(fixed)["max_abs_weight"] <= 64
    assert saturating_bound(int8, g.name, ZEN3, ir=tmp_path / "ir7.xml") is None


def test_an_int8_ir_that_fails_its_check_is_left_out(ir_artifact: Path, tmp_path: Path) -> None:
    """A planted failure (a tolerance nothing quantized meets) leaves the IR out, says why, and the ov runner
    compiles the Q/DQ ONNX graph instead."""
    import functools

    from xdeploy.models.spec import Tolerance
    from xdeploy.verify.sensitivity import check_int8_ir

    impossible = functools.partial(check_int8_ir, tol=Tolerance(atol=0.0, rtol=0.0, cosine=1.0))
    art = load_artifact(convert_artifact(ir_artifact, tmp_path / "c8", "int8", check_ir=impossible))
    sec = art.manifest["openvino"]
    assert sec["graphs"] == {}
    for g in art.spec.graphs:
        assert "misses the int8 tolerance" in sec["skipped"][g.name] and not sec["check"][g.name]["passed"]
        assert open_runner("ov", art, graph=g.name, threads=1).graph_format == "onnx"
    assert not any(f.startswith("openvino/") for f in art.manifest["files"])
    assert not (art.path / "openvino").exists() or not any((art.path / "openvino").iterdir())


def test_int8_from_an_fp32_artifact_without_ir_has_none(tiny_export, tmp_path: Path) -> None:  # noqa: ANN001
    from xdeploy.verify.sensitivity import check_int8_ir

    src = tiny_export(MODEL)
    assert "openvino" not in load_artifact(src).manifest
    art = load_artifact(convert_artifact(src, tmp_path / "c8", "int8", check_ir=check_int8_ir))
    assert "openvino" not in art.manifest and not any(f.startswith("openvino/") for f in art.manifest["files"])
    assert open_runner("ov", art, threads=1).graph_format == "onnx"


def test_without_nncf_the_int8_artifact_says_why_it_has_no_ir(ir_artifact: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from xdeploy.export import openvino_ir
    from xdeploy.verify.sensitivity import check_int8_ir

    monkeypatch.setattr(openvino_ir, "nncf_available", lambda: False)  # as on an install without the extra
    art = load_artifact(convert_artifact(ir_artifact, tmp_path / "c8", "int8", check_ir=check_int8_ir))
    assert art.manifest["openvino"]["graphs"] == {} and "nncf is not installed" in art.manifest["openvino"]["reason"]
    assert not any(f.startswith("openvino/") for f in art.manifest["files"])
    assert open_runner("ov", art, threads=1).graph_format == "onnx"


TELEMETRY_PROBE = """
import os
forks = []
os.register_at_fork(after_in_parent=lambda: forks.append(1))
import torch
from xdeploy.core.deps import import_quietly
ov = import_quietly("openvino")
nncf = import_quietly("nncf")
ov.convert_model(torch.nn.Linear(4, 4), example_input=torch.zeros(1, 4))
from openvino.tools.ovc import telemetry_utils
import openvino_telemetry  # the user's own import still works afterwards
stub = nncf and isinstance(nncf.telemetry.wrapper.telemetry, nncf.telemetry.wrapper.NNCFTelemetryStub)
print(len(forks), telemetry_utils.tm.__name__, "nncf-stub" if stub else "nncf-telemetry")
"""


@pytest.mark.parametrize("opt_in", [False, True], ids=["default", "XDEPLOY_OV_TELEMETRY=1"])
def test_openvino_and_nncf_are_imported_without_their_telemetry(opt_in: bool) -> None:
    """Each telemetry event forks the process (~1 s of CPU per convert_model): xdeploy imports openvino and nncf
    through their own no-telemetry path unless the user opts in. The probe runs in a fresh interpreter (this one
    has imported openvino already) with pytest absent (nncf turns its telemetry off under pytest itself) and
    without CI variables (which turn it off too): the default must fork nothing and bind the stubs."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("CI", "TF_BUILD", "JENKINS_URL", "NNCF_CI",
                                                            "XDEPLOY_OV_TELEMETRY")}
    if opt_in:
        env["XDEPLOY_OV_TELEMETRY"] = "1"
    pytest.importorskip("nncf")
    out = subprocess.run([sys.executable, "-c", TELEMETRY_PROBE], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    forks, ovc_tm, nncf_tm = out.stdout.split()[-3:]
    if opt_in:
        assert (ovc_tm, nncf_tm) == ("openvino_telemetry", "nncf-telemetry")
    else:
        assert (forks, ovc_tm, nncf_tm) == ("0", "openvino.tools.ovc.telemetry_stub", "nncf-stub")


def test_bf16_weights_read_from_the_file_equal_those_read_through_the_map(ir_artifact: Path, tmp_path: Path) -> None:
    """export/openvino_ir.bf16_weights with the IR's path reads each weight from the .bin by its Const layer (not
    through OpenVINO's memory map, whose pages would stay resident): the same bf16 numbers as the map route, and a
    layer whose name now holds other numbers (a rewrite reusing the name) falls back to the map."""
    ov = pytest.importorskip("openvino")
    from xdeploy.export.openvino_ir import bf16_weights

    art = load_artifact(ir_artifact)
    xml = art.path / art.openvino_ir(art.spec.graphs[0].name)

    def bf16_consts(ir: Path | None) -> list[np.ndarray]:
        m = ov.Core().read_model(str(xml))
        assert bf16_weights(ov, m, ir) > 0
        return [np.asarray(op.get_data()).view(np.uint16).copy() for op in m.get_ordered_ops()
                if op.get_type_name() == "Constant" and op.get_element_type() == ov.Type.bf16]

    # every weight it rounds is found in the xml by name, at its size: the file route is the one taken
    from xdeploy.export.openvino_ir import BF16_WEIGHT_MIN_ELEMENTS, _ir_f32_constants

    layers = _ir_f32_constants(xml)
    weights = [op for op in ov.Core().read_model(str(xml)).get_ordered_ops() if op.get_type_name() == "Constant"
               and op.get_element_type() == ov.Type.f32 and op.get_data().size >= BF16_WEIGHT_MIN_ELEMENTS]
    assert weights and all(layers[op.get_friendly_name()][1] == 4 * op.get_data().size for op in weights)
    # a name used by two Const layers is ambiguous: left out (its weight is read through the map)
    twice = tmp_path / "twice.xml"
    twice.write_text('<net><layers><layer id="0" name="w" type="Const"><data element_type="f32" offset="0" '
                     'size="4"/></layer><layer id="1" name="w" type="Const"><data element_type="f32" offset="4" '
                     'size="4"/></layer><layer id="2" name="v" type="Const"><data element_type="f32" offset="8" '
                     'size="4"/></layer></layers></net>')
    assert _ir_f32_constants(twice) == {"v": (8, 4)}
    mapped = bf16_consts(None)
    assert all(np.array_equal(a, b) for a, b in zip(bf16_consts(xml), mapped, strict=True))
    # the same xml over a .bin with every byte moved by 4: the file reads find other numbers under each name
    shifted = tmp_path / xml.name
    shutil.copy(xml, shifted)
    data = xml.with_suffix(".bin").read_bytes()
    shifted.with_suffix(".bin").write_bytes(data[4:] + data[:4])
    assert all(np.array_equal(a, b) for a, b in zip(bf16_consts(shifted), mapped, strict=True))
