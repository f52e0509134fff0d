"""Measured precision refinement: which nodes to keep in floating point, decided by running the graphs.

    proto, record = refine(fp32_proto, "int8", graph=graph, spec=spec, options=PrecisionOptions(...))

export/precision.py only transforms graphs (given keep lists); this module measures and calls it again:

fp16 automatic mixed precision (`fp16_amp`): `layerwise.find_divergence` compares the fp16 graph with the fp32
    one node by node on example feeds; the first node whose output leaves the fp16 tolerance is kept fp32 (or,
    when it already is, the neighbours that feed it fp16 / take its overflowing result) and the conversion is
    redone, until the graph is within tolerance or `amp_max_nodes` nodes were added.

int8 sensitivity (`int8_sensitivity`): quantize statically; run the graph's outputs against the fp32 graph on
    parity-like cases (EVAL_CASES: `xdeploy parity`'s default shapes and seeds plus two more seeds, and the
    longest calibration sample) on each runtime in `runtimes` (onnxruntime, and OpenVINO bf16 where installed:
    the loosest runner), judged like `xdeploy parity` (tolerance, top-1 of logits). Checks the fp32 graph
    itself fails on a runtime are excused (bf16 flipping near-tied logits is not int8's doing). While a check
    fails, on its case:
      1. rank the quantized nodes by the error they add locally, from one run of both graphs with every node's
         float input x and output y exposed (`layerwise.tensor_values`):
             cost = (||y_int8 - y_fp32|| - relerr(x) * ||y_fp32||) / mean ||y_fp32||
      2. try each of the SHORTLIST costliest float (`keep_float`: a graph edit, no re-quantization) and keep
         float the one that raises the case's worst output cosine most -- local cost alone misjudges nodes
         whose error the residual stream amplifies or hides;
      3. every REQUANTIZE_EVERY rounds and at the end, re-run the quantizer with the exclusions from the cached
         calibration ranges (the fp32 activations do not change, so this takes seconds).
    Until every check passes or the budget (`int8_max_excluded`, default a quarter of the graph's quantizable
    nodes) is spent. The record lists each kept node with its round, local cost and cosine gain, the nodes
    tried per round, and the unresolved failure if the budget ran out.

int8 OpenVINO IR check (`check_int8_ir`): the NNCF-quantized IR a static int8 conversion may carry
    (export/convert.py) is judged on the same cases on `ov` and `ov:bf16` against the fp32 graph; it ships only
    when it passes, and, if the Q/DQ graph kept nodes float, only when it is no further from fp32 than that graph.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from xdeploy.core.deps import import_quietly
from xdeploy.core.errors import XDeployError
from xdeploy.deploy.verdict import check_outputs, meaningful, tolerance_precision
from xdeploy.export import precision as prec
from xdeploy.export.onnx_graph import prune
from xdeploy.models.spec import ExportSpec, Graph, InputCase, Tolerance, case_sizes, shape_cases
from xdeploy.verify.layerwise import (
    _Probe,
    find_divergence,
    iter_tensor_values,
    tensor_values,
    tensor_values_many,
)

SHORTLIST = 6  # nodes per round whose float version is tried on the failing case
REQUANTIZE_EVERY = 4  # rounds between re-quantizations with the exclusions (the edits are equivalent)
MAX_OUTPUT_ELEMENTS = 2e7  # an evaluation case whose outputs would exceed this runs at batch 1


def default_runtimes() -> tuple[str, ...]:
    """onnxruntime, plus OpenVINO with bf16 compute (the loosest-numerics runner) where OpenVINO is installed."""
    try:
        import_quietly("openvino")
    except ImportError:
        return ("ort",)
    return ("ort", "ov:bf16")


def refine(proto: onnx.ModelProto, precision: str, *, graph: Graph, spec: ExportSpec,
           options: prec.PrecisionOptions, runtimes: Sequence[str] | None = None
           ) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """The `refine` hook of export/precision.convert: the plain transform plus the measured search."""
    if precision == "fp16":
        feeds = options.amp_feeds if options.amp_feeds is not None else prec.amp_feeds(graph, spec)
        return fp16_amp(proto, feeds, spec.tolerances["fp16"], options)
    if precision == "int8":
        q, info = int8_sensitivity(proto, graph=graph, spec=spec, options=options,
                                   runtimes=tuple(runtimes or default_runtimes()))
    elif precision == "int8-dynamic":  # the transform alone: convert() would record a bound-only check first
        q, info = prec.to_int8_dynamic(proto, options, graph=graph)
    else:
        return prec.convert(proto, precision, graph=graph, spec=spec, options=options)
    info["saturation"] = saturation_check(q, prec.calibration_feeds(graph, spec, options)[0],
                                          weight_bits=info["weight_bits"])
    return q, info


def saturation_check(q: onnx.ModelProto, samples: Sequence[Mapping[str, np.ndarray]], *, weight_bits: int,
                     most: int = 8, simulate: bool | None = None) -> dict[str, Any]:
    """The static saturation check (export/saturation.py) of int8 graph `q`: the weight bound, and, when the bound
    does not prove the graph (8-bit int8 weights), the AVX2 arithmetic simulated on the activations of up to
    `most` calibration samples (run through `q` itself on onnxruntime, so they are the activations the int8 graph
    really quantizes), to say how far off an AVX2 machine would be. A proven graph skips the simulation: no
    input can saturate it, so it could only find nothing (tests/test_saturation.py checks that it does), at the
    cost of running the calibration samples again (GPT-2 small: ~40 s a graph). `simulate` True: always."""
    from xdeploy.export import saturation

    nodes = saturation.int8_nodes(q)
    names = sorted({n.activation for n in nodes})
    graph_inputs = {i.name for i in q.graph.input}
    feeds = [{k: v for k, v in s.items() if k in graph_inputs} for s in list(samples)[:most]]
    if simulate is None:
        simulate = not saturation.weight_bound(q, nodes)["portable"]
    if not (names and feeds and simulate):
        return saturation.record(q, None, weight_bits=weight_bits, samples=0, nodes=nodes)
    # one session, one sample's activations at a time (tensor_values_many would hold all of them at once)
    probe = _Probe(q, feeds[0], ["CPUExecutionProvider"], "all")
    call = probe.compile(names)
    sim = saturation.Simulation(nodes, len(feeds))
    for f in feeds:
        probe.feeds = probe._adapt(f)
        sim.add(call())
    return saturation.record(q, None, weight_bits=weight_bits, samples=len(feeds), nodes=nodes,
                             simulated=sim.result())


# ---------------------------------------------------------------------------------------------- fp16 ----

def fp16_amp(proto: onnx.ModelProto, feeds: Mapping[str, np.ndarray], tol: Tolerance,
             options: prec.PrecisionOptions | None = None) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """fp16 with the op block list, then keep diverging nodes fp32 until the graph is within `tol`."""
    options = options or prec.PrecisionOptions()
    if not options.amp:
        return prec.to_fp16_blocked(proto, options)
    float_nodes, producer, by_name, consumers = prec.fp16_graph_info(proto)
    by_op = [n for n, op in float_nodes.items() if op in options.fp16_block_ops]
    names = {n.name for n in proto.graph.node}
    requested = [n for n in options.fp16_block_nodes if n in names]
    amp: list[dict[str, Any]] = []
    added: list[str] = []
    out, _ = prec.to_fp16_blocked(proto, options)
    unresolved = None
    while True:
        d = find_divergence(proto, out, dict(feeds), tol, providers=list(options.amp_providers))
        if d is None:
            break
        blocked = set(requested) | set(added) | set(by_op)
        if d.node not in blocked:
            add = [d.node]  # keep the diverging node fp32
        elif max(abs(d.ref_range[0]), abs(d.ref_range[1])) > prec.FP16_MAX:
            # Already fp32, but its result does not fit fp16: the Cast back to fp16 overflows, so its
            # consumers must stay fp32 too.
            add = [n.name for n in consumers.get(d.output, []) if n.name in float_nodes and n.name not in blocked]
        else:
            # Already fp32: the error comes from its fp16 inputs, so keep their producers fp32.
            add = [producer[i].name for i in by_name[d.node].input
                   if i in producer and producer[i].name in float_nodes and producer[i].name not in blocked]
        record = {"node": d.node, "op_type": d.op_type, "max_abs": d.max_abs, "cosine": d.cosine, "kept_fp32": add}
        if not add or len(added) + len(add) > options.amp_max_nodes:
            unresolved = record
            break
        amp.append(record)
        added += add
        out, _ = prec.to_fp16_blocked(proto, options, extra_block_nodes=added)
    info = prec.fp16_record(proto, options, requested + added, amp={
        "enabled": True, "providers": list(options.amp_providers),
        "tolerance": dataclasses.asdict(tol), "iterations": amp, "unresolved": unresolved})
    return out, info


# ---------------------------------------------------------------------------------------------- int8 ----

# (batch, seq, seed): `xdeploy parity`'s default cases (verify/parity.py DEFAULT_SHAPES, seeds 0, 1, 2: what
# the artifact is judged on) and two more seeds, so a search does not fit one draw of random inputs.
EVAL_CASES: tuple[tuple[int, int | None, int], ...] = ((1, 1, 0), (2, 17, 1), (3, None, 2), (2, 17, 101),
                                                       (3, None, 102))


def eval_cases(graph: Graph, spec: ExportSpec, calibration: Sequence[Mapping[str, np.ndarray]] = ()
               ) -> list[InputCase]:
    """Parity-like cases (EVAL_CASES): padded rows at batch 2, the maximum length at batch 3 with an empty row
    (batch 1 when the outputs would be huge), and for text graphs the longest calibration sample (real text)."""
    cases = []
    for b, s, seed in EVAL_CASES:  # parity's shape cases (models/spec.py shape_cases), each with its own seed
        sizes = case_sizes(spec, graph, b, s)
        elems = sum(math.prod(d if isinstance(d, int) else sizes.get(d, 1) for d in t.dims) for t in graph.outputs)
        if elems > MAX_OUTPUT_ELEMENTS and "batch" in sizes:
            b = 1
        (case,) = shape_cases(spec, graph, [(b, s)], seed=seed)
        cases.append(dataclasses.replace(case, name=f"{case.name} seed {seed}"))
    if calibration and any(t.kind == "ids" for t in graph.inputs):  # real text (synthetic images add nothing)
        longest = max(calibration, key=lambda f: sum(a.size for a in f.values()))
        cases.append(InputCase("calibration sample", graph.name, {}, _longest_row(graph, longest)))
    return cases


def _longest_row(graph: Graph, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The row (batch 1) of a calibration sample with the most real tokens: the real text is what this case adds
    (padding and batching are the shape cases' part), and a whole 4 x 1024 sample's logits alone are 0.8 GB on
    GPT-2, held for the reference and the candidate on each runtime."""
    batch_axis = {t.name: t.dims.index("batch") for t in graph.inputs if "batch" in t.dims}
    if not batch_axis or not all(k in batch_axis for k in feeds):
        return dict(feeds)
    ids_dims = {t.dims for t in graph.inputs if t.kind == "ids"}
    masks = [t for t in graph.inputs if t.kind == "mask" and t.dims in ids_dims and t.name in feeds]  # the text's
    if masks:
        m = np.moveaxis(np.asarray(feeds[masks[0].name]), batch_axis[masks[0].name], 0)
        r = int(np.argmax(m.reshape(m.shape[0], -1).sum(axis=1)))
    else:
        r = 0
    return {k: np.take(v, [r], axis=batch_axis[k]) for k, v in feeds.items()}


