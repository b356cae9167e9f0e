"""Shared pieces of the benchmarks: timing, the device's copy bandwidth, the environment."""
import re
import subprocess
import sys
from pathlib import Path

import torch

from .graphs import capture


def require_cuda(script):
    """Exit with a one-line message when there is no CUDA GPU (the GPU-only scripts)."""
    if not torch.cuda.is_available():
        sys.exit(f"{script}: needs a CUDA GPU")


def ms(fn, warmup=25, rep=100):
    """Median milliseconds of fn() by triton.testing.do_bench (CUDA events; warm-up excluded;
    L2 flushed before each timed call)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth(nbytes=1 << 30):
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written.

    Its buffers go back to the driver before it returns. Kept in torch's cache, they could become
    the home of what the caller allocates next (a benchmark's model), a heap no user's process
    has, and one that decoded slower: on one H200 (session 140) gpt2 batch 1 read 8,399-8,434
    tok/s (each process's median) in five processes that kept them against 8,565-8,596 in three
    that handed them back (bench/results/h200/session-140/call4-5)."""
    t = _copy_ms(nbytes)
    torch.cuda.empty_cache()  # (the buffers died with _copy_ms' frame)
    return 2 * nbytes / t / 1e6


def _copy_ms(nbytes):
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return ms(lambda: dst.copy_(src))


def git_rev():
    import os

    if os.environ.get("MINILLM_GIT_REV"):  # the device machine gets the tree without .git
        return os.environ["MINILLM_GIT_REV"]
    try:
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def environment():
    import triton

    cuda = torch.cuda.is_available()
    env = {"device": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "triton": triton.__version__, "git": git_rev()}
    if cuda:
        # which physical GPU: lent machines carry no name, and runs on one host are not independent
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["gpu_uuid"] = str(getattr(props, "uuid", "unknown"))
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def device_slug():
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def ms_graph(fns, min_ms=2.0, reps=20):
    """Median milliseconds per call of the callables `fns`, captured back to back in one CUDA
    graph and timed over graph replays: launch overhead stays out, as in the engine's decode.
    Each callable should touch its own inputs (see rotating) so repeated calls do not hit L2."""
    for f in fns:  # warm-up outside the graph: autotuning, compilation, workspace allocation
        f()
    torch.cuda.synchronize()
    one = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    one[0].record()
    for f in fns:
        f()
    one[1].record()
    torch.cuda.synchronize()
    rounds = max(1, min(50, int(min_ms / max(one[0].elapsed_time(one[1]), 1e-3)) + 1))
    def all_rounds():
        for _ in range(rounds):
            for f in fns:
                f()

    g, _ = capture(all_rounds)
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2] / (rounds * len(fns))


def rotating(make, bytes_each, min_total=256 << 20, max_copies=128):
    """Enough independent input sets from make() that cycling through them streams at least
    min_total bytes (several times the L2), so each call reads device memory, not cache."""
    n = max(1, min(max_copies, -(-min_total // max(bytes_each, 1))))
    return [make() for _ in range(n)]
