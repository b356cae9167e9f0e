"""The L2 requests' ranges (kernels/_l2_ahead.py): what the kernels are asked to fetch. The
requests themselves change no result (test_decode_attention_proj, test_gemv_fma)."""
import pytest
import torch

from kernels._l2_ahead import MAX_RANGES, l2_ranges


@pytest.mark.parametrize("start,cols", [(0, 40), (3, 37), (5, 1), (1, 0)])
def test_ranges_start_and_end_on_16_bytes_inside_the_tensor(start, cols, device):
    """A slice of an out-major head's columns may start anywhere: the bulk request, which needs
    16-byte boundaries (a misaligned one is a CUDA error that ends the context), gets the
    whole 16-byte pieces inside the slice's bytes, and nothing outside them."""
    C = 50  # 100-byte columns: most slices start off a 16-byte boundary
    head = torch.randn(300, C, dtype=torch.float16, device=device).t()  # (C, 300), out-major
    share = head[:, start:start + cols]
    lo, hi = share.data_ptr(), share.data_ptr() + share.numel() * 2
    (view, nbytes), *unused = l2_ranges("l2_ahead", (share,), head.device)
    assert unused == [(None, 0)] * (MAX_RANGES - 1)
    assert view.dtype == torch.uint8 and view.numel() == nbytes and nbytes % 16 == 0
    assert view.data_ptr() % 16 == 0 and lo <= view.data_ptr() and view.data_ptr() + nbytes <= hi
    assert hi - lo - nbytes < 32  # at most one partial piece at either end is left out
    if nbytes:
        assert torch.equal(view, share.t().reshape(-1).view(torch.uint8)[view.data_ptr() - lo:][:nbytes])


def test_ranges_refuse_what_they_cannot_cover(device):
    w = torch.randn(8, 16, device=device)
    with pytest.raises(ValueError, match=rf"^l2_ahead: expected at most {MAX_RANGES} tensors, got "):
        l2_ranges("l2_ahead", (w,) * (MAX_RANGES + 1), w.device)
    with pytest.raises(ValueError, match=r"^l2_ahead\[1\]: expected a dense tensor"):
        l2_ranges("l2_ahead", (w, w[:, ::2]), w.device)
