"""The Gluon kernels of scripts/probe_stream_step.py: the batch-1 step's linears as one persistent
launch, each program streaming its tiles' weights through a ring of shared-memory slots filled
by TMA. Two forms: one role (the program asks for the next tile after each tile's work) and warp
specialized (a loader warp fills the ring on its own, at most MAXF tiles in flight).

A tile's table entry (NF int32): flags | phase << 8, first row, first column, output offset, the
phase's input offset, its K, its output's end, and what the phase's input waits for (counters:
the programs that count themselves in at the phase before; counted words: K tiles a word)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

BK = gl.constexpr(256)  # a tile: BN output rows x 256 of K (TMA boxes reach 256 elements)
XCHUNKS = gl.constexpr(32)  # a phase's input staged as (32, 256) fp32: K up to 8192
FIRST, SEG_END, PHASE_END = 2, 4, 8  # entry flags; bit 0 picks the slab, bits 8+ the phase
NF = gl.constexpr(8)
FIX_SCALE = gl.constexpr(4294967296.0)  # counted words: 2^32 fixed point, the low 8 bits a count
# what a mode leaves out (bits; 0 is the step, the only one whose values are right)
NO_WAIT, NO_OUT, NO_MATH, NO_X, NO_RING = (gl.constexpr(1), gl.constexpr(2), gl.constexpr(4), gl.constexpr(8),
                                           gl.constexpr(16))
SLEEP = gl.constexpr(32)  # not a part left out: counted words read again 0.5 us apart

# the names these have in Triton 3.6 and in the newest
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
HAS_INLINE_ASM = hasattr(gl, "inline_asm")  # the loader's L2 requests ahead need it (3.6 has none)


@gluon.jit
def _table_block(tab, b, rows, f):
    """Tile entries 32b .. 32b + 31 of a program's list, one a lane (every warp a copy)."""
    return gl.load(tab + (b * 32 + rows)[:, None] * NF + f[None, :])


@gluon.jit
def _table_start(tab, tbl: gl.constexpr):
    """A program's table held 32 entries at a time: (rows, fields, the first block, the next)."""
    rows = gl.arange(0, 32, layout=gl.SliceLayout(1, tbl))
    f = gl.arange(0, NF, layout=gl.SliceLayout(0, tbl))
    return rows, f, _table_block(tab, 0, rows, f), _table_block(tab, 1, rows, f)


