"""A decode step's static device buffers, and the buckets that decide which of them (and which
captured CUDA graph) a call reuses: batch sizes and the cache positions decode attention covers;
the prefill's padded ids. What the host reads back of the steps, and knows of the rows."""
import array
from collections import deque

import torch

from . import own_kernels  # noqa: F401  (first: checks that `kernels` is minillm's)
from kernels.argmax_key import EMPTY

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LENGTH_BUCKETS = (128, 256, 512, 1024, 2048, 4096)
# how many steps the host reads each step's ids behind the device: enough queued work to hide the
# host's turn (a stream's consumer included), few steps run past the last row's end
READ_LAG = 3


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

    def __init__(self, batch, vocab, out_len, device, with_seen, max_len=None, noise=None, reads=False):
        self.tokens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.pos = torch.zeros(batch, dtype=torch.int32, device=device)
        self.out = torch.zeros(batch, out_len, dtype=torch.int64, device=device)
        self.step = torch.zeros(1, dtype=torch.int64, device=device)
        # the tokens each row has seen (repetition penalty), (B, V); a spare column V takes the id
        # V a row of NaN logits draws (no token), which ends the call with NonFiniteLogitsError
        self.seen_ids = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device) if with_seen else None
        self.seen = self.seen_ids[:, :vocab] if with_seen else None
        # the lm_head's fused argmax (keys; append_tokens reads them and leaves EMPTY again)
        self.keys = torch.full((batch,), EMPTY, dtype=torch.int64, device=device)
        self.graph = None
        self.max_len = max_len  # cache positions decode attention covers (None: all)
        self.noise = noise  # sampling.KernelNoise, or None: q drawn with torch
        # reads: the host reads each step's ids back (StepReads), on a GPU from a pinned mirror of
        # out that the step writes as well (a step that writes none has nothing to add to its end)
        self.out_host = torch.empty(batch, out_len, dtype=torch.int64, pin_memory=True) \
            if reads and self.out.is_cuda else None
        self.reads = StepReads(self.out, self.out_host) if reads else None


class StepReads:
    """Each step's ids, read back READ_LAG steps behind the device. On a GPU the step's
    bookkeeping kernel writes them into out_host, a pinned mirror of out that the device reaches
    directly, so nothing is queued between two steps but an event: push() records the step's,
    pop() waits for the oldest queued step's and reads its column of the mirror. The host never
    drains the device's queue, as reading each step's ids as it ends would: the next steps are
    already queued while it looks at one. On the CPU, out is host memory already."""

    def __init__(self, out, out_host=None, lag=READ_LAG):
        self.host = out if out_host is None else out_host
        self.lag = lag
        self.events = [torch.cuda.Event() for _ in range(lag + 1)] if out.is_cuda else None
        self.pending = deque()  # the columns of the steps queued, oldest first (event: column % (lag + 1))
        self.column = 0  # the column of the next step pushed

    def start(self, column):
        """A call's first pushed step writes this column (what an earlier call left queued, as
        one that ended with reads still behind, is forgotten)."""
        self.pending.clear()
        self.column = column

    def push(self):
        """Queue the read of the ids of the step just launched."""
        # the event's last step was waited for: the pending reads hold the lag columns before it
        if self.events is not None:
            self.events[self.column % (self.lag + 1)].record()
        self.pending.append(self.column)
        self.column += 1

    def behind(self, last=False):
        """Whether a read is due: more than lag steps queued, or any at the call's last step."""
        return len(self.pending) > (0 if last else self.lag)

    def pop(self):
        """The oldest queued step's ids (a list, one a row), once the step has ended."""
        column = self.pending.popleft()
        if self.events is not None:
            self.events[column % (self.lag + 1)].synchronize()
        return self.host[:, column].tolist()


class HostRows:
    """What the host knows of a call's rows: which have ended at an eos id or by stop_check, and
    (for a stop_check) their ids, from every step's ids as read back."""

    def __init__(self, batch, eos_ids, stop_check):
        self.stop_check, self.eos = stop_check, frozenset(eos_ids)
        self.ended = [False] * batch  # at an eos id
        self.stopped = [False] * batch  # by stop_check, which is not asked about the row again
        self.ids = [[] for _ in range(batch)]  # kept only for stop_check
        self.steps = 0  # steps added

    @property
    def watching(self):
        """Whether any row can end before max_new_tokens (else no step's ids are needed)."""
        return bool(self.eos) or self.stop_check is not None

    def add(self, step_ids):
        """One step's ids, one per row."""
        if not self.eos.isdisjoint(step_ids):
            for b, t in enumerate(step_ids):
                self.ended[b] = self.ended[b] or t in self.eos
        if self.stop_check is not None:
            for row, t in zip(self.ids, step_ids):
                row.append(t)
        self.steps += 1

    def done(self):
        """Whether every row has ended: at an eos id, or by stop_check on its ids. Asked after
        each step read: stop_check is asked about the rows in order up to the first still going
        (the rows after it are asked once it ends, about all their ids), so a step costs about one
        row's search, a few ids decoded; a row stop_check ended is not asked about again."""
        for b, ended in enumerate(self.ended):
            if ended or self.stopped[b]:
                continue
            if self.stop_check is None or not self.stop_check(b, self.ids[b]):
                return False
            self.stopped[b] = True
        return True
