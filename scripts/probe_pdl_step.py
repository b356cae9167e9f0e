"""Probe: a whole batch-1 decode step of GPT-2's architecture as session 106's chain of dependent
launches (scripts/probe_pdl_ring.py, its tensor-core form): per layer the first layernorm, qkv,
the decode attention, attn-out into the residual, the second layernorm, fc, GELU, mlp-out into the
residual; then the final layernorm and the lm_head (logits, no argmax).

Nothing is a launch of its own but the linears and the attention. A layernorm is folded into the
next linear's weights (--layernorm folded: x staged as it is; the attention launch takes LN1's
statistics and finishes q, k, v, fc and the head take theirs behind their first products) or
applied where that linear stages x (staged: statistics and normalizing between the wait and the
products). GELU is applied where mlp-out stages fc's output (its split-K sum is complete only
then). attn-out and mlp-out add their outputs into the residual stream by their atomics; each
program adds the biases of the row blocks whose first K chunk it holds, by one atomic. With
--sums fixed the split-K parts meet in fixed point instead (as the engine's kernels/_fixed_merge
does) and the program that completes a row block finishes it: the bias, fc's GELU, the residual's
add and the row block's statistics for the next layernorm, so that the step's bits do not depend
on the order of the parts. The weights are random (scripts/probe_stream_step.weights), the
arithmetic is real and checked against the same step in torch.

The question it answers: how far the 0.7 goal's 1,057 us at gpt2-xl is from this form's whole
step. Session 107 (bench/results/h200/session-107/): 1,263 us at first, 1,051-1,081 with the
defaults (layernorms folded, tiles by row block, GELU by tanh.approx, a tile's products issued
in a row with one wait; Triton 3.9, 1,070 under 3.6).

    python3 scripts/probe_pdl_step.py --model gpt2-xl --out DIR               # H100 / H200
    python3 scripts/probe_pdl_step.py --mma sync async --leave-out layernorm  # A/B in one process
    python3 scripts/probe_pdl_step.py --sums atomic fixed                     # the price of the same bits
"""
import argparse
import json
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from minillm.cli import _int_at_least  # noqa: E402
from minillm.config import PRESETS  # noqa: E402
from probe_pdl_ring import (BK, attend, floor_with_cache, launch_attention, launch_mma, make_caches,  # noqa: E402
                            mma_descriptors)
from pdl_step_checkpoint import checkpoint_step  # noqa: E402
from probe_stream_step import gpu_record, gpu_setup, tiles_arg, weights  # noqa: E402,F401 (weights: for the tests)

EPS = 1e-5
PLAIN, LAYERNORM, GELU, FOLDED, GELU_APPROX = 0, 1, 2, 3, 4  # how a linear stages x (the kernel's XFORM)
PARTS = ("layernorm", "gelu", "bias")
LAYERNORMS = ("staged", "folded")
ORDERS = ("rows", "chunks", "mixed")  # the kernel's ORDER: 0, 1, and 1 but the head's 0
GELUS = ("exact", "approx")
MMAS = ("sync", "async")  # the kernel's ASYNC
SUMS = ("atomic", "fixed")


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


def launch_linear(descs, arena, params, row, programs, stages, pdl, order=0, async_mma=False, fixed=None,
                  **compile_only):
    slab, start, N, K, in_off, out_off, xform, g_off, b_off, bias_off = row
    assert xform != LAYERNORM or b_off == g_off + K, "the kernel takes a layernorm's bias right after its weight"
    return launch_mma(descs[slab], arena[in_off:], arena[out_off:], start, N, K, programs, stages, 0, pdl, params,
                      xform, g_off, bias_off, EPS, order, async_mma, fixed, **compile_only)


