"""Device code shared by the sm90 decode kernels (``sm90/decode.py``, ``sm90/decode_narrow.py``),
CuTe DSL.  Kernel files must not import each other, so what both need lives here:

* :func:`last_arrival` / :func:`merge_block` -- the fused split combine ("the last block
  combines", as flash-decoding's single-launch variant): every split CTA of a row (a decode token
  and the heads one CTA holds) stores its float32 partial and lse, makes them visible at GPU
  scope, and takes a ticket from the row's arrival counter; the CTA that draws the last ticket
  resets the counter (so the plan's workspace is zero again for the next launch or graph replay)
  and merges the row's parts in split order -- the order, hence the result, does not depend on
  which CTA arrives last.
* :func:`tiled_mma` / :func:`issue_mma` -- the wgmma issue loop both kernels use (sm_90a).
* :class:`PairedBlockConsumer` / :func:`paired_producer_loop` -- the 64-head kernel's main loop:
  the paired-block schedule, whose consumer side the prefill forward (``sm90/fwd.py``) shares (its
  producer, with the indices fetched a pair ahead, stays there).
* :class:`DecodeContract` / :class:`FusedDecodeContract` -- the host entry points of the
  argument contract (``common/decode_host.py``) both kernels share, :func:`flat_views` (the cache
  as rows, the indices as tokens), :func:`cta_coords`, :func:`store_lse_ml` (one head's lse and
  max_logits, ``+inf`` / ``-inf`` when empty) and :func:`fused_tail` (the fused combine's tail).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Boolean, Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.cute.nvgpu import warp, warpgroup
from cutlass.cute.nvgpu.common import OperandMajorMode

from . import decode_parts as dp
from . import device as dev
from .combine import merge_item

# Named barriers of the fused tail (ids no decode kernel uses otherwise; 256 consumer threads).
BAR_ARRIVE = 8
BAR_LAST = 9


@dsl_user_op
def barrier_or(pred: Int32, bar_id: int, n_threads: int, *, loc=None, ip=None) -> Int32:
    """``bar.red.or.pred`` over ``n_threads`` threads at named barrier ``bar_id``: 1 in every
    thread if any thread's ``pred`` is non-zero, else 0 (a barrier and a broadcast in one, no
    shared memory)."""
    return Int32(llvm.inline_asm(
        T.i32(),
        [Int32(pred).ir_value(loc=loc, ip=ip)],
        "{ .reg .pred p, q; setp.ne.s32 p, $1, 0; "
        f"barrier.red.or.pred q, {bar_id}, {n_threads}, p; selp.s32 $0, 1, 0, q; }}",
        "=r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


@cute.jit
def last_arrival(
    mCnt: cute.Tensor,
    row_id: Int32,
    n_splits: Int32,
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
    earlier one (each released its CTA's parts); thread 0 fences, the ``bar_b`` reduction
    (:func:`barrier_or`) carries the verdict to the CTA, and every thread fences again before it
    reads the parts (no stale L1 line survives an acquire fence).  (A shared-memory flag written
    by thread 0 between two barriers drew 33 potential-RAW reports from racecheck in the narrow
    kernel; the barrier reduction needs no shared memory.)"""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.barrier(barrier_id=bar_a, number_of_threads=n_threads)
    last = Int32(0)
    if tid == 0:
        old = cute.arch.atomic_add(mCnt.iterator + row_id, Int32(1), sem="acq_rel", scope="gpu")
        is_last = old == n_splits - 1
        if is_last:
            mCnt[row_id] = Int32(0)
        cute.arch.fence_acq_rel_gpu()
        last = Int32(cutlass.select_(is_last, Int32(1), Int32(0)))
    any_last = barrier_or(last, bar_b, n_threads) != Int32(0)
    if any_last:
        cute.arch.fence_acq_rel_gpu()
    return any_last


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


# ---------------------------------------------------------------------------------------------
# wgmma issue helpers (both decode kernels) and the paired-block schedule (64-head kernel)
# ---------------------------------------------------------------------------------------------


def tiled_mma(m: int, n: int, a_major, b_major, rs: bool = False):
    """A one-warpgroup bf16 -> float32 tiled wgmma of ``m x n``; A from registers when ``rs``."""
    src = warpgroup.OperandSource.RMEM if rs else warpgroup.OperandSource.SMEM
    return sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, a_major, b_major, Float32, (1, 1, 1), (m, n), src)


