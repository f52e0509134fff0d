"""Layerwise divergence finder: the first node of a candidate ONNX graph whose output leaves tolerance.

    d = find_divergence("fp32/model.onnx", "fp16/model.onnx", feeds, DEFAULT_TOLERANCES["fp16"])
    if d: print(d.node, d.op_type, d.max_abs, d.cosine)

Reference = the fp32 ONNX, candidate = an fp16/int8 ONNX of the same export. The fp16 converter keeps node
and tensor names (and inserts Casts); int8 quantization keeps the names of the tensors it finally produces
(renaming only its internal ones), so the comparable tensors are the node outputs present in both graphs.

Algorithm (k-ary bisection over the reference's dependency graph):
  1. Comparable tensors = outputs of the reference's top-level nodes (Constant nodes excluded) that some
     candidate node also produces, whose inferred type is floating point (or unknown), in reference order.
  2. One round exposes up to `batch` of them as extra graph outputs of *both* models (the same set, so both
     keep the same fusions around them), runs both on the same feeds and judges each exposed tensor with
     `deploy.metrics.compare` (fp16/bf16 cast to fp32 first). Tensors whose shapes differ are skipped.
  3. Suspects start as every comparable tensor. A passing probe clears itself and all its ancestors; the
     topologically first failing probe F restricts the suspects to F's ancestors. The first round probes
     `batch` evenly spaced tensors plus every graph output (if all pass the result is None); each later
     round probes `batch` evenly spaced remaining suspects, until none is left: the answer is the last F,
     a failing tensor none of whose compared ancestors fails.
  Ancestry matters, not just topological order: the key and value projections run beside the query's, so a
  corrupted query leaves them intact, and a plain binary search over the node list would step past it.
  Rounds needed: about log_batch(n) + 1, each with `batch` extra outputs: never every tensor at once, which
  would disable fusions everywhere and keep every intermediate alive (memory on large graphs).

Assumption: an error, once out of tolerance, stays out of tolerance downstream (errors propagate). A tensor
that diverges and then recovers is cleared by a passing descendant: e.g. a corrupted *key* bias adds the same
constant to every score of a query, which softmax cancels, so nothing is reported; what is reported is the
first divergence that reaches the probes after it, which is what matters when choosing nodes to keep in fp32.

On onnxruntime's CPU provider an fp16 graph runs most ops in fp32 (it inserts Casts around ops without fp16
kernels and removes Cast pairs between them), so an fp16 overflow between two such ops never materializes
there; exposing that tensor forces its fp16 value and would show ±inf that the deployed graph never sees.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from xdeploy.core.errors import XDeployError, ort_reason
from xdeploy.deploy.metrics import compare
from xdeploy.export.onnx_graph import TWO_GB, proto_size, subgraph_inputs
from xdeploy.models.spec import Tolerance

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
               onnx.TensorProto.DOUBLE}
NP_OF_ONNX = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
              onnx.TensorProto.DOUBLE: np.float64}


@dataclass(frozen=True)
class Divergence:
    """The first tensor out of tolerance: produced by reference node `node` (an `op_type`) as `output`."""

    node: str
    op_type: str
    output: str
    max_abs: float
    max_rel: float
    cosine: float
    ref_range: tuple[float, float]  # (min, max) of the reference tensor
    cand_range: tuple[float, float]  # (min, max) of the candidate (±inf/NaN show as such)


def _load(model: onnx.ModelProto | str | Path, what: str) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    try:
        return onnx.load(str(model))
    except Exception as e:  # onnx raises OSError, DecodeError, ValidationError... keep the first line
        raise XDeployError(f"cannot load {what} ONNX model {model}: {str(e).splitlines()[0]}") from None


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every typed value (graph value_info, inputs, outputs, after shape inference)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model) if proto_size(model) < TWO_GB else model
    except Exception:  # shape inference is best effort: unknown types are decided at run time
        inferred = model
    g = inferred.graph
    return {v.name: v.type.tensor_type.elem_type for v in (*g.value_info, *g.input, *g.output)
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}


def comparable_tensors(reference: onnx.ModelProto, candidate: onnx.ModelProto) -> list[tuple[str, onnx.NodeProto]]:
    """(tensor name, producing reference node) for every tensor both graphs compute, in reference order."""
    cand_out = {o for n in candidate.graph.node for o in n.output if o}
    types = _elem_types(reference)
    out = []
    for node in reference.graph.node:
        if node.op_type == "Constant":
            continue
        for o in node.output:
            if o and o in cand_out and types.get(o, onnx.TensorProto.FLOAT) in FLOAT_TYPES:
                out.append((o, node))
    return out


def runtimes() -> list[str]:
    """Where a candidate can run: the specs of every registered runner that can run a bare ONNX graph with
    exposed tensors (its `layerwise` capability, e.g. ort, ov, ov:bf16); the reference always runs in onnxruntime."""
    from xdeploy.deploy.registry import specs

    return specs(layerwise=True)


def _check_runtime(runtime: str) -> None:
    if runtime not in runtimes():
        from xdeploy.core.errors import one_of

        raise one_of("layerwise runtime", runtime, runtimes())


class _Probe:
    """Runs a model with a chosen set of tensors exposed as extra outputs (the model is restored after).

    `runtime` is a layerwise runner spec (`runtimes()`): that runner's `probe` runs the graph, e.g. "ort" with
    `providers`, "ov" / "ov:bf16" the OpenVINO CPU plugin with the runner's f32 / bf16 precision hint."""

    def __init__(self, model: onnx.ModelProto, feeds: dict[str, np.ndarray], providers: list[Any],
                 opt_level: str, runtime: str = "ort") -> None:
        self.model, self.providers, self.opt_level, self.runtime = model, providers, opt_level, runtime
        self.outputs = {o.name for o in model.graph.output}
        self.feeds = self._adapt(feeds)

    def _adapt(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Cast float feeds to the input types of this graph (an fp16 graph without kept io types)."""
        out = {}
        for i in self.model.graph.input:
            if i.name not in feeds:
                continue
            a = feeds[i.name]
            want = NP_OF_ONNX.get(i.type.tensor_type.elem_type)
            out[i.name] = a.astype(want) if want is not None and a.dtype.kind == "f" and a.dtype != want else a
        return out

    def run(self, names: list[str]) -> dict[str, np.ndarray]:
        return self.compile(names)()

    def compile(self, names: list[str]) -> Any:
        """A call that runs the model on `self.feeds` (read at call time) and returns tensors `names`."""
        from xdeploy.deploy.registry import parse_spec, runner_class

        g = self.model.graph
        extra = [n for n in names if n not in self.outputs]
        n_before = len(g.output)
        # Untyped ValueInfos: the runtime infers the type, which differs between the fp32 and fp16 graphs.
        g.output.extend([onnx.ValueInfoProto(name=n) for n in extra])
        try:
            probe = runner_class(self.runtime).probe(self.model, names, parse_spec(self.runtime)[1],
                                                     providers=self.providers, opt_level=self.opt_level)
        except XDeployError:
            raise
        except Exception as e:  # onnxruntime / OpenVINO raise their own exception types
            raise XDeployError(f"{self.runtime} cannot load the graph with exposed tensors: "
                               f"{ort_reason(e)}") from None
        finally:
            del g.output[n_before:]

        def call() -> dict[str, np.ndarray]:
            try:
                return probe(self.feeds)
            except XDeployError:
                raise
            except Exception as e:  # a kernel refusing these feeds (a foreign graph's shape operand drawn at random)
                raise XDeployError(f"{self.runtime} run of the graph with exposed tensors failed: "
                                   f"{ort_reason(e)}") from None

        return call


def tensor_values(model: onnx.ModelProto, feeds: dict[str, np.ndarray], names: list[str], *,
                  runtime: str = "ort", providers: list[Any] | None = None, opt_level: str = "all"
                  ) -> dict[str, np.ndarray]:
    """The values of tensors `names` (graph outputs or intermediates) of `model` on `feeds`, run in `runtime`
    (one of `runtimes()`): one run with them exposed as extra outputs (the model is restored after)."""
    return tensor_values_many(model, [feeds], names, runtime=runtime, providers=providers, opt_level=opt_level)[0]


def tensor_values_many(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], names: list[str], *,
                       runtime: str = "ort", providers: list[Any] | None = None, opt_level: str = "all"
                       ) -> list[dict[str, np.ndarray]]:
    """`tensor_values` on several feeds with one session / one compiled model."""
    return list(iter_tensor_values(model, feeds, names, runtime=runtime, providers=providers, opt_level=opt_level))


def iter_tensor_values(model: onnx.ModelProto, feeds: Sequence[dict[str, np.ndarray]], names: list[str], *,
                       runtime: str = "ort", providers: list[Any] | None = None, opt_level: str = "all"
                       ) -> Iterator[dict[str, np.ndarray]]:
    """`tensor_values_many` one feed at a time: a caller that judges each result and drops it holds one feed's
    outputs, not all of them (the int8 search's cases: GPT-2's logits are 0.2 GB a case)."""
    _check_runtime(runtime)
    probe = _Probe(model, feeds[0], list(providers or ["CPUExecutionProvider"]), opt_level, runtime)
    call = probe.compile(list(dict.fromkeys(names)))
    for f in feeds:
        probe.feeds = probe._adapt(f)
        yield call()


def _range(a: np.ndarray) -> tuple[float, float]:
    """(min, max); ±inf and NaN show through (np.min/max propagate NaN) since they are the finding."""
    return (float(np.min(a)), float(np.max(a))) if a.size else (0.0, 0.0)


def find_divergence(reference: onnx.ModelProto | str | Path, candidate: onnx.ModelProto | str | Path,
                    feeds: dict[str, np.ndarray], tol: Tolerance, *, providers: list[Any] | None = None,
                    batch: int = 16, opt_level: str = "all", candidate_runtime: str = "ort") -> Divergence | None:
    """The first tensor (reference topological order) where `candidate` leaves `tol`, or None.

    Per-tensor criterion: `deploy.metrics.compare` over all elements: within atol + rtol*|ref| everywhere or
    cosine >= tol.cosine, and no NaN/Inf where the reference is finite. `batch` tensors are exposed per run.
    `candidate_runtime` "ov:bf16" runs the candidate in OpenVINO with bf16 compute (the `ov:bf16` runner), e.g.
    the fp32 graph itself as candidate; the reference always runs in onnxruntime."""
    _check_runtime(candidate_runtime)
    if batch < 2:
        raise XDeployError(f"layerwise batch must be >= 2, got {batch}")
    ref_model, cand_model = _load(reference, "reference"), _load(candidate, "candidate")
    providers = list(providers or ["CPUExecutionProvider"])
    tensors = comparable_tensors(ref_model, cand_model)
    if not tensors:
        raise XDeployError("the reference and candidate graphs share no floating-point node outputs to compare")
    ref_probe = _Probe(ref_model, feeds, providers, opt_level)
    cand_probe = _Probe(cand_model, feeds, providers, opt_level, candidate_runtime)
    anc = ancestors(ref_model, tensors)
    skipped: set[int] = set()

    def judge(idx: list[int]) -> dict[int, Divergence | None]:
        """Divergence, or None when within tolerance, of each index; shape/dtype mismatches and tensors a runtime
        does not expose (fused away) go to `skipped`."""
        names = [tensors[i][0] for i in idx]
        rv, cv = ref_probe.run(names), cand_probe.run(names)
        out: dict[int, Divergence | None] = {}
        for i, name in zip(idx, names):
            r, c = rv.get(name), cv.get(name)
            # a sequence-typed value comes back as a list (a foreign graph's SplitToSequence): not compared
            if not isinstance(r, np.ndarray) or not isinstance(c, np.ndarray) or r.dtype.kind != "f" \
                    or c.dtype.kind != "f" or r.shape != c.shape:
                skipped.add(i)
                continue
            r32, c32 = r.astype(np.float32), c.astype(np.float32)
            cmp = compare(r32, c32, tol)
            node = tensors[i][1]
            out[i] = None if cmp.passed else Divergence(
                node=node.name or f"<unnamed {node.op_type} -> {name}>", op_type=node.op_type, output=name,
                max_abs=cmp.max_abs, max_rel=cmp.max_rel,
                cosine=cmp.cosine, ref_range=_range(r32), cand_range=_range(c32))
        return out

    n = len(tensors)
    suspects = (1 << n) - 1  # bit i set: tensor i may still be the first divergence
    outputs = {o.name for o in ref_model.graph.output}
    found: tuple[int, Divergence] | None = None
    while True:
        pending = [i for i in range(n) if suspects >> i & 1 and i not in skipped and (not found or i != found[0])]
        if not pending:
            return found[1] if found else None
        probes = _spaced(pending, batch)
        if found is None:  # the first round also checks every graph output: each ends its own branch
            probes = sorted(set(probes) | {i for i, (t, _) in enumerate(tensors) if t in outputs})
        verdicts = judge(probes)
        for i, v in verdicts.items():
            if v is None:
                suspects &= ~anc[i]  # it passes, so (errors propagating) all it depends on passes too
        bad = [i for i in probes if verdicts.get(i) is not None]
        if bad:
            found = (bad[0], verdicts[bad[0]])  # topologically first: no other failing probe is its ancestor
            suspects &= anc[bad[0]]
        elif found is None:
            return None  # every probe passes, the graph outputs included


def _spaced(pending: list[int], k: int) -> list[int]:
    """Up to k indices evenly spaced over `pending` (sorted), always including its last element."""
    if len(pending) <= k:
        return pending
    m = len(pending)
    return sorted({pending[round((j + 1) * m / k) - 1] for j in range(k)})


def ancestors(model: onnx.ModelProto, tensors: list[tuple[str, onnx.NodeProto]]) -> list[int]:
    """For each comparable tensor i, a bitmask of the comparable tensors it depends on (itself included).

    Bitmasks (Python ints) keep this O(n) masks of n bits: ~3 MB for a 5000-tensor graph."""
    index = {t: i for i, (t, _) in enumerate(tensors)}
    dep: dict[str, int] = {}
    for node in model.graph.node:  # topological order
        m = 0
        for name in node.input:
            m |= dep.get(name, 0)
        for name in subgraph_inputs(node):  # If/Loop bodies read outer tensors implicitly
            m |= dep.get(name, 0)
        for o in node.output:
            dep[o] = m | (1 << index[o] if o in index else 0)
    return [dep[t] for t, _ in tensors]
