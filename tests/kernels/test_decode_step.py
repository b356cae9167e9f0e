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


def _host_mirror(out, device):
    """A poisoned host copy of out's shape: pinned where out is on a GPU."""
    return torch.full(tuple(out.shape), -7, dtype=torch.int64, pin_memory=device.type == "cuda")


@pytest.mark.parametrize("B", [1, 5, 64])
def test_append_tokens_writes_the_host_mirror(B, device):
    """With out_host, each step's ids land in its column of the host mirror too (the kernel's
    stores reach pinned host memory directly on a GPU), and nothing else there changes; the
    reference mirrors the whole of out."""
    ours, expect = _state(B, 12, device), _state(B, 12, device)
    mirror = _host_mirror(ours[0], torch.device(device))
    ref_mirror = _host_mirror(expect[0], torch.device(device))
    for _ in range(3):
        nxt = torch.randint(10, 800, (B,), device=device)
        kernels.append_tokens(nxt, *ours, out_host=mirror)
        ref.append_tokens(nxt, *expect, out_host=ref_mirror)
    if device != "cpu":
        torch.cuda.synchronize()
    for a, b in zip(ours, expect):
        assert torch.equal(a, b)
    assert torch.equal(mirror[:, 3:6], ours[0][:, 3:6].cpu()) and torch.equal(ref_mirror, expect[0].cpu())
    assert (mirror[:, :3] == -7).all() and (mirror[:, 6:] == -7).all()


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
    with pytest.raises(ValueError, match=r"out_host: expected \(2, 8\) with contiguous rows"):
        kernels.append_tokens(nxt, out, step, tokens, pos, out_host=torch.zeros(2, 9, dtype=torch.int64))
    with pytest.raises(ValueError, match="out_host: expected a tensor on cpu"):
        kernels.append_tokens(nxt, out, step, tokens, pos, out_host=out.to("meta"))
    if out.is_cuda:
        with pytest.raises(ValueError, match="out_host: expected pinned memory"):
            kernels.append_tokens(nxt, out, step, tokens, pos, out_host=torch.zeros(2, 8, dtype=torch.int64))


def test_append_tokens_triggers_no_early_launch():
    """The bookkeeping launch lets the next one (the next step's first) start only at its exit:
    at one row of gpt2's width the next step's fused attention launch reads pos before its own
    dependent-launch wait (decode_attention_proj's prefetch), so pos must be stored by then."""
    import inspect

    from kernels.decode_step import _append_tokens_kernel

    code = [line.split("#")[0] for line in inspect.getsource(_append_tokens_kernel.fn).splitlines()]
    assert any("gdc_wait()" in line for line in code)
    assert not any("gdc_launch_dependents" in line for line in code)
