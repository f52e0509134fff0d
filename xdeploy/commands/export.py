"""xdeploy export: model/preset or checkpoint -> artifact directory."""

from __future__ import annotations

import argparse

from xdeploy.commands import add_json_option, write_json
from xdeploy.core.errors import XDeployError
from xdeploy.export.artifact import DEFAULT_OPSET, DEFAULT_OPTIMIZE
from xdeploy.export.precision import (
    CALIBRATION_METHODS,
    DEFAULT_CALIBRATION_METHOD,
    DYNAMIC_WEIGHT_TYPES,
    EXPORT_PRECISIONS,
    FP16_BLOCK_OPS,
    PrecisionOptions,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="registry name: transformer, bert, gpt, vit")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="named size (see `xdeploy models`); default: the first preset")
    src.add_argument("--checkpoint", metavar="DIR", help="Hugging Face or sentence-transformers directory")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    p.add_argument("--precision", default="fp32", help=f"one of {', '.join(EXPORT_PRECISIONS)} (int8: static "
                   "Q/DQ with calibration; int8-dynamic: onnxruntime dynamic quantization)")
    p.add_argument("--attn-impl", choices=("sdpa", "math"), help="attention kernel to export (default sdpa)")
    add_conversion_arguments(p)
    p.add_argument("--out", metavar="DIR", help="artifact directory (default artifacts/MODEL-PRESET-PRECISION)")
    p.add_argument("--force", action="store_true", help="replace an existing artifact directory")
    p.add_argument("--fresh", action="store_true",
                   help="export again even when the export cache ($XDEPLOY_CACHE/exports) holds the same export "
                        "(same model, options, library versions and xdeploy source), and refresh that entry")
    p.add_argument("--tokenizer-graph", action="store_true",
                   help="also write tokenizer/tokenizer.onnx (onnxruntime-extensions), verified against HF "
                        "tokenizers: text in for the C++ runtime, Triton and Embedder(tokenizer='graph')")
    p.add_argument("--accept-tokenizer-differences", action="store_true",
                   help="write the tokenizer graph even where its ids differ from HF tokenizers (recorded)")
    p.add_argument("--openvino-ir", action=argparse.BooleanOptionalAction, default=None,
                   help="also write openvino/<graph>.xml converted from the reference module (openvino."
                        "convert_model), which the ov runner compiles instead of the ONNX graph (fewer layout "
                        "ops); default: on for fp32 and fp16 when openvino is installed (fp16: weights stored as "
                        "fp16); int8-dynamic when asked (weights compressed to int8 by nncf: OpenVINO's int8 route)")
    add_json_option(p)


