"""Where a warm call's time to first token goes, host and GPU: gpt2-family random weights,
batch 1, greedy, CUDA graphs on (the benchmark's minillm). Writes ttft-<model>.md.

For each prompt length: the median TTFT of --repeats warm calls (Engine timings, as the
benchmark reports it); cProfile over as many calls, the functions with the most host time of
their own (a sync shows as the host waiting in `tolist`); torch.profiler over a few calls, the
host ops and GPU kernels by total time, and the GPU's busy time against the TTFT; the host time
of the engine's prefill call (ids staged, the graph launched) and of its graph's launch alone.

    python3 scripts/profile_ttft.py --model gpt2 --prompt-len 32 1024 --out bench/results
"""
import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm.bench import model_weights  # noqa: E402
from minillm.benchutil import require_cuda  # noqa: E402
from minillm.generate import Engine  # noqa: E402
from minillm.model import GPT  # noqa: E402
from minillm.sampling import SamplingParams  # noqa: E402

WARMUP_CALLS = 3
PROFILED_CALLS = 5  # torch.profiler: enough to average, few enough to read


def gpu_busy_us(prof):
    """Microseconds the GPU ran kernels or copies during the profile, overlaps counted once."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


@contextlib.contextmanager
def host_times(engine):
    """{"prefill": [...], "replay": [...]}: host microseconds of each engine.prefill call and of
    each CUDA graph replay (cudaGraphLaunch and torch's wrapper) while the block runs."""
    times = {"prefill": [], "replay": []}

    def timed(fn, key):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[key].append((time.perf_counter() - t) * 1e6)
        return run

    replay = torch.cuda.CUDAGraph.replay
    engine.prefill = timed(engine.prefill, "prefill")
    torch.cuda.CUDAGraph.replay = timed(replay, "replay")
    try:
        yield times
    finally:
        del engine.prefill  # the instance attribute: the class's method again
        torch.cuda.CUDAGraph.replay = replay


def profile_length(engine, prompt, repeats):
    """(median TTFT ms, markdown section) for one prompt."""
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    for _ in range(WARMUP_CALLS):
        engine.generate([prompt], params)
    with host_times(engine) as host_us:
        ttft = statistics.median(engine.generate([prompt], params)[1]["ttft_s"] for _ in range(repeats)) * 1e3
    prefill_us, replay_us = (statistics.median(host_us[k]) for k in ("prefill", "replay"))

    host = cProfile.Profile()
    host.enable()
    for _ in range(repeats):
        engine.generate([prompt], params)
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(25)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_CALLS):
            engine.generate([prompt], params)
        torch.cuda.synchronize()
    busy = gpu_busy_us(prof) / PROFILED_CALLS
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60)
    section = [f"## prompt {len(prompt)} tokens", "",
               f"- median TTFT over {repeats} warm calls: **{ttft:.3f} ms**",
               f"- host time of the engine's prefill call (ids staged, the graph launched), median: "
               f"{prefill_us:.1f} us; of its graph's replay alone: {replay_us:.1f} us",
               f"- GPU busy a call (kernels and copies, torch.profiler, {PROFILED_CALLS} calls; each call also "
               f"reads its one new id back after the TTFT): {busy:.1f} us", "",
               f"### cProfile, {repeats} calls, by own time (each call includes the id read-back after the TTFT)",
               "", "```", text.getvalue().strip(), "```", "",
               f"### torch.profiler, {PROFILED_CALLS} calls", "", "```", table, "```", ""]
    return ttft, "\n".join(section)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", help="a preset (random weights): gpt2, gpt2-medium, ... (default gpt2)")
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[32, 1024], help="prompt lengths in tokens")
    ap.add_argument("--repeats", type=int, default=50, help="warm calls timed per prompt length (default 50)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for ttft-<model>.md")
    args = ap.parse_args()
    if args.repeats < 1 or min(args.prompt_len) < 1:
        ap.error("--repeats and --prompt-len: expected positive integers")
    require_cuda("profile_ttft.py")
    dev = torch.device("cuda")
    cfg, weights = model_weights(args.model, dev, torch.float16)
    if max(args.prompt_len) > cfg.n_positions:
        ap.error(f"--prompt-len: at most {cfg.n_positions} (the model's context), got {max(args.prompt_len)}")
    engine = Engine(GPT(cfg, weights, "triton"), use_cuda_graphs=True)
    g = torch.Generator().manual_seed(0)
    lines = [f"# Time to first token: {args.model}, batch 1, greedy, fp16 ({torch.cuda.get_device_name()})", ""]
    for n in args.prompt_len:
        prompt = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
        ttft, section = profile_length(engine, prompt, args.repeats)
        print(f"prompt {n:5d}: TTFT {ttft:.3f} ms")
        lines.append(section)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ttft-{args.model}.md"
    path.write_text("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
