"""A machine fingerprint stored in every benchmark record: what the numbers were measured on.

CPU model and family, cores available to this process, the ISA flags that decide which kernels a runtime can
use (AVX-512, VNNI, BF16, AMX, FP16), memory, library versions (read from package metadata, so nothing heavy is
imported), thread settings (torch's, if torch is already loaded, and every threading environment variable,
including OPENBLAS_*), and whether a GPU is visible.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import re
import sys
from collections.abc import Mapping
from typing import Any

# ISA features that change which GEMM/attention kernels a runtime selects.
ISA_PATTERN = re.compile(r"^(avx512.*|amx.*|avx_vnni.*|avx_ifma|avx_ne_convert|avx2|fma|f16c|sse4_2|sha_ni)$")
LIBRARIES = ("torch", "onnxruntime", "onnxruntime-gpu", "openvino", "onnx", "onnxscript", "numpy", "tensorrt",
             "transformers")
THREAD_ENV = re.compile(r"^(OMP_.*|GOMP_.*|MKL_.*|OPENBLAS_.*|GOTO_NUM_THREADS|KMP_.*|ONEDNN_.*|DNNL_.*|OV_.*|ORT_.*"
                        r"|TORCH_NUM_THREADS|VECLIB_MAXIMUM_THREADS|NUMEXPR_.*|CUDA_VISIBLE_DEVICES)$")


def _cpuinfo() -> dict[str, str]:
    """The first processor block of /proc/cpuinfo (Linux); empty elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        out[key.strip()] = value.strip()
    return out


def _mem_total() -> float | None:
    try:
        import psutil

        return float(psutil.virtual_memory().total)
    except ImportError:
        return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# /proc/cpuinfo's flag -> numpy's name for it in the features numpy reads with CPUID itself (what instructions this
# process may execute). They differ under an emulator: QEMU user mode (verify/emulate.py) gives the process the
# emulated CPU's CPUID but leaves /proc/cpuinfo the host's.
_CPUID_NAMES = {"avx2": "AVX2", "fma": "FMA3", "f16c": "F16C", "sse4_2": "SSE42", "avx512f": "AVX512F",
                "avx512cd": "AVX512CD", "avx512bw": "AVX512BW", "avx512dq": "AVX512DQ", "avx512vl": "AVX512VL",
                "avx512_vnni": "AVX512VNNI", "avx512_bf16": "AVX512BF16", "avx512_fp16": "AVX512FP16",
                "avx512ifma": "AVX512IFMA", "avx512vbmi": "AVX512VBMI", "avx512_vbmi2": "AVX512VBMI2",
                "avx512_bitalg": "AVX512BITALG", "avx512_vpopcntdq": "AVX512VPOPCNTDQ"}
EMULATED_ENV = "XDEPLOY_EMULATED_CPU"  # set by verify/emulate.py in the emulated process: the QEMU CPU model


def _cpuid_features() -> dict[str, bool] | None:
    try:
        from numpy._core._multiarray_umath import __cpu_features__
    except ImportError:  # numpy < 2, or a build without runtime dispatch: /proc/cpuinfo alone
        return None
    return dict(__cpu_features__)


def confirmed_isa(flags: list[str], cpuid: Mapping[str, bool] | None, emulated: bool) -> list[str]:
    """The /proc/cpuinfo ISA `flags` this process can use: a flag CPUID (`cpuid`, numpy's names) denies is dropped,
    and the AMX flags with AVX-512 (no CPU has AMX without it). Under an emulator (`emulated`) only what CPUID
    confirms is kept: the host's AVX-VNNI or SHA flags say nothing about the emulated CPU."""
    if cpuid is None:
        return flags
    known = {f: cpuid.get(_CPUID_NAMES[f], False) for f in flags if f in _CPUID_NAMES}
    kept = [f for f in flags if known.get(f, not emulated)]
    if not known.get("avx512f", False):
        kept = [f for f in kept if not f.startswith("amx")]
    return kept


