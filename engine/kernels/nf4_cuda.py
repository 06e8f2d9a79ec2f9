"""NF4 products of few rows in CUDA C++ (kernels/cuda/nf4_gemv.cu), beside the Triton kernels of
kernels/nf4.py: built once per machine by torch's extension loader where a CUDA compiler is
installed (the build is cached by torch), and None where it is not, or where the build fails, so
the engine keeps to the Triton kernels. `nf4_plan.plan_nf4` times its launches against those
kernels on a model's own weights at 1-64 rows, and keeps one only where it is faster and agrees
with the library's product.

A launch is `(rows, warps, split, blocks_per_sm)`: weight rows per warp, warps per block, K split
(float32 partials summed in a fixed order), and 0 for one warp per row group or the number of blocks
per SM of persistent warps that keep their next step's loads in flight (for the tiles the blocks
their items spread over, for the block tiles the blocks their automatic split counts on). Rows 1-8
multiply on FMAs with a shuffle per code; rows 16 is a tile of 16 rows per warp on tensor cores,
each byte's two codes looked up at once from a table in shared memory, the weights streamed to each
warp through a ring of asynchronous copies (one block per SM; split 0: the K slices that spread the
work over the warps best; x's rows are the mma's columns, so a tile takes 1-8 rows at the cost of
one); rows 32 is a block of 4 or 8 warps of 32 weight rows each, walking K together through one ring
that holds x's rows beside the weights, for 1-64 rows of x (the block tiles). It takes bf16 rows of
x whose 16-byte chunks are aligned, and the weight's rows 16-byte aligned (`fits`: one row, for
tiles up to 8, for block tiles up to 64).
"""

from __future__ import annotations

import functools
import logging
import pathlib

import torch

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).parent / "cuda" / "nf4_gemv.cu"
# tile launches: 8, 12 and 16 warps per SM, K split to spread the work
TILE_LAUNCHES = ((16, 8, 0, 1), (16, 12, 0, 1), (16, 16, 0, 1))
# the launches the plans time at one row (`candidates`): the fastest per Gemma-3 4B projection on an
# H200 (python -m bench.nf4_cuda), one warp per row group for QKV, O and down, persistent for
# gate/up, and the tensor-core tiles
CANDIDATES = ((2, 4, 1, 0), (2, 2, 1, 0), (4, 4, 1, 0), (2, 2, 2, 0), (2, 4, 2, 0), (4, 8, 1, 8), (2, 8, 1, 8),
              (2, 4, 1, 4)) + TILE_LAUNCHES
TILE_ROWS = 16  # a launch's rows for the tensor-core tiles
MAX_TILE_X_ROWS = 8  # and they take up to this many rows of x (the mma's columns)
BLOCK_ROWS = 32  # a launch's rows for the block tiles
MAX_X_ROWS = 64  # and they take up to this many rows of x
BLOCK_WARPS = (4, 8)  # the block tiles' warps per block
# block tile launches: 8 or 4 warps, one block per SM, K split to spread the blocks (0) or as given
BLOCK_LAUNCHES = ((32, 8, 0, 1), (32, 8, 1, 1), (32, 8, 2, 1), (32, 4, 0, 1), (32, 4, 1, 1))


def candidates(m: int) -> tuple[tuple[int, int, int, int], ...]:
    """The launches the plans time at `m` rows of x: the one-row kernels and the tiles at one row,
    the tiles and the block tiles at 2-8, the block tiles at 9-64."""
    if m == 1:
        return CANDIDATES
    if m <= MAX_TILE_X_ROWS:
        return TILE_LAUNCHES + BLOCK_LAUNCHES
    return BLOCK_LAUNCHES if m <= MAX_X_ROWS else ()


