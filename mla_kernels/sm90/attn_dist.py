"""Attention distribution on Hopper (sm_90a), CuTe DSL: ``attn_sum[i, j] = sum_h exp(S_ij,h - lse_ih)``.

The DSA indexer's KL target.  Work items are (query token, head group); 384 threads per CTA:

* WG2 -- producer: the forward's top-k KV gather (:class:`~mla_kernels.common.gather.KvGather`)
  into a ring of ``NB`` full-width KV buffers, plus each block's validity bitmask.
* WG0, WG1 -- consumers.  Q lives in *registers* (the A operand of an RS wgmma), so smem holds
  only KV buffers.  Two modes:

  - ``heads`` (h_q a multiple of 128): WG0 owns heads 0..63 and WG1 heads 64..127 of the
    group; both consume every block of 64 indices;
  - ``tokens`` (h_q = 64 * odd): both WGs hold the same 64 heads and take alternate blocks.

  Per block: ``S = Q K^T`` (64 heads x 64 tokens, 36 k-steps), ``P = exp2(S*c - lse*log2e)`` with
  invalid slots zeroed, a reduce-scatter over the heads held by a warp (3 butterfly steps, 14
  shuffles instead of 48; lane ``l`` ends with the warp's sums of columns ``2l, 2l+1``), then one
  smem pass over the warps' partials; each output element is written once.  In ``heads`` mode
  the two warpgroups are not in lock-step: each block's partials go into a 2-slot smem ring
  guarded by full/empty mbarriers (every consumer thread arrives on *full* after its writes; WG0
  arrives on *empty* after combining), and WG0 combines block ``i`` while its wgmma of block
  ``i + 1`` runs -- so one warpgroup's exponentials overlap the other's wgmma (measured +16-17%
  at h_q 128 on an H200, docs/PERF.md).  With a single head
  group per token, ``normalize=True`` is fused (row sum in the same CTA, one re-scale pass).

For more than one head group per token (h_q > 128) each group writes its own partial row into a
workspace and the host sums the groups (and normalises).

Persistent grid (``ctas`` > 0; the default with more items than SMs, in ``tokens`` mode with Q
through the ring only: ``MLA_KERNELS_ATTN_DIST_CTAS``, see ``sm90/__init__.attn_dist_ctas``): CTA
``c`` runs items ``c, c + grid, ...``; the producer's KV ring and the partial-sum ring run on
across items (their slots and phases follow the CTA's running block count), so the next item's
first blocks are gathered while the consumers finish the current one.  ``q_ring`` (the default):
the producer gathers each item's Q into the ring ahead of its KV blocks (two blocks in ``heads``
mode, one that both warpgroups read in ``tokens`` mode -- there a slot's ``free`` counts 256
arrivals and a KV block's warpgroup arrives with a count of 2) and the consumers ldmatrix it into
their A registers: in ``tokens`` mode this is what makes the persistent grid pay (H200, h_q 64,
s_kv 32k: 1.054-1.077x over one CTA per item; with Q from global memory 0.977x).  Without it
each consumer loads the next item's Q (and lse terms) at the item's start (``q_vec``: 16-byte loads
feeding quad shuffles) or, with 4-byte loads, right after its last wgmma of the current item,
under that block's exponentials.  The Q load is ~6% of a persistent CTA's time at h_q 128 (a
timing copy without it, ``profile="noq"``, is 6.5% faster); pulling the next Q into L2 a few
blocks ahead did not shorten it (within 0.8%, docs/PERF.md).
In ``tokens`` mode a warpgroup takes the blocks whose CTA-wide index has its parity (so that its
consecutive blocks stay two apart in the ring across items: the parity waits stay unambiguous).
``ctas`` = 0: one CTA per item, straight-line (no item loop).  docs/PERF.md has the measurements.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import warp, warpgroup
from cutlass.cute.nvgpu.common import OperandMajorMode

from ..common import device as dev
from ..common.gather import KvGather, copy_dense_rows

B_H = 64
B_TOPK = 64
THREADS = 384
SMEM_LIMIT = 232448

BAR_PSUM_WG0 = 2  # per-WG (tokens mode)
BAR_PSUM_WG1 = 3
BAR_TOTAL = 4  # normalisation: row total exchange (256 threads)
BAR_TOTAL2 = 5


class AttnDistSm90:
    """Static configuration + host launcher + device kernel of the sm90 attention distribution."""

    def __init__(self, d_qk: int, mode: str, normalize: bool, has_topk_length: bool, ctas: int = 0,
                 profile: str = "", q_vec: bool = True, q_ring: bool = False):
        if d_qk not in (512, 576):
            raise ValueError(f"sm90 attn_dist supports d_qk 512 or 576, got {d_qk}")
        if mode not in ("heads", "tokens"):
            raise ValueError(f"mode must be 'heads' or 'tokens', got {mode!r}")
        self.d_qk = d_qk
        self.mode = mode
        self.normalize = normalize
        self.has_topk_length = has_topk_length
        if ctas < 0:
            raise ValueError(f"ctas must be >= 0, got {ctas}")
        #: persistent grid: at most this many CTAs, each looping over work items (token, head
        #: group) with its KV ring running on across them; 0: one CTA per work item
        self.ctas = ctas
        if profile not in ("", "noq", "gather"):
            raise ValueError(f"profile must be '', 'noq' or 'gather', got {profile!r}")
        if profile == "noq" and not ctas:
            raise ValueError("profile 'noq' needs a persistent grid (ctas > 0)")
        #: timing copies only (wrong outputs): ``"noq"`` -- a persistent CTA loads Q and lse for its
        #: first item only and reuses them, so the difference to the real kernel is the per-item Q
        #: load; ``"gather"`` -- the consumers free each KV block as soon as it lands (no Q, no
        #: wgmma, no output): the producer's gather alone, the kernel's floor from the KV bytes
        self.profile = profile
        #: Q into the wgmma's A registers by 16-byte loads and a 4 x 4 word transpose in each lane
        #: quad (36 loads and 144 shuffles per thread) instead of 144 four-byte loads, each of which
        #: touches 8 half-used sectors (the default; measured faster, docs/PERF.md)
        self.q_vec = q_vec
        if q_ring and not (ctas > 0 and profile == ""):
            raise ValueError("q_ring takes a persistent grid (ctas > 0, no profile)")
        #: persistent grid: the producer gathers each item's Q through the KV ring ahead of the
        #: item's KV blocks (heads mode: two 64-head blocks, one per consumer warpgroup; tokens
        #: mode: one, which both warpgroups read), and the consumers load their A registers from
        #: shared memory (ldmatrix) instead of from global memory at the item's start (the ~4 us
        #: per item of the ``noq`` measurement, docs/PERF.md)
        self.q_ring = q_ring
        self.q_blocks = 2 if mode == "heads" else 1  # ring blocks of an item's Q (q_ring)
        # a ring slot's ``free`` barrier counts 256 arrivals when both warpgroups read some of its
        # blocks (heads mode; tokens mode's shared Q blocks with q_ring), else 128; in tokens mode
        # with q_ring a KV block's one warpgroup arrives with a count of 2 per thread
        self.free_count = 256 if (mode == "heads" or q_ring) else 128
        self.kv_release = 1 if mode == "heads" else self.free_count // 128
        self.n_k_tiles = d_qk // 64
        self.nb = 3  # KV ring depth
        self.heads_per_cta = 2 * B_H if mode == "heads" else B_H
        # per-warp column partials, double-buffered by block parity: [set][parity][warp][64]
        self.psum_elems = (1 if mode == "heads" else 2) * 2 * (8 if mode == "heads" else 4) * B_TOPK
        # setmaxnreg budget: 2*consumer + producer must not exceed the launch allocation of
        # 168 regs x 384 threads (= 504 per thread-slot of a warpgroup), or the increase blocks.
        self.regs_consumer = 224
        self.regs_producer = 56
        assert 2 * self.regs_consumer + self.regs_producer <= 504
        self.smem_bytes = 0

    def _mma(self):
        """S = Q K^T with Q (A) from registers, K (B) K-major in smem: 64 heads x 64 tokens."""
        return sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1),
            (B_H, B_TOPK), warpgroup.OperandSource.RMEM,
        )

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [s_q, h_q, d_qk] bf16
        mKV: cute.Tensor,  # [s_kv, d_qk] bf16
        mIdx: cute.Tensor,  # [s_q, topk] int32, topk % 64 == 0
        mTopkLen: cute.Tensor,  # [s_q] int32 (read only if has_topk_length)
        mLse: cute.Tensor,  # [s_q, h_q] f32
        mOut: cute.Tensor,  # [n_groups, s_q, topk] f32
        scale_log2: Float32,
        stream,
    ):
        k_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
        sK_layout = cute.tile_to_shape(k_atom, (B_TOPK, self.d_qk), (0, 1))

        @cute.struct
        class SharedStorage:
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout) * self.nb], 1024]
            psum: cute.struct.Align[cute.struct.MemRange[Float32, self.psum_elems], 16]
            mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.nb + 4]
            sValid: cute.struct.MemRange[Uint32, 2 * self.nb]
            sTotal: cute.struct.MemRange[Float32, 16]  # [item parity][warp]

        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes <= SMEM_LIMIT, f"smem {self.smem_bytes} > {SMEM_LIMIT}"
        s_q = mQ.shape[0]
        n_groups = mQ.shape[1] // self.heads_per_cta
        n_items = s_q * n_groups
        grid = n_items
        if const_expr(self.ctas > 0):
            grid = cutlass.min(n_items, Int32(self.ctas))
        self.kernel(mQ, mKV, mIdx, mTopkLen, mLse, mOut, scale_log2, sK_layout, SharedStorage, n_groups).launch(
            grid=[grid, 1, 1], block=[THREADS, 1, 1], smem=self.smem_bytes, stream=stream,
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
        sK_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
        n_groups: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp_idx // 4
        idx_in_wg = tidx % 128
        n_items = mQ.shape[0] * n_groups
        grp = bidx % n_groups  # the item of a one-item CTA
        s_idx = bidx // n_groups

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar = storage.mbar.data_ptr()
        if warp_idx == 0:
            with cute.arch.elect_one():
                for b in cutlass.range_constexpr(self.nb):
                    # ready: 128 cp.async arrivals + 2 mask-writer arrivals; free: the consumers
                    dev.HalfBufferBarriers.init(mbar + 2 * b, mbar + 2 * b + 1, 128 + 2, self.free_count)
                for p in cutlass.range_constexpr(2):
                    # heads mode's partials ring slot p: full (every consumer thread arrives after its
                    # writes), empty (every WG0 thread arrives after the combine read the slot)
                    dev.HalfBufferBarriers.init(mbar + 2 * self.nb + 2 * p, mbar + 2 * self.nb + 2 * p + 1, 256, 128)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        num_blocks = None
        if const_expr(self.ctas == 0):
            num_blocks = (self._topk_len(mIdx, mTopkLen, s_idx) + (B_TOPK - 1)) // B_TOPK

        sK_base = storage.sK.data_ptr()
        sValid = storage.sValid.get_tensor(cute.make_layout(2 * self.nb))
        psum = storage.psum.get_tensor(cute.make_layout(self.psum_elems))
        sTotal = storage.sTotal.get_tensor(cute.make_layout(16))
        buf_elems = cute.cosize(sK_layout)

        if wg == 2:
            cute.arch.setmaxregister_decrease(self.regs_producer)
            buf0_addr = dev.smem_addr_u32(sK_base)
            warp_in_wg = warp_idx % 4
            if const_expr(self.ctas > 0):
                g0 = Int32(0)  # blocks gathered for this CTA's earlier items (the ring runs on)
                q_policy = dev.createpolicy_evict_first()  # Q rows are read once
                for item in cutlass.range(bidx, n_items, n_ctas, unroll=1):
                    if const_expr(self.q_ring):
                        g0 = g0 + self._produce_q(mQ, sValid, mbar, buf0_addr, buf_elems, item // n_groups,
                                                  item % n_groups, g0, idx_in_wg, warp_in_wg, q_policy)
                    g0 = g0 + self._produce_item(mIdx, mKV, mTopkLen, sValid, mbar, buf0_addr, buf_elems,
                                                 item // n_groups, g0, idx_in_wg, warp_in_wg)
            else:
                self._produce_item(mIdx, mKV, mTopkLen, sValid, mbar, buf0_addr, buf_elems, s_idx, 0, idx_in_wg,
                                   warp_in_wg, num_blocks)
        else:
            cute.arch.setmaxregister_increase(self.regs_consumer)
            self.consumer(
                mQ, mIdx, mTopkLen, mLse, mOut, scale_log2, sK_layout, sK_base, sValid, psum, sTotal, mbar,
                n_groups, n_items, bidx, n_ctas, wg, idx_in_wg, warp_idx, grp, s_idx, num_blocks,
            )

    @cute.jit
    def _produce_item(self, mIdx: cute.Tensor, mKV: cute.Tensor, mTopkLen: cute.Tensor, sValid: cute.Tensor,
                      mbar: cute.Pointer, buf0_addr: Int32, buf_elems: cutlass.Constexpr, s_idx: Int32, g0,
                      idx_in_wg: Int32, warp_in_wg: Int32, num_blocks=None) -> Int32:
        """Gather token ``s_idx``'s blocks into the ring (its block ``b`` is the CTA's ``g0 + b``-th:
        slot ``(g0 + b) % nb``), publishing each block's validity words; returns the block count
        (``num_blocks``: already known)."""
        topk_len = self._topk_len(mIdx, mTopkLen, s_idx)
        if const_expr(num_blocks is None):
            num_blocks = (topk_len + (B_TOPK - 1)) // B_TOPK
        gather = KvGather(mKV, mIdx, s_idx, topk_len, idx_in_wg, self.d_qk, slots=1)
        # tokens mode (h_q 64, where the gather sets the pace): block b + 1's indices (and the slot
        # this thread votes for) are fetched into registers while block b is issued, so that their
        # latency leaves the block's path, as in the forward (H200, interleaved: h64 s_kv 32k
        # 1.037x; heads mode measured 0.986x with it, so it loads each block's indices in place)
        prefetch = const_expr(self.mode == "tokens")
        rpt = gather.rows_per_thread
        raw = cute.make_rmem_tensor((rpt + 1,), Int32)  # the copy rows' indices, then the vote slot's
        if const_expr(prefetch):
            if num_blocks > 0:
                gather.fetch_raw(raw, 0, 0)
                raw[rpt] = gather.fetch_slot(gather.vote_slot(0))
        for b in cutlass.range(num_blocks, unroll=1):
            g = g0 + b
            slot = g % self.nb
            bars = dev.HalfBufferBarriers(mbar + 2 * slot, mbar + 2 * slot + 1)
            bits = Uint32(0)
            if const_expr(prefetch):
                gather.indices_from_raw(raw, b, 0)
                vslot = gather.vote_slot(b)
                bits = gather.vote_from_raw(raw[rpt], vslot)
                # the next block's (slots past topk read a clamped slot; never used past the end)
                gather.fetch_raw(raw, b + 1, 0)
                raw[rpt] = gather.fetch_slot(vslot + B_TOPK)
            else:
                gather.load_indices(b, 0)
                bits = gather.valid_word(b)
            bars.wait_free((g // self.nb) & 1)
            gather.copy_tiles(buf0_addr + slot * (buf_elems * 2), 0, 0, self.n_k_tiles)
            bars.commit_cp_async()
            if warp_in_wg < 2:
                if idx_in_wg % 32 == 0:
                    sValid[2 * slot + warp_in_wg] = bits
                    cute.arch.mbarrier_arrive(bars.ready)
        return num_blocks

    @cute.jit
    def _produce_q(self, mQ: cute.Tensor, sValid: cute.Tensor, mbar: cute.Pointer, buf0_addr: Int32,
                   buf_elems: cutlass.Constexpr, s_idx: Int32, grp: Int32, g0, idx_in_wg: Int32, warp_in_wg: Int32,
                   policy: Int64) -> Int32:
        """``q_ring``: item (``s_idx``, ``grp``)'s Q into the ring as the CTA's blocks ``g0`` (heads
        0..63 of the group: WG0's, in tokens mode both warpgroups') and, in heads mode, ``g0 + 1``
        (64..127: WG1's), in the KV blocks' tile layout; returns the blocks (2 / 1).  The validity
        words are written (never read) so that ``ready`` gets its two mask-writer arrivals as for a
        KV block."""
        row_bytes = self.d_qk * 2
        for w in cutlass.range_constexpr(self.q_blocks):
            g = g0 + w
            slot = g % self.nb
            bars = dev.HalfBufferBarriers(mbar + 2 * slot, mbar + 2 * slot + 1)
            head0 = Int64(s_idx) * mQ.shape[1] + grp * self.heads_per_cta + w * B_H
            src = dev.gmem_addr_i64(mQ.iterator) + head0 * row_bytes
            bars.wait_free((g // self.nb) & 1)
            copy_dense_rows(buf0_addr + slot * (buf_elems * 2), src, row_bytes, B_H, self.n_k_tiles, idx_in_wg,
                            policy)
            bars.commit_cp_async()
            if warp_in_wg < 2:
                if idx_in_wg % 32 == 0:
                    sValid[2 * slot + warp_in_wg] = Uint32(0xFFFFFFFF)
                    cute.arch.mbarrier_arrive(bars.ready)
        return Int32(self.q_blocks)

    @cute.jit
    def _topk_len(self, mIdx: cute.Tensor, mTopkLen: cute.Tensor, s_idx: Int32) -> Int32:
        topk_len = mIdx.shape[1]
        if const_expr(self.has_topk_length):
            topk_len = mTopkLen[s_idx]
        return topk_len

    @cute.jit
    def consumer(
        self,
        mQ: cute.Tensor,
        mIdx: cute.Tensor,
        mTopkLen: cute.Tensor,
        mLse: cute.Tensor,
        mOut: cute.Tensor,
        scale_log2: Float32,
        sK_layout: cute.ComposedLayout,
        sK_base: cute.Pointer,
        sValid: cute.Tensor,
        psum: cute.Tensor,
        sTotal: cute.Tensor,
        mbar: cute.Pointer,
        n_groups: Int32,
        n_items: Int32,
        first_item: Int32,
        n_ctas: Int32,
        wg: Int32,
        idx_in_wg: Int32,
        warp_idx: Int32,
        grp: Int32,
        s_idx: Int32,
        num_blocks,
    ):
        """WG0 / WG1: the CTA's items (``grp`` / ``s_idx`` / ``num_blocks``: a one-item CTA's)."""
        heads_mode = const_expr(self.mode == "heads")
        mma = self._mma()
        thr = mma.get_slice(idx_in_wg)
        head_off = wg * B_H if heads_mode else 0
        row0 = dev.fragment_row(idx_in_wg, 0)
        row1 = dev.fragment_row(idx_in_wg, 1)

        # Q (64 heads x d_qk) straight from global into the RS A-operand registers, with its two
        # lse terms: at the item's start (with 4-byte loads, a persistent CTA loads the next item's
        # right after the last wgmma of the current one, under that block's exponentials).
        tSrQ = thr.make_fragment_A(thr.partition_shape_A((B_H, self.d_qk)))
        acc_s = thr.make_fragment_C(thr.partition_shape_C((B_H, B_TOPK)))
        colsum = cute.make_rmem_tensor((16,), Float32)
        args = (mQ, mIdx, mTopkLen, mLse, mOut, scale_log2, sK_layout, sK_base, sValid, psum, sTotal, mbar, n_groups,
                n_items, n_ctas, thr, tSrQ, acc_s, colsum, wg, idx_in_wg, warp_idx, head_off, row0, row1)
        if const_expr(self.ctas > 0):
            q_item = Int32(-1)  # the item whose Q (and lse terms) the registers hold
            nlse0 = Float32(0.0)
            nlse1 = Float32(0.0)
            g0 = Int32(0)  # KV ring: blocks of this CTA's earlier items (the producer's count)
            r0 = Int32(0)  # partials ring / parity: this warpgroup's blocks of earlier items
            n_done = Int32(0)  # items done (the row-total exchange's parity)
            for item in cutlass.range(first_item, n_items, n_ctas, unroll=1):
                i_grp = item % n_groups
                i_tok = item // n_groups
                if const_expr(self.q_ring):
                    nlse0, nlse1 = self._q_from_ring(thr, mLse, tSrQ, sK_layout, sK_base, mbar, g0, i_tok, i_grp,
                                                     wg, idx_in_wg, head_off, row0, row1)
                    q_item = item
                    g0 = g0 + self.q_blocks
                else:
                    need_q = q_item != item
                    if const_expr(self.profile == "noq"):
                        need_q = q_item < 0  # the first item only: every later one runs on its Q (timing copy)
                    if need_q:
                        nlse0, nlse1 = self._load_q(thr, mQ, mLse, tSrQ, i_tok, i_grp, head_off, row0, row1)
                        q_item = item
                i_blocks = (self._topk_len(mIdx, mTopkLen, i_tok) + (B_TOPK - 1)) // B_TOPK
                n_mine, q_item, nlse0, nlse1 = self._consume_item(
                    *args, item, i_grp, i_tok, i_blocks, g0, r0, n_done, q_item, nlse0, nlse1)
                g0 = g0 + i_blocks
                r0 = r0 + n_mine
                n_done = n_done + 1
        else:
            nlse0, nlse1 = self._load_q(thr, mQ, mLse, tSrQ, s_idx, grp, head_off, row0, row1)
            self._consume_item(*args, first_item, grp, s_idx, num_blocks, 0, 0, 0, first_item, nlse0, nlse1)

    @cute.jit
    def _consume_item(self, mQ: cute.Tensor, mIdx: cute.Tensor, mTopkLen: cute.Tensor, mLse: cute.Tensor,
                      mOut: cute.Tensor, scale_log2: Float32, sK_layout: cute.ComposedLayout, sK_base: cute.Pointer,
                      sValid: cute.Tensor, psum: cute.Tensor, sTotal: cute.Tensor, mbar: cute.Pointer,
                      n_groups: Int32, n_items: Int32, n_ctas: Int32, thr, tSrQ: cute.Tensor, acc_s: cute.Tensor,
                      colsum: cute.Tensor, wg: Int32, idx_in_wg: Int32, warp_idx: Int32, head_off: int,
                      row0: Int32, row1: Int32, item: Int32, grp: Int32, s_idx: Int32, num_blocks: Int32, g0, r0,
                      n_done, q_item: Int32, neg_lse0: Float32, neg_lse1: Float32):
        """One work item of a consumer warpgroup (its Q in ``tSrQ``, its ``-lse log2(e)`` terms given):
        the blocks, the row's tail zeros and normalisation.  ``g0`` / ``r0`` / ``n_done``: the CTA's
        KV-ring blocks, this warpgroup's partial-sum ring entries and items before this one (Python
        0 in a one-item CTA).  Returns ``(this warpgroup's blocks, q_item, lse terms)`` -- the last
        three of the next item when a persistent CTA loaded its Q early."""
        heads_mode = const_expr(self.mode == "heads")
        persistent = const_expr(self.ctas > 0)
        lane = idx_in_wg % 32
        lane_quad = idx_in_wg % 4
        warp_in_wg = warp_idx % 4
        topk = mIdx.shape[1]
        # psum layout: [set][parity][warp][64]; the set is the WG in tokens mode.
        n_warps = 8 if heads_mode else 4
        pset = 0 if heads_mode else wg
        my_warp = warp_idx if heads_mode else warp_in_wg
        stride = 1 if heads_mode else 2
        me = wg * 128 + idx_in_wg
        nlse0 = neg_lse0
        nlse1 = neg_lse1

        nxt = item + n_ctas
        # tokens mode: WG w takes the blocks whose CTA-wide index g0 + b has parity w, so that
        # a warpgroup's consecutive blocks are 2 apart in the ring across items too: when it
        # waits for block g it has seen block g - 2 land, hence g - 3 (the ring's previous
        # use of the slot, landed in order before g - 2), and the parity wait cannot pass on
        # that slot's phase before last (a per-item alternation broke this after items with
        # 0 or 1 blocks: compute-sanitizer's synccheck reported the missed phase)
        first = 0
        if const_expr(not heads_mode):
            first = wg
            if const_expr(persistent):
                first = (wg + g0) & 1
        n_mine = (num_blocks - first + (stride - 1)) // stride
        total = Float32(0.0)
        if const_expr(self.profile == "gather"):
            for i in cutlass.range(n_mine, unroll=1):
                g = g0 + first + i * stride
                slot = g % self.nb
                bars = dev.HalfBufferBarriers(mbar + 2 * slot, mbar + 2 * slot + 1)
                bars.wait_ready((g // self.nb) & 1)
                bars.release(self.kv_release)
            return n_mine, q_item, nlse0, nlse1
        for i in cutlass.range(n_mine, unroll=1):
            b = first + i * stride
            g = g0 + b
            slot = g % self.nb
            bars = dev.HalfBufferBarriers(mbar + 2 * slot, mbar + 2 * slot + 1)
            bars.wait_ready((g // self.nb) & 1)
            mma = self._mma()  # fresh per region: the ACCUMULATE field must not escape the loop
            sK = cute.make_tensor(
                cute.recast_ptr((sK_base + slot * cute.cosize(sK_layout)).align(1024), sK_layout.inner),
                sK_layout.outer,
            )
            tSrK = thr.make_fragment_B(thr.partition_B(sK))
            cute.nvgpu.warpgroup.fence()
            for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                cute.gemm(mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k], acc_s)
            cute.nvgpu.warpgroup.commit_group()
            if const_expr(heads_mode):
                # WG0 combines the previous block while this block's wgmma runs.
                if (wg == 0) & (i > 0):
                    total = self._combine(psum, mOut, mbar, grp, s_idx, r0 + i - 1, i - 1, idx_in_wg, total)
            cute.nvgpu.warpgroup.wait_group(0)
            lo = sValid[2 * slot] >> Uint32(2 * lane_quad)
            hi = sValid[2 * slot + 1] >> Uint32(2 * lane_quad)
            bars.release(self.kv_release)
            # (q_vec: the loads feed shuffles right away -- no latency to hide, and the early copy
            # spills: the next item's Q is loaded at its start instead)
            if const_expr(persistent and self.profile != "noq" and not self.q_vec and not self.q_ring):
                if (i == n_mine - 1) & (nxt < n_items):
                    # the registers of Q are free: the next item's Q loads fly under this block's math
                    nlse0, nlse1 = self._load_q(thr, mQ, mLse, tSrQ, nxt // n_groups, nxt % n_groups, head_off,
                                                row0, row1)
                    q_item = nxt

            # P = exp2(S*c - lse*log2e), invalid slots 0; sum this thread's two rows per column.
            # (The mask is fused as a select rather than the forward's S = -inf pass: one pass
            # fewer, and a caller's lse = -inf cannot turn a masked slot into NaN.)
            for gi in cutlass.range_constexpr(8):
                word = lo if gi < 4 else hi
                for v0 in cutlass.range_constexpr(2):
                    p0 = cute.math.exp2(acc_s[dev.acc_flat(v0, 0, gi)] * scale_log2 + neg_lse0, fastmath=True)
                    p1 = cute.math.exp2(acc_s[dev.acc_flat(v0, 1, gi)] * scale_log2 + neg_lse1, fastmath=True)
                    bit = (word >> Uint32(8 * (gi % 4) + v0)) & Uint32(1)
                    colsum[2 * gi + v0] = Float32(cutlass.select_(bit != Uint32(0), p0 + p1, Float32(0.0)))
            # Reduce-scatter over the 8 row groups of the warp: lane l ends with columns 2l and
            # 2l+1 summed over the warp's 16 heads.
            dev.warp_reduce_scatter_cols(colsum, lane)
            r = r0 + i
            if const_expr(heads_mode):
                ring = dev.HalfBufferBarriers(mbar + 2 * self.nb + 2 * (r & 1),
                                              mbar + 2 * self.nb + 2 * (r & 1) + 1)
                ring.wait_free((r // 2) & 1)  # WG0 has combined block r - 2 out of this slot
            base = ((pset * 2 + (r & 1)) * n_warps + my_warp) * B_TOPK + 2 * lane
            psum[base] = colsum[0]
            psum[base + 1] = colsum[1]
            if const_expr(heads_mode):
                cute.arch.mbarrier_arrive(ring.ready)  # this thread's partials are in the slot
            else:
                cute.arch.barrier(barrier_id=BAR_PSUM_WG0 + wg, number_of_threads=128)
                # One pass over the warps' partials: the first 64 threads of the WG write the block.
                if idx_in_wg < B_TOPK:
                    src = (pset * 2 + (r & 1)) * n_warps * B_TOPK + idx_in_wg
                    acc = Float32(0.0)
                    for w in cutlass.range_constexpr(n_warps):
                        acc = acc + psum[src + w * B_TOPK]
                    mOut[grp, s_idx, b * B_TOPK + idx_in_wg] = acc
                    total = total + acc
        if const_expr(heads_mode):
            if (wg == 0) & (n_mine > 0):
                total = self._combine(psum, mOut, mbar, grp, s_idx, r0 + n_mine - 1, n_mine - 1, idx_in_wg,
                                      total)

        # Slots of blocks past topk_length are never gathered: write their zeros.
        n_tail = topk - num_blocks * B_TOPK
        for t in cutlass.range((n_tail + 255 - me) // 256, unroll=1):
            mOut[grp, s_idx, num_blocks * B_TOPK + me + t * 256] = Float32(0.0)

        if const_expr(self.normalize):
            # Row total: the writers' partials -> smem -> all; then re-scale the row in place.
            # (sTotal alternates between two halves by item, so a fast warp's next write cannot
            # meet a slow warp's read of this item's totals.)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=16)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=8)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=4)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            half = 0
            if const_expr(persistent):
                half = (n_done & 1) * 8
            if lane == 0:
                sTotal[half + warp_idx] = total
            cute.arch.barrier(barrier_id=BAR_TOTAL, number_of_threads=256)
            row_total = Float32(0.0)
            for w in cutlass.range_constexpr(8):
                row_total = row_total + sTotal[half + w]
            inv = Float32(cutlass.select_(row_total > 0.0, 1.0 / row_total, Float32(0.0)))
            for t in cutlass.range((num_blocks * B_TOPK + 255 - me) // 256, unroll=1):
                j = me + t * 256
                mOut[grp, s_idx, j] = mOut[grp, s_idx, j] * inv
        return n_mine, q_item, nlse0, nlse1

    @cute.jit
    def _q_from_ring(self, thr, mLse: cute.Tensor, tSrQ: cute.Tensor, sK_layout: cute.ComposedLayout,
                     sK_base: cute.Pointer, mbar: cute.Pointer, g0, s_idx: Int32, grp: Int32, wg: Int32,
                     idx_in_wg: Int32, head_off: int, row0: Int32, row1: Int32):
        """``q_ring``: this warpgroup's Q from ring block ``g0 + wg`` (tokens mode: ``g0``, shared)
        into the A registers (ldmatrix), then the item's Q blocks freed; returns the ``-lse
        log2(e)`` terms.  Heads mode: each warpgroup waits for *both* blocks before it frees them
        (every consumer thread arrives on both): a free arrival must not land in the slot's
        previous phase (the other warpgroup may still be reading the previous item's block
        there).  Tokens mode: every consumer thread of both warpgroups frees the shared block once
        (the slots count 256 arrivals; a KV block's one warpgroup arrives with a count of 2); the
        slot's previous use had all its arrivals before the producer refilled it for this Q."""
        heads_mode = const_expr(self.mode == "heads")
        for w in cutlass.range_constexpr(self.q_blocks):
            g = g0 + w
            slot = g % self.nb
            dev.HalfBufferBarriers(mbar + 2 * slot, mbar + 2 * slot + 1).wait_ready((g // self.nb) & 1)
        mine = g0 % self.nb
        if const_expr(heads_mode):
            mine = (g0 + wg) % self.nb
        sQ = cute.make_tensor(
            cute.recast_ptr((sK_base + mine * cute.cosize(sK_layout)).align(1024), sK_layout.inner),
            sK_layout.outer,
        )
        ld_atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), BFloat16)
        thr_ld = cute.make_tiled_copy_A(ld_atom, self._mma()).get_slice(idx_in_wg)
        cute.copy(thr_ld, thr_ld.partition_S(sQ), thr_ld.retile(tSrQ))
        for w in cutlass.range_constexpr(self.q_blocks):
            slot = (g0 + w) % self.nb
            dev.HalfBufferBarriers(mbar + 2 * slot, mbar + 2 * slot + 1).release()
        head0 = grp * self.heads_per_cta + head_off
        return -mLse[s_idx, head0 + row0] * dev.LOG2E, -mLse[s_idx, head0 + row1] * dev.LOG2E

    @cute.jit
    def _load_q(self, thr, mQ: cute.Tensor, mLse: cute.Tensor, tSrQ: cute.Tensor, s_idx: Int32, grp: Int32,
                head_off: int, row0: Int32, row1: Int32):
        """Q of token ``s_idx``'s 64 heads of group ``grp`` (this warpgroup's) into the A-operand
        registers; returns their ``-lse * log2(e)`` terms."""
        head0 = grp * self.heads_per_cta + head_off
        if const_expr(self.q_vec):
            self._load_q_vec(mQ, tSrQ, s_idx, head0, row0)
        else:
            gQ = cute.local_tile(mQ[s_idx, None, None], (B_H, self.d_qk), (head0 // B_H, 0))
            cute.autovec_copy(thr.partition_A(gQ), tSrQ)
        return -mLse[s_idx, head0 + row0] * dev.LOG2E, -mLse[s_idx, head0 + row1] * dev.LOG2E

    @cute.jit
    def _load_q_vec(self, mQ: cute.Tensor, tSrQ: cute.Tensor, s_idx: Int32, head0: Int32, row0: Int32):
        """``tSrQ`` (the RS wgmma's A fragment of Q rows ``head0 ..+ 64``) by 16-byte loads.

        The fragment as 32-bit words: word ``4 k + e1 + 2 e2`` of a thread holds columns
        ``16 k + 8 e2 + 2 q, +1`` of row ``row0 + 8 e1`` (``q`` = lane % 4).  Lane ``q`` of a quad
        loads chunk ``q`` (columns ``32 j + 8 q ..+ 8``) of a row; the quad's four chunks then hold
        the 16 words its lanes need for k-steps ``2 j, 2 j + 1``, lane ``q`` wanting word ``q`` of
        every chunk: a 4 x 4 transpose by two butterfly exchanges (lane bit 1, then bit 0), each
        swapping the two words whose index bit differs from the lane's."""
        tidx, _, _ = cute.arch.thread_idx()
        q = tidx % 4
        b1 = (q & 2) != 0
        b0 = (q & 1) != 0
        words = cute.recast_tensor(tSrQ, Uint32)
        assert cute.size(words) == 2 * (self.d_qk // 16) * 2, words.layout
        h = mQ.shape[1]
        v = cute.make_rmem_tensor((4,), Uint32)
        for e1 in cutlass.range_constexpr(2):
            # 64-bit element offset: s_q * h_q * d_qk may pass 2^31
            row_ptr = mQ.iterator + ((Int64(s_idx) * h + (head0 + row0 + 8 * e1)) * self.d_qk + 8 * q)
            for j in cutlass.range_constexpr(self.d_qk // 32):
                src = cute.make_tensor(cute.recast_ptr((row_ptr + 32 * j).align(16), dtype=Uint32), cute.make_layout(4))
                cute.autovec_copy(src, v)
                # exchange across lane bit 1: keep the words whose index bit 1 is the lane's
                sa = Uint32(cutlass.select_(b1, v[0], v[2]))
                sb = Uint32(cutlass.select_(b1, v[1], v[3]))
                ra = cute.arch.shuffle_sync_bfly(sa, offset=2)
                rb = cute.arch.shuffle_sync_bfly(sb, offset=2)
                n0 = Uint32(cutlass.select_(b1, ra, v[0]))
                n1 = Uint32(cutlass.select_(b1, rb, v[1]))
                n2 = Uint32(cutlass.select_(b1, v[2], ra))
                n3 = Uint32(cutlass.select_(b1, v[3], rb))
                # across lane bit 0
                sa = Uint32(cutlass.select_(b0, n0, n1))
                sb = Uint32(cutlass.select_(b0, n2, n3))
                ra = cute.arch.shuffle_sync_bfly(sa, offset=1)
                rb = cute.arch.shuffle_sync_bfly(sb, offset=1)
                # lane q now holds word q of chunks 0..3 = k-step 2j (e2 0, 1), k-step 2j + 1 (e2 0, 1)
                words[8 * j + e1] = Uint32(cutlass.select_(b0, ra, n0))
                words[8 * j + 2 + e1] = Uint32(cutlass.select_(b0, n1, ra))
                words[8 * j + 4 + e1] = Uint32(cutlass.select_(b0, rb, n2))
                words[8 * j + 6 + e1] = Uint32(cutlass.select_(b0, n3, rb))

    @cute.jit
    def _combine(self, psum: cute.Tensor, mOut: cute.Tensor, mbar: cute.Pointer, grp: Int32, s_idx: Int32,
                 r: Int32, j: Int32, idx_in_wg: Int32, total: Float32) -> Float32:
        """Heads mode, WG0 only: once both warpgroups' partials of block ``j`` of the item are in
        partials-ring entry ``r`` (the CTA's running block count), threads 0..63 sum the 8 warps'
        partials of their column and write it; every WG0 thread then frees the slot.  Returns
        ``total`` plus this thread's column sum."""
        ring = dev.HalfBufferBarriers(mbar + 2 * self.nb + 2 * (r & 1), mbar + 2 * self.nb + 2 * (r & 1) + 1)
        ring.wait_ready((r // 2) & 1)
        if idx_in_wg < B_TOPK:
            src = (r & 1) * 8 * B_TOPK + idx_in_wg
            acc = Float32(0.0)
            for w in cutlass.range_constexpr(8):
                acc = acc + psum[src + w * B_TOPK]
            mOut[grp, s_idx, j * B_TOPK + idx_in_wg] = acc
            total = total + acc
        ring.release()
        return total
