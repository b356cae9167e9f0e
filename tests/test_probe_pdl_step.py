"""scripts/probe_pdl_step.py (its plan: tests/test_pdl_step_plan.py): the launcher refuses what
it cannot run and lets forms share their weights; a real checkpoint's step is transformers'
GPT-2; the kernel's GELU form equals torch's; the command line refuses bad options in one line;
on a Hopper GPU the step matches torch and transformers, and its sums' forms keep their bits."""
import sys

import pytest
import torch
import torch.nn.functional as F

from minillm.config import GPTConfig
from tests.probe_scripts import assert_help_has_example, assert_refused_in_one_line, hopper, load

pps = load("probe_pdl_step")
psc = sys.modules["pdl_step_checkpoint"]  # imported by the script, from scripts/

CFG = GPTConfig(n_layer=2, n_head=5, n_embd=320, n_positions=32, vocab_size=100)  # head size 64


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
    values stay below 2**8: every activation of the step bit for bit, whatever order either's
    parts came in, for 16 fresh x0 (the attention's y was one unit apart for about one x0 in
    five until its fold took explicit fmas, session 162)."""
    programs = 5 if few else torch.cuda.get_device_properties(0).multi_processor_count
    slabs, shapes, params, offs, final, caches, _ = random_step_inputs()
    shared = {}
    grid, words = (pps.step_launcher(slabs, shapes, CFG, params, offs, final, caches, programs, 3,
                                     pps.Form(sums=sums, guard="off"), shared=shared) for sums in ("grid", "fixed32"))
    for _ in range(16):
        x0 = torch.randn(CFG.n_embd, device="cuda")
        got = []
        for built in (grid, words):
            built.x0.copy_(x0)
            built.step()
            got.append(pps.from_words(built.arena[:-1]))  # every activation (the last word: int32's flag)
            assert got[-1][:CFG.n_embd].abs().max() < 2 ** 8  # the residual stream: in range
        assert torch.equal(*got)


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
