"""A decode step's bookkeeping in one launch: record every row's new token, advance the row,
and embed the new token as the next step's input.

Unfused, this is five or six tiny torch kernels per generated token (an indexed copy, two adds,
a copy, the end-of-sequence flags) and the embedding's launch; in a CUDA-graph decode step of a
small model each costs about as much as a layer's matmul launch.
"""
import torch
import triton
import triton.language as tl

from ._checks import check_device_usable, check_tensor
from ._tuning import launch, use_pdl
from .argmax_key import _empty_keys, _key_index
from .embedding import _embed_row, check_outputs, check_tables, embed_meta


@triton.jit
def _append_tokens_kernel(next_ptr, out_ptr, step_ptr, tokens_ptr, pos_ptr, finished_ptr,
                          wte_ptr, wpe_ptr, x_ptr, stats_ptr, lens_ptr, eos, N, n_vocab, n_pos,
                          stride_ob, stride_te, stride_pe, stride_xm, stride_sm,
                          HAS_EOS: tl.constexpr, FROM_KEYS: tl.constexpr, EMBED: tl.constexpr,
                          STATS_OUT: tl.constexpr, LENS_OUT: tl.constexpr, BLOCK_N: tl.constexpr,
                          USE_PDL: tl.constexpr):
    row = tl.program_id(0)  # one program a row: each keeps its own step, so no program waits on another
    if USE_PDL:  # may start while the lm_head finishes: wait for the new ids
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    nxt = tl.load(next_ptr + row)
    if FROM_KEYS:  # the lm_head's argmax keys: read the index, leave EMPTY for the next step
        tl.store(next_ptr + row + tl.arange(0, 1), _empty_keys(1))
        nxt = _key_index(nxt)
    step = tl.load(step_ptr + row)
    tl.store(out_ptr + row * stride_ob + step, nxt.to(out_ptr.dtype.element_ty))
    tl.store(step_ptr + row, step + 1)
    tl.store(tokens_ptr + row, nxt.to(tokens_ptr.dtype.element_ty))
    pos = tl.load(pos_ptr + row) + 1
    tl.store(pos_ptr + row, pos)
    if HAS_EOS:
        done = tl.load(finished_ptr + row) != 0
        tl.store(finished_ptr + row, done | (nxt == eos))
    if LENS_OUT:
        tl.store(lens_ptr + row, (pos + 1).to(lens_ptr.dtype.element_ty))
    if EMBED:  # the next step's input row and its statistics: no embedding launch there
        _embed_row(nxt.to(tl.int64), pos.to(tl.int64), row, wte_ptr, wpe_ptr, x_ptr, stats_ptr, N, n_vocab, n_pos,
                   stride_te, stride_pe, stride_xm, stride_sm, BLOCK_N, STATS_OUT)


def append_tokens(next_ids, out, step, tokens, pos, finished=None, eos=None, from_keys=False,
                  wte=None, wpe=None, x_out=None, stats_out=None, lens_out=None):
    """For every row b: out[b, step[b]] = tokens[b] = next_ids[b]; pos[b] += 1; step[b] += 1;
    with eos, finished[b] |= next_ids[b] == eos. All on the device, no sync.

    next_ids: (B,) int64; out: (B, L) int64; step: (B,) int64; tokens, pos: (B,) int32;
    finished: (B,) bool (with eos, an int token id).
    from_keys: next_ids holds argmax keys (linear's argmax_keys): the ids are their indices,
    and next_ids is reset to argmax_key.EMPTY for the next step's lm_head.
    wte, wpe, x_out: also embed the new tokens at their advanced positions, as `embedding` does:
    x_out[b] = wte[id] + wpe[pos[b]], with its stats_out and lens_out (= pos + 1). The runtime
    feeds x_out to the next step (GPT.decode's `embedded`) and saves that step a launch. A
    position past wpe's last row embeds as wte alone (the last step's token, never fed back).
    """
    check_tensor("next_ids", next_ids, ndim=1, dtypes=(torch.int64,))
    check_device_usable("next_ids", next_ids)
    B = next_ids.shape[0]
    dev = next_ids.device
    check_tensor("out", out, ndim=2, dtypes=(torch.int64,), device=dev)
    for name, t, dtype in (("step", step, torch.int64), ("tokens", tokens, torch.int32), ("pos", pos, torch.int32)):
        check_tensor(name, t, ndim=1, dtypes=(dtype,), device=dev)
        if t.shape[0] != B or t.stride(0) != 1:
            raise ValueError(f"{name}: expected a contiguous ({B},) tensor, got shape {tuple(t.shape)}")
    if out.shape[0] != B or out.stride(1) != 1:
        raise ValueError(f"out: expected ({B}, L) with contiguous rows, got shape {tuple(out.shape)}")
    if (finished is None) != (eos is None):
        raise ValueError("finished/eos: expected both or neither")
    if finished is not None:
        check_tensor("finished", finished, ndim=1, dtypes=(torch.bool,), device=dev)
    embed = all(t is not None for t in (wte, wpe, x_out))
    if not embed and any(t is not None for t in (wte, wpe, x_out, stats_out, lens_out)):
        raise ValueError("wte/wpe/x_out: expected all three or none (stats_out and lens_out go with them)")
    if embed:
        check_tables(wte, wpe)
        if wte.device != dev:
            raise ValueError(f"wte: expected a tensor on {dev}, got one on {wte.device}")
        check_outputs(wte, B, x_out, stats_out, lens_out, out_name="x_out")
    if B:
        pdl = use_pdl(dev)
        if embed:
            (BLOCK_N, warps), tables = embed_meta(wte.shape[1]), (wte, wpe, x_out)
        else:  # pointers and sizes the kernel does not read
            (BLOCK_N, warps), tables = (16, 1), (out, out, out)
        stats = stats_out if stats_out is not None else tables[2]
        launch(_append_tokens_kernel, (B,), next_ids, out, step, tokens, pos,
               finished if finished is not None else pos, *tables, stats,
               lens_out if lens_out is not None else pos, -1 if eos is None else int(eos),
               tables[0].shape[1], tables[0].shape[0], tables[1].shape[0], out.stride(0), *(t.stride(0) for t in tables),
               stats.stride(0), HAS_EOS=eos is not None, FROM_KEYS=bool(from_keys), EMBED=embed,
               STATS_OUT=stats_out is not None, LENS_OUT=lens_out is not None, BLOCK_N=BLOCK_N, USE_PDL=pdl,
               num_warps=warps, launch_pdl=pdl)
    return out
