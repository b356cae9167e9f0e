"""The tokenizer: the `tokenizers` fast path gives transformers' ids and text exactly, falls back
to AutoTokenizer wherever the folder asks for more, and loading a model does not import
transformers (7-9 s of a warm start on the GPU machine)."""
import json
import random
import re
import shutil
import subprocess
import sys

import pytest

from minillm.loader import ModelLoadError
from minillm.tokenizer import FALLBACK_KEYS, IncrementalText, Tokenizer, load_tokenizer
from tests.models import build_checkpoint, real_tokenizer_dir

TEXTS = [
    "Hello, my name is",
    "Hello , world . I'm here, aren't you? We'll see; they've said it's 3.14159!",
    "  leading and   inner   spaces\n\n\ttabs\r\nand CRLF  ",
    "<|endoftext|>between<|endoftext|> special text",
    "héllo wörld — naïve café, 日本語のテキスト, 🎉🚀 emoji, \u200b zero width",
    "def f(x):\n    return x ** 2  # code\n",
    "",
]


@pytest.fixture(scope="module")
def tok_dir():
    d = real_tokenizer_dir()
    if d is None:
        pytest.skip("the GPT-2 tokenizer is not at ../shared/assets/gpt2-tokenizer")
    return d


def _copy(src, dst, **config):
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, dst / f.name)
    cfg_file = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    cfg_file.write_text(json.dumps({**cfg, **config}))
    return dst


def test_fast_path_matches_transformers(tok_dir):
    from transformers import AutoTokenizer

    fast, hf = load_tokenizer(tok_dir), AutoTokenizer.from_pretrained(str(tok_dir))
    assert isinstance(fast, Tokenizer) and len(fast) == len(hf) == 50257
    rng = random.Random(0)
    noise = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(160, 0x3000)])) for _ in range(400))
    for text in TEXTS + [noise]:
        ids = fast.encode(text)
        assert ids == hf.encode(text), text
        assert fast.decode(ids) == hf.decode(ids) == text
    for _ in range(20):  # arbitrary ids, split UTF-8 sequences and the end-of-text token among them
        ids = [rng.randrange(50257) for _ in range(rng.randrange(1, 40))] + [50256, rng.randrange(50257)]
        for skip in (False, True):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def _check_incremental(decode, sequences, rng):
    """Fed in chunks of 1-3 ids, IncrementalText's text is decode(ids) wherever that ends on a
    whole character, and its pieces add up to it; returns how many points were compared."""
    compared = 0
    for ids in sequences:
        text, pieces, i = IncrementalText(decode), [], 0
        while i < len(ids):
            k = rng.randrange(1, 4)
            pieces.append(text.extend(ids[i:i + k]))
            i += k
            whole = decode(ids[:i])
            assert "".join(pieces) == text.text
            if not whole.endswith("\ufffd"):  # (a split character: its piece waits)
                assert text.text == whole, ids[:i]
                compared += 1
    return compared


def test_incremental_text_gpt2(tok_dir):
    """Byte-level BPE: multi-byte characters split over ids, arbitrary ids, the end-of-text token."""
    tok = load_tokenizer(tok_dir)
    rng = random.Random(1)
    emoji = tok.encode("héllo wörld 世界 🎉🎉 naïve ☃<|endoftext|> " * 3)
    sequences = [[rng.randrange(50257) for _ in range(rng.randrange(1, 50))] for _ in range(100)]
    sequences += [emoji[:rng.randrange(1, len(emoji) + 1)] for _ in range(100)]
    assert _check_incremental(tok.decode, sequences, rng) > 1000


