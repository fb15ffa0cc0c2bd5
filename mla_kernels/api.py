"""The torch-facing ops: validate inputs, normalise them, pick a backend, call it.

All input validation of the package lives here; backends trust the
:class:`~mla_kernels.common.problem.Problem` they receive.

Input conventions (shared by every op):

* ``q [s_q, h_q, d_qk]``; ``kv [s_kv, 1, d_qk]`` or ``[s_kv, d_qk]`` (one shared KV head;
  ``V = kv[..., :d_v]``); ``indices [s_q, 1, topk]`` or ``[s_q, topk]``, int32 or int64 (int64 is
  converted; values outside ``[0, s_kv)`` become -1).
* ``q`` and ``kv`` share one floating dtype (bfloat16 for the kernels; float16/float32/float64
  run on the reference) and one device with every other tensor argument.
* ``topk_length [s_q]`` (int32 or int64): slots ``j >= topk_length[i]`` are ignored; values are
  clamped to ``[0, topk]``.
* ``attn_sink [h_q]`` (float): scales ``out`` by ``exp(lse) / (exp(lse) + exp(sink))``; ``lse``
  is left untouched.
* Non-contiguous or misaligned tensors are copied to contiguous, 16-byte-aligned memory (a
  one-off copy per call; pass contiguous tensors to avoid it).  Outputs are always contiguous.
* ``topk`` that is not a multiple of the selected kernel's block is padded with -1 slots
  internally; results keep the caller's ``topk``.
* ``sm_scale`` is a finite real number ``> 0`` (the kernels fold it into ``exp2``).

Eager calls run the body of each function directly (no dispatcher cost).  While
``torch.compile`` or ``torch.export`` traces (``torch.compiler.is_compiling()``), each public op
checks its inputs' metadata (:func:`check_inputs`: shapes, dtypes, devices -- the same errors as
eagerly, raised at trace time) and calls its ``torch.library`` custom op
(``torch.ops.mla_kernels.*``, defined in :mod:`mla_kernels.ops`) instead, whose implementation
is the eager body.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional, Tuple

import torch

from . import dispatch
from .common.problem import Problem
from .reference import compute_dtype

__all__ = ["sparse_mla_fwd", "attn_dist", "sparse_mla_bwd", "make_problem", "check_inputs", "tracing"]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


def tracing() -> bool:
    """True while ``torch.compile``/``torch.export`` traces: tensors may be fake (no data), so the
    public ops call their ``torch.library`` custom ops instead of running eagerly."""
    return torch.compiler.is_compiling()


def _contig(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (kernels read rows with 16-byte vector loads / TMA)."""
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() and t.data_ptr() % 16:
        t = t.clone()
    return t


def _check_tensor(name: str, t, shape_doc: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_doc}, got {type(t).__name__}")


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; all tensors must share one device")


def _check_scale(sm_scale) -> float:
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        if isinstance(sm_scale, torch.Tensor) and sm_scale.numel() == 1 and not sm_scale.requires_grad:
            sm_scale = sm_scale.item()
        else:
            raise TypeError(f"sm_scale must be a real number, got {type(sm_scale).__name__}")
    sm_scale = float(sm_scale)
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be finite, got {sm_scale}")
    if not sm_scale > 0:
        raise ValueError(f"sm_scale must be > 0 (the softmax scale, e.g. d_qk ** -0.5), got {sm_scale}")
    return sm_scale


def _check_flag(name: str, flag) -> bool:
    if not isinstance(flag, bool):
        raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    return flag


class Shapes(NamedTuple):
    """What :func:`check_inputs` derives from the inputs (no tensor data is read)."""

    s_q: int
    h_q: int
    d_qk: int
    s_kv: int
    topk: int
    d_v: int
    sm_scale: float


