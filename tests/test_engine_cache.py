"""The KV cache kept inside the engine (models/spec.py EngineCache, export/openvino_ir.py `stateful_ir`,
deploy/ov_runner.py `stateful`, deploy/generate.py `kv_cache`): gpt's and the transformer's `step` converted to a
stateful OpenVINO IR computes what the decode graph computes, and generating with it gives the loop-owned cache's
tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from xdeploy.core.errors import XDeployError
from xdeploy.deploy.generate import GenerationConfig, Generator
from xdeploy.deploy.registry import open_runner
from xdeploy.export.artifact import load_artifact
from xdeploy.export.onnx_export import export
from xdeploy.models.spec import make_feeds

pytest.importorskip("openvino")
# left padding, ragged rows: what batched generation meets
PROMPTS = [[72, 101, 108, 108, 111, 44, 32], [84, 104], [69, 120, 112, 111]]


SOURCES = [[5, 6, 7, 8, 9, 10], [11, 12], [40, 41, 42, 43]]  # right padding, ragged rows (encoder-decoder)


@pytest.fixture(scope="module")
def stateful_art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export("gpt", preset="tiny", out=tmp_path_factory.mktemp("stateful") / "a", openvino_ir=True)


@pytest.fixture(scope="module")
def stateful_seq2seq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export("transformer", preset="tiny", out=tmp_path_factory.mktemp("stateful-s2s") / "a", openvino_ir=True)


def test_the_stateful_ir_is_recorded_and_checked_at_load(stateful_art: Path, tmp_path: Path) -> None:
    art = load_artifact(stateful_art)
    rec = art.openvino_stateful("decode")
    assert rec is not None and art.openvino_stateful("model") is None
    assert rec["xml"] in art.manifest["files"] and rec["bin"] in art.manifest["files"]
    assert len(rec["variables"]) == 2 * art.config.n_layers
    for field, bad in (("variables", "past.0.key"), ("replaces", "nope"), ("xml", "../x.xml")):
        d = tmp_path / field
        shutil.copytree(stateful_art, d)
        m = json.loads((d / "manifest.json").read_text())
        m["openvino"]["stateful"][field] = bad
        (d / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(XDeployError, match="invalid manifest"):
            load_artifact(d)


def test_the_stateful_ir_converts_to_paged_attention(stateful_art: Path) -> None:
    """Every input of the stateful IR is named as its tensor, so OpenVINO's PagedAttention rewrite (what
    openvino-genai's default backend runs) replaces the step's inputs instead of adding a second position_ids
    beside them: one rank-1 input_ids and position_ids, a key and a value cache per layer, the block table."""
    import openvino as ov
    from openvino._offline_transformations import paged_attention_transformation

    art = load_artifact(stateful_art)
    model = ov.Core().read_model(str(art.path / art.openvino_stateful("decode")["xml"]))
    assert all(p.get_friendly_name() in p.output(0).get_names() for p in model.get_parameters())
    paged_attention_transformation(model, False, False)
    names = [i.get_any_name() for i in model.inputs]
    assert len(names) == len(set(names))
    assert {n: model.input(n).get_partial_shape().rank.get_length() for n in ("input_ids", "position_ids")} == \
        {"input_ids": 1, "position_ids": 1}
    layers = art.config.n_layers
    assert {f"{k}_cache.{i}" for k in ("key", "value") for i in range(layers)} <= set(names)
    assert {"past_lens", "block_indices", "block_indices_begins", "subsequence_begins"} <= set(names)


@pytest.mark.parametrize("which", ["gpt", "transformer"])
def test_the_stateful_runner_computes_the_decode_graph(which: str, request: pytest.FixtureRequest) -> None:
    """Through `infer` the stateful IR takes the decode graph's feeds (a cache with masked slots, a padded row;
    the transformer's memory and source mask besides) and returns its outputs: the logits and the step's K/V,
    read back from the grown state, equal the reference module's `decode` at fp32; the golden probes therefore
    check it where it opens."""
    art = load_artifact(request.getfixturevalue("stateful_art" if which == "gpt" else "stateful_seq2seq"))
    graph = art.graph("decode")
    feeds = make_feeds(graph, {"batch": 3, "step": 2, "cache": 6, "src_seq": 5}, seed=5)
    with open_runner("torch", art, "decode") as ref_runner:  # the reference module, the artifact's weights
        ref = ref_runner.infer(feeds)
    with open_runner("ov", art, "decode", stateful=True, threads=1) as r:
        assert r.graph_format == "stateful"
        got = r.infer(feeds)
    for name in ("logits", "new_kv"):
        assert got[name].shape == ref[name].shape
        np.testing.assert_allclose(got[name], ref[name], atol=1e-4, rtol=1e-3, err_msg=name)


@pytest.mark.parametrize("gc", [GenerationConfig(max_new_tokens=16, eos_token_id=-1),
                                GenerationConfig(max_new_tokens=8, num_beams=3, eos_token_id=-1),
                                GenerationConfig(max_new_tokens=12, do_sample=True, top_k=20, seed=7, eos_token_id=-1)],
                         ids=["greedy", "beams", "sampling"])
def test_the_engine_cache_generates_the_loop_caches_tokens(stateful_art: Path, gc: GenerationConfig) -> None:
    """At fp32 the engine-held cache (the stateful step) and the loop's buffer give the same tokens, padded rows,
    beams (the engine's gather expands each prompt row into its beams, then reorders them) and sampling included;
    beam scores agree to float rounding."""
    with Generator(stateful_art, "ov", threads=1, kv_cache="engine") as eng, \
            Generator(stateful_art, "ov", threads=1, kv_cache="loop") as loop:
        assert eng.engine_cache and not loop.engine_cache
        assert eng.decode.graph_format == "stateful" and len(eng._runners()) == 1
        a, b = eng.generate(PROMPTS, gc), loop.generate(PROMPTS, gc)
    assert a.tokens == b.tokens
    if gc.num_beams > 1:
        np.testing.assert_allclose(a.scores, b.scores, atol=1e-4)


def test_the_step_binds_its_inputs_once_and_computes_what_a_fed_request_computes(stateful_art: Path) -> None:
    """The stateful step copies each call's inputs into buffers bound to its request once (growing them when a
    call outgrows them), instead of binding new tensors every call: the input memory stays put from call to call,
    and every step's logits equal those of a second request fed the same inputs the plain way, across the
    growth of the mask's buffer (3 rows x 7 -> 3 x 30 positions, past its first 64 elements)."""
    with open_runner("ov", stateful_art, "decode", stateful=True, threads=1) as r:
        step, plain = r.cached_step(), r.compiled.create_infer_request()
        names = ("input_ids", "position_ids", "attention_mask", "beam_idx")
        ids = np.array([[0] * (7 - len(p)) + p for p in PROMPTS], np.int64)
        mask = (np.arange(7)[None] >= 7 - np.array([len(p) for p in PROMPTS])[:, None]).astype(np.int64)
        pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
        step.reset()
        plain.reset_state()
        rows = np.array([0, 0, 1], np.int32)  # the first step gathers: row 1 becomes a copy of row 0
        feeds = [ids, pos, mask, np.arange(3, dtype=np.int32)]
        pointers = []
        for i in range(24):
            got = np.array(step(*feeds), copy=True)
            want = plain.infer(dict(zip(names, feeds)))[r._out_ports["logits"]][:, -1]
            np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"call {i}")
            pointers.append([step.req.get_tensor(n).data.ctypes.data for n in names])
            tok = got.argmax(-1)[:, None]
            mask = np.concatenate([mask[rows] if i == 0 else mask, np.ones((3, 1), np.int64)], 1)
            pos = (mask.sum(1, keepdims=True) - 1).astype(np.int64)
            feeds = [tok, pos, mask, rows if i == 0 else np.arange(3, dtype=np.int32)]
    assert mask.size > 64  # the mask's buffer grew (rebound) on the way
    stable = sum(a == b for a, b in zip(pointers, pointers[1:]))
    assert stable >= len(pointers) - 4  # rebound only when a buffer grew


