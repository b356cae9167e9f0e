"""Zeroed workspaces for the one-launch reductions: arrival counters (linear's split-K, decode
attention, the fused MLP) and the fused MLP's fixed-point rows.

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


_fixed_rows = {}


def fixed_point_rows(device, n):
    """A zeroed int64 buffer of at least n values on `device` (grown when too small) for the
    fixed-point reductions (the fused MLP): each launch adds into it and its last program zeroes
    what it used, so, like the counters, one buffer serves every launch that does not overlap."""
    buf = _fixed_rows.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int64, device=device)
        _fixed_rows[device] = buf
    return buf
