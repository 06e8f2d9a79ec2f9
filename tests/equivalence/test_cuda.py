"""The same engine on a CUDA device (skipped without one): float32 tiny models must match the
DESIGN mask oracle and HF generate exactly as on the CPU; bfloat16 must agree closely."""

import random

import pytest
import torch

from engine import Engine, EngineConfig, Request
from engine.model.loader import LoadedModel, tiny_random_model
from tests.scenarios import Recorder, check_against_oracle, check_turns_with_stops, converse, run_sessions
from tests.helpers import greedy, hf_greedy, run_all

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def equal_prefix(pairs) -> int:
    """Tokens equal before each row's first difference, summed over (tokens, tokens) pairs: bf16
    rounding differs between paths, and once one token differs the continuations diverge."""
    n = 0
    for a, b in pairs:
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
    return n


@pytest.mark.parametrize("policy", ["s5", "native"])
def test_cuda_oracle_multiturn(policy):
    rng = random.Random(0)
    model = tiny_random_model(0).cuda()
    cfg = EngineConfig(model="tiny-random", device="cuda", kv_policy=policy, kv_sink=2, kv_window=5,
                       max_num_batched_tokens=16, kv_cache_bytes=1 << 22)
    engine = Engine(cfg, LoadedModel(model, None, "tiny"))
    results, rec = run_sessions(engine, [[12, 5, 3], [30, 2, 7], [4, 9, 9]], rng)
    ref = tiny_random_model(0)
    ref.set_attn_implementation("sdpa")
    rec.logits = {k: v.cpu() for k, v in rec.logits.items()}
    check_against_oracle(engine, ref, results, rec, policy, 2, 5, 1e-3)


def test_cuda_native_equals_hf_generate_64_steps():
    model = tiny_random_model(1, num_hidden_layers=6).cuda()
    ref = tiny_random_model(1, num_hidden_layers=6).cuda()
    ref.set_attn_implementation("sdpa")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 40, 130)]
    cfg = EngineConfig(model="tiny-random", device="cuda", kv_policy="native", max_num_batched_tokens=32,
                       kv_cache_bytes=1 << 24)
    engine = Engine(cfg, LoadedModel(model, None, "tiny"))
    out = run_all(engine, [Request(f"r{i}", p, greedy(64)) for i, p in enumerate(prompts)], {"r1": 3, "r2": 9})
    for i, p in enumerate(prompts):
        expected = hf_greedy(ref, p, 64)
        assert out[f"r{i}"] == expected
    engine.check_invariants()