def test_the_encoder_decoders_engine_cache_generates_the_loop_caches_tokens(stateful_seq2seq: Path) -> None:
    """The transformer's engine cache: the encoder once, then the stateful step from BOS with the memory and the
    source mask held by the engine. Sampled at a high temperature (the tiny model's random weights make greedy
    repeat one token), ragged sources: the same tokens as the loop's cache and as the torch reference."""
    gc = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=10.0, seed=7, eos_token_id=-1)
    with Generator(stateful_seq2seq, "ov", threads=1) as eng, \
            Generator(stateful_seq2seq, "ov", threads=1, kv_cache="loop") as loop, \
            Generator(stateful_seq2seq, "torch", threads=1) as ref:
        assert eng.engine_cache and not loop.engine_cache
        assert eng.decode.graph_format == "stateful" and eng.prefill.graph_format != "stateful"
        a = eng.generate(SOURCES, gc)
        assert a.mode == "engine cache"
        assert a.tokens == loop.generate(SOURCES, gc).tokens == ref.generate(SOURCES, gc).tokens
    assert len({t for row in a.tokens for t in row}) > 10  # sampled, not one repeated token


def test_the_cache_is_stored_in_the_compute_precision(stateful_art: Path) -> None:
    """OpenVINO's CPU default is a u8 cache; xdeploy stores it in the compute precision unless told otherwise."""
    art = load_artifact(stateful_art)
    with open_runner("ov", art, "decode", stateful=True, threads=1) as r:
        assert str(r.compiled.get_property("KV_CACHE_PRECISION")) == str(r._ov.Type.f32)
    with open_runner("ov", art, "decode", stateful=True, threads=1, kv_precision="u8") as r:
        assert str(r.compiled.get_property("KV_CACHE_PRECISION")) == str(r._ov.Type.u8)
    with pytest.raises(XDeployError, match="ov kv_precision 'int4'; expected one of: bf16, f16, f32, u8"):
        open_runner("ov", art, "decode", stateful=True, kv_precision="int4")


