"""Machine-class-honest results: `machine_class` names vendor, model and the matrix ISA, and both the `xdeploy run`
summary header and the report's machine section carry it (a speed-up measured on one class is not another's)."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from xdeploy.commands.run import _print_summary
from xdeploy.core.fingerprint import machine_class
from xdeploy.reports.render import render_summary

XEON_AMX = {"cpu_model": "Intel(R) Xeon(R) Platinum 8480+", "cpu_vendor": "GenuineIntel", "cpu_family": "6",
            "cpu_model_id": "143", "logical_cpus": 2, "threads": {"affinity_cpus": 2},
            "isa": ["amx_bf16", "amx_int8", "amx_tile", "avx2", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx512f"]}
ZEN5 = {"cpu_model": "AMD EPYC 9B45", "cpu_vendor": "AuthenticAMD", "cpu_family": "26", "cpu_model_id": "2",
        "logical_cpus": 4, "isa": ["avx2", "avx512_bf16", "avx512_vnni", "avx512f"]}
OLD = {"cpu_model": "Some CPU", "cpu_vendor": "", "isa": ["avx2", "fma"]}


def test_machine_class_names_vendor_model_and_matrix_isa() -> None:
    xeon = machine_class(XEON_AMX)
    assert xeon.startswith("Intel: Intel(R) Xeon(R) Platinum 8480+ (family 6, model 143)")
    assert "AMX bf16 int8" in xeon and "AVX-512 bf16 vnni fp16" in xeon and xeon.endswith("2 CPUs")
    zen = machine_class(ZEN5)
    assert zen.startswith("AMD: AMD EPYC 9B45") and "AMX" not in zen and "AVX-512 bf16 vnni" in zen
    assert "AVX2" in machine_class(OLD) and "unknown vendor" in machine_class(OLD)


def test_run_summary_header_and_report_say_the_machine_class() -> None:
    rec = {"kind": "custom", "fingerprint": ZEN5}  # a record of no table: only its fingerprint matters here
    buf = io.StringIO()
    result = SimpleNamespace(records=[rec], errors=[], out=Path("o"), parity_failures=[], duration_s=1.0)
    _print_summary(Console(file=buf, width=200), result)
    first = buf.getvalue().splitlines()[0]
    assert first.startswith("machine class: AMD: AMD EPYC 9B45") and "AVX-512 bf16 vnni" in first
    md = render_summary([rec], {"title": "t"}, [])
    assert f"- machine class: {machine_class(ZEN5)}" in md
