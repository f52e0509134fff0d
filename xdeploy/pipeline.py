"""The main job: every model -> export fp32/fp16/int8 -> parity -> bench -> scale -> decode -> report.

    from xdeploy.pipeline import RunConfig, run_job
    result = run_job(RunConfig(out="reports/latest"))        # `xdeploy run`, `make demo`
    result.parity_passed, result.out / "summary.md"

This module only orchestrates: exporting is export/onnx_export.py + export/convert.py, parity is
verify/parity.py, latency/memory records come from the benchmarks' API, attention scaling from bench/scale.py,
decoding from deploy/generate.py, the roofline from bench/roofline.py, and rendering from reports/render.py.
Every phase turns its results into records (core/records.py kinds, or the report's "parity"/"decode" kinds)
so the report and `report compare` see one flat list.

Presets: the default job uses small presets chosen by measurement to finish in <= 10 minutes on 2 cores
(`QUICK_PRESETS`); `--full` uses the base presets (`FULL_PRESETS`) for the reference report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError, one_of

MODELS = ("bert", "gpt", "vit", "transformer")
QUICK_PRESETS = {"bert": "minilm", "gpt": "tiny", "vit": "tiny", "transformer": "tiny"}
FULL_PRESETS = {"bert": "base", "gpt": "small", "vit": "base16", "transformer": "base"}
PRECISIONS = ("fp32", "fp16", "int8")
RUNNERS = ("ort", "ov")  # candidates; "torch" is the fp32 reference everything is compared with
GENERATIVE = ("gpt", "transformer")
SKIPPABLE = ("roofline", "bench", "decode", "scale")


@dataclass(frozen=True)
class RunConfig:
    """What the main job does. `smoke` is the smallest meaningful run (tests): one shape per check, a few
    timed iterations, a short scale sweep and decode."""

    out: str | Path = "reports/latest"
    artifacts: str | Path = "artifacts/run"
    models: tuple[str, ...] = MODELS
    full: bool = False
    smoke: bool = False
    precisions: tuple[str, ...] = PRECISIONS
    runners: tuple[str, ...] = RUNNERS
    threads: int = 0  # 0 = the cores free when the job starts (measured: other processes' CPU use subtracted)
    presets: dict[str, str] = field(default_factory=dict)  # per-model override of the preset table
    tolerances: tuple[str, ...] = ()  # parity overrides, `xdeploy parity --tolerance` syntax: "[OUT:]atol=X,..."
    skip: tuple[str, ...] = ()  # optional phases not to run (SKIPPABLE); export, parity and report always run

    def runs(self, phase: str) -> bool:
        return phase not in self.skip

    def preset(self, model: str) -> str:
        return self.presets.get(model) or (FULL_PRESETS if self.full else QUICK_PRESETS)[model]

    def check(self) -> None:
        for m in self.models:
            if m not in MODELS:
                raise one_of("model", m, MODELS)
        if not self.runners:
            raise XDeployError("no runners selected; expected e.g. --runners ort,ov")
        if not self.models:
            raise XDeployError(f"no models selected; expected some of: {', '.join(MODELS)}")
        for p in self.precisions:
            if p not in PRECISIONS:
                raise one_of("precision", p, PRECISIONS)
        for ph in self.skip:
            if ph not in SKIPPABLE:
                raise one_of("phase to skip", ph, SKIPPABLE)
        if "fp32" not in self.precisions:
            raise XDeployError("the precisions must include fp32 (the other artifacts are converted from it)")
        from xdeploy.deploy.registry import parse_spec

        for r in self.runners:
            parse_spec(r)
        from xdeploy.verify.parity import parse_tolerance_overrides

        parse_tolerance_overrides(self.tolerances)


@dataclass(frozen=True)
class RunResult:
    out: Path
    records: tuple[dict[str, Any], ...]
    parity_failures: tuple[str, ...]  # "bert minilm fp16 ov model/hidden: reason"
    phase_s: dict[str, float]  # wall seconds per phase (export, parity, ...)
    duration_s: float
    errors: tuple[str, ...] = ()  # phases that could not run here, with why (the report says so too)

    @property
    def parity_passed(self) -> bool:
        return not self.parity_failures


# ----------------------------------------------------------------------------------------- progress ----

class _Progress:
    """Phase timing plus an optional callback(step_description, advance) for a progress bar."""

    def __init__(self, callback: Callable[[str, int], None] | None) -> None:
        self.callback = callback or (lambda _d, _n: None)
        self.phase_s: dict[str, float] = {}
        self.notes: list[str] = []  # parts of a phase that could not run (the phase itself went on)

    @contextmanager
    def step(self, phase: str, what: str) -> Iterator[None]:
        self.callback(f"{phase}: {what}", 0)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phase_s[phase] = self.phase_s.get(phase, 0.0) + time.perf_counter() - t0
            self.callback(f"{phase}: {what}", 1)


def plan(cfg: RunConfig) -> list[tuple[str, str]]:
    """The (phase, what) steps the job will take, in order (the progress bar's total)."""
    steps: list[tuple[str, str]] = [("roofline", "machine peaks")] if cfg.runs("roofline") else []
    for m in cfg.models:
        label = f"{m} {cfg.preset(m)}"
        steps += [("export", f"{label} {p}") for p in cfg.precisions]
        steps += [("parity", f"{label} {p}") for p in cfg.precisions]
        steps += [("bench", label)] if cfg.runs("bench") else []
        if m in GENERATIVE and cfg.runs("decode"):
            steps += [("decode", label)]
    steps += [("scale", m) for m in _scale_models(cfg)] if cfg.runs("scale") else []
    steps += [("report", str(cfg.out))]
    return steps


def _scale_models(cfg: RunConfig) -> list[str]:
    """The attention sweep needs a token axis (not ViT: its T is fixed by the image); one model is enough."""
    seq_models = [m for m in ("bert", "gpt", "transformer") if m in cfg.models]
    return seq_models[:1]


# -------------------------------------------------------------------------------------------- phases ----

def _fp() -> dict[str, Any]:
    from xdeploy.core.fingerprint import fingerprint

    return fingerprint()


def export_all(cfg: RunConfig, model: str, prog: _Progress) -> dict[str, Path]:
    """fp32 through the torch exporter, the other precisions converted from it (no second torch export)."""
    from xdeploy.export.convert import convert_artifact
    from xdeploy.export.onnx_export import export

    preset = cfg.preset(model)
    root = Path(cfg.artifacts)
    paths: dict[str, Path] = {}
    for prec in cfg.precisions:
        with prog.step("export", f"{model} {preset} {prec}"):
            out = root / f"{model}-{preset}-{prec}"
            if prec == "fp32":
                paths[prec] = export(model, preset=preset, out=out, force=True)
            else:
                paths[prec] = convert_artifact(paths["fp32"], out, prec, force=True)
    return paths


PARITY_SHAPES_SMOKE: tuple[tuple[int, int | None], ...] = ((2, 17),)
# (batch, seq); None = the exported maximum. Like parity.py's defaults (seq 1, a padded row, the maximum, a fully
# padded row at batch >= 3), but the maximum at batch 1: gpt small's logits at 3 x 1024 x 50257 are 600 MB per
# copy and the comparison holds several float64 copies - the job was OOM-killed on this 24 GiB machine.
PARITY_SHAPES: tuple[tuple[int, int | None], ...] = ((1, 1), (2, 17), (3, 64), (1, None))


def parity_records(report: Any, model: str, preset: str) -> list[dict[str, Any]]:
    """One "parity" record per (graph, runner, output), worst case over the input cases."""
    groups: dict[tuple, list[Any]] = {}
    for c in report.checks:
        groups.setdefault((c.graph, c.runner, c.artifact_precision, c.output), []).append(c)
    out = []
    for (graph, runner, ap, output), cs in groups.items():
        def worst(vals: Sequence[float | None], fn: Callable[..., float]) -> float | None:
            v = [x for x in vals if x is not None and np.isfinite(x)]
            return float(fn(v)) if v else None

        failed = [c for c in cs if not c.passed]
        top1 = worst([c.top1 for c in cs], min)
        # where the ONNX graph first leaves tolerance (verify/layerwise.py), found for failing graphs only
        where = next((_divergence_text(f) for f in report.layerwise if f.graph == graph and failed), None)
        out.append({"kind": "parity", "model": model, "preset": preset, "graph": graph, "runner": runner,
                    "artifact_precision": ap, "output": output, "tolerance_precision": cs[0].precision,
                    "max_abs": worst([c.max_abs for c in cs], max) or 0.0,
                    "max_rel": worst([c.max_rel for c in cs], max) or 0.0,
                    "mean_abs": worst([c.mean_abs for c in cs], max) or 0.0,
                    "cosine": cos if (cos := worst([c.cosine for c in cs], min)) is not None else 0.0,
                    "nonfinite": int(sum(c.nonfinite for c in cs)), "top1": top1, "passed": not failed,
                    "reason": f"case {failed[0].case}: {failed[0].reason}" if failed else None,
                    "cases": len(cs), "atol": cs[0].atol, "rtol": cs[0].rtol, "min_cosine": cs[0].min_cosine,
                    "first_divergence": where})
    return out


def _divergence_text(finding: Any) -> str:
    d = finding.divergence
    if d is None:
        return finding.note or "no ONNX node leaves tolerance in onnxruntime"
    return f"{d.node} ({d.op_type}) -> {d.output}: max_abs {d.max_abs:.3g}, cosine {d.cosine:.6f}"


def parity_all(cfg: RunConfig, model: str, paths: dict[str, Path], prog: _Progress) -> list[dict[str, Any]]:
    from xdeploy.export.artifact import load_artifact
    from xdeploy.verify.parity import check_artifact, parse_tolerance_overrides

    preset = cfg.preset(model)
    overrides = parse_tolerance_overrides(cfg.tolerances) or None
    recs: list[dict[str, Any]] = []
    for prec, path in paths.items():
        with prog.step("parity", f"{model} {preset} {prec}"):
            art = load_artifact(path)
            rep = check_artifact(art, list(cfg.runners), shapes=PARITY_SHAPES_SMOKE if cfg.smoke else PARITY_SHAPES,
                                 layerwise="on-failure", threads=cfg.threads, overrides=overrides)
            recs += parity_records(rep, model, preset)
    return recs


def bench_all(cfg: RunConfig, model: str, paths: dict[str, Path], prog: _Progress) -> list[dict[str, Any]]:
    """Latency, throughput and peak memory via bench/suite.py: per (batch, seq), PyTorch eager (the fp32
    reference weights) and every candidate runner on every artifact precision timed interleaved in one child
    (paired speed-ups, stability verdicts), plus one isolated memory child per (runner, precision)."""
    from xdeploy.bench.suite import bench_artifacts
    from xdeploy.export.artifact import load_artifact

    preset = cfg.preset(model)
    batches = (1, 4) if cfg.smoke else (1, 8)
    seqs = (32,) if cfg.smoke else (128,)
    # per comparison: rotated rounds of every (runner, precision), at least min_iters and until max_seconds (at
    # most max_iters), re-measured once while unstable; the children's start-up costs more than the timing
    timing = {"warmup": 2, "min_iters": 3, "max_iters": 8, "max_seconds": 0.5} if cfg.smoke else \
        {"warmup": 2, "min_iters": 8, "max_iters": 60, "max_seconds": 3.0} if not cfg.full else \
        {"warmup": 2, "min_iters": 6, "max_iters": 60, "max_seconds": 20.0}  # base presets: up to 1 s per call
    with prog.step("bench", f"{model} {preset}"):
        arts = [load_artifact(paths[p]) for p in cfg.precisions]  # fp32 first: torch runs with it
        return bench_artifacts(arts, runners=["torch", *cfg.runners], batches=batches, seqs=seqs,
                               threads=cfg.threads, **timing)


def decode_all(cfg: RunConfig, model: str, paths: dict[str, Path], prog: _Progress) -> list[dict[str, Any]]:
    """Greedy decoding with the KV cache on each runner and precision (and one recompute-everything run),
    against the PyTorch fp32 reference's tokens."""
    from xdeploy.deploy.generate import GenerationConfig, Generator, token_agreement
    from xdeploy.export.artifact import load_artifact

    preset = cfg.preset(model)
    new = 16 if cfg.smoke else (128 if cfg.full else 64)
    prompt_len = 8 if cfg.smoke else 32
    fp = _fp()
    recs: list[dict[str, Any]] = []
    with prog.step("decode", f"{model} {preset}"), contextlib.ExitStack() as stack:
        from xdeploy.bench.interleave import compare

        arts = {p: load_artifact(path) for p, path in paths.items()}
        vocab = arts["fp32"].config.vocab_size
        prompt = [np.random.default_rng(0).integers(4, vocab - 1, size=prompt_len).tolist()]
        gc = GenerationConfig(max_new_tokens=new, eos_token_id=-1)  # never stop early: fixed work per run
        runs: list[tuple[str, str, bool]] = [("torch", "fp32", True)]
        runs += [(r, p, True) for p in cfg.precisions for r in cfg.runners]
        runs += [(cfg.runners[0], "fp32", False)]
        gens: dict[str, tuple[tuple[str, str, bool], Any]] = {}  # "ort int8" / "ort fp32 no-cache" -> generator
        for i, (runner, prec, cache) in enumerate(runs):
            try:
                g = stack.enter_context(Generator(arts[prec], runner, use_cache=cache, threads=cfg.threads))
                g.generate(prompt, dataclasses.replace(gc, max_new_tokens=2))  # warm-up: first-call allocations
            except XDeployError as e:
                if i == 0:
                    raise  # without the reference nothing else can be judged
                prog.notes.append(f"decode {model} {runner} {prec}: {e}")
                continue
            gens[f"{runner} {prec}" + ("" if cache else " no-cache")] = ((runner, prec, cache), g)
        # every generator decodes the same prompt in rotated rounds (one generation per round each): tokens/s
        # from the median round, speed-up vs torch from paired rounds, re-measured once while unstable
        cmp = compare({k: (lambda g=g: g.generate(prompt, gc)) for k, (_, g) in gens.items()}, baseline="torch fp32",
                      attempts=2, warmup=0, min_block_s=0.0, min_rounds=3 if cfg.smoke else 5, max_rounds=12,
                      max_seconds=2.0 if cfg.smoke else 8.0)
        ref = None
        for k, ((runner, prec, _cache), g) in gens.items():
            out = g.generate(prompt, gc)  # tokens and per-step latencies for the report (one more run)
            if ref is None:
                ref = out
            agree = token_agreement(ref, out)
            med = cmp.series[k].median_s
            recs.append({"kind": "decode", "model": model, "preset": preset, "runner": runner,
                         "artifact_precision": prec, "mode": out.mode, "batch": 1, "prompt_len": prompt_len,
                         "new_tokens": out.new_tokens, "ttft_s": out.time_to_first_token_s,
                         "step_s": list(out.step_s), "tokens_per_s": out.new_tokens / med,
                         "agreement": agree.agreement, "first_divergence": agree.first_divergence[0],
                         "total_s": med, "threads": cfg.threads, "stability": cmp.stability(k),
                         "fingerprint": fp})
    return recs


def scale_all(cfg: RunConfig, model: str, prog: _Progress) -> list[dict[str, Any]]:
    """Attention scaling sweep over T (bench/scale.py): every attention lowering, latency and memory per T,
    fitted exponents, the onnxruntime per-op profile; `--full` adds the ViT patch-size rows."""
    from xdeploy.bench.scale import run_scale

    with prog.step("scale", model):
        if cfg.smoke:
            return run_scale(model, smoke=True, budget=20.0, max_t=256, threads=cfg.threads)
        if cfg.full:  # scale.py's own defaults: bert minilm (all layers) to T=4096 in 600 s, ViT patches 32/16/8
            return run_scale(model, threads=cfg.threads)
        # default job: 2 layers of the model's quick preset to T=2048 within 90 s (sized for the 10-minute job)
        return run_scale(model, preset=cfg.preset(model), quick=True, max_t=2048, budget=90.0, vit_patches=(),
                         threads=cfg.threads)


def roofline_records(cfg: RunConfig, prog: _Progress) -> list[dict[str, Any]]:
    from xdeploy.bench.roofline import get_roofline

    with prog.step("roofline", "machine peaks"):
        # cached per machine + library versions; the quick measurement is enough for the default job
        return list(get_roofline(quick=not cfg.full)["records"])


# ------------------------------------------------------------------------------------------- the job ----

def run_job(cfg: RunConfig, *, progress: Callable[[str, int], None] | None = None) -> RunResult:
    """Run every phase for every model, write the report to `cfg.out`, and return what happened.

    A phase that cannot run on this machine (e.g. a missing optional runtime) is recorded in `errors` and in
    the report, and the job continues; parity failures are collected, never raised here (the CLI exits 1)."""
    cfg.check()
    from xdeploy.bench.suite import apply_thread_env

    apply_thread_env()  # before torch loads OpenMP in this process (decode runs here): passive waiting
    if not cfg.threads:  # runners never oversubscribe: threads = the cores free now (--threads overrides)
        from xdeploy.bench.interleave import free_cores

        cfg = dataclasses.replace(cfg, threads=free_cores())
    t0 = time.perf_counter()
    prog = _Progress(progress)
    records: list[dict[str, Any]] = []
    errors: list[str] = []

    def attempt(what: str, fn: Callable[[], list[dict[str, Any]]]) -> None:
        try:
            records.extend(fn())
        except XDeployError as e:
            errors.append(f"{what}: {e}")

    if cfg.runs("roofline"):
        attempt("roofline", lambda: roofline_records(cfg, prog))
    for model in cfg.models:
        paths = export_all(cfg, model, prog)  # nothing else can run without the artifacts: errors propagate
        attempt(f"parity {model}", lambda: parity_all(cfg, model, paths, prog))  # noqa: B023
        if cfg.runs("bench"):
            attempt(f"bench {model}", lambda: bench_all(cfg, model, paths, prog))  # noqa: B023
        if model in GENERATIVE and cfg.runs("decode"):
            attempt(f"decode {model}", lambda: decode_all(cfg, model, paths, prog))  # noqa: B023
    for model in _scale_models(cfg) if cfg.runs("scale") else []:
        attempt(f"scale {model}", lambda: scale_all(cfg, model, prog))  # noqa: B023

    from xdeploy.bench.roofline import reconcile
    from xdeploy.reports.render import render_report

    records = reconcile(records)  # no record above 100% of its peak: a peak it beats is measured again
    errors += prog.notes
    failures = tuple(f"{r['model']} {r.get('preset')} {r['artifact_precision']} {r['runner']} "
                     f"{r['graph']}/{r['output']}: {r['reason']}" for r in records
                     if r["kind"] == "parity" and not r["passed"])
    duration = time.perf_counter() - t0
    meta = {"title": f"xdeploy run ({'full: base presets' if cfg.full else 'default presets'})",
            "command": "xdeploy run" + (" --full" if cfg.full else "") + (" --smoke" if cfg.smoke else ""),
            "presets": ", ".join(f"{m} {cfg.preset(m)}" for m in cfg.models),
            "precisions": list(cfg.precisions), "runners": ["torch (reference)", *cfg.runners],
            "duration_s": float(duration), "phase_s": prog.phase_s, "errors": errors,
            "note": "; ".join(errors) if errors else None}
    with prog.step("report", str(cfg.out)):
        out = render_report(records, cfg.out, meta=meta)
    return RunResult(out=out, records=tuple(records), parity_failures=failures, phase_s=dict(prog.phase_s),
                     duration_s=time.perf_counter() - t0, errors=tuple(errors))
