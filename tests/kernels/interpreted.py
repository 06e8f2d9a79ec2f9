"""The CUDA kernels' logic on the CPU: Triton's interpreter (TRITON_INTERPRET=1) runs them on CPU
tensors, so a machine without a GPU can check them against their torch references, and the fused
Gemma 4 forward on them against the stock layers. Run by test_interpreted.py in a process of its
own (the variable must be set before the kernels are defined):

    TRITON_INTERPRET=1 python -m tests.kernels.interpreted

Float32 only: the interpreter truncates where the GPU rounds to nearest when it converts to
bfloat16, so bfloat16 agreement is the GPU tests' part. It lacks libdevice's cos/sin, so RoPE
runs from tables here (`qk_norm_rope`); the kernel is the same but for where the angles come
from. Timing means nothing here.
"""

from __future__ import annotations

import os

import torch

from engine import Engine, EngineConfig
from engine.model import fused_forward, fused_gemma4
from engine.model.kernel_check import gemma4_kernels_disagree
from engine.kernels import decode_attention, fused_ops, moe, small_linear
from engine.kv.policy import ring_slot
from engine.model.loader import LoadedModel, tiny_random_model
from tests.helpers import greedy_agreement, tiny_gemma4

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
# the kernels take CPU tensors here
fused_ops._use_triton = moe._use_triton = lambda x: True


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_kernels() -> dict[str, float]:
    torch.manual_seed(0)
    N, H, Hkv, D, eps = 96, 4, 2, 16, 1e-6
    worst: dict[str, float] = {}

    def note(name, got, want):
        for a, b in zip(got, want):
            worst[name] = max(worst.get(name, 0.0), rel(a, b))

    for T in (1, 3):
        h, y = torch.randn(T, N) * 3, torch.randn(T, N)
        w1, w2, w3, w4 = (torch.randn(N) * 0.3 + 1 for _ in range(4))
        for off, also in ((1.0, ()), (0.0, (w3,)), (0.0, (w3, w4))):
            note(f"add_rmsnorm offset {off:g}, {1 + len(also)} norms", fused_ops.add_rmsnorm(h.clone(), y, w1, w2, eps,
                                                                                         off, also),
                 fused_ops.add_rmsnorm_ref(h, y, w1, w2, eps, off, also))
            note(f"rmsnorm offset {off:g}", [fused_ops.rmsnorm(h, w1, eps, off)], [fused_ops.rmsnorm_ref(h, w1, eps, off)])
        pos = torch.randint(0, 1000, (T,))
        inv = 1.0 / (10_000 ** (torch.arange(0, D, 2).float() / D))
        cos, sin = fused_ops.rope_tables(pos, inv, 1.0, torch.float32)
        wq, wk = torch.randn(D) * 0.3 + 1, torch.randn(D) * 0.3 + 1
        for off, v_norm, v_from_k in ((1.0, False, False), (0.0, True, False), (0.0, True, True)):
            qkv = torch.randn(T, (H + (1 if v_from_k else 2) * Hkv) * D)
            note(f"qk_norm_rope offset {off:g} v_norm {v_norm} v_from_k {v_from_k}",
                 fused_ops.qk_norm_rope(qkv.clone(), wq, wk, cos, sin, H, Hkv, eps, off, v_norm, v_from_k),
                 fused_ops.qk_norm_rope_ref(qkv, wq, wk, cos, sin, H, Hkv, eps, off, v_norm, v_from_k))
        d, e, scalar = torch.randn(T, N), torch.randn(T, N) * 0.1, torch.tensor([0.8])
        note("layer_out", fused_ops.layer_out(h.clone(), d, e, w1, w2, w3, scalar, w4, eps),
             fused_ops.layer_out_ref(h, d, e, w1, w2, w3, scalar, w4, eps))
        note("layer_out dense", fused_ops.layer_out(h.clone(), d, None, None, None, w3, scalar, w4, eps),
             fused_ops.layer_out_ref(h, d, None, None, None, w3, scalar, w4, eps))
        # the few-row product, and with the MLP's activation stored by its own kernel (the bits
        # of gelu_mul after it: the same sums, the same activation function)
        wgu = torch.randn(2 * 37, N) * 0.2
        for cfg in small_linear.GEMV_CANDIDATES[:3]:
            note("gemv", [small_linear.gemv(h, wgu, **cfg)], [h @ wgu.T])
            got = small_linear.gemv(h, wgu, **cfg, gelu=True)
            note("gemv gelu", [got], [fused_ops.gelu_mul_ref(h @ wgu.T)])
            assert torch.equal(got, fused_ops.gelu_mul(small_linear.gemv(h, wgu, **cfg)))
        E, K, inter = 16, 4, 40  # an expert width that is not a multiple of the blocks
        scale = torch.rand(E) + 0.5
        logits = torch.randn(T, E) * 2
        w, idx = moe.router_topk(logits, K, scale)
        w_ref, idx_ref = moe.router_topk_ref(logits, K, scale)
        assert idx.dtype == torch.int32 and torch.equal(idx.long(), idx_ref), (idx, idx_ref)
        note("router_topk", [w], [w_ref])
        gate_up, down, x = torch.randn(E, 2 * inter, N) * 0.2, torch.randn(E, N, inter) * 0.2, torch.randn(T, N)
        got = moe.experts(x, idx, w, gate_up, down)
        note("experts", [got], [moe.experts_ref(x, idx_ref, w_ref, gate_up, down)])
        other = moe.experts(x, idx, w, gate_up, down, down_launch=dict(moe.DOWN, split=not moe.DOWN["split"]))
        assert torch.equal(other, got), "the split down stage computes the same sums in the same order"
        # the pairs' partials left for layer_out: their sum is the experts' output, and layer_out
        # adds them to the same bits
        part = moe.experts(x, idx, w, gate_up, down, pairs=True)
        assert part.shape == (T * K, N) and part.dtype == torch.float32
        assert torch.equal(moe.sum_pairs_ref(part, K, x.dtype), got)
        args = (w1, w2, w3, scalar, w4, eps)
        got_out = fused_ops.layer_out(h.clone(), d, part, *args, pairs=K)
        note("layer_out of pairs", got_out, fused_ops.layer_out_ref(h, d, part, *args, pairs=K))
        for a, b in zip(got_out, fused_ops.layer_out(h.clone(), d, got, *args)):
            assert torch.equal(a, b), "layer_out of the pairs = layer_out of their sum"
    # the tensor-core product of 9-64 rows: K split or not (the last program of a column block
    # sums the partials in split order, and leaves its counter at zero), and with the activation
    counts = torch.zeros(small_linear.MMA_COUNTS, dtype=torch.int32)
    wgu = torch.randn(2 * 37, 2 * N) * 0.2
    for T in (9, 20):
        x = torch.randn(T, 2 * N)
        for cfg, split in ((dict(block_n=32, block_k=64, warps=4, stages=2), 3),
                           (dict(block_n=16, block_k=32, warps=4, stages=2), 1)):
            assert small_linear.mma_rows_fits(T, 37, 2 * N, cfg["block_n"], cfg["block_k"], split)
            got = small_linear.mma_rows(x, wgu, **cfg, split=split, counts=counts)
            note("mma_rows", [got], [x @ wgu.T])
            act = small_linear.mma_rows(x, wgu, **cfg, split=split, counts=counts, gelu=True)
            note("mma_rows gelu", [act], [fused_ops.gelu_mul_ref(x @ wgu.T)])
            # (the same bits on a GPU; here numpy's products may sum tiles of other shapes in
            # another order)
            note("mma_rows gelu against gelu_mul of its product", [act], [fused_ops.gelu_mul(got)])
            assert torch.equal(small_linear.mma_rows(x, wgu, **cfg, split=split, counts=counts), got)
            assert not counts.any()
    check_decode_attention(note)
    return worst


