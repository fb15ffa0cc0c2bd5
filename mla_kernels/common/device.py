"""CuTe DSL device helpers shared by the sm90 and sm100 kernels.

Everything here runs inside ``@cute.kernel`` code.  Contents:

* inline PTX the DSL does not expose: ``cp.async`` with zero-fill and an L2 cache policy,
  ``createpolicy``, the sm100 ``tcgen05.fence::{before,after}_thread_sync`` pair;
* :class:`HalfBufferBarriers` -- a ready/free mbarrier pair guarding one piece of an smem buffer
  whose producer and consumers do not run as a ring (phases come from the iteration parity);
* index/validity helpers (the slot-validity rule of the package: ``0 <= idx < s_kv`` and
  ``slot < topk_length``);
* row-wise online-softmax pieces over a Hopper wgmma accumulator fragment (``64 x N`` f32 tile,
  each thread holding rows ``r0`` and ``r0 + 8``; flat element ``i = v0 + 2*v1 + 4*v2`` is row
  ``v1``, column ``8*v2 + 2*(lane % 4) + v0``).

Softmax conventions: scores are kept in "scaled log2" units ``x = s * sm_scale * log2(e)`` so that
probabilities are ``exp2(x - m)``; ``lse = ln(l) + m * ln(2)`` at the end.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, Uint32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass._mlir.dialects import nvvm as _nvvm
from cutlass.cutlass_dsl import T, dsl_user_op

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
#: Initial running max: finite so that ``exp2(m_old - m_new)`` never sees ``(-inf) - (-inf)``.
MAX_INIT = -1e30


# ---------------------------------------------------------------------------------------------
# Inline PTX
# ---------------------------------------------------------------------------------------------


def _createpolicy(priority: str, loc=None, ip=None) -> Int64:
    """``createpolicy.fractional.L2::<priority>`` for every line (fraction 1.0)."""
    return Int64(
        llvm.inline_asm(
            T.i64(),
            [],
            f"createpolicy.fractional.L2::{priority}.b64 $0, 1.0;",
            "=l",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def createpolicy_evict_last(*, loc=None, ip=None) -> Int64:
    """An L2 cache policy that keeps lines (``createpolicy.fractional.L2::evict_last``)."""
    return _createpolicy("evict_last", loc, ip)


@dsl_user_op
def createpolicy_evict_normal(*, loc=None, ip=None) -> Int64:
    """An L2 cache policy with the default eviction priority (``...L2::evict_normal``)."""
    return _createpolicy("evict_normal", loc, ip)


@dsl_user_op
def createpolicy_evict_first(*, loc=None, ip=None) -> Int64:
    """An L2 cache policy for data read once (``createpolicy.fractional.L2::evict_first``)."""
    return _createpolicy("evict_first", loc, ip)


def _asm_void(text: str, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [], text, "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def tcgen05_fence_before_thread_sync(*, loc=None, ip=None) -> None:
    """sm100: order this thread's earlier tcgen05 ops (TMEM loads, MMAs) before the thread
    synchronisation that follows (an mbarrier arrive, a named barrier)."""
    _asm_void("tcgen05.fence::before_thread_sync;", loc, ip)


@dsl_user_op
def tcgen05_fence_after_thread_sync(*, loc=None, ip=None) -> None:
    """sm100: order this thread's later tcgen05 ops after the thread synchronisation that precedes
    (an mbarrier wait, a named barrier)."""
    _asm_void("tcgen05.fence::after_thread_sync;", loc, ip)


@dsl_user_op
def cp_async_16_zfill(
    smem_addr: Int32, gmem_addr: Int64, valid: Boolean, policy: Int64, *, loc=None, ip=None
) -> None:
    """16-byte ``cp.async.cg`` global->shared with L2 256-byte prefetch and cache ``policy``.

    When ``valid`` is false no global memory is read and the 16 smem bytes are zero-filled
    (src-size 0), so an invalid KV row never leaves stale or uninitialised smem behind.
    """
    src_size = Int32(cutlass.select_(valid, Int32(16), Int32(0)))
    llvm.inline_asm(
        None,
        [
            Int32(smem_addr).ir_value(loc=loc, ip=ip),
            Int64(gmem_addr).ir_value(loc=loc, ip=ip),
            Int32(src_size).ir_value(loc=loc, ip=ip),
            Int64(policy).ir_value(loc=loc, ip=ip),
        ],
        "cp.async.cg.shared.global.L2::cache_hint.L2::256B [$0], [$1], 16, $2, $3;",
        "r,l,r,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def red_add_v4_f32(gmem_addr: Int64, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> None:
    """``red.global.add.v4.f32``: one 16-byte vector float atomic add (sm_90+), no return value."""
    llvm.inline_asm(
        None,
        [Int64(gmem_addr).ir_value(loc=loc, ip=ip)]
        + [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
        "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};",
        "l,f,f,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def red_add_v4_f32_hint(gmem_addr: Int64, a: Float32, b: Float32, c: Float32, d: Float32, policy: Int64,
                        *, loc=None, ip=None) -> None:
    """``red.global.add.v4.f32`` with an L2 cache-policy hint (``createpolicy`` value)."""
    llvm.inline_asm(
        None,
        [Int64(gmem_addr).ir_value(loc=loc, ip=ip)]
        + [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)]
        + [Int64(policy).ir_value(loc=loc, ip=ip)],
        "red.global.add.L2::cache_hint.v4.f32 [$0], {$1, $2, $3, $4}, $5;",
        "l,f,f,f,f,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def bulk_reduce_add_f32(gmem_addr: Int64, smem_addr: Int32, nbytes: Int32, policy: Int64, *, loc=None,
                        ip=None) -> None:
    """TMA bulk reduction ``global[gmem_addr : +nbytes] += shared[smem_addr : +nbytes]`` (float32
    add, ``cp.reduce.async.bulk ... .add.f32`` with an L2 cache-policy hint; ``nbytes`` a multiple
    of 16, both addresses 16-byte aligned).  Asynchronous: commit the bulk group and wait (``.read``)
    before the source is overwritten."""
    llvm.inline_asm(
        None,
        [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Int32(smem_addr).ir_value(loc=loc, ip=ip),
         Int32(nbytes).ir_value(loc=loc, ip=ip), Int64(policy).ir_value(loc=loc, ip=ip)],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.f32 [$0], [$1], $2, $3;",
        "l,r,r,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def bulk_commit_and_wait_read_le(n: int, *, loc=None, ip=None) -> None:
    """Commit this thread's bulk operations and wait until at most ``n`` groups still read smem."""
    _asm_void(f"cp.async.bulk.commit_group;\n\tcp.async.bulk.wait_group.read {int(n)};", loc, ip)


