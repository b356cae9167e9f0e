"""kernels/_checks.py: each input check the launchers share fails as one ValueError that names
the argument and what was expected; through a launcher too."""
import pytest
import torch

import kernels
from kernels import _checks
from kernels._checks import check_device_usable, check_shape, check_tensor
from tests.conftest import ON_GPU
from tests.kernels.helpers import randn


@pytest.mark.parametrize("t,kw,message", [
    ([1.0], {}, "expected a torch.Tensor, got list"),
    (torch.ones(2, 3), dict(ndim=3), r"expected 3 dims, got shape \(2, 3\)"),
    (torch.ones(4), dict(min_ndim=2), r"expected at least 2 dims, got shape \(4,\)"),
    (torch.ones(2, dtype=torch.int32), {}, r"expected dtype in \(float32, float16, bfloat16\), got int32"),
    (torch.ones(2, device="meta"), dict(device=torch.device("cpu")), "expected a tensor on cpu, got one on meta"),
    (torch.ones(3, 4).t(), dict(last_contiguous=True), r"expected a contiguous last dim \(stride 1\), got strides "
                                                        r"\(1, 4\)"),
])
def test_check_tensor_refusals(t, kw, message):
    with pytest.raises(ValueError, match=f"^w: {message}$"):
        check_tensor("w", t, **kw)


def test_check_tensor_passes_what_it_should():
    x = torch.ones(3, 4)
    assert check_tensor("x", x, ndim=2, min_ndim=1, device=x.device, last_contiguous=True) is x
    check_tensor("x", torch.ones(3, 1).t(), last_contiguous=True)  # a last dim of 1 has any stride
    check_tensor("ids", torch.ones(2, dtype=torch.int64), dtypes=None)
    with pytest.raises(ValueError, match=r"^x: expected shape \(3, 5\), got \(3, 4\)$"):
        check_shape("x", x, (3, 5))


def test_a_cpu_tensor_without_the_interpreter(monkeypatch):
    """Without TRITON_INTERPRET=1 a CPU tensor cannot reach a Triton kernel: the launcher says so
    before it launches."""
    monkeypatch.setattr(_checks, "INTERPRET", False)
    with pytest.raises(ValueError, match=r"^x: Triton kernels need a CUDA tensor \(or TRITON_INTERPRET=1 on the "
                                         r"CPU\), got one on cpu$"):
        kernels.gelu(randn(8))
    check_device_usable("x", torch.ones(1, device="meta"))  # only the CPU is refused


@pytest.mark.skipif(ON_GPU, reason="needs the interpreter: without it the CPU input is refused first")
def test_a_weight_on_another_device_through_a_launcher():
    x, w = randn(2, 8), torch.ones(8, 4, device="meta")
    with pytest.raises(ValueError, match="^weight: expected a tensor on cpu, got one on meta$"):
        kernels.linear(x, w)
