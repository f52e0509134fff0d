"""KV-cache decoding on a GPU runner: token parity, and the loop's cache kept on the device against the host.

    python -m xdeploy.studies.gpu_decode --out /tmp/gd                       # on an NVIDIA GPU (ort-cuda)
    python -m xdeploy.studies.gpu_decode --runner ort --presets tiny         # the same path on the CPU

For each model that generates (the registry's decoders and encoder-decoders), at each preset: greedy and beam
tokens of `--runner` equal to onnxruntime's on the CPU (the loop's host cache), with the runner's loop arrays on
its device (Runner.loop_arrays: the KV cache, the step's K/V and an encoder-decoder's memory stay there) and on the
host (what ort-cuda did before: the whole cache copied in and the step's K/V out at every step); greedy agreement
with PyTorch fp32 on the first decoder at the largest preset; then the two placements timed in interleaved rounds
(bench/interleave.py compare: one `generate` of --new tokens from a --prompt-token prompt per call, batch 1,
paired speed-up with its 95% interval). On ort-cuda a third placement, the device cache with CUDA graphs (the runner's
default on the decode graph, option cuda_graph: each decode step one graph replay instead of one launch per
kernel; the first two placements run with cuda_graph=False), is checked and timed the same way (--no-cuda-graph
leaves it out). Writes <out>/gpu_decode.json and prints a table.

--precisions fp32,fp16 also exports the timed model at each precision and times them against each other with the
runner's defaults (CUDA graphs on ort-cuda), interleaved, the first one the baseline, each with its greedy agreement
with PyTorch fp32. --kernels adds a census of one timed generation per precision from torch's profiler (CUPTI sees
every kernel of the process, onnxruntime's too): kernels and memory copies per generated token, the GPU's busy time
per token against the wall time, and the kernels that take most of it -- whether a step is bound by its kernels'
work or by their number.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np


def _prompts(vocab: int, rows: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(4, vocab - 1, size=length - 2 * r).tolist() for r in range(rows)]


def _graphs(g: Any) -> int | None:
    """How many CUDA graphs the decode runner captured (None: graphs off, its note on stderr says why)."""
    graphs = getattr(g.decode, "graphs", None)
    return None if graphs is None else len(graphs.ids)


def _step_split(g: Any, prompt: list[list[int]], gc: Any, calls: int = 3) -> dict[str, float]:
    """Where a generated token's time goes: the decode runner's bound step call (the engine's run with its copies
    in and out: for CUDA graphs, the replay) against the whole token (the loop's token choice, slot write and
    bookkeeping besides), medians over `calls` generations; the bound call is wrapped only here."""
    runner, spent = g.decode, []
    bind = runner.bind

    def timed_bind(inputs: Any, outputs: Any) -> Any:
        call = bind(inputs, outputs)

        def timed() -> None:
            t = time.perf_counter()
            call()
            spent.append(time.perf_counter() - t)
        return timed

    runner.bind = timed_bind
    try:
        per_token = []
        for _ in range(calls):
            t = time.perf_counter()
            out = g.generate(prompt, gc)
            per_token.append((time.perf_counter() - t - out.time_to_first_token_s) / max(gc.max_new_tokens - 1, 1))
    finally:
        del runner.bind  # the instance attribute: the class's method again
    return {"bound_call_ms": 1e3 * float(np.median(spent)), "token_ms": 1e3 * float(np.median(per_token)),
            "bound_calls": len(spent)}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _kernels(generate: Any, tokens: int, top: int = 8) -> dict[str, Any]:
    """One `generate()` under torch's profiler (CUDA activity only): kernel launches and device time per token."""
    import collections

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    count: collections.Counter[str] = collections.Counter()
    spent: collections.Counter[str] = collections.Counter()  # microseconds
    for e in prof.events():
        if e.device_type != DeviceType.CPU:
            count[e.name] += 1
            spent[e.name] += e.time_range.elapsed_us()
    copies = {k for k in count if k.lower().startswith(("memcpy", "memset"))}
    busy_us = sum(v for k, v in spent.items() if k not in copies)
    by_time = [k for k, _ in spent.most_common() if k not in copies][:top]
    return {"tokens": tokens, "kernels_per_token": sum(v for k, v in count.items() if k not in copies) / tokens,
            "copies_per_token": sum(count[k] for k in copies) / tokens,
            "kernel_ms_per_token": busy_us / 1e3 / tokens,
            "copy_ms_per_token": sum(spent[k] for k in copies) / 1e3 / tokens, "wall_ms_per_token": 1e3 * wall / tokens,
            "top": [{"kernel": k[:90], "calls": count[k], "share": spent[k] / busy_us} for k in by_time]}


