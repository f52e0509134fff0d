"""xdeploy convert: fp32 artifact -> fp16 / int8 (static Q/DQ) / int8-dynamic / optimized artifact, without PyTorch."""

from __future__ import annotations

import argparse
import sys

from xdeploy.commands import add_json_option, write_json
from xdeploy.commands.export import add_conversion_arguments, precision_options, print_conversion, print_openvino_ir
from xdeploy.export.precision import EXPORT_PRECISIONS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", help="an unoptimized fp32 artifact directory (xdeploy export), or an fp32 ONNX file / "
                   "export directory of another exporter (golden probes from onnxruntime CPU fp32 on it)")
    p.add_argument("--precision", default="fp32", help=f"one of {', '.join(EXPORT_PRECISIONS)}")
    p.add_argument("--out", metavar="DIR", help="new artifact directory (required unless --write-manifest)")
    p.add_argument("--shapes", metavar="INPUT:DxD,...", help="ONNX file only: sizes of symbolic dims xdeploy "
                   "does not recognize, trtexec style (e.g. input_ids:1x128,attention_mask:1x128)")
    p.add_argument("--write-manifest", action="store_true", help="ONNX file only: write its manifest.json beside "
                   "the graph (nothing else is changed) and stop; the directory then opens as an artifact")
    p.add_argument("--force", action="store_true", help="replace an existing artifact directory")
    add_conversion_arguments(p)
    add_json_option(p)


def run(args: argparse.Namespace) -> int:
    from xdeploy.api import convert_artifact
    from xdeploy.core.errors import XDeployError
    from xdeploy.export.artifact import load_artifact
    from xdeploy.export.foreign import describe, parse_input_shapes, write_manifest

    if args.write_manifest:
        written = write_manifest(args.artifact)
        print(f"wrote {written}")
        return 0
    if not args.out:
        raise XDeployError("--out DIR is required (or --write-manifest for an ONNX file)")
    src = load_artifact(args.artifact)
    if src.foreign is not None:
        print(describe(src), file=sys.stderr)
    elif args.shapes:
        raise XDeployError(f"--shapes applies to an ONNX file; {args.artifact} is an artifact")
    path = convert_artifact(args.artifact, args.out, args.precision, optimize=args.optimize, opt_level=args.opt_level,
                            options=precision_options(args), force=args.force,
                            shapes=parse_input_shapes(args.shapes) or None)
    art = load_artifact(path)
    print(f"converted {args.artifact} -> {path} ({art.precision}{', optimized' if args.optimize else ''})")
    print_conversion(art.manifest)
    print_openvino_ir(art.manifest)
    write_json(args.json, dict(art.manifest) | {"path": str(path)})
    return 0
