"""Engine invariants: CUDA graphs change nothing, and a prompt's tokens do not depend on the
batch it runs in (up to 64 rows: the decode linear's reduction order depends on N and K only)."""
import dataclasses
import json
import shutil

import pytest
import torch

import kernels.vocab_screen
from kernels.argmax_key import argmax_index
import minillm.decode_plan
from minillm import LLM, SamplingParams
from minillm.checks import ContextLengthError, NonFiniteLogitsError, check_context, check_vocab
from minillm.decode_state import READ_LAG, HostRows, StepReads, batch_bucket, cache_bucket
from tests.conftest import ON_GPU
from tests.models import build_checkpoint

SIZE = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=128) if ON_GPU else \
    dict(n_layer=1, n_head=2, n_embd=32, vocab_size=256, n_positions=64)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("engine")
    build_checkpoint(p, seed=4, **SIZE)
    return str(p)


def _prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (int(torch.randint(1, 20, (), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True),
                                    SamplingParams(max_new_tokens=24, temperature=0.9, top_k=30, top_p=0.95,
                                                   repetition_penalty=1.2, seed=3, ignore_eos=True)],
                         ids=["greedy", "sampled"])
def test_cuda_graphs_on_off_identical(path, dtype, params):
    prompts = _prompts(5, SIZE["vocab_size"])
    on = LLM(path, dtype=dtype)
    off = LLM(path, dtype=dtype, cuda_graphs=False)
    assert on.engine.use_cuda_graphs and not off.engine.use_cuda_graphs
    # graphs pad the batch to a bucket (5 -> 8); so must the eager run for identical draws
    pad = [[1]] * 3
    a = [r.token_ids for r in on.generate(prompts, params)]
    b = [r.token_ids for r in off.generate(prompts + pad, params)[:5]]
    assert a == b


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("top_k", [30, 0], ids=["noise-in-kernel", "noise-by-torch"])
def test_a_call_without_a_seed_draws_where_the_caller_left_the_generator(path, top_k):
    """torch.manual_seed before a call without a seed gives the same ids whether the call is an
    engine's first (a new decode state: a dry pass and two warm-up steps before its capture, each
    drawing noise) or a later one, and as an engine without graphs (on the same padded batch)."""
    prompts = _prompts(3, SIZE["vocab_size"], seed=6)
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_k=top_k, ignore_eos=True)
    on = LLM(path, dtype="float16")
    off = LLM(path, dtype="float16", cuda_graphs=False)
    padded = prompts + [[1]] * (batch_bucket(3) - 3)
    runs = []
    for llm, batch in ((on, prompts), (on, prompts), (off, padded), (off, padded)):
        torch.manual_seed(21)
        runs.append([r.token_ids for r in llm.generate(batch, params)[:3]])
        runs[-1].append(torch.rand(2, device="cuda").tolist())  # and the generator ends where it did
    assert runs[0] == runs[1] == runs[2] == runs[3]
    torch.manual_seed(22)
    assert [r.token_ids for r in on.generate(prompts, params)] != runs[0][:3]


@pytest.mark.skipif(not ON_GPU, reason="the sampler computes torch's CUDA noise in-kernel on a GPU only")
@pytest.mark.parametrize("graphs", [True, False])
def test_kernel_noise_same_ids_and_generator(path, monkeypatch, graphs):
    """Sampled steps that compute torch's exponential_ noise inside the sampler give the ids that
    drawing it with torch gives, and leave the CUDA generator where that leaves it: after a run,
    and after a stream closed early."""
    import minillm.sampling

    prompts = _prompts(3, SIZE["vocab_size"], seed=2)
    params = SamplingParams(max_new_tokens=20, temperature=0.9, top_k=30, top_p=0.95, seed=3, ignore_eos=True)
    torch.cuda.init()  # default_generators is empty until CUDA is initialized (this test alone in a process)
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    runs = {}
    for in_kernel in (True, False):
        monkeypatch.setattr(minillm.sampling, "KERNEL_NOISE", in_kernel)
        llm = LLM(path, dtype="float16", cuda_graphs=graphs)
        ids = [r.token_ids for r in llm.generate(prompts, params)]
        offset, after = gen.get_offset(), torch.rand(4, device="cuda")  # the stream goes on from there
        steps = llm.engine.steps(prompts, params, stream=True)
        next(steps), next(steps)
        steps.close()
        runs[in_kernel] = ids, offset, after, gen.get_offset()
        assert all((st.noise is not None) == in_kernel for st in llm.engine._states.values())
    (ids, offset, after, closed), (ids_t, offset_t, after_t, closed_t) = runs[True], runs[False]
    assert ids == ids_t and offset == offset_t and torch.equal(after, after_t) and closed == closed_t


