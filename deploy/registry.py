"""Runner registry: adding a backend = one module with a Runner subclass + one line here.

Entries are import paths, so optional backends (openvino, tensorrt, onnxruntime-gpu) are imported only when
selected. A runner spec is "name" or "name:variant", e.g. "ov:bf16", "torch:bf16", "ort-trt:fp16".

Each runner class declares what it can do (deploy/base.py: the variants computing in a precision of their own,
those needing a GPU, whether it runs the artifact's graph or is a layerwise runtime, what this machine lacks to
open it); code over "every runner" asks `specs` and `gaps` here, never a list of names, so a runner added here is
listed by `xdeploy doctor`, offered to verify/layerwise.py and contract-tested (tests/test_runners.py) as it is."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError, one_of
from xdeploy.export.artifact import Artifact, load_artifact

from .base import Runner

RUNNERS: dict[str, str] = {
    "torch": "xdeploy.deploy.torch_runner:TorchRunner",
    "ort": "xdeploy.deploy.ort_runner:OrtRunner",
    "ov": "xdeploy.deploy.ov_runner:OvRunner",
    "trt": "xdeploy.deploy.trt_runner:TrtRunner",
    "ort-cuda": "xdeploy.deploy.ort_gpu_runner:OrtCudaRunner",
    "ort-trt": "xdeploy.deploy.ort_gpu_runner:OrtTrtRunner",
}


def parse_spec(spec: str) -> tuple[str, str]:
    name, _, variant = spec.partition(":")
    if name not in RUNNERS:
        raise one_of("runner", name, RUNNERS)
    return name, variant


def check_spec(spec: str) -> tuple[str, str]:
    """parse_spec plus the variant: a misspelt spec ("ov:fp16") is an error before any runner is opened."""
    name, variant = parse_spec(spec)
    variants = runner_class(spec).variants
    if variant not in variants:
        raise XDeployError(f"runner {name!r} has no variant {variant!r}; expected {name} or "
                           f"{', '.join(f'{name}:{v}' for v in variants if v)}" if any(variants) else
                           f"runner {name!r} takes no variant; expected {name}")
    return name, variant


def runner_class(spec: str) -> type[Runner]:
    name, _ = parse_spec(spec)
    module, _, cls = RUNNERS[name].partition(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise XDeployError(f"runner {name!r} is not available: {e}") from None


def open_runner(spec: str, artifact: Artifact | str | Path, graph: str = "model", **options: Any) -> Runner:
    if not isinstance(artifact, Artifact):
        artifact = load_artifact(artifact)
    _, variant = parse_spec(spec)
    return runner_class(spec)(artifact, graph, variant=variant, **options)


def open_reference(artifact: Artifact, graph: str = "model", **options: Any) -> Runner:
    """The reference every check compares with: the torch runner (PyTorch fp32 on the artifact's reference
    weights), or for a foreign ONNX model (export/foreign.py) onnxruntime CPU on its fp32 graph (Polygraphy-style)."""
    from xdeploy.export.foreign import reference_source

    src = reference_source(artifact)
    return open_runner("torch" if src is None else "ort", artifact if src is None else src, graph, **options)


def reference_name(artifact: Artifact) -> str:
    """What `open_reference` runs, in words (parity tables, probe sections)."""
    return "torch fp32" if artifact.foreign is None else "onnxruntime CPU fp32 (the foreign graph's fp32 source)"


def reference_outputs(artifact: Artifact, graph: str, feeds: list[dict[str, Any]], **options: Any) -> list[Any]:
    """The reference's outputs for each of `feeds` (export/convert.py's golden probes of a foreign graph)."""
    with open_reference(artifact, graph, **options) as r:
        return [r.infer(f) for f in feeds]


def specs(*, runs_graph: bool | None = None, layerwise: bool | None = None) -> list[str]:
    """The distinct specs of every registered runner (registry order) with the given capabilities: its default and
    each variant computing in a precision of its own ("ov", "ov:bf16"; an alias such as "ov:f32" is left out)."""
    out = []
    for name in RUNNERS:
        cls = runner_class(name)
        if runs_graph in (None, cls.runs_graph) and layerwise in (None, cls.layerwise):
            out += [name, *(f"{name}:{v}" for v in cls.variant_precisions)]
    return out


def compute_precision(spec: str) -> str | None:
    """The precision `spec` computes in when it is its own ("ov:bf16" -> "bf16"); None: the artifact's."""
    _, variant = parse_spec(spec)
    return runner_class(spec).variant_precisions.get(variant)


def needs_gpu(spec: str) -> bool:
    _, variant = parse_spec(spec)
    return variant in runner_class(spec).gpu_variants


def gaps(spec: str) -> list[str]:
    """What this machine lacks to open `spec` ([] = nothing), without opening it or importing its backend."""
    _, variant = check_spec(spec)
    return runner_class(spec).gaps(variant)
