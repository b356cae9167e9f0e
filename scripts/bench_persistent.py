"""Probe: how fast could a batch-1 decode step be as ONE persistent launch?

minillm runs a layer as four dependent kernels, and at gpt2-xl's size each linear fills about
all the bytes its resident programs can have in flight, so each kernel boundary drains the
memory pipe (docs/benchmarks.md, "What limits the speed, in full"). Here one to four programs
on every SM (TILES) run the whole step and ask for their weight tiles one tile ahead whatever
the phase, so weights keep streaming while they wait for the previous phase's values.

The phases meet without barriers or fences: every activation is an 8-byte word, its fp32 value
in the low half and in the high half a tag (the launch's epoch and the phase that wrote it). A
program reads the values it needs and reads them again until every tag is the one it expects.
(A first version met at grid barriers, an arrival counter and a spin: at dbd8aa3 it was 2.9-9x
slower than the engine, its registers spilling.)

The step, with real arithmetic in fp32 over fp16 weights (checked against torch):
- each linear's output columns are split evenly over the programs, every program over the whole
  of K (no split-K merge), its weights streamed as (TN columns x TK of K) tiles;
- attention: one program a head (heads round-robin over the programs), over CACHE_POSITIONS
  cached keys and values, read once q is in;
- a layer is five phases (qkv, attention, attn-out + residual, fc, mlp-out + residual), then
  the lm_head.
Left out (each cheap in this design, or a launch minillm has too): the layernorms (each program
reads whole rows of x, so it can take their statistics itself), GELU, the embedding, the new
key and value's store, the lm_head's argmax.

Outcome on an H200 (Triton 3.6; bench/results/h200/persistent-probe/): at best 2,423 us a step
at gpt2-xl and 342 us at gpt2, against the engine's 1,323 and 134. The tiles' loads alone stream
at the copy rate (733 us at gpt2-xl); each tile's sum over K, which Triton reduces across warps,
costs most of the rest. One-warp programs keep it in a warp, but then so many programs poll that
the step gets slower.

    python3 scripts/bench_persistent.py --out bench/results
"""
import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels._tuning import programs_by_registers  # noqa: E402
from kernels.decode_attention import LOG2E  # noqa: E402
from minillm.bench import floor_seconds  # noqa: E402
from minillm.benchutil import copy_bandwidth, device_slug, environment, ms_graph, require_cuda  # noqa: E402
from minillm.config import PRESETS  # noqa: E402
from persistent_kernels import persistent_step_kernel  # noqa: E402
from persistent_plan import act_offsets, phases, plan, reference, weight_count, weight_views  # noqa: E402
from probe_common import rel_err  # noqa: E402

CACHE_POSITIONS = 96  # the generation benchmark's mean context, as scripts/bench_floor.py
# (TN, TK, warps, programs an SM, register cap or None): more programs an SM keep more tiles in flight
# one warp a program keeps each tile's sum over K inside the warp (call 9: reduced across warps,
# it cost about 1.6 us a tile); call 7 ran four more multi-warp layouts, none better
TILES = [(16, 2048, 8, 1, None), (8, 1024, 4, 3, 168), (4, 1024, 1, 8, None), (4, 512, 1, 8, None),
         (8, 512, 1, 8, None)]


class Step:
    """One model's persistent step: weights, cache, plan and buffers for one tile layout."""

    def __init__(self, cfg, programs, tn, tk, warps, positions, device, prefetch=True, sync=True, maxnreg=None,
                 stream_only=False, parts=2, seed=0):
        g = torch.Generator(device=device).manual_seed(seed)
        self.cfg, self.positions, self.warps, self.tn, self.tk = cfg, positions, warps, tn, tk
        self.prefetch, self.sync, self.maxnreg = prefetch, sync, maxnreg
        self.stream_only, self.parts = stream_only, parts
        self.compiled = None
        desc, counts, self.w_offs, self.n_phases = plan(cfg, programs, tn, tk, positions)
        self.desc, self.counts = desc.to(device), counts.to(device)
        self.weights = torch.empty(weight_count(cfg), dtype=torch.float16, device=device)
        for w in weight_views(cfg, self.weights, self.w_offs):
            w.normal_(0, 1 / math.sqrt(w.shape[1]), generator=g)
        self.cache = torch.randn(cfg.n_layer * cfg.n_head * 2 * positions * cfg.head_dim, generator=g,
                                 device=device).half()
        self.acts, size = act_offsets(cfg)
        # tagged words (values: .values()); poisoned with NaN under tag 0, which no phase waits for,
        # but the step's input x, which is read as it is
        self.act = torch.full((size,), float("nan"), device=device).view(torch.int32).long() & 0xFFFFFFFF
        x0 = torch.randn(cfg.n_embd, generator=g, device=device)
        self.act[:cfg.n_embd] = x0.view(torch.int32).long() & 0xFFFFFFFF
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)

    def __call__(self, warmup=False):
        """Launch the step (warmup: compile only); returns the compiled kernel."""
        c = self.cfg
        args = (self.desc, self.counts, self.weights, self.cache, self.act, self.epoch, self.desc.shape[1],
                self.n_phases, LOG2E / math.sqrt(c.head_dim))  # log2(e): softmax via exp2
        meta = dict(TN=self.tn, TK=self.tk, BLOCK_P=max(16, triton.next_power_of_2(self.positions)), ATT_P=16,
                    HEAD_D=c.head_dim, PREFETCH=self.prefetch, SYNC=self.sync, STREAM_ONLY=self.stream_only,
                    PARTS=self.parts,
                    num_warps=self.warps, **({} if self.maxnreg is None else {"maxnreg": self.maxnreg}))
        grid = (self.desc.shape[0],)
        if warmup:
            self.compiled = persistent_step_kernel.warmup(*args, grid=grid, **meta)
        else:
            self.compiled = persistent_step_kernel[grid](*args, **meta)
        return self.compiled

    def values(self, name):
        """An activation's fp32 values (the low halves of its words) and tags (the high halves)."""
        at = self.acts[name]
        words = self.act[at:at + (self.cfg.vocab_size if name[1] == "logits" else self.cfg.n_embd)]
        return (words & 0xFFFFFFFF).int().view(torch.float32), words >> 32

    def check(self):
        """Largest error of the logits against torch, relative to their largest magnitude."""
        self()
        c = self.cfg
        logits = self.values((c.n_layer, "logits"))[0]
        _, want = reference(c, self.weights, self.w_offs, self.cache, self.values((0, "x"))[0], self.positions)
        return rel_err(logits, want)

    @property
    def weight_bytes(self):
        return self.weights.numel() * 2


