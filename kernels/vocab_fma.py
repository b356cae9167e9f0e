"""Decode-time vocabulary head for one row on CUDA cores: logits = layernorm(x) @ W + bias
(the layernorm folded in, as linear's ln_fold) and greedy decoding's argmax, in one persistent
launch.

A vocabulary head at one row is a pure weight stream (gpt2: 77 MB for 50k outputs), so what
counts is keeping the memory bus busy to the last byte. The tensor-core GEMV (gemv.py) runs it
as 786 column-block programs in 1.5 waves, each one loading x, taking the row's statistics and
max-ing its argmax key into the row's word; here many small programs per SM loop over column
blocks:
- a program is one warp that owns BLOCK_N columns at a time over the whole of K (out-major
  weights: each column's K weights contiguous, as nn.Linear stores them) and requests its next
  block before it reduces the current one, so every program keeps two blocks in flight. One
  warp holds a column's whole K, so every reduction stays in the warp: no barrier after the
  wait, where 4-warp programs took 10 (their sums over K crossed the warps);
- x and its layernorm statistics are loaded once per program, after the programmatic-
  dependent-launch wait; the first block is requested before it;
- the argmax runs in registers over all of a program's blocks (per lane the first maximum,
  lanes then reduced to the lowest column among equal maxima), and each program max-es one key
  (argmax_key.py) into the row's word.
Products and sums are fp32 on CUDA cores, as in gemv_fma.py: the row's logits differ from the
tensor-core path's (a row inside a batch) only in the last bits.
"""
import os

import triton
import triton.language as tl

from ._epilogue import _mean_rstd
from ._tuning import (FP_FUSION, INTERPRET, compiling_ahead, launch, layout_switch, programs_by_registers, sm_count,
                      use_pdl)
from .argmax_key import _argmax_key, _no_token_if_nan
from .gemv_fma import VOCAB_N, _row_dot, _row_sums, pad_fold

# MINILLM_FMA_VOCAB=0 sends vocabulary heads back to the tensor-core GEMV (A/B timing)
ENABLED = os.environ.get("MINILLM_FMA_VOCAB", "1") != "0"
BLOCK_N = 2  # columns per block below ONE_COLUMN_K
ONE_COLUMN_K = 1024  # from this K 1 column a block: 2 would hold 103 registers (19 programs an SM)
NUM_WARPS = 1
PROGRAMS_PER_SM = 24  # 80 registers a thread (Triton 3.6): 24 one-warp programs fit an SM's 64K
INTERPRET_BLOCK_N = 256  # the interpreter runs every program in Python: fewer, wider blocks
MAX_K = 1024  # gpt2's 768 and gpt2-medium's 1024 gained end to end; gpt2-large's 1280 lost (see vocab_config)


def forced_layout(text):
    """MINILLM_VOCAB_LAYOUT's (BLOCK_N, num_warps, programs an SM), e.g. "2x1x16", or None where
    unset (A/B timing). One ValueError for anything else."""
    return layout_switch("MINILLM_VOCAB_LAYOUT", text, "BLOCK_NxWARPSxPROGRAMS", "8x4x4", pow2=2)


FORCED_LAYOUT = forced_layout(os.environ.get("MINILLM_VOCAB_LAYOUT"))


