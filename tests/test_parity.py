"""Parity: metrics and verdicts, input sets, tiny models x runners x precisions, planted defects, CLI."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import onnx
import pytest
from families import names, params, smallest
from onnxruntime.transformers.float16 import convert_float_to_float16
from planted import attention_query, corrupt_weight, scale_up

from xdeploy.api import export  # with the measured refinement (fp16 AMP, int8 sensitivity)
from xdeploy.cli import main
from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import atomic_write_json
from xdeploy.deploy.metrics import compare
from xdeploy.deploy.verdict import meaningful, tolerance_precision
from xdeploy.export.artifact import MANIFEST, load_artifact, write_manifest_files
from xdeploy.export.precision import EXPORT_PRECISIONS
from xdeploy.models.registry import MODELS
from xdeploy.models.spec import DEFAULT_TOLERANCES, Tolerance
from xdeploy.verify.parity import (
    check_artifact,
    drop_empty_rows,
    input_cases,
    parse_shapes,
    parse_tolerance_overrides,
)

FP32, FP16 = DEFAULT_TOLERANCES["fp32"], DEFAULT_TOLERANCES["fp16"]


def _has_openvino() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


RUNNERS = ["torch", "ort"] + (["ov"] if _has_openvino() else [])


# ------------------------------------------------------------------------------------ metrics (no models) ----

def test_compare_values_direction_and_nonfinite():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((4, 8, 16)).astype(np.float32)
    assert compare(ref, ref.copy(), FP32).passed
    small = ref + 5e-5  # inside atol everywhere
    c = compare(ref, small, FP32)
    assert c.passed and c.within == 1.0 and c.max_abs == pytest.approx(5e-5, rel=1e-2)
    # A 2% scale error: outside atol/rtol and, being a pure scale, still cosine 1 -> passes on direction only
    scaled = compare(ref, ref * 1.02, FP32)
    assert scaled.within < 1.0 and scaled.cosine == pytest.approx(1.0) and scaled.passed
    # Noise of 30% relative: fails both criteria
    noisy = compare(ref, ref + 0.3 * rng.standard_normal(ref.shape).astype(np.float32), FP16)
    assert not noisy.passed and noisy.cosine < FP16.cosine and "cosine" in noisy.reason
    # One NaN fails whatever the other metrics say, and is counted
    bad = ref.copy()
    bad[1, 2, 3] = np.nan
    bad[0, 0, 0] = np.inf
    c = compare(ref, bad, Tolerance(1.0, 1.0, 0.0))
    assert not c.passed and c.nonfinite == 2 and c.reason == "2 NaN/Inf"
    with pytest.raises(ValueError, match="shape mismatch"):
        compare(ref, ref[0], FP32)


def test_compare_mask_saturation_and_relative_error():
    ref = np.array([[1.0, 2.0, -3e38, 0.0], [5.0, 6.0, 7.0, 8.0]], np.float32)
    cand = np.array([[1.0, 2.0, -65504.0, 1e-5], [50.0, 60.0, 70.0, 80.0]], np.float32)
    mask = np.array([[True], [False]])  # row 1 is padding: garbage there is not compared
    c = compare(ref, cand, FP32, mask=mask)
    assert c.passed and c.compared == 3  # -3e38 vs -65504 is saturation, not an error
    assert c.max_rel == 0.0  # ref 0.0 (|ref| <= atol) is judged by atol only, not by relative error
    c = compare(ref, cand, FP32)
    assert not c.passed and c.max_rel == pytest.approx(9.0)
    # ...but a positive value where the reference saturates negatively is an error
    flip = cand.copy()
    flip[0, 2] = 65504.0
    assert compare(ref, flip, FP32, mask=mask).nonfinite == 1


def test_compare_in_chunks_equals_the_whole_tensor_formulas(monkeypatch):
    """compare works through a large tensor in chunks (bounded float64 temporaries): every metric is the
    whole-tensor formula, with a NaN, a saturated value and masked-out garbage in different chunks."""
    from xdeploy.deploy import metrics

    monkeypatch.setattr(metrics, "CHUNK", 1000)
    rng = np.random.default_rng(3)
    ref = rng.standard_normal((7, 1003)).astype(np.float32)
    cand = (ref + 0.01 * rng.standard_normal(ref.shape)).astype(np.float32)
    ref[5, 7], cand[5, 7] = -3e38, -65504.0  # saturation: matches, not compared
    cand[6, 900] = np.nan  # a NaN in another chunk
    mask = np.ones((7, 1), bool)
    mask[2] = False  # a padded row (its garbage is not compared)
    cand[2] += 100.0
    c = compare(ref, cand, FP32, mask=mask)
    sel = np.broadcast_to(mask, ref.shape) & np.isfinite(cand) & (np.abs(ref) < 1e30)
    r, x = ref[sel].astype(np.float64), cand[sel].astype(np.float64)
    d = np.abs(x - r)
    assert c.nonfinite == 1 and not c.passed and c.compared == r.size == 6 * 1003 - 2
    assert c.max_abs == pytest.approx(d.max(), rel=1e-12) and c.mean_abs == pytest.approx(d.mean(), rel=1e-9)
    assert c.cosine == pytest.approx(r @ x / np.linalg.norm(r) / np.linalg.norm(x), rel=1e-12)
    assert c.within == pytest.approx(np.mean(d <= FP32.atol + FP32.rtol * np.abs(r)), rel=1e-12)
    big = np.abs(r) > FP32.atol
    assert c.max_rel == pytest.approx((d[big] / np.abs(r[big])).max(), rel=1e-12)


def test_cosine_whole_and_per_row():
    from xdeploy.deploy.metrics import cosine

    a = np.array([[1.0, 0.0], [0.0, 0.0], [3.0, 4.0], [0.0, 0.0]], np.float32)
    b = np.array([[0.0, 2.0], [0.0, 0.0], [6.0, 8.0], [1.0, 0.0]], np.float32)
    # per row: orthogonal, both zero (1 by definition), parallel, one zero (0 by definition)
    np.testing.assert_array_equal(cosine(a, b, axis=1), [0.0, 1.0, 1.0, 0.0])
    assert cosine(a, b) == pytest.approx((3 * 6 + 4 * 8) / (np.sqrt(1 + 9 + 16) * np.sqrt(4 + 36 + 64 + 1)))
    assert cosine(a[2], -b[2]) == pytest.approx(-1.0) and isinstance(cosine(a, b), float)


def test_tolerance_precision_and_overrides():
    assert tolerance_precision("fp32", "bf16") == "bf16"  # ov:bf16 / torch:bf16 on an fp32 artifact
    assert tolerance_precision("int8", "fp32") == "int8"
    assert tolerance_precision("fp16", "fp32") == "fp16"
    o = parse_tolerance_overrides(["logits:atol=1e-3,cosine=0.99", "rtol=0.5"])
    assert o == {"logits": {"atol": 1e-3, "cosine": 0.99}, "*": {"rtol": 0.5}}
    for bad in ["logits:atol", "logits:foo=1", "atol=-1", "atol=nan"]:
        with pytest.raises(XDeployError, match="bad tolerance"):
            parse_tolerance_overrides([bad])
    assert parse_shapes("1x1, 4xmax,2x17") == [(1, 1), (4, None), (2, 17)]
    for bad in ["4", "0x3", "2x0", "axb", ","]:
        with pytest.raises(XDeployError):
            parse_shapes(bad)


# ------------------------------------------------------------------------------------------ artifacts ----

@pytest.fixture(scope="module")
def arts(tiny_export):
    """model -> its smallest preset's fp32 artifact, exported on first use (conftest.py; shared read-only)."""

    class Lazy(dict):
        def __missing__(self, m: str):
            self[m] = load_artifact(tiny_export(m, preset=smallest(m)))
            return self[m]

    return Lazy()


