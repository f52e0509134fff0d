"""Graphs another exporter made - a plain `torch.onnx.export` file, an Optimum or sentence-transformers export
directory, a model zoo's .onnx - as artifact views, so every command takes them like its own artifacts:

    art = load_artifact("exports/bert/model.onnx")        # -> foreign_view(): an Artifact, nothing written
    art = bind(art, parse_input_shapes("input_ids:1x128,attention_mask:1x128"))   # --shapes (trtexec style)
    require_bound(art)                                    # one line naming the inputs and the flag, if not

The view's manifest is built from the graph itself (inputs and outputs with their dtypes and dims, the opset, the
precision its op types show) and from what lies beside it: config.json (position / image sizes, vocabulary),
tokenizer.json (a tokenizer, as in our artifacts' tokenizer/), a sentence-transformers modules.json (pooling).
The graph is untrusted input like our own artifacts' (export/artifact.py): it is read without its external data,
whose locations must lie inside the directory, and the manifest goes through the same validation.

Symbolic dims become axes. A few names are recognized as what they say (`AXIS_NAMES`: batch, sequence,
height, width) and take --batch / --seq; every other symbolic (or unnamed) dim must be given with --shapes
(`require_bound`). Before binding, such an axis admits any size, so a child process that re-opens the view by
its path validates the sizes the parent bound.

Feeds (models/spec.py make_feeds) follow each input's kind, read from its name and dtype: integer inputs are
token ids below the vocabulary size (the rows of the embedding table the ids are gathered from, else
config.json's or the tokenizer's vocab_size), attention masks are ones, token type / position ids zeros, float
inputs standard normal.

The reference of a foreign graph is onnxruntime CPU on its fp32 graph (Polygraphy-style; `reference_source`);
`xdeploy convert` writes a real artifact with golden probes from it (export/convert.py). `write_manifest` puts
the view's manifest beside the graph, on explicit request only (`xdeploy convert PATH --write-manifest`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError
from xdeploy.models.spec import Axis

from .artifact import FORMAT, MANIFEST, SCHEMA_VERSION, Artifact, load_artifact, parse_manifest
from .onnx_graph import REFERENCE, SECTION, view_manifest  # noqa: F401 - REFERENCE: for export/convert.py

# ------------------------------------------------------------------------------------------ binding ----

def parse_input_shapes(text: str | None) -> dict[str, tuple[int, ...]]:
    """'input_ids:1x128,attention_mask:1x128' (trtexec / Polygraphy style) -> {name: dims}."""
    out: dict[str, tuple[int, ...]] = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        name, sep, dims = item.rpartition(":")
        try:
            if not sep or not name:
                raise ValueError
            shape = tuple(int(x) for x in dims.lower().split("x"))
            if any(x < 1 for x in shape):
                raise ValueError
        except ValueError:
            raise XDeployError(f"bad shape {item!r}; expected INPUT:DxDx..., e.g. input_ids:1x128") from None
        out[name] = shape
    return out


def bind(art: Artifact, shapes: Mapping[str, Sequence[int]] | None) -> Artifact:
    """The view with the axes of the inputs named in `shapes` fixed to the sizes given (Axis(v, v, v))."""
    if not shapes:
        return art
    g = art.graph("model")
    names = {t.name: t for t in g.inputs}
    fixed: dict[str, tuple[int, str]] = {}
    for name, shape in shapes.items():
        t = names.get(name)
        if t is None:
            raise XDeployError(f"--shapes names input {name!r}; the graph's inputs are {', '.join(names)}")
        if len(shape) != len(t.dims):
            raise XDeployError(f"--shapes gives {name!r} {len(shape)} dim(s); it has {len(t.dims)} "
                               f"({'x'.join(str(d) for d in t.dims)})")
        for d, v in zip(t.dims, shape):
            if isinstance(d, int):
                if d != v:
                    raise XDeployError(f"--shapes gives {name!r} a dim of {v} where the graph fixes {d}")
                continue
            if d in fixed and fixed[d][0] != v:
                raise XDeployError(f"--shapes gives axis {d!r} {v} in {name!r} but {fixed[d][0]} in {fixed[d][1]!r}")
            fixed[d] = (int(v), name)
    axes = dict(art.spec.axes) | {d: Axis(v, v, v) for d, (v, _) in fixed.items()}
    return dataclasses.replace(art, spec=dataclasses.replace(art.spec, axes=axes))


def unbound_axes(art: Artifact) -> list[str]:
    """The symbolic input dims of a foreign view that neither a recognized name nor --shapes bound."""
    return [a for a in (art.foreign or {}).get("unbound", []) if art.spec.axes[a].min != art.spec.axes[a].max]


def require_bound(art: Artifact) -> Artifact:
    """`art` itself when every symbolic input dim is bound; otherwise one line naming the inputs and the flag."""
    left = unbound_axes(art)
    if not left:
        return art
    g = art.graph("model")
    users = [t for t in g.inputs if any(d in left for d in t.dims)]

    def example(t: Any) -> str:
        return "x".join(str(d) if isinstance(d, int) else "N" if d in left else str(art.spec.axes[d].opt)
                        for d in t.dims)

    dims = ", ".join(repr(a) for a in left)
    raise XDeployError(f"{art.onnx_path()}: cannot bind symbolic dim(s) {dims} of input(s) "
                       f"{', '.join(t.name for t in users)}; give their sizes with --shapes "
                       f"{','.join(f'{t.name}:{example(t)}' for t in users)} (N: a size)")


def describe(art: Artifact) -> str | None:
    """One line on how a foreign view's dims are bound (printed by the commands), None for our artifacts."""
    f = art.foreign
    if f is None:
        return None
    parts = [f"{dim} -> {axis}" for axis, dim in f.get("axis_names", {}).items()]
    parts += [f"{a} = {art.spec.axes[a].min}" for a in f.get("unbound", []) if art.spec.axes[a].min ==
              art.spec.axes[a].max]
    vocab = f.get("vocab")
    v = f"; token ids < {vocab['size']} ({vocab['from']})" if vocab else ""
    bound = ", ".join(parts) if parts else "no symbolic dims"
    what = "foreign ONNX" if f.get("view_of") else "xdeploy artifact converted from a foreign ONNX"
    return (f"{art.onnx_path()}: {what} ({art.precision}, opset {art.opset}); dims: {bound}"
            f" (batch -> --batch, seq -> --seq; others: --shapes){v}")


