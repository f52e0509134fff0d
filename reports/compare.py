"""Compare two reports record by record and flag regressions (for CI: `xdeploy report compare A B`).

Records match on their identity (core/records.py `IDENTITY`: kind + model, preset, graph, runner, precisions,
batch, seq, T, lowering, mode, ...). The compared quantity is a time in seconds (lower is better): latency p50
for latency and scale records, the per-token p50 for decode records. A slowdown is a *regression* only when it
exceeds BOTH

    the relative threshold             (b - a) / a > threshold          (default 10%)
    the recorded noise                 b - a > (p90_a - p50_a) + (p90_b - p50_b)

so a shared, noisy machine does not fail CI on jitter that its own measurements show. Parity records regress
when a check that passed in A fails in B. Records present in only one run are listed, never flagged.

Timings compare only within one machine class (core/fingerprint.py `machine_class`: vendor, model, matrix ISA,
CPUs): two runs measured on different classes are refused, unless `across_machines` is given; then their timing
changes are shown with the status "other machine" and never counted (a Zen 5 run against a Xeon AMX reference
says how the machines differ, not whether the code got slower). Parity verdicts still compare.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from xdeploy.core.errors import XDeployError
from xdeploy.core.fingerprint import machine_class
from xdeploy.core.records import IDENTITY
from xdeploy.reports.render import load_results

DEFAULT_THRESHOLD = 0.10

# The kinds compared (timed ones, and parity verdicts); their identity fields are core/records.py's IDENTITY.
COMPARED = ("latency", "scale", "decode", "parity")

_PREFIX = {"batch": "b", "seq": "s", "T": "T=", "d_model": "d", "n_layers": "L", "prompt_len": "prompt=",
           "new_tokens": "new="}


@dataclass(frozen=True)
class Row:
    """One matched (or unmatched) record. Times in seconds; None where the side has no such record."""

    kind: str
    key: str
    metric: str
    a: float | None
    b: float | None
    spread: float | None  # (p90 - p50) of A + of B: the noise band a change must exceed
    change: float | None  # (b - a) / a
    status: str  # "ok" | "regression" | "improvement" | "noise" | "other machine" | "only in A" | "only in B"


@dataclass(frozen=True)
class Comparison:
    rows: tuple[Row, ...]
    threshold: float
    machines_a: tuple[str, ...] = ()  # machine classes of A's records (those that carry a fingerprint)
    machines_b: tuple[str, ...] = ()

    @property
    def same_machine(self) -> bool:
        return _same_class(self.machines_a, self.machines_b)

    @property
    def regressions(self) -> tuple[Row, ...]:
        return tuple(r for r in self.rows if r.status == "regression")

    def as_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "regressions": len(self.regressions),
                "machines_a": list(self.machines_a), "machines_b": list(self.machines_b),
                "same_machine": self.same_machine, "rows": [asdict(r) for r in self.rows]}


def _same_class(a: Sequence[str], b: Sequence[str]) -> bool:
    """Both runs on one machine class (or a side without fingerprints: nothing says they differ)."""
    return not a or not b or set(a) == set(b)


def machine_classes(records: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """The machine classes the records were measured on (sorted; records without a fingerprint add none)."""
    return tuple(sorted({machine_class(r["fingerprint"]) for r in records if isinstance(r.get("fingerprint"), dict)}))


def identity(rec: Mapping[str, Any]) -> tuple[str, str] | None:
    kind = rec.get("kind")
    if kind not in COMPARED:
        return None
    fields = IDENTITY[kind]
    # Compact but unique: strings as they are, numbers with a short prefix ("b1 s128", "T=512").
    parts: list[str] = []
    for f in fields:
        v = rec.get(f)
        if v is None or (f == "precision" and v == rec.get("artifact_precision")):
            continue  # the compute precision is only shown when it differs from the artifact's
        parts.append(f"{_PREFIX.get(f, f + '=')}{v}" if isinstance(v, int) else str(v))
    return kind, " ".join(parts)


def measurement(rec: Mapping[str, Any]) -> tuple[str, float, float] | None:
    """(metric name, p50 seconds, p90 - p50 seconds) of a timed record; None for untimed kinds."""
    kind = rec["kind"]
    if kind in ("latency", "scale"):
        lat = rec["latency_s"]
        return "latency p50", float(lat["p50"]), float(lat["p90"] - lat["p50"])
    if kind == "decode" and rec["step_s"]:
        p50, p90 = np.percentile(np.asarray(rec["step_s"], dtype=np.float64), [50, 90])
        return "per-token p50", float(p50), float(p90 - p50)
    return None


def _index(records: Sequence[Mapping[str, Any]], which: str) -> dict[tuple[str, str], Mapping[str, Any]]:
    out: dict[tuple[str, str], Mapping[str, Any]] = {}
    for r in records:
        ident = identity(r)
        if ident is None:
            continue
        if ident in out:
            raise XDeployError(f"run {which} has two {ident[0]} records for {ident[1]}; expected one per configuration")
        out[ident] = r
    return out


def compare_records(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]], *,
                    threshold: float = DEFAULT_THRESHOLD, across_machines: bool = False) -> Comparison:
    if not 0 <= threshold < 10:
        raise XDeployError(f"threshold must be a fraction in [0, 10) (0.10 = 10%); got {threshold}")
    ma_, mb_ = machine_classes(a), machine_classes(b)
    same = _same_class(ma_, mb_)
    if not same and not across_machines:
        raise XDeployError(f"A was measured on '{' + '.join(ma_)}', B on '{' + '.join(mb_)}': timings of different "
                           "machine classes do not compare; measure the baseline on this class, or pass "
                           "--across-machines to see them side by side (timing changes then never count)")
    ia, ib = _index(a, "A"), _index(b, "B")
    rows: list[Row] = []
    for ident in sorted(set(ia) | set(ib)):
        kind, key = ident
        ra, rb = ia.get(ident), ib.get(ident)
        if kind == "parity":
            pa = None if ra is None else bool(ra["passed"])
            pb = None if rb is None else bool(rb["passed"])
            status = ("only in A" if rb is None else "only in B" if ra is None else
                      "regression" if pa and not pb else "improvement" if pb and not pa else "ok")
            rows.append(Row(kind, key, "max abs error", None if ra is None else ra["max_abs"],
                            None if rb is None else rb["max_abs"], None, None, status))
            continue
        ma = measurement(ra) if ra is not None else None
        mb = measurement(rb) if rb is not None else None
        if ma is None and mb is None:
            continue
        metric = (ma or mb)[0]  # type: ignore[index]
        if ma is None or mb is None:
            rows.append(Row(kind, key, metric, ma and ma[1], mb and mb[1], None, None,
                            "only in A" if mb is None else "only in B"))
            continue
        (_, va, sa), (_, vb, sb) = ma, mb
        spread = sa + sb
        change = (vb - va) / va if va > 0 else None
        if change is None:
            status = "ok"
        elif change > threshold:
            status = "regression" if vb - va > spread else "noise"
        elif change < -threshold:
            status = "improvement" if va - vb > spread else "noise"
        else:
            status = "ok"
        if not same and status != "ok":
            status = "other machine"  # shown, never counted: the machines differ, not (only) the code
        rows.append(Row(kind, key, metric, va, vb, spread, change, status))
    return Comparison(tuple(rows), threshold, ma_, mb_)


def compare_runs(run_a: str, run_b: str, *, threshold: float = DEFAULT_THRESHOLD,
                 across_machines: bool = False) -> Comparison:
    """Compare two report directories (or their results.json files)."""
    return compare_records(load_results(run_a)["records"], load_results(run_b)["records"], threshold=threshold,
                           across_machines=across_machines)


def render_table(c: Comparison, title: str = "") -> Any:
    """A rich Table of the comparison (regressions in red, improvements in green)."""
    from rich.table import Table

    from xdeploy.reports.text import NONE, fmt_num, fmt_s

    t = Table(title=title or f"report compare (threshold {100 * c.threshold:.0f}%, noise = p90-p50 of A + B)")
    for col, just in (("kind", "left"), ("configuration", "left"), ("metric", "left"), ("A", "right"),
                      ("B", "right"), ("change", "right"), ("noise", "right"), ("status", "left")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    style = {"regression": "bold red", "improvement": "green", "noise": "yellow", "other machine": "yellow"}
    for r in c.rows:
        fmt = fmt_num if r.kind == "parity" else fmt_s
        t.add_row(r.kind, r.key, r.metric, fmt(r.a), fmt(r.b),
                  NONE if r.change is None else f"{100 * r.change:+.1f}%", fmt_s(r.spread) if r.spread else NONE,
                  f"[{style[r.status]}]{r.status}[/]" if r.status in style else r.status)
    return t