def test_where_the_cache_lives_is_refused_in_one_line_when_it_cannot(stateful_art: Path, stateful_seq2seq: Path,
                                                                     tiny_export) -> None:  # noqa: ANN001
    # onnxruntime keeps a decoder's cache (deploy/ort_cache.py), not an encoder-decoder's
    with pytest.raises(XDeployError, match="runner 'ort' cannot keep the KV cache in its engine"):
        Generator(stateful_seq2seq, "ort", kv_cache="engine")
    with pytest.raises(XDeployError, match="does not rewrite to keep the KV cache in onnxruntime"):
        open_runner("ort", stateful_seq2seq, "decode", stateful=True)
    plain = tiny_export("gpt")  # no OpenVINO IR: no stateful step
    with pytest.raises(XDeployError, match="runner 'ov' cannot keep the KV cache in its engine"):
        Generator(plain, "ov", kv_cache="engine")
    with pytest.raises(XDeployError, match="carries no stateful OpenVINO IR for graph 'decode'"):
        open_runner("ov", plain, "decode", stateful=True)
    with pytest.raises(XDeployError, match="KV cache 'gpu'"):
        Generator(stateful_art, "ov", kv_cache="gpu")
    with Generator(plain, "ov") as g:  # auto: the loop's cache where the engine cannot hold it
        assert not g.engine_cache
    with Generator(stateful_art, "ov", prefill_graph="model") as g:  # another prefill graph: the loop's cache
        assert not g.engine_cache and len(g._runners()) == 2


