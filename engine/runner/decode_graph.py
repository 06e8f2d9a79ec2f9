"""Static decode steps: a decode-only step runs a fixed-size batch whose inputs live in device
tensors, so the whole forward (every layer, the output layer) is captured once per batch size
as a CUDA graph and replayed with one launch.

A step qualifies when every scheduled row feeds exactly one token as a complete forward: a decode,
a one-token turn, or a one-token forward replayed to rebuild a session's row (no logits wanted).
The batch is padded to the next bucket size; padding lanes read the zero block and write only the
pool's scratch places, so they touch no row.

Per step the host writes one small int64 tensor (token ids, positions, rows, the K/V write slots
on paged layers and on each ring of the pool, token sources) and copies it to the device without a sync; block tables
live in a device mirror that is rewritten only for rows whose blocks changed. Attention runs the
ragged decode kernels of `kernels/decode_attention.py` straight on the pool's storage. The host
books (kv_len, ring positions) are committed exactly as the eager path commits them.

A step may also be launched before the host has seen the tokens it feeds (`run(..., sources)`):
a lane then reads its token id on the device, from the tokens the previous static step left in
`last` (its greedy tokens, or the engine's sampled draws, `feed_next`). The engine does this to
overlap its host work with the device (core/ahead.py). A row that turns out to have finished one
step earlier must get its state back:
with `undoable`, ring layers keep what each store overwrote (`evicted`), and `RowPool.undo_decode`
puts it back.

On the CPU the same step runs without capture (`EngineConfig.decode_graphs=True`); tests use it
to hold the static path to the eager one.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels.decode_attention import decode_attention
from engine.kv.rows import RowPool
from engine.runner.logits_process import logprobs_unpack
from engine.runner.sampler import greedy_tokens
from engine.core.types import StepLogits
from engine.runner.transfer import to_device

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def buckets_upto(max_batch: int) -> list[int]:
    return sorted({b for b in BUCKETS if b < max_batch} | {max_batch})


class DecodeBatch:
    """The step attention (`s5_step`) of a static decode of `size` lanes."""

    IDS, POS, ROWS, PAGED_SLOT, SRC, RING_SLOT = range(6)  # RING_SLOT + r: the write slot on ring r

    def __init__(self, pool: RowPool, size: int, table: torch.Tensor, last: torch.Tensor,
                 evicted: dict[int, tuple[torch.Tensor, torch.Tensor]] | None, pdl: bool = False) -> None:
        self.pool = pool
        self.size = size
        self.pdl = pdl  # the attention kernels launched with PDL (kernels/launch.py)
        self.table = table  # [num_rows + 1, max_blocks] int32, the decoder's block-table mirror
        self.last = last  # [max_batch] the previous static step's greedy tokens, per lane
        self.evicted = evicted  # ring layer -> (k, v) [max_batch, Hkv, D]: what the step's stores overwrote
        dev = pool.device
        fields = self.RING_SLOT + max(1, len(pool.rings))
        self.inputs = torch.zeros((fields, size), dtype=torch.long, device=dev)
        self.ids, self.pos, self.rows, self.paged_slot, self.src, *self.ring_slot = self.inputs.unbind(0)
        self.padding = torch.zeros((fields, size), dtype=torch.long)
        self.padding[self.ROWS] = pool.scratch_ring_row
        self.padding[self.PAGED_SLOT] = pool.scratch_paged_slot
        for r, ring in enumerate(pool.rings):
            self.padding[self.RING_SLOT + r] = ring.base(pool.scratch_ring_row)
        self.padding[self.SRC] = -1
        self.padding_np = self.padding.numpy()
        cuda = dev.type == "cuda"
        # Two host buffers in turn: a step that wants no logits (a replayed forward) ends with no
        # sync, so the next step must not overwrite the buffer an earlier copy may still read.
        self.hosts = [self.padding.clone().pin_memory() if cuda else self.padding.clone() for _ in range(2)]
        self.hosts_np = [h.numpy() for h in self.hosts]  # the same memory, written without torch dispatch
        self.copied = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.turn = 0
        self.inputs.copy_(self.hosts[0])

    def load(self, lanes: list[tuple[int, ...]]) -> None:
        """Per-lane (id, pos, row, paged slot, source lane or -1, ring slot per ring); the rest
        are padding.
        No host sync beyond waiting for the copy two steps back, which the device has long
        finished."""
        n = len(lanes)
        self.turn ^= 1
        host, copied = self.hosts[self.turn], self.copied[self.turn]
        if copied is not None:
            copied.synchronize()
        view = self.hosts_np[self.turn]
        view[:, :n] = np.array(lanes, dtype=np.int64).T
        if n < self.size:
            view[:, n:] = self.padding_np[:, n:]
        self.inputs.copy_(host, non_blocking=True)
        if copied is not None:
            copied.record()

    def token_ids(self) -> torch.Tensor:
        """Each lane's token: the host's, or (source lane >= 0) the greedy token that lane of the
        previous static step produced, read on the device."""
        return torch.where(self.src >= 0, self.last[self.src.clamp(min=0)], self.ids)

    def attend(self, layer, query, key, value, scaling, softcap=None) -> torch.Tensor:
        """Attention output [1, B, H, D]; stores the new K/V. Same contract as StepAttention."""
        pool = self.pool
        lay = pool.layouts[layer]
        q = query[0].transpose(0, 1)  # [B, H, D]
        k_new = key[0].transpose(0, 1)  # [B, Hkv, D]
        v_new = value[0].transpose(0, 1)
        ks, vs = pool.store(layer)
        # the kernel stores the new K/V itself, after every read of the store (a ring slot it
        # takes may still hold a key this query sees)
        if lay.paged:
            out = decode_attention(q, ks, vs, self.rows, self.pos, scale=scaling, softcap=softcap,
                                   attn_window=lay.attn_window, block_table=self.table, page=pool.block_size,
                                   k_new=k_new, v_new=v_new, store_slot=self.paged_slot, pdl=self.pdl)
        else:
            r = pool.ring_of[layer]
            ring = pool.rings[r]
            out = decode_attention(q, ks, vs, self.rows, self.pos, scale=scaling, softcap=softcap,
                                   attn_window=lay.attn_window, ring=(ring.sink, ring.window),
                                   k_new=k_new, v_new=v_new, store_slot=self.ring_slot[r],
                                   evicted=self.evicted[layer] if self.evicted is not None else None, pdl=self.pdl)
        return out.unsqueeze(0)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` on the host, queued (into pinned memory from a CUDA device): no sync."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
    host.copy_(t, non_blocking=True)
    return host


class GreedyFetch:
    """A static step's greedy tokens on their way to the host: the copy is queued right behind the
    step, and `result()` waits for that copy alone (not for steps queued after it)."""

    def __init__(self, host: np.ndarray, done: torch.cuda.Event | None,
                 logprobs: tuple[torch.Tensor, list[int], list[int]] | None = None) -> None:
        self.host, self.done = host, done  # host: [2, n], the copy's destination
        self.logprobs = logprobs  # (a `logprobs_pack` copied behind the tokens, its lanes, their k)

    def ready(self) -> bool:
        """Whether the copy has landed, without waiting (on the CPU, when it was made)."""
        return self.done is None or self.done.query()

    def result(self) -> tuple[list[int], list[bool]]:
        if self.done is not None:
            self.done.synchronize()
        return self.host[0].tolist(), [bool(x) for x in self.host[1]]

    def lane_logprobs(self) -> dict:
        """{lane: TokenLogprobs} of the lanes that want logprobs (after `result`)."""
        if self.logprobs is None:
            return {}
        pack, lanes, ks = self.logprobs
        return dict(zip(lanes, logprobs_unpack(pack.tolist(), ks)))


class GraphDecoder:
    """Owns the static decode batches, their CUDA graphs, the block-table mirror and the buffers
    of steps launched ahead (`last`, `evicted`, the host copies of their tokens)."""

    def __init__(self, forward, pool: RowPool, max_batch: int, max_model_len: int, capture: bool,
                 undoable: bool = False, pdl=None) -> None:
        """`forward(ids, positions, step, logits_index)`: the runner's model forward. `undoable`:
        ring stores keep what they overwrite, for `RowPool.undo_decode`. `pdl(size)`: whether a
        batch of `size` lanes launches its attention kernels with PDL (None: never)."""
        self.forward = forward
        self.pool = pool
        self.max_batch = max_batch
        dev = pool.device
        max_blocks = max(1, min(pool.blocks_for(max_model_len), pool.num_blocks - 1)) if pool.paged_layers else 1
        self.table = torch.zeros((pool.num_rows + 1, max_blocks), dtype=torch.int32, device=dev)
        self._mirrored: dict[int, list[int]] = {}
        self.last = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.evicted = None
        if undoable:
            shapes = {i: pool.store(i)[0].shape[1:] for i in pool.ring_layers}  # [Hkv, D] per ring layer
            self.evicted = {i: (torch.zeros((max_batch, *shape), dtype=pool.dtype, device=dev),
                                torch.zeros((max_batch, *shape), dtype=pool.dtype, device=dev))
                            for i, shape in shapes.items()}
        cuda = dev.type == "cuda"
        # two in turn: the host reads one step's tokens while the next step's copy is queued;
        # flat, so a step's [2, n] is one contiguous run (an asynchronous copy needs one)
        self._fetch_host = [torch.zeros(2 * max_batch, dtype=torch.long) for _ in range(2)]
        if cuda:
            self._fetch_host = [h.pin_memory() for h in self._fetch_host]
        self._fetch_np = [h.numpy() for h in self._fetch_host]
        self._fetch_done = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._fetch_turn = 0
        self.batches = {b: DecodeBatch(pool, b, self.table, self.last, self.evicted, pdl is not None and pdl(b))
                        for b in buckets_upto(max_batch)}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.steps = 0  # steps run here (graph replays, or uncaptured static steps)
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per graph: (logits, greedy)
        if capture:
            self._capture()

    def accepts(self, inputs) -> bool:
        return 0 < len(inputs) <= self.max_batch and all(
            i.chunk.num_tokens == 1 and i.chunk.forward_start == i.chunk.start
            and i.chunk.forward_done for i in inputs)

    def _forward(self, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of every lane and their greedy tokens (both computed in the captured graph: a
        greedy step then copies one small tensor to the host after the replay)."""
        logits = self.forward(batch.token_ids(), batch.pos, batch, None)
        greedy = greedy_tokens(logits)
        self.last[: batch.size].copy_(greedy[0])  # for a step launched before the host sees them
        return logits, greedy

    @torch.inference_mode()
    def _capture(self) -> None:
        """Largest first, all graphs in one memory pool. Warm-up runs and the first replay (on the
        padding inputs) write only scratch places."""
        mempool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for size in sorted(self.batches, reverse=True):
            batch = self.batches[size]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles kernels, sets up library handles
                    self._forward(batch)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                self.outputs[size] = self._forward(batch)
            graph.replay()  # a graph's first launch uploads it to the device (ms): not in a served step
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def _sync_table(self, row: int) -> None:
        blocks = self.pool.row(row).blocks
        if self._mirrored.get(row) != blocks:
            if blocks:
                self.table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32).to(self.table.device)
            self._mirrored[row] = list(blocks)

    def fetch(self, greedy: torch.Tensor, logprobs=None) -> GreedyFetch:
        """Queue the copy of a step's greedy tokens [2, n] to the host (and of `logprobs`, a
        `logprobs_pack` with its lanes and their k, where rows want them); no sync."""
        self._fetch_turn ^= 1
        t = self._fetch_turn
        n = greedy.shape[1]
        self._fetch_host[t][: 2 * n].view(2, n).copy_(greedy.contiguous(), non_blocking=True)
        if logprobs is not None:  # rare (only rows that ask): an allocation per step is fine
            logprobs = (_to_host(logprobs[0]), *logprobs[1:])
        done = self._fetch_done[t]
        if done is not None:
            done.record()
        return GreedyFetch(self._fetch_np[t][: 2 * n].reshape(2, n), done, logprobs)

    def fetch_apart(self, tokens: torch.Tensor, logprobs=None) -> GreedyFetch:
        """`fetch` of picks made apart from a step's own (a grammar row's, [2, r]), into a host
        buffer of their own: the step's double buffer is left to the steps."""
        host = _to_host(tokens)
        if logprobs is not None:
            logprobs = (_to_host(logprobs[0]), *logprobs[1:])
        done = torch.cuda.Event() if tokens.device.type == "cuda" else None
        if done is not None:
            done.record()
        return GreedyFetch(host.numpy(), done, logprobs)

    def feed(self, lanes: list[int], tokens: torch.Tensor) -> None:
        """`tokens` [len(lanes)] into those lanes of `last`, for the step launched next."""
        self.last.index_copy_(0, to_device(lanes, torch.long, self.last.device), tokens)

    def feed_next(self, tokens: torch.Tensor) -> None:
        """The tokens [n] lanes 0..n-1 of the last step produced, where they are not its greedy
        ones (sampled): a step launched next with `sources` reads these."""
        self.last[: tokens.shape[0]].copy_(tokens)

    def evicted_at(self, lane: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """What the newest step's ring stores overwrote for `lane`: layer -> (k, v) [Hkv, D]."""
        assert self.evicted is not None, "built without undoable stores"
        return {i: (k[lane], v[lane]) for i, (k, v) in self.evicted.items()}

    def run(self, inputs, sources: list[int] | None = None) -> StepLogits:
        """`sources`: per input, the lane of the previous static step whose greedy token it feeds
        (its `token_ids` are then ignored), or -1."""
        pool = self.pool
        size = next(b for b in self.batches if b >= len(inputs))
        batch = self.batches[size]
        bs, paged, rings = pool.block_size, bool(pool.paged_layers), pool.rings
        lanes = []
        for n, inp in enumerate(inputs):
            c = inp.chunk
            p = c.start
            pslot = 0
            if paged:
                self._sync_table(c.row)
                pslot = pool.row(c.row).blocks[p // bs] * bs + p % bs
            rslots = [ring.base(c.row) + ring.slot(p) for ring in rings] or [0]
            lanes.append((inp.token_ids[0], p, c.row, pslot, -1 if sources is None else sources[n], *rslots))
        batch.load(lanes)
        self.steps += 1
        if size in self.graphs:
            self.graphs[size].replay()
            logits, greedy = self.outputs[size]
        else:
            logits, greedy = self._forward(batch)
        pool.commit_decodes([i.chunk.row for i in inputs], [i.chunk.start for i in inputs])
        owners = [n for n, i in enumerate(inputs) if i.wants_logits]
        if len(owners) == len(inputs):
            n = len(inputs)
            return StepLogits(logits[:n], owners, greedy[:, :n])
        idx = to_device(owners, torch.long, logits.device)
        return StepLogits(logits[idx], owners, greedy[:, idx])
