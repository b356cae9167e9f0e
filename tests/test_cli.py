"""The `minillm` command as a user runs it: subprocesses on a tiny local checkpoint on the CPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ON_GPU
from tests.models import add_generation_settings, build_checkpoint, real_tokenizer_dir

ROOT = Path(__file__).resolve().parents[1]
needs_tokenizer = pytest.mark.skipif(real_tokenizer_dir() is None,
                                     reason="the GPT-2 tokenizer is not at ../shared/assets/gpt2-tokenizer")


def run(*args, stdin=None):
    """The command's exit status and text output; stdin as text, or bytes to pass as they are."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    text = not isinstance(stdin, bytes)
    p = subprocess.run([sys.executable, "-m", "minillm", *args], input=stdin, capture_output=True, text=text,
                       env=env, cwd=ROOT, timeout=300)
    if not text:
        p.stdout, p.stderr = p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")
    return p


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    if real_tokenizer_dir() is None:
        pytest.skip("the GPT-2 tokenizer is not at ../shared/assets/gpt2-tokenizer")
    path = tmp_path_factory.mktemp("cli-gpt2")
    build_checkpoint(path, n_layer=2, n_head=2, n_embd=32, vocab_size=50257, n_positions=64, seed=5,
                     with_tokenizer=True)
    return str(path)


def assert_no_traceback(p):
    assert "Traceback" not in p.stderr, p.stderr


@needs_tokenizer
def test_generate_streams_and_summarizes(model):
    p = run("generate", "--model", model, "--device", "cpu", "--greedy", "--max-new-tokens", "12", "Hello world")
    assert p.returncode == 0, p.stderr
    assert len(p.stdout.strip()) > 0
    summary = p.stderr.strip().splitlines()[-1]
    for part in ("2 prompt tokens", "12 new tokens", "time to first token", "tokens/s"):
        assert part in summary, summary
    one = run("generate", "--model", model, "--device", "cpu", "--greedy", "--max-new-tokens", "1", "Hi")
    assert one.returncode == 0, one.stderr
    assert "1 prompt token, 1 new token," in one.stderr and "no decode step" in one.stderr, one.stderr


@needs_tokenizer
def test_stdin_prompt_and_batch(model):
    p = run("generate", "--model", model, "--device", "cpu", "--greedy", "--max-new-tokens", "5", "-", stdin="Hi\n")
    assert p.returncode == 0, p.stderr
    q = run("generate", "--model", model, "--device", "cpu", "--seed", "1", "-n", "2", "--max-new-tokens", "5",
            "--temperature", "0.8", "--top-k", "10", "--top-p", "0.9", "--repetition-penalty", "1.1", "--stop", "zzz",
            "Hi", "Bye")
    assert q.returncode == 0, q.stderr
    assert q.stdout.count("--- prompt") == 4 and "sample 2" in q.stdout


@needs_tokenizer
def test_settings_not_given_are_the_models(model, tmp_path):
    """Flags left out take the model's generation_config.json settings, and stderr names them, and
    the file's settings that minillm does not apply."""
    add_generation_settings(tmp_path, {"do_sample": False, "max_new_tokens": 6, "top_k": 9, "num_beams": 4,
                                       "no_repeat_ngram_size": 2}, copy_from=model)
    p = run("generate", "--model", str(tmp_path), "--device", "cpu", "Hello world")
    assert p.returncode == 0, p.stderr
    taken = next(line for line in p.stderr.splitlines() if "generation_config.json" in line)
    assert taken.startswith("[minillm] from the model's generation_config.json: ")
    assert {"max-new-tokens 6", "top-k 9", "temperature 0 (greedy)"} == set(taken.split(": ", 1)[1].split(", "))
    assert "6 new tokens" in p.stderr.splitlines()[-1]
    same = run("generate", "--model", model, "--device", "cpu", "--greedy", "--max-new-tokens", "6", "Hello world")
    assert same.returncode == 0 and same.stdout == p.stdout, same.stderr
    unapplied = ("[minillm] not applied from the model's generation_config.json (transformers' generate would): "
                 "num_beams 4, no_repeat_ngram_size 2\n")
    assert unapplied in p.stderr and "not applied" not in same.stderr
    verbose = run("generate", "--model", str(tmp_path), "--device", "cpu", "--verbose", "Hello world")
    assert verbose.returncode == 0, verbose.stderr
    assert verbose.stderr.count("num_beams 4") == 1, verbose.stderr  # said once, not also as a warning
    flags = run("generate", "--model", str(tmp_path), "--device", "cpu", "--max-new-tokens", "3", "--temperature",
                "0.5", "--seed", "1", "Hello world")
    assert flags.returncode == 0, flags.stderr
    assert "[minillm] from the model's generation_config.json: top-k 9\n" in flags.stderr
    assert "3 new tokens" in flags.stderr.splitlines()[-1]


