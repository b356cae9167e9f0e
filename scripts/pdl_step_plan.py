"""The plan of scripts/probe_pdl_step.py's whole decode step: the parameters' layout, each
launch in order, the step in torch (reference_step), how the step is built (Form) and what each
form changes in the plan (the layernorms folded into the weights, parts left out, the
fixed-point form's words and the most parts a sum takes). Plain torch and Python: the CPU tests
check all of it."""
from dataclasses import dataclass

import torch

from kernels._fixed_merge import FIXED_SCALE, FIXED_UNIT
from kernels import fold_layernorm
from pdl_ring_kernels import GRID32, SCALE32, UNIT32
from probe_common import attend
from probe_pdl_ring import BK, share

EPS = 1e-5
PLAIN, LAYERNORM, GELU, FOLDED, GELU_APPROX = 0, 1, 2, 3, 4  # how a linear stages x (the kernel's XFORM)
PARTS = ("layernorm", "gelu", "bias")
LAYERNORMS = ("staged", "folded")
ORDERS = ("rows", "chunks", "mixed")  # the kernel's ORDER: 0, 1, and 1 but the head's 0
GELUS = ("exact", "approx")
MMAS = ("sync", "async")  # the kernel's ASYNC
SUMS = ("atomic", "fixed", "fixed32", "grid")
WORD_BITS = {"atomic": 0, "fixed": 64, "fixed32": 32, "grid": GRID32.value}  # the kernels' FIXED
HEADS = ("full", "screened")
GUARDS = {"on": 3, "parts": 1, "reads": 2, "off": 0}  # int32's checks: the kernels' GUARD bits


def step_params(cfg, device, seed=2):
    """The layernorms' weights and biases and the linears' biases in one fp32 tensor, and where
    each is: per layer ln1, ln2 (weight, bias) and the qkv, attn-out, fc, mlp-out biases; ln_f."""
    C, at, offs = cfg.n_embd, 0, []
    for _ in range(cfg.n_layer):
        layer = {}
        for name, n in (("ln1_w", C), ("ln1_b", C), ("ln2_w", C), ("ln2_b", C), ("qkv", 3 * C), ("attn_out", C),
                        ("fc", 4 * C), ("mlp_out", C)):
            layer[name], at = at, at + n
        offs.append(layer)
    final = {"ln_w": at, "ln_b": at + C}
    g = torch.Generator(device=device).manual_seed(seed)
    p = torch.randn(at + 2 * C, device=device, generator=g) * 0.1
    for off in [o[k] for o in offs for k in ("ln1_w", "ln2_w")] + [final["ln_w"]]:
        p[off:off + C] += 1.0  # layernorm weights near 1
    return p, offs, final


def plan_step(shapes, C, heads, offs, final):
    """Each launch in order: a linear as (slab, first row, N, K, input offset, output offset,
    XFORM, ln weight offset, ln bias offset, bias offset or -1), or ("attn", layer, qkv's offset,
    its output's); and the arena's size. The residual stream is the arena's first C (attn-out and
    mlp-out add into it, so their output offset is 0)."""
    align = lambda v: (v + 31) // 32 * 32  # noqa: E731
    rows, at = [], align(C)

    def out(n):
        nonlocal at
        at, start = align(at + n), at
        return start

    for layer, o in enumerate(offs):
        q, y, h = out(3 * C), out(C), out(4 * C)
        (s0, r0, _, _), (s1, r1, _, _), (s2, r2, _, _), (s3, r3, _, _) = shapes[4 * layer:4 * layer + 4]
        rows += [(s0, r0, 3 * C, C, 0, q, LAYERNORM, o["ln1_w"], o["ln1_b"], o["qkv"]), ("attn", layer, q, y),
                 (s1, r1, C, C, y, 0, PLAIN, 0, 0, o["attn_out"]),
                 (s2, r2, 4 * C, C, 0, h, LAYERNORM, o["ln2_w"], o["ln2_b"], o["fc"]),
                 (s3, r3, C, 4 * C, h, 0, GELU, 0, 0, o["mlp_out"])]
    slab, start, V, _ = shapes[-1]
    rows.append((slab, start, V, C, 0, out(V), LAYERNORM, final["ln_w"], final["ln_b"], -1))
    return rows, at