def _norm(a: np.ndarray) -> float:
    a64 = a.astype(np.float64).ravel()
    return float(np.linalg.norm(a64[np.isfinite(a64)]))


def node_costs(reference: onnx.ModelProto, candidate: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
               nodes: Sequence[str], *, chunk: int = 32) -> dict[str, float]:
    """The error each quantized node adds, from one run of each graph with the nodes' float input x and output y
    exposed (`layerwise.tensor_values`):
        cost = (||y_int8 - y_fp32|| - relerr(x) * ||y_fp32||) / mean ||y_fp32|| over the nodes
    i.e. the output error beyond what the input error alone would give, in units of a typical node output
    (absolute, so a node whose output dominates the residual stream counts for more than a small one)."""
    by_name = {n.name: n for n in reference.graph.node}
    inits = {i.name for i in reference.graph.initializer}
    graph_inputs = {i.name for i in reference.graph.input}
    pairs: dict[str, tuple[str | None, str]] = {}
    for name in nodes:
        n = by_name.get(name)
        if n is None:
            continue
        x = next((i for i in n.input[:2] if i and i not in inits), None)
        pairs[name] = (None if x in graph_inputs else x, n.output[0])
    names = sorted({t for xy in pairs.values() for t in xy if t})
    err: dict[str, float] = {}
    norm: dict[str, float] = {}
    for k in range(0, len(names), chunk):
        part = names[k:k + chunk]
        r = tensor_values(reference, dict(feeds), part)
        c = tensor_values(candidate, dict(feeds), part)
        for t in part:
            if r[t].shape == c[t].shape:
                err[t] = _norm(c[t].astype(np.float64) - r[t].astype(np.float64))
                norm[t] = _norm(r[t])
    typical = float(np.mean([norm[y] for _, y in pairs.values() if y in norm] or [1.0])) or 1.0
    out = {}
    for n, (x, y) in pairs.items():
        if y in err:
            inherited = err[x] / norm[x] * norm[y] if x and x in err and norm[x] > 0 else 0.0
            out[n] = (err[y] - inherited) / typical
    return out


