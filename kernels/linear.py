"""Fused linear: y = act(x @ W + bias) + residual, with an optional folded layernorm.

W is (K, N) with any strides: Hugging Face GPT-2 Conv1D weights ((in, out), N contiguous) and
nn.Linear weights passed as `w.t()` (K contiguous) both run without a copy.

A layernorm before the linear is folded into it (reference.fold_layernorm: W and bias carry
its gain and shift, ln_fold the column sums of W):
  layernorm(x) @ W + c = rstd * (x @ (g * W) - mean * colsum(g * W)) + (b @ W + c).

Two kernels behind one launcher:
- decode rows (M <= 64) go to `gemv.py`: split-K, weight-read bound. A folded layernorm costs
  the product nothing there: x goes into it as it is, and the epilogue applies the right-hand
  side with each row's mean and 1/std;
- prefill rows use the classic output-tile kernel below, grouped program order for L2 reuse.
  Where x and W are in the layout TMA reads (2-byte floats, 16-byte aligned rows, W out-major)
  on a Hopper GPU, their tiles come in by tensor descriptors, in a layout tma_config picks;
  elsewhere by pointer loads, autotuned on (M bucket, N, K). With a folded layernorm the
  launcher standardizes the rows first ((x - mean) * rstd, the layernorm kernel without gain
  and shift), and the tile kernel multiplies those by g * W: many column tiles share a row, and
  taking its statistics in each (in the epilogue, from partial sums) made a 1024-token prompt's
  first token 1.44 ms against 1.35 on an H100 (so prefill_row_stats gives those rows none).
"""
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._checks import check_device_usable, check_shape, check_tensor
from ._epilogue import _epilogue, _load_bias_residual, _store_row_stats, check_row_stats, new_row_stats
from ._l2_ahead import l2_ranges
from ._tuning import INTERPRET, autotune, compiling_ahead, launch, pick, tma_ready
from .activations import ACTIVATIONS
from .argmax_key import row_keys
from .embedding import check_embedding, embedding
from .gemv import gemv
from .gemv_fma import fma_config, gemv_fma
from .gemv_config import SMALL_M
from .layernorm import standardize

# a decode step's embedding gathered by its first linear where that runs on the CUDA-core GEMV
# (embedding_linear); MINILLM_EMBED_FOLD=0 keeps two launches (A/B timing)
EMBED_FOLD = os.environ.get("MINILLM_EMBED_FOLD", "1") != "0"
# prefill tiles by tensor descriptors (TMA) where x and W allow it; MINILLM_PREFILL_TMA=0 keeps the
# pointer loads (A/B timing)
PREFILL_TMA = os.environ.get("MINILLM_PREFILL_TMA", "1") != "0"
# where tma_config takes 128-row tiles: a widening layer's output elements (M x N), another's
# multiply-adds (M x N x K)
TMA_WIDE = 7 << 19
TMA_DEEP = 5 << 30


def _cfg(bm, bn, bk, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)


# the first is the untuned default (MINILLM_AUTOTUNE=0). Every config runs BLOCK_M >= 64 in whole
# warpgroups (Hopper's wgmma), each output adding its K products in the same 16-wide steps in order,
# so the choice (which follows M) keeps a row's bits. At a 1024-token prompt 64-row tiles in 3
# stages took gpt2's four layers from 56.8 to 45.6 us on an H200; 64 x 128 x 128 tiles are best for
# K = 768 -> 768 and 3072 -> 768, where few tiles fill the GPU (bench/results/h200/prefill-linear-sweep.md)
_CONFIGS = [
    _cfg(128, 128, 64, 8, 3), _cfg(128, 256, 64, 8, 3), _cfg(64, 128, 64, 4, 3), _cfg(64, 128, 128, 4, 3),
]
if INTERPRET:  # the interpreter runs every program in Python: one small config
    _CONFIGS = [_cfg(64, 64, 64, 4, 1)]


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, stats_out_ptr,
    M, N, K, M_BUCKET, negative_slope,
    stride_xm, stride_xk, stride_wk, stride_wn, stride_rm, stride_ym, stride_so,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    STATS_OUT: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # grouped ordering: GROUP_M row-tiles sweep the same weight columns while they sit in L2
    pid = tl.program_id(0)
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if TMA:  # x_ptr, w_ptr: descriptors of x (M, K) and W's out-major (N, K), zero past the edges
            a = x_ptr.load([pid_m * BLOCK_M, k0])
            w = w_ptr.load([pid_n * BLOCK_N, k0]).T
        else:
            kk = k0 + rk
            k_mask = kk < K
            a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptr + kk[:, None] * stride_wk + rn[None, :] * stride_wn,
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
    tile_mask = m_mask[:, None] & n_mask[None, :]
    bias, res = _load_bias_residual(bias_ptr, res_ptr, rm, rn, tile_mask, n_mask, stride_rm, HAS_BIAS, HAS_RESIDUAL)
    y = _epilogue(acc, bias, res, y_ptr, rm, rn, tile_mask, stride_ym, negative_slope, ACTIVATION)
    if STATS_OUT:
        _store_row_stats(tl.where(tile_mask, y, 0.0), rm, m_mask, pid_n * BLOCK_N, N, stats_out_ptr, stride_so,
                         BLOCK_M, BLOCK_N)


