"""Static int8 (Q/DQ): graph structure, parity of every registered model on ort / ov / ov:bf16, calibration data
(defaults, user files, methods, bad files) and the sensitivity search on a planted sensitive layer."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import shutil
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from planted import activation_outlier

from xdeploy import api
from xdeploy.cli import main
from xdeploy.core.errors import XDeployError
from xdeploy.export.artifact import load_artifact
from xdeploy.export.calibration import PARAGRAPH_TOKENS, default_calibration, load_calibration
from xdeploy.export.precision import PrecisionOptions, to_int8_static, with_calibration
from xdeploy.models.registry import MODELS, get_config
from xdeploy.verify.layerwise import tensor_values
from xdeploy.verify.parity import check_artifact
from xdeploy.verify.sensitivity import eval_cases, int8_sensitivity

WEIGHT_OPS = ("MatMul", "Gemm", "Conv")


@pytest.fixture(scope="module")
def fp32(tiny_export):
    """model -> fp32 artifact (api.export and export are the same at fp32), shared read-only (conftest.py)."""

    def get(model: str):
        return tiny_export(model)

    return get


@pytest.fixture(scope="module")
def int8(fp32, tmp_path_factory):
    root = tmp_path_factory.mktemp("int8q")
    cache: dict = {}

    def get(model: str):
        if model not in cache:
            cache[model] = api.convert_artifact(fp32(model), root / f"{model}-int8", "int8")
        return cache[model]

    return get


def _weight_nodes(proto: onnx.ModelProto) -> dict[str, str]:
    """MatMul/Gemm/Conv nodes of an fp32 graph whose second input is a constant weight."""
    inits = {i.name for i in proto.graph.initializer}
    return {n.name: n.op_type for n in proto.graph.node if n.op_type in WEIGHT_OPS and n.input[1] in inits}


def assert_qdq_structure(ref: onnx.ModelProto, q: onnx.ModelProto, kept: set[str]) -> int:
    """Every weight MatMul/Gemm/Conv not kept float reads DequantizeLinear on both inputs: the activation's from
    a QuantizeLinear with zero point 0 (int8, symmetric), the weight's from an int8 initializer with one scale
    per output channel; no dynamic-quantization op; no other op reads a quantized activation."""
    ops = collections.Counter(n.op_type for n in q.graph.node)
    assert not {"MatMulInteger", "DynamicQuantizeLinear", "ConvInteger", "MatMulIntegerToFloat"} & set(ops), ops
    assert max(o.version for o in q.opset_import if o.domain in ("", "ai.onnx")) >= 13
    inits = {i.name: i for i in q.graph.initializer}
    producer = {o: n for n in q.graph.node for o in n.output}
    by_name = {n.name: n for n in q.graph.node}
    # weight nodes: constant second input in the fp32 graph, or after the quantizer's constant folding (a tied
    # embedding's Transpose becomes an initializer: GPT's lm_head)
    weights = {n.name: n.op_type for n in q.graph.node if n.op_type in WEIGHT_OPS and (
        n.input[1] in inits or (n.input[1] in producer and producer[n.input[1]].op_type == "DequantizeLinear"
                                and producer[n.input[1]].input[0] in inits))}
    assert weights and set(_weight_nodes(ref)) <= set(weights), "a weight MatMul/Gemm/Conv went missing"
    act_dq = set()
    for name, op in weights.items():
        n = by_name[name]
        assert n.op_type == op
        if name in kept:
            assert all(producer.get(i) is None or producer[i].op_type != "DequantizeLinear" for i in n.input[:2])
            continue
        x_dq, w_dq = producer[n.input[0]], producer[n.input[1]]
        assert x_dq.op_type == "DequantizeLinear" and w_dq.op_type == "DequantizeLinear", name
        qx = producer[x_dq.input[0]]
        assert qx.op_type == "QuantizeLinear", name
        zp = inits[qx.input[2]]
        assert zp.data_type == onnx.TensorProto.INT8 and not numpy_helper.to_array(zp).any(), name
        w = inits[w_dq.input[0]]
        assert w.data_type == onnx.TensorProto.INT8, name
        w_zp, w_scale = (numpy_helper.to_array(inits[w_dq.input[k]]) for k in (2, 1))
        assert not w_zp.any() and w_scale.size > 1, f"{name}: weights not symmetric per channel"
        act_dq.add(x_dq.output[0])
    for n in q.graph.node:
        if n.op_type not in (*WEIGHT_OPS, "QuantizeLinear", "DequantizeLinear"):
            assert not act_dq & set(n.input), f"{n.name} ({n.op_type}) reads a quantized activation"
    assert not act_dq & {o.name for o in q.graph.output}
    return len(weights) - len(kept & set(weights))


# Every registered model. The encoder-decoder Transformer (3 graphs, each calibrated and searched) costs minutes
# on 2 shared cores, so it runs with `-m slow`, as its reduced-precision exports do in test_runners.py.
@pytest.mark.parametrize("model", [pytest.param(m, marks=[pytest.mark.slow] if len(MODELS[m].spec(
    next(iter(MODELS[m].presets.values()))).graphs) > 2 else []) for m in MODELS])
def test_qdq_structure_and_parity_on_every_runner(fp32, int8, model):
    art = load_artifact(int8(model))
    ref = load_artifact(fp32(model))
    assert art.precision == "int8" and art.tolerance == ref.spec.tolerances["int8"]
    for g in art.spec.graphs:
        info = art.manifest["conversion"][g.name]
        assert info["format"] == "qdq" and info["activation_symmetric"] and info["per_channel"]
        cal = info["calibration"]
        assert cal["method"] == "percentile" and cal["samples"] == 32 and len(cal["sha256"]) == 64
        assert cal["source"].startswith("default:")
        assert info["sensitivity"]["enabled"] and info["sensitivity"]["unresolved"] is None
        kept = {k["node"] for k in info["kept_fp32"]}
        n = assert_qdq_structure(onnx.load(str(ref.onnx_path(g.name))), onnx.load(str(art.onnx_path(g.name))), kept)
        assert n == info["quantized_nodes"] > 0
    rep = check_artifact(art, ["ort", "ov", "ov:bf16"])
    assert rep.passed, [(c.runner, c.graph, c.output, c.case, c.reason) for c in rep.failures]


def test_default_calibration_is_deterministic_and_follows_the_inputs(fp32):
    bert, vit = load_artifact(fp32("bert")), load_artifact(fp32("vit"))
    a, b = default_calibration(bert.spec), default_calibration(bert.spec)
    assert a.sha256 == b.sha256 and a.source["model"] == "default:text"
    lengths = [s["input_ids"].shape[1] for s in a.samples["model"]]
    assert min(lengths) < 16 and max(lengths) == bert.spec.axes["seq"].max  # short sentences and paragraphs
    # a paragraph sample holds PARAGRAPH_TOKENS whatever the maximum length (GPT-2 small's 1024: 2 rows; the
    # spec alone, no export needed)
    for model, preset, rows in (("gpt", "small", 2), ("bert", "tiny", 4)):
        spec = MODELS[model].spec(get_config(model, preset))
        paragraphs = [s["input_ids"] for s in default_calibration(spec).samples[spec.graphs[0].name]
                      if s["input_ids"].shape[1] == spec.axes["seq"].max]
        assert paragraphs and {p.shape[0] for p in paragraphs} == {rows}
        assert all(p.size <= max(PARAGRAPH_TOKENS, 4 * spec.axes["seq"].max) for p in paragraphs)
    assert all(s["attention_mask"].sum(1).min() >= 1 for s in a.samples["model"])
    img = default_calibration(vit.spec)
    px = np.concatenate([s["pixel_values"] for s in img.samples["model"]])
    assert img.source["model"] == "default:image" and np.isfinite(px).all() and px.std() > 0.3
    # the text set is not the parity sentences
    from xdeploy.export.calibration_text import SENTENCES
    from xdeploy.verify.parity import TEXTS

    assert not set(SENTENCES) & set(TEXTS)


def test_calibration_files_text_npz_and_bad_input(fp32, tmp_path):
    bert, vit = load_artifact(fp32("bert")), load_artifact(fp32("vit"))
    lines = tmp_path / "lines.txt"
    lines.write_text("first line of text\n\nsecond, a little longer line of text\nthird\nfourth\nfifth\n")
    cal = load_calibration(lines, bert.spec)
    assert cal.source["model"] == "file:lines.txt" and len(cal.samples["model"]) == 2  # 5 lines, 4 per sample
    assert cal.sha256["model"] == hashlib.sha256(lines.read_bytes()).hexdigest()
    px = np.random.default_rng(0).standard_normal((6, *vit.spec.graph("model").inputs[0].dims[1:])).astype("f4")
    np.savez(tmp_path / "px.npz", pixel_values=px)
    np.save(tmp_path / "px.npy", px)
    for f in ("px.npz", "px.npy"):
        c = load_calibration(tmp_path / f, vit.spec)
        assert [s["pixel_values"].shape[0] for s in c.samples["model"]] == [4, 2]
    bad = {
        "missing.txt": None,
        "bin.txt": b"\xff\xfe\x00bad",
        "empty.txt": b"\n\n",
        "obj.npy": "object",
        "ids.npz": {"input_ids": np.full((2, 4), 10**6), "attention_mask": np.ones((2, 4), np.int64),
                    "token_type_ids": np.zeros((2, 4), np.int64)},
        "keys.npz": {"nope": np.zeros(3)},
        "nan.npy": np.full(px.shape, np.nan, np.float32),
        "shape.npy": np.zeros((2, 3, 5, 5), np.float32),
        "broken.npz": b"PK\x03\x04 not a zip",
    }
    for name, content in bad.items():
        p = tmp_path / name
        if isinstance(content, bytes):
            p.write_bytes(content)
        elif isinstance(content, dict):
            np.savez(p, **content)
        elif isinstance(content, np.ndarray):
            np.save(p, content)
        elif content == "object":
            np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True)
        spec = bert.spec if name.endswith(".txt") or name == "ids.npz" or name == "keys.npz" else vit.spec
        with pytest.raises(XDeployError) as e:
            load_calibration(p, spec)
        msg = str(e.value)
        assert "calibration file" in msg and "\n" not in msg, (name, msg)
    with pytest.raises(XDeployError, match="takes no token ids"):
        load_calibration(lines, vit.spec)
    with pytest.raises(XDeployError, match="expected a .npz with one array per input"):
        load_calibration(tmp_path / "px.npy", bert.spec)


def test_cli_convert_with_calibration_file_and_method(fp32, tmp_path, capsys):
    lines = tmp_path / "cal.txt"
    lines.write_text("\n".join(f"calibration sentence number {i} about trains and weather" for i in range(8)))
    out = tmp_path / "q"
    assert main(["convert", str(fp32("bert")), "--precision", "int8", "--calibration", str(lines),
                 "--calibration-method", "minmax", "--no-sensitivity", "--out", str(out)]) == 0
    assert "minmax calibration, 2 samples, file:cal.txt" in capsys.readouterr().out
    info = json.loads((out / "manifest.json").read_text())["conversion"]["model"]
    cal = dict(info["calibration"])
    assert cal.pop("measured_tensors") > 0 and cal.pop("shared_tensors") == {}  # one graph: nothing to share
    assert cal == {"method": "minmax", "source": "file:cal.txt", "samples": 2,
                   "sha256": hashlib.sha256(lines.read_bytes()).hexdigest()}
    assert info["sensitivity"] == {"enabled": False}
    # the method changes the activation scales (default: percentile)
    mm = tmp_path / "mm"
    assert main(["convert", str(fp32("bert")), "--precision", "int8", "--calibration", str(lines),
                 "--no-sensitivity", "--out", str(mm)]) == 0

    def act_scales(path):
        p = onnx.load(str(path / "model.onnx"))
        inits = {i.name: numpy_helper.to_array(i) for i in p.graph.initializer}
        return {n.input[0]: float(inits[n.input[1]]) for n in p.graph.node if n.op_type == "QuantizeLinear"}

    a, b = act_scales(out), act_scales(mm)
    assert a.keys() == b.keys() and any(abs(a[k] - b[k]) > 1e-6 * b[k] for k in a)
    capsys.readouterr()
    for argv, msg in [(["--calibration", str(tmp_path / "none.npz")], "does not exist"),
                      (["--calibration-method", "median"], "invalid choice")]:
        with pytest.raises(SystemExit) as e:
            sys.exit(main(["convert", str(fp32("bert")), "--precision", "int8", "--out", str(tmp_path / "x"), *argv]))
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and msg in err, err
    assert not (tmp_path / "x").exists()


def _planted(fp32):
    art = load_artifact(fp32("bert"))
    proto = onnx.load(str(art.onnx_path()))
    # the last weight node: nothing downstream (no residual) hides what its quantization destroys
    weights = [n for n in proto.graph.node if n.name in _weight_nodes(proto)]
    name = activation_outlier(proto, weights[-1].name)
    opts = PrecisionOptions(int8_calibration=default_calibration(art.spec))
    return art, proto, name, opts


def test_sensitivity_keeps_the_planted_layer_float(fp32):
    art, proto, name, opts = _planted(fp32)
    graph = art.graph()
    tol = art.spec.tolerances["int8"]
    # without the search the planted layer breaks the tolerance
    q0, info0 = int8_sensitivity(proto, graph=graph, spec=art.spec, options=dataclasses.replace(
        opts, int8_sensitivity=False))
    assert name in {n.name for n in q0.graph.node} and not info0["kept_fp32"]
    case = eval_cases(graph, art.spec)[2]  # the maximum length
    outs = [t.name for t in graph.outputs]
    ref, bad = tensor_values(proto, case.feeds, outs), tensor_values(q0, case.feeds, outs)
    from xdeploy.deploy.metrics import compare

    assert not all(compare(ref[k], bad[k], tol).passed for k in outs)
    # with it: the planted MatMul is ranked first, kept float, and the graph is within tolerance
    q, info = int8_sensitivity(proto, graph=graph, spec=art.spec, options=opts, runtimes=("ort",))
    sens = info["sensitivity"]
    assert sens["unresolved"] is None and sens["rounds"][0]["kept_float"] == name, sens
    kept = {k["node"]: k for k in info["kept_fp32"]}
    assert kept[name]["reason"] == "sensitivity" and kept[name]["round"] == 1 and kept[name]["cosine_gain"] > 0.05
    assert len(kept) <= sens["budget"] == max(2, (info["quantized_nodes"] + len(kept)) // 4)
    assert_qdq_structure(proto, q, set(kept))
    good = tensor_values(q, case.feeds, outs)
    assert all(compare(ref[k], good[k], tol).passed for k in outs)
    # a spent budget is recorded, not hidden
    _, spent = int8_sensitivity(proto, graph=graph, spec=art.spec, runtimes=("ort",),
                                options=dataclasses.replace(opts, int8_max_excluded=0))
    assert spent["sensitivity"]["unresolved"]["why"] == "budget spent" and not spent["kept_fp32"]


def test_requested_exclusions_and_cached_ranges(fp32, tmp_path):
    art = load_artifact(fp32("bert"))
    proto = onnx.load(str(art.onnx_path()))
    first = next(iter(_weight_nodes(proto)))
    cal = default_calibration(art.spec)
    cache = tmp_path / "ranges.json"
    opts = PrecisionOptions(int8_exclude=(first,))
    q1, info1 = to_int8_static(proto, cal.samples["model"], opts, cache=cache)
    assert cache.is_file()
    q2, _ = to_int8_static(proto, [], opts, cache=cache)  # ranges from the cache: no calibration data needed
    assert q1.graph.SerializeToString() == q2.graph.SerializeToString()
    assert info1["kept_fp32"] == [{"node": first, "reason": "requested"}]
    assert_qdq_structure(proto, q1, {first})
    with pytest.raises(XDeployError, match="needs calibration data"):
        to_int8_static(proto, [], opts)


def test_the_searchs_real_text_case_is_the_longest_calibration_row(fp32):
    """The search's real-text case is one row (batch 1): the calibration sample's row with the most tokens, on
    every graph with token ids (the decode graph's cache inputs cut along their own batch axis)."""
    art = load_artifact(fp32("gpt"))
    cal = default_calibration(art.spec, art.tokenizer_dir)
    for g in art.spec.graphs:
        samples = cal.samples[g.name]
        case = eval_cases(g, art.spec, samples)[-1]
        assert case.name == "calibration sample"
        longest = max(samples, key=lambda f: sum(a.size for a in f.values()))
        mask = next(t.name for t in g.inputs if t.kind == "mask" and t.dims == g.inputs[0].dims)
        row = int(np.argmax(longest[mask].sum(axis=1)))
        for t in g.inputs:
            axis = t.dims.index("batch")
            assert case.feeds[t.name].shape[axis] == 1, (g.name, t.name)
            np.testing.assert_array_equal(case.feeds[t.name], np.take(longest[t.name], [row], axis=axis))
        assert case.feeds[mask].sum() == longest[mask].sum(axis=1).max() > 1


def _activation_scales(q: onnx.ModelProto) -> list[float]:
    inits = {i.name: i for i in q.graph.initializer}
    return sorted(float(numpy_helper.to_array(inits[n.input[1]]).ravel()[0]) for n in q.graph.node
                  if n.op_type == "QuantizeLinear" and n.input[1] in inits and n.input[0] not in inits)


def test_a_decode_graph_takes_the_prefill_graphs_ranges(fp32):
    """GPT's decode step runs the prefill graph's weights on the same text, so an artifact calibrates once: the
    decode graph's activation scales are the model graph's, recorded as shared. A graph calibrated on its own
    (no graph name: no memo) measures its own ranges, and different ones (the sharing is what made them equal);
    a calibration source given for the decode graph alone stays that graph's; every artifact starts empty."""
    art = load_artifact(fp32("gpt"))
    opts = with_calibration(PrecisionOptions(), "int8", art.spec, art.tokenizer_dir)
    cal = opts.int8_calibration
    protos = {g.name: onnx.load(str(art.onnx_path(g.name))) for g in art.spec.graphs}
    qm, im = to_int8_static(protos["model"], cal.samples["model"], opts, graph="model")
    qd, idc = to_int8_static(protos["decode"], cal.samples["decode"], opts, graph="decode")
    n = im["calibration"]["measured_tensors"]
    assert n == im["quantized_nodes"] > 0 and im["calibration"]["shared_tensors"] == {}
    assert idc["calibration"]["measured_tensors"] == 0 and idc["calibration"]["shared_tensors"] == {"model": n}
    assert _activation_scales(qd) == _activation_scales(qm)
    own, own_info = to_int8_static(protos["decode"], cal.samples["decode"], opts)
    assert own_info["calibration"]["measured_tensors"] == n and _activation_scales(own) != _activation_scales(qm)
    # a file for the decode graph alone (its source differs): the decode graph measures its own
    other = dataclasses.replace(cal, source={**cal.source, "decode": "file:decode.npz"}, ranges={})
    opts2 = dataclasses.replace(opts, int8_calibration=other)
    to_int8_static(protos["model"], other.samples["model"], opts2, graph="model")
    _, info2 = to_int8_static(protos["decode"], other.samples["decode"], opts2, graph="decode")
    assert info2["calibration"]["measured_tensors"] == n and info2["calibration"]["shared_tensors"] == {}
    # the next artifact (with_calibration runs once per export/convert) starts with an empty memo
    again = with_calibration(opts, "int8", art.spec, art.tokenizer_dir).int8_calibration
    assert cal.ranges and again.ranges == {} and again.sha256 == cal.sha256


def test_uint8_activations_for_onnxruntime(fp32, tmp_path, capsys):
    """--int8-activations uint8: asymmetric uint8 activation Q/DQ (onnxruntime's fast CPU kernels), recorded."""
    out = tmp_path / "u8"
    assert main(["convert", str(fp32("bert")), "--precision", "int8", "--int8-activations", "uint8",
                 "--no-sensitivity", "--out", str(out)]) == 0
    info = json.loads((out / "manifest.json").read_text())["conversion"]["model"]
    assert info["activation_type"] == "uint8" and not info["activation_symmetric"]
    q = onnx.load(str(out / "model.onnx"))
    inits = {i.name: i for i in q.graph.initializer}
    zps = [inits[n.input[2]] for n in q.graph.node if n.op_type == "QuantizeLinear"]
    assert zps and all(z.data_type == onnx.TensorProto.UINT8 for z in zps)
    assert check_artifact(load_artifact(out), ["ort"]).passed
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["convert", str(fp32("bert")), "--precision", "int8", "--int8-activations", "int4", "--out",
              str(tmp_path / "x")])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_int8_study_times_every_candidate_in_the_shared_harness(fp32, tmp_path):
    """studies/int8_study's speed part on a tiny model: every candidate timed by bench/interleave (a speed-up
    with its interval or an instability verdict for each, none for the baseline), FLOP/s never above the
    roofline peak it is judged against, the artifacts built once and reused."""
    from xdeploy.studies import int8_study

    work = tmp_path / "study"
    work.mkdir()
    shutil.copytree(fp32("bert"), work / "bert-tiny-fp32")  # the study's fp32 slot: reused, not exported again
    out = tmp_path / "study.json"
    argv = ["--model", "bert", "--preset", "tiny", "--quantizers", "dynamic", "--workdir", str(work),
            "--no-accuracy", "--max-seconds", "0.3", "--threads", "1", "--json", str(out)]
    assert int8_study.main(argv) == 0
    rep = json.loads(out.read_text())["speed"]
    res = rep["results"]
    assert set(res) == {"ort fp32", "ov fp32", "ov:bf16 fp32", "ort dynamic", "ov dynamic", "ov:bf16 dynamic"}
    assert rep["baseline"] == "ort dynamic" and res["ort dynamic"]["speedup"] is None
    for label, r in res.items():
        assert r["round_median_ms"] > 0 and r["gflops"] > 0 and isinstance(r["stable"], bool), label
        if label != "ort dynamic":
            sp = r["speedup"]
            assert sp["low"] <= sp["median"] <= sp["high"], label
        assert r["pct_of_peak"] is None or r["pct_of_peak"] <= 100.0, label
    assert (work / "bert-tiny-dynamic" / "manifest.json").is_file()


