"""The encoder-decoder Transformer of Vaswani et al. (2017): post-LN, sinusoidal positions, ReLU feed-forward,
one embedding shared by source, target and the generator (pre-softmax) layer, embeddings scaled by sqrt(d).

Graphs: `model` (teacher-forced forward), `encoder` (source -> every decoder layer's cross-attention K/V,
computed once per sequence), `decode` (one target token against a preallocated self-attention cache).

A fourth form, `step`, is converted for OpenVINO only (ExportSpec.engine_cache, as gpt's): `decode` with the
self-attention cache concatenated and returned whole, which OpenVINO turns into a stateful model whose cache never
leaves the engine; the encoder's memory and the source mask stay inputs, held by the engine for a sequence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .attention import causal_bias, padding_bias
from .layers import Layer, stack_kv
from .spec import (
    Axis,
    Capabilities,
    DecoderFeeds,
    Dims,
    EngineCache,
    ExportSpec,
    Graph,
    ModelFamily,
    TensorSpec,
    cache_inputs,
    cache_names,
    layer_flops,
)


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 32000
    d_model: int = 512
    n_heads: int = 8
    d_ff: int = 2048
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    max_positions: int = 1024
    eps: float = 1e-5
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    attn_impl: str = "sdpa"


PRESETS = {
    "tiny": TransformerConfig(vocab_size=1000, d_model=64, n_heads=4, d_ff=128, n_encoder_layers=2,
                              n_decoder_layers=2, max_positions=256),
    "base": TransformerConfig(),
}


def sinusoids(n: int, d: int) -> torch.Tensor:
    """(n, d) table: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...). Always computed on the CPU: a model
    built on the meta device for its shapes (registry.on_meta) needs no table, and meta's arange/exp would import
    torch._dynamo (~1.9 s)."""
    pos = torch.arange(n, dtype=torch.float32, device="cpu")[:, None]
    inv = torch.exp(torch.arange(0, d, 2, dtype=torch.float32, device="cpu") * (-math.log(10000.0) / d))
    pe = torch.zeros(n, d, device="cpu")
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * inv), torch.cos(pos * inv)
    return pe


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.register_buffer("pe", sinusoids(cfg.max_positions, cfg.d_model), persistent=False)
        layer = lambda cross: Layer(cfg.d_model, cfg.n_heads, cfg.d_ff, act="relu", eps=cfg.eps,  # noqa: E731
                                    norm_first=False, cross=cross, impl=cfg.attn_impl)
        self.encoder = nn.ModuleList(layer(False) for _ in range(cfg.n_encoder_layers))
        self.decoder = nn.ModuleList(layer(True) for _ in range(cfg.n_decoder_layers))

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed(ids) * math.sqrt(self.cfg.d_model) + self.pe[positions]

    def _generator(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.embed.weight.T  # shared with the embeddings: (B, T, V)

    def encode(self, src_ids: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """Source (B, S) -> the decoder layers' cross-attention K/V (L_dec, 2, B, nh, S, hs)."""
        s = src_ids.shape[1]
        x = self._embed(src_ids, torch.arange(s, device=src_ids.device)[None])
        bias = padding_bias(src_mask, x.dtype)
        for layer in self.encoder:
            x, _ = layer(x, bias)
        return stack_kv([layer.cross.project_kv(x) for layer in self.decoder])

    def forward(self, src_ids: torch.Tensor, src_mask: torch.Tensor, tgt_ids: torch.Tensor,
                tgt_mask: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: source (B, S), target (B, T) -> logits (B, T, V)."""
        memory = self.encode(src_ids, src_mask)
        t = tgt_ids.shape[1]
        x = self._embed(tgt_ids, torch.arange(t, device=tgt_ids.device)[None])
        bias = causal_bias(t, t, x.device, x.dtype) + padding_bias(tgt_mask, x.dtype)
        src_bias = padding_bias(src_mask, x.dtype)
        for i, layer in enumerate(self.decoder):
            x, _ = layer(x, bias, memory_kv=(memory[i, 0], memory[i, 1]), memory_bias=src_bias)
        return self._generator(x)

    def decode(self, tgt_ids: torch.Tensor, position_ids: torch.Tensor, cache_mask: torch.Tensor,
               memory: torch.Tensor, src_mask: torch.Tensor, *cache: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """One target step: tgt_ids, position_ids (B, 1); the self-attention cache, 2 x L tensors (B, nh, C, hs)
        (layer 0's key, layer 0's value, ...: models/spec.py DecoderFeeds) with cache_mask (B, C); memory =
        encode(...) output. Returns logits (B, 1, V), new K/V (L, 2, B, nh, 1, hs)."""
        x = self._embed(tgt_ids, position_ids)
        past_bias, src_bias = padding_bias(cache_mask, x.dtype), padding_bias(src_mask, x.dtype)
        kvs = []
        for i, layer in enumerate(self.decoder):
            x, kv = layer(x, None, past=(cache[2 * i], cache[2 * i + 1]), past_bias=past_bias,
                          memory_kv=(memory[i, 0], memory[i, 1]), memory_bias=src_bias)
            kvs.append(kv)
        return self._generator(x), stack_kv(kvs)

    def step(self, tgt_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
             memory: torch.Tensor, src_mask: torch.Tensor, *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`decode` for an engine that holds the self-attention cache (EngineCache): S new target tokens after P
        cached ones. tgt_ids, position_ids (B, S); attention_mask (B, P + S) = 1 on every real target position;
        memory, src_mask as `decode`; past: 2 x L tensors (B, nh, P, hs), layer 0's key, layer 0's value, ...
        Returns the last token's logits (B, 1, V) and per layer the cache grown by the step, 2 x L tensors
        (B, nh, P + S, hs)."""
        s, total = tgt_ids.shape[1], attention_mask.shape[1]
        x = self._embed(tgt_ids, position_ids)
        bias = causal_bias(s, total, x.device, x.dtype) + padding_bias(attention_mask, x.dtype)  # (B, 1, S, P + S)
        src_bias = padding_bias(src_mask, x.dtype)
        present: list[torch.Tensor] = []
        for i, layer in enumerate(self.decoder):
            x, kv = layer(x, bias, past=(past[2 * i], past[2 * i + 1]), append=True,
                          memory_kv=(memory[i, 0], memory[i, 1]), memory_bias=src_bias)
            present.extend(kv)
        return (self._generator(x[:, -1:]), *present)


def dims(cfg: TransformerConfig) -> Dims:
    # decoding caches the decoder's self-attention keys and values (the encoder's memory is computed once)
    return Dims(layers=cfg.n_encoder_layers + cfg.n_decoder_layers, width=cfg.d_model, heads=cfg.n_heads,
                ffn=cfg.d_ff, kv_layers=cfg.n_decoder_layers, kv_width=cfg.d_model,
                layer_fields=("n_encoder_layers", "n_decoder_layers"), positions_field="max_positions")


def export_spec(cfg: TransformerConfig) -> ExportSpec:
    hs, v = cfg.d_model // cfg.n_heads, cfg.vocab_size
    kv = lambda t: (cfg.n_decoder_layers, 2, "batch", cfg.n_heads, t, hs)  # noqa: E731
    src = (TensorSpec("src_ids", "int64", ("batch", "src_seq"), "ids", v),
           TensorSpec("src_mask", "int64", ("batch", "src_seq"), "mask"))
    memory = TensorSpec("memory", "float32", kv("src_seq"))
    return ExportSpec(
        graphs=(
            Graph("model", "forward",
                  inputs=(*src, TensorSpec("tgt_ids", "int64", ("batch", "seq"), "ids", v),
                          TensorSpec("tgt_mask", "int64", ("batch", "seq"), "mask")),
                  outputs=(TensorSpec("logits", "float32", ("batch", "seq", v)),)),
            Graph("encoder", "encode", inputs=src,
                  outputs=(TensorSpec("memory", "float32", kv("src_seq")),)),
            Graph("decode", "decode",
                  inputs=(TensorSpec("tgt_ids", "int64", ("batch", 1), "ids", v),
                          TensorSpec("position_ids", "int64", ("batch", 1), "positions"),
                          TensorSpec("cache_mask", "int64", ("batch", "cache"), "mask"),
                          memory, src[1],
                          *cache_inputs(cfg.n_decoder_layers, cfg.n_heads, hs)),
                  outputs=(TensorSpec("logits", "float32", ("batch", 1, v)),
                           TensorSpec("new_kv", "float32", kv(1))),
                  decode_step=True),
        ),
        engine_cache=EngineCache(Graph(
            "step", "step",
            inputs=(TensorSpec("tgt_ids", "int64", ("batch", 1), "ids", v),
                    TensorSpec("position_ids", "int64", ("batch", 1), "positions"),
                    TensorSpec("attention_mask", "int64", ("batch", "total"), "mask"),
                    memory, src[1],
                    *cache_inputs(cfg.n_decoder_layers, cfg.n_heads, hs, axis="past", name="past")),
            outputs=(TensorSpec("logits", "float32", ("batch", 1, v)),
                     *(TensorSpec(n, "float32", ("batch", cfg.n_heads, "total", hs))
                       for n in cache_names("present", cfg.n_decoder_layers))),
            decode_step=True)),
        axes={"batch": Axis(1, 1, 16), "src_seq": Axis(1, 128, cfg.max_positions),
              "seq": Axis(1, 128, cfg.max_positions), "cache": Axis(1, 256, cfg.max_positions)},
    )


def flops(cfg: TransformerConfig, sizes: Mapping[str, int]) -> float:
    b, t = sizes["batch"], sizes["seq"]
    s = sizes.get("src_seq", t)
    d, f = cfg.d_model, cfg.d_ff
    enc = cfg.n_encoder_layers * layer_flops(s, s, d, f)
    dec = cfg.n_decoder_layers * layer_flops(t, t, d, f, cross_s=s)
    return b * (enc + dec + 2.0 * t * d * cfg.vocab_size)


FAMILY = ModelFamily(
    name="transformer", description="Encoder-decoder Transformer of Vaswani et al. (post-LN, sinusoidal)",
    presets=PRESETS, build=Transformer, spec=export_spec, flops=flops, dims=dims,
    # the "bert" optimizer patterns: its encoder and decoder layers are post-LN like BERT's
    capabilities=Capabilities(
        role="encoder-decoder", token_axis="seq", source_axis="src_seq", optimizer="bert",
        decoding=DecoderFeeds(prompt_ids="src_ids", prompt_mask="src_mask", step_ids="tgt_ids",
                              prefill_graph="encoder", memory="memory", target_ids="tgt_ids",
                              target_mask="tgt_mask")),
    quick_preset="tiny", full_preset="base",
)
