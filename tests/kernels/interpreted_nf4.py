"""The NF4 kernels (kernels/nf4.py, kernels/nf4_moe.py) on the CPU through Triton's interpreter,
against bitsandbytes' own dequantize and a float32 product on the same packed weights, and the
fused forwards on them (Gemma 3, and Gemma 4 with NF4 experts) against the engine's stock layers
on bitsandbytes' `Linear4bit` and the stock experts module on bitsandbytes' dequantized experts.
Run by test_interpreted.py in a process of its own:

    TRITON_INTERPRET=1 python -m tests.kernels.interpreted_nf4

Float32 only (the interpreter truncates where the GPU rounds to nearest when it converts to
bfloat16; bfloat16 is the GPU tests' part).
"""

from __future__ import annotations

import os

import torch

from engine import Engine, EngineConfig
from engine.kernels import fused_ops, moe, nf4, nf4_moe
from engine.model import fused_forward, nf4_experts, nf4_linear
from engine.model.nf4_experts import NF4Experts
from engine.model.loader import LoadedModel, tiny_random_model
from tests.helpers import greedy_agreement, tiny_gemma4

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
fused_ops._use_triton = nf4._use_triton = moe._use_triton = lambda x: True  # the kernels take CPU tensors here


def quantized(w: torch.Tensor, **kw):
    """bitsandbytes' Params4bit of w, quantized (on the CPU)."""
    import bitsandbytes as bnb

    return bnb.nn.Params4bit(w.clone(), requires_grad=False, **{"quant_type": "nf4", **kw}).to("cpu")


def bnb_reference(p) -> torch.Tensor:
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(p.data, p.quant_state).reshape(p.quant_state.shape)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_kernels() -> float:
    """Every kernel launch kind (one row per program on FMAs, tl.dot tiles as x W^T and W x^T,
    split K, several row tiles, steps of one group and of several) at 1, 3, 16 and 64 rows,
    float32 and 16-bit activations, against bnb's dequantize_4bit + matmul; returns the worst
    relative error (float32)."""
    torch.manual_seed(0)
    worst = 0.0
    # widths of one group up to several, row counts off every block size; nested absmax and plain
    for (n, k), nested in (((48, 192), True), ((33, 320), False), ((96, 64), True), ((20, 1088), True)):
        p = quantized(torch.randn(n, k) * 0.05, compress_statistics=nested)
        assert p.quant_state.nested == nested
        want_w = bnb_reference(p)
        w = nf4.from_bnb(p)
        assert w.packed.data_ptr() == p.data.data_ptr(), "the packed bytes are bnb's own, not a copy"
        assert torch.equal(nf4.dequantize_ref(w), want_w) and torch.equal(nf4.dequantize(w), want_w)
        for m in (1, 3, 16, 64):
            x = torch.randn(m, k)
            want = x @ want_w.T
            launches = [nf4.launch_for(m, n, k, 4),
                        dict(block_m=16, block_n=16, block_k=128, split=3),
                        dict(block_m=16, block_n=32, block_k=64, split=2, swap=True),
                        dict(block_m=32, block_n=16, block_k=256, split=1, swap=True),
                        dict(block_m=1, block_n=32, block_k=64, split=2), dict(block_m=1, block_n=16, block_k=256, split=1),
                        dict(block_m=1, block_n=8, block_k=512, split=1)]
            for launch in launches:
                got = nf4.nf4_matmul(x, w, **launch)
                assert got.shape == (m, n) and got.dtype == x.dtype
                worst = max(worst, rel(got, want))
        x = torch.randn(nf4.MAX_KERNEL_ROWS + 3, k)  # a prefill chunk: dequantize, then the library product
        worst = max(worst, rel(nf4.linear(x, w), x @ want_w.T))
        fused = nf4.fuse([w, nf4.from_bnb(quantized(torch.randn(8, k)))])
        assert torch.equal(nf4.dequantize(fused)[:n], want_w)
    # 16-bit activations (read as (even, odd) word pairs on the one-row path); the interpreter
    # truncates where the GPU rounds, so to 16-bit rounding here. Its tl.dot gives garbage on
    # bfloat16 operands (numpy has no bfloat16), so bfloat16 tiles are the GPU tests' part.
    for dtype in (torch.bfloat16, torch.float16):
        p = quantized((torch.randn(40, 320) * 0.05).to(dtype))
        w, want_w = nf4.from_bnb(p), bnb_reference(p)
        assert w.dtype == dtype and want_w.dtype == dtype
        for m in (1, 3, 16, 19):
            x = torch.randn(m, 320).to(dtype)
            want = x.float() @ want_w.float().T
            launches = [dict(block_m=1, block_n=16, block_k=128, split=2),
                        dict(block_m=1, block_n=8, block_k=512, split=1)]
            if dtype == torch.float16:  # tiles, with the codes by shuffle (loads here) and by byte permutes
                launches += [dict(block_m=16, block_n=16, block_k=128, split=1),
                             dict(block_m=16, block_n=32, block_k=128, split=2, swap=True),
                             dict(block_m=16, block_n=16, block_k=128, split=1, permute=True),
                             dict(block_m=16, block_n=32, block_k=64, split=3, swap=True, permute=True),
                             # the codes as mma fragments (each fragment's sums computed from loads here)
                             dict(block_m=8, block_n=16, block_k=128, split=1, warps=1, mma=True),
                             dict(block_m=16, block_n=64, block_k=64, split=3, warps=4, mma=True),
                             dict(block_m=8, block_n=32, block_k=256, split=2, warps=2, mma=True)]
            for launch in launches:
                got = nf4.nf4_matmul(x, w, **launch)
                assert got.dtype == dtype and rel(got, want) < 1e-2, (dtype, m, launch, rel(got, want))
    # what the kernels refuse: other formats, groups, and rows that are not whole groups
    for kw, shape in ((dict(quant_type="fp4"), (8, 128)), (dict(blocksize=128), (8, 128)), ({}, (8, 96))):
        why = nf4.refusal(quantized(torch.randn(*shape), **kw))
        assert why is not None, (kw, shape)
        try:
            nf4.from_bnb(quantized(torch.randn(*shape), **kw))
            raise AssertionError("from_bnb took a weight it refuses")
        except ValueError:
            pass
    w = nf4.from_bnb(quantized(torch.randn(8, 128)))
    for bad in (torch.randn(2, 64), torch.randn(2, 128, dtype=torch.float64)):
        try:
            nf4.linear(bad, w)
            raise AssertionError("a product of mismatched input taken")
        except ValueError:
            pass
    return worst


