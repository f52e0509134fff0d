"""The KV cache kept inside onnxruntime (deploy/ort_cache.py): a decoder's decode graph rewritten at load time to
GroupQueryAttention computes what the decode graph computes, appends to the cache in place, and generating with
it gives the loop-owned cache's tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from xdeploy.core.errors import XDeployError
from xdeploy.core.fingerprint import fingerprint, int8_dot
from xdeploy.deploy.generate import GenerationConfig, Generator
from xdeploy.deploy.ort_cache import (
    INT8_WEIGHTS,
    fused_graph,
    signed_prefill_applies,
    signed_steps_apply,
    signed_weights,
    u8s8_exact,
)
from xdeploy.deploy.registry import open_runner, runner_class
from xdeploy.deploy.sessions import SMALL_STEP_BYTES, one_thread_steps
from xdeploy.export.artifact import load_artifact
from xdeploy.models.spec import make_feeds

PROMPTS = [[72, 101, 108, 108, 111, 44, 32], [84, 104], [69, 120, 112, 111]]  # ragged: left padding


def test_the_rewrite_replaces_each_attention_with_one_fused_node(tiny_export) -> None:  # noqa: ANN001
    import onnx

    art = load_artifact(tiny_export("gpt"))
    model, layers, why = fused_graph(art, "decode")
    assert why == "" and layers == art.config.n_layers
    fused, plain = onnx.ModelProto.FromString(model), onnx.load(str(art.onnx_path("decode")), load_external_data=False)
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("GroupQueryAttention") == layers and "Softmax" not in ops
    assert len(fused.graph.node) < len(plain.graph.node) - 10 * layers  # ~15 small nodes a layer gone
    assert "step_mask" not in {i.name for i in fused.graph.input}
    assert [o.name for o in fused.graph.output] == ["logits"] + [f"present.{i}.{kv}" for i in range(layers)
                                                                 for kv in ("key", "value")]
    assert not fused.graph.initializer or all(t.data_location == onnx.TensorProto.EXTERNAL or t.raw_data is not None
                                              for t in fused.graph.initializer)


@pytest.mark.parametrize("step", [1, 3])
def test_the_rewritten_graph_computes_the_decode_graph(tiny_export, step: int) -> None:  # noqa: ANN001
    """The decode graph's own call (a padded cache, a step's padding) on the rewritten graph equals the plain graph's:
    logits and the step's K/V. Several tokens after a past run row by row (onnxruntime's limit)."""
    art = load_artifact(tiny_export("gpt"))
    feeds = make_feeds(art.graph("decode"), {"batch": 2, "cache": 9, "step": step}, seed=3)
    feeds["cache_mask"][:] = 1
    feeds["cache_mask"][0, :3] = 0  # left padding of row 0's prompt
    feeds["step_mask"][:] = 1
    if step > 1:
        feeds["step_mask"][1, 0] = 0
    with open_runner("ort", art, "decode", stateful=True, threads=1) as fused, \
            open_runner("ort", art, "decode", threads=1) as plain:
        a, b = fused.infer(feeds), plain.infer(feeds)
    np.testing.assert_allclose(a["logits"], b["logits"], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(a["new_kv"], b["new_kv"], atol=1e-5, rtol=1e-5)


def test_the_engine_cache_generates_the_loops_tokens_and_appends_in_place(tiny_export) -> None:  # noqa: ANN001
    art = tiny_export("gpt")
    gc = GenerationConfig(max_new_tokens=70, eos_token_id=-1)  # prompt + 70 > 64 slots: the buffer grows once
    with Generator(art, "ort", threads=1) as eng, Generator(art, "ort", threads=1, kv_cache="loop") as loop:
        assert eng.engine_cache and not loop.engine_cache and len(eng._runners()) == 1
        assert eng.probes is not None and eng.probes.passed and "decode/new_kv" in eng.probes.covered
        a, b = eng.generate(PROMPTS, gc), loop.generate(PROMPTS, gc)
        assert a.mode == "engine cache" and b.mode == "cache" and a.tokens == b.tokens
        beams = GenerationConfig(max_new_tokens=12, num_beams=3, eos_token_id=-1)
        assert eng.generate(PROMPTS, beams).tokens == loop.generate(PROMPTS, beams).tokens
        sampled = GenerationConfig(max_new_tokens=16, do_sample=True, top_k=40, seed=5, eos_token_id=-1)
        assert eng.generate(PROMPTS, sampled).tokens == loop.generate(PROMPTS, sampled).tokens
        # the step itself: onnxruntime writes each new K/V into the bound buffer, slot after slot
        step = eng.decode.cached_step()
        step.reset()
        step(np.array([[5, 6, 7]]), np.array([[0, 1, 2]]), np.ones((1, 3), np.int64), np.zeros(1, np.int32))
        before = step.cache.copy()
        assert np.abs(before[:, :, 0, :, :3]).min() > 0 and not before[:, :, :, :, 3:].any()
        binding, _, _ = step._call(1, 1)
        step(np.array([[8]]), np.array([[3]]), np.ones((1, 4), np.int64), np.zeros(1, np.int32))
        presents = {o.data_ptr() for o in binding.get_outputs()[1:]}
        views = {step.cache[i // 2, i % 2, :1].ctypes.data for i in range(2 * load_artifact(art).config.n_layers)}
        assert presents == views  # the presents alias the cache: nothing copied back
        assert np.array_equal(step.cache[:, :, :, :, :3], before[:, :, :, :, :3])  # earlier slots untouched
        assert np.abs(step.cache[:, :, 0, :, 3]).min() > 0 and not step.cache[:, :, :, :, 4:].any()
        with pytest.raises(XDeployError, match="the engine cache holds 4 slots; the mask says 6"):
            step(np.array([[9]]), np.array([[4]]), np.ones((1, 7), np.int64), np.zeros(1, np.int32))


def test_an_int8_dynamic_artifact_keeps_its_cache_in_onnxruntime(tiny_export) -> None:  # noqa: ANN001
    """int8-dynamic's attention is float: it rewrites the same way. At batch 1 (no padding rows in the dynamic
    activation ranges) the engine cache gives the loop's tokens, whichever weights run: by default the uint8 ones,
    or on a CPU with VNNI and without AMX the weights shifted to int8 for every call (one session); option
    signed_prefill=True also on AMX, for prompts only (a second session); False never (every class modelled by
    its rule, this machine's route checked)."""
    art = tiny_export("gpt", precision="int8-dynamic")
    a = load_artifact(art)
    every_call = signed_steps_apply(a) and u8s8_exact()
    gc = GenerationConfig(max_new_tokens=24, eos_token_id=-1)
    with Generator(art, "ort", threads=1) as eng, Generator(art, "ort", threads=1, kv_cache="loop") as loop, \
            Generator(art, "ort", threads=1, signed_prefill=True) as signed, \
            Generator(art, "ort", threads=1, signed_prefill=False) as uint8:
        assert eng.engine_cache and eng.probes is not None and eng.probes.passed
        assert eng.decode.prefill_session is None and uint8.decode.prefill_session is None  # one session each
        assert eng.decode.signed == every_call and not uint8.decode.signed
        assert signed.engine_cache and signed.decode.signed == signed_prefill_applies(a)
        # a second session for prompts only where the steps stay on the uint8 weights (AMX)
        assert (signed.decode.prefill_session is not None) == (signed_prefill_applies(a) and not every_call)
        for p in PROMPTS:
            want = loop.generate([p], gc).tokens
            assert eng.generate([p], gc).tokens == want == signed.generate([p], gc).tokens \
                == uint8.generate([p], gc).tokens


def _with_external_data(artifact: Path, to: Path) -> Path:
    """A copy of `artifact` whose decode graph keeps its weights in decode.onnx.data, as every graph from 32 MiB
    does (the tiny ones are inline), its manifest's hashes rewritten."""
    import json
    import shutil

    import onnx

    from xdeploy.core.fsutil import atomic_write_json
    from xdeploy.export.artifact import write_manifest_files

    art = shutil.copytree(artifact, to)
    path = art / "decode.onnx"
    onnx.save_model(onnx.load(str(path)), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="decode.onnx.data")
    manifest = json.loads((art / "manifest.json").read_text())
    atomic_write_json(art / "manifest.json", write_manifest_files(art, manifest))
    return art


def test_int8_weights_read_from_disk_give_the_uint8_tokens(tiny_export, tmp_path: Path,  # noqa: ANN001
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """An artifact whose decode graph keeps its weights in external data (as every graph from 32 MiB does): the
    weights and the other external tensors go to a temporary folder of their own, gone once the sessions are
    open. Two threads asked: a small decoder's one-thread steps take the same weights."""
    import tempfile

    art = _with_external_data(tiny_export("gpt", precision="int8-dynamic"), tmp_path / "art")
    a = load_artifact(art)
    gc = GenerationConfig(max_new_tokens=24, eos_token_id=-1)
    tmp = tmp_path / "tmp"  # this test's own temporary folder: other workers' Generators write to theirs
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with Generator(art, "ort", threads=2) as eng, Generator(art, "ort", threads=2, signed_prefill=False) as uint8:
        assert eng.decode.signed == (signed_steps_apply(a) and u8s8_exact()) and not uint8.decode.signed
        assert eng.decode.prefill_session is not None  # the one-thread steps' companion, same weights
        assert not any(tmp.iterdir())  # the int8 weights' folder (where it was made) is gone
        for p in PROMPTS:
            assert eng.generate([p], gc).tokens == uint8.generate([p], gc).tokens


def test_int8_weights_that_cannot_be_written_leave_the_uint8_route(tiny_export, tmp_path: Path) -> None:  # noqa: ANN001
    """Where the temporary folder cannot take the shifted weights (here: a child process whose files may not grow
    past 1 KiB), the runner says so in one line and runs the uint8 weights; the tokens are the same. Only where
    the route applies (VNNI without AMX); elsewhere the child checks that nothing was tried."""
    import subprocess
    import sys

    art = _with_external_data(tiny_export("gpt", precision="int8-dynamic"), tmp_path / "art")
    child = f"""
import resource, signal
from xdeploy.deploy.generate import GenerationConfig, Generator
gc = GenerationConfig(max_new_tokens=12, eos_token_id=-1)
with Generator({str(art)!r}, "ort", threads=1, signed_prefill=False) as g:
    want = g.generate([[72, 101, 108]], gc).tokens
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
with Generator({str(art)!r}, "ort", threads=1) as g:
    assert not g.decode.signed
    assert g.generate([[72, 101, 108]], gc).tokens == want
"""
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    noted = "the int8 weights cannot be written to a temporary folder" in out.stderr
    assert noted == (signed_steps_apply(load_artifact(art)) and u8s8_exact()), out.stderr[-2000:]


def test_a_small_decoders_steps_run_on_one_thread(tiny_export) -> None:  # noqa: ANN001
    """With more than one thread asked, a decoder whose step graph and weights fit in SMALL_STEP_BYTES runs its
    one-token steps on a session of one thread and its prompts on one with the threads asked; the tokens are the
    one-thread runner's and the loop's. The rule itself: sizes and thread counts either side of it."""
    for precision in ("fp32", "int8-dynamic"):
        art = tiny_export("gpt", precision=precision)
        gc = GenerationConfig(max_new_tokens=24, eos_token_id=-1)
        with Generator(art, "ort", threads=2) as two, Generator(art, "ort", threads=1) as one, \
                Generator(art, "ort", threads=2, kv_cache="loop") as loop:
            steps, prompts = two.decode.session, two.decode.prefill_session
            assert prompts is not None and steps is not prompts and two.probes.passed
            assert steps.get_session_options().intra_op_num_threads == 1
            assert prompts.get_session_options().intra_op_num_threads == 2 == two.decode.info().threads
            assert one.decode.prefill_session is None  # one thread asked: one session
            for p in PROMPTS:
                assert two.generate([p], gc).tokens == one.generate([p], gc).tokens == loop.generate([p], gc).tokens
    assert one_thread_steps(2, SMALL_STEP_BYTES) and one_thread_steps(0, 1 << 20, cpus=2)
    assert not one_thread_steps(1, 1 << 20) and not one_thread_steps(0, 1 << 20, cpus=1)
    assert not one_thread_steps(2, SMALL_STEP_BYTES + 1) and not one_thread_steps(16, 500 << 20)


def test_the_int8_weight_prefill_is_exact_and_only_where_the_cpu_adds_in_int32(tiny_export,  # noqa: ANN001
                                                                                 tmp_path: Path) -> None:
    """uint8 weights w with zero point zp become int8 w - 128 and zp - 128: w - zp is unchanged, so every integer
    product is too. Only on the classes whose u8*s8 dot product accumulates in int32 (VNNI, AMX); on AVX2 8-bit
    int8 weights could saturate its int16 pairs (modeled: every class, whatever this machine is)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnx.external_data_helper import load_external_data_for_model

    art = load_artifact(tiny_export("gpt", precision="int8-dynamic"))
    path = art.onnx_path("decode")
    plain = onnx.load(str(path))
    # the tensors stored as external data, as a graph from 32 MiB has them: shifted into a file of their own
    onnx.save_model(onnx.load(str(path)), str(tmp_path / "decode.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="decode.onnx.data")
    signed = onnx.load(str(tmp_path / "decode.onnx"), load_external_data=False)
    out = tmp_path / "out"
    out.mkdir()
    assert signed_weights(signed, tmp_path, out) == sum(n.op_type == "MatMulInteger" for n in plain.graph.node) > 0
    assert (out / INT8_WEIGHTS).stat().st_size >= (tmp_path / "decode.onnx.data").stat().st_size  # all copied
    load_external_data_for_model(signed, str(out))
    before = {t.name: numpy_helper.to_array(t) for t in plain.graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in signed.graph.initializer}
    for n in plain.graph.node:
        if n.op_type == "MatMulInteger":
            w, zp = n.input[1], n.input[3]
            assert before[w].dtype == np.uint8 and after[w].dtype == np.int8 and after[zp].dtype == np.int8
            np.testing.assert_array_equal(before[w].astype(np.int16) - before[zp].astype(np.int16),
                                          after[w].astype(np.int16) - after[zp].astype(np.int16))
        else:  # every other tensor as it was
            for t in n.input:
                if t in before:
                    np.testing.assert_array_equal(before[t], after[t])
    # external data is untrusted input: a range past its file, or a file outside the folder, is one clear line
    for key, value in (("length", str(10**9)), ("location", "../decode.onnx.data")):
        bad = onnx.load(str(tmp_path / "decode.onnx"), load_external_data=False)
        t = next(t for t in bad.graph.initializer if t.data_location == TensorProto.EXTERNAL)
        next(e for e in t.external_data if e.key == key).value = value
        with pytest.raises(XDeployError, match=f"initializer '{t.name}': external data .* must name a file in"):
            signed_weights(bad, tmp_path, out)
    # an initializer two MatMuls share is shifted once, so each MatMul's w - zp still holds

    w = np.array([[0, 255], [128, 7]], np.uint8)
    zp = np.array([128, 3], np.uint8)
    nodes = [helper.make_node("MatMulInteger", [x, "w", "", "zp"], [f"y{x}"]) for x in ("a", "b")]
    shared = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(x, TensorProto.UINT8, [1, 2]) for x in ("a", "b")],
        [helper.make_tensor_value_info(f"y{x}", TensorProto.INT32, [1, 2]) for x in ("a", "b")],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(zp, "zp")]))
    assert signed_weights(shared, tmp_path, out) == 2
    got = {t.name: numpy_helper.to_array(t).astype(np.int16) for t in shared.graph.initializer}
    np.testing.assert_array_equal(got["w"] - got["zp"], w.astype(np.int16) - zp.astype(np.int16))
    isa = {"amx": ["avx2", "avx512f", "avx512_vnni", "amx_int8"], "vnni": ["avx2", "avx512f", "avx512_vnni"],
           "avx2": ["avx2", "fma"]}
    assert [signed_prefill_applies(art, {"isa": v}) for v in isa.values()] == [True, True, False]
    # the steps too only where one token is faster on it: VNNI without AMX (AMX's tiles were slower at one row)
    assert [signed_steps_apply(art, {"isa": v}) for v in isa.values()] == [False, True, False]
    assert not signed_prefill_applies(load_artifact(tiny_export("gpt")), {"isa": isa["amx"]})  # fp32: no int8
    # and onnxruntime's kernel here agrees with the flags: all-ones activations against weights of 127 overflow
    # every int16 pair, so a saturating kernel (AVX2) gives about half; this fails on a class where it disagrees
    assert u8s8_exact() == (int8_dot(fingerprint()) in ("vnni", "amx"))


def test_graphs_that_do_not_rewrite_keep_the_loops_cache(tiny_export, tmp_path: Path) -> None:  # noqa: ANN001
    from xdeploy.export.onnx_export import export

    s2s = load_artifact(tiny_export("transformer"))
    assert not runner_class("ort").keeps_cache(s2s, "decode")
    assert "not a decoder's decode graph" in fused_graph(s2s, "decode")[2]
    odd = load_artifact(export("gpt", preset="tiny-random", out=tmp_path / "hs12",
                                    config_overrides={"d_model": 48}))
    assert "head size 12 is not a multiple of 8" in fused_graph(odd, "decode")[2]
    with Generator(odd, "ort", threads=1) as g:  # auto: the loop's cache where onnxruntime cannot keep it
        assert not g.engine_cache
    with pytest.raises(XDeployError, match="does not rewrite to keep the KV cache in onnxruntime .*head size 12"):
        open_runner("ort", odd, "decode", stateful=True)
    with pytest.raises(XDeployError, match="runner 'ort' cannot keep the KV cache in its engine"):
        Generator(odd, "ort", kv_cache="engine")
    gpt = tiny_export("gpt")
    with Generator(gpt, "ort", threads=1, prefill_graph="model") as g:  # another prefill graph: the loop's cache
        assert not g.engine_cache
    assert not runner_class("ort-cuda").fuses_cache  # measured on the CPU execution provider only


def test_cli_signed_prefill_gives_the_same_tokens_and_says_where_it_is_not_used(tiny_export, tmp_path: Path,
                                                                                 capsys) -> None:  # noqa: ANN001
    import json

    from xdeploy.cli import main
    from xdeploy.core.fingerprint import fingerprint, int8_dot

    int8 = tiny_export("gpt", precision="int8-dynamic")
    args = ["--runner", "ort", "--prompt-ids", "72,101,108,108,111", "--new-tokens", "8", "--ignore-eos"]
    assert main(["generate", str(int8), *args, "--json", str(tmp_path / "a.json")]) == 0
    assert main(["generate", str(int8), *args, "--signed-prefill", "--json", str(tmp_path / "b.json")]) == 0
    assert main(["generate", str(int8), *args, "--no-signed-prefill", "--json", str(tmp_path / "c.json")]) == 0
    a, b, c = (json.loads((tmp_path / n).read_text())["tokens"] for n in ("a.json", "b.json", "c.json"))
    assert a == b == c
    used = int8_dot(fingerprint()) in ("vnni", "amx")
    assert ("--signed-prefill is not used here" in capsys.readouterr().err) != used
    assert main(["generate", str(tiny_export("gpt")), *args, "--signed-prefill"]) == 0  # fp32: nothing to shift
    assert "--signed-prefill is not used here: it needs runner ort" in capsys.readouterr().err
