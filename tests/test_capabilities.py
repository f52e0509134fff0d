"""Models declare their capabilities, and nothing else knows model names.

The proof: a fifth model family the library has never seen, defined and registered here (a tiny text encoder
whose inputs are called `tokens` / `keep`, which has no segment ids, and whose config and token axis are named
unlike any other family's: `hidden`, `blocks`, `attn_heads`, `mlp`, `context`, axis `length`), goes through
export, parity, the benchmark, the report and the Embedder with no library change; its memory and scale estimates
come from the sizes it declares (non-zero, equal to the hand-computed figures); generation refuses it in one
line."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

from xdeploy.core.errors import XDeployError
from xdeploy.export.artifact import MANIFEST, load_artifact
from xdeploy.models import registry
from xdeploy.models.attention import padding_bias
from xdeploy.models.layers import Layer
from xdeploy.models.spec import (
    Axis,
    Capabilities,
    Cost,
    DecoderFeeds,
    Dims,
    ExportSpec,
    Graph,
    ModelFamily,
    TensorSpec,
    TextFeeds,
    layer_flops,
    token_axes,
    token_sizes,
)

# ----------------------------------------------------------------------------- the fifth family ----


@dataclass(frozen=True)
class EchoConfig:  # no field is named as in the library's own families (d_model, n_layers, max_positions ...)
    vocab: int = 97
    hidden: int = 32
    blocks: int = 1
    attn_heads: int = 2
    mlp: int = 64
    context: int = 64
    attn_impl: str = "sdpa"


AXIS = "length"  # the token axis: no family of the library calls it so


class Echo(nn.Module):
    """Token + position embeddings and one post-LN encoder layer: (B, T) tokens, keep -> states (B, T, C)."""

    def __init__(self, cfg: EchoConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.context, cfg.hidden)
        self.layers = nn.ModuleList(Layer(cfg.hidden, cfg.attn_heads, cfg.mlp, act="gelu", eps=1e-5,
                                          norm_first=False, impl=cfg.attn_impl) for _ in range(cfg.blocks))

    def forward(self, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1])[None])
        bias = padding_bias(keep, x.dtype)
        for layer in self.layers:
            x, _ = layer(x, bias)
        return x


def echo_spec(cfg: EchoConfig) -> ExportSpec:
    ids = ("batch", AXIS)
    return ExportSpec(
        graphs=(Graph("model", "forward",
                      inputs=(TensorSpec("tokens", "int64", ids, "ids", cfg.vocab),
                              TensorSpec("keep", "int64", ids, "mask")),
                      outputs=(TensorSpec("states", "float32", (*ids, cfg.hidden)),)),),
        axes={"batch": Axis(1, 1, 8), AXIS: Axis(1, 16, cfg.context)})


def echo_flops(cfg: EchoConfig, sizes: Mapping[str, int]) -> float:
    return sizes["batch"] * cfg.blocks * layer_flops(sizes[AXIS], sizes[AXIS], cfg.hidden, cfg.mlp)


def echo_dims(cfg: EchoConfig) -> Dims:
    return Dims(layers=cfg.blocks, width=cfg.hidden, heads=cfg.attn_heads, ffn=cfg.mlp, layer_fields=("blocks",),
                positions_field="context")


ECHO = ModelFamily(
    name="echo", description="test-only text encoder with its own feed names",
    presets={"tiny": EchoConfig()}, build=Echo, spec=echo_spec, flops=echo_flops, dims=echo_dims,
    capabilities=Capabilities(role="encoder", token_axis=AXIS,
                              text=TextFeeds(ids="tokens", mask="keep", type_ids=None, hidden="states")),
)


@pytest.fixture
def echo(monkeypatch):
    """Registered from the test: one entry in the registry's table, nothing else."""
    monkeypatch.setitem(registry.MODELS, ECHO.name, ECHO)
    return ECHO.name


# ------------------------------------------------------------------------------------- the proof ----

