"""xdeploy embed: sentences (one per line) -> embeddings (.npy or JSON lines) with an encoder artifact."""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

from xdeploy.commands import THREADS_HELP, add_json_option, write_json
from xdeploy.core.errors import InputError, XDeployError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", help="artifact directory exported from a sentence-transformers/BERT checkpoint")
    p.add_argument("--input", default="-", metavar="FILE|-",
                   help="UTF-8 text, one sentence per line (blank lines are empty sentences); default stdin")
    p.add_argument("--out", default="-", metavar="FILE.npy|FILE.jsonl|-",
                   help="float32 [n, d] .npy, or one JSON array per line; default: JSON lines on stdout")
    p.add_argument("--runner", default="ort", help="runner spec: ort, ov, ov:bf16, torch, ... (default ort)")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per model call (default 32)")
    p.add_argument("--pad-to", type=int, default=1, help="pad each batch's length to a multiple of this (default 1)")
    p.add_argument("--batching", choices=("cost", "fixed"), default="cost",
                   help="cost: cut length-sorted inputs where padding costs more than a call (default); fixed: "
                        "batches of --batch-size, as sentence-transformers")
    p.add_argument("--max-length", type=int, help="tokens per sentence (default: the artifact's pooling max_length)")
    p.add_argument("--truncation", choices=("right", "error"), default="right",
                   help="longer sentences: cut to max-length (default, counted) or refuse")
    p.add_argument("--threads", type=int, default=0, help=THREADS_HELP)
    p.add_argument("--tokenizer", choices=("hf", "graph"), default="hf",
                   help="hf: HF tokenizers; graph: the artifact's tokenizer graph (export --tokenizer-graph)")
    p.add_argument("--no-verify", action="store_true",
                   help="run the artifact without checking its golden probes on this machine (says so on stderr)")
    add_json_option(p)


def read_lines(source: str) -> list[bytes]:
    """Lines of FILE or stdin as bytes (decoded per line, so an error can name the line)."""
    if source == "-" and sys.stdin.isatty():  # a person at a terminal: say why nothing happens
        print("xdeploy embed: reading sentences from stdin, one per line; end with Ctrl-D (or pass --input FILE)",
              file=sys.stderr, flush=True)
    try:
        data = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
    except OSError as e:
        raise XDeployError(f"cannot read input {source}: {e.strerror or e}") from None
    if not data:
        raise XDeployError(f"input {'stdin' if source == '-' else source} is empty; expected one sentence per line")
    lines = data.split(b"\n")
    if lines[-1] == b"":  # a final newline ends the last line, it does not start a new one
        lines.pop()
    return [ln[:-1] if ln.endswith(b"\r") else ln for ln in lines]


def decode_lines(lines: list[bytes], source: str) -> list[str]:
    out = []
    for i, ln in enumerate(lines):
        try:
            out.append(ln.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise XDeployError(f"{source} line {i + 1} is not valid UTF-8 (byte {e.start} of the line)") from None
    return out


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from xdeploy.core.fsutil import atomic_write_bytes, atomic_write_text
    from xdeploy.deploy.embedder import Embedder

    out = args.out
    if out != "-" and not out.endswith((".npy", ".jsonl")):
        raise XDeployError(f"--out {out}: expected a file name ending in .npy or .jsonl, or - for stdout")
    # Load the artifact before reading the input: a wrong artifact path is reported as such, and a user
    # piping a large file learns about it before the file is read.
    with Embedder(args.artifact, args.runner, batch_size=args.batch_size, pad_to=args.pad_to,
                  batching=args.batching, max_length=args.max_length, truncation=args.truncation, threads=args.threads,
                  tokenizer=args.tokenizer, verify=not args.no_verify) as emb:
        source = "stdin" if args.input == "-" else args.input
        texts = decode_lines(read_lines(args.input), source)
        t0 = time.perf_counter()
        try:
            vecs, stats = emb.embed_with_stats(texts)
        except InputError as e:  # the Embedder counts inputs from 0; a file's lines are counted from 1
            raise XDeployError(f"{source} line {e.index + 1} {e.problem}") from None
        seconds = time.perf_counter() - t0
        info = emb.info()
    if out.endswith(".npy"):
        buf = io.BytesIO()
        np.save(buf, vecs)
        atomic_write_bytes(out, buf.getvalue())
    else:
        text = "".join(json.dumps([float(x) for x in row]) + "\n" for row in vecs)
        if out == "-":
            sys.stdout.write(text)
        else:
            atomic_write_text(out, text)
    print(f"embedded {stats.inputs} sentences -> {vecs.shape[1]}-d ({info['pooling']} pooling"
          f"{', L2-normalized' if info['normalize'] else ''}) in {seconds:.3f} s "
          f"({stats.inputs / seconds if seconds > 0 else 0.0:.1f} sentences/s, {stats.batches} batches); "
          f"truncated {stats.truncated} to {stats.max_length} tokens", file=sys.stderr)
    write_json(args.json, info | {"inputs": stats.inputs, "truncated": stats.truncated,
                                  "truncated_indices": list(stats.truncated_indices), "batches": stats.batches,
                                  "tokens": stats.tokens, "padded_tokens": stats.padded_tokens,
                                  "seconds": seconds, "out": out})
    return 0