def test_histogram_on_edges_counts_exactly_as_numpy():
    """The sort-free binning gives np.histogram's counts to the last value: values on an edge, one ulp either
    side, outside the range, NaN, -0.0, and edges that are uniform only up to rounding (linspace, then grown by
    arange steps as onnxruntime grows them, or coarsened as _bounded_histograms coarsens them)."""
    from xdeploy.export.precision import histogram_on_edges

    rng = np.random.default_rng(1)
    first = np.histogram(np.abs(rng.standard_normal(5000)).astype(np.float32), bins=2048)[1].astype(np.float32)
    w = first[1] - first[0]
    grown = np.hstack((first, np.arange(first[-1] + w, np.float32(17.3) + w, w))).astype(np.float32)
    coarse = (float(grown[0]) + np.arange(301) * float(w) * 7).astype(np.float32)
    tiny = np.linspace(0, 3e-7, 2049).astype(np.float32)
    growing = np.hstack((first, np.arange(first[-1] + w, np.float32(9.1) + w, w)))  # float64, as while it grows
    assert growing.dtype == np.float64
    for edges in (first, grown, coarse, tiny, growing):
        x = (np.abs(rng.standard_normal(700_001)) * float(edges[-1]) / 2.5).astype(np.float32)
        picks = rng.integers(0, edges.size, 3000)
        x[:3000] = edges[picks]  # exactly on edges, the last one included
        x[3000:6000] = np.nextafter(edges[picks], np.float32(np.inf))
        x[6000:9000] = np.nextafter(edges[picks], np.float32(-np.inf))
        x[9000:9004] = [np.nan, -0.0, -1.0, float(edges[-1]) * 2]
        counts = histogram_on_edges(x, edges)
        assert counts is not None
        np.testing.assert_array_equal(counts, np.histogram(x, bins=edges)[0])
    assert histogram_on_edges(x.astype(np.float64), edges) is None  # not its case: numpy bins it
    assert histogram_on_edges(x, edges[::-1].copy()) is None


