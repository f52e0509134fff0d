"""`xdeploy scale`: how latency and memory grow with the sequence length T, measured next to the analytic model.

Per layer of width d (d_ff = 4d), a forward over T tokens costs

    FLOPs(T)  ≈ 24·T·d²  (q,k,v,o projections 8·T·d² + feed-forward 16·T·d²)  +  4·T²·d  (scores + weighted sum)
    scores    =  B·h·T² entries, B·h·T²·4 bytes in fp32 when the softmax input is materialized

so attention FLOPs overtake the rest at T* = 6d (generally 2d + d_ff), and the time exponent d log t / d log T
moves from 1 towards 2 above T*. The sweep measures, per runner and attention lowering,

    ort-o18     ONNX Runtime, opset 18: attention decomposed into MatMul / Softmax (scores materialized)
    ort-o23     ONNX Runtime, opset 23: the native ONNX `Attention` op
    torch-sdpa  PyTorch eager, scaled_dot_product_attention (flash-style kernel on CPU: no T² buffer)
    torch-math  PyTorch eager, explicit softmax(q kᵀ) v (materialized)
    (ov-o18, ov-o23: the same graphs on OpenVINO, on request)

latency (p50) and peak memory per T, each (lowering, T) in its own child process (bench/memory.py), within a
time budget; the log-log slope fitted over the upper range of T; and onnxruntime's profiler's per-op time
shares (attention, matmul, normalization, other) at one T. Scaling runs need T beyond the presets'
max_positions: the field the family declares for it (models/spec.py `Dims.positions_field`) is overridden
(`config_overrides={"max_positions": T_max}`), presets are untouched.

ViT: T is fixed by the image and patch size, N = (R/p)² + 1. Measured for a few patch sizes; the table beside
it shows the end point: attending over raw pixels (p = 1) of an R×R image needs (R²)² = R⁴ score entries per
head per layer (224⁴ ≈ 2.5·10⁹: 10 GB of fp32 scores for one head of one layer).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError, one_of
from xdeploy.core.fingerprint import fingerprint
from xdeploy.core.records import make_record
from xdeploy.export.cache import cached_artifact
from xdeploy.models.spec import token_sizes

from .memory import Probe, run_isolated
from .suite import BenchJob, _mem_dict, run_job


@dataclass(frozen=True)
class Lowering:
    runner: str
    opset: int
    attn_impl: str
    what: str


LOWERINGS: dict[str, Lowering] = {
    "ort-o18": Lowering("ort", 18, "sdpa", "ONNX Runtime, opset 18: MatMul/Softmax (decomposed)"),
    "ort-o23": Lowering("ort", 23, "sdpa", "ONNX Runtime, opset 23: native Attention op"),
    "torch-sdpa": Lowering("torch", 23, "sdpa", "PyTorch eager, scaled_dot_product_attention"),
    "torch-math": Lowering("torch", 23, "math", "PyTorch eager, explicit softmax(q k^T) v"),
    "ov-o18": Lowering("ov", 18, "sdpa", "OpenVINO, opset 18 graph"),
    "ov-o23": Lowering("ov", 23, "sdpa", "OpenVINO, opset 23 graph"),
}
DEFAULT_LOWERINGS = ("ort-o18", "ort-o23", "torch-sdpa", "torch-math")
OP_CLASSES = ("attention", "matmul", "normalization", "other")
NORM_OPS = {"LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
            "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization", "RMSNormalization"}
MATMUL_OPS = {"MatMul", "Gemm", "FusedGemm", "FusedMatMul", "MatMulInteger", "QLinearMatMul", "MatMulNBits",
              "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "Conv", "ConvInteger", "QGemm"}
ATTENTION_OPS = {"Attention", "MultiHeadAttention", "GroupQueryAttention", "Softmax"}


def t_values(max_t: int, min_t: int = 64) -> list[int]:
    """64, 128, ... doubling up to max_t (max_t itself included even if not a power of two)."""
    if max_t < min_t:
        raise XDeployError(f"--max-t must be >= {min_t}, got {max_t}")
    out, t = [], min_t
    while t <= max_t:
        out.append(t)
        t *= 2
    if out[-1] != max_t:
        out.append(max_t)
    return out


# ------------------------------------------------------------------------------------------ analytic ----

def analytic(d: int, d_ff: int, n_heads: int, n_layers: int, t: int, batch: int = 1, bytes_per: int = 4
             ) -> dict[str, float]:
    """FLOPs of the layers (attention part separately) and the materialized score bytes at length t."""
    dense = (8.0 * d * d + 4.0 * d * d_ff) * t
    attn = 4.0 * t * t * d
    return {"flops": batch * n_layers * (dense + attn), "attn_flops": batch * n_layers * attn,
            "attn_share": attn / (dense + attn), "score_bytes": float(batch * n_heads * t * t * bytes_per)}


def crossover_t(d: int, d_ff: int) -> float:
    """T where 4·T²·d = (8d² + 4·d·d_ff)·T, i.e. T = 2d + d_ff (= 6d for d_ff = 4d)."""
    return 2.0 * d + d_ff


def fit_exponent(ts: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of log y against log T (None with fewer than 2 points)."""
    pts = [(math.log(t), math.log(y)) for t, y in zip(ts, ys) if t > 0 and y and y > 0]
    if len(pts) < 2:
        return None
    x, y = np.array(pts).T
    return float(np.polyfit(x, y, 1)[0])


