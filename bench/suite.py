"""`xdeploy bench`: latency percentiles, throughput, peak memory and % of the GEMM peak, per runner and config.

Timing is interleaved (bench/interleave.py): for one (batch, seq), every compared thing - the PyTorch baseline
and every runner x artifact precision - is loaded and prepared once in one child process and timed in
alternating rounds, so a burst of load hits all of them alike; speed-ups are medians of paired round ratios
with a 95% interval, and a comparison whose dispersion passes the thresholds is re-measured and, if it stays
unstable, carries "unstable" in its record's `stability` block instead of a speed-up. Threads per runner
default to the cores free when the run starts (`free_cores`), and PyTorch's OpenMP threads wait passively
(OMP_WAIT_POLICY=PASSIVE, measured in docs/benchmarks.md) so a core taken by another process slows it in
proportion instead of stalling it.

Memory stays isolated: each (runner, artifact, batch, seq) also runs in its own fresh child process
(bench/memory.py) that loads the runner, prepares, runs a few calls and reports the memory phases (a shared
process would report the first configuration's high-water mark for every later one).

    from xdeploy.bench.suite import run_bench
    records = run_bench("bert", preset="tiny", runners=["torch", "ort"], batches=[1, 8], seqs=[32, 128])

A model name is exported once per (precision, opset, attention kernel, config overrides) into the artifact
cache (export/cache.py: $XDEPLOY_CACHE/artifacts, keyed also by a hash of the model/export source, so a changed
exporter never serves a stale graph); an artifact directory is used as it is.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError, ort_line
from xdeploy.core.fingerprint import fingerprint
from xdeploy.core.records import best, make_record
from xdeploy.core.targets import TARGETS
from xdeploy.export.cache import cached_artifact
from xdeploy.models.spec import token_axes, token_count

from .interleave import Budget
from .memory import MemoryStats, Probe, run_isolated


@dataclass(frozen=True)
class BenchJob:
    """Everything a child needs (plain data: it is pickled to the child)."""

    runner: str
    artifact: str
    sizes: tuple[tuple[str, int], ...]
    graph: str = "model"
    threads: int = 0
    seed: int = 0
    warmup: int = 3
    min_iters: int = 10
    max_iters: int = 200
    max_seconds: float = 5.0
    return_outputs: bool = False
    runner_options: tuple[tuple[str, Any], ...] = ()


def bench_child(probe: Probe, job: BenchJob) -> dict[str, Any]:
    """Runs in the child: imports -> load (weights) -> prepare -> warm-up + timed calls (activations)."""
    apply_thread_env()
    from xdeploy.deploy.registry import open_runner, runner_class
    from xdeploy.export.artifact import load_artifact
    from xdeploy.models.spec import make_feeds

    from .latency import measure

    art = load_artifact(job.artifact, verify=False)  # the parent verified it
    runner_class(job.runner)  # import the backend's libraries before the "imported" mark
    feeds = make_feeds(art.graph(job.graph), dict(job.sizes), seed=job.seed)
    probe.mark("imported")
    runner = open_runner(job.runner, art, job.graph, threads=job.threads, **dict(job.runner_options))
    call = runner.prepare(feeds)
    probe.mark("loaded")
    stats = measure(call, warmup=job.warmup, min_iters=job.min_iters, max_iters=job.max_iters,
                    max_seconds=job.max_seconds)
    probe.mark("run")
    outputs = runner.infer(feeds) if job.return_outputs else None
    info = dataclasses.asdict(runner.info())
    runner.close()
    return {"stats": stats.as_dict(), "info": info, "fingerprint": fingerprint(), "outputs": outputs}


def run_job(job: BenchJob, *, isolate: bool = True) -> tuple[dict[str, Any], MemoryStats | None]:
    """Run one job in a child (with memory) or, with isolate=False, in this process (no memory figures)."""
    if isolate:
        result, _, mem = run_isolated(bench_child, job)
        return result, mem
    return bench_child(Probe(), job), None


# PyTorch (libgomp) threads spin while waiting for work by default: with another process on a core, a
# 2-thread torch call was 8-20x slower, passive waiting ~1x (studies/omp_policy.py, docs/benchmarks.md).
# Set in the benchmark children before torch loads; an explicit setting in the environment wins. Recorded
# in every record's fingerprint (env).
THREAD_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def apply_thread_env() -> None:
    for k, v in THREAD_ENV.items():
        os.environ.setdefault(k, v)


@dataclass(frozen=True)
class CompareJob:
    """One interleaved comparison at one (graph, sizes): candidates are (runner spec, artifact path)."""

    candidates: tuple[tuple[str, str, str], ...]  # (name shown in verdicts, e.g. "ort int8"; runner spec; artifact)
    sizes: tuple[tuple[str, int], ...]
    graph: str = "model"
    baseline: str | None = None  # name of the baseline candidate (speed-ups are relative to it)
    threads: int = 0
    seed: int = 0
    warmup: int = 2
    min_rounds: int = 8
    max_rounds: int = 40
    max_seconds: float = 3.0
    min_block_s: float = 0.02
    attempts: int = 2
    return_outputs: bool = False
    extra_seconds: float = 0.0  # sequential rounds past max_seconds while some interval is wider than the target


def compare_child(probe: Probe, job: CompareJob) -> dict[str, Any]:
    """Runs in a child: open and prepare every candidate once, then interleaved rounds (bench/interleave.py).
    A candidate that cannot open is reported in "failures" and left out; the others are still compared.

    All candidates at once may not fit in memory (GPT-2 small at batch 8: twelve runner x precision sessions
    were killed on a 24 GB machine), so they are opened in memory-sized groups beside the open baseline, each
    group compared with it in its own rounds (bench/groups.py): every speed-up is paired."""
    apply_thread_env()
    from xdeploy.deploy.registry import open_runner, runner_class
    from xdeploy.export.artifact import load_artifact
    from xdeploy.models.spec import make_feeds

    from .groups import Group, grouped_comparison
    from .interleave import Comparison, compare

    paths = {name: path for name, _spec, path in job.candidates}
    specs = {name: spec for name, spec, _path in job.candidates}
    arts: dict[str, Any] = {}
    runners: dict[str, Any] = {}
    feeds: dict[str, Any] = {}
    options: dict[str, dict[str, Any]] = {}  # name -> the runner options it was opened with
    failures: dict[str, str] = {}
    out: dict[str, Any] = {"results": {}, "failures": failures, "fingerprint": fingerprint(), "groups": 0,
                           "extra_s": 0.0}

    def open_one(stack: Any, name: str) -> Callable[[], Any]:
        art = arts.setdefault(paths[name], load_artifact(paths[name], verify=False))  # the parent verified it
        feeds[name] = make_feeds(art.graph(job.graph), dict(job.sizes), seed=job.seed)
        # opened as it is timed beside the others (deploy/base.py Runner.interleaved_options)
        options[name] = dict(runner_class(specs[name]).interleaved_options)
        runners[name] = stack.enter_context(open_runner(specs[name], art, job.graph, threads=job.threads,
                                                        **options[name]))
        return runners[name].prepare(feeds[name])

    def failed(name: str, e: Exception) -> None:  # one runner failing must not lose the others
        failures[name] = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]

    def measure(calls: dict[str, Callable[[], Any]], base: str | None) -> Comparison:
        if out["groups"] == 0:
            probe.mark("loaded")
        cmp = compare(calls, baseline=base, attempts=job.attempts, warmup=job.warmup, min_rounds=job.min_rounds,
                      max_rounds=job.max_rounds, max_seconds=job.max_seconds, min_block_s=job.min_block_s,
                      extra_s=max(job.extra_seconds - out["extra_s"], 0.0))
        out["extra_s"] += cmp.extra_s
        return cmp

    def judge(group: Group) -> None:
        out["groups"] = group.number
        for name in group.names:
            runner = runners[name]
            out["results"][name] = {
                "stats": group.comparison.latency[name].as_dict(), "info": dataclasses.asdict(runner.info()),
                "stability": group.comparison.stability(name) | {"group": group.number, "options": options[name]},
                "outputs": runner.infer(feeds[name]) if job.return_outputs else None}

    grouped_comparison(list(paths), open_one, measure, judge, failed, baseline=job.baseline)
    out["fingerprint"] = fingerprint()  # after the runners set their threads
    return out


# ------------------------------------------------------------------------------------------ artifacts ----

# ------------------------------------------------------------------------------------------ configs ----

def bench_configs(art: Any, batches: Sequence[int], seqs: Sequence[int], graph: str = "model"
                  ) -> tuple[list[dict[str, int]], list[str]]:
    """Axis sizes per (batch, seq) the graph accepts, and why the others were skipped. Graphs without a token
    axis (ViT: the image size fixes the tokens) get one config per batch; --seq is then ignored."""
    g = art.graph(graph)
    used = {d for t in g.inputs for d in t.dims if isinstance(d, str)}
    axes = art.spec.axes
    configs: list[dict[str, int]] = []
    skipped: list[str] = []
    seq_axes = [a for a in token_axes(art.capabilities) if a in used]
    for b in batches:
        for s in (seqs if seq_axes else [None]):
            sizes = {"batch": b} | {a: s for a in seq_axes}
            for a in used - set(sizes):  # other dynamic axes (e.g. a KV cache): their optimization point
                sizes[a] = axes[a].opt
            bad = [f"{a}={v} outside {axes[a].min}..{axes[a].max}" for a, v in sizes.items()
                   if not axes[a].min <= v <= axes[a].max]
            if bad:
                skipped.append(f"batch {b} seq {s}: {', '.join(bad)}")
            elif sizes not in configs:
                configs.append(sizes)
    return configs, skipped


def model_cost(art: Any) -> tuple[Callable[[Mapping[str, int]], float], int | None]:
    """One of our artifacts' FLOPs per call (a function of the axis sizes) and fixed token count (ViT's patches):
    the manifest's `cost` (models/spec.py Cost: no model code, no torch), or for an artifact written before the
    manifest had it, the model family's own (the torch model registry)."""
    if (cost := art.cost) is not None:
        return cost.flops, cost.fixed_tokens
    from xdeploy.models.registry import get_family

    family, cfg = get_family(art.model), art.config
    return (lambda sizes: float(family.flops(cfg, sizes))), family.dims(cfg).fixed_tokens


