"""Small CLI reading defects (issue #31's list): help descriptions are shown as written, and an ONNX file given
where an artifact directory is expected is read as an ONNX file (tests/test_foreign_onnx.py), not called missing."""

from __future__ import annotations

import pytest

from xdeploy.cli import COMMANDS, main
from xdeploy.core.errors import XDeployError
from xdeploy.export.artifact import load_artifact


@pytest.mark.parametrize("command", [c for c, text in COMMANDS.items() if "%" in text])
def test_help_descriptions_show_percent_signs_once(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "%%" not in out and "%" in out, out[:400]


def test_an_onnx_file_is_not_called_missing(tmp_path):
    f = tmp_path / "model_quantized.onnx"
    f.write_bytes(b"\x08\x07")
    with pytest.raises(XDeployError, match=r"model_quantized.onnx: a graph with 0 input\(s\)") as e:
        load_artifact(f)
    assert "does not exist" not in str(e.value)
    with pytest.raises(XDeployError, match="does not exist"):
        load_artifact(tmp_path / "nope")
