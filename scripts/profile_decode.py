"""Per-kernel GPU time of one minillm decode step. Writes profile-<model>-b<batch>.md.

Default: torch.profiler over eager steps (graphs off: the same kernels the graph replays). With
programmatic dependent launch a kernel starts while the one before still runs, so its time
there includes its wait: an upper bound. --graph profiles replays of the captured step instead
and adds each kernel's critical-path share: how much later the step's last finished kernel ends
because of it (end minus the latest end before it). Those shares add up to the step time, so
they say which kernel costs what in the step as it really runs; beside them, the time between
replays (a step's last end to the next one's first start). The steps run in the
benchmark's cache bucket (prompt 32, 128 new tokens) and attend over about --context cached
positions (default 96, the benchmark's mean: attention's share grows with it).

    python3 scripts/profile_decode.py --model gpt2 --batch 1 --out bench/results
    python3 scripts/profile_decode.py --model gpt2 --batch 1 --graph --out bench/results
    python3 scripts/profile_decode.py --model gpt2 --batch 64 --graph --context 150
"""
import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm.bench import NEW_TOKENS, PROMPT_LEN, model_weights  # noqa: E402
from minillm.benchutil import require_cuda  # noqa: E402
from minillm.generate import Engine  # noqa: E402
from minillm.model import GPT  # noqa: E402
from minillm.sampling import SamplingParams  # noqa: E402


WARMUP_STEPS = 3
# tensor cores (the looping or split GEMV, the whole-slab one past 32 rows); CUDA cores at one row,
# where greedy decoding's lm_head may be the screened head (kernels/vocab_screen.py)
LINEARS = ("_gemv_kernel", "_gemv_slab_kernel", "_gemv_fma_kernel", "_vocab_fma_kernel", "_vocab_screen_kernel")
FUSED = "_decode_attention_proj_kernel"


def cuda_time(e):
    return e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total


def label(names, n_layer):
    """A role for each kernel of one step, in launch order: the decode linears by position
    (qkv, attn-out, fc, mlp-out per layer, then the lm_head), the rest by kernel name. A fused
    attention + projection launch (kernels/decode_attention_proj.py) takes attn-out's place."""
    roles = ["qkv", "attn-out", "fc", "mlp-out"] * n_layer + ["lm_head"]
    out, i = [], 0
    for name in names:
        if name.startswith(LINEARS):
            out.append(roles[i % len(roles)])
            i += 1
        elif name.startswith(FUSED):
            out.append("attention+attn-out")
            i += 1
        else:
            out.append(name.split("(")[0].strip("_").removesuffix("_kernel"))
    return out


