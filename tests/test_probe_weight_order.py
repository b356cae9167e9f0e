"""scripts/probe_weight_order.py: every order streams the same tiles (its kernel, interpreted on
the CPU), its help, its one-line refusals, and on a GPU a short run."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ON_GPU

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "probe_weight_order.py"
spec = importlib.util.spec_from_file_location("probe_weight_order", SCRIPT)
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("K,N,block_n,block_k", [(40, 50, 16, 16), (64, 32, 32, 16)])
def test_every_order_streams_the_same_tiles(K, N, block_n, block_k, device):
    """Every program adds up its tile of W in every order (K and N off the tile edges at first)."""
    w = torch.randn(K, N, device=device).half()
    n_blocks, chunks = -(-N // block_n), -(-K // block_k)
    sums = []
    for order in probe.ORDERS:
        out = torch.full((n_blocks * chunks,), float("nan"), device=device)
        probe.stream_tiles(probe.stored(w, order, block_n, block_k), order, block_n, block_k, K, N, out)
        sums.append(out.cpu())
    padded = torch.zeros(chunks * block_k, n_blocks * block_n)
    padded[:K, :N] = w.float().cpu()
    expect = padded.view(chunks, block_k, n_blocks, block_n).sum(dim=(1, 3)).t().reshape(-1)
    for got in sums:
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-3)


def test_help_names_the_options():
    done = _run("--help")
    assert done.returncode == 0 and "--tiles" in done.stdout and "python3 scripts/probe_weight_order.py" in done.stdout


def test_refuses_bad_tiles(tmp_path):
    done = _run("--tiles", "100x256", "--out", str(tmp_path))
    assert done.returncode == 2 and "--tiles: expected BLOCK_NxBLOCK_K" in done.stderr


@pytest.mark.skipif(ON_GPU, reason="the refusal of a machine without a GPU")
def test_refuses_without_a_gpu(tmp_path):
    done = _run("--out", str(tmp_path))
    assert done.returncode != 0 and done.stderr.strip() == "probe_weight_order.py: needs a CUDA GPU"


@pytest.mark.skipif(not ON_GPU, reason="times a kernel: GPU only")
def test_short_run_writes_its_rows(tmp_path):
    done = _run("--shapes", "gpt2-medium-mlp-out", "--tiles", "64x256", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    (path,) = tmp_path.glob("probe-weight-order-*.json")
    rows = json.loads(path.read_text())["rows"]
    pdls = (False, True) if probe.is_hopper(torch.device("cuda")) else (False,)  # dependent launch: Hopper on
    assert [(r["tile"], r["order"], r["pdl"]) for r in rows] == [("64x256", o, pdl) for pdl in pdls
                                                                 for o in ("out-major", "in-major", "tiles")]
    assert all(r["us"] > 0 and r["programs"] == 16 * 16 for r in rows)
