"""The per-row kv-band order of the backward's slots (common/index_order.py,
common/order_host.kv_ordered): compile on the CPU, exact results on an sm_90 GPU, and the backward's
results with and without it."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close_fwd, make_case, needs_cutlass, rel_l2, skip_unless_sm90


def expected_order(idx: torch.Tensor, s_kv: int, topk_length=None):
    """(ordered indices, the slots they came from): stable by band ``min(idx >> shift, 62)``,
    invalid entries last as -1."""
    from mla_kernels.common.order_host import band_shift

    s_q, topk = idx.shape
    slot = torch.arange(topk, device=idx.device).expand(s_q, topk)
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid &= slot < topk_length.clamp(min=0)[:, None]
    band = torch.where(valid, (idx.long() >> band_shift(s_kv)).clamp(max=62),
                       torch.full_like(idx, 63, dtype=torch.long))
    key = (band * 65536 + slot).sort(dim=1).values
    perm = key % 65536
    out = torch.where(valid.gather(1, perm), idx.gather(1, perm), -1)
    return out.to(torch.int32), perm.to(torch.int32)


def test_index_order_compiles_for_sm90():
    needs_cutlass()
    from mla_kernels.common.index_order import MAX_STAGE, band_shift, compile_index_order, stage_for
    from mla_kernels.common import order_host

    for s_kv in (1, 63, 64, 65, 1000, 32768, 2**31 - 1):
        assert order_host.band_shift(s_kv) == band_shift(s_kv)
        assert (s_kv - 1) >> band_shift(s_kv) < 64
    kernel, _ = compile_index_order(True, True, "sm_90a")  # direct stores (rows past MAX_STAGE)
    assert kernel.smem_bytes == 8 * 64 * 4 + 2 * 16
    kernel, _ = compile_index_order(True, True, "sm_90a", stage=2048)  # the row staged in smem
    assert kernel.smem_bytes == 8 * 64 * 4 + 2 * 2048 * 4
    for topk in (1, 2, 3, 64, 100, 2048, 2049, 8192, 8193, 100_000):
        assert order_host.stage_for(topk) == stage_for(topk)
        assert stage_for(topk) == 0 or topk <= stage_for(topk) <= MAX_STAGE
    assert stage_for(8193) == 0 and stage_for(100) == 128
    with pytest.raises(ValueError, match="power of two"):
        compile_index_order(False, False, "sm_90a", stage=3000)


def test_index_order_run_sizes():
    """Staged rows of up to ONE_RUN slots take one run per lane of just the slots a lane has (the
    kernel is issue-bound: no iterations over absent slots), so pass 2 can reuse pass 1's
    registers; longer and unstaged rows load RUN slots per lane at a time."""
    needs_cutlass()
    from mla_kernels.common.index_order import ONE_RUN, RUN, THREADS, KvBandOrder

    assert ONE_RUN == THREADS * RUN == 2048
    for stage, run in ((1, 1), (64, 1), (256, 1), (512, 2), (1024, 4), (2048, 8), (4096, 8), (8192, 8), (0, 8)):
        k = KvBandOrder(True, True, stage)
        assert k.run == run
        if 0 < stage <= ONE_RUN:  # every row of the kernel: one run per lane covers the warp's share
            per_warp = -(-stage // THREADS) * 32
            assert per_warp <= 32 * k.run


def test_expected_order_on_cpu():
    idx = torch.tensor([[5, -1, 3, 3, 9, 0], [7, 6, 5, 4, 3, 2]], dtype=torch.int32)
    out, perm = expected_order(idx, 9, torch.tensor([6, 3]))  # s_kv 9: one row per band
    assert out.tolist() == [[0, 3, 3, 5, -1, -1], [5, 6, 7, -1, -1, -1]]
    assert perm.tolist() == [[5, 2, 3, 0, 1, 4], [2, 1, 0, 3, 4, 5]]
    out, perm = expected_order(torch.tensor([[300, 5, 299, 7, 1000]], dtype=torch.int32), 1000)
    assert out.tolist() == [[5, 7, 300, 299, -1]]  # bands of 16 rows; slot order within a band
    assert perm.tolist() == [[1, 3, 0, 2, 4]]


@skip_unless_sm90()
@pytest.mark.gpu
@pytest.mark.parametrize("topk", [1, 64, 100, 576, 2048, 5000, 8192, 9000])  # 9000: unstaged
@pytest.mark.parametrize("with_tl", [False, True])
@pytest.mark.parametrize("s_kv", [40, 3000, 100_000])
def test_index_order_exact(topk, with_tl, s_kv):
    from mla_kernels.common import order_host
    from mla_kernels.common.problem import Problem

    torch.manual_seed(topk + with_tl + s_kv)
    s_q = 37
    idx = torch.randint(-200, s_kv + 200, (s_q, topk), dtype=torch.int32, device="cuda")
    idx[0] = -1
    idx[1] = 7  # all duplicates
    tl = None
    if with_tl:
        tl = torch.randint(0, topk + 1, (s_q,), dtype=torch.int32, device="cuda")
        tl[2] = 0
        tl[3] = topk
        tl[4] = -5  # kernels get lengths clamped to [0, topk]; the order must not break on others
    q = torch.empty(s_q, 64, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.empty(s_kv, 576, device="cuda", dtype=torch.bfloat16)
    p = Problem(q, kv, idx, 1.0, 512, tl, None, kv.shape)
    p2, perm = order_host.kv_ordered(p, True)
    ref, ref_perm = expected_order(idx, s_kv, tl)
    assert torch.equal(p2.indices, ref)
    assert torch.equal(perm, ref_perm)
    p3, none = order_host.kv_ordered(p, False)
    assert none is None and torch.equal(p3.indices, ref)


@skip_unless_sm90()
@pytest.mark.gpu
@pytest.mark.parametrize("h_q", [64, 128])
def test_bwd_same_with_and_without_sort(h_q, monkeypatch):
    """The backward on kv-ordered slots gives the unsorted run's gradients (to float rounding:
    the order of additions differs) and attn_sum in the caller's slot order."""
    import mla_kernels as mk
    from mla_kernels.common import order_host

    case = make_case(150, h_q, 576, 900, 256, device="cuda", invalid_frac=0.1, dup_frac=0.1, topk_length=True)
    out, _, lse = mk.sparse_mla_fwd(case.q, case.kv, case.indices, case.sm_scale, topk_length=case.topk_length)
    dout = torch.randn_like(out)
    res = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(order_host.SORT_ENV, flag)
        res[flag] = mk.sparse_mla_bwd(case.q, case.kv, out, dout, case.indices, lse, case.sm_scale,
                                      topk_length=case.topk_length, return_attn_sum=True)
    (dq1, dkv1, _, a1), (dq0, dkv0, _, a0) = res["1"], res["0"]
    assert rel_l2(dq1, dq0) < 5e-3 and rel_l2(dkv1, dkv0) < 5e-3
    assert torch.allclose(a1, a0, rtol=1e-5, atol=1e-6)
    assert not any(t.isnan().any() for t in (dq1, dkv1, a1))


