"""The main job's artifact set: one artifact per precision of a model, fp32 through the torch exporter (via the
export cache), the others converted from it (export/convert.py). Apart from convert.py and cache.py, which the
torch exporter imports: this module imports all three."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import precision as prec
from .cache import cached_export
from .convert import convert_artifact


def export_precisions(model: str, preset: str, root: str | Path, precisions: Sequence[str], *,
                      openvino_ir: bool = False, fresh: bool = False, refine: prec.Refiner | None = None,
                      each: Callable[[str, Path, Callable[[], Path]], Path] | None = None) -> dict[str, Path]:
    """One artifact per precision, `root`/MODEL-PRESET-PRECISION: fp32 through the torch exporter (with the
    OpenVINO IR when `openvino_ir`), the others converted from it with the measured refinement `refine` (fp16
    AMP, int8 sensitivity), as `xdeploy convert` does: no second torch export. An identical earlier fp32 export
    (same key as api.export(..., measured=False)) is copied from the export cache and verified; `fresh` exports
    again. `each(what, out, export)` runs each export (what: "MODEL PRESET PRECISION"; the main job's progress
    step and journal, which may return an artifact it already has instead of calling export)."""
    paths: dict[str, Path] = {}
    for precision in precisions:  # fp32 first: the others are converted from it
        out = Path(root) / f"{model}-{preset}-{precision}"
        one = functools.partial(_export_one, model, preset, precision, out, paths, openvino_ir, fresh, refine)
        paths[precision] = each(f"{model} {preset} {precision}", out, one) if each else one()
    return paths


def _export_one(model: str, preset: str, precision: str, out: Path, paths: dict[str, Path], openvino_ir: bool,
                fresh: bool, refine: prec.Refiner | None) -> Path:
    if precision == "fp32":
        return cached_export(model, {"measured": False, "preset": preset, "out": out, "force": True,
                                     "openvino_ir": openvino_ir},
                             functools.partial(_torch_export, model, preset=preset, out=out, force=True,
                                               openvino_ir=openvino_ir), fresh=fresh)
    return convert_artifact(paths["fp32"], out, precision, force=True, refine=refine)


def _torch_export(*a: Any, **k: Any) -> Path:
    from .onnx_export import export  # imports torch: only on a cache miss

    return export(*a, **k)
