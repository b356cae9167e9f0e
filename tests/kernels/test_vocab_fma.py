"""The persistent one-row vocabulary head of `linear` (kernels/vocab_fma.py): logits with a folded
layernorm and bias, the fused argmax (ties, -inf rows, keys already there), when `linear` routes
there and when not."""
import pytest
import torch

import kernels
from kernels import argmax_key, gemv, gemv_fma, vocab_fma
from kernels._tuning import INTERPRET, sm_count
from tests.conftest import ON_GPU
from tests.kernels.helpers import DTYPES, assert_rel_close, ln_linear_ref, poisoned, randn

N_ODD = gemv_fma.VOCAB_N + 27  # a vocabulary head whose last column block is partial


def _head(K, N, dtype, device, tied=()):
    """(x, weight, bias, colsum, g, be, w, b): a folded layernorm head with out-major weights, as
    the model holds its lm_head, and the unfolded weights for the reference. Columns `tied` get
    column tied[0]'s weights and a large bias: equal row maxima."""
    x = randn(1, K, dtype=dtype, device=device, scale=2.0) + 0.5  # a mean to take out
    w = randn(K, N, dtype=dtype, device=device, scale=K ** -0.5)
    b = randn(N, dtype=dtype, device=device)
    if tied:
        w[:, tied], b[tied] = w[:, tied[:1]].clone(), 50.0
    g, be = 1 + 0.2 * randn(K, dtype=dtype, device=device), randn(K, dtype=dtype, device=device)
    wf, bf, colsum = kernels.fold_layernorm(w, b, g, be)
    return x, wf.t().contiguous().t(), bf, colsum, g, be, w, b


def _keys(device):
    return torch.full((1,), argmax_key.EMPTY, dtype=torch.int64, device=device)


@pytest.mark.parametrize("K", [40, 100])
@pytest.mark.parametrize("dtype", DTYPES)
def test_vocab_head_logits_and_argmax(K, dtype, device):
    """Logits within tolerance of the float64 layernorm + matmul; the key holds torch.argmax of
    the stored logits, with maxima tied across lanes, blocks and programs (the lowest wins)."""
    x, wf, bf, colsum, g, be, w, b = _head(K, N_ODD, dtype, device, tied=[5, 6, 300, 2000, N_ODD - 3])
    keys, y = _keys(device), poisoned((1, N_ODD), dtype, device)
    cfg = vocab_fma.vocab_config(1, N_ODD, K, wf.stride(0), sms=sm_count(torch.device(device)))
    assert cfg is not None and cfg["programs"] < N_ODD // cfg["BLOCK_N"]  # programs loop over blocks
    kernels.linear(x, wf, bf, ln_fold=colsum, argmax_keys=keys, out=y)
    assert_rel_close(y, ln_linear_ref(x, w, b, g, be), dtype, f"vocab head K={K}")
    assert (y[0] == y[0].max()).sum() >= 2, "the tied maxima must tie after rounding"
    assert argmax_key.argmax_index(keys).item() == y[0].argmax().item() == 5
    first = keys.clone()
    kernels.linear(x, wf, bf, ln_fold=colsum, argmax_keys=keys)  # keys already there: unchanged
    assert torch.equal(keys, first)
    # the keys alone: the same key, no logits written (the launcher's store=False; linear's keys_only)
    alone, y2 = _keys(device), poisoned((1, N_ODD), dtype, device)
    before = y2.clone()
    vocab_fma.vocab_fma(x, wf, bf, y2, colsum, 1e-5, alone, cfg, store=False)
    assert torch.equal(alone, first) and torch.equal(y2.view(torch.int8), before.view(torch.int8))
    alone = _keys(device)
    assert kernels.linear(x, wf, bf, ln_fold=colsum, argmax_keys=alone, keys_only=True) is None
    assert torch.equal(alone, first)


def test_vocab_head_pad_fold_same_bits(device, monkeypatch):
    """gpt2's K = 768 (padded to 1024): the padded lanes as -0.0 (gemv_fma.pad_fold; compiled,
    their adds dropped) give the logits and key of the plain products of zeros."""
    K = 768
    x, wf, bf, colsum, *_ = _head(K, N_ODD, torch.float16, device)
    cfg = vocab_fma.vocab_config(1, N_ODD, K, wf.stride(0), sms=sm_count(torch.device(device)))
    assert gemv_fma.pad_fold(K, cfg["BLOCK_K"], cfg["num_warps"])
    got = {}
    for fold in (True, False):
        monkeypatch.setattr(gemv_fma, "PAD_FOLD", fold)
        keys, y = _keys(device), poisoned((1, N_ODD), torch.float16, device)
        vocab_fma.vocab_fma(x, wf, bf, y, colsum, 1e-5, keys, cfg)
        got[fold] = (y, keys)
    assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1])


