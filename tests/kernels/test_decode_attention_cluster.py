"""kernels/decode_attention_cluster.py: decode_attention_proj with its heads merged in a cluster.

Gluon has no interpreter: on the CPU (CI) the kernel is compiled ahead of time for sm_90 and its
PTX checked for the cluster exchange; on a Hopper GPU under a Triton with Gluon's cluster
layouts (3.9+) decode_attention_proj runs it, checked against the float64 reference here and
in test_decode_attention_proj.py."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import decode_attention_cluster as dc
from kernels import reference as ref
from tests.conftest import ON_GPU
from tests.kernels.helpers import DTYPES, assert_rel_close, poisoned
from tests.kernels.test_decode_attention_proj import _case, _expect

ROOT = Path(__file__).resolve().parents[2]
needs_gluon_clusters = pytest.mark.skipif(not dc.AVAILABLE, reason="this Triton's Gluon has no cluster layouts "
                                          "(cga_layout, Triton 3.9+): the plain kernel runs")
on_cluster_gpu = pytest.mark.skipif(
    not (ON_GPU and dc.ENABLED and torch.cuda.get_device_capability()[0] >= 9),
    reason="needs a Hopper GPU and a Triton with Gluon's cluster layouts (3.9+), MINILLM_CLUSTER_MERGE not 0")

_COMPILE = """
import json, sys
from kernels.decode_attention_cluster import compile_ahead
k = compile_ahead(prefetch=int(sys.argv[1]), stats_out=sys.argv[2] == "1", smem=sys.argv[3] == "1")
json.dump({"ptx": k.asm["ptx"], "shared": k.metadata.shared}, sys.stdout)
"""


@needs_gluon_clusters
@pytest.mark.parametrize("smem", [True, False])
@pytest.mark.parametrize("prefetch,stats", [(1, False), (2, True)])
def test_compiles_for_hopper_with_a_cluster_merge(prefetch, stats, smem, tmp_path):
    """gpt2's shape (256 positions of 64 dims, out-major W) as the model launches it at one row
    (prefetch 1) and at two (prefetch 2, statistics out): 16-CTA clusters whose CTAs read each
    other's partials through distributed shared memory, between cluster barriers, with
    programmatic dependent launch, and no global partials or atomics."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter wraps Gluon's ops
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]), TRITON_CACHE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", _COMPILE, str(prefetch), str(int(stats)), str(int(smem))], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    k = json.loads(p.stdout)
    ptx = k["ptx"]
    assert re.search(r"\.reqnctapercluster\s+16", ptx), "not launched as 16-CTA clusters"
    for op in ("mapa.shared::cluster", "ld.shared::cluster", "barrier.cluster.arrive", "barrier.cluster.wait",
               "griddepcontrol.wait"):
        assert op in ptx, op
    assert not re.search(r"^\s*(@!?%p\d+\s+)?(atom|red)\.", ptx, re.M), "the heads must not meet through atomics"
    if smem:  # the cache tile and W by cp.async: 64 + 32 KB, and the partials
        assert "cp.async.cg.shared.global" in ptx
        assert k["shared"] <= 100 * 1024, f"{k['shared']} bytes of shared memory"
    else:
        assert k["shared"] <= 4096, f"{k['shared']} bytes of shared memory: the merge is 16 x 256 fp32"


@on_cluster_gpu
@pytest.mark.parametrize("B,H,L,D,N", [(1, 12, 256, 64, 768), (2, 12, 160, 64, 768), (1, 16, 256, 64, 1024),
                                       (2, 5, 77, 48, 300), (1, 3, 1, 16, 40), (2, 1, 33, 64, 520)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cluster_merge_against_float64(B, H, L, D, N, dtype, device):
    """gpt2's and gpt2-medium's widths, and awkward ones: idle CTAs (5 of 16 heads, one head),
    48-wide heads, a partial column block and one of 8 columns past 512, a one-position cache."""
    assert dc.covers(torch.device(device), H, D, L)
    case = _case(B, H, L, D, N, dtype, device)
    q, kc, vc, lens, k_new, v_new, w, b, x = case
    expect, ek, ev = _expect(*case)
    out = poisoned((B, N), dtype, device)
    y = kernels.decode_attention_proj(q, kc, vc, lens, k_new, v_new, w, b, x, out=out)
    assert_rel_close(y, expect, dtype, f"cluster {B, H, L, D, N}")
    past = (torch.arange(L, device=device)[None, :] >= lens[:, None])[:, None, :, None]
    assert torch.equal(kc.masked_fill(past, 0), ek.masked_fill(past, 0)), "new keys not appended"
    assert torch.equal(vc.masked_fill(past, 0), ev.masked_fill(past, 0)), "new values not appended"


@on_cluster_gpu
@pytest.mark.parametrize("prefetch", [False, "cache", True])
@pytest.mark.parametrize("early_launch", [False, True])
def test_cluster_in_place_with_stats(prefetch, early_launch, device):
    """As the model calls it (x in place, the next layernorm's statistics), twice over, in every
    prefetch mode: each CTA's 16 columns are one statistics group."""
    B, H, L, D, N = 2, 12, 100, 64, 768
    q, kc, vc, lens, k_new, v_new, w, b, x = _case(B, H, L, D, N, torch.float32, device)
    for _ in range(2):
        expect, _, _ = _expect(q, kc, vc, lens, k_new, v_new, w, b, x)
        stats = torch.full((B, 2, N // 16), float("nan"), device=device)
        kernels.decode_attention_proj(q, kc, vc, lens, k_new, v_new, w, b, x, out=x, stats_out=stats,
                                      prefetch=prefetch, early_launch=early_launch)
        assert_rel_close(x, expect, torch.float32, "in place")
        assert_rel_close(stats, ref.row_stats(x), torch.float32, "row statistics")


@on_cluster_gpu
def test_cluster_weights_in_either_order_agree(device):
    """W stored (K, N) row-major takes the other weight layout; both give the reference."""
    case = list(_case(1, 12, 64, 64, 768, torch.float16, device))
    expect, _, _ = _expect(*case)
    case[6] = case[6].contiguous()  # (H * D, N) with N contiguous
    y = kernels.decode_attention_proj(*case)
    assert_rel_close(y, expect, torch.float16, "row-major W")


def test_covers_only_what_it_can_hold():
    """Heads past 16, heads wider than 64, caches past 256 and CPU tensors keep the plain kernel."""
    cuda = torch.device("cuda")
    assert not dc.covers(torch.device("cpu"), 12, 64, 256)
    if not (dc.ENABLED and ON_GPU and torch.cuda.get_device_capability()[0] >= 9):
        assert not dc.covers(cuda, 12, 64, 256)
        return
    assert dc.covers(cuda, 12, 64, 256) and dc.covers(cuda, 16, 64, 1)
    assert not dc.covers(cuda, 17, 64, 256)
    assert not dc.covers(cuda, 12, 128, 256)
    assert not dc.covers(cuda, 12, 64, 257)
