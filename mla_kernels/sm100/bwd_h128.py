"""Sparse MLA backward on Blackwell (sm_100a / sm_103a): 128 heads per 2-CTA cluster (cta_group::2).

Same op, kernel arguments (and argument order) and host driver (``common/bwd_host.run_bwd``) as
the 1-CTA kernel ``bwd.py``; dispatched for h_q % 128 == 0 (``sm100.bwd_two_cta``).  One cluster
of two CTAs per (query token, 128-head group); CTA ``r`` owns heads ``64 r .. 64 r + 63`` and
keeps its own Q (64 x d_qk) and dO (64 x 512) stationary in smem.  Per block of ``B_TOPK = 64``
indices (``c = sm_scale log2 e``); CTA ``r`` "owns" tokens ``32 r .. 32 r + 31`` of the block:

* ``S = Q K^T``, ``dP = dO V^T``: ``cta_group::2``, M = 128 heads (A: each CTA's own Q / dO), N = 64
  tokens (B split by N: CTA ``r`` gathers its 32 tokens, all d_qk columns, into ``sKh``).  The
  M128 2-CTA accumulator puts head ``i`` of this CTA in TMEM lane ``i`` for tokens 0..31 and lane
  ``64 + i`` for tokens 32..63; thread ``t`` of the math warps owns head ``t % 64``, tokens
  ``32 (t / 64) .. +31``.
* ``P = exp2(S c - lse2)`` (0 on invalid slots), ``dS = P (dP sm_scale - delta' sm_scale)``.  The
  math warps store dS as bf16 ``[64 heads x 64 tokens]`` (dQ's A, ``sDS``), and P and dS again as
  *quadrants* ``[64 heads x 32 tokens]`` (one 64-byte swizzled row per head) for dKV: the
  quadrant of this CTA's own tokens goes to ``sPY/sDSY`` at head offset ``64 r`` (global head
  order); the quadrant of the peer's tokens goes to a staging pair ``sPX/sDSX`` that one thread
  copies with ``cp.async.bulk.shared::cluster`` into the peer's ``sPY/sDSY`` (same head offset,
  ``complete_tx`` on the peer's ``PX_FULL``).  After the exchange, each CTA holds P and dS of all
  128 heads for its own 32 tokens -- the B operand of a pair-summed dKV^T.
* attn_sum (optional): each math thread scales its 32 P values (fp32) by its head's
  ``exp(lse' - lse)``, a 32-lane reduce-scatter sums a warp's 32 heads, the two warps of a token
  half add through smem and write this CTA's 64-head partial ``[s, h_blk, slot]`` (the host sums
  the head blocks, as for the 1-CTA kernel).
* ``dQ = dS K``: ``cta_group::2``, M = 128 heads (A = each CTA's ``sDS``), N = 128 dims per tile,
  K = 64 tokens; B split by N: CTA ``r`` supplies dims ``128 j + 64 r .. +63`` of all 64 tokens
  (d_qk 576: a fifth tile, dims 448..575, whose first 64 dims are not stored).  After S/dP the
  gather warps *regather* those K tiles (``[64 tokens x 64 dims]`` each, 40 KB for d576) from
  global memory into ``sKh`` (which is sized for both uses); dQ stays in TMEM and is written once.
* ``dKV^T += Q^T dS + dO^T P``, pair-summed: ``cta_group::2``, M = 256 dims per round (CTA ``r``:
  dims ``D_j + 128 r .. +127``), N = 64 tokens (B split by N: CTA ``r``'s quadrants = all 128
  heads x its 32 tokens), K = 128 heads in four 32-head steps.  The A operand (Q^T / dO^T of all
  128 heads for this CTA's 128 dims) streams through a two-stage ring (8 KB per stage: two
  ``[32 heads x 64 dims]`` SW128 tiles) that a loader warp fills from global memory (L2) with
  cp.async.  Rounds: d_qk 576 -> ``D = 0, 256, 320`` (the last round is Q^T dS only; CTA 0's dims
  320..447 and CTA 1's 448..511 repeat earlier rounds and are not stored), d_qk 512 -> ``0, 256``.
  Each CTA drains its 128 dims x 64 tokens (two TMEM buffers) with 16-byte float atomics
  (``red.global.add.v4.f32``): the two head blocks are summed *before* the scatter, so the
  workspace traffic is half that of two 1-CTA head blocks.  The deterministic variant stores the
  same vectors to the slot's private workspace row, one row per (token, 128-head group, slot)
  (the two CTAs write disjoint columns); ``bwd_host`` reduces them in a fixed order.

TMEM (512 columns, allocated with cta_group::2): S 0..31 | dP 32..63 | dQ tile j at 64 + 64 j |
dKV^T buffers at 384 and 448 (64 columns each).  See :func:`bwd_h128_plan` (checked by tests).

smem per CTA (d_qk 576): header 2,048 + Q 73,728 + dO 65,536 + sKh 40,960 + ring 16,384 + sDS
8,192 + sPY 8,192 + sDSY 8,192 + sPX 4,096 + sDSX 4,096 = 231,424 <= 232,448.

Warps (448 threads): 0-3 math (P, dS, attn_sum, exchange copies, dQ epilogue; warp 0 allocates
TMEM); 4-7 drain (delta, then the dKV scatter); 8-11 gather (Q, dO once; per block the CTA's 32 K
rows, then the dQ K tiles); 12 -- CTA 0: MMA issuer, CTA 1: relay (forwards CTA 1's local
completions to CTA 0's barriers: cp.async and complete_tx can only complete a local mbarrier);
13 ring loader (Q^T / dO^T).

Barrier protocol (``MB_*``; "mc" = ``tcgen05.commit.cta_group::2`` multicast to both CTAs; "->0" =
remote arrival on CTA 0's barrier, release at cluster scope; "relay" = CTA 1's warp 12 waits its
local barrier and arrives on CTA 0's ``*_PEER``).  One phase per block unless noted:

* ``Q_LOCAL`` (128 noinc, once) -> MMA / relay -> ``Q_PEER``.
* ``KVH_LOCAL`` (128 noinc: own 32 K rows in sKh) -> MMA / relay -> ``KVH_PEER``.
* ``KVH_FREE`` (mc after S/dP(b)) -> gather: regather dQ's K tiles into sKh.
* ``KDQ_LOCAL`` (128 noinc) -> MMA / relay -> ``KDQ_PEER``; ``KDQ_FREE`` (mc after dQ(b)) ->
  gather of block b+1's own K rows.
* ``S_FULL`` (mc) -> math; ``S_EMPTY`` (256 ->0 after the math warps' TMEM loads) -> MMA.
* ``PDS_FULL`` (256 ->0 after the local P/dS stores + ``fence.proxy.async``) -> MMA (dQ, dKV);
  ``PDS_FREE`` (mc after the block's last dKV^T MMA) -> math before P/dS(b+1) (so both CTAs'
  sDS, quadrants and staging are free, and the exchange copies of block b have landed).
* ``PX_FULL`` (local: one ``arrive.expect_tx(8192)`` by math thread 0 after ``PDS_FREE(b-1)``;
  the bytes come from the peer's two bulk copies) -> MMA / relay -> ``PX_PEER``.  The peer's
  bytes of block b+1 cannot land before phase b completed: it copies only after its
  ``PDS_FREE(b)``, which follows the dKV^T MMAs that waited ``PX_FULL(b)`` of both CTAs.
* ``RING_FULL[s]`` (32 noinc from the loader) -> MMA / relay -> ``RING_PEER[s]``; ``RING_EMPTY[s]``
  (mc after the MMAs reading stage s) -> loader.  The number of ring generations per block is a
  multiple of 4, so a generation's stage and phase depend only on its place in the block.
* ``DKV_FULL[i]`` (mc per round) -> drain; ``DKV_EMPTY[i]`` (256 ->0 after the drain's TMEM
  loads) -> MMA.
* ``DQ_FULL`` (mc after the last block) -> math epilogue.
* The pair ends with a cluster barrier before the cta_group::2 TMEM dealloc.

Named barriers (CTA-local; each ``bar.sync`` at one code address): ``BAR_ROWS`` (the drain warps
``bar.arrive`` once ``-delta'`` is in smem, the math warps ``bar.sync``), ``BAR_XCHG`` (the two
math warps that wrote the staging pair, each thread after its own ``fence.proxy.async``, before
one thread issues the bulk copies), ``BAR_ASUM`` (the four math warps, a full sync per block:
block b + 2's writes of a parity slot of ``sAsum`` follow block b + 1's sync, so block b's reads).

The relay handles its events in the order the MMA consumes them (KVH, KDQ, PX, ring generations
of block b), and each of those depends only on events earlier in that order, so it cannot
deadlock.

Registers: the loader's and the MMA warp's loops over the four 32-head steps are rolled
(``cutlass.range(..., unroll=1)``) with operands rebuilt per step from dynamic offsets: unrolled,
the CUDA 13 ptxas hoists every step's addresses / descriptors and spills (1,796 bytes; the CUDA
12 ptxas of the cu12 DSL wheel did not).  Both toolchains now report 0 spills (113-120 registers).

Unproven (no Blackwell GPU has run it): the barrier protocol, the proxy fences between cp.async /
generic stores and the tcgen05 reads, the bulk-copy exchange; the compile report (SASS), the
layout contracts and a CPU emulation of the pair decomposition are what tests check.  Known
costs: the ring re-reads Q^T/dO^T from L2 every block (20 x 8 KB per CTA per block for d576);
the d576 tail round computes 256 dims for 64 stored ones; dQ's K tiles are re-read from L2 after
S/dP (no smem is left to keep both K layouts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

from ..common import device as dev
from ..common.gather import KvGather, copy_dense_rows
from .bwd import D_CHUNK, K_TILE, MMA_K, SMEM_LIMIT, TMEM_COLUMNS, SparseMlaBwdSm100

B_H = 128  # heads per cluster (M of S / dP / dQ, K of dKV^T)
B_H_CTA = 64
B_TOPK = 64
K_ROWS = B_TOPK // 2  # K rows gathered per CTA (its own tokens)
DQ_N = 128  # dims per dQ tile (N), 64 per CTA
DKV_M = 256  # dims per dKV^T round (128 per CTA)
DKV_N = B_TOPK  # tokens (32 per CTA)
RING_K = 32  # heads per ring stage (K step of the dKV^T MMA)
RING_STAGES = 2
RING_STAGE_BYTES = (DKV_M // 2) * RING_K * 2  # 8192: two [32 heads x 64 dims] SW128 tiles
QUAD_BYTES = B_H_CTA * K_ROWS * 2  # 4096: one [64 heads x 32 tokens] quadrant (64-byte rows)
KDQ_TILE_BYTES = B_TOPK * K_TILE * 2  # 8192: one [64 tokens x 64 dims] tile of dQ's K operand
#: barriers, TMEM address, staged row terms (lse2, -delta', attn_sum scale) and the attn_sum
#: exchange, before the 1024-aligned operand buffers
SMEM_HEADER_BYTES = 2048

COL_S = 0
COL_DP = 32
COL_DQ = 64
S_COLS = 32
DKV_COLS = DKV_N  # per TMEM buffer

MATH_WARP0 = 0
DRAIN_WARP0 = 4
GATHER_WARP0 = 8
MMA_WARP = 12  # CTA 0: MMA issuer; CTA 1: relay
RING_WARP = 13
THREADS = 32 * (RING_WARP + 1)
WG_THREADS = 128
PAIR_THREADS = 2 * WG_THREADS

# Named barriers (0 is __syncthreads); every bar.sync of an id sits at one code address (the rule
# of docs/DSL_NOTES.md "Named barriers", checked on the SASS by tests/test_barrier_rule.py).
BAR_ROWS = 1  # drain arrives once -delta' is in smem; the math warps sync (and see their lse2 / asum scale)
BAR_XCHG = 2  # the two math warps whose tokens the peer owns: staging written
BAR_ASUM = 3  # the four math warps: attn_sum halves in smem

MB_Q_LOCAL = 0
MB_Q_PEER = 1
MB_KVH_LOCAL = 2
MB_KVH_PEER = 3
MB_KVH_FREE = 4
MB_KDQ_LOCAL = 5
MB_KDQ_PEER = 6
MB_KDQ_FREE = 7
MB_S_FULL = 8
MB_S_EMPTY = 9
MB_PDS_FULL = 10
MB_PDS_FREE = 11
MB_PX_FULL = 12
MB_PX_PEER = 13
MB_RING_FULL = 14  # + stage
MB_RING_PEER = 16  # + stage
MB_RING_EMPTY = 18  # + stage
MB_DKV_FULL = 20  # + buffer
MB_DKV_EMPTY = 22  # + buffer
MB_DQ_FULL = 24
N_MBAR = 25


@dataclass(frozen=True)
class BwdH128Plan:
    """Static resource plan of one configuration (pure Python; host tests check it)."""

    d_qk: int
    d_v: int
    n_k_tiles: int
    n_v_tiles: int
    dq_tile_dims: Tuple[int, ...]  # first dim of each 128-dim dQ tile
    dq_store_from: Tuple[int, ...]  # first stored dim offset within the tile (64: overlap)
    kdq_tiles: Tuple[Tuple[int, ...], Tuple[int, ...]]  # per rank: the 64-dim K tile of each dQ tile
    round_dims: Tuple[int, ...]  # first dim of each 256-dim dKV^T round (CTA r: + 128 r)
    round_store_row: Tuple[Tuple[int, ...], Tuple[int, ...]]  # per rank, per round: first stored row (128: none)
    round_has_do: Tuple[bool, ...]  # whether the round adds dO^T P (dims below d_v)
    ring_gens: Tuple[Tuple[int, int, int], ...]  # per block: (round, product 0=Q/dS 1=dO/P, 32-head step)
    dq_cols: Tuple[int, ...]
    dkv_cols: Tuple[int, ...]
    smem_regions: Tuple[Tuple[str, int], ...]  # (name, bytes), in struct order
    smem_bytes: int

    def tmem_regions(self) -> List[Tuple[str, int, int]]:
        """``(name, first column, end column)`` per CTA (every region spans all 128 lanes)."""
        regs = [("S", COL_S, COL_S + S_COLS), ("dP", COL_DP, COL_DP + S_COLS)]
        regs += [(f"dQ{j}", c, c + DQ_N // 2) for j, c in enumerate(self.dq_cols)]
        regs += [(f"dKV{i}", c, c + DKV_COLS) for i, c in enumerate(self.dkv_cols)]
        return regs

    def round_buffer(self, j: int) -> Tuple[int, int, int]:
        """``(TMEM buffer, uses of that buffer per block, this round's use index within the block)``
        of dKV^T round ``j`` (buffers alternate by round within a block)."""
        buf = j % 2
        uses = sum(1 for i in range(len(self.round_dims)) if i % 2 == buf)
        return buf, uses, j // 2


def bwd_h128_plan(d_qk: int, d_v: int = 512) -> BwdH128Plan:
    if d_qk not in (512, 576):
        raise ValueError(f"sm100 2-CTA backward supports d_qk 512 or 576, got {d_qk}")
    if d_v != 512:
        raise ValueError(f"sm100 2-CTA backward supports d_v 512, got {d_v}")
    n_dq = (d_qk + DQ_N - 1) // DQ_N
    dq_dims = tuple(min(j * DQ_N, d_qk - DQ_N) for j in range(n_dq))
    dq_store = tuple(j * DQ_N - dq_dims[j] for j in range(n_dq))
    kdq = tuple(tuple(dq_dims[j] // K_TILE + r for j in range(n_dq)) for r in range(2))
    n_rounds = (d_qk + DKV_M - 1) // DKV_M
    rdims = tuple(min(j * DKV_M, d_qk - DKV_M) for j in range(n_rounds))
    # CTA r's rows are dims rdims[j] + 128 r + row; rows below dim 256 j were stored by a previous round
    rstore = tuple(tuple(min(DKV_M // 2, max(0, j * DKV_M - rdims[j] - (DKV_M // 2) * r)) for j in range(n_rounds))
                   for r in range(2))
    has_do = tuple(rdims[j] == j * DKV_M and rdims[j] + DKV_M <= d_v for j in range(n_rounds))
    gens = tuple((j, prod, kc) for j in range(n_rounds) for prod in range(1 + int(has_do[j]))
                 for kc in range(B_H // RING_K))
    assert len(gens) % (2 * RING_STAGES) == 0, "ring stage/phase must be static within a block"
    dq_cols = tuple(COL_DQ + (DQ_N // 2) * j for j in range(n_dq))
    dkv_cols = (TMEM_COLUMNS - 2 * DKV_COLS, TMEM_COLUMNS - DKV_COLS)
    regions = (
        ("sQ", B_H_CTA * d_qk * 2),
        ("sDO", B_H_CTA * d_v * 2),
        ("sKh", max(K_ROWS * d_qk * 2, n_dq * KDQ_TILE_BYTES)),  # own K rows, then dQ's K tiles
        ("sRing", RING_STAGES * RING_STAGE_BYTES),
        ("sDS", B_H_CTA * B_TOPK * 2),
        ("sPY", 2 * QUAD_BYTES),
        ("sDSY", 2 * QUAD_BYTES),
        ("sPX", QUAD_BYTES),
        ("sDSX", QUAD_BYTES),
    )
    smem = SMEM_HEADER_BYTES + sum(b for _, b in regions)
    if smem > SMEM_LIMIT:
        raise ValueError(f"smem {smem} > {SMEM_LIMIT}")
    return BwdH128Plan(d_qk, d_v, d_qk // K_TILE, d_v // K_TILE, dq_dims, dq_store, kdq, rdims, rstore, has_do,
                       gens, dq_cols, dkv_cols, regions, smem)


def quad_offset(head: int, token: int) -> int:
    """Byte offset of (head, token) in a ``[heads x 32 tokens]`` quadrant buffer (64-byte rows,
    16-byte chunk ``c`` of row ``h`` at ``c ^ ((h >> 1) & 3)``: the MN-major SW64 layout of the
    dKV^T MMA's B operand)."""
    c = token // 8
    return head * 64 + ((c ^ ((head >> 1) & 3)) * 16) + (token % 8) * 2


class SparseMlaBwdSm100H128(SparseMlaBwdSm100):
    """2-CTA (cta_group::2) sm100 sparse backward, 128 heads per cluster.  Reuses the 1-CTA
    kernel's ``_delta_rows``, ``_drain_rows`` and ``_drain_scatter``."""

    delta_unroll = 1  # a rolled delta loop: this kernel's register budget is tighter
    #: heads per deterministic workspace row block (the host sizes the workspace with it)
    ws_row_heads = B_H

    def __init__(self, d_qk: int, d_v: int = 512, has_topk_length: bool = False, has_dlse: bool = False,
                 attn_sum: bool = False, attn_sum_scaled: bool = False, deterministic: bool = False):
        super().__init__(d_qk, d_v, has_topk_length, has_dlse, attn_sum, attn_sum_scaled, deterministic)
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
        sRing = sm100_utils.make_smem_layout_a(mma_dkv, (DKV_M, DKV_N, RING_K), BFloat16, RING_STAGES)
        sY = sm100_utils.make_smem_layout_b(mma_dkv, (DKV_M, DKV_N, B_H), BFloat16, 1)
        return sQ, sDO, sKh, sDSa, sKdq, sRing, sY

    def step_layouts(self):
        """One ring stage and one 32-head step of a quadrant pair (the rolled dKV^T loop's views;
        a step ``kc`` starts ``kc * 32 * 32`` elements into sPY / sDSY -- tests check both)."""
        mma_dkv = self._mma_dkv()
        return (sm100_utils.make_smem_layout_a(mma_dkv, (DKV_M, DKV_N, RING_K), BFloat16, 1),
                sm100_utils.make_smem_layout_b(mma_dkv, (DKV_M, DKV_N, RING_K), BFloat16, 1))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKV: cute.Tensor, mDO: cute.Tensor, mO: cute.Tensor, mIdx: cute.Tensor,
                 mTopkLen: cute.Tensor, mLse2: cute.Tensor, mDeltaCorr: cute.Tensor, mDeltaOut: cute.Tensor,
                 mAsumScale: cute.Tensor, mDQ: cute.Tensor, mWs: cute.Tensor, mAsum: cute.Tensor,
                 scale_log2: Float32, sm_scale: Float32, stream):
        sQ_l, sDO_l, sKh_l, sDSa_l, sKdq_l, sRing_l, sY_l = self.smem_layouts()
        sRing1_l, sYk_l = self.step_layouts()
        kh_elems = dict(self.plan2.smem_regions)["sKh"] // 2

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, N_MBAR]
            tmem_holding: Int32
            sLse2: cute.struct.Align[cute.struct.MemRange[Float32, B_H_CTA], 16]
            sNegDelta: cute.struct.Align[cute.struct.MemRange[Float32, B_H_CTA], 16]
            sAsc: cute.struct.Align[cute.struct.MemRange[Float32, B_H_CTA], 16]
            sAsum: cute.struct.Align[cute.struct.MemRange[Float32, 2 * B_TOPK], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, B_H_CTA * self.d_qk], 1024]
            sDO: cute.struct.Align[cute.struct.MemRange[BFloat16, B_H_CTA * self.d_v], 1024]
            sKh: cute.struct.Align[cute.struct.MemRange[BFloat16, kh_elems], 1024]
            sRing: cute.struct.Align[cute.struct.MemRange[BFloat16, RING_STAGES * RING_STAGE_BYTES // 2], 1024]
            sDS: cute.struct.Align[cute.struct.MemRange[BFloat16, B_H_CTA * B_TOPK], 1024]
            sPY: cute.struct.Align[cute.struct.MemRange[BFloat16, QUAD_BYTES], 1024]
            sDSY: cute.struct.Align[cute.struct.MemRange[BFloat16, QUAD_BYTES], 1024]
            sPX: cute.struct.Align[cute.struct.MemRange[BFloat16, QUAD_BYTES // 2], 1024]
            sDSX: cute.struct.Align[cute.struct.MemRange[BFloat16, QUAD_BYTES // 2], 1024]

        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes <= self.plan2.smem_bytes <= SMEM_LIMIT, f"smem {self.smem_bytes}"
        assert cute.cosize(sQ_l) == B_H_CTA * self.d_qk and cute.cosize(sKh_l) == K_ROWS * self.d_qk
        assert cute.cosize(sKdq_l) == self.n_dq * B_TOPK * K_TILE and cute.cosize(sKdq_l) <= kh_elems
        assert cute.cosize(sRing_l) * 2 == RING_STAGES * RING_STAGE_BYTES
        assert cute.cosize(sY_l) * 2 == 2 * QUAD_BYTES

        s_q = mQ.shape[0]
        n_hgrp = mQ.shape[1] // B_H
        self.kernel(
            mQ, mKV, mDO, mO, mIdx, mTopkLen, mLse2, mDeltaCorr, mDeltaOut, mAsumScale, mDQ, mWs, mAsum,
            scale_log2, sm_scale, sQ_l, sDO_l, sKh_l, sDSa_l, sKdq_l, sRing_l, sY_l, sRing1_l, sYk_l, SharedStorage,
            n_hgrp,
        ).launch(grid=[2 * s_q * n_hgrp, 1, 1], block=[THREADS, 1, 1], cluster=[2, 1, 1], smem=self.smem_bytes,
                 stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKV: cute.Tensor, mDO: cute.Tensor, mO: cute.Tensor, mIdx: cute.Tensor,
               mTopkLen: cute.Tensor, mLse2: cute.Tensor, mDeltaCorr: cute.Tensor, mDeltaOut: cute.Tensor,
               mAsumScale: cute.Tensor, mDQ: cute.Tensor, mWs: cute.Tensor, mAsum: cute.Tensor,
               scale_log2: Float32, sm_scale: Float32, sQ_l: cute.ComposedLayout, sDO_l: cute.ComposedLayout,
               sKh_l: cute.ComposedLayout, sDSa_l: cute.ComposedLayout, sKdq_l: cute.ComposedLayout,
               sRing_l: cute.ComposedLayout, sY_l: cute.ComposedLayout, sRing1_l: cute.ComposedLayout,
               sYk_l: cute.ComposedLayout, SharedStorage: cutlass.Constexpr, n_hgrp: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster = bidx // 2
        h_grp = cluster % n_hgrp
        s_idx = cluster // n_hgrp
        h_blk = 2 * h_grp + rank  # the 64-head block (row terms / attn_sum partial index)
        head0 = h_blk * B_H_CTA

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar = storage.mbar.data_ptr()
        tmem_holding = storage.tmem_holding.ptr
        sLse2 = storage.sLse2.get_tensor(cute.make_layout(B_H_CTA))
        sNegDelta = storage.sNegDelta.get_tensor(cute.make_layout(B_H_CTA))
        sAsc = storage.sAsc.get_tensor(cute.make_layout(B_H_CTA))
        sAsum = storage.sAsum.get_tensor(cute.make_layout(2 * B_TOPK))
        sQ = storage.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)
        sDO = storage.sDO.get_tensor(sDO_l.outer, swizzle=sDO_l.inner)
        sKh = storage.sKh.get_tensor(sKh_l.outer, swizzle=sKh_l.inner)
        sKdq = storage.sKh.get_tensor(sKdq_l.outer, swizzle=sKdq_l.inner)
        sRing = storage.sRing.get_tensor(sRing_l.outer, swizzle=sRing_l.inner)
        sDSa = storage.sDS.get_tensor(sDSa_l.outer, swizzle=sDSa_l.inner)
        sPY = storage.sPY.get_tensor(sY_l.outer, swizzle=sY_l.inner)
        sDSY = storage.sDSY.get_tensor(sY_l.outer, swizzle=sY_l.inner)
        sQ_addr = dev.smem_addr_u32(storage.sQ.data_ptr())
        sDO_addr = dev.smem_addr_u32(storage.sDO.data_ptr())
        sKh_addr = dev.smem_addr_u32(storage.sKh.data_ptr())
        sRing_addr = dev.smem_addr_u32(storage.sRing.data_ptr())
        sDS_addr = dev.smem_addr_u32(storage.sDS.data_ptr())
        sPY_addr = dev.smem_addr_u32(storage.sPY.data_ptr())
        sDSY_addr = dev.smem_addr_u32(storage.sDSY.data_ptr())
        sPX_addr = dev.smem_addr_u32(storage.sPX.data_ptr())
        sDSX_addr = dev.smem_addr_u32(storage.sDSX.data_ptr())
        mbar_addr = dev.smem_addr_u32(mbar)

        if warp_idx == MMA_WARP:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar + MB_Q_LOCAL, WG_THREADS)
                cute.arch.mbarrier_init(mbar + MB_Q_PEER, 1)
                cute.arch.mbarrier_init(mbar + MB_KVH_LOCAL, WG_THREADS)
                cute.arch.mbarrier_init(mbar + MB_KVH_PEER, 1)
                cute.arch.mbarrier_init(mbar + MB_KVH_FREE, 1)
                cute.arch.mbarrier_init(mbar + MB_KDQ_LOCAL, WG_THREADS)
                cute.arch.mbarrier_init(mbar + MB_KDQ_PEER, 1)
                cute.arch.mbarrier_init(mbar + MB_KDQ_FREE, 1)
                cute.arch.mbarrier_init(mbar + MB_S_FULL, 1)
                cute.arch.mbarrier_init(mbar + MB_S_EMPTY, PAIR_THREADS)
                cute.arch.mbarrier_init(mbar + MB_PDS_FULL, PAIR_THREADS)
                cute.arch.mbarrier_init(mbar + MB_PDS_FREE, 1)
                cute.arch.mbarrier_init(mbar + MB_PX_FULL, 1)
                cute.arch.mbarrier_init(mbar + MB_PX_PEER, 1)
                for s in cutlass.range_constexpr(RING_STAGES):
                    cute.arch.mbarrier_init(mbar + MB_RING_FULL + s, 32)
                    cute.arch.mbarrier_init(mbar + MB_RING_PEER + s, 1)
                    cute.arch.mbarrier_init(mbar + MB_RING_EMPTY + s, 1)
                for i in cutlass.range_constexpr(2):
                    cute.arch.mbarrier_init(mbar + MB_DKV_FULL + i, 1)
                    cute.arch.mbarrier_init(mbar + MB_DKV_EMPTY + i, PAIR_THREADS)
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
                # one ring stage / one 32-head step of the quadrants, for the rolled dKV^T loop
                sRing_one = storage.sRing.get_tensor(sRing1_l.outer, swizzle=sRing1_l.inner)
                sY_step = storage.sDSY.get_tensor(sYk_l.outer, swizzle=sYk_l.inner)
                self.mma2(sQ, sDO, sKh, sDSa, sKdq, sRing, sPY, sDSY, sRing_one, sY_step, tmem_holding, num_blocks,
                          mbar)
            else:
                self.relay2(num_blocks, mbar)
        elif warp_idx == RING_WARP:
            self.ring2(mQ, mDO, s_idx, h_grp, rank, num_blocks, sRing_addr, mbar, tidx % 32)
        elif warp_idx < DRAIN_WARP0:
            self.math2(mKV, mIdx, mLse2, mAsumScale, mDQ, mAsum, scale_log2, sm_scale, s_idx, h_blk, head0, rank,
                       topk, topk_len, num_blocks, sLse2, sNegDelta, sAsc, sAsum, sDS_addr, sPY_addr, sDSY_addr,
                       sPX_addr, sDSX_addr, tmem_holding, mbar, mbar_addr, tidx, warp_idx)
        else:
            self.drain2(mKV, mIdx, mDO, mO, mDeltaCorr, mDeltaOut, mWs, sm_scale, s_idx, h_grp, n_hgrp, head0,
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
        """Warps 8-11: Q, dO once; per block the CTA's 32 K rows (S/dP), then dQ's K tiles."""
        if num_blocks > 0:
            row0 = Int64(s_idx) * mQ.shape[1] + Int64(head0)
            policy = dev.createpolicy_evict_first()
            copy_dense_rows(sQ_addr, dev.gmem_addr_i64(mQ.iterator) + row0 * (self.d_qk * 2), self.d_qk * 2,
                            B_H_CTA, self.n_k_tiles, ptid, policy)
            copy_dense_rows(sDO_addr, dev.gmem_addr_i64(mDO.iterator) + row0 * (self.d_v * 2), self.d_v * 2,
                            B_H_CTA, self.n_v_tiles, ptid, policy)
            cute.arch.cp_async_mbarrier_arrive_noinc(mbar + MB_Q_LOCAL)
        own = KvGather(mKV, mIdx, s_idx, topk_len, ptid, self.d_qk, slots=1, rows=K_ROWS)
        full = KvGather(mKV, mIdx, s_idx, topk_len, ptid, self.d_qk, slots=1, rows=B_TOPK)
        for b in cutlass.range(num_blocks, unroll=1):
            parity = b & 1
            own.load_indices(2 * b + rank, 0)  # tokens 32 rank .. 32 rank + 31 of block b
            # sKh holds dQ(b-1)'s K tiles until that MMA is done
            cute.arch.mbarrier_wait(mbar + MB_KDQ_FREE, parity ^ 1)
            own.copy_tiles(sKh_addr, 0, 0, self.n_k_tiles)
            cute.arch.cp_async_mbarrier_arrive_noinc(mbar + MB_KVH_LOCAL)
            full.load_indices(b, 0)
            # ... and this block's own K rows until S/dP(b) are done
            cute.arch.mbarrier_wait(mbar + MB_KVH_FREE, parity)
            for j in cutlass.range_constexpr(self.n_dq):
                full.copy_tile(sKh_addr + j * KDQ_TILE_BYTES, 0, Int32(self.plan2.kdq_tiles[0][j]) + rank)
            cute.arch.cp_async_mbarrier_arrive_noinc(mbar + MB_KDQ_LOCAL)

    @cute.jit
    def ring2(self, mQ, mDO, s_idx, h_grp, rank, num_blocks, sRing_addr, mbar, lane):
        """Warp 13: per dKV^T step, Q^T or dO^T of 32 heads x this CTA's 128 dims into the ring."""
        policy = dev.createpolicy_evict_last()  # re-read by every block of this token
        h_q = mQ.shape[1]
        head_row0 = Int64(s_idx) * h_q + Int64(h_grp * B_H)
        q_base = dev.gmem_addr_i64(mQ.iterator) + head_row0 * (self.d_qk * 2)
        do_base = dev.gmem_addr_i64(mDO.iterator) + head_row0 * (self.d_v * 2)
        col0 = Int64(rank * (DKV_M // 2) * 2)  # this CTA's 128 dims of a round, in bytes
        n_kc = B_H // RING_K
        for b in cutlass.range(num_blocks, unroll=1):
            g0 = 0  # generations issued before this (round, product) within the block (static)
            for j in cutlass.range_constexpr(len(self.plan2.round_dims)):
                for prod in cutlass.range_constexpr(1 + int(self.plan2.round_has_do[j])):
                    # a rolled loop over the 32-head steps: unrolled, ptxas keeps every step's row
                    # addresses live and spills
                    for kc in cutlass.range(n_kc, unroll=1):
                        s = kc % RING_STAGES  # g0 is a multiple of 4 = 2 x RING_STAGES
                        ph = ((g0 // RING_STAGES) + kc // RING_STAGES) & 1
                        cute.arch.mbarrier_wait(mbar + MB_RING_EMPTY + s, ph ^ 1)
                        dim_bytes = Int64(self.plan2.round_dims[j] * 2) + col0
                        dst = sRing_addr + s * RING_STAGE_BYTES
                        if const_expr(prod == 0):
                            src = q_base + Int64(kc * RING_K) * Int64(self.d_qk * 2) + dim_bytes
                            copy_dense_rows(dst, src, self.d_qk * 2, RING_K, 2, lane, policy, n_threads=32)
                        else:
                            src = do_base + Int64(kc * RING_K) * Int64(self.d_v * 2) + dim_bytes
                            copy_dense_rows(dst, src, self.d_v * 2, RING_K, 2, lane, policy, n_threads=32)
                        cute.arch.cp_async_mbarrier_arrive_noinc(mbar + MB_RING_FULL + s)
                    g0 += n_kc

    @cute.jit
    def relay2(self, num_blocks, mbar):
        """CTA 1, warp 12: forward CTA 1's local completions to CTA 0's barriers, in the order the
        MMA warp consumes them."""
        if num_blocks > 0:
            cute.arch.mbarrier_wait(mbar + MB_Q_LOCAL, 0)
            cute.arch.fence_proxy("async.shared", space="cta")  # cp.async (generic) -> MMA (async proxy)
            with cute.arch.elect_one():
                dev.arrive_cta0(mbar + MB_Q_PEER)
        for b in cutlass.range(num_blocks, unroll=1):
            parity = b & 1
            cute.arch.mbarrier_wait(mbar + MB_KVH_LOCAL, parity)
            cute.arch.fence_proxy("async.shared", space="cta")
            with cute.arch.elect_one():
                dev.arrive_cta0(mbar + MB_KVH_PEER)
            cute.arch.mbarrier_wait(mbar + MB_KDQ_LOCAL, parity)
            cute.arch.fence_proxy("async.shared", space="cta")
            with cute.arch.elect_one():
                dev.arrive_cta0(mbar + MB_KDQ_PEER)
            cute.arch.mbarrier_wait(mbar + MB_PX_FULL, parity)
            with cute.arch.elect_one():
                dev.arrive_cta0(mbar + MB_PX_PEER)
            for g in cutlass.range_constexpr(len(self.plan2.ring_gens)):
                s = g % RING_STAGES
                cute.arch.mbarrier_wait(mbar + MB_RING_FULL + s, (g // RING_STAGES) & 1)
                cute.arch.fence_proxy("async.shared", space="cta")
                with cute.arch.elect_one():
                    dev.arrive_cta0(mbar + MB_RING_PEER + s)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def mma2(self, sQ, sDO, sKh, sDSa, sKdq, sRing, sPY, sDSY, sRing_one, sY_step, tmem_holding, num_blocks, mbar):
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
        mc = 0b11
        n_steps = RING_K // MMA_K

        if num_blocks > 0:
            cute.arch.mbarrier_wait(mbar + MB_Q_LOCAL, 0)
            cute.arch.mbarrier_wait(mbar + MB_Q_PEER, 0)
        for b in cutlass.range(num_blocks, unroll=1):
            parity = b & 1
            # Operand descriptors are rebuilt per block from an opaque zero: hoisted out of the
            # loop, the live 64-bit descriptors spill.
            z = dev.opaque_zero()
            tCrQ = mma_s0.make_fragment_A(cute.make_tensor(sQ.iterator + z, sQ.layout))
            tCrDO = mma_s0.make_fragment_A(cute.make_tensor(sDO.iterator + z, sDO.layout))
            tCrK = mma_s0.make_fragment_B(cute.make_tensor(sKh.iterator + z, sKh.layout))
            tCrDS = mma_dq0.make_fragment_A(cute.make_tensor(sDSa.iterator + z, sDSa.layout))
            tCrKdq = mma_dq0.make_fragment_B(cute.make_tensor(sKdq.iterator + z, sKdq.layout))
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
            cute.arch.mbarrier_wait(mbar + MB_KDQ_LOCAL, parity)
            cute.arch.mbarrier_wait(mbar + MB_KDQ_PEER, parity)
            cute.arch.fence_proxy("async.shared", space="cta")
            dev.tcgen05_fence_after_thread_sync()
            mma_dq = self._mma_dq()
            for j in cutlass.range_constexpr(self.n_dq):
                acc = cute.make_tensor(tmem_ptr + self.plan2.dq_cols[j], dq_layout)
                for kk in cutlass.range_constexpr(B_TOPK // MMA_K):
                    mma_dq.set(tcgen05.Field.ACCUMULATE, (b > 0) | (kk != 0))
                    cute.gemm(mma_dq, acc, tCrDS[None, None, kk, 0], tCrKdq[None, None, kk, j], acc)
            with cute.arch.elect_one():
                tcgen05.commit(mbar + MB_KDQ_FREE, mc, tcgen05.CtaGroup.TWO)
            # ---- dKV^T += Q^T dS + dO^T P (M256 x N64, K = 128 heads from the ring), pair-summed ----
            cute.arch.mbarrier_wait(mbar + MB_PX_FULL, parity)
            cute.arch.mbarrier_wait(mbar + MB_PX_PEER, parity)
            mma_dkv = self._mma_dkv()
            g0 = 0  # ring generations before this (round, product) within the block (static)
            for j in cutlass.range_constexpr(len(self.plan2.round_dims)):
                buf, uses, u = self.plan2.round_buffer(j)
                cute.arch.mbarrier_wait(mbar + MB_DKV_EMPTY + buf, ((uses * b + u) & 1) ^ 1)
                dev.tcgen05_fence_after_thread_sync()
                acc = cute.make_tensor(tmem_ptr + self.plan2.dkv_cols[buf], dkv_layout)
                for prod in cutlass.range_constexpr(1 + int(self.plan2.round_has_do[j])):
                    sB = sDSY if const_expr(prod == 0) else sPY
                    # a rolled loop over the 32-head steps, operands rebuilt per step from dynamic
                    # offsets: unrolled, ptxas hoists every step's descriptors and spills
                    for kc in cutlass.range(B_H // RING_K, unroll=1):
                        s = kc % RING_STAGES  # g0 is a multiple of 2 x RING_STAGES
                        ph = ((g0 // RING_STAGES) + kc // RING_STAGES) & 1
                        cute.arch.mbarrier_wait(mbar + MB_RING_FULL + s, ph)
                        cute.arch.mbarrier_wait(mbar + MB_RING_PEER + s, ph)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        dev.tcgen05_fence_after_thread_sync()
                        tA = mma_dkv0.make_fragment_A(cute.make_tensor(
                            sRing.iterator + s * (RING_STAGE_BYTES // 2), sRing_one.layout))
                        tB = mma_dkv0.make_fragment_B(cute.make_tensor(
                            sB.iterator + kc * (RING_K * DKV_N // 2), sY_step.layout))
                        for kk in cutlass.range_constexpr(n_steps):
                            mma_dkv.set(tcgen05.Field.ACCUMULATE, (prod + kc + kk) != 0)
                            cute.gemm(mma_dkv, acc, tA[None, None, kk, 0], tB[None, None, kk, 0], acc)
                        with cute.arch.elect_one():
                            tcgen05.commit(mbar + MB_RING_EMPTY + s, mc, tcgen05.CtaGroup.TWO)
                    g0 += B_H // RING_K
                with cute.arch.elect_one():
                    tcgen05.commit(mbar + MB_DKV_FULL + buf, mc, tcgen05.CtaGroup.TWO)
            with cute.arch.elect_one():
                tcgen05.commit(mbar + MB_PDS_FREE, mc, tcgen05.CtaGroup.TWO)
        with cute.arch.elect_one():
            tcgen05.commit(mbar + MB_DQ_FULL, mc, tcgen05.CtaGroup.TWO)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def math2(self, mKV, mIdx, mLse2, mAsumScale, mDQ, mAsum, scale_log2, sm_scale, s_idx, h_blk, head0, rank,
              topk, topk_len, num_blocks, sLse2, sNegDelta, sAsc, sAsum, sDS_addr, sPY_addr, sDSY_addr, sPX_addr,
              sDSX_addr, tmem_holding, mbar, mbar_addr, tidx, warp_idx):
        """Warps 0-3: thread t owns head t % 64, tokens 32 (t / 64) .. +31 of each block."""
        if tidx < B_H_CTA:
            sLse2[tidx] = mLse2[s_idx, head0 + tidx]
            if const_expr(self.attn_sum_scaled):
                sAsc[tidx] = mAsumScale[s_idx, head0 + tidx]
        # The drain warps arrive (their -delta' rows are stored); the math warps sync.
        cute.arch.barrier(barrier_id=BAR_ROWS, number_of_threads=2 * WG_THREADS)

        lane = tidx % 32
        row = tidx % B_H_CTA
        chalf = tidx // B_H_CTA  # token half: == rank -> this CTA's tokens, else the peer's
        s_kv = mKV.shape[0]
        peer = 1 - rank
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
        asc = Float32(1.0)
        if const_expr(self.attn_sum_scaled):
            asc = sAsc[row]
        mine = chalf == rank
        # this head's quadrant row: own tokens -> sPY/sDSY at head 64 rank + row (global head
        # order); the peer's tokens -> the staging pair, copied to the peer's sPY/sDSY
        qrow = row + B_H_CTA * rank
        p_row = Int32(cutlass.select_(mine, sPY_addr + qrow * 64, sPX_addr + row * 64))
        ds_row = Int32(cutlass.select_(mine, sDSY_addr + qrow * 64, sDSX_addr + row * 64))
        px_full = mbar_addr + MB_PX_FULL * 8
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
            dev.arrive_cta0(mbar + MB_S_EMPTY)
            # both CTAs' dQ / dKV^T MMAs of block b-1 are done: sDS, the quadrants and the
            # staging are free, and PX_FULL's phase b-1 has completed (its bytes were consumed)
            cute.arch.mbarrier_wait(mbar + MB_PDS_FREE, parity ^ 1)
            if tidx == 0:
                dev.mbarrier_arrive_expect_tx(px_full, Int32(2 * QUAD_BYTES))
            for q in cutlass.range_constexpr(S_COLS // 8):
                for i in cutlass.range_constexpr(8):
                    j = 8 * q + i
                    bit = (valid >> Uint32(j)) & Uint32(1)
                    p = cute.math.exp2(rS[j] * scale_log2 - lse2, fastmath=True)
                    p = Float32(cutlass.select_(bit != Uint32(0), p, Float32(0.0)))
                    rS[j] = p
                    rDP[j] = p * (rDP[j] * sm_scale + negd)
                # dQ's A: head row of 64 tokens, 128-byte swizzle
                chunk = (4 * chalf + q) ^ (row % 8)
                w = [dev.pack_bf16x2(rDP[8 * q + 2 * e], rDP[8 * q + 2 * e + 1]) for e in range(4)]
                dev.st_shared_v4_b32(sDS_addr + row * 128 + chunk * 16, w[0], w[1], w[2], w[3])
                # dKV^T's B: quadrant row of 32 tokens, 64-byte swizzle (see quad_offset)
                qchunk = (q ^ ((qrow >> 1) & 3)) * 16
                dev.st_shared_v4_b32(ds_row + qchunk, w[0], w[1], w[2], w[3])
                w = [dev.pack_bf16x2(rS[8 * q + 2 * e], rS[8 * q + 2 * e + 1]) for e in range(4)]
                dev.st_shared_v4_b32(p_row + qchunk, w[0], w[1], w[2], w[3])
            cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> MMA / bulk-copy reads
            dev.arrive_cta0(mbar + MB_PDS_FULL)
            if chalf != rank:
                # the peer's quadrant of this CTA's heads: two 4 KB bulk copies into its sPY/sDSY
                cute.arch.barrier(barrier_id=BAR_XCHG, number_of_threads=2 * 32)
                if row == 0:
                    dst_mbar = dev.mapa_shared(px_full, peer)
                    off = rank * QUAD_BYTES
                    dev.bulk_copy_s2cluster(dev.mapa_shared(sPY_addr + off, peer), sPX_addr, Int32(QUAD_BYTES), dst_mbar)
                    dev.bulk_copy_s2cluster(dev.mapa_shared(sDSY_addr + off, peer), sDSX_addr, Int32(QUAD_BYTES), dst_mbar)
                    dev.bulk_commit_and_wait_read()
            if const_expr(self.attn_sum):
                # sum over heads of P * exp(lse' - lse): lanes -> tokens, then the two warps of a half
                for j in cutlass.range_constexpr(S_COLS):
                    rS[j] = rS[j] * asc
                dev.warp_reduce_scatter_32(rS, lane)
                buf = (b & 1) * B_TOPK + 32 * chalf + lane
                if (warp_idx % 2) == 1:
                    sAsum[buf] = rS[0]
                cute.arch.barrier(barrier_id=BAR_ASUM, number_of_threads=WG_THREADS)
                if (warp_idx % 2) == 0:
                    mAsum[s_idx, h_blk, slot] = rS[0] + sAsum[buf]
        if const_expr(self.attn_sum):
            # slots of blocks past topk_length are never gathered: write their zeros
            n_tail = topk - num_blocks * B_TOPK
            for t in cutlass.range((n_tail + (WG_THREADS - 1) - tidx) // WG_THREADS, unroll=1):
                mAsum[s_idx, h_blk, num_blocks * B_TOPK + tidx + t * WG_THREADS] = Float32(0.0)

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
            for hf in cutlass.range_constexpr(2):  # the two 32-column halves of this thread's 64
                tDQ = cute.make_tensor(tmem_ptr + self.plan2.dq_cols[j] + hf * S_COLS, dq_layout)
                cute.copy(t2r_dq, t2r_dq.partition_S(tDQ), rDQ)
                cute.arch.fence_view_async_tmem_load()
                dim0 = self.plan2.dq_tile_dims[j] + (DQ_N // 2) * chalf + hf * S_COLS
                if (DQ_N // 2) * chalf >= self.plan2.dq_store_from[j]:
                    for v in cutlass.range_constexpr(S_COLS // 8):
                        w = []
                        for e in cutlass.range_constexpr(4):
                            i = 8 * v + 2 * e
                            lo = Float32(cutlass.select_(has_rows, rDQ[i], Float32(0.0)))
                            hi = Float32(cutlass.select_(has_rows, rDQ[i + 1], Float32(0.0)))
                            w.append(dev.pack_bf16x2(lo, hi))
                        dev.st_global_v4_b32(dq_row + Int64((dim0 + 8 * v) * 2), w[0], w[1], w[2], w[3])

    @cute.jit
    def drain2(self, mKV, mIdx, mDO, mO, mDeltaCorr, mDeltaOut, mWs, sm_scale, s_idx, h_grp, n_hgrp, head0, rank,
               topk, topk_len, num_blocks, sNegDelta, tmem_holding, mbar, dtid, warp_idx):
        """Warps 4-7: delta, then per round this CTA's 128 dims (TMEM lane = dim) x 64 tokens."""
        self._delta_rows(mO, mDO, mDeltaCorr, mDeltaOut, sNegDelta, sm_scale, s_idx, head0, dtid)
        # One-way: the drain needs nothing the math warps stage (a bar.sync here as well would be
        # one barrier synced from two code locations: synccheck's "divergent threads").
        cute.arch.barrier_arrive(barrier_id=BAR_ROWS, number_of_threads=2 * WG_THREADS)

        dev.tcgen05_fence_after_thread_sync()
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=tmem_holding)
        halves = 2  # 32 tokens per TMEM load: 64 loaded floats + the 16 rows do not fit the registers
        cols = B_TOPK // halves
        half_layout = cute.make_layout(((D_CHUNK, cols), 1, 1), stride=((65536, 1), 0, 0))
        tKV0 = cute.make_tensor(tmem_ptr + self.plan2.dkv_cols[0], half_layout)
        ld32 = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(cols)), Float32)
        t2r = tcgen05.make_tmem_copy(ld32, tKV0).get_slice(dtid)
        rKV = cute.make_rmem_tensor(t2r.partition_D(tKV0).shape, Float32)
        lane = dtid % 32
        wq = warp_idx - DRAIN_WARP0
        q = lane % 4
        s_kv = mKV.shape[0]
        col_bytes = (32 * wq + 4 * (lane // 4)) * 4 + rank * (DKV_M // 2) * 4  # this CTA's dims of a round
        ws_base = dev.gmem_addr_i64(mWs.iterator) + Int64(col_bytes)
        row_bytes = self.d_qk * 4
        policy = dev.createpolicy_evict_last()
        rows = cute.make_rmem_tensor((B_TOPK // 4,), Int32)
        for b in cutlass.range(num_blocks, unroll=1):
            okmask = self._drain_rows(mIdx, s_idx, b, q, topk, topk_len, s_kv, rows)
            # one private workspace row per (token, 128-head group, slot); the CTAs fill disjoint dims
            det_row0 = (s_idx * n_hgrp + h_grp) * topk + b * B_TOPK + q
            for j in cutlass.range_constexpr(len(self.plan2.round_dims)):
                buf, uses, u = self.plan2.round_buffer(j)
                cute.arch.mbarrier_wait(mbar + MB_DKV_FULL + buf, (uses * b + u) & 1)
                dev.tcgen05_fence_after_thread_sync()
                store_row = Int32(cutlass.select_(rank == 0, Int32(self.plan2.round_store_row[0][j]),
                                                  Int32(self.plan2.round_store_row[1][j])))
                for hf in cutlass.range_constexpr(halves):
                    src = cute.make_tensor(tmem_ptr + self.plan2.dkv_cols[buf] + hf * cols, half_layout)
                    cute.copy(t2r, t2r.partition_S(src), rKV)
                    cute.arch.fence_view_async_tmem_load()
                    if const_expr(hf == halves - 1):
                        dev.tcgen05_fence_before_thread_sync()
                        dev.arrive_cta0(mbar + MB_DKV_EMPTY + buf)
                    self._drain_scatter(rKV, hf, cols, q, 32 * wq >= store_row, Int64(self.plan2.round_dims[j] * 4),
                                        okmask, rows, det_row0, ws_base, row_bytes, policy)
