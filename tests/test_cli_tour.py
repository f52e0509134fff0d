"""A tour of every CLI subcommand with bad arguments: one line on stderr, exit 2, never a traceback."""

from __future__ import annotations

import io
import sys

import pytest

from xdeploy.cli import COMMANDS, main

NOPE = "/nonexistent/xdeploy-artifact"
BAD = {
    "models": [["--bogus"], ["--json", "/proc/version/x.json"]],
    "export": [["--bogus"], ["llama"], ["gpt", "--opset", "abc"], ["gpt", "--precision", "fp3"],
               ["bert", "--checkpoint", NOPE]],
    "convert": [["--bogus"], [NOPE, "--out", "/tmp/xdeploy-tour-out"]],
    "generate": [["--bogus"], [NOPE], ["gpt", "--preset", "tiny", "--new-tokens", "-5"],
                 ["gpt", "--preset", "tiny", "--prompt", "hello"], ["gpt", "--runner", "nope"]],
    "embed": [["--bogus"], [NOPE]],
    "run": [["--bogus"], ["--models", "llama"]],
    "report": [["--bogus"], ["compare", NOPE, NOPE], ["render", NOPE]],
    "parity": [["--bogus"], [NOPE], ["gpt", "--runners", "nope"], ["gpt", "--shapes", "2by3"],
               ["gpt", "--precision", "fp64"]],
    "bench": [["--bogus"], [NOPE], ["bert", "--batch", "abc"], ["bert", "--runners", "nope"]],
    "roofline": [["--bogus"]],
    "scale": [["--bogus"], ["llama"], ["bert", "--max-t", "abc"]],
    "triton": [["--bogus"], [NOPE, "--out", "/tmp/xdeploy-tour-repo"]],
    "serve": [["--bogus"], [NOPE], [NOPE, "--http-port", "99999"]],
    "loadtest": [["--bogus"], [NOPE], ["http://10.1.2.3:8000"]],
    "doctor": [["--bogus"]],  # `doctor --gpu` on a machine without a GPU: tests/test_tensorrt_logic.py
}
CASES = [(cmd, args) for cmd, variants in BAD.items() for args in variants]


def test_every_command_is_toured():
    assert set(BAD) == set(COMMANDS)


@pytest.mark.parametrize(("cmd", "args"), CASES, ids=[" ".join([c, *a]) for c, a in CASES])
def test_bad_arguments_give_one_line_and_exit_2(cmd, args, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    try:
        code = main([cmd, *args])
    except SystemExit as e:  # argparse errors
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2, (code, err)
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("xdeploy")
