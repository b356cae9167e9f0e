"""What the Gluon probes share (scripts/probe_stream_step.py, probe_pdl_ring.py, probe_pdl_step.py,
probe_rows_ring.py; bench_persistent.py takes rel_err): the chain's random weights laid out as
two slabs by K, the GPU run's record (copy rate, floor, environment), and how a run's error and
JSON record are written."""
import json

import torch

from minillm.config import PRESETS


def weights(cfg, device, seed=0):
    """The chain's weights as two slabs by K, and each phase's (slab, first row, N, K)."""
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    shapes, rows = [], [0, 0]
    for _ in range(L):
        for N, K in ((3 * C, C), (C, C), (4 * C, C), (C, 4 * C)):
            slab = int(K == 4 * C)
            shapes.append((slab, rows[slab], N, K))
            rows[slab] += N
    shapes.append((0, rows[0], V, C))
    rows[0] += V
    g = torch.Generator(device=device).manual_seed(seed)
    slabs = [torch.randn(r, K, dtype=torch.float16, device=device, generator=g).div_(K ** 0.5)
             for r, K in zip(rows, (C, 4 * C))]
    return slabs, shapes


def gpu_setup(model, script):
    """On the GPU: the preset, its chain's weights and shapes, a random input, and the run's
    record (SMs, weight bytes, the copy rate and the floor it gives, the environment)."""
    from minillm.benchutil import require_cuda

    require_cuda(script)
    cfg = PRESETS[model]
    slabs, shapes = weights(cfg, "cuda")
    return cfg, slabs, shapes, torch.randn(cfg.n_embd, device="cuda"), gpu_record(model, slabs)


def gpu_record(model, slabs):
    """A run's record for weights `slabs` (fp16, on the GPU): SMs, weight bytes, the copy rate
    and the floor it gives, the environment."""
    from minillm.benchutil import copy_bandwidth, environment

    nbytes = sum(w.numel() * 2 for w in slabs)
    bw = copy_bandwidth()
    return dict(model=model, programs=torch.cuda.get_device_properties(0).multi_processor_count, weight_bytes=nbytes,
                copy_gbps=round(bw, 1), floor_us=round(nbytes / (bw * 1e9) * 1e6, 2), environment=environment(),
                runs=[])


def rel_err(got, want):
    """got's largest error against want's largest magnitude (a Python float)."""
    return ((got - want).abs().max() / want.abs().max()).item()


def write_record(out, name, rec):
    """rec as JSON at out/name (out made where missing); nothing where out is None."""
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(rec, indent=1) + "\n")


def attend(qkv, k_cache, v_cache, heads):
    """One step's attention over the cache's first P rows and this step's k and v (fp32)."""
    C = qkv.numel() // 3
    D = C // heads
    q, k, v = qkv.view(3, heads, D)
    keys = torch.cat([k_cache[:-1].float().view(-1, heads, D), k[None]]).transpose(0, 1)  # (H, P + 1, D)
    vals = torch.cat([v_cache[:-1].float().view(-1, heads, D), v[None]]).transpose(0, 1)
    w = torch.softmax((keys @ q[:, :, None]).squeeze(-1) / D ** 0.5, dim=-1)  # (H, P + 1)
    return (w[:, None, :] @ vals).reshape(C)


def floor_with_cache(rec, cfg, positions):
    """The cache's bytes (every layer's K and V over `positions`) and the floor (us) with them read
    once beside the weights, at the run's copy rate."""
    cache_bytes = 2 * positions * cfg.n_embd * 2 * cfg.n_layer
    return cache_bytes, rec["floor_us"] * (1 + cache_bytes / rec["weight_bytes"])


def make_caches(cfg, positions, device, seed=1):
    """Each layer's K and V cache: positions random rows (fp16) and one more for this step's."""
    g = torch.Generator(device=device).manual_seed(seed)
    return [tuple(torch.randn(positions + 1, cfg.n_embd, dtype=torch.float16, device=device, generator=g)
                  for _ in range(2)) for _ in range(cfg.n_layer)]
