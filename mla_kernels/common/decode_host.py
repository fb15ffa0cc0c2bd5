"""The host side of the decode kernels: their argument contract (fake tensors for compile-only
tracing), compiled-kernel lookup and the launch sequence of one decode step.

Argument contract of a decode kernel (``sm90/decode.py``, ``sm90/decode_narrow.py``)::

    (q [b, s_q, h_q, d_qk] bf16, q_bias [b|1, h_q, d_qk] bf16, kv_cache [pages, page_size, 1, d_qk] bf16,
     indices [b, s_q, topk] i32, block_table [b|1, max_pages] i32, topk_length [b | b*s_q | 1] i32,
     attn_sink [h_q | 1] f32, out, lse, max_logits, scale_log2 f32, flags i32, page_size i32,
     page_mul i32, page_shift i32, tl_stride_b i32, tl_stride_s i32, n_splits i32, blocks_per_split i32,
     stream)

``(page_mul, page_shift)`` is :func:`page_divisor` of ``max(page_size, 1)``: with
``MLA_KERNELS_DECODE_PAGEDIV=magic`` the kernels divide a position by the page size with a
multiply-high, an add and a shift (the default kernels ignore them).

``out`` is ``[n_splits, b*s_q, h_q, d_v]`` float32 or bf16 (split mode; ``MLA_KERNELS_DECODE_PARTS``) or ``[b, s_q, h_q, d_v]`` bf16
(direct mode); ``lse`` / ``max_logits`` ``[n_splits, b*s_q, h_q]`` or ``[b, s_q, h_q]`` float32.
The fused split kernels (the combine folded in: ``common/decode_device.py``) take four more
after ``max_logits``: the merged ``out [b, s_q, h_q, d_v]`` bf16, ``lse`` and ``max_logits
[b, s_q, h_q]`` float32 and the plan's arrival counters ``[rows]`` int32 (zero between launches;
the kernel that uses them resets them).
Absent optional inputs are small cached placeholders with the flag bit cleared
(``common/decode_parts.F_*``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import fastpath, host

D_V = 512

# Runtime flag bits of the decode kernels' ``flags`` argument (read by ``decode_parts``).
F_BIAS = 1
F_BLOCK_TABLE = 2
F_TOPK_LENGTH = 4
F_SINK = 8
F_MAX_LOGITS = 16


def decode_fake_args(d_qk: int, h_q: int, split: bool, fused: bool = False, parts_bf16: bool = False):
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    b, s_q, nb, pages, psz, b2, s2, topk, nbt, maxp, ntl, ns = (cute.sym_int() for _ in range(12))
    o0, o1, l0, l1, m0, m1 = (cute.sym_int() for _ in range(6))
    o_dtype = Float32 if split and not parts_bf16 else BFloat16
    tail = ()
    if fused:
        f0, f1, g0, g1, k0, k1, nc = (cute.sym_int() for _ in range(7))
        tail = (
            host.fake(BFloat16, (f0, f1, h_q, D_V)),
            host.fake(Float32, (g0, g1, h_q), align=4),
            host.fake(Float32, (k0, k1, h_q), align=4),
            host.fake(Int32, (nc,), align=4),
        )
    return (
        host.fake(BFloat16, (b, s_q, h_q, d_qk)),
        host.fake(BFloat16, (nb, h_q, d_qk)),
        host.fake(BFloat16, (pages, psz, 1, d_qk)),
        host.fake(Int32, (b2, s2, topk), align=4),
        host.fake(Int32, (nbt, maxp), align=4),
        host.fake(Int32, (ntl,), align=4),
        host.fake(Float32, (ns,), align=4),
        host.fake(o_dtype, (o0, o1, h_q, D_V)),
        host.fake(Float32, (l0, l1, h_q), align=4),
        host.fake(Float32, (m0, m1, h_q), align=4),
        *tail,
        Float32(1.0),
        Int32(0),
        Int32(1),
        Int32(1),
        Int32(0),
        Int32(1),
        Int32(0),
        Int32(1),
        Int32(1),
        host.fake_stream(),
    )


def compile_decode_kernel(kernel, d_qk: int, h_q: int, split: bool, arch: str, fused: bool = False,
                          pagediv: Optional[str] = None, o_bulk: Optional[bool] = None,
                          ring_alt: Optional[bool] = None, rows: Optional[int] = None,
                          pair_cluster: Optional[bool] = None, **kw):
    """Compile ``kernel`` over the decode contract's fake tensors; ``pagediv`` (``"generic"`` /
    ``"magic"``, default: the kernel's own, ``"generic"``): how its paged gather divides a position
    by the page size (:func:`page_div_mode`); ``o_bulk``: direct mode's O by bulk copies (default:
    the kernel's own); ``ring_alt``: the alternating KV ring (default: :func:`ring_for`'s rule for
    the kernel's mode); ``rows``: heads per CTA of the 64-head kernel in a DSMEM cluster merge
    (64, or 32: :func:`cluster_rows`); ``pair_cluster``: direct mode's token pairs of 64-head CTAs
    launched as 2-CTA clusters (:func:`decode_pair_mode`).  An option the kernel does not have is a
    ValueError."""
    from .. import _compile

    if pagediv is not None and pagediv not in PAGEDIV_MODES:
        raise ValueError(f"pagediv={pagediv!r}: expected one of {', '.join(PAGEDIV_MODES)}")
    if ring_alt is None and hasattr(kernel, "ring_alt"):
        ring_alt = ring_for(DEFAULT_RING, kernel.split) == "alt"
    for name, value in (("pagediv", pagediv), ("o_bulk", o_bulk), ("ring_alt", ring_alt), ("rows", rows),
                        ("pair_cluster", pair_cluster)):
        if value is None:  # the kernel's own default
            continue
        if not hasattr(kernel, name):
            raise ValueError(f"{type(kernel).__name__} has no {name} option")
        setattr(kernel, name, value if name in ("pagediv", "rows") else bool(value))
    if rows is not None and (rows not in (32, 64) or (rows == 32 and not getattr(kernel, "cluster_dsmem", False))):
        raise ValueError(f"rows={rows}: 64, or 32 with a DSMEM cluster merge")
    if pair_cluster and (split or getattr(kernel, "cluster", 0) or h_q % 128):
        raise ValueError(f"pair_cluster: direct mode (no split, no merge cluster) and h_q a multiple of 128, "
                         f"got split={split}, h_q={h_q}")
    parts_bf16 = split and getattr(kernel, "parts_bf16", False)
    return kernel, _compile.compile_kernel(kernel, *decode_fake_args(d_qk, h_q, split, fused, parts_bf16), arch=arch,
                                           **kw)


# ---------------------------------------------------------------------------------------------
# What the kernels serve
# ---------------------------------------------------------------------------------------------

NARROW_HEADS = (8, 16, 24, 32)


def decode_reason(plan) -> Optional[str]:
    """None if the decode kernels serve ``plan``'s static configuration, else why not."""
    if plan.dtype != torch.bfloat16:
        return f"dtype {plan.dtype} (kernels take bfloat16)"
    if plan.d_qk not in (512, 576):
        return f"d_qk={plan.d_qk} (kernels take 512 or 576)"
    if plan.d_v != D_V:
        return f"d_v={plan.d_v} (kernels take {D_V})"
    if plan.h_q not in NARROW_HEADS and plan.h_q % 64:
        return f"h_q={plan.h_q} (decode kernels take 8, 16, 24, 32 or a multiple of 64)"
    return None


