#!/usr/bin/env bash
# The CUDA checks and benchmarks in one run: GPU-marked tests (kernels vs references, graph vs
# eager, oracle, HF generate, block reuse, bnb-4bit, device sampler, swap and rebuild), then
# decode-1238 throughput on random-weight BENCH.md shapes, or the capacity run.
#   bash bench/cuda_suite.sh [results dir] [quick|full|regress|capacity|moe|moe-nf4|nf4-profile|nf4-sweep|nf4-permute|nf4-mma|nf4-cuda|nf4-tiles|nf4-stream|nf4-stage|nf4-stage-throughput|nf4-stage-check|nf4-stage-4b|attn-wide|fused-ends|nf4-block|nf4-block-profile|nf4-figures|nf4-cuda-throughput|nf4-cuda-pdl|nf4-mma-profile|nf4-mma-throughput|gemv-ab|attn-ring|step-n64|step-ab|targets|tune|overlap|overlap-1b|pdl|pdl-1b|serve|serve-4b|stall|cluster|nf4]
# regress: BEFORE=<a directory holding an earlier tree> compares its engine with this one
# A bitsandbytes wheel in wheels/ is installed first where the image has none.
set -uo pipefail
OUT=${1:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if ! python3 -c "import bitsandbytes" 2>/dev/null && ls wheels/bitsandbytes-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps wheels/bitsandbytes-*.whl 2>&1 | tail -1
fi
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
python3 -c "import bitsandbytes; print('bitsandbytes', bitsandbytes.__version__)" 2>/dev/null || echo "bitsandbytes: not installed"
run_tests() {
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/equivalence/test_cuda.py tests/equivalence/test_cuda_nf4.py \
    tests/equivalence/test_cuda_sampling.py -s 2>&1 \
    | tee "$OUT/cuda-tests.log" | grep -v "^\.$"
}
# The nf4-stage modes: this tree (after) against BEFORE's (before), each with its own extension
# build, results into $OUT/after and $OUT/before. stage_side: into that side's tree (in a subshell).
stage_side() {
  if [ "$1" = before ]; then cd "$BEFORE" && export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/ext}-before"; fi
}
stage_build() {  # both sides' extensions, side by side
  for side in after before; do
    (stage_side $side && python3 -c \
      "from engine.kernels import nf4_cuda; print('$side: CUDA NF4 kernel built:', nf4_cuda.extension() is not None)") &
  done
  wait
}
stage_tests() {  # LOG KEYWORDS TIMEOUT: this tree's NF4 GPU tests
  timeout "$3" python3 -m pytest -q -p no:cacheprovider -n 4 -rP -m gpu tests/equivalence/test_cuda_nf4.py -k "$2" \
    2>&1 | tee "$OUT/$1.log" | grep -v "^\.$" | grep -E "passed|failed|Error|error|nf4 experts|nf4 cuda|greedy|plan" \
    | tail -20
}
stage_launches() {  # SIDE: every launch at 1 and 8 rows
  local out; out=$(cd "$OUT" && pwd)
  (stage_side "$1" && timeout 160 python3 -m bench.nf4_cuda --shape gemma3-4b --rows 1 8 --out "$out/$1" 2>&1 \
    | tee "$out/nf4-cuda-stage-$1.log" | grep -E "fastest, tiles|^ +(qkv|o|gate_up|down) " | head -40)
}
stage_experts() {  # SIDE: the 26B-A4B experts' two stages at 1 and 8 tokens
  local out; out=$(cd "$OUT" && pwd)
  (stage_side "$1" && timeout 120 python3 -m bench.tune_kernels --shape gemma4-26b-a4b --experts 1 8 --nf4 --rows \
    --out "$out/$1" --tag stage-$1-experts 2>&1 | tee "$out/tune-stage-$1.log" | tail -7)
}
stage_decode() {  # SHAPE SIDE: 4-bit decode at N=1 and 8 (DECODE_N)
  local out; out=$(cd "$OUT" && pwd)
  (stage_side "$2" && timeout 200 python3 -m bench.throughput --shape "$1" --dtype bfloat16 --weights bnb-4bit \
    --layers fused --policies s5 --n ${DECODE_N:-1 8} --no-quality --out "$out/$2" --tag stage-$2 2>&1 \
    | tee "$out/throughput-$1-stage-$2.log" | tail -6)
}
attention_tests() {  # TAG TIMEOUT: the GPU tests named by AB_TESTS (a pytest -k expression over test_cuda.py;
  # default the decode attention's and the engine's around it); TESTS=0 skips them
  if [ "${TESTS:-1}" != 0 ]; then
    timeout "$2" python3 -m pytest -q -p no:cacheprovider -n 4 -m gpu tests/equivalence/test_cuda.py \
      -k "${AB_TESTS:-decode_attention or graph_decode or fused_forward or pdl_launches or overlap}" 2>&1 \
      | tee "$OUT/cuda-tests-$1.log" | grep -E "passed|failed|Error" | tail -20
  fi
}
case "${2:-}" in
  quick) run_tests; python3 -m bench.throughput --shape gemma3-1b --dtype bfloat16 --n 1 64 --out "$OUT" --tag quick ;;
  nf4)  # the NF4 kernels against bitsandbytes, 4-bit decode on the engine's kernels (fused) against
    # bitsandbytes' own forward (stock) in the same run, then the products per projection; each
    # step bounded so that the run ends within 9 minutes; the tests in 6 processes (about 2 minutes,
    # 5.5 in one), their printed errors and token counts shown by -rP
    timeout 180 python3 -m pytest -q -p no:cacheprovider -n 6 -rP -m gpu tests/equivalence/test_cuda_nf4.py \
      tests/equivalence/test_cuda.py -k "nf4 or bnb4" 2>&1 | tee "$OUT/cuda-tests-nf4.log" | grep -v "^\.$"
    timeout 220 python3 -m bench.throughput --shape gemma3-4b --dtype bfloat16 --weights bnb-4bit \
      --layers stock fused --policies s5 --n 1 64 --no-quality --out "$OUT" --tag nf4
    timeout 120 python3 -m bench.nf4_kernels --shape gemma3-4b --n 1 8 64 --out "$OUT" 2>&1 | tee "$OUT/nf4-kernels.log" ;;
  moe-nf4)  # the NF4 experts kernels and the Gemma 4 engine on them against their references, their
    # launches at 1 and 8 tokens, then the MoE shape in bnb-4bit (linears and experts in NF4)
    timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 -rP -m gpu tests/equivalence/test_cuda_nf4.py \
      tests/equivalence/test_cuda.py -k "experts or gemma4" 2>&1 | tee "$OUT/cuda-tests-nf4-experts.log" | grep -v "^\.$"
    timeout 150 python3 -m bench.tune_kernels --shape gemma4-26b-a4b --experts 1 8 --nf4 --out "$OUT" --tag moe-nf4 \
      2>&1 | tee "$OUT/tune-moe-nf4.log"
    timeout 400 python3 -m bench.throughput --shape gemma4-26b-a4b --dtype bfloat16 --weights bnb-4bit --n 1 8 \
      --no-quality --out "$OUT" --tag nf4-experts 2>&1 | tee "$OUT/throughput-moe-nf4.log" ;;
  nf4-profile)  # every NF4, bnb-4bit and Gemma 4 GPU test, then where a 4-bit decode step's time goes
    # (kernels of one forward by device time), dense 4B and the MoE shape
    timeout 200 python3 -m pytest -q -p no:cacheprovider -n 6 -rP -m gpu tests/equivalence/test_cuda_nf4.py \
      tests/equivalence/test_cuda.py -k "nf4 or bnb4 or experts or gemma4" 2>&1 | tee "$OUT/cuda-tests-nf4-profile.log" \
      | grep -v "^\.$" | tail -40
    timeout 120 python3 -m bench.profile_decode --shape gemma3-4b --weights bnb-4bit --n 1 64 2>&1 \
      | tee "$OUT/profile-decode-gemma3-4b-nf4.log" | grep -A34 "^N="
    timeout 240 python3 -m bench.profile_decode --shape gemma4-26b-a4b --weights bnb-4bit --n 1 8 2>&1 \
      | tee "$OUT/profile-decode-gemma4-26b-a4b-nf4.log" | grep -A34 "^N=" ;;
  nf4-permute)  # NF4 launches with the code lookup by warp shuffle against the lookup by byte permutes
    # (Gemma-3 4B projections at 1, 8 and 64 rows; SWEEP=permute: a grid of tiles, SWEEP=permute-planned:
    # the planned launches), then the NF4 kernels' GPU tests
    timeout 400 python3 -m bench.nf4_kernels --shape gemma3-4b --n 1 8 64 --sweep ${SWEEP:-permute} --out "$OUT" 2>&1 \
      | tee "$OUT/nf4-kernels-permute.log" | grep -v "^ \{9\}"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rP -m gpu tests/equivalence/test_cuda_nf4.py -k kernels_match \
      2>&1 | tee "$OUT/cuda-tests-nf4-permute.log" | grep -v "^\.$" | tail -8 ;;
  nf4-mma)  # the kernel that decodes the codes into mma.sync fragments: its GPU tests and the NF4
    # kernels' (planned launches, plans), then its lookups and tiles against the planned launches
    # (Gemma-3 4B projections at 1, 8 and 16 rows)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -n 4 -rP -m gpu tests/equivalence/test_cuda_nf4.py \
      -k "kernels_match or mma or plans" 2>&1 | tee "$OUT/cuda-tests-nf4-mma.log" | grep -v "^\.$" | tail -14
    timeout 360 python3 -m bench.nf4_kernels --shape gemma3-4b --n 1 8 16 --sweep mma --out "$OUT" 2>&1 \
      | tee "$OUT/nf4-kernels-mma.log" | grep -v "^ \{9\}" ;;
  nf4-cuda)  # the one-row NF4 product in CUDA C++ (engine/kernels/cuda/nf4_gemv.cu, built here by
    # torch's extension loader) against the Triton plan's launch, Gemma-3 4B projections at one row
    timeout 300 python3 -m bench.nf4_cuda --shape gemma3-4b --out "$OUT" 2>&1 | tee "$OUT/nf4-cuda.log"
    # Nsight Compute on gate/up (NCU=0: not run): the CUDA kernel, its loads alone, and the Triton one-row kernel
    [ "${NCU:-1}" = 0 ] && exit 0
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    timeout 200 "$NCU" --clock-control none -k regex:'nf4_gemv' -s 3 -c 3 --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section Occupancy --section SchedulerStats --section WarpStateStats \
      python3 -c "
