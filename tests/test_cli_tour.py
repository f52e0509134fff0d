"""A tour of every CLI subcommand with bad arguments: one line on stderr, exit 2, never a traceback."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest

from xdeploy.cli import COMMANDS, main
from xdeploy.core.deps import missing_package

NOPE = "/nonexistent/xdeploy-artifact"
BAD = {
    "models": [["--bogus"], ["--json", "/proc/version/x.json"]],
    "export": [["--bogus"], ["llama"], ["gpt", "--opset", "abc"], ["gpt", "--precision", "fp3"],
               ["bert", "--checkpoint", NOPE], ["gpt", "--precision", "fp16", "--int8-exclude", "node_MatMul_1"]],
    "convert": [["--bogus"], [NOPE, "--out", "/tmp/xdeploy-tour-out"],
                [NOPE, "--out", "/tmp/xdeploy-tour-out", "--precision", "int8", "--fp16-block-nodes", "n"]],
    "generate": [["--bogus"], [NOPE], ["gpt", "--preset", "tiny", "--new-tokens", "-5"],
                 ["gpt", "--preset", "tiny", "--prompt", "hello"], ["gpt", "--runner", "nope"]],
    "embed": [["--bogus"], [NOPE]],
    "run": [["--bogus"], ["--models", "llama"]],
    "report": [["--bogus"], ["compare", NOPE, NOPE], ["render", NOPE]],
    "parity": [["--bogus"], [NOPE], ["gpt", "--runners", "nope"], ["gpt", "--shapes", "2by3"],
               ["gpt", "--precision", "fp64"]],
    "verify": [["--bogus"], [NOPE], [NOPE, "--runner", "ov:fp16"], [NOPE, "--threads", "x"]],
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


def test_a_missing_package_is_one_line_naming_it():
    """In a lean environment (the serving one has no PyTorch) a command that needs torch says so in one line, exit 2,
    here while the parser is built (`models`, `run`: options from the model registry); the same handler covers an
    import while a command runs (`bench` of an artifact reads FLOPs from the model family). A module missing inside
    xdeploy or an installed package is a bug and stays a traceback."""
    code = ("import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
            "from xdeploy.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    for argv in (["models"], ["run", "--smoke"]):
        done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert done.stderr.splitlines() == [f"xdeploy: error: {argv[0]} needs the Python package 'torch', which is "
                                            "not installed here (`pip install xdeploy` installs every package it "
                                            "needs)"]
    assert missing_package(ModuleNotFoundError(name="surely_not_a_package.sub")) == "surely_not_a_package"
    assert missing_package(ModuleNotFoundError(name="xdeploy.nope")) is None
    assert missing_package(ModuleNotFoundError(name="numpy.nope")) is None


# ------------------------------------------------------------------------------------------- help ----

HELP = [["--help"], ["-h"], *([c, "--help"] for c in COMMANDS), ["report", "render", "--help"],
        ["report", "compare", "--help"]]


@pytest.mark.parametrize("argv", HELP, ids=[" ".join(a) for a in HELP])
def test_every_help_screen_renders(argv, capsys):
    """The first thing a person types: `xdeploy --help` once crashed on a bare % in a help string."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 0 and not err, err
    assert out.startswith("usage: xdeploy") and "Traceback" not in out
    if argv[0].startswith("-"):  # the top screen lists every command and documents the exit codes once
        assert all(c in out for c in COMMANDS) and "exit codes" in out and "% of GEMM peak" in out


# ---------------------------------------------------------------------------------- exit codes ----
# 0 success, 1 a verdict failed, 2 a usage/input error or nothing to do. The 2s of every command are toured
# above; the 0s and 1s live with each command's tests (test_parity, test_report, test_bench, test_embedder,
# test_generate, test_export, test_triton, test_serve); here: the cases that used to give the wrong code.

def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err.strip()


@pytest.fixture(scope="module")
def tiny_bert(tiny_export):
    return tiny_export("bert")


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory):
    from tiny_text import tiny_text_artifact

    return tiny_text_artifact(tmp_path_factory.getbasetemp())


def test_a_misspelt_runner_is_a_usage_error_not_a_parity_failure(tiny_bert, capsys):
    code, out, err = _run(["parity", str(tiny_bert), "--runners", "ov:fp16"], capsys)
    assert code == 2 and "FAIL" not in out and "no variant 'fp16'" in err and "ov:bf16" in err, (out, err)
    assert len(err.splitlines()) == 1


