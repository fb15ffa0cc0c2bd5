"""The public ops as ``torch.library`` custom ops (``torch.ops.mla_kernels.*``).

What they are for: ``torch.compile(fullgraph=True)`` and ``torch.export`` see each op as one
opaque node with known output shapes (``register_fake``) and, for the forward, a registered
autograd formula (``register_autograd``), so a training step traces into one graph with no
break and an exported program keeps the ops by name.  Importing :mod:`mla_kernels` registers
them.

When they are used: the public functions (``mla_kernels.sparse_mla_fwd``, ``attn_dist``,
``sparse_mla_bwd``, ``sparse_mla``, ``indexer_loss``, ...) call these ops only while tracing
(``torch.compiler.is_compiling()``); an eager call runs the function's body directly, because
the dispatcher costs tens of microseconds per call.  Each op's implementation *is* that eager
body (``api.*_eager``), so both paths compute the same thing.

==========================  =====================================================================
op                          schema (positional arguments as the public function's)
==========================  =====================================================================
``sparse_mla_fwd``          ``(q, kv, indices, sm_scale, d_v=512, topk_length=None,
                            attn_sink=None, deterministic=False) -> (out, max_logits, lse)``;
                            differentiable in ``q``, ``kv``, ``attn_sink`` through ``out`` and
                            ``lse`` (``max_logits`` carries no gradient); ``deterministic``
                            picks the backward's mode
``attn_dist``               ``(q, kv, indices, lse, sm_scale, topk_length=None,
                            normalize=False) -> attn_sum``
``sparse_mla_bwd``          ``(q, kv, out, dout, indices, lse, sm_scale, d_v=512,
                            topk_length=None, attn_sink=None, dlse=None, *,
                            deterministic=False, return_attn_sum=False)
                            -> (dq, dkv, d_attn_sink, attn_sum)``; ``dlse`` is the gradient
                            of the forward's ``lse`` (positional: an op takes no keyword-only
                            tensor);
                            an op cannot return None: ``d_attn_sink`` is ``[0]`` without a sink,
                            ``attn_sum`` ``[0]`` without ``return_attn_sum`` (the public
                            function maps both back to its documented results)
``sparse_mla_decode``       ``(q, kv_cache, indices, sm_scale, d_v=512, topk_length=None,
                            attn_sink=None, block_table=None, q_bias=None) -> (out, lse)``;
                            no ``plan`` (a plan's buffers cannot be a traced op's outputs: the
                            public function ignores the plan while tracing, the compiled graph
                            allocates); ``block_table``/``q_bias`` positional
``merge_attn_partials``     ``(outs, lses, attn_sink=None, out_dtype=None) -> (out, lse)``
``indexer_logits``          ``(q_idx, k_idx, weights, sm_scale=1.0, k_start=None, k_end=None,
                            q_scale=None, k_scale=None) -> logits`` (the public keyword-only
                            arguments, positional)
``indexer_topk``            ``(q_idx, k_idx, weights, topk, sm_scale=1.0, k_start=None,
                            k_end=None, q_scale=None, k_scale=None, return_logits=False)
                            -> (indices, topk_length, logits)``; ``logits`` is ``[0]`` without
                            ``return_logits``
``indexer_loss_fwd``        ``(q_idx, k_idx, weights, indices, target, sm_scale=1.0,
                            topk_length=None, deterministic=False, q_scale=None, k_scale=None)
                            -> (rows, lse, inv_tsum)``: :func:`mla_kernels.indexer_loss`'s
                            arguments but ``reduction`` (the public function reduces ``rows
                            [s_q]`` itself); differentiable in ``q_idx``, ``k_idx``, ``weights``
                            through ``rows`` (``lse``, ``inv_tsum`` ``[s_q]`` are what the backward
                            needs and carry no gradient); ``deterministic`` picks the backward's
                            mode
``indexer_loss_bwd``        ``(q_idx, k_idx, weights, indices, target, grad_rows, lse, inv_tsum,
                            sm_scale=1.0, topk_length=None, deterministic=False)
                            -> (dq, dk, dweights)`` in the shapes and dtypes of ``q_idx``,
                            ``k_idx``, ``weights``; not differentiable (a double backward raises)
==========================  =====================================================================

Adding an op takes three steps:

1. ``api.py``: the eager body ``foo_eager(...)`` (validation + dispatch, as today), and the public
   ``foo(...)`` that, under :func:`mla_kernels.api.tracing`, checks its inputs' metadata and
   returns ``torch.ops.mla_kernels.foo(...)``, else ``foo_eager(...)``;
2. here::

       @custom_op("foo")
       def _foo(q: Tensor, kv: Tensor, topk: int, lengths: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
           return _outputs(api.foo_eager(q, kv, topk, lengths))

       @_foo.register_fake
       def _(q, kv, topk, lengths=None):
           return q.new_empty(...), q.new_empty(..., dtype=torch.float32)   # shapes/dtypes only

   plus ``_foo.register_autograd(backward, setup_context=...)`` if it is differentiable (see
   :func:`_fwd_setup_context` / :func:`_fwd_backward`);
3. ``tests/test_ops.py``: one entry in ``OPCHECK_CASES`` (``torch.library.opcheck`` on the CPU
   reference) and, if differentiable, a ``torch.compile(fullgraph=True)`` step.

Rules every op keeps: no output aliases an input or another output (return fresh tensors: the
eager bodies do); no ``None`` outputs (use an empty tensor, see :func:`_outputs`); type
annotations on the implementation (they define the schema: ``int`` is ``SymInt``, ``float``,
``bool``, ``Optional[Tensor]``, ``Tensor``, tuples of tensors).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import api, api_indexer
from .reference import compute_dtype

__all__ = ["NAMESPACE", "custom_op", "OPS"]

NAMESPACE = "mla_kernels"


def custom_op(name: str, *, mutates_args=()):
    """``torch.library.custom_op("mla_kernels::<name>")``: decorate the typed implementation."""
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates_args)


def _outputs(*tensors: Optional[Tensor], like: Tensor, dtype: torch.dtype):
    """A custom op returns tensors only: a None result becomes an empty ``[0]`` tensor."""
    return tuple(t if t is not None else like.new_empty((0,), dtype=dtype) for t in tensors)


# --------------------------------------------------------------------------------------------
# sparse_mla_fwd (+ the autograd formula of sparse_mla)
# --------------------------------------------------------------------------------------------


@custom_op("sparse_mla_fwd")
def _sparse_mla_fwd(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: Optional[Tensor] = None,
    attn_sink: Optional[Tensor] = None,
    deterministic: bool = False,
) -> Tuple[Tensor, Tensor, Tensor]:
    api._check_flag("deterministic", deterministic)
    out, max_logits, lse = api.sparse_mla_fwd_eager(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)
    return out, max_logits, lse


@_sparse_mla_fwd.register_fake
def _(q, kv, indices, sm_scale, d_v=512, topk_length=None, attn_sink=None, deterministic=False):
    sh = api.check_inputs(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)
    cdt = compute_dtype(q.dtype)
    return (
        q.new_empty((sh.s_q, sh.h_q, sh.d_v)),
        q.new_empty((sh.s_q, sh.h_q), dtype=cdt),
        q.new_empty((sh.s_q, sh.h_q), dtype=cdt),
    )


def _fwd_setup_context(ctx, inputs, output):
    q, kv, indices, sm_scale, d_v, topk_length, attn_sink, deterministic = inputs
    out, _max_logits, lse = output
    ctx.save_for_backward(q, kv, indices, topk_length, attn_sink, out, lse)
    ctx.sm_scale, ctx.d_v, ctx.deterministic = sm_scale, d_v, deterministic


def _fwd_backward(ctx, d_out, _d_max_logits, d_lse):
    q, kv, indices, topk_length, attn_sink, out, lse = ctx.saved_tensors
    if d_out is None:
        d_out = torch.zeros_like(out)
    dq, dkv, dsink, _ = torch.ops.mla_kernels.sparse_mla_bwd(
        q, kv, out, d_out.contiguous(), indices, lse, ctx.sm_scale, ctx.d_v, topk_length, attn_sink, d_lse,
        deterministic=ctx.deterministic,
    )
    d_attn_sink = dsink.to(attn_sink.dtype) if attn_sink is not None else None
    return dq, dkv, None, None, None, None, d_attn_sink, None


_sparse_mla_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# --------------------------------------------------------------------------------------------
# attn_dist
# --------------------------------------------------------------------------------------------


@custom_op("attn_dist")
def _attn_dist(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    lse: Tensor,
    sm_scale: float,
    topk_length: Optional[Tensor] = None,
    normalize: bool = False,
) -> Tensor:
    return api.attn_dist_eager(q, kv, indices, lse, sm_scale, topk_length, normalize)


@_attn_dist.register_fake
def _(q, kv, indices, lse, sm_scale, topk_length=None, normalize=False):
    sh = api.check_inputs(q, kv, indices, sm_scale, None, topk_length)
    return q.new_empty((sh.s_q, sh.topk), dtype=compute_dtype(q.dtype))


# --------------------------------------------------------------------------------------------
# sparse_mla_bwd
# --------------------------------------------------------------------------------------------


@custom_op("sparse_mla_bwd")
def _sparse_mla_bwd(
    q: Tensor,
    kv: Tensor,
    out: Tensor,
    dout: Tensor,
    indices: Tensor,
    lse: Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: Optional[Tensor] = None,
    attn_sink: Optional[Tensor] = None,
    dlse: Optional[Tensor] = None,
    *,
    deterministic: bool = False,
    return_attn_sum: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    res = api.sparse_mla_bwd_eager(q, kv, out, dout, indices, lse, sm_scale, d_v, topk_length, attn_sink,
                                   dlse=dlse, deterministic=deterministic, return_attn_sum=return_attn_sum)
    dq, dkv, dsink = res[:3]
    asum = res[3] if return_attn_sum else None
    return _outputs(dq, dkv, dsink, asum, like=q, dtype=compute_dtype(q.dtype))


@_sparse_mla_bwd.register_fake
def _(q, kv, out, dout, indices, lse, sm_scale, d_v=512, topk_length=None, attn_sink=None, dlse=None, *,
      deterministic=False, return_attn_sum=False):
    sh = api.check_bwd_inputs(q, kv, out, dout, indices, lse, sm_scale, d_v, topk_length, attn_sink, dlse,
                              deterministic, return_attn_sum)
    cdt = compute_dtype(q.dtype)
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        kv.new_empty(kv.shape),
        q.new_empty((sh.h_q,) if attn_sink is not None else (0,), dtype=cdt),
        q.new_empty((sh.s_q, sh.topk) if return_attn_sum else (0,), dtype=cdt),
    )


def _no_double_backward(ctx, *grads):
    from .autograd import DOUBLE_BACKWARD_ERROR

    raise RuntimeError(DOUBLE_BACKWARD_ERROR)


def _no_setup(ctx, inputs, keyword_only_inputs=None, output=None):
    pass


# The backward's outputs are not differentiable: say so instead of returning silent zeros.
_sparse_mla_bwd.register_autograd(_no_double_backward, setup_context=_no_setup)


# --------------------------------------------------------------------------------------------
# sparse_mla_decode, merge_attn_partials (not differentiable)
# --------------------------------------------------------------------------------------------


@custom_op("sparse_mla_decode")
def _sparse_mla_decode(
    q: Tensor,
    kv_cache: Tensor,
    indices: Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: Optional[Tensor] = None,
    attn_sink: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    q_bias: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    out, lse = api.sparse_mla_decode_eager(q, kv_cache, indices, sm_scale, d_v, topk_length, attn_sink,
                                           block_table=block_table, q_bias=q_bias)
    return out, lse


@_sparse_mla_decode.register_fake
def _(q, kv_cache, indices, sm_scale, d_v=512, topk_length=None, attn_sink=None, block_table=None, q_bias=None):
    api._decode_inputs(None, q, kv_cache, indices, sm_scale, d_v, topk_length, attn_sink, block_table, q_bias)
    b, s_q, h_q, _ = q.shape
    return q.new_empty((b, s_q, h_q, d_v)), q.new_empty((b, s_q, h_q), dtype=compute_dtype(q.dtype))


@custom_op("merge_attn_partials")
def _merge_attn_partials(
    outs: Tensor,
    lses: Tensor,
    attn_sink: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[Tensor, Tensor]:
    out, lse = api.merge_attn_partials_eager(outs, lses, attn_sink, out_dtype)
    return out, lse


@_merge_attn_partials.register_fake
def _(outs, lses, attn_sink=None, out_dtype=None):
    out_dtype = api._check_merge(outs, lses, attn_sink, out_dtype)
    shape = tuple(outs.shape[1:])
    return outs.new_empty(shape, dtype=out_dtype), outs.new_empty(shape[:-1], dtype=compute_dtype(outs.dtype))


# --------------------------------------------------------------------------------------------
# indexer_logits, indexer_topk (not differentiable)
# --------------------------------------------------------------------------------------------


@custom_op("indexer_logits")
def _indexer_logits(
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    sm_scale: float = 1.0,
    k_start: Optional[Tensor] = None,
    k_end: Optional[Tensor] = None,
    q_scale: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
) -> Tensor:
    return api_indexer.indexer_logits_eager(q_idx, k_idx, weights, sm_scale, k_start, k_end, q_scale, k_scale)


@_indexer_logits.register_fake
def _(q_idx, k_idx, weights, sm_scale=1.0, k_start=None, k_end=None, q_scale=None, k_scale=None):
    p = api_indexer.make_indexer_problem(q_idx, k_idx, weights, sm_scale=sm_scale, k_start=k_start, k_end=k_end,
                                         q_scale=q_scale, k_scale=k_scale)
    return q_idx.new_empty((p.s_q, p.s_kv), dtype=api_indexer._cdt(p.dtype))


@custom_op("indexer_topk")
def _indexer_topk(
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    topk: int,
    sm_scale: float = 1.0,
    k_start: Optional[Tensor] = None,
    k_end: Optional[Tensor] = None,
    q_scale: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
    return_logits: bool = False,
) -> Tuple[Tensor, Tensor, Tensor]:
    res = api_indexer.indexer_topk_eager(q_idx, k_idx, weights, topk, sm_scale, k_start, k_end, q_scale,
                                         k_scale, return_logits)
    idx, length = res[0], res[1]
    logits = res[2] if return_logits else None
    return _outputs(idx, length, logits, like=q_idx, dtype=api_indexer._cdt(q_idx.dtype))


@_indexer_topk.register_fake
def _(q_idx, k_idx, weights, topk, sm_scale=1.0, k_start=None, k_end=None, q_scale=None, k_scale=None,
      return_logits=False):
    p = api_indexer.make_indexer_problem(q_idx, k_idx, weights, sm_scale=sm_scale, k_start=k_start, k_end=k_end,
                                         q_scale=q_scale, k_scale=k_scale)
    return (
        q_idx.new_empty((p.s_q, topk), dtype=torch.int32),
        q_idx.new_empty((p.s_q,), dtype=torch.int32),
        q_idx.new_empty((p.s_q, topk) if return_logits else (0,), dtype=api_indexer._cdt(p.dtype)),
    )


# --------------------------------------------------------------------------------------------
# indexer_loss_fwd (+ the autograd formula of indexer_loss), indexer_loss_bwd
# --------------------------------------------------------------------------------------------


@custom_op("indexer_loss_fwd")
def _indexer_loss_fwd(
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    indices: Tensor,
    target: Tensor,
    sm_scale: float = 1.0,
    topk_length: Optional[Tensor] = None,
    deterministic: bool = False,
    q_scale: Optional[Tensor] = None,
    k_scale: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    rows, lse, inv_tsum = api_indexer.indexer_loss_fwd_eager(q_idx, k_idx, weights, indices, target, sm_scale,
                                                             topk_length, deterministic, q_scale, k_scale)
    return rows, lse, inv_tsum


@_indexer_loss_fwd.register_fake
def _(q_idx, k_idx, weights, indices, target, sm_scale=1.0, topk_length=None, deterministic=False, q_scale=None,
      k_scale=None):
    api._check_flag("deterministic", deterministic)
    p = api_indexer.make_indexer_loss_problem(q_idx, k_idx, weights, indices, target, sm_scale=sm_scale,
                                              topk_length=topk_length, q_scale=q_scale, k_scale=k_scale)
    cdt = api_indexer._cdt(p.dtype)
    return tuple(q_idx.new_empty((p.s_q,), dtype=cdt) for _ in range(3))


def _loss_setup_context(ctx, inputs, output):
    q_idx, k_idx, weights, indices, target, sm_scale, topk_length, deterministic, _q_scale, _k_scale = inputs
    _rows, lse, inv_tsum = output
    ctx.save_for_backward(q_idx, k_idx, weights, indices, target, topk_length, lse, inv_tsum)
    ctx.sm_scale, ctx.deterministic = sm_scale, deterministic


def _loss_backward(ctx, d_rows, _d_lse, _d_inv_tsum):
    q_idx, k_idx, weights, indices, target, topk_length, lse, inv_tsum = ctx.saved_tensors
    if d_rows is None:
        d_rows = torch.zeros_like(lse)
    dq, dk, dw = torch.ops.mla_kernels.indexer_loss_bwd(
        q_idx, k_idx, weights, indices, target, d_rows.contiguous(), lse, inv_tsum, ctx.sm_scale, topk_length,
        ctx.deterministic,
    )
    return dq, dk, dw, None, None, None, None, None, None, None


_indexer_loss_fwd.register_autograd(_loss_backward, setup_context=_loss_setup_context)


@custom_op("indexer_loss_bwd")
def _indexer_loss_bwd(
    q_idx: Tensor,
    k_idx: Tensor,
    weights: Tensor,
    indices: Tensor,
    target: Tensor,
    grad_rows: Tensor,
    lse: Tensor,
    inv_tsum: Tensor,
    sm_scale: float = 1.0,
    topk_length: Optional[Tensor] = None,
    deterministic: bool = False,
) -> Tuple[Tensor, Tensor, Tensor]:
    dq, dk, dw = api_indexer.indexer_loss_bwd_eager(q_idx, k_idx, weights, indices, target, grad_rows, lse,
                                                    inv_tsum, sm_scale, topk_length, deterministic)
    return dq, dk, dw


@_indexer_loss_bwd.register_fake
def _(q_idx, k_idx, weights, indices, target, grad_rows, lse, inv_tsum, sm_scale=1.0, topk_length=None,
      deterministic=False):
    api_indexer.check_loss_bwd_inputs(q_idx, k_idx, weights, indices, target, grad_rows, lse, inv_tsum, sm_scale,
                                      topk_length, deterministic)
    return (
        torch.empty_like(q_idx, memory_format=torch.contiguous_format),
        k_idx.new_empty(k_idx.shape),
        torch.empty_like(weights, memory_format=torch.contiguous_format),
    )


def _no_loss_double_backward(ctx, *grads):
    from .autograd_indexer import DOUBLE_BACKWARD_ERROR

    raise RuntimeError(DOUBLE_BACKWARD_ERROR)


_indexer_loss_bwd.register_autograd(_no_loss_double_backward, setup_context=_no_setup)


#: The ops defined here, by name (``torch.ops.mla_kernels.<name>``).
OPS = {
    "sparse_mla_fwd": _sparse_mla_fwd,
    "attn_dist": _attn_dist,
    "sparse_mla_bwd": _sparse_mla_bwd,
    "sparse_mla_decode": _sparse_mla_decode,
    "merge_attn_partials": _merge_attn_partials,
    "indexer_logits": _indexer_logits,
    "indexer_topk": _indexer_topk,
    "indexer_loss_fwd": _indexer_loss_fwd,
    "indexer_loss_bwd": _indexer_loss_bwd,
}
