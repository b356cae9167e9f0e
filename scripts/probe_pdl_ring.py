"""Probe: the batch-1 step's linears as a chain of launches, each one program an SM streaming its
share of the weights through a TMA ring, the ring's first tiles asked for before the
dependent-launch wait (scripts/pdl_ring_kernels.py).

The hundred-and-fifth session ran the same linears as ONE persistent launch
(scripts/probe_stream_step.py): its weights streamed at the floor, but each phase's boundary
(counters in global memory) took 2.8 us that barely overlapped the stream. A dependent launch's
boundary is the hardware's (bench_floor.py: about 1.3 us a kernel in a chain of streaming
kernels), and the engine's linears cannot ask for all of their weights before their wait: their
programs hold them in registers, a wave and a half a kernel. Here a launch takes at most half of
every SM's shared memory and registers, so the next launch's program is resident beside it from
its start and asks for its first tiles then: the bus should stay busy across every boundary.

The chain: per layer qkv (C -> 3C), attn-out (its first C -> C, or with --attention on the
layer's decode attention between them), fc (C -> 4C), mlp-out (4C -> C), then the lm_head. The
arithmetic is real, checked against torch. Left out: the layernorms, GELU and the residuals, so
the times are a lower bound for a full step; the probe asks whether the chain can beat the
engine's whole step (gpt2-xl 1,177 us on an H200) by enough to leave room for those.

Two forms of the products: `cuda` (fp32 FMAs, 8 warps; `cuda16` 16) and `mma` (one warpgroup,
wgmma over 128-byte-swizzled boxes, x in fp16 in the first of the B operand's 8 columns).

Outcome on an H200 (bench/results/h200/session-106/), gpt2-xl, floor 736 us:
- the ring and the waits alone take 811 us: the boundary itself costs 0.4 us;
- what follows each wait (x's staging, the landed tiles' products, the outputs) is the rest:
  `cuda` 1,081-1,099 us at 64x3, `mma` **970 us (0.759)**, the same under Triton 3.6 and 3.9;
- with each layer's decode attention as a fifth launch (--attention on), `mma` **1,062 us**
  (0.696 of the floor with the cache), against the engine's whole step of 1,177. Still missing
  for a step: the layernorms, GELU, the residuals, the head's argmax. gpt2: 150 us against the
  engine's 115.

    python3 scripts/probe_pdl_ring.py --model gpt2-xl --tiles 64x2 32x4 --out DIR   # H100 / H200
    python3 scripts/probe_pdl_ring.py --model gpt2-xl --tiles 64x3 --forms mma --attention off on --modes 0
    python3 scripts/probe_pdl_ring.py --compile-only                  # sm_90 compile on any machine
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from minillm.cli import _int_at_least  # noqa: E402
from minillm.config import PRESETS  # noqa: E402
from pdl_attention_kernels import ring_attention_kernel  # noqa: E402
from pdl_ring_kernels import ring_linear_kernel  # noqa: E402
from pdl_ring_mma_kernels import ring_linear_mma_kernel  # noqa: E402
from probe_common import (attend, floor_with_cache, gpu_setup, make_caches, rel_err, weights,  # noqa: E402
                          write_record)
from probe_stream_step import BK, descriptors, tiles_arg  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

MODES = {0: "the chain", 1: "no waits (the stream with the work)", 2: "the next launch triggered late",
         4: "no arithmetic", 5: "no waits, no arithmetic", 8: "no x staged after the wait",
         12: "the ring and the waits alone (no x staged, no arithmetic)"}
SMEM_PER_SM = 228 * 1024  # H100 / H200; a block also holds 1 KB for the system


def phases(shapes, C, bn, attention=False):
    """Each launch's (slab, first row, N, K, input offset, output offset, tiles, K chunks) in one
    fp32 arena (offsets 32-aligned), and the arena's size. Phase p reads phase p - 1's output
    (attn-out its first C of qkv's), the first reads the arena's first C. attention: after each
    layer's qkv an attention launch ("attn", layer, qkv's output offset, its own output offset),
    whose output attn-out reads instead."""
    align = lambda v: (v + 31) // 32 * 32  # noqa: E731
    rows, at, prev = [], align(C), 0
    layers = (len(shapes) - 1) // 4
    for i, (slab, start, N, K) in enumerate(shapes):
        kt = (K + BK - 1) // BK
        rows.append((slab, start, N, K, prev, at, (N + bn - 1) // bn * kt, kt))
        prev, at = at, align(at + N)
        if attention and i % 4 == 0 and i < 4 * layers:
            rows.append(("attn", i // 4, prev, at))
            prev, at = at, align(at + C)
    return rows, at


def share(n_tiles, programs, pid):
    """Program pid's tiles, as the kernel splits them: (first tile, count)."""
    t0 = n_tiles * pid // programs
    return t0, n_tiles * (pid + 1) // programs - t0