def merge_reason(mp) -> Optional[str]:
    """None if the combine kernel serves a merge of ``mp`` (a MergeProblem)."""
    if mp.dtype not in (torch.bfloat16, torch.float32):
        return f"parts dtype {mp.dtype} (the combine takes bfloat16 or float32)"
    if mp.out_dtype not in (torch.bfloat16, torch.float32):
        return f"output dtype {mp.out_dtype} (the combine writes bfloat16 or float32)"
    vec = 8 if mp.dtype == torch.bfloat16 else 4
    if mp.d_v % (32 * vec) or mp.d_v == 0:
        return f"d_v={mp.d_v} (the combine needs a multiple of {32 * vec} for {mp.dtype} parts)"
    return None


def _dtype_name(dt: torch.dtype) -> str:
    return "bf16" if dt == torch.bfloat16 else "f32"


# ---------------------------------------------------------------------------------------------
# Plan preparation and one decode step
# ---------------------------------------------------------------------------------------------


ENV_PDL = "MLA_KERNELS_DECODE_PDL"
ENV_L2_PREFETCH = "MLA_KERNELS_DECODE_L2_PREFETCH"
ENV_COMBINE = "MLA_KERNELS_DECODE_COMBINE"
ENV_L2_POLICY = "MLA_KERNELS_DECODE_L2_POLICY"
ENV_PARTS = "MLA_KERNELS_DECODE_PARTS"
PARTS_DTYPES = ("f32", "bf16")
DEFAULT_PARTS = "f32"
COMBINE_MODES = ("auto", "separate", "fused", "cluster")
DEFAULT_COMBINE = "auto"
ENV_CLUSTER_MAX = "MLA_KERNELS_DECODE_CLUSTER_MAX"
ENV_CLUSTER_PARTS = "MLA_KERNELS_DECODE_CLUSTER_PARTS"
CLUSTER_SIZES = (2, 4, 8, 16)
#: every size the DSMEM merge serves (``common/cluster_merge.merge_slice``: 2..16, uneven head
#: slices where it does not divide the heads); the ``auto`` rule with
#: ``MLA_KERNELS_DECODE_RESPLIT=fit`` takes any of them
MERGE_SIZES = tuple(range(2, 17))
DEFAULT_CLUSTER_MAX = 16
#: ``auto`` may lower a 64-head plan's split count to this cluster size when clusters of its own
#: split count do not all fit on the GPU (measured on an H200, docs/PERF.md: b 2, s_q 2, h_q 128 --
#: 8 rows -- 16 splits with the combine kernel 21.3 us, 8 clusters of 16 28.3, 8 clusters of 8
#: 17.6; 8-CTA clusters at b 1 lose to 16: 17.0 vs 15.0 us)
AUTO_RESPLIT = 8
DEFAULT_CLUSTER_PARTS = "bf16"
ENV_RESPLIT = "MLA_KERNELS_DECODE_RESPLIT"
#: ``fit`` (default): a split plan whose clusters do not all fit may become the largest cluster
#: size below its split count whose clusters do, if its blocks deal evenly and each split then
#: holds at most :data:`RESPLIT_MAX_BLOCKS` blocks (64-head kernel / narrow kernel); ``8``: only a
#: 64-head plan of more than 8 splits may become 8 splits in clusters of 8 (the rule before)
RESPLIT_MODES = ("fit", "8")
DEFAULT_RESPLIT = "fit"
#: blocks per split up to which ``fit`` trades the combine kernel for fewer splits in clusters
#: (H200, graph steps, docs/PERF.md: the 64-head kernel's 8 -> 4 splits 0.81-0.95x the time with
#: the combine kernel, 4 -> 2 (16 blocks) 1.04-1.12x; the narrow kernel's 16 -> 8 0.95-0.98x,
#: 8 -> 4 (8 blocks) 1.02-1.07x, 8 -> 6 (6 blocks) 1.01-1.08x)
RESPLIT_MAX_BLOCKS = {"wide": 8, "narrow": 4}


def resplit_mode() -> str:
    """``MLA_KERNELS_DECODE_RESPLIT`` (read when a plan is made): how far the ``auto`` combine rule
    may lower a plan's split count to merge it in clusters (:data:`RESPLIT_MODES`,
    :func:`cluster_size_for`)."""
    return fastpath.knob_choice(ENV_RESPLIT, RESPLIT_MODES, DEFAULT_RESPLIT)


def combine_mode() -> str:
    """How a split plan merges its parts, read when a plan is made: ``MLA_KERNELS_DECODE_COMBINE``
    = ``auto`` (default: ``cluster`` for plans whose clusters all fit on the GPU, possibly with
    fewer splits -- :func:`cluster_size_for` --, else ``separate``), ``separate``
    (the combine kernel after the decode kernel, two launches), ``fused`` (one launch: the last
    CTA of each row merges it) or ``cluster`` (one launch: the row's split CTAs run as one
    thread-block cluster and merge over DSMEM, ``common/cluster_merge.py``; split counts
    2/4/8/16, for the narrow kernel only those dividing h_q or divided by it -- other plans fall
    back to ``separate``).  docs/PERF.md says which measures faster."""
    return fastpath.knob_choice(ENV_COMBINE, COMBINE_MODES, DEFAULT_COMBINE)


