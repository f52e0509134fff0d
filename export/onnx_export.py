"""PyTorch -> ONNX with the dynamo exporter, one artifact directory per export (see artifact.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import platform
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import onnx
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

import xdeploy
from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import atomic_dir, atomic_write_json, sha256_file
from xdeploy.models import registry
from xdeploy.models.spec import ExportSpec, Graph

from .artifact import FORMAT, MANIFEST, SCHEMA_VERSION, spec_to_json, write_manifest_files

SUPPORTED_OPSETS = (18, 23)  # 18: attention as MatMul/Softmax; 23: the native ONNX Attention op
DEFAULT_OPSET = 23  # by measurement (python -m xdeploy.studies.export_lowering; docs/export.md)
DEFAULT_OPTIMIZE = False  # by measurement, and fused com.microsoft ops would tie the artifact to onnxruntime
TWO_GB = 2**31


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


def set_metadata(proto: onnx.ModelProto, fields: dict[str, Any]) -> None:
    """Mirror key manifest fields into metadata_props, for runtimes that only see the .onnx file."""
    del proto.metadata_props[:]
    for k, v in fields.items():
        proto.metadata_props.add(key=f"xdeploy.{k}", value=str(v))
    proto.producer_name, proto.producer_version = "xdeploy", xdeploy.__version__


def save_onnx(proto: onnx.ModelProto, path: Path) -> None:
    """Check fully (with shape inference) and save; weights go to <name>.data when the model exceeds 2 GB."""
    large = proto.ByteSize() >= TWO_GB
    try:
        if not large:
            onnx.checker.check_model(proto, full_check=True)
    except onnx.checker.ValidationError as e:
        raise XDeployError(f"exported graph {path.name} failed the ONNX checker: {str(e).splitlines()[0]}") from e
    onnx.save_model(proto, str(path), save_as_external_data=large, all_tensors_to_one_file=True,
                    location=f"{path.name}.data" if large else None)
    if large:
        onnx.checker.check_model(str(path), full_check=True)


def library_versions() -> dict[str, str]:
    import numpy
    import onnxruntime

    return {"xdeploy": xdeploy.__version__, "python": platform.python_version(), "torch": torch.__version__,
            "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "numpy": numpy.__version__}


def export(model: str, *, preset: str | None = None, checkpoint: str | Path | None = None, out: str | Path,
           opset: int = DEFAULT_OPSET, precision: str = "fp32", force: bool = False,
           attn_impl: str | None = None, seed: int = 0, optimize: bool = DEFAULT_OPTIMIZE, opt_level: int = 1,
           precision_options: Any = None, config_overrides: dict[str, Any] | None = None) -> Path:
    """Export every graph of `model` into the artifact directory `out` (written atomically).

    `config_overrides` replaces preset config fields (e.g. {"max_positions": 4096} for scaling runs); the
    manifest records the resulting config.

    `optimize` applies onnxruntime's offline optimizations and transformer fusions (export/optimize.py) before
    the precision conversion (export/precision.py; `precision_options` is a `PrecisionOptions`)."""
    from . import precision as prec
    from .convert import convert_graph

    if opset not in SUPPORTED_OPSETS:
        raise XDeployError(f"unsupported opset {opset}; expected one of: {', '.join(map(str, SUPPORTED_OPSETS))}")
    prec.check_precision(precision)
    family = registry.get_family(model)
    tokenizer_files: list[Path] = []
    pooling = None
    if checkpoint is not None:
        from xdeploy.models.checkpoint import load_checkpoint

        ck = load_checkpoint(checkpoint)
        if ck.model != family.name:
            raise XDeployError(f"checkpoint {checkpoint} holds a {ck.model} model, not {family.name}")
        cfg = ck.config if attn_impl is None else dataclasses.replace(ck.config, attn_impl=attn_impl)
        module = family.build(cfg).eval()
        module.load_state_dict(ck.module.state_dict())
        tokenizer_files, pooling = ck.tokenizer_files, ck.pooling
        source = {"kind": ck.kind, "checkpoint": str(Path(checkpoint).resolve()), "sha256": ck.sha256}
    else:
        preset = preset or next(iter(family.presets))
        cfg = registry.get_config(family.name, preset, attn_impl=attn_impl, **(config_overrides or {}))
        module = registry.build(family.name, cfg, seed=seed)
        source = {"kind": "preset", "preset": preset, "seed": seed}
    spec = family.spec(cfg)
    out = Path(out)
    t0 = time.perf_counter()
    with atomic_dir(out, force=force) as tmp:
        (tmp / "reference").mkdir()
        state = {k: v.contiguous() for k, v in module.state_dict().items()}
        try:
            save_file(state, str(tmp / "reference" / "model.safetensors"))
        except SafetensorError as e:  # e.g. a full disk: not an OSError, so say it here
            raise XDeployError(f"cannot write {out}: {e}") from None
        source["weights_sha256"] = sha256_file(tmp / "reference" / "model.safetensors")
        files: dict[str, str] = {}
        conversion: dict[str, Any] = {}
        meta = {"model": family.name, "preset": preset or "", "precision": precision, "opset": opset,
                "optimized": optimize,
                "schema_version": SCHEMA_VERSION, "source_sha256": source.get("sha256", source["weights_sha256"])}
        with torch.no_grad():
            for graph in spec.graphs:
                proto = export_graph(module, graph, spec, opset)
                proto, info = convert_graph(proto, precision, graph=graph, spec=spec, model=family.name, config=cfg,
                                            optimize=optimize, opt_level=opt_level, options=precision_options)
                conversion[graph.name] = info
                set_metadata(proto, meta | {"graph": graph.name,
                                            "inputs": ",".join(t.name for t in graph.inputs),
                                            "outputs": ",".join(t.name for t in graph.outputs)})
                files[graph.name] = f"{graph.name}.onnx"
                save_onnx(proto, tmp / files[graph.name])
        prec.check_requested_nodes(precision, precision_options, conversion)
        if tokenizer_files:
            (tmp / "tokenizer").mkdir()
            for f in tokenizer_files:
                shutil.copy2(f, tmp / "tokenizer" / f.name)
        graphs, axes, tols = spec_to_json(spec, files)
        manifest: dict[str, Any] = {
            "format": FORMAT, "schema_version": SCHEMA_VERSION, "model": family.name, "preset": preset,
            "source": source, "config": dataclasses.asdict(cfg), "precision": precision, "opset": opset,
            "attn_impl": cfg.attn_impl, "optimized": optimize, "graphs": graphs, "axes": axes, "tolerances": tols,
            "conversion": conversion,
            "pooling": dataclasses.asdict(pooling) if pooling else None,
            "versions": library_versions(), "export_seconds": round(time.perf_counter() - t0, 3),
        }
        write_manifest_files(tmp, manifest)
        atomic_write_json(tmp / MANIFEST, manifest)
    return out
