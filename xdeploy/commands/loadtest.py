"""xdeploy loadtest: bounded load test of a Triton embedding server on loopback (URL, or ARTIFACT: start one)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from xdeploy.commands import add_json_option, deprecated_alias, write_json
from xdeploy.commands import console as make_console
from xdeploy.core.errors import XDeployError


def _levels(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise XDeployError(f"--concurrency must be comma-separated integers, e.g. 1,4,16; got {s!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="URL|ARTIFACT",
                   help="http://127.0.0.1:PORT or grpc://127.0.0.1:PORT of a running server, or an artifact "
                        "directory (a server is started on free loopback ports, tested, and stopped)")
    p.add_argument("--concurrency", default="1,4,16", help="client threads per level (default 1,4,16)")
    p.add_argument("--requests", type=int, default=200, help="requests per level, at most (default 200)")
    p.add_argument("--time-limit", type=float, default=30.0, help="seconds per level, at most (default 30)")
    p.add_argument("--batch", type=int, default=4, help="sentences per request (default 4)")
    p.add_argument("--protocol", choices=("http", "grpc"), default="http",
                   help="client protocol when the target has no scheme or is an artifact (default http)")
    p.add_argument("--model-name", dest="model", default="embedder",
                   help="Triton model name to call (default embedder, the name `xdeploy serve` gives)")
    deprecated_alias(p, "--model", "--model-name")
    p.add_argument("--warmup", type=int, default=8, help="untimed requests first (default 8)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="with an ARTIFACT: skip the in-process Embedder baseline row")
    p.add_argument("--log", metavar="FILE", help="with an ARTIFACT: append the server log to FILE")
    p.add_argument("--records", metavar="FILE", help="also write the records as JSON lines (bench record format)")
    add_json_option(p)


def render(records: Sequence[dict[str, Any]]) -> None:
    from xdeploy.reports.tables import loadtest_table

    make_console().print(loadtest_table(records).rich())
    for r in records:
        if r["note"]:
            print(f"{'baseline' if r['protocol'] == 'none' else 'concurrency'} {r['concurrency']}: {r['note']}")


def run(args: argparse.Namespace) -> int:
    from xdeploy.serve.loadtest import LoadOptions, loadtest

    o = LoadOptions(concurrency=_levels(args.concurrency), requests=args.requests, time_limit=args.time_limit,
                    batch=args.batch, protocol=args.protocol, model=args.model, warmup=args.warmup,
                    baseline=args.baseline)
    records = loadtest(args.target, o, log=args.log)
    render(records)
    write_json(args.json, {"records": records})
    if args.records:
        from xdeploy.core.records import write_records

        write_records(args.records, records)
    return 1 if all(r["errors"] == r["requests"] for r in records) else 0