@dsl_user_op
def st_global_v4_f32(gmem_addr: Int64, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> None:
    """A 16-byte vector store of four floats to global memory."""
    llvm.inline_asm(
        None,
        [Int64(gmem_addr).ir_value(loc=loc, ip=ip)]
        + [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
        "st.global.v4.f32 [$0], {$1, $2, $3, $4};",
        "l,f,f,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def pack_bf16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """Two floats rounded to bf16 in one 32-bit word (``lo`` in the low half), round to nearest."""
    return Uint32(
        llvm.inline_asm(
            T.i32(),
            [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
            "cvt.rn.bf16x2.f32 $0, $1, $2;",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def _store(ptx: str, constraint: str, operands, loc, ip) -> None:
    llvm.inline_asm(None, operands, ptx, constraint, has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def st_shared_v4_b32(smem_addr: Int32, a: Uint32, b: Uint32, c: Uint32, d: Uint32, *, loc=None, ip=None) -> None:
    """A 16-byte shared-memory store of four 32-bit words (32-bit shared address)."""
    _store("st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r",
           [Int32(smem_addr).ir_value(loc=loc, ip=ip)] + [Uint32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
           loc, ip)


@dsl_user_op
def st_shared_v4_f32(smem_addr: Int32, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> None:
    """A 16-byte shared-memory store of four floats (32-bit shared address)."""
    _store("st.shared.v4.f32 [$0], {$1, $2, $3, $4};", "r,f,f,f,f",
           [Int32(smem_addr).ir_value(loc=loc, ip=ip)] + [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
           loc, ip)


@dsl_user_op
def st_shared_v2_b32(smem_addr: Int32, a: Uint32, b: Uint32, *, loc=None, ip=None) -> None:
    """An 8-byte shared-memory store of two 32-bit words (32-bit shared address)."""
    _store("st.shared.v2.b32 [$0], {$1, $2};", "r,r,r",
           [Int32(smem_addr).ir_value(loc=loc, ip=ip)] + [Uint32(x).ir_value(loc=loc, ip=ip) for x in (a, b)],
           loc, ip)


@dsl_user_op
def st_shared_f32(smem_addr: Int32, a: Float32, *, loc=None, ip=None) -> None:
    """A 4-byte shared-memory store of one float (32-bit shared address)."""
    _store("st.shared.f32 [$0], $1;", "r,f",
           [Int32(smem_addr).ir_value(loc=loc, ip=ip), Float32(a).ir_value(loc=loc, ip=ip)], loc, ip)


@dsl_user_op
def st_global_b32(gmem_addr: Int64, value: Uint32, *, loc=None, ip=None) -> None:
    """A 4-byte global store at a 64-bit address."""
    _store("st.global.b32 [$0], $1;", "l,r",
           [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Uint32(value).ir_value(loc=loc, ip=ip)], loc, ip)


@dsl_user_op
def st_global_b32_if(gmem_addr: Int64, value: Uint32, pred: Int32, *, loc=None, ip=None) -> None:
    """A 4-byte global store at a 64-bit address, done only where ``pred`` is non-zero (a
    predicated instruction: no branch)."""
    _store("{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $2, 0;\n\t@p st.global.b32 [$0], $1;\n\t}", "l,r,r",
           [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Uint32(value).ir_value(loc=loc, ip=ip),
            Int32(pred).ir_value(loc=loc, ip=ip)], loc, ip)


@dsl_user_op
def st_global_v2_b32(gmem_addr: Int64, a: Uint32, b: Uint32, *, loc=None, ip=None) -> None:
    """An 8-byte global store of two 32-bit words at a 64-bit address."""
    _store("st.global.v2.b32 [$0], {$1, $2};", "l,r,r",
           [Int64(gmem_addr).ir_value(loc=loc, ip=ip)] + [Uint32(x).ir_value(loc=loc, ip=ip) for x in (a, b)],
           loc, ip)


@dsl_user_op
def st_global_v4_b32(gmem_addr: Int64, a: Uint32, b: Uint32, c: Uint32, d: Uint32, *, loc=None, ip=None) -> None:
    """A 16-byte global store of four 32-bit words at a 64-bit address."""
    _store("st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r",
           [Int64(gmem_addr).ir_value(loc=loc, ip=ip)] + [Uint32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
           loc, ip)


def smem_addr_u32(ptr) -> Int32:
    """The 32-bit shared-memory address of an smem pointer."""
    return Int32(ptr.toint())


def gmem_addr_i64(ptr) -> Int64:
    """The 64-bit address of a global pointer."""
    return Int64(ptr.toint())


# ---------------------------------------------------------------------------------------------
# Barriers
# ---------------------------------------------------------------------------------------------


class HalfBufferBarriers:
    """A ``ready``/``free`` mbarrier pair for one piece of an smem buffer.

    The producer waits ``free`` (phase ``parity ^ 1``: a fresh barrier counts as free), fills the
    piece and arrives on ``ready``; consumers wait ``ready`` (phase ``parity``) and arrive on
    ``free`` when done.  ``parity`` is the iteration index's low bit: every piece is produced and
    consumed exactly once per iteration.  Used instead of a ring pipeline because the pieces are
    consumed by different warpgroups in different orders.
    """

    def __init__(self, ready_ptr, free_ptr):
        self.ready = ready_ptr
        self.free = free_ptr

    # Loop-invariant: dynamic loops capture the pointers from the enclosing scope instead of
    # carrying them.
    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    @staticmethod
    def init(ready_ptr, free_ptr, ready_count: int, free_count: int) -> None:
        cute.arch.mbarrier_init(ready_ptr, ready_count)
        cute.arch.mbarrier_init(free_ptr, free_count)

    def wait_ready(self, parity) -> None:
        cute.arch.mbarrier_wait(self.ready, parity)

    def wait_free(self, parity) -> None:
        cute.arch.mbarrier_wait(self.free, parity ^ 1)

    def commit_cp_async(self) -> None:
        """Arrive on ``ready`` once this thread's earlier cp.async copies have landed."""
        cute.arch.cp_async_mbarrier_arrive_noinc(self.ready)

    def release(self, count: int = 1) -> None:
        """Arrive on ``free`` (``count`` > 1: this thread counts as that many arrivals)."""
        if count == 1:
            cute.arch.mbarrier_arrive(self.free)
        else:
            cute.arch.mbarrier_arrive(self.free, arrive_count=count)


class PhaseSignal:
    """An mbarrier used as a one-way, once-per-iteration signal from one thread group to another.

    Every thread of the sending group calls :meth:`arrive` after its shared-memory writes (the
    arrive releases *this thread's* earlier accesses, so each writer must arrive itself -- an
    elected lane arriving for its warp would leave the other lanes' writes unordered); the
    receiving group calls :meth:`wait` with the iteration's parity before it reads.  The sender
    must not arrive for iteration ``i + 1`` before the receiver has waited on ``i`` (a parity wait
    cannot tell phase ``p`` from ``p + 2``): the kernels guarantee it with a signal in the other
    direction.  Used instead of a named ``bar.arrive``/``bar.sync`` pair because the PTX memory
    model *and* compute-sanitizer's racecheck both see the release/acquire of an mbarrier, so a
    buffer reused in the next iteration is provably free of write-after-read hazards.
    """

    def __init__(self, ptr):
        self.ptr = ptr

    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    def init(self, senders: int) -> None:
        cute.arch.mbarrier_init(self.ptr, senders)

    def arrive(self) -> None:
        cute.arch.mbarrier_arrive(self.ptr)

    def wait(self, parity) -> None:
        cute.arch.mbarrier_wait(self.ptr, parity)


# ---------------------------------------------------------------------------------------------
# Slot validity
# ---------------------------------------------------------------------------------------------


def slot_valid(idx: Int32, slot: Int32, s_kv: Int32, topk_len: Int32) -> Boolean:
    """The package's rule: a slot is valid iff ``0 <= idx < s_kv`` and ``slot < topk_len``."""
    return (idx >= 0) & (idx < s_kv) & (slot < topk_len)


# ---------------------------------------------------------------------------------------------
# Online softmax over a wgmma accumulator fragment (64 x N f32, two rows per thread)
# ---------------------------------------------------------------------------------------------


def acc_flat(v0: int, row: int, group: int) -> int:
    """Flat index of (column pair element ``v0``, row ``row`` in {0,1}, 8-column group)."""
    return v0 + 2 * row + 4 * group


def mask_scores(acc_s: cute.Tensor, valid_lo: Uint32, valid_hi: Uint32, lane_quad: Int32) -> None:
    """Set ``-inf`` where the column's slot is invalid.

    ``valid_lo``/``valid_hi`` hold the validity bits of columns 0..31 / 32..63; this thread's
    columns are ``8*g + 2*lane_quad + v0``.
    """
    n_groups = cute.size(acc_s) // 4
    lo = valid_lo >> Uint32(2 * lane_quad)
    hi = valid_hi >> Uint32(2 * lane_quad)
    for g in range(n_groups):
        word = lo if g < 4 else hi
        for v0 in range(2):
            bit = (word >> Uint32(8 * (g % 4) + v0)) & Uint32(1)
            for row in range(2):
                i = acc_flat(v0, row, g)
                acc_s[i] = Float32(cutlass.select_(bit != Uint32(0), acc_s[i], Float32(-math.inf)))


def row_max(acc_s: cute.Tensor, row: int) -> Float32:
    """Max over this thread's elements of ``row`` (0/1), then over the 4 threads of the quad."""
    n_groups = cute.size(acc_s) // 4
    m = acc_s[acc_flat(0, row, 0)]
    for g in range(n_groups):
        for v0 in range(2):
            if const_expr(g != 0 or v0 != 0):
                m = cute.arch.fmax(m, acc_s[acc_flat(v0, row, g)])
    m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=1))
    m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=2))
    return m


