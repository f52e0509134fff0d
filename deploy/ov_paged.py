"""The stateful decode step in OpenVINO's PagedAttention form: the KV cache in blocks this module owns.

    open_runner("ov", art, "decode", stateful=True, paged=True)    # a decoder's stateful IR, rewritten

OpenVINO's own rewrite (`paged_attention_transformation`, the pass openvino-genai's continuous-batching backend
runs) turns each layer's ReadValue -> Concat -> SDPA -> Assign of the stateful IR into one PagedAttention node.
The tokens of every row are fed as one flat sequence (input_ids, position_ids: (n,)); the cache is one tensor per
layer and K/V of `blocks` fixed-size blocks ((blocks, nh, block, hs) on the CPU plugin), and each row names its
blocks (block_indices, block_indices_begins) and how many of its slots are filled (past_lens). Why: a padded
position is never computed (a ragged batch of four prompts on GPT-2 small gets its first token 1.8-2.4x sooner
than from the stateful step, and each token ~1.1x), and no input grows with the sequence (a few percent a step on
a 64-wide GPT); at batch 1 on GPT-2 small the two tie (docs/generate.md, "The paged cache").

`Blocks` allocates: a row owns a list of blocks, beams that continue one row share its full blocks, and a shared
block that is still being filled is copied before a row writes into it (copy on write), so a beam step copies at
most one block per row. There is no attention mask: a padded prompt position is simply not fed, so each row's
cache holds only its real tokens (the mask's meaning, exactly), and positions are given explicitly.

`PagedStep` is the decoding loop's CachedStep over it; `paged_decode` answers the decode graph's own call (cache in,
logits and the step's K/V out) through the same step, so golden probes and parity check the paged graph itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError

from .base import CachedStep
from .sessions import BoundInputs, ov_reason

# the PagedAttention form's inputs beside the per-layer caches (OpenVINO 2026's rewrite, no score outputs)
PAGED_INPUTS = ("past_lens", "subsequence_begins", "block_indices", "block_indices_begins", "max_context_len")
CACHE_PREFIXES = ("key_cache", "value_cache")
LOGITS_INDICES = "logits_indices"  # added here: the fed tokens whose logits the head computes


def paged_model(ov: Any, path: str, ids: str, positions: str, layers: int, logits: str) -> Any:
    """The stateful IR at `path`, read and rewritten to PagedAttention; refused in one line unless the rewrite gives
    exactly the step's ids and positions (rank 1), the block inputs and one key and value cache per layer. Every fed
    token is a row of the rewritten graph, so its head would compute every token's logits; a Gather of the rows
    `logits_indices` names (each sequence's last token) goes in front of the head (`gather_before_head`)."""
    try:
        from openvino._offline_transformations import paged_attention_transformation
    except ImportError:
        raise XDeployError(f"openvino {ov.get_version()} has no paged_attention_transformation: the ov option "
                           "paged=True needs openvino >= 2024.4") from None
    try:
        model = ov.Core().read_model(path)
        paged_attention_transformation(model)
    except Exception as e:  # openvino raises RuntimeError subclasses with multi-line messages
        raise XDeployError(f"OpenVINO cannot rewrite {path} to PagedAttention: {ov_reason(e)}"
                           ) from None
    gather_before_head(ov, model, logits)
    found = sorted(n for p in model.inputs for n in p.get_names())
    want = sorted([ids, positions, *PAGED_INPUTS, *cache_inputs(layers), LOGITS_INDICES])
    ranks = {n: p.get_partial_shape().rank.get_length() for p in model.inputs for n in p.get_names()}
    if found != want or ranks.get(ids) != 1 or ranks.get(positions) != 1:
        raise XDeployError(f"{path} does not rewrite to the expected PagedAttention step: expected inputs {want} "
                           f"(ids and positions of rank 1); found {found}")
    return model


def gather_before_head(ov: Any, model: Any, logits: str) -> None:
    """Insert Gather(rows, logits_indices, axis 0) before the MatMul whose result is output `logits` (the LM head:
    (n, 1, d) x (V, d)^T), so a prefill of T tokens computes one row of logits per sequence instead of T. Why:
    GPT-2 small's head is a third of its weights; at a 32-token prompt the other 31 rows cost the first token
    ~4 ms (openvino-genai's continuous-batching pipeline makes the same cut)."""
    import openvino.opset13 as ops

    outs = [o for o in model.outputs if logits in o.get_names()]
    if not outs:
        raise XDeployError(f"the PagedAttention step has no output {logits!r}; expected the manifest's logits")
    head = outs[0].get_node().input_value(0).get_node()
    if head.get_type_name() != "MatMul":
        raise XDeployError(f"the PagedAttention step's output {logits!r} is not a MatMul's (found "
                           f"{head.get_type_name()}); expected the LM head")
    idx = ops.parameter(ov.PartialShape([-1]), ov.Type.i64, name=LOGITS_INDICES)
    idx.output(0).set_names({LOGITS_INDICES})
    rows = ops.gather(head.input_value(0), idx, ops.constant(np.int64(0)))
    head.input(0).replace_source_output(rows.output(0))
    model.add_parameters([idx])
    model.validate_nodes_and_infer_types()


def cache_inputs(layers: int) -> list[str]:
    """The PagedAttention form's cache inputs, layer-major like DecoderFeeds.cache_names."""
    return [f"{p}.{i}" for i in range(layers) for p in CACHE_PREFIXES]


class Blocks:
    """Which cache blocks each row uses. `lens[r]` slots of row r are filled, in blocks `tables[r]` (slot s lives in
    block tables[r][s // size] at offset s % size); `ref[b]` counts the rows naming block b (0: free)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.ref = np.zeros(0, np.int32)
        self.version = 0  # bumped whenever the tables change: a request's block inputs are set again only when the
        # version it last saw is older
        self.reset()

    def reset(self) -> None:
        self.tables: list[list[int]] = []
        self.lens = np.zeros(0, np.int32)
        self.counts = np.zeros(0, np.int32)  # len(tables[r])
        self.ref[:] = 0
        self.version += 1

    @property
    def capacity(self) -> int:
        return len(self.ref)

    def _take(self) -> int:
        free = np.flatnonzero(self.ref == 0)
        if len(free) == 0:  # out of blocks: twice as many (the caller grows its tensors to `capacity`)
            free = np.array([self.capacity])
            self.ref = np.concatenate([self.ref, np.zeros(max(self.capacity, 4), np.int32)])
        b = int(free[0])
        self.ref[b] = 1
        return b

    def start(self, rows: int) -> None:
        """A new sequence of `rows` empty rows (after `reset`)."""
        self.tables = [[] for _ in range(rows)]
        self.lens = np.zeros(rows, np.int32)
        self.counts = np.zeros(rows, np.int32)
        self.version += 1

    def reorder(self, beam: np.ndarray) -> None:
        """Row r continues row beam[r]: the blocks are shared, not copied (`extend` copies a shared partial block
        before anything is written into it)."""
        new = [list(self.tables[b]) for b in beam]
        for t in new:
            self.ref[t] += 1
        for t in self.tables:
            self.ref[t] -= 1
        self.tables, self.lens, self.counts = new, self.lens[beam], self.counts[beam]
        self.version += 1

    def extend(self, k: np.ndarray) -> list[tuple[int, int]]:
        """Room for k[r] more slots in each row r; returns the block copies (source, destination) the caller must
        make first: a row's partly filled last block that other rows share is copied into a block of its own."""
        new = self.lens + k.astype(np.int32)
        todo = new > self.counts * self.size  # rows that need another block
        if self.ref.max(initial=0) > 1:  # blocks are shared (beams): a shared partial last block is copied
            todo |= (self.lens % self.size != 0) & (k > 0)
        copies = []
        for r in np.flatnonzero(todo).tolist():  # a decode step at batch 1: once every `size` steps
            t, used = self.tables[r], int(self.lens[r])
            if used % self.size and self.ref[t[-1]] > 1:
                b = self._take()
                copies.append((t[-1], b))
                self.ref[t[-1]] -= 1
                t[-1] = b
            for _ in range(-(-int(new[r]) // self.size) - len(t)):
                t.append(self._take())
            self.counts[r] = len(t)
            self.version += 1
        self.lens = new
        return copies

    def slots(self, r: int, first: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(block, offset) of slots first .. first + n - 1 of row r."""
        s = np.arange(first, first + n)
        return np.asarray(self.tables[r])[s // self.size], s % self.size


class _Lane:
    """One infer request the step runs on: its inputs bound once (BoundInputs), the logits port it reads, what its
    bound inputs were last set for (the step shape `key`, the block tables' `version`), and the cache tensors bound
    to it (`cache`, in its compiled model's cache types; shared with the other lane where those agree)."""

    def __init__(self, request: Any, compiled: Any, logits: Any, caches: Sequence[str], ov: Any) -> None:
        self.req, self.logits = request, logits
        self.inputs = BoundInputs(request, ov)
        self.key: tuple[int, int] | None = None
        self.version = -1
        ports = {n: p for p in compiled.inputs for n in p.get_names()}
        self.types = {n: ports[n].get_element_type() for n in caches}
        self.cache: dict[str, Any] = {}
        self.views: list[np.ndarray] = []  # each cache tensor's memory, block-major


class PagedStep(CachedStep):
    """The decoding loop's step on the PagedAttention graph (see CachedStep): row r's real new tokens (mask 1 at the
    step's positions) are fed; masked ones (a left-padded prompt) are not, so they never enter the cache.

    `steps`: (an infer request of a second compiled model of the same graph, that model, its logits port) that
    runs the calls feeding one token per row, while `request` runs the rest (prompts). Both read the same block
    tables; where both models store the cache in one type, both requests are bound to the same cache tensors and a
    sequence moves between them freely (OvRunner: a small decoder's steps on one thread, docs/generate.md). Where
    the types differ (bf16 arithmetic for prompts, f32 arithmetic on bf16 weights for steps: the CPU plugin's
    PagedAttention stores the cache in the compute precision), each lane has its own tensors and the blocks in use
    are converted when the sequence moves to the other lane (once a generation: after its prompt)."""

    def __init__(self, request: Any, compiled: Any, ids: str, positions: str, logits: Any, layers: int,
                 ov: Any, steps: tuple[Any, Any, Any] | None = None) -> None:
        self._ov = ov
        self.names = (ids, positions)
        self.caches = cache_inputs(layers)
        ports = {n: p for p in compiled.inputs for n in p.get_names()}
        # the CPU plugin fixes every dimension but the block count when it compiles: (blocks, nh, block, hs)
        shapes = {n: ports[n].get_partial_shape() for n in self.caches}
        if any(s.rank.get_length() != 4 or not all(s[i].is_static for i in (1, 2, 3)) for s in shapes.values()):
            raise XDeployError(f"unexpected PagedAttention cache shapes {sorted({str(s) for s in shapes.values()})}; "
                               "expected (?, heads, block, head size)")
        self.dims = {n: [s[i].get_length() for i in (1, 2, 3)] for n, s in shapes.items()}
        self.blocks = Blocks(self.dims[self.caches[1]][1])  # a value cache's (heads, block, head size)
        self._prompt = _Lane(request, compiled, logits, self.caches, ov)
        self._steps = self._prompt if steps is None else _Lane(steps[0], steps[1], steps[2], self.caches, ov)
        self._lanes = (self._prompt,) if steps is None else (self._prompt, self._steps)
        self._own = steps is not None and self._steps.types != self._prompt.types  # each lane its own tensors
        self._holder = self._prompt  # the lane whose cache tensors hold the sequence's K/V now
        # staging for _one_token and _infer: past_lens, the fed count of one row, max_context_len
        self._past, self._one = np.zeros(1, np.int32), np.ones(1, np.int64)
        self._longest = np.zeros((), np.int32)

    def reset(self) -> None:
        self.blocks.reset()
        self._holder = self._prompt  # nothing held: the next sequence starts where its prompt runs

    def hold(self, feeds: Mapping[str, np.ndarray]) -> None:
        if feeds:
            raise XDeployError("the PagedAttention step is a decoder's: it holds no encoder memory")

    @property
    def types(self) -> dict[str, Any]:
        """Each cache input's element type where the sequence's K/V are now."""
        return self._holder.types

    def _grow(self) -> None:
        """Cache tensors of `blocks.capacity` blocks, the filled ones copied over, bound to the request(s)."""
        n = self.blocks.capacity
        for lane in (self._lanes if self._own else self._lanes[:1]):
            for name in self.caches:
                old = lane.cache.get(name)
                t = self._ov.Tensor(lane.types[name], [n, *self.dims[name]])
                if old is not None:
                    t.data[:old.data.shape[0]] = old.data
                lane.cache[name] = t
            lane.views = [lane.cache[name].data for name in self.caches]
        if not self._own:
            self._steps.cache, self._steps.views = self._prompt.cache, self._prompt.views
        for lane in self._lanes:
            for name in self.caches:
                lane.req.set_tensor(name, lane.cache[name])

    def _move(self, lane: _Lane) -> None:
        """The blocks in use, converted from the holder's cache tensors into `lane`'s (their types differ), which
        then holds the sequence: once a generation, after its prompt (a few MB after GPT-2 small's 32-token prompt)."""
        used = np.flatnonzero(self.blocks.ref > 0)
        src = self._holder
        for name, a, b in zip(self.caches, src.views, lane.views):
            b[used] = _from_f32(_to_f32(a[used], src.types[name]), lane.types[name])
        self._holder = lane

    def reserve(self, k: np.ndarray) -> np.ndarray:
        """Room for k[r] more slots in each row r (blocks taken, a shared partial block copied, the cache tensors
        grown when out of blocks); returns the rows' filled slots before."""
        past = self.blocks.lens
        copies = self.blocks.extend(k)
        if self.blocks.capacity > (self._prompt.views[0].shape[0] if self._prompt.views else 0):
            self._grow()
        for src, dst in copies:  # copy on write: a shared block this row is about to fill
            for v in self._holder.views:
                v[dst] = v[src]
        return past

    def run(self, ids: np.ndarray, positions: np.ndarray, k: np.ndarray, key: tuple[int, int] | None = None
            ) -> np.ndarray:
        """Feed row r's next k[r] tokens (ids and positions flat, row after row); returns each row's last token's
        logits (N, V), a view of the request's output valid until the next call. `key` (rows, tokens per row), when
        every row feeds the same count: inputs that only depend on it are set again only when it changes (a decode
        step at batch 1 sets four small inputs; its Python is a tenth of a 64-wide GPT's step)."""
        if not (k > 0).all():
            raise XDeployError(f"PagedAttention step: row(s) {np.flatnonzero(k <= 0).tolist()} feed no token; "
                               "expected at least one real (mask 1) token per row and step")
        past = self.reserve(k)
        return self._infer(ids, positions, past, int(self.blocks.lens.max()), k, key)

    def _infer(self, ids: np.ndarray, positions: np.ndarray, past: np.ndarray, longest: int, k: np.ndarray,
               key: tuple[int, int] | None) -> np.ndarray:
        """Set the inputs of the request that runs this call (one token a row: the steps'; else the prompts') and
        infer: `past` the rows' filled slots before, `longest` the longest row after."""
        blocks = self.blocks
        lane = self._steps if key is not None and key[1] == 1 else self._prompt
        if lane is not self._holder and self._own:
            self._move(lane)
        inputs = lane.inputs
        inputs.set(self.names[0], ids)
        inputs.set(self.names[1], positions)
        inputs.set("past_lens", past)
        self._longest[...] = longest
        inputs.set("max_context_len", self._longest)
        if key is None or key != lane.key:
            ends = np.cumsum(k)
            inputs.set("subsequence_begins", np.concatenate([[0], ends]).astype(np.int32))
            inputs.set(LOGITS_INDICES, (ends - 1).astype(np.int64))
            lane.key = key
        if lane.version != blocks.version:
            inputs.set("block_indices", np.fromiter((b for t in blocks.tables for b in t), np.int32))
            inputs.set("block_indices_begins", np.concatenate([[0], np.cumsum(blocks.counts)]).astype(np.int32))
            lane.version = blocks.version
        lane.req.infer()
        return lane.req.get_tensor(lane.logits).data[:, 0]

    def _one_token(self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The decoding loop's step at batch 1, its most common call (one real token, the row not moved), in scalar
        arithmetic: the general path's array bookkeeping and checks were ~25 us of a ~150 us step on the trained
        tiny GPT (docs/generate.md). The same check of the mask, the same inputs; a step that needs a new block
        takes the general path."""
        blocks = self.blocks
        used = int(blocks.lens[0])
        if int(mask.sum()) != used + 1:
            raise _mask_mismatch([int(mask.sum())], [used + 1])
        if used == int(blocks.counts[0]) * blocks.size:  # the last block is full: `extend` takes one
            return self.run(ids.reshape(-1), positions.reshape(-1), self._one, (1, 1))
        blocks.lens[0] = used + 1  # one row names its blocks alone: nothing shared to copy
        self._past[0] = used
        return self._infer(ids.reshape(-1), positions.reshape(-1), self._past, used + 1, self._one, (1, 1))

    def __call__(self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, beam: np.ndarray) -> np.ndarray:
        n, s = ids.shape
        blocks = self.blocks
        if n == 1 == s and len(blocks.tables) == 1 and beam[0] == 0 and mask[0, -1] != 0:
            return self._one_token(ids, positions, mask)
        fresh = not blocks.tables
        moved = not fresh and (len(beam) != len(blocks.tables) or (beam != np.arange(len(beam))).any())
        lens = np.zeros(n, np.int32) if fresh else blocks.lens[beam] if moved else blocks.lens
        real = mask[:, -s:] != 0
        k = np.full(n, s, np.int64) if real.all() else real.sum(1)
        # the mask says which positions are real, and the cache holds exactly those: checked before anything moves
        if (mask.sum(1) != lens + k).any():
            raise _mask_mismatch(mask.sum(1).tolist(), (lens + k).tolist())
        if fresh:
            blocks.start(n)
        elif moved:
            blocks.reorder(beam)
        if real.all():
            return self.run(ids.reshape(-1), positions.reshape(-1), k, (n, s))
        return self.run(ids[real], positions[real], k)

    # -- the decode graph's own call (golden probes, parity) --
    def write(self, r: int, first: int, kv: Sequence[np.ndarray]) -> None:
        """Store K/V for slots first.. of row r: kv[i] (nh, n, hs) float32 for cache input i."""
        blocks, offsets = self.blocks.slots(r, first, kv[0].shape[1])
        types = self.types
        for name, view, a in zip(self.caches, self._holder.views, kv):
            view[blocks, :, offsets] = _from_f32(a.transpose(1, 0, 2), types[name])  # (n, nh, hs)

    def read(self, r: int, first: int, n: int) -> list[np.ndarray]:
        """K/V of slots first .. first + n - 1 of row r, float32 (nh, n, hs) per cache input."""
        blocks, offsets = self.blocks.slots(r, first, n)
        types = self.types
        return [_to_f32(view[blocks, :, offsets], types[name]).transpose(1, 0, 2)
                for name, view in zip(self.caches, self._holder.views)]


def _mask_mismatch(marks: list[int], holds: list[int]) -> XDeployError:
    return XDeployError(f"PagedAttention step: the mask marks {marks} real positions per row, the cache would hold "
                        f"{holds}; expected a mask that only ever adds real positions")


def _to_f32(a: np.ndarray, ov_type: Any) -> np.ndarray:
    name = ov_type.get_type_name()
    if name == "bf16":  # OpenVINO hands bf16 memory over as a 2-byte numpy view: widen the bits
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if name in ("f32", "f16"):
        return a.astype(np.float32)
    raise XDeployError(f"PagedAttention cache of type {name}: expected f32, bf16 or f16")


def _from_f32(a: np.ndarray, ov_type: Any) -> np.ndarray:
    name = ov_type.get_type_name()
    if name == "bf16":  # round to nearest even, as the CPU plugin's own conversion
        from xdeploy.export.openvino_ir import round_to_bf16

        out = np.empty(a.shape, np.uint16)
        round_to_bf16(np.ascontiguousarray(a, np.float32).view(np.uint32), out)
        return out.view(np.float16)
    if name in ("f32", "f16"):
        return a.astype(np.float32 if name == "f32" else np.float16)
    raise XDeployError(f"PagedAttention cache of type {name}: expected f32, bf16 or f16")


def paged_decode(step: PagedStep, ids: np.ndarray, positions: np.ndarray, cache: Sequence[np.ndarray],
                 cache_mask: np.ndarray, step_mask: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """The decode graph's call on the paged step: `cache` (N, nh, P, hs) per cache input with `cache_mask` (N, P),
    then the step's ids/positions (N, S) with `step_mask`. A row's cached real positions are stored in its blocks
    and its step tokens fed, save masked ones before a real token (a masked token after the last real one only
    attends; nothing real attends to it). Returns the last step position's logits (N, 1, V), as the graph does, and
    the step's K/V, (N, nh, S, hs) per cache input; an unfed token's are zeros, as meaningless as the graph's at a
    masked position."""
    n, s = ids.shape
    step.reset()
    step.blocks.start(n)
    past = (cache_mask != 0).sum(1)
    step.reserve(past)
    for r in range(n):
        keep = np.flatnonzero(cache_mask[r] != 0)
        if len(keep):
            step.write(r, 0, [c[r][:, keep] for c in cache])
    # fed: real tokens and the masked ones after a row's last real token
    real = step_mask != 0
    fed = real | (np.cumsum(real[:, ::-1], 1)[:, ::-1] == 0)
    k = fed.sum(1)
    key = (n, int(k[0])) if (k == k[0]).all() else None  # one token a row: the steps' request runs it, as in a loop
    logits = np.array(step.run(ids[fed], positions[fed], k, key)[:, None], copy=True)  # (N, 1, V): S - 1 is fed
    new = [np.zeros((n, c.shape[1], s, c.shape[3]), np.float32) for c in cache]
    for r in range(n):
        cols = np.flatnonzero(fed[r])
        for dst, kv in zip(new, step.read(r, int(past[r]), len(cols))):
            dst[r][:, cols] = kv
    return logits, new
