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
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <set>
#include <utility>
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

// The packed weights are read once per product: loaded past L1 (L1::no_allocate), so that they do
// not evict x and the absmax, which every warp reads again.
__device__ __forceinline__ uint4 load_weights(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
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
// and products alone (the weight words made up from the chunk index, no weight load). The tiles
// take two more, the product itself with other ways of loading (3 and 4: copy_next below).

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
      st.w[r] = load_weights(reinterpret_cast<const uint4*>(packed + (size_t)row * stride_p) + cc);
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

// Tiles of 16 weight rows on tensor cores (a launch's `rows` 16): each warp takes one tile over one
// K slice at a time, as the A operand of mma.sync.m16n8k16 (bf16 in, float32 sums), with x's 1-8
// rows the B operand's eight columns (column j: x's row min(j, M - 1); the repeats are not
// stored). A weight byte is looked up whole, as its two codes (high nibble: the even column) in
// one bf16x2 word, from a table in shared memory that each block builds once: 256 entries, one
// copy per lane so that the 32 lanes read 32 banks, entry v's copy for lane l at v * 256 + l * 4
// from a 64 KiB boundary of the shared window, so that one byte permute of the packed word into
// the lane's address gives the address. The sum over K is the same whatever order the mma's 16 k
// slots take the columns in, so each group of 64 columns is laid on them as the loads suit: lane t
// of a row's four lanes (t = lane % 4) takes that row's 8 bytes 8t .. 8t + 7 (columns 16t .. 16t +
// 15) and the same 16 columns of x's rows, step s of the group's four products its bytes 2s (k
// slots 2t, 2t + 1) and 2s + 1 (slots 2t + 8, 2t + 9). Each group's product is then scaled by the
// group's absmax. The codes are rounded to bf16 in the table, as the kernels of kernels/nf4.py that
// multiply on tensor cores round them.
//
// The weights reach a warp through a ring of RING_STAGES stages in shared memory, filled by
// asynchronous copies (cp.async, past L1) that run RING_STAGES - 1 stages ahead of the products
// along the warp's whole sequence of work items, so that many loads are in flight with few
// registers. A stage holds two groups of the tile (its 16 rows' 64 bytes, then their 32 absmax,
// each row's two side by side); the products of a stage look up both groups' codes before the
// first mma, so that a warp has 32 lookups in flight. An item of an odd number of groups ends on
// a stage of one: its second group is not copied, and is multiplied as a repeat of the first
// group's x with an absmax of 0 (the ring's stale bytes look up finite codes). x is read at its
// product (from L1: the weights do not pass through it).
constexpr int TABLE_BYTES = 256 * 256;
constexpr int RING_STAGES = 6;
constexpr int STAGE_GROUPS = 2;
constexpr int STAGE_BYTES = STAGE_GROUPS * (16 * 32 + 16 * 4);
constexpr int STAGE_SCALES = STAGE_GROUPS * 16 * 32;  // the absmax's offset in a stage
constexpr int RING_BYTES = RING_STAGES * STAGE_BYTES;
constexpr int SCRATCH_BYTES = 8 * 1024;  // the experts' own shared memory (PairSlots)

// Where a block's shared memory holds what, as offsets from its base, given `pad` (the bytes from
// the base to the table, which starts at a 64 KiB boundary of the shared window): the scratch
// (`scratch` bytes) and then as many warps' rings as fit go before the table, the rest after it.
// `end`: the bytes the block uses. The launcher allocates the most `end` any pad needs
// (tile_smem); the kernel lays out its own pad the same way.
struct TileLayout {
  uint32_t scratch, rings_before, before, rings_after, end;
  __host__ __device__ constexpr uint32_t ring(uint32_t warp) const {
    return warp < before ? rings_before + warp * RING_BYTES : rings_after + (warp - before) * RING_BYTES;
  }
};

__host__ __device__ constexpr TileLayout tile_layout(uint32_t pad, uint32_t warps, uint32_t scratch) {
  const bool scratch_before = scratch <= pad;
  const uint32_t free_before = scratch_before ? pad - scratch : pad;
  const uint32_t before = free_before / RING_BYTES < warps ? free_before / RING_BYTES : warps;
  const uint32_t after = pad + TABLE_BYTES, rings_end = after + (warps - before) * RING_BYTES;
  return {scratch_before ? 0u : rings_end, scratch_before ? scratch : 0u, before, after,
          rings_end + (scratch_before ? 0u : scratch)};
}

// A block's shared memory for `warps` warps' tiles with `scratch` bytes of a Work's own: the most
// any alignment of the base needs
constexpr int tile_smem(int warps, int scratch = 0) {
  uint32_t most = 0;
  for (uint32_t pad = 0; pad < TABLE_BYTES; pad += 16) {
    const uint32_t end = tile_layout(pad, warps, scratch).end;
    most = end > most ? end : most;
  }
  return static_cast<int>(most);
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// gelu_tanh(g) x u of Gemma's MLP with the stock module's roundings (kernels/fused_ops.py's
// `_gelu_mul`): the two products' outputs and the activation rounded to bf16
__device__ __forceinline__ __nv_bfloat16 gelu_mul_bf16(float g, float u) {
  g = round_bf16(g);
  u = round_bf16(u);
  const float z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  const float a = round_bf16(0.5f * g * (1.f + (2.f / (1.f + expf(-2.f * z)) - 1.f)));
  return __float2bfloat16(a * u);
}

__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo in the low 16 bits
  return *reinterpret_cast<const uint32_t*>(&v);
}

// cp.async needs compute capability 8.0, as bf16 mma.sync does (nf4_cuda.fits keeps the tiles from
// older GPUs, for which the extension still builds the row kernels). PREFETCH: L2 fetches the 128
// bytes around the copy's 16 (the tiles' MODE 3).
template <bool PREFETCH = false>
__device__ __forceinline__ void copy_async16(uint32_t dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (PREFETCH) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  }
#else
  __trap();
#endif
}

__device__ __forceinline__ void copy_async4(uint32_t dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
#endif
}

__device__ __forceinline__ void commit_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// wait until at most N of this thread's committed copy groups are still in flight
template <int N>
__device__ __forceinline__ void wait_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// A warp's work item on the tiles, as one lane holds it: the bytes and the absmax it copies (tile
// row lane / 2, of the stage's group lane % 2: 32 bytes at group 0 of the item's K, and one
// absmax), its x row (the mma's column lane / 4, its 16 columns of group 0), and the item's groups
// [g_lo, g_hi) of K.
struct TileItem {
  const uint8_t* src;
  const float* scales;
  const uint4* xrow;
  int g_lo, g_hi;
  const uint8_t* tile_src;   // the tile's first row's bytes and absmax (MODE 5)
  const float* tile_scales;
};

// Lane l's item over the weight rows `row(r)` (r: the tile's row, 0-15) of a weight of `stride_p`
// bytes and `stride_s` absmax per row, against x row `xr`.
template <class Row>
__device__ __forceinline__ TileItem tile_item(const uint8_t* packed, const float* absmax, int stride_p, int stride_s,
                                              Row row, const __nv_bfloat16* xr, int g_lo, int g_hi) {
  const int lane = threadIdx.x & 31, r = row(lane >> 1), r0 = row(0);
  return {packed + (size_t)r * stride_p + 32 * (lane & 1), absmax + (size_t)r * stride_s + (lane & 1),
          reinterpret_cast<const uint4*>(xr) + 2 * (lane & 3), g_lo, g_hi,
          packed + (size_t)r0 * stride_p, absmax + (size_t)r0 * stride_s};
}

// One group of one tile as a lane multiplies it: its 8 bytes of each of its two rows (groupID,
// groupID + 8), their absmax, and its 16 columns of its x row as 8 bf16x2 words.
struct TileStep {
  uint2 a, b;
  float sa, sb;
  uint4 x0, x1;
};

// x is written by the kernel before this one: read with a plain load (not through the read-only
// cache: the pointer is not __restrict__), which the compiler keeps after the PDL wait's memory
// clobber
__device__ __forceinline__ uint4 load_x(const uint4* p) { return *p; }

// Byte j of `word` looked up in this lane's copy of the table (lane_addr: the table's shared address
// plus lane * 4; the permute puts the byte in bits 8-15).
__device__ __forceinline__ uint32_t pair_codes(uint32_t word, uint32_t lane_addr, uint32_t j) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(__byte_perm(word, lane_addr, 0x7604u | (j << 4))));
  return v;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

