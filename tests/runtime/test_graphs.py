"""minillm/graphs.py: the prefill graph's staged inputs (one buffer, views of the right dtypes and
shapes, refilled in place) and a captured graph that replays them."""
import pytest
import torch

from minillm.graphs import StagedInputs, capture
from tests.conftest import ON_GPU


@pytest.mark.parametrize("batch,length", [(1, 1), (3, 5), (2, 16)])
def test_staged_inputs_are_views_of_one_buffer_refilled_in_place(batch, length):
    dev = "cuda" if ON_GPU else "cpu"
    s = StagedInputs(batch, length, dev)
    assert s.ids.dtype == torch.int64 and s.ids.shape == (batch, length) and s.ids.is_contiguous()
    assert s.lens.dtype == torch.int32 and s.lens.shape == (batch,)
    assert s.ids.data_ptr() == s.buffer.data_ptr() and s.lens.data_ptr() == s.buffer.data_ptr() + 8 * batch * length
    ids_ptr, lens_ptr = s.ids.data_ptr(), s.lens.data_ptr()
    g = torch.Generator().manual_seed(batch * 100 + length)
    for _ in range(2):  # a second load writes the same memory: a captured graph keeps reading it
        # ids past 2**32 too: the int64 view must keep both halves
        ids = torch.randint(-2**40, 2**40, (batch, length), generator=g, dtype=torch.int64)
        lens = torch.randint(1, length + 1, (batch,), generator=g, dtype=torch.int32)
        s.load(ids, lens)
        assert torch.equal(s.ids.cpu(), ids) and torch.equal(s.lens.cpu(), lens)
        assert s.ids.data_ptr() == ids_ptr and s.lens.data_ptr() == lens_ptr
    assert s.host.is_pinned() == ON_GPU


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_a_captured_graph_reads_each_load():
    s = StagedInputs(2, 3, "cuda")
    s.load(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int32))
    graph, out = capture(lambda: s.ids.sum(1) + s.lens, warmups=1)
    for k in range(3):
        ids = torch.arange(6, dtype=torch.int64).view(2, 3) * (k + 1) + 2**33
        lens = torch.tensor([k, 7 * k], dtype=torch.int32)
        s.load(ids, lens)
        graph.replay()
        assert out.tolist() == (ids.sum(1) + lens).tolist()
