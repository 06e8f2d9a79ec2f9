"""The CUDA kernels compiled for Hopper (sm_90) on the CPU, without a GPU: Triton's compiler and the
ptxas its wheel ships turn each kernel into a cubin here, so a kernel that the interpreter runs
but the GPU compiler refuses (inline PTX, layouts, shared memory) fails here first. The NF4
kernels in each launch kind the plans use: one row per program on FMAs (pipelined steps), tiles
on tensor cores as x W^T and W x^T (mma and wgmma sizes), the codes by warp shuffle, loads or
byte permutes, 16-bit and float32 activations, split K or not, PDL launches. The bf16 few-row
products (`gemv`, `mma_rows`), and what the decode attention reads before its PDL wait."""

import pytest

pytestmark = pytest.mark.interpret

# (block_m, block_n, block_k, warps, stages, swap, dtype, shfl, partial, even, permute)
VARIANTS = [
    (1, 16, 512, 4, 3, False, "bf16", True, False, True, False),
    (1, 8, 512, 4, 2, False, "bf16", True, True, False, False),
    (1, 32, 512, 8, 3, False, "fp16", False, False, True, False),
    (1, 16, 256, 4, 3, False, "fp32", True, True, False, False),
    (16, 64, 128, 4, 3, True, "bf16", True, True, True, False),
    (16, 32, 256, 4, 3, False, "bf16", True, False, False, False),
    (64, 64, 128, 4, 3, True, "bf16", True, False, True, False),
    (64, 32, 256, 4, 2, False, "fp16", False, True, True, False),
    (32, 64, 128, 4, 3, True, "fp32", True, True, False, False),
    (16, 64, 128, 4, 3, True, "bf16", True, True, True, True),
    (16, 64, 256, 8, 3, False, "fp16", True, False, False, True),
    (64, 128, 128, 4, 3, True, "bf16", True, True, False, True),
]