# restore y: with out=residual (in-place residual add) a tuning run must not accumulate
_linear_tuned = autotune(_CONFIGS, key=["M_BUCKET", "N", "K", "stride_wk", "stride_wn"],
                         restore_value=["y_ptr"])(_linear_kernel)


def tma_config(M, N, K):
    """The prefill tile layout where x and W come in by tensor descriptors: a rule, not the
    autotuner, whose on-disk cache skips configs with a pre-hook (which would set the
    descriptors' tile shapes), so every process would tune again. Each layer alone in a CUDA
    graph on an H200, every layout the same bits (bench/results/h200/session-102/call2-probe.log,
    call5-rule.log; one reading each):
    - widening layers (qkv, fc): 64-row tiles in 3 stages, past TMA_WIDE output elements 128-row
      tiles in 8 warps (gpt2 at 1,024 rows: qkv 9.1, fc 11.4 us against the pointer loads' 11.7
      and 12.8; at 2,048 qkv 17.2, fc 21.9 against 19.5 and 25.6);
    - the others (attn-out, mlp-out): 64-row tiles in 4 stages (gpt2 at 1,024 rows attn-out 6.0,
      mlp-out 12.5 against 6.6 and 14.6), past TMA_DEEP multiply-adds 128-row tiles in 4 warps
      (gpt2-xl's mlp-out at 1,024 rows 41.6 against 45.0, at 2,048 85.7 against 99.0).
    The four layers at 1,024 / 2,048 rows: gpt2 45.7 -> 39.0 / 83.7 -> 68.7 us (cuBLAS 31.9 /
    54.2), gpt2-xl 158.4 -> 131.2 / 276.5 -> 256.3 (116.7 / 223.9)."""
    if N > K:
        if M * N > TMA_WIDE:
            return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)
    if M * N * K > TMA_DEEP:
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)


def prefill_row_stats(rows, cols, device):
    """new_row_stats for a prefill of `rows` rows, or None past SMALL_M rows, where the linears
    read x's rows (standardize) and writing statistics would cost each tile for nothing."""
    return None if rows > SMALL_M else new_row_stats(rows, cols, device)


def _tma_ok(x2, weight):
    """Whether tensor descriptors can read x2 (M, K) and W's out-major storage (N, K) (tma_ready)."""
    return PREFILL_TMA and tma_ready(x2, weight.t())