def test_fifth_family_goes_through_export_parity_bench_report_and_embedder(echo, tmp_path):
    from xdeploy.bench.suite import bench_artifacts
    from xdeploy.deploy.embedder import Embedder
    from xdeploy.deploy.generate import Generator
    from xdeploy.pipeline import RunConfig, plan, run_job
    from xdeploy.reports.render import load_results, render_report

    # the main job knows it from the registry: exported, checked and reported; no decode (it does not
    # generate), a scale sweep (it has a token axis)
    cfg = RunConfig(models=(echo,), smoke=True, runners=("ort",), precisions=("fp32", "int8"),
                    skip=("roofline", "bench", "decode", "scale"), out=tmp_path / "report",
                    artifacts=tmp_path / "art")
    full_plan = plan(dataclasses.replace(cfg, skip=()))
    assert ("scale", echo) in full_plan and not [s for s in full_plan if s[0] == "decode"]
    assert cfg.preset(echo) == "tiny" and dataclasses.replace(cfg, full=True).preset(echo) == "tiny"
    result = run_job(cfg)
    assert result.parity_passed and not result.errors, (result.parity_failures, result.errors)
    parity = [r for r in result.records if r["kind"] == "parity"]
    assert {(r["runner"], r["artifact_precision"], r["output"]) for r in parity} == {
        ("ort", "fp32", "states"), ("ort", "int8", "states")}
    assert all(r["model"] == echo and r["cases"] >= 1 for r in parity)

    # the manifest carries the family's capabilities; the runtime reads them from there
    art = load_artifact(tmp_path / "art" / f"{echo}-tiny-fp32")
    assert art.capabilities == ECHO.capabilities
    assert json.loads((art.path / MANIFEST).read_text())["capabilities"]["text"]["ids"] == "tokens"

    # the benchmark (in-process: spawned children would not see a family registered by a test)
    lat = bench_artifacts([art], runners=["torch", "ort"], batches=(1, 2), seqs=(8,), warmup=1, min_iters=2,
                          max_iters=3, max_seconds=0.2, isolate=False, peaks={})
    assert {(r["runner"], r["batch"], r["seq"]) for r in lat} == {(r, b, 8) for r in ("torch", "ort") for b in (1, 2)}
    flops = echo_flops(EchoConfig(), {"batch": 2, AXIS: 8})
    assert all(r["model"] == echo and r["latency_s"]["p50"] > 0 for r in lat)
    assert {r["flops"] for r in lat if r["batch"] == 2} == {flops}

    # the report renders both
    out = render_report([*result.records, *lat], tmp_path / "report2", meta={"title": "fifth family"})
    md = (out / "summary.md").read_text()
    assert "**Parity: all checks pass.**" in md and f"{echo} tiny" in md
    assert {r["kind"] for r in load_results(out)["records"]} >= {"parity", "latency"}

    # the Embedder feeds `tokens` / `keep` and pools `states`: a padded batch equals each row alone
    rows = [[5, 6, 7, 8, 9], [10, 11]]
    with Embedder(art, pooling="mean", batch_size=4) as emb:
        together = emb.embed_ids(rows)
        alone = np.concatenate([emb.embed_ids([r]) for r in rows])
    assert together.shape == (2, 32) and np.allclose(together, alone, atol=1e-5)

    # generation: one clear line, not an AttributeError
    with pytest.raises(XDeployError, match=f"model '{echo}' does not generate text: it is an encoder model"):
        Generator(art)


