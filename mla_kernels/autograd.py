"""The autograd op: ``sparse_mla(...)``, differentiable in ``q``, ``kv`` and ``attn_sink``.

The forward runs the active backend's forward and saves what the backward needs (the
normalised inputs, ``out`` and ``lse``); the backward calls the backend's backward -- nothing of
the forward is recomputed outside the backward kernel.  The returned ``lse`` is differentiable
too: its gradient enters the backward as ``delta' = delta - dlse * exp(lse' - lse)``.

Eager calls go straight to :class:`SparseMLA` (no dispatcher cost).  Under ``torch.compile`` /
``torch.export`` (``torch.compiler.is_compiling()``), :func:`sparse_mla` calls the custom op
``mla_kernels::sparse_mla_fwd`` instead, whose autograd formula (registered in
:mod:`mla_kernels.ops`) calls ``mla_kernels::sparse_mla_bwd``: one graph, no break.

The gradients are not differentiable themselves: a double backward (``create_graph=True``
followed by a backward through the gradients) raises an error naming this op.
"""

from __future__ import annotations

from typing import Optional

import torch

from .api import _check_flag, bwd_problem, check_inputs, fwd_with_problem, tracing
from .common.problem import Problem

__all__ = ["SparseMLA", "sparse_mla", "AttnSum"]


class AttnSum:
    """Holder that receives ``attn_sum`` (the indexer's KL target) computed inside the backward.

    Pass an instance as ``sparse_mla(..., attn_sum=holder)``; after ``loss.backward()``,
    ``holder.value`` is the ``[s_q, topk]`` float32 tensor ``sum_h exp(q.k*scale - lse)`` --
    the same as :func:`mla_kernels.attn_dist` -- obtained for free from the backward's
    recomputed probabilities.  ``holder.value`` is None until the backward has run.
    """

    def __init__(self) -> None:
        self.value: Optional[torch.Tensor] = None


DOUBLE_BACKWARD_ERROR = (
    "mla_kernels.sparse_mla does not support double backward: its gradients (dq, dkv, "
    "d_attn_sink) are computed by a backward kernel that has no derivative of its own.  Do not "
    "differentiate through them (create_graph=True is fine as long as no backward runs through "
    "sparse_mla's gradients)."
)


class _NoDoubleBackward(torch.autograd.Function):
    """Identity whose backward raises ``message``: attached to gradients computed under
    ``create_graph=True`` so that differentiating through them fails loudly instead of returning a
    silent zero (used by every op here whose backward is a kernel: sparse_mla, indexer_loss)."""

    @staticmethod
    def forward(ctx, message, n_grads, *tensors):
        # tensors = grads + anchors (the op's differentiable inputs): the anchors make the outputs
        # part of the graph, so a backward through them reaches this function and raises.
        ctx.message = message
        return tuple(g.view_as(g) for g in tensors[:n_grads])

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(ctx.message)


class SparseMLA(torch.autograd.Function):
    """``out, lse = SparseMLA.apply(q, kv, indices, sm_scale, d_v, topk_length, attn_sink,
    deterministic, attn_sum_holder)``."""

    @staticmethod
    def forward(ctx, q, kv, indices, sm_scale, d_v, topk_length, attn_sink, deterministic, holder):
        p, (out, _max_logits, lse) = fwd_with_problem(q, kv, indices, sm_scale, d_v, topk_length, attn_sink, True)
        ctx.save_for_backward(p.q, p.kv, p.indices, p.topk_length, p.attn_sink, out, lse, q, kv, attn_sink)
        ctx.meta = (p.sm_scale, p.d_v, p.kv_shape, bool(deterministic), holder)
        ctx.sink_dtype = attn_sink.dtype if attn_sink is not None else None
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, kv, indices, topk_length, attn_sink, out, lse, *anchors = ctx.saved_tensors
        sm_scale, d_v, kv_shape, deterministic, holder = ctx.meta
        p = Problem(q, kv, indices, sm_scale, d_v, topk_length, attn_sink, kv_shape)
        if dout is None:
            dout = torch.zeros_like(out)
        dout = dout.contiguous()
        if dlse is not None:
            dlse = dlse.contiguous().to(lse.dtype)
        want_sum = holder is not None
        res = bwd_problem(p, out, dout, lse, dlse, deterministic, want_sum)
        dq, dkv, dsink = res[:3]
        if want_sum:
            holder.value = res[3]
        if dsink is not None and ctx.sink_dtype is not None:
            dsink = dsink.to(ctx.sink_dtype)
        anchors = [a for a in anchors if a is not None and a.requires_grad]
        if torch.is_grad_enabled() and anchors:  # create_graph=True: a second backward must fail loudly
            grads = [g for g in (dq, dkv, dsink) if g is not None]
            marked = iter(_NoDoubleBackward.apply(DOUBLE_BACKWARD_ERROR, len(grads), *grads, *anchors))
            dq, dkv = next(marked), next(marked)
            dsink = next(marked) if dsink is not None else None
        return dq, dkv, None, None, None, None, dsink, None, None


def sparse_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    *,
    deterministic: bool = False,
    attn_sum: Optional[AttnSum] = None,
):
    """Differentiable sparse MLA attention (forward + backward through the active backend).

    Same inputs and conventions as :func:`mla_kernels.sparse_mla_fwd`.  Returns ``out`` or,
    with ``return_lse``, ``(out, lse)``; gradients flow to ``q``, ``kv`` (``dkv`` in kv's shape)
    and ``attn_sink``.

    Keyword-only:
        deterministic: use the backend's bitwise-reproducible backward.
        attn_sum: an :class:`AttnSum` holder that receives the attention distribution
            ``[s_q, topk]`` computed by the backward (the DSA indexer's KL target).
    """
    _check_flag("return_lse", return_lse)
    _check_flag("deterministic", deterministic)
    if attn_sum is not None and not isinstance(attn_sum, AttnSum):
        raise TypeError(f"attn_sum must be an mla_kernels.AttnSum holder, got {type(attn_sum).__name__}")
    if tracing():
        if attn_sum is not None:
            raise RuntimeError(
                "sparse_mla(attn_sum=AttnSum()) cannot be used under torch.compile/torch.export: the "
                "holder is filled by a Python side effect of the backward.  Compute the indexer's target "
                "with mla_kernels.attn_dist(q, kv, indices, lse, sm_scale) (return_lse=True gives lse)"
            )
        sh = check_inputs(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)
        out, _max_logits, lse = torch.ops.mla_kernels.sparse_mla_fwd(
            q, kv, indices, sh.sm_scale, sh.d_v, topk_length, attn_sink, deterministic=deterministic
        )
        return (out, lse) if return_lse else out
    out, lse = SparseMLA.apply(
        q, kv, indices, sm_scale, d_v, topk_length, attn_sink, deterministic, attn_sum
    )
    return (out, lse) if return_lse else out