def _compile(fn, sig: dict, consts: dict, warps: int, stages: int, divisible: tuple[str, ...]):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**sig, **{k: "constexpr" for k in consts}}
    names = list(sig)
    # what the launcher specializes on at run time: 16-byte aligned pointers, sizes divisible by 16
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    try:
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    except RuntimeError as exc:
        if "ptxas" in str(exc) and "not found" in str(exc).lower():
            pytest.skip(f"no ptxas: {exc}")
        raise


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_nf4_kernel_compiles_for_sm90(variant):
    pytest.importorskip("triton", reason="Triton is not installed (make test-kernels installs it)")
    from engine.kernels import nf4

    bm, bn, bk, warps, stages, swap, dtype, shfl, partial, even, permute = variant
    sig = {"X": f"*{dtype}", "P": "*u8", "S": "*fp32", "C": "*fp32", "Y": "*fp32" if partial else f"*{dtype}",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_p": "i32", "stride_s": "i32",
           "k_per": "i32"}
    if bm == 1:
        fn = nf4._nf4_gemv_kernel
        consts = dict(BLOCK_N=bn, BLOCK_K=bk, PARTIAL=partial, SHFL=shfl, X16=dtype != "fp32", BF16=dtype == "bf16",
                      EVEN=even, STAGES=stages, GDC=True)
    else:
        fn = nf4._nf4_dot_kernel
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PARTIAL=partial, IEEE=dtype == "fp32", SHFL=shfl, SWAP=swap,
                      EVEN=even, PERMUTE=permute, GDC=True)
    kernel = _compile(fn, sig, consts, warps, stages,
                      ("X", "P", "S", "C", "Y", "N", "K", "stride_xm", "stride_p", "stride_s", "k_per"))
    assert kernel.asm["cubin"] and kernel.metadata.shared <= 227 * 1024
    assert ("shfl.sync.idx.b32" in kernel.asm["ptx"]) == (shfl and not permute)
    assert ("prmt.b32 a," in kernel.asm["ptx"]) == permute
    if bm == 1:
        assert "cp.async" in kernel.asm["ptx"], "the weight tiles are loaded ahead through the pipeliner"
    elif dtype != "fp32":
        assert "wgmma" in kernel.asm["ptx"] or "mma.sync" in kernel.asm["ptx"], "products on tensor cores"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_nf4_dequantize_kernel_compiles_for_sm90(dtype):
    triton = pytest.importorskip("triton", reason="Triton is not installed (make test-kernels installs it)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.kernels import nf4

    sig = {"P": "*u8", "S": "*fp32", "C": "*fp32", "W": f"*{dtype}", "N": "i32", "K": "i32", "stride_p": "i32",
           "stride_s": "i32", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "SHFL": "constexpr"}
    kernel = triton.compile(ASTSource(fn=nf4._dequantize_kernel, signature=sig,
                                      constexprs=dict(BLOCK_N=16, BLOCK_K=256, SHFL=False)),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert kernel.asm["cubin"]


def test_the_one_row_kernel_spends_one_shuffle_per_weight_and_sums_groups_within_threads():
    """The instruction mix of `_nf4_gemv_kernel`'s K loop at its gate/up launch
    (bench/kernel_sass.py): one shuffle (the code lookup) per weight, the weight bytes read in
    16-byte vectors from the pipeliner's shared memory (no byte loads), and each group's sum
    kept within a thread but for one exchange (a layout that spread a group over the warp spent
    five exchanges per sum and read each byte with its own load)."""
    pytest.importorskip("triton", reason="Triton is not installed (make test-kernels installs it)")
    from bench.kernel_sass import loop_counts, sass

    block_n, block_k, warps = 32, 256, 4
    counts = loop_counts(sass("gemv", 1, block_n, block_k, warps, 3, False))
    weights = block_n * block_k // (32 * warps)  # per thread per K step
    assert counts["SHFL.IDX"] == weights
    assert counts["LDS.128"] * 16 >= weights // 2  # the thread's weight bytes, 16 to a load
    assert counts.get("LDG.E", 0) <= weights // 16  # plain global loads (not the pipeliner's copies)
    assert counts.get("SHFL.BFLY", 0) <= weights // 8
    assert sum(counts.values()) <= 6 * weights


def test_the_permute_lookup_takes_the_codes_off_the_shuffle_and_memory_pipes():
    """The tile kernel's K loop with `permute` (bench/kernel_sass.py, the 8-row plans' tile):
    no shuffle and no load for the code lookup, eight byte permutes per four weights (two
    16-byte tables, low and high bytes, each looked up in two halves and merged, then each
    column's two bytes paired), and no per-weight scaling (each group's product is scaled)."""
    pytest.importorskip("triton", reason="Triton is not installed (make test-kernels installs it)")
    from bench.kernel_sass import loop_counts, sass

    block_n, block_k, warps = 64, 128, 4
    weights = block_n * block_k // (32 * warps)  # per thread per K step
    counts = loop_counts(sass("dot", 16, block_n, block_k, warps, 3, True, permute=True))
    assert counts.get("SHFL.IDX", 0) == 0 and counts["PRMT"] == 2 * weights
    assert counts.get("FMUL", 0) == 0 and counts["HGMMA.64"] * 64 >= 2 * weights // 4
    shuffled = loop_counts(sass("dot", 16, block_n, block_k, warps, 3, True))
    assert shuffled["SHFL.IDX"] == weights and shuffled["FMUL"] == weights


# (block_m, block_n, block_k, warps, stages, dtype, partial, even)
MMA_VARIANTS = [
    (8, 64, 256, 4, 3, "bf16", False, True),
    (8, 32, 128, 2, 3, "bf16", True, False),
    (8, 128, 512, 8, 3, "bf16", False, True),
    (16, 64, 256, 4, 3, "fp16", True, True),
    (16, 64, 256, 2, 3, "bf16", False, True),
    (8, 128, 256, 4, 2, "fp16", False, False),
]


@pytest.mark.parametrize("variant", MMA_VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_the_mma_kernel_compiles_for_sm90_in_the_layout_its_fragments_assume(variant):
    """`_nf4_mma_kernel`'s inline PTX is warp-collective: each lane must hold the packed words
    of weight rows r and r + 8W (W warps) for quarter t of a group, lane = 4 (r % 8) + t. That is
    the layout Triton gives the [BLOCK_N, 16] 16-bit loads (sizePerThread [1, 4], threadsPerWarp
    [8, 4], warps stacked over rows); a Triton that chose another would compute other sums, so
    the asm's layout is checked here, where the GPU is not needed."""
    pytest.importorskip("triton", reason="Triton is not installed (make test-kernels installs it)")
    import re

    from engine.kernels import nf4

    bm, bn, bk, warps, stages, dtype, partial, even = variant
    sig = {"X": f"*{dtype}", "P": "*u8", "S": "*fp32", "C": "*fp32", "Y": "*fp32" if partial else f"*{dtype}",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_p": "i32", "stride_s": "i32",
           "k_per": "i32"}
    consts = dict(BLOCK_N=bn, BLOCK_K=bk, PARTIAL=partial, ROWS16=bm == 16, BF16=dtype == "bf16", ASM=True,
                  EVEN=even, STAGES=stages, GDC=True)
    kernel = _compile(nf4._nf4_mma_kernel, sig, consts, warps, stages,
                      ("X", "P", "S", "C", "Y", "N", "K", "stride_xm", "stride_p", "stride_s", "k_per"))
    ttgir = kernel.asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<.*>)$", ttgir, re.M))
    asm_ops = [line for line in ttgir.splitlines() if "tt.elementwise_inline_asm" in line and "mma.sync" in line]
    assert asm_ops
    for line in asm_ops:
        result = re.search(r"-> tensor<(\d+)x16xf32, (#\w+)>", line)
        assert result and int(result.group(1)) == bn, line[-200:]
        layout = layouts[result.group(2)]
        assert "sizePerThread = [1, 4]" in layout and "threadsPerWarp = [8, 4]" in layout, layout
        assert f"warpsPerCTA = [{warps}, 1]" in layout and "order = [1, 0]" in layout, layout
    ptx = kernel.asm["ptx"]
    ab = "bf16" if dtype == "bf16" else "f16"
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32" in ptx and "shfl.sync.idx" not in ptx


def test_the_mma_kernel_decodes_codes_into_fragments_without_shared_memory():
    """`_nf4_mma_kernel`'s K loop (bench/kernel_sass.py): the codes go from the packed words to
    the A fragments in registers (no store to shared memory, no ldmatrix, no shuffle), one
    tensor-core product per 8 weights a lane decodes (16 weight rows x 16 columns a warp), two
    byte permutes per weight."""
    pytest.importorskip("triton", reason="Triton is not installed (make test-kernels installs it)")
    from bench.kernel_sass import loop_counts, sass

    block_n, block_k, warps = 64, 256, 4
    weights = block_n * block_k // (32 * warps)  # per thread per K step
    counts = loop_counts(sass("mma", 8, block_n, block_k, warps, 3, False))
    assert counts["HMMA.16816"] == weights // 8, counts
    assert counts["PRMT"] == 2 * weights and counts.get("SHFL.IDX", 0) == 0, counts
    assert not any(op.startswith(("STS", "LDSM")) for op in counts), counts
    assert sum(counts.values()) <= 5.5 * weights, counts  # 4.1 (Triton 3.6), 5.1 (3.9: moves of the tables)


def test_the_few_row_product_compiles_for_sm90_with_its_activation_and_pdl():
    """`small_linear._gemv_kernel` at two weight rows of 1,024 columns a program and eight rows of
    x, launched with PDL, plain and with `gelu`: both compile for Hopper and wait on the grid
    dependency (`griddepcontrol`) only after requesting their first weight tiles, with `gelu` the
    gate's and the up's (twice the plain kernel's loads before the wait), and only the activation
    takes an exp."""
    triton = pytest.importorskip("triton", reason="Triton is not installed (make test-kernels installs it)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.kernels import small_linear

    sig = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
           "stride_wn": "i32", "stride_ym": "i32", "MP": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
           "GELU": "constexpr", "GDC": "constexpr"}
    before_wait = {}
    for gelu in (False, True):
        kernel = triton.compile(ASTSource(fn=small_linear._gemv_kernel, signature=sig,
                                          constexprs=dict(MP=8, BLOCK_N=2, BLOCK_K=1024, GELU=gelu, GDC=True)),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
        ptx = kernel.asm["ptx"]
        assert "griddepcontrol.wait" in ptx
        assert ("ex2.approx" in ptx) == gelu, "the activation's exp only with gelu"
        before_wait[gelu] = ptx[: ptx.index("griddepcontrol.wait")].count("ld.global")
    assert before_wait[False] >= 1 and before_wait[True] == 2 * before_wait[False], before_wait


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_the_tensor_core_few_row_product_compiles_for_sm90_within_shared_memory(block_m):
    """`small_linear._mma_rows_kernel` at every candidate launch the plans time (`MMA_CANDIDATES`)
    for 16, 32 and 64 rows of bf16 x, K split or not, plain and with the activation, launched with
    PDL: each compiles for Hopper, multiplies on tensor cores, waits on the grid dependency only
    after requesting its first weight tile, and only the split launch counts its block done (an
    atomic) and reloads the partials past L1. Every plain launch fits Hopper's 227 KiB of shared
    memory, and with the activation (two weight tiles a step) at least one does at each row count
    and split; the plans skip one the GPU refuses (this Triton gives the widest tile 240 KiB at 64
    rows with the activation)."""
    pytest.importorskip("triton", reason="Triton is not installed (make test-kernels installs it)")
    from engine.kernels import small_linear

    sig = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "P": "*fp32", "Counts": "*i32", "M": "i32", "N": "i32",
           "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "k_per": "i32", "split": "i32"}
    fits = {}
    for cfg in small_linear.MMA_CANDIDATES:
        for split in (False, True):
            for gelu in (False, True):
                consts = dict(BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], SPLIT=split,
                              IEEE=False, GELU=gelu, GDC=True)
                kernel = _compile(small_linear._mma_rows_kernel, sig, consts, cfg["warps"], cfg["stages"],
                                  ("X", "W", "Y", "P", "Counts", "N", "K", "stride_xm", "stride_wn", "stride_ym",
                                   "k_per"))
                ptx, what = kernel.asm["ptx"], (cfg, split, gelu)
                assert kernel.asm["cubin"] and ("wgmma" in ptx or "mma.sync" in ptx), what
                assert ptx[: ptx.index("griddepcontrol.wait")].count("ld.global") >= 1, what
                assert ("atom.global" in ptx) == split and ("ld.global.cg" in ptx) == split, what
                fits.setdefault((split, gelu), []).append(kernel.metadata.shared <= 227 * 1024)
    for (split, gelu), ok in fits.items():
        assert all(ok) if not gelu else any(ok), (block_m, split, gelu, ok)


def _attention_kernels(paged: bool, splits: int, store: bool, evict: bool):
    """The decode attention's partial and merge kernels for Hopper, bf16, Gemma-3 4B's heads (two
    query heads per K/V head of 256), in their PDL form, with `decode_attention`'s constants for
    a ring of 4 + 64 slots or pages of 16 keys."""
    from engine.kernels import decode_attention as da

    types = dict(Q="*bf16", K="*bf16", V="*bf16", Opart="*fp32", Mpart="*fp32", Lpart="*fp32", BlockTable="*i32",
                 Rows="*i64", Pos="*i64", Out="*bf16", Knew="*bf16", Vnew="*bf16", Slots="*i64", Ek="*bf16",
                 Ev="*bf16")
    ints = ("stride_qb", "stride_qh", "stride_ks", "stride_kh", "stride_bt", "stride_ob", "stride_oh", "stride_kb",
            "stride_knh", "stride_vb", "stride_vnh", "stride_eb", "stride_eh")
    sig = {**types, **dict.fromkeys(ints, "i32"), "scale": "fp32", "softcap": "fp32", "attn_window": "i32",
           "sink": "i32", "ring_window": "i32"}
    extra = not paged or store
    consts = dict(G=2, GP=16, D=256, S=splits, PAGE=16, RING_SLOTS=68, PAGED=paged, SOFTCAP=False, IEEE=False,
                  BLOCK=32 if paged or splits == 1 else 16, NEW_APART=paged and store, EXTRA=extra, STORE=store,
                  EVICT=evict, GDC=True)
    partial = _compile(da._partial_kernel, sig, consts, 4, 3 if splits == 1 else 2, ())
    types = dict(Out="*bf16", Opart="*fp32", Mpart="*fp32", Lpart="*fp32", Q="*bf16", Knew="*bf16", Vnew="*bf16",
                 Kstore="*bf16", Vstore="*bf16", Slots="*i64", Ek="*bf16", Ev="*bf16")
    ints = ("stride_ob", "stride_oh", "stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_vb", "stride_vh",
            "stride_ss", "stride_sh", "stride_eb", "stride_eh")
    sig = {**types, **dict.fromkeys(ints, "i32"), "scale": "fp32", "softcap": "fp32", "H": "i32", "G": "i32"}
    consts = dict(D=256, S=splits, SP=max(2, 1 << (splits - 1).bit_length()), EXTRA=extra, SOFTCAP=False,
                  STORE=store, EVICT=evict, GDC=True)
    return partial, _compile(da._combine_kernel, sig, consts, 4, 1, ())


def _loads_around_the_wait(kernel) -> tuple[set[str], set[str]]:
    """The kernel arguments that its loads read before and after `griddepcontrol.wait`, from
    Triton's IR: each load's pointer followed back through splats, offsets and broadcasts to the
    argument it starts from."""
    import re

    parent, phases, waited = {}, (set(), set()), False
    for line in kernel.asm["ttir"].splitlines():
        if "tt.grid_dependency_wait" in line:
            waited = True
            continue
        m = re.match(r"\s*(%[\w.#]+) = (\S+) (%[\w.#]+)", line)
        if not m:
            continue
        result, op, operand = m.groups()
        if op == "tt.load":
            while operand in parent:
                operand = parent[operand]
            phases[waited].add(operand.lstrip("%"))
        elif op in ("tt.splat", "tt.addptr", "tt.broadcast", "tt.expand_dims", "tt.reshape"):
            parent[result] = operand
    return phases


@pytest.mark.parametrize("layout", ["ring-split", "ring-whole", "paged-split", "paged-whole", "paged-stored-before"])
def test_decode_attention_reads_what_the_kernel_before_it_does_not_write_before_its_pdl_wait(layout):
    """Launched with PDL and storing the new token itself, the decode attention's partial kernel
    reads only the rows' indices, block tables, store slots and the K/V store before
    `griddepcontrol.wait` (the kernel before it wrote q, k_new and v_new, read after the wait);
    where the caller stored the new token just before (no `store_slot`), nothing. The merge
    kernel reads q, the new token, the slot and what it holds before its wait, and the partials,
    which the partial kernel before it writes, only after it. Both compile for Hopper."""
    pytest.importorskip("triton", reason="Triton is not installed (make test-kernels installs it)")
    paged = layout.startswith("paged")
    store = layout != "paged-stored-before"
    splits = 1 if layout.endswith("whole") else 4
    partial, merge = _attention_kernels(paged, splits, store, evict=store and not paged)
    assert partial.asm["cubin"] and merge.asm["cubin"]
    before, after = _loads_around_the_wait(partial)
    if store:
        assert {"K", "V", "Rows", "Pos"} <= before <= {"K", "V", "Rows", "Pos", "BlockTable", "Slots"}, before
        assert "Q" in after, after
        assert ("Slots" in before) == (splits == 1), before  # with splits, the merge stores
    else:
        assert not before and {"Q", "K", "V", "Rows", "Pos", "BlockTable"} <= after, (before, after)
    if splits > 1:
        before, after = _loads_around_the_wait(merge)
        assert {"Mpart", "Lpart", "Opart"} <= after and not before & {"Mpart", "Lpart", "Opart", "Out"}, (before, after)
        want = {"Q", "Knew", "Vnew", "Slots"} | ({"Kstore", "Vstore"} if not paged else set()) if store else set()
        assert before == want, (before, want)


@pytest.mark.parametrize("splits", [1, 4], ids=["whole", "split"])
def test_ring_attention_finds_slot_positions_without_a_division_per_key(splits):
    """A ring slot's position takes the one 64-bit remainder of `_ring_wrap` once per program,
    not two per key: a 64-bit remainder is a long instruction sequence on the GPU, and each
    block's loads wait on its keys' positions (their masks)."""
    pytest.importorskip("triton", reason="Triton is not installed (make test-kernels installs it)")
    partial, _ = _attention_kernels(False, splits, True, evict=True)
    ptx = partial.asm["ptx"]
    divisions = sum(op in ptx_line for ptx_line in ptx.splitlines() for op in ("rem.s64", "div.s64", "rem.u64",
                                                                               "div.u64"))
    assert divisions <= 1, divisions
