"""The greedy head's screen (vocab_screen.py), built once at load: an int8 copy of the vocabulary
head with the per-column constants its error bound needs. Plain torch, in fp64 where the bound's
constants must hold exactly, a slice of columns at a time."""
import os
from collections import namedtuple

import torch
import triton

from ._tuning import env_int
from .gemv_fma import VOCAB_N

# MINILLM_VOCAB_SCREEN=0 gives greedy decoding the full head back (A/B timing)
ENABLED = os.environ.get("MINILLM_VOCAB_SCREEN", "1") != "0"
# the widest K screened (screen_head). Past vocab_fma's MAX_K (1024) the head it replaces runs
# on tensor cores: H200, alternated twice in one call, the same ids (bench/results/h200/session-96/
# call3-*): gpt2-large (K = 1280) 1,424 / 1,428 -> 1,446 / 1,447 tok/s (+1.4%), gpt2-xl (1600)
# 841 / 841 -> 844 / 844 (+0.3%). MINILLM_SCREEN_MAX_K=n takes another (A/B timing; 1024: the former)
MAX_SCREEN_K = env_int("MINILLM_SCREEN_MAX_K", 2048, minimum=0)

# The screen's int8 copy: q (N, K // 4) int32 words of 4 int8 weights each (a column's K in order, the
# first in the lowest byte), meta (5, N_PAD) fp32: per column its scale s (w ~ s * q), upper bounds
# E of |w - s * q| and W of |w| (2-norms over K, of the weights the full head multiplies), |colsum|
# and the bias (0 without one); N_PAD, N rounded up to 16, lets a block's constants load as vectors
ScreenedHead = namedtuple("ScreenedHead", "q meta")
PAD = 16
BUILD_COLUMNS = 8192  # columns quantized at a time at load


def _fp32_up(v):
    """fp64 values as fp32 values no smaller."""
    v32 = v.float()
    return torch.where(v32.double() < v, torch.nextafter(v32, torch.full_like(v32, float("inf"))), v32)


def screen_head(weight, bias, colsum):
    """The int8 screen of a vocabulary head's weight (K, N) (out-major, as vocab_fma takes it) with
    its bias (N,) or None and its folded layernorm's column sums colsum (N,), or None where the
    screen does not run: switched off, narrower than a vocabulary, K past MAX_SCREEN_K or not a
    multiple of 4, or a bias that is not finite (its bound would be too; the loader refuses
    weights that are not finite)."""
    K, N = weight.shape
    if not ENABLED or N < VOCAB_N or K > MAX_SCREEN_K or K % 4 or weight.stride(0) != 1:
        return None
    if bias is not None and not torch.isfinite(bias).all():
        return None
    q8 = torch.empty(N, K, dtype=torch.int8, device=weight.device)
    meta = torch.zeros(5, triton.cdiv(N, PAD) * PAD, dtype=torch.float32, device=weight.device)
    meta[0] = 1.0
    for n0 in range(0, N, BUILD_COLUMNS):  # in slices: fp64 copies of the whole head would take GBs
        w = weight[:, n0:n0 + BUILD_COLUMNS].t().double()  # (columns, K)
        scale = (w.abs().amax(1) / 127).float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a zero column: q = 0, exact
        q = torch.round(w / scale.double()[:, None]).clamp_(-127, 127)
        err = (w - scale.double()[:, None] * q).norm(dim=1)  # exact in fp64: 11 + 24 + 8 bits
        q8[n0:n0 + BUILD_COLUMNS] = q.to(torch.int8)
        meta[:3, n0:n0 + len(w)] = torch.stack([scale, _fp32_up(err), _fp32_up(w.norm(dim=1))])
    meta[3, :N] = colsum.float().abs().reshape(N)
    if bias is not None:
        meta[4, :N] = bias.float()
    return ScreenedHead(q8.view(torch.int32), meta)