def check_inputs(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: Optional[int] = 512,
    topk_length: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
) -> Shapes:
    """Check the shared inputs' types, shapes, dtypes and devices (metadata only: works on the
    fake tensors of ``torch.compile``/``torch.export`` tracing).

    Raises ``TypeError`` for wrong types/dtypes and ``ValueError`` for wrong shapes, sizes,
    devices or values, each naming the argument and what was expected.  ``d_v=None`` (ops that
    do not read V) means ``d_qk``.
    """
    _check_tensor("q", q, "of shape [s_q, h_q, d_qk]")
    if q.dim() != 3:
        raise ValueError(f"q must have shape [s_q, h_q, d_qk] (3-D), got {tuple(q.shape)}")
    s_q, h_q, d_qk = q.shape
    if h_q < 1 or d_qk < 1:
        raise ValueError(f"q must have h_q >= 1 and d_qk >= 1, got shape {tuple(q.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q must be bfloat16, float16, float32 or float64, got {q.dtype}")
    device = q.device

    _check_tensor("kv", kv, "of shape [s_kv, 1, d_qk] or [s_kv, d_qk]")
    if kv.dim() == 3:
        if kv.shape[1] != 1:
            raise ValueError(
                f"kv must have shape [s_kv, 1, d_qk] (one shared KV head) or [s_kv, d_qk], "
                f"got {tuple(kv.shape)}"
            )
    elif kv.dim() != 2:
        raise ValueError(f"kv must have shape [s_kv, 1, d_qk] or [s_kv, d_qk], got {tuple(kv.shape)}")
    if kv.shape[-1] != d_qk:
        raise ValueError(f"kv's last dim must equal q's d_qk={d_qk}, got kv shape {tuple(kv.shape)}")
    if kv.dtype != q.dtype:
        raise TypeError(f"kv must have q's dtype {q.dtype}, got {kv.dtype}")
    _check_device("kv", kv, device)

    _check_tensor("indices", indices, "of shape [s_q, 1, topk] or [s_q, topk]")
    if indices.dim() == 3:
        if indices.shape[1] != 1:
            raise ValueError(
                f"indices must have shape [s_q, 1, topk] or [s_q, topk], got {tuple(indices.shape)}"
            )
    elif indices.dim() != 2:
        raise ValueError(f"indices must have shape [s_q, 1, topk] or [s_q, topk], got {tuple(indices.shape)}")
    if indices.shape[0] != s_q:
        raise ValueError(f"indices must have s_q={s_q} rows like q, got shape {tuple(indices.shape)}")
    if indices.dtype not in _INDEX_DTYPES:
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype}")
    _check_device("indices", indices, device)

    sm_scale = _check_scale(sm_scale)
    if d_v is None:
        d_v = d_qk
    elif isinstance(d_v, bool) or not isinstance(d_v, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"d_v must be an int, got {type(d_v).__name__}")
    elif isinstance(d_v, numbers.Integral):
        d_v = int(d_v)
    if not 1 <= d_v <= d_qk:
        raise ValueError(f"d_v must satisfy 1 <= d_v <= d_qk={d_qk}, got d_v={d_v}")

    if topk_length is not None:
        _check_tensor("topk_length", topk_length, f"of shape [s_q]={[s_q]}")
        if topk_length.dim() != 1 or topk_length.shape[0] != s_q:
            raise ValueError(f"topk_length must have shape [s_q]=[{s_q}], got {tuple(topk_length.shape)}")
        if topk_length.dtype not in _INDEX_DTYPES:
            raise TypeError(f"topk_length must be int32 or int64, got {topk_length.dtype}")
        _check_device("topk_length", topk_length, device)

    if attn_sink is not None:
        _check_tensor("attn_sink", attn_sink, f"of shape [h_q]=[{h_q}]")
        if attn_sink.dim() != 1 or attn_sink.shape[0] != h_q:
            raise ValueError(f"attn_sink must have shape [h_q]=[{h_q}], got {tuple(attn_sink.shape)}")
        if not attn_sink.is_floating_point():
            raise TypeError(f"attn_sink must be a floating tensor, got {attn_sink.dtype}")
        _check_device("attn_sink", attn_sink, device)

    return Shapes(s_q, h_q, d_qk, kv.shape[0], indices.shape[-1], d_v, sm_scale)