def exp2_scores(acc_s: cute.Tensor, row: int, scale_log2: Float32, m: Float32) -> Float32:
    """``p = exp2(s * scale_log2 - m)`` in place for ``row``; returns this thread's partial sum."""
    n_groups = cute.size(acc_s) // 4
    neg_m = -m
    total = Float32(0.0)
    for g in range(n_groups):
        for v0 in range(2):
            i = acc_flat(v0, row, g)
            p = cute.math.exp2(acc_s[i] * scale_log2 + neg_m, fastmath=True)
            acc_s[i] = p
            total = total + p
    return total


def online_softmax(acc_s, acc_o, rM, rL, scale_log2: Float32, floor0: Float32, floor1: Float32) -> None:
    """One block of online softmax for the two rows this thread holds, in scaled-log2 units.

    New running max ``m = max(floor, rowmax(S) * c)`` (``floor`` is the previous max, or a larger
    max published by another warpgroup); ``O`` and ``l`` are rescaled by ``exp2(m_old - m)``;
    ``S`` becomes ``P = exp2(S*c - m)`` in place; ``l += rowsum(P)`` (this thread's columns only
    -- reduce over the quad at the end).  ``rM``/``rL`` are 2-element register tensors.
    """
    sf = []
    for r, floor in ((0, floor0), (1, floor1)):
        cur = row_max(acc_s, r) * scale_log2
        new_m = cute.arch.fmax(floor, cur)
        sfo = cute.math.exp2(rM[r] - new_m, fastmath=True)
        rL[r] = rL[r] * sfo + exp2_scores(acc_s, r, scale_log2, new_m)
        rM[r] = new_m
        sf.append(sfo)
    scale_rows(acc_o, sf[0], sf[1])


