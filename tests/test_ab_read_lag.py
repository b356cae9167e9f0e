"""scripts/ab_read_lag.py: its help, its refusals, and the pieces its variants are made of."""
import pytest
import torch

from minillm.decode_state import READ_LAG, StepReads
from tests.conftest import ON_GPU
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