def test_input_cases_cover_seq1_max_padding_and_empty_row(arts):
    art = arts["bert"]
    cases = input_cases(art)
    assert [c.sizes for c in cases] == [{"batch": 1, "seq": 1}, {"batch": 2, "seq": 17}, {"batch": 3, "seq": 128}]
    mask = cases[2].feeds["attention_mask"]
    assert not mask[0].any() and mask[1].all() and mask[2].sum() == 64  # empty row, full row, half padded
    g = art.graph()
    keep = meaningful(g, g.outputs[0], cases[2].feeds, (3, 128, 64))
    assert keep.shape == (3, 128, 1) and keep.sum() == 128 + 64
    assert meaningful(g, g.outputs[1], cases[2].feeds, (3, 64)).ravel().tolist() == [False, True, True]
    dropped = drop_empty_rows(g, cases[2].feeds)
    assert dropped["input_ids"].shape == (2, 128) and dropped["attention_mask"][0].all()
    # GPT decode: the cache axis gets the sequence size, the new token's position stays in the table
    dec = input_cases(arts["gpt"], "decode", [(2, None)])[0]
    assert dec.sizes["cache"] == 256 and dec.feeds["position_ids"].max() == 255


def test_text_inputs_from_the_artifact_tokenizer(arts, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "deployed", "model", "that", "is", "fast", "but", "wrong"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2),
                                                                                                  ("[SEP]", 3)])
    art_dir = tmp_path / "bert"
    shutil.copytree(arts["bert"].path, art_dir)
    (art_dir / "tokenizer").mkdir()
    tok.save(str(art_dir / "tokenizer" / "tokenizer.json"))
    m = json.loads((art_dir / MANIFEST).read_text())
    atomic_write_json(art_dir / MANIFEST, write_manifest_files(art_dir, m))
    art = load_artifact(art_dir)
    text = input_cases(art, texts=["a model that is fast but wrong", "", "wrong " * 500])[-1]
    assert text.name == "text 3x128"  # the long text is truncated at the exported maximum
    assert text.feeds["attention_mask"].sum(axis=1).tolist() == [9, 2, 128]
    assert text.feeds["input_ids"][0, :3].tolist() == [2, 4, 6]
    rep = check_artifact(art, ["ort"], shapes=[(1, 4)], layerwise="never")
    assert rep.passed and {c.case for c in rep.checks} == {"1x4", "text 5x128"}
    (art_dir / "tokenizer" / "tokenizer.json").write_text("{not json")
    with pytest.raises(XDeployError, match="cannot read .*tokenizer.json"):
        input_cases(load_artifact(art_dir, verify=False))


