"""Golden probes: every artifact carries tiny inputs and the PyTorch fp32 outputs for them (export/probes.py) and
checks itself where it runs (deploy/probes.py): `xdeploy verify` (exit 0 / 1 / 2, no torch), the Embedder and the
Generator refuse a corrupted artifact with one line unless told not to verify, a pass is remembered per machine
class and runner, the probe file is untrusted input (never unpickled), and `convert` carries the probes over."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from planted import corrupt_artifact, refresh_manifest, strip_probes

from xdeploy.cli import main
from xdeploy.core.errors import XDeployError
from xdeploy.core.fingerprint import bf16_native, fingerprint, machine_class
from xdeploy.deploy import probes
from xdeploy.deploy.embedder import Embedder
from xdeploy.deploy.generate import GenerationConfig, Generator
from xdeploy.deploy.registry import open_runner
from xdeploy.export import probes as export_probes
from xdeploy.export.artifact import load_artifact
from xdeploy.export.convert import convert_artifact
from xdeploy.models.spec import make_feeds

MACHINE = machine_class(fingerprint())


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Each test remembers its passes in its own cache ($XDEPLOY_CACHE/probes.json), not the user's."""
    monkeypatch.setenv("XDEPLOY_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def bert(tiny_export):
    return tiny_export("bert")


@pytest.fixture(scope="module")
def gpt(tiny_export):
    return tiny_export("gpt")


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------------------------------ writing ----

def test_export_writes_probes_whose_references_are_the_torch_runners(bert):
    art = load_artifact(bert)
    sec = art.manifest["probes"]
    assert sec["file"] == "probes/probes.npz" and sec["graphs"] == ["model"]
    assert [(c["graph"], c["name"]) for c in sec["cases"]] == [("model", "1x16"), ("model", "2x11")]
    assert sec["cases"][1]["inputs"]["input_ids"] == {"dtype": "int64", "shape": [2, 11]}
    loaded = probes.load_probes(art)
    assert loaded is not None and len(loaded) == 2
    mask = loaded[1].case.feeds["attention_mask"]
    assert mask[0].all() and not mask[1].all()  # batch 2 pads its last row
    # the stored references are exactly what the torch runner (parity's reference) gives on the stored inputs
    with open_runner("torch", art) as t:
        for p in loaded:
            got = t.infer(p.case.feeds)
            assert set(got) == set(p.reference)
            for k in got:
                np.testing.assert_array_equal(got[k], p.reference[k])
    # the C++ runtime's raw copy of graph "model": little-endian, the manifest's shape
    raw = sec["cases"][0]["raw"]
    ids = np.fromfile(bert / raw["input_ids"], "<i8").reshape(1, 16)
    np.testing.assert_array_equal(ids, loaded[0].case.feeds["input_ids"])
    hidden = np.fromfile(bert / raw["last_hidden_state"], "<f4").reshape(1, 16, 64)
    np.testing.assert_array_equal(hidden, loaded[0].reference["last_hidden_state"])


def test_generating_models_probe_every_graph_within_the_axis_bounds(gpt):
    art = load_artifact(gpt)
    loaded = probes.load_probes(art)
    assert [(p.case.graph, p.case.name) for p in loaded] == [("model", "1x16"), ("model", "2x11"),
                                                             ("decode", "1x16x16"), ("decode", "2x11x11")]
    for p in loaded:
        for t in art.graph(p.case.graph).inputs:
            for d, n in zip(t.dims, p.case.feeds[t.name].shape):
                assert n == d if isinstance(d, int) else art.spec.axes[d].min <= n <= art.spec.axes[d].max


def test_convert_carries_the_probes_over_unchanged(bert, tmp_path):
    src = load_artifact(bert)
    out = load_artifact(convert_artifact(bert, tmp_path / "bert-fp16", "fp16"))
    assert out.manifest["probes"] == src.manifest["probes"]
    probe_files = [f for f in src.manifest["files"] if f.startswith("probes/")]
    assert probe_files and all(out.manifest["files"][f] == src.manifest["files"][f] for f in probe_files)
    rep = probes.verify_artifact(out, "ort")
    assert rep.passed and rep.precision == "fp16"  # the fp32 references, judged at fp16 tolerance


# ------------------------------------------------------------------------------------------ verify ----

def test_verify_passes_on_ort_and_ov_without_importing_torch(bert, tmp_path):
    """`xdeploy verify` in a fresh interpreter: exit 0 on both runtimes, and torch never imported; nor by
    `xdeploy convert` to fp16 (its search lists the runners, the torch runner among them, without opening it)."""
    code = ("import sys; from xdeploy.cli import main\n"
            f"rcs = [main(['verify', {str(bert)!r}, '--runner', r, '--json', {str(tmp_path)!r} + f'/{{r}}.json'])"
            " for r in ('ort', 'ov')]\n"
            f"rcs.append(main(['convert', {str(bert)!r}, '--precision', 'fp16', '--out', "
            f"{str(tmp_path / 'fp16')!r}]))\n"
            "print('RCS', rcs, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "XDEPLOY_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    assert "RCS [0, 0, 0] False" in r.stdout, r.stdout + r.stderr
    assert load_artifact(tmp_path / "fp16").precision == "fp16"
    assert r.stdout.count("2 golden probe case(s), 2 output(s) pass") == 2
    assert MACHINE in r.stdout
    rec = json.loads((tmp_path / "ov.json").read_text())
    assert rec["passed"] and rec["runner"] == "ov" and len(rec["checks"]) == 4 and rec["machine"] == MACHINE


def test_ov_bf16_is_judged_at_the_precision_it_really_computes(bert):
    """On a CPU without bf16 OpenVINO computes f32 under a bf16 hint: the probes' tolerance follows what the
    runner reports, not the hint."""
    rep = probes.verify_artifact(load_artifact(bert), "ov:bf16")
    assert rep.passed
    assert rep.precision == ("bf16" if bf16_native(fingerprint()) else "fp32")


def test_corrupted_artifact_fails_verify_with_one_line_per_failing_output(bert, tmp_path, capsys):
    bad = corrupt_artifact(bert, tmp_path / "bad")
    for runner in ("ort", "ov"):
        rc, out, err = _cli(capsys, "verify", str(bad), "--runner", runner, "--json", str(tmp_path / "v.json"))
        assert rc == 1, err
        lines = out.splitlines()
        assert len(lines) == 2, out  # last_hidden_state and pooler_output, one line each
        for line, output in zip(lines, ("last_hidden_state", "pooler_output")):
            assert f"graph 'model' output '{output}': cosine " in line and MACHINE in line and f"on {runner} " in line
            assert float(re.search(r"cosine (\S+)", line).group(1)) < 0.99999
        assert not json.loads((tmp_path / "v.json").read_text())["passed"]
    assert not (Path(tmp_path / "cache" / "probes.json")).exists()  # a failure is never remembered


def test_verify_checks_several_artifacts_in_turn(bert, tmp_path, capsys):
    """`xdeploy verify A B C`: one line (or its failure lines) per artifact in the order given, exit 1 when any fails,
    and --json {"passed", "artifacts": [one object each]}; a missing one among them is an input error (exit 2)
    before anything is checked."""
    bad = corrupt_artifact(bert, tmp_path / "bad")
    rc, out, err = _cli(capsys, "verify", str(bert), str(bad), str(bert), "--json", str(tmp_path / "v.json"))
    assert rc == 1, err
    lines = out.splitlines()
    assert len(lines) == 4, out  # the good artifact's line, the bad one's two failing outputs, the good one's again
    assert lines[0].startswith(f"{bert}: ") and "pass on ort" in lines[0] and lines[3] == lines[0]
    assert all(x.startswith(f"{bad}: FAIL graph 'model' output ") for x in lines[1:3])
    rec = json.loads((tmp_path / "v.json").read_text())
    assert rec["passed"] is False and [a["passed"] for a in rec["artifacts"]] == [True, False, True]
    assert [a["artifact"] for a in rec["artifacts"]] == [str(bert), str(bad), str(bert)]
    rc, out, err = _cli(capsys, "verify", str(bert), str(tmp_path / "missing"))
    assert rc == 2 and out == "" and "does not exist" in err and len(err.splitlines()) == 1


def test_verify_usage_errors_exit_2(bert, tmp_path, capsys):
    old = strip_probes(bert, tmp_path / "old")
    rc, out, err = _cli(capsys, "verify", str(old))
    assert rc == 2 and "has no golden probes" in err and "re-export it" in err and len(err.splitlines()) == 1
    rc, _, err = _cli(capsys, "verify", str(bert), "--runner", "ov:fp16")
    assert rc == 2 and "no variant 'fp16'" in err
    rc, _, err = _cli(capsys, "verify", str(tmp_path / "missing"))
    assert rc == 2 and "does not exist" in err and "Traceback" not in err


def test_a_pickled_probe_array_is_refused_in_one_line(bert, tmp_path, capsys):
    """Artifact files are untrusted: an object array (a pickle inside the .npz) is never loaded."""
    art = tmp_path / "pickled"
    shutil.copytree(bert, art)
    with np.load(art / "probes" / "probes.npz", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["0/in/input_ids"] = np.array([[{"payload": 1}] * 16], dtype=object)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    (art / "probes" / "probes.npz").write_bytes(buf.getvalue())
    refresh_manifest(art)
    rc, out, err = _cli(capsys, "verify", str(art))
    assert rc == 2, out + err
    assert "'0/in/input_ids' is not a plain numeric array" in err and "never unpickled" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    with pytest.raises(XDeployError, match="never unpickled"):
        Embedder(art)
    # a member larger than its declared array is refused before it is read
    arrays["0/in/input_ids"] = np.zeros((1, 4096), np.int64)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    (art / "probes" / "probes.npz").write_bytes(buf.getvalue())
    refresh_manifest(art)
    with pytest.raises(XDeployError, match="larger than its declared int64"):
        probes.load_probes(load_artifact(art))
    # not an .npz at all
    (art / "probes" / "probes.npz").write_bytes(b"\x80\x04K\x01.")
    refresh_manifest(art)
    with pytest.raises(XDeployError, match="cannot read the golden probes"):
        probes.load_probes(load_artifact(art))
    assert zipfile.is_zipfile(bert / "probes" / "probes.npz")  # the shared artifact is untouched


# ------------------------------------------------------------------------------------------ runtimes ----

def test_embedder_refuses_a_corrupted_artifact_unless_told_not_to_verify(bert, tmp_path, capsys):
    bad = corrupt_artifact(bert, tmp_path / "bad")
    with pytest.raises(probes.ProbeFailure) as e:
        Embedder(bad)
    msg = str(e.value)
    assert "\n" not in msg and e.value.exit_code == 1
    assert "graph 'model' output 'last_hidden_state': cosine " in msg and MACHINE in msg and "verify=False" in msg
    capsys.readouterr()
    with Embedder(bad, verify=False) as emb:  # the opt-out runs it, and says so
        assert emb.probes is None
        vecs = emb.embed_ids([[1, 5, 7, 2]])
    assert vecs.shape == (1, 64)
    err = capsys.readouterr().err
    assert "golden probes not checked on ort (verify=False / --no-verify)" in err and len(err.splitlines()) == 1
    # the CLI: exit 1 with the one line before any input is read; --no-verify proceeds (this preset then stops at
    # its missing tokenizer, exit 2, having said that the probes were skipped)
    rc, _, err = _cli(capsys, "embed", str(bad), "--input", str(tmp_path / "never-read.txt"))
    assert rc == 1 and "fails its golden probes here" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "in.txt").write_text("a sentence\n")
    rc, _, err = _cli(capsys, "embed", str(bad), "--input", str(tmp_path / "in.txt"), "--no-verify")
    assert rc == 2 and "has no tokenizer" in err


def test_generator_refuses_a_corrupted_artifact_unless_told_not_to_verify(gpt, tmp_path, capsys):
    bad = corrupt_artifact(gpt, tmp_path / "bad", "decode")  # gpt generates with its decode graph alone
    for runner in ("ort", "ov"):
        with pytest.raises(probes.ProbeFailure, match=r"graph 'decode' output '(logits|new_kv)': cosine ") as e:
            Generator(bad, runner)
        assert "\n" not in str(e.value) and MACHINE in str(e.value) and f" on {runner} " in str(e.value)
    rc, _, err = _cli(capsys, "generate", str(bad), "--prompt-ids", "3,4,5", "--new-tokens", "2")
    assert rc == 1 and "fails its golden probes here" in err and len(err.strip().splitlines()) == 1
    rc, out, err = _cli(capsys, "generate", str(bad), "--prompt-ids", "3,4,5", "--new-tokens", "2", "--no-verify")
    assert rc == 0 and "2 new tokens" in out and "golden probes not checked on ort" in err
    with Generator(bad, verify=False) as g:  # (the warning is said once per process: above)
        out = g.generate([[3, 4, 5]], GenerationConfig(max_new_tokens=3, eos_token_id=-1))
    assert len(out.tokens[0]) == 3 and g.probes is None


def test_artifacts_without_probes_run_with_a_one_line_notice(bert, tmp_path, capsys):
    old = strip_probes(bert, tmp_path / "old")
    with Embedder(old) as emb:
        assert emb.probes is None
        emb.embed_ids([[1, 2, 3]])
    err = capsys.readouterr().err
    assert "has no golden probes" in err and "re-export it" in err and len(err.splitlines()) == 1


def test_a_pass_is_remembered_so_the_second_open_runs_nothing(bert, gpt, private_cache, capsys):
    runs = probes.probe_runs()
    with Embedder(bert) as emb:
        assert emb.probes is not None and emb.probes.passed and not emb.probes.cached
        assert emb.probes.covered == ("model/last_hidden_state",)  # the Embedder's runner serves only that
    assert probes.probe_runs() == runs + 2  # both cases ran once
    with Embedder(bert) as emb:
        assert emb.probes.cached and emb.probes.checks == ()
    assert probes.probe_runs() == runs + 2  # nothing ran the second time
    entries = json.loads((private_cache / "probes.json").read_text())["entries"]
    (entry,) = entries.values()
    assert entry["machine"] == MACHINE and entry["runner"] == "ort" and entry["covered"] == ["model/last_hidden_state"]
    assert entry["artifact"] == str(Path(bert).resolve())
    # another runner is another entry; `xdeploy verify` always runs, and its pass serves the runtimes' next open
    assert _cli(capsys, "verify", str(gpt), "--runner", "ov")[0] == 0
    runs = probes.probe_runs()
    with Generator(gpt, "ov") as g:
        assert g.probes.cached
    assert probes.probe_runs() == runs
    assert len(json.loads((private_cache / "probes.json").read_text())["entries"]) == 2


def test_a_changed_artifact_is_not_covered_by_its_earlier_pass(bert, tmp_path):
    """The remembered pass is keyed by the artifact's content (its manifest's sha256s), not its path."""
    art = tmp_path / "art"
    shutil.copytree(bert, art)
    with Embedder(art) as emb:
        assert not emb.probes.cached
    shutil.rmtree(art)
    corrupt_artifact(bert, art)
    with pytest.raises(probes.ProbeFailure):
        Embedder(art)


def test_probe_feeds_are_valid_runner_inputs(bert):
    """The probe inputs are make_feeds' at the probe shapes (models/spec.py shape_cases): the same kinds of
    inputs every other check uses."""
    art = load_artifact(bert)
    p = probes.load_probes(art)[0]
    want = make_feeds(art.graph(), {"batch": 1, "seq": 16}, seed=export_probes.SEED)
    for k, v in want.items():
        np.testing.assert_array_equal(p.case.feeds[k], v)
