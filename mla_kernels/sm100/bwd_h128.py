"""Sparse MLA backward on Blackwell (sm_100a / sm_103a): 128 heads per 2-CTA cluster (cta_group::2).

COMPILE-ONLY, NOT WIRED INTO DISPATCH.  Same op, kernel arguments (and argument order) and host
driver (``common/bwd_host.run_bwd``) as the 1-CTA kernel ``bwd.py``; ``attn_sum`` is not
implemented here (the constructor refuses it).  One cluster of two CTAs per (query token,
128-head group); CTA ``r`` owns heads ``64 r .. 64 r + 63`` and keeps its own Q (64 x d_qk) and
dO (64 x 512) stationary in smem.  Per block of ``B_TOPK = 64`` indices (``c = sm_scale log2 e``):

* ``S = Q K^T``, ``dP = dO V^T``: ``cta_group::2``, M = 128 heads (A: each CTA's own Q / dO), N = 64
  tokens (B split by N: CTA ``r`` gathers tokens ``32 r .. 32 r + 31``, all d_qk columns, into
  ``sKh``).  The M128 2-CTA accumulator puts head ``i`` of this CTA in TMEM lane ``i`` for tokens
  0..31 and lane ``64 + i`` for tokens 32..63 (32 columns each for S and dP).  Thread ``t`` of the
  math warps owns head ``t % 64``, tokens ``32 (t / 64) .. +31``.
* ``P = exp2(S c - lse2)`` (0 on invalid slots), ``dS = P (dP sm_scale - delta' sm_scale)`` -> bf16
  smem ``[64 heads x 64 tokens]`` (128-byte swizzled row per head) in each CTA.
* ``dQ = dS K``: ``cta_group::2``, M = 128 heads (A = each CTA's dS, K-major), N = 128 dims per tile,
  K = 64 tokens; B split by N: CTA ``r`` supplies dims ``128 j + 64 r .. +63`` of all 64 tokens
  (d_qk 576: a fifth tile, dims 448..575, whose first 64 dims are not stored).  Those operand
  tiles (``sKdq``) are assembled through DSMEM: each CTA's **push** warp copies 4 KB blocks
  (its 32 tokens x 64 dims) of its ``sKh`` into its own and the peer's ``sKdq`` with
  ``cp.async.bulk.shared::cluster.shared::cta`` (``complete_tx`` on the destination's mbarrier).
  dQ stays in TMEM (64 columns per tile) and is written once at the end.
* ``dKV^T = Q^T dS + dO^T P`` per 128-dim chunk: the sum over heads needs every head's Q^T, but
  each CTA only has its own 64 heads.  The product is issued as a *block-diagonal*
  ``cta_group::2`` MMA: M = 256 (CTA r's A = its own Q^T chunk, the same smem address in both
  CTAs), N = 128 (CTA r's B half = its own dS / P, all 64 tokens), K = 64 (own heads).  CTA r's
  accumulator columns ``64 r .. 64 r + 63`` hold ``Q_r^T dS_r`` (its heads' partial dKV^T of all 64
  tokens); the other 64 columns mix the two CTAs' heads and are never read (half of this MMA is
  wasted).  Each CTA drains its partial with 16-byte float atomics (``red.global.add.v4.f32``) --
  the pair's sum happens in the float32 workspace, exactly as two 1-CTA head blocks would (so the
  deterministic workspace, one private row per (token, 64-head block, slot), and the host's fixed
  reduction are unchanged).

TMEM (512 columns, allocated with cta_group::2): S 0..31 | dP 32..63 | dQ tile j at 64 + 64 j |
dKV^T (one buffer, 128 columns) at 384.  See :func:`bwd_h128_plan` (checked by tests).

smem per CTA (d_qk 576): header 1,024 + Q 73,728 + dO 65,536 + sKh 36,864 + sKdq 5 x 8,192 + dS
8,192 = 226,304 <= 232,448.  A separate P buffer would need 234,496 bytes, so **P lives in the
last 8 KB of sKh** (K dims 448..575; for d_qk 512 dims 384..511): the math warps write P(b) only
after ``S_FULL(b)`` (S/dP MMAs done reading sKh) and ``PUSH_DONE(b)`` (this CTA's DSMEM copies
done reading it), and the gather of block b+1 waits ``PDS_FREE(b)`` as well -- which serialises
the next block's K gather behind this block's dKV^T MMAs (a throughput cost, not a hazard).

Warps (448 threads): 0-3 math (P, dS, dQ epilogue; warp 0 allocates TMEM); 4-7 drain (delta, then
the dKV scatter); 8-11 gather (Q, dO once; per block the CTA's 32 K rows); 12 -- CTA 0: MMA issuer,
CTA 1: relay (forwards CTA 1's local completions to CTA 0's barriers: cp.async completion and
complete_tx can only land on a local mbarrier); 13 push (DSMEM copies).

Barrier protocol (``MB_*``; "mc" = ``tcgen05.commit.cta_group::2`` multicast to both CTAs; "->0" =
remote arrival on CTA 0's barrier, release at cluster scope).  Every phase is one per block unless
noted; each waiter waits every phase in order, and no phase can advance twice before its waiters
have waited (the producer of phase b+1 always waits on a consequence of the waiter's phase b):

* ``Q_LOCAL`` (128 noinc cp.async arrivals, once) -> MMA (CTA 0) / relay (CTA 1) -> ``Q_PEER`` (->0).
* ``KVH_LOCAL`` (128 noinc, gather of sKh(b)) -> push warp, MMA / relay -> ``KVH_PEER`` (->0).
* ``KVH_FREE`` (mc after S/dP(b)), ``PUSH_DONE`` (push warp, local, after its bulk reads of
  sKh(b) completed: ``cp.async.bulk.wait_group.read 0``) and ``PDS_FREE(b)`` -> gather of block
  b+1; ``PUSH_DONE(b)`` -> math too (before writing P(b) into sKh).  ``PUSH_DONE`` cannot advance
  twice before the math warps wait it: push(b+1) needs the gather of b+1, which needs
  ``PDS_FREE(b)``, which needs ``PDS_FULL(b)`` from the math warps after that wait.
* ``KDQ_FULL`` (local: 1 arrival = the push warp's ``arrive.expect_tx(40,960 or 32,768)``; the
  bytes come from both CTAs' push warps) -> MMA / relay -> ``KDQ_PEER`` (->0).  The peer's bytes of
  block b+1 cannot land before phase b completed: the peer pushes b+1 only after ``KDQ_FREE(b)``,
  which follows the dQ MMA(b), which waited ``KDQ_FULL(b)`` of both CTAs.
* ``KDQ_FREE`` (mc after dQ(b)) -> push warps (block b+1).
* ``S_FULL`` (mc after S/dP(b)) -> math; ``S_EMPTY`` (CTA 0, 256 ->0 from both CTAs' math after
  their TMEM loads) -> MMA before S/dP(b+1).
* ``PDS_FULL`` (CTA 0, 256 ->0 after the P/dS stores + ``fence.proxy.async``) -> MMA (dQ, dKV read
  both CTAs' dS / P); ``PDS_FREE`` (mc after the block's last dKV^T MMA) -> math before P/dS(b+1).
* ``DKV_FULL`` (mc per chunk) -> drain; ``DKV_EMPTY`` (CTA 0, 256 ->0 from both CTAs' drain warps
  after their TMEM loads) -> MMA: one buffer, one phase per chunk.
* ``DQ_FULL`` (mc after the last block) -> math epilogue.
* The pair ends with a cluster barrier before the cta_group::2 TMEM dealloc.

Compile report (sm_100a and sm_103a): 105-108 registers, 0 spills, 226,304 B smem (d576),
UTCHMMA.2CTA 124, UTCBAR.2CTA.MULTICAST 10, UBLKCP.S.S 10, LDTM.x32 22, 80 REDG.E.ADD.F32x4
(0 in the deterministic variant), no single-CTA tcgen05 op.  The drain loads 32 tokens per TMEM
load and the MMA warp rebuilds its operand descriptors per block from an opaque zero: both only
to stay within the 128 registers ptxas gives a 448-thread CTA without spilling.

Unproven / known costs: never run (no Blackwell GPU); the SASS, the layout contracts and a CPU
emulation of the pair decomposition are what tests check.  Costs by design: half of every dKV^T
MMA is wasted (block-diagonal), dKV atomics are per CTA (twice those of a pair-summed scheme,
the same as two 1-CTA head blocks), P in sKh serialises the next K gather behind the dKV^T
phase.  Cross-CTA ordering relies on remote ``mbarrier.arrive.release.cluster`` + a local
(CTA-scope) wait before async-proxy reads, as in ``fwd_h128.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.pipeline import PipelineUserType, make_pipeline_state

from ..common import device as dev
from ..common.gather import KvGather, copy_dense_rows
from .bwd import (D_CHUNK, K_TILE, MMA_K, SMEM_HEADER_BYTES, SMEM_LIMIT, TMEM_COLUMNS, SparseMlaBwdSm100,
                  transpose_quad)
from .fwd_h128 import arrive_cta0

B_H = 128  # heads per cluster (M of S / dP / dQ)
B_H_CTA = 64
B_TOPK = 64
K_ROWS = B_TOPK // 2  # K rows gathered per CTA
DQ_N = 128  # dims per dQ tile (N), 64 per CTA
DKV_M = 256  # M of the block-diagonal dKV^T MMA (128 dims per CTA)
DKV_N = 128  # 64 tokens per CTA
KH_TILE_BYTES = K_ROWS * K_TILE * 2  # 4096: one [32 rows x 64] SW128 tile of sKh
KDQ_TILE_BYTES = B_TOPK * K_TILE * 2  # 8192: one [64 tokens x 64 dims] tile of sKdq

COL_S = 0
COL_DP = 32
COL_DQ = 64
S_COLS = 32

MATH_WARP0 = 0
DRAIN_WARP0 = 4
GATHER_WARP0 = 8
MMA_WARP = 12  # CTA 0: MMA issuer; CTA 1: relay
PUSH_WARP = 13
THREADS = 32 * (PUSH_WARP + 1)
WG_THREADS = 128
PAIR_THREADS = 2 * WG_THREADS

BAR_ROWS = 1  # math + drain of one CTA: lse2 / -delta' staged

MB_Q_LOCAL = 0
MB_Q_PEER = 1
MB_KVH_LOCAL = 2
MB_KVH_PEER = 3
MB_KVH_FREE = 4
MB_PUSH_DONE = 5
MB_KDQ_FULL = 6
MB_KDQ_PEER = 7
MB_KDQ_FREE = 8
MB_S_FULL = 9
MB_S_EMPTY = 10
MB_PDS_FULL = 11
MB_PDS_FREE = 12
MB_DKV_FULL = 13
MB_DKV_EMPTY = 14
MB_DQ_FULL = 15
N_MBAR = 16


@dataclass(frozen=True)
class BwdH128Plan:
    """Static resource plan of one configuration (pure Python; host tests check it)."""

    d_qk: int
    d_v: int
    n_k_tiles: int
    n_v_tiles: int
    dq_tile_dims: Tuple[int, ...]  # first dim of each 128-dim dQ tile
    dq_store_from: Tuple[int, ...]  # first stored dim offset within the tile (64: overlap)
    kdq_tiles: Tuple[Tuple[int, ...], Tuple[int, ...]]  # per rank: the 64-dim K tile of each sKdq slot
    chunk_dims: Tuple[int, ...]  # dKV^T chunks (as bwd.py)
    chunk_store_row: Tuple[int, ...]
    dq_cols: Tuple[int, ...]
    dkv_col: int
    kdq_tx_bytes: int  # bytes landing in one CTA's sKdq per block
    smem_regions: Tuple[Tuple[str, int], ...]  # (name, bytes), in struct order
    p_offset_in_kh: int  # byte offset of P inside sKh (1024-aligned)
    smem_bytes: int

    def tmem_regions(self) -> List[Tuple[str, int, int]]:
        """``(name, first column, end column)`` per CTA (every region spans all 128 lanes)."""
        regs = [("S", COL_S, COL_S + S_COLS), ("dP", COL_DP, COL_DP + S_COLS)]
        regs += [(f"dQ{j}", c, c + DQ_N // 2) for j, c in enumerate(self.dq_cols)]
        regs += [("dKV", self.dkv_col, self.dkv_col + DKV_N)]
        return regs


def bwd_h128_plan(d_qk: int, d_v: int = 512) -> BwdH128Plan:
    if d_qk not in (512, 576):
        raise ValueError(f"sm100 2-CTA backward supports d_qk 512 or 576, got {d_qk}")
    if d_v != 512:
        raise ValueError(f"sm100 2-CTA backward supports d_v 512, got {d_v}")
    n_k = d_qk // K_TILE
    n_dq = (d_qk + DQ_N - 1) // DQ_N
    dq_dims = tuple(min(j * DQ_N, d_qk - DQ_N) for j in range(n_dq))
    dq_store = tuple(j * DQ_N - dq_dims[j] for j in range(n_dq))
    kdq = tuple(tuple(dq_dims[j] // K_TILE + r for j in range(n_dq)) for r in range(2))
    n_chunks = (d_qk + D_CHUNK - 1) // D_CHUNK
    dims = tuple(min(c * D_CHUNK, d_qk - D_CHUNK) for c in range(n_chunks))
    store = tuple(c * D_CHUNK - dims[c] for c in range(n_chunks))
    dq_cols = tuple(COL_DQ + (DQ_N // 2) * j for j in range(n_dq))
    dkv_col = TMEM_COLUMNS - DKV_N
    regions = (
        ("sQ", B_H_CTA * d_qk * 2),
        ("sDO", B_H_CTA * d_v * 2),
        ("sKh", K_ROWS * d_qk * 2),
        ("sKdq", n_dq * KDQ_TILE_BYTES),
        ("sDS", B_H_CTA * B_TOPK * 2),
    )
    # P has no buffer of its own: it lives in the last 8 KB of sKh (see the module docstring)
    p_off = K_ROWS * d_qk * 2 - B_H_CTA * B_TOPK * 2
    smem = SMEM_HEADER_BYTES + sum(b for _, b in regions)
    if smem > SMEM_LIMIT:
        raise ValueError(f"smem {smem} > {SMEM_LIMIT}")
    return BwdH128Plan(d_qk, d_v, n_k, d_v // K_TILE, dq_dims, dq_store, kdq, dims, store, dq_cols, dkv_col,
                       n_dq * KDQ_TILE_BYTES, regions, p_off, smem)


# ---------------------------------------------------------------------------------------------
# DSMEM helpers
# ---------------------------------------------------------------------------------------------


@dsl_user_op
def mapa_shared(addr: Int32, rank: Int32, *, loc=None, ip=None) -> Int32:
    """The shared::cluster address of ``addr`` (a shared::cta address) in CTA ``rank``."""
    return Int32(llvm.inline_asm(
        cutlass.cutlass_dsl.T.i32(),
        [Int32(addr).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip)],
        "mapa.shared::cluster.u32 $0, $1, $2;",
        "=r,r,r",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


@dsl_user_op
def bulk_copy_s2cluster(dst: Int32, src: Int32, nbytes: Int32, mbar: Int32, *, loc=None, ip=None) -> None:
    """``cp.async.bulk`` local smem -> (possibly remote) cluster smem; ``complete_tx`` on ``mbar``
    (a shared::cluster address in the destination CTA)."""
    llvm.inline_asm(
        None,
        [Int32(x).ir_value(loc=loc, ip=ip) for x in (dst, src, nbytes, mbar)],
        "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def bulk_commit_and_wait_read(*, loc=None, ip=None) -> None:
    """Commit this thread's bulk copies and wait until their sources have been read."""
    dev._asm_void("cp.async.bulk.commit_group;\n\tcp.async.bulk.wait_group.read 0;", loc, ip)