def _precision_timing(model: str, preset: str, precisions: list[str], out: Path, runner: str, prompt: list[list[int]],
                      gc: Any, max_seconds: float, kernels: bool, ref_tokens: Any) -> dict[str, Any]:
    """The timed model at each precision on `runner` with its defaults, interleaved; baseline the first."""
    from xdeploy.bench.interleave import compare
    from xdeploy.deploy.generate import Generator, token_agreement
    from xdeploy.export.artifact import load_artifact
    from xdeploy.export.onnx_export import export

    gens, failed = {}, {}
    for p in precisions:
        path = out / "artifacts" / f"{model}-{preset}" if p == "fp32" else out / "artifacts" / f"{model}-{preset}-{p}"
        precision, *more = p.split("+")  # fp16+opt: optimized (export/optimize.py); +opset18: another opset
        kw: dict[str, Any] = {"optimize": "opt" in more}
        kw |= [("opset", int(m[5:])) for m in more if m.startswith("opset")]
        try:
            art = load_artifact(path if (path / "manifest.json").is_file()
                                else export(model, preset=preset, precision=precision, out=path, **kw))
            gens[p] = Generator(art, runner, kv_cache="loop")
        except Exception as e:  # noqa: BLE001 - a study: a precision the runner cannot take is a finding
            failed[p] = f"{type(e).__name__}: {e}"
            print(f"{model} {preset} {p} on {runner}: {failed[p]}", flush=True)
    precisions = [p for p in precisions if p in gens]
    try:
        last: dict[str, Any] = {}
        calls = {p: (lambda p=p: last.__setitem__(p, gens[p].generate(prompt, gc))) for p in precisions}
        c = compare(calls, baseline=precisions[0], min_rounds=5, max_seconds=max_seconds)
        res: dict[str, Any] = {
            "model": model, "preset": preset, "runner": runner, "failed": failed,
            "modes": {p: g.mode for p, g in last.items()},
            "tokens_per_s": {p: gc.max_new_tokens / s.median_s for p, s in c.series.items()},
            "ttft_ms_last": {p: 1e3 * g.time_to_first_token_s for p, g in last.items()},
            "speedup_over": precisions[0],
            "speedups": {p: {"median": v.median, "low": v.low, "high": v.high, "rounds": v.rounds,
                             "verdict": c.verdict(p)} for p, v in c.speedups.items() if p != precisions[0]},
            "cuda_graphs_captured": {p: _graphs(g) for p, g in gens.items()},
            "agreement_with_torch": {p: token_agreement(ref_tokens, g.tokens).agreement for p, g in last.items()}}
        if kernels and not _cuda():
            res["kernels"] = "left out: torch sees no CUDA device"
        elif kernels:
            res["kernels"] = {}
            for p in precisions:
                try:
                    res["kernels"][p] = _kernels(lambda p=p: gens[p].generate(prompt, gc), gc.max_new_tokens)
                except Exception as e:  # noqa: BLE001 - the profiler's failure must not lose the timings
                    res["kernels"][p] = f"{type(e).__name__}: {e}"
    finally:
        for g in gens.values():
            g.close()
    print(json.dumps({"precisions": res}, indent=1), flush=True)
    return res


