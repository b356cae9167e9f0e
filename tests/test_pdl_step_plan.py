"""scripts/pdl_step_plan.py, the plan of scripts/probe_pdl_step.py's whole step, in plain torch:
the plan chains every launch (layernorms staged, biases once, attn-out and mlp-out into the
residual stream), pieces are left out one at a time, the folded layernorm is the same linear,
the fixed-point words and the grid's fp32 sums add in any order to the same bits, the parts a
sum takes are counted, and the torch step matches a second, separate one (sdpa for the
attention)."""
import sys

import torch
import torch.nn.functional as F

from minillm.config import GPTConfig
from tests.probe_scripts import load

pps = load("probe_pdl_step")  # the plan's names, as the probe imports them

CFG = GPTConfig(n_layer=2, n_head=5, n_embd=320, n_positions=32, vocab_size=100)  # head size 64


def test_plan_chains_a_whole_step():
    C = CFG.n_embd
    _, shapes = pps.weights(CFG, "cpu")
    params, offs, final = pps.step_params(CFG, "cpu")
    rows, size = pps.plan_step(shapes, C, CFG.n_head, offs, final)
    assert len(rows) == 5 * CFG.n_layer + 1
    for layer, o in enumerate(offs):
        qkv, attn, out, fc, mlp = rows[5 * layer:5 * layer + 5]
        assert qkv[2:7] == (3 * C, C, 0, qkv[5], pps.LAYERNORM) and qkv[7:] == (o["ln1_w"], o["ln1_b"], o["qkv"])
        assert attn == ("attn", layer, qkv[5], attn[3])
        assert out[2:7] == (C, C, attn[3], 0, pps.PLAIN) and out[9] == o["attn_out"]  # into the residual
        assert fc[2:7] == (4 * C, C, 0, fc[5], pps.LAYERNORM) and fc[7:] == (o["ln2_w"], o["ln2_b"], o["fc"])
        assert mlp[2:7] == (C, 4 * C, fc[5], 0, pps.GELU) and mlp[9] == o["mlp_out"]
        assert C <= qkv[5] < attn[3] < fc[5] and attn[3] >= qkv[5] + 3 * C and fc[5] >= attn[3] + C
    head = rows[-1]
    assert head[2:4] == (CFG.vocab_size, C) and head[6:] == (pps.LAYERNORM, final["ln_w"], final["ln_b"], -1)
    assert head[5] + CFG.vocab_size <= size
    # the parameters: every piece once, the layernorm weights near 1
    spans = sorted((v, v + n) for o in offs for k, v in o.items()
                   for n in [{"qkv": 3 * C, "fc": 4 * C}.get(k, C)]) + [(final["ln_w"], final["ln_w"] + 2 * C)]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] == params.numel()
    assert (params[offs[1]["ln2_w"]:offs[1]["ln2_w"] + C] - 1).abs().max() < 1


def test_leave_out_prices_one_part_at_a_time():
    _, shapes = pps.weights(CFG, "cpu")
    params, offs, final = pps.step_params(CFG, "cpu")
    rows, _ = pps.plan_step(shapes, CFG.n_embd, CFG.n_head, offs, final)
    assert pps.leave_out_parts(rows, ()) == rows
    for part, changed in (("layernorm", {0, 3}), ("gelu", {4}), ("bias", {0, 2, 3, 4})):
        got = pps.leave_out_parts(rows, (part,))
        diff = {i % 5 for i, (a, b) in enumerate(zip(rows, got)) if a != b}
        assert diff == changed, part
        assert (got[-1] != rows[-1]) == (part == "layernorm")  # the head: its final layernorm, no bias
        assert all(a[:6] == b[:6] for a, b in zip(rows, got))


