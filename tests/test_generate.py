"""KV-cache generation: parity with Hugging Face transformers (greedy and beam) and across runners, padding,
seeded sampling, zero-copy IO binding, token agreement, limits and the CLI. Tiny models only."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from families import first, smallest

from xdeploy.cli import main
from xdeploy.core.errors import XDeployError
from xdeploy.deploy.generate import (
    GenerationConfig,
    Generator,
    generate,
    normalize_prompts,
    pad_rows,
    sample,
    token_agreement,
)
from xdeploy.deploy.registry import RUNNERS, open_runner
from xdeploy.export.artifact import load_artifact
from xdeploy.export.onnx_export import export
from xdeploy.models.spec import make_feeds

transformers = pytest.importorskip("transformers")

V, EOS = 300, 299
PROMPTS = [[5, 17, 250, 3, 99, 42], [7, 7, 180], [120, 11, 64, 2, 5, 88, 140, 31, 9]]


def _runners() -> list[str]:
    """fp32 runners to hold to token-for-token parity; ov joins once its runner is importable."""
    names = ["torch", "ort"]
    if "ov" in RUNNERS:
        try:
            import openvino  # noqa: F401

            names.append("ov")
        except ImportError:
            pass
    return names


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A random GPT-2 in Hugging Face format, the HF model itself, and its xdeploy artifact (--checkpoint).

    Weights are drawn larger than HF's default init (std 0.4, embeddings std 1): at std 0.02 a 2-layer model
    greedily repeats a handful of tokens, which would make token parity nearly vacuous; with these the
    references use > 25 distinct tokens while the top-2 logit margin stays far above fp32 noise."""
    d = tmp_path_factory.mktemp("hf")
    # head size 16: onnxruntime keeps the cache itself by default (GroupQueryAttention needs a multiple of 8)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                  bos_token_id=EOS, eos_token_id=EOS, initializer_range=0.4)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        model.transformer.wte.weight.normal_(0.0, 1.0)
    model.save_pretrained(d / "ckpt", safe_serialization=True)
    return model, load_artifact(export("gpt", checkpoint=d / "ckpt", out=d / "art"))


@pytest.fixture(scope="module")
def seq2seq(tiny_export):
    return load_artifact(tiny_export("transformer"))


def _hf_generate(model, prompt, **kw) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=EOS, **kw)[0, len(prompt):]
    toks = out.tolist()
    return toks[:toks.index(EOS) + 1] if EOS in toks else toks  # after EOS, HF pads with pad_token_id


def test_greedy_equals_transformers_generate_on_every_runner(hf):
    model, art = hf
    want = [_hf_generate(model, p, do_sample=False, max_new_tokens=32) for p in PROMPTS]
    assert len({t for w in want for t in w}) > 15, "degenerate reference: the test would prove little"
    for runner, kv in [(r, "auto") for r in _runners()] + [("ort", "loop")]:
        with Generator(art, runner, kv_cache=kv) as g:
            if runner == "ort":  # onnxruntime's own cache by default (deploy/ort_cache.py); the loop's when asked
                assert g.engine_cache == (kv == "auto")
            for p, w in zip(PROMPTS, want):
                got = g.generate([p], GenerationConfig(max_new_tokens=32))
                assert list(got.tokens[0]) == w, (runner, kv)
                assert got.stop[0] == ("eos" if w[-1] == EOS else "length")


def test_beam_search_equals_transformers_beam_search(hf):
    model, art = hf
    for k, m in ((3, 12), (4, 20)):
        want = [_hf_generate(model, p, do_sample=False, num_beams=k, length_penalty=0.75, early_stopping=False,
                             max_new_tokens=m) for p in PROMPTS[:2]]
        for runner, cache, kv in (("ort", True, "auto"), ("ort", True, "loop"), ("torch", True, "auto"),
                                  ("ort", False, "auto")):
            with Generator(art, runner, use_cache=cache, kv_cache=kv) as g:
                got = g.generate(PROMPTS[:2], GenerationConfig(max_new_tokens=m, num_beams=k))
            assert [list(t) for t in got.tokens] == want, (runner, cache, kv, k)
            assert all(s < 0 for s in got.scores)


