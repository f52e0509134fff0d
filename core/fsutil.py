"""Crash-safe file output: everything is written to a temporary sibling and renamed into place.

A reader therefore sees either the previous complete file/directory or the new complete one, never a
half-written one, even if the writer is killed with SIGKILL.

Debris: a writer killed mid-write (SIGKILL, the OOM killer, a power cut) leaves its temporary sibling behind.
Temporaries are named after the target and the writing process, `.<name>.tmp-<pid>-<random>` (and, during
the swap of a directory, `.<name>.old-<pid>`), so the next write to the same target removes those whose
owner is gone before it starts (`clean_debris`): a target never has more than one temporary per live writer.
An `.old-<pid>` directory whose target is missing (killed between the two renames of the swap) is the previous
complete version and is renamed back instead of deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
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


# -------------------------------------------------------------------------------------------- space ----

def _existing(path: Path) -> Path:
    """`path`, or its nearest existing parent (what a directory about to be created will live on)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def require_space(needs: Mapping[str | os.PathLike[str], int], what: str) -> None:
    """Refuse `what` in one line when a filesystem lacks the space it is about to fill. `needs` maps each directory
    written under (it need not exist yet) to the bytes that will be; directories on one filesystem add up.

    Checked before the first byte: a disk that fills half way shows up as some library's parse error instead
    (onnx: "Error parsing message with type 'onnx.ModelProto'", OpenVINO: "basic_ios::clear: iostream error")."""
    by_fs: dict[int, tuple[list[Path], int, Path]] = {}
    for where, n in needs.items():
        if n <= 0:
            continue
        d = _existing(Path(where))
        dev = d.stat().st_dev
        paths, total, probe = by_fs.get(dev, ([], 0, d))
        by_fs[dev] = (paths + [Path(where)], total + int(n), probe)
    for paths, total, probe in by_fs.values():
        free = shutil.disk_usage(probe).free
        if free < total:
            raise XDeployError(
                f"not enough disk space for {what}: about {_size(total)} will be written under "
                f"{' and '.join(map(str, paths))}, and {_size(free)} is free there; expected that much "
                "free (free some space, or point --out / TMPDIR at another disk)")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------------------- debris ----

LEGACY_AGE_S = 3600.0  # temporaries of versions before the pid was in the name: removed once this old
_PID_SLACK_S = 2.0  # psutil's create_time is derived from boot time in whole seconds


def _tmp_prefix(name: str) -> str:
    return f".{name}.tmp-{os.getpid()}-"


def _owner_gone(pid: int, mtime: float) -> bool:
    """True when no live process can own a temporary last modified at `mtime` and named with `pid`.

    A pid is reused after its process dies; a process that started after the temporary's last modification
    cannot be the writer that modified it, so a reused pid is recognised by its start time."""
    import psutil

    if pid == os.getpid():
        return False
    try:
        started = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return True
    except (psutil.AccessDenied, OSError):
        return False  # someone else's live process: leave it
    return started > mtime + _PID_SLACK_S


def clean_debris(target: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporaries that killed writers left next to `target`; returns what was removed/restored.

    Only temporaries of this target whose owning process is gone are touched; a live writer's are left alone.
    Errors are ignored (a temporary that cannot be removed now is retried by the next write)."""
    target = Path(target)
    name = re.escape(target.name)
    current = re.compile(rf"^\.{name}\.(tmp|old)-(\d+)(-.*)?$")
    legacy = re.compile(rf"^\.{name}\.(tmp-[a-z0-9_]{{8}}|[a-z0-9_]{{8}}\.tmp)$")  # mkdtemp / mkstemp names
    done: list[Path] = []
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return done
    now = time.time()
    for e in entries:
        m = current.match(e.name)
        try:
            mtime = e.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        if m:
            if not _owner_gone(int(m.group(2)), mtime):
                continue
        elif not (legacy.match(e.name) and now - mtime > LEGACY_AGE_S):
            continue
        p = Path(e.path)
        with contextlib.suppress(OSError):
            if m and m.group(1) == "old" and not os.path.lexists(target):
                os.replace(p, target)  # killed between the swap's renames: this is the previous version
            elif e.is_dir(follow_symlinks=False):
                shutil.rmtree(p)
            else:
                os.unlink(p)
            done.append(p)
    return done


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        clean_debris(path)
        fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(path.name), dir=path.parent)
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
    Temporaries are named `.<name>.tmp-<pid>-*` and never mistaken for artifacts; those of killed writers
    are removed here, before this write begins (`clean_debris`).
    """
    final = Path(final)
    with contextlib.suppress(OSError):
        if final.parent.is_dir():
            clean_debris(final)
    if final.exists() and not force:
        raise XDeployError(f"{final} already exists; pass --force to replace it")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(final.name), dir=final.parent))
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
