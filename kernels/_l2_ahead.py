"""Asking L2 for bytes a later kernel will read (Hopper's cp.async.bulk.prefetch.L2): the
requests carry no registers and nothing waits for them, so no result can change.

Used at one row where the layer's linears run on the CUDA-core GEMV (gemv_fma.py), which then
reads the bytes from L2 (past gpt2's width each weight only up to its first 2 MB:
minillm.decode_plan.l2_part); at gpt2's size:
- the fused attention launch (decode_attention_proj's l2_ahead): its 36 programs stream about
  1.5 MB in about 4 us of latency-bound work, and the bus is free to bring fc's and mlp-out's
  9.4 MB into L2 meanwhile;
- mlp-out (linear's l2_ahead, kept by gemv_fma): the next layer's qkv weights (3.5 MB), or the
  lm_head's first columns after the last layer;
- qkv (the same, from layer 1): its layer's attention projection W_o (1.2 MB), which the fused
  attention launch reads before its wait.
MINILLM_L2_AHEAD=0 turns the requests off (A/B timing).
The requests are Hopper instructions (sm_90 on): the launcher sends them only there
(_tuning.is_hopper), and never under the interpreter, which runs no inline PTX.
"""
import os

import torch
import triton
import triton.language as tl

from ._checks import check_tensor
from ._tuning import INTERPRET, is_hopper

ON = os.environ.get("MINILLM_L2_AHEAD", "1") != "0" and not INTERPRET
PIECE = 1024  # bytes a request, one a thread: 512 gained less (+2.0% against +2.8%), 4 KB (fc's alone) lost 2.3%
MAX_RANGES = 2


def l2_ranges(name, tensors, device):
    """[(bytes view, bytes)] * MAX_RANGES for a kernel's arguments: each tensor's bytes as a uint8
    view that starts and ends on 16-byte boundaries inside them (a bulk request takes only
    those, and a view's slice may start anywhere), (None, 0) for the unused ones. Each tensor
    must be dense in some order of its dims (an out-major weight's transposed view is), or its
    span would not be its bytes."""
    tensors = tuple(tensors or ())
    if len(tensors) > MAX_RANGES:
        raise ValueError(f"{name}: expected at most {MAX_RANGES} tensors, got {len(tensors)}")
    out = []
    for i, t in enumerate(tensors):
        check_tensor(f"{name}[{i}]", t, dtypes=None, device=device)
        dense = t.permute(sorted(range(t.dim()), key=t.stride, reverse=True))
        if not dense.is_contiguous():
            raise ValueError(f"{name}[{i}]: expected a dense tensor (in any order of its dims), got shape "
                             f"{tuple(t.shape)} with strides {t.stride()}")
        flat = dense.reshape(-1).view(torch.uint8)
        skip = -flat.data_ptr() % 16  # a misaligned request is a CUDA error that ends the context
        nbytes = max(0, flat.numel() - skip) // 16 * 16
        out.append((flat[skip:skip + nbytes], nbytes))
    return out + [(None, 0)] * (MAX_RANGES - len(out))


def launch_args(ranges, fallback, device, num_warps):
    """(the kernel's four range arguments, its L2_* constexprs) for l2_ranges' list (None: no
    requests); `fallback`, any tensor on the device, stands in for the unused pointers. The
    requests run only on Hopper (cp.async.bulk needs sm_90) and never under the interpreter."""
    (a, a_bytes), (b, b_bytes) = ranges or l2_ranges("l2_ahead", (), device)
    args = (a if a is not None else fallback, a_bytes, b if b is not None else fallback, b_bytes)
    return args, dict(L2_AHEAD=ON and a is not None and is_hopper(device), L2_SLOTS=32 * num_warps, L2_PIECE=PIECE)


@triton.jit
def _ask_l2_at(ptrs, sizes, live):
    """One bulk L2 request an element where live: sizes bytes (int32, a multiple of 16) from
    ptrs (int8 pointers, 16-byte aligned)."""
    tl.inline_asm_elementwise(
        """{ .reg .pred live;
        setp.ne.s32 live, $3, 0;
        @live cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.u32 $0, 0; }""",
        "=r,l,r,r", [ptrs, sizes, live.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _ask_l2_columns(w_ptr, n0, N, stride_wn, k0, nbytes, live, BLOCK_N: tl.constexpr):
    """Ask L2 for nbytes of each out-major column n0 .. n0 + BLOCK_N - 1 of w (stride_wk 1: a
    column's K values are one run), from K index k0, one request a column where live and below
    N. The launcher checks the 16-byte alignment of the runs and of nbytes."""
    col = n0 + tl.arange(0, BLOCK_N)
    ptrs = (w_ptr + col.to(tl.int64) * stride_wn + k0).to(tl.pointer_type(tl.int8))
    _ask_l2_at(ptrs, tl.full((BLOCK_N,), nbytes, dtype=tl.int32), live & (col < N))


@triton.jit
def _ask_l2(ptr, nbytes, program, num_programs, SLOTS: tl.constexpr, PIECE_BYTES: tl.constexpr):
    """This program's share of an L2 prefetch of nbytes (a multiple of 16) from ptr: each of its
    SLOTS threads asks for one piece at a time, the programs' slots interleaved."""
    base = ptr.to(tl.pointer_type(tl.int8))
    slot = tl.arange(0, SLOTS)
    n_pieces = tl.cdiv(nbytes, PIECE_BYTES)
    for first in range(program * SLOTS, n_pieces, num_programs * SLOTS):
        piece = first + slot
        off = piece.to(tl.int64) * PIECE_BYTES
        size = tl.minimum(nbytes - off, PIECE_BYTES).to(tl.int32)
        _ask_l2_at(base + off, size, piece < n_pieces)


@triton.jit
def _ask_l2_ranges(a_ptr, a_bytes, b_ptr, b_bytes, program, num_programs, SLOTS: tl.constexpr,
                   PIECE_BYTES: tl.constexpr):
    """_ask_l2 for both of launch_args' ranges (an unused one has 0 bytes: no request)."""
    _ask_l2(a_ptr, a_bytes, program, num_programs, SLOTS, PIECE_BYTES)
    _ask_l2(b_ptr, b_bytes, program, num_programs, SLOTS, PIECE_BYTES)
