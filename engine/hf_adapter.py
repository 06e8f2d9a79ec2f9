"""The only module that touches transformers.

It plugs the engine's row attention into a stock transformers model through the documented
`AttentionInterface` registry (registered when a model is prepared, never at import) and calls the
model's ordinary forward with:

  * the step's tokens packed as one sequence, `position_ids` giving each token's position in its
    own row (RoPE stays per row),
  * `attention_mask` as an already-built per-layer-type mapping of None, so the model builds no
    mask (our attention applies the restored-S5 mask itself),
  * `use_cache=False`: K/V live in the engine's RowPool, which the attention reads and writes,
  * `s5_step`: the step's StepAttention, which transformers passes through to attention functions,
  * `logits_to_keep`: the packed indices whose logits are sampled (the output layer runs on those
    rows only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel

from engine.attention import StepAttention
from engine.kv_policy import FULL_ATTENTION, SLIDING_ATTENTION

ATTENTION_NAME = "s5serve_rows"


def _row_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    step: StepAttention | None = kwargs.get("s5_step")
    if step is None:
        raise RuntimeError("s5serve row attention called outside an engine step")
    softcap = getattr(module, "attn_logit_softcapping", None)
    return step.attend(module.layer_idx, query, key, value, scaling, softcap), None


@dataclass(frozen=True)
class ModelGeometry:
    layer_types: list[str]
    native_window: int | None  # sliding layers' own window
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]


def geometry(model: PreTrainedModel) -> ModelGeometry:
    cfg = model.config
    n = cfg.num_hidden_layers
    layer_types = list(getattr(cfg, "layer_types", None) or [FULL_ATTENTION] * n)
    window = getattr(cfg, "sliding_window", None)
    if SLIDING_ATTENTION in layer_types and not window:
        raise ValueError("model declares sliding layers but no sliding_window")
    eos = getattr(model.generation_config, "eos_token_id", None) or getattr(cfg, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelGeometry(
        layer_types=layer_types,
        native_window=window if SLIDING_ATTENTION in layer_types else None,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        eos_token_ids=eos_ids,
    )


def use_row_attention(model: PreTrainedModel) -> None:
    """Route the model's attention layers to the engine (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, _row_attention)
    model.set_attn_implementation(ATTENTION_NAME)


@torch.inference_mode()
def forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,  # [T_total] packed
    positions: torch.Tensor,  # [T_total]
    step: StepAttention,
    logits_index: torch.Tensor,  # [n] packed indices to compute logits for
) -> torch.Tensor:
    """Logits [n, vocab] (float32) of the tokens at `logits_index`."""
    kinds = set(geometry(model).layer_types)
    out = model(
        input_ids=input_ids.unsqueeze(0),
        position_ids=positions.unsqueeze(0),
        attention_mask={kind: None for kind in kinds},
        use_cache=False,
        logits_to_keep=logits_index,
        s5_step=step,
    )
    return out.logits[0].float()
