"""The sm90 (Hopper) backend: CuTe DSL kernels compiled for sm_90a.

``BACKEND`` is what ``mla_kernels.dispatch`` uses.  Kernels live one per file:
``fwd.py`` (sparse forward), ``attn_dist.py`` (attention distribution), ``bwd.py`` (backward:
dQ, dKV and optionally the attention sum); the lightning indexer's ``indexer_score.py``,
``indexer_topk.py``, ``indexer_loss_fwd.py`` and ``indexer_loss_bwd.py`` with their host side in
``indexer_host.py``.  The backward's small host-side pieces (lse' and
delta' per row, the dKV workspace conversion, the deterministic mode's fixed-order reduction,
d_attn_sink) live in ``common/bwd_host.py`` (shared with sm100).
"""

from __future__ import annotations

from typing import Optional

from .. import _compile
from ..common import decode_host, fastpath
from ..common.kernel_backend import (
    CuteKernelBackend, attn_dist_fake_args, bwd_fake_args, cached, fwd_fake_args,
)
from ..common.problem import Problem

__all__ = [
    "BACKEND", "Sm90Backend", "compile_fwd", "compile_attn_dist", "compile_bwd", "compile_decode",
    "compile_decode_narrow", "compile_combine",
]


def compile_fwd(d_qk: int, h_q: int, has_topk_length: bool, has_sink: bool, arch: str = "sm_90a",
                ring_alt: Optional[bool] = None, rotate_shift: int = 0, **kw):
    """Compile the sm90 forward for one static configuration (no GPU needed); ``ring_alt``: the
    alternating KV ring (None: :data:`DEFAULT_FWD_RING`, see :func:`fwd_ring`); ``rotate_shift``:
    the rotated pair order (``SparseMlaFwdSm90``; for kv-ordered slots)."""
    from .fwd import SparseMlaFwdSm90

    kernel = SparseMlaFwdSm90(d_qk, 512, has_topk_length, has_sink, rotate_shift=rotate_shift)
    kernel.ring_alt = DEFAULT_FWD_RING == "alt" if ring_alt is None else bool(ring_alt)
    return kernel, _compile.compile_kernel(kernel, *fwd_fake_args(d_qk, h_q), arch=arch, **kw)


FWD_RINGS = ("fixed", "alt")
DEFAULT_FWD_RING = "alt"


def fwd_ring() -> str:
    """The forward's KV ring, read per call: ``MLA_KERNELS_FWD_RING`` = ``alt`` (default: the right
    halves of the two buffers swap owners every block pair, as in decode's direct mode --
    ``common/decode_device.PairedBlockConsumer.loop``; H200, interleaved: 1.2-2.8% faster at h_q
    128 s_kv 8k / 32k and h_q 64, docs/PERF.md) or ``fixed`` (block 0 of every pair in buffer 0).
    Bit for bit the same outputs."""
    return fastpath.knob_choice("MLA_KERNELS_FWD_RING", FWD_RINGS, DEFAULT_FWD_RING)


def attn_dist_mode(h_q: int) -> str:
    """``heads`` (128 heads per CTA) when h_q is a multiple of 128, else ``tokens`` (64 per CTA)."""
    return "heads" if h_q % 128 == 0 else "tokens"


def attn_dist_ctas(device, h_q: int = 128, s_q: int = 1 << 30) -> int:
    """The attention distribution's grid: ``N`` > 0 -- persistent, at most N CTAs each running
    several (token, head group) items; 0 -- one CTA per item.

    ``MLA_KERNELS_ATTN_DIST_CTAS`` chooses: unset or ``auto`` (the default) -- persistent with one
    CTA per SM (a CTA fills an SM's shared memory) when there are more items than SMs -- in
    ``tokens`` mode only with Q through the KV ring (:func:`attn_dist_q_ring`), without it one CTA
    per item --, else one CTA per item; ``0`` -- one CTA per item always; ``N`` -- at most N CTAs
    in every mode (tests use a few, so that every CTA runs many items).  Measured on an H200
    (docs/PERF.md): persistent +5-6% at h_q 128; in ``tokens`` mode (h_q 64, s_kv 32k) 1.077x with
    Q through the ring, 0.977x with Q from global memory."""
    env = fastpath.knob("MLA_KERNELS_ATTN_DIST_CTAS", "").strip()
    if env in ("", "auto"):
        heads = attn_dist_mode(h_q) == "heads"
        if not heads and not attn_dist_q_ring():
            return 0
        from ..decode import device_sm_count

        n_sm = device_sm_count(device)
        items = s_q * (h_q // 128 if heads else h_q // 64)
        return n_sm if items > n_sm else 0
    try:
        n = int(env)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"MLA_KERNELS_ATTN_DIST_CTAS must be 'auto' or an integer >= 0, got {env!r}")
    return n


