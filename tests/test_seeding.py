"""The suite's per-test torch seed (tests/seeding.py): fresh per test, named on failure, replayable."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.seeding import SEED_ENV

REPO = Path(__file__).resolve().parents[1]

# two tests record their first draw; the third fails with its draw in the message
INNER = '''
import torch

def test_a(tmp_path_factory):
    (tmp_path_factory.getbasetemp().parent / "a.txt").write_text(repr(torch.rand(4).tolist()))

def test_b(tmp_path_factory):
    (tmp_path_factory.getbasetemp().parent / "b.txt").write_text(repr(torch.rand(4).tolist()))

def test_fails():
    assert False, "drew " + repr(torch.rand(4).tolist())
'''


def _run(tmp_path, seed_env, *args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(SEED_ENV, None)
    if seed_env is not None:
        env[SEED_ENV] = seed_env
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
           "-p", "tests.seeding", "--basetemp", str(tmp_path / "base"), *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_seed_is_fresh_per_test_named_on_failure_and_replays(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    fresh = _run(tmp_path, None, "test_inner.py")
    assert fresh.returncode == 1, fresh.stdout + fresh.stderr
    a, b = (tmp_path / "a.txt").read_text(), (tmp_path / "b.txt").read_text()
    assert a != b, "two tests drew the same inputs: the seed is not fresh per test"
    # only the failing test's report carries a seed section
    assert fresh.stdout.count("torch seed") == 1, fresh.stdout
    seed = re.search(rf"(\d+): replay with {SEED_ENV}=(\d+)", fresh.stdout)
    assert seed and seed[1] == seed[2], fresh.stdout
    drew = re.search(r"drew (\[[^\]]+\])", fresh.stdout)[1]

    replay = _run(tmp_path, seed[1], "test_inner.py::test_fails")
    assert replay.returncode == 1, replay.stdout + replay.stderr
    assert f"drew {drew}" in replay.stdout, (drew, replay.stdout)
    assert f"{seed[1]}: replay with" in replay.stdout


@pytest.mark.parametrize("bad", ["abc", "-3", str(2**63)])
def test_bad_seed_is_a_one_line_usage_error(tmp_path, bad):
    (tmp_path / "test_inner.py").write_text("def test_ok():\n    pass\n")
    out = _run(tmp_path, bad, "test_inner.py")
    assert out.returncode == 4, out.stdout + out.stderr  # pytest's usage-error exit code
    assert f"{SEED_ENV}: expected an integer in [0, 2**63), got {bad!r}" in out.stderr
    assert "Traceback" not in out.stderr
