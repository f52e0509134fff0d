"""A long run loses nothing (#21): `xdeploy run` killed with SIGKILL at seeded points leaves a journal that renders
as an INCOMPLETE report naming where it stopped, and `--resume` completes it with the records an uninterrupted run
has; the memory guard skips a configuration that would not fit and the job still exits 0."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil
import pytest

from xdeploy.bench.memory import skip_note
from xdeploy.cli import main
from xdeploy.core.journal import read_journal
from xdeploy.reports.compare import identity
from xdeploy.reports.render import load_results

# the smallest run that has every kind of step: export, parity, bench (isolated children), report
ARGS = ["--smoke", "--models", "vit", "--runners", "ort", "--precision", "fp32", "--skip", "roofline,scale,decode"]


def _ids(records):
    return sorted(json.dumps(identity(r)) for r in records)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_export):
    """One uninterrupted run under a memory limit that only its biggest configuration exceeds: the reference
    records for the resume tests, and the memory guard's test case (one run serves both: runs cost seconds)."""
    from xdeploy.memory_guard import RunMemoryGuard
    from xdeploy.pipeline import PARITY_SHAPES_SMOKE, RunConfig

    d = tmp_path_factory.mktemp("base")
    fp32 = tiny_export("vit")  # the model the run exports: for the estimates
    g = RunMemoryGuard(RunConfig(smoke=True).memory_limit, lambda *_: None)
    (pb, ps), = PARITY_SHAPES_SMOKE
    est = {"bench batch 1": g.estimate(fp32, {"batch": 1}).total,  # the smoke bench: batch 1 and 4
           "bench batch 4": g.estimate(fp32, {"batch": 4}).total,
           "parity": g.parity_estimate(fp32, pb, ps)[0].total}  # parity holds a reference model too
    (big, need), (_, second) = sorted(est.items(), key=lambda kv: -kv[1])[:2]
    limit = int((need + second) / 2)  # only the biggest configuration does not fit
    LIMIT[:] = ["--memory-limit", str(limit)]
    assert main(["run", *ARGS, *LIMIT, "--out", str(d / "out"), "--artifacts", str(d / "art")]) == 0
    return {"records": load_results(d / "out")["records"], "dir": d, "big": big, "need": need, "limit": limit}


LIMIT: list[str] = []  # the memory limit of the reference run, used by every run compared with it


def _work_lines(journal: Path) -> int:
    """Lines that mark work in progress: a step begun or a record made (not the bookkeeping of a resume)."""
    if not journal.exists():
        return 0
    return sum(b'"event":"begin"' in x or b'"event":"record"' in x for x in journal.read_bytes().splitlines())


