"""The model registry: adding a model = one file with a `FAMILY` + one line here.

Code that works over "every model" iterates `MODELS` and asks each family what it can do (`capabilities`:
role, feeds, token axis; `quick`/`full` presets; `config_sweep`), never a list of names. The order here is
the order of the main job and its report."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from xdeploy.core.errors import XDeployError, one_of

from . import bert, gpt, transformer, vit
from .attention import ATTENTION_IMPLS
from .spec import ModelFamily

MODELS: dict[str, ModelFamily] = {
    f.name: f for f in (bert.FAMILY, gpt.FAMILY, vit.FAMILY, transformer.FAMILY)
}


def get_family(name: str) -> ModelFamily:
    if name not in MODELS:
        raise one_of("model", name, MODELS)
    return MODELS[name]


def families(*, role: str | None = None, generates: bool | None = None, token_axis: bool | None = None
             ) -> list[ModelFamily]:
    """The registered families (in registry order) with the given capabilities."""
    return [f for f in MODELS.values()
            if (role is None or f.capabilities.role == role)
            and (generates is None or f.capabilities.generates == generates)
            and (token_axis is None or (f.capabilities.token_axis is not None) == token_axis)]


def get_config(model: str, preset: str, **overrides: Any) -> Any:
    family = get_family(model)
    if preset not in family.presets:
        raise one_of(f"preset for {model}", preset, family.presets)
    cfg = family.presets[preset]
    if overrides.get("attn_impl") not in (None, *ATTENTION_IMPLS):
        raise one_of("attention implementation", overrides["attn_impl"], ATTENTION_IMPLS)
    try:
        return dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    except (TypeError, ValueError) as e:  # an unknown field, or a value the config's own checks refuse
        raise XDeployError(f"{model} {preset}: {e}") from None


def build(model: str, cfg: Any, *, seed: int = 0) -> nn.Module:
    """A reference model in eval mode with seeded random weights (deterministic for a torch version)."""
    torch.manual_seed(seed)
    return get_family(model).build(cfg).eval()


def param_count(model: str, cfg: Any) -> int:
    with torch.device("meta"):  # count without allocating (BERT-base would cost 440 MB otherwise)
        module = get_family(model).build(cfg)
    return sum(p.numel() for p in module.parameters())


def describe(model: str, preset: str) -> dict[str, Any]:
    family = get_family(model)
    cfg = family.presets[preset]
    spec = family.spec(cfg)
    sizes = {name: axis.opt for name, axis in spec.axes.items()}
    return {"model": model, "preset": preset, "params": param_count(model, cfg),
            "flops": family.flops(cfg, sizes), "flops_at": sizes, "config": dataclasses.asdict(cfg)}


def check_finite(module: nn.Module) -> None:
    for name, p in module.state_dict().items():
        if p.is_floating_point() and not torch.isfinite(p).all():
            raise XDeployError(f"weight {name!r} contains NaN or Inf values")