def attn_dist_q_vec() -> bool:
    """How the attention distribution loads Q into the wgmma's A registers:
    ``MLA_KERNELS_ATTN_DIST_QVEC`` unset or ``1`` -- by 16-byte loads and a word transpose in each
    lane quad (the default: +2-3% at h_q 128 persistent, +3-5% in ``tokens`` mode on an H200,
    docs/PERF.md); ``0`` -- by 4-byte loads.  Bitwise the same results."""
    env = fastpath.knob("MLA_KERNELS_ATTN_DIST_QVEC", "").strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"MLA_KERNELS_ATTN_DIST_QVEC must be 0 or 1, got {env!r}")
    return env != "0"


def attn_dist_q_ring() -> bool:
    """Where the attention distribution's persistent grid takes each item's Q from:
    ``MLA_KERNELS_ATTN_DIST_QRING`` unset or ``1`` -- the producer gathers it into the KV ring ahead
    of the item's KV blocks and the consumers load it from shared memory (the default: 1.012-1.024x
    at h_q 128, and what makes the persistent grid pay in ``tokens`` mode, on an H200, docs/PERF.md);
    ``0`` -- the consumers load it from global memory at the item's start (and ``tokens`` mode
    defaults to one CTA per item, :func:`attn_dist_ctas`).  The same values (bitwise, up to the
    grouping of ``tokens`` mode's fused normalising total); one-item grids take the global path."""
    env = fastpath.knob("MLA_KERNELS_ATTN_DIST_QRING", "").strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"MLA_KERNELS_ATTN_DIST_QRING must be 0 or 1, got {env!r}")
    return env != "0"


def compile_attn_dist(d_qk: int, h_q: int, normalize: bool, has_topk_length: bool, arch: str = "sm_90a",
                      ctas: int = 0, profile: str = "", q_vec: bool = True, q_ring: bool = False, **kw):
    """Compile the sm90 attention distribution for one static configuration (no GPU needed).

    ``normalize`` is fused only when one CTA covers all heads of a token (h_q 64 or 128);
    ``ctas`` > 0 makes the grid persistent with at most that many CTAs (see ``attn_dist.py``)."""
    from .attn_dist import AttnDistSm90

    kernel = AttnDistSm90(d_qk, attn_dist_mode(h_q), normalize, has_topk_length, ctas, profile, q_vec, q_ring)
    return kernel, _compile.compile_kernel(kernel, *attn_dist_fake_args(d_qk, h_q, 64), arch=arch, **kw)


def compile_bwd(d_qk: int, h_q: int, has_topk_length: bool, attn_sum: bool = False,
                attn_sum_scaled: bool = False, deterministic: bool = False, has_dlse: bool = False,
                arch: str = "sm_90a", **kw):
    """Compile the sm90 backward for one static configuration (no GPU needed)."""
    from .bwd import SparseMlaBwdSm90

    # h_q % 128 == 0: the two head blocks of a token sum their dKV chunks on chip (2-CTA cluster)
    kernel = SparseMlaBwdSm90(d_qk, 512, has_topk_length, has_dlse, attn_sum, attn_sum_scaled, deterministic,
                              pair_sum=kw.pop("pair_sum", h_q % 128 == 0), trace=kw.pop("trace", False),
                              rotate_shift=kw.pop("rotate_shift", 0), defer_scatter=kw.pop("defer_scatter", False))
    if deterministic:
        import torch

        kernel.det_ws_dtype = torch.bfloat16  # bf16 per-slot rows (see SparseMlaBwdSm90.det_ws_dtype)
    return kernel, _compile.compile_kernel(kernel, *bwd_fake_args(d_qk, h_q, bf16_workspace=deterministic),
                                           arch=arch, **kw)


