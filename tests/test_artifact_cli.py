"""Artifact writing/reading, runner feed validation, and the CLI's one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

from xdeploy.cli import main
from xdeploy.core.errors import XDeployError
from xdeploy.deploy.registry import open_runner
from xdeploy.export.artifact import load_artifact
from xdeploy.export.onnx_export import export
from xdeploy.models.registry import MODELS
from xdeploy.models.spec import make_feeds


@pytest.fixture(scope="module")
def bert_art(tiny_export):
    return tiny_export("bert")


def test_artifact_layout_manifest_and_metadata(bert_art):
    art = load_artifact(bert_art)
    m = art.manifest
    # + the golden probes (tests/test_probes.py): the .npz, and raw copies of graph "model"'s for the C++ runtime
    assert {f for f in m["files"] if not f.startswith("probes/")} == {"model.onnx", "reference/model.safetensors"}
    assert "probes/probes.npz" in m["files"] and m["probes"]["file"] == "probes/probes.npz"
    assert m["axes"]["seq"] == {"min": 1, "opt": 128, "max": 128}
    assert m["graphs"]["model"]["inputs"][0]["name"] == "input_ids"
    meta = {p.key: p.value for p in onnx.load(str(bert_art / "model.onnx")).metadata_props}
    assert meta["xdeploy.model"] == "bert" and meta["xdeploy.precision"] == "fp32" and meta["xdeploy.opset"] == "23"
    # its own temporaries only: the folder is shared, and the other xdist worker may be exporting beside it
    assert not list(bert_art.parent.glob(f".{bert_art.name}.tmp*")), "temporary directories left behind"


def test_ort_matches_torch_at_several_shapes(bert_art):
    art = load_artifact(bert_art)
    with open_runner("torch", art) as t, open_runner("ort", art) as o:
        for b, s in [(1, 1), (2, 17), (4, 128)]:
            feeds = make_feeds(art.graph(), {"batch": b, "seq": s}, seed=b * s)
            rt, ro = t.infer(feeds), o.infer(feeds)
            for k in rt:
                np.testing.assert_allclose(ro[k], rt[k], atol=1e-4, rtol=1e-3)


def test_feed_validation_errors(bert_art):
    art = load_artifact(bert_art)
    good = make_feeds(art.graph(), {"batch": 2, "seq": 8})
    with open_runner("ort", art) as r:
        cases = [
            ({k: v for k, v in good.items() if k != "attention_mask"}, "missing \\['attention_mask'\\]"),
            (good | {"input_ids": good["input_ids"].astype(np.int32)}, "dtype int32; expected int64"),
            (good | {"input_ids": good["input_ids"][0]}, "rank 1"),
            (good | {k: np.zeros((2, 129), np.int64) for k in good}, "axis 'seq' is 129.*1..128"),
            (good | {"input_ids": np.zeros((0, 8), np.int64)}, "empty along axis 'batch'"),
            (good | {"attention_mask": np.ones((2, 9), np.int64)}, "axis 'seq' is 9 in 'attention_mask' but 8"),
            (good | {"input_ids": good["input_ids"] + 5000}, "ids outside 0..999"),
        ]
        for feeds, msg in cases:
            with pytest.raises(XDeployError, match=msg):
                r.infer(feeds)


def test_bind_writes_outputs_in_place(bert_art):
    art = load_artifact(bert_art)
    feeds = make_feeds(art.graph(), {"batch": 2, "seq": 8})
    out = {"pooler_output": np.zeros((2, 64), np.float32)}
    with open_runner("ort", art) as r:
        call = r.bind(feeds, out)
        call()
        np.testing.assert_allclose(out["pooler_output"], r.infer(feeds)["pooler_output"], atol=1e-6)
        feeds["input_ids"][:] = 3  # contents change between calls; the bound call must see them
        call()
        np.testing.assert_allclose(out["pooler_output"], r.infer(feeds)["pooler_output"], atol=1e-6)


def test_corrupted_and_traversing_manifests_are_refused(bert_art, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(bert_art, bad)
    with open(bad / "model.onnx", "r+b") as f:
        f.seek(1000)
        f.write(b"\x00" * 16)
    with pytest.raises(XDeployError, match="corrupted: sha256 of model.onnx"):
        load_artifact(bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["files"]["../../etc/passwd"] = "0" * 64
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(XDeployError, match="outside the artifact directory"):
        load_artifact(bad)
    del m["graphs"]
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(XDeployError, match="missing field\\(s\\): graphs"):
        load_artifact(bad)


def test_existing_artifact_needs_force(bert_art):
    with pytest.raises(XDeployError, match="already exists; pass --force"):
        export("bert", preset="tiny", out=bert_art)


@pytest.mark.parametrize(("argv", "msg"), [
    (["export", "llama"], "unknown model 'llama'"),
    (["export", "gpt", "--preset", "huge"], "unknown preset for gpt 'huge'"),
    (["export", "gpt", "--opset", "11"], "unsupported opset 11"),
    (["export", "gpt", "--precision", "fp64"], "unknown export precision 'fp64'"),
    (["export", "bert", "--checkpoint", "/nonexistent"], "checkpoint directory /nonexistent does not exist"),
    (["nonsense"], "invalid choice"),
])
def test_cli_bad_input_is_one_line_exit_2(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        sys.exit(main(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_models_json(tmp_path):
    out = tmp_path / "m.json"
    subprocess.run([sys.executable, "-m", "xdeploy.cli", "models", "--json", str(out)], check=True,
                   capture_output=True)
    rows = json.loads(out.read_text())["models"]
    assert {r["model"] for r in rows} == set(MODELS)
    assert next(r for r in rows if (r["model"], r["preset"]) == ("gpt", "small"))["params"] == 124439808
