"""StepAttention: one step's ragged attention over the row pool, and its K/V write-back.

A step packs the new tokens of every scheduled row into one sequence (decode rows first, one token
each, then prefill chunks). Attention runs in groups without query padding: all one-token rows
together as a batch (keys padded to the longest row with masked zero slots), then each multi-token
chunk on its own. Every index and mask is built once per step here and shared by all layers of the
same layout; the per-layer work is a gather, one SDPA per group and one scatter.

On CUDA in half precision, the chunks that start a row (position 0: nothing resident, nothing
staged) come last and attend together in one variable-length flash attention call per layer
(`_Group.varlen`): their keys are their own new tokens, in place in the packed sequence, and the
mask reduces to causal plus the layer's attention window, which the kernel applies by blocks
without a mask tensor. No gather, mask or K/V head copy is built for them.

Mask (DESIGN.md section 1), for a query at position q in a forward that started at s:
key k is visible iff  k <= q,  q - k < attn_window (sliding layers),  and on ring layers
(k >= s  or  k < sink  or  k >= s - window), with the sink and window of the layer's ring
(RowPool.rings: ring layers may keep windows of different sizes). Resident ring slots hold only
such keys by construction; the rule is still applied here, so the mask alone defines what a query
sees.

Layers are told apart by their *store*: PAGED, or the index of their ring in the pool; indices,
masks and writes are built once per store (and attention window) and shared by its layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from engine.kv.rows import RowPool

# On the CPU, a prefill chunk longer than this attends in query blocks of this many tokens, each
# against only the keys its queries can see: under a causal mask, and more so under a sliding
# window, most of a long chunk's query x key grid is masked, and SDPA with an explicit mask
# computes all of it. On CUDA that grid costs less than the blocks' host work (a gather, a mask
# and an SDPA per block and layer), so a chunk attends in one call.
QUERY_BLOCK = 256
PAGED = -1  # the store of paged layers; ring layers' store is their ring's index


class ForwardChunk(NamedTuple):
    """One row's share of a step (a tuple: made per row per step, cheap to build)."""

    row: int
    num_tokens: int  # new tokens this step
    start: int  # position of the first new token (== the row's kv_len)
    forward_start: int  # first position of the logical forward this chunk belongs to
    forward_done: bool  # the logical forward ends with this chunk


