"""scripts/probe_prompt_speed.py: its help, its one-line refusals, its prompts and report, and on a
GPU a short run."""
import pytest
import torch

from minillm.config import PRESETS
from tests.conftest import ON_GPU
from tests.probe_scripts import assert_refused_in_one_line, help_text, load, run


@pytest.fixture(scope="module")
def probe():
    return load("probe_prompt_speed")


def test_help_shows_an_example():
    out = help_text("probe_prompt_speed")
    assert "--prompts" in out and "MINILLM_VOCAB_SCREEN=0" in out


@pytest.mark.parametrize("argv, got", [(["--rounds", "0"], "got 1 / 7 / 0"), (["--batch", "0"], "got 0 / 7 / 5"),
                                       (["--prompts", "-1"], "got 1 / -1 / 5")])
def test_refuses_bad_counts(argv, got):
    assert_refused_in_one_line("probe_prompt_speed", argv,
                               f"--batch / --prompts / --rounds: expected >= 1 / >= 0 / >= 1, {got}")


@pytest.mark.skipif(ON_GPU, reason="the refusal of a machine without a GPU")
def test_refuses_without_a_gpu(tmp_path):
    done = run("probe_prompt_speed", "--out", str(tmp_path))
    assert done.returncode != 0 and done.stderr.strip() == "probe_prompt_speed.py: needs a CUDA GPU"


def test_refuses_a_model_that_is_not_a_preset():
    assert_refused_in_one_line("probe_prompt_speed", ["--model", "weights/gpt2"], "--model: invalid choice")


def test_prompts_are_the_bench_draw_then_ab_decodes_seeds(probe):
    cfg = PRESETS["gpt2"]
    torch.manual_seed(0)
    bench_draw = torch.randint(0, cfg.vocab_size, (2, probe.PROMPT_LEN)).tolist()
    torch.manual_seed(0)
    named = probe.prompts_for(cfg, 2, 3, "cpu")
    assert list(named) == ["bench", "seed 1", "seed 2", "seed 3"]
    assert named["bench"] == bench_draw
    # ab_decode's prompt at batch B is seed B's draw
    ab_b2 = torch.randint(0, cfg.vocab_size, (2, probe.PROMPT_LEN), generator=torch.Generator().manual_seed(2))
    assert named["seed 2"] == ab_b2.tolist() and named["seed 1"] != named["seed 2"]


def test_report_compares_each_prompt_with_the_bench(probe):
    results = {"bench": ([100.0, 90.0, 110.0], [[5, 5, 6]]), "seed 1": ([120.0, 118.0, 125.0], [[1, 2, 3]])}
    text = probe.report(results, "title")
    assert "| bench | 100 | 90-110 | +0.0% | 2 |" in text
    assert "| seed 1 | 120 | 118-125 | +20.0% | 3 |" in text
    assert "Across prompts: 100-120 tok/s (20.0% from the slowest to the fastest)." in text


@pytest.mark.skipif(not ON_GPU, reason="times decode on a GPU")
def test_short_run_writes_its_report(tmp_path):
    done = run("probe_prompt_speed", "--prompts", "1", "--rounds", "1", "--out", str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "prompt-speed-gpt2-b1.md").read_text()
    assert "| bench |" in text and "| seed 1 |" in text and "screened head on" in text
