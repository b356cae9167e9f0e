import importlib

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
LINEAR_MODULE = importlib.import_module("kernels.linear")  # `kernels.linear` is the function


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
    with pytest.raises(ValueError, match=r"^x: expected at least one feature in its last dim, got shape \(2, 0\)"):
        kernels.linear(x[:, :0], w[:0])
    with pytest.raises(ValueError, match="^out: expected a contiguous tensor$"):  # the kernel writes (M, N) rows
        kernels.linear(x, w, out=torch.empty(4, 2, device=device).t())
    keys = torch.empty(2, 2, dtype=torch.int64, device=device)[:, 0]
    with pytest.raises(ValueError, match="^argmax_keys: expected a contiguous tensor$"):
        kernels.linear(x, w, argmax_keys=keys)


def test_linear_empty_batch(device):
    w, b = randn(8, 4, device=device), randn(4, device=device)
    assert kernels.linear(randn(0, 8, device=device), w, b).shape == (0, 4)
    assert kernels.linear(randn(2, 0, 8, device=device), w, b, activation="gelu_tanh").shape == (2, 0, 4)


def _embedding_layer(V, P, C, N, dtype, device):
    """Tables and a layernorm-folded, out-major layer (the model's first qkv)."""
    wte, wpe = randn(V, C, dtype=dtype, device=device), randn(P, C, dtype=dtype, device=device, scale=0.3)
    g, be = randn(C, dtype=dtype, device=device, scale=0.2) + 1.0, randn(C, dtype=dtype, device=device)
    w, b, colsum = kernels.fold_layernorm(randn(C, N, dtype=dtype, device=device, scale=C ** -0.5),
                                          randn(N, dtype=dtype, device=device), g, be)
    return wte, wpe, w.t().contiguous().t(), b, colsum


# (V, P, C, N): C off a power of two, N off the CUDA-core GEMV's column block; gpt2's qkv on the GPU
EMBED_SHAPES = [(50, 16, 300, 37), (97, 40, 64, 130)] + ([(50257, 1024, 768, 2304)] if ON_GPU else [])


@pytest.mark.parametrize("V,P,C,N", EMBED_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_embedding_linear_one_row_in_one_launch(V, P, C, N, dtype, device, monkeypatch):
    """At one row the first linear's programs gather the embedding themselves: x, y and the
    lengths equal the two ops' bit for bit, and y matches the float64 math."""
    wte, wpe, w, b, colsum = _embedding_layer(V, P, C, N, dtype, device)
    ids = torch.randint(0, V, (1,), device=device)
    pos = torch.randint(0, P, (1,), device=device, dtype=torch.int32)
    lens = torch.full((1,), -7, dtype=torch.int32, device=device)
    x0 = kernels.embedding(ids, pos, wte, wpe)
    y0 = kernels.linear(x0, w, b, ln_fold=colsum)
    monkeypatch.setattr(LINEAR_MODULE, "embedding", None)  # a second launch would fail
    x, y = kernels.embedding_linear(ids, pos, wte, wpe, w, b, ln_fold=colsum, lens_out=lens, early_launch=True)
    assert torch.equal(x, x0) and torch.equal(y, y0)
    assert torch.equal(lens, pos + 1)
    assert_rel_close(y, _ref(x0, w, bias=b, ln_fold=colsum), dtype, f"embedding_linear C={C} N={N}")


def test_embedding_linear_elsewhere_two_ops(device, monkeypatch):
    """More rows (with their statistics), or the fold switched off: the embedding launch and
    `linear`, the same results as calling them."""
    wte, wpe, w, b, colsum = _embedding_layer(60, 20, 96, 100, torch.float32, device)
    ids = torch.tensor([59, 3, 60], device=device)  # 60: outside the table, embeds wpe alone
    pos = torch.tensor([19, 0, 7], device=device, dtype=torch.int32)
    for rows, fold in ((3, True), (1, False)):
        stats = kernels.decode_row_stats(rows, 96, device) if rows > 1 else None
        monkeypatch.setattr(LINEAR_MODULE, "EMBED_FOLD", fold)
        lens = torch.full((rows,), -7, dtype=torch.int32, device=device)
        x, y = kernels.embedding_linear(ids[:rows], pos[:rows], wte, wpe, w, b, ln_fold=colsum, stats=stats,
                                        lens_out=lens)
        x0 = kernels.embedding(ids[:rows], pos[:rows], wte, wpe)
        assert torch.equal(x, x0) and torch.equal(lens, pos[:rows] + 1)
        assert_rel_close(y, _ref(x0, w, bias=b, ln_fold=colsum), torch.float32, f"embedding_linear rows={rows}")
        rx, ry = ref.embedding_linear(ids[:rows], pos[:rows], wte, wpe, w, b, ln_fold=colsum)
        assert torch.equal(rx, x0)
        assert_rel_close(y, ry, torch.float32, "the reference backend")


def test_embedding_linear_errors(device):
    wte, wpe, w, b, colsum = _embedding_layer(10, 4, 8, 12, torch.float32, device)
    ids = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="pos: expected shape"):
        kernels.embedding_linear(ids, ids[:0], wte, wpe, w, b, ln_fold=colsum)
    with pytest.raises(ValueError, match=r"weight: expected \(8, N\)"):
        kernels.embedding_linear(ids, ids, wte, wpe, w[:4], b, ln_fold=colsum)
    with pytest.raises(ValueError, match="ln_fold: expected shape"):
        kernels.embedding_linear(ids, ids, wte, wpe, w, b, ln_fold=colsum[:5])


def test_a_dry_pass_leaves_argmax_keys_alone(device, monkeypatch):
    """Past SMALL_M rows the keys come from a torch reduction of the stored output. Inside
    compile_ahead's dry pass the kernel runs nothing, so that output is unwritten memory: the
    reduction must not max it into the caller's keys (the engine's decode state keeps them
    EMPTY between steps)."""
    from kernels import _tuning
    from kernels.argmax_key import EMPTY
    from kernels.gemv_config import SMALL_M

    monkeypatch.setattr(LINEAR_MODULE, "launch", lambda *args, **kwargs: None)  # a dry launch runs nothing
    M, K, N = SMALL_M + 1, 32, 48
    x, w = randn(M, K, device=device), randn(K, N, device=device)
    keys = torch.full((M,), EMPTY, dtype=torch.int64, device=device)
    with _tuning.dry_launches():
        kernels.linear(x, w, argmax_keys=keys, keys_only=True)
    assert (keys == EMPTY).all()


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
    y = ln_linear(h, w2, None, g, b, ln_stats=stats)
    assert_rel_close(y, ln_linear_ref(h, w2, None, g, b), dtype, f"ln from stats M={M}")


def test_linear_row_stats_errors(device):
    x, w = randn(2, 8, device=device), randn(8, 20, device=device)
    colsum = randn(20, device=device)
    with pytest.raises(ValueError, match=r"stats_out: expected shape \(2, 2, 2\)"):
        kernels.linear(x, w, stats_out=torch.zeros(2, 2, 1, device=device))
    with pytest.raises(ValueError, match="ln_stats: expected dtype"):
        kernels.linear(x, w, ln_fold=colsum, ln_stats=torch.zeros(2, 2, 1, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match=r"ln_fold: expected shape \(20,\)"):
        kernels.linear(x, w, ln_fold=colsum[:8])
    with pytest.raises(ValueError, match="ln_fold: expected dtype"):
        kernels.linear(x, w, ln_fold=colsum.double())
    with pytest.raises(ValueError, match="ln_stats: given without ln_fold"):
        kernels.linear(x, w, ln_stats=torch.zeros(2, 2, 1, device=device))
