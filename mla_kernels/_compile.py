"""One compile cache for every kernel.

Key: ``(kernel class, static config, dtypes, arch)`` -> compiled function.  A kernel is compiled
once per key with fake tensors whose varying extents (``s_q``, ``s_kv``, ``topk``) are symbolic
(``cute.sym_int``), and with ``--enable-tvm-ffi`` so that a call passes torch tensors directly
and a new size never recompiles.  The target arch comes from the device, or is given explicitly
(compile-only on a machine without a GPU, e.g. ``tools/compile_report.py``).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = ["arch_for_capability", "arch_for_device", "compile_kernel", "cached_compile", "cache_info", "clear_cache"]

_cache: Dict[Tuple, Any] = {}
_lock = threading.Lock()


def arch_for_capability(major: int, minor: int) -> str:
    """``(9, 0) -> "sm_90a"``, ``(10, 0) -> "sm_100a"``, ``(10, 3) -> "sm_103a"``."""
    if (major, minor) == (9, 0):
        return "sm_90a"
    if major == 10:
        return f"sm_10{minor}a"
    raise ValueError(f"no CuTe DSL kernels for compute capability {major}.{minor}")


def arch_for_device(device) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return arch_for_capability(major, minor)


def compile_kernel(
    fn: Callable,
    *args: Any,
    arch: str,
    tvm_ffi: bool = True,
    keep: bool = False,
    dump_dir: Optional[str] = None,
    extra_options: str = "",
):
    """``cute.compile(fn, *args)`` for ``arch`` (``sm_90a``, ``sm_100a``, ``sm_103a``).

    ``keep`` keeps PTX and CUBIN in ``compiled.artifacts`` (and writes them to ``dump_dir``).
    """
    import cutlass.cute as cute

    opts = [f"--gpu-arch {arch}"]
    if tvm_ffi:
        opts.append("--enable-tvm-ffi")
    if keep:
        opts.append("--keep-ptx --keep-cubin")
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)
            opts.append(f"--dump-dir {dump_dir}")
    if extra_options:
        opts.append(extra_options)
    return cute.compile(fn, *args, options=" ".join(opts))


def cached_compile(key: Tuple, build: Callable[[], Any]):
    """Return the compiled function cached under ``key``, building it with ``build()`` once."""
    fn = _cache.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _cache.get(key)
        if fn is None:
            fn = build()
            _cache[key] = fn
    return fn


def cache_info() -> Dict[str, int]:
    return {"entries": len(_cache)}


def clear_cache() -> None:
    with _lock:
        _cache.clear()
