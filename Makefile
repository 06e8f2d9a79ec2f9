# Two commands on a fresh clone: `make serve` and `make test`. Each installs what it needs.
#
#   make serve                 CPU: torch's CPU-only build into .venv, serves on 127.0.0.1:8000
#   make serve DEVICE=cuda     NVIDIA GPU: a CUDA build of torch and bitsandbytes into .venv-cuda
#   make serve HOST=0.0.0.0    every interface (set S5_API_KEYS then: the server warns without keys)
PY ?= python3
DEVICE ?= cpu
VENV ?= $(if $(filter cuda,$(DEVICE)),.venv-cuda,.venv)
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
# The torch release the project is tested with (pyproject.toml admits any torch >= 2.6, the floor
# transformers 5 sets). The images install the same release (docker/Dockerfile*).
TORCH_VERSION ?= 2.13.0
# On the CPU, torch comes from torch's own index of CPU-only builds: the default index's Linux
# torch is a CUDA build that brings ~20 nvidia-* packages (several GB). The default index stays
# an extra index for torch's own dependencies (the CPU build's `+cpu` local version sorts above
# the default index's release of the same version, so it wins). Where torch's index cannot be
# reached (checked once, before pip runs), pip takes the pinned release from the sources it is
# configured with: a CPU wheel it finds locally, else the default index's CUDA build, which the
# check after it reports.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# DEVICE=cuda: empty takes the default index's CUDA build; https://download.pytorch.org/whl/cuXYZ
# picks a CUDA version.
TORCH_CUDA_INDEX ?=
DEFAULT_INDEX ?= https://pypi.org/simple
ifeq ($(DEVICE),cuda)
TORCH_INDEX := $(TORCH_CUDA_INDEX)
EXTRAS := test,cuda
SERVE_DEVICE := --device cuda --dtype bfloat16
else
TORCH_INDEX := $(TORCH_CPU_INDEX)
EXTRAS := test
SERVE_DEVICE :=
endif
INDEX_UP := import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=15)
TORCH_CHECK := import sys, torch; cuda = torch.version.cuda; want = sys.argv[1]; \
  print("torch", torch.__version__, "(CUDA " + cuda + " build)" if cuda else "(CPU-only build)"); \
  cuda and want == "cpu" and print("warning: a CUDA build of torch on a CPU install: the CPU index " \
    "was not reachable (TORCH_CPU_INDEX may name a mirror of it)"); \
  not cuda and want == "cuda" and print("warning: this torch has no CUDA: set TORCH_CUDA_INDEX to " \
    "https://download.pytorch.org/whl/cuXYZ for your CUDA version")

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@if [ -z "$(TORCH_INDEX)" ]; then \
	  echo "$(BIN)/pip install torch==$(TORCH_VERSION)"; \
	  $(BIN)/pip install -q "torch==$(TORCH_VERSION)"; \
	elif $(BIN)/python -c '$(INDEX_UP)' "$(TORCH_INDEX)" 2>/dev/null; then \
	  echo "$(BIN)/pip install torch==$(TORCH_VERSION) from $(TORCH_INDEX)"; \
	  $(BIN)/pip install -q --index-url "$(TORCH_INDEX)" --extra-index-url "$(DEFAULT_INDEX)" "torch==$(TORCH_VERSION)"; \
	else \
	  echo "$(TORCH_INDEX) is not reachable: pip install torch==$(TORCH_VERSION) from the configured indexes"; \
	  $(BIN)/pip install -q "torch==$(TORCH_VERSION)"; \
	fi
	@$(BIN)/python -W ignore -c '$(TORCH_CHECK)' $(DEVICE)
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	touch $@

install: $(BIN)/.installed

serve: install
	$(BIN)/s5serve serve --model embedded --host $(HOST) --port $(PORT) $(SERVE_DEVICE)

# Two at a time (pytest-xdist, a module per worker, one thread each: tests/conftest.py), then
# alone the tests marked serial: those that bound a latency, and those whose threads keep every
# core busy on their own.
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not serial"
	$(BIN)/python -m pytest -q -m serial

# The CUDA kernels' logic on the CPU, in Triton's interpreter (the CPU torch build has no Triton).
test-kernels: install
	$(BIN)/pip install -q "triton==3.9.0" "bitsandbytes>=0.50"
	$(BIN)/python -m pytest -q -m interpret -s tests/kernels

bench: install
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python -m bench.throughput

recall: install
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python -m bench.recall

# Builds both images and probes each (health, a completion, the user, a draining stop) wherever a
# Docker engine runs; the CUDA image runs only where Docker has GPUs (SMOKE_GPU=0: build it only).
docker-smoke:
	bash docker/smoke.sh

.PHONY: install serve test test-kernels bench recall docker-smoke
