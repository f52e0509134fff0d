"""The layout is the data path: imports run one way, core -> models -> export -> deploy -> verify -> bench ->
serve -> reports -> (pipeline, studies, api) -> commands -> cli, and no module imports itself in a circle.

Every import is read from the source (module level and inside functions alike), so a lazy import cannot
hide an upward edge."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each top-level folder X is the package xdeploy.X (pyproject.toml's package-dir); xdeploy/ holds the rest.
PACKAGES = ("core", "models", "export", "deploy", "verify", "bench", "serve", "reports", "studies")
# Lower number = lower layer. A module may import its own layer's package or any lower layer.
LAYER = {
    "xdeploy": 0, "xdeploy.core": 0, "xdeploy.models": 1, "xdeploy.export": 2, "xdeploy.deploy": 3,
    "xdeploy.verify": 4, "xdeploy.bench": 5, "xdeploy.serve": 6, "xdeploy.reports": 7,
    "xdeploy.pipeline": 8, "xdeploy.journal_run": 8, "xdeploy.memory_guard": 8, "xdeploy.studies": 8,
    "xdeploy.api": 8, "xdeploy.commands": 9, "xdeploy.cli": 10,
    "xdeploy.__main__": 10,
}


# Edges still to be removed (issue #14): each entry must still exist, so the list can only shrink.
KNOWN_UPWARD: set[str] = set()
KNOWN_CYCLES: set[str] = set()


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for folder in (*PACKAGES, "xdeploy"):
        pkg = "xdeploy" if folder == "xdeploy" else f"xdeploy.{folder}"
        for f in sorted((ROOT / folder).rglob("*.py")):
            rel = f.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = f
    return mods


def _layer(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in LAYER:
            return LAYER[key]
    raise AssertionError(f"module {module} has no layer: add its package to LAYER")


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = base[: len(base) - (node.level - 1)]
                mod = ".".join([*stem, node.module] if node.module else stem)
            else:
                mod = node.module or ""
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        for name in names:
            # the longest known module that the name starts with (a `from pkg import mod` names mod)
            parts = name.split(".")
            for n in range(len(parts), 0, -1):
                cand = ".".join(parts[:n])
                if cand in known:
                    if cand != module:
                        found.add(cand)
                    break
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, p, known) for m, p in mods.items()}


def test_every_package_has_a_layer_and_the_map_matches_pyproject() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    for folder in PACKAGES:
        assert f'"xdeploy.{folder}" = "{folder}"' in text, f"pyproject.toml does not map xdeploy.{folder}"
    for m in _modules():
        _layer(m)


def test_imports_never_run_upward() -> None:
    upward = sorted(f"{m} -> {d}" for m, deps in _graph().items() for d in deps if _layer(d) > _layer(m))
    assert set(upward) >= KNOWN_UPWARD, f"fixed, so drop from KNOWN_UPWARD: {KNOWN_UPWARD - set(upward)}"
    upward = [e for e in upward if e not in KNOWN_UPWARD]
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    graph = _graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d == m or d.startswith(m + ".") or m.startswith(d + "."):
                continue  # a package and its own modules
            if state.get(d) == 1:
                ring = stack[stack.index(d):]
                k = ring.index(min(ring))  # canonical: start at the smallest name
                cycles.append(ring[k:] + ring[:k] + [ring[k]])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    found = {" -> ".join(c) for c in cycles}
    assert found >= KNOWN_CYCLES, f"fixed, so drop from KNOWN_CYCLES: {KNOWN_CYCLES - found}"
    found -= KNOWN_CYCLES
    assert not found, "import cycles:\n" + "\n".join(sorted(found))


def test_the_checker_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The graph reader must catch an upward import hidden inside a function and a relative one."""
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from xdeploy.pipeline import run_job\nfrom .base import Runner\n")
    deps = _imports("xdeploy.deploy.m", f, {"xdeploy.pipeline", "xdeploy.deploy.base", "xdeploy.deploy.m"})
    assert deps == {"xdeploy.pipeline", "xdeploy.deploy.base"}
