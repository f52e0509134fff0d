"""Every registered runner that runs the artifact's graph (ort, ov, ov:bf16, ...: deploy/registry.specs, never a
list of names; tests/runners.py) runs every exported tiny model (every graph, every export precision) and matches
the torch fp32 reference; runner options, info(), zero-copy binding, and clean errors for the GPU-only runners here."""

from __future__ import annotations

import numpy as np
import pytest
from families import n_graphs, names
from runners import (
    check_bind_reads_current_inputs,
    check_bind_with_pruned_outputs,
    check_outputs_option,
    params,
    reference_failures,
    require,
)
from runners import close as _close

from xdeploy.core.errors import XDeployError
from xdeploy.deploy.registry import RUNNERS, compute_precision, gaps, needs_gpu, open_runner, runner_class, specs
from xdeploy.export.artifact import load_artifact
from xdeploy.export.precision import EXPORT_PRECISIONS
from xdeploy.models.spec import DEFAULT_TOLERANCES, make_feeds

MODELS = names()  # every registered family
SIZES = {"batch": 2, "seq": 5, "src_seq": 4, "cache": 3, "step": 2}  # step: gpt decode takes 2 new tokens


@pytest.fixture(scope="module")
def artifacts(tiny_export):
    """(model, precision) -> artifact, exported lazily once per session (conftest.py; shared read-only)."""
    cache: dict[tuple[str, str], object] = {}

    def get(model: str, precision: str):
        if (model, precision) not in cache:
            cache[model, precision] = load_artifact(tiny_export(model, precision=precision))
        return cache[model, precision]

    return get


@pytest.fixture(scope="module")
def reference(artifacts):
    """(model, graph) -> (feeds, torch fp32 outputs), from the fp32 artifact's reference weights."""
    cache: dict[tuple[str, str], tuple] = {}

    def get(model: str, graph: str):
        if (model, graph) not in cache:
            art = artifacts(model, "fp32")
            feeds = make_feeds(art.graph(graph), SIZES, seed=7)
            with open_runner("torch", art, graph) as t:
                cache[model, graph] = feeds, t.infer(feeds)
        return cache[model, graph]

    return get


# Every model x every export precision. The encoder-decoder Transformer's reduced-precision exports (3 graphs,
# fp16 automatic-mixed-precision search) cost ~30 s each on 2 cores, so those two run with `-m slow`; its fp32
# graphs and every precision of bert, gpt (KV-cache decode graph) and vit run by default.
MATRIX = [pytest.param(m, p, marks=[pytest.mark.slow] if n_graphs(m) >= 3 and p != "fp32" else [])
          for m in MODELS for p in EXPORT_PRECISIONS]


@pytest.mark.parametrize("model,precision", MATRIX)
def test_cpu_runners_match_torch_fp32(artifacts, reference, model, precision):
    """Every CPU spec that runs the graph; the GPU specs have their own gpu-marked check below (the GPU check,
    `make gpu-check`, knows which export precisions each GPU runner takes). A spec that cannot open here (ov
    without openvino) is left out by what it lacks; at least one runs."""
    art = artifacts(model, precision)
    here = [s for s in specs(runs_graph=True) if not needs_gpu(s) and not gaps(s)]
    assert here, "no CPU runner of the graph can open here"
    failures = [f for spec in here for f in reference_failures(spec, art, lambda g: reference(model, g))]
    assert not failures, "\n".join(failures)


def test_torch_bf16_autocast_matches_fp32(artifacts, reference):
    art = artifacts("bert", "fp32")
    feeds, ref = reference("bert", "model")
    with open_runner("torch:bf16", art) as r:
        got = r.infer(feeds)
        assert r.info().precision == "bf16"
    for name in ref:
        ok, why = _close(ref[name], got[name], DEFAULT_TOLERANCES["bf16"], cosine_only=True)
        assert ok, why


@pytest.mark.parametrize("spec,precision,device", [("torch", "fp32", "cpu"), ("ort", "fp32", "cpu"),
                                                   ("ov", "fp32", "cpu ("), ("ov:f32", "fp32", "cpu ("),
                                                   ("ov:bf16", "bf16", "cpu (")])
