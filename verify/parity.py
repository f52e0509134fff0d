"""Numerical parity of a whole artifact: input cases, per-output checks against the PyTorch fp32 reference and
the layerwise follow-up on a failure. The tensor metrics are deploy/metrics.py, the per-output verdict
deploy/verdict.py (the runtimes judge their golden probes with the same one: deploy/probes.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from xdeploy.deploy.metrics import Comparison
from xdeploy.deploy.verdict import OutputCheck, check_outputs, judged_precision, output_tolerance
from xdeploy.models.spec import InputCase, shape_cases

# ------------------------------------------------------------------------------------------ input sets ----

TEXTS = (  # real text for artifacts with a tokenizer: short, long (truncated at the exported max), empty
    "A deployed model that is fast but wrong is worse than useless.",
    "The quick brown fox jumps over the lazy dog near the riverbank at dawn.",
    "Parity is what users run in CI before they ship an engine; " * 40,
    "",
    "Numbers: 3.14159, 2.71828 and 65504 (the largest half-precision value).",
)


def parse_shapes(text: str) -> list[tuple[int, int | None]]:
    """'1x1,4x64,2xmax' -> [(1, 1), (4, 64), (2, None)]; None = the exported maximum."""
    from xdeploy.core.errors import XDeployError

    out: list[tuple[int, int | None]] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        b, sep, s = item.lower().partition("x")
        try:
            if not sep or int(b) < 1 or (s != "max" and int(s) < 1):
                raise ValueError
            out.append((int(b), None if s == "max" else int(s)))
        except ValueError:
            raise XDeployError(f"bad shape {item!r}; expected BATCHxSEQ with positive integers, e.g. 2x17 or "
                               f"4xmax") from None
    if not out:
        raise XDeployError("--shapes is empty; expected BATCHxSEQ[,BATCHxSEQ...], e.g. 1x1,2x17,3xmax")
    return out


DEFAULT_SHAPES: tuple[tuple[int, int | None], ...] = ((1, 1), (2, 17), (3, None))


def input_cases(artifact: Any, graph: str = "model", shapes: Sequence[tuple[int, int | None]] = DEFAULT_SHAPES,
                *, seed: int = 0, texts: Sequence[str] = TEXTS) -> list[InputCase]:
    """Seeded inputs for `graph`: each shape right-pads its last row to half length (batch > 1), shapes with
    batch >= 3 also fully pad row 0 (the fp16-softmax / exported-SDPA NaN trap), and an artifact with a
    tokenizer adds real tokenized `texts` (padded to the longest, truncated at the exported maximum)."""
    g = artifact.graph(graph)
    cases = shape_cases(artifact.spec, g, shapes, seed=seed)
    text = _text_case(artifact, g, texts) if artifact.tokenizer_dir is not None and texts else None
    return cases + ([text] if text else [])


def _text_case(artifact: Any, g: Any, texts: Sequence[str]) -> InputCase | None:
    """Real tokenized text for a graph fed by (ids, mask[, zeros]) over (batch, seq); None for other graphs."""
    from tokenizers import Tokenizer

    from xdeploy.core.errors import XDeployError

    ids_t = [t for t in g.inputs if t.kind == "ids"]
    if len(ids_t) != 1 or any(t.kind not in ("ids", "mask", "zeros") or len(t.dims) != 2 or t.dims[0] != "batch"
                              or t.dims != ids_t[0].dims for t in g.inputs):
        return None
    seq_axis = ids_t[0].dims[1]
    ax = artifact.spec.axes[seq_axis]
    path = artifact.tokenizer_dir / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise XDeployError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
    tok.no_padding()  # we pad (and build the mask) ourselves
    tok.enable_truncation(ax.max)
    encs = tok.encode_batch(list(texts)[:artifact.spec.axes["batch"].max])
    n = max(ax.min, max(len(e.ids) for e in encs))
    ids = np.zeros((len(encs), n), np.int64)
    mask = np.zeros((len(encs), n), np.int64)
    for i, e in enumerate(encs):
        ids[i, :len(e.ids)], mask[i, :len(e.ids)] = e.ids, 1
    sizes = {"batch": len(encs), seq_axis: n}
    feeds = {t.name: (ids if t.kind == "ids" else mask if t.kind == "mask" else np.zeros_like(ids)).astype(t.dtype)
             for t in g.inputs}
    return InputCase(f"text {len(encs)}x{n}", g.name, sizes, feeds)


# ----------------------------------------------------------------------------------------- checking ----

def parse_tolerance_overrides(items: Sequence[str]) -> dict[str, dict[str, float]]:
    """['logits:atol=1e-3,cosine=0.99', 'rtol=0.02'] -> {'logits': {...}, '*': {'rtol': 0.02}}."""
    from xdeploy.core.errors import XDeployError

    out: dict[str, dict[str, float]] = {}
    for item in items:
        name, sep, rest = item.rpartition(":")
        target = name if sep else "*"
        for kv in filter(None, rest.split(",")):
            k, eq, v = kv.partition("=")
            k = k.strip()
            try:
                if not eq or k not in ("atol", "rtol", "cosine"):
                    raise ValueError
                val = float(v)
                if not np.isfinite(val) or val < 0:
                    raise ValueError
            except ValueError:
                raise XDeployError(f"bad tolerance {item!r}; expected [OUTPUT:]atol=X,rtol=Y,cosine=Z with "
                                   f"finite non-negative numbers") from None
            out.setdefault(target, {})[k] = val
    return out


# ------------------------------------------------------------------------------------------ running ----

@dataclass(frozen=True)
class LayerwiseFinding:
    """Where the candidate ONNX of one graph first leaves tolerance against the fp32 reference graph."""

    artifact_precision: str
    graph: str
    case: str
    precision: str  # tolerance used
    divergence: Any  # verify.layerwise.Divergence | None
    note: str = ""
    runtime: str = "ort"  # where the candidate ran: ort, ov, ov:bf16


@dataclass(frozen=True)
class ParityReport:
    checks: tuple[OutputCheck, ...]
    layerwise: tuple[LayerwiseFinding, ...] = ()
    runners: tuple[dict[str, Any], ...] = ()
    reference: str = "torch fp32"  # deploy/registry.py reference_name: onnxruntime fp32 for a foreign graph

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[OutputCheck]:
        return [c for c in self.checks if not c.passed]

    def to_json(self) -> dict[str, Any]:
        import dataclasses

        def clean(v: Any) -> Any:  # JSON has no NaN/Inf: non-finite floats become null (nested too)
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [clean(x) for x in v]
            return None if isinstance(v, float) and not np.isfinite(v) else v

        def rec(obj: Any) -> dict[str, Any]:
            return clean(dataclasses.asdict(obj))

        return {"passed": self.passed, "reference": self.reference, "checks": [clean(c.as_dict()) for c in self.checks],
                "layerwise": [rec(f) for f in self.layerwise], "runners": list(self.runners)}


def drop_empty_rows(graph: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The feeds without their fully padded rows (garbage by definition; layerwise compares whole tensors)."""
    keep = None
    for t in graph.inputs:
        if t.kind == "mask" and len(t.dims) == 2 and t.dims[0] == "batch":
            row = feeds[t.name].any(axis=1)
            keep = row if keep is None else keep & row
    if keep is None or keep.all() or not keep.any():
        return feeds
    out = {}
    for t in graph.inputs:
        a = feeds[t.name]
        out[t.name] = np.ascontiguousarray(np.compress(keep, a, axis=t.dims.index("batch"))) \
            if "batch" in t.dims else a
    return out


