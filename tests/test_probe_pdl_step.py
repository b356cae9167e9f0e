"""scripts/probe_pdl_step.py: the plan chains every launch of a whole step (layernorms staged,
biases once, attn-out and mlp-out into the residual stream); the torch step matches a second,
separate one (sdpa for the attention); the kernel's GELU form equals torch's; the command line
refuses bad options in one line; on a Hopper GPU the step matches torch."""
import sys

import pytest
import torch
import torch.nn.functional as F

from minillm.config import GPTConfig
from tests.probe_scripts import assert_help_has_example, assert_refused_in_one_line, hopper, load

pps = load("probe_pdl_step")
psc = sys.modules["pdl_step_checkpoint"]  # imported by the script, from scripts/

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


def cpu_step_inputs(cfg):
    """cfg's random weights, parameters and 7 cached positions on the CPU, for a launcher that
    is built (and refuses) but never launched."""
    slabs, shapes = pps.weights(cfg, "cpu")
    params, offs, final = pps.step_params(cfg, "cpu")
    return slabs, shapes, params, offs, final, [tuple(c.cpu() for c in pair) for pair in pps.make_caches(cfg, 7, "cpu")]


def test_int32_words_refuse_sums_their_guard_does_not_cover():
    cfg = GPTConfig(n_layer=1, n_head=12, n_embd=768, n_positions=32, vocab_size=100)  # mlp-out: 12 K chunks
    slabs, shapes, params, offs, final, caches = cpu_step_inputs(cfg)
    with pytest.raises(ValueError, match=r"--sums fixed32: mlp-out's sums take up to 13 parts, more than the guard "
                                         r"covers \(12\); take --order rows or --sums fixed"):
        pps.step_launcher(slabs, shapes, cfg, params, offs, final, caches, 132, 3, pps.Form(order="chunks",
                                                                                         sums="fixed32"))


@pytest.mark.parametrize("form, expect", [
    (pps.Form(sums="fixed", head="screened"), "--head screened: takes --layernorm folded and --sums atomic, grid "
                                              "or fixed32"),
    (pps.Form("staged", head="screened"), "--head screened: takes --layernorm folded and --sums atomic, grid or "
                                          "fixed32"),
    (pps.Form(head="screened"), r"--head screened: the screen takes a vocabulary of at least 16384 columns and a "
                                r"width up to 2048 divisible by 4, got 100 x 320"),
])
def test_screened_head_refuses_what_it_cannot_run(form, expect):
    slabs, shapes, params, offs, final, caches = cpu_step_inputs(CFG)
    with pytest.raises(ValueError, match=expect):
        pps.step_launcher(slabs, shapes, CFG, params, offs, final, caches, 132, 3, form)


