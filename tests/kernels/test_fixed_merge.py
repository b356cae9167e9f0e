"""The unfenced merge (kernels/_fixed_merge.py's _launch_number and _add_unfenced) on its own:
launch numbers and who comes last, the double buffer (a launch's partials in its parity's
buffer, EMPTY in the other), the order of the sum, and, on the GPU, programs that really run at
once. (Its users' tests check it against the stored merge's bits: tests/kernels/test_gemv_slab.py.)"""
import pytest
import torch
import triton
import triton.language as tl

from kernels._fixed_merge import EMPTY, _add_unfenced, _launch_number
from kernels._workspace import double_buffered_parts
from tests.conftest import ON_GPU
from tests.kernels.helpers import randn

ROWS, COLS = 4, 8
TILE = ROWS * COLS


@triton.jit
def _merge_kernel(x_ptr, y_ptr, last_ptr, counts, parts, M, PARTS: tl.constexpr, ROWS: tl.constexpr,
                  COLS: tl.constexpr):
    """Program (b, p) adds part p of block b (x[p, b]: (ROWS, COLS), M rows of it) by the
    unfenced merge; the last writes the sum to y[b], and every program its verdict to last[b, p]."""
    b, p = tl.program_id(0), tl.program_id(1)
    rm, rn = tl.arange(0, ROWS), tl.arange(0, COLS)
    mask = (rm < M)[:, None] & (rn < COLS)[None, :]
    tile = rm[:, None] * COLS + rn[None, :]
    launch = _launch_number(counts + b, PARTS)
    acc = tl.load(x_ptr + (p * tl.num_programs(0) + b) * ROWS * COLS + tile, mask=mask, other=0.0)
    acc, finish = _add_unfenced(acc, parts + b * 2 * PARTS * ROWS * COLS + tile, counts + b, launch, p, mask,
                                ROWS * COLS, PARTS)
    tl.store(last_ptr + b * PARTS + p, finish.to(tl.int32))
    if finish:
        tl.store(y_ptr + b * ROWS * COLS + tile, acc, mask=mask)


def _merge(x, M):
    """(the sums, the last-flags) of x (PARTS, blocks, ROWS, COLS) over M rows."""
    n_parts, blocks = x.shape[:2]
    counts, parts = double_buffered_parts(x.device, blocks, n_parts, TILE)
    y = torch.full((blocks, ROWS, COLS), float("nan"), device=x.device)
    last = torch.full((blocks, n_parts), -1, dtype=torch.int32, device=x.device)
    _merge_kernel[(blocks, n_parts)](x, y, last, counts, parts, M, PARTS=n_parts, ROWS=ROWS, COLS=COLS)
    return y, last


def _in_order(x):
    """The parts added in order from zero, in fp32 (the stored merge's arithmetic)."""
    total = torch.zeros_like(x[0])
    for part in x:
        total = total + part
    return total


@pytest.mark.parametrize("n_parts", [2, 3])
def test_unfenced_merge_sums_in_order_in_the_launchs_buffer(n_parts, device):
    """Each block's last program to count in writes the parts' sum in order (exactly: another
    order would round differently on these magnitudes); every block's counter moves by the
    parts and one program a block comes last; the launch's partials stand in its parity's
    buffer, bit for bit, and the other buffer is EMPTY where they were written. A second launch
    (the other buffer) over fewer rows writes those rows alone."""
    blocks = 3
    counts, parts = double_buffered_parts(device, blocks, n_parts, TILE)
    scales = torch.tensor([1e4, 1.0, 1e-4][:n_parts], device=device).view(n_parts, 1, 1, 1)
    x = (randn(n_parts, blocks, ROWS, COLS, device=device) * scales).contiguous()
    before = counts[:blocks].clone()
    y, last = _merge(x, ROWS)
    assert torch.equal(y, _in_order(x)), "the sum is not the parts in order"
    assert torch.equal(counts[:blocks] - before, torch.full_like(before, n_parts))
    assert torch.equal(last.sum(1), torch.ones(blocks, dtype=torch.int32, device=device))
    region = parts[:blocks * 2 * n_parts * TILE].view(blocks, 2, n_parts, ROWS, COLS)
    for b in range(blocks):
        launch = int(before[b]) // n_parts
        assert torch.equal(region[b, launch % 2], x[:, b])
        assert (region[b, 1 - launch % 2].view(torch.int32) == EMPTY.value).all()
    x2 = randn(n_parts, blocks, ROWS, COLS, device=device).contiguous()
    y2, _ = _merge(x2, 2)
    assert torch.equal(y2[:, :2], _in_order(x2)[:, :2])
    assert torch.isnan(y2[:, 2:]).all(), "rows past M written"


@pytest.mark.skipif(not ON_GPU, reason="programs run at once only on the GPU (the interpreter runs them in turn)")
def test_unfenced_merge_under_concurrency(device):
    """Many blocks of four parts, launched back to back 50 times: every launch's sums are the
    parts in order, whichever program comes last and whether or not it read a part twice."""
    n_parts, blocks = 4, 512
    x = randn(n_parts, blocks, ROWS, COLS, device=device).contiguous()
    expect = _in_order(x)
    for _ in range(50):
        y, last = _merge(x, ROWS)
        assert torch.equal(y, expect)
        assert torch.equal(last.sum(1), torch.ones(blocks, dtype=torch.int32, device=device))