@functools.cache
def extension():
    """The built extension, or None (no CUDA device or compiler, or the build failed: logged)."""
    if not torch.cuda.is_available():
        return None
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        log.info("no CUDA compiler: the NF4 products run on the Triton kernels only")
        return None
    decl = ("void nf4_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor absmax, torch::Tensor code, "
            "torch::Tensor y, torch::Tensor partial, int64_t rows, int64_t warps, int64_t split, int64_t mode, "
            "int64_t blocks, bool pdl, bool gelu);\n"
            "void nf4_experts_gate_up(torch::Tensor x, torch::Tensor experts, torch::Tensor packed, "
            "torch::Tensor absmax, torch::Tensor code, torch::Tensor act, int64_t top_k, int64_t warps, "
            "int64_t blocks, bool pdl);\n"
            "void nf4_experts_down(torch::Tensor act, torch::Tensor experts, torch::Tensor weights, "
            "torch::Tensor packed, torch::Tensor absmax, torch::Tensor code, torch::Tensor part, int64_t warps, "
            "int64_t blocks, bool pdl);\n"
            "int64_t nf4_tile_shared_bytes(int64_t warps);\n"
            "int64_t nf4_block_shared_bytes(int64_t warps);\n"
            "int64_t nf4_expert_max_pairs();\n"
            "int64_t nf4_expert_max_experts();")
    major, minor = torch.cuda.get_device_capability()
    log.info("loading the CUDA NF4 kernel (built on a machine's first start, then cached by torch)")
    try:
        return cpp_extension.load_inline(
            "s5serve_nf4_gemv", cpp_sources=decl, cuda_sources=SOURCE.read_text(),
            functions=["nf4_gemv", "nf4_experts_gate_up", "nf4_experts_down", "nf4_tile_shared_bytes",
                       "nf4_block_shared_bytes", "nf4_expert_max_pairs", "nf4_expert_max_experts"],
            extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"])
    except Exception as exc:  # a compiler that cannot build it: the Triton kernels serve
        log.warning("the CUDA NF4 kernel did not build (%s): the Triton kernels serve", str(exc)[:200])
        return None


def _holds(index: int, shared_bytes: int) -> bool:
    """Whether device `index` runs a tile kernel whose block takes `shared_bytes` of shared memory:
    bf16 mma.sync and cp.async (compute capability 8.0) and the block's opt-in shared memory."""
    props = torch.cuda.get_device_properties(index)
    return props.major >= 8 and getattr(props, "shared_memory_per_block_optin", 0) >= shared_bytes


@functools.cache
def tiles_supported(index: int, warps: int = min(w for _, w, _, _ in TILE_LAUNCHES)) -> bool:
    """Whether device `index` runs tiles of `warps` warps per block: the table and the warps' rings
    (the extension's `nf4_tile_shared_bytes`)."""
    ext = extension()
    return ext is not None and _holds(index, ext.nf4_tile_shared_bytes(warps))


@functools.cache
def blocks_supported(index: int, warps: int) -> bool:
    """Whether device `index` runs block tiles of `warps` warps: the table and the block's ring
    (`nf4_block_shared_bytes`)."""
    ext = extension()
    return ext is not None and _holds(index, ext.nf4_block_shared_bytes(warps))


def _weight_fits(w, device: torch.device, k: int) -> bool:
    return (w.packed.device == w.scales.device == w.code.device == device and w.packed.dtype == torch.uint8
            and w.shape[1] == k and w.packed.stride(1) == 1 and w.packed.stride(0) % 16 == 0
            and w.packed.data_ptr() % 16 == 0 and w.scales.dtype == torch.float32 and w.scales.stride(1) == 1
            and w.scales.shape[1] * 64 >= k and w.code.dtype == torch.float32 and w.code.is_contiguous()
            and w.code.numel() == 16)


def fits(x: torch.Tensor, w, launch: tuple[int, int, int, int] | None = None) -> bool:
    """Whether the kernel takes this product (with `launch`, where given): bf16 rows of the
    weight's K, 16-byte aligned, on the weight's CUDA device; one row, 1-8 rows for tiles, 1-64
    for block tiles (on a GPU that runs them)."""
    if x.dim() != 2 or not x.is_cuda or x.dtype != torch.bfloat16 or x.stride(1) != 1 or x.data_ptr() % 16:
        return False
    if launch is not None and launch[0] == BLOCK_ROWS:
        if (not 1 <= x.shape[0] <= MAX_X_ROWS or x.stride(0) % 8 or launch[1] not in BLOCK_WARPS or launch[3] < 1
                or not blocks_supported(x.device.index, launch[1])):
            return False
    elif launch is not None and launch[0] == TILE_ROWS:
        if (not 1 <= x.shape[0] <= MAX_TILE_X_ROWS or x.stride(0) % 8
                or not tiles_supported(x.device.index, launch[1])):
            return False
    elif x.shape[0] != 1:
        return False
    return x.shape[1] > 0 and _weight_fits(w, x.device, x.shape[1])


def gemv(x: torch.Tensor, w, launch: tuple[int, int, int, int], sms: int, pdl: bool = False,
         mode: int = 0, gelu: bool = False) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] bf16 with the CUDA kernel, W an `nf4.NF4Weight` (`fits(x, w, launch)` must
    hold; `sms`: the device's multiprocessors; `pdl`: launched with PDL, as kernels/launch.py's
    kernels are (the caller checked `launch.supported`); `mode` 1 and 2 are the source's
    measurement variants, not the product, 3 and 4 the tiles' product with L2 prefetching and with copies
    that read whole 32-byte sectors, 5 the tiles' copies from a tile-contiguous layout, a measurement;
    for the block tiles at 33-64 rows of x, 1 without the lookups, 6 without the mma, 2 and 3
    without x's and without the weights' copies past the ring's first groups). `gelu`: W is Gemma's
    gate/up weight [gate; up] and the result gelu_tanh(gate) x up [M, N / 2], with the roundings
    of `fused_ops.gelu_mul` after the product (unsplit tiles compute it as they store; otherwise
    the kernel that adds the K slices does, or, for an unsplit product of the other kernels, one
    that reads it from a bf16 buffer the launcher allocates)."""
    rows, warps, split, per_sm = launch
    y = torch.empty((x.shape[0], w.shape[0] // 2 if gelu else w.shape[0]), dtype=x.dtype, device=x.device)
    # the launcher allocates the float32 partials of a K split (it settles the split), so y stands
    # for the partials buffer here
    extension().nf4_gemv(x, w.packed, w.scales, w.code, y, y, rows, warps, split, mode, per_sm * sms, pdl, gelu)
    return y


# the experts' tile launches (warps per block, blocks per SM) the plans, the GPU tests and
# `bench.tune_kernels --experts --nf4` run, where the GPU holds them (`experts_fit`)
EXPERT_LAUNCHES = ((8, 1), (12, 1), (16, 1))


def experts_fit(x: torch.Tensor, gate_up, down, launch: tuple[int, int] | None = None, top_k: int = 1) -> bool:
    """Whether the experts' tiles take these operands (in `launch`, where given: its warps' rings
    fit the GPU's shared memory): bf16 tokens whose rows are 16-byte aligned, on the weights' CUDA
    device, H and I multiples of 64 (kernels/nf4_moe.py's layout; each is a weight's K), at most
    the kernel's pairs (T x top_k) and experts in one launch."""
    hidden, inter = gate_up.shape[1], down.shape[1]
    warps = launch[0] if launch is not None else min(w for w, _ in EXPERT_LAUNCHES)
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == hidden and x.stride(1) == 1
            and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 and hidden % 64 == 0 and inter % 64 == 0
            and tiles_supported(x.device.index, warps)
            and x.shape[0] * top_k <= extension().nf4_expert_max_pairs()
            and gate_up.shape[0] // (2 * inter) <= extension().nf4_expert_max_experts()
            and gate_up.shape[0] % (2 * inter) == 0
            and down.shape[0] % hidden == 0 and _weight_fits(gate_up, x.device, hidden)
            and _weight_fits(down, x.device, inter))


