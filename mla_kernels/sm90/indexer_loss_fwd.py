"""The indexer's KL loss forward on Hopper (sm_90a), CuTe DSL, fused: recompute the selected
scores, their softmax and the KL per query in one kernel.

One CTA (one warpgroup, 128 threads) per query ``t``; several CTAs per SM overlap each other's
gathers and MMAs.  Per block of 64 slots: the selected key rows arrive by ``cp.async``
(:class:`~mla_kernels.common.indexer_device.SparseKeyRing`, ``stages`` buffers in flight), then
``S^T = K_sel q_t^T`` by wgmma (64 slots x 64 heads, keys on M so that the head sum
``I_j = sum_h w_eff[h] ReLU(S^T[j, h])`` is a row reduction inside a thread plus two quad
shuffles), and the block's logits go to shared memory (``-inf`` on invalid slots).  Then
``lse = logsumexp(I)``, ``tsum = sum(target)`` over the valid slots and
``loss_t = sum_j p_j (log p_j - I_j + lse)`` with ``p = target / tsum`` (``0 log 0 = 0``) by
block reductions.  Outputs per query: ``loss``, ``lse`` and ``inv_tsum = 1 / tsum`` (0 for a row
with no valid slot or a zero target sum, whose loss is 0) -- what the backward needs.

``prefetch`` (default): the gather's indices and the logits' slot indices are loaded one block
ahead (the first version loaded each block's indices right before the copies and the stores that
need them: a global-load latency in every block's dependent path).

``rotate`` (an option, off by default): query ``t`` visits its slot blocks starting at block
``t mod num_blocks`` (then wrapping), so that the CTAs running at the same time gather from
different bands of ``k_idx`` rows instead of all walking up the same ascending band (H200, S 32k:
the forward took 3.88 ms on slots in random order vs 4.15 in ``indexer_topk``'s ascending order).
The logits land in their slots as before and every reduction runs after the blocks over the
slots in index order, so the outputs are bitwise those without it.

Variants (``variant``, :data:`VARIANTS`; issue 19's profile and measurements in docs/PERF.md): the
default ``online4`` forms the softmax and KL sums in the block loop instead of keeping the row's
logits in shared memory for passes after the blocks (``lse`` by a running max and rescaled sum per
thread; ``loss = inv (a - b) + inv c (log inv + lse)`` from ``a = sum tg log tg``, ``b = sum tg I``,
``c = sum tg`` over the slots with a positive target), holds the weights in registers, uses the
gather's indices a block after their loads (:class:`~mla_kernels.common.indexer_device.SparseKeyRingRaw`,
loop unrolled by two so that no loaded register is copied) and runs 4 CTAs per SM (2 key
stages); its sums follow the visiting order, so its rows match the ``smem`` variant's to float32
rounding (not bitwise, rotated or not).

``w_eff = weights * sm_scale`` comes from the host; ``topk`` is padded to a multiple of 64 (slots
-1, target 0) and at most ``topk_cap`` (<= :data:`MAX_TOPK`; 2048 keeps smem at 72 KB, three
CTAs per SM).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.cute.nvgpu.common import OperandMajorMode

from ..common import device as dev
from ..common import indexer_device as idev
from ..common.gather import copy_dense_rows

H = 64  # index heads (the wgmma N)
B_TOPK = 64  # slots per block (the wgmma M)
THREADS = 128
#: Largest (padded) topk served: the logits of one query live in shared memory.
MAX_TOPK = 8192
BAR_RING = 1
BAR_RED = 2
#: The forward's variants (``indexer_host.ENV_LOSS_FWD``): ``smem`` -- the logits of the row in
#: shared memory, softmax and KL by passes over them after the blocks, the gather's indices
#: checked right after their loads (:class:`~mla_kernels.common.indexer_device.SparseKeyRing`);
#: ``raw`` -- the same with the gather's indices used one issue after their loads
#: (:class:`~mla_kernels.common.indexer_device.SparseKeyRingRaw`; bitwise the same outputs);
#: ``online`` -- ``raw`` plus the softmax / KL sums formed in the block loop (:meth:`_online`),
#: the weights in registers, no logits row in smem; ``online4`` (the default, fastest measured) --
#: ``online`` with one key stage fewer (four CTAs per SM instead of three, d 128).
VARIANTS = ("online4", "online", "raw", "smem")


class IndexerLossFwdSm90:
    """Static configuration (d, whether topk_length is given) + launcher + kernel."""

    def __init__(self, d: int, has_topk_length: bool, topk_cap: int = MAX_TOPK, prefetch: bool = True,
                 sum_parts: int = idev.SUM_PARTS, rotate: bool = False, variant: str = "online4"):
        if d not in (64, 128):
            raise ValueError(f"sm90 indexer loss takes d_idx 64 or 128, got {d}")
        if topk_cap % B_TOPK or not 0 < topk_cap <= MAX_TOPK:
            raise ValueError(f"topk_cap must be a multiple of 64 in (0, {MAX_TOPK}], got {topk_cap}")
        self.topk_cap = topk_cap  # logits buffer (slots); the host picks the smallest that fits
        self.d = d
        self.has_topk_length = has_topk_length
        self.prefetch = prefetch
        self.rotate = rotate
        self.sum_parts = sum_parts  # FMA chains per logit's head sum (indexer_device.weighted_relu_rows)
        if variant not in VARIANTS:
            raise ValueError(f"loss forward variant {variant!r}: expected one of {VARIANTS}")
        self.variant = variant
        # raw: the gather's next indices consumed one issue after their loads (SparseKeyRingRaw);
        # online: the softmax / KL sums in the block loop, weights in registers, no logits in smem
        self.ring_raw = prefetch and variant != "smem"
        self.online = variant.startswith("online")
        self.stages = 3 if d == 128 else 4
        if variant == "online4":
            self.stages = 2 if d == 128 else 3  # 4 CTAs per SM (smem)
        self.smem_bytes = 0

    def _mma(self):
        return sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), (B_TOPK, H)
        )

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [s_q, 64, d] bf16
        mK: cute.Tensor,  # [s_kv, d] bf16
        mW: cute.Tensor,  # [s_q, 64] f32: weights * sm_scale
        mIdx: cute.Tensor,  # [s_q, topk] int32, topk % 64 == 0
        mTopkLen: cute.Tensor,  # [s_q] int32 (read only if has_topk_length)
        mTarget: cute.Tensor,  # [s_q, topk] f32
        mLoss: cute.Tensor,  # [s_q] f32 (out)
        mLse: cute.Tensor,  # [s_q] f32 (out)
        mInv: cute.Tensor,  # [s_q] f32 (out)
        stream,
    ):
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
        sQ_layout = cute.tile_to_shape(atom, (H, self.d), (0, 1))
        sK_layout = cute.tile_to_shape(atom, (B_TOPK, self.d, self.stages), (0, 1, 2))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[Float32, H], 16]
            sLogit: cute.struct.Align[cute.struct.MemRange[Float32, 4 if self.online else self.topk_cap], 16]
            sRed: cute.struct.MemRange[Float32, 8]

        self.smem_bytes = SharedStorage.size_in_bytes()
        self.kernel(mQ, mK, mW, mIdx, mTopkLen, mTarget, mLoss, mLse, mInv, sQ_layout, sK_layout,
                    SharedStorage).launch(grid=[mQ.shape[0], 1, 1], block=[THREADS, 1, 1], smem=self.smem_bytes,
                                          stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mIdx: cute.Tensor, mTopkLen: cute.Tensor,
               mTarget: cute.Tensor, mLoss: cute.Tensor, mLse: cute.Tensor, mInv: cute.Tensor,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sW = storage.sW.get_tensor(cute.make_layout(H))
        sLogit = storage.sLogit.get_tensor(cute.make_layout(4 if const_expr(self.online) else self.topk_cap))
        sRed = storage.sRed.get_tensor(cute.make_layout(8))
        s_kv = mK.shape[0]
        topk = mIdx.shape[1]
        topk_len = topk
        if const_expr(self.has_topk_length):
            topk_len = mTopkLen[t]
        num_blocks = (topk_len + (B_TOPK - 1)) // B_TOPK

        # q_t (64 heads x d) and the weights; the first ring group carries q_t too.
        q_addr = dev.gmem_addr_i64(mQ.iterator) + Int64(t) * Int64(H * self.d * 2)
        copy_dense_rows(dev.smem_addr_u32(storage.sQ.data_ptr()), q_addr, self.d * 2, H, self.d // 64, tidx,
                        dev.createpolicy_evict_first())
        if tidx < H:
            sW[tidx] = mW[t, tidx]
        rot = None
        if const_expr(self.rotate):
            rot = Int32(t) % cutlass.max(num_blocks, Int32(1))
        if const_expr(self.ring_raw):
            ring = idev.SparseKeyRingRaw(mK, mIdx, t, topk_len, tidx, self.d, self.stages,
                                         dev.smem_addr_u32(storage.sK.data_ptr()), rot, num_blocks,
                                         2 if self.online else 1)
        else:
            ring = idev.SparseKeyRing(mK, mIdx, t, topk_len, tidx, self.d, self.stages,
                                      dev.smem_addr_u32(storage.sK.data_ptr()), self.prefetch, rot, num_blocks)
        ring.start()
        for s in cutlass.range_constexpr(self.stages - 1):
            if const_expr(self.ring_raw):
                ring.issue(Int32(s), num_blocks, s % ring.slots)
            else:
                ring.issue(Int32(s), num_blocks)

        mma = self._mma()
        thr = mma.get_slice(tidx)
        tSrK = thr.make_fragment_A(thr.partition_A(sK))
        tSrQ = thr.make_fragment_B(thr.partition_B(sQ))
        acc = thr.make_fragment_C(thr.partition_shape_C((B_TOPK, H)))
        if const_expr(self.online):
            self._online(acc, tSrK, tSrQ, ring, sW, sRed, mIdx, mTarget, mLoss, mLse, mInv, t, tidx, num_blocks,
                         topk_len, s_kv, topk)
        else:
            lane_quad = tidx % 4
            row0 = dev.fragment_row(tidx, 0)
            # the two slots' indices of this thread (lane_quad 0 writes the logits), one block ahead
            rIdx = cute.make_rmem_tensor((2,), Int32)
            if const_expr(self.prefetch):
                for r in cutlass.range_constexpr(2):
                    rIdx[r] = mIdx[t, ring.phys(Int32(0)) * B_TOPK + row0 + 8 * r]
            for b in cutlass.range(num_blocks, unroll=1):
                cIdx = cute.make_rmem_tensor((2,), Int32)
                if const_expr(self.prefetch):
                    for r in cutlass.range_constexpr(2):
                        cIdx[r] = rIdx[r]
                    if b + 1 < num_blocks:
                        for r in cutlass.range_constexpr(2):
                            rIdx[r] = mIdx[t, ring.phys(b + 1) * B_TOPK + row0 + 8 * r]
                ring.issue(b + self.stages - 1, num_blocks)
                ring.wait(BAR_RING)
                block_scores(self._mma(), acc, tSrK, tSrQ, b % self.stages, self.d)
                s0, s1 = idev.weighted_relu_rows(acc, sW, Int32(0), 0, H, lane_quad, self.sum_parts)
                s0 = dev.quad_sum(s0)
                s1 = dev.quad_sum(s1)
                if lane_quad == 0:
                    for r in cutlass.range_constexpr(2):
                        j = ring.phys(b) * B_TOPK + row0 + 8 * r
                        idx = Int32(0)
                        if const_expr(self.prefetch):
                            idx = cIdx[r]
                        else:
                            idx = mIdx[t, cutlass.min(j, topk - 1)]
                        ok = dev.slot_valid(idx, j, s_kv, topk_len)
                        sLogit[j] = Float32(cutlass.select_(ok, s0 if r == 0 else s1, Float32(-math.inf)))
                # every thread's wgmma has read the stage the next iteration refills
                cute.arch.barrier(barrier_id=BAR_RING, number_of_threads=THREADS)

            cute.arch.cp_async_wait_group(0)  # q_t's copies when there was no block at all
            # softmax statistics and the KL over the valid slots (sLogit = -inf elsewhere)
            n_slots = num_blocks * B_TOPK
            n_it = (n_slots - tidx + THREADS - 1) // THREADS
            m = Float32(-math.inf)
            tsum = Float32(0.0)
            for i in cutlass.range(n_it, unroll=2):
                j = tidx + i * THREADS
                x = sLogit[j]
                m = cute.arch.fmax(m, x)
                tsum = tsum + Float32(cutlass.select_(x != Float32(-math.inf), mTarget[t, j], Float32(0.0)))
            m = idev.block_reduce(m, True, sRed, tidx, 4, BAR_RED)
            tsum = idev.block_reduce(tsum, False, sRed, tidx, 4, BAR_RED)
            active = (m != Float32(-math.inf)) & (tsum > Float32(0.0))
            m_safe = Float32(cutlass.select_(active, m, Float32(0.0)))
            esum = Float32(0.0)
            for i in cutlass.range(n_it, unroll=2):
                esum = esum + cute.math.exp(sLogit[tidx + i * THREADS] - m_safe)
            esum = idev.block_reduce(esum, False, sRed, tidx, 4, BAR_RED)
            lse = m_safe + cute.math.log(Float32(cutlass.select_(active, esum, Float32(1.0))))
            inv = Float32(cutlass.select_(active, Float32(1.0) / tsum, Float32(0.0)))
            kl = Float32(0.0)
            for i in cutlass.range(n_it, unroll=2):
                j = tidx + i * THREADS
                x = sLogit[j]
                p = Float32(cutlass.select_(x != Float32(-math.inf), mTarget[t, j], Float32(0.0))) * inv
                pos = p > Float32(0.0)
                term = p * (cute.math.log(Float32(cutlass.select_(pos, p, Float32(1.0)))) - x + lse)
                kl = kl + Float32(cutlass.select_(pos, term, Float32(0.0)))
            kl = idev.block_reduce(kl, False, sRed, tidx, 4, BAR_RED)
            if tidx == 0:
                mLoss[t] = Float32(cutlass.select_(active, kl, Float32(0.0)))
                mLse[t] = Float32(cutlass.select_(active, lse, Float32(0.0)))
                mInv[t] = inv


    @cute.jit
    def _online(self, acc, tSrK, tSrQ, ring, sW, sRed, mIdx, mTarget, mLoss, mLse, mInv, t, tidx, num_blocks,
                topk_len, s_kv, topk):
        """The block loop with the softmax and KL sums formed as the logits come (``online``):
        per thread over its two slots of each block (the lanes ``lane_quad == 0`` count) a running
        max ``m`` and ``e = sum exp(I - m)``, and :func:`~mla_kernels.common.indexer_device.kl_terms`'s
        sums; after the blocks only block reductions of them (no logits row in smem, no pass
        over it).  The weights live in registers.  The loop is unrolled by two with two register
        slots for everything loaded one block ahead (the gather's raw indices, the slots' indices
        and targets): block ``b`` uses slot ``b % 2`` and loads block ``b + 1``'s into the other, so
        no loaded register is copied (a copy would wait for its load) -- the first use of a load
        is a block later."""
        lane_quad = tidx % 4
        row0 = dev.fragment_row(tidx, 0)
        cute.arch.barrier(barrier_id=BAR_RED, number_of_threads=THREADS)  # sW written
        rW = cute.make_rmem_tensor((H // 4,), Float32)
        idev.load_weight_cols(rW, sW, Int32(0), H, lane_quad)
        rIdx = cute.make_rmem_tensor((4,), Int32)  # [slot * 2 + r]
        rTgt = cute.make_rmem_tensor((4,), Float32)
        self._load_slots(rIdx, rTgt, ring, mIdx, mTarget, t, Int32(0), row0, topk, 0)
        st = cute.make_rmem_tensor((6,), Float32)  # m, e, tsum, a, b, c
        st[0] = Float32(-math.inf)
        for i in cutlass.range_constexpr(1, 6):
            st[i] = Float32(0.0)
        for bp in cutlass.range((num_blocks + 1) // 2, unroll=1):
            self._online_block(acc, tSrK, tSrQ, ring, rW, rIdx, rTgt, st, mIdx, mTarget, t, 2 * bp, num_blocks,
                               row0, topk_len, s_kv, topk, 0)
            if 2 * bp + 1 < num_blocks:
                self._online_block(acc, tSrK, tSrQ, ring, rW, rIdx, rTgt, st, mIdx, mTarget, t, 2 * bp + 1,
                                   num_blocks, row0, topk_len, s_kv, topk, 1)

        cute.arch.cp_async_wait_group(0)  # q_t's copies when there was no block at all
        lead = lane_quad == 0  # the quad's 4 lanes hold the same sums: count one
        m = Float32(cutlass.select_(lead, st[0], Float32(-math.inf)))
        mx = idev.block_reduce(m, True, sRed, tidx, 4, BAR_RED)
        m_safe = Float32(cutlass.select_(mx == Float32(-math.inf), Float32(0.0), mx))
        e = Float32(cutlass.select_(lead, st[1] * cute.math.exp(m - m_safe), Float32(0.0)))
        esum = idev.block_reduce(e, False, sRed, tidx, 4, BAR_RED)
        tsum = idev.block_reduce(Float32(cutlass.select_(lead, st[2], Float32(0.0))), False, sRed, tidx, 4, BAR_RED)
        sa = idev.block_reduce(Float32(cutlass.select_(lead, st[3], Float32(0.0))), False, sRed, tidx, 4, BAR_RED)
        sb = idev.block_reduce(Float32(cutlass.select_(lead, st[4], Float32(0.0))), False, sRed, tidx, 4, BAR_RED)
        sc = idev.block_reduce(Float32(cutlass.select_(lead, st[5], Float32(0.0))), False, sRed, tidx, 4, BAR_RED)
        active = (mx != Float32(-math.inf)) & (tsum > Float32(0.0))
        lse = m_safe + cute.math.log(Float32(cutlass.select_(active, esum, Float32(1.0))))
        inv = Float32(cutlass.select_(active, Float32(1.0) / tsum, Float32(0.0)))
        log_inv = cute.math.log(Float32(cutlass.select_(active, inv, Float32(1.0))))
        kl = inv * (sa - sb) + inv * sc * (log_inv + lse)
        if tidx == 0:
            mLoss[t] = Float32(cutlass.select_(active, kl, Float32(0.0)))
            mLse[t] = Float32(cutlass.select_(active, lse, Float32(0.0)))
            mInv[t] = inv

    @cute.jit
    def _load_slots(self, rIdx, rTgt, ring, mIdx, mTarget, t, b, row0, topk, slot: cutlass.Constexpr):
        """``rIdx / rTgt[slot * 2 + r]`` = index and target of slot ``phys(b) * 64 + row0 + 8 r``
        (a block past the last reads a clamped slot: never used)."""
        for r in cutlass.range_constexpr(2):
            j = cutlass.min(ring.phys(b) * B_TOPK + row0 + 8 * r, topk - 1)
            rIdx[2 * slot + r] = mIdx[t, j]
            rTgt[2 * slot + r] = mTarget[t, j]

    @cute.jit
    def _online_block(self, acc, tSrK, tSrQ, ring, rW, rIdx, rTgt, st, mIdx, mTarget, t, b, num_blocks, row0,
                      topk_len, s_kv, topk, slot: cutlass.Constexpr):
        """Block ``b`` (``slot = b % 2``) of :meth:`_online`."""
        if const_expr(self.prefetch):
            self._load_slots(rIdx, rTgt, ring, mIdx, mTarget, t, b + 1, row0, topk, 1 - slot)
        if const_expr(self.ring_raw):
            ring.issue(b + self.stages - 1, num_blocks, (slot + self.stages - 1) % 2)
        else:
            ring.issue(b + self.stages - 1, num_blocks)
        ring.wait(BAR_RING)
        block_scores(self._mma(), acc, tSrK, tSrQ, b % self.stages, self.d)
        s0, s1 = idev.weighted_relu_rows_reg(acc, rW, 0, H, self.sum_parts)
        s0 = dev.quad_sum(s0)
        s1 = dev.quad_sum(s1)
        if const_expr(not self.prefetch):
            self._load_slots(rIdx, rTgt, ring, mIdx, mTarget, t, b, row0, topk, slot)
        j0 = ring.phys(b) * B_TOPK + row0
        ok0 = dev.slot_valid(rIdx[2 * slot], j0, s_kv, topk_len)
        ok1 = dev.slot_valid(rIdx[2 * slot + 1], j0 + 8, s_kv, topk_len)
        x0 = Float32(cutlass.select_(ok0, s0, Float32(-math.inf)))
        x1 = Float32(cutlass.select_(ok1, s1, Float32(-math.inf)))
        tsum, sa, sb, sc = idev.kl_terms(x0, rTgt[2 * slot], ok0, st[2], st[3], st[4], st[5])
        tsum, sa, sb, sc = idev.kl_terms(x1, rTgt[2 * slot + 1], ok1, tsum, sa, sb, sc)
        m, e = idev.online_lse_update(st[0], st[1], x0, x1)
        st[0] = m
        st[1] = e
        st[2] = tsum
        st[3] = sa
        st[4] = sb
        st[5] = sc
        # every thread's wgmma has read the stage the next iteration refills
        cute.arch.barrier(barrier_id=BAR_RING, number_of_threads=THREADS)

@cute.jit
def block_scores(mma: cute.TiledMma, acc: cute.Tensor, tSrK: cute.Tensor, tSrQ: cute.Tensor, stage,
                 d: cutlass.Constexpr):
    """``S^T = K_sel q_t^T`` of the key block in ring stage ``stage`` into ``acc``, waited for (both
    loss kernels: 64 slots x 64 heads, ``d / 16`` k-steps of SS wgmma)."""
    cute.nvgpu.warpgroup.fence()
    for k in cutlass.range_constexpr(d // 16):
        mma.set(warpgroup.Field.ACCUMULATE, k != 0)
        cute.gemm(mma, acc, tSrK[None, None, k, stage], tSrQ[None, None, k], acc)
    cute.nvgpu.warpgroup.commit_group()
    cute.nvgpu.warpgroup.wait_group(0)


def loss_fake_args(d: int, extra):
    """The arguments shared by the loss kernels' compiles: q, k, w, indices, topk_length, target."""
    import cutlass.cute as cute
    from ..common import host

    s_q, s_q2, s_q3, s_q4, s_q5, s_kv = (cute.sym_int() for _ in range(6))
    topk = cute.sym_int(divisibility=64)
    topk2 = cute.sym_int(divisibility=64)
    return (
        host.fake(BFloat16, (s_q, H, d)),
        host.fake(BFloat16, (s_kv, d)),
        host.fake(Float32, (s_q2, H), align=4),
        host.fake(Int32, (s_q3, topk), align=4),
        host.fake(Int32, (s_q4,), align=4),
        host.fake(Float32, (s_q5, topk2), align=4),
    ) + tuple(extra)


def compile_loss_fwd(d: int, has_topk_length: bool, topk_cap: int = MAX_TOPK, arch: str = "sm_90a",
                     prefetch: bool = True, sum_parts: int = 1, rotate: bool = False, variant: str = "online4", **kw):
    """Compile the loss forward for one static configuration (no GPU needed)."""
    from .. import _compile
    from ..common import host

    kernel = IndexerLossFwdSm90(d, has_topk_length, topk_cap, prefetch, sum_parts, rotate, variant)
    outs = [host.fake(Float32, (cute.sym_int(),), align=4) for _ in range(3)]
    args = loss_fake_args(d, outs + [host.fake_stream()])
    return kernel, _compile.compile_kernel(kernel, *args, arch=arch, **kw)
