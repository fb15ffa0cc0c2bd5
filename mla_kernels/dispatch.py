"""Which backend serves a call: ``"sm90"``, ``"sm100"`` or ``"reference"``.

Rules:

* ``MLA_KERNELS_BACKEND`` (read at every call): ``auto`` (default), ``reference``, ``sm90`` or
  ``sm100``.  ``reference`` serves everything.  A forced kernel backend that cannot serve the
  call -- CPU tensors, another GPU, an unsupported configuration, a failed first-use check --
  raises :class:`BackendUnavailableError` naming the reason (forcing means "no silent fallback").
* ``auto``: CPU tensors use the reference (no warning); CUDA tensors use the kernel backend of
  the device's compute capability (9.0 -> sm90, 10.x -> sm100) when it supports the call's
  configuration, otherwise the reference with one warning (per distinct reason) saying why.
* A backend not yet verified on real hardware (``hardware_verified = False``) passes a first-use
  check per static configuration before it serves it: a small problem against the reference, run
  in a child process with a time limit (:mod:`mla_kernels.common.first_use`: a hang, a crash or
  a wrong answer marks the configuration bad, on disk, with the reason).  A bad configuration is
  served by the reference with one warning.  ``MLA_KERNELS_CANARY=0`` turns the check off.
"""

from __future__ import annotations

import threading
import warnings
from typing import Dict, Optional

import torch

from . import _compile
from . import reference as ref
from .common import fastpath, first_use
from .common.backend import OPS, Backend
from .common.problem import Problem

__all__ = [
    "BackendUnavailableError",
    "ReferenceBackend",
    "backend_for",
    "get_backend",
    "select",
    "serving_kernel",
    "register_backend",
    "reset_state",
]

ENV_BACKEND = "MLA_KERNELS_BACKEND"
ENV_CANARY = first_use.ENV_CHECK
_CHOICES = ("auto", "reference", "sm90", "sm100")


class BackendUnavailableError(RuntimeError):
    """A backend forced through ``MLA_KERNELS_BACKEND`` cannot serve the call."""


class ReferenceBackend(Backend):
    """The plain-PyTorch oracle (``mla_kernels.reference``): any device, any configuration."""

    name = "reference"
    topk_block = 1

    def unavailable_reason(self, device):
        return None

    def supports(self, op, p):
        return None if op in OPS else f"unknown op {op!r}"

    def fwd(self, p):
        return ref.sparse_mla_fwd_ref(
            p.q, p.kv, p.indices, p.sm_scale, p.d_v, p.topk_length, p.attn_sink
        )

    def attn_dist(self, p, lse, normalize):
        return ref.attn_dist_ref(p.q, p.kv, p.indices, lse, p.sm_scale, p.topk_length, normalize)

    def bwd(self, p, out, dout, lse, *, dlse=None, deterministic=False, return_attn_sum=False):
        # deterministic: the dkv scatter runs in collision-free rounds (bitwise reproducible on
        # CUDA as well; index_add_ on CPU already is).
        return ref.sparse_mla_bwd_ref(
            p.q, p.kv, out, dout, p.indices, lse, p.sm_scale, p.d_v, p.topk_length,
            p.attn_sink, dlse=dlse, return_attn_sum=return_attn_sum, deterministic=deterministic,
        )

    def decode(self, plan, q, kv_cache, indices, sm_scale, topk_length, attn_sink, block_table, q_bias):
        # A plan with several splits is emulated split by split (the kernels' slot ranges), then
        # merged: the CPU tests exercise the split / merge arithmetic this way.
        if plan.num_splits > 1:
            outs, lses, mls = ref.decode_split_partials_ref(
                q, kv_cache, indices, sm_scale, plan.d_v, plan.num_splits, plan.blocks_per_split,
                topk_length, block_table, q_bias,
            )
            out, lse = ref.merge_attn_partials_ref(outs, lses, attn_sink, plan.dtype)
            ml = mls.amax(dim=0)
        else:
            out, lse, ml = ref.sparse_mla_decode_ref(q, kv_cache, indices, sm_scale, plan.d_v, topk_length,
                                                     attn_sink, block_table, q_bias, with_max_logits=True)
        plan.out.copy_(out)
        plan.lse.copy_(lse)
        if plan.with_max_logits:
            plan.max_logits.copy_(ml)
            return plan.out, plan.lse, plan.max_logits
        return plan.out, plan.lse

    def merge(self, outs, lses, attn_sink, out_dtype):
        return ref.merge_attn_partials_ref(outs, lses, attn_sink, out_dtype)
    # -- the indexer ----------------------------------------------------------------------------
    def indexer_logits(self, p):
        return ref.indexer_logits_ref(p.q, p.k, p.weights, p.sm_scale, p.k_start, p.k_end, p.q_scale, p.k_scale)

    def indexer_topk(self, p, topk, return_logits):
        res = ref.indexer_topk_ref(p.q, p.k, p.weights, topk, p.sm_scale, p.k_start, p.k_end, p.q_scale,
                                   p.k_scale, return_logits)
        if return_logits and res[2].dtype != torch.float64:
            res = (res[0], res[1], res[2].float())
        return res

    def indexer_loss_fwd(self, p):
        return ref.indexer_loss_fwd_ref(p.q, p.k, p.weights, p.indices, p.target, p.sm_scale, p.topk_length,
                                        p.q_scale, p.k_scale)

    def indexer_loss_bwd(self, p, grad_rows, lse, inv_tsum, deterministic):
        return ref.indexer_loss_bwd_ref(p.q, p.k, p.weights, p.indices, p.target, grad_rows, lse, inv_tsum,
                                        p.sm_scale, p.topk_length, deterministic)


