"""Pure TensorRT logic (no tensorrt / CUDA import): optimization profiles from the manifest's dynamic axes,
the engine cache key and layout, the builder's precision plan, and the equivalent `trtexec` command line.

The hardware side (deploy/trt_runner.py) and the onnxruntime TensorRT provider (deploy/ort_gpu_runner.py)
both use these, so what they build is decided here, where CPU tests can check it.

Engine cache layout, under a cache root (default: the project's one cache root, export/cache.py `cache_root()`
= $XDEPLOY_CACHE or ~/.cache/xdeploy, then trt/):

    <root>/<model>-<graph>-<precision>-<key[:16]>/engine.plan   serialized engine
                                                 /engine.json  the key and every field it was made from
                                                 /trtexec.sh   the equivalent trtexec command line
    <root>/timing-trt<version>-<gpu>-sm<cc>.cache              timing cache, shared by every model on that GPU
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import atomic_write_bytes, atomic_write_json, atomic_write_text
from xdeploy.export.cache import cache_root
from xdeploy.models.spec import Axis, Graph

Shape = tuple[int, ...]


@dataclass(frozen=True)
class ShapeRange:
    """One input's optimization-profile shapes (TensorRT IOptimizationProfile.set_shape(name, min, opt, max))."""

    name: str
    min: Shape
    opt: Shape
    max: Shape


@dataclass(frozen=True)
class BuildPlan:
    """How the network is created: strongly typed (precision comes from the ONNX tensors' types) or weakly
    typed with the FP16 builder flag (TensorRT 10 only: 11 removed BuilderFlag.FP16 and weak typing)."""

    strongly_typed: bool
    fp16_flag: bool
    precision: str  # what the engine computes in: fp32 | fp16 | int8
    # TensorRT enables TF32 for fp32 tensors by default (NvInfer.h BuilderFlag::kTF32 "Enabled by default"): inner
    # products then round inputs to 10-bit mantissas. False = the builder clears the flag, so fp32 tensors (all of
    # an fp32 artifact, the fp32 islands of fp16/int8 ones) compute in fp32. Part of the engine key.
    tf32: bool = False


