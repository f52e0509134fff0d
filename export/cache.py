"""The artifact cache: an export runs once per key; later calls reuse it while it still loads and verifies.

One cache, one layout, one budget. Entries live in one folder, `$XDEPLOY_CACHE/exports/` (or a study's own
folder, `root=`), each named `<label>-<source>_<key>`: a label a person can read (model, preset or checkpoint,
precision, options), 8 hex digits naming the exported source it was stored under, and 12 of the key
(`export_key`: the model and every export option, the checkpoint's files or the preset, the calibration file's
bytes, the library versions and the source an export runs). Two ways in, the same entries:

    from xdeploy.export.cache import cached_artifact, cached_export
    path = cached_artifact("bert", preset="tiny", precision="int8")   # used in place: $XDEPLOY_CACHE/exports/...
    path = cached_artifact("bert", checkpoint="ckpt/minilm", root="artifacts/embed")  # a study's own folder
    cached_export("bert", {"preset": "tiny", "out": "artifacts/bert"}, run)   # copied out: `xdeploy export` / api

`cached_artifact` (bench/suite.py, bench/scale.py, the studies) returns the entry itself; a damaged entry (it no
longer loads or its sha256s do not match) is exported again. `cached_export` (api.export, `xdeploy export`,
`xdeploy run`) copies an entry into the caller's `--out` and verifies the copy, so the user's artifact is theirs.

After every store the folder is brought under XDEPLOY_EXPORT_CACHE_BUDGET_MB (`evict`): stale entries first
(stored under another source: every code edit changes the key, so nothing this source runs can hit them), then the
least recently used (a hit touches its entry). An entry in use is never removed: `cached_artifact` holds a shared
lock (flock on the entry's directory) for the rest of the process, `cached_export` while it copies, and eviction
removes only what it can lock exclusively, renaming it aside first, so no process sees half an entry.
"""

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