def keep_float(candidate: onnx.ModelProto, reference: onnx.ModelProto, nodes: Sequence[str]) -> onnx.ModelProto:
    """A copy of the Q/DQ graph `candidate` with `nodes` reading their float inputs again (the activation before
    its QuantizeLinear, the fp32 weight and bias from `reference`): the same graph the quantizer writes with
    them excluded, made in milliseconds, so the search can try candidates by their effect on the outputs.

    A weight the fp32 graph reaches through constant ops (a tied embedding's Transpose: the Transformer's and
    GPT's lm_head) is folded into one initializer by the quantizer's pre-processing, so its fp32 name does not
    exist in `candidate`: that constant chain is copied over from `reference` under fresh names."""
    q = onnx.ModelProto()
    q.CopyFrom(candidate)
    ref_nodes = {n.name: n for n in reference.graph.node}
    ref_inits = {i.name: i for i in reference.graph.initializer}
    ref_producer = {o: n for n in reference.graph.node for o in n.output}
    have = {i.name for i in q.graph.initializer}
    producer = {o: n for n in q.graph.node for o in n.output}
    chains: list[onnx.NodeProto] = []  # copied constant nodes, prepended (they read initializers only)

    def float_constant(name: str) -> str:
        """`reference`'s constant tensor `name`, made available in q; returns its name there."""
        if name in ref_inits:
            init = ref_inits[name]
            if name in producer:  # the quantizer named its DequantizeLinear output after the weight
                init = onnx.TensorProto()
                init.CopyFrom(ref_inits[name])
                init.name = name = f"{name}_float"
            if name not in have:
                q.graph.initializer.append(init)
                have.add(name)
            return name
        src = ref_producer.get(name)
        if src is None or src.op_type not in prec.WEIGHT_CHAIN_OPS:
            raise XDeployError(f"keep_float: the fp32 weight {name!r} is neither an initializer nor made by constant "
                               f"ops ({', '.join(prec.WEIGHT_CHAIN_OPS)}) from one")
        out = f"{name}_float"
        if out not in have and out not in producer:
            node = onnx.NodeProto()
            node.CopyFrom(src)
            node.name = f"{src.name}_float"
            node.input[:] = [float_constant(i) if i else i for i in src.input]
            node.output[:] = [f"{o}_float" if o else o for o in src.output]
            chains.append(node)
            producer.update({o: node for o in node.output})
        return out

    for n in q.graph.node:
        if n.name not in nodes or n.name not in ref_nodes:
            continue
        for k, name in enumerate(n.input):
            dq = producer.get(name)
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            qn = producer.get(dq.input[0])
            if qn is not None and qn.op_type == "QuantizeLinear":
                n.input[k] = qn.input[0]  # an activation: the float tensor the QuantizeLinear reads
            else:
                n.input[k] = float_constant(ref_nodes[n.name].input[k])  # a weight (or bias): the fp32 one
    if chains:
        nodes_now = list(q.graph.node)
        del q.graph.node[:]
        q.graph.node.extend(chains + nodes_now)
    return prune(q)  # Q/DQ pairs left without a consumer, and their initializers


