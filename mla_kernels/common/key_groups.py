"""Group the valid slots of a block of top-k rows by key (CuTe DSL; arch-agnostic: plain loads,
global atomics, no MMA).

Two launches of one kernel, ``count`` then ``place``, with a prefix sum between them on the host:

* ``count``: ``cursor[idx] += 1`` for every valid slot (``0 <= idx < s_kv``, slot ``<
  topk_length[t]``, row active: ``inv[t] != 0``) -- the segment sizes;
* the host turns them into segment starts (``start[s]`` = the valid slots of keys below ``s``)
  and copies them into ``cursor``;
* ``place``: every valid slot takes the next free position of its key's segment,
  ``pos[t, j] = atomicAdd(cursor[idx], 1)`` (coalesced stores in slot order): the rows
  ``[start[s], start[s+1])`` of a workspace written at ``pos`` hold the slots that selected key
  ``s``.

Which slot lands where inside a segment depends on the order the atomics arrive in, so ``pos``
is not reproducible; what is, is the *set* of each segment.  It serves a sum whose result does not
depend on the order of its terms -- the indexer loss backward's deterministic dk
(:class:`~mla_kernels.common.segment_sum.FixedSegmentSum`: fixed-point integers).  The validity
rule is the loss backward kernel's (it writes exactly the rows of these slots).

One thread per 4 consecutive slots (``topk % 4 == 0``), 256 threads per CTA.

``chunked`` (the default of the ``grouped`` mode): the same two launches without global atomics.
CTA ``(c, tile)`` takes the slots of :data:`CHUNK` consecutive queries whose keys fall into one
tile of :data:`TILE_KEYS` keys and counts them in shared memory (``count``: ``cursor[c, s]``, the
chunk's count of key ``s``); the host turns the counts into each chunk's first row per key
(``start[s]`` plus the counts of the chunks before it); ``place`` loads those into shared
cursors and takes rows with shared-memory atomics.  A key selected by most queries (popular keys
are: the selection is far from uniform) then costs one global write per chunk, not one atomic per
slot, which the first version serialised on that key's L2 slice (H200, S 32k: 3.1 ms for the two
launches over 16 waves).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .device import slot_valid

THREADS = 256
CHUNK = 32  # queries per CTA (chunked)
TILE_KEYS = 16384  # keys per CTA's shared counters (chunked): 64 KiB
CHUNK_THREADS = 512
PER_THREAD = 4  # consecutive slots per thread (topk is a multiple of 4: the loss pads it to 64)


class KeyGroups:
    """Static configuration (``place``: the second launch; ``has_topk_length``) + launcher + kernel."""

    def __init__(self, place: bool, has_topk_length: bool, chunked: bool = False):
        self.place = place
        self.has_topk_length = has_topk_length
        self.chunked = chunked

    @cute.jit
    def __call__(
        self,
        mIdx: cute.Tensor,  # [n_q, topk] int32, topk % 4 == 0
        mTopkLen: cute.Tensor,  # [n_q] int32 (read only if has_topk_length)
        mInv: cute.Tensor,  # [n_q] f32: 0 = inactive row (no slot of it counts)
        mCursor: cute.Tensor,  # [s_kv] int32: counts (count, zeroed by the caller) / next positions (place);
        # chunked: [n_chunks, s_kv] -- each chunk's counts (count, written whole) / first rows (place)
        mPos: cute.Tensor,  # [n_q, topk] int32: each valid slot's position (written only by place)
        s_kv: Int32,
        stream,
    ):
        if const_expr(self.chunked):
            @cute.struct
            class SharedStorage:
                cur: cute.struct.Align[cute.struct.MemRange[Int32, TILE_KEYS], 16]

            self.kernel_chunked(mIdx, mTopkLen, mInv, mCursor, mPos, s_kv, SharedStorage).launch(
                grid=[(mIdx.shape[0] + CHUNK - 1) // CHUNK, (s_kv + TILE_KEYS - 1) // TILE_KEYS, 1],
                block=[CHUNK_THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream
            )
        else:
            n = mIdx.shape[0] * mIdx.shape[1]
            per_cta = THREADS * PER_THREAD
            self.kernel(mIdx, mTopkLen, mInv, mCursor, mPos, s_kv).launch(
                grid=[(n + per_cta - 1) // per_cta, 1, 1], block=[THREADS, 1, 1], stream=stream
            )

    @cute.kernel
    def kernel_chunked(self, mIdx: cute.Tensor, mTopkLen: cute.Tensor, mInv: cute.Tensor, mCursor: cute.Tensor,
                       mPos: cute.Tensor, s_kv: Int32, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        chunk, tile, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sCur = storage.cur.get_tensor(cute.make_layout(TILE_KEYS))
        topk = mIdx.shape[1]
        k0 = tile * TILE_KEYS
        n_keys = cutlass.min(s_kv - k0, Int32(TILE_KEYS))
        for i in cutlass.range(tidx, TILE_KEYS, CHUNK_THREADS, unroll=1):
            v = Int32(0)
            if const_expr(self.place):
                if i < n_keys:
                    v = mCursor[chunk, k0 + i]
            sCur[i] = v
        cute.arch.sync_threads()
        t0 = chunk * CHUNK
        t1 = cutlass.min(t0 + CHUNK, mIdx.shape[0])
        for t in cutlass.range(t0, t1, unroll=1):
            limit = topk
            if const_expr(self.has_topk_length):
                limit = mTopkLen[t]
            if mInv[t] == Float32(0.0):
                limit = Int32(0)  # inactive row: the backward writes none of its slots
            for j in cutlass.range(tidx, topk, CHUNK_THREADS, unroll=4):
                idx = mIdx[t, j]
                key = idx - k0
                if slot_valid(idx, j, s_kv, limit) and key >= 0 and key < n_keys:
                    p = cute.arch.atomic_add(sCur.iterator + key, Int32(1))
                    if const_expr(self.place):
                        mPos[t, j] = p
        if const_expr(not self.place):
            cute.arch.sync_threads()
            for i in cutlass.range(tidx, n_keys, CHUNK_THREADS, unroll=1):
                mCursor[chunk, k0 + i] = sCur[i]

    @cute.kernel
    def kernel(self, mIdx: cute.Tensor, mTopkLen: cute.Tensor, mInv: cute.Tensor, mCursor: cute.Tensor,
               mPos: cute.Tensor, s_kv: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        topk = mIdx.shape[1]
        first = (bidx * THREADS + tidx) * PER_THREAD
        if first < mIdx.shape[0] * topk:
            t = first // topk
            j0 = first - t * topk
            limit = topk
            if const_expr(self.has_topk_length):
                limit = mTopkLen[t]
            if mInv[t] == Float32(0.0):
                limit = Int32(0)  # inactive row: the backward writes none of its slots
            idx = cute.make_rmem_tensor((PER_THREAD,), Int32)
            pos = cute.make_rmem_tensor((PER_THREAD,), Int32)
            for e in cutlass.range_constexpr(PER_THREAD):
                idx[e] = mIdx[t, j0 + e]
            # all of the thread's atomics first, then the stores: the atomics' round trips overlap
            for e in cutlass.range_constexpr(PER_THREAD):
                if slot_valid(idx[e], j0 + e, s_kv, limit):
                    pos[e] = cute.arch.atomic_add(mCursor.iterator + idx[e], Int32(1))
            if const_expr(self.place):
                for e in cutlass.range_constexpr(PER_THREAD):
                    if slot_valid(idx[e], j0 + e, s_kv, limit):
                        mPos[t, j0 + e] = pos[e]


def compile_key_groups(place: bool, has_topk_length: bool = False, arch: str = "sm_90a", chunked: bool = False,
                       **kw):
    """Compile the count (``place=False``) or place launch (no GPU needed)."""
    from .. import _compile
    from . import host

    kernel = KeyGroups(place, has_topk_length, chunked)
    n_q = cute.sym_int()
    args = (
        host.fake(Int32, (n_q, cute.sym_int()), align=16),
        host.fake(Int32, (cute.sym_int(),), align=4),
        host.fake(Float32, (cute.sym_int(),), align=4),
        host.fake(Int32, (cute.sym_int(), cute.sym_int()) if chunked else (cute.sym_int(),), align=4),
        host.fake(Int32, (cute.sym_int(), cute.sym_int()), align=4),
        Int32(0),
        host.fake_stream(),
    )
    return kernel, _compile.compile_kernel(kernel, *args, arch=arch, **kw)
