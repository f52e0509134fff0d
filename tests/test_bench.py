"""Benchmark harness, memory probe, fingerprint, records and the bench/roofline/scale commands (tiny runs)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from xdeploy.bench.latency import LatencyStats, measure, summarize
from xdeploy.core.errors import XDeployError


def test_summarize_percentile_math():
    s = summarize([float(x) for x in range(1, 101)])  # 1..100 seconds
    assert s.n == 100 and s.min == 1.0 and s.max == 100.0 and s.total_s == 5050.0
    assert s.mean == pytest.approx(50.5) and s.std == pytest.approx(np.std(np.arange(1, 101)))
    assert s.p50 == pytest.approx(50.5) and s.p90 == pytest.approx(90.1) and s.p99 == pytest.approx(99.01)
    assert s.min <= s.p50 <= s.p90 <= s.p99 <= s.max
    with pytest.raises(XDeployError):
        summarize([])
    with pytest.raises(XDeployError):
        summarize([1.0, math.nan])


def test_measure_counts_warmup_and_bounds():
    calls = itertools.count()
    st = measure(lambda: next(calls), warmup=4, min_iters=5, max_iters=7, max_seconds=10.0)
    assert isinstance(st, LatencyStats) and st.n == 7 and next(calls) == 4 + 7  # max_iters bounds a fast call
    # a slow call stops on the time budget, but never before min_iters
    import time
    st = measure(lambda: time.sleep(0.01), warmup=0, min_iters=3, max_iters=1000, max_seconds=0.05)
    assert 3 <= st.n < 20 and st.min >= 0.009
    with pytest.raises(XDeployError):
        measure(lambda: None, min_iters=5, max_iters=2)


def test_measure_sees_a_known_distribution():
    # 1 call in 10 sleeps 20 ms, the rest ~0: the p50 must be tiny and the p99 must see the slow tail.
    import time
    i = itertools.count()
    st = measure(lambda: time.sleep(0.02) if next(i) % 10 == 9 else None, warmup=0, min_iters=50,
                 max_iters=50, max_seconds=10.0)
    assert st.n == 50 and st.p50 < 0.005 and st.p99 >= 0.019 and st.max >= 0.019
    assert st.mean == pytest.approx(st.total_s / st.n)


def test_a_peak_is_a_time_reached_twice():
    """roofline's peak time is the second-fastest call: one call that comes out too fast (a clock step, a read
    peak twice the machine's) is not taken as the peak; a time every call reaches is."""
    import time

    from xdeploy.bench import roofline

    i = itertools.count()
    # the second call (after the warm-up) returns at once, every other sleeps 5 ms
    t = roofline._best_time(lambda: None if next(i) == 2 else time.sleep(0.005), budget=0.05)
    assert t >= 0.0045
    assert roofline._best_time(lambda: time.sleep(0.005), budget=0.03) == pytest.approx(0.005, abs=0.004)


# ---------------------------------------------------------------- memory, fingerprint, records ----

def test_isolated_memory_sees_a_bigger_allocation():
    from xdeploy.bench.memory import allocate, run_isolated

    small, _, m_small = run_isolated(allocate, 8 << 20)
    big, phases, m_big = run_isolated(allocate, 160 << 20)
    assert big > small and set(phases) >= {"start", "imported", "loaded", "run", "end"}
    # the run phase touched ~152 MiB more; baseline interpreter noise is a few MiB
    assert m_big.activations_bytes - m_small.activations_bytes > 120 * 2**20
    assert m_big.peak_rss > m_small.peak_rss and m_big.device_bytes is None
    # freed before the mark: still seen by the high-water mark, not by the phase's end RSS
    _, phases, m_freed = run_isolated(allocate, 160 << 20, False)
    assert m_freed.activations_bytes > 120 * 2**20 and phases["run"]["rss"] < phases["run"]["hwm"] - 100 * 2**20


def test_isolated_child_errors_are_reported():
    from xdeploy.bench.memory import allocate, run_isolated

    with pytest.raises(XDeployError, match="nbytes must be >= 0"):  # a user error in the child stays one line
        run_isolated(allocate, -1)


