"""Decode-time MLP for one row on CUDA cores, in one launch:
x + proj(act(layernorm(x) @ W_fc + b_fc)) + b_proj, the layernorm folded into fc (linear's ln_fold).

At one row of gpt2's size each decode kernel costs about 2 us of latency (the launch, the
dependent-launch wait, an L2 round trip for its input) whatever its bytes, and fc and mlp-out
(gemv_fma.py) were two of a layer's four. Here they are one:
- a program owns BLOCK_H hidden units and one of OUT_SPLIT column ranges of the output: those
  units' fc weights (BLOCK_H x C) and their rows of the projection in its column range, all in
  registers, requested before the wait, so they stream in behind the previous kernel. The
  programs of one hidden block compute the same hidden values (their fc weights come from L2
  after the first read);
- after the wait: the row x, its statistics, the hidden values (rounded to x's dtype, as fc
  would store them), and their share of the output columns: a partial over BLOCK_H of the
  projection's K;
- the partials meet as the fused attention launch's heads do (decode_attention_proj._add_fixed):
  one returning atomic per column adds the partial in fixed point with an arrival count, and
  the program that brings a column's count to the number of hidden blocks adds bias and
  residual and stores it. Integer sums do not depend on the order: deterministic.
A row's bits are not the two linears' (other reduction orders); at one row that is the only
path, so a row's result does not depend on anything but the row.
"""
import os

import torch
import triton
import triton.language as tl

from ._checks import check_device_usable, check_shape, check_tensor
from ._epilogue import _mean_rstd
from ._tuning import INTERPRET, launch, use_pdl
from ._workspace import fixed_point_sums
from .activations import ACTIVATIONS, _apply_activation
from .decode_attention_proj import MAX_FIXED_HEADS, _add_fixed
from .linear import linear

# MINILLM_FUSED_MLP=0 runs the two linears instead (A/B timing)
ENABLED = os.environ.get("MINILLM_FUSED_MLP", "1") != "0"
BLOCK_H = 64  # hidden units per program: gpt2's 3072 in 48 blocks, each column's arrivals <= 63
INTERPRET_BLOCK_H = 16
OUT_SPLIT = 2  # column ranges of the output per hidden block
# weights one program holds in registers (elements): BLOCK_H x (C + C / OUT_SPLIT) as tiled below.
# gpt2's 73,728 take 144 registers a thread at 8 warps
MAX_TILE = 73_728
NUM_WARPS = 8