@pytest.mark.parametrize("policy", ["s5", "native"])
def test_cuda_long_prefill_chunks_equal_the_cpu_engine(policy):
    """Chunks over attention.QUERY_BLOCK tokens attend in one masked call on CUDA and by query
    blocks on the CPU: float32, the same greedy tokens, logits to float rounding."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (700, 300, 9)]
    outs, recs = {}, {}
    for dev in ("cpu", "cuda"):
        cfg = EngineConfig(model="tiny-random", device=dev, kv_policy=policy, kv_sink=2, kv_window=5,
                           max_num_batched_tokens=1024, kv_cache_bytes=1 << 24)
        engine = Engine(cfg, LoadedModel(tiny_random_model(0).to(dev), None, "tiny"))
        recs[dev] = Recorder(engine)
        outs[dev] = run_all(engine, [Request(f"r{i}", p, greedy(16)) for i, p in enumerate(prompts)], {})
        engine.check_invariants()
    common = recs["cpu"].logits.keys() & recs["cuda"].logits.keys()
    diff = max((recs["cpu"].logits[k] - recs["cuda"].logits[k].cpu()).abs().max().item() for k in common)
    print(f"{policy}: max |logit diff| cpu vs cuda {diff:.2e} over {len(common)} steps")
    assert outs["cpu"] == outs["cuda"] and diff < 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["paged", "paged-window", "paged-wide", "ring", "ring-softcap"])
def test_decode_attention_kernel_matches_reference(layout, dtype):
    """The Triton decode kernels against the torch reference on fresh random ragged rows (paged-wide:
    two K/V heads of 512 for 16 query heads, as Gemma 4's exact layers, in bf16 on their own default
    launch)."""
    from engine.kernels.decode_attention import decode_attention, launch_for, reference

    gen = torch.Generator(device="cuda").manual_seed(hash((layout, str(dtype))) % 1000)
    B, H, hkv, D, page = 13, 8, 2, 64, 16
    if layout == "paged-wide":
        H, D = 16, 512
        assert (launch_for(True, B, hkv, D, dtype.itemsize) != launch_for(True, B, hkv, 64, dtype.itemsize)) \
            == (dtype == torch.bfloat16)
    num_rows, max_blocks = 20, 40
    rows = torch.randperm(num_rows, device="cuda", generator=gen)[:B]
    pos = torch.randint(0, page * max_blocks - 1, (B,), device="cuda", generator=gen)
    pos[0], pos[1] = 0, 3  # a first token, and a row shorter than the sink + window
    q = torch.randn(B, H, D, device="cuda", dtype=dtype, generator=gen)
    kw = dict(scale=D ** -0.5, softcap=30.0 if layout == "ring-softcap" else None,
              attn_window=100 if layout in ("paged-window", "ring-softcap") else None)
    if layout.startswith("paged"):
        slots = 1 + num_rows * max_blocks
        table = torch.randperm(slots - 1, device="cuda", generator=gen)[: num_rows * max_blocks].view(num_rows, -1)
        kw.update(block_table=(table + 1).to(torch.int32), page=page)
        n = (slots + 1) * page
    else:
        kw.update(ring=(4, 60))
        n = num_rows * 64
        # k and v of different layouts, as a model hands them over (one normed, one a view)
        kw.update(k_new=torch.randn(B, hkv, D, device="cuda", dtype=dtype, generator=gen),
                  v_new=torch.randn(hkv, B, D, device="cuda", dtype=dtype, generator=gen).transpose(0, 1))
    ks = torch.randn(n, hkv, D, device="cuda", dtype=dtype, generator=gen)
    vs = torch.randn(n, hkv, D, device="cuda", dtype=dtype, generator=gen)
    ref = reference(q, ks, vs, rows, pos, **kw).double()
    wide32 = layout == "paged-wide" and dtype == torch.float32  # 64 keys of 512 in float32: past shared memory
    launches = [{}] + [dict(splits=s, block=b) for s in (1, 8, 64) for b in ((16, 32) if wide32 else (16, 32, 64))]
    if layout == "paged-wide" and dtype == torch.bfloat16:  # launch_for's two launches for few programs
        launches += [dict(splits=32, block=64, warps=8, stages=1), dict(splits=16, block=32, warps=8, stages=2)]
    for launch in launches:
        out = decode_attention(q, ks, vs, rows, pos, **launch, **kw).double()
        err = ((out - ref).norm() / ref.norm()).item()
        print(f"{layout} {dtype} {launch or 'default launch'}: rel err {err:.1e}")
        assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), launch


def attention_rows(layout: str, dtype, gen, device, B: int, num_rows: int, hkv: int, D: int,
                   max_blocks: int = 20, page: int = 16, sink: int = 4, window: int = 60):
    """B random rows of a store of `num_rows` rows (the first at position 0, the second at 3, the
    others anywhere in `max_blocks` pages), in pages of `page` keys (layout "paged...") or in
    rings of `sink` + `window` slots: (rows, pos, the layout's decode_attention keywords, the slot
    each row's new token takes, K store, V store)."""
    from engine.kv.policy import ring_slot

    rows = torch.randperm(num_rows, device=device, generator=gen)[:B]
    pos = torch.randint(0, page * max_blocks - 1, (B,), device=device, generator=gen)
    pos[0], pos[1] = 0, 3
    if layout.startswith("paged"):
        table = (1 + torch.randperm(num_rows * max_blocks, device=device, generator=gen)).view(num_rows, -1)
        kw = dict(block_table=table.to(torch.int32), page=page)
        n = (num_rows * max_blocks + 2) * page
        slot = table[rows, pos // page].long() * page + pos % page
    else:
        kw = dict(ring=(sink, window))
        n = num_rows * (sink + window)
        slot = torch.tensor([int(r) * (sink + window) + ring_slot(int(p), sink, window) for r, p in zip(rows, pos)],
                            device=device)
    ks = torch.randn(n, hkv, D, device=device, dtype=dtype, generator=gen)
    vs = torch.randn(n, hkv, D, device=device, dtype=dtype, generator=gen)
    return rows, pos, kw, slot, ks, vs


def check_decode_attention_store(layout: str, dtype, launch: dict | None = None,
                                 device: str = "cuda") -> tuple[float, float]:
    """The kernels with `store_slot` (attend, then write the new K/V where the reference writes
    it; a ring also keeps what it overwrote in `evicted`) against the reference: (output rel
    err, max |store or evicted diff|). paged-wide: 16 query heads over two K/V heads of 512, as
    Gemma 4's exact layers."""
    from engine.kernels.decode_attention import decode_attention, reference

    gen = torch.Generator(device=device).manual_seed(5)
    B, H, hkv, D = 9, 8, 2, 64
    if layout == "paged-wide":
        H, D = 16, 512
    rows, pos, kw, slot, ks, vs = attention_rows(layout, dtype, gen, device, B, num_rows=12, hkv=hkv, D=D)
    q = torch.randn(B, H, D, device=device, dtype=dtype, generator=gen)
    kw.update(scale=D ** -0.5, softcap=None, attn_window=50 if layout == "paged-window" else None,
              k_new=torch.randn(B, hkv, D, device=device, dtype=dtype, generator=gen),
              v_new=torch.randn(hkv, B, D, device=device, dtype=dtype, generator=gen).transpose(0, 1))
    rk, rv = ks.clone(), vs.clone()
    evicted = ref_evicted = None
    if not layout.startswith("paged"):
        evicted = (torch.full((B + 3, hkv, D), 7.0, device=device, dtype=dtype),
                   torch.full((B + 3, hkv, D), 7.0, device=device, dtype=dtype))
        ref_evicted = (evicted[0].clone(), evicted[1].clone())
        held = (ks[slot].clone(), vs[slot].clone())  # what the slots hold before the store
    ref = reference(q, rk, rv, rows, pos, store_slot=slot, evicted=ref_evicted, **kw).double()
    out = decode_attention(q, ks, vs, rows, pos, store_slot=slot, evicted=evicted, **(launch or {}), **kw).double()
    err = ((out - ref).norm() / ref.norm()).item()
    diffs = [(ks - rk).abs().max().item(), (vs - rv).abs().max().item()]
    if evicted is not None:
        assert torch.equal(ref_evicted[0][:B], held[0]) and torch.equal(ref_evicted[1][:B], held[1])
        diffs += [(evicted[0] - ref_evicted[0]).abs().max().item(), (evicted[1] - ref_evicted[1]).abs().max().item()]
    return err, max(diffs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["paged", "paged-window", "paged-wide", "ring"])
@pytest.mark.parametrize("launch", [{}, dict(splits=1, block=32), dict(splits=64, block=16),
                                    dict(splits=1, block=32, pdl=True), dict(splits=64, block=16, pdl=True)],
                         ids=["default", "one-split", "merged", "one-split-pdl", "merged-pdl"])
def test_decode_attention_kernel_stores_the_new_token(layout, dtype, launch):
    """Launched with PDL, the kernels read the store before their wait (kernels/launch.py): the
    same outputs, stores and kept K/V."""
    if launch.get("pdl"):
        from engine.kernels import launch as pdl_launch

        assert pdl_launch.supported(torch.device("cuda")), "this GPU or Triton cannot launch with PDL"
    err, store_diff = check_decode_attention_store(layout, dtype, launch)
    print(f"{layout} {dtype} {launch} with store: rel err {err:.1e}, store diff {store_diff}")
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5) and store_diff == 0


@pytest.mark.parametrize("layout", ["paged", "ring"])
@pytest.mark.parametrize("launch", [dict(splits=1, block=32), dict(splits=64, block=16)], ids=["one-split", "merged"])
def test_decode_attention_with_pdl_reads_q_and_the_new_token_after_a_late_writer(layout, launch):
    """Launched with PDL right behind a kernel that lets it start at once and writes q, k_new and
    v_new only after a long spin (late_writer.py), the attention reads what that kernel wrote:
    output, store and kept K/V equal the reference's on those values. The control: a kernel in the
    same place that reads the buffer before its PDL wait gets what was there before, so on this
    GPU a read ahead of the wait would show. (Split, the merge kernel reads q and the new token
    before its own wait, which is safe because it starts only after every partial program has
    passed the wait on the writer: the test holds that chain.)"""
    from engine.kernels import launch as pdl_launch
    from engine.kernels.decode_attention import decode_attention, reference
    from tests.equivalence.late_writer import early_read, late_copy

    assert pdl_launch.supported(torch.device("cuda")), "this GPU or Triton cannot launch with PDL"
    device, dtype = "cuda", torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(9)
    B, H, hkv, D = 6, 8, 2, 64
    rows, pos, kw, slot, ks, vs = attention_rows(layout, dtype, gen, device, B, num_rows=8, hkv=hkv, D=D)
    shapes = ((B, H, D), (B, hkv, D), (B, hkv, D))
    sizes = [a * b * c for a, b, c in shapes]
    fresh = torch.randn(sum(sizes), device=device, generator=gen).to(dtype)
    stale = -fresh

    def inputs(buf):
        return [t.view(shape) for t, shape in zip(buf.split(sizes), shapes)]

    rk, rv = ks.clone(), vs.clone()
    kept_ref = (torch.zeros(B, hkv, D, device=device, dtype=dtype), torch.zeros(B, hkv, D, device=device, dtype=dtype))
    q, k_new, v_new = inputs(fresh)
    want = reference(q, rk, rv, rows, pos, scale=D ** -0.5, k_new=k_new, v_new=v_new, store_slot=slot,
                     evicted=kept_ref if layout == "ring" else None, **kw).float()
    buf = torch.empty_like(fresh)
    for attempt in ("compile", "check"):  # the first round compiles: the host is slower than any spin
        k, v = ks.clone(), vs.clone()
        kept = (torch.zeros_like(kept_ref[0]), torch.zeros_like(kept_ref[1]))
        torch.cuda.synchronize()
        buf.copy_(stale)
        late_copy(fresh, buf)
        seen = early_read(buf)
        buf.copy_(stale)
        late_copy(fresh, buf)
        q, k_new, v_new = inputs(buf)
        out = decode_attention(q, k, v, rows, pos, scale=D ** -0.5, k_new=k_new, v_new=v_new, store_slot=slot,
                               evicted=kept if layout == "ring" else None, pdl=True, **launch, **kw).float()
        torch.cuda.synchronize()
    early = (seen == stale).float().mean().item()
    err = ((out - want).norm() / want.norm()).item()
    print(f"{layout} {launch}: the early reader saw {early:.0%} stale; attention rel err {err:.1e}")
    assert early > 0.5, "the early reader saw the late writer's values: no PDL window to test in"
    assert torch.equal(buf, fresh) and err < 1e-2
    assert torch.equal(k, rk) and torch.equal(v, rv)
    if layout == "ring":
        assert torch.equal(kept[0], kept_ref[0]) and torch.equal(kept[1], kept_ref[1])


@pytest.mark.parametrize("policy", ["s5", "native"])
def test_cuda_graph_decode_equals_eager_decode(policy):
    """bfloat16 random Gemma-3 (1B-like head layout, small): greedy tokens of the captured decode
    agree with the eager engine's over 64 steps, for rows of different lengths joining at different
    times (graph buckets 1..8)."""
    rng = random.Random(7)
    model = tiny_random_model(3, dtype=torch.bfloat16, num_hidden_layers=6, head_dim=64, hidden_size=256,
                              num_attention_heads=4, num_key_value_heads=1).cuda()
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 40, 130, 77, 300)]
    outs = {}
    for graphs in (False, True):
        cfg = EngineConfig(model="tiny-random", device="cuda", dtype="bfloat16", kv_policy=policy, kv_sink=2,
                           kv_window=8, max_num_batched_tokens=64, kv_cache_bytes=1 << 24, max_rows=8,
                           decode_graphs=graphs)
        engine = Engine(cfg, LoadedModel(model, None, "tiny"))
        outs[graphs] = run_all(engine, [Request(f"r{i}", p, greedy(64)) for i, p in enumerate(prompts)],
                               {"r1": 3, "r2": 9, "r4": 30})
        if graphs:
            assert engine.runner.decoder.steps > 50 and engine.runner.decoder.graphs
        engine.check_invariants()
    # bf16 rounding differs between the kernels (SDPA vs the split decode kernel)
    prefix = equal_prefix((outs[True][r], outs[False][r]) for r in outs[True])
    print(f"{policy}: {prefix}/{64 * len(prompts)} tokens equal before a row's first difference")
    assert prefix >= 0.9 * 64 * len(prompts)


