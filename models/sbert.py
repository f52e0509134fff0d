"""Sentence-transformers directory layout, read without torch: its modules list, pooling and Transformer folder.
Shared by the checkpoint import (models/checkpoint.py) and foreign ONNX exports of such a directory
(export/foreign.py), which must open in a lean serving environment without torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


@dataclass(frozen=True)
class Pooling:
    mode: str = "cls"  # "mean" | "cls" | "max"
    normalize: bool = False
    max_length: int | None = None
    do_lower_case: bool = False



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
