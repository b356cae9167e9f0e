"""The generation engine: prefill, decode_one_token, generate.

All sequences of a batch decode in lockstep over a static KV cache. On CUDA the whole decode
step (every layer, the lm_head, logits processing and the token draw, plus the bookkeeping:
output write, next input and position) is captured once per (batch bucket, sampling mode) as a
CUDA graph and replayed per token. Where a row can end early (an eos id, a stop string) or the
call streams, the host reads each step's ids back READ_LAG steps behind the device, without
draining its queue (decode_state.StepReads); otherwise it reads nothing until the end.
"""
import contextlib
import threading
import time
from concurrent.futures import as_completed

import torch
from tqdm.auto import tqdm

from . import own_kernels  # noqa: F401  (first: checks that `kernels` is minillm's)
from kernels.argmax_key import EMPTY

from .checks import MiniLLMError, check_context, check_vocab
from .decode_state import DecodeState, HostRows, batch_bucket, cache_bucket, padded_ids
from .graphs import StagedInputs, capture
from .sampling import KernelNoise, SamplingParams, sample

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
PREFILL_GRAPH_TOKENS = 16384


def check_step(ids, vocab_size, step):
    """check_vocab of one step's ids (one a row), quick where every one is in the vocabulary."""
    if min(ids) < 0 or max(ids) >= vocab_size:
        check_vocab([[t] for t in ids], vocab_size, first=step)


def eos_ids(config, params):
    """The ids that end a sequence in this call: none with ignore_eos."""
    return () if params.ignore_eos else config.eos_token_ids


