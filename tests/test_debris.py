"""Temporaries of killed writers (core/fsutil.py): removed by the next write to the same target, only when their
owner is gone; a directory swap killed between its two renames is rolled back to the previous version."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from xdeploy.core.fsutil import atomic_dir, atomic_write_text, clean_debris


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_next_write_removes_dead_writers_temporaries_only(tmp_path):
    target = tmp_path / "art"
    dead = _dead_pid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / f".art.tmp-{dead}-abc").mkdir()
        (tmp_path / f".art.tmp-{dead}-abc" / "model.onnx").write_bytes(b"x" * 1000)
        (tmp_path / f".art.tmp-{sleeper.pid}-live").mkdir()  # a live writer's: must survive
        (tmp_path / f".art.tmp-{os.getpid()}-mine").mkdir()  # this process's own: must survive
        (tmp_path / f".other.tmp-{dead}-abc").mkdir()  # another target's: not this write's business
        # a pid reused by a process that started after the temporary was last touched cannot be its owner
        reused = tmp_path / f".art.tmp-{sleeper.pid}-old"
        reused.mkdir()
        os.utime(reused, (time.time() - 600, time.time() - 600))
        legacy_old, legacy_new = tmp_path / ".art.tmp-k3j_9x2a", tmp_path / ".art.tmp-q8w7e6r5"  # no pid (<= 0.1)
        legacy_old.mkdir()
        legacy_new.mkdir()
        os.utime(legacy_old, (time.time() - 7200, time.time() - 7200))
        with atomic_dir(target) as tmp:
            assert tmp.name.startswith(f".art.tmp-{os.getpid()}-")
            (tmp / "f").write_text("new")
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted(["art", f".art.tmp-{sleeper.pid}-live", f".art.tmp-{os.getpid()}-mine",
                               f".other.tmp-{dead}-abc", legacy_new.name])
    finally:
        sleeper.kill()
        sleeper.wait()


def test_file_writes_clean_their_own_debris(tmp_path):
    dead = _dead_pid()
    (tmp_path / f".r.json.tmp-{dead}-x1y2").write_text("half")
    atomic_write_text(tmp_path / "r.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_swap_killed_between_renames_is_rolled_back(tmp_path):
    target = tmp_path / "rep"
    old = tmp_path / f".rep.old-{_dead_pid()}"
    old.mkdir()
    (old / "results.json").write_text("previous")
    assert clean_debris(target) == [old]
    assert (target / "results.json").read_text() == "previous" and not old.exists()
    # with the target in place, a stale old copy is simply removed
    old.mkdir()
    clean_debris(target)
    assert not old.exists() and (target / "results.json").read_text() == "previous"


def test_sigkilled_writer_leaves_at_most_one_temporary(tmp_path):
    """Kill writers mid-write repeatedly: each next write starts by removing the previous victim's temporary."""
    target = tmp_path / "big"
    code = (f"from xdeploy.core.fsutil import atomic_dir\nimport time, pathlib\n"
            f"with atomic_dir({str(target)!r}, force=True) as t:\n"
            f"    (t / 'w').write_bytes(b'0' * 100000); print('writing', flush=True); time.sleep(60)\n")
    for _ in range(3):
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "writing"  # type: ignore[union-attr]
        child.kill()
        child.wait()
        temps = [p for p in tmp_path.iterdir() if p.name.startswith(".big.tmp-")]
        assert len(temps) == 1, temps
    with atomic_dir(target, force=True) as t:
        (t / "w").write_text("done")
    assert [p.name for p in tmp_path.iterdir()] == ["big"] and Path(target / "w").read_text() == "done"
