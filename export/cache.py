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

import hashlib
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import atomic_dir

# the folders, keys' common part, leases and eviction (export/store.py); re-exported: callers and tests use
# xdeploy.export.cache for all of the cache
from .store import (  # noqa: F401
    _HELD,
    DEFAULT_BUDGET_MB,
    DEFAULT_ENTRY_MB,
    EXPORT_SOURCES,
    _dir_bytes,
    _fields_digest,
    _hold,
    _leased,
    _mb_env,
    _source_tag,
    _touch,
    cache_root,
    entries_root,
    evict,
    export_source_hash,
)


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


def _file_digest(path: str | Path) -> str:
    from xdeploy.core.fsutil import sha256_file

    p = Path(path)
    if not p.is_file():
        raise XDeployError(f"calibration file {path} does not exist; expected a text, .npy or .npz file")
    return sha256_file(p)


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
