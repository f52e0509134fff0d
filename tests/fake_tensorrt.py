"""A FAKE `tensorrt` module for CPU tests of OUR logic around TensorRT (network flags, FP16 flag gating,
profiles, timing-cache round trip, parse-error reporting). It builds nothing: passing tests with it says
nothing about TensorRT itself, which is verified only by the `gpu`-marked tests on an NVIDIA machine.

    trt = make_fake_tensorrt("10.13.0")     # 10.x: has BuilderFlag.FP16
    trt = make_fake_tensorrt("11.4.0")      # 11.x: BuilderFlag.FP16 removed (as in the real 11.x API)
    trt.calls                               # what our code asked the "builder" for
"""

from __future__ import annotations

import enum
import json
import types
from typing import Any


def make_fake_tensorrt(version: str = "10.13.0") -> types.SimpleNamespace:
    calls: dict[str, Any] = {"profiles": [], "flags": [], "timing_cache_in": None, "builds": 0}
    major = int(version.split(".")[0])

    class NetworkDefinitionCreationFlag(enum.IntEnum):
        STRONGLY_TYPED = 5

    builder_flags = {"TF32": 7} if major >= 11 else {"FP16": 0, "INT8": 1, "TF32": 7}
    BuilderFlag = enum.IntEnum("BuilderFlag", builder_flags)

    class MemoryPoolType(enum.IntEnum):
        WORKSPACE = 0

    class Logger:
        WARNING = 2

        def __init__(self, severity: int) -> None:
            self.severity = severity

    class Network:
        def __init__(self, flags: int) -> None:
            self.flags = flags

    class Profile:
        def __init__(self) -> None:
            self.shapes: dict[str, tuple] = {}

        def set_shape(self, name: str, mn: tuple, opt: tuple, mx: tuple) -> None:
            self.shapes[name] = (tuple(mn), tuple(opt), tuple(mx))

    class TimingCache:
        def __init__(self, blob: bytes) -> None:
            self.entries = json.loads(blob) if blob else []

        def serialize(self) -> bytes:
            return json.dumps(self.entries).encode()

    class Config:
        def __init__(self) -> None:
            self.profiles: list[Profile] = []
            self.cache: TimingCache | None = None
            self.pool: dict[Any, int] = {}

        def set_flag(self, flag: Any) -> None:
            calls["flags"].append(flag.name)

        def set_memory_pool_limit(self, pool: Any, size: int) -> None:
            self.pool[pool] = size

        def add_optimization_profile(self, p: Profile) -> int:
            self.profiles.append(p)
            return len(self.profiles) - 1

        def create_timing_cache(self, blob: bytes) -> TimingCache:
            calls["timing_cache_in"] = bytes(blob)
            return TimingCache(blob)

        def set_timing_cache(self, cache: TimingCache, ignore_mismatch: bool) -> bool:
            self.cache = cache
            return True

        def get_timing_cache(self) -> TimingCache:
            assert self.cache is not None
            return self.cache

    class Builder:
        def __init__(self, logger: Logger) -> None:
            self.logger = logger

        def create_network(self, flags: int = 0) -> Network:
            calls["network_flags"] = flags
            return Network(flags)

        def create_builder_config(self) -> Config:
            return Config()

        def create_optimization_profile(self) -> Profile:
            return Profile()

        def build_serialized_network(self, network: Network, config: Config) -> bytes:
            calls["builds"] += 1
            calls["profiles"] = [p.shapes for p in config.profiles]
            calls["workspace"] = config.pool.get(MemoryPoolType.WORKSPACE, 0)
            assert config.cache is not None
            config.cache.entries.append(f"tactic-{calls['builds']}")  # builds add timings to the cache
            return json.dumps({"fake_engine": True, "flags": network.flags, "build": calls["builds"]}).encode()

    class OnnxParser:
        def __init__(self, network: Network, logger: Logger) -> None:
            self.errors: list[str] = []

        def parse_from_file(self, path: str) -> bool:
            with open(path, "rb") as f:
                head = f.read(64)
            if head.startswith(b"BAD"):
                self.errors = ["In node 3 (MatMulInteger): UNSUPPORTED_NODE: no importer registered"]
                return False
            return True

        @property
        def num_errors(self) -> int:
            return len(self.errors)

        def get_error(self, i: int) -> str:
            return self.errors[i]

    return types.SimpleNamespace(
        __version__=version, calls=calls, NetworkDefinitionCreationFlag=NetworkDefinitionCreationFlag,
        BuilderFlag=BuilderFlag, MemoryPoolType=MemoryPoolType, Logger=Logger, Builder=Builder,
        OnnxParser=OnnxParser)
