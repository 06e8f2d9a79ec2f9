// The one-row NF4 product (x one bf16 row, a decode step of one token) in CUDA C++, beside the
// Triton kernels of kernels/nf4.py. kernels/nf4_cuda.py builds it with torch's extension loader
// where a CUDA compiler is installed, and the NF4 plans (kernels/nf4_plan.py) time its launches
// against the Triton ones on the model's weights and keep the fastest.
//
// Weight: packed bytes [N, K/2] (byte b of a row holds elements 2b in its high nibble and
// 2b + 1 in its low one), absmax [N, K/64] float32, code table [16] float32. Each warp owns ROWS
// weight rows and walks K in chunks of 32 elements (16 bytes), one chunk per lane per step: one
// 16-byte load of each row's bytes, x's 32 elements read once for all ROWS rows. A code is looked
// up by warp shuffle: lane l holds code[l % 16], so a nibble in the low 4 bits of the shuffle's
// lane index names its code with no masking (the bit above it lands on the table's copy in lanes
// 16-31). Each chunk's products are summed in float32, then scaled by its group's absmax once.
// K split over gridDim.y writes float32 partials that `sum_splits_kernel` adds in a fixed order.
#include <cuda_bf16.h>
#include <stdint.h>
#ifndef NF4_KERNELS_ONLY  // the launcher, for torch's extension loader
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/types.h>
#endif

namespace {

// Launched with PDL (programmatic dependent launch), a kernel may start while the one before it
// in the stream still runs: it waits here for that kernel's writes before touching memory a kernel
// of the step writes, and lets the next kernel be scheduled. Without PDL both are no-ops.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float lo_bf16(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_bf16(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// One step of a warp: each lane's 16-byte chunk of x (32 values) and of each of ROWS weight rows,
// and the absmax of that chunk's group per row.
template <int ROWS>
struct Step {
  uint4 x[4];
  uint4 w[ROWS];
  float s[ROWS];
};

// MODE 0: the product. To place the time, two variants that leave one stage out (their output
// is not the product): 1, the loads alone (each word's bits summed, no lookup); 2, the lookups
// and products alone (the weight words made up from the chunk index, no weight load).

// Chunk c of rows row0 .. row0 + ROWS - 1 (rows past the last repeat it and are not stored); a
// lane past the slice [c_lo, c_hi) reads chunk c_lo and scales it by zero.
template <int ROWS, int MODE>
__device__ __forceinline__ void load_step(Step<ROWS>& st, const __nv_bfloat16* __restrict__ x,
                                          const uint8_t* __restrict__ packed, const float* __restrict__ absmax,
                                          int row0, int n, int c, int c_lo, int c_hi, int stride_p, int stride_s) {
  const bool ok = c < c_hi;
  const int cc = ok ? c : c_lo;
  const uint4* xp = reinterpret_cast<const uint4*>(x) + (size_t)cc * 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) st.x[i] = __ldg(xp + i);
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int row = min(row0 + r, n - 1);
    if (MODE == 2) {
      const uint32_t m = (uint32_t)cc * 0x9e3779b9u + (uint32_t)row * 0x85ebca6bu;
      st.w[r] = make_uint4(m, m ^ 0x5bd1e995u, m * 3u, m + 0x27d4eb2fu);
    } else {
      st.w[r] = __ldg(reinterpret_cast<const uint4*>(packed + (size_t)row * stride_p) + cc);
    }
    st.s[r] = ok ? __ldg(absmax + (size_t)row * stride_s + (cc >> 1)) : 0.f;
  }
}

// acc[r] += (row r's chunk . x's chunk) x the group's absmax: the codes by warp shuffle from
// `table` (this lane's code[lane % 16]), the chunk's products summed in float32 first.
template <int ROWS, int MODE>
__device__ __forceinline__ void add_products(const Step<ROWS>& st, float table, float (&acc)[ROWS]) {
  float xe[16], xo[16];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t w4[4] = {st.x[i].x, st.x[i].y, st.x[i].z, st.x[i].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      xe[4 * i + j] = lo_bf16(w4[j]);
      xo[4 * i + j] = hi_bf16(w4[j]);
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const uint32_t q[4] = {st.w[r].x, st.w[r].y, st.w[r].z, st.w[r].w};
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (MODE == 1) {
        sum += __uint_as_float(q[i] & 0x3fffffffu) * xe[4 * i];
        continue;
      }
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const float hi = __shfl_sync(0xffffffffu, table, (int)(q[i] >> (8 * b + 4)));
        const float lo = __shfl_sync(0xffffffffu, table, (int)(q[i] >> (8 * b)));
        sum = fmaf(hi, xe[4 * i + b], sum);
        sum = fmaf(lo, xo[4 * i + b], sum);
      }
    }
    acc[r] = fmaf(sum, st.s[r], acc[r]);
  }
}

