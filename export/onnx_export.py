"""PyTorch -> ONNX with the dynamo exporter, one artifact directory per export (see artifact.py).

`export()` is three steps: resolve the source (a preset or a checkpoint -> a torch module), export its graphs
(torch.onnx, then convert.convert_graph: optimize, precision), write the artifact (writer.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import io
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import nn

from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import require_space
from xdeploy.models import registry
from xdeploy.models.spec import Cost, ExportSpec, Graph, ModelFamily, token_axes

# the export defaults live in artifact.py (torch-free), so the CLI's --help and `convert` need no torch import
from .artifact import DEFAULT_OPSET, DEFAULT_OPTIMIZE, SUPPORTED_OPSETS, spec_to_json  # noqa: F401
from .probes import write_probes
from .tokenizer_graph import TokenizerGraphBuilder
from .writer import write_artifact


class _GraphModule(nn.Module):
    """Exposes one method of a model (forward, decode, encode) as the forward of an exportable module."""

    def __init__(self, model: nn.Module, method: str) -> None:
        super().__init__()
        self.model, self.method = model, method

    def forward(self, *args: torch.Tensor) -> Any:
        return getattr(self.model, self.method)(*args)


def example_sizes(spec: ExportSpec) -> dict[str, int]:
    """Distinct, small sizes > 1 for each dynamic axis, so torch.export neither specializes an axis to 1
    nor assumes two axes are equal."""
    primes = iter((2, 5, 7, 11, 13, 17, 19, 23))
    return {name: min(next(primes), ax.max) for name, ax in spec.axes.items()}


def export_graph(model: nn.Module, graph: Graph, spec: ExportSpec, opset: int) -> onnx.ModelProto:
    from xdeploy.models.spec import make_feeds

    sizes = example_sizes(spec)
    feeds = make_feeds(graph, sizes, seed=0)
    args = tuple(torch.from_numpy(feeds[t.name]) for t in graph.inputs)
    dims = {a: torch.export.Dim(a, min=1, max=ax.max) for a, ax in spec.axes.items()}
    dynamic = tuple({i: dims[d] for i, d in enumerate(t.dims) if isinstance(d, str)} or None
                    for t in graph.inputs)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(
                _GraphModule(model, graph.method), args, dynamo=True, opset_version=opset,
                dynamic_shapes=(dynamic,), input_names=[t.name for t in graph.inputs],
                output_names=[t.name for t in graph.outputs], optimize=True, verbose=False)
        except Exception as e:  # the exporter raises many types; keep the first line
            raise XDeployError(f"torch.onnx.export failed for graph {graph.name!r} at opset {opset}: "
                               f"{str(e).splitlines()[0]}") from e
    return program.model_proto


@dataclass(frozen=True)
class Source:
    """What an export starts from: the family, its config, the torch module and where it came from."""

    family: ModelFamily
    config: Any
    module: nn.Module
    preset: str | None
    source: dict[str, Any]  # manifest["source"]: kind preset|hf|..., and the preset/seed or checkpoint digest
    tokenizer_files: tuple[Path, ...] = ()
    pooling: Any = None


def resolve_source(model: str, *, preset: str | None = None, checkpoint: str | Path | None = None,
                   attn_impl: str | None = None, seed: int = 0,
                   config_overrides: dict[str, Any] | None = None) -> Source:
    """A checkpoint (safetensors + config) or a preset with seeded random weights -> the module to export."""
    family = registry.get_family(model)
    if checkpoint is not None:
        from xdeploy.models.checkpoint import load_checkpoint

        ck = load_checkpoint(checkpoint)
        if ck.model != family.name:
            raise XDeployError(f"checkpoint {checkpoint} holds a {ck.model} model, not {family.name}")
        cfg = ck.config if attn_impl is None else dataclasses.replace(ck.config, attn_impl=attn_impl)
        module = family.build(cfg).eval()
        module.load_state_dict(ck.module.state_dict())
        return Source(family, cfg, module, preset,
                      {"kind": ck.kind, "checkpoint": str(Path(checkpoint).resolve()), "sha256": ck.sha256},
                      tuple(ck.tokenizer_files), ck.pooling)
    preset = preset or next(iter(family.presets))
    cfg = registry.get_config(family.name, preset, attn_impl=attn_impl, **(config_overrides or {}))
    module = registry.build(family.name, cfg, seed=seed)
    return Source(family, cfg, module, preset, {"kind": "preset", "preset": preset, "seed": seed})


def weight_bytes(module: nn.Module) -> int:
    """The bytes of a module's weights (its state dict: a tied tensor counted once per name, an upper bound)."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def export_space(module: nn.Module, n_graphs: int, out: str | Path, *, precision: str, optimize: bool,
                 n_ir: int) -> dict[Path, int]:
    """What an export writes, for core/fsutil.require_space, from the module's weight bytes W (an upper bound for
    each graph: a graph holds at most the weights, at fp32): the artifact beside `out` (its temporary sibling:
    reference safetensors + each graph + each of the `n_ir` OpenVINO IRs, W each), and the
    temporary directory (a conversion or optimization holds its graph about three times there: saved,
    pre-processed, converted)."""
    w = weight_bytes(module)
    converts = precision != "fp32" or optimize
    return {Path(out).absolute().parent: w * (1 + n_graphs + n_ir),
            Path(tempfile.gettempdir()): 3 * w if converts else 0}


