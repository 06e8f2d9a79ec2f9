"""bitsandbytes NF4 weights through the engine's own kernels: one fused dequantize-and-multiply
for decode batches, a dequantize to the compute dtype for prefill chunks.

bitsandbytes stores a 4-bit weight [N, K] as the row-major flattening of its elements in groups
of `GROUP` (64) consecutive values: per group one absolute maximum (float32, or itself quantized
to 8 bits per 256 groups with an offset, "nested"), and per element a 4-bit index into the
16-entry NF4 code table, two to a byte, the earlier element in the high nibble. It dequantizes
an element as `code[index] * absmax` in float32, rounded once to the compute dtype.

`NF4Weight` is that weight as the kernels read it, made once at load (`from_bnb`): bnb's packed
bytes viewed as [N, K / 2] uint8 (a row's groups are whole when K is a multiple of 64, the only
case taken), the groups' absmax decoded once to float32 [N, K / 64] (bnb's own decoding of the
nested form, so the values are its values), and the code table. Rows of several projections
with one input are concatenated (`fuse`), as the bf16 forward fuses Q/K/V and gate/up.

`nf4_matmul` (x [M, K] @ W^T): each program owns `block_n` output columns and a `k_per` slice
of K (split-K where there are too few columns to cover the GPU: float32 partials per split, then
one kernel sums them in a fixed order; no atomics) and streams its weight once for all its rows,
whole groups per step, with Triton's pipeliner keeping the next steps' loads in flight:
  - the code lookup is a warp shuffle (`SHFL`): each lane holds code[lane % 16] and each nibble,
    shifted down, names the source lane; no address arithmetic or load per element (the
    interpreter, which has no inline assembly, loads from the table instead);
  - one row of x per program (`block_m` 1, `_nf4_gemv_kernel`; decode steps of one or two
    tokens): a step is a
    [block_n, G, 32] tile of bytes (G whole groups); 16-bit activations are read as one 32-bit
    word per (even, odd) column pair, against a byte's high and low nibbles, so the packed bytes
    are never reordered; FMAs of x with the code values, each thread's part of a group summed,
    then times the group's absmax once, reduced over the columns at the end. That is the product
    of the exact weights (code x absmax), within a rounding of bnb's, which rounds each weight to
    the compute dtype first;
  - tiles of 16 to 64 rows (`_nf4_dot_kernel`): a step's weight tile decoded as bnb decodes it (code x
    absmax, rounded to the compute dtype) in column order, [block_n, block_k], and multiplied on
    tensor cores (`tl.dot`) with a plain [block_m, block_k] tile of x, or (`swap`) as W x^T, the
    decoded tile the left operand, which suits tiles of few rows. With `permute` a tile's codes
    are instead looked up by byte permutes on the integer pipe (`_PRMT_CODES`: no shuffle, no
    memory), rounded to the activations' 16-bit type, and each group is multiplied as codes and
    scaled by its absmax after its product; faster than the shuffle in tiles of 16 rows;
  - up to 8 or 16 rows (`_nf4_mma_kernel`): the codes looked up by byte permutes straight into
    the A fragments of mma.sync products (16 weight rows, two per lane, in the layout Triton
    gives the packed words' loads), x's rows the B operand, so no tile goes through shared
    memory; each group's four products scaled by its absmax after them. The fastest at 2 to 16
    rows; slower than the one-row kernel at one;
`nf4_plan.plan_nf4` times a few launches per row count on a model's own weights and keeps the
fastest of those that agree with the library's product on the dequantized weight (`launch_for`
is a fixed rule where there is no plan); from 128 rows it also weighs that library product.
`dequantize` writes the whole weight in the compute dtype, bit for bit bnb's (prefill chunks).

Without Triton, or off CUDA (tests), `dequantize_ref` and `F.linear` compute the same function.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels import nf4_cuda
from engine.kernels.fused_ops import gelu_mul
from engine.kernels.launch import kernel_args

try:
    import triton
    import triton.language as tl

    from engine.kernels.launch import pdl_enter
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None

GROUP = 64  # elements per absmax group: the bitsandbytes blocksize taken
MAX_KERNEL_ROWS = 256  # more rows (prefill chunks) dequantize the weight and run the library product


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.device.type == "cuda"


@dataclass(frozen=True)
class NF4Weight:
    """A [N, K] NF4 weight: packed [N, K / 2] uint8 (element 2j of a row in byte j's high nibble,
    2j + 1 in its low nibble), scales [N, K / 64] float32 (each group's absmax), code [16]
    float32 (the NF4 table), dtype: the compute dtype its products and dequantization give."""

    packed: torch.Tensor
    scales: torch.Tensor
    code: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], 2 * self.packed.shape[1]

    @property
    def device(self) -> torch.device:
        return self.packed.device


def refusal(weight) -> str | None:
    """Why a bitsandbytes `Params4bit` cannot become an `NF4Weight` (None: it can)."""
    qs = getattr(weight, "quant_state", None)
    if qs is None:
        return "not quantized"
    if qs.quant_type != "nf4":
        return f"quant_type {qs.quant_type!r} (NF4 only)"
    if qs.blocksize != GROUP:
        return f"blocksize {qs.blocksize} (64 only)"
    if len(qs.shape) != 2 or qs.shape[1] % GROUP:
        return f"shape {tuple(qs.shape)}: rows that are not whole groups of 64"
    if qs.code.numel() != 16:
        return "a code table of other than 16 entries"
    return None


@torch.no_grad()
def from_bnb(weight) -> NF4Weight:
    """The kernels' view of a quantized bitsandbytes `Params4bit`: its packed bytes (the same
    memory), its groups' absmax decoded to float32 as bnb's dequantize decodes them, its code."""
    why = refusal(weight)
    if why is not None:
        raise ValueError(f"NF4 kernels cannot take this weight: {why}")
    qs = weight.quant_state
    n, k = qs.shape
    packed = weight.data.reshape(-1).view(torch.uint8)  # any quant_storage dtype holds the same bytes
    if packed.numel() != n * k // 2:
        raise ValueError(f"packed weight of {packed.numel()} bytes for shape {(n, k)}")
    absmax = qs.absmax
    if qs.nested:
        from bitsandbytes.functional import dequantize_blockwise

        absmax = dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
    scales = absmax.float().reshape(n, k // GROUP).contiguous()
    code = qs.code.to(device=packed.device, dtype=torch.float32).contiguous()
    return NF4Weight(packed.view(n, k // 2), scales, code, qs.dtype)


def fuse(weights: list[NF4Weight]) -> NF4Weight:
    """One weight whose rows are those of `weights` in order (same K, code and dtype)."""
    w0 = weights[0]
    for w in weights[1:]:
        if w.shape[1] != w0.shape[1] or w.dtype != w0.dtype or not torch.equal(w.code, w0.code):
            raise ValueError("only NF4 weights of one input width, dtype and code table fuse")
    return NF4Weight(torch.cat([w.packed for w in weights]), torch.cat([w.scales for w in weights]), w0.code,
                     w0.dtype)


def dequantize_ref(w: NF4Weight) -> torch.Tensor:
    """The weight [N, K] in its compute dtype, in torch ops: code[index] * absmax in float32,
    rounded once."""
    n, k = w.shape
    idx = torch.stack([w.packed >> 4, w.packed & 15], dim=-1).reshape(n, k).long()
    vals = w.code[idx].view(n, k // GROUP, GROUP) * w.scales[..., None]
    return vals.reshape(n, k).to(w.dtype)


if triton is not None:

    # The code lookup by warp shuffle: every lane loads code[lane % 16] once per call, and each
    # nibble is the source lane of a shuffle of that register (shfl.sync.idx reads bits 4:0 of
    # the index; both half-warps hold the table, so a nibble shifted down with whatever bits lie
    # above it names a lane holding code[nibble]). Four bytes per call (pack=4): 8 lookups for 4
    # loads' worth of setup, no address arithmetic per element. Outputs: the high nibbles' codes,
    # then the low nibbles', as float32 bit patterns.
    _SHFL_CODES = tl.constexpr("""
    {
    .reg .b32 lane, a, t;
    .reg .b64 addr;
    mov.u32 lane, %laneid;
    and.b32 lane, lane, 15;
    mad.wide.u32 addr, lane, 4, $9;
    ld.global.nc.b32 a, [addr];
    shr.b32 t, $8, 4;
    shfl.sync.idx.b32 $0, a, t, 0x1f, 0xffffffff;
    shr.b32 t, $8, 12;
    shfl.sync.idx.b32 $1, a, t, 0x1f, 0xffffffff;
    shr.b32 t, $8, 20;
    shfl.sync.idx.b32 $2, a, t, 0x1f, 0xffffffff;
    shr.b32 t, $8, 28;
    shfl.sync.idx.b32 $3, a, t, 0x1f, 0xffffffff;
    shfl.sync.idx.b32 $4, a, $8, 0x1f, 0xffffffff;
    shr.b32 t, $8, 8;
    shfl.sync.idx.b32 $5, a, t, 0x1f, 0xffffffff;
    shr.b32 t, $8, 16;
    shfl.sync.idx.b32 $6, a, t, 0x1f, 0xffffffff;
    shr.b32 t, $8, 24;
    shfl.sync.idx.b32 $7, a, t, 0x1f, 0xffffffff;
    }
    """)

    @triton.jit
    def _codes(p, C, SHFL: tl.constexpr):
        """The NF4 code values (float32) of the high and low nibbles of the bytes p: by warp
        shuffle (SHFL, CUDA) or by a load from the table (any device, Triton's interpreter)."""
        if SHFL:
            table = C + tl.zeros(p.shape, tl.int32)
            hi, lo = tl.inline_asm_elementwise(_SHFL_CODES, "=r,=r,=r,=r,=r,=r,=r,=r,r,l,l,l,l", [p, table],
                                               dtype=(tl.int32, tl.int32), is_pure=True, pack=4)
            return hi.to(tl.float32, bitcast=True), lo.to(tl.float32, bitcast=True)
        else:
            return tl.load(C + (p >> 4).to(tl.int32)), tl.load(C + (p & 15).to(tl.int32))

    # The code lookup by byte permutes on the integer pipe (no shuffle, no memory): the 16 codes,
    # rounded to the activations' 16-bit type, as two 16-byte tables (their low bytes $5-$17,
    # their high bytes $21-$33, each four words of four entries). A packed word's low 16 bits
    # hold the nibbles of columns 1, 0, 3, 2 (a byte's high nibble is its even column), which is
    # the selector layout of prmt: the nibbles with bit 3 cleared pick an entry from entries 0-7
    # and from 8-15, bit 3 picks between the two, and two more permutes pair each column's low
    # and high byte, columns (0, 1) and (2, 3) as the two 16-bit halves of a word. The high
    # 16 bits give columns 4-7 the same way. Outputs: columns 0-3 ($0, $1), then 4-7 ($2, $3).
    def _prmt_lookup(s: str, m: str, col01: str, col23: str, first_table: int, pack: int) -> str:
        """PTX for the codes of the four columns whose selectors are the low 16 bits of `s` (the
        nibbles, bit 3 cleared) and `m` (each nibble's bit 3 as the pick between the two
        permutes' results), columns (0, 1) into `col01`, (2, 3) into `col23`; the eight table
        words are the operands from $`first_table`, `pack` apart (each a tensor operand)."""
        t = [f"${first_table + pack * i}" for i in range(8)]
        return f"""
    prmt.b32 a, {t[0]}, {t[1]}, {s};
    prmt.b32 b, {t[2]}, {t[3]}, {s};
    prmt.b32 lo, a, b, {m};
    prmt.b32 a, {t[4]}, {t[5]}, {s};
    prmt.b32 b, {t[6]}, {t[7]}, {s};
    prmt.b32 hi, a, b, {m};
    prmt.b32 {col01}, lo, hi, 0x4051;
    prmt.b32 {col23}, lo, hi, 0x6273;"""

    def _prmt_half(word: str, col01: str, col23: str) -> str:
        """PTX for the codes of the four columns whose nibbles are the low 16 bits of `word`,
        columns (0, 1) into `col01`, (2, 3) into `col23`."""
        return f"""
    and.b32 s, {word}, 0x7777;
    shr.b32 m, {word}, 1;
    and.b32 m, m, 0x4444;
    or.b32 m, m, 0x3210;""" + _prmt_lookup("s", "m", col01, col23, first_table=5, pack=4)

    _PRMT_CODES = tl.constexpr("""
    {
    .reg .b32 s, m, q, a, b, lo, hi;""" + _prmt_half("$4", "$0", "$1") + """
    shr.b32 q, $4, 16;""" + _prmt_half("q", "$2", "$3") + """
    }
    """)

    # One lane's part of a group of 64 columns of two weight rows as four mma.sync.m16n8k16
    # products, the weight's codes the A operand (rows: 16 weight rows, two per lane) and x the B
    # operand (columns: 8 rows of x), so the codes go from the packed bytes to the A fragments in
    # registers, looked up by byte permutes, never through shared memory or a layout conversion.
    # A lane (row r of an 8-row block, quarter t of the group) holds the packed bytes of weight
    # rows r and r + 8W (W: the warps), columns 16t..16t+15 of the group, as four 16-bit words
    # each ($8, $9: row r, word 2i in the low half of operand i; $10, $11: row r + 8W). Word j's
    # nibbles (columns 16t + 4j + 0..3) are the fragment's k slots 2t, 2t+1, 2t+8, 2t+9 of
    # product j, and the B fragment is x at the same columns, of x's row r % 8 ($12: 16 bytes per
    # two products; $20: row r % 8 + 8). Products chain in accumulators: row r against x rows 2t,
    # 2t+1 into $0, $1, row r + 8W into $4, $5; against x rows 8 + 2t, 8 + 2t + 1 (rows16) into
    # $2, $3, $6, $7, else those are zero.
    _MMA_TABLE = 28  # the first table operand; each table tensor is 8 operands (pack)

    def _prmt_selectors(reg: str, s: str, m: str) -> str:
        """PTX for the permute lookup's selectors of both 16-bit words of `reg` at once: `s` the
        nibbles with bit 3 cleared, `m` each nibble's bit 3 as the pick between the two tables'
        permutes (the low word's in the low 16 bits, where prmt reads its selector)."""
        return f"""
    and.b32 {s}, {reg}, 0x77777777;
    shr.b32 {m}, {reg}, 1;
    lop3.b32 {m}, {m}, 0x44444444, 0x32103210, 0xEA;"""

    def _mma_group(ab: str, rows16: bool) -> str:
        mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32"
        lines = ["""
    {
    .reg .b32 s0, m0, s1, m1, s, m, a, b, lo, hi, a0, a1, a2, a3;
    .reg .b32 x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7;
    .reg .f32 fz, d0, d1, d2, d3, e0, e1, e2, e3;
    mov.f32 fz, 0f00000000;
    ld.global.nc.v4.b32 {x0, x1, x2, x3}, [$12];
    ld.global.nc.v4.b32 {x4, x5, x6, x7}, [$12+16];"""]
        if rows16:
            lines.append("""
    ld.global.nc.v4.b32 {y0, y1, y2, y3}, [$20];
    ld.global.nc.v4.b32 {y4, y5, y6, y7}, [$20+16];""")
        for j in range(4):
            for slot, (col01, col23) in enumerate((("a0", "a2"), ("a1", "a3"))):
                reg = f"${8 + 2 * slot + j // 2}"
                s, m = f"s{slot}", f"m{slot}"
                if j % 2 == 0:
                    lines.append(_prmt_selectors(reg, s, m))
                    lines.append(_prmt_lookup(s, m, col01, col23, _MMA_TABLE, 8))
                else:
                    lines.append(f"""
    shr.b32 s, {s}, 16;
    shr.b32 m, {m}, 16;""")
                    lines.append(_prmt_lookup("s", "m", col01, col23, _MMA_TABLE, 8))
            c = "{fz, fz, fz, fz}" if j == 0 else "{d0, d1, d2, d3}"
            lines.append(f"""
    {mma} {{d0, d1, d2, d3}}, {{a0, a1, a2, a3}}, {{x{2 * j}, x{2 * j + 1}}}, {c};""")
            if rows16:
                c = "{fz, fz, fz, fz}" if j == 0 else "{e0, e1, e2, e3}"
                lines.append(f"""
    {mma} {{e0, e1, e2, e3}}, {{a0, a1, a2, a3}}, {{y{2 * j}, y{2 * j + 1}}}, {c};""")
        high = ("e0", "e1", "e2", "e3") if rows16 else ("fz",) * 4
        lines.append(f"""
    mov.f32 $0, d0;
    mov.f32 $1, d1;
    mov.f32 $2, {high[0]};
    mov.f32 $3, {high[1]};
    mov.f32 $4, d2;
    mov.f32 $5, d3;
    mov.f32 $6, {high[2]};
    mov.f32 $7, {high[3]};
    }}
    """)
        return "".join(lines)

    _MMA_BF16 = tl.constexpr(_mma_group("bf16", False))
    _MMA_BF16_ROWS16 = tl.constexpr(_mma_group("bf16", True))
    _MMA_F16 = tl.constexpr(_mma_group("f16", False))
    _MMA_F16_ROWS16 = tl.constexpr(_mma_group("f16", True))
    _MMA_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 8 + ["r"] * 4 + ["l"] * 16 + ["r"] * 64))

    _PRMT_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,r," + ",".join(["r"] * 32))

    @triton.jit
    def _code_tables(C, X):
        """The 16 codes rounded to X's element type (16 bits) as the permute lookup's eight table
        words: the low bytes of codes 4w..4w+3 (w = 0-3), then their high bytes, entry 4w in the
        lowest byte."""
        ci = tl.arange(0, 16)
        bits = tl.load(C + ci).to(X.dtype.element_ty).to(tl.int16, bitcast=True).to(tl.int32) & 65535
        shift = 8 * (ci % 4)
        lo = (bits & 255) << shift
        hi = (bits >> 8) << shift
        w = ci // 4
        return (tl.sum(tl.where(w == 0, lo, 0), axis=0), tl.sum(tl.where(w == 1, lo, 0), axis=0),
                tl.sum(tl.where(w == 2, lo, 0), axis=0), tl.sum(tl.where(w == 3, lo, 0), axis=0),
                tl.sum(tl.where(w == 0, hi, 0), axis=0), tl.sum(tl.where(w == 1, hi, 0), axis=0),
                tl.sum(tl.where(w == 2, hi, 0), axis=0), tl.sum(tl.where(w == 3, hi, 0), axis=0))

    @triton.jit
    def _permute_codes(P, C, X, row, nm, kg, k_hi, stride_p, t0, t1, t2, t3, t4, t5, t6, t7,
                       ASM: tl.constexpr, EVEN: tl.constexpr):
        """A group of 64 columns from kg of weight rows `row` as codes in X's element type (16
        bits), two [BLOCK_N, 32] halves: A holds columns 8q + r and B columns 8q + 4 + r at
        position 4q + r (q 0-7, r 0-3), the order the permute lookup yields them in; zero past
        k_hi and past the last row. ASM: by byte permutes of the packed bytes (CUDA), else codes
        loaded per column."""
        j = tl.arange(0, 32)
        if EVEN:
            ok = nm[:, None]
        else:
            ok = nm[:, None] & ((row * 0 + kg) < k_hi)[:, None]
        base = P + row[:, None] * stride_p + tl.multiple_of(kg // 2, 32)
        if ASM:
            p = tl.load(base + j[None, :], mask=ok, other=0)
            z = tl.zeros(p.shape, tl.int32)
            a, b = tl.inline_asm_elementwise(
                _PRMT_CODES, _PRMT_CONSTRAINTS,
                [p, z + t0, z + t1, z + t2, z + t3, z + t4, z + t5, z + t6, z + t7],
                dtype=(X.dtype.element_ty, X.dtype.element_ty),
                is_pure=True, pack=4)
            return a, b
        else:
            col_a = 8 * (j // 4) + j % 4
            pa = tl.load(base + (col_a // 2)[None, :], mask=ok, other=0).to(tl.int32)
            pb = tl.load(base + (col_a // 2 + 2)[None, :], mask=ok, other=0).to(tl.int32)
            even = (j % 2 == 0)[None, :]
            na = tl.where(even, pa >> 4, pa & 15)
            nb = tl.where(even, pb >> 4, pb & 15)
            a = tl.where(ok, tl.load(C + na), 0.0).to(X.dtype.element_ty)
            b = tl.where(ok, tl.load(C + nb), 0.0).to(X.dtype.element_ty)
            return a, b

    @triton.jit
    def _nf4_group(P, S, C, rn, nm, kg, k_hi, stride_p, stride_s, SHFL: tl.constexpr, EVEN: tl.constexpr = False):
        """The group of 64 columns from kg of weight rows rn: the code values of its even and odd
        columns ([BLOCK_N, 32] float32 each) and the rows' absmax ([BLOCK_N, 1]); zero past k_hi
        (EVEN: the caller knows kg < k_hi) and past the last row."""
        if EVEN:
            ok = nm
        else:
            ok = nm & ((rn * 0 + kg) < k_hi)
        row = rn.to(tl.int64)
        byte = tl.multiple_of(kg // 2, 32)  # groups start at multiples of 64 columns: whole 16-byte vectors
        p = tl.load(P + row[:, None] * stride_p + (byte + tl.arange(0, 32))[None, :], mask=ok[:, None], other=0)
        s = tl.load(S + row * stride_s + kg // 64, mask=ok, other=0.0)[:, None]
        hi, lo = _codes(p, C, SHFL)
        return hi, lo, s

    @triton.jit
    def _gemv_tile(P, S, rn, nm, g, j, kg, k_hi, stride_p, stride_s, EVEN: tl.constexpr):
        """Rows rn's bytes of the groups from kg, [BLOCK_N, G, 32], and their absmax [BLOCK_N, G];
        zero past k_hi (EVEN: the caller knows the tile lies below it) and past the last row."""
        row = rn.to(tl.int64)
        if EVEN:
            ok = nm[:, None] & (g >= 0)[None, :]
        else:
            ok = nm[:, None] & ((kg + 64 * g) < k_hi)[None, :]
        byte = tl.multiple_of(kg // 2, 32)
        p = tl.load(P + row[:, None, None] * stride_p + (byte + 32 * g[None, :, None] + j[None, None, :]),
                    mask=ok[:, :, None], other=0)
        s = tl.load(S + row[:, None] * stride_s + (kg // 64 + g[None, :]), mask=ok, other=0.0)
        return p, s

    @triton.jit
    def _x_tile(xr, g, j, kg, k_hi, X16: tl.constexpr, BF16: tl.constexpr, EVEN: tl.constexpr):
        """One row's even and odd columns of the groups from kg as float32 [G, 32] each: 16-bit
        activations (X16) read as one 32-bit word per (even, odd) pair and split in registers,
        others read at stride 2 (EVEN: the groups lie below k_hi)."""
        col = kg + 64 * g[:, None] + 2 * j[None, :]
        ok = col < k_hi
        if X16:
            if EVEN:
                w = tl.load(xr.to(tl.pointer_type(tl.int32)) + col // 2)
            else:
                w = tl.load(xr.to(tl.pointer_type(tl.int32)) + col // 2, mask=ok, other=0)
            if BF16:  # a bfloat16 is the upper half of its float32
                return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)
            else:
                even = (w & 65535).to(tl.int16).to(tl.float16, bitcast=True)
                odd = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True)
                return even.to(tl.float32), odd.to(tl.float32)
        elif EVEN:
            return tl.load(xr + col).to(tl.float32), tl.load(xr + col + 1).to(tl.float32)
        else:
            even = tl.load(xr + col, mask=ok, other=0.0)
            odd = tl.load(xr + col + 1, mask=ok, other=0.0)
            return even.to(tl.float32), odd.to(tl.float32)

    @triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count
    def _nf4_gemv_kernel(X, P, S, C, Y, M, N, K, stride_xm, stride_p, stride_s, k_per,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr, SHFL: tl.constexpr,
                         X16: tl.constexpr, BF16: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr,
                         GDC: tl.constexpr = False):
        """One row of x per program (pid 2) against BLOCK_N weight rows over a K slice, in tiles of
        G = BLOCK_K / 64 whole groups ([BLOCK_N, G, 32] bytes) with STAGES tiles in flight
        (Triton's pipeliner): each thread sums its part of a group's products first and scales
        the sum by the group's absmax once. EVEN: every K slice is whole BLOCK_K steps."""
        G: tl.constexpr = BLOCK_K // 64
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = rn < N
        g = tl.arange(0, G)
        j = tl.arange(0, 32)
        k_lo = pid_k * k_per
        k_hi = tl.minimum(k_lo + k_per, K)
        pdl_enter(GDC)
        xr = X + pid_m.to(tl.int64) * stride_xm
        acc = tl.zeros([BLOCK_N, G], tl.float32)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            p, s = _gemv_tile(P, S, rn, nm, g, j, k0, k_hi, stride_p, stride_s, EVEN)
            hi, lo = _codes(p, C, SHFL)
            xe, xo = _x_tile(xr, g, j, k0, k_hi, X16, BF16, EVEN)
            acc += (tl.sum(hi * xe[None, :, :], axis=2) + tl.sum(lo * xo[None, :, :], axis=2)) * s
        y = tl.sum(acc, axis=1)
        out = Y + (pid_k * M + pid_m).to(tl.int64) * N + rn
        if PARTIAL:  # float32 partials of this K slice, summed by _sum_splits_kernel
            tl.store(out, y, mask=nm)
        else:
            tl.store(out, y.to(Y.dtype.element_ty), mask=nm)

    @triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count
    def _nf4_dot_kernel(X, P, S, C, Y, M, N, K, stride_xm, stride_p, stride_s, k_per,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PARTIAL: tl.constexpr, IEEE: tl.constexpr, SHFL: tl.constexpr, SWAP: tl.constexpr,
                        EVEN: tl.constexpr, PERMUTE: tl.constexpr = False, GDC: tl.constexpr = False):
        """Tiles of BLOCK_M rows on tensor cores, one product per BLOCK_K step: the step's weight
        tile decoded as bnb decodes it (code x absmax, rounded) in column order ([BLOCK_N,
        BLOCK_K]) against a plain [BLOCK_M, BLOCK_K] tile of x. SWAP: computed as W x^T (the weight
        tile the left operand)."""
        G: tl.constexpr = BLOCK_K // 64
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        nm = rn < N
        mm = rm < M
        k_lo = pid_k * k_per
        k_hi = tl.minimum(k_lo + k_per, K)
        pdl_enter(GDC)
        row = rn.to(tl.int64)
        kb = tl.arange(0, BLOCK_K // 2)
        kk = tl.arange(0, BLOCK_K)
        g = tl.arange(0, G)
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if PERMUTE:  # codes by byte permutes, two products per group, scaled by its absmax after
            t0, t1, t2, t3, t4, t5, t6, t7 = _code_tables(C, X)
            j32 = tl.arange(0, 32)
            col_a = 8 * (j32 // 4) + j32 % 4
            for k0 in range(k_lo, k_hi, BLOCK_K):
                for gi in tl.static_range(G):
                    kg = k0 + 64 * gi
                    if EVEN:
                        sm = nm
                        xm = mm[:, None]
                    else:
                        sm = nm & ((rn * 0 + kg) < k_hi)
                        xm = mm[:, None] & ((rm * 0 + kg) < k_hi)[:, None]
                    a, b = _permute_codes(P, C, X, row, nm, kg, k_hi, stride_p, t0, t1, t2, t3, t4, t5, t6, t7,
                                          SHFL, EVEN)
                    s = tl.load(S + row * stride_s + kg // 64, mask=sm, other=0.0)
                    xr = X + rm[:, None].to(tl.int64) * stride_xm + kg
                    xa = tl.load(xr + col_a[None, :], mask=xm, other=0.0)
                    xb = tl.load(xr + (col_a + 4)[None, :], mask=xm, other=0.0)
                    if SWAP:
                        acc += (tl.dot(a, tl.trans(xa)) + tl.dot(b, tl.trans(xb))) * s[:, None]
                    else:
                        acc += (tl.dot(xa, tl.trans(a)) + tl.dot(xb, tl.trans(b))) * s[None, :]
        else:
            for k0 in range(k_lo, k_hi, BLOCK_K):
                if EVEN:
                    wm = nm[:, None]
                    sm = nm[:, None]
                    xm = mm[:, None]
                else:
                    wm = nm[:, None] & ((k0 + 2 * kb) < k_hi)[None, :]
                    sm = nm[:, None] & ((k0 + 64 * g) < k_hi)[None, :]
                    xm = mm[:, None] & ((k0 + kk) < k_hi)[None, :]
                p = tl.load(P + row[:, None] * stride_p + (tl.multiple_of(k0 // 2, 32) + kb)[None, :], mask=wm, other=0)
                s = tl.load(S + row[:, None] * stride_s + (k0 // 64 + g)[None, :], mask=sm, other=0.0)
                x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + (k0 + kk)[None, :], mask=xm, other=0.0)
                hi, lo = _codes(p, C, SHFL)
                w = tl.reshape(tl.join(hi, lo), [BLOCK_N, G, 64]) * s[:, :, None]
                w = tl.reshape(w, [BLOCK_N, BLOCK_K]).to(X.dtype.element_ty)
                if SWAP:
                    if IEEE:
                        acc += tl.dot(w, tl.trans(x), input_precision="ieee")
                    else:
                        acc += tl.dot(w, tl.trans(x))
                else:
                    if IEEE:
                        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
                    else:
                        acc += tl.dot(x, tl.trans(w))
        if SWAP:
            out = Y + (pid_k * M + rm[None, :]).to(tl.int64) * N + rn[:, None]
            ok = nm[:, None] & mm[None, :]
        else:
            out = Y + (pid_k * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
            ok = mm[:, None] & nm[None, :]
        if PARTIAL:
            tl.store(out, acc, mask=ok)
        else:
            tl.store(out, acc.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _mma_asm(ASM: tl.constexpr, w, xa, xb, t0, t1, t2, t3, t4, t5, t6, t7):
        z = tl.zeros(w.shape, tl.int32)
        return tl.inline_asm_elementwise(ASM, _MMA_CONSTRAINTS,
                                         [w, xa, xb, z + t0, z + t1, z + t2, z + t3, z + t4, z + t5, z + t6, z + t7],
                                         dtype=tl.float32, is_pure=True, pack=8)

    @triton.jit
    def _mma_part(P16, X, C, row, x_row, x_hi, out_x, kg, k_ok, K, stride_p16, stride_xm,
                  t0, t1, t2, t3, t4, t5, t6, t7, ROWS16: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr):
        """One group's products [BLOCK_N, 16]: element (r, 4t + j) is weight row r against x's
        row out_x (r, 4t + j) over the 64 columns from kg (see _mma_group; x_row: the row of x
        whose B fragment lane r loads, x_hi for x rows 8-15 of the fragment). ASM:
        mma.sync on the fragments (CUDA), else each element's sum of products from loaded codes
        (Triton's interpreter)."""
        i = tl.arange(0, 16)[None, :]
        kx = tl.minimum(kg, K - 64)  # a group past this slice reads a valid one; its absmax is zero
        w = tl.load(P16 + row[:, None] * stride_p16 + (kx // 4 + 4 * (i // 4) + i % 4), mask=k_ok, other=0)
        if ASM:
            xa = X + x_row[:, None] * stride_xm + (kx + 16 * (i // 4))
            xb = X + x_hi[:, None] * stride_xm + (kx + 16 * (i // 4))
            if BF16:
                if ROWS16:
                    return _mma_asm(_MMA_BF16_ROWS16, w, xa, xb, t0, t1, t2, t3, t4, t5, t6, t7)
                else:
                    return _mma_asm(_MMA_BF16, w, xa, xb, t0, t1, t2, t3, t4, t5, t6, t7)
            elif ROWS16:
                return _mma_asm(_MMA_F16_ROWS16, w, xa, xb, t0, t1, t2, t3, t4, t5, t6, t7)
            else:
                return _mma_asm(_MMA_F16, w, xa, xb, t0, t1, t2, t3, t4, t5, t6, t7)
        else:
            kk = tl.arange(0, 64)[None, None, :]
            byte = tl.load(P16.to(tl.pointer_type(tl.uint8)) + row[:, None, None] * (2 * stride_p16) + (kx + kk) // 2)
            nib = tl.where(kk % 2 == 0, byte >> 4, byte & 15).to(tl.int32)
            code = tl.load(C + nib).to(X.dtype.element_ty).to(tl.float32)  # [BLOCK_N, 1, 64]
            xv = tl.load(X + out_x[:, :, None] * stride_xm + kx + kk).to(tl.float32)
            return tl.sum(code * xv, axis=2)

    @triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count
    def _nf4_mma_kernel(X, P, S, C, Y, M, N, K, stride_xm, stride_p, stride_s, k_per,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr, ROWS16: tl.constexpr,
                        BF16: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr,
                        STAGES: tl.constexpr, GDC: tl.constexpr = False):
        """Up to 16 rows of x per program (pid 2; 8 without ROWS16) against BLOCK_N weight rows
        over a K slice, one mma.sync per 16 columns and 16 weight rows with the codes as the A
        operand and x as the B operand (_mma_group), each group's four products scaled by its
        absmax after them. Tensors are [BLOCK_N, 16]: weight row, then quarter t and word j of
        the group's row (4t + j), which is the layout Triton gives the packed words' 8-byte loads
        (a lane per (row, quarter), 8 rows a warp, a second row 8 warps' rows further on), so each
        lane holds the fragments _mma_group reads. Rows of x past M repeat the last."""
        G: tl.constexpr = BLOCK_K // 64
        XR: tl.constexpr = 16 if ROWS16 else 8
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row = tl.minimum(rn, N - 1).to(tl.int64)  # rows past the last compute a repeat, not stored
        i = tl.arange(0, 16)[None, :]
        # the x row of the B fragment this lane loads, and of each element's product
        x_base = pid_m * XR + rn % 8
        x_row = tl.minimum(x_base, M - 1).to(tl.int64)
        x_hi = tl.minimum(x_base + 8, M - 1).to(tl.int64)
        out_m = pid_m * XR + 2 * (i // 4) + i % 2 + 8 * (i % 4 // 2)
        out_x = tl.minimum(out_m, M - 1).to(tl.int64)
        k_lo = pid_k * k_per
        k_hi = tl.minimum(k_lo + k_per, K)
        pdl_enter(GDC)
        t0, t1, t2, t3, t4, t5, t6, t7 = _code_tables(C, X)
        P16 = P.to(tl.pointer_type(tl.int16))
        stride_p16 = stride_p // 2
        acc = tl.zeros([BLOCK_N, 16], tl.float32)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            for gi in tl.static_range(G):
                kg = k0 + 64 * gi
                if EVEN:
                    k_ok = row[:, None] >= 0
                    s = tl.load(S + row * stride_s + kg // 64)
                else:
                    k_ok = (row[:, None] * 0 + kg) < k_hi
                    s = tl.load(S + row * stride_s + kg // 64, mask=(row * 0 + kg) < k_hi, other=0.0)
                part = _mma_part(P16, X, C, row, x_row, x_hi, out_x, kg, k_ok, K, stride_p16, stride_xm,
                                 t0, t1, t2, t3, t4, t5, t6, t7, ROWS16, BF16, ASM)
                acc += part * s[:, None]
        out = Y + (pid_k * M + out_m).to(tl.int64) * N + rn[:, None]
        ok = (out_m < M) & (rn[:, None] < N)
        if not ROWS16:  # x rows 8-15 of the fragment are not this program's
            ok = ok & (i % 4 < 2)
        if PARTIAL:
            tl.store(out, acc, mask=ok)
        else:
            tl.store(out, acc.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _sum_splits_kernel(Part, Y, total, split, BLOCK: tl.constexpr, GDC: tl.constexpr = False):
        pdl_enter(GDC)
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = idx < total
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(split):
            acc += tl.load(Part + s * total + idx, mask=ok, other=0.0)
        tl.store(Y + idx, acc.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _dequantize_kernel(P, S, C, W, N, K, stride_p, stride_s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           SHFL: tl.constexpr):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = rn < N
        for g in tl.static_range(BLOCK_K // 64):
            kg = tl.program_id(1) * BLOCK_K + 64 * g
            hi, lo, s = _nf4_group(P, S, C, rn, nm, kg, K, stride_p, stride_s, SHFL)
            # the even and odd columns interleaved in registers: one contiguous store per row
            w = tl.reshape(tl.join(hi * s, lo * s), [BLOCK_N, 64]).to(W.dtype.element_ty)
            ptr = W + rn[:, None].to(tl.int64) * K + (kg + tl.arange(0, 64))[None, :]
            tl.store(ptr, w, mask=nm[:, None] & ((kg + tl.arange(0, 64)) < K)[None, :])


def dequantize(w: NF4Weight) -> torch.Tensor:
    """The weight [N, K] in its compute dtype (the same values as `dequantize_ref`; the code
    lookup by loads, as no check precedes its use)."""
    if not _use_triton(w.packed):
        return dequantize_ref(w)
    n, k = w.shape
    out = torch.empty((n, k), dtype=w.dtype, device=w.device)
    bn, bk = 16, 256
    _dequantize_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        w.packed, w.scales, w.code, out, n, k, w.packed.stride(0), w.scales.stride(0), BLOCK_N=bn, BLOCK_K=bk,
        SHFL=False, num_warps=4)
    return out


def _check(x: torch.Tensor, w: NF4Weight) -> None:
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not match an NF4 weight of shape {w.shape}")
    if x.dtype != w.dtype:
        raise ValueError(f"x is {x.dtype}, the NF4 weight computes in {w.dtype}")


def nf4_matmul(x: torch.Tensor, w: NF4Weight, block_m: int, block_n: int, block_k: int, split: int,
               warps: int = 4, stages: int = 3, shfl: bool = False, swap: bool = False, permute: bool = False,
               mma: bool = False, pdl: bool = False) -> torch.Tensor:
    """x [M, K] (last dim contiguous) @ W^T -> [M, N] in x's dtype, W decoded in registers:
    `block_m` 1, one row of x per program on FMAs (`_nf4_gemv_kernel`), else tiles of `block_m`
    rows on tensor cores (`_nf4_dot_kernel`, `swap`: as W x^T); `block_n` weight rows per program,
    K in `split` slices (1: no partials) of `block_k` steps, `stages` of them in flight; `shfl`:
    the code lookup by warp shuffle (CUDA only), else by loads; `permute` (tiles, 16-bit x): the
    codes in x's dtype by byte permutes (CUDA; loads elsewhere), each group's product scaled by
    its absmax after it; `mma` (16-bit x, `block_m` 8 or 16): `_nf4_mma_kernel`, the codes
    looked up by byte permutes into mma.sync fragments in registers (`shfl`, `swap` and `permute`
    do not apply)."""
    _check(x, w)
    align = 16 if mma else 4  # mma: x read in 16-byte vectors; else whole (even, odd) pairs
    if x.stride(1) != 1 or (x.stride(0) * x.element_size()) % align or x.data_ptr() % align:
        x = x.clone(memory_format=torch.contiguous_format)
    m, k = x.shape
    n = w.shape[0]
    if (permute or mma) and (block_m == 1 or x.element_size() != 2):
        raise ValueError("the permute lookup and mma fragments take tiles (block_m from 8) of 16-bit activations")
    if mma and (block_m not in (8, 16) or block_n % (16 * warps)):
        raise ValueError("mma fragments take block_m 8 or 16 and block_n a multiple of 16 rows per warp")
    if block_k % GROUP or block_m & (block_m - 1) or block_n & (block_n - 1) or (1 < block_m < 16 and not mma):
        raise ValueError("block_k must be a multiple of 64, block_n a power of two, block_m 1 or a power of "
                         "two from 16")
    k_per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    args = kernel_args(pdl)
    even = k % block_k == 0 and k_per % block_k == 0
    if mma:
        _nf4_mma_kernel[(triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))](
            x, w.packed, w.scales, w.code, out, m, n, k, x.stride(0), w.packed.stride(0), w.scales.stride(0), k_per,
            BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=split > 1, ROWS16=block_m == 16, BF16=x.dtype == torch.bfloat16,
            ASM=x.is_cuda, EVEN=even, STAGES=stages, num_warps=warps, **args)
    elif block_m == 1:
        _nf4_gemv_kernel[(triton.cdiv(n, block_n), split, m)](
            x, w.packed, w.scales, w.code, out, m, n, k, x.stride(0), w.packed.stride(0), w.scales.stride(0), k_per,
            BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=split > 1, SHFL=shfl and x.is_cuda, X16=x.element_size() == 2,
            BF16=x.dtype == torch.bfloat16, EVEN=even, STAGES=stages, num_warps=warps, **args)
    else:
        _nf4_dot_kernel[(triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))](
            x, w.packed, w.scales, w.code, out, m, n, k, x.stride(0), w.packed.stride(0), w.scales.stride(0), k_per,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=split > 1, IEEE=x.dtype == torch.float32,
            SHFL=(permute or shfl) and x.is_cuda, SWAP=swap, EVEN=even, PERMUTE=permute, num_warps=warps,
            num_stages=stages, **args)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](out, y, m * n, split, BLOCK=block, num_warps=4,
                                                         **args)
    return y


def launch_for(m: int, n: int, k: int, sms: int, shfl: bool = False) -> dict:
    """A launch for `m` rows without a timed plan: one row per program on FMAs for one row, else
    `tl.dot` on tiles of 16 to 64 rows, K split for about two programs per SM."""
    if m == 1:
        cand = (1, 16, 512, 4, 3, False)
    else:
        cand = (min(64, max(16, triton.next_power_of_2(m))), 64, 128, 4, 3, True)
    return with_split(cand, m, n, k, sms, shfl=shfl)


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def linear(x: torch.Tensor, w: NF4Weight, plan: dict[int, dict | None] | None = None,
           pdl: bool = False, gelu: bool = False) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N]: up to MAX_KERNEL_ROWS rows the fused kernel, with the plan's
    launch for the smallest planned row count >= M (without one, `launch_for`'s, lookups by
    loads; a planned None: as for more rows; a planned {"cuda": launch}: the CUDA kernel of
    nf4_cuda where it takes x); more rows dequantize W and run `F.linear`. `gelu`: W is Gemma's
    gate/up weight and the result `fused_ops.gelu_mul` of the product, [M, N / 2]: computed by
    the CUDA kernel where it runs, else by `fused_ops.gelu_mul` after the product."""
    _check(x, w)
    m = x.shape[0]
    if not _use_triton(x):
        y = F.linear(x, dequantize_ref(w))
        return gelu_mul(y) if gelu else y
    sms = 4  # Triton's interpreter on the CPU
    if x.is_cuda:
        sms = _sms(x.device.index if x.device.index is not None else torch.cuda.current_device())
    cfg = None
    if m <= MAX_KERNEL_ROWS:
        planned = [r for r in (plan or {}) if r >= m]
        cfg = plan[min(planned)] if planned else launch_for(m, w.shape[0], w.shape[1], sms)
    if cfg is not None and "cuda" in cfg:  # the CUDA kernel (nf4_cuda), where it takes x
        if nf4_cuda.fits(x, w, cfg["cuda"]):
            return nf4_cuda.gemv(x, w, cfg["cuda"], sms, pdl, gelu=gelu)
        cfg = launch_for(m, w.shape[0], w.shape[1], sms)
    y = F.linear(x, dequantize(w)) if cfg is None else nf4_matmul(x, w, **cfg, pdl=pdl)
    return gelu_mul(y, pdl) if gelu else y


def with_split(cand: tuple, m: int, n: int, k: int, sms: int, per_sm: int = 2, shfl: bool = False) -> dict:
    """`cand` (block_m, block_n, block_k, warps, stages, swap[, permute[, mma]]) as
    `nf4_matmul`'s launch, K split in two until there are `per_sm` programs per SM (or a slice
    would be under two K blocks; `per_sm` 0: no split)."""
    block_m, block_n, block_k, warps, stages, swap, *rest = cand
    permute = bool(rest and rest[0])
    mma = bool(len(rest) > 1 and rest[1])
    programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = 1
    while programs * split < per_sm * sms and split * 2 * block_k <= k:
        split *= 2
    return dict(block_m=block_m, block_n=block_n, block_k=block_k, split=split, warps=warps, stages=stages,
                shfl=shfl, swap=swap, permute=permute, mma=mma)