def test_cuda_rows_never_read_reused_blocks():
    """1,000 short requests through 4 rows and a small block pool (rows and blocks are reused
    hundreds of times): each request's greedy tokens equal a run of it alone on a fresh engine."""
    rng = random.Random(11)
    model = tiny_random_model(4).cuda()
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 40))] for _ in range(1000)]
    cfg = EngineConfig(model="tiny-random", device="cuda", kv_policy="s5", kv_sink=2, kv_window=5,
                       max_rows=4, max_num_batched_tokens=64, kv_cache_bytes=1 << 18)
    engine = Engine(cfg, LoadedModel(model, None, "tiny"))
    reqs = [Request(f"r{i}", p, greedy(rng.randrange(1, 12))) for i, p in enumerate(prompts)]
    out = run_all(engine, reqs)
    engine.check_invariants()
    alone = Engine(cfg, LoadedModel(model, None, "tiny"))
    for r in reqs[::25]:  # 40 of them, each alone
        assert run_all(alone, [r])[r.request_id] == out[r.request_id]
    assert engine.runner.decoder.steps > 500


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_rmsnorm_replaces_gemma_norms_and_matches(dtype):
    """Every RMSNorm of a Gemma-3 model is replaced on CUDA; each agrees with the stock module on
    fresh inputs, contiguous or not."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from engine.kernels.rmsnorm import FusedRMSNorm, fuse_norms

    model = tiny_random_model(5, dtype=dtype).cuda()
    stock = sum(isinstance(m, Gemma3RMSNorm) for m in model.modules())
    assert fuse_norms(model) == stock > 0
    assert not any(isinstance(m, Gemma3RMSNorm) for m in model.modules())
    for shape, transpose in (((9, 64), False), ((1, 7, 4, 16), True), ((2, 3, 64), False)):
        norm = Gemma3RMSNorm(shape[-1], eps=1e-6).cuda().to(dtype)
        norm.weight.data.normal_()
        x = torch.randn(shape, device="cuda").to(dtype)
        if transpose:
            x = x.transpose(1, 2)
        want = norm(x).double()
        got = FusedRMSNorm(norm.weight, norm.eps, 1.0)(x).double()
        err = ((got - want).norm() / want.norm()).item()
        assert err < (1e-2 if dtype == torch.bfloat16 else 1e-6), err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_small_batch_linear_matches_library(dtype):
    """The split-K small-batch kernel against F.linear on fresh random shapes and row counts."""
    import torch.nn.functional as F

    from engine.kernels.small_linear import small_linear

    gen = torch.Generator(device="cuda").manual_seed(1)
    for m, n, k in [(1, 1024, 2560), (3, 2560, 10240), (16, 333, 1152), (7, 4096, 130)]:
        x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
        w = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
        want = F.linear(x.double(), w.double())
        err = ((small_linear(x, w, 132).double() - want).norm() / want.norm()).item()
        assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), (m, n, k, err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_matches_library_and_plans_only_faster_launches(dtype):
    """The one-kernel few-row product against F.linear on odd shapes, every candidate launch that
    fits the row count, 1..8 rows; the plan over a stack of weights holds only row counts and
    launches it may use."""
    import torch.nn.functional as F

    from engine.kernels.small_linear import (GEMV_CANDIDATES, GEMV_ROWS, MMA_CANDIDATES, MMA_ROWS, gemv, gemv_fits,
                                             plan_gemv)

    gen = torch.Generator(device="cuda").manual_seed(2)
    for m, n, k in [(1, 1024, 2560), (3, 2560, 10240), (8, 333, 1152), (5, 4100, 130), (2, 7, 3000)]:
        x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
        w = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
        want = F.linear(x.double(), w.double())
        for cfg in (c for c in GEMV_CANDIDATES if gemv_fits(c, m)):
            for pdl in (False, True):  # with PDL the first weight tile is read before the wait
                err = ((gemv(x, w, **cfg, pdl=pdl).double() - want).norm() / want.norm()).item()
                assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), (m, n, k, cfg, pdl, err)
    weights = [torch.randn(2048, 2560, device="cuda", generator=gen).to(dtype) for _ in range(8)]
    for pdl in (False, True):
        for gelu in (False, True):
            plan = plan_gemv(weights, pdl_for=lambda rows: pdl, gelu=gelu)
            print(f"{dtype}: gemv plan for 2048x2560 (pdl {pdl}, gelu {gelu}): {plan}")
            assert set(plan) <= set(GEMV_ROWS + MMA_ROWS)
            assert all(cfg in GEMV_CANDIDATES and gemv_fits(cfg, rows, gelu) for rows, cfg in plan.items()
                       if rows in GEMV_ROWS)
            assert all({k: v for k, v in cfg["mma"].items() if k != "split"} in MMA_CANDIDATES
                       for rows, cfg in plan.items() if rows in MMA_ROWS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mma_rows_matches_library_for_every_launch_and_split(dtype):
    """The tensor-core product of 9-64 rows, every candidate launch with every K split that fits,
    on Gemma-3 4B's O and 1B's gate/up shapes and an odd one (columns not a multiple of a tile),
    at 9, 16, 33 and 64 rows: near the float64 reference; the same bits again on a second call
    and with PDL (the split's partials are summed in split order, whichever program ends last),
    every counter back at zero; with the activation, the same bits as `gelu_mul` of the
    launch's product."""
    import torch.nn.functional as F

    from engine.kernels import fused_ops
    from triton.runtime.errors import OutOfResources

    from engine.kernels.small_linear import MMA_CANDIDATES, MMA_COUNTS, MMA_SPLITS, mma_rows, mma_rows_fits

    gen = torch.Generator(device="cuda").manual_seed(4)
    counts = torch.zeros(MMA_COUNTS, dtype=torch.int32, device="cuda")
    runs = skipped = 0
    for n, k in [(2560, 2048), (2 * 6912, 1152), (2 * 333, 1024)]:
        w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(dtype)
        for m in (9, 16, 33, 64):
            x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
            want = F.linear(x.double(), w.double())
            want_act = fused_ops.gelu_mul_ref(want)
            for cfg in MMA_CANDIDATES:
                for split in MMA_SPLITS:
                    if not mma_rows_fits(m, n // 2, k, cfg["block_n"], cfg["block_k"], split):
                        continue
                    launch = dict(cfg, split=split, counts=counts)
                    try:
                        got = mma_rows(x, w, **launch)
                        act = mma_rows(x, w, **launch, gelu=True)
                    except OutOfResources:  # float32 tiles of the widest launches, with the activation's two
                        skipped += 1
                        continue
                    assert got.shape == (m, n) and got.dtype == dtype
                    err = ((got.double() - want).norm() / want.norm()).item()
                    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), (n, k, m, launch, err)
                    assert torch.equal(mma_rows(x, w, **launch), got), (n, k, m, cfg, split)
                    assert torch.equal(mma_rows(x, w, **launch, pdl=True), got), (n, k, m, cfg, split)
                    assert torch.equal(act, fused_ops.gelu_mul(got)), (n, k, m, cfg, split)
                    err = ((act.double() - want_act).norm() / want_act.norm()).item()
                    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), (n, k, m, launch, err)
                    assert not counts.any(), (n, k, m, cfg, split)
                    runs += 1
    assert runs >= 3 * 4 * (len(MMA_CANDIDATES) if dtype == torch.bfloat16 else 1), runs
    assert dtype != torch.bfloat16 or not skipped, skipped
    print(f"mma_rows, {dtype}: {runs} launches agree ({skipped} beyond shared memory), split sums repeatable, "
          f"activation equal to gelu_mul")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_gate_up_with_its_activation_equals_the_product_then_gelu_mul(dtype):
    """`gemv(..., gelu=True)` (the MLP's [gate; up] weight, gelu_tanh(gate) x up stored by the
    product's kernel) with every candidate launch that fits, 1..8 rows, on Gemma-3 1B's gate/up
    shape and odd ones (I not a multiple of a program's rows, K not of its tile), with and
    without PDL: the same bits as `fused_ops.gelu_mul` of the same launch's product (each program
    computes the gate and up rows as the plain launch does, and the activation is the one Triton
    function every activation kernel stores with), and near the float64 reference."""
    import torch.nn.functional as F

    from engine.kernels import fused_ops
    from engine.kernels.small_linear import GEMV_CANDIDATES, gemv, gemv_fits

    gen = torch.Generator(device="cuda").manual_seed(3)
    runs = 0
    for n, k in [(2 * 6912, 1152), (2 * 333, 1000), (2 * 5, 130)]:
        w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).to(dtype)
        for m in (1, 2, 3, 8):
            x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
            want = fused_ops.gelu_mul_ref(F.linear(x.double(), w.double()))
            for cfg in (c for c in GEMV_CANDIDATES if gemv_fits(c, m, gelu=True)):
                got = gemv(x, w, **cfg, gelu=True)
                assert got.shape == (m, n // 2) and got.dtype == dtype, (n, k, m, cfg)
                assert torch.equal(got, fused_ops.gelu_mul(gemv(x, w, **cfg))), (n, k, m, cfg)
                assert torch.equal(gemv(x, w, **cfg, pdl=True, gelu=True), got), (n, k, m, cfg)
                err = ((got.double() - want).norm() / want.norm()).item()
                assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), (n, k, m, cfg, err)
                runs += 1
    assert runs >= 3 * 4 * 4, runs
    print(f"gemv gate/up with the activation, {dtype}: {runs} launches, each equal to gelu_mul of its product")


