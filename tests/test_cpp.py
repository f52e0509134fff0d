"""The C++ runtime (deploy/cpp): built with CMake against the pip wheel's libonnxruntime and Debian's ORT headers;
its embeddings equal the Python Embedder's on the real MiniLM artifact; bad artifacts and ids give one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
from cpp_build import CPP, build_cpp
from tiny_text import MINILM, minilm_artifact

from xdeploy.deploy.embedder import Embedder, plan_batches


@pytest.fixture(scope="module")
def binary() -> Path:
    """Configure + build (a no-op when `make cpp` already built it). Fails, not skips: CI must build it."""
    return build_cpp() / "xdeploy-embed"


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    return minilm_artifact(tmp_path_factory)


def run_cpp(binary: Path, artifact: Path | str, ids: list[list[int]] | str, *args: str
            ) -> subprocess.CompletedProcess[str]:
    stdin = ids if isinstance(ids, str) else "".join(" ".join(map(str, r)) + "\n" for r in ids)
    return subprocess.run([str(binary), str(artifact), *args], input=stdin, capture_output=True, text=True,
                          timeout=120)


SENTENCES = [
    "A man is playing a guitar.", "", "Stocks fell sharply after the central bank raised rates.",
    "¿Dónde está la biblioteca?", "emoji 🎉 and 日本語", "x", "The quick brown fox jumps over the lazy dog. " * 40,
    "How do I reset my password if I no longer have access to my email account?",
] * 5


def test_cpp_matches_python_embedder(binary, minilm):
    with Embedder(minilm) as emb:
        ids, _, truncated = emb.tokenize(SENTENCES)
        ref = emb.embed(SENTENCES)
    assert len(truncated) == 5  # the long sentence is cut to 256 tokens by the tokenizer, then given to C++
    for args in ([], ["--batch", "7", "--threads", "1"]):
        r = run_cpp(binary, minilm, ids, *args)
        assert r.returncode == 0, r.stderr
        got = np.array([[float(x) for x in line.split()] for line in r.stdout.splitlines()], np.float32)
        assert got.shape == ref.shape == (len(SENTENCES), 384)
        assert np.abs(got - ref).max() <= 1e-5, np.abs(got - ref).max()
        assert "mean pooling, L2-normalized) on cpu" in r.stderr


def test_cpp_plans_the_same_batches_as_python(binary, minilm):
    """xdeploy::plan_batches cuts every length list exactly as deploy/embedder.py's plan_batches (one cost model in
    two languages), and `--batching fixed` gives the same vectors as the default cost plan."""
    check = binary.with_name("xdeploy-embed-check")
    rng = np.random.default_rng(1)
    for trial in range(40):
        n = int(rng.integers(0, 300))
        bs, d, pad = int(rng.integers(1, 65)), int(rng.choice([32, 384, 768])), int(rng.choice([1, 1, 8]))
        lengths = sorted(rng.integers(1, 513, n).tolist() if trial % 2 else rng.choice([5, 9, 12, 200], n).tolist())
        for mode in ("cost", "fixed"):
            r = subprocess.run([str(check), "--plan", str(bs), str(d), str(pad), "512", mode],
                               input=" ".join(map(str, lengths)), capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            got = [tuple(map(int, line.split())) for line in r.stdout.splitlines()]
            assert got == plan_batches(lengths, bs, d=d, pad_to=pad, smax=512, batching=mode), (trial, mode)
    with Embedder(minilm) as emb:
        ids = emb.tokenize(SENTENCES)[0]
    out = {}
    for mode in ("cost", "fixed"):
        r = run_cpp(binary, minilm, ids, "--batching", mode)
        assert r.returncode == 0, r.stderr
        out[mode] = np.array([[float(x) for x in line.split()] for line in r.stdout.splitlines()], np.float32)
    assert np.abs(out["cost"] - out["fixed"]).max() <= 2e-5
    r = run_cpp(binary, minilm, ids, "--batching", "greedy")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        'xdeploy-embed: error: batching "greedy" is not supported; expected cost or fixed'], r.stderr


def test_cpp_cls_pooling_without_pooling_record(binary, tiny_export):
    art = tiny_export("bert")
    ids = [[1, 5, 9, 2], [1, 7, 2], [1] + list(range(3, 60)) + [2]]
    with Embedder(art) as emb:
        ref = emb.embed_ids(ids)
    r = run_cpp(binary, art, ids, "--batch", "2")
    assert r.returncode == 0, r.stderr
    got = np.array([[float(x) for x in line.split()] for line in r.stdout.splitlines()], np.float32)
    assert np.abs(got - ref).max() <= 1e-5 and "(cls pooling) on cpu" in r.stderr


def test_cpp_checks_the_golden_probes_at_load(binary, tiny_export, tmp_path):
    """The C++ runtime runs graph "model"'s golden probes (their raw copies) at load: a corrupted artifact is
    refused with one line naming the graph, output and cosine (exit 1), --no-verify runs it and says so, and an
    artifact made before probes existed runs with a notice."""
    from planted import corrupt_artifact, strip_probes

    art = tiny_export("bert")
    ids = [[1, 5, 9, 2]]
    r = run_cpp(binary, art, ids)
    assert r.returncode == 0 and "golden probes" not in r.stderr, r.stderr  # they ran and passed: nothing to say
    bad = corrupt_artifact(art, tmp_path / "bad")
    r = run_cpp(binary, bad, ids)
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    m = re.search(r"fails its golden probes here: graph 'model' output 'last_hidden_state': cosine (\S+) ", r.stderr)
    assert m and float(m.group(1)) < 0.99999 and "--no-verify" in r.stderr, r.stderr
    r = run_cpp(binary, bad, ids, "--no-verify")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1, r.stderr
    assert "xdeploy-embed: warning: golden probes not checked (--no-verify)" in r.stderr
    r = run_cpp(binary, strip_probes(art, tmp_path / "old"), ids)
    assert r.returncode == 0 and "xdeploy-embed: notice: " in r.stderr and "has no golden probes" in r.stderr


def test_cpp_reports_its_providers_and_versions(binary):
    r = subprocess.run([str(binary), "--providers"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first, *providers = r.stdout.splitlines()
    assert first.startswith(f"onnxruntime {onnxruntime.__version__} (headers: ORT_API_VERSION ")
    header_api = int(first.rsplit(" ", 1)[1].rstrip(")"))
    assert header_api <= int(onnxruntime.__version__.split(".")[1])  # older headers, newer library: ABI-stable
    assert "CPUExecutionProvider" in providers


def _copy_artifact(src: Path, dst: Path) -> Path:
    dst.mkdir()
    (dst / "tokenizer").mkdir()
    weights = ["model.onnx.data"] if (src / "model.onnx.data").exists() else []  # external data (export/writer.py)
    for f in ("manifest.json", "model.onnx", "tokenizer/tokenizer.json", *weights):
        os.link(src / f, dst / f)  # hard link: no 90 MB copy; the tests below replace files, never edit them
    return dst


def test_cpp_bad_artifacts_and_ids(binary, minilm, tmp_path):
    manifest = json.loads((minilm / "manifest.json").read_text())

    def variant(name: str, *, manifest_obj: object = None, manifest_text: str | None = None,
                model: bytes | None = None, drop: str | None = None) -> Path:
        d = _copy_artifact(minilm, tmp_path / name)
        if manifest_obj is not None or manifest_text is not None:
            (d / "manifest.json").unlink()
            (d / "manifest.json").write_text(manifest_text if manifest_text is not None else json.dumps(manifest_obj))
        if model is not None:
            (d / "model.onnx").unlink()
            (d / "model.onnx").write_bytes(model)
        if drop:
            (d / drop).unlink()
        return d

    fewer_inputs = json.loads(json.dumps(manifest))
    fewer_inputs["graphs"]["model"]["inputs"] = fewer_inputs["graphs"]["model"]["inputs"][:2]
    outside = json.loads(json.dumps(manifest))
    outside["graphs"]["model"]["file"] = "../minilm-fp32/model.onnx"
    no_graphs = {k: v for k, v in manifest.items() if k != "graphs"}
    bad_pool = manifest | {"pooling": {"mode": "avg"}}
    cases = [
        (tmp_path / "nope", "artifact directory .* does not exist"),
        (variant("no-manifest", drop="manifest.json"), "is not an xdeploy artifact: it has no manifest.json"),
        (variant("not-json", manifest_text="{oops"), "invalid manifest .*: not JSON"),
        (variant("no-graphs", manifest_obj=no_graphs), "invalid manifest .*: missing or mistyped field"),
        (variant("wrong-format", manifest_obj=manifest | {"format": "other"}), "format is not"),
        (variant("outside", manifest_obj=outside), "points outside the artifact directory"),
        (variant("no-model", drop="model.onnx"), "graph file \"model.onnx\" is missing"),
        (variant("garbage-model", model=b"not an onnx file"), "onnxruntime cannot load .*model.onnx"),
        (variant("fewer-inputs", manifest_obj=fewer_inputs), "takes inputs .* but its manifest declares"),
        (variant("bad-pooling", manifest_obj=bad_pool), "pooling mode \"avg\" is not mean, cls or max"),
    ]
    for art, msg in cases:
        r = run_cpp(binary, art, [[101, 102]])
        assert r.returncode == 2, (art, r.stdout, r.stderr)
        assert r.stderr.startswith("xdeploy-embed: error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert re.search(msg, r.stderr), (msg, r.stderr)

    for stdin, msg in [("101 102\n\n", "stdin line 2 has no token ids"), ("101 x 102\n", "\"x 102\" is not a token id"),
                       ("101 30522 102\n", "token id 30522 outside 0..30521"), ("", "stdin is empty"),
                       (" ".join(["101"] * 257) + "\n", "257 token ids; expected 1..256")]:
        r = run_cpp(binary, minilm, stdin)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, (msg, r.stderr)
    for args, msg in [(["--provider", "gpu"], "unknown provider \"gpu\""), (["--batch"], "incomplete option"),
                      (["--threads", "-1"], "--threads needs a non-negative integer"), (["--frobnicate", "1"],
                                                                                        "unknown option")]:
        r = run_cpp(binary, minilm, [[101, 102]], *args)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr)


def test_cpp_auto_provider_falls_back_and_says_why(binary, tiny_export):
    """`auto` tries TensorRT, then CUDA, then the CPU, keeping the first whose provider appends and whose session
    opens (ORT lists TensorRT even without libnvinfer). On this CPU wheel both GPU providers fail to append, so
    this runs the real fallback path; an explicit GPU provider stays a one-line error."""
    art = tiny_export("bert")
    r = run_cpp(binary, art, [[1, 5, 9, 2]])
    assert r.returncode == 0, r.stderr
    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("a GPU build of onnxruntime: the fallback reasons differ")
    line = r.stderr.strip().splitlines()[-1]
    assert re.search(r"on cpu \(auto: tensorrt unavailable \(.+\); cuda unavailable \(.+\)\)$", line), line
    r = run_cpp(binary, art, [[1, 5, 9, 2]], "--provider", "cuda")
    assert r.returncode != 0 and "provider \"cuda\" is not in this ONNX Runtime library" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------- text in ----

def _vectors(stdout: str) -> np.ndarray:
    return np.array([[float(x) for x in line.split()] for line in stdout.splitlines()], np.float32)


def run_text(binary: Path, artifact: Path, data: bytes, *args: str, env: dict | None = None
             ) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([str(binary), str(artifact), "--text", *args], input=data, capture_output=True,
                          timeout=300, env=env)


def docs_sentences() -> list[str]:
    """Every sentence of docs/embedding.md's examples: the Python lists and the printf lines of its code blocks."""
    text = (CPP.parents[1] / "docs" / "embedding.md").read_text()
    out = []
    for block in re.findall(r"```(?:python|sh|cpp)\n(.*?)```", text, re.S):
        for q in re.findall(r'"((?:[^"\\]|\\.)*)"', block):
            if " " in q and not q.startswith(("artifacts/", "-")) and "/" not in q and not q.replace(" ", "").isdigit():
                out.append(q.encode().decode("unicode_escape") if "\\u" in q else q)
        for p in re.findall(r"printf '([^']*)'", block):
            out += [x for x in p.split("\\n") if x]
    return out


