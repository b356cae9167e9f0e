"""scripts/probe_rows_ring.py and its kernel (scripts/pdl_rows_kernels.py): the launches chain each
output into the next input (attn-out reading qkv's first C columns), each launch zeroes the launch
after next's output, a model of the kernel's tile split gives the chain's values in either order,
the command line refuses bad options in one line; on a Hopper GPU the kernel matches torch over
two steps (the second proves the zeroing ahead). (Gluon kernels do not run under the interpreter.)"""

import pytest
import torch

from minillm.config import GPTConfig
from tests.probe_scripts import assert_help_has_example, assert_refused_in_one_line, hopper, load

prr = load("probe_rows_ring")

# K = 320 and 1280 (partial K chunks at 128 and 256), N = 100 ends mid row block
WIDE = GPTConfig(n_layer=2, n_head=2, n_embd=320, n_positions=32, vocab_size=100)


@pytest.mark.parametrize("head", [True, False])
def test_phases_chain_outputs_into_inputs(head):
    R, C = 5, WIDE.n_embd
    _, shapes = prr.weights(WIDE, "cpu")
    rows, size = prr.phases(shapes, R, C, head)
    assert [r[:4] for r in rows] == (shapes if head else shapes[:-1])
    for p, (slab, start, N, K, in_off, stride_xm, out_off) in enumerate(rows):
        if p == 0:
            assert (in_off, stride_xm) == (0, C) and out_off >= R * C  # x0 is not overwritten
        else:
            assert in_off == rows[p - 1][6] and stride_xm == rows[p - 1][2] >= K  # attn-out: qkv's first C
        nxt = rows[p + 1][6] if p + 1 < len(rows) else size
        assert out_off % 32 == 0 and out_off + R * N <= nxt  # outputs never overlap


def test_every_output_but_the_first_two_is_zeroed_two_launches_ahead():
    R = 3
    _, shapes = prr.weights(WIDE, "cpu")
    rows, _ = prr.phases(shapes, R, WIDE.n_embd)
    zeros = prr.zero_ahead(rows, R)
    assert zeros[-2:] == [(0, 0), (0, 0)]
    assert [z for z in zeros[:-2]] == [(r[6], R * r[2]) for r in rows[2:]]
    off, length = prr.prep_zero(rows, R)
    assert off == rows[0][6] and off + length == rows[1][6] + R * rows[1][2]


