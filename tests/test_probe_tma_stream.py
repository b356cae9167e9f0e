"""scripts/probe_tma_stream.py: its help, its one-line refusal, and on a Hopper GPU a short run
whose sums say every box arrived."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "probe_tma_stream.py"


def run(*argv):
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300)


def test_help_and_refusal():
    done = run("--help")
    assert done.returncode == 0 and "python3 scripts/probe_tma_stream.py --out DIR" in done.stdout
    done = run("--gbytes", "0")
    err = [line for line in done.stderr.splitlines() if line.startswith("probe_tma_stream.py: error")]
    assert done.returncode == 2 and len(err) == 1 and "more than 0 and at most 64 GB" in err[0]
    done = run("--configs", "0")
    err = [line for line in done.stderr.splitlines() if line.startswith("probe_tma_stream.py: error")]
    assert done.returncode == 2 and len(err) == 1 and "--configs: expected an integer >= 1" in err[0]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="Gluon TMA kernels: an H100 / H200 (they do not run under the interpreter)")
def test_short_run_sums_every_box(tmp_path):
    done = run("--gbytes", "0.25", "--configs", "2", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads((tmp_path / "tma-stream.json").read_text())["runs"]
    assert len(runs) == 4 and all(r["sums_ok"] for r in runs if r["touch"]) and all(r["gbps"] > 0 for r in runs)
