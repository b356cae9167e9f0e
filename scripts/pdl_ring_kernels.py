"""The Gluon kernels of scripts/probe_pdl_ring.py: one batch-1 linear as one program an SM that
streams its share of the weight tiles through a TMA ring in shared memory, with the ring's
first tiles asked for BEFORE the dependent-launch wait. Two forms of the products: CUDA cores
(ring_linear_kernel) and tensor cores (ring_linear_mma_kernel).

A launch that takes at most about half of an SM's shared memory and registers leaves room for
the next launch's program, launched early by programmatic dependent launch, which asks for its
own first tiles while this one works: the weights stream on across the boundary, which the
hardware's grid dependency handles (no counters in global memory, unlike the one persistent
launch of scripts/stream_step_kernels.py)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

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
def _tile_at(t, KT: gl.constexpr, RB: gl.constexpr, ORDER: gl.constexpr):
    """Tile t's (row block, K chunk): ORDER 0 by row block (a row block's K chunks in a row: few
    partial sums a row, x by the chunks of a whole row), 1 by K chunk (a chunk's row blocks in a
    row: a program's tiles share one or two chunks of x)."""
    if ORDER == 0:
        rb = t // KT
        chunk = t % KT
    else:
        rb = t % RB
        chunk = t // RB
    return rb, chunk


@gluon.jit
def _ask_tile_mma(desc, ring, bars, row0, t, slot, KT: gl.constexpr, RB: gl.constexpr, ORDER: gl.constexpr,
                  BN: gl.constexpr):
    """Ask for tile t as four (BN x 64) boxes (128-byte swizzle, as the tensor cores read them)."""
    rb, chunk = _tile_at(t, KT, RB, ORDER)
    bar = bars.index(slot)
    mbarrier.expect(bar, 4 * desc.block_type.nbytes)
    for s in gl.static_range(4):
        _tma_load(desc, [row0 + rb * BN, chunk * BK + s * 64], bar, ring.index(slot * 4 + s))


@gluon.jit
def _add_pairs(a, b, c, d):
    return a + c, b + d


@gluon.jit
def _row_load(x_ptr, K, KP: gl.constexpr, num_warps: gl.constexpr):
    """x[:K] for a layernorm's statistics, spread over all threads (KP: a power of two >= K and
    >= the threads). Every program of a launch reads the same x, so one copy a program: a copy a
    warp took 1.5 us more a launch (session 107, call 3), the L2 lines' traffic, not latency."""
    c = gl.arange(0, KP, layout=gl.BlockedLayout([KP // (32 * num_warps)], [32], [num_warps], [0]))
    return gl.load(x_ptr + c, mask=c < K, other=0.0)


@gluon.jit
def _row_stats(r, K, eps):
    """A layernorm's mean and 1 / std of _row_load's r: the sum and the sum of squares in one
    reduction, one trip through shared memory (fp32: E[x^2] - mean^2 loses nothing at a
    residual's scale)."""
    s, ss = gl.reduce((r, r * r), 0, _add_pairs)
    mean = s / K
    return mean, gl.rsqrt(gl.maximum(ss / K - mean * mean, 0.0) + eps)


@gluon.jit
def _gelu_tanh(x):
    """GPT-2's GELU, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh by exp2."""
    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x - x / (gl.exp2(2.8853900817779268 * z) + 1.0)  # 2 log2(e): x (1 + tanh z) / 2 = x - x / (e^2z + 1)


@gluon.jit
def _gelu_tanh_approx(x):
    """GPT-2's GELU with tanh by the MUFU's tanh.approx (about 2^-11 relative, an fp16 rounding's
    size; x is rounded to fp16 right after): one instruction where exp2 and a division take
    several after the wait."""
    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [z], dtype=gl.float32, is_pure=True, pack=1)
    return 0.5 * x * (1.0 + t)


@gluon.jit
def ring_linear_mma_kernel(desc, x_ptr, y_ptr, row0, N, K, n_tiles, programs, p_ptr, g_off, bias_off, eps,
                           MODE: gl.constexpr, STAGES: gl.constexpr, KT: gl.constexpr, RB: gl.constexpr,
                           ORDER: gl.constexpr, XS: gl.constexpr, XB: gl.constexpr, XFORM: gl.constexpr,
                           BIAS: gl.constexpr, BROWS: gl.constexpr, KP: gl.constexpr, ASYNC: gl.constexpr,
                           num_warps: gl.constexpr):
    """ring_linear_kernel's chain on the tensor cores: one warpgroup, a (64 x 256) tile as four
    wgmma over (64 x 64) boxes against x as fp16 in the first of 8 columns (the others zero):
    no conversions and no shuffles after the wait, where the CUDA-core form spends about a
    microsecond a launch on the tiles that landed before it. Tiles in ORDER (_tile_at); XS: the
    most K chunks a program's tiles touch, XB: x's boxes, a power of two of at least 4 XS.
    For a whole step (scripts/probe_pdl_step.py), x is staged as XFORM says: 0 as it is, 1 its
    layernorm (weight and bias at p_ptr + g_off, + K; statistics from all of x, loaded beside
    the chunks), 2 its GELU (4: by tanh.approx), 3 as it is for a layernorm folded into the
    weights (W' = W diag(g): W LN(x) + bias = rstd (W' x - mean u) + c with u = W' 1 at p_ptr +
    g_off and c = W b + bias at p_ptr + bias_off, per output; the statistics are needed only at
    the outputs). BIAS: the
    bias (XFORM 3: c - rstd mean u) of the row blocks whose first K chunk is this program's,
    loaded before the wait as one vector (BROWS, a power of two) and added by one atomic."""
    BN: gl.constexpr = 64
    pid = gl.program_id(0)
    t0 = n_tiles * pid // programs
    n = n_tiles * (pid + 1) // programs - t0
    ring = gl.allocate_shared_memory(gl.float16, [STAGES * 4, BN, 64], desc.layout)
    # x as the (8 x 64) K-major B operand of each box: row 0 the chunk, rows 1-7 zero
    xl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    xs = gl.allocate_shared_memory(gl.float16, [XB, 8, 64], xl)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES):  # weights never depend on the launch before: ask first
        if s < n:
            _ask_tile_mma(desc, ring, bars, row0, t0 + s, s, KT, RB, ORDER, BN)
    # x's boxes (XB, a power of two >= 4 XS) zeroed before the wait; after it one load and one
    # store write every box's row 0, which the 128-byte swizzle leaves in place: the buffer seen
    # unswizzled as (XB, 512), a box a row, its first 64 columns
    flat = xs.reinterpret(gl.float16, [XB, 512], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    xa: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    flat.store(gl.zeros([XB, 512], gl.float16, xa))
    # where each box's x comes from, and what never depends on the launch before (the layernorm's
    # weight and bias, this program's biases): all asked for before the wait
    _, chunk0 = _tile_at(t0, KT, RB, ORDER)
    bx = gl.arange(0, XB, layout=gl.SliceLayout(1, xa))
    c64 = gl.arange(0, 64, layout=gl.SliceLayout(0, xa))
    i = bx // 4
    if ORDER == 1:  # the chunks of this program's tiles, in a row
        chunk = chunk0 + i
        ok = (i < XS) & (chunk <= (t0 + n - 1) // RB)
    elif XS == KT:
        chunk = i
        ok = i < XS
    else:  # a box row a tile
        chunk = (t0 + i) % KT
        ok = (i < XS) & (i < n)
    col = (chunk * BK + (bx % 4) * 64)[:, None] + c64[None, :]
    m = ok[:, None] & (col < K)
    if XFORM == 1:
        g = gl.load(p_ptr + g_off + col, mask=m, other=0.0)
        b = gl.load(p_ptr + g_off + K + col, mask=m, other=0.0)
    if BIAS:  # the row blocks whose first K chunk is this program's: [rb_lo, rb_hi)
        if ORDER == 0:
            rb_lo = (t0 + KT - 1) // KT
            rb_hi = (t0 + n + KT - 1) // KT
        else:
            rb_lo = t0
            rb_hi = gl.minimum(t0 + n, RB)
        bias_rows = rb_lo * BN + gl.arange(0, BROWS, layout=gl.BlockedLayout([BROWS // (32 * num_warps)], [32],
                                                                             [num_warps], [0]))
        own = (bias_rows < rb_hi * BN) & (bias_rows < N)
        bias = gl.load(p_ptr + bias_off + bias_rows, mask=own, other=0.0)
        if XFORM == 3:
            u = gl.load(p_ptr + g_off + bias_rows, mask=own, other=0.0)
    _barrier()  # the zeros before any thread's x
    if (MODE & LATE_TRIGGER) == 0:
        gdc_launch_dependents()
    if (MODE & NO_WAIT) == 0:
        gdc_wait()
    if (MODE & NO_X) == 0:
        xv = gl.load(x_ptr + col, mask=m, other=0.0)
        if (XFORM == 1) | (XFORM == 3):
            r = _row_load(x_ptr, K, KP, num_warps)  # asked for beside x's chunks
        if XFORM == 1:
            mean, rstd = _row_stats(r, K, eps)
            xv = gl.where(m, (xv - mean) * rstd * g + b, 0.0)
        if XFORM == 2:
            xv = _gelu_tanh(xv)  # GELU(0) = 0: the masked columns stay zero
        if XFORM == 4:
            xv = _gelu_tanh_approx(xv)
        flat.slice(0, 64, dim=1).store(xv.to(gl.float16))
    if BIAS:
        if XFORM != 3:  # fire and forget: the outputs' other parts come by atomics too
            gl.atomic_add(y_ptr + bias_rows, bias, mask=own, sem="relaxed", scope="gpu")
    fence_async_shared()  # x's stores before the tensor cores read them
    _barrier()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8, 16])
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    # ASYNC 0: each box's wgmma waited for; 1: a tile's four in a row, one wait; 2: the same into
    # four accumulators (no chain between the boxes); 3: as 2, the wait letting the tile's own
    # products run on (the last tile's are done: its slot refilled a tile later)
    a0 = gl.zeros([BN, 8], gl.float32, mma)
    a1 = gl.zeros_like(a0)
    a2 = gl.zeros_like(a0)
    a3 = gl.zeros_like(a0)
    if ORDER == 0:
        first_out = gl.minimum(n - 1, KT - 1 - t0 % KT)  # this program's first outputs: at tile j = first_out
    else:
        first_out = 0
    mean = 0.0
    rstd = 0.0
    for j in range(n):
        t = t0 + j
        rb, ch = _tile_at(t, KT, RB, ORDER)
        slot = j % STAGES
        mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
        if ORDER == 1:
            xr = ch - chunk0
        else:
            xr = _x_row(t, j, KT, XS)
        if (MODE & NO_MATH) == 0:
            if ASYNC < 2:
                for s in gl.static_range(4):
                    a0 = warpgroup_mma(ring.index(slot * 4 + s), xs.index(xr * 4 + s).permute((1, 0)), a0,
                                       is_async=ASYNC == 1)
                if ASYNC == 1:
                    a0 = warpgroup_mma_wait(0, deps=[a0])
            else:
                a0 = warpgroup_mma(ring.index(slot * 4), xs.index(xr * 4).permute((1, 0)), a0, is_async=True)
                a1 = warpgroup_mma(ring.index(slot * 4 + 1), xs.index(xr * 4 + 1).permute((1, 0)), a1, is_async=True)
                a2 = warpgroup_mma(ring.index(slot * 4 + 2), xs.index(xr * 4 + 2).permute((1, 0)), a2, is_async=True)
                a3 = warpgroup_mma(ring.index(slot * 4 + 3), xs.index(xr * 4 + 3).permute((1, 0)), a3, is_async=True)
                a0, a1, a2, a3 = warpgroup_mma_wait(4 if ASYNC == 3 else 0, deps=[a0, a1, a2, a3])
        _barrier()
        fence_async_shared()
        if ASYNC == 3:  # the last tile's slot: its products are done
            if (j >= 1) & (j - 1 + STAGES < n):
                _ask_tile_mma(desc, ring, bars, row0, t - 1 + STAGES, (j - 1) % STAGES, KT, RB, ORDER, BN)
        elif j + STAGES < n:
            _ask_tile_mma(desc, ring, bars, row0, t + STAGES, slot, KT, RB, ORDER, BN)
        if (ORDER == 1) | (ch == KT - 1) | (j == n - 1):
            if (MODE & NO_MATH) == 0:
                if ASYNC == 3:
                    a0, a1, a2, a3 = warpgroup_mma_wait(0, deps=[a0, a1, a2, a3])
                out = rb * BN + rows
                y = gl.sum(gl.where(cols[None, :] == 0, a0 + a1 + a2 + a3, 0.0), axis=1)
                if XFORM == 3:
                    if j == first_out:  # the statistics behind the first products, not before them
                        mean, rstd = _row_stats(r, K, eps)
                        if BIAS:
                            gl.atomic_add(y_ptr + bias_rows, bias - rstd * mean * u, mask=own, sem="relaxed",
                                          scope="gpu")
                    y = y * rstd
                gl.atomic_add(y_ptr + out, y, mask=out < N, sem="relaxed", scope="gpu")
            a0 = gl.zeros_like(a0)
            a1 = gl.zeros_like(a0)
            a2 = gl.zeros_like(a0)
            a3 = gl.zeros_like(a0)
    if (MODE & LATE_TRIGGER) != 0:
        gdc_launch_dependents()
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


@gluon.jit
def ring_attention_kernel(kc_ptr, vc_ptr, qkv_ptr, y_ptr, P, C, scale, x_ptr, p_ptr, u_off, c_off, eps,
                          MODE: gl.constexpr, D: gl.constexpr, BP: gl.constexpr, FOLD: gl.constexpr,
                          KP: gl.constexpr, num_warps: gl.constexpr):
    """A layer's decode attention between qkv and attn-out, a program a head: its P cached keys and
    values (fp16, (P + 1, C) row-major, row P for this step's) loaded before the wait, q, k and v
    from qkv's output after it; y[head] = softmax(K q * scale) V over the P + 1 positions, and the
    new key and value appended at row P. Small enough to share any SM with the launches beside it.
    FOLD: qkv's output is W' x with the layernorm folded into W' (ring_linear_mma_kernel's XFORM
    3); this launch's few programs take the statistics of x (the residual stream) and finish
    q, k, v = rstd (W' x - mean u) + c, u and c at p_ptr + u_off / c_off, so qkv's many do not."""
    h = gl.program_id(0)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    p = gl.arange(0, BP, layout=gl.SliceLayout(1, blk))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    at = p[:, None] * C + h * D + d[None, :]
    old = (p < P)[:, None]
    kt = gl.load(kc_ptr + at, mask=old, other=0.0)  # the cache never depends on the launch before
    vt = gl.load(vc_ptr + at, mask=old, other=0.0)
    if FOLD:
        u_q = gl.load(p_ptr + u_off + h * D + d)
        u_k = gl.load(p_ptr + u_off + C + h * D + d)
        u_v = gl.load(p_ptr + u_off + 2 * C + h * D + d)
        c_q = gl.load(p_ptr + c_off + h * D + d)
        c_k = gl.load(p_ptr + c_off + C + h * D + d)
        c_v = gl.load(p_ptr + c_off + 2 * C + h * D + d)
    if (MODE & LATE_TRIGGER) == 0:
        gdc_launch_dependents()
    if (MODE & NO_WAIT) == 0:
        gdc_wait()
    q = gl.load(qkv_ptr + h * D + d)
    k_new = gl.load(qkv_ptr + C + h * D + d)
    v_new = gl.load(qkv_ptr + 2 * C + h * D + d)
    if FOLD:
        mean, rstd = _row_stats(_row_load(x_ptr, C, KP, num_warps), C, eps)
        q = rstd * (q - mean * u_q) + c_q
        k_new = rstd * (k_new - mean * u_k) + c_k
        v_new = rstd * (v_new - mean * u_v) + c_v
    new = (p == P)[:, None]
    k = gl.where(new, k_new[None, :], kt.to(gl.float32))
    v = gl.where(new, v_new[None, :], vt.to(gl.float32))
    s = gl.where(p <= P, gl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
    e = gl.exp2((s - gl.max(s, axis=0)) * 1.4426950408889634)  # log2(e): exp via exp2
    gl.store(y_ptr + h * D + d, gl.sum(e[:, None] * v, axis=0) / gl.sum(e, axis=0))
    gl.store(kc_ptr + P * C + h * D + d, k_new.to(gl.float16))
    gl.store(vc_ptr + P * C + h * D + d, v_new.to(gl.float16))
