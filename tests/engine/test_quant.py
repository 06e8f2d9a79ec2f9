"""The int8 CPU path: the kernel (each instruction set this CPU runs) bitwise against the torch
reference, the reference against a float64 product, row independence, the choice of instruction
set, the fallback, greedy tokens through the engine on the kernel against the reference path, and
the engine's fused forward on int8 weights against the stock layers on the same weights."""

import logging

import pytest
import torch
from torch import nn

from engine import Engine, EngineConfig, Request
from engine.model import quant
from engine.model.loader import LoadedModel, load_model
from engine.model.quant import (Int8Linear, Int8Weight, KernelUnavailable, Q8Kernel, activation_block, block_sums128,
                                pack_rows, quantize_packed, quantize_rows, reference_matmul, unpack_rows)
from tests.helpers import greedy, run_all

RUNNABLE = [isa for isa, need in quant.ISA_FLAGS.items() if need <= quant._cpu_flags()]


@pytest.fixture(scope="module", params=RUNNABLE or [None])
def kernel(request, tmp_path_factory):
    if request.param is None:  # the fallback is tested below; the kernel itself needs AVX2
        pytest.skip("int8 kernel needs AVX2 and FMA, which this CPU does not report")
    return Q8Kernel(tmp_path_factory.mktemp("kcache"), request.param)


def int8_weight(w: torch.Tensor, kernel) -> Int8Weight:
    q, scale = quantize_rows(w)
    block = activation_block(w.shape[1])
    return Int8Weight(pack_rows(q), scale, block_sums128(q, block), block, None, kernel)


@pytest.mark.parametrize("m,n,k", [(1, 7, 32), (3, 33, 64), (4, 256, 640), (5, 1025, 128), (9, 64, 2048),
                                   (32, 130, 96), (1, 4100, 640), (2, 72, 1024)])
