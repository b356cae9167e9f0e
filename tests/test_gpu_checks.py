"""scripts/gpu_checks.py on the CPU: its command line and the summary it writes (the checks
themselves need a GPU)."""
import pytest

from tests.probe_scripts import assert_help_has_example, assert_refused_in_one_line, load

gpu_checks = load("gpu_checks")


def _report(graphs_same=True, alone_same=True):
    parity = {"prompt_len": 16, "new_tokens": 128, "hf_fp32_top2_margin": {"min": 0.0123, "median": 1.43}}
    engine = {}
    for dtype, diff in (("float32", 7.6e-5), ("float16", 0.078)):
        parity[dtype] = {"max_logit_diff": diff, "logit_scale": 54.3, "max_diff_over_scale": diff / 54.3,
                         "max_logit_diff_vs_hf_fp32": diff * 1.5, "hf_same_dtype_max_logit_diff_vs_hf_fp32": diff,
                         "teacher_forced_top1_agreement_vs_hf_same_dtype": 0.99609375,
                         "teacher_forced_top1_agreement_vs_hf_fp32": 0.9921875,
                         "hf_same_dtype_top1_agreement_vs_hf_fp32": 0.99609375,
                         "greedy_steps_matching_hf_same_dtype": 128 if dtype == "float32" else 93}
        partings = {"vs_hf_same_dtype": [64, 64, 64], "vs_hf_fp32": [64, 64, 64], "hf_same_dtype_vs_hf_fp32": [64] * 3}
        if dtype == "float16":
            partings = {"vs_hf_same_dtype": [17, 64, 30], "vs_hf_fp32": [12, 64, 64],
                        "hf_same_dtype_vs_hf_fp32": [9, 64, 64]}
        engine[dtype] = {"graphs_on_equals_off_greedy": True, "graphs_on_equals_off_sampled": graphs_same,
                         "batch_invariance_alone_vs_in_64": alone_same, "sampled_partings": partings}
        if not alone_same:
            engine[dtype].update(batch_first_diff=41, batch_hf_fp32_margin_at_first_diff=0.00731)
    return {"parity": parity, "engine": engine}


def test_summary_table():
    lines = gpu_checks.summary("gpt2-xl", _report()).splitlines()
    assert lines[0].startswith("gpt2-xl, 128 new tokens after 16 (transformers fp32's top-1/top-2 margin: min 0.0123")
    assert lines[2].count("|") == lines[3].count("|") == lines[4].count("|") == 10
    assert lines[4] == ("| float32 | 7.60e-05 / 54 (1.4e-06) | 1.14e-04 (7.60e-05) | 99.61% | 99.22% (99.61%) "
                        "| 128 / 128 | yes | yes | 3 / 3, median 64 |")
    assert lines[5].startswith("| float16 | 7.80e-02 / 54 (1.4e-03) |") and "| 93 / 128 |" in lines[5]
    assert lines[5].endswith("| yes | yes | 1 / 3, median 30 (against fp32: 2 / 3, median 64; transformers itself: "
                             "2 / 3, median 64) |"), lines[5]


def test_first_diff():
    assert gpu_checks.first_diff([1, 2, 3], [1, 2, 4]) == 2
    assert gpu_checks.first_diff([1, 2], [1, 2, 3]) == 2 and gpu_checks.first_diff([], [5]) == 0


def test_graphs_disagreeing_is_marked_and_caught():
    report = _report(graphs_same=False, alone_same=False)
    assert not gpu_checks.graphs_agree(report) and gpu_checks.graphs_agree(_report())
    row = gpu_checks.summary("gpt2", report).splitlines()[4]
    assert row.endswith("| **no** | from step 41 (transformers fp32's margin there 0.00731) | 3 / 3, median 64 |"), row


@pytest.mark.parametrize("argv, expect", [
    (["--out", "o", "--models", "gpt3"], "argument --models: invalid choice: 'gpt3'"),
    (["--out", "o", "--new-tokens", "0"], "expected 1 to 1008 tokens"),
    (["--out", "o", "--new-tokens", "1009"], "expected 1 to 1008 tokens"),
    (["--models", "gpt2"], "the following arguments are required: --out"),
])
def test_bad_arguments_refused_in_one_line(argv, expect):
    assert_refused_in_one_line("gpu_checks", argv, expect)


def test_help_has_examples():
    assert_help_has_example("gpu_checks", "--models gpt2 gpt2-xl --new-tokens 128")
