"""Backend selection rules, fallback warnings, forced backends and the first-use canary.

Runs on the CPU: ``dispatch._is_cuda``/``_arch_of`` are patched so that CPU tensors take the GPU
code path, and fake kernel backends (wrapping the reference, optionally corrupting results)
are injected with ``dispatch.register_backend``."""

from __future__ import annotations

import warnings

import pytest
import torch

import mla_kernels as mk
from mla_kernels import dispatch
from mla_kernels.dispatch import ReferenceBackend

from conftest import make_case


class FakeKernel(ReferenceBackend):
    """A 'kernel' backend: serves fwd/attn_dist for h_q % 2 == 0, optionally wrong."""

    def __init__(self, name="sm90", wrong=False, verified=True, block=4):
        self.name = name
        self.wrong = wrong
        self.hardware_verified = verified
        self.topk_block = block
        self.calls = []

    def supports(self, op, p):
        if op == "bwd":
            return "no fake bwd"
        if p.h_q % 2:
            return f"h_q={p.h_q} is odd"
        return None

    def fwd(self, p):
        self.calls.append(("fwd", p.topk))
        assert p.topk % self.topk_block == 0, "API must pad topk to the backend's block"
        out, ml, lse = super().fwd(p)
        if self.wrong:
            out = out + 1.0
        return out, ml, lse

    def attn_dist(self, p, lse, normalize):
        self.calls.append(("attn_dist", p.topk))
        res = super().attn_dist(p, lse, normalize)
        return res * 2 if self.wrong else res


@pytest.fixture
def gpu_like(monkeypatch):
    monkeypatch.setattr(dispatch, "_is_cuda", lambda d: True)
    monkeypatch.setattr(dispatch, "_arch_of", lambda d: "sm90")


def _case(h=4):
    return make_case(3, h, 16, 20, 6, d_v=8, dtype=torch.float32)


def test_cpu_uses_reference_without_warning():
    c = _case()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mk.sparse_mla_fwd(c.q, c.kv, c.indices, c.sm_scale, 8)
    assert mk.backend_for("cpu") == "reference"


def test_auto_picks_kernel_and_pads_topk(gpu_like):
    fake = FakeKernel()
    dispatch.register_backend("sm90", fake)
    c = _case()
    out, _, _ = mk.sparse_mla_fwd(c.q, c.kv, c.indices, c.sm_scale, 8)
    assert fake.calls == [("fwd", 8)]  # topk 6 padded to 8
    want = dispatch.get_backend("reference").fwd(mk.api.make_problem(c.q, c.kv, c.indices, c.sm_scale, 8))
    torch.testing.assert_close(out, want[0])
    res = mk.attn_dist(c.q, c.kv, c.indices, want[2], c.sm_scale)
    assert res.shape == (3, 6)  # sliced back to the caller's topk


def test_auto_falls_back_with_one_warning(gpu_like):
    fake = FakeKernel()
    dispatch.register_backend("sm90", fake)
    c = _case(h=3)
    with pytest.warns(RuntimeWarning, match="h_q=3 is odd"):
        mk.sparse_mla_fwd(c.q, c.kv, c.indices, c.sm_scale, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason does not warn twice
        mk.sparse_mla_fwd(c.q, c.kv, c.indices, c.sm_scale, 8)
    assert fake.calls == []


def test_forced_backend_raises_when_it_cannot_serve(gpu_like, monkeypatch):
    dispatch.register_backend("sm90", FakeKernel())
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    c = _case(h=3)
    with pytest.raises(mk.BackendUnavailableError, match="h_q=3 is odd"):
        mk.sparse_mla_fwd(c.q, c.kv, c.indices, c.sm_scale, 8)
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm100")
    with pytest.raises(mk.BackendUnavailableError, match="not sm100"):
        mk.sparse_mla_fwd(*_case_args())


def _case_args():
    c = _case()
    return c.q, c.kv, c.indices, c.sm_scale, 8


def test_forced_reference_and_bad_env(gpu_like, monkeypatch):
    fake = FakeKernel()
    dispatch.register_backend("sm90", fake)
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "reference")
    mk.sparse_mla_fwd(*_case_args())
    assert fake.calls == []
    assert mk.backend_for("cpu") == "reference"
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "tpu")
    with pytest.raises(ValueError, match="MLA_KERNELS_BACKEND='tpu'"):
        mk.sparse_mla_fwd(*_case_args())


