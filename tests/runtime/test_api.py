"""The Python API: batches, stream(), finish reasons, stop strings (with the real GPT-2 tokenizer,
skipped without it), and prompts as token ids and argument checks (without a tokenizer)."""
import dataclasses
import random
import threading

import numpy as np
import pytest
import torch

import minillm.decode_plan
from minillm import LLM, ContextLengthError, MiniLLMError, SamplingParams
from minillm.api import _find_stop, _stop_end, stop_checker
from tests.models import build_checkpoint, hf_generate, real_tokenizer_dir


@pytest.fixture(scope="module")
def llm_hf(tmp_path_factory):
    if real_tokenizer_dir() is None:
        pytest.skip("the GPT-2 tokenizer is not at ../shared/assets/gpt2-tokenizer")
    path = tmp_path_factory.mktemp("gpt2-tok")
    hf = build_checkpoint(path, n_layer=2, n_head=2, n_embd=32, vocab_size=50257, n_positions=64, seed=3,
                          with_tokenizer=True)
    return LLM(str(path), device="cpu"), hf


@pytest.fixture(scope="module")
def llm_ids(tmp_path_factory):
    """No tokenizer files: prompts are token ids (LLM warns that it loads without a tokenizer)."""
    path = tmp_path_factory.mktemp("gpt2-ids")
    hf = build_checkpoint(path, n_layer=2, n_head=2, n_embd=32, vocab_size=512, n_positions=64, seed=4)
    with pytest.warns(UserWarning, match="tokenizer"):
        llm = LLM(str(path), device="cpu")
    return llm, hf


def test_text_prompts_batched_ragged(llm_hf):
    llm, hf = llm_hf
    prompts = ["Hello", "The quick brown fox jumps over", "A"]
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    batch = llm.generate(prompts, params)
    assert len(batch) == 3
    for p, r in zip(prompts, batch):
        ids = llm.tokenizer.encode(p)
        assert r.prompt_token_ids == ids
        assert r.token_ids == hf_generate(hf, ids, max_new_tokens=12, do_sample=False)
        assert r.text == llm.tokenizer.decode(r.token_ids)
        assert r.finish_reason == "length"
        m = r.metrics
        assert m["prompt_tokens"] == len(ids) and m["new_tokens"] == 12 and m["ttft_s"] > 0 and m["decode_tok_s"] > 0


def test_tokenizer_of_another_vocabulary(llm_hf, monkeypatch):
    """Text whose ids lie past the model's vocabulary: the tokenizer files are another model's,
    said as such (not as a bad token id the caller never gave)."""
    llm, _ = llm_hf
    monkeypatch.setattr(llm, "config", type(llm.config)(**{**llm.config.to_dict(), "vocab_size": 1000}))
    with pytest.raises(MiniLLMError, match=r"^prompts\[0\]: the tokenizer gives id 15496, outside the model's "
                       r"vocabulary of 1000: the tokenizer files do not belong to this checkpoint$"):
        llm.generate("Hello world", SamplingParams(max_new_tokens=2))


def test_single_string_and_token_ids(llm_hf):
    llm, _ = llm_hf
    params = SamplingParams(max_new_tokens=4, temperature=0)
    a = llm.generate("Hello there", params)
    b = llm.generate([llm.tokenizer.encode("Hello there")], params)
    assert len(a) == 1 and a[0].token_ids == b[0].token_ids


def test_text_that_is_no_utf8(llm_hf):
    """A str holding a lone surrogate (as surrogateescape decoding leaves bytes that are not UTF-8)
    is refused naming the prompt; the tokenizer had raised a bare TypeError."""
    llm, _ = llm_hf
    for call in (llm.generate, lambda p: next(llm.stream(p[0]))):
        with pytest.raises(ValueError, match=r"^prompts\[0\]: expected text that UTF-8 encodes, got a lone surrogate "
                                             r"at character 2$"):
            call(["ab\udcff"])


def test_stream_pieces_join_to_the_text(llm_hf):
    llm, _ = llm_hf
    params = SamplingParams(max_new_tokens=15, temperature=0, ignore_eos=True)
    pieces = list(llm.stream("Once upon a time", params))
    assert len(pieces) > 1
    assert "".join(pieces) == llm.last_result.text == llm.generate("Once upon a time", params)[0].text
    assert "".join(llm.stream(llm.tokenizer.encode("Once upon a time"), params)) == llm.last_result.text
    # a stop string that never comes: its length less one is held back each step, then flushed
    held = SamplingParams(max_new_tokens=15, temperature=0, ignore_eos=True, stop=["\x00never in this text"])
    joined = "".join(llm.stream("Once upon a time", held))
    assert joined == llm.last_result.text == llm.generate("Once upon a time", params)[0].text
    with pytest.raises(ValueError, match=r"prompt: stream\(\) takes one prompt .*, got 2; use generate\(\)"):
        next(llm.stream(["Once", "upon"], params))
    stopped = llm.stream("Once upon a time", params)  # left after one piece: no result, not the last one's
    next(stopped)
    stopped.close()
    assert llm.last_result is None


