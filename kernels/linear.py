"""Fused linear: y = act(layernorm?(x) @ W + bias) + residual, in one kernel.

W is (K, N) with any strides: Hugging Face GPT-2 Conv1D weights ((in, out), N contiguous) and
nn.Linear weights passed as `w.t()` (K contiguous) both run without a copy.

Two launch shapes share one kernel:
- prefill (M > SMALL_M): classic output tiles, grouped program order for L2 reuse, autotuned on
  (M bucket, N, K);
- decode (M <= SMALL_M): a few rows leave most SMs idle with output tiles alone, so K is split
  across SPLIT_K programs. Each writes an fp32 partial tile; the last program of a tile to
  arrive (an atomic counter) sums the partials in a fixed order, runs the epilogue and stores.
  The reduction order depends only on (N, K), never on M or timing: results are deterministic
  and the same for a row whether it runs alone or among 64.
The optional layernorm prologue (decode rows) recomputes each row's statistics over the whole K
in every program (rows are a few KB, read from L2), which removes the layernorm launch; with
prefill rows the launcher runs the layernorm kernel once instead, as many tiles share a row.
"""
import torch
import triton
import triton.language as tl

from ._checks import check_device_usable, check_shape, check_tensor
from ._tuning import INTERPRET, autotune, pick
from ._workspace import arrival_counters
from .activations import ACTIVATIONS, _apply_activation
from .layernorm import layernorm

SMALL_M = 64


def _cfg(bm, bn, bk, split, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split},
                         num_warps=warps, num_stages=stages)


# BLOCK_M stays 16 in every decode config: a row's arithmetic is then the same at any M <= 64
_DECODE_CONFIGS = [  # the first is the untuned default (MINILLM_AUTOTUNE=0)
    _cfg(16, bn, bk, split, w, s)
    for bn, bk, split, w, s in (
        (64, 128, 2, 4, 3), (64, 128, 1, 4, 3), (64, 128, 4, 4, 3), (32, 128, 4, 4, 3), (32, 128, 8, 4, 3),
        (16, 128, 8, 2, 3), (32, 64, 8, 4, 3), (64, 64, 8, 4, 3), (128, 64, 2, 4, 3), (32, 128, 16, 4, 3),
        # GEMV-like: narrow column blocks, whole K per program, no cross-program reduction
        (16, 256, 1, 4, 3), (32, 256, 2, 4, 3), (16, 128, 4, 2, 4),
    )
]
_PREFILL_CONFIGS = [
    _cfg(128, 128, 64, 1, 8, 3), _cfg(128, 256, 64, 1, 8, 3), _cfg(64, 128, 64, 1, 4, 4), _cfg(128, 64, 64, 1, 4, 4),
]
# the interpreter runs every program in Python: one config each, few programs
if INTERPRET:
    _DECODE_CONFIGS = [_cfg(16, 128, 64, 1, 4, 1)]  # split-K has its own tests (_config)
    _PREFILL_CONFIGS = [_cfg(64, 64, 64, 1, 4, 1)]
MAX_SPLIT_K = max(c.kwargs["SPLIT_K"] for c in _DECODE_CONFIGS)
SPLIT_WORKSPACE = 1 << 22  # fp32 partials per launch at most (16 MB at M = SMALL_M)


def _max_split(N):
    """Wide outputs (the lm_head) get fewer splits; they have enough column tiles anyway. A
    function of N alone, so a row's reduction order never depends on the batch (M)."""
    split = MAX_SPLIT_K
    while split > 1 and split * SMALL_M * N > SPLIT_WORKSPACE:
        split //= 2
    return split


def _prune_splits(configs, named_args, **kwargs):
    limit = _max_split(named_args["N"])
    return [c for c in configs if c.kwargs["SPLIT_K"] <= limit] or configs[:1]


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, lnw_ptr, lnb_ptr, part_ptr, count_ptr,
    M, N, K, M_BUCKET, ln_eps, negative_slope,
    stride_xm, stride_xk, stride_wk, stride_wn, stride_rm, stride_ym,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    HAS_LN: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # grouped ordering: GROUP_M row-tiles sweep the same weight columns while they sit in L2
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % group_m
    pid_n = (pid % group_size) // group_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N

    if HAS_LN:  # row statistics over the full K in one pass (sum and sum of squares, fp32)
        row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        row_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xk = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :] * stride_xk,
                         mask=m_mask[:, None] & ((k0 + rk)[None, :] < K), other=0.0).to(tl.float32)
            row_sum += tl.sum(xk, axis=1)
            row_sq += tl.sum(xk * xk, axis=1)
        mean = row_sum / K
        # E[x^2] - mean^2 loses digits only when |mean| >> std, which layernorm inputs avoid
        var = tl.maximum(row_sq / K - mean * mean, 0.0)
        rstd = 1.0 / tl.sqrt(var + ln_eps)

    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < k_end
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if HAS_LN:
            g = tl.load(lnw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            b = tl.load(lnb_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            a = (a.to(tl.float32) - mean[:, None]) * rstd[:, None] * g[None, :] + b[None, :]
            a = tl.where(k_mask[None, :], a, 0.0)
        w = tl.load(w_ptr + kk[:, None] * stride_wk + rn[None, :] * stride_wn,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a.to(w.dtype), w, acc, input_precision=INPUT_PRECISION)

    tile_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        part = part_ptr + rm[:, None] * N + rn[None, :]
        tl.store(part + pid_k * M * N, acc, mask=tile_mask)
        # acq_rel: our partial is visible before the count moves; the last arriver sees all
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):  # fixed order: deterministic sums
                acc += tl.load(part + s * M * N, mask=tile_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid, 0)  # ready for the next launch (and graph replay)
            _epilogue(acc, bias_ptr, res_ptr, y_ptr, rm, rn, tile_mask, n_mask, stride_rm, stride_ym,
                      negative_slope, HAS_BIAS, ACTIVATION, HAS_RESIDUAL)
    else:
        _epilogue(acc, bias_ptr, res_ptr, y_ptr, rm, rn, tile_mask, n_mask, stride_rm, stride_ym,
                  negative_slope, HAS_BIAS, ACTIVATION, HAS_RESIDUAL)


@triton.jit
def _epilogue(acc, bias_ptr, res_ptr, y_ptr, rm, rn, tile_mask, n_mask, stride_rm, stride_ym,
              negative_slope, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    acc = _apply_activation(acc, negative_slope, ACTIVATION)
    if HAS_RESIDUAL:
        acc += tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :], mask=tile_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=tile_mask)


