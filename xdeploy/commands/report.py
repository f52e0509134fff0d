"""xdeploy report: render records into a report directory, or compare two reports (CI regression gate).

    xdeploy report render bench.jsonl scale.jsonl --out reports/mine
    xdeploy report compare reports/reference reports/latest [--threshold 0.10] [--json FILE]   # exit 1 on regression
"""

from __future__ import annotations

import argparse

from xdeploy.commands import add_json_option, write_json
from xdeploy.core.errors import XDeployError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    sub.required = True
    r = sub.add_parser("render", help="records (JSON lines, or a report's results.json) -> report directory",
                       description="Render benchmark records into summary.md, results.csv/json and plots.")
    r.add_argument("inputs", nargs="+", metavar="FILE", help="records as JSON lines (xdeploy bench/scale/roofline "
                   "--records), a run's journal.jsonl (a killed run gives an INCOMPLETE report naming where it "
                   "stopped) or a report directory / results.json")
    r.add_argument("--out", required=True, metavar="DIR", help="report directory (replaced atomically)")
    r.add_argument("--title", help="title of summary.md")
    add_json_option(r)
    c = sub.add_parser("compare", help="compare two reports; exit 1 on a regression",
                       description="Side-by-side table of matching records of two reports. A slowdown is a "
                       "regression when it exceeds --threshold AND the recorded p90-p50 spread of both runs.")
    c.add_argument("run_a", metavar="RUN_A", help="baseline report directory (or its results.json)")
    c.add_argument("run_b", metavar="RUN_B", help="candidate report directory (or its results.json)")
    c.add_argument("--threshold", type=float, default=0.10, help="relative slowdown that fails (default 0.10 = 10%%)")
    c.add_argument("--all", action="store_true", help="show every matched record, not only changes")
    c.add_argument("--across-machines", action="store_true",
                   help="compare runs of different machine classes (refused otherwise): timing changes are shown "
                   "as 'other machine' and never counted; parity verdicts still are")
    add_json_option(c)


def _read_inputs(paths: list[str], meta: dict) -> list[dict]:
    """Records of every input; a journal adds its run's status to `meta` (incomplete: where it stopped)."""
    from pathlib import Path

    from xdeploy.core.journal import JOURNAL_NAME, is_journal, read_journal
    from xdeploy.core.records import read_records
    from xdeploy.reports.render import load_results

    records: list[dict] = []
    for path in paths:
        p = Path(path)
        if p.is_dir() and (p / JOURNAL_NAME).is_file() and not read_journal(p / JOURNAL_NAME).complete:
            p = p / JOURNAL_NAME  # the run in this directory did not finish: its journal is newer than any report
        if p.is_file() and is_journal(p):
            st = read_journal(p)
            records += st.records()
            if not st.complete:
                meta["incomplete"] = st.status()
            meta["errors"] = list(meta.get("errors", [])) + list(st.notes)
            meta.setdefault("title", f"{st.first.get('command') or 'xdeploy run'} (from its journal"
                                     f"{'' if st.complete else ', INCOMPLETE'})")
        elif p.is_dir() or p.name == "results.json":
            records += load_results(p)["records"]
        elif p.exists():
            records += read_records(p)
        else:
            raise XDeployError(f"{path} does not exist; expected a JSON-lines records file or a report directory")
    return records


def run(args: argparse.Namespace) -> int:
    from xdeploy.commands import console as make_console

    console = make_console()
    if args.action == "render":
        from pathlib import Path

        from xdeploy.core.journal import JOURNAL_NAME
        from xdeploy.reports.render import render_report

        meta: dict = {}
        records = _read_inputs(args.inputs, meta)
        meta |= {"title": args.title or meta.get("title") or "xdeploy report",
                 "command": "xdeploy report render " + " ".join(args.inputs)}
        # rendering a run's own journal into its own directory keeps the journal there (--resume still works)
        own = {Path(args.out).resolve(), (Path(args.out) / JOURNAL_NAME).resolve()}
        carry = [JOURNAL_NAME] if any(Path(i).resolve() in own for i in args.inputs) else []
        out = render_report(records, args.out, meta=meta, carry=carry)
        inc = meta.get("incomplete")
        console.print(f"rendered {len(records)} records -> {out}/summary.md"
                      + (f" (INCOMPLETE: stopped {'in ' + inc['stopped_in'] if inc['stopped_in'] else 'between steps'})"
                         if inc else ""))
        write_json(args.json, {"out": str(out), "records": len(records), "incomplete": inc})
        return 0

    from xdeploy.reports.compare import compare_runs, render_table

    c = compare_runs(args.run_a, args.run_b, threshold=args.threshold, across_machines=args.across_machines)
    matched = sum(r.a is not None and r.b is not None for r in c.rows)
    if not matched:  # a gate that compared nothing must not pass
        raise XDeployError(f"nothing to compare: {args.run_a} and {args.run_b} have no record in common (records "
                           f"match on kind, model, preset, precision, runner and shape); {len(c.rows)} record(s) "
                           "are in only one")
    shown = c if args.all else type(c)(tuple(r for r in c.rows if r.status != "ok"), c.threshold)
    console.print(render_table(shown, title=f"{args.run_a} -> {args.run_b} (threshold {100 * c.threshold:.0f}%, "
                                             "noise = p90-p50 of A + B)"))
    if not c.same_machine:
        from rich.markup import escape

        console.print(f"[yellow]different machine classes[/]: A {escape(' + '.join(c.machines_a))}; B "
                      f"{escape(' + '.join(c.machines_b))}: timing changes are not counted")
    n_ok = sum(r.status == "ok" for r in c.rows)
    console.print(f"{matched} matched records, {n_ok} unchanged within threshold; "
                  f"{len(c.regressions)} regression(s)" + ("" if args.all else " (use --all to list every record)"))
    write_json(args.json, c.as_dict() | {"run_a": args.run_a, "run_b": args.run_b})
    return 1 if c.regressions else 0