@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True),
                                    SamplingParams(max_new_tokens=16, temperature=0.9, top_k=30, seed=5,
                                                   ignore_eos=True)], ids=["greedy", "sampled"])
def test_a_second_gpu_gives_the_same_ids(path, params):
    """A model on cuda:1, with the current device left at 0, gives the ids it gives on cuda:0:
    the engine's launches and graph captures follow the model's device."""
    prompts = _prompts(3, SIZE["vocab_size"], seed=4)
    torch.cuda.set_device(0)
    ids = {d: [r.token_ids for r in LLM(path, device=d, dtype="float16").generate(prompts, params)]
           for d in ("cuda:0", "cuda:1")}
    assert ids["cuda:0"] == ids["cuda:1"] and torch.cuda.current_device() == 0


def test_cache_bucket():
    """The smallest length bucket that holds a call's positions, the length itself past the
    last bucket, never more than the model's context."""
    assert [cache_bucket(n, 1024) for n in (1, 128, 129, 160, 1000)] == [128, 128, 256, 256, 1024]
    assert cache_bucket(5000, 8192) == 5000
    assert cache_bucket(300, 200) == 200


def test_batch_bucket():
    """The smallest batch bucket that holds a call's prompts, the count itself past the last."""
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 33, 64, 65, 256)] == [1, 2, 4, 8, 64, 64, 128, 256]
    assert batch_bucket(300) == 300


def test_host_rows_end_at_eos_ids_and_ask_stop_checks_in_order():
    """Rows end at any eos id in the ids added; done() asks stop_check about the rows in order up
    to the first still going, and not again about one it has ended."""
    seen = []
    rows = HostRows(3, (9, 11), lambda b, ids: seen.append((b, list(ids))) or 7 in ids)
    assert rows.watching and not HostRows(2, (), None).watching
    for step in ([5, 1, 4], [6, 9, 4]):
        rows.add(step)
    assert rows.ended == [False, True, False] and rows.steps == 2
    assert not rows.done() and seen == [(0, [5, 6])]  # (it stops at the first row that goes on)
    rows.add([7, 2, 11])  # row 0 reaches its stop string, row 2 the second eos id
    assert rows.done() and rows.stopped == [True, False, False] and rows.ended == [False, True, True]
    assert rows.done() and seen == [(0, [5, 6]), (0, [5, 6, 7])]  # row 0 is not asked again
    plain = HostRows(2, (9,), None)
    plain.add([9, 3])
    assert not plain.done() and plain.ids == [[], []]  # (ids kept for a stop_check only)
    plain.add([1, 9])
    assert plain.done()


@pytest.mark.parametrize("dev", ["cpu", "cuda"] if ON_GPU else ["cpu"])
def test_step_reads_hand_back_every_step_in_order_lag_steps_behind(dev):
    """Each pushed step's ids come back once more than lag steps are queued, all of them at the
    last step, in order, each from its own column (of the pinned mirror on a GPU, after the
    step's event, its slot in a ring of lag + 1 reused over the call)."""
    out = torch.zeros(3, 12, dtype=torch.int64, device=dev)
    host = torch.full((3, 12), -1, dtype=torch.int64, pin_memory=True) if dev == "cuda" else None
    reads = StepReads(out, host, lag=2)
    reads.start(column=2)
    popped = []  # (steps pushed, ids popped)
    for step in range(7):
        ids = torch.full((3,), 10 + step, dtype=torch.int64, device=dev)
        if dev == "cuda":  # a step writing the mirror, queued behind a slow kernel
            torch.cuda._sleep(1_000_000)
            host[:, 2 + step].copy_(ids, non_blocking=True)
        else:
            out[:, 2 + step] = ids
        reads.push()
        while reads.behind(last=step == 6):
            popped.append((step + 1, reads.pop()))
    assert popped == [(k + 3, [10 + k] * 3) for k in range(4)] + [(7, [10 + k] * 3) for k in (4, 5, 6)]
    reads.push()
    reads.start(column=1)
    assert not reads.behind(last=True) and reads.column == 1


