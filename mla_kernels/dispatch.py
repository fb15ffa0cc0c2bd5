"""Which backend serves a call: ``"sm90"``, ``"sm100"`` or ``"reference"``.

Rules:

* CPU tensors always use the reference (with one warning if a kernel backend is forced).
* ``MLA_KERNELS_BACKEND`` (read at every call): ``auto`` (default), ``reference``, ``sm90`` or
  ``sm100``.  A forced kernel backend that cannot serve the call raises
  :class:`BackendUnavailableError` naming the reason; ``reference`` serves everything.
* ``auto`` picks the kernel backend of the device's compute capability (9.0 -> sm90,
  10.x -> sm100) when it supports the call's configuration, otherwise the reference with one
  warning (per distinct reason) saying why.
* A backend not yet verified on real hardware (``hardware_verified = False``) runs a first-use
  canary per static configuration: a small problem against the reference.  On a mismatch it is
  disabled for the process, with a warning, and the reference serves the call.
  ``MLA_KERNELS_CANARY=0`` turns the canary off.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from typing import Dict, Optional

import torch

from . import reference as ref
from .common.backend import OPS, Backend
from .common.problem import Problem

__all__ = [
    "BackendUnavailableError",
    "ReferenceBackend",
    "backend_for",
    "get_backend",
    "select",
    "register_backend",
    "reset_state",
]

ENV_BACKEND = "MLA_KERNELS_BACKEND"
ENV_CANARY = "MLA_KERNELS_CANARY"
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
_disabled: Dict[str, str] = {}  # backend name -> why (failed canary)
_canary_done: Dict[tuple, bool] = {}


def register_backend(name: str, backend: Backend) -> None:
    """Install ``backend`` under ``name`` (``sm90``/``sm100``); used by tests to inject fakes."""
    lb = _LazyBackend(name, "<injected>")
    lb._obj = backend
    _KERNELS[name] = lb


def reset_state() -> None:
    """Forget warnings, canary results and disabled backends (tests)."""
    with _lock:
        _warned.clear()
        _disabled.clear()
        _canary_done.clear()
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
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) == (9, 0):
        return "sm90"
    if major == 10:
        return "sm100"
    return None


def _requested() -> str:
    choice = os.environ.get(ENV_BACKEND, "auto").strip().lower() or "auto"
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

    Honours ``MLA_KERNELS_BACKEND`` when set to a specific backend.  Whether a given call's
    configuration (head count, head dim, dtype ...) is served by that kernel is decided per call;
    an unsupported call falls back to the reference with a warning.
    """
    device = torch.device(device)
    choice = _requested()
    if choice != "auto":
        return choice if device.type == "cuda" or choice == "reference" else "reference"
    arch = _arch_of(device)
    if arch is None:
        return "reference"
    lb = _KERNELS[arch]
    obj = lb.get()
    if obj is None or arch in _disabled or obj.unavailable_reason(device) is not None:
        return "reference"
    return arch


def _canary_ok(backend: Backend, op: str, p: Problem) -> bool:
    """Run ``backend`` on a small problem of ``p``'s static configuration against the reference."""
    key = (backend.name,) + backend.config_key(op, p)
    with _lock:
        if key in _canary_done:
            return _canary_done[key]
    ok, why = _run_canary(backend, op, p)
    with _lock:
        _canary_done[key] = ok
        if not ok:
            _disabled[backend.name] = why
    if not ok:
        _warn_once(
            f"mla_kernels: backend {backend.name} failed its first-use check for {op} "
            f"({why}); it is disabled for this process and the reference serves the calls"
        )
    return ok


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.double()
    b = b.double()
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin) or not torch.equal(a[~fin], b[~fin]):
        return math.inf
    num = (a[fin] - b[fin]).norm().item()
    den = b[fin].norm().item()
    return num / max(den, 1e-30)


def _run_canary(backend: Backend, op: str, p: Problem):
    g = torch.Generator(device="cpu").manual_seed(1234)
    s_q, s_kv, topk = 5, 300, max(2 * backend.topk_block, 128)
    dev, dt = p.device, p.dtype
    q = (torch.randn(s_q, p.h_q, p.d_qk, generator=g) * 0.5).to(dev, dt)
    kv = (torch.randn(s_kv, p.d_qk, generator=g) * 0.5).to(dev, dt)
    idx = torch.randint(-8, s_kv + 8, (s_q, topk), generator=g).to(dev, torch.int32)
    tl = None
    if p.topk_length is not None:
        tl = torch.tensor([topk, 0, 7, topk // 2, topk - 3], dtype=torch.int32).to(dev)
    sink = None
    if p.attn_sink is not None:
        sink = torch.randn(p.h_q, generator=g).to(dev, p.attn_sink.dtype)
    small = Problem(q, kv, idx, p.sm_scale, p.d_v, tl, sink, kv.shape)
    try:
        if op == "fwd":
            got = backend.fwd(small)
            want = _REFERENCE.fwd(small)
            errs = [_rel_err(got[0], want[0]), _rel_err(got[2], want[2])]
            tol = [2e-2, 1e-4]
        elif op == "attn_dist":
            _, _, lse = _REFERENCE.fwd(small)
            got = backend.attn_dist(small, lse.float(), False)
            want = _REFERENCE.attn_dist(small, lse.float(), False)
            errs, tol = [_rel_err(got, want)], [1e-2]
        else:
            out, _, lse = _REFERENCE.fwd(small)
            dout = torch.randn(out.shape, generator=g).to(dev, dt)
            got = backend.bwd(small, out, dout, lse.float())
            want = _REFERENCE.bwd(small, out, dout, lse.float())
            errs, tol = [_rel_err(got[0], want[0]), _rel_err(got[1], want[1])], [3e-2, 3e-2]
    except Exception as e:  # a crash is a failed canary, not a crash of the user's call
        return False, f"raised {type(e).__name__}: {e}"
    bad = [(e, t) for e, t in zip(errs, tol) if not e <= t]
    if bad:
        return False, f"relative error {bad[0][0]:.3g} > {bad[0][1]:.0e}"
    return True, ""


def select(op: str, p: Problem) -> Backend:
    """The backend that serves ``op`` for ``p`` (see the module docstring for the rules)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    choice = _requested()
    if choice == "reference" or not _is_cuda(p.device):
        if choice in ("sm90", "sm100"):
            _warn_once(
                f"mla_kernels: {ENV_BACKEND}={choice} but the inputs are on {p.device}; CPU tensors "
                f"always use the PyTorch reference"
            )
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
        elif name in _disabled:
            reason = f"disabled after a failed first-use check ({_disabled[name]})"
        else:
            reason = backend.unavailable_reason(p.device) or backend.supports(op, p)
    if reason is None and not backend.hardware_verified and os.environ.get(ENV_CANARY, "1") != "0":
        if not _canary_ok(backend, op, p):  # warned there
            if choice != "auto":
                raise BackendUnavailableError(
                    f"{ENV_BACKEND}={choice} failed its first-use check: {_disabled.get(name)}"
                )
            return _REFERENCE
    if reason is None:
        return backend
    if choice != "auto":
        raise BackendUnavailableError(f"{ENV_BACKEND}={choice} cannot serve {op}: {reason}")
    _warn_once(f"mla_kernels: {name} kernels do not serve this {op} call ({reason}); using the PyTorch reference")
    return _REFERENCE