def test_info_reports_device_precision_threads_versions(artifacts, spec, precision, device):
    """The precision reported is the one computed: a bf16 hint runs (and is reported as) f32 on a CPU without
    native bf16 (AVX2-only x86, core/fingerprint.bf16_native)."""
    from xdeploy.core.fingerprint import bf16_native, fingerprint

    if spec == "ov:bf16" and not bf16_native(fingerprint()):
        precision = "fp32"
    art = artifacts("vit", "fp32")
    with open_runner(spec, art, threads=1) as r:
        info = r.info()
    assert info.runner == spec and info.device.startswith(device) and info.precision == precision
    assert info.threads == 1
    assert info.versions and all(isinstance(v, str) and v[0].isdigit() for v in info.versions.values())


def test_ov_options_cache_dir_and_hints(artifacts, tmp_path):
    art = artifacts("bert", "fp32")
    feeds = make_feeds(art.graph(), SIZES, seed=1)
    cache = tmp_path / "ovcache"
    with open_runner("ov", art, hint="throughput", cache_dir=cache) as r:
        first = r.infer(feeds)
        assert str(r.compiled.get_property("PERFORMANCE_HINT")).upper().endswith("THROUGHPUT")
    blobs = list(cache.glob("*.blob"))
    assert blobs, "OpenVINO wrote no compiled-model blob into cache_dir"
    with open_runner("ov", art, cache_dir=cache) as r:  # loaded from the blob: same results
        np.testing.assert_array_equal(r.infer(feeds)["pooler_output"], first["pooler_output"])
    with pytest.raises(XDeployError, match="unknown OpenVINO performance hint 'fast'"):
        open_runner("ov", art, hint="fast")
    with pytest.raises(XDeployError, match="unknown ov option"):
        open_runner("ov", art, precision="bf16")


@pytest.mark.parametrize("spec", params())
def test_outputs_option_returns_only_the_named_outputs(artifacts, reference, spec):
    require(spec)
    feeds, ref = reference("bert", "model")
    check_outputs_option(spec, artifacts("bert", "fp32"), feeds, ref)


@pytest.mark.parametrize("spec", params())
def test_infer_outputs_belong_to_the_caller(artifacts, spec):
    """infer() hands back arrays the next call does not touch: a runner that reads outputs as views of its
    request's memory (OpenVINO's share_outputs, kept for speed) must copy them out before returning."""
    require(spec)
    art = artifacts("gpt", "fp32")
    with open_runner(spec, art, "model") as r:
        first = r.infer(make_feeds(art.graph("model"), SIZES, seed=1))
        kept = {k: v.copy() for k, v in first.items()}
        second = r.infer(make_feeds(art.graph("model"), SIZES, seed=2))  # same shapes: the same request memory
        assert any(not np.array_equal(second[k], kept[k]) for k in kept)  # the inputs made a difference
        for k in kept:
            np.testing.assert_array_equal(first[k], kept[k], err_msg=f"{spec}: {k} changed by the next call")


def test_ov_prepare_and_bind_are_zero_copy(artifacts):
    art = artifacts("gpt", "fp32")
    g = art.graph("decode")
    feeds = make_feeds(g, {"batch": 2, "cache": 6, "step": 1}, seed=3)
    with open_runner("ov", art, "decode") as r:
        want = r.infer(feeds)
        out = {n: np.full_like(v, np.nan) for n, v in want.items()}
        call = r.bind(feeds, out)
        call()
        for n in want:
            np.testing.assert_array_equal(out[n], want[n])
        feeds["input_ids"][:] = (feeds["input_ids"] + 1) % g.inputs[0].high  # in place: the bound call must see it
        feeds["cache.0.value"] *= 0.5
        call()
        want2 = r.infer(feeds)  # infer() uses its own request; it must not re-point the bound one
        assert not np.allclose(want2["logits"], want["logits"])
        call()
        for n in want:
            np.testing.assert_array_equal(out[n], want2[n])
        prepared = r.prepare(feeds)
        np.testing.assert_array_equal(np.asarray(prepared()[0]), want2["logits"])
        with pytest.raises(XDeployError, match="bound output 'logits' must be .* shape \\(2, 1, 512\\)"):
            r.bind(feeds, {"logits": np.zeros((2, 2, 512), np.float32)})
        with pytest.raises(XDeployError, match="must be a C-contiguous"):
            r.bind(feeds | {"cache.0.key": np.asfortranarray(feeds["cache.0.key"])}, {})
        with pytest.raises(XDeployError, match="unknown output"):
            r.bind(feeds, {"hidden": np.zeros(1, np.float32)})


