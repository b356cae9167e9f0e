"""Probe: the batch-1 step's linears as ONE persistent Gluon launch fed by a TMA ring.

The engine runs each linear as its own launch, and at gpt2-xl's size each launch is about one
wave of programs, so every boundary drains the memory pipe (docs/performance.md, sixty-fourth
session). The sixty-sixth session's persistent probe (scripts/bench_persistent.py, plain Triton)
could not keep weights streaming through the waits: plain Triton neither pipelines loads across
them nor keeps a tile's sum inside a warp.

Here every SM runs one program that owns a contiguous share of every phase's (BN x 256) weight
tiles (scripts/stream_step_kernels.py). A ring of shared-memory slots, filled by TMA, keeps
tiles in flight whatever their phase: weights never depend on activations, so the ring can
stream on while the program waits for the phase before. Each tile's products accumulate in
registers (a warp owns whole rows, so the sum over K stays in the warp). A run of tiles of one row
block is added into the output by atomics. Phases meet in one of two ways:
- counters: each program counts itself in (release) and readers poll (acquire), then stage the
  input in shared memory;
- counted words: 8-byte fixed-point sums whose low byte counts the K tiles added, polled
  directly.

The kernel comes in two forms: one role, or warp specialized (a loader warp, at most N tiles in
flight). Modes leave parts out to see what each costs.

The chain: per layer qkv (C -> 3C), attn-out (its first C -> C), fc (C -> 4C), mlp-out
(4C -> C), then the lm_head. The arithmetic is real (fp32 over fp16 weights), checked against
torch. Left out: attention, the layernorms, GELU and the residuals, so the times are a lower bound
for a full step.

Outcome on an H200 (bench/results/h200/session-105/), gpt2-xl, whose floor is 735 us:
- the ring alone streams at 1.05 of the floor;
- the phases' chain alone takes 2.8 us a phase;
- the step is about their sum: at best 1,078 us (0.68, warp specialized, Triton 3.9) against the
  engine's whole step of 1,177 us.

At gpt2 the step takes about 180 us, against the engine's 115.

    python3 scripts/probe_stream_step.py --model gpt2-xl --forms one ws1 --out DIR   # H100 / H200
    python3 scripts/probe_stream_step.py --compile-only               # sm_90 compile on any machine
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from minillm.config import PRESETS  # noqa: E402
from probe_common import gpu_setup, rel_err, weights, write_record  # noqa: E402
import stream_step_kernels as ssk  # noqa: E402
from stream_step_kernels import FIRST, PHASE_END, SEG_END, stream_step_kernel, stream_step_ws_kernel  # noqa: E402

BK, NF, FIX_SCALE = ssk.BK.value, ssk.NF.value, ssk.FIX_SCALE.value  # the kernels' constants, as numbers


def tile_major(slabs, shapes, bn):
    """The weights stored tile by tile: each phase's (bn x BK) tiles in (row block, K chunk)
    order, each one contiguous block (K and N padded with zeros to whole tiles), in two slabs of
    BK columns as the row-major ones; and each phase's first row there."""
    parts, starts, at = [[], []], [], [0, 0]
    for slab, start, N, K in shapes:
        w = slabs[slab][start:start + N]
        n_pad, k_pad = -N % bn, -K % BK
        w = torch.nn.functional.pad(w, (0, k_pad, 0, n_pad))
        nb, kt = w.shape[0] // bn, w.shape[1] // BK
        parts[slab].append(w.view(nb, bn, kt, BK).permute(0, 2, 1, 3).reshape(-1, BK))
        starts.append(at[slab])
        at[slab] += nb * kt * bn
    return [torch.cat(p) for p in parts], starts


