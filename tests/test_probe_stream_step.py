"""scripts/probe_stream_step.py and its kernels (scripts/stream_step_kernels.py): the plan covers
every weight once in phase order with the flags the kernels act on; a model of the kernels' table
semantics in torch gives the chain's values, for both weight layouts and both protocols; counted
words decode and count; the command line refuses bad options in one line; on a Hopper GPU both
kernel forms match torch. (Gluon kernels do not run under the interpreter.)"""

import pytest
import torch

from minillm.config import GPTConfig
from tests.probe_scripts import assert_help_has_example, assert_refused_in_one_line, hopper, load

pss = load("probe_stream_step")

# K = 64 or 256 (under one 256-column tile), N = 100 ends mid row block
TINY = GPTConfig(n_layer=2, n_head=2, n_embd=64, n_positions=32, vocab_size=100)
WIDE = GPTConfig(n_layer=1, n_head=2, n_embd=320, n_positions=32, vocab_size=100)  # K = 320, 1280: 2 and 5 tiles


def entries(pl, q):
    return pl["table"][q, :int(pl["counts"][q])].tolist()


@pytest.mark.parametrize("cfg", [TINY, WIDE])
@pytest.mark.parametrize("programs,bn", [(1, 64), (5, 32), (13, 16), (132, 64)])  # 132: some have no tile
def test_plan_covers_every_weight_once(cfg, programs, bn):
    slabs, shapes = pss.weights(cfg, "cpu")
    pl = pss.plan(shapes, cfg.n_embd, programs, bn, "cpu")
    BK = pss.BK
    covered = [torch.zeros(w.shape, dtype=torch.int32) for w in slabs]
    for q in range(programs):
        mine = entries(pl, q)
        assert (pl["table"][q, len(mine):] == 0).all()  # the blocks the kernels read ahead into
        phases = [e[0] >> 8 for e in mine]
        assert phases == sorted(phases)
        for i, (meta, row, col, out_off, in_off, k_len, out_end, want) in enumerate(mine):
            p = meta >> 8
            slab, start, N, K = shapes[p]
            assert meta & 1 == slab and k_len == K and in_off == (pl["outs"][p - 1] if p else 0)
            assert out_end == pl["outs"][p] + N and out_off - pl["outs"][p] == row - start
            assert bool(meta & pss.FIRST) == (i == 0 or phases[i - 1] != p)
            assert bool(meta & pss.PHASE_END) == (i == len(mine) - 1 or phases[i + 1] != p)
            nxt = mine[i + 1] if i + 1 < len(mine) else None
            assert bool(meta & pss.SEG_END) == (nxt is None or nxt[3] != out_off or nxt[0] >> 8 != p)
            rows = slice(row, min(row + bn, start + N))
            covered[slab][rows, col:col + BK] += 1
    assert all((c == 1).all() for c in covered)
    # how many programs count themselves in at each phase: the counters' `want`, a phase late
    busy = [sum(any(e[0] >> 8 == p for e in entries(pl, q)) for q in range(programs)) for p in range(len(shapes))]
    for q in range(programs):
        for e in entries(pl, q):
            p = e[0] >> 8
            assert e[7] == (busy[p - 1] if p else 0)


def emulate(slabs, shapes, pl, x0, counted):
    """What the kernels compute from the table, tile by tile in phase order (outputs by
    fp32 adds or counted words), read back as the last phase's output."""
    BK, bn = pss.BK, pl["bn"]
    arena = torch.zeros(pl["arena"], dtype=torch.int64 if counted else torch.float64)
    arena[:x0.numel()] = pss.encode(x0) if counted else x0.double()
    tiles = sorted((e for q in range(pl["table"].shape[0]) for e in entries(pl, q)), key=lambda e: e[0] >> 8)
    acc, seg = 0, 0
    for meta, row, col, out_off, in_off, k_len, out_end, want in tiles:
        src = arena[in_off + col:in_off + min(k_len, col + BK)]
        if counted:  # every input word complete: its count is the K tiles of the phase before
            assert ((src & 0xFF) == want).all()
            src = pss.decode(src)
        x = torch.zeros(BK, dtype=torch.float64)
        x[:src.numel()] = src
        w = torch.zeros(bn, BK, dtype=torch.float64)  # TMA fills what lies past the slab with zeros
        if pl["tiled"]:  # tile by tile: the tile's rows start at `row`, its columns at 0
            part = slabs[meta & 1][row:row + bn]
        else:
            part = slabs[meta & 1][row:row + bn, col:col + BK]
        w[:part.shape[0], :part.shape[1]] = part.double()
        acc = acc + w @ x
        seg += 1
        if meta & pss.SEG_END:
            n = min(bn, out_end - out_off)
            if counted:
                arena[out_off:out_off + n] += (acc[:n].float().double() * pss.FIX_SCALE).long() * 256 + seg
            else:
                arena[out_off:out_off + n] += acc[:n]
            acc, seg = 0, 0
    last = arena[pl["outs"][-1]:pl["outs"][-1] + shapes[-1][2]]
    return pss.decode(last) if counted else last


