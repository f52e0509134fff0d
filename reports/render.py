"""The report renderer: benchmark records -> a report directory a person can read and a machine can diff.

    from xdeploy.reports.render import render_report
    render_report(records, "reports/latest", meta={"command": "xdeploy run", "presets": "quick"})

writes, atomically (a temp dir renamed into place, so a crash leaves the previous report intact):

    summary.md      machine fingerprint + library versions, parity, latency percentiles, throughput, peak
                    memory, speedup vs PyTorch eager fp32, % of the measured roofline, decode tokens/s,
                    attention-scaling exponents, and the plots below
    results.csv     one row per record, nested fields flattened (`latency_s.p50`, `memory.peak_rss_bytes`, ...)
    results.json    {"schema": "xdeploy-report", "version": 1, "meta": ..., "records": [...]} (`report compare`)
    plots/*.png     latency vs T (log-log, fitted slope per runner), peak memory vs T, throughput vs batch,
                    decode per-token latency vs context length, speed vs error per precision

Records are those of core/records.py (every kind declared there, built by `make_record`, checked by
`validate_record`); kinds without a section of their own (`SECTIONS`) are listed under "Other records".
Speed-ups and the fastest record per configuration are core/records.py's `speedups` / `unstable` / `best`,
keyed by record identity. Numbers stay floats until reports/text.py formats them (reports/tables.py: the
tables summary.md shares with the commands' terminal output).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError
from xdeploy.core.fingerprint import machine_class
from xdeploy.core.fsutil import atomic_dir
from xdeploy.core.journal import JOURNAL_NAME
from xdeploy.core.records import (
    Best,
    best,
    identity,
    is_baseline,
    speedup_wide,
    speedups,
    stability_block,
    unstable,
    upgrade_legacy,
    validate_record,
)

from .tables import (
    NOISY,
    decode_table,
    fastest_table,
    is_noisy,
    latency_table,
    memory_table,
    model_label,
    noisy_ids,
    profile_table,
    roofline_table,
    scale_fits,
    scale_fits_table,
)
from .text import (
    NONE,
    TIMES,
    fmt_bytes,
    fmt_num,
    fmt_s,
    markdown_table,
    record_speedup,
    speedup,
    speedup_of,
    unstable_text,
)

REPORT_SCHEMA = "xdeploy-report"
REPORT_VERSION = 1

PLOTS = ("latency_vs_T.png", "memory_vs_T.png", "throughput_vs_batch.png", "decode_latency_vs_context.png",
         "speed_vs_error.png")
# Kinds with a section of their own in summary.md; records of the other kinds are listed under "Other records".
SECTIONS = ("parity", "latency", "roofline", "decode", "scale", "profile", "peers", "peers_generate")


# ------------------------------------------------------------------------------------------ records ----

def fitted_exponent(ts: Sequence[float], ys: Sequence[float]) -> float | None:
    """The exponent `xdeploy scale` reports: log-log slope over the upper range of T (bench/scale.py)."""
    from xdeploy.bench.scale import fit_exponent, upper_range

    upper = set(upper_range([int(t) for t in ts]))
    sel = [(t, y) for t, y in zip(ts, ys) if int(t) in upper]
    return fit_exponent([t for t, _ in sel], [y for _, y in sel])


def stability_summary(records: Sequence[Mapping[str, Any]]) -> str | None:
    """One line for the top of the summary: how many paired speed-ups reached the target width (their 95%
    interval within +-target of the median), how many stayed wide, and how many configurations were unstable
    and why."""
    lat = [r for r in records if r.get("kind") == "latency" and stability_block(r) is not None]
    dec = [r for r in records if r.get("kind") == "decode" and stability_block(r) is not None]
    if not lat and not dec:
        return None
    configs = _by(lat, "model", "graph", "batch", "seq") | {("decode",) + k: v for k, v in
                                                            _by(dec, "model").items()}
    bad = {k: v for k, v in configs.items() if any(not stability_block(r)["stable"] for r in v)}
    figures = [r for r in lat + dec if stability_block(r).get("speedup")]  # every paired comparison (not the baseline)
    wide = [r for r in figures if speedup_wide(r)]
    within = [r for r in figures if stability_block(r)["stable"] and not speedup_wide(r)]
    target = max((float(stability_block(r).get("target") or 0.10) for r in figures), default=0.10)
    loads = [(stability_block(r)["load"] or {}) for r in lat + dec]
    other = max((ld.get("other_cores") or 0.0 for ld in loads), default=0.0)
    la = max((ld.get("loadavg_1m") or 0.0 for ld in loads), default=0.0)
    machine = (f"other processes used up to {other:.1f} cores during a measurement, 1-min load average up to "
               f"{la:.1f}")
    reached = (f"{len(within)} of {len(figures)} comparisons within ±{target:.0%} of their median"
               + (f", {len(wide)} wide (printed with their interval and \"wide\")" if wide else ""))
    if not bad:
        return (f"**Speed-ups: {reached}**; all {len(configs)} configurations stable (interleaved sequential rounds, "
                f"paired ratios; {machine}).")
    causes: dict[str, int] = {}
    for v in bad.values():
        c = next(stability_block(r)["cause"] for r in v if not stability_block(r)["stable"])
        causes[c] = causes.get(c, 0) + 1
    why = ", ".join(f"{n} {c}" for c, n in sorted(causes.items()))
    names = "; ".join(" ".join(str(x) for x in k if x is not None) for k in list(bad)[:6])
    return (f"**Speed-ups: {len(bad)} of {len(configs)} configurations unstable ({why})** — shown as "
            f"\"unstable (cause)\" instead of a figure after re-measuring ({names}{'; …' if len(bad) > 6 else ''}); "
            f"{reached}; {machine}. \"load\": other processes used more than the threshold while the rounds were "
            "dispersed, an interval stayed wide or the CPU was oversubscribed; \"noise\": the rounds were "
            "dispersed on an otherwise idle machine (docs/benchmarks.md).")


# ------------------------------------------------------------------------------------------- plots ----

def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _panels(n: int, width: float = 6.2) -> tuple[Any, Any]:
    """(figure, 2-D array of axes) for n panels, two per row, each `width` x 4.4 inches."""
    cols = min(n, 2)
    rows = (n + cols - 1) // cols
    return _plt().subplots(rows, cols, figsize=(width * cols, 4.4 * rows), squeeze=False)


def _plain_log2_x(ax: Any, ticks: Sequence[int]) -> None:
    """Log2 x axis labelled with the plain values measured (64, 128, ... rather than 2^6, 2^7)."""
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(set(ticks))))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(ScalarFormatter())


def _save(fig: Any, axes: Any, used: int, path: Path) -> None:
    """Hide the panels past the first `used` (the grid's last row may be half empty), lay out, write, close."""
    for ax in list(axes.flat)[used:]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)