@pytest.mark.parametrize("spec", params(variants=False))
def test_bind_with_pruned_outputs_checks_the_requested_outputs(artifacts, spec):
    """(OpenVINO raised a bare KeyError from its output ports for the output it does not compute.)"""
    require(spec)
    check_bind_with_pruned_outputs(spec, artifacts("bert", "fp32"))


@pytest.mark.parametrize("spec", params(variants=False))
def test_bind_reads_the_inputs_current_contents_every_call(artifacts, spec):
    """(ort-cuda bound the decode step's host inputs once: onnxruntime copies them to the GPU at bind time, so every
    step reread the first one's token and cache; caught on an NVIDIA H200, 1 of 16 greedy tokens agreeing.)"""
    require(spec)
    check_bind_reads_current_inputs(spec, artifacts("gpt", "fp32"), "decode", SIZES)


@pytest.mark.gpu
def test_cuda_graphs_replay_the_bound_calls_current_inputs(artifacts):
    """ort-cuda's decode graph runs its bound calls as CUDA graphs by default: onnxruntime runs the first plainly,
    captures the second and replays the third on the captured device addresses; each must still read the host
    inputs' current contents (mirrored into fixed device buffers: deploy/ort_gpu_runner.py CudaGraphs) and write
    the host outputs. cuda_graph=False binds without them, with the same results."""
    require("ort-cuda")
    art = artifacts("gpt", "fp32")
    r = check_bind_reads_current_inputs("ort-cuda", art, "decode", SIZES)
    assert r.graphs is not None and len(r.graphs.ids) == 1, "CUDA graphs were turned off (see the note on stderr)"
    assert check_bind_reads_current_inputs("ort-cuda", art, "decode", SIZES, cuda_graph=False).graphs is None
    with open_runner("ort-cuda", art, "model") as full:  # not the loop's step graph: off unless asked
        assert full.graphs is None


class _CopyAtBindSession:
    """A CPU onnxruntime session whose IO binding copies a host input when it is bound, as onnxruntime does for an
    input a GPU provider reads (IOBinding::BindInput -> CopyOneInputAcrossDevices): a simulation of that copy on
    the CPU provider, not the CUDA provider."""

    def __init__(self, session):
        self._session = session

    def __getattr__(self, name):
        return getattr(self._session, name)

    def io_binding(self):
        inner = self._session.io_binding()

        class Binding:
            def __getattr__(self, name):
                return getattr(inner, name)

            def bind_cpu_input(self, name, a):
                self.copies = getattr(self, "copies", []) + [a.copy()]  # kept alive, as the device copy is
                inner.bind_cpu_input(name, self.copies[-1])

        return Binding()  # run_with_iobinding reads the wrapped binding through __getattr__


@pytest.mark.parametrize("in_place", [True, False])
def test_ort_bind_on_a_provider_that_copies_at_bind_time_binds_again_every_call(artifacts, in_place, monkeypatch):
    """What OrtRunner.binds_in_place decides, on the CPU with the GPU provider's copy at bind time simulated: binding
    once (the CPU provider's zero-copy path) keeps the first request; binding again every call (what ort-cuda and
    ort-trt now do) reads the current one."""
    from xdeploy.deploy.ort_gpu_runner import OrtCudaRunner
    from xdeploy.deploy.ort_runner import OrtRunner

    assert OrtRunner.binds_in_place and not OrtCudaRunner.binds_in_place
    art = artifacts("gpt", "fp32")
    monkeypatch.setattr(OrtRunner, "binds_in_place", in_place)
    first, second = (make_feeds(art.graph("decode"), SIZES, seed=s) for s in (1, 2))
    with open_runner("ort", art, "decode", threads=1) as r:
        want = r.infer(second)["logits"]
        r.session = _CopyAtBindSession(r.session)
        inputs = {k: v.copy() for k, v in first.items()}
        logits = np.zeros_like(want)
        call = r.bind(inputs, {"logits": logits})
        call()
        for k, v in second.items():
            np.copyto(inputs[k], v)
        call()
    assert np.allclose(logits, want, rtol=1e-5, atol=1e-5) is not in_place


