"""The reference oracle against a naive per-row loop in float64, and its written-out backward
against autograd (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from mla_kernels import reference as ref

from conftest import make_case


def naive_fwd(q, kv, idx, scale, d_v, tl=None, sink=None):
    """Per-row loop over the valid slots; differentiable (used for autograd checks)."""
    s_q, h, d = q.shape
    kv2 = kv.reshape(-1, d)
    idx2 = idx.reshape(s_q, -1)
    s_kv, topk = kv2.shape[0], idx2.shape[1]
    outs, lses, mls = [], [], []
    for i in range(s_q):
        slots = [j for j in range(topk) if 0 <= int(idx2[i, j]) < s_kv and (tl is None or j < int(tl[i]))]
        if not slots:
            outs.append(torch.zeros(h, d_v, dtype=q.dtype) + 0 * q[i, :, :d_v])  # keep the graph
            lses.append(torch.full((h,), math.inf, dtype=q.dtype))
            mls.append(torch.full((h,), -math.inf, dtype=q.dtype))
            continue
        k = kv2[torch.tensor([int(idx2[i, j]) for j in slots])]
        s = (q[i] @ k.T) * scale
        lse = torch.logsumexp(s, dim=-1)
        o = torch.softmax(s, dim=-1) @ k[:, :d_v]
        if sink is not None:
            o = o * torch.sigmoid(lse - sink)[:, None]
        outs.append(o)
        lses.append(lse)
        mls.append(s.max(dim=-1).values)
    return torch.stack(outs), torch.stack(mls), torch.stack(lses)


def naive_attn_dist(q, kv, idx, lse, scale, tl=None, normalize=False):
    s_q, h, d = q.shape
    kv2 = kv.reshape(-1, d).double()
    idx2 = idx.reshape(s_q, -1)
    res = torch.zeros(s_q, idx2.shape[1], dtype=torch.float64)
    for i in range(s_q):
        for j in range(idx2.shape[1]):
            t = int(idx2[i, j])
            if 0 <= t < kv2.shape[0] and (tl is None or j < int(tl[i])):
                res[i, j] = torch.exp(q[i].double() @ kv2[t] * scale - lse[i].double()).sum()
    if normalize:
        tot = res.sum(-1, keepdim=True)
        res = torch.where(tot > 0, res / tot.clamp_min(1e-300), res)
    return res


CASES = [
    dict(s_q=7, h_q=3, d_qk=16, s_kv=20, topk=9, d_v=8),
    dict(s_q=5, h_q=4, d_qk=24, s_kv=6, topk=12, d_v=24),  # many duplicates, d_v == d_qk
    dict(s_q=9, h_q=2, d_qk=8, s_kv=40, topk=1, d_v=4),
]


@pytest.mark.parametrize("c", CASES)
@pytest.mark.parametrize("tl", [False, True])
@pytest.mark.parametrize("sink", [None, "finite", "neginf"])
def test_fwd_matches_naive(c, tl, sink):
    case = make_case(c["s_q"], c["h_q"], c["d_qk"], c["s_kv"], c["topk"], d_v=c["d_v"], dtype=torch.float64,
                     invalid_frac=0.3, dup_frac=0.3, empty_rows=1, topk_length=tl, sink=sink, scale=1.0)
    sk = case.attn_sink.double() if case.attn_sink is not None else None
    out, ml, lse = ref.sparse_mla_fwd_ref(case.q, case.kv, case.indices, case.sm_scale, c["d_v"], case.topk_length, sk)
    n_out, n_ml, n_lse = naive_fwd(case.q, case.kv, case.indices, case.sm_scale, c["d_v"], case.topk_length, sk)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(out, n_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, n_lse, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ml, n_ml, rtol=1e-10, atol=1e-12)
    empty = ~ref.valid_mask(case.indices, c["s_kv"], case.topk_length).any(-1)
    assert empty.any()
    assert (out[empty] == 0).all() and torch.isposinf(lse[empty]).all() and torch.isneginf(ml[empty]).all()


def test_fwd_bf16_returns_bf16_and_float32_stats():
    case = make_case(4, 2, 16, 30, 8, d_v=8)
    out, ml, lse = ref.sparse_mla_fwd_ref(case.q, case.kv, case.indices, case.sm_scale, 8)
    assert out.dtype == torch.bfloat16 and ml.dtype == torch.float32 and lse.dtype == torch.float32


def test_fwd_chunking_is_invisible(monkeypatch):
    case = make_case(33, 4, 16, 50, 10, d_v=8, dtype=torch.float64, topk_length=True, sink="finite")
    sk = case.attn_sink.double()
    want = ref.sparse_mla_fwd_ref(case.q, case.kv, case.indices, case.sm_scale, 8, case.topk_length, sk)
    monkeypatch.setattr(ref, "_CHUNK_BYTES", 1)  # one row per chunk
    got = ref.sparse_mla_fwd_ref(case.q, case.kv, case.indices, case.sm_scale, 8, case.topk_length, sk)
    for a, b in zip(got, want):  # BLAS may sum in another order for other batch sizes
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_fwd_no_kv_rows():
    q = torch.randn(3, 2, 8, dtype=torch.float64)
    kv = torch.zeros(0, 8, dtype=torch.float64)
    idx = torch.zeros(3, 4, dtype=torch.int32)
    out, ml, lse = ref.sparse_mla_fwd_ref(q, kv, idx, 0.5, 8)
    assert (out == 0).all() and torch.isposinf(lse).all() and torch.isneginf(ml).all()


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("tl", [False, True])
def test_attn_dist_matches_naive(normalize, tl):
    case = make_case(6, 3, 16, 25, 10, dtype=torch.float64, invalid_frac=0.3, dup_frac=0.3,
                     empty_rows=1, topk_length=tl, scale=1.0)
    _, _, lse = ref.sparse_mla_fwd_ref(case.q, case.kv, case.indices, case.sm_scale, 16, case.topk_length)
    got = ref.attn_dist_ref(case.q, case.kv, case.indices, lse, case.sm_scale, case.topk_length, normalize)
    want = naive_attn_dist(case.q, case.kv, case.indices, lse, case.sm_scale, case.topk_length, normalize)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert not torch.isnan(got).any()
    if normalize:
        tot = got.sum(-1)
        nonempty = tot > 0
        torch.testing.assert_close(tot[nonempty], torch.ones_like(tot[nonempty]))


def test_attn_dist_rows_sum_to_heads():
    # without normalisation each non-empty row sums to h_q (softmax rows sum to 1 per head)
    case = make_case(5, 4, 16, 30, 12, dtype=torch.float64, empty_rows=0, invalid_frac=0.2)
    _, _, lse = ref.sparse_mla_fwd_ref(case.q, case.kv, case.indices, case.sm_scale, 16)
    got = ref.attn_dist_ref(case.q, case.kv, case.indices, lse, case.sm_scale)
    torch.testing.assert_close(got.sum(-1), torch.full((5,), 4.0, dtype=torch.float64))


@pytest.mark.parametrize("tl", [False, True])
@pytest.mark.parametrize("sink", [None, "finite", "neginf"])
@pytest.mark.parametrize("with_dlse", [False, True])
def test_written_out_bwd_matches_autograd(tl, sink, with_dlse):
    case = make_case(6, 3, 16, 12, 10, d_v=8, dtype=torch.float64, invalid_frac=0.3, dup_frac=0.4,
                     empty_rows=1, topk_length=tl, sink=sink, scale=1.0)
    q = case.q.clone().requires_grad_()
    kv = case.kv.clone().requires_grad_()
    sk = case.attn_sink.double().clone().requires_grad_() if case.attn_sink is not None else None
    out, _, lse = naive_fwd(q, kv, case.indices, case.sm_scale, 8, case.topk_length, sk)
    dout = torch.randn_like(out)
    loss = (out * dout).sum()
    dlse = None
    if with_dlse:
        dlse = torch.randn_like(lse)
        fin = torch.isfinite(lse)
        loss = loss + (torch.where(fin, lse, torch.zeros_like(lse)) * dlse).sum()
        dlse = torch.where(fin, dlse, torch.zeros_like(dlse))
    loss.backward()
    dq, dkv, dsink, attn_sum = ref.sparse_mla_bwd_ref(
        case.q, case.kv, out.detach(), dout, case.indices, lse.detach(), case.sm_scale, 8,
        case.topk_length, case.attn_sink.double() if sk is not None else None, dlse=dlse, return_attn_sum=True,
    )
    torch.testing.assert_close(dq, q.grad, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(dkv, kv.grad, rtol=1e-9, atol=1e-11)
    assert dkv.shape == case.kv.shape
    if sk is not None:
        torch.testing.assert_close(dsink, sk.grad, rtol=1e-9, atol=1e-11)
    else:
        assert dsink is None
    want_sum = ref.attn_dist_ref(case.q, case.kv, case.indices, lse.detach(), case.sm_scale, case.topk_length)
    torch.testing.assert_close(attn_sum, want_sum, rtol=1e-10, atol=1e-12)


def test_bwd_empty_rows_have_zero_grads():
    case = make_case(4, 2, 8, 10, 6, d_v=8, dtype=torch.float64, invalid_frac=0.0, empty_rows=0)
    case.indices[1] = -1
    out, _, lse = ref.sparse_mla_fwd_ref(case.q, case.kv, case.indices, case.sm_scale, 8)
    dout = torch.randn_like(out)
    dq, dkv, _ = ref.sparse_mla_bwd_ref(case.q, case.kv, out, dout, case.indices, lse, case.sm_scale, 8)
    assert (dq[1] == 0).all() and not torch.isnan(dq).any() and not torch.isnan(dkv).any()


def test_deterministic_scatter_matches_and_repeats():
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 7, (500,), generator=g)  # heavy collisions
    vals = torch.randn(500, 5, dtype=torch.float64, generator=g)
    plain = torch.zeros(7, 5, dtype=torch.float64)
    ref.scatter_add_rows(plain, rows, vals, deterministic=False)
    outs = []
    for _ in range(3):
        d = torch.zeros(7, 5, dtype=torch.float64)
        ref.scatter_add_rows(d, rows, vals, deterministic=True)
        outs.append(d)
    torch.testing.assert_close(outs[0], plain, rtol=1e-12, atol=1e-12)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    empty = torch.zeros(7, 5, dtype=torch.float64)
    ref.scatter_add_rows(empty, rows[:0], vals[:0], deterministic=True)
    assert (empty == 0).all()


def test_bwd_deterministic_equals_plain():
    case = make_case(8, 3, 16, 6, 12, d_v=8, dtype=torch.float64, dup_frac=0.5, scale=1.0)
    out, _, lse = ref.sparse_mla_fwd_ref(case.q, case.kv, case.indices, case.sm_scale, 8)
    dout = torch.randn_like(out)
    a = ref.sparse_mla_bwd_ref(case.q, case.kv, out, dout, case.indices, lse, case.sm_scale, 8)
    b = ref.sparse_mla_bwd_ref(case.q, case.kv, out, dout, case.indices, lse, case.sm_scale, 8, deterministic=True)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    torch.testing.assert_close(a[1], b[1], rtol=1e-12, atol=1e-13)
