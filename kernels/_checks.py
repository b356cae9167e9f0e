"""Input checks shared by the launchers: each failure is one ValueError naming the argument."""
import torch

from ._tuning import INTERPRET

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(name, t, *, ndim=None, min_ndim=None, dtypes=FLOAT_DTYPES, device=None,
                 last_contiguous=False):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name}: expected dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected a contiguous last dim (stride 1), got strides {t.stride()}")
    return t


def check_shape(name, t, shape):
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def check_device_usable(name, t):
    """Triton needs a GPU tensor, or a CPU tensor under TRITON_INTERPRET=1."""
    if t.device.type == "cpu" and not INTERPRET:
        raise ValueError(f"{name}: Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1 on the CPU), "
                         f"got one on {t.device}")
