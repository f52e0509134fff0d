"""The one artifact cache (export/cache.py): export once per key, reuse while it verifies, re-export when the
entry is damaged or the checkpoint changes. Tiny preset, real exports."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from xdeploy.core.errors import XDeployError
from xdeploy.export.artifact import load_artifact
from xdeploy.export.cache import cache_root, cached_artifact
from xdeploy.models.registry import MODELS


def _first_model() -> str:
    """A registered model with a tiny preset and the fewest graphs: the quickest export (the registry decides)."""
    tiny = [name for name, family in MODELS.items() if "tiny" in family.presets]
    return min(tiny, key=lambda name: len(MODELS[name].spec(MODELS[name].presets["tiny"]).graphs))


def test_preset_entries_are_reused_and_damaged_ones_rebuilt(tmp_path, monkeypatch):
    """cached_artifact: one export per key, reused in place; a damaged entry is rebuilt; the key is the export
    cache's (export_key), so a change to the source an export runs gives a new entry."""
    import xdeploy.export.cache as cache
    import xdeploy.export.store as store

    model = _first_model()
    logs: list[str] = []
    a = cached_artifact(model, preset="tiny", root=tmp_path, log=logs.append)
    b = cached_artifact(model, preset="tiny", root=tmp_path, log=logs.append)
    assert a == b and len(logs) == 1 and a.parent == tmp_path  # exported once, then served from the cache
    stamp = (a / "manifest.json").stat().st_mtime_ns
    onnx = next(a.glob("*.onnx"))
    onnx.write_bytes(onnx.read_bytes()[:-16])  # a truncated graph: its sha256 no longer matches the manifest
    with pytest.raises(XDeployError):
        load_artifact(a)
    c = cached_artifact(model, preset="tiny", root=tmp_path, log=logs.append)
    assert c == a and len(logs) == 2 and load_artifact(c).path == a  # exported again, verified
    assert (a / "manifest.json").stat().st_mtime_ns != stamp
    monkeypatch.setattr(cache, "export_source_hash", lambda: "edited exporter")
    monkeypatch.setattr(store, "export_source_hash", lambda: "edited exporter")  # eviction's view too
    d = cached_artifact(model, preset="tiny", root=tmp_path, log=logs.append)
    assert d != a and len(logs) == 3 and d.name.rsplit("-", 1)[0] == a.name.rsplit("-", 1)[0]


