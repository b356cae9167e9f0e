"""scripts/probe_vocab_l2.py: its help, its one-line refusals, and on a GPU a short run."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ON_GPU

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "probe_vocab_l2.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_help_names_the_options():
    done = _run("--help")
    assert done.returncode == 0 and "--warm-mb" in done.stdout and "python3 scripts/probe_vocab_l2.py" in done.stdout


@pytest.mark.skipif(ON_GPU, reason="the refusal of a machine without a GPU")
def test_refuses_without_a_gpu(tmp_path):
    done = _run("--out", str(tmp_path))
    assert done.returncode != 0 and done.stderr.strip() == "probe_vocab_l2.py: needs a CUDA GPU"


@pytest.mark.skipif(not ON_GPU, reason="times a kernel: GPU only")
def test_short_run_writes_its_rows(tmp_path):
    done = _run("--warm-mb", "0", "4", "--no-argmax", "--screen", "--reps", "3", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    (path,) = tmp_path.glob("probe-vocab-l2-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["warm_mb"], r["argmax"]) for r in rows] == [(0, True), (0, False), (4, True), (4, False),
                                                           (0, "screen")]
    assert all(r["median_us"] > 0 for r in rows)
    assert rows[2]["dram_bound_us"] < rows[0]["dram_bound_us"]


def test_refuses_bad_arguments(tmp_path):
    done = _run("--reps", "1", "--out", str(tmp_path))
    assert done.returncode == 2 and "--reps >= 3" in done.stderr
