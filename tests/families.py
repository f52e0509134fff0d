"""Tests parametrize over the model registry, never over a list of names: every family, or those with a
capability (`generates`, `role`, `token_axis`), each at its smallest preset.

A family whose smallest preset has three or more graphs (an encoder-decoder: model, encoder, decode) costs the
most to export and check; where a test says so, its cases are marked `slow`."""

from __future__ import annotations

from typing import Any

import pytest

from xdeploy.models.registry import MODELS, families, get_config


def names(**caps: Any) -> list[str]:
    """Registered model names (registry order), optionally only those with the given capabilities."""
    return [f.name for f in families(**caps)]


def first(**caps: Any) -> str:
    """The first registered model with the given capabilities (e.g. first(generates=True))."""
    found = names(**caps)
    if not found:
        pytest.skip(f"no registered model with {caps}")
    return found[0]


def smallest(model: str) -> str:
    return MODELS[model].smallest_preset


def n_graphs(model: str) -> int:
    return len(MODELS[model].spec(get_config(model, smallest(model))).graphs)


def params(*, slow_when_many_graphs: bool = False, **caps: Any) -> list[Any]:
    """pytest params over the registry; with `slow_when_many_graphs` the 3+-graph families are marked slow."""
    return [pytest.param(m, marks=[pytest.mark.slow] if slow_when_many_graphs and n_graphs(m) >= 3 else [], id=m)
            for m in names(**caps)]
