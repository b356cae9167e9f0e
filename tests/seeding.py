"""Fresh random inputs at every run, yet any failure can be replayed.

Each test starts from `torch.manual_seed(seed)` with a seed drawn fresh for that test, so every run
still tries new inputs; a failing test's report names its seed, and

    MINILLM_TEST_SEED=<seed> python -m pytest 'tests/kernels/test_linear.py::test_name[case]'

draws the same inputs again. The seed covers torch's CPU and CUDA generators; code that seeds its
own (the checkpoint builders in `tests/models.py`) keeps doing so, and a module-scoped fixture draws
before any test's seed is set. `tests/conftest.py` installs these hooks for the suite.
"""
import os
import secrets

import pytest
import torch

SEED_ENV = "MINILLM_TEST_SEED"
_FIXED_SEED = pytest.StashKey["int | None"]()  # the run's MINILLM_TEST_SEED; None: draw per test
_TEST_SEED = pytest.StashKey[int]()


def _parse_seed(text: str) -> int:
    if text.isdecimal() and int(text) < 2**63:
        return int(text)
    raise pytest.UsageError(f"{SEED_ENV}: expected an integer in [0, 2**63), got {text!r}")


def pytest_configure(config):
    text = os.environ.get(SEED_ENV, "").strip()
    config.stash[_FIXED_SEED] = _parse_seed(text) if text else None


@pytest.fixture(autouse=True)
def torch_seed(request):
    fixed = request.config.stash.get(_FIXED_SEED, None)
    seed = fixed if fixed is not None else secrets.randbits(63)
    torch.manual_seed(seed)  # the CPU generator and every CUDA device's
    request.node.stash[_TEST_SEED] = seed
    return seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = item.stash.get(_TEST_SEED, None)
    if report.failed and seed is not None:
        report.sections.append(("torch seed", f"{seed}: replay with {SEED_ENV}={seed}"))
