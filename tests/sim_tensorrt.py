"""SIMULATED TensorRT: a stand-in `tensorrt` module whose engines *execute* (the ONNX graph, with onnxruntime on
CPU), so TrtRunner's whole runtime path -- build, timing cache, deserialize, context, set_input_shape,
set_tensor_address, execute_async_v3, outputs -- runs in CI. It is NOT TensorRT: passing tests with it verifies
our code around TensorRT, never TensorRT's numerics, kernels or speed (the `gpu`-marked tests do that).

    sim = make_simulated_tensorrt("10.13.0")   # __version__ "10.13.0+sim"; 10.x API: BuilderFlag.FP16/INT8 exist
    sim = make_simulated_tensorrt("11.1.0")    # 11.x API: no FP16/INT8 flags, always strongly typed
    backend = simulated_backend(sim)           # TrtBackend: the simulation + HostBuffers on its simulated devices
    open_runner("trt", artifact, backend=backend, device=1)

What it follows from the real API (NVIDIA/TensorRT include/NvInfer.h, NvInferRuntime.h, python/src/infer/
pyCore.cpp, onnx-tensorrt docs/operators.md + onnxOpImporters.cpp), failure behaviour first:
- the ONNX parser refuses operators TensorRT has no importer for (MatMulInteger, DynamicQuantizeLinear, ...),
  non-default domains (onnxruntime contrib ops), and Q/DQ with a non-zero zero point (symmetric only);
- `create_timing_cache` returns None for a blob it cannot read; `set_timing_cache(c, ignore_mismatch=False)`
  returns False for a cache taken on another device;
- `build_serialized_network` returns None when a dynamic input has no profile, a profile disagrees with the
  network, or a precision flag (FP16/INT8) is set on a strongly typed network;
- `deserialize_cuda_engine` returns None for a foreign or damaged blob, another TensorRT version, or a device
  of another compute capability;
- `set_input_shape` returns False for an unknown input or a shape outside the profile; `set_tensor_address`
  returns False for an unknown name; `get_tensor_shape` of an unknown name has no dims; `get_tensor_dtype` of
  an unknown name is FLOAT (that is what the C++ API documents) with an error logged;
- an engine is bound to the device current when it is deserialized (the simulated CUDA runtime tracks
  cudaSetDevice); `execute_async_v3` returns False when called with another device current, on a stream of
  another device, or with an address that is not memory of the engine's device, and when an input or output
  has no address or shape.
What it does not simulate: kernels, tactics and their precision choices. The engine runs the ONNX graph's own
types; with weak typing + the FP16 flag (`trt:fp16` on TensorRT 10) it runs the whole graph in fp16 (I/O types
kept), where TensorRT would choose per layer. TF32 is only recorded, not emulated.
"""

from __future__ import annotations

import ctypes
import enum
import json
import types
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from xdeploy.deploy.trt_runner import HostBuffers, TrtBackend

ENGINE_MAGIC = b"SIMULATED-TRT-ENGINE\n"
CACHE_MAGIC = b"SIMULATED-TRT-TIMING\n"
# onnx-tensorrt docs/operators.md: operators with "Supported: N" that our exports or quantizers can produce
UNSUPPORTED_OPS = {"ConvInteger", "DynamicQuantizeLinear", "MatMulInteger", "QLinearConv", "QLinearMatMul",
                   "Compress", "Unique", "NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"}


class DataType(enum.IntEnum):  # values as in NvInferRuntimeBase.h
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    BF16 = 7
    INT64 = 8


_NP = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8, DataType.INT32: np.int32,
       DataType.BOOL: np.bool_, DataType.UINT8: np.uint8, DataType.INT64: np.int64}