def reexport_reference(artifact: Any, graph: str) -> Any:
    """The fp32 ONNX of `graph` re-exported in memory from the artifact's reference weights (needs torch)."""
    import torch

    from xdeploy.deploy.torch_runner import load_reference
    from xdeploy.export.onnx_export import export_graph

    with torch.no_grad():
        return export_graph(load_reference(artifact), artifact.graph(graph), artifact.spec, artifact.opset)


def check_artifact(artifact: Any, runners: Sequence[str], *, shapes: Sequence[tuple[int, int | None]] = DEFAULT_SHAPES,
                   graphs: Sequence[str] | None = None, overrides: dict[str, dict[str, float]] | None = None,
                   seed: int = 0, texts: Sequence[str] = TEXTS, layerwise: str = "on-failure",
                   reference_onnx: Any = None, threads: int = 0) -> ParityReport:
    """Run the same seeded inputs through each runner and the PyTorch fp32 reference; judge every output.

    layerwise: "never", "on-failure" (per graph with a failing check) or "always". `reference_onnx(graph)`
    returns the fp32 ONNX to compare the artifact's graph with (path or ModelProto); default: re-exported
    from the artifact's reference weights."""
    from xdeploy.core.errors import XDeployError
    from xdeploy.deploy.registry import check_spec, open_reference, open_runner, reference_name
    from xdeploy.export.artifact import Artifact, load_artifact
    from xdeploy.export.foreign import reference_source, require_bound

    if not isinstance(artifact, Artifact):  # a path, like open_runner and Generator take
        artifact = load_artifact(artifact)
    require_bound(artifact)  # a foreign graph's symbolic dims: recognized or given (--shapes)
    if reference_onnx is None and artifact.foreign is not None:  # layerwise: the foreign graph's fp32 source
        reference_onnx = lambda g: reference_source(artifact).onnx_path(g)  # noqa: E731
    if layerwise not in ("never", "on-failure", "always"):
        raise XDeployError(f"layerwise mode {layerwise!r}; expected never, on-failure or always")
    for spec in runners:  # a misspelt spec is a usage error, not a runner that fails parity
        check_spec(spec)
    graph_names = list(graphs) if graphs else [g.name for g in artifact.spec.graphs]
    outputs = {t.name for gname in graph_names for t in artifact.graph(gname).outputs}
    unknown = sorted(set(overrides or {}) - outputs - {"*"})
    if unknown:
        raise XDeployError(f"tolerance override for unknown output(s) {', '.join(unknown)}; expected an output "
                           f"of graph(s) {', '.join(graph_names)}: {', '.join(sorted(outputs))}")
    checks: list[OutputCheck] = []
    infos: list[dict[str, Any]] = []
    findings: list[LayerwiseFinding] = []
    for gname in graph_names:
        g = artifact.graph(gname)
        cases = input_cases(artifact, gname, shapes, seed=seed, texts=texts)
        with open_reference(artifact, gname, threads=threads) as ref_runner:
            refs = [ref_runner.infer(c.feeds) for c in cases]
        failed_cases: list[tuple[InputCase, OutputCheck]] = []  # (case, its first failing check)
        for spec in runners:
            try:
                with open_runner(spec, artifact, gname, threads=threads) as r:
                    info = r.info()
                    # The torch runner computes from the reference weights, never the artifact's ONNX graph.
                    prec = judged_precision(spec, artifact.precision, info.precision)
                    tol = artifact.spec.tolerances.get(prec, artifact.tolerance)
                    if gname == graph_names[0]:
                        infos.append({"runner": spec, "device": info.device, "precision": info.precision,
                                      "threads": info.threads, "versions": dict(info.versions)})
                    for case, ref in zip(cases, refs):
                        got = check_outputs(ref, r.infer(case.feeds), case, g, runner=spec, precision=prec,
                                            artifact_precision=artifact.precision, tol=tol, overrides=overrides)
                        checks += got
                        bad = [c for c in got if not c.passed]
                        if bad:
                            failed_cases.append((case, bad[0]))
            except XDeployError as e:
                # A runner that cannot load or run this artifact fails parity; the other runners still report.
                # (Unknown runner names were refused before anything ran.)
                why = f"runner error: {e}"
                checks += [OutputCheck(spec, artifact.precision, artifact.precision, gname, "-", t.name,
                                       Comparison.not_compared(why), artifact.tolerance, False, why)
                           for t in g.outputs]
        if layerwise == "always" or (layerwise == "on-failure" and failed_cases):
            findings.append(_layerwise(artifact, g, cases, failed_cases, reference_onnx, overrides))
    return ParityReport(tuple(checks), tuple(findings), tuple(infos), reference_name(artifact))