def test_percentile_calibration_is_identical_with_sort_free_binning(monkeypatch):
    """Under `_bounded_histograms`, onnxruntime's HistogramCollector builds the very same histograms (counts,
    edges, min, max) and percentile ranges as without, while every later sample is binned by
    histogram_on_edges, on the edges it keeps (float32) and on those it grows (float64)."""
    from onnxruntime.quantization import calibrate
    from onnxruntime.quantization.calibrate import HistogramCollector

    from xdeploy.export import precision

    binned: list[tuple[str, bool]] = []
    real = precision.histogram_on_edges

    def counting(a: np.ndarray, edges: np.ndarray) -> np.ndarray | None:
        counts = real(a, edges)
        binned.append((str(edges.dtype), counts is not None))
        return counts

    monkeypatch.setattr(precision, "histogram_on_edges", counting)

    rng = np.random.default_rng(2)
    samples = [{"a": [(rng.standard_normal((2, 512, 96)) * s).astype(np.float32)],
                "b": [(rng.standard_t(3, (2, 512, 24)) * s).astype(np.float32)]} for s in (1.0, 2.5, 0.7, 4.0, 3.0)]

    def run() -> HistogramCollector:
        c = HistogramCollector("percentile", True, 2048, 128, 99.99, "same")
        for sample in samples:
            c.collect(sample)
        return c

    ref = run()
    with precision._bounded_histograms():
        ours = run()
    assert calibrate.np is np  # restored
    assert len(binned) == 2 * (len(samples) - 1) and all(ok for _, ok in binned)
    assert {dtype for dtype, _ in binned} == {"float32", "float64"}
    for t in ("a", "b"):
        hist, edges, lo, hi = ours.histogram_dict[t]
        ref_hist, ref_edges, ref_lo, ref_hi = ref.histogram_dict[t]
        assert len(ref_edges) > 2049  # the later samples grew the histogram
        np.testing.assert_array_equal(hist, ref_hist)
        np.testing.assert_array_equal(edges, ref_edges)
        assert (lo, hi) == (ref_lo, ref_hi)
    assert {t: tuple(map(float, v)) for t, v in ours.compute_collection_result().items()} == \
        {t: tuple(map(float, v)) for t, v in ref.compute_collection_result().items()}


