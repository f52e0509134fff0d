"""Run xdeploy on a CPU class this machine is not: QEMU user mode emulating an AVX2-only AMD Zen 3.

Which kernels a runtime runs depends on the CPU class (onnxruntime's AVX2 int8 GEMM adds u8*s8 pairs in saturating
int16, export/saturation.py; OpenVINO JIT-compiles for the ISA it finds), and the class changes between machines:
AVX2-only Zen 3, Zen 4/5 with AVX-512 VNNI, Xeon with AMX. A machine with VNNI can still *run* the AVX2 kernels:
`qemu-x86_64 -cpu EPYC-Milan` gives a process Zen 3's CPUID (AVX2, FMA, F16C; no AVX-512, VNNI or AMX), so
numpy, onnxruntime and OpenVINO dispatch exactly as they do on that class, on the host's cores, many times slower.
What it checks is correctness (an artifact's golden probes, the saturation model against onnxruntime's own AVX2
kernel); timings under emulation mean nothing. The emulated process is told (XDEPLOY_EMULATED_CPU) so that its
fingerprint reads the ISA from CPUID, not from the host's /proc/cpuinfo (core/fingerprint.py confirmed_isa), and
its machine class says "emulated".

    xdeploy verify ART --emulate avx2          # the golden probes on the AVX2-only class
    argv, env = emulated_command("avx2", ["-m", "xdeploy.cli", "verify", "ART"])

Only the AVX2 class can be emulated: QEMU's TCG has no AVX-512 (so no VNNI or AMX). QEMU 10 or later is required:
Debian 12's own qemu-user 7.2 computes OpenVINO's AVX2 tanh wrongly (a plain Tanh off by up to 0.995; 10.0.2 exact),
which xdeploy would report as the artifact's failure. Only this process is emulated: a subprocess it starts runs on
the host (verify starts none).
"""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence

from xdeploy.core.errors import XDeployError, one_of
from xdeploy.core.fingerprint import EMULATED_ENV

EMULATED_CPUS = {"avx2": "EPYC-Milan"}  # class -> QEMU CPU model (AMD Zen 3: AVX2, FMA, F16C)
QEMU = "qemu-x86_64"
MIN_QEMU = (10, 0)
INSTALL = ("install qemu-user >= 10 (Debian 12: apt-get install -t bookworm-backports qemu-user, with "
           "bookworm-backports in the apt sources; .ci/run does this)")
# QEMU's note for each CPUID feature of the model its TCG does not implement (none decides a kernel here)
_TCG_NOTE = re.compile(r"^qemu-x86_64: warning: TCG doesn't support requested feature")


@functools.cache
def qemu_version(binary: str) -> tuple[int, ...] | None:
    """(major, minor, ...) of `binary --version`, None if it does not answer like QEMU."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"version (\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


def emulator(cls: str) -> list[str]:
    """The command prefix that runs a program as CPU class `cls`; one-line XDeployError saying what to install when
    this host cannot."""
    if cls not in EMULATED_CPUS:
        raise one_of("emulated CPU class", cls, tuple(EMULATED_CPUS))
    if platform.machine() not in ("x86_64", "AMD64"):
        raise XDeployError(f"CPU emulation runs x86-64 programs on an x86-64 host; this one is {platform.machine()}")
    binary = shutil.which(QEMU)
    if binary is None:
        raise XDeployError(f"{QEMU} not found: {INSTALL}")
    version = qemu_version(binary)
    if version is None or version[:2] < MIN_QEMU:
        found = ".".join(map(str, version)) if version else "an unreadable version"
        raise XDeployError(f"{binary} is QEMU {found}; emulating the {cls} class needs QEMU >= "
                           f"{'.'.join(map(str, MIN_QEMU))} (7.2's AVX2 emulation computes OpenVINO's tanh wrongly): "
                           f"{INSTALL}")
    return [binary, "-cpu", EMULATED_CPUS[cls]]


def emulated_command(cls: str, python_args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """(argv, env) that run this Python with `python_args` as CPU class `cls`."""
    prefix = emulator(cls)
    return [*prefix, sys.executable, *python_args], dict(os.environ) | {EMULATED_ENV: EMULATED_CPUS[cls]}


def run_emulated(cls: str, python_args: Sequence[str], *, timeout: float | None = None
                 ) -> subprocess.CompletedProcess[str]:
    """Run this Python with `python_args` as CPU class `cls`; stdout and stderr captured (QEMU's notes on CPUID
    features its TCG lacks are left out of stderr)."""
    argv, env = emulated_command(cls, python_args)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    done.stderr = "".join(line for line in done.stderr.splitlines(keepends=True) if not _TCG_NOTE.match(line))
    return done
