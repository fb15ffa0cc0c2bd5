"""The indexer's KL loss backward on Hopper (sm_90a), CuTe DSL, fused: ``dI = (pi - p) g`` and the
three gradients without per-head intermediates in HBM.

One CTA (one warpgroup, 128 threads) per query ``t``.  Per block of 64 selected slots (the key
rows gathered by ``cp.async`` through :class:`~mla_kernels.common.indexer_device.SparseKeyRing`):

1. ``S^T = K_sel q_t^T`` (wgmma SS, 64 slots x 64 heads); the logits ``I_j`` as in the forward,
   ``pi_j = exp(I_j - lse_t)``, ``p_j = target_j * inv_tsum_t``, ``dI_j = (pi_j - p_j) g_t``
   (0 on invalid slots);
2. in registers: ``dw_h += dI_j ReLU(S^T[j, h])`` (per-thread column partials) and
   ``dS^T[j, h] = dI_j w_eff[h] [S^T[j, h] > 0]`` (bf16), which is the A operand of
3. ``dK_sel = dS^T q_t`` (wgmma RS, 64 slots x 64 columns per chunk, ``q_t^T`` read MN-major from
   the same smem tile), scattered into a float32 ``dk`` workspace with 16-byte
   ``red.global.add.v4.f32`` (rearranged so that 8 lanes cover one 128-byte line), or
   (``red_bf16``, an opt-in) into a bf16 ``dk`` workspace with 8-byte
   ``red.global.add.noftz.v2.bf16x2`` (half the bytes; every addition rounds the running sum to
   bf16, so dk carries the error of a bf16 accumulation over every query that selected the key), or
   (``dk_bulk``) staged in shared memory and added one 256-byte row per
   ``cp.reduce.async.bulk .add.f32`` (the reduction done by the TMA unit and L2).  Deterministic
   modes: ``fixed_*`` add ``round(dK * 2^e)`` as 64-bit integers into an int64 ``[s_kv, d]``
   workspace (integer addition is associative: the sum is the same whatever order the additions
   arrive in; ``2^e`` comes from the host's bound on every partial sum, see ``indexer_host``) --
   ``fixed_bulk64`` (the fastest of these; ``deterministic=True``'s default here, the host's is
   ``slots_bf16`` below) stages each whole 64-column chunk in smem and
   adds one 512-byte row per ``cp.reduce.async.bulk .add.u64`` (3 key stages instead of 4, for
   smem); ``fixed_bulk`` 32-column pieces (4 stages), ``fixed_bulk2`` 16-column pieces in two
   alternating buffers (the wait for a piece's smem read overlaps the next piece),
   ``fixed_bulk32x2`` 32-column pieces in two buffers (3 stages); ``fixed_red`` 8-byte ``red.global.add.u64`` from registers --; ``slots`` stores each slot's row to the query's own
   workspace rows (the host sums them in a fixed order: sort + segment sum); ``slots_bf16`` the
   same rows rounded to bf16 (8-byte stores) at the workspace row ``pos[t, j]`` the host gave
   each valid slot, grouped by key (``indexer_host``'s ``grouped`` mode, the default deterministic
   one: summed in fixed point after the kernel).  ``none`` (profiling
   only: dk is not formed) measures what the dk additions cost;
4. ``dS^T`` through shared memory (stmatrix) for ``dq_t += dS K_sel`` (wgmma SS, both operands
   MN-major views), accumulated in registers over the blocks.

The slots' indices and targets (for ``dI``) are loaded one block ahead (``prefetch``; the first
version loaded them after the S MMA, in the dependent path of every block).

At the end ``dq_t`` (bf16) and ``dw_t = sm_scale * sum`` are stored.  A row with
``inv_tsum = 0`` (no valid slot or zero target sum) skips the blocks and stores zeros.
``w_eff = weights * sm_scale``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warp, warpgroup
from cutlass.cute.nvgpu.common import OperandMajorMode

from ..common import device as dev
from ..common import indexer_device as idev
from ..common.gather import copy_dense_rows
from .indexer_loss_fwd import B_TOPK, H, block_scores, loss_fake_args

THREADS = 128
BAR_RING = 1
BAR_DS = 2
BAR_DK = 3  # fixed_bulk*: a staging buffer's previous bulk read is done
BAR_DK2 = 4  # fixed_bulk*: the staged piece is written
DK_PITCH = 68  # floats per staged dK row (bulk mode): 16-byte aligned, rows 4 banks apart
#: dk modes: how the per-slot dK rows are added (see the module docstring)
DK_MODES = ("red", "red_bf16", "bulk", "none", "slots", "slots_bf16", "fixed_bulk", "fixed_bulk2", "fixed_bulk64",
            "fixed_bulk32x2", "fixed_red")
DETERMINISTIC_MODES = ("slots", "slots_bf16", "fixed_bulk", "fixed_bulk2", "fixed_bulk64", "fixed_bulk32x2", "fixed_red")
#: fixed-point staging: (columns per piece, buffers); staging over 18 KB leaves 3 key stages
_FIXED_STAGING = {"fixed_bulk": (32, 1), "fixed_bulk2": (16, 2), "fixed_bulk64": (64, 1), "fixed_bulk32x2": (32, 2)}
K_MAJ = OperandMajorMode.K
MN_MAJ = OperandMajorMode.MN


class IndexerLossBwdSm90:
    """Static configuration (d, topk_length given, deterministic) + launcher + kernel."""

    def __init__(self, d: int, has_topk_length: bool, dk_mode: str = "red", prefetch: bool = True,
                 sum_parts: int = idev.SUM_PARTS):
        if d not in (64, 128):
            raise ValueError(f"sm90 indexer loss takes d_idx 64 or 128, got {d}")
        if dk_mode not in DK_MODES:
            raise ValueError(f"dk_mode {dk_mode!r}: expected one of {DK_MODES}")
        self.d = d
        self.has_topk_length = has_topk_length
        self.dk_mode = dk_mode
        self.prefetch = prefetch
        self.sum_parts = sum_parts  # FMA chains per logit's head sum (indexer_device.weighted_relu_rows)
        self.deterministic = dk_mode in ("slots", "slots_bf16")  # per-slot rows (the historical name of that path)
        self.rows_bf16 = dk_mode == "slots_bf16"  # the per-slot rows rounded to bf16 (half the bytes)
        self.dk_bulk = dk_mode == "bulk"
        self.fixed = dk_mode.startswith("fixed")
        self.piece, self.nbuf = _FIXED_STAGING.get(dk_mode, (32, 1))
        self.fixed_bulk = dk_mode in _FIXED_STAGING
        self.stages = 4  # two CTAs per SM (registers): deep prefetch of the gathered rows
        if self.fixed_bulk and self.nbuf * B_TOPK * (self.piece + 2) * 8 > 18 * 1024:
            self.stages = 3  # two CTAs per SM still fit
        self.smem_bytes = 0

    def _mma(self, a_major, b_major, n: int, rs: bool = False):
        src = warpgroup.OperandSource.RMEM if rs else warpgroup.OperandSource.SMEM
        return sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, a_major, b_major, Float32, (1, 1, 1),
                                                 (B_TOPK, n), src)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [n_q, 64, d] bf16
        mK: cute.Tensor,  # [s_kv, d] bf16
        mW: cute.Tensor,  # [n_q, 64] f32: weights * sm_scale
        mIdx: cute.Tensor,  # [n_q, topk] int32, topk % 64 == 0
        mTopkLen: cute.Tensor,  # [n_q] int32 (read only if has_topk_length)
        mTarget: cute.Tensor,  # [n_q, topk] f32
        mLse: cute.Tensor,  # [n_q] f32 (the forward's)
        mInv: cute.Tensor,  # [n_q] f32 (the forward's 1 / tsum; 0 = inactive row)
        mGrad: cute.Tensor,  # [n_q] f32: d loss / d loss_t
        mDq: cute.Tensor,  # [n_q, 64, d] bf16 (out)
        mDw: cute.Tensor,  # [n_q, 64] f32 (out)
        mWs: cute.Tensor,  # [s_kv, d] f32 (atomic), [n_q * topk, d] f32 (slots) or [s_kv, d] int64 (fixed)
        mDkScale: cute.Tensor,  # [1] f32: 2^e of the fixed-point modes (read only by them)
        mPos: cute.Tensor,  # [n_q, topk] int32: slots_bf16's workspace row of each valid slot (read only there)
        sm_scale: Float32,
        stream,
    ):
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
        sQ_layout = cute.tile_to_shape(atom, (H, self.d), (0, 1))
        sK_layout = cute.tile_to_shape(atom, (B_TOPK, self.d, self.stages), (0, 1, 2))
        sDS_layout = cute.tile_to_shape(atom, (B_TOPK, H), (0, 1))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sDS: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sDS_layout)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[Float32, H], 16]
            sDw: cute.struct.Align[cute.struct.MemRange[Float32, 4 * H], 16]
            sIdx: cute.struct.MemRange[Int32, B_TOPK]
            sDk: cute.struct.Align[cute.struct.MemRange[Float32, B_TOPK * DK_PITCH if self.dk_bulk else 4], 16]
            sDk64: cute.struct.Align[cute.struct.MemRange[
                Int64, self.nbuf * B_TOPK * (self.piece + 2) if self.fixed_bulk else 2], 16]

        self.smem_bytes = SharedStorage.size_in_bytes()
        self.kernel(mQ, mK, mW, mIdx, mTopkLen, mTarget, mLse, mInv, mGrad, mDq, mDw, mWs, mDkScale, mPos, sm_scale,
                    sQ_layout, sK_layout, sDS_layout, SharedStorage).launch(
            grid=[mQ.shape[0], 1, 1], block=[THREADS, 1, 1], smem=self.smem_bytes, stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mIdx: cute.Tensor, mTopkLen: cute.Tensor,
               mTarget: cute.Tensor, mLse: cute.Tensor, mInv: cute.Tensor, mGrad: cute.Tensor, mDq: cute.Tensor,
               mDw: cute.Tensor, mWs: cute.Tensor, mDkScale: cute.Tensor, mPos: cute.Tensor, sm_scale: Float32,
               sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sDS_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sDS = storage.sDS.get_tensor(sDS_layout.outer, swizzle=sDS_layout.inner)
        sW = storage.sW.get_tensor(cute.make_layout(H))
        sDw = storage.sDw.get_tensor(cute.make_layout(4 * H))
        sIdx = storage.sIdx.get_tensor(cute.make_layout(B_TOPK))
        sDk = storage.sDk.get_tensor(cute.make_layout(B_TOPK * DK_PITCH if self.dk_bulk else 4))
        if const_expr(self.fixed_bulk):
            sDk = storage.sDk64.get_tensor(cute.make_layout(self.nbuf * B_TOPK * (self.piece + 2)))
        dk_scale = Float32(1.0)
        if const_expr(self.fixed):
            dk_scale = mDkScale[0]
        s_kv = mK.shape[0]
        topk = mIdx.shape[1]
        topk_len = topk
        if const_expr(self.has_topk_length):
            topk_len = mTopkLen[t]
        inv = mInv[t]
        g = mGrad[t]
        lse = mLse[t]
        num_blocks = (topk_len + (B_TOPK - 1)) // B_TOPK
        if inv == Float32(0.0):
            num_blocks = Int32(0)  # inactive row: zero gradients

        q_addr = dev.gmem_addr_i64(mQ.iterator) + Int64(t) * Int64(H * self.d * 2)
        copy_dense_rows(dev.smem_addr_u32(storage.sQ.data_ptr()), q_addr, self.d * 2, H, self.d // 64, tidx,
                        dev.createpolicy_evict_first())
        if tidx < H:
            sW[tidx] = mW[t, tidx]
        ring = idev.SparseKeyRing(mK, mIdx, t, topk_len, tidx, self.d, self.stages,
                                  dev.smem_addr_u32(storage.sK.data_ptr()), self.prefetch)
        ring.start()
        for s in cutlass.range_constexpr(self.stages - 1):
            ring.issue(Int32(s), num_blocks)

        # S^T = K q^T (slots x heads); dK = dS^T q (slots x 64 d-columns per chunk, q^T MN-major);
        # dq = dS K (heads x d: dS = (dS^T)^T and K^T are MN-major views of smem tiles).
        mma_s = self._mma(K_MAJ, K_MAJ, H)
        thr_s = mma_s.get_slice(tidx)
        thr_k = self._mma(K_MAJ, MN_MAJ, 64, rs=True).get_slice(tidx)
        thr_q = self._mma(MN_MAJ, MN_MAJ, self.d).get_slice(tidx)
        sQt = cute.make_tensor(sQ.iterator, cute.select(sQ.layout, mode=[1, 0]))
        sKt = cute.make_tensor(sK.iterator, cute.select(sK.layout, mode=[1, 0, 2]))
        sDSt = cute.make_tensor(sDS.iterator, cute.select(sDS.layout, mode=[1, 0]))
        tSrK = thr_s.make_fragment_A(thr_s.partition_A(sK))
        tSrQ = thr_s.make_fragment_B(thr_s.partition_B(sQ))
        acc_s = thr_s.make_fragment_C(thr_s.partition_shape_C((B_TOPK, H)))
        tKrDS = thr_k.make_fragment_A(thr_k.partition_shape_A((B_TOPK, H)))
        tKrDS_acc = cute.make_tensor(tKrDS.iterator, acc_s.layout)
        acc_dk = thr_k.make_fragment_C(thr_k.partition_shape_C((B_TOPK, 64)))
        tQrDS = thr_q.make_fragment_A(thr_q.partition_A(sDSt))
        tQrK = thr_q.make_fragment_B(thr_q.partition_B(sKt))
        acc_dq = thr_q.make_fragment_C(thr_q.partition_shape_C((H, self.d)))
        acc_dq.fill(0.0)
        st_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), BFloat16)
        thr_st = cute.make_tiled_copy_C(st_atom, mma_s).get_slice(tidx)
        tPsDS = thr_st.partition_D(sDS)
        tPrDS = thr_st.retile(tKrDS_acc)

        lane = tidx % 32
        lane_quad = lane % 4
        row0 = dev.fragment_row(tidx, 0)
        dwp = cute.make_rmem_tensor((16,), Float32)
        dwp.fill(0.0)
        vec = cute.make_rmem_tensor((16,), Float32)
        # the dK scatter's lane mapping (see common.device.quad_pair_v4 / transpose_lanes)
        odd = (lane_quad & 1) != 0
        r8 = lane // 4
        srow0 = (tidx // 32) * 16 + 4 * (r8 >> 2) + 8 * (lane_quad & 1)
        elem_bytes = 8 if const_expr(self.fixed) else (2 if const_expr(self.dk_mode == "red_bf16" or self.rows_bf16) else 4)
        ws_base = dev.gmem_addr_i64(mWs.iterator) + Int64((8 * (r8 & 3) + 4 * (lane_quad >> 1)) * elem_bytes)
        row_bytes = self.d * elem_bytes

        # this thread's two slots' index and target, loaded one block ahead (``prefetch``): their
        # global-load latency hides under the previous block instead of stalling dI
        rIdx = cute.make_rmem_tensor((2,), Int32)
        rTgt = cute.make_rmem_tensor((2,), Float32)
        rPos = cute.make_rmem_tensor((2,), Int32)  # slots_bf16: the slots' workspace rows
        if const_expr(self.prefetch):
            self._load_slots(rIdx, rTgt, rPos, mIdx, mTarget, mPos, t, Int32(0), row0, topk)
        for b in cutlass.range(num_blocks, unroll=1):
            stage = b % self.stages
            cIdx = cute.make_rmem_tensor((2,), Int32)
            cTgt = cute.make_rmem_tensor((2,), Float32)
            cPos = cute.make_rmem_tensor((2,), Int32)
            if const_expr(self.prefetch):
                for r in cutlass.range_constexpr(2):
                    cIdx[r] = rIdx[r]
                    cTgt[r] = rTgt[r]
                    if const_expr(self.rows_bf16):
                        cPos[r] = rPos[r]
                if b + 1 < num_blocks:
                    self._load_slots(rIdx, rTgt, rPos, mIdx, mTarget, mPos, t, b + 1, row0, topk)
            ring.issue(b + self.stages - 1, num_blocks)
            ring.wait(BAR_RING)
            block_scores(self._mma(K_MAJ, K_MAJ, H), acc_s, tSrK, tSrQ, stage, self.d)

            # dI per row of this thread (rows row0 and row0 + 8)
            s0, s1 = idev.weighted_relu_rows(acc_s, sW, Int32(0), 0, H, lane_quad, self.sum_parts)
            s0 = dev.quad_sum(s0)
            s1 = dev.quad_sum(s1)
            d_i = cute.make_rmem_tensor((2,), Float32)
            for r in cutlass.range_constexpr(2):
                j = b * B_TOPK + row0 + 8 * r
                idx = Int32(0)
                tg = Float32(0.0)
                pos = Int32(0)
                if const_expr(self.prefetch):
                    idx = cIdx[r]
                    tg = cTgt[r]
                    if const_expr(self.rows_bf16):
                        pos = cPos[r]
                else:
                    idx = mIdx[t, cutlass.min(j, topk - 1)]
                    tg = mTarget[t, j]
                    if const_expr(self.rows_bf16):
                        pos = mPos[t, cutlass.min(j, topk - 1)]
                ok = dev.slot_valid(idx, j, s_kv, topk_len)
                logit = s0 if r == 0 else s1
                pi = cute.math.exp(logit - lse)
                p = tg * inv
                d_i[r] = Float32(cutlass.select_(ok, (pi - p) * g, Float32(0.0)))
                if lane_quad == 0:
                    # slots_bf16 keeps the slot's workspace row instead of its key (-1: no row)
                    sIdx[row0 + 8 * r] = Int32(cutlass.select_(ok, pos if const_expr(self.rows_bf16) else idx,
                                                               Int32(-1)))
            # dw partials and dS^T = dI w_eff [S^T > 0], in place of S^T
            for gi in cutlass.range_constexpr(H // 8):
                for v0 in cutlass.range_constexpr(2):
                    w = sW[8 * gi + 2 * lane_quad + v0]
                    for r in cutlass.range_constexpr(2):
                        i = dev.acc_flat(v0, r, gi)
                        a = acc_s[i]
                        dwp[2 * gi + v0] = dwp[2 * gi + v0] + d_i[r] * cute.arch.fmax(a, Float32(0.0))
                        acc_s[i] = Float32(cutlass.select_(a > Float32(0.0), d_i[r] * w, Float32(0.0)))
            tKrDS_acc.store(acc_s.load().to(BFloat16))
            # dS^T -> smem for dq (the previous block's readers finished at the end-of-block barrier)
            cute.copy(thr_st, tPrDS, tPsDS)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=BAR_DS, number_of_threads=THREADS)
            # dK chunk 0 (RS), then dq += dS K_sel (SS) behind it: wgmma groups retire in order, so
            # wait_group(1) hands chunk 0 to the scatter while dq still runs.
            self._dk_chunk(thr_k, acc_dk, tKrDS, sQt, 0)
            mma_q = self._mma(MN_MAJ, MN_MAJ, self.d)
            cute.nvgpu.warpgroup.fence()
            mma_q.set(warpgroup.Field.ACCUMULATE, True)
            for k in cutlass.range_constexpr(B_TOPK // 16):
                cute.gemm(mma_q, acc_dq, tQrDS[None, None, k], tQrK[None, None, k, stage], acc_dq)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(1)
            self._dk_out(acc_dk, vec, sIdx, sDk, mWs, ws_base, row_bytes, srow0, odd, r8, 0, t, b, topk, tidx,
                         dk_scale)
            for ch in cutlass.range_constexpr(1, self.d // 64):
                self._dk_chunk(thr_k, acc_dk, tKrDS, sQt, ch)
                cute.nvgpu.warpgroup.wait_group(0)
                self._dk_out(acc_dk, vec, sIdx, sDk, mWs, ws_base, row_bytes, srow0, odd, r8, ch, t, b, topk, tidx,
                             dk_scale)
            cute.nvgpu.warpgroup.wait_group(0)
            # the stage, sDS and sIdx are refilled next block
            cute.arch.barrier(barrier_id=BAR_RING, number_of_threads=THREADS)

        cute.arch.cp_async_wait_group(0)  # q_t's copies of an inactive row
        if const_expr(self.fixed_bulk):
            if tidx < B_TOPK:
                cute.arch.cp_async_bulk_wait_group(0, read=False)  # the last pieces' reductions
        # dq_t (bf16) straight from the fragment: rows = heads, 2 consecutive columns per store
        dq_base = dev.gmem_addr_i64(mDq.iterator) + Int64(t) * Int64(H * self.d * 2)
        for r in cutlass.range_constexpr(2):
            head = row0 + 8 * r
            for gi in cutlass.range_constexpr(self.d // 8):
                col = 8 * gi + 2 * lane_quad
                word = dev.pack_bf16x2(acc_dq[dev.acc_flat(0, r, gi)], acc_dq[dev.acc_flat(1, r, gi)])
                dev.st_global_b32(dq_base + Int64((head * self.d + col) * 2), word)
        # dw_t: column partials summed over the warp's rows, then over the 4 warps
        dev.warp_reduce_scatter_cols(dwp, lane)
        w_id = tidx // 32
        sDw[w_id * H + 2 * lane] = dwp[0]
        sDw[w_id * H + 2 * lane + 1] = dwp[1]
        cute.arch.barrier(barrier_id=BAR_DS, number_of_threads=THREADS)
        if tidx < H:
            tot = sDw[tidx] + sDw[H + tidx] + sDw[2 * H + tidx] + sDw[3 * H + tidx]
            mDw[t, tidx] = tot * sm_scale

    @cute.jit
    def _load_slots(self, rIdx, rTgt, rPos, mIdx, mTarget, mPos, t, b, row0, topk):
        """``rIdx[r], rTgt[r]`` (and ``rPos[r]`` in slots_bf16) = index and target (workspace row)
        of slot ``b * 64 + row0 + 8 r`` (topk is a multiple of 64: always inside the row)."""
        for r in cutlass.range_constexpr(2):
            j = b * B_TOPK + row0 + 8 * r
            rIdx[r] = mIdx[t, j]
            rTgt[r] = mTarget[t, j]
            if const_expr(self.rows_bf16):
                rPos[r] = mPos[t, j]

    @cute.jit
    def _dk_chunk(self, thr_k, acc_dk, tKrDS, sQt, ch: cutlass.Constexpr):
        """Issue (and commit) ``dK[:, 64 ch : 64 ch + 64] = dS^T q_t[:, 64 ch : 64 ch + 64]``."""
        tKrQ = thr_k.make_fragment_B(thr_k.partition_B(cute.local_tile(sQt, (64, H), (ch, 0))))
        mma_k = self._mma(K_MAJ, MN_MAJ, 64, rs=True)
        cute.nvgpu.warpgroup.fence()
        for k in cutlass.range_constexpr(H // 16):
            mma_k.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(mma_k, acc_dk, tKrDS[None, None, k], tKrQ[None, None, k], acc_dk)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _dk_out(self, acc_dk, vec, sIdx, sDk, mWs, ws_base, row_bytes, srow0, odd, r8, ch: cutlass.Constexpr, t, b,
                topk, tidx, dk_scale):
        if const_expr(self.dk_mode == "none"):
            pass
        elif const_expr(self.dk_bulk):
            self._bulk(acc_dk, sIdx, sDk, mWs, row_bytes, ch, tidx)
        elif const_expr(self.fixed_bulk):
            self._bulk_fixed(acc_dk, sIdx, sDk, mWs, ch, tidx, dk_scale)
        else:
            self._scatter(acc_dk, vec, sIdx, ws_base, row_bytes, srow0, odd, r8, ch, t, b, topk, dk_scale)

    @cute.jit
    def _bulk_fixed(self, acc_dk, sIdx, sDk, mWs, ch: cutlass.Constexpr, tidx, dk_scale):
        """Fixed-point dK chunk ``ch`` through smem: per piece of ``self.piece`` columns the 64 rows
        as int64 in staging buffer ``piece_index % nbuf``, then one bulk integer reduce-add per
        valid row.  A buffer is rewritten only after its previous bulk read: the issuing threads
        wait for all but the last ``nbuf - 1`` of their bulk groups before the leading barrier."""
        lane_quad = tidx % 4
        piece = self.piece
        pitch = piece + 2  # int64 per staged row: 16-byte aligned rows
        n_pieces = 64 // piece
        for pc in cutlass.range_constexpr(n_pieces):
            buf = (ch * n_pieces + pc) % self.nbuf
            cute.arch.barrier(barrier_id=BAR_DK, number_of_threads=THREADS)
            for r in cutlass.range_constexpr(2):
                row = dev.fragment_row(tidx, r)
                for gg in cutlass.range_constexpr(piece // 8):
                    gi = pc * (piece // 8) + gg
                    off = (buf * B_TOPK + row) * pitch + 8 * gg + 2 * lane_quad
                    sDk[off] = idev.f32_to_fixed(acc_dk[dev.acc_flat(0, r, gi)], dk_scale)
                    sDk[off + 1] = idev.f32_to_fixed(acc_dk[dev.acc_flat(1, r, gi)], dk_scale)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=BAR_DK2, number_of_threads=THREADS)
            if tidx < B_TOPK:
                kv_row = sIdx[tidx]
                if kv_row >= 0:
                    dst = (dev.gmem_addr_i64(mWs.iterator) + Int64(kv_row) * Int64(self.d * 8)
                           + Int64((ch * 64 + piece * pc) * 8))
                    src = dev.smem_addr_u32(sDk.iterator) + (buf * B_TOPK + tidx) * (pitch * 8)
                    idev.bulk_reduce_add_u64(dst, src, Int32(piece * 8), dev.createpolicy_evict_last())
                dev.bulk_commit_and_wait_read_le(self.nbuf - 1)

    @cute.jit
    def _bulk(self, acc_dk, sIdx, sDk, mWs, row_bytes, ch: cutlass.Constexpr, tidx):
        """Stage the 64 x 64 dK chunk in smem, then one 256-byte bulk reduce-add per valid row."""
        lane_quad = tidx % 4
        for r in cutlass.range_constexpr(2):
            row = dev.fragment_row(tidx, r)
            for gi in cutlass.range_constexpr(8):
                col = 8 * gi + 2 * lane_quad
                sDk[row * DK_PITCH + col] = acc_dk[dev.acc_flat(0, r, gi)]
                sDk[row * DK_PITCH + col + 1] = acc_dk[dev.acc_flat(1, r, gi)]
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=BAR_DS, number_of_threads=THREADS)
        if tidx < B_TOPK:
            kv_row = sIdx[tidx]
            if kv_row >= 0:
                dst = dev.gmem_addr_i64(mWs.iterator) + Int64(kv_row) * Int64(row_bytes) + Int64(ch * 256)
                src = dev.smem_addr_u32(sDk.iterator) + tidx * (DK_PITCH * 4)
                dev.bulk_reduce_add_f32(dst, src, Int32(256), dev.createpolicy_evict_last())
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        # the staging buffer is rewritten by the next chunk
        cute.arch.barrier(barrier_id=BAR_DS, number_of_threads=THREADS)

    @cute.jit
    def _scatter(self, acc_dk, vec, sIdx, ws_base, row_bytes, srow0, odd, r8, ch: cutlass.Constexpr, t, b, topk,
                 dk_scale):
        """Add (or store) the 64 x 64 dK chunk ``ch``: per 32-column half a quad pairing and a 4 x 4
        lane transpose leave instruction ``j`` of a lane with row ``srow0 + j`` and 4 consecutive
        columns, 8 lanes per 128-byte line."""
        for p in cutlass.range_constexpr(2):
            for s in cutlass.range_constexpr(4):
                v = dev.quad_pair_v4(acc_dk, 4 * p + s, odd)
                for e in cutlass.range_constexpr(4):
                    vec[4 * s + e] = v[e]
            dev.transpose_lanes(vec, r8, 4)
            for j in cutlass.range_constexpr(4):
                row = srow0 + j
                kv_row = sIdx[row]
                if kv_row >= 0:
                    dst = Int64(kv_row)  # slots_bf16: the slot's workspace row
                    if const_expr(self.deterministic and not self.rows_bf16):
                        dst = Int64(t) * Int64(topk) + Int64(b * B_TOPK + row)
                    if const_expr(self.fixed):  # fixed_red: four 8-byte integer atomics (one 32-byte sector)
                        addr = ws_base + dst * Int64(row_bytes) + Int64((ch * 64 + 32 * p) * 8)
                        for e in cutlass.range_constexpr(4):
                            idev.red_add_u64(addr + Int64(8 * e), idev.f32_to_fixed(vec[4 * j + e], dk_scale))
                    elif const_expr(self.dk_mode == "red_bf16"):  # 8 bytes: four bf16 sums
                        addr = ws_base + dst * Int64(row_bytes) + Int64((ch * 64 + 32 * p) * 2)
                        idev.red_add_v2_bf16x2(addr, dev.pack_bf16x2(vec[4 * j], vec[4 * j + 1]),
                                               dev.pack_bf16x2(vec[4 * j + 2], vec[4 * j + 3]))
                    elif const_expr(self.rows_bf16):  # 8 bytes: the four values rounded to bf16
                        addr = ws_base + dst * Int64(row_bytes) + Int64((ch * 64 + 32 * p) * 2)
                        dev.st_global_v2_b32(addr, dev.pack_bf16x2(vec[4 * j], vec[4 * j + 1]),
                                             dev.pack_bf16x2(vec[4 * j + 2], vec[4 * j + 3]))
                    elif const_expr(self.deterministic):
                        addr = ws_base + dst * Int64(row_bytes) + Int64((ch * 64 + 32 * p) * 4)
                        dev.st_global_v4_f32(addr, vec[4 * j], vec[4 * j + 1], vec[4 * j + 2], vec[4 * j + 3])
                    else:
                        addr = ws_base + dst * Int64(row_bytes) + Int64((ch * 64 + 32 * p) * 4)
                        dev.red_add_v4_f32(addr, vec[4 * j], vec[4 * j + 1], vec[4 * j + 2], vec[4 * j + 3])


def dk_mode_of(deterministic: bool, dk_bulk: bool = False, dk_mode=None) -> str:
    """The dk mode: ``dk_mode`` if given, else ``fixed_bulk64`` (deterministic), ``bulk`` or ``red``."""
    if dk_mode is not None:
        return dk_mode
    return "fixed_bulk64" if deterministic else ("bulk" if dk_bulk else "red")


def compile_loss_bwd(d: int, has_topk_length: bool, deterministic: bool, arch: str = "sm_90a", dk_bulk: bool = False,
                     dk_mode=None, prefetch: bool = True, sum_parts: int = 1, **kw):
    """Compile the loss backward for one static configuration (no GPU needed)."""
    from .. import _compile
    from ..common import host

    mode = dk_mode_of(deterministic, dk_bulk, dk_mode)
    kernel = IndexerLossBwdSm90(d, has_topk_length, mode, prefetch, sum_parts)
    extra = [host.fake(Float32, (cute.sym_int(),), align=4) for _ in range(3)]  # lse, inv, grad
    extra += [
        host.fake(BFloat16, (cute.sym_int(), H, d)),  # dq
        host.fake(Float32, (cute.sym_int(), H), align=4),  # dw
        host.fake(Int64 if mode.startswith("fixed") else (BFloat16 if mode in ("red_bf16", "slots_bf16") else Float32),
                  (cute.sym_int(), d)),  # dk workspace
        host.fake(Float32, (1,), align=4),  # fixed-point scale
        host.fake(Int32, (cute.sym_int(), cute.sym_int()), align=4),  # slots_bf16: workspace rows
        Float32(1.0),
        host.fake_stream(),
    ]
    args = loss_fake_args(d, extra)
    return kernel, _compile.compile_kernel(kernel, *args, arch=arch, **kw)
