"""Calibration data for static int8 quantization: what activations the quantizer measures to choose its scales.

    cal = default_calibration(spec, tokenizer_dir)             # per model family, deterministic
    cal = load_calibration("lines.txt", spec, tokenizer_dir)    # text lines, tokenized with the artifact's tokenizer
    cal = load_calibration("feeds.npz", spec, tokenizer_dir)    # arrays named after graph inputs (batch axis first)
    cal.samples["model"]  -> list of feed dicts; cal.record("model") -> the manifest's calibration entry

Default sets, chosen by what each graph's inputs declare (models/spec.py `TensorSpec.kind`), never by model name:
  ids inputs    real English sentences (export/calibration_text.py; not the parity sentences) tokenized with the
                checkpoint's tokenizer; preset models without a tokenizer map words to ids by a stable hash
                (their weights are random, so only the id statistics matter). Batches of 1-4 sentences, and
                every fourth sample a paragraph of joined sentences up to the exported maximum length, so long
                inputs are calibrated too: PARAGRAPH_TOKENS of them per sample (4 rows of 512, 2 of 1024), so the
                cost does not grow with the maximum length (GPT-2's 1024: the same scales and accuracy on half
                the forward passes, docs/export.md).
  image inputs  deterministic synthetic images: gradients, stripes, checkerboards, blobs (in [-1, 1], ViT's
                normalization) and Gaussian noise (std 1: what parity and the benchmarks feed).
  other inputs  (KV caches, positions, masks of cache axes) seeded `make_feeds` values, as parity uses.

Calibration files are untrusted input: every problem is one XDeployError line naming what was expected.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError
from xdeploy.models.spec import ExportSpec, Graph, TensorSpec, make_feeds

from .calibration_text import SENTENCES

DEFAULT_SAMPLES = 32
MAX_SAMPLES = 4096
FILE_BATCH = 4  # rows of a .npy/.npz file per calibration sample
PARAGRAPH_TOKENS = 2048  # tokens of one default paragraph sample (rows of the maximum length: 1 to 4)
INT_KINDS = ("ids", "mask", "zeros", "positions")


@dataclass(frozen=True)
class Calibration:
    """Calibration feeds per graph, and where they came from (for the manifest)."""

    samples: Mapping[str, list[dict[str, np.ndarray]]] = field(hash=False)
    source: Mapping[str, str]  # graph -> "default:text" | "default:image" | "default:random" | "file:NAME"
    sha256: Mapping[str, str]  # graph -> hash of the data (the file's bytes, or the default feeds' bytes)
    # Activation ranges measured on this set by one artifact's graphs, for its later graphs (export/precision.py
    # `_calibrate`): key (method, source, the digests of the weights reading the activation) -> (the graph that
    # measured it, onnxruntime's TensorData). A memo, not data: `precision.with_calibration` gives every artifact
    # an empty one.
    ranges: dict[tuple, tuple[str, Any]] = field(default_factory=dict, hash=False, compare=False, repr=False)

    def record(self, graph: str) -> dict[str, Any]:
        return {"source": self.source[graph], "samples": len(self.samples[graph]), "sha256": self.sha256[graph]}


def _hash_feeds(samples: Sequence[Mapping[str, np.ndarray]]) -> str:
    h = hashlib.sha256()
    for feeds in samples:
        for k in sorted(feeds):
            a = np.asarray(feeds[k], order="C")
            h.update(f"{k}:{a.dtype}:{a.shape};".encode())
            h.update(a.tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ tokenizing ----

class _Tokenizer:
    """The checkpoint's tokenizer (tokenizer.json) or, without one, a stable hash of words into [1, high)."""

    def __init__(self, tokenizer_dir: Path | None) -> None:
        self.tok = None
        if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            path = Path(tokenizer_dir) / "tokenizer.json"
            try:
                self.tok = Tokenizer.from_file(str(path))
            except Exception as e:  # tokenizers raises a bare Exception for malformed files
                raise XDeployError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
            self.tok.no_padding()
            self.tok.no_truncation()

    def encode(self, text: str, high: int) -> list[int]:
        if self.tok is not None:
            ids = self.tok.encode(text).ids
        else:
            ids = [1 + zlib.crc32(w.lower().encode()) % max(high - 1, 1) for w in re.findall(r"\w+|[^\w\s]", text)]
        ids = [i for i in ids if 0 <= i < high] or [min(1, high - 1)]
        return ids


def _text_inputs(graph: Graph) -> list[TensorSpec]:
    """The (batch, tokens) id inputs tokenized text fills; other int inputs (a foreign graph's shape or index
    operand, of another rank) keep make_feeds' draw."""
    return [t for t in graph.inputs if t.kind == "ids" and len(t.dims) == 2]


