"""TensorRT engine built from the artifact's ONNX graph, run on device buffers behind a small seam.

    open_runner("trt", art)                      # strongly typed: computes in the artifact's precision
    open_runner("trt:fp16", art)                 # fp32 artifact + BuilderFlag.FP16 (TensorRT 10 only)
    open_runner("trt", art, cache_dir=..., workspace_mib=4096, device=1)

What is built (profiles, cache key, strong typing, TF32, trtexec line) is decided by the pure functions in
xdeploy.export.tensorrt; this module drives TensorRT. `tensorrt` is imported when the runner is opened, never
at package import.

The device seam: everything the runner does with memory, streams and the current device goes through one
`DeviceBuffers` object. `CudaBuffers` (torch CUDA tensors on `cuda:N`) is the real one; `HostBuffers` keeps
"device" tensors in host numpy arrays so a *simulated* tensorrt module (tests/sim_tensorrt.py, which executes
the ONNX graph with onnxruntime on CPU) can run the whole path deserialize -> context -> set_input_shape ->
set_tensor_address -> execute_async_v3 -> outputs in CI. `backend=TrtBackend(...)` selects both; the default is
the real tensorrt module with CUDA buffers. The simulation is not TensorRT: only the `gpu`-marked tests on an
NVIDIA machine verify TensorRT itself.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from xdeploy.core.deps import installed
from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import atomic_write_bytes
from xdeploy.export.artifact import Artifact
from xdeploy.export.tensorrt import (
    BuildPlan,
    EngineKey,
    ShapeRange,
    build_plan,
    cached_engine,
    default_cache_root,
    engine_dir,
    int8_format,
    profile_shapes,
    timing_cache_path,
    trtexec_command,
)

from .base import Runner, RunnerInfo, cuda_gaps, validate_feeds


def tensorrt_gaps() -> list[str]:
    """What the trt runner lacks here ([] = nothing), found without importing tensorrt (`xdeploy doctor`)."""
    missing = [] if installed("tensorrt") else ["the tensorrt Python package is not installed (make gpu-env)"]
    return missing + cuda_gaps()


def require_tensorrt() -> tuple[Any, Any]:
    """(tensorrt, torch) with a visible CUDA device, or one XDeployError naming everything that is missing."""
    missing = tensorrt_gaps()
    if missing:
        raise XDeployError("runner 'trt' needs an NVIDIA GPU with TensorRT: " + "; ".join(missing))
    try:
        import tensorrt as trt
    except ImportError as e:  # installed but broken (a missing libnvinfer): its own words
        raise XDeployError(f"runner 'trt' cannot import tensorrt: {e}") from None
    import torch

    return trt, torch


# ---------------------------------------------------------------------------------------------------------------
# The device seam
# ---------------------------------------------------------------------------------------------------------------


class DeviceBuffers(abc.ABC):
    """One device: its identity, the "current device" switch, buffers, copies and the stream TensorRT runs on.

    Buffers are whatever the implementation allocates (torch CUDA tensors, numpy arrays); the runner only asks
    for their `.shape` and their `address`."""

    index: int
    name: str  # GPU name, part of the engine key
    compute_capability: str  # "8.9", part of the engine key
    label: str  # RunnerInfo.device
    versions: Mapping[str, str]

    @abc.abstractmethod
    def use(self) -> contextlib.AbstractContextManager[None]:
        """Make this device current. An engine is bound to the device current when it is built or deserialized,
        and kernels launch on the current device (cudaSetDevice): build, load and every launch run inside."""

    @abc.abstractmethod
    def to_device(self, a: np.ndarray) -> Any: ...

    @abc.abstractmethod
    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any: ...

    @abc.abstractmethod
    def address(self, buf: Any) -> int: ...

    @abc.abstractmethod
    def copy_in(self, dst: Any, src: np.ndarray) -> None:
        """host -> device, ordered on the stream before later launches."""

    @abc.abstractmethod
    def copy_out(self, dst: np.ndarray, src: Any) -> None:
        """device -> host after everything enqueued so far; returns when dst holds the data."""

    @abc.abstractmethod
    def to_host(self, buf: Any) -> np.ndarray: ...

    @property
    @abc.abstractmethod
    def stream_handle(self) -> int: ...

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for everything enqueued on the stream."""