def vocab_config(M, N, K, stride_wk, *, sms):
    """Launch parameters of the persistent CUDA-core head for M rows of a (K -> N) layer, or None
    where the tensor-core GEMV runs it: more than one row, narrower than a vocabulary, weights
    not out-major, or K past MAX_K. First chosen on an H100 (bench/results/h100/vocab-head.md):
    8 columns in 4 warps, 4 programs an SM, from a sweep of 8 or 16 columns, 4 or 8 warps, 2 to
    8 programs an SM (gpt2's head alone 30.5 -> 27.9 us; end to end +1.9%); gpt2-medium's head
    (K = 1024) lost 0.7% there. One-warp programs were not in that sweep. H200, gpt2 batch 1,
    alternated twice, the same ids (bench/results/h200/session-77/): 2 columns, 24 an SM 7,891 /
    7,877 -> 8,091 / 8,089 tok/s (+2.6%), and 7,908 / 7,867 -> 8,097 / 8,044 (+2.3%) in a second
    call, sampled +2.8%; 2 columns 16 an SM +1.9%, 20 +1.5%; 1 column 24 an SM +1.5%, 32 +0.7%;
    4 columns 8 an SM +0.3%. Alone (L2 flushed) the head took 22.9 against 25.1 us. Past K =
    1023, H200, alternated twice, the same ids (bench/results/h200/session-78/): gpt2-medium
    batch 1 2,261 / 2,268 -> 2,280 / 2,284 tok/s (+0.8%) with 1 column at 24 an SM (Triton 3.6:
    75 registers), even with 2 (103 registers: 19 an SM); gpt2-large (K = 1280) -0.3% and -1.1%,
    hence MAX_K. MINILLM_VOCAB_LAYOUT=BLOCK_NxWARPSxPROGRAMS takes another layout (A/B timing)."""
    if not ENABLED or M != 1 or N < VOCAB_N or stride_wk != 1 or K > MAX_K:
        return None
    block_n, warps, per_sm = FORCED_LAYOUT or (BLOCK_N if K < ONE_COLUMN_K else 1, NUM_WARPS, PROGRAMS_PER_SM)
    block_n = INTERPRET_BLOCK_N if INTERPRET else block_n
    return dict(BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(K), num_warps=warps, per_sm=per_sm,
                programs=min(triton.cdiv(N, block_n), sms * per_sm))


