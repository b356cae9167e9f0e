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


def test_host_times_records_prefill_and_replay_calls_then_restores_them(monkeypatch):
    class _Engine:
        def prefill(self, n):
            if n < 0:
                raise ValueError("n")
            return n + 1

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: "replayed")
    engine, replay = _Engine(), torch.cuda.CUDAGraph.replay
    with profile_ttft.host_times(engine) as times:
        assert engine.prefill(1) == 2 and engine.prefill(5) == 6
        with pytest.raises(ValueError):  # a failing call is timed too, and still raises
            engine.prefill(-1)
        assert torch.cuda.CUDAGraph.replay(None) == "replayed"
    assert len(times["prefill"]) == 3 and len(times["replay"]) == 1
    assert all(t >= 0 for t in times["prefill"] + times["replay"])
    assert "prefill" not in vars(engine) and torch.cuda.CUDAGraph.replay is replay


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
    assert "of its graph's replay alone" in text
