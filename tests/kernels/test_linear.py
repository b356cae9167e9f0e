import pytest
import torch

import kernels
from kernels import reference as ref
from tests.conftest import ON_GPU
from tests.kernels.helpers import DTYPES, assert_rel_close, ln_linear, ln_linear_ref, poisoned, randn

# (M, K, N): decode rows (split-K path) and prefill rows (tile path), N and K off the blocks
SHAPES = [(1, 50, 37), (3, 96, 100), (17, 200, 48), (130, 64, 70)]
EPILOGUE_SHAPES = list(SHAPES)  # every activation x dtype: keep the GPU's compile count sane
if ON_GPU:
    SHAPES += [(1, 768, 2304), (1, 1600, 6400), (64, 1600, 6400), (1, 768, 50257), (1024, 768, 3072),
               (4096, 3072, 768), (130, 1600, 4800)]
    EPILOGUE_SHAPES += [(1, 768, 3072), (1024, 768, 3072)]


def _ref(x, w, **kw):
    kw = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return ref.linear(x.double(), w.double(), **kw)


def _weight(K, N, layout, dtype, device):
    if layout == "conv1d":  # Hugging Face Conv1D: stored (in, out)
        return randn(K, N, dtype=dtype, device=device, scale=K ** -0.5)
    return randn(N, K, dtype=dtype, device=device, scale=K ** -0.5).t()  # nn.Linear, a view


@pytest.mark.parametrize("M,K,N", EPILOGUE_SHAPES)
@pytest.mark.parametrize("activation", kernels.ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_epilogues(M, K, N, activation, dtype, device):
    x = randn(M, K, dtype=dtype, device=device)
    w = _weight(K, N, "conv1d", dtype, device)
    bias = randn(N, dtype=dtype, device=device)
    res = randn(M, N, dtype=dtype, device=device)
    out = poisoned((M, N), dtype, device)
    y = kernels.linear(x, w, bias, activation=activation, residual=res, negative_slope=0.2, out=out)
    assert y.data_ptr() == out.data_ptr()
    expect = _ref(x, w, bias=bias, activation=activation, residual=res, negative_slope=0.2)
    assert_rel_close(y, expect, dtype, f"linear {M}x{K}x{N} {activation}")


@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("layout", ["conv1d", "linear_t"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_layouts_and_plain(M, K, N, layout, dtype, device):
    x = randn(2, M, K, dtype=dtype, device=device)  # leading dims are flattened
    w = _weight(K, N, layout, dtype, device)
    y = kernels.linear(x, w)
    assert y.shape == (2, M, N)
    assert_rel_close(y, _ref(x, w), dtype, f"linear {layout}")


@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_stats", [False, True])
def test_linear_folded_layernorm(M, K, N, dtype, with_stats, device):
    """linear(layernorm(x)) with the layernorm folded in, its statistics from x's rows (prefill
    rows: a loop over K in every tile) or from partial statistics, the mean large."""
    x = randn(M, K, dtype=dtype, device=device, scale=4.0) + 9.0
    w = _weight(K, N, "conv1d", dtype, device)
    g, b = randn(K, dtype=dtype, device=device), randn(K, dtype=dtype, device=device)
    bias = randn(N, dtype=dtype, device=device)
    stats = ref.row_stats(x) if with_stats else None
    y = ln_linear(x, w, bias, g, b, eps=1e-5, activation="gelu_tanh", ln_stats=stats)
    expect = ln_linear_ref(x, w, bias, g, b, eps=1e-5, activation="gelu_tanh")
    assert_rel_close(y, expect, dtype, f"ln+linear {M}x{K}x{N}")


def test_fold_layernorm_keeps_the_weight_layout(device):
    """The folded weight has W's dtype and strides (out-major stays out-major); the shift and
    the column sums are fp32."""
    K, N = 24, 10
    w = randn(N, K, dtype=torch.float16, device=device).t()  # (K, N), out-major
    wf, bf, colsum = kernels.fold_layernorm(w, None, randn(K, device=device), randn(K, device=device))
    assert wf.dtype == torch.float16 and wf.stride() == w.stride()
    assert bf.dtype == colsum.dtype == torch.float32 and bf.shape == colsum.shape == (N,)
    torch.testing.assert_close(colsum, wf.double().sum(0).float())


@pytest.mark.parametrize("M,K,N", [(130, 64, 70)] + ([(512, 768, 3072)] if ON_GPU else []))
def test_linear_autotuned(M, K, N, device, autotuned):
    """Every prefill config the autotuner benchmarks must be right, in place too (restore_value).
    (Decode rows are not autotuned: test_gemv runs every candidate layout.)"""
    dtype = torch.float16 if ON_GPU else torch.float32
    x, w = randn(M, K, dtype=dtype, device=device), randn(K, N, dtype=dtype, device=device, scale=K ** -0.5)
    b, h = randn(N, dtype=dtype, device=device), randn(M, N, dtype=dtype, device=device)
    expect = _ref(x, w, bias=b, activation="gelu_tanh", residual=h)
    kernels.linear(x, w, b, activation="gelu_tanh", residual=h, out=h)
    assert_rel_close(h, expect, dtype, "autotuned linear")


def test_linear_in_place_residual(device):
    x, w = randn(3, 40, device=device), randn(40, 24, device=device)
    h = randn(3, 24, device=device)
    expect = _ref(x, w, residual=h)
    kernels.linear(x, w, residual=h, out=h)  # h += x @ w, GPT-2's residual stream
    assert_rel_close(h, expect, torch.float32)


def test_linear_errors(device):
    x, w = randn(2, 8, device=device), randn(8, 4, device=device)
    with pytest.raises(ValueError, match="weight: expected \\(8, N\\)"):
        kernels.linear(x, randn(7, 4, device=device))
    with pytest.raises(ValueError, match="activation: expected one of"):
        kernels.linear(x, w, activation="swish")
    with pytest.raises(ValueError, match="bias: expected shape"):
        kernels.linear(x, w, randn(5, device=device))
    with pytest.raises(ValueError, match="residual: expected shape"):
        kernels.linear(x, w, residual=randn(2, 5, device=device))
    with pytest.raises(ValueError, match="weight: expected dtype"):
        kernels.linear(x, w.half())
    with pytest.raises(ValueError, match="ln_fold: expected shape"):
        kernels.linear(x, w, ln_fold=randn(8, device=device))
