"""Weight-only int8 linears for the CPU decode path (`quantization="int8"`).

A CPU decode step reads every weight once, so its time follows the bytes of the weights: the
embedded model is ~1 GB in float32 (two thirds of it the tied 262k-vocabulary output layer).
Storing linear weights as int8 with one float32 scale per output row reads a quarter of that.
Activations, accumulation, norms, attention and the residual stream stay float32.

The matmul is a small C kernel (kernels/q8_matmul.c, AVX2 + FMA, OpenMP) compiled on first use
into the cache directory and loaded with ctypes; torch's own int8 CPU kernel takes bfloat16
activations only and slows down sharply with several rows. Every row's result is bitwise the same
whatever else shares the batch. Large row counts (prefill chunks) are compute-bound rather than
bandwidth-bound; for those the weights are widened to float32 for one BLAS matmul.

Quantization replaces `nn.Linear` modules by `Int8Linear` modules (module substitution, as
bitsandbytes does); the model's own forward code is untouched. The input embedding keeps its
float32 table (a lookup reads one row per token); the output layer gets its own int8 copy.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

KERNEL_SOURCE = Path(__file__).parents[1] / "kernels" / "q8_matmul.c"
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
# Rows at or above which a matmul widens the weights and uses BLAS instead (prefill chunks), for
# weights small enough that widening them costs little next to the matmul (not the output layer).
BLAS_MIN_ROWS = 48
BLAS_MAX_WEIGHTS = 1 << 24


class KernelUnavailable(RuntimeError):
    pass


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


class Q8Kernel:
    """The compiled int8 matmul. One instance per engine; modules hold a reference to it."""

    def __init__(self, cache_dir: Path) -> None:
        missing = {"avx2", "fma"} - _cpu_flags()
        if missing:
            raise KernelUnavailable(f"int8 CPU kernel needs {sorted(missing)} (not reported by this CPU)")
        source = KERNEL_SOURCE.read_bytes()
        tag = hashlib.sha256(source + " ".join(CFLAGS).encode()).hexdigest()[:12]
        lib_path = Path(cache_dir) / "kernels" / f"q8_matmul-{tag}.so"
        if not lib_path.exists():
            self._compile(lib_path)
        lib = ctypes.CDLL(str(lib_path))
        fn = lib.q8_matmul
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3
        fn.restype = None
        self._fn = fn

    @staticmethod
    def _compile(lib_path: Path) -> None:
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        cc = os.environ.get("CC", "cc")
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_path.parent)
        os.close(fd)
        try:
            proc = subprocess.run([cc, *CFLAGS, "-o", tmp, str(KERNEL_SOURCE)], capture_output=True, text=True)
        except FileNotFoundError as e:
            os.unlink(tmp)
            raise KernelUnavailable(f"no C compiler ({cc}) to build the int8 CPU kernel") from e
        if proc.returncode != 0:
            os.unlink(tmp)
            raise KernelUnavailable(f"building the int8 CPU kernel failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, lib_path)  # atomic: concurrent builders never load a half-written file

    def matmul(self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 contiguous, packed = pack_rows(q) for q [N, K] int8, scale [N] float32
        -> x @ (q * scale[:, None]).T, [M, N] float32."""
        m, k = x.shape
        n = scale.shape[0]
        if packed.shape[1] * 8 != k or packed.shape[0] * 8 < n or not x.is_contiguous():
            raise ValueError("q8 matmul: shapes or layout do not match")
        y = torch.empty(m, n, dtype=torch.float32)
        self._fn(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), y.data_ptr(), m, n, k)
        return y


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


@dataclass(frozen=True)
class Int8Weight:
    """An int8 weight as a product reads it: the kernel's packed layout, one float32 scale per
    output row, and, for weights small enough to widen cheaply (not the output layer), a row-major
    copy that large row counts widen for one BLAS matmul. Without a kernel, `widened` holds the
    int8-rounded weight in float32 (the same results at float32 speed)."""

    packed: torch.Tensor  # pack_rows(q): [N8/8, K/8, 8, 8] int8
    scale: torch.Tensor  # [N] float32
    qrows: torch.Tensor | None  # [N, K] int8 row-major, or None
    widened: torch.Tensor | None  # [N, K] float32 where no kernel runs, else None
    kernel: Q8Kernel | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.scale.shape[0], self.packed.shape[1] * 8

    def dequantized(self) -> torch.Tensor:
        q = self.qrows if self.qrows is not None else unpack_rows(self.packed, self.shape[0])
        return q * self.scale[:, None]  # int8 * float32 -> float32 in one pass

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 contiguous -> x @ (q * scale).T, [M, N] float32."""
        if self.widened is not None:
            return x @ self.widened.T
        if self.qrows is not None and x.shape[0] >= BLAS_MIN_ROWS:
            return x @ self.dequantized().T
        return self.kernel.matmul(x, self.packed, self.scale)

    def rows(self, lo: int, hi: int) -> Int8Weight:
        """Output rows lo:hi (multiples of 8 where they fall inside the weight), as views."""
        assert lo % 8 == 0 and (hi % 8 == 0 or hi == self.shape[0])
        cut = (lambda t: None if t is None else t[lo:hi])
        return Int8Weight(self.packed[lo // 8: -(-hi // 8)], self.scale[lo:hi], cut(self.qrows), cut(self.widened),
                          self.kernel)


def fuse_int8(weights: list[Int8Weight]) -> Int8Weight:
    """One weight of the weights' output rows in order (each but the last a multiple of 8 rows, so
    the packed blocks line up). Each output row's product is the same as in its own weight."""
    if any(w.shape[0] % 8 for w in weights[:-1]) or len({w.shape[1] for w in weights}) != 1:
        raise ValueError("int8 weights fuse along whole blocks of 8 rows of one width")
    both = (lambda name: None if any(getattr(w, name) is None for w in weights)
            else torch.cat([getattr(w, name) for w in weights]))
    n = sum(w.shape[0] for w in weights)
    packed = torch.cat([w.packed for w in weights])
    if n <= BLAS_MAX_WEIGHTS // weights[0].shape[1]:
        qrows = both("qrows")
    else:
        qrows = None
    return Int8Weight(packed, torch.cat([w.scale for w in weights]), qrows, both("widened"), weights[0].kernel)


class Int8Linear(nn.Module):
    """y = x @ (qweight * scale).T (+ bias), float32 in and out, on an `Int8Weight` (`weight`)
    over the module's buffers."""

    def __init__(self, linear: nn.Linear, kernel: Q8Kernel | None) -> None:
        super().__init__()
        if linear.in_features % 8:
            raise ValueError("Int8Linear needs in_features divisible by 8")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight)
        self.register_buffer("qweight", pack_rows(q))  # the kernel's layout
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.kernel = kernel
        # row-major int8 beside the packed copy, so widening for BLAS is one pass (small weights only)
        self.qrows = q if q.numel() <= BLAS_MAX_WEIGHTS else None
        self.widened = None
        if kernel is None:
            self.widened = self.weight.dequantized()

    @property
    def weight(self) -> Int8Weight:
        return Int8Weight(self.qweight, self.scale, self.qrows, self.widened, self.kernel)

    def rebind(self, w: Int8Weight) -> None:
        """Hold `w` (same shape: a view of a fused weight's rows) instead of its own tensors."""
        assert w.shape == (self.out_features, self.in_features)
        self.qweight, self.scale, self.qrows, self.widened = w.packed, w.scale, w.qrows, w.widened

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.weight.matmul(x.reshape(-1, self.in_features).float().contiguous())
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row"


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
