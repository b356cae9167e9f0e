"""Activation functions: the @triton.jit helpers that linear's epilogue switches between, and an
elementwise GELU kernel on its own (the seeds' classic kernel; the benchmark uses it)."""
import torch
import triton
import triton.language as tl

from ._checks import check_device_usable, check_tensor
from ._tuning import launch

ACTIVATIONS = (None, "gelu_tanh", "gelu", "relu", "leaky_relu")


@triton.jit
def _gelu_tanh(x):
    # 0.5 * x * (1 + tanh(u)) == x * sigmoid(2u): no cancellation in 1 + tanh(u) for x << 0
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # sqrt(2/pi)
    # -2 * log2(e): exp via exp2; the clamp keeps exp2 finite where the result is ~0 anyway
    return x / (1.0 + tl.exp2(tl.minimum(-2.8853900817779268 * u, 126.0)))


@triton.jit
def _gelu_erf(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))  # 1/sqrt(2)


@triton.jit
def _apply_activation(y, negative_slope, ACTIVATION: tl.constexpr):
    if ACTIVATION == "gelu_tanh":
        y = _gelu_tanh(y)
    elif ACTIVATION == "gelu":
        y = _gelu_erf(y)
    elif ACTIVATION == "relu":
        y = tl.maximum(y, 0.0)
    elif ACTIVATION == "leaky_relu":
        y = tl.where(y >= 0.0, y, y * negative_slope)
    return y


@triton.jit
def _gelu_kernel(x_ptr, y_ptr, n, APPROXIMATE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = _apply_activation(x, 0.0, "gelu_tanh" if APPROXIMATE == "tanh" else "gelu")
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def gelu(x, approximate="tanh"):
    """GELU of every element; approximate "tanh" (GPT-2's gelu_new) or "none" (erf)."""
    check_tensor("x", x)
    check_device_usable("x", x)
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate: expected 'tanh' or 'none', got {approximate!r}")
    xc = x.contiguous()
    y = torch.empty_like(xc)
    n = xc.numel()
    if n:
        BLOCK = 1024
        launch(_gelu_kernel, (triton.cdiv(n, BLOCK),), xc, y, n, APPROXIMATE=approximate, BLOCK=BLOCK, num_warps=4)
    return y
