"""How kernels are launched on this GPU: the autotuning switch, programmatic dependent launch,
the SM count layouts size their grids by, and `launch`, through which every kernel goes (it pins
floating-point contraction and fits a fixed layout's pipeline stages to the GPU's shared memory).

MINILLM_AUTOTUNE=0 launches each kernel with its first (default) config instead of
benchmarking all of them: the GPU tests use it to keep compile time sane, and one test per
kernel turns tuning back on. Tuned choices are cached on disk where Triton supports it (a
second process starts warm)."""
import contextlib
import contextvars
import functools
import inspect
import os
from concurrent.futures import ThreadPoolExecutor

import triton
from triton.runtime.autotuner import Autotuner
from triton.runtime.errors import OutOfResources


def env_int(name, default=None, minimum=None):
    """An integer A/B-timing switch from the environment (unset or empty: default), or one
    error naming the variable (also for a value below `minimum`, where one is given)."""
    value = os.environ.get(name, "")
    if not value:
        return default
    floor = "" if minimum is None else f" >= {minimum}"
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name}: expected an integer{floor}, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name}: expected an integer{floor}, got {number}")
    return number


def env_choice(name, default, choices):
    """A string A/B-timing switch from the environment (unset or empty: default), or one error
    naming the variable and the choices."""
    value = os.environ.get(name, "") or default
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)} (or unset), got {value!r}")
    return value


def mask_switch(name, text, meaning):
    """A 3-bit mask switch's value (A/B timing; `meaning` names the bits), or None where unset
    or empty. One ValueError naming the variable for anything but 0 to 7."""
    if not text:
        return None
    if not (text.isdigit() and int(text) < 8):
        raise ValueError(f"{name}: expected 0 to 7 ({meaning}), got {text!r}")
    return int(text)


def layout_switch(name, text, fields, example, pow2=3):
    """A layout switch's values (A/B timing): `fields` positive integers joined by x (`fields`
    names them, such as "BLOCK_NxWARPSxPROGRAMS"; `example` is one), the first `pow2` of them
    powers of two, or None where unset or empty. One ValueError naming the variable for
    anything else."""
    if not text:
        return None
    parts = text.split("x")
    values = tuple(int(p) for p in parts if p.isdigit())
    n = len(fields.split("x"))
    if len(parts) != n or len(values) != n or min(values) < 1 or any(v & (v - 1) for v in values[:pow2]):
        what = "powers of two" if pow2 >= n else "the first one a power of two" if pow2 == 1 else \
            f"the first {pow2} powers of two"
        raise ValueError(f"{name}: expected {fields}, {n} positive integers ({what}) such as {example}, "
                         f"got {text!r}")
    return values


AUTOTUNE = os.environ.get("MINILLM_AUTOTUNE", "1") != "0"
# Triton's CPU interpreter runs every program in Python: kernels give it one small config
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def autotune(configs, key, **kw):
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        kw["cache_results"] = True
    return triton.autotune(configs=configs, key=key, **kw)


def pick(tuned, configs):
    """(kernel, extra launch kwargs): the autotuner, or its JIT function with configs[0] (launch
    it through `launch`, which fits its stages to the GPU; the autotuner skips configs that do
    not fit by itself)."""
    if AUTOTUNE:
        return tuned, {}
    return tuned.fn, config_kwargs(configs[0])


def config_kwargs(config):
    """A triton.Config as the launch kwargs of its JIT function: its constexprs, warps and stages
    (also the `_config=` form of the autotuned launchers, for tests and benchmarks)."""
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}

# Programmatic dependent launch (Hopper+): a kernel may start while the one before it finishes,
# fetch its weights, then wait (gdc_wait) for the inputs that kernel writes. MINILLM_PDL=0 turns
# it off (for A/B timing); the interpreter has no grid dependencies.
PDL = os.environ.get("MINILLM_PDL", "1") != "0" and not INTERPRET
_hopper_devices = {}


def is_hopper(device):
    """True for a CUDA device of compute capability 9 or later (Hopper's instructions: dependent
    launch, bulk L2 prefetch)."""
    if device.type != "cuda":
        return False
    if device not in _hopper_devices:
        import torch

        _hopper_devices[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return _hopper_devices[device]


def tma_ready(*tensors):
    """Whether tensor descriptors (TMA) can read these tensors as they lie: on Hopper (or the
    interpreter, which runs the descriptors' loads as plain ones), 2-byte floats, a contiguous last
    dim, 16-byte aligned bases and other strides."""
    first = tensors[0]
    if not ((INTERPRET or is_hopper(first.device)) and first.is_floating_point() and first.element_size() == 2):
        return False
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st * 2 % 16 == 0 for st in t.stride()[:-1])
               for t in tensors)


def use_pdl(device):
    """True where kernels on `device` should be launched with launch_pdl and gdc_wait."""
    return PDL and is_hopper(device)


@functools.cache
def sm_count(device):
    """Multiprocessors of `device` (the interpreter stands for 2)."""
    if device.type != "cuda":
        return 2
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


REGS_PER_SM = 65536  # the register file of an SM on every GPU since Volta


def programs_by_registers(regs, warps, regs_per_sm=REGS_PER_SM):
    """How many programs of `warps` warps and `regs` registers a thread an SM's register file
    holds at once: registers are allocated per warp in units of 256 (8 a thread)."""
    return regs_per_sm // (-(-regs // 8) * 8 * 32 * warps)