@dataclass
class _Group:
    lo: int  # the group's tokens are packed[lo:hi], row-major: B rows of T tokens
    hi: int
    batch: int  # B
    gather: dict[int, torch.Tensor]  # store -> [B, L_res] storage slots
    staged_rows: list[int | None]  # B == 1 groups: row whose staging joins the keys
    masks: dict[tuple[int, int | None], torch.Tensor]  # (store, attn_window) -> [B, 1, T, L]
    # long single-chunk groups: (store, attn_window) -> [(t0, t1, keys, mask)], query blocks that
    # each attend only to the keys their rows can see (keys: a slice or an index tensor into L)
    blocks: dict[tuple[int, int | None], list] | None = None
    # one-token rows on the CPU with the paged-pool kernel: attn_window -> (lo, hi) [B] int32, the
    # positions each row's query sees on the paged layers (its keys are slots[b, lo:hi])
    paged_bounds: dict[int | None, tuple[torch.Tensor, torch.Tensor]] | None = None
    # and on the ring layers: (store, attn_window) -> (slots [B, L] int64, lo, hi [B] int32), the
    # ring slots each row's query sees first, then the row's new token (entry hi - 1)
    ring_keys: dict[tuple[int, int | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    # chunks that start their rows, attending together: (cumulative token counts [B + 1] int32 on
    # the device, longest chunk); their keys are their own tokens, packed[lo:hi]
    varlen: tuple[torch.Tensor, int] | None = None


class StepAttention:
    def __init__(self, pool: RowPool, chunks: list[ForwardChunk], paged_decode=None) -> None:
        """`paged_decode`: a CpuDecodeAttention (kernels/cpu_attention.py) that one-token rows on
        the CPU attend the paged layers with, reading the pool in place; None gathers for SDPA."""
        self.pool = pool
        self.chunks = chunks
        self.paged_decode = paged_decode
        dev = pool.device
        # One-token forwards (decodes) batch together; anything else, including the last token of
        # a longer forward (it may need staged keys), runs as a group of its own.
        single = [c.num_tokens == 1 and c.forward_start == c.start for c in chunks]
        decode = [c for c, one in zip(chunks, single) if one]
        prefill = [c for c, one in zip(chunks, single) if not one]
        fresh = [c for c in prefill if c.start == 0] if _varlen_ok(pool) else []
        if fresh:
            prefill = [c for c in prefill if c.start != 0]
        self.order = decode + prefill + fresh  # packed order of the step's tokens
        offsets, n = [], 0
        for c in self.order:
            offsets.append(n)
            n += c.num_tokens
        self.num_tokens = n
        self.positions = torch.tensor(
            [p for c in self.order for p in range(c.start, c.start + c.num_tokens)], dtype=torch.long
        )  # [T_total]
        self.store = [PAGED if lay.paged else pool.ring_of[i] for i, lay in enumerate(pool.layouts)]
        classes = {(store, lay.attn_window) for store, lay in zip(self.store, pool.layouts)}
        self.groups: list[_Group] = []
        if decode:
            self.groups.append(self._group(decode, offsets[: len(decode)], classes, dev))
        for c, off in zip(prefill, offsets[len(decode) : len(decode) + len(prefill)]):
            self.groups.append(self._group([c], [off], classes, dev))
        if fresh:
            lo = offsets[len(decode) + len(prefill)]
            cu = np.cumsum([0, *(c.num_tokens for c in fresh)], dtype=np.int32)
            self.groups.append(_Group(lo, lo + int(cu[-1]), len(fresh), {}, [None] * len(fresh), {},
                                      varlen=(torch.from_numpy(cu).to(dev),
                                              max(c.num_tokens for c in fresh))))
        self._build_writes(offsets, dev)

    # ---- index building (host, once per step) -------------------------------------------------
    def _resident(self, chunks, store: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Storage slots and positions [B, L] of each chunk's keys read from storage (padding:
        slot 0, position -1). Paged layers store the step's new tokens first, so their keys are
        one gather of positions [0, end); ring layers read what the row held before the step (the
        new tokens are appended)."""
        pool = self.pool
        if store != PAGED:
            ring = pool.rings[store]
            rows = torch.tensor([c.row for c in chunks], dtype=torch.long)
            return ring.base(rows)[:, None] + torch.arange(ring.slots), ring.pos[rows]
        ends = np.array([c.start + c.num_tokens for c in chunks], dtype=np.int64)
        at = np.arange(int(ends.max()), dtype=np.int64)
        slots = np.zeros((len(chunks), at.size), dtype=np.int64)
        for b, c in enumerate(chunks):
            slots[b, : ends[b]] = pool.paged_slots(c.row, 0, int(ends[b]))
        pos = np.where(at[None, :] < ends[:, None], at[None, :], -1)
        return torch.from_numpy(slots), torch.from_numpy(pos)

    def _group(self, chunks, offsets, classes, dev) -> _Group:
        pool = self.pool
        tmax = max(c.num_tokens for c in chunks)
        q_pos = torch.tensor([c.start for c in chunks], dtype=torch.long)[:, None] + torch.arange(tmax)
        gather, key_pos = {}, {}
        staged_rows: list[int | None] = []
        for c in chunks:
            staged_rows.append(c.row if pool.staged_span(c.row) is not None else None)
        for store in {s for s, _ in classes}:
            slots, pos = self._resident(chunks, store)
            extra = []
            if store != PAGED and len(chunks) == 1 and staged_rows[0] is not None:
                c = chunks[0]
                extra.append(torch.arange(c.forward_start, c.start).unsqueeze(0))
            if store != PAGED:
                extra.append(q_pos)
            gather[store] = slots.to(dev)
            key_pos[store] = torch.cat([pos, *extra], dim=1)  # [B, L]
        # A mask is built where SDPA reads it: a multi-token chunk's [T, L] mask on the device
        # from its T + L positions; one-token rows' [B, 1, L] masks (smaller than their inputs)
        # on the host. The CPU's query blocks (below) slice the chunk's mask on the host.
        mdev = dev if tmax > 1 else torch.device("cpu")
        fstart = torch.tensor([c.forward_start for c in chunks], dtype=torch.long)[:, None, None].to(mdev)
        masks, blocks = {}, {}
        # one-token rows that attend the ring layers with the CPU kernel (no staged tokens)
        ring_keys = {} if self.paged_decode is not None and tmax == 1 and all(r is None for r in staged_rows) else None
        for store, attn_window in classes:
            k = key_pos[store].to(mdev)[:, None, :]  # [B, 1, L]
            q = q_pos.to(mdev)[:, :, None]  # [B, T, 1]
            m = (k >= 0) & (k <= q)
            if attn_window is not None:
                m &= (q - k) < attn_window
            if store != PAGED:
                ring = pool.rings[store]
                m &= (k >= fstart) | (k < ring.sink) | (k >= fstart - ring.window)
                if ring_keys is not None:  # the ring's slots come first in the keys, the new token last
                    ring_keys[(store, attn_window)] = self._ring_keys(gather[store], m[:, 0, : ring.slots])
            # [B, 1, T, L]. On the CPU, None when every key is visible (SDPA's unmasked path is
            # faster there); on CUDA the unmasked path measured 16x slower for these shapes.
            if len(chunks) == 1 and tmax > QUERY_BLOCK and dev.type == "cpu":  # by blocks: no whole-chunk mask
                blocks[(store, attn_window)] = self._query_blocks(chunks[0], store, attn_window, m[0], dev)
                continue
            unmasked = dev.type == "cpu" and bool(m.all())
            masks[(store, attn_window)] = None if unmasked else m[:, None].to(dev)
        bounds = None
        if self.paged_decode is not None and tmax == 1 and PAGED in gather:
            end = q_pos[:, 0] + 1
            bounds = {w: ((end - w).clamp(min=0).to(torch.int32) if w is not None else torch.zeros_like(end, dtype=torch.int32),
                          end.to(torch.int32)) for s, w in classes if s == PAGED}
        lo = offsets[0]
        return _Group(lo, lo + len(chunks) * tmax, len(chunks), gather, staged_rows, masks, blocks or None, bounds,
                      ring_keys)

    @staticmethod
    def _ring_keys(slots: torch.Tensor, seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One-token rows on a ring layer, for the kernel: the ring's slots [B, S] each query sees
        (`seen` [B, S], the mask built for SDPA) first in each row, in slot order; then its new
        token. Returns (slots [B, S], lo, hi [B] int32)."""
        seen = seen.numpy()
        first = np.take_along_axis(slots.numpy(), np.argsort(~seen, axis=1, kind="stable"), axis=1)
        hi = seen.sum(axis=1).astype(np.int32) + 1
        return torch.from_numpy(first), torch.zeros(len(hi), dtype=torch.int32), torch.from_numpy(hi)

    def _query_blocks(self, c: ForwardChunk, store: int, attn_window: int | None, m: torch.Tensor, dev) -> list:
        """Query blocks of one long chunk. Keys on a paged layer are positions 0..end-1 in order;
        on a ring layer, the ring's slots then a contiguous run of positions (staging + new)."""
        out = []
        paged = store == PAGED
        head = 0 if paged else self.pool.rings[store].slots  # keys before the contiguous run
        run_start = c.start + c.num_tokens - (m.shape[-1] - head)  # position of the run's first key
        for t0 in range(0, c.num_tokens, QUERY_BLOCK):
            t1 = min(t0 + QUERY_BLOCK, c.num_tokens)
            lo_pos = run_start if attn_window is None else max(run_start, c.start + t0 - attn_window + 1)
            hi_pos = c.start + t1  # exclusive
            lo, hi = head + lo_pos - run_start, head + hi_pos - run_start
            if paged:
                keys = slice(lo, hi)
                mb = m[t0:t1, lo:hi]
            else:
                idx = torch.cat([torch.arange(head), torch.arange(lo, hi)])
                keys = idx.to(dev)
                mb = m[t0:t1].index_select(-1, idx)
            unmasked = dev.type == "cpu" and bool(mb.all())
            out.append((t0, t1, keys, None if unmasked else mb[None, None].to(dev)))
        return out

    def _build_writes(self, offsets, dev) -> None:
        pool = self.pool
        pw_slots, pw_src = [], []
        rw_slots: list[list[int]] = [[] for _ in pool.rings]  # per ring
        rw_src: list[list[int]] = [[] for _ in pool.rings]
        self.stage_src: list[tuple[int, int, int]] = []  # (row, packed start, n) to append
        # per ring: (row, ring slots, staging indices): staged tokens that survive into the ring
        self.unstage: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = [[] for _ in pool.rings]
        for c, off in zip(self.order, offsets):
            end = c.start + c.num_tokens
            if pool.paged_layers:
                pw_slots.append(pool.paged_slots(c.row, c.start, end))
                pw_src.append(np.arange(off, off + c.num_tokens, dtype=np.int64))
            if not pool.ring_layers:
                continue
            if pool.staged and not c.forward_done:
                pool.open_staging(c.row, c.forward_start)
                self.stage_src.append((c.row, off, c.num_tokens))
                continue
            span = pool.staged_span(c.row)
            as_dev = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
            for r, ring in enumerate(pool.rings):
                base = ring.base(c.row)
                for p in _survivors(ring, c.start, end):
                    rw_slots[r].append(base + ring.slot(p))
                    rw_src[r].append(off + p - c.start)
                if span is not None:
                    kept = _survivors(ring, span[0], min(end, span[0] + span[1]), end)
                    self.unstage[r].append((c.row, as_dev([base + ring.slot(p) for p in kept]),
                                            as_dev([p - span[0] for p in kept])))
        as_t = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
        cat = lambda xs: torch.from_numpy(np.concatenate(xs) if xs else np.zeros(0, np.int64)).to(dev)  # noqa: E731
        self.paged_write = (cat(pw_slots), cat(pw_src))
        self.ring_write = [(as_t(s), as_t(src)) for s, src in zip(rw_slots, rw_src)]  # per ring

    # ---- per layer ----------------------------------------------------------------------------
    def attend(
        self,
        layer: int,
        query: torch.Tensor,  # [1, H, T_total, D]
        key: torch.Tensor,  # [1, Hkv, T_total, D]  (this step's new tokens, RoPE applied)
        value: torch.Tensor,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention output [1, T_total, H, D] for `layer`; then stores the new K/V."""
        pool = self.pool
        lay = pool.layouts[layer]
        store = self.store[layer]
        k_new = key[0].transpose(0, 1)  # [T_total, Hkv, D]
        v_new = value[0].transpose(0, 1)
        q_all = query[0]  # [H, T_total, D]
        if lay.paged:
            self._store_paged(layer, k_new, v_new)
        outs = []
        for g in self.groups:
            if g.varlen is not None:
                outs.append(_fresh_attention(q_all[:, g.lo : g.hi].transpose(0, 1), k_new[g.lo : g.hi],
                                             v_new[g.lo : g.hi], g.varlen, lay.attn_window, scaling, softcap))
                continue
            slots = g.gather[store]
            keys = g.paged_bounds if lay.paged else g.ring_keys
            if keys is not None and self.paged_decode.supports(q_all, pool.k[layer], softcap):
                q = q_all[:, g.lo : g.hi].transpose(0, 1)  # [B, H, D]
                if lay.paged:
                    lo, hi = keys[lay.attn_window]
                    outs.append(self.paged_decode(q, pool.k[layer], pool.v[layer], slots, lo, hi, scaling))
                else:  # the ring's slots, then the new token (stored after the attention)
                    ring_slots, lo, hi = keys[(store, lay.attn_window)]
                    outs.append(self.paged_decode(q, pool.k[layer], pool.v[layer], ring_slots, lo, hi, scaling,
                                                  k_new[g.lo : g.hi], v_new[g.lo : g.hi]))
                continue
            k, v = pool.gather(layer, slots)  # [B, L_res, Hkv, D]
            if lay.paged:
                k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, L, D]
            else:
                keys, vals = [k], [v]
                row = g.staged_rows[0]
                if row is not None:
                    sk, sv = pool.staged_kv(row, layer)
                    keys.append(sk.unsqueeze(0))
                    vals.append(sv.unsqueeze(0))
                # a group's tokens are contiguous in the packed sequence: views, no gathers
                keys.append(k_new[g.lo : g.hi].unflatten(0, (g.batch, -1)))  # [B, T, Hkv, D]
                vals.append(v_new[g.lo : g.hi].unflatten(0, (g.batch, -1)))
                k = torch.cat(keys, dim=1).transpose(1, 2)  # [B, Hkv, L, D]
                v = torch.cat(vals, dim=1).transpose(1, 2)
            q = q_all[:, g.lo : g.hi].unflatten(1, (g.batch, -1)).transpose(0, 1)  # [B, H, T, D]
            blocks = g.blocks.get((store, lay.attn_window)) if g.blocks else None
            if blocks:
                o = torch.cat([_sdpa(q[:, :, t0:t1], _keys(k, keys), _keys(v, keys), mb, scaling, softcap)
                               for t0, t1, keys, mb in blocks], dim=2)
            else:
                o = _sdpa(q, k, v, g.masks[(store, lay.attn_window)], scaling, softcap)  # [B, H, T, D]
            outs.append(o.transpose(1, 2).reshape(-1, o.shape[1], o.shape[3]))
        out = torch.cat(outs) if len(outs) > 1 else outs[0]  # [T_total, H, D]
        if not lay.paged:
            self._store_ring(layer, store, k_new, v_new)
        return out.unsqueeze(0)

    def _store_paged(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        slots, src = self.paged_write
        self.pool.write(layer, slots, k_new.index_select(0, src), v_new.index_select(0, src))

    def _store_ring(self, layer: int, ring: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """After the layer's attention: survivors into ring slots, or staging for later chunks."""
        pool = self.pool
        for row, slots, idx in self.unstage[ring]:
            sk, sv = pool.staged_kv(row, layer)
            pool.write(layer, slots, sk.index_select(0, idx), sv.index_select(0, idx))
        slots, src = self.ring_write[ring]
        pool.write(layer, slots, k_new.index_select(0, src), v_new.index_select(0, src))
        for row, off, n in self.stage_src:
            pool.stage(row, layer, k_new[off : off + n], v_new[off : off + n])

    def commit(self) -> None:
        """After the forward: the pool records every chunk's new length and ring positions."""
        for c in self.chunks:
            self.pool.commit(c.row, c.start + c.num_tokens, c.forward_start, c.forward_done)


def _varlen_ok(pool: RowPool) -> bool:
    """Whether chunks that start their rows attend through `_fresh_attention`'s flash kernel here:
    CUDA, half precision, head sizes the kernel takes."""
    if pool.device.type != "cuda" or pool.dtype not in (torch.bfloat16, torch.float16):
        return False
    major, _ = torch.cuda.get_device_capability(pool.device)  # torch keeps the device's properties
    return (major >= 8 and torch.backends.cuda.is_flash_attention_available()
            and all(k.shape[-1] % 8 == 0 and k.shape[-1] <= 256 for k in pool.k))


def _fresh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: tuple[torch.Tensor, int],
                     attn_window: int | None, scaling: float, softcap: float | None) -> torch.Tensor:
    """Chunks that start their rows, packed: q [T, H, D], k and v [T, Hkv, D] (their own tokens);
    `varlen`: (cumulative token counts [B + 1] int32, longest chunk). Each token sees the tokens of
    its own chunk at or before it, within `attn_window` (q - k < attn_window). Returns [T, H, D]."""
    cu, longest = varlen
    if softcap is None:
        window = -1 if attn_window is None else attn_window - 1
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scaling,
            window_size_left=window, window_size_right=0)[0]
    # the flash kernel here takes no softcap: one masked attention per chunk
    outs, bounds = [], cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        pos = torch.arange(b - a, device=q.device)
        m = pos[None, :] <= pos[:, None]
        if attn_window is not None:
            m &= (pos[:, None] - pos[None, :]) < attn_window
        o = _sdpa(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None],
                  m[None, None], scaling, softcap)  # [1, H, T, D]
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def _survivors(ring, lo: int, hi: int, end: int | None = None) -> list[int]:
    """Positions in [lo, hi) that the ring keeps after a forward ending at `end` (default hi)."""
    end = hi if end is None else end
    return [*range(lo, min(hi, ring.sink)), *range(max(lo, ring.sink, end - ring.window), hi)]


def _keys(k: torch.Tensor, keys) -> torch.Tensor:
    """k [B, Hkv, L, D] restricted to a query block's keys (a slice, or an index tensor)."""
    return k[:, :, keys] if isinstance(keys, slice) else k.index_select(2, keys)


def _sdpa(q, k, v, mask, scaling, softcap):
    groups = q.shape[1] // k.shape[1]
    if softcap is None and mask is not None and q.is_cuda and groups > 1:
        # torch's memory-efficient kernel takes a mask but not grouped K/V heads, flash takes no
        # mask, so a masked grouped SDPA on CUDA falls to the math path: float32 score matrices,
        # 10x the time of a prefill step of Gemma-3 1B (bench.profile_decode --prefill). K/V
        # expanded to the query heads (a copy of the keys in view) take the efficient kernel.
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)
