"""kernels/kth_search.py: the bit-by-bit search of ordered words, in a one-program test kernel,
against torch.topk and counts in torch. Exact k-th largest words (limit = k), early cuts (limit >
k: between k and limit words at or above, unless ties forbid it), with bounds from the scores or
none, over random, clustered, tied, signed-zero and infinite scores; one bit a count and two
(TWO_BITS, from above 1,023 counted words down)."""
import pytest
import torch
import triton
import triton.language as tl

from kernels.argmax_key import _ordered, ordered_words
from kernels.kth_search import _kth_search, _words

BLOCK = 2048


@triton.jit
def _search_kernel(x_ptr, out_ptr, N, k, limit, lo_word, BOUNDS: tl.constexpr, TWO_BITS: tl.constexpr,
                   BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    valid = offs < N
    u = _words(_ordered(tl.load(x_ptr + offs, mask=valid, other=float("nan"))))
    if BOUNDS:  # lo from the caller (a word with at least k at or above it), hi the maximum
        hi = tl.max(tl.where(valid, u, 0), axis=0)
        t, cnt = _kth_search(u, valid, k, lo_word.to(tl.uint32, bitcast=True), hi, -1, limit, TWO_BITS)
    else:
        t, cnt = _kth_search(u, valid, k, tl.full((), 0, tl.uint32), tl.full((), 4294967295, tl.uint32), -1, limit,
                             TWO_BITS)
    tl.store(out_ptr, t.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 1, cnt)


def _words_of(x):
    """The kernel's uint32 words of fp32 x, as int64 (the same order as the floats)."""
    return ordered_words(x).long() + 2 ** 31


def _search(x, k, limit, lo, two_bits):
    out = torch.full((2,), -7, dtype=torch.int32, device=x.device)  # poisoned
    lo_word = 0 if lo is None else int(lo) - (2 ** 32 if lo >= 2 ** 31 else 0)
    _search_kernel[(1,)](x, out, x.numel(), k, limit, lo_word, BOUNDS=lo is not None, TWO_BITS=two_bits,
                         BLOCK=BLOCK)
    t, cnt = out.tolist()
    return t & 0xFFFFFFFF, cnt


def _scores(kind, n, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if kind == "clustered":  # GPT-2's logits: one sign, one exponent for most of them
        x = x * 2.5 - 90.0
    elif kind == "tied":
        x = (x * 2).round() / 2
    elif kind == "signed zeros":
        x = torch.where(x.abs() < 1.0, torch.where(x < 0, -0.0, 0.0), x)
    elif kind == "infinite":
        x[::3] = float("-inf")
        x[5] = float("inf")
    return x.to(device)


@pytest.mark.parametrize("kind", ["random", "clustered", "tied", "signed zeros", "infinite"])
@pytest.mark.parametrize("n", [1500, 97])  # 1,500: counts start above the two-bit form's 1,023
@pytest.mark.parametrize("two_bits", [False, True])
def test_kth_search(kind, n, two_bits, device):
    x = _scores(kind, n, device, seed=n)
    u = _words_of(x)
    for k in sorted({1, 7, 50, n}):
        if k > n:
            continue
        kth = int(torch.topk(u, k).values[-1])
        lo = int(torch.topk(u, min(2 * k, n)).values[-1])  # a bound below the k-th
        for bounds in (None, lo):
            t, cnt = _search(x, k, k, bounds, two_bits)
            assert cnt == int((u >= t).sum()) and cnt >= k, (kind, k, t, cnt)
            assert int(u[u >= t].min()) == kth, (kind, k)  # the k-th word: the least at or above t
            for limit in (k + 8, 64 + k):
                t, cnt = _search(x, k, limit, bounds, two_bits)
                assert cnt == int((u >= t).sum()) and cnt >= k, (kind, k, limit, t, cnt)
                # at most limit at or above the cut, unless the search ended on the k-th itself
                assert cnt <= limit or t == kth, (kind, k, limit, t, cnt)
