"""Math that must round as torch's CUDA kernels do, from libdevice; under the interpreter (which
has no libdevice) numpy's: its exp rounds as expf, its log lies a few ulps from __logf."""
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._tuning import INTERPRET

if INTERPRET:
    @triton.jit
    def expf(x):
        return tl.exp(x)

    @triton.jit
    def fast_logf(x):
        return tl.log(x)
else:
    @triton.jit
    def expf(x):
        return libdevice.exp(x)  # expf's rounding, as torch's softmax (tl.exp is approximate)

    @triton.jit
    def fast_logf(x):
        return libdevice.fast_logf(x)  # __logf: lg2.approx times ln 2, as ATen's at::log of a float
