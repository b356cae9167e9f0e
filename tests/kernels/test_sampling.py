"""kernels/sampling.py against kernels.reference.sample_logits (transformers' processors, softmax
and argmax(p / q)) on the same q: the ids must be equal. Shapes stay small for the interpreter
(each call sorts in Python there); the GPU runs the vocabulary of gpt2 too."""
import pytest
import torch

import kernels
from kernels import reference as ref
from kernels.noise import new_exponential_noise, seed_bits
from kernels.sampling import MAX_MERGED_ROWS, MAX_TOP_K
from tests.conftest import ON_GPU


def _inputs(B, V, device, dtype=torch.float16, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=g) * scale).to(dtype).to(device)
    q = torch.empty(B, V).exponential_(1, generator=g).to(device)
    seen = (torch.rand(B, V, generator=g) < 0.1).to(device)
    return logits, q, seen


def _check(logits, q, top_k, temperature=1.0, top_p=1.0, penalty=1.0, seen=None):
    out = torch.full((logits.shape[0],), -7, dtype=torch.int64, device=logits.device)  # poisoned
    got = kernels.sample_logits(logits, q, top_k, temperature, top_p, penalty, seen, out=out)
    expect = ref.sample_logits(logits, q, top_k, temperature, top_p, penalty, seen)
    assert got is out and torch.equal(got, expect), (got.tolist(), expect.tolist())
    return got


CASES = [  # (B, V, top_k, temperature, top_p, penalty)
    (1, 777, 50, 1.0, 1.0, 1.0),    # transformers' default top_k; V not a power of two
    (3, 1000, 1, 0.7, 1.0, 1.0),    # top_k 1: the argmax
    (2, 1500, 10, 0.7, 0.9, 1.3),   # every processor, several tiles
    (2, 300, MAX_TOP_K, 1.3, 0.95, 1.0),  # the largest top_k the kernel takes
    (2, 40, 50, 1.0, 0.5, 1.0),     # top_k past V: all of them
    (2, 300, MAX_TOP_K, 0.8, 1.0, 1.2),  # without top-p the k-th value comes from the lists' values
    (2, 40, 50, 1.0, 1.0, 1.0),     # past V without top-p
]


@pytest.mark.parametrize("B,V,top_k,temperature,top_p,penalty", CASES)
def test_sample_logits_matches_reference(B, V, top_k, temperature, top_p, penalty, device):
    logits, q, seen = _inputs(B, V, device, seed=V)
    _check(logits, q, top_k, temperature, top_p, penalty, seen)


