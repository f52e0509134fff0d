"""xdeploy scale: attention scaling with sequence length per runner and attention lowering."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from xdeploy.commands import THREADS_HELP, add_json_option, step_log, write_json
from xdeploy.commands import console as make_console


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    from xdeploy.bench.scale import DEFAULT_LOWERINGS, LOWERINGS

    p.add_argument("model", nargs="?", default=None,
                   help="model with a token axis (default: the first registered one, bert)")
    p.add_argument("--preset", help="preset (default: the model's quick preset, minilm for bert; --smoke: its "
                   "smallest)")
    p.add_argument("--lowerings", default=",".join(DEFAULT_LOWERINGS),
                   help=f"comma-separated, from: {', '.join(LOWERINGS)} (default {','.join(DEFAULT_LOWERINGS)})")
    p.add_argument("--max-t", type=int, help="largest T (default 4096; T doubles from 64)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--layers", type=int, help="override the number of layers (exponents do not depend on it)")
    p.add_argument("--budget", type=float, help="total seconds for the sweep, shared by the lowerings "
                   "(default 600; --quick 300)")
    p.add_argument("--threads", type=int, default=0, help=THREADS_HELP)
    p.add_argument("--profile-t", type=int, help="T for onnxruntime's per-op profile (default: largest <= 2048)")
    p.add_argument("--vit-patches", type=_ints, help="values of the models' config sweeps, i.e. ViT-B patch sizes "
                   "(default 32,16,8; empty: none)")
    p.add_argument("--quick", action="store_true", help="2 layers, 300 s budget")
    p.add_argument("--smoke", action="store_true", help="tiny preset up to T=256, no ViT (seconds)")
    p.add_argument("--fresh", action="store_true", help="re-export cached artifacts")
    p.add_argument("--records", metavar="FILE", help="write scale/profile records as JSON lines")
    add_json_option(p)


def render(records: Sequence[Mapping[str, Any]], console: Any) -> None:
    """The sweep's tables (reports/tables.py): per T and lowering, the fitted exponents, the op profile, the
    config sweep (ViT patch sizes) and, for scale, ViT-B's analytic attention memory down to raw pixels."""
    from xdeploy.core.fingerprint import summary
    from xdeploy.reports.tables import profile_table, scale_fits_table, scale_grid_table, sweep_table, vit_memory_table

    scale = [r for r in records if r["kind"] == "scale" and r.get("patch_size") is None]
    if scale:
        console.print(scale_grid_table(scale, caption=summary(scale[0]["fingerprint"])).rich())
        console.print(scale_fits_table(scale, title="log-log exponents over the upper range of T (time ∝ T^k)").rich())
    prof = [r for r in records if r["kind"] == "profile"]
    if prof:
        console.print(profile_table(prof, top_ops=5, title="onnxruntime profile: share of kernel time").rich())
    sweep = [r for r in records if r["kind"] == "scale" and r.get("patch_size") is not None]
    if sweep:
        console.print(sweep_table(sweep).rich())
    console.print(vit_memory_table().rich())


def run(args: argparse.Namespace) -> int:
    from xdeploy.bench.scale import run_scale, summarize
    from xdeploy.core.errors import XDeployError
    from xdeploy.core.records import write_records

    if args.batch < 1 or (args.layers is not None and args.layers < 1) or args.threads < 0:
        raise XDeployError("--batch and --layers must be >= 1 and --threads >= 0")
    console = make_console()
    records = run_scale(args.model, preset=args.preset, lowerings=[x for x in args.lowerings.split(",") if x],
                        max_t=args.max_t, batch=args.batch, layers=args.layers, budget=args.budget,
                        threads=args.threads, profile_t=args.profile_t, sweep_values=args.vit_patches,
                        quick=args.quick, smoke=args.smoke, fresh=args.fresh, log=step_log(console))
    render(records, console)
    if args.records:
        write_records(args.records, records)
    write_json(args.json, {"records": records, "summary": summarize(records)})
    return 0
