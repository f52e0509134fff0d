"""The cache's folders and entries, below the artifact cache (export/cache.py) and the trace cache: where they
live ($XDEPLOY_CACHE), what every key is made of (library versions, Python, the export source), entries in use
(flock leases), the size budget and eviction, and the trace entries (`cached_trace`). Nothing here imports the
exporter, so export/onnx_export.py can keep its traces here while export/cache.py exports through it."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import atomic_dir, clean_debris


def cache_root() -> Path:
    """$XDEPLOY_CACHE, else ~/.cache/xdeploy: artifacts, the roofline, compiled-model caches."""
    return Path(os.environ.get("XDEPLOY_CACHE") or Path.home() / ".cache" / "xdeploy")


def entries_root() -> Path:
    """The artifact cache's folder (both ways in)."""
    return cache_root() / "exports"


def traces_root() -> Path:
    """The trace cache's folder (`cached_trace`)."""
    return cache_root() / "traces"


# the in-place folder of versions before the one cache: its entries can never be hit again (other names), so they
# count as stale in the default folder's budget until they are gone
LEGACY_ROOT = "artifacts"


# libraries whose version changes the exported bytes or the measured keep-float choices
EXPORT_LIBRARIES = ("torch", "onnx", "onnxscript", "onnxruntime", "onnxruntime-extensions", "openvino", "nncf",
                    "numpy", "safetensors", "tokenizers")  # nncf: an int8-dynamic artifact's int8-weight IR


# source the artifact depends on, relative to the package root (the folder holding export/)
EXPORT_SOURCES = ("models", "export", "verify", "core", "deploy/tokenizer_graph.py")


