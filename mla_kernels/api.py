"""The torch-facing ops: validate inputs, normalise them, pick a backend, call it.

All input validation of the package lives here; backends trust the
:class:`~mla_kernels.common.problem.Problem` they receive.

Input conventions (shared by every op):

* ``q [s_q, h_q, d_qk]``; ``kv [s_kv, 1, d_qk]`` or ``[s_kv, d_qk]`` (one shared KV head;
  ``V = kv[..., :d_v]``); ``indices [s_q, 1, topk]`` or ``[s_q, topk]``, int32 or int64 (int64 is
  converted; values outside ``[0, s_kv)`` become -1).
* ``q`` and ``kv`` share one floating dtype (bfloat16 for the kernels; float16/float32/float64
  run on the reference) and one device with every other tensor argument.
* ``topk_length [s_q]`` (int32 or int64): slots ``j >= topk_length[i]`` are ignored; values are
  clamped to ``[0, topk]``.
* ``attn_sink [h_q]`` (float): scales ``out`` by ``exp(lse) / (exp(lse) + exp(sink))``; ``lse``
  is left untouched.
* Non-contiguous or misaligned tensors are copied to contiguous, 16-byte-aligned memory (a
  one-off copy per call; pass contiguous tensors to avoid it).  Outputs are always contiguous.
* ``topk`` that is not a multiple of the selected kernel's block is padded with -1 slots
  internally; results keep the caller's ``topk``.
* ``sm_scale`` is a finite real number ``> 0`` (the kernels fold it into ``exp2``).

Eager calls run the body of each function directly (no dispatcher cost).  While
``torch.compile`` or ``torch.export`` traces (``torch.compiler.is_compiling()``), each public op
checks its inputs' metadata (:func:`check_inputs`: shapes, dtypes, devices -- the same errors as
eagerly, raised at trace time) and calls its ``torch.library`` custom op
(``torch.ops.mla_kernels.*``, defined in :mod:`mla_kernels.ops`) instead, whose implementation
is the eager body.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional, Tuple

import torch

from . import dispatch
from .common import fastpath
from .common.problem import MergeProblem, Problem
from .decode import NARROW_HEADS, DecodePlan, choose_splits, device_sm_count
from .reference import compute_dtype

__all__ = [
    "sparse_mla_fwd", "attn_dist", "sparse_mla_bwd", "make_problem", "check_inputs", "tracing",
    "sparse_mla_decode", "decode_plan", "merge_attn_partials",
]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


def tracing() -> bool:
    """True while ``torch.compile``/``torch.export`` traces: tensors may be fake (no data), so the
    public ops call their ``torch.library`` custom ops instead of running eagerly."""
    return torch.compiler.is_compiling()


_FAKE_TENSOR = []


def _no_data(t: torch.Tensor) -> bool:
    """True for a tensor without storage to look at: a fake tensor (a custom op's
    ``register_fake``, ``torch.library.opcheck``) or any tensor while tracing."""
    if not _FAKE_TENSOR:
        from torch._subclasses.fake_tensor import FakeTensor

        _FAKE_TENSOR.append(FakeTensor)
    return isinstance(t, _FAKE_TENSOR[0]) or tracing()


def _contig(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (kernels read rows with 16-byte vector loads / TMA)."""
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() and not _no_data(t) and t.data_ptr() % 16:
        t = t.clone()
    return t


def _check_tensor(name: str, t, shape_doc: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_doc}, got {type(t).__name__}")


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; all tensors must share one device")


def _check_scale(sm_scale) -> float:
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        if isinstance(sm_scale, torch.Tensor) and sm_scale.numel() == 1 and not sm_scale.requires_grad:
            sm_scale = sm_scale.item()
        else:
            raise TypeError(f"sm_scale must be a real number, got {type(sm_scale).__name__}")
    sm_scale = float(sm_scale)
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be finite, got {sm_scale}")
    if not sm_scale > 0:
        raise ValueError(f"sm_scale must be > 0 (the softmax scale, e.g. d_qk ** -0.5), got {sm_scale}")
    return sm_scale


def _check_flag(name: str, flag) -> bool:
    if not isinstance(flag, bool):
        raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    return flag


class Shapes(NamedTuple):
    """What :func:`check_inputs` derives from the inputs (no tensor data is read)."""

    s_q: int
    h_q: int
    d_qk: int
    s_kv: int
    topk: int
    d_v: int
    sm_scale: float


def check_inputs(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: Optional[int] = 512,
    topk_length: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
) -> Shapes:
    """Check the shared inputs' types, shapes, dtypes and devices (metadata only: works on the
    fake tensors of ``torch.compile``/``torch.export`` tracing).

    Raises ``TypeError`` for wrong types/dtypes and ``ValueError`` for wrong shapes, sizes,
    devices or values, each naming the argument and what was expected.  ``d_v=None`` (ops that
    do not read V) means ``d_qk``.
    """
    _check_tensor("q", q, "of shape [s_q, h_q, d_qk]")
    if q.dim() != 3:
        raise ValueError(f"q must have shape [s_q, h_q, d_qk] (3-D), got {tuple(q.shape)}")
    s_q, h_q, d_qk = q.shape
    if h_q < 1 or d_qk < 1:
        raise ValueError(f"q must have h_q >= 1 and d_qk >= 1, got shape {tuple(q.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q must be bfloat16, float16, float32 or float64, got {q.dtype}")
    device = q.device

    _check_tensor("kv", kv, "of shape [s_kv, 1, d_qk] or [s_kv, d_qk]")
    if kv.dim() == 3:
        if kv.shape[1] != 1:
            raise ValueError(
                f"kv must have shape [s_kv, 1, d_qk] (one shared KV head) or [s_kv, d_qk], "
                f"got {tuple(kv.shape)}"
            )
    elif kv.dim() != 2:
        raise ValueError(f"kv must have shape [s_kv, 1, d_qk] or [s_kv, d_qk], got {tuple(kv.shape)}")
    if kv.shape[-1] != d_qk:
        raise ValueError(f"kv's last dim must equal q's d_qk={d_qk}, got kv shape {tuple(kv.shape)}")
    if kv.dtype != q.dtype:
        raise TypeError(f"kv must have q's dtype {q.dtype}, got {kv.dtype}")
    _check_device("kv", kv, device)

    _check_tensor("indices", indices, "of shape [s_q, 1, topk] or [s_q, topk]")
    if indices.dim() == 3:
        if indices.shape[1] != 1:
            raise ValueError(
                f"indices must have shape [s_q, 1, topk] or [s_q, topk], got {tuple(indices.shape)}"
            )
    elif indices.dim() != 2:
        raise ValueError(f"indices must have shape [s_q, 1, topk] or [s_q, topk], got {tuple(indices.shape)}")
    if indices.shape[0] != s_q:
        raise ValueError(f"indices must have s_q={s_q} rows like q, got shape {tuple(indices.shape)}")
    if indices.dtype not in _INDEX_DTYPES:
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype}")
    _check_device("indices", indices, device)

    sm_scale = _check_scale(sm_scale)
    if d_v is None:
        d_v = d_qk
    elif isinstance(d_v, bool) or not isinstance(d_v, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"d_v must be an int, got {type(d_v).__name__}")
    elif isinstance(d_v, numbers.Integral):
        d_v = int(d_v)
    if not 1 <= d_v <= d_qk:
        raise ValueError(f"d_v must satisfy 1 <= d_v <= d_qk={d_qk}, got d_v={d_v}")

    if topk_length is not None:
        _check_tensor("topk_length", topk_length, f"of shape [s_q]={[s_q]}")
        if topk_length.dim() != 1 or topk_length.shape[0] != s_q:
            raise ValueError(f"topk_length must have shape [s_q]=[{s_q}], got {tuple(topk_length.shape)}")
        if topk_length.dtype not in _INDEX_DTYPES:
            raise TypeError(f"topk_length must be int32 or int64, got {topk_length.dtype}")
        _check_device("topk_length", topk_length, device)

    if attn_sink is not None:
        _check_tensor("attn_sink", attn_sink, f"of shape [h_q]=[{h_q}]")
        if attn_sink.dim() != 1 or attn_sink.shape[0] != h_q:
            raise ValueError(f"attn_sink must have shape [h_q]=[{h_q}], got {tuple(attn_sink.shape)}")
        if not attn_sink.is_floating_point():
            raise TypeError(f"attn_sink must be a floating tensor, got {attn_sink.dtype}")
        _check_device("attn_sink", attn_sink, device)

    return Shapes(s_q, h_q, d_qk, kv.shape[0], indices.shape[-1], d_v, sm_scale)