def reference_step(slabs, shapes, params, offs, final, x0, caches, heads):
    """The step in torch: fp32 over the fp16 weights, each linear's input rounded to fp16 (as the
    tensor cores read it); the logits."""
    C = x0.numel()
    ln = lambda v, w, b: torch.nn.functional.layer_norm(v, (C,), params[w:w + C], params[b:b + C], EPS)  # noqa: E731
    lin = lambda i, v: slabs[shapes[i][0]][shapes[i][1]:shapes[i][1] + shapes[i][2]].float() @ v.half().float()  # noqa
    r = x0.float().clone()
    for layer, o in enumerate(offs):
        qkv = lin(4 * layer, ln(r, o["ln1_w"], o["ln1_b"])) + params[o["qkv"]:o["qkv"] + 3 * C]
        y = attend(qkv, *caches[layer], heads)
        r = r + lin(4 * layer + 1, y) + params[o["attn_out"]:o["attn_out"] + C]
        h = lin(4 * layer + 2, ln(r, o["ln2_w"], o["ln2_b"])) + params[o["fc"]:o["fc"] + 4 * C]
        g = torch.nn.functional.gelu(h, approximate="tanh")
        r = r + lin(4 * layer + 3, g) + params[o["mlp_out"]:o["mlp_out"] + C]
    return lin(len(shapes) - 1, ln(r, final["ln_w"], final["ln_b"]))


