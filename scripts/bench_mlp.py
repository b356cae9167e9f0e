"""Decode MLP: the fused one-launch kernel (kernels/mlp.py) against the same block as two
linears (fc, then mlp-out), on the GPT-2 widths, timed as a chain of layers in CUDA graphs
(programmatic dependent launch as in the engine; weights rotated past L2). Prints us per MLP,
the weight bytes per us (GB/s) and its fraction of the copy bandwidth; with --sweep also every
fused layout at one row.

    python3 scripts/bench_mlp.py --out bench/results
"""
import argparse
import importlib
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
from kernels import reference as ref  # noqa: E402
from minillm.benchutil import copy_bandwidth, device_slug, environment, ms_graph, rotating  # noqa: E402

mlp_module = importlib.import_module("kernels.mlp")
WIDTHS = {"gpt2": 768, "gpt2-xl": 1600}


def make_layers(C, M, dtype):
    """Enough independent MLP blocks (and their inputs) that a chain through them reads memory."""
    def one():
        g = lambda *s, scale=1.0: torch.randn(*s, device="cuda", dtype=dtype) * scale  # noqa: E731
        x = g(M, C)
        return dict(x=x, y=torch.empty_like(x), stats=ref.row_stats(x), out_stats=kernels.new_row_stats(M, C, "cuda"),
                    p=dict(ln_weight=g(C), ln_bias=g(C), fc_weight=g(C, 4 * C, scale=C ** -0.5), fc_bias=g(4 * C),
                           proj_weight=g(4 * C, C, scale=(4 * C) ** -0.5), proj_bias=g(C)))
    return rotating(one, 2 * 8 * C * C * torch.finfo(dtype).bits // 16)


def time_chain(layers, fused, config=None):
    """us per MLP over a chain of the layers (each writes its own y: the inputs stay fixed)."""
    mlp_module.FUSED = fused

    def call(L):
        return lambda: kernels.mlp(L["x"], **L["p"], ln_stats=L["stats"], stats_out=L["out_stats"], out=L["y"],
                                   _config=config)
    try:
        return ms_graph([call(L) for L in layers]) * 1e3
    finally:
        mlp_module.FUSED = True


def sweep_configs():
    for bh, (bk, bn), warps in itertools.product((16, 32, 64), ((128, 128), (64, 256), (128, 64), (256, 128)), (4, 8)):
        yield dict(BLOCK_H=bh, BLOCK_K=bk, BLOCK_N=bn, num_warps=warps, num_stages=3)
    for stages in (2, 4):
        yield {**mlp_module.fused_config(1, 768, 3072), "num_stages": stages}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16], help="rows (batch) per launch")
    ap.add_argument("--models", nargs="+", default=list(WIDTHS), choices=list(WIDTHS))
    ap.add_argument("--sweep", action="store_true", help="also time every fused layout at one row")
    ap.add_argument("--out", default=None, help="folder for mlp-<device>.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mlp: needs a CUDA GPU")
    copy_gbs = copy_bandwidth()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    print("| model | rows | layout | us per MLP | GB/s | of copy bandwidth |")
    print("|---|---:|---|---:|---:|---:|")
    rows = []

    def report(name, M, label, us, nbytes):
        gbs = nbytes / us / 1e3
        rows.append({"model": name, "rows": M, "layout": label, "us": us, "gbs": gbs})
        print(f"| {name} | {M} | {label} | {us:.2f} | {gbs:.0f} | {gbs / copy_gbs:.2f} |", flush=True)

    for name in args.models:
        C = WIDTHS[name]
        nbytes = 2 * 8 * C * C
        for M in args.rows:
            layers = make_layers(C, M, torch.float16)
            report(name, M, "two linears", time_chain(layers, False), nbytes)
            if M <= mlp_module.FUSED_ROWS:
                report(name, M, "fused (default)", time_chain(layers, True), nbytes)
            if args.sweep and M == 1:
                for cfg in sweep_configs():
                    label = "fused " + " ".join(f"{k}={v}" for k, v in cfg.items())
                    report(name, M, label, time_chain(layers, True, cfg), nbytes)
            del layers
            torch.cuda.empty_cache()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"mlp-{device_slug()}.json").write_text(json.dumps(
            {"environment": environment(), "copy_gbs": copy_gbs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
