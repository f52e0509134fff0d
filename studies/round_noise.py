"""Where slow rounds come from, and which engine settings remove them (issue #32).

The comparison `xdeploy run` makes per (model, batch): PyTorch eager fp32 beside ONNX Runtime and OpenVINO at
fp32 and int8-dynamic on BERT MiniLM (seq 128), timed in rotated rounds (bench/interleave.py `run_rounds`, a
fixed number of rounds, not sequential). Per setting it reports:

  * slow rounds: rounds more than 10% above their candidate's median, in all and by the engine timed just
    before (torch / ort / ov): a pool that is still spinning or waking up shows as slow rounds after its engine;
  * the paired speed-ups' 95% interval half-width at that number of rounds (median over the candidates), and
    how many are within +-10% (the run's target).

Settings (each opened afresh; the settings alternate, A B C D A B C D, so drift hits all alike):

  default     onnxruntime spins after a call (its default), OpenVINO's defaults, 2 ms untimed pause per block,
              then until the process's other threads are idle (run_rounds' wait_idle)
  no-idle-wait  the 2 ms pause only (run_rounds before the idle wait): a pool still spinning holds a core
  no-spin     session.intra_op.allow_spinning = 0 for every onnxruntime session
  run-spin    session.force_spinning_stop = 1: the pool spins while a Run() lasts, stops when it returns
  settle-20   a 20 ms pause before each block instead of 2 ms, no idle wait (settle-100: 100 ms)
  no-pin      OpenVINO ENABLE_CPU_PINNING = false
  burn-in     one untimed rotated round of blocks before the timed rounds

    .venv/bin/python -m xdeploy.studies.round_noise [--rounds 16] [--batches 1,8] [--repeats 2]
    .venv/bin/python -m xdeploy.studies.round_noise --cost run-spin   # what a setting costs onnxruntime itself

`--cost SETTING`: onnxruntime's candidates opened with SETTING and with no-spin, timed in the same rotated rounds
beside PyTorch and OpenVINO (the neighbours a comparison gives them), paired speed-up of SETTING over no-spin.

Take figures on a quiet machine (nothing else running); docs/benchmarks.md has them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xdeploy.bench.interleave import IDLE_WAIT_MAX_S


@dataclass(frozen=True)
class Setting:
    name: str
    settle_s: float = 0.002
    idle_wait: bool = True  # run_rounds waits for the process's other threads to go idle before a block
    burn_in: int = 0
    ort: dict[str, Any] = field(default_factory=dict)
    ov: dict[str, Any] = field(default_factory=dict)


SETTINGS = {s.name: s for s in (
    Setting("default"),
    Setting("no-spin", ort={"spinning": False}),
    Setting("run-spin", ort={"spin_between_runs": False}),
    Setting("no-idle-wait", idle_wait=False),
    Setting("settle-20", settle_s=0.020, idle_wait=False),
    Setting("settle-100", settle_s=0.100, idle_wait=False),
    Setting("no-pin", ov={"pinning": False}),
    Setting("burn-in", burn_in=1),
)}
CANDIDATES = (("torch", "fp32"), ("ort", "fp32"), ("ov", "fp32"), ("ort", "int8-dynamic"), ("ov", "int8-dynamic"))
BASELINE = "torch fp32"


def predecessors(names: list[str], rounds: int) -> dict[str, list[str | None]]:
    """The candidate timed just before each candidate's block in each round (run_rounds' rotation)."""
    order = [n for r in range(rounds) for n in names[r % len(names):] + names[:r % len(names)]]
    out: dict[str, list[str | None]] = {n: [] for n in names}
    for i, n in enumerate(order):
        out[n].append(order[i - 1] if i else None)
    return out


def analyse(rounds: dict[str, list[float]], rounds_n: int, target: float = 0.10) -> dict[str, Any]:
    """Slow-round shares (overall and by the engine timed before) and the paired intervals' half-widths."""
    from xdeploy.bench.interleave import paired_speedup

    names = list(rounds)
    pred = predecessors(names, rounds_n)
    slow: dict[str, list[bool]] = {}
    for n, vals in rounds.items():
        med = statistics.median(vals)
        for v, p in zip(vals, pred[n]):
            engine = "start" if p is None else p.split()[0]
            slow.setdefault(engine, []).append(v > 1.10 * med)
    halves = {n: paired_speedup(rounds[BASELINE], rounds[n]).half_width for n in names if n != BASELINE}
    return {"slow_share": float(np.mean([x for v in slow.values() for x in v])),
            "slow_after": {k: float(np.mean(v)) for k, v in sorted(slow.items())},
            "half_width": halves, "median_half_width": float(np.median(list(halves.values()))),
            "within": sum(h <= target for h in halves.values()), "compared": len(halves)}


