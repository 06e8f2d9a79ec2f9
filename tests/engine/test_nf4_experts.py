"""NF4 experts (engine/model/nf4_experts.py) on the CPU: bitsandbytes' own packing of the expert
tensors, the grouped path against the stock math on bitsandbytes' dequantized weights, and the
engine on a Gemma 4 model with NF4 experts against the engine on the stock experts module holding
the same dequantized weights. The decode kernels are checked in Triton's interpreter
(tests/kernels/interpreted_nf4.py) and on a GPU (tests/equivalence/test_cuda_nf4.py)."""

import pytest
import torch

from engine import Engine, EngineConfig
from engine.kernels import moe, nf4, nf4_moe
from engine.model import fused_gemma4
from engine.model.loader import LoadedModel
from engine.model.nf4_experts import NF4Experts, quantize_experts
from tests.helpers import tiny_gemma4
from tests.scenarios import converse, plan

bnb = pytest.importorskip("bitsandbytes")

BASE = dict(model="tiny-random", kv_sink=2, kv_window=5, kv_cache_bytes=1 << 22, max_num_batched_tokens=16)


def bnb_roundtrip(w: torch.Tensor):
    """bitsandbytes' NF4 of an [E, R, K] expert tensor viewed as 2-D (plain absmax): its packed
    bytes and its dequantize_4bit, in w's shape."""
    from bitsandbytes.functional import dequantize_4bit

    p = bnb.nn.Params4bit(w.reshape(-1, w.shape[2]).clone(), requires_grad=False, quant_type="nf4",
                          compress_statistics=False).to("cpu")
    return p.data, dequantize_4bit(p.data, p.quant_state).view(w.shape)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_nf4_experts_hold_bitsandbytes_nf4_and_compute_the_stock_math():
    torch.manual_seed(0)
    E, H, inter, k = 8, 128, 64, 2
    gate_up, down = torch.randn(E, 2 * inter, H) * 0.05, torch.randn(E, H, inter) * 0.05
    ex = NF4Experts.quantize(gate_up, down)
    (packed_gu, want_gu), (packed_dn, want_dn) = bnb_roundtrip(gate_up), bnb_roundtrip(down)
    assert torch.equal(ex.gate_up.packed.reshape(-1), packed_gu.reshape(-1))
    assert torch.equal(ex.down.packed.reshape(-1), packed_dn.reshape(-1))
    assert torch.equal(nf4.dequantize(ex.gate_up).view_as(gate_up), want_gu)
    assert torch.equal(nf4.dequantize(ex.down).view_as(down), want_dn)
    assert ex.gate_up_packed.numel() + ex.down_packed.numel() == gate_up.numel() // 2 + down.numel() // 2
    for T in (1, 5, 100):
        idx = torch.rand(T, E).topk(k, dim=1).indices
        w = torch.rand(T, k)
        x = torch.randn(T, H)
        want = moe.experts_ref(x, idx, w, want_gu, want_dn)
        got = ex(x, idx, w)
        assert got.shape == (T, H) and rel(got, want) < 1e-5
        # the reference the engine checks its kernels against on a model's own weights (kernel_check)
        assert rel(nf4_moe.experts_ref(x, idx, w, ex.gate_up, ex.down), want) < 1e-6


def test_quantize_experts_replaces_experts_of_whole_groups_only():
    model = tiny_gemma4(0, moe_intermediate_size=64)
    layers = model.model.layers
    assert quantize_experts(model) == len(layers)
    assert all(isinstance(layer.experts, NF4Experts) for layer in layers)
    assert quantize_experts(model) == 0  # nothing left in float
    assert fused_gemma4.unsupported(model) is None
    # 32 units per expert: the down rows are half a group of 64, so the experts stay as they are
    assert quantize_experts(tiny_gemma4(0)) == 0


@pytest.mark.parametrize("fused", [True, False])
def test_engine_on_nf4_experts_equals_the_stock_module_on_their_values(fused):
    """The same sessions (prefill chunks, decode batches, later turns) through the engine on a
    model with NF4 experts and on the same model whose stock experts hold their dequantized
    values: the same greedy tokens, on the fused forward and on the stock layers."""

    def model(nf4_experts: bool):
        m = tiny_gemma4(3, moe_intermediate_size=64)
        for layer in m.model.layers:
            ex = layer.experts
            if nf4_experts:
                layer.experts = NF4Experts.quantize(ex.gate_up_proj.data, ex.down_proj.data)
            else:
                ex.gate_up_proj.data = bnb_roundtrip(ex.gate_up_proj.data)[1]
                ex.down_proj.data = bnb_roundtrip(ex.down_proj.data)[1]
        return LoadedModel(m, None, "tiny-gemma4")

    turns = plan(3, sessions=3, turns=2)
    outs = []
    for nf4_experts in (True, False):
        engine = Engine(EngineConfig(**BASE, max_rows=4, fused_layers=fused), model(nf4_experts))
        assert (engine.runner.fused is not None) == fused
        outs.append(converse(engine, turns)[0])
        engine.check_invariants()
    assert outs[0] == outs[1] and all(len(tokens) > 0 for session in outs[0] for tokens in session)


def test_nf4_router_runs_on_the_copy_bitsandbytes_dequantizes():
    """A router on NF4 weights: the fused forward holds its weight in the compute dtype, equal to
    bitsandbytes' dequantize_4bit of the packed router, and the engine on it gives the same greedy
    tokens as the stock layers on the NF4 router."""
    from bitsandbytes.functional import dequantize_4bit

    from engine.model.nf4_linear import NF4Linear

    def model():
        m, want = tiny_gemma4(3, moe_intermediate_size=64), []
        for layer in m.model.layers:
            p = bnb.nn.Params4bit(layer.router.proj.weight.data.clone(), requires_grad=False,
                                  quant_type="nf4").to("cpu")
            layer.router.proj = NF4Linear(nf4.from_bnb(p))
            want.append(dequantize_4bit(p.data, p.quant_state))
        return m, want

    m, want = model()
    fused = fused_gemma4.FusedGemma4(m)
    for L, w in zip(fused.layers, want):
        assert type(L.experts.router) is torch.Tensor and torch.equal(L.experts.router, w)
    turns = plan(5, sessions=3, turns=2)
    outs = []
    for f in (True, False):
        engine = Engine(EngineConfig(**BASE, max_rows=4, fused_layers=f), LoadedModel(model()[0], None, "tiny"))
        assert (engine.runner.fused is not None) == f
        outs.append(converse(engine, turns)[0])
        engine.check_invariants()
    assert outs[0] == outs[1] and all(len(tokens) > 0 for session in outs[0] for tokens in session)