def _layerwise(artifact: Any, g: Any, cases: list[InputCase], failed: list[tuple[InputCase, OutputCheck]],
               reference_onnx: Any, overrides: dict[str, dict[str, float]] | None = None) -> LayerwiseFinding:
    """Locate the first divergent node of the artifact's graph for the first failure that involves the graph.

    The candidate runs where it failed when that runner is a layerwise runtime (`layerwise.runtimes()`, e.g. `ov`,
    `ov:bf16`: same ONNX, that runtime's compute), otherwise in onnxruntime on the CPU (a graph-level defect shows
    there too). A failure of a runner that does not run the graph (torch) is not bisected."""
    from xdeploy.deploy.registry import runner_class
    from xdeploy.verify.layerwise import find_divergence, runtimes

    graph_failures = [(c, chk) for c, chk in failed if runner_class(chk.runner).runs_graph]
    if graph_failures:
        case, chk = graph_failures[0]
        runtime = chk.runner if chk.runner in runtimes() else "ort"
        precision, nonfinite = chk.precision, chk.comparison.nonfinite > 0
        tol = chk.tolerance  # the tolerance that failed, overrides included
    elif failed:
        case, chk = failed[0]
        return LayerwiseFinding(artifact.precision, g.name, case.name, chk.precision, None,
                                f"only {chk.runner} failed: it runs the PyTorch model, not the ONNX graph")
    else:
        case = max(cases, key=lambda c: sum(a.size for a in c.feeds.values()))
        runtime, precision, nonfinite = "ort", artifact.precision, False
        tol = output_tolerance(artifact.tolerance, "", overrides)  # the all-outputs override, if any
    # Fully padded rows are garbage by definition; keep them only when a NaN/Inf is what failed.
    feeds = case.feeds if nonfinite else drop_empty_rows(g, case.feeds)
    ref = reference_onnx(g.name) if reference_onnx is not None else reexport_reference(artifact, g.name)
    d = find_divergence(ref, artifact.onnx_path(g.name), feeds, tol, candidate_runtime=runtime)
    note = "" if d is not None else (f"no intermediate tensor of the ONNX graph leaves {precision} tolerance in "
                                     f"{runtime}: the failure is specific to the runner or recovers before "
                                     f"the outputs")
    return LayerwiseFinding(artifact.precision, g.name, case.name, precision, d, note, runtime)


