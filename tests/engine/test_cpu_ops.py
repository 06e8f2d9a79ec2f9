"""The CPU's kernels for the fused forward's elementwise steps (kernels/cpu_ops.py): RMSNorm, the
residual add fused with the next norm, and Q/K head norms with RoPE, against the torch references
they replace (to float rounding), a row's result independent of the batch (bitwise), on one
thread and split over threads; and through the engine, the same greedy tokens and logits to float
rounding as the torch ops, on float32 and int8 weights."""

import pytest
import torch

from engine import Engine, EngineConfig, Request
from engine.kernels.cpu_ops import CpuLayerOps
from engine.kernels.fused_ops import add_rmsnorm_ref, qk_norm_rope_ref, rmsnorm_ref, rope_tables
from engine.model.loader import load_model
from tests.helpers import built_kernel, greedy, run_all
from tests.scenarios import Recorder


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    return built_kernel(CpuLayerOps, tmp_path_factory.mktemp("kcache"))


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: rows split over threads
@pytest.mark.parametrize("n", [640, 1152])
def test_norms_match_the_references(ops, rows, n):
    g = torch.Generator().manual_seed(rows * n)
    h, y = torch.randn(rows, n, generator=g) * 3, torch.randn(rows, n, generator=g) * 40
    w1, w2 = torch.randn(n, generator=g) * 0.3, torch.randn(n, generator=g) * 0.3
    for offset in (1.0, 0.0):
        _close(ops.rmsnorm(y, w1, 1e-6, offset), rmsnorm_ref(y, w1, 1e-6, offset))
        want_h, want_x = add_rmsnorm_ref(h, y, w1, w2, 1e-6, offset)
        got_h, got_x = ops.add_rmsnorm(h.clone(), y, w1, w2, 1e-6, offset)
        _close(got_h, want_h)
        _close(got_x, want_x)
    # the last row alone gives bitwise what it gives in the batch
    assert torch.equal(ops.rmsnorm(y[-1:], w1, 1e-6, 1.0)[0], ops.rmsnorm(y, w1, 1e-6, 1.0)[-1])
    alone = ops.add_rmsnorm(h[-1:].clone(), y[-1:], w1, w2, 1e-6, 1.0)
    batch = ops.add_rmsnorm(h.clone(), y, w1, w2, 1e-6, 1.0)
    assert torch.equal(alone[0][0], batch[0][-1]) and torch.equal(alone[1][0], batch[1][-1])


@pytest.mark.parametrize("T,heads,kv_heads,D", [(1, 4, 1, 256), (5, 8, 2, 64), (33, 4, 1, 256)])
def test_qk_norm_rope_matches_the_reference(ops, T, heads, kv_heads, D):
    g = torch.Generator().manual_seed(T + D)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * D, generator=g) * 5
    wq, wk = torch.randn(D, generator=g) * 0.2, torch.randn(D, generator=g) * 0.2
    positions = torch.randint(0, 30000, (T,), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = rope_tables(positions, inv_freq, 1.0, torch.float32)
    want = qk_norm_rope_ref(qkv, wq, wk, cos, sin, heads, kv_heads, 1e-6)
    work = qkv.clone()
    got = ops.qk_norm_rope(work, wq, wk, cos, sin, heads, kv_heads, 1e-6, 1.0)
    for a, b in zip(got, want):
        _close(a, b)
    assert got[0].data_ptr() == work.data_ptr()  # in place: views of qkv
    assert torch.equal(got[2], qkv.view(T, heads + 2 * kv_heads, D)[:, heads + kv_heads:])  # V untouched


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_engine_with_the_kernels_equals_the_torch_ops(ops, quantization, tmp_path):
    def engine(on):
        loaded = load_model(EngineConfig(model="tiny-random:3", quantization=quantization, cache_dir=str(tmp_path)))
        cfg = EngineConfig(model="tiny-random", kv_window=8, max_rows=4, max_num_batched_tokens=48, cpu_layer_ops=on,
                           cache_dir=str(tmp_path))
        return Engine(cfg, loaded)

    fast, slow = engine(True), engine(False)
    assert fast.runner.fused is not None and fast.runner.fused.cpu is not None and slow.runner.fused.cpu is None
    reqs = lambda: [Request(f"r{i}", [2] + [(31 * i + 7 * t) % 500 + 3 for t in range(12 + 37 * i)], greedy(24))
                    for i in range(4)]  # noqa: E731
    a, b = Recorder(fast), Recorder(slow)
    assert run_all(fast, reqs()) == run_all(slow, reqs())
    assert a.logits.keys() == b.logits.keys()
    diffs = sorted((a.logits[k] - b.logits[k]).abs().max().item() for k in b.logits)
    print(f"{quantization}: max |logit diff| {diffs[-1]:.2e}, median {diffs[len(diffs) // 2]:.2e} "
          f"over {len(diffs)} steps")
    if quantization is None:
        assert diffs[-1] < 1e-4
    else:  # int8 activations: a float-rounding difference can move a value across a rounding
        # boundary of its block's quantization, one step of that block's scale
        assert diffs[len(diffs) // 2] < 1e-4 and diffs[-1] < 0.1
