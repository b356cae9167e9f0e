"""scripts/record_ranges.py: counts the runs in committed benchmark records and finds each
measure's lowest and highest value with its session, over the sessions asked."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import record_ranges  # noqa: E402


def _row(engine, tok_s, batch=1, model="gpt2", prompt_len=32, ttft_ms=1.0, gpu="abcdef12-0000"):
    return {"engine": engine, "model": model, "batch": batch, "prompt_len": prompt_len,
            "new_tokens": 1 if prompt_len == 1024 else 128, "dtype": "float16", "decoding": "greedy", "tok_s": tok_s,
            "ttft_ms": ttft_ms, "prefill_tok_s": 1024 / ttft_ms * 1e3, "step_ms": batch / tok_s * 1e3,
            "floor_fraction": tok_s / 12_000, "gpu_uuid": gpu}


def _collect(root, first, last):
    return record_ranges.collect(record_ranges.load_runs(root, first, last))


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows))


@pytest.fixture
def records(tmp_path):
    root = tmp_path / "h100"
    _write(root / "session-10/call1/generate-h100.json",
           [_row("minillm", 7600.0), _row("torch-compile", 2000.0), _row("minillm", 170_000.0, batch=64),
            _row("torch-compile", 80_000.0, batch=64), _row("minillm", 1.0, prompt_len=7)])
    _write(root / "session-10/call1/again/generate-h100.json", [_row("minillm", 7800.0), _row("torch-compile", 1950.0)])
    _write(root / "session-10/call1/ttft/generate-h100.json",
           [_row("minillm", 1e6, prompt_len=1024, ttft_ms=0.93), _row("hf-sdpa", 9e4, prompt_len=1024, ttft_ms=8.5)])
    _write(root / "session-12/call2/generate-h100.json",
           [_row("minillm", 7700.0, gpu="99999999-0"), _row("torch-compile", 2010.0, gpu="99999999-0")])
    _write(root / "session-12/call2/xl/generate-h100.json",
           [_row("minillm", 745.0, model="gpt2-xl", gpu="99999999-0")])
    (root / "session-12/call2/gpt2-rows.json").write_text("not a generate record")
    return root


def test_counts_and_ranges_carry_their_sessions(records):
    groups, gpus = _collect(records, 0, 100)
    assert gpus == {"abcdef12", "99999999"}
    b1 = groups["gpt2 batch 1"]
    assert [v for v, _ in b1["minillm tok/s"]] == [7800.0, 7600.0, 7700.0]  # again/ sorts before generate-
    assert min(b1["minillm tok/s"]) == (7600.0, 10) and max(b1["minillm tok/s"]) == (7800.0, 10)
    ratios = sorted(b1["minillm / torch-compile"])
    assert ratios[0] == pytest.approx((3.8, 10)) and ratios[-1] == pytest.approx((7800 / 1950, 10))
    assert groups["gpt2 batch 64"]["minillm / torch-compile"] == [(170_000 / 80_000, 10)]
    assert groups["gpt2-xl batch 1"]["minillm tok/s"] == [(745.0, 12)]
    ttft = groups["TTFT, 1024-token prompt"]
    assert ttft["minillm TTFT ms"] == [(0.93, 10)] and ttft["hf-sdpa TTFT ms"] == [(8.5, 10)]
    assert "minillm tok/s" not in ttft
    assert not any("7" in g for g in groups)  # a prompt length the goals leave out is not a group


def test_session_range_filters(records):
    groups, gpus = _collect(records, 12, 12)
    assert gpus == {"99999999"} and set(groups) == {"gpt2 batch 1", "gpt2-xl batch 1"}
    assert groups["gpt2 batch 1"]["minillm / torch-compile"] == [(7700 / 2010, 12)]


def test_report_table(records):
    out = subprocess.run([sys.executable, "scripts/record_ranges.py", "--root", str(records), "--sessions", "10-12"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.startswith("Sessions 10-12: 2 GPUs")
    assert "## gpt2 batch 1: 3 runs" in out and "## gpt2-xl batch 1: 1 run" in out
    assert "| minillm tok/s | 7,600 (10) | 7,800 (10) | 3 |" in out
    assert "| minillm / torch-compile | 3.800 (10) | 4.000 (10) | 3 |" in out
    assert "| minillm TTFT ms | 0.93 (10) | 0.93 (10) | 1 |" in out
    assert out.index("gpt2 batch 1:") < out.index("gpt2 batch 64:") < out.index("gpt2-xl") < out.index("TTFT")


@pytest.mark.parametrize("args, message", [
    (["--sessions", "12-10"], "ends before it starts"),
    (["--sessions", "ten"], "expected a session number or a range"),
    (["--sessions", "50"], "--sessions: no generate-*.json records"),
    (["--root", "missing"], "--root: missing is not a folder"),
])
def test_bad_arguments_get_one_line_errors(records, args, message):
    if args[0] == "--sessions":
        args = ["--root", str(records), *args]
    p = subprocess.run([sys.executable, "scripts/record_ranges.py", *args], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr


def test_rows_without_a_gpu_id_are_not_counted_as_gpus(tmp_path):
    row = _row("minillm", 8500.0)
    del row["gpu_uuid"]
    _write(tmp_path / "session-140/call3/bench1/generate-h200.json", [row, _row("minillm", 8600.0, batch=64)])
    groups, gpus = _collect(tmp_path, 0, 200)
    assert gpus == {None, "abcdef12"}
    assert record_ranges.report(groups, gpus, 0, 200).startswith("Sessions 0-200: 1 GPU, and rows that name no GPU\n")


def test_baselines_pair_only_with_rows_of_the_same_setting(tmp_path):
    """A baseline pairs with minillm only at the same setting (targets.find_row): a sampled row or
    one that failed is no greedy baseline, and a failed minillm row is no run."""
    sampled = {**_row("torch-compile", 1000.0), "decoding": "sample"}
    failed = {**_row("hf-eager", 100.0), "error": "out of memory"}
    failed_mine = {**_row("minillm", 5000.0, batch=64), "error": "out of memory"}
    _write(tmp_path / "session-5/call1/generate-h100.json",
           [_row("minillm", 7700.0), sampled, failed, _row("hf-eager", 110.0), failed_mine])
    groups, _ = _collect(tmp_path, 0, 10)
    assert set(groups) == {"gpt2 batch 1"}
    b1 = groups["gpt2 batch 1"]
    assert "minillm / torch-compile" not in b1 and b1["hf-eager tok/s"] == [(110.0, 5)]
    assert b1["minillm / hf-eager"] == [(70.0, 5)]


def test_bench_stream_records_are_no_goal_runs(tmp_path):
    """bench-stream's folder times minillm against its own streaming (no baseline): left out, while a
    goal run in a folder whose name merely contains "stream" still counts."""
    _write(tmp_path / "session-179/call3/stream/generate-h200.json",
           [_row("minillm", 8649.0), _row("minillm-stream", 7606.0)])
    _write(tmp_path / "session-179/call1/generate-h200.json", [_row("minillm", 8700.0)])
    _write(tmp_path / "session-179/call2/streamed/generate-h200.json", [_row("minillm", 8600.0)])
    groups, _ = _collect(tmp_path, 0, 200)
    assert sorted(groups["gpt2 batch 1"]["minillm tok/s"]) == [(8600.0, 179), (8700.0, 179)]
    assert not any(name.startswith("minillm-stream") or "/ minillm-stream" in name for name in groups["gpt2 batch 1"])


def test_goal_tally_counts_own_run_and_fastest_host(tmp_path):
    """Each goal counts the runs that measured it and met it against their own rows; a ratio against
    transformers is counted again against the fastest baseline host among the runs (the README's
    yardstick), so a run met only against a slow host is not met there."""
    _write(tmp_path / "session-20/call1/generate-h100.json",  # 53.3x eager, 3.81x torch-compile, floor 0.667
           [_row("minillm", 8000.0), _row("hf-eager", 150.0), _row("torch-compile", 2100.0)])
    _write(tmp_path / "session-21/call1/generate-h100.json",  # 29.5x, 4.21x, floor 0.492
           [_row("minillm", 5900.0), _row("hf-eager", 200.0), _row("torch-compile", 1400.0)])
    _write(tmp_path / "session-22/call1/generate-h100.json",  # 40.9x, no torch-compile, floor 0.75
           [_row("minillm", 9000.0), _row("hf-eager", 220.0)])
    tally = {t.name: (runs, met, fastest) for t, runs, met, fastest in
             record_ranges.goal_tally(record_ranges.load_runs(tmp_path, 0, 100))}
    assert tally == {
        "gpt2 batch 1 >= 40x transformers eager": (3, 2, (220.0, 22, 1)),  # only 9,000 is 40x of 220
        "gpt2 batch 1 >= 4x torch-compile": (2, 1, None),
        "gpt2 batch 1 floor fraction >= 0.5": (3, 2, None),
    }
    out = subprocess.run([sys.executable, "scripts/record_ranges.py", "--root", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "| gpt2 batch 1 >= 40x transformers eager | 3 | 2 | 1 (hf-eager 220.0 tok/s, session 22) |" in out
    assert "| gpt2 batch 1 floor fraction >= 0.5 | 3 | 2 | - |" in out
    assert "gpt2-xl" not in out  # a goal no run measured gets no line