def add_conversion_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the optimize + precision pipeline (shared with `xdeploy convert`)."""
    g = p.add_argument_group("optimization and precision")
    g.add_argument("--optimize", action=argparse.BooleanOptionalAction, default=DEFAULT_OPTIMIZE,
                   help="onnxruntime offline optimization + transformer fusions (fused ops run on onnxruntime "
                        f"only; default {'on' if DEFAULT_OPTIMIZE else 'off'})")
    g.add_argument("--opt-level", type=int, default=1, choices=(0, 1, 2),
                   help="onnxruntime level before the fusions: 0 none, 1 basic, 2 extended (default 1)")
    g.add_argument("--fp16-block-ops", metavar="OPS", default=",".join(FP16_BLOCK_OPS),
                   help="comma-separated op types kept fp32 in fp16 graphs (default: norms, softmax, reductions)")
    g.add_argument("--fp16-block-nodes", metavar="NODES", default="", help="node names kept fp32 in fp16 graphs")
    g.add_argument("--no-amp", dest="amp", action="store_false",
                   help="fp16: skip the layerwise search for diverging nodes (automatic mixed precision)")
    g.add_argument("--int8-exclude", metavar="NODES", default="", help="node names left unquantized in int8 graphs")
    g.add_argument("--int8-per-tensor", dest="int8_per_channel", action="store_false",
                   help="int8: one scale per weight tensor instead of per output channel")
    g.add_argument("--calibration", metavar="FILE",
                   help="static int8 calibration data: text lines (tokenized with the model's tokenizer), or .npy "
                        "/ .npz arrays named after the graph inputs (default: the model family's built-in set)")
    g.add_argument("--calibration-method", default=DEFAULT_CALIBRATION_METHOD, choices=CALIBRATION_METHODS,
                   help=f"how activation ranges are chosen (default {DEFAULT_CALIBRATION_METHOD}, by measurement)")
    g.add_argument("--int8-activations", default="int8", choices=("int8", "uint8"),
                   help="static int8 activations: int8 symmetric (default; TensorRT, OpenVINO) or uint8 asymmetric "
                        "(onnxruntime's CPU int8 kernels, ~2.5x faster there; TensorRT rejects it)")
    g.add_argument("--int8-weight-bits", type=int, default=7, choices=(7, 8),
                   help="int8 weight range: 7 (default) is exact on every x86 CPU; 8 is exact only on CPUs with VNNI "
                        "or AMX and saturates on AVX2-only x86 (the manifest records the classes it is proven for); "
                        "int8-dynamic: with --int8-dynamic-weights int8 only")
    g.add_argument("--int8-dynamic-weights", choices=DYNAMIC_WEIGHT_TYPES, default="auto",
                   help="int8-dynamic weights: uint8 (8 bits, exact on every x86 CPU: onnxruntime's U8U8 kernels; "
                        "as fast where decoding reads weights, slower where batches compute), int8 (symmetric, "
                        "--int8-weight-bits bits), auto (default): uint8 for decode-step graphs, int8 for the rest, or "
                        "blocks: decode steps as onnxruntime's MatMulNBits (8-bit blocks of 256, int8 activations "
                        "per block; each token 1.3-1.5x faster on GPT-2 small, a prompt slower), int8 for the rest")
    g.add_argument("--no-sensitivity", dest="sensitivity", action="store_false",
                   help="int8: skip the measured search for nodes to keep float when the tolerance is missed")
    g.add_argument("--int8-max-excluded", type=int, metavar="N",
                   help="int8: budget of nodes per graph the sensitivity search may keep float (default: a quarter "
                        "of the graph's quantizable nodes)")


def precision_options(args: argparse.Namespace) -> PrecisionOptions:
    def names(s: str) -> tuple[str, ...]:
        return tuple(x.strip() for x in s.split(",") if x.strip())

    # an option of the other precision would be silently ignored: say so instead
    # flag -> (given, the precision it applies to; "int8" covers int8-dynamic)
    given = {"--int8-exclude": (bool(names(args.int8_exclude)), "int8"),
             "--int8-per-tensor": (not args.int8_per_channel, "int8"),
             "--int8-weight-bits": (args.int8_weight_bits != 7, "int8"),
             "--int8-dynamic-weights": (args.int8_dynamic_weights != "auto", "int8-dynamic"),
             "--fp16-block-nodes": (bool(names(args.fp16_block_nodes)), "fp16"),
             "--fp16-block-ops": (names(args.fp16_block_ops) != FP16_BLOCK_OPS, "fp16"),
             "--no-amp": (not args.amp, "fp16")}
    for flag, (used, wants) in given.items():
        if used and not args.precision.startswith(wants):
            raise XDeployError(f"{flag} applies to --precision {wants}, not {args.precision}")

    return PrecisionOptions(fp16_block_ops=names(args.fp16_block_ops), fp16_block_nodes=names(args.fp16_block_nodes),
                            amp=args.amp, int8_exclude=names(args.int8_exclude),
                            int8_per_channel=args.int8_per_channel, int8_calibration_file=args.calibration,
                            int8_method=args.calibration_method, int8_activations=args.int8_activations,
                            int8_sensitivity=args.sensitivity, int8_max_excluded=args.int8_max_excluded,
                            int8_weight_bits=args.int8_weight_bits, int8_dynamic_weights=args.int8_dynamic_weights)


def openvino_ir(args: argparse.Namespace) -> bool:
    """--openvino-ir as asked; unset: on for fp32 and fp16 exports where openvino is installed (the IR holds the
    reference's weights, fp16 in an fp16 artifact; int8 gets its own from `xdeploy convert`; int8-dynamic's, its
    weights compressed by nncf, only when asked)."""
    if args.openvino_ir is not None:
        return bool(args.openvino_ir)
    from xdeploy.export.openvino_ir import available

    return args.precision in ("fp32", "fp16") and available()


def run(args: argparse.Namespace) -> int:
    from xdeploy.api import export
    from xdeploy.deploy.tokenizer_graph import tokenizer_graph_builder
    from xdeploy.export.artifact import load_artifact

    out = args.out or f"artifacts/{args.model}-{args.preset or ('ckpt' if args.checkpoint else 'default')}-" \
                      f"{args.precision}"
    path = export(args.model, preset=args.preset, checkpoint=args.checkpoint, out=out, opset=args.opset,
                  precision=args.precision, force=args.force, attn_impl=args.attn_impl, optimize=args.optimize,
                  opt_level=args.opt_level, precision_options=precision_options(args),
                  tokenizer_graph=tokenizer_graph_builder(args.accept_tokenizer_differences)
                  if args.tokenizer_graph else None, openvino_ir=openvino_ir(args), fresh=args.fresh,
                  log=print)
    art = load_artifact(path)
    graphs = ", ".join(g.name for g in art.spec.graphs)
    print(f"exported {art.model} ({art.precision}, opset {art.opset}{', optimized' if args.optimize else ''}; "
          f"graphs: {graphs}) -> {path}")
    print_conversion(art.manifest)
    print_openvino_ir(art.manifest)
    tg = art.manifest.get("tokenizer_graph")
    if tg:
        v = tg["verified"]
        print(f"tokenizer graph: {tg['file']} (onnxruntime-extensions {tg['extensions_version']}, max_length "
              f"{tg['max_length']}): ids identical to HF tokenizers on {v['identical']}/{v['inputs']} inputs"
              + (f"; accepted differences on inputs {v['differing']}" if v["differing"] else ""))
    write_json(args.json, dict(art.manifest) | {"path": str(path)})
    return 0


def print_openvino_ir(manifest: dict) -> None:
    """One line on the artifact's OpenVINO IR: the fp32 reference's, a static int8 artifact's NNCF-quantized one
    (export/convert.py), or why a static int8 artifact carries none (the ov runner then compiles the Q/DQ ONNX)."""
    sec = manifest.get("openvino")
    if manifest.get("precision") == "int8" and not (sec or {}).get("graphs"):
        why = (sec or {}).get("reason") or "; ".join(f"{g}: {r}" for g, r in (sec or {}).get("skipped", {}).items()) \
            or ("the fp32 source carries no OpenVINO IR" if manifest.get("derived_from")
                else "an int8 export from PyTorch makes none; export fp32 and `xdeploy convert --precision int8`")
        print(f"no OpenVINO int8 IR ({why}): the ov runner compiles the Q/DQ ONNX graph")
    elif sec and sec.get("graphs"):
        files = ", ".join(g["xml"] for g in sec["graphs"].values())
        if sec.get("quantizer"):
            worst = min((c for r in sec.get("check", {}).values() for c in r.get("worst_cosine", {}).values()),
                        default=float("nan"))
            left = "; ".join(f"{g} left out: {r}" for g, r in sec.get("skipped", {}).items())
            print(f"OpenVINO int8 IR: {files} ({sec['quantizer']}, checked on ov and ov:bf16, worst cosine "
                  f"{worst:.4f}; the ov runner compiles it){'; ' + left if left else ''}")
        else:
            weights = {"fp16": " with fp16 weights", "int8 weight-only": " with int8 weights (nncf)"}.get(
                sec.get("weights"), "")
            print(f"OpenVINO IR{weights}: {files} (the ov runner compiles it; every other runtime reads the ONNX)")


def print_conversion(manifest: dict) -> None:
    """One line per graph: what the precision conversion kept fp32 / quantized and which ops were fused."""
    for g, info in (manifest.get("conversion") or {}).items():
        parts = []
        if info.get("precision") == "fp16":
            amp = [k for k in info.get("kept_fp32", []) if k.get("reason") == "amp"]
            parts.append(f"{len(info.get('kept_fp32', []))} nodes kept fp32 ({len(amp)} by AMP), "
                         f"{info.get('fp16_nodes', 0)} fp16")
        if info.get("precision") in ("int8", "int8-dynamic"):
            parts.append("quantized " + ", ".join(f"{v} {k}" for k, v in info.get("quantized_ops", {}).items()))
            if info.get("excluded"):
                parts.append(f"{len(info['excluded'])} excluded (kept fp32): {', '.join(info['excluded'][:5])}"
                             + (" ..." if len(info["excluded"]) > 5 else ""))
        if info.get("format") == "qdq":
            cal = info.get("calibration", {})
            sens = info.get("sensitivity", {})
            kept = [k["node"] for k in info.get("kept_fp32", [])]
            shared = cal.get("shared_tensors") or {}
            where = (f"{cal.get('samples')} samples, {cal.get('source')}" if cal.get("measured_tensors", 1)
                     else f"ranges of graph {', '.join(shared)}: same weights, same data")
            parts.append(f"{info.get('quantized_nodes', 0)} nodes int8 ({cal.get('method')} calibration, {where}); "
                         f"kept float: {', '.join(kept) or 'none'}")
            if sens.get("unresolved"):
                parts.append(f"sensitivity budget spent, still failing: {sens['unresolved'].get('reason')}")
        if info.get("fused_ops"):
            parts.append("fused " + ", ".join(f"{v} {k}" for k, v in info["fused_ops"].items()))
        if parts:
            print(f"  {g}: " + "; ".join(parts))
    print_portability(manifest)


def print_portability(manifest: dict) -> None:
    """int8: which CPU classes the artifact is proven for (export/saturation.py), and the simulated AVX2 error
    when it is not proven for AVX2-only x86."""
    from xdeploy.export.saturation import EXACT_CLASSES, PAIRWISE_CLASS, artifact_proven_for

    conv = manifest.get("conversion") or {}
    proven = artifact_proven_for(conv)
    if proven is None:
        return
    if PAIRWISE_CLASS in proven:
        kinds = sorted({f"{r.get('weight_bits')}-bit {r.get('weight_type', 'int8')}" for r in conv.values()
                        if isinstance(r, dict) and r.get("weight_bits")})
        print(f"int8 portable: proven exact on every x86 class ({', '.join(proven)}): no pair of int8 products can "
              f"saturate the AVX2 kernel ({', '.join(kinds) or 'int8'} weights"
              f"{'; uint8 ones run U8U8, which adds no pair in int16' if any('uint8' in k for k in kinds) else ''})")
        return
    sims = [r["saturation"].get("simulated") or {} for r in conv.values() if isinstance(r.get("saturation"), dict)]
    worst = max((s.get("worst_accumulator_rel_error", 0.0) for s in sims), default=0.0)
    sat = sum(s.get("saturating_pairs", 0) for s in sims)
    print(f"int8 NOT portable: proven only for {', '.join(c for c in proven if c in EXACT_CLASSES)}; on x86 without "
          f"VNNI or AMX ({PAIRWISE_CLASS}) onnxruntime saturates {sat} simulated pair(s) (worst accumulator off by "
          f"{100 * worst:.1f}%) and the ort runner refuses it there; --int8-weight-bits 7 (the default) is portable")