// A group's four mma A fragments per step: the codes of bytes 2s and 2s + 1 of each of the lane's
// two rows (MODE 1, time without the lookups: the packed words themselves)
template <int MODE>
__device__ __forceinline__ void group_codes(const TileStep& st, uint32_t lane_addr, uint32_t (&f)[4][4]) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t wa = s < 2 ? st.a.x : st.a.y, wb = s < 2 ? st.b.x : st.b.y;
    const uint32_t lo = (2 * s) & 3, hi = (2 * s + 1) & 3;
    if (MODE == 1) {
      f[s][0] = wa, f[s][1] = wb, f[s][2] = wa ^ wb, f[s][3] = wa + wb;
    } else {
      f[s][0] = pair_codes(wa, lane_addr, lo), f[s][1] = pair_codes(wb, lane_addr, lo);
      f[s][2] = pair_codes(wa, lane_addr, hi), f[s][3] = pair_codes(wb, lane_addr, hi);
    }
  }
}

// acc += a stage's two groups' products x their absmax: acc[0], acc[1] for the lane's first
// weight row against x rows 2t and 2t + 1 (the mma's columns), acc[2], acc[3] for its second. All
// 32 lookups are issued before the first mma; each group's four products go in two chains of two,
// so that the tensor cores take four at once.
template <int MODE>
__device__ __forceinline__ void stage_products(const TileStep (&st)[STAGE_GROUPS], uint32_t lane_addr,
                                               float (&acc)[4]) {
  uint32_t f[STAGE_GROUPS][4][4];
#pragma unroll
  for (int h = 0; h < STAGE_GROUPS; ++h) group_codes<MODE>(st[h], lane_addr, f[h]);
  float c[STAGE_GROUPS][2][4] = {};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
#pragma unroll
    for (int h = 0; h < STAGE_GROUPS; ++h) {
      const uint32_t xw[8] = {st[h].x0.x, st[h].x0.y, st[h].x0.z, st[h].x0.w,
                              st[h].x1.x, st[h].x1.y, st[h].x1.z, st[h].x1.w};
      mma_bf16(c[h][s & 1], f[h][s][0], f[h][s][1], f[h][s][2], f[h][s][3], xw[2 * s], xw[2 * s + 1]);
    }
  }
#pragma unroll
  for (int h = 0; h < STAGE_GROUPS; ++h) {
    acc[0] = fmaf(c[h][0][0] + c[h][1][0], st[h].sa, acc[0]);
    acc[1] = fmaf(c[h][0][1] + c[h][1][1], st[h].sa, acc[1]);
    acc[2] = fmaf(c[h][0][2] + c[h][1][2], st[h].sb, acc[2]);
    acc[3] = fmaf(c[h][0][3] + c[h][1][3], st[h].sb, acc[3]);
  }
}

// Where a warp's copies stand in its sequence of work items (item, item + warps in grid, ...): the
// lane's next bytes and absmax to copy, and the groups left in the item.
struct CopyCursor {
  int item, left;
  const uint8_t* src;
  const float* scales;

  // MODE 5: the item's stages read as if the weight were laid out tile by tile, each stage's 16
  // rows x 64 bytes and 32 absmax contiguous (the tile's rows' bytes in another order: a
  // measurement of such a layout's loads, not a product)
  template <int MODE, class Work>
  __device__ __forceinline__ void start(const Work& work, int items) {
    if (item < items) {
      const TileItem it = work.item(item);
      if (MODE == 5) {
        const int lane = threadIdx.x & 31;
        src = it.tile_src + (size_t)(it.g_lo / STAGE_GROUPS) * (16 * 32 * STAGE_GROUPS) + 32 * lane;
        scales = it.tile_scales + (it.g_lo / STAGE_GROUPS) * (16 * STAGE_GROUPS) + lane;
      } else {
        src = it.src + (size_t)it.g_lo * 32;
        scales = it.scales + it.g_lo;
      }
      left = it.g_hi - it.g_lo;
    }
  }
};

// Copies the cursor's next stage (its item's next two groups, or the last one) into the ring stage
// at `stage` (shared address), one copy group per call (empty past the warp's last item, so that
// the count of groups in flight stays fixed), and moves the cursor on: lane l copies tile row l / 2's
// 32 bytes and absmax of the stage's group l % 2 (so that each copy instruction reads half of every
// 32-byte sector it touches, its neighbour lane's the other half). MODE 2 (time without the weight
// loads) copies nothing; MODE 3 (the product) has L2 fetch each row's 128 bytes around its copies;
// MODE 4 (the product) has lane l copy the 16-byte half l % 2 of each of the stage's groups, so
// that each copy instruction reads whole sectors; MODE 5 (a measurement) copies each stage from one
// contiguous 1 KiB span and 128 bytes of absmax (CopyCursor::start).
template <int MODE, class Work>
__device__ __forceinline__ void copy_next(const Work& work, CopyCursor& cur, int items, int warps, uint32_t stage) {
  const int lane = threadIdx.x & 31;
  if (cur.item < items) {
    if (MODE == 5) {
      copy_async16(stage + 32 * lane, cur.src);
      copy_async16(stage + 32 * lane + 16, cur.src + 16);
      copy_async4(stage + STAGE_SCALES + 4 * lane, cur.scales);
      cur.src += 16 * 32 * STAGE_GROUPS - 32 * STAGE_GROUPS;  // with the step below: the next stage
      cur.scales += 16 * STAGE_GROUPS - STAGE_GROUPS;
    } else if (MODE == 4) {
      const uint8_t* src = cur.src - 16 * (lane & 1);  // the lane's half of the stage's first group
      const uint32_t dst = stage + 64 * (lane >> 1) + 16 * (lane & 1);
      copy_async16(dst, src);
      if (cur.left > 1) copy_async16(dst + 32, src + 32);
      if ((lane & 1) < cur.left) copy_async4(stage + STAGE_SCALES + 4 * lane, cur.scales);
    } else if (MODE != 2 && (lane & 1) < cur.left) {
      const uint32_t dst = stage + 32 * lane;
      copy_async16<MODE == 3>(dst, cur.src);
      copy_async16<MODE == 3>(dst + 16, cur.src + 16);
      copy_async4(stage + STAGE_SCALES + 4 * lane, cur.scales);
    }
    cur.src += 32 * STAGE_GROUPS;
    cur.scales += STAGE_GROUPS;
    cur.left -= STAGE_GROUPS;
    if (cur.left <= 0) {
      cur.item += warps;
      cur.start<MODE>(work, items);
    }
  }
  commit_copies();
}

// Persistent blocks, one per SM: the table is built before the PDL wait, and where the items' rows
// do not depend on what the kernel before writes (Work::kRowsBeforeWait) the first copies are
// issued before it too; warp w of block b takes work items w x blocks + b, then each one the grid's
// warps further, of `work` (`count`, `item(i)`: its TileItem, and `store(i, acc)`), so that fewer
// items than warps still spread over every block (every SM). After the PDL wait the block's
// threads call `work.prepare(scratch)` together (Work::kScratch bytes of shared memory) before the
// first item is read; a Work whose rows come before the wait has nothing to prepare.
// The block's code table (the tiles' comment above) at the first 64 KiB boundary of the shared
// window at or after `base` (the dynamic shared memory's address): thread v makes entry v (its two
// loads in flight together) and writes its 32 copies, copy (v + j) % 32 at step j, so that a
// warp's stores fall on 32 banks. Returns the table's shared address; the block's threads
// synchronize before reading it.
__device__ __forceinline__ uint32_t build_table(uint32_t* smem_words, uint32_t base, const float* __restrict__ code) {
  const uint32_t table_addr = (base + TABLE_BYTES - 1) & ~(uint32_t)(TABLE_BYTES - 1);
  uint32_t* table = smem_words + (table_addr - base) / 4;
  for (int v = threadIdx.x; v < 256; v += blockDim.x) {
    const uint32_t pair = bf16x2_bits(__ldg(code + (v >> 4)), __ldg(code + (v & 15)));  // the even column low
#pragma unroll 8
    for (int j = 0; j < 32; ++j) table[v * 64 + ((v + j) & 31)] = pair;
  }
  return table_addr;
}

