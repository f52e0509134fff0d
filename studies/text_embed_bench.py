"""Text -> vector: the C++ runtime (xdeploy-embed --text, its own tokenizer, HF-exact) vs the Python Embedder
(HF tokenizers), at batch 1 and 32, interleaved; tokenization alone reported separately.

    .venv/bin/python -m xdeploy.studies.text_embed_bench ARTIFACT --binary deploy/cpp/build/xdeploy-embed

Each round runs, in rotated order, one C++ process (`--time REPS`: REPS timed embed() calls after a warm-up
call, in process, model loaded once) and the Python Embedder (same REPS timed calls); bench/interleave.py pairs
the rounds (`run_timed_rounds`: a round's time is the mean of its REPS calls) and judges them (`judge`): each
side's median round time (and sentences/s) with its IQR, the paired speed-up with its 95% interval, or
"unstable (load|noise)" past the thresholds of docs/benchmarks.md. Tokenization alone is paired the same way:
C++ `tokenize()` timed in process (`--text --print-ids --time REPS`) against `Embedder.tokenize` (HF tokenizers).
Every side uses 1 intra-op thread (a fair 1-core figure on a shared machine). Benchmark only; not a test.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

SENTENCES = [
    "A man is playing a guitar.", "Stocks fell sharply after the central bank raised rates.",
    "How do I reset my password if I no longer have access to my email account?",
    "¿Dónde está la biblioteca?", "The quick brown fox jumps over the lazy dog.",
    "Researchers found that sleep improves memory consolidation in older adults.",
    "Café au lait with croissants, please.", "The new phone has a better camera and a longer battery life.",
]


def cpp_times(binary: str, artifact: str, lines: list[str], reps: int, *, tokenize_only: bool = False
              ) -> list[float]:
    what = "tokenize()" if tokenize_only else "embed()"
    r = subprocess.run([binary, artifact, "--text", "--threads", "1", "--batch", "32", "--time", str(reps),
                        *(["--print-ids"] if tokenize_only else [])],
                       input="".join(s + "\n" for s in lines).encode(), capture_output=True, timeout=600, check=True)
    line = next(ln for ln in r.stderr.decode().splitlines() if f"seconds per {what} call" in ln)
    return [float(x) for x in line.split(":")[-1].split()]


def py_times(fn: Callable[[list[str]], object], lines: list[str], reps: int) -> list[float]:
    """Seconds of each of `reps` timed calls fn(lines) after one warm-up call, as the C++ side times them."""
    fn(lines)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(lines)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    from xdeploy.bench.interleave import judge, run_timed_rounds
    from xdeploy.core.fingerprint import fingerprint, summary
    from xdeploy.deploy.embedder import Embedder
    from xdeploy.reports.text import speedup_of

    p = argparse.ArgumentParser()
    p.add_argument("artifact")
    p.add_argument("--binary", default=str(Path(__file__).resolve().parents[1] / "deploy/cpp/build/xdeploy-embed"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    print(f"machine: {summary(fingerprint())}; 1 intra-op thread per side")
    with Embedder(a.artifact, threads=1) as hf:
        for batch in (1, 32):
            lines = [SENTENCES[i % len(SENTENCES)] + ("" if i < len(SENTENCES) else f" ({i})") for i in range(batch)]
            sides = {"cpp": lambda ln=lines: cpp_times(a.binary, a.artifact, ln, a.reps),
                     "py-hf": lambda ln=lines: py_times(hf.embed, ln, a.reps)}
            cmp = judge(run_timed_rounds(sides, rounds=a.rounds), baseline="py-hf")
            print(f"\nbatch {batch} ({a.rounds} rounds x {a.reps} calls; other processes used "
                  f"{cmp.load.other_cores or 0:.1f} cores):")
            for k, s in cmp.series.items():
                print(f"  {k:9s} {s.median_s * 1e3:8.3f} ms/call  {batch / s.median_s:9.1f} sentences/s  "
                      f"(round times IQR {s.rel_iqr:.0%} of median)")
            print(f"  cpp vs py-hf (py-hf time / cpp time, paired rounds): {speedup_of(cmp.stability('cpp'))}")
            # tokenization alone: C++ tokenize() in process vs Embedder.tokenize (cut, tokenize, truncate)
            toks = {"cpp": lambda ln=lines: cpp_times(a.binary, a.artifact, ln, a.reps * 10, tokenize_only=True),
                    "py-hf": lambda ln=lines: py_times(hf.tokenize, ln, a.reps * 10)}
            tok = judge(run_timed_rounds(toks, rounds=a.rounds), baseline="py-hf")
            print(f"  tokenize only: cpp {tok.series['cpp'].median_s * 1e6:.1f} us, py-hf "
                  f"{tok.series['py-hf'].median_s * 1e6:.1f} us per call; cpp vs py-hf (py-hf time / cpp time): "
                  f"{speedup_of(tok.stability('cpp'))}")


if __name__ == "__main__":
    main()
