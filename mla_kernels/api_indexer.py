"""The torch-facing indexer ops (the other half of a DSA layer): validation, normalisation,
backend choice.  Part of the api layer (``api.py`` holds the attention ops; this file the
indexer family): all validation of the indexer's inputs lives here.

Inputs (shared by the three ops):

* ``q_idx [s_q, h_idx, d_idx]`` and ``k_idx [s_kv, d_idx]`` (or ``[s_kv, 1, d_idx]``), one dtype:
  bfloat16, float16, float32, float64 or float8_e4m3fn (the kernels take bfloat16 and
  float8_e4m3fn; the reference anything);
* ``weights [s_q, h_idx]`` float (any float dtype but float8);
* ``k_start``, ``k_end`` optional ``[s_q]`` int32/int64: query t scores the keys
  ``k_start[t] <= s < k_end[t]`` (clamped to ``[0, s_kv]``); default causal, aligned to the end:
  ``k_start = 0``, ``k_end[t] = s_kv - s_q + t + 1``;
* float8_e4m3fn inputs need ``q_scale [s_q, h_idx]`` and ``k_scale [s_kv]`` (float32, positive --
  not checked: a check would synchronise the device); other dtypes must not pass them.

``I[t, s] = sm_scale * sum_j weights[t, j] * ReLU(q[t, j] . k[s])`` (q, k dequantised).
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch

from . import dispatch
from .api import _check_device, _check_flag, _check_scale, _check_tensor, _contig, tracing
from .common.problem import IndexerLossProblem, IndexerProblem
from .reference import compute_dtype

__all__ = [
    "indexer_logits",
    "indexer_topk",
    "make_indexer_problem",
    "make_indexer_loss_problem",
    "indexer_loss_fwd_problem",
    "indexer_loss_bwd_problem",
    "indexer_loss_fwd_eager",
    "indexer_loss_bwd_eager",
]

FP8 = torch.float8_e4m3fn
_QK_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, FP8)
_W_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)
REDUCTIONS = ("mean", "sum", "none")


def _cdt(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == FP8 else compute_dtype(dtype)


def _check_qkw(q_idx, k_idx, weights):
    _check_tensor("q_idx", q_idx, "of shape [s_q, h_idx, d_idx]")
    if q_idx.dim() != 3:
        raise ValueError(f"q_idx must have shape [s_q, h_idx, d_idx] (3-D), got {tuple(q_idx.shape)}")
    s_q, h, d = q_idx.shape
    if h < 1 or d < 1:
        raise ValueError(f"q_idx must have h_idx >= 1 and d_idx >= 1, got shape {tuple(q_idx.shape)}")
    if q_idx.dtype not in _QK_DTYPES:
        raise TypeError(f"q_idx must be bfloat16, float16, float32, float64 or float8_e4m3fn, got {q_idx.dtype}")
    device = q_idx.device
    _check_tensor("k_idx", k_idx, "of shape [s_kv, d_idx] or [s_kv, 1, d_idx]")
    if k_idx.dim() == 3:
        if k_idx.shape[1] != 1:
            raise ValueError(f"k_idx must have shape [s_kv, d_idx] or [s_kv, 1, d_idx] (one shared key head), "
                             f"got {tuple(k_idx.shape)}")
    elif k_idx.dim() != 2:
        raise ValueError(f"k_idx must have shape [s_kv, d_idx] or [s_kv, 1, d_idx], got {tuple(k_idx.shape)}")
    if k_idx.shape[-1] != d:
        raise ValueError(f"k_idx's last dim must equal q_idx's d_idx={d}, got k_idx shape {tuple(k_idx.shape)}")
    if k_idx.dtype != q_idx.dtype:
        raise TypeError(f"k_idx must have q_idx's dtype {q_idx.dtype}, got {k_idx.dtype}")
    _check_device("k_idx", k_idx, device)
    _check_tensor("weights", weights, f"of shape [s_q, h_idx]=[{s_q}, {h}]")
    if tuple(weights.shape) != (s_q, h):
        raise ValueError(f"weights must have shape [s_q, h_idx]=[{s_q}, {h}], got {tuple(weights.shape)}")
    if weights.dtype not in _W_DTYPES:
        raise TypeError(f"weights must be a float tensor (bfloat16, float16, float32, float64), got {weights.dtype}")
    _check_device("weights", weights, device)
    return s_q, h, d, k_idx.shape[0], device


def _check_scales(q_idx, q_scale, k_scale, s_q, h, s_kv, device):
    if q_idx.dtype != FP8:
        if q_scale is not None or k_scale is not None:
            raise ValueError(f"q_scale / k_scale are only for float8_e4m3fn inputs; q_idx is {q_idx.dtype}")
        return None, None
    if q_scale is None or k_scale is None:
        raise ValueError("float8_e4m3fn q_idx / k_idx need both dequantisation scales: q_scale [s_q, h_idx] "
                         "and k_scale [s_kv] (float32)")
    _check_tensor("q_scale", q_scale, f"of shape [s_q, h_idx]=[{s_q}, {h}]")
    if tuple(q_scale.shape) != (s_q, h):
        raise ValueError(f"q_scale must have shape [s_q, h_idx]=[{s_q}, {h}], got {tuple(q_scale.shape)}")
    _check_tensor("k_scale", k_scale, f"of shape [s_kv]=[{s_kv}]")
    if tuple(k_scale.shape) not in ((s_kv,), (s_kv, 1)):
        raise ValueError(f"k_scale must have shape [s_kv]=[{s_kv}] (or [s_kv, 1]), got {tuple(k_scale.shape)}")
    for name, t in (("q_scale", q_scale), ("k_scale", k_scale)):
        if t.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise TypeError(f"{name} must be a float tensor (float32), got {t.dtype}")
        _check_device(name, t, device)
    return _contig(q_scale.detach().float()), _contig(k_scale.detach().reshape(s_kv).float())


def _check_range(name, t, s_q, device):
    if t is None:
        return None
    _check_tensor(name, t, f"of shape [s_q]=[{s_q}]")
    if t.dim() != 1 or t.shape[0] != s_q:
        raise ValueError(f"{name} must have shape [s_q]=[{s_q}], got {tuple(t.shape)}")
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    _check_device(name, t, device)
    return t


def make_indexer_problem(q_idx, k_idx, weights, *, sm_scale=1.0, k_start=None, k_end=None, q_scale=None,
                         k_scale=None) -> IndexerProblem:
    """Validate the score/top-k inputs and normalise them (see the module docstring)."""
    s_q, h, d, s_kv, device = _check_qkw(q_idx, k_idx, weights)
    sm_scale = _check_scale(sm_scale)
    ks = _check_range("k_start", k_start, s_q, device)
    ke = _check_range("k_end", k_end, s_q, device)
    qs, kscale = _check_scales(q_idx, q_scale, k_scale, s_q, h, s_kv, device)
    t = torch.arange(s_q, device=device, dtype=torch.int64)
    start = torch.zeros(s_q, dtype=torch.int64, device=device) if ks is None else ks.long()
    end = (s_kv - s_q + t + 1) if ke is None else ke.long()
    return IndexerProblem(
        q=_contig(q_idx.detach()),
        k=_contig(k_idx.detach().reshape(s_kv, d)),
        weights=_contig(weights.detach().to(_cdt(q_idx.dtype))),
        sm_scale=sm_scale,
        k_start=_contig(start.clamp(0, s_kv).to(torch.int32)),
        k_end=_contig(end.clamp(0, s_kv).to(torch.int32)),
        q_scale=qs,
        k_scale=kscale,
        k_shape=k_idx.shape,
        causal=ks is None and ke is None,
    )


def indexer_logits(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    *,
    sm_scale: float = 1.0,
    k_start: Optional[torch.Tensor] = None,
    k_end: Optional[torch.Tensor] = None,
    q_scale: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The dense indexer scores ``[s_q, s_kv]`` float32 (float64 for float64 inputs), ``-inf``
    outside each row's key range (see the module docstring for the inputs).

    This holds ``[s_q, s_kv]`` whole (4 GiB at S = 32k); :func:`indexer_topk` never does.
    """
    if tracing():
        make_indexer_problem(q_idx, k_idx, weights, sm_scale=sm_scale, k_start=k_start, k_end=k_end,
                             q_scale=q_scale, k_scale=k_scale)
        return torch.ops.mla_kernels.indexer_logits(q_idx.detach(), k_idx.detach(), weights.detach(),
                                                    _check_scale(sm_scale), k_start, k_end, _det(q_scale),
                                                    _det(k_scale))
    return indexer_logits_eager(q_idx, k_idx, weights, sm_scale, k_start, k_end, q_scale, k_scale)


