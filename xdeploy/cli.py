"""The `xdeploy` console script: thin subcommands over the Python API.

Each subcommand lives in xdeploy/commands/<name>.py with `add_arguments(parser)` and `run(args) -> int`;
adding one = one module + one line in COMMANDS. Only the chosen command's module is imported, so
`xdeploy models` does not pay for importing onnxruntime or openvino."""

from __future__ import annotations

import argparse
import importlib
import sys

from xdeploy.core.deps import missing_package
from xdeploy.core.errors import XDeployError

COMMANDS: dict[str, str] = {
    "models": "list models, presets, parameter counts and FLOPs",
    "export": "export a model or checkpoint to an ONNX artifact directory",
    "convert": "derive an fp16 / int8 / optimized artifact from an fp32 artifact (no PyTorch needed)",
    "generate": "generate tokens with a KV cache (greedy, sampling, beam search) on any runner",
    "embed": "embed sentences (one per line) with an encoder artifact -> .npy / JSON lines",
    "run": "the main job: export, parity, bench, scale, decode -> reports/latest (exit 1 on parity failure)",
    "report": "render records into a report, or compare two reports (exit 1 on a regression)",
    "parity": "compare runners with the PyTorch fp32 reference per output (exit 1 on a failure)",
    "verify": "check an artifact's golden probes on this machine and runner, without PyTorch (exit 1 on a failure)",
    "bench": "latency percentiles, throughput, peak memory and % of GEMM peak per runner and config",
    "roofline": "measure the machine's peak GEMM FLOP/s (fp32, bf16, int8) and memory bandwidth",
    "scale": "attention scaling with sequence length: latency, memory, fitted exponents, analytic model",
    "triton": "write a Triton Inference Server model repository (config.pbtxt, ensemble for text) from an artifact",
    "serve": "serve an embedding artifact on a real Triton server (PyTriton) over HTTP and gRPC, loopback by default",
    "loadtest": "bounded load test of a Triton embedding server on loopback: req/s, sentences/s, p50/p90/p99, errors",
    "doctor": "which runners can open here; --gpu: the GPU ready check (gpu tests + GPU runners -> reports/gpu)",
}


EPILOG = """exit codes (every subcommand):
  0  success
  1  a verdict failed: a parity check, a golden probe (`verify`, or a runtime refusing an artifact), a regression
     in `report compare`, a load test with no successful request
  2  a usage or input error, or nothing to do (e.g. every bench config skipped, no records in common to compare)

`xdeploy COMMAND --help` lists a command's options; README.md has the table of common flags."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line + exit 2, like every other user error
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    from xdeploy import __version__

    parser = _Parser(prog="xdeploy", description="Export, optimize, run and benchmark transformer models.",
                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"xdeploy {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, help_text in COMMANDS.items():
        # argparse %-formats help strings: a literal % (e.g. "% of GEMM peak") must be doubled
        p = sub.add_parser(name, help=help_text.replace("%", "%%"), description=help_text)
        if name == command:
            importlib.import_module(f"xdeploy.commands.{name}").add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    try:
        args = build_parser(command).parse_args(argv)  # a command's options may come from the model registry
        args.argv = argv  # the command line as typed (reports record it)
        return int(importlib.import_module(f"xdeploy.commands.{args.command}").run(args) or 0)
    except XDeployError as e:
        print(f"xdeploy: error: {e}", file=sys.stderr)
        return e.exit_code
    except ModuleNotFoundError as e:
        missing = missing_package(e)
        if missing is None:  # a module of a package that is installed: a bug, shown as one
            raise
        print(f"xdeploy: error: {command or 'xdeploy'} needs the Python package {missing!r}, which is not installed "
              "here (`pip install xdeploy` installs every package it needs)", file=sys.stderr)
        return XDeployError.exit_code
    except KeyboardInterrupt:
        print("xdeploy: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