def test_cpp_text_is_hugging_face_exact(binary, minilm):
    """Raw strings in C++ (its own tokenizer over tokenizer.json, the default export): ids equal the Python
    Embedder's (HF tokenizers) on the 43-input verification corpus and the test sentences, truncation counted
    alike, and vectors within 1e-5 of Python's and at cosine >= 0.99999 of sentence-transformers' on every
    sentence of docs/embedding.md's examples and of the corpus."""
    from sentence_transformers import SentenceTransformer

    from xdeploy.export.tokenizer_graph import TOKENIZER_CORPUS

    manifest = json.loads((minilm / "manifest.json").read_text())
    assert "tokenizer_graph" not in manifest and (minilm / "tokenizer" / "tokenizer.json").is_file()  # no flag
    docs = docs_sentences()
    assert len(docs) >= 6 and "A man is playing a guitar." in docs and "日本語 🎉" in docs
    texts = [t for t in TOKENIZER_CORPUS if "\n" not in t and "\r" not in t] + SENTENCES + docs  # one a line
    data = "".join(t + "\n" for t in texts).encode()
    with Embedder(minilm) as h:
        hf_ids, _, hf_trunc = h.tokenize(texts)
        ref = h.embed(texts)
    r = run_text(binary, minilm, data, "--print-ids")
    assert r.returncode == 0, r.stderr.decode()
    cpp_ids = [[int(x) for x in line.split()] for line in r.stdout.decode().splitlines()]
    assert cpp_ids == hf_ids
    assert f"{len(texts)} sentences tokenized, {len(hf_trunc)} truncated to 256 tokens" in r.stderr.decode()
    st = SentenceTransformer(str(MINILM), device="cpu").encode(texts, batch_size=32, convert_to_numpy=True)
    for args in ([], ["--batch", "7", "--threads", "1"]):
        r = run_text(binary, minilm, data, *args)
        assert r.returncode == 0, r.stderr.decode()
        got = _vectors(r.stdout.decode())
        assert got.shape == ref.shape == (len(texts), 384)
        assert np.abs(got - ref).max() <= 1e-5, np.abs(got - ref).max()
        cos = (got * st).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(st, axis=1)
        assert cos.min() >= 0.99999, (cos.min(), texts[int(cos.argmin())])