def upper_range(ts: Sequence[int], points: int = 3) -> list[int]:
    """The largest `points` values of T (the 'upper range' the exponent is fitted over)."""
    return sorted(ts)[-points:]


# ------------------------------------------------------------------------------------------ profiler ----

def classify(op: str, shapes: Sequence[Sequence[int]]) -> str:
    """attention: attention ops, Softmax, and every node on 4-D (B, h, T, ·) head tensors — q kᵀ and p v
    MatMuls, the mask-bias Add and scaling Mul over (B, h, T, S) scores, head transposes; matmul: the other
    MatMul/Gemm/Conv (projections, feed-forward, patch embedding); normalization: LayerNorm variants."""
    four_d = any(len(s) == 4 for s in shapes)
    if op in ATTENTION_OPS:
        return "attention"
    if op in MATMUL_OPS:
        return "attention" if four_d and op in ("MatMul", "FusedMatMul") else "matmul"
    if op in NORM_OPS:
        return "normalization"
    return "attention" if four_d else "other"


def _shapes(arg: Any) -> list[list[int]]:
    out = []
    for entry in arg or []:
        for dims in entry.values():
            out.append(list(dims))
    return out


def ort_op_profile(artifact: Any, sizes: Mapping[str, int], *, threads: int = 0, runs: int = 3
                   ) -> dict[str, Any]:
    """Per-op-type kernel time (seconds per call) and class shares from onnxruntime's profiler."""
    from xdeploy.deploy.sessions import ort_session, ort_session_options
    from xdeploy.models.spec import make_feeds

    with tempfile.TemporaryDirectory(prefix="xdeploy-prof-") as tmp:
        so = ort_session_options(threads, profile_prefix=Path(tmp) / "ort")
        sess = ort_session(artifact.onnx_path(), options=so)
        feeds = make_feeds(artifact.graph(), dict(sizes))
        sess.run(None, feeds)  # warm-up (first-call allocations) is profiled too: dropped below by run index
        for _ in range(runs):
            sess.run(None, feeds)
        events = json.loads(Path(sess.end_profiling()).read_text())
    runs_ev = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    cutoff = runs_ev[0]["ts"] + runs_ev[0]["dur"] if runs_ev else -1  # skip the warm-up run's nodes
    per_op: dict[str, float] = {}
    per_class = dict.fromkeys(OP_CLASSES, 0.0)
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time") or e["ts"] < cutoff:
            continue
        op = e["args"].get("op_name", "?")
        shapes = _shapes(e["args"].get("input_type_shape")) + _shapes(e["args"].get("output_type_shape"))
        sec = e["dur"] * 1e-6 / runs
        per_op[op] = per_op.get(op, 0.0) + sec
        per_class[classify(op, shapes)] += sec
    total = sum(per_class.values()) or 1.0
    return {"op_times_s": dict(sorted(per_op.items(), key=lambda kv: -kv[1])),
            "shares": {k: v / total for k, v in per_class.items()}, "total_s": total}


