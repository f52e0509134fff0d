"""What each model declares next to its code: its graphs, dynamic axes, tolerances, FLOPs, presets.

These records are plain frozen dataclasses of numbers and names: the exporter, the runners, parity and the
benchmarks all read the same declaration, so a model is added by writing one file and one registry line.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError
from xdeploy.core.memory import system_available

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int8-dynamic")  # compute precisions (tolerance keys)
# What an artifact holds: int8 = static Q/DQ (calibrated), int8-dynamic = onnxruntime dynamic quantization.
ARTIFACT_PRECISIONS = ("fp32", "fp16", "int8", "int8-dynamic")


# The element types a graph's inputs and outputs may have (numpy names): what the runners feed and read, manifests
# may declare (export/artifact.py), foreign graphs may take (export/onnx_graph.py) and golden probes may hold.
# Not float64: a foreign float64 graph would be labelled fp32 and "converted" to fp16 or int8 without a change.
DTYPES = ("int64", "int32", "float32", "float16", "bool")

# The additive attention bias of a masked key (models/attention.py): finite and representable in fp16. Here, not
# beside the torch attention, because runtime code that builds masks for the exported graphs (deploy/ort_cache.py)
# must not import torch.
MASK_VALUE = -1.0e4


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output. `dims` holds axis names (dynamic) or ints (fixed)."""

    name: str
    dtype: str  # numpy dtype name, one of DTYPES
    dims: tuple[str | int, ...]
    kind: str = "float"  # how example inputs are drawn: ids | mask | positions | zeros | float
    high: int = 0  # exclusive upper bound for kind="ids"
    # an output whose size-1 axis is the last position of this input axis (a decode step's logits: the graph's
    # contract is a real last token, left padding): it means something only where the masks mark that position
    last_of: str = ""


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
    """One exported graph: `method` names the model method whose positional args are `inputs`. `decode_step`: the
    graph is a decoding loop's step (a token or a few per call), so its matrix products read every weight once
    per token and memory bandwidth bounds them, not arithmetic (int8-dynamic picks its weight type by it)."""

    name: str
    method: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    decode_step: bool = False


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
    "int8-dynamic": Tolerance(atol=1e-1, rtol=1e-1, cosine=0.98),
}


@dataclass(frozen=True)
class EngineCache:
    """A decoder's step in the form an engine that keeps the KV cache itself runs (an OpenVINO stateful model:
    export/openvino_ir.py, deploy/ov_runner.py). `graph` takes the step's ids and positions, `mask` (B, P + S)
    over the cached and the new positions, and per layer `{past}.<i>.key` / `.value` (B, nh, P, hs); it returns
    the last token's logits and per layer `{present}.<i>.key` / `.value` (B, nh, P + S, hs), the cache grown by
    the step, which the engine stores in place of the past. It computes what graph `replaces` computes, the
    cache concatenated instead of attended beside (models/attention.py `append`). Only an OpenVINO IR of it is
    written: an ONNX graph would be another copy of the weights that no runtime here reads. `past_axis` and
    `total_axis` (P and P + S) are not artifact axes: the engine sizes them itself."""

    graph: Graph
    replaces: str = "decode"
    mask: str = "attention_mask"
    past: str = "past"
    present: str = "present"
    beam: str = "beam_idx"  # the engine's input (N,) int32 that picks each row's cache before a step (beam search)
    past_axis: str = "past"
    total_axis: str = "total"

    def state_pairs(self) -> tuple[tuple[str, str], ...]:
        """(past input, present output) per cached tensor, layer-major as `cache_names`."""
        layers = sum(t.name.startswith(f"{self.past}.") for t in self.graph.inputs) // 2
        return tuple(zip(cache_names(self.past, layers), cache_names(self.present, layers)))


@dataclass(frozen=True)
class ExportSpec:
    graphs: tuple[Graph, ...]
    axes: Mapping[str, Axis]
    tolerances: Mapping[str, Tolerance] = field(default_factory=lambda: dict(DEFAULT_TOLERANCES))
    engine_cache: EngineCache | None = None  # a decoder's step for engines that hold the cache (OpenVINO IR only)

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


ROLES = ("encoder", "decoder", "encoder-decoder")


