"""Arrival counters for the one-launch split reductions (linear's split-K, decode attention),
and the fixed-point words of the fused attention launch's head merge; and the counters and
double buffers of the unfenced merge (_fixed_merge._add_unfenced), which never go back to zero.

A program of a split tile bumps its tile's counter after writing its partial; the last one to
arrive reduces and resets the counter to zero (the last head to add into a word zeroes it). So
one zeroed buffer of each kind per device serves every launch, also inside CUDA graphs, as long
as launches on it do not run concurrently.
"""
import torch

from ._fixed_merge import EMPTY

_buffers = {}


def arrival_counters(device, n):
    """A zeroed int32 buffer of at least n counters on `device` (grown when too small).
    A grown buffer's predecessors stay referenced: a captured CUDA graph may still use one, and
    freed, its memory could go to another tensor while the graph bumps counters in it."""
    return _zeroed(device, n, torch.int32)


def fixed_point_sums(device, n):
    """A zeroed int64 buffer of at least n words on `device`, as arrival_counters: the words
    that decode_attention_proj's heads add their partials into, left zero by the last one."""
    return _zeroed(device, n, torch.int64)


def double_buffered_parts(device, blocks, parts, tile):
    """(counters, parts) for the unfenced merge (_fixed_merge._add_unfenced) of `blocks` column
    blocks in `parts` parts of `tile` elements: int64 counters, one a block, which only count
    up, and each block's own region of two buffers of parts x tile fp32 elements, all EMPTY at
    first. One pair per (parts, tile): a block's launch numbers count its own launches of one
    layout, and a region is always the same block's. Grown as arrival_counters, the pair
    together."""
    device = _resolve(device)
    bufs = _buffers.setdefault((device, "double-buffered", parts, tile), [])
    if not bufs or bufs[-1][0].numel() < blocks:
        n = max(blocks, 64)
        empty = torch.full((n * 2 * parts * tile,), EMPTY.value, dtype=torch.int32, device=device)
        bufs.append((torch.zeros(n, dtype=torch.int64, device=device), empty.view(torch.float32)))
    return bufs[-1]


def _resolve(device):
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" is the current one, as for tensors
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _zeroed(device, n, dtype):
    device = _resolve(device)
    bufs = _buffers.setdefault((device, dtype), [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 1 << 16), dtype=dtype, device=device))
    return bufs[-1]
