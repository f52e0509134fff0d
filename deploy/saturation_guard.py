"""Refuse an int8 graph this CPU would compute wrongly, before a runtime compiles it.

On x86 without VNNI or AMX (AMD Zen 1-3, Intel before Cascade Lake) onnxruntime's and OpenVINO's int8 kernels add
adjacent u8*s8 products in saturating int16 (vpmaddubsw), so 8-bit int8 weights can be clipped into wrong outputs
(export/saturation.py; both runtimes measured as that class under QEMU in tests/test_emulate.py). The proof is read
from the weights themselves, never from the manifest (untrusted): the ONNX graph's (`weight_bound`, pairs along K as
MLAS takes them) or the OpenVINO int8 IR's (`ir_weight_bound`, any pairing), only on such a CPU and only for int8
artifacts. `allow_saturation=True` (a runner option) opts out. The ov runner does not refuse a static int8
artifact whose NNCF IR could saturate there: it compiles the artifact's 7-bit Q/DQ ONNX graph instead.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from xdeploy.core.errors import ParityError


def saturating_bound(artifact: Any, graph: str, fp: dict[str, Any] | None = None, *,
                     ir: Path | None = None) -> dict[str, Any] | None:
    """The weight bound of graph `graph` of `artifact` (the ONNX graph, or the OpenVINO IR at `ir`) when this CPU
    (`fp`: a fingerprint, default this machine's; tests model the other classes with it) would saturate it; None
    when it cannot (not int8, a class with int32 accumulation, or weights that cannot make a pair past int16)."""
    if artifact.precision not in ("int8", "int8-dynamic"):
        return None
    from xdeploy.core.fingerprint import fingerprint, int8_dot

    fp = fp if fp is not None else fingerprint()
    if int8_dot(fp) != "avx2":
        return None
    path = Path(ir) if ir is not None else artifact.onnx_path(graph)
    st = path.stat()
    bound = _bound(str(path), st.st_size, st.st_mtime_ns, ir is not None)
    return None if bound["portable"] else bound


def refuse_saturating_int8(artifact: Any, graph: str, fp: dict[str, Any] | None = None, *,
                           runtime: str = "onnxruntime", ir: Path | None = None) -> None:
    """Raise ParityError (exit 1: a verdict) when `runtime` on this CPU would saturate graph `graph` of `artifact`
    (`saturating_bound`)."""
    bound = saturating_bound(artifact, graph, fp, ir=ir)
    if bound is None:
        return
    from xdeploy.core.fingerprint import fingerprint, machine_class

    raise ParityError(
        f"graph {graph!r} of {artifact.path} has 8-bit int8 weights (a pair of products reaches "
        f"{bound['worst_pair_bound']} > {bound['limit']} at {bound['worst_node']}), which {runtime} on this CPU "
        f"({machine_class(fp if fp is not None else fingerprint())}: no VNNI or AMX) saturates into wrong "
        "outputs; expected an artifact exported with --int8-weight-bits 7 (the default) or int8-dynamic's "
        "default uint8 weights, or pass allow_saturation=True")


@functools.lru_cache(maxsize=32)
def _bound(path: str, size: int, mtime_ns: int, ir: bool) -> dict[str, Any]:
    """The bound of the graph file at `path`, once per file version (size, mtime): the Embedder and the benchmarks
    open several runners on one graph, and reading a base model's weights costs seconds."""
    from xdeploy.export import saturation

    if ir:
        from xdeploy.core.deps import import_quietly

        return saturation.ir_weight_bound(import_quietly("openvino").Core().read_model(path))
    import onnx

    return saturation.weight_bound(onnx.load(path))
