"""Sparse MLA decode on Hopper (sm_90a), head blocks of 64 (h_q a multiple of 64), CuTe DSL.

Split-top-k flash-decoding with the prefill forward's CTA (``sm90/fwd.py``): one CTA per
(decode token, 64-head block, split) processes the split's top-k blocks of 64 slots and writes

* split mode: a float32 (or bf16: ``parts_bf16``) partial ``out_parts[split, token, head, :]`` normalised by the split's own
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
* direct mode runs the alternating KV ring (``ring_alt``): the right halves (k-tiles 4..) of the
  two buffers swap owners every pair, so WG0's next block always lies in the two halves freed
  early (after the products with the freeing warpgroup's own P) and its QK product never waits
  for a gather issued at the end of a pair; split mode keeps the fixed ring (short CTAs);
* the epilogue stores O from registers with 16-byte (float32) vector stores (split mode), or in
  direct mode stages the bf16 rows in Q's free smem and writes each head's row by one 1 KB bulk
  copy (``o_bulk``, the default; 8-byte stores from registers otherwise);
* a row's splits may run as one cluster that merges over DSMEM (``cluster``,
  ``common/cluster_merge.py``), and then a CTA may hold 32 heads instead of 64 (``rows``): the
  Q tile's other 32 rows are zeros (computed, never staged), so each CTA pulls half the bytes in
  the merge -- at b 1, 4 clusters of 16 CTAs instead of 2.

Runtime flags (``common/decode_parts.F_*``) switch q_bias, the block table, topk_length, the
sink and max_logits without a recompile; static: ``d_qk``, ``h_q`` (through the fake tensors)
and the mode.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint32, const_expr
from cutlass.cute.nvgpu import warpgroup

from ..common import cluster_merge as cm
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
BAR_O_STAGED = 7  # ``o_bulk``: the bf16 output rows are staged in smem (256 threads)


class SparseMlaDecodeSm90(dd.DecodeContract):
    """Static configuration + host launcher + device kernel of the sm90 split decode (h_q % 64 == 0)."""

    def __init__(self, d_qk: int, split: bool, d_v: int = 512, l2_prefetch: int = 128, fused: bool = False,
                 evict_first: bool = False, parts_bf16: bool = False, cluster: int = 0, cluster_bf16: bool = False,
                 cluster_l2: bool = False):
        if d_qk not in (512, 576):
            raise ValueError(f"sm90 decode supports d_qk 512 or 576, got {d_qk}")
        if d_v != 512:
            raise ValueError(f"sm90 decode supports d_v 512, got {d_v}")
        self.d_qk = d_qk
        self.d_v = d_v
        self.split = split
        # split mode only: the last CTA of a row merges the parts (common/decode_device.py)
        self.fused = fused and split
        # split mode, not fused: bf16 partial outputs (the combine reads half the bytes)
        self.parts_bf16 = parts_bf16 and split and not self.fused
        # split mode: the row's splits run as one cluster of ``cluster`` CTAs and merge over DSMEM
        # (common/cluster_merge.py); the kernel then writes the bf16 output like direct mode.
        # ``cluster_l2``: the partials go through the float32 workspace in global memory (L2) as in
        # plain split mode, the cluster barrier orders them, and each CTA merges a slice of the
        # row's heads with the combine's per-row merge (the fused kernel's argument contract)
        if cluster and (not split or fused or parts_bf16 or cluster not in cm.MERGE_SIZES
                        or (cluster_l2 and cluster not in cm.CLUSTER_SIZES)):
            raise ValueError(f"cluster merge needs split mode, float32 parts and a size of 2..16 "
                             f"({cm.CLUSTER_SIZES} with the L2 staging), got {cluster}")
        self.cluster = cluster if split else 0
        self.cluster_l2 = cluster_l2 and bool(self.cluster)
        self.cluster_dsmem = bool(self.cluster) and not self.cluster_l2
        self.cluster_bf16 = cluster_bf16 and self.cluster_dsmem  # the staged partials in bf16
        self.f32_out = split and not self.parts_bf16 and not self.cluster_dsmem  # O stored as float32 (else bf16)
        self.l2_prefetch = l2_prefetch  # the gather's L2 prefetch size (decode_parts.PagedKvGather)
        self.evict_first = evict_first  # the gather's L2 policy: evict_first instead of evict_last
        # how the gather divides a position by the page size: "generic" (the compiler's division)
        # or "magic" (multiply-high + shift by the host's constants, the page_mul / page_shift
        # arguments); set by decode_host.compile_decode_kernel (MLA_KERNELS_DECODE_PAGEDIV)
        self.pagediv = "generic"
        # direct mode: how O leaves -- True (default): staged as bf16 rows in the free Q smem, one
        # 1 KB bulk copy per head row (H200: 1.03-1.05x faster steps at b 64 / 128, docs/PERF.md);
        # False: 8-byte stores from the accumulator registers; set by
        # decode_host.compile_decode_kernel (MLA_KERNELS_DECODE_O)
        self.o_bulk = True
        # the alternating KV ring (``PairedBlockConsumer.loop(alt=True)``): the right halves of
        # the two buffers swap owners every block pair; set by decode_host.compile_decode_kernel
        # (decode_host.ring_for's rule -- direct mode only -- or MLA_KERNELS_DECODE_RING), as
        # compile_fwd sets the forward's
        self.ring_alt = False
        # heads per CTA: 64 (one wgmma M tile), or 32 in a DSMEM cluster merge -- the tile's other
        # 32 rows are zeros, computed and dropped -- so that a row's partials are half the bytes
        # each CTA pulls over DSMEM (b 1 runs twice the CTAs); set by
        # decode_host.compile_decode_kernel (MLA_KERNELS_DECODE_CLUSTER_ROWS)
        self.rows = B_H
        # direct mode, h_q a multiple of 128: a token's two head-block CTAs (consecutive blocks,
        # the same KV rows) launched as one 2-CTA cluster, so that they start together and gather
        # their rows at the same time -- the second CTA's L2 misses merge into the first's (H200:
        # 0.98-0.99x the step time at b 64 / 128, s_q 2, h_q 128, outputs bitwise the same;
        # docs/PERF.md); nothing else changes.  Set by decode_host.compile_decode_kernel
        # (MLA_KERNELS_DECODE_PAIR)
        self.pair_cluster = False
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
        page_mul: Int32,
        page_shift: Int32,
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
            # cluster merge: this CTA's staged lse (64) and max logits (64)
            sStats: cute.struct.MemRange[Float32, 2 * B_H if self.cluster else 1]

        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes <= SMEM_LIMIT, f"smem {self.smem_bytes} > {SMEM_LIMIT}"
        # the staged partial reuses the Q and KV buffers (contiguous from sQ; DSMEM staging only)
        assert cm.staged_bytes(B_H, self.d_v, self.cluster_bf16) <= 3 * cute.cosize(sK_layout) * 2

        b, s_q, h_q = mQ.shape[0], mQ.shape[1], mQ.shape[2]
        n_tok = b * s_q
        # flattened views: the cache as [rows, d_qk], the indices as [tokens, topk]
        mKV2, mIdx2 = dd.flat_views(mKV, mIdx, n_tok, d_qk)
        n_hblk = h_q // self.rows
        launch = self.kernel(
            mQ, mBias, mKV2, mIdx2, mBT, mTL, mSink, mO, mLse, mML, mOF, mLseF, mMLF, mCnt, scale_log2, flags,
            page_size, page_mul, page_shift, tl_stride_b, tl_stride_s, n_splits, blocks_per_split,
            sQ_layout, sK_layout, sP_layout, SharedStorage, n_hblk,
        )
        if const_expr(self.cluster):
            # one cluster per row: its split CTAs are consecutive blocks (n_splits == self.cluster)
            launch.launch(grid=[n_tok * n_hblk * n_splits, 1, 1], block=[THREADS, 1, 1], cluster=[self.cluster, 1, 1],
                          smem=self.smem_bytes, stream=stream, min_blocks_per_mp=1)
        elif const_expr(self.pair_cluster):
            # a token's two head blocks are consecutive CTAs (direct mode: bidx = token * n_hblk + h_blk)
            assert not self.split and n_hblk % 2 == 0, "pair_cluster: direct mode, h_q a multiple of 128"
            launch.launch(grid=[n_tok * n_hblk * n_splits, 1, 1], block=[THREADS, 1, 1], cluster=[2, 1, 1],
                          smem=self.smem_bytes, stream=stream, min_blocks_per_mp=1)
        else:
            launch.launch(grid=[n_tok * n_hblk * n_splits, 1, 1], block=[THREADS, 1, 1], smem=self.smem_bytes,
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
        if const_expr(self.cluster):
            # a cluster per row: the split is the CTA's rank in the cluster (consecutive bidx)
            split = bidx % self.cluster
            rest = bidx // self.cluster
            h_blk = rest % n_hblk
            token = rest // n_hblk
        s_q = mQ.shape[1]
        b_idx, s_in = dd.cta_coords(token, s_q)

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

        sQ_ptr = storage.sQ.data_ptr()
        if tidx < 256:
            # Q (+ bias) for this head block by the 256 consumer threads, issued first: without a
            # bias the copies are asynchronous and overlap the setup and the producer's first loads
            dp.load_q_tile(mQ, mBias, flags & Int32(dp.F_BIAS), token, b_idx, h_blk * self.rows, self.rows, self.d_qk,
                           dev.smem_addr_u32(sQ_ptr), tidx, 256, B_H)
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
        # WG0's P0 for WG1: the RoPE tile of WG0's block at d_qk 576 (per parity with the alternating ring)
        sS0, sS0b = dd.p0_tiles(storage, sP_layout, self.n_k_tiles, self.s0_in_rope, self.ring_alt)

        blk0, num_iters, bound = dp.split_pairs(mTL, flags, b_idx, s_in, tl_stride_b, tl_stride_s, mIdx.shape[1],
                                                split, blocks_per_split)

        sValid = storage.sValid.get_tensor(cute.make_layout(4))
        sM0 = storage.sM0.get_tensor(cute.make_layout(B_H))
        sM1 = storage.sM1.get_tensor(cute.make_layout(B_H))
        sL = storage.sL.get_tensor(cute.make_layout(2 * B_H))
        sK0_ptr = storage.sK0.data_ptr()
        sK1_ptr = storage.sK1.data_ptr()

        if wg == 2:
            cute.arch.setmaxregister_decrease(self.regs_producer)
            gather = dp.PagedKvGather(
                mKV, mIdx, token, bound, idx_in_wg, self.d_qk, 2, mBT, b_idx,
                dp.flag(flags, dp.F_BLOCK_TABLE), page_size, self.l2_prefetch, self.evict_first,
                page_mul, page_shift, self.pagediv == "magic",
            )
            dd.paired_producer_loop(gather, dev.smem_addr_u32(sK0_ptr), dev.smem_addr_u32(sK1_ptr), sValid, k0l, k0r,
                                    k1l, k1r, bar_valid, blk0, num_iters, idx_in_wg, warp_idx % 4, self.n_left,
                                    self.n_k_tiles, self.ring_alt)
            if const_expr(self.cluster):
                cm.cluster_sync(False)  # the partials are staged (the producer wrote none of them)
            if const_expr(self.cluster_dsmem):
                cm.cluster_sync(False)  # the peers have read this CTA's smem
        else:
            cute.arch.setmaxregister_increase(self.regs_consumer)
            dp.cp_async_wait_all()  # this thread's Q copies (issued at the start) have landed
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=BAR_Q_READY, number_of_threads=256)
            self.consumer(
                mSink, mO, mLse, mML, scale_log2, flags, sValid, sM0, sM1, sL, sQ, sK0, sK1, sS0, sS1, sS0b,
                k0l, k0r, k1l, k1r, bar_valid, max0_ready, max1_ready, split, token, h_blk, num_iters, wg,
                idx_in_wg, dev.smem_addr_u32(sQ_ptr), dev.smem_addr_u32(storage.sStats.data_ptr()),
            )
            if const_expr(self.cluster_l2):
                # every CTA of the row has stored its part (release: MEMBAR.GPU after the stores;
                # the acquiring wait invalidates L1), then this CTA merges its slice of the heads
                cm.cluster_sync(True)
                hp = B_H // self.cluster
                dd.merge_block(mO, mLse, mML, mOF, mLseF, mMLF, mSink, flags & Int32(dp.F_SINK),
                               flags & Int32(dp.F_MAX_LOGITS), token, h_blk * B_H + split * hp, hp, self.d_v, tidx,
                               256)
            if const_expr(self.cluster_dsmem):
                cm.cluster_sync(True)  # every CTA of the row has staged its partial
                n_merge = cm.merge_threads(self.rows, self.cluster, self.d_v, self.cluster_bf16, 256)
                if const_expr(n_merge < 256):
                    if tidx < n_merge:
                        self._merge(mO, mLse, mML, mSink, flags, token, h_blk, split, sQ_ptr, storage, tidx, n_merge,
                                    mQ.shape[2])
                else:
                    self._merge(mO, mLse, mML, mSink, flags, token, h_blk, split, sQ_ptr, storage, tidx, n_merge,
                                mQ.shape[2])
                # no CTA exits while a peer reads its smem (every DSMEM load's value was consumed by
                # the stores above, so the arrival need not release anything)
                cm.cluster_sync(False)
            if const_expr(self.fused):
                dd.fused_tail(mCnt, token * n_hblk + h_blk, n_splits, tidx, mO, mLse, mML, mOF, mLseF, mMLF, mSink,
                              flags, token, h_blk * B_H, B_H, self.d_v)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _merge(self, mO, mLse, mML, mSink, flags, token, h_blk, split, sQ_ptr, storage, tidx, n_merge: cutlass.Constexpr,
               h_q):
        """This CTA's slice of the row's heads, merged from the cluster's staged partials."""
        cm.merge_slice(dev.smem_addr_u32(sQ_ptr), dev.smem_addr_u32(storage.sStats.data_ptr()), split,
                       self.cluster, self.rows, self.d_v, self.cluster_bf16, tidx, n_merge, mO, mLse, mML, mSink,
                       flags, token, h_blk * self.rows, h_q)

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
        sS0b,
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
        x_addr: Int32,
        stats_addr: Int32,
    ):
        """WG0 / WG1: the forward's paired-block schedule (``common/decode_device.py``), then the
        epilogue (``x_addr`` / ``stats_addr``: where a cluster CTA stages its partial)."""
        c = dd.PairedBlockConsumer(sQ, sK0, sK1, sS0, sS1, idx_in_wg, wg, self.d_qk, self.d_v, sS0b)
        c.loop(sValid, sM0, sM1, k0l, k0r, k1l, k1r, bar_valid, max0_ready, max1_ready, BAR_S0_READY, BAR_S1_READY,
               num_iters, wg, scale_log2, self.ring_alt)
        self._epilogue(mSink, mO, mLse, mML, flags, sL, c.acc_o, c.rM, c.rL, split, token, h_blk, wg, idx_in_wg,
                       c.row0, c.row1, c.lane_quad, x_addr, stats_addr)

    @cute.jit
    def _epilogue(self, mSink, mO, mLse, mML, flags, sL, acc_o, rM, rL, split, token, h_blk, wg, idx_in_wg,
                  row0, row1, lane_quad, x_addr, stats_addr):
        """Row sums of both WGs, normalise O, store O, lse (and max_logits) -- or, in a cluster,
        stage them in this CTA's smem for the merge (``common/cluster_merge.py``)."""
        l0 = dev.quad_sum(rL[0])
        l1 = dev.quad_sum(rL[1])
        if lane_quad == 0:
            sL[wg * B_H + row0] = l0
            sL[wg * B_H + row1] = l1
        cute.arch.barrier(barrier_id=BAR_L_READY, number_of_threads=256)
        l0 = l0 + sL[(1 - wg) * B_H + row0]
        l1 = l1 + sL[(1 - wg) * B_H + row1]

        h_q = mLse.shape[2]
        head0 = h_blk * self.rows + row0
        head1 = h_blk * self.rows + row1
        sink_term0 = Float32(0.0)
        sink_term1 = Float32(0.0)
        if const_expr(not self.split):
            if dp.flag(flags, dp.F_SINK):
                sink_term0 = cute.math.exp2(mSink[head0] * dev.LOG2E - rM[0], fastmath=True)
                sink_term1 = cute.math.exp2(mSink[head1] * dev.LOG2E - rM[1], fastmath=True)
        inv0 = Float32(cutlass.select_(l0 > 0.0, 1.0 / (l0 + sink_term0), Float32(0.0)))
        inv1 = Float32(cutlass.select_(l1 > 0.0, 1.0 / (l1 + sink_term1), Float32(0.0)))
        dev.scale_rows(acc_o, inv0, inv1)

        odd = (lane_quad % 2) == 1
        col0 = wg * (self.d_v // 2) + 4 * (lane_quad // 2)
        bulk = const_expr(self.o_bulk and not self.split)  # direct mode's O by bulk copies
        if const_expr(self.cluster_dsmem or bulk):
            # the Q / KV buffers are free (both WGs passed BAR_L_READY after their last wgmma; the
            # producer is done): the rows staged 16-byte padded (bank-conflict free) -- for the
            # cluster merge, or (bf16) for one bulk copy per head row
            my_row = Int32(cutlass.select_(odd, row1, row0))
            bf16 = self.cluster_bf16 if const_expr(self.cluster_dsmem) else True
            if const_expr(self.rows < B_H):
                if my_row < self.rows:  # the zero rows are not staged
                    cm.stage_o_rows(x_addr, acc_o, my_row, col0, odd, self.d_v, bf16)
            else:
                cm.stage_o_rows(x_addr, acc_o, my_row, col0, odd, self.d_v, bf16)
        if const_expr(self.cluster_dsmem):
            if wg == 1:
                if lane_quad == 0:
                    if const_expr(self.rows < B_H):
                        # 32 rows: the quads of warp 0 .. 1 hold rows 0 .. 31 as row0 (row1 = row0 + 8)
                        if row1 < self.rows:
                            cm.stage_row_stats(stats_addr, row0, self.rows, l0, rM[0])
                            cm.stage_row_stats(stats_addr, row1, self.rows, l1, rM[1])
                    else:
                        cm.stage_row_stats(stats_addr, row0, self.rows, l0, rM[0])
                        cm.stage_row_stats(stats_addr, row1, self.rows, l1, rM[1])
        else:
            n_tok = n_tokens_of(mLse, self.split)
            tid = wg * 128 + idx_in_wg
            if const_expr(bulk):
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=BAR_O_STAGED, number_of_threads=256)
                if tid < B_H:  # head row tid: 1 KB, contiguous in out
                    off = dp.out_row_offset(split, n_tok, token, h_q, h_blk * B_H + tid, self.d_v)
                    dev.bulk_copy_s2g(dev.gmem_addr_i64(mO.iterator) + off * 2,
                                      x_addr + tid * cm.row_stride_bytes(self.d_v, True), Int32(self.d_v * 2))
                    cute.arch.cp_async_bulk_commit_group()
            else:
                my_head = Int32(cutlass.select_(odd, head1, head0))
                base = dp.out_row_offset(split, n_tok, token, h_q, my_head, self.d_v) + col0
                elem_bytes = 4 if const_expr(self.f32_out) else 2
                o_addr = dev.gmem_addr_i64(mO.iterator) + base * elem_bytes
                for g in cutlass.range_constexpr(cute.size(acc_o) // 4):
                    v0, v1, v2, v3 = dev.quad_pair_v4(acc_o, g, odd)
                    addr = o_addr + (8 * g) * elem_bytes
                    if const_expr(self.f32_out):
                        dev.st_global_v4_f32(addr, v0, v1, v2, v3)
                    else:
                        dev.st_global_v2_b32(addr, dev.pack_bf16x2(v0, v1), dev.pack_bf16x2(v2, v3))

            if wg == 1:
                if lane_quad == 0:
                    dd.store_lse_ml(mLse, mML, dp.lse_offset(split, n_tok, token, h_q, head0), l0, rM[0], flags)
                    dd.store_lse_ml(mLse, mML, dp.lse_offset(split, n_tok, token, h_q, head1), l1, rM[1], flags)
            if const_expr(bulk):
                if tid < B_H:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)  # the staged rows are read before exit


