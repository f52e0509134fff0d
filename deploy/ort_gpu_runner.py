"""ONNX Runtime on NVIDIA GPUs: the CUDA execution provider (`ort-cuda`) and the TensorRT one (`ort-trt`).

    open_runner("ort-cuda", art)                       # computes in the artifact's precision (fp32 / fp16)
    open_runner("ort-trt:fp16", art, cache_dir=...)    # TensorRT EP, fp16 kernels allowed, engine+timing cache
    open_runner("ort-cuda", art, "decode")             # its bound calls replayed as CUDA graphs (cuda_graph=False: off)

Needs the onnxruntime-gpu wheel (not installed by `make`) and a GPU. The provider options are built by pure
functions (`provider_list`), tested on CPU; running them was verified only on three leases of an NVIDIA H200
(ort-cuda; docs/runners.md).
The TensorRT EP's optimization profile comes from the manifest's axes (xdeploy.export.tensorrt), exactly
like the `trt` runner's, so both engines cover the same exported shape range.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError
from xdeploy.export.tensorrt import default_cache_root, format_shapes, int8_format, profile_shapes
from xdeploy.models.spec import Axis, Graph

from .base import LoopArrays, RunnerInfo, TorchArrays, cuda_gaps, is_tensor, torch_dtype, validate_feeds
from .ort_runner import OrtRunner

Provider = tuple[str, dict[str, str]]


def cuda_options(device_id: int = 0, *, graph: bool = False) -> dict[str, str]:
    # use_tf32=0: keep fp32 artifacts at fp32 so parity tolerances mean the same as on CPU. `graph`: CUDA graphs
    # (option cuda_graph): onnxruntime captures a run's kernels once and replays them on the device addresses of
    # that run, so a captured run must IO-bind the same device inputs *and outputs* every time (ORT docs, CUDA EP
    # "Using CUDA Graphs"): only the runner's bind() does (CudaGraphs), every other run is annotated not to capture.
    return {"device_id": str(device_id), "use_tf32": "0", "arena_extend_strategy": "kSameAsRequested",
            "cudnn_conv_algo_search": "HEURISTIC", "enable_cuda_graph": "1" if graph else "0"}


def ort_trt_cache_dir(root: str | Path, model: str, graph: str, precision: str, graph_sha256: str) -> Path:
    """Per-graph engine/timing cache directory of the TensorRT EP, keyed by the graph file's sha256 so an
    artifact re-exported in place never meets its predecessor's engines."""
    return Path(root).expanduser() / f"{model}-{graph}-{precision}-{graph_sha256[:16]}"


def tensorrt_options(graph: Graph, axes: Mapping[str, Axis], *, device_id: int = 0, fp16: bool = False,
                     int8: bool = False, cache_dir: str | Path, workspace_mib: int = 0) -> dict[str, str]:
    """TensorRT EP options: precision, engine cache, timing cache and an explicit min/opt/max profile.

    int8 is for Q/DQ artifacts: trt_int8_enable with no calibration table makes the EP build an explicitly
    quantized engine from the graph's Q/DQ scales (tensorrt_execution_provider.cc applies a calibration table
    only when trt_int8_calibration_table_name is set)."""
    profiles = profile_shapes(graph, axes)
    cache = str(Path(cache_dir).expanduser())
    opts = {"device_id": str(device_id), "trt_fp16_enable": "True" if fp16 else "False",
            "trt_int8_enable": "True" if int8 else "False",
            "trt_engine_cache_enable": "True", "trt_engine_cache_path": cache,
            "trt_timing_cache_enable": "True", "trt_timing_cache_path": cache,
            "trt_profile_min_shapes": format_shapes(profiles, "min"),
            "trt_profile_opt_shapes": format_shapes(profiles, "opt"),
            "trt_profile_max_shapes": format_shapes(profiles, "max")}
    if workspace_mib:
        opts["trt_max_workspace_size"] = str(workspace_mib << 20)
    return opts


@dataclass(frozen=True)
class GpuEP:
    """One GPU flavour: its primary provider, accepted variants and how its provider list is built."""

    provider: str
    variants: tuple[str, ...]
    build: Callable[..., list[Provider]]


def _cuda_list(graph: Graph, axes: Mapping[str, Axis], variant: str, device_id: int, **opts: Any) -> list[Provider]:
    return [("CUDAExecutionProvider", cuda_options(device_id, graph=bool(opts.get("cuda_graph", False))))]


