"""The lse combine: merge partial attention results over disjoint parts of the keys (CuTe DSL;
arch-agnostic: plain loads and stores, no MMA).

``out_parts [n, P, d_v]`` (float32 or bf16; each part normalised by its own softmax sum) and
``lse_parts [n, P]`` float32 (natural log, ``+inf`` = empty part) give, per row ``p`` (a flattened
``(token, head)`` pair)::

    lse[p] = log(sum_i exp(lse_i))           out[p] = sum_i exp(lse_i - lse[p]) * out_i

with the max subtracted first (numerically stable); an all-empty row gives ``out = 0`` and
``lse = +inf``; a part whose weight is 0 (empty, or ``exp`` underflow) never contributes, whatever
its ``out`` holds.  ``attn_sink [h]`` (head ``p % h``) is applied once, after the merge:
``out *= 1 / (1 + exp(sink - lse))`` (``= exp(lse) / (exp(lse) + exp(sink))``), ``lse`` untouched.

This one kernel is both the decode path's split combine and ``merge_attn_partials``.  With
``pdl=True`` (``MLA_KERNELS_DECODE_PDL=1``) it is launched with programmatic dependent launch
after a decode kernel: its CTAs may be scheduled while the decode kernel finishes and wait in
``griddepcontrol.wait`` (a no-op in a plain launch) until the decode grid has completed and its
writes are visible.

Work split: one warp per ``(row, column group)``; a column group is ``32 * vec`` columns (``vec``
= one 16-byte vector of the input: 4 float32 or 8 bf16), one vector per lane, so a warp reads
512 contiguous bytes per part.  Pass 1 (lanes over parts) finds the max and the sum of the
parts' ``exp``; pass 2 walks the parts in order, unrolled so that several parts' loads are in
flight (the first ``PREFETCH`` parts' vectors are loaded before pass 1, so a small split count costs
one round trip to L2 instead of three).  Empty parts are read but multiplied out by a select
(weight 0), never by ``0 * x``.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from . import device as dev

WARPS = 4
THREADS = 32 * WARPS
UNROLL = 8
# the first PREFETCH parts' vectors are loaded before pass 1 (their loads do not depend on the lse
# values): a small split count then costs one round trip to L2 instead of three
PREFETCH = 16


def _dtype_of(name: str):
    return {"bf16": BFloat16, "f32": Float32}[name]


class LseCombine:
    """Static configuration (``d_v``, input and output dtypes) + launcher + kernel."""

    def __init__(self, d_v: int, in_dtype: str = "f32", out_dtype: str = "bf16", pdl: bool = False):
        if in_dtype not in ("bf16", "f32") or out_dtype not in ("bf16", "f32"):
            raise ValueError(f"dtypes must be 'bf16' or 'f32', got {in_dtype!r} -> {out_dtype!r}")
        self.in_dtype = _dtype_of(in_dtype)
        self.out_dtype = _dtype_of(out_dtype)
        self.vec = 16 // (self.in_dtype.width // 8)  # elements per 16-byte input vector
        if d_v % (32 * self.vec):
            raise ValueError(f"combine needs d_v % {32 * self.vec} == 0 for {in_dtype} parts, got {d_v}")
        self.d_v = d_v
        self.pdl = pdl
        self.n_groups = d_v // (32 * self.vec)
        self.smem_bytes = 0

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # [n, P, d_v] parts (in_dtype)
        mL: cute.Tensor,  # [n, P] f32 parts' lse
        mSink: cute.Tensor,  # [h] f32 (read only if has_sink)
        mOut: cute.Tensor,  # [P, d_v] out_dtype
        mLse: cute.Tensor,  # [P] f32
        n_heads: Int32,  # h: row p belongs to head p % h
        has_sink: Int32,
        stream,
    ):
        n_rows = mL.shape[1]
        n_items = n_rows * self.n_groups
        self.kernel(mO, mL, mSink, mOut, mLse, n_heads, has_sink).launch(
            grid=[(n_items + WARPS - 1) // WARPS, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mL: cute.Tensor, mSink: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor,
               n_heads: Int32, has_sink: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        n_rows = mL.shape[1]
        item = bidx * WARPS + warp
        row = item // self.n_groups
        cute.arch.griddepcontrol_wait()  # the producing kernel's grid is complete (PDL launch)
        group = item % self.n_groups
        if row < n_rows:
            merge_item(mO, mL, mSink, mOut, mLse, mL, mLse, n_heads, has_sink, Int32(0), row, group, lane,
                       self.d_v, self.in_dtype, self.out_dtype, False)


@cute.jit
def merge_item(
    mO: cute.Tensor,
    mL: cute.Tensor,
    mSink: cute.Tensor,
    mOut: cute.Tensor,
    mLse: cute.Tensor,
    mMLp: cute.Tensor,
    mMLout: cute.Tensor,
    n_heads: Int32,
    has_sink: Int32,
    use_ml: Int32,
    row: Int32,
    group: Int32,
    lane: Int32,
    d_v: cutlass.Constexpr,
    in_dtype: cutlass.Constexpr,
    out_dtype: cutlass.Constexpr,
    with_ml: cutlass.Constexpr,
):
    """One warp merges columns ``[group * 32 * vec, (group + 1) * 32 * vec)`` of row ``row``:
    ``mO`` is ``[n, P, d_v]`` (only its iterator is used: parts ``n_rows * d_v`` elements apart),
    ``mL [n, P]`` the parts' lse, ``mOut [P, d_v]`` / ``mLse [P]`` the merged row (``mLse`` written
    by group 0's lane 0).  ``with_ml`` (static) and ``use_ml`` (runtime): also the max over the
    parts of ``mMLp [n, P]`` into ``mMLout [P]`` (``-inf`` when every part is empty).  Shared by
    the combine kernel and the decode kernels' fused tail (``common/decode_device.py``)."""
    n_parts = mL.shape[0]
    n_rows = mL.shape[1]
    vec = 16 // (in_dtype.width // 8)
    col = Int64((group * 32 + lane) * vec)
    vec_layout = cute.make_layout(vec)
    row_off = Int64(row) * d_v + col
    part_stride = Int64(n_rows) * d_v
    # ---- the first PREFETCH parts' vectors, in flight during pass 1 -----------------------------
    pre = cute.make_rmem_tensor((vec, max(PREFETCH, 1)), in_dtype)
    for i in cutlass.range_constexpr(PREFETCH):
        if i < n_parts:
            src = cute.make_tensor((mO.iterator + (Int64(i) * part_stride + row_off)).align(16), vec_layout)
            cute.autovec_copy(src, pre[None, i])
    # ---- pass 1: max and sum over the parts (lanes over parts), in log2 units ----------------
    m = Float32(dev.MAX_INIT)
    s = Float32(0.0)
    for i0 in cutlass.range(0, n_parts, 32, unroll=1):
        i = i0 + lane
        x = Float32(-math.inf)
        if i < n_parts:
            x = mL[i, row]
        # +inf (empty) and NaN count as empty
        xl = Float32(cutlass.select_(x < Float32(math.inf), x * dev.LOG2E, Float32(-math.inf)))
        m_new = cute.arch.fmax(m, xl)
        s = s * cute.math.exp2(m - m_new, fastmath=True) + cute.math.exp2(xl - m_new, fastmath=True)
        m = m_new
    for off in (16, 8, 4, 2, 1):
        m_o = cute.arch.shuffle_sync_bfly(m, offset=off)
        s_o = cute.arch.shuffle_sync_bfly(s, offset=off)
        m_new = cute.arch.fmax(m, m_o)
        s = s * cute.math.exp2(m - m_new, fastmath=True) + s_o * cute.math.exp2(m_o - m_new, fastmath=True)
        m = m_new
    nonempty = s > Float32(0.0)
    # lse in log2 units; +inf for an all-empty row makes every weight exp2(-inf) = 0
    lse2 = Float32(cutlass.select_(nonempty, m + cute.math.log2(s, fastmath=False), Float32(math.inf)))

    # ---- pass 2: weighted sum of the parts ------------------------------------------------------
    acc = cute.make_rmem_tensor((vec,), Float32)
    acc.fill(0.0)
    for i in cutlass.range_constexpr(PREFETCH):
        if i < n_parts:
            x = mL[i, row]
            xl = Float32(cutlass.select_(x < Float32(math.inf), x * dev.LOG2E, Float32(-math.inf)))
            w = cute.math.exp2(xl - lse2, fastmath=True)
            v = pre[None, i].load().to(Float32)
            for e in cutlass.range_constexpr(vec):
                acc[e] = acc[e] + Float32(cutlass.select_(w > Float32(0.0), w * v[e], Float32(0.0)))
    buf = cute.make_rmem_tensor((vec,), in_dtype)
    for i in cutlass.range(PREFETCH, n_parts, unroll=UNROLL):
        x = mL[i, row]
        xl = Float32(cutlass.select_(x < Float32(math.inf), x * dev.LOG2E, Float32(-math.inf)))
        w = cute.math.exp2(xl - lse2, fastmath=True)
        src = cute.make_tensor((mO.iterator + (Int64(i) * part_stride + row_off)).align(16), vec_layout)
        cute.autovec_copy(src, buf)
        v = buf.load().to(Float32)
        for e in cutlass.range_constexpr(vec):
            acc[e] = acc[e] + Float32(cutlass.select_(w > Float32(0.0), w * v[e], Float32(0.0)))

    lse = lse2 * dev.LN2  # +inf stays +inf
    if has_sink != 0:
        sink = mSink[row % n_heads]
        # exp(lse) / (exp(lse) + exp(sink)); an empty row has acc = 0 already
        f = Float32(1.0) / (Float32(1.0) + cute.math.exp2((sink - lse) * dev.LOG2E, fastmath=True))
        f = Float32(cutlass.select_(nonempty, f, Float32(0.0)))
        for e in cutlass.range_constexpr(vec):
            acc[e] = acc[e] * f
    res = cute.make_rmem_tensor((vec,), out_dtype)
    res.store(acc.load().to(out_dtype))
    out_align = vec * (out_dtype.width // 8)
    dst = cute.make_tensor((mOut.iterator + row_off).align(out_align), vec_layout)
    cute.autovec_copy(res, dst)
    if group == 0:
        if const_expr(with_ml):
            if use_ml != 0:
                mx = Float32(-math.inf)
                for i0 in cutlass.range(0, n_parts, 32, unroll=1):
                    i = i0 + lane
                    if i < n_parts:
                        mx = cute.arch.fmax(mx, mMLp[i, row])
                for off in (16, 8, 4, 2, 1):
                    mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=off))
                if lane == 0:
                    mMLout[row] = mx
        if lane == 0:
            mLse[row] = lse


def combine_fake_args(d_v: int, in_dtype: str, out_dtype: str):
    """``(out_parts [n, P, d_v], lse_parts [n, P], sink [h], out [P, d_v], lse [P], n_heads,
    has_sink, stream)``."""
    from . import host

    n, n2, p, p2, p3, p4, h = (cute.sym_int() for _ in range(7))
    return (
        host.fake(_dtype_of(in_dtype), (n, p, d_v)),
        host.fake(Float32, (n2, p2), align=4),
        host.fake(Float32, (h,), align=4),
        host.fake(_dtype_of(out_dtype), (p3, d_v)),
        host.fake(Float32, (p4,), align=4),
        Int32(1),
        Int32(0),
        host.fake_stream(),
    )


def compile_combine(d_v: int, in_dtype: str = "f32", out_dtype: str = "bf16", arch: str = "sm_90a",
                    pdl: bool = False, **kw):
    """Compile the combine for one static configuration (no GPU needed)."""
    from .. import _compile

    kernel = LseCombine(d_v, in_dtype, out_dtype, pdl)
    return kernel, _compile.compile_kernel(kernel, *combine_fake_args(d_v, in_dtype, out_dtype), arch=arch, **kw)
