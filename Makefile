# Two commands on a fresh clone: `make serve` and `make test`. Each installs what it needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first and pinned to a CPU-capable release, so nothing resolves a multi-GB CUDA build.
TORCH ?= torch==2.13.0

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(BIN)/.installed

serve: install
	$(BIN)/s5serve serve --model embedded --host 0.0.0.0 --port 8000

test: install
	$(BIN)/python -m pytest -q

# The CUDA kernels' logic on the CPU, in Triton's interpreter (the CPU torch build has no Triton).
test-kernels: install
	$(BIN)/pip install -q "triton==3.9.0"
	$(BIN)/python -m pytest -q -m interpret -s tests/kernels

bench: install
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python -m bench.throughput

recall: install
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python -m bench.recall

.PHONY: install serve test test-kernels bench recall