def _det(t):
    return t.detach() if t is not None else None


def indexer_logits_eager(q_idx, k_idx, weights, sm_scale=1.0, k_start=None, k_end=None, q_scale=None,
                         k_scale=None):
    """:func:`indexer_logits`'s body (the ``mla_kernels::indexer_logits`` op's implementation)."""
    p = make_indexer_problem(q_idx, k_idx, weights, sm_scale=sm_scale, k_start=k_start, k_end=k_end,
                             q_scale=q_scale, k_scale=k_scale)
    if p.s_q == 0 or p.s_kv == 0:
        return torch.full((p.s_q, p.s_kv), float("-inf"), dtype=_cdt(p.dtype), device=p.device)
    return dispatch.select("indexer_logits", p).indexer_logits(p)


def indexer_topk(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    *,
    sm_scale: float = 1.0,
    k_start: Optional[torch.Tensor] = None,
    k_end: Optional[torch.Tensor] = None,
    q_scale: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    return_logits: bool = False,
):
    """Exact top-k keys of the indexer scores per query, without holding ``[s_q, s_kv]``.

    The ``topk`` keys of largest score in the query's key range; equal scores go to the smaller
    key index (the set is exact and deterministic); NaN scores rank below every number; a row
    with fewer keys in range takes them all.

    Returns ``(indices [s_q, topk] int32, topk_length [s_q] int32)`` -- the chosen keys in
    ascending order, then -1; ``topk_length`` counts them -- and with ``return_logits`` also
    ``logits [s_q, topk]`` float32 (float64 for float64 inputs) of the returned slots, -inf at -1.
    ``indices.view(s_q, 1, topk)`` and ``topk_length`` feed :func:`mla_kernels.sparse_mla`
    directly.

    On sm90 the scores are computed by blocks of query rows into bounded float32 workspaces
    (``mla_kernels.sm90.indexer_host.WORKSPACE_BYTES`` in total, 512 MiB by default) and each row's
    exact top-k is selected there; the blocks run on two CUDA streams (the caller's current one
    and a side stream forked from it and joined back before the call returns, so the call is
    ordered on the current stream as usual and can be captured in a CUDA graph).  The reference
    works by chunks of rows likewise.
    """
    if tracing():
        topk, return_logits = _check_topk_args(topk, return_logits)
        make_indexer_problem(q_idx, k_idx, weights, sm_scale=sm_scale, k_start=k_start, k_end=k_end,
                             q_scale=q_scale, k_scale=k_scale)
        res = torch.ops.mla_kernels.indexer_topk(q_idx.detach(), k_idx.detach(), weights.detach(), topk,
                                                 _check_scale(sm_scale), k_start, k_end, _det(q_scale),
                                                 _det(k_scale), return_logits)
        return tuple(res) if return_logits else tuple(res[:2])
    return indexer_topk_eager(q_idx, k_idx, weights, topk, sm_scale, k_start, k_end, q_scale, k_scale,
                              return_logits)