def critical_shares(kernels, per_step):
    """Per step, sorted by start: (index in the step, duration, share, gap). share: end minus
    the latest end before it in the step (0 if it ended earlier; the first kernel's share is its
    duration). gap: start minus the previous kernel's end (negative: it started early)."""
    rows = []
    for s in range(len(kernels) // per_step):
        step = sorted(kernels[s * per_step:(s + 1) * per_step], key=lambda e: e.time_range.start)
        latest = None
        for j, e in enumerate(step):
            start, end = e.time_range.start, e.time_range.end
            share = end - start if latest is None else max(0.0, end - latest)
            latest = end if latest is None else max(latest, end)
            rows.append((j, end - start, share, (start - step[j - 1].time_range.end) if j else 0.0))
    return rows


def step_gaps(kernels, per_step):
    """Per step after the first: its first kernel's start minus the step before's last end, in
    us (the time between CUDA-graph replays that no kernel's share covers)."""
    steps = [kernels[s * per_step:(s + 1) * per_step] for s in range(len(kernels) // per_step)]
    return [min(e.time_range.start for e in b) - max(e.time_range.end for e in a) for a, b in zip(steps, steps[1:])]


def table(title, per_role, steps):
    lines = ["", title, "", "| role | launches/step | us/step | us/launch |", "|---|---:|---:|---:|"]
    for role, (n, us) in per_role.items():
        lines.append(f"| {role[:70]} | {n / steps:.0f} | {us / steps:.1f} | {us / n:.2f} |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--graph", action="store_true", help="profile CUDA-graph replays (critical-path shares)")
    ap.add_argument("--context", type=int, default=PROMPT_LEN + NEW_TOKENS // 2,
                    help="cached positions a profiled step attends over, on average (default %(default)s: the "
                         "benchmark's mean, prompt 32 + half of 128 new tokens)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    require_cuda("profile_decode")
    cfg, weights = model_weights(args.model, "cuda", torch.float16)
    engine = Engine(GPT(cfg, weights, "triton"), use_cuda_graphs=args.graph)
    # the benchmark's call (prompt 32, 128 new tokens): its cache-length bucket, and a full cache
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    engine.generate([[1] * PROMPT_LEN] * args.batch, params)  # warm-up: autotuning, compilation, capture
    (st,) = engine._states.values()
    first = args.context - WARMUP_STEPS - args.steps // 2  # cache length of the first warm-up step
    if first < 1 or first + WARMUP_STEPS + args.steps - 1 > st.max_len:
        sys.exit(f"profile_decode: --context {args.context}: expected {WARMUP_STEPS + args.steps // 2 + 1} to "
                 f"{st.max_len - (args.steps + 1) // 2 + 1} for {args.steps} steps (cache bucket {st.max_len})")
    st.pos.fill_(first - 1)  # the fed token's position: the step attends over pos + 1 positions
    st.step.zero_()
    cache = engine.cache_for(args.batch)
    step = st.graph.replay if args.graph else (lambda: engine.decode_one_token(st, params, cache))
    for _ in range(WARMUP_STEPS):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and not e.name.startswith("Memcpy")), key=lambda e: e.time_range.start)
    if len(kernels) % args.steps:
        sys.exit(f"profile_decode: {len(kernels)} kernels over {args.steps} steps: not a whole number per step")
    per_step = len(kernels) // args.steps
    roles = label([e.name for e in kernels[:per_step]], cfg.n_layer)
    per_kernel, per_role = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for i, e in enumerate(kernels):
        for d, key in ((per_kernel, e.name), (per_role, roles[i % per_step])):
            d[key][0] += 1
            d[key][1] += cuda_time(e)
    total = sum(v[1] for v in per_kernel.values()) / args.steps
    mode = "CUDA-graph replays" if args.graph else "eager steps, graphs off"
    lines = [f"# decode step profile: {args.model}, batch {args.batch}, fp16, {torch.cuda.get_device_name()}",
             "", f"torch.profiler over {args.steps} {mode}, attending over {first + WARMUP_STEPS} to "
             f"{first + WARMUP_STEPS + args.steps - 1} cached positions (cache bucket {st.max_len}). "
             f"Kernel time per step: {total:.1f} us over "
             f"{per_step} launches (with dependent launch a kernel's time includes its wait for the one before)"]
    lines += table("by kernel:", dict(sorted(per_kernel.items(), key=lambda kv: -kv[1][1])), args.steps)
    lines += table("by role (decode linears by position):", per_role, args.steps)
    if args.graph:
        share, early = defaultdict(lambda: [0, 0.0]), defaultdict(float)
        rows = critical_shares(kernels, per_step)
        for j, _, sh, gap in rows:
            share[roles[j]][0] += 1
            share[roles[j]][1] += sh
            early[roles[j]] += -gap
        step_us = sum(r[2] for r in rows) / args.steps
        gaps = step_gaps(kernels, per_step)
        lines += ["", f"critical path: {step_us:.1f} us a step (first kernel's start to the last end)", ""]
        if gaps:  # two steps or more
            lines += [f"between steps: {sum(gaps) / len(gaps):.2f} us a step (a step's last end to the next one's "
                      f"first start; {min(gaps):.2f} to {max(gaps):.2f})", ""]
        lines += ["| role | launches/step | share us/step | share us/launch | started before the previous ended, us |",
                  "|---|---:|---:|---:|---:|"]
        for role, (n, us) in share.items():
            lines.append(f"| {role[:70]} | {n / args.steps:.0f} | {us / args.steps:.1f} | {us / n:.2f} | "
                         f"{early[role] / n:.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"profile-{args.model}-b{args.batch}{'-graph' if args.graph else ''}.md"
    (out / name).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
