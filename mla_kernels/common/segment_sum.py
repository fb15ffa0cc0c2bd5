"""Deterministic segmented row sum (CuTe DSL; arch-agnostic: plain loads and stores, no MMA).

``acc[seg_row[s]] += sum_{k in [seg_start[s], seg_start[s+1])} ws[order[k]]`` for every segment
``s``: one CTA per segment, ``d/4`` threads, each owning 4 columns and adding the segment's rows
one after the other in ``order``.  Every output row has exactly one writer and every sum one fixed
order, so the result is bitwise reproducible.  This is the deterministic backward's reduction of
its per-slot dKV rows (segments = runs of equal kv rows after a stable sort); it reads each row
once, where ``segment_reduce(ws[order])`` first materialises a gathered copy.  The rows may be
float32 or bfloat16 (the sm90 backward stores bf16 rows: half the traffic); the sum is float32.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from .indexer_device import f32_to_fixed


class SegmentSum:
    """Static configuration (row width ``d``, a multiple of 4; row dtype) + launcher + kernel."""

    def __init__(self, d: int, bf16_rows: bool = False):
        if d % 4 or d > 4096:
            raise ValueError(f"segment sum needs d % 4 == 0 and d <= 4096, got {d}")
        self.d = d
        self.bf16_rows = bf16_rows
        self.threads = d // 4
        self.smem_bytes = 0

    @cute.jit
    def __call__(
        self,
        mWs: cute.Tensor,  # [n_rows, d] f32 or bf16: the rows to sum
        mOrder: cute.Tensor,  # [n] int32: row ids, grouped by segment
        mSegStart: cute.Tensor,  # [n_seg + 1] int32: segment s is order[start[s]:start[s+1]]
        mSegRow: cute.Tensor,  # [n_seg] int32: destination row of segment s (distinct)
        mAcc: cute.Tensor,  # [n_dst, d] f32: accumulated in place
        stream,
    ):
        self.kernel(mWs, mOrder, mSegStart, mSegRow, mAcc).launch(
            grid=[mSegRow.shape[0], 1, 1], block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mWs: cute.Tensor, mOrder: cute.Tensor, mSegStart: cute.Tensor, mSegRow: cute.Tensor,
               mAcc: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        seg, _, _ = cute.arch.block_idx()
        start = mSegStart[seg]
        end = mSegStart[seg + 1]
        col = Int64(4 * tidx)
        vec = cute.make_layout(4)
        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        buf = cute.make_rmem_tensor((4,), BFloat16 if cutlass.const_expr(self.bf16_rows) else Float32)
        align = 8 if cutlass.const_expr(self.bf16_rows) else 16
        for k in cutlass.range(start, end, unroll=4):
            row = Int64(mOrder[k])
            cute.autovec_copy(cute.make_tensor((mWs.iterator + (row * self.d + col)).align(align), vec), buf)
            acc.store(acc.load() + buf.load().to(Float32))
        dst = cute.make_tensor((mAcc.iterator + (Int64(mSegRow[seg]) * self.d + col)).align(16), vec)
        cur = cute.make_rmem_tensor((4,), Float32)
        cute.autovec_copy(dst, cur)
        cur.store(cur.load() + acc.load())
        cute.autovec_copy(cur, dst)


def compile_segment_sum(d: int, arch: str = "sm_90a", bf16_rows: bool = False, **kw):
    """Compile the segmented sum for row width ``d`` and float32 (or bf16) rows (no GPU needed)."""
    from .. import _compile
    from . import host

    kernel = SegmentSum(d, bf16_rows)
    n_rows, n, n_s1, n_seg, n_dst = (cute.sym_int() for _ in range(5))
    args = (
        host.fake(BFloat16 if bf16_rows else Float32, (n_rows, d)),
        host.fake(Int32, (n,), align=4),
        host.fake(Int32, (n_s1,), align=4),
        host.fake(Int32, (n_seg,), align=4),
        host.fake(Float32, (n_dst, d)),
        host.fake_stream(),
    )
    return kernel, _compile.compile_kernel(kernel, *args, arch=arch, **kw)


class FixedSegmentSum:
    """``acc[s] += sum_{k in [start[s], start[s+1])} round(ws[k] * scale)`` in 64-bit
    integers (``acc`` int64 ``[n_seg, d]``, ``ws`` bf16 rows, ``scale`` a power of two): one CTA
    per segment, ``d / 8`` lanes per row (16 bytes each), ``128 / (d / 8)`` rows in flight per
    step; the lanes' partial sums meet in shared memory.  Integer addition is associative, so the
    result does not depend on the order of the rows inside a segment (which
    :class:`~mla_kernels.common.key_groups.KeyGroups` assigns by atomics) nor on how the rows are
    split between the lanes: bitwise reproducible.  ``round`` is ``cvt.rni.s64.f32`` of the exact
    product (the scale is chosen so that no sum overflows, see ``indexer_host.fixed_point_scale``).
    """

    THREADS = 128

    def __init__(self, d: int):
        if d % 8 or not 8 <= d <= 8 * self.THREADS:
            raise ValueError(f"fixed segment sum needs d % 8 == 0 and 8 <= d <= {8 * self.THREADS}, got {d}")
        self.d = d
        self.lanes = d // 8  # lanes per row, 8 bf16 each
        self.groups = self.THREADS // self.lanes  # rows per step

    @cute.jit
    def __call__(
        self,
        mWs: cute.Tensor,  # [n_rows, d] bf16: segment s is rows start[s] .. start[s+1] - 1
        mSegStart: cute.Tensor,  # [n_seg + 1] int32
        mAcc: cute.Tensor,  # [n_seg, d] int64: accumulated in place
        mScale: cute.Tensor,  # [1] f32: the fixed-point scale 2^e
        stream,
    ):
        @cute.struct
        class SharedStorage:
            part: cute.struct.Align[cute.struct.MemRange[Int64, self.groups * self.d], 16]

        self.kernel(mWs, mSegStart, mAcc, mScale, SharedStorage).launch(
            grid=[mAcc.shape[0], 1, 1], block=[self.THREADS, 1, 1], smem=SharedStorage.size_in_bytes(),
            stream=stream
        )

    @cute.kernel
    def kernel(self, mWs: cute.Tensor, mSegStart: cute.Tensor, mAcc: cute.Tensor, mScale: cute.Tensor, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        seg, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sPart = storage.part.get_tensor(cute.make_layout(self.groups * self.d))
        start = mSegStart[seg]
        end = mSegStart[seg + 1]
        if start < end:  # the same for every thread of the CTA
            scale = mScale[0]
            # this thread's accumulator columns, loaded now: their latency hides under the rows
            n_out = (self.d + self.THREADS - 1) // self.THREADS
            prev = cute.make_rmem_tensor((n_out,), Int64)
            for c in cutlass.range_constexpr(n_out):
                cc = c * self.THREADS + tidx
                prev[c] = Int64(0)
                if cc < self.d:
                    prev[c] = mAcc[seg, cc]
            grp = tidx // self.lanes
            col = 8 * (tidx % self.lanes)
            acc = cute.make_rmem_tensor((8,), Int64)
            for e in cutlass.range_constexpr(8):
                acc[e] = Int64(0)
            buf = cute.make_rmem_tensor((8,), BFloat16)
            vals = cute.make_rmem_tensor((8,), Float32)
            vec = cute.make_layout(8)
            for k in cutlass.range(start + grp, end, self.groups, unroll=4):
                row = Int64(k)
                cute.autovec_copy(cute.make_tensor((mWs.iterator + (row * self.d + col)).align(16), vec), buf)
                vals.store(buf.load().to(Float32))
                for e in cutlass.range_constexpr(8):
                    acc[e] = acc[e] + f32_to_fixed(vals[e], scale)
            for e in cutlass.range_constexpr(8):
                sPart[grp * self.d + col + e] = acc[e]
            cute.arch.sync_threads()
            for c in cutlass.range_constexpr((self.d + self.THREADS - 1) // self.THREADS):
                cc = c * self.THREADS + tidx
                if cc < self.d:
                    tot = prev[c]
                    for g in cutlass.range_constexpr(self.groups):
                        tot = tot + sPart[g * self.d + cc]
                    mAcc[seg, cc] = tot


def compile_fixed_segment_sum(d: int, arch: str = "sm_90a", **kw):
    """Compile the fixed-point segmented sum for row width ``d`` (bf16 rows; no GPU needed)."""
    from .. import _compile
    from . import host

    kernel = FixedSegmentSum(d)
    args = (
        host.fake(BFloat16, (cute.sym_int(), d)),
        host.fake(Int32, (cute.sym_int(),), align=4),
        host.fake(Int64, (cute.sym_int(), d)),
        host.fake(Float32, (1,), align=4),
        host.fake_stream(),
    )
    return kernel, _compile.compile_kernel(kernel, *args, arch=arch, **kw)
