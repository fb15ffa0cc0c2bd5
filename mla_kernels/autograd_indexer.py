"""The indexer's KL loss as an autograd op: ``indexer_loss(...)``, differentiable in ``q_idx``,
``k_idx`` and ``weights`` (``target`` is a constant).

The forward runs the backend's fused loss forward (recomputing the selected scores, their
softmax and the KL per row) and saves ``lse`` and ``1 / sum(target)`` per row; the backward runs
the backend's loss backward, which recomputes the scores again and forms
``dI = (softmax(I) - p) * g`` and the three gradients.

Eager calls go straight to :class:`IndexerLoss` (no dispatcher cost).  Under ``torch.compile`` /
``torch.export`` (``torch.compiler.is_compiling()``), :func:`indexer_loss` calls the custom op
``mla_kernels::indexer_loss_fwd`` instead, whose autograd formula (registered in
:mod:`mla_kernels.ops`) calls ``mla_kernels::indexer_loss_bwd``: one graph, no break.  Both paths
run the same problem functions (``indexer_loss_fwd_problem`` / ``indexer_loss_bwd_problem``).

The gradients are not differentiable themselves: a double backward (``create_graph=True``
followed by a backward through the gradients) raises an error naming this op.
"""

from __future__ import annotations

from typing import Optional

import torch

from .api import _check_scale, tracing
from .autograd import _NoDoubleBackward
from .api_indexer import (
    FP8, REDUCTIONS, indexer_loss_bwd_problem, indexer_loss_fwd_problem, make_indexer_loss_problem,
)
from .common.problem import IndexerLossProblem

__all__ = ["IndexerLoss", "indexer_loss"]

DOUBLE_BACKWARD_ERROR = (
    "mla_kernels.indexer_loss does not support double backward: its gradients (dq_idx, dk_idx, "
    "dweights) are computed by a backward kernel that has no derivative of its own.  Do not "
    "differentiate through them (create_graph=True is fine as long as no backward runs through "
    "indexer_loss's gradients)."
)


class IndexerLoss(torch.autograd.Function):
    """``rows = IndexerLoss.apply(problem, deterministic, q_idx, k_idx, weights)`` -- the per-row
    loss ``[s_q]`` of an already validated :class:`IndexerLossProblem` (the three tensors are
    passed again so that autograd tracks them)."""

    @staticmethod
    def forward(ctx, p, deterministic, q_idx, k_idx, weights):
        rows, lse, inv_tsum = indexer_loss_fwd_problem(p)
        ctx.save_for_backward(p.q, p.k, p.weights, p.indices, p.target, p.topk_length, lse, inv_tsum,
                              q_idx, k_idx, weights)
        ctx.meta = (p.sm_scale, p.k_shape, bool(deterministic))
        return rows

    @staticmethod
    def backward(ctx, grad_rows):
        q, k, w, indices, target, topk_length, lse, inv_tsum, *anchors = ctx.saved_tensors
        sm_scale, k_shape, deterministic = ctx.meta
        p = IndexerLossProblem(q, k, w, indices, target, sm_scale, topk_length, None, None, k_shape)
        g = grad_rows.contiguous().to(lse.dtype)
        dq, dk, dw = indexer_loss_bwd_problem(p, g, lse, inv_tsum, deterministic)
        dk = dk.reshape(k_shape)
        anchors = [a for a in anchors if a.requires_grad]
        if torch.is_grad_enabled() and anchors:  # create_graph=True: a second backward must fail loudly
            dq, dk, dw = _NoDoubleBackward.apply(DOUBLE_BACKWARD_ERROR, 3, dq, dk, dw, *anchors)
        return None, None, dq, dk, dw


def indexer_loss(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    target: torch.Tensor,
    *,
    sm_scale: float = 1.0,
    topk_length: Optional[torch.Tensor] = None,
    reduction: str = "mean",
    deterministic: bool = False,
    q_scale: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The DSA indexer's KL loss (DeepSeek-V3.2's sparse stage), differentiable in ``q_idx``,
    ``k_idx`` and ``weights``.

    Per query t over its valid slots j (``0 <= indices[t, j] < s_kv`` and
    ``j < topk_length[t]``): ``I_tj = sm_scale * sum_h weights[t,h] ReLU(q_idx[t,h] .
    k_idx[indices[t,j]])``, ``p = target / sum(target)`` (``target >= 0``, e.g. ``attn_sum``; it
    is a constant), ``pi = softmax(I)`` and ``loss_t = sum_j p (log p - log pi)`` with
    ``0 log 0 = 0``.  A row with no valid slot or a zero target sum gives 0 and no gradient.

    Args:
        q_idx: ``[s_q, h_idx, d_idx]``; k_idx: ``[s_kv, d_idx]`` or ``[s_kv, 1, d_idx]`` (same
            dtype: bfloat16, float32, float64, or float8_e4m3fn for a forward-only loss with
            ``q_scale``/``k_scale``); weights: ``[s_q, h_idx]`` float.
        indices: ``[s_q, topk]`` or ``[s_q, 1, topk]`` int32/int64 (e.g. from
            :func:`mla_kernels.indexer_topk`); target: ``[s_q, topk]`` float.
        reduction: ``"mean"`` (sum over rows / s_q), ``"sum"`` or ``"none"`` (``[s_q]``).
        deterministic: bitwise-reproducible gradients run to run (sm90: dk summed in 64-bit
            fixed point -- order-independent integer additions; the reference: a fixed order).

    Returns:
        the loss (float32; float64 for float64 inputs), a scalar or ``[s_q]``.
    """
    if not isinstance(reduction, str):
        raise TypeError(f"reduction must be a str, got {type(reduction).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    fp8 = isinstance(q_idx, torch.Tensor) and q_idx.dtype == FP8
    if fp8 and torch.is_grad_enabled():
        grads = [n for n, t in (("q_idx", q_idx), ("k_idx", k_idx), ("weights", weights))
                 if isinstance(t, torch.Tensor) and t.requires_grad]
        if grads:
            raise ValueError(
                f"indexer_loss: float8_e4m3fn inputs are forward-only, but {', '.join(grads)} require grad; "
                f"train with bfloat16 (or float32) q_idx / k_idx, or compute the loss under torch.no_grad()"
            )
    if tracing():
        # torch.compile / torch.export: validate the metadata, then the custom op (one graph node)
        make_indexer_loss_problem(q_idx, k_idx, weights, indices, target, sm_scale=sm_scale,
                                  topk_length=topk_length, q_scale=q_scale, k_scale=k_scale)
        rows = torch.ops.mla_kernels.indexer_loss_fwd(
            q_idx, k_idx, weights, indices, target.detach(), _check_scale(sm_scale), topk_length, deterministic,
            _det(q_scale), _det(k_scale),
        )[0]
        return _reduce(rows, reduction)
    p = make_indexer_loss_problem(q_idx, k_idx, weights, indices, target, sm_scale=sm_scale,
                                  topk_length=topk_length, q_scale=q_scale, k_scale=k_scale)
    if fp8:
        rows = indexer_loss_fwd_problem(p)[0]
    else:
        rows = IndexerLoss.apply(p, deterministic, q_idx, k_idx, weights)
    return _reduce(rows, reduction)


def _det(t):
    return t.detach() if t is not None else None


def _reduce(rows: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / max(rows.shape[0], 1)
