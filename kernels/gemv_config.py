"""Launch layouts of the decode GEMV (gemv.py), host side: for each decode linear, the weight
tiles, the K chunks and how they add up (the arithmetic a row's bits depend on: a function of
the layer alone), and the programs, warps and pipeline stages (which follow the row count).
Every rule cites the GPU timing it came from.
"""
import os

import triton

from ._fixed_merge import MAX_FIXED_PARTS
from ._tuning import env_choice, env_int
from .gemv_fma import VOCAB_N
from . import gemv_slab

BLOCK_M = 16  # rows per tl.dot (a config may take 64): the minimum MMA height
SMALL_M = 64  # the most rows of the decode GEMV: linear sends M <= SMALL_M here
# rows x K from which a layernorm linear past 16 rows (K >= 1024) runs 64-row tiles: gpt2-xl
# (K = 1600) gained from 32 rows, gpt2-large (1280) and gpt2-medium (1024) lost at 32 and gained
# at 64 (timed when these layers normalized apart, before the layernorm was folded)
TALL_MIN = 48 * 1024
# output width below which a K >= 1024 layer without a layernorm adds its chunk sums in two
# groups and runs two programs a 64-column block past 16 rows (gpt2's mlp-out; chunk_groups)
NARROW_N = 1024
# the least K of a wide layer that takes one 32-row tile at 17-32 rows and one 64-row tile past
# that in half precision (gpt2's qkv and fc, K = 768; decode_config). There a row's bits match the
# 16-row layouts' (32 rows: fp16 and fp32, 12 random draws, H100; 64 rows: fp16, H100 and H200);
# at K = 96 its statistics added up another way, as the split and looping 16-row programs' did
# then (test_gemv_layernorm_same_rows_at_any_batch). Such narrow rows now add their statistics in
# a fixed order (_epilogue.SUM_IN_ORDER_GROUPS); they keep 16-row tiles, never timed against these
ROWS32_MIN_K = 512
STAGE_FIRST = os.environ.get("MINILLM_STAGE_FIRST", "1") != "0"  # see stage_first
# see tma_weights: "1" or "0" forces the tensor-descriptor weight tiles on or off (A/B timing)
TMA_WEIGHTS = env_choice("MINILLM_TMA_WEIGHTS", "auto", ("auto", "0", "1"))
# see slab_layout: the fewest rows that take it; MINILLM_SLAB_MIN_ROWS=65 turns it off (A/B timing)
SLAB_MIN_ROWS = env_int("MINILLM_SLAB_MIN_ROWS", 33)
CHUNK_GROUPS_ON = os.environ.get("MINILLM_GROUP_SPLIT", "1") != "0"  # see chunk_groups
# see chunk_groups: MINILLM_CHUNK_GROUPS=N adds gpt2's mlp-out chunk sums in N groups (A/B timing)
CHUNK_GROUPS = env_int("MINILLM_CHUNK_GROUPS", 4, minimum=1)
# see slab_layout: MINILLM_GROUP_SLAB=N runs chunk groups from N rows (17-64) as slabs, 0 never (A/B timing)
GROUP_SLAB_MIN_ROWS = env_int("MINILLM_GROUP_SLAB", 17)
# pipeline stages of the looping chunk-group programs (gpt2's mlp-out past 16 rows where the group
# slabs are off; decode_config); MINILLM_GROUP_STAGES=N forces N (A/B timing: with two groups, 5
# and 6 stages were even at gpt2 batch 64, bench/results/h200/session-83/call1-ab.log)
GROUP_STAGES = env_int("MINILLM_GROUP_STAGES", 4, minimum=1)
# see fixed_split: "1" or "0" forces it on or off
GEMV_FIXED = env_choice("MINILLM_GEMV_FIXED", "auto", ("auto", "0", "1"))


