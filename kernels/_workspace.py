"""Arrival counters for the one-launch split reductions (linear's split-K, decode attention),
the fixed-point words of the fused attention launch's head merge, and the screened head's
scratch for its columns' upper ends.

A program of a split tile bumps its tile's counter after writing its partial; the last one to
arrive reduces and resets the counter to zero (the last head to add into a word zeroes it). So
one zeroed buffer of each kind per device serves every launch, also inside CUDA graphs, as long
as launches on it do not run concurrently.
"""
import torch

_buffers = {}


def arrival_counters(device, n):
    """A zeroed int32 buffer of at least n counters on `device` (grown when too small).
    A grown buffer's predecessors stay referenced: a captured CUDA graph may still use one, and
    freed, its memory could go to another tensor while the graph bumps counters in it."""
    return _shared(device, n, torch.int32, "counters")


def fixed_point_sums(device, n):
    """A zeroed int64 buffer of at least n words on `device`, as arrival_counters: the words
    that decode_attention_proj's heads add their partials into, left zero by the last one."""
    return _shared(device, n, torch.int64, "sums")


def screen_scratch(device, n, dtype):
    """A buffer of at least n elements of dtype on `device` that one vocab_screen launch at a time
    writes and reads back: shared, so that a decode step run without CUDA graphs allocates
    nothing for it (its contents between launches do not matter; zeroed once, when made)."""
    return _shared(device, n, dtype, "screen")


def _shared(device, n, dtype, use):
    """The newest buffer of (use, device, dtype), made zeroed and grown to hold n (never freed)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" is the current one, as for tensors
        device = torch.device("cuda", torch.cuda.current_device())
    bufs = _buffers.setdefault((use, device, dtype), [])  # by use: a scratch never aliases the counters
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 1 << 16), dtype=dtype, device=device))
    return bufs[-1]
