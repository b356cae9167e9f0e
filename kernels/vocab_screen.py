"""Greedy decoding's vocabulary head at one row from an int8 screen: the argmax key of
layernorm(x) @ W + bias (the layernorm folded in, as linear's ln_fold) that the full head
(vocab_fma.py) gives, read from about half its bytes. Past vocab_fma's MAX_K (gpt2-large,
gpt2-xl) the engine's full head runs on tensor cores, whose logits may differ in the last bits:
there the key is the one vocab_fma's arithmetic gives, as a row's key may differ between batch
sizes.

At one row the full head is a pure weight stream (gpt2: 77 MB in fp16, a sixth of a decode
step's time), and greedy decoding keeps one number of the 50k it computes. Here:
- an int8 copy of W (one fp32 scale per column, built once at load: `_screen_head.py`) is streamed
  instead, and the row, standardized by its layernorm, is rounded on one scale to integers of
  two int8 digits (ROW_RADIX), so a column's screen value is an exact integer dot product (two
  dp4a a word) times the two scales;
- each column gets an interval that surely holds the full head's logit (the bound below); its
  ends are rounded to the logits' dtype, which keeps their order against the rounded logits;
- a program posts its best lower end into the row's argmax key word, as a key that any logit
  of the same value outranks, with a returning atomic max: what comes back (with its own post)
  is a value some column's logit reaches. Its columns whose upper end reaches that value are
  computed exactly, as vocab_fma computes them, and their keys max-ed in. A column it skips is
  below some column's logit even after rounding, so it is never the argmax, ties included.

Programs are one warp, loop over column blocks with two in flight and request their first before
the programmatic-dependent-launch wait, as in vocab_fma.py. The upper ends go through a scratch
buffer, which the program reads back after its blocks; no logits come out. Most programs compute
no column exactly: a column is computed only if it was near the best lower end posted before its
program finished (a few columns a row, see the tests).
"""
import math
import os

import torch
import triton
import triton.language as tl

from ._epilogue import _mean_rstd
from ._screen_head import MAX_SCREEN_K
from ._tuning import INTERPRET, env_int, launch, layout_switch, sm_count, use_pdl
from ._workspace import screen_scratch
from .argmax_key import _argmax_key, _from_ordered, _no_token_if_nan, _ordered
from .gemv_fma import _row_sums, pad_fold
from .vocab_fma import BLOCK_N as EXACT_BLOCK_N, ONE_COLUMN_K, _block_logits, fitted_programs

