"""The artifact cache: an export runs once per key; later calls reuse it while it still loads and verifies.

Two ways in, one key (`export_key`: the model and every export option, the checkpoint's files or the preset, the
calibration file's bytes, the library versions and the source an export runs):

    from xdeploy.export.cache import cached_artifact, cached_export
    path = cached_artifact("bert", preset="tiny", precision="int8")   # used in place: $XDEPLOY_CACHE/artifacts/...
    path = cached_artifact("bert", checkpoint="ckpt/minilm", root="artifacts/embed")  # a study's own folder
    cached_export("bert", {"preset": "tiny", "out": "artifacts/bert"}, run)   # copied out: `xdeploy export` / api

`cached_artifact` (bench/suite.py, bench/scale.py, the studies) returns the cache directory itself; a damaged entry
(it no longer loads or its sha256s do not match) is exported again. `cached_export` (api.export, `xdeploy export`,
`xdeploy run`) copies an entry into the caller's `--out` and verifies the copy, so the user's artifact is theirs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError


def cache_root() -> Path:
    """$XDEPLOY_CACHE, else ~/.cache/xdeploy: artifacts, the roofline, compiled-model caches."""
    return Path(os.environ.get("XDEPLOY_CACHE") or Path.home() / ".cache" / "xdeploy")


def _checkpoint_key(checkpoint: str | Path) -> str:
    """Names, sizes and modification times of the checkpoint's files (cheap; a rewritten file changes it)."""
    p = Path(checkpoint).resolve()
    if not p.exists():
        raise XDeployError(f"checkpoint {checkpoint} does not exist; expected a checkpoint directory or file")
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
    cache_root()/artifacts); later calls return the cached directory. `fresh` exports again. `refine`: the
    measured keep-float search (verify/sensitivity.refine) for fp16/int8; `openvino_ir`: with the OpenVINO IR
    (fp32); both part of the key."""
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
    ov = "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    source = preset if checkpoint is None else _checkpoint_key(checkpoint)
    measured = refine is not None and precision not in ("fp32", "int8-dynamic")
    # the key of cached_export (library versions and export source included), behind a name a person can read
    key = export_key(model, {"preset": preset, "checkpoint": checkpoint, "precision": precision, "opset": opset,
                             "attn_impl": attn_impl, "config_overrides": overrides or None, "measured": measured,
                             "openvino_ir": openvino_ir})
    assert key is not None  # every field above is keyable
    name = (f"{model}-{source}-{precision}{'-measured' if measured else ''}{'-ir' if openvino_ir else ''}-o{opset}-"
            f"{attn_impl or 'sdpa'}{ov}-{key.rsplit('-', 1)[1][:10]}")
    path = Path(root) / name if root is not None else cache_root() / "artifacts" / name
    if path.exists() and not fresh:
        try:
            load_artifact(path)
            return path
        except XDeployError:
            pass  # damaged cache entry: export again
    if log:
        log(f"exporting {model} {source} {precision} opset {opset} {attn_impl or 'sdpa'}{ov} -> {path}")
    kwargs: dict[str, Any] = {"config_overrides": dict(overrides)} if overrides else {}
    return export(model, preset=preset, checkpoint=checkpoint, out=path, opset=opset, precision=precision,
                  attn_impl=attn_impl, force=True, refine=refine, openvino_ir=openvino_ir, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# The export cache: `xdeploy export ... --out DIR` / api.export(...) a second time with the same inputs copies the
# first result instead of running torch again. Checked before torch is imported (api.export imports the exporter
# only on a miss). The key is a sha256 over everything the artifact depends on: the model and every export option,
# the checkpoint's files (names, sizes, modification times) or the preset, the calibration file's bytes, the
# versions of the libraries that write or measure the graphs, and the source of models/, export/, verify/ (the
# measured AMP / int8 sensitivity search), core/ and deploy/tokenizer_graph.py. Inputs that cannot be keyed
# (in-memory calibration data or AMP feeds, a custom tokenizer-graph builder) bypass the cache.

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


def export_key(model: str, options: Mapping[str, Any]) -> str | None:
    """The export cache key of `api.export(model, **options)` (plus `measured`), or None when an option cannot be
    keyed honestly (then the export runs and nothing is cached). `out` and `force` are not part of it."""
    import dataclasses
    import json
    import sys

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
    fields["libraries"] = _library_versions()
    fields["python"] = sys.version.split()[0]
    fields["source"] = export_source_hash()
    try:
        blob = json.dumps(fields, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        return None
    return f"{model}-{hashlib.sha256(blob.encode()).hexdigest()[:24]}"


def cached_export(model: str, options: Mapping[str, Any], run: Callable[[], Path], *, fresh: bool = False,
                  log: Callable[[str], None] | None = None) -> Path:
    """`run()` (the export into options["out"]) unless the export cache holds the same key: then that entry is
    copied into `out` (atomically, core/fsutil.atomic_dir; an existing `out` is refused without force, as the
    export does) and the copy's manifest and every sha256 are verified before it is renamed into place. A miss,
    a damaged entry or `fresh` runs the export and (re)stores its result in $XDEPLOY_CACHE/exports/."""
    import shutil

    from xdeploy.core.fsutil import atomic_dir
    from xdeploy.export.artifact import load_artifact

    key = export_key(model, options) if options.get("out") is not None else None
    if key is None:
        return run()
    out, entry = Path(options["out"]), cache_root() / "exports" / key
    limit = _mb_env("XDEPLOY_EXPORT_CACHE_MAX_MB", DEFAULT_ENTRY_MB)  # a bad setting: an error before any work
    _mb_env("XDEPLOY_EXPORT_CACHE_BUDGET_MB", DEFAULT_BUDGET_MB)
    if entry.is_dir() and not fresh:
        try:
            with atomic_dir(out, force=bool(options.get("force"))) as tmp:
                shutil.copytree(entry, tmp, dirs_exist_ok=True)
                load_artifact(tmp)  # manifest schema and every file's sha256: a damaged entry never lands
            with contextlib.suppress(OSError):
                os.utime(entry)  # recently used: the last to be evicted
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
        evict_exports(keep=entry)
    except (XDeployError, OSError) as e:
        if log:
            log(f"export cache: not stored ({e})")
    return path


# Size policy of the export cache: entries are full copies, so only small exports are kept (tiny and small
# presets: what tests, docs and quick runs repeat), and the folder is held under a budget, least recently used
# first out (a hit touches its entry).
DEFAULT_ENTRY_MB = 256.0
DEFAULT_BUDGET_MB = 2048.0


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


def evict_exports(keep: Path | None = None) -> list[Path]:
    """Remove the least recently used export-cache entries until the folder fits XDEPLOY_EXPORT_CACHE_BUDGET_MB
    (default 2048); `keep` (the entry just stored) is never removed. Returns the removed entries."""
    import shutil

    root = cache_root() / "exports"
    if not root.is_dir():
        return []
    budget = _mb_env("XDEPLOY_EXPORT_CACHE_BUDGET_MB", DEFAULT_BUDGET_MB)
    entries = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime)  # oldest use first
    sizes = {p: _dir_bytes(p) for p in entries}
    total, removed = sum(sizes.values()), []
    for p in entries:
        if total <= budget:
            break
        if keep is not None and p.resolve() == Path(keep).resolve():
            continue
        shutil.rmtree(p, ignore_errors=True)
        total -= sizes[p]
        removed.append(p)
    return removed
