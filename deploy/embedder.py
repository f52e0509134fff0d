"""Sentence embeddings from an exported encoder artifact: tokenize, batch, run, pool, normalize.

    from xdeploy.deploy.embedder import Embedder
    with Embedder("artifacts/minilm", runner="ort") as emb:
        vecs = emb.embed(["a sentence", "another one"])      # float32 [n, d], L2-normalized
        vecs, stats = emb.embed_with_stats(lines)             # + how many inputs were truncated, padding, ...

Torch-free: this module imports only numpy, tokenizers and the torch-free artifact/runner code, so it runs in
a lean environment with onnxruntime + tokenizers + numpy. Other runners (ov, ov:bf16, torch, ...) are
imported only when selected.

Pipeline (all shapes: n inputs, b batch, s padded length, d hidden size):
  1. tokenize every input with the artifact's tokenizer/tokenizer.json (special tokens added, no padding),
     truncated to `max_length` tokens (policy "right": keep the first max_length-1 tokens + [SEP]; "error":
     refuse); very long lines are tokenized from a whitespace-cut prefix, so cost does not grow with length;
  2. sort by token count and cut into batches of at most `batch_size` (`batching="cost"`, default: where the
     padding saved outweighs one more model call, so a few long inputs do not pad a whole batch to their length;
     "fixed": every `batch_size` inputs, as sentence-transformers' encode; plan_batches), pad each batch to its
     longest input rounded up to a multiple of `pad_to` (default 1: measured fastest on onnxruntime's CPU
     provider and equal on OpenVINO, see docs/embedding.md; larger buckets give fewer distinct shapes for
     backends that build per-shape plans);
  3. run the graph: input_ids/attention_mask/token_type_ids int64 [b, s] -> last_hidden_state [b, s, d];
  4. pool as the manifest's `pooling` says (mean over attention_mask, CLS = token 0, or max), L2-normalize
     if it says so, and scatter rows back to input order.
Artifacts without a `pooling` record (plain BERT checkpoints/presets) use CLS pooling without normalization,
the default of sentence-transformers' Pooling for a bare transformer.

Tokenizer: `tokenizer="hf"` (default) uses HF tokenizers on tokenizer.json; `tokenizer="graph"` runs the
artifact's tokenizer graph (export --tokenizer-graph; onnxruntime-extensions' BertTokenizer, the same graph the
C++ runtime and Triton use) with the same cut, truncation and padding. The graph's max_length is fixed.

Golden probes: on the first open of an artifact on a (machine class, runner) the runner is checked against the
artifact's golden probes (deploy/probes.py: PyTorch fp32 outputs stored at export, judged with parity's verdict);
a failing probe refuses the artifact with one line (ProbeFailure), `verify=False` runs it anyway and says so, an
artifact made before probes existed runs with a one-line notice. A pass is remembered, so later opens cost nothing.

Thread safety: one Embedder may be shared by threads. `sessions="shared"` (default) serializes backend calls
with a lock while tokenization and pooling run concurrently; `sessions="per-thread"` opens one runner per
thread (memory x threads). See docs/embedding.md for which is faster here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import InputError, XDeployError, one_of
from xdeploy.export.artifact import Artifact, load_artifact
from xdeploy.models.spec import TextFeeds

from .base import Runner
from .probes import check_on_open
from .registry import open_runner

TRUNCATION = ("right", "error")
TOKENIZERS = ("hf", "graph")
SESSIONS = ("shared", "per-thread")
BATCHING = ("cost", "fixed")
# The batch planner's cost model (plan_batches): one model call costs as much as CALL_TOKENS tokens, and a token
# padded to length L costs 1 + 2L/(3d) tokens (attention grows with L; d the hidden size). Costs are kept in
# integer units of 1/(3d) token, so Python and the C++ runtime (deploy/cpp/src/embedder.cpp) pick the same cut.
# Measured on MiniLM (d 384), Xeon model 207, 2 threads: a token at 256 costs ~1.18x one at 128, and a call
# threshold of 256 tokens beat 48 and 1024 (docs/embedding.md).
CALL_TOKENS = 256
POOLING_MODES = ("mean", "cls", "max")


@dataclass(frozen=True)
class Pooling:
    """How token states become one vector. Mirrors the manifest's `pooling` record."""

    mode: str = "cls"
    normalize: bool = False
    max_length: int | None = None


