"""kernels/_tuning.py: fixed layouts fall back to fewer pipeline stages on GPUs with less shared
memory than the Hopper parts they were tuned on, with the same bits; compile_ahead compiles
launches in threads and runs nothing."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton.runtime.errors import OutOfResources

from kernels import _tuning
from tests.conftest import ON_GPU
from tests.test_check_compile import _nvidia_toolchain

ROOT = Path(__file__).resolve().parents[2]


class FakeKernel:
    """Stands in for a JIT function: records each launch's stages, and is out of shared memory
    above `fits` stages (or of registers, with `resource`)."""
    __name__ = "_fake_kernel"

    def __init__(self, fits, resource="shared memory"):
        self.fits, self.resource, self.tried, self.warmed = fits, resource, [], []

    def __getitem__(self, grid):
        def run(*args, num_stages, **kwargs):
            self.tried.append(num_stages)
            if num_stages > self.fits:
                raise OutOfResources(1000 * num_stages, 1000 * self.fits, self.resource)
            return args, kwargs
        return run

    def warmup(self, *args, grid, **kwargs):
        self.warmed.append((grid, kwargs))


@pytest.fixture(autouse=True)
def _fresh_memo(monkeypatch):
    monkeypatch.setattr(_tuning, "_fitted_stages", {})


def test_launch_keeps_a_layout_that_fits():
    k = FakeKernel(fits=4)
    assert _tuning.launch(k, (1,), "x", BLOCK_K=64, num_stages=4) == (("x",), {"BLOCK_K": 64, "enable_fp_fusion": True})
    assert k.tried == [4] and _tuning._fitted_stages == {}


def test_launch_falls_back_to_fewer_stages_and_remembers():
    k = FakeKernel(fits=2)
    _tuning.launch(k, (1,), BLOCK_K=64, num_stages=4)
    assert k.tried == [4, 3, 2]
    _tuning.launch(k, (1,), BLOCK_K=64, num_stages=4)  # the same layout: straight to what fits
    assert k.tried == [4, 3, 2, 2]
    _tuning.launch(k, (1,), BLOCK_K=32)  # another layout (Triton's default 3 stages) is tried afresh
    assert k.tried == [4, 3, 2, 2, 3, 2]


def test_launch_reports_a_layout_that_never_fits():
    k = FakeKernel(fits=0)
    with pytest.raises(RuntimeError, match=r"_fake_kernel: .* 1000 bytes of shared memory even at one pipeline "
                                           r"stage; this GPU has 0"):
        _tuning.launch(k, (1,), num_stages=2)
    assert k.tried == [2, 1]


def test_launch_leaves_other_resources_alone():
    k = FakeKernel(fits=1, resource="threads")
    with pytest.raises(OutOfResources, match="threads"):
        _tuning.launch(k, (1,), num_stages=3)
    assert k.tried == [3]


def test_launch_inside_compile_ahead_only_compiles(monkeypatch):
    """A dry pass's launch hands the kernel to warmup (compilation) with the stages a launch
    would take, and runs nothing."""
    k = FakeKernel(fits=4)
    with _tuning.dry_launches():
        _tuning.launch(k, (3,), "x", BLOCK_K=64, num_stages=4)
    assert k.tried == [] and k.warmed == [((3,), {"BLOCK_K": 64, "enable_fp_fusion": True, "num_stages": 4})]
    _tuning.launch(k, (3,), "x", BLOCK_K=64, num_stages=4)  # after the block: runs
    assert k.tried == [4] and len(k.warmed) == 1


def test_dry_launches_stay_in_their_thread():
    """A dry pass in one thread leaves another thread's launches running (a server's other
    requests must not silently skip their kernels)."""
    import threading

    k = FakeKernel(fits=4)
    with _tuning.dry_launches():
        other = threading.Thread(target=_tuning.launch, args=(k, (1,)), kwargs={"num_stages": 2})
        other.start()
        other.join()
        assert k.tried == [2] and k.warmed == []
        _tuning.launch(k, (1,), num_stages=2)
    assert k.tried == [2] and len(k.warmed) == 1


def test_compile_ahead_applies_once_and_where_it_can(monkeypatch):
    """compile_ahead yields its pending compilations where Triton can compile (not nested), None
    under the interpreter or switched off (MINILLM_COMPILE_AHEAD=0)."""
    monkeypatch.setattr(_tuning, "INTERPRET", False)
    with _tuning.compile_ahead(workers=2) as pending:
        assert pending == [] and _tuning.compiling_ahead()
        with _tuning.compile_ahead() as nested:
            assert nested is None and _tuning.compiling_ahead()
    assert not _tuning.compiling_ahead()
    monkeypatch.setattr(_tuning, "COMPILE_AHEAD", False)
    with _tuning.compile_ahead() as pending:
        assert pending is None and not _tuning.compiling_ahead()
    monkeypatch.setattr(_tuning, "COMPILE_AHEAD", True)
    monkeypatch.setattr(_tuning, "INTERPRET", True)
    with _tuning.compile_ahead() as pending:
        assert pending is None


def test_an_interrupted_pass_drops_its_queued_compilations(monkeypatch):
    """Ctrl-C (or an error) inside compile_ahead cancels the compilations not yet started, so
    the interrupt does not wait for all of them (here 7 of 8 queued behind one slow one)."""
    import inspect
    import time

    from triton.runtime import _async_compile

    monkeypatch.setattr(_tuning, "INTERPRET", False)
    with pytest.raises(KeyboardInterrupt):
        with _tuning.compile_ahead(workers=1) as pending:
            mode = _async_compile.active_mode.get()
            cleanup = [lambda kernel: None] if "cleanup_fn" in inspect.signature(mode.submit).parameters else []
            for i in range(8):
                mode.submit(("slow", i), lambda: time.sleep(0.2), lambda kernel: None, *cleanup)
            raise KeyboardInterrupt
    assert sum(f.cancelled() for f in pending) >= 6 and not _tuning.compiling_ahead()


_AHEAD_SCRIPT = r"""
import json, sys
sys.path.insert(0, "scripts")
from check_compile import target_only
target_only(90)  # compile for Hopper with no GPU: a launch that ran would fail
import torch
import triton
import triton.language as tl
import kernels
from kernels import _checks, _tuning
from kernels.layernorm import _layernorm_kernel
_checks.INTERPRET = True  # CPU tensors stand in for CUDA ones

