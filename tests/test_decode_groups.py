"""The decode phase of `xdeploy run` opens its generators in groups sized to the memory available (base presets
do not fit all at once: GPT-2 small's 14 generators reached 21.5 GB and were killed on a 24 GB machine). Every
group is timed together with the PyTorch baseline, so each speed-up still comes from paired rounds."""

from __future__ import annotations

from tests.families import first
from xdeploy.bench.memory import WEIGHT_COPIES
from xdeploy.memory_guard import RunMemoryGuard
from xdeploy.pipeline import RunConfig, run_job


def test_decode_in_memory_sized_groups_keeps_every_record_paired(tmp_path, tiny_export):
    model = first(generates=True)
    base = dict(artifacts=tmp_path / "art", models=(model,), smoke=True, precisions=("fp32",),
                runners=("ort",), threads=1)
    # size the limit from the guard's own decode estimate: the baseline and one
    # runner fit, a second runner does not, so every generator gets its own group
    cfg0 = RunConfig(out=tmp_path / "x", **base)
    fp32 = tiny_export(model, preset=cfg0.preset(model))  # the session's shared export (read only here)
    guard = RunMemoryGuard(cfg0.memory_limit, lambda *_: None)
    limit = guard.decode_estimate(fp32, 8, 16).total + 0.5 * WEIGHT_COPIES * guard._weights(fp32)
    assert RunMemoryGuard(limit, lambda *_: None).decode_group(fp32, 8, 16) == 1

    res = run_job(RunConfig(out=tmp_path / "out", skip=("roofline", "bench", "scale"), memory_limit=limit, **base))
    decode = [r for r in res.records if r["kind"] == "decode"]
    keys = [(r["runner"], r["artifact_precision"], r["mode"]) for r in decode]
    assert keys[0][0] == "torch" and len(keys) == 3 and len(set(keys)) == 3  # torch, ort, ort no-cache
    for r in decode:
        st = r["stability"]
        assert st["baseline"] == "torch fp32" and st["rounds"] >= 3
        assert r["tokens_per_s"] > 0 and r["agreement"] == 1.0  # fp32 decodes the reference's tokens
        if r["runner"] != "torch":
            assert st["speedup"]["low"] <= st["speedup"]["median"] <= st["speedup"]["high"]
    assert {r["stability"]["group"] for r in decode if r["runner"] != "torch"} == {1, 2}  # one group each
    assert not res.errors  # grouping is not a failure
    # the console summary's decode table lists every route that keeps a cache, the engine's too (it listed only
    # the loop's "cache" mode, so ov's paged rows and ort's own cache were left out), and not the recompute row
    import io

    from rich.console import Console

    from xdeploy.commands.run import _print_summary

    buf = io.StringIO()
    _print_summary(Console(file=buf, width=300), res)
    table = buf.getvalue().split("decoding with the KV cache")[1].split("parity:")[0]
    cached = next(r["mode"] for r in decode if r["runner"] == "ort" and r["mode"] != "recompute")
    assert cached in table and "recompute" not in table
