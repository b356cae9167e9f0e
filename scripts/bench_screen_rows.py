"""Greedy decoding's vocabulary head past one row, alone: the full head (kernels.linear with argmax
keys: the tensor-core GEMV, 77 MB of fp16 at gpt2's size) against the screened head
(kernels/vocab_screen_rows.py: the rows rounded, the int8 copy, then the pick) in each layout asked for, at each
row count. A sample is one CUDA graph replay of [reset the key words, the head] between two CUDA
events, after a 512 MB read that flushes L2; the reset alone is timed the same way and taken off.
Medians over --reps samples, the variants interleaved. The keys are checked equal first.

    python3 scripts/bench_screen_rows.py --rows 8 64 --layouts 64x4x3 128x8x3 --out bench/results/h200
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
from kernels import vocab_screen_rows  # noqa: E402
from kernels._tuning import layout_switch  # noqa: E402
from kernels.argmax_key import EMPTY  # noqa: E402
from minillm.benchutil import copy_bandwidth, device_slug, environment, require_cuda  # noqa: E402


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up call that compiles its kernels): its replay."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _compiled(fn):
    """The compiled kernels of a JIT function so far (for their registers)."""
    out = []
    for cache in getattr(fn, "device_caches", {}).values():
        out += [k for k in cache[0].values() if hasattr(k, "n_regs")]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="\n".join(__doc__.splitlines()[-1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=50257, help="head width (default gpt2's 50257)")
    ap.add_argument("--embd", type=int, default=768, help="K (default gpt2's 768)")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64], help="row counts, 2 to 64 (default 8 64)")
    ap.add_argument("--layouts", nargs="*", default=[],
                    help="screen layouts BLOCK_NxWARPSxSTAGES besides the default (e.g. 128x8x3)")
    ap.add_argument("--reps", type=int, default=30, help="samples per variant (default 30)")
    ap.add_argument("--out", required=True, help="folder for screen-rows-<gpu>.json")
    args = ap.parse_args()
    if args.vocab < 16384 or not 1 <= args.embd <= 1024 or args.embd % 4 or args.reps < 3 or \
            any(not 2 <= m <= vocab_screen_rows.MAX_ROWS for m in args.rows):
        ap.error("--vocab >= 16384, --embd a multiple of 4 up to 1024, --rows 2 to 64, --reps >= 3 expected")
    layouts = [None] + [layout_switch("--layouts", t, "BLOCK_NxWARPSxSTAGES", "64x4x3", pow2=2)
                        for t in args.layouts]
    require_cuda("bench_screen_rows.py")
    dev = torch.device("cuda")
    C, V = args.embd, args.vocab
    gen = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(V, C, device=dev, generator=gen) * C ** -0.5).half().t()  # (C, V), out-major
    bias = torch.randn(V, device=dev, generator=gen).half()
    colsum = w.double().sum(0).float()
    screen = kernels.screen_head(w, bias, colsum)
    flush = torch.empty(512 << 20, device=dev, dtype=torch.uint8)
    results = []
    for M in args.rows:
        x = (torch.randn(M, C, device=dev, generator=gen) * 2 + 0.3).half()
        keys = torch.full((M,), EMPTY, device=dev, dtype=torch.int64)
        variants = {"reset": graphed(lambda: keys.fill_(EMPTY)),
                    "full": graphed(lambda: (keys.fill_(EMPTY),
                                             kernels.linear(x, w, bias, ln_fold=colsum, argmax_keys=keys)))}
        full_keys = keys.clone()
        for layout in layouts:
            vocab_screen_rows.FORCED_LAYOUT = layout
            name = "screen " + ("x".join(map(str, layout)) if layout else "default")
            variants[name] = graphed(lambda: (keys.fill_(EMPTY), kernels.screened_argmax(
                x, w, bias, colsum, 1e-5, screen, keys)))
            torch.cuda.synchronize()
            if not torch.equal(keys, full_keys):
                sys.exit(f"{name} at {M} rows: keys differ from the full head's in rows "
                         f"{(keys != full_keys).nonzero().flatten().tolist()}")
        vocab_screen_rows.FORCED_LAYOUT = None
        # the default layout's three launches apart: the rounding, the screen (keys reset first), and
        # the pick from the words as the screen leaves them (restored first); each row's candidate groups
        meta = vocab_screen_rows.rows_config(M)
        rows = vocab_screen_rows.quantized_rows(x)
        gmax = torch.empty(M, -(-V // vocab_screen_rows.group_n(C)), dtype=x.dtype, device=dev)
        bmax = torch.empty(M, -(-V // meta["BLOCK_N"]), dtype=x.dtype, device=dev)
        posted = torch.empty_like(keys)
        variants["rounding launch"] = graphed(lambda: (keys.fill_(EMPTY), vocab_screen_rows.quantize_launch(
            x, rows, False)))
        variants["screen launch"] = graphed(lambda: (keys.fill_(EMPTY), vocab_screen_rows.screen_launch(
            rows, screen, colsum, 1e-5, keys, gmax, bmax, meta, False)))
        posted.copy_(keys)
        variants["restore"] = graphed(lambda: keys.copy_(posted))
        variants["pick launch"] = graphed(lambda: (keys.copy_(posted), vocab_screen_rows.pick_launch(
            x, w, bias, colsum, 1e-5, keys, gmax, bmax, meta["BLOCK_N"], False)))
        threshold = (posted >> 32).int()
        threshold = torch.where(threshold < 0, threshold ^ 0x7FFFFFFF, threshold).view(torch.float32)
        groups = (gmax.float() >= threshold[:, None]).sum(1)
        print(f"rows {M:>2}  candidate groups a row: median {groups.median().item()}, max {groups.max().item()}")
        for name in ("quantize", "screen", "pick"):
            fn = getattr(vocab_screen_rows, f"_{name}_rows_kernel")
            for compiled in _compiled(fn):
                print(f"rows {M:>2}  {name}: {compiled.n_regs} registers, {compiled.n_spills} spilled")
        times = {k: [] for k in variants}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(args.reps):
            for k, replay in variants.items():
                flush.zero_()
                start.record()
                replay()
                end.record()
                torch.cuda.synchronize()
                times[k].append(start.elapsed_time(end) * 1e3)
        reset = statistics.median(times.pop("reset"))
        restore = statistics.median(times.pop("restore"))
        for k, t in times.items():
            us = statistics.median(t) - (restore if k == "pick launch" else reset)
            results.append(dict(rows=M, variant=k, us=round(us, 2)))
            print(f"rows {M:>2}  {k:<22} {us:7.2f} us")
    bw = copy_bandwidth()  # GB/s
    floor_us = {"fp16 head": V * C * 2 / bw * 1e-3, "int8 copy": V * C / bw * 1e-3}
    print("at the copy bandwidth: " + ", ".join(f"{k} {v:.2f} us" for k, v in floor_us.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"screen-rows-{device_slug()}.json"
    path.write_text(json.dumps(dict(environment=environment(), vocab=V, embd=C, copy_bandwidth=bw,
                                    floor_us=floor_us, results=results), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