def _image_input(t: TensorSpec) -> bool:
    return t.kind == "image" or (t.kind == "float" and len(t.dims) == 4 and t.dims[0] == "batch"
                                 and all(isinstance(d, int) for d in t.dims[1:]) and t.dims[1] in (1, 3))


# ------------------------------------------------------------------------------------------- defaults ----

def _synthetic_image(rng: np.random.Generator, c: int, h: int, w: int, kind: int) -> np.ndarray:
    """One (c, h, w) image: 0 gradient, 1 stripes, 2 checkerboard, 3 blobs (all in [-1, 1]), 4 N(0, 1) noise."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    y, x = y / max(h - 1, 1), x / max(w - 1, 1)
    chans = []
    for _ in range(c):
        if kind == 0:
            a, b = rng.uniform(-1, 1, 2)
            img = a * x + b * y
        elif kind == 1:
            f, th = rng.uniform(2, 20), rng.uniform(0, np.pi)
            img = np.sin(2 * np.pi * f * (x * np.cos(th) + y * np.sin(th)) + rng.uniform(0, 6.3))
        elif kind == 2:
            n = int(rng.integers(2, 16))
            img = ((np.floor(x * n) + np.floor(y * n)) % 2) * 2 - 1.0
        elif kind == 3:
            img = np.zeros((h, w), np.float32)
            for _ in range(int(rng.integers(2, 6))):
                cx, cy, s = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.3)
                img += rng.uniform(-1, 1) * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * s * s))
        else:
            img = rng.standard_normal((h, w))
        chans.append(img if kind == 4 else np.clip(img, -1.0, 1.0))
    return np.stack(chans).astype(np.float32)


def _max_len(t: TensorSpec, axes: Mapping[str, Any]) -> int:
    """The longest row a text input takes: its sequence axis's maximum, or its fixed length."""
    seq = t.dims[1] if len(t.dims) == 2 else None
    return axes[seq].max if isinstance(seq, str) else int(seq or 1)