def test_padded_batch_rows_generate_what_they_generate_alone(hf):
    _, art = hf
    gc = GenerationConfig(max_new_tokens=16, eos_token_id=-1)
    with Generator(art, "ort") as g:
        alone = [g.generate([p], gc).tokens[0] for p in PROMPTS]
        ragged = g.generate(PROMPTS, gc).tokens
        right_ids, right_mask = pad_rows(PROMPTS, "right", pad_id=EOS)
        left_ids, left_mask = pad_rows(PROMPTS, "left", pad_id=0)
        right = g.generate(right_ids, gc, attention_mask=right_mask).tokens
        left = g.generate(left_ids, gc, attention_mask=left_mask).tokens
        beams_alone = [g.generate([p], GenerationConfig(max_new_tokens=8, num_beams=2)).tokens[0] for p in PROMPTS]
        beams = g.generate(PROMPTS, GenerationConfig(max_new_tokens=8, num_beams=2)).tokens
    assert list(ragged) == list(right) == list(left) == alone
    assert list(beams) == beams_alone
    assert all(len(t) == 16 for t in alone)  # eos_token_id=-1 never stops early


def test_cache_and_recompute_paths_agree_and_cache_is_bounded(hf):
    _, art = hf
    gc = GenerationConfig(max_new_tokens=30, eos_token_id=-1)
    recomputed = generate(art, PROMPTS, gc, runner="ort", use_cache=False)
    assert recomputed.mode == "recompute"
    for kv, mode in (("auto", "engine cache"), ("loop", "cache")):  # onnxruntime's own cache, the loop's
        with Generator(art, "ort", kv_cache=kv) as g:
            cached = g.generate(PROMPTS, gc)
            edge = g.generate([[1] * 60], GenerationConfig(max_new_tokens=5, eos_token_id=-1))  # 64 positions: fits
        assert cached.tokens == recomputed.tokens and cached.mode == mode, kv
        assert len(cached.step_s) == gc.max_new_tokens - 1 and cached.time_to_first_token_s > 0
        assert len(edge.tokens[0]) == 5


def test_seeded_sampling_is_reproducible_and_runner_independent(hf):
    _, art = hf
    gc = GenerationConfig(max_new_tokens=24, do_sample=True, temperature=1.5, top_k=100, top_p=0.95, seed=7,
                          eos_token_id=-1)
    with Generator(art, "ort") as g:
        a, b = g.generate(PROMPTS, gc).tokens, g.generate(PROMPTS, gc).tokens
        other = g.generate(PROMPTS, GenerationConfig(**{**gc.__dict__, "seed": 8})).tokens
    assert a == b and a != other
    assert len({t for row in a for t in row}) > 30
    with Generator(art, "torch", use_cache=False) as g:
        assert g.generate(PROMPTS, gc).tokens == a


def test_sampler_filters():
    rng = np.random.default_rng(0)
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
    draw = lambda **kw: sample(logits, np.random.default_rng(1), **kw)  # noqa: E731
    assert set(draw(top_k=2)) == {0, 1}
    assert set(draw(top_p=0.79)) == {0, 1}  # 0.5 + 0.3 reaches 0.79: token 2 is outside the nucleus
    assert set(draw(top_p=0.81)) == {0, 1, 2}
    freq = np.bincount(draw(), minlength=4) / 4000
    assert np.abs(freq - [0.5, 0.3, 0.15, 0.05]).max() < 0.03
    cold = np.bincount(draw(temperature=0.25), minlength=4) / 4000  # p^4 renormalized: token 0 ~ 0.88
    assert cold[0] > 0.85
    assert (sample(logits[:3], rng, top_k=1) == 0).all()


def test_transformer_greedy_and_sampling_parity_across_runners(seq2seq):
    src = [[5, 9, 13, 400, 77, 21, 8], [300, 44, 6]]
    greedy = GenerationConfig(max_new_tokens=16)
    sampled = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=30.0, seed=3, eos_token_id=-1)
    ref_g = generate(seq2seq, src, greedy, runner="torch", use_cache=False)
    ref_s = generate(seq2seq, src, sampled, runner="torch", use_cache=False)
    # random post-LN weights make greedy output repetitive; high-temperature sampling exercises many tokens
    assert len({t for row in ref_s.tokens for t in row}) > 10
    bc = GenerationConfig(max_new_tokens=6, num_beams=3, eos_token_id=-1)
    rb = generate(seq2seq, src, bc, runner="torch", use_cache=False)
    for runner in _runners():
        with Generator(seq2seq, runner) as g:
            assert g.generate(src, greedy).tokens == ref_g.tokens, runner
            assert g.generate(src, sampled).tokens == ref_s.tokens, runner
            beam = g.generate(src, bc)
        assert beam.tokens == rb.tokens and np.allclose(beam.scores, rb.scores, atol=1e-4), runner
    # a padded source row generates what it generates alone (beam scores: a sharp check of the logits)
    alone = generate(seq2seq, [src[1]], bc, runner="ort")
    both = generate(seq2seq, src, bc, runner="ort")
    assert alone.tokens[0] == both.tokens[1] and alone.scores[0] == pytest.approx(both.scores[1], abs=1e-5)


