"""Loading checkpoints: key layouts, shards, tied heads, and every way a local folder can be wrong
(hub downloads: test_download.py)."""
import json
import re
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from minillm import LLM, ModelLoadError, SamplingParams, UnappliedSettingsWarning
from minillm.config import GPTConfig
from minillm.loader import load_weights, read_config, read_model_settings
from tests.models import add_generation_settings, build_checkpoint, hf_generate

SMALL = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=64)


def _logits(llm, ids):
    lens = torch.tensor([len(ids)], dtype=torch.int32)
    return llm.model.prefill(torch.tensor([ids]), lens, llm.model.new_cache(1), all_logits=True)[0]


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("tie", [True, False])
def test_layouts_load_and_match(tmp_path, prefix, tie):
    hf = build_checkpoint(tmp_path, prefix=prefix, tie=tie, **SMALL)
    with pytest.warns(UserWarning, match="no tokenizer"):
        llm = LLM(str(tmp_path), device="cpu", backend="torch")
    head = llm.model.lm_head[0]  # ln_f folded in: a copy of its own even when tied, out-major (C, V)
    assert head.shape == llm.model.wte.t().shape and head.stride(0) == 1
    assert head.data_ptr() != llm.model.wte.data_ptr()
    ids = [3, 9, 27, 81, 5]
    torch.testing.assert_close(_logits(llm, ids), _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_conv1d_weights_are_used_in_place(tmp_path):
    build_checkpoint(tmp_path, **SMALL)
    w = load_weights(tmp_path, read_config(tmp_path), "cpu", torch.float32)
    assert w["h.0.attn.c_attn.weight"].shape == (32, 96)  # (in, out), no transposed copy


def test_mask_buffers_and_a_tied_heads_copy_are_skipped(tmp_path):
    """The hub's gpt2 file stores each layer's causal-mask buffers (attn.bias, attn.masked_bias), and
    a tied checkpoint may store its head too: none is a weight to load, and the logits stay
    transformers'."""
    hf = build_checkpoint(tmp_path, prefix=False, tie=True, **SMALL)
    sd = load_file(tmp_path / "model.safetensors")
    T = SMALL["n_positions"]
    for i in range(SMALL["n_layer"]):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(T, T)).view(1, 1, T, T)
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    sd["lm_head.weight"] = torch.randn_like(sd["wte.weight"])  # not what the tie reads
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="no tokenizer"):
        llm = LLM(str(tmp_path), device="cpu", backend="torch")
    ids = [3, 9, 27, 81, 5]
    torch.testing.assert_close(_logits(llm, ids), _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_cross_attention_blocks_are_skipped(tmp_path):
    """A GPT-2 decoder with cross-attention blocks (config.json's add_cross_attention): transformers
    generates without encoder states by skipping them, and so does the engine, token by token.
    Without the setting, such tensors are refused as unexpected."""
    hf = build_checkpoint(tmp_path, cross_attention=True, **SMALL)
    assert any("crossattention" in k for k in load_file(tmp_path / "model.safetensors"))
    with pytest.warns(UserWarning, match="no tokenizer"):
        llm = LLM(str(tmp_path), device="cpu", backend="torch")
    ids = [3, 9, 27, 81, 5]
    torch.testing.assert_close(_logits(llm, ids), _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
    got = llm.generate([ids], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    assert got == hf_generate(hf, ids, max_new_tokens=12, do_sample=False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "add_cross_attention": False}))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor transformer\.h\.0\.crossattention\."):
        LLM(str(tmp_path), device="cpu", backend="torch")


def test_sharded_checkpoint(tmp_path):
    hf = build_checkpoint(tmp_path, **SMALL)
    sd = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for f, keys in shards.items():
        save_file({k: sd[k] for k in keys}, tmp_path / f, metadata={"format": "pt"})
        weight_map.update({k: f for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    llm = LLM(str(tmp_path), device="cpu")
    ids = [1, 2, 3]
    torch.testing.assert_close(_logits(llm, ids), _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtypes(tmp_path, dtype):
    build_checkpoint(tmp_path, **SMALL)
    llm = LLM(str(tmp_path), device="cpu", dtype=dtype)
    assert llm.model.wte.dtype == getattr(torch, dtype)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, temperature=0))[0]
    assert len(out.token_ids) >= 1 and out.text is None


def test_truncated_file(tmp_path):
    build_checkpoint(tmp_path, **SMALL)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(str(tmp_path), device="cpu")


def test_garbage_file(tmp_path):
    build_checkpoint(tmp_path, **SMALL)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        LLM(str(tmp_path), device="cpu")


def test_missing_tensor(tmp_path):
    build_checkpoint(tmp_path, **SMALL)
    sd = load_file(tmp_path / "model.safetensors")
    del sd["transformer.h.1.mlp.c_fc.bias"]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"h\.1\.mlp\.c_fc\.bias is missing from model\.safetensors"):
        LLM(str(tmp_path), device="cpu")


def test_wrong_shape(tmp_path):
    build_checkpoint(tmp_path, **SMALL)
    sd = load_file(tmp_path / "model.safetensors")
    sd["transformer.h.0.attn.c_proj.weight"] = torch.zeros(32, 31)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"h\.0\.attn\.c_proj\.weight has shape \(32, 31\), expected \(32, 32\)"):
        LLM(str(tmp_path), device="cpu")