// Each row's sum over the warp's lanes, stored by lane 0 (float32 partials of this K slice when
// K is split), and acc cleared.
template <int ROWS>
__device__ __forceinline__ void store_rows(float (&acc)[ROWS], int row0, int n, int lane,
                                           float* __restrict__ partial, __nv_bfloat16* __restrict__ y) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float v = acc[r];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    const int row = row0 + r;
    if (lane == 0 && row < n) {
      if (gridDim.y > 1) partial[(size_t)blockIdx.y * n + row] = v;
      else y[row] = __float2bfloat16(v);
    }
    acc[r] = 0.f;
  }
}

// One warp per row group: warp i takes rows i ROWS .. i ROWS + ROWS - 1 over its K slice.
template <int ROWS, int MODE>
__global__ void __launch_bounds__(256) nf4_gemv_kernel(
    const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ packed, const float* __restrict__ absmax,
    const float* __restrict__ code, float* __restrict__ partial, __nv_bfloat16* __restrict__ y,
    int n, int k, int stride_p, int stride_s, int chunks_per_split) {
  pdl_enter();
  const int lane = threadIdx.x & 31;
  const int row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * ROWS;
  if (row0 >= n) return;  // whole warps leave together: the shuffles below see full warps
  const float table = __ldg(code + (lane & 15));
  const int c_lo = blockIdx.y * chunks_per_split;
  const int c_hi = min(c_lo + chunks_per_split, k >> 5);
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
  for (int c0 = c_lo; c0 < c_hi; c0 += 32) {
    Step<ROWS> st;
    load_step<ROWS, MODE>(st, x, packed, absmax, row0, n, c0 + lane, c_lo, c_hi, stride_p, stride_s);
    add_products<ROWS, MODE>(st, table, acc);
  }
  store_rows<ROWS>(acc, row0, n, lane, partial, y);
}

// Persistent warps: warp i of the grid takes row groups i, i + warps in grid, ...; each walks its
// K slice 32 chunks at a time, and the next step's loads are issued before this step's lookups
// (two steps in registers).
template <int ROWS, int MODE>
__global__ void __launch_bounds__(256) nf4_gemv_persistent_kernel(
    const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ packed, const float* __restrict__ absmax,
    const float* __restrict__ code, float* __restrict__ partial, __nv_bfloat16* __restrict__ y,
    int n, int k, int stride_p, int stride_s, int chunks_per_split) {
  pdl_enter();
  const int lane = threadIdx.x & 31;
  const int warps = (gridDim.x * blockDim.x) >> 5;
  const int groups = (n + ROWS - 1) / ROWS;
  int g = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const float table = __ldg(code + (lane & 15));
  const int c_lo = blockIdx.y * chunks_per_split;
  const int c_hi = min(c_lo + chunks_per_split, k >> 5);
  // the same count for every warp (a warp past the last row group repeats it and stores nothing),
  // so the compiler sees the shuffles in converged code
  const int total = (groups + warps - 1) / warps * ((c_hi - c_lo + 31) / 32);
  Step<ROWS> cur, nxt;
  int c0 = c_lo;
  load_step<ROWS, MODE>(cur, x, packed, absmax, g * ROWS, n, c0 + lane, c_lo, c_hi, stride_p, stride_s);
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
  for (int it = 0; it < total; ++it) {
    int ng = g, nc0 = c0 + 32;
    const bool last_step = nc0 >= c_hi;
    if (last_step) {
      ng = g + warps;
      nc0 = c_lo;
    }
    const bool more = it + 1 < total;
    load_step<ROWS, MODE>(nxt, x, packed, absmax, (more ? ng : g) * ROWS, n, (more ? nc0 : c0) + lane, c_lo, c_hi,
                          stride_p, stride_s);
    add_products<ROWS, MODE>(cur, table, acc);
    if (last_step) store_rows<ROWS>(acc, g * ROWS, n, lane, partial, y);  // the row group's slice is done
    cur = nxt;
    g = ng;
    c0 = nc0;
  }
}

__global__ void sum_splits_kernel(const float* __restrict__ partial, __nv_bfloat16* __restrict__ y, int n,
                                  int split) {
  pdl_enter();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = 0.f;
  for (int s = 0; s < split; ++s) v += partial[(size_t)s * n + i];
  y[i] = __float2bfloat16(v);
}