def _checkpoint_key(checkpoint: str | Path) -> str:
    """Names, sizes and modification times of the checkpoint's files (cheap; a rewritten file changes it)."""
    p = Path(checkpoint).resolve()
    if not p.exists():
        raise XDeployError(f"checkpoint directory {checkpoint} does not exist")  # models/checkpoint.py's words
    files = sorted(f for f in (p.rglob("*") if p.is_dir() else [p]) if f.is_file())
    h = hashlib.sha256(str(p).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(p) if p.is_dir() else f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return "ckpt" + h.hexdigest()[:8]


def cached_artifact(model: str, *, preset: str | None = None, checkpoint: str | Path | None = None,
                    precision: str = "fp32", opset: int | None = None, attn_impl: str | None = None,
                    overrides: Mapping[str, Any] | None = None, root: str | Path | None = None,
                    fresh: bool = False, log: Callable[[str], None] | None = None, refine: Any = None,
                    openvino_ir: bool = False) -> Path:
    """Export `model` (a preset, default its first; or a `checkpoint`) once per key under `root` (default
    entries_root()); later calls return the cached directory, held in use for the rest of this process (never
    evicted under it). `fresh` exports again. `refine`: the measured keep-float search
    (verify/sensitivity.refine) for fp16/int8; `openvino_ir`: with the OpenVINO IR (fp32); both part of the key."""
    from xdeploy.export.artifact import load_artifact
    from xdeploy.export.onnx_export import DEFAULT_OPSET, export
    from xdeploy.models.registry import get_family

    family = get_family(model)
    if checkpoint is not None and preset is not None:
        raise XDeployError("give a preset or a checkpoint, not both")
    if checkpoint is None:
        preset = preset or next(iter(family.presets))
    opset = opset or DEFAULT_OPSET
    base = family.presets.get(preset) if preset else None
    # overrides equal to the preset's own values do not change the graph: share the cache entry
    overrides = {k: v for k, v in (overrides or {}).items() if getattr(base, k, object()) != v}
    measured = refine is not None and precision not in ("fp32", "int8-dynamic")
    folder = Path(root) if root is not None else entries_root()
    _mb_env("XDEPLOY_EXPORT_CACHE_BUDGET_MB", DEFAULT_BUDGET_MB)  # a bad setting: an error before any work
    path = entry_path(folder, model, {"preset": preset, "checkpoint": checkpoint, "precision": precision,
                                      "opset": opset, "attn_impl": attn_impl, "config_overrides": overrides or None,
                                      "measured": measured, "openvino_ir": openvino_ir})
    assert path is not None  # every field above is keyable
    if not fresh and _hold(path):
        try:
            load_artifact(path)
            _touch(path)
            return path
        except XDeployError:
            pass  # damaged cache entry: export again
    if log:
        log(f"exporting {model} {preset or 'checkpoint'} {precision} opset {opset} {attn_impl or 'sdpa'} -> {path}")
    kwargs: dict[str, Any] = {"config_overrides": dict(overrides)} if overrides else {}
    export(model, preset=preset, checkpoint=checkpoint, out=path, opset=opset, precision=precision,
           attn_impl=attn_impl, force=True, refine=refine, openvino_ir=openvino_ir,
           trace_cache="refresh" if fresh else "use", **kwargs)
    _hold(path)  # the new directory: held before eviction runs, so it cannot be taken by another store either
    evict(folder, keep=path)
    return path


# ---------------------------------------------------------------------------------------------------------------
# The key: a sha256 over everything the artifact depends on: the model and every export option, the checkpoint's
# files (names, sizes, modification times) or the preset, the calibration file's bytes, the versions of the
# libraries that write or measure the graphs, and the source of models/, export/, verify/ (the measured AMP / int8
# sensitivity search), core/ and deploy/tokenizer_graph.py. Checked before torch is imported (api.export imports
# the exporter only on a miss). Inputs that cannot be keyed (in-memory calibration data or AMP feeds, a custom
# tokenizer-graph builder) bypass the cache.

# libraries whose version changes the exported bytes or the measured keep-float choices
EXPORT_LIBRARIES = ("torch", "onnx", "onnxscript", "onnxruntime", "onnxruntime-extensions", "openvino", "numpy",
                    "safetensors", "tokenizers")
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


def _file_digest(path: str | Path) -> str:
    from xdeploy.core.fsutil import sha256_file

    p = Path(path)
    if not p.is_file():
        raise XDeployError(f"calibration file {path} does not exist; expected a text, .npy or .npz file")
    return sha256_file(p)


def _fields_digest(fields: Mapping[str, Any], source: str) -> str:
    """sha256 of `fields` (JSON) with the library versions, the Python version and the export `source`: what every
    key is made of."""
    import json
    import sys

    blob = json.dumps({**fields, "libraries": _library_versions(), "python": sys.version.split()[0],
                       "source": source}, sort_keys=True, allow_nan=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def _key_digest(model: str, options: Mapping[str, Any], source: str) -> str | None:
    """The sha256 behind export_key, for the export `source` (export_source_hash())."""
    import dataclasses

    fields: dict[str, Any] = {"model": model}
    for k, v in sorted(options.items()):
        if k in ("out", "force"):
            continue
        if v is None or isinstance(v, (bool, int, float, str)):
            fields[k] = v
        elif k == "checkpoint":
            fields[k] = _checkpoint_key(v)
        elif k == "config_overrides" and isinstance(v, Mapping):
            if not all(isinstance(x, (bool, int, float, str)) for x in v.values()):
                return None
            fields[k] = dict(sorted(v.items()))
        elif k == "precision_options" and dataclasses.is_dataclass(v):
            if getattr(v, "amp_feeds", None) is not None or getattr(v, "int8_calibration", None) is not None:
                return None  # in-memory data: not keyed
            d = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
            if d.get("int8_calibration_file"):
                d["int8_calibration_file"] = _file_digest(d["int8_calibration_file"])
            fields[k] = {n: list(x) if isinstance(x, tuple) else x for n, x in d.items()}
        elif k == "tokenizer_graph" and isinstance(getattr(v, "cache_key", None), str):
            fields[k] = v.cache_key  # deploy/tokenizer_graph.py's builder names its behaviour
        else:
            return None
    try:
        return _fields_digest(fields, source)
    except (TypeError, ValueError):
        return None


def export_key(model: str, options: Mapping[str, Any]) -> str | None:
    """The cache key of `api.export(model, **options)` (plus `measured`), or None when an option cannot be keyed
    honestly (then the export runs and nothing is cached). `out` and `force` are not part of it."""
    digest = _key_digest(model, options, export_source_hash())
    return None if digest is None else f"{model}-{digest[:24]}"


def _source_tag(source: str) -> str:
    # hashed again so any source string (a test's stand-in included) names entries with 8 hex digits
    return hashlib.sha256(source.encode()).hexdigest()[:8]


# `<label>-<source tag>_<key>`: what eviction recognises as an entry (a study's folder may hold other things,
# e.g. the checkpoints it exports from)
_ENTRY = re.compile(r"-(?P<source>[0-9a-f]{8})_[0-9a-f]{12}$")
# names of versions before the one cache: `<model>-<24 hex>` (the copy cache), `<label>-<10 hex>` (the in-place one)
_OLD_ENTRY = re.compile(r"-([0-9a-f]{24}|[0-9a-f]{10})$")


def _label(model: str, options: Mapping[str, Any]) -> str:
    """The readable part of an entry's name (the key after it decides what matches)."""
    checkpoint, precision = options.get("checkpoint"), options.get("precision") or "fp32"
    parts = [model, _checkpoint_key(checkpoint) if checkpoint is not None else options.get("preset") or "default",
             precision + ("-measured" if options.get("measured") and precision not in ("fp32", "int8-dynamic")
                          else "") + ("-ir" if options.get("openvino_ir") else "")]
    if options.get("opset"):
        parts.append(f"o{options['opset']}")
    parts.append(str(options.get("attn_impl") or "sdpa"))
    overrides = options.get("config_overrides")
    parts += [f"{k}{v}" for k, v in sorted(overrides.items())] if isinstance(overrides, Mapping) else []
    return re.sub(r"[^\w.+=-]", "", "-".join(map(str, parts)))[:120]  # one path component, whatever the values


def entry_path(root: Path, model: str, options: Mapping[str, Any]) -> Path | None:
    """The entry `options` (as export_key takes them) are stored under in `root`; None when they cannot be keyed."""
    source = export_source_hash()
    digest = _key_digest(model, options, source)
    if digest is None:
        return None
    return Path(root) / f"{_label(model, options)}-{_source_tag(source)}_{digest[:12]}"


def cached_export(model: str, options: Mapping[str, Any], run: Callable[[], Path], *, fresh: bool = False,
                  log: Callable[[str], None] | None = None) -> Path:
    """`run()` (the export into options["out"]) unless the cache holds the same key: then that entry is copied
    into `out` (atomically, core/fsutil.atomic_dir; an existing `out` is refused without force, as the export does)
    and the copy's manifest and every sha256 are verified before it is renamed into place. A miss, a damaged entry
    or `fresh` runs the export and (re)stores a copy of its result in entries_root()."""
    from xdeploy.export.artifact import load_artifact

    entry = entry_path(entries_root(), model, options) if options.get("out") is not None else None
    if entry is None:
        return run()
    out = Path(options["out"])
    limit = _mb_env("XDEPLOY_EXPORT_CACHE_MAX_MB", DEFAULT_ENTRY_MB)  # a bad setting: an error before any work
    _mb_env("XDEPLOY_EXPORT_CACHE_BUDGET_MB", DEFAULT_BUDGET_MB)
    if entry.is_dir() and not fresh:
        try:
            with _leased(entry) as held:
                if not held:
                    raise XDeployError("evicted while it was looked up")
                with atomic_dir(out, force=bool(options.get("force"))) as tmp:
                    shutil.copytree(entry, tmp, dirs_exist_ok=True)
                    load_artifact(tmp)  # manifest schema and every file's sha256: a damaged entry never lands
                _touch(entry)
            if log:
                log(f"export cache: {entry} reused (same model, options, libraries and xdeploy source; "
                    "--fresh exports again)")
            return out
        except (XDeployError, OSError) as e:
            if out.exists() and not options.get("force"):
                raise  # `out` already exists: the same refusal the export gives
            if log:
                log(f"export cache: entry {entry} not reused ({e}); exporting")
    path = run()
    size = _dir_bytes(path)
    if size > limit:  # a full copy of a base-preset export costs more disk than re-exporting saves
        if log:
            log(f"export cache: not stored ({size / 2**20:.0f} MB > XDEPLOY_EXPORT_CACHE_MAX_MB "
                f"{limit / 2**20:.0f} MB)")
        return path
    try:  # a cache that cannot be written costs the next export its reuse, never this one its result
        with atomic_dir(entry, force=True) as tmp:
            shutil.copytree(path, tmp, dirs_exist_ok=True)
        evict(entries_root(), keep=entry)
    except (XDeployError, OSError) as e:
        if log:
            log(f"export cache: not stored ({e})")
    return path


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
    traces_root() with their sha256, and read from it while they verify; `read=False` runs and refreshes the
    entry. Results over XDEPLOY_EXPORT_CACHE_MAX_MB are not stored; a cache that cannot be written costs only
    the reuse."""
    source = export_source_hash()
    digest = _fields_digest(fields, source)
    name = re.sub(r"[^\w.+=-]", "", label)[:120]
    entry = traces_root() / f"{name}-{_source_tag(source)}_{digest[:12]}"
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