@pytest.mark.parametrize("stored", [torch.int8, torch.bool])
def test_integer_weights_are_refused(tmp_path, stored):
    """A tensor stored as integers (a quantized checkpoint's, without its scales) had been cast to
    floats and run as a wrong model, silently."""
    build_checkpoint(tmp_path, **SMALL)
    sd = load_file(tmp_path / "model.safetensors")
    sd["transformer.h.1.mlp.c_fc.weight"] = (sd["transformer.h.1.mlp.c_fc.weight"] * 100).to(stored)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    name = str(stored).removeprefix("torch.")
    with pytest.raises(ModelLoadError, match=rf"tensor transformer\.h\.1\.mlp\.c_fc\.weight is stored as {name}, "
                       r"expected floating point \(quantized checkpoints are not supported\)$"):
        LLM(str(tmp_path), device="cpu")


@pytest.mark.parametrize("value,dtype", [(float("nan"), "float32"), (1e6, "float16")])
def test_non_finite_weights(tmp_path, value, dtype):
    """A NaN in the file, or a value past float16's range, is named at load: no NaN logits later."""
    build_checkpoint(tmp_path, **SMALL)
    sd = load_file(tmp_path / "model.safetensors")
    sd["transformer.h.1.mlp.c_fc.weight"][3, 5] = value
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=rf"h\.1\.mlp\.c_fc\.weight holds 1 NaN or inf value\(s\) in {dtype}"):
        LLM(str(tmp_path), device="cpu", dtype=dtype)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture LlamaForCausalLM; minillm supports "
                       "model_type 'gpt2' with GPT2LMHeadModel"):
        LLM(str(tmp_path), device="cpu")
    # a GPT-2 architecture under another model_type: the message names what is wrong, not the architecture
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="unsupported model_type 'llama'; minillm supports model_type 'gpt2'"):
        LLM(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": 2}))
    with pytest.raises(ModelLoadError, match="unsupported model_type None; minillm supports"):
        LLM(str(tmp_path), device="cpu")


def test_config_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match=r"config.json: expected a JSON object of settings, got a list$"):
        LLM(str(tmp_path), device="cpu")


