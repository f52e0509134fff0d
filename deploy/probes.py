"""Golden probes where an artifact runs: the one probe runner and judge, for `xdeploy verify` and the runtimes.

Every artifact carries a few tiny inputs per graph and the PyTorch fp32 outputs for them (export/probes.py writes
them at export; `convert` carries them over). Here they are read (untrusted: allow_pickle=False, shapes and sizes
checked against the manifest), run through the runners a runtime has opened, and judged by parity's own verdict
(deploy/verdict.py `check_outputs`) with the tolerance of the precision the runner really computes in
(`judged_precision`: the looser of the artifact's and `Runner.info().precision`, so `ov:bf16` on a CPU without
bf16 is judged as the f32 it computes):

    report = check_on_open(artifact, [runner], verify=True)   # Embedder, Generator, `xdeploy serve`: first open
    report = verify_artifact(artifact, "ov:bf16")              # `xdeploy verify`: always runs, never refuses

`check_on_open` refuses (ProbeFailure, one line naming the graph, the output, the cosine and the machine class)
when a probe fails; `verify=False` proceeds and says so on stderr; an artifact exported before probes existed is
run with a one-line notice. A pass is remembered in $XDEPLOY_CACHE/probes.json per (artifact identity = its
manifest's sha256, which holds every file's, machine class, runner + what it reports computing and its library
versions), with the graph/outputs it covered, so a second open of the same artifact on the same runner and machine
class runs nothing. Written atomically; two processes writing at once may drop one entry (it only runs again).

Torch-free: `xdeploy verify`, the Embedder and the serving environment (no torch) run this.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import ParityError, XDeployError
from xdeploy.core.fsutil import atomic_write_json, sha256_file
from xdeploy.export.artifact import MANIFEST, Artifact, load_artifact
from xdeploy.export.probes import SECTION, key
from xdeploy.models.spec import DTYPES, InputCase

from .base import Runner, RunnerInfo
from .registry import open_runner
from .verdict import OutputCheck, check_outputs, judged_precision

CACHE_FILE = "probes.json"  # under export/cache.py's cache_root()
CACHE_VERSION = 1
CACHE_ENTRIES = 512  # newest kept: one per (artifact, machine class, runner) ever opened here
HEADER_SLACK = 4096  # bytes an .npy member may hold beyond its declared array (its header)


class ProbeFailure(ParityError):
    """A golden probe failed on this machine: the runtime refuses the artifact (exit code 1, like parity)."""


@dataclass(frozen=True)
class Probe:
    """One probe case: a graph's inputs and the PyTorch fp32 reference outputs for them."""

    case: InputCase
    reference: Mapping[str, np.ndarray]


@dataclass(frozen=True)
class ProbeReport:
    """The probes of one artifact through one runner on this machine. `cached`: a pass remembered for this
    (artifact, machine class, runner) covered everything asked, so nothing ran (`checks` is empty)."""

    artifact: Path
    runner: str  # the runner's own name for itself, e.g. "ov:bf16"
    precision: str  # whose tolerance judged (deploy/verdict.py judged_precision)
    machine: str  # core/fingerprint.py machine_class
    checks: tuple[OutputCheck, ...]
    covered: tuple[str, ...]  # "graph/output" judged (or remembered)
    cached: bool = False

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[OutputCheck]:
        """The worst failing case of each failing output (lowest cosine), in graph/output order."""
        worst: dict[tuple[str, str], OutputCheck] = {}
        for c in self.checks:
            if not c.passed:
                k = (c.graph, c.output)
                if k not in worst or _cos(c) < _cos(worst[k]):
                    worst[k] = c
        return list(worst.values())

    def failure_line(self, c: OutputCheck) -> str:
        """One line for one failing output: graph, output, cosine, why, runner and the machine class."""
        cmp, tol = c.comparison, c.tolerance
        if c.reason == cmp.reason and not cmp.nonfinite and math.isfinite(cmp.cosine):  # outside the tolerance
            why = f"< {tol.cosine}, and max_abs {cmp.max_abs:.3g} > {tol.atol:g} + {tol.rtol:g}*|ref|"
        else:  # NaN/Inf, top-1 agreement, a shape, a broken reference
            why = c.reason
        return (f"graph {c.graph!r} output {c.output!r}: cosine {cmp.cosine:.6f} ({why}; case {c.case}) on "
                f"{self.runner} at {c.precision} tolerance; machine class: {self.machine}")

    def refusal(self) -> str:
        """The runtimes' one-line refusal: the first failing output (and how many more failed)."""
        bad = self.failures
        more = f" (+{len(bad) - 1} more failing output(s): xdeploy verify lists them)" if len(bad) > 1 else ""
        return (f"artifact {self.artifact} fails its golden probes here: {self.failure_line(bad[0])}{more}; "
                "pass verify=False (CLI: --no-verify) to run it anyway")