def test_forced_kernel_on_cpu_tensors_raises_as_the_readme_says(monkeypatch):
    args = _case_args()
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    with pytest.raises(mk.BackendUnavailableError, match="MLA_KERNELS_BACKEND=sm90 cannot serve tensors on cpu"):
        mk.sparse_mla_fwd(*args)
    with pytest.raises(mk.BackendUnavailableError, match="cannot serve tensors on cpu"):
        mk.backend_for("cpu")
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "reference")
    out, _, _ = mk.sparse_mla_fwd(*args)
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto on CPU: the reference, silently
        torch.testing.assert_close(out, mk.sparse_mla_fwd(*args)[0])


def test_bwd_without_kernel_falls_back(gpu_like):
    dispatch.register_backend("sm90", FakeKernel())
    c = _case()
    out, _, lse = mk.sparse_mla_fwd(c.q, c.kv, c.indices, c.sm_scale, 8)
    with pytest.warns(RuntimeWarning, match="no fake bwd"):
        mk.sparse_mla_bwd(c.q, c.kv, out, torch.randn_like(out), c.indices, lse, c.sm_scale, 8)


def test_canary_marks_a_wrong_configuration_bad(gpu_like):
    fake = FakeKernel(wrong=True, verified=False)
    dispatch.register_backend("sm90", fake)
    c = _case()
    with pytest.warns(RuntimeWarning, match="failed its first-use check .wrong answer"):
        out, _, _ = mk.sparse_mla_fwd(c.q, c.kv, c.indices, c.sm_scale, 8)
    ref_out = dispatch.get_backend("reference").fwd(mk.api.make_problem(c.q, c.kv, c.indices, c.sm_scale, 8))[0]
    torch.testing.assert_close(out, ref_out)  # the reference served the call
    n = len(fake.calls)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per configuration, not per call
        mk.sparse_mla_fwd(c.q, c.kv, c.indices, c.sm_scale, 8)
    assert len(fake.calls) == n  # that configuration is not checked again nor served
    # another op is another configuration: checked on its own
    with pytest.warns(RuntimeWarning, match="attn_dist kernel for this configuration failed"):
        mk.attn_dist(c.q, c.kv, c.indices, torch.zeros(3, 4), c.sm_scale)


def test_canary_passes_a_correct_unverified_backend(gpu_like, monkeypatch):
    fake = FakeKernel(wrong=False, verified=False)
    dispatch.register_backend("sm90", fake)
    c = _case()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mk.sparse_mla_fwd(c.q, c.kv, c.indices, c.sm_scale, 8)
        n = len(fake.calls)
        mk.sparse_mla_fwd(c.q, c.kv, c.indices, c.sm_scale, 8)  # canary runs once per config
    assert len(fake.calls) == n + 1
    monkeypatch.setenv("MLA_KERNELS_CANARY", "0")
    dispatch.reset_state()
    wrong = FakeKernel(wrong=True, verified=False)
    dispatch.register_backend("sm90", wrong)
    mk.sparse_mla_fwd(c.q, c.kv, c.indices, c.sm_scale, 8)  # canary off: served, unchecked
    assert wrong.calls == [("fwd", 8)]


def test_canary_catches_a_crashing_backend(gpu_like):
    class Crashing(FakeKernel):
        def fwd(self, p):
            raise RuntimeError("illegal instruction")

    dispatch.register_backend("sm90", Crashing(verified=False))
    with pytest.warns(RuntimeWarning, match="raised RuntimeError"):
        mk.sparse_mla_fwd(*_case_args())


def test_backend_for_reports_kernel(gpu_like):
    dispatch.register_backend("sm90", FakeKernel())
    assert mk.backend_for("cpu") == "sm90"


def test_fwd_ring_env(monkeypatch):
    """MLA_KERNELS_FWD_RING: unset -- the alternating KV ring; 'fixed' / 'alt' (whitespace
    stripped); anything else a clear error.  The forward's compile cache key names the ring only
    when it is not the default."""
    pytest.importorskip("cutlass", reason="the sm90 backend module imports the CuTe DSL")
    from mla_kernels.sm90 import fwd_ring

    monkeypatch.delenv("MLA_KERNELS_FWD_RING", raising=False)
    assert fwd_ring() == "alt"
    for env, want in (("fixed", "fixed"), (" alt ", "alt")):
        monkeypatch.setenv("MLA_KERNELS_FWD_RING", env)
        assert fwd_ring() == want
    monkeypatch.setenv("MLA_KERNELS_FWD_RING", "deep")
    with pytest.raises(ValueError, match="MLA_KERNELS_FWD_RING='deep': expected one of fixed, alt"):
        fwd_ring()