# ------------------------------------------------------------------ config sweeps (ViT's patches) ----

def sweep_child(probe: Probe, model: str, preset: str, overrides: tuple[tuple[str, Any], ...], batch: int,
                threads: int, iters: int) -> dict[str, Any]:
    """Torch-only (no export): build `model` with `overrides` (e.g. patch size, attention kernel) and time
    `iters` calls of its graph "model" on seeded example inputs at `batch`."""
    import torch

    from xdeploy.models.registry import build, get_config, get_family
    from xdeploy.models.spec import make_feeds

    from .latency import measure

    if threads:
        torch.set_num_threads(threads)
    family = get_family(model)
    cfg = get_config(model, preset, **dict(overrides))
    graph = family.spec(cfg).graph("model")
    probe.mark("imported")
    module = build(model, cfg)
    feeds = make_feeds(graph, {"batch": batch})
    args = [torch.from_numpy(feeds[t.name]) for t in graph.inputs]
    probe.mark("loaded")
    with torch.inference_mode():
        st = measure(lambda: module(*args), warmup=1, min_iters=1, max_iters=iters, max_seconds=2.0)
    probe.mark("run")
    return {"stats": st.as_dict(), "fingerprint": fingerprint(), "threads": torch.get_num_threads(),
            "tokens": family.config_sweep.tokens(cfg) if family.config_sweep else None}