def test_taken_settings_print_as_written():
    from minillm.cli import _taken_text
    taken = {"max_new_tokens": 1000000, "temperature": 0.123456789, "top_p": 0.95, "repetition_penalty": 1.0}
    assert _taken_text(taken) == ("max-new-tokens 1000000, temperature 0.123456789, top-p 0.95, "
                                  "repetition-penalty 1")
    assert _taken_text({"temperature": 0.0}) == "temperature 0 (greedy)"


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "--temperature: expected a number >= 0"),
    (["--top-p", "0"], "--top-p: expected a number in (0, 1]"),
    (["--top-p", "1.5"], "--top-p: expected a number in (0, 1]"),
    (["--top-k", "-1"], "--top-k: expected an integer >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens: expected an integer >= 1"),
    (["--temperature", "inf"], "--temperature: expected a number >= 0, got inf"),
    (["--temperature", "warm"], "--temperature: expected a number, got 'warm'"),
    (["--stop", ""], "argument --stop: expected non-empty text"),
    (["--seed", str(2 ** 64)], "--seed: expected an integer in [-2**63, 2**64), got 18446744073709551616"),
    (["--seed", "1.5"], "--seed: expected an integer, got '1.5'"),
    (["--dtype", "int8"], "invalid choice"),
    (["-", "-"], "PROMPT: '-' (read from stdin) may appear once"),
    (["  "], "PROMPT: expected non-empty text; prompt 1 is empty"),
])
def test_bad_usage_exits_2(args, message):
    p = run("generate", "--model", "unused", *args, "x")
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert_no_traceback(p)


