"""The text of every measured quantity: the one place a number becomes what a person reads.

Measurement modules (bench/, serve/) return numbers; the terminal tables of the commands, their log lines and
summary.md are all formatted here (reports/tables.py lays the cells out as tables). One formatter per quantity
and one glyph set, so a figure reads the same wherever it is printed:

    speed-up        '3.41× (3.30–3.52)', '1.07× (1.02–1.47) wide', 'unstable (load)', '–'
    % of peak       '87%', '> peak (peak underestimated)', '–'
    seconds, bytes, rates, plain numbers; '–' for "no figure" and for a range, '×' for a ratio

Pure functions over floats and records; rich is imported only by `TextTable.rich`, so `xdeploy report` and
the studies render without it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from xdeploy.core.records import identity, speedup_interval, speedup_wide, stability_block

NONE = "–"  # a cell without a figure (not measured, not applicable)
RANGE = "–"  # between the ends of an interval or a range
TIMES = "×"  # a speed-up: how many times faster than the baseline


# -------------------------------------------------------------------------------------------- speed-up ----

def unstable_text(cause: str | None) -> str:
    """What replaces a speed-up whose comparison stayed unstable: 'unstable (load)' or 'unstable (noise)'."""
    return f"unstable ({cause or 'noise'})"


def speedup(x: float | None, interval: tuple[float, float] | None = None, *, wide: bool = False,
            unstable: str | None = None, digits: int = 2) -> str:
    """'3.41× (3.30–3.52)' (paired median and its 95% interval), '1.07× (1.02–1.47) wide' (the interval stayed
    wider than the comparison's target), '3.41×' (a p50 ratio: no interval), 'unstable (load)' when the
    comparison stayed unstable (never a figure then), '–' without one."""
    if unstable:
        return unstable_text(unstable)
    if x is None:
        return NONE
    ci = f" ({interval[0]:.{digits}f}{RANGE}{interval[1]:.{digits}f})" if interval else ""
    return f"{x:.{digits}f}{TIMES}{ci}" + (" wide" if wide else "")


def speedup_of(stability: Mapping[str, Any] | None, *, digits: int = 2) -> str:
    """`speedup` of one candidate's stability block (bench/interleave.py `Comparison.stability`, a record's
    `stability`); '–' for the baseline itself and for blocks without a paired figure."""
    if not stability or not stability.get("speedup"):
        return NONE
    if not stability["stable"]:
        return unstable_text(stability.get("cause"))
    sp = stability["speedup"]
    return speedup(sp["median"], (sp["low"], sp["high"]), wide=bool(stability.get("wide")), digits=digits)


def record_speedup(r: Mapping[str, Any], sp: Mapping[tuple[Any, ...], float],
                   unst: Mapping[tuple[Any, ...], str]) -> str:
    """`speedup` of a latency record, from core/records.py's `speedups` (sp) and `unstable` (unst) of its set."""
    ident = identity(r)
    return speedup(sp.get(ident), speedup_interval(r), wide=speedup_wide(r), unstable=unst.get(ident))


def record_speedup_of(r: Mapping[str, Any]) -> str:
    """`speedup_of` a record's own stability block (decode records: their speed-up is not keyed by identity)."""
    return speedup_of(stability_block(r))


# ------------------------------------------------------------------------------------------- % of peak ----

def pct_of_peak(pct: float | None, digits: int = 0, *, peak: str = "peak", why: str = "peak underestimated") -> str:
    """'87%', '–' when not measured, and never a figure above 100%: such a figure beat a `peak` that was
    underestimated (bench/roofline.py `reconcile` re-measures a GEMM peak; older records may still carry one)."""
    if pct is None:
        return NONE
    if pct > 100.0:
        return f"> {peak} ({why})"
    return f"{pct:.{digits}f}%"


# ------------------------------------------------------------------------------------- units, numbers ----

def fmt_s(s: float | None) -> str:
    """Seconds in the unit that keeps 3-4 significant digits: '1.20 s', '3.41 ms', '812.0 µs'."""
    if s is None:
        return NONE
    if s >= 1.0:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def fmt_bytes(b: float | None) -> str:
    """Binary units: '1.5 GiB', '310.0 MiB', '12 B'."""
    if b is None:
        return NONE
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b:.0f} B"


