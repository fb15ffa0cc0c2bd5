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
