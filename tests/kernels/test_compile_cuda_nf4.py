"""The CUDA NF4 kernels (engine/kernels/cuda/nf4_gemv.cu) compiled for Hopper (sm_90) on the CPU,
where a CUDA compiler is installed: every product kernel a launch can pick builds without
spilling, and its K loop is what the source intends. The shuffles must stay in converged code
(a loop whose trip count the compiler cannot prove warp-uniform wraps every shuffle in a
collective sequence, four times the instructions), one shuffle per weight, one 16-byte load per
row's chunk; the tensor-core tiles stream the weights through a ring in shared memory and look a
byte's two codes up with one permute and one shared-memory load."""

import collections
import os
import re
import shutil
import subprocess

import pytest

from engine.kernels import nf4_cuda

pytestmark = pytest.mark.interpret

NVCC = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME")
                                else None)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if NVCC is None or not os.path.exists(NVCC):
        pytest.skip("no CUDA compiler here: the engine keeps to the Triton kernels (nf4_cuda.extension)")
    cubin = tmp_path_factory.mktemp("nf4cuda") / "nf4_gemv.cubin"
    out = subprocess.run([NVCC, "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-DNF4_KERNELS_ONLY",
                          "-cubin", "-o", str(cubin), str(nf4_cuda.SOURCE), "-Xptxas", "-v"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    triton = pytest.importorskip("triton", reason="Triton's nvdisasm reads the machine code (make test-kernels)")
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    return out.stderr, sass


def test_every_kernel_builds_for_sm90_without_spills(built):
    log, _ = built
    kernels = re.findall(r"Compiling entry function '(\S+)'", log)
    assert sum("nf4_gemv_kernel" in k for k in kernels) == 4 and sum("persistent" in k for k in kernels) == 3
    assert "spill stores" in log and not re.search(r"[1-9]\d* bytes spill stores", log)


def test_the_loops_shuffle_once_per_weight_in_converged_code(built):
    from bench.kernel_sass import loop_counts

    _, sass = built
    seen = 0
    for part in re.split(r"\n(?=\s*\.text\.)", sass):
        m = re.match(r"\s*\.text\.\S*nf4_gemv_(persistent_)?kernelILi(\d)ELi0E", part)  # a function's code
        if not m:
            continue
        rows = int(m.group(2))
        counts = loop_counts(part)
        weights = 32 * rows  # one 16-byte chunk of each row per lane per step
        assert not any("COLLECTIVE" in op or "WARPSYNC" in op for op in counts), (m.group(0), counts)
        assert counts["SHFL.IDX"] == weights, (m.group(0), counts)
        assert counts["LDG.E"] >= rows + 4, (m.group(0), counts)  # the rows' chunks and x's four vectors
        assert sum(counts.values()) <= 7.5 * weights, (m.group(0), sum(counts.values()) / weights)
        seen += 1
    assert seen == 7


def _loops(text: str) -> list[collections.Counter]:
    """Opcodes of every loop (a label and a later branch back to it), innermost first. Branches
    from past the function's last EXIT are not loops: the compiler puts the slow paths of warp
    collectives there (e.g. a match over lanes it cannot prove converged), each jumping back."""
    lines = text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\s*(\.L_x_\d+):", line))}
    end = max((i for i, line in enumerate(lines) if re.search(r"\sEXIT\s*;", line)), default=len(lines))
    spans = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i and i < end]
    op = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)?)", re.M)
    spans.sort(key=lambda s: s[1] - s[0])
    return [collections.Counter(op.findall("\n".join(lines[a:b + 1]))) for a, b in spans]


@pytest.mark.parametrize("kernel", ["nf4_gemv_table_kernelILi0E", "nf4_gemv_gelu_table_kernel",
                                    "nf4_expert_gate_up_kernel", "nf4_expert_down_kernel"])
