"""Host side of the sm90 indexer kernels: which calls they serve, input preparation, workspaces,
launches.

* ``indexer_topk``: the query rows are processed in blocks of ``rows`` through float32
  workspaces ``[rows, s_kv]`` of at most :data:`WORKSPACE_BYTES` together (512 MiB: two of 2048
  rows at s_kv 32k, one per stream, see :data:`ENV_TOPK_STREAMS`; one of 4096 rows with one
  stream): the score kernel (``indexer_score.py``) fills the block's in-range scores, the top-k
  kernel (``indexer_topk.py``) selects each row's keys.  The ``[s_q, s_kv]`` scores are never
  held whole.  With h_idx 64 and ``s_kv < 65536`` the score
  kernel also counts each row's first-digit histogram (``[rows, 2048]`` int32 beside the
  workspace, 8 KiB per row: 32 MiB at 4096 rows) and the top-k kernel starts from it instead of
  reading the row once more -- an option (:data:`ENV_TOPK_HIST`), off by default: it measured
  slower for bf16 and even for fp8 on an H200 (docs/PERF.md).  The select kernel's variant
  (:data:`TOPK_VARIANTS`: rows held in shared memory, CTAs per SM) is chosen per row block by the
  block's longest row (:func:`topk_variant`).
* ``indexer_logits``: the score kernel into the caller's ``[s_q, s_kv]`` output, pre-filled with
  ``-inf`` (the kernel skips key tiles outside every range of a query tile).
* ``indexer_loss`` forward / backward (``indexer_loss_fwd.py``, ``indexer_loss_bwd.py``):
  ``topk`` padded to a multiple of 64 with -1 slots (target 0); ``dk`` accumulated in a float32
  ``[s_kv, d]`` workspace (16-byte float atomics).  With ``deterministic`` (:data:`ENV_DET`) the
  dk sums are fixed-point integers, ``round(x * 2^e)`` added as int64 -- integer addition is
  associative, so the bits do not depend on the order the additions land in -- converted back at
  the end (``/ 2^e``, float64, then k's dtype).  ``2^e`` (:func:`fixed_point_scale`, computed on
  the device, no synchronisation) is the largest power of two with ``4 B 2^e <= 2^62`` for a
  bound ``B`` on every partial sum of every dk element: ``|dK_slot[c]| <= |g_t| sum_j |w_eff[t, j]|
  max|q|`` (``|pi - p| <= 1``), summed over the queries.  The absolute resolution is ``2^-e``,
  ~``B 2^-60``; non-finite gradients (``g``, ``w``, ``q`` with inf/NaN) give a meaningless dk in
  these modes.  ``grouped`` (the default, since the S 32k backward measured 1.44-1.48x the
  default's with it, 2.05x with ``fixed_bulk64``; up to :data:`GROUPED_WORKSPACE_BYTES` of
  workspace): per wave of queries each valid slot gets a row of its key's segment
  (``common/key_groups.py``), the kernel stores the slot's dK row there in bf16 and
  ``FixedSegmentSum`` adds each key's rows into an int64 ``[s_kv, d]`` accumulator -- one bf16
  rounding per slot row (as the attention backward's deterministic mode), then an exact sum (see
  :func:`_grouped_dk`).  ``fixed_bulk64`` (73 MiB at S 32k instead of up to 4 GiB): the kernel
  adds every slot's float32 row as int64 by bulk reductions into the accumulator (the other
  ``fixed_*`` modes are its variants).  ``slots`` (the first deterministic mode): each slot's
  float32 row written into a workspace of at most
  :data:`~mla_kernels.common.bwd_host.DET_WORKSPACE_BYTES` per wave of queries and summed per key
  in a fixed order (stable sort + segment sum).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .. import _compile
from ..common import host
from ..common.bwd_host import DET_WORKSPACE_BYTES
from ..common.kernel_backend import cached

#: Upper bound of the top-k's score workspace (float32 rows of s_kv scores).
WORKSPACE_BYTES = 512 << 20
#: How the loss backward adds dk: ``red`` (16-byte float atomics from registers), ``red_bf16``
#: (8-byte bf16x2 atomics into a bf16 workspace: half the bytes, every addition rounded to bf16 --
#: an opt-in, less exact) or ``bulk`` (rows staged in smem, one ``cp.reduce.async.bulk`` per row).
ENV_DK = "MLA_KERNELS_INDEXER_DK"
#: How the deterministic loss backward adds dk: ``grouped`` (default: bf16 per-slot rows grouped
#: by key, summed in fixed point), ``fixed_bulk64``, ``fixed_bulk``, ``fixed_bulk2``,
#: ``fixed_bulk32x2``, ``fixed_red`` (float32 rows added as fixed-point int64 by the kernel, see
#: the module docstring and ``indexer_loss_bwd.py``) or ``slots`` (per-slot rows, sort + segment
#: sum).
#: ``MLA_KERNELS_INDEXER_DK=none`` (profiling only) skips dk altogether.
ENV_DET = "MLA_KERNELS_INDEXER_DET"
DET_MODES = ("grouped", "fixed_bulk64", "fixed_bulk", "fixed_bulk2", "fixed_bulk32x2", "fixed_red", "slots")
#: ``grouped``: the bf16 per-slot rows of up to this many bytes per wave of queries
#: (``MLA_KERNELS_INDEXER_DET_WS_MIB`` overrides it, in MiB): the attention backward's
#: deterministic bound (``bwd_host.DET_WORKSPACE_BYTES``, 4 GiB: 4 waves at S 32k; 1 GiB measured
#: 1.51-1.54x the default backward, 2 GiB 1.46-1.50x, 4 GiB 1.44-1.48x, docs/PERF.md)
GROUPED_WORKSPACE_BYTES = DET_WORKSPACE_BYTES
ENV_DET_WS = "MLA_KERNELS_INDEXER_DET_WS_MIB"
#: ``grouped``: queries per CTA of the key grouping (``common/key_groups.py``)
KEY_GROUP_CHUNK = 32
#: Warp steps whose loads the top-k's ordered passes issue together (1 = one load in flight per
#: step, the first version's behaviour; unset: the select variant's, :data:`TOPK_VARIANTS`).
ENV_TOPK_BATCH = "MLA_KERNELS_INDEXER_TOPK_BATCH"
#: ``0``: the top-k kernel always writes its selection by a third pass over the row (the first
#: version) instead of from its shared selection bitmap.
ENV_TOPK_MAP = "MLA_KERNELS_INDEXER_TOPK_MAP"
#: The top-k (select) kernel's variants: name -> ``(row_cap, batch, min_ctas, map_words,
#: row_unroll, full_batches)`` (``indexer_topk.IndexerTopkSm90``'s options; ``batch`` here unless
#: :data:`ENV_TOPK_BATCH` is set).  ``row_cap`` > 0: rows of at most that many keys read once into
#: shared memory; ``min_ctas``: CTAs per SM the registers must allow; ``map_words``: the selection
#: bitmap's words (rows of at most ``32 map_words`` keys written from it).  Every variant selects
#: exactly the same keys for every row (tested); they differ in speed only.  Registers / shared
#: memory (sm_90a, without / with logits; CUDA 13 ptxas) and the CTAs of 512 threads per SM they
#: allow (the select's shared memory: 42.7 KiB + the bitmap or the row's keys):
#:
#: * ``base``: the version before the variants: 38 / 40 registers, 75 KiB -> 3 per SM (42 registers
#:   and 2 per SM before pass 2 compared the scores as floats and handed out candidate chunks);
#: * ``b2``: two warp steps of loads in flight instead of four: 38 / 38 -> 3 per SM;
#: * ``b4m3``: ``base`` bounded to 3 per SM (40 registers, no spills), pass 2's whole batches
#:   without bounds checks (``full_batches``: -10 to -13% per block of 12k-32k keys on an H200;
#:   docs/PERF.md);
#: * ``b2m4`` / ``b1m4``: a 1,024-word bitmap (rows of <= 32,768 keys), 47 KiB, 32 registers -> 4
#:   per SM (56 / 232 bytes of spills without logits);
#: * ``s8k``: rows of <= 8,192 keys in shared memory, 75 KiB, bounded to 3 per SM (40 / 38
#:   registers, no spills; unbounded it took 43 with the candidate chunks);
#: * ``s16k`` / ``s32k`` / ``s47k``: rows of <= 16,384 / 32,768 / 47,104 keys in shared memory,
#:   107 / 171 / 227 KiB -> 2 / 1 / 1 per SM.
TOPK_VARIANTS = {
    "base": (0, 4, 0, 8192, 0, False),
    "b2": (0, 2, 0, 8192, 0, False),
    "b4m3": (0, 4, 3, 8192, 0, True),
    "b2m4": (0, 2, 4, 1024, 0, False),
    "b1m4": (0, 1, 4, 1024, 0, False),
    "s8k": (8192, 2, 3, 8192, 2, False),
    "s16k": (16384, 4, 0, 8192, 0, False),
    "s32k": (32768, 4, 0, 8192, 0, False),
    "s47k": (47104, 4, 0, 8192, 0, False),
}
#: ``indexer_topk.MAX_ROW_CAP`` (repeated here so that the host side does not import the kernel
#: module; a test checks that they agree).
TOPK_MAX_ROW_CAP = 47104
#: The select variant for every row block (a name of :data:`TOPK_VARIANTS`: benchmarks, tests);
#: unset / ``auto``: :func:`topk_variant`'s choice by the block's longest row.
ENV_TOPK_VARIANT = "MLA_KERNELS_INDEXER_TOPK_VARIANT"
#: ``0``: :func:`topk_variant` never chooses a variant with rows in shared memory.
ENV_TOPK_SMEM = "MLA_KERNELS_INDEXER_TOPK_SMEM"
#: :func:`topk_variant`'s choice by the longest row of the block: ``(longest <= bound, name)``,
#: the first that holds (the rows that need a selection, ``longest > topk``).  From the per-block
#: select times of every variant on an H200 at S 32k (docs/PERF.md, 2026-11-23): ``s8k`` was the
#: fastest for the blocks of <= 8,192 keys (0.066 / 0.151 ms vs ``base`` 0.095 / 0.191), ``b4m3``
#: for every longer block (e.g. 0.424 vs 0.453 ms at <= 32,768 keys); ``b2m4`` / ``b1m4`` (4 CTAs
#: per SM) and ``s16k`` were no faster, ``s32k`` / ``s47k`` (1 CTA per SM) 1.5x slower.
TOPK_AUTO = ((8192, "s8k"), (None, "b4m3"))
#: ``0``: the top-k kernel counts its first histogram by reading the row (the first version)
#: instead of taking the one the score kernel counted while writing it; ``plain`` or ``pad``:
#: that mode of the score kernel's counting (``indexer_score.HIST_MODES``) for both dtypes;
#: unset / ``1``: :data:`HIST_DEFAULT`.
ENV_TOPK_HIST = "MLA_KERNELS_INDEXER_TOPK_HIST"
#: The fused histogram's mode per input dtype by default ("" = not fused): off for both -- on an
#: H200 at S 32k ``indexer_topk`` bf16 14.70 ms without / 15.70 plain / 15.79 pad, fp8 11.34 /
#: 11.43 / 11.31 (docs/PERF.md).
HIST_DEFAULT = {"bf16": "", "fp8": ""}
HIST_MODES = ("plain", "pad")
#: The fused first-digit histogram's bins (``indexer_score.BINS``, ``indexer_topk.BINS``).
HIST_BINS = 2048
#: How many CUDA streams ``indexer_topk`` runs its row blocks on (``1`` or ``2``; default
#: :data:`TOPK_STREAMS_DEFAULT`).  With 2 (and more than one block), the blocks go in reverse
#: order (the heaviest causal blocks first), block ``j`` (its score kernel, then its select
#: kernel) to stream ``j % 2`` -- the caller's current stream or a side stream forked from it and
#: joined back before the call returns -- each stream with its own workspace of half the
#: :data:`WORKSPACE_BYTES` budget (the same memory in total), so that one block's score kernel
#: fills the SMs that the other stream's tails and selects leave idle.  The outputs are the same
#: bits either way (tested).  H200, S 32k: 0.977-0.980x the one-stream time in bf16, 0.972-0.980x
#: in fp8 (docs/PERF.md).
ENV_TOPK_STREAMS = "MLA_KERNELS_INDEXER_TOPK_STREAMS"
TOPK_STREAMS_DEFAULT = 2
#: ``0``: the score kernel reads its weights from shared memory per key tile (the first version)
#: instead of holding them in registers.
ENV_SCORE_WREGS = "MLA_KERNELS_INDEXER_SCORE_WREGS"
#: ``1``: the score kernel's two consumer warpgroups take turns issuing their MMAs through two named
#: barriers (``indexer_score.py``, ``pingpong``) instead of issuing whenever their key tile is in
#: (default ``0``: the ping-pong measured no faster on an H200, docs/PERF.md).
ENV_SCORE_PINGPONG = "MLA_KERNELS_INDEXER_SCORE_PINGPONG"
#: ``bf16x2``: the score kernel's head sum in packed bf16 (``cvt.rn.relu.bf16x2`` + ``fma.rn.bf16x2``
#: per two scores: fewer instructions, scores rounded at bf16 precision -- an opt-in: on an H200 at
#: S 32k ``indexer_topk`` bf16 14.82 -> 13.59 ms, fp8 11.22 -> 10.62, logits within ~1e-2 of the row's
#: largest |logit| (median 5e-4), 0.26% of the selected keys differ; docs/PERF.md); ``f32``
#: (default): float32 ReLU + FMA per score.
ENV_SCORE_HEADSUM = "MLA_KERNELS_INDEXER_SCORE_HEADSUM"
#: ``0``: the loss kernels load each block's indices (and targets) when the block needs them (the
#: first version) instead of one block ahead.
ENV_LOSS_PREFETCH = "MLA_KERNELS_INDEXER_LOSS_PREFETCH"
#: ``0``: the loss forward visits each query's slot blocks in order instead of from block ``t mod n``
#: on (rotated, the default: concurrent CTAs gather from different bands of keys; bitwise the same
#: outputs with the ``smem`` / ``raw`` forward variants, the same to float32 rounding with the
#: ``online*`` ones, whose sums follow the visiting order; ``indexer_loss_fwd.py``, :func:`_loss_rotate`).
ENV_LOSS_ROTATE = "MLA_KERNELS_INDEXER_LOSS_ROTATE"
#: The loss forward's variant (``indexer_loss_fwd.VARIANTS``): ``online4`` (default: the softmax and
#: KL sums formed in the block loop, the gather's indices used a block after their loads, weights
#: in registers, 2 key stages: 4 CTAs per SM), ``online`` (the same with 3 stages, 3 CTAs per SM),
#: ``raw`` (the logits row in smem as before, with the deferred index use), ``smem`` (the version
#: before, issue 19's profile).  H200, S 32k, two interleaved rounds in one process (docs/PERF.md):
#: forward smem 3.60 / 3.46 ms, raw 3.24 / 3.33, online 3.29 / 3.45, **online4 2.91 / 3.11**;
#: forward + backward 15.62 / 15.55, 15.32 / 15.34, 15.39 / 16.48, **15.13 / 15.28**.
ENV_LOSS_FWD = "MLA_KERNELS_INDEXER_LOSS_FWD"
LOSS_FWD_VARIANTS = ("online4", "online", "raw", "smem")
LOSS_FWD_DEFAULT = "online4"
#: Independent FMA chains per head sum in the score and loss kernels (default 1, the serial chain
#: = :data:`~mla_kernels.common.indexer_device.SUM_PARTS`; 2 / 4 / 8 split it, see docs/PERF.md).
ENV_SUM_PARTS = "MLA_KERNELS_INDEXER_SUM_PARTS"
FP8 = torch.float8_e4m3fn
#: The loss kernels' largest top-k (``indexer_loss_fwd.MAX_TOPK``, repeated here so that the host
#: side does not import the kernel module; a test checks that they agree).
MAX_TOPK = 8192
SCORE_BN = 256  # the score kernel's (query, head) columns per CTA
SCORE_BM = 64  # its key rows per tile


def _arch(p) -> str:
    return _compile.arch_for_device(p.device)


def supports(op: str, p) -> Optional[str]:
    """None if the sm90 indexer kernels serve ``op`` for ``p``, else why not."""
    if op in ("indexer_logits", "indexer_topk"):
        if p.dtype not in (torch.bfloat16, FP8):
            return f"dtype {p.dtype} (the indexer kernels take bfloat16 or float8_e4m3fn)"
        if p.h not in (16, 32, 64):
            return f"h_idx={p.h} (the score kernel takes 16, 32 or 64)"
        if p.d not in (64, 128):
            return f"d_idx={p.d} (the score kernel takes 64 or 128)"
        if p.s_kv >= 2**31 - SCORE_BM or p.s_q * p.h >= 2**31 - SCORE_BN:
            return "sizes beyond int32 indexing"
        return None
    if p.dtype != torch.bfloat16:
        return f"dtype {p.dtype} (the loss kernels take bfloat16)"
    if p.h != 64:
        return f"h_idx={p.h} (the loss kernels take 64)"
    if p.d not in (64, 128):
        return f"d_idx={p.d} (the loss kernels take 64 or 128)"
    if -(-p.topk // 64) * 64 > MAX_TOPK:
        return f"topk={p.topk} (the loss kernels take at most {MAX_TOPK})"
    if p.s_kv >= 2**31:
        return "s_kv beyond int32 indexing"
    return None


# ---------------------------------------------------------------------------------------------
# Scores and top-k
# ---------------------------------------------------------------------------------------------


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` (2-D) with at least ``rows`` rows (zeros appended; a byte view keeps float8 exact):
    a TMA box must not be taller than the tensor."""
    if x.shape[0] >= rows:
        return x
    out = torch.zeros(rows, x.shape[1] * x.element_size(), dtype=torch.uint8, device=x.device)
    out[: x.shape[0]] = x.view(torch.uint8)
    return out.view(x.dtype)


