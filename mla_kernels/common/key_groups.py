"""Group the valid slots of a block of top-k rows by key (CuTe DSL; arch-agnostic: plain loads,
shared-memory atomics, no MMA).

Two launches of one kernel, ``count`` then ``place``, with a prefix sum between them on the host.
CTA ``(c, tile)`` takes the slots of ``chunk`` consecutive queries (chunk ``c``) whose keys fall
into one tile of :data:`TILE_KEYS` keys:

* ``count``: counts them per key in shared memory and writes the chunk's counts,
  ``cursor[c, s]`` (every key of the tile, zeros included);
* the host prefix-sums the counts over the chunks (inclusive, ``incl[c, s]``) and the keys'
  totals into segment starts ``start[s]`` (the valid slots of keys below ``s``);
* ``place``: loads each key's first row for its chunk, ``start[s] + incl[c - 1, s]`` (the counts
  of key ``s`` in the chunks before ``c``), into shared cursors and gives every valid slot the next
  row of its key's segment, ``pos[t, j] = atomicAdd(cursor[key], 1)`` (shared atomics): the rows
  ``[start[s], start[s+1])`` of a workspace written at ``pos`` hold the slots that selected key
  ``s``.

Valid slot: ``0 <= idx < s_kv``, slot ``< topk_length[t]``, row active (``inv[t] != 0``) -- the
loss backward kernel's rule (it writes exactly the rows of these slots).  Which slot lands where
inside a segment depends on the order of the shared atomics, so ``pos`` is not reproducible; what
is, is the *set* of each segment.  It serves a sum whose result does not depend on the order of
its terms -- the indexer loss backward's deterministic dk
(:class:`~mla_kernels.common.segment_sum.FixedSegmentSum`: fixed-point integers).

No global atomics: a key that most queries select (popular keys are: the selection is far from
uniform) costs one global write per chunk.  The first version took one global atomic per slot
and launch, which serialised on such a key's L2 slice (H200, S 32k: 3.1 ms for the two launches
over 16 waves; 1.9 ms with the shared counters, 0.5 ms once each lane's index loads were batched;
docs/PERF.md).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .device import slot_valid

THREADS = 512
TILE_KEYS = 16384  # keys per CTA's shared counters: 64 KiB
BATCH = 16  # slots per lane whose index loads are issued together


class KeyGroups:
    """Static configuration (``place``: the second launch; ``has_topk_length``; ``chunk``: queries
    per CTA) + launcher + kernel."""

    def __init__(self, place: bool, has_topk_length: bool, chunk: int):
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.place = place
        self.has_topk_length = has_topk_length
        self.chunk = chunk

    @cute.jit
    def __call__(
        self,
        mIdx: cute.Tensor,  # [n_q, topk] int32
        mTopkLen: cute.Tensor,  # [n_q] int32 (read only if has_topk_length)
        mInv: cute.Tensor,  # [n_q] f32: 0 = inactive row (no slot of it counts)
        mCursor: cute.Tensor,  # [ceil(n_q / chunk), s_kv] int32: each chunk's counts (count) / their
        #                        inclusive prefix sums over the chunks (place)
        mPos: cute.Tensor,  # [n_q, topk] int32: each valid slot's row (written only by place)
        mStart: cute.Tensor,  # [s_kv + 1] int32: each key's segment start (read only by place)
        s_kv: Int32,
        stream,
    ):
        @cute.struct
        class SharedStorage:
            cur: cute.struct.Align[cute.struct.MemRange[Int32, TILE_KEYS], 16]

        self.kernel(mIdx, mTopkLen, mInv, mCursor, mPos, mStart, s_kv, SharedStorage).launch(
            grid=[(mIdx.shape[0] + self.chunk - 1) // self.chunk, (s_kv + TILE_KEYS - 1) // TILE_KEYS, 1],
            block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream
        )

    @cute.kernel
    def kernel(self, mIdx: cute.Tensor, mTopkLen: cute.Tensor, mInv: cute.Tensor, mCursor: cute.Tensor,
               mPos: cute.Tensor, mStart: cute.Tensor, s_kv: Int32, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        chunk, tile, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sCur = storage.cur.get_tensor(cute.make_layout(TILE_KEYS))
        topk = mIdx.shape[1]
        k0 = tile * TILE_KEYS
        n_keys = cutlass.min(s_kv - k0, Int32(TILE_KEYS))
        for i in cutlass.range(tidx, TILE_KEYS, THREADS, unroll=1):
            v = Int32(0)
            if const_expr(self.place):
                if i < n_keys:
                    v = mStart[k0 + i]
                    if chunk > 0:
                        v = v + mCursor[chunk - 1, k0 + i]
            sCur[i] = v
        cute.arch.sync_threads()
        # one warp per query row of the chunk, BATCH slots per lane and step: the batch's indices
        # are all loaded before its atomics, so BATCH loads are in flight per lane
        lane = tidx % 32
        t1 = cutlass.min(chunk * self.chunk + self.chunk, mIdx.shape[0])
        rIdx = cute.make_rmem_tensor((BATCH,), Int32)
        for t in cutlass.range(chunk * self.chunk + tidx // 32, t1, THREADS // 32, unroll=1):
            limit = topk
            if const_expr(self.has_topk_length):
                limit = mTopkLen[t]
            if mInv[t] == Float32(0.0):
                limit = Int32(0)  # inactive row: the backward writes none of its slots
            for j0 in cutlass.range(0, topk, 32 * BATCH, unroll=1):
                for u in cutlass.range_constexpr(BATCH):
                    rIdx[u] = mIdx[t, cutlass.min(j0 + 32 * u + lane, topk - 1)]
                for u in cutlass.range_constexpr(BATCH):
                    j = j0 + 32 * u + lane
                    idx = rIdx[u]
                    if j < topk and slot_valid(idx, j, s_kv, limit) and idx >= k0 and idx - k0 < n_keys:
                        p = cute.arch.atomic_add(sCur.iterator + (idx - k0), Int32(1))
                        if const_expr(self.place):
                            mPos[t, j] = p
        if const_expr(not self.place):
            cute.arch.sync_threads()
            for i in cutlass.range(tidx, n_keys, THREADS, unroll=1):
                mCursor[chunk, k0 + i] = sCur[i]


def compile_key_groups(place: bool, has_topk_length: bool, chunk: int, arch: str = "sm_90a", **kw):
    """Compile the count (``place=False``) or place launch for chunks of ``chunk`` queries (no GPU
    needed)."""
    from .. import _compile
    from . import host

    kernel = KeyGroups(place, has_topk_length, chunk)
    args = (
        host.fake(Int32, (cute.sym_int(), cute.sym_int()), align=4),
        host.fake(Int32, (cute.sym_int(),), align=4),
        host.fake(Float32, (cute.sym_int(),), align=4),
        host.fake(Int32, (cute.sym_int(), cute.sym_int()), align=4),
        host.fake(Int32, (cute.sym_int(), cute.sym_int()), align=4),
        host.fake(Int32, (cute.sym_int(),), align=4),
        Int32(0),
        host.fake_stream(),
    )
    return kernel, _compile.compile_kernel(kernel, *args, arch=arch, **kw)
