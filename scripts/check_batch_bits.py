"""Is a sequence's arithmetic independent of its batch? Logits of one prompt run alone and as
row 20 of a batch of 64 (right-padded, as the engine batches), compared bit for bit: at the
prompt's last position after prefill, then over teacher-forced decode steps (both runs are fed
the same tokens, so a difference is arithmetic, not a diverged sequence). Prints the steps whose
logits differ, the largest difference, and whether the argmax ever differs.

    python3 scripts/check_batch_bits.py --model gpt2 --steps 64
    python3 scripts/check_batch_bits.py --model gpt2 --kernels   # each decode kernel on its own
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm.bench import model_weights  # noqa: E402
from minillm.benchutil import require_cuda  # noqa: E402
from minillm.config import PRESETS  # noqa: E402
from minillm.generate import Engine  # noqa: E402
from minillm.model import GPT, out_major  # noqa: E402

ROW = 20
MAX_LEN = 256  # cache positions decode attention splits over (the benchmark's bucket)


def prefill(model, prompts, cache):
    """The engine's own batched prefill (right-padded) into cache; returns logits (B, V)."""
    return Engine(model, use_cuda_graphs=False).prefill(prompts, cache)[0]


def run(model, prompts, steps, feed, max_len, separate_prefill=False):
    """Logits of row ROW (or 0 alone) at prefill and at each fed decode step: (steps + 1, V).
    separate_prefill: every prompt is prefilled alone and its cache rows copied into the batch's
    cache, so that the decode steps are the only batched arithmetic."""
    B = len(prompts)
    row = ROW if B > 1 else 0
    dev = model.device
    cache = model.new_cache(B)
    if separate_prefill:
        one = model.new_cache(1)
        for b, p in enumerate(prompts):
            logits = prefill(model, [p], one)
            cache.k[:, b], cache.v[:, b] = one.k[:, 0], one.v[:, 0]
            if b == row:
                first = logits[0].float().clone()
    else:
        first = prefill(model, prompts, cache)[row].float().clone()
    out = [first]
    pos = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=dev)
    for t in range(steps):
        tokens = torch.full((B,), int(feed[t]), dtype=torch.int32, device=dev)
        out.append(model.decode(tokens, pos, cache, max_len)[row].float().clone())
        pos += 1
    return torch.stack(out)


