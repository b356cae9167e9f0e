"""GPU parity record and engine checks (run on the GPU machine, results to --out).

For each model named (a GPT-2 preset's architecture, every layer, random init saved by
transformers, peaked logits):
1. Parity with transformers in fp32 and fp16 (--new-tokens, 256 by default): per-step max logit
   difference (teacher forced over transformers' fp32 greedy sequence), top-1 agreement, greedy
   steps that match.
2. Engine checks: tokens identical with CUDA graphs on and off (greedy and sampled), a prompt
   alone and inside a batch of 64 (batch invariance; where they part, transformers fp32's top-2
   margin there), and 16 seeded sampled runs against transformers (where each parts from
   transformers in the same dtype and in fp32, and transformers' own dtype from its fp32).
Writes gpu-checks-MODEL.json, .log and .md (a summary table) per model; exits 1 if CUDA graphs
on and off gave other ids anywhere.

    python3 scripts/gpu_checks.py --out /tmp/out
    python3 scripts/gpu_checks.py --models gpt2 gpt2-xl --new-tokens 128 --out /tmp/out
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from minillm import LLM, SamplingParams  # noqa: E402
from minillm.benchutil import environment, require_cuda  # noqa: E402
from minillm.config import PRESETS  # noqa: E402
from tests.models import build_checkpoint, hf_generate, hf_in, hf_steps, teacher_forced  # noqa: E402

PROMPT_LEN = 16  # parity's random prompt
CONTEXT = min(c.n_positions for c in PRESETS.values())


def first_diff(a, b):
    """The first step where two id lists part (the shorter's length where one starts the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def top2_margin(hf, ids):
    """transformers' top-1/top-2 logit margin for the token after ids."""
    with torch.no_grad():
        top2 = hf(torch.tensor([ids], device="cuda")).logits[0, -1].float().topk(2).values
    return (top2[0] - top2[1]).item()


def parity(path, hf32, new, log):
    torch.manual_seed(0)
    prompt = torch.randint(0, 50256, (PROMPT_LEN,)).tolist()
    ref_ids = prompt + hf_generate(hf32, prompt, max_new_tokens=new, do_sample=False)
    ref32 = hf_steps(hf32, ref_ids, PROMPT_LEN)
    top2 = ref32.topk(2, -1).values
    report = {"prompt_len": len(prompt), "new_tokens": new,
              "hf_fp32_top2_margin": {"min": (top2[:, 0] - top2[:, 1]).min().item(),
                                      "median": (top2[:, 0] - top2[:, 1]).median().item()}}
    for dtype in ("float32", "float16"):
        llm = LLM(str(path), device="cuda", dtype=dtype)
        hf = hf_in(hf32, path, getattr(torch, dtype))
        ref = hf_steps(hf, ref_ids, PROMPT_LEN)
        mine = teacher_forced(llm.model, ref_ids, PROMPT_LEN)
        diff = (mine - ref).abs().amax(-1)  # per step
        scale = ref.abs().amax().item()
        got = llm.generate([prompt], SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True))[0].token_ids
        hf_same = hf_generate(hf, prompt, max_new_tokens=new, do_sample=False)
        match = first_diff(got, hf_same)
        report[dtype] = {
            "logit_scale": scale, "max_logit_diff": diff.max().item(), "median_step_max_diff": diff.median().item(),
            "max_diff_over_scale": diff.max().item() / scale,
            # against the fp32 truth, and transformers in this dtype against it as the yardstick
            "max_logit_diff_vs_hf_fp32": (mine - ref32).abs().max().item(),
            "hf_same_dtype_max_logit_diff_vs_hf_fp32": (ref - ref32).abs().max().item(),
            "per_step_max_diff": [round(v, 6) for v in diff.tolist()],
            "teacher_forced_top1_agreement_vs_hf_same_dtype": (mine.argmax(-1) == ref.argmax(-1)).float().mean().item(),
            "teacher_forced_top1_agreement_vs_hf_fp32": (mine.argmax(-1) == ref32.argmax(-1)).float().mean().item(),
            "greedy_steps_matching_hf_same_dtype": match, "greedy_identical": got == hf_same,
            # the same engine-to-truth number for transformers itself, as a yardstick
            "hf_same_dtype_top1_agreement_vs_hf_fp32": (ref.argmax(-1) == ref32.argmax(-1)).float().mean().item(),
        }
        log(f"parity {dtype}: max logit diff {diff.max().item():.3e} (scale {scale:.1f}), top-1 agreement "
            f"{report[dtype]['teacher_forced_top1_agreement_vs_hf_same_dtype'] * 100:.2f}%, greedy steps matching "
            f"{match}/{new}")
        del llm
    return report


SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.2)
SAMPLED_RUNS, SAMPLED_TOKENS = 16, 64


def sampled_partings(llm, hf, hf32, prompts):
    """Seeded runs of SAMPLED_TOKENS sampled ids, one a prompt: the step where the engine's ids part
    from transformers' in the same dtype and in fp32, and where transformers' own part from its fp32
    ids (the yardstick: a draw whose two best p / q lie within the dtype's rounding can flip)."""
    partings = {"vs_hf_same_dtype": [], "vs_hf_fp32": [], "hf_same_dtype_vs_hf_fp32": []}
    for seed, prompt in enumerate(prompts, 123):
        mine = llm.generate([prompt], SamplingParams(max_new_tokens=SAMPLED_TOKENS, seed=seed, ignore_eos=True,
                                                     **SAMPLED))[0].token_ids

        def drawn(model):
            torch.manual_seed(seed)
            return hf_generate(model, prompt, max_new_tokens=SAMPLED_TOKENS, do_sample=True, **SAMPLED)

        same = drawn(hf)
        fp32 = same if hf is hf32 else drawn(hf32)
        partings["vs_hf_same_dtype"].append(first_diff(mine, same))
        partings["vs_hf_fp32"].append(first_diff(mine, fp32))
        partings["hf_same_dtype_vs_hf_fp32"].append(first_diff(same, fp32))
    return partings


def engine_checks(path, hf32, log):
    """Per dtype: ids with CUDA graphs on and off (greedy and sampled), a prompt alone and as row
    20 of 64, and sampled_partings. One engine alive at a time (a 64-row fp32 cache of gpt2-xl
    is 37.5 GiB)."""
    res = {}
    torch.manual_seed(1)
    prompts = [torch.randint(0, 50256, (n,)).tolist() for n in (5, 17, 40)]
    filler = [torch.randint(0, 50256, (torch.randint(1, 60, ()).item(),)).tolist() for _ in range(63)]
    seeded = [torch.randint(0, 50256, (n,)).tolist() for n in torch.randint(2, 40, (SAMPLED_RUNS,)).tolist()]
    greedy = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=64, seed=123, ignore_eos=True, **SAMPLED)
    for dtype in ("float16", "float32"):
        r, ids = {}, {}
        for graphs in (True, False):
            llm = LLM(str(path), device="cuda", dtype=dtype, cuda_graphs=graphs)
            ids[graphs] = [[x.token_ids for x in llm.generate(prompts, params)] for params in (greedy, sampled)]
            if graphs:
                alone = llm.generate([prompts[1]], greedy)[0].token_ids
                in_batch = llm.generate(filler[:20] + [prompts[1]] + filler[20:], greedy)[20].token_ids
                hf = hf_in(hf32, path, getattr(torch, dtype))
                r["sampled_partings"] = sampled_partings(llm, hf, hf32, seeded)
                del hf
            del llm
            torch.cuda.empty_cache()
        r["graphs_on_equals_off_greedy"] = ids[True][0] == ids[False][0]
        r["graphs_on_equals_off_sampled"] = ids[True][1] == ids[False][1]
        r["batch_invariance_alone_vs_in_64"] = alone == in_batch
        if alone != in_batch:  # where they part, and how close transformers fp32 found that step
            k = first_diff(alone, in_batch)
            r["batch_first_diff"] = k
            r["batch_hf_fp32_margin_at_first_diff"] = top2_margin(hf32, prompts[1] + alone[:k])
        res[dtype] = r
        log(f"engine checks {dtype}: {r}")
    return res


