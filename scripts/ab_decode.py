"""Same-call A/B of minillm's decode speed between settings of its environment switches.

Every engine switch (MINILLM_GEMV_FIXED, MINILLM_FIXED_STATS, MINILLM_ATTN_NEW_APART, ...) is
read at import, so each variant runs in a fresh process; the variants alternate in rounds, so a
drift of the machine (clocks, another tenant) shows as spread between rounds instead of as a
difference between variants. Every second round runs them in reverse order (A B, B A, A B, ...),
so no variant always runs first or after the same neighbour, and a steady drift over the call
weighs on every variant alike over each pair of rounds. Each process builds the model (a preset
gets random weights, as `minillm bench`), generates once cold, then times --runs warm runs per
batch (prompt 32, 128 new tokens, greedy or with --temperature sampled from seed 0, EOS ignored)
and reports the median decode tokens/s, the range, the median time to first token and a hash of
the ids. The table gives each variant's median per round (tokens/s, or --metric ttft), the change
against the first variant and whether the ids matched it. The worker finds minillm on PYTHONPATH
first, so a variant's PYTHONPATH may name another copy of the tree, an older commit's too (one
from before minillm.bench.model_weights gets the same weights from its build).
A process's speed is not all the variant's: at gpt2 batch 64 (H200, session 121) processes of
one setting settled at two levels about 1.8% apart, each steady over its runs
(bench/results/h200/session-121/). Within a process a lone engine kept its level over 24
recaptures, and the lower level inside one process came only with several models in it
(session-123/). With two rounds a variant's two processes can both land high, so a difference
under about 2% there needs more rounds (or the A/A beside it).
AB_HEAP, the worker's own switch, prepares the process's memory around the model, to time where
it lies (session 140: one GPU's processes read gpt2 batch 1 at 8,399-8,755 tok/s by what they had
allocated before the model): "fresh" (unset) as a user's process; "copy-test" first allocates and
frees what `minillm bench`'s copy test did before f5b5f74 (1 + 1 GiB and do_bench's 256 MiB, left
in torch's cache); "arena" / "arena-2m" copy the model's weights into one allocation in the order
a step reads them, each on a 256-byte / 2 MiB boundary (scripts/probe_cache_placement.py's arena).

  python3 scripts/ab_decode.py --env MINILLM_GEMV_FIXED=0 --env MINILLM_GEMV_FIXED=1 \\
      --model gpt2-medium gpt2-xl --batch 1 2 --rounds 2 --out $OUT
  python3 scripts/ab_decode.py --env "" --env MINILLM_PDL=0 --model gpt2 --batch 1   # "": as set
  python3 scripts/ab_decode.py --env "" --env MINILLM_AA=1 --rounds 4   # A/A (a switch nothing reads): the noise
  python3 scripts/ab_decode.py --env "" --env MINILLM_L2_AHEAD=0 --temperature 1   # sampled, top_k 50
  python3 scripts/ab_decode.py --env PYTHONPATH=. --env PYTHONPATH=/tmp/old --metric ttft \\
      --prompt-len 1024 --new-tokens 2   # time to first token (ms), two trees
  python3 scripts/ab_decode.py --env AB_HEAP=fresh --env AB_HEAP=copy-test --env AB_HEAP=arena-2m --rounds 3
"""
import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAPS = ("fresh", "copy-test", "arena", "arena-2m")  # AB_HEAP's values (see above)


def heap_recipe():
    """AB_HEAP's value, checked: how the worker lays out its process's memory."""
    recipe = os.environ.get("AB_HEAP") or "fresh"
    if recipe not in HEAPS:
        raise ValueError(f"AB_HEAP: expected one of {', '.join(HEAPS)} (or unset), got {recipe!r}")
    return recipe


