"""bitsandbytes 4-bit linears as the engine's own NF4 linears, made once when a model is prepared.

Users load 4-bit models through bitsandbytes (loader.py: `quantize_bnb4` as a full-precision
checkpoint moves to the GPU, or transformers' loading of a bitsandbytes 4-bit checkpoint); every
decoder linear is then a `Linear4bit` whose
`Params4bit` holds the packed weight and a quant state. `repack` replaces each one it can take
(NF4, groups of 64, rows of whole groups, no bias) by an `NF4Linear` over an `NF4Weight`
(kernels/nf4.py): the same packed bytes, the absmax decoded once to float32, the code table; the
quant state (the nested absmax and its own scales) goes with the replaced module. `NF4Linear`
computes what `Linear4bit` computes (bnb's dequantized weight times x, in the compute dtype), on
the engine's kernels; the fused forwards read its weight directly and fuse Q/K/V and gate/up rows
(`fuse_rows`), as they do for full-precision weights.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.kernels import nf4
from engine.kernels.nf4 import NF4Weight

log = logging.getLogger(__name__)


class NF4Linear(nn.Module):
    """A bias-free linear on an NF4 weight: x [..., in] -> [..., out] in x's dtype, computed in the
    weight's compute dtype. `weight` is the `NF4Weight` over the module's buffers."""

    def __init__(self, w: NF4Weight) -> None:
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.dtype = w.dtype
        self.register_buffer("packed", w.packed, persistent=False)
        self.register_buffer("scales", w.scales, persistent=False)
        self.register_buffer("code", w.code, persistent=False)

    @property
    def weight(self) -> NF4Weight:
        return NF4Weight(self.packed, self.scales, self.code, self.dtype)

    def rebind(self, w: NF4Weight) -> None:
        """Hold `w` (same shape: a view of a fused weight's rows) instead of its own buffers."""
        assert w.shape == (self.out_features, self.in_features)
        self.packed, self.scales, self.code = w.packed, w.scales, w.code

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(self.dtype)
        return nf4.linear(flat, self.weight).to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4, dtype={self.dtype}"


def fuse_nf4_rows(linears: list[NF4Linear]) -> NF4Weight:
    """One NF4 weight of the linears' rows in order; each linear then holds a view of its rows."""
    fused = nf4.fuse([m.weight for m in linears])
    lo = 0
    for m in linears:
        hi = lo + m.out_features
        m.rebind(NF4Weight(fused.packed[lo:hi], fused.scales[lo:hi], fused.code, fused.dtype))
        lo = hi
    return fused


def _refusal(m) -> str | None:
    if getattr(m, "bias", None) is not None:
        return "a bias"
    return nf4.refusal(m.weight)


def decodes_as_bnb(weight) -> bool:
    """Whether the kernels' dequantization of this `Params4bit` is bit for bit bitsandbytes' own
    (`dequantize_4bit`) on the same packed weight."""
    from bitsandbytes.functional import dequantize_4bit

    want = dequantize_4bit(weight.data, weight.quant_state)
    return torch.equal(nf4.dequantize(nf4.from_bnb(weight)), want.reshape(weight.quant_state.shape))


@torch.no_grad()
def repack(model) -> int:
    """Replace the decoder layers' bitsandbytes `Linear4bit` modules by `NF4Linear`s over the same
    packed weights; a module the kernels cannot take stays as it is (logged, with why). The first
    one is checked first: where the kernels do not decode it exactly as bitsandbytes does (another
    bitsandbytes layout), every module stays. Returns how many were replaced."""
    done, kept = 0, {}
    for parent in list(model.get_decoder().layers.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ != "Linear4bit":
                continue
            why = _refusal(child)
            if why is not None:
                kept[why] = kept.get(why, 0) + 1
                continue
            if not done and not decodes_as_bnb(child.weight):
                log.warning("bitsandbytes weights not decoded as bitsandbytes decodes them: 4-bit linears stay as "
                            "they are")
                return 0
            setattr(parent, name, NF4Linear(nf4.from_bnb(child.weight)))
            done += 1
    if kept:
        log.info("bitsandbytes linears kept as they are: %s", kept)
    if done:
        log.info("%d bitsandbytes NF4 linears run on the engine's kernels", done)
    return done
