"""Greedy decoding's vocabulary head for 2 to 64 rows from the int8 screen (vocab_screen.py's
copy of the head): each row's argmax key of layernorm(x) @ W + bias, bit for bit the key the
one-row full head (vocab_fma.py) gives that row alone, from about half the head's bytes.

Past one row the full head runs on tensor cores (gemv.py): at 64 rows of gpt2 it streams 77 MB
in about 25 us. Here, in three launches:
- the rounding: a program a row takes out its mean and rounds each K chunk to int8 on its own
  scale (so one large value costs only its chunk's resolution), once for all the screen's
  programs (each rounding all the rows itself took longer than the full head);
- the screen: a program a block of BLOCK_N columns over all rows multiplies the int8 rows by
  the int8 columns on tensor cores (exact int32 sums). Every (row, column) gets an
  interval that surely holds the exact logit (the bound below); the program keeps, per row, the
  largest upper end of each group of columns (group_n) and of the block, and posts the row's best lower end
  into its argmax word (as vocab_screen does: a key that any logit of that value outranks);
- the pick: PICK_PARTS one-warp programs a row, after the screen. What the word holds is then the
  best lower end of the whole row; the groups whose upper end reaches it are the only columns
  that can hold the argmax, and they are computed exactly as vocab_fma computes them (its
  layout, its statistics of the row), their keys max-ed in.
No logits come out. The screen's statistics of a row are its own (other sums in another
order than vocab_fma's), and the bound covers the difference.
"""
import os

import torch
import triton
import triton.language as tl

from ._l2_ahead import ON as L2_ON, _ask_l2_columns
from ._epilogue import _mean_rstd
from ._tuning import INTERPRET, is_hopper, launch, layout_switch, use_pdl
from .argmax_key import _from_ordered, _ordered
from .vocab_fma import BLOCK_N as EXACT_BLOCK_N, ONE_COLUMN_K
from .vocab_screen import _exact_tile, _post_best
from .vocab_screen import screened_argmax as screened_argmax_one

# MINILLM_SCREEN_ROWS=0 gives greedy decoding past one row the full head back (A/B timing)
ENABLED = os.environ.get("MINILLM_SCREEN_ROWS", "1") != "0"
MAX_ROWS = 64
BLOCK_N = 64  # columns a screen program
BLOCK_K = 128  # K chunk: each row's chunk has its own int8 scale
def exact_n(K):
    """Columns a tile of the exact logits: vocab_fma's block at K, for its bits."""
    return EXACT_BLOCK_N if K < ONE_COLUMN_K else 1


def group_n(K):
    """Columns the pick computes together where their largest upper end reaches the threshold:
    two of its tiles, requested together."""
    return 2 * exact_n(K)


PICK_PARTS = 32  # programs a row in the pick: a row's few candidate groups are then in different programs
NUM_WARPS = 4
NUM_STAGES = 3
INTERPRET_BLOCK_N = 256  # the interpreter runs every program in Python: fewer, wider blocks
FORCED_LAYOUT = layout_switch("MINILLM_SCREEN_ROWS_LAYOUT", os.environ.get("MINILLM_SCREEN_ROWS_LAYOUT"),
                              "BLOCK_NxWARPSxSTAGES", "64x4x3", pow2=2)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, xq_ptr, sx_ptr, rowv_ptr, K, stride_xm, stride_xk, stride_qm, stride_sm, stride_vm,
    CHUNKS: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x is written by now
        tl.extra.cuda.gdc_launch_dependents()  # the screen may launch: its first requests need no x
    x_row = x_ptr + row * stride_xm
    # the row's center c (its mean), taken out before the rounding: a mean far from zero would
    # take the int8 grid's resolution. Any c keeps the screen's bound
    row_sum = 0.0
    row_sq = 0.0
    for ch in tl.static_range(CHUNKS):
        kk = ch * BLOCK_K + tl.arange(0, BLOCK_K)
        xc = tl.load(x_row + kk * stride_xk, mask=kk < K, other=0.0).to(tl.float32)
        row_sum += tl.sum(xc, axis=0)
        row_sq += tl.sum(xc * xc, axis=0)
    c = row_sum / K
    # each chunk of x - c on its own int8 scale; the norms of a = the int8 chunks times their
    # scales and of d = x - c - a
    a_sq = 0.0
    d_sq = 0.0
    for ch in tl.static_range(CHUNKS):
        kk = ch * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        xc = tl.where(k_mask, tl.load(x_row + kk * stride_xk, mask=k_mask, other=0.0).to(tl.float32) - c, 0.0)
        sx = tl.maximum(tl.max(tl.abs(xc), axis=0), 1e-30) / 127.0
        xq = tl.minimum(tl.maximum(tl.floor(xc / sx + 0.5), -127.0), 127.0)
        d = xc - xq * sx
        d_sq += tl.sum(d * d, axis=0)
        a_sq += (sx * sx) * tl.sum(xq * xq, axis=0)  # the int sum is exact: 127**2 * BLOCK_K < 2**24
        tl.store(xq_ptr + row * stride_qm + kk, xq.to(tl.int8))
        tl.store(sx_ptr + row * stride_sm + ch, sx)
    v = tl.arange(0, 8)
    vals = tl.where(v == 0, c, tl.where(v == 1, row_sum, tl.where(v == 2, row_sq, tl.where(v == 3, a_sq, d_sq))))
    tl.store(rowv_ptr + row * stride_vm + v, vals, mask=v < 5)


