"""The indexer's reference (scores, exact top-k, KL loss and its written-out backward) against
naive per-element loops in float64, and the public ops on the CPU (gradcheck in float64)."""

from __future__ import annotations

import math

import pytest
import torch

import mla_kernels as mk
from mla_kernels import reference as ref


def relu(x: float) -> float:
    return x if (x > 0 or math.isnan(x)) else 0.0  # NaN propagates, as torch's clamp_min does


def naive_scores(q, k, w, scale, start, end, q_scale=None, k_scale=None):
    s_q, h, d = q.shape
    k = k.reshape(-1, d).double()
    q = q.double()
    if q_scale is not None:
        q = q * q_scale.double()[..., None]
        k = k * k_scale.double().reshape(-1, 1)
    out = torch.full((s_q, k.shape[0]), -math.inf, dtype=torch.float64)
    for t in range(s_q):
        for s in range(max(0, int(start[t])), min(k.shape[0], int(end[t]))):
            out[t, s] = scale * sum(float(w[t, j]) * relu(float(q[t, j] @ k[s])) for j in range(h))
    return out


def naive_topk(scores, topk, start, end):
    """Per row: in-range keys sorted by (-score, index) -- NaN as -inf --, first topk, ascending."""
    s_q, s_kv = scores.shape
    idx = torch.full((s_q, topk), -1, dtype=torch.int32)
    ln = torch.zeros(s_q, dtype=torch.int32)
    for t in range(s_q):
        keys = list(range(max(0, int(start[t])), min(s_kv, int(end[t]))))
        val = {s: (-math.inf if math.isnan(float(scores[t, s])) else float(scores[t, s])) for s in keys}
        keys.sort(key=lambda s: (-val[s], s))
        chosen = sorted(keys[:topk])
        idx[t, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
        ln[t] = len(chosen)
    return idx, ln


def causal(s_q, s_kv):
    t = torch.arange(s_q)
    return torch.zeros(s_q, dtype=torch.long), (s_kv - s_q + t + 1).clamp(0, s_kv)


def int_inputs(s_q, h, d, s_kv, seed=0, lo=-2, hi=3):
    """Integer-valued inputs: exact scores in every dtype, many exact ties."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(lo, hi, (s_q, h, d), generator=g).float()
    k = torch.randint(lo, hi, (s_kv, d), generator=g).float()
    w = torch.randint(-1, 3, (s_q, h), generator=g).float()
    return q, k, w


@pytest.mark.parametrize("ranges", ["causal", "explicit"])
def test_logits_vs_naive(ranges):
    g = torch.Generator().manual_seed(1)
    s_q, h, d, s_kv = 7, 3, 5, 11
    q = torch.randn(s_q, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(s_kv, 1, d, generator=g, dtype=torch.float64)
    w = torch.randn(s_q, h, generator=g, dtype=torch.float64)
    if ranges == "causal":
        ks = ke = None
        start, end = causal(s_q, s_kv)
    else:
        ks = torch.tensor([0, 3, 5, 11, 2, -4, 6], dtype=torch.int32)
        ke = torch.tensor([11, 9, 5, 20, 3, 4, 1], dtype=torch.int64)  # empty rows 2, 6; clamps
        start, end = ks.clamp(0, s_kv), ke.clamp(0, s_kv)
    got = mk.indexer_logits(q, k, w, sm_scale=0.7, k_start=ks, k_end=ke)
    want = naive_scores(q, k, w, 0.7, start, end)
    assert got.dtype == torch.float64 and got.shape == (s_q, s_kv)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("topk", [1, 4, 9, 30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_topk_exact_ties(topk, dtype):
    s_q, h, d, s_kv = 12, 4, 6, 25
    q, k, w = int_inputs(s_q, h, d, s_kv, seed=topk)
    ks = torch.tensor([0, 0, 3, 7, 25, 0, 1, 2, 10, 0, 0, 4], dtype=torch.int32)
    ke = torch.tensor([25, 1, 20, 7, 25, 14, 25, 3, 24, 13, 25, 18], dtype=torch.int32)
    idx, ln, lg = mk.indexer_topk(q.to(dtype), k.to(dtype), w, topk, sm_scale=0.5, k_start=ks, k_end=ke,
                                  return_logits=True)
    scores = naive_scores(q, k, w, 0.5, ks, ke)
    want_idx, want_len = naive_topk(scores, topk, ks, ke)
    assert idx.dtype == torch.int32 and ln.dtype == torch.int32 and idx.shape == (s_q, topk)
    assert torch.equal(idx, want_idx)
    assert torch.equal(ln, want_len)
    assert ln[3] == 0 and ln[4] == 0 and (idx[3] == -1).all()  # empty ranges
    safe = want_idx.clamp_min(0).long()
    want_lg = torch.where(want_idx >= 0, scores.gather(1, safe), torch.full(safe.shape, -math.inf, dtype=torch.float64))
    assert torch.equal(lg.double(), want_lg)


def test_topk_causal_default_and_short_rows():
    s_q, h, d, s_kv = 9, 2, 4, 6  # s_q > s_kv: the first rows have empty ranges
    q, k, w = int_inputs(s_q, h, d, s_kv, seed=3)
    idx, ln = mk.indexer_topk(q, k, w, 4)
    start, end = causal(s_q, s_kv)
    want_idx, want_len = naive_topk(naive_scores(q, k, w, 1.0, start, end), 4, start, end)
    assert torch.equal(idx, want_idx) and torch.equal(ln, want_len)
    assert ln.tolist() == [0, 0, 0, 1, 2, 3, 4, 4, 4]
    # a row with fewer keys than topk takes them all, in ascending order
    assert idx[4].tolist() == [0, 1, -1, -1]


def test_topk_nan_ranks_last():
    s_q, h, d, s_kv = 3, 2, 4, 8
    q, k, w = int_inputs(s_q, h, d, s_kv, seed=5)
    k[2] = float("nan")
    k[5] = float("nan")
    ks = torch.zeros(s_q, dtype=torch.int32)
    ke = torch.full((s_q,), s_kv, dtype=torch.int32)
    idx, ln = mk.indexer_topk(q, k, w, 7, k_start=ks, k_end=ke)
    want_idx, want_len = naive_topk(naive_scores(q, k, w, 1.0, ks, ke), 7, ks, ke)
    assert torch.equal(idx, want_idx) and torch.equal(ln, want_len)
    # 7 of 8 keys: exactly one NaN key is dropped, the larger index (ties -> smaller index wins)
    assert all(5 not in row for row in idx.tolist()) and all(2 in row for row in idx.tolist())


def test_topk_chunked_equals_whole(monkeypatch):
    s_q, h, d, s_kv = 40, 3, 8, 64
    g = torch.Generator().manual_seed(7)
    q = torch.randn(s_q, h, d, generator=g)
    k = torch.randn(s_kv, d, generator=g)
    w = torch.randn(s_q, h, generator=g)
    whole = mk.indexer_topk(q, k, w, 10, return_logits=True)
    monkeypatch.setattr(ref, "_CHUNK_BYTES", 4096)  # one row per chunk
    assert ref._indexer_chunk(s_q, h, s_kv, 4) == 1
    chunked = mk.indexer_topk(q, k, w, 10, return_logits=True)
    # the same slots; the logits to float32 rounding (BLAS may sum in another order for another
    # GEMM size: seen on an AMD EPYC CI host, where the whole and the one-row GEMMs differ in the
    # last bit)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    torch.testing.assert_close(chunked[2], whole[2], rtol=1e-6, atol=1e-6)


def test_fp8_through_dequantisation():
    g = torch.Generator().manual_seed(11)
    s_q, h, d, s_kv = 10, 4, 16, 30
    q8 = (torch.randn(s_q, h, d, generator=g) * 2).to(torch.float8_e4m3fn)
    k8 = (torch.randn(s_kv, d, generator=g) * 2).to(torch.float8_e4m3fn)
    qs = torch.rand(s_q, h, generator=g) + 0.1
    ksc = torch.rand(s_kv, generator=g) + 0.1
    w = torch.randn(s_q, h, generator=g)
    got = mk.indexer_logits(q8, k8, w, sm_scale=0.3, q_scale=qs, k_scale=ksc)
    deq_q, deq_k = q8.float() * qs[..., None], k8.float() * ksc[:, None]
    want = mk.indexer_logits(deq_q, deq_k, w, sm_scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    idx, ln = mk.indexer_topk(q8, k8, w, 5, sm_scale=0.3, q_scale=qs, k_scale=ksc.reshape(s_kv, 1))
    start, end = causal(s_q, s_kv)
    want_idx, want_len = naive_topk(naive_scores(q8.float(), k8.float(), w, 0.3, start, end, qs, ksc), 5, start, end)
    assert torch.equal(idx, want_idx) and torch.equal(ln, want_len)


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------


def naive_loss_rows(q, k, w, idx, tgt, scale, tl=None):
    s_q, h, d = q.shape
    k = k.reshape(-1, d).double()
    rows = torch.zeros(s_q, dtype=torch.float64)
    for t in range(s_q):
        slots = [j for j in range(idx.shape[1]) if 0 <= int(idx[t, j]) < k.shape[0]
                 and (tl is None or j < int(tl[t]))]
        if not slots:
            continue
        tsum = sum(float(tgt[t, j]) for j in slots)
        if tsum <= 0:
            continue
        logits = [scale * sum(float(w[t, hh]) * max(0.0, float(q[t, hh].double() @ k[int(idx[t, j])]))
                              for hh in range(h)) for j in slots]
        lse = math.log(sum(math.exp(x) for x in logits))
        for j, x in zip(slots, logits):
            p = float(tgt[t, j]) / tsum
            if p > 0:
                rows[t] += p * (math.log(p) - (x - lse))
    return rows


def loss_case(s_q=9, h=3, d=5, s_kv=13, topk=6, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(s_kv, 1, d, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(s_q, h, generator=g, dtype=torch.float64).to(dtype)
    idx = torch.randint(0, s_kv, (s_q, topk), generator=g)
    idx[0, 1] = idx[0, 0]  # duplicate
    idx[1, 2] = -1
    idx[2, 3] = s_kv + 4  # out of range
    idx[3] = -1  # empty row
    tgt = torch.rand(s_q, topk, generator=g, dtype=torch.float64)
    tgt[4] = 0.0  # zero target sum
    tgt[5, 0] = 0.0  # a p = 0 slot
    tl = torch.randint(0, topk + 1, (s_q,), generator=g)
    tl[6] = 0
    tl[7] = topk + 5
    return q, k, w, idx, tgt, tl


@pytest.mark.parametrize("with_tl", [False, True])
def test_loss_rows_vs_naive(with_tl):
    q, k, w, idx, tgt, tl = loss_case()
    tl = tl if with_tl else None
    rows = mk.indexer_loss(q, k, w, idx, tgt, sm_scale=0.6, topk_length=tl, reduction="none")
    want = naive_loss_rows(q, k, w, idx, tgt, 0.6, tl)
    torch.testing.assert_close(rows, want, rtol=1e-10, atol=1e-12)
    assert rows[3] == 0 and rows[4] == 0
    assert (rows >= -1e-12).all()  # a KL divergence
    s = mk.indexer_loss(q, k, w, idx, tgt, sm_scale=0.6, topk_length=tl, reduction="sum")
    m = mk.indexer_loss(q, k, w, idx, tgt, sm_scale=0.6, topk_length=tl)
    torch.testing.assert_close(s, want.sum())
    torch.testing.assert_close(m, want.sum() / q.shape[0])


@pytest.mark.parametrize("with_tl", [False, True])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_loss_gradcheck_float64(with_tl, reduction):
    q, k, w, idx, tgt, tl = loss_case(seed=3)
    tl = tl if with_tl else None
    q.requires_grad_(True)
    k.requires_grad_(True)
    w.requires_grad_(True)

    def f(q, k, w):
        return mk.indexer_loss(q, k, w, idx, tgt, sm_scale=0.6, topk_length=tl, reduction=reduction)

    assert torch.autograd.gradcheck(f, (q, k, w), eps=1e-6, atol=1e-7)


def test_loss_backward_matches_autograd_reference():
    q, k, w, idx, tgt, tl = loss_case(s_q=17, h=4, d=8, s_kv=21, topk=10, seed=5)
    q.requires_grad_(True)
    k.requires_grad_(True)
    w.requires_grad_(True)
    g_rows = torch.randn(q.shape[0], dtype=torch.float64)
    a = (mk.indexer_loss(q, k, w, idx, tgt, sm_scale=0.3, topk_length=tl, reduction="none") * g_rows).sum()
    b = (ref.indexer_loss_ref(q, k, w, idx, tgt, 0.3, tl, reduction="none") * g_rows).sum()
    ga = torch.autograd.grad(a, (q, k, w))
    gb = torch.autograd.grad(b, (q, k, w))
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    # empty row and zero-target row get no gradient
    assert (ga[0][3] == 0).all() and (ga[0][4] == 0).all() and (ga[2][3] == 0).all()
    assert ga[1].shape == k.shape


def test_loss_float32_bfloat16_and_deterministic():
    q, k, w, idx, tgt, tl = loss_case(s_q=20, h=4, d=8, s_kv=30, topk=12, seed=9)
    want = ref.indexer_loss_ref(q, k, w, idx, tgt, 0.4, tl)
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        qq = q.to(dt).requires_grad_(True)
        kk = k.to(dt).requires_grad_(True)
        ww = w.to(torch.float32).requires_grad_(True)
        loss = mk.indexer_loss(qq, kk, ww, idx, tgt.float(), sm_scale=0.4, topk_length=tl, deterministic=True)
        assert loss.dtype == torch.float32
        loss.backward()
        assert qq.grad.dtype == dt and kk.grad.dtype == dt and ww.grad.dtype == torch.float32
        assert abs(loss.item() - want.item()) <= tol * max(1.0, abs(want.item()))
    # deterministic=True and False agree on the CPU (index_add_ is sequential there)
    outs = []
    for det in (False, True):
        qq, kk, ww = (x.clone().requires_grad_(True) for x in (q, k, w))
        mk.indexer_loss(qq, kk, ww, idx, tgt, sm_scale=0.4, topk_length=tl, deterministic=det).backward()
        outs.append((qq.grad, kk.grad, ww.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_loss_fp8_forward_only():
    g = torch.Generator().manual_seed(2)
    s_q, h, d, s_kv, topk = 6, 2, 8, 12, 4
    q8 = torch.randn(s_q, h, d, generator=g).to(torch.float8_e4m3fn)
    k8 = torch.randn(s_kv, d, generator=g).to(torch.float8_e4m3fn)
    qs, ksc = torch.rand(s_q, h, generator=g) + 0.5, torch.rand(s_kv, generator=g) + 0.5
    w = torch.randn(s_q, h, generator=g)
    idx = torch.randint(0, s_kv, (s_q, topk), generator=g)
    tgt = torch.rand(s_q, topk, generator=g)
    got = mk.indexer_loss(q8, k8, w, idx, tgt, q_scale=qs, k_scale=ksc, reduction="none")
    want = mk.indexer_loss(q8.float() * qs[..., None], k8.float() * ksc[:, None], w, idx, tgt, reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="forward-only"):
        mk.indexer_loss(q8, k8, w.requires_grad_(True), idx, tgt, q_scale=qs, k_scale=ksc)
    with torch.no_grad():
        mk.indexer_loss(q8, k8, w, idx, tgt, q_scale=qs, k_scale=ksc)


def test_empty_problems():
    q = torch.randn(0, 2, 4)
    k = torch.randn(5, 4)
    w = torch.randn(0, 2)
    idx, ln = mk.indexer_topk(q, k, w, 3)
    assert idx.shape == (0, 3) and ln.shape == (0,)
    assert mk.indexer_logits(q, k, w).shape == (0, 5)
    q = torch.randn(3, 2, 4)
    w = torch.randn(3, 2)
    idx, ln, lg = mk.indexer_topk(q, torch.randn(0, 4), w, 3, return_logits=True)
    assert (idx == -1).all() and (ln == 0).all() and torch.isneginf(lg).all()
    qq = q.clone().requires_grad_(True)
    loss = mk.indexer_loss(qq, k, w, torch.zeros(3, 0, dtype=torch.int32), torch.zeros(3, 0))
    loss.backward()
    assert loss.item() == 0 and (qq.grad == 0).all()
    e = torch.randn(0, 2, 4, requires_grad=True)
    loss = mk.indexer_loss(e, k, torch.randn(0, 2), torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, 3))
    assert loss.item() == 0
    loss.backward()


def test_dsa_layer_flow_from_the_readme():
    """The README's order of calls at a tiny size on the CPU: indexer_topk -> sparse_mla (with the
    AttnSum holder) -> backward -> indexer_loss on the free target -> backward."""
    g = torch.Generator().manual_seed(0)
    S, h_q, h_idx, d_idx, topk, d_qk = 24, 4, 4, 16, 8, 576
    x_q = torch.randn(S, h_q, d_qk, generator=g, requires_grad=True)
    x_kv = torch.randn(S, 1, d_qk, generator=g, requires_grad=True)
    q_idx = torch.randn(S, h_idx, d_idx, generator=g, requires_grad=True)
    k_idx = torch.randn(S, d_idx, generator=g, requires_grad=True)
    w_idx = torch.randn(S, h_idx, generator=g, requires_grad=True)
    with torch.no_grad():
        indices, topk_length = mk.indexer_topk(q_idx, k_idx, w_idx, topk, sm_scale=d_idx ** -0.5)
    holder = mk.AttnSum()
    out = mk.sparse_mla(x_q, x_kv, indices.view(S, 1, topk), d_qk ** -0.5, topk_length=topk_length,
                        attn_sum=holder)
    out.float().square().mean().backward()
    assert holder.value.shape == (S, topk) and x_q.grad is not None
    loss = mk.indexer_loss(q_idx, k_idx, w_idx, indices, holder.value, sm_scale=d_idx ** -0.5,
                           topk_length=topk_length)
    loss.backward()
    assert loss.item() >= 0 and q_idx.grad.abs().sum() > 0 and w_idx.grad.abs().sum() > 0
    # the target sums to h_q over each row's valid slots (softmax per head, summed over heads)
    sums = holder.value.sum(dim=1)
    torch.testing.assert_close(sums[topk_length > 0], torch.full_like(sums[topk_length > 0], float(h_q)))


def test_loss_backward_inactive_rows_with_huge_logits_give_zero_not_nan():
    """A row with a zero target sum (inactive: no gradient) and logits far beyond exp's range: its
    pi is not formed, so its gradient is 0 and no NaN (inf * 0) leaks into dk."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 2, 8, generator=g, dtype=torch.float64)
    k = torch.randn(10, 8, generator=g, dtype=torch.float64)
    w = torch.rand(4, 2, generator=g, dtype=torch.float64) * 1e6  # logits ~ 1e6: exp overflows
    idx = torch.randint(0, 10, (4, 5), generator=g).int()
    tgt = torch.rand(4, 5, generator=g, dtype=torch.float64)
    tgt[1] = 0.0  # inactive row
    _, lse, inv = ref.indexer_loss_fwd_ref(q, k, w, idx, tgt, 1.0)
    assert inv[1] == 0
    dq, dk, dw = ref.indexer_loss_bwd_ref(q, k, w, idx, tgt, torch.ones(4, dtype=torch.float64), lse, inv, 1.0)
    for t in (dq, dk, dw):
        assert torch.isfinite(t).all()
    assert (dq[1] == 0).all() and (dw[1] == 0).all()


