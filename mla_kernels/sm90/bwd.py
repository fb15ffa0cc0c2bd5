"""Sparse MLA backward on Hopper (sm_90a), CuTe DSL.

One CTA per (query token, 64-head block); 384 threads in three warpgroups.  Per top-k block of
64 indices (``K = V[:, :d_v]`` is the gathered KV tile, ``c = sm_scale * log2(e)``):

* WG2 -- producer (``setmaxnreg`` down).  Gathers the block's 64 KV rows with the forward's
  16-byte ``cp.async`` gather (:class:`~mla_kernels.common.gather.KvGather`; zero-fill for invalid
  slots) into one swizzled KV buffer, in two pieces (k-tiles ``0..3`` then ``4..``) with their
  own ready barriers so the consumers start on the first piece, and publishes each block's
  validity bitmask and per-row kv index (``-1`` if invalid) to smem.
* WG0 -- "scores": ``S = Q K^T`` (all ``d_qk/64`` k-tiles), ``P = exp2(S*c - lse2)`` with invalid
  slots zeroed (``lse2 = log2(e) * lse'``, the sink-adjusted lse, prepared on the host), P to smem
  as bf16; optionally the attention-distribution partial ``sum_h P * exp(lse' - lse)``.
* WG1 -- "gradients": first ``delta = rowsum(O * dO)`` for its 64 heads (straight from global
  memory, while the first KV block is gathered; written out for the host's d_attn_sink), then
  per block ``dP = dO V^T`` (the ``d_v/64`` V k-tiles) and, with P from smem,
  ``dS = P * (dP - delta') * sm_scale`` to smem as bf16 (``delta' = delta - dlse * exp(lse' - lse)``,
  the correction term from the host when the returned lse carries a gradient).

Then both consumer warpgroups:

* ``dQ += dS K`` -- the accumulator lives in registers for the whole kernel, split by columns:
  WG0 owns columns ``0..255`` (+ the RoPE columns ``512..575``), WG1 ``256..511``.  Written once
  at the end (stmatrix into Q's smem, one TMA store).
* ``dKV[idx] += dS^T Q (+ P^T dO on the first d_v columns)`` in 64-column chunks (M = 64 tokens,
  N = 64 columns, K = 64 heads; both operands MN-major views of the smem tiles), split between
  the two WGs by chunk.  Each chunk is scattered straight from the accumulator with 16-byte
  ``red.global.add.v4.f32`` atomics into a float32 ``[s_kv, d_qk]`` workspace; the host converts
  it to bf16.  The atomics are the kernel's bottleneck, and their cost is set by the number of
  L2 requests, so the fragment is first rearranged in registers (a quad shuffle makes 4-column
  vectors, an 8 x 8 lane transpose puts each warp instruction on two whole rows): every atomic
  instruction then covers 4 full 128-byte lines instead of 16 partial ones (-29% time).  The
  gathered KV rows carry an L2 evict_first hint, the workspace's atomics evict_normal (see
  ``ws_policy``).  In the deterministic variant the chunk is
  instead stored (no atomics) into a per-slot row of a ``[tokens * row_blocks * topk, d_qk]``
  workspace that the host reduces in a fixed order.
* **Pair sum** (h_q a multiple of 128): the two head-block CTAs of a token run as a 2-CTA cluster
  and add their dKV chunks on chip before anything leaves it: each CTA owns one 32-column half of
  every chunk, sends the other half to its peer (``st.async`` into the peer's landing area, 8 KB
  per warpgroup, completing bytes on the peer's mbarrier) and scatters its own half plus the
  peer's -- half the float32 atomic traffic (the bound at s_kv >= 32k; see :class:`_Exchange`).
  d_qk 576 has no free smem for the 16 KB landing area, so it borrows the KV buffer's last two
  k-tiles: the producer gathers them for the next block (piece C) only once the exchange drained,
  and S / dP wait for piece C last.

All four products are SS wgmma.  smem: Q (64 x d_qk), dO (64 x 512), one KV buffer, P and dS
(64 x 64 each): 229,376 bytes for d_qk = 576, which is why the KV buffer is single: its pieces are
released as soon as both dQ products are done, so the next block's gather overlaps the dKV phase.
d_qk 512 + pair sum adds a separate 16 KB landing area (230,400 bytes).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.cute.nvgpu.common import OperandMajorMode

from ..common import device as dev
from ..common.gather import KvGather
from .. import tma

B_H = 64  # heads per CTA
B_TOPK = 64  # indices per block
THREADS = 384
SMEM_LIMIT = 232448
K_MAJ = OperandMajorMode.K
MN_MAJ = OperandMajorMode.MN

# Named barrier ids (0 is __syncthreads).
BAR_P = 1  # WG0 stored P (WG0 arrives, WG1 waits)
BAR_DS = 2  # WG1 stored dS (WG1 arrives, WG0 waits)
BAR_DS_WG1 = 7  # WG1 only: all of dS stored before WG1's own products read it
BAR_DKV_DONE = 3  # WG1's dKV products finished reading P/dS (WG1 arrives, WG0 waits)
BAR_ASUM = 4  # WG0 only: attention-sum partials in smem
BAR_EPI = 5  # both: dQ epilogue, last readers of sQ done
BAR_EPI_STORED = 8  # both: dQ stored into sQ's tile (one id per sync site: docs/DSL_NOTES.md)
BAR_EPI_WG1 = 10  # one body per warpgroup: WG0 arrives, WG1 syncs (last readers of sQ done)
BAR_ASUM_READ = 9  # WG0 only: attention-sum partials read (the next block may overwrite them)
BAR_DELTA = 6  # WG1 only: delta rows in smem

# mbarriers (``SharedStorage.mbar``)
MB_IN, MB_KV_A, MB_KV_B, MB_KV_FREE, MB_META = 0, 1, 2, 3, 4
MB_KV_C = 5  # pair-summed d576: ready of the last two k-tiles (the exchange's landing area)
MB_DRAINED = 6  # pair-summed d576: both WGs consumed the block's last exchange (landing free)
MAX_SLOTS = 3  # landing slots per warpgroup at most (a ring of ``n_slots``: chunk k uses slot k % n_slots)
MB_LAND_FULL = 7  # + MAX_SLOTS * wg + slot: the peer's half-chunk landed (st.async complete_tx)
MB_SEND_OK = MB_LAND_FULL + 2 * MAX_SLOTS  # + MAX_SLOTS * wg + slot: the peer's slot is free (4 warp arrivals)
MB_START = MB_SEND_OK + 2 * MAX_SLOTS  # ``rotate_shift`` + pair sum: CTA rank 0's tick landed (rank 1)
N_MBAR = MB_START + 1
SLOT_BYTES = 128 * 16 * 2  # one WG's half chunk: 64 tokens x 32 columns of bf16
TILE_BYTES = 64 * 64 * 2  # one 64-column k-tile of the KV buffer

# ``trace`` (timing traces, tools/trace_bwd.py): cycle stamps per block and role into the attn_sum
# argument's rows (one row of TRACE_SLOTS int32 per CTA; the kernel is compiled without attn_sum)
TRACE_PER_BLOCK = 20  # event slots per block and role
TRACE_BLOCKS = 32  # blocks recorded per CTA
TRACE_BASE = (0, TRACE_PER_BLOCK * TRACE_BLOCKS, 2 * TRACE_PER_BLOCK * TRACE_BLOCKS)  # WG0, WG1, producer
# header slots after the three roles' events: WG0's clock at the start and at the end of the CTA's
# work, the block count, and each role's clock right after the CTA's first barrier (its arrival
# there: how far apart the roles start)
TRACE_START = 3 * TRACE_PER_BLOCK * TRACE_BLOCKS
TRACE_END = TRACE_START + 1
TRACE_NBLK = TRACE_START + 2
TRACE_ARRIVE = TRACE_START + 3  # + role (0 WG0, 1 WG1, 2 producer)
TRACE_SLOTS = TRACE_ARRIVE + 3


def pair_rank(h_blk):
    """With the pair sum: the CTA's rank in its 2-CTA cluster (the token's two head blocks)."""
    return h_blk % 2


class SparseMlaBwdSm90:
    """Static configuration + host launcher + device kernel of the sm90 sparse backward."""

    #: The float32 dKV workspace's column order within 16-column groups (see :class:`_Scatter`);
    #: ``common.bwd_host`` undoes it when it converts the workspace.
    ws_col_perm = None  # set below, once WS_COL_PERM is defined
    #: Deterministic mode: each (token, head block, slot) row is stored as bfloat16 (rounded once;
    #: the host's fixed-order sum is float32).  Half of the float32 rows' HBM traffic, which is
    #: what bounds that mode.
    det_ws_dtype = None  # torch.bfloat16, set by the backend (kernels do not import torch)

    def __init__(
        self,
        d_qk: int,
        d_v: int = 512,
        has_topk_length: bool = False,
        has_dlse: bool = False,
        attn_sum: bool = False,
        attn_sum_scaled: bool = False,
        deterministic: bool = False,
        pair_sum: bool = False,
        trace: bool = False,
        rotate_shift: int = 0,
        defer_scatter: bool = False,
    ):
        if d_qk not in (512, 576):
            raise ValueError(f"sm90 backward supports d_qk 512 or 576, got {d_qk}")
        if d_v != 512:
            raise ValueError(f"sm90 backward supports d_v 512, got {d_v}")
        self.d_qk = d_qk
        self.d_v = d_v
        self.has_topk_length = has_topk_length
        self.has_dlse = has_dlse  # delta' = delta - mDeltaCorr (the returned lse's gradient)
        self.attn_sum = attn_sum
        self.attn_sum_scaled = attn_sum_scaled  # attn_sum needs P * exp(lse' - lse) (a sink)
        self.deterministic = deterministic
        # h_q a multiple of 128: the two 64-head CTAs of a token (a 2-CTA cluster) add their dKV
        # chunks through DSMEM before one of them scatters each half: half the atomic traffic.
        self.pair_sum = pair_sum
        # timing traces (tools/trace_bwd.py): the attn_sum argument carries the stamps
        if trace and (attn_sum or deterministic):
            raise ValueError("trace takes the attn_sum argument as its buffer: not with attn_sum or deterministic")
        self.trace = trace
        # Block order (``rotate_shift`` > 0): each CTA (pair) starts its row's blocks at
        # ``(%globaltimer >> rotate_shift) % num_blocks`` and wraps around.  With the host's
        # band-ordered slots (block b of every row covers about the b-th 1/num_blocks of the kv
        # range) and a tick as long as one block takes, every CTA -- whenever it starts -- works on
        # the band the others are on, so the dKV atomics and the KV gathers of all SMs stay in a
        # few bands of rows that fit in L2.  Without it only the first wave starts aligned, and the
        # CTAs drift apart.  The tick must match the block time: 2^13 ns (8.2 us; the h128 blocks
        # take 7.2-7.9 us on an H200) gains 8% at s_kv 128k, 2^12 nothing, 2^14 a third of it
        # (docs/PERF.md).  dq's sum over the blocks then runs in a time-dependent order: not with
        # deterministic mode.
        if rotate_shift and deterministic:
            raise ValueError("rotate_shift: the block order must be fixed in deterministic mode")
        if not 0 <= rotate_shift <= 40:
            raise ValueError(f"rotate_shift must be in [0, 40], got {rotate_shift}")
        self.rotate_shift = rotate_shift
        # Which warpgroups' chunks go through the exchange (the others scatter whole chunks from
        # both CTAs).  Deterministic rows need every chunk summed (one row per pair and slot).
        self.ex_wgs = (pair_sum, pair_sum)
        assert not deterministic or self.ex_wgs == (pair_sum, pair_sum)
        self.ws_row_heads = 2 * B_H if pair_sum else B_H  # deterministic rows per (token, slot)
        self.n_k_tiles = d_qk // 64
        # d_qk 576 has no free smem for the landing areas (12 KB per WG): they borrow the KV
        # buffer's last three k-tiles (WG0: the RoPE tile, read by WG0 only, + the second half of
        # k-tile 6; WG1: k-tile 7 + the first half of k-tile 6), gathered for the next block only
        # after the exchange drained (piece C); d_qk 512 has a buffer of its own (2 x 8 KB: a third
        # slot does not fit).  Three slots let WG1 receive chunk c two chunks later (``ex_lag``).
        self.land_in_kv = pair_sum and d_qk > d_v
        assert self.ex_wgs == (pair_sum, pair_sum)
        self.n_slots = 3 if self.land_in_kv else 2
        self.n_land = 3 if self.land_in_kv else 0  # k-tiles lent to the landing areas
        self.n_v_tiles = d_v // 64
        self.n_left = 4  # first gather piece: k-tiles 0..3
        self.n_mid = self.n_k_tiles - self.n_land  # second piece: n_left..n_mid; piece C: the rest
        self.has_rope = d_qk > d_v
        # dKV column chunks (64 wide) per warpgroup, balancing S (WG0) against dP (WG1) and the
        # RoPE dQ columns (WG0): chunks < n_v_tiles cost two products, the RoPE chunk one.
        if self.has_rope:
            self.dkv_chunks = ((0, 1, 2, 8), (3, 4, 5, 6, 7))
        else:
            self.dkv_chunks = ((0, 1, 2, 3), (4, 5, 6, 7))
        # L2 policy: the gathered KV rows are marked evict_first (L2 is for the dKV workspace).
        # The workspace's atomics carried evict_last (+4% at h128/s_kv 32k, +7% at h64, measured
        # before the band order and the rotated block order); on top of those, evict_normal is
        # 1.4-1.6% faster at s_kv 128k and 1.1% at 64k, 0.5-1% at 8k / 32k, neutral at h_q 64 (H200,
        # docs/PERF.md): at 128k a workspace line gets about one add per pass over the bands, so
        # evict_last only holds lines that will not be touched again soon.  ``ws_policy``:
        # "normal", "last" (the old policy, for measurements) or None (no hint).  The two 64-head CTAs
        # of a token run as a 2-CTA cluster so that they are co-scheduled and their atomics to
        # the same rows meet in L2 (+2% at 32k, +9% at 64k).  Measured on the H200.
        self.gather_evict_first = True
        self.ws_policy = "normal"
        self.pair_cluster = True
        # Registers per thread after ``setmaxnreg``, per warpgroup (WG0, WG1) and for the producer:
        # the kernel launches with 168 x 384, i.e. 504 per (WG0, WG1, producer) triple.  The pair
        # sum keeps a chunk half (16 floats) live across the next chunk's products.
        regs = 232 if pair_sum else 224
        self.regs_wg = (regs, regs)
        self.regs_producer = 40 if pair_sum else 56
        # How many chunks later a WG receives, adds and scatters chunk c (the products of the
        # chunks in between run meanwhile; 16 live registers per chunk in flight).  0: chunk by
        # chunk.  Measured (H200, interleaved): WG1 at lag 1 is 17% faster than neither WG
        # pipelined; WG1 at lag 2 (d576: three slots) another 3-4%; WG0 (which also holds the
        # RoPE dQ accumulator) pipelined only in the send-first order below.  The CUDA 12 ptxas
        # spills 84 B at WG1's lag 2, so that build keeps lags (0, 1).
        deep = self.n_slots == 3 and cutlass.CUDA_VERSION.major >= 13
        self.ex_lag = (1, 2) if deep else (0, 1)
        # Per warpgroup: with a lag, send chunk c's peer half *before* receiving and scattering
        # chunk c - lag (the default order sends it after), so that the receive waits on a send
        # that is a whole chunk old while chunk c's own half waits in the accumulator.  WG0 at
        # lag 1 in the default order measured 0.99x (its receive right after the send waited
        # ~750 cycles, the DSMEM latency, on the chain); in this order WG0 is 0.96 / 0.97 / 0.98-0.99x
        # the time at s_kv 8k / 32k / 128k (H200, docs/PERF.md).  WG1 in this order: 1.02-1.03x, so
        # it keeps the default (its products overlap its scatters at lag 2).
        self.send_first = (True, False) if deep else (False, False)
        if deep and not deterministic:
            # WG0 at lag 2 keeps two chunk halves pending, 16 registers more than at lag 1: it
            # takes them from WG1 (224, where lag 2 still fits) and the producer (32).  H200,
            # interleaved (docs/PERF.md): the registers moved alone cost 1-2%, WG0 at lag 2 with
            # them gains 2-3%, together 0.98-1.00x the time of lag 1 at 232 / 232 / 40 (at 232
            # registers WG0's lag 2 spills ~110 bytes per block; a producer at 24 costs 2%).
            self.ex_lag = (2, 2)
            self.regs_wg = (248, 224)
            self.regs_producer = 32
        # ``defer_scatter`` (d576 pair path under CUDA 13, else ignored): WG1 scatters its last
        # chunk's pair sums in the next block, once its dP products are done (while it waits for
        # WG0's P, ~800 cycles), instead of at the end of its dKV phase; the receive stays in the
        # block (the landing area drains on time).  H200: 0.983x the time at s_kv 8k (two runs),
        # 0.988 / 1.005x at 32k, 1.033x at 64k, 1.036x at 128k: once the workspace outgrows L2
        # the late atomics miss it and hold up WG1's dS path -- so the host asks for it by s_kv
        # (``bwd_host.defer_scatter_for``, docs/PERF.md).
        self.defer_wg1 = defer_scatter and deep and pair_sum and not deterministic
        # every slot is used at least once per block (the flow control frees each once per block)
        assert max(self.ex_lag) < self.n_slots <= min(len(c) for c in self.dkv_chunks)
        assert sum(self.regs_wg) + self.regs_producer <= 504
        self.smem_bytes = 0  # set when traced

    @property
    def wg_bodies(self) -> bool:
        """Whether the consumer is traced once per warpgroup (``wg`` a constant in each body):
        ``setmaxnreg`` takes a constant, so warpgroups with different register counts need it."""
        return self.regs_wg[0] != self.regs_wg[1]

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [s_q, h_q, d_qk] bf16
        mKV: cute.Tensor,  # [s_kv, d_qk] bf16
        mDO: cute.Tensor,  # [s_q, h_q, d_v] bf16
        mO: cute.Tensor,  # [s_q, h_q, d_v] bf16 (the forward's output)
        mIdx: cute.Tensor,  # [s_q, topk] int32, topk % 64 == 0
        mTopkLen: cute.Tensor,  # [s_q] int32 (read only if has_topk_length)
        mLse2: cute.Tensor,  # [s_q, h_q] f32: log2(e) * lse' (+inf on empty rows)
        mDeltaCorr: cute.Tensor,  # [s_q, h_q] f32: dlse * exp(lse' - lse) (read only if has_dlse)
        mDeltaOut: cute.Tensor,  # [s_q, h_q] f32 out: rowsum(O dO) (for d_attn_sink)
        mAsumScale: cute.Tensor,  # [s_q, h_q] f32: exp(lse' - lse) (read only if attn_sum_scaled)
        mDQ: cute.Tensor,  # [s_q, h_q, d_qk] bf16
        mWs: cute.Tensor,  # f32 [s_kv, d_qk] (atomic) or bf16 [s_q * n_hblk * topk, d_qk] (deterministic)
        mAsum: cute.Tensor,  # f32 [s_q, n_hblk, topk] (written only if attn_sum)
        scale_log2: Float32,  # sm_scale * log2(e)
        sm_scale: Float32,
        stream,
    ):
        d_qk, d_v = self.d_qk, self.d_v
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
        sQ_layout = cute.tile_to_shape(k_atom, (B_H, d_qk), (0, 1))
        sDO_layout = cute.tile_to_shape(k_atom, (B_H, d_v), (0, 1))
        sK_layout = cute.tile_to_shape(k_atom, (B_TOPK, d_qk), (0, 1))
        sP_layout = cute.tile_to_shape(k_atom, (B_H, B_TOPK), (0, 1))

        # (h_q, d, s_q) views: one TMA box grid per (token, head block).
        mQ_hds = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 2, 0]))
        mDO_hds = cute.make_tensor(mDO.iterator, cute.select(mDO.layout, mode=[1, 2, 0]))
        mDQ_hds = cute.make_tensor(mDQ.iterator, cute.select(mDQ.layout, mode=[1, 2, 0]))
        tma_atom_q, tma_q = tma.tile_load_atom(mQ_hds, sQ_layout, (B_H, d_qk))
        tma_atom_do, tma_do = tma.tile_load_atom(mDO_hds, sDO_layout, (B_H, d_v))
        tma_atom_dq, tma_dq = tma.tile_store_atom(mDQ_hds, sQ_layout, (B_H, d_qk))

        psum_elems = 4 * B_TOPK if const_expr(self.attn_sum) else 4
        land_elems = 2 * self.n_slots * SLOT_BYTES // 4 if const_expr(self.pair_sum and not self.land_in_kv) else 4

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_layout)], 1024]
            sDO: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sDO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, B_H * B_TOPK], 1024]
            sDS: cute.struct.Align[cute.struct.MemRange[BFloat16, B_H * B_TOPK], 1024]
            sLand: cute.struct.Align[cute.struct.MemRange[Float32, land_elems], 128]
            mbar: cute.struct.MemRange[cutlass.Int64, N_MBAR]  # MB_* above
            sRowIdx: cute.struct.MemRange[Int32, 2 * B_TOPK]  # by block parity
            sValid: cute.struct.MemRange[Uint32, 2]
            sPsum: cute.struct.MemRange[Float32, psum_elems]
            sDelta: cute.struct.MemRange[Float32, B_H]
            # rotate_shift: the block-order tick (CTA rank 0's; st.async into rank 1: 16 bytes)
            sStart: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]

        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes <= SMEM_LIMIT, f"smem {self.smem_bytes} > {SMEM_LIMIT}"

        s_q = mQ.shape[0]
        n_hblk = mQ.shape[1] // B_H
        assert not self.pair_sum or n_hblk % 2 == 0, "pair_sum needs h_q % 128 == 0"
        self.kernel(
            mKV, mDO, mO, mIdx, mTopkLen, mLse2, mDeltaCorr, mDeltaOut, mAsumScale, mWs, mAsum, scale_log2, sm_scale,
            tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_dq, tma_dq,
            sQ_layout, sDO_layout, sK_layout, sP_layout, SharedStorage, n_hblk,
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
        mKV: cute.Tensor,
        mDO: cute.Tensor,
        mO: cute.Tensor,
        mIdx: cute.Tensor,
        mTopkLen: cute.Tensor,
        mLse2: cute.Tensor,
        mDeltaCorr: cute.Tensor,
        mDeltaOut: cute.Tensor,
        mAsumScale: cute.Tensor,
        mWs: cute.Tensor,
        mAsum: cute.Tensor,
        scale_log2: Float32,
        sm_scale: Float32,
        tma_atom_q: cute.CopyAtom,
        tma_q: cute.Tensor,
        tma_atom_do: cute.CopyAtom,
        tma_do: cute.Tensor,
        tma_atom_dq: cute.CopyAtom,
        tma_dq: cute.Tensor,
        sQ_layout: cute.ComposedLayout,
        sDO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
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
        bar_in = mbar + MB_IN
        kv_a = dev.HalfBufferBarriers(mbar + MB_KV_A, mbar + MB_KV_FREE)  # piece A (k-tiles 0..3)
        kv_b = dev.HalfBufferBarriers(mbar + MB_KV_B, mbar + MB_KV_FREE)  # piece B; one free barrier
        kv_c = dev.HalfBufferBarriers(mbar + MB_KV_C, mbar + MB_DRAINED)  # piece C (landing, d576 pair)
        bar_meta = mbar + MB_META

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_do)
            cpasync.prefetch_descriptor(tma_atom_dq)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(bar_in, 1)
                cute.arch.mbarrier_init(mbar + 1, 128)  # every producer thread's cp.async arrive
                cute.arch.mbarrier_init(mbar + 2, 128)
                cute.arch.mbarrier_init(mbar + 3, 256)  # every consumer thread
                cute.arch.mbarrier_init(bar_meta, 128)
                if const_expr(self.pair_sum):
                    cute.arch.mbarrier_init(mbar + MB_KV_C, 128)
                    cute.arch.mbarrier_init(mbar + MB_DRAINED, 256)  # both WGs' last receive
                    for i in cutlass.range_constexpr(2 * MAX_SLOTS):
                        cute.arch.mbarrier_init(mbar + MB_LAND_FULL + i, 1)
                        cute.arch.mbarrier_init(mbar + MB_SEND_OK + i, 4)
                    if const_expr(self.rotate_shift > 0):
                        cute.arch.mbarrier_init(mbar + MB_START, 1)
        cute.arch.mbarrier_init_fence()
        if const_expr(self.rotate_shift > 0):
            # (with the pair sum only CTA rank 0 reads the clock: rank 1 gets its tick, below)
            if tidx == 0 and (not self.pair_sum or pair_rank(h_blk) == 0):
                storage.sStart[0] = dev.globaltimer_ticks(self.rotate_shift)
        trace_row = Int64(0)
        if const_expr(self.trace):
            trace_row = dev.gmem_addr_i64(mAsum.iterator) + Int64(s_idx * n_hblk + h_blk) * Int64(mAsum.shape[2]) * 4
        head = dev.Trace(self.trace, trace_row)
        cute.arch.sync_threads()
        if const_expr(self.trace):
            t_sync = dev.clock32()
            for r in cutlass.range_constexpr(3):
                head.put(TRACE_ARRIVE + r, t_sync, tidx == 128 * r)
        if const_expr(self.pair_sum):
            if warp_idx == 0:
                with cute.arch.elect_one():
                    # phase 0's expected bytes (later phases: the receiver, after each read); after
                    # the CTA barrier: the init is visible to every thread (racecheck)
                    for i in cutlass.range_constexpr(2 * MAX_SLOTS):
                        cute.arch.mbarrier_arrive_and_expect_tx(mbar + MB_LAND_FULL + i, SLOT_BYTES)
            # the peer's barriers are initialised before anyone arrives on them remotely
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sDO = storage.sDO.get_tensor(sDO_layout.outer, swizzle=sDO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sDS = storage.sDS.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)

        if const_expr(self.trace):
            head.put(TRACE_START, dev.clock32(), tidx == 0)

        topk = mIdx.shape[1]
        topk_len = topk
        if const_expr(self.has_topk_length):
            topk_len = cutlass.max(cutlass.min(mTopkLen[s_idx], topk), 0)
        num_blocks = (topk_len + (B_TOPK - 1)) // B_TOPK
        if warp_idx == 0:
            # The TMA copies elect their own issuing lane: they must not sit inside elect_one.
            tQsQ, tQgQ = tma.token_tile_partition(tma_atom_q, tma_q, s_idx, (B_H, self.d_qk), (h_blk, 0), sQ)
            tDsDO, tDgDO = tma.token_tile_partition(tma_atom_do, tma_do, s_idx, (B_H, self.d_v), (h_blk, 0), sDO)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(bar_in, B_H * (self.d_qk + self.d_v) * 2)
            cute.copy(tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=bar_in)
            cute.copy(tma_atom_do, tDgDO, tDsDO, tma_bar_ptr=bar_in)

        # (after Q / dO's load is issued: rank 1's wait for the tick is not on that path)
        start = Int32(0)
        if const_expr(self.rotate_shift > 0):
            if const_expr(self.pair_sum):
                # both CTAs of the pair walk the same blocks in the same order: CTA rank 0 sends
                # its tick into rank 1's sStart (st.async, completing on rank 1's MB_START; the
                # peer's barrier was initialised before the cluster barrier above)
                start_bar = mbar + MB_START
                if pair_rank(h_blk) == 0:
                    if tidx == 0:
                        t0 = storage.sStart[0]
                        dev.st_async_v4_b32(
                            dev.mapa_shared(dev.smem_addr_u32(storage.sStart.data_ptr()), Int32(1)),
                            Uint32(t0), Uint32(0), Uint32(0), Uint32(0),
                            dev.mapa_shared(dev.smem_addr_u32(start_bar), Int32(1)))
                else:
                    if tidx == 0:
                        dev.mbarrier_arrive_expect_tx(dev.smem_addr_u32(start_bar), 16)
                    cute.arch.mbarrier_wait(start_bar, 0)
            start = storage.sStart[0] % cutlass.max(num_blocks, Int32(1))

        sRowIdx = storage.sRowIdx.get_tensor(cute.make_layout(2 * B_TOPK))
        sValid = storage.sValid.get_tensor(cute.make_layout(2))
        sPsum = storage.sPsum.get_tensor(cute.make_layout(4 * B_TOPK if const_expr(self.attn_sum) else 4))
        sDelta = storage.sDelta.get_tensor(cute.make_layout(B_H))
        sK_ptr = storage.sK.data_ptr()

        head.put(TRACE_NBLK, num_blocks, tidx == 0)
        if wg == 2:
            cute.arch.setmaxregister_decrease(self.regs_producer)
            self.producer(mKV, mIdx, sK_ptr, sRowIdx, sValid, kv_a, kv_b, kv_c, bar_meta,
                          s_idx, topk_len, num_blocks, start, idx_in_wg, warp_idx % 4,
                          dev.Trace(self.trace, trace_row, TRACE_BASE[2], TRACE_PER_BLOCK, TRACE_BLOCKS))
        else:
            args = (mDO, mO, mLse2, mDeltaCorr, mDeltaOut, mAsumScale, mWs, mAsum, scale_log2, sm_scale,
                    tma_atom_dq, tma_dq, sQ, sDO, sK, sP, sDS, sRowIdx, sValid, sPsum, sDelta, bar_in,
                    kv_a, kv_b, kv_c, bar_meta, s_idx, h_blk, n_hblk, topk, topk_len, num_blocks, start)
            if const_expr(not self.wg_bodies):
                cute.arch.setmaxregister_increase(self.regs_wg[0])
                self.consumer(*args, wg, idx_in_wg, warp_idx, _Exchange(self, storage, mbar, wg, idx_in_wg, h_blk),
                              trace_row)
            else:
                # one consumer body per warpgroup (``wg`` a constant in each), each under its own
                # register count
                for c_wg in cutlass.range_constexpr(2):
                    if wg == c_wg:
                        cute.arch.setmaxregister_increase(self.regs_wg[c_wg])
                        self.consumer(*args, c_wg, idx_in_wg, warp_idx,
                                      _Exchange(self, storage, mbar, c_wg, idx_in_wg, h_blk), trace_row)
            if const_expr(self.trace):
                head.put(TRACE_END, dev.clock32(), tidx == 0)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def producer(
        self,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        sK_ptr: cute.Pointer,
        sRowIdx: cute.Tensor,
        sValid: cute.Tensor,
        kv_a: cutlass.Constexpr,
        kv_b: cutlass.Constexpr,
        kv_c: cutlass.Constexpr,
        bar_meta,
        s_idx: Int32,
        topk_len: Int32,
        num_blocks: Int32,
        start: Int32,
        ptid: Int32,
        warp_in_wg: Int32,
        tr,
    ):
        """WG2: gather each block's KV rows in two pieces; publish row indices and validity."""
        gather = KvGather(mKV, mIdx, s_idx, topk_len, ptid, self.d_qk, slots=1)
        if const_expr(self.gather_evict_first):
            gather.policy = dev.createpolicy_evict_first()  # L2 is for the workspace
        sK_addr = dev.smem_addr_u32(sK_ptr)
        rec = ptid == 0
        for b in cutlass.range(num_blocks, unroll=1):
            parity = b & 1
            tr.stamp(b, 0, rec)
            blk = self._block_at(b, start, num_blocks)
            gather.load_indices(blk, 0)
            row_idx, row_ok = gather.index_at(blk * B_TOPK + ptid % B_TOPK)
            bits = Uint32(cute.arch.vote_ballot_sync(row_ok))
            tr.stamp(b, 1, rec)
            # The buffer and sValid are free once both dQ products of block b-1 are done (every
            # read of block b-1's validity happened before).  Row indices are double-buffered by
            # block parity: the dKV scatter of block b-1 still reads its slot.
            kv_a.wait_free(parity)
            tr.stamp(b, 2, rec)
            gather.copy_tiles(sK_addr, 0, 0, self.n_left)
            kv_a.commit_cp_async()
            gather.copy_tiles(sK_addr, 0, self.n_left, self.n_mid)
            kv_b.commit_cp_async()
            tr.stamp(b, 3, rec)
            if ptid < B_TOPK:
                sRowIdx[parity * B_TOPK + ptid] = Int32(cutlass.select_(row_ok, row_idx, Int32(-1)))
            if warp_in_wg < 2:
                if ptid % 32 == 0:
                    sValid[warp_in_wg] = bits
            cute.arch.mbarrier_arrive(bar_meta)
            tr.stamp(b, 4, rec)
            if const_expr(self.n_land > 0):
                # piece C doubles as the dKV exchange's landing area: wait until block b-1's
                # exchange drained in both WGs
                kv_c.wait_free(parity)
                tr.stamp(b, 5, rec)
                gather.copy_tiles(sK_addr, 0, self.n_mid, self.n_k_tiles)
                kv_c.commit_cp_async()
                tr.stamp(b, 6, rec)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consumer(
        self,
        mDO: cute.Tensor,
        mO: cute.Tensor,
        mLse2: cute.Tensor,
        mDeltaCorr: cute.Tensor,
        mDeltaOut: cute.Tensor,
        mAsumScale: cute.Tensor,
        mWs: cute.Tensor,
        mAsum: cute.Tensor,
        scale_log2: Float32,
        sm_scale: Float32,
        tma_atom_dq: cute.CopyAtom,
        tma_dq: cute.Tensor,
        sQ: cute.Tensor,
        sDO: cute.Tensor,
        sK: cute.Tensor,
        sP: cute.Tensor,
        sDS: cute.Tensor,
        sRowIdx: cute.Tensor,
        sValid: cute.Tensor,
        sPsum: cute.Tensor,
        sDelta: cute.Tensor,
        bar_in,
        kv_a: cutlass.Constexpr,
        kv_b: cutlass.Constexpr,
        kv_c: cutlass.Constexpr,
        bar_meta,
        s_idx: Int32,
        h_blk: Int32,
        n_hblk: Int32,
        topk: Int32,
        topk_len: Int32,
        num_blocks: Int32,
        start: Int32,
        wg,  # Int32, or a constant (one body per warpgroup)
        idx_in_wg: Int32,
        warp_idx: Int32,
        ex,
        trace_row,
    ):
        """WG0 / WG1: recompute P (WG0) and dS (WG1), then dQ and dKV for their columns."""
        lane_quad = idx_in_wg % 4
        head0 = h_blk * B_H + dev.fragment_row(idx_in_wg, 0)
        head1 = h_blk * B_H + dev.fragment_row(idx_in_wg, 1)
        scatter = _Scatter(self, mWs, sRowIdx, idx_in_wg, s_idx, h_blk, n_hblk, topk)

        # Products: S / dP (64 x 64, K-major x K-major), dQ (64 x 256 / 64 x 64, K x MN),
        # dKV (64 tokens x 64 columns, MN x MN).
        thr_s = self._mma(K_MAJ, K_MAJ, B_TOPK).get_slice(idx_in_wg)
        thr_dq = self._mma(K_MAJ, MN_MAJ, 256).get_slice(idx_in_wg)
        thr_dq64 = self._mma(K_MAJ, MN_MAJ, 64).get_slice(idx_in_wg)
        thr_kv = self._mma(MN_MAJ, MN_MAJ, 64).get_slice(idx_in_wg)

        # Transposed (MN-major) views: K^T (d x tokens), Q^T / dO^T (d x heads), dS^T / P^T
        # (tokens x heads).
        sKt = cute.make_tensor(sK.iterator, cute.select(sK.layout, mode=[1, 0]))
        sQt = cute.make_tensor(sQ.iterator, cute.select(sQ.layout, mode=[1, 0]))
        sDOt = cute.make_tensor(sDO.iterator, cute.select(sDO.layout, mode=[1, 0]))
        sDSt = cute.make_tensor(sDS.iterator, cute.select(sDS.layout, mode=[1, 0]))
        sPt = cute.make_tensor(sP.iterator, cute.select(sP.layout, mode=[1, 0]))

        tDQrDS = thr_dq.make_fragment_A(thr_dq.partition_A(sDS))
        tDQrK = thr_dq.make_fragment_B(thr_dq.partition_B(cute.local_tile(sKt, (256, B_TOPK), (wg, 0))))
        acc_dq = thr_dq.make_fragment_C(thr_dq.partition_shape_C((B_H, 256)))
        acc_dq.fill(0.0)
        tKVrDS = thr_kv.make_fragment_A(thr_kv.partition_A(sDSt))
        tKVrP = thr_kv.make_fragment_A(thr_kv.partition_A(sPt))
        acc_kv = thr_kv.make_fragment_C(thr_kv.partition_shape_C((B_TOPK, 64)))
        acc_s = thr_s.make_fragment_C(thr_s.partition_shape_C((B_H, B_TOPK)))

        st_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), BFloat16)
        thr_st = cute.make_tiled_copy_C(st_atom, self._mma(K_MAJ, K_MAJ, B_TOPK)).get_slice(idx_in_wg)
        rPb = cute.make_rmem_tensor_like(acc_s, BFloat16)
        acc_dqr = thr_dq64.make_fragment_C(thr_dq64.partition_shape_C((B_H, 64)))  # RoPE dQ (WG0)
        acc_dqr.fill(0.0)

        cute.arch.mbarrier_wait(bar_in, 0)

        rec = idx_in_wg == 0  # the trace's recorder of each warpgroup
        if wg == 0:
            # ---------------- WG0: S, P, (attention sum), dQ columns 0..255 + RoPE ----------------
            tr = dev.Trace(self.trace, trace_row, TRACE_BASE[0], TRACE_PER_BLOCK, TRACE_BLOCKS)
            tSrQ = thr_s.make_fragment_A(thr_s.partition_A(sQ))
            tSrK = thr_s.make_fragment_B(thr_s.partition_B(sK))
            tDQrKr = thr_dq64.make_fragment_B(
                thr_dq64.partition_B(cute.local_tile(sKt, (64, B_TOPK), (self.n_k_tiles - 1, 0)))
            )
            tDQrDS64 = thr_dq64.make_fragment_A(thr_dq64.partition_A(sDS))
            neg_lse2_0 = -mLse2[s_idx, head0]
            neg_lse2_1 = -mLse2[s_idx, head1]
            asc0 = Float32(1.0)
            asc1 = Float32(1.0)
            if const_expr(self.attn_sum_scaled):
                asc0 = mAsumScale[s_idx, head0]
                asc1 = mAsumScale[s_idx, head1]
            colsum = cute.make_rmem_tensor((16,), Float32)
            lane = idx_in_wg % 32
            tPsP = thr_st.partition_D(sP)
            for b in cutlass.range(num_blocks, unroll=1):
                parity = b & 1
                tr.stamp(b, 0, rec)
                kv_a.wait_ready(parity)
                tr.stamp(b, 1, rec)
                self._issue(K_MAJ, K_MAJ, B_TOPK, acc_s, tSrQ, tSrK, 0, 4 * self.n_left, True, False)
                kv_b.wait_ready(parity)
                tr.stamp(b, 2, rec)
                self._issue(K_MAJ, K_MAJ, B_TOPK, acc_s, tSrQ, tSrK, 4 * self.n_left, 4 * self.n_mid,
                            False, self.n_land == 0)
                if const_expr(self.n_land > 0):
                    kv_c.wait_ready(parity)
                    tr.stamp(b, 3, rec)
                    self._issue(K_MAJ, K_MAJ, B_TOPK, acc_s, tSrQ, tSrK, 4 * self.n_mid, 4 * self.n_k_tiles,
                                False, True)
                cute.arch.mbarrier_wait(bar_meta, parity)
                lo = sValid[0] >> Uint32(2 * lane_quad)
                hi = sValid[1] >> Uint32(2 * lane_quad)
                cute.nvgpu.warpgroup.wait_group(0)
                tr.stamp(b, 4, rec)
                # P = exp2(S*c - lse2); invalid slots 0 (select, so no NaN can leak from them).
                for g in cutlass.range_constexpr(8):
                    word = lo if g < 4 else hi
                    for v0 in cutlass.range_constexpr(2):
                        bit = ((word >> Uint32(8 * (g % 4) + v0)) & Uint32(1)) != Uint32(0)
                        i0 = dev.acc_flat(v0, 0, g)
                        i1 = dev.acc_flat(v0, 1, g)
                        p0 = cute.math.exp2(acc_s[i0] * scale_log2 + neg_lse2_0, fastmath=True)
                        p1 = cute.math.exp2(acc_s[i1] * scale_log2 + neg_lse2_1, fastmath=True)
                        acc_s[i0] = Float32(cutlass.select_(bit, p0, Float32(0.0)))
                        acc_s[i1] = Float32(cutlass.select_(bit, p1, Float32(0.0)))
                        if const_expr(self.attn_sum):
                            colsum[2 * g + v0] = acc_s[i0] * asc0 + acc_s[i1] * asc1
                if const_expr(self.attn_sum):
                    self._attn_sum_block(colsum, sPsum, mAsum, lane, idx_in_wg, warp_idx, h_blk, s_idx,
                                         self._block_at(b, start, num_blocks))
                rPb.store(acc_s.load().to(BFloat16))
                if b > 0:
                    # WG1's dKV products of block b-1 still read P: wait for them.
                    cute.arch.barrier(barrier_id=BAR_DKV_DONE, number_of_threads=256)
                cute.copy(thr_st, thr_st.retile(rPb), tPsP)
                cute.arch.fence_proxy("async.shared", space="cta")
                tr.stamp(b, 5, rec)
                cute.arch.barrier_arrive(barrier_id=BAR_P, number_of_threads=256)
                cute.arch.barrier(barrier_id=BAR_DS, number_of_threads=256)
                tr.stamp(b, 6, rec)
                # dQ[:, 0:256] += dS K[:, 0:256];  dQ[:, 512:576] += dS K[:, 512:576]
                cute.nvgpu.warpgroup.fence()
                self._gemm(K_MAJ, MN_MAJ, 256, acc_dq, tDQrDS, tDQrK, 0, 4, False)
                if const_expr(self.has_rope):
                    self._gemm(K_MAJ, MN_MAJ, 64, acc_dqr, tDQrDS64, tDQrKr, 0, 4, False)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(0)
                tr.stamp(b, 7, rec)
                kv_a.release()
                ex.dq_done(self.ex_wgs[0], 0)
                self._dkv_chunks(0, self.ex_lag[0], self.ex_wgs[0], thr_kv, acc_kv, tKVrDS, tKVrP, sQt, sDOt,
                                 scatter, ex, b, tr, rec)
            if const_expr(self.attn_sum):
                self._attn_sum_tail(mAsum, h_blk, s_idx, num_blocks, topk, idx_in_wg)
        else:
            # ---------------- WG1: dP, dS, dQ columns 256..511 ----------------
            tr = dev.Trace(self.trace, trace_row, TRACE_BASE[1], TRACE_PER_BLOCK, TRACE_BLOCKS)
            tDPrDO = thr_s.make_fragment_A(thr_s.partition_A(sDO))
            tDPrV = thr_s.make_fragment_B(thr_s.partition_B(cute.local_tile(sK, (B_TOPK, self.d_v), (0, 0))))
            ld_atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), BFloat16)
            thr_ld = cute.make_tiled_copy_C(ld_atom, self._mma(K_MAJ, K_MAJ, B_TOPK)).get_slice(idx_in_wg)
            tPsP_ld = thr_ld.partition_S(sP)
            tDSsDS = thr_st.partition_D(sDS)
            rPf = cute.make_rmem_tensor_like(acc_s, Float32)
            dfr = None
            if const_expr(self.defer_wg1):
                dfr = cute.make_rmem_tensor((16,), Float32)
            self._delta_rows(mO, mDO, mDeltaCorr, mDeltaOut, sDelta, s_idx, h_blk, idx_in_wg)
            nd0 = -sDelta[dev.fragment_row(idx_in_wg, 0)] * sm_scale
            nd1 = -sDelta[dev.fragment_row(idx_in_wg, 1)] * sm_scale
            for b in cutlass.range(num_blocks, unroll=1):
                parity = b & 1
                tr.stamp(b, 0, rec)
                kv_a.wait_ready(parity)
                tr.stamp(b, 1, rec)
                self._issue(K_MAJ, K_MAJ, B_TOPK, acc_s, tDPrDO, tDPrV, 0, 4 * self.n_left, True, False)
                kv_b.wait_ready(parity)
                tr.stamp(b, 2, rec)
                self._issue(K_MAJ, K_MAJ, B_TOPK, acc_s, tDPrDO, tDPrV, 4 * self.n_left,
                            4 * min(self.n_mid, self.n_v_tiles), False, self.n_mid >= self.n_v_tiles)
                if const_expr(self.n_mid < self.n_v_tiles):
                    kv_c.wait_ready(parity)
                    tr.stamp(b, 3, rec)
                    self._issue(K_MAJ, K_MAJ, B_TOPK, acc_s, tDPrDO, tDPrV, 4 * self.n_mid, 4 * self.n_v_tiles,
                                False, True)
                # (consume this block's metadata phase before releasing the buffer: the producer
                # must not complete the next phase before both WGs waited on this one)
                cute.arch.mbarrier_wait(bar_meta, parity)
                cute.nvgpu.warpgroup.wait_group(0)
                tr.stamp(b, 4, rec)
                if const_expr(self.defer_wg1):
                    if b > 0:
                        # the previous block's last chunk (its row indices: parity b - 1, rewritten
                        # by the producer only after this block's dQ)
                        self._scatter_deferred(scatter, dfr, b - 1, ex.rank)
                # dS = P (dP - delta') sm_scale, with P (bf16) from WG0 through smem.
                cute.arch.barrier(barrier_id=BAR_P, number_of_threads=256)
                tr.stamp(b, 5, rec)
                cute.copy(thr_ld, tPsP_ld, thr_ld.retile(rPb))
                rPf.store(rPb.load().to(Float32))
                for g in cutlass.range_constexpr(8):
                    for v0 in cutlass.range_constexpr(2):
                        i0 = dev.acc_flat(v0, 0, g)
                        i1 = dev.acc_flat(v0, 1, g)
                        acc_s[i0] = rPf[i0] * (acc_s[i0] * sm_scale + nd0)
                        acc_s[i1] = rPf[i1] * (acc_s[i1] * sm_scale + nd1)
                rPb.store(acc_s.load().to(BFloat16))
                cute.copy(thr_st, thr_st.retile(rPb), tDSsDS)
                cute.arch.fence_proxy("async.shared", space="cta")
                tr.stamp(b, 6, rec)
                # One-way hand-off to WG0 plus WG1's own sync: a bar.sync that both warpgroups
                # reached from different code locations is what synccheck reports as divergent
                # (barrier.sync.aligned wants one instruction per barrier instance).
                cute.arch.barrier_arrive(barrier_id=BAR_DS, number_of_threads=256)
                cute.arch.barrier(barrier_id=BAR_DS_WG1, number_of_threads=128)
                # dQ[:, 256:512] += dS K[:, 256:512]
                cute.nvgpu.warpgroup.fence()
                self._gemm(K_MAJ, MN_MAJ, 256, acc_dq, tDQrDS, tDQrK, 0, 4, False)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(0)
                tr.stamp(b, 7, rec)
                kv_a.release()
                ex.dq_done(self.ex_wgs[1], 1)
                self._dkv_chunks(1, self.ex_lag[1], self.ex_wgs[1], thr_kv, acc_kv, tKVrDS, tKVrP, sQt, sDOt,
                                 scatter, ex, b, tr, rec, dfr)
                tr.stamp(b, 18, rec)
                if b + 1 < num_blocks:
                    cute.arch.barrier_arrive(barrier_id=BAR_DKV_DONE, number_of_threads=256)
            if const_expr(self.defer_wg1):
                if num_blocks > 0:
                    self._scatter_deferred(scatter, dfr, num_blocks - 1, ex.rank)

        # ---------------- dQ epilogue: registers -> bf16 -> smem (Q's tile) -> TMA ----------------
        split = self.wg_bodies
        if const_expr(split):
            # last readers of sQ done, with one bar.sync site per id (the two bodies are two code
            # locations): each warpgroup arrives on the barrier the other one syncs
            if const_expr(wg == 0):
                cute.arch.barrier_arrive(barrier_id=BAR_EPI_WG1, number_of_threads=256)
                cute.arch.barrier(barrier_id=BAR_EPI, number_of_threads=256)
            else:
                cute.arch.barrier_arrive(barrier_id=BAR_EPI, number_of_threads=256)
                cute.arch.barrier(barrier_id=BAR_EPI_WG1, number_of_threads=256)
        else:
            cute.arch.barrier(barrier_id=BAR_EPI, number_of_threads=256)  # last readers of sQ done
        thr_st_dq = cute.make_tiled_copy_C(st_atom, self._mma(K_MAJ, MN_MAJ, 256)).get_slice(idx_in_wg)
        rDQ = cute.make_rmem_tensor_like(acc_dq, BFloat16)
        rDQ.store(acc_dq.load().to(BFloat16))
        cute.copy(thr_st_dq, thr_st_dq.retile(rDQ), thr_st_dq.partition_D(cute.local_tile(sQ, (B_H, 256), (0, wg))))
        if const_expr(self.has_rope):
            if wg == 0:
                thr_st_r = cute.make_tiled_copy_C(st_atom, self._mma(K_MAJ, MN_MAJ, 64)).get_slice(idx_in_wg)
                rDQr = cute.make_rmem_tensor_like(acc_dqr, BFloat16)
                rDQr.store(acc_dqr.load().to(BFloat16))
                cute.copy(thr_st_r, thr_st_r.retile(rDQr),
                          thr_st_r.partition_D(cute.local_tile(sQ, (B_H, 64), (0, self.n_k_tiles - 1))))
        cute.arch.fence_proxy("async.shared", space="cta")
        if const_expr(split and wg == 1):
            cute.arch.barrier_arrive(barrier_id=BAR_EPI_STORED, number_of_threads=256)  # WG0 stores
        else:
            cute.arch.barrier(barrier_id=BAR_EPI_STORED, number_of_threads=256)
        if warp_idx == 0:
            tDQsDQ, tDQgDQ = tma.token_tile_partition(tma_atom_dq, tma_dq, s_idx, (B_H, self.d_qk), (h_blk, 0), sQ)
            cute.copy(tma_atom_dq, tDQsDQ, tDQgDQ)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _block_at(self, b: Int32, start: Int32, num_blocks: Int32) -> Int32:
        """The row's block that step ``b`` of the loop works on (``rotate_shift``: from ``start``,
        wrapping around; else ``b``)."""
        blk = b
        if const_expr(self.rotate_shift > 0):
            blk = dev.wrap_index(b, start, num_blocks)
        return blk

    def _mma(self, a_major, b_major, n: int):
        return sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, a_major, b_major, Float32, (1, 1, 1), (64, n)
        )

    # The ACCUMULATE field is set on a fresh tiled MMA per call: a field set inside one staged
    # region must not leak into another.
    @cute.jit
    def _gemm(self, a_major: cutlass.Constexpr, b_major: cutlass.Constexpr, n: cutlass.Constexpr,
              acc, tA, tB, k0: cutlass.Constexpr, k1: cutlass.Constexpr, clear: cutlass.Constexpr):
        """acc (+)= sum over k-steps [k0, k1) of tA[k] tB[k] (issue only)."""
        mma = self._mma(a_major, b_major, n)
        for k in cutlass.range_constexpr(k0, k1):
            mma.set(warpgroup.Field.ACCUMULATE, not (clear and k == k0))
            cute.gemm(mma, acc, tA[None, None, k], tB[None, None, k], acc)

    @cute.jit
    def _issue(self, a_major: cutlass.Constexpr, b_major: cutlass.Constexpr, n: cutlass.Constexpr,
               acc, tA, tB, k0: cutlass.Constexpr, k1: cutlass.Constexpr, clear: cutlass.Constexpr,
               commit: cutlass.Constexpr):
        """fence + issue; commit the group if ``commit``."""
        cute.nvgpu.warpgroup.fence()
        self._gemm(a_major, b_major, n, acc, tA, tB, k0, k1, clear)
        if const_expr(commit):
            cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _dkv_issue(self, ch: cutlass.Constexpr, thr_kv, acc_kv, tKVrDS, tKVrP, sQt, sDOt):
        """Issue (and commit) dKV[:, chunk] = dS^T Q[:, chunk] (+ P^T dO[:, chunk])."""
        tB_q = thr_kv.make_fragment_B(thr_kv.partition_B(cute.local_tile(sQt, (64, B_H), (ch, 0))))
        cute.nvgpu.warpgroup.fence()
        self._gemm(MN_MAJ, MN_MAJ, 64, acc_kv, tKVrDS, tB_q, 0, 4, True)
        if const_expr(ch < self.n_v_tiles):
            tB_do = thr_kv.make_fragment_B(thr_kv.partition_B(cute.local_tile(sDOt, (64, B_H), (ch, 0))))
            self._gemm(MN_MAJ, MN_MAJ, 64, acc_kv, tKVrP, tB_do, 0, 4, False)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _dkv_chunks(self, wg: cutlass.Constexpr, lag: cutlass.Constexpr, exchange: cutlass.Constexpr, thr_kv, acc_kv, tKVrDS, tKVrP,
                    sQt, sDOt, scatter, ex, b: Int32, tr, rec, deferred=None):
        """dKV[:, chunk] per 64-column chunk, then its scatter.  (``deferred``: a 16-value
        register tensor that receives the last chunk's sums instead of scattering them.)

        Without the pair sum each chunk is scattered whole.  With it (h_q % 128 == 0) chunk c's
        half that the peer CTA owns goes to the peer (st.async into its landing area) while this
        CTA's half waits in registers; the peer's half of chunk c is received, added and scattered
        ``lag`` chunks later, while the products of chunks c+1 .. c+lag run on the tensor cores
        (``lag`` 0: right away).  Each CTA thus scatters 32 of every 64 columns with both head
        blocks summed.  With ``send_first[wg]`` (WG0 on the d576 pair path) chunk c - lag is
        received and scattered after chunk c's products and send instead: its peer half was sent
        a whole chunk earlier, so the receive does not wait out the DSMEM round trip.

        (A second accumulator that kept chunk c+1's products in flight while chunk c is scattered
        measured 0.994-0.996x of the unpaired loop -- no gain -- and was dropped.)"""
        chunks = self.dkv_chunks[wg]
        n = len(chunks)
        # trace events (``trace``): chunk c's send-slot wait passed, its receive wait passed and
        # (WG0) its scatter issued
        ev_send = [8 + 3 * c if wg == 0 else 8 + c for c in range(n)]
        ev_recv = [9 + 3 * c if wg == 0 else 13 + c for c in range(n)]

        def finish(kept, c):
            """Receive the peer's half of chunk c, add it to ``kept`` and scatter the sums."""
            summed = ex.receive(kept, b * n + c, c, n, wg, tr, b, ev_recv[c], rec)
            if const_expr(deferred is not None and c == n - 1):
                for i in cutlass.range_constexpr(16):
                    deferred[i] = summed[i]
            else:
                scatter.half(summed, chunks[c], b, ex.rank)

        if const_expr(not exchange):
            for c in cutlass.range_constexpr(n):
                self._dkv_issue(chunks[c], thr_kv, acc_kv, tKVrDS, tKVrP, sQt, sDOt)
                cute.nvgpu.warpgroup.wait_group(0)
                scatter.chunk(acc_kv, chunks[c], b)
                if const_expr(wg == 0):
                    tr.stamp(b, 10 + 3 * c, rec)
        elif const_expr(lag == 0):
            for c in cutlass.range_constexpr(n):
                self._dkv_issue(chunks[c], thr_kv, acc_kv, tKVrDS, tKVrP, sQt, sDOt)
                cute.nvgpu.warpgroup.wait_group(0)
                ex.send(acc_kv, b * n + c, wg)
                tr.stamp(b, ev_send[c], rec)
                finish(ex.kept(acc_kv), c)
                if const_expr(wg == 0):
                    tr.stamp(b, 10 + 3 * c, rec)
        else:
            pending = []  # kept halves of the chunks in flight, oldest first
            first = self.send_first[wg]
            for c in cutlass.range_constexpr(n):
                self._dkv_issue(chunks[c], thr_kv, acc_kv, tKVrDS, tKVrP, sQt, sDOt)
                if const_expr(c >= lag and not first):
                    finish(pending[0], c - lag)
                    pending = pending[1:]
                cute.nvgpu.warpgroup.wait_group(0)
                ex.send(acc_kv, b * n + c, wg)
                tr.stamp(b, ev_send[c], rec)
                if const_expr(c >= lag and first):
                    finish(pending[0], c - lag)
                    pending = pending[1:]
                pending = pending + [ex.kept(acc_kv)]
            for j in cutlass.range_constexpr(len(pending)):
                finish(pending[j], n - len(pending) + j)

    @cute.jit
    def _scatter_deferred(self, scatter, dfr, b, rank) -> None:
        """WG1 (``defer_wg1``): scatter the sums of block ``b``'s last chunk held in ``dfr``."""
        scatter.half([dfr[i] for i in range(16)], self.dkv_chunks[1][-1], b, rank)

    @cute.jit
    def _delta_rows(self, mO, mDO, mDeltaCorr, mDeltaOut, sDelta, s_idx, h_blk, idx_in_wg):
        """WG1: ``delta = rowsum(O * dO)`` of the 64 heads (float32) -> smem (minus the dlse
        correction) and global memory.  Thread t sums half a row: row t/2, columns (t%2)*256.."""
        row = idx_in_wg // 2
        head = h_blk * B_H + row
        half = idx_in_wg % 2
        acc = dev.rowsum_o_do_half(mO, mDO, s_idx, head, half, self.d_v, 2)
        if half == 0:
            mDeltaOut[s_idx, head] = acc
            corr = Float32(0.0)
            if const_expr(self.has_dlse):
                corr = mDeltaCorr[s_idx, head]
            sDelta[row] = acc - corr
        cute.arch.barrier(barrier_id=BAR_DELTA, number_of_threads=128)

    @cute.jit
    def _attn_sum_block(self, colsum, sPsum, mAsum, lane, idx_in_wg, warp_idx, h_blk, s_idx, b):
        """Sum this block's P over WG0's 64 heads; the first 64 threads write the partial row."""
        dev.warp_reduce_scatter_cols(colsum, lane)
        sPsum[warp_idx * B_TOPK + 2 * lane] = colsum[0]
        sPsum[warp_idx * B_TOPK + 2 * lane + 1] = colsum[1]
        cute.arch.barrier(barrier_id=BAR_ASUM, number_of_threads=128)
        total = Float32(0.0)
        if idx_in_wg < B_TOPK:
            for w in cutlass.range_constexpr(4):
                total = total + sPsum[w * B_TOPK + idx_in_wg]
            mAsum[s_idx, h_blk, b * B_TOPK + idx_in_wg] = total
        # The partials are overwritten by the next block only after every reader passed here.
        cute.arch.barrier(barrier_id=BAR_ASUM_READ, number_of_threads=128)

    @cute.jit
    def _attn_sum_tail(self, mAsum, h_blk, s_idx, num_blocks, topk, idx_in_wg):
        """Slots of blocks past topk_length are never gathered: write their zeros."""
        n_tail = topk - num_blocks * B_TOPK
        for t in cutlass.range((n_tail + 127 - idx_in_wg) // 128, unroll=1):
            mAsum[s_idx, h_blk, num_blocks * B_TOPK + idx_in_wg + t * 128] = Float32(0.0)


class _Scatter:
    """The dKV scatter of one consumer thread: row addressing (atomic workspace ``[s_kv, d_qk]`` or
    the deterministic per-slot workspace) and the register exchange that makes each warp
    instruction cover 4 whole 128-byte lines.

    Workspace column order: the float32 workspace rows are stored in a *permuted* column order
    (:data:`WS_COL_PERM`, within every 16-column group) so that a thread's accumulator values land
    in 16-byte vectors with a single shuffle per value.  The 64 x 64 chunk fragment gives lane
    ``(r8, q)`` (``lane = 4 r8 + q``) columns ``8g + 2q``, ``+1`` (g = 0..7) of rows ``r8`` and
    ``r8 + 8`` of the warp's 16; the four values of column pair ``2q`` of groups ``2G``, ``2G+1``
    (16-column group ``G``) are workspace columns ``16G + 4q .. 16G + 4q + 3``.  Lanes ``r8 = 2k`` and
    ``2k + 1`` swap one such vector (shuffle xor 4) so that each writes its half (group ``2L`` for
    the even lane, ``2L + 1`` for the odd one) of both their rows: per instruction, 8 lanes cover
    the 128 bytes of one row.  Per chunk and thread: 16 shuffles, 48 selects, 8 ``red.v4`` (the
    earlier exchange into natural column order took 48 shuffles and ~150 selects).  The host undoes
    the permutation when it converts the workspace to bfloat16.
    """

    def __init__(self, kernel: SparseMlaBwdSm90, mWs, sRowIdx, idx_in_wg, s_idx, h_blk, n_hblk, topk):
        self.deterministic = kernel.deterministic
        self.sRowIdx = sRowIdx
        lane = idx_in_wg % 32
        r8 = lane // 4
        self.odd = (r8 & 1) != 0
        self.row_pair = (idx_in_wg // 32) * 16 + (r8 & 6)  # the even row of this lane pair
        self.elem = 2 if kernel.deterministic else 4  # workspace bytes per value (bf16 per-slot rows)
        self.ws_base = dev.gmem_addr_i64(mWs.iterator) + Int64((16 * (r8 & 1) + 4 * (lane % 4)) * self.elem)
        self.row_bytes = kernel.d_qk * (2 if kernel.deterministic else 4)
        self.ws_hint = kernel.ws_policy is not None
        self.policy = Int64(0)
        if kernel.ws_policy == "last":
            self.policy = dev.createpolicy_evict_last()
        elif kernel.ws_policy == "normal":
            self.policy = dev.createpolicy_evict_normal()
        self.det_row0 = Int32(0)
        if kernel.deterministic:
            # this CTA's first per-slot row; int32 suffices: the host bounds a wave's rows.  With
            # the pair sum one row per (token, head-block pair, slot), each CTA writing its half.
            if kernel.pair_sum:
                self.det_row0 = (s_idx * (n_hblk // 2) + h_blk // 2) * topk
            else:
                self.det_row0 = (s_idx * n_hblk + h_blk) * topk

    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    @cute.jit
    def _store(self, row, b, col_bytes: Int64, v0, v1, v2, v3) -> None:
        kv_row = self.sRowIdx[(b & 1) * B_TOPK + row]
        if kv_row >= 0:
            dst = Int64(kv_row)
            if const_expr(self.deterministic):
                dst = Int64(self.det_row0 + b * B_TOPK + row)
            addr = self.ws_base + dst * Int64(self.row_bytes) + col_bytes
            if const_expr(self.deterministic):
                dev.st_global_v2_b32(addr, dev.pack_bf16x2(v0, v1), dev.pack_bf16x2(v2, v3))
            elif const_expr(self.ws_hint):
                dev.red_add_v4_f32_hint(addr, v0, v1, v2, v3, self.policy)
            else:
                dev.red_add_v4_f32(addr, v0, v1, v2, v3)

    @cute.jit
    def _rows(self, vals, row, b, col_bytes) -> None:
        """Scatter one 32-column half of rows ``row``, ``row + 8`` of the warp's 16: ``vals`` are
        the 16 fragment values of the half in :data:`HALF_IDX` order."""
        for rh in cutlass.range_constexpr(2):
            a0 = vals[8 * rh: 8 * rh + 4]
            a1 = vals[8 * rh + 4: 8 * rh + 8]
            d1 = []
            d2 = []
            for e in cutlass.range_constexpr(4):
                send = Float32(cutlass.select_(self.odd, a0[e], a1[e]))
                recv = cute.arch.shuffle_sync_bfly(send, offset=4)
                d1.append(Float32(cutlass.select_(self.odd, recv, a0[e])))
                d2.append(Float32(cutlass.select_(self.odd, a1[e], recv)))
            self._store(row + 8 * rh, b, col_bytes, d1[0], d1[1], d1[2], d1[3])
            self._store(row + 8 * rh + 1, b, col_bytes, d2[0], d2[1], d2[2], d2[3])

    @cute.jit
    def chunk(self, acc_kv, ch: cutlass.Constexpr, b) -> None:
        """Scatter a whole 64 x 64 chunk."""
        for ln in cutlass.range_constexpr(2):
            vals = [acc_kv[i] for i in HALF_IDX[ln]]
            self._rows(vals, self.row_pair, b, Int64((ch * 64 + 32 * ln) * self.elem))

    @cute.jit
    def half(self, vals, ch: cutlass.Constexpr, b, half) -> None:
        """Scatter the 32-column half ``half`` (runtime: the CTA's rank) of chunk ``ch``."""
        self._rows(vals, self.row_pair, b, Int64(ch * 64 * self.elem) + Int64(half * (32 * self.elem)))


#: Fragment indices of the two 32-column halves of a 64 x 64 chunk accumulator, in the order the
#: scatter consumes them: ``(row half rh, column group g in the half, v)``.
HALF_IDX = tuple(
    tuple(dev.acc_flat(v, rh, 4 * ln + g) for rh in (0, 1) for g in range(4) for v in (0, 1)) for ln in (0, 1)
)


class _Exchange:
    """The DSMEM exchange of one consumer thread (h_q % 128 == 0): the two CTAs of a head-block
    pair each own one 32-column half of every dKV chunk (rank r: columns ``32 r .. 32 r + 31``).

    Per chunk ``k`` (counted over the kernel), a thread rounds the 16 values of the peer's half to
    bf16 and ``st.async``-es them (2 x 16 bytes) into slot ``k % n_slots`` of the peer's landing
    area of its warpgroup (4 KB slots, thread-major 16-byte words: conflict-free), which completes
    the bytes on the peer's ``MB_LAND_FULL`` of that slot; ``lag`` chunks later it waits on its own
    one, adds the peer's 16 values (widened to float32) to the float32 ones it kept, and scatters
    them.  bf16 because the slots are what hides the DSMEM round trip (one float32 slot measured
    1.28x slower than no exchange at all) and the d_qk 576 smem plan has 24 KB for them (three
    k-tiles of the KV buffer): each (token, slot) sum thus carries one bf16 rounding of the peer's
    partial (relative 2^-9 of that partial, the deterministic mode's per-row rounding).

    Flow control: ``MB_SEND_OK`` of a slot in the sender collects one remote arrival per warp when
    the peer's slot is free -- once per block after the peer's dQ products (d576: the area is the
    KV buffer's last k-tiles, read until then; WG0's third slot lies in k-tile 6, which WG1's dQ
    reads, so WG1's warps free it), and after the peer consumed the slot's previous use within the
    block.  The receiver re-arms the slot's ``MB_LAND_FULL`` (expect-tx) after each read; the next
    phase cannot complete before every warp has read (the sender needs all four arrivals first).
    The block's last read arrives on ``MB_DRAINED`` (d576) so that the producer may gather the
    next block's piece C there.
    """

    def __init__(self, kernel: SparseMlaBwdSm90, storage, mbar, wg, idx_in_wg, h_blk):
        # few live registers: the peer's addresses are mapped (mapa) where they are used
        self.land_in_kv = kernel.land_in_kv
        self.n_slots = kernel.n_slots
        self.rank = Int32(0)
        if kernel.pair_sum:
            self.rank = pair_rank(h_blk)
            self.tid = idx_in_wg
            if kernel.land_in_kv:
                # slots 0, 1: WG0 the RoPE k-tile (read by WG0 only), WG1 k-tile n-2 (WG1's last dQ
                # tile); slot 2: a half of k-tile n-3 (WG0 the second, WG1 the first)
                land = dev.smem_addr_u32(storage.sK.data_ptr()) + (kernel.n_k_tiles - 1 - wg) * TILE_BYTES
            else:
                land = dev.smem_addr_u32(storage.sLand.data_ptr()) + wg * (kernel.n_slots * SLOT_BYTES)
            self.land = land + idx_in_wg * 16
            self.full = mbar + MB_LAND_FULL + MAX_SLOTS * wg
            self.send_ok = mbar + MB_SEND_OK + MAX_SLOTS * wg
            self.send_ok_wg0 = mbar + MB_SEND_OK
            self.drained = mbar + MB_DRAINED

    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    def _peer(self, addr):
        return dev.mapa_shared(addr, 1 - self.rank)

    def _slot_addr(self, slot, wg: cutlass.Constexpr):
        """This thread's 16-byte word in landing slot ``slot`` (runtime) of warpgroup ``wg``'s
        area (d576, slot 2: k-tile n-3's second half for WG0, its first half for WG1)."""
        off = slot * SLOT_BYTES
        if const_expr(self.n_slots == 3):
            off = Int32(cutlass.select_(slot == 2, Int32((-2 + wg) * TILE_BYTES + (1 - wg) * SLOT_BYTES), off))
        return self.land + off

    @cute.jit
    def _free_peer_slot(self, send_ok) -> None:
        """One arrival per warp on the peer's ``MB_SEND_OK`` barrier ``send_ok`` (after
        ``sync_warp``: every lane's reads of the slot are done)."""
        cute.arch.sync_warp()
        if self.tid % 32 == 0:
            dev.mbarrier_arrive_cluster(self._peer(dev.smem_addr_u32(send_ok)))

    @cute.jit
    def dq_done(self, exchange: cutlass.Constexpr, wg: cutlass.Constexpr) -> None:
        """Warpgroup ``wg``'s dQ products are done: the peer may write into the landing slots that
        lie in k-tiles this CTA has stopped reading for the block."""
        if const_expr(exchange):
            for slot in cutlass.range_constexpr(self.n_slots):
                if const_expr(not (self.n_slots == 3 and wg == 0 and slot == 2)):
                    self._free_peer_slot(self.send_ok + slot)
            if const_expr(self.n_slots == 3 and wg == 1):
                self._free_peer_slot(self.send_ok_wg0 + 2)  # WG0's slot in k-tile n-3

    def kept(self, acc_kv):
        """The 16 values of this CTA's own half."""
        return [Float32(cutlass.select_(self.rank == 1, acc_kv[HALF_IDX[1][j]], acc_kv[HALF_IDX[0][j]]))
                for j in range(16)]

    @cute.jit
    def send(self, acc_kv, k, wg: cutlass.Constexpr) -> None:
        """st.async the peer's half of chunk ``k`` (bf16) into the peer's landing slot ``k % n_slots``."""
        slot = k % self.n_slots
        cute.arch.mbarrier_wait(self.send_ok + slot, (k // self.n_slots) & 1)
        peer_land = self._peer(self._slot_addr(slot, wg))
        peer_full = self._peer(dev.smem_addr_u32(self.full + slot))
        v = [Float32(cutlass.select_(self.rank == 1, acc_kv[HALF_IDX[0][j]], acc_kv[HALF_IDX[1][j]]))
             for j in range(16)]
        for q in cutlass.range_constexpr(2):
            w = [dev.pack_bf16x2(v[8 * q + 2 * i], v[8 * q + 2 * i + 1]) for i in range(4)]
            dev.st_async_v4_b32(peer_land + q * 2048, w[0], w[1], w[2], w[3], peer_full)

    @cute.jit
    def receive(self, kept, k, c: cutlass.Constexpr, n: cutlass.Constexpr, wg: cutlass.Constexpr, tr, b, ev: cutlass.Constexpr,
                rec):
        """Wait for the peer's half of chunk ``k`` (chunk ``c`` of ``n`` of the block), add it to
        ``kept``; free the slot.  (``tr``: the trace stamps event ``ev`` of block ``b`` after the wait.)"""
        slot = k % self.n_slots
        cute.arch.mbarrier_wait(self.full + slot, (k // self.n_slots) & 1)
        tr.stamp(b, ev, rec)
        out = []
        land = self._slot_addr(slot, wg)
        for q in cutlass.range_constexpr(2):
            r = dev.ld_shared_v4_bf16x2_f32(land + q * 2048)
            for e in cutlass.range_constexpr(8):
                out.append(kept[8 * q + e] + r[e])
        if self.tid == 0:
            dev.mbarrier_arrive_expect_tx(dev.smem_addr_u32(self.full + slot), Int32(SLOT_BYTES))  # re-arm
        if const_expr(c + self.n_slots < n):
            self._free_peer_slot(self.send_ok + slot)  # the slot's next use is in this block
        if const_expr(c == n - 1 and self.land_in_kv):
            cute.arch.mbarrier_arrive(self.drained)
        return out


def _ws_col_perm():
    """Natural column -> position in a 16-column group of the workspace (see :class:`_Scatter`):
    workspace column ``4q + e`` of a group holds natural column ``8 (e // 2) + 2q + e % 2``."""
    perm = [0] * 16
    for j in range(16):
        q, e = j // 4, j % 4
        perm[8 * (e // 2) + 2 * q + e % 2] = j
    return tuple(perm)


#: ``natural[..., c] = workspace[..., WS_COL_PERM[c]]`` within every 16-column group.
WS_COL_PERM = _ws_col_perm()

SparseMlaBwdSm90.ws_col_perm = WS_COL_PERM
