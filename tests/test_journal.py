"""The run journal (core/journal.py): append-only, fsynced per line, readable after a crash at any byte."""

from __future__ import annotations

import json

import pytest

from xdeploy.core.errors import XDeployError
from xdeploy.core.journal import JournalWriter, identity_changes, is_journal, machine_identity, read_journal

FP = {"cpu_model": "Test CPU", "isa": ["avx2"], "logical_cpus": 2, "versions": {"torch": "2.13.0"},
      "threads": {"affinity_cpus": 2}, "env": {}}
PLAN = [("export", "m fp32"), ("parity", "m fp32"), ("bench", "m"), ("report", "out")]


def _header(**kw):
    return {"config": {"smoke": True}, "fingerprint": FP, "plan": PLAN, "command": "xdeploy run"} | kw


def _write(path):
    w = JournalWriter.create(path, **_header())
    w.begin("export", "m fp32")
    w.done("export", "m fp32", {"artifact": "abc"}, 1.0, 0)
    w.begin("parity", "m fp32")
    w.record({"kind": "test", "n": 1})  # a kind without an identity: every record kept
    w.record({"kind": "test", "n": 2})
    w.done("parity", "m fp32", {"k": 1}, 0.5, 2)
    w.begin("bench", "m")
    w.record({"kind": "test", "n": 3})
    w.close()
    return path


def test_killed_run_leaves_a_readable_journal_with_its_stop_point(tmp_path):
    st = read_journal(_write(tmp_path / "journal.jsonl"))
    assert not st.complete and st.stop_point() == ("bench", "m")
    assert [r["n"] for r in st.records()] == [1, 2, 3]  # the partial step's record is shown too
    assert st.finished("parity", "m fp32").key == {"k": 1} and st.finished("bench", "m") is None
    s = st.status()
    assert s["stopped_in"] == "bench: m" and s["step_index"] == 3 and s["steps"] == 4
    assert s["missing"] == ["bench: m", "report: out"]
    assert is_journal(tmp_path / "journal.jsonl") and not is_journal(tmp_path / "nope")


def test_torn_last_line_is_dropped_and_resume_appends_cleanly(tmp_path):
    path = _write(tmp_path / "journal.jsonl")
    with open(path, "ab") as f:
        f.write(b'{"event":"record","attempt":7,"record":{"kind":"lat')  # killed mid-write
    st = read_journal(path)
    assert st.torn and [r["n"] for r in st.records()] == [1, 2, 3]
    w, before = JournalWriter.resume(path, **_header())
    assert before.stop_point() == ("bench", "m")
    w.reused("parity", "m fp32", before.finished("parity", "m fp32").attempt, {"k": 1})
    w.begin("bench", "m")  # the interrupted step is measured again
    w.record({"kind": "test", "n": 4})
    w.done("bench", "m", {"k": 2}, 2.0, 1)
    w.end(3.0, "out")
    w.close()
    st = read_journal(path)
    assert not st.torn and st.complete and st.stop_point() is None and st.missing() == [("report", "out")]
    # the re-measured step replaces its interrupted attempt; the reused step keeps its records
    assert [r["n"] for r in st.records()] == [1, 2, 4]
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_damaged_journal_is_one_line_error(tmp_path):
    path = _write(tmp_path / "journal.jsonl")
    lines = path.read_text().splitlines(keepends=True)
    lines[2] = "{not json\n"
    path.write_text("".join(lines))
    with pytest.raises(XDeployError, match=r"journal.jsonl:3: not a JSON journal line"):
        read_journal(path)
    (tmp_path / "other.jsonl").write_text('{"kind": "latency"}\n')
    with pytest.raises(XDeployError, match="not an xdeploy journal"):
        read_journal(tmp_path / "other.jsonl")


def test_machine_changes_are_named():
    a = machine_identity(FP)
    b = machine_identity(FP | {"cpu_model": "Other CPU", "versions": {"torch": "2.14.0"}})
    assert identity_changes(a, b) == ["cpu_model: Test CPU -> Other CPU", "versions.torch: 2.13.0 -> 2.14.0"]
    assert identity_changes(a, machine_identity(FP | {"threads": {"affinity_cpus": 2, "torch_intra_op": 1}})) == []


def test_a_correction_replaces_the_record_it_corrects(tmp_path):
    """records.revise re-emits a record with the same identity (e.g. % of peak re-judged after the steps): the
    report of the journal shows the correction where the original was."""
    par = {"kind": "parity", "model": "m", "preset": "p", "graph": "model", "runner": "ort",
           "artifact_precision": "fp32", "output": "logits"}
    w = JournalWriter.create(tmp_path / "j.jsonl", **_header())
    w.begin("parity", "m fp32")
    w.record(par | {"output": "hidden", "n": 1})
    w.record(par | {"n": 2})
    w.done("parity", "m fp32", {}, 0.1, 2)
    w.record(par | {"n": 3})  # outside any step: the correction
    w.close()
    assert [r["n"] for r in read_journal(tmp_path / "j.jsonl").records()] == [1, 3]
