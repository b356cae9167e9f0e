"""A decode step's static device buffers, and the buckets that decide which of them (and which
captured CUDA graph) a call reuses: batch sizes and the cache positions decode attention covers;
the prefill's padded ids."""
import array

import torch

from . import own_kernels  # noqa: F401  (first: checks that `kernels` is minillm's)
from kernels.argmax_key import EMPTY

from .checks import check_vocab

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LENGTH_BUCKETS = (128, 256, 512, 1024, 2048, 4096)


def padded_ids(prompts, T):
    """(B, T) int64 on the host: each prompt's ids, then zeros. Built through array.array, which
    reads a list of Python ints 4-14x faster than torch.tensor (1 x 1024 ids: 47 against 169 us;
    64 x 32: 71 against 963 us, on a 2-core CPU machine), and this is on the time to first
    token's path."""
    flat = array.array("q", bytes(8 * len(prompts) * T))
    for i, p in enumerate(prompts):
        flat[i * T:i * T + len(p)] = array.array("q", p)
    return torch.frombuffer(flat, dtype=torch.int64).view(len(prompts), T)


def batch_bucket(n):
    """The batch a call of n prompts runs at with CUDA graphs: the smallest BATCH_BUCKETS entry
    that holds them (padded rows decode alongside and are dropped), so few graphs serve all."""
    for b in BATCH_BUCKETS:
        if n <= b:
            return b
    return n


def cache_bucket(reach, n_positions):
    """The cache positions decode attention covers for a call whose steps reach `reach`
    positions (prompt + new tokens): the smallest LENGTH_BUCKETS entry that holds them."""
    return min(next(b for b in (*LENGTH_BUCKETS, reach) if b >= reach), n_positions)


class DecodeState:
    """Static device buffers one decode step reads and writes (so a CUDA graph can replay it)."""

    def __init__(self, batch, vocab, out_len, device, with_seen, max_len=None, noise=None, eos=()):
        self.tokens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.pos = torch.zeros(batch, dtype=torch.int32, device=device)
        self.out = torch.zeros(batch, out_len, dtype=torch.int64, device=device)
        self.step = torch.zeros(1, dtype=torch.int64, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        # the ids that end a row, all flagged in finished by the step itself (None: no end)
        self.eos = torch.tensor(eos, dtype=torch.int64, device=device) if eos else None
        self.eos_ids = tuple(eos)
        # the tokens each row has seen (repetition penalty), (B, V); a spare column V takes the id
        # V a row of NaN logits draws (no token), which ends the call with NonFiniteLogitsError
        self.seen_ids = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device) if with_seen else None
        self.seen = self.seen_ids[:, :vocab] if with_seen else None
        # the lm_head's fused argmax (keys; append_tokens reads them and leaves EMPTY again)
        self.keys = torch.full((batch,), EMPTY, dtype=torch.int64, device=device)
        self.graph = None
        self.max_len = max_len  # cache positions decode attention covers (None: all)
        self.noise = noise  # sampling.KernelNoise, or None: q drawn with torch


class HostRows:
    """What the host knows of a call's rows: which have ended, and (for a stop_check) their ids.
    Between checks the host reads back only the steps since its last read and the device's eos
    flags; a streamed step's ids, which the host has already read, are taken as they come, so a
    streaming check reads nothing more back."""

    def __init__(self, batch, eos_ids, stop_check):
        self.stop_check, self.eos = stop_check, frozenset(eos_ids)
        self.ended = [False] * batch  # at an eos id (the device's flags, or the streamed ids)
        self.stopped = [False] * batch  # by stop_check, which is not asked about the row again
        self.ids = [[] for _ in range(batch)]  # kept only for stop_check
        self.steps = 0  # steps taken into account

    def add(self, step_ids):
        """One step's ids (a streamed step's, read by the caller)."""
        for b, t in enumerate(step_ids):
            self.ended[b] = self.ended[b] or t in self.eos
            if self.stop_check is not None:
                self.ids[b].append(t)
        self.steps += 1

    def done(self, st, n, vocab_size):
        """Whether every row has ended after n steps: an eos id, or stop_check on its ids."""
        if not self.eos and self.stop_check is None:
            return False
        if self.steps < n:  # catch up from the device
            if self.eos:
                self.ended = st.finished[:len(self.ended)].tolist()
            if self.stop_check is not None:
                new = st.out[:len(self.ended), self.steps:n].tolist()
                check_vocab(new, vocab_size, first=self.steps)  # before stop_check decodes them
                for row, ids in zip(self.ids, new):
                    row.extend(ids)
            self.steps = n
        for b, ended in enumerate(self.ended):
            if ended or self.stopped[b]:
                continue
            if self.stop_check is None or not self.stop_check(b, self.ids[b]):
                return False  # (the rows after it are asked at a later check, about more ids)
            self.stopped[b] = True
        return True