_FROM_ONNX = {onnx.TensorProto.FLOAT: DataType.FLOAT, onnx.TensorProto.FLOAT16: DataType.HALF,
              onnx.TensorProto.INT8: DataType.INT8, onnx.TensorProto.INT32: DataType.INT32,
              onnx.TensorProto.BOOL: DataType.BOOL, onnx.TensorProto.UINT8: DataType.UINT8,
              onnx.TensorProto.INT64: DataType.INT64, onnx.TensorProto.BFLOAT16: DataType.BF16}


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class SimulatedCudaRuntime:
    """The CUDA state the simulation checks: the current device (cudaSetDevice), which device each allocation
    and stream belongs to. Devices are (name, compute capability)."""

    def __init__(self, devices: Sequence[tuple[str, str]]) -> None:
        self.devices = list(devices)
        self.current = 0
        self.allocations: dict[int, tuple[int, int]] = {}  # address -> (nbytes, device)
        self.streams: dict[int, int] = {0: -1}  # handle -> device (0 = the legacy default stream: any device)

    def device_count(self) -> int:
        return len(self.devices)

    def get_device(self) -> int:
        return self.current

    def set_device(self, index: int) -> None:
        if not 0 <= index < len(self.devices):
            raise RuntimeError(f"simulated cudaSetDevice({index}): invalid device ordinal "
                               f"({len(self.devices)} devices)")
        self.current = index

    def note_allocation(self, address: int, nbytes: int, device: int) -> None:
        if not 0 <= device < len(self.devices):
            raise RuntimeError(f"simulated cudaMalloc on device {device}: invalid device ordinal")
        # memory now owned by this allocation was freed by whatever was registered over it before
        for start, (size, _) in list(self.allocations.items()):
            if start < address + max(nbytes, 1) and address < start + max(size, 1):
                del self.allocations[start]
        self.allocations[address] = (nbytes, device)

    def device_of(self, address: int, nbytes: int) -> int | None:
        for start, (size, device) in self.allocations.items():
            if start <= address and address + nbytes <= start + size:
                return device
        return None

    def create_stream(self, device: int) -> int:
        handle = 0x5000 + len(self.streams)
        self.streams[handle] = device
        return handle

    def device_name(self, index: int) -> str:
        return self.devices[index][0]

    def compute_capability(self, index: int) -> str:
        return self.devices[index][1]

    def identity(self) -> str:
        return "/".join(self.devices[self.current])


def _dims(vi: onnx.ValueInfoProto) -> tuple[int, ...]:
    return tuple(d.dim_value if d.HasField("dim_value") else -1 for d in vi.type.tensor_type.shape.dim)


