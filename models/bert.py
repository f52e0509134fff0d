"""BERT (Devlin et al. 2019): word + position + token-type embeddings, post-LN encoder, tanh pooler.

Presets: `minilm` has the all-MiniLM-L6-v2 shape, `base` is BERT-base (≈110M parameters).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .attention import padding_bias
from .layers import Layer
from .spec import (
    Axis,
    Capabilities,
    Dims,
    ExportSpec,
    Graph,
    HFImport,
    ModelFamily,
    TensorSpec,
    TextFeeds,
    layer_flops,
)


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    d_ff: int = 3072
    max_positions: int = 512
    type_vocab_size: int = 2
    eps: float = 1e-12
    act: str = "gelu"
    attn_impl: str = "sdpa"


PRESETS = {
    "tiny": BertConfig(vocab_size=1000, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_positions=128),
    "minilm": BertConfig(d_model=384, n_layers=6, n_heads=12, d_ff=1536),
    "base": BertConfig(),
}


class Bert(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.position = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.d_model)
        self.ln_emb = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
        self.layers = nn.ModuleList(
            Layer(cfg.d_model, cfg.n_heads, cfg.d_ff, act=cfg.act, eps=cfg.eps, norm_first=False,
                  impl=cfg.attn_impl)
            for _ in range(cfg.n_layers)
        )
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) ids, mask, types -> last_hidden_state (B, T, C), pooler_output (B, C)."""
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)[None]  # (1, T)
        x = self.ln_emb(self.word(input_ids) + self.position(pos) + self.token_type(token_type_ids))
        bias = padding_bias(attention_mask, x.dtype)  # (B, 1, 1, T)
        for layer in self.layers:
            x, _ = layer(x, bias)
        return x, torch.tanh(self.pooler(x[:, 0]))


def dims(cfg: BertConfig) -> Dims:
    return Dims(layers=cfg.n_layers, width=cfg.d_model, heads=cfg.n_heads, ffn=cfg.d_ff, layer_fields=("n_layers",),
                positions_field="max_positions")


def export_spec(cfg: BertConfig) -> ExportSpec:
    ids = ("batch", "seq")
    return ExportSpec(
        graphs=(Graph("model", "forward",
                      inputs=(TensorSpec("input_ids", "int64", ids, "ids", cfg.vocab_size),
                              TensorSpec("attention_mask", "int64", ids, "mask"),
                              TensorSpec("token_type_ids", "int64", ids, "zeros")),
                      outputs=(TensorSpec("last_hidden_state", "float32", (*ids, cfg.d_model)),
                               TensorSpec("pooler_output", "float32", ("batch", cfg.d_model)))),),
        axes={"batch": Axis(1, 1, 64), "seq": Axis(1, 128, cfg.max_positions)},
    )


def flops(cfg: BertConfig, sizes: Mapping[str, int]) -> float:
    b, t = sizes["batch"], sizes["seq"]
    return b * (cfg.n_layers * layer_flops(t, t, cfg.d_model, cfg.d_ff) + 2.0 * cfg.d_model**2)


# ---- Hugging Face import (BertModel, and the bare encoder inside sentence-transformers directories) ----

_HF_RENAMES = [
    (r"^embeddings\.word_embeddings\.", "word."),
    (r"^embeddings\.position_embeddings\.", "position."),
    (r"^embeddings\.token_type_embeddings\.", "token_type."),
    (r"^embeddings\.LayerNorm\.", "ln_emb."),
    (r"^encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.", r"layers.\1.attn.\2."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attn.out."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.ln1."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.ffn.fc1."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.ffn.fc2."),
    (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.ln2."),
    (r"^pooler\.dense\.", "pooler."),
]
_HF_IGNORED = re.compile(r"^(cls\.|embeddings\.position_ids)")


def config_from_hf(c: Mapping[str, Any]) -> BertConfig:
    act = {"gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu"}.get(c.get("hidden_act", "gelu"))
    if act is None:
        raise ValueError(f"unsupported hidden_act {c.get('hidden_act')!r}; expected gelu, gelu_new or relu")
    return BertConfig(vocab_size=c["vocab_size"], d_model=c["hidden_size"], n_layers=c["num_hidden_layers"],
                      n_heads=c["num_attention_heads"], d_ff=c["intermediate_size"],
                      max_positions=c["max_position_embeddings"], type_vocab_size=c.get("type_vocab_size", 2),
                      eps=c.get("layer_norm_eps", 1e-12), act=act)


def state_dict_from_hf(tensors: Mapping[str, torch.Tensor], cfg: BertConfig) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tensors.items():
        key = re.sub(r"^(bert|model)\.", "", key)
        if _HF_IGNORED.match(key):
            continue
        for pattern, repl in _HF_RENAMES:
            new, n = re.subn(pattern, repl, key)
            if n:
                out[new] = value
                break
        else:
            out[key] = value  # unknown names are reported by the strict load
    return out


FAMILY = ModelFamily(
    name="bert", description="BERT encoder (post-LN) with pooler; MiniLM and BERT-base shapes",
    presets=PRESETS, build=Bert, spec=export_spec, flops=flops, dims=dims,
    capabilities=Capabilities(role="encoder", token_axis="seq", text=TextFeeds(), optimizer="bert"),
    quick_preset="minilm", full_preset="base",
    hf=HFImport(model_types=("bert",), config=config_from_hf, state_dict=state_dict_from_hf),
)
