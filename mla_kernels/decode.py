"""The decode plan: the split choice and every buffer one decode step needs (host only).

A :class:`DecodePlan` is made once per batch shape by :func:`mla_kernels.decode_plan` (which
validates its arguments) and passed to :func:`mla_kernels.sparse_mla_decode`; a call with a plan
then allocates nothing, never synchronises with the device and does only cheap shape checks, so
a decode step can be captured in a CUDA graph and replayed with new ``q`` / ``indices`` /
``topk_length`` / ``block_table`` contents.

**Split rule** (flash-decoding over the top-k; :func:`choose_splits`).  A CTA of the decode
kernels serves one (decode token, head block) "row" -- 64 heads for ``h_q % 64 == 0``, all
heads for ``h_q <= 32`` (heads on the MMA's N side).  With ``rows = b * s_q * head_blocks``:

* ``rows >= num_sms``: one split -- the CTAs fill the GPU; the kernel writes the bf16 output
  directly (no workspace, no combine);
* otherwise ``n = num_sms // rows`` splits (one wave), capped so that every split keeps at
  least ``MIN_BLOCKS_PER_SPLIT`` (2) blocks of 64 slots -- one per consumer warpgroup; then the
  blocks are dealt evenly: ``blocks_per_split = ceil(blocks / n)``, ``n = ceil(blocks /
  blocks_per_split)`` (no empty split for a full-length row).

Splits are static per plan (no per-step metadata kernel, which is what makes a plan
graph-capturable without refilling anything): a request whose ``topk_length`` is short leaves
its later splits empty (they exit after writing ``lse = +inf``) instead of rebalancing as
FlashMLA's scheduler does.  Each split writes a float32 partial (normalised by its own softmax
sum) and its lse; the lse combine (:mod:`mla_kernels.common.combine`) merges them and applies
the sink -- as a second kernel, or folded into the split kernel
(``MLA_KERNELS_DECODE_COMBINE=fused``: the last CTA of a row to finish merges that row, counted
in the plan's ``counters``; :mod:`mla_kernels.common.decode_device`), or -- the default for
64-head plans whose clusters all fit on the GPU at once, ``cluster`` on request for any 64-head
plan with 2/4/8/16 splits -- inside the split kernel by a thread-block cluster per row whose CTAs
stage their partials in shared memory and each merge a slice of the heads over DSMEM
(:mod:`mla_kernels.common.cluster_merge`; no float32 workspace then, ``out_parts`` is None).
Such a plan's CTAs hold 32 heads instead of 64 when its rows of 32 heads fit as clusters at once
(b 1 at h_q 64 / 128; ``MLA_KERNELS_DECODE_CLUSTER_ROWS``,
:func:`mla_kernels.common.decode_host.cluster_rows_for`): each CTA pulls half the bytes over
DSMEM, the split count stays.
The default (``auto``) rule, :func:`mla_kernels.common.decode_host.cluster_size_for`: clusters of
the plan's split count if ``rows`` of them fit (the driver's occupancy query; on an H200 7
clusters of 16, 15 of 8, 17 of 6, 30 of 4, 66 of 2), else a smaller cluster size (2..16) whose
``rows`` clusters fit, whose splits deal the blocks evenly and hold at most 8 blocks each (4 for
the narrow kernel), with the fewest block pairs per split, then the fewest CTAs -- e.g. b 2,
s_q 2, h_q 128 (8 rows): 8 splits in clusters of 8; b 16, h_q 64: 6 splits in clusters of 6
(``MLA_KERNELS_DECODE_RESPLIT=8`` restores the earlier rule: only 8 splits, only for 64 heads)
--, else the combine kernel (on an H200 at topk 2048: 16-26, 31-33 and 40-44 rows of the
narrow kernel, 31-33 and 40-44 rows of 64 heads; 34-39 rows run their 3 splits in clusters of
3).  A CTA of a cluster merges ``ceil(heads / n)`` heads (the last
ones fewer), or with more CTAs than heads (the narrow kernel's 8 heads over 16 CTAs) half of
one head's columns.  ``num_splits`` can be forced per plan (``auto`` then never changes it).

Outputs live in the plan: a call returns views of the plan's ``out`` and ``lse`` buffers, which
the next call with the same plan overwrites (clone them to keep a step's result).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, Optional, Tuple

import torch

__all__ = ["DecodePlan", "choose_splits", "MIN_BLOCKS_PER_SPLIT", "BLOCK", "NARROW_HEADS", "heads_per_cta"]

BLOCK = 64  # top-k slots per block
MIN_BLOCKS_PER_SPLIT = 2
NARROW_HEADS = (8, 16, 24, 32)  # heads on the MMA's N side: one CTA holds all of them
DEFAULT_NUM_SMS = 132  # an H100/H200 SXM; used when the device has no SM count (CPU)


def heads_per_cta(h_q: int) -> int:
    """Heads one decode CTA holds: all of them for ``h_q <= 32``, else 64."""
    return h_q if h_q in NARROW_HEADS else 64


def choose_splits(b: int, s_q: int, h_q: int, topk: int, num_sms: int) -> Tuple[int, int]:
    """``(num_splits, blocks_per_split)`` by the rule in the module docstring."""
    n_blocks = max(1, -(-topk // BLOCK))
    rows = b * s_q * max(1, -(-h_q // heads_per_cta(h_q)))
    if rows <= 0 or rows >= num_sms:
        return 1, n_blocks
    n = max(1, num_sms // rows)
    n = min(n, max(1, n_blocks // MIN_BLOCKS_PER_SPLIT))
    bps = -(-n_blocks // n)
    return -(-n_blocks // bps), bps


_SM_COUNTS: dict = {}


def device_sm_count(device: torch.device) -> int:
    """The SM count of ``device`` (:data:`DEFAULT_NUM_SMS` off the GPU), looked up once per device:
    the property query costs host time on every call's path."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    key = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNTS.get(key)
    if n is None:
        n = _SM_COUNTS[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


@dataclass(eq=False)
class DecodePlan:
    """Split choice, backend and buffers of one decode batch shape (see the module docstring).

    Attributes: the shape (``b``, ``s_q``, ``h_q``, ``topk``, ``d_qk``, ``d_v``), ``device``,
    ``dtype``, ``num_splits``, ``blocks_per_split``, ``backend`` (its name in
    ``backend_name``), ``with_max_logits``, and the buffers ``out [b, s_q, h_q, d_v]``,
    ``lse [b, s_q, h_q]`` (+ ``max_logits``), and with several splits ``out_parts [num_splits,
    b*s_q, h_q, d_v]`` / ``lse_parts [num_splits, b*s_q, h_q]`` float32 (+ ``max_logits_parts``).
    """

    b: int
    s_q: int
    h_q: int
    topk: int
    d_qk: int
    d_v: int
    device: torch.device
    dtype: torch.dtype
    num_splits: int
    blocks_per_split: int
    with_max_logits: bool = False
    backend: Any = None
    out: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None
    max_logits: Optional[torch.Tensor] = None
    out_parts: Optional[torch.Tensor] = None
    lse_parts: Optional[torch.Tensor] = None
    max_logits_parts: Optional[torch.Tensor] = None
    #: the fused combine's per-row arrival counters (int32, zero between launches; split plans made
    #: with ``MLA_KERNELS_DECODE_COMBINE=fused`` only)
    counters: Optional[torch.Tensor] = None
    #: the split count was forced (``decode_plan(num_splits=...)``): the ``auto`` combine rule then
    #: keeps it (it may otherwise lower it to merge the rows in 8-CTA clusters, ``common/decode_host``)
    forced_splits: bool = False
    #: backend-owned state (compiled kernels, placeholders, cached views)
    state: Dict[str, Any] = field(default_factory=dict)
    #: what the per-call check compares against (set by ``allocate``)
    fast: Any = None

    @property
    def backend_name(self) -> str:
        return getattr(self.backend, "name", "none")

    @property
    def q_shape(self) -> Tuple[int, int, int, int]:
        return (self.b, self.s_q, self.h_q, self.d_qk)

    @property
    def device_index(self) -> int:
        """``tensor.get_device()`` of tensors on the plan's device (-1 on the CPU)."""
        return -1 if self.device.type == "cpu" else (self.device.index or 0)

    @property
    def indices_shape(self) -> Tuple[int, int, int]:
        return (self.b, self.s_q, self.topk)

    @property
    def topk_length_shapes(self):
        return ((self.b,), (self.b, self.s_q))

    @property
    def sink_shape(self) -> Tuple[int]:
        return (self.h_q,)

    @property
    def bias_shape(self) -> Tuple[int, int, int]:
        return (self.b, self.h_q, self.d_qk)

    @property
    def split(self) -> bool:
        return self.num_splits > 1

    # attributes dispatch's ``supports`` reads (shared with Problem)
    @property
    def sm_scale(self) -> float:
        return 1.0

    @property
    def s_kv(self) -> int:
        return 0

    def allocate(self) -> None:
        """The plan's buffers (called once, when the plan is made), and the values the per-call
        check compares against (``fast``)."""
        dev, T = self.device, self.b * self.s_q
        self.fast = SimpleNamespace(
            dev=self.device_index, dtype=self.dtype, d_v=self.d_v, d_qk=self.d_qk, b=self.b,
            q_shape=torch.Size(self.q_shape), idx_shape=torch.Size(self.indices_shape),
            tl_shapes=tuple(torch.Size(s) for s in self.topk_length_shapes), sink_shape=torch.Size(self.sink_shape),
            sink_dtype=_lse_dtype(self.dtype), bias_shape=torch.Size(self.bias_shape),
            max_kv_numel=(2**31) * self.d_qk,
        )
        self.out = torch.zeros(self.b, self.s_q, self.h_q, self.d_v, dtype=self.dtype, device=dev)
        self.lse = torch.zeros(self.b, self.s_q, self.h_q, dtype=_lse_dtype(self.dtype), device=dev)
        if self.with_max_logits:
            self.max_logits = torch.zeros_like(self.lse)
        if self.split:
            n = self.num_splits
            self.out_parts = torch.zeros(n, T, self.h_q, self.d_v, dtype=torch.float32, device=dev)
            self.lse_parts = torch.zeros(n, T, self.h_q, dtype=torch.float32, device=dev)
            if self.with_max_logits:
                self.max_logits_parts = torch.zeros_like(self.lse_parts)

    def describe(self) -> str:
        return (f"DecodePlan(b={self.b}, s_q={self.s_q}, h_q={self.h_q}, topk={self.topk}, d_qk={self.d_qk}, "
                f"d_v={self.d_v}, num_splits={self.num_splits}, blocks_per_split={self.blocks_per_split}, "
                f"backend={self.backend_name}, device={self.device})")

    __repr__ = describe


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32