class _LazyBackend:
    """Imports a kernel backend module on first use (importing the DSL takes seconds)."""

    def __init__(self, name: str, module: str):
        self.name = name
        self.module = module
        self._obj: Optional[Backend] = None
        self._error: Optional[str] = None

    def get(self) -> Optional[Backend]:
        if self._obj is None and self._error is None:
            try:
                mod = __import__(self.module, fromlist=["BACKEND"])
                self._obj = mod.BACKEND
            except Exception as e:  # pragma: no cover - depends on the installation
                self._error = f"cannot import {self.module}: {type(e).__name__}: {e}"
        return self._obj

    @property
    def error(self) -> Optional[str]:
        return self._error


_REFERENCE = ReferenceBackend()
_KERNELS: Dict[str, _LazyBackend] = {
    "sm90": _LazyBackend("sm90", "mla_kernels.sm90"),
    "sm100": _LazyBackend("sm100", "mla_kernels.sm100"),
}
_lock = threading.Lock()
_warned: set = set()


def register_backend(name: str, backend: Backend) -> None:
    """Install ``backend`` under ``name`` (``sm90``/``sm100``); used by tests to inject fakes."""
    lb = _LazyBackend(name, "<injected>")
    lb._obj = backend
    _KERNELS[name] = lb
    fastpath.clear()


def reset_state() -> None:
    """Forget warnings, in-memory first-use verdicts and the host fast path's entries (tests; verdict
    files stay on disk)."""
    with _lock:
        _warned.clear()
    first_use.forget()
    fastpath.clear()
    _KERNELS["sm90"] = _LazyBackend("sm90", "mla_kernels.sm90")
    _KERNELS["sm100"] = _LazyBackend("sm100", "mla_kernels.sm100")


def _warn_once(msg: str) -> None:
    with _lock:
        if msg in _warned:
            return
        _warned.add(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=4)


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _arch_of(device: torch.device) -> Optional[str]:
    if not _is_cuda(device):
        return None
    major, minor = _compile.device_capability(device)
    if (major, minor) == (9, 0):
        return "sm90"
    if major == 10:
        return "sm100"
    return None


