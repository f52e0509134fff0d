"""The runner interface every backend implements, and feed validation shared by all of them.

    with open_runner("ort", artifact) as r:         # load
        outputs = r.infer(feeds)                     # host numpy in -> host numpy out (validated)
        call = r.prepare(feeds)                      # inputs made resident once (device / bound buffers)
        call()                                       # the zero-copy call benchmarks time
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from xdeploy.core.errors import XDeployError
from xdeploy.export.artifact import Artifact
from xdeploy.models.spec import Axis, Graph


@dataclass(frozen=True)
class RunnerInfo:
    runner: str  # registry name, e.g. "ov:bf16"
    device: str  # "cpu", "cuda:0 (NVIDIA L4)", ...
    precision: str  # effective compute precision: artifact precision or the runner's hint
    threads: int
    versions: Mapping[str, str] = field(default_factory=dict)


def validate_feeds(graph: Graph, axes: Mapping[str, Axis], feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Check names, dtypes, ranks and dims against the exported graph; return contiguous arrays.

    Every error names the input and what was expected, so a user never sees a backend's stack trace."""
    if not isinstance(feeds, Mapping):
        raise XDeployError(f"feeds must be a mapping of input name -> array, got {type(feeds).__name__}")
    want = [t.name for t in graph.inputs]
    missing = [n for n in want if n not in feeds]
    extra = [n for n in feeds if n not in want]
    if missing or extra:
        raise XDeployError(f"graph {graph.name!r} expects inputs {want}; "
                           f"missing {missing}, unexpected {extra}")
    out: dict[str, np.ndarray] = {}
    bound: dict[str, tuple[int, str]] = {}
    for t in graph.inputs:
        a = feeds[t.name]
        if not isinstance(a, np.ndarray):
            raise XDeployError(f"input {t.name!r} must be a numpy array, got {type(a).__name__}")
        if a.dtype != np.dtype(t.dtype):
            raise XDeployError(f"input {t.name!r} has dtype {a.dtype}; expected {t.dtype}")
        if a.ndim != len(t.dims):
            raise XDeployError(f"input {t.name!r} has rank {a.ndim} (shape {a.shape}); "
                               f"expected rank {len(t.dims)} {tuple(t.dims)}")
        for i, (n, d) in enumerate(zip(a.shape, t.dims)):
            if isinstance(d, int):
                if n != d:
                    raise XDeployError(f"input {t.name!r} dim {i} is {n}; expected {d}")
                continue
            ax = axes[d]
            if n == 0:
                raise XDeployError(f"input {t.name!r} is empty along axis {d!r}; expected {ax.min}..{ax.max}")
            if not ax.min <= n <= ax.max:
                raise XDeployError(f"input {t.name!r} axis {d!r} is {n}; the artifact was exported for "
                                   f"{ax.min}..{ax.max}")
            if d in bound and bound[d][0] != n:
                raise XDeployError(f"axis {d!r} is {n} in {t.name!r} but {bound[d][0]} in {bound[d][1]!r}")
            bound[d] = (n, t.name)
        if t.kind == "ids" and t.high and a.size and (a.min() < 0 or a.max() >= t.high):
            raise XDeployError(f"input {t.name!r} holds ids outside 0..{t.high - 1}")
        out[t.name] = np.asarray(a, order="C")  # not ascontiguousarray: it makes a rank-0 input (a flag) 1-d
    return out


class CachedStep(abc.ABC):
    """A decode step whose engine keeps the KV cache (Runner.cached_step): `reset()` empties it, then each call
    feeds only the new tokens. ids, positions (N, S) int64; mask (N, P + S) int64 over every position so far (1 =
    real); beam (N,) int32: row r of this step continues cached row beam[r] (a prefill's B rows may become
    B x beams). Returns the last token's logits (N, V), valid until the next call."""

    @abc.abstractmethod
    def reset(self) -> None: ...

    @abc.abstractmethod
    def __call__(self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, beam: np.ndarray) -> np.ndarray: ...

    @abc.abstractmethod
    def hold(self, feeds: Mapping[str, np.ndarray]) -> None:
        """After `reset`: the step's inputs fixed for the sequence (models/spec.py DecoderFeeds.held: an
        encoder-decoder's memory and source mask, one row per cached row), read in place by every call until the
        next `hold`; the caller keeps the arrays alive and unchanged meanwhile."""


