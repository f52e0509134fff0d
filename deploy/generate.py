"""Autoregressive generation over any runner: greedy, sampling and beam search with a preallocated KV cache.

    from xdeploy.deploy.generate import Generator, GenerationConfig
    with Generator("artifacts/gpt-tiny-fp32", "ort") as g:
        out = g.generate([[5, 7, 11], [3]], GenerationConfig(max_new_tokens=32))
    out.tokens          # per prompt row, the new token ids (ending with EOS when it stopped there)

How a step works (a decoder such as gpt; an encoder-decoder such as the transformer runs its `encoder` instead of
the prefill). Graph and feed names come from the model's declared `DecoderFeeds` (models/spec.py), read from
the artifact's manifest; below are gpt's:

  prefill   graph `decode` once on the left-padded prompt as one step of T tokens (ids, positions, step_mask
            (B, T)) against an empty cache (one masked slot) -> the last token's logits (B, 1, V) and new_kv
            (L, 2, B, nh, T, hs), copied once into slots [0, T) of the cache (L, 2, B, nh, C, hs), C = T + new - 1.
            Only one graph is opened, so every engine holds one copy of the weights. (Artifacts whose model
            declares no step_mask, and exports older than it, prefill with graph `model`'s logits and present.)
  decode    graph `decode`, bound ONCE with `Runner.bind` onto numpy buffers owned here: ids (B, 1),
            positions (B, 1), the cache (per-layer inputs `cache.<i>.key` / `.value`, each bound to its
            (B, nh, C, hs) view of the one buffer), cache_mask (B, C) in; logits (B, 1, V), new_kv
            (L, 2, B, nh, 1, hs) out.
            Each step writes the token into `ids`, runs, then writes `new_kv` into cache slot `slot` and sets
            cache_mask[:, slot] = 1: (L, 2, B, nh, 1, hs) floats move per step, never the whole cache.

The cache, new_kv and an encoder-decoder's memory live where the decode runner reads them (Runner.loop_arrays):
host numpy for the CPU runners, torch tensors on the GPU for ort-cuda / ort-trt (bound by address; the slot write
and beam gather run there), so that a GPU step moves only the token in and the logits out.
On onnxruntime (IO binding) and OpenVINO (shared-memory tensors) the graph reads the cache buffer in place;
runners without an override of `bind` copy their outputs (the torch reference does). Beam search reorders the
cache rows by beam index after each step: that copy is inherent to beam search and touches only the filled
slots. `use_cache=False` is the "recompute everything" mode: every step runs the full `model` graph on the
whole sequence so far (used for the with-cache / without-cache ratio and as an independent parity path).

Beam search follows Hugging Face transformers' `generate(num_beams=k)` exactly (early_stopping=False): a
finished hypothesis scores sum(log p) / generated_length ** length_penalty (generated tokens including EOS,
prompt excluded), 2k candidates per step, and a row stops once k hypotheses are finished and the best running
beam cannot beat the worst of them. Padding: prompts may be left- or right-padded (or ragged lists); gpt
prompts are re-padded on the left (positions count only real tokens, so a padded row generates what it
generates alone), transformer sources on the right (its encoder uses absolute positions).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError, one_of
from xdeploy.export.artifact import Artifact, load_artifact
from xdeploy.models.spec import DecoderFeeds

from .base import CachedStep, Runner
from .probes import check_on_open
from .registry import open_runner, runner_class


def decoding_feeds(artifact: Artifact) -> DecoderFeeds:
    """The decoding feeds the artifact's model declares; one clear line when it does not generate."""
    caps = artifact.capabilities
    if caps.decoding is None:
        raise XDeployError(f"model {artifact.model!r} does not generate text: it is an {caps.role} model "
                           "(generation needs a decoder or encoder-decoder model)")
    return caps.decoding


