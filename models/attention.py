"""The one multi-head attention used by every model (encoder, decoder, cross-attention, KV cache).

Two interchangeable kernels compute the same thing:
  * "sdpa": torch.nn.functional.scaled_dot_product_attention. The dynamo exporter lowers it to the native
    ONNX `Attention` op at opset >= 23 and to MatMul/Softmax at opset 18.
  * "math": the explicit softmax(q k^T / sqrt(hs) + bias) v, always MatMul/Softmax in ONNX.

Masks are *additive biases* broadcastable to (B, nh, T, S): 0 where a key may be attended, MASK_VALUE where
not. MASK_VALUE is finite and fits in fp16, so a fully padded row yields a uniform softmax instead of NaN
(-inf or finfo(float32).min would overflow to -inf in an fp16 graph and give NaN).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .spec import MASK_VALUE

ATTENTION_IMPLS = ("sdpa", "math")


def padding_bias(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, S) 1=keep/0=pad -> additive bias (B, 1, 1, S)."""
    return ((1.0 - mask.to(dtype)) * MASK_VALUE)[:, None, None, :]


def causal_bias(t: int | torch.Tensor, s: int | torch.Tensor, device: torch.device | None = None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(1, 1, T, S): query i (the last T of S positions) may see key j only if j <= i + (S - T)."""
    i = torch.arange(t, device=device)[:, None] + (s - t)  # absolute position of each query
    j = torch.arange(s, device=device)[None, :]
    return torch.where(j <= i, 0.0, MASK_VALUE).to(dtype)[None, None]


class MultiHeadAttention(nn.Module):
    """y = softmax(q k^T / sqrt(hs) + bias) v over nh heads of size hs = C / nh."""

    def __init__(self, d_model: int, n_heads: int, *, bias: bool = True, impl: str = "sdpa",
                 fused_qkv: bool = False) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention impl {impl!r}; expected one of {ATTENTION_IMPLS}")
        self.n_heads, self.head_size, self.impl = n_heads, d_model // n_heads, impl
        if fused_qkv:
            # one (C -> 3C) GEMM instead of three (C -> C): what GPT-2 checkpoints store (c_attn). OpenVINO bf16
            # ran GPT-2 small's logits-only prefill 4-6% faster so; f32 and the graph with `present` tied
            # (docs/benchmarks.md)
            self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        else:
            self.query = nn.Linear(d_model, d_model, bias=bias)
            self.key = nn.Linear(d_model, d_model, bias=bias)
            self.value = nn.Linear(d_model, d_model, bias=bias)
        self.fused_qkv = fused_qkv
        self.out = nn.Linear(d_model, d_model, bias=bias)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_size).transpose(1, 2)  # (B, nh, T, hs)

    def project_kv(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `src` (B, S, C) -> 2 x (B, nh, S, hs); done once per encoder output."""
        if self.fused_qkv:
            raise ValueError("cross-attention (project_kv) needs separate key/value projections; "
                             "build it with fused_qkv=False")
        return self._heads(self.key(src)), self._heads(self.value(src))

    def forward(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_bias: torch.Tensor | None = None,
        append: bool = False,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """
        x:    (B, T, C) queries; also the keys/values unless `kv` is given.
        bias: additive mask over the new keys, broadcastable to (B, nh, T, S).
        kv:   precomputed (k, v), 2 x (B, nh, S, hs): cross-attention to an encoder's memory.
        past: cached (k, v), 2 x (B, nh, P, hs), of earlier positions. They are attended *beside* the new
              keys rather than concatenated to them, so the cache can be a preallocated max-length buffer
              that is never copied; `past_bias` (B, 1, 1|T, P) masks its padded and unused slots.
        append: the new keys are concatenated to `past` instead, and `bias` masks all P + T of them. This is the
              form an engine that keeps the cache itself recognizes (OpenVINO's CPU plugin fuses ReadValue ->
              Concat -> SDPA -> Assign into one attention node that appends in place: deploy/ov_runner.py).
        Returns y (B, T, C) and the (k, v) computed here, 2 x (B, nh, T, hs), for the caller to cache; with
        `append`, the grown cache 2 x (B, nh, P + T, hs).
        """
        b, t, c = x.shape
        if self.fused_qkv and kv is None:
            q, k, v = (self._heads(h) for h in self.qkv(x).split(c, dim=-1))  # 3 x (B, nh, T, hs)
        elif self.fused_qkv:
            raise ValueError("precomputed kv (cross-attention) needs fused_qkv=False")
        else:
            q = self._heads(self.query(x))  # (B, nh, T, hs)
            k, v = self.project_kv(x) if kv is None else kv
        if past is not None and append:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)  # 2 x (B, nh, P + T, hs)
        if past is None or append:
            y = self._attend(q, k, v, bias)
        else:
            y = self._attend_two(q, past, past_bias, (k, v), bias)
        y = y.transpose(1, 2).reshape(b, t, c)  # (B, T, C)
        return self.out(y), (k, v)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.impl == "sdpa":
            if bias is not None:
                # ONNX Runtime's Attention op (opset 23) does not broadcast the mask over query positions:
                # expand (B, 1, 1, S) padding biases to (B, 1, T, S).
                bias = bias.to(q.dtype).expand(-1, -1, q.shape[2], -1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_size))  # (B, nh, T, S)
        if bias is not None:
            scores = scores + bias
        return torch.softmax(scores, dim=-1) @ v

    def _attend_two(self, q: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor], past_bias: torch.Tensor | None,
                    new: tuple[torch.Tensor, torch.Tensor], new_bias: torch.Tensor | None) -> torch.Tensor:
        # One softmax over [past keys ; new keys] without materializing their concatenation: only the
        # (B, nh, T, P + T) score matrix is concatenated, never the (B, nh, P, hs) cache.
        scale = 1.0 / math.sqrt(self.head_size)
        s_past = (q @ past[0].transpose(-2, -1)) * scale  # (B, nh, T, P)
        s_new = (q @ new[0].transpose(-2, -1)) * scale  # (B, nh, T, T)
        if past_bias is not None:
            s_past = s_past + past_bias
        if new_bias is not None:
            s_new = s_new + new_bias
        p = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1)
        n_past = past[0].shape[2]
        return p[..., :n_past] @ past[1] + p[..., n_past:] @ new[1]
