"""Is the one-row vocabulary head bound by DRAM? Times gpt2's head (kernels/vocab_fma.py, the
engine's launch: layernorm folded in, greedy argmax keys) with L2 flushed before it, and with the
head's first X MB read into L2 just before it. A DRAM-bound head gets shorter by about X MB at
the copy bandwidth; a head bound by its programs' own chains does not.

Each sample: a 512 MB read (L2 flushed, clean: a flush that wrote would leave the head its dirty
lines to write back), then the warm-up read of X MB, then the head between two
CUDA events (the flush is long enough that the host has queued the rest before the GPU gets
there). Medians over --reps samples, the variants interleaved. With --no-argmax each warm-up is
timed also without the greedy argmax keys (one relaxed atomic a program, all on one word). With
--screen the screened head (kernels/vocab_screen.py: the argmax from an int8 copy, 0 MB warm) is
timed too, its key word reset before each sample as in a decode step.

    python3 scripts/probe_vocab_l2.py --out bench/results/h200
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
from kernels.argmax_key import EMPTY  # noqa: E402
from minillm.benchutil import copy_bandwidth, device_slug, environment, require_cuda  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="\n".join(__doc__.splitlines()[-1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=50257, help="head width (default gpt2's 50257)")
    ap.add_argument("--embd", type=int, default=768, help="K (default gpt2's 768)")
    ap.add_argument("--warm-mb", type=float, nargs="*", default=[0, 8, 16, 32, 48],
                    help="MB of the head's first columns read into L2 before it (default 0 8 16 32 48)")
    ap.add_argument("--no-argmax", action="store_true",
                    help="time each warm-up also without the greedy argmax keys (their one atomic a program)")
    ap.add_argument("--screen", action="store_true",
                    help="time the screened head too (kernels/vocab_screen.py, the same argmax from an int8 copy)")
    ap.add_argument("--reps", type=int, default=50, help="samples per variant (default 50)")
    ap.add_argument("--out", required=True, help="folder for probe-vocab-l2-<gpu>.json")
    args = ap.parse_args()
    if args.vocab < 16384 or args.embd < 1 or args.reps < 3 or any(mb < 0 for mb in args.warm_mb):
        ap.error("--vocab >= 16384 (a vocabulary head), --embd >= 1, --reps >= 3, --warm-mb >= 0 expected")
    require_cuda("probe_vocab_l2.py")
    dev = torch.device("cuda")
    C, V = args.embd, args.vocab
    gen = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(V, C, device=dev, generator=gen) * C ** -0.5).half().t()  # (C, V), out-major
    colsum = torch.randn(V, device=dev, generator=gen)
    x = torch.randn(1, C, device=dev, generator=gen).half()
    y = torch.empty(1, V, device=dev, dtype=torch.float16)
    keys = torch.full((1,), EMPTY, device=dev, dtype=torch.int64)
    flush = torch.empty(512 << 20, device=dev, dtype=torch.uint8)
    col_bytes = C * 2

    screen = kernels.screen_head(w, None, colsum) if args.screen else None

    def head(argmax=True):
        if argmax == "screen":
            kernels.screened_argmax(x, w, None, colsum, 1e-5, screen, keys)
        else:
            kernels.linear(x, w, None, ln_fold=colsum, ln_eps=1e-5, argmax_keys=keys if argmax else None, out=y)

    def warm(mb):
        cols = min(V, int(mb * (1 << 20)) // col_bytes)
        return w[:, :cols].sum() if cols else None

    variants = [(mb, argmax) for mb in args.warm_mb for argmax in ((True, False) if args.no_argmax else (True,))]
    variants += [(0, "screen")] if args.screen else []
    for _ in range(3):
        for argmax in {argmax for _, argmax in variants}:
            head(argmax)
    torch.cuda.synchronize()
    times = {v: [] for v in variants}
    for _ in range(args.reps):
        for mb, argmax in variants:
            flush.sum()  # read 512 MB: nothing of the head stays in L2
            warm(mb)
            keys.fill_(EMPTY)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            head(argmax)
            e1.record()
            times[mb, argmax].append((e0, e1))
    torch.cuda.synchronize()
    head_mb = V * col_bytes / 2 ** 20
    bw = copy_bandwidth() * 1e9  # bytes/s (read plus written)
    rows = []
    print(f"head {C} x {V} fp16 ({head_mb:.1f} MB), copy bandwidth {bw / 1e12:.2f} TB/s "
          f"(the head's bytes: {V * col_bytes / bw * 1e6:.1f} us)")
    for (mb, argmax), evs in times.items():
        us = statistics.median(e0.elapsed_time(e1) * 1e3 for e0, e1 in evs)
        cold = min(V * col_bytes, mb * (1 << 20))
        rows.append(dict(warm_mb=mb, argmax=argmax, median_us=round(us, 2),
                         dram_bound_us=round((V * col_bytes - cold) / bw * 1e6, 2)))
        if argmax == "screen":  # its int8 copy: half the bytes
            rows[-1]["dram_bound_us"] = round(V * C / bw * 1e6, 2)
        what = {True: "", False: ", no argmax", "screen": ", screened"}[argmax]
        print(f"warm {mb:5.1f} MB{what}: {us:6.2f} us (the bytes left cold at the "
              f"copy bandwidth: {rows[-1]['dram_bound_us']:.2f} us)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"probe-vocab-l2-{device_slug()}.json"
    path.write_text(json.dumps(dict(environment=environment(), copy_gb_s=bw / 1e9, head_mb=head_mb, rows=rows),
                               indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
