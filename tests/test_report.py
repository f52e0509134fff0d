"""Report renderer, `report compare` and the main job (`xdeploy run`) on synthetic records and a tiny real run.

The synthetic records below have the shapes of real ones (validated by the same schema); their values are made up
and only ever used here, never by the product."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from xdeploy.cli import main
from xdeploy.core.errors import XDeployError
from xdeploy.core.fingerprint import fingerprint
from xdeploy.core.records import KINDS, identity, make_record, speedups
from xdeploy.reports.compare import compare_records, compare_runs
from xdeploy.reports.render import PLOTS, fitted_exponent, load_results, render_report

MEM = {"weights_bytes": 50e6, "load_peak_bytes": 80e6, "activations_bytes": 10e6, "peak_rss_bytes": 300e6,
       "device_bytes": None}



def make(kind: str, fp: dict, **fields) -> dict:
    """make_record, with every nullable field this test does not set left null (the schema grows over time)."""
    extra = {k: None for k, (_t, nullable) in KINDS[kind].items() if nullable and k not in fields}
    return make_record(kind, fp, **fields, **extra)


def lat(p50: float, spread: float = 0.05) -> dict:
    return {"p50": p50, "p90": p50 * (1 + spread), "p99": p50 * (1 + 2 * spread), "mean": p50 * (1 + spread / 2),
            "std": p50 * spread / 2, "min": p50 * 0.95, "max": p50 * (1 + 3 * spread)}


def synthetic_records(slow: float = 1.0, spread: float = 0.05, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    fp = fingerprint()
    out = []
    runners = [("torch", "fp32", "fp32", 1.0), ("ort", "fp32", "fp32", 0.5), ("ort", "fp16", "fp16", 0.7),
               ("ort", "int8", "int8", 0.3), ("ov", "fp32", "fp32", 0.45)]
    for model in ("bert", "vit"):
        for batch in (1, 4, 8):
            for runner, prec, ap, f in runners:
                p50 = 0.002 * batch * f * (slow if runner == "ort" and ap == "fp32" else 1.0)
                out.append(make(
                    "latency", fp, model=model, preset="tiny", graph="model", runner=runner, device="cpu",
                    precision=prec, artifact_precision=ap, opset=23, attn_impl="sdpa", threads=2, batch=batch,
                    seq=128 if model == "bert" else None, sizes={"batch": batch}, latency_s=lat(p50, spread),
                    iterations=50, timed_s=50 * p50, items_per_s=batch / p50, tokens_per_s=batch * 128 / p50,
                    flops=1e9 * batch, achieved_flops=1e9 * batch / p50, peak_flops=2e11,
                    pct_of_peak=100 * 1e9 * batch / p50 / 2e11, memory=dict(MEM)))
        for runner, ap in (("ort", "fp32"), ("ort", "fp16"), ("ort", "int8"), ("ov", "fp32")):
            err = {"fp32": 1e-6, "fp16": 2e-3, "int8": 5e-2}[ap] * (1 + rng.random())
            out.append(make("parity", fp, model=model, preset="tiny", graph="model", runner=runner,
                            artifact_precision=ap, output="hidden", tolerance_precision=ap, max_abs=err,
                            max_rel=err * 10, mean_abs=err / 10, cosine=1 - err / 100, nonfinite=0, passed=True,
                            cases=3, atol=1e-4, rtol=1e-3, min_cosine=0.999))
    for runner, lowering in (("ort", "opset23"), ("ort", "opset18"), ("torch", "sdpa")):
        for T in (64, 128, 256, 512, 1024, 2048):
            d = 128
            flops = 2 * (24 * T * d * d + 4 * T * T * d)
            p50 = 1e-4 + flops / 5e10 * (1.3 if lowering == "opset18" else 1.0)
            out.append(make(
                "scale", fp, model="bert", runner=runner, lowering=lowering, T=T, batch=1, d_model=d, n_heads=2,
                n_layers=2, latency_s=lat(p50, spread), iterations=10,
                memory=dict(MEM, peak_rss_bytes=2e8 + 4.0 * 2 * T * T * (2 if lowering == "opset18" else 1)),
                flops=flops, attn_flops=2 * 4 * T * T * d, score_bytes=4.0 * 2 * T * T, achieved_flops=flops / p50))
    for measure, prec, val, unit in (("gemm", "fp32", 1.8e11, "FLOP/s"), ("gemm", "bf16", 7.6e11, "FLOP/s"),
                                     ("memory", None, 3.8e10, "B/s")):
        out.append(make("roofline", fp, measure=measure, precision=prec, path="torch.matmul n=2048",
                               value=val, unit=unit, trials=[{"path": "x", "value": val}]))
    for runner, ap, mode, base in (("ort", "fp32", "cache", 0.004), ("ort", "fp32", "recompute", 0.004),
                                   ("torch", "fp32", "cache", 0.008), ("ort", "int8", "cache", 0.002)):
        steps = [base * (1 + (i / 60 if mode == "cache" else i / 8)) * (1 + 0.05 * rng.random()) for i in range(63)]
        out.append(make("decode", fp, model="gpt", preset="tiny", runner=runner, artifact_precision=ap, mode=mode,
                        batch=1, prompt_len=16, new_tokens=64, ttft_s=base * 3, step_s=steps,
                        tokens_per_s=64 / (base * 3 + sum(steps)), total_s=base * 3 + sum(steps), agreement=1.0))
    return out


def _png_ok(path: Path) -> None:
    """A decodable PNG of a sensible size that is not a blank canvas."""
    import matplotlib.image as mpimg

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] >= 300 and img.shape[1] >= 400
    rgb = img[..., :3].reshape(-1, 3)
    non_white = np.mean(np.any(rgb < 0.95, axis=1))
    assert 0.02 < non_white < 0.9  # axes, lines, text drawn; not all one colour
    assert len(np.unique((rgb * 255).astype(np.uint8), axis=0)) > 20  # several line colours + antialiasing


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("rep") / "run"
    recs = synthetic_records()
    render_report(recs, out, meta={"command": "pytest", "title": "synthetic"})
    return out, recs


def test_renderer_writes_every_file_and_plot(rendered):
    out, recs = rendered
    assert {p.name for p in out.iterdir()} == {"summary.md", "results.csv", "results.json", "plots"}
    assert sorted(p.name for p in (out / "plots").iterdir()) == sorted(PLOTS)
    for p in PLOTS:
        _png_ok(out / "plots" / p)
    doc = load_results(out)
    assert len(doc["records"]) == len(recs) and doc["plots"] == list(PLOTS)
    import pandas as pd

    df = pd.read_csv(out / "results.csv")
    assert len(df) == len(recs) and {"kind", "latency_s.p50", "memory.peak_rss_bytes", "max_abs"} <= set(df.columns)
    lat_rows = df[df.kind == "latency"]
    assert np.allclose(sorted(lat_rows["latency_s.p50"]), sorted(r["latency_s"]["p50"] for r in recs
                                                                  if r["kind"] == "latency"))


def test_summary_has_every_section_with_computed_numbers(rendered):
    out, recs = rendered
    md = (out / "summary.md").read_text()
    for heading in ("## Machine", "## Parity vs PyTorch fp32", "## Latency and throughput", "## Peak memory",
                    "## Machine roofline", "## Decoding (KV cache)", "## Attention scaling with sequence length",
                    "## Plots"):
        assert heading in md, heading
    fp = fingerprint()
    assert fp["cpu_model"] in md and f"onnxruntime {fp['versions']['onnxruntime']}" in md
    # speedup of ort fp32 vs torch fp32 is 1.0/0.5 = 2x for every config, int8 is 1/0.3 = 3.33x
    assert "| 2.00× |" in md and "3.33×" in md
    for p in PLOTS:
        assert f"(plots/{p})" in md
    # scaling exponents: fitted from the records (top 3 T), shown next to the FLOPs exponent
    doc = load_results(out)
    fit = next(f for f in doc["scale_fits"] if f["lowering"] == "opset23")
    top = [r for r in recs if r.get("lowering") == "opset23" and r["T"] >= 512]
    assert fit["time_exponent"] == pytest.approx(float(np.polyfit(np.log([r["T"] for r in top]),
                                                                  np.log([r["latency_s"]["p50"] for r in top]), 1)[0]))
    assert 1.0 < fit["time_exponent"] < 2.0 and fit["crossover_T"] == 6 * 128 and fit["max_T"] == 2048
    assert f"| bert | opset23 | 512–2048 | 2048 | {fit['time_exponent']:.2f} |" in md


def test_fitted_exponent_uses_the_upper_range():
    t = np.array([64, 128, 256, 512, 1024, 2048, 4096], dtype=float)
    assert fitted_exponent(t, 3e-9 * t**2) == pytest.approx(2.0)
    assert fitted_exponent(t, 1e-3 + 0 * t) == pytest.approx(0.0)
    # a constant overhead at small T drags a whole-range fit down, not the upper-range one
    y = 1e-3 + 1e-9 * t**2
    whole = float(np.polyfit(np.log(t), np.log(y), 1)[0])
    assert fitted_exponent(t, y) > 1.5 and fitted_exponent(t, y) > whole + 0.3
    assert fitted_exponent([1], [1]) is None


def test_speedups_only_against_eager_fp32_of_the_same_config():
    recs = synthetic_records()
    sp = speedups(recs)
    lat = [r for r in recs if r["kind"] == "latency"]
    for r in lat:
        want = {"torch": 1.0, "ort": {"fp32": 2.0, "fp16": 1 / 0.7, "int8": 1 / 0.3}, "ov": 1 / 0.45}[r["runner"]]
        want = want[r["artifact_precision"]] if isinstance(want, dict) else want
        assert sp[identity(r)] == pytest.approx(want)
    no_base = [r for r in lat if r["runner"] != "torch"]
    assert speedups(no_base) == {}


def test_parity_failure_is_visible(tmp_path):
    recs = synthetic_records()
    bad = next(r for r in recs if r["kind"] == "parity" and r["artifact_precision"] == "fp16")
    bad |= {"passed": False, "reason": "3 NaN/Inf", "nonfinite": 3}
    render_report(recs, tmp_path / "r")
    md = (tmp_path / "r" / "summary.md").read_text()
    assert "**Parity: 1 check(s) FAIL**" in md and "**FAIL** 3 NaN/Inf" in md


def test_no_parity_records_no_speed_vs_error_plot(tmp_path):
    """A run without parity records has no error axis: the plot is left out (it once drew a lone reference
    point at an invented error of 1e-8), and the summary says so."""
    render_report([r for r in synthetic_records() if r["kind"] == "latency"], tmp_path / "r")
    res = load_results(tmp_path / "r")
    assert "throughput_vs_batch.png" in res["plots"] and "speed_vs_error.png" not in res["plots"]
    assert "Not plotted (no records of that kind in this run): " in (tmp_path / "r" / "summary.md").read_text()


def test_kinds_without_a_section_render_as_a_generic_table(tmp_path):
    fp = fingerprint()
    rows = [make("loadtest", fp, target="http://127.0.0.1:8000", server="tritonserver", model="embedder",
                 protocol="http", concurrency=c, batch=4, requests=100, errors=0, sentences=400, timed_s=2.0,
                 requests_per_s=50.0 * c, sentences_per_s=200.0 * c, latency_s=lat(0.02)) for c in (1, 4)]
    render_report(rows, tmp_path / "r")
    md = (tmp_path / "r" / "summary.md").read_text()
    assert "## Other records" in md and "### loadtest" in md
    table = md[md.index("### loadtest"):]
    assert "concurrency" in table and "sentences_per_s" in table
    assert "| 200 |" in table and "| 800 |" in table  # sentences/s of both levels, not just a count


def test_invalid_records_are_refused_with_one_line(tmp_path):
    recs = synthetic_records()
    del next(r for r in recs if r["kind"] == "decode")["ttft_s"]
    with pytest.raises(XDeployError, match="ttft_s"):
        render_report(recs, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    recs = synthetic_records()
    next(r for r in recs if r["kind"] == "latency")["latency_s"]["p50"] = float("nan")
    with pytest.raises(XDeployError, match="latency_s.p50"):
        render_report(recs, tmp_path / "x")


def _write_run(path: Path, records: list[dict]) -> None:
    """A report's results.json alone: what `report compare` reads (the renderer's output is tested above)."""
    path.mkdir()
    (path / "results.json").write_text(json.dumps({"schema": "xdeploy-report", "version": 1, "meta": {},
                                                   "records": records}))


def test_compare_catches_planted_30pct_slowdown(tmp_path):
    _write_run(tmp_path / "a", synthetic_records())
    _write_run(tmp_path / "b", synthetic_records(slow=1.3))
    c = compare_runs(str(tmp_path / "a"), str(tmp_path / "b"))
    reg = c.regressions
    # exactly the slowed records (ort fp32, 2 models x 3 batches), each at +30%
    assert len(reg) == 6 and all("ort fp32" in r.key and r.change == pytest.approx(0.3) for r in reg)
    assert main(["report", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json",
                 str(tmp_path / "c.json")]) == 1
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["regressions"] == 6
    # the same runs compared the other way round: improvements, exit 0
    assert main(["report", "compare", str(tmp_path / "b"), str(tmp_path / "a")]) == 0


def test_compare_passes_equal_runs_and_noise_within_spread():
    a = synthetic_records()
    c = compare_records(a, synthetic_records())
    assert not c.regressions and all(r.status == "ok" for r in c.rows)
    # 12% slower but each run's own p90-p50 spread is 15%: inside the noise band, not a regression
    noisy_a, noisy_b = synthetic_records(spread=0.15), synthetic_records(slow=1.12, spread=0.15)
    c = compare_records(noisy_a, noisy_b)
    assert not c.regressions and sum(r.status == "noise" for r in c.rows) == 6
    # the same 12% with tight spreads (1%) is a regression
    assert len(compare_records(synthetic_records(spread=0.01), synthetic_records(slow=1.12, spread=0.01))
               .regressions) == 6
    # a 30% slowdown is caught even with 5% spreads; a parity check that starts failing is a regression too
    b = synthetic_records()
    next(r for r in b if r["kind"] == "parity")["passed"] = False
    c = compare_records(a, b)
    assert [r.kind for r in c.regressions] == ["parity"]
    with pytest.raises(XDeployError, match="threshold"):
        compare_records(a, a, threshold=-1)


def test_compare_refuses_runs_of_different_machine_classes_unless_told(tmp_path, capsys):
    """A run from another machine class is refused (exit 2, naming both classes); --across-machines shows the
    timing changes as 'other machine' without counting them, while a parity check that starts failing still
    counts."""
    a, b = synthetic_records(), synthetic_records(slow=1.3)
    for r in b:
        r["fingerprint"] = {**r["fingerprint"], "cpu_vendor": "AuthenticAMD", "cpu_model": "AMD EPYC 9B45",
                            "isa": ["avx2", "avx512f", "avx512_bf16", "avx512_vnni"]}
    with pytest.raises(XDeployError, match=r"B on 'AMD: AMD EPYC 9B45.*--across-machines"):
        compare_records(a, b)
    c = compare_records(a, b, across_machines=True)
    assert not c.same_machine and c.machines_b[0].startswith("AMD: AMD EPYC 9B45")
    assert not c.regressions and sum(r.status == "other machine" for r in c.rows) == 6
    next(r for r in b if r["kind"] == "parity")["passed"] = False
    assert [r.kind for r in compare_records(a, b, across_machines=True).regressions] == ["parity"]
    _write_run(tmp_path / "a", a)
    _write_run(tmp_path / "b", b)
    capsys.readouterr()
    assert main(["report", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("xdeploy: error: A was measured on") and "\n" not in err
    assert main(["report", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--across-machines",
                 "--json", str(tmp_path / "c.json")]) == 1  # the parity regression
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["same_machine"] is False and doc["regressions"] == 1
    assert "different machine classes" in capsys.readouterr().out


def test_compare_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["report", "compare", str(tmp_path / "none"), str(tmp_path / "none")]) == 2
    (tmp_path / "bad.json").write_text("{}")
    assert main(["report", "compare", str(tmp_path / "bad.json"), str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("xdeploy: error:") for e in err)


KILL_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_report import synthetic_records
    from xdeploy.reports.render import render_report

    def progress(name):
        print(name, flush=True)
        if name == "results.json":
            time.sleep(60)  # the parent kills us here: plots and results.json are in the temp dir

    recs = [r for r in synthetic_records(slow=2.0) if r["kind"] == "latency"]
    render_report(recs, {out!r}, meta={{"title": "second"}}, progress=progress)
""")


