"""The validated, normalised description of one call, as every backend receives it.

``mla_kernels.api`` builds a :class:`Problem` from the user's tensors (all validation lives
there); backends read it and never re-validate.  Host-side only (plain torch).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Optional

import torch


@dataclass(frozen=True)
class Problem:
    """Normalised inputs of one sparse-MLA call.

    Tensors are contiguous and on one device:

    * ``q [s_q, h_q, d_qk]``;
    * ``kv [s_kv, d_qk]`` (the user's ``[s_kv, 1, d_qk]`` is viewed as 2-D; ``kv_shape`` keeps
      the original shape so that ``dkv`` can be returned in it);
    * ``indices [s_q, topk]`` int32 (int64 inputs converted; values outside ``[0, s_kv)``
      mapped to -1 so no int64 value can wrap onto a valid row);
    * ``topk_length [s_q]`` int32 clamped to ``[0, topk]``, or None;
    * ``attn_sink [h_q]`` float32 (float64 for float64 problems), or None.
    """

    q: torch.Tensor
    kv: torch.Tensor
    indices: torch.Tensor
    sm_scale: float
    d_v: int
    topk_length: Optional[torch.Tensor]
    attn_sink: Optional[torch.Tensor]
    kv_shape: torch.Size

    @property
    def s_q(self) -> int:
        return self.q.shape[0]

    @property
    def h_q(self) -> int:
        return self.q.shape[1]

    @property
    def d_qk(self) -> int:
        return self.q.shape[2]

    @property
    def s_kv(self) -> int:
        return self.kv.shape[0]

    @property
    def topk(self) -> int:
        return self.indices.shape[1]

    @cached_property
    def device(self) -> torch.device:  # (a tensor's .device builds a new object on every read)
        return self.q.device

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    def with_indices(self, indices: torch.Tensor) -> "Problem":
        """A copy with other indices (used to pad ``topk`` to a kernel's block)."""
        return replace(self, indices=indices)


@dataclass(frozen=True)
class MergeProblem:
    """What dispatch needs to pick a backend for ``merge_attn_partials``."""

    device: torch.device
    dtype: torch.dtype  # of the parts' outs
    out_dtype: torch.dtype
    d_v: int
    h_q: int


class _IndexerShapes:
    """The sizes and type of an indexer problem, read from its ``q [s_q, h, d]`` and ``k [s_kv, d]``."""

    @property
    def s_q(self) -> int:
        return self.q.shape[0]

    @property
    def h(self) -> int:
        return self.q.shape[1]

    @property
    def d(self) -> int:
        return self.q.shape[2]

    @property
    def s_kv(self) -> int:
        return self.k.shape[0]

    @cached_property
    def device(self) -> torch.device:  # (a tensor's .device builds a new object on every read)
        return self.q.device

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def is_fp8(self) -> bool:
        return self.q.dtype == torch.float8_e4m3fn


@dataclass(frozen=True)
class IndexerProblem(_IndexerShapes):
    """Normalised inputs of one indexer score / top-k call (contiguous, one device):

    * ``q [s_q, h_idx, d_idx]`` and ``k [s_kv, d_idx]`` in one dtype (bfloat16, float16, float32,
      float64 or float8_e4m3fn); ``k_shape`` is the caller's shape of ``k``;
    * ``weights [s_q, h_idx]`` float32 (float64 for float64 problems);
    * ``k_start``, ``k_end`` ``[s_q]`` int32, clamped to ``[0, s_kv]`` (the causal default filled in);
    * ``q_scale [s_q, h_idx]``, ``k_scale [s_kv]`` float32 for float8 inputs, else None;
    * ``causal``: the ranges are the causal default (neither ``k_start`` nor ``k_end`` given), so
      the host knows every row's length without reading them from the device.
    """

    q: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor
    sm_scale: float
    k_start: torch.Tensor
    k_end: torch.Tensor
    q_scale: Optional[torch.Tensor]
    k_scale: Optional[torch.Tensor]
    k_shape: torch.Size
    causal: bool = False


@dataclass(frozen=True)
class IndexerLossProblem(_IndexerShapes):
    """Normalised inputs of the indexer loss: ``q``, ``k``, ``weights`` as in
    :class:`IndexerProblem` except that ``weights`` keeps the caller's dtype (its gradient is
    returned in it); ``indices [s_q, topk]`` int32 (out-of-range values mapped to -1);
    ``target [s_q, topk]`` float32 (float64 for float64 problems), detached;
    ``topk_length [s_q]`` int32 clamped to ``[0, topk]`` or None."""

    q: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor
    target: torch.Tensor
    sm_scale: float
    topk_length: Optional[torch.Tensor]
    q_scale: Optional[torch.Tensor]
    k_scale: Optional[torch.Tensor]
    k_shape: torch.Size

    @property
    def topk(self) -> int:
        return self.indices.shape[1]
