"""Split-K decode attention (flash-decoding): one query per sequence against its KV cache.

One query per (batch, head) is far too little work for one program when the batch is small,
so the cache length is cut into NUM_SPLITS chunks, one program each. Every program keeps an
online softmax over its chunk and writes (max, sum, unnormalized output); the last program of
a (batch, head) to arrive (an atomic counter) merges the partials in a fixed order. One
launch, deterministic, and the grid depends only on shapes, so it replays in a CUDA graph
while seq_lens changes on the device.

Optionally the new token's key and value are written into the cache by the same launch
(`k_new`, `v_new` land at position seq_lens[b] - 1) and used directly from registers. The
launch layouts (splits, tiles, prefetch, pipelining, the new row's form) are chosen in
decode_attention_config.py.
"""
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._checks import check_device_usable, check_tensor
from ._tuning import launch, tma_ready, use_pdl
from ._workspace import arrival_counters
from .decode_attention_config import launch_layout

LOG2E = 1.4426950408889634
@triton.jit
def _attend_rows(q, k, v, rows, m_i, l_i, acc, p_new):
    """Online-softmax update of (m_i, l_i, acc) with a tile of cache rows (log2 domain). Rows
    outside `rows` must hold zeros in v (masked loads, or a select): their scores become -inf
    and p . V needs no select. Where the step's new row is attended apart (new_row_apart), the
    state starts from its score (m_i finite from the start, l_i 1) and p_new follows its softmax
    weight, so v_new is added once at the end; elsewhere p_new goes unused."""
    s = tl.sum(q[None, :] * k.to(tl.float32), axis=1)
    s = tl.where(rows, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
    return m_new, l_i, acc, p_new * alpha


@triton.jit
def _v_early(v, rows):
    """A loop's V tile in fp32, rows outside `rows` zeroed: the masked load already gave zeros
    there, but the select makes V needed before the scores, so ptxas issues the tile's K and V
    loads together. Without it, it issued them two by two, each pair after the last one's use,
    one memory round trip each (gpt2 batch 64's attention launch alone, H200: 11.4 -> 15.8 us).
    decode_attention_proj's loop is left without it: gpt2-xl batch 1 lost 1.8% with it."""
    return tl.where(rows[:, None], v.to(tl.float32), 0.0)


@triton.jit
def _attend_tile(q, k, v, offs_n, rows, pos, k_new, v_new, m_i, l_i, acc, p_new, HAS_NEW: tl.constexpr,
                 NEW_APART: tl.constexpr, PREFETCHED: tl.constexpr):
    """One tile's update in either form (new_row_apart). Rows past `rows` may hold anything (a
    prefetched tile reads to the cache's end). Where NEW_APART they are all older rows; elsewhere
    the row at pos may be among them, and is taken from registers (k_new, v_new) where HAS_NEW:
    the cache row may not be written yet."""
    if NEW_APART:
        # a prefetched tile, read before the wait, needs no early V: a select in fp16 only
        # clears rows past `rows` (gpt2 batch 16's launch alone, H200: 4.62 us with _v_early's
        # select, 4.50 with this one, in two calls)
        v = tl.where(rows[:, None], v, 0.0) if PREFETCHED else _v_early(v, rows)
    else:
        k = k.to(tl.float32)
        v = tl.where(rows[:, None], v.to(tl.float32), 0.0)
        if HAS_NEW:
            is_new = (offs_n == pos)[:, None]
            k = tl.where(is_new, k_new.to(tl.float32)[None, :], k)
            v = tl.where(is_new, v_new.to(tl.float32)[None, :], v)
    return _attend_rows(q, k, v, rows, m_i, l_i, acc, p_new)


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lens_ptr, knew_ptr, vnew_ptr, part_ptr, count_ptr, k_desc, v_desc,
    H, D, L, qk_scale, chunk,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
    stride_ob, stride_oh, stride_knb, stride_knh, stride_vnb, stride_vnh,
    HAS_NEW: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH_N: tl.constexpr, LOOP_STAGES: tl.constexpr, NEW_APART: tl.constexpr,
    TMA: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    start = pid_s * chunk
    if PREFETCH_N > 0:  # rows written by earlier steps (caller's promise): read before the wait
        offs_p = start + tl.arange(0, PREFETCH_N)
        tile_mask = (offs_p < L)[:, None] & d_mask[None, :]
        k0 = tl.load(k_base + offs_p[:, None] * stride_kl + offs_d[None, :], mask=tile_mask, other=0.0)
        v0 = tl.load(v_base + offs_p[:, None] * stride_vl + offs_d[None, :], mask=tile_mask, other=0.0)
    if USE_PDL:  # launched early behind the kernel that writes q, k_new, v_new: wait for it
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    seq_len = tl.load(lens_ptr + b)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    q = q * qk_scale  # log2 domain
    end = tl.minimum(start + chunk, seq_len)  # this split's cache rows: [start, end)
    m_i = float("-inf")
    l_i = 0.0
    p_new = 0.0
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    pos = seq_len - 1
    k_new = q
    v_new = q
    if HAS_NEW:
        k_new = tl.load(knew_ptr + b * stride_knb + h * stride_knh + offs_d, mask=d_mask, other=0.0)
        v_new = tl.load(vnew_ptr + b * stride_vnb + h * stride_vnh + offs_d, mask=d_mask, other=0.0)
        owner = (pos >= start) & (pos < start + chunk)  # exactly one split owns the new position
        if owner:
            tl.store(k_base + pos * stride_kl + offs_d, k_new.to(k_ptr.dtype.element_ty), mask=d_mask)
            tl.store(v_base + pos * stride_vl + offs_d, v_new.to(v_ptr.dtype.element_ty), mask=d_mask)
        if NEW_APART:  # the owner's softmax starts from the new row (weight 1, followed in p_new)
            m_i = tl.where(owner, tl.sum(q * k_new.to(tl.float32), axis=0), m_i)
            l_i = tl.where(owner, 1.0, 0.0)
            p_new = l_i
            end = tl.minimum(end, pos)

    first = start
    if PREFETCH_N > 0:  # (rows past `end`, read to the cache's end, may hold anything)
        m1, l1, acc1, p1 = _attend_tile(q, k0, v0, offs_p, offs_p < end, pos, k_new, v_new, m_i, l_i, acc, p_new,
                                        HAS_NEW, NEW_APART, True)
        live = start < end  # no row here: keep the state (a neutral one's update is NaN)
        m_i = tl.where(live, m1, m_i)
        l_i = tl.where(live, l1, l_i)
        acc = tl.where(live, acc1, acc)
        p_new = tl.where(live, p1, p_new)
        first = start + PREFETCH_N
    # LOOP_STAGES > 1: Triton copies the tiles ahead into shared memory (cp.async); the same arithmetic
    for start_n in tl.range(first, end, BLOCK_N, num_stages=LOOP_STAGES):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        if TMA:  # whole tiles by tensor descriptors (zeros past L); rows past `end` are selected out
            k = tl.reshape(k_desc.load([b, h, start_n, 0]), (BLOCK_N, BLOCK_D))
            v = tl.reshape(v_desc.load([b, h, start_n, 0]), (BLOCK_N, BLOCK_D))
        else:
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_base + offs_n[:, None] * stride_kl + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vl + offs_d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc, p_new = _attend_tile(q, k, v, offs_n, n_mask, pos, k_new, v_new, m_i, l_i, acc, p_new,
                                            HAS_NEW, NEW_APART, False)
    if NEW_APART:
        acc += p_new * v_new.to(tl.float32)

    o_ptrs = o_ptr + b * stride_ob + h * stride_oh + offs_d
    if NUM_SPLITS == 1:
        tl.store(o_ptrs, (acc / l_i).to(o_ptr.dtype.element_ty), mask=d_mask)
    else:
        # partial row: [max, sum, acc[0:BLOCK_D]]
        row = part_ptr + (pid_bh * NUM_SPLITS + pid_s) * (BLOCK_D + 2)
        tl.store(row, m_i)
        tl.store(row + 1, l_i)
        tl.store(row + 2 + offs_d, acc)
        arrived = tl.atomic_add(count_ptr + pid_bh, 1, sem="acq_rel")
        if arrived == NUM_SPLITS - 1:
            offs_s = tl.arange(0, NUM_SPLITS)
            rows = part_ptr + (pid_bh * NUM_SPLITS + offs_s) * (BLOCK_D + 2)
            m_s = tl.load(rows, cache_modifier=".cg")
            l_s = tl.load(rows + 1, cache_modifier=".cg")
            acc_s = tl.load(rows[:, None] + 2 + offs_d[None, :], cache_modifier=".cg")
            m = tl.max(m_s, axis=0)  # finite: the new row's owner (or split 0, seq_len >= 1) has a row
            w = tl.exp2(m_s - m)  # empty splits: exp2(-inf) = 0
            out = tl.sum(acc_s * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
            tl.atomic_xchg(count_ptr + pid_bh, 0, sem="relaxed")  # next launch: after the kernel boundary
            tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=d_mask)


def _tma_ok(k_cache, v_cache, block_d):
    """Whether the caches' tiles can come in by tensor descriptors (tma_ready), their head rows one
    128-byte line at most with no padding to BLOCK_D."""
    return k_cache.shape[3] == block_d and block_d * 2 <= 128 and tma_ready(k_cache, v_cache)


def check_inputs(q, k_cache, v_cache, seq_lens, k_new=None, v_new=None):
    """decode_attention's argument checks (one ValueError naming the argument), shared with
    decode_attention_proj."""
    check_tensor("q", q, ndim=3, last_contiguous=True)
    check_device_usable("q", q)
    B, H, D = q.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, ndim=4, device=q.device, last_contiguous=True)
        if t.shape[0] != B or t.shape[1] != H or t.shape[3] != D:
            raise ValueError(f"{name}: expected shape ({B}, {H}, L, {D}), got {tuple(t.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32, torch.int64), device=q.device)
    if seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens: expected shape ({B},), got {tuple(seq_lens.shape)}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new/v_new: expected both or neither")
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if t is not None:
            check_tensor(name, t, ndim=3, device=q.device, last_contiguous=True)
            if t.shape != q.shape:
                raise ValueError(f"{name}: expected shape {tuple(q.shape)}, got {tuple(t.shape)}")


def decode_attention(q, k_cache, v_cache, seq_lens, scale=None, k_new=None, v_new=None, out=None,
                     num_splits=None, prefetch_cache=False, tma_stages=None, _config=None):
    """Attention of one new query per sequence over its cache.

    q: (B, H, D); k_cache, v_cache: (B, H, L, D), any strides but a contiguous head dim;
    seq_lens: (B,) int32/int64, 1 <= seq_lens[b] <= L: query b sees cache positions < seq_lens[b].
    k_new, v_new: optional (B, H, D), written to position seq_lens[b] - 1 of the caches first.
    Returns (B, H, D) in q's dtype (into `out` if given).
    prefetch_cache: each program reads its first cache tile (or tiles: decode_attention_config's
    prefetch_tiles) before waiting on the previous kernel (programmatic dependent launch). Only
    for caches that kernel does not write, as in a decode step, where the cache is written by
    this kernel alone.
    tma_stages: where the cache loop reads its tiles by tensor descriptors
    (decode_attention_config.tma_tiles), how many it keeps in flight, in place of 3 (None); a
    caller's tuning by model (minillm/decode_plan.py), the arithmetic the same.
    _config: {"BLOCK_N": ..., "num_warps": ..., "PREFETCH_TILES": ..., "LOOP_STAGES": ...,
    "NEW_APART": ...} in place of the defaults (benchmarks, tests).
    """
    check_inputs(q, k_cache, v_cache, seq_lens, k_new, v_new)
    B, H, D = q.shape
    o = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    check_tensor("out", o, ndim=3, dtypes=(q.dtype,), device=q.device, last_contiguous=True)
    if o.shape != q.shape:
        raise ValueError(f"out: expected shape {tuple(q.shape)}, got {tuple(o.shape)}")
    L = k_cache.shape[2]
    if B * H == 0:
        return o
    BLOCK_D = max(16, triton.next_power_of_2(D))
    tma_ok = _tma_ok(k_cache, v_cache, BLOCK_D)
    splits, chunk, meta = launch_layout(q.device, B * H, L, BLOCK_D, num_splits, _config, tma_ok, tma_stages)
    tiles, stages, apart, tma = (meta.pop(k) for k in ("PREFETCH_TILES", "LOOP_STAGES", "NEW_APART", "TMA"))
    part = q.new_empty((B * H * splits * (BLOCK_D + 2),) if splits > 1 else (1,), dtype=torch.float32)
    counts = arrival_counters(q.device, B * H) if splits > 1 else part
    kd = vd = part  # (unused stand-ins)
    if tma:
        kd, vd = (TensorDescriptor.from_tensor(t, [1, 1, meta["BLOCK_N"], BLOCK_D]) for t in (k_cache, v_cache))
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    kn = k_new if k_new is not None else q
    vn = v_new if v_new is not None else q
    pdl = use_pdl(q.device)
    launch(
        _decode_attention_kernel, (B * H, splits), q, k_cache, v_cache, o, seq_lens, kn, vn, part, counts, kd, vd,
        H, D, L, scale * LOG2E, chunk,  # log2(e): softmax via exp2
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), o.stride(0), o.stride(1),
        kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        HAS_NEW=k_new is not None, NUM_SPLITS=splits, BLOCK_D=BLOCK_D,
        USE_PDL=pdl, PREFETCH_N=tiles * meta["BLOCK_N"] if prefetch_cache else 0, LOOP_STAGES=stages,
        NEW_APART=bool(apart) and k_new is not None, TMA=tma, launch_pdl=pdl,
        **meta,
    )
    return o
