"""kernels/_prefetch.py: the L2 prefetch hint that decode kernels issue for the next kernel's
weights. A hint changes no result: with it, every launcher's output is bit-identical to the
same launch without it (on the GPU, where the instruction runs; the interpreter has none)."""
import pytest
import torch

import kernels
from kernels._prefetch import CAP, _is_dense, prefetch_args
from tests.conftest import ON_GPU
from tests.kernels.helpers import poisoned, randn


def test_dense_layouts():
    w = torch.empty(64, 48)
    assert _is_dense(w) and _is_dense(w.t()) and _is_dense(w.view(8, 8, 48).permute(2, 0, 1))
    assert not _is_dense(w[:, :40]) and not _is_dense(w[::2])
    assert _is_dense(torch.empty(0, 5)) and _is_dense(w[:1])


def test_prefetch_errors(device):
    x, w = randn(2, 32, device=device), randn(32, 24, device=device)
    with pytest.raises(ValueError, match="prefetch: expected a torch.Tensor"):
        kernels.linear(x, w, prefetch=[w])
    with pytest.raises(ValueError, match="prefetch: expected a tensor over one dense range"):
        kernels.linear(x, w, prefetch=w[:, :20])
    q = randn(1, 2, 16, device=device)
    k = randn(1, 2, 8, 16, device=device)
    with pytest.raises(ValueError, match="prefetch: expected a tensor over one dense range"):
        kernels.decode_attention(q, k, k, torch.ones(1, dtype=torch.int32, device=device), prefetch=k[..., ::2])
    ids = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="prefetch: expected a torch.Tensor"):
        kernels.embedding(ids, ids, w, w, prefetch=3)


def test_prefetch_args(device):
    w = randn(300, 7, dtype=torch.float16, device=device)
    t, nbytes = prefetch_args(w.t(), w.device)
    if ON_GPU and torch.cuda.get_device_capability(w.device)[0] >= 9:
        assert t is not None and nbytes == 300 * 7 * 2 // 16 * 16  # whole 16-byte units
        big = torch.empty(CAP // 2 + 100, dtype=torch.float16, device=device)
        assert prefetch_args(big, big.device)[1] == CAP
    else:
        assert (t, nbytes) == (None, 0)  # no instruction here: the kernels skip it
    assert prefetch_args(None, device) == (None, 0)


@pytest.mark.skipif(not ON_GPU, reason="the interpreter has no L2 prefetch: on the CPU this compares a launch with itself")
@pytest.mark.parametrize("M,K,N", [(1, 768, 2304), (5, 300, 200), (64, 1600, 6400)])
def test_results_unchanged(M, K, N, device):
    dtype = torch.float16
    x, w = randn(M, K, dtype=dtype, device=device), randn(K, N, dtype=dtype, device=device, scale=K ** -0.5)
    b, lnw, lnb = (randn(n, dtype=dtype, device=device) for n in (N, K, K))
    other = randn(4 * N + 3, K, dtype=dtype, device=device)  # the "next weight": any dense tensor
    outs = []
    for pf in (None, other, other.t()):
        y = poisoned((M, N), dtype, device)
        kernels.linear(x, w, b, activation="gelu_tanh", ln_weight=lnw, ln_bias=lnb, out=y, prefetch=pf)
        outs.append(y)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])

    q, kc, vc = randn(M, 12, 64, dtype=dtype, device=device), *(randn(M, 12, 300, 64, dtype=dtype, device=device)
                                                              for _ in range(2))
    lens = torch.randint(1, 301, (M,), dtype=torch.int32, device=device)
    a = kernels.decode_attention(q, kc, vc, lens)
    assert torch.equal(a, kernels.decode_attention(q, kc, vc, lens, prefetch=other))

    wte, wpe = randn(50, K, dtype=dtype, device=device), randn(20, K, dtype=dtype, device=device)
    ids, pos = torch.randint(0, 50, (M,), device=device), torch.randint(0, 20, (M,), device=device)
    assert torch.equal(kernels.embedding(ids, pos, wte, wpe), kernels.embedding(ids, pos, wte, wpe, prefetch=other))
