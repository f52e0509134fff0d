"""Text -> vector throughput: C++ runtime (xdeploy-embed --text, tokenizer graph) vs the Python Embedder
(tokenizer="hf" and tokenizer="graph"), at batch 1 and 32, interleaved.

    .venv/bin/python -m xdeploy.studies.text_embed_bench ARTIFACT --binary deploy/cpp/build/xdeploy-embed

Each round runs, in rotated order, one C++ process (`--time REPS`: REPS timed embed() calls after a warm-up
call, in process, model loaded once) and the two Python Embedders (same REPS timed calls); the per-call medians of
one round are paired, so a round's ratio compares runs under the same machine load. Printed: the median over
rounds of each side's per-call time (and sentences/s), the median paired ratio with its min..max over rounds,
and "unstable" when the ratio's spread exceeds 20%. Every side uses 1 intra-op thread (a fair 1-core figure on
a shared machine). Benchmark only; not a test.
"""

from __future__ import annotations

import argparse
import statistics
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
            med: dict[str, list[float]] = {k: [] for k in sides}
            names = list(sides)
            for r in range(a.rounds):
                for k in names[r % 3:] + names[:r % 3]:  # rotated order
                    med[k].append(statistics.median(sides[k]()))
            print(f"\nbatch {batch} ({a.rounds} rounds x {a.reps} calls):")
            for k in names:
                m = statistics.median(med[k])
                print(f"  {k:9s} {m * 1e3:8.3f} ms/call  {batch / m:9.1f} sentences/s  "
                      f"(round medians {min(med[k]) * 1e3:.3f}..{max(med[k]) * 1e3:.3f} ms)")
            for k in ("py-hf", "py-graph"):
                ratios = [p_ / c for p_, c in zip(med[k], med["cpp"])]
                m = statistics.median(ratios)
                spread = (max(ratios) - min(ratios)) / m
                print(f"  {k} / cpp time: median {m:.2f}x (rounds {min(ratios):.2f}..{max(ratios):.2f})"
                      + ("  UNSTABLE (spread > 20%)" if spread > 0.2 else ""))
            ratios = [g / h for g, h in zip(med["py-graph"], med["py-hf"])]
            print(f"  py-graph / py-hf time: median {statistics.median(ratios):.2f}x "
                  f"(rounds {min(ratios):.2f}..{max(ratios):.2f})")
            # tokenization alone (Embedder.tokenize: cut, tokenize, truncate), interleaved the same way
            tok: dict[str, list[float]] = {"hf": [], "graph": []}
            for r in range(a.rounds):
                for k, e in ((("hf", hf), ("graph", gr)) if r % 2 else (("graph", gr), ("hf", hf))):
                    e.tokenize(lines)
                    ts = []
                    for _ in range(a.reps * 5):
                        t0 = time.perf_counter()
                        e.tokenize(lines)
                        ts.append(time.perf_counter() - t0)
                    tok[k].append(statistics.median(ts))
            ratios = [g / h for g, h in zip(tok["graph"], tok["hf"])]
            print(f"  tokenize only: hf {statistics.median(tok['hf']) * 1e6:.0f} us, graph "
                  f"{statistics.median(tok['graph']) * 1e6:.0f} us per call; graph / hf median "
                  f"{statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}..{max(ratios):.2f})")


if __name__ == "__main__":
    main()
