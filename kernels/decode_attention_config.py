"""Launch layouts of the split-K decode attention (decode_attention.py), host side: for (row,
head) pairs over a cache length, the splits, the tile (rows and warps), the tiles read before the
dependent-launch wait, how the loop reads its tiles (pointer loads or tensor descriptors), its
pipeline stages and the form the new row takes. The arithmetic of a split is the same in every
layout; each rule cites the GPU timing it came from.
"""
import os

import triton

from ._tuning import env_int, layout_switch, sm_count

# cache tiles a program of the narrow unsplit layout reads before its wait (prefetch_tiles);
# MINILLM_ATTN_PREFETCH_TILES=N forces N there, 0 none (A/B timing)
PREFETCH_TILES_ENV = env_int("MINILLM_ATTN_PREFETCH_TILES", minimum=0)
# cache positions (the allocated length) from which the narrow unsplit layout's loop is
# software-pipelined (loop_stages); MINILLM_ATTN_STAGES=N forces N stages everywhere (A/B timing)
PIPELINE_MIN_L = 512
LOOP_STAGES_ENV = env_int("MINILLM_ATTN_STAGES")
# (BLOCK_N, num_warps) of the narrow unsplit layout of many rows (default_layout);
# MINILLM_ATTN_NARROW=BLOCK_NxWARPS forces another (A/B timing)
NARROW_ENV = layout_switch("MINILLM_ATTN_NARROW", os.environ.get("MINILLM_ATTN_NARROW"), "BLOCK_NxWARPS", "32x2",
                           pow2=2)
NARROW = NARROW_ENV or (32, 2)
# the narrow tiles in one-warp programs, from half the programs wanted over a short cache
# (default_layout); MINILLM_ATTN_ONE_WARP=0 turns that off (A/B timing), and MINILLM_ATTN_NARROW
# (set) replaces it too
ONE_WARP = (NARROW[0], 1)
ONE_WARP_ENV = env_int("MINILLM_ATTN_ONE_WARP", 1)
if ONE_WARP_ENV not in (0, 1):
    raise ValueError(f"MINILLM_ATTN_ONE_WARP: expected 0 or 1, got {ONE_WARP_ENV}")
ONE_WARP_ON = ONE_WARP_ENV == 1
# splits of the narrow tiles over long caches at fewer pairs than programs wanted (default_layout);
# MINILLM_ATTN_LONG_SPLITS=0 turns that layout off (A/B timing)
LONG_SPLITS = env_int("MINILLM_ATTN_LONG_SPLITS", 8)
if LONG_SPLITS < 0 or LONG_SPLITS & (LONG_SPLITS - 1):
    raise ValueError(f"MINILLM_ATTN_LONG_SPLITS: expected 0 or a power of two, got {LONG_SPLITS}")
# see new_row_apart; MINILLM_ATTN_NEW_APART=1 or 0 forces the form everywhere (A/B timing)
NEW_APART_ENV = env_int("MINILLM_ATTN_NEW_APART")
if NEW_APART_ENV not in (None, 0, 1):
    raise ValueError(f"MINILLM_ATTN_NEW_APART: expected 0 or 1, got {NEW_APART_ENV}")


# see tma_tiles; MINILLM_ATTN_TMA=1 or 0 forces the descriptors on or off wherever the caches allow
# them (A/B timing)
TMA_ENV = env_int("MINILLM_ATTN_TMA")
if TMA_ENV not in (None, 0, 1):
    raise ValueError(f"MINILLM_ATTN_TMA: expected 0 or 1, got {TMA_ENV}")


def _programs_wanted(device):
    """Programs that cover the SMs a few times over (the interpreter stands for 2 SMs)."""
    return 4 * sm_count(device)


def _num_splits(wanted, bh, L, block_n):
    """Enough programs (`wanted`) to cover the SMs a few times over, each with at least one full
    tile (block_n positions): on an H200 thinner splits cost more in the merge than they save
    (scripts/bench_decode_attention.py)."""
    splits = 1
    while bh * splits < wanted and splits * 2 * block_n <= L and splits < 64:
        splits *= 2
    return splits


def _narrow(block_n, warps):
    """Whether (BLOCK_N, num_warps) is the narrow unsplit layout, in two warps or in one."""
    return (block_n, warps) in (NARROW, ONE_WARP)


def _base_layout(block_d):
    """(BLOCK_N, num_warps) of a tile: 64 or 32 cache rows, 8 or 16 KB of fp16 keys."""
    return (64, 4) if block_d <= 64 else (32, 8)


