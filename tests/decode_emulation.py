"""CPU stand-ins for the compiled decode and combine kernels, implementing their argument
contract (``common/decode_host.py``) with the reference.  Injected through
``decode_host.prepare_decode``'s compile functions, they let the CPU tests drive the real host
side -- flag bits, topk_length strides, page size, split views, the combine's flattened rows,
placeholders -- and compare with the reference decode."""

from __future__ import annotations

import math

import torch

from mla_kernels import reference as ref
from mla_kernels.common import decode_host as dh


class Calls:
    def __init__(self):
        self.log = []
        self.pagediv = []  # (mode, page_size, page_mul, page_shift) per decode launch


def emulated_physical_indices(idx, n_rows, page_size, page_mul, page_shift, block_table, pagediv="magic"):
    """``PagedKvGather.index_at`` on the host: rows of the flattened cache for positions ``idx
    [b, s_q, topk]`` through ``block_table [b, max_pages]`` (-1 where invalid), the division by the
    page size done as the kernel does it (``magic``: :func:`decode_host.page_div_emulated` with the
    kernel's arguments; ``generic``: ``//``)."""
    ps = max(page_size, 1)
    pos = idx.long()
    pos_c = pos.clamp_min(0)
    div = (lambda n: dh.page_div_emulated(n, page_mul, page_shift)) if pagediv == "magic" else (lambda n: n // ps)
    page_i = div(pos_c)
    num_pages = div(n_rows)
    b, max_pages = block_table.shape
    page = block_table.long().gather(1, page_i.clamp(max=max_pages - 1).reshape(b, -1)).reshape(pos.shape)
    rows = page * ps + (pos_c - page_i * ps)
    ok = (pos >= 0) & (page_i < max_pages) & (page >= 0) & (page < num_pages)
    return torch.where(ok, rows, torch.full_like(rows, -1))


def make_decode_kernel(d_qk: int, h_q: int, split: bool, calls: Calls, fused: bool = False, cluster: int = 0,
                       cluster_bf16: bool = False, cluster_l2: bool = False, pagediv: str = dh.DEFAULT_PAGEDIV):
    if cluster_l2:  # the fused kernel's contract: parts through the workspace, merged by the cluster
        fused = True
    def fn(q, bias, kv4, idx, bt, tl, sink, out, lse, ml, *rest):
        if fused:  # the merged outputs and the arrival counters come after max_logits
            out_f, lse_f, ml_f, cnt, *rest = rest
        scale_log2, flags, page_size, page_mul, page_shift, tl_b, tl_s, n_splits, bps = rest
        tag = (f"cluster{cluster}",) if cluster else (("fused",) if fused else ())
        calls.log.append(("decode", d_qk, h_q, split, flags, n_splits, bps, tl_b, tl_s) + tag)
        calls.pagediv.append((pagediv, page_size, page_mul, page_shift))
        # the constants of the kernels' division by the page size (page_size 0: divide by 1)
        assert all(isinstance(v, int) for v in (page_size, page_mul, page_shift))
        assert (page_mul, page_shift) == dh.page_divisor(max(page_size, 1))
        b, s_q, h, d = q.shape
        assert (h, d) == (h_q, d_qk) and q.dtype == torch.bfloat16 and q.is_contiguous()
        assert kv4.dim() == 4 and kv4.shape[2] == 1 and kv4.shape[3] == d and page_size == kv4.shape[1]
        assert idx.dtype == torch.int32 and idx.shape[:2] == (b, s_q) and idx.is_contiguous()
        assert bias.dim() == 3 and bias.shape[1:] == (h, d) and bias.dtype == torch.bfloat16
        assert bt.dtype == torch.int32 and bt.dim() == 2 and tl.dtype == torch.int32 and tl.dim() == 1
        assert sink.dtype == torch.float32 and sink.dim() == 1
        assert lse.dim() == 3 and lse.shape[2] == h and ml.dim() == 3 and ml.shape[2] == h
        T = b * s_q
        topk = idx.shape[2]
        if cluster and not cluster_l2:  # the row's CTAs merge over DSMEM and write the direct mode's outputs
            # (the 64-head kernel's rows of 64 heads, or the narrow kernel's token of h_q heads,
            # which the cluster's CTAs merge ceil(h_q / cluster) heads each, the last ones fewer)
            assert split and n_splits == cluster and 2 <= cluster <= 16 and (h % 64 == 0 or h <= 32)
            assert out.shape == (b, s_q, h, 512) and out.dtype == torch.bfloat16 and lse.shape == (b, s_q, h)
            assert not (flags & dh.F_SINK) or sink.shape == (h,)
        elif split:
            assert out.shape == (n_splits, T, h, 512) and out.dtype == torch.float32
            assert lse.shape == (n_splits, T, h)
        else:
            assert n_splits == 1 and out.shape == (b, s_q, h, 512) and out.dtype == torch.bfloat16
            assert not (flags & dh.F_SINK) or sink.shape == (h,)
        qe = q.float()
        if flags & dh.F_BIAS:
            assert bias.shape[0] == b
            qe = (qe + bias.float()[:, None]).to(torch.bfloat16).float()  # the kernel rounds q + bias
        block_table = bt if flags & dh.F_BLOCK_TABLE else None
        if block_table is not None:
            # the kernel's translation, its division as the kernel does it, is the reference's
            n_rows = kv4.shape[0] * kv4.shape[1]
            assert torch.equal(emulated_physical_indices(idx, n_rows, page_size, page_mul, page_shift, block_table,
                                                         pagediv),
                               ref.decode_physical_indices(idx, n_rows, page_size, block_table))
        tl_tok = None
        if flags & dh.F_TOPK_LENGTH:
            bi = torch.arange(b)[:, None]
            si = torch.arange(s_q)[None, :]
            tl_tok = tl[(bi * tl_b + si * tl_s).reshape(-1)].reshape(b, s_q).long().clamp(0, topk)
        sm_scale = scale_log2 / math.log2(math.e)
        outs, lses, mls = ref.decode_split_partials_ref(qe, kv4, idx, sm_scale, 512, n_splits, bps, tl_tok,
                                                        block_table)
        if cluster:
            parts = outs.reshape(n_splits, T, h, 512)
            if cluster_bf16:  # the staged partials are rounded to bf16
                parts = parts.to(torch.bfloat16).float()
            o, l_ = ref.merge_attn_partials_ref(parts, lses.reshape(n_splits, T, h),
                                                sink if flags & dh.F_SINK else None, torch.bfloat16)
            out.copy_(o.reshape(b, s_q, h, 512))
            lse.copy_(l_.reshape(b, s_q, h))
            if flags & dh.F_MAX_LOGITS:
                ml.copy_(mls.reshape(n_splits, b, s_q, h).amax(0))
        elif split:
            out.copy_(outs.reshape(n_splits, T, h, 512))
            lse.copy_(lses.reshape(n_splits, T, h))
            if flags & dh.F_MAX_LOGITS:
                ml.copy_(mls.reshape(n_splits, T, h))
            if fused:  # the last CTA's merge (or the cluster's); the counters are zero before and after
                assert cnt.dtype == torch.int32 and cnt.dim() == 1 and bool((cnt == 0).all())
                assert cnt.numel() == (1 if cluster_l2 else T * (1 if h <= 32 else h // 64))
                assert not cluster_l2 or (n_splits == cluster and h % 64 == 0)
                assert out_f.shape == (b, s_q, h, 512) and out_f.dtype == torch.bfloat16
                o, l_ = ref.merge_attn_partials_ref(out.reshape(n_splits, T, h, 512), lse.reshape(n_splits, T, h),
                                                    sink if flags & dh.F_SINK else None, torch.bfloat16)
                out_f.copy_(o.reshape(b, s_q, h, 512))
                lse_f.copy_(l_.reshape(b, s_q, h))
                if flags & dh.F_MAX_LOGITS:
                    ml_f.copy_(ml.reshape(n_splits, b, s_q, h).amax(0))
        else:
            o, l_ = outs[0], lses[0]
            if flags & dh.F_SINK:
                o = o * torch.sigmoid(l_ - sink)[..., None]
                o = torch.where(torch.isposinf(l_)[..., None], torch.zeros_like(o), o)
            out.copy_(o.to(torch.bfloat16))
            lse.copy_(l_)
            if flags & dh.F_MAX_LOGITS:
                ml.copy_(mls[0])

    return fn


def make_combine(d_v: int, in_dtype: str, out_dtype: str, calls: Calls):
    def fn(parts, lses, sink, out, lse, n_heads, has_sink):
        calls.log.append(("combine", d_v, in_dtype, out_dtype, n_heads, has_sink))
        n, P, dv = parts.shape
        assert dv == d_v and lses.shape == (n, P) and out.shape == (P, d_v) and lse.shape == (P,)
        assert P % n_heads == 0
        o, l_ = ref.merge_attn_partials_ref(parts.reshape(n, P // n_heads, n_heads, d_v),
                                            lses.reshape(n, P // n_heads, n_heads),
                                            sink if has_sink else None, out.dtype)
        out.copy_(o.reshape(P, d_v))
        lse.copy_(l_.reshape(P))

    return fn


def emulated_compilers(calls: Calls):
    """``(compile_wide, compile_narrow, compile_combine)`` as ``prepare_decode`` takes them."""
    return (
        lambda d_qk, h_q, split, arch, **kw: (None, make_decode_kernel(d_qk, h_q, split, calls, kw.get("fused", False),
                                                                       kw.get("cluster", 0),
                                                                       kw.get("cluster_bf16", False),
                                                                       kw.get("cluster_l2", False),
                                                                       kw.get("pagediv", dh.DEFAULT_PAGEDIV))),
        lambda d_qk, h_q, split, arch, **kw: (None, make_decode_kernel(d_qk, h_q, split, calls, kw.get("fused", False),
                                                                       kw.get("cluster", 0),
                                                                       kw.get("cluster_bf16", False),
                                                                       kw.get("cluster_l2", False),
                                                                       kw.get("pagediv", dh.DEFAULT_PAGEDIV))),
        lambda d_v, i, o, arch, **kw: (None, make_combine(d_v, i, o, calls)),
    )