def _score(reference_out: dict[str, np.ndarray], candidate: onnx.ModelProto, case: InputCase, graph: Graph,
           tol: Tolerance) -> float:
    """The worst output cosine of `candidate` on one case in onnxruntime (what the search maximizes)."""
    from xdeploy.deploy.metrics import compare
    got = tensor_values(candidate, case.feeds, [t.name for t in graph.outputs])
    worst = 1.0
    for t in graph.outputs:
        r = reference_out[t.name]
        c = compare(r, got[t.name], tol, mask=meaningful(graph, t, case.feeds, r.shape))
        worst = min(worst, c.cosine if c.cosine == c.cosine else -1.0)
    return worst


def _evaluate(reference_out: list[dict[str, np.ndarray]], candidate: onnx.ModelProto, cases: list[InputCase],
              graph: Graph, tol: Tolerance, runtimes: Sequence[str]) -> tuple[list[Any], float]:
    """Failing output checks over cases x runtimes, and the worst cosine seen."""
    outs = [t.name for t in graph.outputs]
    failures, worst = [], 1.0
    for rt in runtimes:
        tp = tolerance_precision("int8", "bf16" if rt == "ov:bf16" else "fp32")
        for case, ref, got in zip(cases, reference_out,
                                  iter_tensor_values(candidate, [c.feeds for c in cases], outs, runtime=rt)):
            for c in check_outputs(ref, got, case, graph, runner=rt, precision=tp, artifact_precision="int8",
                                   tol=tol):
                if c.comparison.cosine == c.comparison.cosine:  # not NaN
                    worst = min(worst, c.comparison.cosine)
                if not c.passed:
                    failures.append(c)
    return failures, worst