def make_problem(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: Optional[int] = 512,
    topk_length: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
) -> Problem:
    """Validate the shared inputs (:func:`check_inputs`) and normalise them into a
    :class:`Problem` (contiguous, aligned, int32 indices with out-of-range values as -1, clamped
    ``topk_length``, ``attn_sink`` in the compute dtype)."""
    sh = check_inputs(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)
    s_q, s_kv, d_qk = sh.s_q, sh.s_kv, sh.d_qk
    idx = indices.reshape(s_q, indices.shape[-1])
    if idx.dtype == torch.int64:
        idx = torch.where((idx < 0) | (idx >= s_kv), torch.full_like(idx, -1), idx).to(torch.int32)
    return Problem(
        q=_contig(q.detach()),
        kv=_contig(kv.detach().reshape(s_kv, d_qk)),
        indices=_contig(idx),
        sm_scale=sh.sm_scale,
        d_v=sh.d_v,
        topk_length=_norm_topk_length(topk_length, sh.topk),
        attn_sink=_norm_sink(attn_sink, q.dtype),
        kv_shape=kv.shape,
    )


def _norm_topk_length(topk_length, topk: int):
    """``topk_length`` as a Problem holds it: int32, clamped to ``[0, topk]`` (a new tensor)."""
    if topk_length is None:
        return None
    return _contig(topk_length.clamp(0, topk).to(torch.int32))


def _norm_sink(attn_sink, dtype: torch.dtype):
    """``attn_sink`` as a Problem holds it: in the compute dtype of ``dtype``, contiguous."""
    if attn_sink is None:
        return None
    return _contig(attn_sink.detach().to(compute_dtype(dtype)))


