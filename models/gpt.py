"""GPT-2 (Radford et al. 2019): learned positions, pre-LN causal decoder, LM head tied to the embedding.

Two graphs: `model` (the full forward: logits of every position and the prompt's KV cache; parity's reference
shape and the recompute path) and `decode` (S new tokens against a preallocated cache, returning the last
token's logits and only the new K/V, so the runtime writes them in place instead of copying the whole cache).
Generation runs `decode` for both phases: the prompt is one step of S = T tokens against an empty cache, every
later token a step of 1. One graph means one compiled copy of the weights in every engine (ONNX Runtime and
OpenVINO hold a copy per session / compiled model), and the prefill computes the LM head for one position,
not T (for GPT-2 small at T = 32, 2.5 of its 8 GFLOP).

A third form, `step`, is converted for OpenVINO only (ExportSpec.engine_cache): the same step with the cache
concatenated and returned whole, which OpenVINO turns into a stateful model whose cache never leaves the engine.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .attention import causal_bias, padding_bias
from .layers import Layer, positions_from_mask, stack_kv
from .spec import (
    Axis,
    Capabilities,
    DecoderFeeds,
    Dims,
    EngineCache,
    ExportSpec,
    Graph,
    HFImport,
    ModelFamily,
    TensorSpec,
    cache_inputs,
    cache_names,
    layer_flops,
)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    max_positions: int = 1024
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    eps: float = 1e-5
    eos_token_id: int = 50256
    attn_impl: str = "sdpa"
    weights: str | None = None  # trained weights in models/weights/ that registry.build loads; None: random

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model


_TINY = GPTConfig(vocab_size=512, max_positions=256, d_model=64, n_layers=2, n_heads=4, eos_token_id=511)
PRESETS = {
    # tiny is trained (studies/train_tiny.py): a byte-level language model of this repository's Markdown (token =
    # UTF-8 byte, 511 = EOS), so reduced-precision verdicts judge real logit margins, not a flat random model's;
    # tiny-random keeps the seeded random weights
    "tiny": dataclasses.replace(_TINY, weights="gpt-tiny.safetensors"),
    "tiny-random": _TINY,
    "small": GPTConfig(),
}


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.layers = nn.ModuleList(
            Layer(cfg.d_model, cfg.n_heads, cfg.d_ff, act="gelu_tanh", eps=cfg.eps, norm_first=True,
                  impl=cfg.attn_impl, fused_qkv=True)  # one c_attn GEMM, as GPT-2 stores it
            for _ in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.eps)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x) @ self.wte.weight.T  # tied LM head: (B, T, V)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt (B, T) -> logits (B, T, V) and its KV cache (L, 2, B, nh, T, hs).

        Positions count only real tokens, so left-padded prompts (what batched generation uses) get the same
        positions as unpadded ones."""
        t = input_ids.shape[1]
        x = self.wte(input_ids) + self.wpe(positions_from_mask(attention_mask))
        bias = causal_bias(t, t, x.device, x.dtype) + padding_bias(attention_mask, x.dtype)  # (B, 1, T, T)
        kvs = []
        for layer in self.layers:
            x, kv = layer(x, bias)
            kvs.append(kv)
        return self._logits(x), stack_kv(kvs)

    def decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache_mask: torch.Tensor,
               step_mask: torch.Tensor, *cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """S new tokens. input_ids, position_ids, step_mask (B, S) (step_mask 0 on left padding of a prompt);
        cache: 2 x L preallocated tensors (B, nh, C, hs), layer 0's key, layer 0's value, ... (one graph input
        each, so engines attend over the caller's buffer in place: models/spec.py DecoderFeeds), with
        cache_mask (B, C) = 1 on the slots written so far. Returns the logits of the step's last token
        (B, 1, V) and the step's new K/V (L, 2, B, nh, S, hs) for the caller to write into slots
        [slot, slot + S) of the cache."""
        s = input_ids.shape[1]
        x = self.wte(input_ids) + self.wpe(position_ids)
        past_bias = padding_bias(cache_mask, x.dtype)  # (B, 1, 1, C)
        step_bias = causal_bias(s, s, x.device, x.dtype) + padding_bias(step_mask, x.dtype)  # (B, 1, S, S)
        kvs = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, step_bias, past=(cache[2 * i], cache[2 * i + 1]), past_bias=past_bias)
            kvs.append(kv)
        # left padding: the last column is a real token in every row, and only its logits pick the next token
        return self._logits(x[:, -1:]), stack_kv(kvs)

    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
             *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`decode` for an engine that holds the cache (EngineCache): S new tokens after P cached positions.
        input_ids, position_ids (B, S); attention_mask (B, P + S) = 1 on every real position, cached or new; past:
        2 x L tensors (B, nh, P, hs), layer 0's key, layer 0's value, ... Returns the last token's logits (B, 1, V)
        and per layer the cache grown by the step, 2 x L tensors (B, nh, P + S, hs)."""
        s, total = input_ids.shape[1], attention_mask.shape[1]
        x = self.wte(input_ids) + self.wpe(position_ids)
        bias = causal_bias(s, total, x.device, x.dtype) + padding_bias(attention_mask, x.dtype)  # (B, 1, S, P + S)
        present: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, bias, past=(past[2 * i], past[2 * i + 1]), append=True)
            present.extend(kv)
        return (self._logits(x[:, -1:]), *present)


def dims(cfg: GPTConfig) -> Dims:
    # every layer caches keys and values of width d (n_heads x head size)
    return Dims(layers=cfg.n_layers, width=cfg.d_model, heads=cfg.n_heads, ffn=cfg.d_ff, kv_layers=cfg.n_layers,
                kv_width=cfg.d_model, layer_fields=("n_layers",), positions_field="max_positions")


def export_spec(cfg: GPTConfig) -> ExportSpec:
    hs = cfg.d_model // cfg.n_heads
    kv = lambda t: (cfg.n_layers, 2, "batch", cfg.n_heads, t, hs)  # noqa: E731
    return ExportSpec(
        graphs=(
            Graph("model", "forward",
                  inputs=(TensorSpec("input_ids", "int64", ("batch", "seq"), "ids", cfg.vocab_size),
                          TensorSpec("attention_mask", "int64", ("batch", "seq"), "mask")),
                  outputs=(TensorSpec("logits", "float32", ("batch", "seq", cfg.vocab_size)),
                           TensorSpec("present", "float32", kv("seq")))),
            Graph("decode", "decode",
                  inputs=(TensorSpec("input_ids", "int64", ("batch", "step"), "ids", cfg.vocab_size),
                          TensorSpec("position_ids", "int64", ("batch", "step"), "positions"),
                          TensorSpec("cache_mask", "int64", ("batch", "cache"), "mask"),
                          TensorSpec("step_mask", "int64", ("batch", "step"), "mask"),
                          *cache_inputs(cfg.n_layers, cfg.n_heads, hs)),
                  outputs=(TensorSpec("logits", "float32", ("batch", 1, cfg.vocab_size), last_of="step"),
                           TensorSpec("new_kv", "float32", kv("step"))),
                  decode_step=True),
        ),
        engine_cache=EngineCache(Graph(
            "step", "step",
            inputs=(TensorSpec("input_ids", "int64", ("batch", "step"), "ids", cfg.vocab_size),
                    TensorSpec("position_ids", "int64", ("batch", "step"), "positions"),
                    TensorSpec("attention_mask", "int64", ("batch", "total"), "mask"),
                    *cache_inputs(cfg.n_layers, cfg.n_heads, hs, axis="past", name="past")),
            outputs=(TensorSpec("logits", "float32", ("batch", 1, cfg.vocab_size)),
                     *(TensorSpec(n, "float32", ("batch", cfg.n_heads, "total", hs))
                       for n in cache_names("present", cfg.n_layers))),
            decode_step=True)),
        # opt sizes are capped by max_positions: imported checkpoints may have n_positions < 256. A step is 1
        # token while decoding (TensorRT's opt) and the whole prompt at prefill (max).
        axes={"batch": Axis(1, 1, 16), "seq": Axis(1, min(128, cfg.max_positions), cfg.max_positions),
              "cache": Axis(1, min(256, cfg.max_positions), cfg.max_positions),
              "step": Axis(1, 1, cfg.max_positions)},
    )


def flops(cfg: GPTConfig, sizes: Mapping[str, int]) -> float:
    b, t = sizes["batch"], sizes["seq"]
    return b * (cfg.n_layers * layer_flops(t, t, cfg.d_model, cfg.d_ff) + 2.0 * t * cfg.d_model * cfg.vocab_size)


# ---- Hugging Face import (GPT2Model / GPT2LMHeadModel) ----

def config_from_hf(c: Mapping[str, Any]) -> GPTConfig:
    if c.get("n_inner") not in (None, 4 * c["n_embd"]):
        raise ValueError(f"n_inner {c['n_inner']} is not 4 * n_embd; only the standard GPT-2 MLP is supported")
    if c.get("activation_function", "gelu_new") != "gelu_new":
        raise ValueError(f"activation_function {c['activation_function']!r}; expected gelu_new")
    return GPTConfig(vocab_size=c["vocab_size"], max_positions=c["n_positions"], d_model=c["n_embd"],
                     n_layers=c["n_layer"], n_heads=c["n_head"], eps=c.get("layer_norm_epsilon", 1e-5),
                     eos_token_id=c.get("eos_token_id", c["vocab_size"] - 1))


def state_dict_from_hf(tensors: Mapping[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    # GPT-2 stores its linears as Conv1D with weight (in, out): transpose into nn.Linear's (out, in). The fused
    # c_attn (C, 3C) is our attn.qkv as it is (q | k | v along the output axis).
    out: dict[str, torch.Tensor] = {}
    for key, w in tensors.items():
        key = key.removeprefix("transformer.")
        parts = key.split(".")
        if key == "lm_head.weight" or re.fullmatch(r"h\.\d+\.attn\.(bias|masked_bias)", key):
            continue  # tied head; causal-mask buffers of old checkpoints
        if parts[0] in ("wte", "wpe", "ln_f"):
            out[key] = w
            continue
        if parts[0] != "h":
            out[key] = w
            continue
        i, rest = parts[1], ".".join(parts[2:])
        p = f"layers.{i}."
        simple = {"ln_1": "ln1", "ln_2": "ln2", "attn.c_attn": "attn.qkv", "attn.c_proj": "attn.out",
                  "mlp.c_fc": "ffn.fc1", "mlp.c_proj": "ffn.fc2"}
        mod, kind = rest.rsplit(".", 1)
        if mod not in simple:
            out[key] = w
            continue
        conv = mod in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj") and kind == "weight"
        out[f"{p}{simple[mod]}.{kind}"] = w.T.contiguous() if conv else w
    return out


FAMILY = ModelFamily(
    name="gpt", description="GPT-2 decoder (pre-LN, tied LM head) with KV-cache decode graph",
    presets=PRESETS, build=GPT, spec=export_spec, flops=flops, dims=dims,
    capabilities=Capabilities(
        role="decoder", token_axis="seq", optimizer="gpt2",
        # the prompt is prefilled by the decode graph itself (step_mask): one graph, one copy of the weights;
        # `present`: graph "model"'s KV, for a caller that prefills with it (Generator's prefill_graph)
        decoding=DecoderFeeds(prompt_ids="input_ids", prompt_mask="attention_mask", step_ids="input_ids",
                              prefill_graph="decode", step_mask="step_mask", present="present")),
    quick_preset="tiny", full_preset="small",
    hf=HFImport(model_types=("gpt2",), config=config_from_hf, state_dict=state_dict_from_hf),
)
