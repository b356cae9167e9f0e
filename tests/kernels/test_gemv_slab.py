"""The whole-slab decode GEMV (kernels/gemv_slab.py): a row's bits against gemv.py's looping
layouts over the same chunks, every epilogue the model asks of it, the chunk counts it takes,
and its refusals."""
import pytest
import torch

import kernels
from kernels import gemv_config, gemv_slab
from kernels import reference as ref
from tests.conftest import ON_GPU
from tests.kernels.helpers import assert_rel_close, ln_linear_ref, poisoned, randn

SLAB = {"BLOCK_N": 32, "BLOCK_K": 128, "CHUNKS": 6, "SPLIT": False, "SLAB": True, "num_warps": 4, "BLOCK_M": 64}
LOOP = {"BLOCK_N": 32, "BLOCK_K": 128, "CHUNKS": 6, "SPLIT": False, "num_warps": 4, "BLOCK_M": 64, "num_stages": 2}


def _layer(kind, M, K, N, dtype, device):
    """(x, weight, bias, linear's keyword arguments, the float64 reference) of one decode layer
    as the model calls it: qkv (a folded layernorm with the producer's row statistics), fc (the
    same, and GELU) or attn-out (a residual, and row statistics out). Weights out-major, as the
    model stores them."""
    x = randn(M, K, dtype=dtype, device=device, scale=2.0) + 0.5
    w = randn(N, K, dtype=dtype, device=device, scale=K ** -0.5).t()
    bias = randn(N, dtype=dtype, device=device)
    if kind == "attn-out":
        res = randn(M, N, dtype=dtype, device=device)
        kw = dict(residual=res, stats_out=kernels.new_row_stats(M, N, device))
        return x, w, bias, kw, ref.linear(x.double(), w.double(), bias.double(), residual=res.double())
    g, be = randn(K, dtype=dtype, device=device), randn(K, dtype=dtype, device=device)
    wf, bf, colsum = kernels.fold_layernorm(w, bias, g, be)
    act = "gelu_tanh" if kind == "fc" else None
    kw = dict(ln_fold=colsum, ln_stats=ref.row_stats(x), activation=act)
    return x, wf, bf, kw, ln_linear_ref(x, w, bias, g, be, activation=act)


