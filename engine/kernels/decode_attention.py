"""Decode attention over ragged rows: one query token per row against that row's resident K/V.

Two key layouts, both read in place from the RowPool (no gather, no padding to the longest row):

  paged  keys 0..pos of the row, at `block_table[row, j // page] * page + j % page`; the new
         token was stored before the call. Visible: pos - j < attn_window.
  ring   the row's `sink + window` ring slots at `row * ring_slots + j`, plus the new token, which
         is passed in (it is stored after the call: its slot may still hold a visible key). A
         slot's position is a function of the row's length alone (see `ring_positions`).

The CUDA version is a split-K ("flash decoding") Triton kernel: program (row, kv head, split)
walks its share of the row's keys for all query heads of the group and writes a partial
(max, sum, unnormalised output); a second kernel merges the splits (and the ring's new token).
With one split per (row, kv head) the first kernel finishes alone: one launch per layer.
`reference` computes the same function with torch ops; it is the oracle of the kernel's test and
the path where Triton is missing.
"""

from __future__ import annotations

import torch

from engine.kernels.launch import kernel_args


def ring_positions(pos: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """Position held by each ring slot of rows whose next token is at `pos` [B] (-1: empty).
    After any completed forward that ended at `pos`, a ring(sink, window) holds positions < sink
    and the last `window` positions before `pos`; slot of p >= sink is sink + (p - sink) % window."""
    j = torch.arange(sink + window, device=pos.device)
    p = pos[:, None]
    sinks = torch.where(j[None, :] < p, j[None, :], -1)
    m = p - 1 - sink  # offset of the last position (may be < 0)
    r = j[None, :] - sink
    off = m - torch.remainder(m - r, max(window, 1))
    ring = torch.where(off >= 0, sink + off, -1)
    return torch.where(j[None, :] < sink, sinks, ring)[:, : sink + window]


def reference(q, k_store, v_store, rows, pos, *, scale, softcap=None, attn_window=None,
              block_table=None, page=0, ring=None, k_new=None, v_new=None, store_slot=None,
              evicted=None) -> torch.Tensor:
    """q [B, H, D]; stores [slots, Hkv, D]; rows, pos [B]. Paged when `block_table` is given, else
    `ring` = (sink, window) with k_new / v_new [B, Hkv, D]. Returns [B, H, D] in q's dtype.
    `store_slot` [B]: k_new / v_new are also written there (paged: the new token's own slot,
    before attending; ring: the slot it takes, after attending). `evicted` (ring only): a pair of
    [>= B, Hkv, D] tensors that receive what the ring slots held before the store, so the store
    can be undone."""
    if store_slot is not None and block_table is not None:
        k_store.index_copy_(0, store_slot, k_new)
        v_store.index_copy_(0, store_slot, v_new)
    out = _reference(q, k_store, v_store, rows, pos, scale=scale, softcap=softcap, attn_window=attn_window,
                     block_table=block_table, page=page, ring=ring, k_new=k_new, v_new=v_new)
    if store_slot is not None and block_table is None:
        if evicted is not None:
            evicted[0][: len(store_slot)] = k_store[store_slot]
            evicted[1][: len(store_slot)] = v_store[store_slot]
        k_store.index_copy_(0, store_slot, k_new)
        v_store.index_copy_(0, store_slot, v_new)
    return out


def _reference(q, k_store, v_store, rows, pos, *, scale, softcap, attn_window, block_table, page, ring,
               k_new, v_new) -> torch.Tensor:
    B, H, D = q.shape
    hkv = k_store.shape[1]
    if block_table is not None:
        L = int(pos.max()) + 1
        j = torch.arange(L, device=q.device)
        slots = block_table[rows][:, j // page].long() * page + j % page  # [B, L]
        kpos = j[None, :].expand(B, L)
        valid = kpos <= pos[:, None]
        keys, vals = k_store[slots], v_store[slots]  # [B, L, Hkv, D]
    else:
        sink, window = ring
        r = sink + window
        slots = rows[:, None] * r + torch.arange(r, device=q.device)
        kpos = torch.cat([ring_positions(pos, sink, window), pos[:, None]], dim=1)
        valid = kpos >= 0
        keys = torch.cat([k_store[slots], k_new[:, None]], dim=1)
        vals = torch.cat([v_store[slots], v_new[:, None]], dim=1)
    if attn_window is not None:
        valid &= (pos[:, None] - kpos) < attn_window
    g = H // hkv
    keys = keys.float().repeat_interleave(g, dim=2)  # [B, L, H, D]
    vals = vals.float().repeat_interleave(g, dim=2)
    s = torch.einsum("bhd,blhd->bhl", q.float(), keys) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhl,blhd->bhd", torch.softmax(s, dim=-1), vals).to(q.dtype)


try:  # Triton ships with CUDA builds of torch; the CPU path never needs it
    import triton
    import triton.language as tl

    from engine.kernels.launch import pdl_enter
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None

def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _ring_wrap(p, sink, ring_window):
        """(p - 1 - sink) mod the window, in [0, window): with it `_key_block` finds each ring
        slot's position without a division per key. (Triton's remainder takes the dividend's sign.)"""
        w = tl.maximum(ring_window, 1)
        r = (p - 1 - sink) % w
        return tl.where(r < 0, r + w, r)

    @triton.jit
    def _key_block(K, V, offs, end, row, p, kh, d, BlockTable, stride_bt, stride_ks, stride_kh, attn_window, sink,
                   ring_window, wrap, PAGE: tl.constexpr, RING_SLOTS: tl.constexpr, PAGED: tl.constexpr):
        """The keys and values [BLOCK, D] of K/V head kh at key indices `offs` (< end) of `row`,
        whose next token is at `p`, and which of them the query sees (the others read as 0).
        `wrap`: `_ring_wrap` of the row (rings only)."""
        valid = offs < end
        if PAGED:
            blk = tl.load(BlockTable + row * stride_bt + offs // PAGE, mask=valid, other=0)
            slot = blk.to(tl.int64) * PAGE + offs % PAGE
            kpos = offs
        else:
            slot = row * RING_SLOTS + offs
            # slot sink + r (0 <= r < w) holds sink + off, off = m - ((m - r) mod w), m = p - 1 - sink;
            # (m - r) mod w = wrap - r, plus w where that is negative (slots outside the window's
            # range are masked or take the sink branch)
            t = wrap - (offs - sink)
            off = (p - 1 - sink) - tl.where(t < 0, t + tl.maximum(ring_window, 1), t)
            kpos = tl.where(offs < sink, tl.where(offs < p, offs, -1), tl.where(off >= 0, sink + off, -1))
            valid = valid & (kpos >= 0)
        valid = valid & ((p - kpos) < attn_window)
        at = slot[:, None] * stride_ks + kh * stride_kh + d[None, :]
        return tl.load(K + at, mask=valid[:, None], other=0.0), tl.load(V + at, mask=valid[:, None], other=0.0), valid

    @triton.jit
    def _attend_block(q, k, v, valid, m_i, l_i, acc, scale, softcap, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
        """One block of keys k, values v [BLOCK, D] into the group's running max, sum and
        unnormalised output."""
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = qk * scale
        if SOFTCAP:
            qk = softcap * (1.0 - 2.0 / (tl.exp(2.0 * qk / softcap) + 1.0))
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        pr = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _partial_kernel(
        Q, K, V, Opart, Mpart, Lpart, BlockTable, Rows, Pos,
        Out, Knew, Vnew, Slots, Ek, Ev,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_bt,
        stride_ob, stride_oh, stride_kb, stride_knh, stride_vb, stride_vnh, stride_eb, stride_eh,
        scale, softcap, attn_window, sink, ring_window,
        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, S: tl.constexpr, PAGE: tl.constexpr,
        RING_SLOTS: tl.constexpr, PAGED: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
        BLOCK: tl.constexpr, NEW_APART: tl.constexpr, EXTRA: tl.constexpr, STORE: tl.constexpr,
        EVICT: tl.constexpr, GDC: tl.constexpr = False,
    ):
        """One split of (row, kv head)'s keys -> a partial (max, sum, output) per query head of
        the group. With one split (S == 1) the program finishes the job the merge kernel would:
        the new token, the normalisation, the output and the store (it alone read this row's
        keys of this head).

        With STORE (the kernel writes the new token itself, so the caller wrote nothing in the
        store just before) and PDL, the row's indices and block table, its first block of keys
        and values and, with one split, the slot it stores to and (EVICT) what that slot holds
        are read before the wait on the kernel before it: none of them is written by that kernel
        (it made q, k_new and v_new, read after the wait), so the reads overlap its end. Launched
        plainly with one split, it reads the slot and what it holds first too, so that the store
        at its end waits on no read."""
        if not STORE:  # the caller may have just written the store: wait first
            pdl_enter(GDC)
        b = tl.program_id(0)
        kh = tl.program_id(1)
        s = tl.program_id(2)
        d = tl.arange(0, D)
        row = tl.load(Rows + b)
        p = tl.load(Pos + b)
        if PAGED:
            lo = tl.maximum(p + 1 - attn_window, 0)
            if NEW_APART:  # the new token is not in the store yet: the combine adds it
                hi = p
            else:
                hi = p + 1
            wrap = p * 0
        else:
            hi = p * 0 + RING_SLOTS
            lo = p * 0
            wrap = _ring_wrap(p, sink, ring_window)
        per = tl.cdiv(tl.cdiv(hi - lo, S), BLOCK) * BLOCK
        start = lo + s * per
        end = tl.minimum(start + per, hi)
        if S == 1:
            if STORE:  # the slot this program writes, and (EVICT) what it holds: only this program writes it
                dest = tl.load(Slots + b)
                if EVICT:
                    held_k = tl.load(K + dest * stride_ks + kh * stride_kh + d)
                    held_v = tl.load(V + dest * stride_ks + kh * stride_kh + d)
        g = tl.arange(0, GP)
        head = kh * G + g
        m_i = tl.full([GP], -1.0e30, tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        first = start
        if STORE and GDC:  # the first block before the wait, then the rest of the loop
            k, v, valid = _key_block(K, V, start + tl.arange(0, BLOCK), end, row, p, kh, d, BlockTable, stride_bt,
                                     stride_ks, stride_kh, attn_window, sink, ring_window, wrap, PAGE, RING_SLOTS,
                                     PAGED)
            pdl_enter(GDC)
        q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None], other=0.0)
        if S == 1 and EXTRA:  # the new token, not (yet) in the store: read with q, not after the keys
            k_in = tl.load(Knew + b * stride_kb + kh * stride_knh + d)
            v_in = tl.load(Vnew + b * stride_vb + kh * stride_vnh + d)
        if STORE and GDC:
            m_i, l_i, acc = _attend_block(q, k, v, valid, m_i, l_i, acc, scale, softcap, SOFTCAP, IEEE)
            first = start + BLOCK
        for j0 in range(first, end, BLOCK):
            k, v, valid = _key_block(K, V, j0 + tl.arange(0, BLOCK), end, row, p, kh, d, BlockTable, stride_bt,
                                     stride_ks, stride_kh, attn_window, sink, ring_window, wrap, PAGE, RING_SLOTS,
                                     PAGED)
            m_i, l_i, acc = _attend_block(q, k, v, valid, m_i, l_i, acc, scale, softcap, SOFTCAP, IEEE)
        gm = g < G
        if S == 1:
            if EXTRA:  # the new token
                kn = k_in.to(tl.float32)
                sn = tl.sum(q.to(tl.float32) * kn[None, :], 1) * scale  # [GP]
                if SOFTCAP:
                    sn = softcap * (1.0 - 2.0 / (tl.exp(2.0 * sn / softcap) + 1.0))
                m_new = tl.maximum(m_i, sn)
                alpha = tl.exp(m_i - m_new)
                en = tl.exp(sn - m_new)
                acc = acc * alpha[:, None] + en[:, None] * v_in.to(tl.float32)[None, :]
                l_i = l_i * alpha + en
            o = acc / l_i[:, None]
            tl.store(Out + b * stride_ob + head[:, None] * stride_oh + d[None, :], o.to(Out.dtype.element_ty),
                     mask=gm[:, None])
            if STORE:  # (STORE implies EXTRA) after every thread's last read of the store
                if EVICT:  # keep what the slot held, so the store can be undone
                    tl.store(Ek + b * stride_eb + kh * stride_eh + d, held_k)
                    tl.store(Ev + b * stride_eb + kh * stride_eh + d, held_v)
                tl.debug_barrier()
                tl.store(K + dest * stride_ks + kh * stride_kh + d, k_in)
                tl.store(V + dest * stride_ks + kh * stride_kh + d, v_in)
        else:
            H = tl.num_programs(1) * G
            base = (b * H + head) * S + s  # [GP]
            tl.store(Mpart + base, m_i, mask=gm)
            tl.store(Lpart + base, l_i, mask=gm)
            tl.store(Opart + base[:, None] * D + d[None, :], acc, mask=gm[:, None])

    @triton.jit
    def _combine_kernel(
        Out, Opart, Mpart, Lpart, Q, Knew, Vnew, Kstore, Vstore, Slots, Ek, Ev,
        stride_ob, stride_oh, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_ss, stride_sh, stride_eb, stride_eh, scale, softcap, H, G,
        D: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, EXTRA: tl.constexpr, SOFTCAP: tl.constexpr,
        STORE: tl.constexpr, EVICT: tl.constexpr, GDC: tl.constexpr = False,
    ):
        """Merges program (row b, query head h)'s splits and the new token. Launched with PDL it
        reads everything but the partials (q, the new token, the slot and what it holds) before
        its wait: the partial kernel writes only the partials, and this kernel may start only
        once every partial program has passed its own wait, so what the kernels before that one
        wrote is complete."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        sidx = tl.arange(0, SP)
        d = tl.arange(0, D)
        base = (b * H + h) * S
        sm = sidx < S
        if EXTRA:  # the new token, not (yet) in the store
            q = tl.load(Q + b * stride_qb + h * stride_qh + d).to(tl.float32)
            k_in = tl.load(Knew + b * stride_kb + (h // G) * stride_kh + d)
            v_in = tl.load(Vnew + b * stride_vb + (h // G) * stride_vh + d)
        if STORE:  # the first query head of each group writes its K/V head's new token
            writer = (d * 0 + h % G) == 0
            dest = tl.load(Slots + b)
            kv = h // G
            if EVICT:  # what the slot holds, kept so the store can be undone
                held_k = tl.load(Kstore + dest * stride_ss + kv * stride_sh + d, mask=writer)
                held_v = tl.load(Vstore + dest * stride_ss + kv * stride_sh + d, mask=writer)
        pdl_enter(GDC)
        m = tl.load(Mpart + base + sidx, mask=sm, other=-1.0e30)
        lsum = tl.load(Lpart + base + sidx, mask=sm, other=0.0)
        o = tl.load(Opart + (base + sidx)[:, None] * D + d[None, :], mask=sm[:, None], other=0.0)
        m_all = tl.max(m, 0)
        if EXTRA:
            sn = tl.sum(q * k_in.to(tl.float32), 0) * scale
            if SOFTCAP:
                sn = softcap * (1.0 - 2.0 / (tl.exp(2.0 * sn / softcap) + 1.0))
            m_all = tl.maximum(m_all, sn)
        w = tl.exp(m - m_all)
        num = tl.sum(o * w[:, None], 0)
        den = tl.sum(lsum * w, 0)
        if EXTRA:
            en = tl.exp(sn - m_all)
            num += en * v_in.to(tl.float32)
            den += en
        tl.store(Out + b * stride_ob + h * stride_oh + d, (num / den).to(Out.dtype.element_ty))
        if STORE:  # every program of the partial kernel has read the store: write the new token
            if EVICT:
                tl.store(Ek + b * stride_eb + kv * stride_eh + d, held_k, mask=writer)
                tl.store(Ev + b * stride_eb + kv * stride_eh + d, held_v, mask=writer)
            tl.store(Kstore + dest * stride_ss + kv * stride_sh + d, k_in, mask=writer)
            tl.store(Vstore + dest * stride_ss + kv * stride_sh + d, v_in, mask=writer)


def launch_for(paged: bool, batch: int, kv_heads: int, head_dim: int = 256, itemsize: int = 2) -> dict:
    """The partial kernel's launch for `batch` rows of `kv_heads` K/V heads of `head_dim` values of
    `itemsize` bytes: splits (at most), keys per iteration, warps, stages. Measured on an H200 with
    `python -m bench.tune_kernels` (Gemma-3 1B and 4B shapes, rows of ~1,238 tokens, 1 to 256 rows;
    Gemma 4 26B-A4B's exact layers, two heads of 512, at 1 and 8 rows; docs/performance.md has the
    tables): within 6% of the best launch found per case, against up to 2x slower for one launch
    everywhere.
      ring   few programs: 16-key blocks, one split per block (a ring is only a few blocks);
             many: one 32-key program per (row, head), three stages
      paged  about 512 programs in all; 32-key blocks; two warps once there are many. Few
             programs (under 32) of 16-bit heads of 512 or more: half the programs and splits
             (each split's partial output is twice as wide) and eight warps, with 64-key blocks
             in one stage under 16 programs, else 32-key blocks in two (the best launches found
             at 1 and 8 rows of Gemma 4's exact layers); more programs, and float32 heads, keep
             the rule for heads of 256, not timed at 512"""
    programs = batch * kv_heads
    if not paged:
        if programs < 128:
            return dict(splits=64, block=16, warps=4, stages=2)
        return dict(splits=1, block=32, warps=4, stages=3)
    wide = head_dim >= 512 and itemsize == 2 and programs < 32
    splits = 1
    while programs * splits < (256 if wide else 512) and splits < (32 if wide else 64):
        splits *= 2
    if wide:
        return dict(splits=splits, block=64, warps=8, stages=1) if programs < 16 else \
            dict(splits=splits, block=32, warps=8, stages=2)
    if programs < 32:
        return dict(splits=splits, block=32, warps=4, stages=1)
    return dict(splits=splits, block=32, warps=2, stages=2)


def decode_attention(q, k_store, v_store, rows, pos, *, scale, softcap=None, attn_window=None,
                     block_table=None, page=0, ring=None, k_new=None, v_new=None, store_slot=None, evicted=None,
                     out=None, splits=None, block=None, warps=None, stages=None, pdl=False) -> torch.Tensor:
    """Same contract as `reference`; Triton kernels on CUDA (no host sync, graph-capturable).
    The launch settings default to `launch_for`'s.
    With `store_slot`, the merge kernel writes the new K/V once the partial kernel is done (with
    one split, the partial kernel writes it after its own reads and no merge runs), so a paged
    layer's new token is attended from k_new / v_new (as a ring layer's is) and no separate store
    runs. `splits` (at most; a ring takes no more than its blocks), `block` (keys per
    iteration), `warps` and `stages` set the partial kernel's launch. `evicted` (ring layers with
    `store_slot`): a pair of [>= B, Hkv, D] tensors; the store first copies there what each slot
    held (a step run ahead of the host's verdict undoes its store with them). `pdl`: both kernels
    launched with PDL (kernels/launch.py; the caller checked that the device supports it); with
    `store_slot` too, the kernel launched just before must not write the stores, `rows`, `pos`,
    `block_table` or `store_slot`, which the partial kernel reads before its wait."""
    if not available(q.device):
        return reference(q, k_store, v_store, rows, pos, scale=scale, softcap=softcap, attn_window=attn_window,
                         block_table=block_table, page=page, ring=ring, k_new=k_new, v_new=v_new,
                         store_slot=store_slot, evicted=evicted)
    B, H, D = q.shape
    hkv = k_store.shape[1]
    G = H // hkv
    paged = block_table is not None
    launch = launch_for(paged, B, hkv, D, k_store.element_size())
    splits, block = splits or launch["splits"], block or launch["block"]
    warps, stages = warps or launch["warps"], stages or launch["stages"]
    sink, window = (0, 0) if paged else ring
    ring_slots = sink + window
    S = splits if paged else max(1, min(splits, triton.cdiv(ring_slots, block)))
    assert k_store.stride(2) == 1 and q.stride(2) == 1 and k_store.stride() == v_store.stride()
    new_apart = paged and store_slot is not None
    extra = not paged or new_apart
    assert not extra or (k_new.stride(2) == 1 and v_new.stride(2) == 1)
    if out is None:
        out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    kn = k_new if extra else q
    vn = v_new if extra else q
    store = store_slot is not None
    slots = store_slot if store else rows
    evict = evicted is not None and store and not paged
    ek, ev = evicted if evict else (q, q)
    assert not evict or (ek.stride() == ev.stride() and ek.stride(2) == 1)
    parts = (B, H, S) if S > 1 else (1, 1, 1)  # one split: no partials, no merge
    opart = torch.empty((*parts, D), dtype=torch.float32, device=q.device)
    mpart = torch.empty(parts, dtype=torch.float32, device=q.device)
    lpart = torch.empty(parts, dtype=torch.float32, device=q.device)
    bt = block_table if paged else rows  # any int tensor; unused for rings
    _partial_kernel[(B, hkv, S)](
        q, k_store, v_store, opart, mpart, lpart, bt, rows, pos,
        out, kn, vn, slots, ek, ev,
        q.stride(0), q.stride(1), k_store.stride(0), k_store.stride(1), bt.stride(0) if paged else 0,
        out.stride(0), out.stride(1), kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        ek.stride(0), ek.stride(1), scale, softcap or 0.0, attn_window if attn_window is not None else 1 << 30, sink, window,
        G=G, GP=max(16, triton.next_power_of_2(G)), D=D, S=S, PAGE=max(page, 1), RING_SLOTS=max(ring_slots, 1),
        PAGED=paged, SOFTCAP=softcap is not None, IEEE=q.dtype == torch.float32, BLOCK=block,
        NEW_APART=new_apart, EXTRA=extra, STORE=store, EVICT=evict, num_warps=warps, num_stages=stages,
        **kernel_args(pdl),
    )
    if S == 1:
        return out
    _combine_kernel[(B, H)](
        out, opart, mpart, lpart, q, kn, vn, k_store, v_store, slots, ek, ev,
        out.stride(0), out.stride(1), q.stride(0), q.stride(1), kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        k_store.stride(0), k_store.stride(1), ek.stride(0), ek.stride(1), scale, softcap or 0.0, H, G,
        D=D, S=S, SP=max(2, triton.next_power_of_2(S)), EXTRA=extra, SOFTCAP=softcap is not None, STORE=store,
        EVICT=evict, num_warps=4, **kernel_args(pdl),
    )
    return out