@pytest.mark.parametrize("layout", ["rows", "tiles"])
@pytest.mark.parametrize("counted", [False, True])
def test_table_semantics_give_the_chain(layout, counted):
    cfg, programs, bn = WIDE, 7, 32
    slabs, shapes = pss.weights(cfg, "cpu", seed=3)
    if layout == "tiles":
        stored, starts = pss.tile_major(slabs, shapes, bn)
        pl = pss.plan(shapes, cfg.n_embd, programs, bn, "cpu", starts, counted)
    else:
        stored, pl = slabs, pss.plan(shapes, cfg.n_embd, programs, bn, "cpu", counted=counted)
    x0 = torch.randn(cfg.n_embd, generator=torch.Generator().manual_seed(0))
    want = pss.reference(slabs, shapes, x0).double()
    got = emulate(stored, shapes, pl, x0, counted)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_counted_words_add_values_and_counts():
    vals = torch.tensor([[1.5, -2.25, 3e-3, -7.0], [0.5, 0.25, -1e-3, 100.0]], dtype=torch.float64)
    parts = [(v * pss.FIX_SCALE).long() * 256 + n for v, n in zip(vals, (3, 4))]  # two segments: 3 and 4 tiles
    word = parts[0] + parts[1]
    assert ((word & 0xFF) == 7).all()
    assert torch.allclose(pss.decode(word), vals.sum(0), atol=1e-9)
    assert torch.equal(pss.decode(pss.encode(vals[0].float())), vals[0].float().double())


@pytest.mark.parametrize("argv,expect", [
    (["--tiles", "64"], "expected ROWSxSTAGES such as 64x6, got '64'"),
    (["--tiles", "48x4"], "rows 16-128 (a power of two)"),
    (["--tiles", "128x8"], "a ring within 200 KB"),
    (["--forms", "ws0"], "expected one, wsN or wsNlM"),
    (["--forms", "ws1l40"], "0 < M <= 32"),
    (["--modes", "2"], "invalid choice: 2"),
])
def test_cli_refuses_in_one_line(argv, expect):
    assert_refused_in_one_line("probe_stream_step", argv, expect)


def test_help_has_an_example():
    assert_help_has_example("probe_stream_step", "python3 scripts/probe_stream_step.py --model gpt2-xl")


@hopper
@pytest.mark.parametrize("form", ["one", "ws2", "ws2l4"])  # ws2l4: L2 requests ahead, weights tile by tile
@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("bn,stages", [(64, 6), (32, 3)])
def test_kernels_match_torch(form, counted, bn, stages):
    if "l" in form and not pss.ssk.HAS_INLINE_ASM:
        pytest.skip("L2 requests ahead: Gluon's inline_asm, which Triton 3.6 lacks (call 15 of session 105)")
    cfg = WIDE
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    slabs, shapes = pss.weights(cfg, "cuda", seed=5)
    if "l" in form:
        stored, starts = pss.tile_major(slabs, shapes, bn)
    else:
        stored, starts = slabs, None
    pl = pss.plan(shapes, cfg.n_embd, programs, bn, "cuda", starts, counted)
    step, _, arena = pss.launcher(stored, pl, len(shapes), cfg.n_embd, programs, stages, 0, form)
    x0 = torch.randn(cfg.n_embd, device="cuda")
    want = pss.reference(slabs, shapes, x0)
    for _ in range(2):  # a second step: the zero fills start it over
        arena[:cfg.n_embd] = pss.encode(x0) if counted else x0
        step()
        got = arena[pl["outs"][-1]:pl["outs"][-1] + cfg.vocab_size]
        got = pss.decode(got).float() if counted else got
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
