import pytest
import torch

import kernels
from kernels import reference as ref
from kernels.decode_attention_config import default_layout
from tests.conftest import ON_GPU
from tests.kernels.helpers import DTYPES, assert_rel_close, poisoned, randn, without_env_switches

# (B, H, L, D) with per-sequence lengths drawn in [1, L]
SHAPES = [(1, 2, 1, 16), (3, 2, 100, 64), (2, 3, 129, 80), (1, 2, 200, 64),  # 200: one 256-row tile
          (2, 4, 37, 8)]
if ON_GPU:
    SHAPES += [(1, 12, 1024, 64), (64, 12, 1024, 64), (8, 25, 1024, 64), (4, 16, 777, 128), (1, 12, 256, 64),
               (8, 12, 256, 64), (64, 12, 256, 64)]  # the last: one-warp programs (default_layout)


def _lens(B, L, device):
    lens = torch.randint(1, L + 1, (B,))
    lens[0] = L  # one full-length sequence every time
    return lens.to(device=device, dtype=torch.int32)


@pytest.mark.parametrize("B,H,L,D", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention(B, H, L, D, dtype, device):
    q = randn(B, H, D, dtype=dtype, device=device)
    kc, vc = randn(B, H, L, D, dtype=dtype, device=device), randn(B, H, L, D, dtype=dtype, device=device)
    lens = _lens(B, L, device)
    out = poisoned((B, H, D), dtype, device)
    o = kernels.decode_attention(q, kc, vc, lens, out=out)
    expect = ref.decode_attention(q.double(), kc.double(), vc.double(), lens)
    assert_rel_close(o, expect, dtype, f"decode {B, H, L, D}")


@pytest.mark.parametrize("config", [None, {"BLOCK_N": 32, "num_warps": 2}, {"BLOCK_N": 128, "num_warps": 4},
                                    {"BLOCK_N": 32, "num_warps": 2, "PREFETCH_TILES": 4},
                                    {"BLOCK_N": 32, "num_warps": 2, "LOOP_STAGES": 3},
                                    {"BLOCK_N": 32, "num_warps": 2, "NEW_APART": False},
                                    {"BLOCK_N": 64, "num_warps": 4, "NEW_APART": True}]
                         # one warp (default_layout's): the interpreter runs it as it runs two
                         + ([{"BLOCK_N": 32, "num_warps": 1}] if ON_GPU else []))
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("splits", [1, 2, 4, 16])
def test_decode_attention_splits_and_new_token(splits, prefetch, config, device):
    """Every split count, with the new key/value written into the cache by the same launch, and
    with each program's first tile (or first 4 tiles, past its chunk at 4 and 16 splits) read up
    front (empty splits, 1-token rows included). Both forms of the new row (new_row_apart: by
    default in the narrow unpipelined layout, 32 rows in 2 warps or 1, and forced on and off), with
    it at a chunk's last row, in its middle and at a tile's first row (33 = a 32-row tile + 1).
    Cache rows past a sequence's length, the new row's own included, are NaN: they may be read
    (prefetched tiles), never used."""
    B, H, L, D = 4, 2, 150, 32
    q = randn(B, H, D, device=device)
    kc, vc = randn(B, H, L, D, device=device), randn(B, H, L, D, device=device)
    k_new, v_new = randn(B, H, D, device=device), randn(B, H, D, device=device)
    lens = torch.tensor([150, 1, 77, 33], dtype=torch.int32, device=device)
    expect_k, expect_v = kc.clone(), vc.clone()
    rows = torch.arange(B, device=device)
    expect_k[rows, :, lens - 1] = k_new
    expect_v[rows, :, lens - 1] = v_new
    past = (torch.arange(L, device=device)[None, :] >= lens[:, None])[:, None, :, None]  # (B, 1, L, 1)
    stale = past | (torch.arange(L, device=device)[None, :] == lens[:, None] - 1)[:, None, :, None]  # the new row too
    kc.masked_fill_(stale, float("nan"))
    vc.masked_fill_(stale, float("nan"))
    # a second launch reuses the arrival counters (the default layout's alone: interpreter time)
    for _ in range(2 if config is None else 1):
        o = kernels.decode_attention(q, kc, vc, lens, k_new=k_new, v_new=v_new, num_splits=splits,
                                     prefetch_cache=prefetch, _config=config)
        assert torch.equal(kc.masked_fill(past, 0), expect_k.masked_fill(past, 0))
        assert torch.equal(vc.masked_fill(past, 0), expect_v.masked_fill(past, 0))
        assert_rel_close(o, ref.decode_attention(q, expect_k, expect_v, lens), torch.float32, f"splits={splits}")


@pytest.mark.parametrize("L", [128, 200] + ([256] if ON_GPU else []))
def test_decode_attention_whole_cache_tile(L, device):
    """Few rows and a short cache: default_layout gives one program per (row, head) with the
    whole cache as one tile, read before the wait, the new key/value taken from registers."""
    B, H, D = 1, 12 if ON_GPU else 1, 64  # (the interpreter stands for 2 SMs: 2 pairs are many there)
    splits, block_n, _ = default_layout(torch.device(device), B * H, L, D)
    assert splits == 1 and block_n >= L
    q, k_new, v_new = (randn(B, H, D, device=device) for _ in range(3))
    kc, vc = randn(B, H, L, D, device=device), randn(B, H, L, D, device=device)
    lens = torch.tensor([L - 3], dtype=torch.int32, device=device)
    expect_k, expect_v = kc.clone(), vc.clone()
    expect_k[0, :, L - 4], expect_v[0, :, L - 4] = k_new[0], v_new[0]
    o = kernels.decode_attention(q, kc, vc, lens, k_new=k_new, v_new=v_new, prefetch_cache=True)
    assert_rel_close(o, ref.decode_attention(q, expect_k, expect_v, lens), torch.float32, f"whole-cache tile L={L}")


def test_long_cache_split_layout_by_default(device, monkeypatch):
    """The long-cache split layout as the engine runs it (defaults: first tiles read before the
    wait, the new key/value written by the launch), NaN rows past each length."""
    without_env_switches(monkeypatch)
    B, H, L, D = (16, 25, 1024, 64) if ON_GPU else (3, 2, 1024, 64)  # (the interpreter stands for 2 SMs)
    assert default_layout(torch.device(device), B * H, L, D) == (8, 32, 2)
    q, k_new, v_new = (randn(B, H, D, dtype=torch.float16, device=device) for _ in range(3))
    kc, vc = (randn(B, H, L, D, dtype=torch.float16, device=device) for _ in range(2))
    lens = torch.randint(1, L + 1, (B,), dtype=torch.int32)
    lens[:3] = torch.tensor([1024, 300, 1])
    lens = lens.to(device)
    past = (torch.arange(L, device=device)[None, :] >= lens[:, None])[:, None, :, None]
    kc.masked_fill_(past, float("nan"))
    vc.masked_fill_(past, float("nan"))
    expect_k, expect_v = kc.double().nan_to_num(), vc.double().nan_to_num()
    rows = torch.arange(B, device=device)
    expect_k[rows, :, lens - 1] = k_new.double()
    expect_v[rows, :, lens - 1] = v_new.double()
    o = kernels.decode_attention(q, kc, vc, lens, k_new=k_new, v_new=v_new, prefetch_cache=True,
                                 out=poisoned((B, H, D), torch.float16, device))
    assert_rel_close(o, ref.decode_attention(q.double(), expect_k, expect_v, lens), torch.float16)


@pytest.mark.parametrize("apart", [False, True])
def test_pipelined_loop_same_bits(apart, device):
    """The pipelined cache loop (copies ahead into shared memory) does the same arithmetic as
    the plain one, in either form of the new row (new_row_apart, pinned: the rule picks the form
    by the stage count, and the two forms round differently): the same bits over caches of 1 to
    19 tiles, the new key/value written by the launch, NaN rows past each length (read by no loop
    step), the first tile read before the wait."""
    B, H, L, D = 4, 2, 600, 64
    q, k_new, v_new = (randn(B, H, D, dtype=torch.float16, device=device) for _ in range(3))
    kc, vc = (randn(B, H, L, D, dtype=torch.float16, device=device) for _ in range(2))
    lens = torch.tensor([600, 1, 33, 417], dtype=torch.int32, device=device)
    past = (torch.arange(L, device=device)[None, :] >= lens[:, None])[:, None, :, None]
    kc.masked_fill_(past, float("nan"))
    vc.masked_fill_(past, float("nan"))
    outs = []
    for stages in (1, 3):
        k, v = kc.clone(), vc.clone()
        o = kernels.decode_attention(q, k, v, lens, k_new=k_new, v_new=v_new, num_splits=1, prefetch_cache=True,
                                     _config={"BLOCK_N": 32, "num_warps": 2, "LOOP_STAGES": stages,
                                              "NEW_APART": apart})
        outs.append(o)
    assert torch.equal(outs[0], outs[1])
    expect_k, expect_v = kc.double().nan_to_num(), vc.double().nan_to_num()
    rows = torch.arange(B, device=device)
    expect_k[rows, :, lens - 1] = k_new.double()
    expect_v[rows, :, lens - 1] = v_new.double()
    assert_rel_close(outs[1], ref.decode_attention(q.double(), expect_k, expect_v, lens), torch.float16)


@pytest.mark.parametrize("layout", [{"BLOCK_N": 32, "num_warps": 2, "LOOP_STAGES": 1, "NEW_APART": True},
                                    {"BLOCK_N": 32, "num_warps": 2, "LOOP_STAGES": 3, "NEW_APART": True},
                                    {"BLOCK_N": 64, "num_warps": 4, "LOOP_STAGES": 2, "NEW_APART": False}]
                         # one warp (default_layout's at many rows): the interpreter runs it as it runs two
                         + ([{"BLOCK_N": 32, "num_warps": 1, "LOOP_STAGES": s, "NEW_APART": True} for s in (1, 2, 3, 4)]
                            if ON_GPU else []))
def test_tensor_descriptor_tiles_same_bits(layout, device):
    """The cache loop's tiles by tensor descriptors (whole tiles, zeros past the cache's end, rows
    past a length selected out) against the masked pointer loads: the same bits, the new row
    written by the launch, NaN rows past each length, views of a longer cache as the model's."""
    B, H, L, D = 4, 2, 100, 64
    q, k_new, v_new = (randn(B, H, D, dtype=torch.float16, device=device) for _ in range(3))
    full = [randn(B + 1, H, L + 28, D, dtype=torch.float16, device=device) for _ in range(2)]
    lens = torch.tensor([100, 1, 33, 70], dtype=torch.int32, device=device)
    past = (torch.arange(L, device=device)[None, :] >= lens[:, None])[:, None, :, None]
    outs, caches = [], []
    for tma in (False, True):
        kc, vc = (t.clone()[:B, :, :L] for t in full)  # (B, H, L, D) views, as KVCache.layer gives
        kc.masked_fill_(past, float("nan"))
        vc.masked_fill_(past, float("nan"))
        outs.append(kernels.decode_attention(q, kc, vc, lens, k_new=k_new, v_new=v_new, num_splits=1,
                                             prefetch_cache=True, _config={**layout, "TMA": tma}))
        caches.append((kc.nan_to_num(), vc.nan_to_num()))
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1]))
    expect_k, expect_v = (t.double() for t in caches[0])
    assert_rel_close(outs[1], ref.decode_attention(q.double(), expect_k, expect_v, lens), torch.float16)


