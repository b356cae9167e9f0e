"""Shared pieces of the benchmarks: timing, the device's copy bandwidth, the environment."""
import re
import subprocess
from pathlib import Path

import torch


def ms(fn, warmup=25, rep=100):
    """Median milliseconds of fn() by triton.testing.do_bench (CUDA events; warm-up excluded;
    L2 flushed before each timed call)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth(nbytes=1 << 30):
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = ms(lambda: dst.copy_(src))
    return 2 * nbytes / t / 1e6


def git_rev():
    try:
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def environment():
    import triton

    env = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "triton": triton.__version__, "git": git_rev()}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def device_slug():
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