def make_simulated_tensorrt(version: str = "10.13.0", *,
                            devices: Sequence[tuple[str, str]] = (("Simulated GPU 0 (not TensorRT)", "8.9"),
                                                                  ("Simulated GPU 1 (not TensorRT)", "8.9"))
                            ) -> types.SimpleNamespace:
    """A simulated `tensorrt` module of the given API version (see the module docstring)."""
    major = int(version.split(".")[0])
    cudart = SimulatedCudaRuntime(devices)
    log: list[str] = []  # what the real library would print through its ILogger (errors and warnings)
    calls: dict[str, Any] = {"builds": 0, "timing_cache_in": None, "engines_run": 0}

    # NvInfer.h: kSTRONGLY_TYPED is 1 on 10.x and 0 (deprecated, ignored) on 11.x; 11 removed kFP16 and kINT8.
    NetworkDefinitionCreationFlag = enum.IntEnum(
        "NetworkDefinitionCreationFlag", {"STRONGLY_TYPED": 1 if major < 11 else 0})
    flags = {"DEBUG": 2, "GPU_FALLBACK": 3, "REFIT": 4, "DISABLE_TIMING_CACHE": 5, "TF32": 6}
    if major < 11:
        flags |= {"FP16": 0, "INT8": 1}
    BuilderFlag = enum.IntEnum("BuilderFlag", flags)

    class MemoryPoolType(enum.IntEnum):
        WORKSPACE = 0

    class Logger:
        ERROR, WARNING, INFO = 1, 2, 3

        def __init__(self, severity: int = 2) -> None:
            self.severity = severity

    def error(msg: str) -> None:
        log.append(f"[E] {msg}")

    def nptype(dt: DataType) -> type:
        return _NP[DataType(dt)]

    class Network:
        def __init__(self, flags: int) -> None:
            self.flags = flags
            # 11.x: always strongly typed (the flag is ignored); 10.x: only with the flag's bit
            self.strongly_typed = major >= 11 or bool(flags >> int(NetworkDefinitionCreationFlag.STRONGLY_TYPED) & 1)
            self.model: onnx.ModelProto | None = None
            self.inputs: list[tuple[str, DataType, tuple[int, ...]]] = []
            self.outputs: list[tuple[str, DataType, tuple[int, ...]]] = []

    class OnnxParser:
        def __init__(self, network: Network, logger: Logger) -> None:
            self.network, self.errors = network, []

        def parse_from_file(self, path: str) -> bool:
            try:
                model = onnx.load(path)  # external data (.onnx.data) is resolved next to the file, as TensorRT does
            except Exception as e:  # noqa: BLE001 - the real parser reports any unreadable file as a parse error
                self.errors.append(f"ModelImporter.cpp: Failed to parse ONNX model from file {path}: {e}")
                return False
            consts = {t.name: t for t in model.graph.initializer}
            for i, node in enumerate(model.graph.node):
                where = f"In node {i} with name: {node.name} and operator: {node.op_type}"
                if node.domain not in ("", "ai.onnx") or node.op_type in UNSUPPORTED_OPS:
                    self.errors.append(f"{where} (checkFallbackPluginImporter): INVALID_NODE: creator && "
                                       f"\"Plugin not found, are the plugin name, version, and namespace correct?\"")
                    return False
                if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 2:
                    zp = consts.get(node.input[2])
                    if zp is not None and np.any(numpy_helper.to_array(zp) != 0):
                        self.errors.append(f"{where}: INVALID_NODE: TensorRT only supports symmetric quantization. "
                                           "The zero point for the QuantizeLinear/DequantizeLinear operator must "
                                           "be all zeros.")
                        return False
                    if zp is not None and zp.data_type == onnx.TensorProto.UINT8:
                        log.append(f"[W] {where}: TensorRT doesn't support QuantizeLinear/DequantizeLinear with "
                                   "UINT8 zero_point. TensorRT will use INT8 instead.")
            init = set(consts)
            net = self.network
            net.model = model
            net.inputs = [(v.name, _FROM_ONNX[v.type.tensor_type.elem_type], _dims(v))
                          for v in model.graph.input if v.name not in init]
            net.outputs = [(v.name, _FROM_ONNX[v.type.tensor_type.elem_type], _dims(v)) for v in model.graph.output]
            return True

        @property
        def num_errors(self) -> int:
            return len(self.errors)

        def get_error(self, i: int) -> str:
            return self.errors[i]

    class OptimizationProfile:
        def __init__(self) -> None:
            self.shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}

        def set_shape(self, name: str, mn: Sequence[int], opt: Sequence[int], mx: Sequence[int]) -> None:
            mn, opt, mx = tuple(mn), tuple(opt), tuple(mx)
            # pyCore.cpp opt_profile_set_shape: PY_ASSERT_RUNTIME_ERROR on setDimensions(...) == false
            if not (len(mn) == len(opt) == len(mx)) or any(not a <= b <= c for a, b, c in zip(mn, opt, mx)):
                raise RuntimeError(f"Shape provided for {'min' if len(mn) != len(opt) else 'opt'} is inconsistent "
                                   f"with other shapes ({name}: {mn} {opt} {mx})")
            self.shapes[name] = (mn, opt, mx)

    class TimingCache:
        def __init__(self, device: str | None, entries: list[str]) -> None:
            self.device, self.entries = device, entries

        def serialize(self) -> bytes:
            return CACHE_MAGIC + json.dumps({"device": self.device, "entries": self.entries}).encode()

    class BuilderConfig:
        def __init__(self) -> None:
            self.flags = {"TF32"}  # NvInfer.h: kTF32 "Enabled by default"
            self.profiles: list[OptimizationProfile] = []
            self.cache: TimingCache | None = None
            self.pool: dict[Any, int] = {}

        def set_flag(self, flag: Any) -> None:
            self.flags.add(BuilderFlag(flag).name)

        def clear_flag(self, flag: Any) -> None:
            self.flags.discard(BuilderFlag(flag).name)

        def get_flag(self, flag: Any) -> bool:
            return BuilderFlag(flag).name in self.flags

        def set_memory_pool_limit(self, pool: Any, size: int) -> None:
            self.pool[pool] = size

        def add_optimization_profile(self, p: OptimizationProfile) -> int:
            if not p.shapes:
                error("IBuilderConfig::addOptimizationProfile: the profile is not valid (no shapes set)")
                return -1
            self.profiles.append(p)
            return len(self.profiles) - 1

        def create_timing_cache(self, blob: bytes) -> TimingCache | None:
            calls["timing_cache_in"] = bytes(blob)
            if not blob:
                return TimingCache(None, [])
            try:
                if not blob.startswith(CACHE_MAGIC):
                    raise ValueError("bad magic")
                meta = json.loads(blob[len(CACHE_MAGIC):])
                return TimingCache(meta["device"], list(meta["entries"]))
            except (ValueError, KeyError, TypeError):
                error("ITimingCache: cannot deserialize the timing cache (corrupt or foreign blob)")
                return None

        def set_timing_cache(self, cache: TimingCache, ignore_mismatch: bool) -> bool:
            if cache.device is not None and cache.device != cudart.identity() and not ignore_mismatch:
                error(f"setTimingCache: the timing cache was created on {cache.device}, this is {cudart.identity()}")
                return False
            self.cache = cache
            return True

        def get_timing_cache(self) -> TimingCache | None:
            return self.cache

    class Builder:
        def __init__(self, logger: Logger) -> None:
            self.logger = logger

        def create_network(self, flags: int = 0) -> Network:
            calls["network_flags"] = flags
            return Network(flags)

        def create_builder_config(self) -> BuilderConfig:
            return BuilderConfig()

        def create_optimization_profile(self) -> OptimizationProfile:
            return OptimizationProfile()

        def build_serialized_network(self, network: Network, config: BuilderConfig) -> bytes | None:
            calls["builds"] += 1
            calls["flags"] = sorted(config.flags)
            calls["profiles"] = [p.shapes for p in config.profiles]
            calls["workspace"] = config.pool.get(MemoryPoolType.WORKSPACE, 0)
            if network.model is None:
                error("Network must have at least one output")
                return None
            if network.strongly_typed and config.flags & {"FP16", "INT8"}:
                error("BuilderFlag::kFP16/kINT8 are not allowed for a strongly typed network")
                return None
            model = network.model
            if not network.strongly_typed and "FP16" in config.flags:
                # weak typing + FP16: TensorRT may run any layer in half precision; the simulation runs all of
                # them in fp16 (graph I/O types kept), the harshest case a real engine could pick
                from onnxruntime.transformers.float16 import convert_float_to_float16

                model = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True)
            profile = config.profiles[0].shapes if config.profiles else {}
            for name, _, dims in network.inputs:
                if name not in profile:
                    if any(d < 0 for d in dims):
                        error(f"Network has dynamic or shape inputs, but no optimization profile has been defined "
                              f"for {name}")
                        return None
                    continue
                for shape in profile[name]:
                    if len(shape) != len(dims) or any(d >= 0 and d != s for d, s in zip(dims, shape)):
                        error(f"Optimization profile dimensions {shape} of {name} do not match the network {dims}")
                        return None
            unknown = set(profile) - {n for n, _, _ in network.inputs}
            if unknown:
                error(f"Optimization profile names unknown inputs {sorted(unknown)}")
                return None
            if config.cache is not None:  # a build times tactics and leaves them in the attached cache
                config.cache.device = cudart.identity()
                config.cache.entries.append(f"tactic-{calls['builds']}")
            header = {"version": version, "device_cc": cudart.compute_capability(cudart.current),
                      "strongly_typed": network.strongly_typed, "flags": sorted(config.flags),
                      "profile": {k: [list(s) for s in v] for k, v in profile.items()},
                      "inputs": [[n, int(t), list(d)] for n, t, d in network.inputs],
                      "outputs": [[n, int(t), list(d)] for n, t, d in network.outputs]}
            head = json.dumps(header).encode()
            return ENGINE_MAGIC + len(head).to_bytes(8, "little") + head + model.SerializeToString()

    class ExecutionContext:
        def __init__(self, engine: CudaEngine) -> None:
            self.engine = engine
            self.shapes: dict[str, tuple[int, ...]] = {}
            self.addresses: dict[str, int] = {}

        def set_input_shape(self, name: str, shape: Sequence[int]) -> bool:
            e, shape = self.engine, tuple(int(d) for d in shape)
            if name not in e.inputs:
                error(f"IExecutionContext::setInputShape: {name!r} is not an input tensor")
                return False
            dims = e.inputs[name][1]
            mn, _, mx = e.profile.get(name, (dims, dims, dims))
            if len(shape) != len(dims) or any(not a <= s <= b for a, s, b in zip(mn, shape, mx)):
                error(f"IExecutionContext::setInputShape: {name} {shape} is outside the profile {mn}..{mx}")
                return False
            self.shapes[name] = shape
            return True

        def get_tensor_shape(self, name: str) -> tuple[int, ...]:
            e = self.engine
            if name in e.inputs:
                return self.shapes.get(name, e.inputs[name][1])
            if name not in e.outputs:
                error(f"IExecutionContext::getTensorShape: {name!r} is not an input or output tensor")
                return ()  # Dims{-1, {}}
            if set(self.shapes) != set(e.inputs):
                return e.outputs[name][1]
            return e.output_shapes(self.shapes)[name]

        def set_tensor_address(self, name: str, address: int) -> bool:
            if name not in self.engine.inputs and name not in self.engine.outputs:
                error(f"IExecutionContext::setTensorAddress: {name!r} is not an input or output tensor")
                return False
            self.addresses[name] = int(address)
            return True

        def _memory(self, name: str, shape: tuple[int, ...], dtype: DataType) -> np.ndarray | None:
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_NP[dtype]).itemsize
            address = self.addresses.get(name)
            if not address:
                error(f"IExecutionContext::enqueueV3: tensor {name!r} has no address")
                return None
            if nbytes and cudart.device_of(address, nbytes) != self.engine.device:
                error(f"IExecutionContext::enqueueV3: {name!r} at {address:#x} is not memory of device "
                      f"{self.engine.device} (illegal memory access)")
                return None
            raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(address)
            return np.ctypeslib.as_array(raw)[:nbytes].view(_NP[dtype]).reshape(shape)

        def execute_async_v3(self, stream_handle: int) -> bool:
            e = self.engine
            if cudart.current != e.device:
                error(f"enqueueV3: engine of device {e.device} launched with device {cudart.current} current")
                return False
            if cudart.streams.get(stream_handle, None) not in (-1, e.device):
                error(f"enqueueV3: stream {stream_handle:#x} does not belong to device {e.device}")
                return False
            missing = sorted(set(e.inputs) - set(self.shapes))
            if missing:
                error(f"enqueueV3: input shapes not set for {missing}")
                return False
            feeds = {}
            for name, (dtype, _) in e.inputs.items():
                mem = self._memory(name, self.shapes[name], dtype)
                if mem is None:
                    return False
                feeds[name] = mem.copy()
            shapes = e.output_shapes(self.shapes)
            outs = {n: self._memory(n, shapes[n], e.outputs[n][0]) for n in e.outputs}
            if any(v is None for v in outs.values()):
                return False
            results = e.run(feeds)
            for name, dst in outs.items():
                np.copyto(dst, results[name].astype(dst.dtype, copy=False))
            calls["engines_run"] += 1
            return True

    class CudaEngine:
        def __init__(self, header: dict[str, Any], model: bytes) -> None:
            self.device = cudart.current  # bound to the device current at deserialization
            self.header, self.model = header, model
            self.inputs = {n: (DataType(t), tuple(d)) for n, t, d in header["inputs"]}
            self.outputs = {n: (DataType(t), tuple(d)) for n, t, d in header["outputs"]}
            self.profile = {k: tuple(tuple(s) for s in v) for k, v in header["profile"].items()}
            self._session: ort.InferenceSession | None = None
            self._shapes: dict[tuple, dict[str, tuple[int, ...]]] = {}

        @property
        def num_io_tensors(self) -> int:
            return len(self.inputs) + len(self.outputs)

        def get_tensor_name(self, i: int) -> str:
            return [*self.inputs, *self.outputs][i]

        def get_tensor_mode(self, name: str) -> TensorIOMode:
            return TensorIOMode.INPUT if name in self.inputs else \
                TensorIOMode.OUTPUT if name in self.outputs else TensorIOMode.NONE

        def get_tensor_dtype(self, name: str) -> DataType:
            if name in self.inputs or name in self.outputs:
                return {**self.inputs, **self.outputs}[name][0]
            error(f"ICudaEngine::getTensorDataType: {name!r} is not an input or output tensor")
            return DataType.FLOAT  # NvInferRuntime.h: kFLOAT for an unknown name

        def get_tensor_shape(self, name: str) -> tuple[int, ...]:
            if name in self.inputs or name in self.outputs:
                return {**self.inputs, **self.outputs}[name][1]
            error(f"ICudaEngine::getTensorShape: {name!r} is not an input or output tensor")
            return ()

        def create_execution_context(self) -> ExecutionContext | None:
            if cudart.current != self.device:
                error(f"createExecutionContext: engine of device {self.device} with device {cudart.current} current")
                return None
            return ExecutionContext(self)

        # -- the simulation's executor: onnxruntime on CPU, one thread (CI shares two cores) --
        def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            if self._session is None:
                so = ort.SessionOptions()
                so.intra_op_num_threads = 1
                so.log_severity_level = 3
                # the graph as written: onnxruntime's own fusions (QDQ propagation among them) are not what a
                # TensorRT engine would do
                so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
                self._session = ort.InferenceSession(self.model, so, providers=["CPUExecutionProvider"])
            names = [o.name for o in self._session.get_outputs()]
            return dict(zip(names, self._session.run(names, feeds)))

        def output_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
            """TensorRT infers output shapes from input shapes before running; the simulation learns them once
            per input-shape combination from a run on zeros."""
            key = tuple(sorted(shapes.items()))
            if key not in self._shapes:
                zeros = {n: np.zeros(shapes[n], _NP[t]) for n, (t, _) in self.inputs.items()}
                self._shapes[key] = {n: tuple(v.shape) for n, v in self.run(zeros).items()}
            return self._shapes[key]

    class Runtime:
        def __init__(self, logger: Logger) -> None:
            self.logger = logger

        def deserialize_cuda_engine(self, blob: bytes) -> CudaEngine | None:
            try:
                if not blob.startswith(ENGINE_MAGIC):
                    raise ValueError("not a serialized engine")
                n = int.from_bytes(blob[len(ENGINE_MAGIC):len(ENGINE_MAGIC) + 8], "little")
                start = len(ENGINE_MAGIC) + 8
                header = json.loads(blob[start:start + n])
                model = blob[start + n:]
                onnx.load_from_string(model)  # a truncated plan fails here
            except Exception as e:  # noqa: BLE001 - any damage means "could not be deserialized"
                error(f"IRuntime::deserializeCudaEngine: {e}")
                return None
            if header["version"] != version:
                error(f"The engine plan file is not compatible with this version of TensorRT, expecting library "
                      f"version {version} got {header['version']}")
                return None
            if header["device_cc"] != cudart.compute_capability(cudart.current):
                error(f"The engine plan file is generated on an incompatible device (sm {header['device_cc']}, "
                      f"current sm {cudart.compute_capability(cudart.current)})")
                return None
            return CudaEngine(header, model)

    return types.SimpleNamespace(
        __version__=f"{version}+sim", __doc__="SIMULATED tensorrt (tests/sim_tensorrt.py): not TensorRT",
        simulated=True, cudart=cudart, log=log, calls=calls, nptype=nptype, DataType=DataType,
        TensorIOMode=TensorIOMode, NetworkDefinitionCreationFlag=NetworkDefinitionCreationFlag,
        BuilderFlag=BuilderFlag, MemoryPoolType=MemoryPoolType, Logger=Logger, Builder=Builder,
        OnnxParser=OnnxParser, Runtime=Runtime)


def simulated_backend(sim: types.SimpleNamespace | None = None, version: str = "10.13.0") -> TrtBackend:
    """TrtRunner's `backend=` for the simulation: its module + host-memory buffers on its simulated devices."""
    sim = sim or make_simulated_tensorrt(version)
    return TrtBackend(sim, lambda index: HostBuffers(index, sim.cudart), simulated=True)