def _score_inputs(p):
    fp8 = p.is_fp8
    q2 = _pad_rows(p.q.view(p.s_q * p.h, p.d), SCORE_BN)
    k = _pad_rows(p.k, SCORE_BM)
    w_eff = p.weights.float() * p.sm_scale
    if fp8:
        w_eff = w_eff * p.q_scale
    ks = p.k_scale if fp8 else host.dummy(torch.float32, p.device)
    return q2, k, w_eff.reshape(-1).contiguous(), ks


# The kernel modules import the CuTe DSL: they are imported only inside a compile (the build of a
# compile-cache key), never on a call whose kernel comes from memory or the on-disk cache.


def sum_parts() -> int:
    """The head sums' FMA chains for this call (:data:`ENV_SUM_PARTS`)."""
    v = os.environ.get(ENV_SUM_PARTS, "").strip()
    if not v:
        return 1
    if v not in ("1", "2", "4", "8"):
        raise ValueError(f"{ENV_SUM_PARTS}={v!r}: expected 1, 2, 4 or 8")
    return int(v)


def _compile_score(fp8, h, d, arch, w_regs, parts=1, hist=False, pingpong=False, head_sum="f32"):
    from .indexer_score import compile_score

    return compile_score(fp8, h, d, arch, w_regs=w_regs, sum_parts=parts, hist=hist, pingpong=pingpong,
                         head_sum=head_sum)


