"""What the tests of the Gluon probes in scripts/ share: a probe loaded as a module, the mark
that keeps their kernels to Hopper GPUs, and the command line's two checks (a bad option is one
line on stderr and exit status 2, checked in this process; the help shows an example, from a
subprocess, or its text read in this process)."""
import contextlib
import functools
import importlib.util
import io
import subprocess
import sys
from pathlib import Path
from unittest import mock

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


_cli_module = functools.cache(load)  # one load a probe for its refusal cases


def run(name, *argv, timeout=120):
    return subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), *argv], capture_output=True, text=True,
                          timeout=timeout)


def assert_refused_in_one_line(name, argv, expect):
    """Run in this process (a subprocess a case cost CI about 5 s of torch imports; the help
    test runs each probe as a command): argparse's error is one line on stderr and exit 2."""
    module = _cli_module(name)
    stderr = io.StringIO()
    with mock.patch.object(sys, "argv", [f"{name}.py", *argv]), contextlib.redirect_stderr(stderr), \
            pytest.raises(SystemExit) as done:
        module.main()
    err = [line for line in stderr.getvalue().splitlines() if line.startswith(f"{name}.py: error")]
    assert done.value.code == 2 and len(err) == 1 and expect in err[0], stderr.getvalue()[-500:]


def help_text(name):
    """NAME's --help, printed by its parse_args in this process (exit status 0 asserted)."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), pytest.raises(SystemExit) as done:
        _cli_module(name).parse_args(["--help"])
    assert done.value.code == 0
    return stdout.getvalue()


def assert_help_has_example(name, example, timeout=120):
    done = run(name, "--help", timeout=timeout)
    assert done.returncode == 0 and example in done.stdout
