"""Arrival counters for the one-launch split reductions (linear's split-K, decode attention).

A program of a split tile bumps its tile's counter after writing its partial; the last one to
arrive reduces and resets the counter to zero. So one zeroed buffer per device serves every
launch, also inside CUDA graphs, as long as launches on it do not run concurrently.
"""
import torch

_counters = {}


def arrival_counters(device, n):
    """A zeroed int32 buffer of at least n counters on `device` (grown when too small)."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _counters[device] = buf
    return buf
