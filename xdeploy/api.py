"""The public Python API in one import: `from xdeploy import api`.

Everything a user script needs, re-exported from the layer that owns it (the CLI is thin over these):

    art = api.export("bert", preset="minilm", precision="fp32", out="artifacts/bert")   # -> artifact path
    q = api.convert_artifact(art, "artifacts/bert-int8", "int8")                        # static Q/DQ int8
    with api.open_runner("ort", art) as r: ...                                          # any runner spec
    report = api.check_artifact(art, ["ort", "ov"])                                     # parity vs PyTorch
    probes = api.verify_artifact(art, "ov")                                             # golden probes, here
    api.run_job(api.RunConfig(out="reports/latest"))                                    # the main job
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from xdeploy.deploy.embedder import Embedder
from xdeploy.deploy.generate import GenerationConfig, Generator
from xdeploy.deploy.probes import ProbeFailure, verify_artifact
from xdeploy.deploy.registry import open_runner, reference_outputs
from xdeploy.deploy.tokenizer_graph import tokenizer_graph_builder
from xdeploy.export import convert as _convert
from xdeploy.export.artifact import Artifact, load_artifact
from xdeploy.models.spec import make_feeds
from xdeploy.pipeline import RunConfig, RunResult, run_job
from xdeploy.verify.parity import ParityReport, check_artifact
from xdeploy.verify.sensitivity import check_int8_ir as _check_int8_ir
from xdeploy.verify.sensitivity import refine as _refine

__all__ = [
    "Artifact", "Embedder", "GenerationConfig", "Generator", "ParityReport", "ProbeFailure", "RunConfig", "RunResult",
    "check_artifact", "convert_artifact", "export", "load_artifact", "make_feeds", "open_runner", "run_job",
    "tokenizer_graph_builder", "verify_artifact",
]


def export(model: str, *, measured: bool = True, cache: bool = True, fresh: bool = False,
           log: Callable[[str], None] | None = None, **kwargs: Any) -> Path:
    """Export `model` to an artifact (export/onnx_export.py `export`, same arguments), with the measured
    refinement of reduced precisions (verify/sensitivity.py): fp16 automatic mixed precision and int8
    sensitivity keep the nodes that break the tolerance in floating point. `measured=False`: the plain
    transform with the requested keep lists only.

    The export cache (export/cache.py `cached_export`, $XDEPLOY_CACHE/exports): an export with the same model,
    options, library versions and xdeploy source as an earlier one copies that result into `out` (verified)
    instead of running torch again; a miss still reuses each graph's torch.onnx trace from any earlier export of
    the same module (the trace cache). `fresh` exports anyway and refreshes the entries; `cache=False` neither
    reads nor writes them. `log` receives one line when the cache is used."""
    from xdeploy.export.cache import cached_export

    def run() -> Path:
        from xdeploy.export import onnx_export as _onnx_export  # imports torch: only when exporting

        trace_cache = "off" if not cache else "refresh" if fresh else "use"
        return _onnx_export.export(model, refine=_refine if measured else None, trace_cache=trace_cache, **kwargs)

    if not cache:
        return run()
    return cached_export(model, {"measured": measured, **kwargs}, run, fresh=fresh, log=log)


def convert_artifact(src: str | Path, out: str | Path, precision: str, *, measured: bool = True,
                     **kwargs: Any) -> Path:
    """Derive an artifact at `precision` from an fp32 one (export/convert.py `convert_artifact`), with the
    measured refinement as in `export`; static int8 from an fp32 artifact with an OpenVINO IR also carries an
    NNCF int8 IR when it passes its measured check (verify/sensitivity.py `check_int8_ir`; `check_ir=` to pass
    another, e.g. with a different tolerance). `measured=False`: neither (no IR without its check)."""
    kwargs.setdefault("check_ir", _check_int8_ir if measured else None)
    kwargs.setdefault("reference", reference_outputs)  # a foreign graph's golden probes: onnxruntime CPU fp32
    return _convert.convert_artifact(src, out, precision, refine=_refine if measured else None, **kwargs)
