"""The interface between ``mla_kernels.api``/``dispatch`` and a backend.

A backend is an object with the methods below.  The API validates and normalises the inputs
into a :class:`~mla_kernels.common.problem.Problem`, asks ``dispatch`` for a backend, pads
``topk`` to the backend's ``topk_block`` with invalid (-1) slots, and calls it.

Ops are named ``"fwd"``, ``"attn_dist"``, ``"bwd"``, ``"decode"`` (split-top-k decode on a
paged cache, driven by a :class:`~mla_kernels.decode.DecodePlan`) and ``"merge"`` (the lse merge
of partial results).  For ``decode`` and ``merge`` ``supports`` receives the plan / a
:class:`~mla_kernels.common.problem.MergeProblem` instead of a ``Problem``; for ``INDEXER_OPS``
(the lightning indexer) an :class:`~mla_kernels.common.problem.IndexerProblem` or
``IndexerLossProblem``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .problem import Problem

INDEXER_OPS = ("indexer_logits", "indexer_topk", "indexer_loss_fwd", "indexer_loss_bwd")
OPS = ("fwd", "attn_dist", "bwd", "decode", "merge") + INDEXER_OPS


class Backend:
    """Base class: a backend that supports nothing.  Subclasses override what they serve."""

    #: Name used by ``MLA_KERNELS_BACKEND`` and ``backend_for``.
    name: str = "none"
    #: The API pads ``topk`` with -1 slots to a multiple of this before calling the backend.
    topk_block: int = 1
    #: False for kernels proven only by compilation (no hardware run yet): dispatch then runs a
    #: first-use check against the reference for each new configuration
    #: (:mod:`mla_kernels.common.first_use`).
    hardware_verified: bool = True
    #: ``"module:attribute"`` from which a child process imports this backend to run its
    #: first-use check (None: the check runs in the calling process, unprotected from a hang).
    import_spec: Optional[str] = None

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        """None if this backend can run on ``device`` at all, else why not."""
        return "not implemented"

    def supports(self, op: str, p: Problem) -> Optional[str]:
        """None if this backend serves ``op`` for ``p``, else the reason it does not."""
        return f"{self.name} does not implement {op}"

    def config_key(self, op: str, p: Problem) -> tuple:
        """The static configuration a call compiles for (the first-use check's key)."""
        return (op, p.h_q, p.d_qk, p.d_v, p.dtype, p.topk_length is not None, p.attn_sink is not None)

    # -- ops -----------------------------------------------------------------------------------
    def fwd(self, p: Problem) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def attn_dist(self, p: Problem, lse: torch.Tensor, normalize: bool) -> torch.Tensor:
        raise NotImplementedError

    # -- the host fast path (``common/fastpath.py``) ---------------------------------------------
    def fwd_launcher(self, p: Problem):
        """A callable ``(q, kv, indices, topk_length, attn_sink) -> (out, max_logits, lse)`` that
        does what ``fwd(p)`` does for any problem whose tensors have ``p``'s shapes, dtypes and
        device (normalised as ``Problem`` holds them), or None if ``fwd`` needs more than that
        (the API then takes the full path for every such call).  Default: None."""
        return None

    def attn_dist_launcher(self, p: Problem, normalize: bool):
        """As :meth:`fwd_launcher` for ``attn_dist(p, lse, normalize)``: a callable
        ``(q, kv, indices, topk_length, lse) -> attn_sum``, or None."""
        return None

    def bwd_launcher(self, p: Problem, deterministic: bool, return_attn_sum: bool):
        """As :meth:`fwd_launcher` for ``bwd``: a callable ``(p2, out, dout, lse, dlse)`` doing
        ``bwd(p2, out, dout, lse, dlse=dlse, ...)`` with these flags for a ``p2`` with ``p``'s
        metadata (the API skips validation and dispatch for it), or None."""
        return None

    def bwd(
        self,
        p: Problem,
        out: torch.Tensor,
        dout: torch.Tensor,
        lse: torch.Tensor,
        *,
        dlse: Optional[torch.Tensor] = None,
        deterministic: bool = False,
        return_attn_sum: bool = False,
    ):
        raise NotImplementedError

    def prepare_decode(self, plan) -> None:
        """Called once when ``plan`` is made with this backend (compile, placeholders)."""

    def decode(self, plan, q, kv_cache, indices, sm_scale, topk_length, attn_sink, block_table, q_bias):
        """One decode step into ``plan``'s buffers: returns ``(out, lse)`` (+ ``max_logits`` with
        ``plan.with_max_logits``), views of the plan's buffers."""
        raise NotImplementedError

    def merge(self, outs: torch.Tensor, lses: torch.Tensor, attn_sink: Optional[torch.Tensor],
              out_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(out [R, h, d_v], lse [R, h])`` of ``n`` partials ``outs [n, R, h, d_v]``, ``lses [n, R, h]``
        (contiguous; ``R`` = the flattened leading dims), ``attn_sink [h]`` float32 or None."""
    # -- indexer ops (problems: common.problem.IndexerProblem / IndexerLossProblem) -------------
    def indexer_logits(self, p) -> torch.Tensor:
        """Dense scores ``[s_q, s_kv]`` float32, -inf outside each row's key range."""
        raise NotImplementedError

    def indexer_topk(self, p, topk: int, return_logits: bool):
        """``(indices [s_q, topk] int32, topk_length [s_q] int32[, logits [s_q, topk]])``."""
        raise NotImplementedError

    def indexer_loss_fwd(self, p):
        """``(loss [s_q], lse [s_q], inv_tsum [s_q])`` -- see ``reference.indexer_loss_fwd_ref``."""
        raise NotImplementedError

    def indexer_loss_bwd(self, p, grad_rows, lse, inv_tsum, deterministic: bool):
        """``(dq, dk, dweights)`` -- see ``reference.indexer_loss_bwd_ref``."""
        raise NotImplementedError
