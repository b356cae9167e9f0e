"""EXPERIMENT (seventy-first session): the fused attention launch asks L2 for the next linears'
weights (Hopper's cp.async.bulk.prefetch.L2: nothing waits on it, no result can change).

At gpt2-xl's size the launch streams 1.4 us of bytes in about 7 us, while fc's 20 MB wait for
the SMs its programs fill: fc's later programs would find their tiles in L2.
MINILLM_L2_NEXT=<when>:<what>[:<piece bytes>]: when 1 before the launch's wait, 2 right after it,
3 after its epilogue, 4 after its own early loads, before the wait; what: fc, mlp (mlp-out) and qkv (the next layer's) joined by +. Unset or 0: off.
"""
import os

import triton
import triton.language as tl

from ._tuning import INTERPRET

_SPEC = os.environ.get("MINILLM_L2_NEXT", "0")


def _parse(spec):
    if spec in ("", "0") or INTERPRET:  # the interpreter runs no inline PTX
        return 0, (), 1024
    parts = spec.split(":")
    what = parts[1].split("+") if len(parts) > 1 else []
    if len(parts) not in (2, 3) or parts[0] not in ("1", "2", "3", "4") or not what or \
            not set(what) <= {"fc", "mlp", "qkv"}:
        raise ValueError(f"MINILLM_L2_NEXT: expected <1|2|3|4>:<fc|mlp|qkv joined by +>[:<piece bytes>], got {spec!r}")
    piece = int(parts[2]) if len(parts) == 3 else 1024
    return int(parts[0]), tuple(parts[1].split("+")), piece


WHEN, WHAT, PIECE = _parse(_SPEC)


def ranges(next_weights):
    """[(tensor, bytes)] x 3 of the next linears' weights to ask for (bytes 0: none); next_weights:
    (fc, mlp-out, the next layer's qkv or None)."""
    picked = [w for w, name in zip(next_weights or (), ("fc", "mlp", "qkv")) if name in WHAT and w is not None]
    out = [(w, w.numel() * w.element_size() // 16 * 16) for w in picked]
    while len(out) < 3:
        out.append((None, 0))
    return out


@triton.jit
def _ask_l2(ptr, nbytes, pid, num_programs, SLOTS: tl.constexpr, PIECE: tl.constexpr):
    """This program's share of an L2 prefetch of nbytes (a multiple of 16) from ptr: each of its
    SLOTS threads asks for one PIECE at a time, the programs' slots interleaved."""
    base = ptr.to(tl.pointer_type(tl.int8))
    slot = tl.arange(0, SLOTS)
    n_pieces = tl.cdiv(nbytes, PIECE)
    for first in range(pid * SLOTS, n_pieces, num_programs * SLOTS):
        piece = first + slot
        off = piece.to(tl.int64) * PIECE
        live = piece < n_pieces
        size = tl.minimum(nbytes - off, PIECE).to(tl.int32)
        tl.inline_asm_elementwise(
            """{ .reg .pred live;
            setp.ne.s32 live, $3, 0;
            @live cp.async.bulk.prefetch.L2.global [$1], $2;
            mov.u32 $0, 0; }""",
            "=r,l,r,r", [base + off, size, live.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