def _env_flag(name: str, default: str) -> bool:
    """A ``0`` / ``1`` setting (unset or empty: ``default``); anything else is refused."""
    v = os.environ.get(name, default).strip() or default
    if v not in ("0", "1"):
        raise ValueError(f"{name}={v!r}: expected 0 or 1")
    return v == "1"


def score_head_sum() -> str:
    """The score kernel's head-sum arithmetic for this call (:data:`ENV_SCORE_HEADSUM`)."""
    v = os.environ.get(ENV_SCORE_HEADSUM, "f32").strip().lower() or "f32"
    if v not in ("f32", "bf16x2"):
        raise ValueError(f"{ENV_SCORE_HEADSUM}={v!r}: expected f32 or bf16x2")
    return v


def score_pingpong() -> bool:
    """Whether the score kernel's warpgroups take turns issuing their MMAs (:data:`ENV_SCORE_PINGPONG`)."""
    return _env_flag(ENV_SCORE_PINGPONG, "0")


def _compile_topk(return_logits, arch, batch, bitmap, pre_hist=False, row_cap=0, min_ctas=0, map_words=8192,
                  row_unroll=0, full_batches=False):
    from .indexer_topk import compile_topk

    return compile_topk(return_logits, arch, batch=batch, bitmap=bitmap, pre_hist=pre_hist, row_cap=row_cap,
                        min_ctas=min_ctas, map_words=map_words, row_unroll=row_unroll, full_batches=full_batches)


