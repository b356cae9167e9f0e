"""The Gluon kernel of scripts/probe_pdl_ring.py: one batch-1 linear as one program an SM that
streams its share of the weight tiles through a TMA ring in shared memory, with the ring's
first tiles asked for BEFORE the dependent-launch wait.

Each launch takes at most half of an SM's shared memory and registers, so the next launch's
program can be resident beside it (launched early by programmatic dependent launch) and ask for
its own first tiles while this one works: the weights stream on across the boundary, which the
hardware's grid dependency handles (no counters in global memory, unlike the one persistent
launch of scripts/stream_step_kernels.py)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from stream_step_kernels import BK, _barrier, _tma_load

# what a mode changes (bits; 0 is the chain, the only one whose values are right)
NO_WAIT, LATE_TRIGGER, NO_MATH = gl.constexpr(1), gl.constexpr(2), gl.constexpr(4)


@gluon.jit
def _ask_tile(desc, ring, bars, row0, t, slot, KT: gl.constexpr, BN: gl.constexpr):
    """Ask for tile t (row block t // KT, K chunk t % KT) of the phase whose rows start at row0."""
    bar = bars.index(slot)
    mbarrier.expect(bar, desc.block_type.nbytes)
    _tma_load(desc, [row0 + (t // KT) * BN, (t % KT) * BK], bar, ring.index(slot))


@gluon.jit
def ring_linear_kernel(desc, x_ptr, y_ptr, row0, N, K, n_tiles, programs, MODE: gl.constexpr,
                       STAGES: gl.constexpr, BN: gl.constexpr, KT: gl.constexpr, num_warps: gl.constexpr):
    """y[:N] += W[row0:row0 + N, :K] @ x[:K] over this program's contiguous share of the (BN x BK)
    tiles in (row block, K chunk) order; a run of one row block is added by atomics (y zeroed
    before the chain)."""
    pid = gl.program_id(0)
    t0 = n_tiles * pid // programs
    n = n_tiles * (pid + 1) // programs - t0
    # a warp owns whole rows of a tile: the sum over K stays inside it
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    ring = gl.allocate_shared_memory(gl.float16, [STAGES, BN, BK], desc.layout)
    xs = gl.allocate_shared_memory(gl.float32, [KT, BK], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES):  # weights never depend on the launch before: ask first
        if s < n:
            _ask_tile(desc, ring, bars, row0, t0 + s, s, KT, BN)
    if (MODE & LATE_TRIGGER) == 0:
        gdc_launch_dependents()  # the next launch's program may take the SM's other half now
    if (MODE & NO_WAIT) == 0:
        gdc_wait()  # the launch before (whose output is x) has ended and its writes are seen
    xcols = gl.arange(0, BK, layout=gl.BlockedLayout([BK // (32 * num_warps)], [32], [num_warps], [0]))
    for c in gl.static_range(KT):  # x staged once, every chunk's load in flight at once
        xs.index(c).store(gl.load(x_ptr + c * BK + xcols, mask=c * BK + xcols < K, other=0.0))
    _barrier()
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, blk))
    acc = gl.zeros([BN], gl.float32, gl.SliceLayout(1, blk))  # a tile's sum reduced at once: few registers
    for j in range(n):
        t = t0 + j
        slot = j % STAGES
        mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
        if (MODE & NO_MATH) == 0:
            w = ring.index(slot).load(blk).to(gl.float32)
            acc += gl.sum(w * xs.index(t % KT).load(gl.SliceLayout(0, blk))[None, :], axis=1)
        _barrier()  # every warp is done with the slot before the TMA that refills it
        fence_async_shared()
        if j + STAGES < n:
            _ask_tile(desc, ring, bars, row0, t + STAGES, slot, KT, BN)
        if ((t % KT) == KT - 1) | (j == n - 1):  # the end of a run of one row block
            if (MODE & NO_MATH) == 0:
                out = (t // KT) * BN + rows
                gl.atomic_add(y_ptr + out, acc, mask=out < N, sem="relaxed", scope="gpu")
            acc = gl.zeros_like(acc)
    if (MODE & LATE_TRIGGER) != 0:
        gdc_launch_dependents()
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
