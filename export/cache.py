"""The one artifact cache: export a model once per key, reuse the directory while it still loads and verifies.

    from xdeploy.export.cache import cached_artifact
    path = cached_artifact("bert", preset="tiny", precision="int8")                  # $XDEPLOY_CACHE/artifacts/...
    path = cached_artifact("bert", checkpoint="ckpt/minilm", root="artifacts/embed")  # a study's own folder

The key holds everything that changes the graph: model, preset (or the checkpoint's file names, sizes and
modification times), precision, opset, attention kernel, config overrides that differ from the preset, and a
hash of the model/export source, so a changed exporter never serves a stale graph. A damaged entry (it no longer
loads or its sha256s do not match) is exported again. Used by `xdeploy bench`/`scale` (bench/suite.py) and the
studies (studies/*.py).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError


def cache_root() -> Path:
    """$XDEPLOY_CACHE, else ~/.cache/xdeploy: artifacts, the roofline, compiled-model caches."""
    return Path(os.environ.get("XDEPLOY_CACHE") or Path.home() / ".cache" / "xdeploy")


def source_hash() -> str:
    """Hash of the model and export source: a cached artifact is reused only if these files are unchanged."""
    import xdeploy.export
    import xdeploy.models

    h = hashlib.sha256()
    for pkg in (xdeploy.models, xdeploy.export):
        for p in sorted(Path(pkg.__path__[0]).glob("*.py")):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:10]


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
                    fresh: bool = False, log: Callable[[str], None] | None = None, refine: Any = None) -> Path:
    """Export `model` (a preset, default its first; or a `checkpoint`) once per key under `root` (default
    cache_root()/artifacts); later calls return the cached directory. `fresh` exports again. `refine`: the
    measured keep-float search (verify/sensitivity.refine) for fp16/int8; part of the key."""
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
    measured = "-measured" if refine is not None and precision not in ("fp32", "int8-dynamic") else ""
    name = f"{model}-{source}-{precision}{measured}-o{opset}-{attn_impl or 'sdpa'}{ov}-{source_hash()}"
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
                  attn_impl=attn_impl, force=True, refine=refine, **kwargs)
