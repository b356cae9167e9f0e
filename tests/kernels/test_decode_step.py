import pytest
import torch

import kernels
from kernels import argmax_key
from kernels import reference as ref


def _state(B, L, device):
    g = torch.Generator().manual_seed(B)
    out = torch.randint(0, 1000, (B, L), generator=g).to(device)
    step = torch.tensor([3], device=device)
    tokens = torch.randint(0, 1000, (B,), generator=g, dtype=torch.int32).to(device)
    pos = torch.randint(0, 50, (B,), generator=g, dtype=torch.int32).to(device)
    return out, step, tokens, pos


@pytest.mark.parametrize("B", [1, 5, 64])
def test_append_tokens_matches_reference(B, device):
    """Each call writes the ids into the step's column and moves every row and the step on."""
    ours, expect = _state(B, 12, device), _state(B, 12, device)
    for _ in range(2):  # step moves on: the second call writes the next column
        nxt = torch.randint(10, 800, (B,), device=device)
        kernels.append_tokens(nxt, *ours)
        ref.append_tokens(nxt, *expect)
        for a, b in zip(ours, expect):
            assert torch.equal(a, b)
    assert ours[1].item() == 5 and torch.equal(ours[0][:, 4], nxt)


@pytest.mark.parametrize("B", [1, 5])
def test_append_tokens_from_argmax_keys(B, device):
    """Keys from the lm_head: the ids are their indices, and the keys are left EMPTY."""
    logits = torch.randn(B, 300, device=device)
    logits[0, [17, 40]] = 9.0  # a tie: the lower index
    ids = logits.argmax(dim=-1)
    for ops in (kernels, ref):
        state = _state(B, 12, device)
        keys = argmax_key.row_keys(logits)
        ops.append_tokens(keys, *state, from_keys=True)
        assert torch.equal(state[0][:, 3], ids) and torch.equal(state[2].long(), ids)
        assert ids[0] == 17 and (keys == argmax_key.EMPTY).all()


def test_append_tokens_advances_noise(device):
    """With the step's ExponentialNoise, its offset moves on by the layout's increment (as
    torch's generator would after exponential_); its seed stays."""
    from kernels.noise import new_exponential_noise

    for ops in (kernels, ref):
        state = _state(3, 12, device)
        noise = new_exponential_noise(3 * 50257, device)
        noise.state.copy_(torch.tensor([-5, 16]))
        for _ in range(2):
            ops.append_tokens(torch.tensor([1, 2, 3], device=device), *state, noise=noise)
        assert noise.state.tolist() == [-5, 16 + 2 * noise.increment]
        assert state[1].item() == 5


def test_append_tokens_errors(device):
    out, step, tokens, pos = _state(2, 8, device)
    nxt = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="next_ids: expected dtype"):
        kernels.append_tokens(nxt.int(), out, step, tokens, pos)
    with pytest.raises(ValueError, match="pos: expected a contiguous \\(2,\\)"):
        kernels.append_tokens(nxt, out, step, tokens, pos[:1])
    with pytest.raises(ValueError, match="out: expected \\(2, L\\)"):
        kernels.append_tokens(nxt, out[:1], step, tokens, pos)


def test_append_tokens_triggers_no_early_launch():
    """The bookkeeping launch lets the next one (the next step's first) start only at its exit:
    at one row of gpt2's width the next step's fused attention launch reads pos before its own
    dependent-launch wait (decode_attention_proj's prefetch), so pos must be stored by then."""
    import inspect

    from kernels.decode_step import _append_tokens_kernel

    code = [line.split("#")[0] for line in inspect.getsource(_append_tokens_kernel.fn).splitlines()]
    assert any("gdc_wait()" in line for line in code)
    assert not any("gdc_launch_dependents" in line for line in code)