template <int MODE, class Work>
__device__ __forceinline__ void run_tiles(const Work& params, const float* __restrict__ code) {
  extern __shared__ __align__(16) uint32_t smem_words[];
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem_words);
  const uint32_t table_addr = build_table(smem_words, base, code);
  const TileLayout layout = tile_layout(table_addr - base, blockDim.x >> 5, Work::kScratch);
  uint8_t* smem_bytes = reinterpret_cast<uint8_t*>(smem_words);
  Work work = params;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t lane_addr = table_addr | lane * 4u;
  const uint32_t ring = base + layout.ring(warp);  // shared address, for the copies
  const uint8_t* ring_bytes = smem_bytes + layout.ring(warp);
  int items = Work::kScratch ? 0 : work.count();
  const int warps = (gridDim.x * blockDim.x) >> 5;
  int item = warp * gridDim.x + blockIdx.x;
  CopyCursor cur{item, 0, nullptr, nullptr};
  auto fill_ring = [&] {  // the first RING_STAGES - 1 stages of the warp's items
    cur.start<MODE>(work, items);
#pragma unroll
    for (int s = 0; s < RING_STAGES - 1; ++s) copy_next<MODE>(work, cur, items, warps, ring + s * STAGE_BYTES);
  };
  static_assert(!(Work::kRowsBeforeWait && Work::kScratch), "rows read before the wait need no preparation");
  if (Work::kRowsBeforeWait) fill_ring();
  __syncthreads();  // the table
  pdl_enter();
  if (Work::kScratch) {
    work.prepare(smem_bytes + layout.scratch);
    items = work.count();
  }
  if (!Work::kRowsBeforeWait) fill_ring();
  // the stage multiplied next (byte offset in the ring), and the one filled next, the stage before it
  int read = 0, fill = (RING_STAGES - 1) * STAGE_BYTES;
  // the lane's bytes in a stage: its rows' (groupID, groupID + 8) 8 bytes 8t .. 8t + 7 of each group,
  // and their absmax (each row's two side by side)
  const int a_off = (lane >> 2) * 64 + 8 * (lane & 3), s_off = STAGE_SCALES + 8 * (lane >> 2);
  for (; item < items; item += warps) {
    const TileItem it = work.item(item);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const uint4* xp = it.xrow + 8 * it.g_lo;
    for (int g = it.g_lo; g < it.g_hi; g += STAGE_GROUPS, xp += 8 * STAGE_GROUPS) {
      wait_copies<RING_STAGES - 2>();  // this stage's copies, then every lane's (below)
      __syncwarp();
      const bool second = g + 1 < it.g_hi;  // the stage's second group is the item's
      TileStep st[STAGE_GROUPS];
      if (MODE == 2) {
        const uint32_t h = (uint32_t)g * 0x9e3779b9u ^ (uint32_t)(uintptr_t)xp;
        st[0].a = make_uint2(h, h * 3u);
        st[0].b = make_uint2(h ^ 0x5bd1e995u, h + 0x7f4a7c15u);
        st[1].a = make_uint2(h * 5u, h ^ 0x2545f491u);
        st[1].b = make_uint2(h + 0x6c8e9cf5u, h * 7u);
        st[0].sa = st[0].sb = 1.f;
        st[1].sa = st[1].sb = second ? 1.f : 0.f;
      } else {
        const uint8_t* stage = ring_bytes + read;
        st[0].a = *reinterpret_cast<const uint2*>(stage + a_off);
        st[0].b = *reinterpret_cast<const uint2*>(stage + a_off + 8 * 64);
        st[1].a = *reinterpret_cast<const uint2*>(stage + a_off + 32);
        st[1].b = *reinterpret_cast<const uint2*>(stage + a_off + 8 * 64 + 32);
        const float2 sa = *reinterpret_cast<const float2*>(stage + s_off);
        const float2 sb = *reinterpret_cast<const float2*>(stage + s_off + 8 * 8);
        st[0].sa = sa.x, st[0].sb = sb.x;
        st[1].sa = second ? sa.y : 0.f, st[1].sb = second ? sb.y : 0.f;
      }
      st[0].x0 = load_x(xp);
      st[0].x1 = load_x(xp + 1);
      const uint4* xq = second ? xp + 8 : xp;
      st[1].x0 = load_x(xq);
      st[1].x1 = load_x(xq + 1);
      // the stage before this one was read by every lane before the barrier above: refill it
      copy_next<MODE>(work, cur, items, warps, ring + fill);
      fill = read;
      read = read == RING_BYTES - STAGE_BYTES ? 0 : read + STAGE_BYTES;
      stage_products<MODE>(st, lane_addr, acc);
    }
    work.store(item, acc);
  }
  wait_copies<0>();  // no copy in flight when the block ends
}

// The operands of a dense product y [M, N] = x [M, K] @ W^T, K in slices of `groups_per_split`
// groups of 64 columns (float32 partials of each slice where there are several).
struct DenseOperands {
  const __nv_bfloat16* x;
  const uint8_t* packed;
  const float* absmax;
  float* partial;  // [splits, M, N] float32 where K is split
  __nv_bfloat16* y;
  int n, m, stride_x, stride_p, stride_s, groups, groups_per_split;
};

// The dense product on the tiles: item tile / splits takes rows 16 tile .. 16 tile + 15 (rows past
// N repeat its last) over K slice item % splits; lane l's x row is min(l / 4, M - 1) (the mma's
// column l / 4).
struct DenseTiles : DenseOperands {
  int splits;
  static constexpr bool kRowsBeforeWait = true;
  static constexpr int kScratch = 0;
  __device__ void prepare(uint8_t*) {}

  __device__ int count() const { return (n + 15) / 16 * splits; }
  __device__ TileItem item(int i) const {
    const int tile = i / splits, r0 = 16 * tile, last = n - 1;
    return slice_item(i - tile * splits, [=](int r) { return min(r0 + r, last); });
  }
  // K slice `slice` of the tile rows row(0 .. 15), against the lane's x row
  template <class Row>
  __device__ TileItem slice_item(int slice, Row row) const {
    const int lo = slice * groups_per_split;
    return tile_item(packed, absmax, stride_p, stride_s, row,
                     x + (size_t)min((int)(threadIdx.x & 31) >> 2, m - 1) * stride_x, lo,
                     min(lo + groups_per_split, groups));
  }
  __device__ void store(int i, const float (&acc)[4]) const {
    const int tile = i / splits, ra = 16 * tile + ((threadIdx.x & 31) >> 2), rb = ra + 8;
    each_column(i - tile * splits, [&](int j, int col, float* out) {
      if (out != nullptr) {
        if (ra < n) out[ra] = acc[j];
        if (rb < n) out[rb] = acc[2 + j];
      } else {
        if (ra < n) y[(size_t)col * n + ra] = __float2bfloat16(acc[j]);
        if (rb < n) y[(size_t)col * n + rb] = __float2bfloat16(acc[2 + j]);
      }
    });
  }
  // f(j, col, out) for the lane's mma columns col = 2t + j (lane t of its row's four) that are rows
  // of x; out: row col of K slice `slice`'s float32 partials where K is split, else null
  template <class F>
  __device__ void each_column(int slice, F f) const {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = 2 * t + j;
      if (col < m) f(j, col, splits > 1 ? partial + ((size_t)slice * m + col) * n : nullptr);
    }
  }
};

template <int MODE>
__global__ void __launch_bounds__(512, 1) nf4_gemv_table_kernel(const DenseTiles work, const float* __restrict__ code) {
  run_tiles<MODE>(work, code);
}

// The gate/up product of Gemma's MLP with its activation after it (W = [gate; up], N = 2I): item
// tile / splits takes gate rows 8 tile .. 8 tile + 7 (rows past I repeat its last) as the tile's
// first eight rows and the matching up rows, I further, as its last eight, as the experts' first
// stage does, so that a lane holds both of an output's products. Unsplit it stores the activation
// y [M, I]; split, each slice stores the rows' float32 partials [splits, M, N] for
// `sum_splits_gelu_kernel` to add and activate.
struct DenseGeluTiles : DenseTiles {
  __device__ int count() const { return (n / 2 + 7) / 8 * splits; }
  __device__ TileItem item(int i) const {
    const int tile = i / splits, half = n / 2, g0 = 8 * tile;
    return slice_item(i - tile * splits, [=](int r) { return min(g0 + (r & 7), half - 1) + (r >> 3) * half; });
  }
  __device__ void store(int i, const float (&acc)[4]) const {
    const int tile = i / splits, half = n / 2, row = 8 * tile + ((threadIdx.x & 31) >> 2);
    if (row >= half) return;
    each_column(i - tile * splits, [&](int j, int col, float* out) {
      if (out != nullptr) {
        out[row] = acc[j];
        out[row + half] = acc[2 + j];
      } else {
        y[(size_t)col * half + row] = gelu_mul_bf16(acc[j], acc[2 + j]);
      }
    });
  }
};

