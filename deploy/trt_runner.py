"""TensorRT engine built from the artifact's ONNX graph, run on CUDA device buffers held as torch tensors.

    open_runner("trt", art)                      # strongly typed: computes in the artifact's precision
    open_runner("trt:fp16", art)                 # fp32 artifact + BuilderFlag.FP16 (TensorRT 10 only)
    open_runner("trt", art, cache_dir=..., workspace_mib=4096)

What is built (profiles, cache key, strong typing, trtexec line) is decided by the pure functions in
xdeploy.export.tensorrt; this module only drives TensorRT and CUDA. `tensorrt` is imported when the runner is
selected, never at package import. Verified only with a fake tensorrt module on CPU (tests/fake_tensorrt.py);
the GPU path is covered by tests marked `gpu`, which need an NVIDIA GPU with TensorRT.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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
    profile_shapes,
    timing_cache_path,
    trtexec_command,
)

from .base import Runner, RunnerInfo, validate_feeds


def require_tensorrt() -> tuple[Any, Any]:
    """(tensorrt, torch) with a visible CUDA device, or one XDeployError naming everything that is missing."""
    missing = []
    try:
        import tensorrt as trt
    except ImportError:
        trt = None
        missing.append("the tensorrt Python package is not installed (pip install 'xdeploy[gpu]')")
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        missing.append(f"no CUDA device is visible to torch {torch.__version__} ({build})")
    if missing:
        raise XDeployError("runner 'trt' needs an NVIDIA GPU with TensorRT: " + "; ".join(missing))
    return trt, torch


def build_engine(trt: Any, onnx_path: str | Path, profiles: tuple[ShapeRange, ...], plan: BuildPlan,
                 timing_cache: str | Path, workspace_mib: int = 0) -> bytes:
    """Parse the ONNX file and build a serialized engine with one optimization profile.

    `trt` is the tensorrt module (passed in so the logic can be exercised with a fake on CPU). The timing
    cache file is read before and rewritten after the build, so later builds on this GPU skip kernel timing."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    # TensorRT 11 is always strongly typed (the flag is accepted and ignored); 10.x needs it explicitly.
    if plan.strongly_typed and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # from the file: resolves external .onnx.data weights
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise XDeployError(f"TensorRT cannot parse {onnx_path}: {errors[0] if errors else 'unknown error'}")
    config = builder.create_builder_config()
    if workspace_mib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mib << 20)
    if plan.fp16_flag:
        if not hasattr(trt.BuilderFlag, "FP16"):
            raise XDeployError(f"TensorRT {trt.__version__} has no BuilderFlag.FP16; export the artifact at fp16")
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for p in profiles:
        profile.set_shape(p.name, p.min, p.opt, p.max)
    config.add_optimization_profile(profile)
    timing_cache = Path(timing_cache)
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise XDeployError(f"TensorRT failed to build an engine for {onnx_path} (see the TensorRT log above)")
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