def test_ort_bind_reads_and_writes_caller_buffers_in_place(hf):
    _, art = hf
    graph = art.graph("decode")
    feeds = make_feeds(graph, {"batch": 2, "cache": 9, "step": 1}, seed=1)
    outs = {"logits": np.zeros((2, 1, V), np.float32), "new_kv": np.zeros((2, 2, 2, 4, 1, 16), np.float32)}
    with open_runner("ort", art, "decode") as r:
        call = r.bind(feeds, outs)
        call()
        ptrs = {o.data_ptr() for o in call.binding.get_outputs()}
        assert ptrs == {a.ctypes.data for a in outs.values()}  # the session wrote into our arrays
        np.testing.assert_allclose(outs["logits"], r.infer(feeds)["logits"], atol=1e-5)
        feeds["cache.0.key"][...] = np.random.default_rng(2).standard_normal(feeds["cache.0.key"].shape)  # in place
        before = outs["logits"].copy()
        call()  # no rebinding: a copy taken at bind time would still hold the old cache
        assert not np.allclose(before, outs["logits"])
        np.testing.assert_allclose(outs["logits"], r.infer(feeds)["logits"], atol=1e-5)
        with pytest.raises(XDeployError, match="bound output 'logits' must be a writeable C-contiguous float32"):
            r.bind(feeds, {"logits": np.zeros((2, 1, V), np.float64)})


class _SpyArrays:
    """The GPU runners' loop arrays (deploy/base.py TorchArrays) on the CPU, counting the tensors it hands out."""

    def __init__(self):
        from xdeploy.deploy.base import TorchArrays

        self.inner, self.made = TorchArrays("cpu"), []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def zeros(self, shape, dtype):
        self.made.append(self.inner.zeros(shape, dtype))
        return self.made[-1]

    def put(self, a):
        self.made.append(self.inner.put(a))
        return self.made[-1]


def test_the_loop_cache_kept_in_torch_tensors_generates_the_host_caches_tokens(hf, seq2seq, monkeypatch):
    """ort-cuda keeps the loop's KV cache, the step's new K/V and an encoder-decoder's memory on its GPU as torch
    tensors bound by address (Runner.loop_arrays): a step copies the token in and the logits out, not the whole
    cache in and the K/V out (GPT-2 small on an NVIDIA H200 moved ~12 MB per step so). The same path on the CPU
    provider with CPU tensors: greedy and beam tokens equal to the numpy cache's, for a decoder and a seq2seq."""
    _, art = hf
    greedy = GenerationConfig(max_new_tokens=12, eos_token_id=-1)
    # beams whose reordering changes the tokens (a cache left unordered fails; fewer new tokens did not show it)
    beams = GenerationConfig(max_new_tokens=20, num_beams=4, eos_token_id=-1)
    for artifact, prompts in ((art, PROMPTS[:2]), (seq2seq, [[5, 9, 13, 400, 77, 21, 8], [300, 44, 6]])):
        with Generator(artifact, "ort", threads=1, kv_cache="loop") as g:
            want = [g.generate(prompts, c) for c in (greedy, beams)]
            spy = _SpyArrays()
            monkeypatch.setattr(g.decode, "loop_arrays", lambda spy=spy: spy)
            got = [g.generate(prompts, c) for c in (greedy, beams)]
        assert [x.tokens for x in got] == [x.tokens for x in want] and got[0].mode == "cache", artifact.model
        assert np.allclose(got[1].scores, want[1].scores, atol=1e-5)
        assert spy.made and all(isinstance(t, torch.Tensor) for t in spy.made)  # the cache was a tensor
    from types import SimpleNamespace

    from xdeploy.deploy.base import LoopArrays, TorchArrays
    from xdeploy.deploy.ort_gpu_runner import OrtCudaRunner

    # ort-cuda opens beside a torch without CUDA (onnxruntime-gpu needs none): its loop then keeps the host cache
    placed = OrtCudaRunner.loop_arrays(SimpleNamespace(device_id=0))
    assert type(placed) is (TorchArrays if torch.cuda.is_available() else LoopArrays)
    with open_runner("ort", art, "decode") as r:  # a bound tensor output of the wrong dtype: one line
        feeds = make_feeds(r.graph, {"batch": 1, "cache": 3, "step": 1}, seed=1)
        with pytest.raises(XDeployError, match="bound output 'new_kv' must hold float32, not float64"):
            r.bind(feeds, {"new_kv": torch.zeros((2, 2, 1, 4, 1, 16), dtype=torch.float64)})


