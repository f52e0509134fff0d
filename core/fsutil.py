"""Crash-safe file output: everything is written to a temporary sibling and renamed into place.

A reader therefore sees either the previous complete file/directory or the new complete one, never a
half-written one, even if the writer is killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise XDeployError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp creates 0600; give the usual permissions
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise XDeployError(f"cannot write {path}: {e.strerror or e}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n")


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike[str], *, force: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory next to `final`; on success it replaces `final` atomically.

    Without `force` an existing `final` is refused. With `force` the old directory is swapped out only
    after the new one is complete, so a crash at any point leaves the old one (or nothing) in place.
    Stale temporaries of killed writers are named `.<name>.tmp-*` and never mistaken for artifacts.
    """
    final = Path(final)
    if final.exists() and not force:
        raise XDeployError(f"{final} already exists; pass --force to replace it")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        tmp.chmod(0o777 & ~_umask())
    except OSError as e:
        raise XDeployError(f"output directory {final.parent} is not writable: {e.strerror or e}") from None
    try:
        yield tmp
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise XDeployError(f"cannot write {final}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
