#!/usr/bin/env bash
# `make gpu-check` on a lent GPU machine that reaches no package index (this project's device tool: one call
# carries at most 64 MiB of working tree; a warm machine keeps its /tmp between calls, not the work tree's ignored
# folders).
#
# onnxruntime-gpu (~244 MiB wheel) does not fit one call, and TensorRT's libraries are not on PyPI at all
# (tensorrt-cu13-libs there is an sdist that downloads from pypi.nvidia.com), so here:
#   bash studies/gpu_lease.sh pack          # onnxruntime-gpu (constraints.txt's version, Python 3.12) as xz parts
#                                           # .gpu1/ .gpu2/ ... (git-ignored: add '/.gpu*/' to .git/info/exclude)
# and on the GPU machine, one call per part (carry: [".gpuN"]), the machine kept warm between them:
#   bash studies/gpu_lease.sh stash         # moves the carried .gpuN/ parts into /tmp/gpustash/ (kept between calls)
#   bash studies/gpu_lease.sh check ARGS    # joins and checks the parts, installs xdeploy (editable, no deps) and
#                                           # onnxruntime-gpu over the image's CPU wheel, runs gpu_check ARGS
#   bash studies/gpu_lease.sh run CMD ...   # the same set-up, then any command (python3 -m xdeploy.studies.gpu_decode)
#
# What fits a 15-minute lease (H200 machine, 2026-11-30; the working tree is ~17 MiB, so PART_MIB=45 and five parts):
# the machine's start ~40 s, each part's call ~6 s; the check's set-up ~15 s; the gpu tests 24-27 s; `gpu_decode`
# (tiny GPT and Transformer, GPT-2 small: exports, token checks, the cache-placement timing) ~110 s, ~115 s with
# the CUDA-graph placement (third lease: the gpu tests and gpu_decode together 141 s; `--models gpt --presets small`
# 109 s; `--models transformer --presets base` 84 s with the two runner tests). The full
# smoke run did not finish in 200 s and GPT-2 small's base run took 290 s (its bench 71 s and decode 116 s are
# mostly the PyTorch reference on the CPU): `check --runs default --skip bench` for parity and decoding only.
# Fourth lease: `gpu_decode --models gpt,transformer --presets tiny,small --precisions fp32,fp16,int8-dynamic
# --kernels` ~215 s (the fp16 and int8-dynamic exports of GPT-2 small ~50 and ~65 s); `xdeploy run --smoke --runners
# ort-cuda --precision fp32,int8,int8-dynamic --skip bench,decode,scale,roofline` 33 s; a bare `pytest -m gpu tests`
# stops at collection (the bundled MiniLM is not carried): pass --continue-on-collection-errors as gpu_check does.
# Optimized exports (`--precisions ...+opt`) of GPT-2 small take ~70 s each on 2 cores and more there: three did
# not finish in 330 s; give them a call of their own, the three `xdeploy export ... --optimize` side by side first
# (docs/runners.md, fourth lease, has the command; checked on 2 cores with the tiny GPT: 31 s, the study reusing them).
set -euo pipefail
cd "$(dirname "$0")/.."
PART_MIB=${PART_MIB:-49}

case "${1:-}" in
pack)
    py=${PYTHON:-python3}
    ver=$(sed -n 's/^onnxruntime==//p' constraints.txt)
    work=$(mktemp -d)
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d "$work" "onnxruntime-gpu==$ver"
    mkdir "$work/site" && (cd "$work/site" && unzip -q "$work"/onnxruntime_gpu-*.whl)
    tar -cf - -C "$work/site" . | xz -T2 -9 > "$work/ortgpu.tar.xz"
    rm -rf .gpu[0-9]* && split -b "${PART_MIB}M" -d -a 1 "$work/ortgpu.tar.xz" "$work/part"
    i=1
    for p in "$work"/part*; do mkdir ".gpu$i" && mv "$p" ".gpu$i/"; i=$((i + 1)); done
    (cd "$work" && sha256sum ortgpu.tar.xz | cut -d' ' -f1) > .gpu1/sha256
    echo "onnxruntime-gpu $ver: $((i - 1)) parts in .gpu1..$((i - 1)) ($(du -m "$work/ortgpu.tar.xz" | cut -f1) MiB)"
    rm -rf "$work"
    ;;
stash)
    mkdir -p /tmp/gpustash && for d in .gpu[0-9]*; do [ -d "$d" ] && mv "$d"/* /tmp/gpustash/; done
    ls -la /tmp/gpustash
    ;;
check|run)
    what=$1
    shift
    [ -f /tmp/gpustash/sha256 ] || { echo "gpu_lease: no /tmp/gpustash/sha256: run 'stash' with every part first"; exit 2; }
    if [ ! -f /tmp/ortgpu/.done ]; then  # once per machine: later checks in the same lease reuse it
        cat /tmp/gpustash/part* > /tmp/ortgpu.tar.xz
        echo "$(cat /tmp/gpustash/sha256)  /tmp/ortgpu.tar.xz" | sha256sum -c --quiet \
            || { echo "gpu_lease: the joined parts do not match their sha256 (a part missing?)"; exit 2; }
        rm -rf /tmp/ortgpu && mkdir /tmp/ortgpu
        python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' \
            /tmp/ortgpu.tar.xz | tar -xf - -C /tmp/ortgpu
        python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null
        # the image's CPU wheel out, so that the records' versions (importlib.metadata) name the GPU one
        python3 -m pip uninstall -q -y onnxruntime >/dev/null 2>&1 || true
        touch /tmp/ortgpu/.done
    fi
    export PYTHONPATH=/tmp/ortgpu${PYTHONPATH:+:$PYTHONPATH}  # ahead of the image's CPU onnxruntime
    # the CUDA 13 libraries onnxruntime-gpu links against, from the image's nvidia-* wheels (torch's)
    libs=$(python3 -c 'import glob, os, site; print(":".join(sorted({os.path.dirname(p) for d in site.getsitepackages() for p in glob.glob(d + "/nvidia/**/lib*.so*", recursive=True)})))')
    export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    python3 -c 'import onnxruntime as o, torch; print("onnxruntime", o.__version__, o.get_available_providers(), "| torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'
    [ "$what" = check ] && exec python3 -m xdeploy.studies.gpu_check "$@"
    exec "$@"
    ;;
*)
    echo "usage: bash studies/gpu_lease.sh pack|stash|check [gpu_check args]|run CMD..." >&2
    exit 2
    ;;
esac
