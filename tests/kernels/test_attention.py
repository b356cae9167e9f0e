import importlib

import pytest
import torch

import kernels
from kernels import MAX_HEAD_DIM
from kernels import reference as ref
from kernels._tuning import config_kwargs
from tests.conftest import ON_GPU
from tests.kernels.helpers import DTYPES, assert_rel_close, poisoned, randn

ATTENTION_MODULE = importlib.import_module("kernels.attention")  # `kernels.attention` is the function

# (B, H, T, D)
# heads under 16 wide (8, 1) pad to the 16 tl.dot needs, as 80 pads to 128
SHAPES = [(1, 2, 1, 16), (2, 3, 7, 64), (1, 2, 129, 32), (2, 1, 33, 80), (2, 3, 19, 8), (1, 2, 5, 1)]
if ON_GPU:
    SHAPES += [(16, 12, 1024, 64), (2, 25, 1024, 64), (3, 4, 129, 96), (2, 4, 300, 128), (1, 12, 7, 64)]


def _ref(q, k, v, causal, scale=None, seq_lens=None):
    return ref.attention(q.double(), k.double(), v.double(), causal, scale, seq_lens)


@pytest.mark.parametrize("B,H,T,D", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention(B, H, T, D, causal, dtype, device):
    q, k, v = (randn(B, H, T, D, dtype=dtype, device=device) for _ in range(3))
    out = poisoned((B, H, T, D), dtype, device)
    o = kernels.attention(q, k, v, causal=causal, out=out)
    assert o.data_ptr() == out.data_ptr()
    assert_rel_close(o, _ref(q, k, v, causal), dtype, f"attention {B, H, T, D} causal={causal}")


@pytest.mark.parametrize("causal", [True, False])
def test_attention_ragged_lengths(causal, device):
    """Right-padded batch: each sequence sees only its own first seq_lens[b] keys, and its valid
    rows equal the sequence computed alone."""
    B, H, T, D = 3, 2, 37, 32
    q, k, v = (randn(B, H, T, D, device=device) for _ in range(3))
    lens = torch.tensor([37, 1, 20], dtype=torch.int32, device=device)
    o = kernels.attention(q, k, v, causal=causal, seq_lens=lens)
    assert torch.isfinite(o).all()
    assert_rel_close(o, _ref(q, k, v, causal, seq_lens=lens), torch.float32)
    for b, n in enumerate(lens.tolist()):
        alone = kernels.attention(q[b:b + 1, :, :n], k[b:b + 1, :, :n], v[b:b + 1, :, :n], causal=causal)
        assert_rel_close(o[b:b + 1, :, :n], alone, torch.float32, f"sequence {b}")


@pytest.mark.parametrize("T", [33] + ([1024] if ON_GPU else []))
def test_attention_autotuned(T, device, autotuned):
    dtype = torch.float16 if ON_GPU else torch.float32
    q, k, v = (randn(2, 3, T, 64, dtype=dtype, device=device) for _ in range(3))
    assert_rel_close(kernels.attention(q, k, v), _ref(q, k, v, True), dtype, "autotuned attention")


def test_every_tuned_config_streams_the_same_key_blocks():
    """The online softmax rescales at key-block boundaries: one BLOCK_N for every config the
    tuner may pick, so its choice (which differs between machines) cannot move a bit."""
    configs = ATTENTION_MODULE._configs(interpret=False)
    assert len(configs) > 1 and {c.kwargs["BLOCK_N"] for c in configs} == {ATTENTION_MODULE.ROW_BLOCK_N}


@pytest.mark.skipif(not ON_GPU, reason="the tuner's configs run on the GPU (the interpreter has one)")
@pytest.mark.parametrize("B,H,T,D,pad", [(1, 12, 1024, 64, 0), (3, 20, 300, 64, 111), (8, 12, 40, 64, 35),
                                         (2, 4, 200, 128, 57), (2, 3, 97, 80, 0)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_every_tuned_config_gives_the_same_bits(B, H, T, D, pad, dtype, device):
    """Every config the autotuner may pick gives the first's bits, causal and ragged: which blocks
    a row meets masked follows BLOCK_M, so masked and unmasked blocks must round alike."""
    q, k, v = (randn(B, H, T, D, dtype=dtype, device=device) for _ in range(3))
    lens = torch.tensor([T - pad * (b % 2) for b in range(B)], dtype=torch.int32, device=device)
    configs = [config_kwargs(c) for c in ATTENTION_MODULE._CONFIGS]
    outs = [kernels.attention(q, k, v, seq_lens=lens, _config=c) for c in configs]
    for c, o in zip(configs, outs):
        assert torch.equal(o, outs[0]), f"{c} against {configs[0]}"
    assert_rel_close(outs[0], _ref(q, k, v, True, seq_lens=lens), dtype, "attention")


def test_attention_strided_views_and_scale(device):
    """q, k, v as views into one (B, T, 3, H, D) projection, output into a (B, T, H, D) buffer."""
    B, T, H, D = 2, 19, 3, 16
    qkv = randn(B, T, 3, H, D, device=device)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    buf = poisoned((B, T, H, D), torch.float32, device)
    kernels.attention(q, k, v, causal=True, scale=0.3, out=buf.transpose(1, 2))
    assert_rel_close(buf.transpose(1, 2), _ref(q, k, v, True, 0.3), torch.float32)


@pytest.mark.parametrize("B,H,T,D,L", [(2, 3, 37, 32, 50), (1, 2, 1, 16, 4)] + ([(2, 12, 300, 64, 1024)] if ON_GPU else []))
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_fills_kv_cache(B, H, T, D, L, dtype, device):
    """k_out/v_out as views of a (n_layer, B, H, L, D) cache (positions 0..T of one layer): every
    position gets k and v exactly, padding rows too; nothing outside the views is touched, and
    the attention itself is unchanged."""
    qkv = randn(B, T, 3, H, D, dtype=dtype, device=device)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # strided, as the model's views
    kc, vc = (poisoned((2, B, H, L, D), dtype, device) for _ in range(2))
    lens = torch.tensor([T, max(1, T // 3)][:B], dtype=torch.int32, device=device)
    o = kernels.attention(q, k, v, causal=True, seq_lens=lens, k_out=kc[1, :, :, :T], v_out=vc[1, :, :, :T])
    assert torch.equal(kc[1, :, :, :T], k) and torch.equal(vc[1, :, :, :T], v)
    assert kc[0].isnan().all() and vc[0].isnan().all() and kc[1, :, :, T:].isnan().all()
    assert vc[1, :, :, T:].isnan().all()
    assert_rel_close(o, _ref(q, k, v, True, seq_lens=lens), dtype, "attention with the cache write")


def test_attention_errors(device):
    q = randn(1, 2, 4, 16, device=device)
    with pytest.raises(ValueError, match="k, v: expected the shape of q"):
        kernels.attention(q, randn(1, 2, 5, 16, device=device), q)
    for D in (0, MAX_HEAD_DIM + 8):
        x = randn(1, 2, 4, D, device=device)
        with pytest.raises(ValueError, match=rf"^q: expected a head_dim from 1 to {MAX_HEAD_DIM}, got {D}$"):
            kernels.attention(x, x, x)
    with pytest.raises(ValueError, match="seq_lens: expected shape"):
        kernels.attention(q, q, q, seq_lens=torch.ones(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="k: expected dtype"):
        kernels.attention(q, q.half(), q)
    with pytest.raises(ValueError, match="k_out, v_out: expected both or neither"):
        kernels.attention(q, q, q, k_out=torch.empty_like(q))
    with pytest.raises(ValueError, match=r"v_out: expected shape \(1, 2, 4, 16\)"):
        kernels.attention(q, q, q, k_out=torch.empty_like(q), v_out=randn(1, 2, 5, 16, device=device))


@pytest.mark.parametrize("first", [True, False])
def test_both_program_orders_give_the_same_bits(first, device, monkeypatch):
    """heads_first only orders the programs: each query block's arithmetic is the same, with
    lengths and the cache copies, at a T off the blocks."""
    B, H, T, D = 2, 3, 70, 32
    dtype = torch.float16
    q, k, v = (randn(B, H, T, D, dtype=dtype, device=device) for _ in range(3))
    lens = torch.tensor([70, 41], dtype=torch.int32, device=device)
    outs = []
    for order in (first, not first):
        monkeypatch.setattr(ATTENTION_MODULE, "heads_first", lambda causal, heads, sms, order=order: order)
        ko, vo = poisoned((B, H, T, D), dtype, device), poisoned((B, H, T, D), dtype, device)
        outs.append((kernels.attention(q, k, v, causal=True, seq_lens=lens, k_out=ko, v_out=vo), ko, vo))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert torch.equal(outs[0][1], k) and torch.equal(outs[0][2], v)
    assert_rel_close(outs[0][0], _ref(q, k, v, True, seq_lens=lens), dtype, "attention, both orders")


def test_heads_first_only_causal_grids_of_at_most_one_wave_of_pairs():
    from kernels.attention import heads_first

    assert heads_first(True, 12, 132) and heads_first(True, 132, 132)
    assert not heads_first(True, 133, 132) and not heads_first(False, 12, 132)
