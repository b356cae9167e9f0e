"""The Python API: `LLM` loads a model once; `generate` runs batches; `stream` yields text."""
import dataclasses
import numbers
import os
import time
import warnings
from dataclasses import dataclass, field

import torch

from .checks import ContextLengthError, MiniLLMError, UnappliedSettingsWarning, is_integer
from .generate import Engine, eos_ids
from .loader import ModelLoadError, load_weights, read_model_settings, resolve
from .model import GPT, check_backend
from .sampling import SamplingParams, settings_text
from .tokenizer import IncrementalText, load_tokenizer

DTYPES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


@dataclass
class GenerationResult:
    """One prompt's output: generated ids only, their text (None without a tokenizer), why it
    ended ("stop": EOS or a stop string; "length": max_new_tokens), and timings."""
    prompt_token_ids: list
    token_ids: list
    text: str | None
    finish_reason: str
    metrics: dict = field(default_factory=dict)


def _token_id(t, vocab_size):
    return is_integer(t) and 0 <= t < vocab_size


def _count(n):
    """A parameter count in three figures: 35.7K, 124M, 1.56B."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        figures = f"{n / scale:.3g}"
        if float(figures) >= 1:  # on the rounded value: 999,999 is 1M, not 1e+03K
            return figures + unit
    return str(n)


def _pick_device(device):
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MiniLLMError(f"device: {device} was asked for, but CUDA is not available on this machine "
                           "(use --device cpu, or device=\"cpu\" in the API)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    return dev


class LLM:
    """A GPT-2-family model ready to generate.

    model: a local folder (config.json + safetensors + tokenizer files), a folder name under
        weights/, or a Hugging Face hub id (downloaded to the HF cache; HF_HUB_OFFLINE honoured).
    device: "cuda" (default when available) or "cpu".
    dtype: "float16" (default on CUDA), "bfloat16" or "float32" (default on CPU), or a torch dtype.
    backend: "triton" (default on CUDA; on CPU only under TRITON_INTERPRET=1) or "torch".
    cuda_graphs: capture the decode step in CUDA graphs (default on CUDA). Without them the host
        launches each step's kernels from Python: the same tokens, about 40x slower at batch 1.

    >>> llm = LLM("gpt2")
    >>> llm.generate("Hello, my name is", SamplingParams(max_new_tokens=20, temperature=0))[0].text
    """

    def __init__(self, model, device=None, dtype=None, backend=None, cuda_graphs=None):
        self.device = _pick_device(device)
        on_cuda = self.device.type == "cuda"
        if dtype is None:
            dtype = torch.float16 if on_cuda else torch.float32
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"dtype: expected one of float16, bfloat16, float32, got {dtype!r}")
            dtype = DTYPES[dtype]
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"dtype: expected float16, bfloat16 or float32, got {dtype}")
        self.dtype = dtype
        if backend is None:
            backend = "triton" if on_cuda else "torch"
        check_backend(backend)
        if backend == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise MiniLLMError("backend: triton on the CPU needs TRITON_INTERPRET=1 set before start "
                               "(or use backend torch)")
        self.backend = backend
        if cuda_graphs not in (None, True, False):
            raise ValueError(f"cuda_graphs: expected True, False or None (on CUDA), got {cuda_graphs!r}")
        t0 = time.perf_counter()
        self.model_dir = resolve(model)
        # sampling_defaults: generation_config.json's settings, what a call without params runs
        # with; unapplied_settings: its settings that transformers' generate would apply and this
        # engine does not
        self.config, self.sampling_defaults, self.unapplied_settings = read_model_settings(self.model_dir)
        if self.unapplied_settings:
            warnings.warn(f"{self.model_dir / 'generation_config.json'}: minillm does not apply "
                          f"{settings_text(self.unapplied_settings)} (transformers' generate would)",
                          UnappliedSettingsWarning, stacklevel=2)
        check_backend(backend, self.config)  # before the weights load
        weights = load_weights(self.model_dir, self.config, self.device, dtype)
        self.tokenizer = load_tokenizer(self.model_dir)
        if self.tokenizer is None:
            warnings.warn(f"{self.model_dir}: no tokenizer files; prompts must be token ids and .text is None",
                          stacklevel=2)
        self.model = GPT(self.config, weights, backend)
        self.engine = Engine(self.model, use_cuda_graphs=cuda_graphs)
        self.load_s = time.perf_counter() - t0
        self.last_result = None  # stream()'s GenerationResult, once one ends

    def __repr__(self):
        c = self.config
        return (f"LLM({self.model_dir.name}: {c.n_layer} layers, {c.n_embd} wide, {_count(c.n_params)} params; "
                f"device={self.device}, dtype={str(self.dtype).replace('torch.', '')}, backend={self.backend}, "
                f"cuda_graphs={self.engine.use_cuda_graphs})")

    def default_params(self, **overrides):
        """SamplingParams as this model's generation_config.json sets them (its temperature, top_k,
        top_p, repetition_penalty and max_new_tokens; do_sample false: greedy), as transformers'
        generate takes them, with SamplingParams' defaults for the rest and `overrides` on top.
        What generate() and stream() run with when given no params.

        >>> llm.generate("Hello", llm.default_params(max_new_tokens=20, seed=0))
        """
        return SamplingParams(**{**self.sampling_defaults, **overrides})

    def _call_params(self, params):
        if params is None:
            return self.default_params()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected a SamplingParams or None, got {type(params).__name__}")
        # checked again, as a copy: fields set after construction skipped the checks, and a stream
        # keeps its settings whatever the caller sets while it runs
        return dataclasses.replace(params)

    # -- prompts and text ---------------------------------------------------------------------
    def encode(self, text):
        if self.tokenizer is None:
            raise MiniLLMError(f"{self.model_dir}: no tokenizer, so prompts must be lists of token ids")
        return self.tokenizer.encode(text)

    def decode(self, ids):
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=False)

    def _prompt_ids(self, prompts):
        if hasattr(prompts, "tolist"):  # a tensor or array: (T,) or (B, T)
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], numbers.Integral)):  # numpy's ints too
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            got = "an empty list" if isinstance(prompts, (list, tuple)) else type(prompts).__name__
            raise ValueError(f"prompts: expected a str, a list of str, or a list of token-id lists, got {got}")
        V = self.config.vocab_size
        out = []
        for i, p in enumerate(prompts):
            text = isinstance(p, str)
            if text:
                try:
                    p.encode("utf-8")  # a lone surrogate (a file read with errors="surrogateescape")
                except UnicodeEncodeError as e:
                    raise ValueError(f"prompts[{i}]: expected text that UTF-8 encodes, got a lone surrogate at "
                                     f"character {e.start}") from None
                p = self.encode(p)
            ids = p.tolist() if hasattr(p, "tolist") else p  # a 1-D tensor too
            if not isinstance(ids, (list, tuple)):
                raise ValueError(f"prompts[{i}]: expected a str or a list of token ids, got {type(p).__name__}")
            if not ids:
                raise ValueError(f"prompts[{i}]: expected at least one token")
            bad = next((j for j, t in enumerate(ids) if not _token_id(t, V)), None)
            if bad is not None and text:
                raise MiniLLMError(f"prompts[{i}]: the tokenizer gives id {ids[bad]}, outside the model's vocabulary "
                                   f"of {V}: the tokenizer files do not belong to this checkpoint")
            if bad is not None:
                raise ValueError(f"prompts[{i}][{bad}]: expected a token id, an integer in [0, {V}), got {ids[bad]!r}")
            out.append([int(t) for t in ids])
        return out

    def _finish(self, prompt, ids, params, timings, n_seq):
        eos = eos_ids(self.config, params)
        reason = "length"
        end = next((i for i, t in enumerate(ids) if t in eos), None)
        if end is not None:
            ids, reason = ids[:end + 1], "stop"
        text = self.decode(ids[:-1] if reason == "stop" else ids)  # the end-of-sequence token is no text
        if text is not None and params.stop:
            cut = _find_stop(text, params.stop)
            if cut >= 0:
                text, reason = text[:cut], "stop"
                ids = ids[:_stop_end(ids, self.decode, params.stop)]
        decode_s = timings["decode_s"]
        metrics = {"prompt_tokens": len(prompt), "new_tokens": len(ids), "ttft_s": timings["ttft_s"],
                   "decode_tok_s": ((timings["steps"] - 1) / decode_s if timings["steps"] > 1 and decode_s > 0
                                    else float("nan")),  # the first token is prefill's
                   "batch_tok_s": n_seq * timings["steps"] / timings["total_s"], "total_s": timings["total_s"]}
        return GenerationResult(prompt, ids, text, reason, metrics)

    def _run(self, prompts, params, stream, stop_check=None):
        try:
            yield from self.engine.steps(prompts, params, stream=stream, stop_check=stop_check)
        except torch.cuda.OutOfMemoryError:
            raise MiniLLMError(f"out of memory: batch {len(prompts)} needs a KV cache of "
                               f"{self.model.cache_nbytes(len(prompts)) / 2**30:.2f} GiB on top of the weights; "
                               "use a smaller batch") from None

    # -- public -----------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | None = None):
        """Generate for one prompt or a batch (run together, one forward per step).

        prompts: a str, a list of str, or token ids: lists or 1-D tensors (lengths may differ), or a
            (B, T) tensor.
        params: a SamplingParams; None runs with the model's own settings (default_params()).
        Returns one GenerationResult per prompt: .token_ids (generated only), .text,
        .finish_reason ("stop" or "length") and .metrics (prompt_tokens, new_tokens, ttft_s,
        decode_tok_s: NaN where the one new token came from prefill, batch_tok_s, total_s).
        """
        params = self._call_params(params)
        if params.stop and self.tokenizer is None:  # ignoring them would run on past where they end
            raise MiniLLMError(f"{self.model_dir}: no tokenizer, so stop strings cannot be matched "
                               "(generation still ends at the model's eos_token_id)")
        ids = self._prompt_ids(prompts)
        stop_check = stop_checker(self.decode, params.stop)
        *_, (_, outs, timings) = self._run(ids, params, stream=False, stop_check=stop_check)
        return [self._finish(p, o, params, timings, len(ids)) for p, o in zip(ids, outs)]

    def stream(self, prompt, params: SamplingParams | None = None):
        """Yield the text of one prompt's continuation piece by piece as tokens arrive (params as
        generate's).
        After the loop, `self.last_result` holds the full GenerationResult (None until a stream
        ends, so a stream that stopped early or failed leaves no other call's result there)."""
        params = self._call_params(params)
        if self.tokenizer is None:
            raise MiniLLMError(f"{self.model_dir}: stream() needs a tokenizer to produce text")
        prompts = self._prompt_ids(prompt)
        if len(prompts) != 1:
            raise ValueError(f"prompt: stream() takes one prompt (a str or a list of token ids), got {len(prompts)}; "
                             "use generate() for a batch")
        (ids,) = prompts
        self.last_result = None
        eos = eos_ids(self.config, params)
        hold = max((len(s) for s in params.stop), default=1) - 1  # never emit part of a stop string
        got, emitted, cut = IncrementalText(self.decode), 0, -1
        # the engine asks after each streamed step, once this loop has searched its text: the loop's
        # find is the stop (no second decode of the same ids)
        stopped = (lambda b, seq: cut >= 0) if params.stop else None
        for event in self._run([ids], params, stream=True, stop_check=stopped):
            if event[0] == "done":
                self.last_result = self._finish(ids, event[1][0], params, event[2], 1)
                break
            tok = event[1][0]
            if tok in eos or cut >= 0:
                continue
            start = len(got.text)
            if not got.extend([tok]):  # (a character still incomplete)
                continue
            text = got.text
            cut = _find_stop(text, params.stop, start)
            end = cut if cut >= 0 else len(text) - hold
            if end > emitted:
                yield text[emitted:end]
                emitted = end
        final = self.last_result.text or ""
        if len(final) > emitted:
            yield final[emitted:]


def stop_checker(decode, stops):
    """The engine's stop_check(b, ids) for the stop strings (None where there are none): each row's
    text grows a piece at a time, and only its new end is searched. A find is confirmed on the
    whole decode, the text _finish cuts."""
    if not stops:  # generate() refuses stop strings without a tokenizer
        return None
    rows = {}  # b -> IncrementalText

    def stop_check(b, ids):
        text = rows.get(b) or rows.setdefault(b, IncrementalText(decode))
        start = len(text.text)
        if not text.extend(ids[len(text.ids):]):
            return False
        return _find_stop(text.text, stops, start) >= 0 and _find_stop(decode(ids), stops) >= 0
    return stop_check


def _stop_end(ids, decode, stops):
    """The length of the shortest prefix of ids whose text holds a stop string (the whole of ids'
    does), by bisection: a few decodes of the row, where dropping an id at a time from the end
    decodes it once per id past the stop (0.08-0.11 s for 970 ids, GPT-2's tokenizer on a 2-core
    CPU), for a row that stopped long before its batch's call ended. Where a prefix's text begins
    every longer prefix's (byte-level BPE), holding a stop string is monotone in the length and
    the bisection finds the one length where it starts; under any decode it ends at a length
    whose text holds one and one id less does not."""
    lo, hi = 0, len(ids)  # the text of ids[:lo] holds none (the empty text), that of ids[:hi] one
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _find_stop(decode(ids[:mid]), stops) >= 0:
            hi = mid
        else:
            lo = mid
    return hi


def _find_stop(text, stops, start=0):
    """Where the first stop string in text begins, -1 where none does; only one that ends past
    text[start] (the rest of text was searched before)."""
    begin = max(0, start - max(len(s) for s in stops) + 1) if stops else 0
    return min((i for i in (text.find(s, begin) for s in stops) if i >= 0), default=-1)


__all__ = ["LLM", "SamplingParams", "GenerationResult", "MiniLLMError", "ModelLoadError", "ContextLengthError"]
