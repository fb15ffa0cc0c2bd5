"""The sm100 (Blackwell) backend: CuTe DSL kernels compiled for sm_100a / sm_103a.

``BACKEND`` is what ``mla_kernels.dispatch`` uses.  Kernels live one per file: ``fwd.py`` (sparse
forward, 64 heads per CTA, 1-CTA tcgen05), ``fwd_h128.py`` (sparse forward, 128 heads per 2-CTA
cluster, used when h_q is a multiple of 128), ``attn_dist.py`` (attention distribution) and
``bwd.py`` (backward, 64 heads per CTA; its host side is the shared ``common/bwd_host.py``).

The kernels are proven by compilation only (PTX -> SASS for sm_100a/sm_103a, see
``tools/compile_report.py``), never run: ``hardware_verified = False`` makes dispatch run a
first-use canary against the reference for every new configuration.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from .. import _compile
from ..common import host
from ..common.backend import Backend
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


def fwd_two_cta(h_q: int) -> bool:
    """Which forward kernel serves ``h_q``: the 2-CTA one (``fwd_h128.py``, clusters of two
    64-head CTAs) when h_q is a multiple of 128, else the 1-CTA one (``fwd.py``).

    ``MLA_KERNELS_SM100_FWD=1cta`` forces the 1-CTA kernel for every h_q (``2cta`` insists on the
    2-CTA one where h_q allows it): both are compile-proven only, so the first hardware run may
    need to tell them apart."""
    choice = os.environ.get(ENV_FWD_KERNEL, "auto").strip().lower() or "auto"
    if choice not in ("auto", "1cta", "2cta"):
        raise ValueError(f"{ENV_FWD_KERNEL}={choice!r}: expected auto, 1cta or 2cta")
    return h_q % 128 == 0 and choice != "1cta"


def compile_fwd(d_qk: int, h_q: int, has_topk_length: bool, has_sink: bool, arch: str = "sm_100a",
                two_cta: Optional[bool] = None, **kw):
    """Compile the sm100 sparse forward for one static configuration (no GPU needed).

    ``two_cta`` picks the kernel (default :func:`fwd_two_cta`); the 1-CTA kernel serves any h_q."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    if two_cta is None:
        two_cta = fwd_two_cta(h_q)
    if two_cta:
        if h_q % 128:
            raise ValueError(f"the 2-CTA forward needs h_q % 128 == 0, got {h_q}")
        from .fwd_h128 import SparseMlaFwdSm100H128 as Kernel
    else:
        from .fwd import SparseMlaFwdSm100 as Kernel

    kernel = Kernel(d_qk, 512, has_topk_length, has_sink)
    s_q, s_q2, s_q3, s_q4, s_q5 = (cute.sym_int() for _ in range(5))
    s_kv = cute.sym_int()
    topk = cute.sym_int(divisibility=64)
    n_tl, n_sink = cute.sym_int(), cute.sym_int()
    args = (
        host.fake(BFloat16, (s_q, h_q, d_qk)),
        host.fake(BFloat16, (s_kv, d_qk)),
        host.fake(Int32, (s_q2, topk)),
        host.fake(Int32, (n_tl,), align=4),
        host.fake(Float32, (n_sink,), align=4),
        host.fake(BFloat16, (s_q3, h_q, 512)),
        host.fake(Float32, (s_q4, h_q), align=4),
        host.fake(Float32, (s_q5, h_q), align=4),
        Float32(1.0),
        host.fake_stream(),
    )
    compiled = _compile.compile_kernel(kernel, *args, arch=arch, **kw)
    return kernel, compiled


def attn_dist_heads_per_cta(h_q: int) -> int:
    """128 heads per CTA when h_q is a multiple of 128, else 64 (h_q a multiple of 64)."""
    return 128 if h_q % 128 == 0 else 64


