"""The record contract (core/records.py): one constructor, one validation rule, the sink hook, record identity,
the one speed-up / best-per-configuration definition, and the targets table. Synthetic values, real code."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from xdeploy.core.errors import XDeployError
from xdeploy.core.fingerprint import fingerprint
from xdeploy.core.records import (
    KINDS,
    best,
    emit,
    identity,
    make_record,
    record_sink,
    speedups,
    upgrade_legacy,
    validate_record,
)
from xdeploy.core.targets import TARGETS

ROOT = Path(__file__).resolve().parents[1]
MEM = {"weights_bytes": 1.0, "load_peak_bytes": 2.0, "activations_bytes": 3.0, "peak_rss_bytes": 4.0,
       "device_bytes": None}


def lat(runner: str, p50: float, *, precision: str = "fp32", ap: str = "fp32", graph: str = "model", batch: int = 1,
        parity: bool | None = None, stability: dict | None = None) -> dict:
    stats = {"p50": p50, "p90": p50 * 1.1, "p99": p50 * 1.2, "mean": p50, "std": p50 / 20, "min": p50 * 0.9,
             "max": p50 * 1.3}
    return make_record(
        "latency", None, model="bert", preset="tiny", graph=graph, runner=runner, device="cpu", precision=precision,
        artifact_precision=ap, opset=23, attn_impl=None, threads=1, batch=batch, seq=8, sizes={"batch": batch},
        latency_s=stats, iterations=5, timed_s=5 * p50, items_per_s=batch / p50, tokens_per_s=None, flops=1e6,
        achieved_flops=1e6 / p50, peak_flops=None, pct_of_peak=None, memory=dict(MEM), parity_passed=parity,
        stability=stability)


def paired(median: float | None, *, stable: bool = True, cause: str | None = None) -> dict:
    """The parts of bench/interleave.py's stability block the speed-ups read (the rest is not consulted)."""
    return {"stable": stable, "cause": cause, "baseline": "torch",
            "speedup": None if median is None else {"median": median, "low": median * 0.9, "high": median * 1.1}}


def parity(**over: object) -> dict:
    fields = dict(model="bert", preset="tiny", graph="model", runner="ort", artifact_precision="fp16",
                  output="hidden", tolerance_precision="fp16", max_abs=1e-3, max_rel=1e-2, mean_abs=1e-4,
                  cosine=0.9999, nonfinite=0, top1=None, passed=True, reason=None, cases=3, atol=1e-2, rtol=1e-2,
                  min_cosine=0.999, first_divergence=None) | over
    return make_record("parity", None, **fields)


def test_make_record_stamps_this_machine_and_passes_every_record_to_the_sinks():
    seen: list[dict] = []
    with record_sink(seen.append):
        p = parity()
        r = lat("ort", 1e-3)
    after = parity()
    assert len(seen) == 2 and seen[0] is p and seen[1] is r  # the records themselves, for the block only
    fp = fingerprint()
    assert p["fingerprint"]["cpu_model"] == fp["cpu_model"] and p["fingerprint"]["isa"] == fp["isa"]
    assert p["schema"] == "xdeploy-bench" and p["kind"] == "parity" and p["timestamp"].endswith("+00:00")
    # a measuring child's fingerprint (its thread settings) is kept as given
    child = fp | {"threads": {"affinity_cpus": 1}}
    assert make_record("roofline", child, measure="gemm", precision="fp32", path="x", value=1e9, unit="FLOP/s",
                       trials=[])["fingerprint"]["threads"] == {"affinity_cpus": 1}
    # emit: a record made earlier (a cached roofline) reaches the sinks, validated
    with record_sink(seen.append):
        emit(after)
        with pytest.raises(XDeployError, match="unexpected"):
            emit(after | {"typo": 1})
    assert seen[-1] is after and len(seen) == 3


def test_a_sink_that_fails_stops_the_phase():
    def broken(_rec: dict) -> None:
        raise OSError("disk full")

    with record_sink(broken), pytest.raises(OSError, match="disk full"):
        parity()


def test_one_rule_for_every_kind_parity_and_decode_included():
    assert {"latency", "roofline", "scale", "profile", "loadtest", "parity", "decode"} <= set(KINDS)
    good = parity()
    for mutate, msg in [
        (lambda r: r.update(extra=1), "unexpected \\['extra'\\]"),  # the report used to let these through
        (lambda r: r.pop("first_divergence"), "missing \\['first_divergence'\\]"),
        (lambda r: r.update(max_abs=float("inf")), "max_abs"),
        (lambda r: r.update(passed=1), "passed"),
        (lambda r: r.update(kind="embedding"), "kind 'embedding'"),  # unknown kinds are refused, not carried
    ]:
        bad = copy.deepcopy(good)
        mutate(bad)
        with pytest.raises(XDeployError, match=msg):
            validate_record(bad)
    dec = dict(model="gpt", preset="tiny", runner="ort", artifact_precision="fp32", mode="cache", batch=1,
               prompt_len=4, new_tokens=3, ttft_s=0.01, step_s=[0.001, 0.002], tokens_per_s=100.0, total_s=0.013,
               agreement=1.0, first_divergence=None, threads=1, stability=None)
    make_record("decode", None, **dec)
    with pytest.raises(XDeployError, match="step_s"):
        make_record("decode", None, **(dec | {"step_s": [0.001, -1.0]}))
    with pytest.raises(XDeployError, match="step_s"):
        make_record("decode", None, **(dec | {"step_s": "fast"}))


