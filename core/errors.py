"""User-facing errors.

Anything a user can cause (a bad name, a bad file, a bad shape) raises `XDeployError` with one line that
names what was expected. The CLI prints that line and exits 2; programming errors keep their traceback.
"""

from __future__ import annotations

import itertools
import re


class XDeployError(Exception):
    """A clear, one-line error caused by the user's input or environment."""

    exit_code = 2


class ParityError(XDeployError):
    """A numerical parity check failed (exit code 1: the tool worked, the model did not)."""

    exit_code = 1


class InputError(XDeployError):
    """One input of a list is bad. `index` is 0-based (the Python list's); the CLI says "line index+1" instead."""

    def __init__(self, index: int, problem: str) -> None:
        self.index, self.problem = index, problem
        super().__init__(f"input {index} {problem}")


def one_of(kind: str, value: object, valid: object) -> XDeployError:
    """Error for an unknown name: `unknown model 'x'; expected one of: a, b`."""
    names = ", ".join(sorted(map(str, valid)))  # type: ignore[call-overload]
    return XDeployError(f"unknown {kind} {value!r}; expected one of: {names}")


# onnxruntime's exceptions put a status prefix and the C++ function that raised before the reason:
#   [ONNXRuntimeError] : 1 : FAIL : Load model from m.onnx failed:/onnxruntime_src/onnxruntime/core/graph/model.cc:256
#   onnxruntime::Model::Model(onnx::ModelProto&&, ...) Unsupported model IR version: 14, ...
# the status prefix of a session run, or the one run_with_iobinding puts before it
_ORT_STATUS = re.compile(r"^(?:Error in execution: )?(?:\[ONNXRuntimeError\] : \d+ : \w+ : )?")
_ORT_SOURCE = re.compile(r"\s*/onnxruntime_src/\S+:\d+ (?:[\w:~<>]+\((?:[^()]|\([^()]*\))*\)(?: const)? )?")


def ort_reason(e: BaseException) -> str:
    """The first line of an onnxruntime exception without its status prefix and C++ source location (the reason
    stays: 'Load model from m.onnx failed: Unsupported model IR version: 14, max supported IR version: 13')."""
    lines = str(e).strip().splitlines() or [type(e).__name__]
    # indented lines continue the first ("Got invalid dimensions for input: x for the following indices\n index: 1
    # Got: 5 Expected: 4")
    first = " ".join([lines[0], *(x.strip() for x in itertools.takewhile(lambda x: x[:1].isspace(), lines[1:]))])
    return ort_line(first)


def ort_line(line: str) -> str:
    """One line of an onnxruntime message without its status prefix and C++ source location."""
    return _ORT_SOURCE.sub(" ", _ORT_STATUS.sub("", line)).strip()
