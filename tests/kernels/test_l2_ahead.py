"""The L2 requests' ranges (kernels/_l2_ahead.py): what the kernels are asked to fetch. The
requests themselves change no result (test_decode_attention_proj, test_gemv_fma)."""
import pytest
import torch
import triton
import triton.language as tl

from kernels._l2_ahead import MAX_RANGES, _l2_piece, l2_ranges


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


@triton.jit
def _pieces_kernel(out_ptr, a_bytes, b_bytes, SLOTS: tl.constexpr, PIECE: tl.constexpr):
    """Every (program, round, slot)'s piece as _ask_l2_ranges deals them: (live, in a, offset, size)."""
    program, num_programs = tl.program_id(0), tl.num_programs(0)
    n_pieces = tl.cdiv(a_bytes, PIECE) + tl.cdiv(b_bytes, PIECE)
    rnd = 0
    for first in range(0, n_pieces, num_programs * SLOTS):
        in_a, off, size, live = _l2_piece(a_bytes, b_bytes, first, program, num_programs, SLOTS, PIECE)
        row = out_ptr + ((program * 8 + rnd) * SLOTS + tl.arange(0, SLOTS)) * 4
        tl.store(row, live.to(tl.int64))
        tl.store(row + 1, in_a.to(tl.int64))
        tl.store(row + 2, off)
        tl.store(row + 3, size.to(tl.int64))
        rnd += 1


@pytest.mark.parametrize("a_bytes,b_bytes,programs", [(96 * 1024, 48 * 1024 + 32, 5), (2048 + 16, 0, 3),
                                                       (0, 7 * 1024, 4), (160 * 1024, 160 * 1024, 3)])
def test_requests_cover_both_ranges_once_dealt_evenly(a_bytes, b_bytes, programs, device):
    """The pieces asked for are every PIECE-byte piece of both ranges exactly once (the last
    one of each range shorter), and no program asks for more than one piece beyond any other:
    the requests leave every SM about equally (MINILLM_L2_SPREAD). Two ranges of 160 KB take
    more than one round of 3 programs x 32 slots."""
    SLOTS, PIECE = 32, 1024
    out = torch.full((programs, 8, SLOTS, 4), -1, dtype=torch.int64, device=device)
    _pieces_kernel[(programs,)](out, a_bytes, b_bytes, SLOTS=SLOTS, PIECE=PIECE)
    rec = out.cpu().view(-1, 4)
    live = rec[rec[:, 0] == 1]
    asked = sorted((int(a), int(o), int(s)) for _, a, o, s in live)
    expect = sorted([(1, o, min(PIECE, a_bytes - o)) for o in range(0, a_bytes, PIECE)]
                    + [(0, o, min(PIECE, b_bytes - o)) for o in range(0, b_bytes, PIECE)])
    assert asked == expect
    per_program = (out.cpu()[..., 0] == 1).sum(dim=(1, 2))
    assert int(per_program.max() - per_program.min()) <= 1, per_program.tolist()
