"""LayerNorm over the last dim, optionally fused with the residual add that precedes it (or
without gain and shift: standardize).

One program normalizes ROWS_PER_PROG rows held whole in registers (hidden sizes up to 8192):
one read of x (and the residual), one write of y (and of the sum), fp32 statistics.
"""
import triton
import triton.language as tl

from ._checks import check_device_usable, check_shape, check_tensor
from ._tuning import launch


@triton.jit
def _layernorm_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, sum_ptr,
    M, N, eps,
    stride_xm, stride_rm, stride_ym, stride_sm,
    HAS_RESIDUAL: tl.constexpr,
    AFFINE: tl.constexpr,
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
    y = xc * rstd[:, None]
    if AFFINE:
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = y * w[None, :] + b[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, bias, eps, out, sum_out, affine=True):
    check_tensor("x", x, min_ndim=1, last_contiguous=True)
    check_device_usable("x", x)
    N = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)) if affine else ():
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
    launch(
        _layernorm_kernel, grid, x2, r2, weight if affine else x2, bias if affine else x2, y2, s2, M, N, eps,
        x2.stride(0), r2.stride(0), y2.stride(0), s2.stride(0),
        HAS_RESIDUAL=residual is not None, AFFINE=affine, ROWS_PER_PROG=rows, BLOCK_N=BLOCK_N, num_warps=num_warps,
    )
    return y, s


def layernorm(x, weight, bias, eps=1e-5, out=None):
    """LayerNorm of `x` (..., N) over N with fp32 statistics; output in x's dtype."""
    return _launch(x, None, weight, bias, eps, out, None)[0]


def standardize(x, eps=1e-5):
    """(x - mean) / sqrt(var + eps) over the last dim: a layernorm without gain and shift, the
    half of a folded layernorm that prefill rows run apart (linear's ln_fold)."""
    return _launch(x, None, None, None, eps, None, None, affine=False)[0]


def add_layernorm(x, residual, weight, bias, eps=1e-5, out=None, sum_out=None):
    """h = x + residual; returns (h, layernorm(h)) from one pass over the data."""
    y, s = _launch(x, residual, weight, bias, eps, out, sum_out)
    return s, y