@dataclass(frozen=True)
class TextFeeds:
    """What the Embedder (deploy/embedder.py) feeds a text encoder's graph "model" and pools from it."""

    ids: str = "input_ids"
    mask: str | None = "attention_mask"  # None: the graph takes no mask
    type_ids: str | None = "token_type_ids"  # None: no segment ids
    hidden: str = "last_hidden_state"  # (batch, seq, d) per-token states to pool


@dataclass(frozen=True)
class DecoderFeeds:
    """The graphs and names the KV-cache decoding loop (deploy/generate.py) binds.

    decoder:         either `prefill_graph` on the prompt -> logits + the prompt's KV (`present`), copied into the
                     cache; or, with `step_mask`, the decode graph itself (prefill_graph == decode_graph): the prompt
                     is one step of T tokens against an empty cache (one graph: one copy of the weights per engine)
    encoder-decoder: `prefill_graph` (the encoder) on the source -> `memory`, which every decode step reads
                     beside the source mask (`prompt_mask`)
    Both then run `decode_graph` one token at a time: step_ids, positions, the cache, cache_mask (+ step_mask,
    + memory) in; logits and the step's new_kv out. `full_graph` recomputes everything (use_cache=False).

    The cache is one input per layer and tensor, `{cache}.{i}.key` / `{cache}.{i}.value` (B, nh, C, hs)
    (`cache_inputs`), bound as views of one (L, 2, B, nh, C, hs) buffer: each attention reads the caller's
    memory where it lies. (Exports before this had one (L, 2, B, nh, C, hs) input named `cache`, which
    onnxruntime copied twice per step to slice it: 1.9 ms of a 29 ms GPT-2 small step at 159 slots, 5.5 ms at
    512, Zen 3; the decoding loop still runs them.)"""

    prompt_ids: str  # prompt (decoder) / source (encoder-decoder) ids, in the prefill and the full graph
    prompt_mask: str
    step_ids: str  # the decode graph's new-token ids
    prefill_graph: str = "model"
    decode_graph: str = "decode"
    full_graph: str = "model"
    present: str | None = None  # decoder with a separate prefill graph: its KV output
    step_mask: str | None = None  # decode graph input (B, S) masking a step's padding: it can prefill the prompt
    memory: str | None = None  # encoder-decoder: encoder output = decode input of this name
    target_ids: str | None = None  # encoder-decoder: the full graph's target ids / mask (recompute mode)
    target_mask: str | None = None
    positions: str = "position_ids"
    cache: str = "cache"
    cache_mask: str = "cache_mask"
    logits: str = "logits"
    new_kv: str = "new_kv"

    def cache_names(self, layers: int) -> tuple[str, ...]:
        """The decode graph's cache inputs, layer-major: layer 0's key, layer 0's value, layer 1's key, ..."""
        return cache_names(self.cache, layers)

    def held(self) -> tuple[str, ...]:
        """Decode inputs fixed for a whole sequence (an encoder-decoder's memory and source mask): an engine
        that keeps the cache holds them once per sequence (deploy/base.py CachedStep.hold)."""
        return (self.memory, self.prompt_mask) if self.memory else ()


@dataclass(frozen=True)
class Vocabulary:
    """The token facts a decoding loop reads from a model's config: how many ids there are, how many positions a
    sequence may fill, and the special ids. Read from the manifest's "config" by these field names (every
    generating family's config has `vocab_size`, `max_positions`, `eos_token_id`; an encoder-decoder's also
    `bos_token_id`, the first target token), so generation from an artifact needs no model code and no torch."""

    size: int
    max_positions: int
    eos_token_id: int
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any], role: str) -> Vocabulary:
        """Parse a manifest's config (untrusted: raises ValueError naming the field and what was expected)."""
        def field_of(name: str, required: bool) -> int | None:
            v = config.get(name)
            if v is None and not required:
                return None
            if not isinstance(v, int) or isinstance(v, bool):  # worded as export/artifact.py parse_config says it
                raise ValueError(f"config field {name!r} is {v!r}; expected int")
            if v < 0:
                raise ValueError(f"config field {name!r} is {v}; expected an int >= 0")
            return v

        size = field_of("vocab_size", True)
        out = cls(size=size, max_positions=field_of("max_positions", True),  # type: ignore[arg-type]
                  eos_token_id=field_of("eos_token_id", True),  # type: ignore[arg-type]
                  bos_token_id=field_of("bos_token_id", role == "encoder-decoder"),
                  pad_token_id=field_of("pad_token_id", False))
        if size < 1 or out.max_positions < 1:
            raise ValueError(f"config has vocab_size {size} and max_positions {out.max_positions}; expected >= 1")
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            v = getattr(out, name)
            if v is not None and v >= size:
                raise ValueError(f"config field {name!r} is {v}; expected an id below vocab_size {size}")
        return out


