"""The NF4 kernel compiled for Hopper (sm_90) on the CPU, without a GPU: Triton's compiler and the
ptxas its wheel ships turn the kernel into a cubin here, so a kernel that the interpreter runs
but the GPU compiler refuses (inline PTX, layouts, shared memory) fails here first. Each launch
kind the plans use: one row on FMAs, tiles on tensor cores (mma and wgmma sizes), warp-shuffle
and load lookups, 16-bit and float32 activations, split K or not."""

import pytest

pytestmark = pytest.mark.interpret

# (block_m, block_n, block_k, warps, dtype, shfl, partial, even)
VARIANTS = [
    (1, 64, 256, 4, "bf16", True, True, True),
    (16, 64, 128, 4, "bf16", True, False, False),
    (64, 128, 128, 8, "bf16", True, True, True),
    (1, 32, 512, 4, "fp16", False, False, False),
    (16, 32, 256, 4, "fp32", True, True, False),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_nf4_kernel_compiles_for_sm90(variant):
    triton = pytest.importorskip("triton", reason="Triton is not installed (make test-kernels installs it)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.kernels import nf4

    bm, bn, bk, warps, dtype, shfl, partial, even = variant
    sig = {"X": f"*{dtype}", "P": "*u8", "S": "*fp32", "C": "*fp32", "Y": "*fp32" if partial else f"*{dtype}",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_p": "i32", "stride_s": "i32",
           "k_per": "i32"}
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PARTIAL=partial, DOT=bm >= 16, IEEE=dtype == "fp32",
                  SHFL=shfl, X16=dtype != "fp32", BF16=dtype == "bf16", EVEN=even, GDC=True)
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    # what the launcher specializes on at run time: 16-byte aligned pointers, sizes divisible by 16
    attrs = {(names.index(a),): [["tt.divisibility", 16]]
             for a in ("X", "P", "S", "C", "Y", "N", "K", "stride_xm", "stride_p", "stride_s", "k_per")}
    try:
        kernel = triton.compile(ASTSource(fn=nf4._nf4_matmul_kernel, signature=sig, constexprs=consts, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})
    except RuntimeError as exc:
        if "ptxas" in str(exc) and "not found" in str(exc).lower():
            pytest.skip(f"no ptxas: {exc}")
        raise
    assert kernel.asm["cubin"] and kernel.metadata.shared <= 227 * 1024
    assert ("shfl.sync.idx.b32" in kernel.asm["ptx"]) == shfl


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