TRACE_CACHE = ("use", "refresh", "off")


def _trace_weights(writer: Any) -> str | None:
    """The trace cache's weights key: the sha256 of the artifact's reference safetensors (names, dtypes, shapes
    and bytes: written and hashed once per export anyway), or None over XDEPLOY_EXPORT_CACHE_MAX_MB (hashing and
    storing a base preset's graphs costs more than tracing them again saves)."""
    from .store import entry_limit_bytes

    if writer.path("reference/model.safetensors").stat().st_size > entry_limit_bytes():
        return None
    return writer.manifest["source"]["weights_sha256"]


def trace_fields(src: Source, graph: Graph, opset: int, weights: str) -> dict[str, Any]:
    """What a trace depends on (the trace cache's key, with the library versions and the export source): the family,
    the config, the graph, the opset, the weights' digest and the module's own source file (a family registered from
    outside models/, a plugin or a test, is not in the export source hash). The config is taken without its
    `weights` field (the file models/registry.py `build` loads trained weights from): the weights are keyed by their
    digest, so a preset's trained weights exported from a checkpoint (whose config names no file) are the same
    trace."""
    code = Path(inspect.getfile(type(src.module)))
    config = {k: v for k, v in dataclasses.asdict(src.config).items() if k != "weights"}
    return {"family": src.family.name, "config": config, "graph": graph.name, "method": graph.method,
            "opset": opset, "weights": weights,
            "module": f"{type(src.module).__qualname__}:{hashlib.sha256(code.read_bytes()).hexdigest()}"}


def traced_graph(src: Source, graph: Graph, spec: ExportSpec, opset: int, *, trace_cache: str = "use",
                 weights: str | None = None) -> onnx.ModelProto:
    """export_graph of `src`, through the trace cache (export/store.py `cached_trace`): the same fp32 graph of the
    same module (`weights`: the sha256 of its saved safetensors; config, graph, opset) is traced once for every
    precision and option.
    `trace_cache`: "use", "refresh" (trace again and store) or "off"; no `weights` digest: no cache."""
    from .store import cached_trace

    def run() -> bytes:
        return export_graph(src.module, graph, spec, opset).SerializeToString()

    if weights is None or trace_cache == "off":
        return export_graph(src.module, graph, spec, opset)
    fields = trace_fields(src, graph, opset, weights)
    label = f"{src.family.name}-{src.preset or 'checkpoint'}-trace-{graph.name}-o{opset}"
    for read in ((True, False) if trace_cache == "use" else (False,)):
        proto = onnx.load_from_string(cached_trace(label, fields, run, read=read))
        if [i.name for i in proto.graph.input] == [t.name for t in graph.inputs]:
            return proto
    raise XDeployError(f"the trace of graph {graph.name!r} does not have the inputs the spec declares")


# A module with this many weight bytes or more has its later graphs traced in a child process while the parent
# traces the first (torch.onnx's trace is single-threaded Python: GPT-2 small's decode graph ~20 s of 2 cores'
# otherwise idle second one); below it, the child's start (importing torch, rebuilding the module) costs more.
PARALLEL_TRACE_MIN_MB = 64
PARALLEL_TRACE_ENV = "XDEPLOY_PARALLEL_TRACE_MIN_MB"


