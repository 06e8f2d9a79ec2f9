"""Programmatic dependent launch (PDL) for the engine's Triton kernels.

At decode batch sizes most kernels of a step are small: a norm of one hidden vector, attention
over a few blocks, a projection of a few MB. Launched plainly, each starts only once the kernel
before it has finished and its writes have landed, and then pays its own block scheduling and
prologue. On Hopper and newer GPUs a kernel launched with PDL may be scheduled while the kernel
before it in the stream is still running; it then waits on the device (`griddepcontrol.wait`)
for that kernel to finish and flush.

Every kernel that takes `GDC` does that wait before it reads any memory the kernel just before
it may write, and before it writes anything, and then lets the next kernel be scheduled
(`pdl_enter`: its first statement, or after reading only what that kernel does not write:
weights, which no kernel of a step writes; the decode attention's K/V store and row indices,
when it stores the new token itself; its merge kernel's inputs other than the partials). That
kernel passed its own wait before it let this one be scheduled, so every kernel before it has
finished. So the memory effects of a step happen in exactly the stream's order, graph-captured
or not; what overlaps is the next kernel's launch and prologue (and those reads) with the end of
this one. A kernel after one that was not launched this way (a library matrix product) just
waits for it as usual.

It pays only for small forwards, and where it stops paying depends on the model's width. On an
H200 (decode-1238, random-weight Gemma-3 shapes, both ways in one run each; docs/performance.md,
"PDL on and off"), decode with PDL against plain launches ran
  1B (hidden 1152): +11% at 1 row, +11% at 2, +10% at 4, +5% at 8, +1% at 16, -8% at 32, -6% at 64
  4B (hidden 2560): +4% at 1 row, +3% at 2, +1% at 4, -2% at 8 (twice), -1% at 64
so a forward launches with PDL while its hidden states are at most `MAX_ACTIVATIONS` values
(tokens x hidden; `worthwhile`), which keeps every measured gain and none of the losses.

`kernel_args(on)` gives the launch keywords: none when PDL is off or the GPU or Triton cannot do
it, so the kernels compile and run exactly as before.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None


@functools.cache
def _triton_has_gdc() -> bool:
    try:
        import triton.language.extra.cuda as cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched with PDL (a CUDA GPU of compute capability 9.0
    or newer, and a Triton that has the grid-dependency instructions)."""
    if device.type != "cuda" or not _triton_has_gdc():
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


MAX_ACTIVATIONS = 16384  # the largest forward launched with PDL: tokens x hidden size


def worthwhile(tokens: int, hidden: int) -> bool:
    """Whether a forward of `tokens` tokens of a model `hidden` wide gains from PDL (see the
    module docstring)."""
    return tokens * hidden <= MAX_ACTIVATIONS


_PDL_ARGS = {"GDC": True, "launch_pdl": True}
_PLAIN_ARGS: dict = {}


def kernel_args(on: bool) -> dict:
    """Launch keywords for a kernel that takes `GDC`: PDL on (the caller checked `supported`).
    The same two dicts every time (eager steps launch thousands of kernels); callers unpack them
    and never change them."""
    return _PDL_ARGS if on else _PLAIN_ARGS


if triton is not None:

    @triton.jit
    def pdl_enter(GDC: tl.constexpr):
        """Wait for the kernel before this one to finish (its writes visible), then let the next
        one be scheduled. A no-op without `GDC`, or when the kernel was launched plainly."""
        if GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