def test_substituted_linears_keep_model_outputs():
    """A bf16 model after substitution gives the same logits (bf16 tolerance) at 1..16 rows."""
    from engine.kernels.small_linear import SmallBatchLinear, substitute_linears

    model = tiny_random_model(6, dtype=torch.bfloat16, hidden_size=512, intermediate_size=2048,
                              head_dim=128, num_attention_heads=4, num_key_value_heads=2).cuda()
    ids = torch.randint(3, 512, (1, 16), device="cuda")
    with torch.inference_mode():
        want = [model(ids[:, :n]).logits.float() for n in (1, 5, 16)]
        chosen = substitute_linears(model)
        print(f"substituted shapes (out, in) -> max rows: {chosen}")
        got = [model(ids[:, :n]).logits.float() for n in (1, 5, 16)]
    n_sub = sum(isinstance(m, SmallBatchLinear) for m in model.modules())
    assert n_sub == sum(1 for m in model.modules() if isinstance(m, SmallBatchLinear)
                        and (m.out_features, m.in_features) in chosen)
    assert all(1 <= r <= 16 for r in chosen.values())
    for w, g in zip(want, got):
        assert ((g - w).norm() / w.norm()).item() < 2e-2


@pytest.mark.parametrize("nf4", [False, True])
def test_cuda_bnb4_engine_agrees_with_hf_on_the_same_weights(nf4):
    """bitsandbytes NF4 weights (quantized in memory from a bf16 random Gemma-3): the engine's
    greedy tokens (captured decode graphs; bitsandbytes' layers, or with `nf4` the engine's NF4
    kernels in its fused forward) agree with HF generate on the same quantized model
    (bitsandbytes' own forward)."""
    pytest.importorskip("bitsandbytes")
    from engine.model.loader import quantize_bnb4

    kw = dict(dtype=torch.bfloat16, num_hidden_layers=6, head_dim=64, hidden_size=256, num_attention_heads=4,
              num_key_value_heads=1)
    model = quantize_bnb4(tiny_random_model(5, **kw).cuda(), torch.bfloat16)
    ref = quantize_bnb4(tiny_random_model(5, **kw).cuda(), torch.bfloat16)
    ref.set_attn_implementation("sdpa")
    assert any(type(m).__name__ == "Linear4bit" for m in model.modules())
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 40, 130)]
    cfg = EngineConfig(model="tiny-random", device="cuda", dtype="bfloat16", quantization="bnb-4bit",
                       kv_policy="native", max_num_batched_tokens=64, kv_cache_bytes=1 << 24, max_rows=4,
                       nf4_kernels=nf4)
    engine = Engine(cfg, LoadedModel(model, None, "tiny"))
    # nf4: the fused forward on the engine's NF4 kernels (test_cuda_nf4.py holds them to bitsandbytes')
    repacked = any(type(m).__name__ == "NF4Linear" for m in model.modules())
    assert (engine.runner.fused is not None) == nf4 and repacked == nf4
    out = run_all(engine, [Request(f"r{i}", p, greedy(32)) for i, p in enumerate(prompts)])
    assert engine.runner.decoder.steps > 20
    prefix = equal_prefix((out[f"r{i}"], hf_greedy(ref, p, 32)) for i, p in enumerate(prompts))
    print(f"bnb-4bit: {prefix}/{32 * len(prompts)} tokens equal to HF generate before a row's first difference")
    assert prefix >= 0.8 * 32 * len(prompts)
    engine.check_invariants()