def default_layout(device, bh, L, block_d):
    """(splits, BLOCK_N, num_warps) for bh (row, head) pairs over L cache positions."""
    block_n, warps = _base_layout(block_d)
    wanted = _programs_wanted(device)
    splits = _num_splits(wanted, bh, L, block_n)
    short = splits > 1 and L <= 4 * block_n  # (splits > 1: fewer pairs than programs wanted)
    if block_d <= 64 and (bh >= wanted or (short and bh >= wanted // 3)):
        # many rows: narrow tiles, two warps a program (or one: below), unsplit. (Row, head) pairs that fill
        # the GPU alone (batch 64, L = 256: 13.0 against 15.4 us on an H200), or a short cache and
        # a third of the programs wanted (gpt2 batch 16: 44.2k to 49.1k tok/s, batch 32: 60.9k to
        # 73.1k, gpt2-xl batch 8 +3%; at gpt2 batch 4 and 8 slower: 15.9k to 14.7k, 29.4k to
        # 27.7k): the one-tile programs below held the SMs the next linear starts on.
        # From half the programs wanted (one tile read before the wait: prefetch_tiles) over a
        # cache under PIPELINE_MIN_L (the unpipelined loop: loop_stages), one warp a program:
        # every reduction of the online softmax stays in the warp, with no shared-memory round
        # trip or barrier in its chain. Traced at gpt2 batch 64 (H200, scripts/trace_decode.py
        # --stamp attn-*), two warps spent ~0.9 us attending the tile already in registers and
        # ~2.7 us on each later tile, though its bytes arrive sooner (an L2 request for them did
        # not help: fifty-seventh session); one warp: the launch 9.6 -> 8.6 us. H200, alternated
        # twice (bench/results/h200/session-85/call4-ab.log, call5-ab.log, call6-ab.log): gpt2
        # batch 64 +3.4% / +4.0%, 48 +3.8%, 40 +3.4%, 32 +3.2%, 24 +3.1%, gpt2-xl batch 64 +3.8%
        # (one round); at gpt2 batch 16 (four tiles before the wait) one warp lost 6.9%
        if ONE_WARP_ON and NARROW_ENV is None and 2 * bh >= wanted and L < PIPELINE_MIN_L:
            return 1, *ONE_WARP
        return 1, *NARROW
    if block_d <= 64 and LONG_SPLITS and L >= 1024 and wanted * 3 // 4 <= bh < wanted:
        # a long cache and three quarters of the programs wanted: many narrow programs of a
        # 128-position chunk, not pipelined. Alternated in one call, 768-token prompts
        # (bench/results/h200/attention-long-splits-ab.log, h100/...): gpt2-xl batch 16 (400 pairs)
        # +10.3% on an H200 (4,155 -> 4,580 tok/s), +5.4% on an H100. Alone (h200/...-sweep.log, 900
        # positions) it beat the split layouts below from gpt2 batch 4 to 40 (batch 32 40.3 -> 29.5
        # us), but not in the step: gpt2's batch bucket of 32 (384 pairs) gained at batch 32 (+8.2%
        # H200, +1.0% H100) and lost at batch 24 (even, -6.1%); batch 8 -3.4%, 16 -9.8%, gpt2-xl
        # batch 8 -5.9% (H200), and at 512 positions gpt2 batch 24 -4.9%
        return LONG_SPLITS, *NARROW
    if block_d <= 64 and short:
        # a short cache and few rows: one program per (row, head) and one tile of the whole
        # cache, read before the wait, no merge (L = 128: 2.1 against 3.3 us at batch 1 on an
        # H200; L = 256: gpt2 batch 1 +4% and batch 8 +10% end to end). Not at batch 64, where the
        # step got slower with them (a profile: 11.0 against 7.7 us at L = 128)
        block_n = triton.next_power_of_2(L)  # 128 or 256
        warps = 4 if block_n <= 128 else 8
        splits = _num_splits(wanted, bh, L, block_n)
    return splits, block_n, warps


def prefetch_tiles(device, bh, block_n, warps, chunk):
    """Cache tiles of block_n rows a program reads before its wait (prefetch_cache): at most its
    chunk, in a power of two (0, none, only where forced). One, except in the narrow unsplit
    layout (default_layout) with fewer (row, head) pairs than half the programs wanted: four.
    H200, alternated in one call (bench/results/h200/attention-prefetch-tiles-ab.log): gpt2 batch
    16 (192 pairs) 52.0k / 52.3k -> 53.9k / 53.9k tok/s, batch 20 and 24 even; with two tiles
    batch 16-64 lost 2-3%, with four batch 32 -1% and batch 64 -7.6% (their programs held the SMs
    the next linear starts on). With none (one-warp programs) batch 64 -1.9%, 48 -1.8%, 32 -2.6%:
    qkv, which runs beside the reads, took 1.4 us less and the attention 1.4 us more
    (bench/results/h200/session-86/call4-*)."""
    tiles = 1
    if _narrow(block_n, warps):
        tiles = PREFETCH_TILES_ENV if PREFETCH_TILES_ENV is not None else 4 if 2 * bh < _programs_wanted(device) else 1
    while tiles > 1 and tiles * block_n > chunk:
        tiles //= 2
    return tiles


def tma_tiles(L, block_n, warps, splits=1, tma_ok=True):
    """Whether the cache loop reads its tiles by tensor descriptors (one copy a tile into shared
    memory; with loop_stages' 3 stages the next two tiles are asked for while one is attended):
    where the caches allow it (tma_ok: decode_attention._tma_ok), in the one-warp programs of
    default_layout, whose loop the pointer loads leave unpipelined there. H200, alternated in
    fresh processes, the same ids (bench/results/h200/session-118/, calls 4 and 5, two hosts):
    gpt2 batch 64 +1.0% (two rounds) and +1.2% (three: 183,375 / 183,491 / 183,688 -> 185,714 /
    185,787 / 185,655 tok/s), batch 32 +0.9% and +0.5%; in 1 stage -4.7% and -5.1%, in 2 +1.0%
    and -2.0%. As the default against MINILLM_ATTN_TMA=0 (session-119/, one host): gpt2 batch
    24 +0.9%, 32 +0.5%, 40 +2.1%, 48 +0.2%, 64 even and +1.4%; gpt2-large 64 +0.7%, 32 even;
    gpt2-medium 64 -0.8% (twice), 48 -1.0%, 32 -0.1% (kept: nothing in the launch's shape tells its
    pairs apart from those that gain); its batch bucket of 64 gains in 4 stages instead, and gpt2's
    in 2 under the "positions" cache layout (the caller's tma_stages:
    minillm/decode_plan.attention_tma_stages, session-120/, session-125/, session-126/). Not over long
    caches: at 1,024 positions (768-token prompts, batch 64), in place of the two-warp loop's
    cp.async copies, -6.5%."""
    if not tma_ok:
        return False
    if TMA_ENV is not None:
        return bool(TMA_ENV)
    return (block_n, warps) == ONE_WARP and ONE_WARP_ON and L < PIPELINE_MIN_L and splits == 1


def loop_stages(L, block_n, warps, splits=1, tma=False, tma_stages=None):
    """Software-pipeline stages of the cache loop after the first tiles: 3 in the narrow unsplit
    layout (default_layout) over caches of PIPELINE_MIN_L positions or more or where its tiles come
    by tensor descriptors (tma: tma_tiles; there tma_stages in place of 3 where the caller gives
    it: decode_attention's tma_stages), 1 (no pipelining) elsewhere, its split form over long
    caches included (3 stages there: gpt2 batch 4 at L = 1024 5.77 -> 6.76 us, batch 32 29.47 ->
    30.66). The same arithmetic either way. H200, gpt2 unless
    named, alternated in one call, the same ids (bench/results/h200/attention-pipelined-loop-ab.log,
    -xl-ab.log):
    - 512-position caches (300-token prompts), batch 64: 106.8k / 107.0k -> 108.6k / 108.4k tok/s;
    - 1024 (768-token prompts): batch 64 69.7k / 69.2k -> 72.1k / 73.0k, batch 48 56.4k / 55.8k
      -> 60.4k / 60.7k, gpt2-medium batch 64 27.8k -> 29.2k;
    - the benchmark's 256-position cache: batch 64 -3% (157.9k / 158.2k -> 152.7k / 153.3k),
      batch 32 and 16 even;
    - the split layouts at a 1024-position cache: batch 1 -10%, batch 8 -6.5%;
    - gpt2-xl, 1024 positions: batch 64 8,618 -> 9,112 tok/s, batch 32 6,195 -> 6,738.
    On an H100 it is mixed (bench/results/h100/attention-pipelined-loop-ab.log): at 1024 positions
    gpt2 batch 48 +3.0%, gpt2-medium batch 64 +1.3%, gpt2-xl batch 64 +3.0%, but gpt2 batch 64
    -0.7% and gpt2-xl batch 32 -1.7%; at 512 gpt2 batch 64 -1.7%. Kept on both: no simple rule by
    (row, head) pairs or length separates the H100's losses from its gains (768 and 800 pairs lost, 576,
    1,024 and 1,600 gained)."""
    if LOOP_STAGES_ENV is not None:
        return LOOP_STAGES_ENV
    if tma and tma_stages is not None:
        return tma_stages
    return 3 if _narrow(block_n, warps) and (L >= PIPELINE_MIN_L or tma) and splits == 1 else 1


def new_row_apart(block_n, warps, stages, tma=False):
    """Whether the new row starts its owner's online softmax (the tiles then hold older rows only:
    no per-element select of the new row into K and V): in the narrow layout's unpipelined loop
    (default_layout, loop_stages) and in its loop of tensor-descriptor tiles (tma_tiles, which was
    timed in this form). Alternated in one call, against the select in every tile
    (bench/results/h200/decode-new-row-apart/, h100/decode-new-row-apart-*): alone, gpt2 batch
    16's launch 5.78 -> 4.50 us on an H200, gpt2-xl batch 8's 5.85 -> 4.57; end to end gpt2 batch
    16 +1.6% (H100 +2.1%), gpt2-xl batch 8 +1.2% (+1.2%), batch 32 and 64 even. Elsewhere it lost
    on the H200: gpt2 batch 8 (the whole-cache tile) -4.2%, batch 64 over 768-token prompts (the
    pipelined loop) -14.5%, though that launch alone was 3% faster. There the form needs fewer
    registers a thread (128 against 182, 80 against 107), and the old form capped to as few lost
    as much (-5.8%, -11.5%): more of its programs fit an SM, and the step gets slower."""
    if NEW_APART_ENV is not None:
        return bool(NEW_APART_ENV)
    return _narrow(block_n, warps) and (stages == 1 or tma)


def launch_layout(device, bh, L, block_d, num_splits=None, config=None, tma_ok=False, tma_stages=None):
    """(splits, chunk, meta) of a launch for bh (row, head) pairs over L cache positions: meta
    holds BLOCK_N, num_warps, PREFETCH_TILES, TMA, LOOP_STAGES and NEW_APART, from the rules above
    unless `config` (decode_attention's _config) names them; num_splits forces the split count
    with the base tiles; tma_ok: whether the caches allow tensor descriptors (TMA is never set
    without it); tma_stages: the stages of a loop of descriptor tiles (loop_stages). One
    ValueError naming the argument for a count out of range."""
    if tma_stages is not None and (not isinstance(tma_stages, int) or tma_stages < 1):
        raise ValueError(f"tma_stages: expected None or an integer >= 1, got {tma_stages!r}")
    if num_splits is None:
        splits, block_n, warps = default_layout(device, bh, L, block_d)
    else:
        splits, (block_n, warps) = int(num_splits), _base_layout(block_d)
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"num_splits: expected a power of two >= 1, got {splits}")
    meta = {"BLOCK_N": block_n, "num_warps": warps, **(config or {})}
    block_n, warps = meta["BLOCK_N"], meta["num_warps"]
    chunk = triton.cdiv(triton.cdiv(L, splits), block_n) * block_n
    if meta.get("PREFETCH_TILES") is None:
        meta["PREFETCH_TILES"] = prefetch_tiles(device, bh, block_n, warps, chunk)
    # a config's TMA too only where the caches allow descriptors: the stages and the new row's form
    # below follow the loop that actually runs
    meta["TMA"] = tma_tiles(L, block_n, warps, splits, tma_ok) if meta.get("TMA") is None else \
        bool(meta["TMA"]) and tma_ok
    if meta.get("LOOP_STAGES") is None:
        meta["LOOP_STAGES"] = loop_stages(L, block_n, warps, splits, meta["TMA"], tma_stages)
    if meta.get("NEW_APART") is None:
        meta["NEW_APART"] = new_row_apart(block_n, warps, meta["LOOP_STAGES"], meta["TMA"])
    tiles, stages = meta["PREFETCH_TILES"], meta["LOOP_STAGES"]
    if tiles < 0 or tiles & (tiles - 1):
        raise ValueError(f"PREFETCH_TILES (_config or MINILLM_ATTN_PREFETCH_TILES): expected 0 or a power of two, "
                         f"got {tiles}")
    if stages < 1:
        raise ValueError(f"LOOP_STAGES (_config or MINILLM_ATTN_STAGES): expected an integer >= 1, got {stages}")
    return splits, chunk, meta
