"""Device pieces shared by the decode kernels (CuTe DSL; no MMA, any arch with cp.async).

* :class:`PagedKvGather` -- :class:`~mla_kernels.common.gather.KvGather` over a paged KV cache:
  the top-k entries are physical rows of the flattened cache, or (with a block table) logical
  positions of the request's sequence translated in the kernel as vLLM's paged attention does:
  ``row = block_table[b, pos // page_size] * page_size + pos % page_size``, the division the
  compiler's (or, ``MLA_KERNELS_DECODE_PAGEDIV=magic``, :func:`div_u31` with the host's constants).
* :func:`load_q_tile` -- ``q (+ q_bias)`` rows into a K-major SW128 smem tile (the layout wgmma
  reads and :class:`KvGather` writes), 16-byte loads and stores; the bias add is fused here.
* :func:`split_range` -- which top-k blocks a split covers, and the slot bound that keeps a
  split from reading its neighbour's slots.

Runtime flag bits shared by the decode kernels' ``flags`` argument: :data:`F_BIAS`,
:data:`F_BLOCK_TABLE`, :data:`F_TOPK_LENGTH`, :data:`F_SINK`, :data:`F_MAX_LOGITS`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64

from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from . import device as dev
from .decode_host import F_BIAS, F_BLOCK_TABLE, F_MAX_LOGITS, F_SINK, F_TOPK_LENGTH  # noqa: F401 (re-exported)
from .gather import GROUPS, KvGather

BLOCK = 64  # top-k slots per block (every decode kernel)


def flag(flags: Int32, bit: int) -> Boolean:
    return (flags & Int32(bit)) != Int32(0)


class PagedKvGather(KvGather):
    """:class:`KvGather` whose slots go through an optional block table.

    ``mKV`` is the flattened cache ``[num_pages * page_size, d_qk]``; ``mBT [b, max_pages]`` the
    block table (read only when ``use_bt`` is true; any small tensor otherwise), ``b_idx`` the
    request of this token.  A slot is valid iff its row is in range after translation and
    ``slot < topk_len`` (see :func:`mla_kernels.reference.decode_physical_indices`).
    """

    def __init__(self, mKV, mIdx, s_idx, topk_len, ptid, d_qk, slots, mBT, b_idx, use_bt, page_size,
                 l2_prefetch: int = 128, evict_first: bool = False, page_mul=None, page_shift=None,
                 magic: bool = False):
        super().__init__(mKV, mIdx, s_idx, topk_len, ptid, d_qk, slots)
        if evict_first:  # rows read once (a knob: MLA_KERNELS_DECODE_L2_POLICY)
            self.policy = dev.createpolicy_evict_first()
        assert l2_prefetch in (0, 128, 256), l2_prefetch
        self.l2_prefetch = l2_prefetch
        self.mBT = mBT
        self.use_bt = use_bt
        self.page_size = page_size
        # the divisor (a page size of 0 -- an empty cache -- divides by 1, as the host's constants)
        self.ps = cutlass.max(page_size, 1)
        # magic: positions divided by ``ps`` with the host's page_divisor(ps) constants
        self.magic = magic
        assert not magic or (page_mul is not None and page_shift is not None)
        self.page_mul = page_mul
        self.page_shift = page_shift
        self.max_pages = mBT.shape[1]
        self.num_pages = self.div_page(self.s_kv)
        # block-table row of this request (0 when unused: the placeholder has one row)
        self.bt_row = Int32(cutlass.select_(use_bt, b_idx, Int32(0)))

    def div_page(self, n):
        """``n // ps`` for ``0 <= n < 2^31``."""
        if self.magic:
            return div_u31(n, self.page_mul, self.page_shift)
        return n // self.ps

    def index_at(self, slot):
        pos = self.fetch_slot(slot)
        ps = self.ps
        pos_c = cutlass.max(pos, Int32(0))
        page_i = self.div_page(pos_c)
        page = self.mBT[self.bt_row, cutlass.min(page_i, self.max_pages - 1)]
        paged = page * ps + (pos_c - page_i * ps)
        ok_paged = (pos >= 0) & (page_i < self.max_pages) & (page >= 0) & (page < self.num_pages)
        idx = Int32(cutlass.select_(self.use_bt, paged, pos))
        in_range = Boolean(cutlass.select_(self.use_bt, ok_paged, (pos >= 0) & (pos < self.s_kv)))
        return idx, in_range & (slot < self.topk_len)

    def copy_tiles(self, buf_addr: Int32, slot_b: int, t0: int, t1: int) -> None:
        """:meth:`KvGather.copy_tiles` with this gather's L2 prefetch size.  Decode rows are
        ``d_qk * 2`` bytes at random rows of a large cache (no reuse): a 256-byte prefetch
        straddles into neighbouring rows nobody asked for (1152-byte rows are 128-byte but not
        256-byte aligned); 128 bytes fetches exactly the row."""
        if self.l2_prefetch == 256:
            return super().copy_tiles(buf_addr, slot_b, t0, t1)
        base = buf_addr + self.smem_off
        for t in range(t0, t1):
            for j in range(self.rows_per_thread):
                cp_async_16_zfill_pf(
                    base + (t * self.rows * 128 + j * GROUPS * 128),
                    self.src[slot_b, j] + Int64(t * 128),
                    self.ok[slot_b, j],
                    self.policy,
                    self.l2_prefetch,
                )