def _trt_list(graph: Graph, axes: Mapping[str, Axis], variant: str, device_id: int, **opts: Any) -> list[Provider]:
    cache = opts.get("cache_dir") or default_cache_root() / "ort-trt"
    precision = opts.get("precision", "fp32")
    # only Q/DQ graphs carry the scales TensorRT needs; a dynamic-int8 graph's float parts run at their precision
    qdq = precision == "int8" and opts.get("int8_format") == "qdq"
    if opts.get("graph_sha256"):
        cache = ort_trt_cache_dir(cache, opts.get("model", "model"), graph.name,
                                  "fp16" if variant == "fp16" else precision, opts["graph_sha256"])
    # CUDA after TensorRT: nodes TensorRT cannot take run on CUDA instead of falling back to the CPU.
    return [("TensorrtExecutionProvider",
             tensorrt_options(graph, axes, device_id=device_id, fp16=variant == "fp16", int8=qdq,
                              cache_dir=cache, workspace_mib=int(opts.get("workspace_mib", 0)))),
            ("CUDAExecutionProvider", cuda_options(device_id))]


GPU_EPS: dict[str, GpuEP] = {
    "ort-cuda": GpuEP("CUDAExecutionProvider", ("",), _cuda_list),
    "ort-trt": GpuEP("TensorrtExecutionProvider", ("", "fp16"), _trt_list),
}
OPTIONS = ("opt_level", "device", "cache_dir", "workspace_mib", "cuda_graph")
# session options, not provider ones: the CPU thread pool (nodes no GPU provider takes) is the `ort` runner's
# (ort_runner.OrtRunner: spinning, and spin_between_runs, which it is opened with when timed beside others)
SESSION_OPTIONS = ("spinning", "spin_between_runs")
ARTIFACT_FACTS = ("precision", "model", "graph_sha256", "int8_format")  # filled in by the runner from the artifact


def unknown_options(runner: str, names: set[str]) -> XDeployError:
    """The one-line error for options a GPU runner does not take (user-facing: the artifact facts are not)."""
    return XDeployError(f"unknown {runner} option(s) {sorted(names)}; expected {', '.join(OPTIONS + SESSION_OPTIONS)}")


def provider_list(runner: str, graph: Graph, axes: Mapping[str, Axis], variant: str = "", device_id: int = 0,
                  **opts: Any) -> list[Provider]:
    """The `providers=` list for onnxruntime.InferenceSession (pure: imports no onnxruntime)."""
    ep = GPU_EPS[runner]
    if variant not in ep.variants:
        raise XDeployError(f"runner {runner!r} has no variant {variant!r}; expected one of: "
                           f"{', '.join(repr(v) for v in ep.variants)}")
    if opts.get("cuda_graph") and ep.provider != "CUDAExecutionProvider":
        raise XDeployError(f"runner {runner!r} does not take cuda_graph: the TensorRT execution provider's own CUDA "
                           "graphs (trt_cuda_graph_enable) are not wired or measured here; expected runner ort-cuda")
    unknown = set(opts) - set(OPTIONS) - set(ARTIFACT_FACTS)
    if unknown:
        raise unknown_options(runner, unknown)
    return ep.build(graph, axes, variant, device_id, **opts)


def create_cache_dirs(providers: list[Provider]) -> None:
    """Create the TensorRT EP's cache directories with all parents: the EP creates only the last level
    (fs::create_directory in tensorrt_execution_provider.cc), so on a fresh machine a nested path fails
    session creation with a message that blames the GPU."""
    for _, opts in providers:
        for key in ("trt_engine_cache_path", "trt_timing_cache_path"):
            if key in opts:
                try:
                    Path(opts[key]).mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise XDeployError(f"cannot create the TensorRT cache directory {opts[key]}: "
                                       f"{e.strerror or e}") from None


def check_available(runner: str, available: list[str], version: str) -> None:
    """One clear error when this onnxruntime build lacks the provider (the CPU wheel has neither)."""
    want = GPU_EPS[runner].provider
    if want not in available:
        raise XDeployError(f"runner {runner!r} needs onnxruntime-gpu with {want} and an NVIDIA GPU; this "
                           f"onnxruntime {version} offers only {', '.join(available)}")


EP_LIBRARIES = {"CUDAExecutionProvider": "libonnxruntime_providers_cuda.so",
                "TensorrtExecutionProvider": "libonnxruntime_providers_tensorrt.so"}


