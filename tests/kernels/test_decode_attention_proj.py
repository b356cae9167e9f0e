import sys

import pytest
import torch

import kernels
from kernels import reference as ref
from kernels._tuning import sm_count
from kernels._workspace import fixed_point_sums
from kernels.decode_attention import LOG2E
from kernels.decode_attention_proj_config import (FIXED_MERGE, FIXED_STATS, MAX_CACHE, MAX_ROWS, fixed_row_stats,
                                                  fused_layout)
from tests.conftest import ON_GPU
from tests.kernels.helpers import DTYPES, assert_rel_close, poisoned, randn

# (B, H, L, D, N): odd widths (a partial column block, a 16-wide head), 1-position caches
SHAPES = [(1, 2, 1, 16, 48), (2, 3, 100, 64, 200), (2, 2, 200, 32, 130), (2, 4, 37, 8, 40)]
if ON_GPU:  # the GPT-2 widths at the row counts that fuse; a 128-wide head
    SHAPES += [(1, 12, 256, 64, 768), (2, 12, 128, 64, 768), (1, 16, 256, 64, 1024), (1, 25, 256, 64, 1600),
               (2, 16, 77, 64, 1024), (1, 20, 256, 64, 1280), (1, 4, 256, 128, 300)]


def _case(B, H, L, D, N, dtype, device, bias=True, lens=()):
    """Random inputs with cache rows past each length poisoned (NaN): read perhaps, never used.
    Row 0 fills the cache; `lens` sets the lengths of the rows after it (random if not given)."""
    q, k_new, v_new = (randn(B, H, D, dtype=dtype, device=device) for _ in range(3))
    kc, vc = randn(B, H, L, D, dtype=dtype, device=device), randn(B, H, L, D, dtype=dtype, device=device)
    lens = torch.tensor([L, *lens]) if lens else torch.randint(1, L + 1, (B,))
    lens[0] = L
    lens = lens.to(device=device, dtype=torch.int32)
    past = (torch.arange(L, device=device)[None, :] >= lens[:, None] - 1)[:, None, :, None]  # (B, 1, L, 1)
    kc.masked_fill_(past, float("nan"))
    vc.masked_fill_(past, float("nan"))
    w = randn(N, H * D, dtype=dtype, device=device, scale=D ** -0.5).t()  # out-major, as the model stores it
    b = randn(N, dtype=dtype, device=device) if bias else None
    x = randn(B, N, dtype=dtype, device=device)
    return q, kc, vc, lens, k_new, v_new, w, b, x


def _expect(q, kc, vc, lens, k_new, v_new, w, b, x):
    """float64 reference and the caches with the new rows appended."""
    B = q.shape[0]
    ek, ev = kc.clone(), vc.clone()
    rows = torch.arange(B, device=q.device)
    ek[rows, :, lens.long() - 1], ev[rows, :, lens.long() - 1] = k_new, v_new
    attn = ref.decode_attention(q.double(), ek.double(), ev.double(), lens)
    y = ref.linear(attn.reshape(B, -1), w.double(), b.double() if b is not None else None, residual=x.double())
    return y, ek, ev


