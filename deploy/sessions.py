"""The one session layer: how xdeploy opens ONNX Runtime sessions and compiles OpenVINO models.

Every ONNX Runtime session (the ort / ort-cuda / ort-trt runners, verify/layerwise.py's probes,
bench/roofline.py's GEMM peaks, bench/scale.py's op profile) and every OpenVINO compile (the ov runner,
layerwise, roofline) takes its options from here, so threads, optimization level, logging and the
OpenVINO hints mean the same thing wherever a figure is measured:

    sess = ort_session(path_or_bytes, threads=2)                 # CPU provider, all graph optimizations
    compiled = ov_compile(path, ov_config("bf16", threads=2))    # bf16 compute, latency hint

`threads` is the caller's request everywhere (0 = the runtime's default: every core); `intra_op_threads`
is the single place that turns a request into the number a runtime gets.

export/ sits below this layer and opens sessions only where onnxruntime's own tools fix their settings:
export/optimize.py hands a file to onnxruntime's optimizer, and static int8 calibration
(export/precision.py `collect_ranges`) runs the unoptimized graph as onnxruntime's calibrators do, so its
ranges are theirs - neither measures anything these options would have to make comparable.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.deps import import_quietly
from xdeploy.core.errors import XDeployError, one_of, ort_reason
from xdeploy.export.onnx_graph import TWO_GB, proto_size

ORT_OPT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
                  "all": "ORT_ENABLE_ALL"}
CPU_PROVIDERS: tuple[Any, ...] = ("CPUExecutionProvider",)
OV_PRECISION_HINTS = {"": "f32", "f32": "f32", "bf16": "bf16"}  # ov variant -> INFERENCE_PRECISION_HINT
OV_PERFORMANCE_HINTS = {"latency": "LATENCY", "throughput": "THROUGHPUT"}


# A one-token step of a graph this small (graph + weights, bytes) runs on one thread; its prompts keep the runner's
# (ort: a second session, deploy/ort_runner.py; ov: a second compiled model of the PagedAttention step,
# deploy/ov_runner.py). Why: each node of such a step is a few microseconds of arithmetic, and splitting it over
# threads costs more than it saves. GPT-2-shaped decoders, onnxruntime's cache, 2 threads asked (AMD Zen 4, one
# model per process, 11 interleaved rounds, docs/benchmarks.md): with the steps on one thread a step took 0.80x the
# time at 2.1 MB of graph, 0.88x at 3.7 MB, 0.96x at 4.3 MB, 1.03x at 6.1 MB and 1.33x at 13.6 MB (a whole 32 -> 128
# generation: 1.20x, 1.12x, 1.02x, 0.97x, 0.73x as fast), so the limit sits just below where it stops paying.
# OpenVINO's paged step, same protocol: 0.87x at 0.7 MB of IR, 0.95x at 2.0, 0.94x at 3.7, 1.03x at 4.3, 1.09x at
# 6.0 and 1.26x at 13.5 MB: the same crossover, so one limit serves both.
SMALL_STEP_BYTES = 4 << 20


def one_thread_steps(threads: int, step_bytes: int, cpus: int | None = None) -> bool:
    """Whether the one-token steps get a session (ort) or compiled model (ov) of their own on one thread (the prompts
    keeping `threads`, 0 = all cores): where more than one thread was asked (or all of more than one core) and the
    step's graph and weights take at most SMALL_STEP_BYTES. A second copy of weights that small costs nothing worth
    counting. `cpus`: the cores `threads=0` means (default this process's)."""
    from xdeploy.core.fingerprint import usable_cpus

    many = threads > 1 or threads == 0 and (cpus if cpus is not None else usable_cpus()) > 1
    return many and step_bytes <= SMALL_STEP_BYTES


def intra_op_threads(threads: int) -> int:
    """The thread count a runtime is given for a request (0 = the runtime's default, every core)."""
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
        raise XDeployError(f"threads must be an integer >= 0 (0 = all cores); got {threads!r}")
    return threads


# ------------------------------------------------------------------------------------ onnxruntime ----

# onnxruntime graph optimizers a CPU session leaves out, each slower than what it replaces on the CPU provider:
# - SkipLayerNormFusion: fuses the residual Add + LayerNormalization after a MatMul whose bias is folded in (the
#   int8-dynamic graphs' DynamicQuantizeMatMul; fp32 graphs keep a bias Add there and are not fused). Its CPU
#   kernel took 15.4 ms per op where the Add + LayerNormalization it replaced take 4.9 (MiniLM int8-dynamic, the
#   peers corpus, onnxruntime 1.31's profiler, AMD Zen 4), and without it MiniLM's int8 pass ran 1.06-1.07x
#   [1.04-1.10] faster, GPT-2 small's int8 decode 1.03x (docs/benchmarks.md). The GPU runners keep it (a fused
#   CUDA kernel there). onnxruntime ignores a name it does not know, without a word: tests/test_sessions.py checks
#   that each one still changes what the session runs.
ORT_CPU_SLOW_FUSIONS: tuple[str, ...] = ("SkipLayerNormFusion",)


def ort_session_options(threads: int = 0, opt_level: str = "all", *, profile_prefix: str | Path | None = None,
                        spinning: bool | None = None, spin_between_runs: bool | None = None,
                        disabled_optimizers: Sequence[str] = ORT_CPU_SLOW_FUSIONS) -> Any:
    """onnxruntime.SessionOptions: `threads` intra-op threads, one inter-op thread (sequential execution),
    warnings off, graph optimizations at `opt_level` less `disabled_optimizers` (onnxruntime's transformer names;
    default ORT_CPU_SLOW_FUSIONS, the CPU's; () keeps every one); `profile_prefix` turns the per-op profiler on;
    `spinning` sets session.intra_op.allow_spinning (None: onnxruntime's default, spinning on);
    `spin_between_runs` False sets session.force_spinning_stop: the pool spins while a Run() lasts and stops
    the moment it returns (None: onnxruntime's default, it goes on spinning after the call)."""
    import onnxruntime as ort

    if opt_level not in ORT_OPT_LEVELS:
        raise one_of("optimization level", opt_level, ORT_OPT_LEVELS)
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, ORT_OPT_LEVELS[opt_level])
    so.intra_op_num_threads = intra_op_threads(threads)
    so.inter_op_num_threads = 1
    # fatal only: every failure onnxruntime logs as an error is also raised, and the runners raise it again as
    # one line (core/errors.py ort_reason); its logged copy was a second, coloured line before ours
    so.log_severity_level = 4
    if disabled_optimizers:  # onnxruntime splits this entry on ';' (a ',' would name one optimizer that is not)
        so.add_session_config_entry("optimization.disable_specified_optimizers", ";".join(disabled_optimizers))
    if spinning is not None:
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if spin_between_runs is not None:
        so.add_session_config_entry("session.force_spinning_stop", "0" if spin_between_runs else "1")
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = str(profile_prefix)
    return so