CLUSTER_PARTS = ("f32", "bf16", "l2")


def cluster_knobs():
    """``(max_cluster, staging)`` for cluster-merge plans made now:
    ``MLA_KERNELS_DECODE_CLUSTER_MAX`` (``16`` default -- a non-portable cluster size --, or 8, 4,
    2: the largest split count merged as a cluster) and ``MLA_KERNELS_DECODE_CLUSTER_PARTS``
    (``bf16`` default: each CTA stages its partial, rounded to bf16, in its shared memory and the
    peers read it over DSMEM; ``f32``: the same unrounded -- twice the DSMEM bytes, 18% slower at
    b 1 --; ``l2``: the float32 partials go through the global workspace, the cluster barrier only
    orders them -- 16% slower at b 1; docs/PERF.md)."""
    import os

    mx = os.environ.get(ENV_CLUSTER_MAX, str(DEFAULT_CLUSTER_MAX)).strip()
    if mx not in tuple(str(c) for c in CLUSTER_SIZES):
        raise ValueError(f"{ENV_CLUSTER_MAX}={mx!r}: expected one of 2, 4, 8, 16")
    return int(mx), fastpath.knob_choice(ENV_CLUSTER_PARTS, CLUSTER_PARTS, DEFAULT_CLUSTER_PARTS)


def cluster_capacity(device: torch.device, cluster: int, num_sms: int) -> int:
    """Clusters of ``cluster`` CTAs (one CTA per SM, as the 64-head decode kernels run) that can be
    resident at once: :func:`max_active_clusters` (the driver's occupancy query -- an H200 with
    132 SMs: 66, 30, 15, 7 for 2, 4, 8, 16), else (no CUDA device or no driver query) half of
    ``num_sms // cluster`` -- a cluster's CTAs need SMs of one GPC, so not every SM can take part
    (the conservative half gives 33, 16, 8, 4 at 132 SMs, the same choices for b <= 2)."""
    n = max_active_clusters(device, cluster)
    return n if n is not None else num_sms // cluster // 2


