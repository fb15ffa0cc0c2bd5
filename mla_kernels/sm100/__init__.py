"""The sm100 (Blackwell) backend: CuTe DSL kernels compiled for sm_100a / sm_103a.

``BACKEND`` is what ``mla_kernels.dispatch`` uses.  Kernels live one per file: ``fwd.py`` (sparse
forward, 64 heads per CTA, 1-CTA tcgen05), ``fwd_h128.py`` (sparse forward, 128 heads per 2-CTA
cluster, used when h_q is a multiple of 128), ``attn_dist.py`` (attention distribution) and
``bwd.py`` (backward, 64 heads per CTA) and ``bwd_h128.py`` (backward, 128 heads per 2-CTA
cluster, used when h_q is a multiple of 128); the backwards' host side is the shared
``common/bwd_host.py``.

The kernels are proven by compilation only (PTX -> SASS for sm_100a/sm_103a, see
``tools/compile_report.py``), never run: ``hardware_verified = False`` makes dispatch run a
first-use canary against the reference for every new configuration.
"""

from __future__ import annotations

from typing import Optional

from .. import _compile
from ..common import fastpath
from ..common.kernel_backend import (
    CuteKernelBackend, attn_dist_fake_args, bwd_fake_args, cached, fwd_fake_args,
)
from ..common.problem import Problem

__all__ = [
    "BACKEND", "Sm100Backend", "attn_dist_heads_per_cta", "compile_attn_dist", "compile_bwd", "compile_fwd",
    "fwd_head_groups", "fwd_two_cta",
]

#: The API pads topk to a multiple of this: attn_dist's block (its MMA M, 128 tokens); the
#: forward's 64-token blocks divide it.
TOPK_BLOCK = 128
#: Heads per forward CTA (the forward's MMA M per CTA); h_q = 64 k runs k CTAs per query token.
FWD_HEADS_PER_CTA = 64


def fwd_head_groups(h_q: int) -> int:
    """CTAs per query token of the forward (grid = s_q x this), for either kernel."""
    if h_q % FWD_HEADS_PER_CTA:
        raise ValueError(f"h_q={h_q} is not a multiple of {FWD_HEADS_PER_CTA}")
    return h_q // FWD_HEADS_PER_CTA


#: Bring-up knob: ``auto`` (default), ``1cta`` (always the 1-CTA kernel) or ``2cta``.
ENV_FWD_KERNEL = "MLA_KERNELS_SM100_FWD"


def kernel_choice(env: str) -> str:
    """The bring-up knob ``env`` (:data:`ENV_FWD_KERNEL` / :data:`ENV_BWD_KERNEL`): ``auto``
    (default), ``1cta`` or ``2cta``; anything else raises."""
    choice = fastpath.knob(env, "auto").strip().lower() or "auto"
    if choice not in ("auto", "1cta", "2cta"):
        raise ValueError(f"{env}={choice!r}: expected auto, 1cta or 2cta")
    return choice


def fwd_two_cta(h_q: int) -> bool:
    """Which forward kernel serves ``h_q``: the 2-CTA one (``fwd_h128.py``, clusters of two
    64-head CTAs) when h_q is a multiple of 128, else the 1-CTA one (``fwd.py``).

    ``MLA_KERNELS_SM100_FWD=1cta`` forces the 1-CTA kernel for every h_q (``2cta`` insists on the
    2-CTA one where h_q allows it): both are compile-proven only, so the first hardware run may
    need to tell them apart."""
    return kernel_choice(ENV_FWD_KERNEL) != "1cta" and h_q % 128 == 0


def compile_fwd(d_qk: int, h_q: int, has_topk_length: bool, has_sink: bool, arch: str = "sm_100a",
                two_cta: Optional[bool] = None, **kw):
    """Compile the sm100 sparse forward for one static configuration (no GPU needed).

    ``two_cta`` picks the kernel (default :func:`fwd_two_cta`); the 1-CTA kernel serves any h_q."""
    if two_cta is None:
        two_cta = fwd_two_cta(h_q)
    if two_cta:
        if h_q % 128:
            raise ValueError(f"the 2-CTA forward needs h_q % 128 == 0, got {h_q}")
        from .fwd_h128 import SparseMlaFwdSm100H128 as Kernel
    else:
        from .fwd import SparseMlaFwdSm100 as Kernel

    kernel = Kernel(d_qk, 512, has_topk_length, has_sink)
    return kernel, _compile.compile_kernel(kernel, *fwd_fake_args(d_qk, h_q), arch=arch, **kw)


def attn_dist_heads_per_cta(h_q: int) -> int:
    """128 heads per CTA when h_q is a multiple of 128, else 64 (h_q a multiple of 64)."""
    return 128 if h_q % 128 == 0 else 64


