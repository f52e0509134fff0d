"""The encoder-decoder peers' checkpoint (studies/peers_seq2seq.py): xdeploy's `transformer` converted to a Hugging
Face MarianMTModel, and to a CTranslate2 Translator, is the same model, so the peers table compares engines, not
models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from xdeploy.core.errors import XDeployError
from xdeploy.models import registry
from xdeploy.studies import peers_seq2seq as s2s

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny() -> tuple[object, object]:
    cfg = registry.get_config("transformer", "tiny")
    return cfg, registry.build("transformer", cfg, seed=0).eval()


def _feeds() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    src = torch.randint(s2s.SPECIAL_IDS, 1000, (2, 9), generator=g)
    tgt = torch.randint(s2s.SPECIAL_IDS, 1000, (2, 7), generator=g)
    tgt[:, 0] = 1  # BOS
    src_mask = torch.ones_like(src)
    src_mask[1, 6:] = 0  # a right-padded source row
    return src, src_mask, tgt


def test_the_marian_conversion_is_the_same_model(tiny: tuple[object, object]) -> None:
    """Permuting the channels into Marian's positional layout changes the basis, not the function: teacher-forced
    logits agree to float32 rounding, a padded source row included; without the permutation they do not."""
    cfg, module = tiny
    tensors = {k: v.detach() for k, v in module.state_dict().items()}
    src, src_mask, tgt = _feeds()
    with torch.no_grad():
        ref = module(src, src_mask, tgt, torch.ones_like(tgt))

    def marian_logits(state: dict) -> torch.Tensor:
        hf = transformers.MarianMTModel(s2s.marian_config(cfg)).eval()
        hf.load_state_dict(state, strict=False)
        with torch.no_grad():
            return hf(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt).logits

    got = marian_logits(s2s.marian_state_dict(tensors, cfg.n_encoder_layers, cfg.n_decoder_layers))
    np.testing.assert_allclose(got.numpy(), ref.numpy(), atol=1e-4 * float(ref.abs().max()))
    assert list(s2s.channel_order(6)) == [0, 2, 4, 1, 3, 5]
    unpermuted = s2s.marian_state_dict(tensors, cfg.n_encoder_layers, cfg.n_decoder_layers)
    order = np.argsort(s2s.channel_order(cfg.d_model))  # undo the permutation of the embedding only
    unpermuted["model.shared.weight"] = unpermuted["model.shared.weight"][:, order]
    assert float((marian_logits(unpermuted) - ref).abs().max()) > 1e-2 * float(ref.abs().max())
    with pytest.raises(XDeployError, match="d_model must be even"):
        s2s.channel_order(7)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("marian")
    d = s2s.make_checkpoint("transformer", "tiny", root)
    assert s2s.make_checkpoint("transformer", "tiny", root) == d  # written once
    return d


def test_the_checkpoint_reloads_as_the_module(tiny: tuple[object, object], checkpoint: Path) -> None:
    """The checkpoint directory (checked at conversion, written atomically) reloads to the module's logits."""
    _, module = tiny
    src, src_mask, tgt = _feeds()
    with torch.no_grad():
        ref = torch.log_softmax(module(src, src_mask, tgt, torch.ones_like(tgt)), -1)
        hf = transformers.MarianMTModel.from_pretrained(str(checkpoint)).eval()
        got = torch.log_softmax(hf(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt).logits, -1)
    np.testing.assert_allclose(got.numpy(), ref.numpy(), atol=1e-3)
    assert not list(checkpoint.parent.glob("*.tmp*"))


def test_the_ctranslate2_translator_scores_like_the_module(tiny: tuple[object, object], checkpoint: Path,
                                                           tmp_path: Path) -> None:
    """CTranslate2's Translator filled from the checkpoint (its spec API) scores a target with the module's
    log-probabilities: its decoder starts from the BOS embedding, not Marian's zero one. Runs where ctranslate2
    is installed (.venv-peers, `make peers-env`)."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    cfg, module = tiny
    src, src_mask, tgt = _feeds()
    d = checkpoint
    out = tmp_path / "ct2"
    s2s.seq2seq_converter(d)().convert(str(out), quantization="float32")
    tr = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    tokens = s2s.ct2_tokens(cfg.vocab_size)
    target = tgt[0, 1:].tolist()
    res = tr.score_batch([[tokens[i] for i in src[0].tolist()]], [[tokens[i] for i in target]])[0]
    # its log-probs: each target token, then the end token, after BOS
    full = torch.cat([tgt[:1], torch.tensor([[cfg.eos_token_id]])], 1)
    with torch.no_grad():
        lp = torch.log_softmax(module(src[:1], src_mask[:1], full[:, :-1], torch.ones_like(full[:, :-1])), -1)[0]
    want = lp.gather(1, full[0, 1:, None])[:, 0].numpy()
    np.testing.assert_allclose(np.asarray(res.log_probs), want, atol=1e-3)