import torch; from engine.kernels import nf4, nf4_cuda
w = nf4.NF4Weight(torch.randint(0, 256, (20480, 1280), dtype=torch.uint8, device='cuda'),
                  torch.rand(20480, 40, device='cuda'), torch.linspace(-1, 1, 16, device='cuda'), torch.bfloat16)
x = torch.randn(1, 2560, device='cuda').to(torch.bfloat16)
for _ in range(2):
    nf4_cuda.gemv(x, w, (4, 8, 1, 8), 132)
    nf4_cuda.gemv(x, w, (4, 8, 1, 8), 132, mode=1)
    nf4.nf4_matmul(x, w, 1, 32, 256, 1, warps=4, stages=3, shfl=True)
torch.cuda.synchronize()" 2>&1 | tee "$OUT/ncu-nf4-cuda.log" | grep -v "^==PROF==" | grep -v "^ *$" | tail -150 ;;
  nf4-tiles)  # the CUDA kernel's tensor-core tiles: its GPU tests, the NF4 plans' and the NF4 experts'
    # (and their plan), the engines' greedy tokens on NF4 against bitsandbytes (the plans in place),
    # then every launch of the kernel against the Triton plan's, Gemma-3 4B projections at 1 and 8
    # rows of x, then the 26B-A4B shape's NF4 experts on the Triton kernels and on the tiles; the
    # extension built once first, into TORCH_EXTENSIONS_DIR where set
    python3 -c "from engine.kernels import nf4_cuda; print('CUDA NF4 kernel built:', nf4_cuda.extension() is not None)"
    timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 -rP -m gpu tests/equivalence/test_cuda_nf4.py \
      -k "cuda_one_row or plans or experts_match or experts_plan or greedy_tokens" 2>&1 \
      | tee "$OUT/cuda-tests-nf4-tiles.log" | grep -v "^\.$" | tail -16
    timeout 330 python3 -m bench.nf4_cuda --shape gemma3-4b --rows 1 8 --out "$OUT" 2>&1 \
      | tee "$OUT/nf4-cuda-tiles.log" | grep -v disagrees
    timeout 300 python3 -m bench.tune_kernels --shape gemma4-26b-a4b --experts 1 8 --nf4 --rows --out "$OUT" \
      --tag nf4-tiles-experts 2>&1 | tail -12 ;;
  nf4-stream)  # the tiles' weights streamed through each warp's ring of asynchronous copies: Nsight
    # Compute on Gemma-3 4B's gate/up at one row (the product, and without the weight loads), then
    # every launch against the Triton plan's at 1 and 8 rows; BEFORE="<earlier trees>" runs the same
    # benchmark on each after (their extensions built apart), into before-<name>/
    python3 -c "from engine.kernels import nf4_cuda; print('CUDA NF4 kernel built:', nf4_cuda.extension() is not None)"
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ -n "$NCU" ] && [ "${NCU_RUN:-1}" = 1 ] && timeout 200 "$NCU" --clock-control none -k regex:nf4_gemv_table_kernel \
      -s 4 -c 2 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats python3 -m bench.nf4_cuda --profile 16,12,1,1 16,12,1,1:2 \
      2>&1 | tee "$OUT/ncu-nf4-stream.log" | grep -v "^==PROF==" | grep -v "^ *$" \
      | grep -E "table_kernel|Duration|Memory Throughput|DRAM Throughput|Registers|Achieved Occ|Stall|Issued Warp|Eligible|Warp Cycles" | head -40
    [ "${AFTER:-1}" = 1 ] && timeout 240 python3 -m bench.nf4_cuda --shape gemma3-4b --rows 1 8 --out "$OUT" 2>&1 \
      | tee "$OUT/nf4-cuda-stream.log" | grep -v disagrees
    out=$(cd "$OUT" && pwd)
    for dir in ${BEFORE:-}; do
      name=$(basename "$dir" | tr -d .)
      (cd "$dir" && TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/ext}-$name" timeout 280 python3 -m bench.nf4_cuda \
        --shape gemma3-4b --rows 1 8 --out "$out/before-$name" 2>&1 | tee "$out/nf4-cuda-stream-before-$name.log" \
        | grep -v disagrees)
    done ;;
  nf4-stage)  # the tiles' two-group ring stages and the experts' pairs grouped by expert: the
    # extensions of this tree and of BEFORE (an earlier tree) built side by side, the NF4 GPU tests,
    # the 26B-A4B experts' two stages at 1 and 8 tokens on both trees, then every launch at 1 and 8
    # rows on this tree (BEFORE's in nf4-stage-throughput), into after/ and before/
    stage_build
    stage_tests cuda-tests-nf4-stage "cuda_one_row or plans or experts_match or experts_plan or greedy_tokens" 200
    for side in after before; do stage_experts $side; done
    stage_launches after ;;
  nf4-stage-throughput)  # BEFORE's launches at 1 and 8 rows, then 4-bit decode of the 26B-A4B shape,
    # this tree then BEFORE, same machine
    stage_launches before
    for side in after before; do stage_decode gemma4-26b-a4b $side; done ;;
  nf4-stage-check)  # after a change to the tiles: the extensions built side by side, the tiles' GPU
    # tests, this tree's launches at 1 and 8 rows and experts' stages at 1 and 8 tokens, then 4-bit
    # decode of the 26B-A4B shape on this tree and, where the run has time left for it
    # (STAGE_BUDGET seconds in all), BEFORE, same machine
    stage_build
    stage_tests cuda-tests-nf4-stage-check "cuda_one_row or experts_match" 90
    stage_launches after
    stage_experts after
    stage_decode gemma4-26b-a4b after
    if [ $SECONDS -gt $(( ${STAGE_BUDGET:-1000} - 180 )) ]; then echo "no time left for BEFORE"
    else stage_decode gemma4-26b-a4b before; fi ;;
  attn-wide)  # decode attention with heads of 512 (Gemma 4's exact layers) and the 26B-A4B step: STEPS
    # of tests (the attention kernels against the reference on their default launches, with and
    # without the store; the Gemma 4 engine's greedy tokens on NF4 against bitsandbytes), decode
    # (4-bit decode of the 26B-A4B shape at N=1 and 8, stage_decode's default, this tree then
    # BEFORE, same machine)
    for step in ${STEPS:-tests decode}; do
      case $step in
        tests)
          timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/equivalence/test_cuda.py \
            -k "decode_attention and paged-wide" 2>&1 | tee "$OUT/cuda-tests-attn-wide.log" | tail -2
          stage_tests cuda-tests-gemma4-nf4 "greedy_tokens and gemma4" 200 ;;
        decode)
          for side in after before; do stage_decode gemma4-26b-a4b $side; done ;;
      esac
    done ;;
  fused-ends)  # the MLP's activation computed by its NF4 gate/up product's kernels, and the experts'
    # (token, expert) partials added by the layer's end kernel: STEPS of tests (both trees' extensions
    # built, the NF4 kernels' GPU tests that take them and the plans' test, the Gemma 4 kernels
    # against their references, the engines' greedy tokens on NF4 against bitsandbytes), moe (4-bit
    # decode of the 26B-A4B shape at DECODE_N, default 8), dense (4-bit Gemma-3 4B at N=1), each this
    # tree then BEFORE, same machine
    for step in ${STEPS:-tests moe dense}; do
      case $step in
        tests)
          stage_build
          timeout 300 python3 -m pytest -q -p no:cacheprovider -n 4 -rP -m gpu tests/equivalence/test_cuda_nf4.py \
            tests/equivalence/test_cuda.py \
            -k "activation or plans_choose or experts_match or greedy_tokens or gemma4_kernels_match" \
            2>&1 | tee "$OUT/cuda-tests-fused-ends.log" | grep -v "^\.$" \
            | grep -E "passed|failed|Error|error|nf4 cuda|nf4 experts|greedy|bfloat16:|float32:" | tail -20 ;;
        moe)
          for side in after before; do DECODE_N=${DECODE_N:-8} stage_decode gemma4-26b-a4b $side; done ;;
        dense)
          for side in after before; do DECODE_N=1 stage_decode gemma3-4b $side; done ;;
      esac
    done ;;
  nf4-block)  # the block tiles (1-64 rows of x): STEPS of tests (the extension built, the block
    # tiles' and the plans' GPU tests), launches (every launch at 16 and 64 rows of x against the
    # Triton plan's), decode (4-bit Gemma-3 4B at DECODE_N, default 16 and 64, this tree then BEFORE)
    for step in ${STEPS:-tests launches decode}; do
      case $step in
        tests)
          python3 -c "from engine.kernels import nf4_cuda; print('CUDA NF4 kernel built:', nf4_cuda.extension() is not None)"
          stage_tests cuda-tests-nf4-block "block_tiles or plans" 240 ;;
        launches)
          timeout 300 python3 -m bench.nf4_cuda --shape gemma3-4b --rows ${ROWS:-16 64} --out "$OUT" 2>&1 \
            | tee "$OUT/nf4-cuda-block.log" | grep -v disagrees | head -60 ;;
        decode)
          for side in after before; do DECODE_N=${DECODE_N:-16 64} stage_decode gemma3-4b $side; done ;;
      esac
    done ;;
  nf4-block-profile)  # Nsight Compute on the block tiles against Gemma-3 4B's gate/up: 8 warps unsplit
    # (80 blocks) at 16 and 64 rows of x, and 4 warps at 64 rows; stall reasons per issued instruction,
    # pipe utilisation, shared-memory wavefronts and bank conflicts
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for rows in ${ROWS:-16 64}; do
      timeout 200 "$NCU" --clock-control none -k regex:'nf4_block_tiles' -s 2 -c 2 --section SpeedOfLight \
        --section Occupancy --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        --metrics regex:'smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio',regex:'sm__inst_executed_pipe_(alu|fma|lsu|uniform|tensor).*\.avg\.pct_of_peak_sustained_active',regex:'sm__pipe_(alu|fma|shared|tensor).*cycles_active\.avg\.pct_of_peak_sustained_active',l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__inst_executed.sum \
        python3 -m bench.nf4_cuda --profile 32,8,1,1 32,4,1,1 --x-rows $rows --reps 2 2>&1 \
        | tee "$OUT/ncu-nf4-block-$rows.log" | grep -v "^==PROF==" | grep -v "^ *$" | tail -120
    done ;;
  nf4-stage-4b)  # Gemma-3 4B in 4 bits, this tree then BEFORE, same machine
    for side in after before; do stage_decode gemma3-4b $side; done ;;
  nf4-figures)  # the 4-bit figures the GPU issue's targets name: decode of Gemma-3 4B (N=1, 8, 64)
    # and of the 26B-A4B shape (N=1, 8), and Gemma-3 4B in 4 bits through the server at 8 and 64
    # streams against the engine alone (the engine and the server each build and quantize the
    # model: about 400 s on an H100); STEPS: which of 4b, 26b, served, in that order
    nf4_decode() {
      timeout "$3" python3 -m bench.throughput --shape "$1" --dtype bfloat16 --weights bnb-4bit --layers fused \
        --policies s5 --n $2 --no-quality --out "$OUT" --tag nf4-figures 2>&1 \
        | tee "$OUT/throughput-$1-nf4-figures.log" | tail -5
    }
    nf4_served() {
      timeout "${SERVE_TIMEOUT:-400}" python3 -m bench.serve --shape gemma3-4b ${TOKENIZER:+--tokenizer "$TOKENIZER"} --device cuda \
        --dtype bfloat16 --quantization bnb-4bit --n 8 64 --new-tokens 512 --client-procs 8 --out "$OUT" \
        --tag served-bnb4 2>&1 | tee "$OUT/serve-gemma3-4b-served-bnb4.log" | grep -v "^INFO" | tail -24
    }
    for step in ${STEPS:-4b 26b served}; do
      case $step in
        4b) nf4_decode gemma3-4b "1 8 64" 150 ;;
        26b) nf4_decode gemma4-26b-a4b "1 8" 200 ;;
        served) nf4_served ;;
      esac
    done ;;
  nf4-cuda-throughput)  # the one-row CUDA kernel's GPU tests and the NF4 plans', then 4-bit decode at
    # N=1 with it in the plans and without it (CUDA_HOME pointing nowhere: the build fails, the
    # Triton kernels serve), same run
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rP -m gpu tests/equivalence/test_cuda_nf4.py \
      -k "cuda_one_row or plans" 2>&1 | tee "$OUT/cuda-tests-nf4-cuda.log" | grep -v "^\.$" | tail -12
    timeout 200 python3 -m bench.throughput --shape gemma3-4b --dtype bfloat16 --weights bnb-4bit --layers fused \
      --policies s5 --n 1 --no-quality --out "$OUT" --tag nf4-cuda 2>&1 | tail -12
    CUDA_HOME=/nonexistent timeout 200 python3 -m bench.throughput --shape gemma3-4b --dtype bfloat16 \
      --weights bnb-4bit --layers fused --policies s5 --n 1 --no-quality --out "$OUT" --tag nf4-triton 2>&1 | tail -12 ;;
  nf4-cuda-pdl)  # the one-row CUDA kernel's GPU tests (PDL launches included), then 4-bit decode at N=1
    timeout 100 python3 -m pytest -q -p no:cacheprovider -rP -m gpu tests/equivalence/test_cuda_nf4.py \
      -k "cuda_one_row" 2>&1 | tee "$OUT/cuda-tests-nf4-cuda-pdl.log" | grep -v "^\.$" | tail -8
    timeout 150 python3 -m bench.throughput --shape gemma3-4b --dtype bfloat16 --weights bnb-4bit --layers fused \
      --policies s5 --n 1 --no-quality --out "$OUT" --tag nf4-cuda-pdl 2>&1 | tail -6 ;;
  nf4-mma-profile)  # Nsight Compute on Gemma-3 4B's gate/up at one row: the one-row kernel and the mma
    # kernel, stall reasons per issued instruction and pipe utilisation, side by side
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    timeout 240 "$NCU" --clock-control none -k regex:'_nf4_(gemv|mma)_kernel' -s 6 -c 2 --section SpeedOfLight \
      --section Occupancy --section SchedulerStats --section LaunchStats \
      --metrics regex:'smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio',regex:'sm__inst_executed_pipe_(alu|fma|fmaheavy|lsu|uniform|tensor).*\.avg\.pct_of_peak_sustained_active',regex:'sm__pipe_(alu|fma|shared|tensor).*cycles_active\.avg\.pct_of_peak_sustained_active' \
      python3 -c "
