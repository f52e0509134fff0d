"""The one artifact cache (export/cache.py): export once per key, reuse while it verifies, re-export when the
entry is damaged or the checkpoint changes. Tiny preset, real exports."""

from __future__ import annotations

import os

import pytest

from xdeploy.core.errors import XDeployError
from xdeploy.export.artifact import load_artifact
from xdeploy.export.cache import cache_root, cached_artifact
from xdeploy.models.registry import MODELS


def _first_model() -> str:
    """A registered model with a tiny preset and the fewest graphs: the quickest export (the registry decides)."""
    tiny = [name for name, family in MODELS.items() if "tiny" in family.presets]
    return min(tiny, key=lambda name: len(MODELS[name].spec(MODELS[name].presets["tiny"]).graphs))


def test_preset_entries_are_reused_and_damaged_ones_rebuilt(tmp_path):
    model = _first_model()
    logs: list[str] = []
    a = cached_artifact(model, preset="tiny", root=tmp_path, log=logs.append)
    b = cached_artifact(model, preset="tiny", root=tmp_path, log=logs.append)
    assert a == b and len(logs) == 1 and a.parent == tmp_path  # exported once, then served from the cache
    stamp = (a / "manifest.json").stat().st_mtime_ns
    onnx = next(a.glob("*.onnx"))
    onnx.write_bytes(onnx.read_bytes()[:-16])  # a truncated graph: its sha256 no longer matches the manifest
    with pytest.raises(XDeployError):
        load_artifact(a)
    c = cached_artifact(model, preset="tiny", root=tmp_path, log=logs.append)
    assert c == a and len(logs) == 2 and load_artifact(c).path == a  # exported again, verified
    assert (a / "manifest.json").stat().st_mtime_ns != stamp


def test_checkpoint_entries_follow_the_checkpoint(tmp_path):
    from tiny_text import tiny_text_checkpoint

    from xdeploy.models.checkpoint import load_checkpoint

    ck = tiny_text_checkpoint(tmp_path / "ck")
    model = load_checkpoint(ck).model
    a = cached_artifact(model, checkpoint=ck, root=tmp_path / "c")
    assert "ckpt" in a.name and cached_artifact(model, checkpoint=ck, root=tmp_path / "c") == a
    weights = next(ck.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # rewritten checkpoint
    b = cached_artifact(model, checkpoint=ck, root=tmp_path / "c")
    assert b != a and load_artifact(b).manifest["source"]["checkpoint"] == str(ck.resolve())
    with pytest.raises(XDeployError, match="does not exist"):
        cached_artifact(model, checkpoint=tmp_path / "none", root=tmp_path / "c")
    with pytest.raises(XDeployError, match="not both"):
        cached_artifact(model, checkpoint=ck, preset="tiny", root=tmp_path / "c")


def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("XDEPLOY_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("XDEPLOY_CACHE")
    assert cache_root().parts[-2:] == (".cache", "xdeploy")
