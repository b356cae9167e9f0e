"""Pieces shared by the kernels that write a linear's output: the fp32-accumulator epilogue and
the row statistics a following layernorm needs.

Row statistics travel as partial sums: for every row, the sum and the sum of squares of each
group of STATS_GROUP columns, in an fp32 (rows, 2, groups) buffer. The kernel that writes a
tensor knows its values anyway and adds them up per tile for free; the linear that normalizes
it (a folded layernorm, `_fold_ln`) then reads a few dozen numbers per row instead of the whole
row, in every one of its programs. Group boundaries depend on the column count only, so the
statistics are the same whatever the tiling or the batch.

A second form, fixed point, serves the one launch whose columns are finished by different
programs (decode_attention_proj's one-atomic merge): a zeroed int64 (rows, 2, groups) buffer
into which each program adds the groups' sums of the columns it finished, sums in units of
FIXED_SUM_UNIT (exact for half-precision values) and squares rounded to units of FIXED_SQ_UNIT.
Integer adds give the same words in any order. Readers tell the forms apart by the dtype.
"""
import torch
import triton
import triton.language as tl

from ._checks import check_shape, check_tensor
from .activations import _apply_activation

STATS_GROUP = 16
# the fixed-point form's units: every fp16 value is a multiple of 2**-24, so its sum is exact;
# a square (below 2**32) in units of 2**-16 keeps a row of up to 2**14 columns below 2**62
FIXED_SUM_UNIT = tl.constexpr(2.0 ** -24)
FIXED_SQ_UNIT = tl.constexpr(2.0 ** -16)
FIXED_SUM_SCALE = tl.constexpr(1.0 / FIXED_SUM_UNIT.value)  # (multiplied: exact, where a division is not free)
FIXED_SQ_SCALE = tl.constexpr(1.0 / FIXED_SQ_UNIT.value)
LN_BLOCK = 256  # columns per chunk of the row-statistics pass (_row_stats), summed in fp64
# up to this many groups (K <= 512) a reader adds a row's group statistics one after another; past
# it (gpt2's 48 to 100 groups) by tl.sum over the (rows, groups) tile, whose order has matched
# across the layouts at K = 768 and 1100 (test_gemv_layernorm_same_rows_at_any_batch). In order at
# every width cost gpt2 batch 8 / 32 / 64 23% / 32% / 20% and gpt2-xl batch 8 90% (H200, alternated
# twice; bench/results/h200/stats-in-order-everywhere-ab-811bd57.log)
SUM_IN_ORDER_GROUPS = tl.constexpr(32)


def new_row_stats(rows, cols, device, fixed=False):
    """An empty statistics buffer for `rows` rows of `cols` columns; fixed: the fixed-point
    form, zeroed."""
    shape = (rows, 2, triton.cdiv(cols, STATS_GROUP))
    if fixed:
        return torch.zeros(shape, dtype=torch.int64, device=device)
    return torch.empty(shape, dtype=torch.float32, device=device)


def check_row_stats(name, t, rows, cols, device, fixed_ok=False):
    """A launcher's check of a statistics buffer argument (None passes); fixed_ok: the
    fixed-point form (int64) too."""
    if t is not None:
        check_tensor(name, t, ndim=3, dtypes=(torch.float32, torch.int64) if fixed_ok else (torch.float32,),
                     device=device)
        check_shape(name, t, (rows, 2, triton.cdiv(cols, STATS_GROUP)))
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor")


@triton.jit
def _load_bias_residual(bias_ptr, res_ptr, rm, rn, tile_mask, n_mask, stride_rm,
                        HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The epilogue's inputs in fp32 (0.0 where absent): the decode kernel loads them early."""
    bias, res = 0.0, 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :], mask=tile_mask, other=0.0).to(tl.float32)
    return bias, res


@triton.jit
def _epilogue(acc, bias, res, y_ptr, rm, rn, tile_mask, stride_ym, negative_slope, ACTIVATION: tl.constexpr,
              STORE: tl.constexpr = True):
    """y = act(acc + bias) + residual, rounded to y's dtype and stored (unless not STORE: a
    greedy head's argmax keys alone); returns the rounded values in fp32."""
    acc = _apply_activation(acc + bias, negative_slope, ACTIVATION) + res
    y = acc.to(y_ptr.dtype.element_ty)
    if STORE:
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=tile_mask)
    return y.to(tl.float32)


