import pytest
import torch
import torch.nn.functional as F

import kernels
from tests.conftest import ON_GPU
from tests.kernels.helpers import DTYPES, TOLERANCE, assert_rel_close, randn

SIZES = [1, 7, 1000, 4099] + ([1 << 22] if ON_GPU else [])


def _gelu64(x, approximate):
    x = x.double()
    if approximate == "tanh":  # x * sigmoid(2u): torch's 1 + tanh(u) cancels to 0 below x = -7
        return x * torch.sigmoid(2 * 0.7978845608028654 * (x + 0.044715 * x ** 3))
    return F.gelu(x)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu(n, approximate, dtype, device):
    x = randn(n, dtype=dtype, device=device, scale=3.0)
    y = kernels.gelu(x, approximate=approximate)
    expect = _gelu64(x, approximate)
    assert torch.isfinite(y).all()
    # relative error, with an absolute floor of 1e-6 * ||x|| for the far negative tail where the
    # result underflows or 1 + erf cancels (torch's own fp32/fp16 GELU does the same)
    err = (y.double().cpu() - expect.cpu()).norm()
    floor = 1e-6 * x.double().norm().item()
    assert err <= TOLERANCE[dtype] * expect.norm().item() + floor, f"gelu {n}: error {err:.3e}"


def test_gelu_extremes(device):
    x = torch.tensor([-1e4, -30.0, -5.0, 0.0, 1e-6, 5.0, 30.0, 1e4], device=device)
    y = kernels.gelu(x)
    assert torch.isfinite(y).all()
    assert_rel_close(y, _gelu64(x, "tanh"), torch.float32)


def test_gelu_errors(device):
    with pytest.raises(ValueError, match="approximate"):
        kernels.gelu(randn(4, device=device), approximate="fast")
