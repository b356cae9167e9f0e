"""scripts/inspect_sass.py: a model's decode kernels compiled for Hopper, their SASS summarized
around the dependent-launch wait (needs this Triton's NVIDIA backend, as check_compile does)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ON_GPU
from tests.test_check_compile import _nvidia_toolchain

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def triton_cache(tmp_path_factory):
    """One Triton cache for the run's compiles, in pytest's temporary root for the run (shared by
    xdist's workers; Triton writes its entries atomically): the kernels a test's switches leave
    alone compile once, not once a test."""
    root = tmp_path_factory.getbasetemp()
    return (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "inspect-sass-triton-cache"


def _run(cache, *args, switches=None):
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    for switch in ("TRITON_INTERPRET", "MINILLM_ATTN_EARLY_F32", "MINILLM_FUSED_LAYOUT", "MINILLM_FMA_EARLY_F32"):
        env.pop(switch, None)  # the defaults' code, unless switches asks otherwise
    env.update(switches or {})
    return subprocess.run([sys.executable, "scripts/inspect_sass.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def _summary_rows(out, kernel):
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in (out / "summary.md").read_text().splitlines() if line.startswith(f"| {kernel} ")]


@pytest.mark.skipif(not _nvidia_toolchain(), reason="this Triton has no NVIDIA backend or no bundled ptxas")
def test_fused_attention_launch_at_one_row(triton_cache, tmp_path):
    """gpt2's one row: the fused attention launch waits, and its fp16 tiles are converted after
    the wait (ptxas sinks them there where nothing holds them before it)."""
    out = tmp_path / "sass"
    p = _run(triton_cache, "--model", "gpt2", "--batch", "1", "--cache-len", "256", "--kernel", "attention_proj",
             "--out", str(out))
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    rows = _summary_rows(out, "_decode_attention_proj_kernel")
    assert len(rows) == 1, rows
    cells = rows[0]
    assert cells[1] == "D=64 L=256 N=256" and cells[2] == "8" and cells[5] == "yes", cells
    before, after, barriers, hadd_before, hadd_after = (int(c) for c in cells[6:11])
    assert before > 0 and after > before and barriers > 0, cells
    assert hadd_before == 0 and hadd_after >= 3 * 64, cells  # keys, values and W, 64 elements a thread each
    assert len(list(out.glob("decode_attention_proj_kernel-*.sass"))) == 1
    assert len(list(out.glob("decode_attention_proj_kernel-*.ptx"))) == 1
    ttgir = list(out.glob("decode_attention_proj_kernel-*.ttgir"))
    assert len(ttgir) == 1 and "#ttg.blocked" in ttgir[0].read_text()  # Triton's layouts


@pytest.mark.skipif(not _nvidia_toolchain(), reason="this Triton has no NVIDIA backend or no bundled ptxas")
# the rule alone in CI (it takes both forms); the switches too where a GPU runs the suite (CI time)
@pytest.mark.parametrize("mask", ["0", "7", None] if ON_GPU else [None])
def test_cuda_core_gemv_conversions_around_the_wait(mask, triton_cache, tmp_path):
    """gpt2's one-row linears (qkv, fc: one warp; mlp-out: four): ptxas converts the weights
    after the wait, unless early_f32 keeps them before it (96 weights a thread in either layout;
    after the wait then only x's conversions: 24 a thread at one warp, 32 at four). The rule
    (mask None) does so at mlp-out only; MINILLM_FMA_EARLY_F32 0 nowhere, 7 everywhere."""
    out = tmp_path / "sass"
    p = _run(triton_cache, "--model", "gpt2", "--batch", "1", "--cache-len", "64", "--kernel", "gemv_fma", "--out",
             str(out), switches={} if mask is None else {"MINILLM_FMA_EARLY_F32": mask})
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    rows = _summary_rows(out, "_gemv_fma_kernel")
    assert sorted(r[2] for r in rows) == ["1", "1", "4"], rows
    for cells in rows:
        hadd_before, hadd_after = int(cells[9]), int(cells[10])
        if mask == "0" or (mask is None and cells[2] == "1"):
            assert hadd_before == 0 and hadd_after >= 96, cells
        else:
            assert hadd_before >= 96 and hadd_after <= 32, cells


@pytest.mark.skipif(not _nvidia_toolchain(), reason="this Triton has no NVIDIA backend or no bundled ptxas")
def test_no_kernel_matches(triton_cache, tmp_path):
    p = _run(triton_cache, "--model", "gpt2", "--batch", "1", "--kernel", "no_such_kernel",
             "--out", str(tmp_path / "s"))
    assert p.returncode == 1
    assert "no compiled kernel's name contains 'no_such_kernel'" in p.stderr


def test_bad_arguments(triton_cache, tmp_path):
    p = _run(triton_cache, "--batch", "0", "--out", str(tmp_path / "s"))
    assert p.returncode == 2
    assert "--batch / --cache-len: expected >= 1 / >= 2, got 0 / 256" in p.stderr