__global__ void __launch_bounds__(512, 1) nf4_gemv_gelu_table_kernel(const DenseGeluTiles work,
                                                                     const float* __restrict__ code) {
  run_tiles<0>(work, code);
}

// The experts' (token, chosen expert) pairs grouped by expert, as each block of the experts' tiles
// builds them in its shared memory after the PDL wait (the experts are the router's output): the
// pairs in order of expert (positions), each expert's in pair order, cut into slots of at most 8
// pairs of one expert, a tile's 8 columns, so that an expert's weights are read once for up to 8
// of its tokens. Every block builds the same slots. The ids are the router's, in [0, E): the slots
// clamp them, so that no id reaches outside the scratch, and the items read their expert's rows at
// the id as given, as the Triton kernels do.
constexpr int MAX_EXPERTS = 512, MAX_PAIRS = 512, MAX_SLOT_PAIRS = 8;

struct PairSlots {
  const uint16_t* order;  // [P] position -> pair
  const uint16_t* first;  // [S + 1] slot -> its first position, first[S] = P
  int slots;

  __device__ void build(const int* __restrict__ experts, int pairs, int n_experts, uint8_t* scratch) {
    int* base = reinterpret_cast<int*>(scratch);                    // [E] count, then first position
    int* slot_base = base + MAX_EXPERTS;                            // [E] first slot
    uint16_t* within = reinterpret_cast<uint16_t*>(slot_base + MAX_EXPERTS);  // [P] index among its expert's pairs
    uint16_t* pos_pair = within + MAX_PAIRS;
    uint16_t* slot_first = pos_pair + MAX_PAIRS;
    int* total = reinterpret_cast<int*>(slot_first + MAX_PAIRS + 2);
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) base[e] = 0;
    __syncthreads();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    if (threadIdx.x < 32) {  // warp 0, 32 pairs at a time in pair order
      const int lane = threadIdx.x;
      for (int p0 = 0; p0 < pairs; p0 += 32) {
        const int p = p0 + lane;
        const int e = p < pairs ? min(max(experts[p], 0), n_experts - 1) : -1;
        const uint32_t same = __match_any_sync(0xffffffffu, e);
        const int leader = __ffs(same) - 1;
        int before = 0;
        if (lane == leader && e >= 0) {
          before = base[e];
          base[e] = before + __popc(same);
        }
        before = __shfl_sync(0xffffffffu, before, leader);
        if (p < pairs) within[p] = before + __popc(same & ((1u << lane) - 1));
        __syncwarp();
      }
      // each expert's first position and first slot: sums over the experts before it (lane l takes
      // experts l x per .. l x per + per - 1)
      const int per = (n_experts + 31) / 32, lo = min(lane * per, n_experts), hi = min(lo + per, n_experts);
      int pos = 0, slot = 0;
      for (int e = lo; e < hi; ++e) pos += base[e], slot += (base[e] + MAX_SLOT_PAIRS - 1) / MAX_SLOT_PAIRS;
      for (int off = 1; off < 32; off <<= 1) {
        const int up_pos = __shfl_up_sync(0xffffffffu, pos, off), up_slot = __shfl_up_sync(0xffffffffu, slot, off);
        if (lane >= off) pos += up_pos, slot += up_slot;
      }
      if (lane == 31) *total = slot;
      pos = __shfl_up_sync(0xffffffffu, pos, 1);
      slot = __shfl_up_sync(0xffffffffu, slot, 1);
      if (lane == 0) pos = slot = 0;
      for (int e = lo; e < hi; ++e) {
        const int count = base[e];
        base[e] = pos;
        slot_base[e] = slot;
        pos += count;
        slot += (count + MAX_SLOT_PAIRS - 1) / MAX_SLOT_PAIRS;
      }
    }
#else
    __trap();
#endif
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
      const int e = min(max(experts[p], 0), n_experts - 1), w = within[p], pos = base[e] + w;
      pos_pair[pos] = static_cast<uint16_t>(p);
      if (w % MAX_SLOT_PAIRS == 0) slot_first[slot_base[e] + w / MAX_SLOT_PAIRS] = static_cast<uint16_t>(pos);
    }
    if (threadIdx.x == 0) slot_first[*total] = static_cast<uint16_t>(pairs);
    __syncthreads();
    order = pos_pair;
    first = slot_first;
    slots = *total;
  }

  // slot s's first position and its pair count; the pair in column c (columns past the count
  // repeat its first pair, and are not stored)
  __device__ int2 span(int s) const { return make_int2(first[s], first[s + 1] - first[s]); }
  __device__ int pair(int2 sp, int c) const { return order[sp.x + (c < sp.y ? c : 0)]; }
};
static_assert(2 * MAX_EXPERTS * 4 + (3 * MAX_PAIRS + 2) * 2 + 4 <= SCRATCH_BYTES, "the slots fit the scratch");

// The experts' first stage (kernels/nf4_moe.py's layout: expert e's gate rows at e * 2I of gate_up,
// its up rows I after them), one slot of pairs at a time: item (slot, j) takes the slot's expert's
// gate rows 8j .. 8j + 7 as the tile's first eight rows and the matching up rows as its last
// eight, against the slot's tokens (the mma's columns), and stores gelu_tanh(gate) * up for those
// 8 columns of each pair's activation, each product and the activation rounded to bf16 where the
// stock module rounds them (as moe.py's store_activation).
struct ExpertGateUpTiles {
  const __nv_bfloat16* x;  // [T, H]
  const int* experts;      // [T * top_k], the pairs' experts
  const uint8_t* packed;
  const float* absmax;
  __nv_bfloat16* act;  // [T * top_k, I]
  int pairs, top_k, inter, stride_x, stride_p, stride_s, groups, n_experts;
  PairSlots slots;
  static constexpr bool kRowsBeforeWait = false;
  static constexpr int kScratch = SCRATCH_BYTES;

  __device__ void prepare(uint8_t* scratch) { slots.build(experts, pairs, n_experts, scratch); }
  __device__ int count() const { return slots.slots * (inter / 8); }
  __device__ TileItem item(int i) const {
    const int per = inter / 8, s = i / per, j = i - s * per;
    const int2 sp = slots.span(s);
    const int r0 = experts[slots.pair(sp, 0)] * 2 * inter + 8 * j, up = inter;
    const int token = slots.pair(sp, (threadIdx.x & 31) >> 2) / top_k;
    return tile_item(packed, absmax, stride_p, stride_s, [=](int r) { return r0 + (r & 7) + (r >> 3) * up; },
                     x + (size_t)token * stride_x, 0, groups);
  }
  __device__ void store(int i, const float (&acc)[4]) const {
    const int per = inter / 8, s = i / per, j = i - s * per, lane = threadIdx.x & 31;
    const int2 sp = slots.span(s);
#pragma unroll
    for (int c = 0; c < 2; ++c) {  // lane t holds the mma's columns 2t and 2t + 1
      const int col = 2 * (lane & 3) + c;
      if (col >= sp.y) continue;
      act[(size_t)slots.pair(sp, col) * inter + 8 * j + (lane >> 2)] = gelu_mul_bf16(acc[c], acc[2 + c]);
    }
  }
};

// The experts' second stage: item (slot, j) takes the slot's expert's down rows 16j .. 16j + 15
// (expert e's rows at e * H) against its pairs' activations, and stores them rounded to bf16 and
// weighted by the router, float32, into each pair's partial [H] (moe.py's _sum_pairs adds a
// token's top_k partials in order).
struct ExpertDownTiles {
  const __nv_bfloat16* act;  // [pairs, I]
  const int* experts;
  const float* weights;  // [pairs]
  const uint8_t* packed;
  const float* absmax;
  float* part;  // [pairs, H]
  int pairs, hidden, inter, stride_p, stride_s, groups, n_experts;
  PairSlots slots;
  static constexpr bool kRowsBeforeWait = false;
  static constexpr int kScratch = SCRATCH_BYTES;

  __device__ void prepare(uint8_t* scratch) { slots.build(experts, pairs, n_experts, scratch); }
  __device__ int count() const { return slots.slots * (hidden / 16); }
  __device__ TileItem item(int i) const {
    const int per = hidden / 16, s = i / per, j = i - s * per;
    const int2 sp = slots.span(s);
    const int r0 = experts[slots.pair(sp, 0)] * hidden + 16 * j;
    return tile_item(packed, absmax, stride_p, stride_s, [=](int r) { return r0 + r; },
                     act + (size_t)slots.pair(sp, (threadIdx.x & 31) >> 2) * inter, 0, groups);
  }
  __device__ void store(int i, const float (&acc)[4]) const {
    const int per = hidden / 16, s = i / per, j = i - s * per, lane = threadIdx.x & 31;
    const int2 sp = slots.span(s);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = 2 * (lane & 3) + c;
      if (col >= sp.y) continue;
      const int p = slots.pair(sp, col);
      const float w = weights[p];
      float* out = part + (size_t)p * hidden + 16 * j + (lane >> 2);
      out[0] = round_bf16(acc[c]) * w;
      out[8] = round_bf16(acc[2 + c]) * w;
    }
  }
};

