"""Exact per-row top-k over a block of indexer score rows (CuTe DSL; plain loads/stores and shared
atomics -- no tensor cores, so arch-agnostic; compiled for sm_90a here).

One CTA (512 threads, 16 warps) per row ``r`` of ``scores [rows, ld]`` (query ``t = q0 + r``);
the row's keys are ``[k_start[t], k_end[t])``.  A row with ``n <= topk`` keys takes them all.
Otherwise a radix select on the order-preserving uint32 key of each score (NaN as -inf, -0 as
+0) finds the threshold -- the ``topk``-th largest key -- and the selection is written in
ascending key order: every key above the threshold and the first ``need`` keys equal to it (ties
go to the smaller index), at position ``#(greater before it) + min(#(equal before it), need)``
(ballots and popcounts, no sort).  Exact and deterministic.

Global passes over the row (each warp owns a contiguous segment of it in the passes that need the
order):

1. a 2048-bin shared histogram of the top 11 key bits (16-byte loads) -> the threshold bin ``b``;
2. per warp segment, the count of keys above ``b`` (and equal to it), and the keys of bin ``b``
   collected into shared memory (at most :data:`CAP` of them, in chunks of :data:`CHUNK` slots
   handed out to the warps: one shared atomic per chunk, not per warp step); the global row's
   scores are compared as floats against the bin's bounds
   (:func:`~mla_kernels.common.indexer_device.bin_bounds`: a ``max`` and two compares, no key
   formed but the candidates'); with ``full_batches`` the batches wholly inside a warp's segment
   run without bounds checks, the last one with them (:meth:`IndexerTopkSm90.pass2_batch`);
3. the write pass.

Between 2 and 3 the threshold is refined on the shared candidates (digits of 11 and 10 bits; a
digit whose threshold bin is taken whole ends the search) and the candidates are counted per
warp segment.  A row whose threshold bin holds more than :data:`CAP` keys (heavy ties), or whose
candidate chunks need more than :data:`CAND_BUF` slots, refines and counts by further passes over
the row instead (up to 5 in all).

With ``pre_hist`` pass 1 is not run: the row's first-digit histogram comes from ``hist[r, :]``,
which the score kernel counted while it wrote the row (``indexer_score.py``, ``hist``) -- one
read of the row fewer.

With ``bitmap`` (default) pass 3 is skipped when the row has at most :data:`MAP_BITS` keys and
the refined threshold's ties are all taken (``need`` = their count: every row of real-valued
scores; exact ties beyond ``need`` take the passes above): pass 2 also stores, per 32 keys, the
warp's ballot of the keys above the first digit's bin (with that bin when it is taken whole) as
one word of a shared selection bitmap; the refined candidates at or above the threshold are
or-ed in; the selection is then written from the bitmap (per-thread word ranges, popcounts, a
block prefix sum) -- no third read of the row.

With ``row_cap`` (``indexer_host.TOPK_VARIANTS``, chosen per row block by its longest row) a row
of ``n <= row_cap`` keys is read from global memory ONCE: pass 1 loads it with 16-byte loads
(``row_unroll`` of them in flight per thread), histograms it and stores its order-preserving
uint32 keys into shared memory (the bitmap's region, grown to ``row_cap + 4`` words; ``bitmap``
is not used for such a row); passes 2, any refinement over the row (heavy ties), the segment
counts and the write then read the keys from shared memory (the selected logits are read back
from the global row: ``topk`` loads).  Rows longer than ``row_cap`` take the global path above in
the same kernel.  Shared memory: ``42.7 KiB + 4 (row_cap + 4)`` bytes -- 107 KiB at 16,384 keys
(2 CTAs per SM), 171 KiB at 32,768 and 227 KiB at :data:`MAX_ROW_CAP` (1 CTA per SM).

Both row passes are bound by the ALU pipe (Nsight Compute, H200: issue slots 64-69% busy,
``math_pipe_throttle`` and ``not_selected`` the top stall reasons), so their instruction count is
their time: :func:`~mla_kernels.common.indexer_device.ordered_key` costs three ALU instructions
and one FMA-pipe instruction per key (docs/PERF.md).

Occupancy options: ``min_ctas`` bounds the registers so that that many CTAs fit on an SM
(``.minnctapersm``), ``map_words`` sizes the bitmap (rows of more than ``32 map_words`` keys are
written by the third pass), ``batch`` / ``row_unroll`` set the loads in flight per thread.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, const_expr

from ..common import indexer_device as idev
from ..common.device import st_shared_v4_b32

THREADS = 512
WARPS = THREADS // 32
BINS = 2048
#: Shared-memory candidates (keys of the threshold bin of the first digit): rows whose bin holds
#: at most ``CAP`` keys collect them in pass 2.
CAP = 4096
#: Pass 2 hands out the candidate buffer in chunks of ``CHUNK`` slots, one shared atomic per chunk
#: per warp (not per warp step); a warp's last chunk may stay partly empty (filled with key 0,
#: which no score has), so the buffer has :data:`CAND_BUF` slots: a row whose chunks need more
#: (``CAP`` keys in its bin and more than 320 empty slots) takes the heavy-ties path.
CHUNK = 32
CAND_BUF = CAP + 320
D1 = (21, 11)  # (shift, bits) of the first digit
REFINE = ((10, 11), (0, 10))  # the finer digits
BAR = 1
#: Words of the shared selection bitmap (``bitmap``): rows of at most ``MAP_BITS`` keys.
MAP_WORDS = 8192
MAP_BITS = 32 * MAP_WORDS
#: Largest ``row_cap`` (keys of a row held in shared memory): the rest of the storage is ~43 KiB of
#: the 227 KiB a CTA may have.
MAX_ROW_CAP = 47104


class IndexerTopkSm90:
    """Static configuration (whether the selected scores are returned; ``batch``: warp steps of 32
    keys whose loads are issued together in the ordered passes) + launcher + kernel."""

    def __init__(self, return_logits: bool, batch: int = 4, bitmap: bool = True, pre_hist: bool = False,
                 row_cap: int = 0, min_ctas: int = 0, map_words: int = MAP_WORDS, row_unroll: int = 0,
                 full_batches: bool = False):
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if not 0 <= row_cap <= MAX_ROW_CAP or row_cap % 32:
            raise ValueError(f"row_cap must be a multiple of 32 in [0, {MAX_ROW_CAP}], got {row_cap}")
        if row_cap and pre_hist:
            raise ValueError("row_cap and pre_hist exclude each other (the row pass builds the histogram)")
        self.return_logits = return_logits
        self.batch = batch
        self.bitmap = bitmap
        self.pre_hist = pre_hist
        if min_ctas not in (0, 1, 2, 3, 4):
            raise ValueError(f"min_ctas must be 0 (no bound), 1, 2, 3 or 4, got {min_ctas}")
        if not 32 <= map_words <= MAP_WORDS or map_words % 4:
            raise ValueError(f"map_words must be a multiple of 4 in [32, {MAP_WORDS}], got {map_words}")
        self.row_cap = row_cap
        if full_batches and row_cap:
            raise ValueError("full_batches is for the kernels without rows in shared memory (row_cap 0)")
        #: pass 2's batches wholly inside a warp's segment without bounds checks
        self.full_batches = full_batches
        #: CTAs per SM the registers must allow (ptxas ``.minnctapersm``; 0: no bound)
        self.min_ctas = min_ctas
        #: words of the selection bitmap: rows of at most ``32 map_words`` keys are written from it
        self.map_words = map_words
        #: 16-byte loads per thread in flight in the shared-memory row path's load (more where one
        #: CTA holds the SM)
        self.row_unroll = row_unroll or (8 if row_cap > 16384 else 4)
        #: 32-bit words of the shared region of the bitmap and the row's keys
        self.sel_words = max(map_words if bitmap else 4, row_cap + 4 if row_cap else 0)
        self.smem_bytes = 0

    @cute.jit
    def __call__(
        self,
        mScores: cute.Tensor,  # [rows, ld] f32: row r is query q0 + r
        mStart: cute.Tensor,  # [s_q] int32
        mEnd: cute.Tensor,  # [s_q] int32
        mIdx: cute.Tensor,  # [s_q, topk] int32 (out)
        mLen: cute.Tensor,  # [s_q] int32 (out)
        mLogits: cute.Tensor,  # [s_q, topk] f32 (out; only with return_logits)
        mHist: cute.Tensor,  # [>= rows, 2048] int32: row r's first-digit histogram (read only with pre_hist)
        q0: Int32,
        stream,
    ):
        @cute.struct
        class SharedStorage:
            hist: cute.struct.Align[cute.struct.MemRange[Int32, BINS], 16]
            cand_key: cute.struct.Align[cute.struct.MemRange[Uint32, CAND_BUF], 16]
            cand_idx: cute.struct.Align[cute.struct.MemRange[Int32, CAND_BUF], 16]
            scratch: cute.struct.MemRange[Int32, WARPS]
            seg_gt: cute.struct.MemRange[Int32, WARPS]
            seg_eq: cute.struct.MemRange[Int32, WARPS]
            found: cute.struct.MemRange[Int32, 4]
            sel: cute.struct.Align[cute.struct.MemRange[Uint32, self.sel_words], 16]

        self.smem_bytes = SharedStorage.size_in_bytes()
        assert self.smem_bytes <= 232448, f"smem {self.smem_bytes} > 232448"
        self.kernel(mScores, mStart, mEnd, mIdx, mLen, mLogits, mHist, q0, SharedStorage).launch(
            grid=[mScores.shape[0], 1, 1], block=[THREADS, 1, 1], smem=self.smem_bytes, stream=stream,
            **self._occupancy()
        )

    def _occupancy(self):
        """Launch options of ``min_ctas`` (the carveout given, so that no device is queried)."""
        if not self.min_ctas:
            return {}
        return dict(min_blocks_per_mp=self.min_ctas, preferred_smem_carveout=100)

    @cute.kernel
    def kernel(self, mScores: cute.Tensor, mStart: cute.Tensor, mEnd: cute.Tensor, mIdx: cute.Tensor,
               mLen: cute.Tensor, mLogits: cute.Tensor, mHist: cute.Tensor, q0: Int32,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        t = q0 + bidx
        s_q = mStart.shape[0]
        topk = mIdx.shape[1]
        if t < s_q:
            st = mStart[t]
            n = cutlass.max(mEnd[t] - st, Int32(0))
            row_ptr = mScores.iterator + (Int64(bidx) * Int64(mScores.shape[1]) + Int64(st))
            row = cute.make_tensor(row_ptr, cute.make_layout(cutlass.max(n, Int32(1))))
            if n <= topk:
                for i in cutlass.range((topk - tidx + THREADS - 1) // THREADS, unroll=1):
                    j = tidx + i * THREADS
                    ok = j < n
                    mIdx[t, j] = Int32(cutlass.select_(ok, st + j, Int32(-1)))
                    if const_expr(self.return_logits):
                        v = Float32(-math.inf)
                        if ok:
                            v = row[j]
                        mLogits[t, j] = v
                if tidx == 0:
                    mLen[t] = n
            else:
                self.select(row, row_ptr, n, st, t, topk, mIdx, mLogits, mHist, bidx, storage, tidx)
                if tidx == 0:
                    mLen[t] = topk

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def find_bin(self, sHist, nb: cutlass.Constexpr, need, sScratch, sFound, tidx):
        """``(b, need', count)``: the bin holding the ``need``-th largest key (bins scanned from
        the top), how many of its keys are still needed, and its count.  Ends with a barrier."""
        per = nb // THREADS  # thread i owns bins nb-1-per*i-e, e = 0..per-1 (descending)
        local = Int32(0)
        for e in cutlass.range_constexpr(per):
            local = local + sHist[nb - 1 - per * tidx - e]
        above, _ = idev.block_exclusive_sum(local, sScratch, tidx, WARPS, BAR, THREADS)
        acc = above
        for e in cutlass.range_constexpr(per):
            b = nb - 1 - per * tidx - e
            c = sHist[b]
            if acc < need and need <= acc + c:
                sFound[0] = b
                sFound[1] = need - acc
                sFound[2] = c
            acc = acc + c
        cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
        res = (sFound[0], sFound[1], sFound[2])
        cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
        return res

    @cute.jit
    def clear_hist(self, sHist, tidx):
        for i in cutlass.range_constexpr(BINS // THREADS):
            sHist[tidx + i * THREADS] = Int32(0)

    @cute.jit
    def select(self, row, row_ptr, n, st, t, topk, mIdx, mLogits, mHist, bidx, storage, tidx):
        """``n > topk``: the threshold (prefix of the key above ``shift``, ``need`` of its ties),
        the per-warp-segment counts, then the ordered write -- from the row's keys in shared memory
        when it has at most ``row_cap`` keys, else from the global row."""
        if const_expr(self.row_cap > 0):
            if n <= Int32(self.row_cap):
                self.select_rows_from(True, row, row_ptr, n, st, t, topk, mIdx, mLogits, mHist, bidx, storage, tidx)
            else:
                self.select_rows_from(False, row, row_ptr, n, st, t, topk, mIdx, mLogits, mHist, bidx, storage, tidx)
        else:
            self.select_rows_from(False, row, row_ptr, n, st, t, topk, mIdx, mLogits, mHist, bidx, storage, tidx)

    @cute.jit
    def select_rows_from(self, in_smem: cutlass.Constexpr, row, row_ptr, n, st, t, topk, mIdx, mLogits, mHist,
                         bidx, storage, tidx):
        """:meth:`select`'s passes; ``in_smem``: pass 1 stores the row's keys in shared memory
        (``src``) and the later passes read them there (no bitmap); else ``src`` is the global row."""
        sHist = storage.hist.get_tensor(cute.make_layout(BINS))
        sCandKey = storage.cand_key.get_tensor(cute.make_layout(CAND_BUF))
        sCandIdx = storage.cand_idx.get_tensor(cute.make_layout(CAND_BUF))
        sScratch = storage.scratch.get_tensor(cute.make_layout(WARPS))
        sSegGt = storage.seg_gt.get_tensor(cute.make_layout(WARPS))
        sSegEq = storage.seg_eq.get_tensor(cute.make_layout(WARPS))
        sFound = storage.found.get_tensor(cute.make_layout(4))
        sSel = storage.sel.get_tensor(cute.make_layout(self.sel_words))
        use_map = self.bitmap and not in_smem  # the bitmap shares its region with the row's keys
        lane = tidx % 32
        warp = tidx // 32
        seg = ((n + THREADS - 1) // THREADS) * 32  # each warp's contiguous segment
        w0 = warp * seg
        w1 = cutlass.min(w0 + seg, n)
        n_steps = cutlass.max(w1 - w0 + 31, Int32(0)) // 32
        mis = Int32((row_ptr.toint() // 4) % 4)  # the row's first key's float offset in its 16 bytes
        src = row
        if const_expr(in_smem):
            # key j at word mis + j: the row's 16-byte-aligned quads land on 16-byte-aligned words
            src = cute.make_tensor(sSel.iterator + mis, cute.make_layout(self.row_cap + 1))

        # -- pass 1: histogram of the first digit (16-byte loads past the unaligned head) --------
        if tidx == 0:
            sFound[3] = Int32(0)  # candidate slots handed out (chunks)
        if const_expr(self.pre_hist):  # counted by the score kernel
            for i in cutlass.range_constexpr(BINS // THREADS):
                sHist[tidx + i * THREADS] = mHist[bidx, tidx + i * THREADS]
            cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
        elif const_expr(in_smem):
            self.clear_hist(sHist, tidx)
            cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
            self.load_row_keys(row, row_ptr, n, mis, src, sHist, tidx)
            cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
        else:
            self.clear_hist(sHist, tidx)
            cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
            head = cutlass.min((4 - mis) % 4, n)
            n_vec = (n - head) // 4
            for i in cutlass.range((head - tidx + THREADS - 1) // THREADS, unroll=1):
                self.hist_add(sHist, idev.ordered_key(row[tidx + i * THREADS]))
            tail0 = head + 4 * n_vec
            for i in cutlass.range((n - tail0 - tidx + THREADS - 1) // THREADS, unroll=1):
                self.hist_add(sHist, idev.ordered_key(row[tail0 + tidx + i * THREADS]))
            r4 = cute.make_rmem_tensor((4,), Float32)
            for i in cutlass.range((n_vec - tidx + THREADS - 1) // THREADS, unroll=4):
                v = tidx + i * THREADS
                gsrc = cute.make_tensor((row_ptr + (Int64(head) + Int64(4 * v))).align(16), cute.make_layout(4))
                cute.autovec_copy(gsrc, r4)
                for e in cutlass.range_constexpr(4):
                    self.hist_add(sHist, idev.ordered_key(r4[e]))
            cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
        b1, need, cnt = self.find_bin(sHist, BINS, topk, sScratch, sFound, tidx)
        prefix = Uint32(b1)
        shift = Int32(D1[0])
        done = cnt == need
        done1 = done
        use_cand = (cnt <= CAP) & (cnt != need)
        map_ok = n <= Int32(32 * self.map_words if use_map else -1)  # never without the bitmap

        # -- pass 2: per-segment counts above / in bin b1; bin b1's keys to smem ---------------
        lt = cute.arch.lanemask_lt()
        cgt = Int32(0)
        ceq = Int32(0)
        cbase = Int32(-CHUNK)  # this warp's candidate chunk (none yet: "full")
        cfill = Int32(CHUNK)
        # the threshold bin's bounds: keys (shared memory) or floats (the global row, compared
        # without forming their keys: a max and two compares per score instead of seven ALU
        # instructions; the candidates' keys are formed where they are stored)
        if const_expr(in_smem):
            b_lo = prefix << Uint32(D1[0])
            b_hi = b_lo | Uint32((1 << D1[0]) - 1)
        else:
            b_lo, b_hi = idev.bin_bounds(prefix, D1[0])
        ks = cute.make_rmem_tensor((self.batch,), Uint32 if in_smem else Float32)
        n_full = Int32(0)
        if const_expr(self.full_batches):
            # the batches wholly inside the warp's segment without bounds checks (fewer ALU
            # instructions, the pass's bound), then the last one.  An option: the loop's second
            # copy costs registers (spills in the kernels not bounded to 3 CTAs per SM).
            n_full = cutlass.max(w1 - w0, Int32(0)) // (32 * self.batch)
            for ib in cutlass.range(n_full, unroll=1):
                cgt, ceq, cbase, cfill = self.pass2_batch(
                    True, in_smem, src, ks, ib, w0, w1, lane, lt, b_lo, b_hi, done1, map_ok, use_map, use_cand, cgt,
                    ceq, cbase, cfill, sSel, sFound, sCandKey, sCandIdx)
        for ib in cutlass.range(n_full, (n_steps + self.batch - 1) // self.batch, unroll=1):
            cgt, ceq, cbase, cfill = self.pass2_batch(
                False, in_smem, src, ks, ib, w0, w1, lane, lt, b_lo, b_hi, done1, map_ok, use_map, use_cand, cgt,
                ceq, cbase, cfill, sSel, sFound, sCandKey, sCandIdx)
        if use_cand:
            # the empty slots of this warp's last chunk: key 0 (no score has it, see CHUNK)
            if cfill < CHUNK and lane >= cfill and cbase + lane < CAND_BUF:
                sCandKey[cbase + lane] = Uint32(0)
                sCandIdx[cbase + lane] = Int32(0)
        if lane == 0:
            sSegGt[warp] = cgt
            sSegEq[warp] = ceq
        cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
        n_cand = sFound[3]  # the slots handed out: the candidates and the chunks' empty slots
        use_cand = use_cand & (n_cand <= CAND_BUF)  # else some were dropped: the heavy-ties path

        if use_cand:
            # -- refine on the candidates (shared memory only) --------------------------------
            for p in cutlass.range_constexpr(len(REFINE)):
                d_shift, d_bits = REFINE[p]
                if not done:
                    self.clear_hist(sHist, tidx)
                    cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
                    for i in cutlass.range((n_cand - tidx + THREADS - 1) // THREADS, unroll=1):
                        key = sCandKey[tidx + i * THREADS]
                        if (key >> Uint32(d_shift + d_bits)) == prefix:
                            b = Int32((key >> Uint32(d_shift)) & Uint32((1 << d_bits) - 1))
                            cute.arch.atomic_add(sHist.iterator + b, Int32(1))
                    cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
                    b, need, c = self.find_bin(sHist, 1 << d_bits, need, sScratch, sFound, tidx)
                    prefix = (prefix << Uint32(d_bits)) | Uint32(b)
                    shift = Int32(d_shift)
                    done = c == need
            if const_expr(use_map):
                map_ok = map_ok & done
            if map_ok:
                # -- every tie taken: the candidates at or above the threshold into the bitmap ----
                if const_expr(use_map):
                    for i in cutlass.range((n_cand - tidx + THREADS - 1) // THREADS, unroll=1):
                        key = sCandKey[tidx + i * THREADS]
                        j = sCandIdx[tidx + i * THREADS]
                        if (key >> Uint32(shift)) >= prefix:
                            cute.arch.atomic_or(sSel.iterator + (j // 32), Uint32(1) << Uint32(j % 32))
                    cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
            else:
                # -- the candidates per warp segment: finer "greater" and "equal" --------------
                if tidx < WARPS:
                    sSegEq[tidx] = Int32(0)
                cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
                for i in cutlass.range((n_cand - tidx + THREADS - 1) // THREADS, unroll=1):
                    key = sCandKey[tidx + i * THREADS]
                    w = sCandIdx[tidx + i * THREADS] // seg
                    hi = key >> Uint32(shift)
                    if hi > prefix:
                        cute.arch.atomic_add(sSegGt.iterator + w, Int32(1))
                    if hi == prefix:
                        cute.arch.atomic_add(sSegEq.iterator + w, Int32(1))
                cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
        else:
            if const_expr(use_map):
                map_ok = map_ok & done1  # the bitmap holds bin b1 whole; heavy ties go by the row
            if not done:
                # -- heavy ties: refine and count by passes over the row -------------------------
                for p in cutlass.range_constexpr(len(REFINE)):
                    d_shift, d_bits = REFINE[p]
                    if not done:
                        self.clear_hist(sHist, tidx)
                        cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
                        for i in cutlass.range((n - tidx + THREADS - 1) // THREADS, unroll=4):
                            key = self.key_at(in_smem, src, tidx + i * THREADS)
                            if (key >> Uint32(d_shift + d_bits)) == prefix:
                                b = Int32((key >> Uint32(d_shift)) & Uint32((1 << d_bits) - 1))
                                cute.arch.atomic_add(sHist.iterator + b, Int32(1))
                        cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
                        b, need, c = self.find_bin(sHist, 1 << d_bits, need, sScratch, sFound, tidx)
                        prefix = (prefix << Uint32(d_bits)) | Uint32(b)
                        shift = Int32(d_shift)
                        done = c == need
                self.count_segments(in_smem, src, w0, w1, n_steps, prefix, shift, sSegGt, sSegEq, lane, warp)
        if const_expr(use_map):
            if map_ok:
                self.write_from_map(row, n, st, t, mIdx, mLogits, sSel, sScratch, tidx)
            else:
                self.write_selection(in_smem, src, row, st, t, w0, w1, n_steps, prefix, shift, need, mIdx, mLogits,
                                     sSegGt, sSegEq, lane, warp)
        else:
            self.write_selection(in_smem, src, row, st, t, w0, w1, n_steps, prefix, shift, need, mIdx, mLogits,
                                 sSegGt, sSegEq, lane, warp)

    @cute.jit
    def pass2_batch(self, full: cutlass.Constexpr, in_smem: cutlass.Constexpr, src, ks, ib, w0, w1, lane, lt, b_lo,
                    b_hi, done1, map_ok, use_map: cutlass.Constexpr, use_cand, cgt, ceq, cbase, cfill, sSel, sFound,
                    sCandKey, sCandIdx):
        """Pass 2 over batch ``ib`` of this warp's segment (``full``: wholly inside it, no bounds
        checks): the counts above / in the threshold bin (``in_smem``: keys ``b_lo ..= b_hi``;
        else scores ``y >= b_lo`` and not ``y >= b_hi``, :func:`~mla_kernels.common.indexer_device.bin_bounds`)
        added to ``(cgt, ceq)``, the bitmap's words, the bin's keys appended to the warp's
        candidate chunk ``cbase`` (``cfill`` of its :data:`CHUNK` slots used; a new chunk from the
        shared count when it is full).  Returns ``(cgt, ceq, cbase, cfill)``."""
        if const_expr(in_smem):
            self.load_keys(True, src, ks, w0 + ib * (32 * self.batch) + lane, w1, guard=not full)
        else:
            self.load_batch(src, ks, w0 + ib * (32 * self.batch) + lane, w1, guard=not full)
        for u in cutlass.range_constexpr(self.batch):
            j = w0 + (ib * self.batch + u) * 32 + lane
            if const_expr(in_smem):
                gt = ks[u] > b_hi
                eq = (ks[u] >= b_lo) & (ks[u] <= b_hi)
            else:
                y = idev.no_nan(ks[u])
                gt = y >= b_hi
                eq = (y >= b_lo) & ~gt  # (not y < b_hi: b_hi is NaN above the top bin)
            if const_expr(not full):
                ok = j < w1
                gt = ok & gt
                eq = ok & eq
            gtm = Uint32(cute.arch.vote_ballot_sync(gt))
            cgt = cgt + Int32(cute.arch.popc(gtm))
            m = Uint32(cute.arch.vote_ballot_sync(eq))
            k = Int32(cute.arch.popc(m))
            ceq = ceq + k
            if const_expr(use_map):
                # (two copies of the store: one predicate built as (lane == 0) & (j0 < w1) compiled
                # to 8 more instructions)
                j0 = w0 + (ib * self.batch + u) * 32
                if const_expr(full):
                    if map_ok and lane == 0:  # this warp's word (segments are word-aligned)
                        sSel[j0 // 32] = Uint32(cutlass.select_(done1, gtm | m, gtm))
                else:
                    if map_ok and lane == 0 and j0 < w1:
                        sSel[j0 // 32] = Uint32(cutlass.select_(done1, gtm | m, gtm))
            if use_cand:
                if m != Uint32(0):
                    pos = cbase + cfill + Int32(cute.arch.popc(m & lt))
                    cfill = cfill + k
                    if cfill > CHUNK:  # past the chunk's end: the rest go to a new chunk
                        nb = Int32(0)
                        if lane == 0:
                            nb = cute.arch.atomic_add(sFound.iterator + 3, Int32(CHUNK))
                        nb = cute.arch.shuffle_sync(nb, 0)
                        over = pos - (cbase + CHUNK)
                        if over >= 0:
                            pos = nb + over
                        cbase = nb
                        cfill = cfill - CHUNK
                    if eq and pos < CAND_BUF:  # (past the buffer: counted, the row goes by heavy ties)
                        sCandKey[pos] = ks[u] if const_expr(in_smem) else idev.ordered_key(ks[u])
                        sCandIdx[pos] = j
        return cgt, ceq, cbase, cfill

    @cute.jit
    def load_row_keys(self, row, row_ptr, n, mis, sKeys, sHist, tidx):
        """The shared-memory row path's pass 1: ``sKeys[j] = ordered_key(row[j])`` for the row's
        ``n`` keys (``sKeys`` at word ``mis`` of a 16-byte-aligned buffer, so that the row's
        16-byte quads are stored by 16-byte stores) and the first digit's histogram.  Each thread
        issues :attr:`row_unroll` 16-byte loads before it uses them."""
        head = cutlass.min((4 - mis) % 4, n)
        n_vec = (n - head) // 4
        for i in cutlass.range((head - tidx + THREADS - 1) // THREADS, unroll=1):
            j = tidx + i * THREADS
            key = idev.ordered_key(row[j])
            sKeys[j] = key
            self.hist_add(sHist, key)
        tail0 = head + 4 * n_vec
        for i in cutlass.range((n - tail0 - tidx + THREADS - 1) // THREADS, unroll=1):
            j = tail0 + tidx + i * THREADS
            key = idev.ordered_key(row[j])
            sKeys[j] = key
            self.hist_add(sHist, key)
        U = self.row_unroll
        rs = [cute.make_rmem_tensor((4,), Float32) for _ in range(U)]
        base = Int32(sKeys.iterator.toint()) + 4 * head  # byte address of key `head`: 16-byte aligned
        per = THREADS * U
        for ib in cutlass.range((n_vec + per - 1) // per, unroll=1):
            for u in cutlass.range_constexpr(U):  # the loads first (clamped: always in the row) ...
                v = cutlass.min(tidx + (ib * U + u) * THREADS, n_vec - 1)
                gsrc = cute.make_tensor((row_ptr + (Int64(head) + Int64(4 * v))).align(16), cute.make_layout(4))
                cute.autovec_copy(gsrc, rs[u])
            for u in cutlass.range_constexpr(U):  # ... then keys, histogram and 16-byte stores
                v = tidx + (ib * U + u) * THREADS
                if v < n_vec:
                    k0 = idev.ordered_key(rs[u][0])
                    k1 = idev.ordered_key(rs[u][1])
                    k2 = idev.ordered_key(rs[u][2])
                    k3 = idev.ordered_key(rs[u][3])
                    self.hist_add(sHist, k0)
                    self.hist_add(sHist, k1)
                    self.hist_add(sHist, k2)
                    self.hist_add(sHist, k3)
                    st_shared_v4_b32(base + 16 * v, k0, k1, k2, k3)

    def key_at(self, in_smem: bool, src, j):
        """The order-preserving key of the row's key ``j`` (from shared memory, or converted)."""
        return Uint32(src[j]) if in_smem else idev.ordered_key(src[j])

    @cute.jit
    def load_keys(self, in_smem: cutlass.Constexpr, src, ks, j0, w1, guard: cutlass.Constexpr = True):
        """``ks[u]`` = the key of ``src[j0 + 32 u]`` (that of 0.0 past ``w1``; ``guard=False``: all
        of them are before ``w1``): the batch's loads issued back to back."""
        if const_expr(in_smem):
            for u in cutlass.range_constexpr(self.batch):
                j = j0 + 32 * u
                if const_expr(guard):
                    k = Uint32(0x80000000)
                    if j < w1:
                        k = Uint32(src[j])
                    ks[u] = k
                else:
                    ks[u] = Uint32(src[j])
        else:
            xs = cute.make_rmem_tensor((self.batch,), Float32)
            self.load_batch(src, xs, j0, w1, guard)
            for u in cutlass.range_constexpr(self.batch):
                ks[u] = idev.ordered_key(xs[u])

    @cute.jit
    def write_from_map(self, row, n, st, t, mIdx, mLogits, sSel, sScratch, tidx):
        """The selection from the shared bitmap: thread ``i`` takes a contiguous range of words,
        its position is the block prefix of the words' popcounts; bits in ascending order."""
        n_words = (n + 31) // 32
        wpt = (n_words + THREADS - 1) // THREADS
        w_lo = cutlass.min(tidx * wpt, n_words)
        w_hi = cutlass.min(w_lo + wpt, n_words)
        local = Int32(0)
        for w in cutlass.range(w_lo, w_hi, unroll=1):
            local = local + Int32(cute.arch.popc(sSel[w]))
        pos, _ = idev.block_exclusive_sum(local, sScratch, tidx, WARPS, BAR, THREADS)
        for w in cutlass.range(w_lo, w_hi, unroll=1):
            x = sSel[w]
            for _ in cutlass.range(Int32(cute.arch.popc(x)), unroll=1):
                low = x & (~x + Uint32(1))
                j = w * 32 + Int32(cute.arch.popc(low - Uint32(1)))
                mIdx[t, pos] = st + j
                if const_expr(self.return_logits):
                    mLogits[t, pos] = row[j]
                pos = pos + 1
                x = x & (x - Uint32(1))

    @cute.jit
    def hist_add(self, sHist, key):
        cute.arch.atomic_add(sHist.iterator + Int32(key >> Uint32(D1[0])), Int32(1))

    @cute.jit
    def count_segments(self, in_smem: cutlass.Constexpr, src, w0, w1, n_steps, prefix, shift, sSegGt, sSegEq,
                       lane, warp):
        """Per warp segment: keys with ``key >> shift`` above / equal to ``prefix``."""
        sh = Uint32(shift)
        cgt = Int32(0)
        ceq = Int32(0)
        ks = cute.make_rmem_tensor((self.batch,), Uint32)
        for ib in cutlass.range((n_steps + self.batch - 1) // self.batch, unroll=1):
            self.load_keys(in_smem, src, ks, w0 + ib * (32 * self.batch) + lane, w1)
            for u in cutlass.range_constexpr(self.batch):
                ok = w0 + (ib * self.batch + u) * 32 + lane < w1
                hi = ks[u] >> sh
                cgt = cgt + Int32(cute.arch.popc(Uint32(cute.arch.vote_ballot_sync(ok & (hi > prefix)))))
                ceq = ceq + Int32(cute.arch.popc(Uint32(cute.arch.vote_ballot_sync(ok & (hi == prefix)))))
        if lane == 0:
            sSegGt[warp] = cgt
            sSegEq[warp] = ceq
        cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)

    @cute.jit
    def write_selection(self, in_smem: cutlass.Constexpr, src, row, st, t, w0, w1, n_steps, prefix, shift, need,
                        mIdx, mLogits, sSegGt, sSegEq, lane, warp):
        """Keys with ``key >> shift`` above ``prefix`` and the first ``need`` equal to it, in order,
        from the per-warp-segment counts (``in_smem``: keys from shared memory, the selected
        logits from the global ``row``)."""
        sh = Uint32(shift)
        gt_before = Int32(0)
        eq_before = Int32(0)
        for w in cutlass.range(warp, unroll=1):  # (a loop: the unrolled sum over 16 warps spilled)
            gt_before = gt_before + sSegGt[w]
            eq_before = eq_before + sSegEq[w]
        lt = cute.arch.lanemask_lt()
        # a batch of keys (shared memory) or of scores (global, their keys formed here)
        vs = cute.make_rmem_tensor((self.batch,), Uint32 if in_smem else Float32)
        for ib in cutlass.range((n_steps + self.batch - 1) // self.batch, unroll=1):
            if const_expr(in_smem):
                self.load_keys(True, src, vs, w0 + ib * (32 * self.batch) + lane, w1)
            else:
                self.load_batch(src, vs, w0 + ib * (32 * self.batch) + lane, w1)
            for u in cutlass.range_constexpr(self.batch):
                j = w0 + (ib * self.batch + u) * 32 + lane
                ok = j < w1
                key = vs[u] if const_expr(in_smem) else idev.ordered_key(vs[u])
                hi = key >> sh
                gt = ok & (hi > prefix)
                eq = ok & (hi == prefix)
                gtm = Uint32(cute.arch.vote_ballot_sync(gt))
                eqm = Uint32(cute.arch.vote_ballot_sync(eq))
                my_gt = gt_before + Int32(cute.arch.popc(gtm & lt))
                my_eq = eq_before + Int32(cute.arch.popc(eqm & lt))
                if gt or (eq and my_eq < need):
                    pos = my_gt + cutlass.min(my_eq, need)
                    mIdx[t, pos] = st + j
                    if const_expr(self.return_logits):
                        mLogits[t, pos] = row[j] if const_expr(in_smem) else vs[u]
                gt_before = gt_before + Int32(cute.arch.popc(gtm))
                eq_before = eq_before + Int32(cute.arch.popc(eqm))

    @cute.jit
    def load_batch(self, row, xs, j0, w1, guard: cutlass.Constexpr = True):
        """``xs[u] = row[j0 + 32 u]`` (0 past ``w1``; ``guard=False``: all before ``w1``): the
        batch's loads issued back to back."""
        for u in cutlass.range_constexpr(self.batch):
            j = j0 + 32 * u
            if const_expr(guard):
                x = Float32(0.0)
                if j < w1:
                    x = row[j]
                xs[u] = x
            else:
                xs[u] = row[j]


def compile_topk(return_logits: bool, arch: str = "sm_90a", batch: int = 4, bitmap: bool = True,
                 pre_hist: bool = False, row_cap: int = 0, min_ctas: int = 0, map_words: int = MAP_WORDS,
                 row_unroll: int = 0, full_batches: bool = False, **kw):
    """Compile the top-k kernel (no GPU needed)."""
    from .. import _compile
    from ..common import host

    rows, ld, s_q, s_q2, s_q3, s_q4, s_q5 = (cute.sym_int() for _ in range(7))
    topk, topk2, h_rows, h_cols = (cute.sym_int() for _ in range(4))
    kernel = IndexerTopkSm90(return_logits, batch, bitmap, pre_hist, row_cap, min_ctas, map_words, row_unroll,
                             full_batches)
    args = (
        host.fake(Float32, (rows, ld), align=4),
        host.fake(Int32, (s_q,), align=4),
        host.fake(Int32, (s_q2,), align=4),
        host.fake(Int32, (s_q3, topk), align=4),
        host.fake(Int32, (s_q4,), align=4),
        host.fake(Float32, (s_q5, topk2), align=4),
        host.fake(Int32, (h_rows, h_cols), align=4),
        Int32(0),
        host.fake_stream(),
    )
    return kernel, _compile.compile_kernel(kernel, *args, arch=arch, **kw)
