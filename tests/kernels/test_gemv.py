"""The decode path of `linear` (kernels/gemv.py): the chunked reduction (split programs or one
looping program), row blocks, the folded layernorm, batch invariance, every layout the sweep
tries. `linear` itself routes M <= 64 here (its row statistics: test_linear.py; its fused
argmax: test_argmax_key.py)."""
import pytest
import torch

import kernels
from kernels import reference as ref
from kernels import gemv_config
from kernels._tuning import sm_count, use_pdl
from kernels.gemv_config import CANDIDATES, SMALL_M
from tests.conftest import ON_GPU
from tests.kernels.helpers import assert_rel_close, gemv_cfg, ln_linear, ln_linear_ref, poisoned, randn


def _ref(x, w, **kw):
    kw = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return ref.linear(x.double(), w.double(), **kw)


# with K = 230: chunks of one and of several BLOCK_Ks, chunk counts that leave the last one
# short or empty (4 x 64 > 230), N off the block; split programs and the looping program
@pytest.mark.parametrize("block_k,chunks", [(32, 1), (32, 3), (64, 4), (32, 2)])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("M", [1, 5, 33])
def test_gemv_chunked_reduction(block_k, chunks, split, M, device):
    """Every chunk count and rows over several 16-row blocks, with repeated launches (the
    arrival counters must be back at zero after each)."""
    K, N = 230, 75
    cfg = gemv_cfg(block_k=block_k, chunks=chunks, split=split)
    for _ in range(2):
        x, w = randn(M, K, device=device), randn(K, N, device=device)
        res = randn(M, N, device=device)
        out = poisoned((M, N), torch.float32, device)
        y = kernels.linear(x, w, activation="relu", residual=res, out=out, _config=cfg)
        expect = _ref(x, w, activation="relu", residual=res)
        assert_rel_close(y, expect, torch.float32, f"chunks {chunks} split {split}")


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_layernorm_across_chunks(chunks, dtype, device):
    """A folded layernorm across chunks: the finishing program normalizes the sum of the chunks'
    products with statistics of the whole row; K spans more than one statistics block
    (LN_BLOCK); the row mean is large against its spread (a cancellation the fold must hold)."""
    M, K, N = 18, 600, 40
    x = randn(M, K, dtype=dtype, device=device) + 8.0
    w = randn(K, N, dtype=dtype, device=device, scale=K ** -0.5)
    g, b = randn(K, dtype=dtype, device=device), randn(K, dtype=dtype, device=device)
    y = ln_linear(x, w, None, g, b, _config=gemv_cfg(block_k=64, chunks=chunks))
    assert_rel_close(y, ln_linear_ref(x, w, None, g, b), dtype, f"ln chunks {chunks}")


