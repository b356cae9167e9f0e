"""Probe: is gpt2 batch 64's process-to-process spread (two levels about 1.8% apart in session
121's A/A-like variants, each steady within its process) fixed by where a process's buffers land?
One process builds several engines side by side (each GPT owns its own weights, cache and CUDA
graphs, all kept alive so none reuses another's memory) and times them in turn, alternated: if
engines of one process sit at different levels, steadily, the level follows the allocations.

    python3 scripts/probe_process_mode.py --engines 4 --rounds 2 --runs 3
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm.bench import build  # noqa: E402
from minillm.generate import Engine  # noqa: E402
from minillm.model import GPT  # noqa: E402
from minillm.sampling import SamplingParams  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--engines", type=int, default=4, help="engines built side by side (default 4)")
    p.add_argument("--rounds", type=int, default=2, help="times each engine is timed, alternated")
    p.add_argument("--runs", type=int, default=3, help="generate calls a timing (median)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("probe_process_mode: needs a CUDA GPU")
    cfg, hf, weights = build(args.model, "cuda", torch.float16)
    del hf
    engines = [Engine(GPT(cfg, weights, "triton"), use_cuda_graphs=True) for _ in range(args.engines)]
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, 32), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=128, ignore_eos=True, temperature=0)
    for e in engines:
        e.generate(prompts, params)  # cold: capture and compile
    rates = {i: [] for i in range(args.engines)}
    for r in range(args.rounds):
        order = range(args.engines) if r % 2 == 0 else reversed(range(args.engines))
        for i in order:
            runs = []
            for _ in range(args.runs):
                _, t = engines[i].generate(prompts, params)
                runs.append(args.batch * (t["steps"] - 1) / t["decode_s"])
            rates[i].append(round(statistics.median(runs)))
    print(json.dumps({"model": args.model, "batch": args.batch, "tok_s": rates}), flush=True)


if __name__ == "__main__":
    main()
