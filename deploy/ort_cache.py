"""The KV cache kept inside onnxruntime: a decoder's decode graph with each layer's attention rewritten, at load
time, to onnxruntime's fused `com.microsoft.GroupQueryAttention`, which writes the step's K/V into the cache in
place.

    open_runner("ort", art, "decode", stateful=True)    # the decode graph rewritten; cached_step() drives it

Why: a decode step of the portable graph (models/attention.py `_attend_two`) runs ~15 small nodes per layer around
its two weight GEMMs (Split, 3 Reshape/Transpose pairs, 2 score MatMuls, scale Muls, mask Adds, Concat, Softmax,
2 Slices, 2 MatMuls, Add, Transpose, Reshape), and the loop then copies the step's K/V into its buffer. On 2 cores
onnxruntime spent ~0.25 ms a layer on them, in kernels and between kernels: ~3 ms of GPT-2 small's 11.6 ms
int8-dynamic step (docs/generate.md, "onnxruntime's own cache"). GroupQueryAttention is one kernel per layer over
the packed QKV projection, with the cache bound as both its past and its present (the same buffer: onnxruntime
then appends in place).

The rewrite reads the graph without its weights, replaces per layer the nodes from the QKV projection's Split to
the Reshape before the output projection by one GroupQueryAttention node, drops the `new_kv` output and the
`step_mask` input, adds two inputs (`seqlens_k`: the filled slots before the last new token, per row;
`total_sequence_length`), and keeps `cache_mask` as the attention mask over the cache's slots (its additive bias
is built in the graph from the mask's first total_sequence_length columns). The session loads the weights from
the artifact's own external-data file (no second copy on disk). A graph whose attention does not have that form
(a foreign ONNX, an encoder-decoder, a cache not float32, a head size not a multiple of 8) is not rewritten:
`fused_graph` says why, `OrtRunner.keeps_cache` says no, and the loop keeps the cache. Golden probes and parity check
the rewritten graph through the decode graph's own call (`decode_call`: the given cache copied into a buffer with
room for the step).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError, ort_reason
from xdeploy.models.spec import MASK_VALUE, DecoderFeeds

from .base import CachedStep

SEQLENS = "seqlens_k"  # (N,) int32: slots filled before the last new token (GroupQueryAttention's seqlens_k)
TOTAL = "total_sequence_length"  # () int32: slots attended after this step
PRESENT = "present"  # outputs present.<i>.key / .value: the cache, bound to the same buffer as its input


def present_names(layers: int) -> tuple[str, ...]:
    return tuple(f"{PRESENT}.{i}.{kv}" for i in range(layers) for kv in ("key", "value"))


class _Graph:
    """Producer and consumer lookups over a GraphProto's nodes."""

    def __init__(self, graph: Any) -> None:
        self.producer = {o: n for n in graph.node for o in n.output}
        self.consumers: dict[str, list[Any]] = {}
        for n in graph.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)

    def only_consumer(self, tensor: str, op: str) -> Any:
        found = [n for n in self.consumers.get(tensor, []) if n.op_type != "Shape"]  # shape arithmetic aside
        if len(found) != 1 or found[0].op_type != op:
            raise _NoMatch(f"{tensor} is not read by one {op}")
        return found[0]

    def made_by(self, tensor: str, op: str) -> Any:
        n = self.producer.get(tensor)
        if n is None or n.op_type != op:
            raise _NoMatch(f"{tensor} is not made by a {op}")
        return n


class _NoMatch(Exception):
    """The decode graph's attention is not the form this rewrite knows (internal: `fused_graph` says why)."""


def _perm(node: Any) -> list[int]:
    import onnx

    return next((list(onnx.helper.get_attribute_value(a)) for a in node.attribute if a.name == "perm"), [])