# N >= 2K: wide layers; K >= 1024 and N < NARROW_N: 32-column blocks past 16 rows; N >= 16384:
# vocabulary heads, narrow and wide (K >= 1024: another BLOCK_K and 64-row tiles past 16 rows)
@pytest.mark.parametrize("K,N", [(96, 200), (1100, 200), (40, 16500), (1100, 16500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_same_rows_at_any_batch(K, N, dtype, monkeypatch, device):
    """A row's result does not depend on how many other rows share the launch (<= 64), nor on
    the layout decode_config picks for that M (split programs or one looping program, 16- or
    64-row tiles, BLOCK_K). A row alone keeps those bits with the one-atomic merge off (its
    own arithmetic: test_gemv_fixed_merge_one_row)."""
    if max(K, N) > 1000 and not ON_GPU:  # numpy sums tiles of other shapes in its own order
        pytest.skip("the K >= 1024 and vocabulary-head cases run on the GPU only: the interpreter's numpy "
                    "matmul cannot show whether two layouts round alike")
    monkeypatch.setattr(gemv_config, "GEMV_FIXED", "0")
    w, bias = randn(K, N, dtype=dtype, device=device), randn(N, dtype=dtype, device=device)
    x = randn(SMALL_M, K, dtype=dtype, device=device)
    for cfg in (None, gemv_cfg(chunks=3)):
        full = kernels.linear(x, w, bias, activation="gelu_tanh", _config=cfg)
        for m in (1, 7, 12, 17, 32, SMALL_M):  # 7 and 12 rows stage their first tile (stage_first)
            assert torch.equal(kernels.linear(x[:m], w, bias, activation="gelu_tanh", _config=cfg), full[:m])
    split = kernels.linear(x, w, bias, _config=gemv_cfg(block_n=64, chunks=3, split=True))
    looped = kernels.linear(x, w, bias, _config=gemv_cfg(block_n=128, chunks=3, split=False))
    rows32 = kernels.linear(x, w, bias, _config={**gemv_cfg(block_n=64, chunks=3, split=False), "BLOCK_M": 32})
    tall = kernels.linear(x, w, bias, _config={**gemv_cfg(block_n=128, chunks=3, split=False), "BLOCK_M": 64})
    for other, what in ((looped, "looping program"), (rows32, "32-row tiles"), (tall, "64-row tiles")):
        if ON_GPU:
            assert torch.equal(other, split), what
        else:  # numpy's matmul sums a tile of another shape in its own order (OpenBLAS picks by CPU)
            assert_rel_close(other, split, dtype, what)


@pytest.mark.parametrize("M,force", [(1, "auto"), (5, "1")])
@pytest.mark.parametrize("chunks", [3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_fixed_merge_one_row(M, force, chunks, dtype, monkeypatch, device):
    """A row alone's split programs meet by the one-atomic merge (gemv_config.fixed_split; forced
    at 5 rows of a 16-row tile). With a folded layernorm, bias, GELU and a residual it matches
    the float64 reference in fresh draws, twice over (the words are back at zero), the second
    time with the row mean large against its spread. A column whose partial is not finite or
    reaches 2**21 comes out NaN beside finite ones, its word reset all the same. 8 chunks of 32
    over K = 230: the last one short."""
    from kernels import gemv
    from kernels._workspace import fixed_point_sums
    monkeypatch.setattr(gemv_config, "GEMV_FIXED", force)
    merges, launch = [], gemv.launch

    def spy(kernel, grid, *args, **kw):  # which merge each launch runs
        merges.append(kw["FIXED"])
        return launch(kernel, grid, *args, **kw)
    monkeypatch.setattr(gemv, "launch", spy)
    K, N = 230, 75
    cfg = gemv_cfg(block_k=32, chunks=chunks)
    assert gemv_config.fixed_split(chunks, False, M) and not gemv_config.fixed_split(chunks, True, M)
    for shift in (0.5, 8.0):  # 8: the row mean large against its spread (the fold's cancellation)
        x = randn(M, K, dtype=dtype, device=device, scale=2.0) + shift
        w = randn(K, N, dtype=dtype, device=device, scale=K ** -0.5)
        b, h, g, be = (randn(n, dtype=dtype, device=device) for n in ((N,), (M, N), (K,), (K,)))
        out = poisoned((M, N), dtype, device)
        y = ln_linear(x, w, b, g, be, activation="gelu_tanh", residual=h, out=out, _config=cfg)
        assert_rel_close(y, ln_linear_ref(x, w, b, g, be, activation="gelu_tanh", residual=h), dtype,
                         f"fixed merge, {chunks} chunks, M = {M}")
    words = fixed_point_sums(device, M * N)
    assert not words.any(), "the completing programs leave the words zero"
    x = randn(M, K, device=device)
    w = randn(K, N, device=device, scale=K ** -0.5)
    w[:, 7] = float("nan")
    w[:40, 9] = 2.0 ** 21 / 8  # the first chunks' partials reach 2**21 for a row of ones
    y = kernels.linear(torch.ones(M, K, device=device), w, None, _config=cfg)
    assert y[:, 7].isnan().all() and y[:, 9].isnan().all()
    finite = [c for c in range(N) if c not in (7, 9)]
    assert_rel_close(y[:, finite], _ref(torch.ones(M, K, device=device), w[:, finite]), torch.float32, "beside NaN")
    assert not words.any(), "NaN columns reset their words too"
    assert kernels.linear(x, w[:, finite], None, _config=cfg).isfinite().all()
    assert merges == [True] * 4


# K = 230 in 32-wide chunks: 8 chunks in 2 or 3 groups (3 + 3 + 2), 5 in 2 (3 + 2), one chunk
# asked for 2 groups (one group)
@pytest.mark.parametrize("chunks,groups", [(8, 2), (8, 3), (5, 2), (1, 2)])
@pytest.mark.parametrize("M", [3, 33])
def test_gemv_chunk_groups(chunks, groups, M, device):
    """Chunk sums added within groups, then the groups: split programs (one per chunk) and
    group programs (one per group) agree with the reference, twice over (the arrival counters
    are back at zero), and with each other bit for bit on the GPU."""
    K, N = 230, 75
    cfg = {**gemv_cfg(block_k=32, chunks=chunks), "CHUNK_GROUPS": groups}
    group_cfg = {**cfg, "SPLIT": False, "GROUP_SPLIT": True, "BLOCK_N": 64}
    for _ in range(2):
        x, w, res = randn(M, K, device=device), randn(K, N, device=device), randn(M, N, device=device)
        expect = _ref(x, w, activation="relu", residual=res)
        ys = []
        for c in (cfg, group_cfg):
            out = poisoned((M, N), torch.float32, device)
            ys.append(kernels.linear(x, w, activation="relu", residual=res, out=out, _config=c))
            assert_rel_close(ys[-1], expect, torch.float32, f"{c}")
        if ON_GPU:
            assert torch.equal(ys[0], ys[1])


@pytest.mark.parametrize("K,N", [(96, 200), (1100, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_stage_first_same_bits(K, N, dtype, monkeypatch, device):
    """Staging the first tile before the wait (a product of zero rows into the accumulator)
    leaves every bit as it was."""
    if K > 1000 and not ON_GPU:
        pytest.skip("interpreter time: the K >= 1024 case runs on the GPU only")
    M = 7
    x, w = randn(M, K, dtype=dtype, device=device), randn(K, N, dtype=dtype, device=device)
    bias, res = randn(N, dtype=dtype, device=device), randn(M, N, dtype=dtype, device=device)
    assert gemv_config.stage_first(gemv_config.decode_config(M, N, K, x.element_size(), sms=sm_count(x.device)), M, K, False)
    staged = kernels.linear(x, w, bias, residual=res)
    monkeypatch.setattr(gemv_config, "STAGE_FIRST", False)
    torch.testing.assert_close(kernels.linear(x, w, bias, residual=res), staged, rtol=0, atol=0)


# (K, N) with each dimension contiguous; 232 and 80 keep TMA's 16-byte strides, 230 and 75 do not
# (pointer loads then); K off the tiles (the last one zero-filled), N off the column blocks
@pytest.mark.parametrize("K,N,out_major,mode", [(232, 75, True, 2), (230, 80, False, 1), (230, 75, True, 0),
                                                (230, 75, False, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_tma_weights_same_bits(K, N, out_major, mode, dtype, monkeypatch, device):
    """Weight tiles read by tensor descriptor (gemv_config.tma_weights) give the bits of the
    pointer loads, over W or W^T storage, with a folded layernorm, bias and residual: split
    programs in one-tile and several-tile chunks, and the looping program over 2 row blocks;
    where TMA cannot read the weight (strides not 16-byte aligned) the pointer loads serve."""
    from kernels import gemv
    w = randn(K, N, dtype=dtype, device=device, scale=K ** -0.5)
    M = 20
    x = randn(M, K, dtype=dtype, device=device, scale=2.0) + 0.5
    bias, g, be = (randn(n, dtype=dtype, device=device) for n in (N, K, K))
    res = randn(M, N, dtype=dtype, device=device)
    wf, bf, colsum = kernels.fold_layernorm(w, bias, g, be)
    wf = wf.t().contiguous().t() if out_major else wf.contiguous()
    assert gemv.weight_descriptor(wf, 32, 32)[1] == mode
    for cfg in (gemv_cfg(block_k=32, chunks=8), gemv_cfg(block_k=32, chunks=3),
                gemv_cfg(block_k=64, chunks=2, split=False), None):
        rows = M if cfg is not None and not cfg["SPLIT"] else 5
        ys = {}
        for tma in ("0", "1"):
            monkeypatch.setattr(gemv_config, "TMA_WEIGHTS", tma)
            ys[tma] = kernels.linear(x[:rows], wf, bf, residual=res[:rows], ln_fold=colsum,
                                     out=poisoned((rows, N), dtype, device), _config=cfg)
        if ON_GPU or dtype != torch.float32:
            torch.testing.assert_close(ys["1"], ys["0"], rtol=0, atol=0)
        else:  # the interpreter's fp32 products are numpy's BLAS, whose kernel follows the CPU: OpenBLAS's
            # AVX-512 one added the descriptor's transposed W^T tile in another order (its AVX2 one did not).
            # A reordered sum differs by ulps of its terms' size, sum_k |x_k w_k| (up to 0.6 eps of it
            # in 320 comparisons; the layernorm's mean subtraction can leave an output far smaller)
            acc_size = (x[:rows].abs() @ wf.abs()).max().item()
            torch.testing.assert_close(ys["1"], ys["0"], rtol=0, atol=4 * torch.finfo(dtype).eps * acc_size)
        expect = ln_linear_ref(x[:rows], w, bias, g, be, residual=res[:rows])
        assert_rel_close(ys["1"], expect, dtype, f"TMA tiles {cfg}")


# At K = 96 (6 statistics groups) the split programs (up to 16 rows, 4 warps) added a row's group
# statistics by tl.sum in another order than the looping ones (8 warps): Triton lays the tile out
# like the epilogue tensors it meets, which follow the launch (fp16: 3 of 12 random draws differed
# at 16 rows, fp32: 12 of 12; H100, bench/results/h100/rows32.md). Up to 32 groups they are now
# added group after group (_epilogue.SUM_IN_ORDER_GROUPS): K = 96 and K = 320 (20 groups) check
# that path, K = 768 (48) and 1100 (69) tl.sum's.


@pytest.mark.parametrize("with_stats", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("K,N", [(1100, 40), (96, 200), (320, 704), (768, 1536)])
def test_gemv_layernorm_same_rows_at_any_batch(K, N, with_stats, dtype, monkeypatch, device):
    """At K >= 1024 and enough rows (TALL_MIN) a folded-layernorm linear runs 64-row tiles in
    half-chunk K steps; below, split programs (up to 16 rows) or the 16-row loop. gpt2's qkv
    and fc (K = 768, N >= 2K) run one 32-row tile at 17-32 rows and one 64-row tile past that in
    half precision. A row gets the same bits every way on the GPU (the interpreter's numpy matmul
    sums a K step in its own order); a row alone with the one-atomic merge off."""
    if K == 768 and not ON_GPU:
        pytest.skip("interpreter time: the gpt2-sized case runs on the GPU only")
    monkeypatch.setattr(gemv_config, "GEMV_FIXED", "0")
    x = randn(SMALL_M, K, dtype=dtype, device=device, scale=2.0) + 0.5
    w = randn(K, N, dtype=dtype, device=device, scale=K ** -0.5)
    bias, g, b = (randn(n, dtype=dtype, device=device) for n in (N, K, K))
    stats = ref.row_stats(x) if with_stats else None
    rows = {m: gemv_config.decode_config(m, N, K, x.element_size(), ln=True, sms=sm_count(x.device)).get("BLOCK_M")
            for m in (32, SMALL_M)}
    half768 = K == 768 and dtype != torch.float32
    expect = {32: None, SMALL_M: 64} if K > 1000 else {32: 32, SMALL_M: 64} if half768 else {32: None, SMALL_M: None}
    assert rows == expect
    full = ln_linear(x, w, bias, g, b, ln_stats=stats)
    assert_rel_close(full, ln_linear_ref(x, w, bias, g, b), dtype, f"ln tall stats {with_stats}")
    # K = 1100: 40 rows the 16-row loop, 48 64-row tiles. The interpreter cannot show K = 320's
    # bits (see the docstring), so there it runs one row count a layout (interpreter time)
    for m in (1, 8, 16, 17, 32, 40, 48) if ON_GPU or K != 320 else (1, 17, 48):
        part = ln_linear(x[:m], w, bias, g, b, ln_stats=stats[:m] if with_stats else None)
        if ON_GPU:
            assert torch.equal(part, full[:m]), f"rows differ at M = {m}"
        else:
            assert_rel_close(part, full[:m], dtype, f"M = {m}")


@pytest.mark.parametrize("split", [True, False])
def test_gemv_prefetched_residual_in_place(split, device):
    """prefetch_residual reads the residual up front; in place (out=residual) the finishing
    program must still add the old values."""
    M, K, N = 18, 100, 70
    x, w = randn(M, K, device=device), randn(K, N, device=device, scale=K ** -0.5)
    bias, h = randn(N, device=device), randn(M, N, device=device)
    expect = _ref(x, w, bias=bias, activation="gelu_tanh", residual=h)
    kernels.linear(x, w, bias, activation="gelu_tanh", residual=h, out=h, prefetch_residual=True,
                   _config=gemv_cfg(chunks=3, split=split))
    assert_rel_close(h, expect, torch.float32, f"prefetched residual, split={split}")


@pytest.mark.parametrize("M", [2, 4, 8, 16] if ON_GPU else [2, 16])  # (the interpreter compares no chains)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_early_launch_same_bits(M, dtype, device):
    """early_launch moves the dependent-launch trigger to a kernel's start (on the GPU). A layer's
    residual half in the model's order (attn-out and mlp-out early, as the decode step runs 2-4
    rows and gpt2-large 9-16; fc late, so mlp-out may prefetch its residual; then the next
    layernorm linear) on the split layouts gives the bits of the plain chain, twice over
    (arrival counters reset). Without dependent launch (the interpreter, GPUs before Hopper) both
    chains run the same code, so there the plain chain alone is checked against the reference."""
    K, N = 300, 700
    y = randn(M, K, dtype=dtype, device=device)
    x = randn(M, K, dtype=dtype, device=device, scale=2.0) + 0.5
    w1, w4 = (randn(K, K, dtype=dtype, device=device, scale=K ** -0.5) for _ in range(2))
    w2 = randn(K, N, dtype=dtype, device=device, scale=K ** -0.5)
    w3 = randn(N, K, dtype=dtype, device=device, scale=N ** -0.5)
    g, be = randn(K, dtype=dtype, device=device), randn(K, dtype=dtype, device=device)

    def layer(early):
        h = x.clone()
        kernels.linear(y, w1, residual=h, out=h, prefetch_residual=True, early_launch=early)  # attn-out
        f = ln_linear(h, w2, None, g, be, activation="gelu_tanh")  # fc
        kernels.linear(f, w3, residual=h, out=h, prefetch_residual=True, early_launch=early)  # mlp-out
        return h, f, ln_linear(h, w4, None, g, be)  # the next qkv

    plain = layer(False)
    for _ in range(2 if use_pdl(x.device) else 0):
        for a, b in zip(layer(True), plain):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    h1 = x.double() + _ref(y, w1)
    f_ref = ln_linear_ref(h1, w2.double(), None, g.double(), be.double(), activation="gelu_tanh")
    assert_rel_close(plain[1], f_ref, dtype, "early chain fc")
    assert_rel_close(plain[0], h1 + _ref(plain[1], w3), dtype, "early chain mlp-out")


@pytest.mark.parametrize("candidate", CANDIDATES if ON_GPU else CANDIDATES[:2])
def test_gemv_candidate_layouts(candidate, device):
    """Every layout scripts/bench_gemv.py sweeps computes the right thing (layernorm, bias, GELU,
    residual), at one and at several row blocks."""
    block_n, block_k, chunks, split, warps = candidate
    cfg = {**gemv_cfg(block_n, block_k, chunks, split), "num_warps": warps}
    dtype = torch.float16 if ON_GPU else torch.float32
    K, N = (1600, 900) if ON_GPU else (300, 100)
    for M in (1, 40):
        x = randn(M, K, dtype=dtype, device=device)
        w = randn(K, N, dtype=dtype, device=device, scale=K ** -0.5)
        b, h = randn(N, dtype=dtype, device=device), randn(M, N, dtype=dtype, device=device)
        g, be = randn(K, dtype=dtype, device=device), randn(K, dtype=dtype, device=device)
        y = ln_linear(x, w, b, g, be, activation="gelu_tanh", residual=h, _config=cfg)
        expect = ln_linear_ref(x, w, b, g, be, activation="gelu_tanh", residual=h)
        assert_rel_close(y, expect, dtype, f"layout {candidate} M={M}")
