"""Transformer MLP with its residual: x + act(layernorm(x) @ W_fc + b_fc) @ W_proj + b_proj.

At a few rows (decode) the MLP is two weight reads joined by a 4C-wide hidden row. As two
linears it costs two dependent launches, each ending in a split-K merge. The fused kernel runs
it as one launch with no merge inside:
- a program owns BLOCK_H hidden units: it computes them over all of K (the layernorm from the
  row statistics the previous kernel left), applies the activation, rounds them to x's dtype
  as the unfused fc would store them, and multiplies them straight into the BLOCK_H rows of
  W_proj it owns: a partial of the whole output row;
- the partials meet in an int64 row in fixed point (units of 2**-32) by relaxed atomic adds.
  Integer sums do not depend on the order of arrival, so the result is deterministic;
- the last program to arrive (an acq_rel counter) finishes the row: bias, residual, rounding,
  the next layernorm's statistics; and zeroes the int64 row for the next launch.
The atomics grow with the rows, so past FUSED_ROWS (and with MINILLM_FUSED_MLP=0, for A/B
timing) the launcher runs the two linears instead. The two paths round differently, so a
row's bits depend on which one its batch takes.
"""
import os

import torch
import triton
import triton.language as tl

from ._checks import check_device_usable, check_shape, check_tensor
from ._epilogue import STATS_GROUP, _epilogue, _load_row_stats, check_row_stats
from ._epilogue import _store_row_stats
from ._tuning import INTERPRET, use_pdl
from ._workspace import arrival_counters, fixed_point_rows
from .activations import ACTIVATIONS, _apply_activation
from .gemv import _chunk_dot, _row_stats, _weight_tile
from .linear import linear

FUSED_ROWS = 16  # one tl.dot row block; see fused_config for the measured crossover
FUSED = os.environ.get("MINILLM_FUSED_MLP", "1") != "0"
FIXED_ONE = tl.constexpr(4294967296.0)  # 2**32: |partial| must stay below 2**31


def fused_config(M, C, hidden, itemsize=2):
    """Launch parameters of the fused kernel for M rows of a (C -> hidden -> C) MLP."""
    if INTERPRET:
        return dict(BLOCK_H=16, BLOCK_K=32, BLOCK_N=32, num_warps=4, num_stages=1)
    return dict(BLOCK_H=32, BLOCK_K=128 if itemsize <= 2 else 64, BLOCK_N=128, num_warps=4, num_stages=3)


