"""Top-k KV row gather by a 128-thread producer warpgroup (cp.async; sm90 and sm100).

:class:`KvGather` owns the per-thread constants (smem/gmem base addresses, the L2 policy) and the
per-thread index registers of the blocks in flight.  Layout contract with the kernels: a KV block
is ``rows`` (64 by default, 128 for sm100's attn_dist) rows x ``d_qk`` bf16 in smem as
``d_qk/64`` tiles of ``[rows x 64 cols]``, each tile K-major with the 128-byte swizzle (chunk
``c`` of row ``r`` at chunk ``c ^ (r % 8)``), tiles ``rows*128`` bytes apart -- the layout
``tile_to_shape(K_SW128 atom, (rows, d_qk))`` that wgmma and tcgen05 read.

Thread ``t`` belongs to group ``t // 8`` (16 groups) and fills 16-byte chunk ``t % 8`` of rows
``group + 16 j`` (j = 0 .. rows/16 - 1) of every tile: each row of a tile is written by 8
consecutive threads, so a warp's 32 copies cover 4 full 128-byte rows.  Invalid slots are
zero-filled without reading global memory.

:func:`copy_dense_rows` fills the same tile layout from a dense row-major matrix (sm100 loads Q
this way).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32, Int64, Uint32

from . import device as dev

ROWS = 64  # rows per block (default)
ROWS_PER_THREAD = 4
GROUPS = 16  # 8-thread groups of the 128-thread warpgroup; group g owns rows g + 16 j


class KvGather:
    """Per-thread state of the gather; ``slots`` = how many blocks' indices are held at once,
    ``rows`` = rows per block (a multiple of 16)."""

    def __init__(
        self, mKV: cute.Tensor, mIdx: cute.Tensor, s_idx, topk_len, ptid, d_qk: int, slots: int, rows: int = ROWS
    ):
        assert rows % GROUPS == 0, f"rows={rows} must be a multiple of {GROUPS}"
        self.rows = rows
        self.rows_per_thread = rows // GROUPS
        self.mKV = mKV
        self.mIdx = mIdx
        self.s_idx = s_idx
        self.topk = mIdx.shape[1]
        self.topk_len = topk_len
        self.s_kv = mKV.shape[0]
        self.d_qk = d_qk
        self.n_tiles = d_qk // 64
        self.ptid = ptid
        self.vote_row = ptid % ROWS  # the row of each 64-row block this thread votes for
        self.group = ptid // 8
        lane8 = ptid % 8
        self.smem_off = self.group * 128 + ((lane8 ^ (self.group % 8)) * 16)
        self.kv_addr = dev.gmem_addr_i64(mKV.iterator) + Int64(lane8 * 16)
        self.row_bytes = d_qk * 2
        self.policy = dev.createpolicy_evict_last()
        self.src = cute.make_rmem_tensor((slots, self.rows_per_thread), Int64)
        self.ok = cute.make_rmem_tensor((slots, self.rows_per_thread), Boolean)

    # Loop-invariant object: dynamic loops capture it rather than carry it.
    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    def fetch_slot(self, slot) -> Int32:
        """The raw index of top-k ``slot`` of this token (a slot past ``topk`` reads the last one:
        :func:`~mla_kernels.common.device.slot_valid` invalidates it by ``topk_len``)."""
        return self.mIdx[self.s_idx, cutlass.min(slot, self.topk - 1)]

    def index_at(self, slot):
        """``(idx, valid)`` of top-k ``slot`` of this token."""
        idx = self.fetch_slot(slot)
        return idx, dev.slot_valid(idx, slot, self.s_kv, self.topk_len)

    def load_indices(self, block, slot_b: int) -> None:
        """Read this thread's ``rows/16`` indices of ``block`` into register slot ``slot_b``."""
        for j in range(self.rows_per_thread):
            slot = block * self.rows + self.group + GROUPS * j
            idx, v = self.index_at(slot)
            self.ok[slot_b, j] = v
            safe = Int64(cutlass.select_(v, idx, Int32(0)))
            self.src[slot_b, j] = self.kv_addr + safe * self.row_bytes

    def fetch_raw(self, raw: cute.Tensor, block, slot_b: int) -> None:
        """Issue the global loads of this thread's ``rows/16`` raw indices of ``block`` into
        ``raw[slot_b * rows/16 + j]`` (an Int32 register tensor) without using them: a prefetch
        whose latency hides behind whatever the thread waits on next.  Slots past ``topk`` read a
        clamped slot (:meth:`indices_from_raw` invalidates them)."""
        for j in range(self.rows_per_thread):
            raw[slot_b * self.rows_per_thread + j] = self.fetch_slot(block * self.rows + self.group + GROUPS * j)

    def indices_from_raw(self, raw: cute.Tensor, block, slot_b: int) -> None:
        """:meth:`load_indices` from indices already fetched by :meth:`fetch_raw`."""
        for j in range(self.rows_per_thread):
            slot = block * self.rows + self.group + GROUPS * j
            idx = raw[slot_b * self.rows_per_thread + j]
            v = dev.slot_valid(idx, slot, self.s_kv, self.topk_len)
            self.ok[slot_b, j] = v
            safe = Int64(cutlass.select_(v, idx, Int32(0)))
            self.src[slot_b, j] = self.kv_addr + safe * self.row_bytes

    def copy_tiles(self, buf_addr: Int32, slot_b: int, t0: int, t1: int) -> None:
        """cp.async tiles ``[t0, t1)`` of the block in register slot ``slot_b`` into the smem
        buffer at ``buf_addr`` (its 32-bit shared address)."""
        base = buf_addr + self.smem_off
        for t in range(t0, t1):
            for j in range(self.rows_per_thread):
                dev.cp_async_16_zfill(
                    base + (t * self.rows * 128 + j * GROUPS * 128),
                    self.src[slot_b, j] + Int64(t * 128),
                    self.ok[slot_b, j],
                    self.policy,
                )

    def copy_tile(self, tile_addr: Int32, slot_b: int, t: int) -> None:
        """cp.async column tile ``t`` (columns ``64 t .. 64 t + 63``) of the block in register
        slot ``slot_b`` into one ``[rows x 64]`` SW128 tile at ``tile_addr`` (32-bit shared
        address, 1024-byte aligned)."""
        base = tile_addr + self.smem_off
        for j in range(self.rows_per_thread):
            dev.cp_async_16_zfill(
                base + j * GROUPS * 128, self.src[slot_b, j] + Int64(t * 128), self.ok[slot_b, j], self.policy
            )

    def vote_slot(self, block):
        """The slot this thread votes for in ``block`` (64-row blocks): row ``ptid % 64``."""
        assert self.rows == ROWS, "the validity vote assumes 64-row blocks"
        return block * ROWS + self.vote_row

    def vote_from_raw(self, raw_idx: Int32, slot) -> Uint32:
        """:meth:`valid_word` from the vote slot's index fetched earlier (:meth:`fetch_slot` of
        :meth:`vote_slot`: a prefetch whose latency leaves the block's path).  Plain ids only: a
        gather that translates ids (decode's block table) votes by :meth:`valid_word`."""
        return Uint32(cute.arch.vote_ballot_sync(dev.slot_valid(raw_idx, slot, self.s_kv, self.topk_len)))

    def valid_word(self, block) -> Uint32:
        """Ballot of slot validity (64-row blocks only): thread t votes for row ``t % 64`` of
        ``block``; lane l of warp w holds bit l = row ``32 * (w % 2) + l``.  Every lane gets the
        warp's word."""
        # the slot of :meth:`vote_slot`, formed here (not from ``vote_row``) so that the decode
        # kernels, which vote only this way, keep their instruction order
        assert self.rows == ROWS, "valid_word assumes 64-row blocks"
        _, v = self.index_at(block * ROWS + self.ptid % ROWS)
        return Uint32(cute.arch.vote_ballot_sync(v))


