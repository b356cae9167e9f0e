"""scripts/probe_cache_placement.py: its turns' order, its help, its one-line refusals, and on a
GPU a short run over a small checkpoint."""
import json

import pytest
import torch

from minillm.api import LLM

from tests.conftest import ON_GPU
from tests.models import build_checkpoint
from tests.probe_scripts import assert_help_has_example, assert_refused_in_one_line, load, run

probe = load("probe_cache_placement")


def test_schedule_alternates_every_cache():
    """Every (engine, kind, copy) once a round, the order reversed on odd rounds."""
    kinds = [("heads", 0), ("positions", 8)]
    turns = probe.schedule(engines=2, kinds=kinds, copies=2, rounds=2)
    first = [t[1:] for t in turns if t[0] == 0]
    assert first == [(e, k, c) for e in (0, 1) for k in kinds for c in (0, 1)]
    assert [t[1:] for t in turns if t[0] == 1] == first[::-1]


def test_help_has_an_example():
    assert_help_has_example("probe_cache_placement", "python3 scripts/probe_cache_placement.py --layouts")


@pytest.mark.parametrize("argv,expect", [(["--pads", "0", "-8"], "--pads: expected cache positions >= 0, got -8"),
                                         (["--copies", "0"], "--copies: expected a positive integer, got 0"),
                                         (["--layouts", "rows"], "argument --layouts: invalid choice: 'rows'"),
                                         (["--new-tokens", "0"], "--new-tokens: expected a positive integer"),
                                         (["--arena", "--share-weights"], "--arena: expected engines with their own"),
                                         (["--spacer-mb", "8"], "--arena-order, --spacer-mb: expected with --arena"),
                                         (["--arena", "--spacer-mb", "-1"], "--spacer-mb: expected MB >= 0, got -1"),
                                         (["--decoys", "-2"], "--decoys: expected a count >= 0, got -2"),
                                         (["--run-decoys"], "--run-decoys: expected with --decoys N > 0")])
def test_refusals_are_one_line(argv, expect):
    assert_refused_in_one_line("probe_cache_placement", argv, expect)


@pytest.mark.parametrize("align", [None, 2 << 20])
def test_arena_keeps_values_and_strides_in_one_allocation(tmp_path, align):
    """arena(): every weight a view of one buffer, 256-byte (or `align`) aligned, in read order,
    with the values and strides it had; the model's logits unchanged."""
    build_checkpoint(tmp_path, seed=5, n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=32)
    m = LLM(str(tmp_path), dtype="float32", backend="torch", cuda_graphs=False).model
    ids = torch.tensor([[3, 9, 27, 81], [5, 1, 2, 2]], device=m.device)
    lens = torch.tensor([4, 1], dtype=torch.int32, device=m.device)
    before = m.prefill(ids, lens, m.new_cache(2, 8))
    old = [m.wte, m.wpe, *m.blocks[1].fc, *m.lm_head]
    buf = probe.arena(m) if align is None else probe.arena(m, align=align)
    new = [m.wte, m.wpe, *m.blocks[1].fc, *m.lm_head]
    for a, b in zip(old, new):
        if a is None:
            assert b is None
            continue
        assert torch.equal(a, b) and a.stride() == b.stride() and b.untyped_storage().data_ptr() == buf.data_ptr()
        assert (b.data_ptr() - buf.data_ptr()) % (align or probe.ARENA_ALIGN) == 0
    starts = [t.data_ptr() for blk in m.blocks for t in (*blk.attn, *blk.attn_proj, *blk.fc, *blk.mlp_proj)]
    assert starts == sorted(starts) and m.wte.data_ptr() == buf.data_ptr()
    assert torch.equal(m.prefill(ids, lens, m.new_cache(2, 8)), before)


@pytest.mark.skipif(ON_GPU, reason="the refusal of a machine without a GPU")
def test_refuses_without_a_gpu():
    done = run("probe_cache_placement")
    assert done.returncode != 0 and done.stderr.strip() == "probe_cache_placement.py: needs a CUDA GPU"


WEIGHT_MODES = {"own": [], "shared": ["--share-weights"], "arena": ["--arena"],
                "arena-reverse": ["--arena", "--arena-order=reverse", "--spacer-mb", "4"],
                "arena-decoys": ["--arena", "--decoys", "2", "--run-decoys"]}


@pytest.mark.skipif(not ON_GPU, reason="times decode steps: GPU only")
@pytest.mark.parametrize("mode", list(WEIGHT_MODES))
def test_short_run_writes_a_row_per_cache(tmp_path, mode):
    build_checkpoint(tmp_path / "ckpt", seed=3, n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=128)
    done = run("probe_cache_placement", "--model", str(tmp_path / "ckpt"), "--batch", "4", "--pads", "0", "8",
               "--layouts", "heads", "positions",
               "--copies", "1", "--engines", "2", "--rounds", "2", "--runs", "1", "--new-tokens", "8",
               "--out", str(tmp_path), *WEIGHT_MODES[mode], timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads((tmp_path / "probe-cache-placement.json").read_text())
    rows = out["rows"]
    assert [(r["engine"], r["layout"], r["pad"], r["copy"]) for r in rows] == [
        (e, layout, p, 0) for e in (0, 1) for layout in ("heads", "positions") for p in (0, 8)]
    assert all(len(r["tok_s"]) == 2 and min(r["tok_s"]) > 0 and 0 <= r["k_in_2mb"] < 2 << 20 for r in rows)
    turns = out["turns"]  # one a (round, cache), each capturing its graphs anew in pools of its own
    assert len(turns) == 16 and all(t["graph_pools"] and len(t["state_tokens"]) == 1 for t in turns)
    pools = [p for t in turns for p in t["graph_pools"]]
    assert len(pools) == len(set(pools))
    assert all(size > 0 and all(0 <= off < size for off, _ in blocks)
               for t in turns for segs in t["graph_pools"].values() for _, size, _, blocks in segs)
    assert (out["decoys"], out["run_decoys"]) == ((2, True) if mode == "arena-decoys" else (0, False))
    heads = {r["engine"]: r["head_addr"] for r in rows}
    assert (heads[0] == heads[1]) == (mode == "shared")  # one lm_head shared, or each its own
    arena = "--arena" in WEIGHT_MODES[mode]
    assert all((r["arena_addr"] is not None) == arena for r in rows)
    if arena:  # the rank each engine's arena was allocated in
        assert {r["engine"]: r["arena_rank"] for r in rows} == ({0: 1, 1: 0} if mode == "arena-reverse" else {0: 0, 1: 1})
