"""Host side of the per-row kv-band slot order (``common/index_order.py``'s kernel), shared by the
sm90 backward (always, unless ``MLA_KERNELS_BWD_SORT=0``) and the sm90 forward (at h_q 64 when the
kv rows outgrow L2, :func:`fwd_order_wanted`).  Imports no DSL on the warm path: the kernel module
is imported only to compile."""

from __future__ import annotations

import torch

from .. import _compile
from . import fastpath, host
from .problem import Problem


#: Environment switch of :func:`kv_ordered` (``0``: the kernel gets the slots as given; for A/B
#: timing and for callers whose indices are already in kv order).
SORT_ENV = "MLA_KERNELS_BWD_SORT"


def sort_enabled() -> bool:
    return fastpath.knob(SORT_ENV, "1") != "0"


#: Environment switch of the forward's use of :func:`kv_ordered` (``auto``: :func:`fwd_order_wanted`'s
#: rule, ``1``: always, ``0``: never).
FWD_ORDER_ENV = "MLA_KERNELS_FWD_ORDER"
#: The values of the order knobs (anything else is a ValueError naming the knob).
ORDER_MODES = ("auto", "0", "1")
_L2_BYTES: dict = {}


def fwd_order_wanted(p: Problem) -> bool:
    """Whether the forward should run on :func:`kv_ordered` slots (or per ``MLA_KERNELS_FWD_ORDER``):
    at ``h_q`` 64 when the ``s_kv`` bf16 kv rows outgrow the L2 cache.  There the CTAs running
    together (one per token) gather from a band of the kv range that stays in L2.  Measured
    (docs/PERF.md, back-to-back calls, against the given order), h_q 64 s_kv 64k / 128k / 256k: an
    H100 0.92 / 0.81 / 0.79x the time, an H200 1.02 / 0.99 / 0.98-0.99x (its faster HBM serves the
    misses; earlier H200 runs read 0.98 / 0.94 / 0.94x); at h_q 128 (two CTAs per token read the
    same rows) 0.99-1.01x, so not used there; with the kv rows in L2 the order gains nothing and
    costs its kernel."""
    mode = fastpath.knob_choice(FWD_ORDER_ENV, ORDER_MODES, "auto")
    if mode == "0" or not p.indices.is_cuda or p.s_q == 0 or p.topk == 0:
        return False
    if mode == "1":
        return True
    if p.h_q != 64:
        return False
    key = p.device.index if p.device.index is not None else torch.cuda.current_device()
    l2 = _L2_BYTES.get(key)
    if l2 is None:
        l2 = _L2_BYTES[key] = int(getattr(torch.cuda.get_device_properties(key), "L2_cache_size", 0) or 50 << 20)
    return p.s_kv * p.d_qk * p.kv.element_size() > l2


#: Environment switch of ``attn_dist``'s use of :func:`kv_ordered` (``auto``:
#: :func:`attn_dist_order_wanted`'s rule, ``1``: always, ``0``: never).
ATTN_DIST_ORDER_ENV = "MLA_KERNELS_ATTN_DIST_ORDER"


def attn_dist_order_wanted(p: Problem) -> bool:
    """Whether ``attn_dist`` should run on :func:`kv_ordered` slots (its result is mapped back to
    the caller's slot order), per ``MLA_KERNELS_ATTN_DIST_ORDER``: ``1`` always; ``auto`` (the
    default) and ``0`` never.  An opt-in because no rule fits both GPUs measured (docs/PERF.md,
    back-to-back, s_q 4096, topk 2048, time against the given order): h_q 128 s_kv 32k / 64k / 128k
    H100 1.13 / 1.08 / **0.84x**, H200 1.12 / 1.11 / 1.09x; h_q 64 s_kv 64k / 128k H100 **0.83** /
    0.97x, H200 **0.87** / 0.97x (1.05x with the host work counted)."""
    mode = fastpath.knob_choice(ATTN_DIST_ORDER_ENV, ORDER_MODES, "auto")
    if mode == "0" or not p.indices.is_cuda or p.s_q == 0 or p.topk == 0:
        return False
    return mode == "1"