Monomial = tuple[tuple[str, int], ...]  # token axes and their powers, e.g. (("seq", 2),); () is the constant


@dataclass(frozen=True)
class Cost:
    """A model's FLOPs per call as its artifact's manifest records them ("cost"), so that a benchmark of the artifact
    needs no model code (and no torch): per batch row, a polynomial of degree <= 2 in the token axes -- what every
    family's `flops` is (the products linear in the tokens, attention's scores and mixing quadratic) -- and the
    token count of a model whose config fixes it (ViT's patches). `fit` reads it off the family's own `flops`."""

    terms: tuple[tuple[Monomial, float], ...]
    fixed_tokens: int | None = None

    def flops(self, sizes: Mapping[str, int]) -> float:
        return float(sizes["batch"]) * sum(c * math.prod(float(sizes[a]) ** e for a, e in m) for m, c in self.terms)

    @classmethod
    def fit(cls, flops: Callable[[Mapping[str, int]], float], axes: Sequence[str], fixed_tokens: int | None = None
            ) -> Cost | None:
        """The polynomial that `flops(sizes)` is, from its values on a grid of token counts, or None where it is not
        one (checked off the grid and at another batch): the family's own function stays the reference."""
        monos: list[Monomial] = [(), *(((a, 1),) for a in axes), *(((a, 2),) for a in axes),
                                 *(((a, 1), (b, 1)) for i, a in enumerate(axes) for b in axes[i + 1:])]
        grid = [dict(zip(axes, v)) for v in np.array(np.meshgrid(*[[7, 19, 64]] * len(axes))).reshape(len(axes), -1).T
                ] if axes else [{}]

        def row(point: Mapping[str, int]) -> list[float]:
            return [math.prod(float(point[a]) ** e for a, e in m) for m in monos]

        try:
            y = np.array([flops({"batch": 1} | {a: int(v) for a, v in p.items()}) for p in grid], dtype=np.float64)
            coef = np.linalg.lstsq(np.array([row(p) for p in grid]), y, rcond=None)[0]
            # FLOP counts are whole numbers: snap the solver's rounding (1e-8 where a term is absent, 262144.000006)
            coef = [float(round(c)) if abs(c - round(c)) <= 1e-6 * max(1.0, abs(c)) else float(c) for c in coef]
            cost = cls(tuple((m, c) for m, c in zip(monos, coef) if c != 0.0), fixed_tokens)
            for b, v in ((3, 13), (2, 101), (1, 1000)):  # off the grid, and linear in the batch
                sizes = {"batch": b} | dict.fromkeys(axes, v)
                want = float(flops(sizes))
                if not math.isfinite(want) or abs(cost.flops(sizes) - want) > 1e-9 * max(abs(want), 1.0):
                    return None
        except (KeyError, TypeError, ValueError, np.linalg.LinAlgError):  # it reads sizes this fit does not give
            return None
        return cost

    def to_json(self) -> dict[str, Any]:
        return {"flops_per_row": [{"axes": dict(m), "coef": c} for m, c in self.terms],
                "fixed_tokens": self.fixed_tokens}

    @classmethod
    def from_json(cls, d: Any) -> Cost:
        """Parse a manifest's section (untrusted: raises ValueError naming what was expected)."""
        if not isinstance(d, Mapping) or not isinstance(d.get("flops_per_row"), list):
            raise ValueError("expected an object with a flops_per_row list")
        terms = []
        for t in d["flops_per_row"]:
            axes, c = (t.get("axes"), t.get("coef")) if isinstance(t, Mapping) else (None, None)
            if not (isinstance(axes, Mapping) and all(isinstance(a, str) and type(e) is int and 1 <= e <= 2
                                                      for a, e in axes.items()) and sum(axes.values()) <= 2):
                raise ValueError(f"term {t!r}: expected axes mapping token axis names to powers 1-2, degree <= 2")
            if not (isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)):
                raise ValueError(f"term {t!r}: expected a finite number coef")
            terms.append((tuple(sorted(axes.items())), float(c)))
        n = d.get("fixed_tokens")
        if n is not None and not (type(n) is int and n >= 1):
            raise ValueError(f"fixed_tokens {n!r}: expected an int >= 1 or null")
        return cls(tuple(terms), n)