def test_cuda_device_sampler_is_seeded_and_top_k_1_is_greedy():
    from engine import SamplingParams

    model = tiny_random_model(6).cuda()
    cfg = EngineConfig(model="tiny-random", device="cuda", max_num_batched_tokens=64, kv_cache_bytes=1 << 22,
                       max_rows=8)
    prompts = [[5, 6, 7, i] for i in range(6)]
    runs = []
    for _ in range(2):
        engine = Engine(cfg, LoadedModel(model, None, "tiny"))
        reqs = [Request(f"s{i}", p, SamplingParams(max_tokens=24, temperature=1.3, top_p=0.9, seed=i, ignore_eos=True))
                for i, p in enumerate(prompts)]
        reqs += [Request(f"k{i}", p, SamplingParams(max_tokens=24, temperature=0.7, top_k=1, seed=i, ignore_eos=True))
                 for i, p in enumerate(prompts)]
        runs.append(run_all(engine, reqs))
    assert runs[0] == runs[1]
    greedy_out = run_all(Engine(cfg, LoadedModel(model, None, "tiny")),
                         [Request(f"k{i}", p, greedy(24)) for i, p in enumerate(prompts)])
    assert all(runs[0][f"k{i}"] == greedy_out[f"k{i}"] for i in range(len(prompts)))
    assert any(runs[0][f"s{i}"] != greedy_out[f"k{i}"] for i in range(len(prompts)))


