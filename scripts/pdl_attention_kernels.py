"""Each layer's decode attention in the chains of dependent launches of scripts/probe_pdl_ring.py
and scripts/probe_pdl_step.py: a launch of its own between qkv and attn-out, a program a head
(ring_attention_kernel), small enough to share any SM with the launches beside it. A head's
pieces are helpers: its cached keys and values (asked for before the wait: the cache never
depends on the launch before), the folded layernorm's terms of its q, k and v, qkv's raw
outputs, the softmax over the positions, and this step's key and value appended.

Session 110 also computed the attention inside attn-out, where it stages x (a program a head,
attn-out's tiles one box wide, LN1's statistics stored by qkv: one launch a layer fewer). A
gpt2-xl step took 1,086-1,142 us against 1,062-1,074 with this launch (fp32 atomics; int32
words 1,142-1,180 against 1,112-1,127): attn-out's tiles one head wide cost 37-69 us on their
own, more than the merge saved (bench/results/h200/session-110/). Removed; the code is at
c69c61f."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pdl_ring_kernels import LATE_TRIGGER, NO_WAIT, _act_load, _over_part, _raise_flag, _row_load, _row_stats, _to_word


@gluon.jit
def _head_cache(kc_ptr, vc_ptr, h, P, C, D: gl.constexpr, BP: gl.constexpr, blk: gl.constexpr):
    """Head h's P cached keys and values ((P + 1, C) fp16 row-major, row P this step's, not read)
    as (BP, D) tiles in blk, zeros past P."""
    p = gl.arange(0, BP, layout=gl.SliceLayout(1, blk))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    at = p[:, None] * C + h * D + d[None, :]
    old = (p < P)[:, None]
    return gl.load(kc_ptr + at, mask=old, other=0.0), gl.load(vc_ptr + at, mask=old, other=0.0)


@gluon.jit
def _head_fold(p_ptr, u_off, c_off, h, C, D: gl.constexpr, blk: gl.constexpr):
    """The folded layernorm's u and c of head h's q, k and v (qkv's outputs h D, C + h D, 2C + h D):
    q = rstd (W' x - mean u) + c."""
    d = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    at = h * D + d
    return (gl.load(p_ptr + u_off + at), gl.load(p_ptr + u_off + C + at), gl.load(p_ptr + u_off + 2 * C + at),
            gl.load(p_ptr + c_off + at), gl.load(p_ptr + c_off + C + at), gl.load(p_ptr + c_off + 2 * C + at))


@gluon.jit
def _head_qkv(qkv_ptr, h, C, D: gl.constexpr, FIXED: gl.constexpr, blk: gl.constexpr):
    """Head h's q, k and v from qkv's output (fp32 or FIXED-bit words), as fp32."""
    d = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    at = qkv_ptr + h * D + d
    return _act_load(at, d < D, FIXED), _act_load(at + C, d < D, FIXED), _act_load(at + 2 * C, d < D, FIXED)


@gluon.jit
def _fold_finish(v, mean, rstd, u, c):
    """rstd (v - mean u) + c, each step one explicit fma: left to FP contraction, int32 words'
    v (a word times 2**-16) took mean u rounded alone where fp32's v fused it into one fma, so
    --sums fixed32 and grid put a y one unit apart for about one x0 in five (session 162)."""
    return gl.fma(rstd, gl.fma(-mean, u, v), c)


@gluon.jit
def _attend_head(q, k_new, v_new, kt, vt, P, scale, BP: gl.constexpr, blk: gl.constexpr):
    """softmax(K q * scale) V over the cache's P positions (kt, vt) and this step's k_new, v_new
    (row P): the head's output, (D,) fp32."""
    p = gl.arange(0, BP, layout=gl.SliceLayout(1, blk))
    new = (p == P)[:, None]
    k = gl.where(new, k_new[None, :], kt.to(gl.float32))
    v = gl.where(new, v_new[None, :], vt.to(gl.float32))
    s = gl.where(p <= P, gl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
    e = gl.exp2((s - gl.max(s, axis=0)) * 1.4426950408889634)  # log2(e): exp via exp2
    return gl.sum(e[:, None] * v, axis=0) / gl.sum(e, axis=0)


@gluon.jit
def _append_kv(kc_ptr, vc_ptr, P, C, h, k_new, v_new, D: gl.constexpr, blk: gl.constexpr):
    """This step's key and value of head h into the cache's row P (fp16)."""
    d = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    gl.store(kc_ptr + P * C + h * D + d, k_new.to(gl.float16))
    gl.store(vc_ptr + P * C + h * D + d, v_new.to(gl.float16))


@gluon.jit
def ring_attention_kernel(kc_ptr, vc_ptr, qkv_ptr, y_ptr, P, C, scale, x_ptr, p_ptr, u_off, c_off, eps, flag_ptr,
                          MODE: gl.constexpr, D: gl.constexpr, BP: gl.constexpr, FOLD: gl.constexpr,
                          KP: gl.constexpr, FIXED: gl.constexpr, num_warps: gl.constexpr,
                          GUARD: gl.constexpr = 3):  # GUARD_PARTS | GUARD_READS
    """A layer's decode attention between qkv and attn-out, a program a head: its P cached keys and
    values loaded before the wait, q, k and v from qkv's output after it; y[head] = softmax(K q
    * scale) V over the P + 1 positions, and the new key and value appended at row P. Small
    enough to share any SM with the launches beside it. FOLD: qkv's output is W' x with the
    layernorm folded into W' (ring_linear_mma_kernel's XFORM 3); this launch's few programs take
    the statistics of x (the residual stream) and finish q, k, v = rstd (W' x - mean u) + c, u
    and c at p_ptr + u_off / c_off, so qkv's many do not. FIXED (32, 64): the activations (qkv's
    output, x, y) are fixed-point words of that width (int32's guard: y's values and the
    residual stream's checked, the flag at flag_ptr raised at the end; GUARD: which checks), or
    (GRID32) fp32 with y truncated onto int32's grid as its words would be."""
    h = gl.program_id(0)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    d = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    kt, vt = _head_cache(kc_ptr, vc_ptr, h, P, C, D, BP, blk)
    if FOLD:
        u_q, u_k, u_v, c_q, c_k, c_v = _head_fold(p_ptr, u_off, c_off, h, C, D, blk)
    if (MODE & LATE_TRIGGER) == 0:
        gdc_launch_dependents()
    if (MODE & NO_WAIT) == 0:
        gdc_wait()
    q, k_new, v_new = _head_qkv(qkv_ptr, h, C, D, FIXED, blk)
    if FOLD:
        mean, rstd, over = _row_stats(_row_load(x_ptr, C, KP, FIXED, num_warps), C, eps, FIXED, GUARD)
        q, k_new, v_new = (_fold_finish(q, mean, rstd, u_q, c_q), _fold_finish(k_new, mean, rstd, u_k, c_k),
                           _fold_finish(v_new, mean, rstd, u_v, c_v))
    y = _attend_head(q, k_new, v_new, kt, vt, P, scale, BP, blk)
    if FIXED != 0:
        gl.store(y_ptr + h * D + d, _to_word(y, FIXED))
    else:
        gl.store(y_ptr + h * D + d, y)
    _append_kv(kc_ptr, vc_ptr, P, C, h, k_new, v_new, D, blk)
    if (FIXED == 32) & (GUARD != 0):  # last, off the outputs' path
        bad = _over_part(y, d < D, FIXED, GUARD)
        if FOLD:
            bad = bad | ((d == 0) & (over > 0.0))
        _raise_flag(flag_ptr, bad)