# -- the PagedAttention form of the stateful step (deploy/ov_paged.py, Generator kv_cache="paged") --

def test_blocks_share_full_blocks_between_beams_and_copy_a_shared_partial_block_before_writing() -> None:
    """The block allocator alone: two rows of 5 and 3 slots in blocks of 4; row 0 becomes two beams that share its
    blocks; writing one more slot into each copies the shared partly filled block once (the second beam then owns
    the original), and a row that drops out frees its blocks for reuse; out of blocks, the capacity doubles."""
    from xdeploy.deploy.ov_paged import Blocks

    b = Blocks(4)
    b.start(2)
    assert b.extend(np.array([5, 3])) == []
    assert b.tables == [[0, 1], [2]] and b.lens.tolist() == [5, 3] and b.capacity == 4
    b.reorder(np.array([0, 0, 1]))  # row 0 -> beams 0 and 1; row 1 -> 2
    assert b.tables == [[0, 1], [0, 1], [2]] and b.ref[:3].tolist() == [2, 2, 1]
    copies = b.extend(np.array([1, 1, 1]))
    assert copies == [(1, 3)]  # beam 0's partial block 1 copied into free block 3; beam 1 keeps block 1
    assert b.tables == [[0, 3], [0, 1], [2]] and b.ref.tolist() == [2, 1, 1, 1] and b.lens.tolist() == [6, 6, 4]
    b.reorder(np.array([1, 1]))  # beam 0 and row 2 drop out: block 3 and 2 are free again
    assert b.tables == [[0, 1], [0, 1]] and b.ref.tolist() == [2, 2, 0, 0]
    assert b.extend(np.array([3, 3])) == [(1, 2)]  # one copy (block 1 shared, 6 % 4 slots filled) ...
    assert b.tables == [[0, 2, 3], [0, 1, 4]] and b.capacity == 8  # ... and new blocks: 5 needed, 4 existed
    assert b.slots(1, 7, 3)[0].tolist() == [1, 4, 4] and b.slots(1, 7, 3)[1].tolist() == [3, 0, 1]


def test_the_paged_step_computes_the_decode_graph(stateful_art: Path) -> None:
    """The decode graph's call answered by the PagedAttention step: the given cache written into blocks (only its
    real slots: masked ones are not stored), the step's tokens fed, logits and K/V read back. At fp32 they equal
    the reference module's `decode` wherever the verdict says an output means something, a right-padded row and
    a cache spanning two blocks included; so the golden probes check the paged graph where it opens."""
    from xdeploy.deploy.verdict import meaningful

    art = load_artifact(stateful_art)
    graph = art.graph("decode")
    outs = {t.name: t for t in graph.outputs}
    # one token a row at 2 threads: the one-thread steps' compiled model answers (what the probes check there)
    for sizes, threads in (({"batch": 3, "step": 1, "cache": 9}, 2), ({"batch": 3, "step": 2, "cache": 6}, 1),
                           ({"batch": 2, "step": 5, "cache": 40}, 1)):
        feeds = make_feeds(graph, sizes, seed=5)
        assert not feeds["cache_mask"].all()  # padded rows
        assert sizes["step"] == 1 or not feeds["step_mask"].all()
        with open_runner("torch", art, "decode") as ref_runner:
            ref = ref_runner.infer(feeds)
        with open_runner("ov", art, "decode", stateful=True, paged=True, threads=threads) as r:
            assert r.graph_format == "paged" and (r.steps_compiled is not None) == (threads == 2)
            got = r.infer(feeds)
        for name in ("logits", "new_kv"):
            assert got[name].shape == ref[name].shape
            keep = np.broadcast_to(meaningful(graph, outs[name], feeds, ref[name].shape), ref[name].shape)
            np.testing.assert_allclose(got[name][keep], ref[name][keep], atol=1e-4, rtol=1e-3, err_msg=name)
    # the padded row's last step token is padding: its logits mean nothing (the decode graph's contract is a
    # real last token), which the verdict now knows
    assert meaningful(graph, outs["logits"], feeds, ref["logits"].shape).ravel().tolist() == [True, False]