def experts(x: torch.Tensor, experts_idx: torch.Tensor, weights: torch.Tensor, gate_up, down,
            launch: tuple[int, int], sms: int, pdl: bool = False) -> torch.Tensor:
    """The experts' two stages on tiles (`experts_fit` must hold): x [T, H] -> the (token, expert)
    pairs' float32 partials [T k, H], each weighted by the router, for moe's `_sum_pairs` (or
    `fused_ops.layer_out(..., pairs=k)`) to add (kernels/nf4_moe.py). `launch`: (warps per block,
    blocks per SM)."""
    warps, per_sm = launch
    T, k = experts_idx.shape
    inter, hidden = down.shape[1], x.shape[1]
    idx = experts_idx.to(torch.int32).contiguous().view(-1)
    act = torch.empty((T * k, inter), dtype=x.dtype, device=x.device)
    part = torch.empty((T * k, hidden), dtype=torch.float32, device=x.device)
    ext = extension()
    ext.nf4_experts_gate_up(x, idx, gate_up.packed, gate_up.scales, gate_up.code, act, k, warps, per_sm * sms, pdl)
    ext.nf4_experts_down(act, idx, weights.float().contiguous().view(-1), down.packed, down.scales, down.code, part,
                         warps, per_sm * sms, pdl)
    return part