def _by(records: Iterable[Mapping[str, Any]], *keys: str) -> dict[tuple, list[Mapping[str, Any]]]:
    out: dict[tuple, list[Mapping[str, Any]]] = defaultdict(list)
    for r in records:
        out[tuple(r.get(k) for k in keys)].append(r)
    return dict(out)


def plot_scale(scale: list[Mapping[str, Any]], path: Path, *, memory: bool) -> bool:
    """Latency (or activation memory) vs T, log-log, one line per lowering, one panel per model."""
    pts = [r for r in scale if not memory or (r.get("memory") or {}).get("activations_bytes")]
    if not pts:
        return False
    models = sorted({r["model"] for r in pts})
    fig, axes = _panels(len(models))
    for ax, model in zip(axes.flat, models):
        mine = [r for r in pts if r["model"] == model]
        for (lowering, batch), rs in sorted(_by(mine, "lowering", "batch").items(), key=lambda kv: str(kv[0])):
            rs = sorted(rs, key=lambda r: r["T"])
            t = [r["T"] for r in rs]
            y = [r["memory"]["activations_bytes"] / 2**20 if memory else r["latency_s"]["p50"] * 1e3 for r in rs]
            slope = fitted_exponent(t, y)
            label = f"{lowering}" + (f" b{batch}" if batch != 1 else "")
            if slope is not None:
                label += f" (slope {slope:.2f}" + (f", {len(t)} points only)" if len(t) < 3 else ")")
            ax.plot(t, y, marker="o", ms=3.5, label=label)
        _plain_log2_x(ax, [r["T"] for r in mine])
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T (tokens)")
        ax.set_ylabel("activations (MiB of peak RSS above the loaded model)" if memory else "latency p50 (ms)",
                      fontsize=9 if memory else 10)
        ax.set_title(f"{model} (d={mine[0]['d_model']}, {mine[0]['n_layers']} layers): "
                     + ("activation memory vs T" if memory else "latency vs T"))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7.5, title="lowering (log-log slope over the top 3 T)", title_fontsize=7.5)
        ax.tick_params(axis="x", labelsize=8)
    _save(fig, axes, len(models), path)
    return True


def plot_throughput(lat: list[Mapping[str, Any]], path: Path) -> bool:
    """items/s vs batch per (runner, artifact precision), one panel per (model, seq)."""
    groups = _by(lat, "model", "graph", "seq")
    panels = {k: v for k, v in groups.items() if len({r["batch"] for r in v}) >= 2}
    if not panels:
        return False
    fig, axes = _panels(len(panels), width=7.4)
    for ax, ((model, graph, seq), rs) in zip(axes.flat, sorted(panels.items(), key=lambda kv: str(kv[0]))):
        for (runner, ap), g in sorted(_by(rs, "runner", "artifact_precision").items()):
            g = sorted(g, key=lambda r: r["batch"])
            ax.plot([r["batch"] for r in g], [r["items_per_s"] for r in g], marker="o", ms=3.5,
                    label=f"{runner} {ap}")
        _plain_log2_x(ax, [r["batch"] for r in rs])
        ax.set_xlabel("batch size")
        ax.set_ylabel("throughput (sequences/s)")
        ax.set_title(f"{model_label(model, rs[0].get('preset'))} {graph}" + (f", seq {seq}" if seq else "")
                     + ": throughput vs batch")
        ax.grid(True, which="both", alpha=0.3)
        # outside the axes: inside it hides lines whatever the placement
        ax.legend(fontsize=7.5, title="runner artifact", title_fontsize=7.5, loc="center left",
                  bbox_to_anchor=(1.01, 0.5))
    _save(fig, axes, len(panels), path)
    return True


