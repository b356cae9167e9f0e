"""Per-kernel GPU time of one minillm decode step (torch.profiler over eager steps, graphs off:
the GPU work is the same kernels the graph replays). Writes profile-<model>-b<batch>.md.

    python3 scripts/profile_decode.py --model gpt2 --batch 1 --out bench/results
"""
import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm.bench import build  # noqa: E402
from minillm.benchutil import require_cuda  # noqa: E402
from minillm.generate import Engine  # noqa: E402
from minillm.model import GPT  # noqa: E402
from minillm.sampling import SamplingParams  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    require_cuda("profile_decode")
    cfg, hf, weights = build(args.model, "cuda", torch.float16)
    del hf
    engine = Engine(GPT(cfg, weights, "triton"), use_cuda_graphs=False)
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)  # 32 + 8 positions: bucket 128
    prompts = [[1] * 32] * args.batch
    engine.generate(prompts, params)  # warm-up: autotuning, compilation
    st = engine._state(args.batch, params, None, max_len=128)  # the bucket generate() uses here
    cache = engine.cache_for(args.batch)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.decode_one_token(st, params, cache, None)
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += 1
            per[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    # the decode linears by role: each step launches qkv, attn-out, fc, mlp-out per layer, then the lm_head
    roles = ["qkv", "attn-out", "fc", "mlp-out"] * cfg.n_layer + ["lm_head"]
    kernels_in_order = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                              key=lambda e: e.time_range.start)
    by_role = defaultdict(lambda: [0, 0.0])
    # both decode GEMVs: tensor cores (_gemv_kernel) and, at one row, CUDA cores (_gemv_fma_kernel)
    linear_names = [e for e in kernels_in_order if e.name.startswith(("_gemv_kernel", "_gemv_fma_kernel"))]
    for i, e in enumerate(linear_names):
        r = by_role[roles[i % len(roles)]]
        r[0] += 1
        r[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])
    total = sum(v[1] for v in per.values()) / args.steps
    lines = [f"# decode step profile: {args.model}, batch {args.batch}, fp16, {torch.cuda.get_device_name()}",
             "", f"GPU kernel time per step: {total:.1f} us over {sum(v[0] for v in per.values()) / args.steps:.0f} "
             "launches (graph replay adds the gaps between them)", "",
             "| kernel | launches/step | us/step | us/launch |", "|---|---:|---:|---:|"]
    for name, (n, us) in rows:
        lines.append(f"| {name[:70]} | {n / args.steps:.0f} | {us / args.steps:.1f} | {us / n:.2f} |")
    lines += ["", "decode linears by role:", "",
              "| role | launches/step | us/step | us/launch |", "|---|---:|---:|---:|"]
    for role in ("qkv", "attn-out", "fc", "mlp-out", "lm_head"):
        n, us = by_role[role]
        if n:
            lines.append(f"| {role} | {n / args.steps:.0f} | {us / args.steps:.1f} | {us / n:.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile-{args.model}-b{args.batch}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:16] + lines[-8:]))


if __name__ == "__main__":
    main()