__global__ void __launch_bounds__(512, 1) nf4_expert_gate_up_kernel(const ExpertGateUpTiles work,
                                                                    const float* __restrict__ code) {
  run_tiles<0>(work, code);
}

__global__ void __launch_bounds__(512, 1) nf4_expert_down_kernel(const ExpertDownTiles work,
                                                                 const float* __restrict__ code) {
  run_tiles<0>(work, code);
}

// Block tiles for 1-64 rows of x (a launch's `rows` 32): each block takes 32 weight rows per warp
// (two 16-row tiles, mma.sync's A operand, the codes looked up from the block's table as above)
// over one K slice, and x's rows, up to 8 NB of them, as the B operand's columns in NB blocks of
// eight, so that each weight decoded is multiplied by every row of x. The block's warps walk K
// together, one group a step, through a ring of BLOCK_STAGES stages in shared memory filled by
// asynchronous copies BLOCK_STAGES - 1 groups ahead: a stage holds the block's rows' 32 bytes of
// the group, their absmax, and x's rows' 64 columns of it (128 bytes a row, each 16-byte chunk c
// of row r at chunk c ^ (r & 1), so that a quarter warp's 16-byte reads of two rows fall on all
// 32 banks). As many stages as fit go before the table, the rest after it. A lane's k slots take
// the columns as the tiles' do (lane t of a row's four: bytes 8t .. 8t + 7), so its B fragments
// are 32 bytes of its x row at column 16t. Each group's products are summed in float32 and scaled
// by its absmax after them; the products of up to four blocks of x rows go at once, k step by k
// step, so that a warp has eight independent mma in flight (four for 16 rows of x). Rows of x past
// M repeat row M - 1 and weight rows past N repeat the last; neither is stored. The weights' first
// copies are issued before the PDL wait, x's after it.
constexpr int BLOCK_STAGES = 8;
constexpr int BLOCK_WARP_ROWS = 32;
constexpr int BLOCK_MAX_WARPS = 8;

// a ring stage's bytes for `warps` warps and NB blocks of 8 rows of x: the rows' bytes, their
// absmax, x's rows
__host__ __device__ constexpr uint32_t block_stage_bytes(uint32_t warps, uint32_t nb) {
  return warps * BLOCK_WARP_ROWS * (32 + 4) + nb * 8 * 128;
}

// Where the ring's stages sit, as offsets from the dynamic shared memory's base, given `pad` (the
// bytes from the base to the table) and a stage's bytes: the stages that fit before the table go
// there (`before` of them), the rest after it (the stages from `before` on `jump` the table).
struct BlockRing {
  uint32_t stage_bytes, before, jump;
  __host__ __device__ constexpr BlockRing(uint32_t pad, uint32_t sb)
      : stage_bytes(sb), before(pad / sb), jump(pad + TABLE_BYTES - pad / sb * sb) {}
  __host__ __device__ constexpr uint32_t at(uint32_t s) const { return s * stage_bytes + (s >= before ? jump : 0u); }
};

// A block's shared memory: the most any alignment of the base needs
constexpr int block_smem(int warps, int nb) {
  const uint32_t sb = block_stage_bytes(warps, nb);
  uint32_t most = 0;
  for (uint32_t pad = 0; pad < TABLE_BYTES; pad += 16) {
    const uint32_t last = BlockRing(pad, sb).at(BLOCK_STAGES - 1) + sb;
    const uint32_t end = last > pad + TABLE_BYTES ? last : pad + TABLE_BYTES;
    most = end > most ? end : most;
  }
  return static_cast<int>(most);
}

// MODE 6 of the block tiles (a measurement, not the product): each mma replaced by two integer ops
// on its A fragment folded into one word (`a`, two ops per fragment) and its B fragment, so that the
// copies, the reads and the lookups stay and the tensor pipe idles
__device__ __forceinline__ void mma_stand_in(float (&c)[4], uint32_t a, uint32_t b0, uint32_t b1) {
  c[0] = __uint_as_float(__float_as_uint(c[0]) ^ a ^ b0);
  c[1] = __uint_as_float(__float_as_uint(c[1]) ^ a ^ b1);
}

// MODE 0 is the product; MODE 1 (the loads and the mma on the raw words, no lookups), MODE 2 (x's
// rows copied for the ring's first groups only, later groups reading what those left), MODE 3 (the
// same for the weights and their absmax) and MODE 6 (the loads and the lookups, no mma) are
// measurements of what sets its pace, built for 8 blocks of x rows (33-64 rows) only
template <int NB, int MODE = 0>
__global__ void __launch_bounds__(BLOCK_MAX_WARPS * 32, 1) nf4_block_tiles_kernel(const DenseOperands p,
                                                                                   const float* __restrict__ code) {
  static_assert(MODE == 0 || MODE == 1 || MODE == 2 || MODE == 3 || MODE == 6,
                "the product, or the block tiles' measurement variants");
  extern __shared__ __align__(16) uint32_t smem_words[];
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem_words);
  const uint32_t table_addr = build_table(smem_words, base, code);
  const int threads = blockDim.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int bn = (threads >> 5) * BLOCK_WARP_ROWS, n0 = blockIdx.x * bn;
  const uint32_t stage_bytes = block_stage_bytes(threads >> 5, NB), pad = table_addr - base;
  const uint8_t* smem_bytes = reinterpret_cast<const uint8_t*>(smem_words);
  const BlockRing ring(pad, stage_bytes);
  const uint32_t scales_off = bn * 32, x_off = bn * 36;
  const int g_lo = blockIdx.y * p.groups_per_split, g_hi = min(g_lo + p.groups_per_split, p.groups);
  // group g's weight rows and absmax into the stage at `stage` (shared address): the block has as
  // many threads as rows, so each thread makes two of the rows' 16-byte copies and one absmax copy
  const int w_row0 = min(n0 + (threadIdx.x >> 1), p.n - 1), w_row1 = min(n0 + ((threadIdx.x + threads) >> 1), p.n - 1);
  const uint8_t* w_src0 = p.packed + (size_t)w_row0 * p.stride_p + 16 * (threadIdx.x & 1);
  const uint8_t* w_src1 = p.packed + (size_t)w_row1 * p.stride_p + 16 * (threadIdx.x & 1);
  const float* s_src = p.absmax + (size_t)min(n0 + (int)threadIdx.x, p.n - 1) * p.stride_s;
  auto copy_weights = [&](int g, uint32_t stage) {
    copy_async16(stage + 16 * threadIdx.x, w_src0 + 32 * g);
    copy_async16(stage + 16 * (threadIdx.x + threads), w_src1 + 32 * g);
    copy_async4(stage + scales_off + 4 * threadIdx.x, s_src + g);
  };
  auto copy_x = [&](int g, uint32_t stage) {
    for (int i = threadIdx.x; i < NB * 64; i += threads) {
      const int r = i >> 3, c = i & 7;
      copy_async16(stage + x_off + r * 128 + ((c ^ (r & 1)) << 4),
                   p.x + (size_t)min(r, p.m - 1) * p.stride_x + 64 * g + 8 * c);
    }
  };
  // the weights of the first BLOCK_STAGES - 1 groups in one copy group, then x's, one per group:
  // BLOCK_STAGES groups in all before the loop, which waits for all but the last BLOCK_STAGES - 2
#pragma unroll
  for (int s = 0; s < BLOCK_STAGES - 1; ++s) {
    if (g_lo + s < g_hi) copy_weights(g_lo + s, base + ring.at(s));
  }
  commit_copies();
  __syncthreads();  // the table
  pdl_enter();
