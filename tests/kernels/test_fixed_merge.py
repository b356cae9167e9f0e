"""The tagged merge (kernels/_fixed_merge.py's _launch_tag and _add_tagged) on its own: the
launches' tags and who comes last, the words' layout (a partial's bits beside its tag), the
order of the sum, and, on the GPU, programs that really run at once. (Its users' tests check
it against the stored merge's bits: tests/kernels/test_gemv_slab.py.)"""
import pytest
import torch
import triton
import triton.language as tl

from kernels._fixed_merge import _add_tagged, _launch_tag
from kernels._workspace import tagged_parts
from tests.conftest import ON_GPU
from tests.kernels.helpers import randn

ROWS, COLS = 4, 8


@triton.jit
def _merge_kernel(x_ptr, y_ptr, last_ptr, tickets, words, M, PARTS: tl.constexpr, ROWS: tl.constexpr,
                  COLS: tl.constexpr):
    """Program (b, p) adds part p of block b (x[p, b]: (ROWS, COLS), M rows of it) by the tagged
    merge; the last writes the sum to y[b] and its ticket's verdict to last[b, p]."""
    b, p = tl.program_id(0), tl.program_id(1)
    rm, rn = tl.arange(0, ROWS), tl.arange(0, COLS)
    mask = (rm < M)[:, None] & (rn < COLS)[None, :]
    tile = rm[:, None] * COLS + rn[None, :]
    tag = _launch_tag(tickets + b, PARTS)
    blocks = tl.num_programs(0)
    acc = tl.load(x_ptr + (p * blocks + b) * ROWS * COLS + tile, mask=mask, other=0.0)
    acc, finish = _add_tagged(acc, words + b * PARTS * ROWS * COLS + tile, tickets + b, p, tag, mask, ROWS * COLS,
                              PARTS)
    tl.store(last_ptr + b * PARTS + p, finish.to(tl.int32))
    if finish:
        tl.store(y_ptr + b * ROWS * COLS + tile, acc, mask=mask)


def _merge(x, M):
    """(the sums, the last-flags, the tickets, the words) of x (PARTS, blocks, ROWS, COLS)."""
    parts, blocks = x.shape[:2]
    tickets, words = tagged_parts(x.device, blocks, parts, ROWS * COLS)
    y = torch.full((blocks, ROWS, COLS), float("nan"), device=x.device)
    last = torch.full((blocks, parts), -1, dtype=torch.int32, device=x.device)
    _merge_kernel[(blocks, parts)](x, y, last, tickets, words, M, PARTS=parts, ROWS=ROWS, COLS=COLS)
    return y, last, tickets, words


def _in_order(x):
    """The parts added in order from zero, in fp32 (the stored merge's arithmetic)."""
    total = torch.zeros_like(x[0])
    for part in x:
        total = total + part
    return total


@pytest.mark.parametrize("parts", [2, 3])
def test_tagged_merge_sums_in_order_and_tags_each_launch(parts, device):
    """Each block's last program to count in writes the parts' sum in order (exactly: a
    different order would round differently on these magnitudes); every block's counter moves
    by the parts, one program a block comes last, and every part's words bear the launch's tag
    beside its bits. A second launch with fewer rows reads none of the first's words."""
    blocks = 3
    scales = torch.tensor([1e4, 1.0, 1e-4][:parts], device=device).view(parts, 1, 1, 1)
    x = (randn(parts, blocks, ROWS, COLS, device=device) * scales).contiguous()
    tickets, _ = tagged_parts(device, blocks, parts, ROWS * COLS)
    before = tickets[:blocks].clone()
    y, last, tickets, words = _merge(x, ROWS)
    assert torch.equal(y, _in_order(x)), "the sum is not the parts in order"
    assert torch.equal(tickets[:blocks] - before, torch.full_like(before, parts))
    assert torch.equal(last.sum(1), torch.ones(blocks, dtype=torch.int32, device=device))
    tag = before // parts + 1  # this launch's tag at each block
    region = words[:blocks * parts * ROWS * COLS].view(blocks, parts, ROWS, COLS)
    for b in range(blocks):
        for p in range(parts):
            assert torch.equal(region[b, p] >> 32, torch.full_like(region[b, p], int(tag[b])))
            bits = (region[b, p] & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
            assert torch.equal(bits, x[p, b])
    x2 = randn(parts, blocks, ROWS, COLS, device=device).contiguous()
    y2, *_ = _merge(x2, 2)
    assert torch.equal(y2[:, :2], _in_order(x2)[:, :2])
    assert torch.isnan(y2[:, 2:]).all(), "rows past M written"


@pytest.mark.skipif(not ON_GPU, reason="programs run at once only on the GPU (the interpreter runs them in turn)")
def test_tagged_merge_under_concurrency(device):
    """Many blocks of four parts, launched back to back 50 times: every launch's sums are the
    parts in order, whichever program comes last and whether or not it had to wait."""
    parts, blocks = 4, 512
    x = randn(parts, blocks, ROWS, COLS, device=device).contiguous()
    expect = _in_order(x)
    for _ in range(50):
        y, last, _, _ = _merge(x, ROWS)
        assert torch.equal(y, expect)
        assert torch.equal(last.sum(1), torch.ones(blocks, dtype=torch.int32, device=device))
