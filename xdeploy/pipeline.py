"""The main job: every model -> export fp32/fp16/int8/int8-dynamic -> parity -> bench -> scale -> decode -> report.

    from xdeploy.pipeline import RunConfig, run_job
    result = run_job(RunConfig(out="reports/latest"))        # `xdeploy run`, `make demo`
    result.parity_passed, result.out / "summary.md"

This module only orchestrates: exporting is export/onnx_export.py + export/convert.py, parity is
verify/parity.py, latency/memory records come from the benchmarks' API, attention scaling from bench/scale.py,
decoding from deploy/generate.py, the roofline from bench/roofline.py, and rendering from reports/render.py.
Every phase turns its results into records (core/records.py kinds, or the report's "parity"/"decode" kinds)
so the report and `report compare` see one flat list.

Models: every family in the model registry, in its order. Presets: the default job uses each family's
`quick` preset (chosen by measurement to finish in <= 10 minutes on 2 cores); `--full` its `full` preset (the
base presets, for the reference report). Decoding runs for the families whose capabilities say they generate,
the scale sweep for the first with a token axis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from xdeploy.core.errors import XDeployError, one_of

if TYPE_CHECKING:
    from xdeploy.bench.interleave import Budget

PRECISIONS = ("fp32", "fp16", "int8", "int8-dynamic")  # int8 = static Q/DQ, int8-dynamic = ORT dynamic
RUNNERS = ("ort", "ov")  # candidates; "torch" is the fp32 reference everything is compared with
SKIPPABLE = ("roofline", "bench", "decode", "scale")


def registered_models() -> tuple[str, ...]:
    """Every model family of the registry, in registry order (the default job's models)."""
    from xdeploy.models.registry import MODELS

    return tuple(MODELS)


def _family(model: str) -> Any:
    from xdeploy.models.registry import get_family

    return get_family(model)


@dataclass(frozen=True)
class RunConfig:
    """What the main job does. `smoke` is the smallest meaningful run (tests): one shape per check, a few
    timed iterations, a short scale sweep and decode."""

    out: str | Path = "reports/latest"
    artifacts: str | Path = "artifacts/run"
    models: tuple[str, ...] | None = None  # None = every registered model (filled in on init)
    full: bool = False
    smoke: bool = False
    precisions: tuple[str, ...] = PRECISIONS
    runners: tuple[str, ...] = RUNNERS
    threads: int = 0  # 0 = the cores free when the job starts (measured: other processes' CPU use subtracted)
    presets: dict[str, str] = field(default_factory=dict)  # per-model override of the preset table ("*": every model)
    tolerances: tuple[str, ...] = ()  # parity overrides, `xdeploy parity --tolerance` syntax: "[OUT:]atol=X,..."
    skip: tuple[str, ...] = ()  # optional phases not to run (SKIPPABLE); export, parity and report always run
    resume: bool = False  # continue the journal in `out` (skip steps already measured with the same key)
    memory_limit: float | None = None  # bytes the memory guard may assume available (None: what the OS says)
    fresh: bool = False  # export fp32 again even when the export cache holds it (export/cache.py cached_export)
    command: str = ""  # the command line as typed, recorded in the report (default: rebuilt from the flags)

    def runs(self, phase: str) -> bool:
        return phase not in self.skip

    def __post_init__(self) -> None:
        if self.models is None:
            object.__setattr__(self, "models", registered_models())

    def preset(self, model: str) -> str:
        family = _family(model)
        return self.presets.get(model) or self.presets.get("*") or (family.full if self.full else family.quick)

    def check(self) -> None:
        if self.full and self.smoke:
            raise XDeployError("--full and --smoke exclude each other: --full runs the base presets for the "
                               "reference report, --smoke the smallest run")
        known = registered_models()
        for m in self.models:
            if m not in known:
                raise one_of("model", m, known)
        if not self.runners:
            raise XDeployError("no runners selected; expected e.g. --runners ort,ov")
        if not self.models:
            raise XDeployError(f"no models selected; expected some of: {', '.join(known)}")
        for m in self.models:
            if self.preset(m) not in _family(m).presets:
                raise one_of(f"preset of {m}", self.preset(m), _family(m).presets)
        for p in self.precisions:
            if p not in PRECISIONS:
                raise one_of("precision", p, PRECISIONS)
        for ph in self.skip:
            if ph not in SKIPPABLE:
                raise one_of("phase to skip", ph, SKIPPABLE)
        if "fp32" not in self.precisions:
            raise XDeployError("the precisions must include fp32 (the other artifacts are converted from it)")
        from xdeploy.deploy.registry import check_spec

        for r in self.runners:
            check_spec(r)
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
    journal: Path | None = None  # <out>/journal.jsonl: every step and record as it happened
    reused_steps: tuple[str, ...] = ()  # "phase: what" taken from the journal by --resume

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
        if _family(m).capabilities.generates and cfg.runs("decode"):
            steps += [("decode", label)]
    steps += [("scale", m) for m in _scale_models(cfg)] if cfg.runs("scale") else []
    steps += [("report", str(cfg.out))]
    return steps


def _scale_models(cfg: RunConfig) -> list[str]:
    """The attention sweep needs a token axis (a ViT's T is fixed by the image); one model is enough."""
    seq_models = [m for m in cfg.models if _family(m).capabilities.token_axis is not None]
    return seq_models[:1]


# -------------------------------------------------------------------------------------------- phases ----

def _fp() -> dict[str, Any]:
    from xdeploy.core.fingerprint import fingerprint

    return fingerprint()


def openvino_ir_wanted(runners: Sequence[str]) -> bool:
    """The fp32 artifact carries an OpenVINO IR (export/openvino_ir.py) when a selected runner compiles it and
    openvino is installed: on BERT-base and MiniLM the IR ran OpenVINO as fast as optimum-intel's where the ONNX
    graph trailed by 6% (bf16) to 17% (f32) (docs/benchmarks.md, "Peers")."""
    from xdeploy.deploy.registry import runner_class
    from xdeploy.export.openvino_ir import available

    return any(runner_class(r).reads_openvino_ir for r in runners) and available()


def export_all(cfg: RunConfig, model: str, prog: _Progress,
               reuse: Callable[[str, str, Path, Callable[[], Path]], Path] | None = None) -> dict[str, Path]:
    """fp32 through the torch exporter, the other precisions converted from it (no second torch export).
    `reuse(model, precision, out, export)` may return an artifact already exported instead of calling export
    (--resume: the journal's artifact, if it still verifies)."""
    from xdeploy.export.cache import cached_export
    from xdeploy.export.convert import convert_artifact
    from xdeploy.verify.sensitivity import refine

    def export(*a: Any, **k: Any) -> Path:
        from xdeploy.export.onnx_export import export as torch_export  # imports torch: only on a cache miss

        return torch_export(*a, **k)

    preset = cfg.preset(model)
    root = Path(cfg.artifacts)
    wants_ir = openvino_ir_wanted(cfg.runners)
    paths: dict[str, Path] = {}
    for prec in cfg.precisions:
        out = root / f"{model}-{preset}-{prec}"

        def one(prec: str = prec, out: Path = out) -> Path:
            with prog.step("export", f"{model} {preset} {prec}"):
                if prec == "fp32":  # with the OpenVINO IR when a selected runner compiles it
                    # an identical earlier export (same key as api.export(..., measured=False)) is copied from
                    # the export cache and verified; --fresh exports again
                    return cached_export(model, {"measured": False, "preset": preset, "out": out, "force": True,
                                                 "openvino_ir": wants_ir},
                                         lambda: export(model, preset=preset, out=out, force=True,
                                                        openvino_ir=wants_ir), fresh=cfg.fresh)
                # with the measured refinement (fp16 AMP, int8 sensitivity), as `xdeploy convert` does
                return convert_artifact(paths["fp32"], out, prec, force=True, refine=refine)
        paths[prec] = reuse(model, prec, out, one) if reuse else one()
    return paths


PARITY_SHAPES_SMOKE: tuple[tuple[int, int | None], ...] = ((2, 17),)
# (batch, seq); None = the exported maximum. Like parity.py's defaults (seq 1, a padded row, the maximum, a fully
# padded row at batch >= 3), but the maximum at batch 1: gpt small's logits at 3 x 1024 x 50257 are 600 MB per
# copy and the comparison holds several float64 copies - the job was OOM-killed on this 24 GiB machine.
PARITY_SHAPES: tuple[tuple[int, int | None], ...] = ((1, 1), (2, 17), (3, 64), (1, None))


def parity_shapes(cfg: RunConfig) -> tuple[tuple[int, int | None], ...]:
    return PARITY_SHAPES_SMOKE if cfg.smoke else PARITY_SHAPES


def parity_records(report: Any, model: str, preset: str) -> list[dict[str, Any]]:
    """One "parity" record per (graph, runner, output), worst case over the input cases."""
    from xdeploy.core.records import make_record

    fp = _fp()
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
        out.append(make_record(
            "parity", fp, model=model, preset=preset, graph=graph, runner=runner, artifact_precision=ap,
            output=output, tolerance_precision=cs[0].precision,
            # null, not 0.0, where no case could be compared (the runner failed, a shape differed)
            max_abs=worst([c.comparison.max_abs for c in cs], max),
            max_rel=worst([c.comparison.max_rel for c in cs], max),
            mean_abs=worst([c.comparison.mean_abs for c in cs], max),
            cosine=worst([c.comparison.cosine for c in cs], min),
            nonfinite=int(sum(c.comparison.nonfinite for c in cs)), top1=top1, passed=not failed,
            reason=f"case {failed[0].case}: {failed[0].reason}" if failed else None,
            cases=len(cs), atol=float(cs[0].tolerance.atol), rtol=float(cs[0].tolerance.rtol),
            min_cosine=float(cs[0].tolerance.cosine), first_divergence=where))
    return out


def _divergence_text(finding: Any) -> str:
    d = finding.divergence
    if d is None:
        return finding.note or "no ONNX node leaves tolerance in onnxruntime"
    return f"{d.node} ({d.op_type}) -> {d.output}: max_abs {d.max_abs:.3g}, cosine {d.cosine:.6f}"


def parity_all(cfg: RunConfig, model: str, paths: dict[str, Path], prog: _Progress,
               shapes: Sequence[tuple[int, int | None]] | None = None) -> list[dict[str, Any]]:
    from xdeploy.export.artifact import load_artifact
    from xdeploy.verify.parity import check_artifact, parse_tolerance_overrides

    preset = cfg.preset(model)
    overrides = parse_tolerance_overrides(cfg.tolerances) or None
    recs: list[dict[str, Any]] = []
    for prec, path in paths.items():
        with prog.step("parity", f"{model} {preset} {prec}"):
            art = load_artifact(path)
            # the job's overrides name outputs of any of its models: this artifact takes those it has
            names = {t.name for g in art.spec.graphs for t in g.outputs} | {"*"}
            mine = {k: v for k, v in (overrides or {}).items() if k in names} or None
            rep = check_artifact(art, list(cfg.runners), shapes=shapes or parity_shapes(cfg),
                                 layerwise="on-failure", threads=cfg.threads, overrides=mine)
            recs += parity_records(rep, model, preset)
    return recs


def bench_all(cfg: RunConfig, model: str, paths: dict[str, Path], prog: _Progress,
              guard: _Guard | None = None, parts: _Parts | None = None, budget: Budget | None = None
              ) -> list[dict[str, Any]]:
    """Latency, throughput and peak memory via bench/suite.py: per (batch, seq), PyTorch eager (the fp32
    reference weights) and every candidate runner on every artifact precision timed interleaved in one child
    (paired speed-ups, stability verdicts), plus one isolated memory child per (runner, precision). With
    `parts` (the journal), each comparison is journaled as a unit when it ends (done, or failed: a child that
    died), and one an interrupted attempt finished is taken from the journal instead of measured again."""
    from xdeploy.bench.suite import bench_artifacts
    from xdeploy.export.artifact import load_artifact

    preset = cfg.preset(model)
    batches = (1, 4) if cfg.smoke else (1, 8)
    seqs = (32,) if cfg.smoke else (128,)
    if guard is not None:  # drop the (batch, seq) configurations whose estimated peak does not fit
        batches, seqs = guard.bench(model, preset, paths["fp32"], batches, seqs)
        if not batches:
            return []
    failures: list[str] = []  # configurations whose child failed or died: recorded, the job goes on
    # per comparison: rotated rounds of every (runner, precision), at least min_iters and until max_seconds (at
    # most max_iters), re-measured once while unstable; the children's start-up costs more than the timing
    timing = {"warmup": 2, "min_iters": 3, "max_iters": 8, "max_seconds": 0.5} if cfg.smoke else \
        {"warmup": 2, "min_iters": 8, "max_iters": 60, "max_seconds": 3.0} if not cfg.full else \
        {"warmup": 2, "min_iters": 6, "max_iters": 60, "max_seconds": 20.0}  # base presets: up to 1 s per call
    with prog.step("bench", f"{model} {preset}"):
        arts = [load_artifact(paths[p]) for p in cfg.precisions]  # fp32 first: torch runs with it
        recs = bench_artifacts(arts, runners=["torch", *cfg.runners], batches=batches, seqs=seqs,
                               threads=cfg.threads, failures=failures, budget=budget, **timing,
                               measured=parts.measured if parts else None, compared=parts.compared if parts else None)
    prog.notes += [f"bench {model} {preset}: failed: {f}" for f in failures]
    return recs


def decode_all(cfg: RunConfig, model: str, paths: dict[str, Path], prog: _Progress,
               max_group: int | None = None, budget: Budget | None = None) -> list[dict[str, Any]]:
    """Greedy decoding with the KV cache on each runner and precision (and one recompute-everything run),
    against the PyTorch fp32 reference's tokens.

    Every generator is timed in interleaved rounds with the PyTorch baseline. All of them at once do not fit in
    memory at base presets (GPT-2 small: 14 generators, each with its own prefill and decode sessions, reached
    21.5 GB on a 24 GB machine and was killed), so they are opened in groups sized to the memory available: at
    most `max_group` (the memory guard's estimate), fewer when the generators opened so far show less memory
    left than two more would take. The baseline stays open and every group is compared with it in its own
    rounds (paired ratios stay paired)."""
    import gc as _gc

    from xdeploy.bench.interleave import Comparison, compare
    from xdeploy.bench.memory import current_rss, room_for_two_more
    from xdeploy.core.records import make_record
    from xdeploy.deploy.generate import GenerationConfig, Generator, token_agreement
    from xdeploy.deploy.registry import runner_class
    from xdeploy.export.artifact import load_artifact

    preset = cfg.preset(model)
    new = 16 if cfg.smoke else (128 if cfg.full else 64)
    prompt_len = 8 if cfg.smoke else 32
    fp = _fp()
    recs: list[dict[str, Any]] = []
    with prog.step("decode", f"{model} {preset}"), contextlib.ExitStack() as stack:
        arts = {p: load_artifact(path) for p, path in paths.items()}
        vocab = arts["fp32"].config.vocab_size
        prompt = [np.random.default_rng(0).integers(4, vocab - 1, size=prompt_len).tolist()]
        gc = GenerationConfig(max_new_tokens=new, eos_token_id=-1)  # never stop early: fixed work per run
        runs: list[tuple[str, str, bool]] = [(r, p, True) for p in cfg.precisions for r in cfg.runners]
        runs += [(cfg.runners[0], "fp32", False)]

        def opened(st: contextlib.ExitStack, runner: str, prec: str, cache: bool) -> Any:
            # opened as it is timed beside the others (deploy/base.py Runner.interleaved_options)
            g = st.enter_context(Generator(arts[prec], runner, use_cache=cache, threads=cfg.threads,
                                           **runner_class(runner).interleaved_options))
            g.generate(prompt, dataclasses.replace(gc, max_new_tokens=2))  # warm-up: first-call allocations
            return g

        base_key = "torch fp32"
        base = opened(stack, "torch", "fp32", True)  # without the reference nothing else can be judged: raises
        ref = base.generate(prompt, gc)

        def record(key: str, run: tuple[str, str, bool], g: Any, cmp: Comparison) -> dict[str, Any]:
            runner, prec, _cache = run
            out = g.generate(prompt, gc)  # tokens and per-step latencies for the report (one more run)
            agree = token_agreement(ref, out)
            med = cmp.series[key].median_s
            return make_record(
                "decode", fp, model=model, preset=preset, runner=runner, artifact_precision=prec, mode=out.mode,
                batch=1, prompt_len=prompt_len, new_tokens=out.new_tokens, ttft_s=out.time_to_first_token_s,
                step_s=list(out.step_s), tokens_per_s=out.new_tokens / med, total_s=med,
                agreement=agree.agreement, first_divergence=agree.first_divergence[0], threads=cfg.threads,
                stability=cmp.stability(key) | {"group": groups + 1,
                                                "options": dict(runner_class(runner).interleaved_options)})

        groups = 0

        def flush(group: dict[str, tuple[tuple[str, str, bool], Any]]) -> None:
            # the group and the baseline decode the same prompt in rotated rounds (one generation per round
            # each): tokens/s from the median round, speed-up vs torch from paired rounds, re-measured once
            # while unstable
            nonlocal groups
            calls = {base_key: lambda: base.generate(prompt, gc)} | \
                {k: (lambda g=g: g.generate(prompt, gc)) for k, (_, g) in group.items()}
            cmp = compare(calls, baseline=base_key, attempts=2, warmup=0, min_block_s=0.0,
                          min_rounds=3 if cfg.smoke else 5, max_rounds=24, max_seconds=2.0 if cfg.smoke else 8.0,
                          extra_s=budget.allowance() if budget is not None else 0.0)
            if budget is not None:
                budget.spend(cmp.extra_s)
            if groups == 0:  # the baseline's own record comes from the first group's rounds
                recs.append(record(base_key, ("torch", "fp32", True), base, cmp))
            recs.extend(record(k, run, g, cmp) for k, (run, g) in group.items())
            groups += 1

        group: dict[str, tuple[tuple[str, str, bool], Any]] = {}
        gstack = contextlib.ExitStack()
        cost = 0.0  # the most one generator has added to this process's memory so far
        for runner, prec, cache in runs:
            full = max_group is not None and len(group) >= max_group
            if group and (full or not room_for_two_more(cost, cfg.memory_limit)):
                flush(group)
                group = {}
                gstack.close()
                gstack = contextlib.ExitStack()
                _gc.collect()
            rss0 = current_rss()
            try:
                g = opened(gstack, runner, prec, cache)
            except XDeployError as e:
                prog.notes.append(f"decode {model} {runner} {prec}: {e}")
                continue
            cost = max(cost, current_rss() - rss0)
            group[f"{runner} {prec}" + ("" if cache else " no-cache")] = ((runner, prec, cache), g)
        if group or groups == 0:
            flush(group)
        gstack.close()
    return recs


def scale_max_t(cfg: RunConfig) -> int:
    """The largest T of the attention sweep (before the memory guard lowers it)."""
    return 256 if cfg.smoke else 4096 if cfg.full else 2048


def scale_all(cfg: RunConfig, model: str, prog: _Progress, max_t: int | None = None) -> list[dict[str, Any]]:
    """Attention scaling sweep over T (bench/scale.py): every attention lowering, latency and memory per T,
    fitted exponents, the onnxruntime per-op profile; `--full` adds the ViT patch-size rows."""
    from xdeploy.bench.scale import run_scale

    with prog.step("scale", model):
        if cfg.smoke:
            return run_scale(model, smoke=True, budget=20.0, max_t=max_t or 256, threads=cfg.threads)
        if cfg.full:  # scale.py's own defaults: bert minilm (all layers) to T=4096 in 600 s, ViT patches 32/16/8
            return run_scale(model, threads=cfg.threads, max_t=max_t)
        # default job: 2 layers of the model's quick preset to T=2048 within 90 s (sized for the 10-minute job)
        return run_scale(model, preset=cfg.preset(model), quick=True, max_t=max_t or 2048, budget=90.0, sweep_values=(),
                         threads=cfg.threads)


def roofline_records(cfg: RunConfig, prog: _Progress) -> list[dict[str, Any]]:
    from xdeploy.bench.roofline import get_roofline

    with prog.step("roofline", "machine peaks"):
        # cached per machine + library versions; the quick measurement is enough for the default job
        return list(get_roofline(quick=not cfg.full)["records"])


# ------------------------------------------------------------------------------------ memory guard ----

class _Guard:
    """Before each configuration: its estimated peak (bench/memory.py `estimate_peak`) against the memory available
    now; what does not fit is left out with a note ("skipped: needs ≈X GiB, Y GiB available")."""

    def __init__(self, cfg: RunConfig, prog: _Progress, on_skip: Callable[[str, str, str], None]) -> None:
        from xdeploy.bench.memory import MemoryGuard

        self.cfg, self.prog, self.on_skip = cfg, prog, on_skip
        self.guard = MemoryGuard(cfg.memory_limit)

    def _skip(self, phase: str, what: str, note: str) -> None:
        self.prog.notes.append(f"{phase} {what}: {note}")
        self.on_skip(phase, what, note)

    @staticmethod
    def _weights(fp32: Path) -> float:
        """fp32 weights in bytes: the fp32 artifact's ONNX files (graph + external data)."""
        return float(sum(p.stat().st_size for p in Path(fp32).iterdir() if p.suffix in (".onnx", ".data")
                         or p.name.endswith(".onnx.data")))

    def estimate(self, fp32: Path, sizes: dict[str, int], **kw: Any) -> Any:
        """MemoryEstimate of the model of the fp32 artifact at these axis sizes (inputs it does not use dropped)."""
        from xdeploy.bench.memory import estimate_peak, output_elems
        from xdeploy.export.artifact import load_artifact

        art = load_artifact(fp32, verify=False)  # verified when exported / reused
        g = art.graph("model")
        used = {d for t in g.inputs for d in t.dims if isinstance(d, str)}
        sizes = {k: v for k, v in sizes.items() if k == "batch" or k in used}
        return estimate_peak(art.config, sizes, weights_fp32_bytes=self._weights(fp32),
                             output_elems=output_elems(g, sizes), **kw)

    def bench(self, model: str, preset: str, fp32: Path, batches: Sequence[int], seqs: Sequence[int]
              ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The batches and seqs whose every combination fits (estimates grow with both)."""
        def note(b: int, t: int) -> str | None:
            return self.guard.check(self.estimate(fp32, {"batch": b, "seq": t, "src_seq": t}))

        keep_s = [t for t in seqs if note(min(batches), t) is None]
        keep_b = [b for b in batches if all(note(b, t) is None for t in keep_s)]
        for b in batches:
            for t in seqs:
                if b not in keep_b or t not in keep_s:
                    self._skip("bench", f"{model} {preset} batch {b} seq {t}", note(b, t) or
                               "skipped: its batch/seq row has a configuration that does not fit")
        if not keep_b or not keep_s:
            self.on_skip("bench", f"{model} {preset}", "every configuration skipped by the memory guard")
            return (), ()
        return tuple(keep_b), tuple(keep_s)

    def parity(self, model: str, preset: str, prec: str, path: Path, fp32: Path,
               shapes: Sequence[tuple[int, int | None]]) -> list[tuple[int, int | None]]:
        """The parity shapes that fit (parity runs in this process)."""
        keep = []
        for b, t in shapes:
            est, sizes = self.parity_estimate(fp32, b, t)
            why = self.guard.check(est)
            if why is None:
                keep.append((b, t))
            else:
                self._skip("parity", f"{model} {preset} {prec} shape {b}x{sizes.get('seq', '-')}", why)
        if not keep:  # the whole step: the journal knows it was not forgotten
            self.on_skip("parity", f"{model} {preset} {prec}", "every parity shape skipped by the memory guard")
        return keep

    def parity_estimate(self, fp32: Path, batch: int, seq: int | None) -> tuple[Any, dict[str, int]]:
        """(MemoryEstimate, sizes) of one parity shape: the reference model in this process besides the runner,
        and float64 copies of the outputs (reference, candidate, difference, ratio)."""
        from xdeploy.bench.memory import WEIGHT_COPIES, output_elems
        from xdeploy.export.artifact import load_artifact

        art = load_artifact(fp32, verify=False)
        seq_max = art.spec.axes["seq"].max if "seq" in art.spec.axes else None
        sizes = {"batch": batch} | ({"seq": seq or seq_max, "src_seq": seq or seq_max} if seq_max else {})
        f64 = 4 * 8.0 * output_elems(art.graph("model"), sizes)
        return self.estimate(fp32, sizes, weight_copies=WEIGHT_COPIES + 1, extra_bytes=f64), sizes

    def decode_estimate(self, fp32: Path, prompt: int, new: int) -> Any:
        """Decoding runs in this process: the reference and one runner, a KV cache of prompt + new tokens."""
        from xdeploy.bench.memory import WEIGHT_COPIES
        from xdeploy.export.artifact import load_artifact

        c = load_artifact(fp32, verify=False).config
        layers = getattr(c, "n_layers", 0) or getattr(c, "n_decoder_layers", 0)
        kv = 2.0 * 2 * layers * (prompt + new) * c.d_model * 4  # keys + values, past and present copies
        return self.estimate(fp32, {"batch": 1, "seq": prompt + new, "src_seq": prompt},
                             weight_copies=WEIGHT_COPIES + 1, extra_bytes=kv)

    def decode(self, model: str, preset: str, fp32: Path, prompt: int, new: int) -> str | None:
        why = self.guard.check(self.decode_estimate(fp32, prompt, new))
        if why is not None:
            self._skip("decode", f"{model} {preset}", why)
        return why

    def decode_group(self, fp32: Path, prompt: int, new: int) -> int:
        """How many generators may be open at once beside the PyTorch baseline (at least one): the decode
        estimate holds the baseline and one runner; every further runner adds WEIGHT_COPIES of the weights."""
        from xdeploy.bench.memory import WEIGHT_COPIES

        spare = self.guard.available() - self.decode_estimate(fp32, prompt, new).total
        return max(1, 1 + int(spare // (WEIGHT_COPIES * self._weights(fp32))))

    def scale_max_t(self, model: str) -> int | None:
        """The largest T of the sweep whose materialized scores fit; None when not even the smallest does."""
        from xdeploy.bench.memory import estimate_peak
        from xdeploy.bench.scale import t_values
        from xdeploy.models.registry import get_config, param_count

        preset = "tiny" if self.cfg.smoke else self.cfg.preset(model)
        c = get_config(model, preset)
        w = 4.0 * param_count(model, c)
        ts = t_values(scale_max_t(self.cfg))
        for t in ts:
            why = self.guard.check(estimate_peak(c, {"batch": 1, "seq": t, "src_seq": t}, weights_fp32_bytes=w))
            if why is not None:
                self._skip("scale", f"{model} T={t}" + (f"..{ts[-1]}" if t != ts[-1] else ""), why)
                if t == ts[0]:
                    self.on_skip("scale", model, "every T skipped by the memory guard")
                    return None
                return ts[ts.index(t) - 1]
        return ts[-1]


# ------------------------------------------------------------------------------------------- journal ----

class _Journal:
    """The run's journal (core/journal.py) and --resume: each step is journaled as it runs; a step already
    finished in the journal with the same key (configuration, artifact hashes, machine) is reused."""

    def __init__(self, cfg: RunConfig, prog: _Progress, steps: list[tuple[str, str]]) -> None:
        from xdeploy.core.journal import JOURNAL_NAME, JournalWriter, digest, machine_identity

        self.cfg, self.prog = cfg, prog
        self.fp = _fp()
        self.machine = machine_identity(self.fp)
        self.machine_key = digest(self.machine)
        self.path = Path(cfg.out) / JOURNAL_NAME
        self.reused: list[str] = []
        self._seen: set[int] = set()  # ids of records already journaled (the records.py sink, when present)
        self._keep: list[dict[str, Any]] = []  # keeps those ids valid
        header = {"config": self.config_json(), "fingerprint": self.fp, "plan": steps,
                  "command": _command(cfg)}
        self.prior = None
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        if cfg.resume and self.path.exists():
            self.writer, self.prior = JournalWriter.resume(self.path, **header)
        else:
            replaced = self._unfinished() if self.path.exists() else None
            self.writer = JournalWriter.create(self.path, **header)
            if cfg.resume:
                self.note(f"--resume: no journal in {cfg.out}; started a new run")
            if replaced:
                self.note(f"started over: the journal of an unfinished run ({replaced}) was replaced; "
                          "--resume would have continued it")

    def _unfinished(self) -> str | None:
        """Where the run journaled in `out` stopped, if it did not finish (None: finished or unreadable)."""
        from xdeploy.core.journal import read_journal

        try:
            st = read_journal(self.path)
        except XDeployError:
            return None
        return None if st.complete else (st.status()["stopped_in"] or "stopped between steps")

    def config_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self.cfg, f.name) for f in dataclasses.fields(self.cfg) if f.name != "resume"}
        return {k: str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    def step_key(self, phase: str, model: str | None, artifacts: dict[str, Path] | None = None) -> dict[str, Any]:
        """What a step's result depends on: the job settings that shape it, the artifacts' manifest hashes,
        the machine. Phases that do not use the run's artifacts (roofline, scale) have none."""
        from xdeploy.core.fsutil import sha256_file
        from xdeploy.core.journal import digest
        from xdeploy.export.artifact import MANIFEST

        c = self.cfg
        conf = {"phase": phase, "model": model, "preset": c.preset(model) if model else None, "smoke": c.smoke,
                "full": c.full, "threads": c.threads, "runners": list(c.runners), "tolerances": list(c.tolerances),
                "memory_limit": c.memory_limit}
        arts = {p: sha256_file(Path(a) / MANIFEST) for p, a in (artifacts or {}).items()}
        return {"config": digest(conf), "artifacts": arts, "machine": self.machine_key}

    def note(self, text: str) -> None:
        self.prog.notes.append(text)
        self.writer.note(text)

    def sink(self, rec: dict[str, Any]) -> None:
        """Journal one record the moment it is made (registered with core/records.py's sink where available)."""
        if id(rec) in self._seen:
            return
        self._seen.add(id(rec))
        self._keep.append(rec)
        self.writer.record(rec)

    def _why_again(self, prior: Any, key: dict[str, Any]) -> str:
        from xdeploy.core.journal import identity_changes

        why = []
        if prior.key.get("machine") != key["machine"]:
            old = self.prior.machine_at(prior.attempt) if self.prior else {}
            why.append("machine changed: " + ("; ".join(identity_changes(old, self.machine)[:4]) or "fingerprint"))
        changed = sorted(p for p in set(prior.key.get("artifacts", {})) | set(key["artifacts"])
                         if prior.key.get("artifacts", {}).get(p) != key["artifacts"].get(p))
        if changed:
            why.append(f"artifact changed: {', '.join(changed)}")
        if prior.key.get("config") != key["config"]:
            why.append("settings changed")
        return "; ".join(why) or "key changed"

    def unit(self, phase: str, what: str, key: dict[str, Any], fn: Callable[[], list[dict[str, Any]]]
             ) -> list[dict[str, Any]]:
        """Run one step with its journal events, or reuse its records from the journal being resumed."""
        prior = self.prior.finished(phase, what) if self.prior else None
        if prior is not None and prior.key == key:
            self.writer.reused(phase, what, prior.attempt, key)
            self.reused.append(f"{phase}: {what}")
            self.prog.callback(f"{phase}: {what} (journal)", 1)
            # what failed in the reused attempt (e.g. a bench child that died) is named in this report too
            self.prog.notes += [f"{phase} {what}: failed: {e}" for ev in prior.parts.values()
                                if ev.get("status") == "failed" for e in ev.get("errors") or ["?"]]
            return list(prior.records)
        if prior is not None:
            self.note(f"{phase} {what}: re-measured ({self._why_again(prior, key)})")
        t0 = time.perf_counter()
        self.writer.begin(phase, what)
        try:
            recs = fn()
        except XDeployError as e:
            self.writer.failed(phase, what, str(e))
            raise
        for r in recs:  # records the sink has not seen (made outside core/records.py's constructor)
            self.sink(r)
        self.writer.done(phase, what, key, time.perf_counter() - t0, len(recs))
        return recs

    def export(self, model: str, prec: str, out: Path, fn: Callable[[], Path]) -> Path:
        """Export one artifact, or reuse the one the journal recorded if it still verifies with the same hash."""
        from xdeploy.core.fsutil import sha256_file
        from xdeploy.export.artifact import MANIFEST, load_artifact

        what = f"{model} {self.cfg.preset(model)} {prec}"
        prior = self.prior.finished("export", what) if self.prior else None
        if prior is not None and (out / MANIFEST).is_file():
            try:
                load_artifact(out)  # every file's sha256 against the manifest
                if sha256_file(out / MANIFEST) == prior.key.get("artifact"):
                    self.writer.reused("export", what, prior.attempt, prior.key)
                    self.reused.append(f"export: {what}")
                    self.prog.callback(f"export: {what} (journal)", 1)
                    return out
            except XDeployError as e:
                self.note(f"export {what}: re-exported ({e})")
        t0 = time.perf_counter()
        self.writer.begin("export", what)
        try:
            path = fn()
        except XDeployError as e:
            self.writer.failed("export", what, str(e))
            raise
        self.writer.done("export", what, {"artifact": sha256_file(Path(path) / MANIFEST)}, time.perf_counter() - t0, 0)
        return path


    def parts(self, phase: str, what: str, key: dict[str, Any]) -> _Parts:
        """The units of a step now running (bench: its comparisons), with what the resumed journal has of them."""
        return _Parts(self, phase, what, key, self.prior.steps.get((phase, what)) if self.prior else None)


class _Parts:
    """The units of one step (bench: one interleaved comparison per batch/seq), each journaled as a "part" event
    when it ends. With --resume, a part the interrupted attempt finished under the same key (the step's key and
    the part's sizes) is taken from the journal: its records are journaled again in this attempt (so a second
    kill keeps them) and it is not measured again. A part with a failure is measured again."""

    def __init__(self, jr: _Journal, phase: str, what: str, key: dict[str, Any], prior: Any) -> None:
        self.jr, self.phase, self.what, self.key, self.prior = jr, phase, what, key, prior

    def _part(self, sizes: Mapping[str, int]) -> tuple[str, dict[str, Any]]:
        return " ".join(f"{k} {v}" for k, v in sizes.items()), self.key | {"part": dict(sizes)}

    def measured(self, sizes: Mapping[str, int]) -> list[dict[str, Any]] | None:
        name, key = self._part(sizes)
        recs = self.prior.part_records(name, key) if self.prior is not None else None
        if recs is None:
            return None
        for r in recs:
            self.jr.sink(r)
        self.jr.writer.part(self.phase, self.what, name, key, recs)
        self.jr.reused.append(f"{self.phase}: {self.what} {name}")
        self.jr.prog.callback(f"{self.phase}: {self.what} {name} (journal)", 0)
        return recs

    def compared(self, sizes: Mapping[str, int], recs: list[dict[str, Any]], errors: list[str]) -> None:
        name, key = self._part(sizes)
        self.jr.writer.part(self.phase, self.what, name, key, recs, errors)


def _command(cfg: RunConfig) -> str:
    return ("xdeploy run" + (" --full" if cfg.full else "") + (" --smoke" if cfg.smoke else "")
            + (" --resume" if cfg.resume else ""))


def sequential_budget(cfg: RunConfig) -> Budget:
    """The run's extra seconds for sequential rounds (bench/interleave.py), shared by its comparisons: one per
    model and bench batch, one per decoding model. Sized so the default job stays within 10 minutes on 2 cores."""
    from xdeploy.bench.interleave import Budget

    n = 2 * len(cfg.models) + sum(1 for m in cfg.models if _family(m).capabilities.generates)
    return Budget(10.0 if cfg.smoke else 300.0 if cfg.full else 90.0, comparisons=max(n, 1))


def _run_steps(cfg: RunConfig, prog: _Progress, jr: _Journal, guard: _Guard,
               attempt: Callable[[str, Callable[[], list[dict[str, Any]]]], None]) -> None:
    """Every step of the plan, each through the journal (run, or reused by --resume) and the memory guard."""
    budget = sequential_budget(cfg)
    if cfg.runs("roofline"):
        attempt("roofline", lambda: jr.unit("roofline", "machine peaks", jr.step_key("roofline", None),
                                            lambda: roofline_records(cfg, prog)))
    for model in cfg.models:
        preset = cfg.preset(model)
        paths = export_all(cfg, model, prog, jr.export)  # nothing runs without the artifacts: errors propagate
        for prec, path in paths.items():
            shapes = guard.parity(model, preset, prec, path, paths["fp32"], parity_shapes(cfg))
            if shapes:
                attempt(f"parity {model}", lambda: jr.unit(  # noqa: B023
                    "parity", f"{model} {preset} {prec}", jr.step_key("parity", model, {prec: path}),  # noqa: B023
                    lambda: parity_all(cfg, model, {prec: path}, prog, shapes)))  # noqa: B023
        if cfg.runs("bench"):
            bkey = jr.step_key("bench", model, paths)
            attempt(f"bench {model}", lambda: jr.unit(  # noqa: B023
                "bench", f"{model} {preset}", bkey,  # noqa: B023
                lambda: bench_all(cfg, model, paths, prog, guard,  # noqa: B023
                                  jr.parts("bench", f"{model} {preset}", bkey), budget)))  # noqa: B023
        if _family(model).capabilities.generates and cfg.runs("decode"):
            new = 16 if cfg.smoke else (128 if cfg.full else 64)
            prompt = 8 if cfg.smoke else 32
            if guard.decode(model, preset, paths["fp32"], prompt, new) is None:
                group = guard.decode_group(paths["fp32"], prompt, new)
                attempt(f"decode {model}", lambda: jr.unit(  # noqa: B023
                    "decode", f"{model} {preset}", jr.step_key("decode", model, paths),  # noqa: B023
                    lambda: decode_all(cfg, model, paths, prog, max_group=group, budget=budget)))  # noqa: B023
    for model in _scale_models(cfg) if cfg.runs("scale") else []:
        max_t = guard.scale_max_t(model)
        if max_t is not None:
            attempt(f"scale {model}", lambda: jr.unit(  # noqa: B023
                "scale", model, jr.step_key("scale", model) | {"max_t": max_t},  # noqa: B023
                lambda: scale_all(cfg, model, prog, max_t)))  # noqa: B023


# ------------------------------------------------------------------------------------------- the job ----

def run_job(cfg: RunConfig, *, progress: Callable[[str, int], None] | None = None) -> RunResult:
    """Run every phase for every model, write the report to `cfg.out`, and return what happened.

    Every step is journaled in `cfg.out`/journal.jsonl as it runs (core/journal.py): a killed run leaves what
    it measured; `resume=True` continues that journal, reusing the steps it finished. Before each configuration
    the memory guard estimates its peak and skips it, with a note, when it would not fit. A phase that cannot
    run on this machine (e.g. a missing optional runtime) is recorded in `errors` and in the report, and the
    job continues; parity failures are collected, never raised here (the CLI exits 1)."""
    from xdeploy.reports.render import check_report_dir, render_report

    cfg.check()
    check_report_dir(Path(cfg.out))  # before any work: never run for minutes and then refuse the directory
    t0 = time.perf_counter()
    prog = _Progress(progress)
    records: list[dict[str, Any]] = []
    errors: list[str] = []
    from xdeploy.bench.suite import apply_thread_env

    # before torch loads OpenMP in this process (decode runs here): passive waiting; and before the journal's
    # fingerprint, which records that environment (else a second run in the same process - the Python API, a
    # test - sees OMP_WAIT_POLICY "changed" and --resume re-measures everything)
    apply_thread_env()
    # journaled with the settings as given (threads 0 = "the free cores"), so a resume keys on what was asked
    jr = _Journal(cfg, prog, plan(cfg))
    if not cfg.threads:  # runners never oversubscribe: threads = the cores free now (--threads overrides)
        from xdeploy.bench.interleave import resolve_threads

        cfg = dataclasses.replace(cfg, threads=resolve_threads(0))
    guard = _Guard(cfg, prog, jr.writer.skip)

    def attempt(what: str, fn: Callable[[], list[dict[str, Any]]]) -> None:
        try:
            records.extend(fn())
        except XDeployError as e:
            errors.append(f"{what}: {e}")

    from xdeploy.core.records import record_sink

    # every record made while the job runs (core/records.py's constructor) is journaled the moment it exists
    try:
        with record_sink(jr.sink):
            try:
                _run_steps(cfg, prog, jr, guard, attempt)
            except KeyboardInterrupt:
                jr.writer.interrupted("SIGINT")
                raise
            from xdeploy.bench.roofline import reconcile

            # no record above 100% of its peak: a peak it beats is measured again (corrections journaled too)
            records = reconcile(records)
        errors += prog.notes
        failures = tuple(f"{r['model']} {r.get('preset')} {r['artifact_precision']} {r['runner']} "
                         f"{r['graph']}/{r['output']}: {r['reason']}" for r in records
                         if r["kind"] == "parity" and not r["passed"])
        duration = time.perf_counter() - t0
        mode = "full: base presets" if cfg.full else "smoke: smallest run" if cfg.smoke else "default presets"
        meta = {"title": f"xdeploy run ({mode})",
                "command": cfg.command or _command(cfg),
                "presets": ", ".join(f"{m} {cfg.preset(m)}" for m in cfg.models),
                "precisions": list(cfg.precisions), "runners": ["torch (reference)", *cfg.runners],
                "duration_s": float(duration), "phase_s": prog.phase_s, "errors": errors,
                "note": "; ".join(errors) if errors else None, "journal": str(jr.path),
                "reused_steps": list(jr.reused)}
        with prog.step("report", str(cfg.out)):
            out = render_report(records, cfg.out, meta=meta, carry=(jr.path.name,))
        jr.writer.end(time.perf_counter() - t0, str(out))
    finally:
        jr.writer.close()
    return RunResult(out=out, records=tuple(records), parity_failures=failures, phase_s=dict(prog.phase_s),
                     duration_s=time.perf_counter() - t0, errors=tuple(errors), journal=jr.path,
                     reused_steps=tuple(jr.reused))
