import pytest
import torch

import kernels
from kernels import reference as ref
from tests.conftest import ON_GPU
from tests.kernels.helpers import DTYPES, randn

SHAPES = [(1, 50, 16, 24), (37, 300, 64, 100)] + ([(4096, 50257, 1024, 1600)] if ON_GPU else [])


@pytest.mark.parametrize("R,V,P,C", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding(R, V, P, C, dtype, device):
    wte, wpe = randn(V, C, dtype=dtype, device=device), randn(P, C, dtype=dtype, device=device)
    ids = torch.randint(0, V, (R,), device=device)
    pos = torch.randint(0, P, (R,), device=device, dtype=torch.int32)
    out = torch.full((R, C), float("nan"), dtype=dtype, device=device)
    stats = torch.full((R, 2, -(-C // 16)), float("nan"), device=device)
    lens = torch.full((R,), -7, dtype=torch.int32, device=device)
    y = kernels.embedding(ids, pos, wte, wpe, out=out, stats_out=stats, lens_out=lens)
    expect = (wte[ids].double() + wpe[pos.long()].double()).to(dtype)
    assert torch.equal(y, expect)  # one rounding of an exact fp32 sum: bit-identical
    assert torch.equal(lens, pos + 1)
    torch.testing.assert_close(stats.cpu(), ref.row_stats(expect).cpu(), rtol=1e-5, atol=1e-4)


def test_embedding_indices_outside_the_tables_read_nothing(device):
    """An id or position outside its table (the argmax of NaN logits, say) adds zeros: no read
    out of bounds."""
    wte, wpe = randn(50, 24, device=device), randn(8, 24, device=device)
    ids = torch.tensor([50, 2 ** 31 - 1, -1, 3, 4], device=device)
    pos = torch.tensor([0, 5, 7, 8, 2], device=device)
    y = kernels.embedding(ids, pos, wte, wpe)
    assert torch.equal(y[:3], wpe[pos[:3]]) and torch.equal(y[3], wte[3])
    assert torch.equal(y[4], wte[4] + wpe[2])
    assert torch.equal(ref.embedding(ids, pos, wte, wpe), y)


def test_embedding_errors(device):
    wte, wpe = randn(10, 8, device=device), randn(4, 8, device=device)
    ids = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="pos: expected shape"):
        kernels.embedding(ids, ids[:2], wte, wpe)
    with pytest.raises(ValueError, match="ids: expected dtype"):
        kernels.embedding(ids.float(), ids, wte, wpe)
    with pytest.raises(ValueError, match="wpe: expected 8 columns"):
        kernels.embedding(ids, ids, wte, randn(4, 6, device=device))
    with pytest.raises(ValueError, match="lens_out: expected a contiguous tensor of shape"):
        kernels.embedding(ids, ids, wte, wpe, lens_out=torch.empty(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="lens_out: expected dtype"):
        kernels.embedding(ids, ids, wte, wpe, lens_out=torch.empty(3, device=device))