@triton.jit
def _store_row_stats(vals, rm, m_mask, n0, N, stats_ptr, stride_sm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Partial row statistics of the tile vals (BLOCK_M, BLOCK_N) whose first column is n0
    (a multiple of STATS_GROUP). Out-of-range elements must be zero in vals."""
    GROUPS: tl.constexpr = BLOCK_N // 16  # STATS_GROUP
    s = tl.sum(tl.reshape(vals, (BLOCK_M, GROUPS, 16)), axis=2)
    sq = tl.sum(tl.reshape(vals * vals, (BLOCK_M, GROUPS, 16)), axis=2)
    n_groups = tl.cdiv(N, 16)
    g = n0 // 16 + tl.arange(0, GROUPS)
    mask = m_mask[:, None] & (g < n_groups)[None, :]
    ptrs = stats_ptr + rm[:, None] * stride_sm + g[None, :]
    tl.store(ptrs, s, mask=mask)
    tl.store(ptrs + n_groups, sq, mask=mask)


@triton.jit
def _add_row_stats_fixed(vals, done, b, n0, N, stats_ptr, stride_sm, BLOCK_N: tl.constexpr):
    """Adds row b's statistics of the columns `done` of vals (BLOCK_N,), half-precision values as
    stored, whose first column is n0 (a multiple of STATS_GROUP), into the fixed-point buffer:
    one relaxed atomic per group word, for the groups with a column done. Values that are not
    finite add nothing: the row's values carry them to the next layer's output."""
    GROUPS: tl.constexpr = BLOCK_N // 16  # STATS_GROUP
    v = tl.where(done & (tl.abs(vals) <= 65504.0), vals, 0.0)  # False for NaN and inf
    s = tl.sum(tl.reshape((v * FIXED_SUM_SCALE).to(tl.int64), (GROUPS, 16)), axis=1)  # exact
    # v * v is exact in fp32 (11-bit significands), and so is + 0.5 below 2**23: round to nearest
    sq = tl.sum(tl.reshape(tl.floor(v * v * FIXED_SQ_SCALE + 0.5).to(tl.int64), (GROUPS, 16)), axis=1)
    any_done = tl.max(tl.reshape(done.to(tl.int32), (GROUPS, 16)), axis=1) > 0
    n_groups = tl.cdiv(N, 16)
    g = n0 // 16 + tl.arange(0, GROUPS)
    mask = any_done & (g < n_groups)
    ptrs = stats_ptr + b * stride_sm + g
    tl.atomic_add(ptrs, s, mask=mask, sem="relaxed")
    tl.atomic_add(ptrs + n_groups, sq, mask=mask, sem="relaxed")


@triton.jit
def _load_row_stats(stats_ptr, m0, M, stride_sm, ln_eps, K, GROUPS_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """Mean and 1/std of the BLOCK_M rows from m0 (over K columns) from their partial statistics.
    tl.sum's order follows how Triton spreads the (rows, groups) tile over threads, and so the
    tile's height (and the warps, and the layout of what uses it): one 32-row tile of 8 groups
    added a row up in another order than the 16-row layouts on an H100, so 32 rows are read as
    two 16-row tiles. gpt2's rows (48 groups) then keep their bits; rows of up to
    SUM_IN_ORDER_GROUPS groups are added group after group, in every layout."""
    if BLOCK_M == 32:
        mean_a, rstd_a = _stats_tile(stats_ptr, m0, M, stride_sm, ln_eps, K, GROUPS_POW2, 16)
        mean_b, rstd_b = _stats_tile(stats_ptr, m0 + 16, M, stride_sm, ln_eps, K, GROUPS_POW2, 16)
        mean, rstd = _stack(mean_a, mean_b), _stack(rstd_a, rstd_b)
    else:
        mean, rstd = _stats_tile(stats_ptr, m0, M, stride_sm, ln_eps, K, GROUPS_POW2, BLOCK_M)
    return mean, rstd


@triton.jit
def _stats_tile(stats_ptr, m0, M, stride_sm, ln_eps, K, GROUPS_POW2: tl.constexpr, ROWS: tl.constexpr):
    rm = m0 + tl.arange(0, ROWS)
    n_groups = (K + 15) // 16
    if stats_ptr.dtype.element_ty == tl.int64:  # the fixed-point form: integer sums, any order
        g = tl.arange(0, GROUPS_POW2)
        mask = (rm < M)[:, None] & (g < n_groups)[None, :]
        ptrs = stats_ptr + rm[:, None] * stride_sm + g[None, :]
        row_sum = tl.sum(tl.load(ptrs, mask=mask, other=0), axis=1).to(tl.float32) * FIXED_SUM_UNIT
        row_sq = tl.sum(tl.load(ptrs + n_groups, mask=mask, other=0), axis=1).to(tl.float32) * FIXED_SQ_UNIT
    elif GROUPS_POW2 <= SUM_IN_ORDER_GROUPS:
        # group after group, one vector add each: an order no layout can change. tl.sum's order
        # changed with the layout at K = 96 (6 groups; bench/results/h100/rows32.md)
        rows = stats_ptr + rm * stride_sm
        row_sum = tl.zeros((ROWS,), dtype=tl.float32)
        row_sq = tl.zeros((ROWS,), dtype=tl.float32)
        for g in tl.static_range(GROUPS_POW2):
            mask = (rm < M) & (tl.full((ROWS,), g, tl.int32) < n_groups)  # a vector: the interpreter wants one
            row_sum += tl.load(rows + g, mask=mask, other=0.0)
            row_sq += tl.load(rows + n_groups + g, mask=mask, other=0.0)
    else:
        g = tl.arange(0, GROUPS_POW2)
        mask = (rm < M)[:, None] & (g < n_groups)[None, :]
        ptrs = stats_ptr + rm[:, None] * stride_sm + g[None, :]
        row_sum = tl.sum(tl.load(ptrs, mask=mask, other=0.0), axis=1)  # fixed order for a layout: deterministic
        row_sq = tl.sum(tl.load(ptrs + n_groups, mask=mask, other=0.0), axis=1)
    return _mean_rstd(row_sum, row_sq, K, ln_eps)


@triton.jit
def _stack(a, b):
    """a then b, as one vector."""
    return tl.reshape(tl.permute(tl.join(a, b), (1, 0)), (2 * a.shape[0],))


@triton.jit
def _mean_rstd(row_sum, row_sq, K, ln_eps):
    """Mean and 1/std from a row's sum and sum of squares over K columns (fp32)."""
    mean = row_sum / K
    # E[x^2] - mean^2 loses digits only when |mean| >> std, which layernorm inputs avoid. An
    # explicit fma: whether the compiler contracts a product and a difference can follow the
    # layout (_fold_ln), and with it a row's bits
    var = tl.maximum(tl.fma(-mean, mean, row_sq / K), 0.0)
    return mean, 1.0 / tl.sqrt(var + ln_eps)


def epilogue_meta(x2, K, bias, activation, residual, ln_fold, ln_stats, stats_out, prefetch_residual, early_launch,
                  pdl):
    """The constexpr arguments of a decode GEMV kernel (gemv.py, gemv_slab.py) that describe its
    inputs and epilogue, for rows x2 of K columns."""
    return dict(K=K, HAS_BIAS=bias is not None, ACTIVATION=activation, HAS_RESIDUAL=residual is not None,
                LN_FOLD=ln_fold is not None, LN_STATS=ln_stats is not None, STATS_OUT=stats_out is not None,
                GROUPS_POW2=triton.next_power_of_2(triton.cdiv(K, STATS_GROUP)),
                INPUT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", USE_PDL=pdl,
                PREFETCH_RESIDUAL=bool(prefetch_residual), EARLY_LAUNCH=bool(early_launch),
                LN_BLOCK=row_stats_block(K), LN_POW2=row_terms_pow2(K))


def row_stats_block(K):
    """The chunk width of _row_stats for K columns."""
    return min(LN_BLOCK, triton.next_power_of_2(K))


def row_terms_pow2(K):
    """_row_stats's P: a power of two >= 4 and >= the K terms of a row's sums."""
    return max(4, triton.next_power_of_2(K))


@triton.jit
def _grid_shift(top, P: tl.constexpr):
    """Rounds fp64 values below 2^(E + 1) to multiples of u = 2^(E + p - 52) when added and
    subtracted, where 2^E <= top < 2^(E + 1) and P = 2^p >= 4 bounds the terms of a sum: every
    partial sum of up to P such values is then a multiple of u below 2^53 u, which fp64 holds
    exactly, so a sum of them has the same bits in any order of addition. 1.5 * 2^(E + p) keeps
    value + shift in one binade, whose spacing is u. top (rows,) fp64 >= 0; 0 rounds nothing,
    inf or NaN make the sums NaN."""
    pow2 = (top.to(tl.int64, bitcast=True) & 0x7FF0000000000000).to(tl.float64, bitcast=True)  # 2^E
    return pow2 * (1.5 * P)


@triton.jit
def _row_chunk(x_ptr, rm, m_mask, k0, stride_xm, stride_xk, K: tl.constexpr, LN_BLOCK: tl.constexpr):
    kk = k0 + tl.arange(0, LN_BLOCK)
    return tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                   mask=m_mask[:, None] & (kk[None, :] < K), other=0.0).to(tl.float32)