def test_speedups_are_keyed_by_identity_and_grouped_by_configuration():
    torch_, ort, bf16 = lat("torch", 4e-3), lat("ort", 1e-3), lat("torch:bf16", 2e-3, precision="bf16")
    other_graph = lat("ort", 1e-3, graph="decode")  # no baseline for this graph: no speed-up
    sp = speedups([torch_, ort, bf16, other_graph])
    assert sp == {identity(torch_): 1.0, identity(ort): 4.0, identity(bf16): 2.0}
    # identity, not object identity: an equal copy (a record read back from disk) finds its speed-up
    assert sp[identity(json.loads(json.dumps(ort)))] == 4.0
    # torch on a non-fp32 artifact is still the eager fp32 baseline (it runs the reference weights)
    t16 = lat("torch", 4e-3, ap="fp16")
    assert speedups([t16, ort])[identity(ort)] == 4.0
    # a torch:bf16 record is not a baseline
    assert speedups([bf16, ort]) == {}


def test_best_is_the_fastest_record_whose_parity_did_not_fail():
    torch_ = lat("torch", 4e-3)
    fast_but_wrong = lat("ort", 5e-4, ap="int8", parity=False)
    ort, ov = lat("ort", 1e-3, parity=True), lat("ov", 2e-3)
    (b,) = best([torch_, fast_but_wrong, ort, ov])
    assert b.record is ort and b.baseline is torch_ and b.speedup == pytest.approx(4.0)
    # nothing beats the baseline: the best deployment is reported with its speed-up below 1
    slow = lat("ort", 8e-3)
    (b,) = best([torch_, slow])
    assert b.record is slow and b.speedup == 0.5 and b.interval is None and b.unstable is None
    # one per configuration (batch differs), none without a baseline
    assert [x.record["batch"] for x in best([torch_, ort, lat("torch", 8e-3, batch=4), lat("ov", 2e-3, batch=4),
                                             lat("ov", 1e-3, batch=8)])] == [1, 4]


def test_best_skips_a_deployment_whose_parity_records_failed_on_this_machine():
    """`xdeploy run` keeps parity in parity records, not on the latency records: an int8 artifact that fails parity
    on any of its graphs on this runner (int8-dynamic on onnxruntime on AVX2-only x86, issue #27) is not named the
    one to deploy, however fast; the same artifact on another runner still can be."""
    from xdeploy.reports.render import render_summary

    torch_, int8_ort, int8_ov = lat("torch", 4e-3), lat("ort", 5e-4, ap="int8"), lat("ov", 8e-4, ap="int8")
    fp32_ort = lat("ort", 1e-3)
    bad = parity(runner="ort", artifact_precision="int8", graph="decode", passed=False, reason="cosine 0.97 < 0.98")
    good = parity(runner="ov", artifact_precision="int8")
    assert best([torch_, int8_ort, int8_ov, fp32_ort])[0].record is int8_ort
    (b,) = best([torch_, int8_ort, int8_ov, fp32_ort, bad, good])
    assert b.record is int8_ov and b.speedup == pytest.approx(5.0)
    text = render_summary([torch_, int8_ort, int8_ov, fp32_ort, bad, good], {"title": "t"}, [])
    head = text.split("## ")[0]
    assert "**Deploy on this machine**" in head and "**ov int8**" in head and "**ort int8**" not in head


def test_bench_best_text_reads_the_targets_table():
    from xdeploy.bench.suite import best_vs_baseline
    from xdeploy.reports.text import best_line

    (b,) = best_vs_baseline([lat("torch", 7e-3), lat("ort", 1e-3)])
    assert b["speedup"] == pytest.approx(7.0) and b["meets_speedup"] and not b["meets_peak"]
    text = best_line(b)
    assert f"meets {TARGETS['speedup_vs_eager'].text()}" in text and "misses >= 70%" in text
    (b,) = best_vs_baseline([lat("torch", 5e-3), lat("ort", 1e-3)])
    assert not b["meets_speedup"] and "misses >= 6x" in best_line(b)


def test_targets_table():
    t = TARGETS["speedup_vs_eager"]
    assert t.text() == ">= 6x" and t.met(6.0) and not t.met(5.99) and not t.met(None)
    assert TARGETS["pct_of_gemm_peak"].text() == ">= 70%"