def _compile_loss_fwd(d, has_tl, cap, arch, prefetch=True, parts=1, rotate=False, variant=LOSS_FWD_DEFAULT):
    from .indexer_loss_fwd import compile_loss_fwd

    return compile_loss_fwd(d, has_tl, cap, arch, prefetch=prefetch, sum_parts=parts, rotate=rotate, variant=variant)


def _compile_loss_bwd(d, has_tl, deterministic, arch, mode, prefetch=True, parts=1):
    from .indexer_loss_bwd import compile_loss_bwd

    return compile_loss_bwd(d, has_tl, deterministic, arch, dk_mode=mode, prefetch=prefetch, sum_parts=parts)


def _loss_prefetch() -> bool:
    return os.environ.get(ENV_LOSS_PREFETCH, "1").strip() != "0"


def loss_fwd_variant() -> str:
    """The loss forward's variant for this call (:data:`ENV_LOSS_FWD`, default
    :data:`LOSS_FWD_DEFAULT`)."""
    v = os.environ.get(ENV_LOSS_FWD, "").strip().lower() or LOSS_FWD_DEFAULT
    if v not in LOSS_FWD_VARIANTS:
        raise ValueError(f"{ENV_LOSS_FWD}={v!r}: expected one of {', '.join(LOSS_FWD_VARIANTS)}")
    return v


