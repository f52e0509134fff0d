"""studies/peers_generate.py: the generation peers on the trained tiny GPT converted to a Hugging Face checkpoint.

The main env has transformers (5.x) and xdeploy: the quick workload runs there with the transformers reference and
every xdeploy row (agreement on the trained model, the AIPerf/MLPerf metrics, records, the rendered table). The
other systems (optimum-intel, CTranslate2, onnxruntime-genai, openvino-genai) live in .venv-peers (`make
peers-env`; not built by `make test`): the full-system quick run is tested there when that env exists, with its
exports kept in the xdeploy cache folder (`_work`: a fresh machine exports them once, ~1 min in the main env and
~2-3 min in .venv-peers; later runs reuse them).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from xdeploy.core.errors import XDeployError
from xdeploy.core.fingerprint import bf16_native, fingerprint
from xdeploy.core.records import make_record, read_records
from xdeploy.reports.render import render_summary
from xdeploy.studies import peers_generate as pg

ROOT = Path(__file__).resolve().parents[1]
PEERS_PY = ROOT / ".venv-peers" / "bin" / "python"
# one generation per round (min_block_s 0): the test checks the study's machinery, not its figures
FAST = dict(min_rounds=7, max_seconds=0.5, attempts=1, threads=1, min_block_s=0.0)


def _work(env: str) -> Path:
    """Where the checkpoint and the exports stay between runs (xdeploy's cache folder): the exports of every row
    are keyed by the checkpoint (itself named by a hash of the trained weights) and xdeploy's by the exporter too,
    so a rerun measures what a fresh export would; exporting them all again would be most of each test's time."""
    from xdeploy.export.cache import cache_root

    return cache_root() / f"test-peers-generate-{env}"


@pytest.fixture(scope="module")
def main_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("peers-generate")
    # memory probes: their own test (one child process each); bandwidth: a fixed figure (measuring it takes 5 s)
    out = pg.run(tmp / "out", quick=True, workloads=[pg.QUICK[0].name], systems=["transformers", "xdeploy"],
                 work=_work("main"), memory=False,
                 log=lambda _m: None, bandwidth=(2e10, "fixed for the test"), **FAST)
    return tmp, read_records(out / "records.jsonl")  # read_records validates every record


def test_transformers_and_xdeploy_on_the_trained_tiny(main_run: tuple[Path, list[dict[str, Any]]]) -> None:
    tmp, recs = main_run
    rows = {(r["system"], r["config"]): r for r in recs}
    from xdeploy.studies.peers import rows_here  # one rule for both studies: bf16 rows only where the CPU has bf16

    want = {(s, c) for s, c, _, _ in rows_here((pg.REFERENCE, *pg.XDEPLOY), fingerprint())}
    assert set(rows) == want
    w = pg.QUICK[0]
    for (system, cfg), r in rows.items():
        assert r["error"] is None, (system, cfg, r["error"])
        assert r["workload"] == w.name and r["weights"] == "trained" and r["new_tokens"] == w.new_tokens
        assert r["threads"] == 1 and r["batch"] == 1 and r["prompt_len"] == w.prompt_len
        itl = r["itl_s"]
        assert 0 < itl["p50"] <= itl["p90"] <= itl["p99"], (system, cfg, itl)
        assert 0 < r["ttft_s"] < r["e2e_s"] and 0 < r["tpot_s"] < r["e2e_s"]
        assert r["output_tokens_per_s"] == pytest.approx(w.new_tokens / r["e2e_s"])
        assert r["decode_tokens_per_s"] == pytest.approx(1 / r["tpot_s"])
        assert r["roofline"]["pct"] > 0 and r["roofline"]["bytes_per_token"] > 0
        # the read probe timed in the row's own rounds (64 MiB with quick): its median bandwidth, and the share
        roof = r["roofline"]
        assert roof["bandwidth_in_rounds_bytes_per_s"] > 0 and "torch mv over 64 MiB" in roof["in_rounds_how"]
        assert roof["pct_in_rounds"] is None or 0 < roof["pct_in_rounds"] <= 100
        if roof["pct_in_rounds"] is not None:
            assert roof["pct_in_rounds"] == pytest.approx(
                100 * r["decode_tokens_per_s"] * roof["bytes_per_token"] / roof["bandwidth_in_rounds_bytes_per_s"])
        assert r["stability"]["rounds"] >= 7  # every system in the same >= 7 interleaved rounds
        if r["precision"] == "fp32":  # the same trained weights, the same greedy tokens, all of them
            assert (r["agreement_tokens"], r["agreement"]) == (w.new_tokens, 1.0), (system, cfg)
        assert (r["vs_hf"] is None) == (system == "transformers")
        assert r["vs_peer"] is None  # no peer system in this run
        # two instances of each system in the same rounds (the reference: one); the row's figures are their mean
        reps = r["stability"]["replicas"]
        assert reps["count"] == (1 if system == "transformers" else 2) == len(reps["round_median_s"])
        assert (reps["aa"] is None) == (system == "transformers")
        if reps["aa"]:
            assert reps["aa"]["low"] <= reps["aa"]["median"] <= reps["aa"]["high"]
            assert min(reps["round_median_s"]) <= r["e2e_s"] * 1.5 and r["e2e_s"] <= max(reps["round_median_s"]) * 1.5
    # one interleaved comparison per precision, the reference in each (its own figures from the fp32 one)
    assert all(r["stability"]["group"] == f"{r['precision']}-1" for r in recs)
    r = rows[("xdeploy", "ort fp32")]
    assert r["vs_hf"]["low"] <= r["vs_hf"]["median"] <= r["vs_hf"]["high"]
    summary = (tmp / "out" / "report" / "summary.md").read_text(encoding="utf-8")
    assert "## Generation peers" in summary and "### gpt-tiny-trained" in summary
    assert "| xdeploy | ort fp32 |" in summary and f"| {w.new_tokens}/{w.new_tokens} (100%) |" in summary
    assert ("no bf16 rows" in summary) != bf16_native(fingerprint())


def test_the_trained_tiny_speaks_readme_bytes(main_run: tuple[Path, list[dict[str, Any]]]) -> None:
    """The converted checkpoint is the trained model: transformers' greedy continuation of README bytes is mostly
    printable ASCII (a random model of 512 tokens would emit ids >= 128 half of the time)."""
    import transformers

    ckpt = next(p for p in _work("main").iterdir() if p.name.startswith("gpt-tiny-trained-"))
    m = transformers.GPT2LMHeadModel.from_pretrained(str(ckpt)).eval()
    ids = torch.tensor([pg.prompt_ids(pg.QUICK[0], 512)])
    with torch.inference_mode():
        out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                         eos_token_id=None, pad_token_id=511)[0, ids.shape[1]:].tolist()
    assert sum(32 <= t < 127 or t == 10 for t in out) >= 28, bytes(t for t in out if t < 256)


