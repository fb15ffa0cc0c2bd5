"""CuTe DSL device helpers of the indexer kernels (scores, top-k, loss).

* :func:`quad_reduce_scatter` -- sums per-lane partial values over the 4 lanes of a quad of a
  wgmma accumulator fragment (the lanes that share a row), leaving each lane a quarter of them;
* :func:`weighted_relu_rows` -- ``sum_c w[c] * relu(acc[row, c])`` over column groups of a
  64 x N accumulator fragment (the indexer's head reduction);
* :func:`ordered_key` -- a float32 as a uint32 whose unsigned order is the float order (NaN as
  -inf, -0 as +0): the radix top-k's key;
* :func:`block_exclusive_sum` -- exclusive prefix sum of one Int32 per thread over a CTA;
* :func:`f32_bits` / :func:`u32_as_f32` -- bit casts;
* :func:`red_add_v2_bf16x2` -- 8-byte bf16 atomic adds (the loss backward's ``red_bf16`` dk);
* :func:`f32_to_fixed` / :func:`red_add_u64` / :func:`bulk_reduce_add_u64` -- the deterministic
  loss backward's fixed-point dk: a float32 scaled to a signed 64-bit integer, and 64-bit integer
  additions into global memory (integer addition is associative, so the sum does not depend on
  the order the additions arrive in).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .device import acc_flat, butterfly_reduce_scatter


@dsl_user_op
def f32_bits(x: Float32, *, loc=None, ip=None) -> Uint32:
    """The bit pattern of a float32."""
    return Uint32(llvm.inline_asm(T.i32(), [Float32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,f",
                                  has_side_effects=False, is_align_stack=False,
                                  asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def u32_as_f32(x: Uint32, *, loc=None, ip=None) -> Float32:
    """The float32 with bit pattern ``x``."""
    return Float32(llvm.inline_asm(T.f32(), [Uint32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=f,r",
                                   has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def f32_to_fixed(x: Float32, scale: Float32, *, loc=None, ip=None) -> Int64:
    """``round(x * scale)`` as a signed 64-bit integer (``cvt.rni.s64.f32``: round to nearest
    even, saturating; NaN gives 0).  ``scale`` a power of two, so ``x * scale`` is exact."""
    y = Float32(x) * Float32(scale)
    return Int64(llvm.inline_asm(T.i64(), [y.ir_value(loc=loc, ip=ip)], "cvt.rni.s64.f32 $0, $1;", "=l,f",
                                 has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def red_add_u64(gmem_addr: Int64, v: Int64, *, loc=None, ip=None) -> None:
    """``red.global.add.u64``: one 8-byte integer atomic add (two's complement: signed values
    add correctly, wrapping modulo 2^64), no return value."""
    llvm.inline_asm(None, [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Int64(v).ir_value(loc=loc, ip=ip)],
                    "red.global.add.u64 [$0], $1;", "l,l", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def bulk_reduce_add_u64(gmem_addr: Int64, smem_addr: Int32, nbytes: Int32, policy: Int64, *, loc=None,
                        ip=None) -> None:
    """TMA bulk reduction ``global[gmem_addr : +nbytes] += shared[smem_addr : +nbytes]`` in 64-bit
    integers (``cp.reduce.async.bulk ... .add.u64``, L2 cache-policy hint; ``nbytes`` a multiple of
    16, both addresses 16-byte aligned).  Asynchronous: commit the bulk group and wait (``.read``)
    before the source is overwritten."""
    llvm.inline_asm(
        None,
        [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Int32(smem_addr).ir_value(loc=loc, ip=ip),
         Int32(nbytes).ir_value(loc=loc, ip=ip), Int64(policy).ir_value(loc=loc, ip=ip)],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.u64 [$0], [$1], $2, $3;",
        "l,r,r,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def red_add_v2_bf16x2(gmem_addr: Int64, lo: Uint32, hi: Uint32, *, loc=None, ip=None) -> None:
    """``red.global.add.noftz.v2.bf16x2``: one 8-byte atomic add of four bf16 (two packed words,
    :func:`~mla_kernels.common.device.pack_bf16x2`), no return value (sm_90+).  Each addition
    rounds the stored sum to bf16."""
    llvm.inline_asm(None, [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Uint32(lo).ir_value(loc=loc, ip=ip),
                           Uint32(hi).ir_value(loc=loc, ip=ip)],
                    "red.global.add.noftz.v2.bf16x2 [$0], {$1, $2};", "l,r,r", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def _pure_asm(ret_type, operand, ptx: str, constraints: str, loc, ip):
    """One value from one operand by side-effect-free inline PTX (``$0`` the result, ``$1`` the
    operand)."""
    return llvm.inline_asm(ret_type, [operand.ir_value(loc=loc, ip=ip)], ptx, constraints, has_side_effects=False,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def ordered_key(x: Float32, *, loc=None, ip=None) -> Uint32:
    """``x`` as a uint32 key whose unsigned order is the float order.  NaN maps to the key of
    -inf (it ranks below every number) and -0.0 to the key of +0.0 (they compare equal).

    Four instructions, three of them on the ALU pipe (the select kernel's passes are bound by
    it): ``max.f32 x, -inf`` (NaN -> -inf: ``max`` returns the operand that is not NaN),
    ``add.rn.f32 +0`` on the FMA pipe (-0 -> +0; no ``.ftz``: subnormals keep their keys), then
    ``bits ^ ((bits >> 31, arithmetic) | 0x80000000)`` (a shift and one ``LOP3``): negative
    numbers get their bits inverted, the others the sign bit set."""
    return Uint32(_pure_asm(
        T.i32(), Float32(x),
        "{\n.reg .f32 y;\n.reg .b32 b, s;\nmax.f32 y, $1, 0fFF800000;\nadd.rn.f32 y, y, 0f00000000;\n"
        "mov.b32 b, y;\nshr.s32 s, b, 31;\nor.b32 s, s, 0x80000000;\nxor.b32 $0, b, s;\n}", "=r,f", loc, ip))


@dsl_user_op
def key_float(key: Uint32, *, loc=None, ip=None) -> Float32:
    """The inverse of :func:`ordered_key`: the float whose key is ``key``, with one exception:
    NaN where that float would be a NaN (``key`` at or above the key of the first NaN past +inf,
    or below the key of -inf)."""
    return Float32(_pure_asm(
        T.f32(), Uint32(key),
        "{\n.reg .b32 s;\nnot.b32 s, $1;\nshr.s32 s, s, 31;\nor.b32 s, s, 0x80000000;\nxor.b32 s, $1, s;\n"
        "mov.b32 $0, s;\n}", "=f,r", loc, ip))


@dsl_user_op
def no_nan(x: Float32, *, loc=None, ip=None) -> Float32:
    """``max.f32 x, -inf``: NaN -> -inf, every other value unchanged (one instruction)."""
    return Float32(_pure_asm(T.f32(), Float32(x), "max.f32 $0, $1, 0fFF800000;", "=f,f", loc, ip))


def bin_bounds(prefix: Uint32, shift: int):
    """The float range of the keys whose top bits (``key >> shift``) equal ``prefix``:
    ``(lo, hi)`` such that for every float ``x``, with ``y = no_nan(x)``,
    ``key >> shift > prefix`` iff ``y >= hi`` and ``key >> shift == prefix`` iff
    ``y >= lo and not y >= hi`` (``key = ordered_key(x)``; ordered compares).  ``hi`` is NaN when
    no float is above the bin (nothing compares ``>=`` to it, and ``y < hi`` is false too: hence
    "not ``>=``"), ``lo`` is -inf for the bin of -inf."""
    lo = no_nan(key_float(prefix << Uint32(shift)))
    hi = key_float((prefix + Uint32(1)) << Uint32(shift))
    return lo, hi


def quad_reduce_scatter(vals: cute.Tensor, n: int, lane: Int32) -> None:
    """Sum ``vals[0:n]`` (``n`` a multiple of 4) over the 4 lanes of this lane's quad
    (``lane ^ 1``, ``lane ^ 2``) by a reduce-scatter: afterwards lane ``q = lane % 4`` holds the
    sums of the original elements ``[q n/4, (q+1) n/4)`` in ``vals[0:n/4]``.  ``3n/4`` shuffles
    instead of ``2n``.  All lanes call it."""
    butterfly_reduce_scatter(vals, n, lane, (2, 1))


def _split_sums(terms, parts: int):
    """Sum a list of ``(w, x)`` as ``sum w * x`` in ``parts`` independent FMA chains (term ``i``
    into chain ``i % parts``), then a pairwise tree over the chains: ``parts`` times the
    instruction-level parallelism of one serial chain, for a few more instructions (``parts=1``:
    the serial chain, its first term a plain product)."""
    chains = [None] * parts
    for i, (w, x) in enumerate(terms):
        c = i % parts
        chains[c] = w * x if chains[c] is None else chains[c] + w * x
    chains = [c for c in chains if c is not None]
    while len(chains) > 1:
        chains = [chains[i] + chains[i + 1] if i + 1 < len(chains) else chains[i] for i in range(0, len(chains), 2)]
    return chains[0] if chains else Float32(0.0)


#: Independent FMA chains per row sum of :func:`weighted_relu_rows` / :func:`weighted_relu_rows_reg`
#: (1: the serial chain; 2 and 4 measured no clear gain end to end on an H200, see docs/PERF.md).
SUM_PARTS = 1


def weighted_relu_rows(acc: cute.Tensor, sW: cute.Tensor, w_off: Int32, col0: int, n_cols: int,
                       lane_quad: Int32, parts: int = SUM_PARTS):
    """``(row 0 sum, row 1 sum)`` of ``sW[w_off + c] * relu(acc[row, c])`` over this thread's
    columns ``c`` in ``[col0, col0 + n_cols)`` (``col0``, ``n_cols`` multiples of 8) of a wgmma
    accumulator fragment, each in ``parts`` FMA chains (:func:`_split_sums`).  Partial: the
    quad's 4 lanes hold disjoint columns."""
    t0, t1 = [], []
    for g in range(col0 // 8, (col0 + n_cols) // 8):
        for v0 in range(2):
            w = sW[w_off + 8 * g + 2 * lane_quad + v0]
            t0.append((w, cute.arch.fmax(acc[acc_flat(v0, 0, g)], Float32(0.0))))
            t1.append((w, cute.arch.fmax(acc[acc_flat(v0, 1, g)], Float32(0.0))))
    return _split_sums(t0, parts), _split_sums(t1, parts)


def load_weight_cols(rW: cute.Tensor, sW: cute.Tensor, w_off: Int32, n_cols: int, lane_quad: Int32) -> None:
    """``rW[2 g + v] = sW[w_off + 8 g + 2 lane_quad + v]``: this thread's columns of an
    ``n_cols``-column wgmma accumulator fragment, for :func:`weighted_relu_rows_reg`."""
    for g in range(n_cols // 8):
        for v0 in range(2):
            rW[2 * g + v0] = sW[w_off + 8 * g + 2 * lane_quad + v0]


def weighted_relu_rows_reg(acc: cute.Tensor, rW: cute.Tensor, col0: int, n_cols: int, parts: int = SUM_PARTS):
    """:func:`weighted_relu_rows` with the weights already in registers (``rW`` from
    :func:`load_weight_cols`): no shared-memory loads per tile."""
    t0, t1 = [], []
    for g in range(col0 // 8, (col0 + n_cols) // 8):
        for v0 in range(2):
            w = rW[2 * g + v0]
            t0.append((w, cute.arch.fmax(acc[acc_flat(v0, 0, g)], Float32(0.0))))
            t1.append((w, cute.arch.fmax(acc[acc_flat(v0, 1, g)], Float32(0.0))))
    return _split_sums(t0, parts), _split_sums(t1, parts)


@dsl_user_op
def relu_pack_bf16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """``(ReLU(lo), ReLU(hi))`` rounded to bf16 in one word (``lo`` in the low half):
    ``cvt.rn.relu.bf16x2.f32``, one instruction for two scores."""
    return Uint32(llvm.inline_asm(T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
                                  "cvt.rn.relu.bf16x2.f32 $0, $1, $2;", "=r,f,f", has_side_effects=False,
                                  is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def fma_bf16x2(a: Uint32, b: Uint32, c: Uint32, *, loc=None, ip=None) -> Uint32:
    """``a * b + c`` on two packed bf16 (``fma.rn.bf16x2``: each half rounded to bf16)."""
    return Uint32(llvm.inline_asm(T.i32(), [Uint32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c)],
                                  "fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", has_side_effects=False,
                                  is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def bf16x2_sum(x: Uint32) -> Float32:
    """The sum of the two bf16 halves of ``x`` in float32 (exact widening, one rounding)."""
    return u32_as_f32(x << Uint32(16)) + u32_as_f32(x & Uint32(0xFFFF0000))


def load_weight_pairs(rWp: cute.Tensor, rW: cute.Tensor, n_pairs: int) -> None:
    """``rWp[g] = bf16x2(rW[2 g], rW[2 g + 1])``: the weights of :func:`load_weight_cols` packed for
    :func:`weighted_relu_rows_bf16x2`."""
    from .device import pack_bf16x2

    for g in range(n_pairs):
        rWp[g] = pack_bf16x2(rW[2 * g], rW[2 * g + 1])


def weighted_relu_rows_bf16x2(acc: cute.Tensor, rWp: cute.Tensor, col0: int, n_cols: int):
    """:func:`weighted_relu_rows_reg` in packed bf16 (an opt-in of the score kernel): per pair of
    adjacent columns one ``cvt.rn.relu.bf16x2.f32`` and one ``fma.rn.bf16x2`` against the packed
    weights (:func:`load_weight_pairs`), the ``n_cols / 8`` pair products of a row accumulated in
    one bf16x2 word, its two halves summed in float32 -- about 9 instructions per 16 scores instead
    of 32, at bf16 rounding of ReLU(S), the weights and the running sums (~2^-9 relative each)."""
    out = []
    for row in range(2):
        s = None
        for g in range(col0 // 8, (col0 + n_cols) // 8):
            x = relu_pack_bf16x2(acc[acc_flat(0, row, g)], acc[acc_flat(1, row, g)])
            s = fma_bf16x2(x, rWp[g], Uint32(0x80008000) if s is None else s)  # c = (-0, -0): exact product
        out.append(bf16x2_sum(s))
    return out[0], out[1]


def warp_inclusive_sum(x: Int32, lane: Int32) -> Int32:
    """Inclusive prefix sum of ``x`` over the lanes of a warp (5 shuffles)."""
    for off in (1, 2, 4, 8, 16):
        y = cute.arch.shuffle_sync_up(x, offset=off)
        x = x + Int32(cutlass.select_(lane >= off, y, Int32(0)))
    return x


@cute.jit
def block_exclusive_sum(x: Int32, sScratch: cute.Tensor, tidx: Int32, n_warps: cutlass.Constexpr,
                        barrier_id: cutlass.Constexpr, n_threads: cutlass.Constexpr):
    """``(exclusive prefix of x over threads 0..tidx-1, total)`` over ``n_threads`` threads
    (``n_warps`` warps, ``n_warps <= 32``).  ``sScratch`` holds ``n_warps`` Int32; two named
    barriers (``barrier_id``) are used, so the scratch may be reused after the call."""
    lane = tidx % 32
    warp = tidx // 32
    inc = warp_inclusive_sum(x, lane)
    if lane == 31:
        sScratch[warp] = inc
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=n_threads)
    before = Int32(0)
    total = Int32(0)
    for w in cutlass.range_constexpr(n_warps):
        v = sScratch[w]
        before = before + Int32(cutlass.select_(Int32(w) < warp, v, Int32(0)))
        total = total + v
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=n_threads)
    return before + inc - x, total


@cute.jit
def block_reduce(x: Float32, is_max: cutlass.Constexpr, sRed: cute.Tensor, tidx: Int32, n_warps: cutlass.Constexpr,
                 barrier_id: cutlass.Constexpr) -> Float32:
    """Sum (or max) of ``x`` over the ``32 n_warps`` threads; every thread gets the result.
    ``sRed`` holds ``n_warps`` floats; two named barriers, so it may be reused after the call."""
    for off in cutlass.range_constexpr(5):
        y = cute.arch.shuffle_sync_bfly(x, offset=16 >> off)
        if const_expr(is_max):
            x = cute.arch.fmax(x, y)
        else:
            x = x + y
    if tidx % 32 == 0:
        sRed[tidx // 32] = x
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=32 * n_warps)
    r = sRed[0]
    for w in cutlass.range_constexpr(1, n_warps):
        if const_expr(is_max):
            r = cute.arch.fmax(r, sRed[w])
        else:
            r = r + sRed[w]
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=32 * n_warps)
    return r


class SparseKeyRing:
    """The selected key rows of one query, 64 slots per block, through a ring of ``stages`` smem
    buffers filled by ``cp.async`` from all 128 threads of a warpgroup
    (:class:`~mla_kernels.common.gather.KvGather`: invalid slots zero-filled, the K-major SW128
    layout wgmma reads).  Completion is tracked with cp.async groups: one group per block, always
    committed (empty past the last block) so that ``wait`` can keep ``stages - 1`` in flight.

    ``prefetch``: the indices of the next block are loaded (into a second register slot) when a
    block is issued, so that a block's ``cp.async`` addresses are ready when it is issued instead
    of waiting for the index loads (the first version: index load, then the dependent copies).
    Blocks must then be issued in order from :meth:`start`'s block 0.

    ``rot`` (a dynamic Int32 in ``[0, num_blocks)``, with ``num_blocks``): block ``b`` of the
    issue order is the row's slot block :meth:`phys` ``(b) = (b + rot) mod num_blocks`` -- the
    same blocks in a rotated order (stages still in issue order)."""

    def __init__(self, mK, mIdx, t, topk_len, tidx, d: int, stages: int, base_addr: Int32, prefetch: bool = True,
                 rot=None, num_blocks=None):
        from .gather import KvGather

        self.rot = rot
        self.nb = num_blocks
        self.prefetch = prefetch
        self.gather = KvGather(mK, mIdx, t, topk_len, tidx, d, slots=2 if prefetch else 1)
        self.stages = stages
        self.base = base_addr
        self.stage_bytes = 64 * d * 2
        self.n_tiles = d // 64

    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    def phys(self, block):
        """The slot block that issue-order block ``block`` reads (itself without ``rot``; past
        the last block a harmless one: clamped slots or a block loaded and not copied)."""
        if self.rot is None:
            return block
        p = block + self.rot
        return Int32(cutlass.select_(p >= self.nb, p - self.nb, p))

    @cute.jit
    def start(self) -> None:
        """With ``prefetch``: load block 0's indices (call once, before the first :meth:`issue`)."""
        if const_expr(self.prefetch):
            self.gather.load_indices(self.phys(Int32(0)), 1)

    @cute.jit
    def issue(self, block: Int32, num_blocks: Int32) -> None:
        """cp.async block ``block`` into stage ``block % stages`` (nothing past the last block),
        then commit a group.  With ``prefetch`` blocks come in order: ``block``'s indices were
        loaded by the previous call (or :meth:`start`); the next block's are loaded now (a slot
        past ``topk`` reads a clamped index and is invalid: harmless past the last block)."""
        if const_expr(self.prefetch):
            g = self.gather
            for j in cutlass.range_constexpr(g.rows_per_thread):
                g.src[0, j] = g.src[1, j]
                g.ok[0, j] = g.ok[1, j]
            g.load_indices(self.phys(block + 1), 1)
            if block < num_blocks:
                g.copy_tiles(self.base + (block % self.stages) * self.stage_bytes, 0, 0, self.n_tiles)
        else:
            if block < num_blocks:
                self.gather.load_indices(self.phys(block), 0)
                self.gather.copy_tiles(self.base + (block % self.stages) * self.stage_bytes, 0, 0, self.n_tiles)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def wait(self, barrier_id: cutlass.Constexpr) -> None:
        """The oldest outstanding block has landed for every thread and is visible to wgmma."""
        cute.arch.cp_async_wait_group(self.stages - 1)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)



class SparseKeyRingRaw(SparseKeyRing):
    """:class:`SparseKeyRing` whose one-block-ahead index loads are consumed one issue later.

    :class:`SparseKeyRing` with ``prefetch`` loads the next block's indices when it issues a block,
    but forms their validity flags and source addresses right after the loads, in the same issue:
    the thread waits there for the loads (Nsight Compute, H100, S 32k: the loss forward's largest
    stall, 23% of its warp samples, at the ``ISETP`` of that validity check).  Here an issue only
    *loads* the next block's raw indices (:meth:`KvGather.fetch_raw`, one Int32 register per row of
    the thread) and the next issue turns them into flags and addresses
    (:meth:`KvGather.indices_from_raw`) just before its copies: a block of work lies between a
    load and its first use.  The same copies from the same addresses (bitwise the same smem
    tiles), in the same issue order (``rot`` as in :class:`SparseKeyRing`).

    ``slots`` (1 or 2) register slots of raw indices: with 1 the loop carries them from one
    iteration to the next (ptxas then copies the loaded registers at the loop's end, which waits
    for the loads there); with 2 a loop unrolled by two issues alternately from slot 0 and slot 1
    (``slot`` of :meth:`issue`, a constant: block ``b`` in slot ``b % 2``) and nothing is copied."""

    def __init__(self, mK, mIdx, t, topk_len, tidx, d: int, stages: int, base_addr: Int32, rot=None, num_blocks=None,
                 slots: int = 1):
        assert slots in (1, 2)
        # (the parent's ``prefetch`` only sizes the gather's address slots here: one per raw slot)
        super().__init__(mK, mIdx, t, topk_len, tidx, d, stages, base_addr, slots == 2, rot, num_blocks)
        self.slots = slots
        self.raw = cute.make_rmem_tensor((slots * self.gather.rows_per_thread,), Int32)

    @cute.jit
    def start(self) -> None:
        """Load block 0's raw indices into slot 0 (call once, before the first :meth:`issue`)."""
        self.gather.fetch_raw(self.raw, self.phys(Int32(0)), 0)

    @cute.jit
    def issue(self, block: Int32, num_blocks: Int32, slot: cutlass.Constexpr = 0) -> None:
        """cp.async block ``block`` (flags and addresses from the raw indices in ``slot``, loaded by
        the previous call) into stage ``block % stages`` (nothing past the last block), load the
        raw indices of block ``block + 1`` into the other slot (a clamped slot past ``topk``:
        invalidated when it is used), then commit a group.  Blocks come in order from 0; with 2
        slots block ``b`` must be issued with ``slot = b % 2``."""
        g = self.gather
        g.indices_from_raw(self.raw, self.phys(block), slot)
        g.fetch_raw(self.raw, self.phys(block + 1), (slot + 1) % self.slots)
        if block < num_blocks:
            g.copy_tiles(self.base + (block % self.stages) * self.stage_bytes, slot, 0, self.n_tiles)
        cute.arch.cp_async_commit_group()


def kl_terms(x: Float32, tg: Float32, ok, tsum: Float32, a: Float32, b: Float32, c: Float32):
    """One slot's contribution to the loss forward's running sums (``ok``: the slot is valid, ``x``
    its logit, ``tg`` its target): ``tsum += tg`` (valid slots), and over the valid slots with
    ``tg > 0``: ``a += tg log tg``, ``b += tg x``, ``c += tg``.  Then with ``inv = 1 / tsum``
    ``sum_{p > 0} p (log p - x + lse) = inv (a - b) + inv c (log inv + lse)`` (``p = tg inv``)."""
    tg_v = Float32(cutlass.select_(ok, tg, Float32(0.0)))
    pos = tg_v > Float32(0.0)
    tg_p = Float32(cutlass.select_(pos, tg_v, Float32(0.0)))
    lg = cute.math.log(Float32(cutlass.select_(pos, tg_v, Float32(1.0))))
    xs = Float32(cutlass.select_(pos, x, Float32(0.0)))  # x may be -inf only where ok is false
    return tsum + tg_v, a + tg_p * lg, b + tg_p * xs, c + tg_p


def online_lse_update(m: Float32, e: Float32, x0: Float32, x1: Float32):
    """``(m, e)`` with ``e = sum exp(x - m)`` over the logits seen so far (``m`` their max, ``-inf``
    and ``e = 0`` before any finite one) updated by two more logits (``-inf`` for invalid slots)."""
    mn = cute.arch.fmax(m, cute.arch.fmax(x0, x1))
    ms = Float32(cutlass.select_(mn == Float32(-math.inf), Float32(0.0), mn))
    e = e * cute.math.exp(m - ms) + cute.math.exp(x0 - ms) + cute.math.exp(x1 - ms)
    return mn, e
