"""The fastest a batch-1 decode step can be when it is a chain of kernels: every kernel of the
chain only streams its op's weight bytes (its slab requested before it waits on the kernel
before it, as minillm's decode kernels do) and hands its values to the next, in a CUDA graph
with programmatic dependent launch. No arithmetic and no layernorm: what is left is the memory
traffic and the cost of each dependency, so the "plain" rows are a lower bound for any design
that runs a layer as that many kernels.

Rows, for the GPT-2 shapes (gpt2, gpt2-xl by default):
- plain: kernels per layer 5 (attention and its output projection apart, as minillm runs them
  past 2 rows), 4 (fused, as minillm runs one row), or ops fused into 3, 2 or 1; with dependent
  launch off; and the whole step's bytes in one kernel (the bandwidth floor, checked);
- merge: the 5-kernel chain where every linear splits K into minillm's chunks and the last
  program to arrive merges the fp32 partials (an acq_rel counter), as minillm's decode
  linears do at few rows;
- tagged: the same merge without fence or counter: partials carry a ready tag that the last
  chunk polls;
- deferred: no merge; each kernel's programs add up the previous kernel's partials after the
  wait (the whole row where a layernorm follows, else their column block);
- atomic: no merge; every chunk adds its partial, in fixed point, into an int64 row with a
  relaxed atomic (integer sums do not depend on the order, so this stays deterministic); the
  next kernel reads the one row after its wait, and the kernel after that clears it.

    python3 scripts/bench_floor.py --out bench/results
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm.bench import floor_seconds  # noqa: E402
from minillm.benchutil import copy_bandwidth, device_slug, environment, ms_graph, require_cuda  # noqa: E402
from minillm.config import PRESETS  # noqa: E402

CACHE_POSITIONS = 96  # the generation benchmark's mean context (prompt 32 + half of 128 new), as its floor
GROUPINGS = {  # kernels per layer: which of a layer's ops share one kernel
    5: [["qkv"], ["attention"], ["attn-out"], ["fc"], ["mlp-out"]],
    4: [["qkv"], ["attention", "attn-out"], ["fc"], ["mlp-out"]],  # minillm at one row
    3: [["qkv"], ["attention", "attn-out"], ["fc", "mlp-out"]],
    2: [["qkv", "attention", "attn-out"], ["fc", "mlp-out"]],
    1: [["qkv", "attention", "attn-out", "fc", "mlp-out"]],
}


FIXED_ONE = tl.constexpr(4294967296.0)  # 2**32: the atomic mode's fixed-point unit


@triton.jit
def _stream_kernel(w_ptr, prev_ptr, out_ptr, part_ptr, count_ptr, clear_ptr, n_elems, n_prev, n_clear, CHUNKS,
                   TILE: tl.constexpr, ACC_IN: tl.constexpr, CLEAR: tl.constexpr, USE_PDL: tl.constexpr,
                   MERGE: tl.constexpr, CHUNKS_IN: tl.constexpr, ROW_IN: tl.constexpr, N_IN: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Streams one TILE of the op's bytes and hands BLOCK_N values per program to the next
    kernel. With CHUNKS > 1 the programs are split-K chunks of a linear (fp32 partials):
    MERGE 1 adds them up in the last program of a group to arrive (an acq_rel counter), as
    minillm's decode linears do; MERGE 2 has the last chunk of a group poll the others'
    partials, each stored with a ready tag in its upper 32 bits (no fence, no counter), and
    clear the tags; otherwise they are left for the next kernel, whose programs add them right
    after the wait (CHUNKS_IN > 1): the whole N_IN-wide row (ROW_IN: a layernorm needs it) or
    one column block."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    w = tl.load(w_ptr + offs, mask=offs < n_elems, other=0.0)  # requested before the wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rn = tl.arange(0, BLOCK_N)
    if CLEAR:  # the int64 row two kernels back: its reader has finished
        for c0 in range(pid * BLOCK_N, n_clear, tl.num_programs(0) * BLOCK_N):
            tl.store(clear_ptr + c0 + rn, tl.zeros((BLOCK_N,), dtype=tl.int64), mask=c0 + rn < n_clear)
    if ACC_IN:  # fixed-point row (2**-32 units) that the previous kernel's chunks added into
        if ROW_IN:
            ROW_A: tl.constexpr = triton.next_power_of_2(N_IN)
            cols_a = tl.arange(0, ROW_A)
            acc_row = tl.load(prev_ptr + cols_a, mask=cols_a < N_IN, other=0, cache_modifier=".cg")
            x = tl.sum(acc_row.to(tl.float32) / FIXED_ONE, axis=0) + tl.zeros((BLOCK_N,), tl.float32)
        else:
            blk_a = pid % (N_IN // BLOCK_N)
            x = tl.load(prev_ptr + blk_a * BLOCK_N + rn, cache_modifier=".cg").to(tl.float32) / FIXED_ONE
    elif CHUNKS_IN == 1:
        x = tl.load(prev_ptr + (pid * BLOCK_N + rn) % n_prev)
    elif ROW_IN:
        ROW: tl.constexpr = triton.next_power_of_2(N_IN)
        cols = tl.arange(0, ROW)
        row = tl.zeros((ROW,), dtype=tl.float32)
        for c in tl.static_range(CHUNKS_IN):  # chunk order; the loads are issued together
            row += tl.load(prev_ptr + c * N_IN + cols, mask=cols < N_IN, other=0.0, cache_modifier=".cg")
        x = tl.sum(row, axis=0) + tl.zeros((BLOCK_N,), dtype=tl.float32)
    else:
        blk = pid % (N_IN // BLOCK_N)
        x = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for c in tl.static_range(CHUNKS_IN):
            x += tl.load(prev_ptr + c * N_IN + blk * BLOCK_N + rn, cache_modifier=".cg")
    val = tl.sum(w.to(tl.float32), axis=0) * x  # (BLOCK_N,)
    if MERGE == 3:
        group = pid // CHUNKS
        tl.atomic_add(part_ptr + group * BLOCK_N + rn, (val * FIXED_ONE).to(tl.int64), sem="relaxed")
    elif MERGE == 2:
        group = pid // CHUNKS
        if pid % CHUNKS != CHUNKS - 1:  # value bits low, tag 1 high: one single-copy-atomic store
            bits = val.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
            tl.store(part_ptr + pid * BLOCK_N + rn, bits | (1 << 32))
        else:  # scheduled after the group's other chunks (higher y): they are running or done
            rc = tl.arange(0, 32)
            ptrs = part_ptr + (group * CHUNKS + rc)[:, None] * BLOCK_N + rn[None, :]
            live = (rc < CHUNKS - 1)[:, None]
            tagged = tl.load(ptrs, mask=live, other=1 << 32, volatile=True)
            while tl.min(tl.min(tagged >> 32, axis=1), axis=0) == 0:
                tagged = tl.load(ptrs, mask=live, other=1 << 32, volatile=True)
            parts = (tagged & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
            acc = tl.sum(tl.where(live, parts, 0.0), axis=0) + val
            tl.store(ptrs, tl.zeros_like(tagged), mask=live)  # cleared for the next launch
            tl.store(out_ptr + group * BLOCK_N + rn, acc)
    elif MERGE == 1:
        tl.store(part_ptr + pid * BLOCK_N + rn, val)
        group = pid // CHUNKS
        if tl.atomic_add(count_ptr + group, 1, sem="acq_rel") == CHUNKS - 1:
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for c in range(CHUNKS):
                acc += tl.load(part_ptr + (group * CHUNKS + c) * BLOCK_N + rn, cache_modifier=".cg")
            tl.store(out_ptr + group * BLOCK_N + rn, acc)
            tl.atomic_xchg(count_ptr + group, 0)
    else:
        tl.store(out_ptr + pid * BLOCK_N + rn, val)


def layer_ops(cfg, positions):
    """(name, bytes read at batch 1 in fp16, output columns, split-K chunks) of one layer's
    ops; the chunks are those of minillm's decode linears (128-wide K-chunks below K = 1024,
    else 256)."""
    C = cfg.n_embd
    k_chunks = lambda K: -(-K // (256 if K >= 1024 else 128))  # noqa: E731
    return {"qkv": (2 * C * 3 * C, 3 * C, k_chunks(C)), "attention": (2 * 2 * positions * C, C, 1),
            "attn-out": (2 * C * C, C, k_chunks(C)), "fc": (2 * C * 4 * C, 4 * C, k_chunks(C)),
            "mlp-out": (2 * 4 * C * C, C, k_chunks(4 * C))}


LN_INPUT = {"qkv", "fc", "lm_head"}  # ops that start with a layernorm: they need whole rows


def chain(cfg, per_layer, positions):
    """Every kernel of one decode step as (bytes, output columns, chunks, first op): the
    embedding, the layers, the lm_head, the bookkeeping."""
    ops = layer_ops(cfg, positions)
    kernels = [(2 * cfg.n_embd, cfg.n_embd, 1, "embedding")]
    for _ in range(cfg.n_layer):
        for group in GROUPINGS[per_layer]:
            kernels.append((sum(ops[o][0] for o in group), ops[group[-1]][1], ops[group[-1]][2], group[0]))
    return kernels + [(2 * cfg.vocab_size * cfg.n_embd, cfg.vocab_size, 1, "lm_head"), (64, 1, 1, "append")]


def time_chain(kernels, tile, pdl, mode, dev):
    """us per step of the chain; mode: "plain" (no split-K), "merge", "tagged", "deferred" or "atomic"."""
    block_n = 128
    bufs = [torch.randn(max(n // 2, 1), dtype=torch.float16, device=dev) for n, _, _, _ in kernels]
    chunks = [c if mode != "plain" else 1 for _, _, c, _ in kernels]
    grids = [triton.cdiv(triton.cdiv(b.numel(), tile), c) * c for b, c in zip(bufs, chunks)]
    size = [max(g, c * triton.cdiv(n, block_n)) * block_n for g, c, (_, n, _, _) in zip(grids, chunks, kernels)]
    outs = [torch.ones(n, dtype=torch.float32, device=dev) for n in size]
    parts = [torch.zeros(n, dtype=torch.int64, device=dev) for n in size]  # (tagged) partials
    counts = [torch.zeros(g, dtype=torch.int32, device=dev) for g in grids]

    def step():
        prev, prev_chunks, prev_n = outs[-1], 1, 1
        accs = [None, None]  # int64 rows written by the last two kernels (atomic mode)
        for b, g, o, p, n, c, (_, cols, _, first) in zip(bufs, grids, outs, parts, counts, chunks, kernels):
            deferred = mode == "deferred"
            atomic = mode == "atomic" and c > 1
            part = p if mode in ("tagged", "atomic") else p.view(torch.float32)
            acc_in = accs[-1] is not None
            clear = accs[0]
            _stream_kernel[(g,)](b, accs[-1] if acc_in else prev, o, part, n, clear if clear is not None else p,
                                 b.numel(), prev.numel(), clear.numel() if clear is not None else 0, c,
                                 TILE=tile, ACC_IN=acc_in, CLEAR=clear is not None, USE_PDL=pdl,
                                 MERGE={"merge": 1, "tagged": 2, "atomic": 3}.get(mode, 0) if c > 1 else 0,
                                 CHUNKS_IN=prev_chunks if deferred else 1,
                                 ROW_IN=first in LN_INPUT, N_IN=triton.cdiv(prev_n, block_n) * block_n,
                                 BLOCK_N=block_n, num_warps=4, launch_pdl=pdl)
            prev, prev_chunks, prev_n = o, c, cols
            accs = [accs[-1], part[:triton.cdiv(cols, block_n) * block_n] if atomic else None]

    t = ms_graph([step], reps=10) * 1e3
    for tensors in (bufs, outs, parts, counts):  # free them for the next chain (step() keeps the lists)
        tensors.clear()
    torch.cuda.empty_cache()
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt2", "gpt2-xl"], choices=sorted(PRESETS))
    ap.add_argument("--tiles-kb", nargs="+", type=int, default=[16, 32, 64],
                    help="bytes per program, in KiB (each a power of two; default 16 32 64)")
    ap.add_argument("--positions", type=int, default=CACHE_POSITIONS,
                    help=f"cache positions the attention reads (default {CACHE_POSITIONS})")
    ap.add_argument("--modes", nargs="+", default=None,
                    choices=["plain", "merge", "tagged", "deferred", "atomic"], help="only these rows (default all)")
    ap.add_argument("--out", default=None, help="folder for floor-<device>.json")
    args = ap.parse_args()
    require_cuda("bench_floor")
    dev = torch.device("cuda")
    copy_gbs = copy_bandwidth()
    rows = []
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    print("| model | kernels/layer | kernels/step | PDL | split-K partials | best tile KiB | us/step "
          "| bandwidth floor us | floor fraction |")
    print("|---|---:|---:|---|---|---:|---:|---:|---:|")
    for name in args.models:
        cfg = PRESETS[name]
        floor_us = floor_seconds(cfg, 1, args.positions, 2, copy_gbs) * 1e6  # the generation benchmark's floor
        one = sum(k[0] for k in chain(cfg, 5, args.positions))
        variants = [(k, True, "plain") for k in GROUPINGS] + [(5, False, "plain"), ("all", True, "plain"),
                                                             (5, True, "merge"), (5, True, "tagged"),
                                                             (5, True, "deferred"), (5, True, "atomic")]
        for per_layer, pdl, mode in variants:
            if args.modes and mode not in args.modes:
                continue
            kernels = [(one, 1, 1, "all")] if per_layer == "all" else chain(cfg, per_layer, args.positions)
            per_tile = {kb: time_chain(kernels, kb * 512, pdl, mode, dev) for kb in args.tiles_kb}
            best = min(per_tile, key=per_tile.get)
            r = {"model": name, "kernels_per_layer": per_layer, "kernels_per_step": len(kernels), "pdl": pdl,
                 "split_k": mode,
                 "bytes_per_step": sum(k[0] for k in kernels), "us_per_step_by_tile_kb": per_tile, "best_tile_kb": best,
                 "us_per_step": per_tile[best], "bandwidth_floor_us": floor_us,
                 "floor_fraction": floor_us / per_tile[best]}
            rows.append(r)
            print(f"| {name} | {per_layer} | {len(kernels)} | {'on' if pdl else 'off'} | {mode} | {best} "
                  f"| {per_tile[best]:.1f} "
                  f"| {floor_us:.1f} | {r['floor_fraction']:.2f} |", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"floor-{device_slug()}.json").write_text(json.dumps(
            {"environment": environment(), "copy_gbs": copy_gbs, "positions": args.positions, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