#pragma unroll
  for (int s = 0; s < BLOCK_STAGES - 1; ++s) {
    if (g_lo + s < g_hi) copy_x(g_lo + s, base + ring.at(s));
    commit_copies();
  }
  const int gq = lane >> 2, t = lane & 3;
  const uint32_t lane_addr = table_addr | lane * 4u;
  float acc[2][NB][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nb][i] = 0.f;
  for (int i = 0; g_lo + i < g_hi; ++i) {
    wait_copies<BLOCK_STAGES - 2>();  // this thread's copies of the stage, then every thread's
    __syncthreads();
    // the stage read in the step before is free: refill it with the group BLOCK_STAGES - 1 ahead
    const int g_next = g_lo + i + BLOCK_STAGES - 1;
    if (g_next < g_hi) {
      const uint32_t fill = base + ring.at((i + BLOCK_STAGES - 1) % BLOCK_STAGES);
      if (MODE != 3) copy_weights(g_next, fill);
      if (MODE != 2) copy_x(g_next, fill);
    }
    commit_copies();
    const uint8_t* stage = smem_bytes + ring.at(i % BLOCK_STAGES);
    TileStep ts[2];
    uint32_t f[2][4][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const int ra = warp * BLOCK_WARP_ROWS + 16 * mt + gq;
      ts[mt].a = *reinterpret_cast<const uint2*>(stage + ra * 32 + 8 * t);
      ts[mt].b = *reinterpret_cast<const uint2*>(stage + (ra + 8) * 32 + 8 * t);
      ts[mt].sa = reinterpret_cast<const float*>(stage + scales_off)[ra];
      ts[mt].sb = reinterpret_cast<const float*>(stage + scales_off)[ra + 8];
      group_codes<MODE == 1 ? 1 : 0>(ts[mt], lane_addr, f[mt]);
    }
    constexpr int NC = NB < 4 ? NB : 4;  // blocks of x rows multiplied at once
#pragma unroll
    for (int nb0 = 0; nb0 < NB; nb0 += NC) {
      uint4 xv[NC][2];
#pragma unroll
      for (int j = 0; j < NC; ++j) {
        const uint8_t* xr = stage + x_off + (8 * (nb0 + j) + gq) * 128;
        xv[j][0] = *reinterpret_cast<const uint4*>(xr + (((2 * t) ^ (gq & 1)) << 4));
        xv[j][1] = *reinterpret_cast<const uint4*>(xr + (((2 * t + 1) ^ (gq & 1)) << 4));
      }
      float c[2][NC][4] = {};
#pragma unroll
      for (int s = 0; s < 4; ++s) {
#pragma unroll
        for (int j = 0; j < NC; ++j) {
          const uint4& xs = xv[j][s >> 1];
          const uint32_t b0 = (s & 1) ? xs.z : xs.x, b1 = (s & 1) ? xs.w : xs.y;
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            if (MODE == 6) {
              mma_stand_in(c[mt][j], f[mt][s][0] ^ f[mt][s][1] ^ f[mt][s][2] ^ f[mt][s][3], b0, b1);
            } else {
              mma_bf16(c[mt][j], f[mt][s][0], f[mt][s][1], f[mt][s][2], f[mt][s][3], b0, b1);
            }
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int j = 0; j < NC; ++j) {
          float(&a)[4] = acc[mt][nb0 + j];
          a[0] = fmaf(c[mt][j][0], ts[mt].sa, a[0]);
          a[1] = fmaf(c[mt][j][1], ts[mt].sa, a[1]);
          a[2] = fmaf(c[mt][j][2], ts[mt].sb, a[2]);
          a[3] = fmaf(c[mt][j][3], ts[mt].sb, a[3]);
        }
      }
    }
  }
  wait_copies<0>();  // no copy in flight when the block ends
  // lane (gq, t) holds rows gq and gq + 8 of each tile against x rows 8 nb + 2t and 8 nb + 2t + 1
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    const int ra = n0 + warp * BLOCK_WARP_ROWS + 16 * mt + gq, rb = ra + 8;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = 8 * nb + 2 * t + j;
        if (col >= p.m) continue;
        if (gridDim.y > 1) {
          float* out = p.partial + ((size_t)blockIdx.y * p.m + col) * p.n;
          if (ra < p.n) out[ra] = acc[mt][nb][j];
          if (rb < p.n) out[rb] = acc[mt][nb][2 + j];
        } else {
          __nv_bfloat16* out = p.y + (size_t)col * p.n;
          if (ra < p.n) out[ra] = __float2bfloat16(acc[mt][nb][j]);
          if (rb < p.n) out[rb] = __float2bfloat16(acc[mt][nb][2 + j]);
        }
      }
    }
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

// The gate/up product's K slices added as sum_splits_kernel adds them, then its activation: y [M, I]
// of the float32 partials [split, M, 2I], or, where `product` is not null (an unsplit product of
// the one-row or block kernels), of that bf16 product [M, 2I] (`partial` unused)
__global__ void sum_splits_gelu_kernel(const float* __restrict__ partial, const __nv_bfloat16* __restrict__ product,
                                       __nv_bfloat16* __restrict__ y, int m, int half, int split) {
  pdl_enter();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= m * half) return;
  const int row = i / half, c = i - row * half;
  const size_t gi = (size_t)row * 2 * half + c, ui = gi + half, n = (size_t)m * 2 * half;
  float g = 0.f, u = 0.f;
  if (product != nullptr) {
    g = __bfloat162float(product[gi]);
    u = __bfloat162float(product[ui]);
  } else {
    for (int s = 0; s < split; ++s) g += partial[s * n + gi], u += partial[s * n + ui];
  }
  y[i] = gelu_mul_bf16(g, u);
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
template __global__ void nf4_gemv_table_kernel<0>(const DenseTiles, const float*);
template __global__ void nf4_gemv_table_kernel<3>(const DenseTiles, const float*);
template __global__ void nf4_gemv_table_kernel<4>(const DenseTiles, const float*);
template __global__ void nf4_gemv_table_kernel<5>(const DenseTiles, const float*);
template __global__ void nf4_block_tiles_kernel<2>(const DenseOperands, const float*);
template __global__ void nf4_block_tiles_kernel<4>(const DenseOperands, const float*);
template __global__ void nf4_block_tiles_kernel<8>(const DenseOperands, const float*);
template __global__ void nf4_block_tiles_kernel<8, 1>(const DenseOperands, const float*);
template __global__ void nf4_block_tiles_kernel<8, 2>(const DenseOperands, const float*);
template __global__ void nf4_block_tiles_kernel<8, 3>(const DenseOperands, const float*);
template __global__ void nf4_block_tiles_kernel<8, 6>(const DenseOperands, const float*);
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
void launch(void (*kernel)(Args...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
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

// An NF4 weight of N rows and K columns as the kernels read it (the caller checks devices and
// alignment).
void check_weight(const torch::Tensor& packed, const torch::Tensor& absmax, const torch::Tensor& code, int64_t n,
                  int64_t k) {
  TORCH_CHECK(n > 0 && k > 0 && k % 64 == 0 && packed.scalar_type() == torch::kByte && packed.dim() == 2 &&
                  packed.size(0) == n && packed.size(1) * 2 == k && packed.stride(1) == 1 &&
                  absmax.scalar_type() == torch::kFloat && absmax.dim() == 2 && absmax.size(0) == n &&
                  absmax.size(1) * 64 >= k && absmax.stride(1) == 1 && code.scalar_type() == torch::kFloat &&
                  code.is_contiguous() && code.numel() == 16,
              "an NF4 weight: packed [N, K/2] uint8, absmax [N, K/64] float32, code [16] float32, K a multiple of 64");
}

// A kernel's opt-in to more than 48 KiB of dynamic shared memory, made once per kernel and device:
// as much as the device allows, up to `most` (its largest block's)
void opt_in(const void* kernel, const torch::Device& device, int most) {
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> opted_in;  // (kernel, device)
  const std::lock_guard<std::mutex> lock(mutex);
  const std::pair<const void*, int> key{kernel, device.index()};
  if (!opted_in.count(key)) {
    int optin = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device.index()));
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, std::min(optin, most)));
    opted_in.insert(key);
  }
}

// a block of `warps` warps needing `smem` bytes of shared memory fits the device
void check_smem(const torch::Device& device, int smem, int64_t warps) {
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device.index()));
  TORCH_CHECK(smem <= optin, "tiles of ", warps, " warps need ", smem, " bytes of shared memory per block; this GPU "
              "allows ", optin);
}

static_assert(tile_smem(16, SCRATCH_BYTES) <= 227 * 1024,
              "the table, 16 warps' rings and the scratch fit one block's shared memory (Hopper)");

