"""Sampling parameters and the logits processing + token choice of one decode step.

The processing follows transformers' order and formulas exactly (repetition penalty, then
temperature, top-k, top-p), and a token is drawn as argmax(p / q) with q ~ Exp(1): the very
draw `torch.multinomial(p, 1)` makes, so with the same seed the ids equal transformers'
`generate(do_sample=True)`. Everything here is shape-static and sync-free, so it is captured in
the decode step's CUDA graph.
"""
import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens.

    max_new_tokens: tokens to generate at most (>= 1).
    temperature: 0 means greedy; otherwise logits are divided by it (> 0).
    top_k: keep the k most likely tokens (0 disables). Default 50, as in transformers.
    top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].
    repetition_penalty: > 1 discourages tokens already in the prompt or output (1 disables).
    seed: seeds torch's generators before generating, for reproducible samples.
    stop: strings that end a sequence (not included in the text).
    ignore_eos: keep generating past the end-of-sequence token (benchmarks).
    """
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            ("max_new_tokens", isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "an integer >= 1"),
            ("temperature", _real(self.temperature) and self.temperature >= 0, "a number >= 0"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0"),
            ("top_p", _real(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("repetition_penalty", _real(self.repetition_penalty) and self.repetition_penalty > 0, "a number > 0"),
            ("seed", self.seed is None or isinstance(self.seed, int), "an integer or None"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "a list of non-empty strings"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name}: expected {expected}, got {getattr(self, name)!r}")

    @property
    def greedy(self):
        return self.temperature == 0

    def graph_key(self):
        """What a captured decode step bakes in."""
        return (self.greedy, float(self.temperature), self.top_k, float(self.top_p),
                float(self.repetition_penalty))


def _real(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def process_logits(logits, params: SamplingParams, seen=None):
    """transformers' logits processors, in its order (kernels.reference.sampling_scores).
    logits (B, V) -> float32 scores (B, V). seen (B, V) bool marks the tokens of each prompt and
    output so far."""
    from kernels.reference import sampling_scores

    if params.greedy:
        if params.repetition_penalty == 1.0 or seen is None:
            return logits  # argmax of fp16 and of its exact fp32 upcast agree: skip the copy
        return sampling_scores(logits, penalty=params.repetition_penalty, seen=seen)
    return sampling_scores(logits, params.temperature, params.top_k, params.top_p, params.repetition_penalty, seen)


def sample(logits, params: SamplingParams, seen=None, ops=None):
    """Next token ids (B,) int64 from logits (B, V): argmax when greedy, else a draw from
    softmax(processed scores) through the default generator of the logits' device. ops: the
    model's kernel backend; its `sample_logits` takes top_k from 1 to its SAMPLE_MAX_TOP_K
    (kernels/sampling.py: 128), plain torch (kernels.reference) the rest. A row of logits with a
    NaN names no token: id V, as the fused argmax (kernels/argmax_key.py)."""
    import torch

    import kernels.reference

    if params.greedy:
        return kernels.reference.no_token_if_nan(logits, process_logits(logits, params, seen).argmax(dim=-1))
    q = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_(1)  # multinomial's draw
    ops = ops if ops is not None and 1 <= params.top_k <= ops.SAMPLE_MAX_TOP_K else kernels.reference
    return ops.sample_logits(logits, q, params.top_k, params.temperature, params.top_p, params.repetition_penalty,
                             seen)