def test_forms_share_their_weights_and_pad_their_activations(monkeypatch):
    """Launchers built with one `shared` dict fold the layernorms once (the forms compared then
    read the same weights' addresses); arena_pad moves the activations within their buffer."""
    slabs, shapes, params, offs, final, caches = cpu_step_inputs(CFG)
    folds = []
    fold = pps.fold_layernorms
    monkeypatch.setattr(pps, "fold_layernorms", lambda *a: folds.append(1) or fold(*a))
    shared = {}
    for form, pad in ((pps.Form(), 0), (pps.Form(sums="fixed32"), 64), (pps.Form(gelu="exact"), 96)):
        built = pps.step_launcher(slabs, shapes, CFG, params, offs, final, caches, 132, 3, form, arena_pad=pad,
                                  shared=shared)
        assert built.arena.storage_offset() == pad
    assert len(folds) == 1
    with pytest.raises(ValueError, match="--arena-pad: expected a multiple of 32 words, got 48"):
        pps.step_launcher(slabs, shapes, CFG, params, offs, final, caches, 132, 3, arena_pad=48)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A GPT-2 checkpoint with peaked logits (tests/models.py), head size 64 as the kernels take."""
    from tests.models import build_checkpoint

    path = tmp_path_factory.mktemp("gpt2")
    build_checkpoint(path, n_layer=2, n_head=2, n_embd=128, vocab_size=512, n_positions=64)
    return path


def test_checkpoint_step_is_transformers_gpt2(checkpoint):
    cfg, slabs, shapes, params, offs, final, caches, x0, want = psc.checkpoint_step(checkpoint, 23, "cpu")
    # the random weights' layout, the same shapes
    random_slabs, random_shapes = pps.weights(cfg, "cpu")
    assert shapes == random_shapes and [s.shape for s in slabs] == [s.shape for s in random_slabs]
    assert params.numel() == pps.step_params(cfg, "cpu")[0].numel() and offs == pps.step_params(cfg, "cpu")[1]
    assert all(k.shape == (24, cfg.n_embd) and k[-1].abs().max() == 0 for pair in caches for k in pair)
    got = pps.reference_step(slabs, shapes, params, offs, final, x0, caches, cfg.n_head)
    # the torch step over fp16 weights with fp16 inputs to each linear, against transformers in fp32
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-3 and got.argmax() == want.argmax()


def test_checkpoint_step_refuses_what_it_cannot_run(tmp_path, checkpoint):
    with pytest.raises(ValueError, match="--positions: the model takes at most 63, got 64"):
        psc.checkpoint_step(checkpoint, 64, "cpu")
    from tests.models import build_checkpoint

    build_checkpoint(tmp_path, n_layer=1, n_head=2, n_embd=128, vocab_size=512, activation="relu")
    with pytest.raises(ValueError, match="--checkpoint: the step computes GPT-2's tanh GELU, the model uses relu"):
        psc.checkpoint_step(tmp_path, 8, "cpu")


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


def test_kernel_gelu_form_is_torch_gelu():
    x = torch.linspace(-30, 30, 20001, dtype=torch.float64)
    z = 0.7978845608028654 * (x + 0.044715 * x ** 3)
    mine = x - x / (torch.exp2(2.8853900817779268 * z) + 1.0)  # _gelu_tanh's form
    assert torch.allclose(mine, F.gelu(x, approximate="tanh"), atol=1e-12)


@pytest.mark.parametrize("argv,expect", [
    (["--tiles", "32x3"], "--tiles: the tensor-core form takes 64-row tiles"),
    (["--positions", "0"], "argument --positions: expected an integer >= 1, got 0"),
    (["--model", "gpt5"], "invalid choice: 'gpt5'"),
    (["--leave-out", "attention"], "argument --leave-out: invalid choice: 'attention'"),
    (["--layernorm", "fused"], "argument --layernorm: invalid choice: 'fused'"),
    (["--order", "cols"], "argument --order: invalid choice: 'cols'"),
    (["--gelu", "erf"], "argument --gelu: invalid choice: 'erf'"),
    (["--sums", "ordered"], "argument --sums: invalid choice: 'ordered'"),
    (["--mma", "deferred"], "argument --mma: invalid choice: 'deferred'"),
    (["--mlp-stages", "0"], "argument --mlp-stages: expected an integer >= 1, got 0"),
    (["--head", "argmax"], "argument --head: invalid choice: 'argmax'"),
    (["--guard", "some"], "argument --guard: invalid choice: 'some'"),
    (["--arena-pad", "-32"], "argument --arena-pad: expected an integer >= 0, got -32"),
    (["--arena-pad", "0", "48"], "--arena-pad: expected multiples of 32 words, got [0, 48]"),
    (["--copies", "0"], "argument --copies: expected an integer >= 1, got 0"),
    (["--copies", "2", "--layernorm", "staged"], "--copies: takes --layernorm folded"),
])
def test_cli_refuses_in_one_line(argv, expect):
    assert_refused_in_one_line("probe_pdl_step", argv, expect)


def test_help_has_an_example():
    assert_help_has_example("probe_pdl_step", "python3 scripts/probe_pdl_step.py --model gpt2-xl")


def random_step_inputs():
    """CFG's random weights, parameters, 23 cached positions and x0, on the GPU."""
    slabs, shapes = pps.weights(CFG, "cuda", seed=6)
    params, offs, final = pps.step_params(CFG, "cuda")
    return slabs, shapes, params, offs, final, pps.make_caches(CFG, 23, "cuda"), torch.randn(CFG.n_embd, device="cuda")


@hopper
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("few", [False, True], ids=["sms", "5-programs"])
@pytest.mark.parametrize("form", [pps.Form("staged", gelu="exact", mma="sync"), pps.Form(gelu="exact", mma="sync"),
                                  pps.Form(), pps.Form(order="chunks"), pps.Form(order="mixed"),
                                  pps.Form(mlp_stages=4, qkv_stages=2), pps.Form(sums="fixed"),
                                  pps.Form("staged", "chunks", sums="fixed"), pps.Form(sums="fixed32"),
                                  pps.Form(sums="grid"), pps.Form(order="chunks", sums="grid")], ids=str)
def test_step_matches_torch(stages, few, form):
    # 5 programs: each holds many row blocks, so flushes several partial sums (and K chunks)
    programs = 5 if few else torch.cuda.get_device_properties(0).multi_processor_count
    slabs, shapes, params, offs, final, caches, x0 = random_step_inputs()
    want = pps.reference_step(slabs, shapes, params, offs, final, x0, caches, CFG.n_head)
    built = pps.step_launcher(slabs, shapes, CFG, params, offs, final, caches, programs, stages, form)
    step, logits, x_in, flagged = built.step, built.logits, built.x0, built.flagged
    x_in.copy_(x0)
    runs = []
    for _ in range(3):  # each step starts over: the residual stream set again, the outputs zeroed
        step()
        got = logits()
        assert ((got - want).abs().max() / want.abs().max()).item() < 2e-3
        assert got.argmax() == want.argmax()
        runs.append(got)
    if form.sums != "atomic":  # the same bits every run, whatever order the parts came in
        assert all(torch.equal(runs[0], other) for other in runs[1:])
    assert flagged() is (False if form.sums == "fixed32" else None)


