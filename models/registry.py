"""The model registry: adding a model = one file with a `FAMILY` + one line here.

Code that works over "every model" iterates `MODELS` and asks each family what it can do (`capabilities`:
role, feeds, token axis; `quick`/`full` presets; `config_sweep`), never a list of names. The order here is
the order of the main job and its report.

`build` gives seeded random weights, unless the config names trained weights (its `weights` field: a safetensors
file in models/weights/, written by studies/train_tiny.py), which it loads with the checkpoint importer's strict
`load_state`: how a trained tiny preset gets real margins while its "tiny-random" twin keeps random weights."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from xdeploy.core.errors import XDeployError, one_of

from . import bert, gpt, transformer, vit
from .attention import ATTENTION_IMPLS
from .spec import Dims, ModelFamily

MODELS: dict[str, ModelFamily] = {
    f.name: f for f in (bert.FAMILY, gpt.FAMILY, vit.FAMILY, transformer.FAMILY)
}

# Trained preset weights, shipped as package data: a config whose `weights` field names a file here is built with it.
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"


def get_family(name: str) -> ModelFamily:
    if name not in MODELS:
        raise one_of("model", name, MODELS)
    return MODELS[name]


def family_of(cfg: Any) -> ModelFamily:
    """The registered family whose configs are of `cfg`'s class (an artifact's or a preset's config)."""
    for f in MODELS.values():
        if type(cfg) is f.config_type:
            return f
    raise XDeployError(f"no registered model family has configs of type {type(cfg).__name__}")


def dims(cfg: Any) -> Dims:
    """The sizes `cfg`'s family declares for it (layers, width, heads, KV cache): what estimates read."""
    return family_of(cfg).dims(cfg)


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
        out = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    except (TypeError, ValueError) as e:  # an unknown field, or a value the config's own checks refuse
        raise XDeployError(f"{model} {preset}: {e}") from None
    if getattr(cfg, "weights", None) and overrides.get("weights") is None \
            and dataclasses.replace(out, attn_impl=cfg.attn_impl) != cfg:
        # trained weights fit the preset's own shapes only: a config changed beyond the attention kernel (the
        # scaling sweep grows max_positions and cuts layers) is built with seeded random weights instead
        out = dataclasses.replace(out, weights=None)
    return out


_META_BUILD = threading.Lock()  # a shape-only build (on_meta) and a seeded one never overlap


def build(model: str, cfg: Any, *, seed: int = 0) -> nn.Module:
    """A reference model in eval mode: with the trained weights its config names (`cfg.weights`, a file in
    WEIGHTS_DIR: the tiny presets), otherwise with seeded random weights (deterministic for a torch version)."""
    with _META_BUILD:  # not while another thread's on_meta() has the initializers swapped out
        torch.manual_seed(seed)
        module = get_family(model).build(cfg).eval()
    name = getattr(cfg, "weights", None)
    if name:
        path = WEIGHTS_DIR / name
        if Path(name).name != name or path.suffix != ".safetensors":
            raise XDeployError(f"{model} config names weights {name!r}; expected a .safetensors file name in "
                               f"{WEIGHTS_DIR}")
        # a missing file is an error, not a silent fall-back to random weights that the manifest would still
        # record as trained
        redo = f"restore the file from git or retrain: python -m xdeploy.studies.train_tiny --model {model}"
        if not path.is_file():
            raise XDeployError(f"trained weights {path} are missing ({redo})")
        try:
            load_state(module, read_safetensors(path), source=str(path))
            check_finite(module, source=str(path))
        except XDeployError as e:
            raise XDeployError(f"{e} ({redo})") from None
    return module


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Modules built in this block are shapes only: on the meta device, with torch.nn.init's initializers left out.
    Why leave them out: a meta tensor's normal_/uniform_ is one of torch's Python reference kernels, whose first
    call imports torch._dynamo (1.9 of a 4.0 s PyTorch benchmark child here, every process that loads a reference
    model), and there is nothing to initialize on meta. The initializers are module attributes, looked up at each
    call (nn.Linear.reset_parameters: `init.kaiming_uniform_`), so they are swapped for the block, under a lock;
    a model initializing through a tensor method instead still builds right, only slower."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")
             and callable(getattr(nn.init, n))]
    skip: Callable[..., Any] = lambda tensor, *args, **kwargs: tensor  # noqa: E731
    with _META_BUILD:
        saved = {n: getattr(nn.init, n) for n in names}
        try:
            for n in names:
                setattr(nn.init, n, skip)
            with torch.device("meta"):
                yield
        finally:
            for n, f in saved.items():
                setattr(nn.init, n, f)


def param_count(model: str, cfg: Any) -> int:
    with on_meta():  # count without allocating (BERT-base would cost 440 MB otherwise)
        module = get_family(model).build(cfg)
    return sum(p.numel() for p in module.parameters())


def describe(model: str, preset: str) -> dict[str, Any]:
    family = get_family(model)
    cfg = family.presets[preset]
    spec = family.spec(cfg)
    sizes = {name: axis.opt for name, axis in spec.axes.items()}
    return {"model": model, "preset": preset, "params": param_count(model, cfg),
            "flops": family.flops(cfg, sizes), "flops_at": sizes, "config": dataclasses.asdict(cfg)}


def check_finite(module: nn.Module, *, source: str | None = None) -> None:
    for name, p in module.state_dict().items():
        if p.is_floating_point() and not torch.isfinite(p).all():
            raise XDeployError(f"weight {name!r}{f' in {source}' if source else ''} contains NaN or Inf values")


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (never a pickle: unpickling runs code), or a one-line error naming it."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise XDeployError(f"cannot read {path}: {first}") from None


def build_loaded(family: ModelFamily, cfg: Any, state: dict[str, torch.Tensor], *, source: str) -> nn.Module:
    """`family`'s module of `cfg` in eval mode holding `state` (a checkpoint's or an artifact's reference weights).
    The shapes are checked on the meta device first: a config that does not fit the weights (a manifest or a
    config.json asking for a vocabulary of 10^12) is one line naming the tensor, not an allocation of terabytes."""
    with on_meta():
        check_state(family.build(cfg), state, source=source)
    module = family.build(cfg).eval()
    load_state(module, state, source=source)
    return module


def load_state(module: nn.Module, state: dict[str, torch.Tensor], *, source: str) -> None:
    """Strict load with errors that name the tensor (and both shapes when they differ)."""
    check_state(module, state, source=source)
    expected = module.state_dict()
    module.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)


def check_state(module: nn.Module, state: dict[str, torch.Tensor], *, source: str) -> None:
    """`state` has exactly `module`'s tensors at its shapes, or a one-line error naming the first that differs."""
    expected = module.state_dict()
    for name, ref in expected.items():
        if name not in state:
            raise XDeployError(f"{source} is missing tensor {name!r} (shape {tuple(ref.shape)})")
        got = state[name]
        if tuple(got.shape) != tuple(ref.shape):
            raise XDeployError(f"tensor {name!r} in {source} has shape {tuple(got.shape)}; "
                               f"the model expects {tuple(ref.shape)}")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise XDeployError(f"{source} has {len(extra)} tensor(s) the model does not use, e.g. {extra[0]!r}")
