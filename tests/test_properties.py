"""Property-based tests (hypothesis): feed validation and manifest parsing never fail with anything but a
clear XDeployError, and accept exactly what they should."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xdeploy.core.errors import XDeployError
from xdeploy.deploy.base import validate_feeds
from xdeploy.export.artifact import MANIFEST, load_artifact
from xdeploy.models.spec import DTYPES as SPEC_DTYPES
from xdeploy.models.spec import Axis, Graph, TensorSpec

GRAPH = Graph("model", "forward",
              inputs=(TensorSpec("ids", "int64", ("batch", "seq"), "ids", 100),
                      TensorSpec("mask", "int64", ("batch", "seq"), "mask"),
                      TensorSpec("pixels", "float32", ("batch", 3, 4))),
              outputs=())
AXES = {"batch": Axis(1, 2, 4), "seq": Axis(1, 8, 16)}
DTYPES = list(SPEC_DTYPES)  # every dtype a graph may declare: drawn for the wrong-dtype cases


def _ok(feeds) -> bool:
    """Independent statement of the contract: names, dtypes, ranks, fixed dims, ranges, shared axes, id range."""
    if set(feeds) != {"ids", "mask", "pixels"}:
        return False
    ids, mask, pix = feeds["ids"], feeds["mask"], feeds["pixels"]
    if (ids.dtype, mask.dtype, pix.dtype) != (np.int64, np.int64, np.float32):
        return False
    if ids.ndim != 2 or mask.ndim != 2 or pix.ndim != 3 or pix.shape[1:] != (3, 4):
        return False
    b, s = ids.shape
    if mask.shape != (b, s) or pix.shape[0] != b or not (1 <= b <= 4 and 1 <= s <= 16):
        return False
    return bool(ids.size == 0 or (ids.min() >= 0 and ids.max() < 100))


shape = st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple)
array = st.builds(lambda shp, dt, v: np.full(shp, v).astype(dt), shape, st.sampled_from(DTYPES),
                  st.integers(-2, 120))


@st.composite
def feeds(draw):
    b, s = draw(st.integers(0, 6)), draw(st.integers(0, 20))
    f = {"ids": np.full((b, s), draw(st.integers(-1, 101)), np.int64), "mask": np.ones((b, s), np.int64),
         "pixels": np.zeros((b, 3, 4), np.float32)}
    for name in draw(st.lists(st.sampled_from(["ids", "mask", "pixels", "extra"]), max_size=2)):
        if draw(st.booleans()):
            f.pop(name, None)
        else:
            f[name] = draw(array)
    return f


@given(feeds())
@settings(max_examples=300, deadline=None)
def test_validate_feeds_accepts_exactly_the_contract(f):
    try:
        out = validate_feeds(GRAPH, AXES, f)
    except XDeployError as e:
        assert not _ok(f), f"rejected valid feeds: {e}"
        assert "\n" not in str(e)
    else:
        assert _ok(f), "accepted invalid feeds"
        assert all(out[k] is f[k] for k in f)  # contiguous input arrays are not copied


@pytest.fixture(scope="module")
def art(tiny_export):
    return tiny_export("vit")


json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=True)
                           | st.text(max_size=8), lambda c: st.lists(c, max_size=3)
                           | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6)


@st.composite
def mutation(draw, manifest):
    """Replace or delete one value at a random path of the manifest."""
    m = json.loads(json.dumps(manifest))
    node, path = m, []
    while isinstance(node, (dict, list)) and node and (not path or draw(st.booleans())):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        k = draw(st.sampled_from(keys))
        path.append(k)
        parent, node = node, node[k]
    if path:
        if isinstance(parent, dict) and draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(json_values)
    return m


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_manifests_load_or_fail_cleanly(art, tmp_path, data):
    d = tmp_path / "m"
    if not d.exists():
        shutil.copytree(art, d)
    original = json.loads((art / MANIFEST).read_text())
    m = data.draw(mutation(original))
    (d / MANIFEST).write_text(json.dumps(m))
    try:
        loaded = load_artifact(d, verify=True)
    except XDeployError as e:
        assert "\n" not in str(e)
    else:
        assert loaded.graph("model").inputs  # whatever loads is usable


@pytest.mark.parametrize(("model", "edit", "expect"), [
    # each loaded before, then failed in use: a TypeError in the decode loop, a KeyError in a decode step, a
    # numpy broadcast error in the probes' output masks, a TypeError while listing the probed graphs
    ("gpt", lambda m: m["config"].__setitem__("eos_token_id", "x"), "config field 'eos_token_id' is 'x'; expected int"),
    ("gpt", lambda m: m["capabilities"]["decoding"].__setitem__("positions", "x"),
     "decoding names 'x', which graph 'decode' does not take"),
    ("transformer", lambda m: m["graphs"]["encoder"]["outputs"][0]["dims"].pop(1),
     "graph 'encoder' outputs [memory float32 rank 5] differ from its ONNX file's [memory float32 rank 6]"),
    ("gpt", lambda m: m["probes"]["cases"][1].__setitem__("graph", []), "probes: case 1 needs a graph"),
    # a head count the ONNX graph does not have: the loop sized its cache by it, onnxruntime refused the step
    ("gpt", lambda m: next(t for t in m["graphs"]["decode"]["inputs"] if t["name"] == "cache.0.key")["dims"]
     .__setitem__(1, 8), "graph 'decode' input 'cache.0.key' dim 1 is 8 in the manifest, 4 in its ONNX file"),
    # the torch runner called the method the manifest names: an AttributeError, or forward() with 9 arguments
    ("gpt", lambda m: m["graphs"]["decode"].__setitem__("method", "forward"),
     "graph 'decode' names method 'forward'; the gpt family computes it with 'decode'"),
])
def test_manifests_that_failed_in_use_are_refused_in_one_line(tiny_export, tmp_path, capsys, model, edit, expect):
    from xdeploy.cli import main

    d = tmp_path / "a"
    shutil.copytree(tiny_export(model), d)
    m = json.loads((d / MANIFEST).read_text())
    edit(m)
    (d / MANIFEST).write_text(json.dumps(m))
    runner = "torch" if "method" in expect else "ort"
    assert main(["generate", str(d), "--prompt-ids", "1,2", "--new-tokens", "2", "--runner", runner]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert len(err) == 1 and expect in err[0], err


def test_a_config_that_does_not_fit_the_reference_weights_is_refused_before_allocating(tiny_export, tmp_path):
    from xdeploy.deploy.torch_runner import load_reference

    d = tmp_path / "a"
    shutil.copytree(tiny_export("bert"), d)
    m = json.loads((d / MANIFEST).read_text())
    m["config"]["type_vocab_size"] = 10**12  # built as asked: 256 TB of embeddings, a RuntimeError from torch
    (d / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(XDeployError, match=r"has shape \(2, \d+\); the model expects \(1000000000000, \d+\)"):
        load_reference(load_artifact(d))


def test_feeds_no_machine_holds_are_one_line_not_an_allocation():
    from xdeploy.models.spec import make_feeds

    g = Graph("model", "forward", (TensorSpec("x", "float32", ("batch", 10**9)),),
              (TensorSpec("y", "float32", ("batch",)),))
    assert make_feeds(g, {"batch": 0})["x"].shape == (0, 10**9)  # empty: nothing to hold
    with pytest.raises(XDeployError, match=r"inputs of graph 'model' at these sizes take .* GiB \('x': \(4096, "):
        make_feeds(g, {"batch": 4096})  # 32 TiB while drawn


def test_available_memory_is_read_without_psutil_too(monkeypatch):
    """The serving environment has no psutil: the check then reads /proc/meminfo's MemAvailable, the figure
    psutil reports on Linux (within what other processes allocate between the two reads), never "unbounded"."""
    import math
    import sys

    import psutil

    from xdeploy.core.memory import system_available

    with_psutil, total = system_available(), psutil.virtual_memory().total
    monkeypatch.setitem(sys.modules, "psutil", None)  # `import psutil` now raises ImportError
    without = system_available()
    assert math.isfinite(without) and 0 < without <= total
    assert abs(without - with_psutil) < 0.1 * total