@pytest.mark.parametrize("B,H,L,D,N", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_proj(B, H, L, D, N, dtype, device):
    assert fused_layout(B, N, L, D, H, sms=sm_count(torch.device(device))) is not None
    case = _case(B, H, L, D, N, dtype, device)
    q, kc, vc, lens, k_new, v_new, w, b, x = case
    expect, ek, ev = _expect(*case)
    out = poisoned((B, N), dtype, device)
    y = kernels.decode_attention_proj(q, kc, vc, lens, k_new, v_new, w, b, x, out=out)
    assert y is out
    assert_rel_close(y, expect, dtype, f"fused {B, H, L, D, N}")
    past = (torch.arange(L, device=device)[None, :] >= lens[:, None])[:, None, :, None]
    assert torch.equal(kc.masked_fill(past, 0), ek.masked_fill(past, 0)), "new keys not appended"
    assert torch.equal(vc.masked_fill(past, 0), ev.masked_fill(past, 0)), "new values not appended"


def _positions(prefetch, lens):
    """The positions argument a prefetch mode takes: the new rows' positions for "cache"."""
    return lens - 1 if prefetch == "cache" else None


@pytest.mark.parametrize("prefetch", [False, "cache", True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("with_stats", [True, False])
def test_in_place_twice(prefetch, bias, with_stats, device):
    """As the model calls it: x updated in place, with or without the next layernorm's
    statistics (the two head merges), twice over: the arrival counters and the fixed-point
    words reset, and the second launch finds its new rows in the cache."""
    B, H, L, D, N = 2, 3, 70, 32, 96
    q, kc, vc, lens, k_new, v_new, w, b, x = _case(B, H, L, D, N, torch.float32, device, bias)
    for _ in range(2):
        expect, ek, ev = _expect(q, kc, vc, lens, k_new, v_new, w, b, x)
        stats = torch.full((B, 2, N // 16), float("nan"), device=device) if with_stats else None
        y = kernels.decode_attention_proj(q, kc, vc, lens, k_new, v_new, w, b, x, out=x, stats_out=stats,
                                          prefetch=prefetch, early_launch=True, positions=_positions(prefetch, lens))
        assert y is x
        assert_rel_close(x, expect, torch.float32, "in place")
        if with_stats:
            assert_rel_close(stats, ref.row_stats(x), torch.float32, "row statistics")
        assert not fixed_point_sums(torch.device(device), B * N)[:B * N].any(), "fixed-point words left set"


@pytest.mark.skipif(not FIXED_MERGE, reason="MINILLM_FIXED_MERGE=0: the heads merge through stored partials")
def test_partials_past_the_fixed_point_range_give_nan(device):
    """A head's partial of 2**21 or more (or not finite) does not fit the fixed-point merge: its
    columns come out NaN, loudly, and the others stay right."""
    B, H, L, D, N = 1, 2, 20, 16, 40
    q, kc, vc, lens, k_new, v_new, w, b, x = _case(B, H, L, D, N, torch.float32, device)
    _, ek, ev = _expect(q, kc, vc, lens, k_new, v_new, w, b, x)
    attn = ref.decode_attention(q, ek, ev, lens).reshape(-1)  # (H * D,): the heads' outputs
    w = w.clone()
    w[:, 5] = 1e8 * attn.sign()  # each head's partial in column 5: 1e8 * sum |o| (~1e8), past 2**21
    w[0, 7] = float("inf")  # head 0's partial in column 7
    expect, _, _ = _expect(q, kc, vc, lens, k_new, v_new, w, b, x)
    assert torch.isfinite(expect[:, 5]).all()
    y = kernels.decode_attention_proj(q, kc, vc, lens, k_new, v_new, w, b, x)
    assert torch.isnan(y[:, [5, 7]]).all()
    keep = [c for c in range(N) if c not in (5, 7)]
    assert_rel_close(y[:, keep], expect[:, keep], torch.float32, "the columns that fit")
    assert not fixed_point_sums(torch.device(device), B * N)[:B * N].any(), "fixed-point words left set"


def _exact_group_sums(y):
    """(rows, 2, groups) float64: each 16-column group's sum and sum of squares of y, exactly."""
    yd = torch.nn.functional.pad(y.double(), (0, -y.shape[1] % 16)).view(y.shape[0], -1, 16)
    return torch.stack([yd.sum(-1), (yd * yd).sum(-1)], dim=1)


@pytest.mark.skipif(not FIXED_MERGE or FIXED_STATS == "0", reason="MINILLM_FIXED_MERGE=0 or MINILLM_FIXED_STATS=0")
def test_fixed_point_statistics(device):
    """Half precision, statistics asked for in the fixed-point form (fixed_row_stats, one zeroed
    buffer a layer): the values have the bits of the launch without statistics, the sums are
    exact, the squares within half a unit (2**-17) a column, and a folded layernorm reading
    them (linear's ln_stats) matches the one that reads whole rows. Twice in place, a NaN
    residual in row 1's column 3 (the row's other statistics stay right), a partial group."""
    B, H, L, D, N = 2, 3, 70, 32, 200
    q, kc, vc, lens, k_new, v_new, w, b, x = _case(B, H, L, D, N, torch.float16, device)
    x[1, 3] = float("nan")
    stats = fixed_row_stats(2, B, N, L, D, H, torch.float16, torch.device(device))
    assert stats.dtype == torch.int64 and stats.shape == (2, B, 2, 13) and not stats.any()
    g, beta = 1 + 0.2 * randn(N, device=device), 0.1 * randn(N, device=device)
    wf, bf, colsum = ref.fold_layernorm(randn(N, 48, device=device).half(), None, g, beta)
    for layer in range(2):
        plain = kernels.decode_attention_proj(q, kc.clone(), vc.clone(), lens, k_new, v_new, w, b, x)
        y = kernels.decode_attention_proj(q, kc, vc, lens, k_new, v_new, w, b, x, out=x, stats_out=stats[layer])
        assert torch.equal(y.nan_to_num(), plain.nan_to_num()) and torch.isnan(y[1, 3])
        got = ref.fixed_stats_values(stats[layer])
        expect = _exact_group_sums(y.nan_to_num(nan=0.0))
        assert torch.equal(got[:, 0], expect[:, 0]), "sums"
        assert ((got[:, 1] - expect[:, 1]).abs() <= 16 * 2.0 ** -17).all(), "squares"
        read = kernels.linear(y[:1], wf, bf, ln_fold=colsum, ln_stats=stats[layer][:1])
        assert_rel_close(read, ref.linear(y[:1].double(), wf.double(), bf.double(), ln_fold=colsum.double()),
                         torch.float16, "folded layernorm from fixed-point statistics")
    dev = torch.device(device)
    assert fixed_row_stats(2, B, N, L, D, H, torch.float32, dev) is None  # half precision only
    assert fixed_row_stats(2, B, N, L, D, 1, torch.float16, dev) is None  # one head: nothing to merge
    assert fixed_row_stats(2, MAX_ROWS + 1, N, L, D, H, torch.float16, dev) is None  # two kernels
    assert fixed_row_stats(2, B, N, MAX_CACHE + 1, D, H, torch.float16, dev) is None
    assert fixed_row_stats(2, B, (1 << 14) + 16, L, D, H, torch.float16, dev) is None  # squares past 2**62
    # the rule: gpt2 and gpt2-medium; not gpt2-large, nor gpt2-xl at 1 row (at 2 rows both run two kernels)
    assert fixed_row_stats(24, 2, 1024, 256, 64, 16, torch.float16, dev) is not None
    assert fixed_row_stats(48, 2, 1600, 256, 64, 25, torch.float16, dev) is None
    assert fixed_row_stats(36, 2, 1280, 256, 64, 20, torch.float16, dev) is None
    assert fixed_row_stats(48, 1, 1600, 256, 64, 25, torch.float16, dev) is None
    with pytest.raises(ValueError, match=r"stats_out: the fixed-point form \(int64\) is written by the fused"):
        kernels.decode_attention_proj(q.float(), kc.float(), vc.float(), lens, k_new.float(), v_new.float(),
                                      w.float(), b.float(), x.float(), stats_out=stats[0])


@pytest.mark.parametrize("prefetch", ["cache", True])
@pytest.mark.parametrize("layout", [(64, 32, 4), (16, 64, 2), (64, 256, 4)])
def test_cache_longer_than_the_prefetched_tile(layout, prefetch, device):
    """The first BLOCK_L positions before the wait, the rest in tiles after it (lengths from 1
    to past several tiles, the new row inside a later tile or just past a tile's end), or one
    tile past the cache's end. Every mode stops the first tile at the lengths: the NaN rows
    past them stay unread."""
    B, H, L, D, N = 4, 2, 150, 32, 72
    case = _case(B, H, L, D, N, torch.float32, device, lens=(1, min(layout[1] + 1, L), 97))
    expect, _, _ = _expect(*case)
    y = kernels.decode_attention_proj(*case, prefetch=prefetch, _layout=layout,
                                      positions=_positions(prefetch, case[3]))
    assert_rel_close(y, expect, torch.float32, f"layout {layout}")


@pytest.mark.parametrize("gap", [40.0, 100.0, 300.0])
@pytest.mark.parametrize("layout", [None, (64, 32, 4)])
def test_older_rows_far_above_the_new_row(gap, layout, device):
    """One older row (in the first tile, and with the small layout also in a later one) scores
    `gap` (log2 units) above the new row, whose score is 0 and whose weight, started at 1, must
    shrink by 2**-gap as the maximum moves: exact where exp2(gap) would overflow float32 (300).
    It also held a reverted form that took the weights against the new row's score
    (bench/results/h200/session-75/attn-ref-new-experiment.patch) to its fallback."""
    B, H, L, D, N = 2, 2, 100, 32, 72
    q, kc, vc, lens, k_new, v_new, w, b, x = _case(B, H, L, D, N, torch.float32, device, lens=(L,))
    u = torch.nn.functional.normalize(torch.randn(D, dtype=torch.float64), dim=0)
    q.copy_((u * gap / LOG2E).expand_as(q))  # q . k / sqrt(D) * log2(e) = gap where k = u * sqrt(D)
    k_new.zero_()
    kc.copy_(kc.nan_to_num() * 0.1)  # the other rows' scores stay within a few units of 0
    kc[0, :, 5], kc[1, :, 70] = u * D ** 0.5, u * D ** 0.5  # row 1's in a later tile of the small layout
    case = (q, kc, vc, lens, k_new, v_new, w, b, x)
    expect, _, _ = _expect(*case)
    y = kernels.decode_attention_proj(*case, _layout=layout)
    assert_rel_close(y, expect, torch.float32, f"gap {gap}")


def test_row_bits_do_not_depend_on_the_batch(device):
    """A row's result has the same bits alone and inside a batch: heads add up in head order."""
    B, H, L, D, N = MAX_ROWS, 3, 90, 64, 160
    q, kc, vc, lens, k_new, v_new, w, b, x = _case(B, H, L, D, N, torch.float16, device)
    alone = kernels.decode_attention_proj(q[1:], kc[1:].clone(), vc[1:].clone(), lens[1:], k_new[1:], v_new[1:],
                                          w, b, x[1:])
    batch = kernels.decode_attention_proj(q, kc, vc, lens, k_new, v_new, w, b, x)
    assert torch.equal(alone[0], batch[1])


@pytest.mark.parametrize("H,D,N", [(3, 64, 200), (12, 64, 768)])
def test_l2_ahead_changes_no_bit(H, D, N, device):
    """Asking L2 for other tensors' bytes (the next kernels' weights; an out-major view, and one
    whose size is not a multiple of 16 bytes) leaves the result, the cache and those tensors as
    they are. On the GPU the requests run (unless MINILLM_L2_AHEAD=0); the interpreter has none."""
    case = _case(1, H, 90, D, N, torch.float16, device)
    q, kc, vc, lens, k_new, v_new, w, b, x = case
    fc = randn(4 * N, N, dtype=torch.float16, device=device).t()
    odd = randn(1001, dtype=torch.float16, device=device)
    keep = fc.clone(), odd.clone()
    kc2, vc2 = kc.clone(), vc.clone()
    plain = kernels.decode_attention_proj(q, kc, vc, lens, k_new, v_new, w, b, x, out=poisoned((1, N), torch.float16,
                                                                                                   device))
    ahead = kernels.decode_attention_proj(q, kc2, vc2, lens, k_new, v_new, w, b, x, l2_ahead=(fc, odd),
                                          out=poisoned((1, N), torch.float16, device))
    assert torch.equal(plain, ahead) and torch.equal(kc.nan_to_num(), kc2.nan_to_num())
    assert torch.equal(fc, keep[0]) and torch.equal(odd, keep[1])


@pytest.mark.parametrize("B,L", [(MAX_ROWS + 1, 64), (1, MAX_CACHE + 44)])
def test_more_rows_or_a_longer_cache_run_two_kernels(B, L, device):
    """Past the fused layout's reach the op runs decode_attention and linear, with the same result."""
    H, D, N = 2, 32, 80
    assert fused_layout(B, N, L, D, H, sms=sm_count(torch.device(device))) is None
    case = _case(B, H, L, D, N, torch.float32, device)
    expect, _, _ = _expect(*case)
    y = kernels.decode_attention_proj(*case, prefetch=True)
    assert_rel_close(y, expect, torch.float32, f"two kernels B={B} L={L}")


def test_wide_column_blocks(device):
    """512-column blocks (gpt2-large's at one row), one of them partial, against the reference."""
    case = _case(1, 3, 70, 32, 600, torch.float32, device)
    expect, _, _ = _expect(*case)
    y = kernels.decode_attention_proj(*case, _layout=(512, 128, 8))
    assert_rel_close(y, expect, torch.float32, "512-column blocks")


@pytest.mark.parametrize("mask", [3, 7, 4])
@pytest.mark.parametrize("prefetch", ["cache", True])
def test_tiles_converted_before_the_wait(mask, prefetch, device):
    """The tiles in fp32 before the dependent-launch wait (early_f32's mask: 1 keys, 2 values,
    4 W), as the model calls the launch at two rows: in place, twice. On the GPU the wait is
    the predicated one; the interpreter has no dependent launch, so there it runs the plain form."""
    B, H, L, D, N = 2, 3, 70, 32, 96
    q, kc, vc, lens, k_new, v_new, w, b, x = _case(B, H, L, D, N, torch.float32, device)
    for _ in range(2):
        expect, _, _ = _expect(q, kc, vc, lens, k_new, v_new, w, b, x)
        kernels.decode_attention_proj(q, kc, vc, lens, k_new, v_new, w, b, x, out=x, prefetch=prefetch,
                                      early_launch=True, positions=_positions(prefetch, lens), _early_f32=mask)
        assert_rel_close(x, expect, torch.float32, f"mask {mask}")


@pytest.mark.skipif(not FIXED_MERGE, reason="MINILLM_FIXED_MERGE=0")
def test_fixed_stats_rule_and_its_switch(monkeypatch):
    """The fixed-point statistics by rule: up to 16 heads (gpt2, gpt2-medium), not gpt2-large's
    20 heads nor gpt2-xl at one row; MINILLM_FIXED_STATS=all takes them past the rule wherever
    the fused launch runs (not two rows of gpt2-large or gpt2-xl), =0 nowhere; never in fp32
    (the launch cannot write them)."""
    proj = sys.modules["kernels.decode_attention_proj_config"]
    cpu = torch.device("cpu")

    def taken(rows, heads, dtype=torch.float16):
        return fixed_row_stats(2, rows, heads * 64, 96, 64, heads, dtype, cpu) is not None

    cases = [(1, 12), (2, 12), (1, 16), (1, 20), (2, 20), (1, 25), (2, 25)]
    monkeypatch.setattr(proj, "FIXED_STATS", "1")
    assert [taken(r, h) for r, h in cases] == [True, True, True, False, False, False, False]
    monkeypatch.setattr(proj, "FIXED_STATS", "all")
    assert [taken(r, h) for r, h in cases] == [True, True, True, True, False, True, False]
    assert not taken(1, 25, torch.float32)
    monkeypatch.setattr(proj, "FIXED_STATS", "0")
    assert not any(taken(r, h) for r, h in cases)


def test_reference_twin_matches(device):
    case = _case(2, 2, 40, 16, 64, torch.float32, device)
    expect, _, _ = _expect(*case)
    q, kc, vc, *rest = case
    assert_rel_close(ref.decode_attention_proj(q, kc.clone(), vc.clone(), *rest), expect, torch.float32, "reference")


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(w=a["w"][:-1]), r"weight: expected 32 rows"),
    (lambda a: a.update(x=a["x"][:, :-1]), r"residual: expected shape \(2, 64\)"),
    (lambda a: a.update(b=a["b"][:-1]), r"bias: expected shape \(64,\)"),
    (lambda a: a.update(lens=a["lens"][:1]), r"seq_lens: expected shape \(2,\)"),
    (lambda a: a.update(k_new=a["k_new"][:, :1]), r"k_new: expected shape \(2, 2, 16\)"),
    (lambda a: a.update(kc=a["kc"][:, :1]), r"k_cache: expected shape \(2, 2, L, 16\)"),
    (lambda a: a.update(x=a["x"].double()), r"residual: expected dtype in \(float32\)"),
    (lambda a: a.update(prefetch="all"), r"prefetch: expected False, True or 'cache', got 'all'"),
    (lambda a: a.update(prefetch="cache"), r"positions: expected a \(B,\) tensor with prefetch='cache'"),
    (lambda a: a.update(positions=a["lens"] - 1), r"positions: .* got a tensor with prefetch=False"),
    (lambda a: a.update(prefetch="cache", positions=(a["lens"] - 1).long()),
     r"positions: expected dtype in \(int32\)"),
    (lambda a: a.update(prefetch="cache", positions=a["lens"][:1] - 1), r"positions: expected shape \(2,\)"),
    (lambda a: a.update(l2_ahead=(a["w"][::2],)), r"l2_ahead\[0\]: expected a dense tensor"),
    (lambda a: a.update(l2_ahead=(a["w"],) * 3), r"l2_ahead: expected at most 2 tensors, got 3"),
    (lambda a: a.update(l2_ahead=(a["w"], "fc")), r"l2_ahead\[1\]: expected a torch.Tensor, got str"),
])
def test_bad_arguments(change, match, device):
    names = ("q", "kc", "vc", "lens", "k_new", "v_new", "w", "b", "x")
    a = dict(zip(names, _case(2, 2, 40, 16, 64, torch.float32, device)), prefetch=False, positions=None, l2_ahead=())
    change(a)
    with pytest.raises(ValueError, match=match):
        kernels.decode_attention_proj(*(a[n] for n in names), prefetch=a["prefetch"], positions=a["positions"],
                                      l2_ahead=a["l2_ahead"])
