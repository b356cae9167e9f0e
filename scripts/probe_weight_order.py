"""Does the order of a weight's bytes in memory bound the decode GEMV's one wave of tiles? Streams
a (K, N) fp16 weight as the split decode layouts do (a program a BLOCK_K x BLOCK_N tile, all of
them in one launch) in three orders:
- out-major: W stored (N, K), as the engine keeps it (minillm.model.out_major): a tile is BLOCK_N
  runs of BLOCK_K x 2 bytes, K x 2 bytes apart;
- in-major: W stored (K, N): a tile is BLOCK_K runs of BLOCK_N x 2 bytes, N x 2 bytes apart;
- tiles: the same bytes packed tile by tile, so a tile is one run of BLOCK_K x BLOCK_N x 2 bytes
  (bench_floor.py's chain streams such runs).
Each program loads its tile by pointers (as Triton 3.6 runs the split layouts), adds it up in
fp32 and stores one number: no products, no merge. Timed in CUDA graphs over weight copies
rotated past L2 (benchutil.ms_graph), with programmatic dependent launch off and on (on Hopper),
against the copy rate measured in the same run (bytes read plus written, as the engine's floor
counts it).

    python3 scripts/probe_weight_order.py --out bench/results/h200
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels._tuning import is_hopper, layout_switch  # noqa: E402
from minillm.benchutil import copy_bandwidth, device_slug, environment, ms_graph, require_cuda, rotating  # noqa: E402

SHAPES = {"xl-qkv": (1600, 4800), "xl-fc": (1600, 6400), "xl-mlp-out": (6400, 1600),  # (K, N)
          "gpt2-medium-mlp-out": (4096, 1024)}
TILES = ["128x256", "64x512", "32x1024", "256x128"]  # BLOCK_NxBLOCK_K, 64 KB each


@triton.jit
def _stream_tiles_kernel(w_ptr, out_ptr, K, N, stride_wb, stride_wk, stride_wn,
                         BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    """One tile per program, W[k0:k0 + BLOCK_K, n0:n0 + BLOCK_N] at w + (n0 // BLOCK_N) *
    stride_wb + k * stride_wk + (n - n0) * stride_wn: the out-major and in-major orders have
    stride_wb = BLOCK_N * stride_wn, the tiles order stride_wk = BLOCK_N, stride_wn = 1 and
    stride_wb a column block's K_pad x BLOCK_N. USE_PDL: the tile is requested before the
    dependent-launch wait, as the engine's split programs do, and the next launch may start then."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    nn = tl.arange(0, BLOCK_N)
    mask = (kk < K)[:, None] & (pid_n * BLOCK_N + nn < N)[None, :]
    w = tl.load(w_ptr + pid_n * stride_wb + kk[:, None] * stride_wk + nn[None, :] * stride_wn, mask=mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + pid_n * tl.num_programs(1) + pid_k, tl.sum(tl.sum(w.to(tl.float32), axis=1), axis=0))


def pack_tiles(w, block_n, block_k):
    """W (K, N) in the tiles order: (column blocks, K_pad, BLOCK_N), zero past K and N."""
    K, N = w.shape
    n_blocks, k_pad = triton.cdiv(N, block_n), triton.cdiv(K, block_k) * block_k
    padded = w.new_zeros(k_pad, n_blocks * block_n)
    padded[:K, :N] = w
    return padded.view(k_pad, n_blocks, block_n).permute(1, 0, 2).contiguous()


ORDERS = ("out-major", "in-major", "tiles")


def stored(w, order, block_n, block_k):
    """W (K, N) as the probe reads it in `order`."""
    if order == "out-major":
        return w.t().contiguous()  # (N, K)
    return w.contiguous() if order == "in-major" else pack_tiles(w, block_n, block_k)


def stream_tiles(w, order, block_n, block_k, K, N, out, pdl=False):
    """One launch of the probe over w, stored(W, order, ...); out gets a tile's sum per program,
    (column block, chunk) row-major. pdl: programmatic dependent launch (Hopper)."""
    chunks = triton.cdiv(K, block_k)
    strides = {"out-major": (block_n * K, 1, K), "in-major": (block_n, N, 1),
               "tiles": (w.shape[1] * block_n, block_n, 1)}[order]  # (stride_wb, stride_wk, stride_wn)
    _stream_tiles_kernel[(triton.cdiv(N, block_n), chunks)](w, out, K, N, *strides, BLOCK_K=block_k,
                                                            BLOCK_N=block_n, USE_PDL=pdl, num_warps=4,
                                                            **({"launch_pdl": True} if pdl else {}))


def _case(K, N, block_n, block_k, order, pdl, copy_gbs):
    n_blocks, chunks = triton.cdiv(N, block_n), triton.cdiv(K, block_k)

    def make():
        return stored(torch.randn(K, N, device="cuda", dtype=torch.float16), order, block_n, block_k)

    sets = rotating(make, K * N * 2)
    out = torch.empty(n_blocks * chunks, device="cuda", dtype=torch.float32)
    us = ms_graph([lambda w=w: stream_tiles(w, order, block_n, block_k, K, N, out, pdl) for w in sets]) * 1e3
    gbs = K * N * 2 / us / 1e3
    return dict(K=K, N=N, tile=f"{block_n}x{block_k}", order=order, pdl=pdl, programs=n_blocks * chunks,
                us=round(us, 2), gb_s=round(gbs, 1), of_copy=round(gbs / copy_gbs, 3))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n".join(__doc__.splitlines()[-1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES),
                    help=f"layers (default all: {', '.join(SHAPES)})")
    ap.add_argument("--tiles", nargs="*", default=TILES, metavar="NxK",
                    help=f"BLOCK_NxBLOCK_K tiles, powers of two (default {' '.join(TILES)})")
    ap.add_argument("--out", required=True, help="folder for probe-weight-order-<gpu>.json")
    args = ap.parse_args()
    tiles = []
    for t in args.tiles:
        try:  # the engine's own parser of layout switches
            tile = layout_switch("--tiles", t, "BLOCK_NxBLOCK_K", "128x256", pow2=2)
        except ValueError as e:
            ap.error(str(e))
        if tile is None or min(tile) < 16:
            ap.error(f"--tiles: expected BLOCK_NxBLOCK_K, powers of two from 16 (such as 128x256), got {t!r}")
        tiles.append(tile)
    require_cuda("probe_weight_order.py")
    copy_gbs = copy_bandwidth()  # read plus written, as the engine's floor counts it
    rows = []
    print(f"copy: {copy_gbs:,.0f} GB/s")
    pdls = (False, True) if is_hopper(torch.device("cuda")) else (False,)
    print("us a launch (fraction of the copy rate) by order")
    print(f"{'layer':20s} {'tile':>8s} {'PDL':>4s} {'programs':>8s} " + " ".join(f"{o:>16s}" for o in ORDERS))
    for name in args.shapes:
        K, N = SHAPES[name]
        for block_n, block_k in tiles:
            for pdl in pdls:
                cases = [_case(K, N, block_n, block_k, order, pdl, copy_gbs) for order in ORDERS]
                rows += [dict(layer=name, **r) for r in cases]
                print(f"{name:20s} {cases[0]['tile']:>8s} {'on' if pdl else 'off':>4s} {cases[0]['programs']:8d} "
                      + " ".join(f"{r['us']:9.2f} ({r['of_copy']:.2f})" for r in cases))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"probe-weight-order-{device_slug()}.json"
    path.write_text(json.dumps(dict(env=environment(), copy_gb_s=round(copy_gbs, 1), rows=rows), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
