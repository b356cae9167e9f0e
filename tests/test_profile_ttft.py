"""scripts/profile_ttft.py: the GPU's busy time on made-up profiler events (no GPU), and on a GPU
one short run of the whole script on a small random model."""
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import ON_GPU

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("profile_ttft", ROOT / "scripts" / "profile_ttft.py")
profile_ttft = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_ttft)

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def event(device, start, end):
    return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start, end=end))


class _Prof:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def test_gpu_busy_counts_overlaps_once_and_skips_host_ops():
    # GPU spans [0, 4] and [2, 6] overlap (6 us together), [10, 11] apart; a host op spans all
    prof = _Prof([event(CUDA, 2.0, 6.0), event(CPU, 0.0, 20.0), event(CUDA, 0.0, 4.0), event(CUDA, 10.0, 11.0),
                  event(CUDA, 3.0, 5.0)])
    assert profile_ttft.gpu_busy_us(prof) == 7.0
    assert profile_ttft.gpu_busy_us(_Prof([event(CPU, 0.0, 1.0)])) == 0.0


def test_bad_arguments_are_one_line_errors():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_ttft.py"), "--repeats", "0"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--repeats and --prompt-len: expected positive integers" in r.stderr


@pytest.mark.skipif(not ON_GPU, reason="profiles CUDA graphs: needs a GPU")
def test_a_short_run_writes_its_report(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_ttft.py"), "--model", "gpt2",
                        "--prompt-len", "8", "40", "--repeats", "3", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    text = (tmp_path / "ttft-gpt2.md").read_text()
    assert "## prompt 8 tokens" in text and "## prompt 40 tokens" in text and "median TTFT over 3 warm calls" in text
