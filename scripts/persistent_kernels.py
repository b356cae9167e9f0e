"""The Triton kernel of scripts/bench_persistent.py: a whole batch-1 decode step as one persistent
launch, its phases meeting through tagged 8-byte words (the plan's descriptors:
scripts/persistent_plan.py)."""
import triton
import triton.language as tl

from kernels.decode_attention import _attend_rows


@triton.jit
def _desc(dp, i):
    """The i-th descriptor of a program's list (persistent_plan.NF int32 fields)."""
    d = dp + i * 8
    # the weight offset and row stride are multiples of 8 (plan): said where they are loaded, so
    # the tile loads are 16 bytes wide (said of a helper's argument, the hint was lost, and the
    # compiler issued 2-byte loads)
    return (tl.load(d), tl.multiple_of(tl.load(d + 1), 8), tl.multiple_of(tl.load(d + 2), 8), tl.load(d + 3),
            tl.load(d + 4), tl.load(d + 5), tl.load(d + 6), tl.load(d + 7))


@triton.jit
def _weight_tile(w_ptr, w_off, ldw, nk, TN: tl.constexpr, TK: tl.constexpr):
    """(TN, TK) fp16 weights, out-major rows; zeros (and no bytes) outside the tile's
    n_valid x k_valid (nk: both packed)."""
    rows = tl.arange(0, TN)
    cols = tl.arange(0, TK)
    # the tile's width is a multiple of 8 (plan), as are w_off and ldw (_desc says so)
    mask = (rows < (nk >> 16))[:, None] & (cols < tl.multiple_of(nk & 0xFFFF, 8))[None, :]
    ptrs = w_ptr + w_off.to(tl.int64) + rows[:, None].to(tl.int64) * ldw + cols[None, :]
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _poll(ptr, offs, mask, tag, SYNC: tl.constexpr):
    """The fp32 values of the tagged words at ptr + offs (zeros where not mask), read again
    until every one carries `tag` (tag < 0: as they are)."""
    word = tl.load(ptr + offs, mask=mask, other=0, volatile=True)
    if SYNC and tag >= 0:
        # only the word is carried around the loop (a carried mask broke Triton 3.6's layout pass)
        while tl.max(tl.where(mask, (word >> 32).to(tl.int32) != tag, False).to(tl.int32), axis=0) != 0:
            word = tl.load(ptr + offs, mask=mask, other=0, volatile=True)
        # threads that hold copies of one element load it each on their own, and the reduction saw
        # one copy: a copy still stale (NaN at the second call) loads again, now that its element
        # was seen written (the reduction's barrier orders the two). Fresh copies load nothing.
        stale = mask & ((word >> 32).to(tl.int32) != tag)
        word = tl.load(ptr + offs, mask=stale, other=word, volatile=True)
    return (word & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _tagged(y, tag):
    """fp32 values as 8-byte words with `tag` in the high half (stored by a relaxed exchange: one
    8-byte access, whatever the compiler would make of a store)."""
    return (y.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF) | (tag.to(tl.int64) << 32)


@triton.jit
def _tile_work(w, acc, w_ptr, c_ptr, act_ptr, kind, w_off, ldw, in_off, out_off, res_off, nk, meta, base, qk_scale,
               TN: tl.constexpr, TK: tl.constexpr, BLOCK_P: tl.constexpr, ATT_P: tl.constexpr,
               HEAD_D: tl.constexpr, LOAD_LATE: tl.constexpr, SYNC: tl.constexpr, PARTS: tl.constexpr):
    """One descriptor's work once its weight tile w is asked for (LOAD_LATE: only once the input
    is in); returns the columns' running sums. PARTS < 2 times part of it (wrong values): 1 no
    input read (x = 1), 0 no input read and no store either."""
    rows = tl.arange(0, TN)
    cols = tl.arange(0, TK)
    offs_d = tl.arange(0, HEAD_D)
    phase = (meta >> 4) & 0xFFF
    in_tag = tl.where(phase > 0, base + phase - 1, -1)  # the input: the phase before
    if kind == 1:  # this tile's share of its columns' dot products
        if PARTS == 2:
            x = _poll(act_ptr + in_off, cols, cols < (nk & 0xFFFF), in_tag, SYNC)
        else:
            x = tl.full((TK,), 1.0, tl.float32)
        if LOAD_LATE:  # the kernel-per-op order: weights once the input is in
            w = _weight_tile(w_ptr, w_off, ldw, nk, TN, TK)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if PARTS > 0 and (meta & 1) != 0:  # LAST_K: the columns are done
            n_mask = rows < (nk >> 16)
            y = acc
            if (meta & 2) != 0:  # RESID
                res_phase = (meta >> 16) - 1
                y += _poll(act_ptr + res_off, rows, n_mask, tl.where(res_phase >= 0, base + res_phase, -1), SYNC)
            tl.atomic_xchg(act_ptr + out_off + rows, _tagged(y, base + phase), mask=n_mask, sem="relaxed")
            acc = tl.zeros((TN,), dtype=tl.float32)
    if kind == 2:  # one head's attention of the new query over the cache
        q = _poll(act_ptr + in_off, offs_d, offs_d < HEAD_D, in_tag, SYNC) * qk_scale  # log2 domain
        m_i = float("-inf")
        l_i = 0.0
        o = tl.zeros((HEAD_D,), dtype=tl.float32)
        # online softmax over ATT_P positions at a time: a whole cache tile in fp32 would take
        # the registers the weight tiles need
        for p0 in tl.static_range(0, BLOCK_P, ATT_P):
            offs = p0 + tl.arange(0, ATT_P)
            kv = c_ptr + w_off.to(tl.int64) + offs[:, None] * HEAD_D + offs_d[None, :]
            kv_mask = (offs < ldw)[:, None] & (offs_d < HEAD_D)[None, :]
            k = tl.load(kv, mask=kv_mask, other=0.0)
            v = tl.load(kv + ldw * HEAD_D, mask=kv_mask, other=0.0)  # zero past the cache, as _attend_rows asks
            m_i, l_i, o, _ = _attend_rows(q, k, v, offs < ldw, m_i, l_i, o, 0.0)  # m_i finite from block 0 on
        tl.atomic_xchg(act_ptr + out_off + offs_d, _tagged(o / l_i, base + phase), sem="relaxed")
    return acc


@triton.jit
def persistent_step_kernel(desc_ptr, n_desc_ptr, w_ptr, c_ptr, act_ptr, epoch_ptr, max_desc, n_phases, qk_scale,
                            TN: tl.constexpr, TK: tl.constexpr, BLOCK_P: tl.constexpr, ATT_P: tl.constexpr,
                            HEAD_D: tl.constexpr, PREFETCH: tl.constexpr, SYNC: tl.constexpr,
                            STREAM_ONLY: tl.constexpr, PARTS: tl.constexpr):
    """Tiles held in registers, the next one asked for during this one (PREFETCH), or each one
    once its input is in. (Reading the next tile's input ahead as well moved nothing: call 6.)
    STREAM_ONLY: each tile only added into a register sum, with no input, reduction or store:
    what the loop's loads alone cost (the values are not the step's)."""
    pid = tl.program_id(0)
    # phase p of launch e tags its values e * phases + p + 1. Program 0 advances the epoch last;
    # by then every program has read it (the lm_head's input holds values from all of them)
    epoch = tl.load(epoch_ptr)
    base = epoch * n_phases + 1
    dp = desc_ptr + pid.to(tl.int64) * max_desc * 8
    n = tl.load(n_desc_ptr + pid)
    # descriptors two ahead (a line of them comes from DRAM): the current one, the next one
    # (whose tile is asked for during this one) and the one after
    kind, w_off, ldw, in_off, out_off, res_off, nk, meta = _desc(dp, 0)
    nkind, nw_off, nldw, nin, nout, nres, nnk, nmeta = _desc(dp, 1)
    w = _weight_tile(w_ptr, w_off, ldw, nk * PREFETCH, TN, TK)
    acc = tl.zeros((TN,), dtype=tl.float32)
    sink = tl.zeros((TN, TK), dtype=w_ptr.dtype.element_ty)
    for t in range(n):  # the list ends in two idle descriptors: t + 2 is always there
        akind, aw_off, aldw, ain, aout, ares, ank, ameta = _desc(dp, t + 2)
        if PREFETCH:  # one tile ahead, whatever its phase: nothing here waits for it
            w_next = _weight_tile(w_ptr, nw_off, nldw, nnk, TN, TK)
        if STREAM_ONLY:
            sink += w
        else:
            acc = _tile_work(w, acc, w_ptr, c_ptr, act_ptr, kind, w_off, ldw, in_off, out_off, res_off, nk, meta,
                             base, qk_scale, TN, TK, BLOCK_P, ATT_P, HEAD_D, not PREFETCH, SYNC, PARTS)
        kind, w_off, ldw, in_off, out_off, res_off, nk, meta = nkind, nw_off, nldw, nin, nout, nres, nnk, nmeta
        nkind, nw_off, nldw, nin, nout, nres, nnk, nmeta = akind, aw_off, aldw, ain, aout, ares, ank, ameta
        if PREFETCH:
            w = w_next
    if STREAM_ONLY or PARTS == 0:  # one value a program keeps the loads (and sums) alive
        total = tl.sum(tl.sum(sink.to(tl.float32), axis=1), axis=0) + tl.sum(acc, axis=0)
        tl.store(act_ptr + pid, total.to(tl.int32, bitcast=True))
    if pid == 0:
        tl.store(epoch_ptr, epoch + 1)
