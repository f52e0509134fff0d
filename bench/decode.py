"""Decoding benchmark of the main job: greedy decoding with the KV cache on each runner and artifact precision
(and one recompute-everything run), timed against the PyTorch fp32 reference and judged on its tokens.

    from xdeploy.bench.decode import decode_records
    records = decode_records({"fp32": path}, runners=["ort"], model="gpt", preset="tiny", threads=2,
                             new_tokens=16, prompt_len=8)

Every generator is timed in interleaved rounds with the PyTorch baseline, opened in memory-sized groups beside
it (bench/groups.py): all of them at once do not fit at base presets (GPT-2 small: 14 generators, each with its
own prefill and decode sessions, reached 21.5 GB on a 24 GB machine and was killed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError

from .groups import Group, grouped_comparison
from .interleave import Budget, Comparison, compare

BASELINE = "torch fp32"


def decode_records(paths: Mapping[str, Path], *, runners: Sequence[str], model: str, preset: str, threads: int,
                   new_tokens: int, prompt_len: int, min_rounds: int = 5, max_seconds: float = 8.0,
                   max_group: int | None = None, memory_limit: float | None = None, budget: Budget | None = None,
                   notes: Callable[[str], None] = lambda _text: None) -> list[dict[str, Any]]:
    """Validated "decode" records: one per generator (runner x precision of `paths`, in that order, plus one run
    of the first runner on fp32 without the cache) and one for the PyTorch baseline, from the first group's rounds.

    At most `max_group` generators are open beside the baseline (the memory guard's estimate), fewer when the
    ones opened so far show less memory left than two more would take. Tokens/s is from the median round, the
    speed-up over the baseline from paired rounds, re-measured once while unstable; rounds past `max_seconds`
    take what `budget` (the run's extra seconds) allows. A generator that cannot open is passed to `notes` and
    left out; the baseline must open (nothing else can be judged without it)."""
    from xdeploy.core.fingerprint import fingerprint
    from xdeploy.core.records import make_record
    from xdeploy.deploy.generate import GenerationConfig, Generator, token_agreement
    from xdeploy.deploy.registry import runner_class
    from xdeploy.export.artifact import load_artifact

    fp = fingerprint()
    arts = {p: load_artifact(path) for p, path in paths.items()}
    vocab = arts["fp32"].vocabulary.size
    prompt = [np.random.default_rng(0).integers(4, vocab - 1, size=prompt_len).tolist()]
    gc = GenerationConfig(max_new_tokens=new_tokens, eos_token_id=-1)  # never stop early: fixed work per run
    runs: dict[str, tuple[str, str, bool]] = {BASELINE: ("torch", "fp32", True)}
    runs |= {f"{r} {p}": (r, p, True) for p in arts for r in runners}
    runs[f"{runners[0]} fp32 no-cache"] = (runners[0], "fp32", False)
    gens: dict[str, Any] = {}
    ref: list[Any] = []  # the baseline's tokens
    recs: list[dict[str, Any]] = []

    def open_one(stack: contextlib.ExitStack, name: str) -> Callable[[], Any]:
        runner, prec, cache = runs[name]
        # opened as it is timed beside the others (deploy/base.py Runner.interleaved_options)
        g = stack.enter_context(Generator(arts[prec], runner, use_cache=cache, threads=threads,
                                          **runner_class(runner).interleaved_options))
        g.generate(prompt, dataclasses.replace(gc, max_new_tokens=2))  # warm-up: first-call allocations
        if name == BASELINE:
            ref.append(g.generate(prompt, gc))
        gens[name] = g
        return functools.partial(g.generate, prompt, gc)

    def failed(name: str, e: Exception) -> None:
        if name == BASELINE:  # without the reference nothing else can be judged
            raise e
        runner, prec, _cache = runs[name]
        notes(f"decode {model} {runner} {prec}: {e}")

    def measure(calls: dict[str, Callable[[], Any]], base: str | None) -> Comparison:
        # the group and the baseline decode the same prompt in rotated rounds (one generation per round each)
        cmp = compare(calls, baseline=base, attempts=2, warmup=0, min_block_s=0.0, min_rounds=min_rounds,
                      max_rounds=24, max_seconds=max_seconds,
                      extra_s=budget.allowance() if budget is not None else 0.0)
        if budget is not None:
            budget.spend(cmp.extra_s)
        return cmp

    def judge(group: Group) -> None:
        for name in group.names:
            runner, prec, _cache = runs[name]
            out = gens[name].generate(prompt, gc)  # tokens and per-step latencies for the report (one more run)
            agree = token_agreement(ref[0], out)
            med = group.comparison.series[name].median_s
            recs.append(make_record(
                "decode", fp, model=model, preset=preset, runner=runner, artifact_precision=prec, mode=out.mode,
                batch=1, prompt_len=prompt_len, new_tokens=out.new_tokens, ttft_s=out.time_to_first_token_s,
                step_s=list(out.step_s), tokens_per_s=out.new_tokens / med, total_s=med,
                agreement=agree.agreement, first_divergence=agree.first_divergence[0], threads=threads,
                stability=group.comparison.stability(name) | {
                    "group": group.number, "options": dict(runner_class(runner).interleaved_options)}))

    grouped_comparison(list(runs), open_one, measure, judge, failed, baseline=BASELINE, catch=XDeployError,
                       max_group=max_group, memory_limit=memory_limit)
    return recs