@pytest.mark.parametrize("layout", [(2, 1, 16), (4, 2, 3)])
def test_vocab_head_forced_layouts(layout, device, monkeypatch):
    """MINILLM_VOCAB_LAYOUT's layouts (A/B timing) give the logits and the argmax too."""
    monkeypatch.setattr(vocab_fma, "FORCED_LAYOUT", layout)
    K = 100
    x, wf, bf, colsum, g, be, w, b = _head(K, N_ODD, torch.float16, device, tied=[7, 8, N_ODD - 1])
    cfg = vocab_fma.vocab_config(1, N_ODD, K, wf.stride(0), sms=sm_count(torch.device(device)))
    assert cfg["num_warps"] == layout[1]
    keys, y = _keys(device), poisoned((1, N_ODD), torch.float16, device)
    kernels.linear(x, wf, bf, ln_fold=colsum, argmax_keys=keys, out=y)
    assert_rel_close(y, ln_linear_ref(x, w, b, g, be), torch.float16, f"vocab head {layout}")
    assert argmax_key.argmax_index(keys).item() == y[0].argmax().item() == 7


def test_resident_per_sm():
    """Programs an SM holds at once: 64K registers in units of 8 a thread per warp, at most 32,
    never more than asked for, at least one."""
    fit = vocab_fma.resident_per_sm
    assert fit(80, 1, 24) == 24 and fit(95, 1, 24) == 21 and fit(124, 4, 4) == 4 and fit(128, 4, 8) == 4
    assert fit(16, 1, 64) == 32 and fit(255, 8, 4) == 1 and fit(81, 1, 24) == 23


@pytest.mark.skipif(not ON_GPU, reason="the programs are fitted to the compiled kernel's registers on a GPU")
def test_vocab_head_programs_fit_the_sms(device, monkeypatch):
    """On a GPU the head launches no more programs than the SMs hold at once by its compiled
    registers, and the logits and argmax hold."""
    monkeypatch.setattr(vocab_fma, "_RESIDENT", {})
    K = 100
    x, wf, bf, colsum, g, be, w, b = _head(K, N_ODD, torch.float16, device)
    keys, y = _keys(device), poisoned((1, N_ODD), torch.float16, device)
    kernels.linear(x, wf, bf, ln_fold=colsum, argmax_keys=keys, out=y)
    (fit,) = vocab_fma._RESIDENT.values()
    assert 1 <= fit <= vocab_fma.PROGRAMS_PER_SM
    assert_rel_close(y, ln_linear_ref(x, w, b, g, be), torch.float16, "fitted vocab head")
    assert argmax_key.argmax_index(keys).item() == y[0].argmax().item()


def test_vocab_head_fit_waits_for_a_real_launch(monkeypatch):
    """In compile_ahead's dry pass the register fit leaves the programs as asked and compiles
    nothing itself (a dry pass's compilation is a future, with no registers to read yet); the
    real launch fits them."""
    class Unfit:
        def warmup(self, *args, **kwargs):
            raise AssertionError("the fit compiled inside a dry pass")

    monkeypatch.setattr(vocab_fma, "_RESIDENT", {})
    with kernels._tuning.dry_launches():
        assert vocab_fma.fitted_programs(Unfit(), 3000, 24, torch.device("cuda"), (), (), {"num_warps": 1}) == 3000
    assert vocab_fma._RESIDENT == {}


def test_vocab_forced_layout_parse():
    assert vocab_fma.forced_layout(None) is None and vocab_fma.forced_layout("") is None
    assert vocab_fma.forced_layout("2x1x16") == (2, 1, 16)
    for bad in ("2x1", "3x1x16", "2x3x16", "2x1x0", "axbxc", "2x1x16x1"):
        with pytest.raises(ValueError, match=r"^MINILLM_VOCAB_LAYOUT: expected BLOCK_NxWARPSxPROGRAMS"):
            vocab_fma.forced_layout(bad)


def test_vocab_head_plain_and_without_argmax(device):
    """No layernorm, no bias, no keys: x @ W alone."""
    K = 72
    x = randn(1, K, device=device)
    w = randn(K, N_ODD, device=device, scale=K ** -0.5).t().contiguous().t()
    y = kernels.linear(x, w)
    assert_rel_close(y, x.double() @ w.double(), torch.float32, "plain vocab head")