def test_a_tolerance_for_an_unknown_output_is_refused(tiny_bert, capsys):
    code, _, err = _run(["parity", str(tiny_bert), "--runners", "ort", "--tolerance", "nope:atol=1"], capsys)
    assert code == 2 and "unknown output(s) nope" in err and "last_hidden_state" in err, err


def test_bench_that_runs_nothing_exits_2_with_the_reason(tiny_bert, capsys):
    code, out, err = _run(["bench", str(tiny_bert), "--runners", "ort", "--seq", "9999", "--no-isolate",
                           "--no-roofline"], capsys)
    assert code == 2 and "nothing ran" in err and "seq" in err, (out, err)


def test_report_compare_of_unrelated_reports_has_nothing_to_compare(tmp_path, capsys):
    import json

    from test_report import synthetic_records

    recs = [r for r in synthetic_records() if r["kind"] in ("latency", "parity")]
    for name, rs in (("a", [r for r in recs if r["model"] == "bert"]), ("b", [r for r in recs if r["model"] == "vit"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"schema": "xdeploy-report", "version": 1,
                                                                  "meta": {}, "records": rs}))
    code, _, err = _run(["report", "compare", str(tmp_path / "a"), str(tmp_path / "b")], capsys)
    assert code == 2 and err.startswith("xdeploy: error: nothing to compare"), err


def test_generate_on_an_encoder_is_one_line(tiny_bert, capsys):
    code, _, err = _run(["generate", str(tiny_bert), "--new-tokens", "2"], capsys)
    assert code == 2 and "does not generate text" in err and len(err.splitlines()) == 1, err


def test_full_and_smoke_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--full", "--smoke"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_run_preset_sets_every_model_and_is_checked_up_front(tmp_path, capsys):
    from xdeploy.models.registry import MODELS
    from xdeploy.pipeline import RunConfig

    smallest = {f.smallest_preset for f in MODELS.values()}
    shared = smallest.pop() if len(smallest) == 1 else None  # a preset name every family has (e.g. tiny)
    if shared is not None:
        cfg = RunConfig(presets={"*": shared}, full=True)
        assert all(cfg.preset(m) == shared for m in MODELS)  # over --full's presets too
    # a preset one of the selected models lacks: exit 2 before anything runs, naming the valid ones
    name, fam = next(iter(MODELS.items()))
    other = next((p for f in MODELS.values() for p in f.presets if p not in fam.presets), None)
    if other is not None:
        code, _, err = _run(["run", "--smoke", "--models", name, "--preset", other, "--out", str(tmp_path / "r")],
                            capsys)
        assert code == 2 and f"preset of {name}" in err and ", ".join(sorted(fam.presets)) in err, err
        assert not (tmp_path / "r").exists()


def test_serve_refuses_an_artifact_it_cannot_serve_before_starting(tiny_bert, capsys):
    # no tokenizer: every request would fail, so the server must not start (embed refuses it the same way)
    code, _, err = _run(["serve", str(tiny_bert), "--http-port", "18999", "--grpc-port", "18998"], capsys)
    assert code == 2 and "no tokenizer" in err and len(err.splitlines()) == 1, err


# ----------------------------------------------------------------------------------- vocabulary ----

@pytest.mark.parametrize(("old", "new", "argv"), [
    ("--tol", "--tolerance", ["parity", "X", "--tol", "atol=1"]),
    ("--precisions", "--precision", ["run", "--precisions", "fp32"]),
    ("--model", "--model-name", ["loadtest", "X", "--model", "m"]),
    ("--name", "--model-name", ["triton", "X", "--out", "Y", "--name", "m"]),
])
def test_old_spellings_still_work_for_one_release_with_a_deprecation_line(old, new, argv, capsys):
    from xdeploy.cli import build_parser

    args = build_parser(argv[0]).parse_args(argv)
    new_args = build_parser(argv[0]).parse_args([new if a == old else a for a in argv])
    err = capsys.readouterr().err
    assert vars(args) == vars(new_args)
    assert f"{old} is deprecated" in err and f"use {new}" in err and err.count("deprecated") == 1
    help_text = build_parser(argv[0])._subparsers._group_actions[0].choices[argv[0]].format_help()
    assert new in help_text and f"{old} " not in help_text  # hidden from --help


def test_threads_means_the_same_in_every_command():
    from xdeploy.cli import build_parser
    from xdeploy.commands import THREADS_HELP, THREADS_HELP_TIMED

    seen = 0
    for cmd in COMMANDS:
        sub = build_parser(cmd)._subparsers._group_actions[0].choices[cmd]
        for a in sub._actions:
            if "--threads" in a.option_strings:
                seen += 1
                assert a.help == (THREADS_HELP_TIMED if cmd in ("bench", "run") else THREADS_HELP), cmd
                assert a.default == 0 and "default 0: automatic" in a.help, cmd
    assert seen >= 8


