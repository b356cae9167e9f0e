"""Probe: a whole batch-1 decode step of GPT-2's architecture as session 106's chain of dependent
launches (scripts/probe_pdl_ring.py, its tensor-core form): per layer the first layernorm, qkv,
the decode attention, attn-out into the residual, the second layernorm, fc, GELU, mlp-out into the
residual; then the final layernorm and the lm_head (logits, no argmax; or with --head screened
the engine's greedy head, kernels.screened_argmax, the argmax alone).

Nothing is a launch of its own but the linears and the attention. A layernorm is folded into the
next linear's weights (--layernorm folded: x staged as it is; the attention launch takes LN1's
statistics and finishes q, k, v, fc and the head take theirs behind their first products) or
applied where that linear stages x (staged: statistics and normalizing between the wait and the
products). GELU is applied where mlp-out stages fc's output (its split-K sum is complete only
then). attn-out and mlp-out add their outputs into the residual stream by their atomics; each
program adds the biases of the row blocks whose first K chunk it holds, by one atomic. With
--sums fixed (fixed32) every activation is an int64 (int32) fixed-point word and the atomics add
integers, whose sums do not depend on the order the parts arrive in: the step's bits are the
same every run. --sums grid keeps fp32 activations on int32's grid, each part truncated onto it
before its fp32 atomic: the same bits while the sums stay below 2**8, with no conversions and no
guard. The weights are random (scripts/probe_common.weights), the arithmetic is
real and checked against the same step in torch.

The question it answers: how far the 0.7 goal's 1,057 us at gpt2-xl is from this form's whole
step. Where it stands (Triton 3.6, screened head; each session's steps: docs/performance.md,
sessions 107-112): fp32 atomics 1,062-1,099 us, their last bits varying from run to run; the
same bits every run with fp32 on int32's grid 1,093-1,098, guarded int32 words 1,112-1,144,
int64 words 120-160 us more; the engine's own step 1,177-1,199.
--checkpoint runs a real GPT-2 checkpoint's weights and checks the logits against transformers'.

    python3 scripts/probe_pdl_step.py --model gpt2-xl --out DIR               # H100 / H200
    python3 scripts/probe_pdl_step.py --mma sync async --leave-out layernorm  # A/B in one process
    python3 scripts/probe_pdl_step.py --sums atomic fixed32 --head screened   # the price of the same bits
    python3 scripts/probe_pdl_step.py --sums atomic grid fixed32 --head screened
    python3 scripts/probe_pdl_step.py --head screened --copies 4              # the weights' placement
"""
import argparse
import json
import itertools
import sys
from collections import namedtuple
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from minillm.cli import _int_at_least  # noqa: E402
from minillm.config import PRESETS  # noqa: E402
from kernels.argmax_key import EMPTY, argmax_index  # noqa: E402
from probe_pdl_ring import BK, launch_attention, launch_mma, mma_descriptors  # noqa: E402
from pdl_ring_kernels import MAX_PARTS32, UNIT32  # noqa: E402
from pdl_step_checkpoint import checkpoint_step  # noqa: E402
# the plan's names, for the tests too (F401)
from pdl_step_plan import (EPS, FOLDED, GELU, GELU_APPROX, GELUS, GUARDS, HEADS, LAYERNORM, LAYERNORMS, MMAS,  # noqa: E402,F401
                           ORDERS, PARTS, PLAIN, SUMS, Form, fold_layernorms, from_words, leave_out_parts,
                           most_parts, reference_step, WORD_BITS, plan_step, step_params, to_words)
from probe_common import (floor_with_cache, gpu_record, gpu_setup, make_caches, rel_err, weights,  # noqa: E402,F401
                          write_record)  # (weights: the tests')
from probe_stream_step import tiles_arg  # noqa: E402


def launch_linear(descs, arena, params, row, programs, stages, pdl, order=0, async_mma=False, fixed=0,
                  flag=None, guard=3, **compile_only):
    """launch_mma of a plan's row (plan_step's) on the activations `arena`."""
    slab, start, N, K, in_off, out_off, xform, g_off, b_off, bias_off = row
    assert xform != LAYERNORM or b_off == g_off + K, "the kernel takes a layernorm's bias right after its weight"
    return launch_mma(descs[slab], arena[in_off:], arena[out_off:], start, N, K, programs, stages, 0, pdl, params,
                      xform, g_off, bias_off, EPS, order, async_mma, fixed, flag, guard,
                      **compile_only)


