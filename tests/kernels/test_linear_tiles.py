"""kernels/linear.py's prefill tile path: tensor descriptors (TMA) against pointer loads, every
tuned and rule layout bit for bit, the layout rule, and the statistics prefill rows do without.
(test_linear.py: the launcher's contract on every path.)"""
import importlib

import pytest
import torch

import kernels
from kernels import reference as ref
from kernels._tuning import config_kwargs
from tests.conftest import ON_GPU
from tests.kernels.helpers import assert_rel_close, ln_linear, poisoned, randn
from tests.kernels.test_linear import LINEAR_MODULE, _ref, _weight


@pytest.mark.parametrize("M,K,N", [(130, 200, 100), (65, 64, 136)]
                         + ([(1024, 768, 3072), (2048, 3072, 768)] if ON_GPU else []))
def test_prefill_tensor_descriptors_same_bits_as_pointer_loads(M, K, N, device, monkeypatch):
    """The prefill tile kernel with x and W by tensor descriptors (TMA) against pointer loads in
    the same layout: the same bits, with K, M and N off the tiles (zero fill past the edges), the
    epilogue's residual and row statistics; and the launcher takes the descriptors by default."""
    if not LINEAR_MODULE._tma_ok(randn(1, 8, dtype=torch.float16, device=device),
                                 _weight(8, 8, "linear_t", torch.float16, device)):
        pytest.skip("tensor descriptors run on Hopper GPUs and the interpreter")
    dtype = torch.float16
    x, w = randn(M, K, dtype=dtype, device=device), _weight(K, N, "linear_t", dtype, device)
    b, h = randn(N, dtype=dtype, device=device), randn(M, N, dtype=dtype, device=device)
    layout = LINEAR_MODULE.tma_config(M, N, K)
    outs = []
    for tma in (True, False):
        stats = kernels.new_row_stats(M, N, device)
        y = kernels.linear(x, w, b, activation="gelu_tanh", residual=h, out=poisoned((M, N), dtype, device),
                           stats_out=stats, _config={**layout, "TMA": tma})
        outs.append((y, stats))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    made = []
    descriptor = LINEAR_MODULE.TensorDescriptor

    class Recorded(descriptor):
        @staticmethod
        def from_tensor(tensor, block_shape, **kw):
            made.append(tuple(block_shape))
            return descriptor.from_tensor(tensor, block_shape, **kw)

    monkeypatch.setattr(LINEAR_MODULE, "TensorDescriptor", Recorded)
    default = kernels.linear(x, w, b, activation="gelu_tanh", residual=h)
    assert made == [(layout["BLOCK_M"], layout["BLOCK_K"]), (layout["BLOCK_N"], layout["BLOCK_K"])]
    assert torch.equal(default, outs[0][0])
    assert_rel_close(default, _ref(x, w, bias=b, activation="gelu_tanh", residual=h), dtype, "linear by TMA")


@pytest.mark.skipif(not ON_GPU, reason="the tuner's configs run on the GPU (the interpreter has one)")
@pytest.mark.parametrize("M,K,N", [(1024, 768, 3072), (130, 1600, 4800), (300, 3072, 768)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_every_prefill_layout_gives_the_same_bits(M, K, N, dtype, device):
    """The autotuner's pick differs between machines, and the TMA rule's layout follows the batch:
    every config it may pick, and the rule's layouts, must give the same bits: the outputs (each
    adds its K products in the same order), their row statistics (stats_out, summed within each
    16-column group) and a folded layernorm's outputs given x's statistics (ln_stats, which prefill
    rows ignore: they standardize x from its rows)."""
    x, w = randn(M, K, dtype=dtype, device=device), _weight(K, N, "linear_t", dtype, device)
    b, h = randn(N, dtype=dtype, device=device), randn(M, N, dtype=dtype, device=device)
    x_stats, colsum = ref.row_stats(x), randn(N, device=device)
    layouts = [config_kwargs(c) for c in LINEAR_MODULE._CONFIGS]
    layouts += [LINEAR_MODULE.tma_config(m, N, K) for m in (M, 4096)]

    def run(layout):
        stats = torch.full_like(ref.row_stats(h), float("nan"))
        y = kernels.linear(x, w, b, activation="gelu_tanh", residual=h, stats_out=stats, _config=layout)
        folded = kernels.linear(x, w, b, ln_fold=colsum, ln_stats=x_stats, _config=layout)
        return {"outputs": y, "stats_out": stats, "ln_stats outputs": folded}

    first = run(layouts[0])
    assert not first["stats_out"].isnan().any()
    for layout in layouts[1:]:
        for what, got in run(layout).items():
            assert torch.equal(got, first[what]), f"{what}: {layout} against {layouts[0]}"


def test_tensor_descriptors_only_where_tma_reads_the_layout(device):
    """fp32, Conv1D (in, out) weights, rows not 16-byte aligned (K = 50) and a base off 16 bytes
    take the pointer loads."""
    ok = LINEAR_MODULE._tma_ok
    h = dict(dtype=torch.float16, device=device)
    x, w = randn(4, 64, **h), _weight(64, 32, "linear_t", torch.float16, device)
    if not ok(x, w):
        pytest.skip("tensor descriptors run on Hopper GPUs and the interpreter")
    assert not ok(x.float(), w.float())
    assert not ok(x, _weight(64, 32, "conv1d", torch.float16, device))
    assert not ok(randn(4, 50, **h), _weight(50, 32, "linear_t", torch.float16, device))
    assert not ok(randn(4, 65, **h)[:, 1:], w)


def test_tma_config_takes_128_row_tiles_for_large_layers():
    cfg = LINEAR_MODULE.tma_config
    rows = lambda M, N, K: (cfg(M, N, K)["BLOCK_M"], cfg(M, N, K)["num_warps"], cfg(M, N, K)["num_stages"])
    assert rows(1024, 2304, 768) == (64, 4, 3) and rows(1024, 3072, 768) == (64, 4, 3)  # gpt2 qkv, fc
    assert rows(2048, 3072, 768) == (128, 8, 3) and rows(1024, 5120, 1280) == (128, 8, 3)
    assert rows(1024, 768, 768) == (64, 4, 4) and rows(2048, 768, 3072) == (64, 4, 4)  # gpt2 attn-out, mlp-out
    assert rows(1024, 1600, 6400) == (128, 4, 4)  # gpt2-xl mlp-out


def test_prefill_row_stats_only_where_linear_reads_them(device):
    """Past SMALL_M rows linear standardizes x from its rows and ignores ln_stats: no buffer."""
    small_m = importlib.import_module("kernels.gemv_config").SMALL_M
    assert kernels.prefill_row_stats(small_m + 1, 768, device) is None
    assert kernels.prefill_row_stats(small_m, 768, device).shape == (small_m, 2, 48)
    x, w = randn(small_m + 1, 40, device=device), randn(40, 24, device=device, scale=40 ** -0.5)
    g, b = randn(40, device=device), randn(40, device=device)
    poison = torch.full((small_m + 1, 2, 3), float("nan"), device=device)
    assert torch.equal(ln_linear(x, w, None, g, b, ln_stats=poison), ln_linear(x, w, None, g, b))
