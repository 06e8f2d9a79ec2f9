#!/usr/bin/env bash
# The CUDA checks and benchmarks in one run: GPU-marked tests (kernels vs references, graph vs
# eager, oracle, HF generate, block reuse), then decode-1238 throughput on random-weight BENCH.md
# shapes.   bash bench/cuda_suite.sh [results dir] [quick|full]
set -uo pipefail
OUT=${1:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/equivalence/test_cuda.py -s 2>&1 | tee "$OUT/cuda-tests.log" | grep -v "^\.$"
case "${2:-}" in
  quick) python3 -m bench.throughput --shape gemma3-1b --dtype bfloat16 --n 1 64 --out "$OUT" --tag quick ;;
  full)
    python3 -m bench.throughput --shape gemma3-1b --dtype bfloat16 --n 1 8 64 256 --out "$OUT"
    python3 -m bench.throughput --shape gemma3-4b --dtype bfloat16 --n 1 8 64 --out "$OUT"
    python3 -m bench.profile_decode --shape gemma3-4b --n 1 64 2>&1 | grep -A24 "^N=" ;;
  *)
    python3 -m bench.throughput --shape gemma3-4b --dtype bfloat16 --n 1 8 64 --out "$OUT"
    python3 -m bench.throughput --shape gemma3-1b --dtype bfloat16 --n 1 64 256 --out "$OUT" ;;
esac