def _options(setting: Setting, runner: str) -> dict[str, Any]:
    return setting.ort if runner == "ort" else setting.ov if runner == "ov" else {}


def _rounds(candidates: dict[str, tuple[str, str, dict[str, Any]]], arts: dict[str, Any], batch: int, rounds: int,
            threads: int, **timing: Any) -> Any:
    """Open each candidate (name -> runner, precision, options) on the artifact of its precision and time them
    all in the same `rounds` rotated rounds (bench/interleave.py run_rounds; `timing`: its settle_s,
    idle_max_s, burn_in)."""
    from xdeploy.bench.interleave import run_rounds
    from xdeploy.deploy.registry import open_runner
    from xdeploy.models.spec import make_feeds

    runners: dict[str, Any] = {}
    try:
        calls = {}
        for name, (runner, prec, opts) in candidates.items():
            art = arts[prec]
            r = runners[name] = open_runner(runner, art, "model", threads=threads, **opts)
            calls[name] = r.prepare(make_feeds(art.graph("model"), {"batch": batch, "seq": 128}, seed=0))
        return run_rounds(calls, min_rounds=rounds, max_rounds=rounds, max_seconds=1e-3, **timing)
    finally:
        for r in runners.values():
            r.close()


def measure(setting: Setting, arts: dict[str, Any], batch: int, rounds: int, threads: int) -> dict[str, Any]:
    att = _rounds({f"{runner} {prec}": (runner, prec, _options(setting, runner)) for runner, prec in CANDIDATES},
                  arts, batch, rounds, threads, settle_s=setting.settle_s, burn_in=setting.burn_in,
                  idle_max_s=IDLE_WAIT_MAX_S if setting.idle_wait else 0.0)
    return analyse(att.rounds, rounds) | {"other_cores": att.load.other_cores, "loadavg": att.load.loadavg_1m}


def cost(setting: Setting, arts: dict[str, Any], batch: int, rounds: int, threads: int) -> dict[str, Any]:
    """Paired speed-up of each onnxruntime candidate opened with `setting` over the same one with no-spin, in
    the same rotated rounds as PyTorch and OpenVINO."""
    from xdeploy.bench.interleave import paired_speedup

    base = SETTINGS["no-spin"]
    candidates = {}
    for runner, prec in CANDIDATES:
        for s in ((base, setting) if runner == "ort" else (base,)):
            candidates[f"{runner} {prec}" + (f" {s.name}" if runner == "ort" else "")] = (runner, prec,
                                                                                         _options(s, runner))
    att = _rounds(candidates, arts, batch, rounds, threads)
    out = {}
    for runner, prec in CANDIDATES:
        if runner == "ort":
            sp = paired_speedup(att.rounds[f"ort {prec} {base.name}"], att.rounds[f"ort {prec} {setting.name}"])
            out[prec] = {"median": sp.median, "low": sp.low, "high": sp.high}
    return {"speedup": out, "other_cores": att.load.other_cores}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--cost", default=None, help="a setting whose cost to onnxruntime itself to measure")
    ap.add_argument("--json", default=None, help="write every result here")
    args = ap.parse_args(argv)
    from xdeploy.bench.interleave import resolve_threads
    from xdeploy.bench.suite import apply_thread_env, resolve_artifacts

    apply_thread_env()
    arts = {a.precision: a for a in resolve_artifacts("bert", preset="minilm", precisions=("fp32", "int8-dynamic"),
                                                      opset=None, attn_impl=None, fresh=False, log=None)}
    threads = resolve_threads(0)
    settings = [SETTINGS[s] for s in args.settings.split(",")]
    results: list[dict[str, Any]] = []
    for batch in (int(b) for b in args.batches.split(",")):
        for rep in range(args.repeats):
            if args.cost:
                res = cost(SETTINGS[args.cost], arts, batch, args.rounds, threads) | {"setting": args.cost,
                                                                                     "batch": batch, "repeat": rep}
                results.append(res)
                print(f"b{batch} #{rep} {args.cost} over no-spin: " + ", ".join(
                    f"ort {p} {v['median']:.3f}× ({v['low']:.3f}–{v['high']:.3f})" for p, v in res["speedup"].items())
                    + f"; other processes {res['other_cores']:.2f} cores", flush=True)
                continue
            for s in settings:
                res = measure(s, arts, batch, args.rounds, threads) | {"setting": s.name, "batch": batch,
                                                                        "repeat": rep}
                results.append(res)
                after = ", ".join(f"{k} {v:.0%}" for k, v in res["slow_after"].items())
                print(f"b{batch} #{rep} {s.name:>10s}: slow rounds {res['slow_share']:.0%} (after {after}); "
                      f"interval half-width median ±{res['median_half_width']:.1%}, within ±10% "
                      f"{res['within']}/{res['compared']}; other processes {res['other_cores']:.2f} cores",
                      flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
