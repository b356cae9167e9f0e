"""The fastest a batch-1 decode step can be when it is a chain of kernels: every kernel of the
chain only streams its op's weight bytes (its slab requested before it waits on the kernel
before it, as minillm's decode kernels do) and hands one value to the next, in a CUDA graph
with programmatic dependent launch. No arithmetic, no split-K merge, no layernorm: what is left
is the memory traffic and the cost of each dependency, so this is a lower bound for any design
that runs a layer as that many kernels.

The chain is timed for the GPT-2 shapes at several granularities (kernels per layer: 5 as
minillm runs it, ops fused into 3, 2 or 1), next to the bandwidth floor (the same bytes in one
kernel) and the copy bandwidth of the run.

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
from minillm.benchutil import copy_bandwidth, device_slug, environment, ms_graph  # noqa: E402
from minillm.config import PRESETS  # noqa: E402

CACHE_POSITIONS = 96  # the generation benchmark's mean context (prompt 32 + half of 128 new), as its floor
GROUPINGS = {  # kernels per layer: which of a layer's ops share one kernel
    5: [["qkv"], ["attention"], ["attn-out"], ["fc"], ["mlp-out"]],
    3: [["qkv"], ["attention", "attn-out"], ["fc", "mlp-out"]],
    2: [["qkv", "attention", "attn-out"], ["fc", "mlp-out"]],
    1: [["qkv", "attention", "attn-out", "fc", "mlp-out"]],
}


@triton.jit
def _stream_kernel(w_ptr, prev_ptr, out_ptr, n_elems, n_prev, TILE: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    w = tl.load(w_ptr + offs, mask=offs < n_elems, other=0.0)  # requested before the wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(prev_ptr + pid % n_prev)  # what the previous kernel wrote
    tl.store(out_ptr + pid, tl.sum(w.to(tl.float32), axis=0) * x)


def op_bytes(cfg, positions):
    """Bytes each op of one layer reads at batch 1 (fp16): weights, or the attention's cache."""
    C = cfg.n_embd
    return {"qkv": 2 * C * 3 * C, "attention": 2 * 2 * positions * C, "attn-out": 2 * C * C,
            "fc": 2 * C * 4 * C, "mlp-out": 2 * 4 * C * C}


def chain_sizes(cfg, per_layer, positions):
    """Bytes of every kernel of one decode step: embedding, the layers, the lm_head, bookkeeping."""
    ops = op_bytes(cfg, positions)
    sizes = [2 * cfg.n_embd]
    for _ in range(cfg.n_layer):
        sizes += [sum(ops[o] for o in group) for group in GROUPINGS[per_layer]]
    return sizes + [2 * cfg.vocab_size * cfg.n_embd, 64]


def time_chain(sizes, tile, pdl, dev):
    bufs = [torch.randn(max(n // 2, 1), dtype=torch.float16, device=dev) for n in sizes]
    grids = [triton.cdiv(b.numel(), tile) for b in bufs]
    outs = [torch.ones(g, dtype=torch.float32, device=dev) for g in grids]

    def step():
        prev = outs[-1]
        for b, g, o in zip(bufs, grids, outs):
            _stream_kernel[(g,)](b, prev, o, b.numel(), prev.numel(), TILE=tile, USE_PDL=pdl, num_warps=4,
                                 launch_pdl=pdl)
            prev = o

    t = ms_graph([step], reps=10) * 1e3
    del bufs, outs
    torch.cuda.empty_cache()
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt2", "gpt2-xl"], choices=sorted(PRESETS))
    ap.add_argument("--tiles-kb", nargs="+", type=int, default=[16, 32, 64],
                    help="bytes per program, in KiB (each a power of two; default 16 32 64)")
    ap.add_argument("--positions", type=int, default=CACHE_POSITIONS,
                    help=f"cache positions the attention reads (default {CACHE_POSITIONS})")
    ap.add_argument("--out", default=None, help="folder for floor-<device>.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    copy_gbs = copy_bandwidth()
    rows = []
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    print("| model | kernels/layer | kernels/step | PDL | best tile KiB | us/step | bandwidth floor us | floor fraction |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for name in args.models:
        cfg = PRESETS[name]
        floor_us = floor_seconds(cfg, 1, args.positions, 2, copy_gbs) * 1e6  # the generation benchmark's floor
        one = sum(chain_sizes(cfg, 5, args.positions))
        variants = [(k, True) for k in GROUPINGS] + [(5, False)] + [("all", True)]
        for per_layer, pdl in variants:
            sizes = [one] if per_layer == "all" else chain_sizes(cfg, per_layer, args.positions)
            per_tile = {kb: time_chain(sizes, kb * 512, pdl, dev) for kb in args.tiles_kb}
            best = min(per_tile, key=per_tile.get)
            r = {"model": name, "kernels_per_layer": per_layer, "kernels_per_step": len(sizes), "pdl": pdl,
                 "bytes_per_step": sum(sizes), "us_per_step_by_tile_kb": per_tile, "best_tile_kb": best,
                 "us_per_step": per_tile[best], "bandwidth_floor_us": floor_us,
                 "floor_fraction": floor_us / per_tile[best]}
            rows.append(r)
            print(f"| {name} | {per_layer} | {len(sizes)} | {'on' if pdl else 'off'} | {best} | {per_tile[best]:.1f} "
                  f"| {floor_us:.1f} | {r['floor_fraction']:.2f} |", flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"floor-{device_slug()}.json").write_text(json.dumps(
            {"environment": environment(), "copy_gbs": copy_gbs, "positions": args.positions, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
