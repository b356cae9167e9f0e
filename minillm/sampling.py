"""Sampling parameters and the logits processing + token choice of one decode step.

The processing follows transformers' order and formulas exactly (repetition penalty, then
temperature, top-k, top-p), and a token is drawn as argmax(p / q) with q ~ Exp(1): the very
draw `torch.multinomial(p, 1)` makes, so with the same seed the ids equal transformers'
`generate(do_sample=True)`. Everything here is shape-static and sync-free, so it is captured in
the decode step's CUDA graph.
"""
import json
import os
import warnings
from dataclasses import dataclass, field

from .checks import is_integer, is_real

SEED_MIN, SEED_END = -2 ** 63, 2 ** 64  # torch.manual_seed's range
# MINILLM_KERNEL_NOISE=0: draw q with torch's exponential_ on CUDA too (A/B timing, checks)
KERNEL_NOISE = os.environ.get("MINILLM_KERNEL_NOISE", "1") != "0"


@dataclass
class SamplingParams:
    """How to pick tokens.

    max_new_tokens: tokens to generate at most (>= 1).
    temperature: 0 means greedy; otherwise logits are divided by it (> 0).
    top_k: keep the k most likely tokens (0 disables). Default 50, as in transformers.
    top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].
    repetition_penalty: > 1 discourages tokens already in the prompt or output (1 disables).
    seed: seeds torch's generators before generating, for reproducible samples. None: the call
        draws from where the caller left them (torch.manual_seed before it reproduces it too).
    stop: a string or strings that end a sequence (not included in the text); None: none.
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
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        checks = [
            ("max_new_tokens", is_integer(self.max_new_tokens) and self.max_new_tokens >= 1, "an integer >= 1"),
            ("temperature", is_real(self.temperature) and self.temperature >= 0, "a number >= 0"),
            ("top_k", is_integer(self.top_k) and self.top_k >= 0, "an integer >= 0"),
            ("top_p", is_real(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("repetition_penalty", is_real(self.repetition_penalty) and self.repetition_penalty > 0, "a number > 0"),
            ("seed", self.seed is None or (is_integer(self.seed) and SEED_MIN <= self.seed < SEED_END),
             "an integer in [-2**63, 2**64) (torch.manual_seed's range) or None"),
            ("stop", isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
             "a non-empty string, a list of them, or None"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "True or False"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name}: expected {expected}, got {getattr(self, name)!r}")
        # numpy scalars pass the checks: hold Python numbers (the kernels' arguments, graph keys)
        self.max_new_tokens, self.top_k = int(self.max_new_tokens), int(self.top_k)
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        self.repetition_penalty = float(self.repetition_penalty)
        self.seed = None if self.seed is None else int(self.seed)

    @property
    def greedy(self):
        return self.temperature == 0

    def graph_key(self):
        """What a captured decode step bakes in."""
        return (self.greedy, float(self.temperature), self.top_k, float(self.top_p),
                float(self.repetition_penalty))


# generation_config.json's settings that transformers' generate takes as its defaults, as
# SamplingParams fields. Each default of transformers (GenerationConfig._get_default_generation_params:
# temperature 1, top_k 50, top_p 1, repetition_penalty 1) is SamplingParams' too, but for length:
# 20 tokens in all there, 64 new ones here
GENERATION_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty")


def generation_defaults(settings):
    """SamplingParams fields from a model's parsed generation_config.json, as transformers'
    generate (and vLLM) take them when a call names none: each setting it names replaces
    SamplingParams' default (null, in transformers 5, is unset: the default stays), and
    do_sample false makes the default greedy (temperature 0), whatever temperature it names.
    Raises ValueError naming the setting where one is not a valid value."""
    fields = {name: settings[name] for name in GENERATION_FIELDS if settings.get(name) is not None}
    do_sample = settings.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise ValueError(f"do_sample: expected true, false or null, got {do_sample!r}")
    if do_sample is False:
        fields["temperature"] = 0.0
    params = SamplingParams(**fields)  # its checks name the field
    return {name: getattr(params, name) for name in fields}  # as Python numbers


# generation_config.json's settings that change which tokens transformers' generate picks and that
# minillm does not apply (beam and contrastive search, further logits processors, forced or
# suppressed tokens, a time limit), each with the values that leave generate's output as it is
# without them. A model naming another value runs without it, and says so (LLM, the CLI). Length
# (max_length) is not among them: minillm's default length differs from transformers' anyway.
UNAPPLIED_NEUTRAL = {
    # search: beams, groups, several sequences, contrastive search, DoLa
    "num_beams": (1,), "num_beam_groups": (1,), "diversity_penalty": (0,), "num_return_sequences": (1,),
    "penalty_alpha": (0,), "dola_layers": (), "constraints": ([],), "force_words_ids": ([],),
    # logits processors and warpers beyond temperature, top-k, top-p and the repetition penalty
    "typical_p": (1,), "min_p": (0,), "top_h": (), "epsilon_cutoff": (0,), "eta_cutoff": (0,),
    "no_repeat_ngram_size": (0,), "encoder_no_repeat_ngram_size": (0,), "encoder_repetition_penalty": (1,),
    "guidance_scale": (1,), "watermarking_config": (), "exponential_decay_length_penalty": (),
    # tokens forced, suppressed, biased; when a sequence may end
    "bad_words_ids": ([],), "sequence_bias": ({},), "suppress_tokens": ([],), "begin_suppress_tokens": ([],),
    "forced_bos_token_id": (), "forced_eos_token_id": (), "min_length": (0,), "min_new_tokens": (0,),
    "stop_strings": ([], ""), "max_time": (), "token_healing": (False,),
}


def unapplied_settings(settings):
    """{name: value} of the settings of a parsed generation_config.json that transformers'
    generate would apply and minillm does not (UNAPPLIED_NEUTRAL; nulls and neutral values left
    out), in the file's order."""
    return {name: value for name, value in settings.items()
            if name in UNAPPLIED_NEUTRAL and value is not None and value not in UNAPPLIED_NEUTRAL[name]}