@triton.jit
def _fused_mlp_kernel(
    x_ptr, lnw_ptr, lnb_ptr, stats_in_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, y_ptr, acc_ptr, count_ptr, stats_out_ptr,
    M, ln_eps, negative_slope, zero,
    stride_xm, stride_w1k, stride_w1n, stride_w2k, stride_w2n, stride_ym, stride_si, stride_so,
    C: tl.constexpr, HIDDEN: tl.constexpr, ACTIVATION: tl.constexpr, LN_STATS: tl.constexpr,
    STATS_OUT: tl.constexpr, GROUPS_POW2: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    LN_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    m_mask = rm < M
    rh = pid * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = rh < HIDDEN
    kk = tl.arange(0, BLOCK_K)
    # the weights never change between launches: the first W_fc tile and the fc bias are
    # requested before waiting on the kernel that writes x
    w, lnw, lnb = _weight_tile(w1_ptr, lnw_ptr, lnb_ptr, kk, kk < C, rh, h_mask, stride_w1k, stride_w1n, True)
    b1 = tl.load(b1_ptr + rh, mask=h_mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    if LN_STATS:
        mean, rstd = _load_row_stats(stats_in_ptr, rm, m_mask, stride_si, ln_eps, C, GROUPS_POW2)
    else:
        mean, rstd = _row_stats(x_ptr, rm, m_mask, stride_xm, 1, ln_eps, C, BLOCK_M, LN_BLOCK)
    ITERS: tl.constexpr = (C + BLOCK_K - 1) // BLOCK_K
    acc = _chunk_dot(x_ptr + rm[:, None] * stride_xm, w1_ptr, lnw_ptr, lnb_ptr, w, lnw, lnb, mean, rstd, rh, h_mask,
                     m_mask, 0, zero, 1, stride_w1k, stride_w1n, C, True, True, ITERS, BLOCK_M, BLOCK_H, BLOCK_K,
                     INPUT_PRECISION)
    h = _apply_activation(acc + b1[None, :], negative_slope, ACTIVATION)
    h = tl.where(h_mask[None, :], h, 0.0).to(x_ptr.dtype.element_ty)  # (BLOCK_M, BLOCK_H)

    for n0 in range(0, C, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        n_mask = rn < C
        w2 = tl.load(w2_ptr + rh[:, None] * stride_w2k + rn[None, :] * stride_w2n,
                     mask=h_mask[:, None] & n_mask[None, :], other=0.0)
        part = tl.dot(h, w2, input_precision=INPUT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32
        # scaling by a power of two is exact; the cast truncates toward zero, the same in every launch
        tl.atomic_add(acc_ptr + rm[:, None] * C + rn[None, :], (part * FIXED_ONE).to(tl.int64),
                      mask=m_mask[:, None] & n_mask[None, :], sem="relaxed")

    # acq_rel: our adds are visible before the count moves; the last arriver sees everyone's
    if tl.atomic_add(count_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        for c0 in tl.static_range(0, C, BLOCK_N):  # unrolled: the loads of all blocks go out together
            rc = c0 + tl.arange(0, BLOCK_N)
            c_mask = rc < C
            out_mask = m_mask[:, None] & c_mask[None, :]
            ptrs = acc_ptr + rm[:, None] * C + rc[None, :]
            total = tl.load(ptrs, mask=out_mask, other=0, cache_modifier=".cg")
            tl.store(ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int64), mask=out_mask)
            b2 = tl.load(b2_ptr + rc, mask=c_mask, other=0.0).to(tl.float32)[None, :]
            res = tl.load(x_ptr + rm[:, None] * stride_xm + rc[None, :], mask=out_mask, other=0.0).to(tl.float32)
            y = _epilogue(total.to(tl.float32) / FIXED_ONE, b2, res, y_ptr, rm, rc, out_mask, stride_ym,
                          negative_slope, None)
            if STATS_OUT:
                _store_row_stats(tl.where(out_mask, y, 0.0), rm, m_mask, c0, C, stats_out_ptr, stride_so,
                                 BLOCK_M, BLOCK_N)
        tl.atomic_xchg(count_ptr, 0, sem="relaxed")  # the next launch starts after this one ends


def _check(x, ln_weight, ln_bias, fc_weight, fc_bias, proj_weight, proj_bias, activation, out):
    check_tensor("x", x, ndim=2, last_contiguous=True)
    check_device_usable("x", x)
    M, C = x.shape
    check_tensor("fc_weight", fc_weight, ndim=2, dtypes=(x.dtype,), device=x.device)
    if fc_weight.shape[0] != C:
        raise ValueError(f"fc_weight: expected ({C}, hidden) to match x's last dim, got {tuple(fc_weight.shape)}")
    hidden = fc_weight.shape[1]
    check_tensor("proj_weight", proj_weight, ndim=2, dtypes=(x.dtype,), device=x.device)
    check_shape("proj_weight", proj_weight, (hidden, C))
    for name, t, n in (("ln_weight", ln_weight, C), ("ln_bias", ln_bias, C), ("fc_bias", fc_bias, hidden),
                       ("proj_bias", proj_bias, C)):
        check_tensor(name, t, ndim=1, device=x.device)
        check_shape(name, t, (n,))
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if out is not None:
        check_tensor("out", out, dtypes=(x.dtype,), device=x.device)
        check_shape("out", out, (M, C))
        if not out.is_contiguous():
            raise ValueError("out: expected a contiguous tensor")
    return M, C, hidden


def mlp(x, ln_weight, ln_bias, fc_weight, fc_bias, proj_weight, proj_bias, activation="gelu_tanh", ln_eps=1e-5,
        negative_slope=0.01, ln_stats=None, stats_out=None, out=None, _config=None):
    """x + act(layernorm(x) @ fc_weight + fc_bias) @ proj_weight + proj_bias (GPT-2's MLP block
    with its residual), fp32 accumulation, in x's dtype.

    x: (M, C); fc_weight: (C, hidden) and proj_weight: (hidden, C), any strides; out may be x.
    ln_stats / stats_out: row statistics of x / of the result, as for `linear`.
    M <= FUSED_ROWS runs the fused kernel; _config (tests, benchmarks): its fused_config.
    """
    M, C, hidden = _check(x, ln_weight, ln_bias, fc_weight, fc_bias, proj_weight, proj_bias, activation, out)
    check_row_stats("ln_stats", ln_stats, M, C, x.device)
    check_row_stats("stats_out", stats_out, M, C, x.device)
    y = torch.empty_like(x) if out is None else out
    if M == 0:
        return y
    if M > FUSED_ROWS or not FUSED:
        f = linear(x, fc_weight, fc_bias, activation=activation, negative_slope=negative_slope, ln_weight=ln_weight,
                   ln_bias=ln_bias, ln_eps=ln_eps, ln_stats=ln_stats)
        # x is read before its kernel waits: the fc launch before it does not write x
        return linear(f, proj_weight, proj_bias, residual=x, out=y, stats_out=stats_out, prefetch_residual=True)

    meta = fused_config(M, C, hidden, x.element_size()) if _config is None else dict(_config)
    acc = fixed_point_rows(x.device, M * C)
    counts = arrival_counters(x.device, 1)
    pdl = use_pdl(x.device)
    dummy = stats_out if stats_out is not None else ln_stats if ln_stats is not None else acc
    _fused_mlp_kernel[(triton.cdiv(hidden, meta["BLOCK_H"]),)](
        x, ln_weight, ln_bias, ln_stats if ln_stats is not None else dummy, fc_weight, fc_bias, proj_weight, proj_bias,
        y, acc, counts, stats_out if stats_out is not None else dummy,
        M, ln_eps, negative_slope, 0.0,
        x.stride(0), fc_weight.stride(0), fc_weight.stride(1), proj_weight.stride(0), proj_weight.stride(1),
        y.stride(0), ln_stats.stride(0) if ln_stats is not None else 0,
        stats_out.stride(0) if stats_out is not None else 0,
        C=C, HIDDEN=hidden, ACTIVATION=activation, LN_STATS=ln_stats is not None, STATS_OUT=stats_out is not None,
        GROUPS_POW2=triton.next_power_of_2(triton.cdiv(C, STATS_GROUP)),
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", USE_PDL=pdl,
        BLOCK_M=FUSED_ROWS, LN_BLOCK=min(512, triton.next_power_of_2(C)), launch_pdl=pdl, **meta,
    )
    return y