def test_ov_validates_feeds_like_every_runner(artifacts):
    art = artifacts("bert", "fp32")
    good = make_feeds(art.graph(), {"batch": 1, "seq": 4})
    with open_runner("ov", art) as r:
        with pytest.raises(XDeployError, match="dtype int32; expected int64"):
            r.infer(good | {"input_ids": good["input_ids"].astype(np.int32)})
        with pytest.raises(XDeployError, match="axis 'seq' is 129"):
            r.infer({k: np.zeros((1, 129), np.int64) for k in good})


def test_ov_close_releases_every_threads_infer_request(artifacts):
    """One OpenVINO infer request per thread lives in thread-local slots; close drops them all (it used to pop
    an attribute that was never set and leave the requests alive)."""
    import gc
    import threading
    import weakref

    art = artifacts("bert", "fp32")
    feeds = make_feeds(art.graph(), {"batch": 1, "seq": 4})
    r = open_runner("ov", art)
    r.infer(feeds)
    t = threading.Thread(target=r.infer, args=(feeds,))
    t.start()
    t.join()
    slots = weakref.ref(r._local)  # the thread-local object holding every thread's request
    assert r._local.request is not None
    r.close()
    gc.collect()
    assert slots() is None and getattr(r._local, "request", None) is None and "compiled" not in r.__dict__


@pytest.mark.parametrize("spec,msg", [
    ("onnx", "unknown runner 'onnx'; expected one of: ort, ort-cuda, ort-trt, ov, torch, trt"),
    ("ov:fp16", "runner 'ov' has no variant 'fp16'; expected one of: '', 'f32', 'bf16'"),
    ("ort:fp16", "runner 'ort' has no variant 'fp16'"),
    ("torch:int8", "runner 'torch' has no variant 'int8'"),
    ("trt", "runner 'trt' needs an NVIDIA GPU with TensorRT: the tensorrt Python package is not installed"),
    ("trt:fp16", "runner 'trt' needs an NVIDIA GPU with TensorRT"),
    ("ort-cuda", "runner 'ort-cuda' needs onnxruntime-gpu with CUDAExecutionProvider"),
    ("ort-trt:fp16", "runner 'ort-trt' needs onnxruntime-gpu with TensorrtExecutionProvider"),
    ("ort-trt:int8", "runner 'ort-trt' has no variant 'int8'"),
    ("torch:fp16", "runner 'torch:fp16' runs on CUDA only; no CUDA device"),
])
def test_bad_specs_and_missing_gpu_give_one_line_errors(artifacts, spec, msg):
    try:
        opens = not gaps(spec)
    except XDeployError:  # an unknown runner or variant: the error under test
        opens = False
    if opens:
        pytest.skip(f"{spec} can open here: its missing-GPU error cannot be seen")
    with pytest.raises(XDeployError) as e:
        open_runner(spec, artifacts("bert", "fp32"))
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_every_registered_runner_imports_without_its_backend():
    """Optional backends (tensorrt, onnxruntime-gpu) are imported only when a runner is opened: not to read its
    capabilities, nor to ask what this machine lacks to open it."""
    import sys

    for name in RUNNERS:
        assert runner_class(name).name == name
    for spec in specs():
        assert all(isinstance(g, str) and g and "\n" not in g for g in gaps(spec))
        assert compute_precision(spec) in (None, *DEFAULT_TOLERANCES)
    assert "tensorrt" not in sys.modules


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [s for s in specs() if needs_gpu(s)])
def test_gpu_runners_match_ort_cpu(artifacts, reference, spec):
    require(spec)
    art = artifacts("bert", "fp32")
    feeds, ref = reference("bert", "model")
    with open_runner(spec, art) as r:
        got = r.infer(feeds)
        r.prepare(feeds)()
    tol = DEFAULT_TOLERANCES[compute_precision(spec) or "fp32"]
    for name in ref:
        ok, why = _close(ref[name], got[name], tol, cosine_only=compute_precision(spec) is not None)
        assert ok, why


