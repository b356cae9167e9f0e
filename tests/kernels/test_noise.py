"""kernels/noise.py: torch's CUDA exponential_ values from the generator's state.

On the CPU: the kernel against kernels.reference.exponential there (the same Philox4x32-10
counters in int64 torch arithmetic, itself checked on Random123's known answers); both take an
accurate log where CUDA takes __logf, numpy's and torch's, so q agrees to a few ulps (another
word or counter would be another number). On the GPU: bit for bit against torch's own
exponential_, and its generator's advance."""
import pytest
import torch

import kernels
from kernels import reference as ref
from kernels.noise import new_exponential_noise, seed_bits, torch_exponential_layout
from tests.conftest import ON_GPU

SEEDS = [0, 12345, (1 << 63) + 7, (1 << 64) - 1]  # the key's high word, and seeds past int64
OFFSETS = [0, 4, 40, (1 << 34) + 8]  # the last: a counter past 32 bits


def _noise(numel, device, seed, offset):
    noise = new_exponential_noise(numel, device)
    noise.state.copy_(torch.tensor([seed_bits(seed), offset]))
    return noise


def test_reference_philox_known_answers():
    """Random123's known-answer vectors for Philox4x32-10 (curand's generator)."""
    cases = [
        ([0, 0, 0, 0], (0, 0), [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([0xFFFFFFFF] * 4, (0xFFFFFFFF, 0xFFFFFFFF), [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], (0xA4093822, 0x299F31D0),
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    ]
    for ctr, key, want in cases:
        got = ref._philox4x32_10([torch.tensor([c]) for c in ctr], key)
        assert [int(w) for w in got] == want


@pytest.mark.parametrize("numel", [1, 1000, 5000, 2 * 4096 + 3])
def test_exponential_matches_reference(numel, device):
    for seed, offset in zip(SEEDS, OFFSETS):
        noise = _noise(numel, device, seed, offset)
        out = torch.full((numel,), float("nan"), device=device)  # poisoned
        got = kernels.exponential(noise, (numel,), out=out)
        want = ref.exponential(noise, (numel,))
        assert got is out and torch.isfinite(got).all() and (got > 0).all()
        if ON_GPU:  # the reference is torch's own draw there
            assert torch.equal(got, want), (seed, offset)
        else:  # numpy's log against torch's: a few ulps, never another word
            torch.testing.assert_close(got, want, rtol=5e-7, atol=0)
        assert torch.equal(noise.state.cpu(), torch.tensor([seed_bits(seed), offset]))  # not advanced


def test_exponential_layouts_differ_by_shape(device):
    """The grid-stride loop puts element i on thread i % threads: with more elements than
    threads, the later ones take other calls' words (what the (B, V) -> flat index mapping must
    get right, and the reason a layout is tied to its element count)."""
    numel = 5000
    threads, increment = torch_exponential_layout(numel, device)
    if not ON_GPU:
        assert (threads, increment) == (4096, 4)  # 2 SMs x 8 blocks of 256: element 4096 takes word 1
    noise = _noise(numel, device, 3, 0)
    q = kernels.exponential(noise, (numel,))
    again = kernels.exponential(noise, (numel // 2, 2))  # the shape only views the same elements
    assert torch.equal(q.view(numel // 2, 2), again)
    later = _noise(numel, device, 3, increment)
    assert not torch.equal(kernels.exponential(later, (numel,)), q)  # the next draw of the stream
    # a different element count is a different layout
    with pytest.raises(ValueError, match="noise: expected the noise layout of 21384 elements"):
        kernels.exponential(noise, (numel + 256 * 64,))


@pytest.mark.skipif(not ON_GPU, reason="torch's CUDA exponential_ is the truth here")
@pytest.mark.parametrize("shape", [(1, 50257), (3, 50257), (64, 50257), (5, 1000), (1, 7), (300_000,)])
def test_exponential_equals_torch(shape, device):
    numel = torch.Size(shape).numel()
    for seed, offset in zip(SEEDS, OFFSETS):
        g = torch.Generator(device).manual_seed(seed)
        g.set_offset(offset)
        noise = _noise(numel, device, g.initial_seed(), g.get_offset())
        want = torch.empty(shape, device=device).exponential_(1, generator=g)
        assert torch.equal(kernels.exponential(noise, shape), want), (shape, seed, offset)
        assert g.get_offset() == offset + noise.increment
    assert kernels.torch_exponential_matches(torch.device(device), numel)


def test_exponential_errors(device):
    noise = _noise(10, device, 1, 0)
    with pytest.raises(ValueError, match="noise.state: expected dtype"):
        kernels.exponential(noise._replace(state=noise.state.float()), (10,))
    with pytest.raises(ValueError, match="out: expected a contiguous tensor of shape"):
        kernels.exponential(noise, (10,), out=torch.empty(12, device=device))