@needs_tokenizer
@pytest.mark.parametrize("batch", [[], ["-n", "2"]], ids=["streamed", "batch"])
def test_reader_gone_exits_quietly(model, batch):
    """`minillm generate ... | head`: the reader closes the pipe before any text arrives (here
    at once, so the first write fails whatever the timing). The command stops with 141 (128 +
    SIGPIPE, as a shell reports a tool the signal ended) and no error line or traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.Popen([sys.executable, "-m", "minillm", "generate", "--model", model, "--device", "cpu",
                          "--max-new-tokens", "8", *batch, "Hi"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=300) == 141, err
    assert "error" not in err and "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.parametrize("args,message", [
    (["--top-p", "0.9"], "--top-k/--top-p: expected --temperature > 0 with them"),
    (["--temperature", "-1"], "--temperature: expected a number >= 0"),
    (["--temperature", "1", "--top-k", "-2"], "--top-k: expected an integer >= 0"),
])
def test_bench_bad_sampling_exits_2(args, message):
    p = run("bench", *args)
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert_no_traceback(p)


def test_bench_checks_every_model_before_any_gpu_work(tmp_path):
    """A prompt and new tokens past a model's context (exit 2), or a model that is not there
    (exit 1), fail before the GPU is asked for; they had failed after the models before them
    had run (minutes), or after the copy-bandwidth test."""
    p = run("bench", "--model", "gpt2", "distilgpt2", "--prompt-len", "1000", "--new-tokens", "26")
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == ("minillm: error: --prompt-len 1000 + --new-tokens 26: expected at most 1025 for "
                                "gpt2's context of 1024 positions")
    p = run("bench", "--model", "gpt2", str(tmp_path / "missing"))
    assert p.returncode == 1 and p.stderr.strip() == f"minillm: error: {tmp_path / 'missing'}: no such folder"


def test_empty_stdin_exits_2():
    p = run("generate", "--model", "unused", "-", stdin="\n")
    assert p.returncode == 2 and "stdin ('-') is empty" in p.stderr, p.stderr
    assert_no_traceback(p)


def test_text_that_is_not_utf8_exits_2():
    """Bytes that are not UTF-8, on stdin or in an argument, whatever the locale: one line that
    says where (they had reached the tokenizer: "TextInputSequence must be str")."""
    p = run("generate", "--model", "unused", "-", stdin=b"ok \xff\xfe then")
    assert p.returncode == 2 and "PROMPT: expected UTF-8 text; stdin ('-') is not (byte 3)" in p.stderr, p.stderr
    assert_no_traceback(p)
    if sys.platform != "win32":  # POSIX argv is bytes; Python hands undecodable ones over as surrogates
        q = run("generate", "--model", "unused", "fine", b"ab\xff")
        assert q.returncode == 2 and "PROMPT: expected UTF-8 text; prompt 2 is not (character 2)" in q.stderr, q.stderr
        assert_no_traceback(q)


@needs_tokenizer
def test_stdin_reads_utf8_with_any_line_ends(model):
    """stdin is read as bytes and decoded as UTF-8, with \\r\\n and \\r read as \\n as text mode does."""
    counts = []
    for data in ("caf\u00e9\n".encode(), b"caf\xc3\xa9\r\n", b"caf\xc3\xa9\r"):
        p = run("generate", "--model", model, "--device", "cpu", "--greedy", "--max-new-tokens", "1", "-", stdin=data)
        assert p.returncode == 0, p.stderr
        counts.append(p.stderr.strip().splitlines()[-1].split(" prompt token")[0])
    assert counts == [counts[0]] * 3, counts  # "\r\n" unread as "\n" would be one token more


def test_runtime_errors_exit_1(tmp_path):
    p = run("generate", "--model", "no-such-org/no-such-model-xyz", "--device", "cpu", "x")
    assert p.returncode == 1 and "HF_HUB_OFFLINE" in p.stderr
    assert_no_traceback(p)
    q = run("generate", "--model", str(tmp_path), "--device", "cpu", "x")
    assert q.returncode == 1 and "no config.json" in q.stderr
    assert_no_traceback(q)
    assert len(q.stderr.strip().splitlines()) == 1
    build_checkpoint(tmp_path / "no-tok", n_layer=1, n_head=2, n_embd=32, vocab_size=128, n_positions=32)
    t = run("generate", "--model", str(tmp_path / "no-tok"), "--device", "cpu", "x")
    assert t.returncode == 1 and t.stderr == (f"minillm: error: {tmp_path / 'no-tok'}: no tokenizer files "
                                              "(tokenizer.json, or vocab.json and merges.txt), so text prompts "
                                              "cannot be encoded\n")
    d = run("download", "gpt2", "--dir", str(tmp_path / "dl"))  # HF_HUB_OFFLINE=1 (run's environment)
    assert d.returncode == 1 and d.stderr == (f"minillm: error: gpt2: cannot download into {tmp_path / 'dl'}: "
                                              "HF_HUB_OFFLINE is set\n")
    assert_no_traceback(d)
    assert not (tmp_path / "dl").exists()


@pytest.mark.skipif(ON_GPU, reason="checks the message on a machine without CUDA")
def test_cuda_absent_exits_1(model):
    p = run("generate", "--model", model, "--device", "cuda", "x")
    assert p.returncode == 1 and "CUDA is not available" in p.stderr
    assert_no_traceback(p)
    for engines in (["minillm"], ["minillm-stream"]):  # (an engine the default run leaves out is accepted)
        b = run("bench", "--model", "gpt2", "--engines", *engines)
        assert b.returncode == 1 and "bench: needs a CUDA GPU" in b.stderr
        assert_no_traceback(b)


@needs_tokenizer
def test_prompt_longer_than_context_exits_1(model):
    p = run("generate", "--model", model, "--device", "cpu", "--max-new-tokens", "10", "word " * 80)
    assert p.returncode == 1 and "is longer than the model's context of 64 positions" in p.stderr
    assert_no_traceback(p)
    v = run("generate", "--model", model, "--device", "cpu", "--verbose", "--max-new-tokens", "10", "word " * 80)
    assert v.returncode == 1 and "Traceback" in v.stderr  # --verbose shows it


def test_help_has_examples():
    for sub in ([], ["generate"], ["download"], ["bench"]):
        p = run(*sub, "--help")
        assert p.returncode == 0 and "example" in p.stdout, sub
    assert run().returncode == 2
