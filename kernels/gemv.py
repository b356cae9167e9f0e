"""Decode-time linear (M <= 64 rows): y = act(layernorm?(x) @ W + bias) + residual, one launch.

Few rows make this a matrix-vector product: every weight byte is read once and used a few
times, so the time is the weight read plus fixed latency. The kernel is built around that:
- programs own (BLOCK_N columns) x (one K split) of W; every split of a column block writes an
  fp32 partial and the last one to arrive (an atomic counter) sums them in a fixed order and
  runs the epilogue. The order depends on (N, K) only: a row's result is bit-identical at any
  M <= 64 and in every launch;
- row blocks of 16 that share a weight tile are neighbouring programs: W crosses the memory
  bus once and the other row blocks read it from L2;
- the first weight tile is loaded before anything that an earlier kernel writes. With
  programmatic dependent launch (Hopper) the kernel starts while the previous one is still
  running, so this load and the launch itself hide behind it; gdc_wait then waits for x;
- the layernorm prologue computes each row's statistics from the whole row (a few KB from
  L2, read in a handful of independent chunks) in every program: no separate launch.
"""
import torch
import triton
import triton.language as tl

from ._epilogue import STATS_GROUP, _epilogue, _load_row_stats, _store_row_stats
from ._tuning import INTERPRET, autotune, pick, use_pdl
from ._workspace import arrival_counters

BLOCK_M = 16  # rows per tl.dot: the minimum MMA height; a row's arithmetic is the same at any M
SMALL_M = 64
LN_BLOCK = 512  # columns per chunk of the row-statistics pass


def _cfg(bn, bk, split, warps=4, stages=3):
    return triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split}, num_warps=warps, num_stages=stages)


_CONFIGS = [  # the first is the untuned default (MINILLM_AUTOTUNE=0)
    _cfg(64, 128, 4), _cfg(64, 128, 1), _cfg(64, 128, 2), _cfg(64, 128, 8), _cfg(32, 128, 8),
    _cfg(64, 256, 2), _cfg(128, 128, 2), _cfg(64, 64, 16), _cfg(128, 128, 1, 8),
]
if INTERPRET:  # the interpreter runs every program in Python; split-K has its own tests
    _CONFIGS = [_cfg(64, 64, 1, stages=1)]
MAX_SPLIT_K = max(c.kwargs["SPLIT_K"] for c in _CONFIGS)
SPLIT_WORKSPACE = 1 << 22  # fp32 partials per launch at most (16 MB at M = SMALL_M)


def _max_split(N):
    """Wide outputs (the lm_head) get fewer splits; they have enough column blocks anyway. A
    function of N alone, so a row's reduction order never depends on the batch (M)."""
    split = MAX_SPLIT_K
    while split > 1 and split * SMALL_M * N > SPLIT_WORKSPACE:
        split //= 2
    return split


def _prune_splits(configs, named_args, **kwargs):
    limit = _max_split(named_args["N"])
    return [c for c in configs if c.kwargs["SPLIT_K"] <= limit] or configs[:1]


@triton.jit
def _row_stats(x_ptr, rm, m_mask, stride_xm, stride_xk, ln_eps,
               K: tl.constexpr, BLOCK_M: tl.constexpr, LN_BLOCK: tl.constexpr):
    """Mean and 1/std of rows rm over all K columns; the chunks are independent loads, issued
    together (static unroll), so the pass costs about one L2 round trip."""
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    row_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in tl.static_range(0, K, LN_BLOCK):
        kk = k0 + tl.arange(0, LN_BLOCK)
        xk = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                     mask=m_mask[:, None] & (kk[None, :] < K), other=0.0).to(tl.float32)
        row_sum += tl.sum(xk, axis=1)
        row_sq += tl.sum(xk * xk, axis=1)
    mean = row_sum / K
    # E[x^2] - mean^2 loses digits only when |mean| >> std, which layernorm inputs avoid
    var = tl.maximum(row_sq / K - mean * mean, 0.0)
    return mean, 1.0 / tl.sqrt(var + ln_eps)


@triton.jit
def _normalize(a, lnw, lnb, mean, rstd, k_mask):
    """(a - mean) * rstd * lnw + lnb per row, zero past K, back in a's dtype for tl.dot."""
    an = (a.to(tl.float32) - mean[:, None]) * rstd[:, None] * lnw[None, :] + lnb[None, :]
    return tl.where(k_mask[None, :], an, 0.0).to(a.dtype)


