"""A decode step's bookkeeping in one launch: record every row's new token and advance the row.

Unfused, this is four or five tiny torch kernels per generated token (an indexed copy, two adds,
a copy); in a CUDA-graph decode step of a small model each costs about as much as a layer's
matmul launch. Where a row ends is the host's to see: the kernel also writes the ids into a
mirror of out in pinned host memory, which the device reaches directly (unified addressing), so
the host reads each step's ids without a copy queued between steps
(minillm.decode_state.StepReads).
"""
import torch
import triton
import triton.language as tl

from ._checks import check_device_usable, check_tensor
from ._tuning import launch, use_pdl
from .argmax_key import _empty_keys, _key_index
from .noise import check_noise


@triton.jit
def _append_tokens_kernel(next_ptr, out_ptr, host_ptr, step_ptr, tokens_ptr, pos_ptr, noise_ptr, B,
                          stride_ob, stride_hb, noise_increment, HOST_OUT: tl.constexpr, FROM_KEYS: tl.constexpr,
                          HAS_NOISE: tl.constexpr, BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # may start while the lm_head finishes: wait for the new ids
        tl.extra.cuda.gdc_wait()
    # no launch_dependents: the next launch (the next step's first) starts at this one's exit.
    # Its kernels may read pos before their waits (decode_attention_proj's prefetch at one row),
    # so pos must be stored first. H200, gpt2 batch 1, alternated twice, the same ids
    # (bench/results/h200/session-91/): +0.2% against the trigger after the wait
    rows = tl.arange(0, BLOCK_B)
    mask = rows < B
    step = tl.load(step_ptr)
    nxt = tl.load(next_ptr + rows, mask=mask)
    if FROM_KEYS:  # the lm_head's argmax keys: read the index, leave EMPTY for the next step
        tl.store(next_ptr + rows, _empty_keys(BLOCK_B), mask=mask)
        nxt = _key_index(nxt)
    tl.store(out_ptr + rows * stride_ob + step, nxt.to(out_ptr.dtype.element_ty), mask=mask)
    if HOST_OUT:  # posted writes over the bus: visible to the host once the launch has ended
        tl.store(host_ptr + rows * stride_hb + step, nxt.to(host_ptr.dtype.element_ty), mask=mask)
    tl.store(tokens_ptr + rows, nxt.to(tokens_ptr.dtype.element_ty), mask=mask)
    pos = tl.load(pos_ptr + rows, mask=mask)
    tl.store(pos_ptr + rows, pos + 1, mask=mask)
    tl.store(step_ptr, step + 1)
    if HAS_NOISE:  # the sampler read the generator state: advance it as exponential_ would
        tl.store(noise_ptr + 1, tl.load(noise_ptr + 1) + noise_increment)


def append_tokens(next_ids, out, step, tokens, pos, from_keys=False, noise=None, out_host=None):
    """For every row b: out[b, step] = tokens[b] = next_ids[b]; pos[b] += 1; then step += 1;
    with noise (the ExponentialNoise the step's sampler drew from), its offset += its increment;
    with out_host, out_host[b, step] = next_ids[b] as well. All on the device, no sync.

    next_ids: (B,) int64; out: (B, L) int64; step: (1,) int64; tokens, pos: (B,) int32;
    out_host: a (B, L) int64 CPU tensor, pinned where next_ids is on a GPU.
    from_keys: next_ids holds argmax keys (linear's argmax_keys): the ids are their indices,
    and next_ids is reset to argmax_key.EMPTY for the next step's lm_head.
    """
    check_tensor("next_ids", next_ids, ndim=1, dtypes=(torch.int64,))
    check_device_usable("next_ids", next_ids)
    B = next_ids.shape[0]
    dev = next_ids.device
    check_tensor("out", out, ndim=2, dtypes=(torch.int64,), device=dev)
    check_tensor("step", step, ndim=1, dtypes=(torch.int64,), device=dev)
    for name, t in (("tokens", tokens), ("pos", pos)):
        check_tensor(name, t, ndim=1, dtypes=(torch.int32,), device=dev)
        if t.shape[0] != B or t.stride(0) != 1:
            raise ValueError(f"{name}: expected a contiguous ({B},) tensor, got shape {tuple(t.shape)}")
    if out.shape[0] != B or out.stride(1) != 1:
        raise ValueError(f"out: expected ({B}, L) with contiguous rows, got shape {tuple(out.shape)}")
    if out_host is not None:
        check_tensor("out_host", out_host, ndim=2, dtypes=(torch.int64,), device=torch.device("cpu"))
        if out_host.shape != out.shape or out_host.stride(1) != 1:
            raise ValueError(f"out_host: expected {tuple(out.shape)} with contiguous rows, as out, got shape "
                             f"{tuple(out_host.shape)}")
        if dev.type == "cuda" and not out_host.is_pinned():
            raise ValueError("out_host: expected pinned memory (torch.empty(..., pin_memory=True)), which the GPU "
                             "reaches directly")
    if noise is not None:
        check_noise("noise", noise, dev)
    if B:
        pdl = use_pdl(dev)
        launch(_append_tokens_kernel, (1,), next_ids, out, out_host if out_host is not None else out, step, tokens,
               pos, noise.state if noise is not None else step, B, out.stride(0),
               out_host.stride(0) if out_host is not None else 0, noise.increment if noise is not None else 0,
               HOST_OUT=out_host is not None, FROM_KEYS=bool(from_keys), HAS_NOISE=noise is not None,
               BLOCK_B=triton.next_power_of_2(B), USE_PDL=pdl, num_warps=1, launch_pdl=pdl)
    return out
