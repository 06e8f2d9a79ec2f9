"""The CPU's decode attention kernel (kernels/cpu_attention.py): against SDPA on gathered keys for
random pools, block tables and visible ranges, and with a new key per row that the pool does not
hold yet (a ring layer's decode); and through the engine (paged and ring layers), the same greedy
tokens and logits to float rounding as the gathering path, for every KV policy."""

import pytest
import torch
import torch.nn.functional as F

from engine import Engine, EngineConfig, Request
from engine.kernels.cpu_attention import CpuDecodeAttention
from engine.model.loader import load_model
from tests.helpers import built_kernel, greedy, run_all
from tests.scenarios import Recorder


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return built_kernel(CpuDecodeAttention, tmp_path_factory.mktemp("kcache"))


@pytest.mark.parametrize("b,h,hkv,d,window,longest", [(1, 4, 1, 256, None, 90), (5, 4, 1, 64, None, 90),
                                                      (3, 8, 2, 32, 7, 90), (6, 2, 2, 16, 40, 90),
                                                      (1, 4, 1, 64, None, 1300), (4, 4, 1, 32, 600, 1300)])
def test_kernel_matches_sdpa_on_gathered_keys(kernel, b, h, hkv, d, window, longest):
    """Rows of one key to 1,300 (several splits of 256 keys, merged), windows cutting the front."""
    g = torch.Generator().manual_seed(b * 100 + h + d + longest)
    slots_total = 2000
    pool_k, pool_v = torch.randn(slots_total, hkv, d, generator=g), torch.randn(slots_total, hkv, d, generator=g)
    ends = torch.randint(1, longest, (b,), generator=g)
    ends[-1] = longest
    ends[0] = 1  # a row with one key
    L = int(ends.max())
    slots = torch.stack([torch.randperm(slots_total, generator=g)[:L] for _ in range(b)])
    lo = (ends - window).clamp(min=0) if window else torch.zeros_like(ends)
    q = torch.randn(b, h, d, generator=g)
    out = kernel(q, pool_k, pool_v, slots, lo.to(torch.int32), ends.to(torch.int32), 0.125)
    assert out.shape == (b, h, d)
    for r in range(b):
        keys = slots[r, lo[r] : ends[r]]
        k = pool_k[keys].transpose(0, 1)[None]  # [1, Hkv, n, D]
        v = pool_v[keys].transpose(0, 1)[None]
        ref = F.scaled_dot_product_attention(q[r][None, :, None], k, v, scale=0.125, enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out[r], ref, rtol=1e-5, atol=1e-5)
    # a row's output does not depend on the others (bitwise)
    alone = kernel(q[-1:], pool_k, pool_v, slots[-1:], lo[-1:].to(torch.int32), ends[-1:].to(torch.int32), 0.125)
    assert torch.equal(alone[0], out[-1])


@pytest.mark.parametrize("b,h,hkv,d,longest", [(1, 4, 1, 256, 68), (6, 4, 1, 64, 68), (3, 8, 2, 32, 300)])
def test_kernel_with_a_new_key_per_row_matches_sdpa(kernel, b, h, hkv, d, longest):
    """A ring layer's decode: each row sees some of its ring's slots (none, for one row), then its
    new token's key and value, which the pool does not hold yet."""
    g = torch.Generator().manual_seed(b + h + d)
    pool_k, pool_v = torch.randn(500, hkv, d, generator=g), torch.randn(500, hkv, d, generator=g)
    counts = torch.randint(0, longest + 1, (b,), generator=g)
    counts[0] = 0
    counts[-1] = longest
    slots = torch.stack([torch.randperm(500, generator=g)[:longest] for _ in range(b)])
    k_new, v_new = torch.randn(b, hkv, d, generator=g), torch.randn(b, hkv, d, generator=g)
    q = torch.randn(b, h, d, generator=g)
    hi = (counts + 1).to(torch.int32)
    out = kernel(q, pool_k, pool_v, slots, torch.zeros(b, dtype=torch.int32), hi, 0.0625, k_new, v_new)
    for r in range(b):
        keys = slots[r, : counts[r]]
        k = torch.cat([pool_k[keys], k_new[r][None]]).transpose(0, 1)[None]  # [1, Hkv, n + 1, D]
        v = torch.cat([pool_v[keys], v_new[r][None]]).transpose(0, 1)[None]
        ref = F.scaled_dot_product_attention(q[r][None, :, None], k, v, scale=0.0625, enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out[r], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["s5", "native", "full"])
def test_engine_with_the_kernel_equals_the_gathering_path(kernel, policy):
    def engine(on):
        cfg = EngineConfig(model="tiny-random:7", kv_policy=policy, kv_window=8, max_rows=4, max_num_batched_tokens=48,
                           cpu_decode_attention=on)
        return Engine(cfg, load_model(cfg))

    fast, slow = engine(True), engine(False)
    assert fast.runner.paged_decode is not None and slow.runner.paged_decode is None
    calls = {"paged": 0, "ring": 0}

    class Counting:  # the kernel, counting the calls of each kind
        def __init__(self, kernel):
            self.kernel = kernel
            self.supports = kernel.supports

        def __call__(self, *args, **kw):
            calls["ring" if len(args) > 7 else "paged"] += 1
            return self.kernel(*args, **kw)

    fast.runner.paged_decode = Counting(fast.runner.paged_decode)
    reqs = lambda: [Request(f"r{i}", [2] + [(29 * i + 13 * t) % 500 + 3 for t in range(15 + 31 * i)], greedy(30))
                    for i in range(4)]  # noqa: E731
    a, b = Recorder(fast), Recorder(slow)
    assert run_all(fast, reqs()) == run_all(slow, reqs())
    ring_layers = bool(fast.pool.ring_layers)
    assert calls["paged"] > 0 and (calls["ring"] > 0) == ring_layers, calls
    assert a.logits.keys() == b.logits.keys()
    diff = max((a.logits[k] - b.logits[k]).abs().max().item() for k in b.logits)
    print(f"{policy}: max |logit diff| {diff:.2e} over {len(b.logits)} steps")
    assert diff < 1e-4
