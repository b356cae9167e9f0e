"""Argmax keys (kernels/argmax_key.py): the Triton packing equals the torch one, keys order as
(value, then lower index), and decoding them gives torch.argmax, awkward values included; the
keys from `linear`'s fused argmax (decode GEMV and prefill rows), keys only, and NaN rows."""
import pytest
import torch
import triton
import triton.language as tl

import kernels
from kernels import argmax_key, gemv
from kernels.argmax_key import EMPTY, _argmax_key, _key_index, argmax_index, row_keys
from tests.conftest import ON_GPU
from tests.kernels.helpers import gemv_cfg, poisoned, randn

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


@pytest.mark.parametrize("M,N,cfg", [
    (1, 300, None), (5, 300, gemv_cfg(chunks=2)),
    (20, 1100, gemv_cfg(block_n=16)),  # 69 column blocks, each max-ing its keys in
    (70, 300, None),  # prefill rows: torch's argmax after the tile kernel
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_fused_argmax(M, N, cfg, dtype, device):
    """argmax_keys holds torch.argmax of the stored logits, ties included (lowest index), and
    combines with keys already there (a second launch on the same keys changes nothing)."""
    if N > 1000 and dtype == torch.float16 and not ON_GPU:
        pytest.skip("interpreter time: the wide case runs in fp32 only")
    K = 16 if N > 1000 else 40  # (the interpreter runs every program)
    x = randn(M, K, dtype=dtype, device=device)
    w = randn(K, N, dtype=dtype, device=device, scale=K ** -0.5)
    bias = randn(N, dtype=dtype, device=device)
    tied = [3, 4, N // 2, N - 7]  # across column blocks and reduction chunks
    # x and the tied column on a grid of 1/8, so their products add up exactly in any order: the
    # interpreter's fp32 products are numpy's, whose summation order follows a column's position
    x = (x * 8).round() / 8
    w[:, 3] = (w[:, 3] * 8).round() / 8
    w[:, tied] = w[:, 3:4]
    bias[tied] = 100.0  # row maxima, equal after rounding: the lowest index must win
    keys = torch.full((M,), argmax_key.EMPTY, dtype=torch.int64, device=device)
    y = kernels.linear(x, w, bias, argmax_keys=keys, _config=cfg)
    tok = argmax_key.argmax_index(keys)
    assert torch.equal(tok, y.argmax(dim=-1))
    assert (y[0] == y[0].max()).sum() >= 2 and tok[0] == 3
    first = keys.clone()
    kernels.linear(x, w, bias, argmax_keys=keys, _config=cfg)
    assert torch.equal(keys, first)
    # keys_only: the same keys from the same rounded logits, and nothing returned
    alone = torch.full((M,), argmax_key.EMPTY, dtype=torch.int64, device=device)
    assert kernels.linear(x, w, bias, argmax_keys=alone, keys_only=True, _config=cfg) is None
    assert torch.equal(alone, first)


@pytest.mark.parametrize("M,cfg", [(5, gemv_cfg(chunks=2)), (20, gemv_cfg(block_n=16, split=False))])
def test_gemv_keys_only_writes_no_output(M, cfg, device):
    """store=False (linear's keys_only) leaves the output untouched, split or looping, and gives
    the keys of the stored launch; keys_only without argmax_keys, or with out, is refused."""
    K, N = 40, 300
    x, w = randn(M, K, device=device), randn(K, N, device=device, scale=K ** -0.5)
    bias = randn(N, device=device)
    keys = torch.full((M,), argmax_key.EMPTY, dtype=torch.int64, device=device)
    y = kernels.linear(x, w, bias, argmax_keys=keys, _config=cfg)
    alone = torch.full((M,), argmax_key.EMPTY, dtype=torch.int64, device=device)
    out = poisoned((M, N), torch.float32, device)
    before = out.clone()
    gemv.gemv(x, w, bias, None, out, None, 1e-5, None, 0.01, argmax_keys=alone, config=cfg, store=False)
    assert torch.equal(out.view(torch.int32), before.view(torch.int32))
    assert torch.equal(alone, keys) and torch.equal(argmax_key.argmax_index(alone), y.argmax(dim=-1))
    with pytest.raises(ValueError, match="keys_only: expected argmax_keys and no out"):
        kernels.linear(x, w, keys_only=True)
    with pytest.raises(ValueError, match="keys_only: expected argmax_keys and no out"):
        kernels.linear(x, w, argmax_keys=alone, keys_only=True, out=out)


@pytest.mark.parametrize("M,cfg", [(5, gemv_cfg(chunks=2)), (20, gemv_cfg(block_n=16)), (70, None)])
def test_linear_fused_argmax_nan_rows_name_no_token(M, cfg, device):
    """A row with a NaN gets index N, no token, in the fused argmax as in the prefill rows'
    torch argmax: row 1 all NaN (through x), then every row with one NaN column (through the
    bias) beside a clear maximum, which a maximum that skips NaN would pick."""
    K, N = 16, 300
    x, w = randn(M, K, device=device), randn(K, N, device=device, scale=K ** -0.5)
    x[1, 3] = float("nan")
    keys = torch.full((M,), argmax_key.EMPTY, dtype=torch.int64, device=device)
    y = kernels.linear(x, w, argmax_keys=keys, _config=cfg)
    expect = y.argmax(dim=-1)
    expect[1] = N
    assert torch.isnan(y[1]).all() and torch.equal(argmax_key.argmax_index(keys), expect)
    bias = randn(N, device=device)
    bias[40], bias[250] = 50.0, float("nan")
    keys.fill_(argmax_key.EMPTY)
    kernels.linear(x, w, bias, argmax_keys=keys, _config=cfg)
    assert (argmax_key.argmax_index(keys) == N).all()