@dsl_user_op
def opaque_zero(*, loc=None, ip=None) -> Int32:
    """0, invisible to the optimiser (keeps address math inside the loop that needs it)."""
    return Int32(llvm.inline_asm(cutlass.cutlass_dsl.T.i32(), [], "mov.u32 $0, 0;", "=r", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def mbarrier_arrive_expect_tx(mbar: Int32, nbytes: Int32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None,
        [Int32(mbar).ir_value(loc=loc, ip=ip), Int32(nbytes).ir_value(loc=loc, ip=ip)],
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;",
        "r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


class SparseMlaBwdSm100H128(SparseMlaBwdSm100):
    """2-CTA (cta_group::2) sm100 sparse backward, 128 heads per cluster.  Reuses the 1-CTA
    kernel's ``_delta_rows``."""

    delta_unroll = 1  # a rolled delta loop: this kernel's 128-register budget is tighter

    def __init__(self, d_qk: int, d_v: int = 512, has_topk_length: bool = False, has_dlse: bool = False,
                 attn_sum: bool = False, attn_sum_scaled: bool = False, deterministic: bool = False):
        if attn_sum or attn_sum_scaled:
            raise NotImplementedError("the 2-CTA sm100 backward does not implement attn_sum")
        super().__init__(d_qk, d_v, has_topk_length, has_dlse, False, False, deterministic)
        self.plan2 = bwd_h128_plan(d_qk, d_v)
        self.n_dq = len(self.plan2.dq_tile_dims)

    def _mma_s(self):
        return sm100_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32, tcgen05.CtaGroup.TWO,
            (B_H, B_TOPK))

    def _mma_dq(self):
        return sm100_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32, tcgen05.CtaGroup.TWO,
            (B_H, DQ_N))

    def _mma_dkv(self):
        return sm100_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.MN, OperandMajorMode.MN, Float32, tcgen05.CtaGroup.TWO,
            (DKV_M, DKV_N))

    def smem_layouts(self):
        """The per-CTA operand layouts (host-made, passed to the kernel; tests trace them)."""
        mma_s, mma_dq, mma_dkv = self._mma_s(), self._mma_dq(), self._mma_dkv()
        sQ = sm100_utils.make_smem_layout_a(mma_s, (B_H, B_TOPK, self.d_qk), BFloat16, 1)
        sDO = sm100_utils.make_smem_layout_a(mma_s, (B_H, B_TOPK, self.d_v), BFloat16, 1)
        sKh = sm100_utils.make_smem_layout_b(mma_s, (B_H, B_TOPK, self.d_qk), BFloat16, 1)
        sDSa = sm100_utils.make_smem_layout_a(mma_dq, (B_H, DQ_N, B_TOPK), BFloat16, 1)
        sKdq = sm100_utils.make_smem_layout_b(mma_dq, (B_H, DQ_N, B_TOPK), BFloat16, self.n_dq)
        sQt = sm100_utils.make_smem_layout_a(mma_dkv, (DKV_M, DKV_N, B_H_CTA), BFloat16, 1)
        sDSb = sm100_utils.make_smem_layout_b(mma_dkv, (DKV_M, DKV_N, B_H_CTA), BFloat16, 1)
        return sQ, sDO, sKh, sDSa, sKdq, sQt, sDSb

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKV: cute.Tensor, mDO: cute.Tensor, mO: cute.Tensor, mIdx: cute.Tensor,
                 mTopkLen: cute.Tensor, mLse2: cute.Tensor, mDeltaCorr: cute.Tensor, mDeltaOut: cute.Tensor,
                 mAsumScale: cute.Tensor, mDQ: cute.Tensor, mWs: cute.Tensor, mAsum: cute.Tensor,
                 scale_log2: Float32, sm_scale: Float32, stream):
        sQ_l, sDO_l, sKh_l, sDSa_l, sKdq_l, sQt_l, sDSb_l = self.smem_layouts()
        n_dq = self.n_dq

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, N_MBAR]
            tmem_holding: Int32
            sLse2: cute.struct.Align[cute.struct.MemRange[Float32, B_H_CTA], 16]
            sNegDelta: cute.struct.Align[cute.struct.MemRange[Float32, B_H_CTA], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, B_H_CTA * self.d_qk], 1024]
            sDO: cute.struct.Align[cute.struct.MemRange[BFloat16, B_H_CTA * self.d_v], 1024]
            sKh: cute.struct.Align[cute.struct.MemRange[BFloat16, K_ROWS * self.d_qk], 1024]
            sKdq: cute.struct.Align[cute.struct.MemRange[BFloat16, n_dq * B_TOPK * K_TILE], 1024]
            sDS: cute.struct.Align[cute.struct.MemRange[BFloat16, B_H_CTA * B_TOPK], 1024]

        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes <= self.plan2.smem_bytes <= SMEM_LIMIT, f"smem {self.smem_bytes}"
        assert cute.cosize(sQ_l) == B_H_CTA * self.d_qk and cute.cosize(sKh_l) == K_ROWS * self.d_qk
        assert cute.cosize(sKdq_l) == n_dq * B_TOPK * K_TILE

        s_q = mQ.shape[0]
        n_hgrp = mQ.shape[1] // B_H
        self.kernel(
            mQ, mKV, mDO, mO, mIdx, mTopkLen, mLse2, mDeltaCorr, mDeltaOut, mAsumScale, mDQ, mWs, mAsum,
            scale_log2, sm_scale, sQ_l, sDO_l, sKh_l, sDSa_l, sKdq_l, sQt_l, sDSb_l, SharedStorage, n_hgrp,
        ).launch(grid=[2 * s_q * n_hgrp, 1, 1], block=[THREADS, 1, 1], cluster=[2, 1, 1], smem=self.smem_bytes,
                 stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKV: cute.Tensor, mDO: cute.Tensor, mO: cute.Tensor, mIdx: cute.Tensor,
               mTopkLen: cute.Tensor, mLse2: cute.Tensor, mDeltaCorr: cute.Tensor, mDeltaOut: cute.Tensor,
               mAsumScale: cute.Tensor, mDQ: cute.Tensor, mWs: cute.Tensor, mAsum: cute.Tensor,
               scale_log2: Float32, sm_scale: Float32, sQ_l: cute.ComposedLayout, sDO_l: cute.ComposedLayout,
               sKh_l: cute.ComposedLayout, sDSa_l: cute.ComposedLayout, sKdq_l: cute.ComposedLayout,
               sQt_l: cute.ComposedLayout, sDSb_l: cute.ComposedLayout, SharedStorage: cutlass.Constexpr,
               n_hgrp: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster = bidx // 2
        h_grp = cluster % n_hgrp
        s_idx = cluster // n_hgrp
        h_blk = 2 * h_grp + rank  # the 64-head block (host workspace / row terms index)
        head0 = h_blk * B_H_CTA
        n_hblk = 2 * n_hgrp

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar = storage.mbar.data_ptr()
        tmem_holding = storage.tmem_holding.ptr
        sLse2 = storage.sLse2.get_tensor(cute.make_layout(B_H_CTA))
        sNegDelta = storage.sNegDelta.get_tensor(cute.make_layout(B_H_CTA))
        sQ = storage.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)
        sDO = storage.sDO.get_tensor(sDO_l.outer, swizzle=sDO_l.inner)
        sKh = storage.sKh.get_tensor(sKh_l.outer, swizzle=sKh_l.inner)
        sKdq = storage.sKdq.get_tensor(sKdq_l.outer, swizzle=sKdq_l.inner)
        sDSa = storage.sDS.get_tensor(sDSa_l.outer, swizzle=sDSa_l.inner)
        sDSb = storage.sDS.get_tensor(sDSb_l.outer, swizzle=sDSb_l.inner)
        p_ptr = storage.sKh.data_ptr() + self.plan2.p_offset_in_kh // 2
        sPb = cute.make_tensor(cute.recast_ptr(p_ptr, sDSb_l.inner, dtype=BFloat16), sDSb_l.outer)
        sQ_ptr = storage.sQ.data_ptr()
        sDO_ptr = storage.sDO.data_ptr()
        sQ_addr = dev.smem_addr_u32(storage.sQ.data_ptr())
        sDO_addr = dev.smem_addr_u32(storage.sDO.data_ptr())
        sKh_addr = dev.smem_addr_u32(storage.sKh.data_ptr())
        sKdq_addr = dev.smem_addr_u32(storage.sKdq.data_ptr())
        sP_addr = dev.smem_addr_u32(p_ptr)
        sDS_addr = dev.smem_addr_u32(storage.sDS.data_ptr())
        mbar_addr = dev.smem_addr_u32(mbar)

        if warp_idx == MMA_WARP:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar + MB_Q_LOCAL, WG_THREADS)
                cute.arch.mbarrier_init(mbar + MB_Q_PEER, 1)
                cute.arch.mbarrier_init(mbar + MB_KVH_LOCAL, WG_THREADS)
                cute.arch.mbarrier_init(mbar + MB_KVH_PEER, 1)
                cute.arch.mbarrier_init(mbar + MB_KVH_FREE, 1)
                cute.arch.mbarrier_init(mbar + MB_PUSH_DONE, 1)
                cute.arch.mbarrier_init(mbar + MB_KDQ_FULL, 1)
                cute.arch.mbarrier_init(mbar + MB_KDQ_PEER, 1)
                cute.arch.mbarrier_init(mbar + MB_KDQ_FREE, 1)
                cute.arch.mbarrier_init(mbar + MB_S_FULL, 1)
                cute.arch.mbarrier_init(mbar + MB_S_EMPTY, PAIR_THREADS)
                cute.arch.mbarrier_init(mbar + MB_PDS_FULL, PAIR_THREADS)
                cute.arch.mbarrier_init(mbar + MB_PDS_FREE, 1)
                cute.arch.mbarrier_init(mbar + MB_DKV_FULL, 1)
                cute.arch.mbarrier_init(mbar + MB_DKV_EMPTY, PAIR_THREADS)
                cute.arch.mbarrier_init(mbar + MB_DQ_FULL, 1)
        if warp_idx == MATH_WARP0:
            cute.arch.alloc_tmem(TMEM_COLUMNS, tmem_holding, is_two_cta=True)
            cute.arch.relinquish_tmem_alloc_permit(is_two_cta=True)
            dev.tcgen05_fence_before_thread_sync()
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()

        topk = mIdx.shape[1]
        topk_len = topk
        if const_expr(self.has_topk_length):
            topk_len = cutlass.max(cutlass.min(mTopkLen[s_idx], topk), 0)
        num_blocks = (topk_len + (B_TOPK - 1)) // B_TOPK

        if warp_idx >= GATHER_WARP0 and warp_idx < MMA_WARP:
            self.gather2(mQ, mKV, mDO, mIdx, s_idx, head0, rank, topk_len, num_blocks, sQ_addr, sDO_addr, sKh_addr,
                         mbar, tidx - 32 * GATHER_WARP0)
        elif warp_idx == MMA_WARP:
            if rank == 0:
                self.mma2(sQ, sDO, sKh, sDSa, sKdq, sDSb, sPb, sQ_ptr, sDO_ptr, sQt_l, tmem_holding, num_blocks, mbar)
            else:
                self.relay2(num_blocks, mbar)
        elif warp_idx == PUSH_WARP:
            self.push2(rank, num_blocks, sKh_addr, sKdq_addr, mbar, mbar_addr)
        elif warp_idx < DRAIN_WARP0:
            self.math2(mKV, mIdx, mLse2, mDQ, scale_log2, sm_scale, s_idx, head0, topk, topk_len, num_blocks,
                       sLse2, sNegDelta, sP_addr, sDS_addr, tmem_holding, mbar, tidx, warp_idx)
        else:
            self.drain2(mKV, mIdx, mDO, mO, mDeltaCorr, mDeltaOut, mWs, sm_scale, s_idx, h_blk, head0, n_hblk,
                        rank, topk, topk_len, num_blocks, sNegDelta, tmem_holding, mbar, tidx - 32 * DRAIN_WARP0,
                        warp_idx)

        # Nothing of the pair exits while the peer can still arrive on its barriers, copy into its
        # smem or read TMEM; then one warp per CTA frees the cta_group::2 allocation.
        dev.tcgen05_fence_before_thread_sync()
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if warp_idx == MATH_WARP0:
            dev.tcgen05_fence_after_thread_sync()
            tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_holding)
            cute.arch.dealloc_tmem(tmem_ptr, TMEM_COLUMNS, is_two_cta=True)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def gather2(self, mQ, mKV, mDO, mIdx, s_idx, head0, rank, topk_len, num_blocks, sQ_addr, sDO_addr, sKh_addr,
                mbar, ptid):
        if num_blocks > 0:
            row0 = Int64(s_idx) * mQ.shape[1] + Int64(head0)
            policy = dev.createpolicy_evict_first()
            copy_dense_rows(sQ_addr, dev.gmem_addr_i64(mQ.iterator) + row0 * (self.d_qk * 2), self.d_qk * 2,
                            B_H_CTA, self.n_k_tiles, ptid, policy)
            copy_dense_rows(sDO_addr, dev.gmem_addr_i64(mDO.iterator) + row0 * (self.d_v * 2), self.d_v * 2,
                            B_H_CTA, self.n_v_tiles, ptid, policy)
            cute.arch.cp_async_mbarrier_arrive_noinc(mbar + MB_Q_LOCAL)
        gather = KvGather(mKV, mIdx, s_idx, topk_len, ptid, self.d_qk, slots=1, rows=K_ROWS)
        for b in cutlass.range(num_blocks, unroll=1):
            gather.load_indices(2 * b + rank, 0)  # tokens 32 rank .. 32 rank + 31 of block b
            # sKh(b-1) is read by S/dP(b-1) (commit) and by this CTA's push copies (wait_group.read)
            cute.arch.mbarrier_wait(mbar + MB_KVH_FREE, (b & 1) ^ 1)
            cute.arch.mbarrier_wait(mbar + MB_PUSH_DONE, (b & 1) ^ 1)
            cute.arch.mbarrier_wait(mbar + MB_PDS_FREE, (b & 1) ^ 1)  # P(b-1) lives in sKh
            gather.copy_tiles(sKh_addr, 0, 0, self.n_k_tiles)
            cute.arch.cp_async_mbarrier_arrive_noinc(mbar + MB_KVH_LOCAL)

    @cute.jit
    def relay2(self, num_blocks, mbar):
        """CTA 1, warp 12: forward CTA 1's local completions to CTA 0's barriers."""
        if num_blocks > 0:
            cute.arch.mbarrier_wait(mbar + MB_Q_LOCAL, 0)
            cute.arch.fence_proxy("async.shared", space="cta")  # cp.async (generic) -> MMA (async proxy)
            with cute.arch.elect_one():
                arrive_cta0(mbar + MB_Q_PEER)
        for b in cutlass.range(num_blocks, unroll=1):
            cute.arch.mbarrier_wait(mbar + MB_KVH_LOCAL, b & 1)
            cute.arch.fence_proxy("async.shared", space="cta")
            with cute.arch.elect_one():
                arrive_cta0(mbar + MB_KVH_PEER)
            cute.arch.mbarrier_wait(mbar + MB_KDQ_FULL, b & 1)
            with cute.arch.elect_one():
                arrive_cta0(mbar + MB_KDQ_PEER)

    @cute.jit
    def push2(self, rank, num_blocks, sKh_addr, sKdq_addr, mbar, mbar_addr):
        """Warp 13: DSMEM copies of this CTA's 32 K rows into both CTAs' dQ operand tiles."""
        peer = 1 - rank
        kdq_bytes = Int32(self.plan2.kdq_tx_bytes)
        full_local = mbar_addr + MB_KDQ_FULL * 8
        for b in cutlass.range(num_blocks, unroll=1):
            cute.arch.mbarrier_wait(mbar + MB_KVH_LOCAL, b & 1)
            cute.arch.fence_proxy("async.shared", space="cta")  # cp.async writes -> bulk-copy reads
            # both CTAs' sKdq(b-1) are read by the one dQ MMA(b-1)
            cute.arch.mbarrier_wait(mbar + MB_KDQ_FREE, (b & 1) ^ 1)
            with cute.arch.elect_one():
                mbarrier_arrive_expect_tx(full_local, kdq_bytes)
                for dst_rank in cutlass.range_constexpr(2):
                    dr = Int32(rank)
                    if const_expr(dst_rank == 1):
                        dr = Int32(peer)
                    dst_base = mapa_shared(sKdq_addr + rank * KH_TILE_BYTES, dr)
                    dst_mbar = mapa_shared(full_local, dr)
                    for j in cutlass.range_constexpr(self.n_dq):
                        # the K tile the destination CTA feeds to dQ tile j
                        tile = self.plan2.kdq_tiles[0][j] + dr
                        bulk_copy_s2cluster(dst_base + j * KDQ_TILE_BYTES, sKh_addr + tile * KH_TILE_BYTES,
                                            Int32(KH_TILE_BYTES), dst_mbar)
                bulk_commit_and_wait_read()
                cute.arch.mbarrier_arrive(mbar + MB_PUSH_DONE)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def mma2(self, sQ, sDO, sKh, sDSa, sKdq, sDSb, sPb, sQ_ptr, sDO_ptr, sQt_l, tmem_holding, num_blocks, mbar):
        """CTA 0, warp 12: every MMA is cta_group::2; every commit is multicast to both CTAs."""
        dev.tcgen05_fence_after_thread_sync()
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_holding)
        mma_s0 = self._mma_s()
        mma_dq0 = self._mma_dq()
        mma_dkv0 = self._mma_dkv()
        s_layout = mma_s0.make_fragment_C(mma_s0.partition_shape_C((B_H, B_TOPK))).layout
        tS = cute.make_tensor(tmem_ptr + COL_S, s_layout)
        tDP = cute.make_tensor(tmem_ptr + COL_DP, s_layout)
        dq_layout = mma_dq0.make_fragment_C(mma_dq0.partition_shape_C((B_H, DQ_N))).layout
        dkv_layout = mma_dkv0.make_fragment_C(mma_dkv0.partition_shape_C((DKV_M, DKV_N))).layout
        acc_dkv = cute.make_tensor(tmem_ptr + self.plan2.dkv_col, dkv_layout)
        dkv_stage = make_pipeline_state(PipelineUserType.Producer, 1)
        mc = 0b11

        if num_blocks > 0:
            cute.arch.mbarrier_wait(mbar + MB_Q_LOCAL, 0)
            cute.arch.mbarrier_wait(mbar + MB_Q_PEER, 0)
        for b in cutlass.range(num_blocks, unroll=1):
            parity = b & 1
            # Operand descriptors are rebuilt per block from an opaque zero: hoisted out of the
            # loop, ~40 live 64-bit descriptors spill at 128 registers.
            z = opaque_zero()
            tCrQ = mma_s0.make_fragment_A(cute.make_tensor(sQ.iterator + z, sQ.layout))
            tCrDO = mma_s0.make_fragment_A(cute.make_tensor(sDO.iterator + z, sDO.layout))
            tCrK = mma_s0.make_fragment_B(cute.make_tensor(sKh.iterator + z, sKh.layout))
            tCrDS = mma_dq0.make_fragment_A(cute.make_tensor(sDSa.iterator + z, sDSa.layout))
            tCrKdq = mma_dq0.make_fragment_B(cute.make_tensor(sKdq.iterator + z, sKdq.layout))
            tCrDSb = mma_dkv0.make_fragment_B(cute.make_tensor(sDSb.iterator + z, sDSb.layout))
            tCrPb = mma_dkv0.make_fragment_B(cute.make_tensor(sPb.iterator + z, sPb.layout))
            # ---- S = Q K^T, dP = dO V^T (M128 x N64, 2-CTA) ----
            cute.arch.mbarrier_wait(mbar + MB_KVH_LOCAL, parity)
            cute.arch.mbarrier_wait(mbar + MB_KVH_PEER, parity)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.mbarrier_wait(mbar + MB_S_EMPTY, parity ^ 1)
            dev.tcgen05_fence_after_thread_sync()
            mma_s = self._mma_s()
            for k in cutlass.range_constexpr(self.d_qk // MMA_K):
                mma_s.set(tcgen05.Field.ACCUMULATE, k != 0)
                cute.gemm(mma_s, tS, tCrQ[None, None, k, 0], tCrK[None, None, k, 0], tS)
            for k in cutlass.range_constexpr(self.d_v // MMA_K):
                mma_s.set(tcgen05.Field.ACCUMULATE, k != 0)
                cute.gemm(mma_s, tDP, tCrDO[None, None, k, 0], tCrK[None, None, k, 0], tDP)
            with cute.arch.elect_one():
                tcgen05.commit(mbar + MB_KVH_FREE, mc, tcgen05.CtaGroup.TWO)
                tcgen05.commit(mbar + MB_S_FULL, mc, tcgen05.CtaGroup.TWO)
            # ---- dQ += dS K (M128 x N128 per tile, K = 64 tokens) ----
            cute.arch.mbarrier_wait(mbar + MB_PDS_FULL, parity)
            cute.arch.mbarrier_wait(mbar + MB_KDQ_FULL, parity)
            cute.arch.mbarrier_wait(mbar + MB_KDQ_PEER, parity)
            dev.tcgen05_fence_after_thread_sync()
            mma_dq = self._mma_dq()
            for j in cutlass.range_constexpr(self.n_dq):
                acc = cute.make_tensor(tmem_ptr + self.plan2.dq_cols[j], dq_layout)
                for kk in cutlass.range_constexpr(B_TOPK // MMA_K):
                    mma_dq.set(tcgen05.Field.ACCUMULATE, (b > 0) | (kk != 0))
                    cute.gemm(mma_dq, acc, tCrDS[None, None, kk, 0], tCrKdq[None, None, kk, j], acc)
            with cute.arch.elect_one():
                tcgen05.commit(mbar + MB_KDQ_FREE, mc, tcgen05.CtaGroup.TWO)
            # ---- dKV^T (block-diagonal M256 x N128; CTA r keeps columns 64 r ..) ----
            mma_dkv = self._mma_dkv()
            # MN-major [128 dims x 64 heads] views of Q and dO per chunk (same opaque zero)
            sQt = []
            sDOt = []
            for c in cutlass.range_constexpr(len(self.plan2.chunk_dims)):
                off = (self.plan2.chunk_dims[c] // K_TILE) * (B_H_CTA * K_TILE) + z  # elements
                sQt.append(cute.make_tensor(cute.recast_ptr(sQ_ptr + off, sQt_l.inner, dtype=BFloat16),
                                            sQt_l.outer))
                if const_expr(self.plan2.chunk_dims[c] < self.d_v):
                    sDOt.append(cute.make_tensor(cute.recast_ptr(sDO_ptr + off, sQt_l.inner, dtype=BFloat16),
                                                 sQt_l.outer))
            for c in cutlass.range_constexpr(len(self.plan2.chunk_dims)):
                cute.arch.mbarrier_wait(mbar + MB_DKV_EMPTY, dkv_stage.phase)
                dev.tcgen05_fence_after_thread_sync()
                tA = mma_dkv.make_fragment_A(sQt[c])
                for kk in cutlass.range_constexpr(B_H_CTA // MMA_K):
                    mma_dkv.set(tcgen05.Field.ACCUMULATE, kk != 0)
                    cute.gemm(mma_dkv, acc_dkv, tA[None, None, kk, 0], tCrDSb[None, None, kk, 0], acc_dkv)
                if const_expr(self.plan2.chunk_dims[c] + self.plan2.chunk_store_row[c] < self.d_v):
                    tAo = mma_dkv.make_fragment_A(sDOt[c])
                    for kk in cutlass.range_constexpr(B_H_CTA // MMA_K):
                        mma_dkv.set(tcgen05.Field.ACCUMULATE, True)
                        cute.gemm(mma_dkv, acc_dkv, tAo[None, None, kk, 0], tCrPb[None, None, kk, 0], acc_dkv)
                with cute.arch.elect_one():
                    tcgen05.commit(mbar + MB_DKV_FULL, mc, tcgen05.CtaGroup.TWO)
                dkv_stage.advance()
            with cute.arch.elect_one():
                tcgen05.commit(mbar + MB_PDS_FREE, mc, tcgen05.CtaGroup.TWO)
        with cute.arch.elect_one():
            tcgen05.commit(mbar + MB_DQ_FULL, mc, tcgen05.CtaGroup.TWO)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def math2(self, mKV, mIdx, mLse2, mDQ, scale_log2, sm_scale, s_idx, head0, topk, topk_len, num_blocks, sLse2,
              sNegDelta, sP_addr, sDS_addr, tmem_holding, mbar, tidx, warp_idx):
        """Warps 0-3: thread t owns head t % 64, tokens 32 (t / 64) .. +31 of each block."""
        if tidx < B_H_CTA:
            sLse2[tidx] = mLse2[s_idx, head0 + tidx]
        cute.arch.barrier(barrier_id=BAR_ROWS, number_of_threads=2 * WG_THREADS)

        lane = tidx % 32
        row = tidx % B_H_CTA
        chalf = tidx // B_H_CTA
        s_kv = mKV.shape[0]
        dev.tcgen05_fence_after_thread_sync()
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_holding)
        mma_s = self._mma_s()
        s_layout = mma_s.make_fragment_C(mma_s.partition_shape_C((B_H, B_TOPK))).layout
        tS = cute.make_tensor(tmem_ptr + COL_S, s_layout)
        tDP = cute.make_tensor(tmem_ptr + COL_DP, s_layout)
        t2r = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), Float32),
                                     tS).get_slice(tidx)
        tSsrc = t2r.partition_S(tS)
        tDPsrc = t2r.partition_S(tDP)
        rS = cute.make_rmem_tensor(t2r.partition_D(tS).shape, Float32)
        rDP = cute.make_rmem_tensor(t2r.partition_D(tDP).shape, Float32)
        lse2 = sLse2[row]
        negd = sNegDelta[row]
        for b in cutlass.range(num_blocks, unroll=1):
            parity = b & 1
            slot = b * B_TOPK + 32 * chalf + lane
            idx = mIdx[s_idx, cutlass.min(slot, topk - 1)]
            valid = Uint32(cute.arch.vote_ballot_sync(dev.slot_valid(idx, slot, s_kv, topk_len)))
            cute.arch.mbarrier_wait(mbar + MB_S_FULL, parity)
            dev.tcgen05_fence_after_thread_sync()
            cute.copy(t2r, tSsrc, rS)
            cute.copy(t2r, tDPsrc, rDP)
            cute.arch.fence_view_async_tmem_load()
            dev.tcgen05_fence_before_thread_sync()
            arrive_cta0(mbar + MB_S_EMPTY)
            # both CTAs' P/dS of block b-1 are read by the dQ / dKV^T MMAs of b-1
            cute.arch.mbarrier_wait(mbar + MB_PDS_FREE, parity ^ 1)
            # P lives in sKh's last 8 KB: this CTA's push copies of sKh(b) must have read it
            cute.arch.mbarrier_wait(mbar + MB_PUSH_DONE, parity)
            for q in cutlass.range_constexpr(S_COLS // 8):
                for i in cutlass.range_constexpr(8):
                    j = 8 * q + i
                    bit = (valid >> Uint32(j)) & Uint32(1)
                    p = cute.math.exp2(rS[j] * scale_log2 - lse2, fastmath=True)
                    p = Float32(cutlass.select_(bit != Uint32(0), p, Float32(0.0)))
                    rS[j] = p
                    rDP[j] = p * (rDP[j] * sm_scale + negd)
                chunk = (4 * chalf + q) ^ (row % 8)
                w = [dev.pack_bf16x2(rS[8 * q + 2 * e], rS[8 * q + 2 * e + 1]) for e in range(4)]
                dev.st_shared_v4_b32(sP_addr + row * 128 + chunk * 16, w[0], w[1], w[2], w[3])
                w = [dev.pack_bf16x2(rDP[8 * q + 2 * e], rDP[8 * q + 2 * e + 1]) for e in range(4)]
                dev.st_shared_v4_b32(sDS_addr + row * 128 + chunk * 16, w[0], w[1], w[2], w[3])
            cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> MMA reads
            arrive_cta0(mbar + MB_PDS_FULL)

        # ---- dQ epilogue: thread t holds head t % 64, dims 64 (t / 64) .. +63 of each tile ----
        # 32x32b: thread t reads TMEM lane t (head t % 64; dims 64 (t / 64) + column of the tile)
        dq_layout = cute.make_layout(((D_CHUNK, S_COLS), 1, 1), stride=((65536, 1), 0, 0))
        tDQ0 = cute.make_tensor(tmem_ptr + COL_DQ, dq_layout)
        t2r_dq = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), Float32),
                                        tDQ0).get_slice(tidx)
        rDQ = cute.make_rmem_tensor(t2r_dq.partition_D(tDQ0).shape, Float32)
        has_rows = num_blocks > 0
        cute.arch.mbarrier_wait(mbar + MB_DQ_FULL, 0)
        dev.tcgen05_fence_after_thread_sync()
        dq_row = dev.gmem_addr_i64(mDQ.iterator) + (Int64(s_idx) * mDQ.shape[1] + Int64(head0 + row)) * (self.d_qk * 2)
        for j in cutlass.range_constexpr(self.n_dq):
            tDQ = cute.make_tensor(tmem_ptr + self.plan2.dq_cols[j], dq_layout)
            cute.copy(t2r_dq, t2r_dq.partition_S(tDQ), rDQ)
            cute.arch.fence_view_async_tmem_load()
            dim0 = self.plan2.dq_tile_dims[j] + (DQ_N // 2) * chalf
            if (DQ_N // 2) * chalf >= self.plan2.dq_store_from[j]:
                for v in cutlass.range_constexpr(S_COLS // 8):
                    w = []
                    for e in cutlass.range_constexpr(4):
                        i = 8 * v + 2 * e
                        lo = Float32(cutlass.select_(has_rows, rDQ[i], Float32(0.0)))
                        hi = Float32(cutlass.select_(has_rows, rDQ[i + 1], Float32(0.0)))
                        w.append(dev.pack_bf16x2(lo, hi))
                    dev.st_global_v4_b32(dq_row + Int64((dim0 + 8 * v) * 2), w[0], w[1], w[2], w[3])
            # the second 32 columns of this thread's 64
            tDQ2 = cute.make_tensor(tmem_ptr + self.plan2.dq_cols[j] + S_COLS, dq_layout)
            cute.copy(t2r_dq, t2r_dq.partition_S(tDQ2), rDQ)
            cute.arch.fence_view_async_tmem_load()
            if (DQ_N // 2) * chalf >= self.plan2.dq_store_from[j]:
                for v in cutlass.range_constexpr(S_COLS // 8):
                    w = []
                    for e in cutlass.range_constexpr(4):
                        i = 8 * v + 2 * e
                        lo = Float32(cutlass.select_(has_rows, rDQ[i], Float32(0.0)))
                        hi = Float32(cutlass.select_(has_rows, rDQ[i + 1], Float32(0.0)))
                        w.append(dev.pack_bf16x2(lo, hi))
                    dev.st_global_v4_b32(dq_row + Int64((dim0 + S_COLS + 8 * v) * 2), w[0], w[1], w[2], w[3])

    @cute.jit
    def drain2(self, mKV, mIdx, mDO, mO, mDeltaCorr, mDeltaOut, mWs, sm_scale, s_idx, h_blk, head0, n_hblk, rank,
               topk, topk_len, num_blocks, sNegDelta, tmem_holding, mbar, dtid, warp_idx):
        self._delta_rows(mO, mDO, mDeltaCorr, mDeltaOut, sNegDelta, sm_scale, s_idx, head0, dtid)
        cute.arch.barrier(barrier_id=BAR_ROWS, number_of_threads=2 * WG_THREADS)

        dev.tcgen05_fence_after_thread_sync()
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_holding)
        halves = 2  # 32 tokens per TMEM load: 64 loaded floats + the 16 rows spill at 128 registers
        cols = B_TOPK // halves
        half_layout = cute.make_layout(((D_CHUNK, cols), 1, 1), stride=((65536, 1), 0, 0))
        tKV0 = cute.make_tensor(tmem_ptr + self.plan2.dkv_col, half_layout)
        ld32 = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(cols)), Float32)
        t2r = tcgen05.make_tmem_copy(ld32, tKV0).get_slice(dtid)
        rKV = cute.make_rmem_tensor(t2r.partition_D(tKV0).shape, Float32)
        lane = dtid % 32
        wq = warp_idx - DRAIN_WARP0
        q = lane % 4
        s_kv = mKV.shape[0]
        col_bytes = (32 * wq + 4 * (lane // 4)) * 4
        ws_base = dev.gmem_addr_i64(mWs.iterator) + Int64(col_bytes)
        row_bytes = self.d_qk * 4
        policy = dev.createpolicy_evict_last()
        rows = cute.make_rmem_tensor((B_TOPK // 4,), Int32)
        own_col = self.plan2.dkv_col + B_TOPK * rank  # this CTA's half of the block-diagonal product
        stage = make_pipeline_state(PipelineUserType.Consumer, 1)
        for b in cutlass.range(num_blocks, unroll=1):
            okmask = Uint32(0)
            for g in cutlass.range_constexpr(B_TOPK // 4):
                slot = b * B_TOPK + 4 * g + q
                idx = mIdx[s_idx, cutlass.min(slot, topk - 1)]
                ok = dev.slot_valid(idx, slot, s_kv, topk_len)
                if const_expr(self.deterministic):
                    okmask = okmask | (Uint32(cutlass.select_(ok, Uint32(1), Uint32(0))) << Uint32(g))
                else:
                    rows[g] = Int32(cutlass.select_(ok, idx, Int32(-1)))
            det_row0 = (s_idx * n_hblk + h_blk) * topk + b * B_TOPK + q
            for c in cutlass.range_constexpr(len(self.plan2.chunk_dims)):
                cute.arch.mbarrier_wait(mbar + MB_DKV_FULL, stage.phase)
                dev.tcgen05_fence_after_thread_sync()
                for hf in cutlass.range_constexpr(halves):
                    src = cute.make_tensor(tmem_ptr + own_col + hf * cols, half_layout)
                    cute.copy(t2r, t2r.partition_S(src), rKV)
                    cute.arch.fence_view_async_tmem_load()
                    if const_expr(hf == halves - 1):
                        dev.tcgen05_fence_before_thread_sync()
                        arrive_cta0(mbar + MB_DKV_EMPTY)
                    for g0 in cutlass.range_constexpr(cols // 4):
                        transpose_quad(rKV, 4 * g0, q)
                    if 32 * wq >= self.plan2.chunk_store_row[c]:
                        chunk_off = Int64(self.plan2.chunk_dims[c] * 4)
                        for g0 in cutlass.range_constexpr(cols // 4):
                            g = hf * (cols // 4) + g0
                            v = (rKV[4 * g0], rKV[4 * g0 + 1], rKV[4 * g0 + 2], rKV[4 * g0 + 3])
                            if const_expr(self.deterministic):
                                if (okmask >> Uint32(g)) & Uint32(1) != Uint32(0):
                                    addr = ws_base + Int64(det_row0 + 4 * g) * Int64(row_bytes) + chunk_off
                                    dev.st_global_v4_f32(addr, v[0], v[1], v[2], v[3])
                            else:
                                if rows[g] >= 0:
                                    addr = ws_base + Int64(rows[g]) * Int64(row_bytes) + chunk_off
                                    dev.red_add_v4_f32_hint(addr, v[0], v[1], v[2], v[3], policy)
                stage.advance()