def fmt_rate(x: float | None, unit: str = "") -> str:
    """Decimal prefixes, 3 significant digits: '412 GFLOP/s', '1.2 kB/s'."""
    if x is None:
        return NONE
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def fmt_num(x: float | None, spec: str = ".3g") -> str:
    return NONE if x is None else format(x, spec)


def fmt_ms(s: float | None, digits: int = 2) -> str:
    """Seconds as a bare number of milliseconds, for columns whose header carries the unit ('p50 ms')."""
    return NONE if s is None else f"{s * 1e3:.{digits}f}"


def fmt_mib(b: float | None) -> str:
    """Bytes as a bare number of MiB, for columns whose header carries the unit."""
    return NONE if b is None else f"{b / 2**20:.0f}"


def fmt_share(x: float) -> str:
    """A fraction as a whole percentage: '43%'."""
    return f"{x:.0%}"


# ----------------------------------------------------------------------------------------------- lines ----

def latency_line(r: Mapping[str, Any]) -> str:
    """One latency record as it is measured (`xdeploy bench`'s progress line)."""
    lat = r["latency_s"]
    return (f"{r['runner']:>10s} {r['artifact_precision']:>5s} b{r['batch']} s{r['seq'] or NONE}: "
            f"p50 {fmt_ms(lat['p50'])} ms p99 {fmt_ms(lat['p99'])} ms, "
            f"{fmt_rate(r['achieved_flops'], 'FLOP/s')} ({pct_of_peak(r['pct_of_peak'])} of peak)")


def best_line(b: Mapping[str, Any]) -> str:
    """One row of bench/suite.py `best_vs_baseline`: the fastest runner of a configuration, its speed-up over
    the baseline and % of its GEMM peak, each against its target (core/targets.py)."""
    from xdeploy.core.targets import TARGETS

    speedup_t, peak_t = TARGETS["speedup_vs_eager"], TARGETS["pct_of_gemm_peak"]
    vs = b.get("baseline", "PyTorch eager fp32")
    parity = {True: "parity pass", None: "parity not checked"}.get(b["parity_passed"], "parity FAIL")
    if b["speedup"] is None:
        sp = f"speed-up {unstable_text(b['unstable'])} vs {vs}"
    else:
        sp = (f"{speedup(b['speedup'], b['speedup_interval'])} {vs} "
              f"({'meets' if b['meets_speedup'] else 'misses'} {speedup_t.text()})")
    return (f"best for {b['model']} {b['preset'] or ''} b{b['batch']} s{b['seq'] or NONE}: {b['runner']} "
            f"({b['artifact_precision']} graph, {b['precision']} compute) p50 {fmt_ms(b['p50_s'])} ms = {sp}, "
            f"{pct_of_peak(b['pct_of_peak'])} of the {b['precision']} GEMM peak "
            f"({'meets' if b['meets_peak'] else 'misses'} {peak_t.text()}), {parity}")


# ---------------------------------------------------------------------------------------------- tables ----

def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table (summary.md, and the studies' output); `|` in cells is escaped."""
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|")

    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(out)


# A terminal cell that starts with one of these is coloured: the same words summary.md prints plainly.
_STYLES = (("unstable", "yellow"), ("FAIL", "red"), ("**FAIL**", "red"))


@dataclass(frozen=True)
class TextTable:
    """A table of formatted cells: `markdown()` for summary.md, `rich()` for the terminal, so both show the
    same rows from the same row function (reports/tables.py)."""

    header: Sequence[str]
    rows: Sequence[Sequence[Any]]
    title: str = ""
    caption: str | None = None
    left: Collection[str] = ()  # columns aligned left in the terminal (names, labels); the rest are figures

    def markdown(self) -> str:
        return markdown_table(self.header, self.rows)

    def rich(self) -> Any:
        from rich.table import Table
        from rich.text import Text

        t = Table(title=self.title or None, caption=self.caption)
        for c in self.header:
            t.add_column(c, justify="left" if c in self.left else "right")
        for row in self.rows:
            # Text, not markup: a cell such as "pip install 'xdeploy[gpu]'" must print as it is
            t.add_row(*(Text(str(v), style=next((s for w, s in _STYLES if str(v).startswith(w)), ""))
                        for v in row))
        return t
