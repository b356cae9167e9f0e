"""Probe: does gpt2 batch 64's decode speed follow where its KV cache lies in memory?

Session 121 saw gpt2 batch 64's processes settle at two levels about 1.8% apart, each steady
within its process, and engines built side by side in one process do the same
(bench/results/h200/session-121/, calls 4-5). A step reads only the first ~100 positions of each
(row, head)'s 1,024, runs 128 KB apart, so where those runs fall may decide the level. This
builds --engines engines (each GPT holds its own weight copies) and, for each, --copies caches of
every pad in --pads (positions after each run: KVCache's pad), all kept alive so none reuses
another's memory. Every (engine, pad, copy) is timed in turn, the order reversed every other
round: its cache is installed (the decode state and graphs captured anew, one untimed run), then
--runs timed runs. If copies of one pad sit at different levels, steadily, the level follows the
cache's placement; if a pad lifts every copy to the upper level, it is the fix to time end to end.

    python3 scripts/probe_cache_placement.py --pads 0 8 24 --copies 2 --engines 2 --out /tmp/probe
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

TWO_MB = 2 << 20  # the GPU's large page


def schedule(engines, pads, copies, rounds):
    """[(round, engine, pad, copy)]: every cache once a round, the order reversed on odd rounds."""
    one = [(e, p, c) for e in range(engines) for p in pads for c in range(copies)]
    return [(r, *key) for r in range(rounds) for key in (one if r % 2 == 0 else one[::-1])]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="example:\n" + __doc__.split("\n\n")[-1] + "\n",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", help="a preset (random weights) or a checkpoint folder (default gpt2)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--pads", type=int, nargs="+", default=[0], help="cache pads in positions (default 0)")
    p.add_argument("--copies", type=int, default=2, help="caches of each pad an engine (default 2)")
    p.add_argument("--engines", type=int, default=2, help="engines built side by side (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="times every cache is timed (default 2)")
    p.add_argument("--runs", type=int, default=3, help="timed runs a turn, their median kept (default 3)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, help="folder for probe-cache-placement.json")
    args = p.parse_args(argv)
    for name in ("batch", "copies", "engines", "rounds", "runs", "prompt_len", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    if min(args.pads) < 0:
        p.error(f"--pads: expected cache positions >= 0, got {min(args.pads)}")
    return args


def install(engine, cache):
    """Make `cache` the engine's for its batch: its decode states and prefill graphs (which hold
    the old cache's addresses) are dropped, to be captured anew on the next call."""
    engine._caches[cache.batch] = cache
    engine._states.clear()
    engine._prefill_graphs.clear()


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("probe_cache_placement.py: needs a CUDA GPU")
    cfg, hf, weights = build(args.model, "cuda", torch.float16)
    del hf
    B = args.batch
    engines = [Engine(GPT(cfg, weights, "triton"), use_cuda_graphs=True) for _ in range(args.engines)]
    caches = {(e, p, c): engines[e].model.new_cache(B, pad=p)
              for e in range(args.engines) for p in args.pads for c in range(args.copies)}
    prompts = torch.randint(0, cfg.vocab_size, (B, args.prompt_len), generator=torch.Generator().manual_seed(B)).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, temperature=0)
    rates = {key: [] for key in caches}
    for r, e, p, c in schedule(args.engines, args.pads, args.copies, args.rounds):
        install(engines[e], caches[e, p, c])
        engines[e].generate(prompts, params)  # capture (and, the first time, compile)
        runs = []
        for _ in range(args.runs):
            _, t = engines[e].generate(prompts, params)
            runs.append(B * (t["steps"] - 1) / t["decode_s"])
        rates[e, p, c].append(round(statistics.median(runs)))
    rows = [{"engine": e, "pad": p, "copy": c, "tok_s": rates[e, p, c],
             "k_addr": hex(caches[e, p, c].k.data_ptr()), "k_in_2mb": caches[e, p, c].k.data_ptr() % TWO_MB,
             "v_in_2mb": caches[e, p, c].v.data_ptr() % TWO_MB} for e, p, c in caches]
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"model": args.model, "batch": B, "device": torch.cuda.get_device_name(), "argv": sys.argv[1:]}
        (args.out / "probe-cache-placement.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
