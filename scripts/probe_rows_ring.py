"""Probe: gpt2 batch 64's decode linears as a chain of launches in the form that streams gpt2-xl's
batch-1 weights near the floor (scripts/probe_pdl_ring.py): each launch one program an SM, its
share of the weight tiles streamed through a TMA ring asked for before the dependent-launch wait,
the products on the tensor cores, the split-K parts added by fp32 atomics
(scripts/pdl_rows_kernels.py). At 64 rows x fills wgmma's A operand and the weights are its B.

The question: the engine's batch-64 linears take 3.3-6.6 us a launch for 0.3-1.1 us of weight
bytes (README, the profile: 240 of the 354 us step), which is why batch 64 misses 15x sdpa (a
0.313 ms step) and 3x torch-compile (0.253 ms). If this form runs them near their bytes, the
goals are in reach of a port; if not, what it costs says why.

The chain: per layer qkv (C -> 3C), attn-out (qkv's first C columns -> C), fc (C -> 4C), mlp-out
(4C -> C); with --head on the lm_head's logits too. The arithmetic is real (x rounded to fp16 at
each launch's input, as the tensor cores read it) and checked against torch. Left out: the
attention, layernorms, GELU, residuals; so the times are the linears' part of a step. Each launch
zeroes the output of the launch after next, so no memset runs inside the chain.

    python3 scripts/probe_rows_ring.py --tiles 64x128x3 32x128x4 --orders 0 1 --out DIR   # H100 / H200
    python3 scripts/probe_rows_ring.py --modes 0 4 12 --rows 64 32
    python3 scripts/probe_rows_ring.py --compile-only                 # sm_90 compile on any machine
"""
import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from minillm.config import PRESETS  # noqa: E402
from pdl_rows_kernels import rows_linear_kernel  # noqa: E402
# the weights' boxes, a program's tiles, x's chunks by row block
from probe_pdl_ring import mma_descriptors, share, x_rows  # noqa: E402
from probe_common import gpu_setup, rel_err, weights, write_record  # noqa: E402,F401 (weights: the tests')

MODES = {0: "the chain", 1: "no waits (the stream with the work)", 2: "the next launch triggered late",
         4: "no arithmetic (no products, no atomics)", 8: "no x staged after the wait",
         12: "the ring and the waits alone (no x, no arithmetic)", 16: "products, no atomics out",
         32: "x read as fp16 (half the bytes)", 48: "x as fp16, no atomics out"}
SMEM_PER_SM = 228 * 1024  # H100 / H200; a block also holds 1 KB for the system
MAX_ROWS = 64  # one warpgroup's wgmma rows
# a run's largest error against torch's chain, relative to its largest value: fp32 sums in another
# order over 48 linears, each input rounded to fp16, read 1.6e-3 to 2.6e-3 at gpt2's size (session 111)
MAX_REL_ERR = 1e-2


def phases(shapes, R, C, head=True):
    """Each launch's (slab, first row, N, K, input offset, input row stride, output offset) in one
    fp32 arena of R-row activations (offsets 32-aligned), and the arena's size. The input is the
    launch before's output (attn-out: qkv's first C columns), the first launch's the arena's first
    R x C. head False: the lm_head left out."""
    align = lambda v: (v + 31) // 32 * 32  # noqa: E731
    rows, at, prev, prev_n = [], align(R * C), 0, C
    for slab, start, N, K in (shapes if head else shapes[:-1]):
        rows.append((slab, start, N, K, prev, prev_n, at))
        prev, prev_n, at = at, N, align(at + R * N)
    return rows, at


def zero_ahead(rows, R):
    """What each launch zeroes after its wait: the launch after next's output (offset, length),
    (0, 0) for the last two. The first two launches' outputs: the step's one memset (prep_zero)."""
    return [(rows[p + 2][6], R * rows[p + 2][2]) if p + 2 < len(rows) else (0, 0) for p in range(len(rows))]


def prep_zero(rows, R):
    """(offset, length) of the arena the step zeroes before its first launch."""
    end = rows[1][6] + R * rows[1][2] if len(rows) > 1 else rows[0][6] + R * rows[0][2]
    return rows[0][6], end - rows[0][6]