import torch; from engine.kernels import nf4
w = nf4.NF4Weight(torch.randint(0, 256, (20480, 1280), dtype=torch.uint8, device='cuda'),
                  torch.rand(20480, 40, device='cuda'), torch.linspace(-1, 1, 16, device='cuda'), torch.bfloat16)
x = torch.randn(1, 2560, device='cuda').to(torch.bfloat16)
for _ in range(4):
    nf4.nf4_matmul(x, w, 1, 32, 256, 1, warps=4, stages=3, shfl=True)
    nf4.nf4_matmul(x, w, 8, 64, 256, 1, warps=4, stages=3, mma=1)
torch.cuda.synchronize()" 2>&1 | tee "$OUT/ncu-nf4-mma.log" | grep -v "^==PROF==" | grep -v "^ *$" | tail -150 ;;
  nf4-mma-throughput)  # the mma kernel's and the NF4 plans' GPU tests, the engine's greedy tokens on NF4
    # kernels against bitsandbytes, then 4-bit decode on plans that include the mma launches:
    # Gemma-3 4B at 1 and 8 rows and the MoE shape at 1 and 8
    timeout 200 python3 -m pytest -q -p no:cacheprovider -n 4 -rP -m gpu tests/equivalence/test_cuda_nf4.py \
      -k "mma or kernels_match or plans or greedy_tokens" 2>&1 | tee "$OUT/cuda-tests-nf4-mma.log" \
      | grep -v "^\.$" | tail -16
    timeout 150 python3 -m bench.throughput --shape gemma3-4b --dtype bfloat16 --weights bnb-4bit --layers fused \
      --policies s5 --n 1 8 --no-quality --out "$OUT" --tag nf4-mma 2>&1 | tee "$OUT/throughput-nf4-mma.log" | tail -6
    timeout 220 python3 -m bench.throughput --shape gemma4-26b-a4b --dtype bfloat16 --weights bnb-4bit --n 1 8 \
      --policies s5 --no-quality --out "$OUT" --tag nf4-mma 2>&1 | tee "$OUT/throughput-moe-nf4-mma.log" | tail -6 ;;
  nf4-sweep)  # the NF4 products' planned launches against a wider grid, then Nsight Compute's view of
    # the one-row kernel on Gemma-3 4B's gate/up at its planned launch (pipes, stalls, occupancy)
    timeout 330 python3 -m bench.nf4_kernels --shape gemma3-4b --n 1 8 --sweep --out "$OUT" 2>&1 \
      | tee "$OUT/nf4-kernels-sweep.log" | grep -v "^ \{9\}"
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    timeout 150 "$NCU" --clock-control none -k regex:_nf4_gemv_kernel -s 3 -c 1 --section SpeedOfLight \
      --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis --section SchedulerStats \
      --section MemoryWorkloadAnalysis python3 -c "
