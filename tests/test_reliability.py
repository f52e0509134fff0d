"""Faults and untrusted files: killed exports, full disks, truncated / path-traversing ONNX files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import atomic_write_json
from xdeploy.export.artifact import MANIFEST, load_artifact, write_manifest_files
from xdeploy.export.onnx_export import export


@pytest.fixture(scope="module")
def vit_art(tiny_export):
    return tiny_export("vit")


def _rehash(root: Path) -> None:
    """Make the manifest consistent again, as an attacker (or a careless tool) could."""
    m = json.loads((root / MANIFEST).read_text())
    atomic_write_json(root / MANIFEST, write_manifest_files(root, m))


def test_external_data_outside_the_artifact_is_refused(vit_art, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(vit_art, bad)
    proto = onnx.load(str(bad / "model.onnx"))
    init = max(proto.graph.initializer, key=lambda t: len(t.raw_data))
    init.ClearField("raw_data")
    init.data_location = onnx.TensorProto.EXTERNAL
    init.external_data.add(key="location", value="../../../../etc/passwd")
    onnx.save(proto, str(bad / "model.onnx"))
    _rehash(bad)
    with pytest.raises(XDeployError, match="external data '../../../../etc/passwd'.*outside the artifact"):
        load_artifact(bad)


def test_truncated_onnx_is_a_clear_error(vit_art, tmp_path):
    bad = tmp_path / "trunc"
    shutil.copytree(vit_art, bad)
    data = (bad / "model.onnx").read_bytes()
    (bad / "model.onnx").write_bytes(data[: len(data) // 3])
    with pytest.raises(XDeployError, match="corrupted: sha256 of model.onnx"):
        load_artifact(bad)
    _rehash(bad)  # even with a matching hash, the file itself is rejected before a runtime sees it
    with pytest.raises(XDeployError, match="not a readable ONNX model"):
        load_artifact(bad)


def test_sigkill_mid_export_leaves_previous_artifact_and_no_valid_partial(tmp_path, tiny_export):
    out = tmp_path / "gpt"
    shutil.copytree(tiny_export("gpt"), out)  # the previous artifact (a copy: this test replaces it)
    before = json.loads((out / MANIFEST).read_text())["files"]
    # Re-export with --force in a child and SIGKILL it while its temporary directory is being filled.
    child = subprocess.Popen([sys.executable, "-m", "xdeploy.cli", "export", "gpt", "--preset", "tiny", "--fresh",
                              "--out", str(out), "--force"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(p.name.startswith(".gpt.tmp-") and any(p.iterdir())
                                                  for p in tmp_path.iterdir()):
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert json.loads((out / MANIFEST).read_text())["files"] == before
    load_artifact(out)  # the previous artifact is intact and valid
    for p in tmp_path.iterdir():  # a leftover temp dir never looks like an artifact
        if p != out:
            assert p.name.startswith(".gpt.tmp-")
            with pytest.raises(XDeployError):
                load_artifact(p)
    # the next export to the same target starts by removing the killed writer's temporary: nothing is left
    export("gpt", preset="tiny", out=out, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["gpt"]
    load_artifact(out)


@pytest.fixture
def small_disk(tmp_path):
    d = tmp_path / "disk"
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(d)],
                                           capture_output=True).returncode:
        pytest.skip("needs root to mount a size-limited tmpfs")
    yield d
    subprocess.run(["umount", str(d)], check=False)


def test_full_disk_is_a_clear_error_and_leaves_nothing(small_disk, monkeypatch):
    from xdeploy.export import onnx_export

    # refused before any byte: the export's upper bound of what it writes does not fit (core/fsutil.require_space)
    with pytest.raises(XDeployError, match="not enough disk space for exporting .* is free there"):
        export("gpt", preset="tiny", out=small_disk / "gpt")
    assert list(small_disk.iterdir()) == []
    # a disk that fills after that check (another writer beside it): the write itself is a clear error
    monkeypatch.setattr(onnx_export, "require_space", lambda needs, what: None)
    with pytest.raises(XDeployError, match="No space left on device|cannot write"):
        export("gpt", preset="tiny", out=small_disk / "gpt")
    assert list(small_disk.iterdir()) == []
