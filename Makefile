# Every target sets up .venv from nothing: torch's CPU wheel first (so no dependency can pull a
# CUDA build), then zerolap with its dev extras, the Hugging Face clients and TensorBoard (torch
# pinned by constraints.txt), then the deepspeed shim (compat/), so that `import deepspeed` is
# zerolap.
VENV   ?= .venv
PYTHON ?= python3
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench

$(STAMP): pyproject.toml compat/pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q torch==2.13.0
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e ".[dev,hf,tensorboard]"
	$(VENV)/bin/python -m pip install -q -c constraints.txt ./compat
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/zerolap demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff format --check zerolap tests benchmarks examples compat
	$(VENV)/bin/ruff check zerolap tests benchmarks examples compat

bench: $(STAMP)
	$(VENV)/bin/zerolap bench
