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
# an extra index for torch's own dependencies; a CPU build also wins over the default index's
# release of the same version (its `+cpu` local version sorts higher). Where torch's index cannot
# be reached, pip takes the pinned release from the other sources it knows (a CPU wheel that pip
# is configured to find locally, else the default index's CUDA build: the check below says so).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
DEFAULT_INDEX ?= https://pypi.org/simple
ifeq ($(DEVICE),cuda)
TORCH_PIP_ARGS ?=
EXTRAS := test,cuda
SERVE_DEVICE := --device cuda --dtype bfloat16
else
TORCH_PIP_ARGS ?= --index-url $(TORCH_CPU_INDEX) --extra-index-url $(DEFAULT_INDEX)
EXTRAS := test
SERVE_DEVICE :=
endif
TORCH_CHECK := import sys, torch; cuda = torch.version.cuda; want = sys.argv[1]; \
  print("torch", torch.__version__, "(CUDA " + cuda + " build)" if cuda else "(CPU-only build)"); \
  cuda and want == "cpu" and print("warning: a CUDA build of torch on a CPU install: the CPU index " \
    "was not reachable (TORCH_CPU_INDEX may name a mirror of it)"); \
  not cuda and want == "cuda" and print("warning: this torch has no CUDA: pass " \
    "TORCH_PIP_ARGS=\"--index-url https://download.pytorch.org/whl/cuXYZ\" for your CUDA version")

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIP_ARGS) "torch==$(TORCH_VERSION)"
	$(BIN)/python -c '$(TORCH_CHECK)' $(DEVICE)
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	touch $@

install: $(BIN)/.installed

serve: install
	$(BIN)/s5serve serve --model embedded --host $(HOST) --port $(PORT) $(SERVE_DEVICE)

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

# Builds both images and probes each (health, a completion, the user, a draining stop) wherever a
# Docker engine runs; the CUDA image runs only where Docker has GPUs (SMOKE_GPU=0: build it only).
docker-smoke:
	bash docker/smoke.sh

.PHONY: install serve test test-kernels bench recall docker-smoke