def test_fifth_family_estimates_read_the_sizes_it_declares(echo):
    """Its config fields and token axis are named unlike any library family's: the memory guard's estimate, a
    decode estimate's KV cache and the scale sweep read what it declares (never a silent zero), and equal the
    figures computed by hand."""
    from xdeploy.bench.memory import ACTIVATION_FACTOR, RUNTIME_BYTES, WEIGHT_COPIES, estimate_peak, output_elems
    from xdeploy.bench.scale import _scale_record, sweep_overrides
    from xdeploy.core.fingerprint import fingerprint

    cfg = registry.get_config(echo, "tiny")  # hidden 32, mlp 64, attn_heads 2, blocks 1, context 64
    assert registry.family_of(cfg) is ECHO and registry.dims(cfg) == echo_dims(cfg)
    assert token_axes(ECHO.capabilities) == (AXIS,)
    sizes = token_sizes(ECHO.capabilities, 2, 8)
    assert sizes == {"batch": 2, AXIS: 8}

    # the memory guard at batch 2, 8 tokens: outputs 2·8·32 = 512 floats; activations 2·8·(4·32 + 64) floats
    # + the outputs; scores and probabilities 2·B·h·T² floats; each ×ACTIVATION_FACTOR
    out = output_elems(ECHO.spec(cfg).graph("model"), sizes)
    est = estimate_peak(cfg, sizes, weights_fp32_bytes=1000.0, output_elems=out)
    assert out == 512
    assert est.activations_bytes == ACTIVATION_FACTOR * (2 * 8 * 192 * 4 + 512 * 4) == 57344
    assert est.scores_bytes == ACTIVATION_FACTOR * 2 * 2 * 2 * 8 * 8 * 4 == 8192
    assert est.total == RUNTIME_BYTES + WEIGHT_COPIES * 1000.0 + 57344 + 8192
    assert estimate_peak(cfg, sizes, weights_fp32_bytes=0.0, materialized=False).activations_bytes > 0

    # a decode estimate's KV cache: none for an encoder; keys and values of every cached layer otherwise (here a
    # grouped-query width of 16 < hidden): 2 (K, V) · 1 layer · batch 2 · 40 tokens · 16 · 4 bytes
    assert registry.dims(cfg).kv_bytes(40) == 0
    gqa = dataclasses.replace(echo_dims(cfg), kv_layers=cfg.blocks, kv_width=16)
    assert gqa.kv_bytes(40, batch=2) == 2 * 1 * 2 * 40 * 16 * 4 == 10240

    # the scale sweep: overrides the declared fields, records the declared sizes and the family's own FLOPs
    assert sweep_overrides(echo, "tiny", 256, layers=3) == {"context": 256, "blocks": 3}
    assert sweep_overrides(echo, "tiny", 32) == {"context": 64}  # never below the preset's own
    stats = dict.fromkeys(("p50", "p90", "p99", "mean", "std", "min", "max"), 1e-3) | {"n": 3}
    rec = _scale_record(echo, "ort-o18", 8, 2, cfg, {"stats": stats, "fingerprint": fingerprint()}, None)
    assert (rec["d_model"], rec["n_heads"], rec["n_layers"]) == (32, 2, 1)
    assert rec["flops"] == echo_flops(cfg, sizes) > 0
    assert rec["attn_flops"] == 2 * 1 * 4 * 8 * 8 * 32 and rec["score_bytes"] == 2 * 2 * 8 * 8 * 4


def test_optimizer_only_when_declared(echo, tmp_path):
    from xdeploy.export.onnx_export import export

    with pytest.raises(XDeployError, match="declares no onnxruntime optimizer type"):
        export(echo, preset="tiny", out=tmp_path / "a", optimize=True)
    assert not (tmp_path / "a").exists()


# ------------------------------------------------------------------------------- declarations ----

