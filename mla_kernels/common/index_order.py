"""Per-row grouping of top-k indices by kv band (CuTe DSL; arch-agnostic: ballots, popcounts,
plain loads and stores, no MMA).

``out[r]`` = the entries of ``indices[r]`` ordered by *band* -- ``min(idx >> shift, 62)``, 63 bands
over ``[0, s_kv)`` -- and, within a band, by slot (a stable order); the invalid entries (``idx < 0``,
``idx >= s_kv``, slot ``>= topk_length[r]``) come last, as -1.  ``perm[r, j]`` is the slot of
``indices[r]`` that ``out[r, j]`` came from (a permutation of ``0..topk-1``).  Duplicates are kept.
The order depends only on the inputs, so it is the same on every run.

Why (the sparse backward; host side in ``common/order_host.py``): the float32 dKV scatter-add is bound by the
L2 / HBM read-modify-write of a ``[s_kv, d_qk]`` workspace.  With each row's slots in kv order,
the CTAs that run at the same time walk the kv range together, so their atomics (and gathers)
fall into a narrow band of rows that stays in L2.  A band order is all that needs: the kernel
visits 64 slots per block, and 63 bands put each block of a 2048-slot row into 1/32 of the range,
as a full sort would -- at a fraction of a sort's cost (a bitonic sort of the rows measured 0.5 ms
at s_q 4096, topk 2048 on an H200: as much as it saved).

One CTA of 8 warps per row; warp ``w`` owns a contiguous run of slots, 32 at a time (loaded
``RUN`` at a time, so that the loads are in flight together).  Pass 1
counts each warp's entries per band (lanes of one band find each other with six ballots, the
highest of them adds the group's size to the warp's counter in shared memory); warp 0 turns the
counts into each (warp, band)'s first output position (band-major, warp-minor: slot order within
a band); pass 2 recomputes (or reuses) the groups and puts each entry at its position plus its rank among
the lower lanes of its group -- into a shared-memory copy of the row (``stage`` entries, topk <=
:data:`MAX_STAGE`), written out with coalesced stores at the end, or straight to global memory for
longer rows.  Staging matters: scattered 4-byte stores kept the L2's crossbar busy (an H200 profile
of the direct version at s_q 4096, topk 2048, cold caches: 99.5 us, crossbar 79% busy, DRAM 10%).

The kernel is bound by instruction issue (~30 per slot: the ballots, the counter updates), so
staged rows of up to :data:`ONE_RUN` slots (topk <= 2048) take one run per lane, of just the
slots the lane has (``stage / 256``, at most ``RUN``), and pass 2 reuses pass 1's entries and
groups from registers instead of loading and grouping them again (H200, s_q 4096, on a GPU with
the launches queued: topk 2048 65 -> 45 us, see docs/PERF.md).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32, const_expr

THREADS = 256
WARPS = THREADS // 32
BAND_BITS = 6
BANDS = 1 << BAND_BITS  # bands 0..62 for valid entries, 63 for invalid ones
INVALID_BAND = BANDS - 1
RUN = 8  # slots per lane loaded before they are grouped (independent loads in flight)
MAX_STAGE = 8192  # longest row staged in shared memory (32 KB, 64 KB with perm)
ONE_RUN = WARPS * 32 * RUN  # staged rows up to this many slots: one run per lane (pass 2 reuses pass 1's registers)


def stage_for(topk: int) -> int:
    """Shared-memory staging capacity (entries) for rows of ``topk`` slots: the next power of two
    (one compile per size class), or 0 (direct stores) past :data:`MAX_STAGE`."""
    if topk > MAX_STAGE:
        return 0
    return 1 << max(0, (max(topk, 1) - 1).bit_length())


def band_shift(s_kv: int) -> int:
    """The shift that maps ``[0, s_kv)`` onto at most 64 bands (band 63 then merges into 62)."""
    return max(0, (max(s_kv, 1) - 1).bit_length() - BAND_BITS)


class KvBandOrder:
    """Static configuration (whether ``topk_length`` / ``perm`` are used) + launcher + kernel."""

    def __init__(self, has_topk_length: bool = False, want_perm: bool = False, stage: int = 0):
        if stage < 0 or stage > MAX_STAGE or stage & (stage - 1):
            raise ValueError(f"stage must be 0 or a power of two <= {MAX_STAGE}, got {stage}")
        self.has_topk_length = has_topk_length
        self.want_perm = want_perm
        self.stage = stage  # rows of topk <= stage are staged in shared memory (0: direct stores)
        # slots per lane and run: RUN, or -- staged rows of fewer than WARPS * 32 * RUN slots --
        # just enough for one run (no lane iterates over slots past its warp's share: the kernel is
        # bound by instruction issue, ~30 per slot)
        self.run = RUN if not stage else max(1, min(RUN, stage // (WARPS * 32)))
        self.smem_bytes = 0

    @cute.jit
    def __call__(
        self,
        mIdx: cute.Tensor,  # [s_q, topk] int32
        mTopkLen: cute.Tensor,  # [s_q] int32 (read only if has_topk_length)
        mOut: cute.Tensor,  # [s_q, topk] int32
        mPerm: cute.Tensor,  # [s_q, topk] int32 (written only if want_perm)
        s_kv: Int32,
        shift: Int32,  # band_shift(s_kv)
        stream,
    ):
        @cute.struct
        class SharedStorage:
            cnt: cute.struct.Align[cute.struct.MemRange[Int32, WARPS * BANDS], 16]
            out: cute.struct.Align[cute.struct.MemRange[Int32, max(1, self.stage)], 16]
            perm: cute.struct.Align[cute.struct.MemRange[Int32, max(1, self.stage) if self.want_perm else 1], 16]

        self.smem_bytes = SharedStorage.size_in_bytes()
        self.kernel(mIdx, mTopkLen, mOut, mPerm, s_kv, shift, SharedStorage).launch(
            grid=[mIdx.shape[0], 1, 1], block=[THREADS, 1, 1], smem=self.smem_bytes, stream=stream
        )

    @cute.jit
    def _load(self, mIdx, row, slot, limit, topk, s_kv, shift):
        """``(present, band, entry)`` of one slot (the load is unconditional -- a clamped slot --
        so that a run of them issues back to back)."""
        v = mIdx[row, cutlass.min(slot, topk - 1)]
        present = slot < topk
        ok = present and slot < limit and v >= 0 and v < s_kv
        band = cutlass.select_(ok, cutlass.min(v >> shift, Int32(INVALID_BAND - 1)), Int32(INVALID_BAND))
        entry = cutlass.select_(ok, v, Int32(-1))
        return present, band, entry

    @cute.jit
    def _load_run(self, mIdx, row, first, per_warp, r, lane, limit, topk, s_kv, shift):
        """Run ``r`` of this lane's slots (``self.run`` of them, 32 apart), loaded back to back:
        ``(present, band, entry)`` per slot, ``present`` 0 past topk or the warp's run."""
        pres = cute.make_rmem_tensor((self.run,), Int32)
        bands = cute.make_rmem_tensor((self.run,), Int32)
        entries = cute.make_rmem_tensor((self.run,), Int32)
        for u in cutlass.range_constexpr(self.run):
            slot = first + (r * self.run + u) * 32 + lane
            present, band, entry = self._load(mIdx, row, slot, limit, topk, s_kv, shift)
            bands[u] = band
            entries[u] = entry
            pres[u] = Int32(present and slot < first + per_warp)
        return pres, bands, entries

    @cute.jit
    def _peers(self, present, band):
        """The lanes holding an entry of the same band as this lane (``present`` lanes only)."""
        peers = Uint32(cute.arch.vote_ballot_sync(present))
        for bit in cutlass.range_constexpr(BAND_BITS):
            on = ((band >> bit) & 1) != 0
            bal = Uint32(cute.arch.vote_ballot_sync(on))
            peers = peers & cutlass.select_(on, bal, ~bal)
        return peers

    @cute.kernel
    def kernel(self, mIdx: cute.Tensor, mTopkLen: cute.Tensor, mOut: cute.Tensor, mPerm: cute.Tensor,
               s_kv: Int32, shift: Int32, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        cnt = storage.cnt.get_tensor(cute.make_layout((BANDS, WARPS)))  # cnt[band, warp]
        sOut = storage.out.get_tensor(cute.make_layout(max(1, self.stage)))
        sPerm = storage.perm.get_tensor(cute.make_layout(max(1, self.stage) if self.want_perm else 1))
        topk = mIdx.shape[1]
        limit = topk
        if const_expr(self.has_topk_length):
            limit = mTopkLen[row]
        per_warp = (topk + 32 * WARPS - 1) // (32 * WARPS) * 32
        first = warp * per_warp
        lower = (Uint32(1) << Uint32(lane)) - Uint32(1)  # lanes below this one
        for k in cutlass.range_constexpr(BANDS * WARPS // THREADS):
            cnt[tidx + k * THREADS] = Int32(0)
        cute.arch.sync_threads()

        # pass 1: entries per (band, warp); the slots are loaded RUN at a time, then grouped.  Rows
        # of one run per lane (a staged kernel of stage <= ONE_RUN) keep the run and each slot's
        # group in registers for pass 2 instead of loading and grouping them again.
        one_run = const_expr(0 < self.stage <= ONE_RUN)
        n_runs = (per_warp + 32 * self.run - 1) // (32 * self.run)
        pres1 = cute.make_rmem_tensor((self.run,), Int32)
        bands1 = cute.make_rmem_tensor((self.run,), Int32)
        entries1 = cute.make_rmem_tensor((self.run,), Int32)
        peers1 = cute.make_rmem_tensor((self.run,), Uint32)
        for r in cutlass.range(n_runs, unroll=1):
            pres, bands, entries = self._load_run(mIdx, row, first, per_warp, r, lane, limit, topk, s_kv, shift)
            for u in cutlass.range_constexpr(self.run):
                present = pres[u] != 0
                peers = self._peers(present, bands[u])
                if const_expr(one_run):
                    pres1[u] = pres[u]
                    bands1[u] = bands[u]
                    entries1[u] = entries[u]
                    peers1[u] = peers
                if present and (peers >> Uint32(lane)) == Uint32(1):  # the group's highest lane
                    cnt[bands[u], warp] = cnt[bands[u], warp] + Int32(cute.arch.popc(peers))
                cute.arch.sync_warp()
        cute.arch.sync_threads()

        # warp 0: first output position of each (band, warp); lane l owns bands 2l and 2l + 1
        if warp == 0:
            tot0 = Int32(0)
            tot1 = Int32(0)
            for w in cutlass.range_constexpr(WARPS):
                tot0 = tot0 + cnt[2 * lane, w]
                tot1 = tot1 + cnt[2 * lane + 1, w]
            incl = tot0 + tot1
            for d in cutlass.range_constexpr(5):
                up = cute.arch.shuffle_sync_up(incl, 1 << d)
                if lane >= (1 << d):
                    incl = incl + up
            run = incl - tot0 - tot1
            for b in cutlass.range_constexpr(2):
                for w in cutlass.range_constexpr(WARPS):
                    c = cnt[2 * lane + b, w]
                    cnt[2 * lane + b, w] = run
                    run = run + c
        cute.arch.sync_threads()

        # pass 2: each entry at its (band, warp)'s next position plus its rank in its group
        for r in cutlass.range(n_runs, unroll=1):
            pres, bands, entries = pres1, bands1, entries1
            if const_expr(not one_run):
                pres, bands, entries = self._load_run(mIdx, row, first, per_warp, r, lane, limit, topk, s_kv, shift)
            for u in cutlass.range_constexpr(self.run):
                slot = first + (r * self.run + u) * 32 + lane
                present = pres[u] != 0
                band = bands[u]
                peers = peers1[u] if const_expr(one_run) else self._peers(present, band)
                if present:
                    pos = cnt[band, warp] + Int32(cute.arch.popc(peers & lower))
                    if const_expr(self.stage > 0):
                        sOut[pos] = entries[u]
                        if const_expr(self.want_perm):
                            sPerm[pos] = slot
                    else:
                        mOut[row, pos] = entries[u]
                        if const_expr(self.want_perm):
                            mPerm[row, pos] = slot
                cute.arch.sync_warp()
                if present and (peers >> Uint32(lane)) == Uint32(1):
                    cnt[band, warp] = cnt[band, warp] + Int32(cute.arch.popc(peers))
                cute.arch.sync_warp()
        if const_expr(self.stage > 0):
            # every position 0..topk-1 was written once (valid entries, then -1s): copy the row out
            cute.arch.sync_threads()
            for j in cutlass.range((topk + THREADS - 1) // THREADS, unroll=1):
                c = j * THREADS + tidx
                if c < topk:
                    mOut[row, c] = sOut[c]
                    if const_expr(self.want_perm):
                        mPerm[row, c] = sPerm[c]


def compile_index_order(has_topk_length: bool = False, want_perm: bool = False, arch: str = "sm_90a",
                        stage: int = 0, **kw):
    """Compile the band order (no GPU needed); ``stage``: see :func:`stage_for` (the host passes
    ``stage_for(topk)``; a staged kernel must only see rows of at most ``stage`` slots)."""
    from .. import _compile
    from . import host

    kernel = KvBandOrder(has_topk_length, want_perm, stage)
    s_q, topk = cute.sym_int(), cute.sym_int()
    args = (
        host.fake(Int32, (s_q, topk), align=4),
        host.fake(Int32, (cute.sym_int(),), align=4),
        host.fake(Int32, (s_q, topk), align=4),
        host.fake(Int32, (cute.sym_int(), cute.sym_int()), align=4),
        Int32(0),
        Int32(0),
        host.fake_stream(),
    )
    return kernel, _compile.compile_kernel(kernel, *args, arch=arch, **kw)
