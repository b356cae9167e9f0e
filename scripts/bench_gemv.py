"""Decode-linear diagnostics: every candidate GEMV layout on every GPT-2 decode shape, timed in
CUDA graphs with weights rotated past L2, with programmatic dependent launch on and off, against
cuBLAS and against the launch floor (a chain of 1-row embedding kernels). Shows what
decode_config picks and what the best candidate reaches (GB/s and fraction of the copy
bandwidth measured in the run). Layernorm shapes take their statistics from ln_stats, as in
the model. --fma instead times the CUDA-core GEMV (kernels/gemv_fma.py) against the tensor-core
one at 1, 2, 4 and 8 rows, weights stored out-major as the model keeps them.

    python3 scripts/bench_gemv.py --out bench/results
    python3 scripts/bench_gemv.py --fma --out bench/results
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
import kernels._tuning as tuning  # noqa: E402
from kernels import gemv, gemv_config, gemv_fma  # noqa: E402
from kernels import reference as ref  # noqa: E402
from minillm.benchutil import copy_bandwidth, device_slug, environment, ms_graph, require_cuda, rotating  # noqa: E402


def engine_config(M, N, K, ln):
    """The layout the engine launches for fp16 rows on this GPU (it follows the SM count)."""
    return gemv_config.decode_config(M, N, K, 2, ln, sms=tuning.sm_count(torch.device("cuda")))


SHAPES = [  # (name, M, K, N, folded layernorm)
    ("gpt2 qkv", 1, 768, 2304, True), ("gpt2 attn-out", 1, 768, 768, False), ("gpt2 fc", 1, 768, 3072, True),
    ("gpt2 mlp-out", 1, 3072, 768, False), ("gpt2 lm_head", 1, 768, 50257, True),
    ("gpt2 qkv", 64, 768, 2304, True), ("gpt2 attn-out", 64, 768, 768, False), ("gpt2 fc", 64, 768, 3072, True),
    ("gpt2 mlp-out", 64, 3072, 768, False), ("gpt2 lm_head", 64, 768, 50257, True),
    ("gpt2 qkv", 32, 768, 2304, True), ("gpt2 fc", 32, 768, 3072, True),  # where 32-row tiles run
    ("xl qkv", 1, 1600, 4800, True), ("xl attn-out", 1, 1600, 1600, False), ("xl fc", 1, 1600, 6400, True),
    ("xl mlp-out", 1, 6400, 1600, False),
    ("xl qkv", 64, 1600, 4800, True), ("xl attn-out", 64, 1600, 1600, False), ("xl fc", 64, 1600, 6400, True),
    ("xl mlp-out", 64, 6400, 1600, False), ("xl lm_head", 64, 1600, 50257, True), ("xl lm_head", 1, 1600, 50257, True),
]


def set_pdl(on):
    tuning.PDL = on  # use_pdl reads it at every launch


def sweep_configs(M, N, K):
    """The listed CANDIDATES and a grid of layouts whose chunk is one weight tile (a program
    requests its whole slab before it waits on the previous kernel)."""
    cands = list(gemv_config.CANDIDATES)
    for bk in (128, 256, 512):
        for bn in (32, 64, 128):
            if bn * bk > 32768 or bk > max(128, K):
                continue
            for warps in ((4, 8) if bn * bk >= 16384 else (4,)):
                cands.append((bn, bk, 64, True, warps))
                if M > 16:  # one looping program per tile too
                    cands.append((bn, bk, 64, False, warps))
    seen, out = set(), []
    tall = [config_dict(c) | {"BLOCK_M": 64} for c in cands if M > 16]  # one 64-row tl.dot
    # 32-row looping tiles in four stages, decode_config's layout at 17-32 rows (32 x 64 tiles)
    rows32 = [config_dict(c) | {"BLOCK_M": 32, "num_stages": 4} for c in cands if M > 16 and not c[3]]  # c[3]: SPLIT
    for cfg in [config_dict(c) for c in cands] + tall + rows32:
        cfg["CHUNKS"] = gemv_config.chunk_count(K, cfg["BLOCK_K"], cfg["CHUNKS"])
        if M > 16 and cfg["SPLIT"] and cfg["CHUNKS"] > 4 and "BLOCK_M" not in cfg:
            continue  # the fp32 partials of 64 rows in 16-row tiles outweigh the weights
        key = str(cfg)
        if key not in seen:
            seen.add(key)
            out.append(cfg)
    return out


def config_dict(c):
    bn, bk, chunks, split, warps = c
    return {"BLOCK_N": bn, "BLOCK_K": bk, "CHUNKS": chunks, "SPLIT": split, "num_warps": warps}


def pdl_ordering():
    """Where the compiled decode kernel waits (griddepcontrol.wait) relative to its first
    global loads: the weight tile must be requested before the wait to hide behind the
    previous kernel."""
    set_pdl(True)
    h = dict(device="cuda", dtype=torch.float16)
    x, w = torch.randn(1, 768, **h), torch.randn(768, 2304, **h)
    kernels.linear(x, w)
    kernel = next(iter(gemv._gemv_kernel.device_caches[torch.cuda.current_device()][0].values()))
    ptx = kernel.asm["ptx"].splitlines()
    wait = next(i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line)
    loads = [i for i, line in enumerate(ptx) if "ld.global" in line or "cp.async" in line]
    return {"wait_line": wait, "loads_before_wait": sum(i < wait for i in loads),
            "loads_after_wait": sum(i > wait for i in loads)}


def run_or_inf(run, cfg):
    try:
        return run(cfg)
    except Exception as e:  # e.g. a tile too large for shared memory: not a layout to pick
        print(f"    {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
        return float("inf")


FMA_SHAPES = [  # (name, K, N, folded layernorm, activation, residual)
    ("gpt2 qkv", 768, 2304, True, None, False), ("gpt2 attn-out", 768, 768, False, None, True),
    ("gpt2 fc", 768, 3072, True, "gelu_tanh", False), ("gpt2 mlp-out", 3072, 768, False, None, True),
    ("xl qkv", 1600, 4800, True, None, False), ("xl attn-out", 1600, 1600, False, None, True),
    ("xl fc", 1600, 6400, True, "gelu_tanh", False),
]


def fma_rows(shapes_filter):
    """Per shape and row count: the tensor-core GEMV (decode_config's layout) and the CUDA-core
    one (one row per program, gemv_fma.layout's columns and warps), both on out-major weights;
    at one row also every CUDA-core layout of 2-8 columns and 1-8 warps."""
    h = dict(device="cuda", dtype=torch.float16)
    rows = []
    for name, K, N, ln, act, res in FMA_SHAPES:
        for M in (1, 2, 4, 8):
            if shapes_filter and not any(t in f"{name} M={M}" for t in shapes_filter):
                continue

            def make():
                x = torch.randn(M, K, **h)
                w = (torch.randn(N, K, **h) * K ** -0.5).t()  # out-major, as the model stores it
                # (x, W, bias, a folded layernorm's column sums, residual)
                return x, w, torch.randn(N, **h), torch.randn(N, device="cuda"), torch.randn(M, N, **h)

            sets = rotating(make, K * N * 2)

            def run(a, cfg):
                kw = dict(ln_fold=a[3]) if ln else dict(residual=a[4])
                return kernels.linear(a[0], a[1], a[2], activation=act, _config=cfg, **kw)

            fma_cfg = gemv_fma.layout(K)
            tensor_cfg = engine_config(M, N, K, ln)
            r = {"shape": f"{name} M={M} {K}->{N}",
                 "tensor_core_us": ms_graph([lambda a=a: run(a, tensor_cfg) for a in sets]) * 1e3,
                 "cuda_core_us": ms_graph([lambda a=a: run(a, fma_cfg) for a in sets]) * 1e3,
                 "cuda_core_layout": str(fma_cfg),
                 "routed_to_cuda_cores": gemv_fma.fma_config(M, N, K, 1) is not None}
            if M == 1:  # the CUDA-core layouts: columns per program and warps
                r["cuda_core_layouts_us"] = {
                    f"{bn} columns, {w} warps": ms_graph([lambda a=a: run(a, fma_cfg | dict(BLOCK_N=bn, num_warps=w))
                                                          for a in sets]) * 1e3
                    for bn in (2, 4, 8) for w in (1, 2, 4, 8) if bn * K // (32 * w) <= 512}
            rows.append(r)
            print(f"{r['shape']:<28} tensor cores {r['tensor_core_us']:6.2f} us  CUDA cores {r['cuda_core_us']:6.2f} us"
                  f"  {'(routed there)' if r['routed_to_cuda_cores'] else ''}", flush=True)
            if M == 1:
                print("    " + "  ".join(f"{k}: {v:.2f}" for k, v in r["cuda_core_layouts_us"].items()), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--shapes", nargs="*", default=None, metavar="TEXT",
                    help="only the shapes whose name contains one of these (e.g. 'xl' 'lm_head')")
    ap.add_argument("--stages", nargs="*", type=int, default=None, metavar="N",
                    help="instead of the layout grid, time decode_config's own layout at each of these "
                         "software-pipelining depths (num_stages; the arithmetic stays the same)")
    ap.add_argument("--configs", default=None, metavar="JSON",
                    help="instead of the layout grid, time these layouts: a JSON list of dicts, each laid over "
                         "decode_config's own (e.g. '[{\"num_stages\": 4}, {\"BLOCK_N\": 32}]')")
    ap.add_argument("--fma", action="store_true",
                    help="time the CUDA-core GEMV against the tensor-core one at 1-8 rows instead of the layout grid")
    args = ap.parse_args()
    require_cuda("bench_gemv")
    if args.fma:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        rows = fma_rows(args.shapes)
        (out / f"gemv-fma-{device_slug()}.json").write_text(json.dumps(
            {"environment": environment(), "rows": rows}, indent=1))
        return
    overrides = None
    if args.configs is not None:
        try:
            overrides = json.loads(args.configs)
        except json.JSONDecodeError as e:
            ap.error(f"--configs: expected a JSON list of objects ({e})")
        if not isinstance(overrides, list) or not all(isinstance(o, dict) for o in overrides):
            ap.error("--configs: expected a JSON list of objects")
    copy_gbs = copy_bandwidth()
    h = dict(device="cuda", dtype=torch.float16)
    launch = {}
    for on in (True, False):
        set_pdl(on)
        wte, wpe = torch.randn(1000, 768, **h), torch.randn(64, 768, **h)
        ids = torch.zeros(1, dtype=torch.int32, device="cuda")
        launch[on] = ms_graph([lambda: kernels.embedding(ids, ids, wte, wpe)]) * 1e3
    print(f"launch floor (1-row embedding chain): {launch[True]:.2f} us with PDL, {launch[False]:.2f} us without")
    try:
        ordering = pdl_ordering()
    except Exception as e:  # Triton's cache layout is internal; the sweep does not depend on it
        ordering = {"error": repr(e)}
    print("PTX of the decode kernel:", ordering)
    rows = []
    for name, M, K, N, ln in SHAPES:
        if args.shapes and not any(t in f"{name} M={M}" for t in args.shapes):
            continue
        lm = "lm_head" in name

        def make():
            w = torch.randn(N, K, **h).t() if lm else torch.randn(K, N, **h)
            return torch.randn(M, K, **h), w * K ** -0.5, torch.randn(N, **h), torch.randn(N, device="cuda")

        sets = [(*a, ref.row_stats(a[0])) for a in rotating(make, K * N * 2)]

        def run(cfg):
            def f(x, w, b, colsum, st):  # colsum: a folded layernorm's (timing only: any values)
                kw = dict(ln_fold=colsum, ln_stats=st) if ln else {}
                return kernels.linear(x, w, b, _config=cfg, **kw)
            return ms_graph([lambda a=a: f(*a) for a in sets]) * 1e3

        set_pdl(True)
        if overrides is not None:  # decode_config's own first; a layout listed twice is timed once
            own = engine_config(M, N, K, ln)
            cfgs = list({str(c): c for c in (own | o for o in [{}] + overrides)}.values())
        elif args.stages:
            cfgs = [engine_config(M, N, K, ln) | {"num_stages": n} for n in args.stages]
        else:
            cfgs = sweep_configs(M, N, K)
        times = [run_or_inf(run, c) for c in cfgs]
        i_best = min(range(len(cfgs)), key=times.__getitem__)
        best, per = str(cfgs[i_best]), {str(c): t for c, t in zip(cfgs, times)}
        tuned_us = run(None)  # decode_config's choice
        set_pdl(False)
        best_nopdl = run(cfgs[i_best])
        cublas = ms_graph([lambda a=a: a[0] @ a[1] for a in sets]) * 1e3
        gbs = K * N * 2 / per[best] / 1e3
        r = {"shape": f"{name} M={M} {K}->{N}", "best_config": best, "best_us": per[best], "best_gbs": gbs,
             "floor_fraction": gbs / copy_gbs, "decode_config": str(engine_config(M, N, K, ln)),
             "decode_config_us": tuned_us, "best_no_pdl_us": best_nopdl,
             "cublas_us": cublas, "all_us": per}
        rows.append(r)
        print(f"{r['shape']:<28} best {per[best]:6.2f} us {gbs:6.0f} GB/s ({gbs / copy_gbs:.2f})"
              f"  picked {tuned_us:6.2f}"
              f"  no-PDL {best_nopdl:6.2f}  cuBLAS {cublas:6.2f}  {best}", flush=True)
        print("    " + "  ".join(f"{v:.1f}" for v in per.values()), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mode = "configs-" if overrides is not None else "stages-" if args.stages else ""
    (out / f"gemv-{mode}{device_slug()}.json").write_text(json.dumps(
        {"environment": environment(), "copy_gbs": copy_gbs, "launch_floor_us": launch, "pdl_ptx": ordering,
         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