def test_fingerprint_has_cpu_isa_versions_threads():
    from xdeploy.core.fingerprint import fingerprint

    fp = fingerprint()
    assert fp["cpu_model"] and fp["logical_cpus"] >= 1 and fp["threads"]["affinity_cpus"] >= 1
    assert isinstance(fp["isa"], list) and all(not f.startswith("sse2") for f in fp["isa"])
    assert fp["versions"]["numpy"] and "onnxruntime" in fp["versions"]
    import json
    json.dumps(fp)  # JSON-ready


def _latency_record():
    from xdeploy.core.fingerprint import fingerprint
    from xdeploy.core.records import make_record

    return make_record(
        "latency", fingerprint(), model="bert", preset="tiny", graph="model", runner="ort", device="cpu",
        precision="fp32", artifact_precision="fp32", opset=23, attn_impl="sdpa", threads=2, batch=1, seq=8,
        sizes={"batch": 1, "seq": 8}, latency_s=dict(p50=1e-3, p90=2e-3, p99=3e-3, mean=1.5e-3, std=1e-4,
                                                     min=9e-4, max=4e-3),
        iterations=10, timed_s=0.015, items_per_s=1000.0, tokens_per_s=8000.0, flops=1e6, achieved_flops=1e9,
        peak_flops=None, pct_of_peak=None, parity_passed=None, stability=None,
        memory=dict(weights_bytes=1.0, load_peak_bytes=2.0, activations_bytes=3.0, peak_rss_bytes=4.0,
                    device_bytes=None))


def test_records_validate_and_invalid_ones_are_rejected(tmp_path):
    import copy
    import json

    from xdeploy.core.records import read_records, validate_record, write_records

    rec = _latency_record()
    write_records(tmp_path / "r.jsonl", [rec, rec])
    assert read_records(tmp_path / "r.jsonl") == [rec, rec]
    bad_cases = [
        (lambda r: r.pop("flops"), "missing \\['flops'\\]"),
        (lambda r: r.update(typo=1), "unexpected \\['typo'\\]"),
        (lambda r: r.update(kind="nope"), "kind 'nope'"),
        (lambda r: r.update(batch=1.5), "batch is 1.5"),
        (lambda r: r["latency_s"].update(p50=float("nan")), "latency_s.p50"),
        (lambda r: r["latency_s"].update(p99=1e-4), "not ordered"),
        (lambda r: r["latency_s"].pop("p90"), "exactly"),
        (lambda r: r["memory"].update(weights_bytes="1 MB"), "memory.weights_bytes"),
        (lambda r: r.update(version=99), "schema/version"),
        (lambda r: r.update(fingerprint={}), "fingerprint"),
        (lambda r: r.update(parity_passed="yes"), "parity_passed"),
    ]
    for mutate, msg in bad_cases:
        r = copy.deepcopy(rec)
        mutate(r)
        with pytest.raises(XDeployError, match=msg):
            validate_record(r)
    (tmp_path / "bad.jsonl").write_text(json.dumps(rec) + "\n{not json\n")
    with pytest.raises(XDeployError, match="bad.jsonl:2: not JSON"):
        read_records(tmp_path / "bad.jsonl")


# ---------------------------------------------------------------- roofline and the commands, end to end ----

