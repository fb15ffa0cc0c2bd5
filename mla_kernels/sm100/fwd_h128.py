"""Sparse MLA forward on Blackwell (sm_100a), CuTe DSL: 128 heads per 2-CTA cluster.

Same op, arguments and conventions as ``fwd.py`` (the 64-head 1-CTA kernel); this one serves
h_q = 128 k with clusters of two CTAs (``tcgen05`` ``cta_group::2``, M128 = 2 x 64 heads), so
that each CTA holds half of every K block: the MMA reads half the K bytes per CTA and the pair
fetches 576 + 2 x 256 columns per KV row instead of 2 x 576 (SM100_NOTES 1a, FlashMLA head128's
operand split, with cp.async instead of TMA gather4).

One cluster per (query token, 128-head group), CTA r owning heads ``64 r .. 64 r + 63``; 288
threads per CTA:

* warps 4-7 -- **gather**: Q (own 64 heads) once; per block of ``B_TOPK = 64`` indices the K rows
  of tokens ``32 r .. 32 r + 31`` (all ``d_qk`` columns, the QK MMA's N half of this CTA) and the
  V columns this CTA feeds PV's N split (dims ``128 r + [0, 128)`` and ``256 + 128 r + [0, 128)``)
  of all 64 tokens, into a 2-stage ring;
* warp 8 -- CTA 0: **MMA** (``S = Q K^T`` M128 x N64, ``O += P V`` 2 x M128 x N256, commits
  multicast to both CTAs); CTA 1: **relay** -- cp.async completion can only arrive on a local
  mbarrier, so this warp waits CTA 1's gather barriers and forwards them to CTA 0's;
* warps 0-3 -- **softmax, correction, epilogue**: the M128 (2-CTA) accumulator puts row ``i`` of
  this CTA in TMEM lane ``i`` for columns ``[0, N/2)`` and lane ``64 + i`` for ``[N/2, N)``, so
  thread ``t`` (``tcgen05.ld.32x32b``) owns row ``t % 64``, column half ``t / 64``: row maxima
  and sums are combined with thread ``t ^ 64`` through smem.  Lazy rescale per row (the two
  threads of a row decide alike), O rescaled in TMEM by warps whose rows moved.

Every barrier the MMA waits on lives in CTA 0: the softmax threads of both CTAs arrive there
(remote arrivals at cluster scope), the relay forwards CTA 1's gather completion there; MMA
completion is ``tcgen05.commit.cta_group::2`` multicast to both CTAs (mask 0b11).  No
``cta_group::1`` tcgen05 op appears (alloc/dealloc/commit/mma are all ``cta_group::2``).

TMEM (512 columns): O at columns 0-255 (both N256 tiles, 128 lanes each), scores at 256-287 and
288-319.  Not verified on hardware (compile-only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

from ..common import device as dev
from ..common.gather import KvGather, copy_dense_rows
from .fwd import D_V, K_TILE, MMA_K, RESCALE_THRESHOLD, SMEM_HEADER_BYTES, SMEM_LIMIT

B_H = 128  # heads per cluster = MMA M
B_H_CTA = 64  # heads per CTA
B_TOPK = 64  # tokens per block = QK's N = PV's K
K_ROWS = B_TOPK // 2  # K rows per CTA (QK's N split)
V_HALF = 256  # PV's N per instruction
V_COLS_CTA = V_HALF  # V columns per CTA: 128 of each of the two N256 instructions
KV_STAGES = 2
TMEM_ALLOC = 512
S_COL0 = 256
S_COLS = B_TOPK // 2  # an M128 2-CTA accumulator folds N into two 64-lane halves
O_CHUNK = 32  # columns per 32x32b TMEM round trip

SOFTMAX_WARPS = 4
GATHER_WARP0 = 4
MMA_WARP = 8  # CTA 0: MMA issuer; CTA 1: relay
THREADS = 32 * (MMA_WARP + 1)
SOFTMAX_THREADS = 128
GATHER_THREADS = 128

# Named barriers of the 128 softmax threads, one id per bar.sync site (the rule of
# docs/DSL_NOTES.md "Named barriers"; one id synced from two code addresses is safe only when the
# same threads reach them in the same order, which the SASS check cannot see).
BAR_MAX = 1  # per block: partial row max exchange
BAR_SUM = 2  # epilogue: partial row sum exchange
#: Row max (two block-parity slots) and row sum exchange between threads t and t ^ 64: 4 x 128 f32.
RED_FLOATS = 4 * 2 * B_H_CTA

MB_Q_LOCAL = 0  # 128 noinc (this CTA's Q landed)
MB_KV_LOCAL = 1  # + stage, 128 noinc (this CTA's K and V of the stage landed)
MB_Q_PEER = 3  # CTA 0 only: 1 remote arrival from CTA 1's relay
MB_KV_PEER = 4  # + stage, CTA 0 only
MB_S_FULL = 6  # + buffer, multicast commit
MB_S_EMPTY = 8  # + buffer, CTA 0 only: 256 arrivals (both CTAs' softmax threads)
MB_P_FULL = 10  # CTA 0 only: 256
MB_O_DONE = 11  # multicast commit
MB_KV_EMPTY = 12  # + stage, multicast commit
N_MBAR = 14


@dataclass(frozen=True)
class FwdH128Plan:
    d_qk: int
    n_k_tiles: int
    q_bytes: int
    k_stage_bytes: int
    v_stage_bytes: int
    p_bytes: int
    smem_bytes: int

    @staticmethod
    def tmem_regions():
        """``(name, lane_lo, lane_hi, col_lo, col_hi)`` per CTA."""
        return [
            ("O[:, 0:256]", 0, 128, 0, 128),
            ("O[:, 256:512]", 0, 128, 128, 256),
            ("S0", 0, 128, S_COL0, S_COL0 + S_COLS),
            ("S1", 0, 128, S_COL0 + S_COLS, S_COL0 + 2 * S_COLS),
        ]


def fwd_h128_plan(d_qk: int) -> FwdH128Plan:
    if d_qk not in (512, 576):
        raise ValueError(f"sm100 forward supports d_qk 512 or 576, got {d_qk}")
    q_bytes = B_H_CTA * d_qk * 2
    k_stage = K_ROWS * d_qk * 2
    v_stage = B_TOPK * V_COLS_CTA * 2
    p_bytes = B_H_CTA * B_TOPK * 2
    smem = SMEM_HEADER_BYTES + 4 * RED_FLOATS + q_bytes + KV_STAGES * (k_stage + v_stage) + p_bytes
    if smem > SMEM_LIMIT:
        raise ValueError(f"smem {smem} > {SMEM_LIMIT}")
    return FwdH128Plan(d_qk, d_qk // K_TILE, q_bytes, k_stage, v_stage, p_bytes, smem)


class SparseMlaFwdSm100H128:
    """Static configuration + host launcher + device kernel of the 2-CTA sm100 sparse forward."""

    def __init__(self, d_qk: int, d_v: int = D_V, has_topk_length: bool = False, has_sink: bool = False):
        if d_v != D_V:
            raise ValueError(f"sm100 forward supports d_v {D_V}, got {d_v}")
        self.plan = fwd_h128_plan(d_qk)
        self.d_qk = d_qk
        self.has_topk_length = has_topk_length
        self.has_sink = has_sink
        self.n_k_tiles = self.plan.n_k_tiles
        self.smem_bytes = 0

    def _mma_qk(self):
        return sm100_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32, tcgen05.CtaGroup.TWO, (B_H, B_TOPK)
        )

    def _mma_pv(self):
        return sm100_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32, tcgen05.CtaGroup.TWO, (B_H, V_HALF)
        )

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor, mTopkLen: cute.Tensor,
                 mSink: cute.Tensor, mO: cute.Tensor, mMaxLogits: cute.Tensor, mLse: cute.Tensor,
                 scale_log2: Float32, stream):
        mma_qk = self._mma_qk()
        mma_pv = self._mma_pv()
        sQ_layout = sm100_utils.make_smem_layout_a(mma_qk, (B_H, B_TOPK, self.d_qk), BFloat16, 1)
        sK_layout = sm100_utils.make_smem_layout_b(mma_qk, (B_H, B_TOPK, self.d_qk), BFloat16, KV_STAGES)
        sP_layout = sm100_utils.make_smem_layout_a(mma_pv, (B_H, V_HALF, B_TOPK), BFloat16, 1)
        sV_layout = sm100_utils.make_smem_layout_b(mma_pv, (B_H, V_HALF, B_TOPK), BFloat16, 1)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, N_MBAR]
            tmem_holding: Int32
            red: cute.struct.Align[cute.struct.MemRange[Float32, RED_FLOATS], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[BFloat16, KV_STAGES * B_TOPK * V_COLS_CTA], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sP_layout)], 1024]

        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes == self.plan.smem_bytes <= SMEM_LIMIT, f"smem {self.smem_bytes}"
        assert cute.cosize(sK_layout) * 2 == KV_STAGES * self.plan.k_stage_bytes
        assert cute.cosize(sV_layout) * 4 == self.plan.v_stage_bytes  # two N256 instructions per stage

        s_q = mQ.shape[0]
        n_hgrp = mQ.shape[1] // B_H
        self.kernel(
            mQ, mKV, mIdx, mTopkLen, mSink, mO, mMaxLogits, mLse, scale_log2,
            sQ_layout, sK_layout, sP_layout, sV_layout, SharedStorage, n_hgrp,
        ).launch(
            grid=[2 * s_q * n_hgrp, 1, 1], block=[THREADS, 1, 1], cluster=[2, 1, 1], smem=self.smem_bytes,
            stream=stream, min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor, mTopkLen: cute.Tensor,
               mSink: cute.Tensor, mO: cute.Tensor, mMaxLogits: cute.Tensor, mLse: cute.Tensor,
               scale_log2: Float32, sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr,
               n_hgrp: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster = bidx // 2
        h_grp = cluster % n_hgrp
        s_idx = cluster // n_hgrp
        head0 = h_grp * B_H + rank * B_H_CTA

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar = storage.mbar.data_ptr()
        tmem_holding = storage.tmem_holding.ptr
        red = storage.red.get_tensor(cute.make_layout(RED_FLOATS))
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sV_ptr = storage.sV.data_ptr()
        sQ_addr = dev.smem_addr_u32(storage.sQ.data_ptr())
        sK_addr = dev.smem_addr_u32(storage.sK.data_ptr())
        sV_addr = dev.smem_addr_u32(sV_ptr)
        sP_addr = dev.smem_addr_u32(storage.sP.data_ptr())

        if warp_idx == MMA_WARP:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar + MB_Q_LOCAL, GATHER_THREADS)
                cute.arch.mbarrier_init(mbar + MB_Q_PEER, 1)
                for s in cutlass.range_constexpr(KV_STAGES):
                    cute.arch.mbarrier_init(mbar + MB_KV_LOCAL + s, GATHER_THREADS)
                    cute.arch.mbarrier_init(mbar + MB_KV_PEER + s, 1)
                    cute.arch.mbarrier_init(mbar + MB_KV_EMPTY + s, 1)
                for j in cutlass.range_constexpr(2):
                    cute.arch.mbarrier_init(mbar + MB_S_FULL + j, 1)
                    cute.arch.mbarrier_init(mbar + MB_S_EMPTY + j, 2 * SOFTMAX_THREADS)
                cute.arch.mbarrier_init(mbar + MB_P_FULL, 2 * SOFTMAX_THREADS)
                cute.arch.mbarrier_init(mbar + MB_O_DONE, 1)
        if warp_idx == 0:
            # cta_group::2 allocation: one warp of each CTA of the pair.
            cute.arch.alloc_tmem(TMEM_ALLOC, tmem_holding, is_two_cta=True)
            cute.arch.relinquish_tmem_alloc_permit(is_two_cta=True)
            dev.tcgen05_fence_before_thread_sync()
        cute.arch.mbarrier_init_fence()
        # The peer's remote arrivals and multicast commits must find initialised barriers.
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()

        topk = mIdx.shape[1]
        topk_len = topk
        if const_expr(self.has_topk_length):
            topk_len = mTopkLen[s_idx]
        num_blocks = (topk_len + (B_TOPK - 1)) // B_TOPK

        if warp_idx >= GATHER_WARP0 and warp_idx < MMA_WARP:
            self.gather(mQ, mKV, mIdx, s_idx, head0, rank, topk_len, num_blocks, sQ_addr, sK_addr, sV_addr, mbar,
                        tidx - 32 * GATHER_WARP0)
        elif warp_idx == MMA_WARP:
            if rank == 0:
                self.mma_issuer(sQ, sK, sP, sV_ptr, sV_layout, tmem_holding, num_blocks, mbar)
            else:
                self.relay(num_blocks, mbar)
        elif warp_idx < SOFTMAX_WARPS:
            self.softmax(mKV, mIdx, mSink, mO, mMaxLogits, mLse, scale_log2, s_idx, head0, topk, topk_len,
                         num_blocks, sP_addr, red, tmem_holding, mbar, tidx)

        # Nothing of the pair may exit while the peer can still arrive on its barriers or use TMEM.
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if warp_idx == 0:
            dev.tcgen05_fence_after_thread_sync()
            tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_holding)
            cute.arch.dealloc_tmem(tmem_ptr, TMEM_ALLOC, is_two_cta=True)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def gather(self, mQ, mKV, mIdx, s_idx, head0, rank, topk_len, num_blocks, sQ_addr, sK_addr, sV_addr, mbar,
               ptid):
        """Warps 4-7: Q once; per block this CTA's 32 K rows (all columns) and its V columns."""
        if num_blocks > 0:
            row0 = Int64(s_idx) * mQ.shape[1] + Int64(head0)
            q_addr = dev.gmem_addr_i64(mQ.iterator) + row0 * (self.d_qk * 2)
            copy_dense_rows(sQ_addr, q_addr, self.d_qk * 2, B_H_CTA, self.n_k_tiles, ptid,
                            dev.createpolicy_evict_first())
            cute.arch.cp_async_mbarrier_arrive_noinc(mbar + MB_Q_LOCAL)
        k_gather = KvGather(mKV, mIdx, s_idx, topk_len, ptid, self.d_qk, slots=1, rows=K_ROWS)
        v_gather = KvGather(mKV, mIdx, s_idx, topk_len, ptid, self.d_qk, slots=1, rows=B_TOPK)
        for b in cutlass.range(num_blocks, unroll=1):
            stage = b % KV_STAGES
            cute.arch.mbarrier_wait(mbar + MB_KV_EMPTY + stage, ((b // KV_STAGES) & 1) ^ 1)
            # K: tokens 32 rank .. 32 rank + 31 of the block = 32-row block 2 b + rank.
            k_gather.load_indices(2 * b + rank, 0)
            k_gather.copy_tiles(sK_addr + stage * self.plan.k_stage_bytes, 0, 0, self.n_k_tiles)
            # V: column tiles 4 h + 2 rank + c (dims 256 h + 128 rank + 64 c ..) of all 64 tokens,
            # stored as tile 2 h + c of the stage (the N half this CTA feeds to PV instruction h).
            v_gather.load_indices(b, 0)
            v_base = sV_addr + stage * self.plan.v_stage_bytes
            for h in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(2):
                    v_gather.copy_tile(v_base + (2 * h + c) * (B_TOPK * K_TILE * 2), 0, 4 * h + 2 * rank + c)
            cute.arch.cp_async_mbarrier_arrive_noinc(mbar + MB_KV_LOCAL + stage)

    @cute.jit
    def relay(self, num_blocks: Int32, mbar: cute.Pointer):
        """CTA 1, warp 8: forward this CTA's gather completions to CTA 0's barriers."""
        if num_blocks > 0:
            cute.arch.mbarrier_wait(mbar + MB_Q_LOCAL, 0)
            cute.arch.fence_proxy("async.shared", space="cta")  # generic cp.async -> async-proxy MMA reads
            with cute.arch.elect_one():
                dev.arrive_cta0(mbar + MB_Q_PEER)
        for b in cutlass.range(num_blocks, unroll=1):
            stage = b % KV_STAGES
            cute.arch.mbarrier_wait(mbar + MB_KV_LOCAL + stage, (b // KV_STAGES) & 1)
            cute.arch.fence_proxy("async.shared", space="cta")
            with cute.arch.elect_one():
                dev.arrive_cta0(mbar + MB_KV_PEER + stage)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def mma_issuer(self, sQ, sK, sP, sV_ptr, sV_layout, tmem_holding, num_blocks, mbar):
        """CTA 0, warp 8: QK(j+1) before PV(j); every commit multicast to both CTAs."""
        dev.tcgen05_fence_after_thread_sync()
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_holding)
        if num_blocks > 0:
            cute.arch.mbarrier_wait(mbar + MB_Q_LOCAL, 0)
            cute.arch.mbarrier_wait(mbar + MB_Q_PEER, 0)
            cute.arch.fence_proxy("async.shared", space="cta")
            self._issue_qk(sQ, sK, tmem_ptr, mbar, Int32(0))
        for b in cutlass.range(num_blocks, unroll=1):
            if b + 1 < num_blocks:
                self._issue_qk(sQ, sK, tmem_ptr, mbar, b + 1)
            cute.arch.mbarrier_wait(mbar + MB_P_FULL, b & 1)
            dev.tcgen05_fence_after_thread_sync()
            self._issue_pv(sP, sV_ptr, sV_layout, tmem_ptr, mbar, b)

    @cute.jit
    def _issue_qk(self, sQ, sK, tmem_ptr, mbar, j: Int32):
        mma = self._mma_qk()
        tCrQ = mma.make_fragment_A(sQ)
        tCrK = mma.make_fragment_B(sK)
        s_layout = mma.make_fragment_C(mma.partition_shape_C((B_H, B_TOPK))).layout
        tS_all = cute.make_tensor(tmem_ptr + S_COL0, cute.append(s_layout, cute.make_layout(2, stride=S_COLS)))
        stage = j % KV_STAGES
        buf = j % 2
        phase = (j // KV_STAGES) & 1
        cute.arch.mbarrier_wait(mbar + MB_KV_LOCAL + stage, phase)
        cute.arch.mbarrier_wait(mbar + MB_KV_PEER + stage, phase)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_wait(mbar + MB_S_EMPTY + buf, ((j // 2) & 1) ^ 1)
        dev.tcgen05_fence_after_thread_sync()
        tS = tS_all[None, None, None, buf]
        for k in cutlass.range_constexpr(self.d_qk // MMA_K):
            mma.set(tcgen05.Field.ACCUMULATE, k != 0)
            cute.gemm(mma, tS, tCrQ[None, None, k, 0], tCrK[None, None, k, stage], tS)
        with cute.arch.elect_one():
            tcgen05.commit(mbar + MB_S_FULL + buf, 0b11, tcgen05.CtaGroup.TWO)

    @cute.jit
    def _issue_pv(self, sP, sV_ptr, sV_layout, tmem_ptr, mbar, j: Int32):
        mma = self._mma_pv()
        tCrP = mma.make_fragment_A(sP)
        # One N256 tile: 128 lanes x 128 columns per CTA; tile h at column 128 h (what the DSL's
        # (128 x 512) fragment does: N-tile stride 128 columns).
        o_layout = mma.make_fragment_C(mma.partition_shape_C((B_H, V_HALF))).layout
        stage = j % KV_STAGES
        for h in cutlass.range_constexpr(D_V // V_HALF):
            v_ptr = sV_ptr + stage * (B_TOPK * V_COLS_CTA) + h * (2 * B_TOPK * K_TILE)
            sV = cute.make_tensor(cute.recast_ptr(v_ptr, sV_layout.inner), sV_layout.outer)
            tCrV = mma.make_fragment_B(sV)
            acc = cute.make_tensor(tmem_ptr + h * (V_HALF // 2), o_layout)
            for k in cutlass.range_constexpr(B_TOPK // MMA_K):
                if const_expr(k == 0):
                    mma.set(tcgen05.Field.ACCUMULATE, j > 0)
                else:
                    mma.set(tcgen05.Field.ACCUMULATE, True)
                cute.gemm(mma, acc, tCrP[None, None, k, 0], tCrV[None, None, k, 0], acc)
        with cute.arch.elect_one():
            tcgen05.commit(mbar + MB_KV_EMPTY + stage, 0b11, tcgen05.CtaGroup.TWO)
            tcgen05.commit(mbar + MB_O_DONE, 0b11, tcgen05.CtaGroup.TWO)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def softmax(self, mKV, mIdx, mSink, mO, mMaxLogits, mLse, scale_log2, s_idx, head0, topk, topk_len, num_blocks,
                sP_addr, red, tmem_holding, mbar, tidx):
        """Warps 0-3: thread t owns row t % 64, score columns 32 (t / 64) .. +31 of each block and
        O columns 256 h + 128 (t / 64) .. +127 of both N256 tiles."""
        lane = tidx % 32
        row = tidx % B_H_CTA
        chalf = tidx // B_H_CTA
        partner = (1 - chalf) * B_H_CTA + row
        s_kv = mKV.shape[0]

        dev.tcgen05_fence_after_thread_sync()
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_holding)
        mma = self._mma_qk()
        s_layout = mma.make_fragment_C(mma.partition_shape_C((B_H, B_TOPK))).layout
        tS_all = cute.make_tensor(tmem_ptr + S_COL0, cute.append(s_layout, cute.make_layout(2, stride=S_COLS)))
        t2r_s = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), Float32), tS_all[None, None, None, 0]
        ).get_slice(tidx)
        rS = cute.make_rmem_tensor(t2r_s.partition_D(tS_all[None, None, None, 0]).shape, Float32)
        # O in 32-column chunks of this thread's 64-lane half: a (128 lanes x 32 cols) view per chunk
        # (the same fold as S, so one copy atom serves S and O).
        chunk_layout = s_layout
        t2r_o = t2r_s
        r2t_o = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition.x32), Float32), tS_all[None, None, None, 0]
        ).get_slice(tidx)
        o_chunks = cute.make_tensor(tmem_ptr, cute.append(chunk_layout, cute.make_layout(2 * V_HALF // B_TOPK,
                                                                                         stride=S_COLS)))
        rO = cute.make_rmem_tensor(rS.shape, Float32)

        m = -1e30
        rM = cute.make_rmem_tensor((1,), Float32)
        rMax = cute.make_rmem_tensor((1,), Float32)
        rL = cute.make_rmem_tensor((1,), Float32)
        rM[0] = Float32(m)
        rMax[0] = Float32(-math.inf)
        rL[0] = Float32(0.0)

        for b in cutlass.range(num_blocks, unroll=1):
            buf = b % 2
            slot = b * B_TOPK + 32 * chalf + lane
            idx = mIdx[s_idx, cutlass.min(slot, topk - 1)]
            valid = Uint32(cute.arch.vote_ballot_sync(dev.slot_valid(idx, slot, s_kv, topk_len)))

            cute.arch.mbarrier_wait(mbar + MB_S_FULL + buf, (b // 2) & 1)
            dev.tcgen05_fence_after_thread_sync()
            cute.copy(t2r_s, t2r_s.partition_S(tS_all[None, None, None, buf]), rS)
            cute.arch.fence_view_async_tmem_load()
            dev.tcgen05_fence_before_thread_sync()
            dev.arrive_cta0(mbar + MB_S_EMPTY + buf)

            part = Float32(-math.inf)
            for i in cutlass.range_constexpr(S_COLS):
                bit = (valid >> Uint32(i)) & Uint32(1)
                rS[i] = Float32(cutlass.select_(bit != Uint32(0), rS[i], Float32(-math.inf)))
                part = cute.arch.fmax(part, rS[i])
            # Row max over both column halves: exchange with thread t ^ 64 (slot by block parity).
            red[buf * 2 * B_H_CTA + tidx] = part
            cute.arch.barrier(barrier_id=BAR_MAX, number_of_threads=SOFTMAX_THREADS)
            cur = cute.arch.fmax(part, red[buf * 2 * B_H_CTA + partner]) * scale_log2
            rMax[0] = cute.arch.fmax(rMax[0], cur)
            grew = cur > rM[0] + RESCALE_THRESHOLD  # the same for both threads of a row
            new_m = Float32(cutlass.select_(grew, cute.arch.fmax(rM[0], cur), rM[0]))
            sf = cute.math.exp2(rM[0] - new_m, fastmath=True)
            rM[0] = new_m
            total = Float32(0.0)
            for i in cutlass.range_constexpr(S_COLS):
                p = cute.math.exp2(rS[i] * scale_log2 - new_m, fastmath=True)
                rS[i] = p
                total = total + p
            rL[0] = rL[0] * sf + total
            need = cute.arch.vote_any_sync(grew)

            if b > 0:
                cute.arch.mbarrier_wait(mbar + MB_O_DONE, (b - 1) & 1)
                dev.tcgen05_fence_after_thread_sync()
                if need:  # warp-uniform; rows that did not move multiply by 1
                    for c in cutlass.range_constexpr(2 * V_HALF // B_TOPK):
                        tO = o_chunks[None, None, None, c]
                        cute.copy(t2r_o, t2r_o.partition_S(tO), rO)
                        cute.arch.fence_view_async_tmem_load()
                        for i in cutlass.range_constexpr(S_COLS):
                            rO[i] = rO[i] * sf
                        cute.copy(r2t_o, rO, r2t_o.partition_D(tO))
                    cute.arch.fence_view_async_tmem_store()

            # P row (32 tokens) -> bf16 -> 4 x 16-byte swizzled stores into the 64 x 64 K-major tile.
            for q in cutlass.range_constexpr(S_COLS // 8):
                chunk = 4 * chalf + q
                addr = sP_addr + row * 128 + ((chunk ^ (row % 8)) * 16)
                dev.st_shared_v4_b32(addr, dev.pack_bf16x2(rS[8 * q], rS[8 * q + 1]), dev.pack_bf16x2(rS[8 * q + 2], rS[8 * q + 3]),
                                 dev.pack_bf16x2(rS[8 * q + 4], rS[8 * q + 5]), dev.pack_bf16x2(rS[8 * q + 6], rS[8 * q + 7]))
            cute.arch.fence_proxy("async.shared", space="cta")
            dev.tcgen05_fence_before_thread_sync()
            dev.arrive_cta0(mbar + MB_P_FULL)

        if num_blocks > 0:
            cute.arch.mbarrier_wait(mbar + MB_O_DONE, (num_blocks - 1) & 1)
        dev.tcgen05_fence_after_thread_sync()

        # Row sum over both halves (slots 2 and 3 of the exchange buffer).
        red[4 * B_H_CTA + tidx] = rL[0]
        cute.arch.barrier(barrier_id=BAR_SUM, number_of_threads=SOFTMAX_THREADS)
        l_row = rL[0] + red[4 * B_H_CTA + partner]
        head = head0 + row
        sink_term = Float32(0.0)
        if const_expr(self.has_sink):
            sink_term = cute.math.exp2(mSink[head] * dev.LOG2E - rM[0], fastmath=True)
        nonempty = l_row > 0.0
        inv = Float32(cutlass.select_(nonempty, 1.0 / (l_row + sink_term), Float32(0.0)))

        # O: this thread's 128 columns of each N256 tile, 32 at a time, 16-byte global stores.
        o_row = dev.gmem_addr_i64(mO.iterator) + (Int64(s_idx) * mO.shape[1] + Int64(head)) * (D_V * 2)
        for c in cutlass.range_constexpr(2 * V_HALF // B_TOPK):
            cute.copy(t2r_o, t2r_o.partition_S(o_chunks[None, None, None, c]), rO)
            cute.arch.fence_view_async_tmem_load()
            # chunk c = N-tile c // 4, columns 32 (c % 4) .. of this thread's 128-column half
            col0 = (c // 4) * V_HALF + chalf * (V_HALF // 2) + (c % 4) * S_COLS
            for v in cutlass.range_constexpr(S_COLS // 8):
                w = []
                for e in cutlass.range_constexpr(4):
                    i = 8 * v + 2 * e
                    lo = Float32(cutlass.select_(nonempty, rO[i] * inv, Float32(0.0)))
                    hi = Float32(cutlass.select_(nonempty, rO[i + 1] * inv, Float32(0.0)))
                    w.append(dev.pack_bf16x2(lo, hi))
                dev.st_global_v4_b32(o_row + (col0 + 8 * v) * 2, w[0], w[1], w[2], w[3])

        if chalf == 0:
            mMaxLogits[s_idx, head] = Float32(cutlass.select_(nonempty, rMax[0] * dev.LN2, Float32(-math.inf)))
            mLse[s_idx, head] = Float32(
                cutlass.select_(nonempty, cute.math.log(l_row) + rM[0] * dev.LN2, Float32(math.inf))
            )
        dev.tcgen05_fence_before_thread_sync()
