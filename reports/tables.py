"""The tables of the measured records, one row function each: summary.md renders them with `.markdown()` and
the commands print the same rows with `.rich()` (reports/text.py `TextTable`), so a figure reads the same in the
terminal and in the report.

    from xdeploy.reports.tables import latency_table
    console.print(latency_table(records).rich())      # `xdeploy bench`
    lines.append(latency_table(records).markdown())   # summary.md

Cells are formatted only by reports/text.py; the records come from bench/ and serve/ as numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from xdeploy.core.records import Best, config_key, identity, is_baseline, speedups, stability_block, unstable

from .text import (
    NONE,
    RANGE,
    TextTable,
    fmt_bytes,
    fmt_mib,
    fmt_ms,
    fmt_num,
    fmt_rate,
    fmt_s,
    fmt_share,
    pct_of_peak,
    record_speedup,
    record_speedup_of,
)

NOISY = 1.5  # p90 / p50 above this: the timing was disturbed (shared machine); speedups get a dagger
_LABELS = ("model", "graph", "runner", "artifact", "compute", "best runner", "lowering", "mode", "measure",
           "precision", "achieved by", "server", "kernel", "parity")  # left-aligned in the terminal


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "",
           caption: str | None = None) -> TextTable:
    return TextTable(tuple(header), rows, title=title, caption=caption, left=_LABELS)


def model_label(model: str, preset: str | None) -> str:
    return f"{model} {preset}" if preset else model


def _seq(r: Mapping[str, Any]) -> Any:
    return r.get("seq") or NONE


# ------------------------------------------------------------------------------------------- latency ----

def is_noisy(r: Mapping[str, Any]) -> bool:
    lat = r["latency_s"]
    return lat["p50"] > 0 and lat["p90"] / lat["p50"] > NOISY


def noisy_ids(lat: Sequence[Mapping[str, Any]]) -> set[tuple[Any, ...]]:
    """Identities whose speed-up gets the † (p90 > NOISY × p50 in the row or its PyTorch baseline). Only for
    older records: interleaved ones carry their own stability verdict."""
    base: dict[tuple[Any, ...], Mapping[str, Any]] = {}
    for r in lat:
        if is_baseline(r):
            base.setdefault(config_key(r), r)
    return {identity(r) for r in lat if stability_block(r) is None and (
        is_noisy(r) or (config_key(r) in base and is_noisy(base[config_key(r)])))}


def _sorted_latency(lat: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted(lat, key=lambda r: (r["model"], r["graph"], r["batch"], r.get("seq") or 0, r["runner"],
                                      r["artifact_precision"]))


def latency_table(lat: Sequence[Mapping[str, Any]], *, baseline: str = "torch", title: str = "",
                  caption: str | None = None) -> TextTable:
    """Per latency record: percentiles, throughput, the paired speed-up over `baseline` (core/records.py
    `speedups` / `unstable`), achieved FLOP/s and % of the GEMM peak; a parity column where the records carry
    a verdict (`xdeploy bench --parity`)."""
    sp, unst, noisy = speedups(lat, baseline), unstable(lat), noisy_ids(lat)
    parity = any(r.get("parity_passed") is not None for r in lat)
    rows = []
    for r in _sorted_latency(lat):
        L = r["latency_s"]
        row = [model_label(r["model"], r.get("preset")), r["graph"], r["runner"], r["artifact_precision"],
               r["precision"], r["batch"], _seq(r), fmt_s(L["p50"]), fmt_s(L["p90"]), fmt_s(L["p99"]),
               fmt_s(L["mean"]), fmt_s(L["std"]), r["iterations"], fmt_num(r["items_per_s"], ".4g"),
               fmt_rate(r.get("tokens_per_s")), record_speedup(r, sp, unst) + ("†" if identity(r) in noisy else ""),
               fmt_rate(r["achieved_flops"], "FLOP/s"), pct_of_peak(r.get("pct_of_peak"), 1)]
        if parity:
            row.append({True: "pass", False: "FAIL", None: NONE}[r.get("parity_passed")])
        rows.append(row)
    header = ["model", "graph", "runner", "artifact", "compute", "batch", "seq", "p50", "p90", "p99", "mean", "std",
              "iters", "items/s", "tokens/s", "speedup" if baseline == "torch" else f"speedup vs {baseline}",
              "achieved", "% of peak"] + (["parity"] if parity else [])
    return _table(header, rows, title, caption)


def memory_table(lat: Sequence[Mapping[str, Any]], *, title: str = "") -> TextTable:
    """Per latency record: the memory phases of its isolated child (bench/memory.py)."""
    rows = [(model_label(r["model"], r.get("preset")), r["graph"], r["runner"], r["artifact_precision"],
             r["batch"], _seq(r), fmt_bytes(m["weights_bytes"]), fmt_bytes(m["load_peak_bytes"]),
             fmt_bytes(m["activations_bytes"]), fmt_bytes(m["peak_rss_bytes"]), fmt_bytes(m.get("device_bytes")))
            for r in _sorted_latency(lat) if (m := r.get("memory"))]
    return _table(["model", "graph", "runner", "artifact", "batch", "seq", "weights", "load peak", "activations",
                   "peak RSS", "device"], rows, title)


def fastest_table(picks: Sequence[Best], lat: Sequence[Mapping[str, Any]], *, title: str = "") -> TextTable:
    """Per configuration: the fastest record (core/records.py `best`) and its speed-up over PyTorch eager fp32."""
    sp, unst, noisy = speedups(lat), unstable(lat), noisy_ids(lat)
    rows = [(r["model"], r["graph"], r["batch"], _seq(r), f"{r['runner']} {r['artifact_precision']}",
             fmt_s(r["latency_s"]["p50"]), record_speedup(r, sp, unst) + ("†" if identity(r) in noisy else ""))
            for r in (b.record for b in picks)]
    return _table(["model", "graph", "batch", "seq", "best runner", "p50", "speedup vs eager"], rows, title)


# ------------------------------------------------------------------------------------------ roofline ----

def roofline_table(peaks: Sequence[Mapping[str, Any]], *, title: str = "", caption: str | None = None) -> TextTable:
    """Roofline records (or bench/roofline.py `peak_rows`): the best measured value per measure and precision."""
    rows = [(r["measure"], r.get("precision") or NONE, fmt_rate(r["value"], r["unit"]), r["path"])
            for r in sorted(peaks, key=lambda r: (r["measure"], r.get("precision") or ""))]
    return _table(["measure", "precision", "peak", "achieved by"], rows, title, caption)


# --------------------------------------------------------------------------------------------- scale ----

def scale_fits(scale: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, lowering): bench/scale.py's summary (measured time/memory exponents over the upper T range,
    the analytic FLOPs exponent over the same T, the crossover T* = 2d + d_ff), plus p50 at the largest T."""
    from xdeploy.bench.scale import summarize

    fits = summarize(scale) if scale else []
    for f in fits:
        top = max((r for r in scale if r["model"] == f["model"] and r["lowering"] == f["lowering"]),
                  key=lambda r: r["T"])
        f["p50_at_max_T"] = top["latency_s"]["p50"]
    return sorted(fits, key=lambda f: (f["model"], f["lowering"]))