def compile_attn_dist(d_qk: int, h_q: int, normalize: bool, has_topk_length: bool, arch: str = "sm_100a", **kw):
    """Compile the sm100 attention distribution for one static configuration (no GPU needed).

    ``normalize`` is fused only when one CTA covers all heads of a token (h_q 64 or 128)."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from .attn_dist import AttnDistSm100

    kernel = AttnDistSm100(d_qk, attn_dist_heads_per_cta(h_q), normalize, has_topk_length)
    s_q, s_q2, s_q3, s_q4, s_kv, n_tl, n_grp = (cute.sym_int() for _ in range(7))
    topk = cute.sym_int(divisibility=TOPK_BLOCK)
    topk2 = cute.sym_int(divisibility=TOPK_BLOCK)
    args = (
        host.fake(BFloat16, (s_q, h_q, d_qk)),
        host.fake(BFloat16, (s_kv, d_qk)),
        host.fake(Int32, (s_q2, topk)),
        host.fake(Int32, (n_tl,), align=4),
        host.fake(Float32, (s_q3, h_q), align=4),
        host.fake(Float32, (n_grp, s_q4, topk2), align=4),
        Float32(1.0),
        host.fake_stream(),
    )
    compiled = _compile.compile_kernel(kernel, *args, arch=arch, **kw)
    return kernel, compiled


#: Whether the 2-CTA backward (``bwd_h128.py``) is complete enough to serve dispatch.  It is not:
#: it compiles, but it is unverified on hardware and lacks attn_sum, so dispatch stays on the
#: 1-CTA kernel and the 2-CTA kernel is only in the compile report.
BWD_TWO_CTA_READY = False


def bwd_two_cta(h_q: int) -> bool:
    """Which backward kernel serves ``h_q`` by default (False: the 1-CTA ``bwd.py``)."""
    return BWD_TWO_CTA_READY and h_q % 128 == 0


def compile_bwd(d_qk: int, h_q: int, has_topk_length: bool, attn_sum: bool = False,
                attn_sum_scaled: bool = False, deterministic: bool = False, has_dlse: bool = False,
                arch: str = "sm_100a", **kw):
    """Compile the sm100 backward for one static configuration (no GPU needed).  Same arguments
    (and kernel argument order) as ``sm90.compile_bwd``: ``common.bwd_host.run_bwd`` drives both.

    Keyword ``two_cta`` (taken from ``kw`` so that the signature stays the sm90 one) picks the
    kernel: default :func:`bwd_two_cta` (currently always the 1-CTA kernel, ``bwd.py``); ``True``
    compiles the 2-CTA h128 kernel (``bwd_h128.py``, compile-only, not wired into dispatch: h_q %
    128 == 0, no attn_sum)."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

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
    sq = [cute.sym_int() for _ in range(10)]
    s_kv, n_ws, n_tl, n_grp = (cute.sym_int() for _ in range(4))
    topk = cute.sym_int(divisibility=64)
    topk2 = cute.sym_int(divisibility=64)
    args = (
        host.fake(BFloat16, (sq[0], h_q, d_qk)),  # q
        host.fake(BFloat16, (s_kv, d_qk)),  # kv
        host.fake(BFloat16, (sq[1], h_q, 512)),  # dout
        host.fake(BFloat16, (sq[2], h_q, 512)),  # out
        host.fake(Int32, (sq[3], topk)),  # indices
        host.fake(Int32, (n_tl,), align=4),  # topk_length
        host.fake(Float32, (sq[4], h_q), align=4),  # lse2
        host.fake(Float32, (sq[5], h_q), align=4),  # delta correction
        host.fake(Float32, (sq[6], h_q), align=4),  # delta out
        host.fake(Float32, (sq[7], h_q), align=4),  # attn_sum scale
        host.fake(BFloat16, (sq[8], h_q, d_qk)),  # dq
        host.fake(Float32, (n_ws, d_qk)),  # dkv workspace
        host.fake(Float32, (sq[9], n_grp, topk2), align=4),  # attn_sum partials
        Float32(1.0),
        Float32(1.0),
        host.fake_stream(),
    )
    compiled = _compile.compile_kernel(kernel, *args, arch=arch, **kw)
    return kernel, compiled


