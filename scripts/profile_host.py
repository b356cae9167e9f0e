"""Where the host's time goes in a decode step run without CUDA graphs. Writes host-<model>-b<batch>.md.

With graphs on, a step is one graph launch and the host waits on the GPU. With graphs off
(`minillm generate --no-cuda-graphs`, `LLM(cuda_graphs=False)`) the host launches every kernel
of every step itself, and a step takes as long as its launches take the host. This script runs
greedy decoding without graphs, times its steps, profiles one generate call with
cProfile (the functions with the most time of their own, and the most time under them), and
times bare launches of a one-line Triton kernel with few and with many arguments: what a launch
costs before any of the engine's own checks.

    python3 scripts/profile_host.py --model gpt2 --batch 1 --out bench/results
"""
import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm.bench import PROMPT_LEN, model_weights  # noqa: E402
from minillm.benchutil import require_cuda  # noqa: E402
from minillm.generate import Engine  # noqa: E402
from minillm.model import GPT  # noqa: E402
from minillm.sampling import SamplingParams  # noqa: E402

TOP = 35  # functions listed per table


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", help="preset (random weights) or checkpoint folder (default gpt2)")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens a generate call makes (default 64)")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for the markdown report")
    args = p.parse_args(argv)
    if args.batch < 1 or args.new_tokens < 2:
        p.error(f"--batch / --new-tokens: expected >= 1 / >= 2, got {args.batch} / {args.new_tokens}")
    return args


@triton.jit
def _store_one(y_ptr):
    tl.store(y_ptr, 1.0)


@triton.jit
def _store_one_24(y_ptr, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18,
                  a19, a20, a21, a22, a23):
    tl.store(y_ptr, 1.0)


def bare_launch_us(n_args, device="cuda", launches=2000):
    """Host microseconds a launch of a kernel that stores one value takes, with 0 or 24 scalar
    arguments besides its pointer (the engine's kernels take 15-45)."""
    kernel = {0: _store_one, 24: _store_one_24}[n_args]
    y = torch.empty(1, device=device)
    extra = list(range(1, n_args + 1))
    kernel[(1,)](y, *extra)  # compile
    sync = torch.cuda.synchronize if y.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(launches):
        kernel[(1,)](y, *extra)
    t = time.perf_counter() - t0
    sync()
    return t / launches * 1e6


def stats_table(prof, key, top=TOP):
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(key).print_stats(top)
    return s.getvalue()


def main(argv=None):
    args = parse_args(argv)
    require_cuda("profile_host.py")
    cfg, weights = model_weights(args.model, "cuda", torch.float16)
    engine = Engine(GPT(cfg, weights, "triton"), use_cuda_graphs=False)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, temperature=0)
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    prompts = prompts.tolist()
    engine.generate(prompts, params)  # compile and tune
    _, t = engine.generate(prompts, params)
    step_ms = t["decode_s"] / (t["steps"] - 1) * 1e3
    prof = cProfile.Profile()
    prof.enable()
    engine.generate(prompts, params)
    prof.disable()
    steps = args.new_tokens
    launches = {n: bare_launch_us(n) for n in (0, 24)}
    total = pstats.Stats(prof).total_tt
    lines = [
        f"# Host time of a decode step without CUDA graphs: {args.model}, batch {args.batch}",
        "",
        f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}",
        f"- decode step without graphs: **{step_ms:.3f} ms** ({args.batch / step_ms * 1e3:,.0f} tok/s), "
        f"{args.new_tokens} new tokens after a {PROMPT_LEN}-token prompt",
        f"- profiled generate call: {total * 1e3:,.1f} ms under cProfile ({total / steps * 1e3:.3f} ms a token, "
        "prefill and profiler overhead included)",
        "- a bare Triton launch (one program storing one value), host us a launch: "
        + ", ".join(f"{n} extra arguments {us:.1f}" for n, us in launches.items()),
        "",
        "## By own time",
        "", "```", stats_table(prof, "tottime"), "```", "",
        "## By cumulative time",
        "", "```", stats_table(prof, "cumulative"), "```", "",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"host-{Path(args.model).name}-b{args.batch}.md"
    path.write_text("\n".join(lines))
    print("\n".join(lines[:8]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