def test_runner_compare_benchmark_runs_and_reports(tmp_path, capsys):
    """Smoke run of the comparison benchmark on the tiny preset (structure only: timings are not asserted)."""
    import json

    from xdeploy.studies import runner_compare

    out = tmp_path / "rc.json"
    assert runner_compare.main(["--preset", "tiny", "--seq", "16", "--precisions", "fp32", "--rounds", "1",
                                "--per-round", "1", "--warmup", "0", "--workdir", str(tmp_path / "w"),
                                "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    labels = [r["label"] for r in report["results"]]
    assert labels == ["torch", "ort", "ov", "ov:bf16"]
    for r in report["results"]:
        assert r["n"] == 1 and r["p50"] > 0 and r["cosine_vs_baseline"] > 0.99
    # every speed-up is torch's p50 over the candidate's own p50 (torch's own is therefore exactly 1)
    torch_p50 = report["results"][0]["p50"]
    for r in report["results"]:
        assert r["speedup_vs_baseline"] == pytest.approx(torch_p50 / r["p50"], rel=1e-12)
    assert report["results"][0]["speedup_vs_baseline"] == 1.0
    assert report["targets"]["ort"]["measured"] == report["results"][1]["speedup_vs_baseline"]
    assert report["machine"]["fingerprint"]["cpu_model"] and len(report["machine"]["load_average"]) == 3
    assert set(report["targets"]) == {"ort", "ov:bf16"} and "x torch" in capsys.readouterr().out
    assert runner_compare.main(["--preset", "tiny", "--rounds", "0", "--workdir", str(tmp_path / "w")]) == 2


def test_runner_compare_runners_option_sets_candidates_and_baseline(tmp_path, capsys):
    """--runners: the first candidate is the baseline of every ratio and cosine; the torch-eager targets are
    not measured against another baseline; a malformed list is one clear error."""
    from xdeploy.studies import runner_compare

    r = runner_compare.compare("bert", "tiny", seq=16, precisions=("fp32",), workdir=tmp_path / "w", rounds=1,
                               per_round=1, warmup=0, runners="ort,torch,ort@fp16")
    assert [x["label"] for x in r["results"]] == ["ort", "torch", "ort@fp16"] and r["baseline"] == "ort"
    assert [x["artifact_precision"] for x in r["results"]] == ["fp32", "fp32", "fp16"]
    assert r["results"][0]["speedup_vs_baseline"] == 1.0
    assert r["results"][1]["speedup_vs_baseline"] == pytest.approx(r["results"][0]["p50"] / r["results"][1]["p50"])
    assert all(x["cosine_vs_baseline"] > 0.99 for x in r["results"])
    assert all(t["measured"] is None for t in r["targets"].values())
    assert "x ort" in runner_compare.render(r)
    # a candidate that cannot open here is named with why, and the others still compare
    r = runner_compare.compare("bert", "tiny", seq=16, precisions=("fp32",), workdir=tmp_path / "w", rounds=1,
                               per_round=1, warmup=0, runners="ort-cuda,ort")
    assert [x["label"] for x in r["results"]] == ["ort"] and r["baseline"] == "ort"
    assert "onnxruntime" in r["skipped"]["ort-cuda"] and "not run: ort-cuda: " in runner_compare.render(r)
    for bad in ("ort,ort", "ort@fp64", ","):
        with pytest.raises(XDeployError, match="--runners"):
            runner_compare.compare("bert", "tiny", workdir=tmp_path / "w", runners=bad)
