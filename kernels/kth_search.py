"""The k-th largest of many fp32 scores in one program, by counting: a bit-by-bit search of
their ordered words (argmax_key._ordered as uint32) for the largest t with at least k words
>= t. Each bit costs one count, a reduction over the block; the bits two known bounds share
cost none, and a caller that only needs a cut with between k and `limit` words at or above it
stops as soon as the count falls to `limit`.

The sampler (sampling.py) finds its tiles' cuts and its rows' k-th values this way. Against
tl.topk, which sorts: a tile's 64th largest of 2,048 took about as long either way at one row
(8.6 us for a top-k against 8.0-8.6 for all 32 counts, bench/results/h200/sampler-cut-probe.log),
but the search does a fraction of the work, which counts once the programs outnumber the SMs:
the whole sampler at gpt2 batch 64 took 113 -> 50 us a call on an H200.

TWO_BITS: once the count fits 10 bits, one int32 reduction counts at three thresholds (10-bit
fields), taking two bits a step. The row's search, which runs to the exact k-th word, uses it.
"""
import triton
import triton.language as tl


@triton.jit
def _words(ordered):
    """_ordered's int32 words as uint32 in the same order (the sign bit flipped)."""
    return (ordered ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def _ordered_of(words):
    """The _ordered int32 words of uint32 words (the inverse of _words)."""
    return words.to(tl.int32, bitcast=True) ^ -2147483648


@triton.jit
def _count_at_least(u, counted, t):
    return tl.sum((counted & (u >= t)).to(tl.int32), axis=0)


@triton.jit
def _count3(u, counted, t1, t2, t3):
    """count(u >= t) at t1 <= t2 <= t3 in one int32 reduction, 10 bits a count: each count must
    be below 1024."""
    ind = (u >= t1).to(tl.int32) + ((u >= t2).to(tl.int32) << 10) + ((u >= t3).to(tl.int32) << 20)
    packed = tl.sum(tl.where(counted, ind, 0), axis=0)
    return packed & 1023, (packed >> 10) & 1023, packed >> 20


@triton.jit
def _kth_search(u, counted, k, lo, hi, cnt, limit, TWO_BITS: tl.constexpr = False):
    """A threshold t for words u (the counted lanes), bit by bit from the top: the largest t
    whose count(u >= t) stays >= k, stopping early once that count is at most limit. lo and hi
    bound the k-th largest word (count(u >= lo) >= k), so the bits they share are taken without
    counting; cnt is count(u >= lo's and hi's shared bits), or -1 to count it here. Returns
    (t, count(u >= t)); t is the k-th largest word itself if the search ran to the last bit. A
    count is a reduction over all of u: starting at the first bit lo and hi differ and stopping
    early skip most of the 32."""
    bit = tl.full((), 2147483648, tl.uint32)
    t = tl.full((), 0, tl.uint32)
    diff = lo ^ hi
    while (bit != 0) & ((diff & bit) == 0):
        t = t | (hi & bit)
        bit = bit >> 1
    if cnt < 0:
        cnt = _count_at_least(u, counted, t)
    while (bit != 0) & (cnt > limit):
        if TWO_BITS and (bit > 1) & (cnt < 1024):  # two bits a reduction once the counts fit 10 bits
            half = bit >> 1
            c1, c2, c3 = _count3(u, counted, t | half, t | bit, t | bit | half)
            t = tl.where(c3 >= k, t | bit | half, tl.where(c2 >= k, t | bit, tl.where(c1 >= k, t | half, t)))
            cnt = tl.where(c3 >= k, c3, tl.where(c2 >= k, c2, tl.where(c1 >= k, c1, cnt)))
            bit = bit >> 2
        else:
            trial = t | bit
            c = _count_at_least(u, counted, trial)
            t = tl.where(c >= k, trial, t)
            cnt = tl.where(c >= k, c, cnt)
            bit = bit >> 1
    return t, cnt