@pytest.mark.parametrize("gc", [GenerationConfig(max_new_tokens=40, eos_token_id=-1),
                                GenerationConfig(max_new_tokens=36, num_beams=3, eos_token_id=-1),
                                GenerationConfig(max_new_tokens=36, do_sample=True, top_k=20, seed=7, eos_token_id=-1)],
                         ids=["greedy", "beams", "sampling"])
def test_the_paged_cache_generates_the_stateful_caches_tokens(stateful_art: Path, gc: GenerationConfig) -> None:
    """At fp32 the PagedAttention cache gives the stateful cache's tokens: ragged left-padded prompts (their
    padding never stored), beams sharing blocks and copying a shared block before writing into it, sampling, and
    sequences that outgrow their first block; beam scores agree to float rounding."""
    with Generator(stateful_art, "ov", threads=1) as paged, \
            Generator(stateful_art, "ov", threads=1, kv_cache="engine") as eng:
        # the default for a decoder on ov: the paged cache, one runner
        assert paged.decode.graph_format == "paged" and len(paged._runners()) == 1
        assert eng.decode.graph_format == "stateful"
        step = paged.decode.cached_step()
        a, b = paged.generate(PROMPTS, gc), eng.generate(PROMPTS, gc)
    assert a.mode == "paged engine cache" and b.mode == "engine cache"
    assert a.tokens == b.tokens
    assert max(len(p) for p in PROMPTS) + gc.max_new_tokens > step.blocks.size  # past the first block
    if gc.num_beams > 1:
        np.testing.assert_allclose(a.scores, b.scores, atol=1e-4)


def test_a_small_decoders_paged_steps_run_on_one_thread(stateful_art: Path) -> None:
    """With more than one thread asked, a decoder whose stateful IR fits in SMALL_STEP_BYTES compiles its
    PagedAttention step twice: prompts on the threads asked, one-token steps on one thread, both requests bound to
    one cache (a steps request that did not read the prompt's blocks would attend to an empty cache and leave its
    tokens). Greedy, beams (shared blocks copied before writing) and a ragged batch give the one-thread runner's
    tokens, generation after generation on the kept step."""
    with Generator(stateful_art, "ov", threads=2) as two, Generator(stateful_art, "ov", threads=1) as one:
        assert two.decode.graph_format == "paged" and two.probes.passed
        assert int(two.decode.steps_compiled.get_property("INFERENCE_NUM_THREADS")) == 1
        assert int(two.decode.compiled.get_property("INFERENCE_NUM_THREADS")) == 2 == two.decode.info().threads
        assert one.decode.steps_compiled is None  # one thread asked: one compiled model
        for gc in (GenerationConfig(max_new_tokens=40, eos_token_id=-1),
                   GenerationConfig(max_new_tokens=36, num_beams=3, eos_token_id=-1)):
            for prompts in ([PROMPTS[0]], PROMPTS, [PROMPTS[1]]):
                assert two.generate(prompts, gc).tokens == one.generate(prompts, gc).tokens


def test_a_generator_keeps_its_engine_step_between_generations(stateful_art: Path) -> None:
    """Generator.cached_step is made once per thread and reset by each generation: a short prompt after a long
    generation gives a fresh Generator's tokens (nothing of the earlier sequence is read), on OpenVINO's paged and
    stateful steps and onnxruntime's; another thread gets a step of its own (a step is not re-entrant)."""
    import threading

    gc = GenerationConfig(max_new_tokens=30, eos_token_id=-1)
    for runner, kv in (("ov", "paged"), ("ov", "engine"), ("ort", "engine")):
        with Generator(stateful_art, runner, threads=1, kv_cache=kv) as g:
            step = g.cached_step()
            g.generate([PROMPTS[0] * 3], gc)
            short = g.generate([PROMPTS[1]], gc).tokens
            assert g.cached_step() is step
            other: list[object] = []
            t = threading.Thread(target=lambda: other.append(g.cached_step()))  # noqa: B023
            t.start()
            t.join()
            assert other and other[0] is not step
        with Generator(stateful_art, runner, threads=1, kv_cache=kv) as fresh:
            assert fresh.generate([PROMPTS[1]], gc).tokens == short, (runner, kv)