@dataclass(frozen=True)
class EmbedStats:
    """What one `embed_with_stats` call did. Token counts include special tokens."""

    inputs: int
    truncated: int  # inputs longer than max_length tokens, cut to max_length
    truncated_indices: tuple[int, ...]
    batches: int
    tokens: int  # real tokens fed to the model
    padded_tokens: int  # tokens including padding (batch * padded length summed over batches)
    max_length: int

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.tokens / self.padded_tokens if self.padded_tokens else 0.0


def artifact_pooling(artifact: Artifact) -> Pooling:
    """The pooling an artifact was exported with; CLS without normalization when it has none."""
    p = artifact.manifest.get("pooling")
    if p is None:
        return Pooling()
    if not isinstance(p, dict) or p.get("mode", "cls") not in POOLING_MODES:
        raise XDeployError(f"invalid manifest {artifact.path / 'manifest.json'}: pooling must be an object with "
                           f"mode one of {', '.join(POOLING_MODES)}, got {p!r}")
    ml = p.get("max_length")
    if ml is not None and (not isinstance(ml, int) or isinstance(ml, bool) or ml < 2):
        raise XDeployError(f"invalid manifest {artifact.path / 'manifest.json'}: pooling max_length {ml!r} "
                           "must be an integer >= 2")
    return Pooling(mode=p.get("mode", "cls"), normalize=bool(p.get("normalize", False)), max_length=ml)