def tokens_per_call(art: Any, sizes: Mapping[str, int]) -> float | None:
    """Tokens processed per call: batch * (sum of token axes), or batch * the fixed token count (ViT)."""
    seq = sum(sizes[a] for a in token_axes(art.capabilities) if a in sizes)
    if seq:
        return float(sizes["batch"] * seq)
    n = model_cost(art)[1] if art.foreign is None else None
    return float(sizes["batch"] * n) if n else None


# ------------------------------------------------------------------------------------------ running ----

def _mem_dict(mem: MemoryStats | None) -> dict[str, float | None]:
    if mem is None:
        return {"weights_bytes": None, "load_peak_bytes": None, "activations_bytes": None, "peak_rss_bytes": None,
                "device_bytes": None}
    return {"weights_bytes": mem.weights_bytes, "load_peak_bytes": mem.load_peak_bytes,
            "activations_bytes": mem.activations_bytes, "peak_rss_bytes": mem.peak_rss,
            "device_bytes": mem.device_bytes}


def latency_record(art: Any, job: BenchJob, result: dict[str, Any], mem: MemoryStats | None,
                   peaks: Mapping[str, float], parity: bool | None = None, note: str | None = None,
                   stability: Mapping[str, Any] | None = None) -> dict[str, Any]:
    from .roofline import peak_for

    sizes = dict(job.sizes)
    st, info = result["stats"], result["info"]
    if art.foreign is not None:  # another exporter's graph: 2 x dense weights x tokens (export/foreign.py)
        from xdeploy.export.foreign import dense_flops

        flops = dense_flops(art, sizes)
    else:
        flops = model_cost(art)[0](sizes)
    achieved = flops / st["p50"] if st["p50"] > 0 else 0.0
    peak = peak_for(dict(peaks), info["precision"], int(info["threads"]))
    tokens = tokens_per_call(art, sizes)
    return make_record(
        "latency", result["fingerprint"], model=art.model, preset=art.manifest.get("preset"), graph=job.graph,
        runner=info["runner"], device=info["device"], precision=info["precision"],
        artifact_precision=art.precision, opset=art.opset, attn_impl=art.manifest.get("attn_impl"),
        threads=int(info["threads"]), batch=sizes["batch"], seq=token_count(art.capabilities, sizes), sizes=sizes,
        latency_s={k: st[k] for k in ("p50", "p90", "p99", "mean", "std", "min", "max")},
        iterations=int(st["n"]), timed_s=st["total_s"], items_per_s=sizes["batch"] / st["p50"],
        tokens_per_s=tokens / st["p50"] if tokens else None, flops=flops, achieved_flops=achieved,
        peak_flops=peak, pct_of_peak=100.0 * achieved / peak if peak else None, memory=_mem_dict(mem),
        parity_passed=parity, note=note, stability=dict(stability) if stability is not None else None)