def plan(shapes, C, programs, bn, device, tiled_starts=None, counted=False):
    """Every program's tile list (a contiguous share of each phase's (row block, K chunk) tiles)
    as a table, the tile counts, each phase's output offset and the arena's size. tiled_starts:
    each phase's first row in the tile-major slabs (tile_major), else row-major weights.
    counted: phases meet by counted words (the entry's last field the K tiles each input word
    needs), else by counters (the programs that count themselves in at the phase before)."""
    align = lambda v: (v + 31) // 32 * 32  # noqa: E731
    at, outs = align(C), []
    for _, _, N, _ in shapes:
        outs.append(at)
        at = align(at + N)
    ins = [0] + outs[:-1]
    wants, lists = [], [[] for _ in range(programs)]
    for p, (slab, start, N, K) in enumerate(shapes):
        kt = (K + BK - 1) // BK
        tiles = [(nb, kk) for nb in range((N + bn - 1) // bn) for kk in range(kt)]
        T, busy = len(tiles), 0
        for q in range(programs):
            mine = tiles[T * q // programs:T * (q + 1) // programs]
            busy += bool(mine)
            for i, (nb, kk) in enumerate(mine):
                last = i == len(mine) - 1
                meta = slab | (FIRST if i == 0 else 0) | (PHASE_END if last else 0) | p << 8
                meta |= SEG_END if last or mine[i + 1][0] != nb else 0
                row = start + nb * bn if tiled_starts is None else tiled_starts[p] + (nb * kt + kk) * bn
                if counted:
                    want = (shapes[p - 1][3] + BK - 1) // BK if p else 1
                else:
                    want = wants[-1] if wants else 0
                lists[q].append([meta, row, kk * BK, outs[p] + nb * bn, ins[p], K, outs[p] + N, want])
        wants.append(busy)
    counts = [len(lst) for lst in lists]
    # whole blocks of 32, one more ahead: reads run past the end
    table = torch.zeros(programs, (max(counts) + 31) // 32 * 32 + 64, NF, dtype=torch.int32)
    for q, lst in enumerate(lists):
        if lst:  # (a program may have no tile at all in a small model)
            table[q, :len(lst)] = torch.tensor(lst, dtype=torch.int32)
    return dict(table=table.to(device), counts=torch.tensor(counts, dtype=torch.int32, device=device), outs=outs,
                arena=at, bn=bn, tiled=tiled_starts is not None, counted=counted)


def encode(x):
    """fp32 values as counted words, each with one tile in."""
    return (x.double() * FIX_SCALE).long() * 256 + 1


def decode(words):
    """Counted words' values (fp64)."""
    return (words >> 8).double() / FIX_SCALE


def reference(slabs, shapes, x0):
    """The chain in torch (fp32 over the fp16 weights): the last phase's output."""
    x = x0.float()
    for slab, start, N, K in shapes:
        x = slabs[slab][start:start + N].float() @ x[:K]
    return x


def launch(kernel_form, descs, pl, arena, flags, programs, stages, mode, **compile_only):
    """One launch of the step's kernel in form "one" (one role) or "wsN[lM]" (warp specialized,
    at most N tiles in flight; lM: with each tile L2 asked for the one M tiles later)."""
    tail = (pl["table"], pl["counts"], arena, flags, pl["table"].stride(0))
    meta = dict(MODE=mode, TILED=pl["tiled"], COUNTED=pl["counted"], STAGES=stages, BN=pl["bn"], num_warps=8)
    if kernel_form == "one":
        kernel, args = stream_step_kernel, (descs[0], descs[1]) + tail
    else:
        maxf, _, ahead = kernel_form[2:].partition("l")
        if ahead and not pl["tiled"]:
            raise ValueError(f"form {kernel_form}: L2 requests ahead need the weights tile by tile (--layouts tiles)")
        kernel, args = stream_step_ws_kernel, (descs[0], descs[1], descs[0].base, descs[1].base) + tail
        meta.update(MAXF=int(maxf), L2_AHEAD=int(ahead or 0))
        meta["maxnreg"] = 168  # 12 warps (8 + the loader's warpgroup): 232 registers for the 8
    if compile_only:
        return kernel.warmup(*args, **meta, **compile_only)
    return kernel[(programs,)](*args, **meta)


def descriptors(slabs, bn):
    """TMA descriptors of the two weight slabs, a (bn x BK) box each, unswizzled."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    return [TensorDescriptor(w, list(w.shape), list(w.stride()), [bn, BK], layout) for w in slabs]


def launcher(slabs, pl, n_phases, C, programs, stages, mode, kernel_form):
    """A callable that runs the step once (zeroed outputs and counters, then the launch), one
    that only zeroes them, and the arena it writes."""
    descs = descriptors(slabs, pl["bn"])
    dev = slabs[0].device
    arena = torch.zeros(pl["arena"], dtype=torch.int64 if pl["counted"] else torch.float32, device=dev)
    flags = torch.zeros(n_phases, dtype=torch.int32, device=dev)

    def clear():
        arena[C:].zero_()
        flags.zero_()

    def step():
        clear()
        launch(kernel_form, descs, pl, arena, flags, programs, stages, mode)
    return step, clear, arena


def compile_only(args):
    """Compile the kernel for sm_90 on this machine (no GPU): shared memory and registers."""
    from check_compile import cubin_usage, find_cuobjdump, target_only

    target_only(90)
    cfg = PRESETS["gpt2"]
    slabs, shapes = weights(cfg, "cpu")
    for (bn, stages), counted, form in ((t, c, k) for t in args.tiles for c in args.protocols for k in args.forms):
        stored, starts = tile_major(slabs, shapes, bn) if "l" in form else (slabs, None)
        pl = plan(shapes, cfg.n_embd, 4, bn, "cpu", starts, counted)
        descs = descriptors(stored, bn)
        arena = torch.zeros(pl["arena"], dtype=torch.int64 if counted else torch.float32)
        for mode in args.modes:
            k = launch(form, descs, pl, arena, torch.zeros(len(shapes), dtype=torch.int32), 4, stages, mode, grid=(4,))
            regs, local = cubin_usage(k, find_cuobjdump())
            print(f"{form}, {bn}x{BK} tiles, {stages} stages, counted {counted}, mode {mode}: "
                  f"shared {k.metadata.shared} B, {regs} registers, {local} B local a thread")


def tiles_arg(text):
    """'64x6': 64-row tiles, a ring of 6."""
    try:
        bn, stages = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxSTAGES such as 64x6, got {text!r}") from None
    if bn not in (16, 32, 64, 128) or not 1 <= stages <= 24 or bn * BK * 2 * stages > 200 * 1024:
        raise argparse.ArgumentTypeError(f"{text!r}: rows 16-128 (a power of two) and a ring within 200 KB")
    return bn, stages


def form_arg(text):
    """'one', 'wsN' or 'wsNlM'."""
    maxf, sep, ahead = text[2:].partition("l")
    if not (text == "one" or (text.startswith("ws") and maxf.isdigit() and int(maxf) > 0
                              and (not sep or (ahead.isdigit() and 0 < int(ahead) <= 32)))):
        raise argparse.ArgumentTypeError(f"expected one, wsN or wsNlM (N tiles in flight at most, N > 0; L2 asked for "
                                         f"the tile M later, 0 < M <= 32), got {text!r}")
    if sep and not ssk.HAS_INLINE_ASM:  # checked after the form, so a malformed one reads the same under any Triton
        raise argparse.ArgumentTypeError(f"form {text}: L2 requests ahead need Gluon's inline_asm, which this Triton "
                                         f"({triton.__version__}) lacks (3.9 has it)")
    return text


MODES = {0: "the step", 1: "no waits", 3: "no waits, no outputs", 7: "the ring alone", 8: "no input staged",
         9: "no waits, no input staged", 15: "the ring alone, no input staged",
         20: "the phases' chain alone (no weights read)", 28: "the chain alone, no input staged",
         32: "the step, polls 0.5 us apart", 52: "the chain alone, polls 0.5 us apart"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-xl", choices=sorted(PRESETS), help="preset whose widths to use")
    ap.add_argument("--tiles", type=tiles_arg, nargs="+", default=[(64, 6)], help="ROWSxSTAGES layouts to time")
    ap.add_argument("--modes", type=int, nargs="+", default=[0, 1, 3, 7], choices=sorted(MODES),
                    help="; ".join(f"{k}: {v}" for k, v in MODES.items()) + " (only 0 is checked)")
    ap.add_argument("--layouts", nargs="+", default=["rows", "tiles"], choices=["rows", "tiles"],
                    help="weights row-major (each tile 256-column pieces of BN rows) or tile by tile (contiguous)")
    ap.add_argument("--protocols", nargs="+", default=["counters", "counted"], choices=["counters", "counted"],
                    help="how phases meet: a counter a phase (release, acquire) or counted words (fixed point "
                         "with the K tiles in, no fence)")
    ap.add_argument("--forms", nargs="+", default=["one"], type=form_arg,
                    help="the kernel: one (one role), wsN (a loader warp, at most N tiles in flight) or wsNlM (and "
                         "L2 asked for the tile M later; --layouts tiles)")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 here and report, no GPU")
    ap.add_argument("--out", type=Path, help="folder for stream-step-MODEL.json")
    args = ap.parse_args()
    args.protocols = [p == "counted" for p in args.protocols]
    if args.compile_only:
        return compile_only(args)
    from minillm.benchutil import ms_graph

    cfg, slabs, shapes, x0, rec = gpu_setup(args.model, "probe_stream_step.py")
    C, programs, nbytes, floor_us = cfg.n_embd, rec["programs"], rec["weight_bytes"], rec["floor_us"]
    bw = rec["copy_gbps"]
    want = reference(slabs, shapes, x0)
    for layout, (bn, stages), counted, form in ((lay, t, c, k) for lay in args.layouts for t in args.tiles
                                                for c in args.protocols for k in args.forms):
        if "l" in form and layout == "rows":
            print(f"(form {form} skipped with row-major weights: its L2 requests need them tile by tile)")
            continue
        if layout == "tiles":
            stored, starts = tile_major(slabs, shapes, bn)
            pl = plan(shapes, C, programs, bn, "cuda", starts, counted)
        else:
            stored, pl = slabs, plan(shapes, C, programs, bn, "cuda", counted=counted)
        read = sum(w.numel() * 2 for w in stored)  # padded tiles read zeros too
        for mode in args.modes:
            step, clear, arena = launcher(stored, pl, len(shapes), C, programs, stages, mode, form)
            arena[:C] = encode(x0) if counted else x0
            step()
            torch.cuda.synchronize()
            got = arena[pl["outs"][-1]:pl["outs"][-1] + cfg.vocab_size]
            got = decode(got) if counted else got
            err = rel_err(got, want)
            us = ms_graph([step]) * 1e3
            run = dict(form=form, layout=layout, tile=[bn, BK], stages=stages,
                       protocol="counted" if counted else "counters",
                       mode=MODES[mode], us=round(us, 2),
                       floor_fraction=round(floor_us / us, 3), read_tbps=round(read / us / 1e6, 3),
                       rel_err=err if mode == 0 else None)
            rec["runs"].append(run)
            print(json.dumps(run), flush=True)
    rec["zero_fill_us"] = round(ms_graph([clear]) * 1e3, 2)  # what the step's two zero fills cost alone
    print(f"{args.model}: {nbytes / 1e9:.3f} GB of weights, floor {floor_us:.1f} us at {bw:.0f} GB/s; "
          f"zero fills {rec['zero_fill_us']:.2f} us")
    write_record(args.out, f"stream-step-{args.model}.json", rec)


if __name__ == "__main__":
    main()
