"""Parity metrics: the verdict for one candidate tensor against its reference.

Kept apart from the backends: everything here takes numpy arrays, so the CLI, the layerwise divergence
finder (verify/layerwise.py), the fp16 mixed-precision step and the golden probes the runtimes check where they
run (deploy/probes.py) share one definition of "close enough". It lives in deploy/, below verify/, because the
runtimes (the Embedder, the Generator: deploy/) judge their own outputs; it needs only numpy and `Tolerance`.

The verdict follows `Tolerance` (models/spec.py): a tensor passes when every compared element is within
atol + rtol*|ref|, OR its cosine similarity to the reference is >= tol.cosine. On top of that, a candidate
must not be NaN/Inf where the reference is finite: a non-finite value fails regardless of the other metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

import numpy as np

from xdeploy.models.spec import Tolerance

# Reference magnitudes at or above this are "infinite-like" (e.g. finfo(float32).min used as a mask value):
# a candidate that saturates them (fp16 max 65504 or ±inf, same sign) matches rather than fails.
HUGE = 1e30


@dataclass(frozen=True)
class Comparison:
    """How one candidate tensor compares with the reference (floats; rendered only for display).

    max_rel is taken over elements with |ref| > atol (relative error of near-zeros is meaningless; atol judges
    them). `within` is the fraction of compared elements inside atol + rtol*|ref|; `nonfinite` counts NaN/Inf in
    the candidate where the reference is finite (over the whole tensor, padded positions included)."""

    max_abs: float
    max_rel: float
    mean_abs: float
    cosine: float
    within: float
    nonfinite: int
    compared: int  # elements compared (finite in both, meaningful positions)
    passed: bool
    reason: str  # "" when passed; otherwise a short phrase ("2 NaN/Inf", "cosine 0.97 < 0.999")

    @classmethod
    def not_compared(cls, reason: str) -> Comparison:
        """No comparison was possible (shape mismatch, the runner failed): NaN metrics, failed with `reason`."""
        nan = float("nan")
        return cls(max_abs=nan, max_rel=nan, mean_abs=nan, cosine=nan, within=nan, nonfinite=0, compared=0,
                   passed=False, reason=reason)


@overload
def cosine(a: np.ndarray, b: np.ndarray, axis: None = None) -> float: ...
@overload
def cosine(a: np.ndarray, b: np.ndarray, axis: int) -> np.ndarray: ...


def cosine(a: np.ndarray, b: np.ndarray, axis: int | None = None) -> float | np.ndarray:
    """Cosine similarity in float64: of the flattened arrays (axis None, a float), or of each vector along
    `axis` (e.g. one per sentence of (N, D) embeddings with axis=1: an (N,) array). 1.0 where both vectors are
    all zero, 0.0 where only one is (the one definition used by parity, the studies and the tests)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if axis is None:
        a, b = a.ravel(), b.ravel()
    na, nb = np.linalg.norm(a, axis=axis), np.linalg.norm(b, axis=axis)
    dot = np.dot(a, b) if axis is None else np.sum(a * b, axis=axis)
    cos = _cosine_rule(dot, na, nb)
    return float(cos) if axis is None else cos


def _cosine_rule(dot: np.ndarray | float, na: np.ndarray | float, nb: np.ndarray | float) -> np.ndarray:
    """dot / (|a| |b|), with 1.0 where both vectors are zero and 0.0 where only one is."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((na == 0) & (nb == 0), 1.0, np.where((na == 0) | (nb == 0), 0.0, dot / (na * nb)))


CHUNK = 1 << 21  # elements compared at a time: float64 temporaries of a few MB, not of a 0.8 GB logits tensor


def compare(ref: np.ndarray, cand: np.ndarray, tol: Tolerance, *, mask: np.ndarray | None = None) -> Comparison:
    """Compare `cand` with `ref` (same shape; any float dtype, computed in float64).

    `mask` (bool, broadcastable to the shape) selects the meaningful positions whose values are compared;
    non-finite candidate values are counted everywhere, since even garbage positions must stay finite.
    Computed in chunks of CHUNK elements and merged (sums, maxima, counts), so the float64 copies stay small
    (GPT-2's logits at 1 x 1024 are 51M elements: whole-tensor temporaries took seconds and gigabytes)."""
    if ref.shape != cand.shape:
        raise ValueError(f"shape mismatch: reference {ref.shape} vs candidate {cand.shape}")
    rf, cf = np.asarray(ref).reshape(-1), np.asarray(cand).reshape(-1)
    mf = None if mask is None else np.broadcast_to(np.asarray(mask, dtype=bool), ref.shape).reshape(-1)
    nonfinite = n = within_n = 0
    max_abs = max_rel = sum_abs = dot = na2 = nb2 = 0.0
    for k in range(0, rf.size, CHUNK):
        r = rf[k:k + CHUNK].astype(np.float64)
        c = cf[k:k + CHUNK].astype(np.float64)
        r_abs = np.abs(r)
        r_inf = r_abs >= HUGE
        r_inf |= ~np.isfinite(r)
        c_fin = np.isfinite(c)
        # Where the reference is NaN/±inf/huge the candidate must be the same kind: NaN for NaN, a saturated
        # value (>= fp16 max) of the same sign for ±inf/huge.
        if r_inf.any():
            rr, cc = r[r_inf], c[r_inf]
            with np.errstate(invalid="ignore"):
                sat_ok = np.where(np.isnan(rr), np.isnan(cc),
                                  (np.sign(cc) == np.sign(rr)) & (~np.isfinite(cc) | (np.abs(cc) >= 65504.0)))
            nonfinite += int(np.count_nonzero(~sat_ok))
        nonfinite += int(c_fin.size - np.count_nonzero(c_fin | r_inf))  # candidate non-finite where ref is finite
        sel = c_fin & ~r_inf
        if mf is not None:
            sel &= mf[k:k + CHUNK]
        if sel.all():  # the common case: no copies of the chunk
            rs, cs, ar = r, c, r_abs
        else:
            rs, cs, ar = r[sel], c[sel], r_abs[sel]
        if not rs.size:
            continue
        n += int(rs.size)
        d = np.subtract(cs, rs)
        np.abs(d, out=d)
        max_abs, sum_abs = max(max_abs, float(d.max())), sum_abs + float(d.sum())
        big = ar > tol.atol
        if big.any():
            max_rel = max(max_rel, float(np.divide(d, ar, out=np.zeros_like(d), where=big).max()))
        bound = ar * tol.rtol
        bound += tol.atol
        within_n += int(np.count_nonzero(d <= bound))
        dot, na2, nb2 = dot + float(np.dot(rs, cs)), na2 + float(np.dot(rs, rs)), nb2 + float(np.dot(cs, cs))
    if n:
        mean_abs, within, cos = sum_abs / n, within_n / n, float(_cosine_rule(dot, np.sqrt(na2), np.sqrt(nb2)))
    else:
        max_abs = max_rel = mean_abs = 0.0
        within, cos = 1.0, 1.0

    if nonfinite:
        passed, reason = False, f"{nonfinite} NaN/Inf"
    elif within == 1.0 or cos >= tol.cosine:
        passed, reason = True, ""
    else:
        passed = False
        reason = f"max_abs {max_abs:.3g} > atol+rtol*|ref| and cosine {cos:.6f} < {tol.cosine}"
    return Comparison(max_abs=max_abs, max_rel=max_rel, mean_abs=mean_abs, cosine=cos, within=within,
                      nonfinite=nonfinite, compared=n, passed=passed, reason=reason)