def scale_fits_table(scale: Sequence[Mapping[str, Any]], *, title: str = "") -> TextTable:
    rows = [(f["model"], f["lowering"], f"{f['T_range'][0]}{RANGE}{f['T_range'][1]}", f["max_T"],
             fmt_num(f["time_exponent"], ".2f"), fmt_num(f["flops_exponent"], ".2f"),
             fmt_num(f["memory_exponent"], ".2f"), fmt_s(f["p50_at_max_T"]), f"{f['crossover_T']:.0f}")
            for f in scale_fits(scale)]
    return _table(["model", "lowering", "fitted over T", "max T", "latency exp.", "FLOPs exp.", "memory exp.",
                   "p50 at max T", "crossover T*"], rows, title)


def scale_grid_table(scale: Sequence[Mapping[str, Any]], *, caption: str | None = None) -> TextTable:
    """One model's sweep: p50 ms / activation MiB per T and lowering, beside the analytic FLOPs, attention
    share and score bytes per layer (B·h·T²·4)."""
    from xdeploy.bench.scale import LOWERINGS, analytic

    lows = sorted({r["lowering"] for r in scale}, key=list(LOWERINGS).index)
    by = {(r["lowering"], r["T"]): r for r in scale}
    r0 = scale[0]
    rows = []
    for T in sorted({r["T"] for r in scale}):
        an = analytic(r0["d_model"], 4 * r0["d_model"], r0["n_heads"], r0["n_layers"], T, r0["batch"])
        cells = [NONE if (r := by.get((low, T))) is None else
                 f"{fmt_ms(r['latency_s']['p50'], 1)} / {fmt_mib((r['memory'] or {}).get('activations_bytes'))}"
                 for low in lows]
        rows.append((T, *cells, f"{an['flops'] / 1e9:.2f}", fmt_share(an["attn_share"]), fmt_mib(an["score_bytes"])))
    return _table(["T", *lows, "GFLOP (analytic)", "attn share", "scores MiB (fp32)"], rows,
                  f"attention scaling: {r0['model']} d={r0['d_model']} h={r0['n_heads']} layers={r0['n_layers']} "
                  f"batch={r0['batch']} — p50 ms / activation MiB", caption)


