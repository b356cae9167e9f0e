"""Fused prefill attention (FlashAttention-2 style forward).

Each program owns BLOCK_M queries of one (batch, head) and streams the keys and values in
BLOCK_N blocks, keeping a running max and running sum (online softmax), so the T x T score
matrix never exists. Blocks wholly below the causal diagonal and inside the sequence skip the
masking work; only the diagonal and tail blocks pay for it.

Prefill also fills the KV cache here (k_out, v_out): each program copies the keys and values at
its own query rows, so every position is written once, with no copy kernels of its own.

Ragged batches: prompts are right-padded to a common T, and `seq_lens[b]` hides key positions
>= seq_lens[b] from every query of sequence b. Query rows past the end still get finite output
(they see the valid keys), which the caller ignores.
"""
import math

import torch
import triton
import triton.language as tl

from ._checks import check_device_usable, check_shape, check_tensor
from ._tuning import INTERPRET, autotune, launch, pick, sm_count

LOG2E = 1.4426950408889634
# a program holds q and its fp32 accumulator as (BLOCK_M, BLOCK_D) tiles: wider heads would spill
# (GPT-2's are 64); narrower ones pad to the 16 columns tl.dot needs
MAX_HEAD_DIM = 256


# Every config streams the keys in blocks of BLOCK_N = 64: the online softmax rescales at block
# boundaries, so BLOCK_N sets a row's rounding, and one BLOCK_N makes the autotuner's pick (which
# differs between machines) leave every output bit alone. BLOCK_M and warps do not change a row's
# arithmetic (the GPU test runs every config against the first). The first is the untuned default
# (MINILLM_AUTOTUNE=0): the fastest in fp16 at 1,024 tokens, and near the fastest in fp32 (an
# H200's fp32 1 x 12 x 1024 x 64: 293 us, where the old first, 128 x 64 in 4 warps, spilled and
# took 4.7 ms; scripts/bench_attention_tiles.py, bench/results/h200/session-117/).
ROW_BLOCK_N = 64


def _configs(interpret=INTERPRET):
    if interpret:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": ROW_BLOCK_N}, num_warps=w, num_stages=s)
            for bm, w, s in ((64, 4, 3), (64, 4, 4), (64, 8, 4), (128, 8, 3), (128, 8, 4))]


@triton.jit
def _attn_block(acc, l_i, m_i, q, k_base, v_base, offs_m, offs_d, start_n, kv_len, qk_scale,
                stride_kn, stride_vn, D, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    d_mask = offs_d < D
    if MASKED:
        kv_mask = (offs_n[:, None] < kv_len) & d_mask[None, :]
    else:
        kv_mask = d_mask[None, :]
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    s = qk * qk_scale  # log2 domain
    if MASKED:
        keep = offs_n[None, :] < kv_len
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    # one explicit FMA, not s - m: the compiler contracts qk * scale - m into an FMA where nothing
    # sits between them (unmasked blocks) but not across the mask's select, and which blocks a row
    # meets masked depends on BLOCK_M, so the bits would too
    p = tl.exp2(tl.fma(qk, qk_scale, -m_new[:, None]))
    if MASKED:
        p = tl.where(keep, p, 0.0)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lens_ptr, ko_ptr, vo_ptr,
    H, T, T_BUCKET, D, qk_scale,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
    stride_kob, stride_koh, stride_kot, stride_vob, stride_voh, stride_vot,
    CAUSAL: tl.constexpr, HAS_LENS: tl.constexpr, KV_OUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    HEADS_FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    if HEADS_FIRST:  # (heads_first) the query blocks last to first, every head's in each
        pid_bh = tl.program_id(0)
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    kv_len = T
    if HAS_LENS:
        kv_len = tl.minimum(tl.load(lens_ptr + b), T)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = q_ptr + b * stride_qb + h * stride_qh
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    q_mask = (offs_m[:, None] < T) & (offs_d[None, :] < D)
    q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)
    if KV_OUT:  # the keys and values at this block's query rows into the cache (each row once)
        k_own = tl.load(k_base + offs_m[:, None] * stride_kt + offs_d[None, :], mask=q_mask, other=0.0)
        v_own = tl.load(v_base + offs_m[:, None] * stride_vt + offs_d[None, :], mask=q_mask, other=0.0)
        tl.store(ko_ptr + b * stride_kob + h * stride_koh + offs_m[:, None] * stride_kot + offs_d[None, :], k_own,
                 mask=q_mask)
        tl.store(vo_ptr + b * stride_vob + h * stride_voh + offs_m[:, None] * stride_vot + offs_d[None, :], v_own,
                 mask=q_mask)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    # keys this block of queries can see, and the prefix that needs no mask at all
    hi = kv_len
    if CAUSAL:
        hi = tl.minimum(hi, (pid_m + 1) * BLOCK_M)
        full = tl.minimum(kv_len, pid_m * BLOCK_M) // BLOCK_N * BLOCK_N
    else:
        full = kv_len // BLOCK_N * BLOCK_N
    for start_n in range(0, full, BLOCK_N):
        acc, l_i, m_i = _attn_block(acc, l_i, m_i, q, k_base, v_base, offs_m, offs_d, start_n, kv_len,
                                    qk_scale, stride_kt, stride_vt, D, False, CAUSAL, BLOCK_N, INPUT_PRECISION)
    for start_n in range(full, hi, BLOCK_N):
        acc, l_i, m_i = _attn_block(acc, l_i, m_i, q, k_base, v_base, offs_m, offs_d, start_n, kv_len,
                                    qk_scale, stride_kt, stride_vt, D, True, CAUSAL, BLOCK_N, INPUT_PRECISION)

    out = acc / l_i[:, None]
    o_base = o_ptr + b * stride_ob + h * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_ot + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=q_mask)


