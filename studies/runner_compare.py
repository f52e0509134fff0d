"""Runner comparison on one model and shape: PyTorch eager fp32 vs ONNX Runtime vs OpenVINO, side by side.

    python -m xdeploy.studies.runner_compare                       # BERT-base, batch 1, seq 128
    python -m xdeploy.studies.runner_compare --model bert --preset tiny --rounds 5 --json out.json
    python -m xdeploy.studies.runner_compare --runners torch:fp16,ort-cuda,ort-cuda@fp16   # on an NVIDIA GPU

All candidates live in one process and are timed *interleaved*: each round gives every candidate
`--per-round` calls in turn, so a load spike on a shared machine hits all of them alike instead of one.
Each candidate is warmed up first, and each of its blocks starts with one untimed call; per-call samples
are summarized with xdeploy.bench.latency.summarize.
The timed call is the runner's prepared call (inputs already staged), the same for every backend.
Ratios are the first candidate's p50 / candidate p50 (higher = faster); by default the first is torch eager fp32.
`--runners` picks the candidates: registry specs, `@precision` naming the artifact one loads (default fp32).
Targets (core/targets.py, issue #4):
the ORT fp32 and OpenVINO bf16 speed-ups over PyTorch eager fp32 (BERT-base b1 s128).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xdeploy.bench.latency import LatencyStats, summarize
from xdeploy.core.errors import XDeployError
from xdeploy.core.fingerprint import usable_cpus
from xdeploy.core.targets import TARGETS
from xdeploy.export.artifact import load_artifact
from xdeploy.studies import finish, machine, machine_line

# candidate label -> its target (core/targets.py): minimum speed-up over torch eager fp32
LABEL_TARGETS = {"ort": "ort_fp32_vs_eager", "ov:bf16": "ov_bf16_vs_eager"}


@dataclass(frozen=True)
class Candidate:
    label: str  # "ort", "ort@fp16", "ov:bf16", ...
    runner: str  # registry spec
    precision: str  # artifact precision it loads


@dataclass(frozen=True)
class Result:
    label: str
    runner: str
    artifact_precision: str
    compute_precision: str
    threads: int
    stats: LatencyStats
    speedup: float  # baseline (first candidate) p50 / this p50
    cosine: float  # vs the baseline's output, first output tensor


def parse_candidates(text: str) -> list[Candidate]:
    """`--runners torch,ort-cuda@fp16,...` -> candidates: a registry spec, optionally `@` the artifact precision."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        runner, _, precision = item.partition("@")
        out.append(Candidate(item, runner, precision or "fp32"))
    if not out or len({c.label for c in out}) != len(out):
        raise XDeployError(f"--runners {text!r}: expected distinct comma-separated runner specs, each optionally "
                           "with @precision, e.g. torch,ort,ort@fp16")
    return out


def candidates(precisions: tuple[str, ...]) -> list[Candidate]:
    out = [Candidate("torch", "torch", "fp32"), Candidate("ort", "ort", "fp32"),
           Candidate("ov", "ov", "fp32"), Candidate("ov:bf16", "ov:bf16", "fp32")]
    out += [Candidate(f"ort@{p}", "ort", p) for p in precisions if p != "fp32"]
    return out