def _check(row: dict[str, Any], g: Any, prompts: list[list[int]], configs: tuple[Any, ...],
           want: list[Any]) -> dict[str, Any]:
    """Greedy and beam tokens of `g` against onnxruntime CPU's (`want`), as one printed row."""
    from xdeploy.deploy.generate import token_agreement

    try:
        got = [g.generate(prompts, c).tokens for c in configs]
    except Exception as e:  # noqa: BLE001 - a study: the failure is the finding, kept in the row
        row |= {"greedy_equal": False, "error": f"{type(e).__name__}: {e}"}
    else:
        row |= {"greedy_equal": got[0] == want[0], "beam_equal": got[1] == want[1],
                "greedy_agreement": token_agreement(want[0], got[0]).agreement, "cuda_graphs": _graphs(g)}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    from xdeploy.bench.interleave import compare
    from xdeploy.core.fsutil import atomic_write_json
    from xdeploy.deploy.base import LoopArrays
    from xdeploy.deploy.generate import GenerationConfig, Generator, token_agreement
    from xdeploy.export.artifact import load_artifact
    from xdeploy.export.onnx_export import export
    from xdeploy.models.registry import MODELS, families

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runner", default="ort-cuda")
    ap.add_argument("--presets", default="tiny,small", help="presets to export and check (the last one is timed)")
    ap.add_argument("--models", default="", help="default: every registered model that generates")
    ap.add_argument("--new", type=int, default=128, help="new tokens per timed call")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per timed call")
    ap.add_argument("--max-seconds", type=float, default=20.0)
    ap.add_argument("--out", default="reports/gpu/decode")
    ap.add_argument("--no-cuda-graph", action="store_true", help="leave out the CUDA-graph placement (ort-cuda)")
    ap.add_argument("--precisions", default="fp32", help="precisions of the timed model to time against each other; "
                    "a '+opt' suffix optimizes the export (onnxruntime's fusions), '+opset18' picks its opset")
    ap.add_argument("--kernels", action="store_true", help="a kernel census per precision (torch's profiler, CUDA)")
    a = ap.parse_args(argv)
    graph = a.runner == "ort-cuda" and not a.no_cuda_graph
    plain = {"cuda_graph": False} if a.runner == "ort-cuda" else {}  # the decode graph's default is on
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    models = [m for m in a.models.split(",") if m] or [f.name for f in families(generates=True)]
    presets = [p for p in a.presets.split(",") if p]
    greedy = GenerationConfig(max_new_tokens=16, eos_token_id=-1)
    beams = GenerationConfig(max_new_tokens=12, num_beams=4, eos_token_id=-1)
    result: dict[str, Any] = {"runner": a.runner, "checks": [], "timing": None}
    for preset in presets:
        for model in models:
            if preset not in MODELS[model].presets:
                continue
            t0 = time.perf_counter()
            path = out / "artifacts" / f"{model}-{preset}"
            art = load_artifact(path if (path / "manifest.json").is_file() else export(model, preset=preset, out=path))
            prompts = _prompts(art.config.vocab_size, 2, 8)
            with Generator(art, "ort", kv_cache="loop") as ref, Generator(art, a.runner, kv_cache="loop", **plain) as g:
                want = [ref.generate(prompts, c).tokens for c in (greedy, beams)]
                device = g.decode.loop_arrays()
                for where, arrays in (("device", device), ("host", LoopArrays())):
                    g.decode.loop_arrays = lambda arrays=arrays: arrays  # this instance only
                    row = {"model": model, "preset": preset, "arrays": f"{where} ({arrays.device})"}
                    result["checks"].append(_check(row, g, prompts, (greedy, beams), want))
                if graph:
                    with Generator(art, a.runner, kv_cache="loop", cuda_graph=True) as gg:
                        row = {"model": model, "preset": preset, "arrays": "device, CUDA graphs"}
                        result["checks"].append(_check(row, gg, prompts, (greedy, beams), want))
            print(f"{model} {preset}: export and checks {time.perf_counter() - t0:.1f} s", flush=True)
    model, preset = models[0], presets[-1]
    art = load_artifact(out / "artifacts" / f"{model}-{preset}")
    prompt = _prompts(art.config.vocab_size, 1, a.prompt)
    gc = GenerationConfig(max_new_tokens=a.new, eos_token_id=-1)
    with Generator(art, a.runner, kv_cache="loop", **plain) as g, \
            (Generator(art, a.runner, kv_cache="loop", cuda_graph=True) if graph else nullcontext()) as gg:
        device = g.decode.loop_arrays()
        calls, last = {}, {}
        for where, arrays in (("host cache", LoopArrays()), ("device cache", device)):
            def call(arrays: Any = arrays, where: str = where) -> None:
                g.decode.loop_arrays = lambda: arrays
                last[where] = g.generate(prompt, gc)
            calls[where] = call
        if gg is not None:
            def call_graph() -> None:
                last["CUDA graphs"] = gg.generate(prompt, gc)
            calls["CUDA graphs"] = call_graph
        c = compare(calls, baseline="device cache", min_rounds=5, max_seconds=a.max_seconds)
        captured = None if gg is None else _graphs(gg)
        g.decode.loop_arrays = lambda: device
        split = {"device cache": _step_split(g, prompt, gc)}
        if gg is not None:
            split["CUDA graphs"] = _step_split(gg, prompt, gc)
        print(json.dumps({"step_split": split}), flush=True)
    with Generator(art, "torch") as t:
        ref = t.generate(prompt, gc)
    precisions = [p for p in a.precisions.split(",") if p]
    if len(precisions) > 1 or a.kernels:
        result["precisions"] = _precision_timing(model, preset, precisions, out, a.runner, prompt, gc, a.max_seconds,
                                                 a.kernels, ref.tokens)
    sp = {k: c.speedups[k] for k in calls if k != "device cache"}
    timing = {"model": model, "preset": preset, "batch": 1, "prompt": a.prompt, "new": a.new,
              "per_call_s": {k: s.median_s for k, s in c.series.items()},
              "tokens_per_s": {k: a.new / s.median_s for k, s in c.series.items()},
              "ttft_ms_last": {k: 1e3 * g_.time_to_first_token_s for k, g_ in last.items()},
              "speedup_over_device_cache": {k: {"median": v.median, "low": v.low, "high": v.high, "rounds": v.rounds,
                                              "verdict": c.verdict(k)} for k, v in sp.items()},
              "cuda_graphs_captured": captured, "step_split": split,
              "agreement_with_torch": {k: token_agreement(ref.tokens, g_.tokens).agreement for k, g_ in last.items()}}
    result["timing"] = timing
    atomic_write_json(out / "gpu_decode.json", result)
    print(json.dumps(timing, indent=1))
    ok = all(r["greedy_equal"] for r in result["checks"]) and all(
        v == 1.0 for v in timing["agreement_with_torch"].values())
    # a reduced precision may leave PyTorch fp32's greedy path (a finding, printed), not a failed check
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