def compile_attn_dist(d_qk: int, h_q: int, normalize: bool, has_topk_length: bool, arch: str = "sm_100a", **kw):
    """Compile the sm100 attention distribution for one static configuration (no GPU needed).

    ``normalize`` is fused only when one CTA covers all heads of a token (h_q 64 or 128)."""
    from .attn_dist import AttnDistSm100

    kernel = AttnDistSm100(d_qk, attn_dist_heads_per_cta(h_q), normalize, has_topk_length)
    return kernel, _compile.compile_kernel(kernel, *attn_dist_fake_args(d_qk, h_q, TOPK_BLOCK), arch=arch, **kw)


#: Bring-up knob of the backward: ``auto`` (default), ``1cta`` or ``2cta`` (as for the forward).
ENV_BWD_KERNEL = "MLA_KERNELS_SM100_BWD"


def bwd_two_cta(h_q: int) -> bool:
    """Which backward kernel serves ``h_q``: the 2-CTA one (``bwd_h128.py``: 128 heads per
    cluster, dKV summed over the pair before its scatter) when h_q is a multiple of 128, else the
    1-CTA one (``bwd.py``, 64 heads per CTA).  ``MLA_KERNELS_SM100_BWD=1cta`` forces the 1-CTA
    kernel for every h_q; both are compile-proven only."""
    return kernel_choice(ENV_BWD_KERNEL) != "1cta" and h_q % 128 == 0


def compile_bwd(d_qk: int, h_q: int, has_topk_length: bool, attn_sum: bool = False,
                attn_sum_scaled: bool = False, deterministic: bool = False, has_dlse: bool = False,
                arch: str = "sm_100a", **kw):
    """Compile the sm100 backward for one static configuration (no GPU needed).  Same arguments
    (and kernel argument order) as ``sm90.compile_bwd``: ``common.bwd_host.run_bwd`` drives both.

    Keyword ``two_cta`` (taken from ``kw`` so that the signature stays the sm90 one) picks the
    kernel: default :func:`bwd_two_cta` (the 2-CTA ``bwd_h128.py`` for h_q % 128 == 0, else the
    1-CTA ``bwd.py``)."""
    two_cta = kw.pop("two_cta", None)
    if two_cta is None:
        two_cta = bwd_two_cta(h_q)
    if two_cta:
        if h_q % 128:
            raise ValueError(f"the 2-CTA sm100 backward needs h_q % 128 == 0, got {h_q}")
        from .bwd_h128 import SparseMlaBwdSm100H128 as Kernel
    else:
        from .bwd import SparseMlaBwdSm100 as Kernel

    kernel = Kernel(d_qk, 512, has_topk_length, has_dlse, attn_sum, attn_sum_scaled, deterministic)
    return kernel, _compile.compile_kernel(kernel, *bwd_fake_args(d_qk, h_q), arch=arch, **kw)


class Sm100Backend(CuteKernelBackend):
    name = "sm100"
    topk_block = TOPK_BLOCK
    hardware_verified = False
    compile_bwd = staticmethod(compile_bwd)

    @property
    def bwd_name(self) -> str:
        """The backward's compile-cache key: the bring-up knob can switch the kernel of an h_q."""
        return "SparseMlaBwdSm100/" + kernel_choice(ENV_BWD_KERNEL)

    def device_reason(self, major: int, minor: int) -> Optional[str]:
        if major != 10:
            return f"not a compute capability 10.x (Blackwell) device (this one is {major}.{minor})"
        return None

    def config_key(self, op: str, p: Problem) -> tuple:
        # The first-use canary is per kernel: the bring-up knob can switch the forward's kernel.
        key = super().config_key(op, p)
        if op == "fwd":
            return key + (fwd_two_cta(p.h_q),)
        if op == "bwd":
            return key + (bwd_two_cta(p.h_q),)
        return key

    def fwd_kernel(self, p: Problem, rotate_shift: int = 0):
        assert not rotate_shift, "sm100 has no rotated pair order (fwd_rotate_shift = 0)"
        arch = _compile.arch_for_device(p.device)
        has_tl, has_sink = p.topk_length is not None, p.attn_sink is not None
        two_cta = fwd_two_cta(p.h_q)
        return cached(("SparseMlaFwdSm100", two_cta, p.d_qk, p.h_q, has_tl, has_sink, arch),
                      lambda: compile_fwd(p.d_qk, p.h_q, has_tl, has_sink, arch, two_cta))

    def attn_dist_heads_per_cta(self, h_q: int) -> int:
        return attn_dist_heads_per_cta(h_q)

    def attn_dist_kernel(self, p: Problem, fused_normalize: bool):
        arch = _compile.arch_for_device(p.device)
        has_tl = p.topk_length is not None
        return cached(("AttnDistSm100", p.d_qk, p.h_q, fused_normalize, has_tl, arch),
                      lambda: compile_attn_dist(p.d_qk, p.h_q, fused_normalize, has_tl, arch))


BACKEND = Sm100Backend()