# The fixed layouts (decode GEMV, first configs) were tuned on Hopper, up to 227 KB of shared
# memory a block; an A100 has 163 KB, consumer cards 99 KB. There a layout falls back to fewer
# software-pipelining stages: fewer loads in flight, the same K steps in the same order, so the
# same bits. Remembered per layout, so later launches (and graph captures) go straight to it.
DEFAULT_STAGES = 3  # Triton's default num_stages on CUDA
_fitted_stages = {}  # (kernel name, device index, launch kwargs) -> stages that fit


def _layout_key(kernel, kwargs):
    import torch

    device = torch.cuda.current_device() if torch.cuda.is_available() else -1
    return kernel.__name__, device, tuple(sorted(kwargs.items()))


# Floating-point contraction (a * b + c as one FMA) pinned on, as every number and bit-level test
# of this project was taken: Triton 3.9 warns that its default turns it off in 3.10, which would
# change the CUDA-core kernels' rounding and speed with the Triton version.
FP_FUSION = True


# MINILLM_COMPILE_AHEAD=0 turns compile_ahead off (A/B timing of start-up)
COMPILE_AHEAD = os.environ.get("MINILLM_COMPILE_AHEAD", "1") != "0"
# inside compile_ahead: launch compiles and runs nothing. A context variable, as Triton's
# AsyncCompileMode is: each thread has its own, so a dry pass never stops another thread's launches
_DRY = contextvars.ContextVar("minillm_compile_ahead", default=False)


def compiling_ahead():
    """True inside compile_ahead's dry pass (in this thread), where launches compile and run
    nothing (launchers that look at a compiled kernel, such as vocab_fma's register fit, wait for
    the real launch)."""
    return _DRY.get()


@contextlib.contextmanager
def dry_launches():
    """Launches in this block (this thread) compile and run nothing: compile_ahead's switch."""
    token = _DRY.set(True)
    try:
        yield
    finally:
        _DRY.reset(token)


def compile_workers():
    """Threads compile_ahead compiles on: this process's CPUs, at most 32."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(32, cpus or 1))


@contextlib.contextmanager
def compile_ahead(workers=None):
    """A dry pass: within it `launch` (in this thread) runs no kernel; it hands the kernel's
    compilation (each config of an autotuner) to a pool of threads and returns. Leaving the
    block waits for them all, so a later launch of the same kernels finds them compiled.
    Triton's MLIR passes and ptxas release the GIL (its Python front end, about a fifth of a
    compilation, does not), so a process's first step waits for far less than the sum of its
    compilations. Code run inside must not depend on what the kernels write (they write
    nothing): a model's forward does not, nor do launchers.

    Yields the pending compilations (a list of concurrent.futures.Future that grows as launches
    come; wait on them inside the block to show progress), or None where there is nothing to do
    ahead: under the interpreter, with a Triton before 3.4 (no AsyncCompileMode), switched off
    (MINILLM_COMPILE_AHEAD=0) or nested. A kernel that fails to compile is left to the real
    launch, which raises its error."""
    mode_type = getattr(triton, "AsyncCompileMode", None)
    if INTERPRET or not COMPILE_AHEAD or mode_type is None or compiling_ahead():
        yield None
        return
    with ThreadPoolExecutor(workers or compile_workers(), thread_name_prefix="minillm-compile") as pool, \
            mode_type(pool, ignore_errors=True) as mode, dry_launches():
        try:
            yield mode.raw_futures
        except BaseException:  # an interrupted pass (Ctrl-C, an error): the queued compilations are dropped
            for future in mode.raw_futures:
                future.cancel()
            raise


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs), every kernel launch of the package: with FP_FUSION, and
    for a JIT function with a fixed layout relaunched with fewer num_stages where the layout
    needs more shared memory than this GPU has. kwargs must be hashable (constexprs and launch
    options; tensors go in args). Autotuners pick their stages themselves. Inside
    compile_ahead: the kernel's compilation (every config of an autotuner) is submitted, and
    nothing runs."""
    kwargs["enable_fp_fusion"] = FP_FUSION
    if isinstance(kernel, Autotuner):
        if compiling_ahead():
            return kernel.warmup(*args, grid=grid, **kwargs)
        return kernel[grid](*args, **kwargs)
    stages = kwargs.pop("num_stages", DEFAULT_STAGES)
    if _fitted_stages:  # hashing only once some layout has failed to fit
        stages = min(stages, _fitted_stages.get(_layout_key(kernel, kwargs), stages))
    if compiling_ahead():  # (a layout that does not fit fails at its real launch, and refits there)
        return kernel.warmup(*args, grid=grid, num_stages=stages, **kwargs)
    while True:
        try:
            return kernel[grid](*args, num_stages=stages, **kwargs)
        except OutOfResources as err:
            if err.name != "shared memory":
                raise
            if stages <= 1:
                raise RuntimeError(f"{kernel.__name__}: its layout needs {err.required} bytes of shared memory even "
                                   f"at one pipeline stage; this GPU has {err.limit}") from err
            stages -= 1
            _fitted_stages[_layout_key(kernel, kwargs)] = stages