def test_sigkill_mid_write_leaves_previous_report(tmp_path):
    out = tmp_path / "latest"
    render_report([r for r in synthetic_records() if r["kind"] == "latency"], out, meta={"title": "first"})
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code = KILL_CHILD.format(tests=str(Path(__file__).parent), out=str(out))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in child.stdout:  # type: ignore[union-attr]
            seen.append(line.strip())
            if line.strip() == "results.json":
                break
        assert seen[-1] == "results.json" and "plots/throughput_vs_batch.png" in seen
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before and "# first" in (out / "summary.md").read_text()
    # the next complete render replaces it
    render_report([], out, meta={"title": "third"})
    assert "# third" in (out / "summary.md").read_text()


def test_xdeploy_run_smoke_end_to_end(tmp_path, capsys):
    """The main job on the smallest configuration: export -> parity -> bench -> report, for real."""
    out, js = tmp_path / "latest", tmp_path / "run.json"
    rc = main(["run", "--smoke", "--models", "vit", "--runners", "ort,ov", "--precision", "fp32,int8",
               "--out", str(out), "--artifacts", str(tmp_path / "art"), "--json", str(js)])
    cap = capsys.readouterr()
    assert rc == 0, cap
    # stderr is not a terminal here (as in CI): one plain progress line per step start and end, with elapsed
    steps = [ln for ln in cap.err.splitlines() if " step " in ln]
    assert steps and all(re.match(r"\[ *\d+\.\d s\] step \d+/\d+ (started|done): ", ln) for ln in steps), cap.err
    assert any("done: report" in ln for ln in steps) and len(steps) % 2 == 0
    doc = json.loads(js.read_text())
    assert doc["parity_passed"] and doc["summary"] == str(out / "summary.md")
    assert {"export", "parity", "bench", "report"} <= set(doc["phase_s"])
    res = load_results(out)
    kinds = {r["kind"] for r in res["records"]}
    assert {"parity", "latency"} <= kinds
    lat = [r for r in res["records"] if r["kind"] == "latency"]
    # torch (eager reference) once + both CPU runners on both artifact precisions, at batch 1 and 4
    assert sorted((r["runner"], r["artifact_precision"], r["batch"]) for r in lat) == sorted(
        (r, p, b) for r, p in (("torch", "fp32"), ("ort", "fp32"), ("ort", "int8"), ("ov", "fp32"), ("ov", "int8"))
        for b in (1, 4))
    assert all(r["memory"]["peak_rss_bytes"] > 0 for r in lat)  # measured in isolated children
    assert "throughput_vs_batch.png" in res["plots"] and "speed_vs_error.png" in res["plots"]
    for p in res["plots"]:
        _png_ok(out / "plots" / p)
    md = (out / "summary.md").read_text()
    assert "**Parity: all checks pass.**" in md and "| vit tiny | model | ort | int8 |" in md
    # the report records the command as typed, every flag, under a title that says which run it was
    assert f"xdeploy run --smoke --models vit --runners ort,ov --precision fp32,int8 --out {out}" in md
    assert "smoke" in md.splitlines()[0] and "default presets" not in md.splitlines()[0]
    assert f"report: {out}/summary.md" in cap.out