@pytest.mark.parametrize("model", params(slow_when_many_graphs=True))
def test_tiny_models_pass_fp32_on_every_runner(arts, model):
    rep = check_artifact(arts[model], RUNNERS, layerwise="never")
    assert rep.passed, [(c.runner, c.graph, c.case, c.output, c.reason) for c in rep.failures]
    graphs = {g.name for g in arts[model].spec.graphs}
    assert {(c.runner, c.graph) for c in rep.checks} == {(r, g) for r in RUNNERS for g in graphs}
    ort = [c for c in rep.checks if c.runner == "ort"]
    assert all(0.0 < c.comparison.max_abs < FP32.atol * 10 and c.comparison.cosine > 0.99999 for c in ort)
    if MODELS[model].capabilities.role == "decoder":
        assert all(c.top1 == 1.0 for c in rep.checks if c.output == "logits")


@pytest.mark.parametrize("precision", [p for p in ("fp16", "int8") if p in EXPORT_PRECISIONS])
def test_bert_lower_precisions_pass_at_default_tolerances(tmp_path, precision):
    art = load_artifact(export("bert", preset="tiny", out=tmp_path / precision, precision=precision))
    rep = check_artifact(art, ["torch", "ort"], layerwise="never")
    assert rep.passed, [(c.case, c.output, c.reason) for c in rep.failures]
    # torch computes from the fp32 reference weights whatever the artifact's precision; ort runs the graph
    assert {(c.runner, c.precision) for c in rep.checks} == {("torch", "fp32"), ("ort", precision)}
    ort = [c for c in rep.checks if c.runner == "ort"]
    assert max(c.comparison.max_abs for c in ort) > FP32.atol  # really lower precision, judged by its own tolerance


# -------------------------------------------------------------------------------------- planted defects ----

def _rehash(art_dir):
    m = json.loads((art_dir / MANIFEST).read_text())
    atomic_write_json(art_dir / MANIFEST, write_manifest_files(art_dir, m))


def test_corrupted_weight_fails_parity_and_layerwise_finds_its_consumer(arts, tmp_path, capsys):
    art_dir = tmp_path / "bert"
    shutil.copytree(arts["bert"].path, art_dir)
    proto = onnx.load(str(art_dir / "model.onnx"))
    consumer = corrupt_weight(proto, "model.layers.0.ffn.fc1.bias", delta=4.0)
    onnx.save(proto, str(art_dir / "model.onnx"))
    _rehash(art_dir)  # a consistent manifest: the sha256 check cannot catch this, only parity can
    out = tmp_path / "parity.json"
    # No reference ONNX is given: layerwise re-exports the fp32 graph from the artifact's reference weights.
    code = main(["parity", str(art_dir), "--runners", "ort", "--shapes", "2x16", "--json", str(out)])
    assert code == 1
    text = capsys.readouterr()
    assert "FAIL" in text.out and f"first divergent node {consumer}" in text.out.replace("\n", " ")
    assert "parity check(s) failed" in text.err
    rep = json.loads(out.read_text())
    assert rep["passed"] is False
    lw = rep["artifacts"][0]["layerwise"]
    assert lw[0]["divergence"]["node"] == consumer and lw[0]["divergence"]["max_abs"] == pytest.approx(4.0)