def emulate(slabs, shapes, R, C, programs, bn, bk, order, x0):
    """What the launches compute: each program's share of tiles in the kernel's order, its parts
    added into the output where a run of one row block ends (order 0) or at every tile (1), x
    rounded to fp16 as it is staged (fp64 sums)."""
    rows, size = prr.phases(shapes, R, C)
    arena = torch.zeros(size, dtype=torch.float64)
    arena[:R * C] = x0.double().flatten()
    for slab, start, N, K, in_off, stride_xm, out_off in rows:
        kt, rb, xs = prr.tile_split(N, K, programs, bn, bk, order)
        x = torch.zeros(R, kt * bk, dtype=torch.float64)
        x[:, :K] = arena[in_off:in_off + R * stride_xm].view(R, stride_xm)[:, :K].half().double()
        w = torch.zeros(rb * bn, kt * bk, dtype=torch.float64)  # TMA's zeros past K; outputs past N masked
        w[:N, :K] = slabs[slab][start:start + N].double()
        y = arena[out_off:out_off + R * N].view(R, N)
        covered = torch.zeros(rb * kt, dtype=torch.int32)
        for pid in range(programs):
            t0, n = prr.share(rb * kt, programs, pid)
            if order == 1 and n:  # the chunks a share touches fit the staged ones
                assert (t0 + n - 1) // rb - t0 // rb + 1 <= xs
            acc = torch.zeros(R, bn, dtype=torch.float64)
            for t in range(t0, t0 + n):
                b, c = divmod(t, kt) if order == 0 else (t % rb, t // rb)
                covered[t] += 1
                acc += x[:, c * bk:(c + 1) * bk] @ w[b * bn:(b + 1) * bn, c * bk:(c + 1) * bk].T
                if order == 1 or c == kt - 1 or t == t0 + n - 1:
                    m = min(bn, N - b * bn)
                    y[:, b * bn:b * bn + m] += acc[:, :m]
                    acc.zero_()
        assert (covered == 1).all()
    return arena[rows[-1][6]:rows[-1][6] + R * shapes[-1][2]].view(R, -1)


@pytest.mark.parametrize("programs,bn,bk,order", [(1, 64, 128, 0), (7, 32, 128, 1), (13, 64, 64, 0),
                                                  (132, 64, 256, 1), (132, 128, 128, 0)])  # 132: some idle
def test_tile_split_gives_the_chain(programs, bn, bk, order):
    slabs, shapes = prr.weights(WIDE, "cpu", seed=3)
    x0 = torch.randn(5, WIDE.n_embd, generator=torch.Generator().manual_seed(1))
    want = prr.reference_chain(slabs, shapes, x0).double()
    got = emulate(slabs, shapes, 5, WIDE.n_embd, programs, bn, bk, order, x0)
    # fp64 against fp32 sums: an input's fp16 rounding may differ by one step (2^-11); a tile missed
    # or added twice is off by the order of the values
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-3


def test_tile_split_and_shared_memory():
    # gpt2's fc at 64 x 128 tiles on 132 SMs: 288 tiles, 3 a share by row block (3 chunks of x)
    assert prr.tile_split(3072, 768, 132, 64, 128, 0) == (6, 48, 3)
    assert prr.tile_split(768, 768, 1, 64, 128, 0) == (6, 12, 6)  # one program: every chunk once
    assert prr.tile_split(3072, 768, 132, 64, 128, 1) == (6, 48, 1)  # 132 shares end on each chunk's end
    assert prr.tile_split(768, 3072, 132, 64, 128, 1) == (24, 12, 2)  # mlp-out: some shares cross a chunk's end
    # x's boxes round up to a power of two: 3 chunks of 2 boxes take 8
    assert prr.smem_bytes(64, 128, 3, 3) == 3 * 64 * 128 * 2 + 8 * 64 * 64 * 2 + 24
    assert prr.smem_bytes(64, 128, 3, 1) == 3 * 64 * 128 * 2 + 2 * 64 * 64 * 2 + 24


@pytest.mark.parametrize("argv,expect", [
    (["--tiles", "64x128"], "expected OUTPUTSxKxSTAGES such as 64x128x3, got '64x128'"),
    (["--tiles", "48x128x3"], "'48x128x3': outputs 16-256 and K 64-256 (powers of two), 1-8 stages"),
    (["--tiles", "256x256x8"], "need 1081408 B of shared memory, over an SM's"),
    (["--rows", "65"], "expected rows from 1 to 64, got '65'"),
    (["--orders", "2"], "invalid choice: 2"),
    (["--modes", "3"], "invalid choice: 3"),
    (["--head", "maybe"], "invalid choice: 'maybe'"),
])
def test_cli_refuses_in_one_line(argv, expect):
    assert_refused_in_one_line("probe_rows_ring", argv, expect)


def test_help_has_an_example():
    assert_help_has_example("probe_rows_ring", "python3 scripts/probe_rows_ring.py --tiles 64x128x3")


@hopper
@pytest.mark.parametrize("R", [64, 5])
@pytest.mark.parametrize("order", [0, 1])
@pytest.mark.parametrize("tile,mode", [((64, 128, 3), 0), ((32, 128, 4), 0), ((128, 64, 3), 0), ((64, 256, 2), 0),
                                       ((64, 128, 3), 2)])  # 2: the next launch triggered late
def test_kernel_matches_torch(R, order, tile, mode):
    cfg = WIDE
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    slabs, shapes = prr.weights(cfg, "cuda", seed=5)
    step, arena, last = prr.launcher(slabs, shapes, R, cfg.n_embd, programs, tile, mode, True, order)
    x0 = torch.randn(R, cfg.n_embd, device="cuda")
    want = prr.reference_chain(slabs, shapes, x0)
    for _ in range(2):  # a second step: each output zeroed again before its atomics
        arena[:R * cfg.n_embd] = x0.flatten()
        step()
        got = arena[last:last + want.numel()].view_as(want)
        # the same fp16 inputs in both; fp32 sums in another order
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-3


@hopper
def test_gpt2_widths_match_torch_without_the_head():
    cfg = GPTConfig(n_layer=2, n_head=12, n_embd=768, n_positions=32, vocab_size=1000)
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    slabs, shapes = prr.weights(cfg, "cuda", seed=6)
    step, arena, last = prr.launcher(slabs, shapes, 64, cfg.n_embd, programs, (64, 128, 3), 0, True, 0, head=False)
    x0 = torch.randn(64, cfg.n_embd, device="cuda")
    want = prr.reference_chain(slabs, shapes, x0, head=False)
    arena[:64 * cfg.n_embd] = x0.flatten()
    step()
    got = arena[last:last + want.numel()].view_as(want)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-3