import torch; from engine.kernels import nf4
w = nf4.NF4Weight(torch.randint(0, 256, (20480, 1280), dtype=torch.uint8, device='cuda'),
                  torch.rand(20480, 40, device='cuda'), torch.linspace(-1, 1, 16, device='cuda'), torch.bfloat16)
x = torch.randn(1, 2560, device='cuda').to(torch.bfloat16)
for _ in range(5):
    nf4.nf4_matmul(x, w, 1, 32, 256, 1, warps=4, stages=3, shfl=True)
torch.cuda.synchronize()" 2>&1 | tee "$OUT/ncu-nf4-gemv.log" | grep -v "^==PROF==" | tail -120 ;;
  capacity)
    python3 -m bench.capacity --shape gemma3-4b --budget-gb "${BUDGET_GB:-4}" --context 1238 8192 --out "$OUT" ;;
  attn-ring)  # the ring layers' decode attention at many rows: Nsight Compute on Gemma-3 4B's ring
    # attention at 64 rows (its current launch), the current launch of this tree and BEFORE's (a
    # directory holding an earlier tree) alternating, twice, at 64 and 256 rows of 4B and 1B, then a
    # wider grid of launches at 64 and 256 rows of 4B; first the GPU tests named by AB_TESTS (a pytest -k
    # expression over test_cuda.py; TESTS=0 skips them)
    attention_tests attn-ring 240
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ -n "$NCU" ] && timeout 150 "$NCU" --clock-control none -k regex:_partial_kernel -s 3 -c 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats python3 -c "
import torch
from bench.throughput import SHAPES
from bench.tune_kernels import attention_cases
for _, _, current, _, make in attention_cases(SHAPES['gemma3-4b'], 64, 16, 4, 64, torch.bfloat16, 'cuda', False,
                                              layouts=('ring',)):
    for call in make(current)[:5]:
        call()
