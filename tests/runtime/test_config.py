"""GPTConfig (minillm/config.py): the config.json settings it refuses, and its parameter count."""
import re

import pytest
import torch

from minillm.config import PRESETS, ConfigError, GPTConfig

SMALL = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=64)


@pytest.mark.parametrize("field,value,expected", [
    ("n_head", 0, "an integer >= 1"), ("n_layer", 0, "an integer >= 1"), ("vocab_size", -5, "an integer >= 1"),
    ("n_positions", "1024", "an integer >= 1"), ("n_embd", True, "an integer >= 1"),
    ("layer_norm_epsilon", -1e-5, r"a number in \[0, 1\)"), ("n_inner", 0, "an integer >= 1"),
    ("n_inner", 2.5, "an integer >= 1"),
])
def test_sizes_are_checked(field, value, expected):
    """A size that is no positive integer is named with what was expected (n_head 0 had been a
    ZeroDivisionError); an integer written as 12.0 still reads."""
    with pytest.raises(ConfigError, match=rf"^cfg.json: {field}: expected {expected}, got {value!r}$"):
        GPTConfig.from_hf({**SMALL.to_hf(), field: value}, source="cfg.json")
    assert GPTConfig.from_hf({**SMALL.to_hf(), "n_layer": 2.0}).n_layer == 2


@pytest.mark.parametrize("setting,message", [
    ({"activation_function": "swish"},
     r"activation_function 'swish' is not supported; expected one of \['gelu', 'gelu_new', 'gelu_pytorch_tanh', "
     r"'relu'\]"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=true is not supported"),
    ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn=true is not supported"),
    ({"scale_attn_weights": False}, "scale_attn_weights=false is not supported"),
    ({"n_head": 3}, "n_embd 32 is not divisible by n_head 3"),
])
def test_settings_it_cannot_run_are_refused(setting, message):
    """Each one would change the model's arithmetic, so reading past it would give wrong tokens."""
    with pytest.raises(ConfigError, match=f"^cfg.json: {message}$"):
        GPTConfig.from_hf({**SMALL.to_hf(), **setting}, source="cfg.json")


@pytest.mark.parametrize("setting,message", [
    ({"architectures": 64}, "architectures: expected a list of class names, got 64"),
    ({"architectures": ["GPT2LMHeadModel", 3]}, r"architectures: expected a list of class names, got "
                                                r"\['GPT2LMHeadModel', 3\]"),
    ({"activation_function": ["gelu"]}, r"activation_function \['gelu'\] is not supported"),
    ({"add_cross_attention": "yes"}, "add_cross_attention: expected true or false, got 'yes'"),
])
def test_settings_of_the_wrong_type_are_refused(setting, message):
    """They had raised a bare TypeError (an int is not iterable; a list is unhashable); found by
    fuzzing config.json with values of every JSON type."""
    with pytest.raises(ConfigError, match=f"^cfg.json: {message}"):
        GPTConfig.from_hf({**SMALL.to_hf(), **setting}, source="cfg.json")


def test_those_settings_at_gpt2s_values_read():
    hf = {**SMALL.to_hf(), "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
          "scale_attn_weights": True, "activation_function": "gelu_pytorch_tanh"}
    assert GPTConfig.from_hf(hf) == SMALL


@pytest.mark.parametrize("value,ids", [(7, (7,)), ([7, 9, 7], (7, 9)), ([], ()), (None, ()), ("absent", (50256,))])
def test_eos_token_ids(value, ids):
    """One id, several (each once, in order), or none; GPT-2's where config.json names none."""
    hf = {k: v for k, v in {**SMALL.to_hf(), "eos_token_id": value}.items() if v != "absent"}
    cfg = GPTConfig.from_hf(hf)
    assert cfg.eos_token_ids == ids and cfg.eos_token_id == (ids[0] if ids else None)
    assert GPTConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize("key", ["bos_token_id", "eos_token_id"])
@pytest.mark.parametrize("value", ["50256", 1.5, True, [1, "a"], [[1]], {"id": 1}])
def test_token_ids_that_are_no_ids_are_refused(key, value):
    """Each had been an IndexError, a bare int() error, or silently another id (1.5 read as 1)."""
    with pytest.raises(ConfigError, match=rf"^cfg.json: {key}: expected a token id \(an integer\), a list of them, "
                                          rf"or null, got {re.escape(repr(value))}$"):
        GPTConfig.from_hf({**SMALL.to_hf(), key: value}, source="cfg.json")


def test_generation_config_names_the_eos_ids():
    hf = SMALL.to_hf()
    assert GPTConfig.from_hf(hf, generation={"eos_token_id": [3, 4]}).eos_token_ids == (3, 4)
    assert GPTConfig.from_hf(hf, generation={"max_length": 9}).eos_token_ids == ()
    with pytest.raises(ConfigError, match=r"^gen.json: eos_token_id: expected a token id"):
        GPTConfig.from_hf(hf, generation={"eos_token_id": 2.5}, generation_source="gen.json")


def _hf_count(cfg):
    """transformers' parameter count for the GPT2LMHeadModel of cfg (built on the meta device:
    no memory, so gpt2-xl costs nothing)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(**cfg.to_hf()))
    return sum(p.numel() for p in model.parameters())  # a tied head is one parameter, counted once


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_n_params_of_the_presets(name):
    published = {"distilgpt2": 81_912_576, "gpt2": 124_439_808, "gpt2-medium": 354_823_168,
                 "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200}
    assert PRESETS[name].n_params == published[name] == _hf_count(PRESETS[name])


@pytest.mark.parametrize("tie", [True, False])
def test_n_params_with_an_untied_head(tie):
    cfg = GPTConfig(**{**SMALL.to_dict(), "tie_word_embeddings": tie})
    assert cfg.n_params == _hf_count(cfg) == SMALL.n_params + (0 if tie else 128 * 32)


def test_n_inner():
    """config.json's MLP width: read, counted, written back; null is 4 x n_embd."""
    cfg = GPTConfig.from_hf({**SMALL.to_hf(), "n_inner": 100})
    assert cfg.mlp_width == 100 and GPTConfig.from_hf(cfg.to_hf()) == cfg
    assert cfg.n_params == _hf_count(cfg) == SMALL.n_params - SMALL.n_layer * (128 - 100) * (2 * 32 + 1)
    assert GPTConfig.from_hf({**SMALL.to_hf(), "n_inner": None}).mlp_width == 4 * 32