def test_folded_layernorm_is_the_same_linear():
    slabs, shapes = pps.weights(CFG, "cpu", seed=5)
    params, offs, final = pps.step_params(CFG, "cpu")
    rows, _ = pps.plan_step(shapes, CFG.n_embd, CFG.n_head, offs, final)
    folded, fparams, plan = pps.fold_layernorms(slabs, params, rows)
    assert folded[1] is slabs[1] and folded[0] is not slabs[0]  # mlp-out's K = 4C slab: no layernorm
    x = torch.randn(CFG.n_embd, generator=torch.Generator().manual_seed(9)) * 3 + 0.5
    mean, rstd = x.mean(), (x.var(unbiased=False) + pps.EPS).rsqrt()
    finished = 0
    for i, (row, new) in enumerate(zip(rows, plan)):
        if row[0] == "attn" or row[6] != pps.LAYERNORM:
            if row[0] == "attn":  # qkv's outputs finished here: u's and c's offsets added
                assert new == (*row, *new[4:6]) and len(new) == 6
            else:
                assert new == row
            continue
        slab, start, N, K, _, _, _, g_off, b_off, bias_off = row
        assert new[:6] == row[:6]
        if i + 1 < len(rows) and rows[i + 1][0] == "attn":  # qkv: raw outputs, no bias
            assert new[6:] == (pps.PLAIN, 0, 0, -1)
            u_off, c_off = plan[i + 1][4:6]
        else:
            assert new[6] == pps.FOLDED
            u_off, c_off = new[7], new[9]
        u, c = fparams[u_off:u_off + N], fparams[c_off:c_off + N]
        ln = F.layer_norm(x, (K,), params[g_off:g_off + K], params[b_off:b_off + K], pps.EPS)
        want = slabs[slab][start:start + N].float() @ ln + (params[bias_off:bias_off + N] if bias_off >= 0 else 0)
        got = rstd * (folded[slab][start:start + N].float() @ x - mean * u) + c
        assert ((got - want).abs().max() / want.abs().max()).item() < 2e-3  # W' in fp16: an ulp of the weights
        finished += 1
    assert finished == 2 * CFG.n_layer + 1
    stripped = pps.leave_out_parts(plan, ("layernorm",))
    assert all(len(r) == 4 for r in stripped if r[0] == "attn")
    assert all(r[6] == pps.PLAIN for r in stripped if r[0] != "attn" and r[6] != pps.GELU)


def test_fixed_point_words_add_in_any_order_to_the_same_bits():
    """The fixed-point form's arithmetic in torch: parts truncated to int64 words and added in
    any order give the same words (fp32 sums do not), within a unit a part of the exact sum."""
    g = torch.Generator().manual_seed(7)
    parts = torch.randn(13, 1600, generator=g) * 40  # 13 split-K parts of 1,600 outputs
    words = [pps.to_words(parts[torch.randperm(13, generator=g)]).sum(0) for _ in range(4)]
    assert all(torch.equal(words[0], w) for w in words[1:])
    floats = [parts[torch.randperm(13, generator=g)].sum(0) for _ in range(4)]
    assert not all(torch.equal(floats[0], f) for f in floats[1:])  # what the atomics' order does
    exact = parts.double().sum(0)
    assert (pps.from_words(words[0]).double() - exact).abs().max() <= 13 * 2.0 ** -24 + exact.abs().max() * 2 ** -23
    x = torch.randn(100, generator=g) * 1000  # words and back: one rounding, no scale lost
    assert (pps.from_words(pps.to_words(x)) - x).abs().max() <= 2.0 ** -24 + x.abs().max() * 2 ** -24
    assert pps.to_words(x, 32).dtype == torch.int32  # the int32 words: units of 2**-16
    assert (pps.from_words(pps.to_words(x, 32)) - x).abs().max() <= 2.0 ** -16 + x.abs().max() * 2 ** -24
    # beyond their range they saturate, as the GPU's conversion does (the readers' guard sees it)
    assert pps.to_words(torch.tensor([1e6, -1e6]), 32).tolist() == [2 ** 31 - 128, -2 ** 31]


