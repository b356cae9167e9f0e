"""Decode-time linear for one row on CUDA cores: y = act(x @ W + bias) + residual with an
optional folded layernorm (linear's ln_fold), one launch, no split-K and no merge.

At one row the tensor-core GEMV (gemv.py) spends more time on latency than on bytes: its
K-chunks meet in a merge (partials stored, an arrival counter, the partials read back) after
the products. Here a program owns BLOCK_N output columns over the whole of K and reduces over K
itself:
- BLOCK_N is 4 up to K = 1024, so N / 4 programs cover the GPU even for a 768-wide output;
  wider slabs fill MAX_TILE (layout). A program's weights (BLOCK_N x K, at most 16K elements)
  sit in registers. The weight must be stored out-major (stride_wk == 1: each output's K
  weights contiguous, nn.Linear's layout), or a program would read 8-byte pieces of K rows.
  The weights, the folded layernorm's column sums, the bias (and a residual the caller vouches
  for) are requested before the programmatic-dependent-launch wait, so they stream in behind
  the previous kernel;
- after the wait: the row of x, multiply-adds in fp32 and one reduction over K, beside them the
  row's statistics for a folded layernorm (every program holds the whole row anyway; no
  partial statistics in or out), the epilogue;
- with EMBED (linear.embedding_linear: a decode step's first linear) x is not read but
  gathered after the wait, wte[id] + wpe[pos] rounded as the embedding kernel rounds it; the
  first column block's programs store it (and the lengths) for the kernels after;
- products and sums are plain fp32 on CUDA cores: free at one row, which is where `linear`
  sends it (fma_config; tests and benchmarks may force more rows, one per program). A row's
  arithmetic depends on (N, K) only, not on M; it is not the tensor-core GEMV's arithmetic, so
  the same row among 2 to 64 rows may differ in the last bits.
"""
import os

import triton
import triton.language as tl

from ._epilogue import _mean_rstd, new_row_stats
from ._l2_ahead import _ask_l2_ranges, launch_args as l2_launch_args
from ._pdl import _gdc_wait_after, _in_f32
from ._tuning import INTERPRET, env_int, launch, layout_switch, mask_switch, use_pdl
from .activations import _apply_activation
from .embedding import _embedded_row

# the most rows routed here: one (a prompt alone). Two gained per kernel but not end to end
# (bench/results/h200/fma-gemv-experiment.md). MINILLM_FMA_ROWS=0 turns the path off (A/B timing)
MAX_ROWS = env_int("MINILLM_FMA_ROWS", 1, minimum=0)
BLOCK_N = 4  # output columns per one-warp program (K up to 1024; layout() past it)
INTERPRET_BLOCK_N = 32  # the interpreter runs every program in Python: fewer, wider ones
MAX_TILE = 16384  # weights held per program (BLOCK_N x next_power_of_2(K) elements)
# elements: gpt2's layers (at most 2.36M) gained first (bench/results/h200/fma-gemv-experiment.md);
# gpt2-medium's and gpt2-xl's (3.1M to 10.2M) once their weights stayed fp16 until after the wait
# (early_f32) and the L2 requests before them were capped (minillm.decode_plan.L2_WIDE_CAP). H200,
# batch 1, the same ids (bench/results/h200/session-93/): gpt2-xl 757 -> 835 tok/s (+10.4%; with
# fp32 weights early 763, with uncapped requests 697), gpt2-medium 2,331 -> 3,071 (+31.7%).
# MINILLM_FMA_MAX_WEIGHT=n routes layers of up to n elements here (A/B timing)
MAX_WEIGHT = env_int("MINILLM_FMA_MAX_WEIGHT", 11_000_000, minimum=0)
# elements of gpt2's largest layers (2.36M), the rules below were timed on
GPT2_MAX_WEIGHT = 2_400_000
# past GPT2_MAX_WEIGHT, the largest part of a tile past K (padded to a power of two) routed here:
# padded lanes hold registers, so fewer programs (and fewer of a layer's bytes) are resident at
# once. gpt2-large's K = 1280 and 5120 (37.5% padded) lost 3.3%, gpt2-xl's (22%) gained (session
# 93). Tiles of exactly K in up to three power-of-two pieces lost at every width (gpt2-xl -16%,
# gpt2-large -2.7%, gpt2-medium -0.9%; k-pieces-experiment.patch there)
MAX_PAD = 0.25
VOCAB_N = 16384  # output width from which a layer is a vocabulary head (gemv_config.decode_config has its layouts)
# the padded lanes' terms as -0.0 where the compiler can drop them (pad_fold); MINILLM_FMA_PAD_FOLD=0
# keeps them as products of zeros (A/B timing)
PAD_FOLD = os.environ.get("MINILLM_FMA_PAD_FOLD", "1") != "0"
# the roles whose weights are converted to fp32 before the wait (early_f32's mask: 1 qkv, 2 fc,
# 4 mlp-out and attn-out). gpt2 batch 1, H200, alternated twice, the same ids
# (bench/results/h200/session-76/): mlp-out 7,897 / 7,913 -> 7,955 / 7,947 tok/s (+0.6%), in a
# second call 7,833 / 7,899 -> 7,933 / 7,938 (+0.9%); fc +0.3%, qkv -2.5%, fc and mlp-out together
# -5.6%, all three -3.7%. MINILLM_FMA_EARLY_F32=mask takes another mask (A/B timing)
EARLY_F32_ROLES = 4
FORCED_EARLY_F32 = mask_switch("MINILLM_FMA_EARLY_F32", os.environ.get("MINILLM_FMA_EARLY_F32"),
                               "1 qkv + 2 fc + 4 mlp-out and attn-out")


