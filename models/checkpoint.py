"""Import real checkpoints without network access: Hugging Face directories (config.json + model.safetensors)
and sentence-transformers directories (modules.json, pooling config, tokenizer files).

Weights are read only from safetensors; pickled weights (pytorch_model.bin, *.pt) are refused because
unpickling runs arbitrary code."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import sha256_file

# load_state lives beside the registry's `build` (which loads the tiny presets' trained weights with it); it is
# imported here for load_checkpoint and for the callers that know it as checkpoint.load_state
from .registry import MODELS, check_finite, load_state, read_safetensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


@dataclass(frozen=True)
class Pooling:
    mode: str = "cls"  # "mean" | "cls" | "max"
    normalize: bool = False
    max_length: int | None = None
    do_lower_case: bool = False


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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise XDeployError(f"checkpoint is missing {path.name} (looked in {path.parent})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise XDeployError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise XDeployError(f"{path} should hold a JSON object")
    return data


def _transformer_dir(root: Path) -> tuple[Path, Pooling | None]:
    """For a sentence-transformers directory, the folder of its Transformer module and its pooling."""
    modules_file = root / "modules.json"
    if not modules_file.exists():
        return root, None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
        types = {m["type"].rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise XDeployError(f"{modules_file} is not a sentence-transformers modules list") from None
    if "Transformer" not in types:
        raise XDeployError(f"{modules_file} has no sentence_transformers.models.Transformer module")
    tdir = (root / types["Transformer"]).resolve()
    if not tdir.is_relative_to(root.resolve()):
        raise XDeployError(f"{modules_file} points outside the checkpoint directory")
    mode, max_length, lower = "cls", None, False
    if "Pooling" in types:
        pcfg = _read_json(root / types["Pooling"] / "config.json")
        for m in ("mean", "cls", "max"):
            if pcfg.get(f"pooling_mode_{m}_tokens"):
                mode = m
                break
    sb = tdir / "sentence_bert_config.json"
    if sb.exists():
        sbc = _read_json(sb)
        max_length, lower = sbc.get("max_seq_length"), bool(sbc.get("do_lower_case", False))
    return tdir, Pooling(mode=mode, normalize="Normalize" in types, max_length=max_length, do_lower_case=lower)


def load_checkpoint(path: str | Path) -> Checkpoint:
    root = Path(path)
    if not root.is_dir():
        raise XDeployError(f"checkpoint directory {root} does not exist")
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
    module = family.build(cfg).eval()
    load_state(module, family.hf.state_dict(tensors, cfg), source=str(weights))
    check_finite(module)
    tok = [tdir / n for n in TOKENIZER_FILES if (tdir / n).exists()] or [
        root / n for n in TOKENIZER_FILES if (root / n).exists()]
    return Checkpoint(path=root, model=family.name, config=cfg, module=module,
                      kind="sentence-transformers" if pooling else "huggingface",
                      sha256=sha256_file(weights), pooling=pooling, tokenizer_files=tok)
