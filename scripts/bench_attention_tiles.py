"""Every prefill attention tile layout (kernels/attention.py) against the first: the same bits or
not, and its time.

The autotuner picks a layout per (T bucket, D, causal, program order) on each machine. A layout
that rounds differently would make the same prompt's logits, and a seeded draw near a tie, depend
on what a machine's tuner happened to pick. This runs every candidate on the engine's prefill
shapes, compares its output bit for bit with the candidate list's first, and times it (medians of
CUDA-graph replays, so the launcher's host work is not counted; warm-up excluded).

    python scripts/bench_attention_tiles.py --out DIR            # the autotuner's list
    python scripts/bench_attention_tiles.py --sweep --out DIR    # every BLOCK_M/BLOCK_N/warps/stages
"""
import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (batch, heads, tokens, head dim, padded rows): the benchmark's prompts at gpt2 and gpt2-xl, the
# 1024-token TTFT prompt, and the parity checks' short ragged prompts
SHAPES = [(1, 12, 32, 64, 0), (8, 12, 32, 64, 0), (64, 12, 32, 64, 0), (1, 12, 1024, 64, 0),
          (16, 12, 1024, 64, 0), (1, 25, 32, 64, 0), (1, 25, 1024, 64, 0), (8, 12, 40, 64, 35),
          (1, 12, 7, 64, 0), (3, 20, 300, 64, 111)]


def configs(sweep):
    from kernels._tuning import config_kwargs
    from kernels.attention import _CONFIGS

    listed = [config_kwargs(c) for c in _CONFIGS]
    if not sweep:
        return listed
    grid = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
            for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (3, 4))]
    return listed + [c for c in grid if c not in listed]


def name(c):
    return f"{c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}"


def inputs(B, H, T, D, padded, dtype, gen):
    q, k, v = (torch.randn(B, H, T, D, generator=gen, device="cuda").to(dtype) for _ in range(3))
    lens = None
    if padded:  # right-padded prompts: every second row ends `padded` tokens early
        lens = torch.tensor([T - padded * (b % 2) for b in range(B)], dtype=torch.int32, device="cuda")
    return q, k, v, lens


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for attention-tiles.json and .md (replaced)")
    ap.add_argument("--sweep", action="store_true", help="every layout of the grid, not only the tuner's list")
    ap.add_argument("--dtypes", default="float16,float32", help="comma-separated torch dtypes (default: %(default)s)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("a CUDA GPU is needed (bits and times are the GPU's)")
    import triton.testing

    import kernels

    os.makedirs(args.out, exist_ok=True)
    cands = configs(args.sweep)
    torch.cuda._sleep(1 << 30)  # half a second of spinning: the clocks are up before the first timing
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for B, H, T, D, padded in SHAPES:
            gen = torch.Generator(device="cuda").manual_seed(T * 131 + B)
            q, k, v, lens = inputs(B, H, T, D, padded, dtype, gen)
            first = None
            for c in cands:
                run = lambda: kernels.attention(q, k, v, causal=True, seq_lens=lens, _config=c)
                try:
                    o = run().clone()
                except Exception as err:  # a layout that does not fit this GPU
                    rows.append(dict(dtype=dtype_name, shape=[B, H, T, D, padded], config=name(c),
                                     error=f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"))
                    continue
                first = o if first is None else first
                same = torch.equal(o.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                   first.view(torch.int16 if dtype != torch.float32 else torch.int32))
                us = triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median") * 1e3
                rows.append(dict(dtype=dtype_name, shape=[B, H, T, D, padded], config=name(c), same_bits=same,
                                 max_diff=float((o.float() - first.float()).abs().max()), us=us))
                print(f"{dtype_name} {B}x{H}x{T}x{D} pad {padded}  {name(c):<18} "
                      f"{'same' if same else 'DIFF'} {rows[-1]['max_diff']:.2e}  {us:8.2f} us", flush=True)
            write(args.out, rows)  # after every shape: a run cut short keeps what it measured
    print(summary(rows))


def write(out, rows):
    import triton

    with open(os.path.join(out, "attention-tiles.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, rows=rows), f, indent=1)
    with open(os.path.join(out, "attention-tiles.md"), "w") as f:
        f.write(summary(rows))


def summary(rows):
    """Per dtype and shape: the fastest layout, the fastest among those with the first's bits,
    and which layouts round differently."""
    lines = ["| dtype | B x H x T x D (pad) | fastest | us | fastest with the first's bits | us | other bits |",
             "|---|---|---|---:|---|---:|---|"]
    keys = sorted({(r["dtype"], tuple(r["shape"])) for r in rows}, key=lambda k: (k[0], k[1][2], k[1][0], k[1][1]))
    for dt, shape in keys:
        ok = [r for r in rows if r["dtype"] == dt and tuple(r["shape"]) == shape and "us" in r]
        if not ok:
            lines.append(f"| {dt} | {'x'.join(map(str, shape[:4]))} ({shape[4]}) | every layout failed | | | | |")
            continue
        best = min(ok, key=lambda r: r["us"])
        same = min((r for r in ok if r["same_bits"]), key=lambda r: r["us"])
        other = ", ".join(r["config"] for r in ok if not r["same_bits"]) or "none"
        lines.append(f"| {dt} | {'x'.join(map(str, shape[:4]))} ({shape[4]}) | {best['config']} | "
                     f"{best['us']:.2f} | {same['config']} | {same['us']:.2f} | {other} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