def make_problem(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: Optional[int] = 512,
    topk_length: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
) -> Problem:
    """Validate the shared inputs (:func:`check_inputs`) and normalise them into a
    :class:`Problem` (contiguous, aligned, int32 indices with out-of-range values as -1, clamped
    ``topk_length``, ``attn_sink`` in the compute dtype)."""
    sh = check_inputs(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)
    s_q, s_kv, d_qk = sh.s_q, sh.s_kv, sh.d_qk
    idx = indices.reshape(s_q, indices.shape[-1])
    if idx.dtype == torch.int64:
        idx = torch.where((idx < 0) | (idx >= s_kv), torch.full_like(idx, -1), idx).to(torch.int32)
    tl = topk_length.clamp(0, sh.topk).to(torch.int32) if topk_length is not None else None
    sink = attn_sink.detach().to(compute_dtype(q.dtype)) if attn_sink is not None else None
    return Problem(
        q=_contig(q.detach()),
        kv=_contig(kv.detach().reshape(s_kv, d_qk)),
        indices=_contig(idx),
        sm_scale=sh.sm_scale,
        d_v=sh.d_v,
        topk_length=_contig(tl) if tl is not None else None,
        attn_sink=_contig(sink) if sink is not None else None,
        kv_shape=kv.shape,
    )


