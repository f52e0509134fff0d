"""Reference models: shapes, attention kernels agree, KV-cache decoding equals the full forward, padding."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from xdeploy.core.errors import XDeployError
from xdeploy.models.registry import MODELS, build, get_config, param_count
from xdeploy.models.spec import make_feeds


def _run(model, graph, feeds):
    with torch.no_grad():
        out = getattr(model, graph.method)(*(torch.from_numpy(feeds[t.name]) for t in graph.inputs))
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_graph_runs_with_declared_shapes(name):
    cfg = get_config(name, "tiny")
    spec = MODELS[name].spec(cfg)
    model = build(name, cfg)
    sizes = {a: min(ax.opt, 5) for a, ax in spec.axes.items()} | {"batch": 2}
    for graph in spec.graphs:
        outs = _run(model, graph, make_feeds(graph, sizes))
        assert len(outs) == len(graph.outputs)
        for o, t in zip(outs, graph.outputs):
            want = tuple(d if isinstance(d, int) else sizes[d] for d in t.dims)
            assert tuple(o.shape) == want, (graph.name, t.name)
            assert torch.isfinite(o).all()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sdpa_and_math_attention_agree(name):
    cfg = get_config(name, "tiny")
    spec = MODELS[name].spec(cfg)
    a = build(name, cfg)
    b = build(name, dataclasses.replace(cfg, attn_impl="math"))
    graph = spec.graph("model")
    feeds = make_feeds(graph, {k: 6 for k in spec.axes} | {"batch": 3})
    for x, y in zip(_run(a, graph, feeds), _run(b, graph, feeds)):
        assert (x - y).abs().max() <= 1e-5 * max(1.0, x.abs().max().item())


def _layers(cache: torch.Tensor) -> list[torch.Tensor]:
    """One (L, 2, B, nh, C, hs) cache -> the decode method's per-layer views: layer 0's key, its value, ..."""
    return [cache[i, j] for i in range(cache.shape[0]) for j in range(2)]


def test_gpt_decode_with_cache_equals_full_forward():
    cfg = get_config("gpt", "tiny")
    model = build("gpt", cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        full, _ = model(ids, torch.ones_like(ids))
        _, present = model(ids[:, :8], torch.ones_like(ids[:, :8]))
        cap = 16  # preallocated cache: 8 prompt slots filled, the rest unused and masked
        cache = torch.zeros(*present.shape[:4], cap, present.shape[-1])
        cache[..., :8, :] = present
        mask = torch.zeros(2, cap, dtype=torch.long)
        mask[:, :8] = 1
        one = torch.ones(2, 1, dtype=torch.long)
        for step in range(8, 12):
            logits, new = model.decode(ids[:, step:step + 1], torch.full((2, 1), step), mask, one, *_layers(cache))
            assert (logits[:, 0] - full[:, step]).abs().max() < 1e-4
            cache[..., step:step + 1, :] = new
            mask[:, step] = 1
        # the prefill through decode: the 8-token prompt as one step against an empty cache (one masked slot)
        empty = torch.zeros(*present.shape[:4], 1, present.shape[-1])
        logits, new = model.decode(ids[:, :8], torch.arange(8).expand(2, 8), torch.zeros(2, 1, dtype=torch.long),
                                   torch.ones(2, 8, dtype=torch.long), *_layers(empty))
        assert logits.shape[1] == 1 and (logits[:, 0] - full[:, 7]).abs().max() < 1e-4  # the last token's only
        assert (new - present).abs().max() < 1e-5


def test_gpt_left_padding_does_not_change_real_tokens():
    cfg = get_config("gpt", "tiny")
    model = build("gpt", cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 7))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.tensor([[0, 0, 0] + [1] * 7])
    with torch.no_grad():
        a, _ = model(ids, torch.ones_like(ids))
        b, _ = model(padded, mask)
    assert (a - b[:, 3:]).abs().max() < 1e-4


def test_transformer_decode_equals_teacher_forcing():
    cfg = get_config("transformer", "tiny")
    model = build("transformer", cfg)
    src = torch.randint(3, cfg.vocab_size, (2, 9))
    src_mask = torch.ones_like(src)
    src_mask[1, 6:] = 0
    tgt = torch.randint(3, cfg.vocab_size, (2, 5))
    with torch.no_grad():
        full = model(src, src_mask, tgt, torch.ones_like(tgt))
        memory = model.encode(src, src_mask)
        hs = cfg.d_model // cfg.n_heads
        cache = torch.zeros(cfg.n_decoder_layers, 2, 2, cfg.n_heads, 8, hs)
        mask = torch.zeros(2, 8, dtype=torch.long)
        for step in range(5):
            logits, new = model.decode(tgt[:, step:step + 1], torch.full((2, 1), step), mask, memory, src_mask,
                                       *_layers(cache))
            assert (logits[:, 0] - full[:, step]).abs().max() < 1e-4
            cache[..., step:step + 1, :] = new
            mask[:, step] = 1


def test_bert_padding_is_ignored():
    cfg = get_config("bert", "tiny")
    model = build("bert", cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 6))
    with torch.no_grad():
        a, _ = model(ids, torch.ones_like(ids), torch.zeros_like(ids))
        padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], 1)
        mask = torch.tensor([[1] * 6 + [0] * 4])
        b, _ = model(padded, mask, torch.zeros_like(padded))
    assert (a - b[:, :6]).abs().max() < 1e-5


@pytest.mark.parametrize(("name", "preset", "published"), [
    ("bert", "base", 110e6), ("gpt", "small", 124e6), ("vit", "base16", 86e6), ("bert", "minilm", 22.7e6),
    ("transformer", "base", 60.5e6),
])
def test_preset_parameter_counts_match_published_sizes(name, preset, published):
    n = param_count(name, get_config(name, preset))
    assert abs(n - published) / published < 0.01, n


def test_unknown_names_list_valid_ones():
    with pytest.raises(XDeployError, match="unknown model 'llama'; expected one of: bert, gpt, transformer, vit"):
        get_config("llama", "tiny")
    with pytest.raises(XDeployError, match="unknown preset for gpt 'huge'; expected one of: small, tiny"):
        get_config("gpt", "huge")


def test_analytic_flops_match_classic_formula():
    cfg = get_config("bert", "base")
    f = MODELS["bert"].flops(cfg, {"batch": 1, "seq": 128})
    d, t = 768, 128
    classic = 12 * (24 * t * d * d + 4 * t * t * d)
    assert abs(f - classic) / classic < 0.01


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_fused_qkv_attention_equals_three_projections(impl):
    """GPT's one C -> 3C projection (GPT-2's c_attn) computes what separate query/key/value projections with the
    same weights compute, with and without a KV cache; cross-attention refuses it (it needs keys of another
    sequence)."""
    from xdeploy.models.attention import MultiHeadAttention, causal_bias

    torch.manual_seed(0)
    fused, split = MultiHeadAttention(32, 4, impl=impl, fused_qkv=True), MultiHeadAttention(32, 4, impl=impl)
    assert not hasattr(fused, "query") and fused.qkv.out_features == 96
    with torch.no_grad():
        for lin, w, b in zip((split.query, split.key, split.value), fused.qkv.weight.split(32),
                             fused.qkv.bias.split(32)):
            lin.weight.copy_(w), lin.bias.copy_(b)
        split.out.load_state_dict(fused.out.state_dict())
    x, past = torch.randn(2, 5, 32), (torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8))
    for kwargs in ({}, {"past": past}):
        (yf, kvf), (ys, kvs) = fused(x, causal_bias(5, 5), **kwargs), split(x, causal_bias(5, 5), **kwargs)
        torch.testing.assert_close(yf, ys)
        torch.testing.assert_close(kvf, kvs)
    assert type(build("gpt", get_config("gpt", "tiny")).layers[0].attn.qkv) is torch.nn.Linear
    with pytest.raises(ValueError, match="fused_qkv=False"):
        fused(x, None, kv=past)


def test_shape_only_builds_skip_the_initializers_and_restore_them():
    """models/registry.py on_meta: a module built for its shapes (the weight check before loading a reference, the
    parameter count) runs none of torch.nn.init's initializers, whose meta kernels import torch._dynamo (1.9 s of a
    4 s PyTorch benchmark child); the initializers come back after the block, even when the build fails; and a
    process that loads a reference model and runs it never imports torch._dynamo."""
    import subprocess
    import sys

    from torch import nn

    from xdeploy.models.registry import on_meta

    before = nn.init.normal_
    with pytest.raises(RuntimeError, match="boom"), on_meta():
        assert nn.init.normal_ is not before and nn.Linear(4, 3).weight.is_meta
        raise RuntimeError("boom")
    assert nn.init.normal_ is before
    w = nn.Linear(64, 64).weight  # initialized again, outside the block
    assert w.std() > 0.01
    code = ("import sys, torch\n"
            "from xdeploy.models.registry import MODELS, build_loaded, build, get_config\n"
            "from xdeploy.models.spec import make_feeds\n"
            "for name in MODELS:\n"
            "    cfg = get_config(name, 'tiny')\n"
            "    m = build_loaded(MODELS[name], cfg, build(name, cfg).state_dict(), source=name)\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