# restore y: with out=residual (in-place residual add) a tuning run must not accumulate
_linear_decode = autotune(_DECODE_CONFIGS, key=["N", "K", "stride_wk", "stride_wn"],
                          restore_value=["y_ptr"], prune_configs_by={"early_config_prune": _prune_splits})(_linear_kernel)
_linear_prefill = autotune(_PREFILL_CONFIGS, key=["M_BUCKET", "N", "K", "stride_wk", "stride_wn"],
                           restore_value=["y_ptr"])(_linear_kernel)

def linear(x, weight, bias=None, activation=None, residual=None, negative_slope=0.01,
           ln_weight=None, ln_bias=None, ln_eps=1e-5, out=None, _config=None):
    """act(layernorm?(x) @ weight + bias) + residual in one kernel, fp32 accumulation.

    x: (..., K); weight: (K, N), any strides; bias: (N,); residual and out: (..., N) like x.
    ln_weight/ln_bias (K,): normalize each row of x first (GPT-2's ln_1/ln_2 fused in).
    _config: tests only: a dict of BLOCK_M/BLOCK_N/BLOCK_K/SPLIT_K that bypasses autotuning.
    """
    check_tensor("x", x, min_ndim=1)
    check_device_usable("x", x)
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), device=x.device)
    K, N = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"weight: expected ({x.shape[-1]}, N) to match x's last dim, got {tuple(weight.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, device=x.device)
        check_shape("bias", bias, (N,))
    if (ln_weight is None) != (ln_bias is None):
        raise ValueError("ln_weight/ln_bias: expected both or neither")
    for name, t in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if t is not None:
            check_tensor(name, t, ndim=1, device=x.device)
            check_shape(name, t, (K,))
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    out_shape = (*x.shape[:-1], N)
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), device=x.device, last_contiguous=True)
        check_shape("residual", residual, out_shape)
    y = x.new_empty(out_shape) if out is None else out
    check_tensor("out", y, dtypes=(x.dtype,), device=x.device)
    check_shape("out", y, out_shape)
    if not y.is_contiguous():
        raise ValueError("out: expected a contiguous tensor")
    r2 = residual.reshape(-1, N) if residual is not None else y.view(-1, N)
    y2 = y.view(-1, N)
    if M == 0:
        return y

    small = M <= SMALL_M
    if ln_weight is not None and not small:
        # many row tiles would each recompute the statistics: normalize once instead
        x2 = layernorm(x2, ln_weight, ln_bias, ln_eps)
        ln_weight = ln_bias = None
    kernel, meta = pick(_linear_decode, _DECODE_CONFIGS) if small else pick(_linear_prefill, _PREFILL_CONFIGS)
    max_split = (_max_split(N) if not meta else meta["SPLIT_K"]) if small else 1
    if _config is not None:
        kernel, meta, max_split = _linear_kernel, dict(_config), _config["SPLIT_K"]
    part = x.new_empty((max_split * M * N,) if max_split > 1 else (1,), dtype=torch.float32)
    counts = arrival_counters(x.device, triton.cdiv(M, 16) * triton.cdiv(N, 32)) if max_split > 1 else part
    grid = lambda META: (triton.cdiv(M, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"]), META["SPLIT_K"])
    dummy = y2
    kernel[grid](
        x2, weight, bias if bias is not None else dummy, r2, y2,
        ln_weight if ln_weight is not None else dummy, ln_bias if ln_bias is not None else dummy,
        part, counts,
        M, N, K, triton.next_power_of_2(M), ln_eps, negative_slope,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), r2.stride(0), y2.stride(0),
        HAS_BIAS=bias is not None, ACTIVATION=activation, HAS_RESIDUAL=residual is not None,
        HAS_LN=ln_weight is not None,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        GROUP_M=8, **meta,
    )
    return y
