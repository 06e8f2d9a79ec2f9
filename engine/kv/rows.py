"""RowPool: the single owner of every K/V byte of the engine.

Storage, per decoder layer (K and V alike), token-major so any set of positions is one gather:

    paged layer   [num_blocks * block_size + 1, num_kv_heads, head_dim]   block 0 is the zero block
    ring layer    [(num_rows + 1) * ring_slots, num_kv_heads, head_dim]   ring_slots = sink + window

(num_kv_heads and head_dim are the layer's own: models such as Gemma 4 give full-attention
layers other K/V shapes than sliding ones).

(the last paged slot and ring row are scratch: see `scratch_paged_slot`).

A row is one session (or one stateless request). It owns a list of blocks (paged layers keep every
position, so memory follows the row's length) and a fixed run of ring slots per ring layer
(bounded layers keep sink + window positions, so memory is constant in context length). Ring
layers may keep windows of different sizes (per-layer windows, kv/windows.py): the layers that
share one (sink, window) form a `Ring`, whose storage has `sink + window` slots per row and whose
`pos[row, slot]` is the position a slot holds (-1: empty). A forward split over several steps stages its own tokens
for staged ring layers until its last chunk (see policy.py); staging is transient and counted.

Verbs check before they commit (`can_allocate_row` / `allocate_row`, `can_reserve` / `reserve`,
`can_fork` / `fork`),
and `check_invariants()` verifies: free + used == total for rows and blocks, no block held by two
rows except as counted (forks share their prompt's full blocks) and below each holder's length,
bytes accounted == bytes allocated, and every ring slot holds the position that maps to it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.kv.policy import LayerLayout, ring_slot


@dataclass
class Ring:
    """The ring layers that keep one (sink, window): one slot map, one record of positions."""

    sink: int
    window: int
    layers: list[int]
    pos: torch.Tensor  # [num_rows, slots] host, the position each slot holds (-1: empty)
    position_bytes: int  # K and V of one position on all of `layers`

    def __post_init__(self) -> None:
        self.pos_np = self.pos.numpy()  # the same memory: per-step writes without torch dispatch

    @property
    def slots(self) -> int:
        return self.sink + self.window

    def slot(self, pos: int) -> int:
        return ring_slot(pos, self.sink, self.window)

    def survives(self, pos: int, end: int) -> bool:
        return pos < self.sink or pos >= end - self.window

    def base(self, row):
        """First storage slot of `row` (an int, or a tensor of rows)."""
        return row * self.slots

    def range(self, row: int) -> slice:
        return slice(row * self.slots, (row + 1) * self.slots)


@dataclass
class Staging:
    """This forward's own tokens on staged ring layers, while it spans several steps."""

    start: int  # first position of the forward
    k: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n, Hkv, D]
    v: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return next(iter(self.k.values())).shape[0] if self.k else 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k.values()) + sum(t.nbytes for t in self.v.values())


@dataclass
class RowState:
    kv_len: int = 0  # positions whose K/V the row holds (computed)
    blocks: list[int] = field(default_factory=list)  # paged layers: block ids, in position order
    staging: Staging | None = None


@dataclass
class RowSnapshot:
    """A row as it was at a turn boundary; restoring it undoes a cancelled turn exactly."""

    kv_len: int
    ring_pos: list[torch.Tensor]  # per ring: [slots]
    ring_k: dict[int, torch.Tensor]  # layer -> [slots, Hkv, D]
    ring_v: dict[int, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.ring_k.values()) * 2


@dataclass
class SwappedRow:
    """A whole row copied to host memory (its pool row and blocks released); `RowPool.swap_in`
    puts it back exactly, with no recompute."""

    kv_len: int
    ring_pos: list[torch.Tensor]  # per ring: [slots]
    ring_k: dict[int, torch.Tensor]  # ring layer -> [slots, Hkv, D]
    ring_v: dict[int, torch.Tensor]
    paged_k: dict[int, torch.Tensor]  # paged layer -> [kv_len, Hkv, D]
    paged_v: dict[int, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for d in (self.ring_k, self.ring_v, self.paged_k, self.paged_v) for t in d.values())


