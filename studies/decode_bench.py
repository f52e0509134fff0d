"""Decode benchmark: KV-cache generation on gpt small (GPT-2 124M), batch 1, against Hugging Face `generate`.

    python -m xdeploy.studies.decode_bench                    # full run (~10-15 min on 2 cores)
    python -m xdeploy.studies.decode_bench --quick            # fewer tokens, no recompute run, no transformer
    python -m xdeploy.studies.decode_bench --json out.json

What it measures, all in one process, side by side:
  * Weights: a random GPT-2 small from `transformers.GPT2Config()` (HF's own init, seed 0), saved as safetensors
    and exported with `--checkpoint`, so xdeploy and Hugging Face run the *same* weights.
  * Per runner and precision (greedy, prompt 32, N new tokens, EOS ignored): time to first token, per-token
    latency percentiles and by context length, tokens/s of the decode phase and end to end, and greedy token
    agreement with the PyTorch fp32 reference (first divergence step).
  * Hugging Face `GPT2LMHeadModel.generate(do_sample=False)` tokens/s (its own KV cache) and token agreement.
  * The same generation with the cache vs recomputing the whole sequence every step (ratio at N new tokens).
  * The memory-bandwidth roofline: weight bytes read per token (every initializer of the decode graph, minus
    embedding tables that are only gathered, plus the KV cache read at the mean context) ÷ measured read
    bandwidth (bench/roofline.py `memory_trials`, best of numpy/torch sums and torch GEMV over a 512 MiB array).
  * 128-token fp32 greedy parity on transformer base (torch reference vs ort / ov).

Timing is interleaved (bench/interleave.py): every generator and HF `generate` are opened once and decode the
same prompt once per round, order rotated, so a burst of load on a shared machine hits all of them alike;
tokens/s is the median round, x HF the median of the paired round ratios with a 95% interval, or "unstable"
when the rounds stay too dispersed after one re-measurement. Threads default to the cores free at the start.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError
from xdeploy.core.targets import TARGETS
from xdeploy.reports.text import pct_of_peak, speedup_of
from xdeploy.studies import finish, machine, machine_line

ROOT = Path("artifacts/decode-bench")
CONTEXT_BUCKETS = (32, 64, 128, 192, 256, 320)


# --------------------------------------------------------------------------------------- artifacts ----

def hf_gpt2(root: Path, seed: int = 0) -> tuple[Any, Path]:
    """The random HF GPT-2 small (same sizes as the `small` preset) and its safetensors directory."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    d = root / f"hf-gpt2-small-seed{seed}"
    if not (d / "model.safetensors").exists():
        model.save_pretrained(d, safe_serialization=True)
    return model, d


def artifact_at(model: str, precision: str, root: Path, *, checkpoint: Path | None = None,
                preset: str | None = None) -> Path:
    """The study's artifacts come from the one artifact cache (export/cache.py), kept under `root`."""
    from xdeploy.export.cache import cached_artifact
    from xdeploy.verify.sensitivity import refine  # fp16 AMP / int8 sensitivity, as `xdeploy export`

    return cached_artifact(model, preset=preset, checkpoint=checkpoint, precision=precision, root=root, log=print,
                           refine=refine)