def resident_per_sm(kernel, warps, props):
    """How many programs of a compiled kernel an SM holds at once (registers, threads, shared
    memory): every program of the step must be resident, or one waits forever for values that a
    program not yet started would write."""
    kernel._init_handles()  # loads the module: n_regs is known from here on
    by_regs = programs_by_registers(kernel.n_regs, warps, props.regs_per_multiprocessor)
    by_threads = props.max_threads_per_multi_processor // (32 * warps)
    by_shared = props.shared_memory_per_multiprocessor // max(kernel.metadata.shared, 1)
    return min(by_regs, by_threads, by_shared)


# (prefetch, sync, stream only, parts). Without prefetch (each tile once its input is in) the step
# was 1-8% slower in calls 5 and 6, except at 32 x 1024 tiles (2-5% faster, not explained)
VARIANTS = {
    "tile ahead": (True, True, False, 2),
    "tile ahead, no waits (wrong values: the loop's own pace)": (True, False, False, 2),
    "no waits, no input reads (x = 1)": (True, False, False, 1),
    "no waits, no input reads, no stores": (True, False, False, 0),
    "the tiles' loads alone (no input, reduction or store)": (True, False, True, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt2", "gpt2-xl"], choices=sorted(PRESETS))
    ap.add_argument("--positions", type=int, default=CACHE_POSITIONS,
                    help=f"cache positions the attention reads (default {CACHE_POSITIONS})")
    ap.add_argument("--out", default=None, help="folder for persistent-<device>.json")
    args = ap.parse_args()
    if args.positions < 1:
        ap.error(f"--positions: expected at least 1, got {args.positions}")
    require_cuda("bench_persistent")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    copy_gbs = copy_bandwidth()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s, {sms} SMs")
    print("| model | TN x TK (KiB), warps, programs an SM, register cap | variant | regs (spills) | us/step | floor us "
          "| floor fraction | max rel. error |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    rows = []
    for name in args.models:
        cfg = PRESETS[name]
        floor_us = floor_seconds(cfg, 1, args.positions, 2, copy_gbs) * 1e6
        for tn, tk, warps, per_sm, cap in TILES:
            layout = f"{tn} x {tk} ({tn * tk * 2 // 1024}), {warps}, {per_sm}, {cap or '-'}"
            for variant, (prefetch, sync, stream_only, parts) in VARIANTS.items():
                programs = min(per_sm * sms, cfg.n_embd)  # (plan's limit: gpt2 at 8 an SM has 768)
                step = Step(cfg, programs, tn, tk, warps, args.positions, dev, prefetch=prefetch, sync=sync,
                            maxnreg=cap, stream_only=stream_only, parts=parts)
                fits = resident_per_sm(step(warmup=True), warps, props)
                regs, spills = (getattr(step.compiled, a, None) for a in ("n_regs", "n_spills"))
                r = {"model": name, "tn": tn, "tk": tk, "tile_kib": tn * tk * 2 / 1024, "warps": warps,
                     "programs_per_sm": per_sm, "programs": programs, "maxnreg": cap, "resident_per_sm": fits,
                     "variant": variant,
                     "prefetch": prefetch, "sync": sync, "stream_only": stream_only, "parts": parts,
                     "phases": step.n_phases,
                     "n_regs": regs, "n_spills": spills, "floor_us": floor_us, "weight_bytes": step.weight_bytes}
                if fits < per_sm:  # would never finish
                    print(f"| {name} | {layout} | {variant} | {regs} ({spills}) | not run: {fits} fit an SM | | | |")
                else:
                    err = step.check() if sync else None
                    us = ms_graph([step], reps=10) * 1e3
                    r.update(us_per_step=us, floor_fraction=floor_us / us, max_rel_error=err)
                    print(f"| {name} | {layout} | {variant} | {regs} ({spills}) | {us:.1f} | {floor_us:.1f} "
                          f"| {floor_us / us:.2f} | {'-' if err is None else f'{err:.1e}'} |", flush=True)
                rows.append(r)
                del step
                torch.cuda.empty_cache()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"persistent-{device_slug()}.json").write_text(json.dumps(
            {"environment": environment(), "copy_gbs": copy_gbs, "sms": sms, "positions": args.positions,
             "phases_per_step": {m: len(phases(PRESETS[m])) for m in args.models},
             "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