def _layer(g: _Graph, key: str, value: str) -> tuple[str, Any]:
    """One layer's attention: the packed QKV tensor (B, S, 3C) its query, key and value are split from, and the
    Reshape that makes its output (B, S, C) for the output projection (the node the fused op replaces; what only
    it read is then dead, and `prune` drops it)."""
    kt = g.only_consumer(key, "Transpose")  # K^T of the cache: (B, nh, hs, C)
    if _perm(kt) != [0, 1, 3, 2]:
        raise _NoMatch(f"{key} is not transposed to (B, nh, hs, C)")
    scores = g.only_consumer(kt.output[0], "MatMul")  # q @ K^T
    q = g.made_by(scores.input[0], "Transpose")  # (B, nh, S, hs)
    heads = g.made_by(q.input[0], "Reshape")
    split = g.made_by(heads.input[0], "Split")
    if len(split.output) != 3 or split.output[0] != heads.input[0] or _perm(q) != [0, 2, 1, 3]:
        raise _NoMatch("the query is not the first of a three-way Split of one projection")
    pv = g.only_consumer(value, "MatMul")  # p[..., :C] @ V
    add = g.only_consumer(pv.output[0], "Add")  # + p[..., C:] @ v_new
    out_t = g.only_consumer(add.output[0], "Transpose")
    if _perm(out_t) != [0, 2, 1, 3]:
        raise _NoMatch("the attention output is not transposed back to (B, S, nh, hs)")
    return split.input[0], g.only_consumer(out_t.output[0], "Reshape")


def fuse_attention(model: Any, f: DecoderFeeds) -> int:
    """Rewrite `model` (a decode graph's ModelProto, weights not loaded) in place as described above; returns its
    layer count. Raises _NoMatch when the graph is not of the form this knows."""
    import onnx
    from onnx import TensorProto, helper

    from xdeploy.export.onnx_graph import prune

    graph = model.graph
    inputs = {t.name: t for t in graph.input}
    layers = 0
    while f"{f.cache}.{layers}.key" in inputs:
        layers += 1
    names = f.cache_names(layers)
    if not layers or any(n not in inputs for n in names) or f.step_ids not in inputs or f.cache_mask not in inputs \
            or f.logits not in {o.name for o in graph.output}:
        raise _NoMatch("the graph lacks the decoding feeds' cache, ids, cache_mask or logits")
    t = inputs[names[0]].type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    if t.elem_type != TensorProto.FLOAT or len(dims) != 4 or not dims[1] or not dims[3]:
        raise _NoMatch("the cache is not float32 (batch, heads, slots, head size)")
    if dims[3] % 8:
        raise _NoMatch(f"head size {dims[3]} is not a multiple of 8, which GroupQueryAttention needs")
    heads = dims[1]
    g = _Graph(graph)
    found = [_layer(g, names[2 * i], names[2 * i + 1]) for i in range(layers)]
    # the attention bias over the cache's first `total` slots, built once: (N, 1, S, total), MASK_VALUE where the
    # mask is 0 (models/attention.py's additive mask, so a fully padded row stays finite)
    c = "xdeploy_gqa"
    consts = {f"{c}.zero": np.array([0], np.int64), f"{c}.one": np.array([1], np.int64),
              f"{c}.one_f": np.array(1.0, np.float32), f"{c}.mask_value": np.array(MASK_VALUE, np.float32),
              f"{c}.axes12": np.array([1, 2], np.int64), f"{c}.ones2": np.array([1, 1], np.int64)}
    graph.initializer.extend(onnx.numpy_helper.from_array(v, k) for k, v in consts.items())
    mk = helper.make_node
    bias_nodes = [
        mk("Cast", [TOTAL], [f"{c}.total64"], to=TensorProto.INT64),
        mk("Reshape", [f"{c}.total64", f"{c}.one"], [f"{c}.end"]),
        mk("Slice", [f.cache_mask, f"{c}.zero", f"{c}.end", f"{c}.one"], [f"{c}.mask"]),  # (N, total)
        mk("Cast", [f"{c}.mask"], [f"{c}.maskf"], to=TensorProto.FLOAT),
        mk("Sub", [f"{c}.one_f", f"{c}.maskf"], [f"{c}.masked"]),
        mk("Mul", [f"{c}.masked", f"{c}.mask_value"], [f"{c}.bias2"]),
        mk("Unsqueeze", [f"{c}.bias2", f"{c}.axes12"], [f"{c}.bias4"]),  # (N, 1, 1, total)
        mk("Shape", [f.step_ids], [f"{c}.ids_shape"], start=1, end=2),  # [S]
        mk("Concat", [f"{c}.ones2", f"{c}.ids_shape", f"{c}.one"], [f"{c}.expand"], axis=0),  # [1, 1, S, 1]
        mk("Expand", [f"{c}.bias4", f"{c}.expand"], [f"{c}.bias"]),  # (N, 1, S, total)
    ]
    fused = {reshape.output[0]: mk("GroupQueryAttention",
                                   [qkv, "", "", names[2 * i], names[2 * i + 1], SEQLENS, TOTAL, "", "", "",
                                    f"{c}.bias"],
                                   [reshape.output[0], f"{PRESENT}.{i}.key", f"{PRESENT}.{i}.value"],
                                   name=f"{c}.layer{i}", domain="com.microsoft", num_heads=heads,
                                   kv_num_heads=heads)
             for i, (qkv, reshape) in enumerate(found)}
    # topological order: the bias first (it reads only graph inputs), each fused node where its Reshape was
    nodes = bias_nodes + [fused.get(n.output[0], n) if n.op_type == "Reshape" else n for n in graph.node]
    del graph.node[:]
    graph.node.extend(nodes)
    # inputs: drop step_mask, add seqlens_k and total_sequence_length; outputs: logits and the presents
    cache_vi = {n: inputs[n] for n in names}
    keep_in = [t for t in graph.input if t.name != f.step_mask]
    del graph.input[:]
    graph.input.extend(keep_in + [helper.make_tensor_value_info(SEQLENS, TensorProto.INT32, ["batch"]),
                                  helper.make_tensor_value_info(TOTAL, TensorProto.INT32, [])])
    logits = next(o for o in graph.output if o.name == f.logits)
    presents = []
    for n, p in zip(names, present_names(layers)):
        vi = onnx.ValueInfoProto.FromString(cache_vi[n].SerializeToString())
        vi.name = p
        presents.append(vi)
    prune(model, [f.logits] + list(present_names(layers)))
    del graph.output[:]
    graph.output.extend([logits] + presents)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return layers


