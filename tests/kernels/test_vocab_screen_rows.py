"""The screened vocabulary head past one row (kernels/vocab_screen_rows.py): each row's argmax key
is the one the one-row full head (vocab_fma.py, through `linear`) gives that row alone, bit for
bit; the screen's maxima hold every logit; ties go to the lowest column; a NaN row names no token
and leaves the others alone; and where it runs."""
import pytest
import torch

import kernels
from kernels import argmax_key, vocab_screen_rows
from tests.conftest import ON_GPU
from tests.kernels.helpers import DTYPES, poisoned, randn
from tests.kernels.test_vocab_screen import N_ODD, _head


def _rows(M, K, dtype, device, seed=0):
    """M rows of unlike scale and mean: one off zero by 8 of its std (the variance loses digits), one with a single large value (its chunk's int8 scale), the rest random."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g, dtype=torch.float64) * (0.5 + torch.rand(M, 1, generator=g, dtype=torch.float64) * 3)
    x += torch.randn(M, 1, generator=g, dtype=torch.float64)
    x[0] = (x[0] - x[0].mean()) / x[0].std() + 8.0
    if M > 2:
        x[2, K // 3] = 60.0
    return x.to(dtype=dtype, device=device)


def _alone(x, wf, bf, colsum):
    """Each row's key and logits (M, N) in fp32 from the one-row full head, row by row."""
    keys, ys = [], []
    for row in x:
        key, y = torch.full((1,), argmax_key.EMPTY, dtype=torch.int64, device=x.device), poisoned(
            (1, wf.shape[1]), x.dtype, x.device)
        kernels.linear(row[None], wf, bf, ln_fold=colsum, argmax_keys=key, out=y)
        keys.append(key)
        ys.append(y[0].float())
    return torch.cat(keys), torch.stack(ys)


def _screened(x, wf, bf, colsum):
    """(keys (M,), the screen's maxima) from the screened head at all rows at once."""
    screen = kernels.screen_head(wf, bf, colsum)
    assert screen is not None
    keys = torch.full((x.shape[0],), argmax_key.EMPTY, dtype=torch.int64, device=x.device)
    maxima = {}
    kernels.screened_argmax(x, wf, bf, colsum, 1e-5, screen, keys, maxima=maxima)
    return keys, maxima


def _check_maxima(maxima, y, K):
    """Every group's and block's largest upper end at or above each of its logits (no tolerance)."""
    M, N = y.shape
    groups, blocks = maxima["groups"].float(), maxima["blocks"].float()
    G = vocab_screen_rows.group_n(K)
    per_block = vocab_screen_rows.rows_config(M)["BLOCK_N"] // G
    padded = torch.full((M, groups.shape[1] * G), float("-inf"), device=y.device)
    padded[:, :N] = y
    below = (groups < padded.view(M, -1, G).amax(2)).nonzero()
    assert below.numel() == 0, f"group maxima below a logit at (row, group) {below[:5].tolist()}"
    rb = torch.arange(groups.shape[1], device=y.device) // per_block
    for b in range(blocks.shape[1]):
        assert (blocks[:, b] >= groups[:, rb == b].amax(1)).all(), f"block {b}"
    return groups