@triton.jit
def _block_logits(w, xf, k_mask, rn, n_mask, bias_ptr, fold_ptr, mean, rstd, y_ptr, HAS_BIAS: tl.constexpr,
                  LN_FOLD: tl.constexpr, STORE: tl.constexpr, PAD_FOLD: tl.constexpr):
    """One block's logits (BLOCK_N,) from its weights w (BLOCK_N, BLOCK_K), rounded to y's dtype:
    stored (STORE), and returned as stored, in fp32."""
    # the column sums and the bias first, so their round trip overlaps the reduction (loaded
    # after it, they cost gpt2 half the gain end to end)
    colsum, bias = 0.0, 0.0
    if LN_FOLD:
        colsum = tl.load(fold_ptr + rn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    y = (_row_dot(w, xf, k_mask, colsum, mean, rstd, LN_FOLD, PAD_FOLD) + bias).to(y_ptr.dtype.element_ty)
    if STORE:
        tl.store(y_ptr + rn, y, mask=n_mask)
    return y.to(tl.float32)


@triton.jit
def _vocab_fma_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, fold_ptr, key_ptr,
    N, ln_eps, stride_xk, stride_wn,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, LN_FOLD: tl.constexpr, ARGMAX: tl.constexpr, USE_PDL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STORE_Y: tl.constexpr, PAD_FOLD: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_N  # programs take column blocks in turn
    cols = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_mask = rk < K
    w_rows = w_ptr + rk[None, :]  # (1, BLOCK_K): out-major, stride_wk == 1

    rn = pid * BLOCK_N + cols  # the launcher makes no more programs than blocks
    w = tl.load(w_rows + rn[:, None] * stride_wn, mask=(rn < N)[:, None] & k_mask[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x is written by now
        tl.extra.cuda.gdc_launch_dependents()
    xf = tl.load(x_ptr + rk * stride_xk, mask=k_mask, other=0.0).to(tl.float32)  # (BLOCK_K,)
    mean, rstd = 0.0, 0.0
    if LN_FOLD:
        mean, rstd = _mean_rstd(*_row_sums(xf, k_mask, PAD_FOLD), K, ln_eps)
    # per lane the first maximum over the program's blocks (columns rise block by block); the
    # first block's columns stand for lanes whose values are all -inf
    best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    best_col = rn
    for n0 in range(pid * BLOCK_N, N, step):
        rn = n0 + cols
        n_mask = rn < N
        rn_next = rn + step  # requested before this block is reduced: two blocks in flight
        w_next = tl.load(w_rows + rn_next[:, None] * stride_wn, mask=(rn_next < N)[:, None] & k_mask[None, :],
                         other=0.0)
        y = _block_logits(w, xf, k_mask, rn, n_mask, bias_ptr, fold_ptr, mean, rstd, y_ptr, HAS_BIAS, LN_FOLD, STORE_Y,
                          PAD_FOLD)
        if ARGMAX:
            v = tl.where(n_mask, y, float("-inf"))
            better = v > best  # NaN never wins: a NaN row is told by its input (below)
            best = tl.where(better, v, best)
            best_col = tl.where(better, rn, best_col)
        w = w_next
    if ARGMAX:
        vmax = tl.max(best, axis=0)
        col = tl.min(tl.where(best == vmax, best_col, N), axis=0)  # the lowest column among ties
        # NaN or inf in x leaves no logit finite: the row names no token. Free, from the layernorm's
        # statistics; a per-logit test cost 0.9% at gpt2 batch 1 (H100). The loader refuses
        # weights that are not finite, so a NaN weight or bias is not looked for here (nor NaN
        # input without a folded layernorm: the model's lm_head always has one)
        not_finite = (mean * 0.0 != 0.0) | (rstd * 0.0 != 0.0)  # v * 0 is NaN for a NaN or inf v
        vmax, col = _no_token_if_nan(vmax, col, not_finite, N)
        tl.atomic_max(key_ptr, _argmax_key(vmax, col), sem="relaxed")


def resident_per_sm(regs, warps, per_sm):
    """How many programs of `warps` warps and `regs` registers a thread an SM holds at once, at
    most per_sm: as many as its registers hold (_tuning.programs_by_registers), and at most 32
    programs (every GPU since Volta). The programs loop over the blocks, so any count is
    correct; more than fit would leave the last ones a second, thin wave."""
    return max(1, min(per_sm, 32, programs_by_registers(regs, warps)))


_RESIDENT = {}  # (kernel, device, the launch's constexprs and dtypes) -> resident_per_sm of its compiled kernel


def fitted_programs(kernel, programs, per_sm, device, key, args, meta):
    """programs, cut on a GPU to those the SMs hold at once by the compiled kernel's registers
    (resident_per_sm, found once per `key`: what picks the compiled kernel besides `meta`, such as
    the dtypes and the ints Triton specializes). The persistent heads loop over their blocks, so
    any count is correct."""
    if device.type != "cuda" or compiling_ahead():  # (a dry pass: any grid compiles the same kernel)
        return programs
    key = (kernel, device, *key, *sorted(meta.items()))  # the object: trace_decode's copies share the names
    if key not in _RESIDENT:
        compiled = kernel.warmup(*args, grid=(1,), enable_fp_fusion=FP_FUSION, **meta)
        _ = compiled.run  # loads the module, which sets n_regs
        _RESIDENT[key] = resident_per_sm(compiled.n_regs, meta["num_warps"], per_sm)
    return min(programs, sm_count(device) * _RESIDENT[key])


def vocab_fma(x2, weight, bias, y2, ln_fold, ln_eps, argmax_keys, config, store=True):
    """Launch for the row x2 (1, K) already checked by `linear`, with vocab_config's `config`;
    writes y2 (1, N) (unless not store) and max-es the row's argmax key into argmax_keys (1,) if
    given. On a GPU the programs are cut to those that fit the SMs at once by the compiled
    kernel's registers (Triton 3.6 takes 80 a thread for the default layout, 3.9 takes 95: 21 an
    SM, not 24)."""
    K, N = weight.shape
    meta = dict(config)
    programs, per_sm = meta.pop("programs"), meta.pop("per_sm")
    pdl = use_pdl(x2.device)
    args = (x2, weight, bias if bias is not None else y2, y2, ln_fold if ln_fold is not None else y2,
            argmax_keys if argmax_keys is not None else y2, N, ln_eps, x2.stride(1), weight.stride(1))
    meta.update(K=K, HAS_BIAS=bias is not None, LN_FOLD=ln_fold is not None, ARGMAX=argmax_keys is not None,
                USE_PDL=pdl, STORE_Y=store, PAD_FOLD=pad_fold(K, meta["BLOCK_K"], meta["num_warps"]), num_stages=1,
                launch_pdl=pdl)
    key = (x2.dtype, weight.dtype, y2.dtype, N % 16, x2.stride(1), weight.stride(1) % 16)
    programs = fitted_programs(_vocab_fma_kernel, programs, per_sm, x2.device, key, args, meta)
    launch(_vocab_fma_kernel, (programs,), *args, **meta)
    return y2
