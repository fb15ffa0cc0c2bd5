"""Plain-PyTorch oracle for every op of the package.

This module is the reference every kernel is held to and the fallback backend on machines
without a supported GPU.  It imports only torch, runs on any device, accepts any sizes
(any ``h_q``, ``d_qk``, ``d_v <= d_qk``, ``topk``), and computes in float32 -- float64 when the
inputs are float64 -- chunked over ``s_q`` so that the DeepSeek-V3.2 headline shape
(s_q 4096, h_q 128, topk 2048, d_qk 576) fits on one GPU.

Conventions (the package's public conventions, see ``mla_kernels.api``):

* ``q [s_q, h_q, d_qk]``, ``kv [s_kv, d_qk]`` (a ``[s_kv, 1, d_qk]`` view is accepted),
  ``indices [s_q, topk]`` (``[s_q, 1, topk]`` accepted), V = ``kv[:, :d_v]``.
* Slot ``j`` of row ``i`` is *valid* iff ``0 <= indices[i, j] < s_kv`` and
  ``j < topk_length[i]`` (when given).  Invalid slots contribute nothing.  Duplicate indices
  count once per slot.
* ``P = q.k * sm_scale``; ``lse = logsumexp(P)`` and ``max_logits = max(P)`` in natural-log
  units; ``out = softmax(P) @ V``.
* ``attn_sink [h_q]`` scales ``out`` by ``exp(lse) / (exp(lse) + exp(sink))`` and leaves ``lse``
  untouched.
* A row with no valid slot: ``out = 0``, ``lse = +inf``, ``max_logits = -inf``,
  ``attn_sum = 0`` and zero gradients.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

__all__ = [
    "compute_dtype",
    "valid_mask",
    "sparse_mla_fwd_ref",
    "attn_dist_ref",
    "sparse_mla_bwd_ref",
    "effective_lse",
    "scatter_add_rows",
]

# Budget (bytes) for the per-chunk temporaries: gathered KV rows and the score matrices.
_CHUNK_BYTES = 512 * 1024 * 1024


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the reference computes in for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_2d_kv(kv: torch.Tensor) -> torch.Tensor:
    return kv.reshape(kv.shape[0], kv.shape[-1]) if kv.dim() == 3 else kv


def _as_2d_indices(indices: torch.Tensor) -> torch.Tensor:
    return indices.reshape(indices.shape[0], indices.shape[-1]) if indices.dim() == 3 else indices


def valid_mask(
    indices: torch.Tensor, s_kv: int, topk_length: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Boolean ``[s_q, topk]``: which slots take part (in range and below ``topk_length``)."""
    indices = _as_2d_indices(indices)
    valid = (indices >= 0) & (indices < s_kv)
    if topk_length is not None:
        slot = torch.arange(indices.shape[1], device=indices.device)
        valid &= slot[None, :] < topk_length.to(indices.device).reshape(-1, 1).long()
    return valid


