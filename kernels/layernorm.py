"""LayerNorm over the last dim, optionally fused with the residual add that precedes it.

One program normalizes ROWS_PER_PROG rows held whole in registers (hidden sizes up to 8192):
one read of x (and the residual), one write of y (and of the sum), fp32 statistics.

layernorm_rows is the decode linears' layernorm prologue run as a kernel of its own, for the
layouts where normalizing inside the matmul loop costs more than a launch (gemv.decode_config):
the same statistics (the producer's partial sums, or the whole row) and the same formula
(_epilogue._normalize), so a row gets the same bits either way.
"""
import torch
import triton
import triton.language as tl

from ._checks import check_device_usable, check_shape, check_tensor
from ._epilogue import STATS_GROUP, _load_row_stats, _normalize, _row_stats, row_stats_block
from ._tuning import use_pdl

ROWS_BLOCK_M = 16  # rows per layernorm_rows program, as the decode linears' row blocks


@triton.jit
def _layernorm_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, sum_ptr,
    M, N, eps,
    stride_xm, stride_rm, stride_ym, stride_sm,
    HAS_RESIDUAL: tl.constexpr,
    ROWS_PER_PROG: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * ROWS_PER_PROG + tl.arange(0, ROWS_PER_PROG)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
        # round the sum to the storage dtype first: the normalized output then matches
        # layernorm(x + residual) computed as two separate ops
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + rows[:, None] * stride_sm + cols[None, :], x, mask=mask)
    x = x.to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layernorm_rows_kernel(x_ptr, w_ptr, b_ptr, y_ptr, stats_ptr, M, eps, stride_xm, stride_xk, stride_ym, stride_sm,
                           K: tl.constexpr, LN_STATS: tl.constexpr, GROUPS_POW2: tl.constexpr,
                           USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m_mask = rm < M
    k_mask = kk < K
    lnw = tl.load(w_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)  # constant: before the wait
    lnb = tl.load(b_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x and its statistics are written by now
        tl.extra.cuda.gdc_launch_dependents()  # the matmul after us may fetch its weights
    if LN_STATS:
        mean, rstd = _load_row_stats(stats_ptr, rm, m_mask, stride_sm, eps, K, GROUPS_POW2)
    else:
        mean, rstd = _row_stats(x_ptr, rm, m_mask, stride_xm, stride_xk, eps, K, BLOCK_M, BLOCK_K)
    tile_mask = m_mask[:, None] & k_mask[None, :]
    a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk, mask=tile_mask, other=0.0)
    tl.store(y_ptr + rm[:, None] * stride_ym + kk[None, :], _normalize(a, k_mask, lnw, lnb, mean, rstd), mask=tile_mask)


def layernorm_rows(x2, weight, bias, eps, stats=None):
    """LayerNorm of the rows of x2 (M, K) as the decode linears' prologue computes it, with
    statistics from `stats` (a new_row_stats buffer the producer of x2 filled) or from the rows.
    Inputs already checked by `linear`; returns a new (M, K) tensor."""
    M, K = x2.shape
    y = torch.empty((M, K), dtype=x2.dtype, device=x2.device)
    pdl = use_pdl(x2.device)
    block_k = row_stats_block(K)  # a program's columns: the statistics pass reads the row in these chunks
    _layernorm_rows_kernel[(triton.cdiv(M, ROWS_BLOCK_M), triton.cdiv(K, block_k))](
        x2, weight, bias, y, stats if stats is not None else y, M, eps, x2.stride(0), x2.stride(1), y.stride(0),
        stats.stride(0) if stats is not None else 0, K=K, LN_STATS=stats is not None,
        GROUPS_POW2=triton.next_power_of_2(triton.cdiv(K, STATS_GROUP)), USE_PDL=pdl, BLOCK_M=ROWS_BLOCK_M,
        BLOCK_K=block_k, launch_pdl=pdl, num_warps=4,
    )
    return y


def _launch(x, residual, weight, bias, eps, out, sum_out):
    check_tensor("x", x, min_ndim=1, last_contiguous=True)
    check_device_usable("x", x)
    N = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        check_tensor(name, t, ndim=1, device=x.device)
        check_shape(name, t, (N,))
    if N > 8192:
        raise ValueError(f"x: expected a last dim of at most 8192, got {N}")
    x2 = x.reshape(-1, N)
    M = x2.shape[0]
    y = out if out is not None else x.new_empty(x.shape)
    check_tensor("out", y, device=x.device, dtypes=(x.dtype,))
    check_shape("out", y, x.shape)
    y2 = y.view(-1, N)
    if residual is not None:
        check_tensor("residual", residual, device=x.device, dtypes=(x.dtype,), last_contiguous=True)
        check_shape("residual", residual, x.shape)
        r2 = residual.reshape(-1, N)
        s = sum_out if sum_out is not None else x.new_empty(x.shape)
        check_shape("sum_out", s, x.shape)
        s2 = s.view(-1, N)
    else:
        r2, s, s2 = x2, None, y2
    BLOCK_N = triton.next_power_of_2(N)
    # small rows: several per program so each program still moves a few KB
    rows = max(1, min(16, 4096 // BLOCK_N))
    num_warps = 4 if BLOCK_N <= 1024 else 8
    grid = (triton.cdiv(M, rows),)
    _layernorm_kernel[grid](
        x2, r2, weight, bias, y2, s2, M, N, eps,
        x2.stride(0), r2.stride(0), y2.stride(0), s2.stride(0),
        HAS_RESIDUAL=residual is not None, ROWS_PER_PROG=rows, BLOCK_N=BLOCK_N, num_warps=num_warps,
    )
    return y, s


def layernorm(x, weight, bias, eps=1e-5, out=None):
    """LayerNorm of `x` (..., N) over N with fp32 statistics; output in x's dtype."""
    return _launch(x, None, weight, bias, eps, out, None)[0]


def add_layernorm(x, residual, weight, bias, eps=1e-5, out=None, sum_out=None):
    """h = x + residual; returns (h, layernorm(h)) from one pass over the data."""
    y, s = _launch(x, residual, weight, bias, eps, out, sum_out)
    return s, y
