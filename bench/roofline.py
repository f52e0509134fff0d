"""The machine's measured ceilings: peak GEMM FLOP/s per precision and memory read bandwidth.

Peaks are *found*, not assumed: every precision is tried on several real implementations (PyTorch matmul via
oneDNN/MKL, ONNX Runtime's MLAS MatMul / MatMulInteger, OpenVINO's CPU plugin, torch._int_mm), at several
square sizes and thread counts, and the best is kept together with the path that reached it. Each trial uses
the *minimum* call time (the least-disturbed run: the quantity a peak is about), so a noisy shared machine
lowers the peak less than a median would. Latency records report `% of peak` against these numbers.

    python -m xdeploy.bench.roofline            # or: xdeploy roofline [--quick] [--json FILE]

The result is cached as JSON (atomically) in $XDEPLOY_CACHE/roofline.json (default ~/.cache/xdeploy), keyed
by the machine's identity (core/fingerprint.py `machine_identity`, the journal's too), for `xdeploy bench` and
other tools: `load_peaks()`.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xdeploy.core.fingerprint import fingerprint, machine_identity, usable_cpus
from xdeploy.core.fsutil import atomic_write_json
from xdeploy.core.records import make_record, revise
from xdeploy.export.cache import cache_root

from .latency import timed_samples

GEMM_PRECISIONS = ("fp32", "bf16", "int8")
CACHE_FILE = "roofline.json"


@dataclass(frozen=True)
class Trial:
    measure: str  # "gemm" | "memory"
    precision: str | None
    path: str  # e.g. "torch.matmul n=2048 threads=2"
    value: float  # FLOP/s or bytes/s
    seconds: float  # best call time
    threads: int = 0  # threads the trial used (0: not applicable)


def _best_time(call: Callable[[], Any], budget: float) -> float:
    """A peak's time: the second-fastest of the timed calls. One call alone can come out too fast (a read peak of
    67.1 GB/s once, where every other measurement that day gave 34.6-36.2 GB/s: docs/benchmarks.md), which would
    halve every % of that peak; a time reached twice is one the machine gave."""
    return sorted(timed_samples(call, warmup=1, min_iters=2, max_iters=50, max_seconds=budget))[1]


# ------------------------------------------------------------------------------------------ GEMM paths ----

@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _torch_gemm(prec: str, n: int, threads: int, budget: float) -> float:
    import torch

    with _torch_threads(threads), torch.inference_mode():
        if prec == "int8":  # int8 x int8 -> int32 (oneDNN / VNNI where available)
            a = torch.randint(-128, 127, (n, n), dtype=torch.int8)
            b = torch.randint(-128, 127, (n, n), dtype=torch.int8)
            return _best_time(lambda: torch._int_mm(a, b), budget)
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[prec]
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        c = torch.empty(n, n, dtype=dt)
        return _best_time(lambda: torch.matmul(a, b, out=c), budget)


def _matmul_onnx(prec: str, n: int, form: str = "") -> bytes:
    """A one-node-GEMM ONNX model: A (n, n) input times a constant B (n, n).

    form "" (fp32: MatMul; int8: MatMulInteger u8 x s8 -> i32), "qlinear" (QLinearMatMul u8 x s8 -> u8, the op
    ORT's static quantization emits), "qdq" (float A -> QuantizeLinear/DequantizeLinear, s8 B -> DequantizeLinear,
    MatMul: the pattern OpenVINO's low-precision transformations turn into an int8 GEMM, AMX/VNNI where present)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    a_t, y_t = TensorProto.FLOAT, TensorProto.FLOAT
    inits: list = []
    if prec != "int8":
        inits = [numpy_helper.from_array(rng.standard_normal((n, n)).astype(np.float32), "B")]
        nodes = [helper.make_node("MatMul", ["A", "B"], ["Y"])]
    else:
        inits = [numpy_helper.from_array(rng.integers(-127, 127, (n, n), dtype=np.int8), "B")]
        scalar = lambda name, v, dt: numpy_helper.from_array(np.array(v, dtype=dt), name)  # noqa: E731
        if form == "qlinear":
            inits += [scalar("sa", 0.02, np.float32), scalar("za", 128, np.uint8), scalar("sb", 0.01, np.float32),
                      scalar("zb", 0, np.int8), scalar("sy", 1.0, np.float32), scalar("zy", 128, np.uint8)]
            nodes = [helper.make_node("QLinearMatMul", ["A", "sa", "za", "B", "sb", "zb", "sy", "zy"], ["Y"])]
            a_t, y_t = TensorProto.UINT8, TensorProto.UINT8
        elif form == "qdq":
            inits += [scalar("sa", 0.02, np.float32), scalar("za", 0, np.int8), scalar("sb", 0.01, np.float32),
                      scalar("zb", 0, np.int8)]
            nodes = [helper.make_node("QuantizeLinear", ["A", "sa", "za"], ["Aq"]),
                     helper.make_node("DequantizeLinear", ["Aq", "sa", "za"], ["Ad"]),
                     helper.make_node("DequantizeLinear", ["B", "sb", "zb"], ["Bd"]),
                     helper.make_node("MatMul", ["Ad", "Bd"], ["Y"])]
        else:
            nodes = [helper.make_node("MatMulInteger", ["A", "B"], ["Y"])]
            a_t, y_t = TensorProto.UINT8, TensorProto.INT32
    graph = helper.make_graph(nodes, "gemm", [helper.make_tensor_value_info("A", a_t, [n, n])],
                              [helper.make_tensor_value_info("Y", y_t, [n, n])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def _a_input(prec: str, n: int, form: str = "") -> np.ndarray:
    rng = np.random.default_rng(1)
    if prec == "int8" and form != "qdq":
        return rng.integers(0, 255, (n, n), dtype=np.uint8)
    return rng.standard_normal((n, n)).astype(np.float32)


def _ort_gemm(prec: str, n: int, threads: int, budget: float, form: str = "") -> float:
    from xdeploy.deploy.sessions import ort_session

    if prec not in ("fp32", "int8"):
        raise NotImplementedError("MLAS has no bf16 GEMM on x86")
    sess = ort_session(_matmul_onnx(prec, n, form), threads=threads, what=f"the {prec} GEMM")
    a = _a_input(prec, n, form)
    binding = sess.io_binding()
    binding.bind_cpu_input("A", a)
    binding.bind_output("Y", "cpu")
    return _best_time(lambda: sess.run_with_iobinding(binding), budget)


def _ort_qlinear(prec: str, n: int, threads: int, budget: float) -> float:
    return _ort_gemm(prec, n, threads, budget, "qlinear")


def _ov_gemm(prec: str, n: int, threads: int, budget: float) -> float:
    from xdeploy.core.deps import import_quietly
    from xdeploy.deploy.sessions import ov_compile, ov_config

    ov = import_quietly("openvino")
    if prec not in ("fp32", "bf16", "int8"):
        raise NotImplementedError(prec)
    form = "qdq" if prec == "int8" else ""  # FakeQuantize -> int8 MatMul (a bare MatMulInteger is decomposed)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gemm.onnx"
        path.write_bytes(_matmul_onnx(prec, n, form))
        cfg = ov_config("bf16" if prec == "bf16" else "", hint="latency", threads=threads, streams=1)
        compiled = ov_compile(ov.Core().read_model(str(path)), cfg, what=f"the {prec} GEMM")
    if prec == "bf16" and "bf" not in str(compiled.get_property("INFERENCE_PRECISION_HINT")).lower():
        raise NotImplementedError("OpenVINO did not accept bf16 on this CPU")
    if prec == "int8":
        runtime = {op.get_rt_info()["runtimePrecision"].astype(str) for op in compiled.get_runtime_model().get_ops()
                   if op.get_rt_info()["layerType"].astype(str) in ("FullyConnected", "MatMul")}
        if not any("i8" in p or "u8" in p for p in runtime):
            raise NotImplementedError(f"OpenVINO ran the int8 MatMul at {sorted(runtime)}")
    req = compiled.create_infer_request()
    a = _a_input(prec, n, form)  # must outlive the request: the tensor shares (does not copy) its memory
    req.set_input_tensor(ov.Tensor(a, shared_memory=True))
    return _best_time(lambda: req.infer(), budget)


GEMM_PATHS: dict[str, tuple[Callable[[str, int, int, float], float], tuple[str, ...]]] = {
    "torch.matmul": (_torch_gemm, ("fp32", "bf16")),
    "torch._int_mm": (_torch_gemm, ("int8",)),
    "onnxruntime MatMul/MatMulInteger": (_ort_gemm, ("fp32", "int8")),
    "onnxruntime QLinearMatMul": (_ort_qlinear, ("int8",)),
    "openvino MatMul": (_ov_gemm, ("fp32", "bf16", "int8")),
}


def gemm_trials(precisions: tuple[str, ...] = GEMM_PRECISIONS, *, sizes: tuple[int, ...] = (1024, 2048, 4096),
                threads: tuple[int, ...] | None = None, budget: float = 0.6,
                log: Callable[[str], None] | None = None) -> list[Trial]:
    """Every (path, precision, size, threads) combination; failures (unsupported paths) are skipped."""
    threads = threads or tuple(sorted({1, usable_cpus()}))
    out: list[Trial] = []
    for name, (fn, precs) in GEMM_PATHS.items():
        for prec in precs:
            if prec not in precisions:
                continue
            for n in sizes:
                for th in threads:
                    try:
                        t = fn(prec, n, th, budget)
                    except Exception as e:  # an unsupported path on this machine is a skipped trial
                        if log:
                            log(f"  {name} {prec}: unavailable ({str(e).splitlines()[0][:80]})")
                        break
                    trial = Trial("gemm", prec, f"{name} n={n} threads={th}", 2.0 * n**3 / t, t, th)
                    out.append(trial)
                    if log:
                        log(f"  {prec:5s} {trial.path:48s} {trial.value / 1e9:8.1f} GFLOP/s")
                else:
                    continue
                break
    return out


# ------------------------------------------------------------------------------------------ memory ----

def _torch_reads(a: np.ndarray, nbytes: int, budget: float) -> list[Trial]:
    """Multi-threaded reads of `a` (torch sum and fp32 GEMV, 1 thread and all threads)."""
    import torch

    out: list[Trial] = []
    ta = torch.from_numpy(a)
    for th in sorted({1, usable_cpus()}):
        with _torch_threads(th):
            t = _best_time(lambda: ta.sum(), budget)
        out.append(Trial("memory", None, f"read: torch sum {nbytes >> 20} MiB threads={th}", nbytes / t, t))
    rows = ta.numel() // 4096
    m, v = ta[: rows * 4096].view(rows, 4096), torch.ones(4096)  # fp32 matrix x vector: reads every byte once
    for th in sorted({1, usable_cpus()}):
        with _torch_threads(th):
            t = _best_time(lambda: torch.mv(m, v), budget)
        out.append(Trial("memory", None, f"read: torch mv {nbytes >> 20} MiB threads={th}", m.numel() * 4 / t, t))
    return out


def memory_trials(nbytes: int = 1 << 30, *, budget: float = 1.0,
                  log: Callable[[str], None] | None = None) -> list[Trial]:
    """Read bandwidth of a large array (far beyond L3): numpy sum (1 thread), torch sum and torch GEMV (1 thread
    and all threads; the read peak is the best of them, as STREAM reports its best kernel); copy bandwidth
    counts read + write bytes. GEMV is the kernel a batch-1 decode step streams its weights through: on a
    2-core Zen 3 the summing kernels read slower than two decoders streamed GPT-2's weights (issue #30), and
    a decode figure above 100% of the read peak is a measurement bug. Where PyTorch is not installed (a lean
    environment benchmarking an artifact) the torch kernels are left out, with a line: the read peak is then
    numpy's one-thread sum, a lower bound."""
    from xdeploy.core.deps import installed

    a = np.ones(nbytes // 4, dtype=np.float32)  # touched: pages are resident before timing
    out: list[Trial] = []
    t = _best_time(lambda: np.add.reduce(a), budget)
    out.append(Trial("memory", None, f"read: numpy sum {nbytes >> 20} MiB threads=1", nbytes / t, t))
    if installed("torch"):
        out += _torch_reads(a, nbytes, budget)
    elif log:
        log("  read: torch sum and torch mv left out (PyTorch is not installed): the read peak is a lower bound")
    b = np.empty_like(a)
    t = _best_time(lambda: np.copyto(b, a), budget)
    out.append(Trial("memory", None, f"copy: numpy copyto {nbytes >> 20} MiB (read+write bytes)", 2 * nbytes / t, t))
    if log:
        for tr in out:
            log(f"  {tr.path:52s} {tr.value / 1e9:8.1f} GB/s")
    return out


# ------------------------------------------------------------------------------------------ API ----

def measure_roofline(*, quick: bool = False, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure all peaks. Returns {"gemm": {prec: {value, path}}, "memory_read": {...}, "records": [...]}."""
    # 512³ calls (~1 ms) slip between other processes' time slices on a shared machine; 2048³ shows the
    # large-matrix rate. 4096³ adds nothing but tens of seconds per trial when the machine is busy.
    sizes = (512, 1024) if quick else (512, 1024, 2048)
    budget = 0.2 if quick else 0.6
    trials = gemm_trials(sizes=sizes, budget=budget, log=log)
    trials += memory_trials(256 << 20 if quick else 1 << 30, budget=budget, log=log)
    return summarize(trials, quick=quick)


def summarize(trials: list[Trial], *, quick: bool) -> dict[str, Any]:
    """Best trial per GEMM precision and per memory kind, with one roofline record each."""
    fp = fingerprint()
    result: dict[str, Any] = {"gemm": {}, "gemm_by_threads": {}, "memory_read": None, "memory_copy": None,
                              "quick": quick, "machine": machine_identity(fp), "records": []}
    note = "quick" if quick else None
    for prec in GEMM_PRECISIONS:
        ts = [t for t in trials if t.measure == "gemm" and t.precision == prec]
        if ts:
            best = max(ts, key=lambda t: t.value)
            result["gemm"][prec] = {"value": best.value, "path": best.path}
            for th in sorted({t.threads for t in ts}):
                b = max((t for t in ts if t.threads == th), key=lambda t: t.value)
                result["gemm_by_threads"].setdefault(str(th), {})[prec] = {"value": b.value, "path": b.path}
            result["records"].append(make_record(
                "roofline", fp, measure="gemm", precision=prec, path=best.path, value=best.value, unit="FLOP/s",
                trials=[{"path": t.path, "value": t.value} for t in ts], note=note))
    for kind in ("read", "copy"):
        ts = [t for t in trials if t.measure == "memory" and t.path.startswith(kind)]
        if ts:
            best = max(ts, key=lambda t: t.value)
            result[f"memory_{kind}"] = {"value": best.value, "path": best.path}
            result["records"].append(make_record(
                "roofline", fp, measure=f"memory_{kind}", precision=None, path=best.path, value=best.value,
                unit="B/s", trials=[{"path": t.path, "value": t.value} for t in ts], note=note))
    return result


def save(result: dict[str, Any], path: Path | None = None) -> Path:
    path = path or cache_root() / CACHE_FILE
    atomic_write_json(path, result)
    return path


def load(path: Path | None = None) -> dict[str, Any] | None:
    """The cached roofline if it was measured on this machine with these library versions, else None."""
    path = path or cache_root() / CACHE_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or data.get("machine") != machine_identity(fingerprint()):
        return None
    return data


def load_peaks(path: Path | None = None) -> dict[str, float]:
    """{precision: peak FLOP/s} from the cache ({} when no roofline was measured on this machine), plus
    "{precision}@{threads}": the best trial at that thread count (a 1-thread run is judged against the
    1-thread peak, not the 2-core one)."""
    data = load(path)
    if not data:
        return {}
    peaks = {k: float(v["value"]) for k, v in data.get("gemm", {}).items()}
    for th, by_prec in (data.get("gemm_by_threads") or {}).items():
        peaks |= {f"{k}@{th}": float(v["value"]) for k, v in by_prec.items()}
    return peaks


def peak_for(peaks: dict[str, float], precision: str, threads: int | None = None) -> float | None:
    """The peak a run at `precision` on `threads` threads is judged against: the best trial at that thread
    count when one was measured, else the overall best. fp16 on a CPU without native fp16 GEMM runs its
    matmuls in fp32 (ORT/OpenVINO upcast), so it is judged against the fp32 peak."""
    prec = "fp32" if precision == "fp16" and "fp16" not in peaks else precision
    prec = "int8" if prec == "int8-dynamic" else prec  # both int8 kinds are judged against the int8 GEMM peak
    if threads and f"{prec}@{threads}" in peaks:
        return peaks[f"{prec}@{threads}"]
    return peaks.get(prec)


def reconcile(records: list[dict[str, Any]], *, log: Callable[[str], None] | None = None,
              budget: float = 1.0) -> list[dict[str, Any]]:
    """No record above 100% of its peak: a latency record that achieves more FLOP/s than the cached peak of
    its precision and thread count proves that peak was underestimated (a busy machine, or a kernel the
    roofline did not try). Those precisions are measured again (smaller, quicker GEMMs that fit between other
    processes' time slices, a longer budget, at the record's thread count), the cache keeps the better peak,
    and the records are re-judged. A record still above its peak keeps `pct_of_peak` null and says so in
    `note`: it is never shown as 132%. Returns the records (updated copies where something changed)."""
    over = {(r["precision"], int(r["threads"])) for r in records
            if r.get("kind") == "latency" and (r.get("pct_of_peak") or 0.0) > 100.0}
    if not over:
        return records
    data = load() or {"gemm": {}, "gemm_by_threads": {}, "records": []}
    for prec, th in sorted(over):
        gprec = "fp32" if prec == "fp16" else prec
        if gprec not in GEMM_PRECISIONS:
            continue
        if log:
            log(f"a {prec} record exceeds the {gprec} peak at {th} threads: measuring that peak again")
        for t in gemm_trials((gprec,), sizes=(256, 512, 1024), threads=(th,), budget=budget):
            for table in (data.setdefault("gemm", {}),
                          data.setdefault("gemm_by_threads", {}).setdefault(str(th), {})):
                if t.value > table.get(gprec, {}).get("value", 0.0):
                    table[gprec] = {"value": t.value, "path": t.path}
    if data.get("machine"):
        save(data)
    peaks = {k: float(v["value"]) for k, v in data["gemm"].items()}
    for th, by_prec in data["gemm_by_threads"].items():
        peaks |= {f"{k}@{th}": float(v["value"]) for k, v in by_prec.items()}
    out = []
    for r in records:
        if r.get("kind") != "latency" or (r["precision"], int(r["threads"])) not in over:
            out.append(r)
            continue
        peak = peak_for(peaks, r["precision"], int(r["threads"]))
        pct = 100.0 * r["achieved_flops"] / peak if peak else None
        note = r.get("note")
        if pct is not None and pct > 100.0:
            why = (f"peak underestimated: achieved {r['achieved_flops'] / 1e9:.0f} GFLOP/s > measured "
                   f"{r['precision']} peak {peak / 1e9:.0f} GFLOP/s even after re-measuring")
            pct, note = None, f"{note}; {why}" if note else why
        out.append(revise(r, peak_flops=peak, pct_of_peak=pct, note=note))
    return out


def get_roofline(*, refresh: bool = False, quick: bool = False,
                 log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Cached result, or measure and cache it."""
    data = None if refresh else load()
    if data is None:
        data = measure_roofline(quick=quick, log=log)
        save(data)
    return data


def peak_rows(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The cached result's peaks as roofline-record-shaped rows (measure, precision, value, unit, path): read from
    its tables, not its records, which `reconcile` does not rewrite when it re-measures a peak."""
    rows = [{"measure": "gemm", "precision": prec, "value": v["value"], "unit": "FLOP/s", "path": v["path"]}
            for prec, v in data["gemm"].items()]
    return rows + [{"measure": kind, "precision": None, "value": data[kind]["value"], "unit": "B/s",
                    "path": data[kind]["path"]} for kind in ("memory_read", "memory_copy") if data.get(kind)]