def _chunk_rows(s_q: int, h_q: int, topk: int, d_qk: int, elem: int) -> int:
    per_row = topk * d_qk * elem * 2 + h_q * topk * elem * 4 + h_q * d_qk * elem * 4
    return max(1, min(s_q, _CHUNK_BYTES // max(per_row, 1)))


def _gather(kv2: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, cdt: torch.dtype):
    safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
    if kv2.shape[0] == 0:  # no kv rows at all: every slot is invalid
        return torch.zeros(*idx.shape, kv2.shape[-1], dtype=cdt, device=kv2.device), safe
    rows = kv2.index_select(0, safe.reshape(-1)).reshape(*idx.shape, kv2.shape[-1]).to(cdt)
    # Invalid slots read row 0; zero them so no stray value (inf/nan) can leak through 0 * x.
    return rows * valid[..., None].to(cdt), safe


def scatter_add_rows(dst: torch.Tensor, rows: torch.Tensor, vals: torch.Tensor, deterministic: bool) -> None:
    """``dst[rows[i]] += vals[i]``.  With ``deterministic`` the additions happen in rounds in
    which every target row is hit at most once (rank of each contribution within its row, in
    slot order), so the result is bitwise reproducible on CUDA too, where a plain ``index_add_``
    races float atomics."""
    if not deterministic or rows.numel() == 0:
        dst.index_add_(0, rows, vals)
        return
    order = torch.argsort(rows, stable=True)
    r, v = rows[order], vals[order]
    pos = torch.arange(r.numel(), device=r.device)
    first = torch.ones_like(r, dtype=torch.bool)
    first[1:] = r[1:] != r[:-1]
    rank = pos - torch.cummax(torch.where(first, pos, torch.zeros_like(pos)), dim=0).values
    for k in range(int(rank.max().item()) + 1):
        sel = rank == k
        dst.index_add_(0, r[sel], v[sel])


def _check_scale(sm_scale) -> None:
    # The kernels fold a positive scale into exp2; the oracle holds every path to the same rule.
    if not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a finite number > 0, got {sm_scale!r}")


def effective_lse(lse: torch.Tensor, attn_sink: Optional[torch.Tensor]) -> torch.Tensor:
    """``log(exp(lse) + exp(sink))`` per ``[s_q, h_q]``: the normaliser that ``out`` really uses.

    Without a sink this is ``lse``.  Rows with ``lse = +inf`` (empty) stay ``+inf`` so that every
    probability of an empty row is exactly 0.
    """
    if attn_sink is None:
        return lse
    sink = attn_sink.to(lse.dtype).reshape(1, -1).expand_as(lse)
    out = torch.logaddexp(lse, sink)
    return torch.where(torch.isposinf(lse), lse, out)


@torch.no_grad()
def sparse_mla_fwd_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA forward.  Returns ``(out [s_q,h_q,d_v] in q's dtype, max_logits, lse)``.

    ``max_logits`` and ``lse`` are ``[s_q, h_q]`` in float32 (float64 for float64 inputs).
    """
    _check_scale(sm_scale)
    kv2 = _as_2d_kv(kv)
    idx2 = _as_2d_indices(indices)
    s_q, h_q, d_qk = q.shape
    s_kv, topk = kv2.shape[0], idx2.shape[1]
    cdt = compute_dtype(q.dtype)
    out = torch.zeros(s_q, h_q, d_v, dtype=q.dtype, device=q.device)
    max_logits = torch.full((s_q, h_q), -math.inf, dtype=cdt, device=q.device)
    lse = torch.full((s_q, h_q), math.inf, dtype=cdt, device=q.device)
    if s_q == 0 or topk == 0:
        return out, max_logits, lse
    valid = valid_mask(idx2, s_kv, topk_length)
    step = _chunk_rows(s_q, h_q, topk, d_qk, torch.finfo(cdt).bits // 8)
    for c0 in range(0, s_q, step):
        c1 = min(s_q, c0 + step)
        vld = valid[c0:c1]
        rows, _ = _gather(kv2, idx2[c0:c1], vld, cdt)  # [c, topk, d_qk]
        qc = q[c0:c1].to(cdt)
        s = torch.einsum("chd,ctd->cht", qc, rows) * sm_scale
        s = s.masked_fill(~vld[:, None, :], -math.inf)
        m = s.amax(dim=-1)  # -inf on empty rows
        l_ = torch.logsumexp(s, dim=-1)  # -inf on empty rows
        empty = ~vld.any(dim=-1)[:, None].expand_as(l_)
        l_ = torch.where(empty, torch.full_like(l_, math.inf), l_)
        p = torch.exp(s - l_[..., None])  # exact zeros on invalid slots and empty rows
        o = torch.einsum("cht,ctd->chd", p, rows[..., :d_v])
        if attn_sink is not None:
            sink = attn_sink.to(cdt).reshape(1, h_q)
            o = o * torch.sigmoid(l_ - sink)[..., None]  # exp(l) / (exp(l) + exp(sink))
            o = torch.where(empty[..., None], torch.zeros_like(o), o)
        out[c0:c1] = o.to(q.dtype)
        max_logits[c0:c1] = m
        lse[c0:c1] = l_
    return out, max_logits, lse


@torch.no_grad()
def attn_dist_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    topk_length: Optional[torch.Tensor] = None,
    normalize: bool = False,
) -> torch.Tensor:
    """``attn_sum[i, j] = sum_h exp(q_i,h . k_idx[i,j] * sm_scale - lse[i,h])`` (``[s_q, topk]``).

    Invalid slots and empty rows give 0; ``lse = +inf`` contributes 0.  With ``normalize`` each
    row is divided by its sum (rows summing to 0 stay 0).  float32 (float64 for float64 inputs).
    """
    _check_scale(sm_scale)
    kv2 = _as_2d_kv(kv)
    idx2 = _as_2d_indices(indices)
    s_q, h_q, d_qk = q.shape
    s_kv, topk = kv2.shape[0], idx2.shape[1]
    cdt = compute_dtype(q.dtype)
    res = torch.zeros(s_q, topk, dtype=cdt, device=q.device)
    if s_q == 0 or topk == 0:
        return res
    valid = valid_mask(idx2, s_kv, topk_length)
    step = _chunk_rows(s_q, h_q, topk, d_qk, torch.finfo(cdt).bits // 8)
    for c0 in range(0, s_q, step):
        c1 = min(s_q, c0 + step)
        vld = valid[c0:c1]
        rows, _ = _gather(kv2, idx2[c0:c1], vld, cdt)
        s = torch.einsum("chd,ctd->cht", q[c0:c1].to(cdt), rows) * sm_scale
        p = torch.exp(s - lse[c0:c1].to(cdt)[..., None])
        p = torch.where(vld[:, None, :], p, torch.zeros_like(p))
        res[c0:c1] = p.sum(dim=1)
    if normalize:
        tot = res.sum(dim=-1, keepdim=True)
        res = torch.where(tot > 0, res / torch.where(tot > 0, tot, torch.ones_like(tot)), res)
    return res


@torch.no_grad()
def sparse_mla_bwd_ref(
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
    dlse: Optional[torch.Tensor] = None,
    return_attn_sum: bool = False,
    deterministic: bool = False,
):
    """Sparse MLA backward, written out (not autograd through the forward).

    With ``P~ = exp(s - lse')`` where ``lse' = log(exp(lse) + exp(sink))`` (``= lse`` without a
    sink) and ``delta = rowsum(out * dout)``:

    * ``dP = dout @ V^T``;  ``dS = P~ * (dP - delta')`` with ``delta' = delta - dlse * exp(lse' - lse)``
      (the ``dlse`` term is the gradient flowing into the returned ``lse``);
    * ``dq = sm_scale * dS @ K``;
    * ``dkv[idx] += sm_scale * dS^T @ q`` (all ``d_qk`` columns) ``+ P~^T @ dout`` (first ``d_v``),
      scatter-added over every valid slot (duplicates and rows shared by many queries add up);
    * ``d_attn_sink[h] = -sum_i exp(sink_h - lse'_ih) * delta_ih``.

    ``deterministic`` makes the dkv scatter bitwise reproducible on every device
    (:func:`scatter_add_rows`).

    Returns ``(dq, dkv, d_attn_sink)`` -- ``dkv`` with ``kv``'s shape, ``d_attn_sink`` None
    without a sink -- and, with ``return_attn_sum``, a fourth item ``attn_sum [s_q, topk]``
    (``sum_h exp(s - lse)``, the attention-distribution target).
    """
    _check_scale(sm_scale)
    kv_shape = kv.shape
    kv2 = _as_2d_kv(kv)
    idx2 = _as_2d_indices(indices)
    s_q, h_q, d_qk = q.shape
    s_kv, topk = kv2.shape[0], idx2.shape[1]
    cdt = compute_dtype(q.dtype)
    dq = torch.zeros(s_q, h_q, d_qk, dtype=cdt, device=q.device)
    dkv = torch.zeros(s_kv, d_qk, dtype=cdt, device=q.device)
    d_sink = None
    attn_sum = torch.zeros(s_q, topk, dtype=cdt, device=q.device) if return_attn_sum else None
    lse_c = lse.to(cdt)
    lse_eff = effective_lse(lse_c, attn_sink)
    delta = (out.to(cdt) * dout.to(cdt)).sum(dim=-1)  # [s_q, h_q]
    if attn_sink is not None:
        sink = attn_sink.to(cdt).reshape(1, h_q)
        p_sink = torch.exp(sink - lse_eff)  # 0 on empty rows (lse' = +inf)
        d_sink = -(p_sink * delta).sum(dim=0)
    delta_eff = delta
    if dlse is not None:
        ratio = torch.exp(lse_eff - lse_c)
        ratio = torch.where(torch.isposinf(lse_c), torch.ones_like(ratio), ratio)
        delta_eff = delta - dlse.to(cdt) * ratio
    if s_q > 0 and topk > 0:
        valid = valid_mask(idx2, s_kv, topk_length)
        step = _chunk_rows(s_q, h_q, topk, d_qk, torch.finfo(cdt).bits // 8)
        for c0 in range(0, s_q, step):
            c1 = min(s_q, c0 + step)
            vld = valid[c0:c1]
            rows, safe = _gather(kv2, idx2[c0:c1], vld, cdt)
            qc = q[c0:c1].to(cdt)
            doc = dout[c0:c1].to(cdt)
            s = torch.einsum("chd,ctd->cht", qc, rows) * sm_scale
            p = torch.exp(s - lse_eff[c0:c1, :, None])
            p = torch.where(vld[:, None, :], p, torch.zeros_like(p))
            dp = torch.einsum("chd,ctd->cht", doc, rows[..., :d_v])
            ds = p * (dp - delta_eff[c0:c1, :, None]) * sm_scale
            dq[c0:c1] = torch.einsum("cht,ctd->chd", ds, rows)
            dk_slot = torch.einsum("cht,chd->ctd", ds, qc)
            dk_slot[..., :d_v] += torch.einsum("cht,chd->ctd", p, doc)
            sel = vld.reshape(-1)
            scatter_add_rows(dkv, safe.reshape(-1)[sel], dk_slot.reshape(-1, d_qk)[sel], deterministic)
            if return_attn_sum:
                pl = torch.exp(s - lse_c[c0:c1, :, None])
                pl = torch.where(vld[:, None, :], pl, torch.zeros_like(pl))
                attn_sum[c0:c1] = pl.sum(dim=1)
    res = (dq.to(q.dtype), dkv.to(kv.dtype).reshape(kv_shape), d_sink)
    if return_attn_sum:
        return res + (attn_sum,)
    return res
