"""Layerwise divergence finder: planted defects are located to the right node; bisection = linear scan."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
from onnxruntime.transformers.float16 import convert_float_to_float16
from planted import attention_query, corrupt_weight, scale_up

from xdeploy.core.errors import XDeployError
from xdeploy.deploy.metrics import compare
from xdeploy.export.artifact import load_artifact
from xdeploy.models.spec import DEFAULT_TOLERANCES, Tolerance, make_feeds
from xdeploy.verify.layerwise import _Probe, ancestors, comparable_tensors, find_divergence


@pytest.fixture(scope="module")
def bert(tiny_export):
    art = load_artifact(tiny_export("bert"))
    ref = onnx.load(str(art.onnx_path()))
    # Padded positions but no fully padded row: layerwise compares whole intermediate tensors, and the
    # garbage row of a fully padded input legitimately differs in fp16 (its -1e4 biases round to steps of 8).
    feeds = make_feeds(art.graph(), {"batch": 3, "seq": 16}, seed=1)
    return art, ref, feeds


def test_fp16_within_tolerance_gives_none_and_shares_names(bert):
    art, ref, feeds = bert
    f16 = convert_float_to_float16(copy.deepcopy(ref), keep_io_types=True)
    tensors = comparable_tensors(ref, f16)
    names = [t for t, _ in tensors]
    assert "last_hidden_state" in names and len(names) > 30
    assert find_divergence(ref, f16, feeds, DEFAULT_TOLERANCES["fp16"]) is None
    # An impossible tolerance makes every fp16-rounded tensor diverge: the first divergence found must be one
    # that depends on no other compared tensor (an embedding gather of fp16-rounded weights).
    d = find_divergence(ref, f16, feeds, Tolerance(0.0, 0.0, 1.0 + 1e-12))
    anc = ancestors(ref, tensors)
    assert d is not None and d.op_type == "Gather"
    assert anc[names.index(d.output)] == 1 << names.index(d.output)
    assert 0 < d.max_abs < 1e-2 and d.cand_range[0] <= d.cand_range[1]


@pytest.mark.parametrize("initializer", ["model.layers.1.ffn.fc2.bias", "model.layers.0.attn.value.bias"])
def test_corrupted_weight_is_located_to_its_consumer(bert, tmp_path, initializer):
    art, ref, feeds = bert
    bad = copy.deepcopy(ref)
    consumer = corrupt_weight(bad, initializer, delta=5.0)
    path = tmp_path / "bad.onnx"
    onnx.save(bad, str(path))  # the path form of the API
    d = find_divergence(art.onnx_path(), path, feeds, DEFAULT_TOLERANCES["fp32"])
    assert d is not None and d.node == consumer, d
    assert d.max_abs == pytest.approx(5.0, rel=1e-3)  # exactly the planted delta on one channel
    assert d.cosine < DEFAULT_TOLERANCES["fp32"].cosine


@pytest.mark.parametrize("batch", [2, 3, 5, 16, 1000])
def test_bisection_agrees_with_every_batch_size(bert, batch):
    """Any batch size (2 = binary search, 1000 = everything at once) must find the same first node."""
    art, ref, feeds = bert
    bad = copy.deepcopy(ref)
    consumer = corrupt_weight(bad, "model.layers.1.attn.query.bias", delta=3.0)
    d = find_divergence(ref, bad, feeds, DEFAULT_TOLERANCES["fp32"], batch=batch)
    assert d is not None and d.node == consumer


def test_fp16_overflow_is_located_to_the_overflowing_node(bert):
    art, ref, feeds = bert
    planted = copy.deepcopy(ref)
    node = scale_up(planted, attention_query(planted), factor=6e4)
    f16 = convert_float_to_float16(copy.deepcopy(planted), keep_io_types=True)
    # The fp32 graph is finite (values ~1e5); in fp16 they overflow to ±inf and the attention turns to NaN.
    d = find_divergence(planted, f16, feeds, DEFAULT_TOLERANCES["fp16"])
    assert d is not None and d.node == node and d.op_type == "Mul", d
    assert np.isfinite(d.ref_range).all() and max(abs(x) for x in d.ref_range) > 65504
    assert np.isinf(d.cand_range).any()


def test_openvino_bf16_candidate_on_the_same_graph(bert):
    pytest.importorskip("openvino")
    art, ref, feeds = bert
    # The fp32 graph computed by OpenVINO in bf16 (the ov:bf16 runner) is within bf16 tolerance...
    assert find_divergence(ref, ref, feeds, DEFAULT_TOLERANCES["bf16"], candidate_runtime="ov:bf16") is None
    # ...and an exact tolerance blames the first node bf16 rounding changes: every tensor it depends on is exact
    exact = Tolerance(0.0, 0.0, 1.0 + 1e-12)
    d = find_divergence(ref, ref, feeds, exact, candidate_runtime="ov:bf16")
    assert d is not None and d.max_abs > 0
    tensors = comparable_tensors(ref, ref)
    names = [t for t, _ in tensors]
    i = names.index(d.output)
    before = [names[j] for j in range(i) if ancestors(ref, tensors)[i] >> j & 1]
    if before:
        r = _Probe(ref, feeds, ["CPUExecutionProvider"], "all").run(before)
        c = _Probe(ref, feeds, [], "all", "ov:bf16").run(before)
        assert all(compare(r[n], c[n], exact).passed for n in before)
    with pytest.raises(XDeployError, match="unknown layerwise runtime 'trt'"):
        find_divergence(ref, ref, feeds, DEFAULT_TOLERANCES["bf16"], candidate_runtime="trt")


def test_bad_inputs_are_one_line_errors(bert, tmp_path):
    art, ref, feeds = bert
    with pytest.raises(XDeployError, match="cannot load candidate ONNX model"):
        find_divergence(ref, tmp_path / "missing.onnx", feeds, DEFAULT_TOLERANCES["fp32"])
    with pytest.raises(XDeployError, match="batch must be >= 2"):
        find_divergence(ref, ref, feeds, DEFAULT_TOLERANCES["fp32"], batch=1)
