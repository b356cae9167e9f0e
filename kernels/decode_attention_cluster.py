"""decode_attention_proj's one-launch attention and output projection, with its heads merged
inside a thread-block cluster instead of through global memory (Gluon, Triton 3.9+, Hopper+).

In the plain kernel every (row, head, column block) program stores its head's partial product,
passes an arrival atomic, and the last arriver reads all the partials back: 1.5-2.5 us of a
layer at batch 1 (docs/performance.md). Here the heads of one (row, column block) are the CTAs
of one cluster (HEADS = 16, the largest cluster Hopper runs; heads past H stay idle):
- every tensor carries the head axis first, laid out one head per CTA (`cga_layout`), so each
  CTA computes its own head's attention over the whole cache and its share of the product;
- the sum over the head axis is then a reduction across the cluster: the partials cross
  through distributed shared memory between cluster barriers, never through L2;
- the epilogue is split too: CTA c adds bias and residual to, stores and sums the statistics
  of the c-th group of 16 columns (a STATS_GROUP), where one last arriver did all 256.
Gluon has no interpreter, so CI compiles this kernel ahead of time for sm_90 and the GPU tests
run it (tests/kernels/test_decode_attention_cluster.py)."""
import functools
import os

import triton

from ._tuning import INTERPRET, launch

try:  # Gluon's cluster layouts arrived after the GPU's Triton 3.6
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    # Triton 3.6's Gluon has cga_layout already, but cannot lower a reduction across CTAs; the
    # cluster barrier (hopper.cluster) came with the Triton that can (3.9)
    from triton.experimental.gluon.language.nvidia.hopper import cluster as _cluster  # noqa: F401

    AVAILABLE = "cga_layout" in getattr(gl.BlockedLayout, "__dataclass_fields__", {})
except ImportError:  # pragma: no cover - Tritons without Gluon: the kernel is never compiled
    import triton.language as gl

    gluon, AVAILABLE = None, False

HEADS = 16  # CTAs a cluster: Hopper's non-portable maximum (Triton asks the driver for it)
BLOCK_N = 256  # output columns a cluster: one 16-column statistics group per CTA
GROUP = 16  # kernels._epilogue.STATS_GROUP
WARPS = 8
LOG2_HEADS = 4


def _jit(fn):
    return gluon.jit(fn) if AVAILABLE else fn


@_jit
def _head_ids(n: gl.constexpr, layout: gl.constexpr):
    return gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))


@_jit
def _mid_ids(n: gl.constexpr, layout: gl.constexpr):
    return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))


@_jit
def _last_ids(n: gl.constexpr, layout: gl.constexpr):
    return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))