def test_grid_sums_are_exact_in_any_order_below_their_range():
    """--sums grid in torch: parts truncated onto int32's grid (multiples of 2**-16) and added in
    fp32 in any order give the same bits while the sums stay below 2**8, and the same values as
    int32 words; past that the fp32 sums round (their bits may vary) but stay near the exact sum,
    where int32 words wrap."""
    g = torch.Generator().manual_seed(11)
    parts = torch.randn(13, 4096, generator=g) * 9  # 13 split-K parts; sums up to about 130
    grid = pps.to_words(parts, pps.WORD_BITS["grid"])
    assert grid.dtype == torch.float32 and torch.equal(grid, torch.trunc(grid * 2 ** 16) / 2 ** 16)
    assert torch.equal(grid, pps.from_words(pps.to_words(parts, 32)))  # the int32 words' values
    assert (grid - parts).abs().max() < 2.0 ** -16 and ((grid - parts) * parts <= 0).all()  # toward zero
    order_sums = []
    for _ in range(4):
        acc = torch.zeros(4096)
        for i in torch.randperm(13, generator=g):  # one fp32 add a part, as the atomics add them
            acc = acc + grid[i]
        order_sums.append(acc)
    assert order_sums[0].abs().max() < 2 ** 8
    assert all(torch.equal(order_sums[0], o) for o in order_sums[1:])
    assert torch.equal(order_sums[0], pps.from_words(pps.to_words(parts, 32).sum(0, dtype=torch.int32)))
    big = pps.to_words(parts * 300, pps.WORD_BITS["grid"])  # sums up to about 4e4: past 2**8
    acc = torch.zeros(4096)
    for i in torch.randperm(13, generator=g):
        acc = acc + big[i]
    exact = big.double().sum(0)
    assert (acc.double() - exact).abs().max() <= 13 * exact.abs().max() * 2 ** -24  # rounded, not wrapped
    assert pps.from_words(grid) is not grid and torch.equal(pps.from_words(grid), grid)


def test_most_parts_counts_each_program_on_a_row_block():
    for N, K, programs in ((1600, 6400, 132), (320, 1280, 5), (50257, 1600, 132), (128, 512, 132), (4800, 1600, 7)):
        kt, rb = -(-K // pps.BK), -(-N // 64)
        holders = [set() for _ in range(rb)]
        for pid in range(programs):
            t0, n = sys.modules["probe_pdl_ring"].share(rb * kt, programs, pid)
            for t in range(t0, t0 + n):
                holders[t // kt].add(pid)
        assert pps.most_parts(N, K, programs, 0) == 1 + max(len(h) for h in holders)
        assert pps.most_parts(N, K, programs, 1) == kt + 1  # a part a tile, and the bias


def separate_step(slabs, shapes, params, offs, final, x0, caches, heads):
    """The same step written out once more, op by op, with torch's sdpa for the attention."""
    C, D = x0.numel(), x0.numel() // heads

    def w(i):
        slab, start, N, _ = shapes[i]
        return slabs[slab][start:start + N].float()

    def p(off, n=C):
        return params[off:off + n]

    r = x0.clone()
    for layer, o in enumerate(offs):
        a = F.layer_norm(r, (C,), p(o["ln1_w"]), p(o["ln1_b"]), 1e-5).half().float()
        q, k, v = (w(4 * layer) @ a + p(o["qkv"], 3 * C)).split(C)
        kc, vc = caches[layer]
        keys = torch.cat([kc[:-1].float(), k[None]]).view(-1, heads, D).transpose(0, 1)
        vals = torch.cat([vc[:-1].float(), v[None]]).view(-1, heads, D).transpose(0, 1)
        y = F.scaled_dot_product_attention(q.view(heads, 1, D), keys, vals).reshape(C)
        r = r + w(4 * layer + 1) @ y.half().float() + p(o["attn_out"])
        m = F.layer_norm(r, (C,), p(o["ln2_w"]), p(o["ln2_b"]), 1e-5).half().float()
        h = w(4 * layer + 2) @ m + p(o["fc"], 4 * C)
        r = r + w(4 * layer + 3) @ F.gelu(h, approximate="tanh").half().float() + p(o["mlp_out"])
    f = F.layer_norm(r, (C,), p(final["ln_w"]), p(final["ln_b"]), 1e-5).half().float()
    return w(len(shapes) - 1) @ f


def test_reference_step_matches_a_separate_one():
    slabs, shapes = pps.weights(CFG, "cpu", seed=4)
    params, offs, final = pps.step_params(CFG, "cpu")
    caches = [tuple(c.cpu() for c in pair) for pair in pps.make_caches(CFG, 11, "cpu")]
    x0 = torch.randn(CFG.n_embd, generator=torch.Generator().manual_seed(3))
    got = pps.reference_step(slabs, shapes, params, offs, final, x0, caches, CFG.n_head)
    want = separate_step(slabs, shapes, params, offs, final, x0, caches, CFG.n_head)
    # both round each linear's input to fp16, where fp32 differences of the order of the two
    # attentions' flip a rounding now and then: an fp16 ulp or so, far under a wrong piece's error
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-3