def bnb_experts(gate_up: torch.Tensor, down: torch.Tensor):
    """bitsandbytes' own NF4 round trip of [E, 2I, H] and [E, H, I] expert tensors (each viewed as
    2-D, plain absmax): its Params4bit of each and the dequantized tensors in their shapes."""
    pg = quantized(gate_up.reshape(-1, gate_up.shape[2]), compress_statistics=False)
    pd = quantized(down.reshape(-1, down.shape[2]), compress_statistics=False)
    return pg, pd, bnb_reference(pg).view(gate_up.shape), bnb_reference(pd).view(down.shape)


def check_experts() -> float:
    """The NF4 experts kernels (launches with one and several groups per step, steps that do not
    divide the width, one and three pipeline stages) at 1, 3 and 8 tokens, and NF4Experts' grouped
    path (prefill) at 3 and 100, against the stock math (moe.experts_ref) on bitsandbytes'
    dequantized experts; returns the worst relative error (float32)."""
    torch.manual_seed(1)
    E, H, inter, k = 8, 128, 64, 2
    gu_f, dn_f = torch.randn(E, 2 * inter, H) * 0.05, torch.randn(E, H, inter) * 0.05
    ex = NF4Experts.quantize(gu_f, dn_f)
    pg, pd, want_gu, want_dn = bnb_experts(gu_f, dn_f)
    assert torch.equal(ex.gate_up.packed.reshape(-1), pg.data.reshape(-1)), "bnb's packing of the 2-D view"
    assert torch.equal(ex.down.packed.reshape(-1), pd.data.reshape(-1))
    assert torch.equal(nf4.dequantize(ex.gate_up).view(E, 2 * inter, H), want_gu)
    assert torch.equal(nf4.dequantize(ex.down).view(E, H, inter), want_dn)
    worst = 0.0
    launches = [(None, None), (nf4_moe.GATE_UP[moe.MAX_TOKENS], nf4_moe.DOWN), (nf4_moe.GATE_UP[1], None),
                (dict(block_n=4, block_k=64, warps=2, stages=1), dict(block_n=8, block_k=128, warps=4, stages=1)),
                (dict(block_n=16, block_k=256, warps=4, stages=3), dict(block_n=32, block_k=64, warps=2, stages=3))]
    for T in (1, 3, 8, 100):
        idx = torch.rand(T, E).topk(k, dim=1).indices
        w = torch.rand(T, k)
        x = torch.randn(T, H)
        want = moe.experts_ref(x, idx, w, want_gu, want_dn)
        if T <= moe.MAX_TOKENS:
            for gu_launch, dn_launch in launches:
                got = nf4_moe.experts(x, idx.int(), w, ex.gate_up, ex.down, gu_launch, dn_launch, shfl=False)
                worst = max(worst, rel(got, want))
                part = nf4_moe.experts(x, idx.int(), w, ex.gate_up, ex.down, gu_launch, dn_launch, shfl=False,
                                       pairs=True)
                assert part.shape == (T * k, H) and torch.equal(moe.sum_pairs_ref(part, k, x.dtype), got)
            worst = max(worst, rel(nf4_moe.experts_ref(x, idx, w, ex.gate_up, ex.down), want))
        if T in (3, 100):
            worst = max(worst, rel(ex.grouped(x, idx, w), want))
        worst = max(worst, rel(ex(x, idx, w), want))  # the kernels up to moe.MAX_TOKENS, else grouped
    # 16-bit activations (the (even, odd) word pairs), to 16-bit rounding (see check_kernels)
    ex16 = NF4Experts.quantize(gu_f.half(), dn_f.half())
    _, _, gu16, dn16 = bnb_experts(gu_f.half(), dn_f.half())
    idx, w, x = torch.rand(3, E).topk(k, dim=1).indices, torch.rand(3, k), torch.randn(3, H).half()
    got = nf4_moe.experts(x, idx.int(), w, ex16.gate_up, ex16.down, shfl=False)
    assert got.dtype == torch.float16 and rel(got, moe.experts_ref(x.float(), idx, w, gu16.float(), dn16.float())) < 1e-2
    try:
        nf4_moe.experts(torch.randn(2, 64), idx[:2].int(), w[:2], ex.gate_up, ex.down)
        raise AssertionError("experts of another width taken")
    except ValueError:
        pass
    return worst