@cute.jit
def load_q_tile(
    mQ: cute.Tensor,
    mBias: cute.Tensor,
    use_bias: Int32,
    token: Int32,
    b_idx: Int32,
    head0: Int32,
    n_rows: cutlass.Constexpr,
    d_qk: cutlass.Constexpr,
    tile_addr: Int32,
    tid: Int32,
    n_threads: cutlass.Constexpr,
    tile_rows: cutlass.Constexpr = 0,
):
    """``q[token, head0 + r, :] (+ q_bias[b_idx, head0 + r, :])`` for ``r < n_rows`` into an smem
    tile of ``tile_rows x d_qk`` bf16 (``tile_rows`` 0: ``n_rows``; rows ``n_rows ..`` are
    zero-filled): ``d_qk/64`` K-major SW128 tiles of ``[tile_rows x 64]``, ``tile_rows * 128``
    bytes apart, starting at ``tile_addr`` (32-bit shared address, 1024-byte
    aligned).  ``mQ`` is ``[b, s_q, h, d_qk]`` (``token = b * s_q + s``), ``mBias [*, h, d_qk]``
    (the zero placeholder when ``use_bias`` is 0: adding it changes nothing).  The sum is
    rounded to bf16 once.  Called by ``n_threads`` threads (``tid`` 0..n_threads-1); without the
    bias the rows go by ``cp.async`` (no register round trip), so the caller first waits
    (:func:`cp_async_wait_all`), then fences (``fence.proxy.async``) and synchronises before an MMA
    reads the tile -- the wait may come much later: the kernels issue the load at their start."""
    h = mQ.shape[2]
    chunks = d_qk // 8
    t_rows = tile_rows if cutlass.const_expr(tile_rows > 0) else n_rows
    total = t_rows * chunks
    if use_bias != 0:
        q_base = mQ.iterator + (Int64(token) * h + head0) * d_qk
        bias_base = mBias.iterator + (Int64(b_idx) * h + head0) * d_qk
        vec = cute.make_layout(8)
        rq = cute.make_rmem_tensor((8,), cutlass.BFloat16)
        rb = cute.make_rmem_tensor((8,), cutlass.BFloat16)
        rf = cute.make_rmem_tensor((8,), Float32)
        for k in cutlass.range_constexpr((total + n_threads - 1) // n_threads):
            j = tid + k * n_threads
            if j < total:
                r = j // chunks
                c = j % chunks
                if cutlass.const_expr(t_rows == n_rows):
                    off = Int64(r * d_qk + c * 8)
                    cute.autovec_copy(cute.make_tensor((q_base + off).align(16), vec), rq)
                    cute.autovec_copy(cute.make_tensor((bias_base + off).align(16), vec), rb)
                    rf.store(rq.load().to(Float32) + rb.load().to(Float32))
                else:  # the padding rows are zeros
                    rf.fill(0.0)
                    if r < n_rows:
                        off = Int64(r * d_qk + c * 8)
                        cute.autovec_copy(cute.make_tensor((q_base + off).align(16), vec), rq)
                        cute.autovec_copy(cute.make_tensor((bias_base + off).align(16), vec), rb)
                        rf.store(rq.load().to(Float32) + rb.load().to(Float32))
                dst = tile_addr + (c // 8) * (t_rows * 128) + r * 128 + (((c % 8) ^ (r % 8)) * 16)
                dev.st_shared_v4_b32(
                    dst,
                    dev.pack_bf16x2(rf[0], rf[1]),
                    dev.pack_bf16x2(rf[2], rf[3]),
                    dev.pack_bf16x2(rf[4], rf[5]),
                    dev.pack_bf16x2(rf[6], rf[7]),
                )
    else:
        # no bias: straight to smem with cp.async, every chunk in flight at once (the caller
        # waits with cp_async_wait_all before its fence and barrier)
        q_addr = dev.gmem_addr_i64(mQ.iterator) + ((Int64(token) * h + head0) * d_qk) * 2
        policy = dev.createpolicy_evict_first()
        for k in cutlass.range_constexpr((total + n_threads - 1) // n_threads):
            j = tid + k * n_threads
            if j < total:
                r = j // chunks
                c = j % chunks
                dst = tile_addr + (c // 8) * (t_rows * 128) + r * 128 + (((c % 8) ^ (r % 8)) * 16)
                if cutlass.const_expr(t_rows == n_rows):
                    cp_async_16_zfill_pf(dst, q_addr + Int64(r * d_qk + c * 8) * 2, Boolean(True), policy, 128)
                else:  # the padding rows: zero-filled, nothing read
                    ok = r < n_rows
                    rr = Int32(cutlass.select_(ok, r, Int32(0)))
                    cp_async_16_zfill_pf(dst, q_addr + Int64(rr * d_qk + c * 8) * 2, Boolean(ok), policy, 128)


@dsl_user_op
def cp_async_wait_all(*, loc=None, ip=None) -> None:
    """Commit this thread's ``cp.async`` copies and wait for all of them (``cp.async.wait_all``)."""
    llvm.inline_asm(None, [], "cp.async.wait_all;", "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@cute.jit
def topk_len_of(mTL, flags: Int32, b_idx: Int32, s_idx: Int32, tl_stride_b: Int32, tl_stride_s: Int32, topk):
    """This token's ``topk_length`` clamped to ``[0, topk]`` (``topk`` without the flag).

    ``mTL`` is 1-D: ``[b]`` (strides ``(1, 0)``) or a flattened ``[b, s_q]`` (``(s_q, 1)``)."""
    # Without the flag nothing is loaded: the load would sit on every CTA's critical path
    # (num_iters and the producer's first slot check wait for it).
    v = Int32(topk)
    if flag(flags, F_TOPK_LENGTH):
        v = cutlass.min(cutlass.max(mTL[b_idx * tl_stride_b + s_idx * tl_stride_s], Int32(0)), topk)
    return v


def split_range(split: Int32, blocks_per_split: Int32, topk_len: Int32):
    """``(first block, number of blocks, slot bound)`` of ``split``: blocks
    ``[split * bps, min((split + 1) * bps, ceil(topk_len / 64)))``; slots at or past the bound
    (the split's end, or topk_len) are invalid, so the last pair's padding block of one split
    never reads the next split's slots."""
    n_total = (topk_len + (BLOCK - 1)) // BLOCK
    blk0 = split * blocks_per_split
    blk1 = cutlass.min(blk0 + blocks_per_split, n_total)
    n_blocks = cutlass.max(blk1 - blk0, Int32(0))
    bound = cutlass.min(topk_len, blk1 * BLOCK)
    return blk0, n_blocks, bound


def split_pairs(mTL, flags: Int32, b_idx: Int32, s_idx: Int32, tl_stride_b: Int32, tl_stride_s: Int32, topk,
                split: Int32, blocks_per_split: Int32):
    """``(first block, block pairs, slot bound)`` of this CTA's split of token ``(b_idx, s_idx)``:
    :func:`topk_len_of` then :func:`split_range`, the blocks taken in pairs (one per consumer
    buffer; the odd pair's padding block is masked by the bound)."""
    topk_len = topk_len_of(mTL, flags, b_idx, s_idx, tl_stride_b, tl_stride_s, topk)
    blk0, n_blocks, bound = split_range(split, blocks_per_split, topk_len)
    return blk0, (n_blocks + 1) // 2, bound


def out_row_offset(split: Int32, n_tokens: Int32, token: Int32, h: int, head: Int32, d_v: int) -> Int64:
    """Element offset of ``out[split, token, head, 0]`` in a ``[n_splits, T, h, d_v]`` output
    (the direct bf16 output ``[b, s_q, h, d_v]`` is split 0)."""
    return ((Int64(split) * n_tokens + token) * h + head) * d_v


def lse_offset(split: Int32, n_tokens: Int32, token: Int32, h: int, head: Int32) -> Int64:
    return (Int64(split) * n_tokens + token) * h + head


def store_f32(mT: cute.Tensor, off: Int64, value: Float32) -> None:
    """``mT.flat[off] = value`` with a 64-bit offset."""
    cute.make_tensor(mT.iterator + off, cute.make_layout(1))[0] = value


def store_bf16(mT: cute.Tensor, off: Int64, value: Float32) -> None:
    """``mT.flat[off] = bf16(value)`` (round to nearest) with a 64-bit offset."""
    r = cute.make_rmem_tensor((1,), Float32)
    r[0] = value
    cute.make_tensor(mT.iterator + off, cute.make_layout(1)).store(r.load().to(cutlass.BFloat16))


@dsl_user_op
def div_u31(n: Int32, mul: Int32, shift: Int32, *, loc=None, ip=None) -> Int32:
    """``n // d`` for ``0 <= n < 2^31`` by the constants ``(mul, shift) = page_divisor(d)`` of
    ``common/decode_host.py``: ``(umulhi(n, mul) + n) >> shift`` in unsigned 32-bit arithmetic
    (``mul.hi.u32``, ``add``, ``shr.b32``: three instructions, no division sequence)."""
    return Int32(llvm.inline_asm(
        T.i32(),
        [Int32(n).ir_value(loc=loc, ip=ip), Int32(mul).ir_value(loc=loc, ip=ip),
         Int32(shift).ir_value(loc=loc, ip=ip)],
        "{ .reg .u32 t; mul.hi.u32 t, $1, $2; add.u32 t, t, $1; shr.b32 $0, t, $3; }",
        "=r,r,r,r",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    ))


@dsl_user_op
def cp_async_16_zfill_pf(smem_addr: Int32, gmem_addr: Int64, valid: Boolean, policy: Int64, prefetch: int,
                         *, loc=None, ip=None) -> None:
    """``device.cp_async_16_zfill`` with an L2 prefetch size of ``prefetch`` bytes (128) or none (0)."""
    src_size = Int32(cutlass.select_(valid, Int32(16), Int32(0)))
    pf = {0: "", 128: ".L2::128B"}[prefetch]
    llvm.inline_asm(
        None,
        [
            Int32(smem_addr).ir_value(loc=loc, ip=ip),
            Int64(gmem_addr).ir_value(loc=loc, ip=ip),
            Int32(src_size).ir_value(loc=loc, ip=ip),
            Int64(policy).ir_value(loc=loc, ip=ip),
        ],
        f"cp.async.cg.shared.global.L2::cache_hint{pf} [$0], [$1], 16, $2, $3;",
        "r,l,r,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