def variant(text):
    """'NAME=VALUE,NAME=VALUE' (or '' for the environment as it is) -> {NAME: VALUE}. A comma
    starts a new pair only before NAME=, so a value may hold commas (MINILLM_X=768,3072)."""
    env = {}
    for item in filter(None, re.split(r",(?=[A-Za-z_][A-Za-z0-9_]*=)", text)):
        name, eq, value = item.partition("=")
        if not eq or not name.isidentifier() or not name.isupper():
            raise argparse.ArgumentTypeError(
                f"expected NAME=VALUE pairs split by commas (NAME upper-case), got {item!r}")
        env[name] = value
    return env


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", type=variant, action="append", default=[],
                   help="one variant: NAME=VALUE[,...] ('' = the environment as it is); two or more")
    p.add_argument("--model", nargs="+", default=["gpt2"], help="presets (random weights) or checkpoint folders")
    p.add_argument("--batch", nargs="+", type=int, default=[1])
    p.add_argument("--rounds", type=int, default=2, help="times every variant runs, alternated (default 2)")
    p.add_argument("--runs", type=int, default=7, help="timed runs per batch after the cold one (default 7)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--metric", default="decode", choices=["decode", "ttft"],
                   help="what the table compares: decode tokens/s (default) or the time to first token in ms")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 greedy (default); above 0 sampled with --top-k, seed 0 (the same draws in every variant)")
    p.add_argument("--top-k", type=int, default=50, help="with --temperature > 0 (default 50, as minillm bench)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--backend", default="triton", choices=["triton", "torch"])
    p.add_argument("--no-graphs", action="store_true", help="run without CUDA graphs")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a variant's process may take (default 300)")
    p.add_argument("--cold-timeout", type=float, default=600.0,
                   help="seconds the call's first process may take, if more than --timeout: on a fresh machine it "
                        "compiles every kernel (gpt2-xl past 80 s on an H200; default 600)")
    p.add_argument("--out", type=Path, help="folder for ab.json and ab.md")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.temperature < 0 or args.top_k < 0:
        p.error(f"--temperature / --top-k: expected numbers >= 0, got {args.temperature} / {args.top_k}")
    if args.timeout <= 0 or args.cold_timeout <= 0:
        p.error(f"--timeout / --cold-timeout: expected seconds > 0, got {args.timeout:g} / {args.cold_timeout:g}")
    for name in ("rounds", "runs", "prompt_len", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    if min(args.batch) < 1:
        p.error(f"--batch: expected integers >= 1, got {args.batch}")
    if not args.worker and len(args.env) < 2:
        p.error("--env: expected two or more variants to compare")
    if len({label(env) for env in args.env}) < len(args.env):
        p.error("--env: expected different variants, got one twice")
    return args


def worker(args):
    """One variant, in this process: a JSON line per (model, batch)."""
    import torch

    sys.path.append(str(ROOT))  # after PYTHONPATH: a variant may name another tree
    try:
        from minillm.bench import model_weights
    except ImportError:  # a tree from before model_weights (session 138): build's weights, the same ones
        from minillm.bench import build

        def model_weights(model, device, dtype):
            cfg, _, weights = build(model, device, dtype)
            return cfg, weights
    from minillm.generate import Engine
    from minillm.model import GPT
    from minillm.sampling import SamplingParams

    heap = heap_recipe()
    if heap == "copy-test":  # allocated and freed: they stay in torch's cache, where the model then goes
        held = [torch.empty(n, dtype=torch.uint8, device=args.device) for n in (1 << 30, 1 << 30, 256 << 20)]
        held.clear()
    for model in args.model:
        cfg, weights = model_weights(model, args.device, getattr(torch, args.dtype))
        gpt = GPT(cfg, weights, args.backend)
        if heap.startswith("arena"):
            from probe_cache_placement import arena  # (scripts/, this script's folder, leads sys.path)

            arena(gpt, align=2 << 20 if heap == "arena-2m" else 256)  # (the weights' views keep it alive)
        engine = Engine(gpt, use_cuda_graphs=not args.no_graphs)
        sampled = dict(temperature=args.temperature, top_k=args.top_k, seed=0) if args.temperature > 0 else \
            dict(temperature=0)
        params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, **sampled)
        for B in args.batch:
            prompts = torch.randint(0, cfg.vocab_size, (B, args.prompt_len),
                                    generator=torch.Generator().manual_seed(B)).tolist()
            t0 = time.perf_counter()
            engine.generate(prompts, params)
            cold = time.perf_counter() - t0
            rates, ttfts = [], []
            for _ in range(args.runs):
                ids, t = engine.generate(prompts, params)
                rates.append(B * (t["steps"] - 1) / t["decode_s"] if t["steps"] > 1 else 0.0)
                ttfts.append(t["ttft_s"] * 1e3)
            print(json.dumps({"model": model, "batch": B, "tok_s": statistics.median(rates), "min": min(rates),
                              "max": max(rates), "ttft_ms": statistics.median(ttfts),
                              "ids": hashlib.sha1(str(ids).encode()).hexdigest()[:10],
                              "cold_s": round(cold, 2), "heap": heap}), flush=True)