def roundtrip_experts(model):
    """Every layer's float experts replaced by bitsandbytes' NF4 round trip of them: the stock
    module computing on the weights an `NF4Experts` of the same tensors holds."""
    for layer in model.get_decoder().layers:
        ex = layer.experts
        _, _, gu, dn = bnb_experts(ex.gate_up_proj.data, ex.down_proj.data)
        ex.gate_up_proj.data, ex.down_proj.data = gu, dn
    return model


def quantize_cpu(model):
    """Every decoder linear as a bitsandbytes Linear4bit (NF4, nested absmax), on the CPU, as
    loader.quantize_bnb4 does on CUDA."""
    import bitsandbytes as bnb

    for parent in list(model.get_decoder().layers.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False, quant_type="nf4",
                                      compute_dtype=torch.float32)
                q.weight = quantized(child.weight.data)
                setattr(parent, name, q)
    return model


def check_forward(family: str, lengths: tuple[int, ...], tokens: int) -> tuple[bool, float, int]:
    """The engine on the fused forward (repacked NF4 linears, the kernels) against the engine's
    stock layers on bitsandbytes' own Linear4bit forward, greedy, several rows at once."""
    def engine(fused: bool) -> Engine:
        if family == "gemma3":
            model = quantize_cpu(tiny_random_model(7))
        else:  # every projection, router and expert a whole number of groups wide
            model = quantize_cpu(tiny_gemma4(7, intermediate_size=128, moe_intermediate_size=64))
            if fused:  # NF4 experts on the kernels; the stock layers: the stock module on their values
                assert nf4_experts.quantize_experts(model) == sum(1 for _ in model.model.layers)
            else:
                roundtrip_experts(model)
        cfg = EngineConfig(model="tiny-random", kv_sink=2, kv_window=5, kv_cache_bytes=1 << 22,
                           max_num_batched_tokens=16, max_rows=4, decode_graphs=True, fused_layers=fused,
                           nf4_kernels=fused)
        eng = Engine(cfg, LoadedModel(model, None, "tiny-nf4"))
        kinds = {type(m).__name__ for m in model.model.layers.modules()}
        assert (eng.runner.fused is not None) == fused
        assert ("NF4Linear" in kinds and "Linear4bit" not in kinds) if fused else ("NF4Linear" not in kinds)
        assert ("NF4Experts" in kinds) == (fused and family == "gemma4")
        return eng

    return greedy_agreement(engine, lengths, tokens)


def check_repack_keeps_what_it_refuses() -> None:
    import bitsandbytes as bnb

    model = quantize_cpu(tiny_random_model(8))
    layer = model.model.layers[0]
    q = bnb.nn.Linear4bit(64, 128, bias=False, quant_type="fp4", compute_dtype=torch.float32)
    q.weight = quantized(torch.randn(128, 64), quant_type="fp4")
    layer.mlp.up_proj = q
    done = nf4_linear.repack(model)
    total = 7 * len(model.model.layers)
    assert done == total - 1 and type(layer.mlp.up_proj).__name__ == "Linear4bit", done
    assert fused_forward.unsupported(model) is not None  # one layer's projections are of two kinds


def main() -> None:
    fused_forward._rope_angles = lambda *a: None  # RoPE from tables (no libdevice here)
    worst = check_kernels()
    print(f"nf4 kernels vs bitsandbytes dequantize_4bit + matmul: worst relative error {worst:.1e}")
    assert worst < 1e-5, worst
    worst = check_experts()
    print(f"nf4 experts kernels and grouped path vs bitsandbytes dequantize_4bit + the stock math: worst relative "
          f"error {worst:.1e}")
    assert worst < 1e-5, worst
    check_repack_keeps_what_it_refuses()
    for family, lengths, tokens in (("gemma3", (5, 23, 9), 6), ("gemma4", (5, 19), 4)):
        same, diff, steps = check_forward(family, lengths, tokens)
        print(f"fused {family} forward on NF4 kernels vs stock layers on bitsandbytes: tokens equal {same}, "
              f"max |logit diff| {diff:.1e} over {steps} steps")
        assert same and diff < 1e-3
    print("OK")


if __name__ == "__main__":
    main()
