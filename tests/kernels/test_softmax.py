import pytest
import torch

import kernels
from kernels.softmax import MAX_N
from tests.conftest import ON_GPU
from tests.kernels.helpers import DTYPES, assert_rel_close, randn

SHAPES = [(1, 1), (3, 7), (17, 1000), (2, 3, 130)]
if ON_GPU:
    SHAPES += [(64, 50257), (4096, 1024)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax(shape, dtype, device):
    x = randn(*shape, dtype=dtype, device=device, scale=4.0)
    y = kernels.softmax(x)
    assert y.dtype == dtype
    assert_rel_close(y, torch.softmax(x.double(), dim=-1), dtype, f"softmax {shape}")


def test_softmax_large_logits(device):
    x = randn(4, 300, device=device, scale=1e4)  # exp would overflow without the max shift
    assert_rel_close(kernels.softmax(x), torch.softmax(x.double(), -1), torch.float32)


def test_softmax_errors(device):
    with pytest.raises(ValueError, match="x: expected dtype"):
        kernels.softmax(torch.ones(3, 4, dtype=torch.int64, device=device))
    for n in (0, MAX_N + 1):
        with pytest.raises(ValueError, match=rf"^x: expected a last dim from 1 to {MAX_N}, got {n}$"):
            kernels.softmax(randn(3, n, device=device))


def test_softmax_empty_batch(device):
    assert kernels.softmax(randn(0, 5, device=device)).shape == (0, 5)