def _trace_child(job: str) -> None:
    """A child process's work (`_TraceAhead`; `python -c` runs it with the job file's path): rebuild the module
    from the reference weights just written and save the trace of each of its graphs as <dir>/<graph>.onnx."""
    import json

    from safetensors.torch import load_file

    from .artifact import parse_config
    from .onnx_graph import TWO_GB, proto_size

    a = json.loads(Path(job).read_text(encoding="utf-8"))
    fam = registry.get_family(a["family"])
    config = parse_config(a["family"], a["config"], Path(job))  # the config as a manifest records it
    module = registry.build_loaded(fam, config, load_file(a["reference"]), source=a["reference"])
    src = Source(fam, config, module, None, {})
    spec = fam.spec(config)
    with torch.no_grad():
        for name in a["graphs"]:
            proto = traced_graph(src, spec.graph(name), spec, a["opset"], trace_cache=a["trace_cache"],
                                 weights=a["weights"])
            large = proto_size(proto) >= TWO_GB
            path = Path(job).with_name(f"{name}.onnx")
            onnx.save_model(proto, str(path), save_as_external_data=large,
                            location=f"{name}.onnx.data" if large else None)


def _die_with_parent() -> None:
    """In the child, before exec (Linux): SIGKILL when the parent dies, so a parent killed mid-export (SIGKILL,
    the OOM killer) leaves no orphan tracing into a temporary directory nobody will remove."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _TraceAhead:
    """Graphs 2..n of an export traced by a child process (`_trace_child`) while the parent traces graph 1.
    The parent waits for it before converting graph 1, so the child's memory never meets a conversion's peak;
    a child that fails is not an error: its graphs are traced in the parent as before, which reports any
    failure itself. A fresh interpreter (not fork: torch's thread pools are not fork-safe; not multiprocessing's
    spawn: it re-imports the caller's __main__, which a plain script runs again)."""

    def __init__(self, src: Source, graphs: list[str], opset: int, trace_cache: str, weights: str | None,
                 reference: Path) -> None:
        import json
        import subprocess
        import sys

        self.graphs = graphs
        self._dir = tempfile.TemporaryDirectory(prefix="xdeploy-trace-")
        job = Path(self._dir.name, "job.json")
        job.write_text(json.dumps({"family": src.family.name, "config": dataclasses.asdict(src.config),
                                   "reference": str(reference), "graphs": graphs, "opset": opset,
                                   "trace_cache": trace_cache, "weights": weights}), encoding="utf-8")
        self._log = open(Path(self._dir.name, "child.log"), "wb")  # noqa: SIM115 (closed in close())
        self._proc = subprocess.Popen(
            [sys.executable, "-c", f"from {__name__} import _trace_child; _trace_child({str(job)!r})"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self.ok: bool | None = None

    def wait(self) -> bool:
        if self.ok is None:
            self.ok = self._proc.wait() == 0
        return self.ok

    def take(self, graph: str) -> onnx.ModelProto | None:
        """The child's trace of `graph` (None when the child failed: trace it here)."""
        path = Path(self._dir.name, f"{graph}.onnx")
        if not (self.wait() and path.is_file()):
            return None
        proto = onnx.load(str(path))
        path.unlink()
        path.with_name(f"{graph}.onnx.data").unlink(missing_ok=True)
        return proto

    def close(self) -> None:
        if self._proc.poll() is None:  # the parent stopped early (an error, Ctrl-C): the child's work is not needed
            self._proc.kill()
            self._proc.wait()
        self._log.close()
        self._dir.cleanup()


def _trace_ahead(src: Source, spec: ExportSpec, opset: int, trace_cache: str, weights: str | None,
                 reference: Path | None) -> _TraceAhead | None:
    """A `_TraceAhead` for graphs 2..n when it pays: several graphs, a module of PARALLEL_TRACE_MIN_MB or more
    ($XDEPLOY_PARALLEL_TRACE_MIN_MB), and traces the trace cache will not give back (no `weights` digest, or the
    cache not read)."""
    if reference is None or len(spec.graphs) < 2 or (weights is not None and trace_cache == "use"):
        return None
    raw = os.environ.get(PARALLEL_TRACE_ENV, str(PARALLEL_TRACE_MIN_MB))
    try:
        limit = float(raw) * 2**20
    except ValueError:
        raise XDeployError(f"{PARALLEL_TRACE_ENV}={raw!r}; expected a number of MB") from None
    if weight_bytes(src.module) < limit:
        return None
    return _TraceAhead(src, [g.name for g in spec.graphs[1:]], opset, trace_cache, weights, reference)


def export_graphs(src: Source, spec: ExportSpec, *, opset: int, precision: str, optimize: bool, opt_level: int,
                  precision_options: Any, refine: Any = None, trace_cache: str = "use",
                  weights: str | None = None, reference: Path | None = None
                  ) -> Iterator[tuple[Graph, onnx.ModelProto, dict[str, Any]]]:
    """Each graph of `spec` exported (through the trace cache, `traced_graph`, when `weights` keys the module's
    weights: export passes `_trace_weights`; None traces without it), optimized and converted to
    `precision`, with its conversion record (one at a time, so a large model's graphs are not all held in
    memory). `reference`: the module's saved safetensors, from which a child process traces the later graphs
    of a large module beside the first (`_trace_ahead`)."""
    from . import convert  # convert.convert_graph is looked up per call (tests interrupt it there)

    ahead = _trace_ahead(src, spec, opset, trace_cache, weights, reference)
    try:
        with torch.no_grad():
            for graph in spec.graphs:
                proto = ahead.take(graph.name) if ahead is not None and graph.name in ahead.graphs else None
                if proto is None:
                    proto = traced_graph(src, graph, spec, opset, trace_cache=trace_cache, weights=weights)
                if ahead is not None:
                    ahead.wait()  # the child's trace finished before this graph's conversion peaks
                proto, info = convert.convert_graph(
                    proto, precision, graph=graph, spec=spec, model=src.family.name, config=src.config,
                    optimizer=src.family.capabilities.optimizer, optimize=optimize, opt_level=opt_level,
                    options=precision_options, refine=refine)
                yield graph, proto, info
    finally:
        if ahead is not None:
            ahead.close()


def export(model: str, *, preset: str | None = None, checkpoint: str | Path | None = None, out: str | Path,
           opset: int = DEFAULT_OPSET, precision: str = "fp32", force: bool = False,
           attn_impl: str | None = None, seed: int = 0, optimize: bool = DEFAULT_OPTIMIZE, opt_level: int = 1,
           precision_options: Any = None, config_overrides: dict[str, Any] | None = None,
           tokenizer_graph: TokenizerGraphBuilder | None = None, refine: Any = None,
           openvino_ir: bool = False, trace_cache: str = "use") -> Path:
    """Export every graph of `model` into the artifact directory `out` (written atomically).

    `config_overrides` replaces preset config fields (e.g. {"max_positions": 4096} for scaling runs); the
    manifest records the resulting config.

    `optimize` applies onnxruntime's offline optimizations and transformer fusions (export/optimize.py) before
    the precision conversion (export/precision.py; `precision_options` is a `PrecisionOptions`). `refine` is the
    measured keep-float search (fp16 AMP, int8 sensitivity: verify/sensitivity.refine); without it the plain
    transform runs. `xdeploy.api.export` passes it.

    `tokenizer_graph` (deploy/tokenizer_graph.py's `tokenizer_graph_builder(accept_differences)`) also writes
    tokenizer/tokenizer.onnx (export/tokenizer_graph.py: the checkpoint's tokenizer as an onnxruntime-extensions
    graph, truncating to the pooling max_length or the seq axis), verified against Hugging Face tokenizers by
    the builder, which refuses when ids differ unless told to accept them.

    `openvino_ir` (fp32; fp16: its weights stored as fp16; int8-dynamic: compressed to int8 by nncf) also writes
    openvino/<graph>.xml + .bin converted from the same module by openvino.convert_model (export/openvino_ir.py),
    which the `ov` runner compiles instead of the ONNX graph.

    Each graph's torch.onnx trace is kept in the trace cache (export/store.py `cached_trace`, $XDEPLOY_CACHE/traces)
    and reused by any later export of the same module, graph and opset, whatever its precision and options;
    `trace_cache="refresh"` traces again and stores the trace, "off" neither reads nor writes it."""
    from . import precision as prec

    if trace_cache not in TRACE_CACHE:
        raise XDeployError(f"trace_cache={trace_cache!r}; expected one of: {', '.join(TRACE_CACHE)}")
    if opset not in SUPPORTED_OPSETS:
        raise XDeployError(f"unsupported opset {opset}; expected one of: {', '.join(map(str, SUPPORTED_OPSETS))}")
    prec.check_precision(precision)
    prec.check_options(precision_options)
    from .openvino_ir import IR_PRECISIONS

    if openvino_ir and precision not in IR_PRECISIONS:
        raise XDeployError(f"an OpenVINO IR is carried by {', '.join(IR_PRECISIONS)} artifacts only; got precision "
                           f"{precision}")
    src = resolve_source(model, preset=preset, checkpoint=checkpoint, attn_impl=attn_impl, seed=seed,
                         config_overrides=config_overrides)
    spec = src.family.spec(src.config)
    # the IRs: one per graph, and a decoder's stateful step (export/openvino_ir.py)
    require_space(export_space(src.module, len(spec.graphs), out, precision=precision, optimize=optimize,
                               n_ir=len(spec.graphs) + (spec.engine_cache is not None) if openvino_ir else 0),
                  f"exporting {model} ({precision})")
    tok_dir = next((f.parent for f in src.tokenizer_files if f.name == "tokenizer.json"), None)
    precision_options = prec.with_calibration(precision_options, precision, spec, tok_dir)
    graphs, axes, tols = spec_to_json(spec, {g.name: f"{g.name}.onnx" for g in spec.graphs})
    manifest: dict[str, Any] = {
        "model": src.family.name, "preset": src.preset, "source": dict(src.source),
        "config": dataclasses.asdict(src.config),
        "precision": precision, "opset": opset, "attn_impl": src.config.attn_impl, "optimized": optimize,
        "graphs": graphs, "axes": axes, "tolerances": tols, "conversion": {},
        "pooling": dataclasses.asdict(src.pooling) if src.pooling else None,
        "capabilities": src.family.capabilities.to_json(),
    }
    # FLOPs per call without the model code (bench reads it: benchmarking an artifact needs no torch)
    cost = Cost.fit(lambda sizes: src.family.flops(src.config, sizes), token_axes(src.family.capabilities),
                    src.family.dims(src.config).fixed_tokens)
    if cost is not None:
        manifest["cost"] = cost.to_json()
    with write_artifact(out, manifest, force=force) as w:
        w.manifest["source"]["weights_sha256"] = w.save_weights(src.module.state_dict())
        # the golden probes: the module's outputs as saved, before torch.onnx runs over it (export/probes.py);
        # a text encoder's also as raw files for the C++ runtime
        write_probes(w, spec, src.module, raw=src.family.capabilities.text is not None)
        for graph, proto, info in export_graphs(src, spec, opset=opset, precision=precision, optimize=optimize,
                                                opt_level=opt_level, precision_options=precision_options,
                                                refine=refine, trace_cache=trace_cache,
                                                weights=_trace_weights(w),
                                                reference=w.path("reference/model.safetensors")):
            w.manifest["conversion"][graph.name] = info
            w.add_graph(graph.name, proto)
        prec.check_requested_nodes(precision, precision_options, w.manifest["conversion"])
        if openvino_ir:
            from .openvino_ir import write_ir

            write_ir(w, spec, lambda g: _GraphModule(src.module, g.method), example_sizes(spec))
        for f in src.tokenizer_files:
            w.add_file(f"tokenizer/{f.name}", f)
        if tokenizer_graph is not None:
            from .tokenizer_graph import write_tokenizer_graph

            # the Embedder's default max_length: pooling max_length, else the declared token axis's
            smax = spec.axes[src.family.capabilities.token_axis].max
            max_length = min((src.pooling.max_length if src.pooling else None) or smax, smax)
            write_tokenizer_graph(w, max_length, tokenizer_graph)
    return Path(out)