def test_vocab_head_all_minus_inf(device):
    """Every logit -inf: the key names column 0, as torch.argmax does."""
    K = 16
    x = randn(1, K, device=device)
    w = randn(K, N_ODD, device=device).t().contiguous().t()
    bias = torch.full((N_ODD,), float("-inf"), device=device)
    keys = _keys(device)
    y = kernels.linear(x, w, bias, argmax_keys=keys)
    assert torch.isneginf(y).all()
    assert argmax_key.argmax_index(keys).item() == 0 == y[0].argmax().item()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_vocab_head_nan_input_names_no_token(bad, device):
    """NaN or inf in the row leaves no logit finite: the key names no token (index N). (A NaN
    weight or bias is not looked for on this path: kernels/vocab_fma.py.)"""
    K = 40
    x, wf, bf, colsum, *_ = _head(K, N_ODD, torch.float32, device)
    x[0, 11] = bad
    keys = _keys(device)
    y = kernels.linear(x, wf, bf, ln_fold=colsum, argmax_keys=keys)
    assert not torch.isfinite(y).any() and argmax_key.argmax_index(keys).item() == N_ODD


def test_vocab_routing(device, monkeypatch):
    """linear sends one row of an out-major vocabulary head without residual, activation or
    statistics out here; anything else goes to the tensor-core GEMV, with the same logits."""
    cfg = vocab_fma.vocab_config
    sms = sm_count(torch.device(device))
    assert cfg(1, 50257, 768, 1, sms=sms) is not None  # gpt2's lm_head at one row
    assert cfg(2, 50257, 768, 1, sms=sms) is None  # two rows
    assert cfg(1, 50257, 768, 768, sms=sms) is None  # in-major weights
    assert cfg(1, 3072, 768, 1, sms=sms) is None  # not a vocabulary
    medium = cfg(1, 50257, 1024, 1, sms=sms)  # gpt2-medium's lm_head: one column a block
    assert medium is not None and cfg(1, 50257, 1280, 1, sms=sms) is None  # K past MAX_K: gpt2-large lost
    if not (INTERPRET or vocab_fma.FORCED_LAYOUT):
        assert (cfg(1, 50257, 768, 1, sms=sms)["BLOCK_N"], medium["BLOCK_N"]) == (vocab_fma.BLOCK_N, 1)
    calls = []
    real = vocab_fma.vocab_fma
    monkeypatch.setattr(gemv, "vocab_fma", lambda *a: calls.append(1) or real(*a))
    K = 24
    x = randn(1, K, device=device)
    w = randn(K, N_ODD, device=device, scale=K ** -0.5).t().contiguous().t()
    routed = kernels.linear(x, w)
    assert calls == [1]
    kernels.linear(x, w, activation="gelu_tanh")
    kernels.linear(x, w, residual=torch.zeros_like(routed))
    kernels.linear(x, w.contiguous())
    assert calls == [1]
    assert_rel_close(routed, kernels.linear(x, w.contiguous()), torch.float32, "routed against tensor cores")


@pytest.mark.skipif(not ON_GPU, reason="interpreter time: gpt2's and gpt2-medium's heads run on the GPU only")
@pytest.mark.parametrize("K", [768, 1024])  # gpt2's and gpt2-medium's (one column a block)
def test_vocab_gpt2_head_same_token_as_in_a_batch(K, device):
    """gpt2's and gpt2-medium's lm_heads: the row alone (here) and inside a batch of 2 (tensor
    cores) give logits within fp16 rounding and the same token."""
    x, wf, bf, colsum, g, be, w, b = _head(K, 50257, torch.float16, device)
    x2 = torch.cat([x, randn(1, K, dtype=torch.float16, device=device)])
    keys1, keys2 = _keys(device), torch.full((2,), argmax_key.EMPTY, dtype=torch.int64, device=device)
    alone = kernels.linear(x, wf, bf, ln_fold=colsum, argmax_keys=keys1)
    batch = kernels.linear(x2, wf, bf, ln_fold=colsum, argmax_keys=keys2)
    assert_rel_close(alone, ln_linear_ref(x, w, b, g, be), torch.float16, "gpt2 head")
    assert_rel_close(alone, batch[:1], torch.float16, "alone against in a batch")
    assert argmax_key.argmax_index(keys1).item() == argmax_key.argmax_index(keys2)[0].item() == alone.argmax().item()