def summary(name, report):
    """A markdown table of one model's record: the parity figures and the engine checks by dtype."""
    p, e = report["parity"], report["engine"]
    rows = [f"{name}, {p['new_tokens']} new tokens after {p['prompt_len']} (transformers fp32's top-1/top-2 "
            f"margin: min {p['hf_fp32_top2_margin']['min']:.3g}, median {p['hf_fp32_top2_margin']['median']:.3g})",
            "",
            "| dtype | max logit diff / scale | from fp32 (transformers same dtype) | top-1 vs transformers same "
            "dtype | vs fp32 (transformers same dtype) | greedy steps identical | graphs on = off "
            f"| alone = row 20 of 64 | sampled runs identical to transformers' for {SAMPLED_TOKENS} steps |",
            "|---|---|---|---|---|---|---|---|---|"]
    for dtype in ("float32", "float16"):
        r, c = p[dtype], e[dtype]
        same = c["graphs_on_equals_off_greedy"] and c["graphs_on_equals_off_sampled"]
        rows.append(f"| {dtype} | {r['max_logit_diff']:.2e} / {r['logit_scale']:.0f} ({r['max_diff_over_scale']:.1e}) "
                    f"| {r['max_logit_diff_vs_hf_fp32']:.2e} ({r['hf_same_dtype_max_logit_diff_vs_hf_fp32']:.2e}) "
                    f"| {r['teacher_forced_top1_agreement_vs_hf_same_dtype']:.2%} "
                    f"| {r['teacher_forced_top1_agreement_vs_hf_fp32']:.2%} "
                    f"({r['hf_same_dtype_top1_agreement_vs_hf_fp32']:.2%}) "
                    f"| {r['greedy_steps_matching_hf_same_dtype']} / {p['new_tokens']} | {'yes' if same else '**no**'} "
                    f"| {alone_in_64(c)} | {sampled_cell(c, dtype)} |")
    return "\n".join(rows) + "\n"


def alone_in_64(checks):
    if checks["batch_invariance_alone_vs_in_64"]:
        return "yes"
    return (f"from step {checks['batch_first_diff']} (transformers fp32's margin there "
            f"{checks['batch_hf_fp32_margin_at_first_diff']:.3g})")


def parted(steps):
    """'a / n runs' that kept every step, and the median step where runs part."""
    return f"{sum(k == SAMPLED_TOKENS for k in steps)} / {len(steps)}, median {statistics.median(steps):g}"


def sampled_cell(checks, dtype):
    p = checks["sampled_partings"]
    if dtype == "float32":
        return parted(p["vs_hf_same_dtype"])
    return (f"{parted(p['vs_hf_same_dtype'])} (against fp32: {parted(p['vs_hf_fp32'])}; transformers itself: "
            f"{parted(p['hf_same_dtype_vs_hf_fp32'])})")


def graphs_agree(report):
    return all(c[f"graphs_on_equals_off_{k}"] for c in report["engine"].values() for k in ("greedy", "sampled"))


def new_tokens(text):
    n = int(text)
    if not 1 <= n <= CONTEXT - PROMPT_LEN:
        raise argparse.ArgumentTypeError(f"expected 1 to {CONTEXT - PROMPT_LEN} tokens (after a {PROMPT_LEN}-token "
                                         f"prompt, in {CONTEXT:,} positions), got {text}")
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu-checks-MODEL.json, .log and .md")
    ap.add_argument("--models", nargs="+", default=["gpt2"], choices=sorted(PRESETS), metavar="MODEL",
                    help=f"presets whose architecture is checked, each at full depth: {', '.join(PRESETS)} "
                    "(default: gpt2)")
    ap.add_argument("--new-tokens", type=new_tokens, default=256, help="greedy tokens compared (default: 256)")
    args = ap.parse_args(argv)
    require_cuda("gpu_checks")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    failed = []
    for name in args.models:
        lines, t0 = [], time.time()

        def log(s):
            s = f"{time.time() - t0:6.1f} s  {s}"
            print(f"[{name}] {s}", flush=True)
            lines.append(s)

        c = PRESETS[name]
        with tempfile.TemporaryDirectory() as d:
            hf32 = build_checkpoint(d, n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, vocab_size=c.vocab_size,
                                    n_positions=c.n_positions, seed=0, peak=10.0).cuda().eval()
            log(f"built a random {name}-sized checkpoint ({c.n_params / 1e6:.0f}M parameters)")
            report = {"model": name, "env": environment(), "parity": parity(d, hf32, args.new_tokens, log),
                      "engine": engine_checks(d, hf32, log)}
            del hf32
        (out / f"gpu-checks-{name}.json").write_text(json.dumps(report, indent=1))
        (out / f"gpu-checks-{name}.log").write_text("\n".join(lines) + "\n")
        (out / f"gpu-checks-{name}.md").write_text(summary(name, report))
        print(summary(name, report), flush=True)
        if not graphs_agree(report):
            failed.append(name)
    if failed:
        sys.exit(f"gpu_checks: CUDA graphs on and off gave other ids for {', '.join(failed)}")


if __name__ == "__main__":
    main()
