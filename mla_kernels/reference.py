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
    "merge_attn_partials_ref",
    "decode_physical_indices",
    "sparse_mla_decode_ref",
    "decode_split_partials_ref",
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


@torch.no_grad()
def merge_attn_partials_ref(
    outs: torch.Tensor,
    lses: torch.Tensor,
    attn_sink: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge ``n`` partial results of one attention over disjoint parts of its keys.

    ``outs [n, ..., h, d_v]`` (each part normalised by its own softmax sum) and ``lses [n, ..., h]``
    (natural log; ``+inf`` marks an empty part, whose ``out`` is ignored).  With
    ``m = max_i lse_i`` and ``w_i = exp(lse_i - lse)``::

        lse = m + log(sum_i exp(lse_i - m))        out = sum_i w_i * out_i

    An all-empty row gives ``out = 0`` and ``lse = +inf``.  ``attn_sink [h]`` is applied once,
    after the merge, as in the forward: ``out *= exp(lse) / (exp(lse) + exp(sink))``, ``lse`` kept.
    Returns ``(out [..., h, d_v]`` in ``out_dtype`` (default ``outs.dtype``), ``lse [..., h]`` float32
    -- float64 when ``outs`` is float64).
    """
    cdt = compute_dtype(outs.dtype)
    x = lses.to(cdt)
    x = torch.where(torch.isposinf(x) | torch.isnan(x), torch.full_like(x, -math.inf), x)
    m = x.amax(dim=0) if x.shape[0] else torch.full(x.shape[1:], -math.inf, dtype=cdt, device=x.device)
    empty = torch.isneginf(m)
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    w = torch.exp(x - m_safe)  # 0 for empty parts
    s = w.sum(dim=0)
    lse = torch.where(empty, torch.full_like(m, math.inf), m_safe + torch.log(torch.where(empty, torch.ones_like(s), s)))
    wn = w / torch.where(empty, torch.ones_like(s), s)
    o = outs.to(cdt)
    # parts with weight 0 never contribute, whatever their out holds (0 * inf / nan would)
    contrib = torch.where(wn[..., None] > 0, wn[..., None] * o, torch.zeros_like(o))
    out = contrib.sum(dim=0)
    if attn_sink is not None:
        sink = attn_sink.to(cdt)
        out = out * torch.sigmoid(lse - sink)[..., None]
        out = torch.where(empty[..., None], torch.zeros_like(out), out)
    return out.to(out_dtype or outs.dtype), lse


def decode_physical_indices(
    indices: torch.Tensor,
    n_rows: int,
    page_size: int,
    block_table: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Physical rows of the flattened paged cache ``[num_pages * page_size, d]`` for decode
    ``indices [b, s_q, topk]``; -1 where the slot is invalid.

    Without ``block_table`` the indices already are physical ids (``page * page_size + offset``);
    values outside ``[0, n_rows)`` are invalid.  With ``block_table [b, max_pages]`` they are
    logical positions ``pos`` of sequence ``b``: the row is ``block_table[b, pos // page_size] *
    page_size + pos % page_size``; a negative ``pos``, ``pos // page_size >= max_pages`` or a
    page entry outside ``[0, num_pages)`` is invalid.
    """
    idx = indices.long()
    if block_table is None:
        ok = (idx >= 0) & (idx < n_rows)
        return torch.where(ok, idx, torch.full_like(idx, -1))
    b, max_pages = block_table.shape
    num_pages = n_rows // page_size if page_size else 0
    page_i = torch.div(idx.clamp_min(0), page_size, rounding_mode="floor")
    ok = (idx >= 0) & (page_i < max_pages)
    bt = block_table.long().to(idx.device)
    page = bt.gather(1, page_i.clamp(max=max(max_pages - 1, 0)).reshape(b, -1)).reshape(idx.shape)
    ok &= (page >= 0) & (page < num_pages)
    phys = page * page_size + idx.clamp_min(0) % page_size
    return torch.where(ok, phys, torch.full_like(idx, -1))


@torch.no_grad()
def sparse_mla_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    q_bias: Optional[torch.Tensor] = None,
    with_max_logits: bool = False,
):
    """Sparse MLA decode = the reference forward on the flattened decode tokens.

    ``q [b, s_q, h_q, d_qk]``; ``kv_cache [num_pages, page_size, 1, d_qk]`` (or a flat
    ``[n, d_qk]`` / ``[n, 1, d_qk]`` cache: one page of ``n`` rows); ``indices [b, s_q, topk]``
    (physical ids, or logical positions with ``block_table``, see :func:`decode_physical_indices`);
    ``topk_length [b]`` (per request) or ``[b, s_q]``; ``q_bias [b, h_q, d_qk]`` added to every
    query of request ``b`` before ``q.k`` (the sum rounded to q's dtype once).

    Returns ``(out [b, s_q, h_q, d_v]`` in q's dtype, ``lse [b, s_q, h_q])`` -- and ``max_logits``
    third with ``with_max_logits``.
    """
    b, s_q, h_q, d_qk = q.shape
    if kv_cache.dim() == 4:
        page_size = kv_cache.shape[1]
    else:
        page_size = kv_cache.shape[0]
    kv2 = kv_cache.reshape(-1, d_qk)
    phys = decode_physical_indices(indices, kv2.shape[0], page_size, block_table)
    cdt = compute_dtype(q.dtype)
    qf = q.to(cdt)
    if q_bias is not None:
        # q + q_bias in q's dtype (rounded once), as a caller adding it before the call would
        # get -- and as the kernels' fused Q load computes it
        qf = (qf + q_bias.to(cdt)[:, None]).to(q.dtype).to(cdt)
    tl = None
    if topk_length is not None:
        tl = topk_length.reshape(b, -1).expand(b, s_q).reshape(-1)
    out, ml, lse = sparse_mla_fwd_ref(
        qf.reshape(b * s_q, h_q, d_qk), kv2, phys.reshape(b * s_q, -1), sm_scale, d_v, tl, attn_sink,
    )
    res = (out.to(q.dtype).reshape(b, s_q, h_q, d_v), lse.reshape(b, s_q, h_q))
    if with_max_logits:
        res = res + (ml.reshape(b, s_q, h_q),)
    return res


