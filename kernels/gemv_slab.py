"""Decode-time linear for 33 to 64 rows of a layer of K <= 768 (gpt2's qkv, attn-out and fc at
batch 33-64), and for 17 to 64 rows of a layer in chunk groups (gpt2's mlp-out,
gemv_config.chunk_groups): one program a 32-column block over every row (and a group of K
chunks), with the block's whole weight slab (its group's) and all of x requested at once.

The looping GEMV (gemv.py) takes a 64-row program's K chunks through a four-stage pipeline:
its first weight tile before the dependent-launch wait, then x and the other tiles chunk by
chunk. Timed per program on an H200 (bench/results/h200/slab-phases-23275e5.json), a chunk's x
arrived 1.0-1.3 us after its request, the same with 24, 48 or 72 programs: each SM waited on
its own few requests in flight, not on the memory system. So here:
- the block's whole weight slab (K x 32, 48 KB at K = 768) is asked into L2 before the wait
  (the weights never change between launches; Hopper's bulk prefetch, no registers);
- right after the wait every chunk's x tile (64 x 128) and weight tile go through a loop of
  seven pipeline stages, which Triton copies into shared memory by cp.async: all of them in
  flight at once (pipelined_stages, with the timing);
- the products run chunk by chunk, each chunk into a fresh accumulator and the chunk sums added
  in chunk order: gemv.py's arithmetic, so a row keeps its bits in either kernel
  (tests/kernels/test_gemv_slab.py).
In chunk groups (CHUNK_GROUPS > 1) the last of a column block's group programs to arrive adds
the group sums in order (gemv.py's GROUP_SPLIT arithmetic, the same bits). It takes 168 KB of
shared memory at K = 768 (gpt2's mlp-out: 192 KB a group), so one program an SM; a GPU with
less gets fewer pipeline stages (_tuning.launch), the same bits. MINILLM_SLAB_PIPELINED=0
keeps the first form (A/B timing): the weight tiles loaded before the wait, named one by one
(MAX_CHUNKS of them: a tile held across the wait cannot live in a loop), and x by pointer loads
through registers after it.
"""
import torch
import triton
import triton.language as tl

from ._epilogue import _finish_tile, _load_bias_residual, _load_row_stats, _row_stats, epilogue_meta
from ._fixed_merge import _add_stored
from ._l2_ahead import ON as L2_ON, _ask_l2_columns
from ._tuning import env_int, is_hopper, launch, use_pdl
from ._workspace import arrival_counters

MAX_CHUNKS = 6  # K <= 6 x 128 for the named tiles
# see pipelined_stages: MINILLM_SLAB_PIPELINED=N runs the chunks through an N-stage loop, 0 the named tiles
PIPELINED_ENV = env_int("MINILLM_SLAB_PIPELINED", 7)
if PIPELINED_ENV < 0 or PIPELINED_ENV == 1:
    raise ValueError(f"MINILLM_SLAB_PIPELINED: expected 0 (off) or pipeline stages >= 2, got {PIPELINED_ENV}")