def test_stream_and_generate_without_params_take_the_models_settings(llm_hf, monkeypatch):
    """stream() and generate() given no params run as default_params() (the model's
    generation_config.json settings: loader tests), not as SamplingParams()."""
    llm, _ = llm_hf
    monkeypatch.setattr(llm, "sampling_defaults", {"max_new_tokens": 5, "temperature": 0.0})
    greedy = llm.generate("Once upon a time", SamplingParams(max_new_tokens=5, temperature=0))[0]
    assert "".join(llm.stream("Once upon a time")) == llm.last_result.text == greedy.text
    assert llm.last_result.token_ids == greedy.token_ids == llm.generate("Once upon a time")[0].token_ids
    assert len(greedy.token_ids) == 5 or greedy.finish_reason == "stop"


def test_stop_string(llm_hf):
    llm, _ = llm_hf
    full = llm.generate("Hello", SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2:][:3]
    assert stop.strip(), "need a visible stop string"
    r = llm.generate("Hello", SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert r.finish_reason == "stop"
    assert r.text == full.text[:full.text.find(stop)]
    assert stop in llm.tokenizer.decode(r.token_ids) and len(r.token_ids) < len(full.token_ids)
    streamed = "".join(llm.stream("Hello", SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True,
                                                          stop=[stop])))
    assert streamed == r.text


def test_stop_strings_in_a_batch(llm_hf):
    """Each row stops at its own first stop string; a row without one runs to the end. The host
    reads back only the steps since its last check."""
    llm, _ = llm_hf
    prompts = ["Hello", "Once upon a time", "The"]
    full = llm.generate(prompts, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True))
    stops = [full[0].text[5:8], full[1].text[30:33]]  # early in row 0, late in row 1 (past a check)
    assert all(s.strip() for s in stops), "need visible stop strings"
    got = llm.generate(prompts, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, stop=stops))
    for f, r in zip(full, got):
        cut = min((i for i in (f.text.find(s) for s in stops) if i >= 0), default=-1)
        assert (r.text, r.finish_reason) == ((f.text[:cut], "stop") if cut >= 0 else (f.text, "length"))
        assert f.token_ids[:len(r.token_ids)] == r.token_ids


def test_stop_checks_decode_only_new_ids(llm_hf, monkeypatch):
    """stream() and the stop-string checks decode a few ids per new piece, not the whole
    continuation each time: that is quadratic (1,024 streamed GPT-2 tokens had spent 0.18 s
    decoding in each of the two)."""
    llm, _ = llm_hf
    decoded, plain = [], llm.decode
    monkeypatch.setattr(llm, "decode", lambda ids: decoded.append(len(ids)) or plain(ids))
    n = 56  # (the fixture's context is 64)
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, stop=["\x00never in this text"])
    text = "".join(llm.stream("Hello", params))
    assert text == llm.last_result.text and len(llm.last_result.token_ids) == n
    assert sum(decoded) < 12 * n  # whole decodes at each step: about n * n in all
    decoded.clear()
    stop_check, ids = stop_checker(llm.decode, params.stop), random.Random(0).choices(range(50257), k=1024)
    assert not any(stop_check(0, ids[:k]) for k in range(1, 1025))  # the engine asks at each step
    assert sum(decoded) < 6 * len(ids)


