"""xdeploy convert: fp32 artifact -> fp16 / int8 (static Q/DQ) / int8-dynamic / optimized artifact, without PyTorch."""

from __future__ import annotations

import argparse

from xdeploy.commands import add_json_option, write_json
from xdeploy.commands.export import add_conversion_arguments, precision_options, print_conversion, print_openvino_ir
from xdeploy.export.precision import EXPORT_PRECISIONS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", help="an unoptimized fp32 artifact directory (xdeploy export)")
    p.add_argument("--precision", default="fp32", help=f"one of {', '.join(EXPORT_PRECISIONS)}")
    p.add_argument("--out", metavar="DIR", required=True, help="new artifact directory")
    p.add_argument("--force", action="store_true", help="replace an existing artifact directory")
    add_conversion_arguments(p)
    add_json_option(p)


def run(args: argparse.Namespace) -> int:
    from xdeploy.api import convert_artifact
    from xdeploy.export.artifact import load_artifact

    path = convert_artifact(args.artifact, args.out, args.precision, optimize=args.optimize, opt_level=args.opt_level,
                            options=precision_options(args), force=args.force)
    art = load_artifact(path)
    print(f"converted {args.artifact} -> {path} ({art.precision}{', optimized' if args.optimize else ''})")
    print_conversion(art.manifest)
    print_openvino_ir(art.manifest)
    write_json(args.json, dict(art.manifest) | {"path": str(path)})
    return 0
