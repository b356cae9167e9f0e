"""Decode-attention diagnostics: every split count on the decode shapes of GPT-2 and GPT-2 XL,
timed as the engine runs the kernel (back to back in a CUDA graph, programmatic dependent
launch, the first cache tile prefetched, the new key/value written by the same launch), caches
rotated past L2. Times every split count at 64-row tiles, every tile height and warp count at
the best split count, and the launcher's own choice (default_layout).

    python3 scripts/bench_decode_attention.py --out bench/results
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
from kernels.decode_attention_config import default_layout  # noqa: E402
from minillm.benchutil import device_slug, environment, ms_graph, require_cuda, rotating  # noqa: E402

SHAPES = [  # (name, batch, heads, cache positions L covered (the length bucket), filled positions)
    ("gpt2", 1, 12, 128, 100), ("gpt2", 1, 12, 256, 160), ("gpt2", 1, 12, 1024, 1000),
    ("gpt2", 64, 12, 256, 160), ("xl", 1, 25, 256, 160), ("xl", 1, 25, 1024, 1000),
]


def time_splits(sets, splits, config):
    def f(q, k, v, kn, vn, lens):
        return kernels.decode_attention(q, k, v, lens, k_new=kn, v_new=vn, num_splits=splits, prefetch_cache=True,
                                        _config=config)
    return ms_graph([lambda a=a: f(*a) for a in sets]) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    require_cuda("bench_decode_attention")
    h = dict(device="cuda", dtype=torch.float16)
    rows = []
    for name, B, H, L, filled in SHAPES:
        D = 64

        def make():
            k, v = torch.randn(B, H, L, D, **h), torch.randn(B, H, L, D, **h)
            q, kn, vn = (torch.randn(B, H, D, **h) for _ in range(3))
            return q, k, v, kn, vn, torch.full((B,), filled, dtype=torch.int32, device="cuda")

        sets = rotating(make, 2 * B * H * L * D * 2)
        default, block_n, warps = default_layout(torch.device("cuda"), B * H, L, D)
        per = {}
        for splits in (1, 2, 4, 8, 16, 32):
            if splits * 32 > L:
                continue
            per[splits] = time_splits(sets, splits, {"BLOCK_N": 64, "num_warps": 4})
        best = min(per, key=per.get)
        layouts = {f"BLOCK_N={bn} warps={w}": time_splits(sets, best, {"BLOCK_N": bn, "num_warps": w})
                   for bn in (16, 32, 64, 128) for w in (1, 2, 4, 8)}
        mine = {"BLOCK_N": block_n, "num_warps": warps}
        default_us = time_splits(sets, default, mine)  # the launcher's own choice
        stages = {n: time_splits(sets, default, mine | {"num_stages": n}) for n in (1, 2, 3, 4)}
        r = {"shape": f"{name} B={B} H={H} L={L} filled={filled}", "default_splits": default,
             "default_block_n": block_n, "default_us": default_us, "best_splits": best, "best_us": per[best],
             "all_us_block_n_64": per, "layouts_at_best_splits_us": layouts, "default_by_num_stages_us": stages}
        rows.append(r)
        print(f"{r['shape']:<36} default {default:2d} splits x {block_n} {default_us:6.2f} us"
              f"   best {best:2d} splits {per[best]:6.2f} us   " + "  ".join(f"{s}:{t:.2f}" for s, t in per.items()),
              flush=True)
        print("    at the best split count: " + "  ".join(f"{k}: {t:.2f}" for k, t in layouts.items()), flush=True)
        print("    the default layout by num_stages: " + "  ".join(f"{k}: {t:.2f}" for k, t in stages.items()), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"decode-attention-{device_slug()}.json").write_text(json.dumps(
        {"environment": environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
