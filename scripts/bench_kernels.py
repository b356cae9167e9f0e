"""Benchmark every kernel against torch eager, torch.compile and cuBLAS / SDPA on a GPU.

Every kernel and baseline is timed the same way: calls captured back to back in a CUDA graph,
median over replays, warm-up (autotuning, compilation) excluded, so launch overhead stays out as
it does in the engine's decode graph. Memory-bound kernels cycle through enough input copies to
stream 256 MB per round (their data never sits in L2) and report GB/s and the fraction of the
device's copy bandwidth measured in the same run; matmul and attention report TFLOP/s.
Writes kernels-<device>.json and a PNG chart, and prints a table.

    python3 scripts/bench_kernels.py --out bench/results
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
from minillm.benchutil import copy_bandwidth, device_slug, environment, ms_graph, require_cuda, rotating  # noqa: E402

GPT2_LINEAR = [  # (name, K, N) for every GPT-2-family projection at decode (M = 1)
    ("gpt2 qkv", 768, 2304), ("gpt2 attn-out", 768, 768), ("gpt2 fc", 768, 3072), ("gpt2 mlp-out", 3072, 768),
    ("medium qkv", 1024, 3072), ("medium fc", 1024, 4096), ("medium mlp-out", 4096, 1024),
    ("large qkv", 1280, 3840), ("large fc", 1280, 5120), ("large mlp-out", 5120, 1280),
    ("xl qkv", 1600, 4800), ("xl attn-out", 1600, 1600), ("xl fc", 1600, 6400), ("xl mlp-out", 6400, 1600),
]


def row(kernel, shape, ours_ms, baselines, bytes_moved=None, flops=None, copy_gbs=None):
    r = {"kernel": kernel, "shape": shape, "minillm_us": ours_ms * 1e3}
    for name, t in baselines.items():
        r[f"{name}_us"] = t * 1e3
        r[f"speedup_vs_{name}"] = t / ours_ms
    if bytes_moved:
        r["minillm_gbs"] = bytes_moved / ours_ms / 1e6
        r["floor_fraction"] = r["minillm_gbs"] / copy_gbs
    if flops:
        r["minillm_tflops"] = flops / ours_ms / 1e9
        for name, t in baselines.items():
            r[f"{name}_tflops"] = flops / t / 1e9
    return r


def _h(*shape, scale=1.0):
    return torch.randn(*shape, device="cuda", dtype=torch.float16) * scale


def timed(sets, **fns):
    """{name: ms per call} for each fn(*inputs) cycled over the input sets."""
    return {name: ms_graph([lambda a=a, f=f: f(*a) for a in sets]) for name, f in fns.items()}


def bench_layernorm(copy_gbs, compiled):
    rows = []
    ln_c = torch.compile(F.layer_norm) if compiled else None
    for M, N in ((4096, 768), (16384, 1600)):
        sets = rotating(lambda: (_h(M, N), _h(N), _h(N)), 2 * M * N * 2)
        fns = {"minillm": lambda x, w, b: kernels.layernorm(x, w, b),
               "torch": lambda x, w, b: F.layer_norm(x, (N,), w, b)}
        if ln_c:
            fns["compile"] = lambda x, w, b: ln_c(x, (N,), w, b)
        t = timed(sets, **fns)
        ours = t.pop("minillm")
        rows.append(row("layernorm", f"{M}x{N} fp16", ours, t, 2 * M * N * 2, copy_gbs=copy_gbs))
    return rows


def bench_linear_decode(copy_gbs):
    rows = []
    for name, K, N in GPT2_LINEAR + [("gpt2 lm_head (wte.T)", 768, 50257)]:
        def make():
            w = _h(N, K, scale=K ** -0.5).t() if "lm_head" in name else _h(K, N, scale=K ** -0.5)
            return _h(1, K), w, _h(N)
        sets = rotating(make, K * N * 2)
        t = timed(sets, minillm=lambda x, w, b: kernels.linear(x, w, b), matmul=lambda x, w, b: torch.matmul(x, w),
                  matmul_bias=lambda x, w, b: torch.addmm(b, x, w))
        ours = t.pop("minillm")
        rows.append(row("linear M=1", f"{name} {K}->{N}", ours, t, K * N * 2, copy_gbs=copy_gbs))
    return rows


def bench_linear_gelu(compiled):
    rows = []

    def eager(x, w, b):
        return F.gelu(torch.addmm(b, x, w), approximate="tanh")

    eager_c = torch.compile(eager) if compiled else None
    for M, K, N in ((512, 768, 3072), (4096, 768, 3072), (4096, 1600, 6400)):
        sets = [(_h(M, K), _h(K, N, scale=K ** -0.5), _h(N))]
        fns = {"minillm": lambda x, w, b: kernels.linear(x, w, b, activation="gelu_tanh"), "eager": eager,
               "matmul_only": lambda x, w, b: x @ w}
        if eager_c:
            fns["compile"] = eager_c
        t = timed(sets, **fns)
        ours = t.pop("minillm")
        rows.append(row("linear+bias+gelu", f"{M}x{K}->{N} fp16", ours, t, flops=2 * M * K * N))
    return rows


def bench_attention():
    rows = []
    for B, H, T, D in ((16, 12, 1024, 64), (1, 12, 1024, 64), (4, 25, 1024, 64)):
        sets = [tuple(_h(B, H, T, D) for _ in range(3))]
        t = timed(sets, minillm=lambda q, k, v: kernels.attention(q, k, v, causal=True),
                  sdpa=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        ours = t.pop("minillm")
        flops = 4 * B * H * T * T * D / 2  # causal: half the score matrix
        rows.append(row("attention causal", f"B{B} H{H} T{T} D{D} fp16", ours, t, flops=flops))
    return rows


def bench_decode_attention(copy_gbs):
    rows = []
    for B, H, L, D in ((1, 12, 1024, 64), (64, 12, 1024, 64), (1, 25, 1024, 64), (8, 12, 512, 64)):
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        sets = rotating(lambda: (_h(B, H, D), _h(B, H, L, D), _h(B, H, L, D)), 2 * B * H * L * D * 2)
        t = timed(sets, minillm=lambda q, k, v: kernels.decode_attention(q, k, v, lens),
                  sdpa=lambda q, k, v: F.scaled_dot_product_attention(q[:, :, None], k, v))
        ours = t.pop("minillm")
        rows.append(row("decode attention", f"B{B} H{H} ctx{L} D{D} fp16", ours, t, 2 * B * H * L * D * 2,
                        copy_gbs=copy_gbs))
    return rows


def bench_small(copy_gbs):
    rows = []
    M, N = 4096, 12564
    t = timed(rotating(lambda: (_h(M, N),), 2 * M * N * 2), minillm=kernels.softmax,
              torch=lambda x: torch.softmax(x, -1))
    ours = t.pop("minillm")
    rows.append(row("softmax", f"{M}x{N} fp16", ours, t, 2 * M * N * 2, copy_gbs=copy_gbs))
    n = 1 << 26
    t = timed([(_h(n),)], minillm=kernels.gelu, torch=lambda y: F.gelu(y, approximate="tanh"))
    ours = t.pop("minillm")
    rows.append(row("gelu", "2^26 fp16", ours, t, 2 * n * 2, copy_gbs=copy_gbs))
    return rows


def chart(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, ratios = [], []
    for r in rows:
        key = next((k for k in r if k.startswith("speedup_vs_")), None)
        if key:
            labels.append(f"{r['kernel']}\n{r['shape']} (vs {key[11:]})")
            ratios.append(r[key])
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(labels) + 1.5))
    ax.barh(range(len(labels)), ratios, color=["tab:green" if v >= 1 else "tab:red" for v in ratios])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(range(len(labels)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("speedup of minillm's kernel over the baseline (x)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results", help="folder for the JSON and PNG (default: %(default)s)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    args = ap.parse_args(argv)
    require_cuda("bench_kernels")
    env = environment()
    copy_gbs = copy_bandwidth()
    print(f"{env['device']}: copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    rows = []
    for fn in (lambda: bench_layernorm(copy_gbs, not args.no_compile), lambda: bench_linear_decode(copy_gbs),
               lambda: bench_linear_gelu(not args.no_compile), bench_attention,
               lambda: bench_decode_attention(copy_gbs), lambda: bench_small(copy_gbs)):
        rows += fn()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = device_slug()
    (out / f"kernels-{slug}.json").write_text(json.dumps({"env": env, "copy_gbs": copy_gbs, "rows": rows}, indent=1))
    chart(rows, out / f"kernels-{slug}.png", f"minillm kernels on {env['device']} (torch {env['torch']}, "
                                             f"triton {env['triton']})")
    print(f"{'kernel':<18} {'shape':<34} {'us':>8} {'GB/s':>7} {'floor':>6} {'TFLOP/s':>8}  speedups")
    for r in rows:
        sp = "  ".join(f"{k[11:]} {v:.2f}x" for k, v in r.items() if k.startswith("speedup_vs_"))
        print(f"{r['kernel']:<18} {r['shape']:<34} {r['minillm_us']:8.1f} {r.get('minillm_gbs', 0):7.0f} "
              f"{r.get('floor_fraction', 0):6.2f} {r.get('minillm_tflops', 0):8.1f}  {sp}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