def test_percentile_histograms_stay_bounded_when_a_first_sample_is_nearly_zero():
    """onnxruntime's percentile histogram keeps its first sample's bin width: a tensor first seen nearly zero and
    then at full scale asked for ~1e11 bins (859 GiB) on the trained tiny GPT. Under `_bounded_histograms` the
    running histogram is coarsened instead, and the percentile range stays where the unbounded one puts it."""
    from onnxruntime.quantization.calibrate import HistogramCollector

    from xdeploy.export.precision import MAX_HISTOGRAM_BINS, _bounded_histograms

    rng = np.random.default_rng(0)
    tiny = (rng.standard_normal(4096) * 1e-9).astype(np.float32)
    big = [(rng.standard_normal(4096) * 3).astype(np.float32) for _ in range(4)]

    def ranges(first: np.ndarray) -> tuple[float, int]:
        c = HistogramCollector("percentile", True, 2048, 128, 99.9, "same")
        for a in [first, *big]:
            c.collect({"t": [a]})
        return float(c.compute_collection_result()["t"][1]), len(c.histogram_dict["t"][0])

    with _bounded_histograms():
        hi, bins = ranges(tiny)
        ref_hi, _ = ranges(big[0] * 0.5)  # a first sample at scale: no coarsening needed, onnxruntime's own result
    assert bins <= MAX_HISTOGRAM_BINS
    assert hi == pytest.approx(ref_hi, rel=0.02)
