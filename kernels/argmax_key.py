"""Greedy decoding's argmax as one int64 key per row, so that programs holding different columns
of a row combine their maxima with a single relaxed atomic max, in any order, with nobody
waiting: no partials, no arrival counter, no last program reducing them.

A key orders by value first, then by the lower column index (ties go to the lowest index, as
torch.argmax):

    key = ordered(value) << 32 | (2**31 - 1 - index)

ordered() maps an fp32 value to an int32 with the same order: the bits of a positive float
already order as integers; a negative float's lower 31 bits count the wrong way, so they are
flipped. -0.0 is taken as +0.0 (the two tie in torch).

A row that holds a NaN names no token: its key has the NaN value word (above every other) and
the index N, the row's length, whichever column the NaN is in. So the runtime sees NaN logits
as an id outside the vocabulary (minillm.checks.check_vocab) instead of a token picked from
them (torch's argmax returns a NaN's index). The one-row vocabulary head (vocab_fma.py) tells
such a row by its folded layernorm's statistics only (the model's lm_head always has one, and
the loader refuses weights that are not finite).

EMPTY is below every key: a key buffer holds it before the lm_head's launch, and whoever reads
the keys (append_tokens) resets it.
"""
import torch
import triton
import triton.language as tl

EMPTY = -(2 ** 63)
INDEX_BITS = 2 ** 31 - 1  # indices 0 .. 2**31 - 1; the low word stores INDEX_BITS - index


@triton.jit
def _ordered(value):
    """fp32 values as int32 words in the same order (NaN above everything, -0.0 as +0.0)."""
    bits = value.to(tl.int32, bitcast=True)
    bits = tl.where(value == 0.0, 0, bits)
    bits = tl.where(value != value, 2147483647, bits)  # NaN
    return tl.where(bits < 0, bits ^ 2147483647, bits)


@triton.jit
def _from_ordered(ordered):
    """The fp32 values of _ordered words (flipping the lower 31 bits back is the same xor)."""
    return tl.where(ordered < 0, ordered ^ 2147483647, ordered).to(tl.float32, bitcast=True)


@triton.jit
def _argmax_key(value, index):
    """Keys of fp32 values at int32 column indices (elementwise)."""
    return (_ordered(value).to(tl.int64) << 32) | (2147483647 - index).to(tl.int64)


@triton.jit
def _no_token_if_nan(vmax, index, has_nan, N):
    """(value, index) of a row's maximum with NaN rows made (NaN, N): a row's key names no token
    if any of its values is NaN (a maximum over values with a NaN may skip it)."""
    return tl.where(has_nan, float("nan"), vmax), tl.where(has_nan, N, index)


@triton.jit
def _empty_keys(BLOCK: tl.constexpr):
    """BLOCK keys of EMPTY (-2**63: -1 shifted into the sign bit)."""
    return tl.full((BLOCK,), -1, tl.int64) << 63


@triton.jit
def _key_index(key):
    """The column index a key holds."""
    return 2147483647 - (key & 2147483647)


def row_keys(y):
    """Keys of the argmax of each row of y (..., N), in torch: for rows no fused kernel covers.
    A row with a NaN gets index N (no token), as the fused kernels give it."""
    index = y.argmax(dim=-1)  # the first index among equal maxima (a NaN's, in a NaN row)
    value = y.gather(-1, index[..., None])[..., 0].float()
    index = torch.where(torch.isnan(value), y.shape[-1], index)
    return (ordered_words(value).long() << 32) | (INDEX_BITS - index)


def ordered_words(value):
    """_ordered in torch: fp32 values as int32 words in the same order (NaN above everything,
    -0.0 as +0.0)."""
    value = torch.where(value == 0, torch.zeros_like(value), value)
    bits = value.view(torch.int32)
    bits = torch.where(torch.isnan(value), torch.full_like(bits, INDEX_BITS), bits)
    return torch.where(bits < 0, bits ^ INDEX_BITS, bits)


def argmax_index(keys):
    """Column indices (int64) from keys (no EMPTY among them)."""
    return INDEX_BITS - (keys & INDEX_BITS)