class TrtRunner(Runner):
    name = "trt"
    variants = ("", "fp16")

    def _load(self) -> None:
        unknown = set(self.options) - {"cache_dir", "workspace_mib", "device"}
        if unknown:
            raise XDeployError(f"unknown trt option(s) {sorted(unknown)}; expected cache_dir, workspace_mib, device")
        trt, torch = require_tensorrt()
        self._trt, self._torch = trt, torch
        self.device = torch.device("cuda", int(self.options.get("device", 0)))
        props = torch.cuda.get_device_properties(self.device)
        self.gpu_name = props.name
        setup = engine_setup(self.artifact, self.graph.name, self.variant, trt_version=trt.__version__,
                             has_fp16_flag=hasattr(trt.BuilderFlag, "FP16"), gpu_name=props.name,
                             compute_capability=f"{props.major}.{props.minor}",
                             cache_dir=self.options.get("cache_dir"),
                             workspace_mib=int(self.options.get("workspace_mib", 0)))
        self.plan, self.engine_dir = setup.plan, setup.engine_dir
        blob, self.built = cached_engine(
            setup.engine_dir, setup.key,
            lambda: build_engine(trt, setup.onnx_path, setup.key.profiles, setup.plan, setup.timing_cache,
                                 setup.key.workspace_mib), setup.trtexec)
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(blob)
        if self.engine is None:
            raise XDeployError(f"TensorRT cannot deserialize {self.engine_dir / 'engine.plan'}; delete it to rebuild")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream(self.device)
        self.done = torch.cuda.Event()

    # -- device buffers --
    def _to_device(self, feeds: Mapping[str, np.ndarray]) -> dict[str, Any]:
        torch = self._torch
        with torch.cuda.stream(self.stream):
            return {n: torch.from_numpy(a).to(self.device, non_blocking=True) for n, a in feeds.items()}

    def _outputs_for(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Set input shapes, then allocate outputs at the shapes TensorRT infers from them."""
        torch, ctx = self._torch, self.context
        for n, t in inputs.items():
            ctx.set_input_shape(n, tuple(t.shape))
        outs = {}
        for n in self.output_names:
            dtype = torch.from_numpy(np.empty(0, self._trt.nptype(self.engine.get_tensor_dtype(n)))).dtype
            outs[n] = torch.empty(tuple(ctx.get_tensor_shape(n)), dtype=dtype, device=self.device)
        return outs

    def _launch(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> None:
        """Enqueue one inference on the runner's stream (addresses are re-set each call: several prepared
        calls may share the one execution context)."""
        ctx = self.context
        for n, t in inputs.items():
            ctx.set_input_shape(n, tuple(t.shape))
            ctx.set_tensor_address(n, t.data_ptr())
        for n, t in outputs.items():
            ctx.set_tensor_address(n, t.data_ptr())
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise XDeployError(f"TensorRT execution of graph {self.graph.name!r} failed")
        self.done.record(self.stream)

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs = self._to_device(feeds)
        outputs = self._outputs_for(inputs)
        self._launch(inputs, outputs)
        with self._torch.cuda.stream(self.stream):
            host = {n: t.to("cpu", non_blocking=False) for n, t in outputs.items()}
        self.done.synchronize()
        return {n: t.numpy() for n, t in host.items()}

    def prepare(self, feeds: Mapping[str, np.ndarray]) -> Callable[[], Any]:
        """Inputs copied to the device once; each call enqueues on the stream and waits on an event."""
        inputs = self._to_device(validate_feeds(self.graph, self.artifact.spec.axes, feeds))
        self.stream.synchronize()
        outputs = self._outputs_for(inputs)

        def call() -> None:
            self._launch(inputs, outputs)
            self.done.synchronize()

        return call

    def bind(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> Callable[[], None]:
        """Caller-owned host buffers mirrored by device buffers: each call copies the current input contents
        host->device, runs, and copies into the output arrays (a discrete GPU cannot read host memory in place)."""
        checked = validate_feeds(self.graph, self.artifact.spec.axes, inputs)
        unknown = [n for n in outputs if n not in self.output_names]
        if unknown:
            raise XDeployError(f"unknown output(s) {unknown}; graph {self.graph.name!r} has {self.output_names}")
        torch = self._torch
        dev_in = self._to_device(checked)
        self.stream.synchronize()
        dev_out = self._outputs_for(dev_in)
        host_in = {n: torch.from_numpy(a) for n, a in checked.items()}
        host_out = {n: torch.from_numpy(b) for n, b in outputs.items()}
        for n, b in host_out.items():
            if tuple(b.shape) != tuple(dev_out[n].shape) or b.dtype != dev_out[n].dtype:
                raise XDeployError(f"bound output {n!r} must be {dev_out[n].dtype} of shape {tuple(dev_out[n].shape)}")

        def call() -> None:
            with torch.cuda.stream(self.stream):
                for n, t in host_in.items():
                    dev_in[n].copy_(t, non_blocking=True)
                self._launch(dev_in, dev_out)
                for n, t in host_out.items():
                    t.copy_(dev_out[n], non_blocking=False)
            self.done.synchronize()

        return call

    def info(self) -> RunnerInfo:
        return RunnerInfo(runner=self.name + (f":{self.variant}" if self.variant else ""),
                          device=f"{self.device} ({self.gpu_name})", precision=self.plan.precision, threads=1,
                          versions={"tensorrt": self._trt.__version__, "torch": self._torch.__version__,
                                    "cuda": str(self._torch.version.cuda)})

    def close(self) -> None:
        for k in ("context", "engine", "runtime"):
            self.__dict__.pop(k, None)