def test_memory_probe_runs_in_its_own_process(main_run: tuple[Path, list[dict[str, Any]]]) -> None:
    w = pg.QUICK[0]
    ckpt = next(p for p in _work("main").iterdir() if p.name.startswith("gpt-tiny-trained-"))
    ctx = pg._context(w, ckpt, _work("main"), 1)
    peak, err = pg.measure_memory(ctx, pg.XDEPLOY[0])
    assert err is None and peak is not None and 50 * 2**20 < peak < 4 * 2**30
    peak, err = pg.measure_memory(ctx, ("xdeploy", "ort int4", "onnxruntime", "int4"))
    assert peak is None and err and err.startswith("memory probe failed: "), err


def test_hf_state_dict_is_the_inverse_of_the_import() -> None:
    from safetensors.torch import load_file

    from xdeploy.models.gpt import PRESETS, state_dict_from_hf
    from xdeploy.models.registry import WEIGHTS_DIR

    ours = load_file(str(WEIGHTS_DIR / str(PRESETS["tiny"].weights)))
    hf = pg.hf_state_dict(ours)
    assert hf["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)  # Conv1D: (in, out)
    back = state_dict_from_hf(hf, PRESETS["tiny"])
    assert set(back) == set(ours) and all(torch.equal(back[k], ours[k]) for k in ours)
    with pytest.raises(XDeployError, match="no GPT-2 counterpart"):
        pg.hf_state_dict({"layers.0.attn.rotary.weight": torch.zeros(2)})


def test_metrics_follow_the_aiperf_definitions() -> None:
    # tokens at 10 ms, then every 2 ms but one 8 ms gap; the call ends 1 ms after the last token
    times = [0.010, 0.012, 0.014, 0.022, 0.024]
    m = pg.trace_metrics([pg.Trace([1, 2, 3, 4, 5], times, 0.025)] * 3)
    assert m["ttft_s"] == pytest.approx(0.010)
    assert m["tpot_s"] == pytest.approx((0.025 - 0.010) / 4)  # (e2e - TTFT) / (output tokens - 1)
    itl = m["itl_s"]  # gaps 2, 2, 8, 2 ms in each of three generations: a quarter of them are 8 ms
    assert itl["p50"] == pytest.approx(0.002) and itl["p90"] == pytest.approx(0.008) == itl["p99"]
    with pytest.raises(XDeployError, match="same number"):
        pg.trace_metrics([pg.Trace([1, 2], [0.1, 0.2], 0.2), pg.Trace([1], [0.1], 0.1)])
    assert pg.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (2, 0.5)  # matching tokens before the first divergence
    assert pg.agreement([1, 2], [1, 2]) == (2, 1.0)


def _record(**changes: Any) -> dict[str, Any]:
    good = dict(workload="w", model="gpt", weights="trained", checkpoint="c", batch=1, prompt_len=4, new_tokens=8,
                system="ctranslate2", config="int8", runtime="ctranslate2", precision="int8", threads=2,
                ttft_s=0.01, tpot_s=0.002, e2e_s=0.024, itl_s={"p50": 0.002, "p90": 0.003, "p99": 0.004},
                output_tokens_per_s=333.0, decode_tokens_per_s=500.0, agreement_tokens=8, agreement=1.0,
                peak_rss_bytes=3e8, roofline=None, vs_hf={"median": 2.0, "low": 1.9, "high": 2.1, "stable": True,
                                                          "wide": False, "cause": None},
                vs_peer=None, stability={"stable": True, "rounds": 7, "rel_iqr": 0.01}, error=None, versions={})
    return make_record("peers_generate", {"cpu_model": "x", "isa": []}, **(good | changes))


def test_record_contract_and_failed_rows_render() -> None:
    rec = _record()
    with pytest.raises(XDeployError, match="not ordered"):
        _record(itl_s={"p50": 0.003, "p90": 0.002, "p99": 0.004})
    with pytest.raises(XDeployError, match="unexpected"):
        _record(speedup=2.0)
    failed = _record(config="float32", precision="fp32", error="RuntimeError: boom", **pg._empty())
    unstable = _record(system="xdeploy", config="ort int8 dynamic", vs_peer={
        "peer": "ctranslate2 int8", "median": 1.3, "low": 1.2, "high": 1.4, "stable": False, "wide": False})
    tie = _record(system="xdeploy", config="ov int8", workload="w2", vs_peer={
        "peer": "ctranslate2 int8", "median": 1.04, "low": 0.98, "high": 1.09, "stable": True, "wide": False,
        "instance_spread": 0.062, "verdict": "tie"})
    text = render_summary([rec, failed, unstable, tie], {"title": "t"}, [])
    assert "| fp32 | ctranslate2 | float32 | **failed**: RuntimeError: boom |" in text
    assert "2.00× (1.90–2.10)" in text and "| 8/8 (100%) |" in text
    assert "unstable" in text and "1.30×" not in text  # an unstable comparison has no figure
    assert "1.04× (0.98–1.09) vs ctranslate2 int8: **tie** (instance spread ±6.2%)" in text


def test_a_row_above_the_read_peak_remeasures_it_and_never_shows_over_100_percent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import xdeploy.studies.decode_bench as db

    logged: list[str] = []
    peak = (2e10, "fixed")
    assert pg._peak_for(peak, [1.5e10, 1.9e10], logged.append) == peak and not logged  # below: kept, not re-measured
    monkeypatch.setattr(db, "read_bandwidth", lambda: (2.5e10, "again"))  # the host quieter when measured again
    assert pg._peak_for(peak, [2.2e10], logged.append) == (2.5e10, "again (re-measured after the timing)")
    assert len(logged) == 1 and "22.0 GB/s, above the read peak 20.0 GB/s" in logged[0]
    monkeypatch.setattr(db, "read_bandwidth", lambda: (1.8e10, "lower"))  # a lower figure never replaces the peak
    assert pg._peak_for(peak, [2.2e10], logged.append) == peak and len(logged) == 3  # both retries spent
    roof = {"bytes_per_token": 5e8, "bandwidth_bytes_per_s": 2e10, "bandwidth_how": "fixed",
            "roofline_tokens_per_s": 40.0, "assumption": "a"}
    text = render_summary([_record(roofline=roof | {"pct": 91.0}),
                           _record(config="float32", precision="fp32", roofline=roof | {"pct": None})],
                          {"title": "t"}, [])
    assert "| 91% |" in text and "| – (above the measured read peak) |" in text
    rounds = {"bandwidth_in_rounds_bytes_per_s": 1.5e10, "in_rounds_how": "probe"}
    text = render_summary([_record(roofline=roof | {"pct": 60.0} | rounds | {"pct_in_rounds": 80.0}),
                           _record(config="float32", precision="fp32",
                                   roofline=roof | {"pct": 70.0} | rounds | {"pct_in_rounds": None})],
                          {"title": "t"}, [])
    assert "| 60% / 80% in rounds |" in text and "| 70% / – in rounds (above the probe: cache) |" in text


def test_bad_selection_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(XDeployError, match="must include transformers"):
        pg.run(tmp_path, quick=True, systems=["xdeploy"], work=tmp_path)
    with pytest.raises(XDeployError, match="unknown workload"):
        pg.run(tmp_path, quick=True, workloads=["gpt-huge"], work=tmp_path)
    with pytest.raises(XDeployError, match="min_rounds must be >= 7"):
        pg.run(tmp_path, quick=True, min_rounds=3, work=tmp_path)


@pytest.mark.skipif(not PEERS_PY.exists(), reason="needs .venv-peers (make peers-env); not built by make test")
def test_every_system_in_the_peers_env(tmp_path: Path) -> None:
    from xdeploy.studies.peers import rows_here

    work = _work("peers")
    cmd = [str(PEERS_PY), "-m", "xdeploy.studies.peers_generate", "--quick", "--out", str(tmp_path / "out"),
           "--work", str(work), "--max-seconds", "0.5", "--attempts", "1", "--threads", "1", "--no-memory",
           "--min-block-s", "0"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    assert [w.name for w in pg.QUICK] == list(dict.fromkeys(r["workload"] for r in recs))
    want = {(s, c) for s, c, _, _ in rows_here(pg.all_rows(), fingerprint())}
    # the encoder-decoder: no decoder-only route and no fp16-weight rows (decoders only); two peers without an
    # encoder-decoder pipeline, in their own words
    s2s = {(r["system"], r["config"]): r for r in recs if r["workload"] == pg.QUICK[1].name}
    assert set(s2s) == {(s, c) for s, c in want if "model-graph prefill" not in c and "fp16 weights" not in c
                        and "int8-weight prefill" not in c and "bf16 prompt" not in c}
    refusals = {"onnxruntime-genai": "runs no attention encoder-decoder but Whisper; its model builder",
                "openvino-genai": "LLMPipeline (decoder-only) refuses optimum-intel's encoder-decoder IR"}
    for (system, cfg), r in s2s.items():
        if system in refusals:
            assert refusals[system] in r["error"], (system, r["error"])
            continue
        assert r["error"] is None, (system, cfg, r["error"])  # the Marian checkpoint loads and runs everywhere
        assert r["model"] == "transformer" and r["output_tokens_per_s"] > 0
        if system == "xdeploy":
            assert s2s[tuple(r["vs_peer"]["peer"].split(" ", 1))]["precision"] == r["precision"]
    rows = {(r["system"], r["config"]): r for r in recs if r["workload"] == pg.QUICK[0].name}
    assert set(rows) == want
    for (system, cfg), r in rows.items():
        assert r["error"] is None, (system, cfg, r["error"])  # every peer installs, loads and runs here
        assert 0 < r["itl_s"]["p50"] <= r["itl_s"]["p90"] <= r["itl_s"]["p99"]
        if r["precision"] == "fp32":  # every fp32 system decodes the trained weights to the same tokens
            assert r["agreement"] == 1.0, (system, cfg, r["agreement_tokens"])
        if system == "xdeploy":  # each xdeploy precision has a peer row of that precision
            v = r["vs_peer"]
            assert rows[tuple(v["peer"].split(" ", 1))]["precision"] == r["precision"]
            # the verdict follows the interval and the tie band the two rows' instance spread makes
            band = 1 + v["instance_spread"]
            assert v["instance_spread"] >= 0 and v["verdict"] == ("ahead" if v["low"] > band else "behind"
                                                                  if v["high"] < 1 / band else "tie")
    assert recs[0]["versions"]["ctranslate2"] == "4.8.5" and recs[0]["versions"]["openvino-genai"]
    for system in ("optimum-intel", "ctranslate2", "onnxruntime-genai", "openvino-genai"):
        assert f"| {system} |" in p.stdout
    # a stable comparison prints its verdict and band (an unstable one, on a loaded host, prints no figure at all)
    if any(r["vs_peer"] and r["vs_peer"]["stable"] for r in recs):
        assert "(instance spread ±" in p.stdout
