"""tests/interpreter_patching.py: the interpreter's shortcuts change no result (CPU only: a GPU
run never interprets)."""
import pytest
import torch
import triton
import triton.language as tl

from tests.conftest import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the patches are the interpreter's: a GPU run compiles")


@triton.jit
def _mul_add(x_ptr, out_ptr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    tl.store(out_ptr + tl.arange(0, N), x * 3 + x + 5)  # wraps past int32's range


def test_memoized_dtypes_are_tritons():
    import triton.runtime.interpreter as interp

    from tests.interpreter_patching import _memoized_np_dtype

    assert interp._get_np_dtype.__qualname__.startswith("_memoized_np_dtype")  # installed by conftest
    original = interp._get_np_dtype.__wrapped__
    memo = _memoized_np_dtype(original, tl)
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64,
               tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv]
    types = scalars + [tl.pointer_type(t) for t in scalars] + [tl.block_type(t, [4, 8]) for t in scalars] + \
        [tl.block_type(tl.pointer_type(tl.float16), [16])]
    for _ in range(2):  # the second round from the memo
        for t in types:
            assert memo(t) == original(t), t


def test_int32_arithmetic_wraps_as_before():
    """The overflow sanitizer is off, and int32 products and sums still wrap as numpy's (Triton
    never reported an overflow here: its assertion needs debug)."""
    import triton.runtime.interpreter as interp

    assert interp.interpreter_builder.options.sanitize_overflow is False
    x = torch.tensor([2 ** 30, -(2 ** 30), 12345, 2 ** 31 - 1], dtype=torch.int32)
    out = torch.full_like(x, 7)
    _mul_add[(1,)](x, out, N=4)
    expect = (x.to(torch.int64) * 3 + x.to(torch.int64) + 5) & 0xFFFFFFFF
    expect = torch.where(expect >= 2 ** 31, expect - 2 ** 32, expect).to(torch.int32)
    assert torch.equal(out, expect)
