"""torch's CUDA `exponential_` noise, computed at any element, so a kernel can draw it where it
needs it instead of reading a whole (B, V) tensor another launch wrote.

Sampling draws argmax(p / q) with q ~ Exp(1) over the whole (B, V) logits, as
`torch.multinomial` does; for a seed to give transformers' ids, q must be the very values
`torch.empty(B, V).exponential_(1)` gives. That is a pure function of the generator's seed and
philox offset at the call and of the element's index:
- torch launches `threads` = 256 x min(ceil(n / 256), SMs x max threads per SM / 256) threads
  (ATen's calc_execution_policy); thread t takes curand_init(seed, t, offset) and calls
  curand_uniform4 in a grid-stride loop, each call covering elements t + threads * (0..3);
- curand's Philox4x32-10 counter is (offset / 4 + call, t) as two 64-bit halves, its key the seed;
  the uniform is word * 2^-32 + 2^-33 in (0, 1];
- q = -__logf(u), or 2^-24 where u >= 1 - 2^-24 (ATen's guard against log(1) = 0): at::log of
  a float is CUDA's fast approximate log there (ATen/NumericUtils.h), not logf;
- the generator's offset then advances by `increment` = ceil(n / (4 threads)) * 4.

A sampled step carries `ExponentialNoise`: the generator's (seed, offset) in a device tensor
(append_tokens advances the offset, so a CUDA graph replays it), and the layout of its shape.
`torch_exponential_matches` checks the formula against this torch, bit for bit, before it is used.
"""
import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._checks import check_device_usable, check_shape, check_tensor
from ._libdevice import fast_logf
from ._tuning import launch, sm_count

BLOCK = 1024  # elements per program of the full draw


class ExponentialNoise(NamedTuple):
    """Where torch's `exponential_(1)` on a fresh contiguous float32 tensor of numel elements
    takes its values: state (2,) int64 on the device = (seed as int64 bits, philox offset), and
    the layout from torch_exponential_layout(numel, device)."""
    state: torch.Tensor
    threads: int
    increment: int


@functools.cache
def torch_exponential_layout(numel, device):
    """(threads, increment) of torch's CUDA exponential_ over numel elements on device (the
    interpreter stands for an SM count of 2 and 2,048 threads an SM)."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        per_sm = getattr(props, "max_threads_per_multi_processor", 2048) // 256
    else:
        per_sm = 2048 // 256
    threads = 256 * min(triton.cdiv(numel, 256), sm_count(device) * per_sm)
    return threads, (triton.cdiv(numel, 4 * threads)) * 4


def new_exponential_noise(numel, device):
    """An ExponentialNoise for numel elements on device, its state zeros (the caller copies a
    generator's seed_bits(initial_seed()) and get_offset() in: minillm.sampling.KernelNoise)."""
    threads, increment = torch_exponential_layout(numel, device)
    return ExponentialNoise(torch.zeros(2, dtype=torch.int64, device=device), threads, increment)


def check_noise(name, noise, device, shape=None):
    """An ExponentialNoise's state is (2,) int64 on device; with shape, its layout is that many
    elements' (fewer than 2^31: the kernels index in int32)."""
    check_tensor(f"{name}.state", noise.state, ndim=1, dtypes=(torch.int64,), device=device)
    check_shape(f"{name}.state", noise.state, (2,))
    if shape is None:
        return
    numel, dims = math.prod(shape), " x ".join(str(n) for n in shape)
    if numel >= 2 ** 31:
        raise ValueError(f"{name}: the in-kernel noise takes fewer than 2**31 elements, got {dims}")
    if (noise.threads, noise.increment) != torch_exponential_layout(numel, device):
        raise ValueError(f"{name}: expected the noise layout of {dims} elements "
                         f"{torch_exponential_layout(numel, device)}, got {(noise.threads, noise.increment)}")


def seed_bits(seed):
    """A generator's seed (0 to 2^64 - 1) as the int64 of the same bits."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@triton.jit
def _exponential_at(state_ptr, flat, threads):
    """torch's exponential_(1) value at int32 element indices `flat` (any shape; the tensor has
    fewer than 2^31 elements)."""
    seed = tl.load(state_ptr)
    offset = tl.load(state_ptr + 1)
    lap = flat // threads  # one int32 division a lane: a row's drawn columns are few, but all lanes run it
    call = lap >> 2  # the thread's curand_uniform4 call
    word = lap & 3  # which of the call's four words
    thread = flat - lap * threads  # curand_init's subsequence
    ctr = offset // 4 + call.to(tl.int64)
    r0, r1, r2, r3 = tl.philox(seed, (ctr & 0xFFFFFFFF).to(tl.uint32), (ctr >> 32).to(tl.uint32),
                               thread.to(tl.uint32), tl.zeros_like(thread).to(tl.uint32))
    r = tl.where(word == 0, r0, tl.where(word == 1, r1, tl.where(word == 2, r2, r3)))
    u = r.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10  # curand's (0, 1]: w 2^-32 + 2^-33
    return tl.where(u >= 0.99999994039535522, 5.9604644775390625e-08, -fast_logf(u))  # 1 - 2^-24 -> 2^-24


@triton.jit
def _exponential_kernel(state_ptr, out_ptr, N, threads, BLOCK: tl.constexpr):
    flat = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + flat, _exponential_at(state_ptr, flat, threads), mask=flat < N)


def exponential(noise, shape, out=None):
    """The float32 tensor of `shape` torch's exponential_(1) would fill from noise.state (whose
    layout must be for that many elements). Does not advance the state."""
    check_device_usable("noise.state", noise.state)
    dev = noise.state.device
    check_noise("noise", noise, dev, shape)
    numel = math.prod(shape)
    out = torch.empty(shape, dtype=torch.float32, device=dev) if out is None else out
    check_tensor("out", out, dtypes=(torch.float32,), device=dev)
    if tuple(out.shape) != tuple(shape) or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous tensor of shape {tuple(shape)}, got {tuple(out.shape)}")
    if numel:
        launch(_exponential_kernel, (triton.cdiv(numel, BLOCK),), noise.state, out, numel, noise.threads,
               BLOCK=BLOCK, num_warps=4)
    return out


@functools.cache
def torch_exponential_matches(device, numel):
    """Whether this torch's exponential_ over numel elements on device (CUDA) gives exactly the
    values and generator advance the formula above does, from a seed past 2^63 and an offset
    whose counter crosses 32 bits. False too where this torch's generators keep no offset."""
    try:
        g = torch.Generator(device).manual_seed((1 << 64) - 12345)
        g.set_offset((1 << 34) + 8)
        start = g.get_offset()
    except (AttributeError, RuntimeError):
        return False
    noise = new_exponential_noise(numel, device)
    noise.state.copy_(torch.tensor([seed_bits(g.initial_seed()), start]))
    want = torch.empty(numel, device=device).exponential_(1, generator=g)
    return torch.equal(exponential(noise, (numel,)), want) and g.get_offset() == start + noise.increment
