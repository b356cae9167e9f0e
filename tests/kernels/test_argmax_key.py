"""Argmax keys (kernels/argmax_key.py): the Triton packing equals the torch one, keys order as
(value, then lower index), and decoding them gives torch.argmax, awkward values included."""
import pytest
import torch
import triton
import triton.language as tl

from kernels import argmax_key
from kernels.argmax_key import EMPTY, _argmax_key, _key_index, argmax_index, row_keys

AWKWARD = [0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0, 6e-8, -6e-8, float("inf"), float("-inf"), 3.5, -3.5]


@triton.jit
def _keys_kernel(v_ptr, i_ptr, key_ptr, back_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    key = _argmax_key(tl.load(v_ptr + offs, mask=mask), tl.load(i_ptr + offs, mask=mask))
    tl.store(key_ptr + offs, key, mask=mask)
    tl.store(back_ptr + offs, _key_index(key), mask=mask)


def _pairs(n, device):
    """Values with many exact ties (fp16-rounded, awkward ones mixed in) and random indices."""
    g = torch.Generator().manual_seed(n)
    v = (torch.randn(n, generator=g) * 4).half().float()
    v[: len(AWKWARD)] = torch.tensor(AWKWARD)
    v[len(AWKWARD): 2 * len(AWKWARD)] = torch.tensor(AWKWARD)  # every awkward value twice
    i = torch.randint(0, 2 ** 31 - 1, (n,), generator=g, dtype=torch.int32)
    i[:3] = torch.tensor([0, 1, 2 ** 31 - 1], dtype=torch.int32)
    return v.to(device), i.to(device)


def test_triton_keys_order_like_value_then_lower_index(device):
    n = 300
    v, i = _pairs(n, device)
    keys = torch.full((n,), 7, dtype=torch.int64, device=device)  # poison
    back = torch.full((n,), -1, dtype=torch.int64, device=device)
    _keys_kernel[(triton.cdiv(n, 128),)](v, i, keys, back, n, BLOCK=128)
    keys, back, v, i = keys.cpu(), back.cpu(), v.cpu().double(), i.cpu().long()
    assert torch.equal(back, i)
    assert (keys > EMPTY).all()
    greater = keys[:, None] > keys[None, :]
    expect = (v[:, None] > v[None, :]) | ((v[:, None] == v[None, :]) & (i[:, None] < i[None, :]))
    assert torch.equal(greater, expect)  # -0.0 == 0.0, so the lower index wins between them
    assert torch.equal(keys >> 32, row_keys(v.float()[:, None]) >> 32)  # the torch packing's value word


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_row_keys_decode_to_torch_argmax_but_nan_rows(dtype, device):
    g = torch.Generator().manual_seed(3)
    y = torch.randn(9, 257, generator=g).to(dtype)
    y[1] = -torch.rand(257, generator=g).to(dtype) - 1  # all negative
    y[2, [5, 100, 200]] = 50.0  # tied maxima
    y[3] = 0.0
    y[3, 7] = -0.0  # signed zeros tie: the lower index
    y[3, 2] = -1.0
    y[4] = float("-inf")
    y[4, 250] = -1e4
    y[5, 31] = float("inf")
    y[6, [9, 40]] = float("nan")  # a NaN row names no token: index N (torch's argmax: 9)
    y = y.to(device)
    keys = row_keys(y)
    expect = y.argmax(dim=-1)
    expect[6] = 257
    assert torch.equal(argmax_index(keys), expect)
    assert argmax_index(keys)[3] == 0 and (keys[6] > keys).sum() == 8  # the NaN key ranks above all


def test_keys_combine_by_max(device):
    """Column blocks' keys max-ed in any order give the whole row's key."""
    y = torch.randn(4, 96, device=device).half()
    y[:, 70] = y[:, 10] = 9.0
    combined = torch.full((4,), EMPTY, dtype=torch.int64, device=device)
    for c in (64, 0, 32):
        k = row_keys(y[:, c:c + 32])
        k = (k >> 32 << 32) | (argmax_key.INDEX_BITS - (argmax_index(k) + c))  # the block's index made global
        combined = torch.maximum(combined, k)
    assert torch.equal(combined, row_keys(y)) and (argmax_index(combined) == 10).all()