def _with_eos(llm, eos):
    """llm with its config's end-of-sequence ids replaced (restored by the caller)."""
    llm.model.config = llm.config = dataclasses.replace(llm.config, eos_token_ids=eos)


def test_a_call_ends_at_the_step_its_last_row_ends(path):
    """With an eos id, the call's steps are exactly those up to the step where the last row ends;
    the device runs READ_LAG steps past it at most (the host reads each step that far behind);
    a stream yields those steps and no later one."""
    llm = LLM(path, device="cpu", dtype="float32", backend="torch")
    free = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    prompts = _prompts(6, SIZE["vocab_size"], seed=2)
    runs = [llm.generate([p], free)[0].token_ids for p in prompts]
    # a prompt whose run has a token first seen past step 2 * READ_LAG (a greedy run may loop)
    cands = [(r, k) for r, run in enumerate(runs) for k in range(2 * READ_LAG, 30) if run[k] not in run[:k]]
    assert cands, f"no greedy run has a fresh token in steps {2 * READ_LAG}-29"
    r, k = cands[0]
    old = llm.config
    _with_eos(llm, (runs[r][k],))
    try:
        params = SamplingParams(max_new_tokens=40, temperature=0)
        ids, timings = llm.engine.generate([prompts[r]], params)
        (st,) = [st for key, st in llm.engine._states.items() if key[-1]]  # (the one whose steps are read)
        ran = st.step.item()
        events = list(llm.engine.steps([prompts[r]], params, stream=True))
    finally:
        llm.model.config = llm.config = old
    assert timings["steps"] == k + 1 and ids[0] == runs[r][:k + 1]
    assert ran == k + 1 + READ_LAG  # (the lag at its full: more steps were left to run)
    assert [e[1][0] for e in events[:-1]] == runs[r][:k + 1] and events[-1][2]["steps"] == k + 1


@pytest.mark.parametrize("ends", [(5, 21), (21, 5)])
def test_rows_stopped_at_different_steps_end_the_call(path, ends):
    """A stop check says True once, at the step where its row's stop string shows up (the API's
    searches only new text): a row it ended stays ended, and the call ends at the step where the
    last row stops (each step read is checked), not at max_new_tokens. A row after one still
    going is asked once that one ends, about all its ids."""
    llm = LLM(path, device="cpu", dtype="float32", backend="torch")
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    told, asked = set(), []

    def once_per_row(b, ids):  # True at the first check at or past the row's stop only
        asked.append((b, len(ids)))
        if len(ids) >= ends[b] and b not in told:
            told.add(b)
            return True
        return False

    _, timings = llm.engine.generate([[1, 2, 3], [4, 5]], params, stop_check=once_per_row)
    assert timings["steps"] == max(ends)
    assert [n for b, n in asked if b == 0] == list(range(1, ends[0] + 1))  # row 0: each step to its stop
    # row 1: first at row 0's stop, about all its ids, then each step to the call's end
    assert [n for b, n in asked if b == 1] == list(range(ends[0], max(ends) + 1))


def test_without_graphs_one_cache_is_held(path):
    """Calls of 1, 3 and 2 prompts without CUDA graphs: one cache at a time (each had stayed, 75 MB
    a row for gpt2 in fp32), and every call's ids as in a fresh engine."""
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    llm = LLM(path, device="cpu", dtype="float32", backend="torch")
    prompts = _prompts(3, SIZE["vocab_size"], seed=5)
    first = [r.token_ids for r in llm.generate(prompts, params)]
    for n in (1, 3, 2):
        assert [r.token_ids for r in llm.generate(prompts[:n], params)] == first[:n]
        assert list(llm.engine._caches) == [n]