# Quantized graph formats (export/tensorrt.py int8_format) whose products onnxruntime's CUDA provider cannot run:
# they fall back to the host, silently but for the speed. Dynamic int8's DynamicQuantizeLinear makes uint8
# activations, and the CUDA provider registers MatMulInteger for int8 activations only (cuda_execution_provider.cc):
# on an NVIDIA H200 GPT-2 small's int8-dynamic artifact decoded at 0.22x its fp32 one, CUDA graphs refused
# (docs/runners.md, fourth lease).
HOST_PRODUCTS = {"dynamic": "its dynamic-int8 products (DynamicQuantizeLinear to uint8, MatMulInteger) have no CUDA "
                            "kernel and run on the host with copies around each (GPT-2 small decoded at 0.22x its "
                            "fp32 artifact on an NVIDIA H200); fp32, fp16 and int8 (Q/DQ) artifacts run on the GPU"}
_HOST_NOTES_SAID: set[tuple[str, str]] = set()


def host_products_note(runner: str, int8_fmt: str | None, graph_file: str) -> str | None:
    """The one-line note for a graph whose products a GPU runner runs on the host (by its quantization format),
    or None; said once per process for each (runner, graph file)."""
    why = HOST_PRODUCTS.get(int8_fmt or "")
    if why is None or (runner, graph_file) in _HOST_NOTES_SAID:
        return None
    _HOST_NOTES_SAID.add((runner, graph_file))
    return f"xdeploy: note: {runner} on {graph_file}: {why}"


def ep_library_gap(provider: str) -> str | None:
    """Why the provider's shared library cannot load (the loader's own message, e.g. `libnvinfer.so.10: cannot
    open shared object file`), or None. onnxruntime-gpu lists its GPU providers whenever their libraries are in
    the wheel, even where what they link against (TensorRT, cuDNN) is absent: session creation then falls back
    to the next provider with the cause only in its log."""
    import ctypes
    import os

    import onnxruntime as ort

    lib = Path(ort.__file__).parent / "capi" / EP_LIBRARIES[provider]
    if not lib.is_file():
        return None  # another platform's layout: session creation is the check
    try:
        ctypes.CDLL(str(lib), mode=os.RTLD_LAZY)
    except OSError as e:
        return f"onnxruntime {ort.__version__} cannot load {provider}: {e}"
    return None


