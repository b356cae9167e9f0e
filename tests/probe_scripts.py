"""What the tests of the Gluon probes in scripts/ share: a probe loaded as a module, the mark
that keeps their kernels to Hopper GPUs, and the command line's two checks (a bad option is one
line on stderr and exit status 2; the help shows an example)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                            reason="Gluon TMA kernels: an H100 / H200 (they do not run under the interpreter)")


def load(name):
    """scripts/NAME.py as a module (it puts scripts/ on the path for its own imports)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(name, *argv, timeout=120):
    return subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), *argv], capture_output=True, text=True,
                          timeout=timeout)


def assert_refused_in_one_line(name, argv, expect, timeout=120):
    done = run(name, *argv, timeout=timeout)
    err = [line for line in done.stderr.splitlines() if line.startswith(f"{name}.py: error")]
    assert done.returncode == 2 and len(err) == 1 and expect in err[0], done.stderr[-500:]


def assert_help_has_example(name, example, timeout=120):
    done = run(name, "--help", timeout=timeout)
    assert done.returncode == 0 and example in done.stdout