def test_every_family_declares_consistent_capabilities():
    for name, f in registry.MODELS.items():
        caps, spec = f.capabilities, f.spec(registry.get_config(name, f.smallest_preset))
        assert f.quick in f.presets and f.full in f.presets
        if caps.token_axis is not None:
            assert caps.token_axis in spec.axes, name
        else:
            assert f.config_sweep is not None, f"{name}: no token axis and no config sweep to scale"
        model = spec.graph("model")
        # the declared token axes are every dynamic axis of graph "model" but the batch: none left to a guess
        assert set(token_axes(caps)) == {d for t in model.inputs for d in t.dims if isinstance(d, str)} - {"batch"}
        cfg = registry.get_config(name, f.smallest_preset)
        dims = f.dims(cfg)
        assert registry.dims(cfg) == dims and (dims.kv_layers > 0) == caps.generates, name
        assert (dims.fixed_tokens is None) == (caps.token_axis is not None), name
        fields = {x.name for x in dataclasses.fields(cfg)}
        assert set(dims.layer_fields) <= fields and {dims.positions_field} - {None} <= fields, name
        if caps.text is not None:
            ins, outs = {t.name for t in model.inputs}, {t.name for t in model.outputs}
            assert caps.text.ids in ins and caps.text.hidden in outs, name
            assert {caps.text.mask, caps.text.type_ids} - {None} <= ins, name
        d = caps.decoding
        if d is not None:  # every name the decoding loop binds exists in the graph it binds it in
            prefill, dec, full = spec.graph(d.prefill_graph), spec.graph(d.decode_graph), spec.graph(d.full_graph)
            dec_in, dec_out = {t.name for t in dec.inputs}, {t.name for t in dec.outputs}
            assert set(d.cache_names(dims.kv_layers)) <= dec_in, name  # a key and a value input per cached layer
            assert {d.step_ids, d.positions, d.cache_mask} <= dec_in and {d.logits, d.new_kv} <= dec_out
            assert {d.prompt_ids, d.prompt_mask} <= {t.name for t in full.inputs}
            assert d.logits in {t.name for t in full.outputs}
            if d.step_mask is not None:  # the decode graph prefills: the prompt is a step, masked by step_mask
                assert d.prefill_graph == d.decode_graph and {d.prompt_ids, d.step_mask} <= dec_in, name
                steps = {t.dims[1] for t in dec.inputs if t.name in (d.step_ids, d.positions, d.step_mask)}
                assert len(steps) == 1 and isinstance(steps.pop(), str), name  # one dynamic step axis
            else:
                assert {d.prompt_ids, d.prompt_mask} <= {t.name for t in prefill.inputs}, name
                kv = d.present if caps.role == "decoder" else d.memory
                assert kv in {t.name for t in prefill.outputs}, name
            if caps.role == "encoder-decoder":
                assert {d.memory, d.prompt_mask} <= dec_in
                assert {d.target_ids, d.target_mask} <= {t.name for t in full.inputs}


def test_capabilities_are_validated():
    with pytest.raises(ValueError, match="role 'oracle'"):
        Capabilities(role="oracle")
    with pytest.raises(ValueError, match="decoding feeds are declared by the decoder roles"):
        Capabilities(role="decoder")
    with pytest.raises(ValueError, match="need `present`"):
        Capabilities(role="decoder", decoding=DecoderFeeds("a", "b", "c"))
    with pytest.raises(ValueError, match="memory, target_ids and target_mask"):
        Capabilities(role="encoder-decoder", decoding=DecoderFeeds("a", "b", "c"))
    with pytest.raises(ValueError, match="source axis is declared beside a token axis of another name"):
        Capabilities(token_axis=None, source_axis="src")
    with pytest.raises(ValueError, match="text feeds need a token axis"):
        Capabilities(token_axis=None, text=TextFeeds())
    with pytest.raises(ValueError, match="dimensions must be positive"):
        Dims(layers=0, width=8, heads=2, ffn=16)
    with pytest.raises(ValueError, match="declared together"):
        Dims(layers=1, width=8, heads=2, ffn=16, kv_layers=1)
    with pytest.raises(ValueError, match="preset 'huge' is not one of"):
        dataclasses.replace(ECHO, quick_preset="huge")
    caps = ECHO.capabilities
    assert Capabilities.from_json(json.loads(json.dumps(caps.to_json()))) == caps
    for bad in ({"role": 3}, {"text": {"ids": 5}}, {"wings": 2}, [], {"decoding": {"prompt_ids": "x"}}):
        with pytest.raises((TypeError, ValueError)):
            Capabilities.from_json(bad)  # type: ignore[arg-type]


