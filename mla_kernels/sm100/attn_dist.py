"""Attention distribution on Blackwell (sm_100a), CuTe DSL: ``attn_sum[i, j] = sum_h exp(S_ij,h - lse_ih)``.

The DSA indexer's KL target, as on sm90 (same arguments, same output layout), built on 1-CTA
tcgen05 and TMEM.  One CTA per query token and head group of ``H`` heads (128 when h_q is a
multiple of 128, else 64); 288 threads in three roles:

* warps 4-7 -- **gather**: first Q (``H x d_qk``, dense rows, cp.async) into smem, resident for the
  whole CTA, then the top-k KV rows of every block of ``B_N = 128`` indices
  (:class:`~mla_kernels.common.gather.KvGather`, cp.async with zero-fill for invalid slots), one
  64-column tile per stage of a ``k_stages``-deep smem ring;
* warp 8 -- **MMA**: "SwapAB" ``S^T = K Q^T``: A = the gathered K tile (128 tokens x 64, K-major
  SW128), B = Q (``H`` heads x 64 of the same columns), 4 ``tcgen05.mma`` (M128 x N``H`` x K16)
  per stage, ``d_qk/64`` stages per block, accumulating into one of ``acc_stages`` TMEM slots of
  128 lanes x ``H`` columns: tokens on lanes, heads in columns;
* warps 0-3 -- **epilogue**: thread ``t`` loads TMEM lane ``t`` (token ``t`` of the block) with all
  ``H`` heads (``tcgen05.ld.32x32b``), frees the slot, and reduces over heads in registers:
  ``sum_h exp2(S * c - lse_h * log2e)``, zeroed on invalid slots.  No shuffles, no atomics: each
  output element is written once, by one thread, in coalesced 512-byte rows.

Synchronisation (raw mbarriers, phases from :class:`cutlass.pipeline.PipelineState`):
``k_full[s]`` (128 ``cp.async.mbarrier.arrive.noinc``) -> MMA; ``k_empty[s]`` (``tcgen05.commit``)
-> gather; ``acc_full[a]`` (``tcgen05.commit`` after a block's last MMA) -> epilogue;
``acc_empty[a]`` (128 epilogue arrivals after ``tcgen05.wait::ld``) -> MMA; ``q_full`` once.

Slots past ``topk_length``'s last block are never gathered; the epilogue writes their zeros.
With a single head group per token, ``normalize=True`` is fused (row total reduced over the
epilogue warps, then each thread re-scales the elements it wrote).  For more than one head group
each group writes its own partial row and the host sums the groups, as on sm90.

Not verified on hardware (compile-only; see ``Sm100Backend.hardware_verified``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.pipeline import PipelineUserType, make_pipeline_state

from ..common import device as dev
from ..common.gather import KvGather, copy_dense_rows

B_N = 128  # tokens per block = MMA M = TMEM lanes
K_TILE = 64  # head-dim columns per K stage: one 128-byte SW128 row
MMA_K = 16  # K of one bf16 tcgen05.mma
K_STAGE_BYTES = B_N * K_TILE * 2
SMEM_LIMIT = 232448
#: Barriers, the staged -lse*log2e and the row-total scratch, padded to the 1024-byte alignment
#: of the swizzled Q/K buffers that follow them.
SMEM_HEADER_BYTES = 1024
TMEM_COLUMNS = 512
MAX_ACC_STAGES = 4
MAX_K_STAGES = 12

EPI_WARPS = 4  # warps 0-3: TMEM lanes 32w..32w+31 belong to warp w (w = warp index % 4)
GATHER_WARP0 = 4  # warps 4-7
MMA_WARP = 8
THREADS = 32 * (MMA_WARP + 1)
EPI_THREADS = 32 * EPI_WARPS
GATHER_THREADS = 128

# Named barriers of the epilogue warps, one id per bar.sync site (the rule of docs/DSL_NOTES.md
# "Named barriers"; tests/test_barrier_rule.py checks the SASS).
BAR_LSE = 1  # -lse * log2(e) staged in smem
BAR_TOTAL = 2  # normalisation: row-total exchange
BAR_EPI = 3  # every TMEM read done before warp 0 frees the allocation


@dataclass(frozen=True)
class AttnDistPlan:
    """The static resource plan of one configuration (pure Python: host tests check it)."""

    d_qk: int
    heads: int  # per CTA: MMA N, TMEM columns per accumulator slot
    n_k_tiles: int  # 64-column K stages per block
    k_stages: int
    acc_stages: int
    tmem_cols: int  # allocated (a power of two, 32..512)
    q_bytes: int
    smem_bytes: int

    def acc_columns(self) -> List[Tuple[int, int]]:
        """``[start, end)`` TMEM columns of each accumulator slot."""
        return [(a * self.heads, (a + 1) * self.heads) for a in range(self.acc_stages)]


def attn_dist_plan(d_qk: int, heads: int) -> AttnDistPlan:
    """Smem ring depth and TMEM slots for ``d_qk`` and ``heads`` per CTA (64 or 128)."""
    if d_qk not in (512, 576):
        raise ValueError(f"sm100 attn_dist supports d_qk 512 or 576, got {d_qk}")
    if heads not in (64, 128):
        raise ValueError(f"sm100 attn_dist takes 64 or 128 heads per CTA, got {heads}")
    n_k_tiles = d_qk // K_TILE
    q_bytes = heads * d_qk * 2
    k_stages = min(MAX_K_STAGES, (SMEM_LIMIT - SMEM_HEADER_BYTES - q_bytes) // K_STAGE_BYTES)
    if k_stages < 2:
        raise ValueError(f"smem: {k_stages} K stages for d_qk={d_qk}, heads={heads}")
    acc_stages = min(MAX_ACC_STAGES, TMEM_COLUMNS // heads)
    tmem_cols = acc_stages * heads
    return AttnDistPlan(
        d_qk, heads, n_k_tiles, k_stages, acc_stages, tmem_cols, q_bytes,
        SMEM_HEADER_BYTES + q_bytes + k_stages * K_STAGE_BYTES,
    )


def exp2_head_sum(s_row: cute.Tensor, scale_log2: Float32, neg_lse: cute.Tensor, n: int) -> Float32:
    """``sum_h exp2(s_row[h] * scale_log2 + neg_lse[h])`` over ``h < n`` (``n`` a multiple of 4).

    Packed f32x2 FMA/add (FFMA2/FADD2) into two independent accumulator pairs, so the adds form
    four dependency chains instead of one."""
    acc = [(Float32(0.0), Float32(0.0)), (Float32(0.0), Float32(0.0))]
    for h in range(0, n, 2):
        x0, x1 = cute.arch.fma_packed_f32x2((s_row[h], s_row[h + 1]), (scale_log2, scale_log2),
                                            (neg_lse[h], neg_lse[h + 1]))
        e = (cute.math.exp2(x0, fastmath=True), cute.math.exp2(x1, fastmath=True))
        k = (h // 2) % 2
        acc[k] = cute.arch.add_packed_f32x2(acc[k], e)
    return (acc[0][0] + acc[0][1]) + (acc[1][0] + acc[1][1])


class AttnDistSm100:
    """Static configuration + host launcher + device kernel of the sm100 attention distribution."""

    def __init__(self, d_qk: int, heads_per_cta: int, normalize: bool, has_topk_length: bool):
        self.plan = attn_dist_plan(d_qk, heads_per_cta)
        self.d_qk = d_qk
        self.heads = heads_per_cta
        self.normalize = normalize
        self.has_topk_length = has_topk_length
        self.n_k_tiles = self.plan.n_k_tiles
        self.k_stages = self.plan.k_stages
        self.acc_stages = self.plan.acc_stages
        self.tmem_cols = self.plan.tmem_cols
        self.smem_bytes = 0

    def _mma(self):
        """``S^T = K Q^T``: A = K (128 tokens, K-major), B = Q (``H`` heads, K-major), f32 in TMEM.

        Built fresh per dynamic region: the ACCUMULATE field set inside one must not leak out."""
        return sm100_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32, tcgen05.CtaGroup.ONE,
            (B_N, self.heads),
        )

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [s_q, h_q, d_qk] bf16
        mKV: cute.Tensor,  # [s_kv, d_qk] bf16
        mIdx: cute.Tensor,  # [s_q, topk] int32, topk % 128 == 0
        mTopkLen: cute.Tensor,  # [s_q] int32 (read only if has_topk_length)
        mLse: cute.Tensor,  # [s_q, h_q] f32
        mOut: cute.Tensor,  # [n_groups, s_q, topk] f32
        scale_log2: Float32,
        stream,
    ):
        mma = self._mma()
        sK_layout = sm100_utils.make_smem_layout_a(mma, (B_N, self.heads, K_TILE), BFloat16, self.k_stages)
        sQ_layout = sm100_utils.make_smem_layout_b(mma, (B_N, self.heads, self.d_qk), BFloat16, 1)

        @cute.struct
        class SharedStorage:
            k_full: cute.struct.MemRange[cutlass.Int64, self.k_stages]
            k_empty: cute.struct.MemRange[cutlass.Int64, self.k_stages]
            acc_full: cute.struct.MemRange[cutlass.Int64, self.acc_stages]
            acc_empty: cute.struct.MemRange[cutlass.Int64, self.acc_stages]
            q_full: cute.struct.MemRange[cutlass.Int64, 1]
            tmem_holding: Int32
            red: cute.struct.Align[cute.struct.MemRange[Float32, EPI_WARPS], 16]
            neg_lse: cute.struct.Align[cute.struct.MemRange[Float32, self.heads], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]

        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes <= SMEM_LIMIT, f"smem {self.smem_bytes} > {SMEM_LIMIT}"
        assert cute.cosize(sQ_layout) * 2 == self.plan.q_bytes
        assert cute.cosize(sK_layout) * 2 == self.k_stages * K_STAGE_BYTES
        s_q = mQ.shape[0]
        n_groups = mQ.shape[1] // self.heads
        self.kernel(
            mQ, mKV, mIdx, mTopkLen, mLse, mOut, scale_log2, sQ_layout, sK_layout, SharedStorage, n_groups
        ).launch(
            grid=[s_q * n_groups, 1, 1], block=[THREADS, 1, 1], smem=self.smem_bytes, stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mTopkLen: cute.Tensor,
        mLse: cute.Tensor,
        mOut: cute.Tensor,
        scale_log2: Float32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
        n_groups: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        grp = bidx % n_groups
        s_idx = bidx // n_groups

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        # Pointers out of the struct before any role branch (a struct cannot cross a dynamic if).
        k_full = storage.k_full.data_ptr()
        k_empty = storage.k_empty.data_ptr()
        acc_full = storage.acc_full.data_ptr()
        acc_empty = storage.acc_empty.data_ptr()
        q_full = storage.q_full.data_ptr()
        tmem_holding = storage.tmem_holding.ptr
        red = storage.red.get_tensor(cute.make_layout(EPI_WARPS))
        neg_lse = storage.neg_lse.get_tensor(cute.make_layout(self.heads))
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sQ_addr = dev.smem_addr_u32(storage.sQ.data_ptr())
        sK_addr = dev.smem_addr_u32(storage.sK.data_ptr())

        if warp_idx == MMA_WARP:
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(self.k_stages):
                    cute.arch.mbarrier_init(k_full + s, GATHER_THREADS)  # noinc cp.async arrivals
                    cute.arch.mbarrier_init(k_empty + s, 1)  # tcgen05.commit
                for a in cutlass.range_constexpr(self.acc_stages):
                    cute.arch.mbarrier_init(acc_full + a, 1)  # tcgen05.commit
                    cute.arch.mbarrier_init(acc_empty + a, EPI_THREADS)
                cute.arch.mbarrier_init(q_full, GATHER_THREADS)
        if warp_idx == 0:
            # The epilogue's first warp owns the TMEM allocation (and frees it at the end).
            cute.arch.alloc_tmem(self.tmem_cols, tmem_holding)
            cute.arch.relinquish_tmem_alloc_permit()
            dev.tcgen05_fence_before_thread_sync()
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        topk = mIdx.shape[1]
        topk_len = topk
        if const_expr(self.has_topk_length):
            topk_len = mTopkLen[s_idx]
        num_blocks = (topk_len + (B_N - 1)) // B_N
        head0 = grp * self.heads

        if warp_idx >= GATHER_WARP0 and warp_idx < MMA_WARP:
            self.gather(mQ, mKV, mIdx, s_idx, head0, topk_len, num_blocks, sQ_addr, sK_addr, k_full, k_empty,
                        q_full, tidx - 32 * GATHER_WARP0)
        elif warp_idx == MMA_WARP:
            self.mma_issuer(sQ, sK, tmem_holding, num_blocks, k_full, k_empty, acc_full, acc_empty, q_full)
        elif warp_idx < EPI_WARPS:
            self.epilogue(mKV, mIdx, mLse, mOut, scale_log2, s_idx, grp, head0, topk, topk_len, num_blocks,
                          neg_lse, red, tmem_holding, acc_full, acc_empty, tidx, warp_idx)

    @cute.jit
    def gather(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        s_idx: Int32,
        head0: Int32,
        topk_len: Int32,
        num_blocks: Int32,
        sQ_addr: Int32,
        sK_addr: Int32,
        k_full: cute.Pointer,
        k_empty: cute.Pointer,
        q_full: cute.Pointer,
        ptid: Int32,
    ):
        if num_blocks > 0:  # an empty row issues no copy (nothing may be in flight at exit)
            row0 = Int64(s_idx) * mQ.shape[1] + Int64(head0)
            q_addr = dev.gmem_addr_i64(mQ.iterator) + row0 * (self.d_qk * 2)
            copy_dense_rows(sQ_addr, q_addr, self.d_qk * 2, self.heads, self.n_k_tiles, ptid,
                            dev.createpolicy_evict_first())
            cute.arch.cp_async_mbarrier_arrive_noinc(q_full)
        gather = KvGather(mKV, mIdx, s_idx, topk_len, ptid, self.d_qk, slots=1, rows=B_N)
        stage = make_pipeline_state(PipelineUserType.Producer, self.k_stages)
        for b in cutlass.range(num_blocks, unroll=1):
            gather.load_indices(b, 0)
            for t in cutlass.range_constexpr(self.n_k_tiles):
                cute.arch.mbarrier_wait(k_empty + stage.index, stage.phase)
                gather.copy_tile(sK_addr + stage.index * K_STAGE_BYTES, 0, t)
                cute.arch.cp_async_mbarrier_arrive_noinc(k_full + stage.index)
                stage.advance()

    @cute.jit
    def mma_issuer(
        self,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        tmem_holding: cute.Pointer,
        num_blocks: Int32,
        k_full: cute.Pointer,
        k_empty: cute.Pointer,
        acc_full: cute.Pointer,
        acc_empty: cute.Pointer,
        q_full: cute.Pointer,
    ):
        dev.tcgen05_fence_after_thread_sync()
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_holding)
        mma0 = self._mma()
        tCrA = mma0.make_fragment_A(sK)  # (MMA, 1, K_TILE/16, k_stages)
        tCrB = mma0.make_fragment_B(sQ)  # (MMA, 1, d_qk/16, 1)
        acc_shape = mma0.partition_shape_C((B_N, self.heads))
        tAcc = cute.make_tensor(tmem_ptr, mma0.make_fragment_C(cute.append(acc_shape, self.acc_stages)).layout)
        k_per_tile = K_TILE // MMA_K
        stage = make_pipeline_state(PipelineUserType.Consumer, self.k_stages)
        acc_stage = make_pipeline_state(PipelineUserType.Producer, self.acc_stages)
        if num_blocks > 0:
            cute.arch.mbarrier_wait(q_full, 0)
            # cp.async writes are generic-proxy; tcgen05.mma reads smem through the async proxy.
            # The writers never wait for their own copies (noinc arrivals), so the reader fences
            # after observing the barrier.  (FlashMLA's sm100 cp.async -> UMMA path has no fence
            # at all; this costs one MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S per stage.)
            cute.arch.fence_proxy("async.shared", space="cta")
        for _b in cutlass.range(num_blocks, unroll=1):
            cute.arch.mbarrier_wait(acc_empty + acc_stage.index, acc_stage.phase)
            dev.tcgen05_fence_after_thread_sync()
            mma = self._mma()
            acc = tAcc[None, None, None, acc_stage.index]
            for t in cutlass.range_constexpr(self.n_k_tiles):
                cute.arch.mbarrier_wait(k_full + stage.index, stage.phase)
                cute.arch.fence_proxy("async.shared", space="cta")
                dev.tcgen05_fence_after_thread_sync()
                for kk in cutlass.range_constexpr(k_per_tile):
                    mma.set(tcgen05.Field.ACCUMULATE, t != 0 or kk != 0)
                    cute.gemm(mma, acc, tCrA[None, None, kk, stage.index], tCrB[None, None, t * k_per_tile + kk, 0],
                              acc)
                with cute.arch.elect_one():
                    tcgen05.commit(k_empty + stage.index)  # the stage is free once these MMAs are done
                stage.advance()
            with cute.arch.elect_one():
                tcgen05.commit(acc_full + acc_stage.index)
            acc_stage.advance()

    @cute.jit
    def epilogue(
        self,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mLse: cute.Tensor,
        mOut: cute.Tensor,
        scale_log2: Float32,
        s_idx: Int32,
        grp: Int32,
        head0: Int32,
        topk: Int32,
        topk_len: Int32,
        num_blocks: Int32,
        neg_lse: cute.Tensor,
        red: cute.Tensor,
        tmem_holding: cute.Pointer,
        acc_full: cute.Pointer,
        acc_empty: cute.Pointer,
        tidx: Int32,
        warp_idx: Int32,
    ):
        # -lse * log2(e) of this CTA's heads, read by every thread for every token.
        if tidx < self.heads:
            neg_lse[tidx] = -mLse[s_idx, head0 + tidx] * dev.LOG2E
        cute.arch.barrier(barrier_id=BAR_LSE, number_of_threads=EPI_THREADS)

        dev.tcgen05_fence_after_thread_sync()
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_holding)
        mma = self._mma()
        acc_shape = mma.partition_shape_C((B_N, self.heads))
        tAcc = cute.make_tensor(tmem_ptr, mma.make_fragment_C(cute.append(acc_shape, self.acc_stages)).layout)
        # 32x32b: thread t of the warpgroup reads TMEM lane t (token t of the block); element i of
        # its fragment is column i (head i).
        t2r_atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), Float32)
        t2r = tcgen05.make_tmem_copy(t2r_atom, tAcc[None, None, None, 0]).get_slice(tidx)
        tTR_rS = cute.make_rmem_tensor(t2r.partition_D(tAcc[None, None, None, 0]).shape, Float32)

        s_kv = mKV.shape[0]
        acc_stage = make_pipeline_state(PipelineUserType.Consumer, self.acc_stages)
        total = Float32(0.0)
        for b in cutlass.range(num_blocks, unroll=1):
            slot = b * B_N + tidx
            idx = mIdx[s_idx, cutlass.min(slot, topk - 1)]
            ok = dev.slot_valid(idx, slot, s_kv, topk_len)
            cute.arch.mbarrier_wait(acc_full + acc_stage.index, acc_stage.phase)
            dev.tcgen05_fence_after_thread_sync()
            cute.copy(t2r, t2r.partition_S(tAcc[None, None, None, acc_stage.index]), tTR_rS)
            cute.arch.fence_view_async_tmem_load()
            dev.tcgen05_fence_before_thread_sync()
            cute.arch.mbarrier_arrive(acc_empty + acc_stage.index)  # the MMA may refill the slot now
            acc_stage.advance()
            # (The mask is a select after the sum, so a caller's lse = -inf on a masked slot
            # cannot produce NaN; invalid rows were zero-filled, so their S is finite.)
            val = Float32(cutlass.select_(ok, exp2_head_sum(tTR_rS, scale_log2, neg_lse, self.heads), Float32(0.0)))
            if slot < topk:
                mOut[grp, s_idx, slot] = val
            total = total + val

        # Slots of blocks past topk_length are never gathered: write their zeros.
        n_tail = topk - num_blocks * B_N
        for t in cutlass.range((n_tail + (EPI_THREADS - 1) - tidx) // EPI_THREADS, unroll=1):
            mOut[grp, s_idx, num_blocks * B_N + tidx + t * EPI_THREADS] = Float32(0.0)

        if const_expr(self.normalize):
            for off in cutlass.range_constexpr(5):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=16 >> off)
            if tidx % 32 == 0:
                red[warp_idx] = total
            cute.arch.barrier(barrier_id=BAR_TOTAL, number_of_threads=EPI_THREADS)
            row_total = red[0] + red[1] + red[2] + red[3]
            inv = Float32(cutlass.select_(row_total > 0.0, 1.0 / row_total, Float32(0.0)))
            # Each thread re-scales exactly the elements it wrote (program order, no barrier).
            for b in cutlass.range(num_blocks, unroll=1):
                slot = b * B_N + tidx
                if slot < topk:
                    mOut[grp, s_idx, slot] = mOut[grp, s_idx, slot] * inv

        # Every TMEM read of this warpgroup is complete before warp 0 frees the allocation.
        dev.tcgen05_fence_before_thread_sync()
        cute.arch.barrier(barrier_id=BAR_EPI, number_of_threads=EPI_THREADS)
        if warp_idx == 0:
            dev.tcgen05_fence_after_thread_sync()
            cute.arch.dealloc_tmem(tmem_ptr, self.tmem_cols)