def test_bin_only_and_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text(json.dumps(GPTConfig(**{**SMALL}).to_hf()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="only PyTorch .bin weights"):
        LLM(str(tmp_path), device="cpu")


def test_paths_that_are_no_model_folder(tmp_path):
    """A file, or a path that cannot be a hub id, is named as such, not looked up on the hub."""
    (tmp_path / "config.json").write_text("{}")
    cases = [(tmp_path / "config.json", "expected a model folder, got a file"), ("./no-such-dir", "no such folder"),
             (tmp_path / "missing", "no such folder"), ("a/b/c", "no such folder")]
    for path, message in cases:
        with pytest.raises(ModelLoadError, match=f"^{re.escape(str(path))}: {message}$"):
            LLM(str(path), device="cpu")


def test_a_name_under_weights(tmp_path, monkeypatch):
    """A bare name is a folder under ./weights, then under MINILLM_WEIGHTS_DIR's (the repo's
    weights/ by default), before it is taken for a hub id."""
    from minillm import loader

    build_checkpoint(tmp_path / "cwd" / "weights" / "tiny", **SMALL)
    build_checkpoint(tmp_path / "store" / "small", **SMALL)
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setattr(loader, "WEIGHTS_DIR", tmp_path / "store")
    assert loader.resolve("tiny") == tmp_path / "cwd" / "weights" / "tiny"
    assert loader.resolve("small") == tmp_path / "store" / "small"
    with pytest.warns(UserWarning, match="no tokenizer"):
        assert LLM("small", device="cpu").model_dir == tmp_path / "store" / "small"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_checkpoint(path, n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    return path


@pytest.mark.parametrize("generation", [None, {}, {"eos_token_id": None}, {"eos_token_id": 5},
                                        {"eos_token_id": [5, 7]}, {"max_length": 20, "bos_token_id": 63}])
@pytest.mark.parametrize("config_eos", [63, None, [3, 4]])
def test_eos_ids_are_the_ones_transformers_generate_stops_at(tiny_checkpoint, tmp_path, config_eos, generation):
    """generate stops at generation_config.json's eos_token_id where that file is (none where it
    names none: config.json's is then not read), else at config.json's."""
    from transformers import GPT2LMHeadModel

    shutil.copytree(tiny_checkpoint, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": config_eos}))
    gen_file = tmp_path / "generation_config.json"
    gen_file.unlink()
    if generation is not None:
        gen_file.write_text(json.dumps(generation))
    expect = GPT2LMHeadModel.from_pretrained(tmp_path).generation_config.eos_token_id
    expect = () if expect is None else tuple(expect) if isinstance(expect, list) else (expect,)
    assert read_config(tmp_path).eos_token_ids == expect


@pytest.mark.parametrize("text,message", [
    ("[5]", "expected a JSON object of settings, got a list"), ('{"eos_token_id": ', "not a readable JSON file"),
    ('{"eos_token_id": "</s>"}', "eos_token_id: expected a token id \\(an integer\\), a list of them, or null, "
                                 "got '</s>'"),
])
def test_unreadable_generation_config(tiny_checkpoint, tmp_path, text, message):
    shutil.copytree(tiny_checkpoint, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ModelLoadError, match=f"^{re.escape(str(tmp_path))}/generation_config.json: {message}"):
        read_config(tmp_path)


@pytest.mark.parametrize("settings,expect", [
    ({}, {}),  # save_pretrained's file: ids only
    ({"do_sample": True, "temperature": 0.7, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.2,
      "max_new_tokens": 30}, {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.2,
                              "max_new_tokens": 30}),
    ({"do_sample": False, "temperature": 0.7, "top_k": 5}, {"temperature": 0.0, "top_k": 5}),
    ({"do_sample": None, "temperature": None, "top_k": None, "max_new_tokens": None}, {}),  # null: unset
    ({"num_beams": 1, "max_length": 50, "top_p": 1}, {"top_p": 1.0}),  # settings SamplingParams has not: passed over
])
def test_sampling_defaults_from_generation_config(tiny_checkpoint, tmp_path, settings, expect):
    _, got, _ = read_model_settings(add_generation_settings(tmp_path, settings, copy_from=tiny_checkpoint))
    assert got == expect and all(type(got[k]) is type(v) for k, v in expect.items())


def test_no_generation_config_no_sampling_defaults(tiny_checkpoint, tmp_path):
    shutil.copytree(tiny_checkpoint, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").unlink()
    assert read_model_settings(tmp_path)[1:] == ({}, {})


@pytest.mark.parametrize("settings,expect", [
    ({"num_beams": 1, "typical_p": 1.0, "min_p": None, "bad_words_ids": [], "token_healing": False,
      "max_length": 50, "forced_bos_token_id": None}, {}),  # neutral, null, or length: nothing to say
    ({"num_beams": 4, "no_repeat_ngram_size": 3, "top_k": 5}, {"num_beams": 4, "no_repeat_ngram_size": 3}),
    ({"bad_words_ids": [[5], [7, 8]], "min_new_tokens": 2, "typical_p": 0.9, "token_healing": True},
     {"bad_words_ids": [[5], [7, 8]], "min_new_tokens": 2, "typical_p": 0.9, "token_healing": True}),
    ({"suppress_tokens": [1], "forced_eos_token_id": 0, "min_p": 0.05, "stop_strings": ["\n"]},
     {"suppress_tokens": [1], "forced_eos_token_id": 0, "min_p": 0.05, "stop_strings": ["\n"]}),
])
def test_settings_minillm_does_not_apply_are_named(tiny_checkpoint, tmp_path, settings, expect):
    """Settings with which transformers' generate would pick other tokens, and minillm does not
    apply, are named: LLM.unapplied_settings and one warning at load; neutral values are not."""
    path = add_generation_settings(tmp_path, settings, copy_from=tiny_checkpoint)
    assert read_model_settings(path)[2] == expect
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(str(path), device="cpu")
    assert llm.unapplied_settings == expect
    said = [str(w.message) for w in caught if "does not apply" in str(w.message)]
    assert all(w.category is UnappliedSettingsWarning for w in caught if "does not apply" in str(w.message))
    if expect:
        text = ", ".join(f"{k} {json.dumps(v)}" for k, v in expect.items())
        assert said == [f"{path}/generation_config.json: minillm does not apply {text} (transformers' generate "
                        "would)"]
    else:
        assert said == []


@pytest.mark.parametrize("settings,message", [
    ({"top_k": -1}, "top_k: expected an integer >= 0, got -1"),
    ({"top_k": 40.5}, "top_k: expected an integer >= 0, got 40.5"),
    ({"temperature": "hot"}, "temperature: expected a number >= 0, got 'hot'"),
    ({"top_p": 0}, "top_p: expected a number in \\(0, 1\\], got 0"),
    ({"max_new_tokens": 0}, "max_new_tokens: expected an integer >= 1, got 0"),
    ({"do_sample": "yes"}, "do_sample: expected true, false or null, got 'yes'"),
])
def test_bad_sampling_settings_are_refused_at_load(tiny_checkpoint, tmp_path, settings, message):
    path = add_generation_settings(tmp_path, settings, copy_from=tiny_checkpoint)
    pattern = f"^{re.escape(str(path))}/generation_config.json: {message}$"
    with pytest.raises(ModelLoadError, match=pattern):
        read_model_settings(path)
    with pytest.raises(ModelLoadError, match=pattern):
        LLM(str(path), device="cpu")


def test_default_params_and_explicit_params(tiny_checkpoint, tmp_path):
    """A call without params takes the model's settings; default_params(**overrides) puts the
    caller's on top of them; a SamplingParams given is run as it is, the model's settings unread."""
    path = add_generation_settings(tmp_path, {"do_sample": False, "max_new_tokens": 3, "top_k": 7},
                                   copy_from=tiny_checkpoint)
    with pytest.warns(UserWarning, match="no tokenizer"):
        llm = LLM(str(path), device="cpu")
    assert llm.default_params() == SamplingParams(max_new_tokens=3, temperature=0.0, top_k=7)
    assert llm.default_params(max_new_tokens=5, seed=1) == SamplingParams(max_new_tokens=5, temperature=0.0,
                                                                           top_k=7, seed=1)
    prompt = [1, 2, 3]
    assert len(llm.generate(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))[0].token_ids) == 2
    (alone,) = llm.generate(prompt)
    assert alone.token_ids == llm.generate(prompt, SamplingParams(max_new_tokens=3, temperature=0))[0].token_ids
    assert len(alone.token_ids) == 3 or alone.finish_reason == "stop"


def test_heads_too_wide_for_the_triton_backend_are_refused_before_loading(tmp_path, monkeypatch):
    """The check runs on config.json alone: this folder has no weights to load."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (tmp_path / "config.json").write_text(json.dumps(GPTConfig(n_layer=1, n_head=2, n_embd=528).to_hf()))
    with pytest.raises(ValueError, match=r"^backend: triton's attention takes heads up to 256 wide, and this model's "
                                         r"are 264 \(n_embd 528 / n_head 2\); backend torch runs it$"):
        LLM(str(tmp_path), device="cpu", backend="triton")
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        LLM(str(tmp_path), device="cpu", backend="torch")


def test_config_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text('{"n_layer": 2,')
    with pytest.raises(ModelLoadError, match=r"config.json: not a readable JSON file \(Expecting property name"):
        LLM(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff")  # not text at all
    with pytest.raises(ModelLoadError, match=r"config.json: not a readable JSON file \('utf-8' codec can't decode"):
        LLM(str(tmp_path), device="cpu")


@pytest.mark.parametrize("index", ["{", "[]", "{}", '{"weight_map": []}', '{"weight_map": {}}',
                                   '{"weight_map": {"wte.weight": 3}}', '{"weight_map": {"wte.weight": ""}}'])
def test_unreadable_shard_index(tmp_path, index):
    """Each had been an AttributeError, a TypeError, or "tensor wte.weight is missing from " (no file)."""
    build_checkpoint(tmp_path, **SMALL)
    (tmp_path / "model.safetensors.index.json").write_text(index)
    expected = ("not a readable JSON file" if index == "{"
                else 'expected a "weight_map" object from tensor names to shard')
    with pytest.raises(ModelLoadError, match=rf"model.safetensors.index.json: {expected}"):
        LLM(str(tmp_path), device="cpu")


def test_missing_shard_and_weights(tmp_path):
    build_checkpoint(tmp_path, **SMALL)
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00002.safetensors")
    folder = re.escape(str(tmp_path))
    with pytest.raises(ModelLoadError, match=rf"^{folder}: no model.safetensors or model.safetensors.index.json$"):
        LLM(str(tmp_path), device="cpu")
    names = {"wte.weight": "model-00001-of-00002.safetensors", "h.0.ln_1.weight": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    with pytest.raises(ModelLoadError, match="index.json: shard model-00002-of-00002.safetensors is missing$"):
        LLM(str(tmp_path), device="cpu")


def test_tensor_of_a_deeper_model_is_refused(tmp_path):
    """Weights of three layers under a config of two are not silently cut to two."""
    build_checkpoint(tmp_path, **SMALL)
    sd = load_file(tmp_path / "model.safetensors")
    sd["transformer.h.2.ln_1.weight"] = torch.randn(32)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"unexpected tensor transformer\.h\.2\.ln_1\.weight for a 2-layer GPT-2$"):
        LLM(str(tmp_path), device="cpu")


def test_bad_arguments(tmp_path):
    build_checkpoint(tmp_path, **SMALL)
    with pytest.raises(ValueError, match="dtype: expected one of"):
        LLM(str(tmp_path), device="cpu", dtype="int8")
    with pytest.raises(ValueError, match="backend: expected one of"):
        LLM(str(tmp_path), device="cpu", backend="cuda")
    with pytest.raises(ValueError, match="device: expected 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        LLM(str(tmp_path), device="tpu")
    with pytest.raises(ValueError, match="cuda_graphs: expected True, False or None"):
        LLM(str(tmp_path), device="cpu", cuda_graphs="yes")