@triton.jit
def _row_stats(x_ptr, rm, m_mask, stride_xm, stride_xk, ln_eps,
               K: tl.constexpr, BLOCK_M: tl.constexpr, LN_BLOCK: tl.constexpr, P: tl.constexpr):
    """Mean and 1/std of rows rm over all K columns, from the rows themselves, in sums whose
    bits no layout can change. tl.sum adds in an order that follows how Triton lays the tile
    over threads, which follows the launch's rows and warps and the Triton version, so the
    values are first rounded to the grid of the row's largest (_grid_shift with
    P = row_terms_pow2(K)), which costs 2^(p - 53) of it. Two passes over the row: its largest
    |value| (the chunks' loads issued together), then the sums in fp64, a chunk at a time
    (an fp32 square is exact there)."""
    top = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in tl.static_range(0, K, LN_BLOCK):  # a max is exact in any order
        xk = _row_chunk(x_ptr, rm, m_mask, k0, stride_xm, stride_xk, K, LN_BLOCK)
        top = tl.maximum(top, tl.max(tl.abs(xk), axis=1))
    top = top.to(tl.float64)
    shift = _grid_shift(top, P)[:, None]
    shift_sq = _grid_shift(top * top, P)[:, None]
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float64)
    row_sq = tl.zeros((BLOCK_M,), dtype=tl.float64)
    for k0 in range(0, K, LN_BLOCK):  # a loop: fp64 chunks side by side would spill
        x64 = _row_chunk(x_ptr, rm, m_mask, k0, stride_xm, stride_xk, K, LN_BLOCK).to(tl.float64)
        row_sum += tl.sum((x64 + shift) - shift, axis=1)
        row_sq += tl.sum((x64 * x64 + shift_sq) - shift_sq, axis=1)
    return _mean_rstd(row_sum.to(tl.float32), row_sq.to(tl.float32), K, ln_eps)