def export_source_hash(base: Path | None = None) -> str:
    """sha256 of every .py file an export runs (EXPORT_SOURCES under `base`, default the installed package root)
    and of the trained preset weights shipped beside the models (models/weights/*.safetensors: a retrain with
    unchanged code must not reuse artifacts of the old weights), read as files: nothing is imported."""
    base = base or Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel in EXPORT_SOURCES:
        p = base / rel
        for f in sorted([*p.rglob("*.py"), *p.rglob("*.safetensors")]) if p.is_dir() else [p]:
            h.update(str(f.relative_to(base)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in EXPORT_LIBRARIES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "-"
    return out


def _fields_digest(fields: Mapping[str, Any], source: str) -> str:
    """sha256 of `fields` (JSON) with the library versions, the Python version and the export `source`: what every
    key is made of."""
    import json
    import sys

    blob = json.dumps({**fields, "libraries": _library_versions(), "python": sys.version.split()[0],
                       "source": source}, sort_keys=True, allow_nan=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def _source_tag(source: str) -> str:
    # hashed again so any source string (a test's stand-in included) names entries with 8 hex digits
    return hashlib.sha256(source.encode()).hexdigest()[:8]


# `<label>-<source tag>_<key>`: what eviction recognises as an entry (a study's folder may hold other things,
# e.g. the checkpoints it exports from)
_ENTRY = re.compile(r"-(?P<source>[0-9a-f]{8})_[0-9a-f]{12}$")


# names of versions before the one cache: `<model>-<24 hex>` (the copy cache), `<label>-<10 hex>` (the in-place one)
_OLD_ENTRY = re.compile(r"-([0-9a-f]{24}|[0-9a-f]{10})$")


# ------------------------------------------------------------------------------------------ traces ----
# torch.onnx's dynamo export is most of an export's time (tiny presets: 4-11 s of CPU per graph, mostly tracing
# and decompositions), and the same fp32 graph is traced again for every precision, optimization and option of
# the same model: an fp32, fp16, int8 and int8-dynamic export of one model trace the same graphs four times. The
# traced graph is kept as an entry of the same folder (same budget, eviction and in-use locks), keyed by what
# the trace depends on (the caller's fields: family, config, weights, graph, opset) plus, as every key, the
# library versions, Python and the export source. Traces live in a folder of their own, $XDEPLOY_CACHE/traces/,
# under the same rules as the artifacts' (named entries, XDEPLOY_EXPORT_CACHE_BUDGET_MB, eviction, in-use locks).
TRACE_FILE = "graph.onnx"


def cached_trace(label: str, fields: Mapping[str, Any], run: Callable[[], bytes], *, read: bool = True) -> bytes:
    """The bytes `run()` makes (a serialized traced graph), stored as the entry `<label>-<source>_<key>` of
    traces_root() with their sha256, and read from it (or from an entry of the same source and key under another
    label) while they verify; `read=False` runs and refreshes the entry. Results over XDEPLOY_EXPORT_CACHE_MAX_MB
    are not stored; a cache that cannot be written costs only the reuse."""
    source = export_source_hash()
    digest = _fields_digest(fields, source)
    name = re.sub(r"[^\w.+=-]", "", label)[:120]
    suffix = f"-{_source_tag(source)}_{digest[:12]}"
    entry = traces_root() / f"{name}{suffix}"
    if read and not (entry / TRACE_FILE).is_file():
        # the same key stored under another label: the same module and weights exported from a preset and from a
        # checkpoint (labels name the source for people; the key is what the trace depends on)
        entry = next(iter(sorted(traces_root().glob(f"*{suffix}"))), entry)
    limit = entry_limit_bytes()
    if read and (entry / TRACE_FILE).is_file():
        with _leased(entry) as held, contextlib.suppress(OSError):
            if held:
                data = (entry / TRACE_FILE).read_bytes()
                if hashlib.sha256(data).hexdigest() == (entry / "sha256").read_text().strip():
                    _touch(entry)
                    return data
    data = run()
    if len(data) <= limit:
        with contextlib.suppress(XDeployError, OSError):
            with atomic_dir(entry, force=True) as tmp:
                (tmp / TRACE_FILE).write_bytes(data)
                (tmp / "sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
            evict(traces_root(), keep=entry)
    return data


# Size policy: one budget over the folder, XDEPLOY_EXPORT_CACHE_BUDGET_MB, stale entries first, then least recently
# used. Copies (cached_export) are stored only up to XDEPLOY_EXPORT_CACHE_MAX_MB (tiny and small presets: what
# tests, docs and quick runs repeat): a copy of a base-preset export costs more disk than re-exporting saves. An
# in-place entry (cached_artifact) is the artifact its caller uses, so it is stored whatever its size.
DEFAULT_ENTRY_MB = 256.0


DEFAULT_BUDGET_MB = 2048.0


def entry_limit_bytes() -> float:
    """XDEPLOY_EXPORT_CACHE_MAX_MB in bytes: the largest copy or trace the cache stores."""
    return _mb_env("XDEPLOY_EXPORT_CACHE_MAX_MB", DEFAULT_ENTRY_MB)


def _mb_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    try:
        mb = float(raw) if raw not in (None, "") else default
    except ValueError:
        raise XDeployError(f"{name}={raw!r}: expected a number of megabytes") from None
    if mb < 0:
        raise XDeployError(f"{name}={raw!r}: expected a number of megabytes >= 0")
    return mb * 2**20


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _touch(entry: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(entry)  # recently used: the last to be evicted


# ------------------------------------------------------------------------------------------- in use ----
# A shared flock on an entry's directory says "in use"; eviction takes it exclusively (non-blocking) or passes the
# entry by. flock locks belong to the open file, so they end with the process, however it ends, and a lock this
# process holds also stops its own eviction (another open of the same directory conflicts).

_HELD: dict[Path, int] = {}  # entries this process uses in place -> the descriptor holding their shared lock


def _lock(entry: Path, mode: int) -> int | None:
    """A descriptor of `entry` locked in `mode`, or None when it is missing, locked against `mode`
    (LOCK_NB), or was replaced or moved away while the lock was awaited."""
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, mode)
        st, now = os.fstat(fd), os.stat(entry)
        if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
            return fd
    except OSError:  # BlockingIOError: in use; FileNotFoundError: evicted meanwhile
        pass
    os.close(fd)
    return None


def _hold(entry: Path) -> bool:
    """Hold `entry` in use for the rest of this process (cached_artifact hands out the directory itself)."""
    fd = _lock(entry, fcntl.LOCK_SH)  # waits only while an eviction moves the entry aside
    old = _HELD.pop(entry, None)
    if old is not None:
        os.close(old)  # an earlier directory under this name (replaced since)
    if fd is not None:
        _HELD[entry] = fd
    return fd is not None


@contextlib.contextmanager
def _leased(entry: Path) -> Iterator[bool]:
    """`entry` in use for the block (a copy out of it); yields False when it is gone."""
    fd = _lock(entry, fcntl.LOCK_SH)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)


def _remove(entry: Path) -> bool:
    """Remove `entry` unless something uses it: renamed aside under its exclusive lock (a reader sees the whole
    entry or none), then deleted. The aside name is fsutil's temporary one, so debris of a killed eviction is
    cleaned like any other (clean_debris)."""
    fd = _lock(entry, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if fd is None:
        return False
    try:
        aside = entry.with_name(f".{entry.name}.tmp-{os.getpid()}-evicted")
        os.replace(entry, aside)
    except OSError:
        return False
    finally:
        os.close(fd)
    shutil.rmtree(aside, ignore_errors=True)
    return True


def _entries(root: Path, source: str) -> list[tuple[bool, float, int, Path]]:
    """(stale, last use, bytes, path) of the entries in `root` (and, for the default folder, the old in-place
    folder's, all stale)."""
    folders = [(root, False)]
    if root.resolve() == entries_root().resolve():
        folders.append((cache_root() / LEGACY_ROOT, True))
    out = []
    for folder, legacy in folders:
        with contextlib.suppress(OSError):
            for p in folder.iterdir():
                if p.name.startswith(".") or not p.is_dir():
                    continue
                m = None if legacy else _ENTRY.search(p.name)
                if m is None and not (_OLD_ENTRY.search(p.name) and (p / "manifest.json").is_file()):
                    continue  # not a cache entry
                with contextlib.suppress(OSError):  # removed meanwhile
                    out.append((m is None or m.group("source") != source, p.stat().st_mtime, _dir_bytes(p), p))
    return out


def evict(root: str | Path | None = None, *, keep: Path | None = None) -> list[Path]:
    """Bring the cache folder `root` (default entries_root()) under XDEPLOY_EXPORT_CACHE_BUDGET_MB (default 2048):
    stale entries (stored under another export source) first, then the least recently used; `keep` (the entry just
    stored) and entries in use (by any process) stay. Returns the removed entries."""
    root = Path(root) if root is not None else entries_root()
    budget = _mb_env("XDEPLOY_EXPORT_CACHE_BUDGET_MB", DEFAULT_BUDGET_MB)
    with contextlib.suppress(OSError):  # what killed evictions and writers left behind
        for name in {m.group(1) for p in root.iterdir() if (m := re.match(r"^\.(.+)\.(tmp|old)-\d+", p.name))}:
            clean_debris(root / name)
    entries = sorted(_entries(root, _source_tag(export_source_hash())), key=lambda e: (not e[0], e[1]))
    total, removed = sum(e[2] for e in entries), []
    for _, _, size, p in entries:
        if total <= budget:
            break
        if keep is not None and p.resolve() == Path(keep).resolve():
            continue
        if _remove(p):
            total -= size
            removed.append(p)
    return removed
