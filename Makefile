# Two commands on a fresh machine: `make demo` (the main job) and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: install demo test lint clean cpp

# torch==2.13.0 is pinned (constraints.txt): it is the CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/xdeploy models
	for m in transformer bert gpt vit; do $(VENV)/bin/xdeploy export $$m --preset tiny --out artifacts/$$m-tiny-fp32 --force || exit 1; done

test: install cpp
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

# C++ embedding runtime (deploy/cpp): links the wheel's libonnxruntime; CMake fetches the ORT headers from Debian's
# libonnxruntime-dev into .cache/ort-headers on first configure (deploy/cpp/fetch_ort_headers.sh).
cpp: install
	cmake -S deploy/cpp -B deploy/cpp/build -DCMAKE_BUILD_TYPE=Release
	cmake --build deploy/cpp/build -j2

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) artifacts reports/latest deploy/cpp/build
