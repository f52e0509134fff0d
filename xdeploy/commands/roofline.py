"""xdeploy roofline: the machine's measured peak GEMM FLOP/s per precision and memory bandwidth (cached)."""

from __future__ import annotations

import argparse

from xdeploy.commands import add_json_option, step_log, write_json
from xdeploy.commands import console as make_console


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small sizes and short budgets (seconds, not a minute); "
                   "a quick result is replaced by the next full measurement")
    p.add_argument("--cached", action="store_true", help="print the cached result instead of measuring "
                   "(measures if there is none)")
    p.add_argument("--records", metavar="FILE", help="write roofline records as JSON lines")
    add_json_option(p)


def run(args: argparse.Namespace) -> int:
    from xdeploy.bench.roofline import CACHE_FILE, get_roofline, peak_rows
    from xdeploy.core.fingerprint import summary
    from xdeploy.core.records import write_records
    from xdeploy.export.cache import cache_root
    from xdeploy.reports.tables import roofline_table

    console = make_console()
    data = get_roofline(refresh=not args.cached, quick=args.quick, log=step_log(console))
    console.print(roofline_table(peak_rows(data), title="machine roofline (best of several paths; min call time)",
                                 caption=summary(data["records"][0]["fingerprint"]) if data.get("records") else None
                                 ).rich())
    console.print(f"cached in {cache_root() / CACHE_FILE}")
    if args.records:
        write_records(args.records, data["records"])
    write_json(args.json, data)
    return 0
