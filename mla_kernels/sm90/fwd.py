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

For d_qk = 576 WG0's P for WG1 lives in the RoPE tile of its block (free once S0 is computed), which
is what lets Q + two 576-wide buffers fit in 227 KB of smem.

The consumers' loop is ``common/decode_device.PairedBlockConsumer`` (shared with decode's 64-head
kernel).  With the alternating ring (``ring_alt``, the default) the right halves (k-tiles 4..) of
the two buffers trade owners every pair: WG0's next block lies in the two halves freed early in the
current pair (after the products with the freeing warpgroup's own P), WG1's in the two freed last,
so WG0's QK product never waits for copies issued at the end of a pair.  The loop is then traced
once per parity: each warpgroup's P-landed barrier (WG1: ``BAR_S0_READY``, WG0: ``BAR_S1_READY``)
is synced at two addresses, one per body, by the same 128 threads in turn.

``rotate_shift`` (opt-in on kv-ordered slots, ``common/order_host.fwd_rotate_shift_for``): one
thread reads ``%globaltimer >> rotate_shift`` at the CTA's start into smem, and the producer
gathers the row's block pairs from pair ``tick % num_pairs`` on, wrapping around.  With each row's
slots in kv-band order, pair ``i`` of every row covers about the ``i``-th sixteenth of the kv
range, so the CTAs running at any time gather from one band that stays in L2 (the backward's
rotated block order).  The consumers do not see the order: their validity masks say which slots
count, wherever the half-empty pair of an odd block count falls.

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
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from ..common import decode_device as dd
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

    def __init__(self, d_qk: int, d_v: int = 512, has_topk_length: bool = False, has_sink: bool = False,
                 rotate_shift: int = 0):
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
        # the alternating KV ring (common/decode_device.PairedBlockConsumer.loop(alt=True)): the
        # right halves of the two buffers swap owners every block pair; compile_fwd sets it
        # (sm90.DEFAULT_FWD_RING, MLA_KERNELS_FWD_RING)
        self.ring_alt = False
        # setmaxnreg budget: 2*consumer + producer must not exceed the launch allocation of
        # 168 regs x 384 threads (= 504 per thread-slot of a warpgroup), or the increase blocks.
        # Pair order (``rotate_shift`` > 0): the producer starts the row's block pairs at pair
        # ``(%globaltimer >> rotate_shift) % num_pairs`` and wraps around.  On band-ordered slots
        # (``common/order_host.kv_ordered``) the CTAs running at any time then gather from one kv
        # band (the backward's rotated block order, for the forward's gather).  Only the producer
        # reads it: the consumers' online softmax does not depend on the order of the pairs (their
        # validity masks say which slots count), so the outputs differ by rounding only.
        if not 0 <= rotate_shift <= 40:
            raise ValueError(f"rotate_shift must be in [0, 40], got {rotate_shift}")
        self.rotate_shift = rotate_shift
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
            # rotate_shift: the pair-order tick, read once per CTA (every producer thread must
            # gather the same pair)
            sStart: cute.struct.MemRange[Int32, 1]

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
                if const_expr(self.rotate_shift > 0):
                    storage.sStart[0] = dev.globaltimer_ticks(self.rotate_shift)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK0 = storage.sK0.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sK1 = storage.sK1.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sS1 = storage.sS1.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        # WG0's P0 for WG1: the RoPE tile of WG0's block at d_qk 576 (per parity with the alternating ring)
        sS0, sS0b = dd.p0_tiles(storage, sP_layout, self.n_k_tiles, self.s0_in_rope, self.ring_alt)

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
        tick = storage.sStart[0] if const_expr(self.rotate_shift > 0) else Int32(0)

        if wg == 2:
            cute.arch.setmaxregister_decrease(self.regs_producer)
            self.producer(
                mKV, mIdx, sK0_ptr, sK1_ptr, sValid, k0l, k0r, k1l, k1r, bar_valid,
                s_idx, topk_len, num_iters, tick, idx_in_wg, warp_idx % 4,
            )
        else:
            cute.arch.setmaxregister_increase(self.regs_consumer)
            self.consumer(
                mSink, mMaxLogits, mLse, scale_log2, tma_atom_o, tma_o, sO_tile_layout,
                sQ_ptr, sValid, sM0, sM1, sL, sOut, sQ, sK0, sK1, sS0, sS1, sS0b, bar_q, k0l, k0r, k1l, k1r,
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
        tick: Int32,
        ptid: Int32,
        warp_in_wg: Int32,
    ):
        """WG2: gather KV rows with cp.async in halves; publish validity bitmasks (``tick``: the
        CTA's pair-order tick, ``rotate_shift`` only)."""
        gather = KvGather(mKV, mIdx, s_idx, topk_len, ptid, self.d_qk, slots=2)
        sK0_addr = dev.smem_addr_u32(sK0_ptr)
        sK1_addr = dev.smem_addr_u32(sK1_ptr)
        self._producer_loop(gather, sK0_addr, sK1_addr, sValid, k0l, k0r, k1l, k1r, bar_valid, num_iters, tick, ptid,
                            warp_in_wg)

    @cute.jit
    def _producer_loop(self, gather, sK0_addr, sK1_addr, sValid, k0l: cutlass.Constexpr,
                       k0r: cutlass.Constexpr, k1l: cutlass.Constexpr, k1r: cutlass.Constexpr, bar_valid,
                       num_iters: Int32, tick: Int32, ptid: Int32, warp_in_wg: Int32):
        """The producer loop with the indices of iteration ``it + 1`` fetched into registers during
        iteration ``it`` (their latency hides behind the free-barrier waits), and the validity
        masks voted from registers and published once both consumers have released the pieces
        they read the previous masks before (WG0: ``k0l``, WG1: the right half of its own block --
        ``k1r``, or with the alternating ring ``k0r`` after odd pairs); ``ring_alt``: the pair
        loop once per parity (:meth:`_producer_pair`)."""
        rpt = gather.rows_per_thread
        raw = cute.make_rmem_tensor((2 * rpt + 1,), Int32)
        vblk = warp_in_wg // 2  # warps 0-1 vote for block 2it, warps 2-3 for 2it+1
        if const_expr(self.rotate_shift > 0):
            start = tick % cutlass.max(num_iters, Int32(1))
            if num_iters > 0:
                gather.fetch_raw(raw, 2 * start, 0)
                gather.fetch_raw(raw, 2 * start + 1, 1)
                raw[2 * rpt] = gather.fetch_slot(gather.vote_slot(2 * start + vblk))
            dd.for_pairs(num_iters, self.ring_alt, lambda it, parity, odd, next_odd: self._producer_pair(
                gather, raw, it, dev.wrap_index(it, start, num_iters), dev.wrap_index(it + 1, start, num_iters),
                parity, odd, sK0_addr, sK1_addr, sValid, k0l, k0r, k1l, k1r, bar_valid, ptid, warp_in_wg))
        else:
            if num_iters > 0:
                gather.fetch_raw(raw, 0, 0)
                gather.fetch_raw(raw, 1, 1)
                raw[2 * rpt] = gather.fetch_slot(gather.vote_slot(vblk))
            dd.for_pairs(num_iters, self.ring_alt, lambda it, parity, odd, next_odd: self._producer_pair(
                gather, raw, it, it, it, parity, odd, sK0_addr, sK1_addr, sValid, k0l, k0r, k1l, k1r, bar_valid, ptid,
                warp_in_wg))

    @cute.jit
    def _producer_pair(self, gather, raw, it: Int32, pa: Int32, pn: Int32, parity, odd: cutlass.Constexpr,
                       sK0_addr, sK1_addr, sValid, k0l: cutlass.Constexpr, k0r: cutlass.Constexpr,
                       k1l: cutlass.Constexpr, k1r: cutlass.Constexpr, bar_valid, ptid: Int32, warp_in_wg: Int32):
        """Loop step ``it`` gathers the row's block pair ``pa``: blocks ``2 pa`` (WG0's) and
        ``2 pa + 1`` (WG1's), and fetches the next pair's indices (``rotate_shift``: pair ``pn``;
        else ``pa = it`` and the next pair is ``it + 1``, ``pn`` unused); ``it`` picks the buffers
        and barrier phases.  The fixed ring
        fills 0L, 1R, 0R, 1L; the alternating one (``odd``: the right halves traded) left 0,
        WG0's right, WG1's right, left 1.  The masks go out after the second free wait: by then
        WG0 has released its left half and WG1 its own right half, each after reading its mask."""
        rpt = gather.rows_per_thread
        vblk = warp_in_wg // 2  # warps 0-1 vote for block 2it, warps 2-3 for 2it+1
        gather.indices_from_raw(raw, 2 * pa, 0)
        gather.indices_from_raw(raw, 2 * pa + 1, 1)
        vslot = gather.vote_slot(2 * pa + vblk)
        bits = gather.vote_from_raw(raw[2 * rpt], vslot)
        # Next iteration's indices (slots past topk read a clamped slot; never used past the end).
        if const_expr(self.rotate_shift > 0):
            gather.fetch_raw(raw, 2 * pn, 0)
            gather.fetch_raw(raw, 2 * pn + 1, 1)
            raw[2 * rpt] = gather.fetch_slot(gather.vote_slot(2 * pn + vblk))
        else:
            gather.fetch_raw(raw, 2 * pa + 2, 0)
            gather.fetch_raw(raw, 2 * pa + 3, 1)
            raw[2 * rpt] = gather.fetch_slot(vslot + 2 * B_TOPK)
        k0l.wait_free(parity)
        gather.copy_tiles(sK0_addr, 0, 0, self.n_left)
        k0l.commit_cp_async()
        for i, (k_r, addr, slot) in enumerate(dd.right_halves(k0r, k1r, sK0_addr, sK1_addr, self.ring_alt, odd)):
            k_r.wait_free(parity)
            if const_expr(i == 0):
                # Both consumers have read the previous masks (WG0 before releasing k0l, WG1 before
                # its own right half, the first of these).
                if ptid % 32 == 0:
                    sValid[warp_in_wg] = bits
                    cute.arch.mbarrier_arrive(bar_valid)
            gather.copy_tiles(addr, slot, self.n_left, self.n_k_tiles)
            k_r.commit_cp_async()
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
        sS0b,
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
        """WG0 / WG1: QK^T, online softmax, PV (the paired-block schedule of
        ``common/decode_device.PairedBlockConsumer``), epilogue."""
        c = dd.PairedBlockConsumer(sQ, sK0, sK1, sS0, sS1, idx_in_wg, wg, self.d_qk, self.d_v, sS0b)
        cute.arch.mbarrier_wait(bar_q, 0)
        c.loop(sValid, sM0, sM1, k0l, k0r, k1l, k1r, bar_valid, max0_ready, max1_ready, BAR_S0_READY, BAR_S1_READY,
               num_iters, wg, scale_log2, self.ring_alt)
        self._epilogue(
            mSink, mMaxLogits, mLse, tma_atom_o, tma_o, c.mma_rs, c.mma_qk, sO_tile_layout, sQ_ptr,
            sL, sOut, c.acc_s, c.acc_o, c.rM, c.rL, s_idx, h_blk, wg, idx_in_wg, warp_in_wg, c.row0, c.row1,
            c.lane_quad,
        )

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