def compile_decode(d_qk: int, h_q: int, split: bool, arch: str = "sm_90a", l2_prefetch: int = 128,
                   fused: bool = False, evict_first: bool = False, parts_bf16: bool = False, cluster: int = 0,
                   cluster_bf16: bool = False, cluster_l2: bool = False, **kw):
    """Compile the sm90 split decode for h_q a multiple of 64 (no GPU needed); ``fused`` (split
    only): the combine folded in; ``parts_bf16`` (split, not fused): bf16 partial outputs;
    ``cluster`` (split only: 2..16 CTAs; 2, 4, 8 or 16 with ``cluster_l2``): the splits of a row
    merge over DSMEM as one cluster and the kernel writes the bf16 output (the direct mode's arguments), ``cluster_bf16``: the
    staged partials in bf16; ``cluster_l2``: the partials exchanged through the float32 workspace
    in global memory instead (the fused kernel's arguments)."""
    from ..common.decode_host import compile_decode_kernel
    from .decode import SparseMlaDecodeSm90, SparseMlaDecodeSm90ClusterL2, SparseMlaDecodeSm90Fused

    fused = fused and split
    cluster = cluster if split and not fused else 0
    if cluster and cluster_l2:
        kernel = SparseMlaDecodeSm90ClusterL2(d_qk, cluster, l2_prefetch=l2_prefetch, evict_first=evict_first)
        return compile_decode_kernel(kernel, d_qk, h_q, True, arch, fused=True, **kw)
    kernel = (SparseMlaDecodeSm90Fused(d_qk, l2_prefetch=l2_prefetch, evict_first=evict_first) if fused
              else SparseMlaDecodeSm90(d_qk, split, l2_prefetch=l2_prefetch, evict_first=evict_first,
                                       parts_bf16=parts_bf16, cluster=cluster, cluster_bf16=cluster_bf16))
    return compile_decode_kernel(kernel, d_qk, h_q, split and not cluster, arch, fused=fused, **kw)


def compile_decode_narrow(d_qk: int, h_q: int, split: bool, arch: str = "sm_90a", l2_prefetch: int = 128,
                          fused: bool = False, evict_first: bool = False, parts_bf16: bool = False, cluster: int = 0,
                          cluster_bf16: bool = False, cluster_l2: bool = False, **kw):
    """Compile the sm90 decode for h_q 8/16/24/32 (heads on the MMA's N side; no GPU needed);
    ``fused`` (split only): the combine folded in; ``parts_bf16`` (split, not fused): bf16 partial
    outputs; ``cluster`` (split only: 2..16 CTAs, each merging ceil(h_q / cluster) heads or a
    share of one head's columns): a token's splits merge over DSMEM as one cluster and the kernel
    writes the bf16 output (the direct mode's arguments),
    ``cluster_bf16``: the staged partials in bf16.  ``cluster_l2`` (the 64-head kernel's L2
    staging) is not built for this kernel: a ValueError."""
    from ..common.decode_host import compile_decode_kernel
    from .decode_narrow import SparseMlaDecodeNarrowSm90, SparseMlaDecodeNarrowSm90Fused

    fused = fused and split
    cluster = cluster if split and not fused else 0
    if cluster and cluster_l2:
        raise ValueError("the narrow decode kernel merges clusters over DSMEM only (no L2 staging)")
    kernel = (SparseMlaDecodeNarrowSm90Fused(d_qk, h_q, l2_prefetch=l2_prefetch, evict_first=evict_first) if fused
              else SparseMlaDecodeNarrowSm90(d_qk, h_q, split, l2_prefetch=l2_prefetch, evict_first=evict_first,
                                             parts_bf16=parts_bf16, cluster=cluster, cluster_bf16=cluster_bf16))
    return compile_decode_kernel(kernel, d_qk, h_q, split and not cluster, arch, fused=fused, **kw)


def compile_combine(d_v: int, in_dtype: str = "f32", out_dtype: str = "bf16", arch: str = "sm_90a",
                    pdl: bool = False, **kw):
    """Compile the lse combine (``common/combine.py``) for sm_90a (no GPU needed)."""
    from ..common.combine import compile_combine as _cc

    return _cc(d_v, in_dtype, out_dtype, arch, pdl, **kw)


