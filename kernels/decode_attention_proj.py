"""A decode step's attention and its output projection in one launch, for few rows:
x + attention(q over the cache) @ W + bias.

At batch 1 every decode kernel costs about 2-3 us of launch, wait and L2 round trips whatever
its bytes, and a layer ran five of them one after the other. Here decode attention becomes the
prologue of the projection, so a layer runs four:
- a program owns one (row, head, column block): it computes its head's attention over the whole
  cache (its first BLOCK_L positions read before the wait, any rest in tiles after it) and
  multiplies the result by that head's D rows of W, a split-K GEMV whose chunk is a head;
- every column block recomputes the head's attention (its cache tile comes from L2 after the
  first read), which costs less than a kernel boundary while the cache is short;
- the heads' partials meet in one of two ways, both deterministic, and a row's result does not
  depend on the batch:
  - without row statistics (one row on the CUDA-core linears, gpt2 to gpt2-xl, which read whole
    rows), by the one-atomic merge (_fixed_merge.py; where decode_attention_proj_config's
    fixed_merge says): each program adds its partial to one int64 word per (row, column) in
    fixed point, and the program that completes a column runs its epilogue (bias, residual). One
    round trip, where storing partials, passing an arrival counter and reading the partials
    back took three;
    Where the next layernorm's row statistics are asked for in the fixed-point form
    (_epilogue.py; half precision), the program that completes columns also adds their
    statistics into the row's group words, one relaxed atomic each, awaited by nobody;
  - with the row statistics as stored partials, which need a whole column block in one program,
    the last program of a (row, column block) to arrive adds the heads' partials in head order
    and runs the epilogue, as gemv.py's split layout does.
Given l2_ahead (the next kernels' weights), each program asks L2 for its share of their bytes
before its wait (_l2_ahead.py), where the caller's rule says the bus is free for them.
The attention output is rounded to x's dtype before the product, as decode_attention would
store it. Longer caches and more rows run decode_attention and linear, which split the cache
and fill the GPU better (`fused_layout` returns None there).
"""
import math

import torch
import triton
import triton.language as tl

from ._checks import check_shape, check_tensor
from ._epilogue import _add_row_stats_fixed, _epilogue, _load_bias_residual, _store_row_stats, check_row_stats
from ._fixed_merge import _add_fixed
from ._l2_ahead import _ask_l2_ranges, l2_ranges, launch_args as l2_launch_args
from ._pdl import _gdc_wait_after, _in_f32
from ._tuning import launch, sm_count, use_pdl
from ._workspace import arrival_counters, fixed_point_sums
from .decode_attention import LOG2E, _attend_rows, check_inputs, decode_attention
from .decode_attention_proj_config import early_f32, fixed_merge, fixed_stats_fit, fused_layout
from .linear import linear

# decode_attention_proj's prefetch -> the kernel's PREFETCH: what it reads before its wait
PREFETCH_MODES = {False: 0, "cache": 1, True: 2}