def to_given_order(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``x [s_q, topk]`` computed on :func:`kv_ordered` slots, back in the caller's slot order:
    ``out[t, perm[t, j]] = x[t, j]`` (``perm`` is a permutation of each row's slots)."""
    return torch.empty_like(x).scatter_(1, perm.long(), x)


#: Environment switch of the forward's rotated pair order on kv-ordered slots (``1``: on; ``0``,
#: the default: every CTA gathers its row's block pairs from the first).  See
#: :func:`fwd_rotate_shift_for`.
FWD_ROTATE_ENV = "MLA_KERNELS_FWD_ROTATE"


def fwd_rotate_shift_for(backend_shift: int) -> int:
    """The forward kernel's ``rotate_shift`` on kv-ordered slots: the backend's (sm90: a 2^12 ns
    tick, about one block pair of a CTA) when ``MLA_KERNELS_FWD_ROTATE`` is ``1``, else 0.  Each CTA
    then starts its row's pairs at ``(%globaltimer >> shift) % num_pairs``, so the CTAs running at
    any time gather from one kv band (the backward's rotated block order,
    ``bwd_host.rotate_shift_for``).  Off by default: measured against the fixed order on the same
    slots (docs/PERF.md, h_q 64, s_kv 64k / 128k / 256k, back-to-back) 0.96 / 0.96 / 0.99x the time
    on an H200 but 0.98 / 1.02 / 1.03x on an H100 -- where equal CTAs already run in step, wave after
    wave, through the same pairs -- and it makes ``out`` / ``lse`` vary in rounding run to run."""
    return rotate_shift_knob(backend_shift, FWD_ROTATE_ENV, "0")


def rotate_shift_knob(backend_shift: int, env: str, default: str) -> int:
    """``backend_shift`` (a rotated order's tick, 0: the backend has none) when the knob ``env``
    (``0`` / ``1``, ``default`` when unset) is ``1``, else 0: the forward's and the backward's
    rotation switches."""
    if not backend_shift:
        return 0
    return backend_shift if fastpath.knob_choice(env, ("0", "1"), default) == "1" else 0


def kv_ordered(p: Problem, want_perm: bool):
    """``(p with each row's slots grouped by kv band, perm)``.

    Each row's valid entries come first, ordered by band (63 bands over ``[0, s_kv)``; in slot
    order within a band), then -1 for the invalid ones (including slots past ``topk_length``,
    which stays valid: it still bounds the valid entries).  ``perm [s_q, topk]`` int32 (only with
    ``want_perm``, else None): the original slot of each entry.  Why: the backward's dKV
    scatter-add into a float32 workspace is bound by the L2/HBM read-modify-write, and with every
    row in kv order the CTAs running at the same time add into the same narrow band of rows, which
    stays in L2 (docs/PERF.md: H200, s_q 4096, topk 2048, s_kv 32k, h_q 64: 11.92 -> 8.80 ms).  One
    CTA per row (:class:`~mla_kernels.common.index_order.KvBandOrder`); the order depends only on
    the inputs, so the deterministic mode stays bitwise reproducible."""
    if p.s_q == 0 or p.topk == 0:
        return p, None
    dev = p.device
    arch = _compile.arch_for_device(dev)
    has_tl = p.topk_length is not None
    stage = stage_for(p.topk)
    _, fn = _compile.cached_compile(("KvBandOrder", has_tl, want_perm, stage, arch),
                                    lambda: _compile_index_order(has_tl, want_perm, arch, stage))
    out = torch.empty_like(p.indices)
    perm = torch.empty_like(p.indices) if want_perm else host.dummy(torch.int32, dev, (1, 1))
    tl = p.topk_length if has_tl else host.dummy(torch.int32, dev)
    fn(p.indices, tl, out, perm, p.s_kv, band_shift(p.s_kv))
    return p.with_indices(out), (perm if want_perm else None)


def band_shift(s_kv: int) -> int:
    """``common.index_order.band_shift`` (kept here so that the warm path imports no DSL)."""
    return max(0, (max(s_kv, 1) - 1).bit_length() - 6)


def stage_for(topk: int) -> int:
    """``common.index_order.stage_for`` (kept here so that the warm path imports no DSL)."""
    if topk > 8192:
        return 0
    return 1 << max(0, (max(topk, 1) - 1).bit_length())


def _compile_index_order(has_tl: bool, want_perm: bool, arch: str, stage: int):
    from .index_order import compile_index_order  # the kernel module (imports the DSL): only to compile

    return compile_index_order(has_tl, want_perm, arch, stage)