@skip_unless_sm90()
@pytest.mark.gpu
@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("sink", [None, "finite"])
def test_fwd_same_with_and_without_order(h_q, sink, monkeypatch):
    """The forward on kv-ordered slots (``MLA_KERNELS_FWD_ORDER=1``, and the auto rule made to
    choose it by a tiny L2 size) meets the forward tolerances against the float32 reference and
    matches the forward on the given order, with invalid / duplicate slots, topk_length (incl.
    empty rows) and a sink."""
    import mla_kernels as mk
    from mla_kernels import reference as ref
    from mla_kernels.common import order_host

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    case = make_case(200, h_q, 576, 3000, 512, device="cuda", invalid_frac=0.1, dup_frac=0.1, topk_length=True,
                     sink=sink)
    args = (case.q, case.kv, case.indices, case.sm_scale, 512, case.topk_length, case.attn_sink)
    p = mk.api.make_problem(*args)
    dev = torch.cuda.current_device()
    monkeypatch.setitem(order_host._L2_BYTES, dev, 1 << 40)
    monkeypatch.setenv(order_host.FWD_ORDER_ENV, "auto")
    assert not order_host.fwd_order_wanted(p)
    monkeypatch.setitem(order_host._L2_BYTES, dev, 1024)  # kv rows >> "L2": ordered at h_q 64 only
    assert order_host.fwd_order_wanted(p) == (h_q == 64)
    res = {}
    for flag in ("0", "1", "auto"):
        monkeypatch.setenv(order_host.FWD_ORDER_ENV, flag)
        res[flag] = mk.sparse_mla_fwd(*args)
    want = ref.sparse_mla_fwd_ref(case.q.float(), case.kv.float(), case.indices, case.sm_scale, 512,
                                  case.topk_length, case.attn_sink)
    valid = ref.valid_mask(case.indices, 3000, case.topk_length)
    empty = (~valid.any(dim=-1))[:, None].expand(-1, h_q)
    assert empty.any() and not empty.all()
    for flag in ("1", "auto"):
        out, ml, lse = res[flag]
        assert_close_fwd(out, ml, lse, want, empty=empty)
        assert rel_l2(out, res["0"][0]) < 5e-3