def int8_sensitivity(proto: onnx.ModelProto, *, graph: Graph, spec: ExportSpec, options: prec.PrecisionOptions,
                     runtimes: Sequence[str] = ("ort",), shortlist: int = SHORTLIST
                     ) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Static int8, then keep the costliest quantized nodes float until the cases pass (module docstring)."""
    feeds, cal_record = prec.calibration_feeds(graph, spec, options)
    tol = spec.tolerances["int8"]
    with tempfile.TemporaryDirectory(prefix="xdeploy-sensitivity-") as d:
        cache = Path(d) / "ranges.json"
        q, info = prec.to_int8_static(proto, feeds, options, calibration_record=cal_record, cache=cache,
                                      graph=graph.name)
        if not options.int8_sensitivity:
            info["sensitivity"] = {"enabled": False}
            return q, info
        cases = eval_cases(graph, spec, feeds)
        outs = [t.name for t in graph.outputs]
        reference_out = tensor_values_many(proto, [c.feeds for c in cases], outs)
        quantizable = prec.quantizable_nodes(proto, options.int8_op_types)
        budget = max_excluded(options, len(quantizable))
        # A check the fp32 graph itself fails on that runtime (OpenVINO bf16 flipping the top-1 of near-tied
        # logits) is not int8's doing: no float node would fix it, so it does not drive the search.
        excused: set[tuple[str, str, str]] | None = None  # measured at the first failure
        edited = False  # q holds keep_float edits the quantizer has not re-made yet
        kept: list[dict[str, Any]] = []
        rounds: list[dict[str, Any]] = []
        unresolved = None
        while True:
            failures, worst = _evaluate(reference_out, q, cases, graph, tol, runtimes)
            if failures and excused is None:
                fp32_failures, _ = _evaluate(reference_out, proto, cases, graph, tol, runtimes)
                excused = {(c.runner, c.case, c.output) for c in fp32_failures}
            failures = [c for c in failures if (c.runner, c.case, c.output) not in (excused or set())]
            if not failures:
                break
            f = min(failures, key=lambda c: c.comparison.cosine if c.comparison.cosine == c.comparison.cosine else -1.0)
            fail = {"runtime": f.runner, "case": f.case, "output": f.output, "cosine": f.comparison.cosine,
                    "reason": f.reason}
            excluded = set(info["excluded"]) | {k["node"] for k in kept}
            candidates = [n for n in quantizable if n not in excluded]
            if len(kept) >= budget or not candidates:
                unresolved = fail | {"why": "budget spent" if len(kept) >= budget else "nothing left to keep float"}
                break
            ci = next(i for i, c in enumerate(cases) if c.name == f.case)
            case, ref = cases[ci], reference_out[ci]
            # Greedy by measured effect: the nodes adding the most error locally are the shortlist; the one
            # whose float version most improves this case's worst output is kept float.
            costs = node_costs(proto, q, case.feeds, candidates)
            short = sorted(costs, key=costs.get, reverse=True)[:shortlist]
            base = _score(ref, q, case, graph, tol)
            trials = {n: _score(ref, keep_float(q, proto, [n]), case, graph, tol) for n in short}
            if not trials:
                unresolved = fail | {"why": "no quantized node could be measured"}
                break
            best = max(trials, key=trials.get)
            kept.append({"node": best, "op_type": quantizable[best], "added_error": costs[best],
                         "cosine_gain": trials[best] - base, "round": len(rounds) + 1})
            rounds.append({"failing": fail, "worst_cosine": worst, "tried": {n: trials[n] for n in short},
                           "kept_float": best})
            q, edited = keep_float(q, proto, [best]), True
            if len(rounds) % REQUANTIZE_EVERY == 0 or trials[best] >= tol.cosine:
                # the quantizer's own graph with these exclusions (the edit above is the same graph, cheaper)
                q, info = prec.to_int8_static(proto, feeds, options, calibration_record=cal_record, cache=cache,
                                              extra_exclude=[k["node"] for k in kept], graph=graph.name)
                edited = False
        if edited:
            q, info = prec.to_int8_static(proto, feeds, options, calibration_record=cal_record, cache=cache,
                                          extra_exclude=[k["node"] for k in kept], graph=graph.name)
    by_node = {k["node"]: k for k in kept}
    info["kept_fp32"] = [by_node.get(e["node"], e) | {"reason": e["reason"]} for e in info["kept_fp32"]]
    info["sensitivity"] = {
        "enabled": True, "runtimes": list(runtimes), "budget": budget, "shortlist": shortlist,
        "tolerance": dataclasses.asdict(tol), "cases": [c.name for c in cases], "rounds": rounds,
        "worst_cosine": worst, "unresolved": unresolved,
        "fp32_also_fails": [" ".join(k) for k in sorted(excused or ())],
    }
    return q, info


def max_excluded(options: prec.PrecisionOptions, quantizable: int) -> int:
    """The search's budget: `options.int8_max_excluded` nodes, or by default a quarter of the graph's
    quantizable nodes (at least 2): past that, the int8 graph is mostly float and int8-dynamic or fp32 is the
    better artifact."""
    if options.int8_max_excluded is not None:
        return options.int8_max_excluded
    return max(2, quantizable // 4)


# -------------------------------------------------------------------------------------- int8 OpenVINO IR ----

# How the `ov` runner compiles an int8 IR in `xdeploy parity`: f32 ("ov") and bf16 ("ov:bf16") compute hints.
IR_VARIANTS: tuple[str, ...] = ("", "bf16")


def _ir_outputs(xml: str | Path, variant: str, graph: Graph, cases: Sequence[InputCase]) -> list[dict[str, np.ndarray]]:
    """Outputs of the IR at `xml` compiled as the `ov` runner compiles it (deploy/sessions.py ov_config) on
    each case."""
    from xdeploy.deploy.sessions import ov_compile, ov_config

    compiled = ov_compile(xml, ov_config(variant), what=f"OpenVINO IR {Path(xml).name}")
    req = compiled.create_infer_request()
    ports = {n: p for p in compiled.outputs for n in p.get_names()}
    out = []
    for c in cases:
        res = req.infer({t.name: np.asarray(c.feeds[t.name], dtype=t.dtype, order="C") for t in graph.inputs})
        out.append({t.name: np.array(res[ports[t.name]], copy=True) for t in graph.outputs})
    return out


def check_int8_ir(reference: onnx.ModelProto, ir: str | Path, *, graph: Graph, spec: ExportSpec,
                  calibration: Sequence[Mapping[str, np.ndarray]], qdq: onnx.ModelProto | None = None,
                  kept_float: Sequence[str] = (), reference_ir: str | Path | None = None,
                  tol: Tolerance | None = None, variants: Sequence[str] = IR_VARIANTS) -> dict[str, Any]:
    """Is the int8 OpenVINO IR at `ir` (export/openvino_ir.py `quantize_ir`) fit to ship? The `check_ir` hook of
    export/convert.py `convert_artifact` (xdeploy/api.py passes it).

    Runs the IR as the `ov` runner does (each of `variants`: f32 and bf16 compute) on the int8 search's cases
    (`eval_cases`: `xdeploy parity`'s shapes and seeds, two more seeds, the longest calibration sample) and
    judges every output against the fp32 ONNX graph `reference` (onnxruntime) like `xdeploy parity`, at `tol`
    (default: the artifact's int8 tolerance). On bf16 a check the fp32 IR `reference_ir` fails as well is
    excused (bf16 flipping a near-tied top-1 is not int8's doing); on f32 nothing is excused.

    When the Q/DQ graph `qdq` kept nodes float (`kept_float`: requested or found by the sensitivity search),
    the IR cannot mirror that (its node names are the PyTorch frontend's, not the ONNX graph's), so it must
    also be at least as close to fp32 as the Q/DQ graph (worst output cosine, IR on f32 vs Q/DQ on onnxruntime).

    Returns the manifest's record: passed, reason (when not), per-runner worst cosine, the cases, tolerance."""
    tol = tol or spec.tolerances["int8"]
    cases = eval_cases(graph, spec, calibration)
    outs = [t.name for t in graph.outputs]
    reference_out = tensor_values_many(reference, [c.feeds for c in cases], outs)
    worst: dict[str, float] = {}
    failures = []
    excused: list[str] = []
    for variant in variants:
        runner = "ov" + (f":{variant}" if variant else "")
        tp = tolerance_precision("int8", "bf16" if variant == "bf16" else "fp32")
        got = _ir_outputs(ir, variant, graph, cases)
        fp32_fails: set[tuple[str, str]] | None = None
        worst[runner] = 1.0
        for i, (case, ref) in enumerate(zip(cases, reference_out)):
            for c in check_outputs(ref, got[i], case, graph, runner=runner, precision=tp, artifact_precision="int8",
                                   tol=tol):
                cos = c.comparison.cosine if c.comparison.cosine == c.comparison.cosine else -1.0
                worst[runner] = min(worst[runner], cos)
                if c.passed:
                    continue
                if variant == "bf16" and reference_ir is not None:
                    if fp32_fails is None:  # measured once, at the first failure
                        base = _ir_outputs(reference_ir, variant, graph, cases)
                        fp32_fails = {(b.case, b.output) for j, (cj, rj) in enumerate(zip(cases, reference_out))
                                      for b in check_outputs(rj, base[j], cj, graph, runner=runner, precision=tp,
                                                             artifact_precision="fp32", tol=tol) if not b.passed}
                    if (c.case, c.output) in fp32_fails:
                        excused.append(f"{runner} {c.case} {c.output}")
                        continue
                failures.append(c)
    record: dict[str, Any] = {
        "passed": not failures, "runners": list(worst), "worst_cosine": worst, "cases": [c.name for c in cases],
        "tolerance": dataclasses.asdict(tol), "fp32_also_fails": excused, "qdq_worst_cosine": None}
    if failures:
        f = min(failures, key=lambda c: c.comparison.cosine if c.comparison.cosine == c.comparison.cosine else -1.0)
        record["reason"] = f"misses the int8 tolerance on {f.runner}, case {f.case}, output {f.output}: {f.reason}"
        return record
    if qdq is not None and kept_float:
        _, qdq_worst = _evaluate(reference_out, qdq, cases, graph, tol, ("ort",))
        record["qdq_worst_cosine"] = qdq_worst
        ir_worst = worst.get("ov", min(worst.values()))
        if ir_worst < qdq_worst:
            record["passed"] = False
            record["reason"] = (f"the Q/DQ graph keeps {len(kept_float)} node(s) float, which the IR cannot mirror, "
                                f"and the IR is further from fp32 (worst cosine {ir_worst:.5f} on ov vs "
                                f"{qdq_worst:.5f} for the Q/DQ graph on ort)")
    return record