class Sm100Backend(Backend):
    name = "sm100"
    topk_block = TOPK_BLOCK
    hardware_verified = False

    _dsl_error: Optional[str] = None
    _dsl_checked = False

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        if device.type != "cuda":
            return "not a CUDA device"
        major, minor = torch.cuda.get_device_capability(device)
        if major != 10:
            return f"not a compute capability 10.x (Blackwell) device (this one is {major}.{minor})"
        if not Sm100Backend._dsl_checked:
            try:
                import cutlass.cute  # noqa: F401  (importability check)
            except Exception as e:  # pragma: no cover - depends on the installation
                Sm100Backend._dsl_error = f"CuTe DSL (nvidia-cutlass-dsl) not importable: {e}"
            Sm100Backend._dsl_checked = True
        return Sm100Backend._dsl_error

    def supports(self, op: str, p: Problem) -> Optional[str]:
        if op not in ("fwd", "attn_dist", "bwd"):
            return f"no sm100 {op} kernel yet"
        if p.dtype != torch.bfloat16:
            return f"dtype {p.dtype} (kernels take bfloat16)"
        if p.d_qk not in (512, 576):
            return f"d_qk={p.d_qk} (kernels take 512 or 576)"
        if op in ("fwd", "bwd") and p.d_v != 512:
            return f"d_v={p.d_v} (kernels take 512)"
        if p.h_q % 64:
            return f"h_q={p.h_q} (kernels take a multiple of 64)"
        if not p.sm_scale > 0:
            return f"sm_scale={p.sm_scale} (kernels fold a positive scale into exp2)"
        if p.s_kv >= 2**31:
            return f"s_kv={p.s_kv} does not fit int32 indices"
        return None

    def config_key(self, op: str, p: Problem) -> tuple:
        # The first-use canary is per kernel: the bring-up knob can switch the forward's kernel.
        key = super().config_key(op, p)
        return key + (fwd_two_cta(p.h_q),) if op == "fwd" else key

    def fwd(self, p: Problem):
        arch = _compile.arch_for_device(p.device)
        has_tl, has_sink = p.topk_length is not None, p.attn_sink is not None
        two_cta = fwd_two_cta(p.h_q)
        key = ("SparseMlaFwdSm100", two_cta, p.d_qk, p.h_q, has_tl, has_sink, arch)
        _, fn = _compile.cached_compile(key, lambda: compile_fwd(p.d_qk, p.h_q, has_tl, has_sink, arch, two_cta))
        out = host.alloc((p.s_q, p.h_q, p.d_v), torch.bfloat16, p.device)
        max_logits = host.alloc((p.s_q, p.h_q), torch.float32, p.device)
        lse = host.alloc((p.s_q, p.h_q), torch.float32, p.device)
        tl = p.topk_length if has_tl else host.dummy(torch.int32, p.device)
        sink = p.attn_sink if has_sink else host.dummy(torch.float32, p.device)
        fn(p.q, p.kv, p.indices, tl, sink, out, max_logits, lse, p.sm_scale * math.log2(math.e))
        return out, max_logits, lse

    def attn_dist(self, p: Problem, lse: torch.Tensor, normalize: bool):
        arch = _compile.arch_for_device(p.device)
        n_groups = p.h_q // attn_dist_heads_per_cta(p.h_q)
        fused = normalize and n_groups == 1
        has_tl = p.topk_length is not None
        key = ("AttnDistSm100", p.d_qk, p.h_q, fused, has_tl, arch)
        _, fn = _compile.cached_compile(key, lambda: compile_attn_dist(p.d_qk, p.h_q, fused, has_tl, arch))
        out = host.alloc((n_groups, p.s_q, p.topk), torch.float32, p.device)
        tl = p.topk_length if has_tl else host.dummy(torch.int32, p.device)
        fn(p.q, p.kv, p.indices, tl, lse.float().contiguous(), out, p.sm_scale * math.log2(math.e))
        if n_groups == 1:
            return out[0]
        res = out.sum(dim=0)  # several head groups per token: combine on the host side
        if normalize:
            tot = res.sum(dim=-1, keepdim=True)
            res = torch.where(tot > 0, res / torch.where(tot > 0, tot, torch.ones_like(tot)), res)
        return res

    def bwd(self, p: Problem, out, dout, lse, *, dlse=None, deterministic=False, return_attn_sum=False):
        from ..common import bwd_host

        return bwd_host.run_bwd(p, out, dout, lse, dlse, deterministic, return_attn_sum,
                                compile_bwd=compile_bwd, name="SparseMlaBwdSm100")


BACKEND = Sm100Backend()
