"""Runner registry: adding a backend = one module with a Runner subclass + one line here.

Entries are import paths, so optional backends (openvino, tensorrt, onnxruntime-gpu) are imported only when
selected. A runner spec is "name" or "name:variant", e.g. "ov:bf16", "torch:bf16", "ort-trt:fp16"."""

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