def _check_layer(x, weight, bias, activation, ln_fold):
    """linear's checks of the layer's tensors against x; returns (K, N)."""
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), device=x.device)
    K, N = weight.shape
    if x.shape[-1] == 0:  # (keys_only's stand-in output is x's first element)
        raise ValueError(f"x: expected at least one feature in its last dim, got shape {tuple(x.shape)}")
    if x.shape[-1] != K:
        raise ValueError(f"weight: expected ({x.shape[-1]}, N) to match x's last dim, got {tuple(weight.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, device=x.device)
        check_shape("bias", bias, (N,))
    if ln_fold is not None:
        check_tensor("ln_fold", ln_fold, ndim=1, dtypes=(torch.float32,), device=x.device)
        check_shape("ln_fold", ln_fold, (N,))
    return K, N


def linear(x, weight, bias=None, activation=None, residual=None, negative_slope=0.01,
           ln_fold=None, ln_eps=1e-5, out=None, ln_stats=None, stats_out=None, argmax_keys=None,
           prefetch_residual=False, early_launch=False, l2_ahead=(), keys_only=False, _config=None):
    """act(x @ weight + bias) + residual in one kernel, fp32 accumulation.

    x: (..., K); weight: (K, N), any strides; bias: (N,); residual and out: (..., N) like x.
    ln_fold (N,) fp32: a layernorm of x's rows folded in (GPT-2's ln_1/ln_2/ln_f): weight, bias
    and ln_fold are reference.fold_layernorm(W, c, g, b)'s three results, and the output is
    act(layernorm(x) @ W + c) + residual, normalized with eps ln_eps.
    stats_out: a `new_row_stats(rows, N)` buffer that receives the output rows' partial
    statistics; ln_stats: the same for x, written by the kernel that produced x, so the folded
    layernorm need not read whole rows (decode rows; prefill rows standardize from x).
    argmax_keys: an int64 tensor of x's leading shape, holding argmax_key.EMPTY (or earlier keys):
    each output row's argmax (lowest index among ties, as torch.argmax) is max-ed into it as a
    key, which argmax_key.argmax_index (or append_tokens) turns into the index. Greedy
    decoding's token, fused into the lm_head for decode rows.
    keys_only (with argmax_keys): the keys are all the caller wants; decode rows then write no
    output (a greedy head past one row: 6.4 MB of logits a step at gpt2 batch 64), and linear
    returns None (out must be None).
    prefetch_residual: decode rows read the residual before waiting on the previous kernel
    (programmatic dependent launch); only for a residual that kernel does not write.
    early_launch: decode rows let the next kernel launch at this one's start rather than after
    its wait, so the next one's weights stream in behind all of this one (where that pays is the
    caller's choice: minillm.decode_plan.early_roles). The caller vouches that the next kernel reads
    nothing before its wait that the kernel before this one writes (no prefetch_residual).
    l2_ahead: up to two dense tensors (later kernels' weights) whose bytes a one-row CUDA-core
    launch (gemv_fma.py) asks L2 for before its wait (_l2_ahead.py; Hopper only, results
    unchanged); other layouts ignore them.
    _config: tests and benchmarks only: a launch config in place of the autotuner's (prefill
    rows: BLOCK_M/BLOCK_N/BLOCK_K, pointer loads unless TMA=True where _tma_ok allows it) or of
    gemv_config.decode_config's (decode rows: BLOCK_N/BLOCK_K/CHUNKS/SPLIT, optionally BLOCK_M and
    num_warps).
    """
    check_tensor("x", x, min_ndim=1)
    check_device_usable("x", x)
    K, N = _check_layer(x, weight, bias, activation, ln_fold)
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    out_shape = (*x.shape[:-1], N)
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), device=x.device, last_contiguous=True)
        check_shape("residual", residual, out_shape)
    if keys_only and (argmax_keys is None or out is not None):
        raise ValueError("keys_only: expected argmax_keys and no out")
    if out is not None:
        check_tensor("out", out, dtypes=(x.dtype,), device=x.device)
        check_shape("out", out, out_shape)
        if not out.is_contiguous():
            raise ValueError("out: expected a contiguous tensor")
    check_row_stats("ln_stats", ln_stats, M, K, x.device, fixed_ok=True)
    check_row_stats("stats_out", stats_out, M, N, x.device)
    if ln_stats is not None and ln_fold is None:
        raise ValueError("ln_stats: given without ln_fold")
    if argmax_keys is not None:
        check_tensor("argmax_keys", argmax_keys, dtypes=(torch.int64,), device=x.device)
        check_shape("argmax_keys", argmax_keys, x.shape[:-1])
        if not argmax_keys.is_contiguous():
            raise ValueError("argmax_keys: expected a contiguous tensor")
    ranges = l2_ranges("l2_ahead", l2_ahead, x.device)
    r2 = residual.reshape(-1, N) if residual is not None else None
    if keys_only and M <= SMALL_M:
        # nothing is stored: x's first element stands in for the output (its dtype, x's, rounds
        # the values the keys come from), so the per-token path allocates nothing
        y, y2 = None, x2[:1, :1].expand(M, N)
    else:
        y = x.new_empty(out_shape) if out is None else out
        y2 = y.view(-1, N)
    if M == 0:
        return y
    if M <= SMALL_M:
        gemv(x2, weight, bias, r2, y2, ln_fold, ln_eps, activation, negative_slope,
             ln_stats, stats_out, argmax_keys.view(-1) if argmax_keys is not None else None, prefetch_residual,
             _config, early_launch, ranges, store=y is not None)
        return y

    if ln_fold is not None:  # then (x - mean) * rstd @ (g * W) + (b @ W + c)
        x2 = standardize(x2, ln_eps)
    kernel, meta = pick(_linear_tuned, _CONFIGS)
    if _config is not None:
        kernel, meta = _linear_kernel, dict(_config)
    tma = meta.pop("TMA", _config is None) and _tma_ok(x2, weight)
    xs, ws = x2, weight
    if tma:
        kernel, meta = _linear_kernel, meta if _config is not None else tma_config(M, N, K)
        xs = TensorDescriptor.from_tensor(x2, [meta["BLOCK_M"], meta["BLOCK_K"]])
        ws = TensorDescriptor.from_tensor(weight.t(), [meta["BLOCK_N"], meta["BLOCK_K"]])
    r2 = r2 if r2 is not None else y2
    grid = lambda META: (triton.cdiv(M, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"]),)
    launch(
        kernel, grid, xs, ws, bias if bias is not None else y2, r2, y2, stats_out if stats_out is not None else y2,
        M, N, K, triton.next_power_of_2(M), negative_slope,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), r2.stride(0), y2.stride(0),
        stats_out.stride(0) if stats_out is not None else 0,
        HAS_BIAS=bias is not None, ACTIVATION=activation, HAS_RESIDUAL=residual is not None,
        STATS_OUT=stats_out is not None,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", TMA=tma, GROUP_M=8, **meta,
    )
    # prefill rows: a separate reduction of the stored output, which a dry pass (compile_ahead)
    # leaves unwritten: there the caller's keys stay as they are
    if argmax_keys is not None and not compiling_ahead():
        keys = argmax_keys.view(-1)
        torch.maximum(keys, row_keys(y2), out=keys)
    return None if keys_only else y


def embedding_linear(ids, pos, wte, wpe, weight, bias=None, ln_fold=None, ln_eps=1e-5, stats=None, lens_out=None,
                     early_launch=False):
    """A decode step's first two ops, (x, y): x = embedding(ids, pos, wte, wpe, stats_out=stats,
    lens_out=lens_out) and y = linear(x, weight, bias, ln_fold=ln_fold, ln_eps=ln_eps,
    ln_stats=stats, early_launch=early_launch), the same bits. Where that linear runs the one-row
    CUDA-core GEMV (gemv_fma.py: no statistics), one launch: every program gathers the row's
    embedding beside its weights, the first column block stores x and the lengths, and the step
    begins with weights streaming (an embedding launch held layer 0's qkv back by its latency).
    MINILLM_EMBED_FOLD=0 keeps the two launches (A/B timing)."""
    check_embedding(ids, pos, wte, wpe, lens_out)
    R = ids.shape[0]
    x = torch.empty((R, wte.shape[1]), dtype=wte.dtype, device=wte.device)
    K, N = _check_layer(x, weight, bias, None, ln_fold)
    config = fma_config(R, N, K, weight.stride(0)) if EMBED_FOLD and R and stats is None else None
    if config is None:
        embedding(ids, pos, wte, wpe, out=x, stats_out=stats, lens_out=lens_out)
        return x, linear(x, weight, bias, ln_fold=ln_fold, ln_eps=ln_eps, ln_stats=stats, early_launch=early_launch)
    y = x.new_empty((R, N))
    lens = lens_out if lens_out is not None else torch.empty_like(pos)
    gemv_fma(x, weight, bias, None, y, ln_fold, ln_eps, None, 0.0, False, config, early_launch,
             embed=(ids, pos, wte, wpe, lens))
    return x, y
