"""cudadoctor-ops: CUDA operators registered as ``torch.ops.cudadoctor_ops.*``.

Importing this package loads the compiled extension ``cudadoctor_ops._C`` (which registers the op
schemas and CUDA kernels), ``cudadoctor_ops._C_sm90a`` where the wheel has it, and then each op module, which registers fake kernels
(``torch.library.register_fake``) and autograd formulas (``torch.library.register_autograd``, or C++
autograd Functions in csrc/*_host.cpp) and
provides the Python entry points.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

try:
    from . import _C  # noqa: F401  (registers torch.ops.cudadoctor_ops.*)
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "cudadoctor_ops: the compiled extension cudadoctor_ops._C could not be loaded "
        f"({exc}). Build it against the installed torch with "
        "`pip install --no-build-isolation --no-deps ./opsrc` (or `python setup.py build_ext "
        "--inplace` inside opsrc/), using the same torch version that imports it."
    ) from exc

# Hopper-only kernels (csrc_sm90a/: Conv+BN+ReLU's wgmma convolution), a module of their own that
# wheels built for 9.0 carry; without it those ops have no CUDA kernel and their callers keep the
# general path. A module that is there but fails to load is reported, not hidden.
if importlib.util.find_spec(f"{__name__}._C_sm90a") is not None:
    try:
        from . import _C_sm90a  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the build
        import warnings

        warnings.warn(f"cudadoctor_ops: cudadoctor_ops._C_sm90a is present but could not be loaded ({exc}); "
                      "Conv+BN+ReLU keeps its ATen convolution", RuntimeWarning, stacklevel=2)

__version__ = "0.1.0"

# Op modules, in order. Each registers its fakes/autograd on import and lists its public names
# in __all__. A module that is not present in this checkout is skipped.
_OP_MODULES = ("batch_norm", "depthwise", "conv_bn_relu")

__all__: list[str] = []
for _name in _OP_MODULES:
    if importlib.util.find_spec(f"{__name__}.{_name}") is None:
        continue
    _mod = importlib.import_module(f"{__name__}.{_name}")
    for _public in getattr(_mod, "__all__", ()):
        globals()[_public] = getattr(_mod, _public)
        __all__.append(_public)

ops = torch.ops.cudadoctor_ops
