"""The trained tiny presets (models/weights/, studies/train_tiny.py): gpt tiny is a byte-level language model of
the repository's Markdown, vit tiny a digits classifier; "tiny-random" keeps the seeded random weights.

Their figures are measured here, on held-out data the training never saw (a few hundred bytes / 360 images, so
each test takes about a second), not read back from the files' metadata."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from xdeploy.core.errors import XDeployError
from xdeploy.models import registry
from xdeploy.models.registry import MODELS, build, get_config
from xdeploy.studies import train_tiny

TRAINED = [(m, p) for m, f in MODELS.items() for p, c in f.presets.items() if getattr(c, "weights", None)]


def test_trained_presets_are_declared_and_shipped():
    assert ("gpt", "tiny") in TRAINED and ("vit", "tiny") in TRAINED
    for model, preset in TRAINED:
        cfg = get_config(model, preset)
        assert (registry.WEIGHTS_DIR / cfg.weights).is_file(), (model, preset)
        # the twin keeps random weights: same shapes, no file
        assert MODELS[model].presets["tiny-random"] == dataclasses.replace(cfg, weights=None)


@pytest.mark.parametrize(("model", "preset"), TRAINED)
def test_trained_weights_load_and_differ_from_random(model, preset):
    cfg = get_config(model, preset)
    trained = build(model, cfg)
    with safe_open(str(registry.WEIGHTS_DIR / cfg.weights), "pt") as f:
        for name, value in trained.state_dict().items():
            assert torch.equal(value, f.get_tensor(name)), name
        record = json.loads(f.metadata()[train_tiny.METADATA_KEY])
    # the shipped file is what the current recipe writes (a recipe edit without retraining fails here)
    assert record["recipe"] == dataclasses.asdict(train_tiny.RECIPES[model]) and record["preset"] == preset
    random = build(model, get_config(model, "tiny-random")).state_dict()
    differ = [k for k, v in trained.state_dict().items() if not torch.equal(v, random[k])]
    assert differ == list(random)  # every tensor was trained (LayerNorm gains and the class token included)
    # the seed draws the random twin's weights; the trained preset's are the file's whatever the seed
    reseeded = build(model, get_config(model, "tiny-random"), seed=1).state_dict()
    assert not all(torch.equal(v, random[k]) for k, v in reseeded.items())
    assert all(torch.equal(v, trained.state_dict()[k]) for k, v in build(model, cfg, seed=1).state_dict().items())


def test_export_and_overrides_see_the_trained_weights():
    """The exporter builds presets through registry.build (export/onnx_export.py resolve_source), so the artifact's
    reference/model.safetensors, parity's reference and the graphs hold the trained weights; a config changed beyond
    the attention kernel (scaling runs) cannot take them and gets random weights, recorded as weights=None."""
    from xdeploy.export.onnx_export import resolve_source

    for model, preset in TRAINED:
        cfg = get_config(model, preset)
        trained = build(model, cfg).state_dict()
        src = resolve_source(model, preset=preset, attn_impl="math")
        assert src.config.weights == cfg.weights and src.config.attn_impl == "math"
        assert all(torch.equal(v, trained[k]) for k, v in src.module.state_dict().items())
    grown = get_config("gpt", "tiny", max_positions=512)
    assert grown.weights is None and build("gpt", grown).wpe.weight.shape[0] == 512
    assert get_config("gpt", "tiny", max_positions=256).weights == "gpt-tiny.safetensors"  # the preset's own value


def test_gpt_tiny_held_out_loss_is_far_below_random():
    _, held = train_tiny.byte_corpus()
    batch = train_tiny.windows(held, 256, limit=2)  # 512 next-byte predictions from the held-out page
    assert batch.shape == (2, 257)
    trained = train_tiny.lm_loss(build("gpt", get_config("gpt", "tiny")), batch)
    random = train_tiny.lm_loss(build("gpt", get_config("gpt", "tiny-random")), batch)
    uniform = math.log(256)
    # measured: ~2.1 nats/byte trained (3.0 bits), ~40 random (its N(0, 1) embeddings make confident wrong logits)
    assert trained < 0.6 * uniform < uniform < random, (trained, random)


def test_gpt_tiny_greedy_continuation_is_repeatable_and_text():
    model = build("gpt", get_config("gpt", "tiny"))
    first = train_tiny.greedy(model, train_tiny.PROMPT, 40)
    assert first == train_tiny.greedy(model, train_tiny.PROMPT, 40)
    assert first == train_tiny.greedy(build("gpt", get_config("gpt", "tiny")), train_tiny.PROMPT, 40)
    text = train_tiny.decode(first)
    assert len(first) == 40 and all(32 <= t < 127 or t == 10 for t in first), text  # printable ASCII bytes
    words = text.split()
    assert sum(c.isalpha() or c == " " for c in text) >= 0.9 * len(text) and len(words) >= 5, text


def test_vit_tiny_held_out_accuracy():
    pytest.importorskip("sklearn")
    x, y = train_tiny.digits("test")
    assert x.shape == (360, 3, 32, 32) and float(x.min()) >= -1 and float(x.max()) <= 1
    trained = train_tiny.accuracy(build("vit", get_config("vit", "tiny")), x, y)
    random = train_tiny.accuracy(build("vit", get_config("vit", "tiny-random")), x, y)
    assert trained > 0.9 and random < 0.3, (trained, random)  # measured: 98.6% and ~11%


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing", "nan", "wrong-shape"])
def test_damaged_weights_file_is_a_one_line_error_naming_it(tmp_path, monkeypatch, damage):
    cfg = get_config("vit", "tiny")
    path = tmp_path / cfg.weights
    shutil.copy(registry.WEIGHTS_DIR / cfg.weights, path)
    monkeypatch.setattr(registry, "WEIGHTS_DIR", tmp_path)
    state = build("vit", get_config("vit", "tiny-random")).state_dict()
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 64)
    elif damage == "missing":
        path.unlink()
    elif damage == "nan":
        save_file(state | {"head.bias": torch.full_like(state["head.bias"], float("nan"))}, str(path))
    else:
        save_file(state | {"head.bias": torch.zeros(3)}, str(path))
    with pytest.raises(XDeployError) as e:
        build("vit", cfg)
    msg = str(e.value)
    assert str(path) in msg and len(msg.splitlines()) == 1 and "train_tiny --model vit" in msg, msg


def test_training_script_writes_a_file_the_preset_loads(tmp_path):
    """Three steps of the real recipe: the output is fp32 safetensors that load_state accepts, with the record."""
    pytest.importorskip("sklearn")
    out = tmp_path / "vit.safetensors"
    r = train_tiny.run("vit", out=out, steps=3)
    assert r["out"] == str(out) and 0 <= r["held_out_accuracy"] <= 1
    with safe_open(str(out), "pt") as f:
        assert json.loads(f.metadata()[train_tiny.METADATA_KEY])["recipe"]["steps"] == 3
    tensors = registry.read_safetensors(out)
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    registry.load_state(build("vit", get_config("vit", "tiny-random")), tensors, source=str(out))
    assert train_tiny.main(["--model", "vit", "--preset", "tiny-random"]) == 2  # names no file: --out needed