#ifdef NF4_KERNELS_ONLY  // every product kernel a launch can pick, to read their machine code without torch
#define KERNEL_ARGS \
  const __nv_bfloat16*, const uint8_t*, const float*, const float*, float*, __nv_bfloat16*, int, int, int, int, int
template __global__ void nf4_gemv_kernel<1, 0>(KERNEL_ARGS);
template __global__ void nf4_gemv_kernel<2, 0>(KERNEL_ARGS);
template __global__ void nf4_gemv_kernel<4, 0>(KERNEL_ARGS);
template __global__ void nf4_gemv_kernel<8, 0>(KERNEL_ARGS);
template __global__ void nf4_gemv_persistent_kernel<1, 0>(KERNEL_ARGS);
template __global__ void nf4_gemv_persistent_kernel<2, 0>(KERNEL_ARGS);
template __global__ void nf4_gemv_persistent_kernel<4, 0>(KERNEL_ARGS);
#undef KERNEL_ARGS
#endif
}  // namespace

#ifndef NF4_KERNELS_ONLY
using Kernel = void (*)(const __nv_bfloat16*, const uint8_t*, const float*, const float*, float*, __nv_bfloat16*, int,
                        int, int, int, int);

template <int R>
Kernel pick(bool persistent, int64_t mode) {
  if (persistent) {
    if constexpr (R <= 4) {
      return mode == 1 ? nf4_gemv_persistent_kernel<R, 1>
                       : mode == 2 ? nf4_gemv_persistent_kernel<R, 2> : nf4_gemv_persistent_kernel<R, 0>;
    }
    TORCH_CHECK(false, "persistent warps take 1, 2 or 4 rows");
  }
  return mode == 1 ? nf4_gemv_kernel<R, 1> : mode == 2 ? nf4_gemv_kernel<R, 2> : nf4_gemv_kernel<R, 0>;
}

template <typename... Args>
void launch(void (*kernel)(Args...), dim3 grid, dim3 block, cudaStream_t stream, bool pdl, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // cleared, so that the next launch in the process does not report it
    TORCH_CHECK(false, "NF4 kernel launch failed: ", cudaGetErrorString(err));
  }
}

// x [K] bf16 contiguous, packed [N, K/2] uint8, absmax [N, K/64] float32, code [16] float32,
// y [N] bf16, partial [split, N] float32 (split > 1); K a multiple of 64, rows 16-byte aligned
// (checked by the caller). `blocks` > 0: persistent warps in that many blocks. `mode` 0: the
// product; 1 and 2 the measurement variants above. `pdl`: launched with PDL (compute capability
// 9.0 or newer; the caller checks).
void nf4_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor absmax, torch::Tensor code, torch::Tensor y,
              torch::Tensor partial, int64_t rows, int64_t warps, int64_t split, int64_t mode, int64_t blocks,
              bool pdl) {
  const int n = packed.size(0), k = x.size(-1);
  const int chunks = k / 32;
  const int per = (chunks + split - 1) / split;
  split = (chunks + per - 1) / per;  // every slice holds a chunk: each writes its partials
  const int row_warps = (n + rows - 1) / rows;
  dim3 grid((row_warps + warps - 1) / warps, split);
  if (blocks > 0) grid.x = std::min<int64_t>(blocks, grid.x);  // persistent warps in `blocks` blocks
  const c10::cuda::CUDAGuard guard(x.device());  // x's device and its current stream
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Kernel kernel = nullptr;
  switch (rows) {
    case 1: kernel = pick<1>(blocks > 0, mode); break;
    case 2: kernel = pick<2>(blocks > 0, mode); break;
    case 4: kernel = pick<4>(blocks > 0, mode); break;
    case 8: kernel = pick<8>(blocks > 0, mode); break;
    default: TORCH_CHECK(false, "rows must be 1, 2, 4 or 8");
  }
  float* part = split > 1 ? partial.data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<__nv_bfloat16*>(y.data_ptr());
  launch(kernel, grid, dim3(32 * warps), stream, pdl, reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()),
         static_cast<const uint8_t*>(packed.data_ptr<uint8_t>()), static_cast<const float*>(absmax.data_ptr<float>()),
         static_cast<const float*>(code.data_ptr<float>()), part, yp, n, k, static_cast<int>(packed.stride(0)),
         static_cast<int>(absmax.stride(0)), per);
  if (split > 1) {
    launch(sum_splits_kernel, dim3((n + 255) / 256), dim3(256), stream, pdl, static_cast<const float*>(part), yp, n,
           static_cast<int>(split));
  }
}
#endif
