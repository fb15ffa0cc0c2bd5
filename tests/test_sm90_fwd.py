"""sm90 sparse forward kernel vs the float32 reference (GPU tests: skipped without an sm_90 GPU)."""

from __future__ import annotations

import pytest
import torch

import mla_kernels as mk
from mla_kernels import reference as ref

from conftest import assert_close_fwd, make_case, skip_unless_sm90

pytestmark = [skip_unless_sm90(), pytest.mark.gpu]


def run_and_check(case, monkeypatch, abs_tol=8e-4, logit_scale=1.0):
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")  # no silent fallback: a miss raises
    out, ml, lse = mk.sparse_mla_fwd(case.q, case.kv, case.indices, case.sm_scale, case.d_v,
                                     case.topk_length, case.attn_sink)
    torch.cuda.synchronize()
    # float32 reference on the same (bf16-valued) inputs; its out is not rounded to bf16
    want = ref.sparse_mla_fwd_ref(case.q.float(), case.kv.float(), case.indices, case.sm_scale, case.d_v,
                                  case.topk_length, case.attn_sink)
    s_kv = case.kv.shape[0]
    valid = ref.valid_mask(case.indices, s_kv, case.topk_length)
    empty = (~valid.any(dim=-1))[:, None].expand(-1, case.q.shape[1])
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and ml.dtype == torch.float32
    assert_close_fwd(out, ml, lse, want, empty=empty, abs_tol=abs_tol, logit_scale=logit_scale)


SHAPES = [
    # (s_q, s_kv, topk)
    (1, 128, 128),
    (62, 592, 128),
    (213, 1840, 256),
    (62, 1521, 512),
    (213, 95, 128),  # many out-of-range indices
    (4096, 32768, 2048),
]


@pytest.mark.parametrize("s_q,s_kv,topk", SHAPES)
@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("d_qk", [576, 512])
def test_fwd_shapes(s_q, s_kv, topk, h_q, d_qk, monkeypatch):
    if s_q == 4096 and (h_q, d_qk) != (128, 576):
        pytest.skip("headline size runs once, at h_q 128 / d_qk 576, to keep the GPU session short")
    case = make_case(s_q, h_q, d_qk, s_kv, topk, device="cuda", invalid_frac=0.1, empty_rows=2)
    run_and_check(case, monkeypatch)


@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("sink", [None, "finite", "neginf"])
def test_fwd_topk_length_and_sink(d_qk, sink, monkeypatch):
    case = make_case(213, 128, d_qk, 1840, 256, device="cuda", topk_length=True, sink=sink)
    run_and_check(case, monkeypatch)


def test_fwd_odd_block_count_and_padding(monkeypatch):
    # topk 192 = 3 blocks (odd: the last pair is half empty); topk 100 is padded to 128 by the API.
    for topk in (192, 100, 64, 1):
        case = make_case(37, 64, 576, 777, topk, device="cuda", topk_length=topk > 1)
        run_and_check(case, monkeypatch)


def test_fwd_all_invalid_and_duplicates(monkeypatch):
    case = make_case(50, 128, 576, 300, 128, device="cuda", invalid_frac=0.0, dup_frac=0.0, empty_rows=0)
    case.indices[0] = -1  # an all-invalid row
    case.indices[1] = 5  # one row repeated 128 times: counts once per slot
    case.indices[2, 0, ::2] = 10_000  # half out of range
    run_and_check(case, monkeypatch)


def test_fwd_unit_scale_values(monkeypatch):
    # randn(1) values: logits ~N(0,1); the absolute tolerance scales with |v| (x10)
    case = make_case(64, 128, 576, 4000, 512, device="cuda", scale=1.0)
    run_and_check(case, monkeypatch, abs_tol=8e-3)


def test_fwd_large_logits(monkeypatch):
    # logits of std ~48 (max ~150) exercise the running-max rescaling across blocks; lse/max_logits
    # errors are bounded relative to that logit scale (1e-5 * 150)
    case = make_case(64, 128, 576, 4000, 512, device="cuda", scale=1.0, kv_scale=2.0, sm_scale=1.0)
    run_and_check(case, monkeypatch, abs_tol=1.6e-2, logit_scale=150.0)


