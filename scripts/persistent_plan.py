"""The host side of scripts/bench_persistent.py: the step's phases, where each activation lives,
every program's list of tile descriptors, and the same step in torch."""
import math

import torch

IDLE, GEMV, ATTEND = 0, 1, 2  # what a descriptor asks of its program
LAST_K, RESID = 1, 2  # descriptor flags
# fields: kind, w_off, ldw, in_off, out_off, res_off, n_valid << 16 | k_valid,
# flags | phase << 4 | (the residual's phase + 1) << 16
NF = 8


def phases(cfg):
    """The step's phases in order: ("gemv", name, N, K, input, output, residual or None) with
    activations named (layer, what), or ("attend", layer)."""
    C = cfg.n_embd
    out = []
    for i in range(cfg.n_layer):
        out += [("gemv", "qkv", 3 * C, C, (i, "x"), (i, "qkv"), None), ("attend", i),
                ("gemv", "attn-out", C, C, (i, "att"), (i, "xm"), (i, "x")),
                ("gemv", "fc", 4 * C, C, (i, "xm"), (i, "h"), None),
                ("gemv", "mlp-out", C, 4 * C, (i, "h"), (i + 1, "x"), (i, "xm"))]
    return out + [("gemv", "lm_head", cfg.vocab_size, C, (cfg.n_layer, "x"), (cfg.n_layer, "logits"), None)]


def act_offsets(cfg):
    """Offset of every activation in one buffer of tagged words (each written once a step), and
    the buffer's size."""
    C, widths = cfg.n_embd, {"x": cfg.n_embd, "qkv": 3 * cfg.n_embd, "att": cfg.n_embd, "xm": cfg.n_embd,
                             "h": 4 * cfg.n_embd}
    offs, at = {}, 0
    for i in range(cfg.n_layer):
        for name, width in widths.items():
            offs[(i, name)], at = at, at + width
    offs[(cfg.n_layer, "x")], offs[(cfg.n_layer, "logits")] = at, at + C
    return offs, at + C + cfg.vocab_size


def plan(cfg, programs, tn, tk, positions):
    """(descriptors (programs, max + 2, NF) int32, counts (programs,), weight offsets by phase,
    number of phases): each program's tiles in phase order, two idle descriptors last."""
    if programs > cfg.n_embd:  # the epoch's rule needs every program in the last layer's mlp-out
        raise ValueError(f"programs: expected at most n_embd ({cfg.n_embd}), got {programs}")
    acts, _ = act_offsets(cfg)
    D, H = cfg.head_dim, cfg.n_head
    res_phase = {(i, "x"): 5 * i - 1 for i in range(cfg.n_layer)} | {(i, "xm"): 5 * i + 2 for i in range(cfg.n_layer)}
    lists = [[] for _ in range(programs)]
    w_at, w_offs, steps = 0, [], phases(cfg)
    for j, ph in enumerate(steps):
        for p in range(programs):
            if ph[0] == "attend":
                layer = ph[1]
                for h in range(p, H, programs):
                    c_off = ((layer * H + h) * 2) * positions * D
                    lists[p].append([ATTEND, c_off, positions, acts[(layer, "qkv")] + h * D,
                                     acts[(layer, "att")] + h * D, 0, 0, j << 4])
                continue
            _, _, N, K, src, dst, res = ph
            lo, hi = N * p // programs, N * (p + 1) // programs
            for n0 in range(lo, hi, tn):
                for k0 in range(0, K, tk):
                    meta = (LAST_K if k0 + tk >= K else 0) | (RESID if res else 0) | j << 4
                    meta |= (res_phase[res] + 1) << 16 if res else 0
                    lists[p].append([GEMV, w_at + n0 * K + k0, K, acts[src] + k0, acts[dst] + n0,
                                     acts[res] + n0 if res else 0, min(tn, hi - n0) << 16 | min(tk, K - k0), meta])
        if ph[0] == "gemv":
            w_offs.append(w_at)
            w_at += ph[2] * ph[3]
    if any(d[0] == GEMV and (d[1] % 8 or d[2] % 8) for lst in lists for d in lst):
        raise ValueError("every layer width must be a multiple of 8 (the kernel's 16-byte loads)")
    counts = [len(lst) for lst in lists]
    desc = torch.zeros(programs, max(counts) + 2, NF, dtype=torch.int32)  # two idle ones last
    for p, lst in enumerate(lists):
        desc[p, :len(lst)] = torch.tensor(lst, dtype=torch.int32)
    return desc, torch.tensor(counts, dtype=torch.int32), w_offs, len(steps)


def weight_count(cfg):
    """Elements of every linear's weights, one after the other in the step's order."""
    return sum(ph[2] * ph[3] for ph in phases(cfg) if ph[0] == "gemv")


def weight_views(cfg, weights, w_offs):
    """Each linear's (N, K) out-major view of the flat weights, in the step's order."""
    return [weights[o:o + ph[2] * ph[3]].view(ph[2], ph[3])
            for o, ph in zip(w_offs, (p for p in phases(cfg) if p[0] == "gemv"))]


def reference(cfg, weights, w_offs, cache, x, positions):
    """The same step in torch (fp32 over the fp16 weights): (final x, logits)."""
    D, H = cfg.head_dim, cfg.n_head
    mats = iter(w.float() for w in weight_views(cfg, weights, w_offs))
    kv = cache.view(cfg.n_layer, H, 2, positions, D).float()
    for i in range(cfg.n_layer):
        q = (next(mats) @ x)[:H * D].view(H, D)
        s = torch.einsum("hd,hpd->hp", q, kv[i, :, 0]) / math.sqrt(D)
        att = torch.einsum("hp,hpd->hd", s.softmax(-1), kv[i, :, 1]).reshape(-1)
        x = x + next(mats) @ att
        h = next(mats) @ x  # fc
        x = x + next(mats) @ h  # mlp-out
    return x, next(mats) @ x
