"""Benchmark records: one JSON object per measurement, stored as JSON lines, validated against SCHEMA.

Every record has the common fields (schema, version, kind, timestamp, fingerprint) plus the fields of its kind:
"latency" (`xdeploy bench`), "roofline" (`xdeploy roofline`), "scale" and "profile" (`xdeploy scale`). Measured
quantities are floats in SI units (seconds, bytes, FLOP/s); counts and sizes are ints; a quantity that could
not be measured on this machine is null (e.g. GPU device memory on a CPU-only machine). docs/benchmarks.md
documents every field; `validate_record` is the executable form of that table.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import atomic_write_text

SCHEMA = "xdeploy-bench"
VERSION = 1

# field -> (allowed JSON types, nullable). "num" = int or float, finite. Extra fields are rejected so that
# typos cannot silently produce records the report renderer ignores.
_NUM, _INT, _STR, _BOOL, _OBJ = "num", "int", "str", "bool", "obj"
LATENCY_STATS = ("p50", "p90", "p99", "mean", "std", "min", "max")
MEMORY_FIELDS = ("weights_bytes", "load_peak_bytes", "activations_bytes", "peak_rss_bytes", "device_bytes")

COMMON: dict[str, tuple[str, bool]] = {
    "schema": (_STR, False), "version": (_INT, False), "kind": (_STR, False), "timestamp": (_STR, False),
    "fingerprint": (_OBJ, False), "note": (_STR, True),
}
KINDS: dict[str, dict[str, tuple[str, bool]]] = {
    "latency": {
        "model": (_STR, False), "preset": (_STR, True), "graph": (_STR, False), "runner": (_STR, False),
        "device": (_STR, False), "precision": (_STR, False), "artifact_precision": (_STR, False),
        "opset": (_INT, True), "attn_impl": (_STR, True), "threads": (_INT, False),
        "batch": (_INT, False), "seq": (_INT, True), "sizes": (_OBJ, False),
        "latency_s": (_OBJ, False), "iterations": (_INT, False), "timed_s": (_NUM, False),
        "items_per_s": (_NUM, False), "tokens_per_s": (_NUM, True),
        "flops": (_NUM, False), "achieved_flops": (_NUM, False), "peak_flops": (_NUM, True),
        "pct_of_peak": (_NUM, True), "memory": (_OBJ, False),
        "parity_passed": (_BOOL, True),  # null: not checked (bench --parity checks against PyTorch fp32)
        # interleaved, paired measurement (bench/interleave.py Comparison.stability): stable, cause, reasons,
        # rounds, rel_iqr, max_over_min, speedup {median, low, high} vs `baseline`, load, thresholds
        "stability": (_OBJ, True),
    },
    "roofline": {
        "measure": (_STR, False),  # "gemm" | "memory"
        "precision": (_STR, True),  # gemm: fp32 | bf16 | fp16 | int8; memory: null
        "path": (_STR, False),  # which implementation achieved it, e.g. "torch.matmul n=2048 threads=2"
        "value": (_NUM, False),  # FLOP/s (gemm) or bytes/s (memory)
        "unit": (_STR, False),  # "FLOP/s" | "B/s"
        "trials": (_OBJ, False),  # list of {path, value} for every configuration tried
    },
    "scale": {
        "model": (_STR, False), "runner": (_STR, False), "lowering": (_STR, False), "T": (_INT, False),
        "batch": (_INT, False), "d_model": (_INT, False), "n_heads": (_INT, False), "n_layers": (_INT, False),
        "latency_s": (_OBJ, False), "iterations": (_INT, False), "memory": (_OBJ, True),
        "flops": (_NUM, False), "attn_flops": (_NUM, False), "score_bytes": (_NUM, False),
        "achieved_flops": (_NUM, False),
        "patch_size": (_INT, True),  # ViT rows: T is the token count of this patch size; null otherwise
    },
    "loadtest": {  # xdeploy loadtest: one concurrency level against a Triton embedding server on loopback
        "target": (_STR, False), "server": (_STR, False), "model": (_STR, False), "protocol": (_STR, False),
        "concurrency": (_INT, False), "batch": (_INT, False),  # client threads; sentences per request
        "requests": (_INT, False), "errors": (_INT, False), "sentences": (_INT, False),  # sentences served
        "timed_s": (_NUM, False), "requests_per_s": (_NUM, False), "sentences_per_s": (_NUM, False),
        "latency_s": (_OBJ, False),  # per request, of successful requests (of errors if none succeeded)
    },
    "profile": {  # onnxruntime profiler: kernel time per op type at one T (xdeploy scale)
        "model": (_STR, False), "runner": (_STR, False), "lowering": (_STR, False), "T": (_INT, False),
        "batch": (_INT, False),
        "shares": (_OBJ, False),  # {attention, matmul, normalization, other}: fractions of kernel time
        "op_times_s": (_OBJ, False),  # {op_type: seconds per call}
        "total_s": (_NUM, False),  # summed kernel time per call
    },
}


# Fields added after version 1 was written: older records may lack them (read as null); new ones must have them.
ADDED: dict[str, frozenset[str]] = {"latency": frozenset({"stability"})}


def now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def make_record(kind: str, fingerprint: Mapping[str, Any], **fields: Any) -> dict[str, Any]:
    """A validated record dict of `kind` (timestamp filled in)."""
    rec = {"schema": SCHEMA, "version": VERSION, "kind": kind, "timestamp": now(),
           "fingerprint": dict(fingerprint), "note": fields.pop("note", None)} | fields
    missing_added = ADDED.get(kind, frozenset()) - set(fields)
    if missing_added:
        raise XDeployError(f"invalid {kind} record: missing {sorted(missing_added)}")
    validate_record(rec)
    return rec


def _check(value: Any, typ: str, nullable: bool, where: str) -> None:
    if value is None:
        if not nullable:
            raise XDeployError(f"invalid record: {where} is null; expected a {typ}")
        return
    ok = {
        _NUM: isinstance(value, (int, float)) and not isinstance(value, bool)
        and math.isfinite(value),
        _INT: isinstance(value, int) and not isinstance(value, bool),
        _STR: isinstance(value, str),
        _BOOL: isinstance(value, bool),
        _OBJ: isinstance(value, (dict, list)),
    }[typ]
    if not ok:
        want = "finite number" if typ == _NUM else typ
        raise XDeployError(f"invalid record: {where} is {value!r}; expected a {want}")


def validate_record(rec: Any) -> None:
    """Raise XDeployError naming the first field that does not match the schema."""
    if not isinstance(rec, dict):
        raise XDeployError(f"invalid record: expected a JSON object, got {type(rec).__name__}")
    if rec.get("schema") != SCHEMA or rec.get("version") != VERSION:
        raise XDeployError(f"invalid record: schema/version is {rec.get('schema')!r}/{rec.get('version')!r}; "
                           f"expected {SCHEMA!r}/{VERSION}")
    kind = rec.get("kind")
    if kind not in KINDS:
        raise XDeployError(f"invalid record: kind {kind!r}; expected one of: {', '.join(KINDS)}")
    fields = COMMON | KINDS[kind]
    missing = [k for k in fields if k not in rec and k not in ADDED.get(kind, ())]
    extra = [k for k in rec if k not in fields]
    if missing or extra:
        raise XDeployError(f"invalid {kind} record: missing {missing}, unexpected {extra}")
    for k, (typ, nullable) in fields.items():
        _check(rec.get(k), typ, nullable, k)
    if "latency_s" in rec:
        lat = rec["latency_s"]
        if not isinstance(lat, dict) or set(lat) != set(LATENCY_STATS):
            raise XDeployError(f"invalid {kind} record: latency_s must have exactly {list(LATENCY_STATS)}")
        for k in LATENCY_STATS:
            _check(lat[k], _NUM, False, f"latency_s.{k}")
            if lat[k] < 0:
                raise XDeployError(f"invalid {kind} record: latency_s.{k} is negative")
        if not lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]:
            raise XDeployError(f"invalid {kind} record: latency percentiles are not ordered min<=p50<=p90<=p99<=max")
    if isinstance(rec.get("memory"), dict):
        mem = rec["memory"]
        if set(mem) != set(MEMORY_FIELDS):
            raise XDeployError(f"invalid {kind} record: memory must have exactly {list(MEMORY_FIELDS)}")
        for k in MEMORY_FIELDS:
            _check(mem[k], _NUM, True, f"memory.{k}")  # null: not measured (--no-isolate, or no GPU)
    if kind == "profile":
        sh = rec["shares"]
        if not isinstance(sh, dict) or set(sh) != {"attention", "matmul", "normalization", "other"}:
            raise XDeployError("invalid profile record: shares must have attention, matmul, normalization, other")
        for k, v in sh.items():
            _check(v, _NUM, False, f"shares.{k}")
        if abs(sum(sh.values()) - 1.0) > 1e-6:
            raise XDeployError("invalid profile record: shares do not sum to 1")
    fp = rec["fingerprint"]
    if not isinstance(fp, dict) or not isinstance(fp.get("cpu_model"), str) or not isinstance(fp.get("isa"), list):
        raise XDeployError(f"invalid {kind} record: fingerprint needs cpu_model and isa")
    if kind == "latency" and rec["iterations"] < 1:
        raise XDeployError("invalid latency record: iterations must be >= 1")


def write_records(path: str | Path, records: Iterable[Mapping[str, Any]]) -> None:
    """Validate and write records as JSON lines (atomically: readers see the old or the new file)."""
    lines = []
    for r in records:
        validate_record(r)
        lines.append(json.dumps(r, allow_nan=False, separators=(",", ":")))
    atomic_write_text(path, "\n".join(lines) + ("\n" if lines else ""))


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Read and validate a JSON-lines file of records; errors name the line."""
    out = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise XDeployError(f"cannot read records {path}: {e.strerror or e}") from None
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            validate_record(rec)
        except json.JSONDecodeError as e:
            raise XDeployError(f"{path}:{i}: not JSON ({e.msg})") from None
        except XDeployError as e:
            raise XDeployError(f"{path}:{i}: {e}") from None
        out.append(rec)
    return out
