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
  depends on (N, K) only: a row's result is bit-identical at any M from 2 to 64, in every mode,
  in every launch;
- one row alone, where no row statistics go out, meets by the one-atomic merge instead
  (_fixed_merge.py, gemv_config.fixed_split): each chunk adds its sum in fixed point into one
  int64 word per column and the chunk that completes a column runs its epilogue, one round trip
  where the stored partials took three. Its bits then differ from the row's among others
  (MINILLM_GEMV_FIXED=0: the same bits at any M <= 64);
- row blocks (16 rows, or 64 for vocabulary heads at batch) that share a weight tile are
  neighbouring programs: W crosses the memory bus once and the other row blocks read it from L2;
- the first weight tile is loaded before anything an earlier kernel writes; decode_config
  (gemv_config.py, with every layout rule) makes a chunk one tile, so that is a split
  program's whole slab. With programmatic dependent launch (Hopper) the kernel starts while
  the previous one still runs, so this load and the launch hide behind it; gdc_wait then
  waits for x;
- weight tiles come through a tensor descriptor (TMA) straight into shared memory where that
  is faster (gemv_config.tma_weights: split programs under Tritons after 3.6, which would hold
  a pointer-loaded tile in registers across the wait; looping layouts past 32 rows);
- a folded layernorm (W and bias carry its gain and shift, reference.fold_layernorm) costs the
  product nothing: x goes into the MMA as it is, and the finishing program scales its tile by
  each row's statistics, from the partial sums the producing kernel left (ln_stats) or else
  from the whole row (in order-free sums: _epilogue._row_stats). Normalizing x in every K
  step instead made gpt2's qkv and fc 1.1-1.2 us slower at 64 rows, gpt2-xl's twice as slow
  (bench/results/h200/batch-decode-linears.md);
- optional fused outputs: the rows' partial statistics for the next layernorm (stats_out) and
  greedy decoding's argmax, as keys (argmax_key.py) that every finishing program max-es into
  the row's word with a relaxed atomic: nothing waits for the other column blocks. With the
  keys alone (store=False) the output is rounded as it would be stored, and not stored: a
  greedy head past one row writes no logits (6.4 MB a step at gpt2 batch 64).
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._epilogue import _finish_tile, _load_bias_residual, _load_row_stats, _row_stats, epilogue_meta
from ._fixed_merge import _add_fixed, _add_stored
from ._tuning import launch, sm_count, use_pdl
from ._workspace import arrival_counters, fixed_point_sums
from .argmax_key import _argmax_key, _no_token_if_nan
from .gemv_config import (BLOCK_M, SMALL_M, chunk_count, decode_config, fixed_split, partial_count, split_maxnreg,
                          stage_first, tma_weights)
from .gemv_fma import fma_config, gemv_fma
from .gemv_slab import gemv_slab
from .vocab_fma import vocab_config, vocab_fma

TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])