class Sm90Backend(CuteKernelBackend):
    name = "sm90"
    topk_block = 64
    hardware_verified = True
    compile_bwd = staticmethod(compile_bwd)
    bwd_name = "SparseMlaBwdSm90"
    bwd_sort_indices = True  # H200, s_kv 32k: h_q 64 1.35x, h_q 128 1.01x (docs/PERF.md)
    bwd_defer_max_skv = 16384  # defer_scatter up to this s_kv: the workspace in L2 (bwd_host.defer_scatter_for; docs/PERF.md)
    bwd_rotate_shift = 13  # H200, h_q 128: s_kv 128k / 64k 1.08x / 1.06x, 8k / 32k ~1.01x (docs/PERF.md)
    fwd_sort_indices = True  # long kv ranges only (order_host.fwd_order_wanted; docs/PERF.md)
    attn_dist_sort_indices = True  # opt-in, MLA_KERNELS_ATTN_DIST_ORDER=1 (order_host.attn_dist_order_wanted)
    fwd_rotate_shift = 12  # opt-in, on kv-ordered slots (order_host.fwd_rotate_shift_for; docs/PERF.md)

    def device_reason(self, major: int, minor: int) -> Optional[str]:
        return None if (major, minor) == (9, 0) else "not a compute capability 9.0 (Hopper) device"

    def fwd_kernel(self, p: Problem, rotate_shift: int = 0):
        arch = _compile.arch_for_device(p.device)
        has_tl, has_sink = p.topk_length is not None, p.attn_sink is not None
        ring = fwd_ring()
        # (the default ring and order keep the kernel's cache key)
        key = ("SparseMlaFwdSm90", p.d_qk, p.h_q, has_tl, has_sink, arch)
        key = key + (() if ring == DEFAULT_FWD_RING else (ring,))
        key = key + ((("rotate_shift", rotate_shift),) if rotate_shift else ())
        return cached(key, lambda: compile_fwd(p.d_qk, p.h_q, has_tl, has_sink, arch, ring_alt=ring == "alt",
                                               rotate_shift=rotate_shift))

    # -- decode and merge (common/decode_host.py) ------------------------------------------------
    def supports(self, op, p):
        if op == "decode":
            return decode_host.decode_reason(p)
        if op == "merge":
            return decode_host.merge_reason(p)
        return super().supports(op, p)

    def prepare_decode(self, plan):
        decode_host.prepare_decode(plan, compile_decode, compile_decode_narrow, compile_combine)

    def decode(self, plan, q, kv_cache, indices, sm_scale, topk_length, attn_sink, block_table, q_bias):
        return decode_host.run_decode(plan, q, kv_cache, indices, sm_scale, topk_length, attn_sink, block_table,
                                      q_bias)

    def merge(self, outs, lses, attn_sink, out_dtype):
        return decode_host.run_merge(outs, lses, attn_sink, out_dtype, compile_combine, outs.device)

    def attn_dist_heads_per_cta(self, h_q: int) -> int:
        return 128 if attn_dist_mode(h_q) == "heads" else 64

    def attn_dist_kernel(self, p: Problem, fused_normalize: bool):
        arch = _compile.arch_for_device(p.device)
        has_tl = p.topk_length is not None
        ctas = attn_dist_ctas(p.device, p.h_q, p.s_q)
        # timing copies (wrong outputs) for measurements, MLA_KERNELS_ATTN_DIST_PROFILE: noq (persistent
        # grids only) -- a CTA's later items reuse its first item's Q, so the difference is the Q
        # loads; gather -- the KV gather alone (the consumers free each block as it lands)
        prof = fastpath.knob("MLA_KERNELS_ATTN_DIST_PROFILE", "")
        if prof == "noq" and not ctas:
            prof = ""
        qvec = attn_dist_q_vec()
        # Q through the KV ring (persistent grids only)
        qring = attn_dist_q_ring() and ctas > 0 and not prof
        return cached(("AttnDistSm90", p.d_qk, p.h_q, fused_normalize, has_tl, arch, ctas, prof, qvec, qring),
                      lambda: compile_attn_dist(p.d_qk, p.h_q, fused_normalize, has_tl, arch, ctas, prof, qvec,
                                                qring))


    # -- the indexer (host side in indexer_host.py) ---------------------------------------------
    def indexer_supports(self, op: str, p) -> Optional[str]:
        from . import indexer_host

        return indexer_host.supports(op, p)

    def indexer_logits(self, p):
        from . import indexer_host

        return indexer_host.run_logits(p)

    def indexer_topk(self, p, topk, return_logits):
        from . import indexer_host

        return indexer_host.run_topk(p, topk, return_logits)

    def indexer_loss_fwd(self, p):
        from . import indexer_host

        return indexer_host.run_loss_fwd(p)

    def indexer_loss_bwd(self, p, grad_rows, lse, inv_tsum, deterministic):
        from . import indexer_host

        return indexer_host.run_loss_bwd(p, grad_rows, lse, inv_tsum, deterministic)


BACKEND = Sm90Backend()