def test_online_kl_sums_equal_the_reference():
    """The sm90 loss forward's ``online`` variant forms, per thread over its slots, a running max
    ``m``, ``e = sum exp(I - m)`` and the sums ``tsum``, ``a = sum tg log tg``, ``b = sum tg I``,
    ``c = sum tg`` (slots with tg > 0), then merges the threads and takes
    ``loss = inv (a - b) + inv c (log inv + lse)``, ``inv = 1 / tsum``
    (``common.indexer_device.kl_terms`` / ``online_lse_update``).  The same arithmetic here in
    float32 (32 "threads", slots in a rotated order, zero / invalid targets, an empty row) equals
    the float64 reference loss and lse to float32 rounding."""
    g = torch.Generator().manual_seed(3)
    s_q, s_kv, topk = 7, 300, 256
    q = torch.randn(s_q, 64, 32, generator=g, dtype=torch.float64) / 4
    k = torch.randn(s_kv, 32, generator=g, dtype=torch.float64) / 4
    w = torch.randn(s_q, 64, generator=g, dtype=torch.float64) / 8
    idx = torch.randint(-2, s_kv, (s_q, topk), generator=g).int()
    idx[0] = -1
    tgt = torch.rand(s_q, topk, generator=g, dtype=torch.float64) * (torch.rand(s_q, topk, generator=g) < 0.8)
    want, want_lse, _ = ref.indexer_loss_fwd_ref(q, k, w, idx, tgt, 0.3)
    valid = (idx >= 0) & (idx < s_kv)
    logits = torch.einsum("thd,sd->ths", q, k).clamp_min(0).mul(w[..., None]).sum(1) * 0.3
    for t in range(s_q):
        x_all = torch.where(valid[t], logits[t, idx[t].clamp_min(0).long()], torch.tensor(float("-inf"),
                            dtype=torch.float64)).float()
        tg_all = tgt[t].float()
        st = []
        for th in range(32):  # thread th: slots th, th + 32, ... visited from a rotated start
            m, e = torch.tensor(float("-inf")), torch.tensor(0.0)
            tsum, a, b, c = (torch.tensor(0.0) for _ in range(4))
            slots = list(range(th, topk, 32))
            slots = slots[t % len(slots):] + slots[: t % len(slots)]
            for j in slots:
                x, ok = x_all[j], bool(valid[t, j])
                tg = tg_all[j] if ok else torch.tensor(0.0)
                tsum = tsum + tg
                if tg > 0:
                    a, b, c = a + tg * torch.log(tg), b + tg * x, c + tg
                mn = torch.maximum(m, x)
                ms = torch.tensor(0.0) if mn == float("-inf") else mn
                e = e * torch.exp(m - ms) + torch.exp(x - ms)
                m = mn
            st.append((m, e, tsum, a, b, c))
        mx = max(s[0] for s in st)
        ms = torch.tensor(0.0) if mx == float("-inf") else mx
        esum = sum(s[1] * torch.exp(s[0] - ms) for s in st)
        tsum, a, b, c = (sum(s[i] for s in st) for i in range(2, 6))
        active = bool(mx != float("-inf")) and bool(tsum > 0)
        if not active:
            assert want[t] == 0
            continue
        lse = ms + torch.log(esum)
        inv = 1.0 / tsum
        loss = inv * (a - b) + inv * c * (torch.log(inv) + lse)
        assert abs(float(lse) - float(want_lse[t])) <= 1e-5 * (1 + abs(float(want_lse[t])))
        assert abs(float(loss) - float(want[t])) <= 1e-5 * (1 + abs(float(want[t]))), (t, float(loss), float(want[t]))
