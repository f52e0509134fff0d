"""Text -> vector throughput: C++ runtime (xdeploy-embed --text, tokenizer graph) vs the Python Embedder
(tokenizer="hf" and tokenizer="graph"), at batch 1 and 32, interleaved.

    .venv/bin/python -m xdeploy.studies.text_embed_bench ARTIFACT --binary deploy/cpp/build/xdeploy-embed

Each round runs, in rotated order, one C++ process (`--time REPS`: REPS timed embed() calls after a warm-up
call, in process, model loaded once) and the two Python Embedders (same REPS timed calls); bench/interleave.py
pairs the rounds (`run_timed_rounds`: a round's time is the mean of its REPS calls) and judges them (`judge`):
each side's median round time (and sentences/s) with its IQR, the paired speed-ups with their 95% interval, or
"unstable (load|noise)" past the thresholds of docs/benchmarks.md. Tokenization alone is an ordinary interleaved
`compare` of the two tokenizers. Every side uses 1 intra-op thread (a fair 1-core figure on a shared machine).
Benchmark only; not a test.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

SENTENCES = [
    "A man is playing a guitar.", "Stocks fell sharply after the central bank raised rates.",
    "How do I reset my password if I no longer have access to my email account?",
    "¿Dónde está la biblioteca?", "The quick brown fox jumps over the lazy dog.",
    "Researchers found that sleep improves memory consolidation in older adults.",
    "Café au lait with croissants, please.", "The new phone has a better camera and a longer battery life.",
]


def cpp_times(binary: str, artifact: str, lines: list[str], reps: int) -> list[float]:
    r = subprocess.run([binary, artifact, "--text", "--threads", "1", "--batch", "32", "--time", str(reps)],
                       input="".join(s + "\n" for s in lines).encode(), capture_output=True, timeout=600, check=True)
    line = next(ln for ln in r.stderr.decode().splitlines() if "seconds per embed() call" in ln)
    return [float(x) for x in line.split(":")[-1].split()]


def py_times(emb: object, lines: list[str], reps: int) -> list[float]:
    emb.embed(lines)  # warm-up, as the C++ side
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        emb.embed(lines)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    from xdeploy.bench.interleave import compare, judge, run_timed_rounds, speedup_text
    from xdeploy.core.fingerprint import fingerprint, summary
    from xdeploy.deploy.embedder import Embedder

    p = argparse.ArgumentParser()
    p.add_argument("artifact")
    p.add_argument("--binary", default=str(Path(__file__).resolve().parents[1] / "deploy/cpp/build/xdeploy-embed"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    print(f"machine: {summary(fingerprint())}; 1 intra-op thread per side")
    with Embedder(a.artifact, threads=1) as hf, Embedder(a.artifact, threads=1, tokenizer="graph") as gr:
        for batch in (1, 32):
            lines = [SENTENCES[i % len(SENTENCES)] + ("" if i < len(SENTENCES) else f" ({i})") for i in range(batch)]
            sides = {"cpp": lambda ln=lines: cpp_times(a.binary, a.artifact, ln, a.reps),
                     "py-hf": lambda ln=lines: py_times(hf, ln, a.reps),
                     "py-graph": lambda ln=lines: py_times(gr, ln, a.reps)}
            att = run_timed_rounds(sides, rounds=a.rounds)
            cmp = judge(att, baseline="py-hf")
            print(f"\nbatch {batch} ({a.rounds} rounds x {a.reps} calls; other processes used "
                  f"{cmp.load.other_cores or 0:.1f} cores):")
            for k, s in cmp.series.items():
                print(f"  {k:9s} {s.median_s * 1e3:8.3f} ms/call  {batch / s.median_s:9.1f} sentences/s  "
                      f"(round times IQR {s.rel_iqr:.0%} of median)")
            for k in ("cpp", "py-graph"):
                print(f"  {k} vs py-hf (py-hf time / {k} time, paired rounds): {speedup_text(cmp.stability(k))}")
            vs_graph = judge(att, baseline="py-graph").stability("cpp")  # the same rounds, paired the other way
            print(f"  cpp vs py-graph (py-graph time / cpp time, paired rounds): {speedup_text(vs_graph)}")
            # tokenization alone (Embedder.tokenize: cut, tokenize, truncate), interleaved the same way
            tok = compare({"hf": lambda ln=lines: hf.tokenize(ln), "graph": lambda ln=lines: gr.tokenize(ln)},
                          baseline="hf", min_rounds=a.rounds, max_rounds=a.rounds * 4, max_seconds=5.0)
            print(f"  tokenize only: hf {tok.series['hf'].median_s * 1e6:.0f} us, graph "
                  f"{tok.series['graph'].median_s * 1e6:.0f} us per call; graph vs hf (hf time / graph time): "
                  f"{speedup_text(tok.stability('graph'))}")

if __name__ == "__main__":
    main()
