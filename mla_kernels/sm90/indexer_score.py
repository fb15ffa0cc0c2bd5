"""Indexer scores on Hopper (sm_90a), CuTe DSL:
``I[t, s] = sum_j w_eff[t, j] * ReLU(q[t, j] . k[s]) (* k_scale[s])`` for a block of query rows.

``w_eff = weights * sm_scale`` (``* q_scale`` for float8 inputs) is prepared on the host; the
float8 path multiplies by ``k_scale[s]`` after the head sum (ReLU commutes with the positive
scales).  Written to ``out[t - q0, s]`` (float32) for every key ``s`` of the key tiles that
intersect the query tile's key ranges; inside those tiles, keys outside ``[k_start[t], k_end[t])``
get ``-inf``.  Tiles outside every range are skipped (causal skipping): the caller pre-fills
``out`` with ``-inf`` where it needs the dense form (``indexer_logits``); the top-k reads only
``[k_start[t], k_end[t])`` of each row.

One CTA per query tile of ``2 BQ`` queries, ``BQ = 256 / h`` per consumer warpgroup (so that
``BQ * h = 256`` is the wgmma N); 384 threads:

* WG2, warp 0 -- producer: the two Q tiles (``[BQ*h, d]`` each, TMA) once, then the key tiles
  (``[64, d]``, TMA) through a ``PipelineTmaAsync`` ring of ``stages`` buffers;
* WG0, WG1 -- consumers of every key tile, each with its own Q tile: ``S^T = K Q^T`` (64 keys x
  256 (query, head) columns, keys on the wgmma's M so that the head sum is a row-wise reduction
  inside a thread plus a quad reduce-scatter), then ``sum_j w_eff * ReLU`` per (key, query) and
  masked 4-byte stores (8 consecutive keys per 8 lanes: full 32-byte sectors).  Sharing each key
  tile between the two warpgroups halves the L2 -> smem key traffic per FLOP (one query tile per
  key tile needed ~16 B/clk/SM at the tensor rate); the tensor core serialises the two MMAs, so
  one warpgroup's epilogue runs under the other's MMA.

Heavy query tiles (late in a causal sequence) are launched first.

``w_regs``: each consumer thread holds its 64 columns' weights in registers (loaded once) instead
of reading them from shared memory for every key tile (64 loads per thread per tile, each a
full shared-memory wavefront that competes with the wgmma operand reads).

``ks_early`` (float8): each key tile's two ``k_scale`` values per thread are loaded at the top of
its iteration, before the pipeline wait and the MMA, so that their global-load latency hides
under the MMA instead of sitting in the epilogue (the first version loaded them just before the
stores: measured 8.19 ms for the score kernel at S 32k, H200, where the MMAs alone take 5.42).

``sum_parts``: each (key, query) head sum runs as that many independent FMA chains (default 1:
the serial chain of 16 dependent FMAs per lane and sum, which ptxas schedules one chain after
another between the ReLUs; 2 and 4 interleave them at the cost of a few FADDs -- on an H200 they
moved ``indexer_topk`` fp8 by -0.3 / -0.2 ms and bf16 by +0.4 / +1.7 ms in one run, so they stay
options).

``hist`` (``h == 64``): each CTA also counts its rows' in-range scores in shared 2048-bin
histograms of the top-k's first radix digit (the top 11 bits of
:func:`~mla_kernels.common.indexer_device.ordered_key`; 16-bit counters, two per word, so a row
must have fewer than 65,536 keys in range: the host asks for it only when ``s_kv < 65536``) and
writes them to ``hist[t - q0, :]`` (int32) at the end, so that the top-k kernel does not read each
row once more for its first histogram (``indexer_topk.py``, ``pre_hist``).  Modes
(:data:`HIST_MODES`): ``plain`` -- one shared atomic per score (two per thread per key tile),
rows 1024 words apart; ``pad`` -- rows :data:`HIST_PITCH` words apart, so that the same bin of
the warp's 4 rows sits in 4 different banks.  ``hist=True`` is :data:`DEFAULT_HIST`.  An option,
off by default: on an H200 at S 32k the counting costs the score kernel more (bf16 +1.3 ms,
fp8 +0.2 ms) than it saves the top-k kernel (-0.65 ms), see docs/PERF.md.  (A third mode that
merged a warp's equal (row, bin) counts by ``match.any.sync`` first cost +4 ms: removed.)

``pingpong`` (opt-in): the two consumer warpgroups take turns issuing their MMAs (each syncs its
own named barrier ``BAR_PP0 + wg`` before issuing and arrives on the other's after committing;
WG1 arrives once before its loop so that WG0 starts, and skips its last arrive so that none is
left pending), FlashAttention-3's schedule, so that one warpgroup's epilogue runs under the
other's MMA.  Measured no faster on an H200 at S 32k (score kernel fp8 8.58 vs 8.65 ms, bf16
13.19 vs 12.58; MMAs alone 5.49 / 10.80): the epilogue does not overlap the MMAs in either
schedule, so the default issues without turns (docs/PERF.md).

``head_sum="bf16x2"`` (opt-in): the head sum in packed bf16 -- per pair of adjacent heads one
``cvt.rn.relu.bf16x2.f32`` and one ``fma.rn.bf16x2`` against bf16-packed weights, a row's pairs
accumulated in one bf16x2 word whose halves are summed in float32
(:func:`~mla_kernels.common.indexer_device.weighted_relu_rows_bf16x2`): ~9 instructions per 16
scores instead of 32.  H200, S 32k: score kernel bf16 12.58 -> 11.45 ms, fp8 8.65 -> 7.88; the
logits are within ~1e-2 of the row's largest |logit| (median 5e-4) and 0.26% of the selected keys
differ from the float32 head sum's.

``profile`` (timing copies only, wrong outputs): ``"mma"`` drops the epilogue (the key tiles'
MMAs and the pipeline alone), ``"nostore"`` computes the epilogue but does not store it.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.nvgpu.common import OperandMajorMode

from ..common import indexer_device as idev
from .. import tma

BM = 64  # keys per consumer tile (the wgmma M)
BN = 256  # (query, head) columns per CTA (the wgmma N)
THREADS = 384
SMEM_LIMIT = 232448
BAR_W = 1  # the consumers' weights are in smem (and, with ``hist``, the histograms zeroed / complete)
BAR_HIST = 2  # with ``hist``: every consumer's counts are in (the histograms are written out)
#: The head sum's arithmetic: ``f32`` (default: FMNMX + FFMA per score) or ``bf16x2`` (opt-in:
#: packed ReLU + bf16x2 FMA per two scores, see :func:`~mla_kernels.common.indexer_device.weighted_relu_rows_bf16x2`)
HEAD_SUMS = ("f32", "bf16x2")
BAR_PP0 = 3  # ``pingpong``: WG0 may issue its MMA (WG1 syncs BAR_PP0 + 1; 256 threads: sync + arrive)
BINS = 2048  # the top-k's first digit: the top 11 bits of the ordered key
HIST_SHIFT = 21
HIST_MODES = ("plain", "pad")
DEFAULT_HIST = "pad"
HIST_PITCH = BINS // 2 + 8  # words per row's counters in ``pad``


def smem_atom_kind(row_bytes: int):
    """The K-major swizzle atom whose span divides a ``row_bytes``-byte row."""
    if row_bytes % 128 == 0:
        return warpgroup.SmemLayoutAtomKind.K_SW128
    if row_bytes % 64 == 0:
        return warpgroup.SmemLayoutAtomKind.K_SW64
    return warpgroup.SmemLayoutAtomKind.K_SW32


class IndexerScoreSm90:
    """Static configuration (input dtype, h, d) + host launcher + device kernel."""

    def __init__(self, fp8: bool, h: int, d: int, profile: str = "", w_regs: bool = True, ks_early: bool = True,
                 sum_parts: int = idev.SUM_PARTS, hist=False, stages: int = 0, pingpong: bool = False,
                 head_sum: str = "f32"):
        if h not in (16, 32, 64):
            raise ValueError(f"sm90 indexer scores take h_idx 16, 32 or 64, got {h}")
        if d not in (64, 128):
            raise ValueError(f"sm90 indexer scores take d_idx 64 or 128, got {d}")
        if profile not in ("", "mma", "nostore"):
            raise ValueError(f"profile {profile!r}: expected '', 'mma' or 'nostore'")
        self.profile = profile
        self.pingpong = pingpong
        if head_sum not in HEAD_SUMS:
            raise ValueError(f"head_sum {head_sum!r}: expected one of {HEAD_SUMS}")
        self.packed = head_sum == "bf16x2"
        if self.packed and not w_regs:
            raise ValueError("head_sum 'bf16x2' takes the weights in registers (w_regs=True)")
        self.w_regs = w_regs
        self.ks_early = ks_early
        self.sum_parts = sum_parts
        self.fp8 = fp8
        self.dtype = Float8E4M3FN if fp8 else BFloat16
        self.elem = 1 if fp8 else 2
        self.h = h
        self.d = d
        self.bq = BN // h  # queries per consumer warpgroup
        self.cq = 2 * self.bq  # queries per CTA
        self.stages = stages or (5 if (d * self.elem) == 256 else 8)
        if hist is True:
            hist = DEFAULT_HIST
        if hist and hist not in HIST_MODES:
            raise ValueError(f"hist {hist!r}: expected one of {HIST_MODES}")
        self.hist_mode = hist if (hist and profile == "") else ""
        self.hist = bool(self.hist_mode)
        self.pitch = BINS // 2 if self.hist_mode == "plain" else HIST_PITCH
        if self.hist:
            if h != 64:
                raise ValueError(f"the fused histogram takes h_idx 64 (8 queries per CTA), got {h}")
            # the histograms (8 rows of counters) beside Q, K and the weights: fewer key stages
            # where they would not fit (bf16 d 128: 4 instead of 5)
            fixed = 2 * BN * d * self.elem + self.cq * self.pitch * 4 + 2 * BN * 4 + 512
            while fixed + self.stages * BM * d * self.elem > SMEM_LIMIT:
                self.stages -= 1
        self.regs_consumer = 232
        self.regs_producer = 40
        assert 2 * self.regs_consumer + self.regs_producer <= 504
        self.smem_bytes = 0

    def _mma(self):
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), (BM, BN)
        )

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [s_q * h, d] bf16 / fp8 (q viewed 2-D)
        mK: cute.Tensor,  # [s_kv, d]
        mW: cute.Tensor,  # [s_q * h] f32: weights * sm_scale (* q_scale)
        mKScale: cute.Tensor,  # [s_kv] f32 (read only for fp8)
        mStart: cute.Tensor,  # [s_q] int32
        mEnd: cute.Tensor,  # [s_q] int32
        mOut: cute.Tensor,  # [rows, ld] f32: row r is query q0 + r
        mHist: cute.Tensor,  # [>= rows, 2048] int32 (out; written only with ``hist``)
        q0: Int32,  # a multiple of 256 / h
        s_kv: Int32,  # keys (mK may carry zero rows past them: a TMA box is not taller than its tensor)
        stream,
    ):
        atom = warpgroup.make_smem_layout_atom(smem_atom_kind(self.d * self.elem), self.dtype)
        sQ_layout = cute.tile_to_shape(atom, (BN, self.d, 2), (0, 1, 2))  # one tile per consumer WG
        sQ_one = cute.slice_(sQ_layout, (None, None, 0))
        sK_layout = cute.tile_to_shape(atom, (BM, self.d, self.stages), (0, 1, 2))
        sK_one = cute.slice_(sK_layout, (None, None, 0))
        tma_atom_q, tma_q = tma.tile_load_atom(mQ, sQ_one, (BN, self.d))
        tma_atom_k, tma_k = tma.tile_load_atom(mK, sK_one, (BM, self.d))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[Float32, 2 * BN], 16]
            pipe: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            bar_q: cute.struct.MemRange[cutlass.Int64, 1]
            hist: cute.struct.Align[cute.struct.MemRange[Int32, self.cq * self.pitch if self.hist else 4], 16]

        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes <= SMEM_LIMIT, f"smem {self.smem_bytes} > {SMEM_LIMIT}"
        rows = mOut.shape[0]
        n_tiles = (rows + (self.cq - 1)) // self.cq
        self.kernel(
            mW, mKScale, mStart, mEnd, mOut, mHist, q0, s_kv, tma_atom_q, tma_q, tma_atom_k, tma_k,
            sQ_layout, sK_layout, SharedStorage, n_tiles,
        ).launch(grid=[n_tiles, 1, 1], block=[THREADS, 1, 1], smem=self.smem_bytes, stream=stream,
                 min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        mW: cute.Tensor,
        mKScale: cute.Tensor,
        mStart: cute.Tensor,
        mEnd: cute.Tensor,
        mOut: cute.Tensor,
        mHist: cute.Tensor,
        q0: Int32,
        s_kv: Int32,
        tma_atom_q: cute.CopyAtom,
        tma_q: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        tma_k: cute.Tensor,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
        n_tiles: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp_idx // 4
        idx_in_wg = tidx % 128
        tile = n_tiles - 1 - bidx  # heavy (late) query tiles first
        qt0 = q0 + tile * self.cq
        s_q = mStart.shape[0]

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        bar_q = storage.bar_q.data_ptr()
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(bar_q, 1)
        k_bytes = BM * self.d * self.elem
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.pipe.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),  # lane 0 of 8 warps
            tx_count=k_bytes,
        )
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sW = storage.sW.get_tensor(cute.make_layout(2 * BN))
        n_hist = self.cq * self.pitch if self.hist else 4
        sHist = storage.hist.get_tensor(cute.make_layout(n_hist))

        # The key tiles this query tile needs: the union of its rows' ranges.
        k_lo = s_kv
        k_hi = Int32(0)
        for i in cutlass.range_constexpr(self.cq):
            t = qt0 + i
            if t < s_q:
                st = mStart[t]
                en = mEnd[t]
                if en > st:
                    k_lo = cutlass.min(k_lo, st)
                    k_hi = cutlass.max(k_hi, en)
        tile_lo = k_lo // BM
        n_k = Int32(0)
        if k_hi > k_lo:
            n_k = (k_hi + (BM - 1)) // BM - tile_lo

        if wg == 2:
            cute.arch.setmaxregister_decrease(self.regs_producer)
            if warp_idx == 8:
                gQ = cute.local_tile(tma_q, (BN, self.d), (None, 0))
                tQsQ, tQgQ = cpasync.tma_partition(
                    tma_atom_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
                )
                gK = cute.local_tile(tma_k, (BM, self.d), (None, 0))
                tKsK, tKgK = cpasync.tma_partition(
                    tma_atom_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
                )
                if n_k > 0:
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(bar_q, 2 * BN * self.d * self.elem)
                    q_tile = q0 // self.bq + 2 * tile  # q0 is a multiple of cq
                    for w in cutlass.range_constexpr(2):
                        cute.copy(tma_atom_q, tQgQ[None, q_tile + w], tQsQ[None, w], tma_bar_ptr=bar_q)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                for i in cutlass.range(n_k, unroll=1):
                    pipe.producer_acquire(state)
                    cute.copy(tma_atom_k, tKgK[None, tile_lo + i], tKsK[None, state.index],
                              tma_bar_ptr=pipe.producer_get_barrier(state))
                    pipe.producer_commit(state)
                    state.advance()
        else:
            cute.arch.setmaxregister_increase(self.regs_consumer)
            # weights of the CTA's (query, head) columns; 0 past s_q
            for e in cutlass.range_constexpr(2):
                c = e * 256 + wg * 128 + idx_in_wg
                w = Float32(0.0)
                if qt0 + c // self.h < s_q:
                    w = mW[Int64(qt0) * self.h + c]
                sW[c] = w
            ct = wg * 128 + idx_in_wg
            if const_expr(self.hist):
                for e in cutlass.range_constexpr((n_hist + 255) // 256):
                    if e * 256 + ct < n_hist:
                        sHist[e * 256 + ct] = Int32(0)
            cute.arch.barrier(barrier_id=BAR_W, number_of_threads=256)
            if n_k > 0:
                cute.arch.mbarrier_wait(bar_q, 0)
                self.consumer(mKScale, mStart, mEnd, mOut, sQ, sK, sW, sHist, pipe, q0, qt0 + wg * self.bq, s_q,
                              s_kv, tile_lo, n_k, wg, idx_in_wg)
                if const_expr(self.hist):
                    # every consumer's counts are in: the rows' histograms out, counters unpacked
                    cute.arch.barrier(barrier_id=BAR_HIST, number_of_threads=256)
                    n_rows_out = mOut.shape[0]
                    for e in cutlass.range(self.cq * (BINS // 2) // 256, unroll=1):
                        wi = e * 256 + ct
                        t = qt0 + wi // (BINS // 2)
                        if t < s_q and t - q0 < n_rows_out:
                            x = sHist[(wi // (BINS // 2)) * self.pitch + wi % (BINS // 2)]
                            col = 2 * (wi % (BINS // 2))
                            mHist[t - q0, col] = x & Int32(0xFFFF)
                            mHist[t - q0, col + 1] = (x >> Int32(16)) & Int32(0xFFFF)

    @cute.jit
    def consumer(self, mKScale, mStart, mEnd, mOut, sQ, sK, sW, sHist, pipe, q0, qt0, s_q, s_kv, tile_lo, n_k, wg,
                 idx_in_wg):
        mma = self._mma()
        thr = mma.get_slice(idx_in_wg)
        tSrK = thr.make_fragment_A(thr.partition_A(sK))  # (MMA, M, K, stage)
        tSrQ = thr.make_fragment_B(thr.partition_B(sQ))  # (MMA, N, K, Q tile)
        acc = thr.make_fragment_C(thr.partition_shape_C((BM, BN)))
        lane = idx_in_wg % 32
        lane_quad = lane % 4
        row0 = (idx_in_wg // 32) * 16 + lane // 4
        qpl = self.bq // 4  # queries per lane after the quad reduce-scatter
        # This lane's queries (after the reduce-scatter): qt0 + lane_quad * qpl + k.
        rStart = cute.make_rmem_tensor((qpl,), Int32)
        rEnd = cute.make_rmem_tensor((qpl,), Int32)
        rRow = cute.make_rmem_tensor((qpl,), Int64)
        for k in cutlass.range_constexpr(qpl):
            t = qt0 + lane_quad * qpl + k
            st = Int32(0)
            en = Int32(0)
            if t < s_q:
                st = mStart[t]
                en = mEnd[t]
            rStart[k] = st
            rEnd[k] = en
            rRow[k] = Int64(t - q0) * Int64(mOut.shape[1])
        n_rows_out = mOut.shape[0]
        vals = cute.make_rmem_tensor((2 * self.bq,), Float32)
        n_k_tiles = cute.size(tSrQ, mode=[2])
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        w_off = wg * BN
        rW = cute.make_rmem_tensor((2 * BN // 8 if self.w_regs else 2,), Float32)
        if const_expr(self.w_regs):
            idev.load_weight_cols(rW, sW, w_off, BN, lane_quad)
        rWp = cute.make_rmem_tensor((BN // 8 if self.packed else 1,), Uint32)
        if const_expr(self.packed):
            idev.load_weight_pairs(rWp, rW, BN // 8)
        rKs = cute.make_rmem_tensor((2,), Float32)
        if const_expr(self.pingpong):
            if wg == 1:  # WG0 issues the first MMA
                cute.arch.barrier_arrive(barrier_id=BAR_PP0, number_of_threads=256)
        hist_row0 = (wg * self.bq + lane_quad * qpl) * self.pitch  # this lane's first row's counters
        for i in cutlass.range(n_k, unroll=1):
            key0 = (tile_lo + i) * BM
            if const_expr(self.fp8 and self.ks_early):  # issued before the wait: latency under the MMA
                for r in cutlass.range_constexpr(2):
                    key_e = key0 + row0 + 8 * r
                    ks_e = Float32(1.0)
                    if key_e < s_kv:
                        ks_e = mKScale[key_e]
                    rKs[r] = ks_e
            pipe.consumer_wait(state)
            if const_expr(self.pingpong):  # this warpgroup's turn to issue (the other one issued its MMA)
                cute.arch.barrier(barrier_id=BAR_PP0 + wg, number_of_threads=256)
            mma_i = self._mma()
            cute.nvgpu.warpgroup.fence()
            for k in cutlass.range_constexpr(n_k_tiles):
                mma_i.set(warpgroup.Field.ACCUMULATE, k != 0)
                cute.gemm(mma_i, acc, tSrK[None, None, k, state.index], tSrQ[None, None, k, wg], acc)
            cute.nvgpu.warpgroup.commit_group()
            if const_expr(self.pingpong):
                # the other warpgroup's turn; WG1's last arrive is skipped (WG0 has no tile left to
                # sync for: every arrive meets one sync, none is left pending at exit)
                if wg == 0 or i + 1 < n_k:
                    cute.arch.barrier_arrive(barrier_id=BAR_PP0 + 1 - wg, number_of_threads=256)
            cute.nvgpu.warpgroup.wait_group(0)
            pipe.consumer_release(state)
            state.advance()
            if const_expr(self.profile == "mma"):  # timing copy: the MMAs alone (a store never taken)
                if acc[0] == Float32(-1.2345e-30):
                    mOut[0, 0] = acc[1]
            else:
                # head sum per (key row, query), then the quad reduce-scatter
                for qi in cutlass.range_constexpr(self.bq):
                    if const_expr(self.packed):
                        s0, s1 = idev.weighted_relu_rows_bf16x2(acc, rWp, qi * self.h, self.h)
                    elif const_expr(self.w_regs):
                        s0, s1 = idev.weighted_relu_rows_reg(acc, rW, qi * self.h, self.h, self.sum_parts)
                    else:
                        s0, s1 = idev.weighted_relu_rows(acc, sW, w_off, qi * self.h, self.h, lane_quad,
                                                         self.sum_parts)
                    vals[2 * qi] = s0
                    vals[2 * qi + 1] = s1
                idev.quad_reduce_scatter(vals, 2 * self.bq, lane)
                for r in cutlass.range_constexpr(2):
                    key = key0 + row0 + 8 * r
                    if key < s_kv:
                        ks = Float32(1.0)
                        if const_expr(self.fp8 and self.ks_early):
                            ks = rKs[r]
                        elif const_expr(self.fp8):
                            ks = mKScale[key]
                        for k in cutlass.range_constexpr(qpl):
                            t = qt0 + lane_quad * qpl + k
                            if t < s_q and t - q0 < n_rows_out:
                                inr = (key >= rStart[k]) & (key < rEnd[k])
                                v = Float32(cutlass.select_(inr, vals[2 * k + r] * ks, Float32(-math.inf)))
                                out = cute.make_tensor(mOut.iterator + (rRow[k] + Int64(key)), cute.make_layout(1))
                                if const_expr(self.profile == "nostore"):  # timing copy: a store never taken
                                    if v == Float32(-1.2345e-30):
                                        out[0] = v
                                else:
                                    out[0] = v
                                if const_expr(self.hist):
                                    # this row's first-digit bin (the top-k's key of the stored value);
                                    # row (wg * bq + lane_quad * qpl + k) of the CTA, 16-bit counters
                                    if inr:
                                        kb = idev.ordered_key(v) >> Uint32(HIST_SHIFT)
                                        word = hist_row0 + k * self.pitch + Int32(kb >> Uint32(1))
                                        inc = Int32(1) << Int32((kb & Uint32(1)) * Uint32(16))
                                        cute.arch.atomic_add(sHist.iterator + word, inc)


def compile_score(fp8: bool, h: int, d: int, arch: str = "sm_90a", profile: str = "", w_regs: bool = True,
                  ks_early: bool = True, sum_parts: int = 1, hist=False, stages: int = 0, pingpong: bool = False,
                  head_sum: str = "f32", **kw):
    """Compile the score kernel for one static configuration (no GPU needed)."""
    from .. import _compile
    from ..common import host

    dt = Float8E4M3FN if fp8 else BFloat16
    n_qh, s_kv, n_w, n_ks, s_q, s_q2, rows, ld, h_rows, h_cols = (cute.sym_int() for _ in range(10))
    kernel = IndexerScoreSm90(fp8, h, d, profile, w_regs, ks_early, sum_parts, hist, stages, pingpong, head_sum)
    args = (
        host.fake(dt, (n_qh, d)),
        host.fake(dt, (s_kv, d)),
        host.fake(Float32, (n_w,), align=4),
        host.fake(Float32, (n_ks,), align=4),
        host.fake(Int32, (s_q,), align=4),
        host.fake(Int32, (s_q2,), align=4),
        host.fake(Float32, (rows, ld), align=4),
        host.fake(Int32, (h_rows, h_cols), align=4),
        Int32(0),
        Int32(0),
        host.fake_stream(),
    )
    return kernel, _compile.compile_kernel(kernel, *args, arch=arch, **kw)