torch.cuda.synchronize()" 2>&1 | tee "$OUT/ncu-attn-ring.log" | grep -v "^==PROF==" | grep -v "^ *$" | tail -90
    out=$(cd "$OUT" && pwd)
    for i in 1 2; do
      for side in after before; do
        dir=.; [ $side = before ] && dir="$BEFORE"
        (cd "$dir" && timeout 100 python3 -m bench.tune_kernels --shape gemma3-4b gemma3-1b --n 64 256 --rows \
          --layouts ring --no-sweep --out "$out/$side" --tag attn-ring-$side-$i 2>&1 | grep -E "^ring" | sed "s/^/$side: /")
      done
    done
    timeout 240 python3 -m bench.tune_kernels --shape gemma3-4b --n 64 256 --rows --layouts ring --attn-wide \
      --out "$OUT" --tag attn-ring-sweep 2>&1 | tee "$OUT/tune-kernels-attn-ring-sweep.log" | tail -4 ;;
  step-n64)  # the 4B step at 64 rows, graph replay: this tree, BEFORE's, and this tree with every kernel
    # launched with PDL (launch.MAX_ACTIVATIONS raised), alternating, twice
    for i in 1 2; do
      for side in after before after-pdl; do
        dir=.; [ $side = before ] && dir="$BEFORE"
        limit=16384; [ $side = after-pdl ] && limit=1073741824
        echo "== $side, launch.MAX_ACTIVATIONS=$limit"
        (cd "$dir" && timeout 150 python3 -c "
import runpy, sys
from engine.kernels import launch
launch.MAX_ACTIVATIONS = int(sys.argv[1])
sys.argv = ['bench.profile_decode'] + sys.argv[2:]
runpy.run_module('bench.profile_decode', run_name='__main__')" $limit --shape gemma3-4b --n 64 2>&1 \
          | tee "$OUT/profile-decode-$side-$i.log" | grep -A6 "^N=")
      done
    done ;;
  step-ab)  # an engine change against an earlier tree, by the step's graph replay: the GPU tests named by
    # AB_TESTS (a pytest -k expression over test_cuda.py; TESTS=0 skips them), then `bench.profile_decode`
    # of this tree and BEFORE's (a directory holding an earlier tree) alternating, for each "shape:N" of
    # STEPS_AB (default 1B and 4B at one row, 4B at 64); files tagged AB_TAG (default step-ab)
    tag=${AB_TAG:-step-ab}
    attention_tests "$tag" 300
    for case in ${STEPS_AB:-gemma3-1b:1 gemma3-4b:1 gemma3-4b:64}; do
      for side in after before; do
        dir=.; [ $side = before ] && dir="$BEFORE"
        echo "== $side ${case%%:*} N=${case##*:}"
        (cd "$dir" && timeout 120 python3 -m bench.profile_decode --shape ${case%%:*} --n ${case##*:} 2>&1 \
          | tee "$OUT/profile-decode-$tag-${case%%:*}-${case##*:}-$side.log" | grep -A8 "^N=")
      done
    done ;;
  tune)  # the decode kernels' launch settings (decode_attention.launch_for, small_linear.GEMV_CANDIDATES)
    python3 -m bench.tune_kernels --out "$OUT" 2>&1 | tee "$OUT/tune-kernels.log" ;;
  overlap)  # steps launched ahead of the host against steps applied in order, same run
    run_tests
    python3 -m bench.throughput --shape gemma3-4b --dtype bfloat16 --n 1 64 --overlap on off --out "$OUT" --tag overlap ;;
  pdl)  # kernels launched with programmatic dependent launch against plain launches, same run
    python3 -c "import torch; from engine.kernels import launch; print('pdl supported:', launch.supported(torch.device('cuda')))"
    run_tests
    python3 -m bench.throughput --shape gemma3-4b --dtype bfloat16 --n 1 8 --pdl on off --out "$OUT" --tag pdl
    python3 -m bench.throughput --shape gemma3-4b --dtype bfloat16 --n 64 --out "$OUT" --tag pdl-n64 ;;
  pdl-1b)
    python3 -m bench.throughput --shape gemma3-1b --dtype bfloat16 --n 1 64 --pdl on off --out "$OUT" --tag pdl
    python3 -m bench.profile_decode --shape gemma3-4b --n 1 64 2>&1 | grep -A24 "^N=" ;;
  overlap-1b)
    python3 -m bench.throughput --shape gemma3-1b --dtype bfloat16 --n 1 64 --overlap on off --out "$OUT" --tag overlap
    python3 -m bench.profile_decode --shape gemma3-4b --n 1 64 2>&1 | grep -A24 "^N=" ;;
  moe)  # the Gemma 4 kernels and forward against their references, then the MoE shape, fused and stock
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/equivalence/test_cuda.py -k "gemma4" -s 2>&1 \
      | tee "$OUT/cuda-tests-gemma4.log" | grep -v "^\.$"
    python3 -m bench.tune_kernels --shape gemma4-26b-a4b --experts 1 8 --out "$OUT" --tag moe 2>&1 | tee "$OUT/tune-moe.log"
    python3 -m bench.throughput --shape gemma4-26b-a4b --dtype bfloat16 --n 1 8 --layers fused stock --out "$OUT" ;;
  serve|serve-4b)  # through the HTTP front end (bench/serve.py) against the engine alone, same run;
    # TOKENIZER (a directory with the embedded model's tokenizer.json) makes the server detokenize;
    # 8 client processes: at 256 streams 4 of them, not the server's front ends, set the pace
    [ "$2" = serve ] && run_tests
    shape=gemma3-1b; [ "$2" = serve-4b ] && shape=gemma3-4b
    python3 -m bench.serve --shape $shape ${TOKENIZER:+--tokenizer "$TOKENIZER"} --device cuda --dtype bfloat16 \
      --n ${SERVE_N:-64 256} --new-tokens 512 --client-procs 8 --out "$OUT" --tag served ;;
  stall)  # the scheduler's decode stall bound: through the server at the default (1 s on CUDA),
    # then the engine alone with the bound off and on and a larger step budget, same run
    timeout 290 python3 -m bench.serve --shape ${SHAPE:-gemma3-1b} ${TOKENIZER:+--tokenizer "$TOKENIZER"} \
      --device cuda --dtype bfloat16 --n ${SERVE_N:-64 256} --new-tokens 512 --client-procs 4 \
      ${STALL:+--max-decode-stall-ms $STALL} --out "$OUT" --tag served-stall-${STALL:-auto}
    timeout 250 python3 -m bench.throughput --shape ${SHAPE:-gemma3-1b} --dtype bfloat16 --policies s5 \
      --n ${ENGINE_N:-64 256} --new-tokens 128 --max-decode-stall-ms 0 1000 --max-batched-tokens 2048 8192 \
      --no-quality --out "$OUT" --tag stall ;;
  cluster)  # s5serve serve, then s5serve cluster with 1 and 2 replicas sharing this GPU (Ray Serve)
    python3 -m bench.serve --shape ${SHAPE:-gemma3-1b} ${TOKENIZER:+--tokenizer "$TOKENIZER"} --device cuda \
      --dtype bfloat16 --n ${SERVE_N:-1 64} --new-tokens ${NEW_TOKENS:-256} --client-procs 4 \
      --targets serve cluster:1 cluster:2 --out "$OUT" --tag cluster ;;
  targets)  # the decode targets of docs/performance.md, each row against the floor and HF in its run:
    # TARGETS=bf16 (default) Gemma-3 4B at N=1 and 64, 1B at 1 and 256; TARGETS=4bit
    # Gemma-3 4B in bnb-4bit at 1 and 64, then the 26B-A4B shape at 1 and 8
    out=$(cd "$OUT" && pwd)
    decode() {  # SHAPE WEIGHTS (float32: the bf16 weights themselves) N...
      local shape=$1 weights=$2; shift 2
      timeout 290 python3 -m bench.throughput --shape "$shape" --dtype bfloat16 --weights "$weights" --layers fused \
        --policies s5 --n "$@" --no-quality --out "$out" --tag "targets-${TARGETS:-bf16}" 2>&1 \
        | tee "$out/throughput-$shape-targets-${TARGETS:-bf16}.log" | grep -E "^ +[0-9]+ |wrote|Error"
    }
    if [ "${TARGETS:-bf16}" = bf16 ]; then
      decode gemma3-4b float32 1 64; decode gemma3-1b float32 1 256
    else
      decode gemma3-4b bnb-4bit 1 64; decode gemma4-26b-a4b bnb-4bit 1 8
    fi ;;
  gemv-ab)  # an engine change against an earlier tree: GPU tests (AB_TESTS, a pytest -k expression over
    # test_cuda.py; default the few-row products' and the fused forward's; TESTS=0 skips them), then
    # bf16 decode at N=1 and 8 (AB_N) of SHAPES (default: gemma3-1b gemma3-4b), this tree and BEFORE (a
    # directory holding an earlier tree) alternating on one machine, this tree first (AB_ORDER="before
    # after": the other way round); result files tagged AB_TAG-after and AB_TAG-before (default gemv)
    tag=${AB_TAG:-gemv}
    if [ "${TESTS:-1}" != 0 ]; then
      timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 -rP -m gpu tests/equivalence/test_cuda.py \
        -k "${AB_TESTS:-gemv or mma_rows or fused_forward or pdl_launches}" 2>&1 | tee "$OUT/cuda-tests-$tag-ab.log" \
        | grep -E "passed|failed|Error|tokens equal|gemv plan|mma_rows" | tail -20
    fi
    out=$(cd "$OUT" && pwd)
    for shape in ${SHAPES:-gemma3-1b gemma3-4b}; do
      for side in ${AB_ORDER:-after before}; do
        dir=.; [ $side = before ] && dir="$BEFORE"
        (cd "$dir" && timeout 170 python3 -m bench.throughput --shape $shape --dtype bfloat16 --policies s5 \
          --n ${AB_N:-1 8} --no-quality --out "$out/$side" --tag $tag-$side 2>&1 \
          | tee "$out/throughput-$shape-$tag-$side.log" | grep -E "^ +[0-9]+ bfloat16|wrote")
      done
    done ;;
  regress)  # this tree against BEFORE (a directory holding an earlier tree), the engine alone, same run
    run_tests
    for shape in gemma3-1b gemma3-4b; do
      for side in before after; do
        dir=.; [ $side = before ] && dir="$BEFORE"
        (cd "$dir" && python3 -m bench.throughput --shape $shape --dtype bfloat16 --policies s5 --n 1 64 \
          --no-quality --out "$OUT/$side" --tag $side)
      done
      python3 -m bench.compare_runs --before "$OUT"/before/throughput-cuda-$shape-*.json \
        --after "$OUT"/after/throughput-cuda-$shape-*.json --out "$OUT"
    done ;;
  full)
    run_tests
    python3 -m bench.throughput --shape gemma3-1b --dtype bfloat16 --n 1 8 64 256 --hf-static --out "$OUT"
    python3 -m bench.throughput --shape gemma3-4b --dtype bfloat16 --n 1 8 64 --hf-static --out "$OUT"
    python3 -m bench.profile_decode --shape gemma3-4b --n 1 64 2>&1 | grep -A24 "^N=" ;;
  *)
    run_tests
    python3 -m bench.throughput --shape gemma3-4b --dtype bfloat16 --weights float32 bnb-4bit \
      --float32-policies s5 native --n 1 64 --out "$OUT" ;;
esac