_CONFIGS = _configs()
_attention_tuned = autotune(_CONFIGS, key=["T_BUCKET", "D", "CAUSAL", "HEADS_FIRST"])(_attention_kernel)


def heads_first(causal, pairs, sms):
    """Whether the grid runs every (batch, head) pair's query blocks last to first, pairs fastest,
    rather than one pair's blocks first to last: under a causal mask the last blocks see the most
    keys, and where every pair fits the first wave (pairs <= sms) starting them first keeps them
    off the grid's tail. H200, alone in a CUDA graph (bench/results/h200/session-102/call2-probe.log):
    1 x 12 heads at 1,024 positions 15.45 -> 14.12 us, 1 x 25 23.19 -> 19.76, 8 x 12 at 128
    6.12 -> 5.64; past the SMs (16 x 12 at 1,024) 109.7 -> 114.4, as the blocks sharing a pair's
    keys no longer run side by side."""
    return causal and pairs <= sms


def attention(q, k, v, causal=True, scale=None, seq_lens=None, out=None, k_out=None, v_out=None, _config=None):
    """softmax(q k^T * scale [+ causal / length masks]) v without materializing the scores.

    q, k, v: (B, H, T, D), any strides but a contiguous head dim; D from 1 to MAX_HEAD_DIM.
    seq_lens: optional (B,) int tensor of valid lengths (>= 1) for right-padded batches.
    out: optional (B, H, T, D) destination, e.g. a transposed view of a (B, T, H, D) buffer.
    k_out, v_out: optional (B, H, T, D) tensors (views of a KV cache) that receive copies of k
    and v, all T positions (padding too), in the same launch.
    _config: tests and benchmarks only: a launch config (BLOCK_M, BLOCK_N, num_warps, num_stages)
    in place of the autotuner's.
    """
    check_tensor("q", q, ndim=4, last_contiguous=True)
    check_device_usable("q", q)
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, ndim=4, last_contiguous=True, dtypes=(q.dtype,), device=q.device)
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"k, v: expected the shape of q {tuple(q.shape)}, got {tuple(k.shape)} and {tuple(v.shape)}")
    B, H, T, D = q.shape
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"q: expected a head_dim from 1 to {MAX_HEAD_DIM}, got {D}")
    if seq_lens is not None:
        check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32, torch.int64), device=q.device)
        if seq_lens.shape[0] != B:
            raise ValueError(f"seq_lens: expected shape ({B},), got {tuple(seq_lens.shape)}")
    o = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    check_tensor("out", o, ndim=4, dtypes=(q.dtype,), device=q.device, last_contiguous=True)
    check_shape("out", o, q.shape)
    if (k_out is None) != (v_out is None):
        raise ValueError("k_out, v_out: expected both or neither")
    for name, t in (("k_out", k_out), ("v_out", v_out)):
        if t is not None:
            check_tensor(name, t, ndim=4, dtypes=(q.dtype,), device=q.device, last_contiguous=True)
            check_shape(name, t, q.shape)
    kv_out = k_out is not None
    ko, vo = (k_out, v_out) if kv_out else (o, o)
    if T == 0 or B * H == 0:
        return o
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    first = heads_first(bool(causal), B * H, sm_count(q.device))

    def grid(meta):
        blocks = triton.cdiv(T, meta["BLOCK_M"])
        return (B * H, blocks) if first else (blocks, B * H)

    kernel, meta = (_attention_kernel, dict(_config)) if _config is not None else pick(_attention_tuned, _CONFIGS)
    launch(
        kernel, grid, q, k, v, o, seq_lens if seq_lens is not None else o, ko, vo,
        H, T, triton.next_power_of_2(T), D, scale * LOG2E,  # log2(e): softmax via exp2
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        ko.stride(0), ko.stride(1), ko.stride(2), vo.stride(0), vo.stride(1), vo.stride(2),
        CAUSAL=bool(causal), HAS_LENS=seq_lens is not None, KV_OUT=kv_out, HEADS_FIRST=first,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_D=max(16, triton.next_power_of_2(D)), **meta,
    )
    return o