# K: six chunks (gpt2's 768) and four with the last one short (500); N off the 32-column blocks;
# 33 and 64 rows (the rule's ends: past 64 a launch is not a decode GEMV)
@pytest.mark.parametrize("kind", ["qkv", "fc", "attn-out"])
@pytest.mark.parametrize("K,N,M", [(768, 70, 64), (500, 100, 33)])
def test_gemv_slab_bits_of_the_loop(kind, K, N, M, device):
    """The slab program gives the looping program's bits (the same chunks, added in the same
    order) and the float64 reference's values, with every output element written; the row
    statistics it leaves describe its output. (Under the interpreter tl.dot is numpy's product
    plus the accumulator, so there the bits check the chunks and their order; on the GPU also
    that each chunk starts from a fresh accumulator.)"""
    dtype = torch.float16
    x, w, bias, kw, expect = _layer(kind, M, K, N, dtype, device)
    chunks = -(-K // 128)
    ys = {}
    for name, cfg in (("slab", SLAB), ("loop", LOOP)):
        kw_run = dict(kw)
        if "stats_out" in kw:
            kw_run["stats_out"] = kernels.new_row_stats(M, N, device)
        ys[name] = kernels.linear(x, w, bias, out=poisoned((M, N), dtype, device), _config=cfg | {"CHUNKS": chunks},
                                  **kw_run)
        assert_rel_close(ys[name], expect, dtype, f"{name} {kind} K {K}")
        if "stats_out" in kw:  # (sum, sum of squares) per 16-column group, from the stored values
            groups = kw_run["stats_out"]
            y = torch.nn.functional.pad(ys[name].float(), (0, groups.shape[2] * 16 - N)).view(M, -1, 16)
            torch.testing.assert_close(groups[:, 0], y.sum(2), rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(groups[:, 1], (y * y).sum(2), rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(ys["slab"], ys["loop"], rtol=0, atol=0)


@pytest.mark.parametrize("stages", [3, 7])
@pytest.mark.parametrize("kind", ["qkv", "attn-out"])
def test_gemv_slab_pipelined_same_bits(kind, stages, monkeypatch, device):
    """MINILLM_SLAB_PIPELINED (the chunks through a pipelined loop, the slab asked into L2 on
    Hopper) gives the named tiles' bits: the same chunks, added in the same order."""
    M, K, N = 64, 768, 100
    x, w, bias, kw, expect = _layer(kind, M, K, N, torch.float16, device)
    ys = {}
    for env in (0, stages):
        monkeypatch.setattr(gemv_slab, "PIPELINED_ENV", env)
        kw_run = dict(kw)
        if "stats_out" in kw:
            kw_run["stats_out"] = kernels.new_row_stats(M, N, device)
        ys[env] = kernels.linear(x, w, bias, out=poisoned((M, N), torch.float16, device), _config=SLAB, **kw_run)
        assert_rel_close(ys[env], expect, torch.float16, f"{kind} stages {env}")
    assert gemv_slab.pipelined_stages(6) == min(stages, 7)
    torch.testing.assert_close(ys[stages], ys[0], rtol=0, atol=0)


def test_gemv_slab_prefetched_residual_in_place(device):
    """The residual read before the wait (prefetch_residual) and the output written over it, as
    the model's attn-out does: the same bits as the residual read after it."""
    M, K, N = 40, 384, 48
    x, w, bias = randn(M, K, device=device), randn(N, K, device=device, scale=K ** -0.5).t(), randn(N, device=device)
    x, w, bias = x.half(), w.half(), bias.half()
    res = randn(M, N, device=device).half()
    late = kernels.linear(x, w, bias, residual=res, _config=SLAB | {"CHUNKS": 3})
    inplace = res.clone()
    y = kernels.linear(x, w, bias, residual=inplace, out=inplace, prefetch_residual=True, _config=SLAB | {"CHUNKS": 3})
    assert y.data_ptr() == inplace.data_ptr()
    torch.testing.assert_close(y, late, rtol=0, atol=0)


def test_slab_layout_rule(monkeypatch):
    """gpt2's qkv, fc and attn-out (K = 768) take the slab past 32 rows in half precision; fp32,
    K past 768 or below ROWS32_MIN_K, and 32 rows or fewer keep gemv.py's layouts;
    MINILLM_SLAB_MIN_ROWS moves the threshold (65: off). (gpt2's mlp-out, in chunk groups,
    follows its own rule: test_gemv_config.test_decode_config_chunk_groups.)"""
    monkeypatch.setattr(gemv_config, "SLAB_MIN_ROWS", 33)

    def slab(M, N, K, itemsize=2, ln=True):
        return gemv_config.decode_config(M, N, K, itemsize, ln, sms=132).get("SLAB", False)
    for N, ln in ((2304, True), (3072, True), (768, False)):
        assert slab(33, N, 768, ln=ln) and slab(64, N, 768, ln=ln)
        assert not slab(32, N, 768, ln=ln) and not slab(1, N, 768, ln=ln)
        assert not slab(64, N, 768, itemsize=4, ln=ln)
    assert gemv_config.decode_config(64, 2304, 768, 2, True, sms=132)["CHUNKS"] == 6
    assert not slab(64, 3072, 1024)  # gpt2-medium's qkv
    assert not slab(64, 200, 96) and slab(64, 200, 512)
    monkeypatch.setattr(gemv_config, "SLAB_MIN_ROWS", 65)
    assert not slab(64, 2304, 768)


# gpt2's mlp-out as the model calls it (a residual, row statistics out) in chunk groups: 10 chunks
# in 3 groups (4 + 4 + 2) and in 2 (5 + 5); 17-32 rows (which take the group slabs too), 40 and
# 64, N off the 32-column blocks
@pytest.mark.parametrize("groups,M", [(3, 40), (2, 64), (3, 24)])
def test_gemv_slab_chunk_groups(groups, M, device):
    """A slab program a chunk group, the last of a column block to arrive adding the group sums
    (twice over: the arrival counters are back at zero), gives the bits of gemv.py's group
    programs (GROUP_SPLIT) on the same tiles, on the GPU also on the model's 16-row tiles, and
    the float64 reference's values. (The interpreter's products are numpy's, whose order of
    addition may follow the tile's shape.)"""
    K, N = 600, 70
    x, w, bias, kw, expect = _layer("attn-out", M, K, N, torch.float16, device)
    slab = SLAB | {"BLOCK_K": 64, "CHUNKS": 10, "CHUNK_GROUPS": groups}
    loop = {"BLOCK_N": 32, "BLOCK_K": 64, "CHUNKS": 10, "SPLIT": False, "GROUP_SPLIT": True, "CHUNK_GROUPS": groups,
            "BLOCK_M": 64}
    cfgs = [("slab", slab), ("loop", loop), ("slab again", slab)]
    if ON_GPU:
        cfgs.append(("16-row loop", loop | {"BLOCK_N": 64, "BLOCK_M": 16}))
    ys, stats = {}, {}
    for name, cfg in cfgs:
        stats[name] = kernels.new_row_stats(M, N, device)
        ys[name] = kernels.linear(x, w, bias, out=poisoned((M, N), torch.float16, device), _config=cfg,
                                  residual=kw["residual"], stats_out=stats[name])
        assert_rel_close(ys[name], expect, torch.float16, f"{name} groups {groups}")
    for name, _ in cfgs[1:]:
        torch.testing.assert_close(ys[name], ys["slab"], rtol=0, atol=0)
        # (the statistics of the same values, summed over another tile's layout on the 16-row tiles)
        exact = name != "16-row loop"
        torch.testing.assert_close(stats[name], stats["slab"], rtol=0 if exact else 1e-6, atol=0 if exact else 1e-4)


def test_gemv_slab_refusals(monkeypatch, device):
    """A slab layout over more than six chunks or in chunk groups without the pipelined loop,
    with chunks of several BLOCK_Ks, over more rows than its tile, or asked for argmax keys:
    one error naming _config."""
    x, w = randn(8, 900, device=device).half(), randn(900, 40, device=device).half()
    monkeypatch.setattr(gemv_slab, "PIPELINED_ENV", 0)
    with pytest.raises(ValueError, match="_config: a SLAB layout"):
        kernels.linear(x, w, _config=SLAB | {"CHUNKS": 8})  # K = 900: 8 chunks
    with pytest.raises(ValueError, match="_config: a SLAB layout"):
        kernels.linear(x[:, :256], w[:256], _config=SLAB | {"CHUNKS": 2, "CHUNK_GROUPS": 2})
    monkeypatch.undo()
    with pytest.raises(ValueError, match="_config: a SLAB layout"):
        kernels.linear(x[:, :256], w[:256], _config=SLAB | {"CHUNKS": 1})  # one 256-wide chunk
    with pytest.raises(ValueError, match="_config: a SLAB layout"):
        kernels.linear(x[:, :256], w[:256], _config=SLAB | {"CHUNKS": 2, "BLOCK_M": 4})
    with pytest.raises(ValueError, match="_config: the SLAB layout writes no argmax_keys"):
        kernels.linear(x[:, :256], w[:256], argmax_keys=torch.zeros(8, dtype=torch.int64, device=device),
                       _config=SLAB | {"CHUNKS": 2})