def test_the_tile_kernels_stream_weights_through_a_ring_and_look_up_two_codes_per_load(built, kernel):
    """The tensor-core tile kernels' K loop (dense, dense gate/up with its activation, and the experts'
    two stages), one ring stage of two groups of 64 columns per iteration: the weights come from
    the warp's ring in shared memory (four 8-byte reads per lane, and two of the absmax),
    refilled by asynchronous copies past L1 (two 16-byte copies per lane and one of the absmax),
    one wait on the copies in flight per stage and no global load but x's four vectors (and, for
    the experts, the expert id of the next item the copies move to, with its slot of pairs);
    each byte's two codes by one byte permute (the table address) and one shared-memory load,
    four per mma of 16 x 16 weights; no spills or local memory. The loop holds the copies' move
    to the next work item (a division by the items per tile, taken once per item), so its budget
    is 3.5 instructions per weight a lane multiplies, all paths counted; the loop over work
    items around it has no local memory either."""
    log, sass = built
    assert re.search(kernel, log)
    part = next(p for p in re.split(r"\n(?=\s*\.text\.)", sass) if re.match(rf"\s*\.text\.\S*{kernel}", p))
    loops = [c for c in _loops(part) if c["HMMA.16816"]]
    assert len(loops) == 2, loops  # the K loop, inside the loop over work items
    inner = loops[0]
    mmas = inner["HMMA.16816"]
    assert mmas == 8 and inner["PRMT"] == 4 * mmas and inner["LDS"] >= 4 * mmas, inner
    assert inner["LDS.64"] == 6 and inner["LDGSTS.E"] == 3 and inner["LDGDEPBAR"] == 1 and inner["DEPBAR.LE"] == 1
    assert inner["LDG.E"] == (4 if kernel.startswith("nf4_gemv_") else 5), inner
    assert not any(op.startswith(("LDL", "STL", "SHFL")) for loop in loops for op in loop), loops
    weights = 8 * mmas  # 16 x 16 weights per mma, over 32 lanes
    assert sum(inner.values()) <= 3.5 * weights, sum(inner.values()) / weights


@pytest.mark.parametrize("nb", [2, 4, 8])
def test_the_block_tiles_multiply_each_looked_up_weight_by_every_row_of_x(built, nb):
    """The block tiles' K loop (8 nb rows of x, 32 weight rows a warp), one group of 64 columns per
    iteration: one wait on the block's copies and one barrier; the refill of the stage read before
    (each thread's two 16-byte weight copies, one absmax copy, x's 16-byte copies in a loop of its
    own); the lane's two tiles' bytes in four 8-byte reads and their codes by 32 byte permutes and
    shared-memory loads (each byte's two codes at once), x's B fragments in two 16-byte reads per
    block of 8 rows, and 8 mma per block (2 tiles x 4 k-steps of 16): the lookups are shared by
    every row of x. No global load, no spills or local memory."""
    log, sass = built
    part = next(p for p in re.split(r"\n(?=\s*\.text\.)", sass)
                if re.match(rf"\s*\.text\.\S*nf4_block_tiles_kernelILi{nb}ELi0E", p))
    loops = [c for c in _loops(part) if c["HMMA.16816"]]
    assert len(loops) == 1, loops
    inner = loops[0]
    assert inner["HMMA.16816"] == 8 * nb and inner["LDS.128"] == 2 * nb, inner
    assert inner["PRMT"] == 32 and inner["LDS"] >= 32 + 4 and inner["LDS.64"] == 4, inner
    assert inner["BAR.SYNC"] == 1 and inner["DEPBAR.LE"] == 1 and inner["LDGSTS.E"] == 4, inner
    assert inner["LDGDEPBAR"] == 1, inner  # one commit per group: the wait's count of groups in flight holds
    assert not any(op.startswith(("LDG.", "LDL", "STL", "SHFL")) for op in inner), inner
    assert not any(op.startswith(("LDL", "STL")) for loop in _loops(part) for op in loop)
    # per block of 8 rows of x: 8 mma, 8 multiply-adds of the group's absmax, 2 reads; the rest (the
    # 64 lookup instructions, the tiles' reads, the copies, the loop) is shared by every row of x
    assert sum(inner.values()) <= 176 + 18 * nb, sum(inner.values())