def test_incremental_text_metaspace():
    """A sentencepiece-style decoder drops a sequence's leading space and decodes byte tokens in
    groups: token by token the spaces go, and a split character is U+FFFD."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    words = ["\u2581Hello", "\u2581world", "!", "\u2581", "\u2581the", "s"]
    vocab = {w: i for i, w in enumerate(words + [f"<0x{b:02X}>" for b in "世界🎉".encode()])}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=False)

    rng = random.Random(2)
    pieces = [[0], [1], [2], [3], [4], [5], [6, 7, 8], [9, 10, 11], [12, 13, 14, 15]]  # words; 世, 界, 🎉
    sequences = [sum((rng.choice(pieces) for _ in range(rng.randrange(1, 15))), []) for _ in range(200)]
    assert decode([0, 1]) == "Hello world" and decode([1]) + decode([0]) == "worldHello"  # (the dropped space)
    assert _check_incremental(decode, sequences, rng) > 500


@pytest.mark.parametrize("key", FALLBACK_KEYS)
def test_settings_beyond_tokenizer_json_fall_back(tok_dir, tmp_path, key):
    from transformers import AutoTokenizer

    d = _copy(tok_dir, tmp_path / "tok", **{key: True})
    tok = load_tokenizer(d)
    assert not isinstance(tok, Tokenizer)
    assert tok.encode("Hello world") == AutoTokenizer.from_pretrained(str(d)).encode("Hello world")
    if key == "add_prefix_space":  # one transformers honours today: the fast path alone would be wrong
        assert tok.encode("Hello")[0] != load_tokenizer(tok_dir).encode("Hello")[0]


def test_other_folders_fall_back(tok_dir, tmp_path):
    fast = load_tokenizer(tok_dir)
    no_json = _copy(tok_dir, tmp_path / "bpe_files")
    (no_json / "tokenizer.json").unlink()  # vocab.json + merges.txt only: transformers builds it
    other_class = _copy(tok_dir, tmp_path / "other", tokenizer_class="LlamaTokenizer")
    extra = _copy(tok_dir, tmp_path / "extra", added_tokens_decoder={"50257": {"content": "<|pad|>"}})
    same = _copy(tok_dir, tmp_path / "same", added_tokens_decoder={"50256": {"content": "<|endoftext|>"}})
    bad_config = _copy(tok_dir, tmp_path / "bad")
    (bad_config / "tokenizer_config.json").write_text("{not json")
    assert not isinstance(load_tokenizer(no_json), Tokenizer)
    assert load_tokenizer(no_json).encode(TEXTS[1]) == fast.encode(TEXTS[1])
    for d in (other_class, extra):
        assert not isinstance(load_tokenizer(d), Tokenizer)
    assert isinstance(load_tokenizer(same), Tokenizer)
    with pytest.raises(ModelLoadError, match=r"tokenizer_config.json: not a readable JSON file"):
        load_tokenizer(bad_config)
    assert load_tokenizer(tmp_path) is None


def test_tokenizer_json_alone(tok_dir, tmp_path):
    """No tokenizer_config.json: transformers reads tokenizer.json as it stands, so the fast path does."""
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, Tokenizer) and repr(tok) == f"Tokenizer({tmp_path}, 50257 tokens)"
    assert tok.encode(TEXTS[1]) == load_tokenizer(tok_dir).encode(TEXTS[1])


def test_broken_tokenizer_json(tok_dir, tmp_path):
    """One the `tokenizers` library cannot read goes to transformers, which cannot either: its error
    (transformers 5.24 raises a bare KeyError: 'added_tokens') comes back as one line that names
    the folder and the error."""
    d = _copy(tok_dir, tmp_path / "broken")
    (d / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "Nope"}}))
    with pytest.raises(ModelLoadError, match=rf"^{re.escape(str(d))}: could not load its tokenizer files \(\w+: .+\)$"):
        load_tokenizer(d)


def test_a_setting_that_breaks_encoding_fails_at_load(tok_dir, tmp_path):
    """transformers loads vocab.json and merges.txt with `model_max_length: "x"` and fails at its
    first encode (a bare TypeError); the load now tries one, so the error names the folder there,
    not at the first prompt (found by fuzzing tokenizer_config.json)."""
    d = _copy(tok_dir, tmp_path / "bpe", model_max_length="x")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=rf"^{re.escape(str(d))}: could not load its tokenizer files "
                                             r"\(TypeError: .+\)$"):
        load_tokenizer(d)


def test_loading_a_model_does_not_import_transformers(tok_dir, tmp_path):
    build_checkpoint(tmp_path, n_layer=1, n_head=2, n_embd=32, vocab_size=50257, n_positions=32, with_tokenizer=True)
    code = ("import sys; from minillm import LLM; llm = LLM(sys.argv[1], device='cpu', backend='torch'); "
            "print(type(llm.tokenizer).__name__, 'transformers' in sys.modules, llm.encode('Hi there'))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(" ", 2)[:2] == ["Tokenizer", "False"], out.stdout