def test_kernel_is_bitwise_the_reference(kernel, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    x[0, :32] = 0.0  # a block of zeros: scale 0
    wt = int8_weight(w, kernel)
    y = kernel.matmul(x, wt)
    assert y.shape == (m, n)
    q, scale = quantize_rows(w)
    assert torch.equal(y, reference_matmul(x, q.float(), scale, wt.block)), kernel.isa


def test_non_finite_activations_give_nan_rows_and_leave_the_others(kernel):
    w = int8_weight(torch.randn(40, 256), kernel)
    x = torch.randn(3, 256)
    x[1, 5] = float("inf")
    x[2, 200] = float("nan")
    y = kernel.matmul(x, w)
    assert torch.isnan(y[1:]).all()
    assert torch.equal(y[0], kernel.matmul(x[:1].contiguous(), w)[0])


def test_reference_is_close_to_the_float64_product():
    """What int8 activations cost a product against the exact product of the same int8 weights:
    each value moves by at most half a step (its block's amax / 127), uniformly, so for Gaussian
    activations (a block of 128 has amax ~2.7 sigma) the error's RMS is ~0.006 of the product's."""
    torch.manual_seed(3)
    w, x = torch.randn(300, 640), torch.randn(8, 640)
    q, scale = quantize_rows(w)
    exact = x.double() @ (q.double() * scale.double()[:, None]).T
    got = reference_matmul(x, q.float(), scale, 128)
    rel = ((got.double() - exact).norm() / exact.norm()).item()
    print(f"int8 activations: relative error {rel:.2e}")
    assert 3e-3 < rel < 1e-2


def test_quantize_rows_error_bound_and_packing_round_trip():
    w = torch.randn(61, 96)
    q, scale = quantize_rows(w)
    packed = pack_rows(q)
    assert packed.shape == (8, 12, 8, 8)
    assert torch.equal(unpack_rows(packed, 61), q)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    # round-to-nearest: each weight within half a step of its row's scale
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    sums = block_sums128(q, 32)  # [8 blocks of rows, 3 activation blocks, 8 rows]
    assert sums.shape == (8, 3, 8)
    assert sums[0, 1, 2].item() == 128 * q[2, 32:64].sum().item() and sums[7, :, 5:].abs().sum() == 0  # padding


@pytest.mark.parametrize("rows", [8, 16, 2048])
def test_slice_by_slice_quantization_equals_the_whole_weights(rows):
    w = torch.randn(61, 96)
    q, scale = quantize_rows(w)
    got = quantize_packed(w, 32, rows)
    for a, b in zip(got, (pack_rows(q), scale, block_sums128(q, 32))):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_row_results_do_not_depend_on_the_batch(kernel):
    torch.manual_seed(0)
    w = int8_weight(torch.randn(300, 640), kernel)
    xs = torch.randn(13, 640)
    alone = torch.stack([kernel.matmul(xs[i : i + 1].contiguous(), w)[0] for i in range(13)])
    for m in (2, 5, 8, 13):
        assert torch.equal(kernel.matmul(xs[:m].contiguous(), w), alone[:m]), m  # bitwise


def test_int8_linear_paths_agree(kernel):
    """The module on the kernel and on the torch reference (no kernel): bitwise, at decode and
    prefill row counts; and close to the float32 product of the same int8 weights."""
    torch.manual_seed(1)
    lin = nn.Linear(128, 96, bias=True)
    fast, fallback = Int8Linear(lin, kernel), Int8Linear(lin, None)
    for rows in (1, 7, 64, 300):
        x = torch.randn(2, rows, 128)
        assert torch.equal(fast(x), fallback(x)), rows
    ref = x @ fast.weight.dequantized().T + lin.bias
    torch.testing.assert_close(fast(x), ref, rtol=0.05, atol=0.05)


def test_instruction_set_choice(tmp_path, monkeypatch, caplog):
    """auto takes AVX-512 VNNI where the CPU has it and AVX2 otherwise; naming a set the CPU lacks
    fails at load with the flags it misses; the load log names the set taken."""
    monkeypatch.setattr(quant, "_cpu_flags", lambda: {"avx2", "fma", "sse4_2"})
    assert Q8Kernel(tmp_path).isa == "avx2"
    with pytest.raises(KernelUnavailable, match="avx512-vnni int8 kernel needs .*avx512_vnni"):
        Q8Kernel(tmp_path, "avx512-vnni")
    with pytest.raises(KernelUnavailable, match="avx512-vnni"):
        load_model(EngineConfig(model="tiny-random:3", quantization="int8", cpu_kernel="avx512-vnni",
                                cache_dir=str(tmp_path)))
    monkeypatch.setattr(quant, "_cpu_flags", lambda: set(quant.ISA_FLAGS["avx512-vnni"]))
    assert Q8Kernel(tmp_path).isa == "avx512-vnni"
    monkeypatch.setattr(quant, "_cpu_flags", lambda: {"avx2", "fma"})
    with caplog.at_level(logging.INFO, logger="engine.model.loader"):
        load_model(EngineConfig(model="tiny-random:3", quantization="int8", cache_dir=str(tmp_path)))
    assert "int8 CPU kernel: AVX2" in caplog.text
    with pytest.raises(ValueError, match="cpu_kernel must be one of"):
        EngineConfig(cpu_kernel="avx9")


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(KernelUnavailable, match="no C compiler"):
        Q8Kernel(tmp_path)


def test_missing_compiler_falls_back_to_widened_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    loaded = load_model(EngineConfig(model="tiny-random:3", quantization="int8", cache_dir=str(tmp_path)))
    mods = [m for m in loaded.model.modules() if isinstance(m, Int8Linear)]
    assert mods and all(m.kernel is None and m.ints is not None for m in mods)


def test_config_rejects_int8_off_cpu_and_non_float32():
    with pytest.raises(ValueError, match="CPU path"):
        EngineConfig(device="cuda", quantization="int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="float32"):
        load_model(EngineConfig(model="tiny-random", dtype="bfloat16", quantization="int8"))


def test_engine_int8_on_the_kernel_equals_the_reference_path(kernel, tmp_path, monkeypatch):
    """A quantized tiny model through the engine gives the same greedy tokens and bitwise the same
    logits on the kernel as on the torch reference (the path where no kernel can be built): the
    kernel changes no result, only the speed."""
    from tests.scenarios import Recorder

    loaded = load_model(EngineConfig(model="tiny-random:5", quantization="int8", cache_dir=str(tmp_path),
                                     cpu_kernel=kernel.isa))
    replaced = [m for m in loaded.model.modules() if isinstance(m, Int8Linear)]
    assert len(replaced) == 6 * 7 + 1  # q,k,v,o,gate,up,down per layer + output layer
    assert all(m.kernel is not None for m in replaced)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    reference = load_model(EngineConfig(model="tiny-random:5", quantization="int8", cache_dir=str(tmp_path / "none")))
    assert all(m.kernel is None for m in reference.model.modules() if isinstance(m, Int8Linear))
    reqs = lambda: [Request(f"r{i}", [2] + [(37 * i + 11 * t) % 500 + 3 for t in range(20 + 9 * i)], greedy(24))
                    for i in range(4)]  # noqa: E731
    cfg = EngineConfig(model="tiny-random", max_rows=4, max_num_batched_tokens=32)
    fast, slow = Engine(cfg, loaded), Engine(cfg, reference)
    a, b = Recorder(fast), Recorder(slow)
    assert run_all(fast, reqs()) == run_all(slow, reqs())
    assert a.logits.keys() == b.logits.keys()
    assert all(torch.equal(a.logits[k], b.logits[k]) for k in b.logits)


def test_fused_forward_on_int8_weights_equals_the_stock_layers(kernel, tmp_path):
    """The fused forward takes int8 linears (Q/K/V and gate/up fused, the kernel per projection):
    the same greedy tokens as the stock layers on the same int8 weights, logits to float rounding,
    and the model holds each int8 weight once (the modules' buffers are views of the fused ones)."""
    from tests.scenarios import Recorder

    def engine(fused):
        loaded = load_model(EngineConfig(model="tiny-random:5", quantization="int8", cache_dir=str(tmp_path)))
        # the norms as torch ops in both (the C ones round differently: tests/engine/test_cpu_ops.py)
        return Engine(EngineConfig(model="tiny-random", max_rows=4, max_num_batched_tokens=64, fused_layers=fused,
                                   cpu_layer_ops=False), loaded)

    fused, stock = engine(True), engine(False)
    assert type(fused.runner.fused).__name__ == "FusedGemma3" and stock.runner.fused is None
    L0 = fused.runner.fused.layers[0]
    attn = fused.runner.model.get_decoder().layers[0].self_attn
    assert L0.wqkv.shape == (attn.q_proj.out_features + 2 * attn.k_proj.out_features, attn.q_proj.in_features)
    assert attn.q_proj.qweight.data_ptr() == L0.wqkv.packed.data_ptr()  # a view, not a copy
    assert attn.k_proj.qweight.data_ptr() == L0.wqkv.packed[attn.q_proj.out_features // 8].data_ptr()
    reqs = lambda: [Request(f"r{i}", [2] + [(37 * i + 11 * t) % 500 + 3 for t in range(20 + 40 * i)], greedy(24))
                    for i in range(4)]  # noqa: E731  (prompts up to 141 tokens: long prefill chunks too)
    a, b = Recorder(fused), Recorder(stock)
    out_a, out_b = run_all(fused, reqs()), run_all(stock, reqs())
    assert out_a == out_b
    assert a.logits.keys() == b.logits.keys()
    diff = max((a.logits[k] - b.logits[k]).abs().max().item() for k in b.logits)
    print(f"int8 fused vs stock: max |logit diff| {diff:.2e} over {len(b.logits)} steps")
    assert diff < 1e-4