def _check_topk_args(topk, return_logits):
    if isinstance(topk, bool) or not isinstance(topk, numbers.Integral):
        raise TypeError(f"topk must be an int, got {type(topk).__name__}")
    topk = int(topk)
    if topk <= 0:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if not isinstance(return_logits, bool):
        raise TypeError(f"return_logits must be a bool, got {type(return_logits).__name__}")
    return topk, return_logits


def indexer_topk_eager(q_idx, k_idx, weights, topk, sm_scale=1.0, k_start=None, k_end=None, q_scale=None,
                       k_scale=None, return_logits=False):
    """:func:`indexer_topk`'s body (the ``mla_kernels::indexer_topk`` op's implementation)."""
    topk, return_logits = _check_topk_args(topk, return_logits)
    p = make_indexer_problem(q_idx, k_idx, weights, sm_scale=sm_scale, k_start=k_start, k_end=k_end,
                             q_scale=q_scale, k_scale=k_scale)
    if p.s_q == 0 or p.s_kv == 0:
        idx = torch.full((p.s_q, topk), -1, dtype=torch.int32, device=p.device)
        length = torch.zeros(p.s_q, dtype=torch.int32, device=p.device)
        if return_logits:
            return idx, length, torch.full((p.s_q, topk), float("-inf"), dtype=_cdt(p.dtype), device=p.device)
        return idx, length
    return dispatch.select("indexer_topk", p).indexer_topk(p, topk, return_logits)


