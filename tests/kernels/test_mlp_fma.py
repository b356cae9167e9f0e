"""The one-launch decode MLP (kernels/mlp_fma.py): against the unfolded float64 math and the
two linears, awkward widths, the column ranges and hidden blocks it splits into, NaN, the
fixed-point words it leaves zero, when it runs and when the two linears do, bad arguments."""
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import mlp_fma
from kernels import reference as ref
from kernels._workspace import fixed_point_sums
from tests.kernels.helpers import DTYPES, assert_rel_close, poisoned, randn


def _out_major(w):
    return w.t().contiguous().t()


def _weights(C, hidden, dtype, device):
    """A gpt2-like MLP: ln_2 folded into fc (out-major), the projection out-major."""
    g, b = 1.0 + 0.2 * randn(C, dtype=dtype, device=device), randn(C, dtype=dtype, device=device, scale=0.2)
    fc = randn(C, hidden, dtype=dtype, device=device, scale=C ** -0.5)
    fc_b = randn(hidden, dtype=dtype, device=device, scale=0.5)
    wf, bf, colsum = kernels.fold_layernorm(fc, fc_b, g, b)
    proj = _out_major(randn(hidden, C, dtype=dtype, device=device, scale=hidden ** -0.5))
    proj_b = randn(C, dtype=dtype, device=device, scale=0.5)
    return dict(fc=(_out_major(wf), bf, colsum), proj=(proj, proj_b), raw=(fc, fc_b, g, b))


def _exact(x, w, activation="gelu_tanh"):
    """x + proj(act(layer_norm(x) @ fc + b)) + b in float64, unfolded."""
    fc, fc_b, g, b = (t.double() for t in w["raw"])
    xd = x.double()
    h = ref.apply_activation(F.layer_norm(xd, (x.shape[-1],), g, b, 1e-5) @ fc + fc_b, activation)
    proj, proj_b = (t.double() for t in w["proj"])
    return xd + h @ proj + proj_b


def _config(C, hidden, block_h):
    cfg = mlp_fma.mlp_config(1, C, hidden, torch.empty(1, 1).t(), torch.empty(1, 1).t())
    assert cfg is not None
    return {**cfg, "BLOCK_H": block_h}


# C off a power of two (both tiles masked), hidden off the block, one hidden block, 63 blocks
SHAPES = [(96, 384, 16), (80, 200, 16), (64, 48, 64), (40, 1000, 16)]