def cache_names(prefix: str, layers: int) -> tuple[str, ...]:
    return tuple(f"{prefix}.{i}.{kv}" for i in range(layers) for kv in ("key", "value"))


def cache_inputs(layers: int, heads: int, head_size: int, axis: str = "cache", name: str = "cache"
                 ) -> tuple[TensorSpec, ...]:
    """Per-layer KV-cache inputs of a decode graph (see DecoderFeeds): 2 * layers tensors (B, nh, axis, hs)."""
    return tuple(TensorSpec(n, "float32", ("batch", heads, axis, head_size)) for n in cache_names(name, layers))


@dataclass(frozen=True)
class Capabilities:
    """What a model can do and the names the code driving it needs. Written into every artifact's manifest
    ("capabilities"), so runtime code (generation, the Embedder) reads it without the torch model registry.

    token_axis: the axis that counts tokens in graph "model" (None: fixed by the config, e.g. ViT's patches);
    source_axis: an encoder-decoder's source length in graph "model" (token_axis is then the target's);
    optimizer: onnxruntime.transformers optimizer model_type for `export --optimize` (None: not supported)."""

    role: str = "encoder"
    token_axis: str | None = "seq"
    source_axis: str | None = None
    text: TextFeeds | None = None
    decoding: DecoderFeeds | None = None
    optimizer: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r}; expected one of {ROLES}")
        if self.text is not None and self.token_axis is None:  # the Embedder's max_length is that axis's
            raise ValueError("text feeds need a token axis (the axis the tokenizer's max_length bounds)")
        if self.source_axis is not None and self.token_axis in (None, self.source_axis):
            raise ValueError("a source axis is declared beside a token axis of another name")
        if (self.decoding is not None) != (self.role != "encoder"):
            raise ValueError(f"role {self.role!r}: decoding feeds are declared by the decoder roles and only by them")
        d = self.decoding
        if d is not None and self.role == "decoder" and d.present is None and d.step_mask is None:
            raise ValueError("a decoder's decoding feeds need `present` (a prefill graph's KV output) or "
                             "`step_mask` (a decode graph that prefills the prompt itself)")
        if d is not None and (d.prefill_graph == d.decode_graph) != (d.step_mask is not None):
            raise ValueError("a decode graph prefills the prompt (prefill_graph == decode_graph) exactly when it "
                             "declares a step_mask")
        if d is not None and self.role == "encoder-decoder" and None in (d.memory, d.target_ids, d.target_mask):
            raise ValueError("an encoder-decoder's decoding feeds need memory, target_ids and target_mask")

    @property
    def generates(self) -> bool:
        return self.decoding is not None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Capabilities:
        """Parse a manifest's section (untrusted: raises ValueError/TypeError on anything malformed)."""
        if not isinstance(d, Mapping):
            raise TypeError("capabilities must be an object")

        def sub(kind: type, v: Any) -> Any:
            if v is None:
                return None
            if not isinstance(v, Mapping) or not all(isinstance(x, str) or x is None for x in v.values()):
                raise TypeError(f"{kind.__name__} must map names to strings")
            return kind(**v)

        known = {f.name for f in dataclasses.fields(cls)}
        if set(d) - known:
            raise TypeError(f"unknown capability field(s) {sorted(set(d) - known)}")
        for k in ("role", "token_axis", "source_axis", "optimizer"):
            if k in d and not (isinstance(d[k], str) or (d[k] is None and k != "role")):
                raise TypeError(f"capability {k!r} must be a string")
        return cls(role=d.get("role", "encoder"), token_axis=d.get("token_axis"), source_axis=d.get("source_axis"),
                   optimizer=d.get("optimizer"), text=sub(TextFeeds, d.get("text")),
                   decoding=sub(DecoderFeeds, d.get("decoding")))


