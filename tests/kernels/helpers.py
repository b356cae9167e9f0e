"""Shared checks for the kernel tests: fresh random inputs, poisoned outputs, relative error."""
import torch
import torch.nn.functional as F

import kernels
from kernels import decode_attention_config, reference

from tests.conftest import ON_GPU

# relative error ||out - ref|| / ||ref|| allowed, by the dtype the kernel ran in
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
# half precision on the CPU interpreter is emulated through numpy and slow; the GPU runs all
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]


def randn(*shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype=dtype, device=device)


def gemv_cfg(block_n=32, block_k=32, chunks=1, split=True):
    """A decode GEMV layout (kernels/gemv.py's config) for `_config=`."""
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "CHUNKS": chunks, "SPLIT": split}


def poisoned(shape, dtype, device):
    """An output buffer full of NaN: any element the kernel fails to write fails the test."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_rel_close(out, ref, dtype, what=""):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out64, ref64 = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out64).all(), f"{what}: non-finite output (unwritten or overflowed elements)"
    err = (out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)
    assert err <= TOLERANCE[dtype], f"{what}: relative error {err:.3e} > {TOLERANCE[dtype]:.0e} ({dtype})"


def ln_linear(x, w, bias, g, b, eps=1e-5, **kw):
    """kernels.linear of layernorm(x; g, b) as the model calls it: the layernorm folded in."""
    wf, bf, colsum = kernels.fold_layernorm(w, bias, g, b)
    return kernels.linear(x, wf, bf, ln_fold=colsum, ln_eps=eps, **kw)


def ln_linear_ref(x, w, bias, g, b, eps=1e-5, **kw):
    """The unfolded math in float64: act(layer_norm(x; g, b) @ w + bias) + residual."""
    xn = F.layer_norm(x.double(), (x.shape[-1],), g.double(), b.double(), eps)
    kw = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return reference.linear(xn, w.double(), bias.double() if bias is not None else None, **kw)


def without_env_switches(monkeypatch):
    """decode_attention_config's rules as they run without MINILLM_ATTN_PREFETCH_TILES,
    MINILLM_ATTN_STAGES, MINILLM_ATTN_LONG_SPLITS, MINILLM_ATTN_NEW_APART, MINILLM_ATTN_TMA,
    MINILLM_ATTN_NARROW and MINILLM_ATTN_ONE_WARP."""
    monkeypatch.setattr(decode_attention_config, "PREFETCH_TILES_ENV", None)
    monkeypatch.setattr(decode_attention_config, "LOOP_STAGES_ENV", None)
    monkeypatch.setattr(decode_attention_config, "LONG_SPLITS", 8)
    monkeypatch.setattr(decode_attention_config, "NEW_APART_ENV", None)
    monkeypatch.setattr(decode_attention_config, "TMA_ENV", None)
    monkeypatch.setattr(decode_attention_config, "NARROW_ENV", None)
    monkeypatch.setattr(decode_attention_config, "NARROW", (32, 2))
    monkeypatch.setattr(decode_attention_config, "ONE_WARP", (32, 1))
    monkeypatch.setattr(decode_attention_config, "ONE_WARP_ON", True)
