"""Every change the engine makes to a loaded model, in one place (quantization aside, which the
loader does as the weights arrive, loader.py): the engine's row attention registered with the
stock forward, and the forward the runner calls. That is the family's fused forward where it
takes the model (it reads the weights and changes no module, except that with `nf4` bitsandbytes
4-bit linears are first repacked once into the engine's NF4 linears, nf4_linear.py, whose kernels
it runs; otherwise 4-bit models keep bitsandbytes' own layers and the stock forward), else the stock forward, with its
CUDA module substitutions: fused RMSNorms, few-row linears and grouped experts, each checked
against the module it replaces or measured faster. A module a substitution already replaced (an
engine built earlier on the same model) is left as it is."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from engine.kernels.rmsnorm import fuse_norms
from engine.kernels.small_linear import substitute_linears
from engine.model import fused_forward, fused_gemma4, hf_adapter, nf4_linear

log = logging.getLogger(__name__)


class Prepared(NamedTuple):
    forward: Callable  # (input_ids, positions, step, logits_index) -> logits [n, vocab]
    fused: fused_forward.FusedDecoder | None  # the fused forward, None: the stock one
    capturable: bool  # decode steps may be captured as CUDA graphs


def prepare(model, device: torch.device, fused: bool, pdl: bool, nf4: bool = False, cpu_ops=None) -> Prepared:
    """The forward to run `model` with on `device`. `fused`: the engine's own layer forward where
    the model allows it; `pdl`: its kernels launched with PDL (the device supports it); `nf4`:
    bitsandbytes 4-bit linears repacked for the engine's NF4 kernels first; `cpu_ops`: the CPU's
    C kernels for the Gemma 3 forward's elementwise steps (kernels/cpu_ops.py), or None."""
    hf_adapter.use_row_attention(model)
    if fused:
        family = type(model.get_decoder()).__name__
        if nf4 and family in ("Gemma3TextModel", "Gemma4TextModel"):  # the families with a fused forward
            nf4_linear.repack(model)
        gemma4 = family == "Gemma4TextModel"
        decoder = fused_gemma4.build(model, pdl) if gemma4 else fused_forward.build(model, pdl, cpu_ops)
        if decoder is not None:
            return Prepared(decoder.forward, decoder, True)
    capturable = True
    if device.type == "cuda":
        fuse_norms(model)
        substitute_linears(model)
        capturable = stock_experts_capturable(model)
    return Prepared(stock_forward(model, frozenset(hf_adapter.geometry(model).layer_types)), None, capturable)


def stock_forward(model, layer_kinds: frozenset[str]):
    """The stock transformers forward with the engine's attention, as the runner calls a forward."""

    def forward(input_ids, positions, step, logits_index) -> torch.Tensor:
        return hf_adapter.forward(model, input_ids, positions, step, logits_index, layer_kinds)

    return forward


def stock_experts_capturable(model) -> bool:
    """The stock layers of a mixture-of-experts model on CUDA: transformers' default experts loop
    reads each expert's token count on the host, which a CUDA graph cannot capture; torch's
    grouped product reads none in bfloat16, so the model is switched to it. In other dtypes the
    grouped product copies its offsets to the host too, and decode steps run uncaptured (False)."""
    experts = [m for m in model.modules() if isinstance(getattr(m, "num_experts", None), int)
               and isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)]
    if not experts:
        return True
    if experts[0].gate_up_proj.dtype != torch.bfloat16 or not hasattr(model, "set_experts_implementation"):
        log.info("stock experts in %s: decode steps run uncaptured", experts[0].gate_up_proj.dtype)
        return False
    model.set_experts_implementation("grouped_mm")
    return True