@pytest.mark.parametrize("mode", [1, 2, 3, 6])
def test_the_block_tiles_measurement_modes_leave_out_one_phase(built, mode):
    """The block tiles' measurement variants at 33-64 rows of x (`bench.nf4_cuda` times them beside
    the product): MODE 1's K loop keeps the product's copies, reads and mma and drops the lookups
    (no permutes, 32 fewer shared-memory loads); MODE 2's drops x's copies (the loop of them inside
    the K loop) and MODE 3's the weights' and absmax' three, each keeping the rest of the product;
    MODE 6's keeps the copies, reads and lookups and drops the mma, each replaced by two integer ops
    (plus two per A fragment), so that it issues about as much as the product."""
    log, sass = built

    def loop(variant):
        part = next(p for p in re.split(r"\n(?=\s*\.text\.)", sass)
                    if re.match(rf"\s*\.text\.\S*nf4_block_tiles_kernelILi8ELi{variant}E", p))
        loops = [c for c in _loops(part) if c["LDGDEPBAR"]]
        assert len(loops) == 1, loops
        return loops[0]

    product, variant = loop(0), loop(mode)
    for op in ("LDS.128", "LDS.64", "LDGDEPBAR", "BAR.SYNC", "DEPBAR.LE", "FFMA"):
        assert variant[op] == product[op], (op, variant, product)
    copies = {1: 4, 2: 3, 3: 1, 6: 4}[mode]  # the product's: two of weights, one of absmax, x's loop
    assert product["LDGSTS.E"] == 4 and variant["LDGSTS.E"] == copies, (variant, product)
    if mode in (1, 2, 3):
        assert variant["HMMA.16816"] == product["HMMA.16816"] == 64, variant
    if mode == 1:
        assert variant["PRMT"] == 0 and variant["LDS"] == product["LDS"] - 32, (variant, product)
    elif mode in (2, 3):
        # every lookup and the absmax' reads (the scheduler may lift a few reads past the loop's label)
        assert variant["PRMT"] == product["PRMT"] == 32 and variant["LDS"] >= 32 + 4, (variant, product)
    else:
        assert variant["HMMA.16816"] == 0 and variant["PRMT"] == product["PRMT"] == 32, variant
        assert variant["LDS"] == product["LDS"], (variant, product)
        assert variant["LOP3.LUT"] <= product["LOP3.LUT"] + 2 * 64 + 2 * 8, (variant, product)
    assert not any(op.startswith(("LDL", "STL")) for op in variant)


def test_the_tiles_variant_with_l2_prefetch_differs_from_the_product_only_in_its_copies(built):
    """MODE 3 of the dense tiles (the product, timed by `bench.nf4_cuda` beside it) has L2 fetch 128
    bytes around each 16-byte copy of the weights; the product's copies carry no prefetch hint."""
    _, sass = built
    parts = {m.group(1): p for p in re.split(r"\n(?=\s*\.text\.)", sass)
             if (m := re.match(r"\s*\.text\.\S*nf4_gemv_table_kernelILi(\d)E", p))}
    assert set(parts) == {"0", "3", "4", "5"}, sorted(parts)
    copies = {mode: re.findall(r"LDGSTS\.E\.BYPASS(\.LTC128B)?\.128", part) for mode, part in parts.items()}
    assert copies["0"] and not any(copies["0"]), copies["0"]
    assert copies["3"] and all(hint == ".LTC128B" for hint in copies["3"]), copies["3"]
    ops = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+([A-Z][A-Z0-9_.]*)", re.M)
    strip = lambda part: collections.Counter(op.replace(".LTC128B", "") for op in ops.findall(part))
    assert strip(parts["0"]) == strip(parts["3"])