def _loss_rotate() -> bool:
    """The loss forward visits query t's slot blocks from block ``t mod n`` (default on: H200,
    S 32k, loss forward 3.94 -> 3.43 ms, forward + backward 15.87 -> 15.64 ms; bitwise the same
    outputs)."""
    return _env_flag(ENV_LOSS_ROTATE, "1")


def topk_hist(p) -> str:
    """The mode in which ``indexer_topk`` fuses the first-digit histogram into the score kernel,
    or ``""`` (not fused): only at h_idx 64 (8 queries per score CTA: 32 KiB of shared 16-bit
    counters) and ``s_kv < 65536`` (no row has 65,536 keys in range, so no counter overflows);
    :data:`ENV_TOPK_HIST` chooses (``0``: off), else :data:`HIST_DEFAULT` of the dtype."""
    v = os.environ.get(ENV_TOPK_HIST, "").strip().lower()
    if v not in ("", "0", "1") + HIST_MODES:
        raise ValueError(f"{ENV_TOPK_HIST}={v!r}: expected 0, 1, {', '.join(HIST_MODES)}")
    if p.h != 64 or p.s_kv >= 65536 or v == "0":
        return ""
    if v in HIST_MODES:
        return v
    return HIST_DEFAULT["fp8" if getattr(p, "is_fp8", False) else "bf16"]


def _score_fn(p, hist: str = ""):
    fp8, arch = p.is_fp8, _arch(p)
    w_regs = os.environ.get(ENV_SCORE_WREGS, "1").strip() != "0"
    parts, pp, hs = sum_parts(), score_pingpong(), score_head_sum()
    if hs != "f32":
        w_regs = True  # the packed head sum keeps its weights in registers
    return cached(("IndexerScoreSm90", fp8, p.h, p.d, w_regs, parts, hist, pp, hs, arch),
                  lambda: _compile_score(fp8, p.h, p.d, arch, w_regs, parts, hist, pp, hs))


def topk_smem() -> bool:
    """Whether :func:`topk_variant` may choose rows in shared memory (:data:`ENV_TOPK_SMEM`)."""
    return _env_flag(ENV_TOPK_SMEM, "1")


def topk_variant(longest: int, topk: int) -> str:
    """The select kernel's variant (:data:`TOPK_VARIANTS`) for a row block whose rows have at most
    ``longest`` keys: :data:`ENV_TOPK_VARIANT` when set, else the first of :data:`TOPK_AUTO` whose
    bound holds ``longest`` (``base`` when no row needs a selection, ``longest <= topk``; a
    shared-memory variant is skipped when :data:`ENV_TOPK_SMEM` is ``0``)."""
    v = os.environ.get(ENV_TOPK_VARIANT, "").strip().lower()
    if v and v != "auto":
        if v not in TOPK_VARIANTS:
            raise ValueError(f"{ENV_TOPK_VARIANT}={v!r}: expected auto or one of {', '.join(TOPK_VARIANTS)}")
        return v
    smem = topk_smem()
    if longest <= topk:
        return "base"
    for bound, name in TOPK_AUTO:
        if (bound is None or longest <= bound) and (smem or TOPK_VARIANTS[name][0] == 0):
            return name
    return "base"


def block_longest(p, q0: int, n: int) -> int:
    """An upper bound of the keys in range of the rows ``[q0, q0 + n)``: exact for the causal
    default (``p.causal``: ``k_end[t] = s_kv - s_q + t + 1``), else ``s_kv`` (the ranges are on the
    device; reading them would synchronise)."""
    if getattr(p, "causal", False):
        return min(p.s_kv, max(0, p.s_kv - p.s_q + q0 + n))
    return p.s_kv


def _topk_fn(p, return_logits: bool, pre_hist=False, variant="base"):
    """The compiled select kernel: ``variant`` a name of :data:`TOPK_VARIANTS` or its tuple."""
    arch = _arch(p)
    row_cap, batch, min_ctas, map_words, unroll, full = TOPK_VARIANTS[variant] if isinstance(variant, str) else variant
    env_batch = os.environ.get(ENV_TOPK_BATCH, "").strip()
    if env_batch:
        batch = int(env_batch)
        if batch not in (1, 2, 4, 8):
            raise ValueError(f"{ENV_TOPK_BATCH}={batch}: expected 1, 2, 4 or 8")
    bitmap = os.environ.get(ENV_TOPK_MAP, "1").strip() != "0"
    pre_hist = bool(pre_hist)
    if pre_hist:  # the fused histogram replaces the row pass that would fill shared memory
        row_cap = unroll = 0
    opts = (batch, bitmap, pre_hist, row_cap, min_ctas, map_words, unroll, bool(full))
    return cached(("IndexerTopkSm90", return_logits) + opts + (arch,),
                  lambda: _compile_topk(return_logits, arch, *opts))


def no_hist(device) -> torch.Tensor:
    """The placeholder histogram argument of a score / top-k kernel built without ``hist``."""
    return host.dummy(torch.int32, device, (1, HIST_BINS))


