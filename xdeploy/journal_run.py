"""The main job's journal adapter (run policy beside xdeploy/pipeline.py): each step of the run is journaled as
it runs (core/journal.py), and with --resume a step the journal already finished with the same key
(configuration, artifact hashes, machine) is reused instead of measured again."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from xdeploy.core.errors import XDeployError

T = TypeVar("T")
Records = list[dict[str, Any]]


def config_json(cfg: Any) -> dict[str, Any]:
    """A run's settings (a dataclass) as given, as JSON for the journal's header: paths as text, tuples as lists;
    whether it resumes is not a setting of what it measures."""
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "resume"}
    return {k: str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v for k, v in d.items()}


class RunJournal:
    """`config`: the run's settings as given (the journal header); `settings`: those that shape a step's result
    (in every step key); `notes(text)`: the report's notes; `progress(step, advance)`: the progress bar."""

    def __init__(self, out: Path, *, resume: bool, config: Mapping[str, Any], settings: Mapping[str, Any],
                 command: str, steps: Sequence[tuple[str, str]], notes: Callable[[str], None],
                 progress: Callable[[str, int], None]) -> None:
        from xdeploy.core.fingerprint import fingerprint
        from xdeploy.core.journal import JOURNAL_NAME, JournalWriter, digest, machine_identity

        self.settings, self.notes, self.progress = dict(settings), notes, progress
        self.fp = fingerprint()
        self.machine = machine_identity(self.fp)
        self.machine_key = digest(self.machine)
        self.path = Path(out) / JOURNAL_NAME
        self.reused: list[str] = []
        self._seen: set[int] = set()  # ids of records already journaled (the records.py sink, when present)
        self._keep: list[dict[str, Any]] = []  # keeps those ids valid
        header = {"config": dict(config), "fingerprint": self.fp, "plan": list(steps), "command": command}
        self.prior = None
        Path(out).mkdir(parents=True, exist_ok=True)
        if resume and self.path.exists():
            self.writer, self.prior = JournalWriter.resume(self.path, **header)
        else:
            replaced = self._unfinished() if self.path.exists() else None
            self.writer = JournalWriter.create(self.path, **header)
            if resume:
                self.note(f"--resume: no journal in {out}; started a new run")
            if replaced:
                self.note(f"started over: the journal of an unfinished run ({replaced}) was replaced; "
                          "--resume would have continued it")

    def _unfinished(self) -> str | None:
        """Where the run journaled here stopped, if it did not finish (None: finished or unreadable)."""
        from xdeploy.core.journal import read_journal

        try:
            st = read_journal(self.path)
        except XDeployError:
            return None
        return None if st.complete else (st.status()["stopped_in"] or "stopped between steps")

    def step_key(self, phase: str, model: str | None = None, preset: str | None = None,
                 artifacts: Mapping[str, Path] | None = None) -> dict[str, Any]:
        """What a step's result depends on: the job settings that shape it, the artifacts' manifest hashes,
        the machine. Phases that do not use the run's artifacts (roofline, scale) have none."""
        from xdeploy.core.fsutil import sha256_file
        from xdeploy.core.journal import digest
        from xdeploy.export.artifact import MANIFEST

        conf = {"phase": phase, "model": model, "preset": preset if model else None} | self.settings
        arts = {p: sha256_file(Path(a) / MANIFEST) for p, a in (artifacts or {}).items()}
        return {"config": digest(conf), "artifacts": arts, "machine": self.machine_key}

    def note(self, text: str) -> None:
        self.notes(text)
        self.writer.note(text)

    def sink(self, rec: dict[str, Any]) -> None:
        """Journal one record the moment it is made (registered with core/records.py's sink where available)."""
        if id(rec) in self._seen:
            return
        self._seen.add(id(rec))
        self._keep.append(rec)
        self.writer.record(rec)

    def _why_again(self, prior: Any, key: dict[str, Any]) -> str:
        from xdeploy.core.journal import identity_changes

        why = []
        if prior.key.get("machine") != key["machine"]:
            old = self.prior.machine_at(prior.attempt) if self.prior else {}
            why.append("machine changed: " + ("; ".join(identity_changes(old, self.machine)[:4]) or "fingerprint"))
        changed = sorted(p for p in set(prior.key.get("artifacts", {})) | set(key["artifacts"])
                         if prior.key.get("artifacts", {}).get(p) != key["artifacts"].get(p))
        if changed:
            why.append(f"artifact changed: {', '.join(changed)}")
        if prior.key.get("config") != key["config"]:
            why.append("settings changed")
        return "; ".join(why) or "key changed"

    def _reuse(self, phase: str, what: str, prior: Any) -> None:
        self.writer.reused(phase, what, prior.attempt, prior.key)
        self.reused.append(f"{phase}: {what}")
        self.progress(f"{phase}: {what} (journal)", 1)

    def _journaled(self, phase: str, what: str, fn: Callable[[], T]) -> tuple[T, float]:
        """fn() between its begin and failed events; returns its result and the seconds it took."""
        t0 = time.perf_counter()
        self.writer.begin(phase, what)
        try:
            return fn(), time.perf_counter() - t0
        except XDeployError as e:
            self.writer.failed(phase, what, str(e))
            raise

    def unit(self, phase: str, what: str, key: dict[str, Any], fn: Callable[[], Records]) -> Records:
        """Run one step with its journal events, or reuse its records from the journal being resumed."""
        prior = self.prior.finished(phase, what) if self.prior else None
        if prior is not None and prior.key == key:
            self._reuse(phase, what, prior)
            # what failed in the reused attempt (e.g. a bench child that died) is named in this report too
            for e in [e for ev in prior.parts.values() if ev.get("status") == "failed"
                      for e in ev.get("errors") or ["?"]]:
                self.notes(f"{phase} {what}: failed: {e}")
            return list(prior.records)
        if prior is not None:
            self.note(f"{phase} {what}: re-measured ({self._why_again(prior, key)})")
        recs, seconds = self._journaled(phase, what, fn)
        for r in recs:  # records the sink has not seen (made outside core/records.py's constructor)
            self.sink(r)
        self.writer.done(phase, what, key, seconds, len(recs))
        return recs

    def export(self, what: str, out: Path, fn: Callable[[], Path]) -> Path:
        """Export one artifact, or reuse the one the journal recorded if it still verifies with the same hash."""
        from xdeploy.core.fsutil import sha256_file
        from xdeploy.export.artifact import MANIFEST, load_artifact

        prior = self.prior.finished("export", what) if self.prior else None
        if prior is not None and (out / MANIFEST).is_file():
            try:
                load_artifact(out)  # every file's sha256 against the manifest
                if sha256_file(out / MANIFEST) == prior.key.get("artifact"):
                    self._reuse("export", what, prior)
                    return out
            except XDeployError as e:
                self.note(f"export {what}: re-exported ({e})")
        path, seconds = self._journaled("export", what, fn)
        self.writer.done("export", what, {"artifact": sha256_file(Path(path) / MANIFEST)}, seconds, 0)
        return path

    def parts(self, phase: str, what: str, key: dict[str, Any]) -> JournalParts:
        """The units of a step now running (bench: its comparisons), with what the resumed journal has of them."""
        return JournalParts(self, phase, what, key, self.prior.steps.get((phase, what)) if self.prior else None)


