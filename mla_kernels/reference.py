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
# ---------------------------------------------------------------------------------------------
# The lightning indexer (the other half of a DSA layer)
# ---------------------------------------------------------------------------------------------
#
# ``q_idx [s_q, h_idx, d_idx]``, ``k_idx [s_kv, d_idx]`` (``[s_kv, 1, d_idx]`` accepted),
# ``weights [s_q, h_idx]``:
#
#     I[t, s] = sm_scale * sum_j weights[t, j] * ReLU(q_idx[t, j] . k_idx[s])
#
# float8_e4m3fn inputs come with float32 dequantisation scales ``q_scale [s_q, h_idx]`` and
# ``k_scale [s_kv]``: q = q8 * q_scale, k = k8 * k_scale (the reference dequantises first).
# Key range of query t: ``k_start[t] <= s < k_end[t]`` (both clamped to [0, s_kv]); default
# causal aligned to the end: k_start = 0, k_end[t] = s_kv - s_q + t + 1.  Scores that are NaN
# rank as -inf (below every number) in the top-k.

__all__ += [
    "indexer_ranges",
    "indexer_logits_ref",
    "indexer_topk_ref",
    "indexer_loss_fwd_ref",
    "indexer_loss_bwd_ref",
    "indexer_loss_ref",
]


