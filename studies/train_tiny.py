"""Train the weights of the tiny presets (models/weights/*.safetensors), so parity verdicts judge real margins.

    python -m xdeploy.studies.train_tiny --model gpt          # ~3 min, 1 thread -> models/weights/gpt-tiny.safetensors
    python -m xdeploy.studies.train_tiny --model vit          # ~30 s, 1 thread -> models/weights/vit-tiny.safetensors
    python -m xdeploy.studies.train_tiny --model vit --out /tmp/vit.safetensors --json /tmp/vit.json

A randomly initialised ViT's logits are nearly flat and a random GPT's greedy tokens arbitrary, so "fp16/int8 agree
with fp32 on top-1" says little about them. Trained, the same shapes make decisions with margins:

  gpt tiny  a byte-level language model (token = UTF-8 byte 0..255; 511 = EOS between documents; 256..510 unused)
            of this repository's Markdown: README.md and docs/*.md, except HELD_OUT, whose loss is reported;
            next-byte cross-entropy, AdamW, random windows: 32 of 128 bytes a step, every fourth step 16 of 256
            (so the whole position table is trained)
  vit tiny  scikit-learn's bundled digits (8x8, 10 classes; load_digits, no download), 80/20 split with a seeded
            permutation, upsampled to 32x32 bilinearly, 3 channels by repetition, scaled to [-1, 1] (the range of
            export/calibration.py's synthetic images: ViT's 0.5/0.5 normalization); random shifts of up to 3 pixels

Everything is seeded (torch, the sampling generator, the split) and runs on the CPU with a fixed thread count (1 by
default: the sums, so the bytes, depend on it, and on a shared 2-core machine one thread trained ~5x faster than two
fighting the other jobs for the cores), so a rerun on the same text and torch version writes the same bytes (the
record holds the text's sha256: the Markdown changes with the repository). The file holds fp32 tensors only, read
back by models/registry.py `build` (safetensors, never pickle); its metadata (METADATA_KEY) records the recipe and
the held-out figures. The export cache keys on the source of models/*.py, not on these files: after retraining,
export with --fresh.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError

from . import finish

ROOT = Path(__file__).resolve().parents[1]  # the checkout (an editable install): README.md and docs/ are the text
HELD_OUT = "docs/generate.md"  # the language model never sees this page; its loss is the held-out figure
SEED = 0
PROMPT = "The "
METADATA_KEY = "xdeploy.train_tiny"  # the file's safetensors metadata: this record as JSON (recipe, held-out figures)


@dataclass(frozen=True)
class Recipe:
    """Optimiser and schedule: AdamW, linear warm-up then cosine decay to lr/10, gradient norm clipped."""

    steps: int
    batch: int
    lr: float
    warmup: int
    weight_decay: float
    clip: float = 1.0
    seq: int = 0  # language model: window length (0 for the image model)
    # language model: all steps but every `long_every`-th draw twice as many windows of half the length (the same
    # bytes per step): more, shorter windows get past the early plateau (loss ~2.6, byte frequencies only) much
    # sooner, and the full-length steps train the upper half of the position table alongside (0: always full length)
    long_every: int = 0
    shift: int = 0  # image model: the largest random translation in pixels


RECIPES = {
    "gpt": Recipe(steps=1500, batch=16, seq=256, long_every=4, lr=8e-3, warmup=30, weight_decay=0.1),
    "vit": Recipe(steps=1500, batch=64, lr=2e-3, warmup=50, weight_decay=0.05, shift=3),
}


# ------------------------------------------------------------------------------------------------- data ----

def text_files(root: Path = ROOT) -> tuple[list[Path], Path]:
    """(training pages, the held-out page): README.md and docs/*.md of the checkout."""
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    held = root / HELD_OUT
    missing = [p for p in (*pages[:1], held) if not p.is_file()]
    if missing:
        raise XDeployError(f"training text {missing[0]} not found: run from a checkout of the repository")
    return [p for p in pages if p != held], held


def encode(text: str) -> list[int]:
    """Byte-level tokens: the UTF-8 bytes (0..255)."""
    return list(text.encode("utf-8"))


def decode(ids: Sequence[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def byte_corpus(root: Path = ROOT, eos: int = 511) -> tuple[Any, Any]:
    """(training ids, held-out ids) as int64 tensors; each training page ends with `eos`, so the model learns where
    a page ends (generation stops there)."""
    import torch

    train_pages, held = text_files(root)
    ids: list[int] = []
    for p in train_pages:
        ids += [*encode(p.read_text(encoding="utf-8")), eos]
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(encode(held.read_text(encoding="utf-8")))


def windows(ids: Any, seq: int, limit: int | None = None) -> Any:
    """Non-overlapping (n, seq + 1) windows of `ids` (inputs and their next-byte targets), at most `limit`."""
    n = (len(ids) - 1) // seq
    n = n if limit is None else min(n, limit)
    return ids[: n * seq + 1].unfold(0, seq + 1, seq)[:n] if n else ids[:0].view(0, seq + 1)


def digits(split: str) -> tuple[Any, Any]:
    """scikit-learn's digits as ViT tiny's inputs: (n, 3, 32, 32) float32 in [-1, 1] and (n,) labels.
    `split` "train" (80%) or "test" (the other 20%, by a seeded permutation)."""
    import torch
    import torch.nn.functional as F

    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise XDeployError("the digits need scikit-learn (pip install scikit-learn)") from None
    d = load_digits()
    order = np.random.default_rng(SEED).permutation(len(d.target))
    cut = int(0.8 * len(order))
    idx = {"train": order[:cut], "test": order[cut:]}[split]
    x = torch.tensor(d.images[idx] / 16.0, dtype=torch.float32).unsqueeze(1)  # (n, 1, 8, 8) in [0, 1]
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False).clamp(0, 1)
    return (x * 2 - 1).repeat(1, 3, 1, 1).contiguous(), torch.tensor(d.target[idx], dtype=torch.int64)


# ---------------------------------------------------------------------------------------------- metrics ----

def lm_loss(module: Any, ids: Any) -> float:
    """Mean next-byte cross-entropy (nats) of (n, seq + 1) windows."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        x, y = ids[:, :-1], ids[:, 1:]
        logits, _ = module(x, torch.ones_like(x))
        return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))


def greedy(module: Any, prompt: str, n: int, eos: int = 511) -> list[int]:
    """`n` greedy bytes after `prompt` (recomputing the prefix each step: a reference, not a fast path)."""
    import torch

    ids = encode(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([ids + out])
            logits, _ = module(x, torch.ones_like(x))
            tok = int(logits[0, -1].argmax())
            out.append(tok)
            if tok == eos:
                break
    return out


def accuracy(module: Any, x: Any, y: Any) -> float:
    import torch

    with torch.no_grad():
        return float((module(x).argmax(-1) == y).float().mean())


# --------------------------------------------------------------------------------------------- training ----

def _lr(r: Recipe, step: int) -> float:
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    t = (step - r.warmup) / max(1, r.steps - r.warmup)
    return r.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _optimizer(module: Any, r: Recipe) -> Any:
    import torch

    # decay the matrices only: norms, biases, the class token and the position tables would just be pulled to 0
    params = list(module.named_parameters())
    decays = {n: p.dim() >= 2 and not n.startswith(("pos", "wpe")) for n, p in params}
    return torch.optim.AdamW([{"params": [p for n, p in params if decays[n]], "weight_decay": r.weight_decay},
                              {"params": [p for n, p in params if not decays[n]], "weight_decay": 0.0}],
                             lr=r.lr, betas=(0.9, 0.95))


def _gpt2_init(module: Any, n_layers: int) -> None:
    """GPT-2's initialisation (std 0.02, residual projections scaled by 1/sqrt(2 layers)): the module's own default
    draws embeddings from N(0, 1), which with the tied head starts at logits of std ~8 and a loss far above ln 256."""
    import torch
    from torch import nn

    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("attn.out", "ffn.fc2")) else 0.02
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)
    with torch.no_grad():
        module.wpe.weight.mul_(0.5)


def _step(module: Any, opt: Any, r: Recipe, step: int, loss: Any) -> None:
    import torch

    for g in opt.param_groups:
        g["lr"] = _lr(r, step)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), r.clip)
    opt.step()


def train_gpt(module: Any, cfg: Any, r: Recipe, log: Any) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    train, held = byte_corpus(eos=cfg.eos_token_id)
    _gpt2_init(module, cfg.n_layers)
    gen = torch.Generator().manual_seed(SEED)
    opt = _optimizer(module, r)
    module.train()
    recent: list[float] = []
    for step in range(r.steps):
        full = not r.long_every or step % r.long_every == r.long_every - 1
        seq, rows = (r.seq, r.batch) if full else (r.seq // 2, 2 * r.batch)
        starts = torch.randint(0, len(train) - seq - 1, (rows,), generator=gen)
        batch = torch.stack([train[s: s + seq + 1] for s in starts.tolist()])
        x, y = batch[:, :-1], batch[:, 1:]
        logits, _ = module(x, torch.ones_like(x))
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
        _step(module, opt, r, step, loss)
        recent = (recent + [loss.item()])[-50:]
        if step % 100 == 0 or step == r.steps - 1:
            log(f"step {step:5d}  train loss {sum(recent) / len(recent):.3f}  lr {_lr(r, step):.2e}")
    module.eval()
    held_loss = lm_loss(module, windows(held, r.seq))
    train_loss = lm_loss(module, windows(train, r.seq, limit=64))
    cont = greedy(module, PROMPT, 64, cfg.eos_token_id)
    return {"data": f"README.md + docs/*.md except {HELD_OUT} ({len(train)} bytes, pages joined by EOS)",
            # the pages change with the repository: the same text (and thread count) gives the same bytes
            "data_sha256": hashlib.sha256(np.asarray(train, dtype=np.int16).tobytes()).hexdigest(),
            "held_out": f"{HELD_OUT} ({len(held)} bytes)", "train_loss": round(train_loss, 4),
            "held_out_loss": round(held_loss, 4), "held_out_bits_per_byte": round(held_loss / math.log(2), 3),
            "uniform_loss": round(math.log(256), 4), "prompt": PROMPT, "greedy": decode(cont)}


def _shift(x: Any, k: int, gen: Any) -> Any:
    """Each image translated by up to `k` pixels each way, the uncovered border filled with background (-1)."""
    import torch
    import torch.nn.functional as F

    if not k:
        return x
    h = x.shape[-1]
    padded = F.pad(x, (k, k, k, k), value=-1.0)
    dy, dx = torch.randint(0, 2 * k + 1, (2, x.shape[0]), generator=gen).tolist()
    return torch.stack([padded[i, :, a: a + h, b: b + h] for i, (a, b) in enumerate(zip(dy, dx))])


def train_vit(module: Any, cfg: Any, r: Recipe, log: Any) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    x, y = digits("train")
    xt, yt = digits("test")
    gen = torch.Generator().manual_seed(SEED)
    opt = _optimizer(module, r)
    module.train()
    recent: list[float] = []
    for step in range(r.steps):
        pick = torch.randint(0, len(y), (r.batch,), generator=gen)
        loss = F.cross_entropy(module(_shift(x[pick], r.shift, gen)), y[pick])
        _step(module, opt, r, step, loss)
        recent = (recent + [loss.item()])[-50:]
        if step % 100 == 0 or step == r.steps - 1:
            log(f"step {step:5d}  train loss {sum(recent) / len(recent):.3f}  lr {_lr(r, step):.2e}")
    module.eval()
    return {"data": f"sklearn load_digits, 80% ({len(y)} images), 8x8 -> 32x32 bilinear, [-1, 1], 3 channels",
            "held_out": f"the other 20% ({len(yt)} images)", "train_accuracy": round(accuracy(module, x, y), 4),
            "held_out_accuracy": round(accuracy(module, xt, yt), 4)}


TRAINERS = {"gpt": train_gpt, "vit": train_vit}


def run(model: str, preset: str = "tiny", out: str | Path | None = None, threads: int = 1,
        steps: int | None = None) -> dict[str, Any]:
    import torch
    from safetensors.torch import save

    from xdeploy.core.fsutil import atomic_write_bytes, sha256_file
    from xdeploy.models.registry import WEIGHTS_DIR, build, get_config

    if model not in TRAINERS:
        raise XDeployError(f"no training recipe for model {model!r}; expected one of: {', '.join(TRAINERS)}")
    cfg = get_config(model, preset)
    if out is None:
        if not cfg.weights:
            raise XDeployError(f"{model} {preset} names no weights file; pass --out")
        out = WEIGHTS_DIR / cfg.weights
    r = RECIPES[model] if steps is None else dataclasses.replace(RECIPES[model], steps=steps)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the thread count changes the float sums, so it is part of the recipe
    try:
        module = build(model, dataclasses.replace(cfg, weights=None), seed=SEED)  # the random start, not the file
        t0 = time.perf_counter()
        result = TRAINERS[model](module, cfg, r, lambda s: print(s, file=sys.stderr, flush=True))
        seconds = time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)  # run() is also called in-process (the tests)
    record = {"model": model, "preset": preset, "recipe": dataclasses.asdict(r), "seed": SEED, "threads": threads,
              "torch": torch.__version__} | result
    tensors = {k: v.detach().float().contiguous() for k, v in module.state_dict().items()}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    # one metadata entry holding sorted JSON: safetensors writes its metadata map in hash order, so several
    # entries would make two identical trainings differ in bytes
    atomic_write_bytes(out, save(tensors, metadata={METADATA_KEY: json.dumps(record, sort_keys=True)}))
    return {"model": model, "preset": preset, "out": str(out), "bytes": Path(out).stat().st_size,
            "sha256": sha256_file(out), "recipe": dataclasses.asdict(r), "threads": threads,
            "train_seconds": round(seconds, 1)} | result


def render(r: dict[str, Any]) -> str:
    lines = [f"{r['model']} {r['preset']}: {r['out']} ({r['bytes'] / 1024:.0f} KiB, sha256 {r['sha256'][:12]}), "
             f"trained in {r['train_seconds']:.0f} s on {r['threads']} threads", f"  data: {r['data']}",
             f"  held out: {r['held_out']}"]
    if "held_out_loss" in r:
        lines += [f"  loss (nats/byte): train {r['train_loss']:.3f}, held out {r['held_out_loss']:.3f} "
                  f"({r['held_out_bits_per_byte']:.2f} bits/byte; uniform over bytes: {r['uniform_loss']:.3f})",
                  f"  greedy after {r['prompt']!r}: {r['greedy']!r}"]
    else:
        lines.append(f"  accuracy: train {r['train_accuracy']:.1%}, held out {r['held_out_accuracy']:.1%}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xdeploy.studies.train_tiny", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, choices=sorted(TRAINERS))
    p.add_argument("--preset", default="tiny", help="the preset whose shapes are trained (default tiny)")
    p.add_argument("--out", help="where to write the safetensors file (default: the file the preset names, in "
                   "models/weights/)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1, what the shipped files were trained with; the bytes depend on it)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the recipe's)")
    p.add_argument("--json", metavar="FILE", help="also write the record as JSON")
    a = p.parse_args(argv)
    return finish("train_tiny", lambda: run(a.model, a.preset, a.out, a.threads, a.steps), render, a.json)


if __name__ == "__main__":
    sys.exit(main())
