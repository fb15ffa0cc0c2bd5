"""The host side shared by the CuTe DSL backends (sm90, sm100).

Both archs' kernels take the same arguments in the same order per op, so everything around a
launch is written once here: which problems a kernel serves, the fake tensors a compile traces
with (the argument contract), output allocation and the launch, the multi-head-group combine of
attn_dist, and (through :mod:`.bwd_host`) the backward's host pieces.  A backend subclass names
its compile functions, its device check and its compile-cache keys.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _compile
from . import host
from .backend import INDEXER_OPS, Backend
from .problem import Problem

D_V = 512
OPS_SERVED = ("fwd", "attn_dist", "bwd")


# ---------------------------------------------------------------------------------------------
# The kernels' argument contract, as fake tensors for compile-only tracing (dynamic extents are
# ``cute.sym_int``: a new s_q / s_kv / topk never recompiles).
# ---------------------------------------------------------------------------------------------


def fwd_fake_args(d_qk: int, h_q: int):
    """``(q, kv, indices, topk_length, attn_sink, out, max_logits, lse, scale_log2, stream)``."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    s_q, s_q2, s_q3, s_q4, s_q5, s_kv = (cute.sym_int() for _ in range(6))
    topk = cute.sym_int(divisibility=64)
    n_tl, n_sink = cute.sym_int(), cute.sym_int()
    return (
        host.fake(BFloat16, (s_q, h_q, d_qk)),
        host.fake(BFloat16, (s_kv, d_qk)),
        host.fake(Int32, (s_q2, topk)),
        host.fake(Int32, (n_tl,), align=4),
        host.fake(Float32, (n_sink,), align=4),
        host.fake(BFloat16, (s_q3, h_q, D_V)),
        host.fake(Float32, (s_q4, h_q), align=16),  # max_logits (rows leave by 16-byte bulk copies)
        host.fake(Float32, (s_q5, h_q), align=16),  # lse
        Float32(1.0),
        host.fake_stream(),
    )


def attn_dist_fake_args(d_qk: int, h_q: int, topk_block: int):
    """``(q, kv, indices, topk_length, lse, out[n_groups, s_q, topk], scale_log2, stream)``."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    s_q, s_q2, s_q3, s_q4, s_kv, n_tl, n_grp = (cute.sym_int() for _ in range(7))
    topk = cute.sym_int(divisibility=topk_block)
    topk2 = cute.sym_int(divisibility=topk_block)
    return (
        host.fake(BFloat16, (s_q, h_q, d_qk)),
        host.fake(BFloat16, (s_kv, d_qk)),
        host.fake(Int32, (s_q2, topk)),
        host.fake(Int32, (n_tl,), align=4),
        host.fake(Float32, (s_q3, h_q), align=4),
        host.fake(Float32, (n_grp, s_q4, topk2), align=4),
        Float32(1.0),
        host.fake_stream(),
    )


def bwd_fake_args(d_qk: int, h_q: int, bf16_workspace: bool = False):
    """The backward's arguments -- see ``common.bwd_host.run_bwd`` for what each one holds
    (``bf16_workspace``: the deterministic per-slot workspace is bfloat16, not float32)."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    sq = [cute.sym_int() for _ in range(10)]
    s_kv, n_ws, n_tl, n_grp = (cute.sym_int() for _ in range(4))
    topk = cute.sym_int(divisibility=64)
    topk2 = cute.sym_int(divisibility=64)
    return (
        host.fake(BFloat16, (sq[0], h_q, d_qk)),  # q
        host.fake(BFloat16, (s_kv, d_qk)),  # kv
        host.fake(BFloat16, (sq[1], h_q, D_V)),  # dout
        host.fake(BFloat16, (sq[2], h_q, D_V)),  # out
        host.fake(Int32, (sq[3], topk)),  # indices
        host.fake(Int32, (n_tl,), align=4),  # topk_length
        host.fake(Float32, (sq[4], h_q), align=4),  # lse2
        host.fake(Float32, (sq[5], h_q), align=4),  # delta correction
        host.fake(Float32, (sq[6], h_q), align=4),  # delta out
        host.fake(Float32, (sq[7], h_q), align=4),  # attn_sum scale
        host.fake(BFloat16, (sq[8], h_q, d_qk)),  # dq
        host.fake(BFloat16 if bf16_workspace else Float32, (n_ws, d_qk)),  # dkv workspace
        host.fake(Float32, (sq[9], n_grp, topk2), align=4),  # attn_sum partials
        Float32(1.0),
        Float32(1.0),
        host.fake_stream(),
    )


# ---------------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------------