def test_an_fp16_artifact_decodes_in_the_engine_with_fp16_weights(stateful_art: Path, tmp_path: Path) -> None:
    """The fp16 artifact converted from the fp32 one carries the stateful step with fp16 weights. Computing in f32
    (`ov`), OpenVINO keeps every FullyConnected's weights in fp16 in the paged step (its weight decompression for a
    language model: a decode step reads half the bytes); the golden probes pass through that step at fp16's
    tolerance (checked as the Generator opens), and the paged and stateful steps give the same tokens."""
    import openvino as ov

    from xdeploy.export.convert import convert_artifact

    fp16 = convert_artifact(stateful_art, tmp_path / "f16", "fp16")
    assert load_artifact(fp16).openvino_stateful("decode") is not None
    gc = GenerationConfig(max_new_tokens=40, eos_token_id=-1)
    with Generator(fp16, "ov", threads=1) as paged, Generator(fp16, "ov", threads=1, kv_cache="engine") as eng:
        assert paged.decode.graph_format == "paged" and eng.decode.graph_format == "stateful"
        assert paged.probes is not None and paged.probes.passed and paged.probes.precision == "fp16"
        assert "decode/logits" in paged.probes.covered
        fcs = [op for op in paged.decode.compiled.get_runtime_model().get_ops()
               if op.get_rt_info()["layerType"].astype(str) == "FullyConnected"]
        assert fcs and all(op.input(1).get_element_type() == ov.Type.f16 for op in fcs)
        a, b = paged.generate(PROMPTS, gc), eng.generate(PROMPTS, gc)
    assert a.mode == "paged engine cache" and a.tokens == b.tokens


def test_the_paged_cache_is_refused_in_one_line_where_it_cannot_run(stateful_art: Path,
                                                                     stateful_seq2seq: Path) -> None:
    with pytest.raises(XDeployError, match="expected stateful=True too"):
        open_runner("ov", stateful_art, "decode", paged=True)
    with pytest.raises(XDeployError, match="expected kv_precision f32, bf16 or f16, not u8"):
        open_runner("ov", stateful_art, "decode", stateful=True, paged=True, kv_precision="u8")
    with pytest.raises(XDeployError, match="is an encoder-decoder"):
        Generator(stateful_seq2seq, "ov", kv_cache="paged")
    with pytest.raises(XDeployError, match="runner 'ort' does not page its cache; expected runner ov"):
        Generator(stateful_art, "ort", kv_cache="paged")
    # the step itself: a mask that un-marks a cached position, or a row with no real token, is refused
    with open_runner("ov", stateful_art, "decode", stateful=True, paged=True, threads=1) as r:
        step, beam = r.cached_step(), np.zeros(1, np.int32)
        step.reset()
        step(np.array([[5, 6, 7]]), np.array([[0, 1, 2]]), np.ones((1, 3), np.int64), beam)
        with pytest.raises(XDeployError, match="expected a mask that only ever adds real positions"):
            step(np.array([[8]]), np.array([[3]]), np.array([[1, 0, 1, 1]]), beam)
        assert step.blocks.lens.tolist() == [3]  # refused before anything was fed
        step.reset()
        with pytest.raises(XDeployError, match=r"row\(s\) \[0\] feed no token"):
            step(np.array([[5, 6]]), np.array([[0, 1]]), np.zeros((1, 2), np.int64), beam)
    # the default falls back to the stateful step where only it can run: an encoder-decoder, a u8 cache
    with Generator(stateful_seq2seq, "ov", threads=1) as s2s, \
            Generator(stateful_art, "ov", threads=1, kv_precision="u8") as u8:
        assert s2s.decode.graph_format == u8.decode.graph_format == "stateful"