def reference_source(art: Artifact) -> Artifact | None:
    """The graph a foreign model's outputs are judged against: onnxruntime CPU on its fp32 graph (the view
    itself; a converted artifact's fp32 source, by the path it was converted from); None for our artifacts
    (their reference is PyTorch)."""
    f = art.foreign
    if f is None:
        return None
    if art.precision == "fp32" or "derived_from" not in art.manifest:
        return art  # a quantized foreign graph is its own reference: runtimes compared on the same graph
    src = Path(str(art.manifest["derived_from"].get("source_path") or art.manifest["derived_from"].get("path")))
    if not src.exists():
        raise XDeployError(f"{art.path} was converted from the foreign graph {src}, which is gone; its reference "
                           "(onnxruntime fp32 on that graph) cannot run: use xdeploy verify (its golden probes)")
    return load_artifact(src, verify=False)


def converted_manifest(art: Artifact, manifest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The manifest of an artifact converted from foreign view `art` (the graph becomes model.onnx, the tokenizer
    moves to tokenizer/, as in our artifacts), and {view file: artifact file} of the files that carry over."""
    import copy

    m = copy.deepcopy(manifest)
    m["graphs"]["model"]["file"] = "model.onnx"
    f = m[SECTION]
    tok = f.get("tokenizer_dir")
    carry = {}
    if tok is not None:
        for rel in art.manifest["files"]:
            if rel not in (f["graph"],) and (Path(tok) / Path(rel).name).as_posix().removeprefix("./") == rel:
                carry[rel] = f"tokenizer/{Path(rel).name}"
    f |= {"graph": "model.onnx", "tokenizer_dir": "tokenizer" if carry else None}
    f.pop("view_of", None)
    m["derived_from"]["source_path"] = str(art.onnx_path())
    return m, carry


def dense_flops(art: Artifact, sizes: Mapping[str, int]) -> float:
    """Estimated FLOPs of one call of a foreign graph: 2 x dense-layer weights x tokens (batch x seq, or batch
    for a graph without a token axis); attention scores and convolutions are not counted."""
    tokens = sizes.get("batch", 1) * sizes.get("seq", 1)
    return 2.0 * float((art.foreign or {}).get("dense_params", 0)) * float(tokens)


# ----------------------------------------------------------------------------------- manifest beside ----

def write_manifest(path: str | Path) -> Path:
    """Write the view's manifest.json beside the foreign graph (explicit request only: --write-manifest), through
    the one manifest writer; afterwards the directory opens as an artifact. Refuses to replace a manifest."""
    from .writer import write_manifest_beside

    root, m = view_manifest(Path(path), verify=True)
    m = {"format": FORMAT, "schema_version": SCHEMA_VERSION} | m
    if (root / MANIFEST).exists():
        raise XDeployError(f"{root / MANIFEST} exists already; remove it first to write a new one")
    m[SECTION].pop("view_of", None)
    parse_manifest(root, m, root / MANIFEST, verify=False)
    return write_manifest_beside(root, m)