@triton.autotune([triton.Config({"BLOCK": 32}, num_warps=1), triton.Config({"BLOCK": 64}, num_warps=2)], key=["n"])
@triton.jit
def _scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

torch.manual_seed(0)
x, w, b = torch.randn(6, 96), torch.randn(96), torch.randn(96)
def calls():
    kernels.layernorm(x, w, b)
    _tuning.launch(_scale_kernel, lambda meta: (triton.cdiv(100, meta["BLOCK"]),), x, 100)
with kernels.compile_ahead(workers=2) as pending:
    calls()
    first = list(pending)
with kernels.compile_ahead(workers=2) as again:
    calls()
    second = len(again)
def cubins(fn):
    return sum("cubin" in k.asm for k in fn.device_caches[0][0].values())
print(json.dumps({"first": len(first), "done": all(f.done() for f in first),
                  "errors": [repr(f.exception()) for f in first if f.exception() is not None],
                  "second": second, "flag": _tuning.compiling_ahead(),
                  "layernorm": cubins(_layernorm_kernel), "autotuned": cubins(_scale_kernel.fn)}))
"""


@pytest.mark.skipif(not _nvidia_toolchain(), reason="this Triton has no NVIDIA backend or no bundled ptxas")
def test_compile_ahead_compiles_every_kernel_and_config(tmp_path):
    """Real compilations for Hopper (no GPU needed): a layernorm and a two-config autotuner
    inside compile_ahead submit one compilation per kernel and config and launch nothing (a
    launch would fail here); leaving the block leaves them compiled in the kernels' caches, so
    the same calls in a second pass submit nothing."""
    script = tmp_path / "ahead.py"  # (Triton reads a kernel's source from its file)
    script.write_text(_AHEAD_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_CACHE_DIR": str(tmp_path / "triton-cache")}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["first"] == 3 and r["done"] and r["errors"] == [], r
    assert (r["layernorm"], r["autotuned"]) == (1, 2), r
    assert r["second"] == 0 and not r["flag"], r


# The GPU check runs each side in a fresh process: Triton checks a kernel's shared memory once,
# when it first loads it, so the smaller limit must be in place before any launch.
_SCRIPT = r"""
import json, sys
import torch
import triton.compiler.compiler as compiler
limit = int(sys.argv[1])
if limit:
    compiler.max_shared_mem = lambda device: limit  # a smaller GPU, as Triton sees it
