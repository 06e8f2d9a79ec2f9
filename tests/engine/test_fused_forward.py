"""The engine's fused Gemma 3 and Gemma 4 forwards (fused_forward.py, fused_gemma4.py) compute
what the stock layers compute.

The oracle tests (tests/equivalence) already run the engine on it, since it is the default; these
hold it to the stock forward directly, step by step, and check what it does to the model."""

import pytest
import torch

from engine import Engine, EngineConfig
from engine.model import fused_forward, fused_gemma4
from engine.kernels import fused_ops
from engine.model.loader import LoadedModel
from tests.scenarios import Recorder, converse, max_logit_diff, plan
from tests.helpers import hf_greedy, tiny_gemma4, tiny_loaded, tiny_random_model

BASE = dict(model="tiny-random", kv_sink=2, kv_window=5, kv_cache_bytes=1 << 22, max_num_batched_tokens=16)


def _tiny(family):
    if family == "gemma3":
        return tiny_loaded(0)
    return LoadedModel(tiny_gemma4(0, enable_moe_block=family == "gemma4"), None, family)


@pytest.mark.parametrize("family", ["gemma3", "gemma4", "gemma4-dense"])
@pytest.mark.parametrize("static", [False, True])
def test_fused_engine_equals_stock_engine(static, family):
    turns = plan(3, sessions=4, turns=3)
    fused = Engine(EngineConfig(**BASE, max_rows=4, decode_graphs=static), _tiny(family))
    stock = Engine(EngineConfig(**BASE, max_rows=4, decode_graphs=static, fused_layers=False), _tiny(family))
    assert fused.runner.fused is not None and stock.runner.fused is None
    assert type(fused.runner.fused).__name__ == ("FusedGemma3" if family == "gemma3" else "FusedGemma4")
    assert family == "gemma3" or all((L.experts is not None) == (family == "gemma4") for L in fused.runner.fused.layers)
    a, b = Recorder(fused), Recorder(stock)
    out_a, sids_a = converse(fused, turns)
    out_b, sids_b = converse(stock, turns)
    assert out_a == out_b
    diff = max_logit_diff(a, b, dict(zip(sids_b, sids_a)))
    print(f"{family} fused vs stock, static={static}: max |logit diff| {diff:.2e} over {len(b.logits)} steps")
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


def test_fused_gemma4_weights_are_the_model_weights():
    """Gemma 4: Q/K(/V) and gate/up fused as for Gemma 3 (full layers with values equal to keys
    have no V projection: [Q|K]); the experts' weights are used as they are."""
    model = tiny_gemma4(1)
    prompt = list(range(5, 25))
    before = hf_greedy(model, prompt, 12)
    params = sum(p.numel() for p in model.parameters())
    fused = fused_gemma4.build(model)
    assert type(fused).__name__ == "FusedGemma4"
    for layer, L in zip(model.model.layers, fused.layers):
        attn = layer.self_attn
        assert attn.q_proj.weight.data_ptr() == L.wqkv.data_ptr()
        assert L.v_from_k == (attn.v_proj is None)
        assert L.wqkv.shape[0] == attn.q_proj.out_features + attn.k_proj.out_features * (1 if L.v_from_k else 2)
        assert L.experts.gate_up.data_ptr() == layer.experts.gate_up_proj.data_ptr()
    assert sum(L.v_from_k for L in fused.layers) == 2
    assert sum(p.numel() for p in model.parameters()) == params
    assert hf_greedy(model, prompt, 12) == before


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_fused_forward_takes_norms_a_stock_engine_substituted(family):
    """On CUDA, an engine on the stock layers puts FusedRMSNorm in for the model's norms (offset 1
    for Gemma 3's 1 + w, 0 for Gemma 4's w); a fused engine built later on the same model (a
    benchmark running both) still takes it, reading the same weights."""
    from engine.kernels.rmsnorm import FusedRMSNorm, _is_rmsnorm, norm_eps

    model = _tiny(family).model
    build = fused_gemma4.build if family == "gemma4" else fused_forward.build
    before = [L.in_norm.data_ptr() for L in build(model).layers]
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_rmsnorm(child):
                setattr(parent, name, FusedRMSNorm(child.weight, norm_eps(child), 1.0 if family == "gemma3" else 0.0))
                swapped += 1
    assert swapped >= 4 * model.config.num_hidden_layers
    fused = build(model)
    assert fused is not None
    assert [L.in_norm.data_ptr() for L in fused.layers] == before