def test_a_stopped_row_is_cut_by_bisection(llm_hf, monkeypatch):
    """_finish cuts a row at the shortest prefix whose text holds a stop string, the one an id at a
    time from the end finds, in a few decodes of the row (bisection), not one per id past the
    stop: a row that stopped long before its batch ended had cost a whole decode per id after it.
    Random GPT-2 ids (multi-byte characters split across tokens among them) and stop strings cut
    from their text, at its start, middle and end."""
    llm, _ = llm_hf
    rng = random.Random(7)
    for trial in range(40):
        ids = rng.choices(range(50257), k=rng.randrange(1, 300))
        text = llm.decode(ids)
        at = rng.choice([0, len(text) // 2, max(0, len(text) - 3)])
        stops = [text[at:at + rng.randrange(1, 4)]] + (["\x00never"] if trial % 2 else [])
        if not stops[0]:
            continue
        by_one = list(ids)  # the cut an id at a time (what _finish did)
        while len(by_one) > 1 and _find_stop(llm.decode(by_one[:-1]), stops) >= 0:
            by_one = by_one[:-1]
        decodes = []
        n = _stop_end(ids, lambda part: decodes.append(len(part)) or llm.decode(part), stops)
        assert ids[:n] == by_one, (trial, stops)
        assert len(decodes) <= len(ids).bit_length()
    # through the API: a batch of two where row 0 stops early and row 1 runs on to the end
    full = llm.generate(["Hello", "The"], SamplingParams(max_new_tokens=56, temperature=0, ignore_eos=True))
    stop = full[0].text[4:7]
    assert stop.strip() and stop not in full[1].text, "need a visible stop string only row 0 holds"
    decoded, plain = [], llm.decode
    monkeypatch.setattr(llm, "decode", lambda ids: decoded.append(len(ids)) or plain(ids))
    got = llm.generate(["Hello", "The"], SamplingParams(max_new_tokens=56, temperature=0, ignore_eos=True,
                                                        stop=[stop]))
    assert got[0].text == full[0].text[:full[0].text.find(stop)] and got[0].finish_reason == "stop"
    assert got[1].token_ids == full[1].token_ids and got[1].finish_reason == "length"
    assert sum(decoded) < 14 * 56  # 339 ids; cut an id at a time from the end: 1,824


@pytest.mark.parametrize("second", [False, True])
def test_eos_finish_reason(llm_hf, second):
    """generate and stream stop at the end-of-sequence id, and where there are several, at the
    second as well (the host sees each in the ids it reads back)."""
    llm, hf = llm_hf
    ids = llm.tokenizer.encode("Hi")
    expect = hf_generate(hf, ids, max_new_tokens=6, do_sample=False)
    unseen = next(t for t in range(llm.config.vocab_size) if t not in expect)
    old = llm.config
    llm.model.config = llm.config = dataclasses.replace(old, eos_token_ids=(unseen, expect[2]) if second
                                                        else (expect[2],))
    try:
        r = llm.generate([ids], SamplingParams(max_new_tokens=6, temperature=0))[0]
        streamed = "".join(llm.stream(ids, SamplingParams(max_new_tokens=6, temperature=0)))
        assert llm.last_result.finish_reason == "stop" and llm.last_result.token_ids == r.token_ids
    finally:
        llm.model.config = llm.config = old
    assert r.finish_reason == "stop" and r.token_ids == expect[:expect.index(expect[2]) + 1]
    assert streamed == r.text == llm.tokenizer.decode(r.token_ids[:-1])  # the eos token is not text


def test_context_length_error_before_work(llm_ids):
    llm, _ = llm_ids
    with pytest.raises(ContextLengthError, match="exceeds the model's context of 64 positions"):
        llm.generate([[1] * 60], SamplingParams(max_new_tokens=10))
    llm.generate([[1] * 60], SamplingParams(max_new_tokens=5, temperature=0))  # exactly fits


@pytest.mark.parametrize("pad,gib", [(0, "0.00"), (65472, "1.25")])
def test_out_of_memory_names_the_cache(llm_ids, monkeypatch, pad, gib):
    """A CUDA out-of-memory error becomes one MiniLLMError naming the batch's KV cache size, its
    padding (decode_plan.CACHE_PAD) included: 2 layers x 2 (k, v) x (64 + pad) positions x 32
    wide x 4 bytes a sequence, 40 sequences."""
    llm, _ = llm_ids

    def no_memory(*args, **kw):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(minillm.decode_plan, "CACHE_PAD", pad)
    monkeypatch.setattr(llm.engine, "steps", no_memory)
    with pytest.raises(MiniLLMError, match=rf"^out of memory: batch 40 needs a KV cache of {gib} GiB on top of "
                                           r"the weights; use a smaller batch$"):
        llm.generate([[1, 2]] * 40, SamplingParams(max_new_tokens=2))


def test_repr_says_what_was_loaded(llm_ids):
    """The parameter count in three figures (this model, 2 layers 32 wide with an untied head,
    had printed as "0M")."""
    llm, hf = llm_ids
    assert sum(p.numel() for p in hf.parameters()) == 60_288
    assert repr(llm) == (f"LLM({llm.model_dir.name}: 2 layers, 32 wide, 60.3K params; device=cpu, dtype=float32, "
                         "backend=torch, cuda_graphs=False)")


def test_one_new_token_has_no_decode_rate(llm_ids):
    llm, hf = llm_ids
    r = llm.generate([[5, 6]], SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True))[0]
    assert r.token_ids == hf_generate(hf, [5, 6], max_new_tokens=1, do_sample=False)
    m = r.metrics  # the one token comes from prefill: no decode step to rate
    assert m["new_tokens"] == 1 and m["ttft_s"] > 0 and m["decode_tok_s"] != m["decode_tok_s"]


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-1), "temperature: expected a number >= 0"),
    (dict(top_p=0), r"top_p: expected a number in \(0, 1\]"),
    (dict(top_k=-1), "top_k: expected an integer >= 0"),
    (dict(max_new_tokens=0), "max_new_tokens: expected an integer >= 1"),
    (dict(repetition_penalty=0), "repetition_penalty: expected a number > 0"),
    (dict(max_new_tokens=True), "max_new_tokens: expected an integer >= 1, got True"),  # bool is not a count
    (dict(top_k=2.5), "top_k: expected an integer >= 0, got 2.5"),
    (dict(seed=False), r"seed: expected an integer in \[-2\*\*63, 2\*\*64\) .* or None, got False"),
    (dict(seed=2 ** 64), r"seed: expected an integer in \[-2\*\*63, 2\*\*64\) .* got 18446744073709551616"),
    (dict(seed=-2 ** 63 - 1), r"seed: expected .* got -9223372036854775809"),
    (dict(stop=[""]), r"stop: expected a non-empty string, a list of them, or None, got \[''\]"),
    (dict(stop=["ok", 3]), r"stop: expected a non-empty string, .* got \['ok', 3\]"),
    (dict(stop=5), r"stop: expected a non-empty string, .* got 5"),  # had been a TypeError
    (dict(ignore_eos="no"), "ignore_eos: expected True or False, got 'no'"),  # had been read as True
    (dict(temperature=10 ** 400), "temperature: expected a number >= 0, got 1000"),  # had been an OverflowError
    (dict(top_k=np.bool_(True)), "top_k: expected an integer >= 0, got np.True_"),
])
def test_sampling_params_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_numpy_scalars_are_numbers():
    """numpy's ints and floats read as the Python numbers they hold (they had been refused as
    "expected an integer >= 1, got np.int64(5)")."""
    p = SamplingParams(max_new_tokens=np.int64(5), temperature=np.float32(0.5), top_k=np.int32(3),
                       top_p=np.float16(0.5), repetition_penalty=np.float64(1.5), seed=np.uint64(2 ** 63 + 5))
    assert p == SamplingParams(max_new_tokens=5, temperature=0.5, top_k=3, top_p=0.5, repetition_penalty=1.5,
                               seed=2 ** 63 + 5)
    types = [type(v) for v in (p.max_new_tokens, p.temperature, p.top_k, p.top_p, p.seed)]
    assert types == [int, float, int, float, int]


