"""Import real checkpoints without network access: Hugging Face directories (config.json + model.safetensors)
and sentence-transformers directories (modules.json, pooling config, tokenizer files).

Weights are read only from safetensors; pickled weights (pytorch_model.bin, *.pt) are refused because
unpickling runs arbitrary code."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import sha256_file

# loading weights into a module lives beside the registry's `build` (which loads the tiny presets' trained weights)
from .registry import MODELS, build_loaded, check_finite, read_safetensors
from .sbert import TOKENIZER_FILES, Pooling, _read_json, _transformer_dir  # noqa: F401 - Pooling: this module's API


@dataclass
class Checkpoint:
    path: Path
    model: str  # registry name
    config: Any
    module: nn.Module
    kind: str  # "huggingface" | "sentence-transformers"
    sha256: str  # of the safetensors file
    pooling: Pooling | None = None  # sentence-transformers only
    tokenizer_files: list[Path] = field(default_factory=list)


def load_checkpoint(path: str | Path) -> Checkpoint:
    root = Path(path)
    if not root.exists():
        raise XDeployError(f"checkpoint directory {root} does not exist")
    if not root.is_dir():
        raise XDeployError(f"checkpoint {root} is a file; expected a checkpoint directory (a Hugging Face or "
                           "sentence-transformers model folder)")
    tdir, pooling = _transformer_dir(root)
    hf_config = _read_json(tdir / "config.json")
    model_type = hf_config.get("model_type")
    family = next((f for f in MODELS.values() if f.hf and model_type in f.hf.model_types), None)
    if family is None:
        supported = sorted(t for f in MODELS.values() if f.hf for t in f.hf.model_types)
        raise XDeployError(f"unsupported architecture model_type={model_type!r} in {tdir / 'config.json'}; "
                           f"supported: {', '.join(supported)}")
    weights = tdir / "model.safetensors"
    if not weights.exists():
        pickled = [p.name for p in tdir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl")]
        if pickled:
            raise XDeployError(f"refusing pickled weights {pickled[0]} in {tdir}: unpickling can run code; "
                               "convert the checkpoint to model.safetensors")
        raise XDeployError(f"checkpoint is missing model.safetensors (looked in {tdir})")
    try:
        cfg = family.hf.config(hf_config)
    except (KeyError, TypeError, ValueError) as e:
        raise XDeployError(f"cannot read {tdir / 'config.json'} as a {model_type} config: {e}") from None
    tensors = read_safetensors(weights)
    module = build_loaded(family, cfg, family.hf.state_dict(tensors, cfg), source=str(weights))
    check_finite(module)
    tok = [tdir / n for n in TOKENIZER_FILES if (tdir / n).exists()] or [
        root / n for n in TOKENIZER_FILES if (root / n).exists()]
    return Checkpoint(path=root, model=family.name, config=cfg, module=module,
                      kind="sentence-transformers" if pooling else "huggingface",
                      sha256=sha256_file(weights), pooling=pooling, tokenizer_files=tok)
