"""scripts/probe_tma_stream.py: its help, its one-line refusal, and on a Hopper GPU a short run
whose sums say every box arrived."""
import json

from tests.probe_scripts import assert_help_has_example, assert_refused_in_one_line, hopper, run as run_probe


def run(*argv):
    return run_probe("probe_tma_stream", *argv, timeout=300)


def test_help_and_refusal():
    assert_help_has_example("probe_tma_stream", "python3 scripts/probe_tma_stream.py --out DIR", timeout=300)
    assert_refused_in_one_line("probe_tma_stream", ["--gbytes", "0"], "argument --gbytes: expected a number in (0, 64]")
    assert_refused_in_one_line("probe_tma_stream", ["--configs", "0"], "--configs: expected an integer >= 1")


@hopper
def test_short_run_sums_every_box(tmp_path):
    done = run("--gbytes", "0.25", "--configs", "2", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads((tmp_path / "tma-stream.json").read_text())["runs"]
    assert len(runs) == 4 and all(r["sums_ok"] for r in runs if r["touch"]) and all(r["gbps"] > 0 for r in runs)