def by_block_k(name, fields, example, pow2=3):
    """A switch of tiles joined by + or , (A/B timing), each `fields` with BLOCK_K first:
    {BLOCK_K: the other fields}."""
    texts = os.environ.get(name, "").replace("+", ",").split(",")
    tiles = (layout_switch(name, t, fields, example, pow2) for t in texts)
    return {v[0]: v[1:] for v in tiles if v}


# MINILLM_FMA_LAYOUT=BLOCK_KxBLOCK_NxWARPS[+...] forces those tiles where BLOCK_K is K's (A/B timing)
FORCED_LAYOUTS = by_block_k("MINILLM_FMA_LAYOUT", "BLOCK_KxBLOCK_NxWARPS", "2048x2x4")
# MINILLM_FMA_MAXNREG=BLOCK_KxREGS[+...] caps a thread's registers where BLOCK_K is K's (A/B timing):
# at 4 warps a program of 72 registers leaves 7 resident an SM, of 64 8, of 48 10 (gpt2-xl's qkv
# has 1,200 programs on 132 SMs). It lost at gpt2-xl batch 1 (H200, session 95, 4 x 4 tiles, alternated
# twice): 2048x64 -1.6%, 2048x56 -5.3%, 2048x64+8192x48 -11.3%; gemv_config.split_maxnreg, the same
# lever on the split tensor-core tiles, gained
FORCED_MAXNREG = {k: regs for k, (regs,) in by_block_k("MINILLM_FMA_MAXNREG", "BLOCK_KxREGS", "2048x64", 1).items()}


