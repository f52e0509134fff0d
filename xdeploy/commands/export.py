"""xdeploy export: model/preset or checkpoint -> artifact directory."""

from __future__ import annotations

import argparse

from xdeploy.commands import add_json_option, write_json
from xdeploy.export.onnx_export import DEFAULT_OPSET, export
from xdeploy.export.precision import EXPORT_PRECISIONS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="registry name: transformer, bert, gpt, vit")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="named size (see `xdeploy models`); default: the first preset")
    src.add_argument("--checkpoint", metavar="DIR", help="Hugging Face or sentence-transformers directory")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    p.add_argument("--precision", default="fp32", help=f"one of {', '.join(EXPORT_PRECISIONS)}")
    p.add_argument("--attn-impl", choices=("sdpa", "math"), help="attention kernel to export (default sdpa)")
    p.add_argument("--out", metavar="DIR", help="artifact directory (default artifacts/MODEL-PRESET-PRECISION)")
    p.add_argument("--force", action="store_true", help="replace an existing artifact directory")
    add_json_option(p)


def run(args: argparse.Namespace) -> int:
    from xdeploy.export.artifact import load_artifact

    out = args.out or f"artifacts/{args.model}-{args.preset or ('ckpt' if args.checkpoint else 'default')}-" \
                      f"{args.precision}"
    path = export(args.model, preset=args.preset, checkpoint=args.checkpoint, out=out, opset=args.opset,
                  precision=args.precision, force=args.force, attn_impl=args.attn_impl)
    art = load_artifact(path)
    graphs = ", ".join(g.name for g in art.spec.graphs)
    print(f"exported {art.model} ({art.precision}, opset {art.opset}; graphs: {graphs}) -> {path}")
    write_json(args.json, dict(art.manifest) | {"path": str(path)})
    return 0