def most_parts(N, K, programs, order):
    """The most parts any output of ring_linear_mma_kernel's sum gets: the bias and a partial from
    each program whose tiles touch its row block (order 0), or one a tile (order 1)."""
    kt, rb = -(-K // BK), -(-N // 64)
    if order == 1:
        return kt + 1
    parts = [1] * rb
    for pid in range(programs):
        t0, n = share(rb * kt, programs, pid)
        for b in range(t0 // kt, (t0 + n - 1) // kt + 1) if n else ():
            parts[b] += 1
    return max(parts)


def to_words(x, bits=64):
    """fp32 activations as a fixed-point form's words: int64 in units of FIXED_UNIT, int32 in
    2**-16 (pdl_ring_kernels' _to_word), truncated toward zero as the kernels convert them; or
    (GRID32) fp32 truncated onto the int32 words' grid."""
    if bits == 64:
        return (x.float() * FIXED_SCALE.value).to(torch.int64)
    if bits == GRID32.value:
        return torch.trunc(x.float() * SCALE32.value) * UNIT32.value
    # saturating as the GPU's conversion does, so that the readers' guard sees what does not fit
    return (x.float() * SCALE32.value).clamp(-2.0 ** 31, 2.0 ** 31 - 128).to(torch.int32)


def from_words(words):
    """The words as fp32, rounded once as the kernels read them (fp32 on the grid: a copy)."""
    if words.dtype == torch.float32:
        return words.clone()
    return words.to(torch.float32) * (FIXED_UNIT if words.dtype == torch.int64 else UNIT32).value


def fold_layernorms(slabs, params, rows):
    """Each layernorm folded into the linear after it: W' = W diag(g) in fp16 (the weights then
    streamed), u = W' 1 and c = W b + bias per output (appended to the parameters), so that
    W LN(x) + bias = rstd (W' x - mean u) + c: x is staged as it is, with no weights or
    statistics between the wait and the products. qkv's outputs are finished by the attention
    launch after it (a program a head: the statistics taken 25 times, not 132), the others' by
    the linear itself. The slabs (a copy where any row changed), the parameters and the plan."""
    folded, extra, at, plan = list(slabs), [], params.numel(), []
    pending = None  # qkv's (u, c) offsets, for the attention after it
    for i, row in enumerate(rows):
        if row[0] == "attn":
            plan.append((*row, *pending) if rows[i - 1][6] == LAYERNORM else row)
            continue
        if row[6] != LAYERNORM:
            plan.append(row)
            continue
        slab, start, N, K, in_off, out_off, _, g_off, b_off, bias_off = row
        if folded[slab] is slabs[slab]:
            folded[slab] = slabs[slab].clone()
        # the engine's fold, on the rows as (K, N): g * W in fp16, b @ W + bias and the column sums in fp32
        w, c, u = fold_layernorm(slabs[slab][start:start + N].t(), params[bias_off:bias_off + N] if bias_off >= 0
                                 else None, params[g_off:g_off + K], params[b_off:b_off + K])
        folded[slab][start:start + N] = w.t()
        extra += [u, c]
        if i + 1 < len(rows) and rows[i + 1][0] == "attn":  # qkv: raw, finished by the attention
            plan.append((slab, start, N, K, in_off, out_off, PLAIN, 0, 0, -1))
            pending = (at, at + N)
        else:
            plan.append((slab, start, N, K, in_off, out_off, FOLDED, at, 0, at + N))
        at += 2 * N
    return folded, torch.cat([params, *extra]), plan


def leave_out_parts(rows, parts):
    """The plan with parts left out, to price each (timing only: the logits are then wrong):
    "layernorm" and "gelu" stage x as it is (the attention then takes qkv's outputs as they
    are), "bias" adds none."""
    plain = {LAYERNORM, FOLDED} if "layernorm" in parts else set()
    plain |= {GELU} if "gelu" in parts else set()
    return [(row[:4] if plain & {LAYERNORM} else row) if row[0] == "attn" else
            (*row[:6], PLAIN if row[6] in plain else row[6], *row[7:9], -1 if "bias" in parts else row[9])
            for row in rows]


@dataclass(frozen=True)
class Form:
    """How the step is built (the defaults: the fastest seen, session 107). layernorm: "staged"
    (applied where the next linear stages x) or "folded" (into its weights, fold_layernorms;
    its statistics passed on from the chunks of x that qkv and fc stage, so that mlp-out
    finished fc, lost 30-50 us: the statistics' load after mlp-out's wait, session 108, call 5);
    order: the linears' tiles by row block ("rows") or by K chunk ("chunks": x in fewer boxes of
    shared memory, more partial sums), or by K chunk but the head's ("mixed": its 50,257 logits
    take fewer); gelu: "exact" (tanh by exp2) or "approx" (the tanh.approx instruction);
    mlp_stages, qkv_stages: fc's and mlp-out's ring depth, qkv's (None: as the others'); mma: a
    tile's four wgmma each waited for ("sync") or issued in a row with one wait ("async"; four
    accumulators, or the wait a tile later, lost: session 107, calls 9-10; a row block's tiles
    chained with a wait only where a ring slot is refilled or the sum taken out gained -7 to +4
    us with fp32 atomics, -20 to +4 with int32 words: session 110, call 7, the code at 0a77ffa);
    sums: the split-K parts and biases added by fp32 atomics ("atomic"), or as fixed-point
    words with every activation kept as such, so that the step's bits are the same every run:
    int64 ("fixed", kernels/_fixed_merge's units: 120-160 us slower) or int32 in units of 2**-16
    ("fixed32": fp32's bytes, 9-26 us slower unguarded, 18-32 guarded, session 109; values must
    stay below 2**15: a flag rises where they might not, pdl_ring_kernels' PART32 and READ32),
    or fp32 kept on int32's grid ("grid": each part truncated onto multiples of 2**-16 before its
    fp32 atomic, so that sums below 2**8 are exact; past that they round, with no wrap to guard;
    6-17 us over fp32 atomics, 22-46 under guarded int32, session 112). The fixed-point forms'
    bits are the same only for one split of K over programs (each part is truncated).
    The last part's program finishing each output, as kernels/_fixed_merge does, took
    1,235-1,285 us against 1,089-1,095 (session 108, call 1). head: the probe's own lm_head,
    every logit ("full"), or the engine's greedy head after the step's launches ("screened":
    kernels.screened_argmax, the argmax key from an int8 copy of the head, about half its bytes;
    layernorms folded, fp32 (atomic, grid) or int32 sums); guard: int32's checks, "on" (both), or
    to price each, "parts" (a part or bias added), "reads" (the residual stream where a layernorm
    reads it), "off"."""
    layernorm: str = "folded"
    order: str = "rows"
    gelu: str = "approx"
    mlp_stages: int | None = None
    qkv_stages: int | None = None
    mma: str = "async"
    sums: str = "atomic"
    head: str = "full"
    guard: str = "on"