def test_xdeploy_run_exits_1_on_parity_failure_after_writing_the_report(tmp_path, capsys):
    # atol=rtol=0 and a cosine floor above 1 cannot be met by a different runtime: every check fails
    out = tmp_path / "latest"
    rc = main(["run", "--smoke", "--models", "vit", "--runners", "ort", "--precision", "fp32", "--skip",
               "roofline,bench,decode,scale", "--tolerance", "atol=0,rtol=0,cosine=2", "--out", str(out),
               "--artifacts", str(tmp_path / "art")])
    err = capsys.readouterr().err
    assert rc == 1 and "parity check(s) failed" in err and "vit tiny fp32 ort model/logits" in err
    md = (out / "summary.md").read_text()
    assert "**Parity: 1 check(s) FAIL**" in md and "**FAIL**" in md and "## Latency" not in md
    assert "first diverging node:" in md  # located by the layerwise finder
    assert main(["run", "--skip", "bench,profiling", "--out", str(out)]) == 2  # unknown phase: one-line error
    assert "unknown phase to skip 'profiling'" in capsys.readouterr().err


def test_report_never_replaces_a_directory_that_is_not_a_report(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    with pytest.raises(XDeployError, match="not an xdeploy report"):
        render_report([], tmp_path / "mine")
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "precious"
    (tmp_path / "f").write_text("x")
    with pytest.raises(XDeployError, match="not a directory"):
        render_report([], tmp_path / "f")
    render_report([], tmp_path / "empty")  # no records: still a valid, if short, report
    assert "- records: none" in (tmp_path / "empty" / "summary.md").read_text()
    render_report([], tmp_path / "empty")  # and an earlier report may be replaced
