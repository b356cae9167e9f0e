"""kernels/_epilogue.py's row statistics from whole rows (_row_stats): right, and the same bits in
any order of addition. That order follows how Triton lays a tile over threads (rows, warps, the
Triton version), so without it a row's layernorm would depend on its batch. And the fixed-point
form's adds (_add_row_stats_fixed)."""
import pytest
import torch
import triton
import triton.language as tl

import kernels
from kernels import reference as ref
from kernels._epilogue import _add_row_stats_fixed, _row_stats, row_stats_block, row_terms_pow2
from tests.conftest import ON_GPU

from .helpers import poisoned

EPS = 1e-5


@triton.jit
def _row_stats_kernel(x_ptr, mean_ptr, rstd_ptr, M, stride_xm, ln_eps,
                      K: tl.constexpr, BLOCK_M: tl.constexpr, LN_BLOCK: tl.constexpr, P: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rm < M
    mean, rstd = _row_stats(x_ptr, rm, m_mask, stride_xm, 1, ln_eps, K, BLOCK_M, LN_BLOCK, P)
    tl.store(mean_ptr + rm, mean, mask=m_mask)
    tl.store(rstd_ptr + rm, rstd, mask=m_mask)


def row_stats(x, block_m=16, num_warps=4):
    M, K = x.shape
    mean, rstd = poisoned((M,), torch.float32, x.device), poisoned((M,), torch.float32, x.device)
    _row_stats_kernel[(triton.cdiv(M, block_m),)](x, mean, rstd, M, x.stride(0), EPS, K=K, BLOCK_M=block_m,
                                                   LN_BLOCK=row_stats_block(K), P=row_terms_pow2(K),
                                                   num_warps=num_warps)
    return mean, rstd


def hard_rows(M, K, dtype, device, seed):
    """Rows whose plain sums round differently in different orders: mixed signs over 24 binades
    (fp16: 10), a mean off zero, one row of zeros, one that cancels to a small
    sum, one in fp32's subnormals."""
    g = torch.Generator().manual_seed(seed)
    span = 5 if dtype == torch.float16 else 12
    x = torch.randn(M, K, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(-span, span, (M, K), generator=g)
    x[0] += 8.0  # (_mean_rstd's E[x^2] - mean^2 in fp32 holds while the mean is not far past the spread)
    x[1] = 0.0
    x[2, : K // 2] = x[3, : K // 2]
    x[2, K // 2: 2 * (K // 2)] = -x[3, : K // 2]
    if dtype == torch.float32:
        x[4] = torch.randn(K, generator=g, dtype=torch.float64) * 1e-40
    return x.to(dtype).to(device)


def reference(x):
    x64 = x.double().cpu()
    mean = x64.mean(dim=1)
    var = (x64 * x64).mean(dim=1) - mean * mean
    return mean, 1.0 / torch.sqrt(var.clamp_min(0.0) + EPS)


@pytest.mark.parametrize("K", [5, 96, 600, 1100])  # one chunk short of the grid; several chunks
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_row_stats_match_float64(K, dtype, device):
    x = hard_rows(20, K, dtype, device, seed=K)
    mean, rstd = row_stats(x)
    mean64, rstd64 = reference(x)
    torch.testing.assert_close(mean.cpu().double(), mean64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rstd.cpu().double(), rstd64, rtol=1e-4, atol=0)


@pytest.mark.parametrize("K", [96, 768])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_row_stats_same_bits_in_any_order(K, dtype, device):
    """Columns permuted, rows in tiles of 16 or 64, 1 to 8 warps: the same bits. A plain sum of
    the same rows in the same permutations must differ somewhere, or the rows prove nothing.
    (The interpreter adds with numpy: the permutations change its order; the GPU's layouts too.)"""
    x = hard_rows(64, K, dtype, device, seed=K + 1)
    mean, rstd = row_stats(x)
    plain_differs = False
    g = torch.Generator().manual_seed(K)
    layouts = [(16, 4), (64, 4), (16, 1), (64, 8)] if ON_GPU else [(16, 4), (64, 4)]
    for i, (block_m, warps) in enumerate(layouts):
        xp = x[:, torch.randperm(K, generator=g).to(x.device)].contiguous() if i else x
        m2, r2 = row_stats(xp, block_m, warps)
        assert torch.equal(m2, mean) and torch.equal(r2, rstd), f"bits differ: {block_m}-row tiles, {warps} warps"
        # torch's own sum of a permutation stands for a layout's order
        plain_differs |= not torch.equal(xp.float().sum(dim=1), x.float().sum(dim=1))
    assert plain_differs, "no permutation changed a plain fp32 sum: the rows are too easy"


@triton.jit
def _add_fixed_kernel(vals_ptr, done_ptr, stats_ptr, N, stride_sm, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    vals = tl.load(vals_ptr + b * N + rn, mask=rn < N, other=0.0).to(tl.float32)
    done = tl.load(done_ptr + b * N + rn, mask=rn < N, other=0) != 0
    _add_row_stats_fixed(vals, done & (rn < N), b, tl.program_id(1) * BLOCK_N, N, stats_ptr, stride_sm, BLOCK_N)


@pytest.mark.parametrize("N", [40, 200])  # a partial group; several column blocks
def test_fixed_point_statistics_add_up(N, device):
    """_add_row_stats_fixed, the fixed-point form: columns finished in three launches, each by
    a random share (as decode_attention_proj's heads finish them), add up to the row's exact
    group sums whatever the split; squares within half a unit a column; values that are not
    finite (and the largest fp16 value's square) add nothing or fit; the reader
    (_load_row_stats; here the reference twin of its units) takes the words back."""
    g = torch.Generator().manual_seed(N)
    x = (torch.randn(3, N, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(-12, 8, (3, N), generator=g))
    x = x.half()
    x[0, 1], x[1, 2], x[2, 0] = float("nan"), float("inf"), 65504.0
    stats = kernels.new_row_stats(3, N, device, fixed=True)
    owner = torch.randint(0, 3, (3, N), generator=g)
    xd = x.to(device)
    for k in range(3):
        done = (owner == k).to(torch.int32).to(device)
        _add_fixed_kernel[(3, triton.cdiv(N, 64))](xd, done, stats, N, stats.stride(0), BLOCK_N=64)
    finite = torch.nan_to_num(x.double(), nan=0.0, posinf=0.0)
    groups = torch.nn.functional.pad(finite, (0, -N % 16)).view(3, -1, 16)
    got = ref.fixed_stats_values(stats.cpu())
    assert torch.equal(got[:, 0], groups.sum(-1))
    assert ((got[:, 1] - (groups * groups).sum(-1)).abs() <= 16 * 2.0 ** -17).all()