def _pad_topk(p: Problem, block: int) -> Problem:
    """Pad ``topk`` with -1 (invalid) slots to a positive multiple of ``block``."""
    if block <= 1:
        return p
    topk = p.topk
    padded = max(block, -(-topk // block) * block)
    if padded == topk:
        return p
    idx = torch.full((p.s_q, padded), -1, dtype=torch.int32, device=p.device)
    idx[:, :topk] = p.indices
    return p.with_indices(idx)


def _check_lse(name: str, lse, s_q: int, h_q: int, device: torch.device) -> None:
    _check_tensor(name, lse, f"of shape [s_q, h_q]=[{s_q}, {h_q}]")
    if lse.dim() != 2 or lse.shape[0] != s_q or lse.shape[1] != h_q:
        raise ValueError(f"{name} must have shape [s_q, h_q]=[{s_q}, {h_q}], got {tuple(lse.shape)}")
    if lse.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name} must be float32 (or float64), got {lse.dtype}")
    _check_device(name, lse, device)


def _check_like_out(name: str, t, sh: Shapes, dtype: torch.dtype, device: torch.device) -> None:
    shape = (sh.s_q, sh.h_q, sh.d_v)
    _check_tensor(name, t, f"of shape [s_q, h_q, d_v]={list(shape)}")
    if t.dim() != 3 or tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape [s_q, h_q, d_v]={list(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have q's dtype {dtype}, got {t.dtype}")
    _check_device(name, t, device)


def _lse_for(lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _contig(lse.detach().to(compute_dtype(dtype)))


def _empty_fwd(p: Problem):
    cdt = compute_dtype(p.dtype)
    out = torch.zeros(p.s_q, p.h_q, p.d_v, dtype=p.dtype, device=p.device)
    max_logits = torch.full((p.s_q, p.h_q), -math.inf, dtype=cdt, device=p.device)
    lse = torch.full((p.s_q, p.h_q), math.inf, dtype=cdt, device=p.device)
    return out, max_logits, lse


def fwd_problem(p: Problem) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward on an already validated problem (used by the autograd op)."""
    if p.s_q == 0 or p.s_kv == 0 or p.topk == 0:
        return _empty_fwd(p)
    routed = _fwd_through_decode(p)
    if routed is not None:
        return routed
    backend = dispatch.select("fwd", p)
    return backend.fwd(_pad_topk(p, backend.topk_block))


def _decode_route(p: Problem):
    """The (unallocated) decode plan -- backend and split chosen -- on which
    :func:`_fwd_through_decode` runs ``p``, else None."""
    if p.device.type != "cuda" or not p.sm_scale > 0:
        return None
    narrow = p.h_q in NARROW_HEADS
    if not narrow and p.h_q % 64:
        return None
    n, bps = choose_splits(p.s_q, 1, p.h_q, p.topk, device_sm_count(p.device))
    if n == 1 and not narrow:  # (decided before the plan and the dispatch: the prefill's common case)
        return None
    proto = DecodePlan(p.s_q, 1, p.h_q, p.topk, p.d_qk, p.d_v, p.device, p.dtype, n, bps, with_max_logits=True)
    proto.backend = dispatch.serving_kernel("decode", proto)
    return proto if proto.backend is not None else None


def _fwd_through_decode(p: Problem):
    """The forward of few query rows (or of 8..32 heads) on the split-top-k decode kernels.

    The prefill kernel runs one CTA per (row, 64 heads): ``s_q * h_q / 64`` CTAs leave most SMs
    idle when ``s_q`` is small, and it cannot take ``h_q < 64``.  Each row is then a decode
    request (``b = s_q``, one query each) split over its top-k (:func:`choose_splits`).  Used
    when a kernel backend serves the decode for ``p``'s configuration and either the rule
    gives more than one split or ``h_q`` is one of the narrow head counts.  Returns None
    otherwise."""
    proto = _decode_route(p)
    if proto is None:
        return None
    backend = proto.backend
    proto.allocate()
    backend.prepare_decode(proto)
    out, lse, ml = backend.decode(
        proto, p.q.view(p.s_q, 1, p.h_q, p.d_qk), p.kv, p.indices.view(p.s_q, 1, p.topk), p.sm_scale,
        p.topk_length, p.attn_sink, None, None,
    )
    return out.view(p.s_q, p.h_q, p.d_v), ml.view(p.s_q, p.h_q), lse.view(p.s_q, p.h_q)


# ---------------------------------------------------------------------------------------------
# The host fast path (common/fastpath.py): a call with the metadata of an earlier one repeats
# that call's decisions and runs the backend's launcher directly.
# ---------------------------------------------------------------------------------------------
_Tensor = torch.Tensor


def _plain_sig(t):
    """``(shape, dtype, device)`` of a plain, contiguous, 16-byte-aligned tensor (which
    :func:`make_problem` passes on as it is), else None."""
    if type(t) is not _Tensor or not t.is_contiguous() or t.data_ptr() & 15:
        return None
    return t.shape, t.dtype, t.device


_NOT_PLAIN = object()


def _opt_sig(t):
    """Metadata of an optional small input that :func:`make_problem` always normalises;
    ``_NOT_PLAIN`` if it is not a plain tensor (the full path raises for it)."""
    if t is None:
        return None
    if type(t) is not _Tensor:
        return _NOT_PLAIN
    return t.shape, t.dtype, t.device


def _fast_key(op: str, q, kv, indices, sm_scale, d_v, topk_length, extra):
    """The fast-path key of a call, or None if the call is not eligible (fastpath.py)."""
    if type(sm_scale) is not float and type(sm_scale) is not int:
        return None
    if d_v is not None and type(d_v) is not int:
        return None
    for x in extra:
        if x is _NOT_PLAIN:  # an optional argument that is not a plain tensor
            return None
    sq, skv, sidx = _plain_sig(q), _plain_sig(kv), _plain_sig(indices)
    if sq is None or skv is None or sidx is None or sidx[1] != torch.int32:
        return None
    stl = _opt_sig(topk_length)
    if stl is _NOT_PLAIN:
        return None
    return (op, sq, skv, sidx, stl, sm_scale, d_v) + extra


def _launcher(op: str, p: Problem, *args):
    """What the full path runs for ``op`` on ``p`` as the backend's launcher
    (``Backend.<op>_launcher(p, *args)``), or None when it is more than a kernel launch: an empty
    problem, a padded ``topk``, the forward's decode routing, a backend without launchers."""
    if p.s_q == 0 or p.s_kv == 0 or p.topk == 0 or (op == "fwd" and _decode_route(p) is not None):
        return None
    backend = dispatch.select(op, p)
    if p.topk % backend.topk_block:
        return None
    return getattr(backend, op + "_launcher")(p, *args)


def _fast_inputs(q, kv, indices, topk_length, attn_sink):
    """The normalised ``(q, kv, indices, topk_length, attn_sink)`` of a call whose fast-path key hit
    (:func:`make_problem`'s tensors, without its checks: the key's first call passed them)."""
    s_q, topk = q.shape[0], indices.shape[-1]
    return (q.detach(), kv.detach().view(kv.shape[0], q.shape[2]), indices.view(s_q, topk),
            _norm_topk_length(topk_length, topk), _norm_sink(attn_sink, q.dtype))


def bwd_problem(p: Problem, out, dout, lse, dlse=None, deterministic=False, return_attn_sum=False):
    """The backward on an already validated problem (used by the autograd op)."""
    cdt = compute_dtype(p.dtype)
    if p.s_q == 0 or p.s_kv == 0 or p.topk == 0:
        dq = torch.zeros_like(p.q)
        dkv = torch.zeros(p.kv_shape, dtype=p.dtype, device=p.device)
        dsink = None if p.attn_sink is None else torch.zeros(p.h_q, dtype=cdt, device=p.device)
        res = (dq, dkv, dsink)
        if return_attn_sum:
            res = res + (torch.zeros(p.s_q, p.topk, dtype=cdt, device=p.device),)
        return res
    backend = dispatch.select("bwd", p)
    res = backend.bwd(
        _pad_topk(p, backend.topk_block), out, dout, lse,
        dlse=dlse, deterministic=deterministic, return_attn_sum=return_attn_sum,
    )
    return _bwd_results(p, res, return_attn_sum)


def _bwd_results(p: Problem, res, return_attn_sum: bool):
    """A backend's backward results as the API returns them: dkv in kv's shape, attn_sum with the
    caller's topk."""
    dq, dkv, dsink = res[:3]
    res = (dq, dkv.reshape(p.kv_shape), dsink) + tuple(res[3:])
    if return_attn_sum:
        res = res[:3] + (res[3][:, : p.topk].contiguous(),)
    return res


def sparse_mla_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA forward (not differentiable: use :func:`mla_kernels.sparse_mla` for training).

    Args:
        q: ``[s_q, h_q, d_qk]`` queries.
        kv: ``[s_kv, 1, d_qk]`` or ``[s_kv, d_qk]`` keys; values are ``kv[..., :d_v]``.
        indices: ``[s_q, 1, topk]`` or ``[s_q, topk]`` int32/int64 rows of ``kv`` each query
            attends to; -1, negative or ``>= s_kv`` entries are ignored.
        sm_scale: softmax scale applied to ``q . k`` (``> 0``).
        d_v: value head dim (``<= d_qk``).
        topk_length: optional ``[s_q]`` int: slots at or beyond it are ignored.
        attn_sink: optional ``[h_q]`` float: per-head sink logit (see module docstring).

    Returns:
        ``(out [s_q, h_q, d_v]`` in q's dtype, ``max_logits [s_q, h_q]``, ``lse [s_q, h_q])``;
        the last two float32 (float64 for float64 inputs), natural-log units.  Rows with no
        valid slot give ``out = 0``, ``lse = +inf``, ``max_logits = -inf``.

    Reproducibility: bitwise the same from run to run, unless ``MLA_KERNELS_FWD_ROTATE=1``
    (opt-in): then, where the sm90 kernel runs on kv-ordered slots (``MLA_KERNELS_FWD_ORDER``), its
    CTAs start their block pairs at a time-dependent pair and ``out`` and ``lse`` vary in rounding
    from run to run (``max_logits`` does not).
    """
    if tracing():
        sh = check_inputs(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)
        return tuple(torch.ops.mla_kernels.sparse_mla_fwd(
            q.detach(), kv.detach(), indices, sh.sm_scale, sh.d_v, topk_length,
            attn_sink.detach() if attn_sink is not None else None,
        ))
    return sparse_mla_fwd_eager(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)


def sparse_mla_fwd_eager(q, kv, indices, sm_scale, d_v=512, topk_length=None, attn_sink=None):
    """:func:`sparse_mla_fwd`'s body (the ``mla_kernels::sparse_mla_fwd`` op's implementation)."""
    return fwd_with_problem(q, kv, indices, sm_scale, d_v, topk_length, attn_sink, False)[1]


def fwd_with_problem(q, kv, indices, sm_scale, d_v, topk_length, attn_sink, want_problem: bool):
    """``(p or None, (out, max_logits, lse))``: the validated problem (with ``want_problem``; the
    autograd op keeps it for the backward) and the forward -- through the host fast path
    (``common/fastpath.py``) when the call has the metadata of an earlier one that a kernel
    launch served."""
    key = None
    if fastpath.enabled():
        key = _fast_key("fwd", q, kv, indices, sm_scale, d_v, topk_length, (_opt_sig(attn_sink),))
        if key is not None:
            launch = fastpath.lookup(key)
            if launch is not None:
                t = _fast_inputs(q, kv, indices, topk_length, attn_sink)
                p = Problem(*t[:3], float(sm_scale), d_v, *t[3:], kv.shape) if want_problem else None
                return p, launch(*t)
    with fastpath.recording() as rec:
        p = make_problem(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)
        res = fwd_problem(p)
        launch = _launcher("fwd", p) if key is not None else None
    if launch is not None:
        fastpath.store(key, rec.knobs, launch)
    return p, res


def attn_dist(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    topk_length: Optional[torch.Tensor] = None,
    normalize: bool = False,
) -> torch.Tensor:
    """Attention distribution over the selected tokens (the indexer's KL target).

    ``attn_sum[i, j] = sum_h exp(q[i,h] . kv[indices[i,j]] * sm_scale - lse[i,h])`` for valid
    slots, 0 for invalid slots and empty rows (``lse = +inf`` gives 0, never NaN).  With
    ``normalize=True`` each row is divided by its sum (all-zero rows stay 0).  Not
    differentiable.

    Args:
        lse: ``[s_q, h_q]`` float32, the forward's log-sum-exp (natural log).

    Returns:
        ``attn_sum [s_q, topk]`` float32 (float64 for float64 inputs), in the caller's slot order.
    """
    if tracing():
        sh = check_inputs(q, kv, indices, sm_scale, None, topk_length)
        _check_lse("lse", lse, sh.s_q, sh.h_q, q.device)
        _check_flag("normalize", normalize)
        return torch.ops.mla_kernels.attn_dist(
            q.detach(), kv.detach(), indices, lse.detach(), sh.sm_scale, topk_length, normalize
        )
    return attn_dist_eager(q, kv, indices, lse, sm_scale, topk_length, normalize)


def attn_dist_eager(q, kv, indices, lse, sm_scale, topk_length=None, normalize=False):
    """:func:`attn_dist`'s body (the ``mla_kernels::attn_dist`` op's implementation)."""
    key = None
    slse = _plain_sig(lse)  # passed on as it is: plain, contiguous, aligned (float32 for the kernels)
    if fastpath.enabled() and type(normalize) is bool and slse is not None:
        key = _fast_key("attn_dist", q, kv, indices, sm_scale, None, topk_length, (slse, normalize))
        if key is not None:
            launch = fastpath.lookup(key)
            if launch is not None:
                return launch(*_fast_inputs(q, kv, indices, topk_length, None)[:4], lse.detach())
    with fastpath.recording() as rec:
        p = make_problem(q, kv, indices, sm_scale, None, topk_length)
        _check_lse("lse", lse, p.s_q, p.h_q, p.device)
        _check_flag("normalize", normalize)
        lse = _lse_for(lse, p.dtype)
        cdt = compute_dtype(p.dtype)
        if p.s_q == 0 or p.s_kv == 0 or p.topk == 0:
            return torch.zeros(p.s_q, p.topk, dtype=cdt, device=p.device)
        backend = dispatch.select("attn_dist", p)
        res = backend.attn_dist(_pad_topk(p, backend.topk_block), lse, normalize)
        res = res[:, : p.topk].contiguous() if res.shape[1] != p.topk else res
        launch = _launcher("attn_dist", p, normalize) if key is not None else None
    if launch is not None:
        fastpath.store(key, rec.knobs, launch)
    return res


def sparse_mla_bwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    indices: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    *,
    deterministic: bool = False,
    return_attn_sum: bool = False,
):
    """Sparse MLA backward.

    Args:
        out: ``[s_q, h_q, d_v]`` the forward's output; ``dout`` its gradient (q's dtype).
        lse: ``[s_q, h_q]`` float32, the forward's log-sum-exp.
        deterministic: bitwise-reproducible gradients (no racing float atomics), where the
            backend supports it (the reference is deterministic on CPU).  Without it, dkv's last
            bits vary from run to run (float atomics), and on sm90 dq's too (each CTA starts its
            row's blocks where the others are, at a time-dependent block: the order of dq's
            float additions; ``MLA_KERNELS_BWD_ROTATE=0`` fixes it).
        return_attn_sum: also return ``attn_sum [s_q, topk]`` (see :func:`attn_dist`).

    Returns:
        ``(dq [s_q,h_q,d_qk], dkv (kv's shape), d_attn_sink [h_q] or None)`` -- dq/dkv in q's
        dtype, ``d_attn_sink`` float32 -- plus ``attn_sum`` with ``return_attn_sum``.
    """
    if tracing():
        check_bwd_inputs(q, kv, out, dout, indices, lse, sm_scale, d_v, topk_length, attn_sink,
                         None, deterministic, return_attn_sum)
        det = lambda t: t.detach() if t is not None else None  # noqa: E731
        dq, dkv, dsink, asum = torch.ops.mla_kernels.sparse_mla_bwd(
            det(q), det(kv), det(out), det(dout), indices, det(lse), float(sm_scale), d_v, topk_length,
            det(attn_sink), deterministic=deterministic, return_attn_sum=return_attn_sum,
        )
        res = (dq, dkv, dsink if attn_sink is not None else None)
        return res + (asum,) if return_attn_sum else res
    return sparse_mla_bwd_eager(q, kv, out, dout, indices, lse, sm_scale, d_v, topk_length, attn_sink,
                                deterministic=deterministic, return_attn_sum=return_attn_sum)


def check_bwd_inputs(q, kv, out, dout, indices, lse, sm_scale, d_v, topk_length, attn_sink, dlse,
                     deterministic, return_attn_sum) -> Shapes:
    """:func:`check_inputs` plus the backward's own arguments (metadata only)."""
    sh = check_inputs(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)
    _check_bwd_args(sh, q.dtype, q.device, out, dout, lse, dlse, deterministic, return_attn_sum)
    return sh


def _check_bwd_args(sh, dtype, device, out, dout, lse, dlse, deterministic, return_attn_sum) -> None:
    """``sh``: anything with ``s_q``, ``h_q``, ``d_v`` (:class:`Shapes` or a :class:`Problem`)."""
    _check_like_out("out", out, sh, dtype, device)
    _check_like_out("dout", dout, sh, dtype, device)
    _check_lse("lse", lse, sh.s_q, sh.h_q, device)
    if dlse is not None:
        _check_lse("dlse", dlse, sh.s_q, sh.h_q, device)
    _check_flag("deterministic", deterministic)
    _check_flag("return_attn_sum", return_attn_sum)


def sparse_mla_bwd_eager(q, kv, out, dout, indices, lse, sm_scale, d_v=512, topk_length=None, attn_sink=None,
                         *, dlse=None, deterministic=False, return_attn_sum=False):
    """:func:`sparse_mla_bwd`'s body (the ``mla_kernels::sparse_mla_bwd`` op's implementation);
    ``dlse`` is the gradient flowing into the forward's returned ``lse`` (the autograd formula's)."""
    key = None
    if fastpath.enabled() and type(deterministic) is bool and type(return_attn_sum) is bool:
        key = _fast_key("bwd", q, kv, indices, sm_scale, d_v, topk_length,
                        (_opt_sig(attn_sink), _opt_sig(out), _opt_sig(dout), _opt_sig(lse), _opt_sig(dlse),
                         deterministic, return_attn_sum))
        if key is not None:
            launch = fastpath.lookup(key)
            if launch is not None:
                t = _fast_inputs(q, kv, indices, topk_length, attn_sink)
                p = Problem(*t[:3], float(sm_scale), d_v, *t[3:], kv.shape)
                res = launch(p, _contig(out.detach()), _contig(dout.detach()), _lse_for(lse, q.dtype),
                             None if dlse is None else _lse_for(dlse, q.dtype))
                return _bwd_results(p, res, return_attn_sum)
    with fastpath.recording() as rec:
        p = make_problem(q, kv, indices, sm_scale, d_v, topk_length, attn_sink)
        _check_bwd_args(p, p.dtype, p.device, out, dout, lse, dlse, deterministic, return_attn_sum)
        if dlse is not None:
            dlse = _lse_for(dlse, p.dtype)
        res = bwd_problem(p, _contig(out.detach()), _contig(dout.detach()), _lse_for(lse, p.dtype), dlse,
                          deterministic, return_attn_sum)
        launch = _launcher("bwd", p, deterministic, return_attn_sum) if key is not None else None
    if launch is not None:
        fastpath.store(key, rec.knobs, launch)
    return res


# ---------------------------------------------------------------------------------------------
# Merge of partial results (context parallelism, decode splits)
# ---------------------------------------------------------------------------------------------


def merge_attn_partials(
    outs: torch.Tensor,
    lses: torch.Tensor,
    attn_sink: Optional[torch.Tensor] = None,
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge the results of one attention computed over ``n`` disjoint parts of its top-k.

    Args:
        outs: ``[n, ..., h_q, d_v]`` (bfloat16, float16, float32 or float64): each part's output,
            normalised by its own softmax sum -- what ``sparse_mla_fwd`` / ``sparse_mla_decode``
            return for the part (called *without* ``attn_sink``).
        lses: ``[n, ..., h_q]`` float32 (or float64): each part's log-sum-exp (natural log);
            ``+inf`` marks an empty part (no valid slot), whose ``out`` is ignored.
        attn_sink: optional ``[h_q]``: applied once, after the merge, as the forward does
            (``out *= exp(lse) / (exp(lse) + exp(sink))``, ``lse`` untouched).
        out_dtype: dtype of the merged ``out`` (default: ``outs``'s).

    Returns:
        ``(out [..., h_q, d_v], lse [..., h_q])``: ``lse = log(sum_i exp(lse_i))``, ``out =
        sum_i exp(lse_i - lse) * out_i``; a row whose parts are all empty gives ``out = 0`` and
        ``lse = +inf``.  ``lse`` is float32 (float64 for float64 ``outs``).

    With ``n`` parts that split the top-k of ``sparse_mla_fwd(q, kv, indices, ...)`` (each part
    the same call with the other parts' slots set to -1, or a shard's rows), the merge equals
    the unsplit forward up to rounding; ``d_attn_sink`` and friends then come from the
    backward run with the merged ``out`` and ``lse``.  GPU: the lse combine kernel on sm90
    (bf16/float32 parts, ``d_v`` a multiple of 256 / 128), the PyTorch reference elsewhere.
    """
    if tracing():
        _check_merge(outs, lses, attn_sink, out_dtype)
        return tuple(torch.ops.mla_kernels.merge_attn_partials(
            outs.detach(), lses.detach(), attn_sink.detach() if attn_sink is not None else None, out_dtype))
    return merge_attn_partials_eager(outs, lses, attn_sink, out_dtype)


def _check_merge(outs, lses, attn_sink, out_dtype):
    """Validate a merge's inputs (metadata only); returns ``out_dtype`` (resolved)."""
    _check_tensor("outs", outs, "of shape [n, ..., h_q, d_v]")
    _check_tensor("lses", lses, "of shape [n, ..., h_q]")
    if outs.dim() < 3:
        raise ValueError(f"outs must have shape [n, ..., h_q, d_v] (at least 3-D), got {tuple(outs.shape)}")
    if outs.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"outs must be bfloat16, float16, float32 or float64, got {outs.dtype}")
    if tuple(lses.shape) != tuple(outs.shape[:-1]):
        raise ValueError(f"lses must have shape outs.shape[:-1]={tuple(outs.shape[:-1])}, got {tuple(lses.shape)}")
    if lses.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"lses must be float32 (or float64), got {lses.dtype}")
    device = outs.device
    if lses.device != device:
        raise ValueError(f"lses is on {lses.device} but outs is on {device}; all tensors must share one device")
    if out_dtype is None:
        out_dtype = outs.dtype
    if out_dtype not in _FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be a floating dtype, got {out_dtype}")
    h_q = outs.shape[-2]
    if attn_sink is not None:
        _check_tensor("attn_sink", attn_sink, f"of shape [h_q]=[{h_q}]")
        if attn_sink.dim() != 1 or attn_sink.shape[0] != h_q:
            raise ValueError(f"attn_sink must have shape [h_q]=[{h_q}], got {tuple(attn_sink.shape)}")
        if not attn_sink.is_floating_point():
            raise TypeError(f"attn_sink must be a floating tensor, got {attn_sink.dtype}")
        if attn_sink.device != device:
            raise ValueError(f"attn_sink is on {attn_sink.device} but outs is on {device}")
    return out_dtype


def merge_attn_partials_eager(outs, lses, attn_sink=None, out_dtype=None):
    """:func:`merge_attn_partials`'s body (the ``mla_kernels::merge_attn_partials`` op's
    implementation)."""
    out_dtype = _check_merge(outs, lses, attn_sink, out_dtype)
    device = outs.device
    n, h_q, d_v = outs.shape[0], outs.shape[-2], outs.shape[-1]
    lead = tuple(outs.shape[1:-2])
    sink = None
    if attn_sink is not None:
        sink = _contig(attn_sink.detach().to(compute_dtype(outs.dtype)))
    rows = math.prod(lead)
    cdt = compute_dtype(outs.dtype)
    if n == 0 or rows == 0 or h_q == 0:  # no parts: every row is empty
        out = torch.zeros(*lead, h_q, d_v, dtype=out_dtype, device=device)
        return out, torch.full((*lead, h_q), math.inf, dtype=cdt, device=device)
    outs3 = _contig(outs.detach()).reshape(n, rows, h_q, d_v)
    lses3 = _contig(lses.detach().to(cdt)).reshape(n, rows, h_q)
    backend = dispatch.select("merge", MergeProblem(device, outs.dtype, out_dtype, d_v, h_q))
    out, lse = backend.merge(outs3, lses3, sink, out_dtype)
    return out.reshape(*lead, h_q, d_v), lse.reshape(*lead, h_q)


# ---------------------------------------------------------------------------------------------
# Decode on a paged KV cache
# ---------------------------------------------------------------------------------------------

DECODE_HEADS_DOC = "8, 16, 24, 32 or a multiple of 64"


def _check_pos_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    v = int(v)
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    return v


def decode_plan(
    b: int,
    s_q: int,
    h_q: int,
    topk: int,
    *,
    d_qk: int = 576,
    d_v: int = 512,
    device=None,
    dtype: torch.dtype = torch.bfloat16,
    num_splits: Optional[int] = None,
    with_max_logits: bool = False,
) -> DecodePlan:
    """A reusable plan for :func:`sparse_mla_decode` on batches of one shape.

    Made once per batch shape (``b`` requests of ``s_q`` query tokens each -- 1, or 2..4 with
    MTP --, ``h_q`` heads, ``topk`` slots per token): it picks the backend and the split of the
    top-k (``mla_kernels.decode.choose_splits``; ``num_splits`` forces one), compiles the kernels
    and allocates every buffer, so that a call with the plan allocates nothing and never
    synchronises with the device (CUDA-graph capturable).  Its ``out`` / ``lse`` buffers are
    what each call returns (overwritten by the next call).  ``device`` defaults to the current
    CUDA device if there is one, else the CPU.  On sm90 a small- or mid-batch plan whose eager calls
    merge their splits in a thread-block cluster (one launch) of 8 or more CTAs, or of fewer splits
    than the plan's own (re-split so that the clusters fit), also prepares the step with its own
    splits and the combine kernel, which a call captured in a CUDA graph runs instead (less GPU
    time; ``MLA_KERNELS_DECODE_GRAPH``, README): the two agree to within bf16 rounding.
    """
    b, s_q, h_q, topk = (_check_pos_int(n, v) for n, v in (("b", b), ("s_q", s_q), ("h_q", h_q), ("topk", topk)))
    d_qk, d_v = _check_pos_int("d_qk", d_qk), _check_pos_int("d_v", d_v)
    if h_q not in NARROW_HEADS and h_q % 64:
        raise ValueError(f"decode supports h_q {DECODE_HEADS_DOC}, got h_q={h_q}")
    if d_v > d_qk:
        raise ValueError(f"d_v must satisfy d_v <= d_qk={d_qk}, got d_v={d_v}")
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be bfloat16, float16, float32 or float64, got {dtype}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if not isinstance(with_max_logits, bool):
        raise TypeError(f"with_max_logits must be a bool, got {type(with_max_logits).__name__}")
    n_blocks = max(1, -(-topk // 64))
    if num_splits is not None:
        num_splits = _check_pos_int("num_splits", num_splits)
    num_splits_forced = num_splits is not None
    plan = DecodePlan(b, s_q, h_q, topk, d_qk, d_v, device, dtype, 1, n_blocks, with_max_logits=with_max_logits)
    backend = dispatch.select("decode", plan)
    if num_splits is None:
        if backend.name == "reference":
            num_splits = 1  # the reference gains nothing from splitting
        else:
            num_splits = choose_splits(b, s_q, h_q, topk, device_sm_count(device))[0]
    bps = -(-n_blocks // min(num_splits, n_blocks))
    plan.num_splits, plan.blocks_per_split = -(-n_blocks // bps), bps
    plan.forced_splits = num_splits_forced
    plan.backend = backend
    plan.allocate()
    backend.prepare_decode(plan)
    return plan


def _decode_inputs(plan: Optional[DecodePlan], q, kv_cache, indices, sm_scale, d_v, topk_length, attn_sink,
                   block_table, q_bias):
    """Check one decode call (against ``plan`` when given) and normalise its tensors."""
    _check_tensor("q", q, "of shape [b, s_q, h_q, d_qk]")
    if q.dim() != 4:
        raise ValueError(f"q must have shape [b, s_q, h_q, d_qk] (4-D), got {tuple(q.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q must be bfloat16, float16, float32 or float64, got {q.dtype}")
    b, s_q, h_q, d_qk = q.shape
    device = q.device
    if plan is not None:
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan must be a DecodePlan (from mla_kernels.decode_plan), got {type(plan).__name__}")
        if tuple(q.shape) != plan.q_shape:
            raise ValueError(f"q has shape {tuple(q.shape)} but the plan was made for {plan.q_shape}")
        if q.dtype != plan.dtype or device != plan.device:
            raise ValueError(f"q is {q.dtype} on {device} but the plan is for {plan.dtype} on {plan.device}")
        if d_v != plan.d_v:
            raise ValueError(f"d_v={d_v} but the plan was made for d_v={plan.d_v}")
    _check_tensor("kv_cache", kv_cache, "of shape [num_pages, page_size, 1, d_qk] or [n, d_qk]")
    kd = kv_cache.dim()
    if not (kd == 4 and kv_cache.shape[2] == 1) and not (kd == 3 and kv_cache.shape[1] == 1) and kd != 2:
        raise ValueError(
            f"kv_cache must have shape [num_pages, page_size, 1, d_qk] (a paged cache, one KV head) or a flat "
            f"[n, d_qk] / [n, 1, d_qk] cache, got {tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[-1] != d_qk:
        raise ValueError(f"kv_cache's last dim must equal q's d_qk={d_qk}, got {tuple(kv_cache.shape)}")
    if kv_cache.dtype != q.dtype:
        raise TypeError(f"kv_cache must have q's dtype {q.dtype}, got {kv_cache.dtype}")
    if kv_cache.device != device:
        raise ValueError(f"kv_cache is on {kv_cache.device} but q is on {device}; all tensors must share one device")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (the cache is not copied per call)")
    n_rows = kv_cache.numel() // d_qk if d_qk else 0
    if n_rows >= 2**31:
        raise ValueError(f"kv_cache has {n_rows} rows; the kernels address at most 2^31 - 1")
    if kv_cache.numel() and not _no_data(kv_cache) and kv_cache.data_ptr() % 16:
        raise ValueError("kv_cache must be 16-byte aligned")
    page_size = kv_cache.shape[1] if kd == 4 else kv_cache.shape[0]

    _check_tensor("indices", indices, "of shape [b, s_q, topk]")
    if indices.dim() != 3 or indices.shape[0] != b or indices.shape[1] != s_q:
        raise ValueError(f"indices must have shape [b, s_q, topk] with b={b}, s_q={s_q}, got {tuple(indices.shape)}")
    if plan is not None and indices.shape[2] != plan.topk:
        raise ValueError(f"indices has topk={indices.shape[2]} but the plan was made for topk={plan.topk}")
    if indices.dtype not in _INDEX_DTYPES:
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype}")
    if indices.device != device:
        raise ValueError(f"indices is on {indices.device} but q is on {device}")
    if indices.dtype == torch.int64:
        big = torch.iinfo(torch.int32).max
        indices = torch.where((indices < 0) | (indices > big), torch.full_like(indices, -1), indices).to(torch.int32)

    sm_scale = _check_scale(sm_scale)
    if not sm_scale > 0:
        raise ValueError(f"sm_scale must be > 0 for decode, got {sm_scale}")
    if plan is None:
        d_v = _check_pos_int("d_v", d_v)
        if d_v > d_qk:
            raise ValueError(f"d_v must satisfy d_v <= d_qk={d_qk}, got d_v={d_v}")

    tl = None
    if topk_length is not None:
        _check_tensor("topk_length", topk_length, f"of shape [b]=[{b}] or [b, s_q]=[{b}, {s_q}]")
        if tuple(topk_length.shape) not in ((b,), (b, s_q)):
            raise ValueError(f"topk_length must have shape [b]=[{b}] or [b, s_q]=[{b}, {s_q}], got "
                             f"{tuple(topk_length.shape)}")
        if topk_length.dtype not in _INDEX_DTYPES:
            raise TypeError(f"topk_length must be int32 or int64, got {topk_length.dtype}")
        if topk_length.device != device:
            raise ValueError(f"topk_length is on {topk_length.device} but q is on {device}")
        tl = topk_length if topk_length.dtype == torch.int32 else topk_length.clamp(-1, indices.shape[2]).to(torch.int32)

    sink = None
    if attn_sink is not None:
        _check_tensor("attn_sink", attn_sink, f"of shape [h_q]=[{h_q}]")
        if attn_sink.shape != (h_q,):
            raise ValueError(f"attn_sink must have shape [h_q]=[{h_q}], got {tuple(attn_sink.shape)}")
        if not attn_sink.is_floating_point():
            raise TypeError(f"attn_sink must be a floating tensor, got {attn_sink.dtype}")
        if attn_sink.device != device:
            raise ValueError(f"attn_sink is on {attn_sink.device} but q is on {device}")
        sink = attn_sink.detach()
        if sink.dtype != compute_dtype(q.dtype):
            sink = sink.to(compute_dtype(q.dtype))

    bt = None
    if block_table is not None:
        _check_tensor("block_table", block_table, f"of shape [b, max_pages] with b={b}")
        if block_table.dim() != 2 or block_table.shape[0] != b or block_table.shape[1] < 1:
            raise ValueError(f"block_table must have shape [b, max_pages] with b={b} and max_pages >= 1, got "
                             f"{tuple(block_table.shape)}")
        if block_table.dtype not in _INDEX_DTYPES:
            raise TypeError(f"block_table must be int32 or int64, got {block_table.dtype}")
        if block_table.device != device:
            raise ValueError(f"block_table is on {block_table.device} but q is on {device}")
        bt = block_table
        if bt.dtype == torch.int64:
            big = torch.iinfo(torch.int32).max
            bt = torch.where((bt < 0) | (bt > big), torch.full_like(bt, -1), bt).to(torch.int32)

    bias = None
    if q_bias is not None:
        _check_tensor("q_bias", q_bias, f"of shape [b, h_q, d_qk]=[{b}, {h_q}, {d_qk}]")
        if q_bias.shape != (b, h_q, d_qk):
            raise ValueError(f"q_bias must have shape [b, h_q, d_qk]=[{b}, {h_q}, {d_qk}], got {tuple(q_bias.shape)}")
        if q_bias.dtype != q.dtype:
            raise TypeError(f"q_bias must have q's dtype {q.dtype}, got {q_bias.dtype}")
        if q_bias.device != device:
            raise ValueError(f"q_bias is on {q_bias.device} but q is on {device}")
        bias = q_bias.detach()

    # contiguous, 16-byte aligned copies only where needed (pass contiguous tensors to avoid them)
    q = _contig(q.detach())
    indices = _contig(indices)
    if tl is not None:
        tl = _contig(tl)
    if sink is not None:
        sink = _contig(sink)
    if bt is not None:
        bt = _contig(bt)
    if bias is not None:
        bias = _contig(bias)
    return q, kv_cache.detach(), indices, sm_scale, tl, sink, bt, bias, page_size


def _planned_call_ok(plan, q, kv_cache, indices, sm_scale, d_v, topk_length, attn_sink, block_table, q_bias) -> bool:
    """The per-call check of a planned decode (host time matters here: a few attribute reads per
    tensor).  True when every input already is what the kernels take as it is -- right shapes,
    dtypes and device, contiguous, 16-byte aligned, no autograd; anything else (including every
    error case) goes through :func:`_decode_inputs`, which raises with a clear message or
    normalises."""
    try:
        f = plan.fast  # precomputed by DecodePlan.allocate
        dev, dt = f.dev, f.dtype
        if not (type(sm_scale) is float and sm_scale > 0 and d_v == f.d_v
                and q.shape == f.q_shape and q.dtype == dt and q.get_device() == dev and q.is_contiguous()
                and not q.requires_grad and q.data_ptr() % 16 == 0
                and indices.shape == f.idx_shape and indices.dtype == torch.int32 and indices.get_device() == dev
                and indices.is_contiguous()
                and kv_cache.dtype == dt and kv_cache.get_device() == dev and kv_cache.is_contiguous()
                and not kv_cache.requires_grad and kv_cache.data_ptr() % 16 == 0
                and kv_cache.shape[-1] == f.d_qk and kv_cache.numel() < f.max_kv_numel):
            return False
        kd = kv_cache.dim()  # [pages, page_size, 1, d], or flat: [n, d] / [n, 1, d] (the forward's kv shape)
        if not (kd == 2 or (kd == 4 and kv_cache.shape[2] == 1) or (kd == 3 and kv_cache.shape[1] == 1)):
            return False
        if topk_length is not None and not (
                topk_length.dtype == torch.int32 and topk_length.shape in f.tl_shapes
                and topk_length.get_device() == dev and topk_length.is_contiguous()):
            return False
        if attn_sink is not None and not (
                attn_sink.dtype == f.sink_dtype and attn_sink.shape == f.sink_shape and attn_sink.get_device() == dev
                and attn_sink.is_contiguous() and not attn_sink.requires_grad):
            return False
        if block_table is not None and not (
                block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == f.b
                and block_table.shape[1] >= 1 and block_table.get_device() == dev and block_table.is_contiguous()):
            return False
        if q_bias is not None and not (
                q_bias.shape == f.bias_shape and q_bias.dtype == dt and q_bias.get_device() == dev
                and q_bias.is_contiguous() and not q_bias.requires_grad and q_bias.data_ptr() % 16 == 0):
            return False
        return True
    except (AttributeError, TypeError):  # not a plan / not a tensor: the full check says what
        return False


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    *,
    block_table: Optional[torch.Tensor] = None,
    q_bias: Optional[torch.Tensor] = None,
    plan: Optional[DecodePlan] = None,
):
    """Sparse MLA decode on a paged KV cache (split-top-k flash-decoding).

    Args:
        q: ``[b, s_q, h_q, d_qk]`` -- ``b`` requests of ``s_q`` query tokens (1; 2..4 with MTP),
            ``h_q`` in {8, 16, 24, 32} or a multiple of 64.
        kv_cache: ``[num_pages, page_size, 1, d_qk]`` (any page size), or a flat ``[n, d_qk]`` /
            ``[n, 1, d_qk]`` (one page); contiguous, q's dtype.  ``V = kv[..., :d_v]``.
        indices: ``[b, s_q, topk]`` int32: physical ids ``page * page_size + offset`` into the
            flattened cache (FlashMLA's sparse decode convention), or with ``block_table``
            logical positions of request ``b``'s sequence.  Invalid entries (-1, out of range,
            slots at or past ``topk_length``) contribute nothing.
        sm_scale: softmax scale (> 0).
        topk_length: ``[b]`` (per request) or ``[b, s_q]`` int32: slots at or past it are ignored.
        attn_sink: ``[h_q]``: scales ``out`` by ``exp(lse) / (exp(lse) + exp(sink))``; lse untouched.
        block_table: ``[b, max_pages]`` int32: position ``pos`` of request ``b`` is row
            ``block_table[b, pos // page_size] * page_size + pos % page_size``; negative
            positions, ``pos // page_size >= max_pages`` and entries outside ``[0, num_pages)``
            are invalid slots (no error: checking values would synchronise with the device).
        q_bias: ``[b, h_q, d_qk]``: added to every query of request ``b`` before ``q . k``
            (Transformer-XL's content bias; fused into the kernel's Q load; ``q + q_bias`` is
            rounded to q's dtype once, as ``q + q_bias`` in PyTorch would be).
        plan: a :func:`decode_plan` for this batch shape: no allocation, no host-device sync,
            CUDA-graph capturable.  Without it a plan is made for the call (allocates; compiles
            on first use of a configuration).

    Returns:
        ``(out [b, s_q, h_q, d_v]`` in q's dtype, ``lse [b, s_q, h_q]`` float32, natural log);
        rows with no valid slot give ``out = 0``, ``lse = +inf``.  With a plan these are the
        plan's buffers (overwritten by its next call).
    """
    if plan is not None and not tracing() and _planned_call_ok(plan, q, kv_cache, indices, sm_scale, d_v,
                                                               topk_length, attn_sink, block_table, q_bias):
        return plan.backend.decode(plan, q, kv_cache, indices, sm_scale, topk_length, attn_sink, block_table, q_bias)
    if tracing():  # a plan's buffers cannot be a traced op's outputs: the compiled graph allocates them
        _decode_inputs(plan, q, kv_cache, indices, sm_scale, d_v, topk_length, attn_sink, block_table, q_bias)
        det = (lambda t: t.detach() if t is not None else None)
        return tuple(torch.ops.mla_kernels.sparse_mla_decode(
            q.detach(), kv_cache.detach(), indices, _check_scale(sm_scale), d_v, topk_length, det(attn_sink),
            block_table, det(q_bias)))
    return sparse_mla_decode_eager(q, kv_cache, indices, sm_scale, d_v, topk_length, attn_sink,
                                   block_table=block_table, q_bias=q_bias, plan=plan)


def sparse_mla_decode_eager(q, kv_cache, indices, sm_scale, d_v=512, topk_length=None, attn_sink=None, *,
                            block_table=None, q_bias=None, plan=None):
    """:func:`sparse_mla_decode`'s body (the ``mla_kernels::sparse_mla_decode`` op's
    implementation, called there without a plan)."""
    args = _decode_inputs(plan, q, kv_cache, indices, sm_scale, d_v, topk_length, attn_sink, block_table, q_bias)
    if plan is None:
        q, indices = args[0], args[2]
        b, s_q, h_q, d_qk = q.shape
        if b == 0 or s_q == 0 or indices.shape[2] == 0:
            out = torch.zeros(b, s_q, h_q, d_v, dtype=q.dtype, device=q.device)
            return out, torch.full((b, s_q, h_q), math.inf, dtype=compute_dtype(q.dtype), device=q.device)
        plan = decode_plan(b, s_q, h_q, indices.shape[2], d_qk=d_qk, d_v=d_v, device=q.device, dtype=q.dtype)
    return plan.backend.decode(plan, *args[:-1])