def _fc_weight_types(runner) -> set[str]:  # noqa: ANN001
    """The element types of the weights every FullyConnected of an ov runner's compiled model reads."""
    ops = runner.compiled.get_runtime_model().get_ordered_ops()
    return {op.input(1).get_element_type().get_type_name() for op in ops
            if op.get_rt_info()["layerType"].astype(str) == "FullyConnected"}


def test_bf16_weights_keep_f32_arithmetic_on_bf16_stored_weights(stateful_art: Path) -> None:
    """ov option weights="bf16": every FullyConnected of the compiled PagedAttention step reads bf16 weights (the
    decompression marks are honoured: without them OpenVINO folds the Converts and stores f32 again; the default
    keeps f32), the step matches the f32 one at the bf16 tolerance it reports, and greedy generation gives the f32
    tokens on the trained tiny model. Bad uses: one line each."""
    from xdeploy.deploy.metrics import cosine
    from xdeploy.models.spec import DEFAULT_TOLERANCES

    art = load_artifact(stateful_art)
    with pytest.raises(XDeployError, match="ov weights"):
        open_runner("ov", art, weights="fp8")
    with pytest.raises(XDeployError, match=r"expected the f32 variant \(ov or ov:f32\), not ov:bf16"):
        open_runner("ov:bf16", art, weights="bf16")
    cfg = GenerationConfig(max_new_tokens=12)
    f32 = Generator(stateful_art, "ov", threads=1).generate(PROMPTS, cfg).tokens
    # Checked on AVX-512 (Zen 4), AMX (Xeon model 207, natively, 2026-11-30) and the AVX2 class (Zen 3 under QEMU):
    # every class keeps the weights bf16 and gives f32's tokens here (an earlier session's bf16 decompression try on
    # AMX had given wrong tokens; this construction does not).
    feeds = make_feeds(art.graph("decode"), {"batch": 2, "cache": 3, "step": 2}, seed=4)
    with open_runner("ov", art, "decode", stateful=True, paged=True, threads=1) as r:
        assert _fc_weight_types(r) == {"f32"} and r.info().precision == "fp32"
        want = r.infer({k: v.copy() for k, v in feeds.items()})
    with open_runner("ov", art, "decode", stateful=True, paged=True, weights="bf16", threads=1) as r:
        assert _fc_weight_types(r) == {"bf16"} and r.info().precision == "bf16"
        got = r.infer({k: v.copy() for k, v in feeds.items()})
    floor = DEFAULT_TOLERANCES["bf16"].cosine
    for name in want:
        cos = cosine(want[name].astype(np.float64).ravel(), got[name].astype(np.float64).ravel())
        assert floor <= cos < 1.0, (name, cos)  # bf16-rounded weights: close, not identical
    assert Generator(stateful_art, "ov", threads=1, weights="bf16").generate(PROMPTS, cfg).tokens == f32