def kernel_checks(cfg, dtype):
    """Each decode kernel at the model's shapes, as the model calls it (out-major weights,
    statistics only where kernels.decode_row_stats gives a buffer): row 0 of a 64-row launch
    against a 1-row launch."""
    import kernels

    C, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
    dev = "cuda"
    r = lambda *shape: torch.randn(*shape, device=dev).to(dtype)  # noqa: E731
    results = {}
    x, res = r(64, C), r(64, C)
    g, b = r(C).abs() + 0.5, r(C)
    stats = kernels.new_row_stats(64, C, dev)
    kernels.linear(r(64, C), r(C, C) / C ** 0.5, residual=x.clone(), out=x, stats_out=stats)  # x and its stats
    for name, (K, N), kw in (("qkv", (C, 3 * C), dict(ln=True)), ("attn-out", (C, C), dict(res=True)),
                             ("fc", (C, 4 * C), dict(ln=True, act=True)), ("mlp-out", (4 * C, C), dict(res=True)),
                             ("lm_head", (C, cfg.vocab_size), dict(ln=True, head=True))):
        w = out_major(r(K, N) / K ** 0.5)  # as the model holds them (the lm_head: wte read transposed)
        bias = None if kw.get("head") else r(N)
        colsum = None
        if kw.get("ln"):  # the layernorm folded in, as the model holds it
            w, bias, colsum = kernels.fold_layernorm(w, bias, g, b)
        inp = x if K == C else r(64, K)
        outs = {}
        for M in (1, 64):
            wanted = kernels.decode_row_stats(M, C, dev) is not None  # the model's choice at M rows
            so = kernels.new_row_stats(M, N, dev) if kw.get("res") and wanted else None
            args = dict(activation="gelu_tanh" if kw.get("act") else None,
                        residual=res[:M, :N].contiguous() if kw.get("res") and N == C else None, stats_out=so)
            if kw.get("ln"):
                args.update(ln_fold=colsum, ln_stats=stats[:M] if wanted else None)
            y = kernels.linear(inp[:M].contiguous(), w, bias, **args)
            outs[M] = (y[0], so[0] if so is not None else None)
        same = torch.equal(outs[1][0], outs[64][0])
        same_stats = outs[1][1] is None or torch.equal(outs[1][1], outs[64][1])
        results[name] = (same, same_stats, (outs[1][0].float() - outs[64][0].float()).abs().max().item())
    for L in (128, 256, 1024):
        kc, vc = r(64, H, L, D), r(64, H, L, D)
        q, kn, vn = r(64, H, D), r(64, H, D), r(64, H, D)
        lens = torch.full((64,), L - 7, dtype=torch.int32, device=dev)
        one = kernels.decode_attention(q[:1], kc[:1].clone(), vc[:1].clone(), lens[:1], k_new=kn[:1], v_new=vn[:1])
        full = kernels.decode_attention(q, kc.clone(), vc.clone(), lens, k_new=kn, v_new=vn)
        results[f"decode attention L={L}"] = (torch.equal(one[0], full[0]), True,
                                              (one[0].float() - full[0].float()).abs().max().item())
    for name, (same, same_stats, diff) in results.items():
        print(f"  {name:<24} row bit-identical at 1 and 64 rows: {same}; statistics: {same_stats}; "
              f"max |difference| {diff:.3e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", choices=sorted(PRESETS), help="preset (random weights), default gpt2")
    ap.add_argument("--steps", type=int, default=64, help="decode steps (default 64)")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--kernels", action="store_true", help="check each decode kernel on its own instead")
    args = ap.parse_args()
    if not 1 <= args.steps <= MAX_LEN - 60:  # prompts are up to 59 tokens
        ap.error(f"--steps: expected 1 to {MAX_LEN - 60} (the cache holds {MAX_LEN} positions), got {args.steps}")
    require_cuda("check_batch_bits")
    torch.manual_seed(0)
    if args.kernels:
        print(f"{args.model} {args.dtype}: decode kernels at 1 and 64 rows")
        with torch.inference_mode():
            kernel_checks(PRESETS[args.model], getattr(torch, args.dtype))
        return
    cfg, weights = model_weights(args.model, "cuda", getattr(torch, args.dtype))
    model = GPT(cfg, weights)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 60, (64,), generator=gen)]
    feed = torch.randint(0, cfg.vocab_size, (args.steps,), generator=gen).tolist()
    with torch.inference_mode():
        alone = run(model, [prompts[ROW]], args.steps, feed, MAX_LEN)
        for label, separate in (("batched prefill", False), ("each prompt prefilled alone", True)):
            batch = run(model, prompts, args.steps, feed, MAX_LEN, separate)
            diff = (alone - batch).abs().amax(dim=1)
            differ = [i for i, d in enumerate(diff.tolist()) if d > 0]
            argmax = (alone.argmax(1) != batch.argmax(1)).nonzero().flatten().tolist()
            print(f"{args.model} {args.dtype}, {label}: prompt of {len(prompts[ROW])} tokens alone vs row {ROW} "
                  f"of 64; prefill + {args.steps} decode steps")
            print(f"  bit-identical logits: {len(diff) - len(differ)} of {len(diff)} (step 0 is the prefill)")
            print(f"  steps that differ: {differ[:12]}{' ...' if len(differ) > 12 else ''}")
            print(f"  largest |difference|: {diff.max().item():.3e}; argmax differs at steps: {argmax[:12]}")


if __name__ == "__main__":
    main()
