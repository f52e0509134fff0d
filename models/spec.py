"""What each model declares next to its code: its graphs, dynamic axes, tolerances, FLOPs, presets.

These records are plain frozen dataclasses of numbers and names: the exporter, the runners, parity and the
benchmarks all read the same declaration, so a model is added by writing one file and one registry line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PRECISIONS = ("fp32", "fp16", "bf16", "int8")


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output. `dims` holds axis names (dynamic) or ints (fixed)."""

    name: str
    dtype: str  # numpy dtype name: "int64", "float32", "float16"
    dims: tuple[str | int, ...]
    kind: str = "float"  # how example inputs are drawn: ids | mask | positions | zeros | float
    high: int = 0  # exclusive upper bound for kind="ids"


@dataclass(frozen=True)
class Axis:
    """Range of a dynamic axis: the exporter, runner validation and TensorRT profiles all use it."""

    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.opt <= self.max:
            raise ValueError(f"axis range must satisfy 1 <= min <= opt <= max, got {self}")


@dataclass(frozen=True)
class Graph:
    """One exported graph: `method` names the model method whose positional args are `inputs`."""

    name: str
    method: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class Tolerance:
    """A candidate passes when max|a-b| <= atol + rtol*|ref| elementwise OR its cosine >= `cosine`
    (fp16/int8 graphs are judged on direction, fp32 on values)."""

    atol: float
    rtol: float
    cosine: float


DEFAULT_TOLERANCES: Mapping[str, Tolerance] = {
    "fp32": Tolerance(atol=1e-4, rtol=1e-3, cosine=0.99999),
    "bf16": Tolerance(atol=5e-2, rtol=5e-2, cosine=0.995),
    "fp16": Tolerance(atol=1e-2, rtol=1e-2, cosine=0.999),
    "int8": Tolerance(atol=1e-1, rtol=1e-1, cosine=0.98),
}


@dataclass(frozen=True)
class ExportSpec:
    graphs: tuple[Graph, ...]
    axes: Mapping[str, Axis]
    tolerances: Mapping[str, Tolerance] = field(default_factory=lambda: dict(DEFAULT_TOLERANCES))

    def graph(self, name: str) -> Graph:
        for g in self.graphs:
            if g.name == name:
                return g
        raise KeyError(name)


@dataclass(frozen=True)
class HFImport:
    """How a Hugging Face checkpoint maps onto the reference model."""

    model_types: tuple[str, ...]  # config.json "model_type" values accepted
    config: Callable[[Mapping[str, Any]], Any]  # HF config dict -> our config
    state_dict: Callable[[Mapping[str, Any], Any], dict[str, Any]]  # HF tensors, our config -> our state dict


@dataclass(frozen=True)
class ModelFamily:
    name: str
    description: str
    presets: Mapping[str, Any]  # preset name -> frozen config dataclass
    build: Callable[[Any], Any]  # config -> torch.nn.Module
    spec: Callable[[Any], ExportSpec]
    flops: Callable[[Any, Mapping[str, int]], float]  # analytic FLOPs of graph "model" at these axis sizes
    hf: HFImport | None = None


def layer_flops(t: int, s: int, d: int, d_ff: int, cross_s: int = 0) -> float:
    """Multiply-add FLOPs (2 per MAC) of one layer with T queries over S keys.

    q,k,v,o projections 8·T·d², feed-forward 4·T·d·d_ff (= 16·T·d² when d_ff = 4d, giving the classic
    24·T·d²), scores and weighted sum 4·T·S·d; a cross-attention block adds 4·T·d² + 4·S·d² + 4·T·S·d.
    """
    f = 8.0 * t * d * d + 4.0 * t * d * d_ff + 4.0 * t * s * d
    if cross_s:
        f += 4.0 * t * d * d + 4.0 * cross_s * d * d + 4.0 * t * cross_s * d
    return f


def make_feeds(graph: Graph, sizes: Mapping[str, int], seed: int = 0, *, pad: bool = True,
               empty_row: bool = False) -> dict[str, np.ndarray]:
    """Seeded example inputs for `graph` at the given axis sizes.

    With `pad` and batch > 1 the last row is right-padded to ~half its length (padding must not change the
    other rows); `empty_row` also fully pads row 0 (the fp16-softmax/SDPA NaN trap).
    """
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for t in graph.inputs:
        shape = tuple(d if isinstance(d, int) else int(sizes[d]) for d in t.dims)
        if t.kind == "ids":
            a = rng.integers(0, t.high, size=shape)
        elif t.kind == "mask":
            a = np.ones(shape)
            if pad and shape[0] > 1:
                a[-1, max(1, shape[-1] // 2):] = 0
            if empty_row and shape[0] > 1:
                a[0, :] = 0
        elif t.kind == "positions":
            # the step's position: at most cache - 1, so a full-capacity cache never indexes past max_positions
            a = np.full(shape, max(sizes.get("cache", 1) - 1, 0))
        elif t.kind == "zeros":
            a = np.zeros(shape)
        else:
            a = rng.standard_normal(shape)
        feeds[t.name] = np.ascontiguousarray(a.astype(t.dtype))
    return feeds