def test_bf16_prompt_runs_prompts_with_bf16_arithmetic_and_steps_on_bf16_weights(stateful_art: Path) -> None:
    """ov option prompt="bf16" (with weights="bf16", paged): the prompts run on a bf16-hint compile of the bf16
    weights with a bf16 cache, the one-token steps on the f32 compile with an f32 one, the blocks in use converted
    when the sequence moves (deploy/ov_paged.py PagedStep `_move`). The golden probes pass on open (bf16 tolerance;
    their one-token call moves the cache too); after a ragged batch of three, each row's prompt K/V in the steps'
    f32 tensors are exactly the prompt lane's bf16 ones widened, and the greedy tokens are f32's where measured.
    Where the CPU has no bf16 the plugin would compute the prompts in f32 and refuse a bf16 cache: the one f32
    compile runs them too."""
    from xdeploy.core.fingerprint import bf16_native, fingerprint
    from xdeploy.deploy.ov_paged import _to_f32

    art = load_artifact(stateful_art)
    with pytest.raises(XDeployError, match="expected weights='bf16' and paged=True"):
        open_runner("ov", art, "decode", stateful=True, prompt="bf16")
    with pytest.raises(XDeployError, match="ov prompt"):
        open_runner("ov", art, "decode", stateful=True, paged=True, weights="bf16", prompt="f8")
    cfg = GenerationConfig(max_new_tokens=12)
    f32 = Generator(stateful_art, "ov", threads=1).generate(PROMPTS, cfg).tokens
    for threads in (1, 2):  # 2: the tiny decoder's steps on their own one-thread compile (a third model)
        with Generator(stateful_art, "ov", threads=threads, weights="bf16", prompt="bf16") as g:
            assert g.decode.graph_format == "paged" and g.decode.info().precision == "bf16"
            tokens = g.generate(PROMPTS, cfg).tokens
            step = g.cached_step()
            if bf16_native(fingerprint()):  # a bf16 prompt cache beside the steps' f32 one
                assert g.decode.prompt_compiled.get_property("INFERENCE_PRECISION_HINT").to_string() == "bf16"
                assert step._own
                # the prompts' K/V moved exactly: each row's prompt slots, widened from the prompt lane's bf16
                # tensors, are the steps lane's f32 ones (every class with bf16, whatever its kernels round)
                for r, prompt in enumerate(PROMPTS):
                    blocks, offsets = step.blocks.slots(r, 0, len(prompt))
                    for name, a, b in zip(step.caches, step._prompt.views, step._steps.views):
                        want = _to_f32(a[blocks, :, offsets], step._prompt.types[name])
                        assert np.array_equal(want, b[blocks, :, offsets]), (r, name)
            else:  # the one f32 model runs the prompts too
                assert g.decode.prompt_compiled is None and not step._own
            assert step._holder is step._steps  # after the prompt, the steps' tensors hold the sequence
            assert {t.get_type_name() for t in step._steps.types.values()} == {"f32"}
        # greedy tokens: f32's where measured (AMX natively, the AVX2 class under QEMU); on AVX-512 BF16 without
        # AMX (Zen 4/5) the prompt's bf16 kernels differ and were not run with this option: the probes judge it
        if not bf16_native(fingerprint()) or any(f.startswith("amx") for f in fingerprint()["isa"]):
            assert tokens == f32, threads


def test_cli_generate_bf16_weights_and_prompt(stateful_art: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`xdeploy generate --runner ov --bf16-weights --bf16-prompt`: the Generator options weights/prompt="bf16",
    the same greedy tokens as the API; a bf16 prompt without bf16 weights is one line naming what it needs."""
    import json
    import sys

    from xdeploy.cli import main

    out = stateful_art.parent / "g.json"
    assert main(["generate", str(stateful_art), "--runner", "ov", "--prompt-ids", ",".join(map(str, PROMPTS[0])),
                 "--new-tokens", "6", "--bf16-weights", "--bf16-prompt", "--json", str(out)]) == 0
    with Generator(stateful_art, "ov", weights="bf16", prompt="bf16") as g:
        want = g.generate([PROMPTS[0]], GenerationConfig(max_new_tokens=6)).tokens[0]
    assert json.loads(out.read_text())["tokens"] == [list(want)]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        sys.exit(main(["generate", str(stateful_art), "--runner", "ov", "--prompt-ids", "1,2", "--bf16-prompt"]))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "expected weights='bf16' and paged=True" in err and len(err.splitlines()) == 1, err