#: The score kernel's query tiles (up to 32 queries per CTA at h_idx 16) must not straddle blocks.
ROW_ALIGN = 32


def block_rows(s_q: int, s_kv: int, streams: int = 1) -> int:
    """Query rows per top-k block: a multiple of :data:`ROW_ALIGN`, the ``streams`` workspaces
    together within :data:`WORKSPACE_BYTES` (or the minimum block)."""
    rows = max(ROW_ALIGN, (WORKSPACE_BYTES // streams // (max(s_kv, 1) * 4)) // ROW_ALIGN * ROW_ALIGN)
    return min(rows, -(-s_q // ROW_ALIGN) * ROW_ALIGN)


def topk_streams() -> int:
    """The streams ``indexer_topk`` spreads its row blocks over (:data:`ENV_TOPK_STREAMS`)."""
    v = os.environ.get(ENV_TOPK_STREAMS, "").strip() or str(TOPK_STREAMS_DEFAULT)
    if v not in ("1", "2"):
        raise ValueError(f"{ENV_TOPK_STREAMS}={v!r}: expected 1 or 2")
    return int(v)


_SIDE_STREAMS = {}


def _side_stream(device) -> "torch.cuda.Stream":
    """One side stream per device for :func:`run_topk`'s second pipeline (always forked from and
    joined back into the caller's current stream, so it adds no ordering of its own)."""
    key = torch.device(device).index
    if key is None:
        key = torch.cuda.current_device()
    s = _SIDE_STREAMS.get(key)
    if s is None:
        s = _SIDE_STREAMS[key] = torch.cuda.Stream(device=key)
    return s


def run_logits(p) -> torch.Tensor:
    out = torch.full((p.s_q, p.s_kv), float("-inf"), dtype=torch.float32, device=p.device)
    q2, k, w_eff, ks = _score_inputs(p)
    _score_fn(p)(q2, k, w_eff, ks, p.k_start, p.k_end, out, no_hist(p.device), 0, p.s_kv)
    return out


def run_topk(p, topk: int, return_logits: bool):
    dev = p.device
    q2, k, w_eff, ks = _score_inputs(p)
    fused = topk_hist(p)
    score = _score_fn(p, fused)
    indices = host.alloc((p.s_q, topk), torch.int32, dev)
    length = host.alloc((p.s_q,), torch.int32, dev)
    logits = host.alloc((p.s_q, topk), torch.float32, dev) if return_logits else host.dummy(
        torch.float32, dev, (1, 1))
    n_str = topk_streams()
    rows = block_rows(p.s_q, p.s_kv, n_str)
    if rows >= p.s_q:
        n_str, rows = 1, block_rows(p.s_q, p.s_kv)
    ws = [torch.empty(rows, p.s_kv, dtype=torch.float32, device=dev) for _ in range(n_str)]
    hist = [torch.empty(rows, HIST_BINS, dtype=torch.int32, device=dev) if fused else no_hist(dev)
            for _ in range(n_str)]
    cur = torch.cuda.current_stream(dev)
    streams = [cur]
    starts = list(range(0, p.s_q, rows))
    if n_str > 1:
        # block j on stream j % 2, each with its own workspace (the same stream orders a
        # workspace's select before its next score); the side stream starts after everything the
        # caller queued and the caller's stream continues after the side stream's last kernel.
        # The last (with causal ranges the heaviest) blocks go first, so that what runs alone at
        # the end -- the last block's tail and its select -- is the lightest.
        streams.append(_side_stream(dev))
        streams[1].wait_stream(cur)
        starts.reverse()
    for j, q0 in enumerate(starts):
        n = min(rows, p.s_q - q0)
        i = j % n_str
        block = ws[i][:n]
        select = _topk_fn(p, return_logits, fused, topk_variant(block_longest(p, q0, n), topk))
        with torch.cuda.stream(streams[i]):
            score(q2, k, w_eff, ks, p.k_start, p.k_end, block, hist[i], q0, p.s_kv)
            select(block, p.k_start, p.k_end, indices, length, logits, hist[i], q0)
    for side in streams[1:]:
        cur.wait_stream(side)
    return (indices, length, logits) if return_logits else (indices, length)


def select_rows(scores: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor, topk: int,
                return_logits: bool = False, variant=None):
    """The top-k kernel alone over a given float32 ``scores [s_q, ld]`` (row t = query t, keys
    ``[k_start[t], k_end[t])`` int32, clamped by the caller): what ``run_topk`` does per block.
    ``variant``: a name of :data:`TOPK_VARIANTS` or its tuple; default :func:`topk_variant` of
    ``ld``."""
    dev = scores.device
    s_q = scores.shape[0]

    class _P:  # what the compile cache key needs
        device = dev

    if variant is None:
        variant = topk_variant(scores.shape[1], topk)
    select = _topk_fn(_P, return_logits, False, variant)
    indices = host.alloc((s_q, topk), torch.int32, dev)
    length = host.alloc((s_q,), torch.int32, dev)
    logits = host.alloc((s_q, topk), torch.float32, dev) if return_logits else host.dummy(torch.float32, dev, (1, 1))
    select(scores, k_start, k_end, indices, length, logits, no_hist(dev), 0)
    return (indices, length, logits) if return_logits else (indices, length)


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------


def _loss_inputs(p):
    """``(indices, target)`` padded to a multiple of 64 slots, ``w_eff``, ``topk_length``."""
    topk_p = max(64, -(-p.topk // 64) * 64)
    idx, tgt = p.indices, p.target.float()
    if topk_p != p.topk:
        idx = torch.full((p.s_q, topk_p), -1, dtype=torch.int32, device=p.device)
        idx[:, : p.topk] = p.indices
        t2 = torch.zeros(p.s_q, topk_p, dtype=torch.float32, device=p.device)
        t2[:, : p.topk] = tgt
        tgt = t2
    w_eff = (p.weights.float() * p.sm_scale).contiguous()
    tl = p.topk_length if p.topk_length is not None else host.dummy(torch.int32, p.device)
    return idx.contiguous(), tgt.contiguous(), w_eff, tl, topk_p


def run_loss_fwd(p):
    idx, tgt, w_eff, tl, topk_p = _loss_inputs(p)
    cap = 2048 if topk_p <= 2048 else MAX_TOPK
    has_tl, arch = p.topk_length is not None, _arch(p)
    pf, parts, rot, var = _loss_prefetch(), sum_parts(), _loss_rotate(), loss_fwd_variant()
    if var.startswith("online"):
        cap = 64  # no logits row in smem: one compile for every topk
    fn = cached(("IndexerLossFwdSm90", p.d, has_tl, cap, pf, parts, rot, var, arch),
                lambda: _compile_loss_fwd(p.d, has_tl, cap, arch, pf, parts, rot, var))
    loss = host.alloc((p.s_q,), torch.float32, p.device)
    lse = host.alloc((p.s_q,), torch.float32, p.device)
    inv = host.alloc((p.s_q,), torch.float32, p.device)
    fn(p.q, p.k, w_eff, idx, tl, tgt, loss, lse, inv)
    return loss, lse, inv


def dk_mode(deterministic: bool) -> str:
    """The loss backward's dk mode for this call (environment: :data:`ENV_DK`, :data:`ENV_DET`)."""
    if deterministic:
        mode = os.environ.get(ENV_DET, "grouped").strip().lower() or "grouped"
        if mode not in DET_MODES:
            raise ValueError(f"{ENV_DET}={mode!r}: expected one of {', '.join(DET_MODES)}")
        return mode
    mode = os.environ.get(ENV_DK, "red").strip().lower() or "red"
    if mode not in ("red", "red_bf16", "bulk", "none"):
        raise ValueError(f"{ENV_DK}={mode!r}: expected red, red_bf16, bulk or none (profiling: no dk)")
    return mode


def fixed_point_scale(q: torch.Tensor, w_eff: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``2^e`` (float32 ``[1]``, on the device, no synchronisation) for the fixed-point dk: the
    largest power of two with ``4 B 2^e <= 2^62``, ``B = max|q| sum_t |g_t| sum_j |w_eff[t, j]|``
    bounding every partial sum of every dk element (see the module docstring); clamped to
    ``2^[-126, 126]``.  One ``max|q|`` over the whole tensor (a full reduction: 0.19 ms at S 32k on
    an H200, where the per-query maxima took 0.35); the bound is at most that much looser, out of
    ~60 bits of resolution."""
    lo, hi = torch.aminmax(q)
    qmax = torch.maximum(lo.float().abs(), hi.float().abs())
    bound = (g.abs() * w_eff.abs().sum(1)).sum() * qmax * 4.0
    e = torch.floor(62.0 - torch.log2(bound.clamp_min(2.0 ** -120)))
    e = torch.nan_to_num(e, nan=-126.0, posinf=126.0, neginf=-126.0).clamp(-126.0, 126.0)
    return torch.exp2(e).reshape(1).float().contiguous()


def grouped_workspace_bytes() -> int:
    """The ``grouped`` mode's workspace bound for this call (:data:`ENV_DET_WS`)."""
    v = os.environ.get(ENV_DET_WS, "").strip()
    if not v:
        return GROUPED_WORKSPACE_BYTES
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"{ENV_DET_WS}={v!r}: expected a positive number of MiB")
    return int(v) << 20


def _key_groups_fn(place: bool, has_tl: bool, arch: str):
    def build():
        from ..common.key_groups import compile_key_groups

        return compile_key_groups(place, has_tl, KEY_GROUP_CHUNK, arch)

    return cached(("KeyGroups", place, has_tl, KEY_GROUP_CHUNK, arch), build)


def _fixed_segment_sum_fn(d: int, arch: str):
    def build():
        from ..common.segment_sum import compile_fixed_segment_sum

        return compile_fixed_segment_sum(d, arch)

    return cached(("FixedSegmentSum", d, arch), build)


def _from_fixed(acc: torch.Tensor, scale: torch.Tensor, p) -> torch.Tensor:
    """dk from the int64 fixed-point accumulator ``acc`` (``/ scale`` in float64, then k's dtype
    and shape)."""
    return acc.double().div_(scale.double()).to(p.k.dtype).reshape(p.k_shape)


def _grouped_dk(p, fn, args_of, idx, tl, inv, topk_p, scale):
    """The ``grouped`` deterministic dk: per wave of queries every valid slot gets a workspace row
    in its key's segment (``KeyGroups``: per-chunk counts, prefix sums, placement), the kernel
    stores the slot's dK row there as bf16 (``slots_bf16``) and each key's rows are added in
    fixed point into an int64 ``[s_kv, d]`` accumulator (``FixedSegmentSum``: one writer per key;
    integer sums, so neither the placement's order nor the waves change a bit).  Returns the
    accumulator."""
    dev, arch, has_tl = p.device, _arch(p), p.topk_length is not None
    wave = max(1, min(p.s_q, grouped_workspace_bytes() // (topk_p * p.d * 2)))
    ws = torch.empty(wave * topk_p, p.d, dtype=torch.bfloat16, device=dev)
    pos = torch.empty(wave, topk_p, dtype=torch.int32, device=dev)
    per_chunk = torch.empty(-(-wave // KEY_GROUP_CHUNK), p.s_kv, dtype=torch.int32, device=dev)
    start = torch.zeros(p.s_kv + 1, dtype=torch.int32, device=dev)  # start[0] stays 0
    acc = torch.zeros(p.s_kv, p.d, dtype=torch.int64, device=dev)
    count, place = _key_groups_fn(False, has_tl, arch), _key_groups_fn(True, has_tl, arch)
    seg_sum = _fixed_segment_sum_fn(p.d, arch)
    for c0 in range(0, p.s_q, wave):
        c1 = min(p.s_q, c0 + wave)
        tl_c = tl[c0:c1] if has_tl else tl
        cnt = per_chunk[: -(-(c1 - c0) // KEY_GROUP_CHUNK)]
        count(idx[c0:c1], tl_c, inv[c0:c1], cnt, pos, start, p.s_kv)
        # the counts summed over the chunks up to each chunk (inclusive) and over the keys (the
        # segment starts); place adds the two into each chunk's first row per key
        incl = torch.cumsum(cnt, 0, dtype=torch.int32)
        torch.cumsum(incl[-1], 0, dtype=torch.int32, out=start[1:])
        place(idx[c0:c1], tl_c, inv[c0:c1], incl, pos, start, p.s_kv)
        fn(*args_of(c0, c1), ws, scale, pos[: c1 - c0], p.sm_scale)
        seg_sum(ws, start, acc, scale)
    return acc


def run_loss_bwd(p, grad_rows, lse, inv, deterministic: bool):
    from ..common.bwd_host import reduce_slot_rows
    from ..reference import valid_mask

    idx, tgt, w_eff, tl, topk_p = _loss_inputs(p)
    has_tl, arch = p.topk_length is not None, _arch(p)
    mode = dk_mode(deterministic)
    kmode = "slots_bf16" if mode == "grouped" else mode  # the kernel's dk mode
    pf, parts = _loss_prefetch(), sum_parts()
    fn = cached(("IndexerLossBwdSm90", p.d, has_tl, kmode, pf, parts, arch),
                lambda: _compile_loss_bwd(p.d, has_tl, deterministic, arch, kmode, pf, parts))
    dev = p.device
    g = grad_rows.float().contiguous()
    lse, inv = lse.float().contiguous(), inv.float().contiguous()
    dq = host.alloc((p.s_q, p.h, p.d), torch.bfloat16, dev)
    dw = host.alloc((p.s_q, p.h), torch.float32, dev)
    one = host.dummy(torch.float32, dev, (1,))
    nopos = host.dummy(torch.int32, dev, (1, 1))  # the slots' workspace rows: only the grouped mode's

    def args_of(c0, c1):
        """The kernel's inputs and dq / dw outputs for the queries ``[c0, c1)`` (a wave)."""
        tl_c = tl[c0:c1] if has_tl else tl
        return (p.q[c0:c1], p.k, w_eff[c0:c1], idx[c0:c1], tl_c, tgt[c0:c1], lse[c0:c1], inv[c0:c1], g[c0:c1],
                dq[c0:c1], dw[c0:c1])

    if mode == "grouped":
        scale = fixed_point_scale(p.q, w_eff, g)
        acc = _grouped_dk(p, fn, args_of, idx, tl, inv, topk_p, scale)
        return dq, _from_fixed(acc, scale, p), dw.to(p.weights.dtype)
    if mode.startswith("fixed"):
        scale = fixed_point_scale(p.q, w_eff, g)
        acc = torch.zeros(p.s_kv, p.d, dtype=torch.int64, device=dev)
        fn(p.q, p.k, w_eff, idx, tl, tgt, lse, inv, g, dq, dw, acc, scale, nopos, p.sm_scale)
        return dq, _from_fixed(acc, scale, p), dw.to(p.weights.dtype)
    if mode == "red_bf16":  # bf16 atomics: the sums rounded to bf16 at every addition (opt-in)
        dk_acc = torch.zeros(p.s_kv, p.d, dtype=torch.bfloat16, device=dev)
        fn(p.q, p.k, w_eff, idx, tl, tgt, lse, inv, g, dq, dw, dk_acc, one, nopos, p.sm_scale)
        return dq, dk_acc.to(p.k.dtype).reshape(p.k_shape), dw.to(p.weights.dtype)
    dk_acc = torch.zeros(p.s_kv, p.d, dtype=torch.float32, device=dev)
    if not deterministic:
        fn(p.q, p.k, w_eff, idx, tl, tgt, lse, inv, g, dq, dw, dk_acc, one, nopos, p.sm_scale)
    else:
        per_q = topk_p * p.d * 4
        wave = max(1, min(p.s_q, DET_WORKSPACE_BYTES // per_q))
        ws = torch.empty(wave * topk_p, p.d, dtype=torch.float32, device=dev)
        valid = valid_mask(idx, p.s_kv, p.topk_length) & (inv > 0)[:, None]
        for c0 in range(0, p.s_q, wave):
            c1 = min(p.s_q, c0 + wave)
            fn(*args_of(c0, c1), ws, one, nopos, p.sm_scale)
            reduce_slot_rows(dk_acc, ws, idx[c0:c1], valid[c0:c1], 1)
    dk = dk_acc.to(p.k.dtype).reshape(p.k_shape)
    return dq, dk, dw.to(p.weights.dtype)
