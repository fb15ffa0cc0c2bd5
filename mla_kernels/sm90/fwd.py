"""Sparse MLA forward on Hopper (sm_90a), CuTe DSL.

One CTA per (query token, 64-head block); 384 threads in three warpgroups:

* WG0, WG1 -- consumers (``setmaxnreg`` up).  Both hold the 64 heads; WG0 owns output columns
  0..255, WG1 columns 256..511.  Top-k blocks of 64 indices are processed in pairs: WG0 computes
  ``S0 = Q K0^T`` for the even block (KV buffer 0), WG1 ``S1 = Q K1^T`` for the odd block
  (buffer 1), both by wgmma over the ``d_qk/64`` k-tiles.  The row max is exchanged through smem
  (WG0's max -> WG1 -> final max back to WG0; one array and one mbarrier signal per direction,
  see "Synchronisation" below), each WG does the online softmax of its block,
  keeps its own P in registers (``O += P V`` as an RS wgmma) and hands the other WG its P through
  smem (stmatrix; SS wgmma).  V is the first 512 columns of the same smem KV tile, read through
  a transposed (MN-major) view: no second load.
* WG2 -- producer (``setmaxnreg`` down).  Gathers the 64 KV rows of each block with 16-byte
  ``cp.async`` (zero-fill for invalid slots, L2 evict-last) into the two swizzled buffers, in
  halves (tiles 0..3 = V's left half, tiles 4.. = right half + RoPE) guarded by ready/free
  mbarriers so a half is refilled as soon as its last reader is done; it also publishes each
  block's validity bitmask (ballot) to smem.  The indices of iteration ``it + 1`` (and the slot
  each thread votes for) are fetched into registers during iteration ``it``, so their latency
  hides behind the free-barrier waits, and the masks are published as soon as both consumers are
  done with the previous ones.

Q arrives once by TMA; O leaves per 64-column tile: stmatrix into smem (aliasing Q), then a TMA
store of that tile that runs while the next tile is written; lse and max_logits are staged in
smem and leave by two 256-byte bulk copies.  Softmax runs in base 2 with ``sm_scale * log2(e)`` folded into
one FFMA; ``lse``/``max_logits`` are converted back to natural-log units at the end.

For d_qk = 576 WG0's P for WG1 lives in buffer 0's RoPE tile (free once S0 is computed), which is
what lets Q + two 576-wide buffers fit in 227 KB of smem.

Synchronisation (clean under compute-sanitizer racecheck and synccheck): the KV halves are guarded
by ready/free mbarriers; the row-max exchange uses two arrays (``sM0`` written only by WG0,
``sM1`` only by WG1) and two :class:`~mla_kernels.common.device.PhaseSignal` mbarriers, so no
lane ever reads a word another lane of its warp overwrites in the same step, and every reuse of a
word in the next iteration is ordered by an mbarrier release/acquire (an earlier version shared
one array and named ``bar.arrive``/``bar.sync`` pairs: racecheck reported write-after-read
hazards on it).  The P hand-offs keep named barriers, always as ``bar.arrive`` by the writer and
``bar.sync`` by the reader, never a ``bar.sync`` reached from two code locations.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.cute.nvgpu.common import OperandMajorMode

from ..common import device as dev
from ..common.gather import KvGather
from .. import tma

B_H = 64  # heads per CTA (one wgmma M tile)
B_TOPK = 64  # indices per block
THREADS = 384
SMEM_LIMIT = 232448

# Named barrier ids (0 is __syncthreads).
BAR_S0_READY = 3  # WG0's P is in smem
BAR_S1_READY = 4  # WG1's P is in smem
BAR_L_READY = 5  # row sums exchanged in the epilogue
BAR_EPI_TILE = 8  # epilogue: ids 8..11 (WG0's four O tiles), 12..15 (WG1's); immediate ids,
#                   one bar.sync address each (tests/test_barrier_rule.py)


class SparseMlaFwdSm90:
    """Static configuration + host launcher + device kernel of the sm90 sparse forward."""

    def __init__(self, d_qk: int, d_v: int = 512, has_topk_length: bool = False, has_sink: bool = False):
        if d_qk not in (512, 576):
            raise ValueError(f"sm90 forward supports d_qk 512 or 576, got {d_qk}")
        if d_v != 512:
            raise ValueError(f"sm90 forward supports d_v 512, got {d_v}")
        self.d_qk = d_qk
        self.d_v = d_v
        self.has_topk_length = has_topk_length
        self.has_sink = has_sink
        self.n_k_tiles = d_qk // 64  # 9 or 8 k-tiles of 64 columns
        self.n_left = (d_v // 2) // 64  # 4: tiles of V's left half (WG0's output columns)
        self.s0_in_rope = d_qk == 576
        # setmaxnreg budget: 2*consumer + producer must not exceed the launch allocation of
        # 168 regs x 384 threads (= 504 per thread-slot of a warpgroup), or the increase blocks.
        self.regs_consumer = 216
        self.regs_producer = 72
        assert 2 * self.regs_consumer + self.regs_producer <= 504
        self.smem_bytes = 0  # set when traced

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [s_q, h_q, d_qk] bf16
        mKV: cute.Tensor,  # [s_kv, d_qk] bf16
        mIdx: cute.Tensor,  # [s_q, topk] int32, topk % 64 == 0
        mTopkLen: cute.Tensor,  # [s_q] int32 (read only if has_topk_length)
        mSink: cute.Tensor,  # [h_q] f32 (read only if has_sink)
        mO: cute.Tensor,  # [s_q, h_q, d_v] bf16
        mMaxLogits: cute.Tensor,  # [s_q, h_q] f32
        mLse: cute.Tensor,  # [s_q, h_q] f32
        scale_log2: Float32,  # sm_scale * log2(e)
        stream,
    ):
        d_qk = self.d_qk
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
        sQ_layout = cute.tile_to_shape(k_atom, (B_H, d_qk), (0, 1))
        sK_layout = cute.tile_to_shape(k_atom, (B_TOPK, d_qk), (0, 1))
        sP_layout = cute.tile_to_shape(k_atom, (B_H, B_TOPK), (0, 1))
        # O leaves through smem one [64 x 64] tile at a time
        sO_tile_layout = cute.tile_to_shape(k_atom, (B_H, 64), (0, 1))

        # Q as (h_q, d_qk, s_q) and O as (h_q, d_v, s_q): one TMA box grid per (token, head block).
        mQ_hds = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 2, 0]))
        mO_hds = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 2, 0]))
        tma_atom_q, tma_q = tma.tile_load_atom(mQ_hds, sQ_layout, (B_H, d_qk))
        tma_atom_o, tma_o = tma.tile_store_atom(mO_hds, sO_tile_layout, (B_H, 64))

        s0_elems = 0 if const_expr(self.s0_in_rope) else B_H * B_TOPK

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_layout)], 1024]
            sK0: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sK1: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sS1: cute.struct.Align[cute.struct.MemRange[BFloat16, B_H * B_TOPK], 1024]
            sS0: cute.struct.Align[cute.struct.MemRange[BFloat16, max(s0_elems, 8)], 1024]
            # q_full, 4 x (ready, free), valid, WG0's max published, WG1's final max published
            mbar: cute.struct.MemRange[cutlass.Int64, 12]
            sValid: cute.struct.MemRange[Uint32, 4]
            sM0: cute.struct.MemRange[Float32, B_H]  # written by WG0 only
            sM1: cute.struct.MemRange[Float32, B_H]  # written by WG1 only
            sL: cute.struct.MemRange[Float32, 2 * B_H]
            # lse / max_logits rows of the 64 heads, for the epilogue's bulk copies
            sOut: cute.struct.Align[cute.struct.MemRange[Float32, 2 * B_H], 16]

        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes <= SMEM_LIMIT, f"smem {self.smem_bytes} > {SMEM_LIMIT}"

        s_q = mQ.shape[0]
        n_hblk = mQ.shape[1] // B_H
        self.kernel(
            mKV, mIdx, mTopkLen, mSink, mMaxLogits, mLse, scale_log2,
            tma_atom_q, tma_q, tma_atom_o, tma_o,
            sQ_layout, sK_layout, sP_layout, sO_tile_layout,
            SharedStorage, n_hblk,
        ).launch(
            grid=[s_q * n_hblk, 1, 1],  # s_q on grid.x: no 65535 cap
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
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mTopkLen: cute.Tensor,
        mSink: cute.Tensor,
        mMaxLogits: cute.Tensor,
        mLse: cute.Tensor,
        scale_log2: Float32,
        tma_atom_q: cute.CopyAtom,
        tma_q: cute.Tensor,
        tma_atom_o: cute.CopyAtom,
        tma_o: cute.Tensor,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        sO_tile_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
        n_hblk: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp_idx // 4
        idx_in_wg = tidx % 128
        h_blk = bidx % n_hblk
        s_idx = bidx // n_hblk

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar = storage.mbar.data_ptr()
        bar_q = mbar
        k0l = dev.HalfBufferBarriers(mbar + 1, mbar + 2)
        k0r = dev.HalfBufferBarriers(mbar + 3, mbar + 4)
        k1l = dev.HalfBufferBarriers(mbar + 5, mbar + 6)
        k1r = dev.HalfBufferBarriers(mbar + 7, mbar + 8)
        bar_valid = mbar + 9
        max0_ready = dev.PhaseSignal(mbar + 10)
        max1_ready = dev.PhaseSignal(mbar + 11)

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_o)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(bar_q, 1)
                for i in cutlass.range_constexpr(4):
                    dev.HalfBufferBarriers.init(mbar + 1 + 2 * i, mbar + 2 + 2 * i, 128, 128)
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
            # buffer 0's RoPE tile (k-tile 8): free once WG0's S0 = Q K0^T is complete
            s0_ptr = storage.sK0.data_ptr() + (self.n_k_tiles - 1) * B_TOPK * 64
            sS0 = cute.make_tensor(cute.recast_ptr(s0_ptr, sP_layout.inner), sP_layout.outer)
        else:
            sS0 = storage.sS0.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)

        topk = mIdx.shape[1]
        topk_len = topk
        if const_expr(self.has_topk_length):
            topk_len = mTopkLen[s_idx]
        num_blocks = (topk_len + (B_TOPK - 1)) // B_TOPK
        num_iters = (num_blocks + 1) // 2

        if warp_idx == 0:
            # The TMA copy elects its own issuing lane: it must not sit inside elect_one.
            tQsQ, tQgQ = tma.token_tile_partition(tma_atom_q, tma_q, s_idx, (B_H, self.d_qk), (h_blk, 0), sQ)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(bar_q, B_H * self.d_qk * 2)
            cute.copy(tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=bar_q)

        # Everything the roles need from `storage`, taken out before the role branch.
        sValid = storage.sValid.get_tensor(cute.make_layout(4))
        sM0 = storage.sM0.get_tensor(cute.make_layout(B_H))
        sM1 = storage.sM1.get_tensor(cute.make_layout(B_H))
        sL = storage.sL.get_tensor(cute.make_layout(2 * B_H))
        sK0_ptr = storage.sK0.data_ptr()
        sK1_ptr = storage.sK1.data_ptr()
        sQ_ptr = storage.sQ.data_ptr()
        sOut = storage.sOut.get_tensor(cute.make_layout(2 * B_H))

        if wg == 2:
            cute.arch.setmaxregister_decrease(self.regs_producer)
            self.producer(
                mKV, mIdx, sK0_ptr, sK1_ptr, sValid, k0l, k0r, k1l, k1r, bar_valid,
                s_idx, topk_len, num_iters, idx_in_wg, warp_idx % 4,
            )
        else:
            cute.arch.setmaxregister_increase(self.regs_consumer)
            self.consumer(
                mSink, mMaxLogits, mLse, scale_log2, tma_atom_o, tma_o, sO_tile_layout,
                sQ_ptr, sValid, sM0, sM1, sL, sOut, sQ, sK0, sK1, sS0, sS1, bar_q, k0l, k0r, k1l, k1r,
                bar_valid, max0_ready, max1_ready, s_idx, h_blk, num_iters, wg, idx_in_wg, warp_idx % 4,
            )

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def producer(
        self,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        sK0_ptr: cute.Pointer,
        sK1_ptr: cute.Pointer,
        sValid: cute.Tensor,
        k0l: cutlass.Constexpr,
        k0r: cutlass.Constexpr,
        k1l: cutlass.Constexpr,
        k1r: cutlass.Constexpr,
        bar_valid,
        s_idx: Int32,
        topk_len: Int32,
        num_iters: Int32,
        ptid: Int32,
        warp_in_wg: Int32,
    ):
        """WG2: gather KV rows with cp.async in halves; publish validity bitmasks."""
        gather = KvGather(mKV, mIdx, s_idx, topk_len, ptid, self.d_qk, slots=2)
        sK0_addr = dev.smem_addr_u32(sK0_ptr)
        sK1_addr = dev.smem_addr_u32(sK1_ptr)
        self._producer_loop(gather, sK0_addr, sK1_addr, sValid, k0l, k0r, k1l, k1r, bar_valid, num_iters, ptid,
                            warp_in_wg)

    @cute.jit
    def _producer_loop(self, gather, sK0_addr, sK1_addr, sValid, k0l: cutlass.Constexpr,
                       k0r: cutlass.Constexpr, k1l: cutlass.Constexpr, k1r: cutlass.Constexpr, bar_valid,
                       num_iters: Int32, ptid: Int32, warp_in_wg: Int32):
        """The producer loop with the indices of iteration ``it + 1`` fetched into registers during
        iteration ``it`` (their latency hides behind the free-barrier waits), and the validity
        masks voted from registers and published once both consumers have released the pieces
        they read the previous masks before (WG0: ``k0l``, WG1: ``k1r``)."""
        rpt = gather.rows_per_thread
        raw = cute.make_rmem_tensor((2 * rpt + 1,), Int32)
        vblk = warp_in_wg // 2  # warps 0-1 vote for block 2it, warps 2-3 for 2it+1
        if num_iters > 0:
            gather.fetch_raw(raw, 0, 0)
            gather.fetch_raw(raw, 1, 1)
            raw[2 * rpt] = gather.fetch_slot(gather.vote_slot(vblk))
        for it in cutlass.range(num_iters, unroll=1):
            parity = it & 1
            gather.indices_from_raw(raw, 2 * it, 0)
            gather.indices_from_raw(raw, 2 * it + 1, 1)
            vslot = gather.vote_slot(2 * it + vblk)
            bits = gather.vote_from_raw(raw[2 * rpt], vslot)
            # Next iteration's indices (slots past topk read a clamped slot; never used past the end).
            gather.fetch_raw(raw, 2 * it + 2, 0)
            gather.fetch_raw(raw, 2 * it + 3, 1)
            raw[2 * rpt] = gather.fetch_slot(vslot + 2 * B_TOPK)
            k0l.wait_free(parity)
            gather.copy_tiles(sK0_addr, 0, 0, self.n_left)
            k0l.commit_cp_async()
            k1r.wait_free(parity)
            # Both consumers have read the previous masks (WG0 before releasing k0l, WG1 before k1r).
            if ptid % 32 == 0:
                sValid[warp_in_wg] = bits
                cute.arch.mbarrier_arrive(bar_valid)
            gather.copy_tiles(sK1_addr, 1, self.n_left, self.n_k_tiles)
            k1r.commit_cp_async()
            k0r.wait_free(parity)
            gather.copy_tiles(sK0_addr, 0, self.n_left, self.n_k_tiles)
            k0r.commit_cp_async()
            k1l.wait_free(parity)
            gather.copy_tiles(sK1_addr, 1, 0, self.n_left)
            k1l.commit_cp_async()

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consumer(
        self,
        mSink: cute.Tensor,
        mMaxLogits: cute.Tensor,
        mLse: cute.Tensor,
        scale_log2: Float32,
        tma_atom_o: cute.CopyAtom,
        tma_o: cute.Tensor,
        sO_tile_layout: cute.ComposedLayout,
        sQ_ptr: cute.Pointer,
        sValid: cute.Tensor,
        sM0: cute.Tensor,
        sM1: cute.Tensor,
        sL: cute.Tensor,
        sOut: cute.Tensor,
        sQ: cute.Tensor,
        sK0: cute.Tensor,
        sK1: cute.Tensor,
        sS0: cute.Tensor,
        sS1: cute.Tensor,
        bar_q,
        k0l: cutlass.Constexpr,
        k0r: cutlass.Constexpr,
        k1l: cutlass.Constexpr,
        k1r: cutlass.Constexpr,
        bar_valid,
        max0_ready: cutlass.Constexpr,
        max1_ready: cutlass.Constexpr,
        s_idx: Int32,
        h_blk: Int32,
        num_iters: Int32,
        wg: Int32,
        idx_in_wg: Int32,
        warp_in_wg: Int32,
    ):
        """WG0 / WG1: QK^T, online softmax, PV, epilogue."""
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
        tOrP_acc = cute.make_tensor(tOrP.iterator, acc_s.layout)  # P in the accumulator's order

        # V^T views (d_v/2 x 64 tokens, MN-major) of this WG's half of each KV buffer.
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

        cute.arch.mbarrier_wait(bar_q, 0)

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
                # Online softmax of block 0 against WG0's running max; publish the max.
                dev.online_softmax(acc_s, acc_o, rM, rL, scale_log2, rM[0], rM[1])
                if lane_quad == 0:
                    sM0[row0] = rM[0]
                    sM0[row1] = rM[1]
                max0_ready.arrive()
                # O_left += P0 V0_left (P0 from registers)
                tOrP_acc.store(acc_s.load().to(BFloat16))
                self._pv(True, acc_o, tOrP, tOrV0_rs)
                cute.nvgpu.warpgroup.wait_group(0)
                k0l.release()
                # Final max from WG1: rescale P0, hand it to WG1 through smem.
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
                # O_left += P1 V1_left (P1 from WG1 through smem)
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
                # Online softmax of block 1 against max(WG0's max, own); publish the final max.
                max0_ready.wait(parity)
                dev.online_softmax(acc_s, acc_o, rM, rL, scale_log2, sM0[row0], sM0[row1])
                if lane_quad == 0:
                    sM1[row0] = rM[0]
                    sM1[row1] = rM[1]
                max1_ready.arrive()
                # O_right += P1 V1_right (registers), then hand P1 to WG0, O_right += P0 V0_right
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

        self._epilogue(
            mSink, mMaxLogits, mLse, tma_atom_o, tma_o, mma_pv_rs, mma_qk, sO_tile_layout, sQ_ptr,
            sL, sOut, acc_s, acc_o, rM, rL, s_idx, h_blk, wg, idx_in_wg, warp_in_wg, row0, row1, lane_quad,
        )

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

    # The ACCUMULATE field is set on a fresh tiled MMA per call: a field set inside one staged
    # region must not leak into another.
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
    def _epilogue(self, mSink, mMaxLogits, mLse, tma_atom_o, tma_o, mma_pv_rs, mma_qk, sO_tile_layout, sQ_ptr,
                  sL, sOut, acc_s, acc_o, rM, rL, s_idx, h_blk, wg, idx_in_wg, warp_in_wg, row0, row1,
                  lane_quad):
        """Combine the two WGs' row sums, normalise O, store O (TMA), lse and max_logits."""
        l0 = dev.quad_sum(rL[0])
        l1 = dev.quad_sum(rL[1])
        if lane_quad == 0:
            sL[wg * B_H + row0] = l0
            sL[wg * B_H + row1] = l1
        cute.arch.barrier(barrier_id=BAR_L_READY, number_of_threads=256)
        l0 = l0 + sL[(1 - wg) * B_H + row0]
        l1 = l1 + sL[(1 - wg) * B_H + row1]

        head0 = h_blk * B_H + row0
        head1 = h_blk * B_H + row1
        sink_term0 = Float32(0.0)
        sink_term1 = Float32(0.0)
        if const_expr(self.has_sink):
            sink_term0 = cute.math.exp2(mSink[head0] * dev.LOG2E - rM[0], fastmath=True)
            sink_term1 = cute.math.exp2(mSink[head1] * dev.LOG2E - rM[1], fastmath=True)
        inv0 = Float32(cutlass.select_(l0 > 0.0, 1.0 / (l0 + sink_term0), Float32(0.0)))
        inv1 = Float32(cutlass.select_(l1 > 0.0, 1.0 / (l1 + sink_term1), Float32(0.0)))
        dev.scale_rows(acc_o, inv0, inv1)

        self._store_tiled(mMaxLogits, mLse, tma_atom_o, tma_o, mma_qk, sO_tile_layout, sQ_ptr, sOut, acc_s,
                          acc_o, rM, l0, l1, s_idx, h_blk, wg, idx_in_wg, warp_in_wg, row0, row1, lane_quad)
        if warp_in_wg == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _store_tiled(self, mMaxLogits, mLse, tma_atom_o, tma_o, mma_qk, sO_tile_layout, sQ_ptr, sOut, acc_s,
                     acc_o, rM, l0, l1, s_idx, h_blk, wg, idx_in_wg, warp_in_wg, row0, row1, lane_quad):
        """This WG's 4 column tiles of O go through smem (aliasing Q) one at a
        time -- stmatrix, then a 64x64 TMA store that runs while the next tile is written -- and
        WG1 stages the lse / max_logits rows in smem for two 256-byte bulk copies."""
        if wg == 1:
            if lane_quad == 0:
                empty0 = l0 == 0.0
                empty1 = l1 == 0.0
                sOut[row0] = Float32(cutlass.select_(empty0, Float32(-math.inf), rM[0] * dev.LN2))
                sOut[row1] = Float32(cutlass.select_(empty1, Float32(-math.inf), rM[1] * dev.LN2))
                sOut[B_H + row0] = Float32(
                    cutlass.select_(empty0, Float32(math.inf), cute.math.log(l0) + rM[0] * dev.LN2)
                )
                sOut[B_H + row1] = Float32(
                    cutlass.select_(empty1, Float32(math.inf), cute.math.log(l1) + rM[1] * dev.LN2)
                )
        st_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), BFloat16)
        thr_st = cute.make_tiled_copy_C(st_atom, mma_qk).get_slice(idx_in_wg)
        n_tiles = self.d_v // 2 // 64
        per_tile = cute.size(acc_s)  # accumulator elements of one 64x64 tile (32)
        for t in cutlass.range_constexpr(n_tiles):
            sOt = cute.make_tensor(
                cute.recast_ptr((sQ_ptr + (wg * n_tiles + t) * (B_H * 64)).align(1024), sO_tile_layout.inner),
                sO_tile_layout.outer,
            )
            acc_t = cute.make_tensor(acc_o.iterator + t * per_tile, acc_s.layout)
            rOt = cute.make_rmem_tensor_like(acc_s, BFloat16)
            rOt.store(acc_t.load().to(BFloat16))
            cute.copy(thr_st, thr_st.retile(rOt), thr_st.partition_D(sOt))
            cute.arch.fence_proxy("async.shared", space="cta")
            if wg == 0:
                cute.arch.barrier(barrier_id=BAR_EPI_TILE + t, number_of_threads=128)
            else:
                cute.arch.barrier(barrier_id=BAR_EPI_TILE + n_tiles + t, number_of_threads=128)
            if warp_in_wg == 0:
                # Whole warp: the TMA store elects its lane; commit/wait are per thread.
                tOsO, tOgO = tma.token_tile_partition(tma_atom_o, tma_o, s_idx, (B_H, 64), (h_blk, wg * n_tiles + t),
                                                      sOt)
                cute.copy(tma_atom_o, tOsO, tOgO)
                if const_expr(t == 0):
                    if wg == 1:
                        if idx_in_wg == 0:
                            row = (Int64(s_idx) * Int64(mLse.shape[1]) + Int64(h_blk * B_H)) * 4
                            src = dev.smem_addr_u32(sOut.iterator)
                            dev.bulk_copy_s2g(dev.gmem_addr_i64(mMaxLogits.iterator) + row, src, Int32(B_H * 4))
                            dev.bulk_copy_s2g(dev.gmem_addr_i64(mLse.iterator) + row, src + B_H * 4, Int32(B_H * 4))
                cute.arch.cp_async_bulk_commit_group()
