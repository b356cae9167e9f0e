"""The screened one-row vocabulary head (kernels/vocab_screen.py, its int8 copy built by
_screen_head.py): its argmax key is the full head's (vocab_fma.py, through `linear`) bit for bit,
every column's upper end holds the full head's logit, ties and near-ties go to the lowest column,
NaN rows name no token, and where it runs."""
import re

import pytest
import torch

import kernels
from kernels import _screen_head, argmax_key, gemv_fma, reference, vocab_fma, vocab_screen
from kernels._workspace import screen_scratch
from tests.conftest import ON_GPU
from tests.kernels.helpers import DTYPES, poisoned, randn
from tests.kernels.test_vocab_fma import _head as vocab_head
from tests.kernels.test_vocab_fma import _keys

N_ODD = gemv_fma.VOCAB_N + 27  # a vocabulary whose last column block is partial
NARROW_BLOCK_N = 512  # under the interpreter: N_ODD in 33 blocks, more than its 24 programs


@pytest.fixture(autouse=True)
def _several_blocks_a_program(monkeypatch):
    """The interpreter's default layout gives each program one wide block (engine tests' time);
    a GPU's programs loop over several, and these tests check that loop."""
    monkeypatch.setattr(vocab_screen, "INTERPRET_BLOCK_N", NARROW_BLOCK_N)


