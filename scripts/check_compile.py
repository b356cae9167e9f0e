"""Compile every kernel layout minillm launches on a GPU, for Hopper (sm_90a), on any machine.

CI has no GPU: its tests run the kernels under the Triton interpreter, which never compiles them,
and the GPU machines run an older Triton. This script drives the real launchers (the model's
prefill and decode steps at several batches and cache lengths, then every other public op) with
the GPU's layouts on CPU tensors: a stand-in driver names the target, and every launch stops once
its kernel is compiled to a cubin, so nothing runs and no output is meaningful. It fails (exit 1)
where a kernel does not compile, or where a fixed layout needs more shared memory than the target
has (autotune configs that do not fit are pruned at run time, so those are only reported).
Registers, spills and shared memory per kernel come from the cubins (cuobjdump).

  python scripts/check_compile.py                          # gpt2 and gpt2-xl shapes, fp16 and fp32
  python scripts/check_compile.py --models gpt2 --dtypes float16 --out compile-sm90.md
  python scripts/check_compile.py --every-config           # every autotune config, not only the first
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMEM_LIMIT = {90: 232448}  # bytes a block may opt into (227 KB on H100 / H200)


def target_only(arch):
    """Make Triton compile for sm_`arch` with no GPU: a stand-in driver answers what
    JITFunction.run asks before it compiles (a launch would then fail: only compile)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class TargetOnly:
        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(TargetOnly())


def install_compile_only(arch, sms, every_config, log, where, failures, only=""):
    """Route every launch to compilation for sm_`arch` on CPU tensors, logging each compiled
    kernel: (name, hash) -> [CompiledKernel, launches, fixed layout?, blocks, first launched
    by (where[0], set by the caller), seconds its first launch took]; a kernel that does not
    compile is one line in failures. Kernels whose name does not contain `only` are skipped."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    target_only(arch)
    compile_run = JITFunction.run
    in_autotuner = []

    def run(self, *args, grid, warmup, **kwargs):
        if only not in self.__name__:
            return None
        t0 = time.perf_counter()
        try:
            kernel = compile_run(self, *args, grid=grid, warmup=True, **kwargs)  # compile, never launch
        except Exception as e:  # noqa: BLE001 - every kernel that fails is reported, the rest go on
            failures.append(_failure(f"{self.__name__} ({where[0]})", e))
            return None
        blocks = " ".join(f"{k[6:]}={v}" for k, v in sorted(kwargs.items()) if k.startswith("BLOCK_"))
        # the first launch of a layout compiles it (the Triton cache starts empty); later ones look it up
        entry = log.setdefault((self.__name__, kernel.hash),
                               [kernel, 0, not in_autotuner, blocks, where[0], time.perf_counter() - t0])
        entry[1] += 1
        return kernel

    def tune(self, *args, **kwargs):  # compile the configs instead of timing them
        configs = self.prune_configs(kwargs) if every_config else self.configs[:1]
        in_autotuner.append(self)
        try:
            compiled = [self.fn.run(*args, **kwargs, **c.all_kwargs()) for c in configs]
            return compiled[0]
        finally:
            in_autotuner.pop()

    JITFunction.run = run
    Autotuner.run = tune

    from kernels import _checks, _tuning

    _checks.INTERPRET = True  # CPU tensors stand in for CUDA ones
    # (taken before _tuning's own are replaced below)
    use_pdl, is_hopper, sm_count = _tuning.use_pdl, _tuning.is_hopper, _tuning.sm_count
    for mod in _kernel_modules():  # the GPU's answers, where launchers ask the device
        if getattr(mod, "use_pdl", None) is use_pdl:
            mod.use_pdl = lambda device: arch >= 90
        if getattr(mod, "is_hopper", None) is is_hopper:
            mod.is_hopper = lambda device: arch >= 90
        if getattr(mod, "sm_count", None) is sm_count:
            mod.sm_count = lambda device: sms


def _kernel_modules():
    """The modules of the package `kernels` imported so far (it imports all of them)."""
    import kernels  # noqa: F401

    return [m for name, m in list(sys.modules.items()) if name == "kernels" or name.startswith("kernels.")]


def _failure(where, e):
    """One line for a failed compile or drive: where, the error's type and its last line."""
    lines = str(e).strip().splitlines()
    return f"{where}: {type(e).__name__}: {lines[-1] if lines else ''}"


def _drive(drive, failures, where, *args, **kwargs):
    try:
        drive(*args, where=where, **kwargs)
    except Exception as e:  # noqa: BLE001 - one line per failing model or library pass, the rest still run
        failures.append(_failure(where[0], e))


def random_weights(cfg, dtype, n_layer):
    """A model's weights, random, with only the first n_layer layers (the rest repeat them)."""
    import torch

    from minillm.loader import expected_shapes

    g = torch.Generator().manual_seed(0)
    shapes = expected_shapes(cfg)
    return {k: (torch.randn(s, generator=g) * 0.02).to(dtype) for k, s in shapes.items()
            if not k.startswith("h.") or int(k.split(".")[1]) < n_layer}