KV_CACHES = ("auto", "engine", "paged", "loop")  # Generator(kv_cache=...): where the KV cache lives


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate. `eos_token_id=None` takes the model's; pass -1 to never stop at EOS (benchmarks)."""

    max_new_tokens: int = 32
    num_beams: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None
    length_penalty: float = 0.75  # beam search: score = sum log p / generated_len ** length_penalty
    eos_token_id: int | None = None

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise XDeployError(f"new tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_beams < 1:
            raise XDeployError(f"beams must be >= 1, got {self.num_beams}")
        if self.do_sample and self.num_beams > 1:
            raise XDeployError("sampling with beams is not supported; use --beams 1 with --sample")
        if not self.temperature > 0:
            raise XDeployError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise XDeployError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise XDeployError(f"top-p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class Generation:
    """The result of one `generate` call. Times are seconds (floats)."""

    tokens: tuple[tuple[int, ...], ...]  # per prompt row: new tokens, ending with EOS if it stopped there
    stop: tuple[str, ...]  # per row: "eos" or "length"
    scores: tuple[float, ...] | None  # beam search: the chosen hypothesis' length-penalized score
    prompt_lengths: tuple[int, ...]  # real (unpadded) prompt tokens per row
    time_to_first_token_s: float  # from the call: checks, prefill (or encoder + first step), the first token's choice
    step_s: tuple[float, ...]  # every later decode step, in order (context grows by one token per step)
    total_s: float
    mode: str  # "cache" (the loop's buffer) | "engine cache" (kept inside the engine) | "paged engine cache" |
    # "recompute"
    runner: str

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else float("inf")

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": [list(t) for t in self.tokens], "stop": list(self.stop),
                "scores": list(self.scores) if self.scores is not None else None,
                "prompt_lengths": list(self.prompt_lengths), "time_to_first_token_s": self.time_to_first_token_s,
                "step_s": list(self.step_s), "total_s": self.total_s, "tokens_per_s": self.tokens_per_s,
                "mode": self.mode, "runner": self.runner}


# ------------------------------------------------------------------------------------------ prompts ----

def normalize_prompts(prompts: Any, attention_mask: np.ndarray | None = None) -> list[list[int]]:
    """Ragged token lists, or a (B, T) id array with an optional 1/0 mask (left, right or any padding)
    -> the real tokens of each row."""
    if isinstance(prompts, np.ndarray):
        if prompts.ndim != 2:
            raise XDeployError(f"prompt ids must be a (batch, seq) array, got shape {prompts.shape}")
        mask = np.ones_like(prompts) if attention_mask is None else np.asarray(attention_mask)
        if mask.shape != prompts.shape:
            raise XDeployError(f"attention_mask shape {mask.shape} differs from prompt ids {prompts.shape}")
        rows = [[int(t) for t, m in zip(r, mr) if m] for r, mr in zip(prompts, mask)]
    elif isinstance(prompts, Sequence) and prompts and all(isinstance(r, Sequence) for r in prompts):
        if attention_mask is not None:
            raise XDeployError("attention_mask applies to an array of prompt ids, not to token lists")
        rows = [[int(t) for t in r] for r in prompts]
    else:
        raise XDeployError("prompts must be a non-empty list of token-id lists or a (batch, seq) id array")
    if not all(rows):
        raise XDeployError("every prompt row needs at least one real token")
    return rows


def pad_rows(rows: list[list[int]], side: str, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> (ids, mask), both (B, max_len) int64, padded on `side` ("left" | "right")."""
    t = max(len(r) for r in rows)
    ids = np.full((len(rows), t), pad_id, np.int64)
    mask = np.zeros((len(rows), t), np.int64)
    for i, r in enumerate(rows):
        sl = slice(t - len(r), t) if side == "left" else slice(0, len(r))
        ids[i, sl], mask[i, sl] = r, 1
    return ids, mask


# --------------------------------------------------------------------------------- token selection ----

def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def sample(logits: np.ndarray, rng: np.random.Generator, *, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0) -> np.ndarray:
    """(N, V) logits -> (N,) token ids. Temperature, then top-k, then top-p (nucleus: the smallest set of
    most likely tokens whose probability reaches top_p), in Hugging Face's order; one uniform draw per row."""
    x = logits.astype(np.float64) / temperature
    v = x.shape[-1]
    if 0 < top_k < v:
        kth = np.partition(x, v - top_k, axis=-1)[:, v - top_k][:, None]  # k-th largest per row
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sp = np.take_along_axis(p, order, -1)
        before = np.cumsum(sp, -1) - sp  # probability mass of the more likely tokens
        drop = np.zeros_like(p, dtype=bool)
        np.put_along_axis(drop, order, before >= top_p, -1)  # the top token always has before = 0: kept
        p = np.where(drop, 0.0, p)
        p /= p.sum(-1, keepdims=True)
    u = rng.random(p.shape[0])[:, None]
    return np.minimum((np.cumsum(p, -1) < u).sum(-1), v - 1).astype(np.int64)


# ------------------------------------------------------------------------------------ step engines ----

class _Steps:
    """Runs the model for N = batch * beams rows: `start()` -> logits of the first new token (N, V),
    `step(tokens)` -> logits of the next, `reorder(rows)` -> row r now continues row rows[r]."""

    def start(self) -> np.ndarray: ...
    def step(self, tokens: np.ndarray) -> np.ndarray: ...
    def reorder(self, rows: np.ndarray) -> None: ...


def _dtype(graph: Any, name: str) -> np.dtype:
    return np.dtype(next(t.dtype for t in graph.inputs if t.name == name))


@dataclass(frozen=True)
class _CacheLayout:
    """How the decode graph takes the cache the loop owns, one (L, 2, N, nh, C, hs) buffer: as per-layer inputs
    `names` (layer 0's key, layer 0's value, ...), each bound to a C-contiguous view of the buffer, or (exports
    before those) as one input `single` (models/spec.py DecoderFeeds)."""

    names: tuple[str, ...] | None
    single: str
    layers: int
    heads: int
    head_size: int
    dtype: np.dtype

    def feeds(self, cache: np.ndarray) -> dict[str, np.ndarray]:
        if self.names is None:
            return {self.single: cache}
        return {n: cache[i // 2, i % 2] for i, n in enumerate(self.names)}

    def empty(self, n: int, slots: int) -> dict[str, np.ndarray]:
        """Feeds of a zeroed cache of `slots` slots for n rows."""
        return self.feeds(np.zeros((self.layers, 2, n, self.heads, slots, self.head_size), self.dtype))


def _cache_layout(graph: Any, f: DecoderFeeds) -> _CacheLayout:
    """The decode graph's cache inputs, read from its (untrusted) manifest entry; one clear line if they are
    not what the loop binds."""
    by_name = {t.name: t for t in graph.inputs}
    if f.cache in by_name:  # one (L, 2, B, nh, C, hs) input
        dims, names = by_name[f.cache].dims, None
        ok = len(dims) == 6 and all(isinstance(dims[i], int) for i in (0, 1, 3, 5)) and dims[1] == 2
    else:
        layers = 0
        while f"{f.cache}.{layers}.key" in by_name:
            layers += 1
        names = f.cache_names(layers)
        dims = by_name[names[0]].dims if layers else ()
        ok = layers > 0 and all(n in by_name and by_name[n].dims == dims for n in names) and len(dims) == 4 \
            and isinstance(dims[1], int) and isinstance(dims[3], int)
    if not ok:
        raise XDeployError(f"decode graph {graph.name!r} has no KV-cache inputs the decoding loop can bind: expected "
                           f"{f.cache}.<layer>.key / .value (batch, heads, cache, head size) for every layer, or one "
                           f"{f.cache!r} (layers, 2, batch, heads, cache, head size); re-export the artifact")
    if names is None:
        return _CacheLayout(None, f.cache, dims[0], dims[3], dims[5], np.dtype(by_name[f.cache].dtype))
    return _CacheLayout(names, f.cache, layers, dims[1], dims[3], np.dtype(by_name[names[0]].dtype))


def _prompt_positions(mask: np.ndarray) -> np.ndarray:
    """(B, T) int64 positions of a left-padded prompt: they count only real tokens (as the full graph's
    positions_from_mask), so left padding gets 0."""
    return np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int64)


def _axis(graph: Any, name: str) -> str:
    """The dynamic axis along dim 1 of input `name` (a (batch, tokens) ids or mask input)."""
    t = next((t for t in graph.inputs if t.name == name), None)
    if t is None or len(t.dims) < 2 or not isinstance(t.dims[1], str):
        raise XDeployError(f"graph {graph.name!r} has no (batch, tokens) input {name!r} that the model's "
                           "decoding feeds name")
    return t.dims[1]


class _CachedSteps(_Steps):
    """Preallocated cache + one bound decode call (see the module docstring)."""

    def __init__(self, gen: Generator, ids: np.ndarray, mask: np.ndarray, beams: int, new: int) -> None:
        self.gen, self.beams = gen, beams
        self.ids, self.mask = ids, mask  # (B, T) prompt (gpt: left-padded) / source (transformer: right-padded)
        self.new = new
        # the arrays the step binds and updates, where the decode runner reads them (Runner.loop_arrays): host
        # numpy, or a GPU runner's device, so that the cache never crosses to the host
        self.arrays = gen.decode.loop_arrays()

    def _alloc(self, n: int, capacity: int, extra: Mapping[str, np.ndarray]) -> None:
        g, f, lay = self.gen, self.gen.feeds, self.gen.cache_layout
        dec = g.decode.graph
        arrays = self.arrays
        self.cache = arrays.zeros((lay.layers, 2, n, lay.heads, capacity, lay.head_size), lay.dtype)
        self.cache_mask = np.zeros((n, capacity), np.int64)
        self.tok = np.zeros((n, 1), np.int64)
        self.pos = np.zeros((n, 1), np.int64)
        out = {t.name: t for t in dec.outputs}
        v = out[f.logits].dims[-1]
        self.logits = np.zeros((n, 1, v), np.dtype(out[f.logits].dtype))
        self.new_kv = arrays.zeros((lay.layers, 2, n, lay.heads, 1, lay.head_size), np.dtype(out[f.new_kv].dtype))
        feeds = {f.step_ids: self.tok, f.positions: self.pos, f.cache_mask: self.cache_mask} | lay.feeds(self.cache)
        self.call = g.decode.bind(feeds | dict(extra), {f.logits: self.logits, f.new_kv: self.new_kv})
        self.slot = 0  # next cache slot to write

    def _run_step(self, tokens: np.ndarray) -> np.ndarray:
        self.tok[:, 0] = tokens
        self.call()
        # The step's K/V into slot `slot`: (L, 2, N, nh, 1, hs) floats, the only cache write of the step.
        self.cache[:, :, :, :, self.slot, :] = self.new_kv[:, :, :, :, 0, :]
        self.cache_mask[:, self.slot] = 1
        self.slot += 1
        self.pos += 1
        return self.logits[:, 0]

    def step(self, tokens: np.ndarray) -> np.ndarray:
        return self._run_step(tokens)

    def reorder(self, rows: np.ndarray) -> None:
        if np.array_equal(rows, np.arange(len(rows))):
            return
        # Beam reordering: only the filled slots [0, slot) move; np.take makes the gathered copy first, so
        # rows that read from rows being overwritten are safe.
        s = self.slot
        self.cache[:, :, :, :, :s] = self.arrays.take(self.cache[:, :, :, :, :s], rows, axis=2)
        self.cache_mask[:] = self.cache_mask[rows]
        self.pos[:] = self.pos[rows]


class _DecoderCached(_CachedSteps):
    def _prefill(self) -> tuple[np.ndarray, np.ndarray]:
        """The prompt's last-token logits (B, V) and KV (L, 2, B, nh, T, hs)."""
        g, f = self.gen, self.gen.feeds
        if g.prefill is not g.decode:  # a separate prefill graph: every position's logits and `present`
            out = g.prefill.infer({f.prompt_ids: self.ids, f.prompt_mask: self.mask})
            return out[f.logits][:, -1], out[f.present]  # left padding: the last column is real in every row
        dec = g.decode.graph
        b = self.ids.shape[0]
        pos = _prompt_positions(self.mask).astype(_dtype(dec, f.positions))
        # an empty cache: one masked slot (a zero-length axis is not portable across engines)
        out = g.decode.infer({f.step_ids: self.ids, f.positions: pos, f.step_mask: self.mask,
                              f.cache_mask: np.zeros((b, 1), _dtype(dec, f.cache_mask))}
                             | g.cache_layout.empty(b, 1))
        return out[f.logits][:, -1], out[f.new_kv]

    def start(self) -> np.ndarray:
        g, k, f = self.gen, self.beams, self.gen.feeds
        b, t = self.ids.shape
        logits, kv = self._prefill()
        n = b * k
        step_mask = {} if f.step_mask is None else {f.step_mask: np.ones((n, 1), _dtype(g.decode.graph, f.step_mask))}
        self._alloc(n, t + self.new - 1, step_mask)
        rep = np.repeat(np.arange(b), k)  # beam copies of each prompt row: row r -> prompt r // k
        self.cache[:, :, :, :, :t] = self.arrays.put(kv[:, :, rep])  # the one whole-prompt copy, at prefill
        self.cache_mask[:, :t] = self.mask[rep]
        self.pos[:, 0] = self.mask.sum(-1)[rep]  # next position = number of real prompt tokens
        self.slot = t
        return logits[rep]


class _EngineCached(_Steps):
    """The KV cache kept inside the engine (Runner.cached_step: OpenVINO's stateful IR). The loop feeds only the new
    tokens, their positions and the mask over every position so far; beam reordering is the engine's own gather
    of its cached rows before the next step, and the prompt is prefilled once per prompt row, its cache copied
    into each beam by that gather."""

    def __init__(self, gen: Generator, ids: np.ndarray, mask: np.ndarray, beams: int, new: int) -> None:
        self.gen, self.run = gen, gen.cached_step()
        self.ids, self.mask, self.beams, self.new = ids, mask, beams, new

    def start(self) -> np.ndarray:
        b, t = self.ids.shape
        rep = np.repeat(np.arange(b), self.beams)  # beam copies of each prompt row: row r -> prompt r // k
        n = len(rep)
        self.run.reset()
        logits = self.run(self.ids, _prompt_positions(self.mask), self.mask, np.arange(b, dtype=np.int32))[rep]
        self.seen = np.zeros((n, t + self.new - 1), np.int64)  # mask over every position so far, cached or new
        self.seen[:, :t] = self.mask[rep]
        self.filled = t
        self.tok = np.zeros((n, 1), np.int64)
        self.pos = self.mask.sum(-1)[rep][:, None].astype(np.int64)  # next position = real prompt tokens
        self.rows = np.arange(n, dtype=np.int32)
        self.beam = rep.astype(np.int32)  # the first step gathers each prompt row's cache into its beams
        return logits

    def step(self, tokens: np.ndarray) -> np.ndarray:
        self.tok[:, 0] = tokens
        self.seen[:, self.filled] = 1
        self.filled += 1
        logits = self.run(self.tok, self.pos, self.seen[:, :self.filled], self.beam)
        self.beam = self.rows
        self.pos += 1
        return logits

    def reorder(self, rows: np.ndarray) -> None:
        self.beam = self.beam[rows]  # composes with a gather not yet applied (the first step's)
        self.seen[:] = self.seen[rows]
        self.pos[:] = self.pos[rows]


class _Seq2SeqEngineCached(_EngineCached):
    """An encoder-decoder's self-attention cache kept inside the engine: the encoder runs once per source row, the
    engine holds its memory and the source mask (expanded to the beams) for the sequence, and the first step is
    BOS at position 0 against an empty cache. Beams never leave their source row, so the held memory never
    moves; the engine's gather reorders only the cache."""

    def start(self) -> np.ndarray:
        g = self.gen
        held = _encode(g, self.ids, self.mask, self.beams)
        n = len(held[g.feeds.prompt_mask])
        self.run.reset()
        self.run.hold(held)
        self.seen = np.ones((n, self.new), np.int64)  # the target has no padding: every position so far is real
        self.filled = 1
        self.tok = np.full((n, 1), g.vocab.bos_token_id, np.int64)
        self.pos = np.zeros((n, 1), np.int64)
        self.rows = np.arange(n, dtype=np.int32)
        self.beam = self.rows
        logits = self.run(self.tok, self.pos, self.seen[:, :1], self.beam)
        self.pos += 1
        return logits


class _Seq2SeqCached(_CachedSteps):
    def start(self) -> np.ndarray:
        g = self.gen
        held = _encode(g, self.ids, self.mask, self.beams)
        n = len(held[g.feeds.prompt_mask])
        # bound into every step, where the runner reads them (the memory on a GPU runner's device): kept alive here
        self.held = {k: self.arrays.put(v) for k, v in held.items()}
        self._alloc(n, self.new, self.held)
        return self._run_step(np.full(n, g.vocab.bos_token_id, np.int64))  # position 0: BOS


def _encode(gen: Generator, ids: np.ndarray, mask: np.ndarray, beams: int) -> dict[str, np.ndarray]:
    """An encoder-decoder's decode inputs fixed for the sequence (DecoderFeeds.held): the encoder's memory
    (L, 2, N, nh, S, hs) and the source mask, each source row repeated for its beams (N = B x beams)."""
    f = gen.feeds
    mem = gen.prefill.infer({f.prompt_ids: ids, f.prompt_mask: mask})[f.memory]
    rep = np.repeat(np.arange(ids.shape[0]), beams)
    return {f.memory: np.ascontiguousarray(mem[:, :, rep]), f.prompt_mask: np.ascontiguousarray(mask[rep])}



class _Recompute(_Steps):
    """No cache: every step runs the full `model` graph on the whole sequence so far."""

    def __init__(self, gen: Generator, ids: np.ndarray, mask: np.ndarray, beams: int, new: int) -> None:
        self.gen = gen
        rep = np.repeat(np.arange(ids.shape[0]), beams)
        self.ids, self.mask = ids[rep], mask[rep]
        self.seq2seq = gen.seq2seq
        n = len(rep)
        self.tgt = np.full((n, 1), gen.vocab.bos_token_id, np.int64) if self.seq2seq else np.zeros((n, 0), np.int64)

    def _run(self) -> np.ndarray:
        f = self.gen.feeds
        if self.seq2seq:
            feeds = {f.prompt_ids: self.ids, f.prompt_mask: self.mask, f.target_ids: self.tgt,
                     f.target_mask: np.ones_like(self.tgt)}
        else:
            ids = np.concatenate([self.ids, self.tgt], 1)
            mask = np.concatenate([self.mask, np.ones_like(self.tgt)], 1)
            feeds = {f.prompt_ids: ids, f.prompt_mask: mask}
        return self.gen.prefill.infer(feeds)[f.logits][:, -1]

    def start(self) -> np.ndarray:
        return self._run()

    def step(self, tokens: np.ndarray) -> np.ndarray:
        self.tgt = np.concatenate([self.tgt, tokens[:, None]], 1)
        return self._run()

    def reorder(self, rows: np.ndarray) -> None:
        self.tgt = self.tgt[rows]


# ----------------------------------------------------------------------------------------- loop ----

class Generator:
    """Opens the runners of one artifact once; `generate` can then be called repeatedly (benchmarks)."""

    def __init__(self, artifact: Artifact | str | Path, runner: str = "ort", *, use_cache: bool = True,
                 threads: int = 0, verify: bool = True, prefill_graph: str | None = None, kv_cache: str = "auto",
                 **options: Any) -> None:
        """`verify`: check the opened graphs against the artifact's golden probes on first open here (deploy/probes.py:
        a failure refuses with one line, ProbeFailure); False runs unchecked and says so on stderr.
        `prefill_graph`: a decoder whose decode graph prefills (one weight copy) may prefill with its full graph
        instead (`full_graph`, e.g. gpt's "model": every position's logits and `present`), a second runner with its
        own weights. Why: an int8-dynamic artifact's decode graph has uint8 weights (exact on every x86 class,
        onnxruntime's U8U8 kernel) and its full graph 7-bit int8 ones (U8S8: VNNI/AMX kernels where the CPU has
        them), so on such a CPU the full graph computes the prompt faster (docs/benchmarks.md).
        `kv_cache`: where the KV cache lives with use_cache. "engine": inside the runner's engine (a runner whose
        `keeps_cache` says it can: `ov` on an fp32 or fp16 artifact exported with an OpenVINO IR, whose stateful
        step prefills and decodes with one copy of the weights; an encoder-decoder's steps from BOS after its
        encoder, the engine holding the memory; `ort` on a decoder whose decode graph it rewrites to
        GroupQueryAttention, deploy/ort_cache.py); "paged": a decoder's engine cache in OpenVINO's PagedAttention
        form (blocks of cache slots the step allocates, deploy/ov_paged.py: a padded prompt position is never
        computed or stored); "loop": a buffer owned here, bound into the decode graph; "auto" (default): the
        engine where the runner can keep it and no other prefill graph is asked, on ov paged for a decoder (unless
        its cache is asked to be u8, which only the stateful step stores). Why paged by default: as fast at batch
        1 and up to 2.4x faster to the first token of a ragged batch (docs/generate.md, "The paged cache"). Why
        ort's by default: one fused attention node a layer instead of ~15 small ones, and no copy of the step's
        K/V: 1.04x (fp32) and 1.11x (int8-dynamic) a token on GPT-2 small, 1.5x on the tiny GPT
        (docs/generate.md)."""
        self.artifact = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
        self.feeds = f = decoding_feeds(self.artifact)
        self.seq2seq = self.artifact.capabilities.role == "encoder-decoder"
        self.vocab = self.artifact.vocabulary  # token facts from the manifest: no model code, no torch
        self.runner_spec, self.use_cache = runner, use_cache
        names = [g.name for g in self.artifact.spec.graphs]
        first = f.prefill_graph if use_cache else f.full_graph
        if prefill_graph is not None and prefill_graph != first:
            if not use_cache or self.artifact.capabilities.role != "decoder" or f.prefill_graph != f.decode_graph \
                    or prefill_graph != f.full_graph or f.present is None:
                raise XDeployError(f"prefill graph {prefill_graph!r}: expected {first!r} (this model's own) or, for a "
                                   "decoder whose decode graph prefills, its full graph "
                                   f"{f.full_graph!r} (its manifest declaring that graph's `present` output: "
                                   "re-export an older artifact), with the KV cache on")
            first = prefill_graph
        one = use_cache and first == f.decode_graph  # the decode graph prefills too: one runner, one weight copy
        need = [first] + ([f.decode_graph] if use_cache and not one else [])
        missing = [n for n in need if n not in names]
        if missing:
            raise XDeployError(f"artifact {self.artifact.path} lacks graph(s) {missing} needed for "
                               f"{'KV-cache' if use_cache else 'recompute'} generation; re-export it")
        if kv_cache not in KV_CACHES:
            raise one_of("KV cache", kv_cache, KV_CACHES)
        # a decoder's engine cache prefills with the stateful step itself (one runner); an encoder-decoder's runs
        # the encoder first, then the stateful step from BOS
        kind = runner_class(runner)
        self.engine_cache = kv_cache != "loop" and (one or (use_cache and self.seq2seq)) \
            and kind.keeps_cache(self.artifact, f.decode_graph)
        if kv_cache == "paged" and self.seq2seq:
            raise XDeployError(f"KV cache 'paged': {self.artifact.path} is an encoder-decoder; the PagedAttention "
                               "step is a decoder's (use --kv-cache engine)")
        if kv_cache == "paged" and not kind.pages_cache:
            raise XDeployError(f"KV cache 'paged': runner {runner!r} does not page its cache; expected runner ov "
                               "(OpenVINO's PagedAttention), or --kv-cache engine or loop")
        if kv_cache in ("engine", "paged") and not self.engine_cache:
            raise XDeployError(f"runner {runner!r} cannot keep the KV cache in its engine for {self.artifact.path}: "
                               "expected runner ov on an fp32 or fp16 artifact exported with --openvino-ir (its "
                               "stateful decode step), or ort on a decoder whose decode graph has a float32 cache "
                               "(rewritten to onnxruntime's GroupQueryAttention), the cache on and, for a decoder, "
                               "the decode graph prefilling; or keep it in the loop (kv_cache='loop', --kv-cache loop)")
        self.paged = self.engine_cache and kind.pages_cache and (
            kv_cache == "paged" or kv_cache == "auto" and not self.seq2seq and options.get("kv_precision") != "u8")
        step_options = options | {"stateful": True} | ({"paged": self.paged} if kind.pages_cache else {}) \
            if self.engine_cache else options
        self.prefill: Runner = open_runner(runner, self.artifact, first, threads=threads,
                                           **(step_options if one else options))
        self.decode: Runner | None = None
        self._steps = threading.local()  # cached_step: one engine-cache step per thread
        try:
            if use_cache:
                self.decode = self.prefill if one else open_runner(runner, self.artifact, f.decode_graph,
                                                                   threads=threads, **step_options)
                self.cache_layout = _cache_layout(self.decode.graph, f)
            self.probes = check_on_open(self.artifact, self._runners(), verify=verify)
        except BaseException:
            self.close()
            raise

    def _runners(self) -> list[Runner]:
        return [self.prefill] + ([self.decode] if self.decode not in (None, self.prefill) else [])

    def cached_step(self) -> CachedStep:
        """The decode runner's engine-cache step for this thread, made on first use and kept: each generation
        `reset`s it instead of making a new one. Why: a fresh step allocates and binds its cache buffers (and
        OpenVINO a fresh infer request) before the prompt can run: kept, the trained tiny GPT's first token took
        0.74x the time on ort (656 -> 496 us) and ~0.8x on ov (1245 -> 873 us; AMD Zen 4, 2 threads, 15
        interleaved rounds, docs/generate.md). One per thread because a step is not re-entrant; its buffers stay as
        large as the longest generation so far until `close`."""
        step = getattr(self._steps, "step", None)
        if step is None:
            if self.decode is None:
                raise XDeployError("this Generator runs without the KV cache (use_cache=False): it has no cached step")
            step = self._steps.step = self.decode.cached_step()
        return step

    def close(self) -> None:
        self._steps = threading.local()
        for r in self._runners():
            r.close()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- limits --
    @functools.cached_property
    def _limits(self) -> tuple[int, int]:
        """(the longest prompt or source, the positions a sequence may fill: a decoder's cache slots, an
        encoder-decoder's target), from the graphs' axes: looked up once, not at every call (a first token's time)."""
        f, spec, axes = self.feeds, self.artifact.spec, self.artifact.spec.axes
        # axis names from the graphs: the prompt's length, the cache's slots, the target's length (enc-dec)
        prompt_axis = _axis(self.prefill.graph, f.prompt_ids)
        cache_axis = _axis(spec.graph(f.decode_graph), f.cache_mask)
        if not self.seq2seq:
            return axes[prompt_axis].max, min(self.vocab.max_positions, axes[cache_axis].max, axes[prompt_axis].max)
        target_axis = _axis(spec.graph(f.full_graph), f.target_ids or "")
        return axes[prompt_axis].max, min(self.vocab.max_positions, axes[cache_axis].max, axes[target_axis].max)

    def _check_sizes(self, rows: list[list[int]], gc: GenerationConfig) -> None:
        axes = self.artifact.spec.axes
        n = len(rows) * gc.num_beams
        if n > axes["batch"].max:
            raise XDeployError(f"batch {len(rows)} x beams {gc.num_beams} = {n} rows exceeds the artifact's "
                               f"batch limit {axes['batch'].max}")
        v = self.vocab.size
        bad = [t for r in rows for t in r if not 0 <= t < v]
        if bad:
            raise XDeployError(f"prompt token id {bad[0]} is outside the vocabulary 0..{v - 1}")
        t = max(len(r) for r in rows)
        longest, limit = self._limits
        if not self.seq2seq:
            # cache slots: the prompt + every fed-back token (the last new token is never fed back)
            need = t + gc.max_new_tokens - 1
            if need > limit:
                raise XDeployError(f"prompt length {t} + {gc.max_new_tokens} new tokens needs {need} positions; "
                                   f"this model has {limit} (max_positions)")
        else:
            if t > longest:
                raise XDeployError(f"source length {t} exceeds the artifact's limit {longest}")
            if gc.max_new_tokens > limit:
                raise XDeployError(f"{gc.max_new_tokens} new tokens exceed this model's {limit} target positions")

    def _loop_mode(self) -> str:
        """The loop cache's mode, naming CUDA graphs where the decode runner replays its steps as one (ort-cuda:
        2.5-3.6x the same loop without them on an H200, docs/runners.md), so a record says which it timed."""
        return "cache (CUDA graphs)" if getattr(self.decode, "graphs", None) is not None else "cache"

    def generate(self, prompts: Any, config: GenerationConfig | None = None, *,
                 attention_mask: np.ndarray | None = None) -> Generation:
        """Generate for a batch of prompts (gpt: the text so far; transformer: the source sequence). The times are
        from this call (the prompts' checks and padding included), as AIPerf times a request's first token."""
        t0 = time.perf_counter()
        gc = config or GenerationConfig()
        gc.check()
        rows = normalize_prompts(prompts, attention_mask)
        self._check_sizes(rows, gc)
        seq2seq = self.seq2seq
        ids, mask = pad_rows(rows, "right" if seq2seq else "left",
                             self.vocab.pad_token_id or 0)
        eos = self.vocab.eos_token_id if gc.eos_token_id is None else gc.eos_token_id
        eos = None if eos is not None and eos < 0 else eos
        if not self.use_cache:
            engine_cls: type[_Steps] = _Recompute
        elif self.engine_cache:
            engine_cls = _Seq2SeqEngineCached if seq2seq else _EngineCached
        else:
            engine_cls = _Seq2SeqCached if seq2seq else _DecoderCached
        engine = engine_cls(self, ids, mask, gc.num_beams, gc.max_new_tokens)
        if gc.num_beams > 1:
            tokens, stop, scores, ttft, steps = _beam_search(engine, len(rows), gc, eos, t0)
        else:
            tokens, stop, ttft, steps = _greedy_or_sample(engine, len(rows), gc, eos, t0)
            scores = None
        total = time.perf_counter() - t0
        return Generation(tokens=tokens, stop=stop, scores=scores, prompt_lengths=tuple(len(r) for r in rows),
                          time_to_first_token_s=float(ttft), step_s=tuple(float(x) for x in steps), total_s=total,
                          mode=(("paged engine cache" if self.paged else "engine cache") if self.engine_cache
                                else self._loop_mode()) if self.use_cache else "recompute",
                          runner=self.runner_spec)


def _greedy_or_sample(engine: _Steps, b: int, gc: GenerationConfig, eos: int | None, t0: float
                      ) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...], float, list[float]]:
    # made only to sample: np.random.default_rng costs ~20 us, inside the first token's time
    rng = np.random.default_rng(gc.seed) if gc.do_sample else None
    out = np.zeros((b, gc.max_new_tokens), np.int64)
    done = np.zeros(b, bool)
    lengths = np.full(b, gc.max_new_tokens)
    stamps: list[float] = []  # perf_counter when each token was chosen
    logits = engine.start()
    for i in range(gc.max_new_tokens):
        if rng is not None:
            tok = sample(logits, rng, temperature=gc.temperature, top_k=gc.top_k, top_p=gc.top_p)
        else:
            tok = logits.argmax(-1)
        if eos is not None:  # without an EOS no row finishes early: nothing to mask (a few us a token)
            # finished rows keep running (the batch is one graph call) but their tokens are ignored
            tok = np.where(done, eos, tok)
            hit = (tok == eos) & ~done
            lengths[hit] = i + 1
            done |= hit
        out[:, i] = tok
        stamps.append(time.perf_counter())
        if i + 1 == gc.max_new_tokens or eos is not None and done.all():
            break
        logits = engine.step(tok)
    tokens = tuple(tuple(int(t) for t in out[r, :lengths[r]]) for r in range(b))
    stop = tuple("eos" if done[r] else "length" for r in range(b))
    return tokens, stop, stamps[0] - t0, list(np.diff(stamps))


def _beam_search(engine: _Steps, b: int, gc: GenerationConfig, eos: int | None, t0: float
                 ) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...], tuple[float, ...], float, list[float]]:
    """Hugging Face's beam search (transformers 5, early_stopping=False), vectorized over the batch in numpy.

    running: k live beams per row with summed log-probs; finished: the k best hypotheses that ended (EOS or
    max length), scored sum / generated_len ** length_penalty."""
    k, m, alpha = gc.num_beams, gc.max_new_tokens, gc.length_penalty
    keep = 2 * k  # candidates per row: enough that k survive even if k of them end in EOS
    run_seq = np.zeros((b, k, m), np.int64)
    run_score = np.zeros((b, k))
    run_score[:, 1:] = -1.0e9  # all beams start identical: only beam 0 may expand at the first step
    fin_seq = np.zeros((b, k, m), np.int64)
    fin_len = np.zeros((b, k), np.int64)
    fin_score = np.full((b, k), -1.0e9)
    fin_set = np.zeros((b, k), bool)
    open_rows = np.ones(b, bool)  # HF's is_early_stop_heuristic_unsatisfied
    stamps: list[float] = []
    logits = engine.start()
    for g in range(m):  # g tokens generated so far; this step picks token g + 1
        lp = log_softmax(logits).reshape(b, k, -1) + run_score[:, :, None]
        v = lp.shape[-1]
        flat = lp.reshape(b, k * v)
        top = np.argpartition(-flat, keep - 1, axis=-1)[:, :keep]
        top = np.take_along_axis(top, np.argsort(-np.take_along_axis(flat, top, -1), -1, kind="stable"), -1)
        top_score = np.take_along_axis(flat, top, -1)  # (b, 2k), best first
        beam, tok = top // v, top % v
        cand = np.take_along_axis(run_seq, beam[:, :, None], 1)  # (b, 2k, m)
        cand[:, :, g] = tok
        ends = (tok == eos) if eos is not None else np.zeros_like(tok, bool)
        if g + 1 == m:
            ends[:] = True  # max length: every candidate is a hypothesis
        # finished hypotheses: only the best k candidates may enter, and only while the row is open
        pen = top_score / float(g + 1) ** alpha
        pen = np.where(ends & (np.arange(keep) < k)[None] & open_rows[:, None], pen, -1.0e9)
        all_score = np.concatenate([fin_score, pen], 1)
        pick = np.argsort(-all_score, -1, kind="stable")[:, :k]
        fin_seq = np.take_along_axis(np.concatenate([fin_seq, cand], 1), pick[:, :, None], 1)
        fin_len = np.take_along_axis(np.concatenate([fin_len, np.full((b, keep), g + 1)], 1), pick, 1)
        fin_set = np.take_along_axis(np.concatenate([fin_set, pen > -1.0e9 / 2], 1), pick, 1)
        fin_score = np.take_along_axis(all_score, pick, 1)
        # running beams for the next step: the best k candidates that did not end
        live = top_score - ends * 1.0e9
        nxt = np.argsort(-live, -1, kind="stable")[:, :k]
        run_seq = np.take_along_axis(cand, nxt[:, :, None], 1)
        run_score = np.take_along_axis(live, nxt, 1)
        src_beam = np.take_along_axis(beam, nxt, 1)  # (b, k) which old beam each new beam continues
        # HF's early-stop heuristic: the best running beam at the current length vs the worst finished one
        worst = np.where(fin_set, fin_score, -1.0e9)
        open_rows &= (run_score[:, :1] / float(g + 1) ** alpha > worst).any(-1)
        stamps.append(time.perf_counter())
        if g + 1 == m or not open_rows.any() or ends.all():
            break
        engine.reorder((src_beam + np.arange(b)[:, None] * k).reshape(-1))
        logits = engine.step(run_seq[:, :, g].reshape(-1))
    tokens, stop = [], []
    for r in range(b):
        n = int(fin_len[r, 0])
        seq = tuple(int(t) for t in fin_seq[r, 0, :n])
        tokens.append(seq)
        stop.append("eos" if eos is not None and seq and seq[-1] == eos else "length")
    return (tuple(tokens), tuple(stop), tuple(float(s) for s in fin_score[:, 0]), stamps[0] - t0,
            list(np.diff(stamps)))