def test_attn_dist_ctas_env(monkeypatch):
    """The sm90 attention distribution's grid: unset or 'auto' -- the SM count with more items than
    SMs (tokens mode: only with Q through the ring), else one CTA per item; '0' -- one CTA per item;
    N -- at most N CTAs; garbage is a clear error.  MLA_KERNELS_ATTN_DIST_QVEC: unset or 1 -- 16-byte Q loads, 0 --
    4-byte loads, anything else an error."""
    pytest.importorskip("cutlass", reason="the sm90 backend module imports the CuTe DSL")
    from mla_kernels.sm90 import attn_dist_ctas

    cpu = torch.device("cpu")  # the decode module's default SM count stands in for a GPU's
    monkeypatch.delenv("MLA_KERNELS_ATTN_DIST_CTAS", raising=False)
    n_sm = attn_dist_ctas(cpu, 128, 1 << 20)
    assert n_sm > 0  # the default: heads mode, more items than SMs -> one CTA per SM
    assert attn_dist_ctas(cpu, 64, 1 << 20) == n_sm  # tokens mode with Q through the ring: persistent too
    assert attn_dist_ctas(cpu, 64, n_sm) == 0 and attn_dist_ctas(cpu, 192, n_sm // 3 + 1) == n_sm
    monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_QRING", "0")
    assert attn_dist_ctas(cpu, 64, 1 << 20) == 0  # tokens mode, Q from global memory: one CTA per item
    assert attn_dist_ctas(cpu, 128, 1 << 20) == n_sm
    monkeypatch.delenv("MLA_KERNELS_ATTN_DIST_QRING")
    monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_CTAS", "0")
    assert attn_dist_ctas(cpu, 128, 1 << 20) == 0
    for env, want in (("0", 0), ("7", 7), (" 132 ", 132)):
        monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_CTAS", env)
        assert attn_dist_ctas(cpu, 64, 1 << 20) == want
    for bad in ("many", "-2", "1.5"):
        monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_CTAS", bad)
        with pytest.raises(ValueError, match="MLA_KERNELS_ATTN_DIST_CTAS"):
            attn_dist_ctas(cpu)
    monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_CTAS", "auto")
    n_sm = attn_dist_ctas(cpu, 128, 1 << 20)
    assert n_sm > 0  # heads mode, more items than SMs: persistent, one CTA per SM
    assert attn_dist_ctas(cpu, 256, n_sm // 2 + 1) == n_sm  # two head groups per token
    assert attn_dist_ctas(cpu, 128, n_sm) == 0  # no more items than SMs: one CTA per item
    assert attn_dist_ctas(cpu, 64, 1 << 20) == n_sm and attn_dist_ctas(cpu, 192, 1 << 20) == n_sm  # tokens mode

    from mla_kernels.sm90 import attn_dist_q_vec

    monkeypatch.delenv("MLA_KERNELS_ATTN_DIST_QVEC", raising=False)
    assert attn_dist_q_vec() is True
    for env, want in (("1", True), ("0", False), (" 0 ", False)):
        monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_QVEC", env)
        assert attn_dist_q_vec() is want
    for bad in ("yes", "2"):
        monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_QVEC", bad)
        with pytest.raises(ValueError, match="MLA_KERNELS_ATTN_DIST_QVEC"):
            attn_dist_q_vec()


def test_attn_dist_profile_option_is_checked():
    """The attention distribution's timing copy ('noq') exists for persistent grids only."""
    pytest.importorskip("cutlass", reason="the sm90 kernel module imports the CuTe DSL")
    from mla_kernels.sm90.attn_dist import AttnDistSm90

    assert AttnDistSm90(576, "heads", False, False, 132, "noq").profile == "noq"
    with pytest.raises(ValueError, match="persistent"):
        AttnDistSm90(576, "heads", False, False, 0, "noq")
    with pytest.raises(ValueError, match="profile"):
        AttnDistSm90(576, "heads", False, False, 132, "fast")
