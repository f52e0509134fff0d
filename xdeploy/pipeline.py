"""The main job: every model -> export fp32/fp16/int8/int8-dynamic -> parity -> bench -> scale -> decode -> report.

    from xdeploy.pipeline import RunConfig, run_job
    result = run_job(RunConfig(out="reports/latest"))        # `xdeploy run`, `make demo`
    result.parity_passed, result.out / "summary.md"

This module only sequences the run and picks each phase's sizes: every phase is one function of the layer that
owns it, taking plain values and returning validated records (core/records.py): exporting is
export/onnx_export.py + export/convert.py, parity records verify/parity.py `artifact_parity_records`, latency and
memory bench/suite.py `bench_artifacts`, decoding bench/decode.py `decode_records`, attention scaling
bench/scale.py, the roofline bench/roofline.py, rendering reports/render.py. The run's policies sit beside it:
the memory guard (xdeploy/memory_guard.py) and the journal with --resume (xdeploy/journal_run.py).

Models: every family in the model registry, in its order. Presets: the default job uses each family's
`quick` preset (chosen by measurement to finish in <= 10 minutes on 2 cores); `--full` its `full` preset (the
base presets, for the reference report). Decoding runs for the families whose capabilities say they generate,
the scale sweep for the first with a token axis.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xdeploy.core.errors import XDeployError, one_of
from xdeploy.journal_run import JournalParts, RunJournal, config_json
from xdeploy.memory_guard import RunMemoryGuard

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

def openvino_ir_wanted(runners: Sequence[str]) -> bool:
    """The fp32 artifact carries an OpenVINO IR (export/openvino_ir.py) when a selected runner compiles it and
    openvino is installed: on BERT-base and MiniLM the IR ran OpenVINO as fast as optimum-intel's where the ONNX
    graph trailed by 6% (bf16) to 17% (f32) (docs/benchmarks.md, "Peers")."""
    from xdeploy.deploy.registry import runner_class
    from xdeploy.export.openvino_ir import available

    return any(runner_class(r).reads_openvino_ir for r in runners) and available()


def export_all(cfg: RunConfig, model: str, prog: _Progress,
               reuse: Callable[[str, Path, Callable[[], Path]], Path] | None = None) -> dict[str, Path]:
    """Every precision's artifact (export/artifact_set.py `export_precisions`), each export a progress step.
    `reuse(what, out, export)` (what: "MODEL PRESET PRECISION") may return an artifact already exported instead
    of calling export (--resume: the journal's artifact, if it still verifies)."""
    from xdeploy.export.artifact_set import export_precisions
    from xdeploy.verify.sensitivity import refine

    def each(what: str, out: Path, export: Callable[[], Path]) -> Path:
        stepped = functools.partial(_stepped, prog, "export", what, export)
        return reuse(what, out, stepped) if reuse else stepped()

    return export_precisions(model, cfg.preset(model), cfg.artifacts, cfg.precisions,
                             openvino_ir=openvino_ir_wanted(cfg.runners), fresh=cfg.fresh, refine=refine, each=each)


def _stepped(prog: _Progress, phase: str, what: str, fn: Callable[[], Path]) -> Path:
    with prog.step(phase, what):
        return fn()


PARITY_SHAPES_SMOKE: tuple[tuple[int, int | None], ...] = ((2, 17),)
# (batch, seq); None = the exported maximum. Like parity.py's defaults (seq 1, a padded row, the maximum, a fully
# padded row at batch >= 3), but the maximum at batch 1: gpt small's logits at 3 x 1024 x 50257 are 600 MB per
# copy and the comparison holds several float64 copies - the job was OOM-killed on this 24 GiB machine.
PARITY_SHAPES: tuple[tuple[int, int | None], ...] = ((1, 1), (2, 17), (3, 64), (1, None))


def parity_shapes(cfg: RunConfig) -> tuple[tuple[int, int | None], ...]:
    return PARITY_SHAPES_SMOKE if cfg.smoke else PARITY_SHAPES


def parity_step(cfg: RunConfig, model: str, prec: str, path: Path, prog: _Progress,
                shapes: Sequence[tuple[int, int | None]]) -> list[dict[str, Any]]:
    """One artifact's parity records (verify/parity.py); the job's tolerance overrides name outputs of any of its
    models: the artifact takes those it has."""
    from xdeploy.verify.parity import artifact_parity_records, parse_tolerance_overrides

    preset = cfg.preset(model)
    with prog.step("parity", f"{model} {preset} {prec}"):
        return artifact_parity_records(path, cfg.runners, model=model, preset=preset, shapes=shapes,
                                       threads=cfg.threads, overrides=parse_tolerance_overrides(cfg.tolerances) or None)


def bench_all(cfg: RunConfig, model: str, paths: dict[str, Path], prog: _Progress,
              guard: RunMemoryGuard | None = None, parts: JournalParts | None = None, budget: Budget | None = None
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


def decode_sizes(cfg: RunConfig) -> tuple[int, int]:
    """(prompt tokens, new tokens) of the decode phase."""
    return (8 if cfg.smoke else 32), (16 if cfg.smoke else (128 if cfg.full else 64))


def decode_step(cfg: RunConfig, model: str, paths: dict[str, Path], prog: _Progress, max_group: int | None = None,
                budget: Budget | None = None) -> list[dict[str, Any]]:
    """Greedy decoding on each runner and precision against the PyTorch fp32 reference (bench/decode.py), at
    most `max_group` generators open beside the baseline (the memory guard's estimate)."""
    from xdeploy.bench.decode import decode_records

    preset = cfg.preset(model)
    prompt, new = decode_sizes(cfg)
    with prog.step("decode", f"{model} {preset}"):
        return decode_records(paths, runners=cfg.runners, model=model, preset=preset, threads=cfg.threads,
                              new_tokens=new, prompt_len=prompt, min_rounds=3 if cfg.smoke else 5,
                              max_seconds=2.0 if cfg.smoke else 8.0, max_group=max_group,
                              memory_limit=cfg.memory_limit, budget=budget, notes=prog.notes.append)



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


def _command(cfg: RunConfig) -> str:
    return ("xdeploy run" + (" --full" if cfg.full else "") + (" --smoke" if cfg.smoke else "")
            + (" --resume" if cfg.resume else ""))


def sequential_budget(cfg: RunConfig) -> Budget:
    """The run's extra seconds for sequential rounds (bench/interleave.py), shared by its comparisons: one per
    model and bench batch, one per decoding model. Sized so the default job stays within 10 minutes on 2 cores."""
    from xdeploy.bench.interleave import Budget

    n = 2 * len(cfg.models) + sum(1 for m in cfg.models if _family(m).capabilities.generates)
    return Budget(10.0 if cfg.smoke else 300.0 if cfg.full else 90.0, comparisons=max(n, 1))


@dataclass
class _Steps:
    """The job while it takes its steps: each step goes through the journal (run, or reused by --resume) and
    the memory guard; a step that cannot run here is one of the run's errors, and the run goes on."""

    cfg: RunConfig
    prog: _Progress
    jr: RunJournal
    guard: RunMemoryGuard
    budget: Budget
    records: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def attempt(self, label: str, phase: str, what: str, key: dict[str, Any],
                fn: Callable[[], list[dict[str, Any]]]) -> None:
        try:
            self.records.extend(self.jr.unit(phase, what, key, fn))
        except XDeployError as e:
            self.errors.append(f"{label}: {e}")


def _run_steps(st: _Steps) -> None:
    """Every step of the plan, in its order."""
    cfg = st.cfg
    if cfg.runs("roofline"):
        st.attempt("roofline", "roofline", "machine peaks", st.jr.step_key("roofline"),
                   functools.partial(roofline_records, cfg, st.prog))
    for model in cfg.models:
        _model_steps(st, model)
    for model in _scale_models(cfg) if cfg.runs("scale") else []:
        max_t = st.guard.scale_max_t(model, "tiny" if cfg.smoke else cfg.preset(model), scale_max_t(cfg))
        if max_t is not None:
            key = st.jr.step_key("scale", model, cfg.preset(model)) | {"max_t": max_t}
            st.attempt(f"scale {model}", "scale", model, key, functools.partial(scale_all, cfg, model, st.prog, max_t))


def _model_steps(st: _Steps, model: str) -> None:
    """One model's export, parity, bench and decode steps."""
    cfg, jr, prog, guard = st.cfg, st.jr, st.prog, st.guard
    preset = cfg.preset(model)
    paths = export_all(cfg, model, prog, jr.export)  # nothing runs without the artifacts: errors propagate
    for prec, path in paths.items():
        shapes = guard.parity(model, preset, prec, paths["fp32"], parity_shapes(cfg))
        if shapes:
            st.attempt(f"parity {model}", "parity", f"{model} {preset} {prec}",
                       jr.step_key("parity", model, preset, {prec: path}),
                       functools.partial(parity_step, cfg, model, prec, path, prog, shapes))
    if cfg.runs("bench"):
        key = jr.step_key("bench", model, preset, paths)
        parts = jr.parts("bench", f"{model} {preset}", key)
        st.attempt(f"bench {model}", "bench", f"{model} {preset}", key,
                   functools.partial(bench_all, cfg, model, paths, prog, guard, parts, st.budget))
    if _family(model).capabilities.generates and cfg.runs("decode"):
        prompt, new = decode_sizes(cfg)
        if guard.decode(model, preset, paths["fp32"], prompt, new) is None:
            group = guard.decode_group(paths["fp32"], prompt, new)
            st.attempt(f"decode {model}", "decode", f"{model} {preset}", jr.step_key("decode", model, preset, paths),
                       functools.partial(decode_step, cfg, model, paths, prog, group, st.budget))


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
    from xdeploy.bench.suite import apply_thread_env

    # before torch loads OpenMP in this process (decode runs here): passive waiting; and before the journal's
    # fingerprint, which records that environment (else a second run in the same process - the Python API, a
    # test - sees OMP_WAIT_POLICY "changed" and --resume re-measures everything)
    apply_thread_env()
    # journaled with the settings as given (threads 0 = "the free cores"), so a resume keys on what was asked
    # the settings that shape a step's result are in every step's key
    settings = {"smoke": cfg.smoke, "full": cfg.full, "threads": cfg.threads, "runners": list(cfg.runners),
                "tolerances": list(cfg.tolerances), "memory_limit": cfg.memory_limit}
    jr = RunJournal(Path(cfg.out), resume=cfg.resume, config=config_json(cfg), settings=settings,
                    command=_command(cfg), steps=plan(cfg), notes=prog.notes.append, progress=prog.callback)
    if not cfg.threads:  # runners never oversubscribe: threads = the cores free now (--threads overrides)
        from xdeploy.bench.interleave import resolve_threads

        cfg = dataclasses.replace(cfg, threads=resolve_threads(0))
    st = _Steps(cfg, prog, jr, RunMemoryGuard(cfg.memory_limit, jr.writer.skip, prog.notes.append),
                sequential_budget(cfg))
    from xdeploy.core.records import record_sink

    # every record made while the job runs (core/records.py's constructor) is journaled the moment it exists
    try:
        with record_sink(jr.sink):
            try:
                _run_steps(st)
            except KeyboardInterrupt:
                jr.writer.interrupted("SIGINT")
                raise
            from xdeploy.bench.roofline import reconcile

            # no record above 100% of its peak: a peak it beats is measured again (corrections journaled too)
            records = reconcile(st.records)
        errors = st.errors + prog.notes
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