def generate(artifact: Artifact | str | Path, prompts: Any, config: GenerationConfig | None = None, *,
             runner: str = "ort", use_cache: bool = True, threads: int = 0,
             attention_mask: np.ndarray | None = None, verify: bool = True) -> Generation:
    """One-shot convenience over `Generator` (opens and closes the runners)."""
    with Generator(artifact, runner, use_cache=use_cache, threads=threads, verify=verify) as g:
        return g.generate(prompts, config, attention_mask=attention_mask)


# ------------------------------------------------------------------------------------ comparison ----

@dataclass(frozen=True)
class Agreement:
    """How a candidate's tokens compare with a reference's, row by row (fp16/int8 vs fp32)."""

    first_divergence: tuple[int | None, ...]  # per row: index of the first differing new token (None = none)
    agreement: float  # matching positions / compared positions, over all rows
    compared: int
    rows: int


def token_agreement(reference: Generation | Sequence[Sequence[int]], candidate: Generation | Sequence[Sequence[int]]
                    ) -> Agreement:
    """First divergence step and token agreement rate. Positions are compared up to the longer of the two
    rows (a missing token counts as a mismatch), so an early or late EOS is a disagreement."""
    ref = reference.tokens if isinstance(reference, Generation) else reference
    cand = candidate.tokens if isinstance(candidate, Generation) else candidate
    if len(ref) != len(cand):
        raise XDeployError(f"cannot compare {len(cand)} rows of tokens with {len(ref)} reference rows")
    firsts: list[int | None] = []
    same = total = 0
    for r, c in zip(ref, cand):
        n = max(len(r), len(c))
        eq = [i < len(r) and i < len(c) and r[i] == c[i] for i in range(n)]
        same += sum(eq)
        total += n
        firsts.append(next((i for i, e in enumerate(eq) if not e), None))
    return Agreement(first_divergence=tuple(firsts), agreement=same / total if total else 1.0, compared=total,
                     rows=len(ref))
