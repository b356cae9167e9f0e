import pytest
import torch

import kernels
from kernels import reference as ref
from kernels.layernorm import standardize
from tests.conftest import ON_GPU
from tests.kernels.helpers import DTYPES, assert_rel_close, poisoned, randn

SHAPES = [(1, 768), (3, 100), (17, 1600), (130, 1024), (2, 5, 1280)]
if ON_GPU:
    SHAPES += [(4096, 768), (16384, 1600), (64, 8192)]


def _ln64(x, w, b, eps):
    return ref.layernorm(x.double(), w.double(), b.double(), eps)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layernorm(shape, dtype, device):
    N = shape[-1]
    x = randn(*shape, dtype=dtype, device=device, scale=3.0) + 0.5
    w = randn(N, dtype=dtype, device=device)
    b = randn(N, dtype=dtype, device=device)
    out = poisoned(shape, dtype, device)
    y = kernels.layernorm(x, w, b, eps=1e-5, out=out)
    assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
    assert_rel_close(y, _ln64(x, w, b, 1e-5), dtype, f"layernorm {shape}")


@pytest.mark.parametrize("shape", SHAPES[:4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layernorm(shape, dtype, device):
    N = shape[-1]
    x, r = randn(*shape, dtype=dtype, device=device), randn(*shape, dtype=dtype, device=device)
    w, b = randn(N, dtype=dtype, device=device), randn(N, dtype=dtype, device=device)
    out, sum_out = poisoned(shape, dtype, device), poisoned(shape, dtype, device)
    h, y = kernels.add_layernorm(x, r, w, b, out=out, sum_out=sum_out)
    h_ref = (x.double() + r.double()).to(dtype)
    assert torch.equal(h, h_ref), "the sum must be rounded exactly like x + residual"
    assert_rel_close(y, _ln64(h_ref, w, b, 1e-5), dtype, f"add_layernorm {shape}")


def test_layernorm_errors(device):
    x = randn(4, 8, device=device)
    w = randn(8, device=device)
    with pytest.raises(ValueError, match="weight: expected shape"):
        kernels.layernorm(x, randn(7, device=device), w)
    with pytest.raises(ValueError, match="weight: expected a torch.Tensor"):  # not a silent standardize
        kernels.layernorm(x, None, w)
    with pytest.raises(ValueError, match="x: expected dtype"):
        kernels.layernorm(x.to(torch.int32), w, w)
    with pytest.raises(ValueError, match="x: expected a contiguous last dim"):
        kernels.layernorm(randn(8, 4, device=device).t(), w, w)
    with pytest.raises(ValueError, match="residual: expected shape"):
        kernels.add_layernorm(x, randn(4, 7, device=device), w, w)
    wide = randn(8200, device=device)  # one program holds a row: past 8192 it would spill
    with pytest.raises(ValueError, match="^x: expected a last dim of at most 8192, got 8200$"):
        kernels.layernorm(randn(2, 8200, device=device), wide, wide)


def test_layernorm_empty_batch(device):
    w, b = randn(8, device=device), randn(8, device=device)
    assert kernels.layernorm(randn(0, 8, device=device), w, b).shape == (0, 8)
    h, y = kernels.add_layernorm(randn(2, 0, 8, device=device), randn(2, 0, 8, device=device), w, b)
    assert h.shape == y.shape == (2, 0, 8)


@pytest.mark.parametrize("M,N", [(3, 768), (130, 1100)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_standardize(M, N, dtype, device):
    """A layernorm without gain and shift (prefill's half of a folded layernorm)."""
    x = randn(M, N, dtype=dtype, device=device, scale=3.0) + 5.0
    ones, zeros = torch.ones(N, device=device), torch.zeros(N, device=device)
    y = standardize(x, 1e-5)
    assert y.shape == x.shape and y.dtype == dtype
    assert_rel_close(y, _ln64(x, ones, zeros, 1e-5), dtype, f"standardize {M}x{N}")