@triton.jit
def _fold_ln(acc, colsum, mean, rstd):
    """A folded layernorm applied to x @ (g * W) (kernels.reference.fold_layernorm): each row's
    rstd * (acc - mean * colsum), the shift left to the epilogue's bias. colsum (1, N) fp32.
    One explicit fma: Triton 3.9 (H200) contracted the product and the difference in the looping
    layout and not in the split one, where the product crossed a layout conversion first, so a
    row's bits depended on the batch (test_gemv_layernorm_same_rows_at_any_batch)."""
    return tl.fma(-mean[:, None], colsum, acc) * rstd[:, None]


@triton.jit
def _finish_tile(acc, colsum, mean, rstd, bias, res, res_ptr, y_ptr, stats_ptr, rm, rn, m_mask, tile_mask, n0, N,
                 stride_rm, stride_ym, stride_sm, negative_slope, ACTIVATION: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, PREFETCH_RESIDUAL: tl.constexpr, LN_FOLD: tl.constexpr,
                 STATS_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STORE: tl.constexpr = True):
    """A decode GEMV's output tile (rows rm, columns rn from n0) from its fp32 sum acc: the folded
    layernorm (LN_FOLD: colsum, mean, rstd), _epilogue with the residual as prefetched (res) or
    loaded now, and the tile's row statistics (STATS_OUT). Returns the values as rounded for y,
    in fp32; stores them unless not STORE."""
    if LN_FOLD:
        acc = _fold_ln(acc, colsum, mean, rstd)
    # res is the constant 0.0 here: loading into it inside a runtime if would change its type
    if HAS_RESIDUAL and not PREFETCH_RESIDUAL:
        late_res = tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :], mask=tile_mask, other=0.0)
        y = _epilogue(acc, bias, late_res.to(tl.float32), y_ptr, rm, rn, tile_mask, stride_ym, negative_slope,
                      ACTIVATION, STORE)
    else:
        y = _epilogue(acc, bias, res, y_ptr, rm, rn, tile_mask, stride_ym, negative_slope, ACTIVATION, STORE)
    if STATS_OUT:
        _store_row_stats(tl.where(tile_mask, y, 0.0), rm, m_mask, n0, N, stats_ptr, stride_sm, BLOCK_M, BLOCK_N)
    return y