# step runs prep (the residual stream set to x0, the other outputs zeroed) then every launch;
# logits() reads the head's outputs as fp32 (None from the screened head), token() the argmax;
# x0 is the residual stream's input (fp32, for the caller to fill); flagged() says whether the
# int32 words' guard was raised in the last step (None for the other forms); arena: the
# activations (for their address)
StepRun = namedtuple("StepRun", "step prep logits x0 flagged token arena")


def screened_head(slabs, params, row, C, device, fixed, shared):
    """The engine's greedy head on the probe's folded lm_head row: (launch(x), keys), x the
    residual stream (fp32, or int32 words: fixed 32). The argmax key of the logits goes into
    keys (reset to EMPTY by the caller before each step). The screen is kept in shared."""
    from kernels import screen_head, screened_argmax

    slab, start, V, _, _, _, _, u_off, _, c_off = row
    weight = slabs[slab][start:start + V].t()  # (C, V) out-major, as the engine's lm_head
    u, c = params[u_off:u_off + V], params[c_off:c_off + V]
    if "screen" not in shared:
        shared["screen"] = screen_head(weight, c, u)
    screen = shared["screen"]
    if screen is None:
        raise ValueError(f"--head screened: the screen takes a vocabulary of at least 16384 columns and "
                         f"a width up to 2048 divisible by 4, got {V} x {C}")
    keys = torch.full((1,), EMPTY, dtype=torch.int64, device=device)
    upper = torch.empty(screen.meta.shape[1], dtype=torch.float32, device=device)
    unit = UNIT32.value if fixed == 32 else None
    return (lambda x: screened_argmax(x.view(1, C), weight, c, u, EPS, screen, keys, upper, unit)), keys


def step_launcher(slabs, shapes, cfg, params, offs, final, caches, programs, stages, form=Form(), pdl=True,
                  leave_out=(), arena_pad=0, shared=None):
    """A StepRun of the whole step in `form`. ValueError where a sum could have more parts than
    the int32 words' guard covers, or the screened head cannot run. arena_pad: the activations
    start that many words (a multiple of 32) into their buffer. shared: a dict in which the
    folded weights and the head's screen are kept for the next launcher on the same weights,
    so that forms compared share their addresses (folded copies alternate between two
    allocations otherwise)."""
    shared = {} if shared is None else shared
    C = cfg.n_embd
    if form.head == "screened" and (form.layernorm != "folded" or form.sums == "fixed"):
        raise ValueError("--head screened: takes --layernorm folded and --sums atomic, grid or fixed32 (it reads "
                         "the folded head and the residual stream in fp32 or int32 words)")
    rows, size = plan_step(shapes, C, cfg.n_head, offs, final)
    if form.layernorm == "folded":
        if "folded" not in shared:
            shared["folded"] = fold_layernorms(slabs, params, rows)
        slabs, params, rows = shared["folded"]
    rows = leave_out_parts(rows, leave_out)
    if form.gelu == "approx":
        rows = [(*row[:6], GELU_APPROX, *row[7:]) if row[0] != "attn" and row[6] == GELU else row for row in rows]
    fixed, guard = WORD_BITS[form.sums], GUARDS[form.guard]
    device = slabs[0].device
    # the activations, then the int32 words' guard flag (zeroed with them)
    if arena_pad % 32:
        raise ValueError(f"--arena-pad: expected a multiple of 32 words, got {arena_pad}")
    words = torch.zeros(arena_pad + size + 1, dtype={32: torch.int32, 64: torch.int64}.get(fixed, torch.float32),
                        device=device)
    arena = words[arena_pad:]
    flag = arena[size:] if fixed == 32 else None
    x0 = torch.zeros(C, dtype=torch.float32, device=device)
    launches = []  # (row, ring depth, tile order)
    for i, row in enumerate(rows):
        kind = "head" if i == len(rows) - 1 else ("qkv", "attention", "attn-out", "fc", "mlp-out")[i % 5]  # plan_step's
        depth = {"qkv": form.qkv_stages, "fc": form.mlp_stages, "mlp-out": form.mlp_stages}.get(kind) or stages
        order = int(form.order == "chunks" or (form.order == "mixed" and kind != "head"))
        parts = most_parts(row[2], row[3], programs, order) if fixed == 32 and row[0] != "attn" else 0
        if parts > MAX_PARTS32:
            raise ValueError(f"--sums fixed32: {kind}'s sums take up to {parts} parts, more than the guard covers "
                             f"({MAX_PARTS32}); take --order rows or --sums fixed")
        launches.append((row, depth, order))
    head, keys = None, None
    if form.head == "screened":  # the engine's head in place of the probe's last launch
        head, keys = screened_head(slabs, params, rows[-1], C, device, fixed, shared)
        launches.pop()

    def prep():
        arena[:C].copy_(to_words(x0, fixed) if fixed else x0)
        arena[C:].zero_()
        if keys is not None:
            keys.fill_(EMPTY)

    def step():
        prep()
        for row, depth, order in launches:
            if row[0] == "attn":
                launch_attention(arena, row, caches, cfg.n_head, 0, pdl, params, EPS, fixed, flag, guard)
            else:
                launch_linear(descs, arena, params, row, programs, depth, pdl, order, form.mma == "async", fixed,
                              flag, guard)
        if head:
            head(arena[:C])

    def logits():
        if head:
            return None
        out = arena[rows[-1][5]:rows[-1][5] + cfg.vocab_size]
        return from_words(out) if fixed else out.clone()

    def token():
        return int(argmax_index(keys).item()) if head else int(logits().argmax().item())

    def flagged():
        return None if flag is None else bool(flag.item())
    descs = mma_descriptors(slabs)
    return StepRun(step, prep, logits, x0, flagged, token, arena)


