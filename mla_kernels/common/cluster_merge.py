"""The split combine over distributed shared memory (sm_90a thread-block clusters), CuTe DSL.

The split CTAs of one decode row (a decode token and the heads one CTA holds) run as one
thread-block cluster of ``n`` CTAs (``n`` = the plan's split count: 2, 4, 8 or 16; 16 is a
non-portable size, which the DSL allows on every kernel it emits).  Each CTA, after its blocks:

1. stages its partial -- O normalised by its own softmax sum, in float32 or bf16 -- in its own
   shared memory (the freed Q / KV buffers; rows padded by 16 bytes), with its ``lse`` and max
   logit per head (:func:`stage_row_stats`);
2. meets the cluster at a barrier (``barrier.cluster.arrive`` releases, ``wait`` acquires: the
   peers' staged partials are visible through ``ld.shared::cluster``);
3. merges one slice of the heads -- ``rows / n`` heads, all ``d_v`` columns -- from every peer's
   shared memory, in split order (the combine kernel's log-sum-exp weighting and sink,
   :func:`merge_slice`), and writes the slice's bf16 output, lse and max logit;
4. meets the cluster again, so that no CTA exits while a peer still reads its shared memory.

No float32 partials go through global memory and no second kernel is launched.  The result does
not depend on the order in which CTAs finish (a fixed merge order per slice).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from . import decode_parts as dp
from . import device as dev
# the cluster sizes live with the plan's rule (host code, no DSL): 2, 4, 8, 16 (the forced
# ``cluster`` mode, the L2 staging) and every size the merge serves, 2..16 (a split count that does
# not divide the CTA's heads gives the last CTAs fewer heads: slice_shape)
from .decode_host import CLUSTER_SIZES, MERGE_SIZES  # noqa: F401


def row_stride_bytes(d_v: int, bf16: bool) -> int:
    """Bytes between two staged rows: ``d_v`` elements plus 16 bytes of padding (rows of a warp's
    16-byte stores then start in different banks)."""
    return d_v * (2 if bf16 else 4) + 16


def bfly_offsets(seg: int):
    """Butterfly shuffle offsets that reduce over an aligned segment of ``seg`` lanes."""
    return tuple(o for o in (16, 8, 4, 2, 1) if o < seg)


def staged_bytes(rows: int, d_v: int, bf16: bool) -> int:
    return rows * row_stride_bytes(d_v, bf16)


def cluster_sync(release: bool) -> None:
    """Every thread of every CTA of the cluster: ``barrier.cluster.arrive`` + ``wait`` (acquire).
    ``release``: the arrival releases this thread's earlier writes at cluster scope (SASS
    ``MEMBAR.ALL.GPU``, which also waits for its outstanding global stores); a thread with nothing
    to publish -- the producer warps, or a reader whose DSMEM loads have all been consumed --
    arrives relaxed."""
    if release:
        cute.arch.cluster_arrive()
    else:
        cute.arch.cluster_arrive_relaxed()
    cute.arch.cluster_wait()


@cute.jit
def stage_row_stats(stats_addr: Int32, row: Int32, n_rows: cutlass.Constexpr, l: Float32, m_log2: Float32):
    """Stage one head's ``lse`` (``+inf`` when empty) at ``stats[row]`` and its max logit
    (``-inf`` when empty) at ``stats[n_rows + row]`` (float32 words)."""
    empty = l == Float32(0.0)
    dev.st_shared_f32(stats_addr + 4 * row,
                  Float32(cutlass.select_(empty, Float32(math.inf), cute.math.log(l) + m_log2 * dev.LN2)))
    dev.st_shared_f32(stats_addr + 4 * (n_rows + row), Float32(cutlass.select_(empty, Float32(-math.inf), m_log2 * dev.LN2)))


@cute.jit
def stage_o_v4(x_addr: Int32, row: Int32, col: Int32, v0: Float32, v1: Float32, v2: Float32, v3: Float32,
               d_v: cutlass.Constexpr, bf16: cutlass.Constexpr):
    """Stage four consecutive columns ``col .. col+3`` of row ``row`` (16 / 8 bytes)."""
    stride = row_stride_bytes(d_v, bf16)
    if cutlass.const_expr(bf16):
        dev.st_shared_v2_b32(x_addr + row * stride + col * 2, dev.pack_bf16x2(v0, v1), dev.pack_bf16x2(v2, v3))
    else:
        dev.st_shared_v4_f32(x_addr + row * stride + col * 4, v0, v1, v2, v3)


@cute.jit
def stage_o_rows(x_addr: Int32, acc_o: cute.Tensor, row: Int32, col0: Int32, odd, d_v: cutlass.Constexpr,
                 bf16: cutlass.Constexpr):
    """Stage a quad lane pair's row ``row`` of a warpgroup's O accumulator (``d_v / 2`` columns
    from ``col0``, 8 apart per column group; :func:`~mla_kernels.common.device.quad_pair_v4`)."""
    for g in cutlass.range_constexpr(cute.size(acc_o) // 4):
        v0, v1, v2, v3 = dev.quad_pair_v4(acc_o, g, odd)
        stage_o_v4(x_addr, row, col0 + 8 * g, v0, v1, v2, v3, d_v, bf16)


def slice_shape(n_rows: int, n: int):
    """``(heads, column parts)`` of one CTA's merge slice: ``n_rows / n`` whole heads when ``n``
    divides ``n_rows``; when ``n_rows`` divides ``n`` (more CTAs than heads, e.g. the narrow
    kernel's 8 heads over 16 CTAs) one head each, a ``1 / (n / n_rows)`` share of its columns;
    else ``ceil(n_rows / n)`` heads, fewer in the last CTAs (64 heads over 6 CTAs: 11, 11, 11,
    11, 11, 9)."""
    if n_rows % n == 0:
        return n_rows // n, 1
    if n % n_rows == 0:
        return 1, n // n_rows
    return -(-n_rows // n), 1


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1)


def merge_threads(n_rows: int, n: int, d_v: int, bf16: bool, max_threads: int) -> int:
    """Threads :func:`merge_slice` runs on for ``n_rows`` heads over ``n`` CTAs: the slice's heads
    (:func:`slice_shape`), each on as many threads as its slice has 16-byte chunks per row (at
    most -- a power of two, so that it divides them --, and at least ``n`` and a whole number of
    warps), within ``max_threads`` (e.g. 3 heads of the narrow kernel's 24 over 8 CTAs: 64
    threads each; half of one of its 8 heads over 16 CTAs: 32)."""
    hp, cp = slice_shape(n_rows, n)
    chunks = d_v // (8 if bf16 else 4) // cp
    tph = _pow2_floor(min(chunks, max_threads // hp))  # (a power of two already unless hp is not one)
    threads = -(-tph * hp // 32) * 32  # whole warps (an uneven slice's last warp may idle in part)
    assert tph >= n and chunks % tph == 0 and threads <= max_threads, (n_rows, n, tph)
    assert n_rows % n or threads == tph * hp
    return threads


@cute.jit
def merge_slice(
    x_addr: Int32,
    stats_addr: Int32,
    rank: Int32,
    n: cutlass.Constexpr,
    n_rows: cutlass.Constexpr,
    d_v: cutlass.Constexpr,
    bf16: cutlass.Constexpr,
    tid: Int32,
    n_threads: cutlass.Constexpr,
    mOut: cute.Tensor,
    mLse: cute.Tensor,
    mML: cute.Tensor,
    mSink: cute.Tensor,
    flags: Int32,
    token: Int32,
    head0: Int32,
    h_q: Int32,
):
    """Merge heads ``rank * n_rows / n ..`` (``n_rows / n`` of them; with more CTAs than heads,
    columns part ``rank % cp`` of head ``rank // cp``, :func:`slice_shape`) of the row from the
    ``n`` CTAs' staged partials (after the first cluster barrier) into ``mOut [T, h_q, d_v]`` bf16,
    ``mLse`` / ``mML [T, h_q]`` float32 (flat offsets: ``(token * h_q + head0 + row) * d_v``; the
    lse and max logit by the column part 0).

    ``n_threads / (n_rows / n)`` threads per head (a power of two, at least ``n``): the first
    ``n`` lanes of each head's lane segment read the peers' lse (lane ``j`` from CTA ``j``), the
    segment reduces them by shuffles, and each thread then reads its 16-byte chunks of every
    peer's row (chunk ``j + k * threads_per_head``: a warp reads contiguous bytes), weights them
    and stores its bf16 columns."""
    hp, cp = slice_shape(n_rows, n)  # heads merged by this CTA (at most), CTAs per head
    uneven = n_rows % n != 0 and n % n_rows != 0
    tph = _pow2_floor(n_threads // hp)  # threads per head
    assert (tph * hp == n_threads or uneven) and tph >= n
    seg = min(tph, 32)  # lanes of one head within a warp
    vec = 8 if cutlass.const_expr(bf16) else 4  # elements per 16-byte chunk
    chunks = d_v // vec // cp  # of this CTA's slice of a row
    cpt = chunks // tph  # chunks per thread
    assert cpt * tph == chunks
    stride = row_stride_bytes(d_v, bf16)

    hl = tid // tph
    j = tid % tph
    valid = True
    if cutlass.const_expr(cp > 1):
        row = rank // cp
        j = j + (rank % cp) * chunks  # the slice's first chunk of the row, plus this thread's
    elif cutlass.const_expr(uneven):
        # the last CTAs hold fewer heads, and the last warp may run past the slice: such threads
        # read a valid row (every lane takes part in the segment's shuffles) and store nothing
        row = rank * hp + hl
        valid = (hl < hp) & (row < n_rows)
        row = cutlass.min(row, Int32(n_rows - 1))
    else:
        row = rank * hp + hl
    lane = tid % 32
    s = lane % seg
    seg_base = lane - s

    # ---- the peers' lse of this head: lane s < n reads CTA s's, the segment reduces (log2 units)
    x = Float32(-math.inf)
    ml = Float32(-math.inf)
    if s < n:
        x = dev.ld_cluster_f32(dev.mapa_shared(stats_addr + 4 * row, s))
        ml = dev.ld_cluster_f32(dev.mapa_shared(stats_addr + 4 * (n_rows + row), s))
    xl = Float32(cutlass.select_(x < Float32(math.inf), x * dev.LOG2E, Float32(-math.inf)))
    m = xl
    for off in bfly_offsets(seg):
        m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=off))
        ml = cute.arch.fmax(ml, cute.arch.shuffle_sync_bfly(ml, offset=off))
    m_safe = Float32(cutlass.select_(m > Float32(-math.inf), m, Float32(0.0)))
    e = cute.math.exp2(xl - m_safe, fastmath=True)
    tot = e
    for off in bfly_offsets(seg):
        tot = tot + cute.arch.shuffle_sync_bfly(tot, offset=off)
    nonempty = tot > Float32(0.0)
    lse2 = Float32(cutlass.select_(nonempty, m_safe + cute.math.log2(tot, fastmath=False), Float32(math.inf)))
    w_own = cute.math.exp2(xl - lse2, fastmath=True)  # this lane's peer's weight (0 if empty)

    # ---- the weighted sum over the peers, in split order --------------------------------------
    acc = cute.make_rmem_tensor((cpt * vec,), Float32)
    acc.fill(0.0)
    local = x_addr + row * stride + j * 16
    for p in cutlass.range_constexpr(n):
        w = cute.arch.shuffle_sync(w_own, offset=seg_base + p)
        base = dev.mapa_shared(local, Int32(p))
        for k in cutlass.range_constexpr(cpt):
            if cutlass.const_expr(bf16):
                v = dev.ld_cluster_v4_bf16x2_f32(base + k * tph * 16)
            else:
                v = dev.ld_cluster_v4_f32(base + k * tph * 16)
            for q in cutlass.range_constexpr(vec):
                acc[k * vec + q] = acc[k * vec + q] + Float32(cutlass.select_(w > Float32(0.0), w * v[q],
                                                                              Float32(0.0)))

    lse = lse2 * dev.LN2  # +inf stays +inf
    head = head0 + row
    if dp.flag(flags, dp.F_SINK):
        sink = mSink[head]
        f = Float32(1.0) / (Float32(1.0) + cute.math.exp2((sink - lse) * dev.LOG2E, fastmath=True))
        f = Float32(cutlass.select_(nonempty, f, Float32(0.0)))
        for i in cutlass.range_constexpr(cpt * vec):
            acc[i] = acc[i] * f
    if cutlass.const_expr(uneven):
        if valid:
            _store_slice(acc, mOut, mLse, mML, flags, token, head, h_q, d_v, bf16, j, tph, cpt, vec, lse, ml)
    else:
        _store_slice(acc, mOut, mLse, mML, flags, token, head, h_q, d_v, bf16, j, tph, cpt, vec, lse, ml)


@cute.jit
def _store_slice(acc, mOut: cute.Tensor, mLse: cute.Tensor, mML: cute.Tensor, flags: Int32, token: Int32, head: Int32,
                 h_q: Int32, d_v: cutlass.Constexpr, bf16: cutlass.Constexpr, j: Int32, tph: cutlass.Constexpr,
                 cpt: cutlass.Constexpr, vec: cutlass.Constexpr, lse: Float32, ml: Float32):
    """A merging thread's bf16 output columns of ``head`` (and, thread 0 of the head, its lse and
    max logit)."""
    out_row = (Int64(token) * h_q + head) * d_v
    o_addr = dev.gmem_addr_i64(mOut.iterator) + out_row * 2
    for k in cutlass.range_constexpr(cpt):
        col = (j + k * tph) * vec
        a = o_addr + col * 2
        if cutlass.const_expr(bf16):
            dev.st_global_v4_b32(a, dev.pack_bf16x2(acc[k * vec], acc[k * vec + 1]),
                                 dev.pack_bf16x2(acc[k * vec + 2], acc[k * vec + 3]),
                                 dev.pack_bf16x2(acc[k * vec + 4], acc[k * vec + 5]),
                                 dev.pack_bf16x2(acc[k * vec + 6], acc[k * vec + 7]))
        else:
            dev.st_global_v2_b32(a, dev.pack_bf16x2(acc[k * vec], acc[k * vec + 1]),
                                 dev.pack_bf16x2(acc[k * vec + 2], acc[k * vec + 3]))
    if j == 0:  # (with column parts: part 0's first thread)
        off_l = Int64(token) * h_q + head
        dp.store_f32(mLse, off_l, lse)
        if dp.flag(flags, dp.F_MAX_LOGITS):
            dp.store_f32(mML, off_l, ml)