def _halves(n):
    """A width n as two power-of-two tiles (head, tail), head < n <= head + tail, tail <= head:
    768 -> (512, 256), 384 -> (256, 128), 1024 -> (512, 512): little padding, no width-0 tile."""
    head = max(16, triton.next_power_of_2(n) // 2)
    return head, max(16, triton.next_power_of_2(max(n - head, 1)))


def mlp_config(M, C, hidden, fc_weight, proj_weight):
    """The fused launch's layout for M rows of a (C -> hidden -> C) MLP, or None where the two
    linears run: more than one row, weights not out-major (each output's K weights contiguous,
    as gemv_fma needs), more hidden blocks than a fixed-point word counts, or more weights a
    program than fit in registers."""
    if not ENABLED or M != 1 or C < 32 or fc_weight.stride(0) != 1 or proj_weight.stride(0) != 1:
        return None
    block_h = INTERPRET_BLOCK_H if INTERPRET else BLOCK_H
    if triton.cdiv(hidden, block_h) > MAX_FIXED_HEADS:
        return None
    out_w = triton.cdiv(C, OUT_SPLIT)
    (k_head, k_tail), (n_head, n_tail) = _halves(C), _halves(out_w)
    if not INTERPRET and block_h * (k_head + k_tail + n_head + n_tail) > MAX_TILE:
        return None
    return dict(BLOCK_H=block_h, OUT_W=out_w, K_HEAD=k_head, K_TAIL=k_tail, N_HEAD=n_head, N_TAIL=n_tail,
                num_warps=NUM_WARPS)


@triton.jit
def _fc_tile(w_ptr, rh, h_mask, rk, C, stride_fn):
    """fc's out-major weights (BLOCK_H, width): hidden unit j's C weights at j * stride_fn."""
    return tl.load(w_ptr + rh[:, None] * stride_fn + rk[None, :], mask=h_mask[:, None] & (rk < C)[None, :],
                   other=0.0)


@triton.jit
def _proj_tile(w_ptr, rn, n_mask, rh, h_mask, stride_pn):
    """The projection's out-major weights (width, BLOCK_H): output n's hidden weights at n * stride_pn."""
    return tl.load(w_ptr + rn[:, None] * stride_pn + rh[None, :], mask=n_mask[:, None] & h_mask[None, :],
                   other=0.0)


@triton.jit
def _finish_columns(part, words_ptr, rn, n_mask, bias, res, y_ptr, PROGRAMS: tl.constexpr):
    """Adds this program's partial into its columns' words; stores the columns it completes."""
    sums, done = _add_fixed(part, words_ptr + rn, n_mask, PROGRAMS)
    tl.store(y_ptr + rn, (sums + bias + res).to(y_ptr.dtype.element_ty), mask=done)  # as linear's epilogue


@triton.jit
def _mlp_fma_kernel(
    x_ptr, fc_w_ptr, fc_b_ptr, fold_ptr, proj_w_ptr, proj_b_ptr, y_ptr, words_ptr,
    C, HIDDEN, OUT_W, ln_eps, negative_slope, stride_fn, stride_pn,
    PROGRAMS: tl.constexpr, ACTIVATION: tl.constexpr, USE_PDL: tl.constexpr, EARLY_LAUNCH: tl.constexpr,
    BLOCK_H: tl.constexpr, K_HEAD: tl.constexpr, K_TAIL: tl.constexpr, N_HEAD: tl.constexpr,
    N_TAIL: tl.constexpr,
):
    if USE_PDL and EARLY_LAUNCH:  # the next kernel may launch now: its prefetch overlaps all of this one
        tl.extra.cuda.gdc_launch_dependents()
    rh = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = rh < HIDDEN
    n0 = tl.program_id(1) * OUT_W
    n_end = tl.minimum(n0 + OUT_W, C)
    rk_head = tl.arange(0, K_HEAD)
    rk_tail = K_HEAD + tl.arange(0, K_TAIL)
    rn_head = n0 + tl.arange(0, N_HEAD)
    rn_tail = n0 + N_HEAD + tl.arange(0, N_TAIL)
    head_mask = rn_head < n_end
    tail_mask = rn_tail < n_end

    # everything that does not come from the previous kernel, before waiting on it
    wf_head = _fc_tile(fc_w_ptr, rh, h_mask, rk_head, C, stride_fn)  # (BLOCK_H, K_HEAD)
    wf_tail = _fc_tile(fc_w_ptr, rh, h_mask, rk_tail, C, stride_fn)
    wp_head = _proj_tile(proj_w_ptr, rn_head, head_mask, rh, h_mask, stride_pn)  # (N_HEAD, BLOCK_H)
    wp_tail = _proj_tile(proj_w_ptr, rn_tail, tail_mask, rh, h_mask, stride_pn)
    colsum = tl.load(fold_ptr + rh, mask=h_mask, other=0.0)
    fc_bias = tl.load(fc_b_ptr + rh, mask=h_mask, other=0.0).to(tl.float32)
    bias_head = tl.load(proj_b_ptr + rn_head, mask=head_mask, other=0.0).to(tl.float32)
    bias_tail = tl.load(proj_b_ptr + rn_tail, mask=tail_mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x is written by now
        if not EARLY_LAUNCH:
            tl.extra.cuda.gdc_launch_dependents()

    # x twice: as fc's input (across K) and as the residual of this program's columns, one round trip
    x_head = tl.load(x_ptr + rk_head, mask=rk_head < C, other=0.0).to(tl.float32)
    x_tail = tl.load(x_ptr + rk_tail, mask=rk_tail < C, other=0.0).to(tl.float32)
    res_head = tl.load(x_ptr + rn_head, mask=head_mask, other=0.0).to(tl.float32)
    res_tail = tl.load(x_ptr + rn_tail, mask=tail_mask, other=0.0).to(tl.float32)
    mean, rstd = _mean_rstd(tl.sum(x_head, axis=0) + tl.sum(x_tail, axis=0),
                            tl.sum(x_head * x_head, axis=0) + tl.sum(x_tail * x_tail, axis=0), C, ln_eps)
    acc = tl.sum(wf_head.to(tl.float32) * x_head[None, :], axis=1)
    acc += tl.sum(wf_tail.to(tl.float32) * x_tail[None, :], axis=1)  # (BLOCK_H,)
    acc = tl.fma(-mean, colsum, acc) * rstd  # the folded layernorm, as linear's
    h = _apply_activation(acc + fc_bias, negative_slope, ACTIVATION)
    h = h.to(y_ptr.dtype.element_ty).to(tl.float32)  # as fc would store it
    # each program's partial: its hidden units' share of its columns. (Not in place: the programs
    # of the other column ranges may not have read x yet when one of these columns is stored)
    _finish_columns(tl.sum(wp_head.to(tl.float32) * h[None, :], axis=1), words_ptr, rn_head, head_mask,
                    bias_head, res_head, y_ptr, PROGRAMS)
    _finish_columns(tl.sum(wp_tail.to(tl.float32) * h[None, :], axis=1), words_ptr, rn_tail, tail_mask,
                    bias_tail, res_tail, y_ptr, PROGRAMS)


def mlp(x, fc_weight, fc_bias, fc_colsum, proj_weight, proj_bias, activation=None, ln_eps=1e-5,
        negative_slope=0.01, out=None, early_launch=False, _config=None):
    """x + linear(linear(x, fc_weight, fc_bias, ln_fold=fc_colsum, activation=...), proj_weight,
    proj_bias): a decode step's MLP with its layernorm folded into fc (fold_layernorm), in one
    launch where mlp_config allows (one row; a column whose hidden blocks' partials are not
    finite or reach 2**21 comes out NaN), else in fc and mlp-out through `linear`.

    x: (M, C); fc_weight: (C, HIDDEN) and proj_weight: (HIDDEN, C), out-major for the fused
    launch; fc_bias, fc_colsum: (HIDDEN,); proj_bias: (C,). Writes (M, C) into `out`, which must
    not share memory with x (every program reads all of x while others store their columns).
    early_launch: the next kernel may launch at this one's start (linear's early_launch; the
    caller vouches that it reads nothing this one writes before its own wait); both linears get
    it where they run. _config: a layout in place of mlp_config's (tests)."""
    check_tensor("x", x, ndim=2, last_contiguous=True)
    check_device_usable("x", x)
    M, C = x.shape
    check_tensor("fc_weight", fc_weight, ndim=2, dtypes=(x.dtype,), device=x.device)
    hidden = fc_weight.shape[1]
    check_shape("fc_weight", fc_weight, (C, hidden))
    check_tensor("proj_weight", proj_weight, ndim=2, dtypes=(x.dtype,), device=x.device)
    check_shape("proj_weight", proj_weight, (hidden, C))
    for name, t, n in (("fc_bias", fc_bias, hidden), ("fc_colsum", fc_colsum, hidden), ("proj_bias", proj_bias, C)):
        check_tensor(name, t, ndim=1, device=x.device)
        check_shape(name, t, (n,))
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    y = torch.empty_like(x) if out is None else out
    check_tensor("out", y, ndim=2, dtypes=(x.dtype,), device=x.device, last_contiguous=True)
    check_shape("out", y, (M, C))
    if y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        raise ValueError("out: expected a tensor apart from x (the fused launch reads all of x while it stores)")
    config = _config or mlp_config(M, C, hidden, fc_weight, proj_weight)
    if config is None:
        h = linear(x, fc_weight, fc_bias, activation=activation, negative_slope=negative_slope, ln_fold=fc_colsum,
                   ln_eps=ln_eps, early_launch=early_launch)
        return linear(h, proj_weight, proj_bias, residual=x, out=y, prefetch_residual=not early_launch,
                      early_launch=early_launch)
    if M != 1 or fc_weight.stride(0) != 1 or proj_weight.stride(0) != 1:
        raise ValueError("_config: the fused launch takes one row and out-major weights")
    meta = dict(config)
    out_w = meta.pop("OUT_W")
    grid = (triton.cdiv(hidden, meta["BLOCK_H"]), triton.cdiv(C, out_w))
    if grid[0] > MAX_FIXED_HEADS:
        raise ValueError(f"_config: at most {MAX_FIXED_HEADS} hidden blocks, got {grid[0]}")
    pdl = use_pdl(x.device)
    launch(
        _mlp_fma_kernel, grid, x, fc_weight, fc_bias, fc_colsum, proj_weight, proj_bias, y,
        fixed_point_sums(x.device, C),
        C, hidden, out_w, ln_eps, negative_slope, fc_weight.stride(1), proj_weight.stride(1),
        PROGRAMS=grid[0], ACTIVATION=activation, USE_PDL=pdl, EARLY_LAUNCH=bool(early_launch), launch_pdl=pdl,
        **meta,
    )
    return y
