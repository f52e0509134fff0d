"""CLI subcommands; see xdeploy/cli.py."""

from __future__ import annotations

import argparse
from typing import Any

from xdeploy.core.fsutil import atomic_write_json


def add_json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE (for machines)")


def write_json(path: str | None, obj: Any) -> None:
    if path:
        atomic_write_json(path, obj)