def _default_graph(graph: Graph, spec: ExportSpec, tok: _Tokenizer, n: int, seed: int) -> tuple[list, str]:
    texts = _text_inputs(graph)
    images = [t for t in graph.inputs if _image_input(t)]
    axes = spec.axes
    samples = []
    rng = np.random.default_rng(seed)
    longest = max((_max_len(t, axes) for t in texts), default=1)
    for i in range(n):
        batch = min(1 + i % 4, axes["batch"].max)
        if i % 4 == 3 and texts:  # a paragraph sample: its rows are the maximum length
            batch = max(1, min(batch, PARAGRAPH_TOKENS // longest))
        sizes = {a: min(max(ax.opt, ax.min), ax.max) for a, ax in axes.items()} | {"batch": batch}
        for a, ax in axes.items():  # axes no text input sets (KV cache lengths): varied, within range
            if a != "batch":
                sizes[a] = int(rng.integers(ax.min, min(ax.max, max(ax.opt, 2 * ax.min)) + 1))
        token_rows: dict[str, list[list[int]]] = {}
        for j, t in enumerate(texts):
            seq = t.dims[1] if len(t.dims) == 2 else None
            limit = _max_len(t, axes)
            rows = []
            for r in range(batch):
                k = (i * 7 + r * 3 + j * 11) % len(SENTENCES)
                if i % 4 == 3:  # a paragraph: sentences joined until the exported maximum
                    ids: list[int] = []
                    while len(ids) < limit:
                        ids += tok.encode(SENTENCES[k % len(SENTENCES)], t.high)
                        k += 1
                else:
                    ids = tok.encode(SENTENCES[k], t.high)
                rows.append(ids[:limit] if isinstance(seq, str) else ids[-limit:])
            token_rows[t.name] = rows
            if isinstance(seq, str):
                sizes[seq] = int(min(max(max(len(r) for r in rows), axes[seq].min), axes[seq].max))
        feeds = make_feeds(graph, sizes, seed=seed + i, pad=False)
        for t in texts:
            ids = np.zeros(feeds[t.name].shape, np.int64)
            mask = np.zeros(feeds[t.name].shape, np.int64)
            for r, row in enumerate(token_rows[t.name]):
                row = row[: ids.shape[1]]
                ids[r, : len(row)], mask[r, : len(row)] = row, 1
            feeds[t.name] = ids.astype(t.dtype)
            for m in graph.inputs:  # the mask / token types over the same axes as these ids
                if m.dims == t.dims and m.kind == "mask":
                    feeds[m.name] = mask.astype(m.dtype)
                elif m.dims == t.dims and m.kind == "zeros":
                    feeds[m.name] = np.zeros_like(ids).astype(m.dtype)
        for t in images:
            c, h, w = (int(d) for d in feeds[t.name].shape[1:])
            feeds[t.name] = np.stack([_synthetic_image(rng, c, h, w, (i + r) % 5) for r in range(batch)]
                                     ).astype(t.dtype)
        samples.append(feeds)
    kind = "text" if texts else "image" if images else "random"
    return samples, f"default:{kind}"


def default_calibration(spec: ExportSpec, tokenizer_dir: Path | None = None, *, samples: int = DEFAULT_SAMPLES,
                        seed: int = 0) -> Calibration:
    """The deterministic default set for every graph of `spec` (see the module docstring)."""
    tok = _Tokenizer(tokenizer_dir)
    out, src, sha = {}, {}, {}
    for g in spec.graphs:
        out[g.name], src[g.name] = _default_graph(g, spec, tok, samples, seed)
        sha[g.name] = _hash_feeds(out[g.name])
    return Calibration(out, src, sha)


# -------------------------------------------------------------------------------------- user files ----

def load_calibration(path: str | Path, spec: ExportSpec, tokenizer_dir: Path | None = None, *,
                     seed: int = 0) -> Calibration:
    """A user's calibration file: `.npy` (the single input of a one-input graph), `.npz` (arrays named INPUT or
    GRAPH/INPUT, batch axis first), or anything else as UTF-8 text lines (for graphs with token-id inputs).
    Graphs the file does not cover use the default set."""
    p = Path(path)
    if not p.is_file():
        raise XDeployError(f"calibration file {p} does not exist; expected text lines, .npy or .npz")
    data = p.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    suffix = p.suffix.lower()
    if suffix in (".npy", ".npz"):
        per_graph = _load_arrays(p, suffix, spec)
    else:
        per_graph = _load_text(p, data, spec, tokenizer_dir)
    default = default_calibration(spec, tokenizer_dir, seed=seed)
    samples = dict(default.samples)
    source, sha = dict(default.source), dict(default.sha256)
    for g, s in per_graph.items():
        samples[g], source[g], sha[g] = s, f"file:{p.name}", digest
    return Calibration(samples, source, sha)


def _load_text(p: Path, data: bytes, spec: ExportSpec, tokenizer_dir: Path | None) -> dict[str, list]:
    try:
        lines = [s.strip() for s in data.decode("utf-8").splitlines()]
    except UnicodeDecodeError:
        raise XDeployError(f"calibration file {p} is neither UTF-8 text lines nor .npy/.npz") from None
    lines = [s for s in lines if s]
    if not lines:
        raise XDeployError(f"calibration file {p} has no non-empty lines; expected one text per line")
    if len(lines) > MAX_SAMPLES * FILE_BATCH:
        raise XDeployError(f"calibration file {p} has {len(lines)} lines; expected at most {MAX_SAMPLES * FILE_BATCH}")
    graphs = [g for g in spec.graphs if _text_inputs(g)]
    if not graphs:
        names = ", ".join(t.name for g in spec.graphs for t in g.inputs)
        raise XDeployError(f"calibration file {p} holds text, but this model takes no token ids ({names}); "
                           "expected a .npy or .npz file of input arrays")
    tok = _Tokenizer(tokenizer_dir)
    out = {}
    for g in graphs:
        samples = []
        for start in range(0, len(lines), FILE_BATCH):
            chunk = lines[start:start + FILE_BATCH]
            sizes = {a: ax.opt for a, ax in spec.axes.items()} | {"batch": len(chunk)}
            feeds = make_feeds(g, {**sizes, **_seq_sizes(g, spec, chunk, tok)}, seed=start, pad=False)
            for t in _text_inputs(g):
                seq = t.dims[1]
                rows = [tok.encode(s, t.high) for s in chunk]
                n = feeds[t.name].shape[1]
                rows = [r[:n] if isinstance(seq, str) else r[-n:] for r in rows]
                ids, mask = np.zeros((len(chunk), n), np.int64), np.zeros((len(chunk), n), np.int64)
                for r, row in enumerate(rows):
                    ids[r, :len(row)], mask[r, :len(row)] = row, 1
                feeds[t.name] = ids.astype(t.dtype)
                for m in g.inputs:
                    if m.dims == t.dims and m.kind in ("mask", "zeros"):
                        feeds[m.name] = (mask if m.kind == "mask" else np.zeros_like(ids)).astype(m.dtype)
            samples.append(feeds)
        out[g.name] = samples
    return out


def _seq_sizes(g: Graph, spec: ExportSpec, chunk: list[str], tok: _Tokenizer) -> dict[str, int]:
    sizes = {}
    for t in _text_inputs(g):
        if len(t.dims) == 2 and isinstance(t.dims[1], str):
            ax = spec.axes[t.dims[1]]
            longest = max(len(tok.encode(s, t.high)) for s in chunk)
            sizes[t.dims[1]] = int(min(max(longest, ax.min), ax.max))
    return sizes


def _load_arrays(p: Path, suffix: str, spec: ExportSpec) -> dict[str, list]:
    try:
        loaded = np.load(p, allow_pickle=False)
    except ValueError as e:  # object arrays need pickle: refused
        raise XDeployError(f"calibration file {p}: {str(e).splitlines()[0]}; expected plain numeric arrays") from None
    except Exception as e:  # zipfile / format errors
        raise XDeployError(f"calibration file {p} is not a readable {suffix} file ({type(e).__name__})") from None
    if suffix == ".npy":
        g = spec.graph("model")
        if len(g.inputs) != 1:
            raise XDeployError(f"calibration file {p} holds one array, but graph 'model' has {len(g.inputs)} inputs "
                               f"({', '.join(t.name for t in g.inputs)}); expected a .npz with one array per input")
        arrays = {"model": {g.inputs[0].name: loaded}}
    else:
        with loaded:
            arrays = {}
            for key in loaded.files:
                graph, _, name = key.rpartition("/")
                arrays.setdefault(graph or "model", {})[name] = loaded[key]
    out = {}
    for gname, feeds in arrays.items():
        try:
            g = spec.graph(gname)
        except KeyError:
            raise XDeployError(f"calibration file {p} names graph {gname!r}; expected one of: "
                               f"{', '.join(x.name for x in spec.graphs)}") from None
        out[gname] = _split(p, g, spec, feeds)
    return out


def _split(p: Path, g: Graph, spec: ExportSpec, feeds: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Check the arrays of one graph against its inputs, then cut them into samples of FILE_BATCH rows."""
    want = {t.name: t for t in g.inputs}
    unknown = sorted(set(feeds) - set(want))
    missing = sorted(set(want) - set(feeds))
    if unknown or missing:
        raise XDeployError(f"calibration file {p}: graph {g.name!r} needs arrays {', '.join(want)}"
                           + (f"; unknown: {', '.join(unknown)}" if unknown else "")
                           + (f"; missing: {', '.join(missing)}" if missing else ""))
    sizes: dict[str, int] = {}
    checked = {}
    for name, a in feeds.items():
        t = want[name]
        if a.ndim != len(t.dims):
            raise XDeployError(f"calibration file {p}: {name} has shape {a.shape}; expected dims {t.dims}")
        integer = t.kind in INT_KINDS
        if integer and a.dtype.kind not in "iu" or not integer and a.dtype.kind != "f":
            raise XDeployError(f"calibration file {p}: {name} is {a.dtype}; expected "
                               f"{'an integer' if integer else 'a floating-point'} array")
        for d, n in zip(t.dims, a.shape):
            if isinstance(d, int) and n != d:
                raise XDeployError(f"calibration file {p}: {name} has shape {a.shape}; expected dims {t.dims}")
            if isinstance(d, str):
                ax = spec.axes[d]
                if d != "batch" and not ax.min <= n <= ax.max:
                    raise XDeployError(f"calibration file {p}: {name} axis {d} is {n}; expected {ax.min}..{ax.max}")
                if sizes.setdefault(d, n) != n:
                    raise XDeployError(f"calibration file {p}: axis {d} is {sizes[d]} in one array and {n} in {name}")
        if integer:
            hi = t.high if t.kind == "ids" else 2 if t.kind == "mask" else None
            if a.size and (a.min() < 0 or (hi is not None and a.max() >= hi)):
                raise XDeployError(f"calibration file {p}: {name} values must lie in [0, {hi}) ({t.kind})")
        elif not np.isfinite(a).all():
            raise XDeployError(f"calibration file {p}: {name} contains NaN or Inf")
        checked[name] = np.asarray(a.astype(t.dtype), order="C")
    rows = sizes.get("batch", 1)
    if rows < 1:
        raise XDeployError(f"calibration file {p}: graph {g.name!r} arrays have no rows")
    if rows > MAX_SAMPLES * FILE_BATCH:
        raise XDeployError(f"calibration file {p} has {rows} rows; expected at most {MAX_SAMPLES * FILE_BATCH}")
    batched = [t.name for t in g.inputs if t.dims and t.dims[0] == "batch"]
    return [{k: (v[s:s + FILE_BATCH] if k in batched else v) for k, v in checked.items()}
            for s in range(0, rows, FILE_BATCH)]

