"""Sparse MLA backward on Blackwell (sm_100a / sm_103a), CuTe DSL, 1-CTA tcgen05 + TMEM.

Same op, arguments and host driver as the sm90 backward (``common/bwd_host.run_bwd`` launches it):
one CTA per (query token, 64-head block), so any ``h_q`` multiple of 64 runs as ``h_q / 64`` CTAs
per token (pairs of them launched as 2-CTA clusters when ``h_q / 64`` is even, as on sm90 --
only for co-scheduling: every tcgen05 op is ``cta_group::1``).  Per top-k block of ``B_TOPK = 64`` indices (``c = sm_scale * log2(e)``):

* ``S^T = K Q^T`` and ``dP^T = V dO^T`` (tcgen05, M = 64 tokens, N = 64 heads, A = the gathered KV
  tile, B = Q / dO, both K-major in smem) into TMEM.  "SwapAB": a TMEM row is a token, so the
  math warps read one token's heads per thread (``tcgen05.ld.16x32bx2``: thread ``16 w + l``,
  ``l < 16``, holds token ``16 w + l``, heads ``0..31``; lane ``l + 16`` the same token, heads
  ``32..63``), mask a whole row with one select and sum over heads (attn_sum) in-thread;
* ``P = exp2(S c - lse2)`` (0 on invalid slots), ``dS = P (dP - delta') sm_scale`` -> bf16 smem
  ``[tokens x heads]`` (one 128-byte swizzled row per token);
* ``dQ^T += K^T dS^T`` (M = 128 head dims, N = 64 heads, K = 64 tokens): dQ stays in TMEM for the
  whole CTA and is written once at the end;
* ``dKV^T = Q^T dS (+ dO^T P on dims < d_v)`` (M = 128 dims, N = 64 tokens, K = 64 heads) per
  128-dim chunk into a TMEM buffer that the drain warps empty: each thread holds one dim of all
  64 tokens, a quad transpose turns that into 4-dim vectors, and each warp instruction
  (``red.global.add.v4.f32``) covers 4 tokens x 128 contiguous bytes -- whole L2 lines of the
  float32 ``[s_kv, d_qk]`` workspace.  The deterministic variant stores the same vectors to the
  slot's private workspace row (no atomics; the host reduces in a fixed order).

Head-dim chunks are 128 dims (the MMA's M); for d_qk = 576 the last chunk is dims 448..575, whose
first 64 rows repeat the previous chunk and are not stored (and its dKV chunk skips ``dO^T P``:
those rows are dropped anyway).  See :func:`bwd_plan` for the TMEM columns:

    S^T 0..63 | dP^T 64..127 | dQ^T chunk c at 128 + 64 c | dKV^T buffers after it (to 512)

d_qk 576: dQ^T 128..447 (5 chunks), one dKV^T buffer 448..511; d_qk 512: dQ^T 128..383, two dKV^T
buffers 384..511.

Warps (416 threads): 0-3 math (P, dS, attn_sum, dQ epilogue; warp 0 owns the TMEM allocation);
4-7 drain (``delta = rowsum(O dO)`` first, then the dKV scatter); 8-11 gather (Q and dO once,
then each block's KV rows by ``cp.async``, :class:`~mla_kernels.common.gather.KvGather`,
zero-filled on invalid slots, one ready barrier per 64-column tile); 12 MMA issuer.

smem: Q (64 x d_qk), dO (64 x 512), one KV tile (64 x d_qk), P and dS (64 x 64 each): 229,376
bytes for d_qk 576, so the KV buffer is single; the MMA frees it right after the block's dQ^T
products, and the next block's gather overlaps the dKV^T phase.

Synchronisation (raw mbarriers; every phase is one per block except the dKV ring):
``kv_full[t]`` (gather, 128 noinc arrivals) -> MMA; ``kv_free`` (commit after dQ^T) -> gather;
``s_full`` (commit) -> math; ``s_free`` (math, after its TMEM loads) -> MMA; ``pds_full`` (math,
after P/dS stores + proxy fence) -> MMA; ``pds_free`` (commit after the block's last dKV^T MMA)
-> math; ``dkv_full[i]`` / ``dkv_empty[i]`` ring -> drain / MMA; ``dq_full`` (commit after the
last block) -> math epilogue; ``q_full`` once.  Named barriers (each ``bar.sync`` at one code
address, the rule of docs/DSL_NOTES.md "Named barriers"): ``BAR_ROWS`` -- the drain warps
``bar.arrive`` once ``-delta'`` is in smem, the math warps ``bar.sync``; ``BAR_END`` -- math and
drain warps at one call site after the role branch, before warp 0 frees TMEM.

Not verified on hardware (compile-only; see ``Sm100Backend.hardware_verified``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.pipeline import PipelineUserType, make_pipeline_state

from ..common import device as dev
from ..common.gather import KvGather, copy_dense_rows

B_H = 64  # heads per CTA (MMA N of S^T/dP^T and dQ^T, K of dKV^T)
B_TOPK = 64  # indices per block (MMA M of S^T/dP^T, N of dKV^T, K of dQ^T)
K_TILE = 64  # head-dim columns per 128-byte swizzled smem tile
MMA_K = 16
D_CHUNK = 128  # head dims per dQ^T / dKV^T chunk (the MMA's M)
TILE_BYTES = B_TOPK * K_TILE * 2  # one [64 rows x 64] bf16 tile
SMEM_LIMIT = 232448
SMEM_HEADER_BYTES = 1024  # barriers + staged row terms, before the 1024-aligned operand tiles
TMEM_COLUMNS = 512
COL_S = 0
COL_DP = 64
COL_DQ = 128

MATH_WARP0 = 0  # warps 0-3
DRAIN_WARP0 = 4  # warps 4-7
GATHER_WARP0 = 8  # warps 8-11
MMA_WARP = 12
THREADS = 32 * (MMA_WARP + 1)
WG_THREADS = 128

# Named barriers (0 is __syncthreads).  Every bar.sync of an id sits at one code address: a
# bar.sync (barrier.sync.aligned) that two roles reach from different code locations is what
# compute-sanitizer's synccheck reports as "divergent threads" (found on sm90; see
# docs/DSL_NOTES.md, "Named barriers"); tests/test_barrier_rule.py checks the SASS.
BAR_ROWS = 1  # drain arrives once -delta' is in smem; the math warps sync (and see their lse2 / asum scale)
BAR_END = 2  # math + drain, one call site in ``kernel``: every TMEM read done before the dealloc


@dataclass(frozen=True)
class BwdPlan:
    """The static resource plan of one configuration (pure Python: host tests check it)."""

    d_qk: int
    d_v: int
    n_k_tiles: int
    n_v_tiles: int
    chunk_dims: Tuple[int, ...]  # first head dim of each 128-dim chunk
    chunk_store_row: Tuple[int, ...]  # first row of the chunk that is stored (64: overlap)
    dq_cols: Tuple[int, ...]  # TMEM column of each dQ^T chunk
    dkv_cols: Tuple[int, ...]  # TMEM column of each dKV^T buffer
    smem_bytes: int  # upper bound of the shared-storage struct (asserted when traced)

    def tmem_regions(self) -> List[Tuple[str, int, int]]:
        """``(name, first column, end column)`` of every TMEM region."""
        regs = [("S", COL_S, COL_S + B_H), ("dP", COL_DP, COL_DP + B_H)]
        regs += [(f"dQ{c}", col, col + B_H) for c, col in enumerate(self.dq_cols)]
        regs += [(f"dKV{i}", col, col + B_TOPK) for i, col in enumerate(self.dkv_cols)]
        return regs


def bwd_plan(d_qk: int, d_v: int = 512) -> BwdPlan:
    if d_qk not in (512, 576):
        raise ValueError(f"sm100 backward supports d_qk 512 or 576, got {d_qk}")
    if d_v != 512:
        raise ValueError(f"sm100 backward supports d_v 512, got {d_v}")
    n_chunks = (d_qk + D_CHUNK - 1) // D_CHUNK
    dims = tuple(min(c * D_CHUNK, d_qk - D_CHUNK) for c in range(n_chunks))
    store = tuple(c * D_CHUNK - dims[c] for c in range(n_chunks))
    dq_cols = tuple(COL_DQ + B_H * c for c in range(n_chunks))
    first_free = COL_DQ + B_H * n_chunks
    n_bufs = (TMEM_COLUMNS - first_free) // B_TOPK
    if n_bufs < 1:
        raise ValueError("TMEM: no column left for a dKV buffer")
    dkv_cols = tuple(first_free + B_TOPK * i for i in range(n_bufs))
    smem = SMEM_HEADER_BYTES + 2 * (B_H * d_qk + B_H * d_v + B_TOPK * d_qk + 2 * B_TOPK * B_H)
    return BwdPlan(d_qk, d_v, d_qk // K_TILE, d_v // K_TILE, dims, store, dq_cols, dkv_cols, smem)


# ---------------------------------------------------------------------------------------------
# Small inline-PTX helpers (used by this kernel only)
# ---------------------------------------------------------------------------------------------


def transpose_quad(vals: cute.Tensor, base: int, q: Int32) -> None:
    """4 x 4 transpose between the 4 lanes of a quad (``q = lane % 4``) and ``vals[base..base+3]``:
    afterwards element ``e`` of lane ``a`` holds what element ``a`` of lane ``e`` held.  Two
    butterfly stages (lane xor 1, 2), 4 shuffles.  All lanes call it."""
    for bit in (1, 2):
        upper = (q & bit) != 0
        for g in range(4):
            if g & bit == 0:
                h = g | bit
                x_g = vals[base + g]
                x_h = vals[base + h]
                send = Float32(cutlass.select_(upper, x_g, x_h))
                recv = cute.arch.shuffle_sync_bfly(send, offset=bit)
                vals[base + g] = Float32(cutlass.select_(upper, recv, x_g))
                vals[base + h] = Float32(cutlass.select_(upper, x_h, recv))


class SparseMlaBwdSm100:
    """Static configuration + host launcher + device kernel of the sm100 sparse backward."""

    #: Chunks of the delta prologue's loads in flight (``common.device.rowsum_o_do_half``).
    delta_unroll = 2

    def __init__(
        self,
        d_qk: int,
        d_v: int = 512,
        has_topk_length: bool = False,
        has_dlse: bool = False,
        attn_sum: bool = False,
        attn_sum_scaled: bool = False,
        deterministic: bool = False,
    ):
        self.plan = bwd_plan(d_qk, d_v)
        self.d_qk = d_qk
        self.d_v = d_v
        self.has_topk_length = has_topk_length
        self.has_dlse = has_dlse
        self.attn_sum = attn_sum
        self.attn_sum_scaled = attn_sum_scaled
        self.deterministic = deterministic
        self.n_k_tiles = self.plan.n_k_tiles
        self.n_v_tiles = self.plan.n_v_tiles
        self.n_chunks = len(self.plan.chunk_dims)
        self.n_dkv_bufs = len(self.plan.dkv_cols)
        # As on sm90 (measured there: +2..9%), the head-block CTAs of a token run as 2-CTA
        # clusters when h_q is a multiple of 128, so that they are co-scheduled and their dKV
        # atomics to the same rows meet in L2.  Only a launch property: every tcgen05 op stays
        # cta_group::1 and the CTAs never talk to each other.
        self.pair_cluster = True
        self.smem_bytes = 0  # set when traced

    # The ACCUMULATE field is set on a fresh tiled MMA per use: a field set inside one dynamic
    # region must not leak into another.
    def _mma_s(self):
        """S^T / dP^T: A = KV tile (tokens, K-major), B = Q / dO (heads, K-major); M = 64."""
        return sm100_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32, tcgen05.CtaGroup.ONE,
            (B_TOPK, B_H),
        )

    def _mma_dq(self):
        """dQ^T: A = K^T (dims, MN-major view of the KV tile), B = dS^T (heads, MN-major view)."""
        return sm100_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.MN, OperandMajorMode.MN, Float32, tcgen05.CtaGroup.ONE,
            (D_CHUNK, B_H),
        )

    def _mma_dkv(self):
        """dKV^T: A = Q^T / dO^T (dims, MN-major views), B = dS / P (tokens, K-major)."""
        return sm100_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.MN, OperandMajorMode.K, Float32, tcgen05.CtaGroup.ONE,
            (D_CHUNK, B_TOPK),
        )

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [s_q, h_q, d_qk] bf16
        mKV: cute.Tensor,  # [s_kv, d_qk] bf16
        mDO: cute.Tensor,  # [s_q, h_q, d_v] bf16
        mO: cute.Tensor,  # [s_q, h_q, d_v] bf16
        mIdx: cute.Tensor,  # [s_q, topk] int32, topk % 64 == 0
        mTopkLen: cute.Tensor,  # [s_q] int32 (read only if has_topk_length)
        mLse2: cute.Tensor,  # [s_q, h_q] f32
        mDeltaCorr: cute.Tensor,  # [s_q, h_q] f32 (read only if has_dlse)
        mDeltaOut: cute.Tensor,  # [s_q, h_q] f32 out
        mAsumScale: cute.Tensor,  # [s_q, h_q] f32 (read only if attn_sum_scaled)
        mDQ: cute.Tensor,  # [s_q, h_q, d_qk] bf16
        mWs: cute.Tensor,  # f32 [s_kv, d_qk] (atomic) or [s_q * n_hblk * topk, d_qk] (deterministic)
        mAsum: cute.Tensor,  # f32 [s_q, n_hblk, topk] (written only if attn_sum)
        scale_log2: Float32,
        sm_scale: Float32,
        stream,
    ):
        mma_s = self._mma_s()
        # K-major operand tiles exactly as the cp.async writers lay them out: [rows x 64] SW128
        # tiles, rows * 128 bytes apart (checked by tests/test_sm100_bwd.py).
        sK_layout = sm100_utils.make_smem_layout_a(mma_s, (B_TOPK, B_H, self.d_qk), BFloat16, 1)
        sQ_layout = sm100_utils.make_smem_layout_b(mma_s, (B_TOPK, B_H, self.d_qk), BFloat16, 1)
        sDO_layout = sm100_utils.make_smem_layout_b(mma_s, (B_TOPK, B_H, self.d_v), BFloat16, 1)
        # P / dS as the K-major B of dKV^T ([tokens x heads], one 128-byte row per token) ...
        sPK_layout = sm100_utils.make_smem_layout_b(self._mma_dkv(), (D_CHUNK, B_TOPK, B_H), BFloat16, 1)
        # ... and MN-major views ([dims or heads] x [tokens or heads], dims contiguous) of the same
        # bytes: a 64-wide MN atom is one row group of 8 x 128 bytes, K advances by 128-byte rows.
        mn_atom = tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.MN_SW128, BFloat16)
        sT128_layout = cute.tile_to_shape(mn_atom, (D_CHUNK, 64), (1, 0))
        sT64_layout = cute.tile_to_shape(mn_atom, (64, 64), (1, 0))

        @cute.struct
        class SharedStorage:
            kv_full: cute.struct.MemRange[cutlass.Int64, self.n_k_tiles]
            kv_free: cute.struct.MemRange[cutlass.Int64, 1]
            q_full: cute.struct.MemRange[cutlass.Int64, 1]
            s_full: cute.struct.MemRange[cutlass.Int64, 1]
            s_free: cute.struct.MemRange[cutlass.Int64, 1]
            pds_full: cute.struct.MemRange[cutlass.Int64, 1]
            pds_free: cute.struct.MemRange[cutlass.Int64, 1]
            dkv_full: cute.struct.MemRange[cutlass.Int64, self.n_dkv_bufs]
            dkv_empty: cute.struct.MemRange[cutlass.Int64, self.n_dkv_bufs]
            dq_full: cute.struct.MemRange[cutlass.Int64, 1]
            tmem_holding: Int32
            sLse2: cute.struct.Align[cute.struct.MemRange[Float32, B_H], 16]
            sNegDelta: cute.struct.Align[cute.struct.MemRange[Float32, B_H], 16]  # -delta' * sm_scale
            sAsc: cute.struct.Align[cute.struct.MemRange[Float32, B_H], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, B_H * self.d_qk], 1024]
            sDO: cute.struct.Align[cute.struct.MemRange[BFloat16, B_H * self.d_v], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, B_TOPK * self.d_qk], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, B_TOPK * B_H], 1024]
            sDS: cute.struct.Align[cute.struct.MemRange[BFloat16, B_TOPK * B_H], 1024]

        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes <= self.plan.smem_bytes <= SMEM_LIMIT, f"smem {self.smem_bytes}"
        assert cute.cosize(sK_layout) == B_TOPK * self.d_qk and cute.cosize(sQ_layout) == B_H * self.d_qk

        s_q = mQ.shape[0]
        n_hblk = mQ.shape[1] // B_H
        self.kernel(
            mQ, mKV, mDO, mO, mIdx, mTopkLen, mLse2, mDeltaCorr, mDeltaOut, mAsumScale, mDQ, mWs, mAsum,
            scale_log2, sm_scale, sK_layout, sQ_layout, sDO_layout, sPK_layout, sT128_layout, sT64_layout,
            SharedStorage, n_hblk,
        ).launch(
            grid=[s_q * n_hblk, 1, 1],  # s_q on grid.x: no 65535 cap
            block=[THREADS, 1, 1],
            cluster=[2 if (self.pair_cluster and n_hblk % 2 == 0) else 1, 1, 1],
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
        mDO: cute.Tensor,
        mO: cute.Tensor,
        mIdx: cute.Tensor,
        mTopkLen: cute.Tensor,
        mLse2: cute.Tensor,
        mDeltaCorr: cute.Tensor,
        mDeltaOut: cute.Tensor,
        mAsumScale: cute.Tensor,
        mDQ: cute.Tensor,
        mWs: cute.Tensor,
        mAsum: cute.Tensor,
        scale_log2: Float32,
        sm_scale: Float32,
        sK_layout: cute.ComposedLayout,
        sQ_layout: cute.ComposedLayout,
        sDO_layout: cute.ComposedLayout,
        sPK_layout: cute.ComposedLayout,
        sT128_layout: cute.ComposedLayout,
        sT64_layout: cute.ComposedLayout,
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
        # Pointers and views out of the struct before any role branch.
        kv_full = storage.kv_full.data_ptr()
        kv_free = storage.kv_free.data_ptr()
        q_full = storage.q_full.data_ptr()
        s_full = storage.s_full.data_ptr()
        s_free = storage.s_free.data_ptr()
        pds_full = storage.pds_full.data_ptr()
        pds_free = storage.pds_free.data_ptr()
        dkv_full = storage.dkv_full.data_ptr()
        dkv_empty = storage.dkv_empty.data_ptr()
        dq_full = storage.dq_full.data_ptr()
        tmem_holding = storage.tmem_holding.ptr
        sLse2 = storage.sLse2.get_tensor(cute.make_layout(B_H))
        sNegDelta = storage.sNegDelta.get_tensor(cute.make_layout(B_H))
        sAsc = storage.sAsc.get_tensor(cute.make_layout(B_H))
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sDO = storage.sDO.get_tensor(sDO_layout.outer, swizzle=sDO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sP = storage.sP.get_tensor(sPK_layout.outer, swizzle=sPK_layout.inner)
        sDS = storage.sDS.get_tensor(sPK_layout.outer, swizzle=sPK_layout.inner)
        sDSt = storage.sDS.get_tensor(sT64_layout.outer, swizzle=sT64_layout.inner)
        # MN-major [128 dims x 64] views of K, Q and dO for each head-dim chunk.
        sKt = []
        sQt = []
        sDOt = []
        for c in cutlass.range_constexpr(self.n_chunks):
            off = (self.plan.chunk_dims[c] // K_TILE) * TILE_BYTES // 2  # elements
            sKt.append(cute.make_tensor(cute.recast_ptr(storage.sK.data_ptr() + off, sT128_layout.inner,
                                                        dtype=BFloat16), sT128_layout.outer))
            sQt.append(cute.make_tensor(cute.recast_ptr(storage.sQ.data_ptr() + off, sT128_layout.inner,
                                                        dtype=BFloat16), sT128_layout.outer))
            if const_expr(self.plan.chunk_dims[c] < self.d_v):
                sDOt.append(cute.make_tensor(cute.recast_ptr(storage.sDO.data_ptr() + off, sT128_layout.inner,
                                                             dtype=BFloat16), sT128_layout.outer))
        sQ_addr = dev.smem_addr_u32(storage.sQ.data_ptr())
        sDO_addr = dev.smem_addr_u32(storage.sDO.data_ptr())
        sK_addr = dev.smem_addr_u32(storage.sK.data_ptr())
        sP_addr = dev.smem_addr_u32(storage.sP.data_ptr())
        sDS_addr = dev.smem_addr_u32(storage.sDS.data_ptr())

        if warp_idx == MMA_WARP:
            with cute.arch.elect_one():
                for t in cutlass.range_constexpr(self.n_k_tiles):
                    cute.arch.mbarrier_init(kv_full + t, WG_THREADS)  # noinc cp.async arrivals
                cute.arch.mbarrier_init(kv_free, 1)
                cute.arch.mbarrier_init(q_full, WG_THREADS)
                cute.arch.mbarrier_init(s_full, 1)
                cute.arch.mbarrier_init(s_free, WG_THREADS)
                cute.arch.mbarrier_init(pds_full, WG_THREADS)
                cute.arch.mbarrier_init(pds_free, 1)
                for i in cutlass.range_constexpr(self.n_dkv_bufs):
                    cute.arch.mbarrier_init(dkv_full + i, 1)
                    cute.arch.mbarrier_init(dkv_empty + i, WG_THREADS)
                cute.arch.mbarrier_init(dq_full, 1)
        if warp_idx == MATH_WARP0:
            cute.arch.alloc_tmem(TMEM_COLUMNS, tmem_holding)
            cute.arch.relinquish_tmem_alloc_permit()
            dev.tcgen05_fence_before_thread_sync()
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        topk = mIdx.shape[1]
        topk_len = topk
        if const_expr(self.has_topk_length):
            topk_len = cutlass.max(cutlass.min(mTopkLen[s_idx], topk), 0)
        num_blocks = (topk_len + (B_TOPK - 1)) // B_TOPK
        head0 = h_blk * B_H

        if warp_idx >= GATHER_WARP0 and warp_idx < MMA_WARP:
            self.gather(mQ, mKV, mDO, mIdx, s_idx, head0, topk_len, num_blocks, sQ_addr, sDO_addr, sK_addr,
                        kv_full, kv_free, q_full, tidx - 32 * GATHER_WARP0)
        elif warp_idx == MMA_WARP:
            self.mma_issuer(sK, sQ, sDO, sP, sDS, sDSt, sKt, sQt, sDOt, tmem_holding, num_blocks, kv_full,
                            kv_free, q_full, s_full, s_free, pds_full, pds_free, dkv_full, dkv_empty, dq_full)
        elif warp_idx < DRAIN_WARP0:
            self.math(mKV, mIdx, mLse2, mAsumScale, mDQ, mAsum, scale_log2, sm_scale, s_idx, h_blk, head0, topk,
                      topk_len, num_blocks, sLse2, sNegDelta, sAsc, sP_addr, sDS_addr, tmem_holding, s_full,
                      s_free, pds_full, pds_free, dq_full, tidx, warp_idx)
        else:
            self.drain(mKV, mIdx, mDO, mO, mDeltaCorr, mDeltaOut, mWs, sm_scale, s_idx, h_blk, head0, n_hblk,
                       topk, topk_len, num_blocks, sNegDelta, tmem_holding, dkv_full, dkv_empty,
                       tidx - 32 * DRAIN_WARP0, warp_idx)

        # Math and drain warps: every TMEM read is complete before math warp 0 frees the
        # allocation.  One bar.sync for both roles, here after the role branch (each role syncing
        # at the end of its own function put two BAR.SYNC of one id at two code addresses).
        if warp_idx < GATHER_WARP0:
            dev.tcgen05_fence_before_thread_sync()
            cute.arch.barrier(barrier_id=BAR_END, number_of_threads=2 * WG_THREADS)
            if warp_idx == MATH_WARP0:
                dev.tcgen05_fence_after_thread_sync()
                tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_holding)
                cute.arch.dealloc_tmem(tmem_ptr, TMEM_COLUMNS)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def gather(self, mQ, mKV, mDO, mIdx, s_idx, head0, topk_len, num_blocks, sQ_addr, sDO_addr, sK_addr,
               kv_full, kv_free, q_full, ptid):
        if num_blocks > 0:  # an empty row issues no copy (nothing may be in flight at exit)
            row0 = Int64(s_idx) * mQ.shape[1] + Int64(head0)
            policy = dev.createpolicy_evict_first()
            copy_dense_rows(sQ_addr, dev.gmem_addr_i64(mQ.iterator) + row0 * (self.d_qk * 2), self.d_qk * 2,
                            B_H, self.n_k_tiles, ptid, policy)
            copy_dense_rows(sDO_addr, dev.gmem_addr_i64(mDO.iterator) + row0 * (self.d_v * 2), self.d_v * 2,
                            B_H, self.n_v_tiles, ptid, policy)
            cute.arch.cp_async_mbarrier_arrive_noinc(q_full)
        gather = KvGather(mKV, mIdx, s_idx, topk_len, ptid, self.d_qk, slots=1, rows=B_TOPK)
        for b in cutlass.range(num_blocks, unroll=1):
            gather.load_indices(b, 0)
            # the single KV buffer is free once block b-1's dQ^T products are done
            cute.arch.mbarrier_wait(kv_free, (b & 1) ^ 1)
            for t in cutlass.range_constexpr(self.n_k_tiles):
                gather.copy_tile(sK_addr + t * TILE_BYTES, 0, t)
                cute.arch.cp_async_mbarrier_arrive_noinc(kv_full + t)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def mma_issuer(self, sK, sQ, sDO, sP, sDS, sDSt, sKt, sQt, sDOt, tmem_holding, num_blocks, kv_full, kv_free,
                   q_full, s_full, s_free, pds_full, pds_free, dkv_full, dkv_empty, dq_full):
        dev.tcgen05_fence_after_thread_sync()
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_holding)
        mma_s0 = self._mma_s()
        mma_dq0 = self._mma_dq()
        mma_dkv0 = self._mma_dkv()
        tCrK = mma_s0.make_fragment_A(sK)  # (MMA, 1, d_qk/16, 1)
        tCrQ = mma_s0.make_fragment_B(sQ)
        tCrDO = mma_s0.make_fragment_B(sDO)
        s_layout = mma_s0.make_fragment_C(mma_s0.partition_shape_C((B_TOPK, B_H))).layout
        tS = cute.make_tensor(tmem_ptr + COL_S, s_layout)
        tDP = cute.make_tensor(tmem_ptr + COL_DP, s_layout)
        thr_dq = mma_dq0.get_slice(0)
        thr_dkv = mma_dkv0.get_slice(0)
        dq_layout = mma_dq0.make_fragment_C(mma_dq0.partition_shape_C((D_CHUNK, B_H))).layout
        dkv_layout = mma_dkv0.make_fragment_C(mma_dkv0.partition_shape_C((D_CHUNK, B_TOPK))).layout
        tCrDSt = mma_dq0.make_fragment_B(thr_dq.partition_B(sDSt))  # (MMA, 1, 4)
        tCrDS = mma_dkv0.make_fragment_B(sDS)
        tCrP = mma_dkv0.make_fragment_B(sP)
        kpt = K_TILE // MMA_K
        dkv_stage = make_pipeline_state(PipelineUserType.Producer, self.n_dkv_bufs)

        if num_blocks > 0:
            cute.arch.mbarrier_wait(q_full, 0)
        for b in cutlass.range(num_blocks, unroll=1):
            parity = b & 1
            # ---- S^T = K Q^T, dP^T = V dO^T (TMEM S/dP free once the math warps loaded b-1) ----
            cute.arch.mbarrier_wait(s_free, parity ^ 1)
            mma_s = self._mma_s()
            for t in cutlass.range_constexpr(self.n_k_tiles):
                cute.arch.mbarrier_wait(kv_full + t, parity)
                # cp.async writes are generic-proxy; the MMA reads through the async proxy.  The
                # writers never wait on their own copies, so the reader fences (cf. attn_dist).
                cute.arch.fence_proxy("async.shared", space="cta")
                dev.tcgen05_fence_after_thread_sync()
                for kk in cutlass.range_constexpr(kpt):
                    k = t * kpt + kk
                    mma_s.set(tcgen05.Field.ACCUMULATE, k != 0)
                    cute.gemm(mma_s, tS, tCrK[None, None, k, 0], tCrQ[None, None, k, 0], tS)
                if const_expr(t < self.n_v_tiles):
                    for kk in cutlass.range_constexpr(kpt):
                        k = t * kpt + kk
                        mma_s.set(tcgen05.Field.ACCUMULATE, k != 0)
                        cute.gemm(mma_s, tDP, tCrK[None, None, k, 0], tCrDO[None, None, k, 0], tDP)
            with cute.arch.elect_one():
                tcgen05.commit(s_full)
            # ---- dQ^T += K^T dS^T (P/dS stored by the math warps) ----
            cute.arch.mbarrier_wait(pds_full, parity)
            dev.tcgen05_fence_after_thread_sync()
            mma_dq = self._mma_dq()
            for c in cutlass.range_constexpr(self.n_chunks):
                tA = mma_dq.make_fragment_A(thr_dq.partition_A(sKt[c]))
                acc = cute.make_tensor(tmem_ptr + self.plan.dq_cols[c], dq_layout)
                for kk in cutlass.range_constexpr(B_TOPK // MMA_K):
                    mma_dq.set(tcgen05.Field.ACCUMULATE, (b > 0) | (kk != 0))
                    cute.gemm(mma_dq, acc, tA[None, None, kk], tCrDSt[None, None, kk], acc)
            with cute.arch.elect_one():
                tcgen05.commit(kv_free)  # the KV buffer's last reader
            # ---- dKV^T = Q^T dS (+ dO^T P) per chunk, into the drain ring ----
            mma_dkv = self._mma_dkv()
            for c in cutlass.range_constexpr(self.n_chunks):
                cute.arch.mbarrier_wait(dkv_empty + dkv_stage.index, dkv_stage.phase)
                dev.tcgen05_fence_after_thread_sync()
                acc = cute.make_tensor(tmem_ptr + self.plan.dkv_cols[0], dkv_layout)
                if const_expr(self.n_dkv_bufs > 1):
                    acc = cute.make_tensor(tmem_ptr + self.plan.dkv_cols[0] + dkv_stage.index * B_TOPK, dkv_layout)
                tA = mma_dkv.make_fragment_A(thr_dkv.partition_A(sQt[c]))
                for kk in cutlass.range_constexpr(B_H // MMA_K):
                    mma_dkv.set(tcgen05.Field.ACCUMULATE, kk != 0)
                    cute.gemm(mma_dkv, acc, tA[None, None, kk], tCrDS[None, None, kk, 0], acc)
                # dO^T P only where the chunk's stored rows are V dims
                if const_expr(self.plan.chunk_dims[c] + self.plan.chunk_store_row[c] < self.d_v):
                    tAo = mma_dkv.make_fragment_A(thr_dkv.partition_A(sDOt[c]))
                    for kk in cutlass.range_constexpr(B_H // MMA_K):
                        mma_dkv.set(tcgen05.Field.ACCUMULATE, True)
                        cute.gemm(mma_dkv, acc, tAo[None, None, kk], tCrP[None, None, kk, 0], acc)
                with cute.arch.elect_one():
                    tcgen05.commit(dkv_full + dkv_stage.index)
                dkv_stage.advance()
            with cute.arch.elect_one():
                tcgen05.commit(pds_free)  # P/dS smem's last reader
        # dQ^T complete (a commit covers every earlier MMA of this thread; with no block it
        # arrives at once and the epilogue writes zeros).
        with cute.arch.elect_one():
            tcgen05.commit(dq_full)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def math(self, mKV, mIdx, mLse2, mAsumScale, mDQ, mAsum, scale_log2, sm_scale, s_idx, h_blk, head0, topk,
             topk_len, num_blocks, sLse2, sNegDelta, sAsc, sP_addr, sDS_addr, tmem_holding, s_full, s_free,
             pds_full, pds_free, dq_full, tidx, warp_idx):
        if tidx < B_H:
            sLse2[tidx] = mLse2[s_idx, head0 + tidx]
            if const_expr(self.attn_sum_scaled):
                sAsc[tidx] = mAsumScale[s_idx, head0 + tidx]
        # The drain warps arrive (their -delta' rows are stored); the math warps sync.
        cute.arch.barrier(barrier_id=BAR_ROWS, number_of_threads=2 * WG_THREADS)

        dev.tcgen05_fence_after_thread_sync()
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_holding)
        mma_s = self._mma_s()
        s_layout = mma_s.make_fragment_C(mma_s.partition_shape_C((B_TOPK, B_H))).layout
        tS = cute.make_tensor(tmem_ptr + COL_S, s_layout)
        tDP = cute.make_tensor(tmem_ptr + COL_DP, s_layout)
        # 16x32bx2: thread 32 w + l holds token 16 w + l % 16, heads 32 (l // 16) + 0..31.
        ld_atom = cute.make_copy_atom(tcgen05.Ld16x32bx2Op(tcgen05.Repetition.x32), Float32)
        t2r = tcgen05.make_tmem_copy(ld_atom, tS).get_slice(tidx)
        tSrc = t2r.partition_S(tS)
        tDPsrc = t2r.partition_S(tDP)
        rS = cute.make_rmem_tensor(t2r.partition_D(tS).shape, Float32)
        rDP = cute.make_rmem_tensor(t2r.partition_D(tDP).shape, Float32)
        lane = tidx % 32
        row = 16 * warp_idx + lane % 16  # the token of the block
        hh0 = 32 * (lane // 16)  # first head
        s_kv = mKV.shape[0]
        # this thread's half row: 16-byte chunks hh0/8 .. +3 of a 128-byte swizzled row
        row_addr_p = sP_addr + row * 128
        row_addr_ds = sDS_addr + row * 128
        for b in cutlass.range(num_blocks, unroll=1):
            parity = b & 1
            slot = b * B_TOPK + row
            idx = mIdx[s_idx, cutlass.min(slot, topk - 1)]
            ok = dev.slot_valid(idx, slot, s_kv, topk_len)
            cute.arch.mbarrier_wait(s_full, parity)
            dev.tcgen05_fence_after_thread_sync()
            cute.copy(t2r, tSrc, rS)
            cute.copy(t2r, tDPsrc, rDP)
            cute.arch.fence_view_async_tmem_load()
            dev.tcgen05_fence_before_thread_sync()
            cute.arch.mbarrier_arrive(s_free)
            # the dKV^T products of block b-1 still read P/dS
            cute.arch.mbarrier_wait(pds_free, parity ^ 1)
            asum = Float32(0.0)
            # 8 heads (one 16-byte chunk of P and of dS) at a time: short live ranges
            for k in cutlass.range_constexpr(4):
                for i in cutlass.range_constexpr(8):
                    j = 8 * k + i
                    h = hh0 + j
                    p = cute.math.exp2(rS[j] * scale_log2 - sLse2[h], fastmath=True)
                    p = Float32(cutlass.select_(ok, p, Float32(0.0)))
                    if const_expr(self.attn_sum):
                        if const_expr(self.attn_sum_scaled):
                            asum = asum + p * sAsc[h]
                        else:
                            asum = asum + p
                    rS[j] = p
                    rDP[j] = p * (rDP[j] * sm_scale + sNegDelta[h])
                chunk = (hh0 // 8 + k) ^ (row % 8)
                w = [dev.pack_bf16x2(rS[8 * k + 2 * i], rS[8 * k + 2 * i + 1]) for i in range(4)]
                dev.st_shared_v4_b32(row_addr_p + chunk * 16, w[0], w[1], w[2], w[3])
                w = [dev.pack_bf16x2(rDP[8 * k + 2 * i], rDP[8 * k + 2 * i + 1]) for i in range(4)]
                dev.st_shared_v4_b32(row_addr_ds + chunk * 16, w[0], w[1], w[2], w[3])
            if const_expr(self.attn_sum):
                asum = asum + cute.arch.shuffle_sync_bfly(asum, offset=16)
                if lane < 16:
                    mAsum[s_idx, h_blk, slot] = asum
            cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> MMA reads
            cute.arch.mbarrier_arrive(pds_full)
        if const_expr(self.attn_sum):
            # slots of blocks past topk_length are never gathered: write their zeros
            n_tail = topk - num_blocks * B_TOPK
            for t in cutlass.range((n_tail + (WG_THREADS - 1) - tidx) // WG_THREADS, unroll=1):
                mAsum[s_idx, h_blk, num_blocks * B_TOPK + tidx + t * WG_THREADS] = Float32(0.0)

        # ---- dQ epilogue: thread t holds dim t of each chunk for all 64 heads ----
        mma_dq = self._mma_dq()
        dq_layout = mma_dq.make_fragment_C(mma_dq.partition_shape_C((D_CHUNK, B_H))).layout
        tDQ0 = cute.make_tensor(tmem_ptr + COL_DQ, dq_layout)
        ld32 = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x64), Float32)
        t2r_dq = tcgen05.make_tmem_copy(ld32, tDQ0).get_slice(tidx)
        rDQ = cute.make_rmem_tensor(t2r_dq.partition_D(tDQ0).shape, Float32)
        has_rows = num_blocks > 0
        q = lane % 4
        cute.arch.mbarrier_wait(dq_full, 0)
        dev.tcgen05_fence_after_thread_sync()
        dq_base = dev.gmem_addr_i64(mDQ.iterator) + (Int64(s_idx) * mDQ.shape[1] + Int64(head0)) * (self.d_qk * 2)
        for c in cutlass.range_constexpr(self.n_chunks):
            tDQ = cute.make_tensor(tmem_ptr + self.plan.dq_cols[c], dq_layout)
            cute.copy(t2r_dq, t2r_dq.partition_S(tDQ), rDQ)
            cute.arch.fence_view_async_tmem_load()
            for g in cutlass.range_constexpr(B_H // 4):
                for e in cutlass.range_constexpr(4):
                    rDQ[4 * g + e] = Float32(cutlass.select_(has_rows, rDQ[4 * g + e], Float32(0.0)))
                transpose_quad(rDQ, 4 * g, q)
            # lane 4a+q now holds, for head 4g+q, dims 4a..4a+3 of this warp's 32: 8-byte stores,
            # 8 lanes per head covering 64 contiguous bytes
            dim0 = self.plan.chunk_dims[c] + 32 * warp_idx + 4 * (lane // 4)
            if 32 * warp_idx >= self.plan.chunk_store_row[c]:
                for g in cutlass.range_constexpr(B_H // 4):
                    h = 4 * g + q
                    addr = dq_base + Int64(h * self.d_qk * 2) + Int64(dim0 * 2)
                    dev.st_global_v2_b32(addr, dev.pack_bf16x2(rDQ[4 * g], rDQ[4 * g + 1]),
                                     dev.pack_bf16x2(rDQ[4 * g + 2], rDQ[4 * g + 3]))

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def drain(self, mKV, mIdx, mDO, mO, mDeltaCorr, mDeltaOut, mWs, sm_scale, s_idx, h_blk, head0, n_hblk, topk,
              topk_len, num_blocks, sNegDelta, tmem_holding, dkv_full, dkv_empty, dtid, warp_idx):
        self._delta_rows(mO, mDO, mDeltaCorr, mDeltaOut, sNegDelta, sm_scale, s_idx, head0, dtid)
        # One-way: the drain needs nothing the math warps stage (a bar.sync here as well would be
        # one barrier synced from two code locations).
        cute.arch.barrier_arrive(barrier_id=BAR_ROWS, number_of_threads=2 * WG_THREADS)

        dev.tcgen05_fence_after_thread_sync()
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_holding)
        # The deterministic variant drains a chunk in two 32-token halves (load, scatter, load,
        # scatter): its stores need more address registers than the atomics, and 64 loaded
        # floats + those do not fit the 128 registers of a 416-thread CTA without spilling.
        halves = 2 if const_expr(self.deterministic) else 1
        cols = B_TOPK // halves
        half_layout = cute.make_layout(((D_CHUNK, cols), 1, 1), stride=((65536, 1), 0, 0))
        tKV0 = cute.make_tensor(tmem_ptr + self.plan.dkv_cols[0], half_layout)
        # 32x32b: thread t holds row t (head dim t of the chunk), element j = token j of the half
        ld32 = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(cols)), Float32)
        t2r = tcgen05.make_tmem_copy(ld32, tKV0).get_slice(dtid)
        rKV = cute.make_rmem_tensor(t2r.partition_D(tKV0).shape, Float32)
        lane = dtid % 32
        wq = warp_idx - DRAIN_WARP0  # TMEM lanes 32 wq .. 32 wq + 31
        q = lane % 4
        s_kv = mKV.shape[0]
        col_bytes = (32 * wq + 4 * (lane // 4)) * 4
        ws_base = dev.gmem_addr_i64(mWs.iterator) + Int64(col_bytes)
        row_bytes = self.d_qk * 4
        policy = dev.createpolicy_evict_last()
        rows = cute.make_rmem_tensor((B_TOPK // 4,), Int32)  # kv row of token 4g+q (-1: invalid)
        dkv_stage = make_pipeline_state(PipelineUserType.Consumer, self.n_dkv_bufs)
        for b in cutlass.range(num_blocks, unroll=1):
            okmask = self._drain_rows(mIdx, s_idx, b, q, topk, topk_len, s_kv, rows)
            # the slot's private row of the deterministic workspace (int32: the host bounds a wave)
            det_row0 = (s_idx * n_hblk + h_blk) * topk + b * B_TOPK + q
            for c in cutlass.range_constexpr(self.n_chunks):
                cute.arch.mbarrier_wait(dkv_full + dkv_stage.index, dkv_stage.phase)
                dev.tcgen05_fence_after_thread_sync()
                col0 = self.plan.dkv_cols[0] + 0 * dkv_stage.index
                if const_expr(self.n_dkv_bufs > 1):
                    col0 = self.plan.dkv_cols[0] + dkv_stage.index * B_TOPK
                for hf in cutlass.range_constexpr(halves):
                    src = cute.make_tensor(tmem_ptr + col0 + hf * cols, half_layout)
                    cute.copy(t2r, t2r.partition_S(src), rKV)
                    cute.arch.fence_view_async_tmem_load()
                    if const_expr(hf == halves - 1):
                        dev.tcgen05_fence_before_thread_sync()
                        cute.arch.mbarrier_arrive(dkv_empty + dkv_stage.index)  # the MMA may refill it
                    self._drain_scatter(rKV, hf, cols, q, 32 * wq >= self.plan.chunk_store_row[c],
                                        Int64(self.plan.chunk_dims[c] * 4), okmask, rows, det_row0, ws_base,
                                        row_bytes, policy)
                dkv_stage.advance()

    @cute.jit
    def _drain_rows(self, mIdx, s_idx, b, q, topk, topk_len, s_kv, rows) -> Uint32:
        """The drain thread's 16 tokens ``4 g + q`` of block ``b``: their kv rows into ``rows``
        (-1: invalid), or -- deterministic -- the validity mask (bit g) that is returned."""
        okmask = Uint32(0)
        for g in cutlass.range_constexpr(B_TOPK // 4):
            slot = b * B_TOPK + 4 * g + q
            idx = mIdx[s_idx, cutlass.min(slot, topk - 1)]
            ok = dev.slot_valid(idx, slot, s_kv, topk_len)
            if const_expr(self.deterministic):
                okmask = okmask | (Uint32(cutlass.select_(ok, Uint32(1), Uint32(0))) << Uint32(g))
            else:
                rows[g] = Int32(cutlass.select_(ok, idx, Int32(-1)))
        return okmask

    @cute.jit
    def _drain_scatter(self, rKV, hf: int, cols: int, q, store, col_off, okmask, rows, det_row0, ws_base, row_bytes,
                       policy):
        """Scatter ``cols`` tokens of one TMEM load (half ``hf`` of the block) of this thread's dKV^T
        row: a quad transpose, then (if ``store``) one 16-byte float atomic -- or, deterministic, a
        store to the slot's private row -- per 4 dims x token.  Lane 4a+q: token 4g+q, dims
        4a..4a+3 of the warp's 32 -> one instruction covers 4 tokens x 128 contiguous bytes (whole
        L2 lines).  ``col_off``: the first dim of the chunk, in bytes."""
        for g0 in cutlass.range_constexpr(cols // 4):
            transpose_quad(rKV, 4 * g0, q)
        if store:
            for g0 in cutlass.range_constexpr(cols // 4):
                g = hf * (cols // 4) + g0
                v = (rKV[4 * g0], rKV[4 * g0 + 1], rKV[4 * g0 + 2], rKV[4 * g0 + 3])
                if const_expr(self.deterministic):
                    if (okmask >> Uint32(g)) & Uint32(1) != Uint32(0):
                        addr = ws_base + Int64(det_row0 + 4 * g) * Int64(row_bytes) + col_off
                        dev.st_global_v4_f32(addr, v[0], v[1], v[2], v[3])
                else:
                    if rows[g] >= 0:
                        addr = ws_base + Int64(rows[g]) * Int64(row_bytes) + col_off  # 64-bit
                        dev.red_add_v4_f32_hint(addr, v[0], v[1], v[2], v[3], policy)

    @cute.jit
    def _delta_rows(self, mO, mDO, mDeltaCorr, mDeltaOut, sNegDelta, sm_scale, s_idx, head0, dtid):
        """``delta = rowsum(O * dO)`` of the 64 heads (float32): thread t sums half of row t/2;
        writes delta out (for d_attn_sink) and ``-(delta - dlse correction) * sm_scale`` to smem."""
        row = dtid // 2
        half = dtid % 2
        head = head0 + row
        acc = dev.rowsum_o_do_half(mO, mDO, s_idx, head, half, self.d_v, self.delta_unroll)
        if half == 0:
            mDeltaOut[s_idx, head] = acc
            corr = Float32(0.0)
            if const_expr(self.has_dlse):
                corr = mDeltaCorr[s_idx, head]
            sNegDelta[row] = -(acc - corr) * sm_scale
