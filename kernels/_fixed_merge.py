"""The one-atomic merge of split partial sums, shared by the kernels whose programs split a dot
product and meet on the output (decode_attention_proj's heads, the decode GEMV's K chunks).

Each program adds its fp32 partial to one int64 word per output element, in fixed point (units
of 2**-24), with an arrival count in the same word, by one atomic that returns the word. Integer
sums do not depend on the order. The program that brings an element's count to the number of
parts holds the element's whole sum and finishes it (its epilogue), then zeroes the word for the
next launch. Storing partials, passing an arrival counter and reading the partials back took
three round trips; this is one. Handed off (PendingRow), the programs add without waiting for
the word, and the next launch finishes the elements after its wait.

A word: bits 0-51 the partials, each in units of 2**-24 and raised by FIXED_OFFSET (so each
adds less than 2**46, and up to 63 parts stay below bit 52); bits 52-57 the parts that arrived;
bits 58-63 the parts whose partial was not finite or not below FIXED_LIMIT (the element comes
out NaN then).
"""
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ._checks import check_shape, check_tensor

FIXED_SCALE = tl.constexpr(float(1 << 24))
FIXED_UNIT = tl.constexpr(1.0 / FIXED_SCALE.value)
FIXED_OFFSET = tl.constexpr(1 << 45)
FIXED_LIMIT = tl.constexpr(FIXED_OFFSET.value / FIXED_SCALE.value)  # 2**21
ARRIVE_SHIFT = tl.constexpr(52)
UNFIT_SHIFT = tl.constexpr(58)
ARRIVAL = tl.constexpr(1 << ARRIVE_SHIFT.value)
UNFIT = tl.constexpr(1 << UNFIT_SHIFT.value)
SUMS_MASK = tl.constexpr(ARRIVAL.value - 1)
ARRIVE_MASK = tl.constexpr((1 << (UNFIT_SHIFT.value - ARRIVE_SHIFT.value)) - 1)  # the count's 6 bits
MAX_FIXED_PARTS = ARRIVE_MASK.value


class PendingRow(NamedTuple):
    """Rows x = residual + bias + (the sums of `parts` partials in `words`) that one launch leaves
    unfinished for the next (decode_attention_proj's hand_off): its programs add their partials
    without waiting for the sum, and the reader (linear, on the CUDA-core GEMV) finishes the rows
    as the merge's epilogue would, bit for bit, and stores them into `store`. The linear given the
    pending row as its residual reads `store` and zeroes `words` for the next launch."""
    words: torch.Tensor  # (B, N) int64, contiguous
    parts: int
    bias: Optional[torch.Tensor]  # (N,)
    residual: torch.Tensor  # (B, N), the rows before the sums
    store: torch.Tensor  # (B, N) like residual, contiguous: receives the finished rows


def check_pending(name, row, device):
    """A launcher's check of a PendingRow argument; returns it."""
    if not isinstance(row.parts, int) or not 1 <= row.parts <= MAX_FIXED_PARTS:
        raise ValueError(f"{name}.parts: expected an int in [1, {MAX_FIXED_PARTS}], got {row.parts!r}")
    res = check_tensor(f"{name}.residual", row.residual, ndim=2, device=device, last_contiguous=True)
    for field in ("words", "store"):
        t = getattr(row, field)
        check_tensor(f"{name}.{field}", t, ndim=2, dtypes=(torch.int64,) if field == "words" else (res.dtype,),
                     device=device)
        check_shape(f"{name}.{field}", t, res.shape)
        if not t.is_contiguous():
            raise ValueError(f"{name}.{field}: expected a contiguous tensor")
    if row.bias is not None:
        check_tensor(f"{name}.bias", row.bias, ndim=1, device=device)
        check_shape(f"{name}.bias", row.bias, res.shape[1:])
    return row


@triton.jit
def _fixed_word(part):
    """This program's word for its partial (any shape): what it adds into each element's word."""
    fits = tl.abs(part) < FIXED_LIMIT  # False for NaN and inf too
    units = (tl.where(fits, part, 0.0) * FIXED_SCALE).to(tl.int64)  # exact scaling, then truncation
    return tl.where(fits, units + (FIXED_OFFSET + ARRIVAL), ARRIVAL + UNFIT)


@triton.jit
def _fixed_sums(total, PARTS: tl.constexpr):
    """The fp32 sums of words that hold all PARTS partials (NaN where one did not fit)."""
    field = (total & SUMS_MASK) - PARTS * FIXED_OFFSET
    sums = field.to(tl.float32) * FIXED_UNIT  # one rounding; the scaling is exact
    return tl.where((total >> UNFIT_SHIFT) != 0, float("nan"), sums)


@triton.jit
def _add_fixed(part, words, mask, PARTS: tl.constexpr):
    """Adds this program's partial (any shape) into its elements' fixed-point words (one
    returning atomic each). Returns the elements' sums, in fp32, and which of them this program
    completed: those where it was the PARTS-th to arrive (the sums of the others lack parts:
    mask them); it leaves their words zero for the next launch."""
    word = _fixed_word(part)
    total = tl.atomic_add(words, word, mask=mask, sem="relaxed") + word
    done = mask & (((total >> ARRIVE_SHIFT) & ARRIVE_MASK) == PARTS)
    tl.store(words, tl.zeros_like(total), mask=done)  # after our atomic on the same word: in order
    return _fixed_sums(total, PARTS), done
