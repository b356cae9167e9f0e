"""L2 prefetch of the next kernel's weights: a decode step is a chain of short kernels, each
waiting on the one before, and between their weight reads the memory bus idles while the chain
waits (a kernel boundary, an L2 round trip for the activations, a split-K merge). A kernel that
is handed the next weight tensor asks the L2 for it as it starts (Hopper's bulk prefetch, one
thread per program, 16 KB a request), so DRAM streams the next weights while this kernel's
chain runs, and the next kernel reads them from L2.

A prefetch is only a hint: it changes no result, and the launchers turn it off where the
instruction does not exist (before sm_90, the interpreter) or MINILLM_L2_PREFETCH=0.
"""
import os

import torch
import triton
import triton.language as tl

from ._checks import check_tensor
from ._tuning import INTERPRET

PIECE = tl.constexpr(16384)  # bytes per prefetch request
CAP = 32 << 20  # at most this many bytes of one tensor: what the L2 can hold beside the rest
ENABLED = os.environ.get("MINILLM_L2_PREFETCH", "1") != "0" and not INTERPRET
_devices = {}


def _supported(device):
    if not ENABLED or device.type != "cuda":
        return False
    if device not in _devices:
        _devices[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return _devices[device]


def prefetch_args(t, device):
    """(tensor, byte count) for a launch that should prefetch t, or (None, 0) for none. t must
    occupy one dense range of memory (any dense layout, e.g. a transposed view)."""
    if t is None:
        return None, 0
    check_prefetch(t, device)
    nbytes = min(t.numel() * t.element_size(), CAP) // 16 * 16  # bulk copies move whole 16 bytes
    if not _supported(device) or nbytes == 0:
        return None, 0
    return t, nbytes


def check_prefetch(t, device):
    """A launcher's check of its prefetch argument (None passes)."""
    if t is not None:
        check_tensor("prefetch", t, dtypes=None, device=device)
        if not _is_dense(t):
            raise ValueError(f"prefetch: expected a tensor over one dense range of memory, got strides {t.stride()}")


def _is_dense(t):
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1)
    step = 1
    for stride, size in dims:
        if stride != step:
            return False
        step *= size
    return True


@triton.jit
def _prefetch_l2(ptr, nbytes, pid, num_programs):
    """Program pid's share of the L2 prefetch of bytes [0, nbytes) at ptr: requests pid,
    pid + num_programs, ... of PIECE bytes each. Issued by thread 0; nothing waits on them."""
    base = ptr.to(tl.pointer_type(tl.int8))
    for piece in range(pid, tl.cdiv(nbytes, PIECE), num_programs):
        off = piece.to(tl.int64) * PIECE
        size = tl.minimum(nbytes - off, PIECE).to(tl.int32)
        tl.inline_asm_elementwise(
            """{ .reg .pred leader; .reg .b32 tid;
            mov.u32 tid, %tid.x; setp.eq.u32 leader, tid, 0;
            @leader cp.async.bulk.prefetch.L2.global [$1], $2;
            mov.u32 $0, 0; }""",
            "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False, pack=1)
