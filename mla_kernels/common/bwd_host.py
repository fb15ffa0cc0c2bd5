"""Host side of the sparse backward kernels (``sm90/bwd.py``, ``sm100/bwd.py``): per-row terms,
launch, dKV conversion, and the deterministic mode's fixed-order reduction.  Arch-agnostic: the
backend passes its ``compile_bwd`` in (both kernels take the same arguments in the same order, 64
heads per CTA).

Per-row terms (float32, ``[s_q, h_q]``), with ``lse' = log(exp(lse) + exp(sink))`` (``= lse``
without a sink; ``+inf`` on empty rows):

* ``lse2 = log2(e) * lse'`` -- the kernel computes ``P = exp2(S * sm_scale * log2(e) - lse2)``;
* ``delta = rowsum(out * dout)`` is computed *in* the kernel (and returned for d_attn_sink); the
  host only supplies the correction ``dlse * exp(lse' - lse)`` when the returned ``lse`` carries a
  gradient, so that the kernel's ``dS = P (dP - delta')`` uses ``delta' = delta - correction``;
* ``exp(lse' - lse)`` -- only with a sink and ``return_attn_sum``: ``attn_sum`` is normalised by
  ``lse`` (not ``lse'``), so the kernel sums ``P * exp(lse' - lse)``;
* ``d_attn_sink[h] = -sum_i exp(sink_h - lse'_ih) * rowsum(out * dout)_ih``.

dKV: the default kernel adds every slot's row into a float32 ``[s_kv, d_qk]`` workspace with
16-byte float atomics (fast; the order of additions, hence the last bits, varies from run to run);
one strided copy converts it to bfloat16 and undoes the kernel's column order within 16-column
groups when the kernel declares one, ``ws_col_perm`` (:func:`natural_columns`).  ``deterministic=True`` runs the same kernel writing each
(token, head block, slot) row to its own workspace row instead (head block: 64 heads, or 128 for a
kernel whose ``ws_row_heads`` says so -- the sm100 2-CTA kernel; float32 rows, or bfloat16 for a
kernel whose ``det_ws_dtype`` says so -- the sm90 kernel: each contribution rounded to bf16 once,
the fixed-order sum in float32, half the traffic) (no atomics), in waves of tokens
bounded by :data:`DET_WORKSPACE_BYTES`; the rows are then summed per kv row in a fixed order
(stable sort by kv index, then :class:`~mla_kernels.common.segment_sum.SegmentSum`: one CTA per
kv row adding its rows in sorted order) and added to the float32 accumulator wave by wave.  Its
cost is the workspace traffic: ``n_head_blocks * topk * d_qk * 4`` bytes per token written once
and read once.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _compile
from . import fastpath, host
from .order_host import kv_ordered, rotate_shift_knob, sort_enabled
from .problem import Problem
from ..reference import effective_lse, valid_mask

LOG2E = math.log2(math.e)
B_H = 64
#: Upper bound of the deterministic mode's per-wave workspace (the wave's slot rows, float32 or --
#: for a kernel whose ``det_ws_dtype`` says so, the sm90 one -- bfloat16).
DET_WORKSPACE_BYTES = 4 << 30
def row_terms(p: Problem, lse, dlse, need_asum_scale: bool):
    """``(lse2, delta correction or None, asum_scale or None, lse')`` -- see the module docstring."""
    lse = lse.float()
    lse_eff = effective_lse(lse, p.attn_sink)
    ratio = None
    if p.attn_sink is not None:
        ratio = torch.exp(lse_eff - lse)
        ratio = torch.where(torch.isposinf(lse), torch.ones_like(ratio), ratio)
    corr = None
    if dlse is not None:
        dl = dlse.float()
        corr = (dl * ratio if ratio is not None else dl).contiguous()
    lse2 = (lse_eff * LOG2E).contiguous()
    asum_scale = ratio.contiguous() if (need_asum_scale and ratio is not None) else None
    return lse2, corr, asum_scale, lse_eff


def d_attn_sink(p: Problem, lse_eff: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``-sum_i exp(sink_h - lse'_ih) * delta_ih`` (0 contribution from empty rows)."""
    p_sink = torch.exp(p.attn_sink.float().reshape(1, -1) - lse_eff)
    return -(p_sink * delta).sum(dim=0)


#: The backward kernel's attributes this host code reads (kept in the compile cache's manifest, so a
#: process that loads the kernel from disk has them without importing the kernel class).
KERNEL_HOST_ATTRS = ("ws_row_heads", "det_ws_dtype", "ws_col_perm")


#: Environment switch of the backward's rotated block order (``0``: every CTA walks its row's
#: blocks from the first, as before; for A/B timing).  See :func:`rotate_shift_for`.
ROTATE_ENV = "MLA_KERNELS_BWD_ROTATE"


def rotate_shift_for(backend_shift: int, ordered: bool, deterministic: bool) -> int:
    """The kernel's ``rotate_shift`` for one call: the backend's (sm90: 13, a 2^13 ns tick) when
    the slots are band-ordered, the mode is not deterministic (dq's block order must be fixed
    there) and ``MLA_KERNELS_BWD_ROTATE`` is not ``0``; else 0 (blocks in row order)."""
    if not ordered or deterministic:
        return 0
    return rotate_shift_knob(backend_shift, ROTATE_ENV, "1")


#: Environment switch of the backward's deferred scatter (``0``: off; for A/B timing).  See
#: :func:`defer_scatter_for`.
DEFER_ENV = "MLA_KERNELS_BWD_DEFER"


def defer_scatter_for(max_skv: int, s_kv: int, h_q: int, deterministic: bool) -> bool:
    """Whether the kernel defers a warpgroup's last dKV scatter into the next block
    (``SparseMlaBwdSm90(defer_scatter=True)``): for the pair-summed kernel (h_q a multiple of
    128), not deterministic, s_kv up to the backend's ``max_skv`` (0: the backend has no such
    variant) -- past it the late atomics miss L2 and the variant is slower -- unless
    ``MLA_KERNELS_BWD_DEFER=0``."""
    if not max_skv or deterministic or h_q % 128 != 0 or s_kv > max_skv:
        return False
    return fastpath.knob_choice(DEFER_ENV, ("0", "1"), "1") == "1"


def _kernel(p: Problem, compile_bwd, name: str, attn_sum: bool, scaled: bool, deterministic: bool,
            has_dlse: bool, rotate_shift: int = 0, defer: bool = False):
    """``(kernel object, compiled function)`` of one configuration (compiled once per process)."""
    arch = _compile.arch_for_device(p.device)
    has_tl = p.topk_length is not None
    key = (name, p.d_qk, p.h_q, has_tl, attn_sum, scaled, deterministic, has_dlse, arch)
    extra = {}
    if rotate_shift:  # (only backends that declare a shift take the argument)
        key += (("rotate_shift", rotate_shift),)
        extra["rotate_shift"] = rotate_shift
    if defer:  # (likewise: only backends with ``bwd_defer_max_skv``)
        key += (("defer_scatter", True),)
        extra["defer_scatter"] = True
    return _compile.cached_compile(
        key, lambda: compile_bwd(p.d_qk, p.h_q, has_tl, attn_sum, scaled, deterministic, has_dlse, arch, **extra),
        host_attrs=KERNEL_HOST_ATTRS,
    )


def ws_row_blocks(kernel, h_q: int) -> int:
    """Deterministic workspace rows per (token, slot): one per ``kernel.ws_row_heads`` heads (64
    for the sm90 and sm100 1-CTA kernels, 128 for the sm100 2-CTA kernel, which sums its two head
    blocks before it stores)."""
    return h_q // getattr(kernel, "ws_row_heads", B_H)


def run_bwd(p: Problem, out, dout, lse, dlse=None, deterministic: bool = False, return_attn_sum: bool = False,
            *, compile_bwd, name: str, sort_indices: bool = False, rotate_shift: int = 0, defer_max_skv: int = 0):
    """The backward on a validated, topk-padded problem: ``(dq, dkv, d_sink[, attn_sum])``.

    ``compile_bwd`` is the backend's ``compile_bwd`` (``sm90`` or ``sm100``), ``name`` its compile
    cache key (the kernel class name); ``sort_indices``: run the kernel on :func:`kv_ordered`
    slots (``attn_sum`` is mapped back to the caller's slot order); ``rotate_shift``: the backend's
    block-order tick on such slots (:func:`rotate_shift_for`); ``defer_max_skv``: the backend's
    bound for the deferred scatter (:func:`defer_scatter_for`)."""
    perm = None
    ordered = sort_indices and sort_enabled() and p.indices.is_cuda
    if ordered:
        p, perm = kv_ordered(p, return_attn_sum)
    dev = p.device
    n_hblk = p.h_q // B_H
    lse2, corr, asum_scale, lse_eff = row_terms(p, lse, dlse, return_attn_sum)
    scaled = asum_scale is not None
    rot = rotate_shift_for(rotate_shift, ordered, deterministic)
    defer = defer_scatter_for(defer_max_skv, p.s_kv, p.h_q, deterministic)
    kernel, fn = _kernel(p, compile_bwd, name, return_attn_sum, scaled, deterministic, corr is not None, rot, defer)

    dq = host.alloc((p.s_q, p.h_q, p.d_qk), torch.bfloat16, dev)
    delta = host.alloc((p.s_q, p.h_q), torch.float32, dev)
    asum_parts = host.alloc((p.s_q, n_hblk, p.topk), torch.float32, dev) if return_attn_sum else None
    tl = p.topk_length
    scale_log2 = p.sm_scale * LOG2E
    row_dummy = host.dummy(torch.float32, dev, (1, p.h_q))  # never read by the variants that get it
    dummy_asum = host.dummy(torch.float32, dev, (1, 1, 64))
    dkv_acc = torch.zeros(p.s_kv, p.d_qk, dtype=torch.float32, device=dev)

    def launch(c0: int, c1: int, ws: torch.Tensor) -> None:
        fn(
            p.q[c0:c1], p.kv, dout[c0:c1], out[c0:c1], p.indices[c0:c1],
            tl[c0:c1] if tl is not None else host.dummy(torch.int32, dev),
            lse2[c0:c1],
            corr[c0:c1] if corr is not None else row_dummy,
            delta[c0:c1],
            asum_scale[c0:c1] if scaled else row_dummy,
            dq[c0:c1], ws,
            asum_parts[c0:c1] if return_attn_sum else dummy_asum,
            scale_log2, p.sm_scale,
        )

    if not deterministic:
        # attn_sum partials are indexed with 32-bit offsets: launch in waves that keep
        # s_q * n_head_blocks * topk below 2^31 (one launch for any realistic size)
        wave = max(1, (2**31 - 1) // (n_hblk * p.topk))
        for c0 in range(0, p.s_q, wave):
            launch(c0, min(p.s_q, c0 + wave), dkv_acc)
    else:
        n_rblk = ws_row_blocks(kernel, p.h_q)
        ws_dtype = getattr(kernel, "det_ws_dtype", None) or torch.float32
        rows_per_token = n_rblk * p.topk
        per_token = rows_per_token * p.d_qk * ws_dtype.itemsize
        wave = max(1, min(p.s_q, DET_WORKSPACE_BYTES // per_token))
        valid = valid_mask(p.indices, p.s_kv, p.topk_length)
        ws = torch.empty(wave * rows_per_token, p.d_qk, dtype=ws_dtype, device=dev)
        for c0 in range(0, p.s_q, wave):
            c1 = min(p.s_q, c0 + wave)
            launch(c0, c1, ws)
            reduce_slot_rows(dkv_acc, ws, p.indices[c0:c1], valid[c0:c1], n_rblk)

    dkv = natural_columns(dkv_acc, getattr(kernel, "ws_col_perm", None), p.dtype)
    d_sink = d_attn_sink(p, lse_eff, delta) if p.attn_sink is not None else None
    res = (dq, dkv, d_sink)
    if return_attn_sum:
        asum = asum_parts.sum(dim=1) if n_hblk > 1 else asum_parts[:, 0]
        if perm is not None:  # back to the caller's slot order
            asum = torch.empty_like(asum).scatter_(1, perm.long(), asum)
        res = res + (asum,)
    return res


_PERM_CACHE: dict = {}
_BITS_CACHE: dict = {}  # perm tuple -> bit_permutation(perm) (pure Python, ~100 generator steps)


def bit_permutation(perm) -> Optional[tuple]:
    """``perm`` (natural column -> workspace position in a group of ``2**k`` columns) as a
    permutation of the ``k`` bits of the column index, or None if it is not one: the tuple gives,
    for each bit of the natural index (most significant first), the workspace bit it comes from
    (most significant first).  The sm90 backward's order is one (a swap of two bit fields), so
    undoing it is a strided view, not a gather."""
    n = len(perm)
    k = n.bit_length() - 1
    if n < 2 or 1 << k != n:
        return None
    src = []
    for b in range(k):  # natural bit b (LSB first): which workspace bit moves with it
        hits = [wb for wb in range(k) if all(((perm[c] >> wb) & 1) == ((c >> b) & 1) for c in range(n))]
        if not hits:
            return None
        src.append(hits[0])
    if sorted(src) != list(range(k)):
        return None
    return tuple(k - 1 - src[b] for b in reversed(range(k)))


def natural_columns(ws: torch.Tensor, perm, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Undo a kernel's workspace column order and convert to ``dtype`` (None: keep ``ws``'s):
    ``perm`` (or None: natural order) gives, for each natural column of a group of ``len(perm)``
    columns, its position in the workspace group (the sm90 backward stores 16-column groups
    permuted so that its atomics need fewer shuffles).  A permutation of the column index's bits
    (the sm90 order) is undone by one strided copy that also converts (one pass over the
    workspace); any other permutation by a gather."""
    if perm is None:
        return ws if dtype is None or ws.dtype == dtype else ws.to(dtype)
    n = len(perm)
    rows, d = ws.shape
    key = tuple(perm)
    bits = _BITS_CACHE.get(key, False)
    if bits is False:
        bits = _BITS_CACHE[key] = bit_permutation(key)
    if bits is not None:
        k = len(bits)
        out = torch.empty(rows, d, dtype=dtype or ws.dtype, device=ws.device)
        src = ws.view(rows, d // n, *([2] * k)).permute(0, 1, *(2 + b for b in bits))
        out.view(rows, d // n, *([2] * k)).copy_(src)
        return out
    key = (tuple(perm), ws.device)
    idx = _PERM_CACHE.get(key)
    if idx is None:
        idx = _PERM_CACHE[key] = torch.tensor(perm, dtype=torch.long, device=ws.device)
    res = ws.view(rows, d // n, n).index_select(2, idx).reshape(rows, d)
    return res if dtype is None else res.to(dtype)


def reduce_slot_rows(acc: torch.Tensor, ws: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor,
                     n_hblk: int) -> None:
    """Deterministic ``acc[indices[s, t]] += sum_hb ws[(s * n_hblk + hb) * topk + t]`` over the
    valid slots: rows are ordered by (kv row, token, head block, slot) with a stable sort of a
    deterministic enumeration and summed per kv row in that order -- on CUDA by
    :class:`~mla_kernels.common.segment_sum.SegmentSum` (one writer per row, each row read once),
    elsewhere by ``segment_reduce``."""
    n_tok, topk = indices.shape
    flat = valid.reshape(-1).nonzero().squeeze(1)  # s * topk + t, ascending: a fixed order
    if flat.numel() == 0:
        return
    # 32-bit keys and row ids where they fit (always, for workspaces of DET_WORKSPACE_BYTES): the
    # stable radix sort then makes 4 passes instead of 8 -- the same permutation either way
    it = torch.int32 if n_tok * n_hblk * topk < 2**31 else torch.int64
    kv_rows = indices.reshape(-1)[flat].to(it)
    if n_hblk == 1:
        ids, keys = flat.to(it), kv_rows
    else:
        s_i, t_i = (flat // topk).to(it), (flat % topk).to(it)
        hb = torch.arange(n_hblk, device=indices.device, dtype=it)
        ids = ((s_i[:, None] * n_hblk + hb[None, :]) * topk + t_i[:, None]).reshape(-1)
        keys = kv_rows[:, None].expand(-1, n_hblk).reshape(-1)
    order = torch.argsort(keys, stable=True)
    keys = keys[order]
    uniq, counts = torch.unique_consecutive(keys, return_counts=True)
    if acc.is_cuda:
        start = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=acc.device)
        torch.cumsum(counts, 0, out=start[1:])
        _segment_sum_fn(acc.shape[1], acc.device, ws.dtype == torch.bfloat16)(
            ws, ids[order].to(torch.int32), start.to(torch.int32), uniq.to(torch.int32), acc
        )
        return
    seg = torch.segment_reduce(ws[ids[order]].to(acc.dtype), "sum", lengths=counts, axis=0)
    acc[uniq] += seg  # one addition per (unique) row: no collisions


def _compile_segment_sum(d: int, arch: str, bf16_rows: bool):
    from .segment_sum import compile_segment_sum  # the kernel module (imports the DSL): only to compile

    return compile_segment_sum(d, arch, bf16_rows)


def _segment_sum_fn(d: int, device, bf16_rows: bool = False):
    arch = _compile.arch_for_device(device)
    _, fn = _compile.cached_compile(("SegmentSum", d, bf16_rows, arch),
                                    lambda: _compile_segment_sum(d, arch, bf16_rows))
    return fn