// A tile kernel (one block per SM at most, `warps` warps each: the table, their rings and the Work's
// scratch) for `items` work items, with its opt-in to more than 48 KiB of dynamic shared memory made
// once per kernel and device (the kernels of one work type, e.g. a product and its measurement
// variants, each opt in).
template <class Work>
void launch_tiles(void (*kernel)(const Work, const float*), int64_t items, int64_t warps, int64_t blocks,
                  const torch::Device& device, cudaStream_t stream, bool pdl, const Work& work, const float* code) {
  TORCH_CHECK(blocks > 0 && warps >= 1 && warps <= 16, "tiles on tensor cores: 1-16 warps in 1 or more blocks");
  static const std::array<int, 17> smem_for = [] {  // by warps (tile_smem scans every alignment)
    std::array<int, 17> t{};
    for (int w = 1; w <= 16; ++w) t[w] = tile_smem(w, Work::kScratch);
    return t;
  }();
  const int smem = smem_for[warps];
  opt_in(reinterpret_cast<const void*>(kernel), device, smem_for[16]);
  check_smem(device, smem, warps);
  if (items > 0) {
    launch(kernel, dim3(std::min<int64_t>(blocks, items)), dim3(32 * warps), smem, stream,
           pdl, work, code);
  }
}

// The number of slices to cut `length` steps of K into, for `units` pieces of work per slice run by
// `resident` workers at once: the slice length whose rounds end soonest, a slice of p steps costing
// p + `overhead` (fewer slices where two lengths cost the same).
int64_t spread_slices(int64_t units, int length, int64_t resident, int overhead) {
  int64_t best = -1, slices = 1;
  for (int p = length; p >= 1; --p) {
    const int64_t s = (length + p - 1) / p, cost = (units * s + resident - 1) / resident * (p + overhead);
    if (best < 0 || cost < best) best = cost, slices = s;
  }
  return slices;
}

// x [M, K] bf16 (rows contiguous, 16-byte aligned), packed [N, K/2] uint8, absmax [N, K/64] float32,
// code [16] float32, y [M, N] bf16, partial [split, M, N] float32 (split > 1; allocated here where
// it is not float32 or smaller); K a multiple of 64, rows 16-byte aligned (checked by the caller). `rows` 1-8: M 1;
// `blocks` > 0: persistent warps in that many blocks. `rows` 16: M 1-8, tiles on tensor cores in
// `blocks` blocks (one per SM at most: the table takes 64 KiB of shared memory at a 64 KiB boundary and each warp's ring 6.75 KiB), `split` 0 for the
// K slices that spread the items best. `rows` 32: M 1-64, block tiles of 4 or 8 warps, one block per
// 32 weight rows a warp and K slice (the grid is row blocks x split), `split` 0 for the slices
// whose waves over `blocks` blocks end soonest. `mode` 0: the product; 1 and 2 the measurement variants
// above; 3 (tiles) the product with L2 prefetching 128 bytes per copy, 4 (tiles) the product with
// copies that read whole sectors; for the block tiles at 33-64 rows, 1 without the lookups and 6
// without the mma. `pdl`: launched with PDL (compute capability 9.0 or newer; the caller checks).
// `gelu`: W is Gemma's [gate; up] (N = 2I) and y [M, I] takes gelu_tanh(gate) x up: the tiles store
// it (unsplit) or the sum of the K slices computes it, and the other kernels' product, where
// unsplit, goes through a bf16 buffer to `sum_splits_gelu_kernel`.
void nf4_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor absmax, torch::Tensor code, torch::Tensor y,
              torch::Tensor partial, int64_t rows, int64_t warps, int64_t split, int64_t mode, int64_t blocks,
              bool pdl, bool gelu) {
  const int n = packed.size(0), k = x.size(-1), m = x.size(0);
  check_weight(packed, absmax, code, n, k);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1 && m >= 1 &&
                  y.scalar_type() == torch::kBFloat16 && y.is_contiguous() &&
                  y.numel() == static_cast<int64_t>(m) * (gelu ? n / 2 : n) &&
                  warps >= 1,
              "x [M, K] bf16 rows, y [M, N] bf16 contiguous ([M, N / 2] with the activation), one warp or more");
  TORCH_CHECK(!gelu || (n % 2 == 0 && mode == 0), "the activation: an even N, the product (mode 0)");
  const c10::cuda::CUDAGuard guard(x.device());  // x's device and its current stream
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto* const act = reinterpret_cast<__nv_bfloat16*>(y.data_ptr());
  // the product's output: y, or with the activation after a kernel that stores the product, a buffer
  torch::Tensor product;
  auto* yp = act;
  auto unsplit_product = [&](int64_t s) {
    if (gelu && s <= 1) {
      product = torch::empty({m, n}, y.options());
      yp = reinterpret_cast<__nv_bfloat16*>(product.data_ptr());
    }
  };
  const auto* xp = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  const auto* pp = static_cast<const uint8_t*>(packed.data_ptr<uint8_t>());
  const auto* sp = static_cast<const float*>(absmax.data_ptr<float>());
  const auto* cp = static_cast<const float*>(code.data_ptr<float>());
  const int stride_p = static_cast<int>(packed.stride(0)), stride_s = static_cast<int>(absmax.stride(0));
  // float32 partials of each K slice (the caller's buffer where it is float32 and holds them)
  auto partials = [&](int64_t s) -> float* {
    if (s <= 1) return nullptr;
    if (partial.scalar_type() != torch::kFloat || partial.numel() < s * m * n) {
      partial = torch::empty({s, m, n}, x.options().dtype(torch::kFloat32));
    }
    return partial.data_ptr<float>();
  };
  float* part = nullptr;
  if (rows == BLOCK_WARP_ROWS) {
    TORCH_CHECK(m >= 1 && m <= 64 && (warps == 4 || warps == BLOCK_MAX_WARPS) && blocks > 0 &&
                    (mode == 0 || ((mode == 1 || mode == 2 || mode == 3 || mode == 6) && m > 32)),
                "block tiles: 1-64 rows of x, 4 or 8 warps, one block per SM or more; the product, or the "
                "measurement modes 1, 2, 3 and 6 at 33-64 rows");
    const int groups = k / 64, bn = static_cast<int>(warps) * BLOCK_WARP_ROWS, row_blocks = (n + bn - 1) / bn;
    // the blocks over `blocks` (one per SM), the ring's filling counted as BLOCK_STAGES - 1 groups
    if (split <= 0) split = spread_slices(row_blocks, groups, blocks, BLOCK_STAGES - 1);
    const int per = (groups + split - 1) / split;
    split = (groups + per - 1) / per;
    part = partials(split);
    unsplit_product(split);
    const DenseOperands work{xp, pp, sp, part, yp, n, m, static_cast<int>(x.stride(0)), stride_p, stride_s, groups, per};
    const int nb = m <= 16 ? 2 : m <= 32 ? 4 : 8;
    auto kernel = nb == 2 ? nf4_block_tiles_kernel<2> : nb == 4 ? nf4_block_tiles_kernel<4>
                  : mode == 1 ? nf4_block_tiles_kernel<8, 1> : mode == 2 ? nf4_block_tiles_kernel<8, 2>
                  : mode == 3 ? nf4_block_tiles_kernel<8, 3> : mode == 6 ? nf4_block_tiles_kernel<8, 6>
                  : nf4_block_tiles_kernel<8>;
    static const std::array<std::array<int, 9>, BLOCK_MAX_WARPS + 1> smem_for = [] {  // by warps and NB
      std::array<std::array<int, 9>, BLOCK_MAX_WARPS + 1> t{};
      for (int w : {4, BLOCK_MAX_WARPS}) for (int b : {2, 4, 8}) t[w][b] = block_smem(w, b);
      return t;
    }();
    const int smem = smem_for[warps][nb];
    opt_in(reinterpret_cast<const void*>(kernel), x.device(), smem_for[BLOCK_MAX_WARPS][nb]);
    check_smem(x.device(), smem, warps);
    launch(kernel, dim3(row_blocks, split), dim3(32 * warps), smem, stream, pdl, work, cp);
  } else if (rows == 16) {
    TORCH_CHECK(mode >= 0 && mode <= 5 && m >= 1 && m <= 8, "tiles on tensor cores: 1-8 rows of x");
    TORCH_CHECK(mode != 5 || (n % 16 == 0 && stride_p * 2 == k && stride_s * 64 == k),
                "MODE 5 reads whole tiles of a contiguous weight");
    // K is cut into slices of whole ring stages (STAGE_GROUPS groups), so that only the last slice
    // can end on a stage of one group
    const int groups = k / 64, tiles = gelu ? (n / 2 + 7) / 8 : (n + 15) / 16;
    const int stages = (groups + STAGE_GROUPS - 1) / STAGE_GROUPS;
    // the items over the grid's warps, an item's own cost (its x row, its store) counted as one stage
    if (split <= 0) split = spread_slices(tiles, stages, blocks * warps, 1);
    const int per = (stages + split - 1) / split * STAGE_GROUPS;
    split = (groups + per - 1) / per;
    part = partials(split);
    const DenseTiles work{{xp, pp, sp, part, yp, n, m, static_cast<int>(x.stride(0)), stride_p, stride_s, groups, per},
                          static_cast<int>(split)};
    const int64_t items = static_cast<int64_t>(tiles) * split;
    auto tiles_of = [&](auto kernel, const auto& w) {
      launch_tiles(kernel, items, warps, blocks, x.device(), stream, pdl, w, cp);
    };
    if (gelu) tiles_of(nf4_gemv_gelu_table_kernel, DenseGeluTiles{work});
    else if (mode == 1) tiles_of(nf4_gemv_table_kernel<1>, work);
    else if (mode == 2) tiles_of(nf4_gemv_table_kernel<2>, work);
    else if (mode == 3) tiles_of(nf4_gemv_table_kernel<3>, work);
    else if (mode == 4) tiles_of(nf4_gemv_table_kernel<4>, work);
    else if (mode == 5) tiles_of(nf4_gemv_table_kernel<5>, work);
    else tiles_of(nf4_gemv_table_kernel<0>, work);
  } else {
    TORCH_CHECK(m == 1 && mode >= 0 && mode <= 2, "1-8 weight rows per warp take one row of x (modes 0-2)");
    const int chunks = k / 32;
    const int per = (chunks + split - 1) / split;
    split = (chunks + per - 1) / per;  // every slice holds a chunk: each writes its partials
    part = partials(split);
    unsplit_product(split);
    const int row_warps = (n + rows - 1) / rows;
    dim3 grid((row_warps + warps - 1) / warps, split);
    if (blocks > 0) grid.x = std::min<int64_t>(blocks, grid.x);  // persistent warps in `blocks` blocks
    Kernel kernel = nullptr;
    switch (rows) {
      case 1: kernel = pick<1>(blocks > 0, mode); break;
      case 2: kernel = pick<2>(blocks > 0, mode); break;
      case 4: kernel = pick<4>(blocks > 0, mode); break;
      case 8: kernel = pick<8>(blocks > 0, mode); break;
      default: TORCH_CHECK(false, "rows must be 1, 2, 4, 8, 16 or 32");
    }
    launch(kernel, grid, dim3(32 * warps), 0, stream, pdl, xp, pp, sp, cp, part, yp, n, k, stride_p, stride_s, per);
  }
  if (gelu && (split > 1 || product.defined())) {
    const int half = n / 2;
    launch(sum_splits_gelu_kernel, dim3((m * half + 255) / 256), dim3(256), 0, stream, pdl,
           static_cast<const float*>(part), static_cast<const __nv_bfloat16*>(product.defined() ? yp : nullptr), act,
           m, half, static_cast<int>(split));
  } else if (split > 1) {
    launch(sum_splits_kernel, dim3((m * n + 255) / 256), dim3(256), 0, stream, pdl, static_cast<const float*>(part),
           yp, m * n, static_cast<int>(split));
  }
}

