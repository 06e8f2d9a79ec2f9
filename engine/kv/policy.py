"""Which K/V positions each layer keeps between forwards. Pure functions, no tensors.

A layer's *layout* says what its row storage holds after a forward that ended at position `end`:

    paged            every position (exact); blocks of the row pool, growing with the row
    ring(sink, w)    positions p < sink and end - w <= p < end; a fixed number of slots

Inside one forward the new tokens always attend exactly (restored): to the resident positions plus
every new token before them, under the model's own attention window. A layout is *staged* when its
resident set can be smaller than that window: a forward split over several steps (chunked prefill)
then keeps its own tokens aside until its last chunk, so chunking never changes the result.

Policies (DESIGN.md section 1):

    s5           full-attention layers paged; sliding layers ring(sink, window), staged
    native       full-attention layers paged; sliding layers ring(0, native window) (exact)
    full         every layer paged (exact)
    sink-window  every layer ring(sink, window), staged: the ablation control that loses recall

Under s5 and sink-window, `windows` may give each bounded layer its own window (in layer order:
one per sliding layer under s5, one per layer under sink-window); the rule of what a forward's
tokens see is the same, only how many recent positions each bounded layer keeps differs.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class LayerLayout:
    paged: bool  # keeps every position
    sink: int = 0  # ring only: leading positions kept
    window: int = 0  # ring only: most recent positions kept
    staged: bool = False  # ring only: a multi-step forward keeps its tokens aside until it ends
    attn_window: int | None = None  # the model's own window for this layer (None: unlimited)

    @property
    def ring_slots(self) -> int:
        return 0 if self.paged else self.sink + self.window


def layer_layouts(
    policy: str,
    layer_types: list[str],
    native_window: int | None,
    sink: int,
    window: int,
    windows: list[int] | tuple[int, ...] | None = None,
) -> list[LayerLayout]:
    """One LayerLayout per decoder layer for `policy`; `windows`: one window per bounded layer
    (s5: the sliding layers, sink-window: every layer), instead of `window` for all."""
    bounded = bounded_layers(policy, layer_types)
    if windows is not None:
        if policy not in ("s5", "sink-window"):
            raise ValueError(f"per-layer windows apply to the s5 and sink-window policies, not {policy!r}")
        if len(windows) != len(bounded):
            raise ValueError(f"{len(windows)} windows given for {len(bounded)} bounded layers under {policy}")
        if min(windows) < 1:
            raise ValueError("every window must be >= 1")
    per_layer = dict(zip(bounded, windows)) if windows is not None else {}
    layouts = []
    for i, kind in enumerate(layer_types):
        if kind not in (FULL_ATTENTION, SLIDING_ATTENTION):
            raise ValueError(f"unsupported layer type {kind!r}")
        sliding = kind == SLIDING_ATTENTION
        attn_window = native_window if sliding else None
        if policy == "full" or (not sliding and policy in ("s5", "native")):
            layouts.append(LayerLayout(paged=True, attn_window=attn_window))
        elif policy == "native":
            assert native_window is not None
            layouts.append(LayerLayout(paged=False, sink=0, window=native_window, attn_window=attn_window))
        elif policy in ("s5", "sink-window"):
            layouts.append(LayerLayout(paged=False, sink=sink, window=per_layer.get(i, window), staged=True,
                                       attn_window=attn_window))
        else:
            raise ValueError(f"unknown kv policy {policy!r}")
    return layouts


def bounded_layers(policy: str, layer_types: list[str]) -> list[int]:
    """Layers whose row keeps sink + window positions under `policy` (native's rings keep the
    model's whole window, so none are bounded there)."""
    if policy == "s5":
        return [i for i, kind in enumerate(layer_types) if kind == SLIDING_ATTENTION]
    return list(range(len(layer_types))) if policy == "sink-window" else []


def ring_slot(pos: int, sink: int, window: int) -> int:
    """Slot of position `pos` in a ring(sink, window)."""
    return pos if pos < sink else sink + (pos - sink) % window


def ring_survives(pos: int, end: int, sink: int, window: int) -> bool:
    """Whether a ring(sink, window) still holds `pos` after a forward that ended at `end`."""
    return pos < sink or pos >= end - window


def resident_positions(layout: LayerLayout, end: int) -> list[int]:
    """Positions a row keeps on this layer between forwards, after one that ended at `end`."""
    if layout.paged:
        return list(range(end))
    return [p for p in range(end) if ring_survives(p, end, layout.sink, layout.window)]