def test_models_the_fused_forward_does_not_take_run_the_stock_layers():
    """Other families, Gemma 4 with per-layer input embeddings and projections of another kind (a
    bias here) keep the stock forward, and still serve; int8 linears are taken."""
    from engine.model.quant import quantize_int8

    assert "not a Gemma 3 decoder" in fused_forward.unsupported(tiny_gemma4(0))
    assert "per-layer input" in fused_gemma4.unsupported(tiny_gemma4(0, hidden_size_per_layer_input=8,
                                                                     vocab_size_per_layer_input=512))
    assert fused_gemma4.build(tiny_gemma4(0, hidden_size_per_layer_input=8, vocab_size_per_layer_input=512)) is None
    int8 = tiny_random_model(0)
    quantize_int8(int8, None)  # the int8 linears' torch path (no compiled kernel needed here)
    assert fused_forward.unsupported(int8) is None
    model = tiny_random_model(0)
    attn = model.get_decoder().layers[0].self_attn
    attn.q_proj = torch.nn.Linear(attn.q_proj.in_features, attn.q_proj.out_features, bias=True)
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


def test_gemma4_references_equal_the_stock_modules():
    """The Gemma 4 references (the CPU path and the CUDA kernels' oracles) against the stock
    modules: norms with offset 0 and without a scale, Q/K/V norms with values equal to keys, the
    router and the experts."""
    from transformers.models.gemma4 import modeling_gemma4 as g4

    from engine.kernels import moe

    torch.manual_seed(0)
    model = tiny_gemma4(2)
    torch.nn.init.normal_(model.model.layers[2].router.per_expert_scale, 1.0, 0.3)
    torch.nn.init.normal_(model.model.layers[2].router.scale, 1.0, 0.3)
    layer = model.model.layers[2]  # a full-attention layer: V is K before its norm
    attn = layer.self_attn
    for m in model.modules():
        if isinstance(m, g4.Gemma4RMSNorm) and m.with_scale:
            torch.nn.init.normal_(m.weight)
    T, hidden = 6, model.config.hidden_size
    h, y = torch.randn(T, hidden), torch.randn(T, hidden)
    n1, n2 = layer.pre_feedforward_layernorm, layer.pre_feedforward_layernorm_2
    assert torch.equal(fused_ops.rmsnorm_ref(h, n1.weight, 1e-6, 0.0), n1(h))
    r, x, x2 = fused_ops.add_rmsnorm_ref(h, y, layer.post_attention_layernorm.weight, n1.weight, 1e-6, 0.0,
                                         also=(n2.weight,))
    assert torch.equal(r, h + layer.post_attention_layernorm(y)) and torch.equal(x, n1(r)) and torch.equal(x2, n2(r))
    D, H, Hkv = attn.head_dim, attn.q_proj.out_features // attn.head_dim, attn.k_proj.out_features // attn.head_dim
    qk = torch.cat([attn.q_proj(h), attn.k_proj(h)], dim=1)
    pos = torch.arange(3, 3 + T)
    cos, sin = model.model.rotary_emb(h, pos[None], "full_attention")
    q, k, v = fused_ops.qk_norm_rope_ref(qk, attn.q_norm.weight, attn.k_norm.weight, cos[0], sin[0], H, Hkv, 1e-6,
                                         0.0, v_norm=True, v_from_k=True)
    sq = attn.q_norm(attn.q_proj(h).view(1, T, H, D))
    sk = attn.k_norm(attn.k_proj(h).view(1, T, Hkv, D))
    want_q = g4.apply_rotary_pos_emb(sq, cos, sin, unsqueeze_dim=2)
    want_k = g4.apply_rotary_pos_emb(sk, cos, sin, unsqueeze_dim=2)
    assert torch.equal(q, want_q[0]) and torch.equal(k, want_k[0])
    assert torch.equal(v, attn.v_norm(attn.k_proj(h).view(1, T, Hkv, D))[0])
    probs, want_w, want_i = layer.router(h)
    router_in = layer.router.norm(h) * layer.router.scale * layer.router.scalar_root_size
    w, i = moe.router_topk_ref(layer.router.proj(router_in), model.config.top_k_experts,
                               layer.router.per_expert_scale)
    assert torch.equal(i, want_i) and torch.allclose(w, want_w, rtol=1e-6, atol=1e-7)
    got = moe.experts_ref(y, want_i, want_w, layer.experts.gate_up_proj, layer.experts.down_proj)
    torch.testing.assert_close(got, layer.experts(y, want_i, want_w), rtol=1e-5, atol=1e-5)
    d, e = torch.randn(T, hidden), torch.randn(T, hidden)
    layer.layer_scalar.fill_(0.75)
    r2, x2 = fused_ops.layer_out_ref(h, d, e, layer.post_feedforward_layernorm_1.weight,
                                     layer.post_feedforward_layernorm_2.weight, layer.post_feedforward_layernorm.weight,
                                     layer.layer_scalar, n1.weight, 1e-6)
    s = layer.post_feedforward_layernorm_1(d) + layer.post_feedforward_layernorm_2(e)
    want = (h + layer.post_feedforward_layernorm(s)) * layer.layer_scalar
    assert torch.equal(r2, want) and torch.equal(x2, n1(want))