def test_fwd_many_heads(monkeypatch):
    case = make_case(20, 256, 576, 1000, 256, device="cuda")  # 4 head blocks
    run_and_check(case, monkeypatch)


def test_fwd_huge_kv_64bit_offsets(monkeypatch):
    # s_kv * d_qk * 2 bytes > 2^31: rows past the 2 GiB mark need 64-bit offsets.
    s_kv = (2**31) // (576 * 2) + 5000
    kv = torch.randn(s_kv, 1, 576, dtype=torch.bfloat16, device="cuda")
    case = make_case(16, 64, 576, s_kv, 256, device="cuda", kv=kv)
    case.indices[:, :, :128] = torch.randint(s_kv - 4000, s_kv, (16, 1, 128), device="cuda", dtype=torch.int32)
    run_and_check(case, monkeypatch)
    del kv


def test_fwd_dispatch_auto_uses_kernel():
    assert mk.backend_for("cuda") == "sm90"


def test_fwd_no_recompile_across_sizes(monkeypatch):
    from mla_kernels import _compile

    run_and_check(make_case(5, 64, 576, 300, 128, device="cuda"), monkeypatch)
    n = _compile.cache_info()["entries"]
    run_and_check(make_case(77, 64, 576, 3000, 384, device="cuda"), monkeypatch)
    assert _compile.cache_info()["entries"] == n


def test_fwd_more_than_65535_queries(monkeypatch):
    # s_q lives on grid.x (no 65535 cap): rows past 65535 must be computed like the others.
    s_q = 70_000
    case = make_case(s_q, 64, 512, 500, 64, device="cuda", invalid_frac=0.1, empty_rows=3)
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    out, ml, lse = mk.sparse_mla_fwd(case.q, case.kv, case.indices, case.sm_scale, 512)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    for r0 in (0, 65_500, s_q - 100):
        sl = slice(r0, r0 + 100)
        want = ref.sparse_mla_fwd_ref(case.q[sl].float(), case.kv.float(), case.indices[sl], case.sm_scale, 512)
        valid = ref.valid_mask(case.indices[sl], 500)
        empty = (~valid.any(dim=-1))[:, None].expand(-1, 64)
        assert_close_fwd(out[sl], ml[sl], lse[sl], want, empty=empty)


@pytest.mark.parametrize("h_q,d_qk,topk,tl,sink", [
    (128, 576, 640, False, None),  # 5 block pairs: the alternating loop ends in an even body
    (64, 576, 512, True, "finite"),  # 4 pairs, rows of 0..512 slots
    (128, 512, 192, True, "finite"),  # d_qk 512 (WG0's P outside the RoPE tile), 2 pairs, the last half empty
])
def test_fwd_rings_are_bitwise_equal(h_q, d_qk, topk, tl, sink, monkeypatch):
    """MLA_KERNELS_FWD_RING=alt (the right halves of the two KV buffers trade owners every block
    pair) gives bit for bit the fixed ring's out, max_logits and lse, and both match the reference
    (invalid and duplicate slots, empty rows; outputs compared after a poisoned first call)."""
    case = make_case(213, h_q, d_qk, 1840, topk, device="cuda", invalid_frac=0.1, empty_rows=2, topk_length=tl,
                     sink=sink)
    res = {}
    for ring in ("alt", "fixed"):
        monkeypatch.setenv("MLA_KERNELS_FWD_RING", ring)
        run_and_check(case, monkeypatch)
        res[ring] = mk.sparse_mla_fwd(case.q, case.kv, case.indices, case.sm_scale, case.d_v, case.topk_length,
                                      case.attn_sink)
    for a, b in zip(res["fixed"], res["alt"]):
        assert torch.equal(a, b)
    monkeypatch.setenv("MLA_KERNELS_FWD_RING", "bogus")
    with pytest.raises(ValueError, match="MLA_KERNELS_FWD_RING"):
        mk.sparse_mla_fwd(case.q, case.kv, case.indices, case.sm_scale, case.d_v)
