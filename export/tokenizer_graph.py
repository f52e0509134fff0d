"""The tokenizer as an ONNX graph (onnxruntime-extensions' BertTokenizer op), so every runtime shares one
tokenization: the Python Embedder (tokenizer="graph"), the C++ runtime and Triton's ensemble.

    from xdeploy.export.tokenizer_graph import build_tokenizer_graph
    model = build_tokenizer_graph(tokenizer_json, max_length=256)      # onnx.ModelProto
    # running and verifying it (an ORT session) is deploy/tokenizer_graph.py's: export() takes its builder
    export("bert", checkpoint=DIR, out=OUT, tokenizer_graph=tokenizer_graph_builder(accept_differences=False))

The graph (b strings, s = the longest kept length, L = max_length):

    text STRING [b]  --Loop over b: BertTokenizer (one string) -> [CLS] ... [SEP] (all n tokens),
                       keep the first L-1 and the final [SEP] when n > L, pad to L with 0-->
    input_ids / attention_mask / token_type_ids INT64 [b, s]  (pad id 0, mask 0, trimmed to s = max kept length)
    tokens INT64 [b]  (n: the length before truncation, so callers count truncated inputs exactly)

That is the Python Embedder's tokenization (HF tokenizers, special tokens added, truncated from the right with
[SEP] re-added, padded with 0 to the longest input). The op itself takes one string per call (two would be a
sentence pair), hence the Loop. Its attributes come from tokenizer.json, configured, not defaulted: BERT's
`strip_accents: null` means "strip when lower-casing", which the extensions' own converter maps to "don't strip".

Only WordPiece tokenizers with BERT's normalizer/pre-tokenizer/template are expressed (BERT, MiniLM, ...);
others get a clear error and the artifact simply has no tokenizer graph. GPT-2's byte-level BPE is not built:
the C++/Triton consumers here are embedding runtimes, and GPT-2 artifacts are not text encoders.

deploy/tokenizer_graph.py's `verify_tokenizer_graph` runs the graph and HF tokenizers on TOKENIZER_CORPUS
(accents, CJK, emoji, control characters, very long inputs, empty strings, ...) and returns which inputs
differ; the build refuses unless the caller accepts the differences (recorded in the manifest).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError

GRAPH_FILE = "tokenizer/tokenizer.onnx"  # beside tokenizer.json: convert copies tokenizer/ whole
OUTPUTS = ("input_ids", "attention_mask", "token_type_ids", "tokens")
CONTRIB = "ai.onnx.contrib"  # onnxruntime-extensions' op domain
OPSET = 17


def extensions_version() -> str:
    try:
        import onnxruntime_extensions
    except ImportError:
        raise XDeployError("the tokenizer graph needs onnxruntime-extensions (pip install onnxruntime-extensions)"
                           ) from None
    return str(onnxruntime_extensions.__version__)


def extensions_library() -> str:
    """Path of the shared library that registers the extensions' custom ops into an ORT session."""
    extensions_version()
    from onnxruntime_extensions import get_library_path

    return str(get_library_path())


# ------------------------------------------------------------------------------------------ building ----

class NotExpressible(XDeployError):
    """The tokenizer cannot be written as a BertTokenizer graph (the artifact then has none)."""


@dataclass(frozen=True)
class BertTokenizerAttrs:
    """The BertTokenizer op's attributes, read from a tokenizer.json."""

    vocab: tuple[str, ...]  # token of id i at position i
    do_lower_case: bool
    strip_accents: bool
    tokenize_chinese_chars: bool
    unk_token: str
    cls_token: str
    sep_token: str
    pad_token: str
    suffix_indicator: str


def bert_attrs(tokenizer_json: Mapping[str, Any], source: str = "tokenizer.json") -> BertTokenizerAttrs:
    """Map a Hugging Face tokenizer.json to BertTokenizer attributes, or raise naming what cannot be expressed.
    tokenizer.json is untrusted input: a field of the wrong type or shape is a one-line error too."""
    try:
        return _bert_attrs(tokenizer_json, source)
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise NotExpressible(f"{source}: no tokenizer graph: malformed tokenizer.json ({type(e).__name__}: {e})"
                             ) from None


