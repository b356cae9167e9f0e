"""How much minillm's decode speed depends on the prompt. Writes prompt-speed-<model>-b<batch>.md.

`minillm bench` times one prompt (its ids are the first CUDA draw after seed 0) and
`scripts/ab_decode.py` another (a CPU generator seeded with the batch size); both run the same
random-weight model, yet on one H200 (session 140) the bench's gpt2 batch 1 read 1.8% below the
A/B's. Greedy decoding's screened head (kernels/vocab_screen.py) computes exactly only the
columns it cannot rule out, so its work depends on the logits, and so on the tokens. This script
times one engine on the bench's prompt and on --prompts more (seeds 1, 2, ...: seed 1 is
ab_decode's at batch 1), in alternation over --rounds, and reports per prompt the median decode
tokens/s, its range, how many distinct tokens the greedy continuation holds (a loop holds few)
and a hash of the ids. Run it with MINILLM_VOCAB_SCREEN=0 beside to see the head's share.
Session 140 (call 3): 16 prompts within 0.3% of each other at gpt2 batch 1, with the screen and
without, and 6 within 0.1% at gpt2-xl. The bench's gap was its process's heap: the copy test's
2 GiB stayed in torch's cache (`minillm.benchutil.copy_bandwidth`, calls 4-5).

    python3 scripts/probe_prompt_speed.py --model gpt2 --batch 1 --prompts 7 --rounds 5 --out $OUT
    MINILLM_VOCAB_SCREEN=0 python3 scripts/probe_prompt_speed.py --out $OUT/no-screen
"""
import argparse
import hashlib
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm.bench import NEW_TOKENS, PROMPT_LEN, model_weights  # noqa: E402
from minillm.benchutil import copy_bandwidth, require_cuda  # noqa: E402
from minillm.config import PRESETS  # noqa: E402
from minillm.generate import Engine  # noqa: E402
from minillm.model import GPT  # noqa: E402
from minillm.sampling import SamplingParams  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", choices=sorted(PRESETS),
                   help="preset, with the bench's random weights (default gpt2): the bench's prompt is drawn "
                        "after them")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--prompts", type=int, default=7, help="random prompts beside the bench's (default 7)")
    p.add_argument("--rounds", type=int, default=5, help="timed runs of every prompt, alternated (default 5)")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for the markdown report")
    args = p.parse_args(argv)
    if args.batch < 1 or args.prompts < 0 or args.rounds < 1:
        p.error(f"--batch / --prompts / --rounds: expected >= 1 / >= 0 / >= 1, "
                f"got {args.batch} / {args.prompts} / {args.rounds}")
    return args


def prompts_for(cfg, batch, n_seeded, device):
    """{name: (B, PROMPT_LEN) id lists}: the bench's prompt first, drawn as `minillm bench` draws it
    (the CUDA generator's first draw after model_weights seeded it with 0), then seeds 1..n."""
    named = {"bench": torch.randint(0, cfg.vocab_size, (batch, PROMPT_LEN), device=device).tolist()}
    for s in range(1, n_seeded + 1):
        gen = torch.Generator().manual_seed(s)
        named[f"seed {s}"] = torch.randint(0, cfg.vocab_size, (batch, PROMPT_LEN), generator=gen).tolist()
    return named


def measure(engine, named, rounds):
    """{name: (tokens/s per round, ids)}, the prompts alternated within each round after one
    untimed run of each (compilation, graph capture)."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0)
    rates, ids = {name: [] for name in named}, {}
    for name, prompts in named.items():
        ids[name], _ = engine.generate(prompts, params)
    for _ in range(rounds):
        for name, prompts in named.items():
            out, t = engine.generate(prompts, params)
            if out != ids[name]:
                raise RuntimeError(f"prompt {name}: greedy ids changed between runs")
            rates[name].append(len(prompts) * (t["steps"] - 1) / t["decode_s"])
    return {name: (rates[name], ids[name]) for name in named}


def report(results, title):
    base = statistics.median(results["bench"][0])
    lines = [f"# {title}", "",
             "| prompt | decode tok/s (median) | range | against the bench's | distinct new tokens | ids |",
             "|---|---:|---:|---:|---:|---|"]
    for name, (rates, ids) in results.items():
        med = statistics.median(rates)
        distinct = len({t for row in ids for t in row})
        lines.append(f"| {name} | {med:,.0f} | {min(rates):,.0f}-{max(rates):,.0f} | {med / base - 1:+.1%} | "
                     f"{distinct} | {hashlib.sha1(str(ids).encode()).hexdigest()[:10]} |")
    meds = [statistics.median(r) for r, _ in results.values()]
    lines += ["", f"Across prompts: {min(meds):,.0f}-{max(meds):,.0f} tok/s "
                  f"({max(meds) / min(meds) - 1:.1%} from the slowest to the fastest)."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    require_cuda("probe_prompt_speed.py")
    bw = copy_bandwidth()  # as the bench does first; it hands its buffers back (f5b5f74)
    cfg, weights = model_weights(args.model, "cuda", torch.float16)
    named = prompts_for(cfg, args.batch, args.prompts, "cuda")
    engine = Engine(GPT(cfg, weights, "triton"), use_cuda_graphs=True)
    results = measure(engine, named, args.rounds)
    screen = os.environ.get("MINILLM_VOCAB_SCREEN", "1") != "0"
    title = (f"{args.model} batch {args.batch}, greedy, prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens, "
             f"{args.rounds} rounds, screened head {'on' if screen else 'off'} "
             f"({torch.cuda.get_device_name()}, copy {bw:,.0f} GB/s)")
    text = report(results, title)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"prompt-speed-{args.model}-b{args.batch}.md").write_text(text)


if __name__ == "__main__":
    main()
