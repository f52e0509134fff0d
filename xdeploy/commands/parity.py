"""xdeploy parity: the same seeded inputs through each runner against the PyTorch fp32 reference."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from xdeploy.commands import THREADS_HELP, add_json_option, deprecated_alias, write_json
from xdeploy.core.errors import ParityError, XDeployError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="MODEL|ARTIFACT|ONNX",
                   help="a registry model (exported to a temporary artifact per precision), an artifact directory, "
                   "or an ONNX file / export directory of another exporter (reference: onnxruntime CPU fp32)")
    p.add_argument("--runners", help="comma-separated runner specs (default torch,ort; for an ONNX file ort,ov), "
                   "e.g. ort,ov,ov:bf16,torch:bf16")
    p.add_argument("--precision", help="MODEL only: comma-separated export precisions (default fp32)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="MODEL only: named size (default: the first preset)")
    src.add_argument("--checkpoint", metavar="DIR", help="MODEL only: Hugging Face / sentence-transformers dir")
    p.add_argument("--shapes", help="comma-separated BATCHxSEQ, SEQ may be 'max' (default 1x1,2x17,3xmax); "
                   "SEQ applies to every non-batch axis; batch >= 3 also gets a fully padded row. For an ONNX file "
                   "also INPUT:DxD... (trtexec style, e.g. input_ids:1x128,attention_mask:1x128): its symbolic dims")
    p.add_argument("--graphs", help="comma-separated graph names (default: all graphs of the artifact)")
    p.add_argument("--tolerance", action="append", default=[], metavar="[OUTPUT:]K=V,...",
                   help="override tolerances, e.g. logits:atol=1e-3,cosine=0.999 (repeatable; no OUTPUT = all)")
    deprecated_alias(p, "--tol", "--tolerance", append=True)
    lw = p.add_mutually_exclusive_group()
    lw.add_argument("--layerwise", action="store_true",
                    help="always locate the first divergent ONNX node (default: only when a check fails)")
    lw.add_argument("--no-layerwise", action="store_true", help="never run the layerwise divergence finder")
    p.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    p.add_argument("--threads", type=int, default=0, help=THREADS_HELP)
    p.add_argument("--records", metavar="FILE",
                   help="write one parity record per runner x graph x output (JSON lines; the same records "
                        "`xdeploy run` writes, worst over the cases)")
    add_json_option(p)


def default_runners(foreign: bool) -> list[str]:
    """torch,ort for our models; ort,ov for a foreign graph (no PyTorch model; ov where OpenVINO is installed)."""
    if not foreign:
        return ["torch", "ort"]
    from xdeploy.deploy.registry import runner_class

    try:
        runner_class("ov")
    except XDeployError:
        return ["ort"]
    return ["ort", "ov"]


def bound_view(art: Any, shapes: str | None) -> Any:
    """A foreign view with its dims bound (--shapes INPUT:DxD, else the recognized names), said on stderr."""
    import sys

    from xdeploy.export.foreign import bind, describe, parse_input_shapes, require_bound

    art = require_bound(bind(art, parse_input_shapes(shapes)))
    print(describe(art), file=sys.stderr)
    return art


def _split(text: str | None) -> list[str]:
    return [s.strip() for s in (text or "").split(",") if s.strip()]


def run(args: argparse.Namespace) -> int:
    from xdeploy.export.artifact import load_artifact
    from xdeploy.verify.parity import (
        DEFAULT_SHAPES,
        check_artifact,
        parity_records,
        parse_shapes,
        parse_tolerance_overrides,
    )

    target = Path(args.target)
    foreign = target.is_file() or (target.is_dir() and not (target / "manifest.json").exists())
    runners = _split(args.runners) if args.runners is not None else default_runners(foreign)
    if not runners:
        raise XDeployError("--runners is empty; expected e.g. torch,ort,ov")
    from xdeploy.deploy.registry import check_spec

    for r in runners:
        check_spec(r)  # a typo (ov:fp16) is a usage error (exit 2), not a parity failure (exit 1)
    named = ":" in (args.shapes or "")  # INPUT:DxD (a foreign graph's dims) or BATCHxSEQ
    shapes = parse_shapes(args.shapes) if args.shapes and not named else list(DEFAULT_SHAPES)
    overrides = parse_tolerance_overrides(args.tolerance)
    mode = "always" if args.layerwise else "never" if args.no_layerwise else "on-failure"
    common: dict[str, Any] = dict(shapes=shapes, graphs=_split(args.graphs) or None, overrides=overrides,
                                  seed=args.seed, layerwise=mode, threads=args.threads)

    reports = []
    records: list[dict[str, Any]] = []  # the run's parity records, built by the same function (verify/parity.py)
    if target.is_dir() or target.is_file():
        if args.precision or args.preset or args.checkpoint:
            raise XDeployError(f"{target} is an artifact or ONNX model: --precision/--preset/--checkpoint apply to a "
                               f"MODEL name only")
        art = load_artifact(target)
        if art.foreign is not None:
            art = bound_view(art, args.shapes if named else None)
            if named:  # the shapes given are the one case (batch and seq bound with them)
                seq = art.spec.axes["seq"].opt if "seq" in art.spec.axes else None
                common["shapes"] = [(art.spec.axes["batch"].opt, seq)]
        elif named:
            raise XDeployError(f"--shapes INPUT:DxD applies to an ONNX file; {target} is an artifact: give BATCHxSEQ")
        reports.append((str(target), check_artifact(art, runners, **common)))
        records += parity_records(reports[-1][1], art.model, art.manifest.get("preset"))
    else:
        from xdeploy.export.onnx_export import export
        from xdeploy.export.precision import check_precision
        from xdeploy.models.registry import get_family

        get_family(args.target)  # one-line error for an unknown model before any work
        precisions = _split(args.precision) or ["fp32"]
        for prec in precisions:
            check_precision(prec)
        with tempfile.TemporaryDirectory(prefix="xdeploy-parity-") as tmp:
            arts: dict[str, Any] = {}
            # fp32 first: its ONNX is the layerwise reference of the other precisions
            for prec in sorted(set(precisions) | ({"fp32"} if mode != "never" else set()),
                               key=lambda p: p != "fp32"):
                arts[prec] = load_artifact(export(args.target, preset=args.preset, checkpoint=args.checkpoint,
                                                  out=Path(tmp) / prec, precision=prec))
            fp32 = arts.get("fp32")
            for prec in precisions:
                ref = (lambda g, a=fp32: a.onnx_path(g)) if fp32 is not None and prec != "fp32" else None
                reports.append((f"{args.target} {prec}", check_artifact(arts[prec], runners, reference_onnx=ref,
                                                                        **common)))
                records += parity_records(reports[-1][1], args.target, arts[prec].manifest.get("preset"))
    _print(reports)
    if args.records:
        from xdeploy.core.records import write_records

        write_records(args.records, records)
    write_json(args.json, {"target": args.target, "passed": all(r.passed for _, r in reports),
                           "artifacts": [{"name": n} | r.to_json() for n, r in reports]})
    failures = [c for _, r in reports for c in r.failures]
    if failures:
        worst = failures[0]
        raise ParityError(f"{len(failures)} parity check(s) failed; first: {worst.runner} {worst.graph}/"
                          f"{worst.output} on {worst.case}: {worst.reason}")
    return 0


def _fmt(x: float | None, spec: str = ".2e") -> str:
    return "-" if x is None else format(x, spec)


def _print(reports: list[tuple[str, Any]]) -> None:
    """One row per artifact x runner x graph x output: the worst case over all inputs (JSON has every case)."""
    from rich.table import Table

    from xdeploy.commands import console as make_console

    console = make_console()
    for name, rep in reports:
        table = Table(title=f"parity: {name} vs {rep.reference}", title_justify="left", box=None, pad_edge=False)
        for col in ("runner", "tol", "graph/output", "cases", "max|d|", "max rel", "min cos", "NaN", "top-1",
                    "verdict"):
            table.add_column(col, no_wrap=True, justify="left" if col in ("runner", "tol", "graph/output",
                                                                          "verdict") else "right")
        groups: dict[tuple[str, str, str], list[Any]] = {}
        for c in rep.checks:
            groups.setdefault((c.runner, c.graph, c.output), []).append(c)
        notes = []
        for (runner, graph, output), cs in groups.items():
            bad = [c for c in cs if not c.passed]
            top1 = [c.top1 for c in cs if c.top1 is not None]
            ms = [c.comparison for c in cs]
            table.add_row(runner, cs[0].precision, f"{graph}/{output}", str(len(cs)),
                          _fmt(max(m.max_abs for m in ms)), _fmt(max(m.max_rel for m in ms)),
                          _fmt(min(m.cosine for m in ms), ".6f"), str(sum(m.nonfinite for m in ms)),
                          _fmt(min(top1) if top1 else None, ".3f"),
                          "[green]pass[/green]" if not bad else f"[red]FAIL[/red] ({len(bad)}/{len(cs)})")
            notes += [f"  {runner} {graph}/{output} on {c.case}: {c.reason}" for c in bad[:2]]
        console.print(table)
        for line in notes:
            console.print(line, markup=False, highlight=False)
        for f in rep.layerwise:
            d = f.divergence
            head = f"layerwise {f.graph} ({f.artifact_precision} ONNX in {f.runtime} vs fp32 ONNX, {f.case}):"
            if d is None:
                console.print(f"{head} {f.note or 'no divergence'}", markup=False, highlight=False)
            else:
                console.print(f"{head} first divergent node [bold]{d.node}[/bold] ({d.op_type}) -> {d.output}: "
                              f"max abs {d.max_abs:.3g}, cosine {d.cosine:.6f}, reference range "
                              f"[{d.ref_range[0]:.4g}, {d.ref_range[1]:.4g}], candidate range "
                              f"[{d.cand_range[0]:.4g}, {d.cand_range[1]:.4g}]", highlight=False)
