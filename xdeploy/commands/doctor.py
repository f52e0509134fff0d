"""xdeploy doctor: which runners can open on this machine, which CPU classes it can emulate (`verify --emulate`),
and (--gpu) the GPU ready check of `make gpu-check`."""

from __future__ import annotations

import argparse

from xdeploy.core.errors import XDeployError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", action="store_true",
                   help="run the GPU check (gpu tests + xdeploy run on trt, ort-cuda, ort-trt -> --out); on a "
                        "machine or environment without what it needs: one line saying what is missing, exit 2")
    p.add_argument("--out", default="reports/gpu", help="where --gpu writes verification.md (default reports/gpu)")


def runner_gaps() -> dict[str, list[str]]:
    """Registered runner -> what this machine/environment lacks to open it ([] = nothing): each runner says what
    it needs (deploy/registry.gaps); a GPU runner first needs the machine to have a GPU at all."""
    from xdeploy.deploy.registry import RUNNERS, gaps, needs_gpu
    from xdeploy.studies.gpu_check import machine_gaps

    machine = machine_gaps()
    return {name: (machine if needs_gpu(name) else []) + gaps(name) for name in RUNNERS}


def run(args: argparse.Namespace) -> int:
    from xdeploy.studies import gpu_check

    if args.gpu:
        # the machine first: no env can fix that; full_check then runs the GPU runners this env can open
        gaps = gpu_check.machine_gaps()
        if gaps:
            raise XDeployError(gpu_check.one_line(gaps))
        from pathlib import Path

        return gpu_check.full_check(Path(args.out))
    for name, gaps in runner_gaps().items():
        print(f"{name:9s} {'ok' if not gaps else 'unavailable: ' + '; '.join(gaps)}")
    from xdeploy.verify.emulate import EMULATED_CPUS, emulator

    for cls, model in EMULATED_CPUS.items():
        try:
            emulator(cls)
            print(f"emulate  {cls}: ok (QEMU as {model}: xdeploy verify ARTIFACT --emulate {cls})")
        except XDeployError as e:
            print(f"emulate  {cls}: unavailable: {e}")
    return 0
