"""A transformer MLP, proj(act(layernorm?(x) @ W_fc + b_fc)) + residual, as two linear launches
whose hand-off skips a merge at decode time.

With few rows each linear is a split-K GEMV: its programs write fp32 partials, count their
arrivals, and the last one adds them up and stores the output. That merge (a fenced atomic,
then reading the partials back) is a chain of round trips to L2 at the end of every kernel:
about 2 us of a decode step per linear on an H200 (scripts/bench_floor.py). Here the first
linear stops at its partials and the second adds them as it loads its input tiles, each
program only its own slice of the hidden activations. The additions and the epilogue are the
same, in the same order, so the result is bit-identical to two separate `linear` calls.
"""
from ._checks import check_tensor
from .gemv import hands_off
from .linear import linear


def mlp(x, fc_weight, fc_bias, proj_weight, proj_bias, activation=None, residual=None, out=None,
        negative_slope=0.01, ln_weight=None, ln_bias=None, ln_eps=1e-5, ln_stats=None, stats_out=None,
        prefetch_residual=False):
    """proj(act(layernorm?(x) @ fc_weight + fc_bias)) + residual, as `linear` twice.

    x: (..., K); fc_weight: (K, H); fc_bias: (H,) or None; proj_weight: (H, N); proj_bias: (N,)
    or None. activation (and negative_slope) apply to the hidden layer; residual, out,
    stats_out and prefetch_residual to the output, ln_weight, ln_bias, ln_eps and ln_stats to
    the input, all as in `linear`.
    """
    check_tensor("x", x, min_ndim=1)
    check_tensor("fc_weight", fc_weight, ndim=2, dtypes=(x.dtype,), device=x.device)
    check_tensor("proj_weight", proj_weight, ndim=2, dtypes=(x.dtype,), device=x.device)
    K, H = fc_weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"fc_weight: expected ({x.shape[-1]}, H) to match x's last dim, got {tuple(fc_weight.shape)}")
    if proj_weight.shape[0] != H:
        raise ValueError(f"proj_weight: expected ({H}, N) to match fc_weight's {H} outputs, "
                         f"got {tuple(proj_weight.shape)}")
    N = proj_weight.shape[1]
    rows = x.numel() // K if K else 0
    fc = dict(activation=activation, negative_slope=negative_slope, ln_weight=ln_weight, ln_bias=ln_bias,
              ln_eps=ln_eps, ln_stats=ln_stats)
    proj = dict(residual=residual, out=out, stats_out=stats_out, prefetch_residual=prefetch_residual)
    if rows and hands_off(rows, K, H, N, x.element_size()):
        hidden = x.new_empty((*x.shape[:-1], H))  # the hidden layer's shape; never written
        partials = linear(x, fc_weight, fc_bias, out=hidden, _defer_out=True, **fc)
        return linear(hidden, proj_weight, proj_bias, _x_partials=partials, **proj)
    return linear(linear(x, fc_weight, fc_bias, **fc), proj_weight, proj_bias, **proj)