# ---------------------------------------------------------------------------------------------
# The indexer's KL loss (the autograd op lives in autograd_indexer.py)
# ---------------------------------------------------------------------------------------------


def make_indexer_loss_problem(q_idx, k_idx, weights, indices, target, *, sm_scale=1.0, topk_length=None,
                              q_scale=None, k_scale=None) -> IndexerLossProblem:
    """Validate the loss inputs and normalise them."""
    s_q, h, d, s_kv, device = _check_qkw(q_idx, k_idx, weights)
    sm_scale = _check_scale(sm_scale)
    qs, kscale = _check_scales(q_idx, q_scale, k_scale, s_q, h, s_kv, device)
    _check_tensor("indices", indices, "of shape [s_q, topk] or [s_q, 1, topk]")
    if indices.dim() == 3:
        if indices.shape[1] != 1:
            raise ValueError(f"indices must have shape [s_q, topk] or [s_q, 1, topk], got {tuple(indices.shape)}")
    elif indices.dim() != 2:
        raise ValueError(f"indices must have shape [s_q, topk] or [s_q, 1, topk], got {tuple(indices.shape)}")
    if indices.shape[0] != s_q:
        raise ValueError(f"indices must have s_q={s_q} rows like q_idx, got shape {tuple(indices.shape)}")
    if indices.dtype not in _INDEX_DTYPES:
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype}")
    _check_device("indices", indices, device)
    idx = indices.reshape(s_q, indices.shape[-1])
    topk = idx.shape[1]
    if idx.dtype == torch.int64:
        idx = torch.where((idx < 0) | (idx >= s_kv), torch.full_like(idx, -1), idx).to(torch.int32)
    _check_tensor("target", target, f"of shape [s_q, topk]=[{s_q}, {topk}]")
    if tuple(target.shape) != (s_q, topk):
        raise ValueError(f"target must have shape [s_q, topk]=[{s_q}, {topk}] like indices, got {tuple(target.shape)}")
    if target.dtype not in _W_DTYPES:
        raise TypeError(f"target must be a float tensor (float32), got {target.dtype}")
    _check_device("target", target, device)
    tl = None
    if topk_length is not None:
        _check_tensor("topk_length", topk_length, f"of shape [s_q]=[{s_q}]")
        if topk_length.dim() != 1 or topk_length.shape[0] != s_q:
            raise ValueError(f"topk_length must have shape [s_q]=[{s_q}], got {tuple(topk_length.shape)}")
        if topk_length.dtype not in _INDEX_DTYPES:
            raise TypeError(f"topk_length must be int32 or int64, got {topk_length.dtype}")
        _check_device("topk_length", topk_length, device)
        tl = _contig(topk_length.clamp(0, topk).to(torch.int32))
    cdt = _cdt(q_idx.dtype)
    return IndexerLossProblem(
        q=_contig(q_idx.detach()),
        k=_contig(k_idx.detach().reshape(s_kv, d)),
        weights=_contig(weights.detach()),
        indices=_contig(idx),
        target=_contig(target.detach().to(cdt)),
        sm_scale=sm_scale,
        topk_length=tl,
        q_scale=qs,
        k_scale=kscale,
        k_shape=k_idx.shape,
    )


