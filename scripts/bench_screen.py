"""The screened greedy head (kernels/vocab_screen.py) on rows with outlier dimensions, as trained
models' last layers have (a few dimensions tens of times the rest): how many columns its bound
leaves to compute exactly, and its time, with the row rounded on a grid vocab_screen.ROW_RADIX
times finer than int8's (two int8 digits) and on int8's own (radix 1), against the full head the
engine would run otherwise (kernels.linear with argmax keys: past K = 1024 on tensor cores).
One row, fp16, a 50,257-column head as a GPT-2 checkpoint folds it: wte-like weights (N(0, 0.02),
as transformers initializes them) and ln_f's gain small at the outlier dimensions and raised
elsewhere, so the logits' spread comes from the other dimensions as it does in a plain row.
Times: CUDA graphs of back-to-back calls, inputs rotated past L2 (minillm.benchutil.ms_graph).
Each row's key is checked against the full head's.

    python3 scripts/bench_screen.py --out bench/results
    python3 scripts/bench_screen.py --widths 768 --scales 0 30 --outliers 1 2 --out /tmp/screen
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
from kernels import argmax_key, vocab_fma, vocab_screen  # noqa: E402
from minillm.benchutil import device_slug, environment, ms_graph, require_cuda, rotating  # noqa: E402

N = 50257


def head(K, dims, scale, seed):
    """(x (1, K), wf, bf, colsum): a row whose `dims` are `scale` times the rest's (alternating
    signs; scale 0: a plain row) and the folded head, out-major as the model holds its lm_head."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, K, device="cuda", generator=g)
    w = torch.randn(K, N, device="cuda", generator=g) * 0.02
    gain = torch.ones(K, device="cuda")
    if scale:
        x[0, dims] = scale * torch.tensor([1.0, -1.0] * len(dims), device="cuda")[:len(dims)]
        gain *= (1 + len(dims) * scale ** 2 / K) ** 0.5  # standardizing shrinks the rest by this
        gain[dims] = 1 / scale
    shift = 0.02 * torch.randn(K, device="cuda", generator=g)
    wf, bf, colsum = kernels.fold_layernorm(w.half(), None, gain.half(), shift.half())
    return x.half(), wf.t().contiguous().t(), bf, colsum


def keys():
    return torch.full((1,), argmax_key.EMPTY, dtype=torch.int64, device="cuda")


def measure(K, dims, scale, seed):
    """One row's columns left to compute and the heads' times (us): the screen on int8's grid
    (radix 1) and on ROW_RADIX's, and the full head."""
    x, wf, bf, colsum = head(K, dims, scale, seed)
    full, y = keys(), torch.empty(1, N, dtype=torch.float16, device="cuda")
    engine_max_k, vocab_fma.MAX_K = vocab_fma.MAX_K, max(vocab_fma.MAX_K, K)
    try:  # the CUDA-core head's key and logits, which the screen's exact columns reproduce
        kernels.linear(x, wf, bf, ln_fold=colsum, argmax_keys=full, out=y)
    finally:
        vocab_fma.MAX_K = engine_max_k
    row = {"K": K, "outlier_dims": len(dims) if scale else 0, "scale": scale, "seed": seed}
    screen = kernels.screen_head(wf, bf, colsum)
    default = vocab_screen.ROW_RADIX
    try:
        for taken in (1, default):  # the launcher reads the module's ROW_RADIX at each call
            vocab_screen.ROW_RADIX = taken
            k, upper = keys(), torch.empty(screen.meta.shape[1], dtype=torch.float16, device="cuda")
            kernels.screened_argmax(x, wf, bf, colsum, 1e-5, screen, k, upper=upper)
            if not torch.equal(k, full):
                raise AssertionError(f"K {K} scale {scale} radix {taken}: the screen's key is not the full head's")
            row[f"left_{taken}"] = int((upper[:N].float() >= y.float().max()).sum())
            copies = rotating(lambda: (kernels.screen_head(wf, bf, colsum), wf.clone(), keys()),
                              screen.q.numel() * 4 + wf.numel() * 2)
            row[f"screen_us_{taken}"] = 1e3 * ms_graph([
                (lambda c=c: (c[2].fill_(argmax_key.EMPTY),
                              kernels.screened_argmax(x, c[1], bf, colsum, 1e-5, c[0], c[2]))) for c in copies])
            del copies
    finally:
        vocab_screen.ROW_RADIX = default
    fulls = rotating(lambda: (wf.clone(), keys()), wf.numel() * 2)
    row["full_us"] = 1e3 * ms_graph([(lambda c=c: (c[1].fill_(argmax_key.EMPTY),
                                                   kernels.linear(x, c[0], bf, ln_fold=colsum, argmax_keys=c[1])))
                                     for c in fulls])
    return row


def table(rows):
    t = vocab_screen.ROW_RADIX
    lines = [f"| K | outlier dims | scale | columns left (radix 1 / {t}) | screen us (radix 1 / {t}) | full head us |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['K']} | {r['outlier_dims']} | {r['scale']:g} | {r['left_1']:,} / {r[f'left_{t}']:,} | "
                     f"{r['screen_us_1']:.1f} / {r[f'screen_us_{t}']:.1f} | {r['full_us']:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", type=int, nargs="+", default=[768, 1600], help="K: gpt2 768, gpt2-xl 1600")
    p.add_argument("--scales", type=float, nargs="+", default=[0, 10, 30, 100],
                   help="outlier dimensions' size in the rest's standard deviations (0: a plain row)")
    p.add_argument("--outliers", type=int, nargs="+", default=[1, 3], help="how many outlier dimensions")
    p.add_argument("--seeds", type=int, default=2, help="rows per setting")
    p.add_argument("--out", type=Path, required=True, help="folder for screen-<device>.json and .md")
    args = p.parse_args(argv)
    require_cuda("bench_screen.py")
    if vocab_screen.ROW_RADIX == 1:
        p.error("MINILLM_SCREEN_ROW_RADIX=1: nothing to compare against")
    rows = []
    for K in args.widths:
        for scale in args.scales:
            for n in ([1] if scale == 0 else args.outliers):
                dims = [int(d) for d in torch.randperm(K, generator=torch.Generator().manual_seed(n))[:n]]
                for seed in range(args.seeds):
                    rows.append(measure(K, dims, scale, seed))
                    print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    slug = device_slug()
    (args.out / f"screen-{slug}.json").write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))
    (args.out / f"screen-{slug}.md").write_text(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