def time_form(slabs, shapes, cfg, params, offs, final, caches, programs, stages, form, parts, pad, shared, x0, want,
              floor_us):
    """One form's record: its time (a CUDA graph's replays), where its weights and activations
    lie, and (with no parts left out) its check against `want` over three runs."""
    from minillm.benchutil import ms_graph

    built = step_launcher(slabs, shapes, cfg, params, offs, final, caches, programs, stages, form, leave_out=parts,
                          arena_pad=pad, shared=shared)
    built.x0.copy_(x0)
    runs, tokens = [], []
    for _ in range(3):  # do the logits keep their bits from run to run?
        built.step()
        runs.append(built.logits())
        tokens.append(built.token())
    us = ms_graph([built.step]) * 1e3
    slab0 = shared["folded"][0][0] if "folded" in shared else slabs[0]
    run = dict(**vars(form), left_out=list(parts), arena_pad=pad, arena_at=hex(built.arena.data_ptr()),
               weights_at=hex(slab0.data_ptr()),
               params_at=hex((shared["folded"][1] if "folded" in shared else params).data_ptr()), us=round(us, 2),
               floor_fraction=round(floor_us / us, 3))
    if not parts:
        got = runs[0]
        run["prep_us"] = round(ms_graph([built.prep]) * 1e3, 2)  # the step's own first launches, priced alone
        run.update(rel_err=None if got is None else rel_err(got, want),
                   same_argmax=tokens[0] == int(want.argmax()), same_bits=None if got is None else
                   all(torch.equal(got, other) for other in runs[1:]), same_tokens=len(set(tokens)) == 1,
                   flagged=built.flagged())
    return run


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
                    help="split-K parts and biases added by fp32 atomics (atomic) or as int64 fixed-point "
                         "words, every activation kept as such (fixed: the same bits every run), or int32 "
                         "words (fixed32: values below 2**15, guarded: the run reports `flagged` where a value "
                         "read reached 2**13 or a part added 2**11), or fp32 on int32's grid (grid: the same "
                         "bits while sums stay below 2**8, no guard)")
    ap.add_argument("--head", nargs="+", default=["full"], choices=HEADS,
                    help="the probe's lm_head, every logit (full), or the engine's greedy head from an int8 copy "
                         "(screened: the argmax alone; --sums atomic, grid or fixed32)")
    ap.add_argument("--guard", nargs="+", default=["on"], choices=sorted(GUARDS),
                    help="fixed32's checks: on (both), or to price each alone, parts (a part or bias added), "
                         "reads (the residual stream where a layernorm reads it), off (timing only)")
    ap.add_argument("--arena-pad", type=_int_at_least(0), nargs="+", default=[0], metavar="WORDS",
                    help="start the activations this many words (a multiple of 32) into their buffer: "
                         "their placement's share of a form's time")
    ap.add_argument("--copies", type=_int_at_least(1), default=1,
                    help="time every form again on this many copies of the folded weights, each in a new "
                         "allocation (3 GB each at gpt2-xl): their placement's share of a form's time")
    ap.add_argument("--fresh", default="weights", choices=("weights", "params", "both", "refold"),
                    help="what each of --copies copies: the folded weights, the parameters (biases, layernorms' "
                         "folded terms), both, or all built again (refold: the weights folded, a new screen; only the last "
                         "copy kept alive, so that the copies take two places in turn)")
    ap.add_argument("--leave-out", nargs="+", default=[], choices=PARTS, metavar="PART",
                    help=f"also time each form without each of these ({', '.join(PARTS)}; timing only)")
    ap.add_argument("--checkpoint", type=Path, metavar="DIR",
                    help="a GPT-2 checkpoint (safetensors, HF layout) to run instead of --model's random weights: "
                         "the logits then checked against transformers'")
    ap.add_argument("--out", type=Path, help="folder for pdl-step-MODEL.json")
    args = ap.parse_args()
    if any(pad % 32 for pad in args.arena_pad):
        ap.error(f"--arena-pad: expected multiples of 32 words, got {args.arena_pad}")
    if args.copies > 1 and args.layernorm != ["folded"]:
        ap.error("--copies: takes --layernorm folded (the copies are of the folded weights)")
    if any(bn != 64 for bn, _ in args.tiles):
        ap.error("--tiles: the tensor-core form takes 64-row tiles (64xSTAGES)")
    forms = [Form(*f) for f in itertools.product(args.layernorm, args.order, args.gelu, args.mlp_stages,
                                                 args.qkv_stages, args.mma, args.sums, args.head,
                                                 args.guard)]
    from minillm.benchutil import require_cuda

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
    variants = [(form, parts, pad) for pad in args.arena_pad for form in forms
                for parts in [()] + [(part,) for part in args.leave_out]]
    shared = {}  # the folded weights and the screen: every form on the same addresses
    kept = []  # the earlier copies of the weights, alive so that each new copy takes a new place
    for copy in range(args.copies):
        if copy:
            kept.append((shared.pop("folded"), shared.pop("screen", None)))
            f_slabs, f_params, f_rows = kept[-1][0]
            if args.fresh == "refold":  # folded again with a new screen, only the last copy kept (as before
                del kept[:-1]           # session 109's call 3: two places in turn)
            else:
                shared["folded"] = ([s.clone() for s in f_slabs] if args.fresh != "params" else f_slabs,
                                    f_params.clone() if args.fresh != "weights" else f_params, f_rows)
                if kept[-1][1] is not None:
                    shared["screen"] = kept[-1][1]
        for bn, stages in args.tiles:
            for form, parts, pad in variants:
                try:
                    run = time_form(slabs, shapes, cfg, params, offs, final, caches, programs, stages, form, parts,
                                    pad, shared, x0, want, floor_us)
                except ValueError as e:
                    ap.error(str(e))
                run = dict(tile=[bn, BK], stages=stages, copy=copy, **run)
                rec["runs"].append(run)
                print(json.dumps(run), flush=True)
    print(f"{rec['model']}: a whole step's floor {floor_us:.1f} us (weights and {args.positions} cached positions)")
    write_record(args.out, f"pdl-step-{'checkpoint' if args.checkpoint else args.model}.json", rec)


if __name__ == "__main__":
    main()