def test_cuda_graph_binding_mirrors_the_host_buffers_and_keys_graphs_by_address(hf, monkeypatch):
    """ort-cuda's CUDA graphs (option cuda_graph, deploy/ort_gpu_runner.py CudaGraphs): a captured graph replays the
    device addresses it was captured on, so the bound decode step's host buffers (token, positions, mask, logits)
    are mirrored into fixed device buffers and each set of bound addresses gets its own graph id. The same path on
    the CPU provider with CPU tensors (no graph to capture there): greedy and beam tokens equal to the plain
    binding's; the ids follow the addresses exactly."""
    from xdeploy.deploy.ort_gpu_runner import CudaGraphs

    _, art = hf
    greedy = GenerationConfig(max_new_tokens=12, eos_token_id=-1)
    beams = GenerationConfig(max_new_tokens=20, num_beams=4, eos_token_id=-1)
    with Generator(art, "ort", threads=1, kv_cache="loop") as g:
        want = [g.generate(PROMPTS[:2], c) for c in (greedy, beams)]
        graphs, spy = CudaGraphs("cpu"), _SpyArrays()
        monkeypatch.setattr(g.decode, "loop_arrays", lambda: spy)
        monkeypatch.setattr(g.decode, "bind", lambda i, o: graphs.bind(g.decode.bind_with, i, o))
        monkeypatch.setattr(g.decode, "graphs", graphs, raising=False)  # as ort-cuda holds them
        got = [g.generate(PROMPTS[:2], c) for c in (greedy, beams)]
    assert [x.tokens for x in got] == [x.tokens for x in want]
    assert want[0].mode == "cache" and got[0].mode == "cache (CUDA graphs)"  # the record says which it timed
    assert np.allclose(got[1].scores, want[1].scores, atol=1e-5)
    # the host token, positions, masks and logits went through mirrors, one per (name, shape, dtype): greedy's
    # two rows and the beams' eight
    assert {(n, s[0]) for n, s, _ in graphs.mirrors} == {(n, r) for n in ("input_ids", "position_ids", "step_mask",
                                                                        "cache_mask", "logits") for r in (2, 8)}
    assert len(graphs.ids) == 2
    # two threads generating on one runner share the mirrors of one shape: still each its own tokens
    with Generator(art, "ort", threads=1, kv_cache="loop") as g:
        graphs = CudaGraphs("cpu")
        monkeypatch.setattr(g.decode, "loop_arrays", lambda: _SpyArrays())
        monkeypatch.setattr(g.decode, "bind", lambda i, o: graphs.bind(g.decode.bind_with, i, o))
        prompts = [[PROMPTS[0]], [PROMPTS[1]], [PROMPTS[2]], [PROMPTS[0][:2]]] * 2
        alone = [g.generate(p, greedy).tokens for p in prompts]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda p: g.generate(p, greedy).tokens, prompts))
    assert together == alone
    a, b = torch.zeros(3), torch.zeros(3)
    small = CudaGraphs("cpu", limit=3)
    first = small.graph_id({"x": a, "y": b})
    assert small.graph_id({"y": b, "x": a}) == first  # the same addresses: the captured graph replays
    assert small.graph_id({"x": b, "y": a}) != first  # swapped buffers are another graph
    assert small.graph_id({"x": a[:2], "y": b}) not in (first, -1)  # another shape at the same address too
    assert small.graph_id({"x": torch.zeros(3), "y": b}) == -1  # past the limit: run uncaptured


def test_token_agreement():
    a = token_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
    assert a.first_divergence == (2, None) and a.agreement == pytest.approx(5 / 6) and a.compared == 6
    b = token_agreement([[1, 2, 3]], [[1, 2, 3, 7, 7]])  # a late EOS counts as disagreement
    assert b.first_divergence == (3,) and b.agreement == pytest.approx(3 / 5)
    with pytest.raises(XDeployError, match="cannot compare 1 rows"):
        token_agreement([[1], [2]], [[1]])


