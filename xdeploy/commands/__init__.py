"""CLI subcommands; see xdeploy/cli.py. Shared pieces: the common flags, deprecated spellings, consoles, progress."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from xdeploy.core.fsutil import atomic_write_json

# Width of tables when stdout is a file or a pipe (CI logs): rich would otherwise wrap them to 80 columns.
LOG_WIDTH = 200
# --threads means the same in every command: threads of each runner (intra-op); 0 = automatic, which is the
# runtime's own default, except for timings (bench, run), where it is the cores free when the benchmark starts.
THREADS_HELP = "threads per runner (default 0: automatic, the runtime's default, about one per core)"
THREADS_HELP_TIMED = "threads per runner (default 0: automatic, the cores free when the timing starts, measured)"


def add_json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE (for machines)")


def write_json(path: str | None, obj: Any) -> None:
    if path:
        atomic_write_json(path, obj)


def console(*, stderr: bool = False) -> Any:
    """A rich Console: as wide as the terminal, or LOG_WIDTH columns in a file/pipe (no wrapping to 80)."""
    from rich.console import Console

    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=LOG_WIDTH)


def progress_lines(out: Any = None) -> Callable[[str], None]:
    """One plain line per step with the elapsed time (`[  12.3 s] what`), flushed: CI logs show where a run is."""
    t0 = time.perf_counter()

    def log(what: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f} s] {what}", file=out or sys.stderr, flush=True)

    return log


def step_log(con: Any) -> Callable[[str], None]:
    """The log callback of a long command: rich lines on a terminal, else plain lines with the elapsed time."""
    if con.is_terminal:
        return con.print
    from rich.text import Text

    lines = progress_lines(con.file)
    return lambda markup: lines(Text.from_markup(str(markup)).plain)


class _Deprecated(argparse.Action):
    """A hidden old spelling of a flag: stores like the new one and says once that it is deprecated."""

    def __init__(self, option_strings: list[str], dest: str, new: str, append: bool = False, **kw: Any) -> None:
        self.new, self.append = new, append
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"xdeploy: warning: {option_string} is deprecated and will be removed in the next release; use "
              f"{self.new}", file=sys.stderr)
        if self.append:
            setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), values])
        else:
            setattr(namespace, self.dest, values)


def deprecated_alias(p: argparse.ArgumentParser, old: str, new: str, *, append: bool = False,
                     type: Callable[[str], Any] | None = None) -> None:  # noqa: A002 - argparse's name
    """Accept `old` as a hidden spelling of the flag `new` (already added to `p`) for one release."""
    dest = next(a.dest for a in p._actions if new in a.option_strings)
    p.add_argument(old, dest=dest, action=_Deprecated, new=new, append=append, type=type, metavar=new.upper())
