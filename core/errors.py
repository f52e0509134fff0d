"""User-facing errors.

Anything a user can cause (a bad name, a bad file, a bad shape) raises `XDeployError` with one line that
names what was expected. The CLI prints that line and exits 2; programming errors keep their traceback.
"""

from __future__ import annotations


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