import kernels
from kernels import _tuning
torch.manual_seed(0)
dev, outs = "cuda", []
for dtype in (torch.float16, torch.float32):
    def r(*s):
        return torch.randn(*s, device=dev, dtype=dtype)
    for M, K, N, ln in ((64, 3072, 768, False), (24, 3072, 768, False), (64, 768, 2304, True),
                        (40, 1024, 4096, False), (64, 1600, 4800, True), (64, 1024, 16384, True),
                        (48, 1024, 16384, True), (200, 1024, 512, True)):
        x, w, b = r(M, K), r(K, N) / K ** 0.5, r(N)
        if ln:  # a folded layernorm (the decode layouts follow it)
            w, b, colsum = kernels.fold_layernorm(w, b, r(K), r(K))
        outs.append(kernels.linear(x, w, b, ln_fold=colsum if ln else None))
    q, k, v = (r(2, 3, 100, 64) for _ in range(3))
    outs.append(kernels.attention(q, k, v, causal=True))
torch.save(outs, sys.argv[2])
print(json.dumps({"fallbacks": len(_tuning._fitted_stages)}))
"""


def _run(limit, path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MINILLM_AUTOTUNE": "0"}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(limit), str(path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU: the interpreter has no shared-memory limit")
def test_small_shared_memory_gives_the_same_bits(tmp_path):
    """With a 99 KB limit (consumer cards: RTX 4090, L4) the decode GEMV's 4-stage and 64-row
    layouts (the slabs of gpt2's qkv and mlp-out's chunk groups among them) and the first prefill
    configs fall back to fewer stages and give the same bits."""
    hopper = _run(0, tmp_path / "hopper.pt")
    small = _run(99 * 1024, tmp_path / "small.pt")
    assert hopper["fallbacks"] == 0
    assert small["fallbacks"] > 0, "no layout exceeded 99 KB: the test checks nothing"
    a, b = torch.load(tmp_path / "hopper.pt"), torch.load(tmp_path / "small.pt")
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.isfinite(x).all(), f"output {i}: non-finite"
        assert torch.equal(x, y), f"output {i}: bits differ with fewer stages"


def test_env_int(monkeypatch):
    """The A/B switches' integers: unset or empty gives the default, a number itself (0 too),
    anything else, or a number below the given minimum, one error naming the variable."""
    monkeypatch.delenv("MINILLM_TEST_SWITCH", raising=False)
    assert _tuning.env_int("MINILLM_TEST_SWITCH") is None and _tuning.env_int("MINILLM_TEST_SWITCH", 1) == 1
    monkeypatch.setenv("MINILLM_TEST_SWITCH", "")
    assert _tuning.env_int("MINILLM_TEST_SWITCH", 1) == 1
    monkeypatch.setenv("MINILLM_TEST_SWITCH", "0")
    assert _tuning.env_int("MINILLM_TEST_SWITCH", 1) == 0
    monkeypatch.setenv("MINILLM_TEST_SWITCH", "three")
    with pytest.raises(ValueError, match="MINILLM_TEST_SWITCH: expected an integer, got 'three'"):
        _tuning.env_int("MINILLM_TEST_SWITCH", 1)
    with pytest.raises(ValueError, match="MINILLM_TEST_SWITCH: expected an integer >= 1, got 'three'"):
        _tuning.env_int("MINILLM_TEST_SWITCH", 1, minimum=1)
    monkeypatch.setenv("MINILLM_TEST_SWITCH", "0")
    with pytest.raises(ValueError, match="MINILLM_TEST_SWITCH: expected an integer >= 1, got 0"):
        _tuning.env_int("MINILLM_TEST_SWITCH", 4, minimum=1)
    assert _tuning.env_int("MINILLM_TEST_SWITCH", 4, minimum=0) == 0


def test_env_choice(monkeypatch):
    """The string switches: unset or empty gives the default, a listed choice itself, anything
    else one error naming the variable and the choices."""
    monkeypatch.delenv("MINILLM_TEST_SWITCH", raising=False)
    assert _tuning.env_choice("MINILLM_TEST_SWITCH", "auto", ("auto", "0", "1")) == "auto"
    monkeypatch.setenv("MINILLM_TEST_SWITCH", "")
    assert _tuning.env_choice("MINILLM_TEST_SWITCH", "auto", ("auto", "0", "1")) == "auto"
    monkeypatch.setenv("MINILLM_TEST_SWITCH", "0")
    assert _tuning.env_choice("MINILLM_TEST_SWITCH", "auto", ("auto", "0", "1")) == "0"
    monkeypatch.setenv("MINILLM_TEST_SWITCH", "on")
    with pytest.raises(ValueError, match=r"MINILLM_TEST_SWITCH: expected one of auto, 0, 1 \(or unset\), got 'on'"):
        _tuning.env_choice("MINILLM_TEST_SWITCH", "auto", ("auto", "0", "1"))


def test_mask_switch():
    """The 3-bit mask switches (MINILLM_ATTN_EARLY_F32, MINILLM_FMA_EARLY_F32): unset or empty
    is None, 0 to 7 themselves, anything else one error naming the variable and the bits."""
    assert _tuning.mask_switch("MINILLM_X", None, "1 a") is None and _tuning.mask_switch("MINILLM_X", "", "1 a") is None
    assert [_tuning.mask_switch("MINILLM_X", str(v), "1 a") for v in (0, 4, 7)] == [0, 4, 7]
    for bad in ("8", "-1", "qkv", "3.0"):
        with pytest.raises(ValueError, match=r"MINILLM_X: expected 0 to 7 \(1 a \+ 2 b\), got"):
            _tuning.mask_switch("MINILLM_X", bad, "1 a + 2 b")


def test_layout_switch():
    """The layout switches (MINILLM_FUSED_LAYOUT, MINILLM_VOCAB_LAYOUT): unset or empty is None,
    positive integers joined by x, the first `pow2` powers of two; anything else one error that
    names the variable, the fields and an example."""
    switch = _tuning.layout_switch
    assert switch("MINILLM_X", None, "AxBxC", "2x2x3") is None and switch("MINILLM_X", "", "AxBxC", "2x2x3") is None
    assert switch("MINILLM_X", "2x1x24", "AxBxC", "2x2x3", pow2=2) == (2, 1, 24)
    assert switch("MINILLM_X", "512x256x8", "AxBxC", "2x2x3") == (512, 256, 8)
    for bad, pow2 in (("2x1x24", 3), ("3x1x16", 2), ("2x1", 2), ("2x1x0", 2), ("2x-1x4", 2), ("ax1x4", 2),
                      ("2x1x4x1", 2), ("2,1,4", 2)):
        with pytest.raises(ValueError, match=r"^MINILLM_X: expected AxBxC, 3 positive integers \(.*powers of two\) "
                                             r"such as 2x2x3, got"):
            switch("MINILLM_X", bad, "AxBxC", "2x2x3", pow2=pow2)
    assert switch("MINILLM_X", "2048x56", "AxB", "2048x64", pow2=1) == (2048, 56)  # MINILLM_FMA_MAXNREG's form
    one_pow2 = r"2 positive integers \(the first one a power of two\) such as 2048x64, got '2000x64'"
    with pytest.raises(ValueError, match=one_pow2):
        switch("MINILLM_X", "2000x64", "AxB", "2048x64", pow2=1)


def test_programs_by_registers():
    """Registers allocated per warp in units of 8 a thread: 80 and 75 a thread hold the same."""
    fit = _tuning.programs_by_registers
    assert fit(80, 1) == fit(75, 1) == 25 and fit(81, 1) == 23 and fit(128, 4) == 4
    assert fit(64, 2, regs_per_sm=32768) == 8