def check_parity(art: Any, job: BenchJob, outputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
                 precision: str) -> tuple[bool, str]:
    """Every output within the tolerance of its precision (verify/parity.py's verdict) vs PyTorch fp32."""
    from xdeploy.deploy.verdict import check_outputs, tolerance_precision
    from xdeploy.models.spec import InputCase, make_feeds

    g = art.graph(job.graph)
    feeds = make_feeds(g, dict(job.sizes), seed=job.seed)
    prec = tolerance_precision(art.precision, precision)
    case = InputCase("bench", g.name, dict(job.sizes), feeds)
    checks = check_outputs(dict(reference), dict(outputs), case, g, runner=job.runner, precision=prec,
                           artifact_precision=art.precision, tol=art.spec.tolerances[prec])
    bad = [f"{c.output}: {c.reason}" for c in checks if not c.passed]
    return not bad, "; ".join(bad)


def resolve_artifacts(target: str, *, preset: str | None, precisions: Sequence[str], opset: int | None,
                      attn_impl: str | None, fresh: bool, log: Callable[[str], None] | None,
                      shapes: Mapping[str, Sequence[int]] | None = None) -> list[Any]:
    from xdeploy.export.artifact import load_artifact

    p = Path(target)
    if p.exists() or "/" in target or target.startswith(".") or target.endswith(".onnx"):
        if preset or opset or attn_impl:
            raise XDeployError("--preset/--opset/--attn-impl apply to a MODEL name, not to an artifact or ONNX file")
        art = load_artifact(p)
        if art.foreign is not None:  # another exporter's graph: its dims bound by name or --shapes
            from xdeploy.export.foreign import bind, describe, require_bound

            art = require_bound(bind(art, {k: v for k, v in (shapes or {}).items()
                                           if k in {t.name for t in art.graph("model").inputs}}))
            if log:
                log(describe(art))
        return [art]
    from xdeploy.verify.sensitivity import refine  # fp16 AMP / int8 sensitivity, as `xdeploy export` runs them

    return [load_artifact(cached_artifact(target, preset=preset, precision=prec, opset=opset, attn_impl=attn_impl,
                                          fresh=fresh, log=log, refine=refine)) for prec in precisions]