@triton.jit
def _weight_tile(w_ptr, w_desc, k0, n0, K, N, stride_wk, stride_wn, W_DESC: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """W[k0:k0 + BLOCK_K, n0:n0 + BLOCK_N], zero past K and N. W_DESC: 0 by pointers; 1 by
    w_desc over W (K, N); 2 by w_desc over W^T (N, K), for out-major storage (a descriptor
    zero-fills past the edges as the masks do)."""
    if W_DESC == 1:
        return w_desc.load([k0, n0])
    elif W_DESC == 2:
        return w_desc.load([n0, k0]).T
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        rn = n0 + tl.arange(0, BLOCK_N)
        return tl.load(w_ptr + kk[:, None] * stride_wk + rn[None, :] * stride_wn,
                       mask=(kk < K)[:, None] & (rn < N)[None, :], other=0.0)


@triton.jit
def _chunk_dot(x_rows, w_ptr, w_desc, w_first, n0, N, m_mask, k0, acc, stride_xk, stride_wk, stride_wn,
               K: tl.constexpr, FIRST_LOADED: tl.constexpr, ITERS: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, W_DESC: tl.constexpr):
    """x[:, k0:k0 + ITERS * BLOCK_K] @ W[k0:..., n0:n0 + BLOCK_N] into a fresh fp32 accumulator;
    the first weight tile may already be loaded (w_first)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    k_mask = kk < K
    w = w_first if FIRST_LOADED else _weight_tile(w_ptr, w_desc, k0, n0, K, N, stride_wk, stride_wn, W_DESC, BLOCK_K,
                                                  BLOCK_N)
    a = tl.load(x_rows + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
    for i in range(1, ITERS):  # fresh names in the loop: only acc is carried
        kk_i = k0 + i * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask_i = kk_i < K
        w_i = _weight_tile(w_ptr, w_desc, k0 + i * BLOCK_K, n0, K, N, stride_wk, stride_wn, W_DESC, BLOCK_K, BLOCK_N)
        a_i = tl.load(x_rows + kk_i[None, :] * stride_xk, mask=m_mask[:, None] & k_mask_i[None, :], other=0.0)
        acc = tl.dot(a_i, w_i, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, fold_ptr, part_ptr, count_ptr, words_ptr, stats_in_ptr, stats_out_ptr,
    key_ptr, w_desc,
    M, N, ln_eps, negative_slope, zero,
    stride_xm, stride_xk, stride_wk, stride_wn, stride_rm, stride_ym, stride_si, stride_so,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    LN_FOLD: tl.constexpr, LN_STATS: tl.constexpr, STATS_OUT: tl.constexpr, GROUPS_POW2: tl.constexpr,
    ARGMAX: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr, CHUNK_GROUPS: tl.constexpr,
    SPLIT: tl.constexpr, GROUP_SPLIT: tl.constexpr, PARTS: tl.constexpr,
    LN_BLOCK: tl.constexpr, LN_POW2: tl.constexpr, EARLY_LAUNCH: tl.constexpr, STAGE_FIRST: tl.constexpr,
    FIXED: tl.constexpr,
    W_DESC: tl.constexpr, STORE_Y: tl.constexpr,
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

    # weights never change between launches: fetch the first tile before waiting on the kernel
    # that writes x
    w = _weight_tile(w_ptr, w_desc, k0, pid_n * BLOCK_N, K, N, stride_wk, stride_wn, W_DESC, BLOCK_K, BLOCK_N)
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
            mean, rstd = _load_row_stats(stats_in_ptr, pid_m * BLOCK_M, M, stride_si, ln_eps, K, GROUPS_POW2, BLOCK_M)
        else:
            mean, rstd = _row_stats(x_ptr, rm, m_mask, stride_xm, stride_xk, ln_eps, K, BLOCK_M, LN_BLOCK, LN_POW2)
    acc = _chunk_dot(x_rows, w_ptr, w_desc, w, pid_n * BLOCK_N, N, m_mask, k0, acc0, stride_xk, stride_wk,
                     stride_wn, K, True, ITERS, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, W_DESC)
    if not SPLIT:  # the rest of the program's chunks: all of them, or its group's
        for c in range(first_chunk + 1, tl.minimum(first_chunk + PER, CHUNKS) if GROUP_SPLIT else CHUNKS):
            acc += _chunk_dot(x_rows, w_ptr, w_desc, w, pid_n * BLOCK_N, N, m_mask, c * K_CHUNK,
                              tl.full((BLOCK_M, BLOCK_N), zero, dtype=tl.float32), stride_xk, stride_wk,
                              stride_wn, K, False, ITERS, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, W_DESC)

    finish = True
    if FIXED:  # (PARTS > 1) the one-atomic merge: each element finished by the part completing it
        acc, done = _add_fixed(acc, words_ptr + rm[:, None] * N + rn[None, :], tile_mask, PARTS)
        tile_mask = tile_mask & done
    elif (SPLIT or GROUP_SPLIT) and PARTS > 1:  # chunk sums (SPLIT) or group sums, in order
        acc, finish = _add_stored(acc, part_ptr + rm[:, None] * N + rn[None, :], count_ptr + pid, pid_k, tile_mask,
                                  M * N, PARTS, 1 if GROUP_SPLIT else PER)
    if finish:
        y = _finish_tile(acc, colsum, mean, rstd, bias, res, res_ptr, y_ptr, stats_out_ptr, rm, rn, m_mask, tile_mask,
                         pid_n * BLOCK_N, N, stride_rm, stride_ym, stride_so, negative_slope, ACTIVATION,
                         HAS_RESIDUAL, PREFETCH_RESIDUAL, LN_FOLD, STATS_OUT, BLOCK_M, BLOCK_N, STORE_Y)
        if ARGMAX:  # the tile's (max, its lowest column) per row, into the row's key
            v = tl.where(tile_mask, y, float("-inf"))
            vmax = tl.max(v, axis=1)
            vidx = tl.min(tl.where(v == vmax[:, None], rn[None, :], N), axis=1)
            vmax, vidx = _no_token_if_nan(vmax, vidx, tl.max((v != v).to(tl.int32), axis=1) > 0, N)
            tl.atomic_max(key_ptr + rm, _argmax_key(vmax, vidx), mask=m_mask, sem="relaxed")


def weight_descriptor(weight, block_k, block_n):
    """(descriptor, W_DESC) for a (BLOCK_K, BLOCK_N) tile of weight (K, N) read by TMA, whichever
    of its dimensions is contiguous; (None, 0) where TMA cannot read it (16-byte alignment of
    the base and the outer stride, at most 256 elements and at least 16 bytes a box row)."""
    K, N = weight.shape
    size = weight.element_size()
    if weight.data_ptr() % 16 or max(block_k, block_n) > 256:
        return None, 0
    if weight.stride(1) == 1 and weight.stride(0) * size % 16 == 0 and block_n * size >= 16:
        return TensorDescriptor(weight, [K, N], [weight.stride(0), 1], [block_k, block_n]), 1
    if weight.stride(0) == 1 and weight.stride(1) * size % 16 == 0 and block_k * size >= 16:
        return TensorDescriptor(weight.t(), [N, K], [weight.stride(1), 1], [block_n, block_k]), 2
    return None, 0


def gemv(x2, weight, bias, residual, y2, ln_fold, ln_eps, activation, negative_slope,
         ln_stats=None, stats_out=None, argmax_keys=None, prefetch_residual=False, config=None,
         early_launch=False, l2_ahead_ranges=None, store=True):
    """Launch for rows x2 (M <= 64, K) already checked by `linear`; writes y2 (M, N). The
    fewest rows go to the CUDA-core kernels where their configs allow: a vocabulary head with
    no residual, activation or statistics out to vocab_fma.py, other layers without statistics
    or argmax out to gemv_fma.py (both ignore ln_stats: they take statistics from whole rows);
    a SLAB layout (gemv_config.slab_layout: 33-64 rows of K <= 768, 17-64 of a layer in chunk
    groups) to gemv_slab.py.
    early_launch: see `linear`; l2_ahead_ranges: _l2_ahead.l2_ranges' list (gemv_fma only).
    store=False (with argmax_keys): the keys alone, y2 is not written.
    config: a dict like decode_config's or fma_config's (with ROWS), in its place (tests,
    benchmarks)."""
    M, K = x2.shape
    N = weight.shape[1]
    assert M <= SMALL_M
    if config is None and stats_out is None and residual is None and activation is None:
        vocab = vocab_config(M, N, K, weight.stride(0), sms=sm_count(x2.device))
        if vocab is not None:
            return vocab_fma(x2, weight, bias, y2, ln_fold, ln_eps, argmax_keys, vocab, store)
    plain = config is None and stats_out is None and argmax_keys is None
    fma = fma_config(M, N, K, weight.stride(0)) if plain else None
    if fma is not None or (config is not None and "ROWS" in config):
        if stats_out is not None or argmax_keys is not None:
            raise ValueError("_config: the CUDA-core layout (ROWS) writes no stats_out or argmax_keys")
        return gemv_fma(x2, weight, bias, residual, y2, ln_fold, ln_eps, activation, negative_slope,
                        prefetch_residual, fma or config, early_launch, l2_ahead_ranges)
    meta = decode_config(M, N, K, x2.element_size(), ln_fold is not None, sms=sm_count(x2.device)) if config is None \
        else dict(config)
    meta["CHUNKS"] = chunk_count(K, meta["BLOCK_K"], meta["CHUNKS"])
    meta.setdefault("BLOCK_M", BLOCK_M)
    if meta.pop("SLAB", False):
        if argmax_keys is not None:
            raise ValueError("_config: the SLAB layout writes no argmax_keys")
        return gemv_slab(x2, weight, bias, residual, y2, ln_fold, ln_eps, activation, negative_slope, ln_stats,
                         stats_out, prefetch_residual, meta, early_launch)
    meta.setdefault("CHUNK_GROUPS", 1)
    meta.setdefault("GROUP_SPLIT", False)
    parts = meta["PARTS"] = partial_count(meta)
    split = parts > 1
    fixed = fixed_split(parts, stats_out is not None or argmax_keys is not None, M)
    stored = split and not fixed  # partials stored and counted (the one-atomic merge needs neither)
    part = x2.new_empty((parts * M * N,) if stored else (1,), dtype=torch.float32)
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, 16)  # at the narrowest BLOCK_N
    counts = arrival_counters(x2.device, tiles) if stored else part
    words = fixed_point_sums(x2.device, M * N) if fixed else part
    grid = (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), parts)
    pdl = use_pdl(x2.device)
    dummy = y2
    w_desc, w_mode = None, 0
    if tma_weights(meta, M, TRITON_VERSION):
        w_desc, w_mode = weight_descriptor(weight, meta["BLOCK_K"], meta["BLOCK_N"])
    maxnreg = split_maxnreg(meta, x2.element_size()) if w_mode else None
    launch(
        _gemv_kernel, grid,
        x2, weight, bias if bias is not None else dummy, residual if residual is not None else y2, y2,
        ln_fold if ln_fold is not None else part,
        part, counts, words, ln_stats if ln_stats is not None else part, stats_out if stats_out is not None else part,
        argmax_keys if argmax_keys is not None else part, w_desc,
        M, N, ln_eps, negative_slope, 0.0,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
        (residual if residual is not None else y2).stride(0), y2.stride(0),
        ln_stats.stride(0) if ln_stats is not None else 0, stats_out.stride(0) if stats_out is not None else 0,
        ARGMAX=argmax_keys is not None, STAGE_FIRST=stage_first(meta, M, K, ln_fold is not None),
        **epilogue_meta(x2, K, bias, activation, residual, ln_fold, ln_stats, stats_out, prefetch_residual,
                        early_launch, pdl),
        FIXED=fixed, W_DESC=w_mode, STORE_Y=store, launch_pdl=pdl, **meta, **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    return y2
