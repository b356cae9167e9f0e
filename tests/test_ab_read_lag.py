"""scripts/ab_read_lag.py: its help, its refusals, and the pieces its variants are made of."""
import pytest
import torch

from minillm.decode_state import READ_LAG, StepReads
from minillm.sampling import SamplingParams
from tests.conftest import ON_GPU
from tests.models import real_tokenizer_dir
from tests.probe_scripts import assert_refused_in_one_line, help_text, load, run


def test_help_names_the_options():
    out = help_text("ab_read_lag")
    assert "--rounds" in out and "python3 scripts/ab_read_lag.py" in out


def test_refuses_no_rounds():
    assert_refused_in_one_line("ab_read_lag", ["--rounds", "0"], "--rounds: expected >= 1, got 0")


@pytest.mark.skipif(ON_GPU, reason="the refusal of a machine without a GPU")
def test_refuses_without_a_gpu():
    done = run("ab_read_lag")
    assert done.returncode != 0 and done.stderr.strip() == "ab_read_lag.py: needs a CUDA GPU"


def test_set_lag_gives_every_state_reads_at_that_lag():
    ab = load("ab_read_lag")

    class State:
        def __init__(self, reads):
            self.out, self.out_host = torch.zeros(2, 8, dtype=torch.int64), None
            self.reads = StepReads(self.out) if reads else None

    class Engine:
        _states = {1: State(True), 2: State(True), 3: State(False)}

    kept = Engine._states[1].reads
    ab.set_lag(Engine, READ_LAG)
    assert Engine._states[1].reads is kept  # (the same lag: nothing made again)
    ab.set_lag(Engine, 0)
    assert [st.reads.lag for st in list(Engine._states.values())[:2]] == [0, 0]
    assert all(st.reads.host is st.out for st in list(Engine._states.values())[:2])
    assert Engine._states[3].reads is None  # (a state whose steps are not read stays so)


def test_alternate_and_first_fresh():
    """Round 0 is dropped, the variants alternate within each round; the first step at or past a
    bound whose id is new."""
    ab = load("ab_read_lag")
    calls = []

    def variant(name, values):
        it = iter(values)
        return lambda: calls.append(name) or next(it)
    medians, runs = ab.alternate({"a": variant("a", [100, 1, 2, 3]), "b": variant("b", [0, 5, 4, 9])}, 3)
    assert medians == {"a": 2, "b": 5} and runs == {"a": [1, 2, 3], "b": [5, 4, 9]}
    assert calls == ["a", "b"] * 4
    assert ab.first_fresh([4, 4, 7, 4, 8], 1) == 2 and ab.first_fresh([4, 4, 7, 4, 8], 3) == 4
    assert ab.first_fresh([4, 4, 4], 1) is None


def test_refuses_a_tokenizer_folder_without_one(tmp_path):
    assert_refused_in_one_line("ab_read_lag", ["--tokenizer", str(tmp_path)],
                               f"--tokenizer: expected a folder with tokenizer files, got {tmp_path}")


def test_stop_string_variant_searches_each_step_read(tmp_path, monkeypatch, capsys):
    """The stop-string variant hands generate the API's stop check for NEVER (a fresh one a call),
    over the tokenizer found; without one it is left out, saying where it looked."""
    ab = load("ab_read_lag")
    monkeypatch.setenv("MINILLM_TOKENIZER_DIR", str(tmp_path))
    assert ab.stop_decode(None) is None
    assert f"no tokenizer at {tmp_path}" in capsys.readouterr().out

    class Engine:
        checks = []

        def generate(self, prompts, params, stop_check=None):
            self.checks.append(stop_check)
            return None, {"steps": params.max_new_tokens, "decode_s": 0.5}

    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    assert ab.decode_tok_s(Engine(), [[1], [2]], params, False) == 16.0
    assert ab.decode_tok_s(Engine(), [[1], [2]], params, False, decode=lambda ids: "ab" * len(ids)) == 16.0
    assert ab.decode_tok_s(Engine(), [[1], [2]], params, False, decode=lambda ids: ab.NEVER * bool(ids)) == 16.0
    none, plain, found = Engine.checks
    assert none is None and plain(0, [5, 6]) is False and found(0, [5]) is True


@pytest.mark.skipif(real_tokenizer_dir() is None,
                    reason="the GPT-2 tokenizer is not at ../shared/assets/gpt2-tokenizer")
def test_stop_decode_reads_the_tokenizer():
    decode = load("ab_read_lag").stop_decode(real_tokenizer_dir())
    assert decode([15496, 995]) == "Hello world"
