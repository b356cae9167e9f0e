"""A grid-wide barrier for persistent kernels: every program of the launch arrives, then waits
until all have. Sound only when every program is resident at once (grid <= SMs, one program
per SM fits), which the persistent launchers guarantee; Triton's interpreter runs programs one
after another, so there the grid must be a single program.

The counter only grows within a launch: the n-th barrier waits for n * programs arrivals, so
no program can mistake one barrier for the next. The launcher zeroes it before each launch.
"""
import triton
import triton.language as tl


@triton.jit
def _ld_acquire(ptr, ASM: tl.constexpr):
    """ptr's value, loaded with acquire semantics (GPU scope): later loads see what was
    written before the matching release."""
    if ASM:
        return tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr],
                                         dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.atomic_add(ptr, 0, sem="acquire")


@triton.jit
def _grid_sync(bar_ptr, target, ASM: tl.constexpr = True):
    """Arrive at the barrier bar_ptr and wait until it has counted `target` arrivals."""
    tl.debug_barrier()  # every warp's stores are issued before this program's arrival
    tl.atomic_add(bar_ptr, 1, sem="release")
    seen = _ld_acquire(bar_ptr, ASM)
    while seen < target:
        seen = _ld_acquire(bar_ptr, ASM)
    tl.debug_barrier()