def scale_rows(acc: cute.Tensor, s0: Float32, s1: Float32) -> None:
    """Multiply row 0 of this thread's fragment by ``s0`` and row 1 by ``s1``."""
    n_groups = cute.size(acc) // 4
    for g in range(n_groups):
        for v0 in range(2):
            acc[acc_flat(v0, 0, g)] = acc[acc_flat(v0, 0, g)] * s0
            acc[acc_flat(v0, 1, g)] = acc[acc_flat(v0, 1, g)] * s1


def quad_sum(x: Float32) -> Float32:
    """Sum over the 4 threads of a quad (the threads sharing a row of the fragment)."""
    x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x


def fragment_row(idx_in_wg: Int32, row: int) -> Int32:
    """Row (0..63) of the 64-row wgmma fragment that element-row ``row`` of thread ``idx_in_wg`` holds."""
    return (idx_in_wg // 32) * 16 + (idx_in_wg % 32) // 4 + 8 * row


def quad_pair_v4(acc: cute.Tensor, g: int, odd: Boolean):
    """Four consecutive columns of one row from a pair of quad lanes (``lane % 4`` = 2k, 2k+1).

    In 8-column group ``g`` lane ``q`` holds columns ``2q, 2q+1`` of its rows 0 and 1.  One
    shuffle pair swaps halves so that the even lane ends with row 0's columns ``2q .. 2q+3`` and
    the odd lane with row 1's columns ``2q-2 .. 2q+1``: 16-byte vectors for global memory
    instead of 8-byte ones.  Every lane must call this (it shuffles).
    """
    a0 = acc[acc_flat(0, 0, g)]
    a1 = acc[acc_flat(1, 0, g)]
    b0 = acc[acc_flat(0, 1, g)]
    b1 = acc[acc_flat(1, 1, g)]
    r0 = cute.arch.shuffle_sync_bfly(Float32(cutlass.select_(odd, a0, b0)), offset=1)
    r1 = cute.arch.shuffle_sync_bfly(Float32(cutlass.select_(odd, a1, b1)), offset=1)
    return (
        Float32(cutlass.select_(odd, r0, a0)),
        Float32(cutlass.select_(odd, r1, a1)),
        Float32(cutlass.select_(odd, b0, r0)),
        Float32(cutlass.select_(odd, b1, r1)),
    )


def butterfly_reduce_scatter(vals: cute.Tensor, n: int, lane: Int32, offsets) -> None:
    """Sum ``vals[0:n]`` over the lanes that differ in the lane bits ``offsets`` (descending powers
    of two) by a reduce-scatter: at each step a lane keeps one half of its values, sends the other
    half to its ``lane ^ off`` partner and adds what it receives; afterwards ``vals[0:n >> len(offsets)]``
    hold this lane's share of the sums.  ``n (1 - 2^-steps)`` shuffles instead of ``n * steps``.
    All lanes call it."""
    for off in offsets:
        upper = (lane & off) != 0
        half = n // 2
        for k in range(half):
            send = Float32(cutlass.select_(upper, vals[k], vals[k + half]))
            keep = Float32(cutlass.select_(upper, vals[k + half], vals[k]))
            vals[k] = keep + cute.arch.shuffle_sync_bfly(send, offset=off)
        n = half


def warp_reduce_scatter_cols(colsum: cute.Tensor, lane: Int32) -> None:
    """Sum 16 per-lane column partials (columns ``8*g + 2*(lane%4) + v``, ``colsum[2g+v]``) over
    the 8 row groups of a warp (lane bits 4, 3, 2) by a reduce-scatter: 3 butterfly steps, 14
    shuffles instead of 48.  Afterwards lane ``l`` holds columns ``2l, 2l+1`` in ``colsum[0:2]``.
    """
    butterfly_reduce_scatter(colsum, 16, lane, (16, 8, 4))


def warp_reduce_scatter_32(vals: cute.Tensor, lane: Int32) -> None:
    """Sum 32 per-lane values over the 32 lanes of a warp by a reduce-scatter (5 butterfly steps,
    31 shuffles): afterwards lane ``l`` holds ``sum over lanes of vals[l]`` in ``vals[0]`` (the
    other elements are clobbered).  All lanes call it."""
    butterfly_reduce_scatter(vals, 32, lane, (16, 8, 4, 2, 1))


def transpose_lanes(vec: cute.Tensor, r8: Int32, n: int) -> None:
    """``n`` x ``n`` transpose (``n`` = 4 or 8) of 4-float vectors between the lanes
    ``(lane // 4) % n`` and the vector slot: afterwards slot ``b`` of lane index ``a`` holds what
    slot ``a`` of lane index ``b`` held (``r8 = lane // 4``; its bits above ``n`` and ``lane % 4``
    select independent groups).  ``vec[4*slot + e]``.  log2(n) butterfly stages (lane xor 4, 8,
    16), ``2 * n * log2(n)`` shuffles.  All lanes call it.
    """
    bit = 1
    while bit < n:
        upper = (r8 & bit) != 0
        for g in range(n):
            if g & bit == 0:
                h = g | bit
                for e in range(4):
                    send = Float32(cutlass.select_(upper, vec[4 * g + e], vec[4 * h + e]))
                    recv = cute.arch.shuffle_sync_bfly(send, offset=4 * bit)
                    vec[4 * g + e] = Float32(cutlass.select_(upper, recv, vec[4 * g + e]))
                    vec[4 * h + e] = Float32(cutlass.select_(upper, vec[4 * h + e], recv))
        bit *= 2


@cute.jit
def rowsum_o_do_half(mO: cute.Tensor, mDO: cute.Tensor, s_idx: Int32, head: Int32, half: Int32,
                     d_v: cutlass.Constexpr, unroll: cutlass.Constexpr) -> Float32:
    """``sum_d O[s_idx, head, d] * dO[s_idx, head, d]`` in float32 by a pair of lanes (``lane ^ 1``):
    this lane sums columns ``half * d_v/2 ..`` (16-byte loads), one shuffle adds the other half.
    Row offsets are 64-bit (``s_q * h_q * d_v`` can pass 2^31); ``unroll`` bounds the loads in
    flight (a fully unrolled loop hoists all of them and can spill)."""
    row_off = (Int64(s_idx) * Int64(mO.shape[1]) + Int64(head)) * Int64(d_v)
    row_layout = cute.make_layout((32, d_v // 32), stride=(1, 32))
    gO = cute.make_tensor((mO.iterator + row_off).align(16), row_layout)
    gDO = cute.make_tensor((mDO.iterator + row_off).align(16), row_layout)
    rO = cute.make_rmem_tensor((32,), cutlass.BFloat16)
    rDO = cute.make_rmem_tensor((32,), cutlass.BFloat16)
    acc = Float32(0.0)
    for c in cutlass.range(d_v // 64, unroll=unroll):
        cute.autovec_copy(gO[None, half * (d_v // 64) + c], rO)
        cute.autovec_copy(gDO[None, half * (d_v // 64) + c], rDO)
        prod = rO.load().to(Float32) * rDO.load().to(Float32)
        acc = acc + prod.reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
    return acc + cute.arch.shuffle_sync_bfly(acc, offset=1)


# ---------------------------------------------------------------------------------------------
# Clusters (sm100 2-CTA kernels): DSMEM addresses, bulk copies to a peer CTA, remote arrivals
# ---------------------------------------------------------------------------------------------


def arrive_cta0(ptr) -> None:
    """Arrive on CTA 0's copy of an mbarrier (release at cluster scope: DSMEM handoff)."""
    cute.arch.mbarrier_arrive(ptr, Int32(0), scope=_nvvm.MemScopeKind.CLUSTER)


@dsl_user_op
def mapa_shared(addr: Int32, rank: Int32, *, loc=None, ip=None) -> Int32:
    """The shared::cluster address of ``addr`` (a shared::cta address) in CTA ``rank``."""
    return Int32(llvm.inline_asm(
        T.i32(),
        [Int32(addr).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip)],
        "mapa.shared::cluster.u32 $0, $1, $2;",
        "=r,r,r",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


@dsl_user_op
def bulk_copy_s2cluster(dst: Int32, src: Int32, nbytes: Int32, mbar: Int32, *, loc=None, ip=None) -> None:
    """``cp.async.bulk`` local smem -> (possibly remote) cluster smem; ``complete_tx`` on ``mbar``
    (a shared::cluster address in the destination CTA)."""
    llvm.inline_asm(
        None,
        [Int32(x).ir_value(loc=loc, ip=ip) for x in (dst, src, nbytes, mbar)],
        "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def bulk_commit_and_wait_read(*, loc=None, ip=None) -> None:
    """Commit this thread's bulk copies and wait until their sources have been read."""
    _asm_void("cp.async.bulk.commit_group;\n\tcp.async.bulk.wait_group.read 0;", loc, ip)


@dsl_user_op
def opaque_zero(*, loc=None, ip=None) -> Int32:
    """0, invisible to the optimiser (keeps address math inside the loop that needs it)."""
    return Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, 0;", "=r", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def clock32(*, loc=None, ip=None) -> Int32:
    """The SM's cycle counter (``%clock``, low 32 bits), read in program order (a volatile asm:
    not moved across the waits it brackets).  For timing traces only."""
    return Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, %clock;", "=r", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def globaltimer_ticks(shift: int, *, loc=None, ip=None) -> Int32:
    """The GPU-wide nanosecond timer (``%globaltimer``, the same on every SM) shifted right by
    ``shift`` bits, low 31 bits (non-negative).  Read in program order."""
    return Int32(llvm.inline_asm(
        T.i32(), [],
        "{\n\t.reg .u64 t;\n\tmov.u64 t, %globaltimer;\n\tshr.u64 t, t, " + str(int(shift))
        + ";\n\tcvt.u32.u64 $0, t;\n\tand.b32 $0, $0, 0x7fffffff;\n\t}",
        "=r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


def wrap_index(i, start, n):
    """``(i + start) mod n`` for ``0 <= i, start < n``: step ``i`` of a walk over ``n`` items that
    starts at item ``start`` and wraps around (the rotated block orders of the forward and the
    backward)."""
    x = i + start
    return cutlass.select_(x >= n, x - n, x)


class Trace:
    """Cycle stamps of one thread into a global ``[.., slots]`` int32 row (timing traces of a
    kernel's phases; ``enabled=False`` makes every call emit nothing).

    Slot ``base + b * per_block + e`` gets ``%clock`` when event ``e`` of block ``b`` happens
    (blocks past ``max_blocks`` are not recorded).  Only the thread that owns the object should
    call :meth:`stamp`: the callers guard it (one lane per role)."""

    def __init__(self, enabled: bool, row_addr=None, base: int = 0, per_block: int = 0, max_blocks: int = 0):
        self.enabled = enabled
        self.row_addr = row_addr
        self.base = base
        self.per_block = per_block
        self.max_blocks = max_blocks

    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    @cute.jit
    def stamp(self, b, e: cutlass.Constexpr, on) -> None:
        """Record event ``e`` of block ``b`` if ``on`` (this thread is the recorder).  A predicated
        store, no branch: the traced kernel keeps the untraced one's control flow."""
        if cutlass.const_expr(self.enabled):
            t = clock32()
            ok = on & (b < self.max_blocks)
            st_global_b32_if(self.row_addr + Int64(4) * Int64(self.base + b * self.per_block + e), Uint32(t),
                             Int32(cutlass.select_(ok, Int32(1), Int32(0))))

    @cute.jit
    def put(self, slot: cutlass.Constexpr, value, on) -> None:
        """Store ``value`` (int32) at slot ``slot`` of the row if ``on``."""
        if cutlass.const_expr(self.enabled):
            st_global_b32_if(self.row_addr + Int64(4 * slot), Uint32(value), Int32(cutlass.select_(on, Int32(1), Int32(0))))


@dsl_user_op
def mbarrier_arrive_expect_tx(mbar: Int32, nbytes: Int32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None,
        [Int32(mbar).ir_value(loc=loc, ip=ip), Int32(nbytes).ir_value(loc=loc, ip=ip)],
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;",
        "r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


# ---------------------------------------------------------------------------------------------
# DSMEM exchange between the two CTAs of a cluster (sm90 backward's pair-summed dKV)
# ---------------------------------------------------------------------------------------------


@dsl_user_op
def st_async_v4_b32(remote_addr: Int32, a: Uint32, b: Uint32, c: Uint32, d: Uint32, remote_mbar: Int32,
                    *, loc=None, ip=None) -> None:
    """``st.async`` of 16 bytes (four 32-bit words, e.g. eight packed bf16) into a peer CTA's
    shared memory (``remote_addr``: a shared::cluster address from :func:`mapa_shared`); the store
    completes 16 bytes of transaction count on the peer's mbarrier ``remote_mbar``."""
    llvm.inline_asm(
        None,
        [Int32(remote_addr).ir_value(loc=loc, ip=ip)]
        + [Uint32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)]
        + [Int32(remote_mbar).ir_value(loc=loc, ip=ip)],
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [$0], {$1, $2, $3, $4}, [$5];",
        "r,r,r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def _load_f32s(ptx: str, n: int, addr, loc, ip):
    """``n`` floats out of one inline-asm load from a 32-bit (shared / shared::cluster) address
    (operand ``$n``), with side effects: kept in program order (after the barrier or mbarrier wait
    that publishes the data).  One float: a Float32; more: a tuple."""
    res = llvm.inline_asm(
        T.f32() if n == 1 else llvm.StructType.get_literal([T.f32()] * n),
        [Int32(addr).ir_value(loc=loc, ip=ip)],
        ptx,
        ",".join(["=f"] * n + ["r"]),
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    if n == 1:
        return Float32(res)
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(n))


def _ld_v4_bf16x2_f32(space: str, addr, loc, ip):
    """``ld.<space>.v4.b32`` of eight bf16 (four words, low half first), widened to eight floats."""
    return _load_f32s(
        "{\n\t.reg .b32 w<4>;\n\tld." + space + ".v4.b32 {w0, w1, w2, w3}, [$8];\n\t"
        "shl.b32 $0, w0, 16;\n\tand.b32 $1, w0, 0xffff0000;\n\t"
        "shl.b32 $2, w1, 16;\n\tand.b32 $3, w1, 0xffff0000;\n\t"
        "shl.b32 $4, w2, 16;\n\tand.b32 $5, w2, 0xffff0000;\n\t"
        "shl.b32 $6, w3, 16;\n\tand.b32 $7, w3, 0xffff0000;\n\t}", 8, addr, loc, ip)


@dsl_user_op
def ld_cluster_f32(addr: Int32, *, loc=None, ip=None) -> Float32:
    """A 4-byte load from a shared::cluster address (:func:`mapa_shared`)."""
    return _load_f32s("ld.shared::cluster.f32 $0, [$1];", 1, addr, loc, ip)


@dsl_user_op
def ld_cluster_v4_f32(addr: Int32, *, loc=None, ip=None):
    """A 16-byte load of four floats from a shared::cluster address."""
    return _load_f32s("ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [$4];", 4, addr, loc, ip)


@dsl_user_op
def ld_shared_v4_bf16x2_f32(smem_addr: Int32, *, loc=None, ip=None):
    """A 16-byte shared-memory load of eight bf16 (four words, low half first), widened to eight
    floats; kept in program order (side effects) so that it never moves above the mbarrier wait
    that publishes the data."""
    return _ld_v4_bf16x2_f32("shared", smem_addr, loc, ip)


@dsl_user_op
def ld_cluster_v4_bf16x2_f32(addr: Int32, *, loc=None, ip=None):
    """The same from a shared::cluster address (a peer CTA's shared memory, :func:`mapa_shared`)."""
    return _ld_v4_bf16x2_f32("shared::cluster", addr, loc, ip)


@dsl_user_op
def mbarrier_arrive_cluster(remote_mbar: Int32, *, loc=None, ip=None) -> None:
    """Arrive on a (peer CTA's) mbarrier at a shared::cluster address, with the default semantics
    (release, CTA scope: what CUTLASS's ``ClusterBarrier::arrive(cta_id)`` issues to free a
    multicast/DSMEM buffer; ``.release.cluster`` compiles to ``MEMBAR.ALL.GPU``, which would wait
    for this thread's outstanding global atomics too)."""
    llvm.inline_asm(
        None,
        [Int32(remote_mbar).ir_value(loc=loc, ip=ip)],
        "mbarrier.arrive.shared::cluster.b64 _, [$0];",
        "r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


# ---------------------------------------------------------------------------------------------
# Bulk copies shared -> global (sm90 forward's lse / max_logits rows)
# ---------------------------------------------------------------------------------------------


@dsl_user_op
def bulk_copy_s2g(gmem_addr: Int64, smem_addr: Int32, nbytes: Int32, *, loc=None, ip=None) -> None:
    """``cp.async.bulk.global.shared::cta.bulk_group``: copy ``nbytes`` (a multiple of 16) from
    shared memory to global memory, both addresses 16-byte aligned.  Asynchronous: order the smem
    writes before it with ``fence.proxy.async.shared::cta`` (+ a barrier), commit the bulk group
    and wait (``.read``) before the source is overwritten or the CTA exits."""
    llvm.inline_asm(
        None,
        [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Int32(smem_addr).ir_value(loc=loc, ip=ip),
         Int32(nbytes).ir_value(loc=loc, ip=ip)],
        "cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
