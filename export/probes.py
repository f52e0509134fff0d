"""Golden probes: a few tiny inputs per graph and the PyTorch fp32 outputs for them, written into every artifact
at export so that the artifact can check itself wherever it runs (deploy/probes.py: `xdeploy verify`, and the
Embedder, the Generator and `xdeploy serve` on first open), without PyTorch.

    <dir>/probes/probes.npz            every case's inputs and reference outputs, keys "<case>/in/<name>" and
                                       "<case>/out/<name>" (np.savez_compressed; read with allow_pickle=False)
    <dir>/probes/raw/<case>.<in|out>.<name>.bin
                                       text encoders only: graph "model"'s cases again as raw little-endian
                                       arrays, for the C++ runtime (deploy/cpp), which parses no .npz
    manifest["probes"] = {"file": "probes/probes.npz", "reference": ..., "seed": ..., "graphs": [...],
                          "cases": [{"graph", "name", "sizes", "inputs": {name: {"dtype", "shape"}},
                                     "outputs": {...}, "raw": {name: file} (text encoders' graph "model")}]}

The cases are parity's shape cases (models/spec.py `shape_cases`) at two small shapes: batch 1, and batch 2 with
its last row right-padded to half length. References come from the module the graphs are exported from, through
the torch runner's own call (models/reference.py), so they are what parity calls the reference. `convert` copies
the files and the section unchanged: a derived fp16/int8 artifact is judged against the same fp32 references
(with its own precision's tolerance).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from xdeploy.models.spec import ExportSpec, InputCase, shape_cases

SECTION = "probes"  # the manifest section
FILE = "probes/probes.npz"
RAW_DIR = "probes/raw"
# (batch, every other axis): short enough to cost little to store and run (GPT-2 small's logits are the largest:
# ~8 MB uncompressed for both cases), long enough that one flipped argmax of a logits output does not fail int8's
# top-1 threshold on its own (deploy/verdict.py TOP1_MIN); the batch-2 case pads its last row.
SHAPES: tuple[tuple[int, int], ...] = ((1, 16), (2, 11))
SEED = 1000  # fixed, and apart from parity's seeds (0, 1, 2, ...): the probes are not parity's own inputs


def key(case: int, kind: str, name: str) -> str:
    """The .npz key of one tensor: case index, "in" or "out", tensor name."""
    return f"{case}/{kind}/{name}"


def raw_file(case: int, kind: str, name: str) -> str:
    return f"{RAW_DIR}/{case}.{kind}.{name}.bin"


def probe_cases(spec: ExportSpec, graphs: Sequence[str] | None = None) -> list[InputCase]:
    """The probe inputs of each graph of `spec` (or of `graphs`), in graph order."""
    return [c for g in spec.graphs if graphs is None or g.name in graphs
            for c in shape_cases(spec, g, SHAPES, seed=SEED)]


def reference_outputs(module: Any, spec: ExportSpec, cases: Sequence[InputCase]) -> list[dict[str, np.ndarray]]:
    """The PyTorch fp32 outputs of each case: the torch runner's call (models/reference.py) on `module`."""
    import torch

    from xdeploy.models.reference import graph_outputs

    refs = []
    with torch.inference_mode():
        for c in cases:
            g = spec.graph(c.graph)
            refs.append(graph_outputs(getattr(module, g.method), g, [torch.from_numpy(c.feeds[t.name])
                                                                     for t in g.inputs]))
    return refs


def _shapes(arrays: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    return {n: {"dtype": str(a.dtype), "shape": list(a.shape)} for n, a in arrays.items()}


# reference(graph name, [feeds, ...]) -> [outputs, ...]: the outputs of a reference other than a torch module
# (a foreign graph's: onnxruntime CPU fp32 on its fp32 graph, deploy/registry.py reference_outputs)
Reference = Callable[[str, list[dict[str, np.ndarray]]], list[dict[str, np.ndarray]]]


def write_probes(w: Any, spec: ExportSpec, module: Any, *, raw: bool = False, reference: Reference | None = None,
                 reference_name: str = "torch fp32 (the module the graphs were exported from)") -> dict[str, Any]:
    """Compute the probes of every graph of `spec` from `module` (fp32, eval), or with `module=None` from
    `reference`, and add them to the artifact being written by `w` (export/writer.py's ArtifactWriter): the .npz,
    and with `raw` (a text encoder: the C++ runtime runs it) graph "model"'s cases as raw files too. Returns the
    manifest section."""
    cases = probe_cases(spec)
    if module is not None:
        refs = reference_outputs(module, spec, cases)
    else:
        assert reference is not None, "write_probes needs a module or a reference"
        refs = []
        for g in spec.graphs:
            mine = [c for c in cases if c.graph == g.name]
            refs += reference(g.name, [c.feeds for c in mine]) if mine else []
    arrays: dict[str, np.ndarray] = {}
    records = []
    for i, (c, ref) in enumerate(zip(cases, refs)):
        arrays |= {key(i, "in", n): a for n, a in c.feeds.items()} | {key(i, "out", n): a for n, a in ref.items()}
        rec: dict[str, Any] = {"graph": c.graph, "name": c.name, "sizes": dict(c.sizes), "inputs": _shapes(c.feeds),
                               "outputs": _shapes(ref)}
        if raw and c.graph == "model":
            rec["raw"] = {}
            for kind, tensors in (("in", c.feeds), ("out", ref)):
                for n, a in tensors.items():
                    rec["raw"][n] = raw_file(i, kind, n)
                    # little-endian, C order: what the C++ runtime reads with the manifest's dtype and shape
                    w.add_file(rec["raw"][n], np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes())
        records.append(rec)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    w.add_file(FILE, buf.getvalue())
    section = {"file": FILE, "reference": reference_name, "seed": SEED,
               "graphs": [g.name for g in spec.graphs], "cases": records}
    w.add_section(SECTION, section)
    return section