def test_fp16_overflow_is_caught_and_located(arts, tmp_path):
    """An fp16 artifact whose attention query is scaled past 65504: NaN outputs, blamed on the scaling node."""
    src = arts["bert"]
    planted = onnx.load(str(src.onnx_path()))
    node = scale_up(planted, attention_query(planted), factor=6e4)
    ref_path = tmp_path / "planted-fp32.onnx"
    onnx.save(planted, str(ref_path))
    art_dir = tmp_path / "bert-fp16"
    shutil.copytree(src.path, art_dir)
    onnx.save(convert_float_to_float16(copy.deepcopy(planted), keep_io_types=True), str(art_dir / "model.onnx"))
    m = json.loads((art_dir / MANIFEST).read_text())
    m["precision"] = "fp16"
    atomic_write_json(art_dir / MANIFEST, write_manifest_files(art_dir, m))
    art = load_artifact(art_dir)
    rep = check_artifact(art, ["ort"], shapes=[(2, 16)], reference_onnx=lambda g: ref_path)
    assert not rep.passed
    assert all(c.comparison.nonfinite > 0 and "NaN/Inf" in c.reason for c in rep.failures)
    (finding,) = rep.layerwise
    assert finding.divergence is not None and finding.divergence.node == node and finding.runtime == "ort"
    assert np.isinf(finding.divergence.cand_range).any()
    doc = json.loads(json.dumps(rep.to_json(), allow_nan=False))  # ±inf ranges become null in JSON
    assert None in doc["layerwise"][0]["divergence"]["cand_range"]


# ------------------------------------------------------------------------------------------------- CLI ----

def test_cli_passes_with_json_records(arts, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["parity", str(arts["vit"].path), "--runners", "torch,ort", "--shapes", "1x1,4xmax",
                 "--tolerance", "logits:cosine=0.9999", "--layerwise", "--json", str(out),
                 "--records", str(tmp_path / "p.jsonl")]) == 0
    rep = json.loads(out.read_text())
    # --records: the run's parity records (verify/parity.py parity_records), the worst of the JSON's cases
    from xdeploy.core.records import read_records

    recs = read_records(tmp_path / "p.jsonl")
    assert {(r["runner"], r["output"], r["cases"], r["passed"]) for r in recs} == {("torch", "logits", 2, True),
                                                                                  ("ort", "logits", 2, True)}
    for r in recs:
        mine = [c for c in rep["artifacts"][0]["checks"] if c["runner"] == r["runner"]]
        assert r["max_abs"] == max(c["max_abs"] for c in mine) and r["model"] == "vit" and r["min_cosine"] == 0.9999
    checks = rep["artifacts"][0]["checks"]
    assert rep["passed"] and len(checks) == 4 and all(isinstance(c["max_abs"], float) for c in checks)
    assert {c["min_cosine"] for c in checks} == {0.9999} and all(c["top1"] == 1.0 for c in checks)
    # --layerwise always runs: an fp32 artifact against its own re-export has no divergent node
    assert rep["artifacts"][0]["layerwise"][0]["divergence"] is None
    assert "model/logits" in capsys.readouterr().out


@pytest.mark.parametrize("argv, msg", [
    (["--runners", "nope"], "unknown runner 'nope'"),
    (["--shapes", "3"], "bad shape '3'"),
    (["--tolerance", "logits:x=1"], "bad tolerance"),
    (["--precision", "fp16"], "apply to a MODEL name only"),
])
def test_cli_user_errors_are_one_line(arts, capsys, argv, msg):
    assert main(["parity", str(arts["vit"].path), *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1


def test_cli_unknown_model_and_precision(capsys):
    assert main(["parity", "nomodel"]) == 2
    assert "unknown model 'nomodel'" in capsys.readouterr().err
    assert main(["parity", "vit", "--precision", "fp8"]) == 2
    assert "unknown export precision 'fp8'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("model", names())
def test_full_matrix_from_model_names(model, tmp_path):
    """Every model x {ort, ov, ov:bf16, torch:bf16} x every export precision, as `xdeploy parity MODEL` does."""
    out = tmp_path / "p.json"
    runners = RUNNERS[1:] + (["ov:bf16"] if "ov" in RUNNERS else []) + ["torch:bf16"]
    code = main(["parity", model, "--preset", smallest(model), "--runners", ",".join(runners),
                 "--precision", ",".join(EXPORT_PRECISIONS), "--json", str(out)])
    rep = json.loads(out.read_text())
    fails = [(a["name"], c["runner"], c["graph"], c["output"], c["case"], c["reason"])
             for a in rep["artifacts"] for c in a["checks"] if not c["passed"]]
    assert code == 0, fails
