"""Row softmax over the last dim: one row per program, held whole in SRAM, fp32 math."""
import torch
import triton
import triton.language as tl

from ._checks import check_device_usable, check_tensor
from ._tuning import launch

MAX_N = 1 << 17


@triton.jit
def _softmax_kernel(x_ptr, y_ptr, N, stride_xm, stride_ym, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=float("-inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)  # subtract the max: exp never overflows
    e = tl.exp2(x * 1.4426950408889634)  # log2(e): exp via exp2
    y = e / tl.sum(e, axis=0)
    tl.store(y_ptr + row * stride_ym + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def softmax(x):
    """softmax over the last dim of x (any leading dims); output in x's dtype."""
    check_tensor("x", x, min_ndim=1, last_contiguous=True)
    check_device_usable("x", x)
    N = x.shape[-1]
    if not 1 <= N <= MAX_N:
        raise ValueError(f"x: expected a last dim from 1 to {MAX_N}, got {N}")
    x2 = x.reshape(-1, N)
    y = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        BLOCK_N = triton.next_power_of_2(N)
        num_warps = 4 if BLOCK_N <= 2048 else (8 if BLOCK_N <= 8192 else 16)
        launch(_softmax_kernel, (x2.shape[0],), x2, y, N, x2.stride(0), y.stride(0), BLOCK_N=BLOCK_N,
               num_warps=num_warps)
    return y.view(x.shape)
