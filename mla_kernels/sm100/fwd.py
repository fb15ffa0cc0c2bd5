"""Sparse MLA forward on Blackwell (sm_100a), CuTe DSL: 64 heads per CTA, 1-CTA tcgen05.

Same op and conventions as the sm90 forward (``sm90/fwd.py``): scores in scaled-log2 units
``x = s * sm_scale * log2(e)``, ``lse``/``max_logits`` returned in natural log, an empty row gives
``out = 0``, ``lse = +inf``, ``max_logits = -inf``; the sink only enlarges the normaliser of ``out``.

One CTA per (query token, 64-head group): h_q = 64 k runs k CTAs per token.  288 threads:

* warps 4-7 -- **gather**: Q (``64 x d_qk``, dense rows, cp.async) once, then the 64 KV rows of
  every top-k block (:class:`~mla_kernels.common.gather.KvGather`, cp.async with zero-fill for
  invalid slots) into a 2-stage ring of whole ``64 x d_qk`` K-major SW128 tiles;
* warp 8 -- **MMA** (``tcgen05.mma.cta_group::1``): ``S_j = Q K_j^T`` (M64 x N64, ``d_qk/16``
  K-steps) into one of two TMEM score buffers, then ``O += P_j V_j`` as two M64 x N256 halves
  (V = the first 512 columns of the same smem tile, read MN-major: no second load).  The issue
  order is QK(j+1) before PV(j), so the softmax of block j+1 overlaps PV(j);
* warps 0-3 -- **softmax, correction, epilogue**: ``tcgen05.ld.16x256b`` gives thread ``t`` rows
  ``16 w + (t%32)/4`` and ``+8`` and columns ``8 g + 2 (t%4) + {0,1}`` -- the Hopper wgmma
  accumulator fragment, so the row max / exp2 / mask helpers of ``common/device.py`` apply as is.
  The running max is rescaled lazily (per warp, only when a row's max grew by more than
  ``RESCALE_THRESHOLD`` in log2 units, FlashMLA's rule): then O's rows are rescaled in TMEM (64
  columns per ``ld``/``st``), otherwise P is computed against the stale max (P <= 2^8, exact in
  the end because ``l`` uses the same max).  P goes to smem as bf16 (swizzled, conflict-free
  32-bit stores) for the PV MMA.  The epilogue reads O from TMEM, scales by ``1/(l + sink)`` and
  stores bf16 straight to global memory; lse/max_logits by the quad leaders.

TMEM (512 columns allocated): O's two N256 halves at columns 0-255, lanes 0-15 / 16-31 of each
32-lane sub-partition (the DSL's M64 accumulator layout puts an M64 tile in lanes 0-15 of each
sub-partition and the second N-tile at lane +16); score buffers at columns 256-319 and 320-383.

Synchronisation (raw mbarriers, phases from the block index): ``q_full`` (128 noinc cp.async
arrivals), ``kv_full[s]`` (128 noinc) -> MMA, ``kv_empty[s]`` (commit after PV) -> gather,
``s_full[b]`` (commit after QK) -> softmax, ``s_empty[b]`` (128 arrivals after the TMEM load) ->
MMA, ``p_full`` (128 arrivals: P in smem and O rescaled) -> MMA, ``o_done`` (commit after PV) ->
softmax (P smem reusable, O stable for the next rescale / the epilogue).

Not verified on hardware (compile-only; see ``Sm100Backend.hardware_verified``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Tuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

from ..common import device as dev
from ..common.gather import KvGather, copy_dense_rows

B_H = 64  # heads per CTA = MMA M
B_TOPK = 64  # tokens per block = QK's N = PV's K
D_V = 512
V_HALF = 256  # PV's N per MMA (two halves)
K_TILE = 64  # columns per SW128 tile
MMA_K = 16
KV_STAGES = 2
SMEM_LIMIT = 232448
#: mbarriers + TMEM holding word, padded to the 1024-byte alignment of the swizzled buffers.
SMEM_HEADER_BYTES = 1024
TMEM_ALLOC = 512
#: TMEM column of the score buffers (O occupies 0..255 in both lane halves).
S_COL0 = 256
#: Element offset of TMEM lane 16 (the lane field is the address's upper 16 bits).
LANE16 = 16 << 16
O_CHUNK = 64  # columns per rescale / epilogue TMEM round trip
#: Lazy rescale: keep the running max until a row's block max exceeds it by this much (log2).
RESCALE_THRESHOLD = 8.0

SOFTMAX_WARPS = 4  # warps 0-3: warp w owns TMEM lanes 32w..32w+31 = rows 16w..16w+15
GATHER_WARP0 = 4  # warps 4-7
MMA_WARP = 8
THREADS = 32 * (MMA_WARP + 1)
SOFTMAX_THREADS = 32 * SOFTMAX_WARPS
GATHER_THREADS = 128

BAR_EPI = 1  # softmax warps: every TMEM access done before warp 0 frees the allocation

# mbarrier slots
MB_Q_FULL = 0
MB_KV_FULL = 1  # + stage
MB_KV_EMPTY = 3  # + stage
MB_S_FULL = 5  # + buffer
MB_S_EMPTY = 7  # + buffer
MB_P_FULL = 9
MB_O_DONE = 10
N_MBAR = 11


@dataclass(frozen=True)
class FwdPlan:
    """The static resource plan of one configuration (pure Python: host tests check it)."""

    d_qk: int
    n_k_tiles: int
    q_bytes: int
    kv_stage_bytes: int
    p_bytes: int
    smem_bytes: int
    tmem_alloc: int

    @staticmethod
    def tmem_regions() -> List[Tuple[str, int, int, int, int]]:
        """``(name, lane_lo, lane_hi, col_lo, col_hi)`` of every TMEM region, per 32-lane
        sub-partition (an M64 tile uses 16 lanes of each)."""
        return [
            ("O[:, 0:256]", 0, 16, 0, V_HALF),
            ("O[:, 256:512]", 16, 32, 0, V_HALF),
            ("S0", 0, 16, S_COL0, S_COL0 + B_TOPK),
            ("S1", 0, 16, S_COL0 + B_TOPK, S_COL0 + 2 * B_TOPK),
        ]


def fwd_plan(d_qk: int) -> FwdPlan:
    if d_qk not in (512, 576):
        raise ValueError(f"sm100 forward supports d_qk 512 or 576, got {d_qk}")
    q_bytes = B_H * d_qk * 2
    kv_stage_bytes = B_TOPK * d_qk * 2
    p_bytes = B_H * B_TOPK * 2
    smem = SMEM_HEADER_BYTES + q_bytes + KV_STAGES * kv_stage_bytes + p_bytes
    if smem > SMEM_LIMIT:
        raise ValueError(f"smem {smem} > {SMEM_LIMIT}")
    return FwdPlan(d_qk, d_qk // K_TILE, q_bytes, kv_stage_bytes, p_bytes, smem, TMEM_ALLOC)


def p_word_offset(row: Int32, g: int, quad: Int32) -> Int32:
    """32-bit word offset of P[row, 8 g + 2 quad .. +1] in the ``64 x 64`` K-major SW128 tile
    (128-byte rows, 16-byte chunk ``g`` stored at chunk ``g ^ (row % 8)``).  A warp's 32 stores
    of one ``g`` hit 32 distinct banks."""
    return row * 32 + ((row % 8) ^ g) * 4 + quad


class SparseMlaFwdSm100:
    """Static configuration + host launcher + device kernel of the sm100 sparse forward."""

    def __init__(self, d_qk: int, d_v: int = D_V, has_topk_length: bool = False, has_sink: bool = False):
        if d_v != D_V:
            raise ValueError(f"sm100 forward supports d_v {D_V}, got {d_v}")
        self.plan = fwd_plan(d_qk)
        self.d_qk = d_qk
        self.d_v = d_v
        self.has_topk_length = has_topk_length
        self.has_sink = has_sink
        self.n_k_tiles = self.plan.n_k_tiles
        self.smem_bytes = 0  # set when traced

    # Fresh tiled MMAs per dynamic region: an ACCUMULATE field set in one must not leak out.
    def _mma_qk(self):
        """S = Q K^T: A = Q (64 heads, K-major), B = K (64 tokens, K-major)."""
        return sm100_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32, tcgen05.CtaGroup.ONE, (B_H, B_TOPK)
        )

    def _mma_pv(self):
        """O += P V: A = P (64 heads x 64 tokens, K-major), B = V^T (256 dims, MN-major)."""
        return sm100_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32, tcgen05.CtaGroup.ONE,
            (B_H, V_HALF),
        )

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
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sP_layout)], 1024]

        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes == self.plan.smem_bytes <= SMEM_LIMIT, f"smem {self.smem_bytes}"
        assert cute.cosize(sQ_layout) * 2 == self.plan.q_bytes
        assert cute.cosize(sK_layout) * 2 == KV_STAGES * self.plan.kv_stage_bytes
        assert cute.cosize(sP_layout) * 2 == self.plan.p_bytes

        s_q = mQ.shape[0]
        n_hblk = mQ.shape[1] // B_H
        self.kernel(
            mQ, mKV, mIdx, mTopkLen, mSink, mO, mMaxLogits, mLse, scale_log2,
            sQ_layout, sK_layout, sP_layout, sV_layout, SharedStorage, n_hblk,
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
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mTopkLen: cute.Tensor,
        mSink: cute.Tensor,
        mO: cute.Tensor,
        mMaxLogits: cute.Tensor,
        mLse: cute.Tensor,
        scale_log2: Float32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
        n_hblk: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        h_blk = bidx % n_hblk
        s_idx = bidx // n_hblk

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        # Pointers out of the struct before any role branch (a struct cannot cross a dynamic if).
        mbar = storage.mbar.data_ptr()
        tmem_holding = storage.tmem_holding.ptr
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sKV_ptr = storage.sKV.data_ptr()
        sP_ptr = storage.sP.data_ptr()
        sQ_addr = dev.smem_addr_u32(storage.sQ.data_ptr())
        sKV_addr = dev.smem_addr_u32(sKV_ptr)

        if warp_idx == MMA_WARP:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar + MB_Q_FULL, GATHER_THREADS)  # noinc cp.async arrivals
                for s in cutlass.range_constexpr(KV_STAGES):
                    cute.arch.mbarrier_init(mbar + MB_KV_FULL + s, GATHER_THREADS)
                    cute.arch.mbarrier_init(mbar + MB_KV_EMPTY + s, 1)  # tcgen05.commit
                for j in cutlass.range_constexpr(2):
                    cute.arch.mbarrier_init(mbar + MB_S_FULL + j, 1)  # tcgen05.commit
                    cute.arch.mbarrier_init(mbar + MB_S_EMPTY + j, SOFTMAX_THREADS)
                cute.arch.mbarrier_init(mbar + MB_P_FULL, SOFTMAX_THREADS)
                cute.arch.mbarrier_init(mbar + MB_O_DONE, 1)  # tcgen05.commit
        if warp_idx == 0:
            # The softmax warpgroup's first warp owns the TMEM allocation (and frees it at the end).
            cute.arch.alloc_tmem(TMEM_ALLOC, tmem_holding)
            cute.arch.relinquish_tmem_alloc_permit()
            dev.tcgen05_fence_before_thread_sync()
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        topk = mIdx.shape[1]
        topk_len = topk
        if const_expr(self.has_topk_length):
            topk_len = mTopkLen[s_idx]
        num_blocks = (topk_len + (B_TOPK - 1)) // B_TOPK
        head0 = h_blk * B_H

        if warp_idx >= GATHER_WARP0 and warp_idx < MMA_WARP:
            self.gather(mQ, mKV, mIdx, s_idx, head0, topk_len, num_blocks, sQ_addr, sKV_addr, mbar,
                        tidx - 32 * GATHER_WARP0)
        elif warp_idx == MMA_WARP:
            self.mma_issuer(sQ, sK, sP, sKV_ptr, sV_layout, tmem_holding, num_blocks, mbar)
        elif warp_idx < SOFTMAX_WARPS:
            self.softmax(mKV, mIdx, mSink, mO, mMaxLogits, mLse, scale_log2, s_idx, head0, topk, topk_len,
                         num_blocks, sP_ptr, tmem_holding, mbar, tidx, warp_idx)

    # ------------------------------------------------------------------------------------------
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
        sKV_addr: Int32,
        mbar: cute.Pointer,
        ptid: Int32,
    ):
        """Warps 4-7: Q once, then every block's 64 KV rows into the 2-stage ring."""
        if num_blocks > 0:  # an empty row issues no copy (nothing may be in flight at exit)
            row0 = Int64(s_idx) * mQ.shape[1] + Int64(head0)
            q_addr = dev.gmem_addr_i64(mQ.iterator) + row0 * (self.d_qk * 2)
            copy_dense_rows(sQ_addr, q_addr, self.d_qk * 2, B_H, self.n_k_tiles, ptid,
                            dev.createpolicy_evict_first())
            cute.arch.cp_async_mbarrier_arrive_noinc(mbar + MB_Q_FULL)
        gather = KvGather(mKV, mIdx, s_idx, topk_len, ptid, self.d_qk, slots=1, rows=B_TOPK)
        for b in cutlass.range(num_blocks, unroll=1):
            stage = b % KV_STAGES
            # A fresh barrier counts as free: the first pass waits on parity 1.
            cute.arch.mbarrier_wait(mbar + MB_KV_EMPTY + stage, ((b // KV_STAGES) & 1) ^ 1)
            gather.load_indices(b, 0)
            gather.copy_tiles(sKV_addr + stage * self.plan.kv_stage_bytes, 0, 0, self.n_k_tiles)
            cute.arch.cp_async_mbarrier_arrive_noinc(mbar + MB_KV_FULL + stage)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def mma_issuer(
        self,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sP: cute.Tensor,
        sKV_ptr: cute.Pointer,
        sV_layout: cute.ComposedLayout,
        tmem_holding: cute.Pointer,
        num_blocks: Int32,
        mbar: cute.Pointer,
    ):
        """Warp 8: QK(j+1) is issued before PV(j) so the softmax of j+1 overlaps PV(j)."""
        dev.tcgen05_fence_after_thread_sync()
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_holding)
        if num_blocks > 0:
            cute.arch.mbarrier_wait(mbar + MB_Q_FULL, 0)
            # cp.async writes are generic-proxy; tcgen05.mma reads smem through the async proxy.
            # The writers never wait for their own copies (noinc arrivals): the reader fences.
            cute.arch.fence_proxy("async.shared", space="cta")
            self._issue_qk(sQ, sK, tmem_ptr, mbar, Int32(0))
        for b in cutlass.range(num_blocks, unroll=1):
            if b + 1 < num_blocks:
                self._issue_qk(sQ, sK, tmem_ptr, mbar, b + 1)
            # P(b) in smem and O rescaled for it (the softmax warps fenced both before arriving).
            cute.arch.mbarrier_wait(mbar + MB_P_FULL, b & 1)
            dev.tcgen05_fence_after_thread_sync()
            self._issue_pv(sP, sKV_ptr, sV_layout, tmem_ptr, mbar, b)

    @cute.jit
    def _issue_qk(self, sQ: cute.Tensor, sK: cute.Tensor, tmem_ptr: cute.Pointer, mbar: cute.Pointer, j: Int32):
        """``S[j % 2] = Q K_j^T`` once block j is gathered and the softmax read S[j % 2] of j - 2."""
        mma = self._mma_qk()
        tCrQ = mma.make_fragment_A(sQ)  # (MMA, 1, d_qk/16, 1)
        tCrK = mma.make_fragment_B(sK)  # (MMA, 1, d_qk/16, KV_STAGES)
        s_layout = mma.make_fragment_C(mma.partition_shape_C((B_H, B_TOPK))).layout
        stage = j % KV_STAGES
        buf = j % 2
        cute.arch.mbarrier_wait(mbar + MB_KV_FULL + stage, (j // KV_STAGES) & 1)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_wait(mbar + MB_S_EMPTY + buf, ((j // 2) & 1) ^ 1)
        dev.tcgen05_fence_after_thread_sync()
        tS = self._s_buffers(tmem_ptr, s_layout)[None, None, None, buf]
        for k in cutlass.range_constexpr(self.d_qk // MMA_K):
            mma.set(tcgen05.Field.ACCUMULATE, k != 0)
            cute.gemm(mma, tS, tCrQ[None, None, k, 0], tCrK[None, None, k, stage], tS)
        with cute.arch.elect_one():
            tcgen05.commit(mbar + MB_S_FULL + buf)

    @cute.jit
    def _issue_pv(self, sP: cute.Tensor, sKV_ptr: cute.Pointer, sV_layout: cute.ComposedLayout,
                  tmem_ptr: cute.Pointer, mbar: cute.Pointer, j: Int32):
        """``O[:, half] += P_j V_j[:, half]`` for both 256-column halves, then free the KV stage
        (this commit also covers QK(j)) and signal ``o_done``."""
        mma = self._mma_pv()
        tCrP = mma.make_fragment_A(sP)  # (MMA, 1, 4, 1)
        o_layout = mma.make_fragment_C(mma.partition_shape_C((B_H, V_HALF))).layout
        stage = j % KV_STAGES
        stage_elems = B_TOPK * self.d_qk
        for h in cutlass.range_constexpr(D_V // V_HALF):
            # V half h = column tiles 4h..4h+3 of the stage: (V_HALF / 64) tiles of 64 x 64.
            v_ptr = sKV_ptr + stage * stage_elems + h * (V_HALF // K_TILE) * (B_TOPK * K_TILE)
            sV = cute.make_tensor(cute.recast_ptr(v_ptr, sV_layout.inner), sV_layout.outer)
            tCrV = mma.make_fragment_B(sV)  # (MMA, 1, 4, 1)
            tO = cute.make_tensor(tmem_ptr + h * LANE16, o_layout)
            for k in cutlass.range_constexpr(B_TOPK // MMA_K):
                if const_expr(k == 0):
                    mma.set(tcgen05.Field.ACCUMULATE, j > 0)  # the first block overwrites O
                else:
                    mma.set(tcgen05.Field.ACCUMULATE, True)
                cute.gemm(mma, tO, tCrP[None, None, k, 0], tCrV[None, None, k, 0], tO)
        with cute.arch.elect_one():
            tcgen05.commit(mbar + MB_KV_EMPTY + stage)
            tcgen05.commit(mbar + MB_O_DONE)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def softmax(
        self,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mSink: cute.Tensor,
        mO: cute.Tensor,
        mMaxLogits: cute.Tensor,
        mLse: cute.Tensor,
        scale_log2: Float32,
        s_idx: Int32,
        head0: Int32,
        topk: Int32,
        topk_len: Int32,
        num_blocks: Int32,
        sP_ptr: cute.Pointer,
        tmem_holding: cute.Pointer,
        mbar: cute.Pointer,
        tidx: Int32,
        warp_idx: Int32,
    ):
        """Warps 0-3: online softmax from TMEM scores, O correction in TMEM, epilogue."""
        lane = tidx % 32
        quad = tidx % 4
        rows = (dev.fragment_row(tidx, 0), dev.fragment_row(tidx, 1))
        s_kv = mKV.shape[0]

        dev.tcgen05_fence_after_thread_sync()
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_holding)
        mma = self._mma_qk()
        tile_layout = mma.make_fragment_C(mma.partition_shape_C((B_H, B_TOPK))).layout  # 64 x 64 f32
        tmpl = cute.make_tensor(tmem_ptr, tile_layout)
        t2r = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld16x256bOp(tcgen05.Repetition.x8), Float32), tmpl
        ).get_slice(tidx)
        r2t = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.St16x256bOp(tcgen05.Repetition.x8), Float32), tmpl
        ).get_slice(tidx)
        rS = cute.make_rmem_tensor(t2r.partition_D(tmpl).shape, Float32)
        tS_all = self._s_buffers(tmem_ptr, tile_layout)
        rO = cute.make_rmem_tensor(t2r.partition_D(tmpl).shape, Float32)
        sP32 = cute.make_tensor(cute.recast_ptr(sP_ptr, dtype=Uint32), cute.make_layout(B_H * B_TOPK // 2))

        rM = cute.make_rmem_tensor((2,), Float32)  # running max used for P (lazy), log2 units
        rMax = cute.make_rmem_tensor((2,), Float32)  # exact max of the valid logits (max_logits)
        rL = cute.make_rmem_tensor((2,), Float32)  # this thread's partial row sums
        rM.fill(dev.MAX_INIT)
        rMax.fill(-math.inf)
        rL.fill(0.0)

        for b in cutlass.range(num_blocks, unroll=1):
            buf = b % 2
            # Validity of the block's 64 slots as two 32-bit words, computed by every warp (two
            # index loads per lane, issued before the score wait so their latency hides).
            valid_lo = Uint32(0)
            valid_hi = Uint32(0)
            for half in cutlass.range_constexpr(2):
                slot = b * B_TOPK + 32 * half + lane
                idx = mIdx[s_idx, cutlass.min(slot, topk - 1)]
                word = Uint32(cute.arch.vote_ballot_sync(dev.slot_valid(idx, slot, s_kv, topk_len)))
                if const_expr(half == 0):
                    valid_lo = word
                else:
                    valid_hi = word

            cute.arch.mbarrier_wait(mbar + MB_S_FULL + buf, (b // 2) & 1)
            dev.tcgen05_fence_after_thread_sync()
            cute.copy(t2r, t2r.partition_S(tS_all[None, None, None, buf]), rS)
            cute.arch.fence_view_async_tmem_load()
            dev.tcgen05_fence_before_thread_sync()
            cute.arch.mbarrier_arrive(mbar + MB_S_EMPTY + buf)  # the MMA may refill this buffer

            dev.mask_scores(rS, valid_lo, valid_hi, quad)
            # Lazy max: a warp moves its rows' max only when one of them grew past the threshold.
            cur = (dev.row_max(rS, 0) * scale_log2, dev.row_max(rS, 1) * scale_log2)
            grew = (cur[0] > rM[0] + RESCALE_THRESHOLD) | (cur[1] > rM[1] + RESCALE_THRESHOLD)
            need = cute.arch.vote_any_sync(grew)
            sf = []
            for r in cutlass.range_constexpr(2):
                rMax[r] = cute.arch.fmax(rMax[r], cur[r])
                new_m = Float32(cutlass.select_(need, cute.arch.fmax(rM[r], cur[r]), rM[r]))
                sf.append(cute.math.exp2(rM[r] - new_m, fastmath=True))
                rM[r] = new_m
                rL[r] = rL[r] * sf[r] + dev.exp2_scores(rS, r, scale_log2, new_m)

            # PV(b-1) is complete: P's smem is free and O holds every block before b.
            if b > 0:
                cute.arch.mbarrier_wait(mbar + MB_O_DONE, (b - 1) & 1)
                dev.tcgen05_fence_after_thread_sync()
                if need:  # warp-uniform: each warp rescales only its own TMEM lanes
                    self._scale_o(t2r, r2t, rO, tmem_ptr, tile_layout, sf[0], sf[1])
                    cute.arch.fence_view_async_tmem_store()

            # P -> bf16 -> smem (K-major SW128), visible to the async proxy before the arrive.
            for g in cutlass.range_constexpr(B_TOPK // 8):
                for r in cutlass.range_constexpr(2):
                    sP32[p_word_offset(rows[r], g, quad)] = dev.pack_bf16x2(
                        rS[dev.acc_flat(0, r, g)], rS[dev.acc_flat(1, r, g)]
                    )
            cute.arch.fence_proxy("async.shared", space="cta")
            dev.tcgen05_fence_before_thread_sync()
            cute.arch.mbarrier_arrive(mbar + MB_P_FULL)

        if num_blocks > 0:  # the last PV is complete (CTA-uniform condition)
            cute.arch.mbarrier_wait(mbar + MB_O_DONE, (num_blocks - 1) & 1)
        dev.tcgen05_fence_after_thread_sync()
        self._epilogue(mSink, mO, mMaxLogits, mLse, s_idx, head0, rows, quad, rM, rMax, rL, t2r, rO, tmem_ptr,
                       tile_layout)

        # Every TMEM read of this warpgroup is complete before warp 0 frees the allocation.
        dev.tcgen05_fence_before_thread_sync()
        cute.arch.barrier(barrier_id=BAR_EPI, number_of_threads=SOFTMAX_THREADS)
        if warp_idx == 0:
            dev.tcgen05_fence_after_thread_sync()
            cute.arch.dealloc_tmem(tmem_ptr, TMEM_ALLOC)

    @cute.jit
    def _scale_o(self, t2r, r2t, rO: cute.Tensor, tmem_ptr: cute.Pointer, tile_layout: cute.Layout,
                 sf0: Float32, sf1: Float32):
        """O rows *= sf (this thread's two rows), 64 columns per TMEM load/store round trip."""
        for c in cutlass.range_constexpr(D_V // O_CHUNK):
            tO = cute.make_tensor(tmem_ptr + self._o_chunk_offset(c), tile_layout)
            cute.copy(t2r, t2r.partition_S(tO), rO)
            cute.arch.fence_view_async_tmem_load()
            dev.scale_rows(rO, sf0, sf1)
            cute.copy(r2t, rO, r2t.partition_D(tO))

    @staticmethod
    def _s_buffers(tmem_ptr: cute.Pointer, tile_layout: cute.Layout) -> cute.Tensor:
        """Both TMEM score buffers as one tensor with a trailing buffer mode (a static stride keeps
        the column alignment the TMEM load checks; a dynamic pointer offset would lose it)."""
        return cute.make_tensor(tmem_ptr + S_COL0, cute.append(tile_layout, cute.make_layout(2, stride=B_TOPK)))

    @staticmethod
    def _o_chunk_offset(c: int) -> int:
        """TMEM element offset of O's 64-column chunk ``c`` (columns ``64 c .. 64 c + 63``)."""
        half, col = divmod(c * O_CHUNK, V_HALF)
        return half * LANE16 + col

    @cute.jit
    def _epilogue(self, mSink, mO, mMaxLogits, mLse, s_idx, head0, rows, quad, rM, rMax, rL, t2r, rO, tmem_ptr,
                  tile_layout):
        """Normalise O by ``1/(l + sink)``, store it as bf16, then lse and max_logits."""
        inv = [Float32(0.0), Float32(0.0)]
        l_row = [Float32(0.0), Float32(0.0)]
        for r in cutlass.range_constexpr(2):
            l_row[r] = dev.quad_sum(rL[r])
            sink_term = Float32(0.0)
            if const_expr(self.has_sink):
                sink_term = cute.math.exp2(mSink[head0 + rows[r]] * dev.LOG2E - rM[r], fastmath=True)
            inv[r] = Float32(cutlass.select_(l_row[r] > 0.0, 1.0 / (l_row[r] + sink_term), Float32(0.0)))

        # Row addresses in 64-bit: s_q * h_q * d_v elements can pass 2^31.
        o_base = dev.gmem_addr_i64(mO.iterator) + Int64(2 * quad) * 2
        o_row = [o_base + (Int64(s_idx) * mO.shape[1] + Int64(head0 + rows[r])) * (D_V * 2) for r in range(2)]
        for c in cutlass.range_constexpr(D_V // O_CHUNK):
            tO = cute.make_tensor(tmem_ptr + self._o_chunk_offset(c), tile_layout)
            cute.copy(t2r, t2r.partition_S(tO), rO)
            cute.arch.fence_view_async_tmem_load()
            for g in cutlass.range_constexpr(O_CHUNK // 8):
                for r in cutlass.range_constexpr(2):
                    # select, not multiply: with no block at all O was never written (garbage).
                    lo = Float32(cutlass.select_(l_row[r] > 0.0, rO[dev.acc_flat(0, r, g)] * inv[r], Float32(0.0)))
                    hi = Float32(cutlass.select_(l_row[r] > 0.0, rO[dev.acc_flat(1, r, g)] * inv[r], Float32(0.0)))
                    dev.st_global_b32(o_row[r] + (c * O_CHUNK + 8 * g) * 2, dev.pack_bf16x2(lo, hi))

        if quad == 0:
            for r in cutlass.range_constexpr(2):
                empty = l_row[r] == 0.0
                head = head0 + rows[r]
                mMaxLogits[s_idx, head] = Float32(cutlass.select_(empty, Float32(-math.inf), rMax[r] * dev.LN2))
                mLse[s_idx, head] = Float32(
                    cutlass.select_(empty, Float32(math.inf), cute.math.log(l_row[r]) + rM[r] * dev.LN2)
                )