@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private XDEPLOY_CACHE (artifacts, roofline) inherited by the benchmark child processes."""
    import os

    old = os.environ.get("XDEPLOY_CACHE")
    path = tmp_path_factory.mktemp("xdeploy-cache")
    os.environ["XDEPLOY_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("XDEPLOY_CACHE", None)
    else:
        os.environ["XDEPLOY_CACHE"] = old


@pytest.fixture(scope="module")
def peaks(cache):
    """A real (tiny) roofline measurement, cached where `xdeploy bench` looks for it."""
    from xdeploy.bench import roofline

    trials = roofline.gemm_trials(("fp32", "int8"), sizes=(128,), threads=(1,), budget=0.02)
    mem = roofline.memory_trials(16 << 20, budget=0.05)
    assert {t.precision for t in trials} == {"fp32", "int8"} and all(t.value > 1e8 for t in trials)
    assert all(t.value > 1e8 for t in mem) and any(t.path.startswith("read") for t in mem)
    data = roofline.summarize(trials + mem, quick=True)
    roofline.save(data)
    loaded = roofline.load_peaks()
    assert {p: loaded[p] for p in data["gemm"]} == {p: v["value"] for p, v in data["gemm"].items()}
    assert loaded["fp32@1"] == loaded["fp32"]  # only 1-thread trials here
    assert roofline.peak_for({"fp32": 2.0, "fp32@1": 1.0}, "fp16", 1) == 1.0  # fp16 GEMMs run in fp32 here
    assert roofline.peak_for({"fp32": 2.0, "fp32@1": 1.0}, "fp32", 2) == 2.0
    assert roofline.peak_for({"fp32": 2.0}, "bf16") is None
    return data


def test_roofline_command_reads_cache(peaks, tmp_path):
    import json

    from xdeploy.cli import main

    assert main(["roofline", "--cached", "--json", str(tmp_path / "r.json"), "--records",
                 str(tmp_path / "r.jsonl")]) == 0
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["gemm"]["fp32"]["value"] == peaks["gemm"]["fp32"]["value"] and out["memory_read"]["value"] > 0
    from xdeploy.core.records import read_records
    assert {r["measure"] for r in read_records(tmp_path / "r.jsonl")} == {"gemm", "memory_read", "memory_copy"}


def test_bench_command_end_to_end(peaks, tmp_path):
    import json

    from xdeploy.cli import main
    from xdeploy.core.records import read_records

    args = ["bench", "bert", "--preset", "tiny", "--runners", "torch,ort", "--batch", "2", "--seq", "8,4096",
            "--warmup", "1", "--min-iters", "2", "--max-iters", "3", "--threads", "1", "--parity",
            "--json", str(tmp_path / "b.json"), "--records", str(tmp_path / "b.jsonl")]
    assert main(args) == 0
    recs = read_records(tmp_path / "b.jsonl")
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["records"] == recs
    by = {(r["runner"], r["batch"]): r for r in recs}
    assert [b["batch"] for b in doc["best"]] == [2]
    for b in doc["best"]:  # the only candidate is ort; speed-up = median of paired torch/ort round ratios
        assert b["runner"] == "ort"
        st = by[("ort", b["batch"])]["stability"]
        sp = st["speedup"]
        assert st["baseline"] is not None and sp["low"] <= sp["median"] <= sp["high"]
        if st["stable"]:
            assert b["speedup"] == pytest.approx(sp["median"]) and b["unstable"] is None
        else:  # an unstable comparison gives no figure, only its cause
            assert b["speedup"] is None and b["unstable"] in ("load", "noise") and st["reasons"]
    # seq 4096 exceeds bert-tiny's 128 positions: skipped, not failed
    assert sorted((r["runner"], r["batch"], r["seq"]) for r in recs) == [("ort", 2, 8), ("torch", 2, 8)]
    for r in recs:
        st = r["stability"]  # --min-iters/--max-iters bound the interleaved rounds; each round times a block
        assert r["parity_passed"] is True and 2 <= st["rounds"] <= 3 and r["threads"] == 1
        assert r["iterations"] == st["rounds"] * st["calls_per_round"]  # the kept attempt's calls
        assert r["fingerprint"]["env"].get("OMP_WAIT_POLICY") == "PASSIVE"  # set in the child before torch
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 8 / r["latency_s"]["p50"])
        assert r["achieved_flops"] == pytest.approx(r["flops"] / r["latency_s"]["p50"])
        peak_1thread = peaks["gemm_by_threads"]["1"]["fp32"]["value"]  # --threads 1: the 1-thread peak
        assert r["pct_of_peak"] == pytest.approx(100 * r["achieved_flops"] / peak_1thread)
        m = r["memory"]
        assert m["weights_bytes"] > 0 and m["peak_rss_bytes"] > m["weights_bytes"] and m["device_bytes"] is None
        assert r["fingerprint"]["isa"] and r["fingerprint"]["threads"]["affinity_cpus"] >= 1
    # the model's analytic FLOPs at these sizes: 2 x the batch-1 figure
    from xdeploy.models.registry import get_config, get_family
    one = get_family("bert").flops(get_config("bert", "tiny"), {"batch": 1, "seq": 8})
    assert all(r["flops"] == pytest.approx(2 * one) for r in recs)


def test_bench_model_without_seq_axis_and_errors(cache, tmp_path):
    from xdeploy.bench.suite import run_bench

    recs = run_bench("vit", preset="tiny", runners=["ort"], batches=[1], seqs=[8, 16, 32], warmup=0,
                     min_iters=1, max_iters=2, isolate=False, peaks={})
    assert len(recs) == 1 and recs[0]["seq"] is None and recs[0]["sizes"] == {"batch": 1}
    assert recs[0]["tokens_per_s"] == pytest.approx(17 / recs[0]["latency_s"]["p50"])  # (32/8)^2 + CLS
    assert recs[0]["memory"]["weights_bytes"] is None and recs[0]["pct_of_peak"] is None
    with pytest.raises(XDeployError, match="unknown runner"):
        run_bench("vit", preset="tiny", runners=["nope"], peaks={})
    from xdeploy.cli import main
    with pytest.raises(SystemExit) as e:
        main(["bench", "vit", "--preset", "tiny", "--runners", "ort", "--batch", "0"])
    assert e.value.code == 2


# ---------------------------------------------------------------- attention scaling ----

def test_scale_analytic_model():
    from xdeploy.bench.scale import analytic, classify, crossover_t, fit_exponent, t_values, vit_table

    assert t_values(4096) == [64, 128, 256, 512, 1024, 2048, 4096] and t_values(100) == [64, 100]
    d = 384
    assert crossover_t(d, 4 * d) == 6 * d
    a = analytic(d, 4 * d, 12, 1, 6 * d)
    assert a["attn_share"] == pytest.approx(0.5)  # at T* = 6d attention FLOPs equal the rest
    assert a["flops"] == pytest.approx(24 * 6 * d * d * d + 4 * (6 * d) ** 2 * d)
    assert a["score_bytes"] == 12 * (6 * d) ** 2 * 4
    ts = [256, 512, 1024, 2048]
    assert fit_exponent(ts, [3e-9 * t**2 for t in ts]) == pytest.approx(2.0)
    assert fit_exponent(ts, [1e-3 * t for t in ts]) == pytest.approx(1.0)
    assert fit_exponent([64], [1.0]) is None
    pixels = vit_table(patches=(16, 1))
    assert pixels[0]["tokens"] == 197 and pixels[1]["entries_per_head"] == 224.0**4  # R⁴ for raw pixels
    assert classify("MatMul", [[1, 12, 64, 32], [1, 12, 32, 64]]) == "attention"
    assert classify("MatMul", [[1, 64, 384], [384, 384]]) == "matmul"
    assert classify("LayerNormalization", []) == "normalization" and classify("Attention", []) == "attention"
    assert classify("Add", [[1, 12, 64, 64], [1, 1, 1, 64]]) == "attention"  # mask bias on the scores
    assert classify("Add", [[1, 64, 384], [384]]) == "other" and classify("Conv", [[1, 3, 32, 32]]) == "matmul"


def test_scale_command_end_to_end(cache, tmp_path):
    import json

    from xdeploy.cli import main
    from xdeploy.core.records import read_records

    args = ["scale", "bert", "--preset", "tiny", "--max-t", "128", "--lowerings", "ort-o23,torch-sdpa",
            "--vit-patches", "", "--budget", "120", "--threads", "1", "--json", str(tmp_path / "s.json"),
            "--records", str(tmp_path / "s.jsonl")]
    assert main(args) == 0
    recs = read_records(tmp_path / "s.jsonl")
    scale = [r for r in recs if r["kind"] == "scale"]
    assert sorted((r["lowering"], r["T"]) for r in scale) == \
        [("ort-o23", 64), ("ort-o23", 128), ("torch-sdpa", 64), ("torch-sdpa", 128)]
    for r in scale:
        assert r["memory"]["peak_rss_bytes"] > 0 and r["score_bytes"] == 1 * 4 * r["T"] ** 2 * 4  # B·h·T²·fp32
    (prof,) = [r for r in recs if r["kind"] == "profile"]
    assert prof["lowering"] == "ort-o23" and prof["shares"]["attention"] > 0 and "Attention" in prof["op_times_s"]
    summary = json.loads((tmp_path / "s.json").read_text())["summary"]
    assert {s["lowering"] for s in summary} == {"ort-o23", "torch-sdpa"}
    assert all(s["time_exponent"] is not None and s["crossover_T"] == 384 for s in summary)
    from xdeploy.bench.scale import run_scale

    with pytest.raises(XDeployError, match="unknown lowering"):
        run_scale("bert", lowerings=["nope"])


def test_no_record_is_shown_above_its_peak(monkeypatch, tmp_path):
    """A record faster than its cached peak proves the peak wrong: it is re-measured, and a record that still
    exceeds it gets no % of peak (and says why) instead of a figure above 100%."""
    from xdeploy.bench import roofline
    from xdeploy.core.records import validate_record

    monkeypatch.setenv("XDEPLOY_CACHE", str(tmp_path))
    underestimated = roofline.Trial("gemm", "fp32", "a disturbed trial n=64 threads=1", 1e6, 1.0, 1)
    roofline.save(roofline.summarize([underestimated], quick=True))
    assert roofline.load_peaks()["fp32@1"] == 1e6
    fast = dict(_latency_record(), threads=1, achieved_flops=1e8, peak_flops=1e6, pct_of_peak=1e4)
    impossible = dict(_latency_record(), threads=1, achieved_flops=1e16, peak_flops=1e6, pct_of_peak=1e12)
    fine = dict(_latency_record(), threads=2, achieved_flops=1e5, peak_flops=1e6, pct_of_peak=10.0)
    out = roofline.reconcile([fast, impossible, fine], budget=0.02)
    assert out[2] is fine  # not over its peak: untouched
    assert out[0]["peak_flops"] > 1e8 and 0 < out[0]["pct_of_peak"] <= 100  # re-measured peak: real GEMMs
    assert out[1]["pct_of_peak"] is None and "peak underestimated" in out[1]["note"]  # 10 PFLOP/s: not here
    for r in out:
        validate_record(r)
    assert roofline.load_peaks()["fp32@1"] == out[0]["peak_flops"]  # the cache keeps the better peak


def test_bench_of_an_artifact_runs_without_torch(cache, tmp_path):
    """An artifact's FLOPs per call come from its manifest ("cost"), not the model family (whose file imports torch):
    `xdeploy bench ARTIFACT` runs where `import torch` fails in every process it starts, on `ort` (the default
    there), measuring its quick roofline without torch's kernels, and its records carry the family's FLOPs and token
    counts, for a model with a token axis and one without."""
    import json
    import os
    import subprocess
    import sys

    from families import names, smallest

    from xdeploy.bench import roofline
    from xdeploy.core.records import read_records
    from xdeploy.export.artifact import load_artifact
    from xdeploy.export.onnx_export import export
    from xdeploy.models.registry import dims, get_family
    from xdeploy.models.spec import token_axes

    with_axis = next(n for n in names() if get_family(n).capabilities.token_axis)
    without = [n for n in names() if not token_axes(get_family(n).capabilities)]
    arts = [load_artifact(export(m, preset=smallest(m), out=tmp_path / m)) for m in [with_axis, *without[:1]]]
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None  # import torch fails\n")
    # a cache of its own: no roofline measured in this environment yet, so bench measures a quick one without torch
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
                        "XDEPLOY_CACHE": str(tmp_path / "lean-cache")}
    out = tmp_path / "b.jsonl"
    # no --runners: the reference runner is left out where PyTorch cannot be imported, not a failure
    r = subprocess.run([sys.executable, "-m", "xdeploy.cli", "bench", *[str(a.path) for a in arts],
                        "--batch", "2", "--seq", "8", "--warmup", "1", "--min-iters", "2",
                        "--max-iters", "3", "--threads", "1", "--records", str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env)
    assert probe.returncode != 0  # the block holds in the processes bench starts too
    recs = {rec["model"]: rec for rec in read_records(out)}
    assert {rec["runner"] for rec in read_records(out)} == {"ort"} and len(recs) == len(arts)
    roof = json.loads((tmp_path / "lean-cache" / roofline.CACHE_FILE).read_text())  # GEMM peaks of ort and ov
    assert roof["gemm"]["fp32"]["value"] > 0 and not roof["gemm"]["fp32"]["path"].startswith("torch")
    assert roof["memory_read"]["path"].startswith("read: numpy")  # the torch read kernels left out
    assert all(rec["peak_flops"] and (rec["pct_of_peak"] is None or 0 < rec["pct_of_peak"] <= 100)
               for rec in recs.values())
    for a in arts:
        sizes = {"batch": 2} | dict.fromkeys(token_axes(a.capabilities), 8)
        rec = recs[a.model]
        assert rec["flops"] == pytest.approx(get_family(a.model).flops(a.config, sizes), rel=1e-12)
        n = 8 if a.model == with_axis else dims(a.config).fixed_tokens
        assert rec["tokens_per_s"] == pytest.approx(2 * n / rec["latency_s"]["p50"])
    assert json.loads((arts[0].path / "manifest.json").read_text())["cost"]["flops_per_row"]