@pytest.mark.parametrize("swap_bytes", [1 << 30, 0])
def test_cuda_swapped_and_rebuilt_rows_come_back_exactly(swap_bytes):
    """Through captured decode graphs: 5 sessions x 4 turns through 2 rows, rows moved to host
    memory (or given up and rebuilt by replay), give the tokens of 8 rows that never left."""
    rng = random.Random(3)
    turns = [[([rng.randrange(3, 512) for _ in range(rng.randrange(2, 30))], 5) for _ in range(4)] for _ in range(5)]
    model = tiny_random_model(0).cuda()
    base = dict(model="tiny-random", device="cuda", kv_sink=2, kv_window=5, kv_cache_bytes=1 << 22,
                max_num_batched_tokens=32)
    roomy = Engine(EngineConfig(**base, max_rows=8), LoadedModel(model, None, "tiny"))
    tight = Engine(EngineConfig(**base, max_rows=2, swap_bytes=swap_bytes), LoadedModel(model, None, "tiny"))
    want, _ = converse(roomy, turns)
    got, _ = converse(tight, turns)
    print(f"\nswap_bytes={swap_bytes}: {tight.stats['swaps_in']} swapped in, {tight.stats['rebuilds']} rebuilt")
    assert got == want and tight.stats["swaps_in"] + tight.stats["rebuilds"] >= 10
    tight.check_invariants()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_layer_kernels_match_their_references(dtype):
    """add_rmsnorm, qk_norm_rope (with tables, and with the angles computed in the kernel) and
    gelu_mul (Gemma-3 4B widths) against their torch versions, which equal the stock layer ops
    (tests/engine/test_fused_forward.py)."""
    from engine.kernels import fused_ops as ops

    g = torch.Generator(device="cuda").manual_seed(0)
    N, H, Hkv, D, inter, eps = 2560, 8, 4, 256, 10240, 1e-6

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    worst = {}
    for T in (1, 7, 64):
        h, y = rnd(T, N, scale=3), rnd(T, N)
        wp, wn = rnd(N, scale=0.3), rnd(N, scale=0.3)
        want = ops.add_rmsnorm_ref(h, y, wp, wn, eps)
        got = ops.add_rmsnorm(h.clone(), y, wp, wn, eps)
        got_norm = ops.rmsnorm(h, wn, eps)
        pos = torch.randint(0, 100_000, (T,), device="cuda").float()
        inv = 1.0 / (10_000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
        ang = torch.cat([pos[:, None] * inv] * 2, dim=1)
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        qkv = rnd(T, (H + 2 * Hkv) * D)
        wq, wk = rnd(D, scale=0.3), rnd(D, scale=0.3)
        want_qkv = ops.qk_norm_rope_ref(qkv, wq, wk, cos, sin, H, Hkv, eps)
        got_qkv = ops.qk_norm_rope(qkv.clone(), wq, wk, cos, sin, H, Hkv, eps)
        # the angles computed in the kernel: the stock tables' values, bit for bit
        ipos = pos.long()
        tables = ops.rope_tables(ipos, inv * 0.125, 0.75, dtype)
        want_at = ops.qk_norm_rope_ref(qkv, wq, wk, *tables, H, Hkv, eps)
        got_at = ops.qk_norm_rope_at(qkv.clone(), wq, wk, ipos, inv * 0.125, 0.75, H, Hkv, eps)
        assert all(torch.equal(a, b) for a, b in zip(got_at, ops.qk_norm_rope(qkv.clone(), wq, wk, *tables, H, Hkv, eps)))
        gu = rnd(T, 2 * inter, scale=2)
        pairs = {"add_rmsnorm h": (got[0], want[0]), "add_rmsnorm x": (got[1], want[1]),
                 "rmsnorm": (got_norm, ops.rmsnorm_ref(h, wn, eps)),
                 "q": (got_qkv[0], want_qkv[0]), "k": (got_qkv[1], want_qkv[1]), "v": (got_qkv[2], want_qkv[2]),
                 "q at": (got_at[0], want_at[0]), "k at": (got_at[1], want_at[1]),
                 "gelu_mul": (ops.gelu_mul(gu), ops.gelu_mul_ref(gu))}
        for name, (a, b) in pairs.items():
            rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
            worst[name] = max(worst.get(name, 0.0), rel)
    print(f"{dtype}: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    assert all(v < tol for v in worst.values()), worst


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemma4_kernels_match_their_references(dtype):
    """The Gemma 4 forms (offset-0 norms, V's scale-free norm in place and taken from K, three
    norms of the residual stream, the layer's end) and the MoE kernels (router top-k, experts:
    Gemma-4 26B-A4B widths, 128 experts, top 8) against their torch versions, which equal the
    stock modules (tests/engine/test_fused_forward.py)."""
    from engine.kernels import fused_ops as ops
    from engine.kernels import moe

    g = torch.Generator(device="cuda").manual_seed(0)
    N, H, Hkv, D, eps = 2816, 16, 8, 256, 1e-6
    E, K, inter = 128, 8, 704

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    worst = {}
    gate_up, down = rnd(E, 2 * inter, N, scale=0.05), rnd(E, N, inter, scale=0.05)
    scale = torch.rand(E, device="cuda", generator=g).to(dtype) + 0.5
    for T in (1, 8, 64):
        h, y = rnd(T, N, scale=3), rnd(T, N)
        w1, w2, w3, w4 = (rnd(N, scale=0.3) + 1 for _ in range(4))
        want = ops.add_rmsnorm_ref(h, y, w1, w2, eps, 0.0, also=(w3, w4.float()))
        got = ops.add_rmsnorm(h.clone(), y, w1, w2, eps, 0.0, also=(w3, w4.float()))
        pos = torch.randint(0, 100_000, (T,), device="cuda")
        inv = 1.0 / (10_000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
        wq, wk = rnd(D, scale=0.3) + 1, rnd(D, scale=0.3) + 1
        qkv = rnd(T, (H + 2 * Hkv) * D)
        want_s = ops.qk_norm_rope_ref(qkv, wq, wk, *ops.rope_tables(pos, inv, 1.0, dtype), H, Hkv, eps, 0.0, True)
        got_s = ops.qk_norm_rope_at(qkv.clone(), wq, wk, pos, inv, 1.0, H, Hkv, eps, 0.0, True)
        inv_p = torch.cat([1.0 / (1e6 ** (torch.arange(0, 128, 2, device="cuda").float() / 512)),
                           torch.zeros(192, device="cuda")])  # "proportional": a quarter rotated
        wq2, wk2 = rnd(512, scale=0.3) + 1, rnd(512, scale=0.3) + 1
        qk = rnd(T, (H + 2) * 512)
        want_f = ops.qk_norm_rope_ref(qk, wq2, wk2, *ops.rope_tables(pos, inv_p, 1.0, dtype), H, 2, eps, 0.0, True,
                                      True)
        got_f = ops.qk_norm_rope_at(qk.clone(), wq2, wk2, pos, inv_p, 1.0, H, 2, eps, 0.0, True, True)
        d, e = rnd(T, N), rnd(T, N, scale=0.1)
        scalar = torch.tensor([0.8], device="cuda").to(dtype)
        want_out = ops.layer_out_ref(h, d, e, w1, w2, w3, scalar, w4, eps)
        got_out = ops.layer_out(h.clone(), d, e, w1, w2, w3, scalar, w4, eps)
        want_dense = ops.layer_out_ref(h, d, None, None, None, w3, scalar, w4, eps)
        got_dense = ops.layer_out(h.clone(), d, None, None, None, w3, scalar, w4, eps)
        logits = torch.randn(T, E, device="cuda", generator=g) * 2  # float32: bf16 logits tie at times
        want_w, want_i = moe.router_topk_ref(logits, K, scale)
        got_w, got_i = moe.router_topk(logits, K, scale)
        assert torch.equal(got_i.long().sort(1).values, want_i.sort(1).values)  # no ties in these draws
        order = got_i.long().argsort(1), want_i.argsort(1)
        x = rnd(T, N)
        part = moe.experts(x, got_i, got_w, gate_up, down, pairs=True)  # the pairs' partials, for layer_out
        summed = moe.experts(x, got_i, got_w, gate_up, down)
        assert part.shape == (T * K, N) and torch.equal(moe.sum_pairs_ref(part, K, dtype), summed)
        for a, b in zip(ops.layer_out(h.clone(), d, part, w1, w2, w3, scalar, w4, eps, pairs=K),
                        ops.layer_out(h.clone(), d, summed, w1, w2, w3, scalar, w4, eps)):
            assert torch.equal(a, b), "layer_out adds the pairs to the bits of their sum"
        pairs = {"add_rmsnorm h": (got[0], want[0]), **{f"add_rmsnorm x{i}": (got[i], want[i]) for i in (1, 2, 3)},
                 **{f"sliding {n}": (a, b) for n, a, b in zip("qkv", got_s, want_s)},
                 **{f"full {n}": (a, b) for n, a, b in zip("qkv", got_f, want_f)},
                 "layer_out h": (got_out[0], want_out[0]), "layer_out x": (got_out[1], want_out[1]),
                 "dense layer_out h": (got_dense[0], want_dense[0]),
                 "router weights": (got_w.gather(1, order[0]), want_w.gather(1, order[1])),
                 "experts": (moe.experts(x, got_i, got_w, gate_up, down), moe.experts_ref(x, want_i, want_w, gate_up,
                                                                                          down)),
                 "experts split down": (moe.experts(x, got_i, got_w, gate_up, down,
                                                    down_launch=dict(moe.DOWN, split=not moe.DOWN["split"])),
                                        moe.experts(x, got_i, got_w, gate_up, down))}
        for name, (a, b) in pairs.items():
            rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
            worst[name] = max(worst.get(name, 0.0), rel)
    print(f"{dtype}: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    assert all(v < tol for v in worst.values()), worst


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
@pytest.mark.parametrize("policy", ["s5", "native"])
def test_cuda_fused_forward_equals_stock_forward(policy, family):
    """The engine on its fused layer forward (graphs) against the stock layers (graphs; float32
    experts decode uncaptured, see `stock_experts_capturable`): float32 logits agree to float
    rounding; bf16 greedy tokens agree up to rounding-driven divergence. Gemma 4: a mixture of
    experts on the MoE kernels (decode steps and prefill chunks up to 64 tokens)."""
    for dtype in (torch.float32, torch.bfloat16):
        prefix, total, diff = compare_tiny_engines(family, dtype, policy, "fused_layers", check=lambda engine, fused: (
            # the fused forward computes RoPE in its kernel (this transformers' tables matched)
            (engine.runner.fused is not None) == fused and (not fused or engine.runner.fused.rope is not None)))
        print(f"{family} {policy} {dtype}: {prefix}/{total} tokens equal; max |logit diff| {diff:.2e}")
        if dtype == torch.float32:
            assert prefix == total and diff < 1e-3
        else:
            assert prefix >= 0.9 * total


def compare_tiny_engines(family: str, dtype, policy: str, knob: str, check) -> tuple[int, int, float]:
    """Two engines on the same tiny random model (graphs), one with EngineConfig `knob` True and
    one with it False, over 4 greedy requests of 48 tokens joining at different steps: (tokens
    equal before each row's first difference, tokens in all, max |logit diff| over the steps both
    recorded). `check(engine, value)` must hold for each engine."""
    from tests.helpers import tiny_gemma4

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 40, 130, 77)]
    outs, recs = {}, {}
    for value in (True, False):
        if family == "gemma3":
            model = tiny_random_model(3, dtype=dtype, num_hidden_layers=6, head_dim=64, hidden_size=256,
                                      num_attention_heads=4, num_key_value_heads=1).cuda()
        else:
            model = tiny_gemma4(3, head_dim=64, global_head_dim=128, hidden_size=256).to("cuda", dtype)
        cfg = EngineConfig(model="tiny-random", device="cuda", dtype=str(dtype).split(".")[1], kv_policy=policy,
                           kv_sink=2, kv_window=8, max_num_batched_tokens=64, kv_cache_bytes=1 << 24,
                           max_rows=8, **{knob: value})
        engine = Engine(cfg, LoadedModel(model, None, "tiny"))
        assert check(engine, value)
        recs[value] = Recorder(engine)
        outs[value] = run_all(engine, [Request(f"r{i}", p, greedy(48)) for i, p in enumerate(prompts)],
                              {"r1": 3, "r2": 9})
        engine.check_invariants()
    prefix = equal_prefix((outs[True][r], outs[False][r]) for r in outs[True])
    common = recs[True].logits.keys() & recs[False].logits.keys()
    diff = max((recs[True].logits[k] - recs[False].logits[k]).abs().max().item() for k in common)
    return prefix, 48 * len(prompts), diff


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_cuda_pdl_launches_change_nothing(family, monkeypatch):
    """Kernels launched with programmatic dependent launch (the default on Hopper) against plain
    launches, on captured graphs: each PDL kernel waits for its predecessor before touching what
    it writes, so tokens and logits are those of plain launches (a kernel that read or wrote too
    early would race with the one before it and show here as wrong logits). The `gemv` launch
    settings are timed when a fused forward is built, and two builds can time different winners
    (which round differently in bfloat16): both engines here take the first build's plans, so
    they differ in the launch mode alone."""
    from engine.kernels import launch, small_linear
    from engine.model import fused_forward

    plans = {}

    def plan_once(weights, rows=small_linear.GEMV_ROWS, pdl_for=None, gelu=False):
        key = (tuple(weights[0].shape), weights[0].dtype, len(weights), rows, gelu)
        if key not in plans:
            plans[key] = small_linear.plan_gemv(weights, rows, pdl_for, gelu)
        return plans[key]

    monkeypatch.setattr(fused_forward, "plan_gemv", plan_once)  # both families plan through fused_forward

    assert launch.supported(torch.device("cuda")), "this GPU or Triton cannot launch with PDL"
    for dtype in (torch.float32, torch.bfloat16):
        plans.clear()
        prefix, total, diff = compare_tiny_engines(family, dtype, "s5", "pdl", check=lambda engine, pdl: (
            engine.runner.pdl == pdl and engine.runner.fused is not None and engine.runner.fused.pdl == pdl))
        print(f"{family} {dtype}: {prefix}/{total} tokens equal; max |logit diff| {diff:.2e}")
        assert prefix == total and diff < (1e-4 if dtype == torch.float32 else 5e-2)


@pytest.mark.parametrize("policy", ["s5", "native"])
def test_cuda_overlap_equals_plain_order(policy):
    """Captured decode graphs launched ahead of the host (the CUDA default) against steps
    applied in order, float32, one session (both run the same graphs): equal tokens and books,
    and K/V to float rounding, through turns that end by a stop token one step before the host
    knew (the extra step is undone: its ring stores put back from what the kernel kept) and
    aborted turns. A slot undone wrongly would hold another token's K/V, off by O(1)."""
    seen = check_turns_with_stops("cuda", policy, sessions=1, stateless=0, rounds=20, atol=1e-4)
    print(policy, seen)
    assert seen["undone_session_rows"] >= 2 and seen["stopped_mid"] >= 1


def test_a_dropped_engine_frees_its_graphs_at_once():
    """Freeing a CUDA graph while another is being captured invalidates that capture, and an
    object in a reference cycle is freed whenever the collector runs (at any allocation). The
    engine's objects form no cycle (tests/engine/test_structure.py), so a dropped engine frees its
    graphs at once, with the collector off: a second engine on the same model then captures its
    own and decodes the same tokens."""
    import gc
    import weakref

    model = tiny_random_model(3, dtype=torch.bfloat16, num_hidden_layers=4, head_dim=64, hidden_size=256,
                              num_attention_heads=4, num_key_value_heads=1).cuda()
    cfg = EngineConfig(model="tiny-random", device="cuda", dtype="bfloat16", kv_sink=2, kv_window=8,
                       max_num_batched_tokens=64, kv_cache_bytes=1 << 24, max_rows=4, decode_graphs=True)
    requests = lambda: [Request(f"r{i}", [5 + i, 6, 7, 8], greedy(24)) for i in range(3)]  # noqa: E731
    gc.collect()
    gc.disable()
    try:
        first = Engine(cfg, LoadedModel(model, None, "tiny"))
        want = run_all(first, requests())
        assert first.runner.decoder.graphs
        refs = [weakref.ref(first), weakref.ref(first.runner.decoder)]
        del first
        assert all(r() is None for r in refs)
        second = Engine(cfg, LoadedModel(model, None, "tiny"))
        assert run_all(second, requests()) == want and second.runner.decoder.graphs
    finally:
        gc.enable()
