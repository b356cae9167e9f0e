"""Autotuning switch. MINILLM_AUTOTUNE=0 launches each kernel with its first (default) config
instead of benchmarking all of them: the GPU tests use it to keep compile time sane, and one
test per kernel turns tuning back on. Tuned choices are cached on disk where Triton supports it
(a second process starts warm)."""
import inspect
import os

import triton

AUTOTUNE = os.environ.get("MINILLM_AUTOTUNE", "1") != "0"
# Triton's CPU interpreter runs every program in Python: kernels give it one small config
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def autotune(configs, key, **kw):
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        kw["cache_results"] = True
    return triton.autotune(configs=configs, key=key, **kw)


def pick(tuned, configs):
    """(kernel, extra launch kwargs): the autotuner, or its JIT function with configs[0]."""
    if AUTOTUNE:
        return tuned, {}
    c = configs[0]
    return tuned.fn, {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}

# Programmatic dependent launch (Hopper+): a kernel may start while the one before it finishes,
# fetch its weights, then wait (gdc_wait) for the inputs that kernel writes. MINILLM_PDL=0 turns
# it off (for A/B timing); the interpreter has no grid dependencies.
PDL = os.environ.get("MINILLM_PDL", "1") != "0" and not INTERPRET
_pdl_devices = {}


def use_pdl(device):
    """True where kernels on `device` should be launched with launch_pdl and gdc_wait."""
    if not PDL or device.type != "cuda":
        return False
    if device not in _pdl_devices:
        import torch

        _pdl_devices[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return _pdl_devices[device]
