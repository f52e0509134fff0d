"""Encoder-decoder generation peers: xdeploy's `transformer` (Vaswani et al.) as the checkpoint every peer loads.

Used by studies/peers_generate.py for its encoder-decoder workload (`transformer-base-decode`). No peer reads
xdeploy's safetensors, and none of them has a class for "the Transformer base": the nearest Hugging Face class
is MarianMTModel (post-LN, ReLU allowed, sinusoidal positions, embeddings scaled by sqrt(d), one embedding shared
by source, target and the output layer). The one difference is the positional table's layout: Marian puts the
sines in the first half of the channels and the cosines in the second, xdeploy interleaves them (PE[p, 2i] sin,
PE[p, 2i+1] cos). So `marian_state_dict` permutes the model's channels (the residual stream's d axis) so that
xdeploy's table becomes Marian's: the same function in another basis, exact (tests/test_peers_seq2seq.py: the
logits agree to float32 rounding).

The peers, all from that one directory:

  transformers    MarianMTModel.generate (eager fp32): the reference and the `× HF` baseline
  optimum-intel   OVModelForSeq2SeqLM (export=True; its decoder stateful: the KV cache inside the engine) f32,
                  bf16 where the CPU has it, int8 weight-only
  ctranslate2     a Translator converted here from the Marian module (`Seq2SeqConverter`, CTranslate2's own
                  spec API): its Marian loader starts the decoder from a zero embedding and drops the pad row
                  (Marian's convention), which is not this model, so the spec is filled directly
  onnxruntime-genai / openvino-genai   no encoder-decoder text pipeline: each row carries the tool's own refusal
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError

SPECIAL_IDS = 3  # xdeploy's transformer: pad 0, bos 1 (the decoder's start), eos 2; prompts use ids from here on


def channel_order(d_model: int) -> np.ndarray:
    """Marian channel j holds xdeploy channel order[j]: the even (sine) channels, then the odd (cosine) ones."""
    if d_model % 2:
        raise XDeployError(f"d_model must be even for sinusoidal positions; got {d_model}")
    return np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])


def marian_state_dict(tensors: dict[str, Any], n_encoder_layers: int, n_decoder_layers: int) -> dict[str, Any]:
    """xdeploy `transformer` tensors -> MarianMTModel's, in Marian's channel order (`channel_order`).

    Every tensor that reads the residual stream has its input columns permuted, every tensor that writes it
    its output rows (and bias); LayerNorm parameters follow the channels. Attention heads are the Q/K/V outputs,
    which no permutation touches. The output layer is tied to the shared embedding (no tensor of its own)."""
    d = tensors["embed.weight"].shape[1]
    order = channel_order(d).tolist()
    out = {"model.shared.weight": tensors["embed.weight"][:, order]}

    def linear(dst: str, src: str, reads: bool, writes: bool) -> None:
        w, b = tensors[f"{src}.weight"], tensors[f"{src}.bias"]
        w = w[:, order] if reads else w
        out[f"{dst}.weight"], out[f"{dst}.bias"] = (w[order, :], b[order]) if writes else (w, b)

    def norm(dst: str, src: str) -> None:
        out[f"{dst}.weight"], out[f"{dst}.bias"] = tensors[f"{src}.weight"][order], tensors[f"{src}.bias"][order]

    def attention(dst: str, src: str) -> None:
        for mine, theirs in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
            linear(f"{dst}.{theirs}", f"{src}.{mine}", reads=True, writes=False)
        linear(f"{dst}.out_proj", f"{src}.out", reads=False, writes=True)

    for side, n in (("encoder", n_encoder_layers), ("decoder", n_decoder_layers)):
        for i in range(n):
            mine, theirs = f"{side}.{i}", f"model.{side}.layers.{i}"
            attention(f"{theirs}.self_attn", f"{mine}.attn")
            norm(f"{theirs}.self_attn_layer_norm", f"{mine}.ln1")
            if side == "decoder":  # cross-attention: K/V read the encoder's output, in the same channel order
                attention(f"{theirs}.encoder_attn", f"{mine}.cross")
                norm(f"{theirs}.encoder_attn_layer_norm", f"{mine}.ln_cross")
            linear(f"{theirs}.fc1", f"{mine}.ffn.fc1", reads=True, writes=False)
            linear(f"{theirs}.fc2", f"{mine}.ffn.fc2", reads=False, writes=True)
            norm(f"{theirs}.final_layer_norm", f"{mine}.ln2")
    return out


def marian_config(cfg: Any) -> Any:
    """MarianConfig for an xdeploy TransformerConfig (dropout off; generation starts from xdeploy's BOS)."""
    import transformers

    return transformers.MarianConfig(
        vocab_size=cfg.vocab_size, d_model=cfg.d_model, encoder_layers=cfg.n_encoder_layers,
        decoder_layers=cfg.n_decoder_layers, encoder_attention_heads=cfg.n_heads,
        decoder_attention_heads=cfg.n_heads, encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
        activation_function="relu", max_position_embeddings=cfg.max_positions, scale_embedding=True,
        pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        decoder_start_token_id=cfg.bos_token_id, forced_eos_token_id=None, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, share_encoder_decoder_embeddings=True, tie_word_embeddings=True)


def make_checkpoint(model: str, preset: str, root: Path) -> Path:
    """The Marian directory (config.json, generation_config.json, model.safetensors) holding xdeploy's `model`
    preset with its seeded random weights (models/registry.py `build`, seed 0: what `xdeploy export --preset`
    exports), written once and atomically."""
    import torch
    import transformers

    from xdeploy.models import registry

    cfg = registry.get_config(model, preset)
    d = root / f"{model}-{preset}-seed0-marian"
    if (d / "model.safetensors").exists():
        return d
    module = registry.build(model, cfg, seed=0)
    tensors = {k: v.detach() for k, v in module.state_dict().items()}
    hf = transformers.MarianMTModel(marian_config(cfg)).eval()
    state = {k: v.contiguous() for k, v in marian_state_dict(tensors, cfg.n_encoder_layers,
                                                              cfg.n_decoder_layers).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    # computed, not loaded: Marian's sinusoids, its zero logits bias, and the tied embeddings and output layer
    derived = {"final_logits_bias", "lm_head.weight", "model.encoder.embed_tokens.weight",
               "model.decoder.embed_tokens.weight", "model.encoder.embed_positions.weight",
               "model.decoder.embed_positions.weight"}
    if unexpected or set(missing) - derived:
        raise XDeployError(f"{model} -> Marian: missing {sorted(set(missing) - derived)}, unexpected {unexpected}")
    with torch.no_grad():  # the first token's logits: a conversion that is not exact fails here, not in a table
        src = torch.arange(SPECIAL_IDS, SPECIAL_IDS + 8)[None]
        tgt = torch.tensor([[cfg.bos_token_id]])
        ref = module(src, torch.ones_like(src), tgt, torch.ones_like(tgt))
        got = hf(input_ids=src, attention_mask=torch.ones_like(src), decoder_input_ids=tgt).logits
    err = float((ref - got).abs().max() / ref.abs().max().clamp_min(1e-6))
    if err > 1e-4:
        raise XDeployError(f"{model} -> Marian: logits differ by {err:.2e} of their range; expected <= 1e-4")
    hf.generation_config.update(decoder_start_token_id=cfg.bos_token_id, forced_eos_token_id=None,
                                bad_words_ids=None, num_beams=1)
    tmp = d.with_name(d.name + f".tmp{os.getpid()}")
    hf.save_pretrained(tmp, safe_serialization=True)
    with contextlib.suppress(OSError):
        tmp.rename(d)  # atomic: a crash leaves no half-written checkpoint under the final name
    return d


# ------------------------------------------------------------------------------------------ systems ----

def _hf_model(ckpt: Path) -> Any:
    import transformers

    return transformers.MarianMTModel.from_pretrained(str(ckpt)).eval()


def open_transformers(ctx: Any, hf_generate: Callable[..., Any]) -> Any:
    import torch

    torch.set_num_threads(ctx.threads)
    return hf_generate(_hf_model(ctx.ckpt), ctx, torch)


def optimum_intel_dir(ctx: Any, precision: str) -> Path:
    from optimum.intel import OVModelForSeq2SeqLM, OVWeightQuantizationConfig

    d = ctx.work / f"optimum-intel-{ctx.ckpt.name}-{'int8wo' if precision == 'int8' else 'f32'}"
    if not (d / "openvino_decoder_model.xml").exists():
        q = {"quantization_config": OVWeightQuantizationConfig(bits=8)} if precision == "int8" else \
            {"load_in_8bit": False}  # no weight compression: f32 weights, as in the ONNX exports
        OVModelForSeq2SeqLM.from_pretrained(str(ctx.ckpt), export=True, compile=False, **q).save_pretrained(str(d))
    return d


def open_optimum_intel(ctx: Any, row: tuple[str, str, str, str], hf_generate: Callable[..., Any],
                       ov_config: dict[str, Any]) -> Any:
    import torch
    from optimum.intel import OVModelForSeq2SeqLM

    from xdeploy.studies.peers import _check_ov

    torch.set_num_threads(ctx.threads)
    d = optimum_intel_dir(ctx, row[3])
    m = OVModelForSeq2SeqLM.from_pretrained(str(d), ov_config=ov_config, compile=True)
    if not m.decoder.stateful:
        raise XDeployError(f"optimum-intel's {d.name} decoder is not stateful; expected the KV cache in the engine")
    for part, compiled in (("encoder", m.encoder.request), ("decoder", m.decoder.request.get_compiled_model())):
        _check_ov(compiled, row[3], ctx.threads, f"optimum-intel compiled {d.name}'s {part}")
    kv = m.decoder.request.get_compiled_model().get_property("KV_CACHE_PRECISION").to_string()
    if kv != ov_config["KV_CACHE_PRECISION"]:
        raise XDeployError(f"optimum-intel compiled {d.name} with a {kv} KV cache; expected "
                           f"{ov_config['KV_CACHE_PRECISION']}")
    return hf_generate(m, ctx, torch)


def ct2_tokens(vocab_size: int) -> list[str]:
    """CTranslate2 takes token strings: id i is "<ti>", but for its special tokens (pad, start, end)."""
    tokens = [f"<t{i}>" for i in range(vocab_size)]
    tokens[:SPECIAL_IDS] = ["<blank>", "<s>", "</s>"]
    return tokens


def ct2_dir(ctx: Any) -> Path:
    d = ctx.work / f"ctranslate2-{ctx.ckpt.name}"
    if not (d / "model.bin").exists():
        # float32 weights on disk; the int8 row quantizes them at load (compute_type="int8")
        seq2seq_converter(ctx.ckpt)().convert(str(d), quantization="float32", force=True)
    return d


def seq2seq_converter(ckpt: Path) -> type:
    """A CTranslate2 converter (its documented extension point: `Converter._load` returns a model spec) for the
    Marian directory `ckpt`, filling a post-LN TransformerSpec from the loaded module: fused self-attention
    QKV, cross-attention Q and fused KV, the module's own sinusoid table, the decoder starting from the start
    token's embedding (CTranslate2's Marian loader starts from a zero one)."""
    from ctranslate2.converters.converter import Converter
    from ctranslate2.specs import common_spec, transformer_spec

    def arr(t: Any) -> np.ndarray:
        return t.detach().float().numpy()

    def linear(spec: Any, *mods: Any) -> None:
        spec.weight = np.concatenate([arr(m.weight) for m in mods])
        spec.bias = np.concatenate([arr(m.bias) for m in mods])

    def norm(spec: Any, m: Any) -> None:
        spec.gamma, spec.beta = arr(m.weight), arr(m.bias)

    class Seq2SeqConverter(Converter):
        def _load(self) -> Any:
            hf = _hf_model(ckpt)
            c, core = hf.config, hf.model
            if c.activation_function != "relu" or not c.scale_embedding:
                raise XDeployError(f"{ckpt.name}: expected a ReLU Marian with scaled embeddings")
            spec = transformer_spec.TransformerSpec.from_config(
                (c.encoder_layers, c.decoder_layers), c.encoder_attention_heads, pre_norm=False,
                activation=common_spec.Activation.RELU)
            emb = arr(core.shared.weight)
            for s, part in ((spec.encoder, core.encoder), (spec.decoder, core.decoder)):
                s.scale_embeddings = True
                s.position_encodings.encodings = arr(part.embed_positions.weight)
            spec.encoder.embeddings[0].weight = emb
            spec.decoder.embeddings.weight = emb
            spec.decoder.projection.weight = emb  # tied output layer; zero logits bias: none
            for s, layer in zip(spec.encoder.layer, core.encoder.layers, strict=True):
                a = layer.self_attn
                linear(s.self_attention.linear[0], a.q_proj, a.k_proj, a.v_proj)
                linear(s.self_attention.linear[1], a.out_proj)
                norm(s.self_attention.layer_norm, layer.self_attn_layer_norm)
                linear(s.ffn.linear_0, layer.fc1)
                linear(s.ffn.linear_1, layer.fc2)
                norm(s.ffn.layer_norm, layer.final_layer_norm)
            for s, layer in zip(spec.decoder.layer, core.decoder.layers, strict=True):
                a, x = layer.self_attn, layer.encoder_attn
                linear(s.self_attention.linear[0], a.q_proj, a.k_proj, a.v_proj)
                linear(s.self_attention.linear[1], a.out_proj)
                norm(s.self_attention.layer_norm, layer.self_attn_layer_norm)
                linear(s.attention.linear[0], x.q_proj)
                linear(s.attention.linear[1], x.k_proj, x.v_proj)
                linear(s.attention.linear[2], x.out_proj)
                norm(s.attention.layer_norm, layer.encoder_attn_layer_norm)
                linear(s.ffn.linear_0, layer.fc1)
                linear(s.ffn.linear_1, layer.fc2)
                norm(s.ffn.layer_norm, layer.final_layer_norm)
            tokens = ct2_tokens(c.vocab_size)
            spec.register_source_vocabulary(tokens)
            spec.register_target_vocabulary(tokens)
            spec.config.bos_token, spec.config.eos_token = tokens[c.bos_token_id], tokens[c.eos_token_id]
            spec.config.decoder_start_token = tokens[c.decoder_start_token_id]
            spec.config.unk_token = tokens[SPECIAL_IDS]  # required; an ordinary id here (nothing is out of vocabulary)
            spec.config.layer_norm_epsilon = float(core.encoder.layers[0].final_layer_norm.eps)
            return spec

    return Seq2SeqConverter


def ort_genai_refusal(ctx: Any) -> str:
    """onnxruntime-genai's own words on the checkpoint: its model builder's last line (kept in a note file)."""
    note = ctx.work / f"ort-genai-{ctx.ckpt.name}.refusal.txt"
    if not note.exists():
        out = ctx.work / f"ort-genai-{ctx.ckpt.name}.tmp{os.getpid()}"
        r = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ctx.ckpt), "-o",
                            str(out), "-p", "fp32", "-e", "cpu", "-c", str(out / "cache")],
                           capture_output=True, text=True, timeout=1800)
        lines = [ln.strip() for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        text = (f"its model builder exits {r.returncode}: {lines[-1] if lines else 'no message'}"
                if r.returncode else "its model builder accepted the checkpoint")
        tmp = note.with_name(note.name + f".tmp{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(note)  # atomic: a crash leaves no half-written note
        with contextlib.suppress(OSError):
            import shutil

            shutil.rmtree(out)
    return note.read_text(encoding="utf-8")


def open_ort_genai(ctx: Any) -> Any:
    text = ort_genai_refusal(ctx)
    # its builder's architectures (onnxruntime_genai/models/builder.py) hold one encoder-decoder, Whisper; its
    # runtime's other encoder-decoder type, marian-ssru, is Marian's recurrent (SSRU) decoder, not attention
    raise XDeployError(f"onnxruntime-genai runs no attention encoder-decoder but Whisper; {text}")


def open_ov_genai(ctx: Any, ov_config: dict[str, Any]) -> Any:
    import openvino_genai as og

    d = optimum_intel_dir(ctx, "fp32")
    try:
        og.LLMPipeline(str(d), "CPU", **ov_config)
    except RuntimeError as e:  # its C++ exception: the message's last line is the reason
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise XDeployError(f"openvino-genai's LLMPipeline (decoder-only) refuses optimum-intel's encoder-decoder "
                           f"IR: {lines[-1] if lines else type(e).__name__}") from None
    raise XDeployError("openvino-genai's LLMPipeline opened an encoder-decoder IR; expected a refusal (no "
                       "encoder-decoder text pipeline in openvino-genai 2026.4)")