@gluon.jit
def _table_turn(tab, cur, nxt, j, rows, f):
    """At a block's first tile (past the first block) the next block is held and the one after
    asked for: a block ahead, so no tile waits on a table read."""
    if (j % 32 == 0) & (j > 0):
        cur = nxt
        nxt = _table_block(tab, j // 32 + 1, rows, f)
    return cur, nxt


@gluon.jit
def _entry(block, j, rows, f):
    """Tile j's fields from the table block holding it: one in-warp sum (redux) a field."""
    e = gl.sum(gl.where(rows[:, None] == (j % 32), block, 0), axis=0)
    return (gl.sum(gl.where(f == 0, e, 0), axis=0), gl.sum(gl.where(f == 1, e, 0), axis=0),
            gl.sum(gl.where(f == 2, e, 0), axis=0), gl.sum(gl.where(f == 3, e, 0), axis=0),
            gl.sum(gl.where(f == 4, e, 0), axis=0), gl.sum(gl.where(f == 5, e, 0), axis=0),
            gl.sum(gl.where(f == 6, e, 0), axis=0), gl.sum(gl.where(f == 7, e, 0), axis=0))


@gluon.jit
def _ask(desc_k1, desc_k4, ring, bars, meta, row0, col0, j, STAGES: gl.constexpr, TILED: gl.constexpr):
    """Ask for tile j's weights into its ring slot; its mbarrier completes on arrival. TILED:
    the weights are stored tile by tile (each tile's BN rows of BK one contiguous block, at row0)."""
    if TILED:
        col0 = 0
    slot = j % STAGES
    bar = bars.index(slot)
    mbarrier.expect(bar, desc_k1.block_type.nbytes)
    if (meta & 1) == 0:
        _tma_load(desc_k1, [row0, col0], bar, ring.index(slot))
    else:
        _tma_load(desc_k4, [row0, col0], bar, ring.index(slot))


@gluon.jit
def _stage_counted(arena_ptr, xs, in_off, k_len, want, xcols, POLL: gl.constexpr, SLEEP_FIRST: gl.constexpr):
    """Stage a phase's input from counted words (fixed point << 8 | K tiles added): read every
    chunk again until each word has all `want` tiles in (POLL), then decode into shared memory.
    SLEEP_FIRST: a pause before each read again (every program reading its whole input again and
    again keeps L2 busy)."""
    _barrier()  # the last phase's input is no longer read
    busy = 0
    first = 1
    while (busy > 0) | (first > 0):
        if SLEEP_FIRST:  # (a constexpr branch alone: Triton 3.6's Gluon has no inline_asm)
            if busy > 0:
                gl.inline_asm("nanosleep.u32 500;")
        first = 0
        bad = xcols < 0
        for c in gl.static_range(XCHUNKS):  # one word a thread a chunk: all loads in flight at once
            m = c * BK + xcols < k_len
            w = gl.load(arena_ptr + in_off + c * BK + xcols, mask=m, other=0, cache_modifier=".cg")
            bad = bad | (m & ((w & 0xFF) != want))
            xs.index(c).store((w >> 8).to(gl.float32) * (1.0 / FIX_SCALE))
        busy = gl.max(bad.to(gl.int32), axis=0) if POLL else 0
    _barrier()


@gluon.jit
def _open_phase(arena_ptr, flags_ptr, xs, p, in_off, k_len, want, xcols, MODE: gl.constexpr,
                COUNTED: gl.constexpr):
    """A phase's first tile here: wait until its input is complete and stage it in shared memory."""
    if COUNTED:
        if (MODE & NO_X) == 0:
            _stage_counted(arena_ptr, xs, in_off, k_len, want, xcols, (MODE & NO_WAIT) == 0, (MODE & SLEEP) != 0)
    else:
        if ((MODE & NO_WAIT) == 0) & (p > 0):
            seen = gl.atomic_add(flags_ptr + p - 1, 0, sem="acquire", scope="gpu")
            while seen < want:
                seen = gl.atomic_add(flags_ptr + p - 1, 0, sem="acquire", scope="gpu")
        if (MODE & NO_X) == 0:
            _barrier()  # and the last phase's input is no longer read
            for c in gl.static_range(XCHUNKS):  # one element a thread a chunk: all loads in flight at once
                xs.index(c).store(gl.load(arena_ptr + in_off + c * BK + xcols, mask=c * BK + xcols < k_len,
                                          other=0.0, cache_modifier=".cg"))
            _barrier()


@gluon.jit
def _close_tile(arena_ptr, flags_ptr, acc, seg_tiles, meta, out_off, out_end, rows, MODE: gl.constexpr,
                COUNTED: gl.constexpr):
    """After a tile's products: at the end of a run of one row block add it into the output; at
    this program's last tile of the phase count it in (counters). Returns (acc, seg_tiles)."""
    seg_tiles += 1
    if (meta & 4) != 0:
        if (MODE & NO_OUT) == 0:
            y = gl.sum(acc, axis=1)
            out = arena_ptr + out_off + rows
            if COUNTED:  # fixed point over the count of K tiles in, one 8-byte word: no fence needed
                word = ((y * FIX_SCALE).to(gl.int64) << 8) + seg_tiles
                gl.atomic_add(out, word, mask=out_off + rows < out_end, sem="relaxed", scope="gpu")
            else:
                gl.atomic_add(out, y, mask=out_off + rows < out_end, sem="relaxed", scope="gpu")
        acc = gl.zeros_like(acc)
        seg_tiles = 0
    if ((MODE & NO_OUT) == 0) & ((meta & 8) != 0) & (not COUNTED):
        _barrier()
        gl.atomic_add(flags_ptr + (meta >> 8), 1, sem="release", scope="gpu")
    return acc, seg_tiles


@gluon.jit
def _work_start(blk: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr):
    """The work's row offsets, the lanes that stage an input chunk (one element a thread), and a
    zero accumulator."""
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, blk))
    xcols = gl.arange(0, BK, layout=gl.BlockedLayout([BK // (32 * num_warps)], [32], [num_warps], [0]))
    return rows, xcols, gl.zeros([BN, BK], gl.float32, blk)


@gluon.jit
def _tile_products(ring, xs, slot, col0, acc, blk: gl.constexpr, MODE: gl.constexpr):
    """Add a landed tile's products with its input chunk into acc; then every warp is done with
    the slot (a barrier) and its reads are ordered before the TMA that refills it."""
    if (MODE & NO_MATH) == 0:
        w = ring.index(slot).load(blk).to(gl.float32)
        acc += w * xs.index(col0 // BK).load(gl.SliceLayout(0, blk))[None, :]
    _barrier()
    fence_async_shared()
    return acc


@gluon.jit
def _consume(ring, xs, ready, empty, tab, n, arena_ptr, flags_ptr, MODE: gl.constexpr, COUNTED: gl.constexpr,
             STAGES: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr):
    """The warp-specialized form's work: every tile's products as its slot fills, the slot given
    back to the loader after."""
    # a warp owns whole rows of a tile: each thread 8 columns (16-byte shared loads), the sum over
    # K reduced by shuffles inside the warp
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    rows_t, f, cur, nxt = _table_start(tab, gl.BlockedLayout([1, NF], [32, 1], [num_warps, 1], [1, 0]))
    rows, xcols, acc = _work_start(blk, BN, num_warps)
    seg_tiles = 0
    for j in range(n):
        cur, nxt = _table_turn(tab, cur, nxt, j, rows_t, f)
        meta, _, col0, out_off, in_off, k_len, out_end, want = _entry(cur, j, rows_t, f)
        if (meta & 2) != 0:
            _open_phase(arena_ptr, flags_ptr, xs, meta >> 8, in_off, k_len, want, xcols, MODE, COUNTED)
        slot = j % STAGES
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        acc = _tile_products(ring, xs, slot, col0, acc, blk, MODE)
        mbarrier.arrive(empty.index(slot), count=1)  # the slot back to the loader
        acc, seg_tiles = _close_tile(arena_ptr, flags_ptr, acc, seg_tiles, meta, out_off, out_end, rows, MODE,
                                     COUNTED)


@gluon.jit
def _l2_ahead(w1_ptr, w4_ptr, meta, row0, TILE_BYTES: gl.constexpr):
    """Ask L2 for a tile stored tile by tile (one contiguous block at row0), from one lane."""
    if (meta & 1) == 0:
        addr = (w1_ptr + row0 * BK).to(gl.int64, bitcast=True)
    else:
        addr = (w4_ptr + row0 * BK).to(gl.int64, bitcast=True)
    gl.inline_asm("{ .reg .pred first; .reg .u32 lane; mov.u32 lane, %laneid; setp.eq.u32 first, lane, 0; "
                  f"@first cp.async.bulk.prefetch.L2.global [$0], {TILE_BYTES}; }}", "l", [addr])


@gluon.jit
def _load(desc_k1, desc_k4, w1_ptr, w4_ptr, ring, ready, empty, tab, n, STAGES: gl.constexpr, MAXF: gl.constexpr,
          TILED: gl.constexpr, L2_AHEAD: gl.constexpr, TILE_BYTES: gl.constexpr):
    """The loader warp: fill each slot once it is given back, with at most MAXF tiles in flight
    (fewer requests queued keep the phases' own reads quick). L2_AHEAD > 0 (weights stored tile
    by tile): with each tile, ask L2 for the one L2_AHEAD tiles later, so requests stay out while
    the ring is full and the program waits on a phase."""
    rows_t, f, cur, nxt = _table_start(tab, gl.BlockedLayout([1, NF], [32, 1], [1, 1], [1, 0]))
    for j in range(n):
        cur, nxt = _table_turn(tab, cur, nxt, j, rows_t, f)
        meta, row0, col0, _, _, _, _, _ = _entry(cur, j, rows_t, f)
        if L2_AHEAD > 0:  # (a constexpr branch alone: Triton 3.6's Gluon has no inline_asm)
            if j + L2_AHEAD < n:
                if j % 32 + L2_AHEAD < 32:
                    l_meta, l_row, _, _, _, _, _, _ = _entry(cur, j + L2_AHEAD, rows_t, f)
                else:
                    l_meta, l_row, _, _, _, _, _, _ = _entry(nxt, j + L2_AHEAD, rows_t, f)
                _l2_ahead(w1_ptr, w4_ptr, l_meta, l_row, TILE_BYTES)
        mbarrier.wait(empty.index(j % STAGES), ((j // STAGES) & 1) ^ 1)
        if (MAXF < STAGES) & (j >= MAXF):  # (MAXF >= STAGES: the slots alone bound it)
            mbarrier.wait(ready.index((j - MAXF) % STAGES), ((j - MAXF) // STAGES) & 1)
        _ask(desc_k1, desc_k4, ring, ready, meta, row0, col0, j, STAGES, TILED)


@gluon.jit
def stream_step_ws_kernel(desc_k1, desc_k4, w1_ptr, w4_ptr, table_ptr, counts_ptr, arena_ptr, flags_ptr,
                          table_stride, MODE: gl.constexpr, TILED: gl.constexpr, COUNTED: gl.constexpr,
                          STAGES: gl.constexpr, MAXF: gl.constexpr, L2_AHEAD: gl.constexpr, BN: gl.constexpr,
                          num_warps: gl.constexpr):
    pid = gl.program_id(0)
    ring = gl.allocate_shared_memory(gl.float16, [STAGES, BN, BK], desc_k1.layout)
    # the phase's input vector in BK chunks (a tile's chunk is one index away)
    xs = gl.allocate_shared_memory(gl.float32, [XCHUNKS, BK], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    n = gl.load(counts_ptr + pid)
    tab = table_ptr + pid * table_stride
    gl.warp_specialize([
        (_consume, (ring, xs, ready, empty, tab, n, arena_ptr, flags_ptr, MODE, COUNTED, STAGES, BN, num_warps)),
        (_load, (desc_k1, desc_k4, w1_ptr, w4_ptr, ring, ready, empty, tab, n, STAGES, MAXF, TILED, L2_AHEAD,
                 BN * BK * 2)),
    ], [1], [48])


@gluon.jit
def stream_step_kernel(desc_k1, desc_k4, table_ptr, counts_ptr, arena_ptr, flags_ptr, table_stride,
                       MODE: gl.constexpr, TILED: gl.constexpr, COUNTED: gl.constexpr, STAGES: gl.constexpr,
                       BN: gl.constexpr, num_warps: gl.constexpr):
    """One role: the program asks for tile j + STAGES after tile j's work."""
    pid = gl.program_id(0)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    ring = gl.allocate_shared_memory(gl.float16, [STAGES, BN, BK], desc_k1.layout)
    xs = gl.allocate_shared_memory(gl.float32, [XCHUNKS, BK], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    n = gl.load(counts_ptr + pid)
    tab = table_ptr + pid * table_stride
    rows_t, f, cur, nxt = _table_start(tab, gl.BlockedLayout([1, NF], [32, 1], [num_warps, 1], [1, 0]))
    for s in gl.static_range(STAGES):
        if (s < n) & ((MODE & NO_RING) == 0):
            m, r, c, _, _, _, _, _ = _entry(cur, s, rows_t, f)
            _ask(desc_k1, desc_k4, ring, bars, m, r, c, s, STAGES, TILED)
    rows, xcols, acc = _work_start(blk, BN, num_warps)
    seg_tiles = 0
    for j in range(n):
        cur, nxt = _table_turn(tab, cur, nxt, j, rows_t, f)
        meta, _, col0, out_off, in_off, k_len, out_end, want = _entry(cur, j, rows_t, f)
        # the ring's tile: from the next block only once it is needed (a branch, so the fresh
        # block's registers are not waited on before then)
        if j % 32 + STAGES < 32:
            a_meta, a_row, a_col, _, _, _, _, _ = _entry(cur, j + STAGES, rows_t, f)
        else:
            a_meta, a_row, a_col, _, _, _, _, _ = _entry(nxt, j + STAGES, rows_t, f)
        if (meta & 2) != 0:
            _open_phase(arena_ptr, flags_ptr, xs, meta >> 8, in_off, k_len, want, xcols, MODE, COUNTED)
        slot = j % STAGES
        if (MODE & NO_RING) == 0:
            mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
        acc = _tile_products(ring, xs, slot, col0, acc, blk, MODE)
        if (j + STAGES < n) & ((MODE & NO_RING) == 0):
            _ask(desc_k1, desc_k4, ring, bars, a_meta, a_row, a_col, j + STAGES, STAGES, TILED)
        acc, seg_tiles = _close_tile(arena_ptr, flags_ptr, acc, seg_tiles, meta, out_off, out_end, rows, MODE,
                                     COUNTED)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
