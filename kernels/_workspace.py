"""Arrival counters for the one-launch split reductions (linear's split-K, decode attention).

A program of a split tile bumps its tile's counter after writing its partial; the last one to
arrive reduces and resets the counter to zero. So one zeroed buffer per device serves every
launch, also inside CUDA graphs, as long as launches on it do not run concurrently.
"""
import torch

_counters = {}


def arrival_counters(device, n):
    """A zeroed int32 buffer of at least n counters on `device` (grown when too small).
    A grown buffer's predecessors stay referenced: a captured CUDA graph may still use one, and
    freed, its memory could go to another tensor while the graph bumps counters in it."""
    bufs = _counters.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device))
    return bufs[-1]