class Engine:
    def __init__(self, model, use_cuda_graphs=None):
        self.model = model
        on_cuda = model.device.type == "cuda"
        self.use_cuda_graphs = on_cuda if use_cuda_graphs is None else (use_cuda_graphs and on_cuda)
        self._caches = {}  # batch -> KVCache
        self._states = {}  # (batch, sampling key, cache bucket, reads) -> DecodeState (with its graph)
        self._prefill_graphs = {}  # (batch, padded length, keyed) -> captured prefill
        self._compiled_prefills = set()  # (batch, padded length, keyed) _compile_ahead has covered
        self._dry = False  # inside _compile_ahead's pass: kernels compile and nothing runs
        self._one_call = threading.Lock()
        self._running_in = None  # the thread whose call holds _one_call

    # -- pieces -------------------------------------------------------------------------
    def cache_for(self, batch):
        """The KV cache of this batch size. Caches stay for the batch sizes a CUDA graph was captured
        at (its replays write that memory); without graphs a cache is quick to make again, so only
        one is held. Where a new one does not fit, those of the other sizes go first."""
        if batch not in self._caches:
            if not self.use_cuda_graphs:
                self._forget_batches_but(batch)
            try:
                self._caches[batch] = self.model.new_cache(batch)
            except torch.cuda.OutOfMemoryError:  # (outside any capture: each call makes its cache first)
                if not self._forget_batches_but(batch):
                    raise
                torch.cuda.empty_cache()
                self._caches[batch] = self.model.new_cache(batch)
        return self._caches[batch]

    def _forget_batches_but(self, batch):
        """Drop the caches of other batch sizes, with the states and graphs that write them;
        whether there were any."""
        others = [b for b in self._caches if b != batch]
        for b in others:
            del self._caches[b]
        self._states = {k: st for k, st in self._states.items() if k[0] == batch}
        self._prefill_graphs = {k: g for k, g in self._prefill_graphs.items() if k[0] == batch}
        return bool(others)

    def prefill(self, prompts, cache, keyed=False):
        """Right-pad the prompts, run them in one forward; returns (logits (B, V), lens (B,)), or
        keyed (greedy decoding): (keys (B,), lens), each row's argmax key (kernels.argmax_key)
        from the lm_head in place of its logits, as the decode step's; append_tokens(from_keys=)
        reads them and leaves EMPTY again. With CUDA graphs, small prefills (B x T <=
        PREFILL_GRAPH_TOKENS) pad T to a bucket and replay a graph captured per (B, T bucket,
        keyed): their launch overhead exceeds their math."""
        dev = self.model.device
        B, (T, graphed) = len(prompts), self._prefill_length(prompts)
        ids = padded_ids(prompts, T)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
        if not graphed:
            ids, lens = ids.to(dev, non_blocking=True), lens.to(dev, non_blocking=True)
            keys = torch.full((B,), EMPTY, dtype=torch.int64, device=dev) if keyed else None
            logits = self.model.prefill(ids, lens, cache, argmax_keys=keys)
            return (keys if keyed else logits), lens
        g = self._prefill_graphs.get((B, T, keyed))
        if g is None:
            g = self._prefill_graphs[(B, T, keyed)] = self._capture_prefill(ids, lens, cache, keyed)
        else:
            g["inputs"].load(ids, lens)
        g["graph"].replay()
        return g["out"], g["inputs"].lens

    def _prefill_length(self, prompts):
        """(T, graphed): the prefill's padded length, a bucket where it replays a graph."""
        T = max(len(p) for p in prompts)
        graphed = self.use_cuda_graphs and len(prompts) * T <= PREFILL_GRAPH_TOKENS
        if graphed:
            T = min(next(t for t in (*PREFILL_BUCKETS, T) if t >= T), self.model.config.n_positions)
        return T, graphed

    def _capture_prefill(self, ids, lens, cache, keyed):
        inputs = StagedInputs(*ids.shape, self.model.device)
        inputs.load(ids, lens)
        keys = torch.full((len(ids),), EMPTY, dtype=torch.int64, device=self.model.device) if keyed else None
        # one warm-up run: autotuning and compilation happen there
        graph, logits = capture(lambda: self.model.prefill(inputs.ids, inputs.lens, cache, argmax_keys=keys),
                                warmups=1)
        if keyed:
            keys.fill_(EMPTY)  # the warm-up's keys: a replay max-es into EMPTY
        return {"graph": graph, "inputs": inputs, "out": keys if keyed else logits}

    @staticmethod
    def _keyed(st, params):
        """Whether the next token is a plain argmax of the logits: fused into the lm_head as keys."""
        return params.greedy and st.seen is None

    def decode_one_token(self, st, params, cache):
        """One step on the state's buffers: next token for every row, appended in place."""
        if self._keyed(st, params):
            self.model.decode(st.tokens, st.pos, cache, st.max_len, argmax_keys=st.keys)
            self._advance(st, st.keys, from_keys=True)
        else:
            nxt = sample(self.model.decode(st.tokens, st.pos, cache, st.max_len), params, st.seen, self.model.ops,
                         st.noise)
            self._advance(st, nxt)

    def _advance(self, st, nxt, from_keys=False):
        if st.seen is not None and not self._dry:  # (a dry pass's nxt holds no ids)
            st.seen_ids.scatter_(1, nxt[:, None], True)
        # out[:, step] = tokens = nxt; pos += 1; step += 1
        self.model.ops.append_tokens(nxt, st.out, st.step, st.tokens, st.pos, from_keys=from_keys,
                                     noise=st.noise.draw if st.noise is not None else None, out_host=st.out_host)

    def _state(self, batch, params, max_len=None, padded=None, reads=False):
        """The decode state's buffers for this batch and sampling mode (and whether the host reads
        each step's ids back: decode_state.StepReads), its graph captured; what
        this call launches first compiled ahead: a new state's step, and the prefill of the padded
        prompts (where given) if its shape is new."""
        key = (batch, params.graph_key(), max_len, reads)
        st = self._states.get(key)
        if st is not None:
            self._compile_ahead(st, padded, params)
            return st
        c, dev = self.model.config, self.model.device
        st = DecodeState(batch, c.vocab_size, c.n_positions, dev, with_seen=params.repetition_penalty != 1.0,
                         max_len=max_len, noise=KernelNoise.new(self.model.ops, params, batch, c.vocab_size, dev),
                         reads=reads)
        self._states[key] = st
        # a new state's dry pass and warm-up steps draw noise from torch's generators: put them back,
        # so that a call without a seed samples from where its caller left them (torch.manual_seed
        # before it gives transformers' ids), the first call as any later one
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            self._compile_ahead(st, padded, params, decode=True)
            if self.use_cuda_graphs:
                self._capture(st, params)
        return st

    def _compile_ahead(self, st, padded, params, decode=False):
        """Compile what this call will launch before anything runs, all kernels at once
        (kernels.compile_ahead, in threads): a dry pass over what this engine has not compiled
        yet: the prefill of the padded prompts (if given and new; greedy decoding's with the
        head's argmax keys), and for a new state (decode) a sampled call's first draw and a
        decode step. A first call then waits far less than for its
        compilations one after the other (a cold gpt2 process on a 16-core H200 host: 19.3 ->
        11.7 s)."""
        keyed = self._keyed(st, params)
        prefill = (len(padded), self._prefill_length(padded)[0], keyed) if padded is not None else None
        prefill = prefill if prefill not in self._compiled_prefills else None
        ahead = getattr(self.model.ops, "compile_ahead", None)
        if not (decode or prefill) or ahead is None:
            return
        if prefill:
            self._compiled_prefills.add(prefill)
        cache, dev, c = self.cache_for(len(st.tokens)), self.model.device, self.model.config
        with ahead() as pending:
            if pending is None:
                return
            self._dry = True
            try:
                if prefill:
                    lens = torch.tensor([len(p) for p in padded], dtype=torch.int32, device=dev)
                    self.model.prefill(padded_ids(padded, prefill[1]).to(dev), lens, cache,
                                       argmax_keys=st.keys if keyed else None)
                if decode:  # a new state's first draw (keyed: the prefill's keys, as a step's) and step
                    if not keyed:
                        logits = torch.empty(len(st.tokens), c.vocab_size, dtype=self.model.dtype, device=dev)
                        self._advance(st, sample(logits, params, st.seen, self.model.ops, st.noise))
                    self.decode_one_token(st, params, cache)
            finally:
                self._dry = False
            for _ in tqdm(as_completed(pending), total=len(pending), desc="[minillm] compiling kernels",
                          unit="kernel", delay=1.0, leave=False):
                pass  # (a bar only where this takes over a second: a first run on this GPU)

    def _capture(self, st, params):
        cache = self.cache_for(st.tokens.shape[0])
        # two warm-up steps: autotuning and compilation happen there
        st.graph, _ = capture(lambda: self.decode_one_token(st, params, cache), warmups=2)

    # -- the loop -------------------------------------------------------------------------
    def steps(self, prompts, params: SamplingParams, stream=False, stop_check=None):
        """Generate for every prompt (lists of ids) in one batch, as a generator.

        With stream, yields ("step", ids) for each step with the (B,) new ids, read READ_LAG
        steps behind the device. stop_check(b, ids) -> bool is a host-side stop test (stop
        strings) for sequence b, on its ids so far (a list the engine extends: read it, do not
        keep it), asked after each step read (HostRows.done); a sequence it has ended is not asked
        about again.
        Last yields ("done", out, timings): the generated ids per sequence (up to the step where
        all stopped; callers cut at EOS/stop) and the timings.
        """
        dev = self.model.device
        # one call at a time: every call writes the same caches and state buffers. Another
        # thread's call waits for this one; this thread's own (a second stream() advanced
        # beside the first) would deadlock, so it is refused
        if self._running_in == threading.get_ident():
            raise MiniLLMError("this LLM is still running an unfinished stream() in this thread: finish or close() "
                               "it first (or use a second LLM)")
        with self._one_call:
            self._running_in = threading.get_ident()
            try:
                # Triton launches on the current device, and graphs capture on its streams: the
                # model's (cuda:N) for the whole call, the caller's code between streamed steps included
                with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
                    yield from self._steps(prompts, params, stream, stop_check)
            finally:
                self._running_in = None

    def _steps(self, prompts, params, stream, stop_check):
        c = self.model.config
        B = len(prompts)
        longest = max(len(p) for p in prompts)
        check_context(longest, params.max_new_tokens, c.n_positions)
        Bp = batch_bucket(B) if self.use_cuda_graphs else B
        padded = list(prompts) + [[0]] * (Bp - B)
        cache = self.cache_for(Bp)
        # decode attention sees only the positions this call can reach, in a few buckets
        max_len = cache_bucket(longest + params.max_new_tokens, c.n_positions)
        # captured before the prefill refills the cache
        rows = HostRows(B, eos_ids(c, params), stop_check)
        # the host reads each step's ids back where a row can end early (an eos id, a stop string)
        # or the call streams
        st = self._state(Bp, params, max_len, padded, reads=stream or rows.watching)
        dev = self.model.device

        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        if params.seed is not None:
            torch.manual_seed(params.seed)
        if st.noise is not None:
            st.noise.load()
        try:
            yield from self._run(st, padded, B, params, cache, stream, rows, t0)
        finally:  # an early exit (an error, the caller closing the stream) also hands the state back
            if st.noise is not None:
                st.noise.store()

    def _run(self, st, padded, B, params, cache, stream, rows, t0):
        """steps() from the prefill on, with the state's buffers reset."""
        c, dev = self.model.config, self.model.device
        if st.seen is not None:
            st.seen_ids.zero_()
            for b, p in enumerate(padded):
                st.seen[b, torch.tensor(p, device=dev)] = True
        keyed = self._keyed(st, params)
        out, lens = self.prefill(padded, cache, keyed)  # keyed: the lm_head's argmax keys, not logits
        # launched while the prefill runs, not before it: the host is ahead of the GPU here
        st.step.zero_()
        first = out if keyed else sample(out, params, st.seen, self.model.ops, st.noise)
        torch.sub(lens, 1, out=st.pos)  # _advance moves it to the first new token's position
        self._advance(st, first, from_keys=keyed)
        first_ids = st.tokens.tolist()[:B]  # the one sync every run needs: time to first token
        t_first = time.perf_counter()
        watch = st.reads is not None  # every step's ids come back, st.reads.lag steps behind
        n, done = 1, False
        if watch:  # every id checked before anyone (a stream's reader, stop_check) decodes it
            check_step(first_ids, c.vocab_size, 0)
            if stream:
                yield "step", first_ids
            rows.add(first_ids)
            done = rows.done()
            st.reads.start(column=1)
        while n < params.max_new_tokens and not done:
            if st.graph is not None:
                st.graph.replay()
            else:
                self.decode_one_token(st, params, cache)
            n += 1
            if watch:
                st.reads.push()
            while watch and not done and st.reads.behind(last=n == params.max_new_tokens):
                ids = st.reads.pop()[:B]
                check_step(ids, c.vocab_size, rows.steps)
                if stream:
                    yield "step", ids
                rows.add(ids)
                done = rows.done()
        if watch:  # the steps the host saw: any later ones ran past the end
            n = rows.steps
        out = st.out[:B, :n].tolist()
        t_end = time.perf_counter()
        if st.noise is not None:
            st.noise.store()  # before the caller sees the ids (and may draw more)
        if not watch:  # (the ids read back were checked as they came)
            check_vocab(out, c.vocab_size)
        timings = {"ttft_s": t_first - t0, "decode_s": t_end - t_first, "steps": n, "total_s": t_end - t0}
        yield "done", out, timings

    def generate(self, prompts, params: SamplingParams, stop_check=None):
        """steps() run to the end: returns (ids per sequence, timings)."""
        *_, last = self.steps(prompts, params, stop_check=stop_check)
        return last[1], last[2]