def cluster_size_for(plan, mode: str, max_cluster: int, staging: str = DEFAULT_CLUSTER_PARTS) -> int:
    """The cluster size a plan's kernel runs with (0: none), at most ``max_cluster``:

    * ``cluster``: the plan's split count when it is 2, 4, 8 or 16 (whether or not all clusters
      fit at once -- those that do not wait for a free GPC);
    * ``auto``: the split count if it is a cluster size (:data:`MERGE_SIZES`, 2..16, by
      :func:`resplit_mode` ``fit``; 2, 4, 8 or 16 by ``8`` or with the L2 staging) and the plan's
      ``rows`` clusters of that size fit on the GPU at once (:func:`cluster_capacity`); else,
      unless the split count was forced, a smaller size -- ``fit``: of the sizes below the split
      count whose ``rows`` clusters fit, whose splits deal the blocks evenly and hold at most
      :data:`RESPLIT_MAX_BLOCKS` blocks each, the one with the fewest block pairs per split (the
      kernels take blocks in pairs: 7 blocks cost as much as 8), then the smallest (16 rows of 64
      heads: 6 splits of 6 blocks in clusters of 6 -- 64 heads over 6 CTAs merge 11, 11, 11, 11,
      11 and 9 heads; 20 rows: 4 splits, not 5 of 7 blocks); ``8``:
      ``AUTO_RESPLIT`` (8) under the same conditions for a 64-head plan of more than 8 splits --
      the caller then lowers the plan's split count to it; else 0 (the combine kernel).

    The narrow kernel (h_q 8..32, one CTA row per token) takes the same rule with a DSMEM
    ``staging`` (``bf16`` / ``f32``; it has no L2 staging): with ``fit`` any size (16 heads over 3
    CTAs: 6, 5, 5; 8 heads over 16 CTAs: each merges half of a head's columns), else sizes that
    divide h_q or that h_q divides.
    """
    from ..decode import device_sm_count

    if mode not in ("cluster", "auto") or plan.num_splits <= 1:
        return 0
    n = plan.num_splits
    fit = mode == "auto" and resplit_mode() == "fit"
    # fit: any size 2..16 for the DSMEM merge (uneven head slices where it does not divide the
    # heads); the L2 staging, the forced `cluster` mode and the earlier rule keep the powers of two
    sizes_ok = MERGE_SIZES if fit and staging != "l2" else CLUSTER_SIZES
    ok = n in sizes_ok and n <= max_cluster
    narrow = plan.h_q in NARROW_HEADS

    def narrow_ok(c):  # the narrow kernel's merge: whole heads (or column parts of one) per CTA
        return staging != "l2" and (fit or plan.h_q % c == 0 or c % plan.h_q == 0)

    if narrow:
        ok = ok and narrow_ok(n)
    if mode == "cluster":
        return n if ok else 0
    rows = plan.b * plan.s_q * (1 if narrow else plan.h_q // 64)
    sms = device_sm_count(plan.device)
    if ok and rows <= cluster_capacity(plan.device, n, sms):  # (narrow: one CTA per SM too)
        return n
    if plan.forced_splits:
        return 0
    n_blocks = max(1, -(-plan.topk // 64))
    if fit:
        sizes = [c for c in sizes_ok if c < n and c <= max_cluster and (not narrow or narrow_ok(c))]
        max_blocks = RESPLIT_MAX_BLOCKS["narrow" if narrow else "wide"]
    else:
        sizes = [] if narrow or n <= AUTO_RESPLIT or AUTO_RESPLIT > max_cluster else [AUTO_RESPLIT]
        max_blocks = n_blocks
    # (block pairs per split, c) of the sizes whose clusters fit, whose splits deal the blocks evenly
    # (none empty) and stay short enough: the kernels take a split's blocks in pairs, so an odd count
    # costs a whole pair -- fewest pairs first, then the fewest CTAs
    fits = [(-(-bps // 2), c) for c, bps in ((c, -(-n_blocks // c)) for c in sizes)
            if -(-n_blocks // bps) == c and bps <= max_blocks and rows <= cluster_capacity(plan.device, c, sms)]
    return min(fits)[1] if fits else 0


#: a PTX kernel that does nothing: the occupancy probe's stand-in for a decode kernel (the driver
#: JIT-compiles it; its resources that matter -- block size, shared memory -- are set per query)
_PROBE_PTX = b""".version 7.8
.target sm_90
.address_size 64
.visible .entry mla_kernels_cluster_probe()
{
    ret;
}
"""
#: shared memory the probe asks for: more than half an SM's (227 KB on sm90), so one CTA per SM,
#: as every 64-head decode kernel (smem ~225-230 KB) runs
PROBE_SMEM = 232448
PROBE_THREADS = 384
_fit_cache = {}
_fit_errors = {}  # why a probe gave None (tools/cluster_occupancy.py prints it)


def max_active_clusters(device: torch.device, cluster: int, smem: int = PROBE_SMEM, threads: int = PROBE_THREADS):
    """How many clusters of ``cluster`` CTAs (``threads`` threads, ``smem`` bytes of dynamic shared
    memory each) can be resident on ``device`` at once: the driver's
    ``cuOccupancyMaxActiveClusters`` for a do-nothing probe kernel with those resources (a cluster
    needs its CTAs' SMs in one GPC, so on an H100 / H200 fewer clusters of 16 fit than 132 / 16).
    Cached per (device, cluster, smem, threads); ``None`` when the driver cannot be asked (no
    CUDA device, no ``cuda.bindings``, no current context, an error) -- the caller then falls back
    to its documented rule."""
    if device.type != "cuda":
        return None
    key = (device.index or 0, cluster, smem, threads)
    if key in _fit_cache:
        return _fit_cache[key]
    n = None
    try:
        from cuda.bindings import driver as cu

        with torch.cuda.device(device):
            torch.cuda.init()
            torch.empty(1, device=device)  # the primary context is current on this thread
            err, ctx = cu.cuCtxGetCurrent()
            if err != cu.CUresult.CUDA_SUCCESS or int(ctx) == 0:
                raise RuntimeError(f"no current CUDA context ({err})")
            else:
                err, mod = cu.cuModuleLoadData(_PROBE_PTX + b"\0")
                if err != cu.CUresult.CUDA_SUCCESS:
                    raise RuntimeError(f"cuModuleLoadData: {err}")
                else:
                    try:
                        n = _probe(cu, mod, cluster, smem, threads)
                    finally:
                        cu.cuModuleUnload(mod)
    except Exception as e:  # pragma: no cover - depends on the machine
        _fit_errors[key] = f"{type(e).__name__}: {e}"
        n = None
    _fit_cache[key] = n
    return n


def _probe(cu, mod, cluster, smem, threads):
    err, fn = cu.cuModuleGetFunction(mod, b"mla_kernels_cluster_probe")
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuModuleGetFunction: {err}")
    A = cu.CUfunction_attribute
    for a, v in ((A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                 (A.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1 if cluster > 8 else 0)):
        err = cu.cuFuncSetAttribute(fn, a, v)[0]
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuFuncSetAttribute({a}): {err}")
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = cluster, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
    cfg.sharedMemBytes = smem
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    err, n = cu.cuOccupancyMaxActiveClusters(fn, cfg)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters: {err}")
    return int(n)


def parts_dtype_name() -> str:
    """The dtype of a split plan's partial outputs, read when a plan is made:
    ``MLA_KERNELS_DECODE_PARTS`` = ``f32`` (default) or ``bf16`` (half the bytes the split kernel
    stores and the combine reads; each part rounded to bf16 once before the merge -- measured
    2-21% slower at b 1-2 on an H200, docs/PERF.md).  The fused combine always uses float32 parts."""
    return fastpath.knob_choice(ENV_PARTS, PARTS_DTYPES, DEFAULT_PARTS)


def l2_evict_first(h_q: int) -> bool:
    """The gather's L2 hint for a plan of ``h_q`` heads: ``MLA_KERNELS_DECODE_L2_POLICY`` =
    ``auto`` (default: evict_first for the narrow-head kernel, h_q <= 32, whose rows one CTA reads
    once; evict_last, the forward gather's hint, otherwise), ``last`` or ``first``; read when a
    plan is made.  Measured on an H200 (docs/PERF.md, CUDA-graph GPU time at b 128, two runs):
    evict_first 1.6-3.1% faster for h_q 16/32, +-1-2% (noise) for h_q 64 and 128."""
    import os

    v = os.environ.get(ENV_L2_POLICY, "auto").strip()
    if v not in ("auto", "last", "first"):
        raise ValueError(f"{ENV_L2_POLICY}={v!r}: expected auto, last or first")
    return v == "first" or (v == "auto" and h_q in NARROW_HEADS)


ENV_PAGEDIV = "MLA_KERNELS_DECODE_PAGEDIV"
PAGEDIV_MODES = ("generic", "magic")
DEFAULT_PAGEDIV = "generic"


def page_div_mode() -> str:
    """How the decode kernels' paged gather divides a position by the page size, read when a plan
    is made: ``MLA_KERNELS_DECODE_PAGEDIV`` = ``generic`` (default: the compiler's division by the
    runtime ``page_size``, a float reciprocal and corrections, ~8 instructions per gathered row) or
    ``magic`` (a multiply-high and a shift by the host's :func:`page_divisor` constants: 70 fewer
    producer instructions per block pair).  Both read the same rows: bit for bit the same outputs.
    Measured on an H200 (docs/PERF.md, decode, eighth round): magic 0.4-0.6% slower at b 128 for
    h_q 64 / 128 (IQRs overlap), equal at h_q 32, 0.6% faster at h_q 16, 1.7% faster at b 2 --
    not faster where the targets are, so not the default."""
    return fastpath.knob_choice(ENV_PAGEDIV, PAGEDIV_MODES, DEFAULT_PAGEDIV)


ENV_O_MODE = "MLA_KERNELS_DECODE_O"
O_MODES = ("bulk", "regs")
DEFAULT_O_MODE = "bulk"


def decode_o_mode() -> str:
    """How the 64-head decode kernel's direct mode (one split: bf16 ``out``) writes O, read when a
    plan is made: ``MLA_KERNELS_DECODE_O`` = ``bulk`` (default: the rows staged in the free Q
    smem, one 1 KB bulk copy per head row) or ``regs`` (8-byte stores from the accumulator
    registers).  Bit for bit the same outputs; on an H200 bulk made the b 128 s_q 2 h 128 step
    1.043x and b 128 s_q 1 h 64 1.030x faster (docs/PERF.md)."""
    return fastpath.knob_choice(ENV_O_MODE, O_MODES, DEFAULT_O_MODE)


ENV_RING = "MLA_KERNELS_DECODE_RING"
RING_MODES = ("auto", "fixed", "alt")
DEFAULT_RING = "auto"


def decode_ring_mode() -> str:
    """The 64-head decode kernel's KV ring, read when a plan is made: ``MLA_KERNELS_DECODE_RING``
    = ``fixed`` (block 0 of every pair in buffer 0), ``alt`` (the right halves of the two buffers
    swap owners every pair, so that WG0's block is always made of the two halves freed early in
    the previous pair: ``common/decode_device.PairedBlockConsumer.loop``) or ``auto`` (default:
    :func:`ring_for`).  Bit for bit the same outputs."""
    return fastpath.knob_choice(ENV_RING, RING_MODES, DEFAULT_RING)


def ring_for(mode: str, split: bool) -> str:
    """The ring a plan's 64-head kernel gets: ``auto`` is ``alt`` in direct mode (one split: a CTA
    runs all of a request's blocks; H200: 1.05x faster steps at b 64, s_q 2, h_q 128 and at b 128,
    h_q 64, docs/PERF.md) and ``fixed`` in split mode (4-8 blocks per CTA: the alternating loop's
    twice longer code cost 1-3% there)."""
    if mode == "auto":
        return "fixed" if split else "alt"
    return mode


ENV_PAIR = "MLA_KERNELS_DECODE_PAIR"
PAIR_MODES = ("1", "0")
DEFAULT_PAIR = "1"


def decode_pair_mode() -> bool:
    """Whether a direct-mode plan (one split) of a head count that is a multiple of 128 launches
    each token's two 64-head CTAs as one 2-CTA cluster, read when a plan is made:
    ``MLA_KERNELS_DECODE_PAIR`` = ``1`` (default) or ``0``.  The pair gathers the same KV rows; in
    a cluster its CTAs start together, so the second CTA's L2 misses merge into the first's
    (H200: 0.979x / 0.987x the step time at b 64 / 128, s_q 2, h_q 128; making the second CTA trail
    its partner by 2 or 6 blocks instead cost 1.035-1.069x, docs/PERF.md).  Bit for bit the same
    outputs."""
    return fastpath.knob_choice(ENV_PAIR, PAIR_MODES, DEFAULT_PAIR) == "1"


def pair_for(plan, split: bool, cluster: int, on: bool) -> bool:
    """Whether ``plan``'s 64-head kernel gets the pair cluster: direct mode (no split, no merge
    cluster), ``h_q`` a multiple of 128, and the knob on (:func:`decode_pair_mode`)."""
    return on and not split and not cluster and plan.h_q % 128 == 0


#: the largest divisor / dividend :func:`page_divisor`'s constants serve (the kernels' int32 range)
PAGEDIV_MAX = 2**31 - 1


def page_divisor(d: int):
    """``(page_mul, page_shift)`` for dividing by ``d`` (``1 <= d <= 2^31 - 1``) in the kernels:
    the round-up method (Granlund & Montgomery 1994, Fig. 4.1) with ``l = ceil(log2 d)`` and
    ``m' = floor(2^32 (2^l - d) / d) + 1`` (``0 < m' < 2^32``; 1 for a power of two), then for every
    ``0 <= n <= 2^31 - 1``::

        q = (umulhi(n, m') + n) >> l      (exactly n // d; the 32-bit sum cannot overflow as n < 2^31)

    ``page_mul`` is ``m'`` as a signed int32 (the kernel reads its bits as unsigned),
    ``page_shift`` is ``l``.  :func:`page_div_emulated` is the same arithmetic on the host."""
    if not 1 <= d <= PAGEDIV_MAX:
        raise ValueError(f"page_divisor: divisor {d} outside [1, 2^31 - 1]")
    l = (d - 1).bit_length()
    m = ((1 << 32) * ((1 << l) - d)) // d + 1
    return (m - (1 << 32) if m >= 1 << 31 else m), l


def page_div_emulated(n, page_mul: int, page_shift: int):
    """The kernels' quotient ``(umulhi(n, m') + n) >> l`` for ``0 <= n < 2^31`` (a Python int or
    an integer torch tensor; the test's check of :func:`page_divisor`)."""
    m = page_mul & 0xFFFFFFFF
    return ((n * m >> 32) + n) >> page_shift


ENV_CLUSTER_ROWS = "MLA_KERNELS_DECODE_CLUSTER_ROWS"
CLUSTER_ROWS = ("32", "64")
DEFAULT_CLUSTER_ROWS = "32"


def cluster_rows() -> int:
    """``MLA_KERNELS_DECODE_CLUSTER_ROWS`` (``32`` default, or ``64``), read when a plan is made:
    heads per CTA of a 64-head-kernel plan that merges over DSMEM in clusters.  32: twice the
    rows, of 32 heads each (the wgmma tile's other 32 rows are zeros, computed and dropped), so
    each CTA pulls half the bytes in the merge -- used when twice the plan's clusters fit on the
    GPU at once (b 1 at h_q 64 / 128 on an H200: 10-11% faster steps, bitwise the same outputs;
    docs/PERF.md), else 64."""
    return int(fastpath.knob_choice(ENV_CLUSTER_ROWS, CLUSTER_ROWS, DEFAULT_CLUSTER_ROWS))


def cluster_rows_for(plan, cluster: int, staging: str) -> int:
    """Heads per CTA of a plan's 64-head kernel: 32 for a cluster merge over DSMEM (``cluster``
    > 0, ``staging`` not ``l2``) when :func:`cluster_rows` is 32 (the default) and the plan's
    ``b * s_q * h_q / 32`` rows fit as clusters at once (:func:`cluster_capacity`), else 64."""
    if not cluster or staging == "l2" or plan.h_q % 64 or cluster_rows() != 32:
        return 64
    from ..decode import device_sm_count

    rows = plan.b * plan.s_q * (plan.h_q // 32)
    return 32 if rows <= cluster_capacity(plan.device, cluster, device_sm_count(plan.device)) else 64


def decode_knobs():
    """``(pdl, l2_prefetch)`` for plans made now -- bring-up knobs, read when a plan is made:
    ``MLA_KERNELS_DECODE_PDL`` (``0`` default: a plain launch of the combine; ``1``: programmatic
    dependent launch after the decode kernel -- in a CUDA graph on an H200 0.1-1.5 us slower at
    b 1-2 for h_q 64/128 in two runs, on an H100 0.3-0.8 us faster; eagerly up to 2.7 us faster
    for h_q 16/32: docs/PERF.md) and ``MLA_KERNELS_DECODE_L2_PREFETCH`` (``128``
    default, ``256`` as the forward's gather -- 3.5-5% slower at b 128 --, ``0`` none: the L2
    prefetch size of the KV gather's cp.async)."""
    import os

    pdl = os.environ.get(ENV_PDL, "0").strip()
    pf = os.environ.get(ENV_L2_PREFETCH, "128").strip()
    if pdl not in ("0", "1"):
        raise ValueError(f"{ENV_PDL}={pdl!r}: expected 0 or 1")
    if pf not in ("0", "128", "256"):
        raise ValueError(f"{ENV_L2_PREFETCH}={pf!r}: expected 0, 128 or 256")
    return pdl == "1", int(pf)


ENV_GRAPH = "MLA_KERNELS_DECODE_GRAPH"
GRAPH_MODES = ("separate", "same")
DEFAULT_GRAPH = "separate"
#: the smallest merge cluster whose plans run the combine kernel instead when captured in a CUDA
#: graph (``MLA_KERNELS_DECODE_GRAPH=separate``; so do smaller clusters that the fit rule made of
#: more splits, :func:`wants_graph_plan`).  H200, graph replays back to back (docs/PERF.md): the
#: plans' own 16 splits with the combine kernel took 0.90x (b 1 h_q 128, clusters of 16), 0.84x
#: (b 2 s_q 2 h_q 128, 8), 0.83x (b 4 h_q 128, 8), 0.91x (b 1 h_q 64, 16), and for the narrow kernel
#: 0.78x (b 1 h_q 16), 0.77x (b 1 h_q 32), 0.76x (b 1 h_q 8), 0.83x (b 4 h_q 16), 0.81x (b 8 h_q 16,
#: 8) the cluster step's time
GRAPH_SEPARATE_MIN_CLUSTER = 8


def graph_mode() -> str:
    """How an ``auto`` plan whose eager calls merge in a DSMEM cluster of at least
    :data:`GRAPH_SEPARATE_MIN_CLUSTER` CTAs (both kernels' small batches), or in smaller clusters
    of a re-split plan (:func:`wants_graph_plan`), runs when its call is captured in a CUDA graph,
    read when a plan is made: ``MLA_KERNELS_DECODE_GRAPH`` = ``separate`` (default: the plan's own
    split count and the combine kernel -- two launches, which cost host
    time only when a call is not replayed from a graph, and less GPU time: the cluster launches of
    8-16 CTAs wait for whole GPCs) or ``same`` (the eager path).  The two paths' outputs agree to
    within bf16 rounding (the merge's partials are float32 in one, bf16 in the other)."""
    return fastpath.knob_choice(ENV_GRAPH, GRAPH_MODES, DEFAULT_GRAPH)


def prepare_decode(plan, compile_wide, compile_narrow, compile_combine, mode: Optional[str] = None) -> None:
    """Compile the plan's kernels (through the compile cache) and make every placeholder and
    view a call needs, so that a call allocates nothing (and can be captured in a CUDA graph).
    ``mode``: the combine mode (default: :func:`combine_mode`).  A plan that :func:`wants_graph_plan`
    (``auto`` CUDA plans merging in clusters of 8+ CTAs, or re-split to smaller ones) also gets a second
    plan for captured calls (``state["graph_plan"]``: its own split count, the combine kernel,
    the same ``out`` / ``lse`` / ``max_logits`` buffers)."""
    from .. import _compile

    arch = _compile.arch_for_device(plan.device)
    split = plan.num_splits > 1
    own_splits = (plan.num_splits, plan.blocks_per_split)
    pdl, pf = decode_knobs()
    mode = combine_mode() if mode is None else mode
    fused = split and mode == "fused"
    plan.state["fused"] = fused
    max_cluster, staging = cluster_knobs()
    cluster = cluster_size_for(plan, mode, max_cluster, staging)
    if cluster and cluster != plan.num_splits:
        # auto: fewer splits, merged in clusters that fit (cluster_size_for)
        n_blocks = max(1, -(-plan.topk // 64))
        plan.num_splits, plan.blocks_per_split = cluster, -(-n_blocks // cluster)
        if plan.out_parts is not None:  # the workspace's first splits (the L2 staging uses it)
            plan.out_parts, plan.lse_parts = plan.out_parts[:cluster], plan.lse_parts[:cluster]
            if plan.max_logits_parts is not None:
                plan.max_logits_parts = plan.max_logits_parts[:cluster]
    plan.state["cluster"] = cluster
    plan.state["own_splits"] = own_splits[0]  # (before the fit rule: what a graph plan runs)
    ef = l2_evict_first(plan.h_q)
    parts = "bf16" if split and not fused and not cluster and parts_dtype_name() == "bf16" else "f32"
    kw = dict(l2_prefetch=pf, fused=True) if fused else dict(l2_prefetch=pf)
    plan.state["cluster_l2"] = bool(cluster) and staging == "l2"
    if cluster:
        kw.update(cluster=cluster, cluster_bf16=staging == "bf16", cluster_l2=staging == "l2")
        parts = f"cluster{cluster}-{staging}"
        if staging != "l2":  # the partials never leave shared memory: no global workspace
            plan.out_parts = plan.lse_parts = plan.max_logits_parts = None
    rows = cluster_rows_for(plan, cluster, staging)
    if rows != 64:  # (the default 64-head kernels keep their cache keys)
        kw["rows"] = rows
        parts += f"-rows{rows}"
    plan.state["rows"] = rows
    if ef:
        kw["evict_first"] = True
    if parts == "bf16":
        kw["parts_bf16"] = True
        # the plan's workspace in the kernel's partial dtype
        plan.out_parts = torch.zeros(plan.out_parts.shape, dtype=torch.bfloat16, device=plan.device)
    plan.state["parts"] = parts
    pagediv = page_div_mode()
    plan.state["pagediv"] = pagediv
    if pagediv != DEFAULT_PAGEDIV:  # (the default kernels keep their cache keys)
        kw["pagediv"] = pagediv
    pd_key = () if pagediv == DEFAULT_PAGEDIV else (pagediv,)
    o_mode = decode_o_mode()
    plan.state["o_mode"] = o_mode
    if plan.h_q not in NARROW_HEADS and o_mode != DEFAULT_O_MODE:  # (the default keeps its cache key)
        kw["o_bulk"] = o_mode == "bulk"
        pd_key = pd_key + (o_mode,)
    ring = ring_for(decode_ring_mode(), split)
    if plan.h_q not in NARROW_HEADS:  # (the narrow kernel has its own loop)
        plan.state["ring"] = ring
        kw["ring_alt"] = ring == "alt"
        pd_key = pd_key + (ring,)
    pair = pair_for(plan, split, cluster, decode_pair_mode())  # (h_q % 128 == 0: never the narrow kernel)
    plan.state["pair"] = pair
    if pair:
        kw["pair_cluster"] = True
        pd_key = pd_key + ("pair",)
    if plan.h_q in NARROW_HEADS:
        kern = _compile.cached_compile(
            ("SparseMlaDecodeNarrowSm90", plan.d_qk, plan.h_q, split, pf, fused, ef, parts, arch) + pd_key,
            lambda: compile_narrow(plan.d_qk, plan.h_q, split, arch, **kw))[1]
    else:
        kern = _compile.cached_compile(
            ("SparseMlaDecodeSm90", plan.d_qk, plan.h_q, split, pf, fused, ef, parts, arch) + pd_key,
            lambda: compile_wide(plan.d_qk, plan.h_q, split, arch, **kw))[1]
    dev, h, T = plan.device, plan.h_q, plan.b * plan.s_q
    st = plan.state
    st["kernel"] = kern
    st["bias0"] = torch.zeros(1, h, plan.d_qk, dtype=torch.bfloat16, device=dev)
    st["bt0"] = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    st["tl0"] = torch.zeros(1, dtype=torch.int32, device=dev)
    st["sink0"] = torch.zeros(1, dtype=torch.float32, device=dev)
    st["ml0"] = torch.zeros(1, 1, h, dtype=torch.float32, device=dev)
    st["scale_log2"] = None
    # page_size -> (page_mul, page_shift) of the last call (a cache's page size rarely changes)
    st["pagediv_of"] = (1, *page_divisor(1))
    if cluster:
        st["cnt0"] = torch.zeros(1, dtype=torch.int32, device=dev)  # the fused contract's unused counters
    elif fused:
        # the arrival counters of the fused kernel's rows: zero now, reset by the kernel
        rows = T * (1 if plan.h_q in NARROW_HEADS else plan.h_q // 64)
        plan.counters = torch.zeros(rows, dtype=torch.int32, device=dev)
    elif split:
        n = plan.num_splits
        st["combine"] = _compile.cached_compile(("LseCombine", plan.d_v, parts, "bf16", pdl, arch),
                                                lambda: compile_combine(plan.d_v, parts, "bf16", arch, pdl=pdl))[1]
        st["parts3"] = plan.out_parts.view(n, T * h, plan.d_v)
        st["lse_parts2"] = plan.lse_parts.view(n, T * h)
        st["out2"] = plan.out.view(T * h, plan.d_v)
        st["lse1"] = plan.lse.view(T * h)
        if plan.with_max_logits:
            st["ml_out2"] = plan.max_logits.view(T, h)
    plan.state["graph_plan"] = None
    if wants_graph_plan(mode, cluster, own_splits[0], staging, plan.device):
        plan.state["graph_plan"] = graph_plan(plan, own_splits, compile_wide, compile_narrow, compile_combine)
    # the arguments that are the same tensors on every call, converted once (ffi_constants)
    st["c"] = ffi_constants(kern, {
        "bias0": st["bias0"], "bt0": st["bt0"], "tl0": st["tl0"], "sink0": st["sink0"], "ml0": st["ml0"],
        "cnt0": st.get("cnt0"), "counters": plan.counters, "out": plan.out, "lse": plan.lse,
        "ml": plan.max_logits, "out_parts": plan.out_parts, "lse_parts": plan.lse_parts,
        "ml_parts": plan.max_logits_parts, "parts3": st.get("parts3"), "lse_parts2": st.get("lse_parts2"),
        "out2": st.get("out2"), "lse1": st.get("lse1"),
    })


def wants_graph_plan(mode: str, cluster: int, own_splits: int, staging: str, device) -> bool:
    """Whether an eager plan merging in a DSMEM cluster of ``cluster`` CTAs (0: none) also gets a
    graph plan (:func:`graph_plan`) for its captured calls: only under the ``auto`` combine rule
    (a forced combine mode runs as forced in graphs too), on a CUDA device, with a DSMEM-staged
    merge and :func:`graph_mode` ``separate``, when the cluster has at least
    :data:`GRAPH_SEPARATE_MIN_CLUSTER` CTAs or when the fit rule lowered the plan's ``own_splits``
    to fewer splits in clusters that fit (those re-split plans exist for the host time of one
    launch; in a graph their own splits with the combine kernel take less GPU time).  H200, graph
    replays back to back (docs/PERF.md): b 16 h_q 64, b 8 h_q 128 and b 4 s_q 2 h_q 128 (8 splits
    re-split to clusters of 6) ran 0.93x / 0.79x / 0.83x the time with the combine kernel; plans
    whose own small clusters fit (3, 4 splits) measured 0.97-1.02x and keep the cluster."""
    if not cluster or mode != "auto" or staging == "l2" or device.type != "cuda" or graph_mode() != "separate":
        return False
    return cluster >= GRAPH_SEPARATE_MIN_CLUSTER or cluster < own_splits


def graph_plan(plan, own_splits, compile_wide, compile_narrow, compile_combine):
    """The plan a captured call of ``plan`` runs (:func:`graph_mode`): ``own_splits`` (the split
    count and blocks per split the plan was made with) merged by the combine kernel, writing
    ``plan``'s own ``out`` / ``lse`` / ``max_logits``."""
    import dataclasses

    g = dataclasses.replace(plan, num_splits=own_splits[0], blocks_per_split=own_splits[1], out=None, lse=None,
                            max_logits=None, out_parts=None, lse_parts=None, max_logits_parts=None,
                            counters=None, forced_splits=True, state={})
    g.allocate()
    g.out, g.lse, g.max_logits = plan.out, plan.lse, plan.max_logits
    prepare_decode(g, compile_wide, compile_narrow, compile_combine, mode="separate")
    return g


def ffi_constants(kern, tensors: dict) -> dict:
    """``tensors`` (name -> tensor or None) as the compiled kernels take them fastest: a TVM-FFI
    kernel converts each torch tensor argument to a DLPack tensor on every call (~0.1-0.3 us each,
    by host), so the arguments a plan passes unchanged on every call -- its buffers and
    placeholders -- are converted once here (``tvm_ffi.from_dlpack``: a view of the same memory;
    an H100 host: 9.0 -> 7.8 us per launch at b 1 h_q 128, docs/PERF.md).  Other kernels (the
    CPU tests' emulated ones) get the tensors themselves."""
    mod = type(kern).__module__ or ""
    if not (mod.startswith("tvm_ffi") or mod.startswith("cutlass")):
        return dict(tensors)
    import tvm_ffi

    return {k: (None if t is None else tvm_ffi.from_dlpack(t)) for k, t in tensors.items()}


def run_decode(plan, q, kv_cache, indices, sm_scale, topk_length, attn_sink, block_table, q_bias):
    """One decode step into ``plan``'s buffers (inputs already checked by the API); a call captured
    in a CUDA graph runs the plan's graph plan if it has one (:func:`graph_mode`)."""
    st = plan.state
    g = st.get("graph_plan")
    if g is not None and torch.cuda.is_current_stream_capturing():
        return run_decode(g, q, kv_cache, indices, sm_scale, topk_length, attn_sink, block_table, q_bias)
    c = st["c"]  # the plan's own arguments, converted once (ffi_constants)
    flags = 0
    if q_bias is None:
        q_bias = c["bias0"]
    else:
        flags |= F_BIAS
    if block_table is None:
        block_table = c["bt0"]
    else:
        flags |= F_BLOCK_TABLE
    tl_b = tl_s = 0
    if topk_length is None:
        topk_length = c["tl0"]
    else:
        flags |= F_TOPK_LENGTH
        if topk_length.dim() == 2:
            topk_length = topk_length.view(-1)
            tl_b, tl_s = plan.s_q, 1
        else:
            tl_b = 1
    if kv_cache.dim() != 4:
        kv_cache = kv_cache.view(1, kv_cache.shape[0], 1, kv_cache.shape[-1])
    page_size = kv_cache.shape[1]
    pd = st["pagediv_of"]
    if pd[0] != page_size:
        pd = st["pagediv_of"] = (page_size, *page_divisor(max(page_size, 1)))
    page_mul, page_shift = pd[1], pd[2]
    scale_log2 = sm_scale * math.log2(math.e)
    if plan.with_max_logits:
        flags |= F_MAX_LOGITS
    # the kernels that write the final output apply the sink themselves (F_SINK); the combine path
    # gives its split kernel the placeholder and the sink to the combine
    has_sink = attn_sink is not None
    sink = attn_sink if has_sink else c["sink0"]
    if st["fused"] or st["cluster_l2"]:
        # one launch, float32 parts through L2: the last CTA of a row merges it (fused), or each
        # cluster CTA merges a slice of the row's heads (cluster_l2: no counters needed)
        ml, ml_f = (c["ml_parts"], c["ml"]) if plan.with_max_logits else (c["ml0"], c["ml0"])
        flags |= F_SINK if has_sink else 0
        counters = c["counters"] if st["fused"] else c["cnt0"]
        st["kernel"](q, q_bias, kv_cache, indices, block_table, topk_length, sink, c["out_parts"],
                     c["lse_parts"], ml, c["out"], c["lse"], ml_f, counters, scale_log2, flags, page_size, page_mul,
                     page_shift, tl_b, tl_s, plan.num_splits, plan.blocks_per_split)
    elif st["cluster"] or plan.num_splits <= 1:
        # direct layout, bf16 output: one split, or the row's cluster merging over DSMEM (one launch)
        ml = c["ml"] if plan.with_max_logits else c["ml0"]
        flags |= F_SINK if has_sink else 0
        st["kernel"](q, q_bias, kv_cache, indices, block_table, topk_length, sink, c["out"], c["lse"], ml,
                     scale_log2, flags, page_size, page_mul, page_shift, tl_b, tl_s,
                     plan.num_splits if st["cluster"] else 1, plan.blocks_per_split)
    else:
        ml = c["ml_parts"] if plan.with_max_logits else c["ml0"]
        st["kernel"](q, q_bias, kv_cache, indices, block_table, topk_length, c["sink0"], c["out_parts"],
                     c["lse_parts"], ml, scale_log2, flags, page_size, page_mul, page_shift, tl_b, tl_s,
                     plan.num_splits, plan.blocks_per_split)
        st["combine"](c["parts3"], c["lse_parts2"], sink, c["out2"], c["lse1"],
                      plan.h_q, 1 if has_sink else 0)
        if plan.with_max_logits:
            torch.amax(plan.max_logits_parts, dim=0, out=st["ml_out2"])
    if plan.with_max_logits:
        return plan.out, plan.lse, plan.max_logits
    return plan.out, plan.lse


def run_merge(outs, lses, attn_sink, out_dtype, compile_combine, device):
    """``merge_attn_partials`` on the combine kernel: ``outs [n, R, h, d_v]``, ``lses [n, R, h]``
    (contiguous) -> ``(out [R, h, d_v], lse [R, h])``."""
    from .. import _compile

    arch = _compile.arch_for_device(device)
    n, R, h, d_v = outs.shape
    in_name, out_name = _dtype_name(outs.dtype), _dtype_name(out_dtype)
    fn = _compile.cached_compile(("LseCombine", d_v, in_name, out_name, False, arch),
                                 lambda: compile_combine(d_v, in_name, out_name, arch))[1]
    out = host.alloc((R, h, d_v), out_dtype, device)
    lse = host.alloc((R, h), torch.float32, device)
    if attn_sink is None:
        sink, has_sink = host.dummy(torch.float32, device, (1,)), 0
    else:
        sink, has_sink = attn_sink, 1
    fn(outs.view(n, R * h, d_v), lses.view(n, R * h), sink, out.view(R * h, d_v), lse.view(R * h), h, has_sink)
    return out, lse
