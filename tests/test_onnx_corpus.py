"""Every xdeploy command on every ONNX model of onnx's own backend test corpus (the onnx wheel carries it): a model a
user brings must end in a result or in one error line, never a traceback. Marked slow (~4 min on 2 cores for the
149 models x 7 commands): `pytest -m slow tests/test_onnx_corpus.py`. The few models whose crashes this found are
held in `make test` by tests/test_foreign_onnx.py `test_onnxs_own_test_models_end_cleanly`."""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import onnx
import pytest

from xdeploy.cli import main

ROOT = Path(onnx.__file__).parent / "backend" / "test" / "data"
MODELS = sorted(ROOT.glob("*/*/model.onnx")) + sorted(ROOT.glob("light/*.onnx"))
COMMANDS = {
    "parity": "parity {m}",
    "bench": "bench {m} --no-isolate --max-seconds 0.2 --min-iters 3 --max-iters 5 --warmup 1 --no-roofline",
    "fp16": "convert {m} --precision fp16 --out {w}/fp16",
    "int8-dynamic": "convert {m} --precision int8-dynamic --out {w}/int8-dynamic",
    "int8": "convert {m} --precision int8 --out {w}/int8 --no-sensitivity",
    "verify": "verify {w}/fp16",  # the fp16 conversion's result, where it was written
    "embed": "embed {m} --input {w}/text.txt --out {w}/vectors.npy",
}


def _label(p: Path) -> str:
    return p.parent.name if p.name == "model.onnx" else p.stem


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS, ids=[_label(p) for p in MODELS])
def test_every_command_ends_in_a_result_or_one_line(model, tmp_path):
    src = tmp_path / "m" / model.name  # a copy: the installed package stays out of reach
    src.parent.mkdir()
    shutil.copy(model, src)
    (tmp_path / "text.txt").write_text("hello world\n")
    for name, command in COMMANDS.items():
        argv = [x.replace("{m}", str(src)).replace("{w}", str(tmp_path)) for x in command.split()]
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            rc = main(argv)  # a traceback fails the test here
        lines = [x for x in err.getvalue().splitlines() if "error" in x.lower()]
        assert rc in (0, 1, 2), (name, rc)  # 1: a check failed (a verdict); 2: refused
        assert rc != 2 or len(lines) == 1, (name, lines)