def test_checkpoint_entries_follow_the_checkpoint(tmp_path):
    from tiny_text import tiny_text_checkpoint

    from xdeploy.models.checkpoint import load_checkpoint

    ck = tiny_text_checkpoint(tmp_path / "ck")
    model = load_checkpoint(ck).model
    a = cached_artifact(model, checkpoint=ck, root=tmp_path / "c")
    assert "ckpt" in a.name and cached_artifact(model, checkpoint=ck, root=tmp_path / "c") == a
    weights = next(ck.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # rewritten checkpoint
    b = cached_artifact(model, checkpoint=ck, root=tmp_path / "c")
    assert b != a and load_artifact(b).manifest["source"]["checkpoint"] == str(ck.resolve())
    with pytest.raises(XDeployError, match="does not exist"):
        cached_artifact(model, checkpoint=tmp_path / "none", root=tmp_path / "c")
    with pytest.raises(XDeployError, match="not both"):
        cached_artifact(model, checkpoint=ck, preset="tiny", root=tmp_path / "c")


def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("XDEPLOY_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("XDEPLOY_CACHE")
    assert cache_root().parts[-2:] == (".cache", "xdeploy")


# --- the export cache (export/cache.py cached_export; `xdeploy export`, api.export) -------------------------------


def _files(path) -> dict[str, str]:
    return load_artifact(path).manifest["files"]


def test_cli_export_reuses_an_identical_export_without_importing_torch(tmp_path, monkeypatch, capsys):
    """A second `xdeploy export` with the same arguments copies the first (verified) in a process that never
    imports torch; an existing --out is still refused without --force."""
    import subprocess
    import sys

    from xdeploy.cli import main

    monkeypatch.setenv("XDEPLOY_CACHE", str(tmp_path / "cache"))
    model = _first_model()
    assert main(["export", model, "--preset", "tiny", "--out", str(tmp_path / "a")]) == 0  # a miss: exported
    assert "export cache" not in capsys.readouterr().out
    [entry] = (tmp_path / "cache" / "exports").iterdir()
    assert _files(entry) == _files(tmp_path / "a")
    code = (f"import sys; from xdeploy.cli import main; rc = main(['export', {model!r}, '--preset', 'tiny', "
            f"'--out', {str(tmp_path / 'b')!r}]); print('torch imported:', 'torch' in sys.modules); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"export cache: {entry} reused" in r.stdout and "torch imported: False" in r.stdout, r.stdout
    assert f"-> {tmp_path / 'b'}" in r.stdout  # the same summary line as an export
    assert _files(tmp_path / "b") == _files(tmp_path / "a")  # the same bytes, every sha256 verified on load
    with pytest.raises(SystemExit) as e:  # an existing --out: the export's own refusal, cache or not
        sys.exit(main(["export", model, "--preset", "tiny", "--out", str(tmp_path / "b")]))
    assert e.value.code == 2 and "already exists; pass --force" in capsys.readouterr().err


def test_export_cache_verifies_entries_and_fresh_exports_again(tmp_path, monkeypatch, tiny_export):
    """The cache logic with a counting export (a copy of the shared tiny artifact stands for the torch export,
    which the test above runs for real): a damaged entry is never copied into place but exported again and
    replaced, `fresh` exports again, `force` replaces an existing output."""
    import shutil

    from xdeploy.export.cache import cached_export

    monkeypatch.setenv("XDEPLOY_CACHE", str(tmp_path / "cache"))
    model = _first_model()
    src = tiny_export(model)
    runs: list[Path] = []

    def export_once(out):
        def run():
            runs.append(out)
            shutil.copytree(src, out)
            return out
        return run

    def cached(name, **kw):
        out = tmp_path / name
        return cached_export(model, {"preset": "tiny", "out": out, "force": kw.pop("force", False)},
                             export_once(out), log=logs.append, **kw)

    logs: list[str] = []
    cached("a")
    cached("b")
    assert len(runs) == 1 and "reused" in logs[-1] and _files(tmp_path / "b") == _files(src)
    [entry] = (tmp_path / "cache" / "exports").iterdir()
    onnx = next(entry.glob("*.onnx"))
    onnx.write_bytes(onnx.read_bytes()[:-16])  # a damaged entry: its sha256 no longer matches
    cached("c")
    assert len(runs) == 2 and "not reused" in logs[-1] and "sha256" in logs[-1]
    assert _files(tmp_path / "c") == _files(src) and _files(entry) == _files(src)  # exported, entry replaced
    cached("d", fresh=True)
    assert len(runs) == 3 and not any(p.name.startswith(".") for p in tmp_path.iterdir())
    (tmp_path / "d" / "old-file").write_text("")
    cached("d", force=True)  # an existing output with force: replaced by the cached copy
    assert len(runs) == 3 and not (tmp_path / "d" / "old-file").exists() and _files(tmp_path / "d") == _files(src)
    with pytest.raises(XDeployError, match="already exists"):
        cached("d")


def test_export_cache_keeps_only_small_entries_within_its_budget(tmp_path, monkeypatch, tiny_export):
    """Entries are full copies: an export over XDEPLOY_EXPORT_CACHE_MAX_MB is not stored, and past
    XDEPLOY_EXPORT_CACHE_BUDGET_MB the least recently used entries go first (a hit counts as a use); a bad
    setting is one clear error."""
    import os
    import shutil

    from xdeploy.export.cache import _dir_bytes, cached_export

    monkeypatch.setenv("XDEPLOY_CACHE", str(tmp_path / "cache"))
    model = _first_model()
    src = tiny_export(model)
    mb = _dir_bytes(src) / 2**20
    root = tmp_path / "cache" / "exports"

    def cached(name, seed):
        out = tmp_path / name
        return cached_export(model, {"preset": "tiny", "seed": seed, "out": out, "force": True},
                             lambda: Path(shutil.copytree(src, out)), log=logs.append)

    logs: list[str] = []
    monkeypatch.setenv("XDEPLOY_EXPORT_CACHE_MAX_MB", str(mb / 2))
    cached("big", 0)
    assert "not stored" in logs[-1] and "XDEPLOY_EXPORT_CACHE_MAX_MB" in logs[-1] and not root.exists()
    monkeypatch.delenv("XDEPLOY_EXPORT_CACHE_MAX_MB")
    monkeypatch.setenv("XDEPLOY_EXPORT_CACHE_BUDGET_MB", str(2.5 * mb))  # room for two entries
    cached("a", 1)
    [ea] = root.iterdir()
    cached("b", 2)
    [eb] = set(root.iterdir()) - {ea}  # not by mtime: two entries made in the same clock tick tie
    os.utime(ea, (1, 1)), os.utime(eb, (2, 2))
    cached("a2", 1)  # a hit on the older entry: it becomes the most recently used
    assert "reused" in logs[-1]
    cached("c", 3)  # a third entry: the least recently used (b) goes
    assert ea.is_dir() and not eb.exists() and len(list(root.iterdir())) == 2
    monkeypatch.setenv("XDEPLOY_EXPORT_CACHE_BUDGET_MB", "lots")
    with pytest.raises(XDeployError, match="XDEPLOY_EXPORT_CACHE_BUDGET_MB='lots': expected a number"):
        cached("d", 4)


def test_stale_entries_go_first_and_a_source_edit_leaves_nothing_behind(tmp_path, monkeypatch, tiny_export):
    """One folder, one budget: after a source edit the entries stored under the old source hash are the first to
    go (before a more recently used current one), as are entries named by versions before the one cache."""
    import os
    import shutil

    import xdeploy.export.cache as cache
    import xdeploy.export.store as store

    monkeypatch.setenv("XDEPLOY_CACHE", str(tmp_path / "cache"))
    model = _first_model()
    src = tiny_export(model)
    root = tmp_path / "cache" / "exports"
    legacy = root / f"{model}-{'0' * 24}"  # the copy cache's old layout: can never be hit again
    shutil.copytree(src, legacy)

    def cached(name, seed):
        out = tmp_path / name
        return cache.cached_export(model, {"preset": "tiny", "seed": seed, "out": out, "force": True},
                                   lambda: Path(shutil.copytree(src, out)))

    cached("a", 1)
    [old] = set(root.iterdir()) - {legacy}
    monkeypatch.setattr(cache, "export_source_hash", lambda: "edited exporter")
    monkeypatch.setattr(store, "export_source_hash", lambda: "edited exporter")  # eviction's view too
    cached("a2", 1)  # the same export after the edit: a new entry beside the old one
    [new] = set(root.iterdir()) - {legacy, old}
    assert old.name.rsplit("_", 1)[0] != new.name.rsplit("_", 1)[0] and legacy.is_dir()  # a different source tag
    os.utime(new, (1, 1)), os.utime(old, (2, 2)), os.utime(legacy, (3, 3))  # the stale ones: most recently used
    monkeypatch.setenv("XDEPLOY_EXPORT_CACHE_BUDGET_MB", str(2.5 * cache._dir_bytes(src) / 2**20))  # room for two
    cached("b", 2)  # a second current entry: over budget, the stale ones go, the current ones stay
    assert not legacy.exists() and not old.exists() and new.is_dir() and len(list(root.iterdir())) == 2


def test_entries_in_use_are_never_evicted(tmp_path, monkeypatch, tiny_export):
    """cached_artifact hands out the entry itself, so it holds it in use for the rest of the process: eviction in
    this process or another passes it by (budget 0 here) and removes it once nothing uses it."""
    import shutil
    import subprocess
    import sys

    import xdeploy.export.cache as cache
    import xdeploy.export.store as store
    from xdeploy.export import onnx_export

    model = _first_model()
    src = tiny_export(model)
    monkeypatch.setattr(onnx_export, "export", lambda *a, out, **k: Path(shutil.copytree(src, out,
                                                                                      dirs_exist_ok=True)))
    monkeypatch.setenv("XDEPLOY_EXPORT_CACHE_BUDGET_MB", "0")
    root = tmp_path / "r"
    (root / "hf-checkpoint").mkdir(parents=True)  # not an entry: a study keeps its checkpoints beside them
    a = cached_artifact(model, preset="tiny", root=root)
    monkeypatch.setattr(cache, "export_source_hash", lambda: "edited exporter")
    monkeypatch.setattr(store, "export_source_hash", lambda: "edited exporter")  # eviction's view too
    b = cached_artifact(model, preset="tiny", root=root)
    assert a != b and a.is_dir() and b.is_dir() and cache.evict(root) == []  # stale, over budget, but in use
    os.close(cache._HELD.pop(a))  # this process is done with it
    code = (f"import sys; from pathlib import Path; from xdeploy.export.cache import _hold; "
            f"assert _hold(Path({str(a)!r})); print('held', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        assert cache.evict(root) == [] and a.is_dir()  # another process uses it
    finally:
        child.communicate("", timeout=60)
    assert cache.evict(root) == [a] and not a.exists() and b.is_dir() and (root / "hf-checkpoint").is_dir()
    assert not any(p.name.startswith(".") for p in root.iterdir())  # moved aside, then removed


def test_export_key_holds_every_input(tmp_path):
    """Each input that changes the artifact changes the key; what cannot be keyed bypasses the cache."""
    import shutil

    import numpy as np

    from xdeploy.export.cache import EXPORT_SOURCES, export_key, export_source_hash
    from xdeploy.export.precision import PrecisionOptions

    cal = tmp_path / "cal.txt"
    cal.write_text("one line\n")
    base = {"preset": "tiny", "precision": "int8", "opset": 23, "out": str(tmp_path / "x"), "measured": True,
            "precision_options": PrecisionOptions(int8_calibration_file=str(cal))}
    k = export_key("bert", base)
    assert k == export_key("bert", base | {"out": str(tmp_path / "y"), "force": True})  # where it goes: not keyed
    others = [export_key("gpt", base)] + [export_key("bert", base | change) for change in (
        {"preset": "small"}, {"precision": "fp16"}, {"opset": 18}, {"measured": False}, {"optimize": True},
        {"config_overrides": {"max_positions": 64}},
        {"precision_options": PrecisionOptions(int8_calibration_file=str(cal), int8_per_channel=False)})]
    cal.write_text("another line\n")  # the calibration file's bytes, not its name
    others.append(export_key("bert", base))
    assert None not in others and len({k, *others}) == len(others) + 1
    assert export_key("bert", base | {"precision_options": PrecisionOptions(amp_feeds={"x": np.zeros(1)})}) is None
    assert export_key("bert", base | {"tokenizer_graph": lambda d, n: (b"", {})}) is None  # an unknown builder
    with pytest.raises(XDeployError, match="calibration file"):
        export_key("bert", base | {"precision_options": PrecisionOptions(int8_calibration_file=str(tmp_path))})
    # the source: a copy of the package's export sources hashes the same until one file changes
    from xdeploy.export import cache

    root = Path(cache.__file__).resolve().parents[1]
    copy = tmp_path / "src"
    for rel in EXPORT_SOURCES:
        if (root / rel).is_dir():
            shutil.copytree(root / rel, copy / rel)
        else:
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(root / rel, copy / rel)
    assert export_source_hash(copy) == export_source_hash()
    f = copy / "export" / "onnx_export.py"
    f.write_text(f.read_text() + "\n# changed\n")
    edited = export_source_hash(copy)
    assert edited != export_source_hash()
    # retrained preset weights (models/weights/*.safetensors) with unchanged code are a different export too
    w = next((copy / "models").rglob("*.safetensors"))
    w.write_bytes(w.read_bytes() + b" ")
    assert export_source_hash(copy) != edited


def test_run_job_takes_its_fp32_export_from_the_cache_and_fresh_exports_again(tmp_path, monkeypatch):
    """`xdeploy run`'s fp32 export goes through the export cache: a second identical job copies the entry (the
    copy keeps the entry's file times), `fresh` exports again and refreshes it."""
    from xdeploy.pipeline import RunConfig, run_job

    monkeypatch.setenv("XDEPLOY_CACHE", str(tmp_path / "cache"))
    model = _first_model()
    base = dict(models=(model,), presets={"*": "tiny"}, smoke=True, precisions=("fp32",), runners=("ort",),
                threads=1, skip=("roofline", "bench", "decode", "scale"))

    def job(name, **kw):
        res = run_job(RunConfig(out=tmp_path / name, artifacts=tmp_path / f"art-{name}", **base, **kw))
        assert not res.errors, res.errors
        return next((tmp_path / f"art-{name}").glob("*-fp32"))

    def mtime(p):
        return (p / "manifest.json").stat().st_mtime_ns

    first = job("a")
    [entry] = (tmp_path / "cache" / "exports").iterdir()
    assert _files(entry) == _files(first)
    second = job("b")
    assert _files(second) == _files(first) and mtime(second) == mtime(entry)  # copied from the entry
    before = mtime(entry)
    third = job("c", fresh=True)
    assert mtime(third) != before and mtime(entry) == mtime(third)  # exported again, the entry refreshed from it
    load_artifact(third)


def test_a_trace_is_reused_by_every_precision_and_verified(tmp_path, monkeypatch):
    """The trace cache (export/cache.py cached_trace): an export traces each graph once; a later export of the same
    module, graph and opset at another precision (or a second fp32 export) reads the trace instead of running
    torch.onnx, and its graphs are the same as a fresh trace's; a damaged trace is traced again; another opset or
    other weights are other entries; trace_cache="off" neither reads nor writes, "refresh" traces again."""
    import onnx

    import xdeploy.export.onnx_export as ox

    monkeypatch.setenv("XDEPLOY_CACHE", str(tmp_path / "cache"))
    model = _first_model()
    traces = lambda: sorted((tmp_path / "cache" / "traces").glob("*-trace-*"))  # noqa: E731
    calls: list[str] = []
    real = ox.export_graph
    monkeypatch.setattr(ox, "export_graph", lambda m, g, s, o: calls.append(g.name) or real(m, g, s, o))
    first = ox.export(model, preset="tiny", out=tmp_path / "a")
    n = len(MODELS[model].spec(MODELS[model].presets["tiny"]).graphs)
    assert len(calls) == n and len(traces()) == n
    again = ox.export(model, preset="tiny", out=tmp_path / "b")
    ox.export(model, preset="tiny", out=tmp_path / "c", precision="int8-dynamic")
    assert len(calls) == n  # no trace: both read the cache
    fresh = ox.export(model, preset="tiny", out=tmp_path / "d", trace_cache="off")
    assert len(calls) == 2 * n and len(traces()) == n  # traced, nothing written
    for g in load_artifact(first).spec.graphs:
        protos = [onnx.load(p / f"{g.name}.onnx").SerializeToString() for p in (first, again, fresh)]
        assert protos[0] == protos[1] == protos[2]
    damaged = traces()[0] / "graph.onnx"
    whole = damaged.read_bytes()
    damaged.write_bytes(whole[:-16])  # its sha256 no longer matches
    ox.export(model, preset="tiny", out=tmp_path / "e")
    assert len(calls) == 2 * n + 1 and damaged.read_bytes() == whole  # traced again and stored whole
    ox.export(model, preset="tiny", out=tmp_path / "f", trace_cache="refresh")
    assert len(calls) == 3 * n + 1
    ox.export(model, preset="tiny", out=tmp_path / "g", opset=18)
    ox.export(model, preset="tiny", out=tmp_path / "h", seed=1)  # other weights
    assert len(calls) == 5 * n + 1 and len(traces()) == 3 * n
    with pytest.raises(XDeployError, match="expected one of: use, refresh, off"):
        ox.export(model, preset="tiny", out=tmp_path / "i", trace_cache="never")


def test_a_trace_stored_under_another_label_is_read_by_its_key(tmp_path, monkeypatch):
    """cached_trace: the key (fields, library versions, export source) decides, the label only names the entry: the
    same key asked under another label (a preset's weights exported from a checkpoint) reads the stored trace;
    another key is another entry."""
    from xdeploy.export.store import cached_trace, traces_root

    monkeypatch.setenv("XDEPLOY_CACHE", str(tmp_path / "cache"))
    calls: list[bytes] = []

    def run(data: bytes):
        return lambda: calls.append(data) or data

    fields = {"family": "gpt", "config": {"d_model": 64}, "graph": "model", "opset": 23, "weights": "ab" * 32}
    assert cached_trace("gpt-tiny-trace-model-o23", fields, run(b"traced")) == b"traced"
    assert cached_trace("gpt-checkpoint-trace-model-o23", fields, run(b"again")) == b"traced"
    assert calls == [b"traced"] and len(list(traces_root().iterdir())) == 1
    assert cached_trace("gpt-checkpoint-trace-model-o23", fields | {"weights": "cd" * 32}, run(b"other")) == b"other"
    assert calls == [b"traced", b"other"] and len(list(traces_root().iterdir())) == 2


def test_trace_key_of_trained_weights_is_the_same_from_a_preset_and_a_checkpoint():
    """A trained preset's config names its weights file (models/registry.py `build` loads it); the same module and
    weights imported from a checkpoint name none. The trace's key leaves that field out (the weights are keyed by
    their digest), and keeps every field that changes the graph."""
    import dataclasses

    from xdeploy.export.onnx_export import resolve_source, trace_fields

    src = resolve_source("gpt", preset="tiny")
    assert src.config.weights  # a trained preset: the field is set
    spec = src.family.spec(src.config)
    graph = spec.graph("model")
    ckpt = dataclasses.replace(src, config=dataclasses.replace(src.config, weights=None), preset=None)
    assert trace_fields(src, graph, 23, "w") == trace_fields(ckpt, graph, 23, "w")
    wider = dataclasses.replace(src, config=dataclasses.replace(src.config, max_positions=src.config.max_positions * 2))
    assert trace_fields(wider, graph, 23, "w") != trace_fields(src, graph, 23, "w")
    assert trace_fields(src, graph, 23, "w") != trace_fields(src, graph, 18, "w")
