"""Precision conversion of exported graphs. fp32 is the exported graph itself."""

from __future__ import annotations

from typing import Any

import onnx

from xdeploy.errors import one_of
from xdeploy.models.spec import ExportSpec, Graph

EXPORT_PRECISIONS = ("fp32",)


def check_precision(precision: str) -> None:
    if precision not in EXPORT_PRECISIONS:
        raise one_of("export precision", precision, EXPORT_PRECISIONS)


def convert(proto: onnx.ModelProto, precision: str, *, graph: Graph, spec: ExportSpec
            ) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Return the graph at `precision` and a record of what the conversion did (kept-fp32 nodes, counts)."""
    check_precision(precision)
    return proto, {"precision": precision, "kept_fp32": [], "fused_ops": {}}