@hopper
@pytest.mark.parametrize("form", [pps.Form(), pps.Form(sums="fixed"), pps.Form(sums="fixed32"), pps.Form(sums="grid")],
                         ids=str)
def test_step_matches_transformers(checkpoint, form):
    cfg, slabs, shapes, params, offs, final, caches, x0, want = psc.checkpoint_step(checkpoint, 23, "cuda")
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    built = pps.step_launcher(slabs, shapes, cfg, params, offs, final, caches, programs, 3, form)
    step, logits, x_in = built.step, built.logits, built.x0
    x_in.copy_(x0)
    step()
    got = logits()
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-3 and got.argmax() == want.argmax()


@hopper
@pytest.mark.parametrize("sums", ["atomic", "fixed32", "grid"])
@pytest.mark.parametrize("few", [False, True], ids=["sms", "5-programs"])
def test_screened_head_gives_the_torch_steps_argmax(few, sums):
    """The engine's greedy head (kernels.screened_argmax) after the step's launches: the argmax of
    the same step in torch, every run (a vocabulary past the screen's 16384 columns, not a
    multiple of its blocks)."""
    cfg = GPTConfig(n_layer=2, n_head=5, n_embd=320, n_positions=32, vocab_size=20011)
    programs = 5 if few else torch.cuda.get_device_properties(0).multi_processor_count
    slabs, shapes = pps.weights(cfg, "cuda", seed=7)
    params, offs, final = pps.step_params(cfg, "cuda")
    caches = pps.make_caches(cfg, 23, "cuda")
    built = pps.step_launcher(slabs, shapes, cfg, params, offs, final, caches, programs, 3,
                              pps.Form(sums=sums, head="screened"))
    checked = 0
    for seed in range(12):
        x0 = torch.randn(cfg.n_embd, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        want = pps.reference_step(slabs, shapes, params, offs, final, x0, caches, cfg.n_head)
        top2 = want.topk(2).values
        if (top2[0] - top2[1]) / want.abs().max() < 4e-3:
            continue  # a near tie (the logits' error is up to 2e-3 of their largest): it would prove nothing
        checked += 1
        built.x0.copy_(x0)
        for _ in range(2):  # the keys reset by each step
            built.step()
            assert built.logits() is None and built.token() == int(want.argmax())
            assert built.flagged() is (False if sums == "fixed32" else None)
    assert checked >= 6


@hopper
@pytest.mark.parametrize("few", [False, True], ids=["sms", "5-programs"])
def test_grid_sums_give_the_int32_words_bits(few):
    """fp32 on int32's grid (--sums grid) holds what the unguarded int32 words hold wherever the
    values stay below 2**8: the same logits bit for bit, whatever order either's parts came in."""
    programs = 5 if few else torch.cuda.get_device_properties(0).multi_processor_count
    slabs, shapes, params, offs, final, caches, x0 = random_step_inputs()
    got, shared = {}, {}
    for sums in ("grid", "fixed32"):
        built = pps.step_launcher(slabs, shapes, CFG, params, offs, final, caches, programs, 3,
                                  pps.Form(sums=sums, guard="off"), shared=shared)
        built.x0.copy_(x0)
        built.step()
        got[sums] = built.logits()
        assert pps.from_words(built.arena[:CFG.n_embd]).abs().max() < 2 ** 8  # the residual stream: in range
    assert torch.equal(got["grid"], got["fixed32"])


@hopper
@pytest.mark.parametrize("guard", sorted(pps.GUARDS))
def test_int32_guard_raises_its_flag(guard):
    """What int32 words cannot hold raises the flag: a residual value at or beyond 2**13 where a
    layernorm reads it (x0 scaled up: the reads' check, and the parts' too, as qkv's raw
    products W' x are then that large), a part or bias added at or beyond 2**11 (attn-out's
    bias, 3,000: the parts' check alone); a step that fits clears it. Each check alone raises it
    for what it covers (--guard, timing only)."""
    parts = guard in ("on", "parts")
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    slabs, shapes, params, offs, final, caches, x0 = random_step_inputs()
    big_bias = params.clone()
    big_bias[offs[1]["attn_out"] + 7] = 3000.0
    cases = ((params, x0, False), (params, x0 * 1e4, guard != "off"), (big_bias, x0, parts), (params, x0, False))
    for p, x, raised in cases:
        built = pps.step_launcher(slabs, shapes, CFG, p, offs, final, caches, programs, 3,
                                  pps.Form(sums="fixed32", guard=guard))
        built.x0.copy_(x)
        built.step()
        assert built.flagged() is raised