def tile_split(N, K, programs, bn, bk, order):
    """(K chunks, row blocks, x's staged chunks) of one launch: order 1 the most chunks a share
    touches; order 0 every chunk where a share is as long, else one a tile."""
    kt, rb = -(-K // bk), -(-N // bn)
    if order == 0:
        return kt, rb, x_rows(rb * kt, kt, programs)
    xs = 1
    for pid in range(programs):
        t0, n = share(rb * kt, programs, pid)
        if n:
            xs = max(xs, (t0 + n - 1) // rb - t0 // rb + 1)
    return kt, rb, xs


def smem_bytes(bn, bk, stages, xs):
    """A launch's shared memory: the ring's fp16 tiles, x's fp16 (64 x 64) boxes (a power of two
    of them), the barriers."""
    boxes = 1 << (xs * bk // 64 - 1).bit_length()
    return stages * bn * bk * 2 + boxes * MAX_ROWS * 64 * 2 + stages * 8


def reference_chain(slabs, shapes, x0, head=True):
    """The chain in torch: x0 (R, C) through every launch, each input rounded to fp16 (fp32
    products over the fp16 weights)."""
    x = x0.float()
    for slab, start, N, K in (shapes if head else shapes[:-1]):
        x = x[:, :K].half().float() @ slabs[slab][start:start + N].float().T
    return x


def launch_rows(descs, arena, ph, zero, R, programs, tile, mode, pdl, order, **compile_only):
    """One launch of rows_linear_kernel for phase ph (phases), zeroing `zero` (zero_ahead)."""
    slab, start, N, K, in_off, stride_xm, out_off = ph
    bn, bk, stages = tile
    kt, rb, xs = tile_split(N, K, programs, bn, bk, order)
    args = (descs[slab], arena[in_off:], arena[out_off:], arena[zero[0]:], start, R, N, K, stride_xm, rb * kt,
            programs, zero[1])
    meta = dict(MODE=mode, STAGES=stages, BN=bn, BOXES=bk // 64, KT=kt, RB=rb, XS=xs, ORDER=order, num_warps=4,
                launch_pdl=pdl)
    if compile_only:
        return rows_linear_kernel.warmup(*args, **meta, **compile_only)
    return rows_linear_kernel[(programs,)](*args, **meta)


def launcher(slabs, shapes, R, C, programs, tile, mode, pdl, order, head=True):
    """A callable that runs the chain once (the first two outputs zeroed, then every launch), the
    arena (x0 goes in its first R x C) and the last launch's output offset."""
    descs = mma_descriptors(slabs, tile[0])
    rows, size = phases(shapes, R, C, head)
    zeros = zero_ahead(rows, R)
    z_off, z_len = prep_zero(rows, R)
    arena = torch.zeros(size, dtype=torch.float32, device=slabs[0].device)

    def step():
        arena[z_off:z_off + z_len].zero_()
        for ph, zero in zip(rows, zeros):
            launch_rows(descs, arena, ph, zero, R, programs, tile, mode, pdl, order)
    return step, arena, rows[-1][6]


def tile_arg(text):
    """'64x128x3': 64 outputs x 128 of K a tile, a ring of 3."""
    try:
        bn, bk, stages = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected OUTPUTSxKxSTAGES such as 64x128x3, got {text!r}") from None
    if bn not in (16, 32, 64, 128, 256) or bk not in (64, 128, 256) or not 1 <= stages <= 8:
        raise argparse.ArgumentTypeError(f"{text!r}: outputs 16-256 and K 64-256 (powers of two), 1-8 stages")
    if smem_bytes(bn, bk, stages, 1) > SMEM_PER_SM - 1024:
        raise argparse.ArgumentTypeError(f"{text!r}: the ring and one chunk of x need "
                                         f"{smem_bytes(bn, bk, stages, 1)} B of shared memory, over an SM's")
    return bn, bk, stages


def rows_arg(text):
    """A batch of 1-64 rows."""
    if not text.isdigit() or not 1 <= int(text) <= MAX_ROWS:
        raise argparse.ArgumentTypeError(f"expected rows from 1 to {MAX_ROWS}, got {text!r}")
    return int(text)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", choices=sorted(PRESETS), help="preset whose widths to use")
    ap.add_argument("--rows", type=rows_arg, nargs="+", default=[64], help="batch rows (1-64)")
    ap.add_argument("--tiles", type=tile_arg, nargs="+", default=[(64, 128, 3)],
                    help="OUTPUTSxKxSTAGES tiles and rings to time")
    ap.add_argument("--orders", type=int, nargs="+", default=[0, 1], choices=[0, 1],
                    help="tiles by row block (0: parts summed in registers) or by K chunk (1: x's chunk shared)")
    ap.add_argument("--modes", type=int, nargs="+", default=[0], choices=sorted(MODES),
                    help="; ".join(f"{k}: {v}" for k, v in MODES.items()) + " (only 0 is checked)")
    ap.add_argument("--head", nargs="+", default=["off"], choices=["off", "on"], help="on: the lm_head's logits too")
    ap.add_argument("--programs", type=int, default=132, help="programs a launch with --compile-only (the SMs)")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 here and report, no GPU")
    ap.add_argument("--out", type=Path, help="folder for rows-ring-MODEL.json")
    return ap.parse_args(argv)


def compile_only(args):
    """Compile a layer's four launch shapes for sm_90 here (no GPU): shared memory, registers, spills."""
    from check_compile import cubin_usage, find_cuobjdump, target_only

    target_only(90)
    cfg = PRESETS[args.model]
    slabs, shapes = weights(cfg, "cpu")
    tool = find_cuobjdump()
    for tile in args.tiles:
        descs = mma_descriptors(slabs, tile[0])
        rows, size = phases(shapes, MAX_ROWS, cfg.n_embd)
        arena = torch.zeros(size)
        for order in args.orders:
            for ph in rows[:4]:
                for mode in args.modes:
                    k = launch_rows(descs, arena, ph, (0, 0), MAX_ROWS, args.programs, tile, mode, True, order,
                                    grid=(args.programs,))
                    regs, local = cubin_usage(k, tool)
                    print(f"{'x'.join(map(str, tile))} order {order}, N {ph[2]}, K {ph[3]}, mode {mode}: shared "
                          f"{k.metadata.shared} B, {regs} registers, {local} B local a thread")


def main():
    args = parse_args()
    if args.compile_only:
        return compile_only(args)
    from minillm.benchutil import ms_graph

    cfg, slabs, shapes, _, rec = gpu_setup(args.model, "probe_rows_ring.py")
    C, programs = cfg.n_embd, rec["programs"]
    layer_bytes = sum(slabs[s][a:a + N].numel() * 2 for s, a, N, _ in shapes[:-1])
    rec.update(launches_per_layer=4, layer_linears_bytes=layer_bytes,
               linears_floor_us=round(layer_bytes / (rec["copy_gbps"] * 1e3), 2))
    head_bytes = slabs[0][shapes[-1][1]:].numel() * 2
    inputs, failed = {}, 0
    for R, head, tile, order, mode in itertools.product(args.rows, [h == "on" for h in args.head], args.tiles,
                                                        args.orders, args.modes):
        if (R, head) not in inputs:
            x0 = torch.randn(R, C, device="cuda")
            inputs[R, head] = x0, reference_chain(slabs, shapes, x0, head)
        x0, want = inputs[R, head]
        floor_us = (layer_bytes + head_bytes * head) / (rec["copy_gbps"] * 1e3)
        step, arena, last = launcher(slabs, shapes, R, C, programs, tile, mode, True, order, head)
        arena[:R * C] = x0.flatten()
        step()
        torch.cuda.synchronize()
        got = arena[last:last + want.numel()].view_as(want)
        err = rel_err(got, want) if mode == 0 else None
        failed += err is not None and not err < MAX_REL_ERR
        us = ms_graph([step]) * 1e3
        xs = [tile_split(N, K, programs, tile[0], tile[1], order)[2] for _, _, N, K in shapes[:4]]
        run = dict(rows=R, head=head, tile=list(tile), order=order, mode=MODES[mode], us=round(us, 2),
                   floor_us=round(floor_us, 2), floor_fraction=round(floor_us / us, 3),
                   us_per_layer=None if head else round(us / cfg.n_layer, 2),
                   layer_smem_bytes=[smem_bytes(*tile, x) for x in xs], rel_err=err)
        rec["runs"].append(run)
        print(json.dumps(run), flush=True)
    print(f"{args.model}: the layers' linears {layer_bytes / 1e6:.1f} MB, floor {rec['linears_floor_us']} us at "
          f"{rec['copy_gbps']:.0f} GB/s")
    write_record(args.out, f"rows-ring-{args.model}.json", rec)
    if failed:
        sys.exit(f"probe_rows_ring.py: {failed} run(s) off torch's chain by a relative error of {MAX_REL_ERR} or more")


if __name__ == "__main__":
    main()
