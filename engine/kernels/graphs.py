"""CUDA graph capture with Python's garbage collector kept out of it.

An object in a reference cycle is freed only when the collector runs, and the collector runs
whenever allocations pass its thresholds: in the middle of a capture too (torch no longer collects
before a capture by default). A dropped engine is such an object (it and its scheduler refer to
each other), and freeing it destroys its CUDA graphs, which CUDA forbids while a capture is in
progress: the capture is invalidated, and torch's CUDA generator is left registered to a capture
that never ends, so every later random draw on the device fails. The GPU tests hit this once: an
engine captured its graphs right after the test before had dropped one with four, and four graph
resets were refused mid-capture (bench/results/cuda-tests-2026-12-01-pdl-first.log).
`capturing` keeps the collector off for the capture; garbage waits until it ends.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, **kwargs) -> Iterator[None]:
    """`torch.cuda.graph(graph, **kwargs)` with the garbage collector paused inside it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, **kwargs):
            yield
    finally:
        if enabled:
            gc.enable()