def layout(K):
    """The launch layout for a K-wide layer: one row and BLOCK_N columns per program, all of K
    in one tile (benchmarks and tests force it where fma_config would not route). Up to 1024
    columns of K one warp holds the slab (128 fp16 a thread) and every reduction (layernorm
    statistics, the dot) stays inside the warp, with no shared-memory round trip: gpt2's fc
    3.52 -> 2.71 us, qkv 2.74 -> 2.36, attn-out even (H200, bench/results/h200/fma-warps.md);
    wider slabs spread over 4 warps (mlp-out: 2.52 against 3.58 us with one), and past 4096 two
    columns over 8 warps (gpt2-xl's mlp-out). gpt2-xl batch 1 (H200, session 93, one round):
    834 tok/s as here; its mlp-out on 1 column x 4 warps 812, 2 x 4 816, 1 x 2 793; its qkv and
    fc on 2 x 2 810, 8 x 8 771, and on one warp, whose programs have no barriers after the wait,
    1 column 747, 2 columns 817 (session 94). Past one warp a program holds MAX_TILE elements:
    gpt2-xl's qkv and fc on 8 columns x 4 warps (600 and 800 programs of 127 registers) against
    4 x 4: 838 -> 841 tok/s, then 837 / 837 -> 839 / 840 alternated twice (+0.3%; the A/A +0.1%).
    In the profile qkv took 0.7 us less a layer and the two launches after it 0.4 more each, the
    step even, and the benchmark too: 836 tok/s either way (session 95). There, too, 4 x 8 lost
    4.8%, mlp-out on 4 x 8 1.0% and 1 x 8 2.4%; qkv and fc capped at 64 registers (8 programs an
    SM where 72 leave 7) lost 1.6%, at 56 5.3% (MINILLM_FMA_MAXNREG)."""
    block_k = triton.next_power_of_2(K)
    warps = 1 if K <= 1024 else 4 if block_k <= 4096 else 8
    # past 1024 as many columns as MAX_TILE holds: 8 to 2048, past 4096 fewer (the slab stays in registers)
    block_n = BLOCK_N if warps == 1 else max(1, MAX_TILE // block_k)
    block_n, warps = FORCED_LAYOUTS.get(block_k, (block_n, warps))
    cap = {} if INTERPRET or block_k not in FORCED_MAXNREG else {"maxnreg": FORCED_MAXNREG[block_k]}
    return dict(ROWS=1, BLOCK_N=INTERPRET_BLOCK_N if INTERPRET else block_n, BLOCK_K=block_k, num_warps=warps, **cap)


def early_f32(N, K, activation):
    """Whether a (K -> N) layer's program converts its weights to fp32 before the wait, by role
    (EARLY_F32_ROLES' mask: 1 widening layers without activation (qkv), 2 widening layers with
    one (fc), 4 the others (mlp-out, attn-out)). ptxas otherwise converts them after it, beside
    the products: at gpt2 batch 1 96 to 128 of a program's 390 to 490 instructions after the
    wait (Triton 3.6, scripts/inspect_sass.py). Before it they hold twice the registers (126
    against 78 at mlp-out) and run beside the kernel before; where that is a loss is timed, not
    derived: the roles did not add up (fc and mlp-out each gained alone, and lost together), and
    qkv's early conversions held back the attention launch's start by 0.26 us (traced). Wider
    layers (past GPT2_MAX_WEIGHT) keep fp16: gpt2-xl batch 1 763 -> 835 tok/s without them."""
    role = 4 if N <= K else (2 if activation else 1)
    if FORCED_EARLY_F32 is not None:
        return bool(FORCED_EARLY_F32 & role)
    return N * K <= GPT2_MAX_WEIGHT and bool(EARLY_F32_ROLES & role)


def fma_config(M, N, K, stride_wk):
    """Launch parameters for M rows of a (K -> N) layer, or None where the tensor-core GEMV is
    the faster one (H200 timings: bench/results/h200/fma-gemv-experiment.md): past MAX_ROWS
    rows, weights not out-major (stride_wk != 1: a program would read 8-byte pieces of many
    rows), a weight column too wide for registers, a large layer's tile padded past MAX_PAD, a
    weight past MAX_WEIGHT, or a vocabulary head (tensor-core column blocks fill the GPU there,
    no merge)."""
    block_k = triton.next_power_of_2(K)
    padded = block_k - K > MAX_PAD * block_k and N * K > GPT2_MAX_WEIGHT
    if M > MAX_ROWS or stride_wk != 1 or block_k > MAX_TILE or padded or N * K > MAX_WEIGHT or N >= VOCAB_N:
        return None
    return layout(K)


def pad_fold(K, block_k, warps):
    """Whether a kernel over a (.., block_k) tile of K columns adds -0.0 for the lanes past K
    (PAD_FOLD). x + -0.0 is x exactly (x + 0.0 is not, at x = -0.0), so where a lane's padding is
    known when compiling the compiler drops those adds and the products beside them: where the
    padding is whole repeats of the warps' 16-byte loads along K (256 columns a warp), as at
    gpt2's K = 768 and 3072, a quarter of the products after the wait (Triton 3.6's SASS:
    164 -> 124 FFMAs at qkv; after the wait qkv 515 -> 467 instructions, fc 491 -> 443, mlp-out
    288 -> 256, the vocabulary heads 390 -> 366 and 1,618 -> 1,570). gpt2 batch 1, H200,
    alternated twice, the same ids (bench/results/h200/session-95/call5-*): 8,489 / 8,470 ->
    8,629 / 8,618 tok/s (+1.7%). Elsewhere (gpt2-xl's K = 1600) the select would cost an
    instruction a term; those keep the plain products. Only zeros' signs can differ."""
    return PAD_FOLD and K < block_k and K % (256 * warps) == 0


@triton.jit
def _unpadded(v, k_mask, PAD_FOLD: tl.constexpr):
    """v, with -0.0 past K where PAD_FOLD (pad_fold): terms a sum drops when compiled."""
    if PAD_FOLD:
        v = tl.where(k_mask, v, -0.0)
    return v


@triton.jit
def _row_sums(xf, k_mask, PAD_FOLD: tl.constexpr):
    """A row's sum and sum of squares (fp32; x zero past K) for its layernorm statistics."""
    return tl.sum(_unpadded(xf, k_mask, PAD_FOLD), axis=0), tl.sum(_unpadded(xf * xf, k_mask, PAD_FOLD), axis=0)


@triton.jit
def _row_dot(w, xf, k_mask, colsum, mean, rstd, LN_FOLD: tl.constexpr, PAD_FOLD: tl.constexpr):
    """x . w for each of w's rows (out-major columns, (BLOCK_N, BLOCK_K)) with x in fp32
    (BLOCK_K,), zero past K; a folded layernorm applied as _fold_ln: rstd * (acc - mean * colsum).
    fp16 x fp16 products are exact in fp32; one reduction over K per output."""
    acc = tl.sum(_unpadded(w.to(tl.float32) * xf[None, :], k_mask[None, :], PAD_FOLD), axis=1)  # (BLOCK_N,)
    if LN_FOLD:
        acc = tl.fma(-mean, colsum, acc) * rstd
    return acc


# M is not specialized: at M = 1 Triton would compile a second kernel whose fp32 contractions
# may differ, and a row must get the same bits at any M
@triton.jit(do_not_specialize=["M"])
def _gemv_fma_kernel(
    x_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, fold_ptr,
    M, N, ln_eps, negative_slope,
    stride_xm, stride_xk, stride_wk, stride_wn, stride_rm, stride_ym,
    l2a_ptr, l2a_bytes, l2b_ptr, l2b_bytes,
    ids_ptr, pos_ptr, wte_ptr, wpe_ptr, lens_ptr, n_vocab, n_pos, stride_te, stride_pe,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    LN_FOLD: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EARLY_LAUNCH: tl.constexpr, EARLY_F32: tl.constexpr,
    L2_AHEAD: tl.constexpr, L2_SLOTS: tl.constexpr, L2_PIECE: tl.constexpr, EMBED: tl.constexpr,
    PAD_FOLD: tl.constexpr,
):
    if USE_PDL and EARLY_LAUNCH:  # the next kernel may launch now: its prefetch overlaps all of this one
        tl.extra.cuda.gdc_launch_dependents()
    # rows fastest: the programs that share a weight slab run side by side (L2 hits)
    pid = tl.program_id(0)
    row = pid % M
    rn = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    k_mask = rk < K

    # everything that does not come from the previous kernel, before waiting on it. Every
    # vector is a slice of the weight tile's layout, so nothing changes layout after the wait
    # (a (rows, columns, K) product made Triton move the whole slab through shared memory there)
    w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :] * stride_wk,
                mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # (BLOCK_N, BLOCK_K)
    colsum = 0.0
    if LN_FOLD:
        colsum = tl.load(fold_ptr + rn, mask=n_mask, other=0.0)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    res_ptrs = res_ptr + row * stride_rm + rn
    res = 0.0
    if HAS_RESIDUAL and PREFETCH_RESIDUAL:
        res = tl.load(res_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    if L2_AHEAD:  # after this program's own loads, which should not queue behind these
        _ask_l2_ranges(l2a_ptr, l2a_bytes, l2b_ptr, l2b_bytes, pid, tl.num_programs(0), L2_SLOTS, L2_PIECE)
    if USE_PDL:
        if EARLY_F32:  # the weights in fp32 before the wait (early_f32)
            w, chk = _in_f32(w, 0.0)
            _gdc_wait_after(chk)  # x (and a late residual) are written by now
        else:
            tl.extra.cuda.gdc_wait()  # x (and a late residual) are written by now
        if not EARLY_LAUNCH:
            tl.extra.cuda.gdc_launch_dependents()

    x_ptrs = x_ptr + row * stride_xm + rk * stride_xk
    if EMBED:  # x is the row's embedding (embedding_linear): gathered here, kept by column block 0
        e, pos = _embedded_row(ids_ptr, pos_ptr, wte_ptr, wpe_ptr, row, rk, k_mask, n_vocab, n_pos, stride_te,
                               stride_pe)
        x = e.to(x_ptr.dtype.element_ty)
        if pid < M:  # every program gathers the same bits; one a row stores them
            tl.store(x_ptrs, x, mask=k_mask)
            tl.store(lens_ptr + row, (pos + 1).to(lens_ptr.dtype.element_ty))
        xf = x.to(tl.float32)  # (BLOCK_K,)
    else:
        xf = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)  # (BLOCK_K,)
    if HAS_RESIDUAL and not PREFETCH_RESIDUAL:  # beside x: one round trip for both
        res = tl.load(res_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    mean, rstd = 0.0, 0.0
    if LN_FOLD:
        mean, rstd = _mean_rstd(*_row_sums(xf, k_mask, PAD_FOLD), K, ln_eps)
    acc = _row_dot(w, xf, k_mask, colsum, mean, rstd, LN_FOLD, PAD_FOLD)
    y = _apply_activation(acc + bias, negative_slope, ACTIVATION) + res  # as _epilogue
    tl.store(y_ptr + row * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def decode_row_stats(rows, cols, device):
    """The partial-statistics buffer a decode step of `rows` rows and width `cols` passes from
    the linears that write its residual stream to the layernorms that read it, or None where
    those linears (attn-out cols -> cols, mlp-out 4 cols -> cols) run here: this kernel writes
    no statistics, and reads whole rows instead."""
    if fma_config(rows, cols, cols, 1) and fma_config(rows, cols, 4 * cols, 1):
        return None
    return new_row_stats(rows, cols, device)


def gemv_fma(x2, weight, bias, residual, y2, ln_fold, ln_eps, activation, negative_slope,
             prefetch_residual, config, early_launch=False, l2_ahead_ranges=None, embed=None):
    """Launch for rows x2 (M, K) already checked by `linear`, with `config`: fma_config's layout
    (or one like it: tests, benchmarks); writes y2 (M, N). early_launch, l2_ahead: see `linear`
    (l2_ahead_ranges: _l2_ahead.l2_ranges' list of its l2_ahead). An EARLY_F32 in `config`
    stands in for early_f32's choice (tests, benchmarks). embed: (ids, pos, wte, wpe, lens_out),
    checked by linear.embedding_linear: x2's rows are gathered from the tables and written, not
    read, and lens_out gets pos + 1."""
    M, K = x2.shape
    N = weight.shape[1]
    meta = dict(config)
    early = meta.pop("EARLY_F32", None)
    if meta.pop("ROWS") != 1:
        raise ValueError(f"_config: the CUDA-core layout runs one row per program, got ROWS={config['ROWS']}")
    grid = (M * triton.cdiv(N, meta["BLOCK_N"]),)
    pdl = use_pdl(x2.device)
    r2 = residual if residual is not None else y2
    l2_args, l2_meta = l2_launch_args(l2_ahead_ranges, y2, x2.device, meta["num_warps"])
    ids, pos, wte, wpe, lens = embed if embed is not None else (y2, y2, y2, y2, y2)
    launch(
        _gemv_fma_kernel, grid, x2, weight, bias if bias is not None else y2, r2, y2,
        ln_fold if ln_fold is not None else y2,
        M, N, ln_eps, negative_slope,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), r2.stride(0), y2.stride(0),
        *l2_args,
        ids, pos, wte, wpe, lens, wte.shape[0], wpe.shape[0], wte.stride(0), wpe.stride(0),
        K=K, HAS_BIAS=bias is not None, ACTIVATION=activation, HAS_RESIDUAL=residual is not None,
        LN_FOLD=ln_fold is not None, USE_PDL=pdl, PREFETCH_RESIDUAL=bool(prefetch_residual),
        EARLY_LAUNCH=bool(early_launch), EARLY_F32=early_f32(N, K, activation) if early is None else bool(early),
        EMBED=embed is not None, PAD_FOLD=pad_fold(K, meta["BLOCK_K"], meta["num_warps"]), launch_pdl=pdl,
        **l2_meta, **meta,
    )
    return y2
