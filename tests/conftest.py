"""Shared fixtures and helpers: random problems with every edge case, comparisons, GPU gating."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from mla_kernels import dispatch
from mla_kernels.common import host


def cuda_capability():
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def _dsl_importable() -> Optional[str]:
    try:
        import cutlass.cute  # noqa: F401
    except Exception as e:  # pragma: no cover
        return f"CuTe DSL not importable: {e}"
    return None


def skip_unless_sm90():
    cap = cuda_capability()
    if cap is None:
        return pytest.mark.skip(reason="needs a CUDA GPU (sm_90); none present")
    if cap != (9, 0):
        return pytest.mark.skip(reason=f"needs an sm_90 GPU; this one is sm_{cap[0]}{cap[1]}")
    why = _dsl_importable()
    if why:
        return pytest.mark.skip(reason=why)
    return pytest.mark.sm90


def skip_unless_sm100():
    cap = cuda_capability()
    if cap is None:
        return pytest.mark.skip(reason="needs a CUDA GPU (sm_100); none present")
    if cap[0] != 10:
        return pytest.mark.skip(reason=f"needs an sm_100 GPU; this one is sm_{cap[0]}{cap[1]}")
    return pytest.mark.sm100


@pytest.fixture
def trace_for_sm100(monkeypatch):
    """Trace tcgen05 code for sm_100a even on a host with another GPU (the DSL otherwise traces
    for the local device's arch and rejects tcgen05 atoms)."""
    pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed")
    from cutlass.cutlass_dsl import CuTeDSL

    monkeypatch.setattr(CuTeDSL._get_dsl().envar, "arch", "sm_100a")


@pytest.fixture(autouse=True)
def _hang_guard(request):
    """With MLA_TEST_TIMEOUT=<s>, dump all stacks and exit if one test runs longer (a hung kernel
    otherwise blocks the whole session without a word)."""
    t = float(os.environ.get("MLA_TEST_TIMEOUT", "0") or 0)
    if t > 0:
        import faulthandler
        import sys

        print(f"\n[start] {request.node.nodeid}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback_later(t, exit=True)
        yield
        faulthandler.cancel_dump_traceback_later()
    else:
        yield


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """Compiled kernels and first-use verdicts go to a directory of this test session, never to
    the user's cache (``MLA_KERNELS_CACHE_DIR``)."""
    old = os.environ.get("MLA_KERNELS_CACHE_DIR")
    os.environ["MLA_KERNELS_CACHE_DIR"] = str(tmp_path_factory.mktemp("mla_kernels_cache"))
    yield
    if old is None:
        os.environ.pop("MLA_KERNELS_CACHE_DIR", None)
    else:
        os.environ["MLA_KERNELS_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def _fresh_dispatch_state(monkeypatch):
    """Each test starts with no cached warnings/canary results and poisoned kernel outputs."""
    dispatch.reset_state()
    monkeypatch.setattr(host, "POISON_OUTPUTS", True)
    monkeypatch.delenv(dispatch.ENV_BACKEND, raising=False)
    yield
    dispatch.reset_state()


@dataclass
class Case:
    q: torch.Tensor
    kv: torch.Tensor
    indices: torch.Tensor
    sm_scale: float
    d_v: int
    topk_length: Optional[torch.Tensor]
    attn_sink: Optional[torch.Tensor]


def make_case(
    s_q: int,
    h_q: int,
    d_qk: int,
    s_kv: int,
    topk: int,
    *,
    d_v: int = 512,
    dtype=torch.bfloat16,
    device="cpu",
    invalid_frac: float = 0.1,
    dup_frac: float = 0.05,
    empty_rows: int = 1,
    topk_length: bool = False,
    sink: Optional[str] = None,
    seed: Optional[int] = None,
    scale: float = 0.1,
    kv_scale: float = 1.0,
    sm_scale: Optional[float] = None,
    kv: Optional[torch.Tensor] = None,
) -> Case:
    """A random problem with invalid (-1, negative, >= s_kv) and duplicate indices, some all-invalid
    rows, optional topk_length (with zeros) and optional sink ("finite" or "neginf").

    Values follow FlashMLA's test distribution by default (``randn * 0.1`` + an offset), the one
    the tolerances of docs/METHOD.md were set for; ``scale``/``kv_scale`` make harder cases."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))

    def rnd(*shape, s):
        # FlashMLA's test distribution at s = 0.1: randn * s plus a random per-tensor offset.
        return torch.randn(*shape, generator=g) * s + (torch.rand((), generator=g) - 0.5) * s

    q = rnd(s_q, h_q, d_qk, s=scale).to(device=device, dtype=dtype)
    if kv is None:
        kv = rnd(s_kv, 1, d_qk, s=scale * kv_scale).to(device=device, dtype=dtype)
    idx = torch.randint(0, s_kv, (s_q, topk), generator=g)
    if dup_frac > 0 and topk > 1:
        dup = torch.rand(s_q, topk, generator=g) < dup_frac
        src = torch.randint(0, topk, (s_q, topk), generator=g)
        idx = torch.where(dup, idx.gather(1, src), idx)
    if invalid_frac > 0:
        bad = torch.rand(s_q, topk, generator=g) < invalid_frac
        kind = torch.randint(0, 3, (s_q, topk), generator=g)
        badval = torch.where(kind == 0, torch.full_like(idx, -1),
                             torch.where(kind == 1, torch.randint(-1000, -1, (s_q, topk), generator=g),
                                         s_kv + torch.randint(0, 1000, (s_q, topk), generator=g)))
        idx = torch.where(bad, badval, idx)
    for r in range(min(empty_rows, s_q)):
        row = (r * 7919) % s_q
        idx[row] = -1
    tl = None
    if topk_length:
        tl = torch.randint(0, topk + 1, (s_q,), generator=g)
        tl[:: max(1, s_q // 5)] = 0
        if s_q > 1:
            tl[1] = topk
        tl = tl.to(torch.int32).to(device)
    sk = None
    if sink is not None:
        sk = torch.randn(h_q, generator=g) * 2
        if sink == "neginf":
            sk[::2] = -math.inf
        sk = sk.to(device=device, dtype=torch.float32)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d_qk)
    return Case(q, kv, idx.to(torch.int32).reshape(s_q, 1, topk).to(device), sm_scale, d_v, tl, sk)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` accumulated in float64, in chunks (a float64 copy of a 70,000-query
    dq is 18 GB: whole-tensor copies ran an 80 GB GPU out of memory)."""
    if a.shape != b.shape:
        a, b = torch.broadcast_tensors(a, b)
    a, b = a.reshape(-1), b.reshape(-1)
    num = den = 0.0
    step = 1 << 26
    for i in range(0, a.numel(), step):
        da, db = a[i:i + step].double(), b[i:i + step].double()
        num += (da - db).square().sum().item()
        den += db.square().sum().item()
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def assert_close_fwd(out, max_logits, lse, ref, *, empty: torch.Tensor, rtol_l2=1e-2, lse_rtol=1e-5,
                     abs_tol=8e-4, logit_scale=1.0):
    """The forward tolerances of docs/METHOD.md (``ref`` computed in float32, ``out`` not rounded):
    rel L2 <= 1e-2, |err| <= abs_tol + 2.5e-2 |ref| elementwise, lse/max_logits relative <= 1e-5;
    empty rows exact; no NaN anywhere.  ``abs_tol`` is 8e-4 for values of FlashMLA's scale
    (|v| ~ 0.1); tests with larger values scale it with |v| (P is rounded to bf16 before P.V,
    as in every peer kernel, so the absolute error grows with |v|).  ``logit_scale`` (default 1)
    bounds lse/max_logits errors by ``lse_rtol * max(|ref|, logit_scale)``: the tensor cores'
    float32 accumulation error of a logit scales with the logits' magnitude, not with lse."""
    r_out, r_ml, r_lse = ref
    assert not torch.isnan(out).any(), "NaN in out"
    assert not torch.isnan(lse).any(), "NaN in lse"
    assert not torch.isnan(max_logits).any(), "NaN in max_logits"
    e = empty
    if e.any():
        assert (out[e] == 0).all(), "empty rows must give out == 0"
        assert torch.isposinf(lse[e]).all(), "empty rows must give lse == +inf"
        assert torch.isneginf(max_logits[e]).all(), "empty rows must give max_logits == -inf"
    ne = ~e
    if ne.any():
        o, ro = out[ne].float(), r_out[ne].float()
        assert rel_l2(o, ro) <= rtol_l2, f"out rel L2 {rel_l2(o, ro):.3g}"
        err = (o - ro).abs()
        lim = abs_tol + 2.5e-2 * ro.abs()
        assert (err <= lim).all(), f"out max abs err {err.max().item():.3g} (worst excess {(err - lim).max().item():.3g})"
        for name, got, want in (("lse", lse, r_lse), ("max_logits", max_logits, r_ml)):
            g, w = got[ne].double(), want[ne].double()
            bad = (g - w).abs() > lse_rtol * w.abs().clamp_min(logit_scale)
            assert not bad.any(), f"{name}: max err {(g - w).abs().max().item():.3g}"


# ---------------------------------------------------------------------------------------------
# Backward checks shared by the arch test files
# ---------------------------------------------------------------------------------------------


def bwd_fwd_ref(case):
    """The forward (float32 reference) whose outputs the backward consumes: out in bf16, lse f32."""
    from mla_kernels import reference as ref

    out, _, lse = ref.sparse_mla_fwd_ref(case.q.float(), case.kv.float(), case.indices, case.sm_scale,
                                         case.d_v, case.topk_length, case.attn_sink)
    return out.to(case.q.dtype), lse.float()


def run_bwd_and_check(case, monkeypatch, backend: str, *, deterministic=False, attn_sum=False, dout_scale=0.1,
                      seed=0, dq_abs=None, zero_dout_heads=None):
    """``sparse_mla_bwd`` forced onto ``backend`` vs the float32 reference backward, on the
    reference forward's outputs; every tolerance of docs/METHOD.md, exact zeros for empty rows and
    unreferenced kv rows, no NaN.  Returns the backend's outputs.

    ``zero_dout_heads``: a slice of heads whose dO is zero.
    ``dq_abs``: compare dq by max abs error instead (problems where dq is 0 up to rounding,
    e.g. one valid slot per row: dS = P (dP - delta) = 0 exactly in exact arithmetic)."""
    import mla_kernels as mk
    from mla_kernels import reference as ref

    monkeypatch.setenv("MLA_KERNELS_BACKEND", backend)  # no silent fallback: a miss raises
    out, lse = bwd_fwd_ref(case)
    g = torch.Generator(device="cpu").manual_seed(seed)
    dout = (torch.randn(out.shape, generator=g) * dout_scale).to(out.device, out.dtype)
    if zero_dout_heads is not None:
        dout[:, zero_dout_heads] = 0  # those heads contribute nothing to dq / dkv
    got = mk.sparse_mla_bwd(case.q, case.kv, out, dout, case.indices, lse, case.sm_scale, case.d_v,
                            case.topk_length, case.attn_sink, deterministic=deterministic,
                            return_attn_sum=attn_sum)
    torch.cuda.synchronize()
    want = ref.sparse_mla_bwd_ref(case.q.float(), case.kv.float(), out.float(), dout.float(), case.indices,
                                  lse, case.sm_scale, case.d_v, case.topk_length, case.attn_sink,
                                  return_attn_sum=attn_sum)
    dq, dkv, dsink = got[:3]
    assert dq.dtype == torch.bfloat16 and dkv.dtype == torch.bfloat16 and dkv.shape == case.kv.shape
    for name, t in (("dq", dq), ("dkv", dkv)):
        assert not torch.isnan(t).any(), f"NaN in {name}"
    if dq_abs is None:
        assert rel_l2(dq.float(), want[0]) <= 1e-2, f"dq rel L2 {rel_l2(dq.float(), want[0]):.3g}"
    else:
        assert (dq.float() - want[0]).abs().max() <= dq_abs
    assert rel_l2(dkv.float(), want[1]) <= 1e-2, f"dkv rel L2 {rel_l2(dkv.float(), want[1]):.3g}"
    # Exact zeros: rows of empty queries in dq, kv rows no valid slot selects in dkv.
    s_kv = case.kv.shape[0]
    valid = ref.valid_mask(case.indices, s_kv, case.topk_length)
    empty = ~valid.any(dim=-1)
    if empty.any():
        assert (dq[empty] == 0).all(), "empty rows must give dq == 0"
    used = torch.zeros(s_kv, dtype=torch.bool, device=dkv.device)
    used[case.indices.reshape(valid.shape)[valid].long()] = True
    if (~used).any():
        assert (dkv.reshape(s_kv, -1)[~used] == 0).all(), "unreferenced kv rows must get dkv == 0"
    if case.attn_sink is None:
        assert dsink is None
    else:
        assert not torch.isnan(dsink).any()
        err = (dsink.double() - want[2].double()).abs().max() / want[2].double().abs().max().clamp_min(1e-30)
        assert err <= 1e-3, f"d_attn_sink rel err {err.item():.3g}"
    if attn_sum:
        a = got[3]
        assert a.shape == want[3].shape and not torch.isnan(a).any()
        assert rel_l2(a, want[3]) <= 1e-3, f"attn_sum rel L2 {rel_l2(a, want[3]):.3g}"
        assert (a[~valid] == 0).all(), "invalid slots must give attn_sum == 0"
    return got


# ---------------------------------------------------------------------------------------------
# Shared by the sm100 tests: the DSL import, the smem layout the cp.async writers produce, the
# compile report tool
# ---------------------------------------------------------------------------------------------


def needs_cutlass():
    """The CuTe DSL module, or skip the test (stated reason) where it is not installed."""
    return pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed")


def sw128(byte_off: int) -> int:
    """The 128-byte swizzle on a 1024-byte aligned buffer: 16-byte chunk ^= row % 8."""
    return byte_off ^ (((byte_off >> 7) & 7) << 4)


def tile_offset(row: int, col: int, rows: int = 64) -> int:
    """Where KvGather / copy_dense_rows (and the kernels' P/dS row stores) put element (row, col)
    of a [rows x d] bf16 block: tile col//64 at rows*128 bytes, row at 128 bytes, 16-byte chunk
    (col%64)//8 swizzled with row % 8."""
    t, c = divmod(col, 64)
    return t * rows * 128 + row * 128 + (((c // 8) ^ (row % 8)) * 16) + (c % 8) * 2


def compile_report_module():
    """``tools/compile_report.py`` as a module (skips without the DSL)."""
    import importlib.util

    needs_cutlass()
    root = os.path.join(os.path.dirname(__file__), "..")
    spec = importlib.util.spec_from_file_location("compile_report", os.path.join(root, "tools", "compile_report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


#: (arch, kernel name) -> compile_report record, for the whole test session.
_COMPILE_RECORDS: dict = {}


def compile_records(arch: str, names) -> dict:
    """``tools/compile_report.py`` records (registers, spills, SASS counts, barrier sites) of the
    kernels ``names`` for ``arch``, each compiled once per test session: the per-kernel SASS checks
    and the barrier-rule test share them, whichever module runs first (skips without the DSL)."""
    names = set(names)
    missing = {n for n in names if (arch, n) not in _COMPILE_RECORDS}
    if missing:
        for r in compile_report_module().run(arch, only=missing, quiet=True):
            _COMPILE_RECORDS[(arch, r["name"])] = r
    unknown = sorted(n for n in names if (arch, n) not in _COMPILE_RECORDS)
    assert not unknown, f"not kernels of tools/compile_report.py for {arch}: {unknown}"
    return {n: _COMPILE_RECORDS[(arch, n)] for n in names}