def label(env):
    """A variant's name in the output: its switches, or "(as set)"."""
    return ",".join(f"{k}={v}" for k, v in env.items()) or "(as set)"


def run_variant(args, env, argv, first=False):
    """The variant's rows, from a fresh process with its switches set; first: the call's first
    process, which may compile the kernels cold (--cold-timeout)."""
    name = label(env)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", *argv]
    cold = first and args.cold_timeout > args.timeout
    option, timeout = ("--cold-timeout", args.cold_timeout) if cold else ("--timeout", args.timeout)
    try:
        done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        sys.exit(f"ab_decode: variant {name} took more than {option} {timeout:g} s")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        sys.exit(f"ab_decode: variant {name} failed (exit {done.returncode}): {last}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def round_order(envs, rnd):
    """The variants in the order round `rnd` (from 1) runs them: as given in odd rounds, reversed in
    even ones. The eightieth session's A/Bs, always in the order given, put the same change (no
    L2 request before the screened head) at +0.4% in one call and -1.3% in the next, each time in
    favour of the variant that ran second."""
    return list(envs) if rnd % 2 else list(reversed(envs))


def table(results, labels, metric="decode"):
    """Markdown: a row per (model, batch), each variant's median per round (decode tokens/s, or
    with metric "ttft" the time to first token in ms), the change of the mean of those medians
    against the first variant, and whether its ids matched the first's."""
    key_of, fmt, unit = ("ttft_ms", "{:,.3f}", "TTFT ms") if metric == "ttft" else ("tok_s", "{:,.0f}", "tok/s")
    head = f"| model | batch ({unit}) | " + " | ".join(labels) + " | change | ids |"
    lines = [head, "|---|---:|" + "---:|" * len(labels) + "---|---|"]
    for key in dict.fromkeys((r["model"], r["batch"]) for r in results):
        rows = {lab: [r for r in results if (r["model"], r["batch"]) == key and r["variant"] == lab] for lab in labels}
        cells = [" / ".join(fmt.format(r[key_of]) for r in rows[lab]) for lab in labels]
        timed = [lab for lab in labels[1:] if rows[lab]]  # (a call cut short: variants not run yet)
        base = statistics.mean(r[key_of] for r in rows[labels[0]])
        change = ", ".join(f"{statistics.mean(r[key_of] for r in rows[lab]) / base - 1:+.1%}" for lab in timed)
        first_ids = {r["ids"] for r in rows[labels[0]]}
        same = all({r["ids"] for r in rows[lab]} == first_ids for lab in timed) and len(first_ids) == 1
        ids = ("same" if same else "differ") if timed else "-"
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + f" | {change or '-'} | {ids} |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    worker_argv = _without_option(_without_option(argv, "--out"), "--env")  # the rest goes to each process
    results, labels = [], [label(env) for env in args.env]
    for rnd in range(1, args.rounds + 1):
        for env in round_order(args.env, rnd):
            name = label(env)
            for r in run_variant(args, env, worker_argv, first=rnd == 1 and env is args.env[0]):
                print(f"round {rnd}  {name:30s} {r['model']:12s} batch {r['batch']:3d} {r['tok_s']:11,.0f} tok/s "
                      f"({r['min']:,.0f}-{r['max']:,.0f})  TTFT {r['ttft_ms']:.3f} ms  ids {r['ids']}  "
                      f"cold {r['cold_s']} s", flush=True)
                results.append({**r, "variant": name, "round": rnd})
            if args.out:  # after every variant: a call cut short keeps the rows it has
                write(args.out, argv, results, labels, args.metric)
    print(table(results, labels, args.metric))


def write(out, argv, results, labels, metric="decode"):
    """ab.json (every row so far) and ab.md (the command and the table) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab.json").write_text(json.dumps(results, indent=1))
    (out / "ab.md").write_text(f"`python3 scripts/ab_decode.py {' '.join(argv)}`\n\n{table(results, labels, metric)}\n")


def _without_option(argv, name):
    """argv less `name` and the values after it (up to the next option)."""
    out, skip = [], False
    for a in argv:
        if a == name or a.startswith(name + "="):
            skip = a == name
            continue
        if skip and not a.startswith("--"):
            continue
        skip = False
        out.append(a)
    return out


if __name__ == "__main__":
    main()
