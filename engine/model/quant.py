"""Int8 linears for the CPU decode path (`quantization="int8"`).

A CPU decode step reads every weight once, so its time follows the bytes of the weights: the
embedded model is ~1 GB in float32 (two thirds of it the tied 262k-vocabulary output layer).
Storing linear weights as int8 with one float32 scale per output row reads a quarter of that.

The decode matmul is a small C kernel (kernels/q8_matmul.c, OpenMP) compiled on first use into
the cache directory and loaded with ctypes. It quantizes each activation row in blocks of 128
values (64 or 32 where the width asks) with a scale per block, sums int8 x int8 products exactly
in int32 per block, and accumulates the blocks' scaled sums in float32. With the activations in
int8 the products are integer dot products: AVX-512 VNNI where the CPU has it (64 byte products
per instruction), AVX2 otherwise, chosen at load and named in the log. Both give the same integers
and the same float operations, so results are bitwise the same on every CPU, and every row's
result is the same whatever else shares the batch. `reference_matmul` computes the same numbers
with torch (the tests' oracle, and the path where no kernel can be built). Prefill chunks run the
same kernel: with integer dot products it is 1.6-4.7x faster than widening the weights to float32
for BLAS at 64-512 rows, so a prompt's forward and a decode step compute a token alike. Norms,
attention and the residual stream stay float32.

Quantization replaces `nn.Linear` modules by `Int8Linear` modules (module substitution, as
bitsandbytes does); the model's own forward code is untouched. The input embedding keeps its
float32 table (a lookup reads one row per token); the output layer gets its own int8 copy.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.core.config import CPU_KERNELS
from engine.kernels import native
from engine.kernels.native import KernelUnavailable

KERNEL_SOURCE = Path(__file__).parents[1] / "kernels" / "q8_matmul.c"
# the kernel's float operations as written: a product and a sum stay two roundings (the torch
# reference computes them that way), never contracted into one fused multiply-add
CFLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
# the kernel's instruction sets, most capable first, with the CPU flags each needs
ISA_FLAGS = {"avx512-vnni": {"avx512f", "avx512bw", "avx512_vnni", "avx2", "fma"}, "avx2": {"avx2", "fma"}}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def activation_block(k: int) -> int:
    """Activation values per quantization block for an input width k: 128, else 64 or 32."""
    for b in (128, 64, 32):
        if k % b == 0:
            return b
    raise ValueError(f"int8 linears need an input width divisible by 32, got {k}")


class Q8Kernel:
    """The compiled int8 matmul. One instance per engine; modules hold a reference to it.
    `isa`: "auto" takes the most capable form this CPU runs; "avx512-vnni" or "avx2" asks for one."""

    def __init__(self, cache_dir: Path, isa: str = "auto") -> None:
        if isa not in CPU_KERNELS:
            raise ValueError(f"cpu kernel must be one of {CPU_KERNELS}, got {isa!r}")
        flags = _cpu_flags()
        runnable = [name for name, need in ISA_FLAGS.items() if need <= flags]
        if isa == "auto":
            if not runnable:
                raise KernelUnavailable("the int8 CPU kernel needs AVX2 and FMA (not reported by this CPU)")
            isa = runnable[0]
        elif isa not in runnable:
            raise KernelUnavailable(f"the {isa} int8 kernel needs {sorted(ISA_FLAGS[isa] - flags)} "
                                    "(not reported by this CPU)")
        self.isa = isa
        fn = native.load(KERNEL_SOURCE, Path(cache_dir), CFLAGS).q8_matmul
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 5
        fn.restype = ctypes.c_int
        self._fn = fn

    def describe(self) -> str:
        return {"avx512-vnni": "AVX-512 VNNI (int8 dot products, 64 per instruction)",
                "avx2": "AVX2 (int16 multiply-adds)"}[self.isa]

    def matmul(self, x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
        """x [M, K] float32 contiguous -> [M, N] float32, as `reference_matmul` computes it."""
        m, k = x.shape
        n = w.scale.shape[0]
        if w.packed.shape[1] * 8 != k or w.packed.shape[0] * 8 < n or not x.is_contiguous():
            raise ValueError("q8 matmul: shapes or layout do not match")
        y = torch.empty(m, n, dtype=torch.float32)
        if self._fn(x.data_ptr(), w.packed.data_ptr(), w.scale.data_ptr(), w.wsum128.data_ptr(), y.data_ptr(),
                    m, n, k, w.block, 1 if self.isa == "avx512-vnni" else 0):
            raise MemoryError("q8 matmul: no memory for the quantized activations")
        return y


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (xq [M, K/block, block] float32 holding int8 values, sx [M, K/block]):
    per block, sx = amax / 127 and xq = x * (127 / amax) rounded half to even. A block of zeros
    gets scale 0; a block holding inf or NaN a NaN scale (as the kernel does)."""
    m, k = x.shape
    xb = x.reshape(m, k // block, block)
    amax = xb.abs().amax(-1)
    finite = torch.isfinite(xb).all(-1)
    usable = finite & (amax > 0)
    # a true division, as the kernel's (a scalar divided by a tensor is a reciprocal and a product)
    inv = torch.where(usable, torch.full_like(amax, 127.0) / torch.where(usable, amax, 1.0), 0.0)
    xq = torch.where(usable[..., None], torch.round(xb * inv[..., None]), 0.0)
    sx = torch.where(finite, torch.where(usable, amax / 127.0, 0.0), float("nan"))
    return xq, sx


def reference_matmul(x: torch.Tensor, qf: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """The kernel's numbers with torch: x [M, K] float32, qf [N, K] float32 holding the int8
    weights. A block's dot products of int8 values are integers below 2^24, exact in float32 in
    any order; the blocks' scaled sums are accumulated in block order, product then sum."""
    m, k = x.shape
    xq, sx = quantize_activations(x, block)
    dots = torch.einsum("mbk,nbk->bmn", xq, qf.reshape(qf.shape[0], k // block, block))
    acc = torch.zeros(m, qf.shape[0])
    for b in range(k // block):
        acc = acc + dots[b] * sx[:, b, None]
    return scale * acc


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: weight ≈ q * scale[:, None]."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 -> the kernel's layout [N8/8, K/8, 8, 8] (N padded with zero rows to N8)."""
    n, k = q.shape
    n8 = -(-n // 8) * 8
    padded = torch.zeros(n8, k, dtype=torch.int8)
    padded[:n] = q
    return padded.view(n8 // 8, 8, k // 8, 8).permute(0, 2, 1, 3).contiguous()


def unpack_rows(packed: torch.Tensor, n: int) -> torch.Tensor:
    b, kb, _, _ = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(b * 8, kb * 8)[:n]


def block_sums128(q: torch.Tensor, block: int) -> torch.Tensor:
    """128 times each activation block's weight sum per output row, [N8/8, K/block, 8] int32 (rows
    padded as pack_rows pads them): what the VNNI form takes off its sums (q8_matmul.c)."""
    n, k = q.shape
    n8 = -(-n // 8) * 8
    sums = torch.zeros(n8, k // block, dtype=torch.int32)
    sums[:n] = q.reshape(n, k // block, block).sum(-1, dtype=torch.int32) * 128
    return sums.view(n8 // 8, 8, k // block).transpose(1, 2).contiguous()


def quantize_packed(weight: torch.Tensor, block: int, rows: int = 2048) -> tuple[torch.Tensor, ...]:
    """(pack_rows(q), scale, block_sums128(q, block)) of `quantize_rows(weight)`, `rows` output
    rows at a time: each slice's passes stay in the cache, where whole-weight passes over an output
    layer (Gemma's: 262144 x 640 float32, 671 MB) go to memory and back several times (1.7 s
    against 0.8 s on 2 cores)."""
    n, k = weight.shape
    n8 = -(-n // 8) * 8
    packed = torch.empty(n8 // 8, k // 8, 8, 8, dtype=torch.int8)
    scale = torch.empty(n)
    sums = torch.empty(n8 // 8, k // block, 8, dtype=torch.int32)
    for lo in range(0, n, rows):  # rows is a multiple of 8: slices of packed blocks line up
        hi = min(n, lo + rows)
        q, scale_rows = quantize_rows(weight[lo:hi])
        scale[lo:hi] = scale_rows
        packed[lo // 8: -(-hi // 8)] = pack_rows(q)
        sums[lo // 8: -(-hi // 8)] = block_sums128(q, block)
    return packed, scale, sums


@dataclass(frozen=True)
class Int8Weight:
    """An int8 weight as a product reads it: the kernel's packed layout, one float32 scale per
    output row, and the VNNI form's block sums. Without a kernel, `ints` holds the int8 values in
    float32 for `reference_matmul` (the same results at float32 speed)."""

    packed: torch.Tensor  # pack_rows(q): [N8/8, K/8, 8, 8] int8
    scale: torch.Tensor  # [N] float32
    wsum128: torch.Tensor  # block_sums128(q, block): [N8/8, K/block, 8] int32
    block: int  # activation values per quantization block
    ints: torch.Tensor | None  # [N, K] float32 holding the int8 values where no kernel runs, else None
    kernel: Q8Kernel | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.scale.shape[0], self.packed.shape[1] * 8

    def dequantized(self) -> torch.Tensor:
        return unpack_rows(self.packed, self.shape[0]) * self.scale[:, None]  # int8 * float32 -> float32 in one pass

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 contiguous -> [M, N] float32, on the kernel (or its torch reference)."""
        if self.ints is not None:
            return reference_matmul(x, self.ints, self.scale, self.block)
        return self.kernel.matmul(x, self)

    def rows(self, lo: int, hi: int) -> Int8Weight:
        """Output rows lo:hi (multiples of 8 where they fall inside the weight), as views."""
        assert lo % 8 == 0 and (hi % 8 == 0 or hi == self.shape[0])
        cut = (lambda t: None if t is None else t[lo:hi])
        blocks = slice(lo // 8, -(-hi // 8))
        return Int8Weight(self.packed[blocks], self.scale[lo:hi], self.wsum128[blocks], self.block, cut(self.ints),
                          self.kernel)


def fuse_int8(weights: list[Int8Weight]) -> Int8Weight:
    """One weight of the weights' output rows in order (each but the last a multiple of 8 rows, so
    the packed blocks line up). Each output row's product is the same as in its own weight."""
    if any(w.shape[0] % 8 for w in weights[:-1]) or len({w.shape[1] for w in weights}) != 1:
        raise ValueError("int8 weights fuse along whole blocks of 8 rows of one width")
    both = (lambda name: None if any(getattr(w, name) is None for w in weights)
            else torch.cat([getattr(w, name) for w in weights]))
    return Int8Weight(torch.cat([w.packed for w in weights]), torch.cat([w.scale for w in weights]),
                      torch.cat([w.wsum128 for w in weights]), weights[0].block, both("ints"), weights[0].kernel)


class Int8Linear(nn.Module):
    """y = x @ (qweight * scale).T (+ bias) with int8 activations on the kernel (see
    `Int8Weight.matmul`), float32 in and out, on an `Int8Weight` (`weight`) over the module's
    buffers."""

    def __init__(self, linear: nn.Linear, kernel: Q8Kernel | None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.block = activation_block(linear.in_features)
        packed, scale, sums = quantize_packed(linear.weight, self.block)
        self.register_buffer("qweight", packed)  # the kernel's layout
        self.register_buffer("scale", scale)
        self.register_buffer("wsum128", sums)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.kernel = kernel
        self.ints = unpack_rows(packed, self.out_features).float() if kernel is None else None

    @property
    def weight(self) -> Int8Weight:
        return Int8Weight(self.qweight, self.scale, self.wsum128, self.block, self.ints, self.kernel)

    def rebind(self, w: Int8Weight) -> None:
        """Hold `w` (same shape: a view of a fused weight's rows) instead of its own tensors."""
        assert w.shape == (self.out_features, self.in_features)
        self.qweight, self.scale, self.wsum128, self.ints = w.packed, w.scale, w.wsum128, w.ints

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.weight.matmul(x.reshape(-1, self.in_features).float().contiguous())
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row weights, "
                f"int8 activations in blocks of {self.block}")


def quantize_int8(model: nn.Module, kernel: Q8Kernel | None) -> int:
    """Replace the decoder's nn.Linear modules and the output layer with Int8Linear in place.
    Returns the number of modules replaced."""
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("int8 quantization is a CPU path; use bnb-4bit on CUDA")
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, Int8Linear(mod, kernel))
    # the output layer was tied to the input embedding; it is its own (int8) module now
    if getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False
    return len(targets)