@functools.cache
def _static() -> dict[str, Any]:
    info = _cpuinfo()
    emulated = os.environ.get(EMULATED_ENV) or None
    flags = confirmed_isa(sorted(f for f in info.get("flags", "").split() if ISA_PATTERN.match(f)),
                          _cpuid_features(), emulated is not None)
    import xdeploy

    return {
        "cpu_model": info.get("model name") or platform.processor() or platform.machine(),
        "cpu_vendor": info.get("vendor_id", ""),
        "cpu_family": info.get("cpu family", ""),
        "cpu_model_id": info.get("model", ""),
        "arch": platform.machine(),
        "logical_cpus": os.cpu_count() or 0,
        "isa": flags,
        "emulated": emulated,  # the QEMU CPU model this process runs on (verify/emulate.py), None natively
        "memory_bytes": _mem_total(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": {"xdeploy": xdeploy.__version__} | {k: v for k in LIBRARIES if (v := _version(k))},
    }


def usable_cpus() -> int:
    """The logical CPUs this process may run on (its affinity mask; the machine's count where there is none)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def fingerprint() -> dict[str, Any]:
    """JSON-ready description of the machine and the threading configuration of this process now."""
    threads: dict[str, Any] = {"affinity_cpus": usable_cpus()}
    torch = sys.modules.get("torch")  # only if already imported: importing torch costs seconds and memory
    if torch is not None:
        threads["torch_intra_op"] = torch.get_num_threads()
        threads["torch_inter_op"] = torch.get_num_interop_threads()
    return _static() | {
        "threads": threads,
        "env": {k: v for k, v in sorted(os.environ.items()) if THREAD_ENV.match(k)},
        "gpu": _gpu(),
    }


@functools.cache
def _gpu() -> str | None:
    """Name of a visible NVIDIA GPU, or None (no driver query tool here: checked via /proc)."""
    path = "/proc/driver/nvidia/gpus"
    try:
        names = os.listdir(path)
    except OSError:
        return None
    for n in names:
        try:
            with open(os.path.join(path, n, "information"), encoding="utf-8") as f:
                for line in f:
                    if line.startswith("Model:"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            continue
    return "nvidia" if names else None


def summary(fp: dict[str, Any]) -> str:
    """One line for table captions: 'AMD EPYC, 2 CPUs, avx512f avx512_bf16 avx512_vnni, torch 2.13.0 ...'."""
    isa = [f for f in fp.get("isa", []) if f in ("avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16",
                                                 "amx_bf16", "amx_int8", "avx2")]
    v = fp.get("versions", {})
    libs = " ".join(f"{k} {v[k]}" for k in ("torch", "onnxruntime", "openvino") if k in v)
    return f"{fp.get('cpu_model')}, {fp.get('threads', {}).get('affinity_cpus')} CPUs, {' '.join(isa)}; {libs}"


# The one definition of "the same machine" for measurements: the fingerprint's parts a measurement depends on (CPU,
# ISA, memory, OS, library versions, the CPUs this process may use and the threading environment; not the
# per-call thread settings). The journal's resume check (core/journal.py), the roofline cache (bench/roofline.py)
# and machine_class's label all read it, so they cannot disagree about which machine a figure is from.
MACHINE_FIELDS = ("cpu_model", "cpu_vendor", "cpu_family", "cpu_model_id", "arch", "logical_cpus", "isa",
                  "emulated", "memory_bytes", "os", "python", "versions", "gpu")


def machine_identity(fp: Mapping[str, Any]) -> dict[str, Any]:
    """What a measurement depends on about the machine: CPU, ISA, memory, OS, library versions, CPUs, thread env.
    Two fingerprints are of the same machine exactly when their identities are equal."""
    ident = {k: fp.get(k) for k in MACHINE_FIELDS}
    ident["affinity_cpus"] = (fp.get("threads") or {}).get("affinity_cpus")
    ident["env"] = fp.get("env")
    return ident


_VENDORS = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}


def machine_class(fp: Mapping[str, Any]) -> str:
    """The machine class a figure belongs to: vendor, model and the matrix ISA that decides which engine wins, e.g.
    'Intel: Intel(R) Xeon(R) Processor (family 6, model 143); AMX bf16 int8; AVX-512 bf16 vnni fp16; 2 CPUs'.
    Speed-ups measured on one class do not carry over to another (MKL makes eager PyTorch strong on Intel;
    bf16 runs on AMX tiles or on AVX-512 BF16), so every published ratio names its class. A label over
    machine_identity (read through it, so the same machine always has the same class)."""
    fp = machine_identity(fp)
    isa = set(fp.get("isa") or [])
    amx = [f.removeprefix("amx_") for f in ("amx_bf16", "amx_int8", "amx_fp16") if f in isa]
    avx512 = [f.removeprefix("avx512_") for f in ("avx512_bf16", "avx512_vnni", "avx512_fp16") if f in isa]
    parts = [f"AMX {' '.join(amx)}"] if amx else []
    if "avx512f" in isa:
        parts.append("AVX-512" + (f" {' '.join(avx512)}" if avx512 else ""))
    elif "avx2" in isa:
        parts.append("AVX2" + (" + AVX-VNNI" if "avx_vnni" in isa else ""))
    vendor = fp.get("cpu_vendor") or ""
    where = ", ".join(f"{k} {v}" for k, v in (("family", fp.get("cpu_family")), ("model", fp.get("cpu_model_id")))
                      if v not in (None, ""))
    cpus = fp.get("affinity_cpus") or fp.get("logical_cpus")
    name = f"{_VENDORS.get(vendor, vendor or 'unknown vendor')}: {fp.get('cpu_model')}"
    return (name + (f" ({where})" if where else "") + f"; {'; '.join(parts) or 'no AVX-512 or AMX'}"
            + (f"; emulated by QEMU as {fp['emulated']}" if fp.get("emulated") else "")
            + (f"; {cpus} CPUs" if cpus else ""))


def int8_dot(fp: dict[str, Any]) -> str:
    """How this CPU's int8 GEMM (onnxruntime's MLAS) adds u8*s8 products, which decides whether an int8 graph is
    computed exactly (export/saturation.py):
        "amx"      AMX int8 tiles, int32 accumulation: exact
        "vnni"     AVX-512 VNNI or AVX-VNNI (vpdpbusd), int32 accumulation: exact
        "avx2"     x86 without VNNI or AMX (AVX2, or AVX-512 without VNNI): adjacent pairs added in saturating
                   int16 (vpmaddubsw): exact only for graphs whose weights cannot saturate a pair
        "unknown"  anything else (not x86, or no ISA flags read)"""
    isa = set(fp.get("isa", []))
    if "amx_int8" in isa:
        return "amx"
    if isa & {"avx512_vnni", "avx_vnni"}:
        return "vnni"
    if isa & {"avx2", "avx512f"}:
        return "avx2"
    return "unknown"


def bf16_native(fp: dict[str, Any]) -> bool:
    """Does this CPU compute in bf16 natively (AVX-512 BF16 or AMX bf16)? Where it does not, OpenVINO ignores a
    bf16 precision hint and computes in f32: the `ov:bf16` runner then reports (and is judged as) f32."""
    return bool(set(fp.get("isa", [])) & {"avx512_bf16", "amx_bf16"})


# AMD Zen generations by (cpu family, model range): AMD's family/model numbering (family 25 = Zen 3 and Zen 4)
_ZEN = ((23, range(0x00, 0x30), 1), (23, range(0x30, 0x100), 2), (25, range(0x00, 0x10), 3),
        (25, range(0x20, 0x60), 3), (25, range(0x10, 0x20), 4), (25, range(0x60, 0x100), 4),
        (26, range(0x00, 0x100), 5))


def class_slug(fp: Mapping[str, Any]) -> str:
    """A short folder name for a machine class (reports/peers-<slug>/): 'zen3', 'zen5', 'xeon' (an Intel Xeon with
    AMX, the class met here), else vendor and matrix ISA ('intel-avx512-vnni', 'amd-avx2', 'x86_64')."""
    if fp.get("emulated"):  # the host's /proc/cpuinfo names the vendor and model, not the emulated CPU
        return "emulated-" + re.sub(r"[^a-z0-9]+", "-", str(fp["emulated"]).lower()).strip("-")
    vendor = _VENDORS.get(str(fp.get("cpu_vendor", "")), "")
    isa = set(fp.get("isa") or [])
    try:
        family, model = int(str(fp.get("cpu_family", ""))), int(str(fp.get("cpu_model_id", "")))
    except ValueError:
        family = model = -1
    if vendor == "AMD":
        for fam, models, gen in _ZEN:
            if family == fam and model in models:
                return f"zen{gen}"
    if vendor == "Intel" and "amx_int8" in isa and "xeon" in str(fp.get("cpu_model", "")).lower():
        return "xeon"
    if vendor:
        best = "amx" if "amx_int8" in isa else "avx512-vnni" if "avx512_vnni" in isa else \
            "avx512" if "avx512f" in isa else "avx2" if "avx2" in isa else "x86"
        return f"{vendor.lower()}-{best}"
    return str(fp.get("arch") or "unknown")


if __name__ == "__main__":  # `python -m xdeploy.core.fingerprint --slug`: the Makefile's report folder per class
    print(class_slug(fingerprint()) if sys.argv[1:] == ["--slug"] else summary(fingerprint()))
