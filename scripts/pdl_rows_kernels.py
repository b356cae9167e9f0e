"""The Gluon kernel of scripts/probe_rows_ring.py: one linear of a many-row decode step (gpt2 at
batch 64) as one program an SM streaming its share of the weight tiles through a TMA ring, the
ring's first tiles asked for before the dependent-launch wait, as scripts/pdl_ring_mma_kernels.py
does at one row. Here the rows fill the tensor cores: x (up to 64 rows, fp32 in the arena) is
staged as fp16 (64 x 64) boxes, wgmma's A; the weights' (BN x 64) boxes, out-major as the slab
holds them, are its B, read transposed. The split-K parts meet by fp32 atomics into y, which
the launch two before this one zeroed (so no memset runs between launches)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pdl_ring_kernels import LATE_TRIGGER, NO_MATH, NO_WAIT, NO_X
# a tile's (row block, K chunk), its weights asked for, the chunk of x it reads: as at one row
from pdl_ring_mma_kernels import _ask_tile_mma, _tile_at, _x_chunks, _x_slot
from stream_step_kernels import _barrier

BM = gl.constexpr(64)  # the rows one warpgroup's wgmma takes; rows past the batch are zeros
# what a mode changes beside pdl_ring_kernels' bits (for pricing: the values are wrong): no
# atomics out; x read as fp16, half the bytes (the first half of each fp32 row's bytes)
NO_OUT, X_HALF = gl.constexpr(16), gl.constexpr(32)


@gluon.jit
def rows_linear_kernel(desc, x_ptr, y_ptr, z_ptr, row0, R, N, K, stride_xm, n_tiles, programs, n_zero,
                       MODE: gl.constexpr, STAGES: gl.constexpr, BN: gl.constexpr, BOXES: gl.constexpr,
                       KT: gl.constexpr, RB: gl.constexpr, XS: gl.constexpr, ORDER: gl.constexpr,
                       num_warps: gl.constexpr):
    """y[:R, :N] += x[:R, :K] @ W[row0:row0 + N].T over this program's share of the (BN x BK)
    tiles (BK = 64 BOXES), and z[:n_zero] = 0 (the output of the launch after next). x rows are
    stride_xm apart; y's are N apart. XS: the chunks of x a program stages (ORDER 1: the most a
    share touches; ORDER 0: KT, or one a tile where shares are shorter)."""
    pid = gl.program_id(0)
    t0 = n_tiles * pid // programs
    n = n_tiles * (pid + 1) // programs - t0
    ring = gl.allocate_shared_memory(gl.float16, [STAGES * BOXES, BN, 64], desc.layout)
    # x's (64 x 64) boxes, GROUP staged by one load and one store as a 3D block (a rank-3 view,
    # whose shape Triton 3.6 wants a power of two); the tensor cores read one box at a time
    # through the rank-2 view of the same bytes (a box's 128-byte rows swizzled alike in both)
    NB: gl.constexpr = XS * BOXES
    GROUP: gl.constexpr = 4 if NB > 2 else NB
    NBP: gl.constexpr = 1 << (NB - 1).bit_length()
    x3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    x2: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    xs = gl.allocate_shared_memory(gl.float16, [NBP, BM, 64], x2)
    xs3 = xs.reinterpret(gl.float16, [NBP, BM, 64], x3)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES):  # weights never depend on the launch before: ask first
        if s < n:
            _ask_tile_mma(desc, ring, bars, row0, t0 + s, s, KT, RB, ORDER, BN, BOXES)
    if (MODE & LATE_TRIGGER) == 0:
        gdc_launch_dependents()
    if (MODE & NO_WAIT) == 0:
        gdc_wait()
    # after the wait the launch before has ended, and so has the one before it, the last reader
    # of the buffer zeroed here (the launch after next's, whose atomics come after its own wait)
    zl: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
    z0 = n_zero * pid // programs
    z1 = n_zero * (pid + 1) // programs
    zi = gl.arange(0, 4 * 32 * num_warps, layout=zl)
    for off in range(z0, z1, 4 * 32 * num_warps):
        gl.store(z_ptr + off + zi, gl.zeros([4 * 32 * num_warps], gl.float32, zl), mask=off + zi < z1)
    # Triton puts a barrier between two stores into xs, and each waits for its own loads: a
    # store a box cost an L2 round trip a box (SASS, Triton 3.6), a store a group costs one a group
    xa: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 2, 16], [1, num_warps, 1], [2, 1, 0])
    xb = gl.arange(0, GROUP, layout=gl.SliceLayout(1, gl.SliceLayout(2, xa)))
    xr = gl.arange(0, BM, layout=gl.SliceLayout(0, gl.SliceLayout(2, xa)))
    xc = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, xa)))
    _, chunk0 = _tile_at(t0, KT, RB, ORDER)
    if (MODE & NO_X) == 0:
        for g in gl.static_range(0, NB, GROUP):
            box = g + xb  # the boxes' index in xs: chunk slot box // BOXES, its (box % BOXES)-th box
            chunk, ok = _x_chunks(box // BOXES, t0, n, chunk0, KT, RB, XS, ORDER)
            col = (chunk * BOXES + box % BOXES) * 64
            ptr = x_ptr + xr[None, :, None] * stride_xm + col[:, None, None] + xc[None, None, :]
            x_in = (ok[:, None, None] & (xr < R)[None, :, None]) & (col[:, None, None] + xc[None, None, :] < K)
            if (MODE & X_HALF) != 0:
                v = gl.load(ptr.to(gl.pointer_type(gl.float16)), mask=x_in, other=0.0)
            else:
                v = gl.load(ptr, mask=x_in, other=0.0)
            xs3.slice(g, GROUP, dim=0).store(v.to(gl.float16))
    fence_async_shared()  # x's stores before the tensor cores read them
    _barrier()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BN, 16])
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    acc = gl.zeros([BM, BN], gl.float32, mma)
    for j in range(n):
        t = t0 + j
        rb, ch = _tile_at(t, KT, RB, ORDER)
        slot = j % STAGES
        mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
        if (MODE & NO_MATH) == 0:
            xi = _x_slot(t, j, chunk0, KT, RB, XS, ORDER)
            for s in gl.static_range(BOXES):
                acc = warpgroup_mma(xs.index(xi * BOXES + s), ring.index(slot * BOXES + s).permute((1, 0)), acc,
                                    is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
        _barrier()  # every warp's products read the slot before it is refilled
        fence_async_shared()
        if j + STAGES < n:
            _ask_tile_mma(desc, ring, bars, row0, t + STAGES, slot, KT, RB, ORDER, BN, BOXES)
        if (ORDER == 1) | (ch == KT - 1) | (j == n - 1):  # a run of one row block ends: its part out
            if (MODE & (NO_MATH | NO_OUT)) == 0:
                out = rb * BN + cols
                y_in = (rows < R)[:, None] & (out < N)[None, :]
                gl.atomic_add(y_ptr + rows[:, None] * N + out[None, :], acc, mask=y_in, sem="relaxed", scope="gpu")
            acc = gl.zeros_like(acc)
    if (MODE & LATE_TRIGGER) != 0:
        gdc_launch_dependents()
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