def copy_dense_rows(
    tile_addr: Int32, gmem_addr: Int64, row_bytes, n_rows: int, n_tiles: int, ptid, policy: Int64,
    n_threads: int = 128,
) -> None:
    """cp.async an ``[n_rows x 64 n_tiles]`` bf16 row-major matrix (row ``r`` at ``gmem_addr +
    r * row_bytes``) into ``n_tiles`` K-major SW128 tiles of ``[n_rows x 64]``, ``n_rows * 128``
    bytes apart from ``tile_addr`` (32-bit shared address, 1024-byte aligned) -- the layout of a
    :class:`KvGather` block.  Called by all ``n_threads`` threads (a warpgroup by default, or one
    warp; ``ptid`` = 0 .. n_threads - 1): thread ``t`` copies 16-byte chunk ``t % 8`` of rows
    ``t / 8 + (n_threads / 8) j``; ``n_rows`` a multiple of ``n_threads / 8``."""
    groups = n_threads // 8
    assert n_rows % groups == 0, f"n_rows={n_rows} must be a multiple of {groups}"
    group = ptid // 8
    lane8 = ptid % 8
    dst = tile_addr + group * 128
    if groups % 8 == 0:  # every row of this thread has the swizzle phase group % 8
        dst = dst + ((lane8 ^ (group % 8)) * 16)
    src = gmem_addr + Int64(group) * row_bytes + Int64(lane8 * 16)
    always = Boolean(True)
    for t in range(n_tiles):
        for j in range(n_rows // groups):
            row_dst = dst
            if groups % 8 != 0:  # the swizzle phase of row group + groups j
                row_dst = dst + ((lane8 ^ ((group + groups * j) % 8)) * 16)
            dev.cp_async_16_zfill(
                row_dst + (t * n_rows * 128 + j * groups * 128),
                src + Int64(j * groups) * row_bytes + Int64(t * 128),
                always,
                policy,
            )
