"""kernels/mlp.py: the fused decode MLP (hidden blocks, fixed-point atomics, the last program
finishing the row) against the torch reference, its determinism, and the two-linear path that
rows past FUSED_ROWS take."""
import importlib

import pytest
import torch

import kernels
from kernels import reference as ref
from tests.conftest import ON_GPU
from tests.kernels.helpers import assert_rel_close, poisoned, randn

mlp_module = importlib.import_module("kernels.mlp")  # the package exports the function under the same name


def _block(C, hidden, dtype, device):
    """MLP weights scaled so the hidden row and the output stay O(1) (a test that moves them)."""
    return dict(ln_weight=randn(C, dtype=dtype, device=device) * 0.5 + 1.0, ln_bias=randn(C, dtype=dtype, device=device),
                fc_weight=randn(C, hidden, dtype=dtype, device=device, scale=C ** -0.5),
                fc_bias=randn(hidden, dtype=dtype, device=device),
                proj_weight=randn(hidden, C, dtype=dtype, device=device, scale=hidden ** -0.5),
                proj_bias=randn(C, dtype=dtype, device=device))


def _ref(x, p, **kw):
    up = {k: v.double() for k, v in p.items()}
    if kw.get("ln_stats") is not None:
        kw["ln_stats"] = kw["ln_stats"].double()
    return ref.mlp(x.double(), **up, **{k: v for k, v in kw.items() if k != "stats_out"})


# C = 100 and hidden = 200: neither a multiple of the blocks (the interpreter's BLOCK_H 16,
# BLOCK_K/BLOCK_N 32; the GPU's 32/128), so every edge is masked
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ["gelu_tanh", "leaky_relu"])
def test_fused_mlp_matches_reference(M, dtype, activation, device):
    C, hidden = 100, 200
    p = _block(C, hidden, dtype, device)
    for _ in range(2):  # the second launch needs the counter and the int64 rows back at zero
        x = randn(M, C, dtype=dtype, device=device, scale=2.0) + 0.5
        out = poisoned((M, C), dtype, device)
        y = kernels.mlp(x, **p, activation=activation, negative_slope=0.2, out=out)
        assert y is out
        assert_rel_close(y, _ref(x, p, activation=activation, negative_slope=0.2), dtype, f"M={M} {activation}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_mlp_in_place_with_row_stats(dtype, device):
    """As the model calls it: the layernorm from ln_stats, out=x (the residual read by the
    finishing program before it overwrites x), and stats_out for the next layernorm."""
    M, C, hidden = 5, 96, 160
    p = _block(C, hidden, dtype, device)
    x = randn(M, C, dtype=dtype, device=device, scale=3.0) - 1.0
    stats_in = ref.row_stats(x).to(device)
    expect = _ref(x, p, ln_stats=stats_in)
    stats = torch.full((M, 2, C // 16), float("nan"), device=device)
    y = kernels.mlp(x, **p, ln_stats=stats_in, stats_out=stats, out=x)
    assert y is x
    assert_rel_close(x, expect, dtype, "in place")
    torch.testing.assert_close(stats.cpu(), ref.row_stats(x).cpu(), rtol=1e-5, atol=1e-4)


def test_fused_mlp_deterministic_and_rows_independent(device):
    """Integer sums do not depend on the order the programs arrive in: repeated launches give
    the same bits, and a row gives the same bits alone or beside 15 others."""
    C, hidden = 64, 192
    p = _block(C, hidden, torch.float32, device)
    x = randn(16, C, device=device)
    first = kernels.mlp(x, **p)
    assert torch.equal(kernels.mlp(x, **p), first)
    assert torch.equal(kernels.mlp(x[3:4], **p), first[3:4])


@pytest.mark.parametrize("fused", [True, False])
def test_mlp_paths_agree(fused, monkeypatch, device):
    """Rows past FUSED_ROWS (or MINILLM_FUSED_MLP=0) run as two linears; same result within
    tolerance either way."""
    monkeypatch.setattr(mlp_module, "FUSED", fused)
    M = 4 if fused else 20
    C, hidden = 48, 128
    p = _block(C, hidden, torch.float16, device)
    x = randn(M, C, dtype=torch.float16, device=device)
    stats = torch.full((M, 2, 3), float("nan"), device=device)
    y = kernels.mlp(x, **p, stats_out=stats)
    assert_rel_close(y, _ref(x, p), torch.float16, f"fused={fused}")
    torch.testing.assert_close(stats.cpu(), ref.row_stats(y).cpu(), rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(not ON_GPU, reason="GPT-2 widths: interpreter time")
@pytest.mark.parametrize("C", [768, 1600])
def test_fused_mlp_gpt2_widths(C, device):
    """The default layout on the GPT-2 widths (gpt2, gpt2-xl) in fp16, one row."""
    p = _block(C, 4 * C, torch.float16, device)
    x = randn(1, C, dtype=torch.float16, device=device, scale=2.0)
    assert_rel_close(kernels.mlp(x, **p), _ref(x, p), torch.float16, f"C={C}")


def test_mlp_errors(device):
    p = _block(8, 16, torch.float32, device)
    x = randn(2, 8, device=device)
    with pytest.raises(ValueError, match=r"proj_weight: expected shape \(16, 8\)"):
        kernels.mlp(x, **{**p, "proj_weight": randn(8, 16, device=device)})
    with pytest.raises(ValueError, match=r"fc_weight: expected \(8, hidden\)"):
        kernels.mlp(x, **{**p, "fc_weight": randn(9, 16, device=device)})
    with pytest.raises(ValueError, match="fc_bias: expected shape"):
        kernels.mlp(x, **{**p, "fc_bias": randn(15, device=device)})
    with pytest.raises(ValueError, match="activation: expected one of"):
        kernels.mlp(x, **p, activation="swish")
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 8\)"):
        kernels.mlp(x, **p, out=randn(3, 8, device=device))
    with pytest.raises(ValueError, match="x: expected 2 dims"):
        kernels.mlp(x[None], **p)