def _cos(c: OutputCheck) -> float:
    return c.comparison.cosine if math.isfinite(c.comparison.cosine) else -math.inf


# ------------------------------------------------------------------------------------------ reading ----

def has_probes(artifact: Artifact) -> bool:
    return artifact.manifest.get(SECTION) is not None


def load_probes(artifact: Artifact) -> list[Probe] | None:
    """The artifact's probes, checked against its manifest; None for an artifact made before probes existed.
    The .npz is untrusted input: read with allow_pickle=False, each member no larger than its declared array."""
    sec = artifact.manifest.get(SECTION)
    if sec is None:
        return None
    mpath = artifact.path / MANIFEST

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise XDeployError(f"invalid manifest {mpath}: probes: {what}")

    need(isinstance(sec, dict) and isinstance(sec.get("file"), str) and isinstance(sec.get("cases"), list)
         and len(sec["cases"]) > 0, "must be an object with a file and a non-empty list of cases")
    rel = sec["file"]
    # load_artifact checked that every listed file lies inside the directory (and, verifying, its sha256)
    need(rel in artifact.manifest["files"], f"file {rel!r} is not listed in files")
    path = artifact.path / rel
    metas = []
    for i, c in enumerate(sec["cases"]):
        need(isinstance(c, dict) and isinstance(c.get("graph"), str) and isinstance(c.get("name"), str)
             and isinstance(c.get("inputs"), dict) and isinstance(c.get("outputs"), dict)
             and isinstance(c.get("sizes", {}), dict), f"case {i} needs a graph, a name, inputs and outputs")
        g = artifact.graph(c["graph"])
        need(set(c["inputs"]) == {t.name for t in g.inputs} and set(c["outputs"]) == {t.name for t in g.outputs},
             f"case {i} must hold every input and output of graph {g.name!r}")
        for name, t in (c["inputs"] | c["outputs"]).items():
            need(isinstance(t, dict) and t.get("dtype") in DTYPES and isinstance(t.get("shape"), list)
                 and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in t["shape"]),
                 f"case {i} tensor {name!r} needs a dtype ({', '.join(DTYPES)}) and a shape of non-negative ints")
        metas.append((c, g))
    try:
        npz = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise XDeployError(f"cannot read the golden probes {path}: {_first(e)}") from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise XDeployError(f"cannot read the golden probes {path}: not an .npz archive")
    probes = []
    with npz:
        for i, (c, g) in enumerate(metas):
            feeds = {n: _array(npz, path, key(i, "in", n), t) for n, t in c["inputs"].items()}
            feeds = {t.name: feeds[t.name] for t in g.inputs}  # graph order
            ref = {n: _array(npz, path, key(i, "out", n), t) for n, t in c["outputs"].items()}
            sizes = {str(k): int(v) for k, v in c.get("sizes", {}).items() if isinstance(v, int)}
            probes.append(Probe(InputCase(c["name"], g.name, sizes, feeds), ref))
    return probes


def _array(npz: Any, path: Path, k: str, t: Mapping[str, Any]) -> np.ndarray:
    member = f"{k}.npy"
    if member not in npz.zip.namelist():
        raise XDeployError(f"golden probes {path} lack array {k!r} that the manifest declares")
    declared = math.prod(t["shape"]) * np.dtype(t["dtype"]).itemsize
    if npz.zip.getinfo(member).file_size > declared + HEADER_SLACK:  # checked before anything is decompressed
        raise XDeployError(f"golden probes {path}: array {k!r} is larger than its declared {t['dtype']} "
                           f"{t['shape']}")
    try:
        a = npz[k]
    except ValueError as e:  # numpy: "Object arrays cannot be loaded when allow_pickle=False"
        raise XDeployError(f"golden probes {path}: array {k!r} is not a plain numeric array ({_first(e)}); "
                           "refused: artifact files are untrusted and never unpickled") from None
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise XDeployError(f"cannot read array {k!r} of the golden probes {path}: {_first(e)}") from None
    if a.dtype != np.dtype(t["dtype"]) or list(a.shape) != list(t["shape"]):
        raise XDeployError(f"golden probes {path}: array {k!r} is {a.dtype} {list(a.shape)}; the manifest declares "
                           f"{t['dtype']} {t['shape']}")
    return a


