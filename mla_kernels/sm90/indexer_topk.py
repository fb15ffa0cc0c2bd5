"""Exact per-row top-k over a block of indexer score rows (CuTe DSL; plain loads/stores and shared
atomics -- no tensor cores, so arch-agnostic; compiled for sm_90a here).

One CTA (512 threads) per row ``r`` of ``scores [rows, ld]`` (query ``t = q0 + r``); the row's
keys are ``[k_start[t], k_end[t])``.  A row with ``n <= topk`` keys takes them all.  Otherwise a
radix select on the order-preserving uint32 key of each score (NaN as -inf, -0 as +0) finds the
threshold ``T`` -- the ``topk``-th largest key -- in at most three histogram passes over the row
(digits of 11, 11 and 10 bits, 2048 shared-memory bins; a pass whose threshold bin is taken
whole ends the search early), then two warp-segmented passes write the selection in ascending key
order: every key above ``T`` and the first ``need`` keys equal to ``T`` (ties go to the smaller
index), at position ``#(greater before it) + min(#(equal before it), need)`` -- ballots and
popcounts, no sort.  The result is exact and deterministic.

Reads each row 4-5 times (the first from HBM, the rest mostly from L2: a block of rows is a few
hundred MB at most, each CTA's row a few hundred KB).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, const_expr

from ..common import indexer_device as idev

THREADS = 512
WARPS = THREADS // 32
BINS = 2048
#: (shift, bits) of the three radix digits, most significant first.
DIGITS = ((21, 11), (10, 11), (0, 10))
BAR = 1


class IndexerTopkSm90:
    """Static configuration (whether the selected scores are returned) + launcher + kernel."""

    def __init__(self, return_logits: bool):
        self.return_logits = return_logits

    @cute.jit
    def __call__(
        self,
        mScores: cute.Tensor,  # [rows, ld] f32: row r is query q0 + r
        mStart: cute.Tensor,  # [s_q] int32
        mEnd: cute.Tensor,  # [s_q] int32
        mIdx: cute.Tensor,  # [s_q, topk] int32 (out)
        mLen: cute.Tensor,  # [s_q] int32 (out)
        mLogits: cute.Tensor,  # [s_q, topk] f32 (out; only with return_logits)
        q0: Int32,
        stream,
    ):
        @cute.struct
        class SharedStorage:
            hist: cute.struct.Align[cute.struct.MemRange[Int32, BINS], 16]
            scratch: cute.struct.MemRange[Int32, 2 * WARPS]
            found: cute.struct.MemRange[Int32, 4]

        self.kernel(mScores, mStart, mEnd, mIdx, mLen, mLogits, q0, SharedStorage).launch(
            grid=[mScores.shape[0], 1, 1], block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream
        )

    @cute.kernel
    def kernel(self, mScores: cute.Tensor, mStart: cute.Tensor, mEnd: cute.Tensor, mIdx: cute.Tensor,
               mLen: cute.Tensor, mLogits: cute.Tensor, q0: Int32, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sHist = storage.hist.get_tensor(cute.make_layout(BINS))
        sScratch = storage.scratch.get_tensor(cute.make_layout(2 * WARPS))
        sFound = storage.found.get_tensor(cute.make_layout(4))
        t = q0 + bidx
        s_q = mStart.shape[0]
        topk = mIdx.shape[1]
        if t < s_q:
            st = mStart[t]
            n = cutlass.max(mEnd[t] - st, Int32(0))
            row = cute.make_tensor(mScores.iterator + (Int64(bidx) * Int64(mScores.shape[1]) + Int64(st)),
                                   cute.make_layout(cutlass.max(n, Int32(1))))
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
                self.select(row, n, st, t, topk, mIdx, mLogits, sHist, sScratch, sFound, tidx)
                if tidx == 0:
                    mLen[t] = topk

    @cute.jit
    def select(self, row, n, st, t, topk, mIdx, mLogits, sHist, sScratch, sFound, tidx):
        """``n > topk``: radix select of the threshold, then the ordered write."""
        prefix = Uint32(0)  # key bits above the current digit of the threshold
        need = topk  # how many of the keys sharing `prefix` are still to be taken
        shift = Int32(32)  # keys are compared on key >> shift
        done = Int32(0)
        for p in cutlass.range_constexpr(len(DIGITS)):
            d_shift, d_bits = DIGITS[p]
            if done == 0:
                nb = 1 << d_bits
                for i in cutlass.range_constexpr(BINS // THREADS):
                    sHist[tidx + i * THREADS] = Int32(0)
                cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
                for i in cutlass.range((n - tidx + THREADS - 1) // THREADS, unroll=4):
                    key = idev.ordered_key(row[tidx + i * THREADS])
                    hit = True
                    if const_expr(p > 0):
                        hit = (key >> Uint32(shift)) == prefix
                    if hit:
                        b = Int32((key >> Uint32(d_shift)) & Uint32(nb - 1))
                        cute.arch.atomic_add(sHist.iterator + b, Int32(1))
                cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
                # Bins in descending order: thread i owns bins nb-1-per*i-e (e = 0..per-1).
                per = nb // THREADS
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
                b = sFound[0]
                need = sFound[1]
                cnt = sFound[2]
                prefix = (prefix << Uint32(d_bits)) | Uint32(b)
                shift = Int32(d_shift)
                if cnt == need:
                    done = Int32(1)  # the whole threshold bin is taken: no finer digit needed
                cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
        self.write_selection(row, n, st, t, prefix, shift, need, mIdx, mLogits, sScratch, tidx)

    @cute.jit
    def write_selection(self, row, n, st, t, prefix, shift, need, mIdx, mLogits, sScratch, tidx):
        """Keys with ``key >> shift > prefix`` and the first ``need`` with ``== prefix``, in order."""
        lane = tidx % 32
        warp = tidx // 32
        seg = ((n + WARPS * 32 - 1) // (WARPS * 32)) * 32
        w0 = warp * seg
        w1 = cutlass.min(w0 + seg, n)
        n_steps = cutlass.max(w1 - w0 + 31, Int32(0)) // 32
        sh = Uint32(shift)
        cgt = Int32(0)
        ceq = Int32(0)
        for i in cutlass.range(n_steps, unroll=2):
            j = w0 + i * 32 + lane
            ok = j < w1
            hi = Uint32(0)
            if ok:
                hi = idev.ordered_key(row[j]) >> sh
            gt = ok & (hi > prefix)
            eq = ok & (hi == prefix)
            cgt = cgt + Int32(cute.arch.popc(Uint32(cute.arch.vote_ballot_sync(gt))))
            ceq = ceq + Int32(cute.arch.popc(Uint32(cute.arch.vote_ballot_sync(eq))))
        if lane == 0:
            sScratch[warp] = Int32(cgt)
            sScratch[WARPS + warp] = Int32(ceq)
        cute.arch.barrier(barrier_id=BAR, number_of_threads=THREADS)
        gt_before = Int32(0)
        eq_before = Int32(0)
        for w in cutlass.range_constexpr(WARPS):
            mine = Int32(w) < warp
            gt_before = gt_before + Int32(cutlass.select_(mine, sScratch[w], Int32(0)))
            eq_before = eq_before + Int32(cutlass.select_(mine, sScratch[WARPS + w], Int32(0)))
        lt = cute.arch.lanemask_lt()
        for i in cutlass.range(n_steps, unroll=2):
            j = w0 + i * 32 + lane
            ok = j < w1
            x = Float32(0.0)
            hi = Uint32(0)
            if ok:
                x = row[j]
                hi = idev.ordered_key(x) >> sh
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
                    mLogits[t, pos] = x
            gt_before = gt_before + Int32(cute.arch.popc(gtm))
            eq_before = eq_before + Int32(cute.arch.popc(eqm))


def compile_topk(return_logits: bool, arch: str = "sm_90a", **kw):
    """Compile the top-k kernel (no GPU needed)."""
    from .. import _compile
    from ..common import host

    rows, ld, s_q, s_q2, s_q3, s_q4, s_q5 = (cute.sym_int() for _ in range(7))
    topk, topk2 = cute.sym_int(), cute.sym_int()
    kernel = IndexerTopkSm90(return_logits)
    args = (
        host.fake(Float32, (rows, ld), align=4),
        host.fake(Int32, (s_q,), align=4),
        host.fake(Int32, (s_q2,), align=4),
        host.fake(Int32, (s_q3, topk), align=4),
        host.fake(Int32, (s_q4,), align=4),
        host.fake(Float32, (s_q5, topk2), align=4),
        Int32(0),
        host.fake_stream(),
    )
    return kernel, _compile.compile_kernel(kernel, *args, arch=arch, **kw)