def test_numpy_token_ids_are_a_prompt(llm_ids):
    """A list of numpy ints is one prompt, as a list of ints is (it had been taken for a batch of
    one-token prompts, each refused); the ids come back as Python ints."""
    llm, _ = llm_ids
    params = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    expect = llm.generate([5, 7, 11], params)[0]
    for ids in (list(np.array([5, 7, 11])), [list(np.array([5, 7, 11], dtype=np.int32))]):
        got = llm.generate(ids, params)[0]
        assert got.token_ids == expect.token_ids and got.prompt_token_ids == [5, 7, 11]
        assert all(type(t) is int for t in got.prompt_token_ids)


def test_one_call_at_a_time(llm_ids):
    """Every call writes the same caches: a second call in the thread of an unfinished stream is
    refused (it had silently mixed the two streams' tokens), and another thread's call waits for
    the first to end (concurrent calls had returned corrupt ids or failed)."""
    llm, _ = llm_ids
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 7, 11], [300, 2]]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    first = llm.engine.steps(prompts[:1], params, stream=True)
    assert next(first)[1] == alone[0][:1]
    with pytest.raises(MiniLLMError, match="still running an unfinished stream"):
        llm.generate([prompts[1]], params)
    other = {}
    waiting = threading.Thread(target=lambda: other.setdefault("ids", llm.generate([prompts[1]], params)[0].token_ids))
    waiting.start()
    waiting.join(timeout=1.0)
    assert waiting.is_alive() and "ids" not in other  # waits while the stream is open
    assert [e[1][0] for e in first if e[0] == "step"] == alone[0][1:]
    waiting.join(timeout=60)
    assert other["ids"] == alone[1]
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.setdefault(i, [
        llm.generate([prompts[i % 2]], params)[0].token_ids for _ in range(3)])) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(results[i] == [alone[i % 2]] * 3 for i in range(4))


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -1.0, "temperature: expected a number >= 0"), ("max_new_tokens", 0, "max_new_tokens: expected"),
    ("top_p", 0.0, "top_p: expected"), ("top_k", "5", "top_k: expected"), ("seed", 1.5, "seed: expected")])
