"""The int8 CPU path: the kernel against a float32 reference, row independence, the fallback,
greedy tokens of a quantized tiny model through the engine against its own dequantized twin, and
the engine's fused forward on int8 weights against the stock layers on the same weights."""

import pytest
import torch
from torch import nn

from engine import Engine, EngineConfig, Request
from engine.model.loader import LoadedModel, load_model
from engine.model.quant import Int8Linear, KernelUnavailable, Q8Kernel, pack_rows, quantize_rows, unpack_rows
from tests.helpers import greedy, run_all


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    try:
        return Q8Kernel(tmp_path_factory.mktemp("kcache"))
    except KernelUnavailable as e:  # the fallback is tested below; the kernel itself needs AVX2
        pytest.skip(f"int8 kernel not buildable here: {e}")


@pytest.mark.parametrize("m,n,k", [(1, 7, 8), (3, 33, 64), (4, 256, 640), (5, 1025, 128), (9, 64, 2048), (32, 130, 96)])
def test_kernel_matches_float32_reference(kernel, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g)
    q, scale = quantize_rows(w)
    ref = x.double() @ (q.double() * scale.double()[:, None]).T
    y = kernel.matmul(x, pack_rows(q), scale)
    assert y.shape == (m, n)
    err = (y.double() - ref).abs().max().item()
    print(f"m={m} n={n} k={k} max|err|={err:.2e}")
    assert err < 1e-4 * max(1.0, ref.abs().max().item())


def test_quantize_rows_error_bound_and_packing_round_trip():
    w = torch.randn(61, 96)
    q, scale = quantize_rows(w)
    packed = pack_rows(q)
    assert packed.shape == (8, 12, 8, 8)
    assert torch.equal(unpack_rows(packed, 61), q)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    # round-to-nearest: each weight within half a step of its row's scale
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


def test_row_results_do_not_depend_on_the_batch(kernel):
    torch.manual_seed(0)
    w = torch.randn(300, 640)
    q, scale = quantize_rows(w)
    xs = torch.randn(13, 640)
    p = pack_rows(q)
    alone = torch.stack([kernel.matmul(xs[i : i + 1].contiguous(), p, scale)[0] for i in range(13)])
    for m in (2, 5, 8, 13):
        batch = kernel.matmul(xs[:m].contiguous(), p, scale)
        assert torch.equal(batch, alone[:m]), m  # bitwise


def test_int8_linear_paths_agree(kernel):
    torch.manual_seed(1)
    lin = nn.Linear(128, 96, bias=True)
    fast, widened = Int8Linear(lin, kernel), Int8Linear(lin, None)
    for rows in (1, 7, 64):  # kernel, kernel, BLAS on widened weights
        x = torch.randn(2, rows, 128)
        a, b = fast(x), widened(x)
        assert a.shape == (2, rows, 96)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        ref = x @ (fast.weight.dequantized()).T + lin.bias
        torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-5)


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(KernelUnavailable, match="no C compiler"):
        Q8Kernel(tmp_path)


def test_missing_compiler_falls_back_to_widened_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    loaded = load_model(EngineConfig(model="tiny-random:3", quantization="int8", cache_dir=str(tmp_path)))
    mods = [m for m in loaded.model.modules() if isinstance(m, Int8Linear)]
    assert mods and all(m.kernel is None and m.widened is not None for m in mods)


def test_config_rejects_int8_off_cpu_and_non_float32():
    with pytest.raises(ValueError, match="CPU path"):
        EngineConfig(device="cuda", quantization="int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="float32"):
        load_model(EngineConfig(model="tiny-random", dtype="bfloat16", quantization="int8"))


def test_engine_int8_greedy_equals_dequantized_float32_model(kernel, tmp_path):
    """A quantized tiny model through the engine gives the greedy tokens of a float32 model whose
    weights are the int8-rounded ones: the kernel changes no result, only the speed."""
    loaded = load_model(EngineConfig(model="tiny-random:5", quantization="int8", cache_dir=str(tmp_path)))
    replaced = [m for m in loaded.model.modules() if isinstance(m, Int8Linear)]
    assert len(replaced) == 6 * 7 + 1  # q,k,v,o,gate,up,down per layer + output layer
    twin = load_model(EngineConfig(model="tiny-random:5"))
    with torch.no_grad():
        for (name, mod) in loaded.model.named_modules():
            if isinstance(mod, Int8Linear):
                twin.model.get_submodule(name).weight = nn.Parameter(mod.weight.dequantized().clone(), requires_grad=False)
    reqs = lambda: [Request(f"r{i}", [2] + [(37 * i + 11 * t) % 500 + 3 for t in range(20 + 9 * i)], greedy(24))
                    for i in range(4)]  # noqa: E731
    cfg = EngineConfig(model="tiny-random", max_rows=4, max_num_batched_tokens=32)
    out_q = run_all(Engine(cfg, loaded), reqs())
    out_f = run_all(Engine(cfg, LoadedModel(twin.model, None, "twin")), reqs())
    assert out_q == out_f


def test_fused_forward_on_int8_weights_equals_the_stock_layers(kernel, tmp_path):
    """The fused forward takes int8 linears (Q/K/V and gate/up fused, the kernel per projection):
    the same greedy tokens as the stock layers on the same int8 weights, logits to float rounding,
    and the model holds each int8 weight once (the modules' buffers are views of the fused ones)."""
    from tests.scenarios import Recorder

    def engine(fused):
        loaded = load_model(EngineConfig(model="tiny-random:5", quantization="int8", cache_dir=str(tmp_path)))
        return Engine(EngineConfig(model="tiny-random", max_rows=4, max_num_batched_tokens=64, fused_layers=fused),
                      loaded)

    fused, stock = engine(True), engine(False)
    assert type(fused.runner.fused).__name__ == "FusedGemma3" and stock.runner.fused is None
    L0 = fused.runner.fused.layers[0]
    attn = fused.runner.model.get_decoder().layers[0].self_attn
    assert L0.wqkv.shape == (attn.q_proj.out_features + 2 * attn.k_proj.out_features, attn.q_proj.in_features)
    assert attn.q_proj.qweight.data_ptr() == L0.wqkv.packed.data_ptr()  # a view, not a copy
    assert attn.k_proj.qweight.data_ptr() == L0.wqkv.packed[attn.q_proj.out_features // 8].data_ptr()
    reqs = lambda: [Request(f"r{i}", [2] + [(37 * i + 11 * t) % 500 + 3 for t in range(20 + 40 * i)], greedy(24))
                    for i in range(4)]  # noqa: E731  (prompts up to 141 tokens: BLAS prefill chunks too)
    a, b = Recorder(fused), Recorder(stock)
    out_a, out_b = run_all(fused, reqs()), run_all(stock, reqs())
    assert out_a == out_b
    assert a.logits.keys() == b.logits.keys()
    diff = max((a.logits[k] - b.logits[k]).abs().max().item() for k in b.logits)
    print(f"int8 fused vs stock: max |logit diff| {diff:.2e} over {len(b.logits)} steps")
    assert diff < 1e-4