class LoopArrays:
    """Where the decoding loop keeps the arrays it binds and updates every step (deploy/generate.py: the KV
    cache, the step's new K/V, an encoder-decoder's held memory): host numpy here, read in place by the CPU
    runners. A GPU runner's `loop_arrays()` keeps them on its device (TorchArrays), so that a step copies only
    the token in and the logits out instead of the whole cache in and the new K/V out."""

    device = "cpu"

    def zeros(self, shape: Sequence[int], dtype: np.dtype) -> Any:
        return np.zeros(tuple(shape), dtype)

    def put(self, a: np.ndarray) -> Any:
        """A host array as this store's array (a copy on a device; here the array itself, made C-contiguous)."""
        return a if a.flags.c_contiguous else np.ascontiguousarray(a)

    def take(self, a: Any, rows: np.ndarray, axis: int) -> Any:
        """`a`'s slices `rows` along `axis`, gathered into a new array (beam reordering)."""
        return np.take(a, rows, axis=axis)


class TorchArrays(LoopArrays):
    """The loop's arrays as torch tensors on `device` ("cuda:0"): the slot writes and beam gathers run there.
    Runners bind them by address (OrtRunner.bind); on "cpu" it is the same path without a GPU (the tests')."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch, self.device = torch, device

    def zeros(self, shape: Sequence[int], dtype: np.dtype) -> Any:
        return self.torch.zeros(tuple(shape), dtype=torch_dtype(dtype), device=self.device)

    def put(self, a: np.ndarray) -> Any:
        return self.torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def take(self, a: Any, rows: np.ndarray, axis: int) -> Any:
        return a.index_select(axis, self.torch.as_tensor(np.asarray(rows, np.int64), device=self.device))


def torch_dtype(dtype: np.dtype) -> Any:
    import torch

    return torch.from_numpy(np.zeros(0, dtype)).dtype


def numpy_dtype(tensor: Any) -> np.dtype:
    """A torch tensor's element type as numpy's (on any device)."""
    import torch

    return torch.empty(0, dtype=tensor.dtype).numpy().dtype


def is_tensor(a: Any) -> bool:
    """Whether `a` is a torch tensor, without importing torch where no tensor can exist."""
    return type(a).__module__.startswith("torch") and hasattr(a, "data_ptr")


def cuda_gaps() -> list[str]:
    """[] when torch sees a CUDA device, else the line saying it does not: the device check of every GPU runner's
    `gaps` (torch is a core dependency, and a CUDA build in the GPU env, `make gpu-env`)."""
    import torch

    if torch.cuda.is_available():
        return []
    build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
    return [f"no CUDA device is visible to torch {torch.__version__} ({build})"]


class Runner(abc.ABC):
    """Load an artifact graph on one backend. Subclasses implement `_load`, `_run` and optionally `prepare`."""

    name: ClassVar[str]
    variants: ClassVar[tuple[str, ...]] = ("",)  # accepted "name:variant" suffixes ("" = default)
    # compiles the OpenVINO IR an fp32 artifact may carry (export/openvino_ir.py): `xdeploy run` writes the IR
    # only when a selected runner reads it
    reads_openvino_ir: ClassVar[bool] = False
    # options the runner is opened with when it is timed beside other engines in one process (bench/suite.py's
    # comparisons, the run's decode groups): an engine's idle threads must not take the core the next one runs on
    interleaved_options: ClassVar[Mapping[str, Any]] = {}
    # What the runner can do, read from the class without opening anything, so that code over "every runner"
    # (deploy/registry.py's `specs`, `xdeploy doctor`, verify/layerwise.py, the contract tests) asks the
    # registry instead of keeping a list of names:
    # variants that compute in a precision of their own instead of the artifact's (ov:bf16 -> "bf16"); with the
    # default variant they are the runner's distinct specs (an alias such as ov:f32 computes what ov does)
    variant_precisions: ClassVar[Mapping[str, str]] = {}
    # variants that need an NVIDIA GPU (every variant of a GPU runner; torch's fp16)
    gpu_variants: ClassVar[tuple[str, ...]] = ()
    # runs the artifact's ONNX graph; False for the torch runner, which runs the PyTorch reference module
    runs_graph: ClassVar[bool] = True
    # implements `probe`: verify/layerwise.py may run its candidate graph in this runner's runtime
    layerwise: ClassVar[bool] = False
    # keeps a decoder's engine cache in blocks (option paged=True, Generator kv_cache="paged"; `keeps_cache` first)
    pages_cache: ClassVar[bool] = False

    @classmethod
    def gaps(cls, variant: str = "") -> list[str]:
        """What this machine or environment lacks to open `variant` ([] = nothing), found without importing an
        optional backend: `xdeploy doctor` prints it and the contract tests skip on it."""
        return []

    @classmethod
    def probe(cls, model: Any, names: list[str], variant: str = "", *, providers: Sequence[Any] = (),
              opt_level: str = "all") -> Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]:
        """A call running the ONNX `model` (an onnx.ModelProto whose graph outputs include `names`) on feeds and
        returning tensors `names`: verify/layerwise.py's candidate, for a runner with `layerwise` set.
        `providers` and `opt_level` are onnxruntime's (runtimes without them ignore them)."""
        raise XDeployError(f"runner {cls.name!r} cannot run a bare ONNX graph (layerwise)")

    def __init__(self, artifact: Artifact, graph: str = "model", *, variant: str = "", threads: int = 0,
                 **options: Any) -> None:
        if variant not in self.variants:
            raise XDeployError(f"runner {self.name!r} has no variant {variant!r}; expected one of: "
                               f"{', '.join(repr(v) for v in self.variants)}")
        self.artifact, self.graph, self.variant, self.threads = artifact, artifact.graph(graph), variant, threads
        # outputs=[names]: compute and return only these (a backend that can prune the rest does: OpenVINO
        # compiles the graph without the other results, e.g. BERT's pooler branch or GPT's KV cache when only
        # logits are read; on BERT-base b1 bf16 the gain was within the 4-5% spread between two compiled
        # instances, so it is about doing the same work as a peer, not a measured speed-up); default: all
        declared = [t.name for t in self.graph.outputs]
        wanted = options.pop("outputs", None)
        if wanted is not None:
            wanted = [wanted] if isinstance(wanted, str) else list(wanted)
            bad = [n for n in wanted if n not in declared]
            if bad or not wanted:
                raise XDeployError(f"unknown output(s) {bad or wanted}; graph {self.graph.name!r} has {declared}")
        self._outputs = [n for n in declared if n in wanted] if wanted is not None else declared
        self.options = options
        self._load()

    # -- to implement --
    @abc.abstractmethod
    def _load(self) -> None: ...

    @abc.abstractmethod
    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    @abc.abstractmethod
    def info(self) -> RunnerInfo: ...

    # -- shared --
    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self._run(validate_feeds(self.graph, self.artifact.spec.axes, feeds))
        return out if len(out) == len(self._outputs) else {n: out[n] for n in self._outputs}

    def prepare(self, feeds: Mapping[str, np.ndarray]) -> Callable[[], Any]:
        """A call with validation and input staging done once; backends override to bind device buffers."""
        checked = validate_feeds(self.graph, self.artifact.spec.axes, feeds)
        return lambda: self._run(checked)

    def bind(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> Callable[[], None]:
        """Zero-copy steady-state call on caller-owned host buffers (the KV-cache decoding loop uses it).

        Each call reads the *current contents* of `inputs` and writes results into `outputs` in place; the
        caller may change array contents between calls, never shapes. This default copies the outputs;
        backends override it to bind the buffers directly (onnxruntime IO binding, OpenVINO shared tensors)."""
        checked = self.check_bound(inputs, outputs)

        def call() -> None:
            result = self._run(checked)
            for name, buf in outputs.items():
                np.copyto(buf, result[name])

        return call

    def check_bound(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]
                    ) -> dict[str, np.ndarray]:
        """The checks every `bind` makes: the feeds are valid and C-contiguous as given (a copy would hide the
        caller's later writes), every output name is one of the graph's. Returns the validated feeds."""
        checked = validate_feeds(self.graph, self.artifact.spec.axes, inputs)
        for name, a in checked.items():
            if a is not inputs[name]:
                raise XDeployError(f"bound input {name!r} must be a C-contiguous array")
        unknown = [n for n in outputs if n not in self.output_names]
        if unknown:
            raise XDeployError(f"unknown output(s) {unknown}; graph {self.graph.name!r} has {self.output_names}")
        return checked

    def loop_arrays(self) -> LoopArrays:
        """Where the decoding loop keeps the arrays it binds to this runner (see LoopArrays): on the host."""
        return LoopArrays()

    @classmethod
    def keeps_cache(cls, artifact: Artifact, graph: str) -> bool:
        """Whether this runner can run decode graph `graph` of `artifact` with the KV cache inside the engine (opened
        with option stateful=True; `cached_step` then drives it). The decoding loop asks, never a runner name."""
        return False

    def cached_step(self) -> CachedStep:
        """The decoding loop's call when the engine keeps the KV cache (see `keeps_cache`)."""
        raise XDeployError(f"runner {self.name!r} does not keep a KV cache in its engine; the decoding loop keeps it")

    def close(self) -> None:
        """Release sessions / device memory. Idempotent."""

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def output_names(self) -> list[str]:
        """The outputs this runner returns: the graph's, or the `outputs` option's subset in graph order."""
        return list(self._outputs)