# One warp a program, PROGRAMS_PER_SM of them an SM, each block MAX_BLOCK_WORDS int32 words of int8
# (BLOCK_N columns of BLOCK_W, K // 4 rounded up to a power of two; at most MAX_BLOCK_N columns):
# 8 columns up to K = 1024, 4 past it. At the two digits (H200, Triton 3.6):
# - gpt2 (138 registers a thread; 4 columns take 96, 2 take 80): +0.8%, +0.5% and, on another
#   machine, +1.4% against 4 x 24 in same-call A/Bs, ahead in all 7 rounds, where 2 x 24 lost 2.0%,
#   4 x 16 1.4%, 8 x 8 0.3% and 16 x 6 5.5%; gpt2-medium even (bench/results/h200/session-131/call4-6)
# - gpt2-large +0.6% against 2 x 24 (2 columns take 128 registers, so fitted_programs launches 16
#   an SM: 2 x 16, the same launch, read +0.3%) and +0.4% against 2 x 16 on another machine,
#   gpt2-xl even (4 columns take 168 registers); 2 x 24 squeezed to 80 registers (spilling) -0.2%
#   and -1.1% (session-132/call3-4)
MAX_BLOCK_WORDS = 2048
MAX_BLOCK_N = 8
PROGRAMS_PER_SM = 12
# the widest K * ROW_RADIX whose screen dot products (at most 127**2 * ROW_RADIX * K) convert to fp32 exactly
EXACT_DOT_K = tl.constexpr(2 ** 24 // 127 ** 2)
# The row is rounded on a grid ROW_RADIX times finer than int8's, each value two int8 digits
# (hi * ROW_RADIX + lo), two dp4a a word. On int8's grid one outlier dimension (trained models' last
# layers have a few) rounds the rest coarsely: a gpt2 head with one 30 (100) times the rest left
# ~1,400 (~50,000) columns to compute, 29 (34) us against 16 here and 22.5 for the full head; random
# weights: gpt2 batch 1 -0.7%, gpt2-xl even (H200, bench/results/h200/session-129/). Exact int32
# sums up to MAX_SCREEN_K: 127**2 * 64 * 2048 < 2**31. MINILLM_SCREEN_ROW_RADIX=n (1: int8's grid)
ROW_RADIX = env_int("MINILLM_SCREEN_ROW_RADIX", 64, minimum=1)
if ROW_RADIX & (ROW_RADIX - 1) or 127 ** 2 * ROW_RADIX * MAX_SCREEN_K >= 2 ** 31:
    raise ValueError(f"MINILLM_SCREEN_ROW_RADIX: expected a power of two whose int32 sums stay exact at K = "
                     f"{MAX_SCREEN_K} (127**2 * n * K < 2**31), got {ROW_RADIX}")
# MINILLM_SCREEN_MAXNREG=n caps a thread's registers (A/B timing). The digits take 96 at gpt2's K
# (21 programs an SM) where int8's grid took 80 (24), but capped at 88 gpt2 batch 1 lost 1.8%, at 80
# (spilling) +0.1% against +0.7% for int8's grid (session-129/call4/): not the registers' price
FORCED_MAXNREG = env_int("MINILLM_SCREEN_MAXNREG", minimum=0)  # 0 or unset: no cap
# the interpreter runs every program, and every op of one, in Python: a vocabulary in a few wide
# blocks, one a program (tests/kernels/test_vocab_screen.py narrows them: several blocks a program)
INTERPRET_BLOCK_N = 4096
FORCED_LAYOUT = layout_switch("MINILLM_SCREEN_LAYOUT", os.environ.get("MINILLM_SCREEN_LAYOUT"),
                              "BLOCK_NxPROGRAMS", "4x24", pow2=1)

@triton.jit
def _dp4a(a, b, DP4A: tl.constexpr):
    """Elementwise sums of the four int8 products of int32 words a and b (exact in int32)."""
    if DP4A:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.zeros_like(a)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:  # the interpreter runs no PTX: the bytes by shifts (arithmetic, so signed)
        acc = tl.zeros_like(a)
        for i in tl.static_range(4):
            acc += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return acc


@triton.jit
def _pack_int8(v, BLOCK_K: tl.constexpr):
    """int32 values in [-127, 127] (BLOCK_K,) as int32 words of 4 bytes (BLOCK_K // 4,), the
    first in the lowest byte (the fields are disjoint, so their sum is their or)."""
    b = tl.reshape(v & 255, (BLOCK_K // 4, 4))
    return tl.sum(b << (tl.arange(0, 4) * 8)[None, :], axis=1)


@triton.jit
def _x_row(x_ptr, rk, stride_xk, k_mask, X_UNIT: tl.constexpr):
    """The row as fp32: from floats, or (X_UNIT > 0) from int32 fixed-point words of X_UNIT each,
    a residual stream summed by integer atomics (a word's conversion rounds once; X_UNIT is a
    power of two, so the scaling is exact)."""
    x = tl.load(x_ptr + rk * stride_xk, mask=k_mask, other=0).to(tl.float32)
    if X_UNIT > 0.0:
        x = x * X_UNIT
    return x


@triton.jit
def _vocab_screen_kernel(
    x_ptr, q_ptr, meta_ptr, w_ptr, bias_ptr, fold_ptr, up_ptr, key_ptr,
    N, N_PAD, ln_eps, sqrt_k, stride_xk, stride_qn, stride_wn,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr, DP4A: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, EXACT_N: tl.constexpr,
    ITERS: tl.constexpr, PAD_FOLD: tl.constexpr, X_UNIT: tl.constexpr, ROW_RADIX: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_N  # programs take column blocks in turn
    cols = tl.arange(0, BLOCK_N)
    rw = tl.arange(0, BLOCK_W)
    w_mask = rw < K // 4
    q_rows = q_ptr + rw[None, :]  # (1, BLOCK_W): a column's words contiguous

    rn = pid * BLOCK_N + cols  # the launcher makes no more programs than blocks
    q = tl.load(q_rows + rn[:, None] * stride_qn, mask=(rn < N)[:, None] & w_mask[None, :], other=0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x is written by now
        tl.extra.cuda.gdc_launch_dependents()
    rk = tl.arange(0, BLOCK_K)
    k_mask = rk < K
    xf = _x_row(x_ptr, rk, stride_xk, k_mask, X_UNIT)  # (BLOCK_K,)
    row_sum, row_sq = _row_sums(xf, k_mask, PAD_FOLD)
    mean, rstd = _mean_rstd(row_sum, row_sq, K, ln_eps)  # as vocab_fma: the same bits
    # The bound. With u = rstd * (x - mean) (u' its fp32 value), u' = su * xq + d (xq int8) and a
    # column's w = s * q + e (q int8), the full head's logit without its rounding is
    #   u . w + bias = su * s * (xq . q) + su * xq . e + d . w + (u - u') . w + bias
    # (its mean * colsum term cancels up to colsum's own rounding), so it lies within
    # A * E + D * W of the screen value, A = su * |xq| and D >= |d| (the row's), E >= |e| and
    # W >= |w| (the column's, from screen_head), plus every fp32 rounding of both computations:
    # at most eta = (K + 16) * 2**-23 times what they round (for fp32 sums of K terms in any order
    # (K + 1) * 2**-24 would do). su * xq . e is also within |su * xq|_1 * s / 2 (each |e_k| <= s / 2,
    # s's fp32 rounding within the 2**-16 more): tighter than A * E where u is concentrated in a few
    # dimensions, and the screen takes the smaller. xq has ROW_RADIX * 127 steps a side
    eta = (K + 16) * 1.1920928955078125e-07
    if K * ROW_RADIX > EXACT_DOT_K:  # and the dot products' conversion to fp32 (relative 2**-24 each)
        eta += 5.9604644775390625e-08
    u = tl.where(k_mask, (xf - mean) * rstd, 0.0)
    su = tl.maximum(tl.max(tl.abs(u), axis=0), 1e-30) / (127.0 * ROW_RADIX)
    xq = tl.minimum(tl.maximum(tl.floor(u / su + 0.5), -127.0 * ROW_RADIX), 127.0 * ROW_RADIX)
    d = u - xq * su
    # fp32 sums of squares (past int32 at ROW_RADIX > 1), within (1 + eta) once scaled up
    a_norm = su * tl.sqrt(tl.sum(xq * xq, axis=0)) * (1.0 + eta)
    d_norm = (tl.sqrt(tl.sum(d * d, axis=0)) + eta * a_norm) * (1.0 + eta)
    a_l1 = su * tl.sum(tl.abs(xq), axis=0) * (1.0 + eta) * 0.5000153  # |su * xq|_1 * (0.5 + 2**-16)
    x_norm = tl.sqrt(row_sq) * (1.0 + eta)
    row_w = a_norm + d_norm + rstd * (x_norm + tl.abs(mean) * sqrt_k)  # W's factor in the slack
    row_colsum = rstd * tl.abs(mean)  # |colsum|'s factor in the slack
    if ROW_RADIX > 1:  # xq = hi * ROW_RADIX + lo: hi in [-127, 127], lo in [-ROW_RADIX / 2, ROW_RADIX / 2)
        hi = tl.floor(xq / ROW_RADIX + 0.5)  # exact in fp32: integers below 2**13, a power of two
        lo = (xq - hi * ROW_RADIX).to(tl.int32)
        xw_lo = tl.broadcast_to(_pack_int8(lo, BLOCK_K)[None, :], (BLOCK_N, BLOCK_W))
        xq = hi
    xq = xq.to(tl.int32)
    xw = _pack_int8(xq, BLOCK_K)  # (BLOCK_W,)
    xw = tl.broadcast_to(xw[None, :], (BLOCK_N, BLOCK_W))

    best_lower = float("-inf")
    for n0 in range(pid * BLOCK_N, N, step):
        rn = n0 + cols
        n_mask = rn < N
        pad_mask = rn < N_PAD  # as n_mask, but whole vectors (N_PAD is a multiple of 16)
        rn_next = rn + step  # requested before this block is reduced: two blocks in flight
        q_next = tl.load(q_rows + rn_next[:, None] * stride_qn, mask=(rn_next < N)[:, None] & w_mask[None, :],
                         other=0)
        # the column constants first, so their round trip overlaps the reduction
        s = tl.load(meta_ptr + rn, mask=pad_mask)
        e_norm = tl.load(meta_ptr + N_PAD + rn, mask=pad_mask)
        w_norm = tl.load(meta_ptr + 2 * N_PAD + rn, mask=pad_mask)
        colsum = tl.load(meta_ptr + 3 * N_PAD + rn, mask=pad_mask)
        bias = tl.load(meta_ptr + 4 * N_PAD + rn, mask=pad_mask)
        words = _dp4a(q, xw, DP4A)
        if ROW_RADIX > 1:
            words = words * ROW_RADIX + _dp4a(q, xw_lo, DP4A)
        dot = tl.sum(words, axis=1)  # (BLOCK_N,) exact in int32: |dot| <= 127**2 * ROW_RADIX * K
        core = (su * s) * dot.to(tl.float32)
        screen = core + bias
        slack = eta * (row_w * w_norm + row_colsum * colsum + tl.abs(core) + 2.0 * tl.abs(bias))
        bound = (tl.minimum(a_norm * e_norm, a_l1 * s) + d_norm * w_norm + slack) * 1.0001  # 1.0001: its own roundings
        upper = (screen + bound).to(up_ptr.dtype.element_ty)  # round to nearest: order kept
        tl.store(up_ptr + rn, upper, mask=pad_mask)
        lower = (screen - bound).to(up_ptr.dtype.element_ty).to(tl.float32)
        lower = tl.where(lower == lower, lower, float("-inf"))  # inf - inf: no lower end
        best_lower = tl.maximum(best_lower, tl.max(tl.where(n_mask, lower, float("-inf")), axis=0))
        q = q_next

    # the upper ends back (and x, for the exact logits), requested before the atomic below so
    # that the round trips overlap
    tl.debug_barrier()  # the upper ends stored by other lanes of this warp are visible now
    rn_all = pid * BLOCK_N + tl.arange(0, ITERS)[:, None] * step + cols[None, :]  # (ITERS, BLOCK_N)
    uppers = tl.load(up_ptr + rn_all, mask=rn_all < N_PAD, other=float("-inf")).to(tl.float32)
    xf = _x_row(x_ptr, rk, stride_xk, k_mask, X_UNIT)
    # post the best lower end as the lowest-ranked key of its value (index part 0); the word's
    # maximum comes back: some column's rounded logit reaches it
    posted = _ordered(best_lower).to(tl.int64) << 32
    old = tl.atomic_max(key_ptr, posted, sem="relaxed")
    threshold = _from_ordered((tl.maximum(old, posted) >> 32).to(tl.int32))
    left = tl.where((uppers >= threshold) & (rn_all < N), rn_all, N)  # columns to compute exactly
    n_left = tl.sum(tl.sum((left < N).to(tl.int32), axis=1), axis=0)

    # the candidates exactly as vocab_fma computes them (its _block_logits): its block of EXACT_N
    # columns over its K tile, so a logit's bits are the full head's (x was read again in that
    # head's layout)
    ex = tl.arange(0, EXACT_N)
    best = tl.full((EXACT_N,), float("-inf"), tl.float32)
    best_col = tl.full((EXACT_N,), N, tl.int32)
    found = n_left > 0
    while n_left > 0:  # ascending columns, EXACT_N at a time
        rc = tl.full((EXACT_N,), N, tl.int32)
        for i in tl.static_range(EXACT_N):
            col = tl.min(tl.min(left, axis=1), axis=0)
            rc = tl.where(ex == i, col, rc)
            left = tl.where(left == col, N, left)
        n_left -= EXACT_N
        c_mask = rc < N
        w = tl.load(w_ptr + rc[:, None] * stride_wn + rk[None, :], mask=c_mask[:, None] & k_mask[None, :], other=0.0)
        y = _block_logits(w, xf, k_mask, rc, c_mask, bias_ptr, fold_ptr, mean, rstd, up_ptr, HAS_BIAS, True, False,
                          PAD_FOLD)
        v = tl.where(c_mask, y, float("-inf"))
        better = v > best  # per lane the first maximum: its columns rise
        best = tl.where(better, v, best)
        best_col = tl.where(better, rc, best_col)
    vmax = tl.max(best, axis=0)
    col = tl.min(tl.where(best == vmax, best_col, N), axis=0)  # the lowest column among ties
    # NaN or inf in x leaves no logit finite: the row names no token (as vocab_fma tells it)
    not_finite = (mean * 0.0 != 0.0) | (rstd * 0.0 != 0.0)
    vmax, col = _no_token_if_nan(vmax, col, not_finite, N)
    if found | not_finite:
        tl.atomic_max(key_ptr, _argmax_key(vmax, col), sem="relaxed")


def screen_config(N, K, *, sms):
    """The launch layout: MAX_BLOCK_WORDS a block, PROGRAMS_PER_SM an SM, one warp each
    (MINILLM_SCREEN_LAYOUT=BLOCK_NxPROGRAMS forces another, for A/B timing)."""
    block_w = triton.next_power_of_2(K // 4)
    widest = max(1, min(MAX_BLOCK_N, MAX_BLOCK_WORDS // block_w))
    block_n, per_sm = FORCED_LAYOUT or (widest, PROGRAMS_PER_SM)
    block_n = INTERPRET_BLOCK_N if INTERPRET else block_n
    return dict(BLOCK_N=block_n, BLOCK_W=block_w, BLOCK_K=triton.next_power_of_2(K),
                EXACT_N=EXACT_BLOCK_N if K < ONE_COLUMN_K else 1, num_warps=1, per_sm=per_sm,
                programs=min(triton.cdiv(N, block_n), sms * per_sm))


def screened_argmax(x2, weight, bias, ln_fold, ln_eps, screen, argmax_keys, upper=None, x_unit=None):
    """Max the argmax key of layernorm(x2) @ weight + bias (x2 (1, K); weight (K, N) out-major with
    its folded layernorm's column sums ln_fold, as `linear` takes them) into argmax_keys (1,),
    reading the screen (`screen_head`) and only the few columns it cannot rule out. No logits
    come out; upper (N_PAD,) of the logits' dtype, if given, receives each column's upper end
    (tests), else the workspace's scratch does. x_unit: x2 is int32 fixed-point words of that
    many (a power of two) each, and the logits are fp32."""
    K, N = weight.shape
    n_pad = screen.meta.shape[1]
    if (x_unit is not None) != (x2.dtype == torch.int32):
        raise ValueError(f"x_unit: expected a unit exactly for int32 words x2, got {x_unit} for {x2.dtype}")
    if x_unit is not None and not (x_unit > 0 and math.frexp(x_unit)[0] == 0.5):
        raise ValueError(f"x_unit: expected a power of two, got {x_unit}")
    if upper is None:
        upper = screen_scratch(x2.device, n_pad, torch.float32 if x_unit else x2.dtype)[:n_pad]
    meta = screen_config(N, K, sms=sm_count(x2.device))
    programs, per_sm = meta.pop("programs"), meta.pop("per_sm")
    pdl = use_pdl(x2.device)
    args = (x2, screen.q, screen.meta, weight, bias if bias is not None else ln_fold, ln_fold, upper, argmax_keys,
            N, n_pad, ln_eps, K ** 0.5, x2.stride(1), screen.q.stride(0), weight.stride(1))
    meta.update(K=K, HAS_BIAS=bias is not None, USE_PDL=pdl, DP4A=not INTERPRET, num_stages=1, launch_pdl=pdl,
                PAD_FOLD=pad_fold(K, meta["BLOCK_K"], meta["num_warps"]), X_UNIT=float(x_unit or 0.0),
                ROW_RADIX=ROW_RADIX)
    if FORCED_MAXNREG and not INTERPRET:
        meta["maxnreg"] = FORCED_MAXNREG
    # ITERS, the blocks a program takes (the tile that reads its upper ends back), and the program
    # count the SMs hold by the registers of the kernel compiled with it, fitted together: fewer
    # programs take more blocks, which may take more registers, so the count only falls (a few rounds)
    key = (x2.dtype, weight.dtype, N % 16, x2.stride(1))
    wanted = programs
    while True:
        meta["ITERS"] = triton.next_power_of_2(triton.cdiv(N, programs * meta["BLOCK_N"]))
        fitted = fitted_programs(_vocab_screen_kernel, wanted, per_sm, x2.device, key, args, meta)
        if fitted >= programs:
            break
        programs = fitted
    launch(_vocab_screen_kernel, (programs,), *args, **meta)
