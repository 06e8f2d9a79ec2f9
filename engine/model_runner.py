"""ModelRunner: one batched forward per step over ragged rows; decode-only steps may take the
static (CUDA graph) path of decode_graph.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import hf_adapter
from engine.attention import ForwardChunk, StepAttention
from engine.decode_graph import GraphDecoder
from engine.kernels.rmsnorm import fuse_norms
from engine.kernels.small_linear import substitute_linears
from engine.kv_rows import RowPool


@dataclass(frozen=True)
class RunnerInput:
    chunk: ForwardChunk
    token_ids: list[int]  # the chunk's new tokens
    wants_logits: bool  # sample a token after the chunk's last position


class ModelRunner:
    def __init__(self, model, pool: RowPool, static_decode: int = 0, max_model_len: int = 0,
                 capture: bool = False) -> None:
        """`static_decode` > 0: decode-only steps of up to that many rows run the fixed-size decode
        of decode_graph.py, captured as CUDA graphs when `capture`."""
        self.model = model
        self.pool = pool
        self.device = pool.device
        hf_adapter.use_row_attention(model)
        if self.device.type == "cuda":  # module substitutions, each checked or measured
            self.fused_norms = fuse_norms(model)
            self.small_linears = substitute_linears(model)
        self.layer_kinds = frozenset(hf_adapter.geometry(model).layer_types)
        self.decoder = None
        if static_decode:
            self.decoder = GraphDecoder(model, pool, self.layer_kinds, static_decode, max_model_len, capture)

    def run(self, inputs: list[RunnerInput]) -> tuple[torch.Tensor, list[int]]:
        """Runs the step; returns logits [n, vocab] (float32, on the device; valid until the next
        step) and, for each of the n rows, the index into `inputs` it belongs to."""
        if self.decoder is not None and self.decoder.accepts(inputs):
            return self.decoder.run(inputs)
        step = StepAttention(self.pool, [i.chunk for i in inputs])
        by_chunk = {id(i.chunk): (n, i) for n, i in enumerate(inputs)}
        ids: list[int] = []
        logits_index, owners = [], []
        for chunk in step.order:
            n, inp = by_chunk[id(chunk)]
            ids.extend(inp.token_ids)
            if inp.wants_logits:
                logits_index.append(len(ids) - 1)
                owners.append(n)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [T_total]
        positions = step.positions.to(self.device)  # [T_total]
        index = torch.tensor(logits_index, dtype=torch.long, device=self.device)  # [n]
        logits = hf_adapter.forward(self.model, input_ids, positions, step, index, self.layer_kinds)  # [n, V]
        step.commit()
        return logits, owners
