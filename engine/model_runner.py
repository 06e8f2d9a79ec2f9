"""ModelRunner: one batched forward per step over ragged rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import hf_adapter
from engine.attention import ForwardChunk, StepAttention
from engine.kv_rows import RowPool


@dataclass(frozen=True)
class RunnerInput:
    chunk: ForwardChunk
    token_ids: list[int]  # the chunk's new tokens
    wants_logits: bool  # sample a token after the chunk's last position


class ModelRunner:
    def __init__(self, model, pool: RowPool) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.device
        hf_adapter.use_row_attention(model)
        self.layer_kinds = frozenset(hf_adapter.geometry(model).layer_types)

    def run(self, inputs: list[RunnerInput]) -> tuple[torch.Tensor, list[int]]:
        """Runs the step; returns logits [n, vocab] (float32, on the device) and, for each of
        the n rows, the index into `inputs` it belongs to."""
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
