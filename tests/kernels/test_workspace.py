import gc
import weakref

import pytest
import torch

from kernels._workspace import arrival_counters, fixed_point_sums, screen_scratch


def test_counters_are_zeroed_shared_and_grow_without_freeing():
    """Every launch on a device shares one zeroed buffer; growing it keeps the old one alive,
    since a captured CUDA graph may still bump counters in it."""
    dev = torch.device("cpu")
    first = arrival_counters(dev, 10)
    assert first.dtype == torch.int32 and first.numel() >= 10 and not first.any()
    assert arrival_counters(dev, first.numel()) is first
    old = weakref.ref(first)
    grown = arrival_counters(dev, first.numel() + 1)
    assert grown.numel() > first.numel() and not grown.any()
    del first
    gc.collect()
    assert old() is not None, "a grown buffer freed its predecessor"
    assert arrival_counters(dev, 1) is grown


def test_fixed_point_sums_are_their_own_zeroed_int64_buffer():
    dev = torch.device("cpu")
    words = fixed_point_sums(dev, 100)
    assert words.dtype == torch.int64 and words.numel() >= 100 and not words.any()
    assert fixed_point_sums(dev, 10) is words
    assert words.data_ptr() != arrival_counters(dev, 10).data_ptr()


def test_the_screens_scratch_never_aliases_the_zeroed_buffers():
    """The screen writes its scratch at will: in the counters' dtype it still gets its own buffer,
    shared between calls and grown like the others."""
    dev = torch.device("cpu")
    scratch = screen_scratch(dev, 10, torch.int32)
    assert scratch.data_ptr() != arrival_counters(dev, 10).data_ptr()
    assert screen_scratch(dev, 10, torch.int32) is scratch
    assert screen_scratch(dev, 10, torch.float16).dtype == torch.float16
    assert screen_scratch(dev, scratch.numel() + 1, torch.int32).numel() > scratch.numel()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="an index-less CUDA device needs a GPU")
def test_an_index_less_cuda_device_gets_the_current_devices_buffers():
    """torch.device("cuda") and the tensors' cuda:N name one buffer: a check of the words a
    launch left must not read a fresh one."""
    here = torch.device("cuda", torch.cuda.current_device())
    assert fixed_point_sums(torch.device("cuda"), 10) is fixed_point_sums(here, 10)
    assert arrival_counters(torch.device("cuda"), 10) is arrival_counters(here, 10)
