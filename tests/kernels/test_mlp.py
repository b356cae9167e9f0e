"""kernels/mlp.py: the MLP as two linears, the hidden layer handed over as split-K partials at
decode rows. Values against the torch twin, bits against two separate `linear` calls."""
import pytest
import torch

import kernels
from kernels import reference as ref
from kernels.gemv import SMALL_M, hands_off
from tests.conftest import ON_GPU
from tests.kernels.helpers import assert_rel_close, poisoned, randn

K, H, N = 200, 800, 200  # K over one 128-wide chunk, so the first linear splits in fp16 too


def _weights(dtype, device, fc_bias=True):
    fw = randn(K, H, dtype=dtype, device=device, scale=K ** -0.5)
    pw = randn(H, N, dtype=dtype, device=device, scale=H ** -0.5)
    fb = randn(H, dtype=dtype, device=device) if fc_bias else None
    return fw, fb, pw, randn(N, dtype=dtype, device=device)


def _ln(dtype, device):
    return dict(ln_weight=randn(K, dtype=dtype, device=device), ln_bias=randn(K, dtype=dtype, device=device))


@pytest.mark.parametrize("M", [1, 5, 20, 70])  # hand-off, hand-off, two decode linears, prefill tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] if ON_GPU else [torch.float32])
def test_mlp_matches_reference(M, dtype, device):
    """Layernorm from partial statistics, GELU, residual added in place (read early), output
    statistics: against the torch twin in float64."""
    x = randn(M, K, dtype=dtype, device=device, scale=2.0) + 0.5
    fw, fb, pw, pb = _weights(dtype, device)
    ln = _ln(dtype, device)
    res = randn(M, N, dtype=dtype, device=device)
    expect = ref.mlp(x.double(), fw.double(), fb.double(), pw.double(), pb.double(), activation="gelu_tanh",
                     residual=res.double(), ln_weight=ln["ln_weight"].double(), ln_bias=ln["ln_bias"].double())
    stats = torch.full((M, 2, -(-N // 16)), float("nan"), device=device)
    y = kernels.mlp(x, fw, fb, pw, pb, activation="gelu_tanh", residual=res, out=res, ln_stats=ref.row_stats(x),
                    stats_out=stats, prefetch_residual=True, **ln)
    assert y.data_ptr() == res.data_ptr()
    assert_rel_close(y, expect, dtype, f"mlp M={M}")
    torch.testing.assert_close(stats.cpu(), ref.row_stats(y).cpu(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("activation,fc_bias", [("gelu_tanh", True), ("leaky_relu", False), (None, True)])
@pytest.mark.parametrize("M", [1, 16])
def test_mlp_hand_off_is_two_linears(activation, fc_bias, M, device):
    """Where the hidden layer travels as partials, the result has the bits of two `linear`
    calls (the same additions in the same order, the first linear's epilogue applied on read)."""
    dtype = torch.float16 if ON_GPU else torch.float32
    assert hands_off(M, K, H, N, torch.tensor([], dtype=dtype).element_size())  # else this proves nothing
    x = randn(M, K, dtype=dtype, device=device)
    fw, fb, pw, pb = _weights(dtype, device, fc_bias)
    fc = dict(activation=activation, negative_slope=0.2, **_ln(dtype, device))
    out = poisoned((M, N), dtype, device)
    y = kernels.mlp(x, fw, fb, pw, pb, out=out, **fc)
    assert torch.equal(y, kernels.linear(kernels.linear(x, fw, fb, **fc), pw, pb))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] if ON_GPU else [torch.float32])
def test_mlp_same_rows_at_any_batch(dtype, device):
    """A row's result does not depend on the batch: the hand-off at few rows and two looping
    linears at 64 rows give it the same bits."""
    x = randn(SMALL_M, K, dtype=dtype, device=device)
    fw, fb, pw, pb = _weights(dtype, device)
    kw = dict(activation="gelu_tanh", **_ln(dtype, device))
    full = kernels.mlp(x, fw, fb, pw, pb, **kw)
    for m in (1, 3):
        assert torch.equal(kernels.mlp(x[:m], fw, fb, pw, pb, **kw), full[:m])


def test_mlp_errors(device):
    x = randn(2, K, device=device)
    fw, fb, pw, pb = _weights(torch.float32, device)
    with pytest.raises(ValueError, match=r"fc_weight: expected \(200, H\)"):
        kernels.mlp(x, fw[:10], fb, pw, pb)
    with pytest.raises(ValueError, match=r"proj_weight: expected \(800, N\)"):
        kernels.mlp(x, fw, fb, pw[:10], pb)
    with pytest.raises(ValueError, match="proj_weight: expected dtype"):
        kernels.mlp(x, fw, fb, pw.half(), pb)
    with pytest.raises(ValueError, match="_defer_out/_x_partials: decode rows only"):
        kernels.linear(randn(70, K, device=device), fw, fb, _defer_out=True)
    with pytest.raises(ValueError, match="defer_out: needs a split layout and no residual"):
        kernels.linear(x, fw, fb, residual=randn(2, H, device=device), _defer_out=True)
    partials = kernels.linear(x, fw, fb, _defer_out=True)
    with pytest.raises(ValueError, match="x_partials: needs a split layout of one-tile chunks and no layernorm"):
        kernels.linear(x.new_empty(2, H), pw, pb, ln_weight=pb.new_ones(H), ln_bias=pb.new_zeros(H),
                       _x_partials=partials)