@torch.no_grad()
def decode_split_partials_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    num_splits: int,
    blocks_per_split: int,
    topk_length: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    q_bias: Optional[torch.Tensor] = None,
    block: int = 64,
):
    """The split-top-k decode's partials: split ``i`` attends to slots ``[i * bps * block,
    (i + 1) * bps * block)`` (and ``< topk_length``) only.

    Returns ``(out_parts [n, b, s_q, h_q, d_v]`` float32 (float64 for float64 inputs), each part
    normalised by its own softmax sum and 0 when empty, ``lse_parts [n, b, s_q, h_q]`` (``+inf``
    when empty), ``max_logits_parts)``.  :func:`merge_attn_partials_ref` of them equals
    :func:`sparse_mla_decode_ref` up to rounding.
    """
    b, s_q, h_q, _ = q.shape
    topk = indices.shape[-1]
    cdt = compute_dtype(q.dtype)
    chunk = blocks_per_split * block
    outs, lses, mls = [], [], []
    for i in range(num_splits):
        lo = min(i * chunk, topk)
        hi = min(lo + chunk, topk)
        idx_i = indices[..., lo:hi]
        tl_i = None
        if topk_length is not None:
            tl_i = (topk_length.long() - lo).clamp(0, hi - lo)
        o, l_, m = sparse_mla_decode_ref(q.to(cdt), kv_cache, idx_i, sm_scale, d_v, tl_i, None, block_table,
                                         q_bias, with_max_logits=True)
        outs.append(o)
        lses.append(l_)
        mls.append(m)
    return torch.stack(outs), torch.stack(lses), torch.stack(mls)