class RowPool:
    def __init__(
        self,
        layouts: list[LayerLayout],
        kv_shapes: list[tuple[int, int]],  # per layer: (num_kv_heads, head_dim)
        dtype: torch.dtype,
        device: torch.device | str,
        num_rows: int,
        block_size: int,
        num_blocks: int,
    ) -> None:
        self.layouts = layouts
        self.num_rows = num_rows
        self.block_size = block_size
        self.num_blocks = num_blocks  # including the reserved zero block 0
        self.device = torch.device(device)
        self.dtype = dtype
        self.paged_layers = [i for i, lay in enumerate(layouts) if lay.paged]
        self.ring_layers = [i for i, lay in enumerate(layouts) if not lay.paged]
        staged = {layouts[i].staged for i in self.ring_layers}
        if len(staged) > 1:
            raise ValueError("ring layers must all be staged or all not")
        self.staged = staged.pop() if staged else False
        if self.paged_layers and num_blocks < 2:
            raise ValueError("the paged pool needs at least 2 blocks (block 0 is reserved)")

        if len(kv_shapes) != len(layouts):
            raise ValueError("one (num_kv_heads, head_dim) per layer")
        item = torch.empty((), dtype=dtype).element_size()
        token_bytes = [h * d * item for h, d in kv_shapes]  # one position of one layer, K or V
        # K and V of one position on every paged layer
        self.paged_position_bytes = 2 * sum(token_bytes[i] for i in self.paged_layers)
        self.block_bytes = block_size * self.paged_position_bytes
        shapes = sorted({(layouts[i].sink, layouts[i].window) for i in self.ring_layers})
        self.rings: list[Ring] = []
        self.ring_of: dict[int, int] = {}  # ring layer -> index in `rings`
        for r, (sink, window) in enumerate(shapes):
            layers = [i for i in self.ring_layers if (layouts[i].sink, layouts[i].window) == (sink, window)]
            self.rings.append(Ring(sink, window, layers, torch.full((num_rows, sink + window), -1, dtype=torch.long),
                                   2 * sum(token_bytes[i] for i in layers)))
            self.ring_of.update({i: r for i in layers})
        self.ring_row_bytes = sum(ring.slots * ring.position_bytes for ring in self.rings)  # one row, every ring

        # One scratch place per layout, never owned by a row: the last paged slot and the ring row
        # `num_rows`. Padding lanes of a fixed-size decode batch (decode_graph.py) write there.
        self.scratch_paged_slot = num_blocks * block_size
        self.scratch_ring_row = num_rows
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for lay, (num_kv_heads, head_dim) in zip(layouts, kv_shapes):
            n = num_blocks * block_size + 1 if lay.paged else (num_rows + 1) * self.rings[self.ring_of[len(self.k)]].slots
            # Zeroed: padding gathers read block 0 and empty ring slots, and masked keys must
            # still be finite (0 * NaN would poison the softmax).
            shape = (n, num_kv_heads, head_dim)  # [slots, Hkv, D]
            self.k.append(torch.zeros(shape, dtype=dtype, device=self.device))
            self.v.append(torch.zeros(shape, dtype=dtype, device=self.device))

        # On the CPU, gathers copy into two buffers kept here, grown as needed and reused by every
        # gather (each read before the next): a step's gathers of a long context's keys are tens
        # of MB, and a fresh tensor that size is memory the kernel maps and zero-fills on first
        # touch every time (5x the copy at 32 rows of 1,238 tokens).
        self._gather_buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

        self._rows: dict[int, RowState] = {}
        self._free_rows: list[int] = list(range(num_rows - 1, -1, -1))
        self._free_blocks: list[int] = list(range(num_blocks - 1, 0, -1))
        # Blocks more than one row holds (forks share their prompt's full blocks): block -> rows.
        # A shared block is never written: it lies below every holder's length, and the rows that
        # share one (n completions of one stateless request) only grow until they are freed.
        self._shared: dict[int, int] = {}

    @classmethod
    def sized(cls, layouts: list[LayerLayout], kv_shapes: list[tuple[int, int]], dtype: torch.dtype,
              device: torch.device | str, num_rows: int, block_size: int, cache_bytes: int) -> RowPool:
        """A pool whose paged blocks take about `cache_bytes` (at least one block besides block 0)."""
        item = torch.empty((), dtype=dtype).element_size()
        paged_bytes = sum(2 * h * d * item for (h, d), lay in zip(kv_shapes, layouts) if lay.paged)
        num_blocks = max(2, cache_bytes // (block_size * max(paged_bytes, 1)) + 1)
        return cls(layouts, kv_shapes, dtype, device, num_rows=num_rows, block_size=block_size, num_blocks=num_blocks)

    # ---- capacity -----------------------------------------------------------------------------
    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks) if self.paged_layers else 1 << 62

    def blocks_for(self, num_tokens: int) -> int:
        if not self.paged_layers:
            return 0
        return -(-num_tokens // self.block_size)

    def blocks_to_reserve(self, row: int | None, total_len: int) -> int:
        held = len(self._rows[row].blocks) if row is not None else 0
        return max(0, self.blocks_for(total_len) - held)

    def can_allocate_row(self) -> bool:
        return bool(self._free_rows)

    def can_reserve(self, row: int | None, total_len: int) -> bool:
        return self.blocks_to_reserve(row, total_len) <= self.num_free_blocks

    # ---- commit verbs ---------------------------------------------------------------------------
    def allocate_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free KV row")
        row = self._free_rows.pop()
        self._rows[row] = RowState()
        self._clear_rings(row)
        return row

    def reserve(self, row: int, total_len: int) -> None:
        """Ensure the row owns blocks for `total_len` positions."""
        need = self.blocks_to_reserve(row, total_len)
        if need > len(self._free_blocks):
            raise RuntimeError("not enough free KV blocks")
        for _ in range(need):
            self._rows[row].blocks.append(self._free_blocks.pop())

    def trim(self, row: int) -> None:
        """Release blocks past the row's length (reserved for a turn that ended early)."""
        state = self._rows[row]
        keep = self.blocks_for(state.kv_len)
        while len(state.blocks) > keep:
            self._release(state.blocks.pop())

    def free_row(self, row: int) -> None:
        state = self._rows.pop(row)
        for block in reversed(state.blocks):
            self._release(block)
        self._clear_rings(row)
        self._free_rows.append(row)

    def _release(self, block: int) -> None:
        """A row lets go of `block`: free once no row holds it."""
        holders = self._shared.pop(block, 1)
        if holders > 2:
            self._shared[block] = holders - 1
        elif holders == 1:
            self._free_blocks.append(block)

    def _clear_rings(self, row: int) -> None:
        for ring in self.rings:
            ring.pos[row] = -1

    def reset_row(self, row: int) -> None:
        """Empty a row in place (keeps the row, releases its blocks)."""
        state = self._rows[row]
        state.kv_len = 0
        state.staging = None
        self._clear_rings(row)
        self.trim(row)

    # ---- forks (n completions of one prompt) -----------------------------------------------------
    def can_fork(self, src: int, dst: int) -> bool:
        """Whether `fork(src, dst)` can copy `src` into `dst`: `src` is between forwards, `dst` is
        another row, empty, holding blocks for `src`'s positions."""
        a, b = self._rows.get(src), self._rows.get(dst)
        return (a is not None and b is not None and src != dst and a.staging is None and b.staging is None
                and b.kv_len == 0 and len(b.blocks) >= self.blocks_for(a.kv_len))

    def fork(self, src: int, dst: int) -> None:
        """Make the fresh row `dst` (allocated and reserved by the caller, empty) hold what `src`
        holds: its ring slots and their positions are copied; its full paged blocks are shared
        (copy-on-write without the copy: nothing writes below a row's length), and `dst` gives
        back the blocks it had reserved in their place; the positions of `src`'s last, partial
        block are copied into `dst`'s own block, where both rows go on writing."""
        if not self.can_fork(src, dst):
            raise RuntimeError(f"row {src} cannot be forked into row {dst}")
        kv_len = self._rows[src].kv_len
        for i in self.ring_layers:
            a, b = self._ring_range(src, i), self._ring_range(dst, i)
            self.k[i][b] = self.k[i][a]
            self.v[i][b] = self.v[i][a]
        full = kv_len // self.block_size if self.paged_layers else 0
        ours, theirs = self._rows[dst].blocks, self._rows[src].blocks
        for k in range(full):
            self._release(ours[k])
            ours[k] = theirs[k]
            self._shared[ours[k]] = self._shared.get(ours[k], 1) + 1
        if self.paged_layers and kv_len > full * self.block_size:
            from_slots = torch.from_numpy(self.paged_slots(src, full * self.block_size, kv_len)).to(self.device)
            to_slots = torch.from_numpy(self.paged_slots(dst, full * self.block_size, kv_len)).to(self.device)
            for i in self.paged_layers:
                self.k[i].index_copy_(0, to_slots, self.k[i].index_select(0, from_slots))
                self.v[i].index_copy_(0, to_slots, self.v[i].index_select(0, from_slots))
        for ring in self.rings:
            ring.pos[dst] = ring.pos[src]
        self._rows[dst].kv_len = kv_len

    # ---- snapshots (rollback of a cancelled turn) ------------------------------------------------
    def _ring_range(self, row: int, layer: int) -> slice:
        return self.rings[self.ring_of[layer]].range(row)

    def _set_ring_pos(self, row: int, ring_pos: list[torch.Tensor]) -> None:
        for ring, pos in zip(self.rings, ring_pos):
            ring.pos[row] = pos

    def snapshot(self, row: int) -> RowSnapshot:
        return RowSnapshot(
            kv_len=self._rows[row].kv_len,
            ring_pos=[ring.pos[row].clone() for ring in self.rings],
            ring_k={i: self.k[i][self._ring_range(row, i)].clone() for i in self.ring_layers},
            ring_v={i: self.v[i][self._ring_range(row, i)].clone() for i in self.ring_layers},
        )

    def restore(self, row: int, snap: RowSnapshot) -> None:
        for i in self.ring_layers:
            self.k[i][self._ring_range(row, i)] = snap.ring_k[i]
            self.v[i][self._ring_range(row, i)] = snap.ring_v[i]
        self._set_ring_pos(row, snap.ring_pos)
        state = self._rows[row]
        state.kv_len = snap.kv_len
        state.staging = None
        self.trim(row)

    # ---- swapping whole rows to host memory ---------------------------------------------------------
    def swap_nbytes(self, row: int) -> int:
        """Host bytes a swap of this row takes: its ring slots and the positions it holds."""
        return self.kv_len(row) * self.paged_position_bytes + self.ring_row_bytes

    def swap_out(self, row: int) -> SwappedRow:
        """Copy the row to host memory and free it (and its blocks). The row must be between
        forwards (no staging)."""
        state = self._rows[row]
        assert state.staging is None, "a row is swapped only between forwards"
        host = torch.device("cpu")
        slots = torch.from_numpy(self.paged_slots(row, 0, state.kv_len)).to(self.device)
        out = SwappedRow(
            kv_len=state.kv_len,
            ring_pos=[ring.pos[row].clone() for ring in self.rings],
            ring_k={i: self.k[i][self._ring_range(row, i)].to(host, copy=True) for i in self.ring_layers},
            ring_v={i: self.v[i][self._ring_range(row, i)].to(host, copy=True) for i in self.ring_layers},
            paged_k={i: self.k[i].index_select(0, slots).to(host) for i in self.paged_layers},
            paged_v={i: self.v[i].index_select(0, slots).to(host) for i in self.paged_layers},
        )
        self.free_row(row)
        return out

    def swap_in(self, swapped: SwappedRow, total_len: int) -> int:
        """A new row holding exactly what `swapped` held, with blocks for `total_len` positions."""
        row = self.allocate_row()
        self.reserve(row, max(total_len, swapped.kv_len))
        for i in self.ring_layers:
            self.k[i][self._ring_range(row, i)] = swapped.ring_k[i].to(self.device)
            self.v[i][self._ring_range(row, i)] = swapped.ring_v[i].to(self.device)
        slots = torch.from_numpy(self.paged_slots(row, 0, swapped.kv_len)).to(self.device)
        for i in self.paged_layers:
            self.k[i].index_copy_(0, slots, swapped.paged_k[i].to(self.device))
            self.v[i].index_copy_(0, slots, swapped.paged_v[i].to(self.device))
        self._set_ring_pos(row, swapped.ring_pos)
        self._rows[row].kv_len = swapped.kv_len
        return row

    def contents(self, row: int) -> tuple[int, list[int], list[torch.Tensor], list[torch.Tensor]]:
        """Everything the row holds, on the host: (kv_len, ring positions per ring, K, V), K and V
        per layer (ring layers' slots, then paged layers' positions). For checks, not the step."""
        kv_len = self.kv_len(row)
        slots = torch.from_numpy(self.paged_slots(row, 0, kv_len)).to(self.device)
        ks = [self.k[i][self._ring_range(row, i)].cpu() for i in self.ring_layers]
        vs = [self.v[i][self._ring_range(row, i)].cpu() for i in self.ring_layers]
        ks += [self.k[i][slots].cpu() for i in self.paged_layers]
        vs += [self.v[i][slots].cpu() for i in self.paged_layers]
        return kv_len, [ring.pos[row].tolist() for ring in self.rings], ks, vs

    # ---- a layer's K/V, for the step's attention ---------------------------------------------------
    def store(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V storage [slots, Hkv, D], for kernels that index it by slot themselves
        (the static decode step's attention reads and stores through slots it is given)."""
        return self.k[layer], self.v[layer]

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` [B, L] -> [B, L, Hkv, D] each; index_select copies whole slots and ran
        ~5x faster than advanced indexing for these shapes on the CPU. On the CPU the results are
        views of the pool's gather buffers: valid until the next gather."""
        flat = slots.reshape(-1)
        k, v = self.k[layer], self.v[layer]
        if self.device.type != "cpu":
            return k.index_select(0, flat).unflatten(0, slots.shape), v.index_select(0, flat).unflatten(0, slots.shape)
        n, key = flat.numel(), tuple(k.shape[1:])
        bk, bv = self._gather_buffers.get(key, (None, None))
        if bk is None or bk.shape[0] < n:
            bk, bv = (torch.empty((n, *key), dtype=k.dtype) for _ in range(2))
            self._gather_buffers[key] = bk, bv
        torch.index_select(k, 0, flat, out=bk[:n])
        torch.index_select(v, 0, flat, out=bv[:n])
        return bk[:n].unflatten(0, slots.shape), bv[:n].unflatten(0, slots.shape)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V [n, Hkv, D] at `slots` [n]."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def staged_kv(self, row: int, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The K and V [n, Hkv, D] the row's open forward staged on a staged ring layer, if any."""
        st = self._rows[row].staging
        return (st.k[layer], st.v[layer]) if st is not None and layer in st.k else None

    def staged_span(self, row: int) -> tuple[int, int] | None:
        """(first position, tokens) the row's open forward has staged, or None (nothing staged)."""
        st = self._rows[row].staging if self.staged else None
        return (st.start, st.num_tokens) if st is not None and st.num_tokens > 0 else None

    # ---- reads for the step ---------------------------------------------------------------------
    def row(self, row: int) -> RowState:
        return self._rows[row]

    def kv_len(self, row: int) -> int:
        return self._rows[row].kv_len

    def paged_slots(self, row: int, start: int, end: int) -> np.ndarray:
        """Storage slots (int64) of positions [start, end) on paged layers (blocks must be
        reserved); none when the pool has no paged layers."""
        if not self.paged_layers:
            return np.zeros(0, dtype=np.int64)
        blocks, bs = np.asarray(self._rows[row].blocks, dtype=np.int64), self.block_size
        p = np.arange(start, end, dtype=np.int64)
        return blocks[p // bs] * bs + p % bs

    def ring(self, layer: int) -> Ring:
        """The ring of a ring layer."""
        return self.rings[self.ring_of[layer]]

    # ---- writes during the step (called per layer by the attention) -----------------------------
    def stage(self, row: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append this forward's new K/V ([n, Hkv, D]) to the row's staging for `layer`."""
        st = self._rows[row].staging
        assert st is not None, "staging must be opened before the forward"
        if layer in st.k:
            st.k[layer] = torch.cat([st.k[layer], k])
            st.v[layer] = torch.cat([st.v[layer], v])
        else:
            st.k[layer], st.v[layer] = k.clone(), v.clone()

    def open_staging(self, row: int, start: int) -> Staging:
        state = self._rows[row]
        if state.staging is None:
            state.staging = Staging(start=start)
        return state.staging

    # ---- bookkeeping after the step ---------------------------------------------------------------
    def commit(self, row: int, end: int, forward_start: int, forward_done: bool) -> None:
        """Record that the row now holds positions [0, end); update ring slot positions."""
        state = self._rows[row]
        start = state.kv_len
        state.kv_len = end
        if not self.ring_layers:
            return
        if self.staged and not forward_done:
            return  # this forward's tokens stay staged until its last chunk
        first = forward_start if self.staged else start
        for ring in self.rings:
            for p in range(max(first, end - ring.window), end):
                ring.pos_np[row, ring.slot(p)] = p
            for p in range(first, min(end, ring.sink)):
                ring.pos_np[row, p] = p
        if forward_done:
            state.staging = None

    def commit_decodes(self, rows: list[int], positions: list[int]) -> None:
        """`commit(row, p + 1, p, True)` for one-token forwards of many rows at once (one tensor
        write for all ring positions instead of one per row)."""
        for row, p in zip(rows, positions):
            state = self._rows[row]
            assert state.kv_len == p and state.staging is None
            state.kv_len = p + 1
        if rows:
            for ring in self.rings:
                ring.pos_np[rows, [ring.slot(p) for p in positions]] = positions

    def undo_decode(self, row: int, p: int, evicted: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Undo the row's last one-token forward (position `p`), which a step launched ahead of
        the host computed for a row that had finished one step earlier: the row holds [0, p)
        again. `evicted`: per ring layer, the (k, v) [Hkv, D] its store overwrote."""
        state = self._rows[row]
        assert state.kv_len == p + 1 and state.staging is None
        state.kv_len = p
        for ring in self.rings:
            slot = ring.slot(p)
            old = p - ring.window  # the slot's previous position: the oldest of the window, if any
            ring.pos_np[row, slot] = old if old >= ring.sink else -1
            dst = ring.base(row) + slot
            for i in ring.layers:
                k, v = evicted[i]
                self.k[i][dst] = k
                self.v[i][dst] = v

    # ---- accounting ----------------------------------------------------------------------------
    def resident_kv_bytes(self, row: int) -> dict[str, int]:
        """Bytes the row holds: paged (exact layers), ring (bounded layers), staging (transient)."""
        state = self._rows[row]
        staging = state.staging.nbytes if state.staging is not None else 0
        paged = len(state.blocks) * self.block_bytes
        ring = self.ring_row_bytes
        return {"paged": paged, "ring": ring, "staging": staging, "total": paged + ring + staging}

    def allocated_bytes(self) -> int:
        """Bytes of K/V storage, less the reserved zero block and the scratch places."""
        total = sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)
        scratch = self.paged_position_bytes + self.ring_row_bytes
        return total - scratch - (self.block_bytes if self.paged_layers else 0)

    def used_rows(self) -> list[int]:
        return sorted(self._rows)

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's books do not balance."""
        used = set(self._rows)
        free = set(self._free_rows)
        assert not used & free, "a row is both used and free"
        assert len(free) == len(self._free_rows), "a row is free twice"
        assert used | free == set(range(self.num_rows)), "rows leaked"
        owned: list[int] = [b for s in self._rows.values() for b in s.blocks]
        holders = Counter(owned)
        assert {b: n for b, n in holders.items() if n > 1} == self._shared, "a block is held by rows it does not count"
        for row, state in self._rows.items():  # a shared block lies below each holder's length
            assert all((k + 1) * self.block_size <= state.kv_len
                       for k, b in enumerate(state.blocks) if b in self._shared), "a shared block can be written"
        owned = list(holders)
        assert not set(owned) & set(self._free_blocks), "a block is both owned and free"
        assert len(set(self._free_blocks)) == len(self._free_blocks), "a block is free twice"
        if self.paged_layers:
            assert 0 not in owned and 0 not in self._free_blocks, "the zero block escaped"
            assert len(owned) + len(self._free_blocks) == self.num_blocks - 1, "blocks leaked"
        accounted = len(owned) * self.block_bytes
        accounted += len(self._free_blocks) * self.block_bytes if self.paged_layers else 0
        accounted += self.num_rows * self.ring_row_bytes
        assert accounted == self.allocated_bytes(), "bytes accounted != bytes allocated"
        for row, state in self._rows.items():
            assert self.blocks_for(state.kv_len) <= len(state.blocks), "row longer than its blocks"
            for ring in self.rings:
                for slot, pos in enumerate(ring.pos[row].tolist()):
                    if pos >= 0:
                        assert pos < state.kv_len, "ring slot holds a future position"
                        assert ring.slot(pos) == slot, "ring slot misplaced"
        for row in free:
            assert all(bool((ring.pos[row] == -1).all()) for ring in self.rings), "a free row still maps positions"
