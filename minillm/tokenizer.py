"""A model folder's tokenizer, loaded through the `tokenizers` library where that gives the
same ids and text as transformers' AutoTokenizer, and through AutoTokenizer elsewhere.

Importing transformers took 7-9 s of a 13 s warm `minillm generate` on the H200 machine
(it pulls in torch.distributed, scikit-learn, scipy and sympy); `tokenizers` reads
tokenizer.json in about 0.1 s. The fast path is taken only for a folder whose tokenizer.json
holds the whole pipeline and whose tokenizer_config.json asks for nothing transformers adds on
top of it (FALLBACK_KEYS, unknown added tokens, another tokenizer class).
"""
from pathlib import Path

from .loader import ModelLoadError, read_json

# tokenizer_config.json settings transformers applies beyond tokenizer.json; any of them true
# sends the folder to AutoTokenizer
FALLBACK_KEYS = ("clean_up_tokenization_spaces", "add_bos_token", "add_eos_token", "add_prefix_space")
# classes whose transformers tokenizer is tokenizer.json as it stands (byte-level BPE, no extra steps)
FAST_CLASSES = (None, "GPT2Tokenizer", "GPT2TokenizerFast")


class Tokenizer:
    """encode / decode over a `tokenizers.Tokenizer`, with transformers' defaults: special tokens
    added as tokenizer.json's post-processor says (none for GPT-2), kept in decoded text."""

    def __init__(self, tokenizer, path):
        self.backend = tokenizer
        self.path = path

    def __repr__(self):
        return f"Tokenizer({self.path}, {len(self)} tokens)"

    def __len__(self):
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text):
        return self.backend.encode(text).ids

    def decode(self, ids, skip_special_tokens=False):
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


class IncrementalText:
    """The text of a growing id sequence, decoding only a few ids per new piece. Decoding the
    whole sequence at every step costs time quadratic in its length: with GPT-2's tokenizer,
    0.18 s over 1,024 streamed tokens, more than the H200 spends generating them.

    The newest ids are decoded together with the piece before them (a window starting where the
    last piece started), and the new text is the window's text past that piece's: decoders that
    treat a sequence's first token differently (a leading space dropped) see the same first token
    in both. Text ending in an incomplete UTF-8 character (U+FFFD) waits for the next ids. For a
    prefix-stable decode (byte-level BPE: GPT-2's) `text` is decode(ids) less a trailing
    incomplete character."""

    def __init__(self, decode):
        self._decode = decode
        self.ids = []
        self.text = ""
        self._start = 0  # where the decode window starts: the first id of the last piece
        self._read = 0  # ids whose text is in self.text

    def extend(self, new_ids):
        """Append ids; returns the text they completed ("" while a character is incomplete)."""
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self._start:self._read])
        window = self._decode(self.ids[self._start:])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return ""
        piece = window[len(before):]
        self.text += piece
        self._start, self._read = self._read, len(self.ids)
        return piece


def _config(d):
    f = d / "tokenizer_config.json"
    if not f.is_file():
        return {}
    return read_json(f)


def fast_tokenizer(model_dir):
    """A Tokenizer for the folder, or None where AutoTokenizer must load it (see the module doc)."""
    d = Path(model_dir)
    cfg = _config(d)
    if not (d / "tokenizer.json").is_file():
        return None
    if cfg.get("tokenizer_class") not in FAST_CLASSES or any(cfg.get(k) for k in FALLBACK_KEYS):
        return None
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - tokenizers raises bare Exception
        return None  # a format this version does not read: transformers may convert it
    added = cfg.get("added_tokens_decoder") or {}
    if not isinstance(added, dict) or not all(_known(tok, i, t) for i, t in added.items()):
        return None  # tokens only the config knows: transformers adds them
    return Tokenizer(tok, d)


def _known(tok, token_id, entry):
    """tokenizer.json already has the config's added token `entry` at `token_id`."""
    if not (str(token_id).isdigit() and isinstance(entry, dict)):
        return False
    return tok.id_to_token(int(token_id)) == entry.get("content")


def load_tokenizer(model_dir):
    """The folder's tokenizer (a Tokenizer, or transformers' where it would differ), or None when
    it has no tokenizer files. Either has encode(text) -> ids and decode(ids) -> text."""
    d = Path(model_dir)
    if not ((d / "tokenizer.json").is_file() or ((d / "vocab.json").is_file() and (d / "merges.txt").is_file())):
        return None
    tok = fast_tokenizer(d)
    if tok is not None:
        return tok
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(d))
        tok.decode(tok.encode("a"))  # some broken settings (model_max_length "x") fail only here
        return tok
    except Exception as e:  # noqa: BLE001 - a broken file surfaces as KeyError, ValueError, OSError...
        raise ModelLoadError(f"{d}: could not load its tokenizer files ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else 'no message'})") from e
