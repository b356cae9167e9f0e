"""Test setup: no GPU means the real Triton kernels run under the interpreter on the CPU.

TRITON_INTERPRET must be set before any kernel is defined, so it is set here, first.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# each kernel's default config; the *_autotuned tests switch tuning on (compile time on a GPU)
os.environ.setdefault("MINILLM_AUTOTUNE", "0")

import torch  # noqa: E402

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests import seeding  # noqa: E402

# a fresh torch seed per test, named in a failure's report (MINILLM_TEST_SEED replays it)
pytest_configure = seeding.pytest_configure
pytest_runtest_makereport = seeding.pytest_runtest_makereport
torch_seed = seeding.torch_seed

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.interpreter_patching import install

    install()  # CI time: the interpreter's helper calls stop re-patching triton.language


@pytest.fixture
def autotuned(monkeypatch):
    import kernels._tuning

    monkeypatch.setattr(kernels._tuning, "AUTOTUNE", True)


@pytest.fixture
def device():
    return "cuda" if ON_GPU else "cpu"


@pytest.fixture(autouse=True)
def _no_tf32():
    # fp32 references must be true fp32: tf32 matmuls would miss the 1e-4 tolerance
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
