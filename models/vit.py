"""ViT (Dosovitskiy et al. 2021): conv patch embedding, class token, learned positions, pre-LN encoder,
classification head on the class token. `base16` is ViT-B/16 at 224x224: 14*14 patches + CLS = 197 tokens."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .layers import Layer
from .spec import (
    Axis,
    Capabilities,
    ConfigSweep,
    Dims,
    ExportSpec,
    Graph,
    HFImport,
    ModelFamily,
    TensorSpec,
    layer_flops,
)


@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 224
    patch_size: int = 16
    channels: int = 3
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    d_ff: int = 3072
    n_classes: int = 1000
    eps: float = 1e-12
    attn_impl: str = "sdpa"
    weights: str | None = None  # trained weights in models/weights/ that registry.build loads; None: random

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"patch size {self.patch_size} does not divide the {self.image_size}-pixel image")

    @property
    def n_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1


_TINY = ViTConfig(image_size=32, patch_size=8, d_model=64, n_layers=2, n_heads=4, d_ff=128, n_classes=10)
PRESETS = {
    # tiny is trained (studies/train_tiny.py) on scikit-learn's 8x8 digits, upsampled to 32x32 and scaled to
    # [-1, 1] like the calibration images, so its top-1 is a real decision; tiny-random keeps seeded random weights
    "tiny": dataclasses.replace(_TINY, weights="vit-tiny.safetensors"),
    "tiny-random": _TINY,
    "base16": ViTConfig(),
}


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch = nn.Conv2d(cfg.channels, cfg.d_model, cfg.patch_size, stride=cfg.patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.d_model))
        # (1, N, D) learned positions, N(0, 0.02) through nn.init (skipped when built on meta: registry.on_meta)
        self.pos = nn.Parameter(nn.init.normal_(torch.empty(1, cfg.n_tokens, cfg.d_model), std=0.02))
        self.layers = nn.ModuleList(
            Layer(cfg.d_model, cfg.n_heads, cfg.d_ff, act="gelu", eps=cfg.eps, norm_first=True,
                  impl=cfg.attn_impl)
            for _ in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.eps)
        self.head = nn.Linear(cfg.d_model, cfg.n_classes)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> class logits (B, n_classes)."""
        x = self.patch(pixel_values).flatten(2).transpose(1, 2)  # (B, N, C), N = (H/p)*(W/p)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos  # (B, N+1, C)
        for layer in self.layers:
            x, _ = layer(x, None)  # every patch sees every patch: no mask
        return self.head(self.ln_f(x[:, 0]))


def dims(cfg: ViTConfig) -> Dims:
    # the image and patch size fix the tokens: no positions field for the scale sweep to grow
    return Dims(layers=cfg.n_layers, width=cfg.d_model, heads=cfg.n_heads, ffn=cfg.d_ff, fixed_tokens=cfg.n_tokens,
                layer_fields=("n_layers",))


def export_spec(cfg: ViTConfig) -> ExportSpec:
    img = ("batch", cfg.channels, cfg.image_size, cfg.image_size)  # fixed image size, dynamic batch
    return ExportSpec(
        graphs=(Graph("model", "forward", inputs=(TensorSpec("pixel_values", "float32", img),),
                      outputs=(TensorSpec("logits", "float32", ("batch", cfg.n_classes)),)),),
        axes={"batch": Axis(1, 1, 64)},
    )


def flops(cfg: ViTConfig, sizes: Mapping[str, int]) -> float:
    t, d = cfg.n_tokens, cfg.d_model
    patch = 2.0 * (t - 1) * d * cfg.channels * cfg.patch_size**2
    return sizes["batch"] * (patch + cfg.n_layers * layer_flops(t, t, d, cfg.d_ff) + 2.0 * d * cfg.n_classes)


# ---- Hugging Face import (ViTModel / ViTForImageClassification) ----

_HF_RENAMES = [
    (r"^embeddings\.cls_token$", "cls"),
    (r"^embeddings\.position_embeddings$", "pos"),
    (r"^embeddings\.patch_embeddings\.projection\.", "patch."),
    (r"^encoder\.layer\.(\d+)\.layernorm_before\.", r"layers.\1.ln1."),
    (r"^encoder\.layer\.(\d+)\.attention\.attention\.(query|key|value)\.", r"layers.\1.attn.\2."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attn.out."),
    (r"^encoder\.layer\.(\d+)\.layernorm_after\.", r"layers.\1.ln2."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.ffn.fc1."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.ffn.fc2."),
    (r"^layernorm\.", "ln_f."),
    (r"^classifier\.", "head."),
]


def config_from_hf(c: Mapping[str, Any]) -> ViTConfig:
    if c.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"hidden_act {c['hidden_act']!r}; expected gelu")
    n_classes = len(c.get("id2label") or {}) or 1000
    return ViTConfig(image_size=c["image_size"], patch_size=c["patch_size"], channels=c.get("num_channels", 3),
                     d_model=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
                     d_ff=c["intermediate_size"], n_classes=n_classes, eps=c.get("layer_norm_eps", 1e-12))


def state_dict_from_hf(tensors: Mapping[str, torch.Tensor], cfg: ViTConfig) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tensors.items():
        key = key.removeprefix("vit.")
        if key.startswith("pooler."):
            continue  # ViTModel's pooler is not used by the classifier
        for pattern, repl in _HF_RENAMES:
            new, n = re.subn(pattern, repl, key)
            if n:
                out[new] = value
                break
        else:
            out[key] = value
    return out


FAMILY = ModelFamily(
    name="vit", description="Vision Transformer (pre-LN) image classifier; ViT-B/16 shape",
    presets=PRESETS, build=ViT, spec=export_spec, flops=flops, dims=dims,
    # tokens are fixed by image and patch size: no token axis; the scale sweep varies the patch size instead
    capabilities=Capabilities(role="encoder", token_axis=None, optimizer="vit"),
    quick_preset="tiny", full_preset="base16",
    config_sweep=ConfigSweep(preset="base16", field="patch_size", values=(32, 16, 8), tokens=lambda c: c.n_tokens),
    hf=HFImport(model_types=("vit",), config=config_from_hf, state_dict=state_dict_from_hf),
)