@_jit
def _decode_attention_cluster_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, knew_ptr, vnew_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, stats_ptr,
    M, N, D, L, H, qk_scale,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
    stride_knb, stride_knh, stride_vnb, stride_vnh, stride_wk, stride_wn, stride_rm, stride_ym, stride_sm,
    HAS_BIAS: gl.constexpr, STATS_OUT: gl.constexpr, USE_PDL: gl.constexpr, PREFETCH: gl.constexpr,
    EARLY_LAUNCH: gl.constexpr, HEADS: gl.constexpr, GROUP: gl.constexpr,
    BLOCK_L: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_N: gl.constexpr,
    KV: gl.constexpr, W: gl.constexpr, EPI: gl.constexpr,
):
    if USE_PDL and EARLY_LAUNCH:
        gdc_launch_dependents()
    pid = gl.program_id(0)  # a cluster: one (row, column block)
    b = pid % M
    n0 = (pid // M) * BLOCK_N

    # (HEADS, BLOCK_D, BLOCK_N): each CTA's head's D rows of W, before anything else
    hw = _head_ids(HEADS, W)[:, None, None]
    dw = _mid_ids(BLOCK_D, W)[None, :, None]
    nw = n0 + _last_ids(BLOCK_N, W)[None, None, :]
    w = gl.load(w_ptr + (hw * D + dw) * stride_wk + nw * stride_wn, mask=(hw < H) & (dw < D) & (nw < N), other=0.0)

    # (HEADS, BLOCK_L, BLOCK_D): the whole cache of each CTA's head
    h3 = _head_ids(HEADS, KV)[:, None, None]
    l3 = _mid_ids(BLOCK_L, KV)[None, :, None]
    d3 = _last_ids(BLOCK_D, KV)[None, None, :]
    cache_mask = (h3 < H) & (d3 < D)
    k_base = k_ptr + b * stride_kb + h3 * stride_kh
    v_base = v_ptr + b * stride_vb + h3 * stride_vh
    # (GROUPS, GROUP): each CTA's 16 output columns, for the epilogue
    gs = gl.arange(0, BLOCK_N // GROUP, layout=gl.SliceLayout(1, gl.SliceLayout(0, EPI)))[:, None]
    rn = n0 + gs * GROUP + gl.arange(0, GROUP, layout=gl.SliceLayout(0, gl.SliceLayout(0, EPI)))[None, :]
    n_mask = rn < N
    if PREFETCH == 2:  # the lengths and x too: the tile stops at the row's older positions
        seq_len = gl.load(lens_ptr + b)
        res = gl.load(res_ptr + b * stride_rm + rn, mask=n_mask, other=0.0).to(gl.float32)
        older = cache_mask & (l3 < seq_len - 1)
        k = gl.load(k_base + l3 * stride_kl + d3, mask=older, other=0.0)
        v = gl.load(v_base + l3 * stride_vl + d3, mask=older, other=0.0)
    if PREFETCH == 1:  # the tile as allocated: rows past the length are masked after the wait
        k = gl.load(k_base + l3 * stride_kl + d3, mask=cache_mask & (l3 < L), other=0.0)
        v = gl.load(v_base + l3 * stride_vl + d3, mask=cache_mask & (l3 < L), other=0.0)
    if USE_PDL:
        gdc_wait()  # q, k_new, v_new are written by the kernel before
        if not EARLY_LAUNCH:
            gdc_launch_dependents()
    if PREFETCH < 2:
        seq_len = gl.load(lens_ptr + b)
        res = gl.load(res_ptr + b * stride_rm + rn, mask=n_mask, other=0.0).to(gl.float32)
    if PREFETCH == 0:
        older = cache_mask & (l3 < seq_len - 1)
        k = gl.load(k_base + l3 * stride_kl + d3, mask=older, other=0.0)
        v = gl.load(v_base + l3 * stride_vl + d3, mask=older, other=0.0)

    # (HEADS, BLOCK_D): the new token's query, key and value of each head
    h2 = gl.arange(0, HEADS, layout=gl.SliceLayout(1, gl.SliceLayout(1, KV)))[:, None]
    d2 = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, gl.SliceLayout(1, KV)))[None, :]
    hd_mask = (h2 < H) & (d2 < D)
    q = gl.load(q_ptr + b * stride_qb + h2 * stride_qh + d2, mask=hd_mask, other=0.0).to(gl.float32)
    k_new = gl.load(knew_ptr + b * stride_knb + h2 * stride_knh + d2, mask=hd_mask, other=0.0)
    v_new = gl.load(vnew_ptr + b * stride_vnb + h2 * stride_vnh + d2, mask=hd_mask, other=0.0)
    pos = seq_len - 1
    if n0 == 0:  # one cluster per row appends the new key and value
        gl.store(k_ptr + b * stride_kb + h2 * stride_kh + pos * stride_kl + d2, k_new.to(k_ptr.dtype.element_ty),
                 mask=hd_mask)
        gl.store(v_ptr + b * stride_vb + h2 * stride_vh + pos * stride_vl + d2, v_new.to(v_ptr.dtype.element_ty),
                 mask=hd_mask)

    # softmax over the positions < seq_len; row pos comes from registers (the cache may lag)
    is_new = l3 == pos
    kf = gl.where(is_new, k_new.to(gl.float32)[:, None, :], k.to(gl.float32))
    vf = gl.where(is_new, v_new.to(gl.float32)[:, None, :], gl.where(l3 < seq_len, v.to(gl.float32), 0.0))
    s = gl.sum((q * qk_scale)[:, None, :] * kf, axis=2)  # (HEADS, BLOCK_L), log2 domain
    s = gl.where(_mid_ids(BLOCK_L, KV)[None, :] < seq_len, s, float("-inf"))
    p = gl.exp2(s - gl.max(s, axis=1)[:, None])
    acc = gl.sum(p[:, :, None] * vf, axis=1)  # (HEADS, BLOCK_D)
    l_sum = gl.convert_layout(gl.sum(p, axis=1), gl.SliceLayout(1, gl.SliceLayout(1, KV)))
    o = (acc / l_sum[:, None]).to(y_ptr.dtype.element_ty).to(gl.float32)  # as decode_attention stores it

    o = gl.convert_layout(o, gl.SliceLayout(2, W))
    part = gl.sum(o[:, :, None] * w.to(gl.float32), axis=1)  # (HEADS, BLOCK_N): each head's share
    # across the cluster: CTA c gathers every head's c-th group of columns (distributed shared
    # memory), then adds the heads up in order
    part = gl.convert_layout(gl.reshape(part, (HEADS, BLOCK_N // GROUP, GROUP)), EPI)
    out = gl.sum(part, axis=0)  # (GROUPS, GROUP)
    if HAS_BIAS:
        out += gl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(gl.float32)
    y = (out + res).to(y_ptr.dtype.element_ty)
    gl.store(y_ptr + b * stride_ym + rn, y, mask=n_mask)
    if STATS_OUT:  # this CTA's statistics group (kernels._epilogue._store_row_stats)
        yf = gl.where(n_mask, y.to(gl.float32), 0.0)
        g = n0 // GROUP + gl.arange(0, BLOCK_N // GROUP, layout=gl.SliceLayout(1, gl.SliceLayout(0, EPI)))
        n_groups = gl.cdiv(N, GROUP)
        g_mask = g < n_groups
        gl.store(stats_ptr + b * stride_sm + g, gl.sum(yf, axis=1), mask=g_mask)
        gl.store(stats_ptr + b * stride_sm + n_groups + g, gl.sum(yf * yf, axis=1), mask=g_mask)


@_jit
def _attend_chunk(k_smem, v_smem, c0, qs, k_new, v_new, pos, seq_len, m_i, l_i, acc,
                  CH: gl.constexpr, KV: gl.constexpr):
    """Online-softmax update with positions c0 .. c0 + CH of every CTA's head, read from shared
    memory; row pos comes from registers, rows past it may hold anything."""
    offs = c0 + _mid_ids(CH, KV)
    l3 = offs[None, :, None]
    k = gl.where(l3 == pos, k_new[:, None, :], k_smem.slice(c0, CH, dim=1).load(KV).to(gl.float32))
    v = v_smem.slice(c0, CH, dim=1).load(KV).to(gl.float32)
    v = gl.where(l3 == pos, v_new[:, None, :], gl.where(l3 < pos, v, 0.0))
    s = gl.sum(qs[:, None, :] * k, axis=2)  # (HEADS, CH)
    s = gl.where(offs[None, :] < seq_len, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    alpha_d = gl.convert_layout(alpha, gl.SliceLayout(1, gl.SliceLayout(1, KV)))
    acc = acc * alpha_d[:, None] + gl.sum(p[:, :, None] * v, axis=1)
    return m_new, l_i, acc


@_jit
def _decode_attention_cluster_smem_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, knew_ptr, vnew_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, stats_ptr,
    M, N, D, L, H, qk_scale,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
    stride_knb, stride_knh, stride_vnb, stride_vnh, stride_wk, stride_wn, stride_rm, stride_ym, stride_sm,
    HAS_BIAS: gl.constexpr, STATS_OUT: gl.constexpr, USE_PDL: gl.constexpr, PREFETCH: gl.constexpr,
    EARLY_LAUNCH: gl.constexpr, HEADS: gl.constexpr, GROUP: gl.constexpr,
    BLOCK_L: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_N: gl.constexpr, CH: gl.constexpr, NC: gl.constexpr,
    KV: gl.constexpr, W: gl.constexpr, EPI: gl.constexpr, P2: gl.constexpr,
    S_KV: gl.constexpr, S_W: gl.constexpr, S_P: gl.constexpr,
):
    """The kernel above with the cache tile and W copied into shared memory (cp.async) before
    the wait, not into registers, and read back in chunks: a CTA takes few registers, so a
    cluster can start beside the previous kernel's programs."""
    if USE_PDL and EARLY_LAUNCH:
        gdc_launch_dependents()
    pid = gl.program_id(0)
    b = pid % M
    n0 = (pid // M) * BLOCK_N
    k_smem = gl.allocate_shared_memory(k_ptr.dtype.element_ty, [HEADS, BLOCK_L, BLOCK_D], S_KV)
    v_smem = gl.allocate_shared_memory(v_ptr.dtype.element_ty, [HEADS, BLOCK_L, BLOCK_D], S_KV)
    w_smem = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [HEADS, BLOCK_D, BLOCK_N], S_W)
    part_smem = gl.allocate_shared_memory(gl.float32, [HEADS, BLOCK_N], S_P)

    hw = _head_ids(HEADS, W)[:, None, None]
    dw = _mid_ids(BLOCK_D, W)[None, :, None]
    nw = n0 + _last_ids(BLOCK_N, W)[None, None, :]
    async_copy.async_load(w_smem, w_ptr + (hw * D + dw) * stride_wk + nw * stride_wn,
                                           mask=(hw < H) & (dw < D) & (nw < N))
    h3 = _head_ids(HEADS, KV)[:, None, None]
    l3 = _mid_ids(BLOCK_L, KV)[None, :, None]
    d3 = _last_ids(BLOCK_D, KV)[None, None, :]
    cache_mask = (h3 < H) & (d3 < D)
    k_ptrs = k_ptr + b * stride_kb + h3 * stride_kh + l3 * stride_kl + d3
    v_ptrs = v_ptr + b * stride_vb + h3 * stride_vh + l3 * stride_vl + d3
    gs = gl.arange(0, BLOCK_N // GROUP, layout=gl.SliceLayout(1, gl.SliceLayout(0, EPI)))[:, None]
    rn = n0 + gs * GROUP + gl.arange(0, GROUP, layout=gl.SliceLayout(0, gl.SliceLayout(0, EPI)))[None, :]
    n_mask = rn < N
    if PREFETCH == 2:
        seq_len = gl.load(lens_ptr + b)
        res = gl.load(res_ptr + b * stride_rm + rn, mask=n_mask, other=0.0).to(gl.float32)
        async_copy.async_load(k_smem, k_ptrs, mask=cache_mask & (l3 < seq_len - 1))
        async_copy.async_load(v_smem, v_ptrs, mask=cache_mask & (l3 < seq_len - 1))
    if PREFETCH == 1:
        async_copy.async_load(k_smem, k_ptrs, mask=cache_mask & (l3 < L))
        async_copy.async_load(v_smem, v_ptrs, mask=cache_mask & (l3 < L))
    async_copy.commit_group()
    if USE_PDL:
        gdc_wait()
        if not EARLY_LAUNCH:
            gdc_launch_dependents()
    if PREFETCH < 2:
        seq_len = gl.load(lens_ptr + b)
        res = gl.load(res_ptr + b * stride_rm + rn, mask=n_mask, other=0.0).to(gl.float32)
    if PREFETCH == 0:
        async_copy.async_load(k_smem, k_ptrs, mask=cache_mask & (l3 < seq_len - 1))
        async_copy.async_load(v_smem, v_ptrs, mask=cache_mask & (l3 < seq_len - 1))
        async_copy.commit_group()

    h2 = gl.arange(0, HEADS, layout=gl.SliceLayout(1, gl.SliceLayout(1, KV)))[:, None]
    d2 = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, gl.SliceLayout(1, KV)))[None, :]
    hd_mask = (h2 < H) & (d2 < D)
    qs = gl.load(q_ptr + b * stride_qb + h2 * stride_qh + d2, mask=hd_mask, other=0.0).to(gl.float32) * qk_scale
    k_new = gl.load(knew_ptr + b * stride_knb + h2 * stride_knh + d2, mask=hd_mask, other=0.0)
    v_new = gl.load(vnew_ptr + b * stride_vnb + h2 * stride_vnh + d2, mask=hd_mask, other=0.0)
    pos = seq_len - 1
    if n0 == 0:
        gl.store(k_ptr + b * stride_kb + h2 * stride_kh + pos * stride_kl + d2, k_new.to(k_ptr.dtype.element_ty),
                 mask=hd_mask)
        gl.store(v_ptr + b * stride_vb + h2 * stride_vh + pos * stride_vl + d2, v_new.to(v_ptr.dtype.element_ty),
                 mask=hd_mask)
    async_copy.wait_group(0)
    gl.barrier()  # every thread's copies in, for the whole CTA

    m_i = gl.full((HEADS,), float("-inf"), gl.float32, layout=gl.SliceLayout(1, gl.SliceLayout(2, KV)))
    l_i = gl.zeros((HEADS,), gl.float32, layout=gl.SliceLayout(1, gl.SliceLayout(2, KV)))
    acc = gl.zeros((HEADS, BLOCK_D), gl.float32, layout=gl.SliceLayout(1, KV))
    k_new = k_new.to(gl.float32)
    v_new = v_new.to(gl.float32)
    for c in gl.static_range(BLOCK_L // CH):
        if c * CH < seq_len:
            m_i, l_i, acc = _attend_chunk(k_smem, v_smem, c * CH, qs, k_new, v_new, pos, seq_len, m_i, l_i, acc,
                                          CH, KV)
    l_d = gl.convert_layout(l_i, gl.SliceLayout(1, gl.SliceLayout(1, KV)))
    o = (acc / l_d[:, None]).to(y_ptr.dtype.element_ty).to(gl.float32)
    o = gl.convert_layout(o, gl.SliceLayout(2, W))
    for j in gl.static_range(BLOCK_N // NC):
        w = w_smem.slice(j * NC, NC, dim=2).load(W).to(gl.float32)
        part_smem.slice(j * NC, NC, dim=1).store(gl.sum(o[:, :, None] * w, axis=1))
    gl.barrier()
    part = gl.convert_layout(gl.reshape(part_smem.load(P2), (HEADS, BLOCK_N // GROUP, GROUP)), EPI)
    out = gl.sum(part, axis=0)
    if HAS_BIAS:
        out += gl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(gl.float32)
    y = (out + res).to(y_ptr.dtype.element_ty)
    gl.store(y_ptr + b * stride_ym + rn, y, mask=n_mask)
    if STATS_OUT:
        yf = gl.where(n_mask, y.to(gl.float32), 0.0)
        g = n0 // GROUP + gl.arange(0, BLOCK_N // GROUP, layout=gl.SliceLayout(1, gl.SliceLayout(0, EPI)))
        n_groups = gl.cdiv(N, GROUP)
        g_mask = g < n_groups
        gl.store(stats_ptr + b * stride_sm + g, gl.sum(yf, axis=1), mask=g_mask)
        gl.store(stats_ptr + b * stride_sm + n_groups + g, gl.sum(yf * yf, axis=1), mask=g_mask)


@functools.cache
def layouts(w_k_contiguous):
    """(KV, W, EPI) distributed layouts: the head axis split over the cluster's 16 CTAs."""
    cga3 = [[1 << i, 0, 0] for i in range(LOG2_HEADS)]
    # 16-byte loads along D; a warp covers 4 positions x 64 dims, warps split the positions
    kv = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [1, WARPS, 1], [2, 1, 0], cga_layout=cga3)
    if w_k_contiguous:  # out-major weights (the model's): D is contiguous, reduced in-thread first
        w = gl.BlockedLayout([1, 8, 1], [1, 8, 4], [1, 1, WARPS], [1, 2, 0], cga_layout=cga3)
    else:
        w = gl.BlockedLayout([1, 1, 8], [1, 1, 32], [1, WARPS, 1], [2, 1, 0], cga_layout=cga3)
    # (HEADS, GROUPS, GROUP): the partials regrouped by columns, one 16-column group per CTA
    # with the heads across a warp's lanes, their sum is a few shuffles
    epi = gl.BlockedLayout([1, 1, 1], [16, 1, 2], [1, 1, WARPS], [0, 2, 1],
                           cga_layout=[[0, 1 << i, 0] for i in range(LOG2_HEADS)])
    return kv, w, epi


CH = 64  # cache positions a chunk of the shared-memory kernel's attention
NC = 64  # columns a chunk of its product
SMEM = os.environ.get("MINILLM_CLUSTER_SMEM", "1") != "0"


@functools.cache
def smem_layouts(w_k_contiguous):
    """(P2, S_KV, S_W, S_P): the partials' register layout and the shared-memory layouts."""
    cga2 = [[1 << i, 0] for i in range(LOG2_HEADS)]
    cga3 = [[1 << i, 0, 0] for i in range(LOG2_HEADS)]
    p2 = gl.BlockedLayout([1, 1], [1, 32], [1, WARPS], [1, 0], cga_layout=cga2)
    s_kv = gl.SwizzledSharedLayout(8, 1, 8, [2, 1, 0], cga_layout=cga3)
    s_w = gl.SwizzledSharedLayout(8, 1, 8, [1, 2, 0] if w_k_contiguous else [2, 1, 0], cga_layout=cga3)
    s_p = gl.SwizzledSharedLayout(1, 1, 1, [1, 0], cga_layout=cga2)
    return p2, s_kv, s_w, s_p


def _constexprs(w_k_contiguous, smem, **kw):
    kv, w, epi = layouts(w_k_contiguous)
    c = dict(kw, HEADS=HEADS, GROUP=GROUP, BLOCK_N=BLOCK_N, KV=kv, W=w, EPI=epi)
    if smem:
        p2, s_kv, s_w, s_p = smem_layouts(w_k_contiguous)
        c.update(CH=CH, NC=NC, P2=p2, S_KV=s_kv, S_W=s_w, S_P=s_p)
    return c


def compile_ahead(arch=90, *, prefetch=1, stats_out=False, early_launch=False, block_l=256, head_dim=64, smem=SMEM):
    """The kernel compiled for sm_`arch` without a GPU (CI's check; Triton's interpreter, which
    CI's tests otherwise run, cannot take Gluon): gpt2's layout, fp16, with dependent launch."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = _decode_attention_cluster_smem_kernel if smem else _decode_attention_cluster_kernel
    constexprs = _constexprs(True, smem, HAS_BIAS=True, STATS_OUT=stats_out, USE_PDL=True, PREFETCH=prefetch,
                             EARLY_LAUNCH=early_launch, BLOCK_L=block_l, BLOCK_D=head_dim)
    # as the JIT specializes a launch on the model's tensors: out-major W (stride 1 along K), and
    # pointers and sizes that are multiples of 16 (cp.async then copies 16 bytes at a time)
    constexprs["stride_wk"] = 1
    pointers = {"lens_ptr": "*i32", "stats_ptr": "*fp32"}
    names = kernel.arg_names
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "*fp16") if name.endswith("_ptr")
                 else "fp32" if name == "qk_scale" else "i32" for name in names}
    aligned = [(i,) for i, name in enumerate(names) if signature[name] != "constexpr" and name not in
               ("M", "H", "qk_scale", "lens_ptr", "stride_qh", "stride_knh", "stride_vnh")]
    src = GluonASTSource(kernel, signature=signature, constexprs=constexprs,
                         attrs={key: [["tt.divisibility", 16]] for key in aligned})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": WARPS, "num_ctas": HEADS})


# MINILLM_CLUSTER_MERGE=0 keeps the plain kernel where this one would run (A/B timing)
ENABLED = AVAILABLE and not INTERPRET and os.environ.get("MINILLM_CLUSTER_MERGE", "1") != "0"
MAX_CACHE = 256  # positions of the whole-cache tile each CTA holds in registers
_capable = {}


def covers(device, heads, head_dim, cache_len):
    """Whether the cluster kernel runs this call: Hopper or later, every head its own CTA, the
    whole cache one tile of at most 64-wide heads (254 registers a thread at 256 x 64)."""
    if not ENABLED or device.type != "cuda" or heads > HEADS or head_dim > 64 or cache_len > MAX_CACHE:
        return False
    if device not in _capable:
        import torch

        _capable[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return _capable[device]


def launch_cluster(q, k_cache, v_cache, seq_lens, k_new, v_new, weight, bias, residual, y, stats_out, qk_scale,
                   prefetch_mode, early_launch, pdl):
    """Launch the cluster kernel; the caller (decode_attention_proj) has checked every input."""
    B, H, D = q.shape
    N = weight.shape[1]
    block_l = max(16, triton.next_power_of_2(k_cache.shape[2]))
    block_d = max(16, triton.next_power_of_2(D))
    # cp.async copies 16 bytes at a time: the JIT must see every stride of a copied row a multiple of 16
    strides = (*k_cache.stride()[:3], *v_cache.stride()[:3], weight.stride(1), D)
    smem = SMEM and weight.stride(0) == 1 and all(st % 16 == 0 for st in strides)
    kernel = _decode_attention_cluster_smem_kernel if smem else _decode_attention_cluster_kernel
    launch(
        kernel, (B * triton.cdiv(N, BLOCK_N),),
        q, k_cache, v_cache, seq_lens, k_new, v_new, weight, bias if bias is not None else y, residual, y,
        stats_out if stats_out is not None else y,
        B, N, D, k_cache.shape[2], H, qk_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1), weight.stride(0), weight.stride(1), residual.stride(0), y.stride(0),
        stats_out.stride(0) if stats_out is not None else 0,
        **_constexprs(weight.stride(0) == 1, smem, HAS_BIAS=bias is not None, STATS_OUT=stats_out is not None,
                      USE_PDL=pdl, PREFETCH=prefetch_mode, EARLY_LAUNCH=bool(early_launch), BLOCK_L=block_l,
                      BLOCK_D=block_d),
        num_warps=WARPS, num_ctas=HEADS, launch_pdl=pdl,
    )
    return y
