"""What ptxas made of a model's decode kernels, for Hopper (sm_90a), on any machine: each
kernel's TTGIR (Triton's layouts), PTX and SASS written out, and a summary of its SASS around
the dependent-launch wait (ACQBULK), where a decode kernel's critical path starts: instructions
before and after it, barriers, and the fp16 -> fp32 conversions (HADD2.F32) that ptxas may sink
past it.

It drives the model's decode step as scripts/check_compile.py does (compile only, nothing runs),
so a layout switch (MINILLM_FUSED_LAYOUT=..., MINILLM_ATTN_EARLY_F32=...) set in the environment
shows up in the code. Counts are of the whole kernel text on either side of the wait, loops and
branches included: a way to compare two variants, not a cycle count.

    python scripts/inspect_sass.py --model gpt2 --batch 1 --cache-len 256 --kernel attention_proj --out /tmp/sass
"""
import argparse
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from check_compile import (cubin_usage, drive_model, find_cuobjdump, install_compile_only,  # noqa: E402
                           run_cuobjdump)

OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")
WAIT = "ACQBULK"  # griddepcontrol.wait in SASS


def opcodes(sass):
    """The SASS instructions in order, as (opcode, modifiers)."""
    return [(m.group(1), m.group(2)) for m in OPCODE.finditer(sass)]


def around_wait(ops):
    """(before, after): Counters of opcodes on either side of the last dependent-launch wait
    (everything counts as before where there is none)."""
    names = [op for op, _ in ops]
    cut = len(names) - names[::-1].index(WAIT) if WAIT in names else len(names)
    tag = [op + (".F32" if op == "HADD2" and ".F32" in mods else "") for op, mods in ops]
    return Counter(tag[:cut]), Counter(tag[cut:])


def summary_row(name, blocks, kernel, regs, local, before, after):
    wait = "yes" if before[WAIT] else "no"
    mix = ", ".join(f"{op} {n}" for op, n in after.most_common(8))
    return (f"| {name} | {blocks} | {kernel.metadata.num_warps} | {regs} | {local} | {wait} "
            f"| {sum(before.values())} | {sum(after.values())} | {after['BAR']} | {before['HADD2.F32']} "
            f"| {after['HADD2.F32']} | {mix} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n".join(__doc__.splitlines()[-1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", help="preset (default gpt2)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--batch", type=int, default=1, help="decode rows (default 1)")
    p.add_argument("--cache-len", type=int, default=256, help="attended cache length (default 256)")
    p.add_argument("--kernel", default="", help="only kernels whose name contains this, the others not compiled "
                                                 "(default: all)")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90)")
    p.add_argument("--sms", type=int, default=132, help="multiprocessors the grids are sized for (default 132)")
    p.add_argument("--out", required=True, help="folder for <kernel>-<hash>.ptx / .sass and summary.md")
    args = p.parse_args()
    if args.batch < 1 or args.cache_len < 2:
        p.error(f"--batch / --cache-len: expected >= 1 / >= 2, got {args.batch} / {args.cache_len}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("run without TRITON_INTERPRET=1: the interpreter never compiles")
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        p.error("this Triton bundles no cuobjdump (triton/backends/nvidia/bin): no SASS to read")
    os.environ["MINILLM_AUTOTUNE"] = "1"

    import torch

    log, where, failures = {}, [""], []
    install_compile_only(args.arch, args.sms, False, log, where, failures, only=args.kernel)
    t0 = time.perf_counter()
    drive_model(args.model, getattr(torch, args.dtype), [args.batch], [args.cache_len], [], where)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for (name, digest), (kernel, _, _, blocks, *_) in sorted(log.items()):
        sass = run_cuobjdump(cuobjdump, kernel.asm["cubin"], "-sass", check=True)
        stem = f"{name.strip('_')}-{digest[:8]}"
        (out / f"{stem}.ptx").write_text(kernel.asm["ptx"])
        (out / f"{stem}.ttgir").write_text(kernel.asm["ttgir"])
        (out / f"{stem}.sass").write_text(sass)
        regs, local = cubin_usage(kernel, cuobjdump)
        rows.append(summary_row(name, blocks, kernel, regs, local, *around_wait(opcodes(sass))))
    table = "\n".join([
        f"# SASS around the dependent-launch wait: {args.model} {args.dtype}, {args.batch} rows, cache "
        f"{args.cache_len}, sm_{args.arch}a ({time.perf_counter() - t0:.0f} s)", "",
        "| kernel | blocks | warps | registers | local bytes | wait | instructions before | after | barriers after "
        "| HADD2.F32 before | after | most frequent after the wait |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|", *rows]) + "\n"
    (out / "summary.md").write_text(table)
    print(table)
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    if not rows:
        print(f"no compiled kernel's name contains {args.kernel!r}", file=sys.stderr)
    return 1 if failures or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