def test_a_tampered_capabilities_section_is_one_line(echo, tmp_path):
    from xdeploy.core.fsutil import atomic_write_json
    from xdeploy.export.artifact import write_manifest_files
    from xdeploy.export.onnx_export import export

    path = export(echo, preset="tiny", out=tmp_path / "a")
    m = json.loads((path / MANIFEST).read_text())
    m["capabilities"]["role"] = "decoder"  # a decoder without decoding feeds
    atomic_write_json(path / MANIFEST, write_manifest_files(path, m))
    with pytest.raises(XDeployError, match="invalid manifest .*capabilities: role 'decoder': decoding feeds"):
        load_artifact(path)


def test_every_familys_recorded_cost_is_its_flops():
    """The manifest's "cost" (FLOPs per call without model code: what lets `xdeploy bench ARTIFACT` run without
    torch) is read off each family's own `flops`: equal to it at random sizes, batch included, for every registered
    family at every preset; it survives its JSON; a cost that is no polynomial of degree <= 2 is not recorded."""
    rng = np.random.default_rng(0)
    for name, fam in registry.MODELS.items():
        axes = token_axes(fam.capabilities)
        for preset in fam.presets:
            cfg = registry.get_config(name, preset)
            cost = Cost.fit(lambda sizes, fam=fam, cfg=cfg: fam.flops(cfg, sizes), axes, fam.dims(cfg).fixed_tokens)
            assert cost is not None and cost.fixed_tokens == fam.dims(cfg).fixed_tokens, (name, preset)
            assert Cost.from_json(json.loads(json.dumps(cost.to_json()))) == cost
            for _ in range(4):
                sizes = {"batch": int(rng.integers(1, 65))} | {a: int(rng.integers(1, 4097)) for a in axes}
                assert cost.flops(sizes) == pytest.approx(fam.flops(cfg, sizes), rel=1e-12), (name, preset, sizes)
    assert Cost.fit(lambda s: s["batch"] * s["seq"] ** 3, ("seq",)) is None  # not degree <= 2
    assert Cost.fit(lambda s: s["seq"] ** 2, ("seq",)) is None  # not linear in the batch
    assert Cost.fit(lambda s: s["batch"] * s["past"], ("seq",)) is None  # reads a size the fit does not give


def test_a_tampered_cost_section_is_one_line(echo, tmp_path):
    """"cost" is untrusted manifest input: a malformed one is refused at load, in one line naming the section."""
    from xdeploy.core.fsutil import atomic_write_json
    from xdeploy.export.artifact import write_manifest_files
    from xdeploy.export.onnx_export import export

    path = export(echo, preset="tiny", out=tmp_path / "a")
    m = json.loads((path / MANIFEST).read_text())
    assert load_artifact(path).cost == Cost.from_json(m["cost"])
    for bad, msg in [({"flops_per_row": [{"axes": {AXIS: 3}, "coef": 1.0}]}, "cost: .*powers 1-2, degree <= 2"),
                     ({"flops_per_row": [{"axes": {}, "coef": "1e9"}]}, "cost: .*a finite number coef"),
                     ({"flops_per_row": [], "fixed_tokens": 0}, "cost: fixed_tokens 0: expected an int >= 1"),
                     ([], "cost: expected an object with a flops_per_row list"),
                     ({"flops_per_row": [{"axes": {"batch": 1}, "coef": 1.0}]},
                      f"cost reads axis 'batch'; expected token axes among \\['{AXIS}'\\]")]:
        atomic_write_json(path / MANIFEST, write_manifest_files(path, m | {"cost": bad}))
        with pytest.raises(XDeployError, match=f"invalid manifest .*{msg}"):
            load_artifact(path)
    # without the section (an artifact written before manifests had it) bench asks the family: the same figures
    from xdeploy.bench.suite import model_cost

    sizes = {"batch": 3, AXIS: 40}
    atomic_write_json(path / MANIFEST, write_manifest_files(path, {k: v for k, v in m.items() if k != "cost"}))
    old = load_artifact(path)
    atomic_write_json(path / MANIFEST, write_manifest_files(path, m))
    assert old.cost is None and load_artifact(path).cost is not None
    assert model_cost(old)[0](sizes) == model_cost(load_artifact(path))[0](sizes) == echo_flops(EchoConfig(), sizes)
