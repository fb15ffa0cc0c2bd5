"""Host-side helpers shared by the kernel backends: fake tensors for compile-only tracing and
small cached device buffers."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

_dummies: Dict[tuple, torch.Tensor] = {}


def fake(dtype, shape, align: int = 16):
    """A compact row-major fake tensor (dynamic extents may be ``cute.sym_int()``)."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    order = tuple(range(len(shape) - 1, -1, -1))
    return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=align)


def fake_stream():
    """The caller's current CUDA stream, taken through TVM-FFI at call time."""
    from cutlass.cute.runtime import make_fake_stream

    return make_fake_stream(use_tvm_ffi_env_stream=True)


def dummy(dtype: torch.dtype, device: torch.device, shape: Tuple[int, ...] = (4,)) -> torch.Tensor:
    """A small cached placeholder (zeros) for an optional input a kernel variant never reads;
    ``shape`` matches the rank (and static extents) the kernel was compiled for."""
    key = (dtype, str(device), tuple(shape))
    t = _dummies.get(key)
    if t is None:
        t = torch.zeros(shape, dtype=dtype, device=device)
        _dummies[key] = t
    return t


#: When True, kernel outputs are filled with NaN (floats) / a sentinel before each launch so that
#: any element a kernel fails to write shows up in tests.  Set by the test-suite.
POISON_OUTPUTS = False


def alloc(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs, poisoned when :data:`POISON_OUTPUTS` is set."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if POISON_OUTPUTS:
        t.fill_(float("nan") if t.is_floating_point() else -12345)
    return t