def test_settings_changed_after_construction_are_checked(llm_ids, field, value, message):
    """SamplingParams is a plain dataclass: a field set later is checked when a call takes it (a
    negative temperature had run, max_new_tokens 0 had given a token)."""
    llm, _ = llm_ids
    params = SamplingParams(max_new_tokens=3, temperature=0.7)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=f"^{message}"):
        llm.generate([[1, 2]], params)


def test_stop_strings_as_given():
    """One string, a tuple, or None (no stop strings; had been a TypeError) read as a list."""
    assert [SamplingParams(stop=s).stop for s in ("END", ("a", "b"), None)] == [["END"], ["a", "b"], []]


def test_bad_prompts(llm_ids):
    llm, _ = llm_ids
    with pytest.raises(ValueError, match=r"prompts\[0\]\[1\]: expected a token id, an integer in \[0, 512\), got 512$"):
        llm.generate([[1, 512]])
    with pytest.raises(ValueError, match=r"prompts\[1\]\[2\]: expected a token id, .*, got 1\.0$"):
        llm.generate([[1], [2, 3, 1.0]])
    with pytest.raises(ValueError, match=r"prompts\[0\]\[0\]: expected a token id, .*, got True$"):
        llm.generate([[True]])
    with pytest.raises(ValueError, match="prompts: expected .*, got an empty list$"):
        llm.generate([])
    with pytest.raises(ValueError, match="prompts: expected .*, got NoneType$"):
        llm.generate(None)
    with pytest.raises(ValueError, match=r"prompts\[1\]: expected at least one token"):
        llm.generate([[1], []])
    with pytest.raises(ValueError, match=r"prompts\[1\]: expected a str or a list of token ids, got int"):
        llm.generate([[1], 3])
    with pytest.raises(MiniLLMError, match="no tokenizer, so prompts must be lists of token ids"):
        llm.generate("Hi")
    with pytest.raises(MiniLLMError, match="no tokenizer, so stop strings cannot be matched"):
        llm.generate([[1]], SamplingParams(max_new_tokens=2, stop=["x"]))  # had been ignored
    with pytest.raises(TypeError, match="^params: expected a SamplingParams or None, got dict$"):
        llm.generate([[1]], {"max_new_tokens": 2})
    with pytest.raises(TypeError, match="^params: expected a SamplingParams or None, got dict$"):
        next(llm.stream([1], {"max_new_tokens": 2}))
    with pytest.raises(MiniLLMError, match="stream\\(\\) needs a tokenizer to produce text$"):
        next(llm.stream([1]))


def test_setup_errors(llm_ids, monkeypatch):
    llm, _ = llm_ids
    with pytest.raises(ValueError, match="^dtype: expected float16, bfloat16 or float32, got torch.int8$"):
        LLM(str(llm.model_dir), device="cpu", dtype=torch.int8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # unset: compiled Triton kernels need a GPU
    with pytest.raises(MiniLLMError, match="^backend: triton on the CPU needs TRITON_INTERPRET=1 set before start"):
        LLM(str(llm.model_dir), device="cpu", backend="triton")


def test_tensor_prompts(llm_ids):
    llm, hf = llm_ids
    params = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    ids = [[464, 329], [40, 101, 257]]
    want = [hf_generate(hf, i, max_new_tokens=3, do_sample=False) for i in ids]
    assert [o.token_ids for o in llm.generate(ids, params)] == want
    assert [o.token_ids for o in llm.generate([torch.tensor(i) for i in ids], params)] == want
    assert llm.generate(torch.tensor(ids[0]), params)[0].token_ids == want[0]
    assert llm.generate(tuple(ids[0]), params)[0].token_ids == want[0]
    assert [o.token_ids for o in llm.generate(torch.tensor([ids[0], ids[0]]), params)] == [want[0]] * 2


def test_seeded_sampling_reproducible(llm_hf):
    llm, _ = llm_hf
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=0, seed=5, ignore_eos=True)
    assert llm.generate("Hi", params)[0].token_ids == llm.generate("Hi", params)[0].token_ids
    torch.manual_seed(0)