def vit_table(image: int = 224, d: int = 768, heads: int = 12, patches: Sequence[int] = (32, 16, 14, 8, 4, 2, 1)
              ) -> list[dict[str, float]]:
    """Tokens, score entries and fp32 score bytes per head and per layer vs patch size (p=1: raw pixels)."""
    rows = []
    for p in patches:
        n = (image // p) ** 2 + (0 if p == 1 else 1)  # raw pixels: no class token in the R⁴ count
        rows.append({"patch": float(p), "tokens": float(n), "entries_per_head": float(n * n),
                     "score_bytes_per_layer": float(heads * n * n * 4),
                     "attn_share": analytic(d, 4 * d, heads, 1, n)["attn_share"]})
    return rows


# ------------------------------------------------------------------------------------------ the sweep ----

def _scale_record(model: str, lowering: str, t: int, batch: int, cfg: Any, result: dict[str, Any], mem: Any,
                  patch: int | None = None, note: str | None = None) -> dict[str, Any]:
    from xdeploy.models.registry import get_family

    family = get_family(model)
    dims = family.dims(cfg)
    d, h, layers = dims.width, dims.heads, dims.layers
    an = analytic(d, dims.ffn, h, layers, t, batch)
    # the model's own analytic FLOPs (embeddings, LM head, cross-attention included) with every token axis at T
    # (none for a model whose tokens its config fixes); the attention part and the score memory from the
    # per-layer formula above
    flops = float(family.flops(cfg, token_sizes(family.capabilities, batch, t)))
    st = result["stats"]
    lat = {k: st[k] for k in ("p50", "p90", "p99", "mean", "std", "min", "max")}
    return make_record("scale", result["fingerprint"], model=model, runner=lowering.split("-")[0],
                       lowering=lowering, T=t, batch=batch, d_model=d, n_heads=h, n_layers=layers,
                       latency_s=lat, iterations=int(st["n"]), memory=_mem_dict(mem) if mem else None,
                       flops=flops, attn_flops=an["attn_flops"], score_bytes=an["score_bytes"],
                       achieved_flops=flops / st["p50"], patch_size=patch, note=note)


def sweep_overrides(model: str, preset: str, max_t: int, layers: int | None = None) -> dict[str, Any]:
    """The config fields the sweep overrides, as the family declares them (models/spec.py Dims): the positions
    bound grown to `max_t` (never shrunk), the layer count(s) set to `layers` (None: the preset's)."""
    from xdeploy.models.registry import get_config, get_family

    family = get_family(model)
    base = get_config(model, preset)
    dims = family.dims(base)
    field = dims.positions_field
    if family.capabilities.token_axis is None or field is None:
        sweep = family.config_sweep
        raise XDeployError(f"model {model!r} has no token axis to scale: its config fixes the tokens"
                           + (f" (its {sweep.field} sweep runs beside a model with a token axis: --vit-patches)"
                              if sweep else ""))
    overrides: dict[str, Any] = {field: max(max_t, int(getattr(base, field)))}
    if layers is not None:
        if not dims.layer_fields:
            raise XDeployError(f"--layers is not supported for {model!r}: it declares no layer fields")
        overrides |= dict.fromkeys(dims.layer_fields, layers)
    return overrides


def run_scale(model: str | None = None, *, preset: str | None = None, lowerings: Sequence[str] = DEFAULT_LOWERINGS,
              max_t: int | None = None, batch: int = 1, layers: int | None = None, budget: float | None = None,
              threads: int = 0, profile_t: int | None = None, sweep_values: Sequence[int] | None = None,
              quick: bool = False, smoke: bool = False, fresh: bool = False,
              log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The attention-scaling sweep; returns validated "scale" and "profile" records (see module docstring).

    `model` (default: the first registered model with a token axis) at `preset` (default: its quick preset,
    e.g. bert `minilm`: d 384, 12 heads) to T=4096 with a 600 s budget; `quick`: 2 layers and 300 s; `smoke`:
    its smallest preset to T=256 (seconds). Each lowering gets an equal share of the budget and stops when the
    next T (predicted ×4 from the last) would not fit. Then every model with a config sweep (ViT: patch
    sizes) at `sweep_values` (default: the family's; empty: none)."""
    from xdeploy.export.artifact import load_artifact
    from xdeploy.models.registry import families, get_config, get_family

    if model is None:
        with_axis = families(token_axis=True)
        if not with_axis:
            raise XDeployError("no registered model has a token axis to scale")
        model = with_axis[0].name
    family = get_family(model)
    if smoke:
        preset, max_t, budget = preset or family.smallest_preset, max_t or 256, budget or 60.0
        sweep_values = () if sweep_values is None else sweep_values
    preset = preset or family.quick
    max_t = max_t or 4096
    budget = budget or (300.0 if quick else 600.0)
    layers = layers if layers is not None else (2 if quick else None)
    for name in lowerings:
        if name not in LOWERINGS:
            raise one_of("lowering", name, LOWERINGS)
    overrides = sweep_overrides(model, preset, max_t, layers)
    cfg = get_config(model, preset, **overrides)
    ts = t_values(max_t)
    per_lowering = budget / max(1, len(lowerings))
    records: list[dict[str, Any]] = []
    for name in lowerings:
        low = LOWERINGS[name]
        art = load_artifact(cached_artifact(model, preset=preset, precision="fp32", opset=low.opset,
                                            attn_impl=low.attn_impl, overrides=overrides, fresh=fresh, log=log))
        t0 = time.perf_counter()
        last = wall = None
        for t in ts:
            elapsed = time.perf_counter() - t0
            # next child ≈ this child's wall time (spawn, load) + its 3 calls growing up to 4x (T² at worst)
            if last is not None and elapsed + wall + 9.0 * last > per_lowering:
                if log:
                    log(f"  {name}: stopping before T={t} (budget {per_lowering:.0f} s for this lowering)")
                break
            sizes = token_sizes(art.capabilities, batch, t)
            job = BenchJob(runner=low.runner, artifact=str(art.path), sizes=tuple(sizes.items()), threads=threads,
                           warmup=1, min_iters=2, max_iters=20, max_seconds=max(0.5, per_lowering / len(ts) / 2))
            try:
                w0 = time.perf_counter()
                result, mem = run_job(job)
                wall = time.perf_counter() - w0
            except XDeployError as e:
                if log:
                    log(f"  {name}: T={t} failed ({e}); stopping this lowering")
                break
            last = result["stats"]["p50"]
            rec = _scale_record(model, name, t, batch, cfg, result, mem)
            records.append(rec)
            if log:
                m = rec["memory"]["peak_rss_bytes"] if rec["memory"] else None
                log(f"  {name:10s} T={t:5d}  p50 {last * 1e3:9.2f} ms  peak RSS "
                    f"{'-' if m is None else f'{m / 2**20:.0f} MiB'}")
        if low.runner == "ort":
            done = [r["T"] for r in records if r["lowering"] == name]
            pt = profile_t if profile_t in done else (max(t for t in done if t <= 2048) if done else None)
            if pt:
                sizes = token_sizes(art.capabilities, batch, pt)
                prof = ort_op_profile(art, sizes, threads=threads, runs=2)
                records.append(make_record("profile", fingerprint(), model=model, runner="ort", lowering=name,
                                           T=pt, batch=batch, shares=prof["shares"], op_times_s=prof["op_times_s"],
                                           total_s=prof["total_s"], note=None))
    for f in families():
        if f.config_sweep and f.name != model and (sweep_values is None or sweep_values):
            records += run_config_sweep(f.name, sweep_values or f.config_sweep.values, threads=threads, log=log)
    return records


def run_config_sweep(model: str, values: Sequence[int], *, threads: int = 0, impls: Sequence[str] = ("sdpa", "math"),
                     log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """A model whose tokens its config fixes (ViT-B/16 at 224×224: the patch size) at each of `values`:
    PyTorch latency and memory per token count, one isolated child per (kernel, value)."""
    from xdeploy.models.registry import get_config, get_family

    sweep = get_family(model).config_sweep
    if sweep is None:
        raise XDeployError(f"model {model!r} declares no config sweep")
    for v in values:
        get_config(model, sweep.preset, **{sweep.field: v})  # a value the config refuses is an error up front
    records = []
    for impl in impls:
        for v in values:
            ov = ((sweep.field, v), ("attn_impl", impl))
            try:
                result, _, mem = run_isolated(sweep_child, model, sweep.preset, ov, 1, threads, 5)
            except XDeployError as e:
                if log:
                    log(f"  {model} {sweep.field} {v} {impl}: failed ({e})")
                break
            cfg = get_config(model, sweep.preset, **dict(ov))
            n = sweep.tokens(cfg)
            rec = _scale_record(model, f"torch-{impl}", n, 1, cfg, result, mem, patch=v)
            records.append(rec)
            if log:
                log(f"  {model} torch-{impl:4s} {sweep.field} {v:2d}: {n:5d} tokens, p50 "
                    f"{rec['latency_s']['p50'] * 1e3:8.1f} ms, activations "
                    f"{rec['memory']['activations_bytes'] / 2**20:.0f} MiB")
    return records


# ------------------------------------------------------------------------------------------ analysis ----

def summarize(records: Sequence[Mapping[str, Any]], points: int = 3) -> list[dict[str, Any]]:
    """Per (model, lowering): measured time and memory exponents over the upper range next to the analytic
    FLOPs exponent over the same T, the largest T reached and the analytic crossover T* = 2d + d_ff."""
    out = []
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in records:
        if r["kind"] == "scale":
            groups.setdefault((r["model"], r["lowering"]), []).append(r)
    for (model, lowering), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["T"])
        upper = upper_range([r["T"] for r in rs], points)
        sel = [r for r in rs if r["T"] in upper]
        ts = [r["T"] for r in sel]
        mem = [r["memory"]["activations_bytes"] if r["memory"] else None for r in sel]
        d = rs[0]["d_model"]
        out.append({
            "model": model, "lowering": lowering, "T_range": [min(ts), max(ts)], "max_T": rs[-1]["T"],
            "time_exponent": fit_exponent(ts, [r["latency_s"]["p50"] for r in sel]),
            "flops_exponent": fit_exponent(ts, [r["flops"] for r in sel]),
            "memory_exponent": fit_exponent(ts, mem) if all(m for m in mem) else None,
            "crossover_T": crossover_t(d, 4 * d), "d_model": d,
        })
    return out