@pytest.mark.skipif(not ON_GPU, reason="the interpreter takes minutes over a 50257-token vocabulary")
@pytest.mark.parametrize("B", [1, 64])
@pytest.mark.parametrize("top_k,top_p", [(50, 1.0), (50, 0.95), (128, 0.9), (5, 1.0)])
def test_sample_logits_gpt2_vocabulary(B, top_k, top_p, device):
    for seed in range(3):
        logits, q, seen = _inputs(B, 50257, device, seed=seed)
        _check(logits, q, top_k, 0.8, top_p, 1.2, seen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_logits_dtypes(dtype, device):
    logits, q, _ = _inputs(2, 300, device, dtype=dtype, seed=5)
    for top_p in (0.9, 1.0):
        _check(logits, q, 20, 0.9, top_p)


def test_ties(device):
    """Scores rounded to a coarse grid tie everywhere; a constant row ties across the whole
    vocabulary (more columns at the k-th value than any tile lists: the kernel scans the row),
    and top-p then splits the tie group (lowest columns dropped first, as a stable sort). 80 ties
    at the top of a row outnumber the row's merged list even where no tile's list is full."""
    logits, q, _ = _inputs(4, 600, device, scale=2.0, seed=9)  # two tiles in the interpreter
    logits = (logits.float() * 2).round() / 2  # values on a 0.5 grid: many ties at the k-th
    logits[1] = 0.0
    logits[2, :] = -1.0
    logits[2, 123] = 0.5  # one column above a tie group that fills the vocabulary
    logits[0, 100:140] = logits[0, 520:560] = 9.0  # 80 ties at the top, 40 in each interpreter tile
    logits[3, :100] = 9.0
    logits[3, 500] = 12.0  # above a tile's tie group whose lower columns fill its list
    for top_k, top_p in ((50, 1.0), (50, 0.001), (3, 0.9)):
        _check(logits, q, top_k, 1.0, top_p)


def test_cut_search_edges(device):
    """The tiles' cuts and the row's k-th value come from bit-by-bit searches of the scores'
    ordered words: a short last tile holding the row's largest scores (fewer than k: it lists
    all and bounds nothing), -0.0 and +0.0 tied at the k-th value (one word), scores that
    share their sign and exponent (GPT-2's logits sit near -90), and a row of two values."""
    from kernels.sampling import BLOCK_V
    V = BLOCK_V + 30
    logits, q, _ = _inputs(4, V, device, dtype=torch.float32, seed=13)
    logits[0, BLOCK_V:] = logits[0].max() + torch.linspace(0.01, 0.3, 30, device=device)
    logits[1] = -5.0 - logits[1].abs()
    logits[1, :40] = torch.linspace(0.01, 0.4, 40, device=device)
    logits[1, 100:134] = -0.0  # 40 above zero, then 34 zeros at the k-th: 4 of them +0.0
    logits[1, 100:104] = 0.0
    logits[2] = logits[2] * 0.7 - 90.0
    logits[3] = torch.where(logits[3] > 0, 1.5, -2.5)
    for top_k, top_p in ((50, 1.0), (50, 0.9), (128, 1.0), (1, 1.0)):
        _check(logits, q, top_k, 1.0, top_p)
        _check(logits.half(), q, top_k, 0.7, top_p)
    for seed in range(4):  # the short tile's neighbours below it are drawn too, now and then
        g = torch.Generator().manual_seed(seed)
        logits[0, :BLOCK_V] = torch.randn(BLOCK_V, generator=g).to(device)
        logits[0, BLOCK_V:] = logits[0, :BLOCK_V].max() + torch.linspace(0.01, 0.3, 30, device=device)
        _check(logits, torch.empty(q.shape).exponential_(1, generator=g).to(device), 50)


def test_noise_in_kernel(device):
    """q as an ExponentialNoise (torch's exponential_ values, computed at the drawn columns
    only): the same ids as the q tensor kernels.exponential fills from that state, through the
    lists and through the scan of a constant row's ties; the state is not advanced."""
    B, V = 3, 700
    logits, _, seen = _inputs(B, V, device, seed=4)
    logits[1] = 0.5  # ties across the whole row: the scan reads q column by column
    noise = new_exponential_noise(B * V, device)
    noise.state.copy_(torch.tensor([seed_bits((1 << 64) - 3), 12]))
    q = kernels.exponential(noise, (B, V))
    for top_k, top_p, penalty in ((50, 1.0, 1.0), (10, 0.9, 1.3), (MAX_TOP_K, 0.95, 1.0)):
        got = kernels.sample_logits(logits, noise, top_k, 0.8, top_p, penalty, seen)
        assert torch.equal(got, _check(logits, q, top_k, 0.8, top_p, penalty, seen))
        if ON_GPU:  # there the reference draws q with torch's exponential_ itself
            assert torch.equal(got, ref.sample_logits(logits, noise, top_k, 0.8, top_p, penalty, seen))
    assert noise.state[1].item() == 12
    with pytest.raises(ValueError, match="q: expected the noise layout of 2 x 700 elements"):
        kernels.sample_logits(logits[:2], noise, 50)


def test_non_finite(device):
    """A NaN anywhere in a row names no token (id V); -inf logits are never drawn."""
    logits, q, _ = _inputs(3, 500, device, seed=2)
    logits[0, 77] = float("nan")
    logits[1, :480] = float("-inf")
    for top_p in (0.9, 1.0):
        got = _check(logits, q, 50, 1.0, top_p)
        assert got[0] == 500 and got[1] >= 480


@pytest.mark.parametrize("top_p", [0.9, 1.0])
def test_scores_softmax_has_no_probabilities_for(device, top_p):
    """Scores of +inf (a temperature, or a repetition penalty on a positive seen logit, too small
    for fp32: logits / 1e-40), or of -inf across a whole row: softmax gives NaN, transformers'
    draw raises, and the row names no token (id V) in both the kernel and the reference. They had
    drawn an arbitrary id (the reference 0, the kernel another, or one past the vocabulary)."""
    logits, q, seen = _inputs(4, 500, device, dtype=torch.float32, seed=3)
    logits[3] = float("-inf")
    got = _check(logits, q, 50, 1e-40, top_p)
    assert got.tolist() == [500] * 4
    logits[:3, 11] = 5.0  # positive and seen in rows 0-2: over the penalty, +inf
    seen[:3, 11], seen[1] = True, False  # row 1 sees nothing: its scores stay finite
    got = _check(logits, q, 50, 1.0, top_p, 1e-40, seen)
    assert got[0] == got[2] == got[3] == 500 and 0 <= got[1] < 500


def test_sample_logits_errors(device):
    logits, q, seen = _inputs(2, 100, device)
    bad = [
        (dict(top_k=0), "top_k: expected an integer from 1 to 128"),
        (dict(top_k=MAX_TOP_K + 1), "top_k: expected an integer from 1 to 128"),
        (dict(top_k=True), "top_k: expected an integer"),
        (dict(temperature=0.0), "temperature: expected a number > 0"),
        (dict(top_p=1.5), r"top_p: expected a number in \(0, 1\]"),
        (dict(penalty=0.0), "penalty: expected a number > 0"),
        (dict(q=q.half()), r"q: expected dtype in \(float32\)"),
        (dict(q=q[:1]), r"q: expected shape \(2, 100\)"),
        (dict(seen=seen.int()), r"seen: expected dtype in \(bool\)"),
        (dict(out=torch.empty(3, dtype=torch.int64, device=device)), r"out: expected shape \(2,\)"),
    ]
    for kw, msg in bad:
        args = dict(logits=logits, q=q, top_k=50) | kw
        with pytest.raises(ValueError, match=msg):
            kernels.sample_logits(**args)


def test_sample_logits_empty_batch(device):
    logits, q, _ = _inputs(0, 100, device)
    got = kernels.sample_logits(logits, q, 50, 1.0, 0.9, 1.0, None)
    assert got.shape == (0,) and got.dtype == torch.int64


def test_sample_logits_repeated_calls(device):
    """Up to MAX_MERGED_ROWS rows, each row's last tile program to arrive draws the row and resets
    its arrival counter: later calls (other batch sizes, other tile counts, a second launch past
    MAX_MERGED_ROWS rows) still finish every row."""
    assert MAX_MERGED_ROWS < 9
    for i, (B, V) in enumerate([(3, 1500), (9, 700), (2, 700), (9, 1500), (3, 1500)]):
        logits, q, _ = _inputs(B, V, device, seed=20 + i)
        _check(logits, q, 10, 0.9)