def test_reduced_precision_divergence_is_measured(hf, tmp_path):
    """fp16 vs fp32 greedy on ort. The agreement and first divergences are those of a position-by-position count,
    and every token fp16 picks is a near-tie of the fp32 model's choice on fp16's own history: its fp32 logit
    (Hugging Face, teacher-forced) is within the fp16 tolerance band of the best one. A broken fp16 decode (stale
    cache, shifted positions) picks tokens far down the fp32 ranking and fails here."""
    from xdeploy.export.precision import EXPORT_PRECISIONS

    if "fp16" not in EXPORT_PRECISIONS:
        pytest.skip("fp16 export not available")
    model, art = hf
    half = load_artifact(export("gpt", checkpoint=art.manifest["source"]["checkpoint"], out=tmp_path / "fp16",
                                precision="fp16"))
    n = 24
    gc = GenerationConfig(max_new_tokens=n, eos_token_id=-1)
    ref = generate(art, PROMPTS, gc, runner="ort")
    got = generate(half, PROMPTS, gc, runner="ort")
    ag = token_agreement(ref, got)
    same = sum(a == b for r, g in zip(ref.tokens, got.tokens) for a, b in zip(r, g))
    firsts = tuple(next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), None)
                   for r, g in zip(ref.tokens, got.tokens))
    assert ag.compared == 3 * n and ag.agreement == pytest.approx(same / (3 * n)) and ag.first_divergence == firsts
    tol = half.spec.tolerances["fp16"]
    for prompt, toks in zip(PROMPTS, got.tokens):
        assert len(toks) == n
        with torch.no_grad():  # logits[i] predicts the token after position i
            logits = model(torch.tensor([prompt + list(toks)])).logits[0, len(prompt) - 1:-1].double().numpy()
        best = logits.max(axis=-1)
        chosen = logits[np.arange(n), list(toks)]
        band = 2 * (tol.atol + tol.rtol * np.abs(best))  # both logits may move by atol + rtol*|logit|
        assert np.all(best - chosen <= band), (best - chosen, band)


def test_limits_and_bad_input(hf):
    _, art = hf
    with Generator(art, "ort") as g:
        cases = [
            (lambda: g.generate([[1] * 60], GenerationConfig(max_new_tokens=6)), "needs 65 positions; .* 64"),
            (lambda: g.generate([[1]] * 6, GenerationConfig(num_beams=3)), "6 x beams 3 = 18 rows exceeds .* 16"),
            (lambda: g.generate([[1, 900]]), "token id 900 is outside the vocabulary 0..299"),
            (lambda: g.generate([[1], []]), "at least one real token"),
            (lambda: g.generate([[1]], GenerationConfig(do_sample=True, num_beams=2)), "sampling with beams"),
            (lambda: g.generate([[1]], GenerationConfig(top_p=0.0)), "top-p must be in"),
            (lambda: g.generate(np.ones((2, 3), np.int64), attention_mask=np.ones((2, 4))), "differs from"),
        ]
        for fn, msg in cases:
            with pytest.raises(XDeployError, match=msg):
                fn()
    assert normalize_prompts(np.array([[0, 4, 5], [6, 0, 0]]), np.array([[0, 1, 1], [1, 0, 0]])) == [[4, 5], [6]]