def ort_session(model: str | Path | bytes, *, threads: int = 0, opt_level: str = "all",
                providers: Any = CPU_PROVIDERS, options: Any = None, what: str | None = None) -> Any:
    """An onnxruntime.InferenceSession on a file or serialized model. `options` (from `ort_session_options`)
    replaces threads/opt_level; a model onnxruntime refuses is one XDeployError naming `what` (or the path)."""
    import onnxruntime as ort

    so = options if options is not None else ort_session_options(threads, opt_level)
    src = model if isinstance(model, bytes) else str(model)
    try:
        return ort.InferenceSession(src, so, providers=list(providers))
    except Exception as e:  # onnxruntime raises its own exception types for bad models
        name = what or ("the serialized model" if isinstance(model, bytes) else str(model))
        raise XDeployError(f"onnxruntime cannot load {name}: {ort_reason(e)}") from None


@contextlib.contextmanager
def onnx_file(model: Any) -> Iterator[Path]:
    """An in-memory onnx.ModelProto saved to a temporary model.onnx (weights as external data beyond 2 GB), for
    a runtime that reads files (OpenVINO; onnxruntime for a model too large to hand over serialized)."""
    import onnx

    with tempfile.TemporaryDirectory(prefix="xdeploy-onnx-") as d:
        path = Path(d) / "model.onnx"
        onnx.save_model(model, str(path), save_as_external_data=proto_size(model) >= TWO_GB,
                        location="model.onnx.data")
        yield path


# --------------------------------------------------------------------------------------- OpenVINO ----