def fixed_roles(n_rows):
    """For the fixed-point form, each launch's (finishing epilogue, the statistics slots it reads,
    the slots it writes) by its place in the plan (kind as plan_step orders them): slots 2l are
    the residual stream's before layer l's attention (0: x0's, set with it), 2l + 1 after its
    attn-out; the head reads 2L. The epilogues: 0 store, 1 GELU (fc: mlp-out then stages its
    input as it is), 2 the residual's add and statistics (attn-out, mlp-out)."""
    roles = []
    for i in range(n_rows):
        layer, kind = divmod(i, 5)
        if i == n_rows - 1:
            roles.append((0, 2 * layer, None))  # the head
        else:
            roles.append({0: (0, None, None), 1: (None, 2 * layer, None), 2: (2, None, 2 * layer + 1),
                          3: (1, 2 * layer + 1, None), 4: (2, None, 2 * layer + 2)}[kind])
    return roles


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
        w = slabs[slab][start:start + N].float()
        folded[slab][start:start + N] = (w * params[g_off:g_off + K]).half()
        c = w @ params[b_off:b_off + K] + (params[bias_off:bias_off + N] if bias_off >= 0 else 0)
        extra += [folded[slab][start:start + N].float().sum(1), c]
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
    (applied where the next linear stages x) or "folded" (into its weights, fold_layernorms);
    order: the linears' tiles by row block ("rows") or by K chunk ("chunks": x in fewer boxes of
    shared memory, more partial sums), or by K chunk but the head's ("mixed": its 50,257 logits
    take fewer); gelu: "exact" (tanh by exp2) or "approx" (the tanh.approx instruction);
    mlp_stages, qkv_stages: fc's and mlp-out's ring depth, qkv's (None: as the others'); mma: a
    tile's four wgmma each waited for ("sync") or issued in a row with one wait ("async"; four
    accumulators, or the wait a tile later, lost: session 107, calls 9-10); sums: the split-K
    parts meet by fp32 atomics ("atomic") or in fixed point, the last part's program finishing
    the outputs ("fixed": the same bits every run; GELU then at fc's finish, the layernorms'
    statistics from the residual writers')."""
    layernorm: str = "folded"
    order: str = "rows"
    gelu: str = "approx"
    mlp_stages: int | None = None
    qkv_stages: int | None = None
    mma: str = "async"
    sums: str = "atomic"

    def __post_init__(self):
        if self.sums == "fixed" and (self.layernorm, self.order) != ("folded", "rows"):
            raise ValueError("--sums fixed: takes --layernorm folded and --order rows")


def step_launcher(slabs, shapes, cfg, params, offs, final, caches, programs, stages, form=Form(), pdl=True,
                  leave_out=()):
    """(step, prep, arena, x0, the logits' offset): step runs prep (the residual stream set to
    x0, and the other outputs zeroed or x0's statistics set) then every launch."""
    C = cfg.n_embd
    rows, size = plan_step(shapes, C, cfg.n_head, offs, final)
    if form.layernorm == "folded":
        slabs, params, rows = fold_layernorms(slabs, params, rows)
    rows = leave_out_parts(rows, leave_out)
    fixed = form.sums == "fixed"
    if fixed:  # GELU at fc's finish instead of mlp-out's staging
        rows = [(*row[:6], PLAIN, *row[7:]) if row[0] != "attn" and row[6] == GELU else row for row in rows]
    elif form.gelu == "approx":
        rows = [(*row[:6], GELU_APPROX, *row[7:]) if row[0] != "attn" and row[6] == GELU else row for row in rows]
    device = slabs[0].device
    arena = torch.zeros(size, dtype=torch.float32, device=device)
    words = torch.zeros(size, dtype=torch.int64, device=device)  # zero between launches: finishers re-zero
    blocks = -(-C // 64)
    slots = torch.zeros(2 * cfg.n_layer + 1, 2 * blocks, device=device)
    x0 = torch.zeros(C, dtype=torch.float32, device=device)
    launches = []  # (row, ring depth, tile order, fixed-point arguments or None, slots or None)
    for i, (row, (epi, slots_in, slots_out)) in enumerate(zip(rows, fixed_roles(len(rows)))):
        head = i == len(rows) - 1
        kind = "head" if head else ("qkv", "attention", "attn-out", "fc", "mlp-out")[i % 5]  # as plan_step
        depth = {"qkv": form.qkv_stages, "fc": form.mlp_stages, "mlp-out": form.mlp_stages}.get(kind) or stages
        order = int(form.order == "chunks" or (form.order == "mixed" and not head))
        args = (words[row[5]:], slots[slots_in if slots_in is not None else 0], blocks if slots_in is not None else 0,
                slots[slots_out if slots_out is not None else 0], epi) if fixed and row[0] != "attn" else None
        attn_slots = (slots[slots_in], blocks) if fixed and row[0] == "attn" else None
        launches.append((row, depth, order, args, attn_slots))

    def prep():
        arena[:C].copy_(x0)
        if fixed:  # x0's statistics, as the embedding's launch would leave them: (sum, sum of squares) a block
            by_block = x0.view(blocks, 64)
            torch.sum(torch.stack([by_block, by_block.square()], 1), 2, out=slots[0].view(blocks, 2))
        else:
            arena[C:].zero_()

    def step():
        prep()
        for row, depth, order, args, attn_slots in launches:
            if row[0] == "attn":
                launch_attention(arena, row, caches, cfg.n_head, 0, pdl, params, EPS, attn_slots)
            else:
                launch_linear(descs, arena, params, row, programs, depth, pdl, order, form.mma == "async", args)
    descs = mma_descriptors(slabs)
    return step, prep, arena, x0, rows[-1][5]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-xl", choices=sorted(PRESETS), help="preset whose widths to use")
    ap.add_argument("--tiles", type=tiles_arg, nargs="+", default=[(64, 3)],
                    help="ROWSxSTAGES rings (64-row tiles: one warpgroup's wgmma)")
    ap.add_argument("--positions", type=_int_at_least(1), default=96, help="cached positions the attention reads")
    ap.add_argument("--layernorm", nargs="+", default=["folded"], choices=LAYERNORMS,
                    help="where the layernorms go: staged (at the next linear's staging, after the wait) or folded "
                         "(into its weights: the statistics needed only at its outputs)")
    ap.add_argument("--order", nargs="+", default=["rows"], choices=ORDERS,
                    help="the linears' tiles by row block (rows) or by K chunk (chunks: x in fewer shared-memory "
                         "boxes, a partial sum a tile), or by K chunk but the head's (mixed)")
    ap.add_argument("--gelu", nargs="+", default=["approx"], choices=GELUS,
                    help="GPT-2's GELU with tanh by exp2 (exact) or by the tanh.approx instruction (approx)")
    ap.add_argument("--mlp-stages", type=_int_at_least(1), nargs="+", default=[None],
                    help="fc's and mlp-out's ring depth (default: as --tiles says)")
    ap.add_argument("--qkv-stages", type=_int_at_least(1), nargs="+", default=[None],
                    help="qkv's ring depth (default: as --tiles says)")
    ap.add_argument("--mma", nargs="+", default=["async"], choices=MMAS,
                    help="a tile's four wgmma each waited for (sync) or issued in a row with one wait (async)")
    ap.add_argument("--sums", nargs="+", default=["atomic"], choices=SUMS,
                    help="split-K parts by fp32 atomics (atomic) or in fixed point, the last part's program "
                         "finishing the outputs (fixed: the same bits every run; with --layernorm folded, "
                         "--order rows)")
    ap.add_argument("--leave-out", nargs="+", default=[], choices=PARTS, metavar="PART",
                    help=f"also time the step without each of these ({', '.join(PARTS)}; timing only)")
    ap.add_argument("--checkpoint", type=Path, metavar="DIR",
                    help="a GPT-2 checkpoint (safetensors, HF layout) to run instead of --model's random weights: "
                         "the logits then checked against transformers'")
    ap.add_argument("--out", type=Path, help="folder for pdl-step-MODEL.json")
    args = ap.parse_args()
    if any(bn != 64 for bn, _ in args.tiles):
        ap.error("--tiles: the tensor-core form takes 64-row tiles (64xSTAGES)")
    try:
        forms = [Form(*f) for f in itertools.product(args.layernorm, args.order, args.gelu, args.mlp_stages,
                                                     args.qkv_stages, args.mma, args.sums)]
    except ValueError as e:
        ap.error(str(e))
    from minillm.benchutil import ms_graph, require_cuda

    if args.checkpoint:  # the logits to match: transformers'
        require_cuda("probe_pdl_step.py")
        try:
            cfg, slabs, shapes, params, offs, final, caches, x0, want = checkpoint_step(args.checkpoint, args.positions,
                                                                                         "cuda")
        except (OSError, ValueError) as e:
            ap.error(str(e).splitlines()[0])
        rec = gpu_record(str(args.checkpoint), slabs)
    else:  # the logits to match: the same step in torch
        cfg, slabs, shapes, x0, rec = gpu_setup(args.model, "probe_pdl_step.py")
        params, offs, final = step_params(cfg, "cuda")
        caches = make_caches(cfg, args.positions, "cuda")
        want = reference_step(slabs, shapes, params, offs, final, x0, caches, cfg.n_head)
    programs = rec["programs"]
    cache_bytes, floor_us = floor_with_cache(rec, cfg, args.positions)
    rec.update(positions=args.positions, cache_bytes=cache_bytes, floor_with_cache_us=round(floor_us, 2))
    variants = [(form, ()) for form in forms] + [(forms[0], (part,)) for part in args.leave_out]
    for bn, stages in args.tiles:
        for form, parts in variants:
            step, prep, arena, x_in, last = step_launcher(slabs, shapes, cfg, params, offs, final, caches, programs,
                                                          stages, form, leave_out=parts)
            x_in.copy_(x0)
            logits = []
            for _ in range(2):  # twice: do the logits keep their bits?
                step()
                torch.cuda.synchronize()
                logits.append(arena[last:last + cfg.vocab_size].clone())
            got = logits[0]
            check = dict(rel_err=((got - want).abs().max() / want.abs().max()).item(),
                         same_argmax=bool(got.argmax() == want.argmax()), same_bits=torch.equal(*logits))
            us = ms_graph([step]) * 1e3
            run = dict(tile=[bn, BK], stages=stages, **vars(form), left_out=list(parts), us=round(us, 2),
                       floor_fraction=round(floor_us / us, 3))
            if not parts:
                run["prep_us"] = round(ms_graph([prep]) * 1e3, 2)  # the step's own first launches, priced alone
                run.update(check)
            rec["runs"].append(run)
            print(json.dumps(run), flush=True)
    print(f"{rec['model']}: a whole step's floor {floor_us:.1f} us (weights and {args.positions} cached positions)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "checkpoint" if args.checkpoint else args.model
        (args.out / f"pdl-step-{name}.json").write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
