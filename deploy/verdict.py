"""The verdict on one graph's outputs against the PyTorch fp32 reference: which positions mean something, whose
tolerance applies, and pass/fail per output (top-1 agreement for logits, a finite reference).

One definition for every judge: parity (verify/parity.py), the measured keep-float searches
(verify/sensitivity.py), the benchmarks' parity column and the golden probes the runtimes check where they run
(deploy/probes.py). Here in deploy/, below verify/, because the runtimes (deploy/embedder.py, deploy/generate.py)
judge their probes themselves; numpy only (no backend, no torch). The tensor metrics are deploy/metrics.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from xdeploy.models.spec import InputCase, Tolerance

from .metrics import Comparison, compare

PRECISION_ORDER = ("fp32", "fp16", "bf16", "int8", "int8-dynamic")  # tightest to loosest default tolerance
# Minimum fraction of meaningful positions whose logits argmax (top-1) agrees with the reference (`top1_agrees`:
# a token within the tolerance of the reference's best ties with it).
TOP1_MIN = {"fp32": 1.0, "fp16": 0.99, "bf16": 0.95, "int8": 0.9, "int8-dynamic": 0.9}


def meaningful(graph: Any, output: Any, feeds: dict[str, np.ndarray], shape: tuple[int, ...]) -> np.ndarray | None:
    """Bool mask (broadcastable to `shape`) of the output positions that mean something, or None for all.

    Outputs at padded positions are garbage by definition: a position is meaningful when every mask input
    over (batch, X) marks it 1, for outputs that have both axes, or that hold X's last position (`last_of`: a
    decode step's logits); rows whose mask is all 0 (fully padded) are dropped from every output with a batch
    axis. Non-finite values are still counted everywhere."""
    if "batch" not in output.dims:
        return None
    dims = list(output.dims)
    keep = np.ones((1,) * len(shape), dtype=bool)  # grows by broadcasting, never to the full shape
    any_mask = False
    for t in graph.inputs:
        if t.kind != "mask" or len(t.dims) != 2 or t.dims[0] != "batch":
            continue
        m = feeds[t.name] != 0  # (B, X)
        any_mask = True
        b_ax = dims.index("batch")
        row = m.any(axis=1)  # (B,): False for a fully padded row
        keep = keep & np.expand_dims(row, [a for a in range(len(shape)) if a != b_ax])
        if t.dims[1] == output.last_of:  # the output holds the last position of X: its row means something there
            keep = keep & np.expand_dims(m[:, -1], [a for a in range(len(shape)) if a != b_ax])
        if t.dims[1] in dims:
            x_ax = dims.index(t.dims[1])
            # move (B, X) onto output axes (b_ax, x_ax); other axes broadcast
            mm = m if b_ax < x_ax else m.T
            keep = keep & np.expand_dims(mm, [a for a in range(len(shape)) if a not in (b_ax, x_ax)])
    return keep if any_mask else None


def top1_agrees(ref: np.ndarray, cand: np.ndarray, tol: Tolerance) -> np.ndarray:
    """Per position (all axes but the last): does the candidate's top-1 token agree with the reference's?

    A token whose reference logit is within the precision's elementwise tolerance (atol + rtol * |max|) of the
    reference maximum ties with it at that precision, so picking it is agreement; a disagreement is a pick the
    reference ranks lower by more than the tolerance allows. Without this, near-tied positions (a trained model
    fed random ids it never saw in training: half of the tiny GPT's parity ids) failed fp16 on a one-in-a-hundred
    flip between two logits 0.01 apart, a verdict about the input, not the deployment."""
    # max and gather are exact in the reference's own dtype: only their results are widened (a float64 copy of
    # GPT-2's 1 x 1024 x 50257 logits was 0.4 GB and a second of the int8 search's every comparison)
    r = np.asarray(ref)
    best = r.max(axis=-1).astype(np.float64)
    picked = np.take_along_axis(r, np.argmax(cand, axis=-1)[..., None], axis=-1)[..., 0].astype(np.float64)
    return picked >= best - (tol.atol + tol.rtol * np.abs(best))


@dataclass(frozen=True)
class OutputCheck:
    """One output of one graph on one input case through one runner, against the PyTorch fp32 reference.

    `comparison` holds the tensor metrics (deploy/metrics.py; `Comparison.not_compared` when no comparison was
    possible: a shape mismatch or a runner error); `passed`/`reason` are the verdict, which adds to the
    comparison's a finite reference and, for outputs named *logits, top-1 agreement."""

    runner: str
    precision: str  # the precision whose tolerance applies
    artifact_precision: str
    graph: str
    case: str
    output: str
    comparison: Comparison
    tolerance: Tolerance  # after the per-output overrides
    passed: bool
    reason: str
    ref_nonfinite: int = 0  # NaN/Inf in the reference itself: the model is broken before any deployment
    top1: float | None = None  # fraction of meaningful positions whose argmax agrees (outputs named *logits)

    def as_dict(self) -> dict[str, Any]:
        """Flat JSON-ready fields (`xdeploy parity --json`): the comparison's metrics beside the tolerance's."""
        metrics = {k: v for k, v in dataclasses.asdict(self.comparison).items() if k not in ("passed", "reason")}
        return {"runner": self.runner, "precision": self.precision, "artifact_precision": self.artifact_precision,
                "graph": self.graph, "case": self.case, "output": self.output, **metrics,
                "ref_nonfinite": self.ref_nonfinite, "top1": self.top1, "atol": self.tolerance.atol,
                "rtol": self.tolerance.rtol, "min_cosine": self.tolerance.cosine, "passed": self.passed,
                "reason": self.reason}


def tolerance_precision(artifact_precision: str, runner_precision: str) -> str:
    """The looser of the artifact's precision and the runner's compute precision (ov:bf16 on fp32 -> bf16)."""
    known = [p for p in (artifact_precision, runner_precision) if p in PRECISION_ORDER]
    return max(known, key=PRECISION_ORDER.index) if known else "fp32"


def judged_precision(runner: str, artifact_precision: str, computed: str) -> str:
    """Whose tolerance judges runner `runner` (a spec, e.g. "ov:bf16") that reports computing in `computed`
    (`RunnerInfo.precision`: what it really computes, e.g. f32 for a bf16 hint on a CPU without bf16): the torch
    runner computes from the reference weights, never the artifact's graph, so only its own precision counts;
    every other runner gets the looser of the artifact's and its own."""
    return computed if runner.partition(":")[0] == "torch" else tolerance_precision(artifact_precision, computed)


def output_tolerance(base: Tolerance, output: str, overrides: dict[str, dict[str, float]] | None) -> Tolerance:
    ov = {**(overrides or {}).get("*", {}), **(overrides or {}).get(output, {})}
    return dataclasses.replace(base, **ov) if ov else base


def check_outputs(ref: dict[str, np.ndarray], cand: dict[str, np.ndarray], case: InputCase, graph: Any, *,
                  runner: str, precision: str, artifact_precision: str, tol: Tolerance,
                  overrides: dict[str, dict[str, float]] | None = None,
                  outputs: Sequence[str] | None = None) -> list[OutputCheck]:
    """Compare every output of one case (or only `outputs`: a runner opened for a subset of the graph's outputs);
    the verdict adds top-1 agreement for logits and a finite reference."""
    checks = []
    for t in graph.outputs:
        if outputs is not None and t.name not in outputs:
            continue
        r, c = ref[t.name], cand[t.name]
        otol = output_tolerance(tol, t.name, overrides)
        where = {"runner": runner, "precision": precision, "artifact_precision": artifact_precision,
                 "graph": graph.name, "case": case.name, "output": t.name, "tolerance": otol}
        if r.shape != c.shape:
            why = f"shape {c.shape} != reference {r.shape}"
            checks.append(OutputCheck(**where, comparison=Comparison.not_compared(why), passed=False, reason=why))
            continue
        mask = meaningful(graph, t, case.feeds, r.shape)
        cmp = compare(r, c, otol, mask=mask)
        ref_bad = int(np.count_nonzero(~np.isfinite(r)))
        top1 = None
        if t.name.endswith("logits") and r.ndim >= 2:
            agree = top1_agrees(r, c, otol)  # shape[:-1]
            m = None if mask is None else np.broadcast_to(mask, r.shape)[..., 0]
            sel = agree if m is None else agree[m]
            top1 = float(sel.mean()) if sel.size else 1.0
        passed, reason = cmp.passed, cmp.reason
        if ref_bad:
            passed, reason = False, f"reference has {ref_bad} NaN/Inf"
        elif passed and top1 is not None and top1 < TOP1_MIN.get(precision, 1.0):
            passed, reason = False, f"top-1 agreement {top1:.4f} < {TOP1_MIN.get(precision, 1.0)}"
        checks.append(OutputCheck(**where, comparison=cmp, passed=passed, reason=reason, ref_nonfinite=ref_bad,
                                  top1=top1))
    return checks