def drive_model(name, dtype, batches, cache_lens, prefills, where):
    """The launches of a model's prefill (batch, length) and decode steps (greedy with the fused
    argmax, and sampled, then the engine's bookkeeping) at each batch and attended cache length."""
    from dataclasses import replace

    import torch

    import kernels
    from minillm.config import PRESETS
    from minillm.model import GPT

    cfg = replace(PRESETS[name], n_layer=1)
    model = GPT(cfg, random_weights(cfg, dtype, 1), "triton")
    tag = f"{name} {str(dtype).removeprefix('torch.')}"
    for B, T in prefills:
        where[0] = f"{tag} prefill {B}x{T}"
        cache = model.new_cache(B)
        ids = torch.randint(0, cfg.vocab_size, (B, T))
        model.prefill(ids, torch.full((B,), T, dtype=torch.int32), cache)
    for B in batches:
        cache = model.new_cache(B)
        for L in cache_lens:
            where[0] = f"{tag} decode b{B} L{L}"
            tokens, pos = torch.zeros(B, dtype=torch.int32), torch.full((B,), L // 2, dtype=torch.int32)
            keys = torch.empty(B, dtype=torch.int64)
            model.decode(tokens, pos, cache, L, argmax_keys=keys)
            model.decode(tokens, pos, cache, L)
            out, step = torch.zeros(B, 8, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
            kernels.append_tokens(keys, out, step, tokens, pos, from_keys=True)
            kernels.append_tokens(keys, out, step, tokens, pos, from_keys=True, out_host=out.clone())  # read back
            noise = kernels.new_exponential_noise(B * cfg.vocab_size, tokens.device)
            kernels.append_tokens(keys, out, step, tokens, pos, noise=noise)  # a sampled step's


def drive_library(dtype, where):
    """The public ops the model does not call, in their common forms."""
    import torch

    import kernels

    def r(*shape):
        return torch.randn(*shape).to(dtype)

    where[0] = f"library {str(dtype).removeprefix('torch.')}"
    x, w, b = r(100, 512), r(512, 384), r(384)
    for act in kernels.ACTIVATIONS:  # (None among them)
        kernels.linear(x, w, b, activation=act, residual=r(100, 384))
    kernels.linear(r(5, 512), w, b, activation="leaky_relu", residual=r(5, 384))
    kernels.layernorm(x, r(512), r(512))
    kernels.add_layernorm(x, r(100, 512), r(512), r(512))
    kernels.softmax(x)
    kernels.gelu(x)
    kernels.gelu(x, approximate="none")
    q, k, v = (r(2, 4, 77, 64) for _ in range(3))
    kernels.attention(q, k, v, causal=False)
    kc, vc = r(3, 4, 300, 64), r(3, 4, 300, 64)
    lens = torch.full((3,), 200, dtype=torch.int32)
    kernels.decode_attention(r(3, 4, 64), kc, vc, lens)
    narrow = r(2, 4, 77, 8)  # heads under 16 wide: prefill pads them to the 16 columns tl.dot takes
    kernels.attention(narrow, narrow, narrow)
    kernels.decode_attention(r(3, 4, 8), r(3, 4, 300, 8), r(3, 4, 300, 8), lens)
    # the split form and its merge: a GPU splits 12 (row, head) pairs; this driver stands for 2 SMs and would not
    kernels.decode_attention(r(3, 4, 64), kc, vc, lens, num_splits=4)
    logits, q, seen = r(64, 50257), torch.rand(64, 50257), torch.rand(64, 50257) < 0.1
    kernels.sample_logits(logits, q, 50, 0.8, 0.9, 1.2, seen)  # every step the sampler has
    kernels.sample_logits(logits, q, 128, 1.0, 1.0)  # its widest lists (each sort compiles for ~20 s)
    kernels.sample_logits(logits[:8], q[:8], 50, 1.0, 0.9)  # the tile launch's 8-warp layout, top-p's wide tiles
    noise = kernels.new_exponential_noise(64 * 50257, logits.device)
    kernels.sample_logits(logits, noise, 50, 1.0, 1.0)  # the engine's: torch's noise computed in-kernel
    one = kernels.new_exponential_noise(50257, logits.device)
    kernels.sample_logits(logits[:1], one, 50, 1.0, 1.0)  # one row: the draw in the last tile program
    kernels.exponential(noise, (64, 50257))


def package_kernels():
    """Names of the package's kernels (its JIT functions named *_kernel; the rest are helpers)."""
    from triton.runtime.jit import JITFunction

    return {obj.__name__ for mod in _kernel_modules() for obj in vars(mod).values()
            if isinstance(obj, JITFunction) and obj.__name__.endswith("_kernel")}


def run_cuobjdump(cuobjdump, cubin, option, check=False):
    """cuobjdump's output for a cubin (bytes), with one option such as -sass."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump, option, f.name], capture_output=True, text=True, check=check).stdout


def cubin_usage(kernel, cuobjdump):
    """(registers, local memory bytes a thread: spills and stack) from the cubin; (None, None)
    without cuobjdump."""
    if cuobjdump is None:
        return None, None
    out = run_cuobjdump(cuobjdump, kernel.asm["cubin"], "--dump-resource-usage")
    fields = dict(kv.split(":", 1) for line in out.splitlines() if "REG:" in line for kv in line.split())
    return int(fields.get("REG", 0)), int(fields.get("LOCAL", 0)) + int(fields.get("STACK", 0))


def find_cuobjdump():
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(path) if path.is_file() else None


def report(log, arch, seconds):
    """(markdown table, failures)."""
    import triton

    limit = SMEM_LIMIT[arch]
    cuobjdump = find_cuobjdump()
    rows, failures = [], []
    for (name, _), (k, launches, fixed, blocks, first, secs) in sorted(log.items(),
                                                                       key=lambda kv: (kv[0][0], kv[1][4])):
        regs, local = cubin_usage(k, cuobjdump)
        md = k.metadata
        over = md.shared > limit
        if over and fixed:
            failures.append(f"{name}: a fixed layout needs {md.shared} bytes of shared memory; sm_{arch} has {limit}")
        rows.append(f"| {name} | {blocks} | {md.num_warps} | {md.num_stages} | {md.shared:,} "
                    f"| {regs if regs is not None else '?'} | {local if local is not None else '?'} | {first} "
                    f"| {secs:.1f} | {launches} | {'fixed' if fixed else 'autotune'}"
                    f"{' (too large: pruned at run time)' if over and not fixed else ''} |")
    per_name = Counter(name for name, _ in log)
    head = [f"# Kernels compiled for sm_{arch}a (Triton {triton.__version__}, no GPU)", "",
            (f"`python {' '.join(['scripts/check_compile.py', *sys.argv[1:]])}`: {len(log)} kernels "
             f"({len(per_name)} functions) compiled in {seconds:.0f} s. Local bytes: local memory a thread "
             "(register spills, stack); first launched by: the model, dtype and step that first compiled it; "
             "compile s: seconds that first launch took."), "",
            ("| kernel | blocks | warps | stages | shared bytes | registers | local bytes | first launched by "
             "| compile s | launches | layout |"),
            "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    return "\n".join(head + rows) + "\n", failures


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n".join(__doc__.splitlines()[-3:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2", "gpt2-xl"], help="presets (default: gpt2 gpt2-xl)")
    p.add_argument("--dtypes", nargs="+", default=["float16", "float32"], choices=["float16", "bfloat16", "float32"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16, 64], help="decode batches")
    p.add_argument("--cache-lens", nargs="+", type=int, default=[128, 256, 1024], help="attended cache lengths")
    p.add_argument("--arch", type=int, default=90, choices=sorted(SMEM_LIMIT), help="compute capability x 10")
    p.add_argument("--sms", type=int, default=132, help="multiprocessors the grids are sized for (H100/H200: 132)")
    p.add_argument("--every-config", action="store_true", help="compile every autotune config, not only the first")
    p.add_argument("--no-library", action="store_true", help="only the model's launches")
    p.add_argument("--out", default=None, help="write the table (markdown) here")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("run without TRITON_INTERPRET=1: the interpreter never compiles")
    os.environ["MINILLM_AUTOTUNE"] = "1"  # the autotuners' configs go through tune() above
    sys.path.insert(0, str(ROOT))

    import torch

    log = {}
    where, failures = [""], []
    install_compile_only(args.arch, args.sms, args.every_config, log, where, failures)
    t0 = time.perf_counter()
    for dtype in (getattr(torch, d) for d in args.dtypes):
        for name in args.models:
            print(f"{name} {str(dtype).removeprefix('torch.')}: ", end="", flush=True)
            before = len(log)
            _drive(drive_model, failures, where, name, dtype, args.batches, args.cache_lens,
                   prefills=[(1, 32), (4, 100), (1, 1024)])
            print(f"{len(log) - before} kernels", flush=True)
        if not args.no_library:
            _drive(drive_library, failures, where, dtype)
    table, over = report(log, args.arch, time.perf_counter() - t0)
    failures += over
    if not args.no_library:
        failures += [f"{name}: never launched, so not compiled (add it to drive_library)"
                     for name in sorted(package_kernels() - {name for name, _ in log})]
    if args.out:
        Path(args.out).write_text(table)
    print(table)
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    return 1 if failures or not log else 0


if __name__ == "__main__":
    sys.exit(main())