def test_a_cache_that_does_not_fit_displaces_the_other_batch_sizes(path, monkeypatch):
    """With CUDA graphs the caches stay per batch bucket; where a new one does not fit, those of
    the other sizes go (with the states and graphs that write them) and it is made again. Where
    nothing else is held, the out-of-memory error stands."""
    llm = LLM(path, device="cpu", dtype="float32", backend="torch")
    engine, make = llm.engine, llm.model.new_cache
    engine.use_cuda_graphs = True  # the policy alone: cache_for never captures
    budget = {"rows": 3}

    def new_cache(batch):
        if batch + sum(engine._caches) > budget["rows"]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return make(batch)

    monkeypatch.setattr(llm.model, "new_cache", new_cache)
    engine.cache_for(1), engine.cache_for(2)
    engine._states[(2, "key")] = engine._states[(1, "key")] = "state"
    engine._prefill_graphs[(1, 16, False)] = "graph"
    assert sorted(engine._caches) == [1, 2]  # both fit
    engine.cache_for(3)
    assert list(engine._caches) == [3] and engine._states == {} and engine._prefill_graphs == {}
    with pytest.raises(torch.cuda.OutOfMemoryError):
        engine.cache_for(4)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graphs_stop_at_eos_identical(path, tmp_path):
    """With end-of-sequence tokens (the second of two ids is the one drawn; the host reads each
    step's ids back READ_LAG steps behind the graph's replays): the same tokens and finish with
    graphs on and off, and both end the call at its step, the device READ_LAG steps past it."""
    candidates = _prompts(8, SIZE["vocab_size"], seed=2)
    free = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    plain = LLM(path, dtype="float16", cuda_graphs=False)
    for row0, prompt in enumerate(candidates):  # a greedy run may fall into a loop: take one that does not
        first = plain.generate([prompt], free)[0].token_ids
        # a token that first shows up in row 0 past step 2 * READ_LAG
        k = next((i for i in range(2 * READ_LAG, len(first)) if first[i] not in first[:i]), None)
        if k is not None:
            break
    assert k is not None, f"each of {len(candidates)} prompts repeats itself past token {2 * READ_LAG}"
    prompts = [prompt] + [p for i, p in enumerate(candidates) if i != row0][:2]
    eos_dir = tmp_path / "eos"
    shutil.copytree(path, eos_dir)
    unseen = next(t for t in range(SIZE["vocab_size"]) if t not in first)
    for name in ("config.json", "generation_config.json"):  # generate stops at the latter's eos
        cfg = json.loads((eos_dir / name).read_text())  # two ids: the step's kernel flags either
        (eos_dir / name).write_text(json.dumps({**cfg, "eos_token_id": [unseen, first[k]]}))
    on = LLM(str(eos_dir), dtype="float16")
    off = LLM(str(eos_dir), dtype="float16", cuda_graphs=False)
    params = SamplingParams(max_new_tokens=40, temperature=0)
    a, b = on.generate(prompts[:1], params)[0], off.generate(prompts[:1], params)[0]
    assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason) == (first[:k + 1], "stop")
    steps = [llm.engine.generate(prompts[:1], params)[1]["steps"] for llm in (on, off)]
    ran = [next(st for key, st in llm.engine._states.items() if key[-1]).step.item() for llm in (on, off)]
    assert steps == [k + 1] * 2 and ran == [min(k + 1 + READ_LAG, params.max_new_tokens)] * 2
    a3 = [r.token_ids for r in on.generate(prompts, params)]
    b3 = [r.token_ids for r in off.generate(prompts + [[0]], params)[:3]]  # the bucket's padding
    assert a3 == b3


@pytest.mark.parametrize("dtype", ["float16", "float32"] if ON_GPU else ["float32"])
def test_batch_invariance(path, dtype):
    """A prompt alone and at row 20 of a batch of 64 (greedy) generates the same tokens."""
    backend = "triton"
    if not ON_GPU:
        pytest.importorskip("triton")
    llm = LLM(path, device="cuda" if ON_GPU else "cpu", dtype=dtype, backend=backend)
    params = SamplingParams(max_new_tokens=16 if ON_GPU else 4, temperature=0, ignore_eos=True)
    prompts = _prompts(64, SIZE["vocab_size"], seed=1)
    alone = llm.generate([prompts[20]], params)[0].token_ids
    assert llm.generate(prompts, params)[20].token_ids == alone




