"""xdeploy run: the main job (export -> parity -> bench -> scale -> decode -> report), with a progress bar."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from xdeploy.commands import THREADS_HELP_TIMED, add_json_option, deprecated_alias, progress_lines, write_json

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from xdeploy.pipeline import RunResult


def add_arguments(p: argparse.ArgumentParser) -> None:
    from xdeploy.models.registry import MODELS as FAMILIES
    from xdeploy.pipeline import PRECISIONS

    models = tuple(FAMILIES)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true",
                   help="base presets (" + ", ".join(f"{m} {f.full}" for m, f in FAMILIES.items()) + ") and longer "
                   "timings, for the reference report; default: " + ", ".join(f"{m} {f.quick}" for m, f in
                                                                              FAMILIES.items()))
    size.add_argument("--smoke", action="store_true", help="smallest meaningful run: one parity shape, a few "
                   "iterations, short sweeps (tests, CI smoke)")
    p.add_argument("--preset", metavar="NAME", help="every model at this preset instead of the default (or --full) "
                   "ones, e.g. tiny: the smallest models (each selected model must have it)")
    p.add_argument("--out", default="reports/latest", metavar="DIR", help="report directory (default reports/latest)")
    p.add_argument("--artifacts", default="artifacts/run", metavar="DIR",
                   help="where the exported artifacts go (default artifacts/run)")
    p.add_argument("--models", default=",".join(models), metavar="M,...", help=f"subset of {','.join(models)}")
    p.add_argument("--precision", dest="precisions", default=",".join(PRECISIONS), metavar="P,...",
                   help=f"artifact precisions (default {','.join(PRECISIONS)}; int8 = static Q/DQ)")
    deprecated_alias(p, "--precisions", "--precision")
    p.add_argument("--runners", default="ort,ov", metavar="R,...",
                   help="runners compared with the PyTorch reference (default ort,ov)")
    p.add_argument("--tolerance", action="append", default=[], metavar="[OUTPUT:]atol=X,rtol=Y,cosine=Z",
                   help="override parity tolerances (repeatable; same syntax as xdeploy parity)")
    p.add_argument("--skip", default="", metavar="PHASE,...",
                   help="phases not to run: roofline, bench, decode, scale (export, parity, report always run)")
    p.add_argument("--threads", type=int, default=0, help=THREADS_HELP_TIMED)
    p.add_argument("--resume", action="store_true", help="continue the run journaled in --out (after a crash, "
                   "kill or Ctrl-C): steps already measured with the same configuration, artifacts and machine "
                   "are taken from the journal")
    p.add_argument("--fresh", action="store_true", help="export fp32 again even when the export cache "
                   "($XDEPLOY_CACHE/exports) holds the same export, and refresh that entry")
    p.add_argument("--memory-limit", metavar="SIZE", help="memory the guard may assume available, e.g. 4GiB "
                   "(default: what the OS reports; also $XDEPLOY_MEMORY_LIMIT)")
    add_json_option(p)


def command_line(args: argparse.Namespace) -> str:
    """The command as typed (every flag), for the report's `command:` line."""
    import shlex

    return "xdeploy " + shlex.join(getattr(args, "argv", None) or ["run"])


