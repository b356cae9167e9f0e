"""Decode-time linear (M <= 64 rows): y = act(x @ W + bias) + residual, one launch, with an
optional folded layernorm (linear's ln_fold).

Few rows make this a matrix-vector product: every weight byte is read once, so the time is the
weight read plus fixed latency, and the kernel is built around that:
- K is cut into CHUNKS chunks; with few rows each chunk is its own program (more bytes in
  flight), writes an fp32 partial, and the last program of a column block to arrive (an atomic
  counter) adds the partials in chunk order and runs the epilogue. With more rows one program
  loops over the chunks and adds them in the same order, or (chunk_groups > 1: gpt2's
  mlp-out) one program per group of chunks does, and the last to arrive adds the groups. The
  chunk sums are added within the groups, then the groups, in every mode. The arithmetic
  depends on (N, K) only: a row's result is bit-identical at any M <= 64, in every mode, in
  every launch;
- row blocks (16 rows, or 64 for vocabulary heads at batch) that share a weight tile are
  neighbouring programs: W crosses the memory bus once and the other row blocks read it from L2;
- the first weight tile is loaded before anything an earlier kernel writes; decode_config
  makes a chunk one tile, so that is a split program's whole slab. With programmatic dependent
  launch (Hopper) the kernel starts while the previous one still runs, so this load and the
  launch hide behind it; gdc_wait then waits for x;
- a folded layernorm (W and bias carry its gain and shift, reference.fold_layernorm) costs the
  product nothing: x goes into the MMA as it is, and the finishing program scales its tile by
  each row's statistics, from the partial sums the producing kernel left (ln_stats) or else
  from the whole row. Normalizing x in every K step instead made gpt2's qkv and fc 1.1-1.2 us
  slower at 64 rows, gpt2-xl's twice as slow (bench/results/h200/batch-decode-linears.md);
- optional fused outputs: the rows' partial statistics for the next layernorm (stats_out) and
  greedy decoding's argmax, as keys (argmax_key.py) that every finishing program max-es into
  the row's word with a relaxed atomic: nothing waits for the other column blocks.
"""
import os

import torch
import triton
import triton.language as tl

from ._epilogue import (STATS_GROUP, _epilogue, _fold_ln, _load_bias_residual, _load_row_stats, _row_stats,
                        _store_row_stats, row_stats_block)
from ._tuning import launch, sm_count, use_pdl
from ._workspace import arrival_counters
from .argmax_key import _argmax_key
from .gemv_fma import VOCAB_N, fma_config, gemv_fma
from .vocab_fma import vocab_config, vocab_fma