def indexer_loss_fwd_problem(p: IndexerLossProblem):
    """``(loss [s_q], lse [s_q], inv_tsum [s_q])`` of a validated problem."""
    if p.s_q == 0 or p.topk == 0 or p.s_kv == 0:
        z = torch.zeros(p.s_q, dtype=_cdt(p.dtype), device=p.device)
        return z, z.clone(), z.clone()
    return dispatch.select("indexer_loss_fwd", p).indexer_loss_fwd(p)


def indexer_loss_bwd_problem(p: IndexerLossProblem, grad_rows, lse, inv_tsum, deterministic: bool):
    """``(dq, dk (k_idx's shape), dweights)`` of a validated problem."""
    if p.s_q == 0 or p.topk == 0 or p.s_kv == 0:
        return (torch.zeros_like(p.q), torch.zeros(p.k_shape, dtype=p.k.dtype, device=p.device),
                torch.zeros_like(p.weights))
    return dispatch.select("indexer_loss_bwd", p).indexer_loss_bwd(p, grad_rows, lse, inv_tsum, deterministic)


# The bodies of the ``mla_kernels::indexer_loss_fwd`` / ``indexer_loss_bwd`` custom ops (ops.py).  An
# eager ``indexer_loss`` call does not go through them: it runs ``IndexerLoss`` (autograd_indexer.py)
# on the same problem functions.


def indexer_loss_fwd_eager(q_idx, k_idx, weights, indices, target, sm_scale=1.0, topk_length=None,
                           deterministic=False, q_scale=None, k_scale=None):
    """``(rows [s_q], lse [s_q], inv_tsum [s_q])``: the per-row loss of :func:`indexer_loss` and what
    its backward needs (``deterministic`` only picks the backward's mode)."""
    _check_flag("deterministic", deterministic)
    p = make_indexer_loss_problem(q_idx, k_idx, weights, indices, target, sm_scale=sm_scale,
                                  topk_length=topk_length, q_scale=q_scale, k_scale=k_scale)
    return indexer_loss_fwd_problem(p)


def check_loss_bwd_inputs(q_idx, k_idx, weights, indices, target, grad_rows, lse, inv_tsum, sm_scale=1.0,
                          topk_length=None, deterministic=False) -> IndexerLossProblem:
    """Validate the loss backward's inputs (no tensor data is read): the forward's, plus
    ``grad_rows``, ``lse``, ``inv_tsum`` ``[s_q]`` float on q_idx's device."""
    _check_flag("deterministic", deterministic)
    if isinstance(q_idx, torch.Tensor) and q_idx.dtype == FP8:
        raise ValueError("indexer_loss: float8_e4m3fn inputs are forward-only (no backward); train with "
                         "bfloat16 (or float32) q_idx / k_idx")
    p = make_indexer_loss_problem(q_idx, k_idx, weights, indices, target, sm_scale=sm_scale,
                                  topk_length=topk_length)
    for name, t in (("grad_rows", grad_rows), ("lse", lse), ("inv_tsum", inv_tsum)):
        _check_tensor(name, t, f"of shape [s_q]=[{p.s_q}]")
        if tuple(t.shape) != (p.s_q,):
            raise ValueError(f"{name} must have shape [s_q]=[{p.s_q}], got {tuple(t.shape)}")
        if t.dtype not in _W_DTYPES:
            raise TypeError(f"{name} must be a float tensor (float32), got {t.dtype}")
        _check_device(name, t, p.device)
    return p


def indexer_loss_bwd_eager(q_idx, k_idx, weights, indices, target, grad_rows, lse, inv_tsum, sm_scale=1.0,
                           topk_length=None, deterministic=False):
    """``(dq [q_idx's shape], dk [k_idx's shape], dweights [weights' shape])`` of
    ``sum_t grad_rows[t] * rows[t]``, from the forward's ``lse`` and ``inv_tsum``."""
    p = check_loss_bwd_inputs(q_idx, k_idx, weights, indices, target, grad_rows, lse, inv_tsum, sm_scale,
                              topk_length, deterministic)
    cdt = _cdt(p.dtype)
    g, lse, inv_tsum = (_contig(t.detach().to(cdt)) for t in (grad_rows, lse, inv_tsum))
    dq, dk, dw = indexer_loss_bwd_problem(p, g, lse, inv_tsum, deterministic)
    return dq, dk.reshape(p.k_shape), dw
