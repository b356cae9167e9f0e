"""(session 88, call 3: a one-off GPU check, not kept) linear at the wide-K layers' shapes under
MINILLM_WIDE_K_TILE against torch: the output, and its row statistics."""
import sys

import torch

from kernels import linear, new_row_stats
from kernels.gemv_config import WIDE_K_TILE, decode_config

torch.manual_seed(0)
ok = True
for M, K, N in [(1, 6400, 1600), (1, 4096, 1024), (1, 5120, 1280), (2, 6400, 1600)]:
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    w = torch.randn(K, N, device="cuda", dtype=torch.float16) / K ** 0.5
    b = torch.randn(N, device="cuda", dtype=torch.float16)
    r = torch.randn(M, N, device="cuda", dtype=torch.float16)
    st = new_row_stats(M, N, x.device)
    y = linear(x, w, b, residual=r, stats_out=st)
    ref = (x.float() @ w.float() + b.float() + r.float())
    err = (y.float() - ref).abs().max().item()
    g = y.float().view(M, -1, 16)
    serr = max((st[:, 0] - g.sum(-1)).abs().max().item(), (st[:, 1] - (g * g).sum(-1)).abs().max().item() / 16)
    good = err < 2e-2 and serr < 1e-2
    ok &= good
    print(f"{WIDE_K_TILE} M={M} K={K} N={N} {decode_config(M, N, K, 2, sms=132)}: max err {err:.2e}, "
          f"stats err {serr:.2e} {'ok' if good else 'FAIL'}")
sys.exit(0 if ok else 1)
