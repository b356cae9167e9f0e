"""Token + position embedding gather: y[r] = wte[ids[r]] + wpe[pos[r]] in one pass. The gather
(_embedded_row) is also the prologue of gemv_fma.py's EMBED switch (linear.embedding_linear)."""
import torch
import triton
import triton.language as tl

from ._checks import check_device_usable, check_tensor
from ._epilogue import STATS_GROUP, _store_row_stats, check_row_stats
from ._tuning import launch, use_pdl


@triton.jit
def _embedded_row(ids_ptr, pos_ptr, wte_ptr, wpe_ptr, row, cols, mask, n_vocab, n_pos, stride_te, stride_pe):
    """wte[ids[row]] + wpe[pos[row]] over `cols` in fp32, not yet rounded, and the position.
    An index outside its table adds zeros: never a read out of bounds, which would end the
    process's CUDA context (an argmax over NaN logits gives the vocabulary size: no token)."""
    tok = tl.load(ids_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    zero = 0 * cols  # compared as vectors: the interpreter cannot mask with a scalar
    in_wte = (tok + zero >= 0) & (tok + zero < n_vocab)
    in_wpe = (pos + zero >= 0) & (pos + zero < n_pos)
    e = tl.load(wte_ptr + tok * stride_te + cols, mask=mask & in_wte, other=0.0).to(tl.float32)
    p = tl.load(wpe_ptr + pos * stride_pe + cols, mask=mask & in_wpe, other=0.0).to(tl.float32)
    return e + p, pos


@triton.jit
def _embedding_kernel(ids_ptr, pos_ptr, wte_ptr, wpe_ptr, y_ptr, stats_ptr, lens_ptr, N, n_vocab, n_pos,
                      stride_te, stride_pe, stride_ym, stride_sm, BLOCK_N: tl.constexpr, STATS_OUT: tl.constexpr,
                      LENS_OUT: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    if USE_PDL:  # may start while the previous kernel runs: wait for its writes (ids, pos)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    y, pos = _embedded_row(ids_ptr, pos_ptr, wte_ptr, wpe_ptr, row, cols, mask, n_vocab, n_pos, stride_te, stride_pe)
    y = y.to(y_ptr.dtype.element_ty)
    if LENS_OUT:  # a decode step's sequence lengths, without a launch of their own
        tl.store(lens_ptr + row, (pos + 1).to(lens_ptr.dtype.element_ty))
    tl.store(y_ptr + row * stride_ym + cols, y, mask=mask)
    if STATS_OUT:  # partial statistics for the first layer's layernorm (see _epilogue.py)
        rows = row + tl.arange(0, 1)
        vals = tl.where(mask, y.to(tl.float32), 0.0)[None, :]
        _store_row_stats(vals, rows, rows >= 0, 0, N, stats_ptr, stride_sm, 1, BLOCK_N)


def check_embedding(ids, pos, wte, wpe, lens_out):
    """embedding's argument checks (also embedding_linear's)."""
    check_tensor("wte", wte, ndim=2, last_contiguous=True)
    check_device_usable("wte", wte)
    check_tensor("wpe", wpe, ndim=2, dtypes=(wte.dtype,), device=wte.device, last_contiguous=True)
    for name, t in (("ids", ids), ("pos", pos)):
        check_tensor(name, t, ndim=1, dtypes=(torch.int32, torch.int64), device=wte.device)
    if pos.shape != ids.shape:
        raise ValueError(f"pos: expected shape {tuple(ids.shape)}, got {tuple(pos.shape)}")
    if wpe.shape[1] != wte.shape[1]:
        raise ValueError(f"wpe: expected {wte.shape[1]} columns like wte, got {wpe.shape[1]}")
    if lens_out is not None:
        check_tensor("lens_out", lens_out, ndim=1, dtypes=(torch.int32, torch.int64), device=wte.device)
        if lens_out.shape != pos.shape or lens_out.stride(0) != 1:
            raise ValueError(f"lens_out: expected a contiguous tensor of shape {tuple(pos.shape)}, "
                             f"got shape {tuple(lens_out.shape)}")


def embedding(ids, pos, wte, wpe, out=None, stats_out=None, lens_out=None):
    """wte[ids] + wpe[pos] for 1-D int tensors ids and pos of equal length; returns (len, C).
    The runtime validates prompt ids and positions on the host; an index outside its table
    embeds as zeros instead of reading out of bounds.
    stats_out: a `new_row_stats(len, C)` buffer for the rows' partial statistics.
    lens_out: an int32/int64 tensor shaped like pos that receives pos + 1 (in a decode step,
    the sequence lengths decode attention needs)."""
    check_embedding(ids, pos, wte, wpe, lens_out)
    R, N = ids.shape[0], wte.shape[1]
    y = torch.empty((R, N), dtype=wte.dtype, device=wte.device) if out is None else out
    check_row_stats("stats_out", stats_out, R, N, wte.device)
    if R:
        BLOCK_N = max(STATS_GROUP, triton.next_power_of_2(N))
        pdl = use_pdl(wte.device)
        stats = stats_out if stats_out is not None else y
        launch(_embedding_kernel, (R,), ids, pos, wte, wpe, y, stats, lens_out if lens_out is not None else pos, N,
               wte.shape[0], wpe.shape[0], wte.stride(0), wpe.stride(0), y.stride(0), stats.stride(0), BLOCK_N=BLOCK_N,
               STATS_OUT=stats_out is not None, LENS_OUT=lens_out is not None, USE_PDL=pdl,
               num_warps=4 if BLOCK_N <= 1024 else 8, launch_pdl=pdl)
    return y
