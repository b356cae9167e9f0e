"""scripts/profile_host.py: its help, its one-line refusals, its bare-launch kernels, and on a GPU a
short run."""
import pytest
import torch

from tests.conftest import ON_GPU
from tests.probe_scripts import assert_refused_in_one_line, help_text, load, run


@pytest.fixture(scope="module")
def profile_host():
    return load("profile_host")


def test_help_names_the_options():
    out = help_text("profile_host")
    assert "--new-tokens" in out and "python3 scripts/profile_host.py" in out


def test_refuses_bad_counts():
    assert_refused_in_one_line("profile_host", ["--new-tokens", "1"],
                               "--batch / --new-tokens: expected >= 1 / >= 2, got 1 / 1")


@pytest.mark.skipif(ON_GPU, reason="the refusal of a machine without a GPU")
def test_refuses_without_a_gpu(tmp_path):
    done = run("profile_host", "--out", str(tmp_path))
    assert done.returncode != 0 and done.stderr.strip() == "profile_host.py: needs a CUDA GPU"


def test_bare_launches_store_their_value(profile_host, device):
    """The timed kernels run (with 0 and with 24 extra arguments) and do what they say."""
    for n in (0, 24):
        assert profile_host.bare_launch_us(n, device, launches=2) > 0
    y = torch.full((1,), float("nan"), device=device)
    profile_host._store_one_24[(1,)](y, *range(24))
    assert y.item() == 1.0


@pytest.mark.skipif(not ON_GPU, reason="profiles decode steps: GPU only")
def test_short_run_writes_its_report(tmp_path):
    done = run("profile_host", "--new-tokens", "4", "--out", str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "host-gpt2-b1.md").read_text()
    assert "decode step without graphs" in text and "## By own time" in text and "model.py" in text