def test_cpp_text_bad_input(binary, minilm, tmp_path, tiny_export):
    # invalid UTF-8: one line naming the line and byte, exit 2 (Python's `xdeploy embed` says the same)
    r = run_text(binary, minilm, b"fine\nbad \xff\xfe here\n")
    assert r.returncode == 2 and r.stdout == b"", r.stderr
    assert r.stderr.decode().strip() == "xdeploy-embed: error: stdin line 2 is not valid UTF-8 (byte 4 of the line)"
    # overlong, surrogate, above U+10FFFF, cut short
    for bad in (b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"ok \xe2\x82"):
        r = run_text(binary, minilm, bad + b"\n")
        assert r.returncode == 2 and b"stdin line 1 is not valid UTF-8" in r.stderr, (bad, r.stderr)
    # empty stdin: an error, as for ids
    r = run_text(binary, minilm, b"")
    assert r.returncode == 2 and b"stdin is empty" in r.stderr
    # a 1 MB line: embedded (cut to max_length tokens), equal to Python's vector
    big = ("lorem ipsum dolor sit amet " * 40000)[:1 << 20]
    with Embedder(minilm) as h:
        ref = h.embed([big, "short"])
        _, _, trunc = h.tokenize([big, "short"])
    assert trunc == [0]
    r = run_text(binary, minilm, (big + "\nshort\n").encode())
    assert r.returncode == 0, r.stderr
    assert np.abs(_vectors(r.stdout.decode()) - ref).max() <= 1e-5
    # an artifact without a tokenizer, a tokenizer.json the C++ tokenizer does not support: one-line errors
    plain = tiny_export("bert")
    r = run_text(binary, plain, b"hello\n")
    assert r.returncode == 2 and b"has no tokenizer/tokenizer.json" in r.stderr, r.stderr
    bpe = _copy_artifact(minilm, tmp_path / "bpe")
    (bpe / "tokenizer" / "tokenizer.json").unlink()
    (bpe / "tokenizer" / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    r = run_text(binary, bpe, b"hello\n", "--no-verify")  # the copy has no probe files
    assert r.returncode == 2 and r.stderr.decode().count("error") == 1, r.stderr
    assert b"model type \"BPE\" is not supported; expected WordPiece" in r.stderr
    r = run_cpp(binary, minilm, [[101, 102]], "--print-ids")
    assert r.returncode == 2 and "--print-ids needs --text" in r.stderr


def test_cpp_api_empty_lists_invalid_utf8_and_long_line(binary, minilm):
    """deploy/cpp/tests/api_check.cpp: what the CLI cannot reach — empty text/id lists give empty results,
    InvalidUtf8 carries the input index and byte, a 1 MB line is cut, reported truncated and gives a unit vector."""
    r = subprocess.run([str(binary.with_name("xdeploy-embed-check")), str(minilm)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
