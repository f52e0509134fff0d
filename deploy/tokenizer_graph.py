"""Running the artifact's tokenizer graph (export/tokenizer_graph.py builds it): an ONNX Runtime session with the
onnxruntime-extensions library registered, and the build-time verification against Hugging Face tokenizers.

    sess = TokenizerSession("artifacts/minilm/tokenizer/tokenizer.onnx")
    ids, mask, type_ids, tokens = sess.encode(["a sentence", "another"])   # INT64 [b, s] x3, [b]
    export("bert", checkpoint=DIR, out=OUT, tokenizer_graph=tokenizer_graph_builder())   # build + verify

The session uses basic graph optimizations: ORT_ENABLE_ALL spends ~5 s loading this graph (its extended passes
copy the 230 KB vocabulary attribute), basic ~0.05 s; the graph has nothing to fuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.export.tokenizer_graph import (
    OUTPUTS,
    TOKENIZER_CORPUS,
    TokenizerCheck,
    TokenizerGraphBuilder,
    build_tokenizer_graph,
    extensions_library,
    graph_record,
    hf_encode,
    read_tokenizer_json,
    refuse_differences,
)

from .sessions import ort_session, ort_session_options


class TokenizerSession:
    """ONNX Runtime session over a tokenizer graph, with the extensions library registered.

    encode(texts) -> (ids, mask, type_ids INT64 [b, s], tokens INT64 [b]); texts are str (validated UTF-8)."""

    def __init__(self, path_or_bytes: str | Path | bytes, threads: int = 1) -> None:
        so = ort_session_options(threads, "basic")
        so.register_custom_ops_library(extensions_library())
        self.session = ort_session(path_or_bytes, options=so, what="the tokenizer graph")

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        arr = np.array(list(texts), dtype=object)
        if arr.size == 0:
            empty = np.zeros((0, 0), np.int64)
            return empty, empty, empty, np.zeros(0, np.int64)
        ids, mask, types, tokens = self.session.run(list(OUTPUTS), {"text": arr})
        return ids, mask, types, tokens


def verify_tokenizer_graph(model_bytes: bytes, tokenizer_json_path: str | Path, max_length: int,
                           corpus: Sequence[str] = TOKENIZER_CORPUS) -> TokenizerCheck:
    """Run the graph and HF tokenizers (the Embedder's path) on `corpus`; which inputs give different ids."""
    sess = TokenizerSession(model_bytes)
    want = hf_encode(tokenizer_json_path, corpus, max_length)
    diff, examples = [], []
    for i, text in enumerate(corpus):
        ids, mask, _, _ = sess.encode([text])
        got = ids[0, :int(mask[0].sum())].tolist()
        if got != want[i]:
            k = next((j for j, (x, y) in enumerate(zip(got, want[i])) if x != y), min(len(got), len(want[i])))
            diff.append(i)
            examples.append(f"input {i} {text[:40]!r}: graph {got[max(0, k - 1):k + 3]} vs HF "
                            f"{want[i][max(0, k - 1):k + 3]} at token {k}")
    return TokenizerCheck(inputs=len(corpus), identical=len(corpus) - len(diff), differing=tuple(diff),
                          texts=tuple(corpus[i][:200] for i in diff), examples=tuple(examples))


def tokenizer_graph_builder(accept_differences: bool = False) -> TokenizerGraphBuilder:
    """What export(..., tokenizer_graph=...) calls: build the graph for the artifact's tokenizer/ dir, verify it
    against HF tokenizers, and refuse (naming the differing inputs) unless `accept_differences`. Tokenizers the
    op cannot express raise NotExpressible."""
    def build(tokenizer_dir: Path, max_length: int) -> tuple[bytes, dict[str, Any]]:
        path = tokenizer_dir / "tokenizer.json"
        data = build_tokenizer_graph(read_tokenizer_json(tokenizer_dir), max_length,
                                     source=str(path)).SerializeToString()
        check = verify_tokenizer_graph(data, path, max_length)
        if not check.ok and not accept_differences:
            refuse_differences(check)
        return data, graph_record(data, check, max_length)

    # what this builder does, for the export cache key (export/cache.py export_key): its code is in the key's
    # source hash, its one option here
    build.cache_key = f"tokenizer_graph_builder(accept_differences={accept_differences})"  # type: ignore[attr-defined]
    return build
