"""The decode path of `linear` (kernels/gemv.py): split-K reduction, row blocks, the layernorm
prologue across splits, batch invariance. `linear` itself routes M <= 64 here."""
import pytest
import torch

import kernels
from kernels import reference as ref
from kernels.gemv import SMALL_M
from tests.kernels.helpers import assert_rel_close, poisoned, randn


def _ref(x, w, **kw):
    kw = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return ref.linear(x.double(), w.double(), **kw)


# (BLOCK_N, BLOCK_K, SPLIT_K) with K = 230: splits of one and of several BLOCK_Ks, empty last
# splits (SPLIT_K = 4 leaves the fourth split past K), N off the block
@pytest.mark.parametrize("block_k,split_k", [(32, 1), (32, 3), (64, 4), (32, 2)])
@pytest.mark.parametrize("M", [1, 5, 33])
def test_gemv_split_k_reduction(block_k, split_k, M, device):
    """Every split count and rows over several 16-row blocks, with repeated launches (the
    arrival counters must be back at zero after each)."""
    K, N = 230, 75
    cfg = {"BLOCK_N": 32, "BLOCK_K": block_k, "SPLIT_K": split_k}
    for _ in range(2):
        x, w = randn(M, K, device=device), randn(K, N, device=device)
        res = randn(M, N, device=device)
        out = poisoned((M, N), torch.float32, device)
        y = kernels.linear(x, w, activation="relu", residual=res, out=out, _config=cfg)
        assert_rel_close(y, _ref(x, w, activation="relu", residual=res), torch.float32, f"split {split_k}")


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_layernorm_across_splits(split_k, dtype, device):
    """Each split normalizes its own K slice with statistics of the whole row; K spans more
    than one statistics chunk (LN_BLOCK)."""
    M, K, N = 18, 600, 40
    x = randn(M, K, dtype=dtype, device=device, scale=3.0) + 1.5
    w = randn(K, N, dtype=dtype, device=device, scale=K ** -0.5)
    g, b = randn(K, dtype=dtype, device=device), randn(K, dtype=dtype, device=device)
    cfg = {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": split_k}
    y = kernels.linear(x, w, ln_weight=g, ln_bias=b, _config=cfg)
    assert_rel_close(y, _ref(x, w, ln_weight=g, ln_bias=b), dtype, f"ln split {split_k}")


def test_gemv_same_rows_at_any_batch(device):
    """A row's result does not depend on how many other rows share the launch (<= 64)."""
    K, N = 96, 80
    w, bias = randn(K, N, device=device), randn(N, device=device)
    x = randn(SMALL_M, K, device=device)
    for cfg in (None, {"BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 3}):
        full = kernels.linear(x, w, bias, activation="gelu_tanh", _config=cfg)
        for m in (1, 7, 17, SMALL_M):
            assert torch.equal(kernels.linear(x[:m], w, bias, activation="gelu_tanh", _config=cfg), full[:m])


@pytest.mark.parametrize("M", [1, 20, 70])  # 70: the prefill tile path writes statistics too
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_row_stats_out_and_in(M, dtype, device):
    """stats_out holds the partial sums of the stored (rounded) output; a layernorm fed those
    through ln_stats matches the one computed from the rows."""
    K, N = 72, 100  # N off the 16-column groups
    x = randn(M, K, dtype=dtype, device=device)
    w = randn(K, N, dtype=dtype, device=device, scale=K ** -0.5)
    res = randn(M, N, dtype=dtype, device=device, scale=2.0) + 1.0
    stats = torch.full((M, 2, 7), float("nan"), device=device)
    h = kernels.linear(x, w, residual=res, stats_out=stats)
    torch.testing.assert_close(stats.cpu(), ref.row_stats(h).cpu(), rtol=1e-5, atol=1e-4)
    w2 = randn(N, 40, dtype=dtype, device=device, scale=N ** -0.5)
    g, b = randn(N, dtype=dtype, device=device), randn(N, dtype=dtype, device=device)
    y = kernels.linear(h, w2, ln_weight=g, ln_bias=b, ln_stats=stats)
    assert_rel_close(y, _ref(h, w2, ln_weight=g, ln_bias=b), dtype, f"ln from stats M={M}")


def test_linear_row_stats_errors(device):
    x, w = randn(2, 8, device=device), randn(8, 20, device=device)
    g = randn(8, device=device)
    with pytest.raises(ValueError, match=r"stats_out: expected shape \(2, 2, 2\)"):
        kernels.linear(x, w, stats_out=torch.zeros(2, 2, 1, device=device))
    with pytest.raises(ValueError, match="ln_stats: expected dtype"):
        kernels.linear(x, w, ln_weight=g, ln_bias=g, ln_stats=torch.zeros(2, 2, 1, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="ln_stats: given without ln_weight"):
        kernels.linear(x, w, ln_stats=torch.zeros(2, 2, 1, device=device))


@pytest.mark.parametrize("M,N,cfg", [
    (1, 300, None), (5, 300, {"BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 2}),
    (20, 4200, {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1}),  # > 256 column blocks: several chunks
    (70, 300, None),  # prefill rows: torch's argmax after the tile kernel
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_fused_argmax(M, N, cfg, dtype, device):
    """argmax_out equals torch.argmax of the stored logits, ties included (lowest index)."""
    K = 40
    x = randn(M, K, dtype=dtype, device=device)
    w = randn(K, N, dtype=dtype, device=device, scale=K ** -0.5)
    w[:, N - 7] = w[:, 3]  # exact ties across column blocks and chunks: the lower index wins
    w[:, N // 2] = w[:, 3]
    w[:, 4] = w[:, 3]
    x[0] = (w[:, 3].double() * 50).to(dtype)  # row 0's maximum is the tied column
    tok = torch.full((M,), -1, dtype=torch.int64, device=device)
    y = kernels.linear(x, w, argmax_out=tok, _config=cfg)
    assert torch.equal(tok, y.argmax(dim=-1))
    assert tok[0] == 3