def _bert_attrs(tokenizer_json: Mapping[str, Any], source: str) -> BertTokenizerAttrs:
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise NotExpressible(f"{source}: no tokenizer graph: {what}")

    t = tokenizer_json
    need(isinstance(t, Mapping), "not a JSON object")
    model, norm = t.get("model") or {}, t.get("normalizer") or {}
    pre, post = t.get("pre_tokenizer") or {}, t.get("post_processor") or {}
    need(model.get("type") == "WordPiece", f"model type {model.get('type')!r}; only WordPiece (BERT) is expressed")
    need(norm.get("type") == "BertNormalizer", f"normalizer {norm.get('type')!r}; expected BertNormalizer")
    need(pre.get("type") == "BertPreTokenizer", f"pre-tokenizer {pre.get('type')!r}; expected BertPreTokenizer")
    need(norm.get("clean_text", True) is True, "clean_text=false is not expressed (the op always removes controls)")
    vocab = model.get("vocab")
    need(isinstance(vocab, dict) and vocab, "model.vocab is missing")
    ids = sorted(vocab.values())
    need(ids == list(range(len(ids))), "vocab ids are not 0..n-1")
    tokens = [""] * len(ids)
    for tok, i in vocab.items():
        need(isinstance(tok, str) and tok != "" and "\n" not in tok and "\r" not in tok,
             f"vocab token {tok!r} cannot be written one per line")
        tokens[i] = tok
    if post.get("type") == "TemplateProcessing":
        single = post.get("single") or []
        shape = [("SpecialToken" if "SpecialToken" in p else "Sequence") for p in single]
        need(shape == ["SpecialToken", "Sequence", "SpecialToken"],
             f"post-processor template {shape}; expected [CLS] $A [SEP]")
        cls, sep = single[0]["SpecialToken"]["id"], single[2]["SpecialToken"]["id"]
        need(all(p.get(k, {}).get("type_id", 0) == 0 for p, k in zip(single, shape)), "type ids other than 0")
    elif post.get("type") == "BertProcessing":
        cls, sep = post["cls"][0], post["sep"][0]
    else:
        raise NotExpressible(f"{source}: no tokenizer graph: post-processor {post.get('type')!r}; "
                           "expected TemplateProcessing or BertProcessing")
    lower = bool(norm.get("lowercase", True))
    strip = norm.get("strip_accents")
    pad = (t.get("padding") or {}).get("pad_token", "[PAD]")
    unk = model.get("unk_token", "[UNK]")
    for name, tok in (("unk", unk), ("cls", cls), ("sep", sep)):
        need(tok in vocab, f"{name} token {tok!r} is not in the vocabulary")
    if pad not in vocab:
        pad = unk  # the op looks a pad token up but never emits it (padding is done by the graph with id 0)
    need(vocab.get(pad, 0) == 0 or pad == unk, "the pad token's id is not 0 (the graph pads with 0)")
    return BertTokenizerAttrs(
        vocab=tuple(tokens), do_lower_case=lower,
        # HF: strip_accents None -> follow lowercase (BertNormalizer); the extensions' converter gets this wrong
        strip_accents=lower if strip is None else bool(strip),
        tokenize_chinese_chars=bool(norm.get("handle_chinese_chars", True)),
        unk_token=unk, cls_token=cls, sep_token=sep, pad_token=pad,
        suffix_indicator=model.get("continuing_subword_prefix", "##"))


def _mask_token(a: BertTokenizerAttrs) -> str:
    # the op looks up [MASK] at construction; vocabularies without it get another existing token
    return "[MASK]" if "[MASK]" in a.vocab else a.unk_token


