"""The transformer layer shared by all four models: self-attention, optional cross-attention, feed-forward,
with the residual/LayerNorm arrangement chosen per model (post-LN: Vaswani, BERT; pre-LN: GPT-2, ViT)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import MultiHeadAttention

ACTIVATIONS = {
    "gelu": F.gelu,  # exact erf GELU (BERT, ViT)
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new"
    "relu": F.relu,  # Vaswani et al.
}

KV = tuple[torch.Tensor, torch.Tensor]


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model), ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Layer(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, *, act: str, eps: float, norm_first: bool,
                 cross: bool = False, impl: str = "sdpa", fused_qkv: bool = False) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.attn = MultiHeadAttention(d_model, n_heads, impl=impl, fused_qkv=fused_qkv)
        self.ln1 = nn.LayerNorm(d_model, eps=eps)
        self.cross = MultiHeadAttention(d_model, n_heads, impl=impl) if cross else None
        self.ln_cross = nn.LayerNorm(d_model, eps=eps) if cross else None
        self.ffn = FeedForward(d_model, d_ff, act)
        self.ln2 = nn.LayerNorm(d_model, eps=eps)

    def _residual(self, x: torch.Tensor, ln: nn.LayerNorm, f: Callable[[torch.Tensor], torch.Tensor]
                  ) -> torch.Tensor:
        # pre-LN: x + f(ln(x));  post-LN: ln(x + f(x))
        return x + f(ln(x)) if self.norm_first else ln(x + f(x))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None, *, past: KV | None = None,
                past_bias: torch.Tensor | None = None, append: bool = False, memory_kv: KV | None = None,
                memory_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, KV]:
        """x (B, T, C) -> (B, T, C) and this layer's new self-attention (k, v), 2 x (B, nh, T, hs) (with
        `append`: `past` grown by them, MultiHeadAttention.forward)."""
        new_kv: list[KV] = []

        def self_attn(h: torch.Tensor) -> torch.Tensor:
            y, kv = self.attn(h, bias, past=past, past_bias=past_bias, append=append)
            new_kv.append(kv)
            return y

        x = self._residual(x, self.ln1, self_attn)
        if self.cross is not None:
            x = self._residual(x, self.ln_cross, lambda h: self.cross(h, memory_bias, kv=memory_kv)[0])
        x = self._residual(x, self.ln2, self.ffn)
        return x, new_kv[0]


def stack_kv(kvs: list[KV]) -> torch.Tensor:
    """Per-layer [(k, v)] -> one cache tensor (L, 2, B, nh, T, hs): one graph input/output, one buffer."""
    return torch.stack([torch.stack(kv) for kv in kvs])


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 1/0 mask -> position ids that skip left padding: the first real token is position 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)
