"""A kernel whose int32 arithmetic wraps, for tests/test_interpreter_patching.py (Triton builds a
kernel from its source file, so it lives in one)."""
import triton
import triton.language as tl


@triton.jit
def mul_add(x_ptr, out_ptr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    tl.store(out_ptr + tl.arange(0, N), x * 3 + x + 5)
