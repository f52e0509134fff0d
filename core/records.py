"""The record contract: every measurement or verdict is one JSON object of a declared kind, built by `make_record`.

    rec = make_record("latency", fp, model="bert", ...)   # stamps schema/version/kind/timestamp/fingerprint,
                                                          # validates, hands it to every sink, returns a dict
    with record_sink(journal.append): ...                  # every record made inside is passed to the sink

One table (`KINDS`) declares every kind: latency (`xdeploy bench`), roofline (`xdeploy roofline`), scale and
profile (`xdeploy scale`), loadtest (`xdeploy loadtest`), parity (one graph output vs PyTorch fp32), decode
(one generation run), peers and peers_generate (studies/peers.py, studies/peers_generate.py). One rule
(`validate_record`) checks them: the common fields (schema, version, kind, timestamp, fingerprint, note) plus
exactly the fields of the kind, no missing and no unknown ones (a typo cannot silently produce a record the
renderer ignores). Measured quantities are floats in SI units (seconds, bytes,
FLOP/s); counts and sizes are ints; a quantity that could not be measured here is null (e.g. GPU device memory
on a CPU-only machine). docs/benchmarks.md documents every field.

A record's identity (`IDENTITY`: the fields that say *what* was measured, not the measurement) keys everything
that matches records: `report compare`, the speed-ups and the "best per configuration" (`speedups`, `best`).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xdeploy.core.errors import XDeployError
from xdeploy.core.fsutil import atomic_write_text

SCHEMA = "xdeploy-bench"
VERSION = 1

Record = dict[str, Any]

# field -> (allowed JSON type, nullable). "num" = int or float, finite; "list"/"obj" = JSON array/object.
_NUM, _INT, _STR, _BOOL, _OBJ, _LIST = "num", "int", "str", "bool", "obj", "list"
LATENCY_STATS = ("p50", "p90", "p99", "mean", "std", "min", "max")
MEMORY_FIELDS = ("weights_bytes", "load_peak_bytes", "activations_bytes", "peak_rss_bytes", "device_bytes")
PROFILE_SHARES = ("attention", "matmul", "normalization", "other")

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
        "measure": (_STR, False),  # "gemm" | "memory_read" | "memory_copy"
        "precision": (_STR, True),  # gemm: fp32 | bf16 | fp16 | int8; memory: null
        "path": (_STR, False),  # which implementation achieved it, e.g. "torch.matmul n=2048 threads=2"
        "value": (_NUM, False),  # FLOP/s (gemm) or bytes/s (memory)
        "unit": (_STR, False),  # "FLOP/s" | "B/s"
        "trials": (_LIST, False),  # list of {path, value} for every configuration tried
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
    "peers": {  # studies/peers.py: one system on one workload, timed interleaved with every other system
        "workload": (_STR, False), "model": (_STR, False), "task": (_STR, False),
        "batch": (_INT, False), "seq": (_INT, True), "items": (_INT, False),  # items per timed call
        # "pytorch" | "xdeploy" | "optimum-onnx" | "optimum-intel" | "sentence-transformers" | "fastembed"
        "system": (_STR, False),
        "config": (_STR, False), "runtime": (_STR, False), "precision": (_STR, False),  # compute precision
        "threads": (_INT, False), "latency_s": (_OBJ, False),  # per timed call
        "rate": (_NUM, False), "rate_unit": (_STR, False),  # items / median round time
        "max_abs_err": (_NUM, False), "min_cosine": (_NUM, False),  # vs the PyTorch reference, per row
        "accuracy_ok": (_BOOL, False),  # min_cosine >= the precision's floor (studies/peers.MIN_COSINE)
        # sentence workloads: fraction of sentences whose nearest other sentence of the corpus (cosine) is the
        # reference's; null for the other workloads
        "nn_agreement": (_NUM, True),
        # sentence workloads: NDCG@10 on the generated retrieval set (studies/peers._retrieval_quality) and its
        # ratio to the pytorch row's (sentence-transformers' quality measure); null for the other workloads
        "ndcg10": (_NUM, True), "st_quality": (_NUM, True),
        # xdeploy rows: paired speed-up over the fastest peer row (any system but pytorch and xdeploy) of the same
        # precision {peer, median, low, high, stable}; null for other systems or without a peer of that precision
        # + instance_spread (the rows' larger A/A deviation) and verdict: "ahead" | "behind" | "tie" (the
        # interval outside / inside the band 1 ± instance_spread); same_engine: the same against the fastest
        # peer row on the row's own runtime (e.g. ov f32 vs optimum-intel ov f32), when that is another row
        "vs_peer": (_OBJ, True),
        "stability": (_OBJ, False),  # bench/interleave.py Comparison.stability (vs the pytorch row)
        "versions": (_OBJ, False),
        # {count, round_median_s: per instance, aa: {median, low, high} instance 1 vs 2 or null}
        "replicas": (_OBJ, True),
    },
    "peers_generate": {  # studies/peers_generate.py: one system's greedy KV-cache generation, timed interleaved
        "workload": (_STR, False), "model": (_STR, False), "weights": (_STR, False),  # "random" | "trained"
        "checkpoint": (_STR, False), "batch": (_INT, False), "prompt_len": (_INT, False), "new_tokens": (_INT, False),
        # "transformers" (the reference) | "xdeploy" | "optimum-intel" | "ctranslate2" | "onnxruntime-genai" | ...
        "system": (_STR, False), "config": (_STR, False), "runtime": (_STR, False), "precision": (_STR, False),
        "threads": (_INT, False),
        # AIPerf / MLPerf Inference definitions; null on a row that failed (`error`): TTFT and TPOT = (e2e - TTFT)
        # / (tokens - 1) are medians over the timed generations, e2e the median round, ITL {p50, p90, p99} over
        # every gap between consecutive streamed tokens
        "ttft_s": (_NUM, True), "tpot_s": (_NUM, True), "e2e_s": (_NUM, True), "itl_s": (_OBJ, True),
        "output_tokens_per_s": (_NUM, True), "decode_tokens_per_s": (_NUM, True),  # new / e2e; 1 / TPOT
        # greedy tokens equal to the reference's before the first divergence, and that count / new_tokens
        "agreement_tokens": (_INT, True), "agreement": (_NUM, True),
        "peak_rss_bytes": (_NUM, True),  # a child process that loads the system and generates once; null: failed
        # {bytes_per_token, bandwidth_bytes_per_s, bandwidth_how, roofline_tokens_per_s, pct, assumption}
        "roofline": (_OBJ, True),
        # paired speed-up over the reference {median, low, high, stable, wide, cause}; null for the reference
        "vs_hf": (_OBJ, True),
        # xdeploy rows: over the fastest peer row of the same precision in the same group {peer, median, low,
        # high, stable, wide} + instance_spread and verdict "ahead" | "behind" | "tie" (as the peers kind; records
        # before the study timed two instances per system have neither); null otherwise
        "vs_peer": (_OBJ, True),
        # bench/interleave.py Comparison.stability + group + replicas {count, round_median_s, aa} (a row's instances;
        # a row's speed-ups are over its instances' mean rounds); null on a failed row
        "stability": (_OBJ, True),
        "error": (_STR, True),  # the row's own one-line error (export, load or run); null when it ran
        "versions": (_OBJ, False),
    },
    "profile": {  # onnxruntime profiler: kernel time per op type at one T (xdeploy scale)
        "model": (_STR, False), "runner": (_STR, False), "lowering": (_STR, False), "T": (_INT, False),
        "batch": (_INT, False),
        "shares": (_OBJ, False),  # {attention, matmul, normalization, other}: fractions of kernel time
        "op_times_s": (_OBJ, False),  # {op_type: seconds per call}
        "total_s": (_NUM, False),  # summed kernel time per call
    },
    "parity": {  # one graph output of one (model, artifact precision, runner) vs PyTorch fp32, worst over cases
        "model": (_STR, False), "preset": (_STR, True), "graph": (_STR, False), "runner": (_STR, False),
        "artifact_precision": (_STR, False), "output": (_STR, False),
        "tolerance_precision": (_STR, False),  # whose tolerance applied (the looser of artifact and compute)
        # worst over the cases compared; null when none could be (the runner failed, a shape differed)
        "max_abs": (_NUM, True), "max_rel": (_NUM, True), "mean_abs": (_NUM, True),
        "cosine": (_NUM, True), "nonfinite": (_INT, False),  # min cosine; NaN/Inf summed over cases
        "top1": (_NUM, True),  # min argmax agreement (outputs named *logits); null otherwise
        "passed": (_BOOL, False), "reason": (_STR, True),  # reason: the first failing case, null when passed
        "cases": (_INT, False), "atol": (_NUM, False), "rtol": (_NUM, False), "min_cosine": (_NUM, False),
        "first_divergence": (_STR, True),  # where the ONNX graph first leaves tolerance (failing graphs only)
    },
    "decode": {  # one greedy generation run: time to first token, then every later step (context grows by one)
        "model": (_STR, False), "preset": (_STR, True), "runner": (_STR, False),
        # mode: Generation.mode, "cache" | "engine cache" | "paged engine cache" | "recompute"
        "artifact_precision": (_STR, False), "mode": (_STR, False),
        "batch": (_INT, False), "prompt_len": (_INT, False), "new_tokens": (_INT, False),
        "ttft_s": (_NUM, False), "step_s": (_LIST, False), "tokens_per_s": (_NUM, False),
        "total_s": (_NUM, False),
        "agreement": (_NUM, True),  # fraction of tokens equal to the PyTorch fp32 reference's
        "first_divergence": (_INT, True),  # index of the first new token that differs; null: none
        "threads": (_INT, True),  # threads per runner (0: all cores)
        # rotated rounds of every generator (bench/interleave.py): paired speed-up vs torch fp32, stable, cause
        "stability": (_OBJ, True),
    },
}

# What a record *is* (not what was measured): two records with the same identity measure the same thing.
IDENTITY: dict[str, tuple[str, ...]] = {
    "latency": ("model", "preset", "graph", "runner", "precision", "artifact_precision", "attn_impl", "batch", "seq"),
    "roofline": ("measure", "precision", "path"),
    "scale": ("model", "runner", "lowering", "batch", "T", "d_model", "n_layers"),
    "loadtest": ("target", "server", "model", "protocol", "concurrency", "batch"),
    "profile": ("model", "runner", "lowering", "T", "batch"),
    "parity": ("model", "preset", "graph", "runner", "artifact_precision", "output"),
    "decode": ("model", "preset", "runner", "artifact_precision", "mode", "batch", "prompt_len", "new_tokens"),
    "peers": ("workload", "system", "config", "batch", "seq", "threads"),
    "peers_generate": ("workload", "system", "config", "batch", "prompt_len", "new_tokens", "threads"),
}
# Fields added after version 1 was written: older records may lack them (read as null); new ones must have them.
ADDED: dict[str, frozenset[str]] = {"latency": frozenset({"stability"}), "decode": frozenset({"threads", "stability"}),
                                    "peers": frozenset({"replicas", "nn_agreement", "ndcg10", "st_quality"})}

# A latency record's configuration: the same work, whichever runner and precision did it (speed-ups compare these).
CONFIG: tuple[str, ...] = ("model", "preset", "graph", "batch", "seq")


def now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------- sinks ----
# Every record passes through `make_record`, which hands it to each registered sink (a journal, a live view)
# the moment it exists. Records that were made earlier and are only re-used (a cached roofline, a records file
# read back) are passed on with `emit`.

RecordSink = Callable[[Record], None]
_sinks: list[RecordSink] = []
_sinks_lock = threading.Lock()


@contextmanager
def record_sink(sink: RecordSink) -> Iterator[RecordSink]:
    """Call `sink(record)` for every record made (or emitted) in this process while the block runs.

    Sinks run in the thread that made the record, in registration order; a sink that raises stops the phase that
    made the record (a journal that cannot write must not be ignored)."""
    with _sinks_lock:
        _sinks.append(sink)
    try:
        yield sink
    finally:
        with _sinks_lock:
            _sinks.remove(sink)


def emit(rec: Record) -> Record:
    """Validate `rec` and hand it to every registered sink; returns it (make_record calls this)."""
    validate_record(rec)
    with _sinks_lock:
        sinks = list(_sinks)
    for s in sinks:
        s(rec)
    return rec


def make_record(kind: str, fingerprint: Mapping[str, Any] | None = None, /, **fields: Any) -> Record:
    """The one constructor of records: a validated record dict of `kind`, stamped and emitted to the sinks.

    `fingerprint` is the machine the figures come from: pass the one a measuring child process took (it holds
    that process's thread settings); None takes this process's now (core/fingerprint.py)."""
    if fingerprint is None:
        from xdeploy.core.fingerprint import fingerprint as _take

        fingerprint = _take()
    rec = {"schema": SCHEMA, "version": VERSION, "kind": kind, "timestamp": now(),
           "fingerprint": dict(fingerprint), "note": fields.pop("note", None)} | fields
    missing_added = ADDED.get(kind, frozenset()) - set(fields)
    if missing_added:
        raise XDeployError(f"invalid {kind} record: missing {sorted(missing_added)}")
    return emit(rec)


def revise(rec: Mapping[str, Any], **changes: Any) -> Record:
    """A corrected copy of a record (the same measurement, some values re-judged: e.g. % of a peak measured
    again), validated and handed to the sinks like a new one, so a journal holds the correction too. Its
    identity cannot change: a different measurement is a new record (`make_record`)."""
    new = dict(rec) | changes
    if identity(new) != identity(rec):
        raise XDeployError(f"revise cannot change what a {rec['kind']} record measured ({sorted(changes)}); "
                           "expected a new record")
    return emit(new)


# ---------------------------------------------------------------------------------------- validation ----

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
        _LIST: isinstance(value, list),
    }[typ]
    if not ok:
        want = "finite number" if typ == _NUM else typ
        raise XDeployError(f"invalid record: {where} is {value!r}; expected a {want}")


def validate_record(rec: Any) -> None:
    """Raise XDeployError naming the first field that does not match the contract."""
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
        if not isinstance(sh, dict) or set(sh) != set(PROFILE_SHARES):
            raise XDeployError("invalid profile record: shares must have attention, matmul, normalization, other")
        for k, v in sh.items():
            _check(v, _NUM, False, f"shares.{k}")
        if abs(sum(sh.values()) - 1.0) > 1e-6:
            raise XDeployError("invalid profile record: shares do not sum to 1")
    if kind == "decode":
        for i, s in enumerate(rec["step_s"]):
            _check(s, _NUM, False, f"step_s[{i}]")
            if s < 0:
                raise XDeployError("invalid decode record: step_s must be a list of non-negative seconds")
    if kind == "peers_generate" and rec["itl_s"] is not None:
        itl = rec["itl_s"]
        if not isinstance(itl, dict) or set(itl) != {"p50", "p90", "p99"}:
            raise XDeployError("invalid peers_generate record: itl_s must have exactly p50, p90, p99")
        for k in ("p50", "p90", "p99"):
            _check(itl[k], _NUM, False, f"itl_s.{k}")
        if not 0 <= itl["p50"] <= itl["p90"] <= itl["p99"]:
            raise XDeployError("invalid peers_generate record: itl_s percentiles are not ordered 0<=p50<=p90<=p99")
    fp = rec["fingerprint"]
    if not isinstance(fp, dict) or not isinstance(fp.get("cpu_model"), str) or not isinstance(fp.get("isa"), list):
        raise XDeployError(f"invalid {kind} record: fingerprint needs cpu_model and isa")
    if kind == "latency" and rec["iterations"] < 1:
        raise XDeployError("invalid latency record: iterations must be >= 1")


def upgrade_legacy(rec: Any, *, timestamp: str, fingerprint: Mapping[str, Any] | None) -> Any:
    """A parity/decode record of a report written before they joined the contract (no schema, version,
    timestamp, note; parity also without a fingerprint), completed from its report; anything else as it is.

    Only `load_results` calls this: reports already on disk (reports/reference/) stay readable."""
    if not isinstance(rec, dict) or "schema" in rec or rec.get("kind") not in ("parity", "decode"):
        return rec
    fp = rec.get("fingerprint", fingerprint)
    head = {"schema": SCHEMA, "version": VERSION, "kind": rec["kind"], "timestamp": timestamp,
            "fingerprint": dict(fp) if isinstance(fp, Mapping) else fp, "note": None}
    body = {k: v for k, v in rec.items() if k not in head}
    if rec["kind"] == "parity":
        body.setdefault("first_divergence", None)
    return head | body


# ----------------------------------------------------------------------------------------- identity ----

def identity(rec: Mapping[str, Any]) -> tuple[Any, ...]:
    """(kind, *the kind's IDENTITY values): equal for two records that measure the same thing."""
    kind = rec["kind"]
    return (kind, *(rec.get(f) for f in IDENTITY[kind]))


def config_key(rec: Mapping[str, Any]) -> tuple[Any, ...]:
    """A latency record's configuration (model, preset, graph, batch, seq): what its speed-up is relative to."""
    return tuple(rec.get(f) for f in CONFIG)


def is_baseline(rec: Mapping[str, Any], baseline: str = "torch") -> bool:
    """The denominator of every speed-up: the `baseline` runner (PyTorch eager) computing in fp32. Its artifact
    precision does not matter: the torch runner runs the reference weights whatever artifact it was given."""
    return rec.get("kind") == "latency" and rec.get("runner") == baseline and rec.get("precision") == "fp32"


def stability_block(rec: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A record's `stability` block (interleaved comparisons, bench/interleave.py); None for older records."""
    st = rec.get("stability")
    return st if isinstance(st, dict) else None


def speedups(records: Iterable[Mapping[str, Any]], baseline: str = "torch") -> dict[tuple[Any, ...], float]:
    """identity(latency record) -> its speed-up over PyTorch eager fp32 in the same configuration (`config_key`:
    graph included, a decode graph is not a prefill graph).

    Interleaved records (a `stability` block, bench/interleave.py): the median of the paired round ratios against
    the comparison's own baseline; left out where that comparison stayed unstable (`unstable` says why), never a
    figure from a disturbed measurement. Records without the block: the first `baseline` record's p50 / p50."""
    lat = [r for r in records if r.get("kind") == "latency"]
    base: dict[tuple[Any, ...], float] = {}
    for r in lat:
        if is_baseline(r, baseline):
            base.setdefault(config_key(r), float(r["latency_s"]["p50"]))
    out: dict[tuple[Any, ...], float] = {}
    for r in lat:
        st = stability_block(r)
        if st is not None:
            if st["stable"] and st.get("speedup"):
                out[identity(r)] = float(st["speedup"]["median"])
            elif is_baseline(r, baseline):
                out[identity(r)] = 1.0  # the reference itself: 1 by definition, not a measured ratio
        elif config_key(r) in base and r["latency_s"]["p50"] > 0:
            out[identity(r)] = base[config_key(r)] / float(r["latency_s"]["p50"])
    return out


def unstable(records: Iterable[Mapping[str, Any]]) -> dict[tuple[Any, ...], str]:
    """identity(latency record) -> "load" | "noise": interleaved comparisons that stayed unstable."""
    return {identity(r): str(st.get("cause") or "noise") for r in records if r.get("kind") == "latency"
            and (st := stability_block(r)) is not None and not st["stable"]}


def speedup_wide(rec: Mapping[str, Any]) -> bool:
    """A steady paired speed-up whose 95% interval stayed wider than the comparison's target (bench/interleave.py:
    "wide"): a figure, printed with its interval and the word."""
    st = stability_block(rec)
    return bool(st is not None and st["stable"] and st.get("wide") and st.get("speedup"))


def speedup_interval(rec: Mapping[str, Any]) -> tuple[float, float] | None:
    """The 95% interval of a stable paired speed-up; None for p50-ratio records and unstable ones."""
    st = stability_block(rec)
    if st is None or not st["stable"] or not st.get("speedup"):
        return None
    return float(st["speedup"]["low"]), float(st["speedup"]["high"])


@dataclass(frozen=True)
class Best:
    """The fastest record of one latency configuration and its speed-up over the baseline."""

    config: tuple[Any, ...]  # config_key
    record: Mapping[str, Any]  # never the baseline itself
    baseline: Mapping[str, Any] | None  # the configuration's baseline record (None: only paired figures)
    speedup: float | None  # None: the comparison stayed unstable (see `unstable`)
    interval: tuple[float, float] | None  # 95% interval of a paired speed-up
    unstable: str | None  # "load" | "noise" when unstable


def deployment(r: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a user deploys: (model, preset, runner, artifact precision). A parity failure of any graph of it on
    this machine disqualifies it (an encoder that passes beside a decode graph that fails is not deployable)."""
    return r.get("model"), r.get("preset"), r.get("runner"), r.get("artifact_precision")


def best(records: Sequence[Mapping[str, Any]], baseline: str = "torch") -> list[Best]:
    """Per configuration with a speed-up or an unstable verdict: the fastest deployment that passes parity on this
    machine - the record with the lowest p50 among those that are not the baseline, whose own parity passed or was
    not checked (`parity_passed` is not False) and that no parity record among `records` failed (`deployment`) -
    with its speed-up (below 1 when eager PyTorch is faster); in order of first appearance."""
    failed = {deployment(p) for p in records if p.get("kind") == "parity" and not p.get("passed")}
    lat = [r for r in records if r.get("kind") == "latency" and deployment(r) not in failed]
    sp, unst = speedups(lat, baseline), unstable(lat)
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    bases: dict[tuple[Any, ...], Mapping[str, Any]] = {}
    for r in lat:
        groups.setdefault(config_key(r), []).append(r)
        if is_baseline(r, baseline):
            bases.setdefault(config_key(r), r)
    out = []
    for key, rs in groups.items():
        cands = [r for r in rs if (identity(r) in sp or identity(r) in unst) and not is_baseline(r, baseline)
                 and r.get("parity_passed") is not False]
        if cands:
            r = min(cands, key=lambda r: r["latency_s"]["p50"])
            out.append(Best(key, r, bases.get(key), sp.get(identity(r)), speedup_interval(r), unst.get(identity(r))))
    return out


# ------------------------------------------------------------------------------------------------ io ----

def write_records(path: str | Path, records: Iterable[Mapping[str, Any]]) -> None:
    """Validate and write records as JSON lines (atomically: readers see the old or the new file)."""
    lines = []
    for r in records:
        validate_record(r)
        lines.append(json.dumps(r, allow_nan=False, separators=(",", ":")))
    atomic_write_text(path, "\n".join(lines) + ("\n" if lines else ""))


def read_records(path: str | Path) -> list[Record]:
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
