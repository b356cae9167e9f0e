"""Fixed-point hand-off between decode kernels: split-K without a merge.

A decode linear cut into K-chunks (one program each, for bytes in flight) must add the chunks'
fp32 partials. Done in the producer, that is a merge (partials out, an arrival counter, the
last program reads them back): about 2 us of dependent round trips per linear on an H200.
Here every chunk instead converts its partial to a fixed-point int64, units of 2**-32, and
adds it into the output row with a relaxed atomic that nobody waits for. Integer addition
is associative, so the sum is exact and the same in any arrival order: deterministic, and a
row's bits do not depend on the batch or on how K is split into programs.

The output is then "pending": bias, activation, residual and the rounding to the model's
dtype are applied by the kernel that reads it (`Pending`), right after its wait, and that
kernel also stores the finished values where they are needed again (the residual stream).
An int64 row is added into, so it must be zero before its producer runs: each is cleared by
the launch after its reader (`clear=`), the kernel boundary orders the rest.

Range: |partial| < 2**31 (any fp16 value; fp32 activations past 2e9 would wrap). Resolution
2**-32 per chunk, finer than fp16's spacing everywhere and than fp32's above 1e-3 in size.
"""
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ._checks import check_shape, check_tensor

FIXED_ONE = 4294967296.0  # 2**32: one unit of the fixed-point rows
CLEAR_BLOCK = tl.constexpr(256)  # int64 elements a program zeroes per store


class Pending(NamedTuple):
    """Values act(acc * 2**-32 + bias) + residual that a decode linear left as the int64 sums
    `acc` (its `acc_out`), not yet finished: the reading kernel finishes them in its prologue,
    rounded to `dtype`, and stores them into `out` when given."""
    acc: torch.Tensor  # int64 (M, N)
    bias: Optional[torch.Tensor] = None  # (N,)
    activation: Optional[str] = None
    residual: Optional[torch.Tensor] = None  # (M, N)
    out: Optional[torch.Tensor] = None  # (M, N), contiguous

    @property
    def dtype(self):
        for t in (self.out, self.residual, self.bias):
            if t is not None:
                return t.dtype
        raise ValueError("x: a Pending needs at least one of bias, residual, out (they give its dtype)")


def check_pending(name, p, activations):
    """A launcher's check of a Pending argument; returns its acc as (M, N)."""
    check_tensor(f"{name}.acc", p.acc, ndim=2, dtypes=(torch.int64,), last_contiguous=True)
    M, N = p.acc.shape
    device = p.acc.device
    dtype = p.dtype
    if p.activation not in activations:
        raise ValueError(f"{name}.activation: expected one of {activations}, got {p.activation!r}")
    if p.bias is not None:
        check_tensor(f"{name}.bias", p.bias, ndim=1, dtypes=(dtype,), device=device)
        check_shape(f"{name}.bias", p.bias, (N,))
    for part in ("residual", "out"):
        t = getattr(p, part)
        if t is not None:
            check_tensor(f"{name}.{part}", t, ndim=2, dtypes=(dtype,), device=device, last_contiguous=True)
            check_shape(f"{name}.{part}", t, (M, N))
    if p.out is not None and p.residual is not None and p.out.data_ptr() == p.residual.data_ptr():
        raise ValueError(f"{name}.out: expected a tensor other than {name}.residual (other programs still read it)")
    return p.acc


def check_clear(clear, rows, device):
    """A launcher's check of `clear`: an int64 (rows, n) row block to zero after the wait."""
    if clear is not None:
        check_tensor("clear", clear, ndim=2, dtypes=(torch.int64,), device=device, last_contiguous=True)
        if clear.shape[0] != rows:
            raise ValueError(f"clear: expected {rows} rows, got shape {tuple(clear.shape)}")


@triton.jit
def _to_fixed(v):
    """fp32 -> int64 in units of 2**-32, truncated toward zero (exact for |v| >= 1)."""
    return (v * 4294967296.0).to(tl.int64)


@triton.jit
def _from_fixed(a):
    """int64 sums -> fp32 (one rounding; the scaling by 2**-32 is exact)."""
    return a.to(tl.float32) * 2.3283064365386963e-10


@triton.jit
def _clear_rows(clr_ptr, rows, n_cols, stride_cm, program, programs, BLOCK: tl.constexpr):
    """Zero clr[:rows, :n_cols], the launch's programs sharing the elements in BLOCK pieces."""
    offs = tl.arange(0, BLOCK)
    total = rows * n_cols
    for start in range(program * BLOCK, total, programs * BLOCK):
        idx = start + offs
        tl.store(clr_ptr + (idx // n_cols) * stride_cm + idx % n_cols, tl.zeros((BLOCK,), dtype=tl.int64),
                 mask=idx < total)