@pytest.mark.parametrize("mode", [4, 5])
def test_the_tiles_variants_with_other_copy_addresses_copy_the_same_bytes_per_stage(built, mode):
    """MODE 4 of the dense tiles (the product with whole-sector copies) and MODE 5 (the copies
    from a tile-contiguous layout), timed by `bench.nf4_cuda` beside the product: each stage's
    copies are the product's, two 16-byte weight copies and one absmax copy per lane, past L1 and
    without a prefetch hint; the K loop is the product's but for the copies' addresses."""
    _, sass = built
    part = next(p for p in re.split(r"\n(?=\s*\.text\.)", sass)
                if re.match(rf"\s*\.text\.\S*nf4_gemv_table_kernelILi{mode}E", p))
    inner = [c for c in _loops(part) if c["HMMA.16816"]][0]
    assert inner["HMMA.16816"] == 8 and inner["PRMT"] == 32 and inner["LDS.64"] == 6, inner
    assert inner["LDGSTS.E"] == 3 and inner["DEPBAR.LE"] == 1 and inner["LDG.E"] == 4, inner
    copies = re.findall(r"LDGSTS\.E(\.BYPASS)?(\.LTC128B)?\.128", part)
    assert copies and all(bypass and not hint for bypass, hint in copies), copies


def test_the_tiles_shared_memory_layout_holds_every_alignment_of_the_base(tmp_path):
    """The tiles' layout (tile_layout, tile_smem), run on the host: for every 16-byte aligned
    distance from the block's base to the table's 64 KiB boundary, 1-16 warps, with and without
    the experts' scratch, the table, the scratch and each warp's ring are 16-byte aligned, overlap
    nothing, and end within the bytes the launcher allocates; and 16 warps with the scratch fit
    Hopper's 227 KiB. The same for the block tiles' table and ring stages (BlockRing, block_smem)
    at 4 and 8 warps and 16-64 rows of x."""
    if NVCC is None or not os.path.exists(NVCC):
        pytest.skip("no CUDA compiler here: the engine keeps to the Triton kernels (nf4_cuda.extension)")
    src = tmp_path / "layout.cu"
    src.write_text(f'#define NF4_KERNELS_ONLY\n#include "{nf4_cuda.SOURCE}"\n' + r'''
#include <cstdio>
int main() {
  int bad = 0;
  for (int scratch : {0, SCRATCH_BYTES}) {
    for (int warps = 1; warps <= 16; ++warps) {
      const uint32_t most = tile_smem(warps, scratch);
      for (uint32_t pad = 0; pad < TABLE_BYTES; pad += 16) {
        const TileLayout l = tile_layout(pad, warps, scratch);
        uint32_t lo[18], hi[18];
        int n = 0;
        lo[n] = pad, hi[n++] = pad + TABLE_BYTES;
        if (scratch) lo[n] = l.scratch, hi[n++] = l.scratch + scratch;
        for (int w = 0; w < warps; ++w) lo[n] = l.ring(w), hi[n++] = l.ring(w) + RING_BYTES;
        for (int i = 0; i < n; ++i) {
          bad += lo[i] % 16 != 0 || hi[i] > l.end || l.end > most;
          for (int j = i + 1; j < n; ++j) bad += lo[i] < hi[j] && lo[j] < hi[i];
        }
      }
    }
  }
  for (int warps : {4, BLOCK_MAX_WARPS}) {  // the block tiles: the table and the ring
    for (int nb : {2, 4, 8}) {
      const uint32_t sb = block_stage_bytes(warps, nb), most = block_smem(warps, nb);
      for (uint32_t pad = 0; pad < TABLE_BYTES; pad += 16) {
        uint32_t lo[BLOCK_STAGES + 1], hi[BLOCK_STAGES + 1];
        lo[0] = pad, hi[0] = pad + TABLE_BYTES;
        for (int s = 0; s < BLOCK_STAGES; ++s) lo[s + 1] = BlockRing(pad, sb).at(s), hi[s + 1] = lo[s + 1] + sb;
        for (int i = 0; i <= BLOCK_STAGES; ++i) {
          bad += lo[i] % 16 != 0 || hi[i] > most;
          for (int j = i + 1; j <= BLOCK_STAGES; ++j) bad += lo[i] < hi[j] && lo[j] < hi[i];
        }
      }
    }
  }
  bad += block_smem(BLOCK_MAX_WARPS, 8) > 227 * 1024;
  printf("%d %d\n", bad, tile_smem(16, SCRATCH_BYTES));
  return 0;
}
''')
    exe = tmp_path / "layout"
    out = subprocess.run([NVCC, "-std=c++17", "-o", str(exe), str(src)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    bad, most = map(int, subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split())
    assert bad == 0
    assert most <= 227 * 1024
