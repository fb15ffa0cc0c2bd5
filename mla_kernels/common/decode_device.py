"""Device code shared by the sm90 decode kernels (``sm90/decode.py``, ``sm90/decode_narrow.py``),
CuTe DSL.  Kernel files must not import each other, so what both need lives here:

* :func:`last_arrival` / :func:`merge_block` -- the fused split combine ("the last block
  combines", as flash-decoding's single-launch variant): every split CTA of a row (a decode token
  and the heads one CTA holds) stores its float32 partial and lse, makes them visible at GPU
  scope, and takes a ticket from the row's arrival counter; the CTA that draws the last ticket
  resets the counter (so the plan's workspace is zero again for the next launch or graph replay)
  and merges the row's parts in split order -- the order, hence the result, does not depend on
  which CTA arrives last.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32

from .combine import merge_item

# Named barriers of the fused tail (ids no decode kernel uses otherwise; 256 consumer threads).
BAR_ARRIVE = 8
BAR_LAST = 9


@cute.jit
def last_arrival(
    mCnt: cute.Tensor,
    row_id: Int32,
    n_splits: Int32,
    sFlag: cute.Tensor,
    tid: Int32,
    n_threads: cutlass.Constexpr,
    bar_a: cutlass.Constexpr,
    bar_b: cutlass.Constexpr,
) -> Boolean:
    """Called by the ``n_threads`` threads (``tid`` 0..n-1) that stored this CTA's part, after
    their stores.  True in the CTA that arrives last at ``mCnt[row_id]`` (then the counter is 0
    again and every part of the row is visible to the caller's plain loads).

    Release: each storing thread fences at GPU scope, the CTA meets at ``bar_a``, thread 0's
    acq_rel atomic publishes the CTA's arrival.  Acquire: the last arrival's atomic reads every
    earlier one (each released its CTA's parts); thread 0 fences, ``bar_b`` carries that to the
    CTA, and every thread fences again before it reads the parts (no stale L1 line survives an
    acquire fence).  ``sFlag`` is one shared int32, written by thread 0 between the barriers."""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.barrier(barrier_id=bar_a, number_of_threads=n_threads)
    if tid == 0:
        old = cute.arch.atomic_add(mCnt.iterator + row_id, Int32(1), sem="acq_rel", scope="gpu")
        last = old == n_splits - 1
        if last:
            mCnt[row_id] = Int32(0)
        cute.arch.fence_acq_rel_gpu()
        sFlag[0] = Int32(cutlass.select_(last, Int32(1), Int32(0)))
    cute.arch.barrier(barrier_id=bar_b, number_of_threads=n_threads)
    is_last = sFlag[0] != Int32(0)
    if is_last:
        cute.arch.fence_acq_rel_gpu()
    return is_last


@cute.jit
def merge_block(
    mOp: cute.Tensor,
    mLp: cute.Tensor,
    mMLp: cute.Tensor,
    mOut: cute.Tensor,
    mLse: cute.Tensor,
    mML: cute.Tensor,
    mSink: cute.Tensor,
    use_sink: Int32,
    use_ml: Int32,
    token: Int32,
    head0: Int32,
    n_rows: cutlass.Constexpr,
    d_v: cutlass.Constexpr,
    tid: Int32,
    n_threads: cutlass.Constexpr,
):
    """Merge the parts of heads ``head0 .. head0 + n_rows - 1`` of decode token ``token``.

    ``mOp [n_splits, T, h, d_v]`` float32 parts, ``mLp`` / ``mMLp [n_splits, T, h]`` their lse /
    max_logits; ``mOut [b, s_q, h, d_v]`` bf16, ``mLse`` / ``mML [b, s_q, h]`` float32 -- all
    contiguous.  One warp per (head, 128-column group), the combine kernel's
    :func:`~mla_kernels.common.combine.merge_item`; the sink (``use_sink``) is applied here."""
    n_parts = mLp.shape[0]
    n_tok = mLp.shape[1]
    h = mLp.shape[2]
    P = n_tok * h
    lay2 = cute.make_layout((n_parts, P), stride=(P, 1))
    mL2 = cute.make_tensor(mLp.iterator, lay2)
    mML2 = cute.make_tensor(mMLp.iterator, lay2)
    mO3 = cute.make_tensor(mOp.iterator, cute.make_layout((n_parts, P, d_v), stride=(P * d_v, d_v, 1)))
    mOut2 = cute.make_tensor(mOut.iterator, cute.make_layout((P, d_v), stride=(d_v, 1)))
    mLse1 = cute.make_tensor(mLse.iterator, cute.make_layout(P))
    mML1 = cute.make_tensor(mML.iterator, cute.make_layout(P))
    n_groups = d_v // 128  # float32 parts: 32 lanes x 4 columns per group
    n_warps = n_threads // 32
    per_warp = (n_rows * n_groups) // n_warps
    assert per_warp * n_warps == n_rows * n_groups
    warp = tid // 32
    lane = tid % 32
    for k in cutlass.range(per_warp, unroll=1):
        item = warp + k * n_warps
        row = token * h + head0 + item // n_groups
        merge_item(mO3, mL2, mSink, mOut2, mLse1, mML2, mML1, h, use_sink, use_ml, row, item % n_groups, lane, d_v,
                   cutlass.Float32, cutlass.BFloat16, True)