# ------------------------------------------------------------------------------------------ records ----

def parity_records(report: ParityReport, model: str, preset: str | None) -> list[dict[str, Any]]:
    """One "parity" record per (graph, runner, output), worst case over the input cases."""
    from xdeploy.core.fingerprint import fingerprint
    from xdeploy.core.records import make_record

    fp = fingerprint()
    groups: dict[tuple[str, str, str, str], list[OutputCheck]] = {}
    for c in report.checks:
        groups.setdefault((c.graph, c.runner, c.artifact_precision, c.output), []).append(c)
    out = []
    for (graph, runner, ap, output), cs in groups.items():
        failed = [c for c in cs if not c.passed]
        # where the ONNX graph first leaves tolerance (verify/layerwise.py), found for failing graphs only
        where = next((_divergence_text(f) for f in report.layerwise if f.graph == graph and failed), None)
        out.append(make_record(
            "parity", fp, model=model, preset=preset, graph=graph, runner=runner, artifact_precision=ap,
            output=output, tolerance_precision=cs[0].precision,
            # null, not 0.0, where no case could be compared (the runner failed, a shape differed)
            max_abs=_worst([c.comparison.max_abs for c in cs], max),
            max_rel=_worst([c.comparison.max_rel for c in cs], max),
            mean_abs=_worst([c.comparison.mean_abs for c in cs], max),
            cosine=_worst([c.comparison.cosine for c in cs], min),
            nonfinite=int(sum(c.comparison.nonfinite for c in cs)), top1=_worst([c.top1 for c in cs], min),
            passed=not failed, reason=f"case {failed[0].case}: {failed[0].reason}" if failed else None,
            cases=len(cs), atol=float(cs[0].tolerance.atol), rtol=float(cs[0].tolerance.rtol),
            min_cosine=float(cs[0].tolerance.cosine), first_divergence=where))
    return out


def _worst(vals: Sequence[float | None], fn: Callable[..., float]) -> float | None:
    """The worst finite value (`fn`: max or min), None where no case gave one."""
    v = [x for x in vals if x is not None and np.isfinite(x)]
    return float(fn(v)) if v else None


def _divergence_text(finding: LayerwiseFinding) -> str:
    d = finding.divergence
    if d is None:
        return finding.note or "no ONNX node leaves tolerance in onnxruntime"
    return f"{d.node} ({d.op_type}) -> {d.output}: max_abs {d.max_abs:.3g}, cosine {d.cosine:.6f}"


def artifact_parity_records(path: Any, runners: Sequence[str], *, model: str, preset: str,
                            shapes: Sequence[tuple[int, int | None]], threads: int = 0,
                            overrides: dict[str, dict[str, float]] | None = None) -> list[dict[str, Any]]:
    """Parity of one artifact as validated "parity" records (the main job's parity step): the layerwise finder
    on failure only, and of `overrides` (which may name outputs of other models) those this artifact has."""
    from xdeploy.export.artifact import load_artifact

    art = load_artifact(path)
    names = {t.name for g in art.spec.graphs for t in g.outputs} | {"*"}
    mine = {k: v for k, v in (overrides or {}).items() if k in names} or None
    rep = check_artifact(art, list(runners), shapes=shapes, layerwise="on-failure", threads=threads, overrides=mine)
    return parity_records(rep, model, preset)