@dataclass(frozen=True)
class ConfigSweep:
    """A model whose token count is set by its config, not by an input axis (ViT: the patch size): the scale
    sweep (bench/scale.py) builds `preset` with `field` = each value and measures in PyTorch."""

    preset: str
    field: str
    values: tuple[int, ...]  # the default sweep
    tokens: Callable[[Any], int]  # config -> tokens the model attends over


@dataclass(frozen=True)
class Dims:
    """A model's sizes, declared by its family next to its config (`ModelFamily.dims`: config -> Dims) so that the
    memory guard, the scale sweep, decode estimates and the studies read them instead of probing config fields by
    name (a family whose config says `blocks` or `hidden` would otherwise get a silent zero-byte estimate).
    The axes that count tokens are names, declared with the feed names (`Capabilities`, `token_axes`).

    layers:          layers a token passes through in graph "model" (an encoder-decoder: encoder + decoder)
    width, heads:    hidden size d and attention heads; ffn: the feed-forward width (d_ff)
    kv_layers:       layers whose keys and values a decode step keeps in its cache (0: the model does not decode)
    kv_width:        width of each of K and V per token and layer (heads x head size; below `width` with
                     grouped-query attention)
    fixed_tokens:    the token count the config fixes (ViT: patches + class token); None: an input axis sets it
    layer_fields:    the config fields that set the layer count (the scale sweep's --layers overrides them)
    positions_field: the config field that bounds the token axes (the scale sweep grows it past the preset's;
                     None: the config fixes the tokens)"""

    layers: int
    width: int
    heads: int
    ffn: int
    kv_layers: int = 0
    kv_width: int = 0
    fixed_tokens: int | None = None
    layer_fields: tuple[str, ...] = ()
    positions_field: str | None = None

    def __post_init__(self) -> None:
        if min(self.layers, self.width, self.heads, self.ffn) < 1 or min(self.kv_layers, self.kv_width) < 0:
            raise ValueError(f"model dimensions must be positive, got {self}")
        if (self.kv_layers == 0) != (self.kv_width == 0):
            raise ValueError(f"kv_layers and kv_width are declared together (a KV cache) or not at all, got {self}")

    def kv_bytes(self, tokens: int, *, batch: int = 1, bytes_per: int = 4) -> float:
        """Bytes of the keys and values a decode step holds for `tokens` tokens of each of `batch` rows."""
        return 2.0 * self.kv_layers * batch * tokens * self.kv_width * bytes_per


def token_axes(caps: Capabilities) -> tuple[str, ...]:
    """The axes of graph "model" that count tokens, as the model declares them: its token axis, then an
    encoder-decoder's source axis; none for a model whose config fixes its tokens. A benchmark at "seq T" sets
    all of them to T; other graphs' further axes (a KV cache) are not among them."""
    return tuple(a for a in (caps.token_axis, caps.source_axis) if a is not None)


def token_count(caps: Capabilities, sizes: Mapping[str, int]) -> int | None:
    """The token axis's size in `sizes` (what records and notes call "seq"); None: no token axis, or not given."""
    return sizes.get(caps.token_axis) if caps.token_axis is not None else None


def token_sizes(caps: Capabilities, batch: int, tokens: int) -> dict[str, int]:
    """Axis sizes of graph "model" at `batch` rows of `tokens` tokens (every token axis at `tokens`)."""
    return {"batch": batch} | dict.fromkeys(token_axes(caps), tokens)