def test_reports_written_before_the_contract_still_load():
    """The committed reference report's parity/decode records predate the contract: load_results completes them
    from the report and validates every record by the one rule."""
    from xdeploy.reports.render import load_results

    raw = json.loads((ROOT / "reports/reference/results.json").read_text())
    doc = load_results(ROOT / "reports/reference")
    assert len(doc["records"]) == len(raw["records"])
    par = [r for r in doc["records"] if r["kind"] == "parity"]
    assert par and all(r["timestamp"] == raw["meta"]["generated"] and r["fingerprint"]["cpu_model"] for r in par)
    for r in doc["records"]:
        validate_record(r)
    # a current record passes through unchanged
    p = parity()
    assert upgrade_legacy(p, timestamp="x", fingerprint=None) is p


def test_paired_speedups_come_from_the_interleaved_rounds_and_unstable_ones_give_no_figure():
    from xdeploy.core.records import speedup_interval, unstable

    # p50s say 4x, the paired rounds say 3.5x: the paired median is the figure, with its interval
    torch_, ort = lat("torch", 4e-3, stability=paired(None)), lat("ort", 1e-3, stability=paired(3.5))
    assert speedups([torch_, ort]) == {identity(torch_): 1.0, identity(ort): 3.5}
    assert speedup_interval(ort) == pytest.approx((3.15, 3.85)) and speedup_interval(torch_) is None
    (b,) = best([torch_, ort])
    assert b.record is ort and b.speedup == 3.5 and b.interval == pytest.approx((3.15, 3.85))
    # an unstable comparison: no figure anywhere, only its cause - the fastest record is still named
    ov = lat("ov", 5e-4, stability=paired(7.0, stable=False, cause="load"))
    assert identity(ov) not in speedups([torch_, ort, ov]) and unstable([torch_, ort, ov]) == {identity(ov): "load"}
    (b,) = best([torch_, ort, ov])
    assert b.record is ov and b.speedup is None and b.unstable == "load" and b.interval is None
    from xdeploy.bench.suite import best_vs_baseline
    from xdeploy.reports.text import best_line

    (d,) = best_vs_baseline([torch_, ort, ov])
    assert d["speedup"] is None and not d["meets_speedup"] and "unstable (load)" in best_line(d)


def test_revise_is_a_validated_emitted_copy_of_the_same_measurement():
    from xdeploy.core.records import revise

    r = lat("ort", 1e-3)
    seen: list[dict] = []
    with record_sink(seen.append):
        fixed = revise(r, pct_of_peak=None, note="peak underestimated")
    assert seen == [fixed] and fixed is not r and r["note"] is None and fixed["note"] == "peak underestimated"
    with pytest.raises(XDeployError, match="cannot change what"):
        revise(r, batch=8)
    with pytest.raises(XDeployError, match="pct_of_peak"):
        revise(r, pct_of_peak="high")


def test_outputs_that_could_not_be_compared_are_null_not_zero(tmp_path):
    """A runner that failed gives a parity record with null metrics (it used to read max_abs 0.0, cosine 0.0: a
    perfect-looking error next to a failed verdict); the report shows "–" and plots no error for it."""
    from xdeploy.deploy.metrics import Comparison
    from xdeploy.deploy.verdict import OutputCheck
    from xdeploy.models.spec import DEFAULT_TOLERANCES
    from xdeploy.reports.render import render_report
    from xdeploy.verify.parity import ParityReport, parity_records

    tol = DEFAULT_TOLERANCES["fp32"]
    ok = Comparison(max_abs=1e-6, max_rel=1e-5, mean_abs=1e-7, cosine=0.9999999, within=1.0, nonfinite=0,
                    compared=10, passed=True, reason="")
    why = "runner error: cannot load"
    checks = (OutputCheck("ort", "fp32", "fp32", "model", "1x4", "out", ok, tol, True, ""),
              OutputCheck("ov", "fp32", "fp32", "model", "-", "out", Comparison.not_compared(why), tol, False, why))
    by = {r["runner"]: r for r in parity_records(ParityReport(checks), "m", "tiny")}
    assert by["ort"]["max_abs"] == 1e-6 and by["ort"]["cosine"] == 0.9999999 and by["ort"]["passed"]
    assert all(by["ov"][k] is None for k in ("max_abs", "max_rel", "mean_abs", "cosine"))
    assert not by["ov"]["passed"] and by["ov"]["reason"] == f"case -: {why}"
    render_report([by["ort"], by["ov"], lat("torch", 2e-3), lat("ort", 1e-3)], tmp_path / "r")
    md = (tmp_path / "r" / "summary.md").read_text()
    assert "| m tiny | model | fp32 | ov | out | – | – | – |" in md and "**FAIL** case -: runner error" in md
