"""The sm90 (Hopper) backend: CuTe DSL kernels compiled for sm_90a.

``BACKEND`` is what ``mla_kernels.dispatch`` uses.  Kernels live one per file:
``fwd.py`` (sparse forward), ``attn_dist.py`` (attention distribution), ``bwd.py`` (backward:
dQ, dKV and optionally the attention sum).  The backward's small host-side pieces (lse' and
delta' per row, the dKV workspace conversion, the deterministic mode's fixed-order reduction,
d_attn_sink) live in ``common/bwd_host.py`` (shared with sm100).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _compile
from ..common.backend import Backend
from ..common.problem import Problem
from ..common import host

__all__ = ["BACKEND", "Sm90Backend", "compile_fwd", "compile_attn_dist", "compile_bwd"]


def compile_fwd(d_qk: int, h_q: int, has_topk_length: bool, has_sink: bool, arch: str = "sm_90a", **kw):
    """Compile the sm90 forward for one static configuration (no GPU needed)."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from .fwd import SparseMlaFwdSm90

    kernel = SparseMlaFwdSm90(d_qk, 512, has_topk_length, has_sink)
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


def attn_dist_mode(h_q: int) -> str:
    """``heads`` (128 heads per CTA) when h_q is a multiple of 128, else ``tokens`` (64 per CTA)."""
    return "heads" if h_q % 128 == 0 else "tokens"


def compile_attn_dist(d_qk: int, h_q: int, normalize: bool, has_topk_length: bool, arch: str = "sm_90a", **kw):
    """Compile the sm90 attention distribution for one static configuration (no GPU needed).

    ``normalize`` is fused only when one CTA covers all heads of a token (h_q 64 or 128)."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from .attn_dist import AttnDistSm90

    mode = attn_dist_mode(h_q)
    kernel = AttnDistSm90(d_qk, mode, normalize, has_topk_length)
    s_q, s_q2, s_q3, s_q4, s_kv, n_tl, n_grp = (cute.sym_int() for _ in range(7))
    topk = cute.sym_int(divisibility=64)
    topk2 = cute.sym_int(divisibility=64)
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


def compile_bwd(d_qk: int, h_q: int, has_topk_length: bool, attn_sum: bool = False,
                attn_sum_scaled: bool = False, deterministic: bool = False, has_dlse: bool = False,
                arch: str = "sm_90a", **kw):
    """Compile the sm90 backward for one static configuration (no GPU needed)."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from .bwd import SparseMlaBwdSm90

    kernel = SparseMlaBwdSm90(d_qk, 512, has_topk_length, has_dlse, attn_sum, attn_sum_scaled, deterministic)
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


class Sm90Backend(Backend):
    name = "sm90"
    topk_block = 64
    hardware_verified = True

    _dsl_error: Optional[str] = None
    _dsl_checked = False

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        if device.type != "cuda":
            return "not a CUDA device"
        if torch.cuda.get_device_capability(device) != (9, 0):
            return "not a compute capability 9.0 (Hopper) device"
        if not Sm90Backend._dsl_checked:
            try:
                import cutlass.cute  # noqa: F401  (importability check)
            except Exception as e:  # pragma: no cover - depends on the installation
                Sm90Backend._dsl_error = f"CuTe DSL (nvidia-cutlass-dsl) not importable: {e}"
            Sm90Backend._dsl_checked = True
        return Sm90Backend._dsl_error

    def supports(self, op: str, p: Problem) -> Optional[str]:
        if op not in ("fwd", "attn_dist", "bwd"):
            return f"no sm90 {op} kernel"
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

    def fwd(self, p: Problem):
        arch = _compile.arch_for_device(p.device)
        key = ("SparseMlaFwdSm90", p.d_qk, p.h_q, p.topk_length is not None, p.attn_sink is not None, arch)
        _, fn = _compile.cached_compile(
            key, lambda: compile_fwd(p.d_qk, p.h_q, p.topk_length is not None, p.attn_sink is not None, arch)
        )
        out = host.alloc((p.s_q, p.h_q, p.d_v), torch.bfloat16, p.device)
        max_logits = host.alloc((p.s_q, p.h_q), torch.float32, p.device)
        lse = host.alloc((p.s_q, p.h_q), torch.float32, p.device)
        tl = p.topk_length if p.topk_length is not None else host.dummy(torch.int32, p.device)
        sink = p.attn_sink if p.attn_sink is not None else host.dummy(torch.float32, p.device)
        fn(p.q, p.kv, p.indices, tl, sink, out, max_logits, lse, p.sm_scale * math.log2(math.e))
        return out, max_logits, lse

    def attn_dist(self, p: Problem, lse: torch.Tensor, normalize: bool):
        arch = _compile.arch_for_device(p.device)
        heads_per_cta = 128 if attn_dist_mode(p.h_q) == "heads" else 64
        n_groups = p.h_q // heads_per_cta
        fused = normalize and n_groups == 1
        has_tl = p.topk_length is not None
        key = ("AttnDistSm90", p.d_qk, p.h_q, fused, has_tl, arch)
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
                                compile_bwd=compile_bwd, name="SparseMlaBwdSm90")


BACKEND = Sm90Backend()