@pytest.mark.parametrize("K,M", [(48, 5), (112, 3), (256, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_keys_are_the_one_row_heads(K, M, dtype, device):
    """Random heads (a mean to take out, a bias) and rows of unlike scale: each row's key equals
    the one-row full head's for that row alone, and the screen's maxima hold every logit. K is
    a multiple of 16 (rows 16-byte aligned, as a model's are): on a GPU the one-row head reads
    a row at another alignment in another layout, whose sums may round differently."""
    _, wf, bf, colsum = _head(K, N_ODD, dtype, device, seed=K)
    x = _rows(M, K, dtype, device, seed=K)
    full, y = _alone(x, wf, bf, colsum)
    keys, maxima = _screened(x, wf, bf, colsum)
    assert torch.equal(keys, full), f"columns {argmax_key.argmax_index(keys).tolist()} against " \
                                    f"{argmax_key.argmax_index(full).tolist()}"
    groups = _check_maxima(maxima, y, K)
    # the screen is tight enough to leave only a few groups a row (what makes it fast), but for
    # row 0, whose variance is known to a few digits only (its bound is as wide)
    assert (groups >= y.amax(1, keepdim=True)).sum(1)[1:].max().item() <= 16


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rows_ties_and_near_ties(dtype, device):
    """Copies of row 1's best column, some a hair smaller, in other blocks and groups: the lowest
    tied column wins, as in the one-row full head."""
    K, M = 64, 3
    _, wf, bf, colsum = _head(K, N_ODD, dtype, device, seed=3)
    x = _rows(M, K, dtype, device, seed=3)
    best = argmax_key.argmax_index(_alone(x, wf, bf, colsum)[0])[1].item()
    copies = [3, 1000, best + 1 if best + 1 < N_ODD else 7, N_ODD - 1]
    wf, bf = wf.clone(), bf.clone()
    for i, c in enumerate(copies):
        wf[:, c] = wf[:, best]
        bf[c] = bf[best] - i * 1e-6 * abs(bf[best].item())  # the first copy exact, then a hair below
    colsum = wf.double().sum(0).float()
    full, y = _alone(x, wf, bf, colsum)
    keys, maxima = _screened(x, wf, bf, colsum)
    assert (y[1] == y[1].max()).sum().item() >= 2, "the copies must tie after rounding"
    assert torch.equal(keys, full) and argmax_key.argmax_index(keys)[1].item() == 3
    _check_maxima(maxima, y, x.shape[1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_rows_nan_row_names_no_token(bad, device):
    """NaN or inf in one row: that row names no token (index N), the others their argmax."""
    _, wf, bf, colsum = _head(48, N_ODD, torch.float32, device)
    x = _rows(4, 48, torch.float32, device)
    x[2, 11] = bad
    full, _ = _alone(x, wf, bf, colsum)
    keys, _ = _screened(x, wf, bf, colsum)
    assert torch.equal(keys, full)
    assert argmax_key.argmax_index(keys).tolist()[2] == N_ODD and max(argmax_key.argmax_index(keys)[[0, 1, 3]]) < N_ODD


def test_rows_leave_a_larger_key(device):
    """A key already in a row's word that outranks the row's stays; the other rows get theirs."""
    _, wf, bf, colsum = _head(48, N_ODD, torch.float32, device)
    x = _rows(3, 48, torch.float32, device)
    full, _ = _alone(x, wf, bf, colsum)
    big = (0x7F000000 << 32) | 5  # a key of 1.7e38 at column 2**31 - 6
    keys = torch.full((3,), argmax_key.EMPTY, dtype=torch.int64, device=device)
    keys[1] = big
    kernels.screened_argmax(x, wf, bf, colsum, 1e-5, kernels.screen_head(wf, bf, colsum), keys)
    assert keys[1].item() == big and keys[0] == full[0] and keys[2] == full[2]


def test_screens_rows(monkeypatch, device):
    """1 to MAX_ROWS rows; more is a clear error; switched off, one row only."""
    assert kernels.screens_rows(1) and kernels.screens_rows(2) and kernels.screens_rows(vocab_screen_rows.MAX_ROWS)
    assert not kernels.screens_rows(vocab_screen_rows.MAX_ROWS + 1)
    _, wf, bf, colsum = _head(40, N_ODD, torch.float32, device)
    x = randn(vocab_screen_rows.MAX_ROWS + 1, 40, device=device)
    keys = torch.full((len(x),), argmax_key.EMPTY, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="x2: expected 1 to 64 rows"):
        kernels.screened_argmax(x, wf, bf, colsum, 1e-5, kernels.screen_head(wf, bf, colsum), keys)
    monkeypatch.setattr(vocab_screen_rows, "ENABLED", False)
    assert kernels.screens_rows(1) and not kernels.screens_rows(2)


@pytest.mark.skipif(not ON_GPU, reason="gpt2's head at 64 rows takes minutes in the interpreter")
def test_rows_gpt2_shape_on_gpu(device):
    """gpt2's head (K = 768, fp16) at 8 and 64 rows on the GPU, with the layout the engine runs:
    each row the one-row full head's key."""
    _, wf, bf, colsum = _head(768, 50257, torch.float16, device)
    for M in (8, 64):
        x = _rows(M, 768, torch.float16, device, seed=M)
        full, y = _alone(x, wf, bf, colsum)
        keys, maxima = _screened(x, wf, bf, colsum)
        assert torch.equal(keys, full), f"M {M}: rows {(keys != full).nonzero().flatten().tolist()}"
        _check_maxima(maxima, y, x.shape[1])
