"""The tokenizer graph (export/tokenizer_graph.py): built from the artifact's tokenizer.json, verified against HF
tokenizers at build time (refused on differences unless accepted), recorded in the manifest, kept by convert,
and used by Embedder(tokenizer="graph") with the same truncation, padding and bad-input errors as tokenizer="hf"."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tiny_text import MINILM, tiny_text_artifact, tiny_text_checkpoint

from xdeploy.core.errors import XDeployError
from xdeploy.deploy.embedder import Embedder
from xdeploy.deploy.tokenizer_graph import TokenizerSession, tokenizer_graph_builder, verify_tokenizer_graph
from xdeploy.export.artifact import load_artifact
from xdeploy.export.tokenizer_graph import (
    TOKENIZER_CORPUS,
    NotExpressible,
    bert_attrs,
    build_tokenizer_graph,
    hf_encode,
)


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> Path:
    return tiny_text_artifact(tmp_path_factory.getbasetemp())


def test_attributes_follow_tokenizer_json():
    tj = json.loads((MINILM / "tokenizer.json").read_text())
    a = bert_attrs(tj)
    # BERT's strip_accents null + lowercase means "strip" (the extensions' own converter says "don't")
    assert tj["normalizer"]["strip_accents"] is None and a.do_lower_case and a.strip_accents
    assert a.vocab[101] == a.cls_token == "[CLS]" and a.vocab[102] == a.sep_token == "[SEP]"
    assert len(a.vocab) == 30522 and a.suffix_indicator == "##"
    tj["normalizer"]["strip_accents"] = False
    assert not bert_attrs(tj).strip_accents
    gpt2_like = {"model": {"type": "BPE", "vocab": {"a": 0}}, "normalizer": None}
    with pytest.raises(NotExpressible, match="only WordPiece"):
        bert_attrs(gpt2_like)
    broken = json.loads(json.dumps(tj))
    broken["post_processor"]["single"][0] = {"SpecialToken": []}  # untrusted file: wrong shapes are one line
    with pytest.raises(NotExpressible, match="malformed tokenizer.json"):
        bert_attrs(broken)
    broken["model"] = "WordPiece"
    with pytest.raises(NotExpressible, match="malformed tokenizer.json"):
        bert_attrs(broken)


def test_verification_names_the_differences_and_the_build_refuses(tmp_path):
    """Ids equal HF's on most of the corpus; where not, the check names the inputs, and export refuses."""
    tj = json.loads((MINILM / "tokenizer.json").read_text())
    data = build_tokenizer_graph(tj, 256).SerializeToString()
    check = verify_tokenizer_graph(data, MINILM / "tokenizer.json", 256)
    assert check.inputs == len(TOKENIZER_CORPUS) and check.identical + len(check.differing) == check.inputs
    assert check.identical >= 30  # latin text, accents, emoji, truncation, empty strings agree
    for i in (0, 4, 7, 8, 21, len(TOKENIZER_CORPUS) - 3):  # "", plain, accents, ¿Dónde..., emoji, long (truncated)
        assert i not in check.differing, TOKENIZER_CORPUS[i]
    # what differs is recomputed independently here: the graph's ids vs HF's
    sess = TokenizerSession(data)
    want = hf_encode(MINILM / "tokenizer.json", TOKENIZER_CORPUS, 256)
    ids, mask, _, _ = sess.encode(list(TOKENIZER_CORPUS))
    got = [ids[i, :mask[i].sum()].tolist() for i in range(len(TOKENIZER_CORPUS))]
    assert tuple(i for i in range(len(got)) if got[i] != want[i]) == check.differing
    # the build refuses without the user's acceptance, naming the inputs
    from xdeploy.export.onnx_export import export

    ck = tmp_path / "ck"
    ck.mkdir()
    tiny_text_checkpoint(ck)
    if check.differing:
        with pytest.raises(XDeployError, match=r"differs from Hugging Face tokenizers on \d+ of \d+ verification "
                                               r"inputs \(input \d+ .*--accept-tokenizer-differences"):
            export("bert", checkpoint=ck, out=tmp_path / "refused", tokenizer_graph=tokenizer_graph_builder())
        assert not (tmp_path / "refused").exists()


