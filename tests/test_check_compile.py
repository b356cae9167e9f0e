"""scripts/check_compile.py: the layouts the GPU runs compile for Hopper (sm_90a) with this
machine's Triton. In CI that is the newest Triton, whose tests otherwise only interpret the
kernels (the interpreter compiles nothing), while the GPU machines run an older one."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _nvidia_toolchain():
    try:
        import triton
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends and (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file()


@pytest.mark.skipif(not _nvidia_toolchain(), reason="this Triton has no NVIDIA backend or no bundled ptxas")
def test_gpu_layouts_compile_for_hopper(tmp_path):
    """gpt2 in fp16 at the batches whose layouts differ (1: CUDA-core kernels and the fused
    attention projection; 2: the split tensor-core GEMV; 8: other early launches; 64: the looping
    layouts) over a short cache, the benchmark's and a long one, prefill, and every library op:
    compiled, within the shared memory of an H100, and every kernel of the package reached."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"), "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / "compile.md"
    p = subprocess.run([sys.executable, "scripts/check_compile.py", "--models", "gpt2", "--dtypes", "float16",
                        "--batches", "1", "2", "8", "64", "--cache-lens", "128", "256", "1024", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=540, check=False)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    assert "FAIL" not in p.stderr, p.stderr[-3000:]
    assert "FP_FUSION" not in p.stderr, "a launch left floating-point contraction to Triton's default"
    table = out.read_text()
    for kernel in ("_gemv_fma_kernel", "_vocab_fma_kernel", "_decode_attention_proj_kernel", "_gemv_kernel",
                   "_decode_attention_kernel", "_attention_kernel", "_append_tokens_kernel"):
        assert f"| {kernel} |" in table, kernel
    # the GPU's layouts, not the interpreter's 2 SMs: gpt2 batch 1 over 256 positions reads its
    # whole cache in one 8-warp tile (fused_layout at 132 SMs; 128 positions in 4 warps at 2)
    assert "| _decode_attention_proj_kernel | D=64 L=256 N=256 | 8 |" in table
