"""The engine's fused Gemma 3 forward (fused_forward.py) computes what the stock layers compute.

The oracle tests (tests/equivalence) already run the engine on it, since it is the default; these
hold it to the stock forward directly, step by step, and check what it does to the model."""

import pytest
import torch

from engine import Engine, EngineConfig, fused_forward
from engine.kernels import fused_ops
from engine.model_loader import LoadedModel
from tests.engine.test_resume import BASE, Recorder, converse, max_logit_diff, plan
from tests.helpers import hf_greedy, tiny_gemma4, tiny_loaded, tiny_random_model


@pytest.mark.parametrize("static", [False, True])
def test_fused_engine_equals_stock_engine(static):
    turns = plan(3, sessions=4, turns=3)
    fused = Engine(EngineConfig(**BASE, max_rows=4, decode_graphs=static), tiny_loaded(0))
    stock = Engine(EngineConfig(**BASE, max_rows=4, decode_graphs=static, fused_layers=False), tiny_loaded(0))
    assert fused.runner.fused is not None and stock.runner.fused is None
    a, b = Recorder(fused), Recorder(stock)
    out_a, sids_a = converse(fused, turns)
    out_b, sids_b = converse(stock, turns)
    assert out_a == out_b
    diff = max_logit_diff(a, b, dict(zip(sids_b, sids_a)))
    print(f"fused vs stock, static={static}: max |logit diff| {diff:.2e} over {len(b.logits)} steps")
    assert diff < 1e-4


def test_fused_weights_are_the_model_weights():
    """Q/K/V and gate/up are fused into one weight each, and the stock modules' weights become
    views of it: no second copy, and the model's own forward is unchanged."""
    model = tiny_random_model(1)
    prompt = list(range(5, 25))
    before = hf_greedy(model, prompt, 12)
    params = sum(p.numel() for p in model.parameters())
    fused = fused_forward.build(model)
    assert fused is not None
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    L = fused.layers[0]
    assert attn.q_proj.weight.data_ptr() == L.wqkv.data_ptr()
    assert attn.v_proj.weight.data_ptr() == L.wqkv[-attn.v_proj.out_features:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == L.wgu[mlp.gate_proj.out_features:].data_ptr()
    assert sum(p.numel() for p in model.parameters()) == params
    assert hf_greedy(model, prompt, 12) == before


def test_models_the_fused_forward_does_not_take_run_the_stock_layers():
    """Other families and quantized linears keep the stock forward, and still serve."""
    from engine.quant import quantize_int8

    assert "not a Gemma 3 decoder" in fused_forward.unsupported(tiny_gemma4(0))
    model = tiny_random_model(0)
    quantize_int8(model, None)  # the int8 linears' torch path (no compiled kernel needed here)
    assert "plain bias-free linears" in fused_forward.unsupported(model)
    engine = Engine(EngineConfig(**BASE, max_rows=2), LoadedModel(model, None, "tiny"))
    assert engine.runner.fused is None
    out, _ = converse(engine, plan(4, sessions=2, turns=2))
    assert all(all(turn for turn in s) for s in out)


def test_fused_ops_references_equal_the_stock_modules():
    """The torch versions (the CPU path and the CUDA kernels' oracle) against the stock ops."""
    from transformers.models.gemma3 import modeling_gemma3 as g3

    torch.manual_seed(0)
    T, H, Hkv, D, N = 5, 4, 2, 16, 64
    norm = g3.Gemma3RMSNorm(N, eps=1e-6)
    post, nxt = g3.Gemma3RMSNorm(N, eps=1e-6), g3.Gemma3RMSNorm(N, eps=1e-6)
    qn, kn = g3.Gemma3RMSNorm(D, eps=1e-6), g3.Gemma3RMSNorm(D, eps=1e-6)
    for m in (norm, post, nxt, qn, kn):
        torch.nn.init.normal_(m.weight)
    h, y = torch.randn(T, N), torch.randn(T, N)
    assert torch.equal(fused_ops.rmsnorm_ref(h, norm.weight, 1e-6), norm(h))
    r, x = fused_ops.add_rmsnorm_ref(h, y, post.weight, nxt.weight, 1e-6)
    assert torch.equal(r, h + post(y)) and torch.equal(x, nxt(h + post(y)))
    qkv = torch.randn(T, (H + 2 * Hkv) * D)
    cos, sin = torch.randn(T, D).chunk(1)[0], torch.randn(T, D)
    cos = torch.cat([cos[:, : D // 2]] * 2, dim=1)
    sin = torch.cat([sin[:, : D // 2]] * 2, dim=1)
    q, k, v = fused_ops.qk_norm_rope_ref(qkv, qn.weight, kn.weight, cos, sin, H, Hkv, 1e-6)
    sq, sk, sv = qkv.view(T, H + 2 * Hkv, D).split([H, Hkv, Hkv], dim=1)
    want_q, want_k = g3.apply_rotary_pos_emb(qn(sq.transpose(0, 1))[None], kn(sk.transpose(0, 1))[None],
                                             cos[None], sin[None])
    assert torch.equal(q, want_q[0].transpose(0, 1)) and torch.equal(k, want_k[0].transpose(0, 1))
    assert torch.equal(v, sv)
    gu = torch.randn(T, 2 * N)
    act = torch.nn.functional.gelu(gu[:, :N], approximate="tanh")
    assert torch.equal(fused_ops.gelu_mul_ref(gu), act * gu[:, N:])