def build_tokenizer_graph(tokenizer_json: Mapping[str, Any], max_length: int, *, source: str = "tokenizer.json"
                          ) -> Any:
    """onnx.ModelProto: text STRING [b] -> input_ids/attention_mask/token_type_ids INT64 [b, s], tokens [b]."""
    import onnx
    from onnx import TensorProto, helper

    if not isinstance(max_length, int) or max_length < 2:
        raise XDeployError(f"tokenizer graph max_length must be an integer >= 2, got {max_length!r}")
    a = bert_attrs(tokenizer_json, source)
    i64 = TensorProto.INT64

    def const(name: str, vals: Sequence[int]) -> Any:
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, i64, [len(vals)], vals))

    # Loop body: iteration i tokenizes text[i] ([1] string) and emits 3 rows of L ints + its token count.
    body_nodes = [
        helper.make_node("Unsqueeze", ["i", "axis0"], ["i1"]),  # [1]
        helper.make_node("Add", ["i1", "one"], ["i1_end"]),
        helper.make_node("Slice", ["text", "i1", "i1_end"], ["one_text"]),  # [1] string
        helper.make_node("BertTokenizer", ["one_text"], ["ids_all", "types_all", "mask_all"], domain=CONTRIB,
                         vocab_file="\n".join(a.vocab), do_lower_case=int(a.do_lower_case),
                         do_basic_tokenize=1, strip_accents=int(a.strip_accents),
                         tokenize_chinese_chars=int(a.tokenize_chinese_chars), unk_token=a.unk_token,
                         sep_token=a.sep_token, cls_token=a.cls_token, pad_token=a.pad_token,
                         mask_token=_mask_token(a), suffix_indicator=a.suffix_indicator,
                         max_length=-1),  # no truncation in the op: the graph truncates and counts (below)
        helper.make_node("Shape", ["ids_all"], ["n"]),  # [1]: tokens before truncation, [CLS]/[SEP] included
        helper.make_node("Min", ["n", "L"], ["k"]),  # kept length
        helper.make_node("Sub", ["k", "one"], ["k1"]),
        helper.make_node("Sub", ["n", "one"], ["n1"]),
        # [CLS] + the first k-2 tokens, then the final [SEP] (right truncation with [SEP] re-added, as HF)
        helper.make_node("Slice", ["ids_all", "zero", "k1"], ["head"]),
        helper.make_node("Slice", ["ids_all", "n1", "n"], ["last"]),
        helper.make_node("Concat", ["head", "last"], ["ids_k"], axis=0),
        helper.make_node("Slice", ["types_all", "zero", "k"], ["types_k"]),
        helper.make_node("Slice", ["mask_all", "zero", "k"], ["mask_k"]),
        helper.make_node("Sub", ["L", "k"], ["pad_n"]),
        helper.make_node("Concat", ["zero", "pad_n"], ["pads"], axis=0),
        helper.make_node("Pad", ["ids_k", "pads"], ["ids_row"]),  # [L], zeros after the kept tokens
        helper.make_node("Pad", ["types_k", "pads"], ["types_row"]),
        helper.make_node("Pad", ["mask_k", "pads"], ["mask_row"]),
        helper.make_node("Identity", ["cond_in"], ["cond_out"]),
    ]
    body = helper.make_graph(
        body_nodes, "tokenize_one",
        [helper.make_tensor_value_info("i", i64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("ids_row", i64, [max_length]),
         helper.make_tensor_value_info("types_row", i64, [max_length]),
         helper.make_tensor_value_info("mask_row", i64, [max_length]),
         helper.make_tensor_value_info("n", i64, [1])])
    nodes = [
        const("axis0", [0]), const("zero", [0]), const("one", [1]), const("L", [max_length]),
        const("axis1", [1]),
        helper.make_node("Shape", ["text"], ["b"]),  # [1]
        helper.make_node("Squeeze", ["b", "axis0"], ["b_scalar"]),
        helper.make_node("Constant", [], ["true"], value=helper.make_tensor("true", TensorProto.BOOL, [], [True])),
        helper.make_node("Loop", ["b_scalar", "true"], ["ids_full", "types_full", "mask_full", "n_all"], body=body),
        helper.make_node("Reshape", ["n_all", "minus1"], ["tokens"]),  # [b, 1] -> [b]
        helper.make_node("ReduceSum", ["mask_full", "axis1"], ["kept"], keepdims=0),  # [b]
        helper.make_node("ReduceMax", ["kept"], ["s"], keepdims=1),  # [1]; empty batch -> 0 (identity)
        helper.make_node("Slice", ["ids_full", "zero", "s", "axis1"], ["input_ids"]),  # [b, s]
        helper.make_node("Slice", ["types_full", "zero", "s", "axis1"], ["token_type_ids"]),
        helper.make_node("Slice", ["mask_full", "zero", "s", "axis1"], ["attention_mask"]),
    ]
    nodes.insert(0, const("minus1", [-1]))
    graph = helper.make_graph(
        nodes, "xdeploy_tokenizer",
        [helper.make_tensor_value_info("text", TensorProto.STRING, ["batch"])],
        [helper.make_tensor_value_info("input_ids", i64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", i64, ["batch", "seq"]),
         helper.make_tensor_value_info("token_type_ids", i64, ["batch", "seq"]),
         helper.make_tensor_value_info("tokens", i64, ["batch"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(CONTRIB, 1)],
                              producer_name="xdeploy")
    model.ir_version = 8
    model.doc_string = f"xdeploy tokenizer graph: BertTokenizer (onnxruntime-extensions), max_length {max_length}"
    onnx.checker.check_model(model)
    return model


# ------------------------------------------------------------------------------------------ writing ----

# (tokenizer/ dir of the artifact being written, max_length) -> (graph bytes, manifest record). export/ builds
# the graph but opens no ONNX Runtime session: the verifying builder is deploy/tokenizer_graph.py's
# `tokenizer_graph_builder`, handed to export() by the caller (the CLI, the API, tests).
TokenizerGraphBuilder = Callable[[Path, int], tuple[bytes, dict[str, Any]]]


def write_tokenizer_graph(w: Any, max_length: int, builder: TokenizerGraphBuilder) -> None:
    """Through the artifact writer `w` (export/writer.py; tokenizer/ already added): tokenizer/tokenizer.onnx
    and the manifest's `tokenizer_graph` section (with the extensions version in the manifest's versions)."""
    tdir = w.root / "tokenizer"
    if not (tdir / "tokenizer.json").exists():
        raise XDeployError("--tokenizer-graph needs a checkpoint with a tokenizer (tokenizer.json)")
    data, record = builder(tdir, max_length)
    w.add_file(GRAPH_FILE, data)
    w.add_section("tokenizer_graph", record, versions=("onnxruntime-extensions",))


def read_tokenizer_json(tokenizer_dir: Path) -> dict[str, Any]:
    path = tokenizer_dir / "tokenizer.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise XDeployError(f"cannot read {path}: {e}") from None


# ------------------------------------------------------------------------------------------ verifying ----

def _corpus() -> tuple[str, ...]:
    long_words = " ".join(f"word{i} über café" for i in range(400))  # > 512 tokens: truncation
    return (
        "", " ", "\t\n", "a", "A man is playing a guitar.", "The quick brown fox jumps over the lazy dog.",
        "Stocks fell sharply after the central bank raised rates.",
        "Café, naïve, résumé, Zürich, São Paulo, Ångström, Øresund, façade",  # accents (stripped when lower-casing)
        "¿Dónde está la biblioteca? Très bien, merci!", "ÀÉÎÕÜ àéîõü ñ ç ß œ æ",
        "Ελληνικά κείμενα με τόνους", "Русский текст, ёлка и йод", "عربي مع تشكيل: مُحَمَّد",
        "עברית", "हिन्दी पाठ", "ภาษาไทย", "Tiếng Việt có dấu",
        "日本語のテキストです。", "中文文本，包括标点符号。", "한국어 텍스트", "漢字かなカナ混じり文",
        "emoji 🎉 and 日本語", "👍🏽 👨‍👩‍👧 ❤️ 🇫🇷", "math ∑∫√∞ ≠ ≤ ≥ and symbols © ® ™ § ¶",
        "control\x00chars\x07here\x1b[0m", "tab\tnew\nline\rreturn", "zero\u200bwidth\u200djoiner\ufeffbom",
        "non\u00a0breaking\u2003spaces\u3000ideographic", "soft\u00adhyphen", "combining e\u0301 vs \u00e9",
        "fullwidth ＡＢＣ １２３", "ligature ﬁ ﬂ", "<html> & \"quotes\" 'apostrophes' — dashes – …",
        "UPPER lower MiXeD CaSe", "numbers 3.14159 1,000,000 42nd 2024-01-01",
        "url https://example.com/path?q=1&r=2 and email a.b@c.org",
        "supercalifragilisticexpialidocious antidisestablishmentarianism", "x" * 150,  # > max_input_chars_per_word
        "hello [SEP] world [CLS] [MASK]",  # special-token strings inside text
        "A man is playing a guitar. " * 60,  # long: truncation
        long_words, "ab " * 3000, "日本" * 700,  # very long, CJK over max_length
    )


TOKENIZER_CORPUS = _corpus()


@dataclass(frozen=True)
class TokenizerCheck:
    """The graph's ids vs Hugging Face tokenizers' on a corpus."""

    inputs: int
    identical: int
    differing: tuple[int, ...]  # corpus indices whose ids differ
    texts: tuple[str, ...]  # those inputs (first 200 characters)
    examples: tuple[str, ...]  # a short description of each difference (input prefix, first differing position)

    @property
    def ok(self) -> bool:
        return not self.differing


def hf_encode(tokenizer_json_path: str | Path, texts: Sequence[str], max_length: int) -> list[list[int]]:
    """What the Python Embedder feeds the model: HF tokenizers, special tokens, right truncation to max_length."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json_path))
    tok.no_padding()
    tok.enable_truncation(max_length, strategy="longest_first", direction="right")
    return [e.ids for e in tok.encode_batch(list(texts))]


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def refuse_differences(check: TokenizerCheck) -> None:
    """The build's refusal: which verification inputs differ from HF tokenizers, and how to accept them."""
    raise XDeployError(
        f"the tokenizer graph differs from Hugging Face tokenizers on {len(check.differing)} of {check.inputs} "
        f"verification inputs ({'; '.join(check.examples[:3])}{'; ...' if len(check.examples) > 3 else ''}); "
        "pass --accept-tokenizer-differences (tokenizer_graph_builder(accept_differences=True)) to write it "
        "anyway, the differences recorded in the manifest")


def graph_record(data: bytes, check: TokenizerCheck, max_length: int) -> dict[str, Any]:
    """The manifest's `tokenizer_graph` section."""
    return {"file": GRAPH_FILE, "op": "BertTokenizer", "sha256": sha256_bytes(data),
            "extensions_version": extensions_version(), "max_length": max_length,
            "inputs": ["text"], "outputs": list(OUTPUTS), "pad_id": 0,
            "verified": {"inputs": check.inputs, "identical": check.identical,
                         "differing": list(check.differing), "differing_texts": list(check.texts),
                         "examples": list(check.examples), "accepted": bool(check.differing)}}