@skip_unless_sm90()
@pytest.mark.gpu
@pytest.mark.parametrize("h_q,d_qk,topk", [(128, 576, 640), (64, 576, 704), (128, 512, 704)])
def test_fwd_rotated_pair_order(h_q, d_qk, topk, monkeypatch):
    """The forward with the rotated pair order (``rotate_shift``; a 2 ns tick here, so that the CTAs
    start at scattered pairs) meets the forward tolerances against the float32 reference and
    matches the fixed order, with an odd number of blocks (a half-empty pair that is no longer the
    last one), topk_length (rows of 0..topk slots), invalid / duplicate slots and a sink; the
    default path on kv-ordered slots takes the rotated kernel."""
    import mla_kernels as mk
    from mla_kernels import reference as ref
    from mla_kernels.common import order_host
    from mla_kernels.sm90 import BACKEND

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    s_kv = 5000
    case = make_case(300, h_q, d_qk, s_kv, topk, device="cuda", invalid_frac=0.1, dup_frac=0.1, topk_length=True,
                     sink="finite")
    args = (case.q, case.kv, case.indices, case.sm_scale, 512, case.topk_length, case.attn_sink)
    p = mk.api.make_problem(*args)
    fixed = BACKEND._fwd_launch(p)(p.q, p.kv, p.indices, p.topk_length, p.attn_sink)
    rot = BACKEND._fwd_launch(p, 1)(p.q, p.kv, p.indices, p.topk_length, p.attn_sink)
    want = ref.sparse_mla_fwd_ref(case.q.float(), case.kv.float(), case.indices, case.sm_scale, 512,
                                  case.topk_length, case.attn_sink)
    valid = ref.valid_mask(case.indices, s_kv, case.topk_length)
    empty = (~valid.any(dim=-1))[:, None].expand(-1, h_q)
    assert empty.any() and not empty.all()
    for out, ml, lse in (fixed, rot):
        assert_close_fwd(out, ml, lse, want, empty=empty)
    assert rel_l2(rot[0], fixed[0]) < 5e-3
    assert torch.equal(rot[1], fixed[1])  # the row max does not depend on the order
    torch.testing.assert_close(rot[2], fixed[2], rtol=1e-5, atol=1e-5)
    # the default path: kv-ordered slots with the backend's tick
    monkeypatch.setenv(order_host.FWD_ORDER_ENV, "1")
    for flag in ("0", "1"):
        monkeypatch.setenv(order_host.FWD_ROTATE_ENV, flag)
        assert order_host.fwd_rotate_shift_for(BACKEND.fwd_rotate_shift) == (BACKEND.fwd_rotate_shift if flag == "1"
                                                                              else 0)
        out, ml, lse = mk.sparse_mla_fwd(*args)
        assert_close_fwd(out, ml, lse, want, empty=empty)


@skip_unless_sm90()
@pytest.mark.gpu
@pytest.mark.parametrize("h_q", [64, 128, 192])
@pytest.mark.parametrize("normalize", [False, True])
def test_attn_dist_same_with_and_without_order(h_q, normalize, monkeypatch):
    """``attn_dist`` on kv-ordered slots (``MLA_KERNELS_ATTN_DIST_ORDER=1``) comes back in the
    caller's slot order: each slot's value does not depend on where its block sits, so without
    normalisation it is bitwise the given order's (with it, the row total's rounding differs);
    invalid / duplicate slots, topk_length with empty rows, tokens / heads / several head groups."""
    import mla_kernels as mk
    from mla_kernels import reference as ref
    from mla_kernels.common import order_host

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    s_kv = 3000
    case = make_case(150, h_q, 576, s_kv, 640, device="cuda", invalid_frac=0.1, dup_frac=0.1, topk_length=True)
    _, _, lse = mk.sparse_mla_fwd(case.q, case.kv, case.indices, case.sm_scale, 512, case.topk_length)
    args = (case.q, case.kv, case.indices, lse, case.sm_scale, case.topk_length, normalize)
    p = mk.api.make_problem(case.q, case.kv, case.indices, case.sm_scale, 512, case.topk_length)
    res = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(order_host.ATTN_DIST_ORDER_ENV, flag)
        assert order_host.attn_dist_order_wanted(p) == (flag == "1")
        res[flag] = mk.attn_dist(*args)
    want = ref.attn_dist_ref(case.q.float(), case.kv.float(), case.indices, lse, case.sm_scale, case.topk_length,
                             normalize)
    valid = ref.valid_mask(case.indices, s_kv, case.topk_length)
    assert (~valid.any(dim=-1)).any()
    got = res["1"]
    assert not torch.isnan(got).any() and (got[~valid] == 0).all()
    assert rel_l2(got, want) <= 1e-3, f"rel L2 {rel_l2(got, want):.3g}"
    if normalize:
        torch.testing.assert_close(got, res["0"], rtol=1e-5, atol=1e-7)
    else:
        assert torch.equal(got, res["0"])