class CuteKernelBackend(Backend):
    """A backend of CuTe DSL kernels.  Subclasses provide ``device_reason``, ``fwd_kernel``,
    ``attn_dist_kernel``, ``attn_dist_heads_per_cta`` and ``compile_bwd``/``bwd_name``."""

    _dsl_error: Optional[str] = None
    _dsl_checked = False

    # -- what a subclass provides ---------------------------------------------------------------
    def device_reason(self, major: int, minor: int) -> Optional[str]:
        """None if a device of this compute capability runs this backend's kernels."""
        raise NotImplementedError

    def fwd_kernel(self, p: Problem, rotate_shift: int = 0):
        """The compiled forward for ``p``'s static configuration (through the compile cache);
        ``rotate_shift`` (only where :attr:`fwd_rotate_shift` is set): the kernel's pair-order tick."""
        raise NotImplementedError

    def attn_dist_heads_per_cta(self, h_q: int) -> int:
        raise NotImplementedError

    def attn_dist_kernel(self, p: Problem, fused_normalize: bool):
        raise NotImplementedError

    compile_bwd = None  # the backward's compile function (same arguments on every arch)
    bwd_name = ""  # its compile-cache key
    #: Run the backward on each row's slots in kv order (``order_host.kv_ordered``); on where it
    #: was measured.
    bwd_sort_indices = False
    #: The backward kernel's block-order tick on kv-ordered slots (``rotate_shift``, 0: none;
    #: ``bwd_host.rotate_shift_for``); on where it was measured.
    bwd_rotate_shift = 0
    #: The largest s_kv at which the backward defers a warpgroup's last dKV scatter into the next
    #: block (``bwd_host.defer_scatter_for``; 0: the backend's kernel has no such variant).
    bwd_defer_max_skv = 0
    #: Run the forward on kv-ordered slots where ``order_host.fwd_order_wanted`` says so (long kv
    #: ranges); on where it was measured.
    fwd_sort_indices = False
    #: The forward kernel's pair-order tick on kv-ordered slots (``rotate_shift``, 0: none;
    #: ``order_host.fwd_rotate_shift_for``); on where it was measured.
    fwd_rotate_shift = 0
    #: Run ``attn_dist`` on kv-ordered slots where ``order_host.attn_dist_order_wanted`` says so.
    attn_dist_sort_indices = False

    @property
    def import_spec(self) -> str:
        """Where a first-use check process finds this backend (``mla_kernels.sm100:BACKEND``)."""
        return f"{type(self).__module__}:BACKEND"

    # -- shared ---------------------------------------------------------------------------------
    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        if device.type != "cuda":
            return "not a CUDA device"
        why = self.device_reason(*_compile.device_capability(device))
        if why:
            return why
        if not CuteKernelBackend._dsl_checked:
            # found, not imported: a process whose kernels all come from the on-disk cache never
            # imports the DSL (see _compile.py)
            why = _compile.dsl_available()
            CuteKernelBackend._dsl_error = f"CuTe DSL not available: {why}" if why else None
            CuteKernelBackend._dsl_checked = True
        return CuteKernelBackend._dsl_error

    def indexer_supports(self, op: str, p) -> Optional[str]:
        """None if this backend has a kernel for indexer ``op`` on ``p`` (a subclass with indexer
        kernels overrides this and the ``indexer_*`` methods)."""
        return f"no {self.name} indexer kernels (the PyTorch reference serves the indexer)"

    def supports(self, op: str, p: Problem) -> Optional[str]:
        if op in INDEXER_OPS:
            return self.indexer_supports(op, p)
        if op not in OPS_SERVED:
            return f"no {self.name} {op} kernel"
        if p.dtype != torch.bfloat16:
            return f"dtype {p.dtype} (kernels take bfloat16)"
        if p.d_qk not in (512, 576):
            return f"d_qk={p.d_qk} (kernels take 512 or 576)"
        if op in ("fwd", "bwd") and p.d_v != D_V:
            return f"d_v={p.d_v} (kernels take {D_V})"
        if p.h_q % 64:
            return f"h_q={p.h_q} (kernels take a multiple of 64)"
        if not p.sm_scale > 0:
            return f"sm_scale={p.sm_scale} (kernels fold a positive scale into exp2)"
        if p.s_kv >= 2**31:
            return f"s_kv={p.s_kv} does not fit int32 indices"
        return None

    def fwd(self, p: Problem):
        launch = self.fwd_launcher(p)
        if launch is None:  # kv-ordered slots first (out / max_logits / lse do not depend on the order)
            from . import order_host

            p = order_host.kv_ordered(p, False)[0]
            launch = self._fwd_launch(p, order_host.fwd_rotate_shift_for(self.fwd_rotate_shift))
        return launch(p.q, p.kv, p.indices, p.topk_length, p.attn_sink)

    def fwd_launcher(self, p: Problem):
        """None when the forward runs on kv-ordered slots (``order_host.fwd_order_wanted``: a
        per-call ordering kernel first)."""
        if self.fwd_sort_indices:
            from . import order_host

            if order_host.fwd_order_wanted(p):
                return None
        return self._fwd_launch(p)

    def _fwd_launch(self, p: Problem, rotate_shift: int = 0):
        """The launch of the forward for ``p``'s static configuration and shapes (``rotate_shift``:
        the pair-order tick, on kv-ordered slots only)."""
        fn = self.fwd_kernel(p, rotate_shift)
        out_shape, row_shape, device = (p.s_q, p.h_q, p.d_v), (p.s_q, p.h_q), p.device
        tl0 = host.dummy(torch.int32, device)
        sink0 = host.dummy(torch.float32, device)
        scale_log2 = p.sm_scale * math.log2(math.e)
        alloc, bf16, f32 = host.alloc, torch.bfloat16, torch.float32

        def launch(q, kv, indices, topk_length, attn_sink):
            out = alloc(out_shape, bf16, device)
            max_logits = alloc(row_shape, f32, device)
            lse = alloc(row_shape, f32, device)
            fn(q, kv, indices, tl0 if topk_length is None else topk_length, sink0 if attn_sink is None else attn_sink,
               out, max_logits, lse, scale_log2)
            return out, max_logits, lse

        return launch

    def attn_dist(self, p: Problem, lse: torch.Tensor, normalize: bool):
        launch = self.attn_dist_launcher(p, normalize)
        if launch is None:  # on kv-ordered slots, the result mapped back to the caller's slot order
            from . import order_host

            p, perm = order_host.kv_ordered(p, True)
            res = self._attn_dist_launch(p, normalize)(p.q, p.kv, p.indices, p.topk_length, lse)
            return order_host.to_given_order(res, perm)
        return launch(p.q, p.kv, p.indices, p.topk_length, lse)

    def attn_dist_launcher(self, p: Problem, normalize: bool):
        """None when ``attn_dist`` runs on kv-ordered slots (``order_host.attn_dist_order_wanted``:
        an ordering kernel first, a scatter back after)."""
        if self.attn_dist_sort_indices:
            from . import order_host

            if order_host.attn_dist_order_wanted(p):
                return None
        return self._attn_dist_launch(p, normalize)

    def _attn_dist_launch(self, p: Problem, normalize: bool):
        """The launch of ``attn_dist`` for ``p``'s static configuration and shapes."""
        n_groups = p.h_q // self.attn_dist_heads_per_cta(p.h_q)
        fused = normalize and n_groups == 1  # one CTA covers all heads of a token
        fn = self.attn_dist_kernel(p, fused)
        out_shape, device = (n_groups, p.s_q, p.topk), p.device
        tl0 = host.dummy(torch.int32, device)
        scale_log2 = p.sm_scale * math.log2(math.e)
        alloc, f32 = host.alloc, torch.float32

        def launch(q, kv, indices, topk_length, lse):
            out = alloc(out_shape, f32, device)
            fn(q, kv, indices, tl0 if topk_length is None else topk_length, lse.float().contiguous(), out, scale_log2)
            if n_groups == 1:
                return out[0]
            res = out.sum(dim=0)  # several head groups per token: combine on the host side
            if normalize:
                tot = res.sum(dim=-1, keepdim=True)
                res = torch.where(tot > 0, res / torch.where(tot > 0, tot, torch.ones_like(tot)), res)
            return res

        return launch

    def bwd_launcher(self, p: Problem, deterministic: bool, return_attn_sum: bool):
        # (the backward's host work -- row terms, slot order, workspace, conversion -- stays per call)
        def launch(p2, out, dout, lse, dlse):
            return self.bwd(p2, out, dout, lse, dlse=dlse, deterministic=deterministic,
                            return_attn_sum=return_attn_sum)

        return launch

    def bwd(self, p: Problem, out, dout, lse, *, dlse=None, deterministic=False, return_attn_sum=False):
        from . import bwd_host

        return bwd_host.run_bwd(p, out, dout, lse, dlse, deterministic, return_attn_sum,
                                compile_bwd=type(self).compile_bwd, name=self.bwd_name,
                                sort_indices=self.bwd_sort_indices, rotate_shift=self.bwd_rotate_shift,
                                defer_max_skv=self.bwd_defer_max_skv)


def cached(key: tuple, build):
    """The compiled function for ``key`` (compiled once per process by ``build()``)."""
    _, fn = _compile.cached_compile(key, build)
    return fn
