"""Greedy decoding's argmax fused into the decode lm_head (gemv's ARGMAX epilogue)."""
import triton
import triton.language as tl


@triton.jit
def _argmax_rows(y, tile_mask, rm, rn, m_mask, pid_m, pid_n, num_pid_n, val_ptr, idx_ptr, counter_ptr, tok_ptr,
                 BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Greedy decoding's argmax over each row of y, fused: every column block writes its rows'
    (max, first index of the max); the last block of a row block to arrive reduces them in
    column order. Ties go to the lowest index, as torch.argmax does."""
    BIG: tl.constexpr = 2147483647
    v = tl.where(tile_mask, y, float("-inf"))
    vmax = tl.max(v, axis=1)
    vidx = tl.min(tl.where(v == vmax[:, None], rn[None, :], BIG), axis=1)
    tl.store(val_ptr + rm * num_pid_n + pid_n, vmax, mask=m_mask)
    tl.store(idx_ptr + rm * num_pid_n + pid_n, vidx, mask=m_mask)
    done = tl.atomic_add(counter_ptr + pid_m, 1, sem="acq_rel")
    if done == num_pid_n - 1:
        best = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        best_i = tl.zeros((BLOCK_M,), dtype=tl.int32)
        for c0 in range(0, num_pid_n, CHUNK):
            cc = c0 + tl.arange(0, CHUNK)
            mask = m_mask[:, None] & (cc < num_pid_n)[None, :]
            offs = rm[:, None] * num_pid_n + cc[None, :]
            cv = tl.load(val_ptr + offs, mask=mask, other=float("-inf"), cache_modifier=".cg")
            ci = tl.load(idx_ptr + offs, mask=mask, other=BIG, cache_modifier=".cg")
            cmax = tl.max(cv, axis=1)
            cidx = tl.min(tl.where(cv == cmax[:, None], ci, BIG), axis=1)
            take = cmax > best  # strictly: an equal max in a later chunk has a higher index
            best = tl.where(take, cmax, best)
            best_i = tl.where(take, cidx, best_i)
        tl.store(tok_ptr + rm, best_i.to(tl.int64), mask=m_mask)
        tl.atomic_xchg(counter_ptr + pid_m, 0, sem="relaxed")  # see the split counter below