def test_interpreter_layout_loops_over_blocks(monkeypatch):
    """What the fixture is for: programs that take two blocks each (the last one partial), some
    of them only one, so the loop's prefetch past the end and its masks run."""
    monkeypatch.setattr(vocab_screen, "INTERPRET", True)
    meta = vocab_screen.screen_config(N_ODD, 40, sms=2)  # the interpreter's 2 SMs
    blocks = -(-N_ODD // meta["BLOCK_N"])
    assert meta["programs"] < blocks < 2 * meta["programs"] and N_ODD % meta["BLOCK_N"]


def _head(K, N, dtype, device, seed=0):
    """(x, weight, bias, colsum) of test_vocab_fma's folded-layernorm head (a mean to take out,
    a bias, out-major weights as the model holds its lm_head), drawn from `seed`."""
    torch.manual_seed(seed)
    x, wf, bf, colsum, *_ = vocab_head(K, N, dtype, device)
    return x, wf, bf, colsum


def _both(x, wf, bf, colsum):
    """(the full head's key, its logits (N,) in fp32, the screen's key, its upper ends (N,) in fp32)."""
    full, y = _keys(x.device), poisoned((1, wf.shape[1]), x.dtype, x.device)
    kernels.linear(x, wf, bf, ln_fold=colsum, argmax_keys=full, out=y)
    screen = kernels.screen_head(wf, bf, colsum)
    assert screen is not None
    keys, upper = _keys(x.device), poisoned((screen.meta.shape[1],), x.dtype, x.device)
    kernels.screened_argmax(x, wf, bf, colsum, 1e-5, screen, keys, upper=upper)
    return full, y[0].float(), keys, upper[:wf.shape[1]].float()


def _seeds(case):
    """The random draws a test checks: two on the GPU; under the interpreter one (CI time), a
    different one for each parametrized case, so the cases together still see several."""
    return range(2) if ON_GPU else [case]


def _check_screen(K, dtype, device, seed):
    """A random head's screen against its full head: the same key, every column's upper end at or
    above the full head's rounded logit (no tolerance), and only a few columns left to compute."""
    x, wf, bf, colsum = _head(K, N_ODD, dtype, device, seed=seed)
    full, y, keys, upper = _both(x, wf, bf, colsum)
    assert torch.equal(keys, full), f"K {K} seed {seed}: column {argmax_key.argmax_index(keys).item()} " \
                                    f"against {argmax_key.argmax_index(full).item()}"
    below = (upper < y).nonzero()
    assert below.numel() == 0, f"K {K} seed {seed}: upper ends below the logits at columns {below[:5].tolist()}"
    # the screen is tight enough to rule out all but a few columns (what makes it fast)
    assert (upper >= y.max()).sum().item() <= 16


@pytest.mark.parametrize("K", [40, 100])
@pytest.mark.parametrize("dtype", DTYPES)
def test_screen_key_is_the_full_heads(K, dtype, device):
    """Random heads with a mean to take out and a bias: the screen holds (_check_screen)."""
    for seed in _seeds(2 * (K == 100) + (dtype == torch.float16)):
        _check_screen(K, dtype, device, seed)


def test_screen_without_upper_uses_the_shared_scratch(device):
    """Without `upper` the upper ends go to the workspace's scratch, the one buffer of the device
    and dtype (a decode step without CUDA graphs allocates nothing for them), and the key is the
    one the call with `upper` gives (test_screen_key_is_the_full_heads: the full head's)."""
    dtype = torch.float16
    x, wf, bf, colsum = _head(100, N_ODD, dtype, device, seed=5)
    screen = kernels.screen_head(wf, bf, colsum)
    n_pad = screen.meta.shape[1]
    keys, upper = _keys(device), poisoned((n_pad,), dtype, device)
    kernels.screened_argmax(x, wf, bf, colsum, 1e-5, screen, keys, upper=upper)
    scratch = screen_scratch(device, n_pad, dtype)
    scratch.fill_(float("nan"))
    again = _keys(device)
    kernels.screened_argmax(x, wf, bf, colsum, 1e-5, screen, again)
    assert torch.equal(again, keys)
    assert screen_scratch(device, n_pad, dtype) is scratch
    assert torch.equal(scratch[:N_ODD], upper[:N_ODD])


@pytest.mark.parametrize("dims", [[7], [0, 33, 99], [5, 6, 50, 71, 98]])
@pytest.mark.parametrize("dtype", DTYPES)
def test_screen_rows_with_outlier_dimensions(dims, dtype, device):
    """Rows with a few dimensions 40 times the rest's scale, as trained models' last layers have,
    small gains there and larger ones elsewhere (the logits' spread comes from the other
    dimensions): the key is the full head's, and the row's finer grid (ROW_RADIX) leaves at most
    16 columns to compute (on int8's grid, 36 to 76 at seed 0; before session 129's bound, 58 to
    130)."""
    K = 100
    rest = torch.ones(K, dtype=torch.bool, device=device)
    rest[dims] = False
    sign = torch.tensor([1.0, -1.0] * 3, device=device)[:len(dims)]
    for seed in _seeds(2 * len(dims) + (dtype == torch.float16)):
        x, wf, bf, _ = _head(K, N_ODD, dtype, device, seed=seed)
        x[0, dims] = (80.0 * sign).to(dtype)
        wf = torch.where(rest[:, None], wf * 4, wf * 0.05)
        bf = bf * 0.1
        colsum = wf.double().sum(0).float()
        full, y, keys, upper = _both(x, wf, bf, colsum)
        assert torch.equal(keys, full), f"dims {dims} seed {seed}"
        assert (upper >= y).all()
        if vocab_screen.ROW_RADIX > 1:
            left = (upper >= y.max()).sum().item()
            assert left <= 16, f"dims {dims} seed {seed}: {left} columns to compute"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_screen_ties_and_near_ties(dtype, device):
    """Copies of the best column, some a hair smaller (so they round to the same logit or just
    below it), spread over programs and blocks: the lowest of the tied columns wins, as in the
    full head, even where a copy comes before the original."""
    K = 64
    x, wf, bf, colsum = _head(K, N_ODD, dtype, device, seed=3)
    full, y, _, _ = _both(x, wf, bf, colsum)
    best = argmax_key.argmax_index(full).item()
    copies = [3, 1000, best + 1 if best + 1 < N_ODD else 7, N_ODD - 1]
    wf, bf = wf.clone(), bf.clone()
    for i, c in enumerate(copies):
        wf[:, c] = wf[:, best]
        bf[c] = bf[best] - i * 1e-6 * abs(bf[best].item())  # the first copy exact, then a hair below
    colsum = wf.double().sum(0).float()
    full, y, keys, upper = _both(x, wf, bf, colsum)
    assert (y == y.max()).sum().item() >= 2, "the copies must tie after rounding"
    assert torch.equal(keys, full) and argmax_key.argmax_index(keys).item() == y.argmax().item() == 3
    assert (upper >= y).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_screen_nan_input_names_no_token(bad, device):
    """NaN or inf in the row: no token (index N), as the full head gives it."""
    x, wf, bf, colsum = _head(40, N_ODD, torch.float32, device)
    x[0, 11] = bad
    full, _, keys, _ = _both(x, wf, bf, colsum)
    assert torch.equal(keys, full) and argmax_key.argmax_index(keys).item() == N_ODD


def test_screen_leaves_a_larger_key(device):
    """A key already in the word that outranks the row's stays (the keys only ever rise)."""
    x, wf, bf, colsum = _head(40, N_ODD, torch.float32, device)
    screen = kernels.screen_head(wf, bf, colsum)
    big = (0x7F000000 << 32) | 5  # a key of 1.7e38 at column 2**31 - 6
    keys = torch.full((1,), big, dtype=torch.int64, device=device)
    kernels.screened_argmax(x, wf, bf, colsum, 1e-5, screen, keys)
    assert keys.item() == big


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_screen_reads_int32_fixed_point_words(dtype, device):
    """x as int32 fixed-point words (x_unit, a residual stream summed by integer atomics): the key
    the same row gives in fp32, which (with fp32 weights) is the full head's."""
    unit = 2.0 ** -16
    for seed in _seeds(int(dtype == torch.float16)):
        x, wf, bf, colsum = _head(100, N_ODD, dtype, device, seed=seed)
        words = torch.round(x.float() / unit).to(torch.int32)
        x32 = words.float() * unit  # exact: the words are below 2**24
        screen = kernels.screen_head(wf, bf, colsum)
        want, got = _keys(device), _keys(device)
        kernels.screened_argmax(x32, wf, bf, colsum, 1e-5, screen, want)
        kernels.screened_argmax(words, wf, bf, colsum, 1e-5, screen, got, x_unit=unit)
        assert torch.equal(got, want), f"seed {seed}"
        if dtype == torch.float32:
            full = _keys(device)
            kernels.linear(x32, wf, bf, ln_fold=colsum, argmax_keys=full)
            assert torch.equal(got, full), f"seed {seed}"


@pytest.mark.parametrize("x_dtype, x_unit, expect", [
    (torch.float32, 2.0 ** -16, "x_unit: expected a unit exactly for int32 words x2, got 1.52587890625e-05 for "
                                "torch.float32"),
    (torch.int32, None, "x_unit: expected a unit exactly for int32 words x2, got None for torch.int32"),
    (torch.int32, 3e-5, "x_unit: expected a power of two, got 3e-05"),
])
def test_screen_refuses_a_unit_that_does_not_fit(x_dtype, x_unit, expect):
    x, wf, bf, colsum = _head(40, N_ODD, torch.float32, "cpu")
    screen = kernels.screen_head(wf, bf, colsum)
    with pytest.raises(ValueError, match=re.escape(expect)):
        kernels.screened_argmax(x.to(x_dtype), wf, bf, colsum, 1e-5, screen, _keys("cpu"), x_unit=x_unit)


def test_screen_head_bounds(device):
    """The int8 copy: weights within [-127, 127], and E, W, |colsum| no smaller than the exact
    norms of the rounding errors and of the columns (fp64), the bias as given, the padding inert."""
    K = 40
    _, wf, bf, colsum = _head(K, N_ODD, torch.float16, device)
    screen = kernels.screen_head(wf, bf, colsum)
    q = screen.q.view(torch.int8).reshape(N_ODD, K).double().cpu()
    assert q.abs().max() <= 127
    w = wf.t().double().cpu()
    meta = screen.meta.double().cpu()
    assert meta.shape == (5, N_ODD + 5) and (meta[0, N_ODD:] == 1).all() and (meta[1:, N_ODD:] == 0).all()
    s = meta[0, :N_ODD]
    assert ((w - s[:, None] * q).norm(dim=1) <= meta[1, :N_ODD]).all()
    assert (w.norm(dim=1) <= meta[2, :N_ODD]).all() and torch.equal(meta[3, :N_ODD], colsum.double().abs().cpu())
    assert torch.equal(meta[4, :N_ODD], bf.double().cpu())


def test_screen_head_in_slices_is_the_same(device, monkeypatch):
    """The copy built a few columns at a time (as a real head is, to bound the memory) equals
    the copy built at once."""
    _, wf, bf, colsum = _head(40, N_ODD, torch.float16, device)
    whole = kernels.screen_head(wf, bf, colsum)
    monkeypatch.setattr(_screen_head, "BUILD_COLUMNS", 1000)  # N_ODD is no multiple of it
    sliced = kernels.screen_head(wf, bf, colsum)
    assert torch.equal(whole.q, sliced.q) and torch.equal(whole.meta, sliced.meta)


def test_screen_head_where_it_runs(device, monkeypatch):
    """A screen for out-major vocabulary heads up to MAX_SCREEN_K with K a multiple of 4 and
    finite biases; None otherwise, with the switch off, and on the torch backend."""
    def head(K, N, **kw):
        _, wf, bf, colsum = _head(K, N, torch.float16, device)
        return wf.t().contiguous() if kw.get("in_major") else wf, bf, colsum

    assert kernels.screen_head(*head(40, N_ODD)) is not None
    assert kernels.screen_head(*head(40, 4096)) is None  # not a vocabulary
    assert kernels.screen_head(*head(42, N_ODD)) is None  # K not a multiple of 4
    wide = torch.empty(_screen_head.MAX_SCREEN_K + 4, N_ODD, dtype=torch.float16, device=device).t().contiguous().t()
    assert kernels.screen_head(wide, None, torch.zeros(N_ODD, device=device)) is None  # K past MAX_SCREEN_K
    w, b, c = head(40, N_ODD)
    b[5] = float("-inf")
    assert kernels.screen_head(w, b, c) is None  # a bias that is not finite
    assert reference.screen_head(*head(40, N_ODD)) is None
    monkeypatch.setattr(_screen_head, "ENABLED", False)
    assert kernels.screen_head(*head(40, N_ODD)) is None


def test_screen_past_vocab_fma_and_exact_dots(device, monkeypatch):
    """K = 1100: past vocab_fma's MAX_K (the screen's wide blocks) and past EXACT_DOT_K, where a
    column's int8 dot product may round on its way to fp32. The screen holds (_check_screen)
    against the full head computed by vocab_fma, let run that wide here."""
    K = 1100
    assert vocab_fma.MAX_K < K <= vocab_screen.MAX_SCREEN_K and K > vocab_screen.EXACT_DOT_K
    monkeypatch.setattr(vocab_fma, "MAX_K", 2048)
    _check_screen(K, torch.float16, device, seed=0)


def test_screen_layout_by_width(monkeypatch):
    """8-column blocks up to K = 1024 (gpt2, gpt2-medium), 4 past it (MAX_BLOCK_WORDS), 12 programs
    an SM; MINILLM_SCREEN_LAYOUT's layout wherever it is set. The program count is capped by the
    blocks and by the SMs' share."""
    monkeypatch.setattr(vocab_screen, "INTERPRET", False)
    monkeypatch.setattr(vocab_screen, "FORCED_LAYOUT", None)
    for K, cols in ((64, 8), (768, 8), (1024, 8), (1028, 4), (1280, 4), (1600, 4), (2048, 4)):
        meta = vocab_screen.screen_config(50257, K, sms=132)
        assert (meta["BLOCK_N"], meta["per_sm"], meta["programs"]) == (cols, 12, 132 * 12), K
    assert vocab_screen.screen_config(50257, 4096, sms=132)["BLOCK_N"] == 2  # past MAX_SCREEN_K's default
    assert vocab_screen.screen_config(100, 768, sms=132)["programs"] == 13  # 100 columns: 13 blocks
    monkeypatch.setattr(vocab_screen, "FORCED_LAYOUT", (4, 24))
    for K in (768, 1600):
        meta = vocab_screen.screen_config(50257, K, sms=132)
        assert (meta["BLOCK_N"], meta["per_sm"]) == (4, 24)


@pytest.mark.skipif(not ON_GPU, reason="the programs are fitted to the compiled kernel's registers on a GPU")
@pytest.mark.parametrize("K,rows", [(768, 64), (1600, 32)])
def test_screen_model_shapes_on_gpu(K, rows, device, monkeypatch):
    """gpt2's head (K = 768) and gpt2-xl's (1600, 4-column blocks of int8) in fp16 on the GPU, with
    the layout the engine runs (dp4a, programs fitted to the SMs): random rows, each the key of
    the full head computed by vocab_fma (let run gpt2-xl's width here); every fourth row with two
    outlier dimensions."""
    monkeypatch.setattr(vocab_fma, "MAX_K", 2048)
    x, wf, bf, colsum = _head(K, 50257, torch.float16, device)
    screen = kernels.screen_head(wf, bf, colsum)
    assert vocab_screen.screen_config(50257, K, sms=132)["BLOCK_N"] == (8 if K <= 1024 else 4)
    for row in range(rows):
        x = randn(1, K, dtype=torch.float16, device=device, scale=1 + 4 * row / rows) + row / rows
        if row % 4 == 3:  # outlier dimensions, 50 times the rest
            x[0, [row, K - 1 - row]] = torch.tensor([50.0, -50.0], device=device, dtype=x.dtype) * (1 + 4 * row / rows)
        full, keys = _keys(device), _keys(device)
        kernels.linear(x, wf, bf, ln_fold=colsum, argmax_keys=full)
        kernels.screened_argmax(x, wf, bf, colsum, 1e-5, screen, keys)
        assert torch.equal(keys, full), f"K {K} row {row}"