def plot_decode(dec: list[Mapping[str, Any]], path: Path) -> bool:
    """Per-token latency of each decode step vs the context length it attended over."""
    dec = [r for r in dec if r["step_s"]]
    if not dec:
        return False
    models = sorted({r["model"] for r in dec})
    fig, axes = _panels(len(models))
    for ax, model in zip(axes.flat, models):
        for r in sorted((r for r in dec if r["model"] == model), key=lambda r: (r["runner"], r["mode"])):
            # step i (0-based) feeds token prompt_len+1+i and attends over prompt_len+1+i cached positions
            ctx = [r["prompt_len"] + 1 + i for i in range(len(r["step_s"]))]
            ms = np.asarray(r["step_s"], dtype=np.float64) * 1e3
            # single steps are disturbed by anything else running: draw them faintly, and a running median
            # (window ~n/16, at least 5 steps) as the line to read
            w = max(5, len(ms) // 16) | 1
            med = [float(np.median(ms[max(0, i - w // 2): i + w // 2 + 1])) for i in range(len(ms))]
            label = f"{r['runner']} {r['artifact_precision']} {r['mode']} ({r['tokens_per_s']:.0f} tok/s)"
            line, = ax.plot(ctx, med, lw=1.3, label=label)
            ax.scatter(ctx, ms, s=3, alpha=0.25, color=line.get_color())
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("per-token latency (ms; line: running median)")
        ax.set_yscale("log")
        ax.set_title(f"{model}: decode step latency vs context (batch {dec[0]['batch']})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7.5, title="runner precision mode (tokens/s)", title_fontsize=7.5)
    _save(fig, axes, len(models), path)
    return True


def speed_error_points(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, runner, artifact precision): worst parity error (max over outputs) and the speedup vs
    eager fp32 at the model's reference latency config (the (batch, seq) with a baseline and most runners)."""
    lat = [r for r in records if r.get("kind") == "latency" and r.get("graph") == "model"]
    sp = speedups(lat)
    par = _by([r for r in records if r.get("kind") == "parity"], "model", "runner", "artifact_precision")
    out = []
    # a model without parity records has no error axis: no points (not a lone reference at an invented error)
    for model in sorted({r["model"] for r in lat} & {k[0] for k in par}):
        cfgs = _by([r for r in lat if r["model"] == model and identity(r) in sp], "batch", "seq")
        if not cfgs:
            continue
        # prefer a config whose eager baseline was timed undisturbed, then the most runners, then the most work
        (batch, seq), rs = max(cfgs.items(), key=lambda kv: (
            not any(is_baseline(r) and is_noisy(r) for r in kv[1]), len(kv[1]), (kv[0][1] or 0) * kv[0][0]))
        for r in rs:
            ps = par.get((model, r["runner"], r["artifact_precision"]))
            if not ps and is_baseline(r):
                err = 0.0  # the reference itself
            elif ps and all(p["max_abs"] is not None for p in ps):
                err = max(p["max_abs"] for p in ps)
            else:
                continue  # no parity, or outputs that could not be compared: no error to plot
            out.append({"model": model, "runner": r["runner"], "artifact_precision": r["artifact_precision"],
                        "batch": batch, "seq": seq, "max_abs": err, "speedup": sp[identity(r)],
                        "passed": all(p["passed"] for p in ps) if ps else True})
    return out


def plot_speed_error(points: list[dict[str, Any]], path: Path) -> bool:
    if not points:
        return False
    models = sorted({p["model"] for p in points})
    fig, axes = _panels(len(models))
    markers = {"fp32": "o", "fp16": "s", "int8": "^", "int8-dynamic": "v", "bf16": "D"}
    floor = 1e-8  # the fp32 reference has error 0: drawn on the axis floor of the log scale
    for ax, model in zip(axes.flat, models):
        ps = [p for p in points if p["model"] == model]
        for p in ps:
            x = max(p["max_abs"], floor)
            ax.scatter([x], [p["speedup"]], marker=markers.get(p["artifact_precision"], "x"), s=40,
                       color="tab:red" if not p["passed"] else None,
                       label=f"{p['runner']} {p['artifact_precision']}" + ("" if p["passed"] else " FAIL"))
            ref = " (reference)" if p["max_abs"] == 0 else ""
            ax.annotate(f"{p['runner']} {p['artifact_precision']}{ref}", (x, p["speedup"]), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
        ax.set_xscale("log")
        sps = [p["speedup"] for p in ps]
        if max(sps) / max(min(sps), 1e-12) > 20:
            from matplotlib.ticker import ScalarFormatter

            ax.set_yscale("log")  # a disturbed baseline can spread speedups over decades
            ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("max abs error vs PyTorch fp32 (worst output; log)")
        ax.set_ylabel("speedup vs PyTorch eager fp32 (×)")
        b, s = ps[0]["batch"], ps[0]["seq"]
        ax.set_title(f"{model}: speed vs error (batch {b}" + (f", seq {s})" if s else ")"))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, title="marker: o fp32, s fp16, ^ int8 (Q/DQ), v int8-dynamic", title_fontsize=7)
    _save(fig, axes, len(models), path)
    return True


# ------------------------------------------------------------------------------------------ summary ----

def _machine_section(fp: Mapping[str, Any] | None) -> list[str]:
    if not fp:
        return ["## Machine", "", "No fingerprint was recorded.", ""]
    th = fp.get("threads", {})
    lines = ["## Machine", "", f"- machine class: {machine_class(fp)} — every figure in this report is for this class",
             f"- CPU: {fp.get('cpu_model')} ({fp.get('arch', '?')}), {th.get('affinity_cpus', '?')} usable of "
             f"{fp.get('logical_cpus', '?')} logical CPUs" + (f"; GPU: {fp['gpu']}" if fp.get("gpu") else "; no GPU"),
             f"- ISA: {' '.join(fp.get('isa', [])) or NONE}",
             f"- memory: {fmt_bytes(fp.get('memory_bytes'))}; OS: {fp.get('os', '?')}; "
             f"Python {fp.get('python', '?')}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in sorted(fp.get("versions", {}).items())),
             "- threads: " + ", ".join(f"{k}={v}" for k, v in th.items())
             + ("; env " + " ".join(f"{k}={v}" for k, v in fp["env"].items()) if fp.get("env") else ""), ""]
    return lines


def _parity_section(par: list[Mapping[str, Any]]) -> list[str]:
    if not par:
        return []
    n_fail = sum(not p["passed"] for p in par)
    rows = [(model_label(p["model"], p.get("preset")), p["graph"], p["artifact_precision"], p["runner"],
             p["output"], fmt_num(p["max_abs"]), fmt_num(p["max_rel"]), fmt_num(p["cosine"], ".6f"),
             p["nonfinite"], fmt_num(None if p.get("top1") is None else 100 * p["top1"], ".1f"),
             "pass" if p["passed"] else f"**FAIL** {p.get('reason') or ''}"
             + (f"; first diverging node: {p['first_divergence']}" if p.get("first_divergence") else ""))
            for p in sorted(par, key=lambda p: (p["model"], p["graph"], p["artifact_precision"], p["runner"],
                                                p["output"]))]
    return ["## Parity vs PyTorch fp32", "",
            f"{len(par) - n_fail} of {len(par)} output checks pass"
            + (f"; **{n_fail} fail**." if n_fail else ".")
            + " Tolerances per artifact precision (models/spec.py): an output passes when every element is within "
              "atol + rtol·|ref| or its cosine similarity reaches the precision's floor; NaN/Inf always fails.", "",
            markdown_table(["model", "graph", "artifact", "runner", "output", "max abs", "max rel", "cosine", "NaN/Inf",
                    "top-1 %", "verdict"], rows), ""]


def _latency_section(lat: list[Mapping[str, Any]], picks: Sequence[Best]) -> list[str]:
    if not lat:
        return []
    out = ["## Latency and throughput", "",
           "Per-call latency over `iterations` timed calls after warm-up (seconds rendered as ms/µs); throughput "
           "= items (sequences/images) per second at the median. PyTorch eager fp32 and every runner × precision of "
           "one (model, batch, seq) are timed interleaved, in rounds with the order rotated; speedup = median of the "
           "paired ratios PyTorch round time / runner round time, with its 95% interval (rounds go on until it is "
           "within ±10% of the median or the run's time for it is spent; \"wide\" after a figure whose interval "
           "stayed wider); \"unstable (load)\" replaces a speed-up whose rounds stayed too dispersed after "
           "re-measuring (bench/interleave.py, docs/benchmarks.md). Achieved FLOP/s from the model's analytic "
           "FLOPs; % of peak = achieved / the measured GEMM roofline for that compute precision and thread count "
           "(never above 100%: a peak a record beats is measured again; \"–\" where it still does).", "",
           latency_table(lat).markdown(), ""]
    if noisy_ids(lat):
        out += [f"† disturbed timing: p90 > {NOISY}× p50 in this row or in its PyTorch baseline (other work was "
                "running on the machine); that speedup is not reliable.", ""]
    if picks:
        out += ["### Fastest per configuration (passing parity on this machine)", "",
                fastest_table(picks, lat).markdown(), ""]
    out += ["## Peak memory", "",
            "Host RSS measured in an isolated child process per (runner, config): weights = RSS kept after "
            "loading, load peak = transient peak while loading, activations = extra at the peak of inference, "
            "peak RSS = highest RSS of the child (includes the Python interpreter and runtime libraries).", "",
            memory_table(lat).markdown(), ""]
    return out


def _roofline_section(roof: list[Mapping[str, Any]]) -> list[str]:
    if not roof:
        return []
    return ["## Machine roofline", "", "Best measured value over the configurations tried (`xdeploy roofline`).", "",
            roofline_table(roof).markdown(), ""]


def _scale_section(scale: list[Mapping[str, Any]], prof: list[Mapping[str, Any]]) -> list[str]:
    out: list[str] = []
    if scale:
        out += ["## Attention scaling with sequence length", "",
                "Exponent k of latency ∝ T^k fitted (least squares, log-log) over the three largest T measured; "
                "the FLOPs exponent is the same fit of the model's analytic FLOPs (24·T·d² + 4·T²·d per layer), "
                "so k moves from 1 towards 2 once attention dominates, above the crossover T* = 2d + d_ff. "
                "Memory exponent: activation memory (peak RSS above the loaded model) over the same T.", "",
                scale_fits_table(scale).markdown(), ""]
    if prof:
        out += ["### Where the time goes (onnxruntime profiler)", "",
                "Share of kernel time per op class at one T (attention = Attention/Softmax and the score MatMuls "
                "around them; matmul = projections and feed-forward).", "",
                profile_table(prof).markdown(), ""]
    return out


def _decode_section(dec: list[Mapping[str, Any]]) -> list[str]:
    if not dec:
        return []
    return ["## Decoding (KV cache)", "",
            "Greedy generation; TTFT = prefill (or encoder) + first token; per-token = later decode steps; "
            "tokens/s = new tokens / the median generation time over interleaved rounds (every runner decodes the "
            "same prompt once per round, order rotated); vs torch = median of the paired ratios PyTorch round / "
            "runner round with its 95% interval, or \"unstable\"; agreement = greedy tokens identical to the "
            "PyTorch fp32 reference (position by position).", "",
            decode_table(dec).markdown(), ""]


def _vs_peer_cell(r: Mapping[str, Any]) -> str:
    """xdeploy vs the fastest peer row of its precision: '1.07× (1.02–1.11) vs optimum-intel ov bf16', or
    'unstable' instead of a figure; '–' for rows that are not xdeploy's or have no peer of that precision."""
    v = r.get("vs_peer")
    if not v:
        return NONE
    if not v["stable"]:  # its own cause since the peer verdict is judged on its own ratios (older records: the row's)
        return f"{unstable_text(v.get('cause', r['stability'].get('cause')))} vs {v['peer']}"
    cell = f"{speedup(v['median'], (v['low'], v['high']), wide=bool(v.get('wide')))} vs {v['peer']}"
    if v.get("verdict"):  # the instance spread of the two rows widens the tie band (studies/peers.run_workload)
        cell += f": **{v['verdict']}** (instance spread ±{v['instance_spread']:.1%})"
    same = v.get("same_engine")
    if same and same["peer"] != v["peer"]:
        cell += "; same engine: " + (_vs_peer_cell({**r, "vs_peer": same}) if same["stable"] else
                                     f"unstable vs {same['peer']}")
    return cell


def _peers_section(peers: list[Mapping[str, Any]]) -> list[str]:
    """The peers table (studies/peers.py): per workload every system, its speed, accuracy and verdicts."""
    if not peers:
        return []
    out = ["## Peers: xdeploy vs Optimum, sentence-transformers and fastembed", "",
           "Every system of a workload timed in the same interleaved rounds (same threads); accuracy against the "
           "same PyTorch reference (min cosine per row; for sentences, `nn agreement`: the share of sentences "
           "whose nearest other sentence is the reference's, and `ST quality`: NDCG@10 on a generated retrieval "
           "set relative to PyTorch's, the quality measure of sentence-transformers' efficiency benchmark). "
           "`× pytorch` = paired speed-up over eager PyTorch; "
           "`vs fastest peer` = an xdeploy row's paired speed-up over the fastest peer row of the same "
           "precision (>1: xdeploy faster), 95% interval in brackets; *unstable* rows are not results. With "
           "several instances per system (`--replicas`), a row's rounds are its instances' mean and a speed-up "
           "is a **tie** unless its interval clears 1 ± the instance spread (the larger A/A deviation of the "
           "two rows).", ""]
    for (wl,), rs in _by(peers, "workload").items():
        r0 = rs[0]
        shape = f"batch {r0['batch']}" + (f", seq {r0['seq']}" if r0.get("seq") else "") + \
            (f", {r0['items']} sentences per call" if r0["rate_unit"] == "sentences/s" else "")
        load = r0["stability"].get("load") or {}
        other = load.get("other_cores")
        out += [f"### {wl}", "", f"{shape}; {r0['threads']} threads; load average {load.get('loadavg_1m', 0):.1f}, "
                f"other processes {other:.1f} cores meanwhile" if other is not None else f"{shape}", ""]
        rows = []
        order = {"pytorch": 0, "xdeploy": 1}
        for r in sorted(rs, key=lambda r: (r["precision"], order.get(r["system"], 2), r["latency_s"]["p50"])):
            st = r["stability"]
            speed = fmt_s(r["latency_s"]["p50"]) if r["rate_unit"] != "sentences/s" else \
                f"{r['rate']:.0f} sent/s"
            rows.append((r["precision"], r["system"], r["config"], speed + ("" if st["stable"] else " *unstable*"),
                         f"{st['rel_iqr']:.0%}", speedup_of(st) if st.get("speedup") else f"1{TIMES} (reference)",
                         fmt_num(r["max_abs_err"]), fmt_num(r["min_cosine"], ".6f"),
                         fmt_num(r.get("nn_agreement"), ".1%"), fmt_num(r.get("st_quality"), ".2%"),
                         "ok" if r["accuracy_ok"] else "**below floor**", _vs_peer_cell(r)))
        out += [markdown_table(("precision", "system", "config", "p50 / rate", "round IQR", f"{TIMES} pytorch",
                                "max abs err", "min cosine", "nn agreement", "ST quality", "accuracy",
                                "vs fastest peer"), rows), ""]
    return out


def _roofline_cell(roof: Mapping[str, Any] | None) -> str:
    """% of the read roofline; a row that read faster than the measured peak shows why it has no figure."""
    if not roof:
        return NONE
    cell = NONE + " (above the measured read peak)" if roof["pct"] is None else f"{roof['pct']:.0f}%"
    if roof.get("bandwidth_in_rounds_bytes_per_s"):  # the read probe of the row's own rounds
        cell += (" / – in rounds (above the probe: cache)" if roof.get("pct_in_rounds") is None
                 else f" / {roof['pct_in_rounds']:.0f}% in rounds")
    return cell


def _paired_cell(v: Mapping[str, Any] | None, *, versus: str = "") -> str:
    """A paired speed-up block of a peers_generate record: '1.52× (1.40–1.61)', 'unstable (load)', or '–'."""
    if not v:
        return NONE
    tail = f" vs {v['peer']}" if versus and v.get("peer") else ""
    if not v["stable"]:
        return unstable_text(v.get("cause")) + tail
    cell = speedup(v["median"], (v["low"], v["high"]), wide=bool(v.get("wide"))) + tail
    if v.get("verdict"):  # the rows' instance spread widens the tie band (studies/peers_generate.run_workload)
        cell += f": **{v['verdict']}** (instance spread ±{v['instance_spread']:.1%})"
    return cell


def _peers_generate_section(recs: list[Mapping[str, Any]]) -> list[str]:
    """The generation peers table (studies/peers_generate.py): per workload every system's TTFT, TPOT, ITL
    percentiles, tokens/s, paired speed-ups with their intervals, token agreement, peak RSS and % of roofline."""
    if not recs:
        return []
    out = ["## Generation peers: xdeploy vs transformers, optimum-intel, CTranslate2, onnxruntime-genai, "
           "openvino-genai", "",
           "Greedy KV-cache decoding, batch 1, EOS off; every system loaded once and timed in the same interleaved "
           "rounds (each round runs every system, order rotated: the median of a block of its generations lasting "
           "at least 0.25 s by default, one generation where one lasts that long). Metrics as NVIDIA AIPerf / "
           "MLPerf Inference define them: TTFT = time to first token; TPOT = (end-to-end − TTFT) / "
           "(output tokens − 1); ITL = inter-token latency percentiles over every gap between streamed tokens; "
           "tokens/s = output tokens / the median round's end-to-end time. `× HF` = paired speed-up over "
           "transformers' `generate` (eager fp32); "
           "`vs fastest peer` = an xdeploy row's paired speed-up over the fastest peer row of the same precision "
           "(>1: xdeploy faster); 95% intervals in brackets, *unstable* comparisons are not results. Agreement = "
           "greedy tokens equal to the reference's before the first divergence. Peak RSS: a child process that "
           "loads the system and generates once. % roofline: decode tokens/s (1 / TPOT) over read bandwidth ÷ "
           "bytes per token (xdeploy's decode graph of that precision + the KV cache; peers are charged the same "
           "bytes), against the best read peak, then against the median read bandwidth of a probe timed in the "
           "row's own rounds (`in rounds`: on a shared host the bandwidth swings between rounds).", ""]
    for (wl,), rs in _by(recs, "workload").items():
        r0 = rs[0]
        ok = [r for r in rs if r.get("stability")]
        load = (ok[0]["stability"].get("load") or {}) if ok else {}
        bw = next((r["roofline"] for r in rs if r.get("roofline")), None)
        head = (f"{r0['weights']} weights ({r0['checkpoint']}), batch {r0['batch']}, prompt {r0['prompt_len']} → "
                f"{r0['new_tokens']} new tokens; {r0['threads']} threads per system")
        if load.get("other_cores") is not None:
            head += (f"; load average {load.get('loadavg_1m', 0):.1f}, other processes {load['other_cores']:.1f} "
                     "cores meanwhile")
        if bw:
            head += f"; read bandwidth {bw['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s"
        out += [f"### {wl}", "", head, ""]
        rows = []
        order = {"transformers": 0, "xdeploy": 1}
        for r in sorted(rs, key=lambda r: (r["precision"], order.get(r["system"], 2), r.get("e2e_s") or 1e9)):
            if r.get("error"):
                rows.append((r["precision"], r["system"], r["config"], f"**failed**: {r['error']}", *[NONE] * 10))
                continue
            itl = r["itl_s"]
            steady = r["stability"]["stable"]
            rate = f"{r['output_tokens_per_s']:.1f}" + ("" if steady else " *unstable*")
            rows.append((r["precision"], r["system"], r["config"], fmt_s(r["ttft_s"]), fmt_s(r["tpot_s"]),
                         " / ".join(fmt_s(itl[k]) for k in ("p50", "p90", "p99")), rate,
                         _paired_cell(r.get("vs_hf")) if r.get("vs_hf") else f"1{TIMES} (reference)",
                         _paired_cell(r.get("vs_peer"), versus="peer"),
                         f"{r['agreement_tokens']}/{r['new_tokens']} ({r['agreement']:.0%})",
                         fmt_bytes(r.get("peak_rss_bytes")),
                         _roofline_cell(r.get("roofline")),
                         f"{r['decode_tokens_per_s']:.1f}"))
        out += [markdown_table(("precision", "system", "config", "TTFT", "TPOT", "ITL p50 / p90 / p99",
                                "tokens/s", f"{TIMES} HF", "vs fastest peer", "agreement", "peak RSS",
                                "% roofline", "decode tokens/s"), rows), ""]
        notes = sorted({r["note"] for r in rs if r.get("note")})
        if bw:
            notes.append(f"roofline bytes: {bw['assumption'].split(';')[0]}; bandwidth: {bw['bandwidth_how']}")
        out += [f"- {n}" for n in notes] + ([""] if notes else [])
    return out


def _other_section(other: list[Mapping[str, Any]]) -> list[str]:
    if not other:
        return []
    out = ["## Other records", ""]
    for kind, rs in sorted(_by(other, "kind").items()):
        keys = [k for k in rs[0] if k not in ("schema", "version", "kind", "timestamp", "fingerprint", "note")
                and all(isinstance(r.get(k), (str, int, float, bool, type(None))) for r in rs)][:12]
        out += [f"### {kind[0]}", "",
                markdown_table(keys, [[fmt_num(r.get(k), ".4g") if isinstance(r.get(k), float) else r.get(k, NONE)
                               for k in keys] for r in rs]), ""]
    return out


def _incomplete_banner(inc: Any) -> list[str]:
    """The first thing an incomplete report says: where the run stopped and what is missing."""
    if not isinstance(inc, Mapping) or inc.get("complete", True):
        return []
    where = inc.get("stopped_in")
    pos = f" (step {inc['step_index']} of {inc['steps']})" if inc.get("step_index") else ""
    how = "interrupted (Ctrl-C)" if inc.get("interrupted") else "killed or still running"
    stop = f"stopped in **{where}**{pos}" if where else "stopped between steps"
    missing = inc.get("missing") or []
    out = [f"> **INCOMPLETE**: this run {stop}: {how}; last journal entry {inc.get('last_event') or '?'}.",
           f"> Missing: {', '.join(missing) if missing else 'nothing but the final report'}.",
           "> Continue it with `xdeploy run --resume` and the same `--out` and options."]
    if inc.get("torn_tail"):
        out.append("> The journal's last line was cut short by the crash and is ignored.")
    return [*out, ""]


def deploy_here(picks: Sequence[Best], sp: Mapping[tuple[Any, ...], float], unst: Mapping[tuple[Any, ...], str],
                fp: Mapping[str, Any] | None) -> list[str]:
    """The answer a reader wants first: per model, graph and batch, the fastest configuration that passes parity on
    this machine (core/records.py `best`), with its paired speed-up over PyTorch eager fp32 and its interval."""
    if not picks:
        return []
    where = machine_class(dict(fp)) if fp else "this machine"
    rows = [f"- {model_label(b.record['model'], b.record.get('preset'))} {b.record['graph']}, batch "
            f"{b.record['batch']}" + (f", seq {b.record['seq']}" if b.record.get("seq") else "")
            + f": **{b.record['runner']} {b.record['artifact_precision']}** {fmt_s(b.record['latency_s']['p50'])}, "
            f"{record_speedup(b.record, sp, unst)} vs PyTorch eager fp32" for b in picks]
    return [f"**Deploy on this machine** ({where}): the fastest configuration per model and batch among those that "
            "pass parity here:", "", *rows, ""]


def render_summary(records: Sequence[Mapping[str, Any]], meta: Mapping[str, Any], plots: Sequence[str]) -> str:
    by_kind = _by(records, "kind")
    get = lambda k: list(by_kind.get((k,), []))  # noqa: E731
    lat = get("latency")
    sp = speedups(lat)
    fp = next((r["fingerprint"] for r in records if isinstance(r.get("fingerprint"), dict)), None)
    par = get("parity")
    title = meta.get("title") or "xdeploy report"
    lines = [f"# {title}", ""]
    lines += _incomplete_banner(meta.get("incomplete"))
    lines += [f"- generated: {meta.get('generated', '?')}" + (f" in {meta['duration_s']:.0f} s"
                                                             if isinstance(meta.get("duration_s"), float) else "")]
    for k in ("command", "presets", "models", "note"):
        if meta.get(k):
            lines.append(f"- {k}: {meta[k] if not isinstance(meta[k], list) else ', '.join(map(str, meta[k]))}")
    if isinstance(meta.get("phase_s"), dict) and meta["phase_s"]:
        lines.append("- time per phase: " + ", ".join(f"{k} {v:.0f} s" for k, v in meta["phase_s"].items()))
    counts = ", ".join(f"{len(v)} {k[0]}" for k, v in sorted(by_kind.items()))
    lines += [f"- records: {counts or 'none'}", ""]
    if par:
        fails = [p for p in par if not p["passed"]]
        lines += [("**Parity: all checks pass.**" if not fails else
                   f"**Parity: {len(fails)} check(s) FAIL** — see the parity table."), ""]
    stab = stability_summary(records)
    if stab:
        lines += [stab, ""]
    picks = sorted(best(lat + par), key=lambda b: tuple(str(b.record[k]) for k in ("model", "graph", "batch", "seq")))
    lines += deploy_here(picks, sp, unstable(lat), fp)
    if isinstance(meta.get("reused_steps"), list) and meta["reused_steps"]:
        lines += [f"- resumed: {len(meta['reused_steps'])} step(s) taken from the journal (measured by the "
                  "interrupted run, same configuration, artifacts and machine)", ""]
    if isinstance(meta.get("errors"), list) and meta["errors"]:
        lines += ["## Skipped or failed", "", *[f"- {e}" for e in meta["errors"]], ""]
    lines += _machine_section(fp)
    lines += _parity_section(par)
    lines += _latency_section(lat, picks)
    lines += _roofline_section(get("roofline"))
    lines += _decode_section(get("decode"))
    lines += _scale_section(get("scale"), get("profile"))
    lines += _peers_section(get("peers"))
    lines += _peers_generate_section(get("peers_generate"))
    lines += _other_section([r for r in records if r.get("kind") not in SECTIONS])
    if plots:
        lines += ["## Plots", ""]
        captions = {"latency_vs_T.png": "Latency vs sequence length (log-log; fitted slope in the legend)",
                    "memory_vs_T.png": "Activation memory vs sequence length (log-log)",
                    "throughput_vs_batch.png": "Throughput vs batch size",
                    "decode_latency_vs_context.png": "Decode per-token latency vs context length",
                    "speed_vs_error.png": "Speed vs error per precision"}
        for p in plots:
            lines += [f"### {captions.get(p, p)}", "", f"![{captions.get(p, p)}](plots/{p})", ""]
    missing = [p for p in PLOTS if p not in plots]
    if missing:
        lines += [f"Not plotted (no records of that kind in this run): {', '.join(missing)}.", ""]
    return "\n".join(lines).rstrip() + "\n"


# ------------------------------------------------------------------------------------------- render ----

def _flat(rec: Mapping[str, Any]) -> dict[str, Any]:
    """A CSV row: nested dicts flattened with dots; lists (trials, step_s) and the fingerprint left out."""
    out: dict[str, Any] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, Mapping):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif not isinstance(v, (list, tuple)):
            out[prefix] = v

    walk("", {k: v for k, v in rec.items() if k not in ("fingerprint", "schema", "version")})
    return out


def render_report(records: Iterable[Mapping[str, Any]], out: str | os.PathLike[str], *,
                  meta: Mapping[str, Any] | None = None,
                  progress: Callable[[str], None] | None = None, carry: Sequence[str] = ()) -> Path:
    """Validate `records` and write the report directory `out` (replacing an existing one atomically).

    `progress(name)` is called after each file is written (for progress bars). `carry`: names of files in the
    existing `out` that move into the new report (the run's journal.jsonl), hard-linked so a later append to
    the journal is an append to the report's copy."""
    import pandas as pd

    recs = [dict(r) for r in records]
    for i, r in enumerate(recs):
        try:
            validate_record(r)
        except XDeployError as e:
            raise XDeployError(f"record {i}: {e}") from None
    meta = {"generated": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")} | dict(meta or {})
    note = progress or (lambda _name: None)
    out = Path(out)
    check_report_dir(out)
    with atomic_dir(out, force=True) as tmp:
        for name in carry:
            if (out / name).is_file():
                try:
                    os.link(out / name, tmp / name)
                except OSError:
                    shutil.copy2(out / name, tmp / name)
        (tmp / "plots").mkdir()
        by_kind = _by(recs, "kind")
        scale = list(by_kind.get(("scale",), []))
        made = []
        jobs: list[tuple[str, Callable[[Path], bool]]] = [
            ("latency_vs_T.png", lambda p: plot_scale(scale, p, memory=False)),
            ("memory_vs_T.png", lambda p: plot_scale(scale, p, memory=True)),
            ("throughput_vs_batch.png", lambda p: plot_throughput(list(by_kind.get(("latency",), [])), p)),
            ("decode_latency_vs_context.png", lambda p: plot_decode(list(by_kind.get(("decode",), [])), p)),
            ("speed_vs_error.png", lambda p: plot_speed_error(speed_error_points(recs), p)),
        ]
        for name, job in jobs:
            if job(tmp / "plots" / name):
                made.append(name)
                note(f"plots/{name}")
        doc = {"schema": REPORT_SCHEMA, "version": REPORT_VERSION, "meta": meta, "plots": made,
               "scale_fits": scale_fits(scale), "records": recs}
        (tmp / "results.json").write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n", encoding="utf-8")
        note("results.json")
        pd.DataFrame([_flat(r) for r in recs]).to_csv(tmp / "results.csv", index=False)
        note("results.csv")
        (tmp / "summary.md").write_text(render_summary(recs, meta, made), encoding="utf-8")
        note("summary.md")
    return out


def check_report_dir(out: Path) -> None:
    """The report directory is replaced wholesale: refuse anything that is not an earlier report, a run's
    journal alone (a run killed before its first report) or empty, so `--out .` or `--out ~` can never delete
    a user's files."""
    if not out.exists():
        return
    if not out.is_dir():
        raise XDeployError(f"{out} exists and is not a directory; expected a report directory path")
    if any(p.name != JOURNAL_NAME for p in out.iterdir()) and not (out / "results.json").is_file():
        raise XDeployError(f"{out} exists and is not an xdeploy report (no results.json); refusing to replace it "
                           "- choose a new --out directory")
    if (out / "results.json").is_file():
        load_results(out)  # raises unless it is one of ours


def load_results(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a report's results.json (given the report directory or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise XDeployError(f"cannot read report {p}: {e.strerror or e}; expected a report directory with "
                           "results.json") from None
    except json.JSONDecodeError as e:
        raise XDeployError(f"{p}: not JSON ({e.msg}); expected an xdeploy report results.json") from None
    if not isinstance(doc, dict) or doc.get("schema") != REPORT_SCHEMA or not isinstance(doc.get("records"), list):
        raise XDeployError(f"{p} is not an xdeploy report (schema {REPORT_SCHEMA!r} with a records list expected)")
    # reports written before parity/decode records joined the contract: complete them from the report
    meta = doc.get("meta") if isinstance(doc.get("meta"), dict) else {}
    stamp = meta.get("generated") if isinstance(meta.get("generated"), str) else "unknown"
    fp = next((r["fingerprint"] for r in doc["records"]
               if isinstance(r, dict) and isinstance(r.get("fingerprint"), dict)), None)
    doc["records"] = [upgrade_legacy(r, timestamp=stamp, fingerprint=fp) for r in doc["records"]]
    for i, r in enumerate(doc["records"]):
        try:
            validate_record(r)
        except XDeployError as e:
            raise XDeployError(f"{p}: record {i}: {e}") from None
    return doc