@cute.jit
def issue_mma(
    acc: cute.Tensor,
    tA: cute.Tensor,
    tB: cute.Tensor,
    k0: cutlass.Constexpr,
    k1: cutlass.Constexpr,
    clear: cutlass.Constexpr,
    m: cutlass.Constexpr,
    n: cutlass.Constexpr,
    a_major: cutlass.Constexpr,
    b_major: cutlass.Constexpr,
    rs: cutlass.Constexpr = False,
):
    """Issue and commit ``acc (+)= sum_{k0 <= k < k1} A[:, :, k] B[:, :, k]`` (the first product
    overwrites ``acc`` when ``clear``).  The tiled MMA is made here, once per call: its ACCUMULATE
    field must not leak across dynamic regions."""
    mma = tiled_mma(m, n, a_major, b_major, rs)
    cute.nvgpu.warpgroup.fence()
    for k in cutlass.range_constexpr(k0, k1):
        mma.set(warpgroup.Field.ACCUMULATE, not (clear and k == k0))
        cute.gemm(mma, acc, tA[None, None, k], tB[None, None, k], acc)
    cute.nvgpu.warpgroup.commit_group()


@cute.jit
def for_pairs(num_iters: Int32, alt: cutlass.Constexpr, body: cutlass.Constexpr):
    """Run ``body(it, parity, odd, next_odd)`` for the block pairs ``it < num_iters``: one traced
    body with a dynamic parity (the fixed ring), or -- ``alt``, the alternating ring -- the loop
    unrolled by two so that each parity's buffer choices are static (``odd``: this pair has its
    right halves traded, ``next_odd``: the next one)."""
    if const_expr(alt):
        for it2 in cutlass.range((num_iters + 1) // 2, unroll=1):
            it = 2 * it2
            body(it, 0, False, True)
            if it + 1 < num_iters:
                body(it + 1, 1, True, False)
    else:
        for it in cutlass.range(num_iters, unroll=1):
            body(it, it & 1, False, False)


def right_halves(k0r, k1r, sK0_addr, sK1_addr, alt: bool, odd: bool):
    """The producer's order of a pair's two right halves (k-tiles ``n_left..``), the order they go
    free: ``(barrier, buffer address, block slot)`` -- slot 0 is WG0's block, 1 WG1's.  Fixed ring:
    WG1's (buffer 1, freed first), then WG0's (buffer 0).  Alternating ring: WG0's block in the
    half freed early (buffer 0 in even pairs, 1 in odd ones), then WG1's."""
    if not alt:
        return ((k1r, sK1_addr, 1), (k0r, sK0_addr, 0))
    if odd:
        return ((k1r, sK1_addr, 0), (k0r, sK0_addr, 1))
    return ((k0r, sK0_addr, 0), (k1r, sK1_addr, 1))


def p0_tiles(storage, sP_layout, n_k_tiles: int, s0_in_rope: bool, alt: bool):
    """``(sS0, sS0b)``: where WG0 hands P0 to WG1 in even / odd pairs.  At d_qk 576 the RoPE tile
    (k-tile ``n_k_tiles - 1``) of WG0's block, free once its QK product is done: buffer 0's, and
    with the alternating ring buffer 1's in odd pairs (``sS0b``; else None); at d_qk 512 the
    kernel's own ``sS0`` buffer in every pair."""
    if not s0_in_rope:
        return storage.sS0.get_tensor(sP_layout.outer, swizzle=sP_layout.inner), None

    def rope_tile(buf):
        ptr = buf.data_ptr() + (n_k_tiles - 1) * B_TOPK * 64
        return cute.make_tensor(cute.recast_ptr(ptr, sP_layout.inner), sP_layout.outer)

    return rope_tile(storage.sK0), (rope_tile(storage.sK1) if alt else None)


B_H = 64  # heads per CTA of the paired schedule (one wgmma M tile)
B_TOPK = 64  # slots per block


class PairedBlockConsumer:
    """The two consumer warpgroups of the 64-head decode CTA and of the prefill forward
    (``sm90/fwd.py``): the paired-block schedule -- blocks in pairs, WG0 owns output columns
    ``0 .. d_v/2``, WG1 the rest; WG0 finds block 0's row max, WG1 block 1's final max (exchanged
    through ``sM0`` / ``sM1`` with :class:`~mla_kernels.common.device.PhaseSignal`), each WG's P
    goes to the other through smem (``sS0`` / ``sS1``, named barriers ``bar_s0`` / ``bar_s1``).

    The constructor (plain Python, no dynamic control flow) makes the fragments and views;
    :meth:`loop` runs the blocks; ``acc_o``, ``rM`` (running max, scaled log2) and ``rL``
    (partial row sums) hold the result for the caller's epilogue."""

    def __init__(self, sQ, sK0, sK1, sS0, sS1, idx_in_wg, wg, d_qk: int, d_v: int, sS0b=None):
        self.d_v = d_v
        self.n_k_tiles = d_qk // 64
        self.n_left = (d_v // 2) // 64
        mma_qk = tiled_mma(B_H, B_TOPK, OperandMajorMode.K, OperandMajorMode.K)
        mma_rs = tiled_mma(B_H, d_v // 2, OperandMajorMode.K, OperandMajorMode.MN, True)
        mma_ss = tiled_mma(B_H, d_v // 2, OperandMajorMode.K, OperandMajorMode.MN, False)
        self.mma_rs = mma_rs
        self.mma_qk = mma_qk
        thr_qk = mma_qk.get_slice(idx_in_wg)
        thr_rs = mma_rs.get_slice(idx_in_wg)
        thr_ss = mma_ss.get_slice(idx_in_wg)
        self.lane_quad = idx_in_wg % 4
        self.row0 = dev.fragment_row(idx_in_wg, 0)
        self.row1 = dev.fragment_row(idx_in_wg, 1)
        self.tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
        self.tSrK0 = thr_qk.make_fragment_B(thr_qk.partition_B(sK0))
        self.tSrK1 = thr_qk.make_fragment_B(thr_qk.partition_B(sK1))
        self.acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((B_H, B_TOPK)))
        self.acc_o = thr_rs.make_fragment_C(thr_rs.partition_shape_C((B_H, d_v // 2)))
        self.acc_o.fill(0.0)
        self.tOrP = thr_rs.make_fragment_A(thr_rs.partition_shape_A((B_H, B_TOPK)))
        self.tOrP_acc = cute.make_tensor(self.tOrP.iterator, self.acc_s.layout)  # P in the accumulator's order
        # V^T views (d_v/2 x 64 tokens, MN-major) of this WG's half of each KV buffer
        vt_layout = cute.select(sK0.layout, mode=[1, 0])
        sVt0 = cute.local_tile(cute.make_tensor(sK0.iterator, vt_layout), (d_v // 2, B_TOPK), (wg, 0))
        sVt1 = cute.local_tile(cute.make_tensor(sK1.iterator, vt_layout), (d_v // 2, B_TOPK), (wg, 0))
        self.tOrV0_rs = thr_rs.make_fragment_B(thr_rs.partition_B(sVt0))
        self.tOrV1_rs = thr_rs.make_fragment_B(thr_rs.partition_B(sVt1))
        self.tOrV0_ss = thr_ss.make_fragment_B(thr_ss.partition_B(sVt0))
        self.tOrV1_ss = thr_ss.make_fragment_B(thr_ss.partition_B(sVt1))
        self.tOrS0 = thr_ss.make_fragment_A(thr_ss.partition_A(sS0))
        self.tOrS1 = thr_ss.make_fragment_A(thr_ss.partition_A(sS1))
        st_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), BFloat16)
        self.thr_st_p = cute.make_tiled_copy_C(st_atom, mma_qk).get_slice(idx_in_wg)
        self.tPsS0 = self.thr_st_p.partition_D(sS0)
        self.tPsS1 = self.thr_st_p.partition_D(sS1)
        # the alternating ring (``loop(alt=True)``): in odd pairs WG0's P0 goes to ``sS0b`` (the
        # RoPE tile of buffer 1 at d_qk 576, where WG0's block then has its right half)
        if sS0b is None:
            sS0b = sS0
        self.tOrS0b = thr_ss.make_fragment_A(thr_ss.partition_A(sS0b))
        self.tPsS0b = self.thr_st_p.partition_D(sS0b)
        self.tPrP = self.thr_st_p.retile(self.tOrP_acc)
        self.rM = cute.make_rmem_tensor((2,), Float32)
        self.rL = cute.make_rmem_tensor((2,), Float32)
        self.rM.fill(dev.MAX_INIT)
        self.rL.fill(0.0)

    @cute.jit
    def qk(self, tSrK, t0: cutlass.Constexpr, t1: cutlass.Constexpr, clear: cutlass.Constexpr):
        """Issue S (+)= Q[:, tiles t0..t1) K[:, tiles t0..t1)^T."""
        issue_mma(self.acc_s, self.tSrQ, tSrK, 4 * t0, 4 * t1, clear, B_H, B_TOPK, OperandMajorMode.K,
                  OperandMajorMode.K)

    @cute.jit
    def pv(self, rs: cutlass.Constexpr, tA, tB):
        """Issue O += P V over the 64 tokens of a block (P from registers when ``rs``)."""
        issue_mma(self.acc_o, tA, tB, 0, B_TOPK // 16, False, B_H, self.d_v // 2, OperandMajorMode.K,
                  OperandMajorMode.MN, rs)

    @cute.jit
    def loop(
        self,
        sValid: cute.Tensor,
        sM0: cute.Tensor,
        sM1: cute.Tensor,
        k0l: cutlass.Constexpr,
        k0r: cutlass.Constexpr,
        k1l: cutlass.Constexpr,
        k1r: cutlass.Constexpr,
        bar_valid,
        max0_ready: cutlass.Constexpr,
        max1_ready: cutlass.Constexpr,
        bar_s0: cutlass.Constexpr,
        bar_s1: cutlass.Constexpr,
        num_iters: Int32,
        wg: Int32,
        scale_log2: Float32,
        alt: cutlass.Constexpr = False,
    ):
        """``num_iters`` block pairs: QK^T, masks, online softmax, PV.

        ``alt`` (the alternating ring): the right halves (k-tiles ``n_left..``) of the two buffers
        swap owners every pair.  A pair's WG0 block is left half 0 + right half 0 (even pairs) or
        right half 1 (odd pairs) -- the two halves its last readers free early in the previous pair
        (after the products with their own P) -- and WG1's block the two halves freed last (after
        the products with the peer's P), so WG0's next QK never waits for a gather issued at the
        end of a pair.  Without ``alt`` block 0 of a pair is always buffer 0."""
        if wg == 0:
            if num_iters > 0:
                k0l.wait_ready(0)
                self.qk(self.tSrK0, 0, self.n_left, True)
                k0r.wait_ready(0)
                self.qk(self.tSrK0, self.n_left, self.n_k_tiles, False)
                cute.nvgpu.warpgroup.wait_group(0)
            for_pairs(num_iters, alt, lambda it, parity, odd, next_odd: self._wg0_pair(
                it, num_iters, parity, odd, next_odd, sValid, sM0, sM1, k0l, k0r, k1l, k1r, bar_valid, max0_ready,
                max1_ready, bar_s0, bar_s1, scale_log2))
        else:
            for_pairs(num_iters, alt, lambda it, parity, odd, next_odd: self._wg1_pair(
                parity, odd, sValid, sM1, k0r, k1l, k1r, bar_valid, max0_ready, max1_ready, bar_s0, bar_s1,
                scale_log2, sM0))

    @cute.jit
    def _wg0_pair(self, it: Int32, num_iters: Int32, parity, odd: cutlass.Constexpr, next_odd: cutlass.Constexpr,
                  sValid, sM0, sM1, k0l: cutlass.Constexpr, k0r: cutlass.Constexpr, k1l: cutlass.Constexpr,
                  k1r: cutlass.Constexpr, bar_valid, max0_ready: cutlass.Constexpr, max1_ready: cutlass.Constexpr,
                  bar_s0: cutlass.Constexpr, bar_s1: cutlass.Constexpr, scale_log2: Float32):
        """WG0's part of pair ``it`` (its QK product already issued and waited for); ``odd``: this
        pair's block has its right half in buffer 1 (P0 goes to ``sS0b``), ``next_odd``: the next
        pair's does."""
        acc_s, acc_o, rM, rL = self.acc_s, self.acc_o, self.rM, self.rL
        row0, row1 = self.row0, self.row1
        cute.arch.mbarrier_wait(bar_valid, parity)
        dev.mask_scores(acc_s, sValid[0], sValid[1], self.lane_quad)
        # online softmax of block 0 against WG0's running max; publish the max
        dev.online_softmax(acc_s, acc_o, rM, rL, scale_log2, rM[0], rM[1])
        if self.lane_quad == 0:
            sM0[row0] = rM[0]
            sM0[row1] = rM[1]
        max0_ready.arrive()
        # O_left += P0 V0_left (P0 from registers)
        self.tOrP_acc.store(acc_s.load().to(BFloat16))
        self.pv(True, self.tOrP, self.tOrV0_rs)
        cute.nvgpu.warpgroup.wait_group(0)
        k0l.release()
        # the final max from WG1: rescale P0, hand it to WG1 through smem
        max1_ready.wait(parity)
        m0 = sM1[row0]
        m1 = sM1[row1]
        sf0 = cute.math.exp2(rM[0] - m0, fastmath=True)
        sf1 = cute.math.exp2(rM[1] - m1, fastmath=True)
        rM[0] = m0
        rM[1] = m1
        dev.scale_rows(acc_s, sf0, sf1)
        self.tOrP_acc.store(acc_s.load().to(BFloat16))
        cute.copy(self.thr_st_p, self.tPrP, self.tPsS0b if const_expr(odd) else self.tPsS0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier_arrive(barrier_id=bar_s0, number_of_threads=256)
        # O_left += P1 V1_left (P1 from WG1 through smem)
        cute.arch.barrier(barrier_id=bar_s1, number_of_threads=256)
        dev.scale_rows(acc_o, sf0, sf1)
        rL[0] = rL[0] * sf0
        rL[1] = rL[1] * sf1
        self.pv(False, self.tOrS1, self.tOrV1_ss)
        if it + 1 < num_iters:
            nparity = parity ^ 1
            k0l.wait_ready(nparity)
            self.qk(self.tSrK0, 0, self.n_left, True)
            cute.nvgpu.warpgroup.wait_group(1)
            k1l.release()
            # the right half of the next pair's block: buffer 1's after an odd pair (alternating ring)
            k_r, tSrK_r = (k1r, self.tSrK1) if const_expr(next_odd) else (k0r, self.tSrK0)
            k_r.wait_ready(nparity)
            self.qk(tSrK_r, self.n_left, self.n_k_tiles, False)
            cute.nvgpu.warpgroup.wait_group(0)
        else:
            cute.nvgpu.warpgroup.wait_group(0)
            k1l.release()

    @cute.jit
    def _wg1_pair(self, parity, odd: cutlass.Constexpr, sValid, sM1, k0r: cutlass.Constexpr,
                  k1l: cutlass.Constexpr, k1r: cutlass.Constexpr, bar_valid, max0_ready: cutlass.Constexpr,
                  max1_ready: cutlass.Constexpr, bar_s0: cutlass.Constexpr, bar_s1: cutlass.Constexpr,
                  scale_log2: Float32, sM0):
        """WG1's pair: block 1 (left half 1 + right half 1, or right half 0 when ``odd``), then
        the peer's P0 against the right half of WG0's block."""
        acc_s, acc_o, rM, rL = self.acc_s, self.acc_o, self.rM, self.rL
        row0, row1 = self.row0, self.row1
        # own block's right half and the peer block's (they trade buffers in odd pairs)
        k_own, tSrK_own, tOrV_own = (k0r, self.tSrK0, self.tOrV0_rs) if const_expr(odd) else (k1r, self.tSrK1,
                                                                                               self.tOrV1_rs)
        k_peer, tOrS_peer, tOrV_peer = (k1r, self.tOrS0b, self.tOrV1_ss) if const_expr(odd) else (k0r, self.tOrS0,
                                                                                                   self.tOrV0_ss)
        k_own.wait_ready(parity)
        self.qk(tSrK_own, self.n_left, self.n_k_tiles, True)
        k1l.wait_ready(parity)
        self.qk(self.tSrK1, 0, self.n_left, False)
        cute.nvgpu.warpgroup.wait_group(0)
        cute.arch.mbarrier_wait(bar_valid, parity)
        dev.mask_scores(acc_s, sValid[2], sValid[3], self.lane_quad)
        # online softmax of block 1 against max(WG0's max, own); publish the final max
        max0_ready.wait(parity)
        dev.online_softmax(acc_s, acc_o, rM, rL, scale_log2, sM0[row0], sM0[row1])
        if self.lane_quad == 0:
            sM1[row0] = rM[0]
            sM1[row1] = rM[1]
        max1_ready.arrive()
        # O_right += P1 V1_right (registers), then hand P1 to WG0, O_right += P0 V0_right
        self.tOrP_acc.store(acc_s.load().to(BFloat16))
        self.pv(True, self.tOrP, tOrV_own)
        cute.copy(self.thr_st_p, self.tPrP, self.tPsS1)
        cute.arch.barrier(barrier_id=bar_s0, number_of_threads=256)
        self.pv(False, tOrS_peer, tOrV_peer)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier_arrive(barrier_id=bar_s1, number_of_threads=256)
        cute.nvgpu.warpgroup.wait_group(1)
        k_own.release()
        cute.nvgpu.warpgroup.wait_group(0)
        k_peer.release()


@cute.jit
def paired_producer_loop(
    gather,
    sK0_addr: Int32,
    sK1_addr: Int32,
    sValid: cute.Tensor,
    k0l: cutlass.Constexpr,
    k0r: cutlass.Constexpr,
    k1l: cutlass.Constexpr,
    k1r: cutlass.Constexpr,
    bar_valid,
    blk0: Int32,
    num_iters: Int32,
    ptid: Int32,
    warp_in_wg: Int32,
    n_left: cutlass.Constexpr,
    n_k_tiles: cutlass.Constexpr,
    alt: cutlass.Constexpr = False,
):
    """The producer of :class:`PairedBlockConsumer`: block ``blk0 + 2 it`` -> buffer 0, the next
    -> buffer 1, in the halves' order the consumers free them (0L, 1R, 0R, 1L); then the four
    validity words (one per warp: buffer ``w // 2``, tokens ``32 (w % 2) ..``) and one arrival
    each on ``bar_valid``.  ``alt`` (the consumers' alternating ring): in odd pairs the right
    halves of the two blocks trade buffers; the order is then left 0, WG0's right, WG1's right,
    left 1 (early frees first)."""
    for_pairs(num_iters, alt, lambda it, parity, odd, next_odd: _producer_pair(
        gather, sK0_addr, sK1_addr, sValid, k0l, k0r, k1l, k1r, bar_valid, blk0 + 2 * it, parity, ptid, warp_in_wg,
        n_left, n_k_tiles, alt, odd))


@cute.jit
def _producer_pair(gather, sK0_addr: Int32, sK1_addr: Int32, sValid: cute.Tensor, k0l: cutlass.Constexpr,
                   k0r: cutlass.Constexpr, k1l: cutlass.Constexpr, k1r: cutlass.Constexpr, bar_valid, blk: Int32,
                   parity, ptid: Int32, warp_in_wg: Int32, n_left: cutlass.Constexpr, n_k_tiles: cutlass.Constexpr,
                   alt: cutlass.Constexpr, odd: cutlass.Constexpr):
    """One pair of :func:`paired_producer_loop`: blocks ``blk`` (WG0's) and ``blk + 1`` (WG1's)."""
    gather.load_indices(blk, 0)
    gather.load_indices(blk + 1, 1)
    k0l.wait_free(parity)
    gather.copy_tiles(sK0_addr, 0, 0, n_left)
    k0l.commit_cp_async()
    for k_r, addr, slot in right_halves(k0r, k1r, sK0_addr, sK1_addr, alt, odd):
        k_r.wait_free(parity)
        gather.copy_tiles(addr, slot, n_left, n_k_tiles)
        k_r.commit_cp_async()
    k1l.wait_free(parity)
    gather.copy_tiles(sK1_addr, 1, 0, n_left)
    k1l.commit_cp_async()
    bits = gather.valid_word(blk + warp_in_wg // 2)
    if ptid % 32 == 0:
        sValid[warp_in_wg] = bits
        cute.arch.mbarrier_arrive(bar_valid)


# ---------------------------------------------------------------------------------------------
# What both decode kernels share around their main loops
# ---------------------------------------------------------------------------------------------


class DecodeContract:
    """The two-launch entry point of a decode kernel (``common/decode_host.py``'s contract): the
    subclass's ``_launch`` takes the fused tail's four arguments after ``mML``; here they are
    placeholders the kernel never touches."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mBias: cute.Tensor,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mBT: cute.Tensor,
        mTL: cute.Tensor,
        mSink: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mML: cute.Tensor,
        scale_log2: Float32,
        flags: Int32,
        page_size: Int32,
        page_mul: Int32,
        page_shift: Int32,
        tl_stride_b: Int32,
        tl_stride_s: Int32,
        n_splits: Int32,
        blocks_per_split: Int32,
        stream,
    ):
        self._launch(mQ, mBias, mKV, mIdx, mBT, mTL, mSink, mO, mLse, mML, mO, mLse, mML, mLse, scale_log2, flags,
                     page_size, page_mul, page_shift, tl_stride_b, tl_stride_s, n_splits, blocks_per_split, stream)


class FusedDecodeContract:
    """The one-launch entry point (the combine folded in): the two-launch contract plus the
    merged ``(out, lse, max_logits)`` and the arrival counters after ``mML``."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mBias: cute.Tensor,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mBT: cute.Tensor,
        mTL: cute.Tensor,
        mSink: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mML: cute.Tensor,
        mOF: cute.Tensor,
        mLseF: cute.Tensor,
        mMLF: cute.Tensor,
        mCnt: cute.Tensor,
        scale_log2: Float32,
        flags: Int32,
        page_size: Int32,
        page_mul: Int32,
        page_shift: Int32,
        tl_stride_b: Int32,
        tl_stride_s: Int32,
        n_splits: Int32,
        blocks_per_split: Int32,
        stream,
    ):
        self._launch(mQ, mBias, mKV, mIdx, mBT, mTL, mSink, mO, mLse, mML, mOF, mLseF, mMLF, mCnt, scale_log2, flags,
                     page_size, page_mul, page_shift, tl_stride_b, tl_stride_s, n_splits, blocks_per_split, stream)


def flat_views(mKV: cute.Tensor, mIdx: cute.Tensor, n_tok, d_qk: int):
    """The paged cache ``[pages, page_size, 1, d_qk]`` as rows ``[pages * page_size, d_qk]`` and
    the indices ``[b, s_q, topk]`` as ``[n_tok, topk]`` (both contiguous)."""
    mKV2 = cute.make_tensor(mKV.iterator, cute.make_layout((mKV.shape[0] * mKV.shape[1], d_qk), stride=(d_qk, 1)))
    topk = mIdx.shape[2]
    mIdx2 = cute.make_tensor(mIdx.iterator, cute.make_layout((n_tok, topk), stride=(topk, 1)))
    return mKV2, mIdx2


def cta_coords(token, s_q):
    """``(b_idx, s_in)``: the request and its query position of decode token ``token``."""
    return token // s_q, token % s_q


@cute.jit
def store_lse_ml(mLse: cute.Tensor, mML: cute.Tensor, off, l: Float32, m_log2: Float32, flags: Int32):
    """One head's ``lse = ln(l) + m`` (``+inf`` for an empty head, ``l == 0``) at element ``off``
    of ``mLse``, and with ``F_MAX_LOGITS`` its max logit (``-inf`` when empty) in ``mML``;
    ``m_log2`` is the running max in scaled log2 units."""
    empty = l == Float32(0.0)
    dp.store_f32(mLse, off, Float32(cutlass.select_(empty, Float32(math.inf), cute.math.log(l) + m_log2 * dev.LN2)))
    if dp.flag(flags, dp.F_MAX_LOGITS):
        dp.store_f32(mML, off, Float32(cutlass.select_(empty, Float32(-math.inf), m_log2 * dev.LN2)))


@cute.jit
def fused_tail(mCnt, row_id, n_splits, tidx, mO, mLse, mML, mOF, mLseF, mMLF, mSink, flags, token, head0,
               n_rows: cutlass.Constexpr, d_v: cutlass.Constexpr):
    """The fused combine after a split CTA's part is stored (its 256 consumer threads): the CTA
    that arrives last at ``mCnt[row_id]`` merges heads ``head0 .. head0 + n_rows - 1``."""
    last = last_arrival(mCnt, row_id, n_splits, tidx, 256, BAR_ARRIVE, BAR_LAST)
    if last:
        merge_block(mO, mLse, mML, mOF, mLseF, mMLF, mSink, flags & Int32(dp.F_SINK), flags & Int32(dp.F_MAX_LOGITS),
                    token, head0, n_rows, d_v, tidx, 256)