def test_manifest_record_convert_and_tampering(art, tmp_path):
    from xdeploy.export.convert import convert_artifact
    from xdeploy.export.tokenizer_graph import sha256_bytes

    a = load_artifact(art)
    tg = a.manifest["tokenizer_graph"]
    import onnxruntime_extensions

    assert tg["extensions_version"] == onnxruntime_extensions.__version__ and tg["max_length"] == 64
    assert tg["sha256"] == sha256_bytes(a.tokenizer_graph.read_bytes()) == a.manifest["files"][tg["file"]]
    assert tg["verified"]["accepted"] == bool(tg["verified"]["differing"])
    fp16 = load_artifact(convert_artifact(art, tmp_path / "fp16", "fp16"))
    assert fp16.manifest["tokenizer_graph"] == tg
    assert fp16.tokenizer_graph.read_bytes() == a.tokenizer_graph.read_bytes()
    # a swapped tokenizer graph is caught by the sha256 check
    bad = tmp_path / "bad"
    shutil.copytree(art, bad)
    (bad / "tokenizer" / "tokenizer.onnx").write_bytes(b"not a graph")
    with pytest.raises(XDeployError, match="corrupted: sha256 of tokenizer/tokenizer.onnx"):
        load_artifact(bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["tokenizer_graph"]["file"] = "../elsewhere.onnx"
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(XDeployError, match="points outside the artifact directory"):
        load_artifact(bad)


def test_embedder_graph_equals_hf_and_handles_bad_input(art):
    tg = load_artifact(art).manifest["tokenizer_graph"]
    differing = set(tg["verified"]["differing"])
    texts = [t for i, t in enumerate(TOKENIZER_CORPUS) if i not in differing] + ["x " * 500_000]  # ~1 MB line
    with Embedder(art, tokenizer="graph") as g, Embedder(art) as h:
        gi, gt, gtr = g.tokenize(texts)
        hi, ht, htr = h.tokenize(texts)
        assert gi == hi and gt == ht and gtr == htr and len(gtr) >= 3  # same ids, same truncated inputs
        many = texts[:5] * 120  # 600 inputs: tokenized in chunks of 256
        assert g.tokenize(many) == h.tokenize(many)
        vg, sg = g.embed_with_stats(texts)
        vh, sh = h.embed_with_stats(texts)
        assert np.abs(vg - vh).max() <= 1e-5 and sg == sh
        assert g.embed([]).shape == (0, 32)
        with pytest.raises(XDeployError, match=r"input 1 is not valid UTF-8 \(byte 1"):
            g.embed(["ok", b"a\xffb"])
        with pytest.raises(XDeployError, match="input 0 is not valid Unicode"):
            g.embed(["\ud800"])
        with pytest.raises(XDeployError, match="must be a str"):
            g.embed([3])
        assert g.info()["tokenizer"] == "graph"
    with Embedder(art, tokenizer="graph", truncation="error") as g, pytest.raises(XDeployError, match="max_length=64"):
        g.embed(["word " * 100])
    with pytest.raises(XDeployError, match="differs from the tokenizer graph's 64"):
        Embedder(art, tokenizer="graph", max_length=32)
    with pytest.raises(XDeployError, match="unknown tokenizer 'spm'"):
        Embedder(art, tokenizer="spm")


def test_artifact_without_graph(tmp_path, tiny_export):
    from xdeploy.export.onnx_export import export

    plain = tiny_export("bert")
    assert load_artifact(plain).tokenizer_graph is None
    with pytest.raises(XDeployError, match="has no tokenizer graph; export it with --tokenizer-graph"):
        Embedder(plain, tokenizer="graph")
    with pytest.raises(XDeployError, match="needs a checkpoint with a tokenizer"):
        export("bert", preset="tiny", out=tmp_path / "tiny2", tokenizer_graph=tokenizer_graph_builder())