@triton.jit
def _w_chunk(w_ptr, c: tl.constexpr, n0, N, stride_wk, stride_wn, K: tl.constexpr, CHUNKS: tl.constexpr,
             BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """W[c * BLOCK_K:(c + 1) * BLOCK_K, n0:n0 + BLOCK_N], zero past K and N; for a chunk past the
    layer's last, a placeholder nothing uses (the compiler drops it)."""
    if c < CHUNKS:
        kk = c * BLOCK_K + tl.arange(0, BLOCK_K)
        rn = n0 + tl.arange(0, BLOCK_N)
        return tl.load(w_ptr + kk[:, None] * stride_wk + rn[None, :] * stride_wn,
                       mask=(kk < K)[:, None] & (rn < N)[None, :], other=0.0)
    else:
        return tl.zeros((BLOCK_K, BLOCK_N), dtype=w_ptr.dtype.element_ty)


@triton.jit
def _x_chunk(x_rows, c: tl.constexpr, m_mask, stride_xk, K: tl.constexpr, CHUNKS: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x[rows, c * BLOCK_K:(c + 1) * BLOCK_K], zero past M and K (a placeholder past the last chunk)."""
    if c < CHUNKS:
        kk = c * BLOCK_K + tl.arange(0, BLOCK_K)
        return tl.load(x_rows + kk[None, :] * stride_xk, mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)
    else:
        return tl.zeros((BLOCK_M, BLOCK_K), dtype=x_rows.dtype.element_ty)


@triton.jit
def _add_chunk(acc, x, w, fresh, c: tl.constexpr, CHUNKS: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """acc + chunk c's product in a fresh accumulator (gemv.py's order); acc past the last chunk."""
    if c < CHUNKS:
        return acc + tl.dot(x, w, fresh, input_precision=INPUT_PRECISION)
    else:
        return acc


@triton.jit
def _gemv_slab_kernel(
    x_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, fold_ptr, stats_in_ptr, stats_out_ptr, part_ptr, count_ptr,
    M, N, ln_eps, negative_slope, zero,
    stride_xm, stride_xk, stride_wk, stride_wn, stride_rm, stride_ym, stride_si, stride_so,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    LN_FOLD: tl.constexpr, LN_STATS: tl.constexpr, STATS_OUT: tl.constexpr, GROUPS_POW2: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_RESIDUAL: tl.constexpr,
    EARLY_LAUNCH: tl.constexpr, LN_BLOCK: tl.constexpr, LN_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr,
    PIPELINED: tl.constexpr, PER: tl.constexpr, PARTS: tl.constexpr, L2_BYTES: tl.constexpr,
):
    if USE_PDL and EARLY_LAUNCH:  # the next kernel may launch now: its prefetch overlaps all of this one
        tl.extra.cuda.gdc_launch_dependents()
    n0 = tl.program_id(0) * BLOCK_N
    group = 0  # (one group: the loop's bounds stay constants)
    if PARTS > 1:  # this program's group of PER chunks (gemv.py's GROUP_SPLIT)
        group = tl.program_id(1)
    k0 = group * PER * BLOCK_K
    k_end = tl.minimum(K, k0 + PER * BLOCK_K)
    rm = tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    tile_mask = m_mask[:, None] & n_mask[None, :]

    if PIPELINED:  # (pipelined_stages) the slab asked into L2; its tiles are loaded in the loop
        if L2_BYTES > 0:  # (W's element bytes) one request a column (_l2_ahead: no registers, nothing waits)
            _ask_l2_columns(w_ptr, n0, N, stride_wn, k0, (k_end - k0) * L2_BYTES,
                            tl.full((BLOCK_N,), True, tl.int1), BLOCK_N)
    else:  # the whole weight slab, before waiting on the kernel that writes x
        w0 = _w_chunk(w_ptr, 0, n0, N, stride_wk, stride_wn, K, CHUNKS, BLOCK_K, BLOCK_N)
        w1 = _w_chunk(w_ptr, 1, n0, N, stride_wk, stride_wn, K, CHUNKS, BLOCK_K, BLOCK_N)
        w2 = _w_chunk(w_ptr, 2, n0, N, stride_wk, stride_wn, K, CHUNKS, BLOCK_K, BLOCK_N)
        w3 = _w_chunk(w_ptr, 3, n0, N, stride_wk, stride_wn, K, CHUNKS, BLOCK_K, BLOCK_N)
        w4 = _w_chunk(w_ptr, 4, n0, N, stride_wk, stride_wn, K, CHUNKS, BLOCK_K, BLOCK_N)
        w5 = _w_chunk(w_ptr, 5, n0, N, stride_wk, stride_wn, K, CHUNKS, BLOCK_K, BLOCK_N)
    # the epilogue's bias and column sums, and the residual where the caller vouches for it (gemv.py)
    bias, res = _load_bias_residual(bias_ptr, res_ptr, rm, rn, tile_mask, n_mask, stride_rm, HAS_BIAS,
                                    HAS_RESIDUAL and PREFETCH_RESIDUAL)
    colsum = 0.0
    if LN_FOLD:
        colsum = tl.load(fold_ptr + rn, mask=n_mask, other=0.0)[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes (x, residual) are visible now
        if not EARLY_LAUNCH:
            tl.extra.cuda.gdc_launch_dependents()

    x_rows = x_ptr + rm[:, None] * stride_xm
    if not PIPELINED:  # all of x at once; the row statistics' loads after it overlap the products
        x0 = _x_chunk(x_rows, 0, m_mask, stride_xk, K, CHUNKS, BLOCK_M, BLOCK_K)
        x1 = _x_chunk(x_rows, 1, m_mask, stride_xk, K, CHUNKS, BLOCK_M, BLOCK_K)
        x2 = _x_chunk(x_rows, 2, m_mask, stride_xk, K, CHUNKS, BLOCK_M, BLOCK_K)
        x3 = _x_chunk(x_rows, 3, m_mask, stride_xk, K, CHUNKS, BLOCK_M, BLOCK_K)
        x4 = _x_chunk(x_rows, 4, m_mask, stride_xk, K, CHUNKS, BLOCK_M, BLOCK_K)
        x5 = _x_chunk(x_rows, 5, m_mask, stride_xk, K, CHUNKS, BLOCK_M, BLOCK_K)
    mean, rstd = 0.0, 0.0
    if LN_FOLD:
        if LN_STATS:  # partial sums left by the kernel that wrote x
            mean, rstd = _load_row_stats(stats_in_ptr, 0, M, stride_si, ln_eps, K, GROUPS_POW2, BLOCK_M)
        else:
            mean, rstd = _row_stats(x_ptr, rm, m_mask, stride_xm, stride_xk, ln_eps, K, BLOCK_M, LN_BLOCK, LN_POW2)

    # a fresh accumulator starts at a runtime zero (gemv.py: Triton would fold a constant one into the sum)
    fresh = tl.full((BLOCK_M, BLOCK_N), zero, dtype=tl.float32)
    if PIPELINED:
        # every chunk's x and W tiles copied into shared memory ahead by the pipeliner (cp.async),
        # all in flight at once where the launch's num_stages exceed PER (fewer where a GPU has
        # less shared memory: _tuning.launch); the chunk sums added in order from zero
        acc = fresh
        for c in range(group * PER, tl.minimum(CHUNKS, group * PER + PER)):
            kk = c * BLOCK_K + tl.arange(0, BLOCK_K)
            k_mask = kk < K
            w_c = tl.load(w_ptr + kk[:, None] * stride_wk + rn[None, :] * stride_wn,
                          mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            x_c = tl.load(x_rows + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            acc = acc + tl.dot(x_c, w_c, fresh, input_precision=INPUT_PRECISION)
    else:
        acc = tl.dot(x0, w0, fresh, input_precision=INPUT_PRECISION)
        acc = _add_chunk(acc, x1, w1, fresh, 1, CHUNKS, INPUT_PRECISION)
        acc = _add_chunk(acc, x2, w2, fresh, 2, CHUNKS, INPUT_PRECISION)
        acc = _add_chunk(acc, x3, w3, fresh, 3, CHUNKS, INPUT_PRECISION)
        acc = _add_chunk(acc, x4, w4, fresh, 4, CHUNKS, INPUT_PRECISION)
        acc = _add_chunk(acc, x5, w5, fresh, 5, CHUNKS, INPUT_PRECISION)
    finish = True
    if PARTS > 1:  # the group sums added in order by the last group to arrive
        acc, finish = _add_stored(acc, part_ptr + rm[:, None] * N + rn[None, :], count_ptr + tl.program_id(0), group,
                                  tile_mask, M * N, PARTS, 1)
    if finish:
        _finish_tile(acc, colsum, mean, rstd, bias, res, res_ptr, y_ptr, stats_out_ptr, rm, rn, m_mask, tile_mask,
                     n0, N, stride_rm, stride_ym, stride_so, negative_slope, ACTIVATION, HAS_RESIDUAL,
                     PREFETCH_RESIDUAL, LN_FOLD, STATS_OUT, BLOCK_M, BLOCK_N)


def pipelined_stages(chunks):
    """Pipeline stages of the slab's chunk loop over a program's chunks (1: the named tiles); a
    GPU whose shared memory holds fewer gets fewer (_tuning.launch's fallback, the same bits:
    gpt2's K = 768 slab takes 168 KB at 7 stages, mlp-out's group slab 192 KB at 4). The
    weight slab is asked into L2 before the wait (not loaded), and after it every chunk's x and
    W tiles go through the loop, which Triton copies into shared memory by cp.async, without
    registers: at 7 stages all six chunks are in flight at once. The named tiles held x in
    registers on its way to shared memory: Triton 3.6 loaded it in two bursts, two L2 round
    trips. The same chunks added in the same order: the same bits. H200, gpt2 batch 64
    alternated twice in one call, the same ids
    (bench/results/h200/session-82/call3-ab.log): 165,342 / 165,516 -> 172,108 / 171,806 tok/s
    (+3.9%) at 7 stages; without the L2 request +0.7%; at 4 stages -2.7%.
    MINILLM_SLAB_PIPELINED=N forces N stages (at most), 0 the named tiles (A/B timing)."""
    return min(PIPELINED_ENV, chunks + 1) if PIPELINED_ENV > 1 else 1


def l2_element_bytes(weight):
    """W's element bytes where the slab may ask L2 for runs of its columns
    (_l2_ahead._ask_l2_columns: out-major weights, stride_wk 1, whose runs start at a multiple
    of BLOCK_K elements and end at one or at K); 0 (no requests) for other layouts, where a
    request would not be 16-byte aligned, off Hopper and under the interpreter. The model stores
    its weights out-major."""
    K, N = weight.shape
    size = weight.element_size()
    if not (L2_ON and is_hopper(weight.device)) or weight.data_ptr() % 16 or weight.stride(0) != 1:
        return 0
    return size if weight.stride(1) * size % 16 == 0 and K * size % 16 == 0 else 0


def gemv_slab(x2, weight, bias, residual, y2, ln_fold, ln_eps, activation, negative_slope, ln_stats, stats_out,
              prefetch_residual, meta, early_launch):
    """Launch for rows x2 (M <= BLOCK_M, K) already checked by `linear`, with a SLAB layout of
    gemv_config.decode_config (or a test's); writes y2 (M, N). With CHUNK_GROUPS > 1 a program
    takes one group of chunks and the last of a column block to arrive adds the group sums
    (gemv.py's GROUP_SPLIT arithmetic)."""
    M, K = x2.shape
    N = weight.shape[1]
    chunks = triton.cdiv(K, meta["BLOCK_K"])
    per = triton.cdiv(chunks, meta.get("CHUNK_GROUPS", 1))  # chunks a program
    parts = triton.cdiv(chunks, per)
    stages = pipelined_stages(per)
    if meta["CHUNKS"] != chunks or M > meta["BLOCK_M"] or (chunks > MAX_CHUNKS and stages == 1) or \
            (parts > 1 and stages == 1):
        raise ValueError(f"_config: a SLAB layout takes K in chunks of one BLOCK_K (at most {MAX_CHUNKS} in one "
                         f"group without the pipelined loop) and at most BLOCK_M rows; got K {K}, M {M} and {meta}")
    pdl = use_pdl(x2.device)
    dummy = y2
    # the group sums' partials and counters; one group uses neither (no allocation a launch)
    part = x2.new_empty((parts * M * N,), dtype=torch.float32) if parts > 1 else dummy
    counts = arrival_counters(x2.device, triton.cdiv(N, meta["BLOCK_N"])) if parts > 1 else dummy
    launch(
        _gemv_slab_kernel, (triton.cdiv(N, meta["BLOCK_N"]), parts),
        x2, weight, bias if bias is not None else dummy, residual if residual is not None else y2, y2,
        ln_fold if ln_fold is not None else dummy, ln_stats if ln_stats is not None else dummy,
        stats_out if stats_out is not None else dummy, part, counts,
        M, N, ln_eps, negative_slope, 0.0,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
        (residual if residual is not None else y2).stride(0), y2.stride(0),
        ln_stats.stride(0) if ln_stats is not None else 0, stats_out.stride(0) if stats_out is not None else 0,
        **epilogue_meta(x2, K, bias, activation, residual, ln_fold, ln_stats, stats_out, prefetch_residual,
                        early_launch, pdl),
        BLOCK_M=meta["BLOCK_M"], BLOCK_N=meta["BLOCK_N"], BLOCK_K=meta["BLOCK_K"], CHUNKS=chunks,
        PIPELINED=stages > 1, L2_BYTES=l2_element_bytes(weight) if stages > 1 else 0, PER=per, PARTS=parts,
        num_warps=meta.get("num_warps", 4), launch_pdl=pdl, **({"num_stages": stages} if stages > 1 else {}),
    )
    return y2
