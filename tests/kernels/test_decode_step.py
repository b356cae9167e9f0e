import pytest
import torch

import kernels
from kernels import argmax_key
from kernels import reference as ref
from tests.kernels.helpers import DTYPES, randn


def _state(B, L, device):
    g = torch.Generator().manual_seed(B)
    out = torch.randint(0, 1000, (B, L), generator=g).to(device)
    step = torch.randint(0, 6, (B,), generator=g).to(device)
    tokens = torch.randint(0, 1000, (B,), generator=g, dtype=torch.int32).to(device)
    pos = torch.randint(0, 50, (B,), generator=g, dtype=torch.int32).to(device)
    finished = (torch.rand(B, generator=g) < 0.3).to(device)
    return out, step, tokens, pos, finished


@pytest.mark.parametrize("B", [1, 5, 64])
@pytest.mark.parametrize("with_eos", [False, True])
def test_append_tokens_matches_reference(B, with_eos, device):
    nxt = torch.randint(0, 1000, (B,), device=device)
    nxt[0] = 7  # the eos id below
    ours, expect = _state(B, 12, device), _state(B, 12, device)
    eos = 7 if with_eos else None
    for _ in range(2):  # step moves on: the second call writes the next column
        kernels.append_tokens(nxt, *ours[:4], ours[4] if with_eos else None, eos)
        ref.append_tokens(nxt, *expect[:4], expect[4] if with_eos else None, eos)
        for a, b in zip(ours, expect):
            assert torch.equal(a, b)
    if with_eos:
        assert ours[4][0]  # row 0 drew the end-of-sequence id


@pytest.mark.parametrize("B", [1, 5])
def test_append_tokens_from_argmax_keys(B, device):
    """Keys from the lm_head: the ids are their indices, and the keys are left EMPTY."""
    logits = torch.randn(B, 300, device=device)
    logits[0, [17, 40]] = 9.0  # a tie: the lower index
    ids = logits.argmax(dim=-1)
    for ops in (kernels, ref):
        state = _state(B, 12, device)
        keys = argmax_key.row_keys(logits)
        ops.append_tokens(keys, *state[:4], state[4], 17, from_keys=True)
        step = state[1] - 1
        assert torch.equal(state[0].gather(1, step[:, None])[:, 0], ids) and torch.equal(state[2].long(), ids)
        assert state[4][0] and (keys == argmax_key.EMPTY).all()


@pytest.mark.parametrize("B,C,with_stats", [(1, 24, False), (5, 100, True), (3, 1600, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_append_tokens_embeds_the_next_input(B, C, with_stats, dtype, device):
    """x_out = wte[id] + wpe[advanced pos], bit for bit as the embedding kernel, with its
    statistics and lengths; a row advanced past wpe's last position gets wte alone."""
    V, P = 300, 40
    wte, wpe = randn(V, C, dtype=dtype, device=device), randn(P, C, dtype=dtype, device=device)
    nxt = torch.randint(0, V, (B,), device=device)
    out, step, tokens, _, _ = _state(B, 12, device)
    pos = torch.randint(0, P - 1, (B,), dtype=torch.int32, device=device)
    pos[0] = P - 1  # advances to P: past wpe
    x = torch.full((B, C), float("nan"), dtype=dtype, device=device)
    stats = torch.full((B, 2, -(-C // 16)), float("nan"), device=device) if with_stats else None
    lens = torch.full((B,), -7, dtype=torch.int32, device=device)
    kernels.append_tokens(nxt, out, step, tokens, pos, wte=wte, wpe=wpe, x_out=x, stats_out=stats, lens_out=lens)
    assert torch.equal(pos[1:], lens[1:] - 1) and pos[0] == P and lens[0] == P + 1
    inside = pos[1:].long()
    expect = torch.cat([wte[nxt[:1]], (wte[nxt[1:]].double() + wpe[inside].double()).to(dtype)])
    assert torch.equal(x, expect)  # one rounding of an exact fp32 sum: bit-identical
    if with_stats:
        torch.testing.assert_close(stats.cpu(), ref.row_stats(expect).cpu(), rtol=1e-5, atol=1e-4)
    # the reference agrees, in every buffer
    r_out, r_step, r_tokens, r_pos, _ = _state(B, 12, device)
    r_pos.copy_(pos - 1)
    r_x, r_stats, r_lens = torch.empty_like(x), None if stats is None else torch.empty_like(stats), lens.clone()
    ref.append_tokens(nxt, r_out, r_step, r_tokens, r_pos, wte=wte, wpe=wpe, x_out=r_x, stats_out=r_stats,
                      lens_out=r_lens)
    for a, b in ((out, r_out), (step, r_step), (tokens, r_tokens), (pos, r_pos), (x, r_x), (lens, r_lens)):
        assert torch.equal(a, b)


def test_append_tokens_errors(device):
    out, step, tokens, pos, finished = _state(2, 8, device)
    nxt = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="next_ids: expected dtype"):
        kernels.append_tokens(nxt.int(), out, step, tokens, pos)
    with pytest.raises(ValueError, match="pos: expected a contiguous \\(2,\\)"):
        kernels.append_tokens(nxt, out, step, tokens, pos[:1])
    with pytest.raises(ValueError, match="finished/eos"):
        kernels.append_tokens(nxt, out, step, tokens, pos, finished)
    with pytest.raises(ValueError, match=r"step: expected a contiguous \(2,\)"):
        kernels.append_tokens(nxt, out, step[:1], tokens, pos)
    wte, wpe = randn(10, 8, device=device), randn(4, 8, device=device)
    with pytest.raises(ValueError, match="wte/wpe/x_out: expected all three or none"):
        kernels.append_tokens(nxt, out, step, tokens, pos, wte=wte, wpe=wpe)
    with pytest.raises(ValueError, match=r"x_out: expected shape \(2, 8\)"):
        kernels.append_tokens(nxt, out, step, tokens, pos, wte=wte, wpe=wpe, x_out=randn(3, 8, device=device))
    with pytest.raises(ValueError, match="wpe: expected 8 columns"):
        kernels.append_tokens(nxt, out, step, tokens, pos, wte=wte, wpe=randn(4, 6, device=device),
                              x_out=randn(2, 8, device=device))