def run_bench(target: str | Sequence[str], *, runners: Sequence[str], preset: str | None = None,
              precisions: Sequence[str] = ("fp32",), batches: Sequence[int] = (1,), seqs: Sequence[int] = (128,),
              opset: int | None = None, attn_impl: str | None = None, fresh: bool = False,
              log: Callable[[str], None] | None = None, shapes: Mapping[str, Sequence[int]] | None = None,
              **kw: Any) -> list[dict[str, Any]]:
    """Benchmark every (artifact precision, runner, batch, seq) of a model name, artifact directory or ONNX file
    (export/foreign.py; `shapes`: its --shapes), or of several (timed in the same interleaved rounds); see
    `bench_artifacts` for the measurement and the keyword arguments."""
    from xdeploy.deploy.registry import check_spec

    if not runners:
        raise XDeployError("no runners given; expected e.g. --runners torch,ort")
    for r in runners:
        check_spec(r)
    for n, v in (("batch", batches), ("seq", seqs)):
        if not v or any(x < 1 for x in v):
            raise XDeployError(f"--{n} needs positive integers, got {list(v)}")
    arts = [a for t in ([target] if isinstance(target, str) else target)
            for a in resolve_artifacts(t, preset=preset, precisions=precisions, opset=opset, attn_impl=attn_impl,
                                       fresh=fresh, log=log, shapes=shapes)]
    if shapes:  # --shapes fixes batch / seq where it names them: those are the configurations then
        fixed = [a.spec.axes for a in arts if a.foreign is not None]
        batches = sorted({ax["batch"].min for ax in fixed if ax["batch"].min == ax["batch"].max}) or batches
        seqs = sorted({ax["seq"].min for ax in fixed if "seq" in ax and ax["seq"].min == ax["seq"].max}) or seqs
    return bench_artifacts(arts, runners=runners, batches=batches, seqs=seqs, log=log, **kw)