def profile_table(prof: Sequence[Mapping[str, Any]], *, top_ops: int = 0, title: str = "") -> TextTable:
    """Share of kernel time per op class (onnxruntime profiler); `top_ops` adds the slowest ops of each."""
    rows = []
    for r in sorted(prof, key=lambda r: (r["model"], r["lowering"], r["T"])):
        row = [r["model"], r["lowering"], r["T"], r["batch"],
               *(fmt_share(r["shares"][k]) for k in ("attention", "matmul", "normalization", "other")),
               fmt_s(r["total_s"])]
        if top_ops:
            row.append(", ".join(f"{k} {fmt_s(v)}" for k, v in list(r["op_times_s"].items())[:top_ops]))
        rows.append(row)
    return _table(["model", "lowering", "T", "batch", "attention", "matmul", "normalization", "other",
                   "kernel time / call"] + (["top ops"] if top_ops else []), rows, title)


def sweep_table(sweep: Sequence[Mapping[str, Any]]) -> TextTable:
    """A config sweep (ViT: tokens vs patch size), measured."""
    rows = [(r["lowering"], r["patch_size"], r["T"], fmt_ms(r["latency_s"]["p50"], 1),
             fmt_mib((r["memory"] or {}).get("activations_bytes")), fmt_mib(r["score_bytes"])) for r in sweep]
    return _table(["kernel", "patch", "tokens", "p50 ms", "activation MiB", "scores MiB/layer (fp32, analytic)"],
                  rows, f"{sweep[0]['model']} (config sweep): tokens vs patch size — measured (torch, batch 1)")


def vit_memory_table() -> TextTable:
    """bench/scale.py `vit_table`: ViT-B attention memory vs patch size, analytic."""
    from xdeploy.bench.scale import vit_table

    rows = [(f"{r['patch']:.0f}", f"{r['tokens']:.0f}", f"{r['entries_per_head']:.3g}",
             fmt_bytes(r["score_bytes_per_layer"]), fmt_share(r["attn_share"])) for r in vit_table()]
    return _table(["patch", "tokens N", "score entries / head (N²)", "fp32 scores / layer", "attn FLOP share"], rows,
                  "ViT attention memory vs patch size (analytic; 224×224, 12 heads): p=1 attends over raw pixels, "
                  "R⁴ score entries per head")


# -------------------------------------------------------------------------------------------- decode ----

def decode_stats(r: Mapping[str, Any]) -> dict[str, float | None]:
    steps = np.asarray(r["step_s"], dtype=np.float64)
    if steps.size == 0:
        return {"per_token_p50": None, "per_token_p90": None}
    p50, p90 = np.percentile(steps, [50, 90])
    return {"per_token_p50": float(p50), "per_token_p90": float(p90)}


def decode_table(dec: Sequence[Mapping[str, Any]], *, title: str = "") -> TextTable:
    """Per decode record: TTFT, per-token latency, tokens/s, the paired speed-up over PyTorch, agreement."""
    rows = []
    for r in sorted(dec, key=lambda r: (r["model"], r["runner"], r["artifact_precision"], r["mode"])):
        st = decode_stats(r)
        rows.append((model_label(r["model"], r.get("preset")), r["runner"], r["artifact_precision"], r["mode"],
                     r["batch"], r["prompt_len"], r["new_tokens"], fmt_s(r["ttft_s"]), fmt_s(st["per_token_p50"]),
                     fmt_s(st["per_token_p90"]), f"{r['tokens_per_s']:.1f}", record_speedup_of(r),
                     NONE if r.get("agreement") is None else f"{100 * r['agreement']:.1f}%"))
    return _table(["model", "runner", "artifact", "mode", "batch", "prompt", "new", "TTFT", "per-token p50",
                   "per-token p90", "tokens/s", "vs torch", "agreement"], rows, title)


# ------------------------------------------------------------------------------------------ loadtest ----

def loadtest_table(records: Sequence[Mapping[str, Any]]) -> TextTable:
    """serve/loadtest.py's records: one row per concurrency level (local: the in-process Embedder baseline)."""
    last = records[-1]
    rows = [("local" if r["protocol"] == "none" else r["protocol"], r["concurrency"], r["requests"], r["errors"],
             f"{r['requests_per_s']:.1f}", f"{r['sentences_per_s']:.1f}",
             *(fmt_ms(r["latency_s"][k], 1) for k in ("p50", "p90", "p99"))) for r in records]
    return _table(["server", "conc", "req", "errors", "req/s", "sent/s", "p50 ms", "p90 ms", "p99 ms"], rows,
                  f"loadtest {last['target']} model {last['model']!r}, {last['batch']} sentences/request")
