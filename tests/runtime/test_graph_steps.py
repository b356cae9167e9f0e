"""Several decode steps in one CUDA graph (minillm.generate.GRAPH_STEPS): which replay runs when,
the switch's refusals, and the same tokens as one step a replay and as no graphs at all."""
import pytest
import torch

import minillm.generate
from minillm import LLM, SamplingParams
from minillm.generate import SYNC_EVERY, graph_steps_from_env, steps_per_replay
from tests.conftest import ON_GPU
from tests.models import build_checkpoint


@pytest.mark.parametrize("value,steps", [(None, 1), ("", 1), ("1", 1), ("4", 4), ("16", 16)])
def test_graph_steps_from_env(value, steps):
    assert graph_steps_from_env(value) == steps


@pytest.mark.parametrize("value", ["0", "3", "32", "-4", "four", "4.0"])
def test_graph_steps_from_env_refuses(value):
    with pytest.raises(ValueError, match=r"MINILLM_GRAPH_STEPS: expected one of 1, 2, 4, 8, 16, got"):
        graph_steps_from_env(value)


def _replays(new_tokens, steps, stream=False):
    """The steps each replay of a call runs, from the first token (the prefill's) on."""
    n, runs = 1, []
    while n < new_tokens:
        runs.append(steps_per_replay(n, new_tokens - n, stream, steps))
        n += runs[-1]
    return runs


@pytest.mark.parametrize("steps", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("new_tokens", [1, 2, 15, 16, 17, 37, 128])
def test_replays_end_on_every_stop_check(steps, new_tokens):
    """Replays cover the call's tokens exactly, end on every SYNC_EVERY-th token (where the host
    checks for stops), and run `steps` at a time from the first multiple of it on, while they fit."""
    runs = _replays(new_tokens, steps)
    ends = {1 + sum(runs[:i + 1]) for i in range(len(runs))}
    assert 1 + sum(runs) == max(new_tokens, 1)
    assert set(range(SYNC_EVERY, new_tokens + 1, SYNC_EVERY)) <= ends
    assert set(runs) <= {1, steps}
    whole = (new_tokens // steps - 1) if steps > 1 else new_tokens - 1  # replays of `steps` after the first
    assert runs.count(steps) == max(whole, 0)
    assert _replays(new_tokens, steps, stream=True) == [1] * (new_tokens - 1)  # a stream takes each token


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("graph-steps")
    build_checkpoint(p, seed=6, n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=128)
    return str(p)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("graph_steps", [4, 16])
@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=37, temperature=0, ignore_eos=True),
                                    SamplingParams(max_new_tokens=37, temperature=0.9, top_k=30, top_p=0.95,
                                                   repetition_penalty=1.2, seed=3, ignore_eos=True)],
                         ids=["greedy", "sampled"])
def test_steps_in_one_graph_give_the_same_tokens(path, monkeypatch, graph_steps, params):
    """A call whose replays run graph_steps steps (and one at a time before and after them) gives
    the tokens of one step a replay and of no graphs, at 1 and 5 rows (bucket 8, padded rows)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 511, (int(n),), generator=g).tolist() for n in (7, 3, 12, 1, 9)]
    runs = []
    monkeypatch.setattr(minillm.generate, "steps_per_replay",
                        lambda *a: runs.append(steps_per_replay(*a)) or runs[-1])
    ids = {}
    for name, steps, graphs in (("steps", graph_steps, True), ("one", 1, True), ("off", 1, False)):
        monkeypatch.setattr(minillm.generate, "GRAPH_STEPS", steps)
        llm = LLM(path, dtype="float16", cuda_graphs=graphs)
        pad = [] if graphs else [[1]] * 3  # graphs pad 5 rows to the bucket of 8: so must the eager run
        ids[name] = ([r.token_ids for r in llm.generate(prompts[:1], params)],
                     [r.token_ids for r in llm.generate(prompts + pad, params)[:5]])
        if name == "steps":
            assert runs.count(graph_steps) == 2 * (37 // graph_steps - 1)  # the graph of steps did run
            assert all(st.graph_steps == graph_steps for st in llm.engine._states.values())
    assert ids["steps"] == ids["one"] == ids["off"]