@triton.jit
def _argmax_rows(y, tile_mask, rm, rn, m_mask, pid_m, pid_n, num_pid_n, val_ptr, idx_ptr, counter_ptr, tok_ptr,
                 BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Greedy decoding's argmax over each row of y, fused: every column block writes its rows'
    (max, first index of the max); the last block of a row block to arrive reduces them in
    column order. Ties go to the lowest index, as torch.argmax does."""
    BIG: tl.constexpr = 2147483647
    v = tl.where(tile_mask, y, float("-inf"))
    vmax = tl.max(v, axis=1)
    vidx = tl.min(tl.where(v == vmax[:, None], rn[None, :], BIG), axis=1)
    tl.store(val_ptr + rm * num_pid_n + pid_n, vmax, mask=m_mask)
    tl.store(idx_ptr + rm * num_pid_n + pid_n, vidx, mask=m_mask)
    done = tl.atomic_add(counter_ptr + pid_m, 1, sem="acq_rel")
    if done == num_pid_n - 1:
        best = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        best_i = tl.zeros((BLOCK_M,), dtype=tl.int32)
        for c0 in range(0, num_pid_n, CHUNK):
            cc = c0 + tl.arange(0, CHUNK)
            mask = m_mask[:, None] & (cc < num_pid_n)[None, :]
            offs = rm[:, None] * num_pid_n + cc[None, :]
            cv = tl.load(val_ptr + offs, mask=mask, other=float("-inf"), cache_modifier=".cg")
            ci = tl.load(idx_ptr + offs, mask=mask, other=BIG, cache_modifier=".cg")
            cmax = tl.max(cv, axis=1)
            cidx = tl.min(tl.where(cv == cmax[:, None], ci, BIG), axis=1)
            take = cmax > best  # strictly: an equal max in a later chunk has a higher index
            best = tl.where(take, cmax, best)
            best_i = tl.where(take, cidx, best_i)
        tl.store(tok_ptr + rm, best_i.to(tl.int64), mask=m_mask)
        tl.atomic_xchg(counter_ptr + pid_m, 0)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, lnw_ptr, lnb_ptr, part_ptr, count_ptr, stats_in_ptr, stats_out_ptr,
    amax_val_ptr, amax_idx_ptr, tok_ptr,
    M, N, ln_eps, negative_slope,
    stride_xm, stride_xk, stride_wk, stride_wn, stride_rm, stride_ym, stride_si, stride_so,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    HAS_LN: tl.constexpr, LN_STATS: tl.constexpr, STATS_OUT: tl.constexpr, GROUPS_POW2: tl.constexpr,
    ARGMAX: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    LN_BLOCK: tl.constexpr,
):
    # m fastest: the row blocks sharing a weight tile run side by side (one DRAM read, L2 hits)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    pid_k = tl.program_id(1)
    # K columns per split, whole BLOCK_Ks: a function of (K, config) only
    K_SPLIT: tl.constexpr = (K + SPLIT_K * BLOCK_K - 1) // (SPLIT_K * BLOCK_K) * BLOCK_K
    ITERS: tl.constexpr = K_SPLIT // BLOCK_K
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    tile_mask = m_mask[:, None] & n_mask[None, :]
    k0 = pid_k * K_SPLIT
    kk = k0 + tl.arange(0, BLOCK_K)
    k_mask = kk < K

    # weights, bias and layernorm parameters never change between launches: fetch them before
    # waiting on the kernel that writes x
    w = tl.load(w_ptr + kk[:, None] * stride_wk + rn[None, :] * stride_wn,
                mask=k_mask[:, None] & n_mask[None, :], other=0.0)
    lnw, lnb = 0.0, 0.0
    if HAS_LN:
        lnw = tl.load(lnw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        lnb = tl.load(lnb_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes (x, residual) are visible now
        tl.extra.cuda.gdc_launch_dependents()

    x_rows = x_ptr + rm[:, None] * stride_xm
    a = tl.load(x_rows + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    mean, rstd = 0.0, 0.0
    if HAS_LN:
        if LN_STATS:  # partial sums left by the kernel that wrote x: a few numbers per row
            mean, rstd = _load_row_stats(stats_in_ptr, rm, m_mask, stride_si, ln_eps, K, GROUPS_POW2)
        else:
            mean, rstd = _row_stats(x_ptr, rm, m_mask, stride_xm, stride_xk, ln_eps, K, BLOCK_M, LN_BLOCK)
        a = _normalize(a, lnw, lnb, mean, rstd, k_mask)
    acc = tl.dot(a, w, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), input_precision=INPUT_PRECISION)
    for i in range(1, ITERS):
        kk = k0 + i * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        if HAS_LN:
            lnw = tl.load(lnw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            lnb = tl.load(lnb_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + kk[:, None] * stride_wk + rn[None, :] * stride_wn,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        a = tl.load(x_rows + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if HAS_LN:
            a = _normalize(a, lnw, lnb, mean, rstd, k_mask)
        acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)

    if SPLIT_K == 1:
        y = _epilogue(acc, bias_ptr, res_ptr, y_ptr, rm, rn, tile_mask, n_mask, stride_rm, stride_ym,
                      negative_slope, HAS_BIAS, ACTIVATION, HAS_RESIDUAL)
        if STATS_OUT:
            _store_row_stats(tl.where(tile_mask, y, 0.0), rm, m_mask, pid_n * BLOCK_N, N, stats_out_ptr, stride_so,
                             BLOCK_M, BLOCK_N)
        if ARGMAX:  # its counters sit after the split-K ones
            _argmax_rows(y, tile_mask, rm, rn, m_mask, pid_m, pid_n, num_pid_n, amax_val_ptr, amax_idx_ptr,
                         count_ptr + num_pid_m * num_pid_n, tok_ptr, BLOCK_M, 256)
    else:
        part = part_ptr + rm[:, None] * N + rn[None, :]
        tl.store(part + pid_k * M * N, acc, mask=tile_mask)
        # acq_rel: our partial is visible before the count moves; the last arriver sees all
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # fixed order: deterministic sums
                acc += tl.load(part + s * M * N, mask=tile_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid, 0)  # ready for the next launch (and graph replay)
            y = _epilogue(acc, bias_ptr, res_ptr, y_ptr, rm, rn, tile_mask, n_mask, stride_rm, stride_ym,
                          negative_slope, HAS_BIAS, ACTIVATION, HAS_RESIDUAL)
            if STATS_OUT:
                _store_row_stats(tl.where(tile_mask, y, 0.0), rm, m_mask, pid_n * BLOCK_N, N, stats_out_ptr,
                                 stride_so, BLOCK_M, BLOCK_N)
            if ARGMAX:
                _argmax_rows(y, tile_mask, rm, rn, m_mask, pid_m, pid_n, num_pid_n, amax_val_ptr, amax_idx_ptr,
                             count_ptr + num_pid_m * num_pid_n, tok_ptr, BLOCK_M, 256)


# restore y: with out=residual (in-place residual add) a tuning run must not accumulate
_gemv_tuned = autotune(_CONFIGS, key=["N", "K", "stride_wk", "stride_wn"], restore_value=["y_ptr"],
                       prune_configs_by={"early_config_prune": _prune_splits})(_gemv_kernel)


def gemv(x2, weight, bias, residual, y2, ln_weight, ln_bias, ln_eps, activation, negative_slope,
         ln_stats=None, stats_out=None, argmax_out=None, config=None):
    """Launch for rows x2 (M <= 64, K) already checked by `linear`; writes y2 (M, N).
    config: tests only, a dict of BLOCK_N/BLOCK_K/SPLIT_K (+ num_warps) that bypasses tuning."""
    M, K = x2.shape
    N = weight.shape[1]
    assert M <= SMALL_M
    kernel, meta = pick(_gemv_tuned, _CONFIGS)
    if config is not None:
        kernel, meta = _gemv_kernel, dict(config)
    max_split = meta["SPLIT_K"] if meta else _max_split(N)
    part = x2.new_empty((max_split * M * N,) if max_split > 1 else (1,), dtype=torch.float32)
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, 16)  # at the narrowest BLOCK_N
    need_counts = max_split > 1 or argmax_out is not None
    counts = arrival_counters(x2.device, tiles + triton.cdiv(M, BLOCK_M)) if need_counts else part
    argmax = argmax_out is not None
    amax_val = x2.new_empty((tiles * BLOCK_M,) if argmax else (1,), dtype=torch.float32)
    amax_idx = x2.new_empty((tiles * BLOCK_M,) if argmax else (1,), dtype=torch.int32)
    grid = lambda META: (triton.cdiv(M, BLOCK_M) * triton.cdiv(N, META["BLOCK_N"]), META["SPLIT_K"])
    pdl = use_pdl(x2.device)
    dummy = y2
    ln_stats = ln_stats if ln_weight is not None else None
    kernel[grid](
        x2, weight, bias if bias is not None else dummy, residual if residual is not None else y2, y2,
        ln_weight if ln_weight is not None else dummy, ln_bias if ln_bias is not None else dummy,
        part, counts, ln_stats if ln_stats is not None else part, stats_out if stats_out is not None else part,
        amax_val, amax_idx, argmax_out if argmax else amax_idx,
        M, N, ln_eps, negative_slope,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
        (residual if residual is not None else y2).stride(0), y2.stride(0),
        ln_stats.stride(0) if ln_stats is not None else 0, stats_out.stride(0) if stats_out is not None else 0,
        K=K, HAS_BIAS=bias is not None, ACTIVATION=activation, HAS_RESIDUAL=residual is not None,
        HAS_LN=ln_weight is not None, LN_STATS=ln_stats is not None, STATS_OUT=stats_out is not None,
        GROUPS_POW2=triton.next_power_of_2(triton.cdiv(K, STATS_GROUP)), ARGMAX=argmax,
        INPUT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        USE_PDL=pdl, BLOCK_M=BLOCK_M, LN_BLOCK=min(LN_BLOCK, triton.next_power_of_2(K)),
        launch_pdl=pdl, **meta,
    )
    return y2