def plan_batches(lengths: Sequence[int], batch_size: int, *, d: int, pad_to: int = 1, smax: int | None = None,
                 batching: str = "cost") -> list[tuple[int, int, int]]:
    """Cut inputs sorted by ascending token count into batches: (start, stop, padded length) over `lengths`.

    "fixed": batches of `batch_size` (sentence-transformers' encode), each padded to its longest input.
    "cost": the cut that minimizes the model's cost over the whole call (dynamic programming over the sorted
    lengths, at most `batch_size` rows a batch): a few long inputs no longer pad a whole batch of shorter ones to
    their length, and a batch is split only where the padding saved outweighs one more call (CALL_TOKENS).
    Either way every batch holds inputs adjacent in length order. The cut does not change the results, except
    on an int8-dynamic artifact: its activations are quantized with one scale per tensor, the whole batch's, so an
    input's vector depends slightly on its batch-mates (docs/embedding.md, "int8-dynamic and the batch")."""
    if batching not in BATCHING:
        raise one_of("batching", batching, BATCHING)
    n = len(lengths)
    cap = smax if smax is not None else max(lengths, default=0) + pad_to
    padded = np.minimum(-(-np.asarray(lengths, np.int64) // pad_to) * pad_to, cap)  # (n,)
    if batching == "fixed" or n == 0:
        return [(a, min(a + batch_size, n), int(padded[min(a + batch_size, n) - 1])) for a in range(0, n, batch_size)]
    per_row = 3 * d * padded + 2 * padded * padded  # (n,) one row padded to input i's length, in 1/(3d) tokens
    call = 3 * d * CALL_TOKENS
    best = np.zeros(n + 1, np.int64)  # best[i]: the cheapest plan of the first i inputs
    cut = np.zeros(n + 1, np.int64)  # cut[i]: where that plan's last batch starts
    for i in range(1, n + 1):
        j = np.arange(max(0, i - batch_size), i)  # the last batch is inputs j..i-1, padded to input i-1
        c = best[j] + call + (i - j) * per_row[i - 1]
        k = int(np.argmin(c))  # the first minimum: the C++ runtime breaks ties the same way
        best[i], cut[i] = c[k], j[k]
    plan, i = [], n
    while i:
        plan.append((int(cut[i]), i, int(padded[i - 1])))
        i = int(cut[i])
    return plan[::-1]


def pool(hidden: np.ndarray, mask: np.ndarray, mode: str, normalize: bool) -> np.ndarray:
    """hidden float [b, s, d], mask int [b, s] (1 = real token) -> float32 [b, d]."""
    h = hidden.astype(np.float32, copy=False)
    m = mask.astype(np.float32)[:, :, None]  # [b, s, 1]
    if mode == "mean":
        # same order as sentence-transformers: sum(h * m) / clamp(sum(m), 1e-9)
        out = (h * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
    elif mode == "cls":
        out = h[:, 0].copy()
    elif mode == "max":
        out = np.where(m > 0, h, np.float32(-1e9)).max(axis=1)
    else:
        raise one_of("pooling mode", mode, POOLING_MODES)
    if normalize:
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out.astype(np.float32, copy=False)


def text_encoder_inputs(artifact: Artifact) -> tuple[list[str], TextFeeds]:
    """The input names of a text encoder's graph and its declared feeds, or a one-line error for an artifact
    that is not one."""
    graph = artifact.graph("model")
    names = [t.name for t in graph.inputs]
    # the feed names a text encoder declares (models/spec.py TextFeeds, read from the manifest)
    text = artifact.capabilities.text or TextFeeds()
    feeds = [n for n in (text.ids, text.mask, text.type_ids) if n]
    caps = artifact.capabilities
    if caps.text is None or caps.token_axis not in artifact.spec.axes or text.ids not in names \
            or not set(names) <= set(feeds) or text.hidden not in [t.name for t in graph.outputs]:
        raise XDeployError(f"artifact {artifact.path} is not a text encoder: its graph takes {names} "
                           f"and gives {[t.name for t in graph.outputs]}; expected {text.ids} (+ "
                           f"{', '.join(feeds[1:])}) -> {text.hidden}")
    return names, text


def check_text_artifact(artifact: Artifact | str | Path, tokenizer: str = "hf") -> Artifact:
    """What embedding text needs, checked up front (a server must refuse at start, not answer every request with
    an error): a text-encoder graph and a readable tokenizer (`tokenizer`: "hf" tokenizer.json, or "graph")."""
    art = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
    text_encoder_inputs(art)
    if tokenizer == "graph":
        if art.tokenizer_graph is None:
            raise XDeployError(f"artifact {art.path} has no tokenizer graph; export it with --tokenizer-graph")
    else:
        _load_tokenizer(art)
    return art


def _load_tokenizer(artifact: Artifact) -> Any:
    from tokenizers import Tokenizer

    d = artifact.tokenizer_dir
    if d is None:
        raise XDeployError(f"artifact {artifact.path} has no tokenizer/tokenizer.json; export it from a checkpoint "
                           "that has one (xdeploy export bert --checkpoint DIR), or pass token ids to embed_ids()")
    try:
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise XDeployError(f"cannot read {d / 'tokenizer.json'}: {str(e).splitlines()[0]}") from None
    tok.no_padding()
    return tok


def _as_text(x: Any, i: int) -> str:
    if isinstance(x, str):
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            raise InputError(i, "is not valid Unicode (it holds a lone surrogate)") from None
        return x
    if isinstance(x, bytes | bytearray):
        try:
            return bytes(x).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(i, f"is not valid UTF-8 (byte {e.start}: {bytes(x)[e.start:e.start + 1]!r})"
                             ) from None
    raise InputError(i, f"must be a str (or UTF-8 bytes), got {type(x).__name__}")


class Embedder:
    """Embed sentences with an encoder artifact on any runner. See the module docstring for the pipeline."""

    def __init__(self, artifact: Artifact | str | Path, runner: str = "ort", *, batch_size: int = 32,
                 truncation: str = "right", max_length: int | None = None, pad_to: int = 1,
                 sessions: str = "shared", pooling: str | None = None, normalize: bool | None = None,
                 threads: int = 0, tokenizer: str = "hf", verify: bool = True, batching: str = "cost",
                 **runner_options: Any) -> None:
        self.artifact = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
        graph = self.artifact.graph("model")
        names, text = text_encoder_inputs(self.artifact)
        self.input_names, self.text = names, text
        caps = self.artifact.capabilities
        if truncation not in TRUNCATION:
            raise one_of("truncation policy", truncation, TRUNCATION)
        if sessions not in SESSIONS:
            raise one_of("sessions mode", sessions, SESSIONS)
        axes = self.artifact.spec.axes
        self.token_axis = str(caps.token_axis)
        bmax, smax = axes["batch"].max, axes[self.token_axis].max
        if not isinstance(batch_size, int) or not 1 <= batch_size <= bmax:
            raise XDeployError(f"batch size must be 1..{bmax} (the artifact's batch axis), got {batch_size!r}")
        if batching not in BATCHING:
            raise one_of("batching", batching, BATCHING)
        if not isinstance(pad_to, int) or pad_to < 1:
            raise XDeployError(f"pad-to must be a positive integer, got {pad_to!r}")
        p = artifact_pooling(self.artifact)
        if pooling is not None and pooling not in POOLING_MODES:
            raise one_of("pooling mode", pooling, POOLING_MODES)
        self.pooling = Pooling(pooling or p.mode, p.normalize if normalize is None else normalize, p.max_length)
        limit = max_length or p.max_length or smax
        if not 2 <= limit <= smax:
            raise XDeployError(f"max length must be 2..{smax} tokens (the artifact's token axis), got {limit}")
        if tokenizer not in TOKENIZERS:
            raise one_of("tokenizer", tokenizer, TOKENIZERS)
        if tokenizer == "graph":
            if self.artifact.tokenizer_graph is None:
                raise XDeployError(f"artifact {self.artifact.path} has no tokenizer graph; export it with "
                                   "--tokenizer-graph (export(..., tokenizer_graph=True)) or use tokenizer='hf'")
            graph_max = self.artifact.manifest["tokenizer_graph"]["max_length"]
            if max_length is not None and max_length != graph_max:
                raise XDeployError(f"max_length {max_length} differs from the tokenizer graph's {graph_max} "
                                   "(its truncation is part of the graph); use tokenizer='hf' for another length")
            limit = min(graph_max, smax)
        self.tokenizer_kind = tokenizer
        self.max_length, self.batch_size, self.pad_to, self.truncation = limit, batch_size, pad_to, truncation
        self.batching = batching
        self.dim = graph.outputs[[t.name for t in graph.outputs].index(text.hidden)].dims[-1]
        self.sessions, self.runner_spec = sessions, runner
        # only the hidden states it pools: a runner that can prune (OpenVINO) skips e.g. BERT's pooler branch
        self._runner_kwargs = dict(runner_options, threads=threads, outputs=[text.hidden])
        self._tokenizer: Any = None  # loaded on first text call: embed_ids works without a tokenizer
        self._lock = threading.Lock()
        self._local = threading.local()
        self._runners: list[Runner] = []  # every runner opened (per-thread ones stay until close())
        self._spare: Runner | None = None  # per-thread: the runner the probes ran on, for the first thread to embed
        self._closed = False
        self._runner = self._open() if sessions == "shared" else None
        try:
            checked = self._runner or self._open()
            self.probes = check_on_open(self.artifact, [checked], verify=verify)  # deploy/probes.py; may refuse
        except BaseException:
            self.close()
            raise
        if self._runner is None:  # still one runner per embedding thread: the first one takes this
            self._spare = checked
        # Longest prefix (in characters) tokenized for one input: the tokenizer's cost grows with the line,
        # the model only sees max_length tokens. Special tokens aside, every token covers >= 1 character.
        self._char_cap = max(4096, 64 * limit)

    # ------------------------------------------------------------------ runners ----
    def _open(self) -> Runner:
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            return spare
        r = open_runner(self.runner_spec, self.artifact, **self._runner_kwargs)
        with self._lock:
            self._runners.append(r)
        return r

    def _run(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        if self._closed:
            raise XDeployError("this Embedder is closed; create a new one")
        if self._runner is not None:
            with self._lock:
                return self._runner.infer(feeds)[self.text.hidden]
        r = getattr(self._local, "runner", None)
        if r is None:
            r = self._local.runner = self._open()
        return r.infer(feeds)[self.text.hidden]

    @property
    def runner(self) -> Runner:
        """The shared runner, or this thread's runner with sessions="per-thread"."""
        if self._runner is not None:
            return self._runner
        r = getattr(self._local, "runner", None)
        if r is None:
            r = self._local.runner = self._open()
        return r

    def close(self) -> None:
        """Release every runner (the shared one, or all per-thread ones). Idempotent."""
        self._closed = True
        with self._lock:
            for r in self._runners:
                r.close()
            self._runners.clear()

    def __enter__(self) -> Embedder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ tokenizing ----
    @property
    def tokenizer(self) -> Any:
        """HF tokenizers' Tokenizer (tokenizer="hf") or a TokenizerSession over the artifact's graph ("graph")."""
        if self._tokenizer is None and self.tokenizer_kind == "graph":
            from .tokenizer_graph import TokenizerSession

            self._tokenizer = TokenizerSession(self.artifact.tokenizer_graph)
        if self._tokenizer is None:
            tok = _load_tokenizer(self.artifact)
            # the tokenizer's own truncation: keeps the first tokens and re-adds [SEP]; what was cut goes to
            # `overflowing`, which is how truncated inputs are counted
            tok.enable_truncation(self.max_length, strategy="longest_first", direction="right")
            self._tokenizer = tok
        return self._tokenizer

    def tokenize(self, texts: Sequence[str | bytes]) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """Token ids and type ids per input (special tokens added, truncated to max_length), and the indices
        of inputs that were truncated. Raises with truncation="error" when an input is too long."""
        if isinstance(texts, str | bytes) or not isinstance(texts, Iterable):
            raise XDeployError(f"texts must be a list of strings, got {type(texts).__name__}")
        strs = [_as_text(x, i) for i, x in enumerate(texts)]
        cap = self._char_cap
        cut = []
        for s in strs:
            if len(s) > cap:
                # cut at whitespace so no word is split (its WordPiece pieces could differ); the prefix still has
                # >= max_length tokens unless the line is mostly whitespace, which is then tokenized whole.
                k = max(s.rfind(" ", 0, cap), s.rfind("\n", 0, cap))
                s = s[:k] if k > 0 else s[:cap]
            cut.append(s)
        if self.tokenizer_kind == "graph":
            return self._tokenize_graph(strs, cut)
        tok = self.tokenizer
        try:
            encs = tok.encode_batch(cut)
            for i, (s, c) in enumerate(zip(strs, cut)):
                if c is not s and not encs[i].overflowing:  # whitespace-heavy line: the prefix was too short
                    encs[i] = tok.encode(s)
        except Exception as e:  # tokenizers' Rust errors surface as bare Exceptions
            raise XDeployError(f"tokenizer failed: {str(e).splitlines()[0]}") from None
        ids, types, truncated = [], [], []
        for i, e in enumerate(encs):
            if e.overflowing:  # the tokenizer cut it to max_length, special tokens re-added ([CLS] ... [SEP])
                if self.truncation == "error":
                    raise InputError(i, f"has more than max_length={self.max_length} tokens "
                                     "(truncation='error'); shorten it or use truncation='right'")
                truncated.append(i)
            ids.append(e.ids)
            types.append(e.type_ids)
        return ids, types, truncated

    def _tokenize_graph(self, strs: list[str], cut: list[str]) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """tokenize() through the artifact's tokenizer graph: same cut, same truncation, exact overflow count."""
        sess = self.tokenizer
        rows, trows, counts = [], [], []
        for start in range(0, len(cut), 256):  # chunks: the graph's outputs are padded [b, s] int64 tensors
            ids, mask, types, tokens = sess.encode(cut[start:start + 256])
            lens = mask.sum(axis=1).tolist()
            rows += [ids[i, :k].tolist() for i, k in enumerate(lens)]
            trows += [types[i, :k].tolist() for i, k in enumerate(lens)]
            counts += tokens.tolist()
        for i, (s, c) in enumerate(zip(strs, cut)):
            if c is not s and counts[i] <= self.max_length:  # whitespace-heavy line: the prefix was too short
                one_ids, one_mask, one_types, one_tokens = sess.encode([s])
                k = int(one_mask[0].sum())
                rows[i], trows[i], counts[i] = one_ids[0, :k].tolist(), one_types[0, :k].tolist(), int(one_tokens[0])
        truncated = []
        for i, n in enumerate(counts):
            if n > self.max_length:  # the graph kept [CLS] + max_length-2 tokens + [SEP]
                if self.truncation == "error":
                    raise XDeployError(f"input {i} has more than max_length={self.max_length} tokens "
                                       "(truncation='error'); shorten it or use truncation='right'")
                truncated.append(i)
        return rows, trows, truncated

    # ------------------------------------------------------------------ embedding ----
    def embed(self, texts: Sequence[str | bytes]) -> np.ndarray:
        """float32 [len(texts), d]; an empty list gives an empty [0, d] array."""
        return self.embed_with_stats(texts)[0]

    def embed_with_stats(self, texts: Sequence[str | bytes]) -> tuple[np.ndarray, EmbedStats]:
        ids, types, truncated = self.tokenize(texts)
        vecs, (batches, real, padded) = self._embed_tokens(ids, types)
        return vecs, EmbedStats(inputs=len(ids), truncated=len(truncated), truncated_indices=tuple(truncated),
                                batches=batches, tokens=real, padded_tokens=padded, max_length=self.max_length)

    def embed_ids(self, ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Embed pre-tokenized inputs (special tokens included), e.g. to compare with the C++ runtime."""
        rows = []
        for i, r in enumerate(ids):
            row = [int(x) for x in r]
            if not 1 <= len(row) <= self.max_length:
                raise InputError(i, f"has {len(row)} token ids; expected 1..{self.max_length}")
            rows.append(row)
        return self._embed_tokens(rows, [[0] * len(r) for r in rows])[0]

    def _embed_tokens(self, ids: list[list[int]], types: list[list[int]]
                      ) -> tuple[np.ndarray, tuple[int, int, int]]:
        n = len(ids)
        out = np.empty((n, self.dim), np.float32)
        order = sorted(range(n), key=lambda i: len(ids[i]))  # similar lengths share a batch: little padding
        plan = plan_batches([len(ids[i]) for i in order], self.batch_size, d=self.dim, pad_to=self.pad_to,
                            smax=self.artifact.spec.axes[self.token_axis].max, batching=self.batching)
        batches = real = padded = 0
        for start, stop, s in plan:
            idx = order[start:stop]
            b = len(idx)
            input_ids = np.zeros((b, s), np.int64)  # pad id 0 = [PAD] for BERT vocabularies; masked anyway
            mask = np.zeros((b, s), np.int64)
            type_ids = np.zeros((b, s), np.int64)
            for row, i in enumerate(idx):
                k = len(ids[i])
                input_ids[row, :k] = ids[i]
                mask[row, :k] = 1
                type_ids[row, :k] = types[i]
            t = self.text
            all_feeds = {t.ids: input_ids} | ({t.mask: mask} if t.mask else {}) | \
                ({t.type_ids: type_ids} if t.type_ids else {})
            hidden = self._run({k: all_feeds[k] for k in self.input_names})  # [b, s, d]
            out[idx] = pool(hidden, mask, self.pooling.mode, self.pooling.normalize)
            batches, real, padded = batches + 1, real + int(mask.sum()), padded + b * s
        return out, (batches, real, padded)

    def info(self) -> dict[str, Any]:
        return {"artifact": str(self.artifact.path), "runner": self.runner_spec, "precision": self.artifact.precision,
                "pooling": self.pooling.mode, "normalize": self.pooling.normalize, "max_length": self.max_length,
                "batch_size": self.batch_size, "batching": self.batching, "pad_to": self.pad_to,
                "truncation": self.truncation, "sessions": self.sessions, "dim": self.dim,
                "tokenizer": self.tokenizer_kind}
