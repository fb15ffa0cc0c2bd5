"""The hang-proof first-use check (mla_kernels/common/first_use.py) on the CPU: backends that
sleep forever, crash the process, raise, or return wrong values are run in a child process with a
time limit, marked bad on disk with the reason, and the reference serves the call with one
warning.  The backends come from tests/fake_backends.py (importable by the child)."""

from __future__ import annotations

import json
import time
import warnings

import pytest
import torch

import fake_backends as fb
import mla_kernels as mk
from mla_kernels import dispatch
from mla_kernels.common import first_use

from conftest import make_case


@pytest.fixture
def sm100_like(monkeypatch, tmp_path):
    """CPU tensors take the sm100 path of dispatch; verdicts go to this test's own directory."""
    monkeypatch.setattr(dispatch, "_is_cuda", lambda d: True)
    monkeypatch.setattr(dispatch, "_arch_of", lambda d: "sm100")
    monkeypatch.setenv("MLA_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(first_use.ENV_TIMEOUT, "120")
    return tmp_path


def _args():
    c = make_case(3, 4, 16, 20, 8, d_v=8, dtype=torch.float32, seed=5)
    return c.q, c.kv, c.indices, c.sm_scale, 8


def _reference_out(args):
    p = mk.api.make_problem(*args)
    return dispatch.get_backend("reference").fwd(p)[0]


def _verdicts(root):
    return [json.loads(f.read_text()) for f in root.rglob("first_use/*.json")]


@pytest.mark.parametrize("mode,words", [
    ("sleeping", "hang: no answer within 6 s"),
    ("crashing", "crash: the check process killed by SIGSEGV"),
    ("raising", "crash: raised RuntimeError: CUDA error: an illegal instruction"),
    ("wrong", "wrong answer: relative error"),
])
def test_bad_kernel_is_marked_bad_and_the_reference_serves_the_call(sm100_like, monkeypatch, mode, words):
    if mode == "sleeping":
        monkeypatch.setenv(first_use.ENV_TIMEOUT, "6")
    backend = getattr(fb, mode.upper())
    backend.calls.clear()
    dispatch.register_backend("sm100", backend)
    args = _args()
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="failed its first-use check") as rec:
        out, _, _ = mk.sparse_mla_fwd(*args)
    assert time.monotonic() - t0 < 100
    msgs = [str(w.message) for w in rec if "first-use" in str(w.message)]
    assert len(msgs) == 1 and words in msgs[0] and "verdict in" in msgs[0], msgs
    torch.testing.assert_close(out, _reference_out(args))
    assert backend.calls == []  # the parent never ran the bad kernel itself
    (v,) = _verdicts(sm100_like)
    assert v["ok"] is False and words in v["reason"] and v["config"]["op"] == "fwd"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per process and configuration
        mk.sparse_mla_fwd(*args)


def test_a_bad_verdict_on_disk_is_reused_by_the_next_process(sm100_like, monkeypatch):
    dispatch.register_backend("sm100", fb.WRONG)
    args = _args()
    with pytest.warns(RuntimeWarning, match="wrong answer"):
        mk.sparse_mla_fwd(*args)
    # a "new process": nothing in memory, the verdict file on disk
    dispatch.reset_state()
    dispatch.register_backend("sm100", fb.WRONG)
    monkeypatch.setattr(first_use, "run_in_child", lambda *a: pytest.fail("checked again"))
    with pytest.warns(RuntimeWarning, match="wrong answer.*delete it to check again"):
        out, _, _ = mk.sparse_mla_fwd(*args)
    torch.testing.assert_close(out, _reference_out(args))


def test_good_kernel_passes_once_and_serves(sm100_like, monkeypatch):
    fb.GOOD.calls.clear()
    dispatch.register_backend("sm100", fb.GOOD)
    args = _args()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _, _ = mk.sparse_mla_fwd(*args)
    assert fb.GOOD.calls == ["fwd"]  # served by the kernel after the check (which ran in the child)
    (v,) = _verdicts(sm100_like)
    assert v["ok"] is True
    dispatch.reset_state()
    dispatch.register_backend("sm100", fb.GOOD)
    monkeypatch.setattr(first_use, "run_in_child", lambda *a: pytest.fail("checked again"))
    mk.sparse_mla_fwd(*args)
    assert fb.GOOD.calls == ["fwd", "fwd"]


def test_forced_backend_with_a_bad_configuration_raises(sm100_like, monkeypatch):
    dispatch.register_backend("sm100", fb.CRASHING)
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm100")
    with pytest.warns(RuntimeWarning):
        with pytest.raises(mk.BackendUnavailableError, match="failed its first-use check .crash"):
            mk.sparse_mla_fwd(*_args())


def test_check_off_and_bad_timeout(sm100_like, monkeypatch):
    monkeypatch.setenv(first_use.ENV_TIMEOUT, "soon")
    dispatch.register_backend("sm100", fb.WRONG)
    with pytest.raises(ValueError, match="MLA_KERNELS_CHECK_TIMEOUT='soon'"):
        mk.sparse_mla_fwd(*_args())
    monkeypatch.setenv("MLA_KERNELS_CANARY", "0")
    fb.WRONG.calls.clear()
    mk.sparse_mla_fwd(*_args())  # unchecked: served as is
    assert fb.WRONG.calls == ["fwd"]
    assert _verdicts(sm100_like) == []


def test_the_real_backends_name_their_child_import():
    from mla_kernels.sm100 import BACKEND as B100
    from mla_kernels.sm90 import BACKEND as B90

    assert B100.import_spec == "mla_kernels.sm100:BACKEND" and first_use._import_spec(B100.import_spec) is B100
    assert B90.import_spec == "mla_kernels.sm90:BACKEND" and B90.hardware_verified