def bench_artifacts(arts: Sequence[Any], *, runners: Sequence[str], batches: Sequence[int] = (1,),
                    seqs: Sequence[int] = (128,), threads: int = 0, warmup: int = 3, min_iters: int = 8,
                    max_iters: int = 40, max_seconds: float = 5.0, isolate: bool = True, parity: bool = False,
                    peaks: Mapping[str, float] | None = None, baseline: str = "torch", attempts: int = 2,
                    log: Callable[[str], None] | None = None, failures: list[str] | None = None,
                    budget: Budget | None = None,
                    measured: Callable[[Mapping[str, int]], list[dict[str, Any]] | None] | None = None,
                    compared: Callable[[Mapping[str, int], list[dict[str, Any]], list[str]], None] | None = None
                    ) -> list[dict[str, Any]]:
    """Interleaved benchmark of every runner on every artifact (same model), per (batch, seq); returns
    validated latency records.

    Per (batch, seq), one comparison (`CompareJob`, in a child with isolate=True) times every (runner,
    artifact) in rotated rounds: at least `min_iters` rounds (at most `max_iters`) and about `max_seconds`
    in all, `attempts` tries while unstable; each record's `latency_s` is over every timed call and its
    `stability` holds the paired speed-up over `baseline` (PyTorch runs the reference weights whatever the
    artifact precision, so it is timed once, on the first artifact). `threads=0` uses the cores free at the
    start (measured). With `isolate`, each (runner, artifact) also gets a memory child (a few calls). With
    `parity`, each runner's outputs are checked against PyTorch fp32 on the same feeds with the tolerance of
    its precision (`parity_passed`). A runner that fails (runtime error, child crash) is appended to
    `failures` and skipped; all failing raises XDeployError.

    Per comparison (its axis sizes): `measured(sizes)` may return the records of that comparison already
    measured (a resumed run: they are used as they are), and `compared(sizes, records, failures)` is told what
    each comparison measured and which of its parts failed (a journal records it as one unit).

    Rounds are sequential (bench/interleave.py): a comparison stops once every interval is within the target;
    one still wider at `max_seconds` may go on for what `budget` allows it (the run's shared extra seconds;
    none without a budget)."""
    from .interleave import resolve_threads
    from .roofline import load_peaks

    peaks = load_peaks() if peaks is None else peaks
    failures = [] if failures is None else failures  # (runner, config) that failed: logged, not raised
    if threads <= 0:
        threads = resolve_threads(0)
        if log:
            log(f"threads per runner: {threads} (cores free now; --threads overrides)")
    configs: list[dict[str, int]] = []
    all_skipped: list[str] = []  # configurations the artifacts' axes do not accept
    for art in arts:
        cs, skipped = bench_configs(art, batches, seqs)
        all_skipped += [f"{art.model} {art.precision} {s}" for s in skipped]
        configs += [c for c in cs if c not in configs]
        for s in skipped:
            if log:
                log(f"skipped {art.model} {art.precision}: {s}")
    records: list[dict[str, Any]] = []
    refs: dict[tuple, dict[str, np.ndarray]] = {}

    def fail(what: str, e: BaseException | str) -> None:
        text = str(e).strip()
        # the last line (a child's traceback ends with its error), without onnxruntime's status prefix (its refusal
        # of drawn inputs mid-comparison: "Error in execution: [ONNXRuntimeError] : 2 : ...")
        msg = ort_line(text.splitlines()[-1])[:200] if text else type(e).__name__
        failures.append(f"{what}: {msg}")
        if log:  # escaped: an error text such as "pip install 'xdeploy[gpu]'" is not rich markup
            from rich.markup import escape

            log(f"[red]failed[/red] {escape(failures[-1])}")

    for sizes in configs:
        cands: list[tuple[str, Any]] = []
        for i, art in enumerate(arts):
            if sizes not in bench_configs(art, batches, seqs)[0]:
                continue
            # PyTorch runs the reference weights: once (first artifact), never for another exporter's graph
            cands += [(spec, art) for spec in runners if not (spec.partition(":")[0] == "torch" and
                                                               (i > 0 or art.foreign is not None))]
        if not cands:
            continue
        before = measured(sizes) if measured else None
        if before is not None:  # measured by an earlier attempt (a comparison is self-contained: paired rounds)
            records += before
            continue
        n_rec, n_fail = len(records), len(failures)
        names = [f"{spec} {art.precision}" for spec, art in cands]
        if len(set(names)) < len(names):  # several models (foreign graphs, or ours beside them): named apart
            names = [f"{spec} {art.model} {art.precision}" for spec, art in cands]
            names = names if len(set(names)) == len(names) else [f"{n} #{k}" for k, n in enumerate(names, 1)]
        base = next((n for n, (spec, _) in zip(names, cands) if spec == baseline), None)
        cjob = CompareJob(candidates=tuple((n, spec, str(art.location)) for n, (spec, art) in zip(names, cands)),
                          sizes=tuple(sizes.items()), baseline=base, threads=threads, warmup=warmup,
                          min_rounds=min_iters, max_rounds=max(max_iters, min_iters), max_seconds=max_seconds,
                          attempts=attempts, return_outputs=parity,
                          extra_seconds=budget.allowance() if budget is not None else 0.0)
        try:
            cres = run_isolated(compare_child, cjob)[0] if isolate else compare_child(Probe(), cjob)
        except (XDeployError, RuntimeError) as e:
            fail(f"comparison at {sizes}", e)
            if compared:
                compared(sizes, [], failures[n_fail:])
            continue
        if budget is not None:
            budget.spend(cres.get("extra_s", 0.0))
        for name, (spec, art) in zip(names, cands):
            what = f"{spec} on {art.precision} {sizes}"
            if name in cres["failures"]:
                fail(what, cres["failures"][name])
                continue
            res = cres["results"][name]
            job = BenchJob(runner=spec, artifact=str(art.location), sizes=tuple(sizes.items()), threads=threads,
                           warmup=1, min_iters=2, max_iters=3, max_seconds=0.05)
            mem = None
            if isolate:
                try:
                    mem = run_job(job)[1]
                except (XDeployError, RuntimeError) as e:
                    fail(f"{what} (memory)", e)
                    continue
            ok = None
            note = None
            if parity:
                key = (art.model, art.manifest.get("source", {}).get("weights_sha256"), job.sizes)
                ref_job = dataclasses.replace(job, runner="torch", warmup=0, min_iters=1, max_iters=1,
                                              return_outputs=True)
                if art.foreign is not None:  # onnxruntime fp32 on the foreign graph's fp32 source
                    from xdeploy.export.foreign import reference_source

                    src = str(reference_source(art).location)
                    key, ref_job = (src, job.sizes), dataclasses.replace(ref_job, runner="ort", artifact=src)
                if key not in refs:
                    refs[key] = run_job(ref_job, isolate=False)[0]["outputs"]  # outputs only: in-process
                ok, why = check_parity(art, job, res["outputs"], refs[key], res["info"]["precision"])
                note = None if ok else f"parity failed: {why}"[:300]
            rec = latency_record(art, job, {"stats": res["stats"], "info": res["info"],
                                            "fingerprint": cres["fingerprint"]}, mem, peaks, parity=ok, note=note,
                                 stability=res["stability"])
            records.append(rec)  # made by make_record: a record_sink sees it now (`xdeploy bench` prints it)
        if compared:
            compared(sizes, records[n_rec:], failures[n_fail:])
    if failures and not records:
        raise XDeployError(f"every benchmark configuration failed; first: {failures[0]}")
    if not records:
        raise XDeployError(f"nothing ran: every configuration was skipped ({'; '.join(all_skipped[:3])})")
    return records