class OrtCachedStep(CachedStep):
    """The rewritten decode graph driven with the cache in buffers this step owns, one (N, nh, capacity, hs) view per
    layer and tensor of one (L, 2, N, nh, capacity, hs) array, each bound as the layer's past *and* present, so
    onnxruntime writes the step's K/V into slot `seqlens_k` itself and nothing is copied back. The capacity grows
    by doubling (the filled slots copied once each time); a beam step gathers the filled slots of the rows it
    continues (see CachedStep). A prompt is one call with no past (GroupQueryAttention's prompt case); onnxruntime
    takes more than one new token after a past only at batch 1, which the decoding loop never asks."""

    def __init__(self, session: Any, f: DecoderFeeds, layers: int, heads: int, head_size: int, vocab: int,
                 prefill: Any = None) -> None:
        """`prefill`: a session of the same graph that runs calls of several tokens (a prompt), writing the same
        cache buffers (OrtRunner's signed-weight prefill); None: `session` runs every call."""
        self.session, self.f, self.layers, self.heads, self.head_size, self.vocab = \
            session, f, layers, heads, head_size, vocab
        self.prefill = prefill
        self.cache = np.zeros((layers, 2, 0, heads, 0, head_size), np.float32)
        self.mask = np.zeros((0, 0), np.int64)
        self.rows = self.filled = 0
        # (n, s) -> binding, buffers, the session it binds
        self._calls: dict[tuple[int, int], tuple[Any, dict[str, np.ndarray], Any]] = {}

    def reset(self) -> None:
        self.rows = self.filled = 0

    def hold(self, feeds: Mapping[str, np.ndarray]) -> None:
        raise XDeployError("onnxruntime's engine cache is a decoder's: an encoder-decoder keeps its cache in the loop")

    def _reserve(self, n: int, slots: int) -> None:
        """Room for n rows and `slots` slots, the filled ones kept."""
        _, _, rows, _, cap, _ = self.cache.shape
        if n <= rows and slots <= cap:
            return
        rows, cap = max(n, rows), max(slots, 2 * cap, 64)
        cache = np.zeros((self.layers, 2, rows, self.heads, cap, self.head_size), np.float32)
        mask = np.zeros((rows, cap), np.int64)
        k, s = self.rows, self.filled
        cache[:, :, :k, :, :s] = self.cache[:, :, :k, :, :s]
        mask[:k, :s] = self.mask[:k, :s]
        self.cache, self.mask = cache, mask
        self._calls.clear()  # bound to the old buffers

    def _call(self, n: int, s: int) -> tuple[Any, dict[str, np.ndarray], Any]:
        """The IO binding for n rows of s new tokens over the current buffers (made once per shape), its buffers and
        the session it binds."""
        key = (n, s)
        if key in self._calls:
            return self._calls[key]
        f = self.f
        buf = {f.step_ids: np.zeros((n, s), np.int64), f.positions: np.zeros((n, s), np.int64),
               f.cache_mask: self.mask[:n], SEQLENS: np.zeros(n, np.int32), TOTAL: np.zeros((), np.int32),
               f.logits: np.zeros((n, 1, self.vocab), np.float32)}
        session = self.prefill if s > 1 and self.prefill is not None else self.session
        binding = session.io_binding()
        for name in (f.step_ids, f.positions, f.cache_mask, SEQLENS, TOTAL):
            binding.bind_cpu_input(name, buf[name])
        out = buf[f.logits]
        binding.bind_output(f.logits, "cpu", 0, out.dtype, list(out.shape), out.ctypes.data)
        for i, (name, present) in enumerate(zip(f.cache_names(self.layers), present_names(self.layers))):
            view = self.cache[i // 2, i % 2, :n]  # (n, nh, capacity, hs), C-contiguous
            binding.bind_cpu_input(name, view)
            binding.bind_output(present, "cpu", 0, view.dtype, list(view.shape), view.ctypes.data)
        self._calls[key] = binding, buf, session
        return binding, buf, session

    def __call__(self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, beam: np.ndarray) -> np.ndarray:
        n, s = ids.shape
        total = mask.shape[1]
        past = total - s
        if past != self.filled:
            raise XDeployError(f"the engine cache holds {self.filled} slots; the mask says {past} before this step")
        # rows moved (beams): at batch 1 a scalar test, since array_equal was ~4 us of a 60 us tiny-GPT step
        if past and (beam[0] != 0 if n == self.rows == 1 else not np.array_equal(beam, np.arange(self.rows))):
            self._reserve(n, total)
            # row r continues row beam[r]: the filled slots gathered (np.take copies before writing)
            self.cache[:, :, :n, :, :past] = np.take(self.cache[:, :, :self.rows, :, :past], beam, axis=2)
        self._reserve(n, total)
        self.rows = n
        binding, buf, session = self._call(n, s)
        buf[self.f.step_ids][:] = ids
        buf[self.f.positions][:] = positions
        self.mask[:n, :total] = mask
        buf[SEQLENS][:] = total - 1
        buf[TOTAL][...] = total
        try:
            session.run_with_iobinding(binding)
        except Exception as e:  # onnxruntime's own exception types
            raise XDeployError(f"onnxruntime's cached decode step failed: {ort_reason(e)}") from None
        self.filled = total
        return buf[self.f.logits][:, -1]


@functools.lru_cache(maxsize=32)
def _fused(path: str, size: int, mtime_ns: int, f: DecoderFeeds) -> tuple[bytes, int, str]:
    """The rewritten graph of the decode graph file at `path` serialized (without weights: kilobytes), its layer
    count and '' -- or (b'', 0, why it does not rewrite). Once per file version: `keeps_cache` asks, then the
    runner opens it."""
    from xdeploy.export.onnx_graph import read_onnx

    model = read_onnx(Path(path))
    try:
        layers = fuse_attention(model, f)
    except _NoMatch as e:
        return b"", 0, str(e)
    return model.SerializeToString(), layers, ""


@functools.lru_cache(maxsize=1)
def _gqa_inputs() -> tuple[str, ...]:
    """The inputs of this onnxruntime's GroupQueryAttention (older releases lack `attention_bias`)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    for schema in C.get_all_operator_schema():
        if schema.name == "GroupQueryAttention" and schema.domain == "com.microsoft":
            return tuple(i.name for i in schema.inputs)
    return ()


def fused_graph(artifact: Any, graph: str) -> tuple[bytes, int, str]:
    """(the rewritten decode graph serialized, its layers, '') for `graph` of `artifact`, or (b'', 0, why not): a
    decoder's float32-cache decode graph of the form models/attention.py exports (not an encoder-decoder's, whose
    cache sits beside the cross-attention's held memory), on an onnxruntime whose GroupQueryAttention takes an
    attention bias."""
    if "attention_bias" not in _gqa_inputs()[10:11]:
        import onnxruntime as ort

        return b"", 0, f"onnxruntime {ort.__version__}'s GroupQueryAttention takes no attention_bias (input 10)"
    f = artifact.capabilities.decoding
    if f is None or artifact.capabilities.role != "decoder" or graph != f.decode_graph or f.step_mask is None:
        return b"", 0, "not a decoder's decode graph that prefills (its manifest declares no step_mask)"
    path = artifact.onnx_path(graph)
    st = path.stat()
    return _fused(str(path), st.st_size, st.st_mtime_ns, f)


def decode_call(session: Any, f: DecoderFeeds, layers: int, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The decode graph's own call (its cache in; logits and the step's K/V out) on the rewritten graph: each row's
    cache copied into a buffer with room for the step, which the fused op fills at slots [C, C + S). Golden probes
    and parity check the rewritten graph through it. Row by row when a step has several tokens (onnxruntime takes
    several new tokens after a past only at batch 1)."""
    ids = feeds[f.step_ids]
    n, s = ids.shape
    names = f.cache_names(layers)
    c = feeds[names[0]].shape[2]
    step_mask = feeds[f.step_mask] if f.step_mask in feeds else np.ones((n, s), np.int64)
    mask = np.concatenate([feeds[f.cache_mask], step_mask], 1).astype(np.int64)
    logits, new = [], []
    for rows in ([slice(0, n)] if s == 1 else [slice(r, r + 1) for r in range(n)]):
        k = len(range(n)[rows])
        run = {f.step_ids: ids[rows], f.positions: feeds[f.positions][rows], f.cache_mask: mask[rows],
               SEQLENS: np.full(k, c + s - 1, np.int32), TOTAL: np.array(c + s, np.int32)}
        run |= {name: np.ascontiguousarray(feeds[name][rows]) for name in names}
        try:
            out = session.run(None, run)  # logits, then each layer's present (k, nh, C + S, hs)
        except Exception as e:  # onnxruntime's own exception types
            raise XDeployError(f"onnxruntime's cached decode step failed: {ort_reason(e)}") from None
        logits.append(out[0])
        new.append(np.stack([p[:, :, c:c + s] for p in out[1:]]))  # (2L, k, nh, S, hs)
    kv = np.concatenate(new, 1)
    return {f.logits: np.concatenate(logits, 0), f.new_kv: kv.reshape(layers, 2, *kv.shape[1:])}


def signed_prefill_applies(artifact: Any, fp: Mapping[str, Any] | None = None) -> bool:
    """Whether the rewritten graph also gets a prefill session with its uint8 weights shifted to int8 (below): an
    int8-dynamic artifact on an x86 CPU whose int8 GEMM adds u8*s8 products in int32 (VNNI or AMX: exact). On a CPU
    without them (AVX2's vpmaddubsw adds pairs in saturating int16) 8-bit int8 weights could be clipped, which is
    why int8-dynamic stores uint8 weights at all (export/saturation.py). `fp`: the machine (default this one's;
    tests model the other classes)."""
    from xdeploy.core.fingerprint import fingerprint, int8_dot

    return artifact.precision == "int8-dynamic" and int8_dot(dict(fp) if fp is not None else fingerprint()) in (
        "vnni", "amx")


def signed_steps_apply(artifact: Any, fp: Mapping[str, Any] | None = None) -> bool:
    """Whether the int8-weight session also runs the one-token decode steps (the uint8 session then released: one
    copy of the weights): where signed_prefill_applies and the int8 dot product is VNNI, not AMX. On AMD Zen 4
    (AVX-512 VNNI) a GPT-2 small int8-dynamic step took 6.24 ms on it against 6.78 ms on the uint8 session (1.07x
    by the median of 12 interleaved rounds, the same tokens); on Xeon model 207 (AMX) it was slower, 0.81x
    [0.78-0.91] a step (docs/generate.md). `fp`: the machine (default this one's; tests model the other classes)."""
    from xdeploy.core.fingerprint import fingerprint, int8_dot

    machine = dict(fp) if fp is not None else fingerprint()
    return signed_prefill_applies(artifact, machine) and int8_dot(machine) == "vnni"


INT8_WEIGHTS = "int8-weights.data"  # the weights' file in the folder `signed_weights` writes
COPY_CHUNK = 16 << 20  # bytes copied (and shifted) at a time into it


def _shifted(a: np.ndarray) -> np.ndarray:
    """uint8 w -> int8 w - 128: the top bit flipped (w ^ 0x80 read as int8), with no wider temporary."""
    return (a ^ np.uint8(0x80)).view(np.int8)


def _external(t: Any, folder: Path) -> tuple[Path, int, int]:
    """(file, offset, length) of an initializer stored as external data, checked (the graph is untrusted input): a
    file inside `folder` (export/onnx_graph.py `check_external_data`'s rule), the range inside it, as long as the
    tensor's dims say."""
    from onnx.helper import tensor_dtype_to_np_dtype

    info = {e.key: e.value for e in t.external_data}
    src = (folder / info.get("location", "")).resolve()
    try:
        want = int(np.prod(t.dims, dtype=np.int64)) * tensor_dtype_to_np_dtype(t.data_type).itemsize
        offset, length = int(info.get("offset", 0)), int(info["length"])
        inside = src != folder.resolve() and src.is_relative_to(folder.resolve())
        size = src.stat().st_size if inside and src.is_file() else -1
    except (KeyError, ValueError, OSError):
        want = size = offset = length = -1
    if size < 0 or offset < 0 or length != want or offset + length > size:
        raise XDeployError(f"initializer {t.name!r}: external data {info} must name a file in {folder} holding "
                           f"its {want} bytes")
    return src, offset, length


def signed_weights(model: Any, folder: str | Path, out: str | Path) -> int:
    """In place: every MatMulInteger's uint8 weight and zero point (initializers) become int8, w - 128 and zp - 128;
    returns how many MatMuls. (w - zp) is unchanged, so the integer products are the same; onnxruntime then runs
    its u8*s8 kernels (VNNI/AMX), which on a prompt of 32 tokens were 2.1-2.5x faster than its u8*u8 ones, and at
    one token 0.8x on AMX, 1.07x on AVX-512 VNNI (signed_steps_apply).

    Inline initializers are shifted in the graph. Every initializer stored as external data (in `folder`, the
    artifact's) is copied, one at a time and shifted where it is one of those, into `out`/INT8_WEIGHTS (all of
    them: onnxruntime refuses external data outside the folder it reads from, links resolved). A session reading
    its weights from `out` maps them from disk as it maps the artifact's own, packs them and lets the mapping go.
    With the shifted weights inline in the serialized graph instead, the session held a second copy: GPT-2 small
    int8-dynamic, opened and run, 639 against 451 MiB of RSS and an 850 MiB peak; from the file 453 MiB, peak 453
    (AMD Zen 4, 2026-11-29)."""
    from onnx import TensorProto, numpy_helper

    folder, out = Path(folder), Path(out)
    inits = {t.name: t for t in model.graph.initializer}
    pairs = [(inits[n.input[1]], inits[n.input[3]]) for n in model.graph.node
             if n.op_type == "MatMulInteger" and len(n.input) >= 4 and n.input[1] in inits and n.input[3] in inits]
    shift: set[str] = set()  # an initializer two MatMuls share (a zero point, a tied weight) is shifted once
    done = 0
    for pair in pairs:
        if all(t.data_type == TensorProto.UINT8 or t.name in shift for t in pair):
            shift.update(t.name for t in pair)
            done += 1
    if not done:
        return 0
    offset, buf = 0, np.empty(COPY_CHUNK, np.uint8)  # copied through one buffer: no tensor-sized temporary
    with open(out / INT8_WEIGHTS, "wb") as f:
        for t in model.graph.initializer:
            if t.data_location != TensorProto.EXTERNAL:
                if t.name in shift:
                    t.CopyFrom(numpy_helper.from_array(_shifted(numpy_helper.to_array(t)), t.name))
                continue
            path, start, length = _external(t, folder)
            f.write(b"\0" * (-offset % 4096))  # page-aligned, as onnx saves external data
            offset += -offset % 4096
            with open(path, "rb") as src:
                src.seek(start)
                for left in range(length, 0, -COPY_CHUNK):
                    part = buf[:min(left, COPY_CHUNK)]
                    if src.readinto(part) != part.size:
                        raise XDeployError(f"{path} ended inside initializer {t.name!r}")
                    if t.name in shift:
                        part ^= np.uint8(0x80)
                    f.write(part)
            del t.external_data[:]
            if t.name in shift:
                t.data_type = TensorProto.INT8
            for k, v in (("location", INT8_WEIGHTS), ("offset", str(offset)), ("length", str(length))):
                e = t.external_data.add()
                e.key, e.value = k, v
            offset += length
    return done


@contextlib.contextmanager
def int8_weight_graph(model: bytes, folder: str | Path) -> Iterator[tuple[bytes, Path] | None]:
    """The rewritten graph `model` (its external data in `folder`) with its MatMuls' weights shifted to int8
    (`signed_weights`), serialized, and the temporary folder its weights are read from while sessions are opened
    on it (onnxruntime has mapped them once the session exists; the folder is removed on exit, the mapped file
    lives on until unmapped). None where the graph has no uint8 MatMulInteger weights."""
    import tempfile

    import onnx

    with tempfile.TemporaryDirectory(prefix="xdeploy-int8-weights-", ignore_cleanup_errors=True) as d:
        signed = onnx.ModelProto.FromString(model)
        yield (signed.SerializeToString(), Path(d)) if signed_weights(signed, folder, d) else None


@functools.lru_cache(maxsize=1)
def u8s8_exact() -> bool:
    """Whether this onnxruntime adds u8*s8 products exactly on this CPU, run rather than read from its ISA flags
    (a build without the VNNI kernels, or a VM that hides them, would saturate): the int8-dynamic pattern
    (DynamicQuantizeLinear, MatMulInteger, Cast, Mul) on all-ones activations (quantized to 255) against int8
    weights of 127, at one row and at five. Every adjacent pair of products is 2 * 255 * 127 = 64770, beyond
    int16: a kernel that adds pairs in saturating int16 (AVX2's vpmaddubsw) returns about half of the exact 127 * K."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from .sessions import ort_session, ort_session_options

    k, n = 64, 16
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "w", "xz", "wz"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["xs", "ws"], ["scale"]), helper.make_node("Mul", ["accf", "scale"], ["y"])]
    inits = [numpy_helper.from_array(np.full((k, n), 127, np.int8), "w"), numpy_helper.from_array(np.int8(0), "wz"),
             numpy_helper.from_array(np.float32(1.0), "ws")]
    graph = helper.make_graph(nodes, "u8s8", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    sess = ort_session(model.SerializeToString(), options=ort_session_options(1),
                       what=f"onnxruntime {ort.__version__}'s u8*s8 check")
    return all(np.allclose(sess.run(None, {"x": np.ones((m, k), np.float32)})[0], 127.0 * k, rtol=1e-5)
               for m in (1, 5))


def prefill_agrees(step: OrtCachedStep, prefill: Any, tokens: int = 8) -> bool:
    """Whether `prefill` (a session of the step's graph) gives the step's own session's logits on a prompt of
    `tokens` ids, to float rounding (the integer products are the same by construction)."""
    ids = (np.arange(tokens, dtype=np.int64) * 7919 % step.vocab)[None]  # (1, T): spread over the vocabulary
    pos = np.arange(tokens, dtype=np.int64)[None]
    mask, beam = np.ones((1, tokens), np.int64), np.zeros(1, np.int32)
    step.reset()
    want = step(ids, pos, mask, beam).copy()
    other = OrtCachedStep(step.session, step.f, step.layers, step.heads, step.head_size, step.vocab, prefill=prefill)
    got = other(ids, pos, mask, beam)
    step.reset()
    return bool(np.abs(got - want).max() <= 1e-4 * max(1.0, float(np.abs(want).max())))
