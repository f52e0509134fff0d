"""One-off studies: thin scripts over the library (`python -m xdeploy.studies.NAME`) whose figures are in docs/.

Each study has its own `main` (arguments) and `run` (the measurement); what they share is here: the machine is
core/fingerprint.py's (plus the load average, since the machine is shared), artifacts come from the one cache
(export/cache.py), tables are reports/render.py's `markdown_table`, targets are core/targets.py's, and `finish`
prints the result or a one-line error and writes the JSON atomically.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
from collections.abc import Callable
from typing import Any

from xdeploy.core.errors import XDeployError


def machine() -> dict[str, Any]:
    """What a study's figures were measured on: the fingerprint, the 1/5/15-minute load average, the time."""
    from xdeploy.core.fingerprint import fingerprint

    return {"fingerprint": fingerprint(), "load_average": list(os.getloadavg()),
            "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def machine_line(m: dict[str, Any]) -> str:
    """'machine: <cpu, CPUs, ISA; versions>; load average 2.1 at start, <date> (shared machine: noisy timings)'."""
    from xdeploy.core.fingerprint import summary

    return (f"machine: {summary(m['fingerprint'])}; 1-min load average {m['load_average'][0]:.1f} at start, "
            f"{m['date']} (shared machine: timings are noisy)")


def finish(prog: str, compute: Callable[[], dict[str, Any]], render: Callable[[dict[str, Any]], str],
           json_path: str | None) -> int:
    """Run `compute`; print `render(result)` and write `json_path` atomically, or print one error line.
    Returns the exit status (0, or the error's: 2 for bad input)."""
    try:
        result = compute()
    except XDeployError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.exit_code
    print(render(result))
    if json_path:
        from xdeploy.core.fsutil import atomic_write_json

        atomic_write_json(json_path, result)
    return 0