def _requested() -> str:
    choice = fastpath.knob(ENV_BACKEND, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{ENV_BACKEND}={choice!r}: expected one of {', '.join(_CHOICES)}")
    return choice


def get_backend(name: str) -> Backend:
    """The backend object registered as ``name`` (imports it if needed)."""
    if name == "reference":
        return _REFERENCE
    lb = _KERNELS.get(name)
    if lb is None:
        raise ValueError(f"unknown backend {name!r}")
    obj = lb.get()
    if obj is None:
        raise BackendUnavailableError(f"backend {name} is not available: {lb.error}")
    return obj


def backend_for(device) -> str:
    """The backend ``auto`` dispatch uses on ``device`` for a configuration it supports:
    ``"sm90"`` (compute capability 9.0), ``"sm100"`` (10.x) or ``"reference"``.

    Honours ``MLA_KERNELS_BACKEND``: ``reference`` gives ``"reference"``; a forced kernel backend
    gives its name on a device it runs on and raises :class:`BackendUnavailableError` on any other
    device (as a call there would).  Whether a given call's configuration (head count, head dim,
    dtype ...) is served by that kernel is decided per call; under ``auto`` an unsupported call
    falls back to the reference with a warning.
    """
    device = torch.device(device)
    choice = _requested()
    arch = _arch_of(device)
    if choice != "auto":
        if choice != "reference" and choice != arch:
            raise BackendUnavailableError(f"{ENV_BACKEND}={choice} cannot serve {_device_words(device, arch)}")
        return choice
    if arch is None:
        return "reference"
    lb = _KERNELS[arch]
    obj = lb.get()
    if obj is None or obj.unavailable_reason(device) is not None:
        return "reference"
    return arch


def _device_words(device: torch.device, arch: Optional[str]) -> str:
    if not _is_cuda(device):
        return f"tensors on {device} (kernel backends run on CUDA tensors; use the reference or auto)"
    return f"this device ({arch or 'not an sm90/sm100 GPU'})"


def _first_use_ok(backend: Backend, op: str, p: Problem) -> Optional[str]:
    """None if ``backend`` may serve ``p``'s configuration, else why not (warned once)."""
    ok, why, path = first_use.check(backend, op, p, _REFERENCE)
    if ok:
        return None
    where = f"; verdict in {path} (delete it to check again)" if path else ""
    _warn_once(
        f"mla_kernels: the {backend.name} {op} kernel for this configuration failed its first-use check "
        f"({why}); the PyTorch reference serves it{where}"
    )
    return f"failed its first-use check ({why})"


def select(op: str, p: Problem) -> Backend:
    """The backend that serves ``op`` for ``p`` (see the module docstring for the rules)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    choice = _requested()
    if choice == "reference":
        return _REFERENCE
    if not _is_cuda(p.device):
        if choice != "auto":
            raise BackendUnavailableError(f"{ENV_BACKEND}={choice} cannot serve {_device_words(p.device, None)}")
        return _REFERENCE
    arch = _arch_of(p.device)
    name = choice if choice != "auto" else arch
    if name is None:
        cap = torch.cuda.get_device_capability(p.device)
        _warn_once(
            f"mla_kernels: no kernel backend for compute capability {cap[0]}.{cap[1]} "
            f"({torch.cuda.get_device_name(p.device)}); using the PyTorch reference"
        )
        return _REFERENCE
    reason = None
    backend = None
    if choice != "auto" and name != arch:
        reason = f"the device is {arch or 'not a supported GPU'}, not {name}"
    else:
        lb = _KERNELS[name]
        backend = lb.get()
        if backend is None:
            reason = lb.error
        else:
            reason = backend.unavailable_reason(p.device) or backend.supports(op, p)
    if reason is None and not backend.hardware_verified and first_use.enabled():
        failed = _first_use_ok(backend, op, p)  # warned there
        if failed:
            if choice != "auto":
                raise BackendUnavailableError(f"{ENV_BACKEND}={choice}: the {op} kernel {failed}")
            return _REFERENCE
    if reason is None:
        return backend
    if choice != "auto":
        raise BackendUnavailableError(f"{ENV_BACKEND}={choice} cannot serve {op}: {reason}")
    _warn_once(f"mla_kernels: {name} kernels do not serve this {op} call ({reason}); using the PyTorch reference")
    return _REFERENCE


def serving_kernel(op: str, p) -> Optional[Backend]:
    """The kernel backend that :func:`select` would return for ``op`` on ``p`` -- or None when
    it would fall back to the reference, or when the backend is not hardware-verified (no
    canary is run).  Never warns: used to route a call to another op's kernels (the forward's
    small-``s_q`` rows to the split decode)."""
    choice = _requested()
    if choice == "reference" or not _is_cuda(p.device):
        return None
    arch = _arch_of(p.device)
    if arch is None or (choice != "auto" and choice != arch):
        return None
    lb = _KERNELS[arch]
    backend = lb.get()
    if backend is None or not backend.hardware_verified:
        return None
    if backend.unavailable_reason(p.device) is not None or backend.supports(op, p) is not None:
        return None
    return backend
