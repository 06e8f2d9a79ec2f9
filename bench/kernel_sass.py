"""The instruction mix of an NF4 kernel's main loop, as the GPU runs it: the kernel compiled for
Hopper (sm_90) by Triton and its own ptxas, disassembled, and the instructions of the K loop's
body (the longest backward branch) counted per weight each thread decodes in one iteration. No
GPU is needed, so a change to the decode can be weighed before it is timed.

    python -m bench.kernel_sass --kernel gemv --block-n 32 --block-k 256 --warps 4 --stages 3
    python -m bench.kernel_sass --kernel dot --block-m 16 --block-n 64 --block-k 128 --swap [--permute]
    python -m bench.kernel_sass --kernel mma --block-m 8 --block-n 64 --block-k 256

The arguments are those of an `nf4_matmul` launch (bf16 activations, the code lookup by warp
shuffle, whole K steps); pointers, sizes and row strides are taken as multiples of 16, as Triton
specializes them for the engine's weights. Prints the counts and writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess

KERNELS = {"gemv": "_nf4_gemv_kernel", "dot": "_nf4_dot_kernel", "mma": "_nf4_mma_kernel"}
SIGNATURE = {"X": "*bf16", "P": "*u8", "S": "*fp32", "C": "*fp32", "Y": "*bf16", "M": "i32", "N": "i32", "K": "i32",
             "stride_xm": "i32", "stride_p": "i32", "stride_s": "i32", "k_per": "i32"}
MULTIPLE_OF_16 = ("X", "P", "S", "C", "Y", "N", "K", "stride_xm", "stride_p", "k_per")


def compiled(kernel: str, block_m: int, block_n: int, block_k: int, warps: int, stages: int, swap: bool,
             permute: bool = False):
    """The kernel compiled for sm_90 (Triton's CompiledKernel: its `asm` holds each stage's text)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.kernels import nf4

    fn = getattr(nf4, KERNELS[kernel])
    const = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=False, IEEE=False, SHFL=True, SWAP=swap,
                 X16=True, BF16=True, EVEN=True, STAGES=stages, PERMUTE=permute, ROWS16=block_m == 16,
                 ASM=True, GDC=False)
    const = {k: v for k, v in const.items() if k in fn.arg_names}
    sig = {**SIGNATURE, **{k: "constexpr" for k in const}}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in MULTIPLE_OF_16}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def sass(kernel: str, block_m: int, block_n: int, block_k: int, warps: int, stages: int, swap: bool,
         permute: bool = False) -> str:
    """The kernel's SASS for sm_90 (`compiled`, disassembled by the nvdisasm Triton ships)."""
    import triton

    kernel = compiled(kernel, block_m, block_n, block_k, warps, stages, swap, permute)
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    cubin = "/tmp/s5serve-kernel-sass.cubin"
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    return subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout


def loop_counts(text: str) -> collections.Counter:
    """Opcodes (with their first modifier) of the longest loop: a label and the last branch back to it."""
    lines = text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\s*(\.L_x_\d+):", line))}
    body = (0, len(lines))
    best = -1
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i and i - labels[m.group(1)] > best:
            best, body = i - labels[m.group(1)], (labels[m.group(1)], i + 1)
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)?)",
                     "\n".join(lines[body[0]:body[1]]), re.M)
    return collections.Counter(ops)


def main() -> None:
    from bench.throughput import git_commit, source_digest, write_result

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=sorted(KERNELS), default="gemv")
    ap.add_argument("--block-m", type=int, default=16)
    ap.add_argument("--block-n", type=int, default=32)
    ap.add_argument("--block-k", type=int, default=256)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--swap", action="store_true")
    ap.add_argument("--permute", action="store_true", help="dot: the code lookup by byte permutes")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    counts = loop_counts(sass(a.kernel, a.block_m, a.block_n, a.block_k, a.warps, a.stages, a.swap, a.permute))
    weights = a.block_n * a.block_k / (32 * a.warps)  # weights each thread decodes per iteration
    total = sum(counts.values())
    print(f"{KERNELS[a.kernel]}: {weights:.0f} weights per thread per K step, {total} instructions in the loop, "
          f"{total / weights:.2f} per weight")
    print(f"{'opcode':>14} {'count':>6} {'per weight':>10}")
    for op, c in counts.most_common(20):
        print(f"{op:>14} {c:>6} {c / weights:>10.3f}")
    launch = dict(block_m=1 if a.kernel == "gemv" else a.block_m, block_n=a.block_n, block_k=a.block_k,
                  warps=a.warps, stages=a.stages, swap=a.swap, permute=a.permute, mma=a.kernel == "mma")
    write_result(a.out, f"kernel-sass-{a.kernel}", {
        "bench": "kernel_sass", "kernel": KERNELS[a.kernel], "launch": launch, "target": "sm_90",
        "weights_per_thread_per_step": weights, "loop_instructions": total, "per_weight": total / weights,
        "opcodes": dict(counts.most_common()),
        "versions": {"triton": __import__("triton").__version__, "commit": git_commit(),
                     "engine_source_sha256": source_digest()}})


if __name__ == "__main__":
    main()