def _pad_topk(p: Problem, block: int) -> Problem:
    """Pad ``topk`` with -1 (invalid) slots to a positive multiple of ``block``."""
    if block <= 1:
        return p
    topk = p.topk
    padded = max(block, -(-topk // block) * block)
    if padded == topk:
        return p
    idx = torch.full((p.s_q, padded), -1, dtype=torch.int32, device=p.device)
    idx[:, :topk] = p.indices
    return p.with_indices(idx)


def _check_lse(name: str, lse, s_q: int, h_q: int, device: torch.device) -> None:
    _check_tensor(name, lse, f"of shape [s_q, h_q]=[{s_q}, {h_q}]")
    if lse.dim() != 2 or lse.shape[0] != s_q or lse.shape[1] != h_q:
        raise ValueError(f"{name} must have shape [s_q, h_q]=[{s_q}, {h_q}], got {tuple(lse.shape)}")
    if lse.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name} must be float32 (or float64), got {lse.dtype}")
    _check_device(name, lse, device)


def _check_like_out(name: str, t, sh: Shapes, dtype: torch.dtype, device: torch.device) -> None:
    shape = (sh.s_q, sh.h_q, sh.d_v)
    _check_tensor(name, t, f"of shape [s_q, h_q, d_v]={list(shape)}")
    if t.dim() != 3 or tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape [s_q, h_q, d_v]={list(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have q's dtype {dtype}, got {t.dtype}")
    _check_device(name, t, device)


def _lse_for(lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _contig(lse.detach().to(compute_dtype(dtype)))


def _empty_fwd(p: Problem):
    cdt = compute_dtype(p.dtype)
    out = torch.zeros(p.s_q, p.h_q, p.d_v, dtype=p.dtype, device=p.device)
    max_logits = torch.full((p.s_q, p.h_q), -math.inf, dtype=cdt, device=p.device)
    lse = torch.full((p.s_q, p.h_q), math.inf, dtype=cdt, device=p.device)
    return out, max_logits, lse


def fwd_problem(p: Problem) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward on an already validated problem (used by the autograd op)."""
    if p.s_q == 0 or p.s_kv == 0 or p.topk == 0:
        return _empty_fwd(p)
    backend = dispatch.select("fwd", p)
    return backend.fwd(_pad_topk(p, backend.topk_block))


def bwd_problem(p: Problem, out, dout, lse, dlse=None, deterministic=False, return_attn_sum=False):
    """The backward on an already validated problem (used by the autograd op)."""
    cdt = compute_dtype(p.dtype)
    if p.s_q == 0 or p.s_kv == 0 or p.topk == 0:
        dq = torch.zeros_like(p.q)
        dkv = torch.zeros(p.kv_shape, dtype=p.dtype, device=p.device)
        dsink = None if p.attn_sink is None else torch.zeros(p.h_q, dtype=cdt, device=p.device)
        res = (dq, dkv, dsink)
        if return_attn_sum:
            res = res + (torch.zeros(p.s_q, p.topk, dtype=cdt, device=p.device),)
        return res
    backend = dispatch.select("bwd", p)
    res = backend.bwd(
        _pad_topk(p, backend.topk_block), out, dout, lse,
        dlse=dlse, deterministic=deterministic, return_attn_sum=return_attn_sum,
    )
    dq, dkv, dsink = res[:3]
    res = (dq, dkv.reshape(p.kv_shape), dsink) + tuple(res[3:])
    if return_attn_sum:
        res = res[:3] + (res[3][:, : p.topk].contiguous(),)
    return res


def sparse_mla_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA forward (not differentiable: use :func:`mla_kernels.sparse_mla` for training).

    Args:
        q: ``[s_q, h_q, d_qk]`` queries.
        kv: ``[s_kv, 1, d_qk]`` or ``[s_kv, d_qk]`` keys; values are ``kv[..., :d_v]``.
        indices: ``[s_q, 1, topk]`` or ``[s_q, topk]`` int32/int64 rows of ``kv`` each query
            attends to; -1, negative or ``>= s_kv`` entries are ignored.
        sm_scale: softmax scale applied to ``q . k`` (``> 0``).
        d_v: value head dim (``<= d_qk``).
        topk_length: optional ``[s_q]`` int: slots at or beyond it are ignored.
        attn_sink: optional ``[h_q]`` float: per-head sink logit (see module docstring).

    Returns:
        ``(out [s_q, h_q, d_v]`` in q's dtype, ``max_logits [s_q, h_q]``, ``lse [s_q, h_q])``;
        the last two float32 (float64 for float64 inputs), natural-log units.  Rows with no
        valid slot give ``out = 0``, ``lse = +inf``, ``max_logits = -inf``.
    """
    if tracing():
        sh = check_inputs(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)
        return tuple(torch.ops.mla_kernels.sparse_mla_fwd(
            q.detach(), kv.detach(), indices, sh.sm_scale, sh.d_v, topk_length,
            attn_sink.detach() if attn_sink is not None else None,
        ))
    return sparse_mla_fwd_eager(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)


def sparse_mla_fwd_eager(q, kv, indices, sm_scale, d_v=512, topk_length=None, attn_sink=None):
    """:func:`sparse_mla_fwd`'s body (the ``mla_kernels::sparse_mla_fwd`` op's implementation)."""
    p = make_problem(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)
    return fwd_problem(p)


def attn_dist(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    topk_length: Optional[torch.Tensor] = None,
    normalize: bool = False,
) -> torch.Tensor:
    """Attention distribution over the selected tokens (the indexer's KL target).

    ``attn_sum[i, j] = sum_h exp(q[i,h] . kv[indices[i,j]] * sm_scale - lse[i,h])`` for valid
    slots, 0 for invalid slots and empty rows (``lse = +inf`` gives 0, never NaN).  With
    ``normalize=True`` each row is divided by its sum (all-zero rows stay 0).  Not
    differentiable.

    Args:
        lse: ``[s_q, h_q]`` float32, the forward's log-sum-exp (natural log).

    Returns:
        ``attn_sum [s_q, topk]`` float32 (float64 for float64 inputs), in the caller's slot order.
    """
    if tracing():
        sh = check_inputs(q, kv, indices, sm_scale, None, topk_length)
        _check_lse("lse", lse, sh.s_q, sh.h_q, q.device)
        _check_flag("normalize", normalize)
        return torch.ops.mla_kernels.attn_dist(
            q.detach(), kv.detach(), indices, lse.detach(), sh.sm_scale, topk_length, normalize
        )
    return attn_dist_eager(q, kv, indices, lse, sm_scale, topk_length, normalize)


def attn_dist_eager(q, kv, indices, lse, sm_scale, topk_length=None, normalize=False):
    """:func:`attn_dist`'s body (the ``mla_kernels::attn_dist`` op's implementation)."""
    p = make_problem(q, kv, indices, sm_scale, None, topk_length)
    _check_lse("lse", lse, p.s_q, p.h_q, p.device)
    _check_flag("normalize", normalize)
    lse = _lse_for(lse, p.dtype)
    cdt = compute_dtype(p.dtype)
    if p.s_q == 0 or p.s_kv == 0 or p.topk == 0:
        return torch.zeros(p.s_q, p.topk, dtype=cdt, device=p.device)
    backend = dispatch.select("attn_dist", p)
    res = backend.attn_dist(_pad_topk(p, backend.topk_block), lse, normalize)
    return res[:, : p.topk].contiguous() if res.shape[1] != p.topk else res


def sparse_mla_bwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    indices: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    *,
    deterministic: bool = False,
    return_attn_sum: bool = False,
):
    """Sparse MLA backward.

    Args:
        out: ``[s_q, h_q, d_v]`` the forward's output; ``dout`` its gradient (q's dtype).
        lse: ``[s_q, h_q]`` float32, the forward's log-sum-exp.
        deterministic: bitwise-reproducible gradients (no racing float atomics), where the
            backend supports it (the reference is deterministic on CPU).
        return_attn_sum: also return ``attn_sum [s_q, topk]`` (see :func:`attn_dist`).

    Returns:
        ``(dq [s_q,h_q,d_qk], dkv (kv's shape), d_attn_sink [h_q] or None)`` -- dq/dkv in q's
        dtype, ``d_attn_sink`` float32 -- plus ``attn_sum`` with ``return_attn_sum``.
    """
    if tracing():
        check_bwd_inputs(q, kv, out, dout, indices, lse, sm_scale, d_v, topk_length, attn_sink,
                         None, deterministic, return_attn_sum)
        det = lambda t: t.detach() if t is not None else None  # noqa: E731
        dq, dkv, dsink, asum = torch.ops.mla_kernels.sparse_mla_bwd(
            det(q), det(kv), det(out), det(dout), indices, det(lse), float(sm_scale), d_v, topk_length,
            det(attn_sink), deterministic=deterministic, return_attn_sum=return_attn_sum,
        )
        res = (dq, dkv, dsink if attn_sink is not None else None)
        return res + (asum,) if return_attn_sum else res
    return sparse_mla_bwd_eager(q, kv, out, dout, indices, lse, sm_scale, d_v, topk_length, attn_sink,
                                deterministic=deterministic, return_attn_sum=return_attn_sum)


def check_bwd_inputs(q, kv, out, dout, indices, lse, sm_scale, d_v, topk_length, attn_sink, dlse,
                     deterministic, return_attn_sum) -> Shapes:
    """:func:`check_inputs` plus the backward's own arguments (metadata only)."""
    sh = check_inputs(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)
    _check_bwd_args(sh, q.dtype, q.device, out, dout, lse, dlse, deterministic, return_attn_sum)
    return sh


def _check_bwd_args(sh, dtype, device, out, dout, lse, dlse, deterministic, return_attn_sum) -> None:
    """``sh``: anything with ``s_q``, ``h_q``, ``d_v`` (:class:`Shapes` or a :class:`Problem`)."""
    _check_like_out("out", out, sh, dtype, device)
    _check_like_out("dout", dout, sh, dtype, device)
    _check_lse("lse", lse, sh.s_q, sh.h_q, device)
    if dlse is not None:
        _check_lse("dlse", dlse, sh.s_q, sh.h_q, device)
    _check_flag("deterministic", deterministic)
    _check_flag("return_attn_sum", return_attn_sum)


def sparse_mla_bwd_eager(q, kv, out, dout, indices, lse, sm_scale, d_v=512, topk_length=None, attn_sink=None,
                         *, dlse=None, deterministic=False, return_attn_sum=False):
    """:func:`sparse_mla_bwd`'s body (the ``mla_kernels::sparse_mla_bwd`` op's implementation);
    ``dlse`` is the gradient flowing into the forward's returned ``lse`` (the autograd formula's)."""
    p = make_problem(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)
    _check_bwd_args(p, p.dtype, p.device, out, dout, lse, dlse, deterministic, return_attn_sum)
    if dlse is not None:
        dlse = _lse_for(dlse, p.dtype)
    return bwd_problem(p, _contig(out.detach()), _contig(dout.detach()), _lse_for(lse, p.dtype), dlse,
                       deterministic, return_attn_sum)
