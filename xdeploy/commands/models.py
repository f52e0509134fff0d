"""xdeploy models: the registry as a table (and JSON)."""

from __future__ import annotations

import argparse

from rich.table import Table

from xdeploy.commands import add_json_option, write_json
from xdeploy.commands import console as make_console
from xdeploy.models.registry import MODELS, describe
from xdeploy.models.spec import token_axes


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_json_option(p)


def run(args: argparse.Namespace) -> int:
    rows = [describe(m, p) | {"description": f.description} for m, f in MODELS.items() for p in f.presets]
    table = Table(title="xdeploy models")
    for col in ("model", "preset", "params", "GFLOPs / forward", "at"):
        table.add_column(col, justify="right" if col in ("params", "GFLOPs / forward") else "left")
    for r in rows:
        shown = ("batch", *token_axes(MODELS[r["model"]].capabilities))  # not the KV cache's axes
        at = " ".join(f"{k}={v}" for k, v in r["flops_at"].items() if k in shown)
        table.add_row(r["model"], r["preset"], f"{r['params'] / 1e6:.2f}M", f"{r['flops'] / 1e9:.2f}", at)
    make_console().print(table)
    write_json(args.json, {"models": rows})
    return 0