def n_tokens_of(mLse, split: bool):
    """Decode tokens ``T = b * s_q``: mode 1 of ``[n_splits, T, h]``, modes 0*1 of ``[b, s_q, h]``."""
    if split:
        return mLse.shape[1]
    return mLse.shape[0] * mLse.shape[1]


class SparseMlaDecodeSm90Fused(dd.FusedDecodeContract, SparseMlaDecodeSm90):
    """The split kernel with the combine folded in (one launch): the contract of
    ``common/decode_host.py`` plus ``(out, lse, max_logits, counters)`` after ``max_logits``."""

    def __init__(self, d_qk: int, d_v: int = 512, l2_prefetch: int = 128, evict_first: bool = False):
        super().__init__(d_qk, True, d_v, l2_prefetch, fused=True, evict_first=evict_first)


class SparseMlaDecodeSm90ClusterL2(dd.FusedDecodeContract, SparseMlaDecodeSm90):
    """The split kernel whose row runs as one cluster of ``cluster`` CTAs: each stores its float32
    part to the workspace (L2), the cluster barrier publishes them, each CTA merges
    ``64 / cluster`` heads (``MLA_KERNELS_DECODE_CLUSTER_PARTS=l2``).  The fused kernel's
    contract; its counters argument is an unused placeholder."""

    def __init__(self, d_qk: int, cluster: int, d_v: int = 512, l2_prefetch: int = 128, evict_first: bool = False):
        super().__init__(d_qk, True, d_v, l2_prefetch, evict_first=evict_first, cluster=cluster, cluster_l2=True)
