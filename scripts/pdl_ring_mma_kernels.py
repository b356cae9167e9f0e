"""The tensor-core form of scripts/probe_pdl_ring.py's linear (ring_linear_mma_kernel), which
scripts/probe_pdl_step.py chains into a whole decode step: wgmma over the TMA ring's (64 x 64)
boxes with x in the first column of the B operand, x staged as the step needs it (as it is, a
layernorm, GELU, or as it is for a layernorm folded into the weights), biases added once; the
split-K parts meet by atomics that nobody waits for, in fp32 or as int32 or int64 fixed-point
words (the same bits every run)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pdl_ring_kernels import (LATE_TRIGGER, NO_MATH, NO_WAIT, NO_X, _act_add, _act_load, _raise_flag, _row_load,
                              _row_stats, _x_row)
from stream_step_kernels import BK, _barrier, _tma_load


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
                  BN: gl.constexpr, BOXES: gl.constexpr):
    """Ask for tile t as BOXES (BN x 64) boxes (128-byte swizzle, as the tensor cores read them)
    into ring slot `slot`."""
    rb, chunk = _tile_at(t, KT, RB, ORDER)
    bar = bars.index(slot)
    mbarrier.expect(bar, BOXES * desc.block_type.nbytes)
    for s in gl.static_range(BOXES):
        _tma_load(desc, [row0 + rb * BN, (chunk * BOXES + s) * 64], bar, ring.index(slot * BOXES + s))


@gluon.jit
def _x_chunks(i, t0, n, chunk0, KT: gl.constexpr, RB: gl.constexpr, XS: gl.constexpr, ORDER: gl.constexpr):
    """For staged slots i of x (a program's tiles t0 .. t0 + n - 1): the K chunk each holds, and
    whether it holds one. ORDER 1: the chunks of the tiles, in a row; ORDER 0: the whole row
    (XS == KT), or a slot a tile."""
    if ORDER == 1:
        chunk = chunk0 + i
        ok = (i < XS) & (chunk <= (t0 + n - 1) // RB)
    elif XS == KT:
        chunk = i
        ok = (i < XS) & (n > 0)
    else:
        chunk = (t0 + i) % KT
        ok = (i < XS) & (i < n)
    return chunk, ok


@gluon.jit
def _x_slot(t, j, chunk0, KT: gl.constexpr, RB: gl.constexpr, XS: gl.constexpr, ORDER: gl.constexpr):
    """The staged slot of x that tile t (the share's j-th) reads (_x_chunks' i)."""
    if ORDER == 1:
        r = t // RB - chunk0
    else:
        r = _x_row(t, j, KT, XS)
    return r


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
def ring_linear_mma_kernel(desc, x_ptr, y_ptr, row0, N, K, n_tiles, programs, p_ptr, g_off, bias_off, eps, flag_ptr,
                           MODE: gl.constexpr, STAGES: gl.constexpr, KT: gl.constexpr, RB: gl.constexpr,
                           ORDER: gl.constexpr, XS: gl.constexpr, XB: gl.constexpr, XFORM: gl.constexpr,
                           BIAS: gl.constexpr, BROWS: gl.constexpr, KP: gl.constexpr, ASYNC: gl.constexpr,
                           FIXED: gl.constexpr, num_warps: gl.constexpr,
                           GUARD: gl.constexpr = 3):  # GUARD_PARTS | GUARD_READS
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
    the outputs). BIAS: the bias (XFORM 3: c - rstd mean u) of the row blocks whose first K
    chunk is this program's, loaded before the wait as one vector (BROWS, a power of two) and
    added by one atomic. ASYNC: a tile's four wgmma issued in a row with one wait (else a wait
    each). FIXED (32, 64): x and y are fixed-point words of that width, the parts and biases added
    as integers (_act_add), so y's bits do not depend on the order in which the parts arrive;
    int32's guard raises the flag at flag_ptr at the program's end (pdl_ring_kernels' PART32,
    READ32: the parts noted as they are added, the residual stream's values counted where the
    layernorms' statistics take them; GUARD: which checks). GRID32: fp32 on int32's grid, the
    parts and biases truncated onto it before their fp32 atomics (_to_word)."""
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
            _ask_tile_mma(desc, ring, bars, row0, t0 + s, s, KT, RB, ORDER, BN, 4)
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
    chunk, ok = _x_chunks(bx // 4, t0, n, chunk0, KT, RB, XS, ORDER)
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
        xv = _act_load(x_ptr + col, m, FIXED)
        if (XFORM == 1) | (XFORM == 3):
            r = _row_load(x_ptr, K, KP, FIXED, num_warps)  # asked for beside x's chunks
        if XFORM == 1:
            mean, rstd, over = _row_stats(r, K, eps, FIXED, GUARD)
            xv = gl.where(m, (xv - mean) * rstd * g + b, 0.0)
        if XFORM == 2:
            xv = _gelu_tanh(xv)  # GELU(0) = 0: the masked columns stay zero
        if XFORM == 4:
            xv = _gelu_tanh_approx(xv)
        flat.slice(0, 64, dim=1).store(xv.to(gl.float16))
    if BIAS:
        bias_over = own & ~own  # the biases (int32's guard: a part each) that break PART32
        if XFORM != 3:  # fire and forget: the outputs' other parts come by atomics too
            bias_over = _act_add(y_ptr + bias_rows, bias, own, FIXED, GUARD)
    fence_async_shared()  # x's stores before the tensor cores read them
    _barrier()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8, 16])
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    acc = gl.zeros([BN, 8], gl.float32, mma)
    parts_over = rows < 0  # the parts this program adds that break PART32 (int32's guard)
    if ORDER == 0:
        first_out = gl.minimum(n - 1, KT - 1 - t0 % KT)  # this program's first outputs: at tile j = first_out
    else:
        first_out = 0
    rstd = 0.0
    if XFORM == 3:
        over = 0.0  # (the statistics' count of values over READ32, taken in the loop)
    for j in range(n):
        t = t0 + j
        rb, ch = _tile_at(t, KT, RB, ORDER)
        slot = j % STAGES
        mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
        xr = _x_slot(t, j, chunk0, KT, RB, XS, ORDER)
        if (MODE & NO_MATH) == 0:
            for s in gl.static_range(4):
                acc = warpgroup_mma(ring.index(slot * 4 + s), xs.index(xr * 4 + s).permute((1, 0)), acc,
                                    is_async=ASYNC)
            if ASYNC:
                acc = warpgroup_mma_wait(0, deps=[acc])
        _barrier()
        fence_async_shared()
        if j + STAGES < n:
            _ask_tile_mma(desc, ring, bars, row0, t + STAGES, slot, KT, RB, ORDER, BN, 4)
        if (ORDER == 1) | (ch == KT - 1) | (j == n - 1):
            if (MODE & NO_MATH) == 0:
                out = rb * BN + rows
                y = gl.sum(gl.where(cols[None, :] == 0, acc, 0.0), axis=1)
                if XFORM == 3:
                    if j == first_out:  # the statistics behind the first products, not before them
                        mean, rstd, over = _row_stats(r, K, eps, FIXED, GUARD)
                        if BIAS:
                            bias_over = _act_add(y_ptr + bias_rows, bias - rstd * mean * u, own, FIXED, GUARD)
                    y = y * rstd
                parts_over = parts_over | _act_add(y_ptr + out, y, out < N, FIXED, GUARD)
            acc = gl.zeros_like(acc)
    if (MODE & LATE_TRIGGER) != 0:
        gdc_launch_dependents()
    if (FIXED == 32) & (GUARD != 0) & ((MODE & NO_MATH) == 0):  # int32's flag, at the end: off the outputs' path
        if (XFORM == 1) | (XFORM == 3):
            parts_over = parts_over | ((rows == 0) & (over > 0.0))
        _raise_flag(flag_ptr, parts_over)
        if BIAS:
            _raise_flag(flag_ptr, bias_over)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
