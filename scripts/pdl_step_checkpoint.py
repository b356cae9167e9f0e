"""A real GPT-2 checkpoint in scripts/probe_pdl_step.py's layout, with what transformers makes of
it: the probe's step then computes GPT-2's next token, checked against transformers' logits
instead of its own torch step.

transformers runs the model on `positions` prompt tokens and then on those and one more; the
prompt's keys and values (taken from each layer's c_attn output, which holds across
transformers' cache classes) are the probe's caches, the next token's embedding its x0, and
the last position's logits what the step must give.
"""
import torch

from minillm.config import GPTConfig
from minillm.loader import read_config


def checkpoint_step(model_dir, positions, device, seed=0):
    """(cfg, slabs, shapes, params, offs, final, caches, x0, logits) for `model_dir`'s model: the
    weights as probe_common.weights lays them out (fp16; slab 0 every K = C linear and the
    head, slab 1 mlp-out), the layernorms and biases as probe_pdl_step.step_params does (fp32),
    the caches as probe_common.make_caches (fp16, one spare row), transformers' fp32 logits."""
    from transformers import GPT2LMHeadModel

    cfg: GPTConfig = read_config(model_dir)
    if cfg.activation != "gelu_tanh":
        raise ValueError(f"--checkpoint: the step computes GPT-2's tanh GELU, the model uses {cfg.activation}")
    if positions + 1 > cfg.n_positions:
        raise ValueError(f"--positions: the model takes at most {cfg.n_positions - 1}, got {positions}")
    model = GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    C, L = cfg.n_embd, cfg.n_layer
    blocks = model.transformer.h
    # Conv1D keeps (in, out): a linear's rows are its weight's columns
    rows0, rows1, shapes, at = [], [], [], [0, 0]
    for blk in blocks:
        for w, slab in ((blk.attn.c_attn.weight, 0), (blk.attn.c_proj.weight, 0), (blk.mlp.c_fc.weight, 0),
                        (blk.mlp.c_proj.weight, 1)):
            (rows0 if slab == 0 else rows1).append(w.t())
            shapes.append((slab, at[slab], w.shape[1], w.shape[0]))
            at[slab] += w.shape[1]
    shapes.append((0, at[0], cfg.vocab_size, C))
    rows0.append(model.lm_head.weight)
    slabs = [torch.cat(rows).to(device, torch.float16).contiguous() for rows in (rows0, rows1)]
    pieces, offs, p_at = [], [], 0
    for blk in blocks:
        layer = {}
        for name, t in (("ln1_w", blk.ln_1.weight), ("ln1_b", blk.ln_1.bias), ("ln2_w", blk.ln_2.weight),
                        ("ln2_b", blk.ln_2.bias), ("qkv", blk.attn.c_attn.bias), ("attn_out", blk.attn.c_proj.bias),
                        ("fc", blk.mlp.c_fc.bias), ("mlp_out", blk.mlp.c_proj.bias)):
            layer[name], p_at = p_at, p_at + t.numel()
            pieces.append(t)
        offs.append(layer)
    final = {"ln_w": p_at, "ln_b": p_at + C}
    pieces += [model.transformer.ln_f.weight, model.transformer.ln_f.bias]
    params = torch.cat([t.detach().float() for t in pieces]).to(device)

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, positions + 1), generator=g)
    kv = []
    hooks = [blk.attn.c_attn.register_forward_hook(lambda m, i, out: kv.append(out[0].detach()))
             for blk in blocks]
    with torch.no_grad():
        model(ids[:, :positions])
        for h in hooks:
            h.remove()
        logits = model(ids).logits[0, -1]
        x0 = model.transformer.wte.weight[ids[0, -1]] + model.transformer.wpe.weight[positions]
    caches = []
    for qkv in kv:  # (positions, 3C): q, k, v; one spare row for the step's own key and value
        spare = torch.zeros(1, C)
        caches.append(tuple(torch.cat([part, spare]).to(device, torch.float16)
                            for part in (qkv[:, C:2 * C], qkv[:, 2 * C:])))
    assert len(caches) == L
    return cfg, slabs, shapes, params, offs, final, caches, x0.float().to(device), logits.float().to(device)