@dataclass(frozen=True)
class EngineKey:
    """Everything an engine depends on. A cached engine is reused only when all of it matches."""

    onnx_sha256: str
    trt_version: str
    gpu_name: str
    compute_capability: str  # "8.9"
    profiles: tuple[ShapeRange, ...]
    plan: BuildPlan
    workspace_mib: int = 0  # 0 = TensorRT's default (all device memory)

    @property
    def digest(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


def profile_shapes(graph: Graph, axes: Mapping[str, Axis]) -> tuple[ShapeRange, ...]:
    """min/opt/max shapes of every graph input: each named dim takes its axis' min/opt/max, fixed dims stay.

    Inputs sharing an axis (input_ids and attention_mask share batch and seq) get equal sizes at each of
    min/opt/max, so the profile is consistent with the shape relations the graph itself requires."""
    out = []
    for t in graph.inputs:
        missing = [d for d in t.dims if isinstance(d, str) and d not in axes]
        if missing:
            raise XDeployError(f"input {t.name!r} uses axis {missing[0]!r} that the manifest does not declare")

        def at(which: str, dims: Sequence[str | int] = t.dims) -> Shape:
            return tuple(d if isinstance(d, int) else int(getattr(axes[d], which)) for d in dims)

        out.append(ShapeRange(t.name, at("min"), at("opt"), at("max")))
    return tuple(out)


def format_shapes(profiles: Sequence[ShapeRange], which: str) -> str:
    """`name:1x128,name2:1x128` -- the syntax of trtexec --minShapes/--optShapes/--maxShapes and of the
    onnxruntime TensorRT provider's trt_profile_{min,opt,max}_shapes options."""
    if which not in ("min", "opt", "max"):
        raise ValueError(which)
    return ",".join(f"{p.name}:{'x'.join(map(str, getattr(p, which)))}" for p in profiles)


def trt_major(version: str) -> int:
    m = re.match(r"(\d+)\.", version)
    if not m:
        raise XDeployError(f"cannot read a TensorRT major version from {version!r}")
    return int(m.group(1))


def build_plan(variant: str, artifact_precision: str, *, has_fp16_flag: bool) -> BuildPlan:
    """Decide strong typing and the FP16 flag.

    "" -> strongly typed: the engine computes in the artifact's precision (an fp16 artifact gives an fp16
    engine; an int8 one must be a Q/DQ graph: explicit quantization, no INT8 flag and no calibrator).
    "fp16" on an fp32 artifact -> weak typing + BuilderFlag.FP16 where that flag still exists (TensorRT 10);
    TensorRT 11 has none, so the user must export at fp16. TF32 is off in every plan (see BuildPlan.tf32)."""
    if variant not in ("", "fp16"):
        raise XDeployError(f"runner 'trt' has no variant {variant!r}; expected one of: '', 'fp16'")
    if variant == "" or artifact_precision == "fp16":
        return BuildPlan(strongly_typed=True, fp16_flag=False, precision=artifact_precision)
    if artifact_precision != "fp32":
        raise XDeployError(f"trt:fp16 needs an fp32 or fp16 artifact; this one is {artifact_precision}")
    if not has_fp16_flag:
        raise XDeployError("this TensorRT has no FP16 builder flag (TensorRT 11 removed weak typing); export "
                           "the artifact with --precision fp16 and use runner 'trt'")
    return BuildPlan(strongly_typed=False, fp16_flag=True, precision="fp16")


DYNAMIC_INT8_OPS = frozenset({"DynamicQuantizeLinear", "MatMulInteger", "ConvInteger"})
QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


def int8_format(onnx_path: str | Path) -> str | None:
    """How an ONNX graph is quantized: "qdq" (static Q/DQ nodes: TensorRT's explicit quantization), "dynamic"
    (onnxruntime dynamic quantization, which TensorRT has no importer for), or None (no quantization ops).
    Reads the graph only (external weights are not loaded)."""
    import onnx

    ops = {n.op_type for n in onnx.load(str(onnx_path), load_external_data=False).graph.node}
    if ops & DYNAMIC_INT8_OPS:
        return "dynamic"
    return "qdq" if ops & QDQ_OPS else None


def default_cache_root() -> Path:
    """<cache root>/trt: engines live beside the artifact and roofline caches ($XDEPLOY_CACHE moves them all)."""
    return cache_root() / "trt"


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", s).strip("-").lower() or "unknown"


def engine_dir(root: str | Path, model: str, graph: str, precision: str, key: EngineKey) -> Path:
    return Path(root) / f"{_slug(model)}-{_slug(graph)}-{precision}-{key.digest[:16]}"


def timing_cache_path(root: str | Path, trt_version: str, gpu_name: str, compute_capability: str) -> Path:
    """Timing caches hold per-GPU kernel timings, valid for any model on the same GPU and TensorRT version."""
    return Path(root) / f"timing-trt{_slug(trt_version)}-{_slug(gpu_name)}-sm{_slug(compute_capability)}.cache"


def cached_engine_is_current(directory: Path, key: EngineKey) -> bool:
    """True when directory holds an engine built under exactly this key (else it must be rebuilt)."""
    try:
        meta = json.loads((directory / "engine.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("key") == key.digest and (directory / "engine.plan").is_file()


def engine_record(key: EngineKey) -> dict[str, Any]:
    """engine.json: the key and what it was computed from (lets a human see why an engine was rebuilt)."""
    return {"key": key.digest, **asdict(key)}


def trtexec_command(onnx_path: str | Path, engine_path: str | Path, profiles: Sequence[ShapeRange],
                    plan: BuildPlan, trt_version: str, *, timing_cache: str | Path | None = None,
                    workspace_mib: int = 0) -> list[str]:
    """The trtexec invocation that builds the same engine (argv list; shlex.join it for a shell).

    TensorRT 11 is always strongly typed: it has no --fp16, and accepts --stronglyTyped only as a deprecated
    no-op (samples/common/sampleOptions.cpp on main), so the flag is written for 10.x only. --noTF32 whenever
    the plan keeps fp32 at fp32 (trtexec enables TF32 by default on both)."""
    cmd = ["trtexec", f"--onnx={onnx_path}", f"--saveEngine={engine_path}"]
    if any(p.min != p.max for p in profiles):  # static graphs need no profile
        cmd += [f"--minShapes={format_shapes(profiles, 'min')}", f"--optShapes={format_shapes(profiles, 'opt')}",
                f"--maxShapes={format_shapes(profiles, 'max')}"]
    if trt_major(trt_version) < 11:
        if plan.strongly_typed:
            cmd.append("--stronglyTyped")
        elif plan.fp16_flag:
            cmd.append("--fp16")
    elif plan.fp16_flag:
        raise XDeployError("TensorRT 11 has no --fp16; the plan must be strongly typed")
    if not plan.tf32:
        cmd.append("--noTF32")
    if timing_cache is not None:
        cmd.append(f"--timingCacheFile={timing_cache}")
    if workspace_mib:
        cmd.append(f"--memPoolSize=workspace:{workspace_mib}M")
    return cmd


def trtexec_script(cmd: Sequence[str]) -> str:
    return "#!/bin/sh\n# The trtexec command that builds the same engine as xdeploy's trt runner.\n" \
           + shlex.join(cmd) + "\n"


def cached_engine(directory: str | Path, key: EngineKey, build: Callable[[], bytes],
                  trtexec: Sequence[str] | None = None) -> tuple[bytes, bool]:
    """The serialized engine for `key`: read from `directory` when it was built under the same key, else
    built with `build()` and written (engine.plan, engine.json, trtexec.sh; each atomically). Returns the
    engine bytes and whether a build happened."""
    directory = Path(directory)
    if cached_engine_is_current(directory, key):
        return (directory / "engine.plan").read_bytes(), False
    blob = build()
    atomic_write_bytes(directory / "engine.plan", blob)
    if trtexec is not None:
        atomic_write_text(directory / "trtexec.sh", trtexec_script(trtexec))
    atomic_write_json(directory / "engine.json", engine_record(key))  # last: marks the directory complete
    return blob, True