// Shared memory per block of tiles of `warps` warps, the most any tile kernel takes (the experts'
// with their scratch).
int64_t nf4_tile_shared_bytes(int64_t warps) { return tile_smem(static_cast<int>(warps), SCRATCH_BYTES); }

// Shared memory per block of block tiles of `warps` warps, for 64 rows of x (the most they take).
int64_t nf4_block_shared_bytes(int64_t warps) { return block_smem(static_cast<int>(warps), 8); }

// The pairs and experts a block's slots hold (PairSlots)
void check_pairs(int64_t pairs, int64_t n_experts) {
  TORCH_CHECK(pairs >= 1 && pairs <= MAX_PAIRS && n_experts >= 1 && n_experts <= MAX_EXPERTS, "the experts' tiles "
              "take 1-", MAX_PAIRS, " (token, expert) pairs of 1-", MAX_EXPERTS, " experts, not ", pairs, " of ",
              n_experts);
}

// The most (token, expert) pairs, and the most experts, the experts' tiles take in one launch.
int64_t nf4_expert_max_pairs() { return MAX_PAIRS; }
int64_t nf4_expert_max_experts() { return MAX_EXPERTS; }

// The experts' two stages on tiles (kernels/nf4_moe.py): x [T, H] bf16, experts [T * top_k] int32,
// gate_up packed [E * 2I, H / 2] with absmax [E * 2I, H / 64] -> act [T * top_k, I] bf16; act,
// experts, weights [T * top_k] float32, down packed [E * H, I / 2] with absmax [E * H, I / 64] ->
// part [T * top_k, H] float32. H and I multiples of 64 (checked by the caller). The grid is
// sized for one slot per pair (no two pairs share an expert), the most the slots can number.
void nf4_experts_gate_up(torch::Tensor x, torch::Tensor experts, torch::Tensor packed, torch::Tensor absmax,
                         torch::Tensor code, torch::Tensor act, int64_t top_k, int64_t warps, int64_t blocks,
                         bool pdl) {
  const int pairs = experts.numel(), inter = act.size(1), hidden = x.size(1);
  check_weight(packed, absmax, code, packed.size(0), hidden);
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.stride(1) == 1 &&
                  experts.scalar_type() == torch::kInt && experts.is_contiguous() &&
                  pairs == x.size(0) * top_k && act.scalar_type() == torch::kBFloat16 && act.is_contiguous() &&
                  act.size(0) == pairs && inter % 8 == 0 && packed.size(0) % (2 * inter) == 0,
              "x [T, H] bf16, experts [T * top_k] int32, act [T * top_k, I] bf16, gate/up rows 2I per expert");
  check_pairs(pairs, packed.size(0) / (2 * inter));
  const c10::cuda::CUDAGuard guard(x.device());
  const ExpertGateUpTiles work{reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), experts.data_ptr<int>(),
                               packed.data_ptr<uint8_t>(), absmax.data_ptr<float>(),
                               reinterpret_cast<__nv_bfloat16*>(act.data_ptr()), pairs, static_cast<int>(top_k), inter,
                               static_cast<int>(x.stride(0)), static_cast<int>(packed.stride(0)),
                               static_cast<int>(absmax.stride(0)), static_cast<int>(x.size(1) / 64),
                               static_cast<int>(packed.size(0) / (2 * inter)), {}};
  launch_tiles(nf4_expert_gate_up_kernel, static_cast<int64_t>(pairs) * (inter / 8), warps, blocks, x.device(),
               c10::cuda::getCurrentCUDAStream(), pdl, work, code.data_ptr<float>());
}

void nf4_experts_down(torch::Tensor act, torch::Tensor experts, torch::Tensor weights, torch::Tensor packed,
                      torch::Tensor absmax, torch::Tensor code, torch::Tensor part, int64_t warps, int64_t blocks,
                      bool pdl) {
  const int pairs = experts.numel(), hidden = part.size(1), inter = act.size(1);
  check_weight(packed, absmax, code, packed.size(0), inter);
  TORCH_CHECK(act.scalar_type() == torch::kBFloat16 && act.is_contiguous() && act.size(0) == pairs &&
                  experts.scalar_type() == torch::kInt && experts.is_contiguous() &&
                  weights.scalar_type() == torch::kFloat && weights.is_contiguous() && weights.numel() == pairs &&
                  part.scalar_type() == torch::kFloat && part.is_contiguous() && part.size(0) == pairs &&
                  hidden % 16 == 0 && packed.size(0) % hidden == 0,
              "act [P, I] bf16, experts [P] int32, weights [P] float32, part [P, H] float32, down rows H per expert");
  check_pairs(pairs, packed.size(0) / hidden);
  const c10::cuda::CUDAGuard guard(act.device());
  const ExpertDownTiles work{reinterpret_cast<const __nv_bfloat16*>(act.data_ptr()), experts.data_ptr<int>(),
                             weights.data_ptr<float>(), packed.data_ptr<uint8_t>(), absmax.data_ptr<float>(),
                             part.data_ptr<float>(), pairs, hidden, inter, static_cast<int>(packed.stride(0)),
                             static_cast<int>(absmax.stride(0)), inter / 64,
                             static_cast<int>(packed.size(0) / hidden), {}};
  launch_tiles(nf4_expert_down_kernel, static_cast<int64_t>(pairs) * (hidden / 16), warps, blocks, act.device(),
               c10::cuda::getCurrentCUDAStream(), pdl, work, code.data_ptr<float>());
}
#endif