def ov_config(variant: str = "", *, hint: str = "latency", threads: int = 0, cache_dir: str | Path | None = None,
              streams: int | None = None, pinning: bool | None = None) -> dict[str, Any]:
    """The compile_model properties for an ov variant and options (pure: no openvino import).

    INFERENCE_PRECISION_HINT is the precision the CPU plugin computes in ("" / "f32" -> f32, "bf16");
    `streams` pins NUM_STREAMS (the roofline's one-stream GEMM); `cache_dir` reuses compiled blobs; `pinning`
    sets ENABLE_CPU_PINNING (None: the plugin's default)."""
    if variant not in OV_PRECISION_HINTS:
        raise one_of("ov variant", variant, [v for v in OV_PRECISION_HINTS if v])
    if hint not in OV_PERFORMANCE_HINTS:
        raise one_of("OpenVINO performance hint", hint, OV_PERFORMANCE_HINTS)
    n = intra_op_threads(threads)
    config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": OV_PRECISION_HINTS[variant],
                              "PERFORMANCE_HINT": OV_PERFORMANCE_HINTS[hint]}
    if n:
        config["INFERENCE_NUM_THREADS"] = n
    if streams is not None:
        config["NUM_STREAMS"] = streams
    if cache_dir is not None:
        config["CACHE_DIR"] = str(Path(cache_dir).expanduser())
    if pinning is not None:
        config["ENABLE_CPU_PINNING"] = bool(pinning)
    return config


def ov_compile(model: str | Path | Any, config: dict[str, Any], device: str = "CPU", *,
               what: str | None = None) -> Any:
    """openvino compile_model on a path (lets CACHE_DIR skip reading the file) or an ov.Model; an OpenVINO
    refusal is one XDeployError naming `what` (or the path)."""
    try:
        ov = import_quietly("openvino")
    except ImportError:
        raise XDeployError("OpenVINO is not installed: pip install 'xdeploy[openvino]'") from None
    if "CACHE_DIR" in config:
        Path(config["CACHE_DIR"]).mkdir(parents=True, exist_ok=True)
    src = str(model) if isinstance(model, (str, Path)) else model
    try:
        return ov.Core().compile_model(src, device, config)
    except Exception as e:  # openvino raises RuntimeError subclasses with multi-line messages
        name = what or str(model)
        raise XDeployError(f"OpenVINO cannot compile {name} for {device}: {ov_reason(e)}") from None


def ov_reason(e: BaseException) -> str:
    """The line of an OpenVINO exception that says why: its message stacks "Exception from <file>:<line>:" and
    "Check '...' failed at <file>:<line>:" headers above the reason (a PagedAttention compile with a bf16 cache
    and f32 arithmetic said only "Exception from src/inference/src/cpp/core.cpp:117:" in its first line)."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    said = [x for x in lines if not x.startswith(("Exception from ", "Check '"))]
    return said[-1] if said else lines[-1] if lines else type(e).__name__


class BoundInputs:
    """An OpenVINO infer request's inputs bound once over numpy buffers: `set(name, a)` copies `a` into the buffer
    bound to input `name` and resizes the bound tensor within its capacity; a buffer that is outgrown is replaced by
    one twice as large and bound again. Binding new tensors every call instead (infer(dict, share_inputs=True)) made
    the CPU plugin re-bind every input on every call: on a 64-wide GPT that was a quarter of a decode step
    (docs/generate.md, "Per-call overhead")."""

    def __init__(self, request: Any, ov: Any) -> None:
        self.req, self._ov = request, ov
        # input -> (buffer, the tensor bound over it, the buffer's view in the tensor's current shape)
        self._staged: dict[str, tuple[np.ndarray, Any, np.ndarray]] = {}

    def set(self, name: str, a: np.ndarray) -> None:
        staged = self._staged.get(name)
        if staged is not None:
            view = staged[2]
            if view.shape == a.shape and view.dtype == a.dtype:  # a decode step's every input: one copy, ~0.5 us
                view[...] = a
                return
            buf, t, _ = staged
        else:
            buf, t = None, None
        bound = buf is not None and buf.dtype == a.dtype and buf.size >= a.size
        if not bound:
            buf = np.empty(max(a.size, 64, 0 if buf is None else 2 * buf.size), a.dtype)  # grows geometrically
            t = self._ov.Tensor(buf.reshape(1, -1), shared_memory=True)
        # resizing the tensor costs a call into OpenVINO: only here, when the shape changes
        t.shape = list(a.shape)
        view = buf[:a.size].reshape(a.shape)
        self._staged[name] = (buf, t, view)
        np.copyto(view, a)
        if not bound:
            self.req.set_tensor(name, t)
