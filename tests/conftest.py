"""Fixtures shared by every test module.

`tiny_export`: a preset artifact exported once per test session and shared by every module that exports the
same thing. torch.onnx's dynamo export is the dominant cost of most tests; the same tiny BERT used to be exported
by a dozen modules, then once per pytest-xdist worker: now one export serves both workers (an export cache folder,
export/cache.py `cached_artifact`, of the session's own, in the base temporary directory the workers share). A
shared artifact is read-only: a test that changes an artifact's files exports or copies its own. That is
enforced, not assumed: every shared artifact's files are hashed when first used and again at the end of the
session, and a change fails the session naming the artifact."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from xdeploy.core.deps import import_quietly

# test modules import openvino themselves (pytest.importorskip at collection): openvino is imported here first,
# through xdeploy's import, so the conversions the tests run in this process send no telemetry either (each
# event forks the process; core/deps.py import_quietly)
with contextlib.suppress(ImportError):
    import_quietly("openvino")


def _digest(root: Path) -> str:
    """sha256 over every file's relative path and bytes (tiny artifacts: a few MB)."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Path]]:
    """(model, preset="tiny", opset=default, precision="fp32") -> the artifact `export` writes for those
    arguments, exported on first use and then shared. Do not modify it: copy it (shutil.copytree) first."""
    from xdeploy.export.cache import cached_artifact
    from xdeploy.export.onnx_export import DEFAULT_OPSET

    # under pytest-xdist each worker's base temporary directory (popen-gwN) sits in the session's, which both
    # share; the session's own folder, not $XDEPLOY_CACHE: nothing but this fixture writes its entries
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-artifacts"
    root.mkdir(exist_ok=True)
    made: dict[tuple[str, str, int, str], tuple[Path, str]] = {}

    def get(model: str, preset: str = "tiny", opset: int = DEFAULT_OPSET, precision: str = "fp32") -> Path:
        key = (model, preset, opset, precision)
        if key not in made:
            # one export per key for both xdist workers: the other one waits for it and then finds the entry
            # (never two exports of one entry, the second replacing the first under the tests that read it)
            with open(root / f".tiny-export-{model}-{preset}-{opset}-{precision}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                path = cached_artifact(model, preset=preset, opset=opset, precision=precision, root=root)
            made[key] = path, _digest(path)
        return made[key][0]

    yield get
    changed = [f"{k} at {p}" for k, (p, d) in made.items() if _digest(p) != d]
    assert not changed, f"a test modified a shared artifact (copy it before changing it): {changed}"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test` runs `-n 2 --dist loadgroup`): a test that uses a module-scoped fixture
    (an export, a server, a reference run) is grouped with the rest of its module, so that fixture is built by
    one worker, once; a test without one (e.g. each executable-docs page) is scheduled on its own, so one long
    module does not become the critical path. Without xdist the mark is inert.

    The executable-docs pages are the longest single tests (seconds to minutes each): they are moved to the front,
    biggest page first, so the many short tests fill in behind them (the last test to finish is a short one, not a
    page that started late while the other worker idled). Under `--dist loadgroup` pytest-xdist then hands out the
    module groups first, largest (by number of tests) first (its default --loadscope-reorder), and the units of
    one test after them in this order: the pages start once the big groups are out, ahead of the short tests
    (docs/testing.md, "Scheduling")."""
    def page_cost(item: pytest.Item) -> int:
        """A page's processes (each starts Python, most import torch and export): command lines in its fenced
        shell blocks plus its Python blocks; -1 for a test that is not a page."""
        page = getattr(getattr(item, "callspec", None), "params", {}).get("page")
        if not isinstance(page, Path):
            return -1
        fenced = re.findall(r"^```(\w+)\n(.*?)^```", page.read_text(encoding="utf-8"), re.S | re.M)
        return sum(len(re.findall(r"^\s*(?:xdeploy|make|python3?|\.venv/bin/\S+)\s", code, re.M)) if lang in
                   ("sh", "bash", "shell") else 1 if lang in ("python", "py") else 0 for lang, code in fenced)

    cost = {item.nodeid: page_cost(item) for item in items}
    items.sort(key=lambda it: -cost[it.nodeid] if cost[it.nodeid] >= 0 else 1)  # stable: the rest keep order
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else None
        shared = defs is None or any(d.scope in ("module", "class", "package") for ds in defs for d in ds)
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


def pytest_configure(config: pytest.Config) -> None:
    """Refuse `--dist loadgroup` where pytest-xdist cannot group: it marks a grouped test by appending "@<group>" to
    its node id, which pytest 9.2's structured node ids ignore (pytest-dev/pytest-xdist#1386, xdist 3.8.0), so every
    group is silently split and both workers build the same module fixtures (measured: the generation-peers
    fixture twice, 32 + 30 s). constraints.txt pins pytest 9.1.1."""
    from importlib.metadata import version

    from packaging.version import Version  # a dependency of pytest itself

    if getattr(config.option, "dist", None) == "loadgroup" and Version(pytest.__version__) >= Version("9.2") \
            and Version(version("pytest-xdist")) <= Version("3.8.0"):
        raise pytest.UsageError(f"pytest-xdist {version('pytest-xdist')} --dist loadgroup does not group tests with "
                                f"pytest {pytest.__version__} (pytest-dev/pytest-xdist#1386); expected pytest < 9.2 "
                                "(constraints.txt: run make install)")