def _run_until(out: Path, art: Path, new_lines: int, count: Callable[[Path], int] = _work_lines,
               limit: Sequence[str] | None = None) -> int:
    """Start `xdeploy run --resume` in a child; SIGKILL it once `count(journal)` has grown by `new_lines` (by
    default: lines of work). Returns the child's exit code (-9 when killed, 0 when it finished first)."""
    journal = out / "journal.jsonl"
    before = count(journal)
    child = subprocess.Popen([sys.executable, "-m", "xdeploy.cli", "run", *ARGS, *(LIMIT if limit is None else limit),
                              "--out", str(out), "--artifacts", str(art), "--resume"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while child.poll() is None and time.monotonic() < deadline:
            if count(journal) - before >= new_lines:
                os.kill(child.pid, signal.SIGKILL)
                break
            time.sleep(0.01)
    finally:
        if child.poll() is None and time.monotonic() >= deadline:
            child.kill()
    return child.wait()


def test_sigkill_at_seeded_points_then_resume_gives_the_uninterrupted_records(tmp_path, uninterrupted):
    out, art = tmp_path / "out", tmp_path / "art"
    rng = random.Random(21)
    # kill points: the k-th step begun or record made by each attempt (an uninterrupted run makes 8: begin
    # export, begin parity, 1 parity record, begin bench, 4 latency records); each resumed attempt starts after
    # the steps finished before it, so three kills land in different steps
    points = [rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 3)]
    stops = []
    for k in points:
        rc = _run_until(out, art, k)
        if rc == 0:
            break  # it finished before the kill point: nothing left to interrupt
        assert rc == -signal.SIGKILL
        st = read_journal(out / "journal.jsonl")  # parses, whatever byte the kill hit
        assert not st.complete and st.missing()
        stop = st.stop_point()
        stops.append(stop)
        # the first time in place (the run's own directory: its unfinished journal is the input and is kept for
        # --resume), later into a directory of their own
        rendered = out if len(stops) == 1 else tmp_path / f"partial{len(stops)}"
        src = out if len(stops) == 1 else out / "journal.jsonl"
        assert main(["report", "render", str(src), "--out", str(rendered)]) == 0
        assert (out / "journal.jsonl").read_bytes().startswith(b'{"schema": "xdeploy-journal"')
        md = (rendered / "summary.md").read_text()
        assert "**INCOMPLETE**" in md and "--resume" in md
        assert (f"stopped in **{stop[0]}: {stop[1]}**" if stop else "stopped between steps") in md
        for p, w in st.missing():
            assert f"{p}: {w}" in md
        # everything measured so far is in the partial report
        assert _ids(load_results(rendered)["records"]) == _ids(st.records())
    assert stops, "no kill point was reached"
    print("stopped in:", stops)
    assert _run_until(out, art, 10**9) == 0  # resume to the end
    st = read_journal(out / "journal.jsonl")
    assert st.complete and not st.torn and st.missing() == [("report", str(out))]
    final = load_results(out)
    assert _ids(final["records"]) == _ids(uninterrupted["records"])  # same set, no duplicates from the killed attempts
    assert final["meta"]["reused_steps"]  # finished steps were not measured again
    assert "export: vit tiny fp32" in final["meta"]["reused_steps"]  # the verified artifact was reused
    assert not [p for p in art.iterdir() if p.name.startswith(".")]  # no temporaries left by the kills


def test_resume_on_another_machine_remeasures_and_says_why(tmp_path, uninterrupted):
    base = uninterrupted["dir"]
    out, art = tmp_path / "out", tmp_path / "art"
    shutil.copytree(base / "out", out)
    shutil.copytree(base / "art", art)
    # the journal as another machine would have written it: a different CPU in its header and step keys
    lines = [json.loads(x) for x in (out / "journal.jsonl").read_text().splitlines()]
    for ev in lines:
        if ev["event"] in ("start", "resume"):
            ev["machine"]["cpu_model"] = "Other CPU 9000"
        if isinstance(ev.get("key"), dict) and "machine" in ev["key"]:
            ev["key"]["machine"] = "0000000000000000"
    (out / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert main(["run", *ARGS, *LIMIT, "--out", str(out), "--artifacts", str(art), "--resume", "--json",
                 str(tmp_path / "r.json")]) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["reused_steps"] == ["export: vit tiny fp32"]  # the artifact still verifies; measurements do not stand
    md = (out / "summary.md").read_text()
    assert "bench vit tiny: re-measured (machine changed: cpu_model: Other CPU 9000 -> " in md
    assert _ids(load_results(out)["records"]) == _ids(uninterrupted["records"])


def test_memory_guard_skips_what_does_not_fit_and_the_job_goes_on(uninterrupted):
    """The reference run (exit 0 asserted by the fixture) under a limit only its biggest configuration exceeds."""
    u = uninterrupted
    out = u["dir"] / "out"
    res = load_results(out)
    lat = sorted((r["runner"], r["batch"]) for r in res["records"] if r["kind"] == "latency")
    par = [r["passed"] for r in res["records"] if r["kind"] == "parity"]
    note = skip_note(u["need"], u["limit"])  # "skipped: needs ≈X MiB, Y MiB available"
    assert note.startswith("skipped: needs ≈") and note.endswith(" available")
    md = (out / "summary.md").read_text()
    skips = [(e["what"], e["note"]) for e in read_journal(out).events if e["event"] == "skip"]
    if u["big"] == "parity":  # the only parity shape: the step is skipped, everything else measured
        assert par == [] and lat == [("ort", 1), ("ort", 4), ("torch", 1), ("torch", 4)]
        assert skips == [("vit tiny fp32 shape 2x-", note),
                         ("vit tiny fp32", "every parity shape skipped by the memory guard")]
        assert f"parity vit tiny fp32 shape 2x-: {note}" in md
    else:  # bench at batch 4 skipped, everything else measured
        assert par == [True] and lat == [("ort", 1), ("torch", 1)]
        assert skips == [("vit tiny batch 4 seq 32", note)]
        assert f"bench vit tiny batch 4 seq 32: {note}" in md
    assert read_journal(out).missing() == [("report", str(out))]  # a skipped step is accounted for


def test_a_failed_export_is_journaled_as_failed(tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    out = tmp_path / "out"
    assert main(["run", *ARGS, "--out", str(out), "--artifacts", str(tmp_path / "file" / "art")]) == 2
    assert "file" in capsys.readouterr().err
    st = read_journal(out)
    assert st.steps[("export", "vit tiny fp32")].status == "failed" and st.stop_point() is None


def _kill_first_bench_child(stop: threading.Event, killed: list[int]) -> None:
    """SIGKILL the first isolated benchmark child (`python -m xdeploy.bench.memory`) of this process, as the
    kernel's OOM killer would: the child really dies, nothing in the code under test is replaced."""
    me = psutil.Process()
    while not stop.is_set() and not killed:
        for c in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "xdeploy.bench.memory" in c.cmdline():
                    c.send_signal(signal.SIGKILL)
                    killed.append(c.pid)
                    break
        time.sleep(0.005)


def test_a_bench_child_that_dies_is_recorded_as_failed_and_the_job_goes_on(tmp_path):
    out = tmp_path / "out"
    stop, killed = threading.Event(), []
    watcher = threading.Thread(target=_kill_first_bench_child, args=(stop, killed), daemon=True)
    watcher.start()
    try:
        rc = main(["run", *ARGS, "--out", str(out), "--artifacts", str(tmp_path / "art")])
    finally:
        stop.set()
        watcher.join()
    assert killed, "no benchmark child was seen"
    assert rc == 0
    # the first child is the batch-1 comparison (every runner timed interleaved): it is failed, batch 4 measured
    res = load_results(out)
    lat = sorted((r["runner"], r["batch"]) for r in res["records"] if r["kind"] == "latency")
    assert lat == [("ort", 4), ("torch", 4)]
    assert [r["passed"] for r in res["records"] if r["kind"] == "parity"] == [True]
    st = read_journal(out)
    parts = [(e["part"], e["status"], e["errors"]) for e in st.events if e["event"] == "part"]
    assert [p[:2] for p in parts] == [("batch 1", "failed"), ("batch 4", "done")]
    assert "isolated benchmark process died (exit code -9" in parts[0][2][0]
    assert st.steps[("bench", "vit tiny")].status == "done" and st.complete
    md = (out / "summary.md").read_text()
    failed = md.split("## Skipped or failed", 1)[1].split("\n## ", 1)[0]
    assert "bench vit tiny: failed: comparison at {'batch': 1}: isolated benchmark process died (exit code -9" in failed
    # the journal alone says so too (report render of the journal)
    assert any(n.startswith("bench vit tiny batch 1: failed: comparison at") for n in st.notes)
    # --resume reuses the finished bench step whole and its report still names the failure
    assert main(["run", *ARGS, "--out", str(out), "--artifacts", str(tmp_path / "art"), "--resume"]) == 0
    assert "bench: vit tiny" in load_results(out)["meta"]["reused_steps"]
    assert "bench vit tiny: failed: comparison at {'batch': 1}: isolated benchmark process died (exit code -9" in \
        (out / "summary.md").read_text().split("## Skipped or failed", 1)[1].split("\n## ", 1)[0]


def _done_parts(journal: Path) -> int:
    if not journal.exists():
        return 0
    return sum(b'"event":"part"' in x and b'"status":"done"' in x for x in journal.read_bytes().splitlines())


def _run_until_parts(out: Path, art: Path, new_parts: int) -> int:
    """`xdeploy run --resume` (no memory limit) in a child, SIGKILLed once its journal has `new_parts` more
    finished bench parts."""
    return _run_until(out, art, new_parts, count=_done_parts, limit=())


def test_resume_inside_bench_reuses_the_comparisons_already_journaled(tmp_path):
    """Killed inside the bench step after its batch-1 comparison: --resume takes that comparison's records from
    the journal (the very records, not a new measurement) and measures only batch 4; a second kill right after
    the reuse loses nothing either."""
    out, art = tmp_path / "out", tmp_path / "art"
    assert _run_until_parts(out, art, 1) == -signal.SIGKILL  # killed inside bench, after the batch-1 comparison
    st = read_journal(out)
    bench = st.steps[("bench", "vit tiny")]
    assert bench.status == "running" and list(bench.parts) == ["batch 1"]
    first = {json.dumps(identity(r)): r for r in bench.records}
    assert sorted((r["runner"], r["batch"]) for r in first.values()) == [("ort", 1), ("torch", 1)]
    # a second attempt, killed as soon as it has journaled the reused comparison (before batch 4 is measured)
    assert _run_until_parts(out, art, 1) == -signal.SIGKILL
    bench2 = read_journal(out).steps[("bench", "vit tiny")]
    assert bench2.attempt != bench.attempt and list(bench2.parts) == ["batch 1"]
    assert {json.dumps(identity(r)): r for r in bench2.records} == first
    assert _run_until_parts(out, art, 10**9) == 0  # resume to the end
    final = load_results(out)
    lat = [r for r in final["records"] if r["kind"] == "latency"]
    assert sorted((r["runner"], r["batch"]) for r in lat) == [("ort", 1), ("ort", 4), ("torch", 1), ("torch", 4)]
    assert [r["passed"] for r in final["records"] if r["kind"] == "parity"] == [True]
    assert len(_ids(final["records"])) == len(set(_ids(final["records"])))  # nothing twice
    for r in lat:  # batch 1: the records the first attempt measured, value for value (timestamps included)
        if r["batch"] == 1:
            assert r == first[json.dumps(identity(r))]
    assert "bench: vit tiny batch 1" in final["meta"]["reused_steps"]
    assert "bench: vit tiny batch 4" not in final["meta"]["reused_steps"]
    st = read_journal(out)
    assert st.complete and st.steps[("bench", "vit tiny")].status == "done"
