"""scripts/bench_persistent.py and its host side, scripts/persistent_plan.py: the plan covers
every weight and every head once, in phase order; the persistent step matches torch (on the CPU
with one program: the interpreter runs programs one after the other, so one that waits for
another's values would never return)."""
import importlib.util
from pathlib import Path

import pytest
import torch

from minillm.config import GPTConfig

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_persistent", ROOT / "scripts" / "bench_persistent.py")
bench_persistent = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_persistent)
import persistent_plan  # noqa: E402  (on the path once bench_persistent is loaded)

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=64, n_positions=32, vocab_size=100)


@pytest.mark.parametrize("programs", [1, 3, 7])
def test_plan_covers_weights_once(programs):
    bp = persistent_plan
    desc, counts, w_offs, n_phases = bp.plan(TINY, programs, 8, 32, positions=5)
    assert n_phases == 5 * TINY.n_layer + 1 and len(w_offs) == 4 * TINY.n_layer + 1
    covered = torch.zeros(sum(ph[2] * ph[3] for ph in bp.phases(TINY) if ph[0] == "gemv"), dtype=torch.int32)
    heads = 0
    for p in range(programs):
        mine = desc[p, :counts[p]]
        assert (desc[p, counts[p]:] == 0).all()  # the idle descriptors the kernel looks ahead to
        phase = (mine[:, 7] >> 4) & 0xFFF
        assert (phase[1:] >= phase[:-1]).all()
        heads += int((mine[:, 0] == bp.ATTEND).sum())
        for d in mine[mine[:, 0] == bp.GEMV].tolist():
            w_off, ldw, n_valid, k_valid = d[1], d[2], d[6] >> 16, d[6] & 0xFFFF
            for r in range(n_valid):
                covered[w_off + r * ldw:w_off + r * ldw + k_valid] += 1
    assert (covered == 1).all()
    assert heads == TINY.n_layer * TINY.n_head


def test_plan_refuses_what_the_kernel_cannot_run():
    with pytest.raises(ValueError, match="programs: expected at most n_embd"):
        persistent_plan.plan(TINY, TINY.n_embd + 1, 8, 32, positions=5)
    odd = GPTConfig(n_layer=1, n_head=2, n_embd=60, n_positions=32, vocab_size=100)
    with pytest.raises(ValueError, match="multiple of 8"):
        persistent_plan.plan(odd, 3, 8, 32, positions=5)


@pytest.mark.parametrize("prefetch,tn,tk", [(True, 8, 32), (False, 4, 64)])  # each mode, each tile shape
def test_step_matches_torch(prefetch, tn, tk, device):
    """K chunks (64 and 256 over TK 32 or 64), a column range that ends mid-tile (V = 100), the
    residuals and the attention, all through one program's descriptor list. The activations
    start as NaN under tag 0: one read as it is would show, and a poll for one never written
    would not return (the CI timeout ends it)."""
    step = bench_persistent.Step(TINY, 1, tn, tk, 1, positions=5, device=device, prefetch=prefetch, seed=1)
    assert step.check() < 1e-5
    step()  # a second launch: the epoch moves the tags on
    assert step.epoch.item() == 2
    assert (step.values((TINY.n_layer, "logits"))[1] == 2 * step.n_phases).all()
    assert step.check() < 1e-5


def test_stream_only_runs(device):
    """The loads-alone variant (timing only) runs its whole list and moves the epoch on."""
    step = bench_persistent.Step(TINY, 1, 8, 32, 1, positions=5, device=device, sync=False, stream_only=True)
    step()
    assert step.epoch.item() == 1