def check_decode_attention(note) -> None:
    """The decode attention's kernels, split or whole, storing the new token themselves (a ring
    also keeping what its slot held) or finding it stored, against the torch reference: outputs
    close, the store and the kept K/V exactly the reference's. (The engine's forwards here keep
    the torch attention: only this check takes the kernels on CPU tensors.)"""
    da = decode_attention
    B, H, Hkv, D, page, num_rows, max_blocks, sink, window = 5, 4, 2, 16, 16, 7, 6, 4, 44
    rows = torch.randperm(num_rows)[:B]
    pos = torch.randint(0, page * max_blocks - 1, (B,))
    pos[0], pos[1] = 0, 3  # a first token, and a row shorter than the ring
    q = torch.randn(B, H, D)
    new = dict(k_new=torch.randn(B, Hkv, D), v_new=torch.randn(Hkv, B, D).transpose(0, 1))
    table = (1 + torch.randperm(num_rows * max_blocks)).view(num_rows, -1)
    layouts = {
        "paged": (dict(block_table=table.to(torch.int32), page=page), (num_rows * max_blocks + 2) * page,
                  table[rows, pos // page].long() * page + pos % page),
        "ring": (dict(ring=(sink, window)), num_rows * (sink + window),
                 torch.tensor([int(r) * (sink + window) + ring_slot(int(p), sink, window) for r, p in zip(rows, pos)])),
    }
    for name, (kw, n, slot) in layouts.items():
        ring = name == "ring"
        ks, vs = torch.randn(n, Hkv, D), torch.randn(n, Hkv, D)
        for launch in (dict(splits=4, block=16), dict(splits=1, block=16)):
            for storing in (False, True):
                k, v, rk, rv = ks.clone(), vs.clone(), ks.clone(), vs.clone()
                args = dict(kw, scale=D ** -0.5, **(new if storing or ring else {}))
                kept = ref_kept = None
                if storing:
                    args.update(store_slot=slot)
                    if ring:
                        kept = (torch.zeros(B, Hkv, D), torch.zeros(B, Hkv, D))
                        ref_kept = (torch.zeros(B, Hkv, D), torch.zeros(B, Hkv, D))
                available, da.available = da.available, lambda device: True
                try:
                    got = da.decode_attention(q, k, v, rows, pos, evicted=kept, **launch, **args)
                finally:
                    da.available = available
                want = da.reference(q, rk, rv, rows, pos, evicted=ref_kept, **args)
                assert torch.equal(k, rk) and torch.equal(v, rv), (name, launch, storing)
                if kept is not None:
                    assert torch.equal(kept[0], ref_kept[0]) and torch.equal(kept[1], ref_kept[1]), (name, launch)
                note(f"decode_attention {name}{', storing' if storing else ''}", [got], [want])


def check_forward() -> tuple[bool, float, int]:
    """The engine on the fused Gemma 4 forward (its kernels, RoPE from tables) against the stock
    layers, with norm weights, router scales and layer scalars away from their initial values."""
    def engine(fused: bool) -> Engine:
        model = tiny_gemma4(3)
        with torch.no_grad():
            for m in model.modules():
                if type(m).__name__ == "Gemma4RMSNorm" and m.with_scale:
                    torch.nn.init.normal_(m.weight, 1.0, 0.3)
            for layer in model.model.layers:
                torch.nn.init.normal_(layer.router.per_expert_scale, 1.0, 0.3)
                torch.nn.init.normal_(layer.router.scale, 1.0, 0.3)
                layer.layer_scalar.fill_(0.9)
        cfg = EngineConfig(model="tiny-gemma4", kv_sink=2, kv_window=5, kv_cache_bytes=1 << 22,
                           max_num_batched_tokens=16, max_rows=4, decode_graphs=True, fused_layers=fused)
        eng = Engine(cfg, LoadedModel(model, None, "tiny-gemma4"))
        assert (type(eng.runner.fused).__name__ == "FusedGemma4") == fused
        assert not fused or eng.runner.fused.rope is None
        return eng

    return greedy_agreement(engine, (5, 23, 9), 6)


def check_gemma3_forward_on_gemv() -> tuple[bool, float, int]:
    """The engine on the fused Gemma 3 forward with every projection of a decode step on `gemv`,
    the MLP's gate/up with its activation stored by the same kernel (`project`'s `gelu`), against
    the stock layers. There is nothing to time here, so the plans are given: one launch at 1-4
    rows (the engine's decode batches), the library's product for prefill chunks."""
    launch = small_linear.GEMV_CANDIDATES[0]
    assert small_linear.gemv_fits(launch, 4, gelu=True)
    planned = []

    def plan_gemv(weights, rows=small_linear.GEMV_ROWS, pdl_for=None, gelu=False):
        planned.append(gelu)
        return {m: launch for m in (1, 2, 4)}

    def engine(fused: bool) -> Engine:
        cfg = EngineConfig(model="tiny-random", kv_sink=2, kv_window=5, kv_cache_bytes=1 << 22,
                           max_num_batched_tokens=16, max_rows=4, decode_graphs=True, fused_layers=fused)
        eng = Engine(cfg, LoadedModel(tiny_random_model(5), None, "tiny-random"))
        assert (type(eng.runner.fused).__name__ == "FusedGemma3") == fused
        return eng

    good = fused_forward.plan_gemv
    fused_forward.plan_gemv = plan_gemv
    try:
        result = greedy_agreement(engine, (5, 23, 9), 6)
    finally:
        fused_forward.plan_gemv = good
    assert sorted(planned) == [False, False, False, True], planned  # Q/K/V, O, down; gate/up with gelu
    return result


def main() -> None:
    fused_forward._rope_angles = lambda *a: None  # RoPE from tables (no libdevice here)
    worst = check_kernels()
    for k, v in worst.items():
        print(f"{k}: {v:.1e}")
    bad = {k: v for k, v in worst.items() if not v < 1e-5}
    assert not bad, bad
    # build's own check of the kernels on the model's weights passes, and catches a broken one
    fused = fused_gemma4.build(tiny_gemma4(4))
    assert type(fused).__name__ == "FusedGemma4" and gemma4_kernels_disagree(fused) is None
    good = moe.experts  # the forward takes its experts kernel when it is built: break it before
    moe.experts = lambda *a, **kw: good(*a, **kw) * 1.5
    try:
        assert "experts" in (gemma4_kernels_disagree(fused_gemma4.FusedGemma4(tiny_gemma4(4))) or "")
        assert fused_gemma4.build(tiny_gemma4(4)) is None
    finally:
        moe.experts = good
    same, diff, steps = check_forward()
    print(f"fused Gemma 4 forward on the kernels vs stock: tokens equal {same}, max |logit diff| {diff:.1e} "
          f"over {steps} steps")
    assert same and diff < 1e-3
    same, diff, steps = check_gemma3_forward_on_gemv()
    print(f"fused Gemma 3 forward on gemv (gate/up with its activation) vs stock: tokens equal {same}, "
          f"max |logit diff| {diff:.1e} over {steps} steps")
    assert same and diff < 1e-3
    print("OK")


if __name__ == "__main__":
    main()
