"""xdeploy verify: run an artifact's golden probes on this machine and runner, without PyTorch (deploy/probes.py).

Exit 0: every probe passes (remembered, so the runtimes' next open here runs nothing); 1: a probe fails (one
line per failing output: graph, output, cosine, machine class), or the runner refuses the artifact on this CPU (an
int8 graph whose kernel would saturate here); 2: a usage or input error, e.g. an artifact exported before probes
existed, or `--emulate` without QEMU >= 10.

Several artifacts are checked in one process, in the order given (the runtimes start once: under `--emulate` the
emulated imports are most of a check's time). Every artifact is loaded first, so a missing or malformed one stops
the command before any check (exit 2); then each is checked, a refusal is said on stderr for its artifact, and the
next one goes on. Exit 1 when any artifact fails or is refused. `--json` writes one object for one artifact and,
for several, {"passed": bool, "artifacts": [one object each, in order]}; a refused artifact's object carries its
"error".

`--emulate avx2` runs the same check as an AVX2-only AMD Zen 3 under QEMU user mode (verify/emulate.py): the
kernels that class runs, on this machine."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from xdeploy.commands import THREADS_HELP, add_json_option, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", nargs="+", help="an artifact directory (xdeploy export / convert), or an ONNX file of "
                   "another exporter (probed now against onnxruntime CPU fp32); several are checked in turn")
    p.add_argument("--runner", default="ort", help="runner spec: ort, ov, ov:bf16, ... (default ort)")
    p.add_argument("--threads", type=int, default=0, help=THREADS_HELP)
    p.add_argument("--emulate", metavar="CLASS", default=None,
                   help="run the check as CPU class CLASS under QEMU user mode (avx2: an AVX2-only AMD Zen 3, "
                        "no AVX-512/VNNI/AMX; needs qemu-user >= 10); its kernels, not its speed")
    add_json_option(p)


def run(args: argparse.Namespace) -> int:
    from xdeploy.core.errors import ParityError
    from xdeploy.deploy.probes import verify_artifact
    from xdeploy.deploy.registry import check_spec
    from xdeploy.export.artifact import load_artifact
    from xdeploy.verify.parity import ParityReport

    check_spec(args.runner)  # a typo is a usage error (exit 2), before the artifact is read
    if args.emulate is not None:
        return _emulated(args)
    arts = [load_artifact(a) for a in args.artifact]  # a missing or malformed artifact: exit 2 before any check
    results: list[dict[str, Any]] = []
    for art in arts:
        try:
            rep = verify_artifact(art, args.runner, threads=args.threads)
        except ParityError as e:  # the runner refuses the artifact on this CPU: a verdict (exit 1), not bad input
            if len(arts) == 1:
                raise
            print(f"xdeploy: error: {art.location}: {e}", file=sys.stderr)
            results.append({"artifact": str(art.path), "runner": args.runner, "passed": False, "error": str(e)})
            continue
        cases = len({(c.graph, c.case) for c in rep.checks})
        if rep.passed:
            print(f"{art.location}: {cases} golden probe case(s), {len(rep.covered)} output(s) pass on {rep.runner} "
                  f"({rep.precision} tolerance); machine class: {rep.machine}")
        else:
            for c in rep.failures:
                print(f"{art.location}: FAIL {rep.failure_line(c)}")
        results.append({"artifact": str(art.path), "runner": rep.runner, "precision": rep.precision,
                        "machine": rep.machine, "covered": list(rep.covered)}
                       | ParityReport(rep.checks).to_json())  # the checks as `xdeploy parity --json` writes them
    passed = all(r["passed"] for r in results)
    write_json(args.json, results[0] if len(results) == 1 else {"passed": passed, "artifacts": results})
    return 0 if passed else 1


def _emulated(args: argparse.Namespace) -> int:
    """This command without --emulate, in a process emulating that class; its output and exit code are ours."""
    from xdeploy.verify.emulate import run_emulated

    argv = ["-m", "xdeploy.cli", "verify", *args.artifact, "--runner", args.runner, "--threads", str(args.threads)]
    done = run_emulated(args.emulate, argv + (["--json", args.json] if args.json else []))
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    return done.returncode
