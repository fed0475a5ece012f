"""A fake torch on a machine whose GPU (an RTX 5090, sm_120) the build has no kernels for."""
import os
import signal
import types
import warnings

from torch import _C  # noqa: F401
from torch.version import __version__  # noqa: F401
import torch.version as version  # noqa: F401

_MODE = os.environ.get("FAKE_TORCH_LAUNCH", "raise")


def _get_arch_list():
    return _C._cuda_getArchFlags().split()


def _ones(n, device="cpu"):
    warnings.warn(
        "NVIDIA GeForce RTX 5090 with CUDA capability sm_120 is not compatible with the current PyTorch installation.\n"
        "The current PyTorch install supports CUDA capabilities sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90."
    )
    if _MODE == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    raise RuntimeError(
        "CUDA error: no kernel image is available for execution on the device\n"
        "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect."
    )


ones = _ones
cuda = types.SimpleNamespace(
    get_arch_list=_get_arch_list,
    is_available=lambda: True,
    device_count=lambda: 1,
    get_device_name=lambda i: "NVIDIA GeForce RTX 5090",
    get_device_capability=lambda i: (12, 0),
    synchronize=lambda i=None: None,
)
backends = types.SimpleNamespace(cudnn=types.SimpleNamespace(version=lambda: 90100))
