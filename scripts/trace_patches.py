"""The text patches of scripts/trace_decode.py: the `%globaltimer` helpers and, for each traced
decode kernel file, the anchors where its timers and its record store go (each anchor must
occur once; tests/test_trace_decode.py checks that they do and that each record call lies inside
its kernel). --stamp moves a kernel's second stamp from its weights' arrival to a later point."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HELPERS = '''

@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _now_after(v):  # the clock once v (fp32) is computed
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,f", [v], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _record(trace_ptr, idx, t0, t1, t2):
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    t3 = _now()
    rec = trace_ptr + idx * 5
    tl.store(rec, smid.to(tl.int64))
    tl.store(rec + 1, t0)
    tl.store(rec + 2, t1)
    tl.store(rec + 3, t2)
    tl.store(rec + 4, t3)

'''
FIELDS = 5  # sm, start, weights in, wait passed, end
MAX_SMS = 1024  # an SM id at or past this is no record
SUM_W = "    t1 = _now_after(tl.sum(tl.sum(w.to(tl.float32), axis=1), axis=0))\n"

# (file, [(anchor, replacement)]): every anchor must occur in the kernel file
PATCHES = {
    "gemv": [
        ("from .gemv_fma import fma_config, gemv_fma\n", "from .gemv_fma import fma_config, gemv_fma\n" + HELPERS),
        ("STORE_Y: tl.constexpr,\n):", "STORE_Y: tl.constexpr, trace_ptr,\n):"),
        ("    pid_k = tl.program_id(1)  # the chunk, with SPLIT\n",
         "    pid_k = tl.program_id(1)  # the chunk, with SPLIT\n    t0 = _now()\n"),
        ("    x_rows = x_ptr + rm[:, None] * stride_xm\n", "    t2 = _now()\n" + SUM_W + "    x_rows = x_ptr + rm[:, None] * stride_xm\n"),
        ("\n\ndef weight_descriptor(",
         "    _record(trace_ptr, pid + pid_k * tl.num_programs(0), t0, t1, t2)\n\n\ndef weight_descriptor("),
    ],
    "gemv_slab": [  # (the pipelined loop loads its weights after the wait: "weights in" is the wait there)
        ("from ._tuning import env_int, is_hopper, launch, use_pdl\n",
         "from ._tuning import env_int, is_hopper, launch, use_pdl\n" + HELPERS),
        ("L2_BYTES: tl.constexpr,\n):", "L2_BYTES: tl.constexpr, trace_ptr,\n):"),
        ("    n0 = tl.program_id(0) * BLOCK_N\n", "    n0 = tl.program_id(0) * BLOCK_N\n    t0 = _now()\n"),
        ("    x_rows = x_ptr + rm[:, None] * stride_xm\n",
         "    t2 = _now()\n    t1 = t2\n    if not PIPELINED:\n    " + SUM_W.replace("w.to", "w0.to")
         + "    x_rows = x_ptr + rm[:, None] * stride_xm\n"),
        ("\n\ndef pipelined_stages(",
         "    _record(trace_ptr, tl.program_id(0) + group * tl.num_programs(0), t0, t1, t2)\n"
         "\n\ndef pipelined_stages("),
    ],
    "gemv_fma": [
        ("from .activations import _apply_activation\n", "from .activations import _apply_activation\n" + HELPERS),
        (" PAD_FOLD: tl.constexpr,\n):", " PAD_FOLD: tl.constexpr, trace_ptr,\n):"),
        ("    pid = tl.program_id(0)\n", "    pid = tl.program_id(0)\n    t0 = _now()\n"),
        ("    x_ptrs = x_ptr + row", "    t2 = _now()\n" + SUM_W + "    x_ptrs = x_ptr + row"),
        ("    tl.store(y_ptr + row * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)\n",
         "    tl.store(y_ptr + row * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)\n"
         "    _record(trace_ptr, pid, t0, t1, t2)\n"),
    ],
    "vocab_fma": [
        ("from .gemv_fma import VOCAB_N, _row_dot, _row_sums, pad_fold\n",
         "from .gemv_fma import VOCAB_N, _row_dot, _row_sums, pad_fold\n" + HELPERS),
        ("STORE_Y: tl.constexpr, PAD_FOLD: tl.constexpr,\n):",
         "STORE_Y: tl.constexpr, PAD_FOLD: tl.constexpr, trace_ptr,\n):"),
        ("    pid = tl.program_id(0)\n", "    pid = tl.program_id(0)\n    t0 = _now()\n"),
        ("    xf = tl.load(x_ptr + rk", "    t2 = _now()\n" + SUM_W + "    xf = tl.load(x_ptr + rk"),
        ('        tl.atomic_max(key_ptr, _argmax_key(vmax, col), sem="relaxed")\n',
         '        tl.atomic_max(key_ptr, _argmax_key(vmax, col), sem="relaxed")\n    _record(trace_ptr, pid, t0, t1, t2)\n'),
    ],
    # the screened lm_head: its second stamp is its stream's end (the best lower end known), not
    # a weights' arrival; from there to its end are the atomic and the exact columns (the tail)
    "vocab_screen": [
        ("_block_logits, fitted_programs\n", "_block_logits, fitted_programs\n" + HELPERS),
        (" X_UNIT: tl.constexpr, ROW_RADIX: tl.constexpr,\n):",
         " X_UNIT: tl.constexpr, ROW_RADIX: tl.constexpr, trace_ptr,\n):"),
        ("    pid = tl.program_id(0)\n", "    pid = tl.program_id(0)\n    t0 = _now()\n"),
        ("    rk = tl.arange(0, BLOCK_K)\n", "    t2 = _now()\n    rk = tl.arange(0, BLOCK_K)\n"),
        ("    # the upper ends back", "    t1 = _now_after(best_lower)\n    # the upper ends back"),
        ('    if found | not_finite:\n        tl.atomic_max(key_ptr, _argmax_key(vmax, col), sem="relaxed")\n',
         '    if found | not_finite:\n        tl.atomic_max(key_ptr, _argmax_key(vmax, col), sem="relaxed")\n'
         '    _record(trace_ptr, pid, t0, t1, t2)\n'),
    ],
    "decode_attention": [
        ("from ._workspace import arrival_counters\n", "from ._workspace import arrival_counters\n" + HELPERS),
        ("TMA: tl.constexpr,\n):", "TMA: tl.constexpr, trace_ptr,\n):"),
        ("    pid_s = tl.program_id(1)\n", "    pid_s = tl.program_id(1)\n    t0 = _now()\n"),
        ("    seq_len = tl.load(lens_ptr + b)\n", "    t2 = _now()\n    t1 = t2\n    seq_len = tl.load(lens_ptr + b)\n"),
        ("\n\ndef _tma_ok(", "    _record(trace_ptr, pid_bh + pid_s * tl.num_programs(0), t0, t1, t2)\n\n\ndef _tma_ok("),
    ],
    "decode_attention_proj": [
        ("from .linear import linear\n", "from .linear import linear\n" + HELPERS),
        ("tl.constexpr,\n):", "tl.constexpr, trace_ptr,\n):"),  # the kernel's last parameter, whichever
        ("    h = tl.program_id(1)  # the head: this program's chunk of the projection's K\n",
         "    h = tl.program_id(1)  # the head: this program's chunk of the projection's K\n    t0 = _now()\n"),
        ("    pos = seq_len - 1\n", "    t2 = _now()\n" + SUM_W + "    pos = seq_len - 1\n"),
        ("\n\ndef decode_attention_proj(",
         "    _record(trace_ptr, pid + h * tl.num_programs(0), t0, t1, t2)\n\n\ndef decode_attention_proj("),
    ],
}


# --stamp: where the fused attention launch's second stamp goes in place of its weights'
# arrival: "proj-q" once q, k_new and v_new are in, "attend" once its head's attention output is
# computed, "merge" once the projection's partial is (just before the heads' merge; from there to
# the program's end is the merge and the epilogue)
PROJ_WAIT = "    t2 = _now()\n" + SUM_W
Q_IN = "    t1 = _now_after(tl.sum(q + k_new.to(tl.float32) + v_new.to(tl.float32), axis=0))\n"  # either attention's
PROJ_APPEND = "    if pid_n == 0:  # one program per (row, head) appends"
STAMPS = {
    "proj-q": [(PROJ_APPEND, Q_IN + PROJ_APPEND)],
    "attend": [("    part = tl.sum(o[:, None]", "    t1 = _now_after(tl.sum(o, axis=0))\n"
                                               "    part = tl.sum(o[:, None]")],
    "merge": [("    finish = True\n", "    t1 = _now_after(tl.sum(part, axis=0))\n    finish = True\n")],
}
# --stamp products: the whole-slab GEMV's second stamp goes where its products are done, before a
# group program's merge (from there to its end: the merge and, for the last of a column block,
# the epilogue); the other kernels keep their weights' stamp
SLAB_WAIT = "    t2 = _now()\n    t1 = t2\n    if not PIPELINED:\n    " + SUM_W.replace("w.to", "w0.to")
SLAB_STAMPS = {
    "products": [("    finish = True\n", "    t1 = _now_after(tl.sum(tl.sum(acc, axis=1), axis=0))\n"
                                          "    finish = True\n")],
}
# --stamp attn-q / attn-first / attn-loop: the separate decode attention's second stamp (at its
# wait by default) goes where q, k_new and v_new are in (the new row stored), where the tiles read
# before the wait are attended, or where the loop over the later tiles is done (before the output's
# store, or a split's merge)
ATTN_WAIT = "    t2 = _now()\n    t1 = t2\n"
ATTN_STAMPS = {
    "attn-q": [("    first = start\n", Q_IN + "    first = start\n")],
    "attn-first": [("    # LOOP_STAGES > 1: Triton", "    t1 = _now_after(l_i)\n    # LOOP_STAGES > 1: Triton")],
    "attn-loop": [("    o_ptrs = o_ptr + b * stride_ob",
                   "    t1 = _now_after(l_i)\n    o_ptrs = o_ptr + b * stride_ob")],
}
# kernel -> (its wait's stamp text, whose "t1 = ..." the moved stamp replaces; its stamps)
MOVED_STAMPS = {"decode_attention_proj": (PROJ_WAIT, STAMPS), "gemv_slab": (SLAB_WAIT, SLAB_STAMPS),
                "decode_attention": (ATTN_WAIT, ATTN_STAMPS)}


def patched_source(name, stamp="weights"):
    src = (ROOT / "kernels" / f"{name}.py").read_text()
    patches = PATCHES[name]
    wait, stamps = MOVED_STAMPS.get(name, ("", {}))
    if stamp in stamps:  # the wait's stamp alone there, t1 later
        patches = [(a, n.replace(wait, "    t2 = _now()\n")) for a, n in patches] + stamps[stamp]
    for anchor, new in patches:
        if src.count(anchor) != 1:
            raise RuntimeError(f"trace_decode: kernels/{name}.py has {src.count(anchor)} copies of the anchor "
                               f"{anchor.strip()[:60]!r}, expected 1: update PATCHES")
        src = src.replace(anchor, new)
    return src