@pytest.mark.parametrize("n", [1, 3])
def test_greedy_first_token_is_the_prefill_heads_argmax(path, n):
    """Greedy decoding's first token comes from the lm_head's argmax keys at prefill (one launch,
    no logits), as every later token does: the same ids as torch's argmax of the prefill's
    logits (one row takes the screened head where the backend has one)."""
    if not ON_GPU:
        pytest.importorskip("triton")
    dev = "cuda" if ON_GPU else "cpu"
    llm = LLM(path, device=dev, dtype="float16" if ON_GPU else "float32", cuda_graphs=False)
    engine, model = llm.engine, llm.engine.model
    prompts = _prompts(n, SIZE["vocab_size"], seed=7)
    logits, _ = engine.prefill(prompts, engine.cache_for(n))
    keys, _ = engine.prefill(prompts, engine.cache_for(n), keyed=True)
    assert argmax_index(keys).tolist() == logits.argmax(dim=-1).tolist()
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    assert [r.token_ids[0] for r in llm.generate(prompts, params)] == logits.argmax(dim=-1).tolist()
    ids = torch.tensor(prompts[:1], device=dev)
    with pytest.raises(ValueError, match="argmax_keys: expected None with all_logits"):
        model.prefill(ids, torch.tensor([ids.shape[1]], dtype=torch.int32, device=dev), engine.cache_for(1),
                      all_logits=True, argmax_keys=keys[:1])


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_graphed_prefill_keys_start_empty_every_replay(path):
    """The greedy prefill graph max-es its keys into its own buffer, which append_tokens leaves
    EMPTY: prompts of one bucket, one after another and between sampled calls of the same shape,
    give the first tokens of an engine without graphs."""
    prompts = [p[:5] for p in _prompts(12, SIZE["vocab_size"], seed=8) if len(p) >= 5][:4]
    greedy = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=2, temperature=0.9, seed=1, ignore_eos=True)
    on, off = LLM(path, dtype="float16"), LLM(path, dtype="float16", cuda_graphs=False)
    for p in prompts + prompts[::-1]:
        on.generate([p], sampled)
        assert on.generate([p], greedy)[0].token_ids == off.generate([p], greedy)[0].token_ids


@pytest.mark.parametrize("n,params", [
    (1, SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)),
    (3, SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)),
    (2, SamplingParams(max_new_tokens=3, temperature=0.8, seed=1, ignore_eos=True)),
    (2, SamplingParams(max_new_tokens=3, temperature=0.8, seed=1, repetition_penalty=1.3, ignore_eos=True)),
    (1, SamplingParams(max_new_tokens=3, temperature=0, repetition_penalty=1.3, ignore_eos=True)),
])
def test_nan_logits_end_with_a_clear_error(path, n, params):
    """NaN logits name no token in every argmax (the lm_head's fused one, the first token's too
    where greedy; torch's with a repetition penalty and for draws): generation ends with
    NonFiniteLogitsError instead of ids picked from NaN."""
    if not ON_GPU:
        pytest.importorskip("triton")
    llm = LLM(path, device="cuda" if ON_GPU else "cpu", dtype="float32")
    llm.model.lm_head[1].fill_(float("nan"))  # the lm_head's fp32 bias: every logit NaN
    with pytest.raises(NonFiniteLogitsError, match=r"sequence 0, new token 0: id \d+ is outside the vocabulary"):
        llm.generate(_prompts(n, SIZE["vocab_size"]), params)
    bias = llm.model.lm_head[1]
    bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(0)))
    bias[7] = float("nan")  # one NaN column beside finite logits: still no token
    with pytest.raises(NonFiniteLogitsError):
        llm.generate(_prompts(n, SIZE["vocab_size"]), params)
    with pytest.raises(NonFiniteLogitsError, match="sequence 0, new token 0"):  # streamed: before the id shows
        next(llm.engine.steps(_prompts(n, SIZE["vocab_size"]), params, stream=True))

    def stop_check(b, ids):  # stop strings decode the ids: none may be past the vocabulary
        assert max(ids) < SIZE["vocab_size"], "an id past the vocabulary reached stop_check"
        return False

    with pytest.raises(NonFiniteLogitsError):
        llm.engine.generate(_prompts(n, SIZE["vocab_size"]), params, stop_check=stop_check)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("settings", [dict(temperature=1e-40), dict(temperature=1e-40, top_k=0),
                                      dict(temperature=0.9, repetition_penalty=1e-40)])
