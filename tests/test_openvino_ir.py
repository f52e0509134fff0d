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


def test_only_fp32_artifacts_carry_an_ir(ir_artifact: Path, tmp_path: Path) -> None:
    with pytest.raises(XDeployError, match="fp32 artifacts only"):
        export(MODEL, preset="tiny", out=tmp_path / "i8", precision="int8", openvino_ir=True)
    conv = load_artifact(convert_artifact(ir_artifact, tmp_path / "c8", "int8"))
    assert "openvino" not in conv.manifest and not any(f.startswith("openvino/") for f in conv.manifest["files"])
    r = open_runner("ov", conv, threads=1)
    assert r.graph_format == "onnx"
    with pytest.raises(XDeployError, match="carries no OpenVINO IR"):
        open_runner("ov", conv, threads=1, format="ir")
    with pytest.raises(XDeployError, match="ov graph format"):
        open_runner("ov", conv, threads=1, format="xml")


def test_the_ir_is_the_default_where_a_runner_reads_it() -> None:
    """`xdeploy export` writes the IR for fp32 unless told not to (never for other precisions); `xdeploy run`
    writes it when a selected runner compiles it (the runner class says so, no runner name in the pipeline)."""
    from xdeploy.cli import build_parser
    from xdeploy.commands.export import openvino_ir
    from xdeploy.pipeline import openvino_ir_wanted

    def wanted(*argv: str) -> bool:
        return openvino_ir(build_parser("export").parse_args(["export", MODEL, *argv]))

    assert wanted() and wanted("--precision", "fp32")
    assert not wanted("--no-openvino-ir")
    assert not wanted("--precision", "int8") and not wanted("--precision", "fp16")
    assert wanted("--precision", "int8", "--openvino-ir")  # asked for: export() refuses it with one line
    assert openvino_ir_wanted(("ort", "ov:bf16")) and openvino_ir_wanted(("ov",))
    assert not openvino_ir_wanted(("ort",)) and not openvino_ir_wanted(("ort", "torch"))