def _first(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# ------------------------------------------------------------------------------------------ running ----

_runs = 0  # probe cases run by this process (the tests read it: a remembered pass runs none)


def probe_runs() -> int:
    return _runs


def this_machine() -> str:
    from xdeploy.core.fingerprint import fingerprint, machine_class

    return machine_class(fingerprint())


def run_probes(artifact: Artifact, runners: Sequence[Runner], probes: Sequence[Probe], *,
               machine: str | None = None) -> ProbeReport:
    """Run every probe of the graphs `runners` serve (one runner per graph, all of one spec) and judge the outputs
    each runner returns (a runner opened for a subset of its graph's outputs is judged on that subset)."""
    global _runs
    by_graph = {r.graph.name: r for r in runners}
    infos: dict[str, RunnerInfo] = {g: r.info() for g, r in by_graph.items()}
    first = infos[runners[0].graph.name]
    checks: list[OutputCheck] = []
    covered: list[str] = []
    for p in probes:
        r = by_graph.get(p.case.graph)
        if r is None:
            continue
        info = infos[p.case.graph]
        prec = judged_precision(info.runner, artifact.precision, info.precision)
        tol = artifact.spec.tolerances.get(prec, artifact.tolerance)
        got = r.infer(p.case.feeds)
        _runs += 1
        checks += check_outputs(dict(p.reference), got, p.case, r.graph, runner=info.runner, precision=prec,
                                artifact_precision=artifact.precision, tol=tol, outputs=r.output_names)
        covered += [f"{r.graph.name}/{o}" for o in r.output_names if f"{r.graph.name}/{o}" not in covered]
    return ProbeReport(artifact.path, first.runner,
                       judged_precision(first.runner, artifact.precision, first.precision),
                       machine or this_machine(), tuple(checks), tuple(covered))


def verify_artifact(artifact: Artifact | str | Path, runner: str = "ort", *, threads: int = 0, remember: bool = True,
                    **options: Any) -> ProbeReport:
    """`xdeploy verify`: open `runner` on every probed graph (all outputs) and run all probes, whatever the cache
    says; a pass is remembered (the runtimes' next open then runs nothing). An artifact without probes is an
    error (exit 2); a failing probe is in the report, not raised."""
    if not isinstance(artifact, Artifact):  # a path, like open_runner and the runtimes take
        artifact = load_artifact(artifact)
    probes = load_probes(artifact)
    if probes is None and artifact.foreign is not None:  # another exporter's graph: probed against onnxruntime fp32
        probes, remember = foreign_probes(artifact), False
    if probes is None:
        raise XDeployError(f"artifact {artifact.path} has no golden probes (exported before xdeploy wrote them); "
                           "re-export it (xdeploy export) to add them")
    graphs = list(dict.fromkeys(p.case.graph for p in probes))
    opened: list[Runner] = []
    try:
        for g in graphs:
            opened.append(open_runner(runner, artifact, g, threads=threads, **options))
        report = run_probes(artifact, opened, probes)
        if report.passed and remember:
            _remember(artifact, _cache_key(artifact, opened[0], opened[0].info(), report.machine), report)
    finally:
        for r in opened:
            r.close()
    return report


def foreign_probes(artifact: Artifact) -> list[Probe]:
    """Probes of a foreign graph that has none (export/foreign.py): the golden probes' cases (export/probes.py) with
    references computed now by onnxruntime CPU fp32 on its fp32 graph (`xdeploy convert` stores them instead)."""
    from xdeploy.export.foreign import require_bound
    from xdeploy.export.probes import probe_cases

    from .registry import reference_outputs

    cases = probe_cases(require_bound(artifact).spec)
    refs = reference_outputs(artifact, "model", [c.feeds for c in cases])
    return [Probe(c, r) for c, r in zip(cases, refs)]


def check_on_open(artifact: Artifact, runners: Sequence[Runner], *, verify: bool = True) -> ProbeReport | None:
    """The runtimes' check when they open an artifact (the Embedder, the Generator, `xdeploy serve`): the probes of
    the graphs and outputs `runners` serve, unless a pass on this machine class and runner is remembered. Raises
    ProbeFailure (one line) when one fails; None when nothing was checked (`verify=False`, or no probes)."""
    info = runners[0].info()
    spec = info.runner
    if not verify:
        _say(f"xdeploy: warning: {artifact.path}: golden probes not checked on {spec} (verify=False / --no-verify); "
             "its outputs on this machine are unverified")
        return None
    sec = artifact.manifest.get(SECTION)
    if sec is None and artifact.foreign is not None:  # another exporter's graph: nothing stored to check against
        _say(f"xdeploy: notice: {artifact.location} is a foreign ONNX model without golden probes: running it "
             f"unverified on {spec}; `xdeploy convert` writes an artifact that has them")
        return None
    if sec is None:  # older artifacts are run, not refused
        _say(f"xdeploy: notice: {artifact.path} has no golden probes (exported before xdeploy wrote them): running "
             f"it unverified on {spec}; re-export it to have it checked where it runs")
        return None
    if not isinstance(sec, dict) or not isinstance(sec.get("cases"), list) or not all(
            isinstance(c, dict) and isinstance(c.get("graph"), str) for c in sec["cases"]):
        load_probes(artifact)  # raises: one line naming what is malformed
    # what the probes cover, from the manifest alone: a remembered pass is found without reading the .npz
    probed = {c["graph"] for c in sec["cases"]}
    want = [f"{r.graph.name}/{o}" for r in runners if r.graph.name in probed for o in r.output_names]
    if not want:
        _say(f"xdeploy: notice: {artifact.path} has no golden probes for graph(s) "
             f"{', '.join(sorted(r.graph.name for r in runners))}: running them unverified on {spec}")
        return None
    machine = this_machine()
    k = _cache_key(artifact, runners[0], info, machine)
    if set(want) <= set(_cache().get(k, {}).get("covered", [])):
        return ProbeReport(artifact.path, spec, judged_precision(spec, artifact.precision, info.precision), machine,
                           (), tuple(want), cached=True)
    served = {r.graph.name for r in runners}
    probes = [p for p in load_probes(artifact) or [] if p.case.graph in served]
    report = run_probes(artifact, runners, probes, machine=machine)
    if not report.passed:
        raise ProbeFailure(report.refusal())
    _remember(artifact, k, report)
    return report


_said: set[str] = set()


def _say(line: str) -> None:
    """One line on stderr, once per process (a study opening fifty Embedders says it once)."""
    if line not in _said:
        _said.add(line)
        print(line, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ the cache ----

def cache_path() -> Path:
    from xdeploy.export.cache import cache_root

    return cache_root() / CACHE_FILE


def _cache_key(artifact: Artifact, r: Runner, info: RunnerInfo, machine: str) -> str:
    """What a remembered pass holds for: the artifact's content (its manifest lists every file's sha256), the
    machine class, the runner as it reports itself (`info`: name, compute precision, library versions) and the
    options that change what it compiles (not threads, outputs or a compile cache's folder)."""
    ident = {"artifact": sha256_file(artifact.path / MANIFEST), "machine": machine, "runner": info.runner,
             "precision": info.precision, "versions": dict(sorted(info.versions.items())),
             "options": {k: repr(v) for k, v in sorted(r.options.items()) if k != "cache_dir"}}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]


def _cache() -> dict[str, Any]:
    """The remembered passes (an unreadable or foreign file counts as empty: it is only a cache)."""
    try:
        data = json.loads(cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"), dict):
        return {}
    return {k: v for k, v in data["entries"].items() if isinstance(v, dict) and isinstance(v.get("covered"), list)}


def _remember(artifact: Artifact, k: str, report: ProbeReport) -> None:
    entries = _cache()
    covered = list(dict.fromkeys([*entries.get(k, {}).get("covered", []), *report.covered]))
    entries[k] = {"artifact": str(artifact.path.resolve()), "machine": report.machine, "runner": report.runner,
                  "precision": report.precision, "covered": covered, "at": time.time()}
    keep = sorted(entries, key=lambda e: entries[e].get("at", 0), reverse=True)[:CACHE_ENTRIES]
    try:
        atomic_write_json(cache_path(), {"version": CACHE_VERSION, "entries": {e: entries[e] for e in keep}})
    except (XDeployError, ImportError) as e:
        # a cache that cannot be written costs a re-run next time, never the run itself (a read-only home; the
        # serving environment has no psutil, which clearing a killed writer's temporary would import)
        _say(f"xdeploy: notice: cannot remember the golden-probe pass in {cache_path()}: {_first(e)}")