def test_sampling_scores_past_fp32_end_with_a_clear_error(path, backend, settings):
    """A temperature (or penalty) so small that the scores overflow to +inf leaves softmax no
    probabilities: transformers' draw raises, and so does this engine, where it had drawn id 0
    step after step (fused sampler and plain torch alike)."""
    if backend == "triton" and not ON_GPU:
        pytest.importorskip("triton")
    llm = LLM(path, device="cuda" if ON_GPU else "cpu", dtype="float32", backend=backend)
    params = SamplingParams(max_new_tokens=3, seed=0, ignore_eos=True, **settings)
    with pytest.raises(NonFiniteLogitsError, match="infinite after a temperature or repetition penalty too small"):
        llm.generate(_prompts(2, SIZE["vocab_size"]), params)


def test_ids_outside_the_vocabulary_end_with_a_clear_error():
    """check_vocab: every id in [0, V), else one clear error naming the sequence and token."""
    check_vocab([[1, 2], [255, 0]], 256)
    with pytest.raises(NonFiniteLogitsError, match="sequence 1, new token 1: id 256 is outside the vocabulary of 256"):
        check_vocab([[1, 2], [3, 256]], 256)
    with pytest.raises(NonFiniteLogitsError, match="sequence 0, new token 5: id -1"):
        check_vocab([[-1]], 256, first=5)


def test_context_check_says_how_much_fits():
    """check_context: the last new token is never fed back, so a full context still gives one;
    a prompt longer than the context is told how long it may be (not a negative count of tokens)."""
    check_context(60, 5, 64)
    check_context(64, 1, 64)
    with pytest.raises(ContextLengthError, match=r"prompt of 60 tokens \+ max_new_tokens 6 exceeds the model's "
                       r"context of 64 positions \(at most 5 new tokens for this prompt\)"):
        check_context(60, 6, 64)
    with pytest.raises(ContextLengthError, match=r"\(at most 1 new token for this prompt\)"):
        check_context(64, 2, 64)
    with pytest.raises(ContextLengthError, match=r"prompt of 101 tokens is longer than the model's context of 64 "
                       r"positions \(with max_new_tokens 10, at most 55 tokens\)"):
        check_context(101, 10, 64)
    with pytest.raises(ContextLengthError,
                       match=r"prompt of 65 tokens is longer .* \(with max_new_tokens 1, at most 64 tokens\)"):
        check_context(65, 1, 64)


def test_mlp_out_asks_l2_for_the_next_weights(path, monkeypatch):
    """At one row of gpt2's size layer i's mlp-out asks L2 for the next layer's qkv weights, and
    the last layer's for the lm_head's first columns: their first bytes, as many as
    L2_LM_HEAD_BYTES allows, dense (l2_ahead's requirement); of the int8 copy where the screened
    head runs (kernels.vocab_screen), as many as L2_SCREEN_BYTES allows (nothing for 0)."""
    model = LLM(path, dtype="float32", cuda_graphs=False).engine.model
    n = len(model.blocks)
    for i in range(n - 1):
        assert model._next_weight(i, False) == (model.blocks[i + 1].attn[0],)
        assert model._next_weight(i, True) == (model.blocks[i + 1].attn[0],)
    C, V = model.lm_head[0].shape
    q = torch.zeros(V, C // 4, dtype=torch.int32, device=model.device)  # the screen's words, (V, C / 4)
    model.lm_screen = kernels._screen_head.ScreenedHead(q, None)
    (screened,) = model._next_weight(n - 1, True)
    rows = min(V, minillm.decode_plan.L2_SCREEN_BYTES // C)  # a column's C int8 weights: C bytes
    assert screened.shape == (rows, C // 4) and screened.data_ptr() == q.data_ptr() and screened.is_contiguous()
    monkeypatch.setattr(minillm.decode_plan, "L2_SCREEN_BYTES", 3 * C)
    assert model._next_weight(n - 1, True)[0].shape == (3, C // 4)
    monkeypatch.setattr(minillm.decode_plan, "L2_SCREEN_BYTES", 0)
    assert model._next_weight(n - 1, True) == ()
    (head,) = model._next_weight(n - 1, False)
    w = model.lm_head[0]  # (C, V), out-major
    cols = min(w.shape[1], minillm.decode_plan.L2_LM_HEAD_BYTES // (w.shape[0] * w.element_size()))
    assert head.shape == (w.shape[0], cols) and head.data_ptr() == w.data_ptr() and head.stride() == w.stride()
    assert head.t().is_contiguous()