@triton.jit
def _cache_tiles(k_base, v_base, offs_l, offs_d, rows, d_mask, stride_kl, stride_vl):
    """A cache tile's keys and values in the rows asked for (zero elsewhere)."""
    mask = rows[:, None] & d_mask[None, :]
    k = tl.load(k_base + offs_l[:, None] * stride_kl + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_base + offs_l[:, None] * stride_vl + offs_d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def _row_inputs(lens_ptr, bias_ptr, res_ptr, b, rm, rn, tile_mask, n_mask, stride_rm, HAS_BIAS: tl.constexpr):
    """The row's length (written by the step's embedding), the bias and the residual tile (fp32)."""
    seq_len = tl.load(lens_ptr + b)
    bias, res = _load_bias_residual(bias_ptr, res_ptr, rm, rn, tile_mask, n_mask, stride_rm, HAS_BIAS, True)
    return seq_len, bias, res


@triton.jit
def _decode_attention_proj_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, knew_ptr, vnew_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, part_ptr, count_ptr,
    stats_ptr, words_ptr, positions_ptr,
    M, N, D, qk_scale,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
    stride_knb, stride_knh, stride_vnb, stride_vnh, stride_wk, stride_wn, stride_rm, stride_ym, stride_sm,
    l2a_ptr, l2a_bytes, l2b_ptr, l2b_bytes,
    H: tl.constexpr, H_POW2: tl.constexpr, HAS_BIAS: tl.constexpr, STATS_OUT: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, EARLY_LAUNCH: tl.constexpr, FIXED: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    L2_AHEAD: tl.constexpr, L2_SLOTS: tl.constexpr, L2_PIECE: tl.constexpr, EARLY_F32: tl.constexpr,
):
    if USE_PDL and EARLY_LAUNCH:  # the next kernel may launch now: its prefetch overlaps all of this one
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    h = tl.program_id(1)  # the head: this program's chunk of the projection's K
    b = pid % M  # rows fastest: programs that share a weight tile run side by side
    pid_n = pid // M
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rm = b + tl.zeros((1,), dtype=tl.int32)  # the row, as a one-row tile for the shared epilogue
    tile_mask = (rm < M)[:, None] & n_mask[None, :]
    offs_l = tl.arange(0, BLOCK_L)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh

    # the head's rows of W never change between launches: first, before anything else
    w = tl.load(w_ptr + (h * D + offs_d)[:, None] * stride_wk + rn[None, :] * stride_wn,
                mask=d_mask[:, None] & n_mask[None, :], other=0.0)
    # what earlier kernels wrote, before the wait as far as the caller vouches (PREFETCH_MODES)
    if PREFETCH == 1:  # the positions, final before the step began: the tile stops at each row's older rows
        n_older = tl.load(positions_ptr + b)
        k, v = _cache_tiles(k_base, v_base, offs_l, offs_d, offs_l < n_older, d_mask, stride_kl, stride_vl)
    if PREFETCH == 2:  # the lengths and x too: the tile stops at each row's older positions
        seq_len, bias, res = _row_inputs(lens_ptr, bias_ptr, res_ptr, b, rm, rn, tile_mask, n_mask, stride_rm,
                                         HAS_BIAS)
        k, v = _cache_tiles(k_base, v_base, offs_l, offs_d, offs_l < seq_len - 1, d_mask, stride_kl, stride_vl)
    if L2_AHEAD:  # after this program's own early loads, which should not queue behind these
        program, n_prog = pid + h * tl.num_programs(0), tl.num_programs(0) * tl.num_programs(1)
        _ask_l2_ranges(l2a_ptr, l2a_bytes, l2b_ptr, l2b_bytes, program, n_prog, L2_SLOTS, L2_PIECE)
    if USE_PDL:
        if EARLY_F32 > 0 and PREFETCH > 0:  # tiles in fp32 before the wait (early_f32)
            chk = 0.0
            if EARLY_F32 % 2 == 1:
                k, chk = _in_f32(k, chk)
            if EARLY_F32 // 2 % 2 == 1:
                v, chk = _in_f32(v, chk)
            if EARLY_F32 // 4 % 2 == 1:
                w, chk = _in_f32(w, chk)
            _gdc_wait_after(chk)  # q, k_new, v_new are written by the kernel before
        else:
            tl.extra.cuda.gdc_wait()  # q, k_new, v_new are written by the kernel before
        if not EARLY_LAUNCH:
            tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH == 1:
        seq_len = n_older + 1
        bias, res = _load_bias_residual(bias_ptr, res_ptr, rm, rn, tile_mask, n_mask, stride_rm, HAS_BIAS, True)
    if PREFETCH == 0:
        seq_len, bias, res = _row_inputs(lens_ptr, bias_ptr, res_ptr, b, rm, rn, tile_mask, n_mask, stride_rm,
                                         HAS_BIAS)
        k, v = _cache_tiles(k_base, v_base, offs_l, offs_d, offs_l < seq_len - 1, d_mask, stride_kl, stride_vl)

    pos = seq_len - 1
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    q = q * qk_scale  # log2 domain
    k_new = tl.load(knew_ptr + b * stride_knb + h * stride_knh + offs_d, mask=d_mask, other=0.0)
    v_new = tl.load(vnew_ptr + b * stride_vnb + h * stride_vnh + offs_d, mask=d_mask, other=0.0)
    if pid_n == 0:  # one program per (row, head) appends the new key and value
        tl.store(k_base + pos * stride_kl + offs_d, k_new.to(k_ptr.dtype.element_ty), mask=d_mask)
        tl.store(v_base + pos * stride_vl + offs_d, v_new.to(v_ptr.dtype.element_ty), mask=d_mask)
    # the new row starts the softmax (its score, weight 1; v_new is added at the end with the
    # weight it has then), so the tiles hold older rows only: nothing to select into K and V
    older_rows = offs_l < pos
    m_i, l_i, acc, p_new = _attend_rows(q, k, v, older_rows, tl.sum(q * k_new.to(tl.float32), axis=0), 1.0,
                                         tl.zeros((BLOCK_D,), dtype=tl.float32), 1.0)
    for start in range(BLOCK_L, pos, BLOCK_L):  # a cache longer than one tile: the rest after the wait
        offs = start + offs_l
        older_rows = offs < pos
        k_t, v_t = _cache_tiles(k_base, v_base, offs, offs_d, older_rows, d_mask, stride_kl, stride_vl)
        m_i, l_i, acc, p_new = _attend_rows(q, k_t, v_t, older_rows, m_i, l_i, acc, p_new)
    acc += p_new * v_new.to(tl.float32)
    o = (acc / l_i).to(y_ptr.dtype.element_ty).to(tl.float32)  # (BLOCK_D,): as decode_attention stores it

    part = tl.sum(o[:, None] * w.to(tl.float32), axis=0)  # (BLOCK_N,): this head's share
    finish = True
    if FIXED:  # (H > 1) finish the columns where this program came last
        part, done = _add_fixed(part, words_ptr + b * N + rn, n_mask, H)
        tile_mask = tile_mask & done[None, :]
    elif H > 1:
        part_row = part_ptr + b * N + rn
        tl.store(part_row + h * M * N, part, mask=n_mask)
        # acq_rel: our partial is visible before the count moves; the last arriver sees all
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
        finish = arrived == H - 1
        if finish:
            hs = tl.arange(0, H_POW2)
            parts = tl.load(part_row[None, :] + hs[:, None] * M * N, mask=(hs < H)[:, None] & n_mask[None, :],
                            other=0.0, cache_modifier=".cg")
            part = tl.sum(parts, axis=0)  # a fixed reduction order: deterministic
            tl.atomic_xchg(count_ptr + pid, 0, sem="relaxed")  # next launch: after the kernel boundary
    if finish:
        y = _epilogue(part[None, :], bias, res, y_ptr, rm, rn, tile_mask, stride_ym, 0.0, None)
        if STATS_OUT and FIXED:
            _add_row_stats_fixed(tl.reshape(y, (BLOCK_N,)), done, b, pid_n * BLOCK_N, N, stats_ptr, stride_sm,
                                 BLOCK_N)
        elif STATS_OUT:
            _store_row_stats(tl.where(tile_mask, y, 0.0), rm, rm < M, pid_n * BLOCK_N, N, stats_ptr, stride_sm,
                             1, BLOCK_N)