def compare(model: str = "bert", preset: str = "base", batch: int = 1, seq: int = 128, *,
            precisions: tuple[str, ...] | None = None, workdir: str | Path = "artifacts/runner_compare",
            threads: int = 0, rounds: int = 15, per_round: int = 2, warmup: int = 3,
            runners: str = "") -> dict[str, Any]:
    """Run the comparison; returns a JSON-able dict (numbers stay floats, seconds). `runners` picks the
    candidates (parse_candidates); the first is the baseline of every ratio and cosine."""
    from xdeploy.deploy.metrics import cosine
    from xdeploy.deploy.registry import open_runner
    from xdeploy.export.cache import cached_artifact
    from xdeploy.export.precision import EXPORT_PRECISIONS
    from xdeploy.models.spec import make_feeds

    if rounds < 1 or per_round < 1 or warmup < 0:
        raise XDeployError("need rounds >= 1, per_round >= 1 and warmup >= 0")
    at_start = machine()  # the load average before the measurement
    precisions = tuple(p for p in (precisions or EXPORT_PRECISIONS) if p in EXPORT_PRECISIONS)
    cands = parse_candidates(runners) if runners else candidates(precisions)
    unknown = sorted({c.precision for c in cands} - set(EXPORT_PRECISIONS))
    if unknown:
        raise XDeployError(f"--runners: unknown artifact precision(s) {unknown}; "
                           f"expected {', '.join(EXPORT_PRECISIONS)}")
    if runners:
        precisions = tuple(sorted({c.precision for c in cands}))
    threads = threads or usable_cpus()
    from xdeploy.verify.sensitivity import refine  # fp16 AMP / int8 sensitivity, as `xdeploy export`

    arts = {p: load_artifact(cached_artifact(model, preset=preset, precision=p, root=workdir, refine=refine,
                                             log=lambda m: print(m, file=sys.stderr, flush=True)))
            for p in sorted({"fp32", *precisions})}
    graph = arts["fp32"].graph()
    sizes = {"batch": batch, "seq": seq}
    sizes |= {k: a.opt for k, a in arts["fp32"].spec.axes.items() if k not in sizes}
    feeds = make_feeds(graph, sizes, seed=0)
    runners, calls, outputs, skipped = {}, {}, {}, {}
    try:
        for c in cands:
            try:
                r = open_runner(c.runner, arts[c.precision], threads=threads)
            except XDeployError as e:  # e.g. a GPU engine whose libraries are absent: the others still compare
                skipped[c.label] = str(e)
                continue
            runners[c.label] = r
            outputs[c.label] = r.infer(feeds)[graph.outputs[0].name]
            calls[c.label] = r.prepare(feeds)
        cands = [c for c in cands if c.label in runners]
        if not cands:
            raise XDeployError("no candidate could be opened: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
        for c in cands:  # warm-up (first calls allocate, JIT-select kernels, fill caches)
            for _ in range(warmup):
                calls[c.label]()
        samples: dict[str, list[float]] = {c.label: [] for c in cands}
        clock = time.perf_counter
        for _ in range(rounds):
            for c in cands:
                call = calls[c.label]
                # One untimed call first: the previous candidate's spinning worker threads (onnxruntime,
                # OpenMP, TBB) and cold caches would otherwise land on this candidate's first sample.
                call()
                for _ in range(per_round):
                    t0 = clock()
                    call()
                    samples[c.label].append(clock() - t0)
        infos = {label: r.info() for label, r in runners.items()}
    finally:
        for r in runners.values():
            r.close()

    first = cands[0].label
    base = summarize(samples[first]).p50
    results = []
    for c in cands:
        st = summarize(samples[c.label])
        results.append(Result(c.label, c.runner, c.precision, infos[c.label].precision, infos[c.label].threads, st,
                              base / st.p50, cosine(outputs[first], outputs[c.label])))
    return {
        "benchmark": "runner_compare", "model": model, "preset": preset, "batch": batch, "seq": seq,
        "threads": threads, "rounds": rounds, "per_round": per_round, "warmup": warmup,
        "baseline": first, "skipped": skipped, "machine": at_start,
        "versions": {k: v for i in infos.values() for k, v in i.versions.items()},
        "results": [{"label": r.label, "runner": r.runner, "artifact_precision": r.artifact_precision,
                     "compute_precision": r.compute_precision, "threads": r.threads, **r.stats.as_dict(),
                     "speedup_vs_baseline": r.speedup, "cosine_vs_baseline": r.cosine} for r in results],
        "targets": {k: {"min_speedup": TARGETS[t].minimum,
                        # a target is a speed-up over torch eager fp32: measured only against that baseline
                        "measured": next((r.speedup for r in results if r.label == k and first == "torch"), None)}
                    for k, t in LABEL_TARGETS.items()},
    }


def render(report: dict[str, Any]) -> str:
    from xdeploy.reports.render import markdown_table

    # three decimals: GPU calls take a millisecond or less
    rows = [(r["label"], r["compute_precision"], f"{r['p50'] * 1e3:.3f}", f"{r['p90'] * 1e3:.3f}",
             f"{r['min'] * 1e3:.3f}", str(int(r["n"])), f"{r['speedup_vs_baseline']:.2f}",
             f"{r['cosine_vs_baseline']:.6f}")
            for r in report["results"]]
    first = report.get("baseline", "torch")
    lines = [f"{report['model']}/{report['preset']} batch {report['batch']} seq {report['seq']}, "
             f"{report['threads']} threads, {report['rounds']}x{report['per_round']} interleaved calls", "",
             markdown_table(["candidate", "compute", "p50 ms", "p90 ms", "min ms", "n", f"x {first}",
                             f"cosine vs {first}"], rows), "", machine_line(report["machine"])]
    lines += [f"not run: {label}: {why}" for label, why in report.get("skipped", {}).items()]
    for label, tgt in report["targets"].items():
        got, target = tgt["measured"], TARGETS[LABEL_TARGETS[label]]
        verdict = "n/a" if got is None else ("met" if target.met(got) else "NOT met")
        lines.append(f"target {label} {target.text()} torch eager: {'-' if got is None else f'{got:.2f}x'} ({verdict})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xdeploy.studies.runner_compare", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert")
    p.add_argument("--preset", default="base")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--precisions", default="", help="comma list of export precisions (default: all available)")
    p.add_argument("--workdir", default="artifacts/runner_compare", help="artifacts are exported here once")
    p.add_argument("--threads", type=int, default=0, help="threads for every runner (0 = all cores)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--per-round", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runners", default="", help="candidates, e.g. torch,ort-cuda,ort-cuda@fp16 (runner spec"
                   "[@artifact precision]; the first is the baseline; default: torch, ort, ov, ov:bf16, ort@...)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE (for machines)")
    a = p.parse_args(argv)
    return finish("runner_compare", lambda: compare(
        a.model, a.preset, a.batch, a.seq, precisions=tuple(x for x in a.precisions.split(",") if x) or None,
        workdir=a.workdir, threads=a.threads, rounds=a.rounds, per_round=a.per_round, warmup=a.warmup,
        runners=a.runners),
        render, a.json)


if __name__ == "__main__":
    sys.exit(main())