class JournalParts:
    """The units of one step (bench: one interleaved comparison per batch/seq), each journaled as a "part" event
    when it ends. With --resume, a part the interrupted attempt finished under the same key (the step's key and
    the part's sizes) is taken from the journal: its records are journaled again in this attempt (so a second
    kill keeps them) and it is not measured again. A part with a failure is measured again."""

    def __init__(self, jr: RunJournal, phase: str, what: str, key: dict[str, Any], prior: Any) -> None:
        self.jr, self.phase, self.what, self.key, self.prior = jr, phase, what, key, prior

    def _part(self, sizes: Mapping[str, int]) -> tuple[str, dict[str, Any]]:
        return " ".join(f"{k} {v}" for k, v in sizes.items()), self.key | {"part": dict(sizes)}

    def measured(self, sizes: Mapping[str, int]) -> Records | None:
        name, key = self._part(sizes)
        recs = self.prior.part_records(name, key) if self.prior is not None else None
        if recs is None:
            return None
        for r in recs:
            self.jr.sink(r)
        self.jr.writer.part(self.phase, self.what, name, key, recs)
        self.jr.reused.append(f"{self.phase}: {self.what} {name}")
        self.jr.progress(f"{self.phase}: {self.what} {name} (journal)", 0)
        return recs

    def compared(self, sizes: Mapping[str, int], recs: Records, errors: list[str]) -> None:
        name, key = self._part(sizes)
        self.jr.writer.part(self.phase, self.what, name, key, recs, errors)
