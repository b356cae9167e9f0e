"""What one dependency between decode phases costs on this GPU: a grid-wide barrier inside one
persistent launch, against a kernel boundary (a chain of launches in a CUDA graph, with and
without programmatic dependent launch, whose trigger comes after the wait or at the start):
what a persistent decode megakernel would pay per phase where minillm pays a launch. Each
variant also carries one value per program across the boundary, as a decode phase carries its
activations.

    python3 scripts/bench_sync.py [--steps 2000] [--out DIR]
"""
import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from minillm.benchutil import ms_graph, require_cuda  # noqa: E402

# PDL: 0 off; 1 the next kernel may launch once this one has waited (minillm's kernels); 2 as
# soon as this one starts ("early trigger": launches run several kernels ahead)
PDL_NAMES = {0: "", 1: " + PDL", 2: " + PDL, early trigger"}


# A grid-wide barrier: every program arrives, then waits until all have. Sound only when every
# program is resident at once (here: grid <= SMs, tiny programs). The counter only grows within
# a launch, so the n-th barrier waits for n * programs arrivals.
@triton.jit
def _ld_acquire(ptr):
    """ptr's value, loaded with acquire semantics (GPU scope): later loads see what was
    written before the matching release."""
    return tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _grid_sync(bar_ptr, target):
    """Arrive at the barrier bar_ptr and wait until it has counted `target` arrivals."""
    tl.debug_barrier()  # every warp's stores are issued before this program's arrival
    tl.atomic_add(bar_ptr, 1, sem="release")  # one thread per program (a scalar atomic)
    seen = _ld_acquire(bar_ptr)
    while seen < target:
        seen = _ld_acquire(bar_ptr)
    tl.debug_barrier()


@triton.jit
def _barrier_chain_kernel(bar_ptr, val_ptr, STEPS: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    v = pid.to(tl.float32)
    for s in range(STEPS):
        tl.store(val_ptr + (s % 2) * G + pid, v)
        _grid_sync(bar_ptr, (s + 1) * G)
        v = tl.load(val_ptr + (s % 2) * G + (pid + 1) % G, cache_modifier=".cg") + 1.0
    tl.store(val_ptr + 2 * G + pid, v)


@triton.jit
def _hop_kernel(val_ptr, out_ptr, G, PDL: tl.constexpr):
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if PDL != 0:
        tl.extra.cuda.gdc_wait()
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    v = tl.load(val_ptr + (pid + 1) % G) + 1.0
    tl.store(out_ptr + pid, v)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000, help="dependencies per timed run (default 2000)")
    ap.add_argument("--out", default=None, help="folder for sync.json")
    args = ap.parse_args()
    require_cuda("bench_sync")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for G in (sms // 2, sms):
        bar = torch.zeros(1, dtype=torch.int32, device=dev)
        val = torch.randn(3 * G, device=dev)

        def barrier():
            bar.zero_()
            _barrier_chain_kernel[(G,)](bar, val, STEPS=args.steps)

        t = ms_graph([barrier]) * 1e3  # us per launch of STEPS barriers
        rows.append({"variant": "grid barrier (one launch)", "programs": G, "us_per_dep": t / args.steps})
        a, b = torch.randn(G, device=dev), torch.empty(G, device=dev)
        for pdl in (0, 1, 2):
            def chain():
                for i in range(args.steps // 10):
                    src, dst = (a, b) if i % 2 == 0 else (b, a)
                    _hop_kernel[(G,)](src, dst, G, PDL=pdl, launch_pdl=bool(pdl))

            t = ms_graph([chain]) * 1e3
            rows.append({"variant": "kernel boundary, graph" + PDL_NAMES[pdl], "programs": G,
                         "us_per_dep": t / (args.steps // 10)})
    name = torch.cuda.get_device_name(dev)
    print(f"# one dependency between phases, {name}, triton {triton.__version__}")
    print("| variant | programs | us per dependency |\n|---|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['programs']} | {r['us_per_dep']:.2f} |")
    if args.out:
        with open(os.path.join(args.out, "sync.json"), "w") as f:
            json.dump({"device": name, "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