def test_decode_attention_matches_prefill_last_row(device):
    """The last query row of causal prefill attention is exactly a decode step."""
    B, H, T, D = 2, 3, 45, 64
    q, k, v = (randn(B, H, T, D, device=device) for _ in range(3))
    full = kernels.attention(q, k, v, causal=True)
    lens = torch.full((B,), T, dtype=torch.int32, device=device)
    o = kernels.decode_attention(q[:, :, -1].contiguous(), k, v, lens)
    assert_rel_close(o, full[:, :, -1], torch.float32)


def test_decode_attention_errors(device):
    q = randn(2, 2, 16, device=device)
    kc = randn(2, 2, 8, 16, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="k_cache: expected shape"):
        kernels.decode_attention(q, randn(2, 3, 8, 16, device=device), kc, lens)
    with pytest.raises(ValueError, match="seq_lens: expected dtype"):
        kernels.decode_attention(q, kc, kc, lens.float())
    with pytest.raises(ValueError, match="num_splits"):
        kernels.decode_attention(q, kc, kc, lens, num_splits=3)
    with pytest.raises(ValueError, match="k_new/v_new"):
        kernels.decode_attention(q, kc, kc, lens, k_new=q)
    with pytest.raises(ValueError, match="PREFETCH_TILES"):
        kernels.decode_attention(q, kc, kc, lens, _config={"PREFETCH_TILES": 3})
    with pytest.raises(ValueError, match="LOOP_STAGES"):
        kernels.decode_attention(q, kc, kc, lens, _config={"LOOP_STAGES": 0})