def decode_config(M, N, K, itemsize=2, ln=False, *, sms):
    """Launch parameters for M rows of an (K -> N) layer. The arithmetic is where K is cut into
    chunks (CHUNKS of whole BLOCK_Ks, each summed afresh): a function of (N, K, dtype) alone, so
    a row's result is the same at every M <= 64. The layout (SPLIT, BLOCK_N, BLOCK_M, warps)
    follows M, and so may BLOCK_K where there is one chunk (vocabulary heads): inside a chunk one
    accumulator is carried over K in the same 16-wide MMA steps. Chosen from
    scripts/bench_gemv.py sweeps on an H200 (bench/results/h200/gemv-sweep-*.json):
    - a chunk is one weight tile, so a program requests all its weights at once, before it
      waits on the previous kernel: 128 x 256 tiles (64 KB) for K >= 1024, 128 x 128 below;
    - past 16 rows one program loops over the chunks: the split partials of many rows cost
      more than they save;
    - vocabulary heads: column blocks alone fill the GPU, one pipelined loop over K; past 16
      rows in one 64-row tl.dot (BLOCK_M), which the GPU tests show gives a row the same bits as
      16-row tiles (one accumulator carried over K in the same 16-wide steps, whatever BLOCK_K).
    - a (folded) layernorm linear (ln: gpt2-xl's qkv and fc, wide) at K >= 1024 and TALL_MIN
      rows x K runs 64-row tiles, which its column blocks fill the GPU with: without the
      layernorm gpt2-xl's qkv took 10.0 us on them at 64 rows against 16.3 on 16-row tiles
      (bench/results/h200/batch-decode-linears-probe-6c89ea8.json).
    fp32 takes half the BLOCK_K (twice the bytes per element). num_stages (software pipelining
    of the looping layouts; the arithmetic stays the same) from `bench_gemv.py --stages`. sms:
    the GPU's multiprocessors (`_tuning.sm_count`; 132 on an H100 SXM or an H200)."""
    shrink = 2 if itemsize > 2 else 1
    if N >= VOCAB_N:
        # timed with the layernorm folded in (bench/results/h100/folded-layernorm.md, H100):
        # past 16 rows 64-row tiles, so W crosses L2 once (gpt2 at 64 rows 46.7 -> 36.5 us; they
        # lost while every K step normalized x); gpt2 at one row 64 x 128 tiles, 31.3 -> 28.5 us
        if M > BLOCK_M and K >= 1024:  # (gpt2-xl at 64 rows: 71 us, the best of 9 layouts on an H200)
            return dict(BLOCK_N=128, BLOCK_K=128 // shrink, CHUNKS=1, SPLIT=False, num_warps=8, BLOCK_M=64,
                        num_stages=3)
        if M > BLOCK_M:
            return dict(BLOCK_N=64, BLOCK_K=64 // shrink, CHUNKS=1, SPLIT=False, num_warps=4, BLOCK_M=64,
                        num_stages=3)
        if K < 1024:  # (one row of out-major weights up to K = 1024 runs on CUDA cores instead: vocab_fma.py)
            return dict(BLOCK_N=64, BLOCK_K=128 // shrink, CHUNKS=1, SPLIT=False, num_warps=4, BLOCK_M=BLOCK_M,
                        num_stages=3)
        # gpt2-xl at one row: 56.7 -> 44.2 us on an H200 (bench/results/h200/lm-head-layouts.md)
        return dict(BLOCK_N=128, BLOCK_K=64 // shrink, CHUNKS=1, SPLIT=False, num_warps=4, BLOCK_M=BLOCK_M,
                    num_stages=3)
    block_k = (256 if K >= 1024 else 128) // shrink
    chunks = triton.cdiv(K, block_k)
    groups = chunk_groups(N, K, ln)
    if M <= BLOCK_M:
        block_n = 128
        # from K = 1024 narrower column blocks until there is a program per SM: gpt2-medium's
        # attn-out (4 chunks) ran 32 programs. H100, alternated in one call: gpt2-medium batch 1
        # 1,547 -> 1,798 tok/s, gpt2-large 929 -> 955, gpt2-xl 583 -> 598. Below 1024 (gpt2 at
        # batch 4 and 8) it gained under 1% and the first token came later
        while K >= 1024 and block_n > 32 and triton.cdiv(N, block_n) * chunks < sms:
            block_n //= 2
        return dict(BLOCK_N=block_n, BLOCK_K=block_k, CHUNKS=chunks, SPLIT=True, num_warps=4, CHUNK_GROUPS=groups)
    slab = slab_layout(M, K, itemsize, groups, block_k, chunks)
    if slab is not None:
        return slab
    if K < 1024 and N >= 2 * K:
        if itemsize != 2 or K < ROWS32_MIN_K:  # (fp32 and narrow K keep 16-row tiles: see ROWS32_MIN_K)
            return dict(BLOCK_N=128, BLOCK_K=block_k, CHUNKS=chunks, SPLIT=False, num_warps=8)
        # gpt2's qkv and fc, the same bits either way (ROWS32_MIN_K):
        # - 17-32 rows: one 32-row tile a 64-column block. H100, alternated in one call: gpt2 batch 32
        #   84.1k -> 85.9k tok/s (qkv) and 85.4k (fc), both: 84.7k -> 87.0k, batch 24 63.6k -> 66.0k;
        #   at 64 rows it lost (qkv -3.7%, fc even), and so did 128-column blocks in 8 warps (batch
        #   32 -10%; bench/results/h100/rows32.md);
        # - past 32 rows (where slab_layout does not take them: K of 769-1023, or the slab switched
        #   off): one 64-row tile a 32-column block. Alone at 64 rows qkv 5.62 -> 5.38 us, fc
        #   5.87 -> 5.52 (the best of 16 layouts); gpt2 batch 64 153.5k / 154.2k -> 158.2k / 157.9k
        #   tok/s, batch 48 +3.0%, batch 40 +2.8%, the same ids (H200, alternated in one call;
        #   bench/results/h200/tall-narrow-ab.log)
        rows32 = M <= 2 * BLOCK_M
        return dict(BLOCK_N=64 if rows32 else 32, BLOCK_K=block_k, CHUNKS=chunks, SPLIT=False, num_warps=4,
                    BLOCK_M=2 * BLOCK_M if rows32 else 64, num_stages=4)
    if K < 1024:  # four stages of these small tiles (12 KB each): 3.55 against 4.1 us at M = 64
        return dict(BLOCK_N=32, BLOCK_K=block_k, CHUNKS=chunks, SPLIT=False, num_warps=4, num_stages=4)
    if ln and M * K >= TALL_MIN:  # one 64-row tile, two K steps a chunk (the same arithmetic)
        return dict(BLOCK_N=64, BLOCK_K=block_k // 2, CHUNKS=chunks, SPLIT=False, num_warps=4, BLOCK_M=64)
    if groups > 1:  # (where slab_layout does not take them: MINILLM_GROUP_SLAB)
        # gpt2's mlp-out (3072 -> 768), timed in its former two groups: two programs a 64-column
        # block, each over its half of K: x is read half as often as by 32-column loops over all
        # of K (below). H100, 64 rows
        # alone 7.89 -> 7.38 us; gpt2 batch 64 138.8k -> 145.6k tok/s, batch 32 80.7k -> 84.1k,
        # batch 8 -0.5% (alternated in one call; bench/results/h100/twenty-first-session.md)
        return dict(BLOCK_N=64, BLOCK_K=block_k, CHUNKS=chunks, SPLIT=False, GROUP_SPLIT=True, CHUNK_GROUPS=groups,
                    num_warps=4, num_stages=GROUP_STAGES)
    if N < NARROW_N and not ln:  # (a layernorm's row sums over 2 warps would round another way)
        # gpt2's mlp-out (3072 -> 768) ran 48 programs of 64 columns at 64 rows; 32-column blocks in
        # two warps: 9.85 -> 7.03 us alone, gpt2 batch 64 135.5k -> 141.3k tok/s, batch 32 81.0k ->
        # 83.1k (H100, alternated in one call). Wider outputs lost end to end (gpt2-medium batch 64
        # -3%, gpt2-xl -15%) though gpt2-xl's layers gained alone (bench/results/h100/narrow-mlp-out.md)
        return dict(BLOCK_N=32, BLOCK_K=block_k, CHUNKS=chunks, SPLIT=False, num_warps=2, num_stages=4)
    # four stages (160 KB of shared memory): gpt2-xl batch 64 16.9k -> 20.3k tok/s, batch 32 10.0k
    # -> 11.7k, gpt2 batch 64 +1% end to end on an H200
    return dict(BLOCK_N=64, BLOCK_K=block_k, CHUNKS=chunks, SPLIT=False, num_warps=4, num_stages=4)


def slab_layout(M, K, itemsize, groups=1, block_k=128, chunks=1):
    """The SLAB layout (gemv_slab.py) for M rows of a layer of K inputs, or None: half precision,
    K from ROWS32_MIN_K to 768 (six 128-wide chunks; gpt2's qkv, attn-out and fc), past 32
    rows: one 64-row tile a 32-column block, the chunks of gemv.py's layouts (the same bits).
    Alternated twice in one call against gemv.py's layouts (bench/results/h200/slab-ab-32c5898.log,
    h100/slab-ab-32c5898.log): gpt2 batch 64 157,979 -> 165,646 tok/s on an H200 (+4.8%) and
    150,114 -> 157,523 on an H100 (+4.9%), batches 33-48 +4.1% to +4.7%. In its first form
    (h200/slab-ab-23275e5.log) qkv and fc alone gained 1.2-1.8%, attn-out the rest; 8 warps lost
    0.7%. The ids of those batches changed, as attn-out's row statistics (fc's layernorm) add up
    in the 64-row tile's order. mlp-out's two chunk groups as slabs of 32 rows lost 8.7%
    (h200/slab-groups-ab-32c5898.log)."""
    if itemsize != 2:
        return None
    if groups > 1:  # gpt2's mlp-out: a program a chunk group (see chunk_groups)
        if not GROUP_SLAB_MIN_ROWS or M < max(GROUP_SLAB_MIN_ROWS, BLOCK_M + 1) or gemv_slab.PIPELINED_ENV <= 1:
            return None
        return dict(BLOCK_N=32, BLOCK_K=block_k, CHUNKS=chunks, CHUNK_GROUPS=groups, SPLIT=False, SLAB=True,
                    num_warps=4, BLOCK_M=64)
    if M < max(SLAB_MIN_ROWS, 2 * BLOCK_M + 1) or not ROWS32_MIN_K <= K <= 128 * gemv_slab.MAX_CHUNKS:
        return None
    return dict(BLOCK_N=32, BLOCK_K=128, CHUNKS=triton.cdiv(K, 128), SPLIT=False, SLAB=True, num_warps=4, BLOCK_M=64)


def chunk_groups(N, K, ln):
    """Groups the chunk sums of an (K -> N) layer are added in (see _gemv_kernel): part of the
    arithmetic, so a function of the layer alone. Four for wide-K layers with a narrow output
    and no layernorm (gpt2's mlp-out: 12 chunks of 256), one elsewhere. Past 16 rows such a
    layer runs a program a group: from 17 rows a 64-row slab a 32-column block (slab_layout,
    gemv_slab.py: the group's weights asked into L2 before the wait, all its chunks in flight
    after it), else a 16-row program a 64-column block (GROUP_SPLIT). H200, alternated twice in
    one call (bench/results/h200/session-83/call3-ab.log, call2-ab.log): against two groups in
    16-row programs, gpt2 batch 64 171.6k -> 175.9k / 176.8k tok/s (+2.7%; +2.5% in call 2),
    batch 48 +2.5%, batch 32 +4.0%, batches 2-16 even (-0.1% to +0.6%). Four groups in 16-row
    programs lost 8.9% at batch 64 (gained 2.9% at 32), two groups as slabs (6 chunks, 4 in
    flight, 48 programs) 1.6%, three (72 programs of 4 chunks) 1.7%
    (bench/results/h200/session-100/call6-ab6.log). The ids of gpt2 batch 16-64 changed (a row's
    bits, now the same at 2-64 rows in the new order).
    MINILLM_CHUNK_GROUPS=N makes it N groups (2: the former arithmetic), MINILLM_GROUP_SPLIT=0
    one group and the looping program on 32-column blocks (A/B timing)."""
    return CHUNK_GROUPS if CHUNK_GROUPS_ON and K >= 1024 and N < NARROW_N and not ln else 1


def stage_first(meta, M, K, ln):
    """Whether a split program (few rows) stages its first weight tile for the tensor cores
    before its wait. The tile is loaded into registers there, but Triton moves it through shared
    memory into the MMA layout only where the first tl.dot uses it, after the wait; a product of
    zero rows with it before the wait (an accumulator of +0.0: the bits do not change) makes
    that copy happen early. Timed end to end on an H100, alternated in one call
    (bench/results/h100/few-row-decode.md); the gains depend on which kernels launch early
    (minillm.decode_plan.early_roles), and so follow the rows:
    - 5 to 8 rows, every gpt2 layer: batch 8 29.4k -> 30.8k tok/s (+4.5%);
    - 9 to 16 rows, the wide layers without a layernorm in tiles up to 256 x 64 (gpt2's
      mlp-out): batch 16 48.0k -> 50.6k (+5.4%; staging every layer: +2.9%);
    - it lost up to 4 rows (gpt2 batch 4 -2.5% to -6%), on wide tiles with a layernorm
      (gpt2-medium batch 1 -6%, gpt2-xl -21%) and in the looping layout (gpt2 batch 64 -1.8%).
    MINILLM_STAGE_FIRST=0 turns it off (A/B timing)."""
    if not meta["SPLIT"] or not STAGE_FIRST or M <= 4:
        return False
    small_wide = K >= 1024 and not ln and meta["BLOCK_K"] * meta["BLOCK_N"] <= 256 * 64
    return small_wide or (M <= 8 and K < 1024)


def tma_weights(meta, M, triton_version):
    """Whether the program's weight tiles come by tensor descriptor (TMA), straight into shared
    memory, rather than by pointer loads. Which is faster depends on the compiler and the layout
    (H200, alternated in one call; bench/results/h200/tma-weight-tiles.md):
    - split programs (up to 16 rows; their one tile is their whole slab, fetched before the
      wait): under Triton 3.6 pointer loads, which it stores to shared memory before the wait
      and reads back beside the MMAs (80-128 registers; the descriptor's tile is read into
      registers before the wait instead, 168-172): gpt2-xl batch 1 757 against 739 tok/s (TMA,
      capped at 168 registers), gpt2 batch 8 33.2k against 32.0k; only gpt2-xl batch 2 lost
      (1,167 against 1,199). Triton 3.9 (the one CI installs with torch 2.13) holds a
      pointer-loaded tile in registers across the wait and stores it only at the MMA (230-239
      registers; two 64 KB programs an SM instead of three): the descriptor there, gpt2-xl
      batch 1 591 -> 757 tok/s, batch 2 1,035 -> 1,204, gpt2 batch 8 32.3k -> 32.9k;
    - looping layouts past 32 rows, under either version (the pipelined tiles then need no
      registers on their way to shared memory: gpt2's mlp-out at 64 rows 253 -> 128, qkv 148
      -> 94 under 3.9): gpt2 batch 64 146.3k -> 156.5k tok/s under 3.9, even under 3.6 (154.2k);
      gpt2-xl batch 64 19.1k -> 21.0k under 3.9, 20.0k -> 20.9k under 3.6. At 17-32 rows it
      lost (gpt2 batch 32 -3.1% under 3.6, -0.9% under 3.9; the vocabulary head's 16-row loop
      at batch 16 -1.1% under 3.9). At 33-63 rows, timed later on an H100: gpt2 batch 40 / 48
      +6.8% / +6.2% under 3.9, +0.7% / +0.6% under 3.6, gpt2-xl batch 48 +4.8% under 3.6
      (bench/results/h100/tma-weak-points-1ae1017.log).
    MINILLM_TMA_WEIGHTS=1 or 0 forces it on or off everywhere."""
    if TMA_WEIGHTS in ("0", "1"):
        return TMA_WEIGHTS == "1"
    if meta["SPLIT"]:
        return triton_version > (3, 6)
    return M > 2 * BLOCK_M


def split_maxnreg(meta, itemsize):
    """A register cap for a split program whose weight tile arrives by tensor descriptor, or
    None. A 64 KB tile (128 x 256 fp16, gpt2-xl at few rows) lets three programs share an SM's
    shared memory; 168 registers a thread (65,536 / (3 x 128 threads), in the allocator's steps
    of 8) lets them share its registers too. The compiler took 168-172 unbounded and spilled
    nothing at 168 when this was timed (scripts/check_compile.py); at 172, two programs fit:
    gpt2-xl batch 1 663 -> 757 tok/s under Triton 3.9, 667 -> 739 under 3.6 (H200,
    bench/results/h200/tma-weight-tiles.md).
    fp32 tiles (128 x 128) spill with or without it, and are left to the compiler. Compiled
    again in the sixty-third session (Triton 3.9.0, sm_90a): gpt2-xl's qkv and fc tiles at one
    row keep 8 bytes of local memory a thread at 168 (32 with the one-atomic merge), at two rows
    32-136 bytes (bench/results/h200/gemv-fixed-merge/README.md); not timed since."""
    if meta["SPLIT"] and itemsize == 2 and meta.get("num_warps", 4) == 4 and meta["BLOCK_M"] == BLOCK_M and \
            meta["BLOCK_K"] * meta["BLOCK_N"] >= 32768:
        return 168
    return None


def fixed_split(parts, whole_tiles, rows):
    """Whether the split programs' partials meet by the one-atomic merge (_fixed_merge.py: each
    element's K chunks add up in an int64 word, and the chunk completing it runs its epilogue)
    instead of stored partials, an arrival counter and the last arriver's read-back. Not where
    whole_tiles (row statistics or the fused argmax go out: they need a whole column block in
    one program).
    The arithmetic differs (each chunk's sum truncated to units of 2**-24, then added exactly),
    so a row alone no longer has the bits it has among 2 to 64 rows, as with gemv_fma.py.
    H200 (bench/results/h200/gemv-fixed-merge/), the same ids at one row:
    - one row, alternated twice in one call: gpt2-medium 2,141 / 2,146 -> 2,280 / 2,283 tok/s
      (+6.4%; its qkv and fc, 4 chunks each), gpt2-large 1,244 / 1,246 -> 1,279 / 1,278 (+2.7%),
      gpt2-xl 756 -> 757 (even; 7 chunks: its qkv and fc got 1.1 and 1.5 us shorter in the
      graph profile, the kernel after each as much longer);
    - more rows lost (one round): gpt2 batch 2 9,213 -> 8,661 (-6.0%), batch 8 32,932 -> 27,448
      (-16.7%), gpt2-xl batch 2 1,226 -> 1,168 (-4.7%). Not profiled; likely the atomics, one
      returning 8-byte round trip per (row, column), where stored partials move as vectors.
    MINILLM_GEMV_FIXED=1 or 0 forces it on or off wherever it can run (A/B timing)."""
    if whole_tiles or not 1 < parts <= MAX_FIXED_PARTS:
        return False
    if GEMV_FIXED in ("0", "1"):
        return GEMV_FIXED == "1"
    return rows == 1


def chunk_count(K, block_k, chunks):
    """Non-empty chunks when K is cut into `chunks` pieces of whole block_ks."""
    k_chunk = triton.cdiv(K, chunks * block_k) * block_k
    return triton.cdiv(K, k_chunk)


def partial_count(meta):
    """Programs along K, whose partial sums meet through an arrival counter: one per chunk
    (SPLIT), one per non-empty group of chunks (GROUP_SPLIT), or one looping program."""
    chunks, groups = meta["CHUNKS"], meta["CHUNK_GROUPS"]
    per = triton.cdiv(chunks, groups)  # the kernel's PER
    if meta["SPLIT"] and meta["GROUP_SPLIT"]:
        raise ValueError("_config: expected SPLIT or GROUP_SPLIT, not both")
    if meta["SPLIT"]:
        return chunks
    if meta["GROUP_SPLIT"]:
        return triton.cdiv(chunks, per)
    if groups > 1:
        raise ValueError(f"_config: CHUNK_GROUPS {groups} needs SPLIT or GROUP_SPLIT (the looping program adds its "
                         "chunks ungrouped)")
    return 1


# layouts scripts/bench_gemv.py sweeps besides its grid of one-tile chunks (BLOCK_N, BLOCK_K,
# CHUNKS, SPLIT, warps); CHUNKS 64 means one weight tile per chunk at every GPT-2 width
CANDIDATES = [(128, 128, 64, True, 4), (128, 256, 64, True, 4), (64, 512, 64, True, 4), (64, 128, 8, True, 4),
              (64, 256, 64, False, 4), (128, 128, 64, False, 8), (128, 128, 1, False, 8)]