def indexer_ranges(s_q: int, s_kv: int, k_start: Optional[torch.Tensor], k_end: Optional[torch.Tensor],
                   device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(start, end)`` int64 ``[s_q]``, clamped to ``[0, s_kv]`` (the causal default where None)."""
    t = torch.arange(s_q, device=device, dtype=torch.int64)
    start = torch.zeros(s_q, dtype=torch.int64, device=device) if k_start is None else k_start.to(device).long()
    end = (s_kv - s_q + t + 1) if k_end is None else k_end.to(device).long()
    return start.clamp(0, s_kv), end.clamp(0, s_kv)


def _dequant(x: torch.Tensor, scale: Optional[torch.Tensor], cdt: torch.dtype) -> torch.Tensor:
    x = x.to(cdt)
    if scale is not None:
        x = x * scale.to(cdt).reshape(*scale.shape, *([1] * (x.dim() - scale.dim())))
    return x


def _indexer_chunk(s_q: int, h: int, n_keys: int, elem: int) -> int:
    per_row = max(1, h * n_keys * elem * 3 + n_keys * 24)
    return max(1, min(max(s_q, 1), _CHUNK_BYTES // per_row))


def _scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """``sm_scale * sum_h w[c, h] relu(q[c, h] . k[n])`` -> ``[c, n]`` (all in the compute dtype)."""
    a = torch.einsum("chd,nd->chn", q, k).clamp_min_(0)
    return torch.einsum("chn,ch->cn", a, w) * sm_scale


@torch.no_grad()
def indexer_logits_ref(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    sm_scale: float = 1.0,
    k_start: Optional[torch.Tensor] = None,
    k_end: Optional[torch.Tensor] = None,
    q_scale: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The dense indexer scores ``[s_q, s_kv]`` (float32; float64 for float64 inputs), ``-inf``
    outside each row's key range."""
    s_q, h, _ = q_idx.shape
    k2 = _as_2d_kv(k_idx)
    s_kv = k2.shape[0]
    cdt = compute_dtype(q_idx.dtype)
    out = torch.full((s_q, s_kv), -math.inf, dtype=cdt, device=q_idx.device)
    if s_q == 0 or s_kv == 0:
        return out
    start, end = indexer_ranges(s_q, s_kv, k_start, k_end, q_idx.device)
    kd = _dequant(k2, None if k_scale is None else k_scale.reshape(-1), cdt)
    col = torch.arange(s_kv, device=q_idx.device)
    step = _indexer_chunk(s_q, h, s_kv, torch.finfo(cdt).bits // 8)
    for c0 in range(0, s_q, step):
        c1 = min(s_q, c0 + step)
        qc = _dequant(q_idx[c0:c1], None if q_scale is None else q_scale[c0:c1], cdt)
        s = _scores(qc, kd, weights[c0:c1].to(cdt), sm_scale)
        inr = (col[None, :] >= start[c0:c1, None]) & (col[None, :] < end[c0:c1, None])
        out[c0:c1] = torch.where(inr, s, torch.full_like(s, -math.inf))
    return out


@torch.no_grad()
def indexer_topk_ref(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    sm_scale: float = 1.0,
    k_start: Optional[torch.Tensor] = None,
    k_end: Optional[torch.Tensor] = None,
    q_scale: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    return_logits: bool = False,
):
    """Exact top-k of the indexer scores per row, over the row's key range.

    The ``topk`` keys of largest score; equal scores go to the smaller key index (so the set is
    exact and deterministic); NaN ranks as -inf; a row with fewer keys in range takes them all.
    Rows are processed in chunks sized so that ``[s_q, s_kv]`` is never held whole.

    Returns ``(indices [s_q, topk] int32`` -- the chosen keys in ascending order, then -1 --,
    ``topk_length [s_q] int32``) and, with ``return_logits``, ``logits [s_q, topk]`` (float32;
    float64 for float64 inputs) of the returned slots, -inf at -1.
    """
    s_q, h, _ = q_idx.shape
    k2 = _as_2d_kv(k_idx)
    s_kv = k2.shape[0]
    dev = q_idx.device
    cdt = compute_dtype(q_idx.dtype)
    indices = torch.full((s_q, topk), -1, dtype=torch.int32, device=dev)
    length = torch.zeros(s_q, dtype=torch.int32, device=dev)
    logits = torch.full((s_q, topk), -math.inf, dtype=cdt, device=dev) if return_logits else None
    if s_q == 0 or s_kv == 0:
        return (indices, length, logits) if return_logits else (indices, length)
    start, end = indexer_ranges(s_q, s_kv, k_start, k_end, dev)
    kd = _dequant(k2, None if k_scale is None else k_scale.reshape(-1), cdt)
    col = torch.arange(s_kv, device=dev)
    slot = torch.arange(topk, device=dev)
    step = _indexer_chunk(s_q, h, s_kv, torch.finfo(cdt).bits // 8)
    for c0 in range(0, s_q, step):
        c1 = min(s_q, c0 + step)
        qc = _dequant(q_idx[c0:c1], None if q_scale is None else q_scale[c0:c1], cdt)
        s = _scores(qc, kd, weights[c0:c1].to(cdt), sm_scale)
        s = torch.nan_to_num(s, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
        inr = (col[None, :] >= start[c0:c1, None]) & (col[None, :] < end[c0:c1, None])
        # Lexicographic (in range, score, -index) by two stable sorts: score first, then range.
        order = torch.sort(s, dim=1, descending=True, stable=True).indices
        by_range = torch.sort(inr.gather(1, order).to(torch.int8), dim=1, descending=True, stable=True).indices
        order = order.gather(1, by_range)[:, : min(topk, s_kv)]
        n = (end[c0:c1] - start[c0:c1]).clamp_min(0).clamp_max(topk)
        keep = slot[None, : order.shape[1]] < n[:, None]
        chosen = torch.where(keep, order, torch.full_like(order, s_kv))  # s_kv sorts last
        chosen = torch.sort(chosen, dim=1).values
        ok = chosen < s_kv
        idx_c = torch.where(ok, chosen, torch.full_like(chosen, -1))
        indices[c0:c1, : idx_c.shape[1]] = idx_c.to(torch.int32)
        length[c0:c1] = n.to(torch.int32)
        if return_logits:
            vals = s.gather(1, chosen.clamp_max(s_kv - 1))
            logits[c0:c1, : idx_c.shape[1]] = torch.where(ok, vals, torch.full_like(vals, -math.inf))
    return (indices, length, logits) if return_logits else (indices, length)


def _loss_valid(indices: torch.Tensor, s_kv: int, topk_length: Optional[torch.Tensor]) -> torch.Tensor:
    return valid_mask(indices, s_kv, topk_length)


def _selected_scores(q, k2, w, idx, vld, sm_scale, cdt, q_scale=None, k_scale=None):
    """``(a [c, h, topk] = q . k_sel, I [c, topk], k_sel [c, topk, d])`` of one chunk of rows."""
    qc = _dequant(q, q_scale, cdt)
    safe = torch.where(vld, idx, torch.zeros_like(idx)).long()
    ksel = k2.index_select(0, safe.reshape(-1)).reshape(*idx.shape, k2.shape[-1])
    ks = None if k_scale is None else k_scale.reshape(-1).index_select(0, safe.reshape(-1)).reshape(idx.shape)
    ksel = _dequant(ksel, ks, cdt) * vld[..., None].to(cdt)
    a = torch.einsum("chd,ctd->cht", qc, ksel)
    logit = torch.einsum("cht,ch->ct", a.clamp_min(0), w.to(cdt)) * sm_scale
    return a, logit, ksel, qc


@torch.no_grad()
def indexer_loss_fwd_ref(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    target: torch.Tensor,
    sm_scale: float = 1.0,
    topk_length: Optional[torch.Tensor] = None,
    q_scale: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
):
    """The indexer's KL loss per row, ``(loss [s_q], lse [s_q], inv_tsum [s_q])``.

    Per row t over its valid slots j (``0 <= indices < s_kv`` and ``j < topk_length``):
    ``I_tj`` the indexer score of key ``indices[t, j]``; ``p = target / sum(target)``;
    ``pi = softmax(I)``; ``loss_t = sum_j p (log p - log pi)`` with ``0 log 0 = 0``.  A row with
    no valid slot or a zero target sum gives 0 (and ``inv_tsum = 0``, which makes its gradient 0).
    ``lse`` is the natural-log ``logsumexp`` of the valid ``I`` (0 on inactive rows): with
    ``inv_tsum`` it is what the backward needs.  Compute dtype float32 (float64 for float64).
    """
    s_q, h, _ = q_idx.shape
    k2 = _as_2d_kv(k_idx)
    idx2 = _as_2d_indices(indices)
    s_kv, topk = k2.shape[0], idx2.shape[1]
    cdt = compute_dtype(q_idx.dtype)
    dev = q_idx.device
    loss = torch.zeros(s_q, dtype=cdt, device=dev)
    lse = torch.zeros(s_q, dtype=cdt, device=dev)
    inv_tsum = torch.zeros(s_q, dtype=cdt, device=dev)
    if s_q == 0 or topk == 0 or s_kv == 0:
        return loss, lse, inv_tsum
    valid = _loss_valid(idx2, s_kv, topk_length)
    step = _indexer_chunk(s_q, h, topk, torch.finfo(cdt).bits // 8)
    for c0 in range(0, s_q, step):
        c1 = min(s_q, c0 + step)
        vld = valid[c0:c1]
        _, logit, _, _ = _selected_scores(
            q_idx[c0:c1], k2, weights[c0:c1], idx2[c0:c1], vld, sm_scale, cdt,
            None if q_scale is None else q_scale[c0:c1], k_scale,
        )
        tgt = torch.where(vld, target[c0:c1].to(cdt), torch.zeros((), dtype=cdt, device=dev))
        tsum = tgt.sum(dim=1)
        active = vld.any(dim=1) & (tsum > 0)
        inv = torch.where(active, 1.0 / torch.where(active, tsum, torch.ones_like(tsum)), torch.zeros_like(tsum))
        p = tgt * inv[:, None]
        masked = logit.masked_fill(~vld, -math.inf)
        l_ = torch.logsumexp(masked, dim=1)
        l_ = torch.where(active, l_, torch.zeros_like(l_))
        logp = torch.log(torch.where(p > 0, p, torch.ones_like(p)))
        logpi = torch.where(vld, logit - l_[:, None], torch.zeros_like(logit))
        term = torch.where(p > 0, p * (logp - logpi), torch.zeros_like(p))
        loss[c0:c1] = torch.where(active, term.sum(dim=1), torch.zeros_like(tsum))
        lse[c0:c1] = l_
        inv_tsum[c0:c1] = inv
    return loss, lse, inv_tsum


@torch.no_grad()
def indexer_loss_bwd_ref(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    target: torch.Tensor,
    grad_rows: torch.Tensor,
    lse: torch.Tensor,
    inv_tsum: torch.Tensor,
    sm_scale: float = 1.0,
    topk_length: Optional[torch.Tensor] = None,
    deterministic: bool = False,
):
    """Gradients of ``sum_t grad_rows[t] * loss_t`` (:func:`indexer_loss_fwd_ref`'s loss) with
    respect to ``q_idx``, ``k_idx`` and ``weights``, written out:

    * ``dI_tj = (pi_tj - p_tj) * g_t`` on valid slots of active rows (``inv_tsum > 0``), where
      ``pi = exp(I - lse)`` and ``p = target * inv_tsum``;
    * with ``a_thj = q_th . k_j`` and ``m = [a > 0]`` (ReLU' = 1 where the product is > 0):
      ``dweights_th = sm_scale sum_j dI_tj relu(a_thj)``,
      ``dq_th = sm_scale sum_j dI_tj w_th m_thj k_j``,
      ``dk[indices_tj] += sm_scale dI_tj sum_h w_th m_thj q_th`` (scatter-added over every valid
      slot; ``deterministic`` makes the scatter bitwise reproducible on CUDA too).

    Returns ``(dq, dk, dweights)`` in the inputs' dtypes and shapes.
    """
    k_shape = k_idx.shape
    s_q, h, d = q_idx.shape
    k2 = _as_2d_kv(k_idx)
    idx2 = _as_2d_indices(indices)
    s_kv, topk = k2.shape[0], idx2.shape[1]
    cdt = compute_dtype(q_idx.dtype)
    dev = q_idx.device
    dq = torch.zeros(s_q, h, d, dtype=cdt, device=dev)
    dk = torch.zeros(s_kv, d, dtype=cdt, device=dev)
    dw = torch.zeros(s_q, h, dtype=cdt, device=dev)
    if s_q > 0 and topk > 0 and s_kv > 0:
        valid = _loss_valid(idx2, s_kv, topk_length)
        g_all = grad_rows.to(cdt) * (inv_tsum.to(cdt) > 0).to(cdt)
        step = _indexer_chunk(s_q, h, topk, torch.finfo(cdt).bits // 8)
        for c0 in range(0, s_q, step):
            c1 = min(s_q, c0 + step)
            vld = valid[c0:c1]
            w = weights[c0:c1].to(cdt)
            a, logit, ksel, qc = _selected_scores(q_idx[c0:c1], k2, w, idx2[c0:c1], vld, sm_scale, cdt)
            # inactive rows (no valid slot, zero target sum) get no gradient: their pi is not formed
            # (their lse is 0, and exp(logit) of a large logit would be inf, inf * 0 = NaN)
            act = vld & (inv_tsum[c0:c1] > 0)[:, None]
            pi = torch.where(act, torch.exp(logit - lse[c0:c1].to(cdt)[:, None]), torch.zeros_like(logit))
            p = torch.where(vld, target[c0:c1].to(cdt) * inv_tsum[c0:c1].to(cdt)[:, None], torch.zeros_like(logit))
            d_i = (pi - p) * g_all[c0:c1, None]
            dw[c0:c1] = torch.einsum("ct,cht->ch", d_i, a.clamp_min(0)) * sm_scale
            ds = (d_i[:, None, :] * w[:, :, None] * (a > 0).to(cdt)) * sm_scale  # [c, h, topk]
            dq[c0:c1] = torch.einsum("cht,ctd->chd", ds, ksel)
            dk_slot = torch.einsum("cht,chd->ctd", ds, qc)
            safe = torch.where(vld, idx2[c0:c1], torch.zeros_like(idx2[c0:c1])).long()
            sel = vld.reshape(-1)
            scatter_add_rows(dk, safe.reshape(-1)[sel], dk_slot.reshape(-1, d)[sel], deterministic)
    return dq.to(q_idx.dtype), dk.to(k_idx.dtype).reshape(k_shape), dw.to(weights.dtype)


def indexer_loss_ref(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    target: torch.Tensor,
    sm_scale: float = 1.0,
    topk_length: Optional[torch.Tensor] = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """The indexer KL loss by plain autograd-able torch ops (an independent check of the
    written-out forward/backward above; small problems only).  Differentiable in ``q_idx``,
    ``k_idx`` and ``weights``; ``target`` is a constant."""
    s_q, h, _ = q_idx.shape
    k2 = _as_2d_kv(k_idx)
    idx2 = _as_2d_indices(indices)
    s_kv, topk = k2.shape[0], idx2.shape[1]
    cdt = compute_dtype(q_idx.dtype)
    valid = _loss_valid(idx2, s_kv, topk_length)
    safe = torch.where(valid, idx2, torch.zeros_like(idx2)).long()
    ksel = k2.to(cdt)[safe.reshape(-1)].reshape(s_q, topk, -1) * valid[..., None].to(cdt)
    a = torch.einsum("chd,ctd->cht", q_idx.to(cdt), ksel)
    logit = torch.einsum("cht,ch->ct", torch.relu(a), weights.to(cdt)) * sm_scale
    tgt = torch.where(valid, target.detach().to(cdt), torch.zeros((), dtype=cdt))
    tsum = tgt.sum(dim=1)
    active = valid.any(dim=1) & (tsum > 0)
    p = tgt / torch.where(active, tsum, torch.ones_like(tsum))[:, None]
    masked = logit.masked_fill(~valid, -math.inf)
    lse = torch.logsumexp(torch.where(active[:, None], masked, torch.zeros_like(masked)), dim=1)
    logpi = torch.where(valid, logit - lse[:, None], torch.zeros_like(logit))
    logp = torch.log(torch.where(p > 0, p, torch.ones_like(p)))
    rows = torch.where(p > 0, p * (logp - logpi), torch.zeros_like(p)).sum(dim=1)
    rows = torch.where(active, rows, torch.zeros_like(rows))
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / max(s_q, 1)
