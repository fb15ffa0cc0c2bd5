"""Sparse MLA decode on Hopper (sm_90a) for small head counts (h_q 8, 16, 24, 32), CuTe DSL.

FlashMLA's decode, and every path built on 64-row head tiles, pads 8-32 heads to 64 (4-8x the
MMA work).  Here the heads sit on the MMA's N side instead: with tokens on M,

    S^T [64 tokens x h] = K [64 x d_qk] . Q^T          (wgmma m64 n=h k16, A = K, B = Q, both K-major)
    O^T [d_v x h]     += V^T [d_v x 64] . P^T [64 x h]  (8 m-tiles; A = V^T read MN-major from the KV tile)

so the tensor work is proportional to h_q and the kernel stays bound by the KV gather.

One CTA per (decode token, split); 384 threads:

* WG2 -- producer: gathers each 64-slot block of the split's top-k
  (:class:`~mla_kernels.common.decode_parts.PagedKvGather`: physical ids or block-table
  translation, 16-byte ``cp.async``) into KV buffer ``block % 2``, and publishes the block's
  validity bitmask.
* WG0 / WG1 -- consumers, one per buffer: WG0 takes the even blocks, WG1 the odd ones, each
  with its own online softmax (running max per head = per column of S^T, found by a quad shuffle
  tree and one smem exchange between the WG's 4 warps) and its own ``O^T`` accumulator
  (``4 h`` floats per thread).  They never wait for each other inside the loop.  At the end WG1
  hands its (max, partial sums, O^T) to WG0 through smem in fragment order (thread ``t`` of WG0
  holds exactly the positions thread ``t`` of WG1 holds), WG0 merges, reduces the softmax sums
  and writes the split's float32 partial (split mode) or the bf16 output with the sink (direct
  mode), lse and optionally max_logits.
* ``cluster`` (split mode): a token's split CTAs run as one thread-block cluster; each stages its
  normalised partial (float32 in place, or rounded to bf16) and its lse / max logit per head in
  its own smem, and after a cluster barrier merges its slice of the heads from every peer over
  DSMEM (``ceil(h_q / cluster)`` heads, fewer in the last CTAs; with more CTAs than heads a share
  of one head's columns: ``common/cluster_merge.py``, shared with the 64-head kernel): one
  launch, no combine kernel, the bf16 output written like direct mode.

Softmax in base 2 with ``sm_scale * log2(e)`` folded (as in the forward); lse in natural log.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.cute.nvgpu.common import OperandMajorMode

from ..common import cluster_merge as cm
from ..common import decode_device as dd
from ..common import decode_parts as dp
from ..common import device as dev

B_TOPK = dp.BLOCK
THREADS = 384
SMEM_LIMIT = 232448
HEADS = (8, 16, 24, 32)

BAR_RED = 1  # + wg: per-WG column-max exchange (128 threads)
BAR_P = 3  # + wg: per-WG P^T stored (128 threads)
BAR_Q_READY = 5  # Q (+ bias) stored (256 threads)
BAR_MERGE = 6  # WG1's state is in smem (WG1 arrives, WG0 waits; 256)
BAR_FIN = 7  # WG0 is done reading WG1's O^T before the staging overwrites it (128)
BAR_SUMS = 10  # WG0's column sums are in sFin (128)
BAR_STAGED = 11  # 1/l per head and the staged rows are in smem (128)


class SparseMlaDecodeNarrowSm90(dd.DecodeContract):
    """Static configuration + host launcher + device kernel of the sm90 decode for h_q <= 32."""

    def __init__(self, d_qk: int, h_q: int, split: bool, d_v: int = 512, l2_prefetch: int = 128,
                 fused: bool = False, evict_first: bool = False, parts_bf16: bool = False, cluster: int = 0,
                 cluster_bf16: bool = False):
        if d_qk not in (512, 576):
            raise ValueError(f"sm90 narrow decode supports d_qk 512 or 576, got {d_qk}")
        if h_q not in HEADS:
            raise ValueError(f"sm90 narrow decode supports h_q in {HEADS}, got {h_q}")
        if d_v != 512:
            raise ValueError(f"sm90 narrow decode supports d_v 512, got {d_v}")
        self.d_qk = d_qk
        self.d_v = d_v
        self.h = h_q
        self.split = split
        # split mode only: the last CTA of a token merges the parts (common/decode_device.py)
        self.fused = fused and split
        # split mode, not fused: bf16 partial outputs (the combine reads half the bytes)
        self.parts_bf16 = parts_bf16 and split and not self.fused
        # split mode: the token's splits run as one cluster of ``cluster`` CTAs and merge over DSMEM
        # (each CTA merges a slice of the heads, cluster_merge.slice_shape); the kernel then writes
        # the bf16 output like direct
        # mode.  ``cluster_bf16``: the staged partials rounded to bf16 (half the DSMEM bytes)
        if cluster and (not split or self.fused or self.parts_bf16 or cluster not in cm.MERGE_SIZES):
            raise ValueError(f"narrow cluster merge needs split mode, float32 parts and a size of 2..16 "
                             f"(h_q {h_q}, cluster {cluster})")
        self.cluster = cluster if split else 0
        self.cluster_bf16 = cluster_bf16 and bool(self.cluster)
        self.n_merge = cm.merge_threads(h_q, self.cluster, d_v, self.cluster_bf16, 256) if self.cluster else 0
        self.f32_out = split and not self.parts_bf16 and not self.cluster  # O stored as float32 (else bf16)
        self.l2_prefetch = l2_prefetch  # the gather's L2 prefetch size (decode_parts.PagedKvGather)
        self.evict_first = evict_first  # the gather's L2 policy: evict_first instead of evict_last
        # how the gather divides a position by the page size: "generic" (the compiler's division)
        # or "magic" (multiply-high + shift by the host's constants, the page_mul / page_shift
        # arguments); set by decode_host.compile_decode_kernel (MLA_KERNELS_DECODE_PAGEDIV)
        self.pagediv = "generic"
        self.n_k_tiles = d_qk // 64
        self.n_cols = h_q // 4  # head columns per thread (S^T and O^T fragments)
        self.n_m_tiles = d_v // 64
        # the paged gather's index math needs more than the forward's 72 producer registers
        self.regs_consumer = 208
        self.regs_producer = 88
        assert 2 * self.regs_consumer + self.regs_producer <= 504
        # WG1 -> WG0 hand-over of O^T goes through KV buffer 1
        assert self.d_v * self.h * 4 <= B_TOPK * self.d_qk * 2
        self.smem_bytes = 0

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
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
        mLse: cute.Tensor,
        mML: cute.Tensor,
        mOF: cute.Tensor,  # fused: the merged [b, s_q, h_q, d_v] bf16
        mLseF: cute.Tensor,  # fused: the merged [b, s_q, h_q] f32
        mMLF: cute.Tensor,  # fused: the merged max_logits
        mCnt: cute.Tensor,  # fused: [b*s_q] int32 arrival counters (zero between launches)
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
        d_qk, h = self.d_qk, self.h
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
        sQ_layout = cute.tile_to_shape(k_atom, (h, d_qk), (0, 1))
        sK_layout = cute.tile_to_shape(k_atom, (B_TOPK, d_qk), (0, 1))
        sP_layout = cute.tile_to_shape(k_atom, (h, B_TOPK), (0, 1))
        n_state = 2 * self.n_cols * 128  # (max, partial sum) per column, per WG1 thread

        @cute.struct
        class SharedStorage:
            sK0: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sK1: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_layout)], 1024]
            sP0: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sP_layout)], 1024]
            sP1: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sP_layout)], 1024]
            # ready0, free0, ready1, free1, valid0, valid1
            mbar: cute.struct.MemRange[cutlass.Int64, 6]
            sValid: cute.struct.MemRange[Uint32, 4]
            sRed: cute.struct.Align[cute.struct.MemRange[Float32, 2 * 2 * 4 * h], 16]  # [wg][slot][warp][h]
            sFin: cute.struct.Align[cute.struct.MemRange[Float32, 4 * h], 16]  # [warp][h]
            sState: cute.struct.Align[cute.struct.MemRange[Float32, n_state], 16]
            # cluster merge: this CTA's staged lse (h) and max logits (h)
            sStats: cute.struct.Align[cute.struct.MemRange[Float32, 2 * h if self.cluster else 1], 16]

        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes <= SMEM_LIMIT, f"smem {self.smem_bytes} > {SMEM_LIMIT}"

        b, s_q = mQ.shape[0], mQ.shape[1]
        n_tok = b * s_q
        mKV2, mIdx2 = dd.flat_views(mKV, mIdx, n_tok, d_qk)
        launch = self.kernel(
            mQ, mBias, mKV2, mIdx2, mBT, mTL, mSink, mO, mLse, mML, mOF, mLseF, mMLF, mCnt, scale_log2, flags,
            page_size, page_mul, page_shift, tl_stride_b, tl_stride_s, n_splits, blocks_per_split,
            sQ_layout, sK_layout, sP_layout, SharedStorage,
        )
        if const_expr(self.cluster):
            # one cluster per token: its split CTAs are consecutive blocks (n_splits == self.cluster)
            launch.launch(grid=[n_tok * n_splits, 1, 1], block=[THREADS, 1, 1], cluster=[self.cluster, 1, 1],
                          smem=self.smem_bytes, stream=stream, min_blocks_per_mp=1)
        else:
            launch.launch(grid=[n_tok * n_splits, 1, 1], block=[THREADS, 1, 1], smem=self.smem_bytes,
                          stream=stream, min_blocks_per_mp=1)

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
        page_mul: Int32,
        page_shift: Int32,
        tl_stride_b: Int32,
        tl_stride_s: Int32,
        n_splits: Int32,
        blocks_per_split: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        # a dependent combine (launched with PDL) may be scheduled now; it waits for this grid
        cute.arch.griddepcontrol_launch_dependents()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp_idx // 4
        idx_in_wg = tidx % 128
        split = bidx % n_splits
        token = bidx // n_splits
        if const_expr(self.cluster):
            # a cluster per token: the split is the CTA's rank in the cluster (consecutive bidx)
            split = bidx % self.cluster
            token = bidx // self.cluster
        s_q = mQ.shape[1]
        b_idx, s_in = dd.cta_coords(token, s_q)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar = storage.mbar.data_ptr()
        kb0 = dev.HalfBufferBarriers(mbar + 0, mbar + 1)
        kb1 = dev.HalfBufferBarriers(mbar + 2, mbar + 3)
        bar_valid0 = mbar + 4
        bar_valid1 = mbar + 5

        if tidx < 256:
            # Q (+ bias) by the 256 consumer threads, issued first: without a bias the copies are
            # asynchronous and overlap the setup and the producer's first loads
            dp.load_q_tile(mQ, mBias, flags & Int32(dp.F_BIAS), token, b_idx, Int32(0), self.h, self.d_qk,
                           dev.smem_addr_u32(storage.sQ.data_ptr()), tidx, 256)
        if warp_idx == 0:
            with cute.arch.elect_one():
                dev.HalfBufferBarriers.init(mbar + 0, mbar + 1, 128, 128)
                dev.HalfBufferBarriers.init(mbar + 2, mbar + 3, 128, 128)
                cute.arch.mbarrier_init(bar_valid0, 2)
                cute.arch.mbarrier_init(bar_valid1, 2)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        blk0, num_iters, bound = dp.split_pairs(mTL, flags, b_idx, s_in, tl_stride_b, tl_stride_s, mIdx.shape[1],
                                                split, blocks_per_split)

        sValid = storage.sValid.get_tensor(cute.make_layout(4))
        sK0_ptr = storage.sK0.data_ptr()
        sK1_ptr = storage.sK1.data_ptr()

        if wg == 2:
            cute.arch.setmaxregister_decrease(self.regs_producer)
            gather = dp.PagedKvGather(
                mKV, mIdx, token, bound, idx_in_wg, self.d_qk, 2, mBT, b_idx,
                dp.flag(flags, dp.F_BLOCK_TABLE), page_size, self.l2_prefetch, self.evict_first,
                page_mul, page_shift, self.pagediv == "magic",
            )
            self.producer(gather, sK0_ptr, sK1_ptr, sValid, kb0, kb1, bar_valid0, bar_valid1, blk0, num_iters,
                          idx_in_wg, warp_idx % 4)
            if const_expr(self.cluster):
                cm.cluster_sync(False)  # the partials are staged (the producer wrote none of them)
                cm.cluster_sync(False)  # the peers have read this CTA's smem
        else:
            cute.arch.setmaxregister_increase(self.regs_consumer)
            dp.cp_async_wait_all()  # this thread's Q copies (issued at the start) have landed
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=BAR_Q_READY, number_of_threads=256)
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
            sRed = storage.sRed.get_tensor(cute.make_layout((self.h, 4, 2, 2), stride=(1, self.h, 4 * self.h,
                                                                                     8 * self.h)))
            sFin = storage.sFin.get_tensor(cute.make_layout((self.h, 4), stride=(1, self.h)))
            sState = storage.sState.get_tensor(cute.make_layout(2 * self.n_cols * 128))
            stats_addr = dev.smem_addr_u32(storage.sStats.data_ptr())
            if wg == 0:
                sK = storage.sK0.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
                sP = storage.sP0.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
                self.consumer(mSink, mO, mLse, mML, scale_log2, flags, sValid, sQ, sK, sP, sRed, sFin, sState,
                              sK0_ptr, sK1_ptr, kb0, bar_valid0, split, token, num_iters, Int32(0), idx_in_wg,
                              stats_addr)
            else:
                sK = storage.sK1.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
                sP = storage.sP1.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
                self.consumer(mSink, mO, mLse, mML, scale_log2, flags, sValid, sQ, sK, sP, sRed, sFin, sState,
                              sK0_ptr, sK1_ptr, kb1, bar_valid1, split, token, num_iters, Int32(1), idx_in_wg,
                              stats_addr)
            if const_expr(self.cluster):
                cm.cluster_sync(True)  # every CTA of the token has staged its partial
                if tidx < self.n_merge:
                    self._merge(mO, mLse, mML, mSink, flags, token, split, sK0_ptr, sK1_ptr, stats_addr, tidx,
                                mQ.shape[2])
                # no CTA exits while a peer reads its smem (every DSMEM load's value was consumed by
                # the stores above, so the arrival need not release anything)
                cm.cluster_sync(False)
            if const_expr(self.fused):
                dd.fused_tail(mCnt, token, n_splits, tidx, mO, mLse, mML, mOF, mLseF, mMLF, mSink, flags, token,
                              Int32(0), self.h, self.d_v)

    # ------------------------------------------------------------------------------------------
    def _staged_addr(self, sK0_ptr, sK1_ptr):
        """Where a cluster CTA's normalised partial is staged: float32 rows in place over KV buffer
        0 (the epilogue's staging), or bf16 rows over KV buffer 1 (free after the hand-over)."""
        return dev.smem_addr_u32(sK1_ptr if const_expr(self.cluster_bf16) else sK0_ptr)

    @cute.jit
    def _merge(self, mO, mLse, mML, mSink, flags, token, split, sK0_ptr, sK1_ptr, stats_addr, tidx, h_q):
        """This CTA's slice of the token's heads, merged from the cluster's staged partials."""
        cm.merge_slice(self._staged_addr(sK0_ptr, sK1_ptr), stats_addr, split, self.cluster, self.h, self.d_v,
                       self.cluster_bf16, tidx, self.n_merge, mO, mLse, mML, mSink, flags, token, Int32(0), h_q)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def producer(
        self,
        gather,
        sK0_ptr: cute.Pointer,
        sK1_ptr: cute.Pointer,
        sValid: cute.Tensor,
        kb0: cutlass.Constexpr,
        kb1: cutlass.Constexpr,
        bar_valid0,
        bar_valid1,
        blk0: Int32,
        num_iters: Int32,
        ptid: Int32,
        warp_in_wg: Int32,
    ):
        """WG2: block ``2 it`` -> buffer 0, block ``2 it + 1`` -> buffer 1; validity words
        (warps 0-1: buffer 0's, warps 2-3: buffer 1's), each published with its own mbarrier."""
        sK0_addr = dev.smem_addr_u32(sK0_ptr)
        sK1_addr = dev.smem_addr_u32(sK1_ptr)
        for it in cutlass.range(num_iters, unroll=1):
            parity = it & 1
            blk = blk0 + 2 * it
            gather.load_indices(blk, 0)
            gather.load_indices(blk + 1, 1)
            kb0.wait_free(parity)
            gather.copy_tiles(sK0_addr, 0, 0, self.n_k_tiles)
            kb0.commit_cp_async()
            kb1.wait_free(parity)
            gather.copy_tiles(sK1_addr, 1, 0, self.n_k_tiles)
            kb1.commit_cp_async()
            # Every consumer read of the previous words happened before the frees waited on above.
            bits = gather.valid_word(blk + warp_in_wg // 2)
            if ptid % 32 == 0:
                sValid[warp_in_wg] = bits
                if warp_in_wg < 2:
                    cute.arch.mbarrier_arrive(bar_valid0)
                else:
                    cute.arch.mbarrier_arrive(bar_valid1)

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
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sP: cute.Tensor,
        sRed: cute.Tensor,
        sFin: cute.Tensor,
        sState: cute.Tensor,
        sK0_ptr: cute.Pointer,
        sK1_ptr: cute.Pointer,
        kb: cutlass.Constexpr,
        bar_valid,
        split: Int32,
        token: Int32,
        num_iters: Int32,
        wg: Int32,
        idx_in_wg: Int32,
        stats_addr: Int32,
    ):
        """One consumer WG: its blocks (``2 it + wg``), then the hand-over / merge / epilogue."""
        h, nc = self.h, self.n_cols
        warp_in_wg = idx_in_wg // 32
        lane = idx_in_wg % 32
        lane_quad = lane % 4
        # S^T = K Q^T (64 tokens x h heads; A = K, B = Q, both K-major) and O^T += V^T P^T (64 rows of
        # d_v x h per m-tile; A = V^T, the MN-major view of the KV tile, B = P^T K-major)
        mma_qk = dd.tiled_mma(B_TOPK, h, OperandMajorMode.K, OperandMajorMode.K)
        mma_pv = dd.tiled_mma(B_TOPK, h, OperandMajorMode.MN, OperandMajorMode.K)
        thr_qk = mma_qk.get_slice(idx_in_wg)
        thr_pv = mma_pv.get_slice(idx_in_wg)

        tSrK = thr_qk.make_fragment_A(thr_qk.partition_A(sK))
        tSrQ = thr_qk.make_fragment_B(thr_qk.partition_B(sQ))
        acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((B_TOPK, h)))
        # V^T: the first d_v columns of the KV tile, viewed as (d, token)
        vt_layout = cute.select(sK.layout, mode=[1, 0])
        sVt = cute.local_tile(cute.make_tensor(sK.iterator, vt_layout), (self.d_v, B_TOPK), (0, 0))
        tOrV = thr_pv.make_fragment_A(thr_pv.partition_A(sVt))
        tOrP = thr_pv.make_fragment_B(thr_pv.partition_B(sP))
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.d_v, h)))
        acc_o.fill(0.0)

        # P^T (bf16) -> sP through a (token, head) view of the B tile
        sP_th = cute.make_tensor(sP.iterator, cute.select(sP.layout, mode=[1, 0]))
        cp_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16)
        thr_cp = cute.make_tiled_copy_C(cp_atom, mma_qk).get_slice(idx_in_wg)
        tPsP = thr_cp.partition_D(sP_th)
        rP = cute.make_rmem_tensor_like(acc_s, BFloat16)
        tPrP = thr_cp.retile(rP)

        rM = cute.make_rmem_tensor((nc,), Float32)  # running max per column (scaled log2)
        rL = cute.make_rmem_tensor((nc,), Float32)  # partial sums over this thread's rows
        rM.fill(dev.MAX_INIT)
        rL.fill(0.0)
        wbit = 16 * (warp_in_wg % 2) + lane // 4  # token bit of fragment row 0 in its 32-bit word

        for it in cutlass.range(num_iters, unroll=1):
            parity = it & 1
            kb.wait_ready(parity)
            dd.issue_mma(acc_s, tSrK, tSrQ, 0, self.n_k_tiles * 4, True, B_TOPK, h, OperandMajorMode.K,
                         OperandMajorMode.K)
            cute.nvgpu.warpgroup.wait_group(0)

            cute.arch.mbarrier_wait(bar_valid, parity)
            word = sValid[2 * wg + warp_in_wg // 2]
            ok0 = ((word >> Uint32(wbit)) & Uint32(1)) != Uint32(0)
            ok1 = ((word >> Uint32(wbit + 8)) & Uint32(1)) != Uint32(0)
            # column max of this thread's two rows, then over the 8 row groups of the warp
            cmax = cute.make_rmem_tensor((nc,), Float32)
            for j in cutlass.range_constexpr(nc):
                v0, g = j % 2, j // 2
                i0 = dev.acc_flat(v0, 0, g)
                i1 = dev.acc_flat(v0, 1, g)
                acc_s[i0] = Float32(cutlass.select_(ok0, acc_s[i0], Float32(-math.inf)))
                acc_s[i1] = Float32(cutlass.select_(ok1, acc_s[i1], Float32(-math.inf)))
                m = cute.arch.fmax(acc_s[i0], acc_s[i1])
                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=4))
                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=8))
                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=16))
                cmax[j] = m
            if lane < 4:
                for j in cutlass.range_constexpr(nc):
                    sRed[8 * (j // 2) + 2 * lane + j % 2, warp_in_wg, parity, wg] = cmax[j]
            cute.arch.barrier(barrier_id=BAR_RED + wg, number_of_threads=128)
            for j in cutlass.range_constexpr(nc):
                col = 8 * (j // 2) + 2 * lane_quad + j % 2
                m = cute.arch.fmax(cute.arch.fmax(sRed[col, 0, parity, wg], sRed[col, 1, parity, wg]),
                                   cute.arch.fmax(sRed[col, 2, parity, wg], sRed[col, 3, parity, wg]))
                new_m = cute.arch.fmax(rM[j], m * scale_log2)
                alpha = cute.math.exp2(rM[j] - new_m, fastmath=True)
                rM[j] = new_m
                v0, g = j % 2, j // 2
                i0 = dev.acc_flat(v0, 0, g)
                i1 = dev.acc_flat(v0, 1, g)
                p0 = cute.math.exp2(acc_s[i0] * scale_log2 - new_m, fastmath=True)
                p1 = cute.math.exp2(acc_s[i1] * scale_log2 - new_m, fastmath=True)
                acc_s[i0] = p0
                acc_s[i1] = p1
                rL[j] = rL[j] * alpha + p0 + p1
                for mt in cutlass.range_constexpr(self.n_m_tiles):
                    for r in cutlass.range_constexpr(2):
                        acc_o[dev.acc_flat(v0, r, g), mt, 0] = acc_o[dev.acc_flat(v0, r, g), mt, 0] * alpha
            rP.store(acc_s.load().to(BFloat16))
            cute.copy(thr_cp, tPrP, tPsP)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=BAR_P + wg, number_of_threads=128)
            dd.issue_mma(acc_o, tOrV, tOrP, 0, B_TOPK // 16, False, B_TOPK, h, OperandMajorMode.MN,
                         OperandMajorMode.K)
            cute.nvgpu.warpgroup.wait_group(0)
            kb.release()

        # ---- hand-over: WG1's state -> smem (fragment order), WG0 merges -------------------------
        n_o = cute.size(acc_o)
        sO1 = cute.make_tensor(cute.recast_ptr(sK1_ptr, dtype=Float32), cute.make_layout(n_o * 128))
        if wg == 1:
            for j in cutlass.range_constexpr(nc):
                sState[j * 128 + idx_in_wg] = rM[j]
                sState[(nc + j) * 128 + idx_in_wg] = rL[j]
            per_tile = n_o // self.n_m_tiles
            for mt in cutlass.range_constexpr(self.n_m_tiles):
                for fi in cutlass.range_constexpr(per_tile):
                    sO1[(fi + per_tile * mt) * 128 + idx_in_wg] = acc_o[fi, mt, 0]
            cute.arch.barrier_arrive(barrier_id=BAR_MERGE, number_of_threads=256)
        else:
            cute.arch.barrier(barrier_id=BAR_MERGE, number_of_threads=256)
            for j in cutlass.range_constexpr(nc):
                m1 = sState[j * 128 + idx_in_wg]
                l1 = sState[(nc + j) * 128 + idx_in_wg]
                m = cute.arch.fmax(rM[j], m1)
                a0 = cute.math.exp2(rM[j] - m, fastmath=True)
                a1 = cute.math.exp2(m1 - m, fastmath=True)
                rM[j] = m
                rL[j] = rL[j] * a0 + l1 * a1
                v0, g = j % 2, j // 2
                for mt in cutlass.range_constexpr(self.n_m_tiles):
                    for r in cutlass.range_constexpr(2):
                        fi = dev.acc_flat(v0, r, g)
                        flat = fi + (cute.size(acc_o) // self.n_m_tiles) * mt
                        acc_o[fi, mt, 0] = acc_o[fi, mt, 0] * a0 + sO1[flat * 128 + idx_in_wg] * a1
            # every WG0 thread is done reading WG1's O^T before the staging overwrites it
            cute.arch.barrier(barrier_id=BAR_FIN, number_of_threads=128)
            self._epilogue(mSink, mO, mLse, mML, flags, sFin, acc_o, rM, rL, thr_pv, sK0_ptr, sK1_ptr, split, token,
                           idx_in_wg, warp_in_wg, lane, lane_quad, stats_addr)

    @cute.jit
    def _epilogue(self, mSink, mO, mLse, mML, flags, sFin, acc_o, rM, rL, thr_pv, sK0_ptr, sK1_ptr, split, token,
                  idx_in_wg, warp_in_wg, lane, lane_quad, stats_addr):
        """WG0: stage the merged O^T in smem (transposed to [head][d]), reduce the softmax sums,
        then per head: 1/l (with the sink in direct mode), lse, max_logits, and 16-byte stores of
        the normalised rows (float32 partial or bf16) -- or, in a cluster, the normalised rows and
        the lse / max logit staged in this CTA's smem for the merge."""
        h, nc = self.h, self.n_cols
        n_tok = mLse.shape[1] if const_expr(self.split and not self.cluster) else mLse.shape[0] * mLse.shape[1]
        # O^T (d, head) -> staging [head][d_v + 4] f32 over the free KV buffers (the pad keeps the
        # scattered fragment stores bank-conflict free); frees the accumulator's registers.
        stride = self.d_v + 4
        sStage = cute.make_tensor(cute.recast_ptr(sK0_ptr, dtype=Float32), cute.make_layout(h * stride + h))
        cO = cute.make_identity_tensor((self.d_v, h))
        tOcO = thr_pv.partition_C(cO)
        per_tile = cute.size(acc_o) // self.n_m_tiles
        for mt in cutlass.range_constexpr(self.n_m_tiles):
            for fi in cutlass.range_constexpr(per_tile):
                d, head = tOcO[fi, mt, 0]
                sStage[head * stride + d] = acc_o[fi, mt, 0]
        # column sums: over the warp's 8 row groups, then over the 4 warps
        for j in cutlass.range_constexpr(nc):
            s = rL[j]
            s = s + cute.arch.shuffle_sync_bfly(s, offset=4)
            s = s + cute.arch.shuffle_sync_bfly(s, offset=8)
            s = s + cute.arch.shuffle_sync_bfly(s, offset=16)
            rL[j] = s
        if lane < 4:
            for j in cutlass.range_constexpr(nc):
                sFin[8 * (j // 2) + 2 * lane + j % 2, warp_in_wg] = rL[j]
        cute.arch.barrier(barrier_id=BAR_SUMS, number_of_threads=128)
        # per head (warp 0, lanes 0..3 hold every column): 1/l, lse, max_logits
        inv_base = h * stride  # 1/l per head, after the staged rows
        if warp_in_wg == 0:
            if lane < 4:
                for j in cutlass.range_constexpr(nc):
                    col = 8 * (j // 2) + 2 * lane + j % 2
                    l = sFin[col, 0] + sFin[col, 1] + sFin[col, 2] + sFin[col, 3]
                    nonempty = l > Float32(0.0)
                    denom = l
                    if const_expr(not self.split):
                        if dp.flag(flags, dp.F_SINK):
                            denom = l + cute.math.exp2(mSink[col] * dev.LOG2E - rM[j], fastmath=True)
                    sStage[inv_base + col] = Float32(cutlass.select_(nonempty, Float32(1.0) / denom, Float32(0.0)))
                    if const_expr(self.cluster):
                        cm.stage_row_stats(stats_addr, col, h, l, rM[j])
                    else:
                        dd.store_lse_ml(mLse, mML, dp.lse_offset(split, n_tok, token, h, col), l, rM[j], flags)
        cute.arch.barrier(barrier_id=BAR_STAGED, number_of_threads=128)
        # each thread: its 4 columns of every head row, normalised -- then stored (float32 partial
        # or bf16), or in a cluster staged for the merge, which reads O / l: in place (float32) or
        # as bf16 rows over KV buffer 1
        if const_expr(self.cluster):
            xb = self._staged_addr(sK0_ptr, sK1_ptr)
        else:
            base = dp.out_row_offset(split, n_tok, token, h, Int32(0), self.d_v) + Int64(4 * idx_in_wg)
        vec = cute.make_layout(4)
        rv = cute.make_rmem_tensor((4,), Float32)
        rb = cute.make_rmem_tensor((4,), BFloat16)
        for head in cutlass.range(h, unroll=4):
            cute.autovec_copy(cute.make_tensor((sStage.iterator + (head * stride + 4 * idx_in_wg)).align(16), vec), rv)
            rv.store(rv.load() * sStage[inv_base + head])
            if const_expr(self.cluster):
                cm.stage_o_v4(xb, head, 4 * idx_in_wg, rv[0], rv[1], rv[2], rv[3], self.d_v, self.cluster_bf16)
            else:
                off = base + Int64(head) * self.d_v
                if const_expr(self.f32_out):
                    cute.autovec_copy(rv, cute.make_tensor((mO.iterator + off).align(16), vec))
                else:
                    rb.store(rv.load().to(BFloat16))
                    cute.autovec_copy(rb, cute.make_tensor((mO.iterator + off).align(8), vec))


class SparseMlaDecodeNarrowSm90Fused(dd.FusedDecodeContract, SparseMlaDecodeNarrowSm90):
    """The split kernel with the combine folded in (one launch): the contract of
    ``common/decode_host.py`` plus ``(out, lse, max_logits, counters)`` after ``max_logits``."""

    def __init__(self, d_qk: int, h_q: int, d_v: int = 512, l2_prefetch: int = 128, evict_first: bool = False):
        super().__init__(d_qk, h_q, True, d_v, l2_prefetch, fused=True, evict_first=evict_first)
