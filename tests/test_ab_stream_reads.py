"""scripts/ab_stream_reads.py: its help, its refusals, and its old-engine variant reading the eos
flags back at every check."""
import pytest
import torch

from minillm.decode_state import HostRows
from tests.conftest import ON_GPU
from tests.probe_scripts import assert_refused_in_one_line, help_text, load, run


def test_help_names_the_options():
    out = help_text("ab_stream_reads")
    assert "--rounds" in out and "python3 scripts/ab_stream_reads.py" in out


def test_refuses_no_rounds():
    assert_refused_in_one_line("ab_stream_reads", ["--rounds", "0"], "--rounds: expected >= 1, got 0")


@pytest.mark.skipif(ON_GPU, reason="the refusal of a machine without a GPU")
def test_refuses_without_a_gpu():
    done = run("ab_stream_reads")
    assert done.returncode != 0 and done.stderr.strip() == "ab_stream_reads.py: needs a CUDA GPU"


def test_the_old_variant_reads_the_flags_and_answers_the_same():
    """done_reading_flags reads the device's eos flags after a streamed step (the read session
    179 removed) and otherwise answers as HostRows.done."""
    ab = load("ab_stream_reads")

    class State:
        reads = 0

        @property
        def finished(self):
            type(self).reads += 1
            return torch.tensor([False, True])

    rows = HostRows(2, (9,), None)
    rows.add([4, 9])
    assert ab.done_reading_flags(rows, State(), 1, 10) is False and State.reads == 1
    assert rows.ended == [False, True]
