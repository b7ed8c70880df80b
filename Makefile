# Two entry points, each self-contained on a fresh machine: `make bench` (the main job) and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q -c requirements/constraints.txt
STAMP  := $(VENV)/.installed

.PHONY: venv test bench lint clean

venv: $(STAMP)

$(STAMP): requirements/constraints.txt requirements/dev.txt setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PIP) -r requirements/dev.txt
	$(PIP) --no-build-isolation --no-deps -e .
	touch $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .

test: venv lint
	$(PY) -m pytest -q tests benchmarks --benchmark-disable

bench: venv
	$(PY) -m benchmarks.run_model $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