class CudaBuffers(DeviceBuffers):
    """torch CUDA tensors on cuda:N, one non-default stream, completion through an event."""

    def __init__(self, torch: Any, index: int) -> None:
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise XDeployError(f"CUDA device {index} does not exist; {count} visible (device=0..{count - 1})")
        self._torch, self.index = torch, index
        self.device = torch.device("cuda", index)
        props = torch.cuda.get_device_properties(self.device)
        self.name, self.compute_capability = props.name, f"{props.major}.{props.minor}"
        self.label = f"cuda:{index} ({props.name})"
        self.versions = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
        with torch.cuda.device(index):  # streams and events belong to the device current at creation
            self.stream = torch.cuda.Stream(self.device)
            self.done = torch.cuda.Event()

    def use(self) -> contextlib.AbstractContextManager[None]:
        return self._torch.cuda.device(self.index)

    def to_device(self, a: np.ndarray) -> Any:
        with self._torch.cuda.stream(self.stream):
            return self._torch.from_numpy(a).to(self.device, non_blocking=True)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        tdtype = self._torch.from_numpy(np.empty(0, dtype)).dtype
        return self._torch.empty(shape, dtype=tdtype, device=self.device)

    def address(self, buf: Any) -> int:
        return int(buf.data_ptr())

    def copy_in(self, dst: Any, src: np.ndarray) -> None:
        with self._torch.cuda.stream(self.stream):
            dst.copy_(self._torch.from_numpy(src), non_blocking=True)

    def copy_out(self, dst: np.ndarray, src: Any) -> None:
        with self._torch.cuda.stream(self.stream):
            self._torch.from_numpy(dst).copy_(src, non_blocking=False)

    def to_host(self, buf: Any) -> np.ndarray:
        with self._torch.cuda.stream(self.stream):
            return buf.to("cpu", non_blocking=False).numpy()

    @property
    def stream_handle(self) -> int:
        return int(self.stream.cuda_stream)

    def synchronize(self) -> None:
        self.done.record(self.stream)
        self.done.synchronize()


class DeviceRuntime(Protocol):
    """What HostBuffers needs from a (simulated) CUDA runtime: the current device and where memory lives."""

    def device_count(self) -> int: ...
    def get_device(self) -> int: ...
    def set_device(self, index: int) -> None: ...
    def note_allocation(self, address: int, nbytes: int, device: int) -> None: ...
    def create_stream(self, device: int) -> int: ...
    def device_name(self, index: int) -> str: ...
    def compute_capability(self, index: int) -> str: ...


