"""Model configuration: a dataclass read from a Hugging Face config.json, with named presets."""
from dataclasses import asdict, dataclass

from .checks import is_integer, is_real

SUPPORTED_ARCHITECTURES = ("GPT2LMHeadModel",)
SUPPORTED_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                         "relu": "relu"}


class ConfigError(ValueError):
    """config.json describes a model this engine cannot run."""


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_positions: int = 1024
    vocab_size: int = 50257
    layer_norm_epsilon: float = 1e-5
    n_inner: int | None = None  # the MLP's width; None: 4 * n_embd
    activation: str = "gelu_tanh"  # a kernels.ACTIVATIONS name
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 50256
    # every id that ends a sequence, as transformers' generate takes them (its generation config's,
    # else config.json's); () where there is none: generation runs to max_new_tokens
    eos_token_ids: tuple[int, ...] = (50256,)
    # a decoder with cross-attention blocks (EncoderDecoderModel's): transformers' generate skips
    # them without encoder states, so the loader passes over their tensors
    add_cross_attention: bool = False

    @property
    def eos_token_id(self):
        """The first end-of-sequence id (None: none), as transformers' config names one."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def mlp_width(self):
        return self.n_inner or 4 * self.n_embd

    @property
    def n_params(self):
        """Parameter count with the tied lm_head counted once."""
        C, V, F = self.n_embd, self.vocab_size, self.mlp_width
        per_layer = 4 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * F + F) + (F * C + C)
        head = 0 if self.tie_word_embeddings else V * C
        return V * C + self.n_positions * C + self.n_layer * per_layer + 2 * C + head

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_hf(cls, hf: dict, source="config.json", generation=None,
                generation_source="generation_config.json"):
        """Build from a parsed Hugging Face GPT-2 config.json; unsupported models raise ConfigError.
        generation: the parsed generation_config.json beside it, if any. Where there is one,
        transformers' generate stops at its eos_token_id alone (none where it names none), and so
        does this engine."""
        archs = hf.get("architectures") or []
        archs = [archs] if isinstance(archs, str) else archs  # a hand-written config's one name
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ConfigError(f"{source}: architectures: expected a list of class names, got {archs!r}")
        model_type = hf.get("model_type")
        if archs and not set(archs) & set(SUPPORTED_ARCHITECTURES):
            got = f"architecture {', '.join(archs)}"
        elif model_type != "gpt2":  # the architecture alone does not say a config is GPT-2's
            got = f"model_type {model_type!r}"
        else:
            got = None
        if got:
            raise ConfigError(f"{source}: unsupported {got}; minillm supports model_type 'gpt2' with "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)} (gpt2, gpt2-medium, gpt2-large, gpt2-xl, "
                              "distilgpt2)")
        act = hf.get("activation_function", "gelu_new")
        if not isinstance(act, str) or act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(f"{source}: activation_function {act!r} is not supported; "
                              f"expected one of {sorted(SUPPORTED_ACTIVATIONS)}")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if hf.get(flag):
                raise ConfigError(f"{source}: {flag}=true is not supported")
        if not hf.get("scale_attn_weights", True):
            raise ConfigError(f"{source}: scale_attn_weights=false is not supported")
        cross = hf.get("add_cross_attention", False)
        if not isinstance(cross, bool):
            raise ConfigError(f"{source}: add_cross_attention: expected true or false, got {cross!r}")
        n_embd, n_head = _size(hf, "n_embd", 768, source), _size(hf, "n_head", 12, source)
        if n_embd % n_head:
            raise ConfigError(f"{source}: n_embd {n_embd} is not divisible by n_head {n_head}")
        bos = _token_ids(hf, "bos_token_id", source)
        eos = _token_ids(hf, "eos_token_id", source)
        if generation is not None:
            eos = _token_ids(generation, "eos_token_id", generation_source, default=None)
        return cls(
            n_layer=_size(hf, "n_layer", 12, source), n_head=n_head, n_embd=n_embd,
            n_positions=_size(hf, "n_positions" if "n_positions" in hf else "n_ctx", 1024, source),
            vocab_size=_size(hf, "vocab_size", 50257, source),
            layer_norm_epsilon=_epsilon(hf.get("layer_norm_epsilon", 1e-5), source),
            n_inner=None if hf.get("n_inner") is None else _size(hf, "n_inner", None, source),
            activation=SUPPORTED_ACTIVATIONS[act],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            bos_token_id=bos[0] if bos else None, eos_token_ids=eos, add_cross_attention=cross,
        )

    def to_hf(self):
        """The config.json fields transformers needs to build the same GPT2LMHeadModel."""
        act = {v: k for k, v in SUPPORTED_ACTIVATIONS.items() if k != "gelu_pytorch_tanh"}[self.activation]
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": self.n_layer,
                "n_head": self.n_head, "n_embd": self.n_embd, "n_positions": self.n_positions,
                "vocab_size": self.vocab_size, "layer_norm_epsilon": self.layer_norm_epsilon, "n_inner": self.n_inner,
                "activation_function": act, "tie_word_embeddings": self.tie_word_embeddings,
                "bos_token_id": self.bos_token_id,
                "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_id,
                "add_cross_attention": self.add_cross_attention}


def _size(hf, key, default, source):
    """A size from config.json: a positive integer (JSON may write it as 12.0)."""
    value = hf.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not is_integer(value) or value < 1:
        raise ConfigError(f"{source}: {key}: expected an integer >= 1, got {value!r}")
    return value


def _token_ids(hf, key, source, default=50256):
    """A special token's ids: an id, a list of them (transformers stops at any of several
    end-of-sequence ids), or null for none; default where the key is absent (GPT-2's 50256)."""
    value = hf.get(key, default)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(is_integer(t) for t in ids):
        raise ConfigError(f"{source}: {key}: expected a token id (an integer), a list of them, or null, "
                          f"got {value!r}")
    return tuple(dict.fromkeys(int(t) for t in ids))  # in order, each once


def _epsilon(value, source):
    if not is_real(value) or not 0 <= value < 1:
        raise ConfigError(f"{source}: layer_norm_epsilon: expected a number in [0, 1), got {value!r}")
    return float(value)


# the GPT-2 family as published on the Hugging Face hub
PRESETS = {
    "distilgpt2": GPTConfig(n_layer=6, n_head=12, n_embd=768),
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
}