@pytest.mark.parametrize("C,hidden,block_h", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mlp_matches_unfolded_math(C, hidden, block_h, dtype, device):
    w = _weights(C, hidden, dtype, device)
    x = randn(1, C, dtype=dtype, device=device, scale=3.0) + 1.5  # a mean to take out
    out = poisoned((1, C), dtype, device)
    y = kernels.mlp(x, *w["fc"], *w["proj"], activation="gelu_tanh", out=out, _config=_config(C, hidden, block_h))
    assert y is out
    assert_rel_close(out, _exact(x, w), dtype, f"mlp C={C} hidden={hidden}")
    # the words are left zero for the next launch (and the fused attention launch, which shares them)
    assert not fixed_point_sums(torch.device(device), C)[:C].any()


@pytest.mark.parametrize("activation", [None, "relu", "leaky_relu", "gelu"])
def test_mlp_activations_against_two_linears(activation, device):
    C, hidden = 72, 288
    w = _weights(C, hidden, torch.float32, device)
    x = randn(1, C, device=device)
    y = kernels.mlp(x, *w["fc"], *w["proj"], activation=activation, negative_slope=0.1,
                    _config=_config(C, hidden, 16))
    expect = ref.mlp(x.double(), *(t.double() for t in w["fc"]), *(t.double() for t in w["proj"]),
                     activation=activation, negative_slope=0.1)
    assert_rel_close(y, expect, torch.float32, f"mlp {activation}")


def test_mlp_hidden_rounded_as_fc_stores_it(device):
    """fp16: the hidden values are rounded to fp16 before the projection, as the two linears do."""
    C, hidden = 64, 256
    w = _weights(C, hidden, torch.float16, device)
    x = randn(1, C, dtype=torch.float16, device=device, scale=2.0)
    y = kernels.mlp(x, *w["fc"], *w["proj"], activation="gelu_tanh", _config=_config(C, hidden, 16))
    two = ref.mlp(x, *w["fc"], *w["proj"], activation="gelu_tanh")
    # both round the hidden values and the output to fp16; what is left is fp32 summation order
    assert (y.float() - two.float()).abs().max() <= 2 * torch.finfo(torch.float16).eps * two.float().abs().max()


def test_mlp_deterministic(device):
    C, hidden = 96, 384
    w = _weights(C, hidden, torch.float32, device)
    x = randn(1, C, device=device)
    cfg = _config(C, hidden, 16)
    first = kernels.mlp(x, *w["fc"], *w["proj"], activation="gelu_tanh", _config=cfg)
    for _ in range(2):
        assert torch.equal(kernels.mlp(x, *w["fc"], *w["proj"], activation="gelu_tanh", _config=cfg), first)


def test_mlp_nan_row_stays_nan(device):
    C, hidden = 64, 128
    w = _weights(C, hidden, torch.float32, device)
    x = randn(1, C, device=device)
    x[0, 5] = float("nan")
    y = kernels.mlp(x, *w["fc"], *w["proj"], activation="gelu_tanh", _config=_config(C, hidden, 16))
    assert torch.isnan(y).all()
    assert not fixed_point_sums(torch.device(device), C)[:C].any()
    x[0, 5] = 1.0  # the words were left clean: the next launch is right
    y = kernels.mlp(x, *w["fc"], *w["proj"], activation="gelu_tanh", _config=_config(C, hidden, 16))
    assert_rel_close(y, _exact(x, w), torch.float32, "mlp after a NaN row")


def test_mlp_routes(device):
    """The fused launch at one row of out-major weights and at most 63 hidden blocks; the two
    linears elsewhere, with the same result."""
    C, hidden = 96, 384
    w = _weights(C, hidden, torch.float32, device)
    fc_w, proj_w = w["fc"][0], w["proj"][0]
    assert mlp_fma.mlp_config(1, C, hidden, fc_w, proj_w) is not None
    assert mlp_fma.mlp_config(2, C, hidden, fc_w, proj_w) is None
    assert mlp_fma.mlp_config(1, C, hidden, fc_w.contiguous(), proj_w) is None  # (C, hidden) row-major
    assert mlp_fma.mlp_config(1, C, 64 * mlp_fma.INTERPRET_BLOCK_H, fc_w, proj_w) is None  # 64 blocks
    x = randn(2, C, device=device)
    y = kernels.mlp(x, *w["fc"], *w["proj"], activation="gelu_tanh")  # two rows: the two linears
    assert_rel_close(y, _exact(x, w), torch.float32, "mlp at two rows")


def test_mlp_gpt2_layout():
    """gpt2's widths: 48 hidden blocks of 64, two column ranges of 384 (512 + 256 and 256 + 128
    wide tiles), within the register budget."""
    w = torch.empty(1, 1).t()
    saved = mlp_fma.INTERPRET
    try:
        mlp_fma.INTERPRET = False
        cfg = mlp_fma.mlp_config(1, 768, 3072, w, w)
        assert cfg == dict(BLOCK_H=64, OUT_W=384, K_HEAD=512, K_TAIL=256, N_HEAD=256, N_TAIL=128, num_warps=8)
        assert mlp_fma.mlp_config(1, 1024, 4096, w, w) is None  # gpt2-medium: 64 hidden blocks
    finally:
        mlp_fma.INTERPRET = saved


def test_mlp_bad_arguments(device):
    C, hidden = 64, 128
    w = _weights(C, hidden, torch.float32, device)
    x = randn(1, C, device=device)
    cfg = _config(C, hidden, 16)
    with pytest.raises(ValueError, match="out: expected a tensor apart from x"):
        kernels.mlp(x, *w["fc"], *w["proj"], out=x, _config=cfg)
    with pytest.raises(ValueError, match="proj_weight: expected shape"):
        kernels.mlp(x, *w["fc"], w["proj"][0][:-1], w["proj"][1], _config=cfg)
    with pytest.raises(ValueError, match="fc_colsum: expected shape"):
        kernels.mlp(x, w["fc"][0], w["fc"][1], w["fc"][2][:-1], *w["proj"], _config=cfg)
    with pytest.raises(ValueError, match="activation: expected one of"):
        kernels.mlp(x, *w["fc"], *w["proj"], activation="swish", _config=cfg)
    with pytest.raises(ValueError, match="_config: at most 63 hidden blocks"):
        kernels.mlp(x, *w["fc"], *w["proj"], _config={**cfg, "BLOCK_H": 1})
    with pytest.raises(ValueError, match="_config: the fused launch takes one row"):
        kernels.mlp(randn(2, C, device=device), *w["fc"], *w["proj"], _config=cfg)
