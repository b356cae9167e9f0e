"""Tiny GPT-2 checkpoints built with transformers (random init, fixed seed), never downloaded.

Random init gives near-uniform next-token distributions, where a 1e-6 difference can flip an
argmax. The lm_head is scaled up so the logits are peaked: the parity tests check every step's
top-1/top-2 margin.
"""
import json
import os
import shutil
from pathlib import Path

import torch

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "assets" / "gpt2-tokenizer"


def real_tokenizer_dir():
    d = Path(os.environ.get("MINILLM_TOKENIZER_DIR", TOKENIZER_DIR)).resolve()
    return d if (d / "vocab.json").is_file() else None


def build_checkpoint(path, *, n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=128, seed=0,
                     activation="gelu_new", with_tokenizer=False, peak=50.0, tie=False, dtype=torch.float32,
                     prefix=True, n_inner=None, cross_attention=False):
    """Save a random GPT2LMHeadModel to `path` as safetensors; returns the transformers model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size,
                     n_positions=n_positions, activation_function=activation, tie_word_embeddings=tie, n_inner=n_inner,
                     bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, add_cross_attention=cross_attention,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # peaked logits: a larger lm_head (or final layernorm gain when tied)
        model.transformer.wte.weight.mul_(5.0)  # embeddings and layers contribute alike
        if tie:
            model.transformer.ln_f.weight.mul_(peak / 5.0)
        else:
            model.lm_head.weight.copy_(torch.randn_like(model.lm_head.weight) * peak / n_embd ** 0.5)
        # transformers' init leaves every bias and layernorm shift zero and every gain one, which
        # would leave each one's arithmetic untested: small random values instead (biases of 0.1
        # made every greedy run of the engine tests' model loop over two or three tokens)
        for name, p in model.transformer.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.02)
            elif "ln_" in name:  # h.*.ln_1, h.*.ln_2, ln_f: their gains
                p.copy_(1.0 + torch.randn_like(p) * 0.1)
    model = model.to(dtype)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    if not prefix:  # older checkpoints store keys without "transformer."
        from safetensors.torch import load_file, save_file

        sd = load_file(path / "model.safetensors")
        save_file({k.removeprefix("transformer."): v for k, v in sd.items()}, path / "model.safetensors",
                  metadata={"format": "pt"})
    if with_tokenizer:
        tok = real_tokenizer_dir()
        assert tok is not None and vocab_size >= 50257
        for f in tok.iterdir():
            if f.is_file() and f.suffix in (".json", ".txt"):
                shutil.copy(f, path / f.name)
    return model


def add_generation_settings(path, settings, copy_from=None):
    """The checkpoint at path (copied there from copy_from first, if given) with settings added
    to the generation_config.json save_pretrained wrote; returns path."""
    path = Path(path)
    if copy_from is not None:
        shutil.copytree(copy_from, path, dirs_exist_ok=True)
    gen_file = path / "generation_config.json"
    gen_file.write_text(json.dumps({**json.loads(gen_file.read_text()), **settings}))
    return path


def teacher_forced(model, ids, prompt_len):
    """minillm's logits (len(ids) - prompt_len, V) for ids[prompt_len:], each from the tokens
    before it: the prompt's prefill, then one decode step (no CUDA graph) per later token."""
    dev, cache = model.device, model.new_cache(1)

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=dev)

    out = [model.prefill(torch.tensor([ids[:prompt_len]], device=dev), i32([prompt_len]), cache)[0]]
    for t in range(prompt_len, len(ids) - 1):
        out.append(model.decode(i32([ids[t]]), i32([t]), cache)[0])
    return torch.stack(out).float()


def hf_steps(model, ids, prompt_len):
    """transformers' logits (len(ids) - prompt_len, V) for ids[prompt_len:], as teacher_forced's."""
    with torch.no_grad():
        return model(torch.tensor([ids], device=model.device)).logits[0, prompt_len - 1:-1].float()


def hf_in(model, path, dtype):
    """The transformers model saved at path, in dtype (model itself where that is its dtype)."""
    if model.dtype == dtype:
        return model
    return type(model).from_pretrained(str(path), dtype=dtype).to(model.device).eval()


def hf_generate(model, ids, ignore_eos=True, **kw):
    """transformers' generate on a prompt list, returning only the new ids. With ignore_eos it
    runs past the end-of-sequence token (no stop criterion, no logits masking)."""
    inp = torch.tensor([ids], device=model.device)
    eos = model.generation_config.eos_token_id
    if ignore_eos:
        model.generation_config.eos_token_id = None
    try:
        out = model.generate(inp, attention_mask=torch.ones_like(inp), pad_token_id=model.config.eos_token_id, **kw)
    finally:
        model.generation_config.eos_token_id = eos
    return out[0, len(ids):].tolist()
