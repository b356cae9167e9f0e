"""The Gluon kernels of scripts/probe_pdl_ring.py: one batch-1 linear as one program an SM that
streams its share of the weight tiles through a TMA ring in shared memory, with the ring's
first tiles asked for BEFORE the dependent-launch wait. Two forms of the products: CUDA cores
(ring_linear_kernel, here) and tensor cores (ring_linear_mma_kernel, pdl_ring_mma_kernels.py);
the layernorm statistics both take (_row_load, _row_stats) and int32 words' guard. Each layer's
decode attention between them: pdl_attention_kernels.py.

A launch that takes at most about half of an SM's shared memory and registers leaves room for
the next launch's program, launched early by programmatic dependent launch, which asks for its
own first tiles while this one works: the weights stream on across the boundary, which the
hardware's grid dependency handles (no counters in global memory, unlike the one persistent
launch of scripts/stream_step_kernels.py)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels._fixed_merge import FIXED_SCALE, FIXED_UNIT
from stream_step_kernels import BK, _barrier, _tma_load

# Triton 3.6's Gluon names a shared-memory view's reinterpretation with a leading underscore
if not hasattr(gl.shared_memory_descriptor, "reinterpret"):
    gl.shared_memory_descriptor.reinterpret = gl.shared_memory_descriptor._reinterpret

# what a mode changes (bits; 0 is the chain, the only one whose values are right)
NO_WAIT, LATE_TRIGGER, NO_MATH, NO_X = gl.constexpr(1), gl.constexpr(2), gl.constexpr(4), gl.constexpr(8)


@gluon.jit
def _ask_tile(desc, ring, bars, row0, t, slot, KT: gl.constexpr, BN: gl.constexpr):
    """Ask for tile t (row block t // KT, K chunk t % KT) of the phase whose rows start at row0."""
    bar = bars.index(slot)
    mbarrier.expect(bar, desc.block_type.nbytes)
    _tma_load(desc, [row0 + (t // KT) * BN, (t % KT) * BK], bar, ring.index(slot))


@gluon.jit
def _reg_tile(w_ptr, ld, slab_rows, row0, t, valid, K, KT: gl.constexpr, BN: gl.constexpr, blk: gl.constexpr):
    """Tile t into registers by plain loads (zeros past K and past the slab's rows, or where the
    program has no such tile)."""
    r = row0 + (t // KT) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, blk))
    c = (t % KT) * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, blk))
    m = ((r < slab_rows) & valid)[:, None] & (c < K)[None, :]
    return gl.load(w_ptr + r.to(gl.int64)[:, None] * ld + c[None, :], mask=m, other=0.0)


@gluon.jit
def _x_row(t, j, KT: gl.constexpr, XS: gl.constexpr):
    """The row of staged x that tile t (the share's j-th) reads: by K chunk or by tile."""
    if XS == KT:
        r = t % KT
    else:
        r = j
    return r


@gluon.jit
def _add_tile(acc, w, xs, t, j, n, y_ptr, N, rows, KT: gl.constexpr, XS: gl.constexpr, BN: gl.constexpr,
              blk: gl.constexpr, MODE: gl.constexpr):
    """acc plus tile t's products with its x chunk; at the end of a run of one row block, added
    into y and cleared."""
    if (MODE & NO_MATH) == 0:
        xc = xs.index(_x_row(t, j, KT, XS)).load(gl.SliceLayout(0, blk))
        acc += gl.sum(w.to(gl.float32) * xc[None, :], axis=1)
    if ((t % KT) == KT - 1) | (j == n - 1):
        if (MODE & NO_MATH) == 0:
            out = (t // KT) * BN + rows
            gl.atomic_add(y_ptr + out, acc, mask=out < N, sem="relaxed", scope="gpu")
        acc = gl.zeros_like(acc)
    return acc


@gluon.jit
def ring_linear_kernel(desc, w_ptr, x_ptr, y_ptr, row0, slab_rows, N, K, n_tiles, programs, MODE: gl.constexpr,
                       STAGES: gl.constexpr, BN: gl.constexpr, KT: gl.constexpr, REG: gl.constexpr,
                       XS: gl.constexpr, num_warps: gl.constexpr):
    """y[:N] += W[row0:row0 + N, :K] @ x[:K] over this program's contiguous share of the (BN x BK)
    tiles in (row block, K chunk) order; a run of one row block is added by atomics (y zeroed
    before the chain). The share's first REG tiles (0-2) come into registers, the rest through
    the ring; all asked for before the wait as far as they fit. x is staged by K chunk (XS ==
    KT) or, where the share has fewer tiles than K has chunks, by tile (XS rows)."""
    pid = gl.program_id(0)
    t0 = n_tiles * pid // programs
    n = n_tiles * (pid + 1) // programs - t0
    # a warp owns whole rows of a tile: the sum over K stays inside it
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    ring = gl.allocate_shared_memory(gl.float16, [STAGES, BN, BK], desc.layout)
    xs = gl.allocate_shared_memory(gl.float32, [XS, BK], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES):  # weights never depend on the launch before: ask first
        if REG + s < n:
            _ask_tile(desc, ring, bars, row0, t0 + REG + s, s, KT, BN)
    if REG > 0:
        w0 = _reg_tile(w_ptr, K, slab_rows, row0, t0, n > 0, K, KT, BN, blk)
    if REG > 1:
        w1 = _reg_tile(w_ptr, K, slab_rows, row0, t0 + 1, n > 1, K, KT, BN, blk)
    if (MODE & LATE_TRIGGER) == 0:
        gdc_launch_dependents()  # the next launch's program may take the SM's other half now
    if (MODE & NO_WAIT) == 0:
        gdc_wait()  # the launch before (whose output is x) has ended and its writes are seen
    xcols = gl.arange(0, BK, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))  # (16 warps: twice over)
    for i in gl.static_range(XS if (MODE & NO_X) == 0 else 0):  # x staged once, all loads in flight at once
        if XS == KT:
            xm = i * BK + xcols < K
            xs.index(i).store(gl.load(x_ptr + i * BK + xcols, mask=xm, other=0.0))
        else:
            c = (t0 + i) % KT
            xm = (c * BK + xcols < K) & (i < n)
            xs.index(i).store(gl.load(x_ptr + c * BK + xcols, mask=xm, other=0.0))
    _barrier()
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, blk))
    acc = gl.zeros([BN], gl.float32, gl.SliceLayout(1, blk))  # a tile's sum reduced at once: few registers
    if REG > 0:
        if n > 0:
            acc = _add_tile(acc, w0, xs, t0, 0, n, y_ptr, N, rows, KT, XS, BN, blk, MODE)
    if REG > 1:
        if n > 1:
            acc = _add_tile(acc, w1, xs, t0 + 1, 1, n, y_ptr, N, rows, KT, XS, BN, blk, MODE)
    for j in range(REG, n):
        t = t0 + j
        q = j - REG  # its ring turn
        slot = q % STAGES
        mbarrier.wait(bars.index(slot), (q // STAGES) & 1)
        w = ring.index(slot).load(blk)
        _barrier()  # every warp is done with the slot before the TMA that refills it
        fence_async_shared()
        if j + STAGES < n:
            _ask_tile(desc, ring, bars, row0, t + STAGES, slot, KT, BN)
        acc = _add_tile(acc, w, xs, t, j, n, y_ptr, N, rows, KT, XS, BN, blk, MODE)
    if (MODE & LATE_TRIGGER) != 0:
        gdc_launch_dependents()
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


@gluon.jit
def _add_pairs(a, b, c, d):
    return a + c, b + d


@gluon.jit
def _add_triples(a, b, c, d, e, f):
    return a + d, b + e, c + f


@gluon.jit
def _mean_rstd(s, ss, K, eps):
    """A layernorm's mean and 1 / std from the sum and the sum of squares of its K values (fp32:
    E[x^2] - mean^2 loses nothing at a residual's scale)."""
    mean = s / K
    return mean, gl.rsqrt(gl.maximum(ss / K - mean * mean, 0.0) + eps)


# the int32 words' units: values up to 2**15 (the int64 words': kernels/_fixed_merge's 2**-24).
# Their guard: a part (or a bias) added is below PART32 and a sum has at most MAX_PARTS32 parts,
# so that one launch's sums stay below 2**15; the residual stream, which sums over launches, is
# below READ32 wherever a layernorm reads it, and READ32 + MAX_PARTS32 PART32 <= 2**15, so no
# word wraps between two reads. Whatever breaks a bound raises the flag, at the program's end:
# a program notes the parts it adds that break PART32 as it goes, and the residual stream's
# values beyond READ32 in the reduction that takes its statistics. (Checking every word where it
# is loaded, right after the wait, cost 150 us a step: session 108, call 7; by a predicated
# atomic a value where the value was made, 31-57 us; at the end, 18-32: session 109, calls 2-7.)
SCALE32 = gl.constexpr(float(1 << 16))
UNIT32 = gl.constexpr(1.0 / SCALE32.value)
PART32 = gl.constexpr(float(1 << 11))
READ32 = gl.constexpr(float(1 << 13))
MAX_PARTS32 = int((2 ** 15 - READ32.value) // PART32.value)  # 12
# the kernels' GUARD bits (timing only: each check priced alone), both by default
GUARD_PARTS, GUARD_READS = gl.constexpr(1), gl.constexpr(2)
# FIXED's code for fp32 activations kept on the int32 words' grid (multiples of UNIT32): each part
# and bias truncated onto it before its fp32 atomic, as _to_word truncates an int32 word. A sum
# below 2**8 (2**24 units, fp32's significand) is then exact, so its bits do not depend on the
# order its parts arrive in, with no conversion at the readers; past that it rounds as the fp32
# atomics do (its last bits may vary), but nothing wraps, so it needs no guard
GRID32 = gl.constexpr(1)


@gluon.jit
def _raise_flag(flag_ptr, bad):
    """Sets the int32 flag at flag_ptr where bad holds: a predicated atomic, issued by no lane
    while all is well."""
    one = bad.to(gl.int32)  # a tensor in bad's layout: a pointer and a value a lane
    gl.atomic_or(flag_ptr + one * 0, one, mask=bad, sem="relaxed", scope="gpu")


@gluon.jit
def _act_load(ptr, mask, FIXED: gl.constexpr):
    """Activations as fp32, from fp32 (FIXED 0, GRID32) or from FIXED-bit fixed-point words
    (_to_word's): a word's conversion rounds once, the scaling by a power of two is exact."""
    if FIXED == 64:
        v = gl.load(ptr, mask=mask, other=0).to(gl.float32) * FIXED_UNIT
    elif FIXED == 32:
        v = gl.load(ptr, mask=mask, other=0).to(gl.float32) * UNIT32
    else:
        v = gl.load(ptr, mask=mask, other=0.0)
    return v


@gluon.jit
def _over_part(v, mask, FIXED: gl.constexpr, GUARD: gl.constexpr):
    """Where a part (or a bias) v, added as an int32 word, breaks PART32 (NaN and inf too): the
    caller keeps these and raises the flag at its end; all False where nothing is checked."""
    if (FIXED == 32) & ((GUARD & GUARD_PARTS) != 0):
        over = mask & ~(gl.abs(v) < PART32)
    else:
        over = mask & ~mask
    return over


@gluon.jit
def _to_word(v, FIXED: gl.constexpr):
    """v (fp32) as a FIXED-bit fixed-point word, truncated toward zero (the conversion saturates;
    NaN becomes 0), or (GRID32) as fp32 truncated onto the int32 words' grid (the same value
    where a word holds it; nothing saturates). The int64 words' range (2**39) is left unguarded."""
    if FIXED == 64:
        w = (v * FIXED_SCALE).to(gl.int64)
    elif FIXED == 32:
        w = (v * SCALE32).to(gl.int32)
    else:
        units = v * SCALE32  # both scalings by a power of two: exact
        w = gl.where(units < 0.0, gl.ceil(units), gl.floor(units)) * UNIT32
    return w


@gluon.jit
def _act_add(ptr, v, mask, FIXED: gl.constexpr, GUARD: gl.constexpr):
    """Adds a split-K part (or a bias) into activations by an atomic that nobody waits for: fp32
    (FIXED 0: the sum's last bits then depend on the parts' order), or as an integer word or fp32
    on the int32 words' grid (_to_word: the sums' bits do not depend on the order). Returns where
    it broke int32's PART32 (_over_part), for the caller to keep until its end."""
    if FIXED != 0:
        gl.atomic_add(ptr, _to_word(v, FIXED), mask=mask, sem="relaxed", scope="gpu")
    else:
        gl.atomic_add(ptr, v, mask=mask, sem="relaxed", scope="gpu")
    return _over_part(v, mask, FIXED, GUARD)


@gluon.jit
def _row_load(x_ptr, K, KP: gl.constexpr, FIXED: gl.constexpr, num_warps: gl.constexpr):
    """x[:K] for a layernorm's statistics, spread over all threads (KP: a power of two >= K and
    >= the threads). Every program of a launch reads the same x, so one copy a program: a copy a
    warp took 1.5 us more a launch (session 107, call 3), the L2 lines' traffic, not latency."""
    c = gl.arange(0, KP, layout=gl.BlockedLayout([KP // (32 * num_warps)], [32], [num_warps], [0]))
    return _act_load(x_ptr + c, c < K, FIXED)


@gluon.jit
def _row_stats(r, K, eps, FIXED: gl.constexpr, GUARD: gl.constexpr):
    """A layernorm's (mean, 1 / std, values over) of _row_load's r: the sum and the sum of
    squares in one reduction, one trip through shared memory. int32 words (FIXED 32): the same
    reduction counts the residual stream's values at or beyond READ32 (NaN too), for the caller
    to raise the flag at its end (0.0 where nothing is checked)."""
    if (FIXED == 32) & ((GUARD & GUARD_READS) != 0):
        s, ss, over = gl.reduce((r, r * r, (~(gl.abs(r) < READ32)).to(gl.float32)), 0, _add_triples)
    else:
        s, ss = gl.reduce((r, r * r), 0, _add_pairs)
        over = s * 0.0
    mean, rstd = _mean_rstd(s, ss, K, eps)
    return mean, rstd, over
