"""The run journal: every record appended the moment it exists, so a killed run loses nothing it measured.

`xdeploy run` keeps `<out>/journal.jsonl`, one JSON object per line, appended with one write() and fsynced per
line (a crash can tear only the last line; the reader drops a torn tail and says so):

    {"schema": "xdeploy-journal", "version": 1, "event": "start", "config": {...}, "fingerprint": {...},
     "machine": {...}, "machine_key": "…", "plan": [["export", "vit tiny fp32"], ...], "command": ..., "pid": ...}
    {"event": "begin",  "phase": "bench", "what": "vit tiny", "attempt": 7, "time": ...}
    {"event": "record", "attempt": 7, "record": {...}}                 one per record, as soon as it is made
    {"event": "done",   "phase": "bench", "what": "vit tiny", "attempt": 7, "key": {...}, "seconds": 12.9}
    {"event": "reused", "phase": ..., "what": ..., "from": 7, "key": {...}}      (--resume: already measured)
    {"event": "failed", "phase": ..., "what": ..., "attempt": 9, "error": "..."}
    {"event": "part",   "phase": "bench", "what": "vit tiny", "part": "batch 4", "attempt": 7, "status": "done",
     "key": {...}, "ids": [[...record identity...], ...], "errors": []}   one unit of a step (a bench comparison)
    {"event": "skip",   "phase": ..., "what": ..., "note": "skipped: needs ≈3.1 GiB, 2.0 GiB available"}
    {"event": "note",   "text": "bench vit tiny: re-measured (machine changed: cpu_model ...)"}
    {"event": "resume", ...same fields as start...}                   (--resume: a new segment begins)
    {"event": "interrupted", "signal": "SIGINT"}  /  {"event": "end", "duration_s": ..., "report": ...}

An attempt is identified by the line number of its "begin" event. The records of a step are those of its
latest finished attempt ("done", or the attempt a "reused" event points at); a step that never finished
contributes the records its latest attempt got to (an incomplete report shows them, --resume measures the
step again, reusing the parts of its latest attempt that are "done" with the same key: their records, named by
identity in the part event). A "failed" part (e.g. its isolated child was killed) is named in the notes.
`read_journal` returns that view; `JournalWriter` appends.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError
from xdeploy.core.fingerprint import machine_identity  # the one definition of the same machine
from xdeploy.core.fsutil import atomic_write_text

SCHEMA = "xdeploy-journal"
VERSION = 1
JOURNAL_NAME = "journal.jsonl"
EVENTS = ("start", "resume", "begin", "record", "part", "done", "reused", "failed", "skip", "note", "interrupted",
          "end")

def now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds")


def digest(obj: Any) -> str:
    """A short stable hash of JSON-able data (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def identity_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """'cpu_model: A -> B' for every differing field (nested versions listed per library)."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{k}.{x}: {a.get(x)} -> {b.get(x)}" for x in sorted(set(a) | set(b)) if a.get(x) != b.get(x)]
        else:
            out.append(f"{k}: {_short(a)} -> {_short(b)}")
    return out


def _short(v: Any) -> str:
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= 60 else s[:57] + "..."


# ------------------------------------------------------------------------------------------- reading ----

@dataclass
class StepState:
    """What the journal says about one (phase, what) step of the plan."""

    phase: str
    what: str
    status: str  # "done" | "reused" | "failed" | "skipped" | "running" (begun, never finished)
    attempt: int | None  # the attempt whose records count
    key: dict[str, Any] | None = None
    note: str | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    parts: dict[str, dict[str, Any]] = field(default_factory=dict)  # part -> its latest "part" event (this attempt)

    def part_records(self, part: str, key: Mapping[str, Any]) -> list[dict[str, Any]] | None:
        """The records of a part this attempt finished ("done") under `key`; None when it must be measured."""
        from xdeploy.core.records import identity

        ev = self.parts.get(part)
        if ev is None or ev.get("status") != "done" or ev.get("key") != dict(key):
            return None
        ids = [tuple(i) for i in ev.get("ids", [])]
        found = {identity(r): r for r in self.records if identity(r) in ids}
        return [found[i] for i in ids] if len(found) == len(ids) else None


@dataclass(frozen=True)
class JournalState:
    path: Path
    header: dict[str, Any]  # the latest "start"/"resume" event (its config, fingerprint and plan)
    first: dict[str, Any]  # the "start" event
    events: tuple[dict[str, Any], ...]
    steps: dict[tuple[str, str], StepState]  # latest state per step, in first-seen order
    torn: bool  # the last line was cut short by a crash (ignored)
    complete: bool  # the latest segment reached "end"
    interrupted: str | None  # "SIGINT" when the latest segment recorded an interruption
    notes: tuple[str, ...]  # "note" and "skip" texts, in order
    loose_records: tuple[dict[str, Any], ...] = ()  # records outside any step

    @property
    def plan(self) -> list[tuple[str, str]]:
        return [(p, w) for p, w in self.header.get("plan", [])]

    def records(self) -> list[dict[str, Any]]:
        """The records a report of this journal shows: per step, those of the attempt that counts, then the
        records made outside steps; a later record with the identity of an earlier one (a correction made by
        records.revise, e.g. a % of peak re-judged) replaces it in place."""
        from xdeploy.core.records import IDENTITY, identity

        out: list[dict[str, Any]] = []
        where: dict[tuple[Any, ...], int] = {}
        for rec in [r for st in self.steps.values() for r in st.records] + list(self.loose_records):
            key = identity(rec) if rec.get("kind") in IDENTITY else None
            if key is not None and key in where:
                out[where[key]] = rec
                continue
            if key is not None:
                where[key] = len(out)
            out.append(rec)
        return out

    def finished(self, phase: str, what: str) -> StepState | None:
        st = self.steps.get((phase, what))
        return st if st is not None and st.status in ("done", "reused") else None

    def machine_at(self, attempt: int | None) -> dict[str, Any]:
        """The machine identity of the segment that ran `attempt` (the start/resume event before its line)."""
        seg = self.first
        for ev in self.events:
            if attempt is not None and ev["_line"] > attempt:
                break
            if ev["event"] in ("start", "resume"):
                seg = ev
        return dict(seg.get("machine") or {})

    def stop_point(self) -> tuple[str, str] | None:
        """The step the latest segment was in when it stopped (begun, never finished), if any."""
        if self.complete:
            return None
        seg = _last_segment_start(self.events)
        open_: dict[tuple[str, str], int] = {}
        for ev in self.events[seg:]:
            k = (ev.get("phase"), ev.get("what"))
            if ev["event"] == "begin":
                open_[k] = ev["attempt"]  # type: ignore[index]
            elif ev["event"] in ("done", "failed"):
                open_.pop(k, None)  # type: ignore[arg-type]
        return list(open_)[-1] if open_ else None  # type: ignore[return-value]

    def missing(self) -> list[tuple[str, str]]:
        """Steps of the latest plan with no finished, failed or skipped state."""
        return [s for s in self.plan if s not in self.steps or self.steps[s].status == "running"]

    def status(self) -> dict[str, Any]:
        """For the report's header: complete or not, where it stopped, what is missing."""
        stop = self.stop_point()
        plan = self.plan
        last = self.events[-1].get("time") if self.events else None
        return {"complete": self.complete, "journal": str(self.path),
                "stopped_in": f"{stop[0]}: {stop[1]}" if stop else None,
                "step_index": plan.index(stop) + 1 if stop in plan else None, "steps": len(plan),
                "missing": [f"{p}: {w}" for p, w in self.missing()], "interrupted": self.interrupted,
                "torn_tail": self.torn, "last_event": last,
                "segments": sum(e["event"] in ("start", "resume") for e in self.events)}


def _last_segment_start(events: Sequence[Mapping[str, Any]]) -> int:
    return max((i for i, e in enumerate(events) if e["event"] in ("start", "resume")), default=0)


def _parse_lines(path: Path) -> tuple[list[dict[str, Any]], bool, int]:
    """(events, torn tail, byte length of the complete lines)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise XDeployError(f"cannot read journal {path}: {e.strerror or e}") from None
    complete_len = data.rfind(b"\n") + 1
    torn = complete_len < len(data)
    events: list[dict[str, Any]] = []
    for i, line in enumerate(data[:complete_len].split(b"\n")[:-1], 1):
        try:
            ev = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise XDeployError(f"{path}:{i}: not a JSON journal line ({getattr(e, 'msg', e)})") from None
        if i == 1 and (not isinstance(ev, dict) or ev.get("event") != "start" or ev.get("schema") != SCHEMA):
            break
        if not isinstance(ev, dict) or ev.get("event") not in EVENTS:
            raise XDeployError(f"{path}:{i}: not a journal event; expected one of: {', '.join(EVENTS)}")
        ev["_line"] = i
        events.append(ev)
    if not events or events[0]["event"] != "start" or events[0].get("schema") != SCHEMA:
        raise XDeployError(f"{path} is not an xdeploy journal (first line must be a {SCHEMA!r} start event)")
    if events[0].get("version") != VERSION:
        raise XDeployError(f"{path}: journal version {events[0].get('version')!r}; expected {VERSION}")
    return events, torn, complete_len


def read_journal(path: str | os.PathLike[str]) -> JournalState:
    """Parse a journal (a torn last line is ignored); raise XDeployError naming a damaged line."""
    path = Path(path)
    if path.is_dir():
        path = path / JOURNAL_NAME
    events, torn, _ = _parse_lines(path)
    steps: dict[tuple[str, str], StepState] = {}
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    parts: dict[int, dict[str, dict[str, Any]]] = {}  # attempt -> part -> its "part" event
    attempt_step: dict[int, tuple[str, str]] = {}
    loose: list[dict[str, Any]] = []
    notes: list[str] = []
    complete, interrupted = False, None
    for ev in events:
        kind = ev["event"]
        k = (ev.get("phase"), ev.get("what"))
        if kind in ("start", "resume"):
            complete, interrupted = False, None
        elif kind == "begin":
            by_attempt[ev["attempt"]] = []
            parts[ev["attempt"]] = {}
            attempt_step[ev["attempt"]] = k  # type: ignore[assignment]
            prev = steps.get(k)  # type: ignore[arg-type]
            if prev is None or prev.status not in ("done", "reused"):  # a finished attempt counts until replaced
                steps[k] = StepState(*k, status="running", attempt=ev["attempt"],  # type: ignore[arg-type]
                                     records=by_attempt[ev["attempt"]], parts=parts[ev["attempt"]])
        elif kind == "part":
            parts.setdefault(ev.get("attempt"), {})[str(ev.get("part"))] = ev  # type: ignore[arg-type]
            if ev.get("status") == "failed":
                notes += [f"{k[0]} {k[1]} {ev.get('part')}: failed: {e}" for e in ev.get("errors") or ["?"]]
        elif kind == "record":
            rec = ev.get("record")
            if not isinstance(rec, dict):
                raise XDeployError(f"{path}:{ev['_line']}: record event without a record object")
            a = ev.get("attempt")
            by_attempt.get(a, loose).append(rec)
        elif kind in ("done", "failed"):
            a = ev.get("attempt")
            steps.pop(k, None)  # type: ignore[arg-type]
            steps[k] = StepState(*k, status=kind, attempt=a, key=ev.get("key"),  # type: ignore[arg-type]
                                 note=ev.get("error"), records=by_attempt.get(a, []), parts=parts.get(a, {}))
        elif kind == "reused":
            src = ev.get("from")
            steps.pop(k, None)  # type: ignore[arg-type]
            steps[k] = StepState(*k, status="reused", attempt=src, key=ev.get("key"),  # type: ignore[arg-type]
                                 records=by_attempt.get(src, []), parts=parts.get(src, {}))
        elif kind == "skip":
            notes.append(f"{k[0]} {k[1]}: {ev.get('note')}")
            if k not in steps:
                steps[k] = StepState(*k, status="skipped", attempt=None, note=ev.get("note"))  # type: ignore[arg-type]
        elif kind == "note":
            notes.append(str(ev.get("text")))
        elif kind == "interrupted":
            interrupted = str(ev.get("signal") or "interrupted")
        elif kind == "end":
            complete = True
    header = events[_last_segment_start(events)]
    return JournalState(path=path, header=header, first=events[0], events=tuple(events), steps=steps, torn=torn,
                        complete=complete, interrupted=interrupted, notes=tuple(notes), loose_records=tuple(loose))


def is_journal(path: str | os.PathLike[str]) -> bool:
    """True when the file's first line is a journal start event (cheap: reads one line)."""
    try:
        with open(path, "rb") as f:
            first = json.loads(f.readline() or b"null")
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(first, dict) and first.get("schema") == SCHEMA


# ------------------------------------------------------------------------------------------- writing ----

class JournalWriter:
    """Appends events to a journal, one fsynced line each. Use `create` (a new run) or `resume`."""

    def __init__(self, path: Path, lines: int) -> None:
        self.path = path
        self.lines = lines  # lines written so far: the next line's number is lines + 1
        self.attempt: int | None = None  # the step attempt records are attributed to
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        except OSError as e:
            raise XDeployError(f"cannot open journal {path}: {e.strerror or e}") from None

    @staticmethod
    def _header(event: str, *, config: Mapping[str, Any], fingerprint: Mapping[str, Any],
                plan: Sequence[tuple[str, str]], command: str) -> dict[str, Any]:
        ident = machine_identity(fingerprint)
        return {"schema": SCHEMA, "version": VERSION, "event": event, "time": now(), "pid": os.getpid(),
                "command": command, "config": dict(config), "fingerprint": dict(fingerprint), "machine": ident,
                "machine_key": digest(ident), "plan": [list(s) for s in plan]}

    @classmethod
    def create(cls, path: str | os.PathLike[str], **header: Any) -> JournalWriter:
        """Start a new journal (replacing an old one atomically: a crash leaves the old or the new header)."""
        path = Path(path)
        atomic_write_text(path, json.dumps(cls._header("start", **header), allow_nan=False) + "\n")
        return cls(path, 1)

    @classmethod
    def resume(cls, path: str | os.PathLike[str], **header: Any) -> tuple[JournalWriter, JournalState]:
        """Continue an existing journal: drop a torn last line, append a "resume" event."""
        path = Path(path)
        state = read_journal(path)
        _, _, complete_len = _parse_lines(path)
        try:
            with open(path, "r+b") as f:
                f.truncate(complete_len)  # the next line must not be glued to a torn one
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise XDeployError(f"cannot write journal {path}: {e.strerror or e}") from None
        w = cls(path, len(state.events))
        w.event(cls._header("resume", **header))
        return w, state

    def event(self, ev: Mapping[str, Any]) -> int:
        """Append one event; returns its line number."""
        data = (json.dumps({k: v for k, v in ev.items() if k != "_line"}, allow_nan=False,
                           separators=(",", ":")) + "\n").encode("utf-8")
        try:
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            os.fsync(self._fd)
        except OSError as e:
            raise XDeployError(f"cannot write journal {self.path}: {e.strerror or e}") from None
        self.lines += 1
        return self.lines

    def begin(self, phase: str, what: str) -> int:
        self.attempt = self.lines + 1
        self.event({"event": "begin", "phase": phase, "what": what, "attempt": self.attempt, "time": now()})
        return self.attempt

    def record(self, rec: Mapping[str, Any]) -> None:
        """Append one record, attributed to the current step attempt (the records.py hook calls this)."""
        self.event({"event": "record", "attempt": self.attempt, "record": dict(rec)})

    def done(self, phase: str, what: str, key: Mapping[str, Any], seconds: float, n_records: int) -> None:
        self.event({"event": "done", "phase": phase, "what": what, "attempt": self.attempt, "key": dict(key),
                    "seconds": seconds, "records": n_records, "time": now()})
        self.attempt = None

    def part(self, phase: str, what: str, part: str, key: Mapping[str, Any], records: Sequence[Mapping[str, Any]],
             errors: Sequence[str] = ()) -> None:
        """One unit of the current step finished: "done" (its records, by identity) or "failed" (errors)."""
        from xdeploy.core.records import identity

        self.event({"event": "part", "phase": phase, "what": what, "part": part, "attempt": self.attempt,
                    "status": "failed" if errors else "done", "key": dict(key),
                    "ids": [list(identity(r)) for r in records], "errors": list(errors), "time": now()})

    def failed(self, phase: str, what: str, error: str) -> None:
        self.event({"event": "failed", "phase": phase, "what": what, "attempt": self.attempt, "error": error,
                    "time": now()})
        self.attempt = None

    def reused(self, phase: str, what: str, attempt: int | None, key: Mapping[str, Any]) -> None:
        self.event({"event": "reused", "phase": phase, "what": what, "from": attempt, "key": dict(key),
                    "time": now()})

    def skip(self, phase: str, what: str, note: str) -> None:
        self.event({"event": "skip", "phase": phase, "what": what, "note": note, "time": now()})

    def note(self, text: str) -> None:
        self.event({"event": "note", "text": text, "time": now()})

    def interrupted(self, signal: str) -> None:
        self.event({"event": "interrupted", "signal": signal, "time": now()})

    def end(self, duration_s: float, report: str) -> None:
        self.event({"event": "end", "duration_s": duration_s, "report": report, "time": now()})

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> JournalWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
