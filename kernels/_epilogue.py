"""The fp32-accumulator epilogue shared by linear's tile kernel and the decode GEMV kernel."""
import triton
import triton.language as tl

from .activations import _apply_activation


@triton.jit
def _epilogue(acc, bias_ptr, res_ptr, y_ptr, rm, rn, tile_mask, n_mask, stride_rm, stride_ym,
              negative_slope, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr):
    """y = act(acc + bias) + residual, stored in y's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    acc = _apply_activation(acc, negative_slope, ACTIVATION)
    if HAS_RESIDUAL:
        acc += tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :], mask=tile_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=tile_mask)