class _OrtGpuRunner(OrtRunner):
    graphs: CudaGraphs | None = None  # ort-cuda's CUDA graphs, where on (option cuda_graph)
    # not a layerwise runtime: each bisection round would build a GPU session (a TensorRT engine for ort-trt)
    # for another set of exposed tensors; layerwise runs such a candidate in onnxruntime on the CPU
    layerwise = False
    # the loop keeps the KV cache: the GroupQueryAttention rewrite (deploy/ort_cache.py) is measured on the CPU
    # execution provider only
    fuses_cache = False
    # onnxruntime's whole optimizer set: ORT_CPU_SLOW_FUSIONS are slow on the CPU provider (a fused GPU kernel here)
    slow_fusions = ()
    # a host input bound once is copied to the GPU once (OrtRunner.binds_in_place): bind() binds again every call
    binds_in_place = False

    def _check_options(self) -> None:
        pass  # provider_options() refuses what a GPU runner does not take

    @classmethod
    def gaps(cls, variant: str = "") -> list[str]:
        import onnxruntime as ort

        want = GPU_EPS[cls.name].provider
        if want not in ort.get_available_providers():
            missing = [f"onnxruntime {ort.__version__} lacks {want} (onnxruntime-gpu: make gpu-env)"]
        else:
            missing = [g for g in (ep_library_gap(want),) if g]
        return missing + cuda_gaps()

    @classmethod
    def provider_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        """The options that go to provider_list (pure): the session's own are left to OrtRunner; the artifact's
        facts cannot be passed in."""
        extra = {k: v for k, v in options.items() if k not in ("opt_level", "device", *SESSION_OPTIONS)}
        unknown = set(extra) & set(ARTIFACT_FACTS)
        if unknown:
            raise unknown_options(cls.name, unknown)
        return extra

    def _load(self) -> None:
        import onnxruntime as ort

        check_available(self.name, ort.get_available_providers(), ort.__version__)
        self.device_id = int(self.options.get("device", 0))
        extra = self.provider_options(self.options)
        facts = {"precision": self.artifact.precision, "model": self.artifact.model,
                 "int8_format": int8_format(self.artifact.onnx_path(self.graph.name))
                 if self.artifact.precision.startswith("int8") else None,
                 "graph_sha256": self.artifact.manifest["files"][self.artifact.manifest["graphs"][self.graph.name]
                                                                 ["file"]]}
        if self.name == "ort-cuda":
            extra.setdefault("cuda_graph", self._steps_graph())
        self._plist = provider_list(self.name, self.graph, self.artifact.spec.axes, self.variant, self.device_id,
                                    **extra, **facts)
        create_cache_dirs(self._plist)
        self.graphs = None
        if extra.get("cuda_graph"):
            self._load_graphs(extra, facts)
        else:
            super()._load()
        active = self.session.get_providers()
        want = GPU_EPS[self.name].provider
        if want not in active:  # onnxruntime falls back to the next provider when one fails to start
            why = ep_library_gap(want) or "no usable GPU?"
            raise XDeployError(f"runner {self.name!r}: onnxruntime could not start {want} ({why}); "
                               f"active providers: {active}")
        note = host_products_note(self.name, facts["int8_format"], str(self.artifact.onnx_path(self.graph.name)))
        if note:
            print(note, file=sys.stderr)

    def _steps_graph(self) -> bool:
        """Whether this is the artifact's decode graph, the one the decoding loop binds once per generation and
        calls per token: CUDA graphs are on there by default (cuda_graph=False turns them off), off elsewhere."""
        feeds = self.artifact.capabilities.decoding
        return feeds is not None and feeds.decode_graph == self.graph.name

    def _load_graphs(self, extra: dict[str, Any], facts: dict[str, Any]) -> None:
        """The session with CUDA graphs on, or, where onnxruntime refuses them for this graph (a node that needs
        a copy between host and device, control flow) or torch has no CUDA, without them and a note saying why."""
        import onnxruntime as ort

        why = cuda_gaps()
        if not why:
            try:
                super()._load()
            except XDeployError as e:
                why = [str(e)]
            else:
                self.graphs = CudaGraphs(f"cuda:{self.device_id}")
                self.run_options = ort.RunOptions()  # an unbound run: neither captured nor replayed
                self.run_options.add_run_config_entry(GRAPH_ID, "-1")
                return
        self._plist = provider_list(self.name, self.graph, self.artifact.spec.axes, self.variant, self.device_id,
                                    **(extra | {"cuda_graph": False}), **facts)
        super()._load()  # a graph onnxruntime refuses outright fails here too, with its own line and no note
        print(f"xdeploy: note: {self.name} graph {self.graph.name!r}: CUDA graphs off ({'; '.join(why)})",
              file=sys.stderr)

    def _providers(self) -> tuple[Any, ...]:
        return (*self._plist, "CPUExecutionProvider")

    def bind(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> Callable[[], None]:
        """With CUDA graphs (option cuda_graph): every input and output on fixed device buffers, the host ones
        mirrored (CudaGraphs.bind), so that onnxruntime captures the bound call once and replays it after."""
        if self.graphs is None or set(self.output_names) - set(outputs):
            return super().bind(inputs, outputs)
        return self.graphs.bind(self.bind_with, inputs, outputs)

    def prepare(self, feeds: Mapping[str, np.ndarray]) -> Callable[[], Any]:
        """Inputs copied to the GPU once as OrtValues; outputs stay on the device."""
        import onnxruntime as ort

        checked = validate_feeds(self.graph, self.artifact.spec.axes, feeds)
        binding = self.session.io_binding()
        resident = {n: ort.OrtValue.ortvalue_from_numpy(a, "cuda", self.device_id) for n, a in checked.items()}
        for n, v in resident.items():
            binding.bind_ortvalue_input(n, v)
        for n in self.output_names:
            binding.bind_output(n, "cuda", self.device_id)
        run, options = self.session.run_with_iobinding, self.run_options

        def call() -> None:
            _ = resident  # the device copies must outlive the binding
            run(binding, options)

        return call

    def loop_arrays(self) -> LoopArrays:
        """The decoding loop's KV cache on this GPU (torch tensors bound by address): a step then copies the token
        in and the logits out, not the whole cache in and the step's K/V out. Beside a torch without CUDA (the
        runner opens: onnxruntime-gpu needs no torch) the cache stays on the host, bound again every call."""
        import torch

        return TorchArrays(f"cuda:{self.device_id}") if torch.cuda.is_available() else LoopArrays()

    def info(self) -> RunnerInfo:
        import onnxruntime as ort

        precision = "fp16" if self.variant == "fp16" else self.artifact.precision
        return RunnerInfo(runner=self.name + (f":{self.variant}" if self.variant else ""),
                          device=f"cuda:{self.device_id}", precision=precision, threads=1,
                          versions={"onnxruntime": ort.__version__})


GRAPH_ID = "gpu_graph_id"  # onnxruntime's run config key (kOrtRunOptionsConfigCudaGraphAnnotation); -1: no graph
MAX_CUDA_GRAPHS = 32  # captured graphs one runner keeps (each holds its launch sequence); beyond: runs uncaptured


class CudaGraphs:
    """The device side of `ort-cuda`'s CUDA graphs: fixed device mirrors of host buffers and one graph id per set
    of bound addresses.

    onnxruntime replays a captured graph on the addresses and shapes of the run it captured, so a bound call gets
    the id of its exact (name, address, shape, dtype) set: a later bind with the same set (torch's caching
    allocator hands the next generation of the same shape the same cache buffers) replays the same graph, any other
    set is captured anew (onnxruntime runs a new id uncaptured first, then captures it). Host arrays are mirrored
    into device buffers kept per (name, shape, dtype): copied in before each run, outputs copied out after. On
    "cpu" it is the same path with no graph to capture (the tests')."""

    def __init__(self, device: str, limit: int = MAX_CUDA_GRAPHS) -> None:
        self.device, self.limit = device, limit
        self.mirrors: dict[tuple[str, tuple[int, ...], str], Any] = {}
        self.ids: dict[tuple[Any, ...], int] = {}
        # one mirrored call at a time: calls of one shape share their mirrors (and a captured graph its addresses),
        # so two threads generating on one runner would otherwise overwrite each other's token between copy-in
        # and replay
        self.lock = threading.Lock()

    def mirror(self, name: str, a: np.ndarray) -> Any:
        import torch

        key = (name, tuple(a.shape), a.dtype.str)
        if key not in self.mirrors:  # (bind: under self.lock)
            self.mirrors[key] = torch.empty(a.shape, dtype=torch_dtype(a.dtype), device=self.device)
        return self.mirrors[key]

    def graph_id(self, tensors: Mapping[str, Any]) -> int:
        """The id of the graph of these bound tensors: the one captured on them, a new one, or -1 (past `limit`)."""
        key = tuple(sorted((n, t.data_ptr(), tuple(t.shape), str(t.dtype)) for n, t in tensors.items()))
        if key not in self.ids:
            if len(self.ids) >= self.limit:
                return -1
            self.ids[key] = len(self.ids) + 1  # 0 is what an unannotated run would capture as
        return self.ids[key]

    def bind(self, bind_with: Callable[..., Callable[[], None]], inputs: Mapping[str, Any],
             outputs: Mapping[str, Any]) -> Callable[[], None]:
        """`bind_with` (OrtRunner.bind_with) on device tensors only, under this set's graph id."""
        import onnxruntime as ort

        host_in = {n: a for n, a in inputs.items() if not is_tensor(a)}
        host_out = {n: a for n, a in outputs.items() if not is_tensor(a)}
        with self.lock:
            ins = {n: self.mirror(n, a) if n in host_in else a for n, a in inputs.items()}
            outs = {n: self.mirror(n, a) if n in host_out else a for n, a in outputs.items()}
            options = ort.RunOptions()
            options.add_run_config_entry(GRAPH_ID, str(self.graph_id(ins | outs)))
        call = bind_with(ins, outs, options)
        return _MirroredCall(call, [(a, ins[n]) for n, a in host_in.items()],
                             [(a, outs[n]) for n, a in host_out.items()], self.lock)


class _MirroredCall:
    """A bound call on device mirrors: the host inputs' current contents copied in before the run (the bound call
    waits for torch's stream), the host outputs copied out after it (onnxruntime synchronizes before returning)."""

    def __init__(self, call: Callable[[], None], ins: list[tuple[np.ndarray, Any]],
                 outs: list[tuple[np.ndarray, Any]], lock: threading.Lock) -> None:
        import torch

        self.call, self.lock = call, lock
        self.ins = [(torch.from_numpy(a), t) for a, t in ins]
        self.outs = [(torch.from_numpy(a), t) for a, t in outs]

    def __call__(self) -> None:
        with self.lock:
            for host, dev in self.ins:
                dev.copy_(host)
            self.call()
            for host, dev in self.outs:
                host.copy_(dev)


class OrtCudaRunner(_OrtGpuRunner):
    name = "ort-cuda"
    variants = GPU_EPS["ort-cuda"].variants
    gpu_variants = variants


class OrtTrtRunner(_OrtGpuRunner):
    name = "ort-trt"
    variants = GPU_EPS["ort-trt"].variants
    gpu_variants = variants
    variant_precisions = {"fp16": "fp16"}
