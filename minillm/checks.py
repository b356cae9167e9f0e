"""What a generation call checks on the host: that prompt plus new tokens fit the context before
anything runs, and that every id it hands back names a token; the type checks the arguments share."""
import math
import numbers


class MiniLLMError(RuntimeError):
    """A runtime problem with one clear message (the CLI prints it as one line)."""


class ContextLengthError(ValueError):
    """Prompt plus new tokens do not fit the model's context."""


class NonFiniteLogitsError(RuntimeError):
    """A step's logits (or sampling scores) were not finite, so it named no token."""


class UnappliedSettingsWarning(UserWarning):
    """The model's generation_config.json names settings transformers' generate would apply and
    minillm does not (LLM.unapplied_settings); a class of its own so a caller can filter it."""


def check_context(prompt_len, max_new_tokens, n_positions):
    """The last new token is never fed back, so prompt + max_new_tokens - 1 positions are used."""
    if prompt_len > n_positions:
        raise ContextLengthError(
            f"prompt of {count(prompt_len)} is longer than the model's context of {n_positions} positions "
            f"(with max_new_tokens {max_new_tokens}, at most {count(max(n_positions - max_new_tokens + 1, 0))})")
    if prompt_len + max_new_tokens - 1 > n_positions:
        raise ContextLengthError(
            f"prompt of {count(prompt_len)} + max_new_tokens {max_new_tokens} exceeds "
            f"the model's context of {n_positions} positions "
            f"(at most {count(n_positions - prompt_len + 1, 'new token')} for this prompt)")


def is_integer(x):
    """An integer that is not a bool (True is no count): an int, or a numpy integer scalar (the
    numbers ABCs hold numpy's scalar types; numpy's bool is no Integral)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x):
    """A finite real number that is not a bool: an int or float, or a numpy scalar of either."""
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int past float's range
        return False


def count(n, noun="token"):
    """'1 token', '2 tokens': a count with its noun."""
    return f"{n} {noun}{'s' * (n != 1)}"


def check_vocab(out, vocab_size, first=0):
    """Every generated id (lists per sequence, from new token `first` on) lies in the
    vocabulary. A row of logits with a NaN names no token (id V: kernels/argmax_key.py,
    sampling.sample), as does a sampled row whose scores reach +inf: say so, rather than decode
    an id picked from NaN."""
    for b, ids in enumerate(out):
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise NonFiniteLogitsError(
                f"sequence {b}, new token {first + bad}: id {ids[bad]} is outside the vocabulary of {vocab_size} "
                "(the model's logits were NaN, or infinite after a temperature or repetition penalty too small "
                "for them; check the checkpoint's weights and the dtype, or those settings)")