def weight_bytes_per_token(onnx_path: Path) -> int:
    """Bytes of initializers one decode step reads: all of them, except tables consumed only through Gather
    (token / position embeddings read one row per token)."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(onnx_path), load_external_data=True)
    g = proto.graph
    consumers: dict[str, list[tuple[Any, int]]] = {}
    for n in g.node:
        for i, name in enumerate(n.input):
            consumers.setdefault(name, []).append((n, i))

    def gathered_only(name: str, depth: int = 0) -> bool:
        uses = consumers.get(name, [])
        if not uses or depth > 3:
            return False
        for node, idx in uses:
            if node.op_type == "Gather" and idx == 0:
                continue
            if node.op_type in ("Cast", "DequantizeLinear") and idx == 0 and gathered_only(node.output[0], depth + 1):
                continue
            return False
        return True

    total = 0
    for init in g.initializer:
        if not gathered_only(init.name):
            total += numpy_helper.to_array(init).nbytes
    return total


def read_bandwidth() -> tuple[float, str]:
    """Best measured read bandwidth in bytes/s and how it was measured."""
    try:
        from xdeploy.bench.roofline import memory_trials

        trials = [t for t in memory_trials(512 << 20, budget=0.5) if t.path.startswith("read")]
        best = max(trials, key=lambda t: t.value)
        return float(best.value), f"bench/roofline.py memory_trials: {best.path}"
    except ImportError:  # pragma: no cover - roofline.py is part of the suite
        a = np.ones(128 << 20, np.float32)
        t = min(_timed(lambda: np.add.reduce(a)) for _ in range(5))
        return a.nbytes / t, "numpy sum over 512 MiB, 1 thread (measured here)"


def read_probe(mib: int = 1024, threads: int = 0) -> tuple[Callable[[], None], int, str]:
    """(call, bytes, how): a call that reads a `mib` MiB fp32 matrix once (torch matrix x vector at `threads`
    threads, 0 = torch's own count: the kernel the read peak is usually best at, bench/roofline.py
    memory_trials). Timed in the same rounds as the decoders (bench/interleave.py `run_rounds` observe), it says
    what the machine read in those rounds: on a shared host the read bandwidth swings by a third within minutes
    (2026-11-30, Xeon model 207: a 2 GiB mv's best 38 GB/s, its median 30), so a median decode step over a best
    read seen minutes earlier understates the share."""
    import torch

    m, v = torch.ones((mib << 20) // (4 * 4096), 4096), torch.ones(4096)  # written: resident before timing
    n = threads or torch.get_num_threads()

    def call() -> None:
        old = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            torch.mv(m, v)
        finally:
            torch.set_num_threads(old)

    return call, m.numel() * 4, f"torch mv over {mib} MiB, {n} threads"


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------ runs ----

def context_profile(step_s: tuple[float, ...], prompt_len: int) -> dict[str, float]:
    """Median per-token latency (s) by context length bucket; step i runs with prompt_len + i + 1 tokens."""
    ctx = prompt_len + 1 + np.arange(len(step_s))
    out = {}
    for lo, hi in zip(CONTEXT_BUCKETS, CONTEXT_BUCKETS[1:]):
        sel = (ctx >= lo) & (ctx < hi)
        if sel.any():
            out[f"{lo}-{hi - 1}"] = float(np.median(np.asarray(step_s)[sel]))
    return out


def run_generator(art: Path, runner: str, prompt: list[int], new: int, *, use_cache: bool = True,
                  repeats: int = 1, threads: int = 0) -> dict[str, Any]:
    from xdeploy.deploy.generate import GenerationConfig, Generator

    gc = GenerationConfig(max_new_tokens=new, eos_token_id=-1)
    best = None
    with Generator(art, runner, use_cache=use_cache, threads=threads) as g:
        g.generate([prompt], dataclasses.replace(gc, max_new_tokens=min(4, new)))  # warm-up allocations
        for _ in range(repeats):
            out = g.generate([prompt], gc)
            if best is None or out.total_s < best.total_s:
                best = out
    steps = np.asarray(best.step_s)
    pct = np.percentile(steps, [50, 90, 99]) if steps.size else np.full(3, np.nan)
    decode_tps = steps.size / steps.sum() if steps.size else float("nan")
    return {"tokens": list(best.tokens[0]), "ttft_s": best.time_to_first_token_s, "total_s": best.total_s,
            "tokens_per_s": best.tokens_per_s, "decode_tokens_per_s": float(decode_tps),
            "step_p50_s": float(pct[0]), "step_p90_s": float(pct[1]), "step_p99_s": float(pct[2]),
            "by_context_s": context_profile(best.step_s, len(prompt)), "mode": best.mode}


# ------------------------------------------------------------------------------------------ main ----

def run(*, new: int = 256, prompt_len: int = 32, runners: tuple[str, ...] = ("torch", "ort", "ov", "ov:bf16"),
        precisions: tuple[str, ...] = ("fp32", "fp16", "int8"), recompute: bool = True,
        seq2seq: bool = True, root: Path = ROOT, threads: int = 0, log: Any = print) -> dict[str, Any]:
    from xdeploy.bench.suite import apply_thread_env
    from xdeploy.deploy.generate import token_agreement
    from xdeploy.deploy.registry import RUNNERS
    from xdeploy.export.artifact import load_artifact
    from xdeploy.models.registry import dims

    apply_thread_env()  # passive OpenMP waiting, before torch loads (docs/benchmarks.md)
    root.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"machine": machine(), "new_tokens": new, "prompt_len": prompt_len, "batch": 1,
                              "threads": threads, "runs": []}
    bw, bw_how = read_bandwidth()
    result["bandwidth"] = {"bytes_per_s": bw, "how": bw_how}
    log(f"read bandwidth {bw / 1e9:.1f} GB/s ({bw_how})")

    hf_model, ckpt = hf_gpt2(root)
    arts: dict[str, Path] = {}
    arts["fp32"] = artifact_at("gpt", "fp32", root, checkpoint=ckpt)
    for p in precisions:
        if p == "fp32":
            continue
        try:
            arts[p] = artifact_at("gpt", p, root, checkpoint=ckpt)
        except XDeployError as e:
            log(f"{p}: not available ({e})")
    cfg = hf_model.config
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size - 1, size=prompt_len).tolist()

    import torch

    from xdeploy.bench.interleave import compare, resolve_threads
    from xdeploy.deploy.generate import GenerationConfig, Generator

    threads = resolve_threads(threads)  # never more threads than free cores (docs/benchmarks.md)
    torch.set_num_threads(threads)
    result["threads"] = threads
    ids = torch.tensor([prompt])
    hf_kw = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": cfg.eos_token_id,
             "eos_token_id": None}
    last: dict[str, Any] = {}  # name -> the output of its last timed generation

    def hf_call() -> None:
        with torch.inference_mode():
            last["hf"] = hf_model.generate(ids, max_new_tokens=new, min_new_tokens=new, **hf_kw)

    gc = GenerationConfig(max_new_tokens=new, eos_token_id=-1)
    # runner variants (ov:bf16 = OpenVINO computing in bf16) are compute hints: run them on the fp32 graph only
    combos = [("torch", "fp32")] + [(r, p) for p in arts for r in runners
                                    if r != "torch" and (":" not in r or p == "fp32")]
    calls: dict[str, Any] = {"hf": hf_call}
    with contextlib.ExitStack() as stack:
        for runner, prec in combos:
            if runner.partition(":")[0] not in RUNNERS:
                continue
            try:
                g = stack.enter_context(Generator(arts[prec], runner, threads=threads))
                g.generate([prompt], dataclasses.replace(gc, max_new_tokens=min(4, new)))  # warm-up allocations
            except XDeployError as e:
                log(f"{runner} {prec}: skipped: {e}")
                result["runs"].append({"runner": runner, "precision": prec, "error": str(e)})
                continue
            name = f"{runner} {prec}"
            calls[name] = lambda g=g, name=name: last.__setitem__(name, g.generate([prompt], gc))
        # every generator (and HF) produces the same `new` tokens once per round, order rotated: drift and bursts
        # of load hit all alike; speed-ups vs HF are medians of paired rounds, re-measured once while unstable
        log(f"{len(calls)} generators x {new} new tokens, interleaved rounds ...")
        cmp = compare(calls, baseline="hf", attempts=2, warmup=1, min_block_s=0.0, min_rounds=5, max_rounds=9,
                      max_seconds=60.0, log=log)
    hf_s = cmp.series["hf"].median_s
    hf_tokens = last["hf"][0, len(prompt):].tolist()
    result["hf"] = {"total_s": hf_s, "tokens_per_s": new / hf_s, "threads": torch.get_num_threads(),
                    "stability": cmp.stability("hf")}
    log(f"  HF: {new / hf_s:.1f} tokens/s ({threads} torch threads)")
    ref_tokens = None
    # the decode graph reads the whole cache (capacity C): the KV bytes of the artifact's model, as its family
    # declares them (GPT-2 small: 12 layers of width 768)
    kv_bytes = dims(load_artifact(arts["fp32"], verify=False).config).kv_bytes(prompt_len + new)
    for name in calls:
        if name == "hf":
            continue
        runner, prec = name.split(" ")
        out = last[name]
        steps = np.asarray(out.step_s)
        pct = np.percentile(steps, [50, 90, 99]) if steps.size else np.full(3, np.nan)
        med = cmp.series[name].median_s
        r: dict[str, Any] = {
            "tokens": list(out.tokens[0]), "ttft_s": out.time_to_first_token_s, "total_s": med,
            "tokens_per_s": new / med, "decode_tokens_per_s": float(steps.size / steps.sum()) if steps.size
            else float("nan"), "step_p50_s": float(pct[0]), "step_p90_s": float(pct[1]),
            "step_p99_s": float(pct[2]), "by_context_s": context_profile(out.step_s, len(prompt)), "mode": out.mode}
        if ref_tokens is None:
            ref_tokens = r["tokens"]
        ag = token_agreement([ref_tokens], [r["tokens"]])
        hb = weight_bytes_per_token(arts[prec] / "decode.onnx")
        if runner.endswith(":bf16") and prec == "fp32":
            hb //= 2  # OpenVINO's bf16 hint stores the fp32 weights as bf16 at compile time
        roof_tps = bw / (hb + kv_bytes)
        stab = cmp.stability(name)
        sp = stab["speedup"]
        r |= {"runner": runner, "precision": prec, "agreement": ag.agreement,
              "first_divergence": ag.first_divergence[0], "hf_agreement": token_agreement([hf_tokens],
                                                                                       [r["tokens"]]).agreement,
              "weight_bytes_per_token": hb, "roofline_tokens_per_s": roof_tps,
              "pct_of_roofline": 100.0 * r["decode_tokens_per_s"] / roof_tps,
              # end to end on both sides: median of paired rounds (HF round / this round); None when unstable
              "vs_hf": sp["median"] if stab["stable"] else None, "vs_hf_low": sp["low"], "vs_hf_high": sp["high"],
              "stability": stab}
        result["runs"].append({k: v for k, v in r.items() if k != "tokens"})
        vs = f"{speedup_of(stab)} vs HF"
        log(f"  {name}: ttft {r['ttft_s'] * 1e3:.1f} ms, step p50 {r['step_p50_s'] * 1e3:.2f} ms, "
            f"{r['tokens_per_s']:.1f} tok/s end to end ({vs}), agreement {ag.agreement:.3f}, "
            f"{roofline_pct(r['pct_of_roofline'])} of roofline ({hb / 1e6:.0f} MB weights/token)")

    result["teacher_forced"] = teacher_forced(arts, hf_model, prompt + ref_tokens, log) if ref_tokens else {}

    if recompute:
        # the fastest true-fp32 runner (not a compute-precision variant such as ov:bf16)
        best_fp32 = max((r for r in result["runs"] if r.get("precision") == "fp32" and r["runner"] != "torch"
                         and ":" not in r["runner"] and "error" not in r), key=lambda r: r["tokens_per_s"],
                        default=None)
        runner = best_fp32["runner"] if best_fp32 else "ort"
        log(f"{runner} fp32 recompute-everything, {new} new tokens (slow) ...")
        rc = run_generator(arts["fp32"], runner, prompt, new, use_cache=False, threads=threads)
        cached = next(r for r in result["runs"] if r["runner"] == runner and r["precision"] == "fp32")
        result["recompute"] = {k: v for k, v in rc.items() if k != "tokens"} | {
            "runner": runner, "same_tokens": rc["tokens"] == ref_tokens,
            "cache_speedup_end_to_end": rc["total_s"] / cached["total_s"]}
        log(f"  recompute {rc['tokens_per_s']:.2f} tok/s end to end; cache is "
            f"{result['recompute']['cache_speedup_end_to_end']:.1f}x faster")

    if seq2seq:
        result["transformer_parity"] = transformer_parity(root, runners, log)
    result["load_average_end"] = list(os.getloadavg())
    result["summary"] = summarize(result)
    return result


def teacher_forced(arts: dict[str, Path], hf_model: Any, seq: list[int], log: Any) -> dict[str, Any]:
    """Why reduced precisions diverge: on the fp32 reference sequence (teacher forcing, so one early flip does
    not derail the rest), the top-1 / top-2 logit margin of the fp32 model and, per precision (ort `model`
    graph), how often the argmax still agrees and how far the logits move."""
    import torch

    from xdeploy.deploy.registry import open_runner

    ids = np.asarray([seq], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    with torch.inference_mode():
        ref = hf_model(torch.from_numpy(ids)).logits[0].float().numpy()  # (T, V)
    top2 = np.sort(ref, -1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    out: dict[str, Any] = {"margin_p10": float(np.percentile(margin, 10)),
                           "margin_median": float(np.median(margin)), "positions": int(len(seq))}
    log(f"fp32 reference top-1 minus top-2 logit margin: median {out['margin_median']:.4f}, "
        f"p10 {out['margin_p10']:.4f} (logit std {ref.std():.3f})")
    for prec, art in arts.items():
        try:
            with open_runner("ort", art) as r:
                got = r.infer(feeds)["logits"][0]
        except XDeployError as e:
            out[prec] = {"error": str(e)}
            continue
        d = np.abs(got - ref)
        out[prec] = {"top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).mean()),
                     "abs_err_median": float(np.median(d)), "abs_err_p99": float(np.percentile(d, 99))}
        log(f"  ort {prec}: teacher-forced top-1 agreement {out[prec]['top1_agreement']:.3f}, "
            f"|logit error| median {out[prec]['abs_err_median']:.4f}, p99 {out[prec]['abs_err_p99']:.4f}")
    return out


def transformer_parity(root: Path, runners: tuple[str, ...], log: Any, new: int = 128) -> dict[str, Any]:
    """128-token parity of transformer base, fp32: torch reference (cache) vs the other runners, greedy and
    seeded high-temperature sampling (random post-LN weights make greedy output repeat one token, so the
    sampled run is the one that exercises many tokens; it needs the logits to agree closely everywhere)."""
    from xdeploy.deploy.generate import GenerationConfig, Generator, token_agreement

    art = artifact_at("transformer", "fp32", root, preset="base")
    src = [np.random.default_rng(1).integers(3, 32000, size=24).tolist()]
    configs = {"greedy": GenerationConfig(max_new_tokens=new, eos_token_id=-1),
               "sampled": GenerationConfig(max_new_tokens=new, eos_token_id=-1, do_sample=True, temperature=30.0,
                                           seed=0)}
    out: dict[str, Any] = {}
    refs: dict[str, Any] = {}
    for runner in ("torch",) + tuple(r for r in runners if r != "torch" and ":" not in r):
        try:
            with Generator(art, runner) as g:
                toks = {k: g.generate(src, c).tokens for k, c in configs.items()}
        except XDeployError as e:
            out[runner] = {"error": str(e)}
            continue
        for k, t in toks.items():
            refs.setdefault(k, t)
            ag = token_agreement(refs[k], t)
            out.setdefault(runner, {})[k] = {"agreement": ag.agreement, "first_divergence": ag.first_divergence[0],
                                             "distinct_tokens": len(set(t[0]))}
            log(f"transformer base {runner} {k}: agreement {ag.agreement:.3f} over {new} tokens "
                f"({len(set(t[0]))} distinct tokens)")
    return out


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    runs = [r for r in result["runs"] if "error" not in r]
    hf_tps = result["hf"]["tokens_per_s"]
    # only stable paired speed-ups count (vs_hf None: the comparison stayed unstable)
    fp32 = [r for r in runs if r["precision"] == "fp32" and r["runner"] != "torch" and ":" not in r["runner"]
            and r["vs_hf"] is not None]
    best_fp32 = max(fp32, key=lambda r: r["tokens_per_s"], default=None)
    good = [r for r in runs if TARGETS["decode_best_agreement"].met(r["agreement"]) and r["runner"] != "torch"
            and r["vs_hf"] is not None]
    best = max(good, key=lambda r: r["tokens_per_s"], default=None)
    s: dict[str, Any] = {"hf_tokens_per_s": hf_tps}
    if best_fp32:
        s |= {"fp32_best": f"{best_fp32['runner']} fp32", "fp32_vs_hf": best_fp32["vs_hf"],
              "fp32_target_met": TARGETS["decode_fp32_vs_hf"].met(best_fp32["vs_hf"])}
    if best:
        s |= {"best_95pct": f"{best['runner']} {best['precision']}", "best_vs_hf": best["vs_hf"],
              "best_agreement": best["agreement"], "best_target_met": TARGETS["decode_best_vs_hf"].met(best["vs_hf"])}
    if "recompute" in result:
        s["cache_vs_recompute"] = result["recompute"]["cache_speedup_end_to_end"]
    return s


def render(result: dict[str, Any]) -> str:
    from xdeploy.reports.render import markdown_table

    rows = []
    for r in result["runs"]:
        if "error" in r:
            rows.append((r["runner"], r["precision"], f"unavailable: {r['error']}", *("–",) * 10))
            continue
        fd = "-" if r["first_divergence"] is None else str(r["first_divergence"])
        rows.append((r["runner"], r["precision"], f"{r['ttft_s'] * 1e3:.1f}", f"{r['step_p50_s'] * 1e3:.2f}",
                     f"{r['step_p90_s'] * 1e3:.2f}", f"{r['step_p99_s'] * 1e3:.2f}", f"{r['tokens_per_s']:.1f}",
                     f"{r['decode_tokens_per_s']:.1f}", speedup_of(r["stability"]), f"{r['agreement']:.3f}", fd,
                     f"{r['weight_bytes_per_token'] / 1e6:.0f}", roofline_pct(r["pct_of_roofline"])))
    lines = [f"decode benchmark, gpt small (GPT-2 124M, random HF init), batch 1, prompt {result['prompt_len']}, "
             f"{result['new_tokens']} new tokens, greedy, threads {result['threads'] or 'all'}",
             machine_line(result["machine"]),
             f"read bandwidth {result['bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s ({result['bandwidth']['how']})",
             f"Hugging Face transformers generate: {result['hf']['tokens_per_s']:.1f} tokens/s (median round; every "
             "generator and HF decode once per round, order rotated; x HF = median of paired round ratios, 95% "
             "interval, or unstable)", "",
             markdown_table(["runner", "precision", "TTFT ms", "step p50 ms", "p90", "p99", "tok/s", "decode tok/s",
                             "x HF", "agreement", "first div.", "MB/token", "% roofline"], rows)]
    lines += ["", "per-token latency (median ms) by context length:"]
    for r in result["runs"]:
        if "error" not in r:
            prof = ", ".join(f"{k}: {v * 1e3:.2f}" for k, v in r["by_context_s"].items())
            lines.append(f"  {r['runner']} {r['precision']}: {prof}")
    tf = result.get("teacher_forced") or {}
    if tf:
        lines.append(f"\nteacher-forced on the fp32 reference sequence: top-1 minus top-2 logit margin median "
                     f"{tf['margin_median']:.4f} (p10 {tf['margin_p10']:.4f}); ort per precision: " + ", ".join(
                         f"{p}: top-1 agreement {v['top1_agreement']:.3f}, |err| median {v['abs_err_median']:.4f}"
                         for p, v in tf.items() if isinstance(v, dict) and "top1_agreement" in v))
    if "recompute" in result:
        rc = result["recompute"]
        lines.append(f"\nrecompute-everything ({rc['runner']} fp32): {rc['tokens_per_s']:.2f} tokens/s end to end; "
                     f"the KV cache is {rc['cache_speedup_end_to_end']:.1f}x faster at {result['new_tokens']} new "
                     f"tokens (same tokens: {rc['same_tokens']})")
    if "transformer_parity" in result:
        tp = ", ".join(f"{k}: " + (v["error"] if "error" in v else " / ".join(
            f"{m} {x['agreement']:.3f} ({x['distinct_tokens']} distinct)" for m, x in v.items()))
            for k, v in result["transformer_parity"].items())
        lines.append(f"transformer base fp32, 128 greedy tokens, agreement with torch: {tp}")
    lines.append(f"summary: {json.dumps(result['summary'])}")
    return "\n".join(lines)


def roofline_pct(pct: float) -> str:
    """Never a figure above 100% of the bandwidth roofline: above it, the bandwidth was underestimated (a busy
    machine during `read_bandwidth`)."""
    return pct_of_peak(pct, peak="roofline", why="bandwidth underestimated")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xdeploy.studies.decode_bench", description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, help="tokens to generate (default 256; --quick: 64)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--runners", default="torch,ort,ov,ov:bf16")
    p.add_argument("--precisions", default="fp32,fp16,int8")
    p.add_argument("--quick", action="store_true", help="64 new tokens unless --new-tokens says otherwise, no "
                   "recompute run, no transformer parity")
    p.add_argument("--no-recompute", action="store_true")
    p.add_argument("--no-transformer", action="store_true", help="skip the transformer base parity run")
    p.add_argument("--artifacts", default=str(ROOT), help=f"where artifacts are kept and reused (default {ROOT})")
    p.add_argument("--threads", type=int, default=0,
                   help="threads for every runner and HF torch (0 = the cores free at the start)")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    new = a.new_tokens if a.new_tokens is not None else (64 if a.quick else 256)

    def compute() -> dict[str, Any]:
        if new < 1:
            raise XDeployError(f"--new-tokens must be >= 1, got {new}")
        return run(new=new, prompt_len=a.prompt_len, runners=tuple(a.runners.split(",")),
                   precisions=tuple(a.precisions.split(",")), recompute=not (a.quick or a.no_recompute),
                   seq2seq=not (a.quick or a.no_transformer), root=Path(a.artifacts), threads=a.threads)

    return finish("decode_bench", compute, render, a.json)


if __name__ == "__main__":
    sys.exit(main())