class HostBuffers(DeviceBuffers):
    """"Device" buffers in host memory (numpy), for running TrtRunner against a simulated tensorrt on CPU.

    With a `runtime` (tests/sim_tensorrt.py's simulated CUDA runtime) the current-device switch and every
    allocation's device are recorded there, so the simulation can refuse an engine used from the wrong device
    or handed memory of another device, as CUDA would. Copies are synchronous; there is no real stream."""

    def __init__(self, index: int = 0, runtime: DeviceRuntime | None = None) -> None:
        if runtime is not None and not 0 <= index < runtime.device_count():
            n = runtime.device_count()
            raise XDeployError(f"device {index} does not exist; {n} visible (device=0..{n - 1})")
        self.index, self.runtime = index, runtime
        self.name = runtime.device_name(index) if runtime else "host memory"
        self.compute_capability = runtime.compute_capability(index) if runtime else "0.0"
        self.label = f"host:{index} ({self.name})"
        self.versions = {"numpy": np.__version__}
        self._stream = runtime.create_stream(index) if runtime else 0

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        if self.runtime is None:
            yield
            return
        before = self.runtime.get_device()
        self.runtime.set_device(self.index)
        try:
            yield
        finally:
            self.runtime.set_device(before)

    def to_device(self, a: np.ndarray) -> np.ndarray:
        buf = self.empty(a.shape, a.dtype)
        np.copyto(buf, a)
        return buf

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        buf = np.empty(shape, dtype)
        if self.runtime is not None:
            self.runtime.note_allocation(buf.ctypes.data, buf.nbytes, self.index)
        return buf

    def address(self, buf: np.ndarray) -> int:
        return int(buf.ctypes.data)

    def copy_in(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def copy_out(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def to_host(self, buf: np.ndarray) -> np.ndarray:
        return buf.copy()

    @property
    def stream_handle(self) -> int:
        return self._stream

    def synchronize(self) -> None:
        pass


@dataclass(frozen=True)
class TrtBackend:
    """The tensorrt module and the device buffers a TrtRunner uses (runner option `backend`)."""

    tensorrt: Any
    buffers: Callable[[int], DeviceBuffers]
    simulated: bool = False  # True for tests/sim_tensorrt.py (its version and device names say so too)


def cuda_backend() -> TrtBackend:
    """The real thing: the tensorrt package and torch CUDA buffers (one clear error when either is missing)."""
    trt, torch = require_tensorrt()
    return TrtBackend(trt, lambda index: CudaBuffers(torch, index))


# ---------------------------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------------------------


def attach_timing_cache(trt: Any, config: Any, path: Path) -> Any:
    """Attach the timing cache stored at `path` (or a fresh one) to the builder config; return the attached cache,
    or None when TensorRT accepted none (then nothing is written back).

    `create_timing_cache` returns None for a blob it cannot read (a truncated or foreign file) and
    `set_timing_cache(cache, ignore_mismatch=False)` returns False for timings taken on another device
    (NvInfer.h IBuilderConfig::setTimingCache); both fall back to an empty cache, which the build then fills."""
    blob = path.read_bytes() if path.is_file() else b""
    for data in ((blob, b"") if blob else (b"",)):
        cache = config.create_timing_cache(data)
        if cache is not None and config.set_timing_cache(cache, ignore_mismatch=False):
            return cache
    return None


def build_engine(trt: Any, onnx_path: str | Path, profiles: tuple[ShapeRange, ...], plan: BuildPlan,
                 timing_cache: str | Path, workspace_mib: int = 0) -> bytes:
    """Parse the ONNX file and build a serialized engine with one optimization profile.

    `trt` is the tensorrt module (passed in so the logic runs against the simulation on CPU). The timing cache
    file is read before and rewritten after the build, so later builds on this GPU skip kernel timing."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    # TensorRT 11 is always strongly typed (the flag is deprecated and ignored); 10.x needs it explicitly.
    if plan.strongly_typed and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # from the file: resolves external .onnx.data weights
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise XDeployError(f"TensorRT cannot parse {onnx_path}: "
                           f"{errors[0].splitlines()[0] if errors else 'unknown error'}")
    config = builder.create_builder_config()
    if workspace_mib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mib << 20)
    if not plan.tf32:  # on by default in TensorRT 10 and 11: fp32 must mean fp32
        config.clear_flag(trt.BuilderFlag.TF32)
    if plan.fp16_flag:
        if not hasattr(trt.BuilderFlag, "FP16"):
            raise XDeployError(f"TensorRT {trt.__version__} has no BuilderFlag.FP16; export the artifact at fp16")
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for p in profiles:
        profile.set_shape(p.name, p.min, p.opt, p.max)
    if config.add_optimization_profile(profile) < 0:
        raise XDeployError(f"TensorRT rejected the optimization profile for {onnx_path}: {list(profiles)}")
    timing_cache = Path(timing_cache)
    cache = attach_timing_cache(trt, config, timing_cache)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise XDeployError(f"TensorRT failed to build an engine for {onnx_path} (see the TensorRT log above)")
    if cache is not None:
        atomic_write_bytes(timing_cache, bytes(config.get_timing_cache().serialize()))
    return bytes(serialized)


@dataclass(frozen=True)
class EngineSetup:
    """Everything decided before TensorRT is touched (all from the manifest + TensorRT/GPU identity)."""

    key: EngineKey
    plan: BuildPlan
    onnx_path: Path
    engine_dir: Path
    timing_cache: Path
    trtexec: tuple[str, ...]


def engine_setup(artifact: Artifact, graph: str, variant: str, *, trt_version: str, has_fp16_flag: bool,
                 gpu_name: str, compute_capability: str, cache_dir: str | Path | None = None,
                 workspace_mib: int = 0) -> EngineSetup:
    """The engine's cache key, typing plan, cache paths and trtexec line for one artifact graph (pure)."""
    g = artifact.graph(graph)
    plan = build_plan(variant, artifact.precision, has_fp16_flag=has_fp16_flag)
    profiles = profile_shapes(g, artifact.spec.axes)
    onnx_sha = artifact.manifest["files"][artifact.manifest["graphs"][g.name]["file"]]
    key = EngineKey(onnx_sha, trt_version, gpu_name, compute_capability, profiles, plan, workspace_mib)
    root = Path(cache_dir or default_cache_root()).expanduser()
    edir = engine_dir(root, artifact.model, g.name, plan.precision, key)
    tcache = timing_cache_path(root, trt_version, gpu_name, compute_capability)
    onnx_path = artifact.onnx_path(g.name)
    cmd = trtexec_command(onnx_path.resolve(), edir / "engine.plan", profiles, plan, trt_version,
                          timing_cache=tcache, workspace_mib=workspace_mib)
    return EngineSetup(key, plan, onnx_path, edir, tcache, tuple(cmd))


# ---------------------------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------------------------

OPTIONS = ("cache_dir", "workspace_mib", "device", "backend")


class TrtRunner(Runner):
    name = "trt"
    variants = ("", "fp16")
    variant_precisions = {"fp16": "fp16"}
    gpu_variants = variants

    @classmethod
    def gaps(cls, variant: str = "") -> list[str]:
        return tensorrt_gaps()

    def _load(self) -> None:
        unknown = set(self.options) - set(OPTIONS)
        if unknown:
            raise XDeployError(f"unknown trt option(s) {sorted(unknown)}; expected {', '.join(OPTIONS)}")
        backend = self.options.get("backend") or cuda_backend()
        if not isinstance(backend, TrtBackend):
            raise XDeployError(f"trt option backend must be a TrtBackend, got {type(backend).__name__}")
        trt = self._trt = backend.tensorrt
        self.backend = backend
        if self.artifact.precision.startswith("int8"):  # int8 (Q/DQ) and int8-dynamic (integer ops)
            fmt = int8_format(self.artifact.onnx_path(self.graph.name))
            if fmt != "qdq":
                raise XDeployError(f"runner 'trt' needs a static Q/DQ int8 artifact; {self.artifact.path} is "
                                   f"{fmt or 'int8 without Q/DQ nodes'} int8 (DynamicQuantizeLinear/MatMulInteger "
                                   "have no TensorRT importer); use its fp32 or fp16 artifact")
        self.buffers = backend.buffers(int(self.options.get("device", 0)))
        setup = engine_setup(self.artifact, self.graph.name, self.variant, trt_version=trt.__version__,
                             has_fp16_flag=hasattr(trt.BuilderFlag, "FP16"), gpu_name=self.buffers.name,
                             compute_capability=self.buffers.compute_capability,
                             cache_dir=self.options.get("cache_dir"),
                             workspace_mib=int(self.options.get("workspace_mib", 0)))
        self.plan, self.engine_dir = setup.plan, setup.engine_dir

        def build() -> bytes:
            return build_engine(trt, setup.onnx_path, setup.key.profiles, setup.plan, setup.timing_cache,
                                setup.key.workspace_mib)

        # An engine belongs to the device current when it is built or deserialized, and so does its context:
        # all three happen with the runner's device current.
        with self.buffers.use():
            blob, self.built = cached_engine(setup.engine_dir, setup.key, build, setup.trtexec)
            self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
            self.engine = self.runtime.deserialize_cuda_engine(blob)
            if self.engine is None and not self.built:  # a damaged cached plan: rebuild it once
                (setup.engine_dir / "engine.json").unlink(missing_ok=True)
                blob, self.built = cached_engine(setup.engine_dir, setup.key, build, setup.trtexec)
                self.engine = self.runtime.deserialize_cuda_engine(blob)
            if self.engine is None:
                raise XDeployError(f"TensorRT cannot deserialize {self.engine_dir / 'engine.plan'}")
            self.context = self.engine.create_execution_context()
            if self.context is None:
                raise XDeployError(f"TensorRT could not create an execution context on {self.buffers.label}")
        names = {self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)}
        want = {t.name for t in (*self.graph.inputs, *self.graph.outputs)}
        if names != want:  # get_tensor_dtype/shape of a name the engine lacks answer kFLOAT / no dims, silently
            raise XDeployError(f"engine {self.engine_dir} has tensors {sorted(names)}; the manifest's graph "
                               f"{self.graph.name!r} has {sorted(want)}")
        self._profile = {p.name: p for p in setup.key.profiles}

    # -- device buffers --
    def _set_shapes(self, inputs: Mapping[str, Any]) -> None:
        for n, t in inputs.items():
            shape = tuple(int(d) for d in t.shape)
            if not self.context.set_input_shape(n, shape):
                p = self._profile.get(n)
                want = f"{p.min}..{p.max}" if p else "an input of this engine"
                raise XDeployError(f"TensorRT refused shape {shape} for input {n!r}; the engine takes {want}")

    def _outputs_for(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Set input shapes, then allocate outputs at the shapes TensorRT infers from them."""
        self._set_shapes(inputs)
        outs = {}
        for t in self.graph.outputs:
            n = t.name
            shape = tuple(int(d) for d in self.context.get_tensor_shape(n))
            if len(shape) != len(t.dims) or any(d < 0 for d in shape):
                raise XDeployError(f"TensorRT could not infer the shape of output {n!r} (got {shape})")
            dtype = np.dtype(self._trt.nptype(self.engine.get_tensor_dtype(n)))
            outs[n] = self.buffers.empty(shape, dtype)
        return outs

    def _launch(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> None:
        """Enqueue one inference on the runner's stream, with the runner's device current (addresses are re-set
        each call: several prepared calls may share the one execution context)."""
        ctx = self.context
        self._set_shapes(inputs)
        for n, t in (*inputs.items(), *outputs.items()):
            if not ctx.set_tensor_address(n, self.buffers.address(t)):
                raise XDeployError(f"TensorRT refused the address of tensor {n!r} of graph {self.graph.name!r}")
        if not ctx.execute_async_v3(self.buffers.stream_handle):
            raise XDeployError(f"TensorRT execution of graph {self.graph.name!r} failed (see the TensorRT log)")

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self.buffers.use():
            inputs = {n: self.buffers.to_device(a) for n, a in feeds.items()}
            outputs = self._outputs_for(inputs)
            self._launch(inputs, outputs)
            host = {n: self.buffers.to_host(t) for n, t in outputs.items()}
            self.buffers.synchronize()
        return host

    def prepare(self, feeds: Mapping[str, np.ndarray]) -> Callable[[], Any]:
        """Inputs copied to the device once; each call enqueues on the stream and waits for completion."""
        checked = validate_feeds(self.graph, self.artifact.spec.axes, feeds)
        with self.buffers.use():
            inputs = {n: self.buffers.to_device(a) for n, a in checked.items()}
            outputs = self._outputs_for(inputs)
            self.buffers.synchronize()

        def call() -> dict[str, Any]:
            with self.buffers.use():
                self._launch(inputs, outputs)
                self.buffers.synchronize()
            return outputs

        return call

    def bind(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> Callable[[], None]:
        """Caller-owned host buffers mirrored by device buffers: each call copies the current input contents
        host->device, runs, and copies into the output arrays (a discrete GPU cannot read pageable host memory).

        Same contract as Runner.bind: inputs must be C-contiguous (a copy would hide the caller's later writes),
        outputs writeable C-contiguous arrays of the exact dtype and shape the engine produces."""
        checked = self.check_bound(inputs, outputs)
        for n, b in outputs.items():
            if not isinstance(b, np.ndarray) or not b.flags.c_contiguous or not b.flags.writeable:
                raise XDeployError(f"bound output {n!r} must be a writeable C-contiguous numpy array")
        with self.buffers.use():
            dev_in = {n: self.buffers.to_device(a) for n, a in checked.items()}
            dev_out = self._outputs_for(dev_in)
            self.buffers.synchronize()
        for n, b in outputs.items():
            want = np.dtype(self._trt.nptype(self.engine.get_tensor_dtype(n)))
            if tuple(b.shape) != tuple(dev_out[n].shape) or b.dtype != want:
                raise XDeployError(f"bound output {n!r} must be {want} of shape {tuple(dev_out[n].shape)}")

        def call() -> None:
            with self.buffers.use():
                for n, a in checked.items():
                    self.buffers.copy_in(dev_in[n], a)
                self._launch(dev_in, dev_out)
                for n, b in outputs.items():
                    self.buffers.copy_out(b, dev_out[n])
                self.buffers.synchronize()

        return call

    def info(self) -> RunnerInfo:
        versions = {"tensorrt": str(self._trt.__version__), **self.buffers.versions}
        return RunnerInfo(runner=self.name + (f":{self.variant}" if self.variant else ""),
                          device=self.buffers.label, precision=self.plan.precision, threads=1, versions=versions)

    def close(self) -> None:
        for k in ("context", "engine", "runtime"):
            self.__dict__.pop(k, None)