def best_vs_baseline(records: Sequence[Mapping[str, Any]], baseline: str = "torch") -> list[dict[str, Any]]:
    """Per configuration: the fastest record whose parity passed (or was not checked) and its speed-up over
    PyTorch eager fp32 (core/records.py `best`: paired when interleaved, None when unstable), its % of the
    GEMM peak, and whether the targets (core/targets.py) are met."""
    speedup, peak = TARGETS["speedup_vs_eager"], TARGETS["pct_of_gemm_peak"]
    out = []
    for b in best(records, baseline):
        r = b.record
        out.append({"model": r["model"], "preset": r["preset"], "graph": r["graph"], "batch": r["batch"],
                    "seq": r["seq"], "runner": r["runner"], "artifact_precision": r["artifact_precision"],
                    "precision": r["precision"], "p50_s": r["latency_s"]["p50"],
                    "baseline_p50_s": b.baseline["latency_s"]["p50"] if b.baseline else None,
                    "speedup": b.speedup, "speedup_interval": b.interval, "unstable": b.unstable,
                    "pct_of_peak": r["pct_of_peak"], "parity_passed": r["parity_passed"],
                    "meets_speedup": speedup.met(b.speedup), "meets_peak": peak.met(r["pct_of_peak"]),
                    "baseline": "PyTorch eager fp32" if baseline == "torch" else f"{baseline} on the first target"})
    return out