BLOCK_M = 16  # rows per tl.dot (a config may take 64): the minimum MMA height
SMALL_M = 64
# rows x K from which a layernorm linear past 16 rows (K >= 1024) runs 64-row tiles: gpt2-xl
# (K = 1600) gained from 32 rows, gpt2-large (1280) and gpt2-medium (1024) lost at 32 and gained
# at 64 (timed when these layers normalized apart, before the layernorm was folded)
TALL_MIN = 48 * 1024
# output width below which a K >= 1024 layer without a layernorm adds its chunk sums in two
# groups and runs two programs a 64-column block past 16 rows (gpt2's mlp-out; chunk_groups)
NARROW_N = 1024
STAGE_FIRST = os.environ.get("MINILLM_STAGE_FIRST", "1") != "0"  # see stage_first
CHUNK_GROUPS_ON = os.environ.get("MINILLM_GROUP_SPLIT", "1") != "0"  # see chunk_groups


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
        if K < 1024:  # (one row of out-major weights runs on CUDA cores instead: vocab_fma.py)
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
    if K < 1024 and N >= 2 * K:
        return dict(BLOCK_N=128, BLOCK_K=block_k, CHUNKS=chunks, SPLIT=False, num_warps=8)
    if K < 1024:  # four stages of these small tiles (12 KB each): 3.55 against 4.1 us at M = 64
        return dict(BLOCK_N=32, BLOCK_K=block_k, CHUNKS=chunks, SPLIT=False, num_warps=4, num_stages=4)
    if ln and M * K >= TALL_MIN:  # one 64-row tile, two K steps a chunk (the same arithmetic)
        return dict(BLOCK_N=64, BLOCK_K=block_k // 2, CHUNKS=chunks, SPLIT=False, num_warps=4, BLOCK_M=64)
    if groups > 1:
        # gpt2's mlp-out (3072 -> 768): two programs a 64-column block, each over its half of K:
        # x is read half as often as by 32-column loops over all of K (below). H100, 64 rows
        # alone 7.89 -> 7.38 us; gpt2 batch 64 138.8k -> 145.6k tok/s, batch 32 80.7k -> 84.1k,
        # batch 8 -0.5% (alternated in one call; bench/results/h100/twenty-first-session.md)
        return dict(BLOCK_N=64, BLOCK_K=block_k, CHUNKS=chunks, SPLIT=False, GROUP_SPLIT=True, CHUNK_GROUPS=groups,
                    num_warps=4, num_stages=4)
    if N < NARROW_N and not ln:  # (a layernorm's row sums over 2 warps would round another way)
        # gpt2's mlp-out (3072 -> 768) ran 48 programs of 64 columns at 64 rows; 32-column blocks in
        # two warps: 9.85 -> 7.03 us alone, gpt2 batch 64 135.5k -> 141.3k tok/s, batch 32 81.0k ->
        # 83.1k (H100, alternated in one call). Wider outputs lost end to end (gpt2-medium batch 64
        # -3%, gpt2-xl -15%) though gpt2-xl's layers gained alone (bench/results/h100/narrow-mlp-out.md)
        return dict(BLOCK_N=32, BLOCK_K=block_k, CHUNKS=chunks, SPLIT=False, num_warps=2, num_stages=4)
    # four stages (160 KB of shared memory): gpt2-xl batch 64 16.9k -> 20.3k tok/s, batch 32 10.0k
    # -> 11.7k, gpt2 batch 64 +1% end to end on an H200
    return dict(BLOCK_N=64, BLOCK_K=block_k, CHUNKS=chunks, SPLIT=False, num_warps=4, num_stages=4)


def chunk_groups(N, K, ln):
    """Groups the chunk sums of an (K -> N) layer are added in (see _gemv_kernel): part of the
    arithmetic, so a function of the layer alone. Two for wide-K layers with a narrow output and
    no layernorm (gpt2's mlp-out), whose 64-row layout then splits K over two programs a column
    block (GROUP_SPLIT); one elsewhere. MINILLM_GROUP_SPLIT=0 keeps one group there too, and
    the looping program on 32-column blocks (A/B timing)."""
    return 2 if CHUNK_GROUPS_ON and K >= 1024 and N < NARROW_N and not ln else 1


def stage_first(meta, M, K, ln):
    """Whether a split program (few rows) stages its first weight tile for the tensor cores
    before its wait. The tile is loaded into registers there, but Triton moves it through shared
    memory into the MMA layout only where the first tl.dot uses it, after the wait; a product of
    zero rows with it before the wait (an accumulator of +0.0: the bits do not change) makes
    that copy happen early. Timed end to end on an H100, alternated in one call
    (bench/results/h100/few-row-decode.md); the gains depend on which kernels launch early
    (model.early_roles), and so follow the rows:
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


@triton.jit
def _weight_tile(w_ptr, kk, k_mask, rn, n_mask, stride_wk, stride_wn):
    return tl.load(w_ptr + kk[:, None] * stride_wk + rn[None, :] * stride_wn,
                   mask=k_mask[:, None] & n_mask[None, :], other=0.0)


@triton.jit
def _chunk_dot(x_rows, w_ptr, w_first, rn, n_mask, m_mask, k0, acc, stride_xk, stride_wk, stride_wn,
               K: tl.constexpr, FIRST_LOADED: tl.constexpr, ITERS: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """x[:, k0:k0 + ITERS * BLOCK_K] @ W[k0:..., rn] into a fresh fp32 accumulator; the first
    weight tile may already be loaded (w_first)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    k_mask = kk < K
    w = w_first if FIRST_LOADED else _weight_tile(w_ptr, kk, k_mask, rn, n_mask, stride_wk, stride_wn)
    a = tl.load(x_rows + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
    for i in range(1, ITERS):  # fresh names in the loop: only acc is carried
        kk_i = k0 + i * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask_i = kk_i < K
        w_i = _weight_tile(w_ptr, kk_i, k_mask_i, rn, n_mask, stride_wk, stride_wn)
        a_i = tl.load(x_rows + kk_i[None, :] * stride_xk, mask=m_mask[:, None] & k_mask_i[None, :], other=0.0)
        acc = tl.dot(a_i, w_i, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, fold_ptr, part_ptr, count_ptr, stats_in_ptr, stats_out_ptr,
    key_ptr,
    M, N, ln_eps, negative_slope, zero,
    stride_xm, stride_xk, stride_wk, stride_wn, stride_rm, stride_ym, stride_si, stride_so,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    LN_FOLD: tl.constexpr, LN_STATS: tl.constexpr, STATS_OUT: tl.constexpr, GROUPS_POW2: tl.constexpr,
    ARGMAX: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr, CHUNK_GROUPS: tl.constexpr,
    SPLIT: tl.constexpr, GROUP_SPLIT: tl.constexpr, PARTS: tl.constexpr,
    LN_BLOCK: tl.constexpr, EARLY_LAUNCH: tl.constexpr, STAGE_FIRST: tl.constexpr,
):
    if USE_PDL and EARLY_LAUNCH:  # the next kernel may launch now: its prefetch overlaps all of this one
        tl.extra.cuda.gdc_launch_dependents()
    # K is cut into CHUNKS chunks of whole BLOCK_Ks, each summed into a fresh accumulator; the
    # chunk sums are added in chunk order within CHUNK_GROUPS groups of PER chunks, then the group sums
    # in group order. SPLIT runs one program per chunk (few rows: more programs in flight) and
    # lets the last to arrive add them; GROUP_SPLIT one program per group, which loops over its
    # chunks; otherwise one program loops over every chunk (CHUNK_GROUPS == 1 only). All do the same
    # arithmetic, so the mode may follow M without changing a bit.
    K_CHUNK: tl.constexpr = (K + CHUNKS * BLOCK_K - 1) // (CHUNKS * BLOCK_K) * BLOCK_K
    ITERS: tl.constexpr = K_CHUNK // BLOCK_K
    PER: tl.constexpr = (CHUNKS + CHUNK_GROUPS - 1) // CHUNK_GROUPS
    # PARTS (partial_count): the programs along K, whose chunk sums (SPLIT) or group sums
    # (GROUP_SPLIT) meet through the arrival counter
    # m fastest: the row blocks sharing a weight tile run side by side (one DRAM read, L2 hits)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    pid_k = tl.program_id(1)  # the chunk, with SPLIT
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    tile_mask = m_mask[:, None] & n_mask[None, :]
    first_chunk = pid_k * PER if GROUP_SPLIT else pid_k
    k0 = first_chunk * K_CHUNK
    kk = k0 + tl.arange(0, BLOCK_K)

    # weights never change between launches: fetch the first tile before waiting on the kernel
    # that writes x
    w = _weight_tile(w_ptr, kk, kk < K, rn, n_mask, stride_wk, stride_wn)
    # the epilogue's bias (and column sums) too, and the residual where the caller vouches that
    # the kernel just before does not write it: the finishing program then has no loads left
    bias, res = _load_bias_residual(bias_ptr, res_ptr, rm, rn, tile_mask, n_mask, stride_rm, HAS_BIAS,
                                    HAS_RESIDUAL and PREFETCH_RESIDUAL)
    colsum = 0.0
    if LN_FOLD:
        colsum = tl.load(fold_ptr + rn, mask=n_mask, other=0.0)[None, :]
    # a fresh accumulator starts at a runtime zero: Triton rewrites `acc + dot(a, b, 0)` into
    # `dot(a, b, acc)`, which would make the looping layout round differently from the split one
    acc0 = tl.full((BLOCK_M, BLOCK_N), zero, dtype=tl.float32)
    if STAGE_FIRST:  # see stage_first: a product with zero rows (+0.0 exactly) before the wait
        acc0 = tl.dot(tl.full((BLOCK_M, BLOCK_K), zero, dtype=x_ptr.dtype.element_ty), w, acc0,
                      input_precision=INPUT_PRECISION)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes (x, residual) are visible now
        if not EARLY_LAUNCH:
            tl.extra.cuda.gdc_launch_dependents()

    x_rows = x_ptr + rm[:, None] * stride_xm
    mean, rstd = 0.0, 0.0
    if LN_FOLD:  # only the epilogue needs them: these loads overlap the products
        if LN_STATS:  # partial sums left by the kernel that wrote x: a few numbers per row
            mean, rstd = _load_row_stats(stats_in_ptr, rm, m_mask, stride_si, ln_eps, K, GROUPS_POW2)
        else:
            mean, rstd = _row_stats(x_ptr, rm, m_mask, stride_xm, stride_xk, ln_eps, K, BLOCK_M, LN_BLOCK)
    acc = _chunk_dot(x_rows, w_ptr, w, rn, n_mask, m_mask, k0, acc0, stride_xk, stride_wk, stride_wn, K, True,
                     ITERS, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION)
    if not SPLIT:  # the rest of the program's chunks: all of them, or its group's
        for c in range(first_chunk + 1, tl.minimum(first_chunk + PER, CHUNKS) if GROUP_SPLIT else CHUNKS):
            acc += _chunk_dot(x_rows, w_ptr, w, rn, n_mask, m_mask, c * K_CHUNK,
                              tl.full((BLOCK_M, BLOCK_N), zero, dtype=tl.float32), stride_xk, stride_wk,
                              stride_wn, K, False, ITERS, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION)

    finish = True
    if (SPLIT or GROUP_SPLIT) and PARTS > 1:
        part = part_ptr + rm[:, None] * N + rn[None, :]
        tl.store(part + pid_k * M * N, acc, mask=tile_mask)
        # acq_rel: our partial is visible before the count moves; the last arriver sees all
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
        finish = arrived == PARTS - 1
        if finish:
            # chunk order within each group, then group order, as the loops above; a group sum
            # (GROUP_SPLIT) is a group of one partial here
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            PER_PART: tl.constexpr = 1 if GROUP_SPLIT else PER
            if PER_PART >= PARTS:  # one group (0 + x is x): the partials in order
                for s in tl.static_range(PARTS):
                    acc += tl.load(part + s * M * N, mask=tile_mask, other=0.0, cache_modifier=".cg")
            else:
                for g in tl.static_range((PARTS + PER_PART - 1) // PER_PART):
                    group = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    for j in tl.static_range(PER_PART):
                        if g * PER_PART + j < PARTS:
                            group += tl.load(part + (g * PER_PART + j) * M * N, mask=tile_mask, other=0.0,
                                             cache_modifier=".cg")
                    acc += group
            # ready for the next launch (and graph replay), which the kernel boundary orders after
            # this one: relaxed, so the epilogue's stores need not wait for its round trip
            tl.atomic_xchg(count_ptr + pid, 0, sem="relaxed")
    if finish:
        if LN_FOLD:
            acc = _fold_ln(acc, colsum, mean, rstd)
        # res is the constant 0.0 here: loading into it inside a runtime if would change its type
        if HAS_RESIDUAL and not PREFETCH_RESIDUAL:
            late_res = tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :], mask=tile_mask, other=0.0)
            late_res = late_res.to(tl.float32)
            y = _epilogue(acc, bias, late_res, y_ptr, rm, rn, tile_mask, stride_ym, negative_slope, ACTIVATION)
        else:
            y = _epilogue(acc, bias, res, y_ptr, rm, rn, tile_mask, stride_ym, negative_slope, ACTIVATION)
        if STATS_OUT:
            _store_row_stats(tl.where(tile_mask, y, 0.0), rm, m_mask, pid_n * BLOCK_N, N, stats_out_ptr, stride_so,
                             BLOCK_M, BLOCK_N)
        if ARGMAX:  # the tile's (max, its lowest column) per row, into the row's key
            v = tl.where(tile_mask, y, float("-inf"))
            vmax = tl.max(v, axis=1)
            vidx = tl.min(tl.where(v == vmax[:, None], rn[None, :], N), axis=1)
            tl.atomic_max(key_ptr + rm, _argmax_key(vmax, vidx), mask=m_mask, sem="relaxed")


def gemv(x2, weight, bias, residual, y2, ln_fold, ln_eps, activation, negative_slope,
         ln_stats=None, stats_out=None, argmax_keys=None, prefetch_residual=False, config=None,
         early_launch=False):
    """Launch for rows x2 (M <= 64, K) already checked by `linear`; writes y2 (M, N). The
    fewest rows go to the CUDA-core kernels where their configs allow: a vocabulary head with
    no residual, activation or statistics out to vocab_fma.py, other layers without statistics
    or argmax out to gemv_fma.py (both ignore ln_stats: they take statistics from whole rows).
    early_launch: see `linear`.
    config: a dict like decode_config's or fma_config's (with ROWS), in its place (tests,
    benchmarks)."""
    M, K = x2.shape
    N = weight.shape[1]
    assert M <= SMALL_M
    if config is None and stats_out is None and residual is None and activation is None:
        vocab = vocab_config(M, N, K, weight.stride(0), sms=sm_count(x2.device))
        if vocab is not None:
            return vocab_fma(x2, weight, bias, y2, ln_fold, ln_eps, argmax_keys, vocab)
    plain = config is None and stats_out is None and argmax_keys is None
    fma = fma_config(M, N, K, weight.stride(0)) if plain else None
    if fma is not None or (config is not None and "ROWS" in config):
        if stats_out is not None or argmax_keys is not None:
            raise ValueError("_config: the CUDA-core layout (ROWS) writes no stats_out or argmax_keys")
        return gemv_fma(x2, weight, bias, residual, y2, ln_fold, ln_eps, activation, negative_slope,
                        prefetch_residual, fma or config, early_launch)
    meta = decode_config(M, N, K, x2.element_size(), ln_fold is not None, sms=sm_count(x2.device)) if config is None \
        else dict(config)
    meta["CHUNKS"] = chunk_count(K, meta["BLOCK_K"], meta["CHUNKS"])
    meta.setdefault("BLOCK_M", BLOCK_M)
    meta.setdefault("CHUNK_GROUPS", 1)
    meta.setdefault("GROUP_SPLIT", False)
    parts = meta["PARTS"] = partial_count(meta)
    split = parts > 1
    part = x2.new_empty((parts * M * N,) if split else (1,), dtype=torch.float32)
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, 16)  # at the narrowest BLOCK_N
    counts = arrival_counters(x2.device, tiles) if split else part
    grid = (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), parts)
    pdl = use_pdl(x2.device)
    dummy = y2
    ln_stats = ln_stats if ln_fold is not None else None
    launch(
        _gemv_kernel, grid,
        x2, weight, bias if bias is not None else dummy, residual if residual is not None else y2, y2,
        ln_fold if ln_fold is not None else part,
        part, counts, ln_stats if ln_stats is not None else part, stats_out if stats_out is not None else part,
        argmax_keys if argmax_keys is not None else part,
        M, N, ln_eps, negative_slope, 0.0,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
        (residual if residual is not None else y2).stride(0), y2.stride(0),
        ln_stats.stride(0) if ln_stats is not None else 0, stats_out.stride(0) if stats_out is not None else 0,
        K=K, HAS_BIAS=bias is not None, ACTIVATION=activation, HAS_RESIDUAL=residual is not None,
        LN_FOLD=ln_fold is not None, LN_STATS=ln_stats is not None, STATS_OUT=stats_out is not None,
        GROUPS_POW2=triton.next_power_of_2(triton.cdiv(K, STATS_GROUP)), ARGMAX=argmax_keys is not None,
        INPUT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        USE_PDL=pdl, PREFETCH_RESIDUAL=bool(prefetch_residual),
        LN_BLOCK=row_stats_block(K), EARLY_LAUNCH=bool(early_launch),
        STAGE_FIRST=stage_first(meta, M, K, ln_fold is not None),
        launch_pdl=pdl, **meta,
    )
    return y2
