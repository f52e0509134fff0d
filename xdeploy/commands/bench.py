"""xdeploy bench: latency percentiles, throughput, peak memory and % of GEMM peak per runner and config."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from xdeploy.commands import THREADS_HELP_TIMED, add_json_option, step_log, write_json
from xdeploy.commands import console as make_console
from xdeploy.core.errors import XDeployError


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="MODEL|ARTIFACT|ONNX", nargs="+", help="registry name (exported to a cached "
                   "artifact), artifact directory, or ONNX file / export directory of another exporter; several "
                   "are timed in the same interleaved rounds")
    p.add_argument("--runners", type=_names, help="comma-separated runner specs, e.g. torch,ort,ov,ov:bf16 "
                   "(default torch,ort; ort when every target is an ONNX file or PyTorch is not installed)")
    p.add_argument("--shapes", metavar="INPUT:DxD,...", help="ONNX files: sizes of their inputs, trtexec style "
                   "(e.g. input_ids:1x128,attention_mask:1x128); needed for symbolic dims xdeploy does not "
                   "recognize (batch and sequence names take --batch / --seq)")
    p.add_argument("--preset", help="model preset (default: the first)")
    p.add_argument("--precision", type=_names, default=["fp32"], help="artifact precisions to export and run, "
                   "e.g. fp32,fp16,int8 (default fp32)")
    p.add_argument("--opset", type=int, help="ONNX opset of exported artifacts (default: the exporter's)")
    p.add_argument("--attn-impl", choices=("sdpa", "math"), help="attention kernel to export (default sdpa)")
    p.add_argument("--batch", type=_ints, default=[1], help="batch sizes, e.g. 1,8 (default 1)")
    p.add_argument("--seq", type=_ints, default=[128], help="sequence lengths, e.g. 32,128,512 (default 128; "
                   "ignored for models without a token axis such as ViT)")
    p.add_argument("--threads", type=int, default=0, help=THREADS_HELP_TIMED)
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up calls (default 3)")
    p.add_argument("--min-iters", type=int, default=10, help="interleaved rounds at least (default 10)")
    p.add_argument("--max-iters", type=int, default=200, help="interleaved rounds at most (default 200)")
    p.add_argument("--max-seconds", type=float, default=5.0, help="stop timing after this many seconds once "
                   "--min-iters are done (default 5); rounds stop earlier once every speed-up is known to +-10%%")
    p.add_argument("--extra-seconds", type=float, default=30.0, help="seconds the whole run may add past "
                   "--max-seconds where a speed-up's interval is still wider than +-10%% (shared by its "
                   "comparisons, default 30; 0: none)")
    p.add_argument("--parity", action="store_true", help="also check each runner's outputs against PyTorch "
                   "fp32 with its precision's tolerance")
    p.add_argument("--baseline", help="runner whose p50 the speed-up column divides (default torch; without "
                   "torch: the first runner on the first target)")
    p.add_argument("--no-isolate", action="store_true", help="run in this process: faster, but no memory figures")
    p.add_argument("--fresh", action="store_true", help="re-export cached artifacts")
    p.add_argument("--no-roofline", action="store_true", help="do not measure a quick roofline when none is "
                   "cached (%% of peak stays empty)")
    p.add_argument("--records", metavar="FILE", help="write the records as JSON lines (the documented schema)")
    add_json_option(p)


def run(args: argparse.Namespace) -> int:
    from xdeploy.bench.interleave import Budget
    from xdeploy.bench.roofline import get_roofline, load_peaks
    from xdeploy.bench.suite import best_vs_baseline, run_bench
    from xdeploy.core.fingerprint import summary
    from xdeploy.core.records import record_sink, write_records
    from xdeploy.reports.tables import latency_table, memory_table
    from xdeploy.reports.text import best_line, latency_line

    if args.threads < 0:
        raise XDeployError(f"--threads must be >= 0, got {args.threads}")
    from pathlib import Path

    from xdeploy.export.foreign import parse_input_shapes

    foreign = [t for t in args.target if Path(t).is_file() or (Path(t).is_dir() and not (Path(t) / "manifest.json")
                                                                 .exists())]
    from xdeploy.core.deps import installed

    # the reference runner where it can run: another exporter's graph has no PyTorch module, and an artifact
    # benchmarks without PyTorch installed (its FLOPs come from the manifest)
    reference = len(foreign) < len(args.target) and installed("torch")
    runners = args.runners or (["torch", "ort"] if reference else ["ort"])
    baseline = args.baseline or ("torch" if "torch" in runners else runners[0])
    shapes = parse_input_shapes(args.shapes)
    if shapes and not foreign:
        raise XDeployError("--shapes INPUT:DxD applies to ONNX files; no target is one")
    if len(args.target) > 1 and (args.preset or args.opset or args.attn_impl):
        raise XDeployError("--preset/--opset/--attn-impl apply to one MODEL name; several targets were given")
    # bad runners and targets fail here, in a line, before a roofline or an export takes seconds to minutes
    from xdeploy.deploy.registry import check_spec

    for r in runners:
        check_spec(r)
    for t in args.target:
        if not Path(t).exists() and ("/" in t or t.endswith(".onnx")):
            raise XDeployError(f"{t} does not exist; expected an artifact directory, an ONNX file or a model name")
        if not Path(t).exists():
            from xdeploy.models.registry import get_family  # a model name: the registry (and torch) is needed

            get_family(t)  # not a registered model: the error names the models
    console = make_console()
    log = step_log(console)
    peaks = load_peaks()
    if args.extra_seconds < 0:
        raise XDeployError(f"--extra-seconds must be >= 0, got {args.extra_seconds}")
    if not peaks and not args.no_roofline:
        log("no roofline cached for this machine: measuring a quick one (`xdeploy roofline` for the "
                      "full measurement)")
        peaks = {k: float(v["value"]) for k, v in get_roofline(quick=True)["gemm"].items()}

    def progress(rec: Mapping[str, Any]) -> None:  # each latency record as it is made (bench/ returns numbers)
        if rec["kind"] == "latency":
            log(latency_line(rec))

    with record_sink(progress):
        records = run_bench(args.target, runners=runners, shapes=shapes, baseline=baseline, preset=args.preset,
                            precisions=args.precision, batches=args.batch, seqs=args.seq, opset=args.opset,
                            attn_impl=args.attn_impl, threads=args.threads, warmup=args.warmup,
                            min_iters=args.min_iters, max_iters=args.max_iters, max_seconds=args.max_seconds,
                            isolate=not args.no_isolate, parity=args.parity, peaks=peaks, fresh=args.fresh, log=log,
                            budget=Budget(args.extra_seconds, comparisons=len(args.batch) * len(args.seq)))
    if peaks:  # no record above 100% of its peak: a peak a record beats is measured again
        from xdeploy.bench.roofline import reconcile

        records = reconcile(records, log=log)
    models = sorted({f"{r['model']} {r['preset'] or ''}".strip() for r in records})
    console.print(latency_table(records, baseline=baseline, title=f"xdeploy bench {', '.join(models)} — latency per "
                                "call", caption=summary(records[0]["fingerprint"]) if records else None).rich())
    if any((r.get("memory") or {}).get("peak_rss_bytes") is not None for r in records):
        console.print(memory_table(records, title="memory of each runner's isolated child").rich())
    else:  # --no-isolate: no child measured memory; a table of dashes would say nothing
        console.print("memory: not measured (--no-isolate: no isolated child per runner)")
    best = best_vs_baseline(records, baseline)
    for b in best:
        console.print(best_line(b))
    if args.records:
        write_records(args.records, records)
    write_json(args.json, {"records": records, "best": best})
    return 0
