"""Device helpers around the programmatic dependent launch's wait (griddepcontrol.wait), shared
by the decode kernels that convert prefetched tiles before it (decode_attention_proj.py,
gemv_fma.py).

ptxas sinks an fp16 -> fp32 conversion to its first use, which for a prefetched weight or cache
tile is a product after the wait: on the path from the previous kernel's output to this one's.
A wait predicated on a value computed from the converted tiles keeps the conversions before it
(scripts/inspect_sass.py counts them on either side)."""
import triton
import triton.language as tl


@triton.jit
def _in_f32(tile, chk):
    """The 2-D tile in fp32, and chk plus its maximum (for _gdc_wait_after to depend on)."""
    tile = tile.to(tl.float32)
    return tile, chk + tl.max(tl.max(tile, axis=1), axis=0)


@triton.jit
def _gdc_wait_after(x):
    """The dependent-launch wait, predicated on x so that ptxas computes x before it. The
    predicate always holds: x is a sum, and no arithmetic gives the NaN bits 0x7fc00001 (a NaN
    result is 0x7fffffff)."""
    return tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.u32 p, $1, 0x7fc00001; @p griddepcontrol.wait; "
                                     "mov.u32 $0, 0; }", "=r,r", [x.to(tl.int32, bitcast=True)], dtype=tl.int32,
                                     is_pure=False, pack=1)