@triton.jit
def _screen_rows_kernel(
    xq_ptr, sx_ptr, rowv_ptr, q_ptr, meta_ptr, fold_ptr, gmax_ptr, bmax_ptr, key_ptr,
    M, N, N_PAD, NG, NB, ln_eps, sqrt_k,
    stride_xm, stride_sm, stride_vm, stride_qn, stride_gm, stride_bm,
    K: tl.constexpr, CHUNKS: tl.constexpr, USE_PDL: tl.constexpr, L2_ASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
):
    pid = tl.program_id(0)
    n0 = pid * BLOCK_N
    rm = tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    pad_mask = rn < N_PAD  # as n_mask, but whole vectors (N_PAD is a multiple of 16)
    if L2_ASK:  # the block's int8 columns (K bytes each, contiguous) into L2 before the wait
        _ask_l2_columns(q_ptr, n0, N, stride_qn, 0, K, tl.full((BLOCK_N,), True, tl.int1), BLOCK_N)
    # the column constants (vocab_screen.screen_head) before the wait, too
    s = tl.load(meta_ptr + rn, mask=pad_mask)
    e_norm = tl.load(meta_ptr + N_PAD + rn, mask=pad_mask)
    w_norm = tl.load(meta_ptr + 2 * N_PAD + rn, mask=pad_mask)
    abs_colsum = tl.load(meta_ptr + 3 * N_PAD + rn, mask=pad_mask)
    bias = tl.load(meta_ptr + 4 * N_PAD + rn, mask=pad_mask)
    colsum = tl.load(fold_ptr + rn, mask=n_mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the rows are rounded by now (and x written)
        tl.extra.cuda.gdc_launch_dependents()  # the pick may start: it reads x before its own wait

    # per row (_quantize_rows_kernel): its center c, sums, and the norms of a and d; per (row,
    # column): the sum of the chunks' scaled int32 dots, and of their magnitudes (what the sum's
    # roundings are relative to)
    rowv = rowv_ptr + rm * stride_vm
    c = tl.load(rowv, mask=m_mask, other=0.0)
    row_sum = tl.load(rowv + 1, mask=m_mask, other=0.0)
    row_sq = tl.load(rowv + 2, mask=m_mask, other=0.0)
    a_sq = tl.load(rowv + 3, mask=m_mask, other=0.0)
    d_sq = tl.load(rowv + 4, mask=m_mask, other=0.0)
    core = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    core_abs = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ch in range(CHUNKS):
        kk = ch * BLOCK_K + tl.arange(0, BLOCK_K)
        xq = tl.load(xq_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None], other=0)
        sx = tl.load(sx_ptr + rm * stride_sm + ch, mask=m_mask, other=0.0)
        qc = tl.load(q_ptr + rn[:, None] * stride_qn + kk[None, :], mask=n_mask[:, None] & (kk < K)[None, :], other=0)
        dot = tl.dot(xq, tl.trans(qc), out_dtype=tl.int32).to(tl.float32)  # exact below 2**24
        core += sx[:, None] * dot
        core_abs += sx[:, None] * tl.abs(dot)

    # The bound. With w = s * q + e a column's weights (q int8; E >= |e|, W >= |w|), x = c + a + d
    # and T = x . w - mean * colsum in this program's statistics (mean, rstd), the screen value is
    #   S = rstd * ((c - mean) * colsum + a . s q) + bias = rstd * (T - r) + bias
    # with r = a . e + d . w + c * (sum(w) - colsum), and the pick's logit without its roundings,
    # in its own statistics (mean', rstd'),
    #   L = rstd' * (T - (mean' - mean) * colsum) + bias.
    # With Q = A * E + D * W + |c| eta / 2 sqrt(K) W >= |r| (colsum is within eta / 2 sqrt(K) W of
    # the weights' sum), |T| <= |S - bias| / rstd + Q, so
    #   |L - S| <= (rstd + dr) * Q + dr / rstd * |S - bias| + (rstd + dr) * dmean * |colsum|
    # where |mean' - mean| <= dmean and |rstd' - rstd| <= dr (both sums of K terms, in any order,
    # are within eta / 2 of the exact ones), plus every fp32 rounding of both computations: at
    # most eta = (K + 16) * 2**-23 times what they round
    eta = (K + 16) * 1.1920928955078125e-07
    mean, rstd = _mean_rstd(row_sum, row_sq, K, ln_eps)
    x_norm = tl.sqrt(row_sq) * (1.0 + eta)
    a_norm = tl.sqrt(a_sq) * (1.0 + eta)
    d_norm = (tl.sqrt(d_sq) + eta * a_norm) * (1.0 + eta)
    dmean = eta * (x_norm / sqrt_k + tl.abs(mean))
    var = tl.maximum(tl.fma(-mean, mean, row_sq / K), 0.0)
    dvar = 2.0 * eta * (row_sq / K + var + ln_eps) + dmean * (2.0 * tl.abs(mean) + dmean)
    v_lo = tl.maximum(var + ln_eps - dvar, ln_eps * 0.5)
    # 1/sqrt(v) moves at most dv / (2 v^1.5) over [v_lo, ...]; 1e-6 of it for the approximate
    # square root and division of both computations (a few units in the last place each)
    dr = (0.5 * dvar / v_lo + 1e-6) / tl.sqrt(v_lo)
    r_hi = rstd + dr
    m_hi = tl.abs(mean) + dmean
    c_abs = tl.abs(c)
    row_w = (r_hi * (d_norm + eta * (x_norm + c_abs * sqrt_k)))[:, None]  # W's factor (and the pick's dot's roundings)
    row_cs = (r_hi * (dmean + eta * (2.0 * m_hi + c_abs)))[:, None]  # |colsum|'s factor
    centered = tl.fma((c - mean)[:, None], colsum[None, :], s[None, :] * core) * rstd[:, None]
    screen = centered + bias[None, :]
    slack = eta * (r_hi[:, None] * (s[None, :] * core_abs) + 2.0 * tl.abs(bias)[None, :] + tl.abs(screen))
    bound = (r_hi[:, None] * a_norm[:, None] * e_norm[None, :] + row_w * w_norm[None, :]
             + row_cs * abs_colsum[None, :] + (dr / rstd)[:, None] * tl.abs(centered)
             + slack) * 1.0001  # the bound's own roundings
    ok = m_mask[:, None] & n_mask[None, :]
    upper = (screen + bound).to(gmax_ptr.dtype.element_ty)  # round to nearest: order kept
    upper = tl.where(ok, upper, float("-inf"))
    lower = (screen - bound).to(gmax_ptr.dtype.element_ty).to(tl.float32)
    lower = tl.where(ok & (lower == lower), lower, float("-inf"))  # inf - inf: no lower end

    # per row: the groups' and the block's largest upper ends, and the best lower end posted as
    # the lowest-ranked key of its value (index part 0)
    groups = tl.max(tl.reshape(upper, (BLOCK_M, BLOCK_N // GROUP_N, GROUP_N)), axis=2)
    rg = pid * (BLOCK_N // GROUP_N) + tl.arange(0, BLOCK_N // GROUP_N)
    tl.store(gmax_ptr + rm[:, None] * stride_gm + rg[None, :], groups, mask=m_mask[:, None] & (rg < NG)[None, :])
    tl.store(bmax_ptr + rm * stride_bm + pid, tl.max(groups, axis=1), mask=m_mask)
    posted = _ordered(tl.max(lower, axis=1)).to(tl.int64) << 32
    tl.atomic_max(key_ptr + rm, posted, mask=m_mask, sem="relaxed")


@triton.jit
def _pick_rows_kernel(
    x_ptr, w_ptr, bias_ptr, fold_ptr, gmax_ptr, bmax_ptr, key_ptr,
    N, NG, NB, PER, ln_eps, stride_xm, stride_xk, stride_wn, stride_gm, stride_bm,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_K: tl.constexpr,
    PER_POW2: tl.constexpr, GROUPS_PER_BLOCK: tl.constexpr, GROUP_N: tl.constexpr, EXACT_N: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)  # this program's PER blocks of the row: the row's candidates in parallel
    # the row and its statistics as vocab_fma takes them (one warp, the same layout: the same bits)
    rk = tl.arange(0, BLOCK_K)
    k_mask = rk < K
    xf = tl.load(x_ptr + row * stride_xm + rk * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
    mean, rstd = _mean_rstd(tl.sum(xf, axis=0), tl.sum(xf * xf, axis=0), K, ln_eps)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the screen is done: its maxima and its posts are in
    key = tl.load(key_ptr + row)
    rb = part * PER + tl.arange(0, PER_POW2)
    rb_mask = (rb < NB) & (rb < part * PER + PER)
    bmax = tl.load(bmax_ptr + row * stride_bm + rb, mask=rb_mask, other=float("-inf")).to(tl.float32)
    # the best lower end of the row (or a larger key already in the word)
    threshold = _from_ordered((key >> 32).to(tl.int32))
    blocks = tl.where(rb_mask & (bmax >= threshold), rb, NB)  # NaN never reaches it (a NaN row: below)
    n_blocks = tl.sum((blocks < NB).to(tl.int32), axis=0)
    ex = tl.arange(0, EXACT_N)
    rg = tl.arange(0, GROUPS_PER_BLOCK)
    best = tl.full((EXACT_N,), float("-inf"), tl.float32)
    best_col = tl.full((EXACT_N,), N, tl.int32)
    found = n_blocks > 0
    while n_blocks > 0:  # ascending blocks, then groups: the columns rise
        b = tl.min(blocks, axis=0)
        blocks = tl.where(blocks == b, NB, blocks)
        n_blocks -= 1
        g_all = b * GROUPS_PER_BLOCK + rg
        gmax = tl.load(gmax_ptr + row * stride_gm + g_all, mask=g_all < NG, other=float("-inf")).to(tl.float32)
        groups = tl.where(gmax >= threshold, g_all, NG)
        n_groups = tl.sum((groups < NG).to(tl.int32), axis=0)
        while n_groups > 0:
            g = tl.min(groups, axis=0)
            groups = tl.where(groups == g, NG, groups)
            n_groups -= 1
            # the group's two tiles requested together, then computed in column order
            rc0 = g * GROUP_N + ex
            rc1 = rc0 + EXACT_N
            w_rows = w_ptr + rk[None, :]
            w0 = tl.load(w_rows + rc0[:, None] * stride_wn, mask=(rc0 < N)[:, None] & k_mask[None, :], other=0.0)
            w1 = tl.load(w_rows + rc1[:, None] * stride_wn, mask=(rc1 < N)[:, None] & k_mask[None, :], other=0.0)
            best, best_col = _exact_tile(w0, rc0, best, best_col, xf, bias_ptr, fold_ptr, mean, rstd, gmax_ptr, N,
                                         HAS_BIAS)
            best, best_col = _exact_tile(w1, rc1, best, best_col, xf, bias_ptr, fold_ptr, mean, rstd, gmax_ptr, N,
                                         HAS_BIAS)
    _post_best(best, best_col, found, mean, rstd, key_ptr + row, N)


def rows_config(M):
    """The screen's layout for M rows: BLOCK_M (16 to 64 rows, the tensor cores' least is 16),
    BLOCK_N columns a program, its warps and pipeline stages over K chunks
    (MINILLM_SCREEN_ROWS_LAYOUT=BLOCK_NxWARPSxSTAGES forces another, for A/B timing)."""
    block_n, warps, stages = FORCED_LAYOUT or (BLOCK_N, NUM_WARPS, NUM_STAGES)
    block_n = INTERPRET_BLOCK_N if INTERPRET else block_n
    return dict(BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def screens_rows(M):
    """Whether screened_argmax takes M rows at once (1 to MAX_ROWS; switched off: one only)."""
    return M == 1 or (ENABLED and 1 < M <= MAX_ROWS)


def screened_argmax(x2, weight, bias, ln_fold, ln_eps, screen, argmax_keys, maxima=None):
    """Max each row's argmax key of layernorm(x2) @ weight + bias (x2 (M, K), M <= MAX_ROWS;
    weight (K, N) out-major with its folded layernorm's column sums ln_fold, as `linear` takes
    them) into argmax_keys (M,), reading the screen (vocab_screen.screen_head) and only the
    columns it cannot rule out: one row by vocab_screen, more here. No logits come out; maxima
    (tests), a dict, receives the screen's largest upper ends per row of each group_n(K) columns
    ("groups", (M, NG)) and of each block ("blocks", (M, NB)) in x2's dtype."""
    M, K = x2.shape
    if M == 1:
        return screened_argmax_one(x2, weight, bias, ln_fold, ln_eps, screen, argmax_keys)
    if not screens_rows(M):
        raise ValueError(f"x2: expected 1 to {MAX_ROWS} rows for the screened head, got {M}")
    N = weight.shape[1]
    meta = rows_config(M)
    rows = quantized_rows(x2)
    gmax = torch.empty(M, triton.cdiv(N, group_n(K)), dtype=x2.dtype, device=x2.device)
    bmax = torch.empty(M, triton.cdiv(N, meta["BLOCK_N"]), dtype=x2.dtype, device=x2.device)
    if maxima is not None:
        maxima.update(groups=gmax, blocks=bmax)
    pdl = use_pdl(x2.device)
    quantize_launch(x2, rows, pdl)
    screen_launch(rows, screen, ln_fold, ln_eps, argmax_keys, gmax, bmax, meta, pdl)
    pick_launch(x2, weight, bias, ln_fold, ln_eps, argmax_keys, gmax, bmax, meta["BLOCK_N"], pdl)


def quantized_rows(x2):
    """Buffers for the rows rounded to int8: (xq (M, CHUNKS * BLOCK_K) int8, zero past K; the
    chunks' scales (M, CHUNKS) fp32; per row c, its sum and sum of squares, |a|^2, |d|^2 (M, 8))."""
    M, K = x2.shape
    chunks = triton.cdiv(K, BLOCK_K)
    return (torch.empty(M, chunks * BLOCK_K, dtype=torch.int8, device=x2.device),
            torch.empty(M, chunks, dtype=torch.float32, device=x2.device),
            torch.empty(M, 8, dtype=torch.float32, device=x2.device))


def quantize_launch(x2, rows, pdl):
    """The first launch: each row rounded to int8 a chunk at a time (a program a row)."""
    M, K = x2.shape
    xq, sx, rowv = rows
    return launch(_quantize_rows_kernel, (M,), x2, xq, sx, rowv, K, x2.stride(0), x2.stride(1), xq.stride(0),
                  sx.stride(0), rowv.stride(0), CHUNKS=sx.shape[1], USE_PDL=pdl, BLOCK_K=BLOCK_K,
                  num_warps=4, num_stages=1, launch_pdl=pdl)


def screen_launch(rows, screen, ln_fold, ln_eps, argmax_keys, gmax, bmax, meta, pdl):
    """The screen's launch (alone: bench_screen_rows.py)."""
    xq, sx, rowv = rows
    M = xq.shape[0]
    q8 = screen.q.view(torch.int8)  # (N, K): a column's K weights contiguous
    N, K = q8.shape
    l2 = L2_ON and is_hopper(xq.device) and K % 16 == 0
    return launch(_screen_rows_kernel, (bmax.shape[1],), xq, sx, rowv, q8, screen.meta, ln_fold, gmax, bmax,
                  argmax_keys, M, N, screen.meta.shape[1], gmax.shape[1], bmax.shape[1], ln_eps, K ** 0.5,
                  xq.stride(0), sx.stride(0), rowv.stride(0), q8.stride(0), gmax.stride(0), bmax.stride(0),
                  K=K, CHUNKS=sx.shape[1], USE_PDL=pdl, L2_ASK=l2, BLOCK_K=BLOCK_K, GROUP_N=group_n(K),
                  launch_pdl=pdl, **meta)


def pick_launch(x2, weight, bias, ln_fold, ln_eps, argmax_keys, gmax, bmax, block_n, pdl):
    """The pick's launch: PICK_PARTS programs a row, each over its share of the row's blocks
    (alone: bench_screen_rows.py)."""
    M, K = x2.shape
    N, ng, nb = weight.shape[1], gmax.shape[1], bmax.shape[1]
    per = triton.cdiv(nb, PICK_PARTS)
    return launch(_pick_rows_kernel, (M, triton.cdiv(nb, per)), x2, weight, bias if bias is not None else ln_fold,
                  ln_fold, gmax, bmax, argmax_keys, N, ng, nb, per, ln_eps, x2.stride(0), x2.stride(1),
                  weight.stride(1), gmax.stride(0), bmax.stride(0), K=K, HAS_BIAS=bias is not None, USE_PDL=pdl,
                  BLOCK_K=triton.next_power_of_2(K), PER_POW2=triton.next_power_of_2(per),
                  GROUPS_PER_BLOCK=block_n // group_n(K), GROUP_N=group_n(K), EXACT_N=exact_n(K), num_warps=1,
                  num_stages=1, launch_pdl=pdl)