# -------------------------------------------------------------------------------------- output ----

def test_embed_numbers_lines_from_1_and_names_the_flag(tiny_text, tmp_path, capsys, monkeypatch):
    src = tmp_path / "in.txt"
    src.write_text("short\n" + "word " * 200 + "\n")
    code, _, err = _run(["embed", str(tiny_text), "--input", str(src), "--truncation", "error"], capsys)
    assert code == 2 and f"{src} line 2 has more than max_length" in err, err
    code, _, err = _run(["embed", str(tiny_text), "--input", str(src), "--batch-size", "100"], capsys)
    assert code == 2 and "batch size must be" in err and "batch_size" not in err, err


class _Tty(io.StringIO):
    def __init__(self, data: bytes) -> None:
        super().__init__()
        self.buffer = io.BytesIO(data)

    def isatty(self) -> bool:
        return True


def test_embed_on_a_terminal_says_it_reads_stdin(tiny_text, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", _Tty(b"hello\n"))
    code, out, err = _run(["embed", str(tiny_text)], capsys)
    assert code == 0 and "reading sentences from stdin" in err and len(out.splitlines()) == 1
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello\n")))  # a pipe: no hint
    code, out, err = _run(["embed", str(tiny_text)], capsys)
    assert code == 0 and "reading sentences" not in err


def test_report_compare_in_a_log_does_not_wrap_to_80_columns(tmp_path, capsys):
    import json

    from test_report import synthetic_records

    for name, slow in (("a", 1.0), ("b", 1.3)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(
            {"schema": "xdeploy-report", "version": 1, "meta": {}, "records": synthetic_records(slow=slow)}))
    code, out, _ = _run(["report", "compare", str(tmp_path / "a"), str(tmp_path / "b")], capsys)
    rows = [ln for ln in out.splitlines() if "regression" in ln and "%" in ln]
    assert code == 1 and rows and "…" not in out, out
    assert max(len(ln) for ln in out.splitlines()) > 80


def test_a_server_that_fails_to_start_says_why_and_names_log(tiny_text):
    """The server's own last error line comes back in the one-line error, and --log is named for the rest.
    Started with this environment's Python, which has no PyTriton: the server fails at start for real."""
    import importlib.util

    from xdeploy.core.errors import XDeployError
    from xdeploy.serve.server import ServeOptions, ServerProcess

    if importlib.util.find_spec("pytriton") is not None:
        pytest.skip("this interpreter can serve")
    srv = ServerProcess(tiny_text, ServeOptions(http_port=0, grpc_port=0), python=sys.executable,
                        start_timeout=120)
    with pytest.raises(XDeployError) as e:
        srv.start()
    msg = str(e.value)
    assert "exited with code 1 while starting: " in msg and "pytriton" in msg and "--log FILE" in msg, msg
    assert "\n" not in msg


def test_a_runner_that_cannot_open_is_one_plain_log_line_and_the_others_still_run(tiny_bert, capsys):
    """In a log (not a terminal) the failure is one plain line with the elapsed time: no rich markup left in it,
    nothing eaten from the message (rich once ate `[gpu]` from an install hint), and bench still reports."""
    code, out, err = _run(["bench", str(tiny_bert), "--runners", "torch,trt", "--seq", "8", "--no-isolate",
                           "--no-roofline", "--min-iters", "2", "--max-iters", "3", "--max-seconds", "0.1"], capsys)
    assert code == 0, (out, err)
    failed = [ln for ln in (out + err).splitlines() if "failed trt" in ln]
    assert len(failed) == 1 and re.match(r"\[ *\d+\.\d s\] failed trt on fp32 \{'batch': 1, 'seq': 8\}: ", failed[0])
    assert "[red]" not in failed[0] and "│ torch" in out


def test_commands_without_a_success_test_elsewhere_exit_0(tiny_bert, tmp_path, capsys):
    """Exit 0 for the commands whose own suites call them only with bad input (the others: see above)."""
    assert main(["models"]) == 0
    assert main(["convert", str(tiny_bert), "--precision", "int8", "--out", str(tmp_path / "int8")]) == 0
    assert "quantized" in capsys.readouterr().out  # the per-graph conversion line
    assert main(["scale", "bert", "--smoke", "--lowerings", "ort-o23", "--max-t", "128", "--budget", "20",
                 "--json", str(tmp_path / "s.json")]) == 0
    assert (tmp_path / "s.json").exists()