def test_generation_from_an_artifact_runs_without_torch(hf, seq2seq):
    """The decoding loop reads its token facts from the manifest (Artifact.vocabulary), not the model's config class
    (whose file imports torch): a decoder and an encoder-decoder generate, greedy and with beams, in a process
    where `import torch` fails, the same tokens as here."""
    model, art = hf
    cases = [(art, [[5, 17, 250]], 2), (seq2seq, [[5, 9, 13, 400, 77]], 3)]
    want = []
    for a, prompt, beams in cases:
        with Generator(a, "ort") as g:
            want.append([list(map(list, g.generate(prompt, GenerationConfig(max_new_tokens=8, num_beams=b)).tokens))
                         for b in (1, beams)])
    code = ("import json, sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
            "from xdeploy.deploy.generate import GenerationConfig, Generator\n"
            f"cases = {[(str(a.path), p, b) for a, p, b in cases]!r}\n"
            "got = []\n"
            "for a, prompt, beams in cases:\n"
            "    with Generator(a, 'ort') as g:\n"
            "        got.append([[list(t) for t in g.generate(prompt, GenerationConfig(max_new_tokens=8, "
            "num_beams=b)).tokens] for b in (1, beams)])\n"
            "assert 'xdeploy.models.registry' not in sys.modules\n"
            "print(json.dumps(got))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout) == want
    assert art.vocabulary.size == model.config.vocab_size and art.vocabulary.eos_token_id == model.config.eos_token_id
    assert seq2seq.vocabulary.bos_token_id is not None


def test_a_manifests_bad_token_facts_fail_at_load(hf, tmp_path):
    """The vocabulary is untrusted manifest input: a special id outside the vocabulary, a missing or non-integer
    field is refused when the artifact loads, in one line naming the field."""
    _, art = hf
    for change, msg in [({"eos_token_id": 300}, "'eos_token_id' is 300; expected an id below vocab_size 300"),
                        ({"vocab_size": "300"}, "'vocab_size' is '300'; expected int"),
                        ({"max_positions": None}, "'max_positions' is None; expected int"),
                        ({"pad_token_id": -1}, "'pad_token_id' is -1; expected an int >= 0"),
                        ({"eos_token_id": True}, "'eos_token_id' is True; expected int")]:
        bad = tmp_path / f"bad-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(art.path, bad)
        m = json.loads((bad / "manifest.json").read_text())
        m["config"] |= change
        (bad / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(XDeployError, match="invalid manifest .*" + re.escape(msg)) as e:
            load_artifact(bad)
        assert "\n" not in str(e.value)


def test_cli_generate_json_and_errors(hf, tmp_path, capsys):
    _, art = hf
    out = tmp_path / "g.json"
    assert main(["generate", str(art.path), "--runner", "ort", "--prompt-ids", "5,17,250,3,99,42",
                 "--new-tokens", "12", "--beams", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    want = generate(art, [PROMPTS[0]], GenerationConfig(max_new_tokens=12, num_beams=2)).tokens[0]
    assert data["tokens"] == [list(want)] and data["config"]["num_beams"] == 2
    assert "beam search k=2" in capsys.readouterr().out
    encoder = first(generates=False)  # a model without a decoder role: by name, and as an artifact directory
    enc_art = export(encoder, preset=smallest(encoder), out=tmp_path / "encoder")
    for argv, msg in [
        (["generate", str(art.path), "--prompt", "hello"], "has no tokenizer"),
        (["generate", str(art.path), "--prompt-ids", "1,x"], "comma-separated integers"),
        (["generate", encoder], f"model '{encoder}' does not generate text"),
        (["generate", str(enc_art)], f"model '{encoder}' does not generate text"),
        (["generate", str(art.path), "--runner", "nope"], "unknown runner 'nope'"),
    ]:
        with pytest.raises(SystemExit) as e:
            sys.exit(main(argv))
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, err


def test_decode_bench_weight_bytes_and_context_profile(hf):
    from xdeploy.studies.decode_bench import context_profile, weight_bytes_per_token

    model, art = hf
    params = sum(p.numel() for p in model.parameters())  # tied LM head counted once
    wpe = model.transformer.wpe.weight.numel()  # position table: only gathered, one row per step
    got = weight_bytes_per_token(art.onnx_path("decode"))
    assert abs(got - 4 * (params - wpe)) <= 0.02 * 4 * params, (got, 4 * (params - wpe))  # wpe alone is 4%
    prof = context_profile((1.0, 2.0, 3.0, 4.0, 5.0), prompt_len=60)  # contexts 61..65
    assert prof == {"32-63": 2.0, "64-127": 4.5}


def test_decode_bench_quick_honours_new_tokens(monkeypatch):
    """--quick used to replace --new-tokens with 64; the argument handling is what is tested (run is recorded)."""
    from xdeploy.studies import decode_bench

    seen = []
    monkeypatch.setattr(decode_bench, "run", lambda **kw: seen.append(kw) or (_ for _ in ()).throw(
        decode_bench.XDeployError("stop here")))
    for argv, new in ((["--quick", "--new-tokens", "8"], 8), (["--quick"], 64), ([], 256), (["--new-tokens", "5"], 5)):
        assert decode_bench.main(argv) == 2
        assert seen[-1]["new"] == new, argv
    assert decode_bench.main(["--new-tokens", "0"]) == 2 and len(seen) == 4


def test_the_decode_graph_prefills_the_prompt_with_one_runner(hf):
    """gpt's decode graph takes the whole prompt as one step (step_mask), so generation opens one graph: one copy
    of the weights per engine. Its prefill must compute what graph `model` (the full forward, the route of
    artifacts without a step_mask) computes for a left-padded batch: the last token's logits, and the K/V of
    every real prompt position (padded slots are masked later and may differ)."""
    from xdeploy.deploy.generate import _DecoderCached, pad_rows

    model, art = hf
    feeds = art.capabilities.decoding
    assert feeds.prefill_graph == feeds.decode_graph and feeds.step_mask
    ids, mask = pad_rows([[5, 9, 3, 17, 2, 8], [11, 4], [7]], "left")
    with Generator(art, "ort") as g, open_runner("ort", art, "model") as full:
        assert g.prefill is g.decode and len(g._runners()) == 1
        logits, kv = _DecoderCached(g, ids, mask, 1, 4)._prefill()
        ref = full.infer({"input_ids": ids, "attention_mask": mask})
    np.testing.assert_allclose(logits, ref["logits"][:, -1], atol=1e-4)
    real = mask.astype(bool)  # (B, T)
    np.testing.assert_allclose(kv[:, :, real[:, None, :].repeat(kv.shape[3], 1)],
                               ref["present"][:, :, real[:, None, :].repeat(kv.shape[3], 1)], atol=1e-4)
    with torch.no_grad():  # and what Hugging Face computes for the unpadded longest row
        hf_logits = model(torch.tensor(ids[:1])).logits[0, -1].numpy()
    np.testing.assert_allclose(logits[0], hf_logits, atol=1e-3)


def test_prefill_with_the_full_graph_generates_the_same_tokens(hf):
    """prefill_graph="model": the prompt runs through the full graph (a second runner, its own weights: at
    int8-dynamic its 7-bit int8 weights, whose kernels VNNI/AMX CPUs run faster) and the decode graph steps on.
    At fp32 both prefills compute the same thing, so every row, padded batches and beams included, generates
    what the one-graph route generates; anything else is refused in one line before a runner opens."""
    _, art = hf
    gc = GenerationConfig(max_new_tokens=12, eos_token_id=-1)
    beams = GenerationConfig(max_new_tokens=6, num_beams=2)
    with Generator(art, "ort") as one, Generator(art, "ort", prefill_graph="model") as two:
        assert len(one._runners()) == 1 and len(two._runners()) == 2
        assert two.prefill.graph.name == "model" and two.decode.graph.name == "decode"
        assert [list(t) for t in two.generate(PROMPTS, gc).tokens] == \
            [list(t) for t in one.generate(PROMPTS, gc).tokens]
        assert [list(t) for t in two.generate(PROMPTS, beams).tokens] == \
            [list(t) for t in one.generate(PROMPTS, beams).tokens]
    with Generator(art, "ort", prefill_graph="decode") as same:  # the model's own prefill graph: one runner
        assert len(same._runners()) == 1
    with pytest.raises(XDeployError, match="prefill graph 'nope': expected 'decode' .* full graph 'model'"):
        Generator(art, "ort", prefill_graph="nope")


def test_int8_dynamic_decode_keeps_8_bit_weights_and_the_greedy_path(tiny_export, tmp_path):
    """On the trained tiny GPT (real weights, d_model 64: few products to average rounding out), int8-dynamic's
    default gives the decode step uint8 8-bit weights (exact on every x86 class) and keeps the full-sequence
    model graph on 7-bit int8 weights; greedy decoding then follows fp32 for far longer than with 7-bit int8 weights,
    which leave it within the first tokens (1 of 128 on Zen 3; the uint8 artifact 15)."""
    from xdeploy.api import convert_artifact
    from xdeploy.export.precision import PrecisionOptions

    src = tiny_export("gpt")
    default = load_artifact(convert_artifact(src, tmp_path / "u8", "int8-dynamic", measured=False, optimize=True))
    int8w = load_artifact(convert_artifact(src, tmp_path / "s8", "int8-dynamic", measured=False, optimize=True,
                                           options=PrecisionOptions(int8_dynamic_weights="int8")))
    conv = default.manifest["conversion"]
    assert (conv["decode"]["weight_type"], conv["decode"]["weight_bits"]) == ("uint8", 8)
    assert (conv["model"]["weight_type"], conv["model"]["weight_bits"]) == ("int8", 7)
    assert conv["decode"]["saturation"]["proven_for"] == ["vnni", "amx", "avx2"]
    prompt = [list(b"Export, optimize, run and benchmark transformer models. Reference PyTorch models"[:32])]
    gc = GenerationConfig(max_new_tokens=32, eos_token_id=-1)
    ref = generate(load_artifact(src), prompt, gc, runner="ort")

    def agreed(art) -> int:
        first = token_agreement(ref, generate(art, prompt, gc, runner="ort")).first_divergence[0]
        return 32 if first is None else first

    u8, s8 = agreed(default), agreed(int8w)
    assert u8 >= 8 and u8 > s8, (u8, s8)


def test_int8_dynamic_blocks_put_every_decode_weight_in_8_bit_blocks(tiny_export, tmp_path):
    """--int8-dynamic-weights blocks: every dense layer of the decode step (the tied LM head's Transpose(wte) too)
    becomes onnxruntime's MatMulNBits with 8-bit blocks of 128, the full-sequence model graph keeps 7-bit int8
    weights; no u8*s8 pair is left to saturate (proven for every class); the golden probes pass on ort and ov, and
    greedy decoding through onnxruntime's own cache follows fp32 on the trained tiny GPT."""
    import onnx

    from xdeploy.api import convert_artifact
    from xdeploy.deploy.probes import verify_artifact
    from xdeploy.export.precision import BLOCK_SIZE, PrecisionOptions

    src = tiny_export("gpt")
    art = load_artifact(convert_artifact(src, tmp_path / "blocks", "int8-dynamic", measured=False,
                                         options=PrecisionOptions(int8_dynamic_weights="blocks")))
    conv = art.manifest["conversion"]
    assert (conv["decode"]["weight_type"], conv["decode"]["weight_bits"], conv["decode"]["block_size"]) == \
        ("blocks", 8, BLOCK_SIZE)
    assert (conv["model"]["weight_type"], conv["model"]["weight_bits"]) == ("int8", 7)
    assert conv["decode"]["saturation"]["proven_for"] == ["vnni", "amx", "avx2"]
    fp32 = onnx.load(str(load_artifact(src).onnx_path("decode")), load_external_data=False)
    weights = {i.name for i in fp32.graph.initializer}
    producer = {o: n for n in fp32.graph.node for o in n.output}
    dense = [n for n in fp32.graph.node if n.op_type == "MatMul" and (n.input[1] in weights or (
        n.input[1] in producer and producer[n.input[1]].op_type == "Transpose"
        and producer[n.input[1]].input[0] in weights))]
    q = onnx.load(str(art.onnx_path("decode")), load_external_data=False)
    ops = [n.op_type for n in q.graph.node]
    assert ops.count("MatMulNBits") == len(dense) == conv["decode"]["quantized_ops"]["MatMulNBits"] > 0
    assert "MatMulInteger" not in ops and "DynamicQuantizeLinear" not in ops
    for runner in ("ort", "ov"):
        rep = verify_artifact(art, runner, remember=False)
        assert rep.passed, [rep.failure_line(c) for c in rep.failures]
    prompt = [list(b"Export, optimize, run and benchmark transformer models. Reference PyTorch models"[:32])]
    gc = GenerationConfig(max_new_tokens=32, eos_token_id=-1)
    first = token_agreement(generate(load_artifact(src), prompt, gc, runner="ort"),
                            generate(art, prompt, gc, runner="ort")).first_divergence[0]
    assert first is None or first >= 8, first


def test_cache_layout_binds_per_layer_views_and_reads_older_single_input_exports():
    from xdeploy.deploy.generate import _cache_layout
    from xdeploy.models.spec import DecoderFeeds, Graph, TensorSpec, cache_inputs

    f = DecoderFeeds(prompt_ids="input_ids", prompt_mask="attention_mask", step_ids="input_ids")
    ids = TensorSpec("input_ids", "int64", ("batch", 1), "ids", V)
    per_layer = Graph("decode", "decode", (ids, *cache_inputs(3, 4, 8)), ())
    lay = _cache_layout(per_layer, f)
    assert (lay.layers, lay.heads, lay.head_size, lay.names) == (3, 4, 8, f.cache_names(3))
    buf = np.zeros((3, 2, 2, 4, 5, 8), np.float32)
    feeds = lay.feeds(buf)
    buf[2, 1, :, :, 4] = 7.0  # a write into the loop's buffer is what the bound layer-2 value input reads
    assert feeds["cache.2.value"][:, :, 4].min() == 7.0 and feeds["cache.2.key"].max() == 0.0
    assert all(v.flags.c_contiguous and np.shares_memory(v, buf) for v in feeds.values())
    # an export from before the per-layer inputs: one (L, 2, B, nh, C, hs) input, bound whole
    single = Graph("decode", "decode", (ids, TensorSpec("cache", "float32", (3, 2, "batch", 4, "cache", 8))), ())
    old = _cache_layout(single, f)
    assert (old.layers, old.heads, old.head_size, old.names) == (3, 4, 8, None)
    assert old.feeds(buf) == {"cache": buf} and old.empty(2, 1)["cache"].shape == (3, 2, 2, 4, 1, 8)
    # a manifest whose cache inputs are not what the loop binds: one line naming what was expected
    broken = Graph("decode", "decode", (ids, *cache_inputs(3, 4, 8)[:-1]), ())  # layer 2's value missing
    with pytest.raises(XDeployError, match=r"expected cache\.<layer>\.key / \.value .* re-export the artifact"):
        _cache_layout(broken, f)