def decode_attention_proj(q, k_cache, v_cache, seq_lens, k_new, v_new, weight, bias, residual, out=None,
                          stats_out=None, scale=None, prefetch=False, early_launch=False, positions=None,
                          l2_ahead=(), tma_stages=None, _layout=None, _early_f32=None):
    """residual + decode_attention(q, ..., k_new=, v_new=) @ weight + bias: attention of one new
    query per sequence and the attention block's output projection.

    q, k_new, v_new: (B, H, D); k_cache, v_cache: (B, H, L, D) (the new key and value land at
    position seq_lens[b] - 1); weight: (H * D, N) with any strides; bias: (N,) or None;
    residual: (B, N). Writes (B, N) into `out` (may be residual itself), with its rows' partial
    statistics into stats_out if given: new_row_stats(B, N), or a zeroed buffer of the fixed-point
    form (a layer of fixed_row_stats), added into. Without stats_out or with the fixed form (and
    with 2 to 63 heads) the heads' partials add up in fixed point: a column where a head's
    partial is not finite or reaches 2**21 in magnitude comes out NaN.
    prefetch: what is read before the wait on the previous kernel (programmatic dependent
    launch), where that kernel writes none of it, as in a decode step: False nothing; "cache"
    the first cache tile up to each row's new position, read from `positions` ((B,) int32,
    seq_lens - 1), which must be final before any kernel that may still run when this one
    starts (a decode step's input positions: only the step's last kernel advances them), so it
    holds while the kernel before this one may still run; True the lengths and the residual as
    well, which needs the kernel before to launch this one only after its own wait.
    early_launch: the next kernel may launch at this one's start
    (linear's early_launch; the caller vouches that it reads nothing this one writes before its
    own wait). l2_ahead: up to two dense tensors (the next kernels' weights) whose bytes the
    fused launch asks L2 for before its wait (_l2_ahead.py; on Hopper GPUs only, results unchanged).
    tma_stages: decode_attention's, where the two launches run (fused_layout None).
    _layout: (BLOCK_N, BLOCK_L, num_warps) in place of fused_layout's, _early_f32 in place of
    early_f32's (tests, benchmarks)."""
    if k_new is None or v_new is None:
        raise ValueError("k_new/v_new: expected the new token's keys and values, got None")
    if not isinstance(prefetch, (bool, str)) or prefetch not in PREFETCH_MODES:
        raise ValueError(f"prefetch: expected False, True or 'cache', got {prefetch!r}")
    check_inputs(q, k_cache, v_cache, seq_lens, k_new, v_new)
    if (prefetch == "cache") != (positions is not None):
        raise ValueError("positions: expected a (B,) tensor with prefetch='cache' and None otherwise, "
                         f"got {'None' if positions is None else 'a tensor'} with prefetch={prefetch!r}")
    if positions is not None:
        check_tensor("positions", positions, ndim=1, dtypes=(torch.int32,), device=q.device)
        check_shape("positions", positions, (q.shape[0],))
    B, H, D = q.shape
    check_tensor("weight", weight, ndim=2, device=q.device)
    if weight.shape[0] != H * D:
        raise ValueError(f"weight: expected {H * D} rows (heads x head_dim), got shape {tuple(weight.shape)}")
    N = weight.shape[1]
    check_tensor("residual", residual, ndim=2, dtypes=(q.dtype,), device=q.device, last_contiguous=True)
    check_shape("residual", residual, (B, N))
    if bias is not None:
        check_tensor("bias", bias, ndim=1, device=q.device)
        check_shape("bias", bias, (N,))
    y = torch.empty_like(residual) if out is None else out
    check_tensor("out", y, ndim=2, dtypes=(q.dtype,), device=q.device, last_contiguous=True)
    check_shape("out", y, (B, N))
    check_row_stats("stats_out", stats_out, B, N, q.device, fixed_ok=True)
    fixed_stats = stats_out is not None and stats_out.dtype == torch.int64
    ahead = l2_ranges("l2_ahead", l2_ahead, q.device)
    layout = _layout or fused_layout(B, N, k_cache.shape[2], D, H, sms=sm_count(q.device))
    if fixed_stats and not fixed_stats_fit(H, N, q.dtype, layout):
        raise ValueError("stats_out: the fixed-point form (int64) is written by the fused launch's fixed merge only "
                         "(fixed_row_stats says where); expected new_row_stats' float32 buffer here")
    if layout is None:
        # decode_attention reads only the cache before its wait, and launches the linear after it:
        # whatever launched this op, the residual is final by then
        attn = decode_attention(q, k_cache, v_cache, seq_lens, scale, k_new, v_new, prefetch_cache=bool(prefetch),
                                tma_stages=tma_stages)
        return linear(attn.view(B, H * D), weight, bias, residual=residual, out=y, stats_out=stats_out,
                      prefetch_residual=bool(prefetch), early_launch=early_launch)
    block_n, block_l, warps = layout
    fixed = fixed_merge(H) and (stats_out is None or fixed_stats)
    if fixed:  # no partials or counters: their pointers go unused
        words = part = counts = fixed_point_sums(q.device, B * N)
    else:
        part = q.new_empty((H * B * N,) if H > 1 else (1,), dtype=torch.float32)
        counts = arrival_counters(q.device, B * triton.cdiv(N, block_n))
        words = part
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    pdl = use_pdl(q.device)
    l2_args, l2_meta = l2_launch_args(ahead, y, q.device, warps)
    launch(
        _decode_attention_proj_kernel, (B * triton.cdiv(N, block_n), H),
        q, k_cache, v_cache, seq_lens, k_new, v_new, weight, bias if bias is not None else y, residual, y,
        part, counts, stats_out if stats_out is not None else part, words,
        positions if positions is not None else seq_lens,
        B, N, D, scale * LOG2E,  # log2(e): softmax via exp2
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1), weight.stride(0), weight.stride(1), residual.stride(0), y.stride(0),
        stats_out.stride(0) if stats_out is not None else 0,
        *l2_args, **l2_meta,
        H=H, H_POW2=triton.next_power_of_2(H), HAS_BIAS=bias is not None, STATS_OUT=stats_out is not None,
        USE_PDL=pdl, PREFETCH=PREFETCH_MODES[prefetch], EARLY_LAUNCH=bool(early_launch), FIXED=fixed,
        BLOCK_L=block_l, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_N=block_n,
        EARLY_F32=early_f32(B, N) if _early_f32 is None else _early_f32,
        num_warps=warps, launch_pdl=pdl,
    )
    return y