@dataclass(frozen=True)
class ModelFamily:
    """One model: its presets (listed smallest first), module, export spec and FLOPs, and what it can do.

    `quick_preset` is what the default job (`xdeploy run`) uses, `full_preset` what `--full` uses (None: the
    first / the last preset)."""

    name: str
    description: str
    presets: Mapping[str, Any]  # preset name -> frozen config dataclass
    build: Callable[[Any], Any]  # config -> torch.nn.Module
    spec: Callable[[Any], ExportSpec]
    flops: Callable[[Any, Mapping[str, int]], float]  # analytic FLOPs of graph "model" at these axis sizes
    dims: Callable[[Any], Dims]  # config -> its sizes (required: estimates never guess a config's field names)
    capabilities: Capabilities = field(default_factory=Capabilities)
    quick_preset: str | None = None
    full_preset: str | None = None
    config_sweep: ConfigSweep | None = None
    hf: HFImport | None = None

    def __post_init__(self) -> None:
        for p in (self.quick_preset, self.full_preset, self.config_sweep and self.config_sweep.preset):
            if p is not None and p not in self.presets:
                raise ValueError(f"{self.name}: preset {p!r} is not one of {list(self.presets)}")

    @property
    def config_type(self) -> type:
        """The class of this family's configs (every preset is one)."""
        return type(next(iter(self.presets.values())))

    @property
    def smallest_preset(self) -> str:
        return next(iter(self.presets))

    @property
    def quick(self) -> str:
        return self.quick_preset or self.smallest_preset

    @property
    def full(self) -> str:
        return self.full_preset or list(self.presets)[-1]


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
    shapes = {t.name: tuple(d if isinstance(d, int) else int(sizes[d]) for d in t.dims) for t in graph.inputs}
    # 8 bytes an element while drawn (float64 / int64), then the cast: a size no machine holds (a manifest's dim of
    # 10^12) is one line, not numpy's allocation error
    need = sum(8 * math.prod(shape) for shape in shapes.values())
    if need > (avail := system_available()):
        big = max(shapes, key=lambda n: math.prod(shapes[n]))
        raise XDeployError(f"inputs of graph {graph.name!r} at these sizes take {need / 2**30:.3g} GiB ({big!r}: "
                           f"{shapes[big]}); {avail / 2**30:.3g} GiB of memory is available")
    for t in graph.inputs:
        shape = shapes[t.name]
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
        feeds[t.name] = np.asarray(a.astype(t.dtype), order="C")
    return feeds


@dataclass(frozen=True)
class InputCase:
    """One set of seeded inputs for one graph. `sizes` are the dynamic axis sizes."""

    name: str  # e.g. "3x128 empty-row", "text 5x32"
    graph: str
    sizes: dict[str, int]
    feeds: dict[str, np.ndarray]


def case_sizes(spec: ExportSpec, graph: Graph, batch: int, seq: int | None) -> dict[str, int]:
    """The graph's dynamic axes at one shape: batch -> `batch`, every other axis (seq, src_seq, cache) -> `seq`
    (None: the exported maximum), clamped to the exported range; in axis-name order."""
    names = sorted({d for t in graph.inputs for d in t.dims if isinstance(d, str)})
    sizes = {}
    for name in names:
        ax = spec.axes[name]
        want = batch if name == "batch" else (ax.max if seq is None else seq)
        sizes[name] = int(min(max(want, ax.min), ax.max))
    return sizes


def shape_cases(spec: ExportSpec, graph: Graph, shapes: Sequence[tuple[int, int | None]], *,
                seed: int = 0) -> list[InputCase]:
    """Seeded inputs for `graph` at each (batch, seq) of `shapes` (case i is seeded `seed + i`): batch > 1
    right-pads its last row to half length, batch >= 3 also fully pads row 0 (the fp16-softmax / exported-SDPA
    NaN trap). Parity's shape cases (verify/parity.py) and the golden probes (export/probes.py) are these."""
    cases = []
    for i, (b, s) in enumerate(shapes):
        sizes = case_sizes(spec, graph, b, s)
        empty = sizes.get("batch", 1) >= 3 and any(t.kind == "mask" for t in graph.inputs)
        label = "x".join(str(v) for v in sizes.values()) + (" empty-row" if empty else "")
        feeds = make_feeds(graph, sizes, seed=seed + i, empty_row=empty)
        for t in graph.inputs:
            if t.kind == "positions" and "cache" in sizes:
                # make_feeds puts the new token at position `cache`; a full max-length cache buffer holds at
                # most max-1 past tokens (position `max` is past the position table), so cap it there.
                feeds[t.name] = np.minimum(feeds[t.name], spec.axes["cache"].max - 1).astype(t.dtype)
        cases.append(InputCase(label, graph.name, sizes, feeds))
    return cases
