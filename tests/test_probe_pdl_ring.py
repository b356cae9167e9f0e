"""scripts/probe_pdl_ring.py and its kernel (scripts/pdl_ring_kernels.py): the launches' offsets
chain each phase's output into the next one's input; a model of the kernel's tile split and runs
in torch gives the chain's values; the command line refuses bad options in one line; on a Hopper
GPU the kernel matches torch. (Gluon kernels do not run under the interpreter.)"""

import pytest
import torch

from minillm.config import GPTConfig
from tests.probe_scripts import assert_help_has_example, assert_refused_in_one_line, hopper, load

ppr = load("probe_pdl_ring")

# K = 320 and 1280 (2 and 5 K chunks, the last partial); N = 100 ends mid row block
WIDE = GPTConfig(n_layer=2, n_head=2, n_embd=320, n_positions=32, vocab_size=100)


def test_phases_chain_outputs_into_inputs():
    C, bn = WIDE.n_embd, 32
    _, shapes = ppr.weights(WIDE, "cpu")
    rows, size = ppr.phases(shapes, C, bn)
    assert [r[:4] for r in rows] == shapes
    for p, (slab, start, N, K, in_off, out_off, n_tiles, kt) in enumerate(rows):
        assert in_off == (rows[p - 1][5] if p else 0) and out_off % 32 == 0 and out_off >= (C if p == 0 else 0)
        assert kt == -(-K // ppr.BK) and n_tiles == -(-N // bn) * kt
        nxt = rows[p + 1][5] if p + 1 < len(rows) else size
        assert out_off + N <= nxt  # outputs never overlap
    assert rows[0][5] >= C  # x0 is not overwritten


def test_phases_with_attention():
    C = WIDE.n_embd
    _, shapes = ppr.weights(WIDE, "cpu")
    rows, size = ppr.phases(shapes, C, 32, attention=True)
    kinds = ["attn" if r[0] == "attn" else "linear" for r in rows]
    assert kinds == ["linear", "attn", "linear", "linear", "linear"] * WIDE.n_layer + ["linear"]
    for i, r in enumerate(rows):
        if r[0] == "attn":
            _, layer, in_off, out_off = r
            assert layer == i // 5 and in_off == rows[i - 1][5] and rows[i + 1][4] == out_off
            assert out_off >= in_off + 3 * C and rows[i + 1][5] >= out_off + C  # nothing overlaps
    assert size >= rows[-1][5] + shapes[-1][2]


def test_attend_matches_torch_sdpa():
    heads, C, P = 4, 64, 9
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(3 * C, generator=g)
    k_cache, v_cache = (torch.randn(P + 1, C, generator=g).half() for _ in range(2))
    got = ppr.attend(qkv, k_cache, v_cache, heads)
    q, k, v = qkv.view(3, heads, 1, C // heads)
    keys = torch.cat([k_cache[:P].float().view(P, heads, -1).transpose(0, 1), k], dim=1)  # (H, P + 1, D)
    vals = torch.cat([v_cache[:P].float().view(P, heads, -1).transpose(0, 1), v], dim=1)
    want = torch.nn.functional.scaled_dot_product_attention(q[None], keys[None], vals[None]).reshape(C)
    assert torch.allclose(got, want, atol=1e-5)


def emulate(slabs, shapes, C, programs, bn, x0):
    """What the launches compute: each program's share of (row block, K chunk) tiles in order,
    a run of one row block added into the output at its end (fp64)."""
    BK = ppr.BK
    rows, size = ppr.phases(shapes, C, bn)
    arena = torch.zeros(size, dtype=torch.float64)
    arena[:C] = x0.double()
    for slab, start, N, K, in_off, out_off, n_tiles, kt in rows:
        x = torch.zeros(kt * BK, dtype=torch.float64)
        x[:K] = arena[in_off:in_off + K]
        w = torch.zeros(-(-N // bn) * bn, kt * BK, dtype=torch.float64)  # TMA's zeros past K; rows past N masked
        w[:N, :K] = slabs[slab][start:start + N].double()
        covered = torch.zeros(n_tiles, dtype=torch.int32)
        for pid in range(programs):
            t0, n = ppr.share(n_tiles, programs, pid)
            acc = torch.zeros(bn, dtype=torch.float64)
            for t in range(t0, t0 + n):
                nb, kk = divmod(t, kt)
                covered[t] += 1
                acc += w[nb * bn:(nb + 1) * bn, kk * BK:(kk + 1) * BK] @ x[kk * BK:(kk + 1) * BK]
                if kk == kt - 1 or t == t0 + n - 1:
                    m = min(bn, N - nb * bn)
                    arena[out_off + nb * bn:out_off + nb * bn + m] += acc[:m]
                    acc.zero_()
        assert (covered == 1).all()
    return arena[rows[-1][5]:rows[-1][5] + shapes[-1][2]]


@pytest.mark.parametrize("programs,bn", [(1, 64), (7, 32), (13, 16), (132, 64)])  # 132: some programs idle
def test_tile_split_gives_the_chain(programs, bn):
    slabs, shapes = ppr.weights(WIDE, "cpu", seed=3)
    x0 = torch.randn(WIDE.n_embd, generator=torch.Generator().manual_seed(1))
    want = ppr.reference_chain(slabs, shapes, x0).double()
    got = emulate(slabs, shapes, WIDE.n_embd, programs, bn, x0)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_x_rows_and_shared_memory():
    assert ppr.x_rows(625, 25, 132) == 5 and ppr.x_rows(700, 7, 132) == 6 and ppr.x_rows(175, 7, 132) == 2
    assert ppr.x_rows(50, 7, 1) == 7  # one program: every K chunk once
    # gpt2-xl at 64 x 3 with x staged by tile: any two of a layer's launches share one SM
    C = 1600
    shapes = [(0, 0, 3 * C, C), (0, 3 * C, C, C), (0, 4 * C, 4 * C, C), (1, 0, C, 4 * C)]  # (slab, row, N, K)
    rows, _ = ppr.phases(shapes, C, 64)
    each = [ppr.smem_bytes(64, 3, ppr.x_rows(ph[6], ph[7], 132)) for ph in rows[:4]]
    assert max(each) * 2 + 2048 <= ppr.SMEM_PER_SM
    # the tensor-core form stages x as fp16 (8 x 64) boxes: 4 KB a tile's chunk, so only 64 x 2 fits twice
    assert ppr.smem_bytes(64, 3, 6, "mma") == 3 * 32768 + 32 * 1024 + 24
    assert max(ppr.smem_bytes(64, 2, ppr.x_rows(ph[6], ph[7], 132), "mma") for ph in rows[:4]) * 2 + 2048 <= 228 * 1024


@pytest.mark.parametrize("N,K,programs", [(4800, 1600, 132), (1600, 6400, 132), (50257, 1600, 132), (960, 320, 5),
                                           (100, 320, 132), (1600, 1600, 7)])
@pytest.mark.parametrize("order", [0, 1])
def test_mma_shares_match_the_kernels_tile_order(N, K, programs, order):
    kt, rb, chunks, firsts = ppr.mma_shares(N, K, programs, order)
    assert (kt, rb) == (-(-K // ppr.BK), -(-N // 64))
    first_owner = {}
    for pid in range(programs):
        t0, n = ppr.share(rb * kt, programs, pid)
        tiles = [(t // kt, t % kt) if order == 0 else (t % rb, t // rb) for t in range(t0, t0 + n)]
        if order == 1 and n:  # the chunks in a row from the first tile's: x's boxes
            used = sorted({c for _, c in tiles})
            assert used == list(range(used[0], used[0] + len(used))) and len(used) <= chunks
        # the kernel's [rb_lo, rb_hi): exactly the row blocks whose chunk 0 this program holds
        lo, hi = (-(-t0 // kt), -(-(t0 + n) // kt)) if order == 0 else (t0, min(t0 + n, rb))
        assert set(range(lo, hi)) == {r for r, c in tiles if c == 0} and hi - lo <= firsts
        for r in range(lo, hi):
            assert first_owner.setdefault(r, pid) == pid
    assert sorted(first_owner) == list(range(rb))  # every row block's bias added once


@pytest.mark.parametrize("argv,expect", [
    (["--tiles", "64"], "expected ROWSxSTAGES such as 64x6, got '64'"),
    (["--modes", "3"], "invalid choice: 3"),
    (["--model", "gpt5"], "invalid choice: 'gpt5'"),
    (["--positions", "0"], "argument --positions: expected an integer >= 1, got 0"),
    (["--attention", "maybe"], "invalid choice: 'maybe'"),
])
def test_cli_refuses_in_one_line(argv, expect):
    assert_refused_in_one_line("probe_pdl_ring", argv, expect)


def test_help_has_an_example():
    assert_help_has_example("probe_pdl_ring", "python3 scripts/probe_pdl_ring.py --model gpt2-xl")


def test_mma_runs_only_on_64_row_tiles(capsys):
    args = type("A", (), dict(tiles=[(64, 3), (32, 4)], forms=["cuda", "mma"], reg=[0, 2]))
    assert list(ppr.runs(args)) == [((64, 3), 0, "cuda"), ((64, 3), 2, "cuda"), ((64, 3), 0, "mma"),
                                    ((32, 4), 0, "cuda"), ((32, 4), 2, "cuda")]
    assert "mma skipped at 32-row tiles" in capsys.readouterr().out


@hopper
@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("mode", [0, 2])  # 2: the next launch triggered late
@pytest.mark.parametrize("bn,stages,reg,form", [(64, 2, 0, "cuda"), (32, 4, 1, "cuda"), (16, 3, 2, "cuda"),
                                               (64, 3, 2, "cuda"), (64, 3, 0, "cuda16"), (32, 3, 2, "cuda16")])
def test_kernel_matches_torch(pdl, mode, bn, stages, reg, form):
    cfg = WIDE
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    slabs, shapes = ppr.weights(cfg, "cuda", seed=5)
    step, arena, last = ppr.launcher(slabs, shapes, cfg.n_embd, programs, bn, stages, reg, mode, pdl, form)
    x0 = torch.randn(cfg.n_embd, device="cuda")
    want = ppr.reference_chain(slabs, shapes, x0)
    for _ in range(2):  # a second step: the zero fill starts it over
        arena[:cfg.n_embd] = x0
        step()
        got = arena[last:last + cfg.vocab_size]
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


@hopper
@pytest.mark.parametrize("mode", [0, 2])
@pytest.mark.parametrize("stages", [2, 3])
def test_mma_kernel_matches_torch(mode, stages):
    cfg = WIDE
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    slabs, shapes = ppr.weights(cfg, "cuda", seed=7)
    step, arena, last = ppr.launcher(slabs, shapes, cfg.n_embd, programs, 64, stages, 0, mode, True, "mma")
    x0 = torch.randn(cfg.n_embd, device="cuda")
    want = ppr.reference_chain(slabs, shapes, x0, fp16_x=True)
    for _ in range(2):
        arena[:cfg.n_embd] = x0
        step()
        got = arena[last:last + cfg.vocab_size]
        # each phase's fp32 output rounds to fp16 as the next one's input, in both
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-3


@hopper
@pytest.mark.parametrize("form", ["cuda", "mma"])
def test_chain_with_attention_matches_torch(form):
    cfg = GPTConfig(n_layer=2, n_head=5, n_embd=320, n_positions=32, vocab_size=100)  # the kernel's D = 64
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    slabs, shapes = ppr.weights(cfg, "cuda", seed=9)
    caches = ppr.make_caches(cfg, 37, "cuda")
    step, arena, last = ppr.launcher(slabs, shapes, cfg.n_embd, programs, 64, 3, 0, 0, True, form, caches, cfg.n_head)
    x0 = torch.randn(cfg.n_embd, device="cuda")
    want = ppr.reference_chain(slabs, shapes, x0, form == "mma", caches, cfg.n_head)
    for _ in range(2):
        arena[:cfg.n_embd] = x0
        step()
        got = arena[last:last + cfg.vocab_size]
        assert ((got - want).abs().max() / want.abs().max()).item() < (1e-3 if form == "mma" else 1e-4)
    k_new = arena[ppr.phases(shapes, cfg.n_embd, 64, attention=True)[0][0][5] + cfg.n_embd:][:cfg.n_embd]
    assert torch.equal(caches[0][0][-1], k_new.half())  # this step's key appended at row P