def _split(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from xdeploy.bench.memory import parse_bytes
    from xdeploy.core.errors import ParityError
    from xdeploy.pipeline import RunConfig, plan, run_job

    cfg = RunConfig(out=args.out, artifacts=args.artifacts, models=_split(args.models), full=args.full,
                    presets={"*": args.preset} if args.preset else {},
                    smoke=args.smoke, precisions=_split(args.precisions), runners=_split(args.runners),
                    threads=args.threads, tolerances=tuple(args.tolerance), skip=_split(args.skip),
                    resume=args.resume, fresh=args.fresh,
                    memory_limit=parse_bytes(args.memory_limit) if args.memory_limit else None,
                    command=command_line(args))
    cfg.check()
    console = Console(stderr=True)
    steps = plan(cfg)
    def run_it(progress: Callable[[str, int], None]) -> RunResult:
        try:
            return run_job(cfg, progress=progress)
        except KeyboardInterrupt:
            console.print(f"journal kept: {cfg.out}/journal.jsonl — `xdeploy run --resume --out {cfg.out}` "
                          f"continues it; `xdeploy report render {cfg.out}/journal.jsonl --out DIR` shows what "
                          "was measured", soft_wrap=True)
            raise

    if console.is_terminal:
        with Progress(TextColumn("[bold]{task.description:<42}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=False) as bar:
            task = bar.add_task("starting", total=len(steps))

            def progress(what: str, advance: int) -> None:
                bar.update(task, description=what[:42], advance=advance)

            result = run_it(progress)
            bar.update(task, description="done", completed=len(steps))
    else:  # CI, a log file: a bar would only be drawn at the end; one line per step instead
        log, done = progress_lines(), [0]

        def lines(what: str, advance: int) -> None:
            done[0] += advance
            log(f"step {done[0] + (advance == 0)}/{len(steps)} {'started' if advance == 0 else 'done'}: {what}")

        log(f"xdeploy run: {len(steps)} steps -> {cfg.out}")
        result = run_it(lines)

    from xdeploy.commands import console as make_console

    out = make_console()
    _print_summary(out, result)
    write_json(args.json, {"out": str(result.out), "summary": str(result.out / "summary.md"),
                           "parity_passed": result.parity_passed, "parity_failures": list(result.parity_failures),
                           "errors": list(result.errors), "duration_s": result.duration_s,
                           "phase_s": result.phase_s, "records": len(result.records),
                           "journal": str(result.journal), "reused_steps": list(result.reused_steps)})
    if not result.parity_passed:
        raise ParityError(f"{len(result.parity_failures)} parity check(s) failed (first: "
                          f"{result.parity_failures[0]}); report in {result.out}/summary.md")
    return 0


def _print_summary(console: Console, result: RunResult) -> None:
    from rich.markup import escape

    from xdeploy.core.fingerprint import fingerprint, machine_class
    from xdeploy.core.records import best
    from xdeploy.reports.render import stability_summary
    from xdeploy.reports.tables import decode_table, fastest_table

    recs = list(result.records)
    par = [r for r in recs if r["kind"] == "parity"]
    lat = [r for r in recs if r["kind"] == "latency"]
    fp = next((r["fingerprint"] for r in recs if isinstance(r.get("fingerprint"), dict)), None) or fingerprint()
    console.print(f"[bold]machine class:[/] {machine_class(fp)} (every figure below is for this class)",
                  soft_wrap=True)
    stab = stability_summary(recs)
    if stab:
        console.print(stab.replace("**", ""), soft_wrap=True)
    # the rows of summary.md's "Fastest per configuration" (passing parity), in the order the models ran
    order = {m: i for i, m in enumerate(dict.fromkeys(r["model"] for r in lat))}
    picks = sorted(best(lat + par), key=lambda b: (order[b.record["model"]], b.record["batch"], b.record["seq"] or 0))
    if picks:
        console.print(fastest_table(picks, lat, title="xdeploy run: best runner per model (speedup vs PyTorch eager "
                                    "fp32, same batch and seq: median of paired interleaved rounds, 95% interval)"
                                    ).rich())
    # every route that keeps a KV cache: the loop's ("cache"), an engine's ("engine cache", "paged engine cache")
    dec = [r for r in recs if r["kind"] == "decode" and r["mode"] != "recompute"]
    if dec:
        console.print(decode_table(dec, title="decoding with the KV cache (vs torch: paired rounds)").rich())
    n_fail = len(result.parity_failures)
    console.print(f"parity: {len(par) - n_fail}/{len(par)} checks pass" + (f" — [red]{n_fail} FAIL[/]" if n_fail
                                                                             else ""))
    for e in result.errors:
        console.print(f"[yellow]not run:[/] {escape(e)}")  # escaped: "xdeploy[gpu]" in a hint is not markup
    console.print(f"report: {result.out}/summary.md (plots in {result.out}/plots) — {result.duration_s:.0f} s",
                  soft_wrap=True)
