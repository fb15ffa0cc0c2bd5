"""Sparse MLA decode on Hopper (sm_90a), head blocks of 64 (h_q a multiple of 64), CuTe DSL.

Split-top-k flash-decoding with the prefill forward's CTA (``sm90/fwd.py``): one CTA per
(decode token, 64-head block, split) processes the split's top-k blocks of 64 slots and writes

* split mode: a float32 partial ``out_parts[split, token, head, :]`` normalised by the split's own
  softmax sum, its ``lse`` (``+inf`` for an empty split) and optionally its ``max_logits``; the
  lse combine (``common/combine.py``) merges the splits and applies the sink;
* direct mode (one split covers the request): the bf16 ``out`` with the sink applied, ``lse`` and
  optionally ``max_logits``, exactly as the forward.

384 threads in three warpgroups, as in the forward (whose schedule this follows): WG0/WG1 are
consumers (both hold the 64 heads; WG0 owns output columns 0..255, WG1 256..511; blocks taken in
pairs, the row max exchanged through smem, each WG's P handed to the other through smem), WG2 the
producer gathering KV rows with 16-byte ``cp.async`` in halves.  What differs from the forward:

* Q is loaded by the consumers with 16-byte loads, ``q_bias`` added in registers (no TMA);
* the producer gathers through :class:`~mla_kernels.common.decode_parts.PagedKvGather` (physical
  ids, or logical positions translated through the block table) and only the split's blocks; the
  padding block of an odd pair is masked at the split's end;
* the epilogue stores O from registers with 16-byte (float32) or 8-byte (bf16) vector stores.

Runtime flags (``common/decode_parts.F_*``) switch q_bias, the block table, topk_length, the
sink and max_logits without a recompile; static: ``d_qk``, ``h_q`` (through the fake tensors)
and the mode.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Uint32, const_expr
from cutlass.cute.nvgpu import warp, warpgroup
from cutlass.cute.nvgpu.common import OperandMajorMode

from ..common import decode_device as dd
from ..common import decode_parts as dp
from ..common import device as dev

B_H = 64  # heads per CTA (one wgmma M tile)
B_TOPK = dp.BLOCK  # indices per block
THREADS = 384
SMEM_LIMIT = 232448

BAR_S0_READY = 3
BAR_S1_READY = 4
BAR_L_READY = 5
BAR_Q_READY = 6  # Q (+ bias) stored by the consumers


class SparseMlaDecodeSm90:
    """Static configuration + host launcher + device kernel of the sm90 split decode (h_q % 64 == 0)."""

    def __init__(self, d_qk: int, split: bool, d_v: int = 512, l2_prefetch: int = 128, fused: bool = False):
        if d_qk not in (512, 576):
            raise ValueError(f"sm90 decode supports d_qk 512 or 576, got {d_qk}")
        if d_v != 512:
            raise ValueError(f"sm90 decode supports d_v 512, got {d_v}")
        self.d_qk = d_qk
        self.d_v = d_v
        self.split = split
        # split mode only: the last CTA of a row merges the parts (common/decode_device.py)
        self.fused = fused and split
        self.l2_prefetch = l2_prefetch  # the gather's L2 prefetch size (decode_parts.PagedKvGather)
        self.n_k_tiles = d_qk // 64
        self.n_left = (d_v // 2) // 64
        self.s0_in_rope = d_qk == 576
        self.regs_consumer = 216
        self.regs_producer = 72
        assert 2 * self.regs_consumer + self.regs_producer <= 504
        self.smem_bytes = 0

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
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
        tl_stride_b: Int32,
        tl_stride_s: Int32,
        n_splits: Int32,
        blocks_per_split: Int32,
        stream,
    ):
        """The two-launch contract (``common/decode_host.py``); the fused tail's arguments are
        placeholders that the kernel never touches."""
        self._launch(mQ, mBias, mKV, mIdx, mBT, mTL, mSink, mO, mLse, mML, mO, mLse, mML, mLse, scale_log2, flags,
                     page_size, tl_stride_b, tl_stride_s, n_splits, blocks_per_split, stream)

    @cute.jit
    def _launch(
        self,
        mQ: cute.Tensor,  # [b, s_q, h_q, d_qk] bf16
        mBias: cute.Tensor,  # [b | 1, h_q, d_qk] bf16
        mKV: cute.Tensor,  # [num_pages, page_size, 1, d_qk] bf16
        mIdx: cute.Tensor,  # [b, s_q, topk] int32
        mBT: cute.Tensor,  # [b | 1, max_pages] int32
        mTL: cute.Tensor,  # [b] or [b * s_q] int32
        mSink: cute.Tensor,  # [h_q] f32
        mO: cute.Tensor,  # split: [n_splits, b*s_q, h_q, d_v] f32; direct: [b, s_q, h_q, d_v] bf16
        mLse: cute.Tensor,  # split: [n_splits, b*s_q, h_q]; direct: [b, s_q, h_q] f32
        mML: cute.Tensor,  # like mLse (written only with F_MAX_LOGITS)
        mOF: cute.Tensor,  # fused: the merged [b, s_q, h_q, d_v] bf16
        mLseF: cute.Tensor,  # fused: the merged [b, s_q, h_q] f32
        mMLF: cute.Tensor,  # fused: the merged max_logits
        mCnt: cute.Tensor,  # fused: [b*s_q*n_hblk] int32 arrival counters (zero between launches)
        scale_log2: Float32,
        flags: Int32,
        page_size: Int32,
        tl_stride_b: Int32,
        tl_stride_s: Int32,
        n_splits: Int32,
        blocks_per_split: Int32,
        stream,
    ):
        d_qk = self.d_qk
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
        sQ_layout = cute.tile_to_shape(k_atom, (B_H, d_qk), (0, 1))
        sK_layout = cute.tile_to_shape(k_atom, (B_TOPK, d_qk), (0, 1))
        sP_layout = cute.tile_to_shape(k_atom, (B_H, B_TOPK), (0, 1))
        s0_elems = 0 if const_expr(self.s0_in_rope) else B_H * B_TOPK

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_layout)], 1024]
            sK0: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sK1: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sS1: cute.struct.Align[cute.struct.MemRange[BFloat16, B_H * B_TOPK], 1024]
            sS0: cute.struct.Align[cute.struct.MemRange[BFloat16, max(s0_elems, 8)], 1024]
            # 4 x (ready, free), valid, WG0's max published, WG1's final max published
            mbar: cute.struct.MemRange[cutlass.Int64, 11]
            sValid: cute.struct.MemRange[Uint32, 4]
            # the row-max exchange: one array per writer and mbarrier signals, as in the forward
            # (racecheck-clean; one shared array with named bar.arrive/bar.sync was not)
            sM0: cute.struct.MemRange[Float32, B_H]  # written by WG0 only
            sM1: cute.struct.MemRange[Float32, B_H]  # written by WG1 only
            sL: cute.struct.MemRange[Float32, 2 * B_H]
            sFlag: cute.struct.MemRange[Int32, 4]  # fused: "this CTA merges the row"

        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes <= SMEM_LIMIT, f"smem {self.smem_bytes} > {SMEM_LIMIT}"

        b, s_q, h_q = mQ.shape[0], mQ.shape[1], mQ.shape[2]
        n_tok = b * s_q
        # flattened views: the cache as [rows, d_qk], the indices as [tokens, topk]
        mKV2 = cute.make_tensor(mKV.iterator, cute.make_layout((mKV.shape[0] * mKV.shape[1], d_qk), stride=(d_qk, 1)))
        topk = mIdx.shape[2]
        mIdx2 = cute.make_tensor(mIdx.iterator, cute.make_layout((n_tok, topk), stride=(topk, 1)))
        n_hblk = h_q // B_H
        self.kernel(
            mQ, mBias, mKV2, mIdx2, mBT, mTL, mSink, mO, mLse, mML, mOF, mLseF, mMLF, mCnt, scale_log2, flags,
            page_size, tl_stride_b, tl_stride_s, n_splits, blocks_per_split,
            sQ_layout, sK_layout, sP_layout, SharedStorage, n_hblk,
        ).launch(
            grid=[n_tok * n_hblk * n_splits, 1, 1],
            block=[THREADS, 1, 1],
            smem=self.smem_bytes,
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
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
        tl_stride_b: Int32,
        tl_stride_s: Int32,
        n_splits: Int32,
        blocks_per_split: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
        n_hblk: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        # a dependent combine (launched with PDL) may be scheduled now; it waits for this grid
        cute.arch.griddepcontrol_launch_dependents()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp_idx // 4
        idx_in_wg = tidx % 128
        h_blk = bidx % n_hblk
        rest = bidx // n_hblk
        split = rest % n_splits
        token = rest // n_splits
        s_q = mQ.shape[1]
        b_idx = token // s_q
        s_in = token % s_q

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar = storage.mbar.data_ptr()
        k0l = dev.HalfBufferBarriers(mbar + 0, mbar + 1)
        k0r = dev.HalfBufferBarriers(mbar + 2, mbar + 3)
        k1l = dev.HalfBufferBarriers(mbar + 4, mbar + 5)
        k1r = dev.HalfBufferBarriers(mbar + 6, mbar + 7)
        bar_valid = mbar + 8
        max0_ready = dev.PhaseSignal(mbar + 9)
        max1_ready = dev.PhaseSignal(mbar + 10)

        if warp_idx == 0:
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(4):
                    dev.HalfBufferBarriers.init(mbar + 2 * i, mbar + 1 + 2 * i, 128, 128)
                cute.arch.mbarrier_init(bar_valid, 4)
                max0_ready.init(128)
                max1_ready.init(128)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK0 = storage.sK0.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sK1 = storage.sK1.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sS1 = storage.sS1.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sS0 = None
        if const_expr(self.s0_in_rope):
            s0_ptr = storage.sK0.data_ptr() + (self.n_k_tiles - 1) * B_TOPK * 64
            sS0 = cute.make_tensor(cute.recast_ptr(s0_ptr, sP_layout.inner), sP_layout.outer)
        else:
            sS0 = storage.sS0.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)

        topk = mIdx.shape[1]
        topk_len = dp.topk_len_of(mTL, flags, b_idx, s_in, tl_stride_b, tl_stride_s, topk)
        blk0, num_blocks, bound = dp.split_range(split, blocks_per_split, topk_len)
        num_iters = (num_blocks + 1) // 2

        sValid = storage.sValid.get_tensor(cute.make_layout(4))
        sM0 = storage.sM0.get_tensor(cute.make_layout(B_H))
        sM1 = storage.sM1.get_tensor(cute.make_layout(B_H))
        sL = storage.sL.get_tensor(cute.make_layout(2 * B_H))
        sK0_ptr = storage.sK0.data_ptr()
        sK1_ptr = storage.sK1.data_ptr()
        sQ_ptr = storage.sQ.data_ptr()

        if wg == 2:
            cute.arch.setmaxregister_decrease(self.regs_producer)
            gather = dp.PagedKvGather(
                mKV, mIdx, token, bound, idx_in_wg, self.d_qk, 2, mBT, b_idx,
                dp.flag(flags, dp.F_BLOCK_TABLE), page_size, self.l2_prefetch,
            )
            self.producer(gather, sK0_ptr, sK1_ptr, sValid, k0l, k0r, k1l, k1r, bar_valid, blk0, num_iters,
                          idx_in_wg, warp_idx % 4)
        else:
            cute.arch.setmaxregister_increase(self.regs_consumer)
            # Q (+ bias) for this head block, by the 256 consumer threads
            dp.load_q_tile(mQ, mBias, flags & Int32(dp.F_BIAS), token, b_idx, h_blk * B_H, B_H, self.d_qk,
                           dev.smem_addr_u32(sQ_ptr), tidx, 256)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=BAR_Q_READY, number_of_threads=256)
            self.consumer(
                mSink, mO, mLse, mML, scale_log2, flags, sValid, sM0, sM1, sL, sQ, sK0, sK1, sS0, sS1,
                k0l, k0r, k1l, k1r, bar_valid, max0_ready, max1_ready, split, token, h_blk, num_iters, wg,
                idx_in_wg,
            )
            if const_expr(self.fused):
                sFlag = storage.sFlag.get_tensor(cute.make_layout(4))
                last = dd.last_arrival(mCnt, token * n_hblk + h_blk, n_splits, sFlag, tidx, 256, dd.BAR_ARRIVE,
                                       dd.BAR_LAST)
                if last:
                    dd.merge_block(mO, mLse, mML, mOF, mLseF, mMLF, mSink, flags & Int32(dp.F_SINK),
                                   flags & Int32(dp.F_MAX_LOGITS), token, h_blk * B_H, B_H, self.d_v, tidx, 256)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def producer(
        self,
        gather,
        sK0_ptr: cute.Pointer,
        sK1_ptr: cute.Pointer,
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
    ):
        """WG2: gather the split's KV rows with cp.async in halves; publish validity bitmasks."""
        sK0_addr = dev.smem_addr_u32(sK0_ptr)
        sK1_addr = dev.smem_addr_u32(sK1_ptr)
        for it in cutlass.range(num_iters, unroll=1):
            parity = it & 1
            blk = blk0 + 2 * it
            gather.load_indices(blk, 0)
            gather.load_indices(blk + 1, 1)
            k0l.wait_free(parity)
            gather.copy_tiles(sK0_addr, 0, 0, self.n_left)
            k0l.commit_cp_async()
            k1r.wait_free(parity)
            gather.copy_tiles(sK1_addr, 1, self.n_left, self.n_k_tiles)
            k1r.commit_cp_async()
            k0r.wait_free(parity)
            gather.copy_tiles(sK0_addr, 0, self.n_left, self.n_k_tiles)
            k0r.commit_cp_async()
            k1l.wait_free(parity)
            gather.copy_tiles(sK1_addr, 1, 0, self.n_left)
            k1l.commit_cp_async()
            bits = gather.valid_word(blk + warp_in_wg // 2)
            if ptid % 32 == 0:
                sValid[warp_in_wg] = bits
                cute.arch.mbarrier_arrive(bar_valid)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consumer(
        self,
        mSink: cute.Tensor,
        mO: cute.Tensor,
        mLse: cute.Tensor,
        mML: cute.Tensor,
        scale_log2: Float32,
        flags: Int32,
        sValid: cute.Tensor,
        sM0: cute.Tensor,
        sM1: cute.Tensor,
        sL: cute.Tensor,
        sQ: cute.Tensor,
        sK0: cute.Tensor,
        sK1: cute.Tensor,
        sS0: cute.Tensor,
        sS1: cute.Tensor,
        k0l: cutlass.Constexpr,
        k0r: cutlass.Constexpr,
        k1l: cutlass.Constexpr,
        k1r: cutlass.Constexpr,
        bar_valid,
        max0_ready: cutlass.Constexpr,
        max1_ready: cutlass.Constexpr,
        split: Int32,
        token: Int32,
        h_blk: Int32,
        num_iters: Int32,
        wg: Int32,
        idx_in_wg: Int32,
    ):
        """WG0 / WG1: QK^T, online softmax, PV (the forward's schedule), then the epilogue."""
        d_v = self.d_v
        mma_qk = self._mma_qk()
        mma_pv_rs = self._mma_pv(rs=True)
        mma_pv_ss = self._mma_pv(rs=False)
        thr_qk = mma_qk.get_slice(idx_in_wg)
        thr_rs = mma_pv_rs.get_slice(idx_in_wg)
        thr_ss = mma_pv_ss.get_slice(idx_in_wg)
        lane_quad = idx_in_wg % 4
        row0 = dev.fragment_row(idx_in_wg, 0)
        row1 = dev.fragment_row(idx_in_wg, 1)

        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK0 = thr_qk.make_fragment_B(thr_qk.partition_B(sK0))
        tSrK1 = thr_qk.make_fragment_B(thr_qk.partition_B(sK1))
        acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((B_H, B_TOPK)))
        acc_o = thr_rs.make_fragment_C(thr_rs.partition_shape_C((B_H, d_v // 2)))
        acc_o.fill(0.0)
        tOrP = thr_rs.make_fragment_A(thr_rs.partition_shape_A((B_H, B_TOPK)))
        tOrP_acc = cute.make_tensor(tOrP.iterator, acc_s.layout)

        vt_layout = cute.select(sK0.layout, mode=[1, 0])
        sVt0 = cute.local_tile(cute.make_tensor(sK0.iterator, vt_layout), (d_v // 2, B_TOPK), (wg, 0))
        sVt1 = cute.local_tile(cute.make_tensor(sK1.iterator, vt_layout), (d_v // 2, B_TOPK), (wg, 0))
        tOrV0_rs = thr_rs.make_fragment_B(thr_rs.partition_B(sVt0))
        tOrV1_rs = thr_rs.make_fragment_B(thr_rs.partition_B(sVt1))
        tOrV0_ss = thr_ss.make_fragment_B(thr_ss.partition_B(sVt0))
        tOrV1_ss = thr_ss.make_fragment_B(thr_ss.partition_B(sVt1))
        tOrS0 = thr_ss.make_fragment_A(thr_ss.partition_A(sS0))
        tOrS1 = thr_ss.make_fragment_A(thr_ss.partition_A(sS1))

        st_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), BFloat16)
        thr_st_p = cute.make_tiled_copy_C(st_atom, mma_qk).get_slice(idx_in_wg)
        tPsS0 = thr_st_p.partition_D(sS0)
        tPsS1 = thr_st_p.partition_D(sS1)
        tPrP = thr_st_p.retile(tOrP_acc)

        rM = cute.make_rmem_tensor((2,), Float32)
        rL = cute.make_rmem_tensor((2,), Float32)
        rM.fill(dev.MAX_INIT)
        rL.fill(0.0)

        if wg == 0:
            if num_iters > 0:
                k0l.wait_ready(0)
                self._qk(acc_s, tSrQ, tSrK0, 0, self.n_left, True)
                k0r.wait_ready(0)
                self._qk(acc_s, tSrQ, tSrK0, self.n_left, self.n_k_tiles, False)
                cute.nvgpu.warpgroup.wait_group(0)
            for it in cutlass.range(num_iters, unroll=1):
                parity = it & 1
                cute.arch.mbarrier_wait(bar_valid, parity)
                dev.mask_scores(acc_s, sValid[0], sValid[1], lane_quad)
                dev.online_softmax(acc_s, acc_o, rM, rL, scale_log2, rM[0], rM[1])
                if lane_quad == 0:
                    sM0[row0] = rM[0]
                    sM0[row1] = rM[1]
                max0_ready.arrive()
                tOrP_acc.store(acc_s.load().to(BFloat16))
                self._pv(True, acc_o, tOrP, tOrV0_rs)
                cute.nvgpu.warpgroup.wait_group(0)
                k0l.release()
                max1_ready.wait(parity)
                m0 = sM1[row0]
                m1 = sM1[row1]
                sf0 = cute.math.exp2(rM[0] - m0, fastmath=True)
                sf1 = cute.math.exp2(rM[1] - m1, fastmath=True)
                rM[0] = m0
                rM[1] = m1
                dev.scale_rows(acc_s, sf0, sf1)
                tOrP_acc.store(acc_s.load().to(BFloat16))
                cute.copy(thr_st_p, tPrP, tPsS0)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier_arrive(barrier_id=BAR_S0_READY, number_of_threads=256)
                cute.arch.barrier(barrier_id=BAR_S1_READY, number_of_threads=256)
                dev.scale_rows(acc_o, sf0, sf1)
                rL[0] = rL[0] * sf0
                rL[1] = rL[1] * sf1
                self._pv(False, acc_o, tOrS1, tOrV1_ss)
                if it + 1 < num_iters:
                    nparity = parity ^ 1
                    k0l.wait_ready(nparity)
                    self._qk(acc_s, tSrQ, tSrK0, 0, self.n_left, True)
                    cute.nvgpu.warpgroup.wait_group(1)
                    k1l.release()
                    k0r.wait_ready(nparity)
                    self._qk(acc_s, tSrQ, tSrK0, self.n_left, self.n_k_tiles, False)
                    cute.nvgpu.warpgroup.wait_group(0)
                else:
                    cute.nvgpu.warpgroup.wait_group(0)
                    k1l.release()
        else:
            for it in cutlass.range(num_iters, unroll=1):
                parity = it & 1
                k1r.wait_ready(parity)
                self._qk(acc_s, tSrQ, tSrK1, self.n_left, self.n_k_tiles, True)
                k1l.wait_ready(parity)
                self._qk(acc_s, tSrQ, tSrK1, 0, self.n_left, False)
                cute.nvgpu.warpgroup.wait_group(0)
                cute.arch.mbarrier_wait(bar_valid, parity)
                dev.mask_scores(acc_s, sValid[2], sValid[3], lane_quad)
                max0_ready.wait(parity)
                dev.online_softmax(acc_s, acc_o, rM, rL, scale_log2, sM0[row0], sM0[row1])
                if lane_quad == 0:
                    sM1[row0] = rM[0]
                    sM1[row1] = rM[1]
                max1_ready.arrive()
                tOrP_acc.store(acc_s.load().to(BFloat16))
                self._pv(True, acc_o, tOrP, tOrV1_rs)
                cute.copy(thr_st_p, tPrP, tPsS1)
                cute.arch.barrier(barrier_id=BAR_S0_READY, number_of_threads=256)
                self._pv(False, acc_o, tOrS0, tOrV0_ss)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier_arrive(barrier_id=BAR_S1_READY, number_of_threads=256)
                cute.nvgpu.warpgroup.wait_group(1)
                k1r.release()
                cute.nvgpu.warpgroup.wait_group(0)
                k0r.release()

        self._epilogue(mSink, mO, mLse, mML, flags, sL, acc_o, rM, rL, split, token, h_blk, wg, idx_in_wg,
                       row0, row1, lane_quad)

    def _mma_qk(self):
        """S = Q K^T: 64 heads x 64 tokens, both operands K-major in smem."""
        return sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), (B_H, B_TOPK)
        )

    def _mma_pv(self, rs: bool):
        """O += P V: 64 heads x d_v/2 columns; P from registers (rs) or smem, V^T MN-major in smem."""
        src = warpgroup.OperandSource.RMEM if rs else warpgroup.OperandSource.SMEM
        return sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32, (1, 1, 1),
            (B_H, self.d_v // 2), src,
        )

    @cute.jit
    def _qk(self, acc_s, tSrQ, tSrK, t0: cutlass.Constexpr, t1: cutlass.Constexpr,
            clear: cutlass.Constexpr):
        """Issue (and commit) S (+)= Q[:, tiles t0..t1) K[:, tiles t0..t1)^T."""
        mma_qk = self._mma_qk()
        cute.nvgpu.warpgroup.fence()
        for t in cutlass.range_constexpr(t0, t1):
            for kk in cutlass.range_constexpr(4):
                k = t * 4 + kk
                mma_qk.set(warpgroup.Field.ACCUMULATE, not (clear and t == t0 and kk == 0))
                cute.gemm(mma_qk, acc_s, tSrQ[None, None, k], tSrK[None, None, k], acc_s)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _pv(self, rs: cutlass.Constexpr, acc_o, tA, tB):
        """Issue (and commit) O += P V over the 64 tokens of a block."""
        mma = self._mma_pv(rs)
        cute.nvgpu.warpgroup.fence()
        mma.set(warpgroup.Field.ACCUMULATE, True)
        for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            cute.gemm(mma, acc_o, tA[None, None, k], tB[None, None, k], acc_o)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _epilogue(self, mSink, mO, mLse, mML, flags, sL, acc_o, rM, rL, split, token, h_blk, wg, idx_in_wg,
                  row0, row1, lane_quad):
        """Row sums of both WGs, normalise O, store O, lse (and max_logits)."""
        l0 = dev.quad_sum(rL[0])
        l1 = dev.quad_sum(rL[1])
        if lane_quad == 0:
            sL[wg * B_H + row0] = l0
            sL[wg * B_H + row1] = l1
        cute.arch.barrier(barrier_id=BAR_L_READY, number_of_threads=256)
        l0 = l0 + sL[(1 - wg) * B_H + row0]
        l1 = l1 + sL[(1 - wg) * B_H + row1]

        h_q = mLse.shape[2]
        head0 = h_blk * B_H + row0
        head1 = h_blk * B_H + row1
        sink_term0 = Float32(0.0)
        sink_term1 = Float32(0.0)
        if const_expr(not self.split):
            if dp.flag(flags, dp.F_SINK):
                sink_term0 = cute.math.exp2(mSink[head0] * dev.LOG2E - rM[0], fastmath=True)
                sink_term1 = cute.math.exp2(mSink[head1] * dev.LOG2E - rM[1], fastmath=True)
        inv0 = Float32(cutlass.select_(l0 > 0.0, 1.0 / (l0 + sink_term0), Float32(0.0)))
        inv1 = Float32(cutlass.select_(l1 > 0.0, 1.0 / (l1 + sink_term1), Float32(0.0)))
        dev.scale_rows(acc_o, inv0, inv1)

        n_tok = n_tokens_of(mLse, self.split)
        odd = (lane_quad % 2) == 1
        my_head = Int32(cutlass.select_(odd, head1, head0))
        col0 = wg * (self.d_v // 2) + 4 * (lane_quad // 2)
        base = dp.out_row_offset(split, n_tok, token, h_q, my_head, self.d_v) + col0
        elem_bytes = 4 if const_expr(self.split) else 2
        o_addr = dev.gmem_addr_i64(mO.iterator) + base * elem_bytes
        for g in cutlass.range_constexpr(cute.size(acc_o) // 4):
            v0, v1, v2, v3 = dev.quad_pair_v4(acc_o, g, odd)
            addr = o_addr + (8 * g) * elem_bytes
            if const_expr(self.split):
                dev.st_global_v4_f32(addr, v0, v1, v2, v3)
            else:
                dev.st_global_v2_b32(addr, dev.pack_bf16x2(v0, v1), dev.pack_bf16x2(v2, v3))

        if wg == 1:
            if lane_quad == 0:
                empty0 = l0 == 0.0
                empty1 = l1 == 0.0
                off0 = dp.lse_offset(split, n_tok, token, h_q, head0)
                off1 = dp.lse_offset(split, n_tok, token, h_q, head1)
                dp.store_f32(mLse, off0, Float32(cutlass.select_(
                    empty0, Float32(math.inf), cute.math.log(l0) + rM[0] * dev.LN2)))
                dp.store_f32(mLse, off1, Float32(cutlass.select_(
                    empty1, Float32(math.inf), cute.math.log(l1) + rM[1] * dev.LN2)))
                if dp.flag(flags, dp.F_MAX_LOGITS):
                    dp.store_f32(mML, off0, Float32(cutlass.select_(empty0, Float32(-math.inf), rM[0] * dev.LN2)))
                    dp.store_f32(mML, off1, Float32(cutlass.select_(empty1, Float32(-math.inf), rM[1] * dev.LN2)))


def n_tokens_of(mLse, split: bool):
    """Decode tokens ``T = b * s_q``: mode 1 of ``[n_splits, T, h]``, modes 0*1 of ``[b, s_q, h]``."""
    if split:
        return mLse.shape[1]
    return mLse.shape[0] * mLse.shape[1]


class SparseMlaDecodeSm90Fused(SparseMlaDecodeSm90):
    """The split kernel with the combine folded in (one launch): the contract of
    ``common/decode_host.py`` plus ``(out, lse, max_logits, counters)`` after ``max_logits``."""

    def __init__(self, d_qk: int, d_v: int = 512, l2_prefetch: int = 128):
        super().__init__(d_qk, True, d_v, l2_prefetch, fused=True)

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
        tl_stride_b: Int32,
        tl_stride_s: Int32,
        n_splits: Int32,
        blocks_per_split: Int32,
        stream,
    ):
        self._launch(mQ, mBias, mKV, mIdx, mBT, mTL, mSink, mO, mLse, mML, mOF, mLseF, mMLF, mCnt, scale_log2, flags,
                     page_size, tl_stride_b, tl_stride_s, n_splits, blocks_per_split, stream)