def x_rows(n_tiles, kt, programs):
    """Rows of staged x: one a K chunk, or one a tile where a share has fewer tiles."""
    return min(kt, -(-n_tiles // programs))


def smem_bytes(bn, stages, xs, form="cuda"):
    """A launch's shared memory: the ring, x staged (fp32 rows; mma: fp16 (8 x 64) boxes, 7 rows
    zero, a power of two of them), the barriers."""
    if form == "mma":  # x in (8 x 64) fp16 boxes, a power of two of them
        return stages * bn * BK * 2 + triton.next_power_of_2(4 * xs) * 1024 + stages * 8
    return stages * bn * BK * 2 + xs * BK * 4 + stages * 8


def mma_descriptors(slabs, bn=64):
    """TMA descriptors of the two weight slabs in (bn x 64) boxes, 128-byte swizzle, as wgmma reads
    them (here its A; scripts/probe_rows_ring.py's B, read transposed)."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return [TensorDescriptor(w, list(w.shape), list(w.stride()), [bn, 64], layout) for w in slabs]


def reference_chain(slabs, shapes, x0, fp16_x=False, caches=None, heads=0):
    """The chain in torch (fp32 over the fp16 weights); fp16_x: each linear's input rounded to
    fp16, as the tensor cores read it; caches (a layer's (K, V), (P + 1, C) fp16, row P unused):
    each layer's attention between qkv and attn-out, as ring_attention_kernel computes it."""
    x = x0.float()
    for i, (slab, start, N, K) in enumerate(shapes):
        xin = x[:K].half().float() if fp16_x else x[:K]
        x = slabs[slab][start:start + N].float() @ xin
        if caches is not None and i % 4 == 0 and i // 4 < len(caches):
            x = attend(x, *caches[i // 4], heads)
    return x


def mma_shares(N, K, programs, order):
    """For ring_linear_mma_kernel's tiles in order (0 by row block, 1 by K chunk): (K chunks, row
    blocks, the most chunks a program's tiles touch (order 1), the most row blocks whose first
    chunk a program holds)."""
    kt, rb = (K + BK - 1) // BK, (N + 63) // 64
    chunks, firsts = 1, 1
    for pid in range(programs):
        t0, n = share(rb * kt, programs, pid)
        if n == 0:
            continue
        if order == 0:  # (chunks: x_rows stages x by tile where a program has fewer than kt)
            firsts = max(firsts, -(-(t0 + n) // kt) - -(-t0 // kt))
        else:
            chunks = max(chunks, (t0 + n - 1) // rb - t0 // rb + 1)
            firsts = max(firsts, min(t0 + n, rb) - t0)
    return kt, rb, chunks, firsts


def launch_mma(desc, x, y, start, N, K, programs, stages, mode, pdl, params=None, xform=0, g_off=0, bias_off=-1,
               eps=1e-5, order=0, async_mma=False, fixed=0, flag=None, guard=3, **compile_only):
    """One launch of the tensor-core form (one warpgroup, 64-row tiles): y[:N] += W[start:start + N] @ x
    with x staged as xform says (probe_pdl_step: 1 its layernorm, weight and bias at params +
    g_off, + K; 2 its GELU; 3 a layernorm folded in, u at params + g_off) and, where bias_off >= 0,
    the bias at params + bias_off added once; the tiles by row block (order 0) or K chunk (1);
    async_mma: a tile's four products issued in a row with one wait. fixed: 0, or the width of
    the fixed-point words that x and y are, or GRID32 (the kernel's FIXED); flag: int32 words'
    guard flag; guard: which of its checks run (the kernel's GUARD)."""
    kt, rb, chunks, firsts = mma_shares(N, K, programs, order)
    xs = x_rows(rb * kt, kt, programs) if order == 0 else chunks
    args = (desc, x, y, start, N, K, rb * kt, programs, x if params is None else params, g_off, max(bias_off, 0), eps,
            x if flag is None else flag)
    meta = dict(MODE=mode, STAGES=stages, KT=kt, RB=rb, ORDER=order, XS=xs, XB=triton.next_power_of_2(4 * xs),
                XFORM=xform, BIAS=bias_off >= 0, BROWS=max(128, triton.next_power_of_2(64 * firsts)),
                KP=max(128, triton.next_power_of_2(K)), ASYNC=async_mma, FIXED=fixed, GUARD=guard, num_warps=4,
                launch_pdl=pdl)
    if compile_only:
        return ring_linear_mma_kernel.warmup(*args, **meta, **compile_only)
    return ring_linear_mma_kernel[(programs,)](*args, **meta)


def launch(descs, slabs, arena, ph, programs, stages, bn, reg, mode, pdl, form="cuda", **compile_only):
    slab, start, N, K, in_off, out_off, n_tiles, kt = ph
    if form == "mma":
        return launch_mma(descs[slab], arena[in_off:], arena[out_off:], start, N, K, programs, stages, mode, pdl,
                          **compile_only)
    args = (descs[slab], slabs[slab], arena[in_off:], arena[out_off:], start, slabs[slab].shape[0], N, K, n_tiles,
            programs)
    # two programs an SM (this launch's and the next one's): 8 warps at <= 128 registers, 16 at <= 64
    warps = 16 if form == "cuda16" else 8
    meta = dict(MODE=mode, STAGES=stages, BN=bn, KT=kt, REG=reg, XS=x_rows(n_tiles, kt, programs), num_warps=warps,
                maxnreg=1024 // warps, launch_pdl=pdl)
    if compile_only:
        return ring_linear_kernel.warmup(*args, **meta, **compile_only)
    return ring_linear_kernel[(programs,)](*args, **meta)


def launch_attention(arena, ph, caches, heads, mode, pdl, params=None, eps=1e-5, fixed=0, flag=None, guard=3,
                     **compile_only):
    """ph: ("attn", layer, qkv's offset, the output's[, u's offset, c's offset in params]): with
    the last two, qkv's output is W' x with the layernorm folded in (probe_pdl_step), finished
    here; the residual stream is the arena's first C. fixed: 0, or the width of the fixed-point
    words the arena holds, or GRID32 (the kernel's FIXED); flag: int32 words' guard flag; guard:
    which of its checks run (the kernel's GUARD)."""
    layer, in_off, out_off = ph[1:4]
    u_off, c_off = ph[4:6] if len(ph) > 4 else (0, 0)
    k_cache, v_cache = caches[layer]
    P, C = k_cache.shape[0] - 1, k_cache.shape[1]
    args = (k_cache, v_cache, arena[in_off:], arena[out_off:], P, C, (C // heads) ** -0.5, arena,
            arena if params is None else params, u_off, c_off, eps, arena if flag is None else flag)
    meta = dict(MODE=mode, D=C // heads, BP=triton.next_power_of_2(P + 1), FOLD=len(ph) > 4,
                KP=max(128, triton.next_power_of_2(C)), FIXED=fixed, GUARD=guard, num_warps=4, launch_pdl=pdl)
    if compile_only:
        return ring_attention_kernel.warmup(*args, **meta, **compile_only)
    return ring_attention_kernel[(heads,)](*args, **meta)


def launcher(slabs, shapes, C, programs, bn, stages, reg, mode, pdl, form="cuda", caches=None, heads=0):
    """A callable that runs the chain once (the arena's outputs zeroed, then every launch), and
    the arena with the last phase's offset. caches (make_caches): with each layer's attention."""
    descs = mma_descriptors(slabs) if form == "mma" else descriptors(slabs, bn)
    rows, size = phases(shapes, C, bn, attention=caches is not None)
    arena = torch.zeros(size, dtype=torch.float32, device=slabs[0].device)

    def step():
        arena[C:].zero_()
        for ph in rows:
            if ph[0] == "attn":
                launch_attention(arena, ph, caches, heads, mode, pdl)
            else:
                launch(descs, slabs, arena, ph, programs, stages, bn, reg, mode, pdl, form)
    return step, arena, rows[-1][5]


def compile_only(args):
    """Compile every launch shape for sm_90 here (no GPU): shared memory, registers, spills."""
    from check_compile import cubin_usage, find_cuobjdump, target_only

    target_only(90)
    cfg = PRESETS[args.model]
    slabs, shapes = weights(cfg, "cpu")
    tool = find_cuobjdump()
    for (bn, stages), reg, form in runs(args):
        descs = mma_descriptors(slabs) if form == "mma" else descriptors(slabs, bn)
        rows, size = phases(shapes, cfg.n_embd, bn)
        arena = torch.zeros(size)
        for ph in rows[:4]:  # a layer's four shapes
            for mode in args.modes:
                k = launch(descs, slabs, arena, ph, args.programs, stages, bn, reg, mode, True, form,
                           grid=(args.programs,))
                regs, local = cubin_usage(k, tool)
                print(f"{form} {bn}x{stages}, {reg} tiles in registers, N {ph[2]}, K {ph[3]}, mode {mode}: shared "
                      f"{k.metadata.shared} B, {regs} registers, {local} B local a thread")
    caches = make_caches(cfg, args.positions, "cpu")
    k = launch_attention(torch.zeros(8 * cfg.n_embd), ("attn", 0, 0, 4 * cfg.n_embd), caches, cfg.n_head, 0, True,
                         grid=(cfg.n_head,))
    regs, local = cubin_usage(k, tool)
    print(f"attention over {args.positions} positions: shared {k.metadata.shared} B, {regs} registers, {local} B local")


def runs(args):
    """(tile, register tiles, form) to run: the mma form takes 64-row tiles and no register tiles."""
    for t in args.tiles:
        for form in args.forms:
            if form == "mma" and t[0] != 64:
                print(f"(mma skipped at {t[0]}-row tiles: one warpgroup's wgmma takes 64 rows)")
                continue
            for r in ([0] if form == "mma" else args.reg):
                yield t, r, form


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-xl", choices=sorted(PRESETS), help="preset whose widths to use")
    ap.add_argument("--tiles", type=tiles_arg, nargs="+", default=[(64, 2), (32, 4)],
                    help="ROWSxSTAGES rings to time (two launches' rings and staged x must share an SM)")
    ap.add_argument("--modes", type=int, nargs="+", default=[0, 1, 2], choices=sorted(MODES),
                    help="; ".join(f"{k}: {v}" for k, v in MODES.items()) + " (only 0 is checked)")
    ap.add_argument("--reg", type=int, nargs="+", default=[0], choices=[0, 1, 2],
                    help="tiles of each share loaded into registers before the wait, ahead of the ring's")
    ap.add_argument("--forms", nargs="+", default=["cuda"], choices=["cuda", "cuda16", "mma"],
                    help="the tiles' products on CUDA cores (fp32 over fp16 weights; 8 warps, or 16) or tensor cores "
                         "(wgmma, x in fp16)")
    ap.add_argument("--attention", nargs="+", default=["off"], choices=["off", "on"],
                    help="on: each layer's decode attention as a launch between qkv and attn-out (a program a head)")
    ap.add_argument("--positions", type=_int_at_least(1), default=96, help="cached positions the attention reads")
    ap.add_argument("--programs", type=int, default=132, help="programs a launch with --compile-only (the SMs)")
    ap.add_argument("--no-pdl", action="store_true", help="also time every run as plain launches")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 here and report, no GPU")
    ap.add_argument("--out", type=Path, help="folder for pdl-ring-MODEL.json")
    args = ap.parse_args()
    if args.compile_only:
        return compile_only(args)
    from minillm.benchutil import ms_graph

    cfg, slabs, shapes, x0, rec = gpu_setup(args.model, "probe_pdl_ring.py")
    C, programs, nbytes, floor_us = cfg.n_embd, rec["programs"], rec["weight_bytes"], rec["floor_us"]
    bw = rec["copy_gbps"]
    caches = make_caches(cfg, args.positions, "cuda")
    cache_bytes, cache_floor = floor_with_cache(rec, cfg, args.positions)
    rec.update(launches=len(shapes), positions=args.positions, cache_bytes=cache_bytes)
    wants = {(f, a): reference_chain(slabs, shapes, x0, f, caches if a else None, cfg.n_head)
             for f in (False, True) for a in (False, True)}
    for ((bn, stages), reg, form), att, pdl, mode in (
            (r, a == "on", p, m) for r in list(runs(args)) for a in args.attention
            for p in ([True, False] if args.no_pdl else [True]) for m in args.modes):
        step, arena, last = launcher(slabs, shapes, C, programs, bn, stages, reg, mode, pdl, form,
                                     caches if att else None, cfg.n_head)
        want = wants[(form == "mma", att)]
        arena[:C] = x0
        step()
        torch.cuda.synchronize()
        got = arena[last:last + cfg.vocab_size]
        err = rel_err(got, want)
        us = ms_graph([step]) * 1e3
        xs = [x_rows(ph[6], ph[7], programs) for ph in phases(shapes, C, bn)[0][:4]]
        floor = cache_floor if att else floor_us
        run = dict(form=form, tile=[bn, BK], stages=stages, reg_tiles=reg, attention=att, pdl=pdl, mode=MODES[mode],
                   us=round(us, 2), floor_fraction=round(floor / us, 3),
                   layer_smem_bytes=[smem_bytes(bn, stages, x, form) for x in xs],
                   rel_err=err if mode == 0 else None)
        rec["runs"].append(run)
        print(json.dumps(run), flush=True)
    print(f"{args.model}: {nbytes / 1e9:.3f} GB of weights in {len(shapes)} launches, floor {floor_us:.1f} us "
          f"at {bw:.0f} GB/s")
    write_record(args.out, f"pdl-ring-{args.model}.json", rec)


if __name__ == "__main__":
    main()
