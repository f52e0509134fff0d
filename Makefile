# Two commands on a fresh machine: `make demo` (the main job) and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: install demo test lint clean cpp serve-env gpu-env gpu-check peers peers-env

# torch==2.13.0 is pinned (constraints.txt): it is the CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
# Packages are installed by uv (pinned in constraints.txt, bootstrapped into .venv with pip): the same pinned
# versions as pip, several times faster (parallel downloads and unpacking; .venv measured 50 s with uv vs 4 min
# 55 s with pip on the busy 2-core machine). If uv fails, pip does the install; NO_UV=1 uses pip only. uv does
# not read pip's configuration, so pip's find-links (where a machine may keep its CPU torch wheel) are passed on.
# --compile-bytecode: uv, unlike pip, installs no .pyc files by default, and where PYTHONDONTWRITEBYTECODE is set
# (as on this project's machines) every Python process then compiles torch & co. from source again: `import torch,
# onnxruntime, onnx` took 2.8 s instead of 1.4 s, and `make test` starts hundreds of such processes. Compiling once
# at install costs ~18 s of wall time on 2 cores.
UV        := $(VENV)/bin/uv
FIND_LINKS = $(foreach d,$(sort $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)),--find-links $(d))
UV_PIP     = $(if $(NO_UV),false,$(UV) pip install -q --compile-bytecode $(FIND_LINKS))
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(if $(NO_UV),,$(PY) -m pip install -q -c constraints.txt uv)
	$(UV_PIP) --python $(PY) -c constraints.txt -e '.[test]' || $(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The main job: all four models -> fp32/fp16/int8 -> parity -> bench -> scale -> decode -> reports/latest/
# (DEMO_ARGS=--full: base presets, for the reference report).
demo: install
	$(VENV)/bin/xdeploy run --out reports/latest $(DEMO_ARGS)

# pytest-xdist workers (the suite is single-core bound: its CPU time ~ its wall time in one process, and many
# tests wait on servers and child processes); tests/conftest.py keeps each module that shares a module fixture
# on one worker. Fresh clone, quiet 2-core Xeon: 2 workers 418 s for the whole `make test` (483 tests); 3 workers were
# slower (75% done after 8 min, measured before install compiled bytecode). PYTEST_WORKERS=0 runs everything in one process.
# The C++ build (CPU: ~12 s) and the serving env (mostly unpacking: ~16 s) both need only .venv, so they run side by
# side (~8 s less of make test's set-up on 2 cores).
PYTEST_WORKERS ?= 2
test: install
	$(MAKE) --no-print-directory -j2 cpp serve-env
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=15

# C++ embedding runtime (deploy/cpp): links the wheel's libonnxruntime; CMake fetches the ORT headers from Debian's
# libonnxruntime-dev into .cache/ort-headers on first configure (deploy/cpp/fetch_ort_headers.sh).
# $(realpath ...): the checkout's physical path even when make runs in a directory of symlinks into it (the docs
# test's scratch copy): otherwise CMake re-configures the one build with the scratch path as the binary's RUNPATH,
# and the binary breaks when the scratch directory is deleted.
# One build of deploy/cpp/build at a time (flock, util-linux; tests/test_cpp.py takes the same lock): with
# PYTEST_WORKERS=2, docs/embedding.md's `make cpp` may run beside test_cpp.py's build check.
CPP_SRC = $(realpath deploy/cpp)
CPP_LOCK = $(if $(shell command -v flock),flock $(CPP_SRC)/.build.lock)
cpp: install
	$(CPP_LOCK) cmake -S $(CPP_SRC) -B $(CPP_SRC)/build -DCMAKE_BUILD_TYPE=Release
	$(CPP_LOCK) cmake --build $(CPP_SRC)/build -j2

# Lean serving env for `xdeploy serve` (serve/server.py): PyTriton's Python stub fails under Python 3.11 and works
# under 3.12 and 3.13, and the server needs no torch. Python 3.12 first: nvidia-pytriton 0.7 needs numpy < 2, and
# numpy 1.26.4 / ml-dtypes 0.4.1 have cp312 wheels but no cp313 ones (3.13 compiles numpy from source: minutes).
# --only-binary makes a missing wheel an error instead of a silent compile. Pinned in requirements-serve.txt;
# xdeploy installed --no-deps on top. PYTHON_SERVE=/path/to/python3.1x overrides the search.
PYTHON_SERVE ?= $(shell for p in python3.12 $$(pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12 python3.13 \
	$$(pyenv root 2>/dev/null)/versions/3.13*/bin/python3.13; do \
	$$p -c 'import sys' >/dev/null 2>&1 && { command -v $$p || echo $$p; } && break; done)
SERVE_VENV  ?= .venv-serve
SERVE_STAMP := $(SERVE_VENV)/.installed-stamp
SERVE_BINARY = $(if $(PYTHON_SERVE),$(shell $(PYTHON_SERVE) -c \
	'import sys; print("--only-binary=:all:" if sys.version_info < (3, 13) else "")'))
$(SERVE_STAMP): requirements-serve.txt pyproject.toml | $(STAMP)
	@test -n "$(PYTHON_SERVE)" || { echo "make serve-env: needs Python 3.12 or 3.13 (set PYTHON_SERVE=/path/to/python3.12)"; exit 1; }
	$(PYTHON_SERVE) -m venv $(SERVE_VENV)
	$(UV_PIP) --python $(SERVE_VENV)/bin/python $(SERVE_BINARY) -r requirements-serve.txt \
		|| $(SERVE_VENV)/bin/python -m pip install -q $(SERVE_BINARY) -r requirements-serve.txt
	$(UV_PIP) --python $(SERVE_VENV)/bin/python --no-deps -e . || $(SERVE_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(SERVE_STAMP)

serve-env: $(SERVE_STAMP)

# GPU env (.venv-gpu): onnxruntime-gpu *instead of* onnxruntime (both install the same `onnxruntime` package
# directory, so only one may be present), tensorrt, and PyPI's CUDA build of the pinned torch version.
# `make gpu-check` then runs the gpu-marked tests and `xdeploy run --runners trt,ort-cuda,ort-trt` on the default
# and base presets, writing reports/gpu/verification.md. On a machine without an NVIDIA GPU both stop at once
# with one line saying what is missing (studies/gpu_check.py --preflight, standard library only). On a lent GPU
# machine that reaches no package index, studies/gpu_lease.sh carries onnxruntime-gpu there in parts and runs the
# same check (docs/runners.md, "Measured on an NVIDIA H200").
GPU_VENV      ?= .venv-gpu
GPU_PY        := $(GPU_VENV)/bin/python
GPU_STAMP     := $(GPU_VENV)/.installed-stamp
ORT_VERSION   := $(shell sed -n 's/^onnxruntime==//p' constraints.txt)
TORCH_VERSION := $(shell sed -n 's/^torch==\([^+]*\).*/\1/p' constraints.txt)
ifneq ($(filter gpu-env gpu-check,$(MAKECMDGOALS)),)
GPU_MISSING := $(shell $(PYTHON) studies/gpu_check.py --preflight)
ifneq ($(GPU_MISSING),)
$(error $(GPU_MISSING))
endif
endif

$(GPU_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(GPU_VENV)
	grep -v -E '^(torch|onnxruntime)==' constraints.txt > $(GPU_VENV)/constraints-gpu.txt
	$(GPU_PY) -m pip install -q --upgrade pip
	$(GPU_PY) -m pip install -q -c $(GPU_VENV)/constraints-gpu.txt "torch==$(TORCH_VERSION)" -e '.[test,gpu]'
	$(GPU_PY) -m pip uninstall -q -y onnxruntime
	$(GPU_PY) -m pip install -q --no-deps --force-reinstall "onnxruntime-gpu==$(ORT_VERSION)"
	touch $(GPU_STAMP)

gpu-env: $(GPU_STAMP)

gpu-check: gpu-env
	$(GPU_PY) -m xdeploy.studies.gpu_check --out reports/gpu

# Peers environment (.venv-peers) and study: xdeploy against Hugging Face Optimum (optimum-onnx, optimum-intel) and,
# for sentence embeddings, sentence-transformers' onnx/openvino backends (its own exports, int8 included) and
# fastembed, on the same checkpoints, timed interleaved in one process (studies/peers.py). Optimum pins
# transformers<4.58, so it gets its own env, fully pinned in requirements-peers.txt (same torch, onnxruntime
# and openvino as .venv);
# xdeploy is installed on top with --no-deps. `make peers` writes reports/peers/ (records + rendered table);
# PEERS_ARGS=--quick for the tiny version, e.g. PEERS_ARGS="--workloads bert-base-b1,minilm-sentences"; the sentence
# workload always has xdeploy's static Q/DQ int8 row, --static-int8 adds it to the others (minutes of export each).
# Then the generation peers (studies/peers_generate.py: GPT-2 small and the trained tiny GPT, KV-cache decoding
# against transformers, optimum-intel, CTranslate2, onnxruntime-genai and openvino-genai) into
# $(PEERS_OUT)/generate/; PEERS_GEN_ARGS passes its options (e.g. --quick, --static-int8). PEERS_OUT defaults to this
# machine class's report folder, reports/peers-<class> (core/fingerprint.class_slug: zen3, zen5, xeon, ...).
PEERS_VENV  ?= .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed-stamp
$(PEERS_STAMP): requirements-peers.txt pyproject.toml
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install -q -r requirements-peers.txt
	$(PEERS_VENV)/bin/python -m pip install -q --no-deps -e .
	$(PEERS_VENV)/bin/python -m pip check
	touch $(PEERS_STAMP)

peers-env: $(PEERS_STAMP)

PEERS_OUT ?= reports/peers-$(shell $(PEERS_VENV)/bin/python -m xdeploy.core.fingerprint --slug)
peers: peers-env
	$(PEERS_VENV)/bin/python -m xdeploy.studies.peers --out $(PEERS_OUT) $(PEERS_ARGS)
	$(PEERS_VENV)/bin/python -m xdeploy.studies.peers_generate --out $(PEERS_OUT)/generate $(PEERS_GEN_ARGS)

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(SERVE_VENV) $(GPU_VENV) artifacts reports/latest deploy/cpp/build