def settings_text(settings):
    """'num_beams 4, bad_words_ids [[5]]': settings as the file writes them, for one line."""
    return ", ".join(f"{name} {json.dumps(value)}" for name, value in settings.items())


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


def fused(ops, params: SamplingParams):
    """Whether the kernel backend ops draws these settings itself (sample_logits takes top_k
    from 1 to its SAMPLE_MAX_TOP_K), rather than plain torch."""
    return ops is not None and 1 <= params.top_k <= ops.SAMPLE_MAX_TOP_K


def sample(logits, params: SamplingParams, seen=None, ops=None, noise=None):
    """Next token ids (B,) int64 from logits (B, V): argmax when greedy, else a draw from
    softmax(processed scores) through the default generator of the logits' device. ops: the
    model's kernel backend; its `sample_logits` takes top_k from 1 to its SAMPLE_MAX_TOP_K
    (kernels/sampling.py: 128), plain torch (kernels.reference) the rest. noise: a loaded
    KernelNoise for this shape (the caller advances it, append_tokens(noise=)), else q is drawn
    here. A row of logits with a NaN names no token: id V, as the fused argmax
    (kernels/argmax_key.py)."""
    import torch

    import kernels.reference

    if params.greedy:
        return kernels.reference.no_token_if_nan(logits, process_logits(logits, params, seen).argmax(dim=-1))
    if noise is not None:
        q = noise.draw
    else:
        q = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_(1)  # multinomial's
    ops = ops if fused(ops, params) else kernels.reference
    return ops.sample_logits(logits, q, params.top_k, params.temperature, params.top_p, params.repetition_penalty,
                             seen)


class KernelNoise:
    """The noise q of a batch's sampled steps, computed inside the sampler kernel at the drawn
    columns (kernels/noise.py) from the CUDA generator's (seed, offset), which live on the device
    while the steps run: each step's append_tokens advances the offset, and store() hands the
    advance back to torch's generator. The ids, and the generator's state after, are the ones
    drawing q with torch gives, without that (B, V) draw and the two fills a graph replay runs
    for a generator it captured.

    An offset that is not a multiple of 4 (torch never makes one; Generator.set_offset can) is
    taken as the next multiple of 4."""

    def __init__(self, ops, batch, vocab, device):
        import torch

        self.draw = ops.new_exponential_noise(batch * vocab, device)
        self.generator = torch.cuda.default_generators[device.index if device.index is not None
                                                       else torch.cuda.current_device()]
        self.start = None

    @classmethod
    def new(cls, ops, params, batch, vocab, device):
        """A KernelNoise where the sampler can draw in-kernel and this torch's exponential_ is the
        formula's (checked once per shape), else None: q is drawn with torch."""
        if (not KERNEL_NOISE or params.greedy or device.type != "cuda" or not hasattr(ops, "new_exponential_noise")
                or not fused(ops, params) or batch * vocab >= 2 ** 31):
            return None
        if not ops.torch_exponential_matches(device, batch * vocab):
            warnings.warn("minillm: this torch's exponential_ does not draw as kernels/noise.py computes; sampling "
                          "draws its noise with torch instead (slower)", RuntimeWarning, stacklevel=2)
            return None
        return cls(ops, batch, vocab, device)

    def load(self):
        """Take the generator's state: call before the first draw."""
        import torch

        from kernels.noise import seed_bits

        g = self.generator
        self.start = -(-g.get_offset() // 4) * 4
        self.draw.state.copy_(torch.tensor([seed_bits(g.initial_seed()), self.start]))

    def store(self):
        """Advance torch's generator by what the steps since load() drew (syncs)."""
        if self.start is not None:
            used = int(self.draw.state[1]) - self.start
            self.generator.set_offset(self.generator.get_offset() + used)
            self.start = None
