"""sm90 decode, combine and merge kernels vs the float32 reference (GPU tests: skipped without an
sm_90 GPU).  Every option of the decode (paged cache with/without block table, page sizes 1 and
64, topk_length [b] / [b, s_q], attn_sink, q_bias, h_q 8..128, s_q 1 and 2, split and direct
modes), the forward's routing of small s_q through the decode, CUDA-graph capture of a planned
step, and the combine kernel on its own (empty parts holding NaN, all-empty rows, sinks)."""

from __future__ import annotations

import math

import pytest
import torch

import mla_kernels as mk
from mla_kernels import _compile
from mla_kernels import reference as ref

from conftest import assert_close_fwd, make_case, rel_l2, skip_unless_sm90

pytestmark = [skip_unless_sm90(), pytest.mark.gpu]


def dcase(b, s_q, h, topk, *, d=576, page_size=64, seq_len=4096, block_table=True, tl=None, sink=False,
          bias=False, seed=0, invalid=0.05, dup=0.03, empty=True, scale=0.1):
    """A paged decode problem: ``b`` sequences of ``seq_len`` tokens in distinct pages of a shared
    cache (plus spare pages), distinct random positions per query (as a top-k selection gives),
    some invalid (-1, past the sequence) and duplicate slots, one all-invalid query."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    pps = -(-seq_len // page_size)
    num_pages = b * pps + 3
    off = lambda: (torch.rand((), generator=g) - 0.5) * scale
    kv = (torch.randn(num_pages, page_size, 1, d, generator=g) * scale + off()).to("cuda", torch.bfloat16)
    q = (torch.randn(b, s_q, h, d, generator=g) * scale + off()).to("cuda", torch.bfloat16)
    bt = torch.randperm(num_pages, generator=g)[: b * pps].reshape(b, pps).to(torch.int32)
    pos = torch.rand(b * s_q, seq_len, generator=g).topk(min(topk, seq_len), dim=1).indices
    if topk > seq_len:
        pos = torch.cat([pos, torch.full((b * s_q, topk - seq_len), -1)], dim=1)
    pos = pos.reshape(b, s_q, topk)
    if dup > 0:
        src = torch.randint(0, topk, (b, s_q, topk), generator=g)
        pos = torch.where(torch.rand(b, s_q, topk, generator=g) < dup, pos.gather(2, src), pos)
    if invalid > 0:
        bad = torch.rand(b, s_q, topk, generator=g) < invalid
        kind = torch.rand(b, s_q, topk, generator=g) < 0.5
        pos = torch.where(bad, torch.where(kind, torch.full_like(pos, -1), pos + pps * page_size), pos)
    if empty:
        pos[0, 0] = -1
    if block_table:
        idx, bt_arg = pos, bt
    else:  # physical ids
        p = pos.clamp_min(0)
        page_i = (p // page_size).clamp(max=pps - 1)
        phys = bt.long().gather(1, page_i.reshape(b, -1)).reshape(pos.shape) * page_size + p % page_size
        ok = (pos >= 0) & (pos < pps * page_size)
        idx, bt_arg = torch.where(ok, phys, torch.full_like(phys, -1)), None
    tl_t = None
    if tl == "b":
        tl_t = torch.randint(0, topk + 1, (b,), generator=g)
        tl_t[0] = topk
        if b > 1:
            tl_t[1] = 0
    elif tl == "bs":
        tl_t = torch.randint(0, topk + 1, (b, s_q), generator=g)
        tl_t[0, 0] = topk
        tl_t[-1, -1] = 1
    sk = (torch.randn(h, generator=g) * 2).to("cuda") if sink else None
    if sk is not None:
        sk[::3] = -math.inf
    qb = (torch.randn(b, h, d, generator=g) * scale).to("cuda", torch.bfloat16) if bias else None
    cuda = lambda t: None if t is None else t.to("cuda", torch.int32)
    return dict(q=q, kv_cache=kv, indices=cuda(idx), topk_length=cuda(tl_t), attn_sink=sk, block_table=cuda(bt_arg),
                q_bias=qb)


def want_of(c, sm_scale, with_ml=False):
    """float32 reference on what the kernel computes: q + q_bias rounded to bf16 once."""
    q = c["q"].float()
    if c["q_bias"] is not None:
        q = (q + c["q_bias"].float()[:, None]).to(torch.bfloat16).float()
    return ref.sparse_mla_decode_ref(q, c["kv_cache"], c["indices"], sm_scale, 512, c["topk_length"], c["attn_sink"],
                                     c["block_table"], None, with_max_logits=with_ml)


def check(out, lse, want, c, ml=None, abs_tol=8e-4):
    w_o, w_l = want[0], want[1]
    b, s_q, h, _ = c["q"].shape
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.shape == (b, s_q, h, 512) and lse.shape == (b, s_q, h)
    empty = torch.isposinf(w_l)
    ml_ = ml if ml is not None else torch.zeros_like(lse)
    w_m = want[2] if ml is not None else torch.zeros_like(w_l)
    if ml is not None:
        w_m = torch.where(empty, torch.full_like(w_m, -math.inf), w_m)
        ml_ = ml
    else:
        ml_ = torch.where(empty, torch.full_like(lse, -math.inf), torch.zeros_like(lse))
        w_m = ml_
    assert_close_fwd(out.reshape(-1, h, 512), ml_.reshape(-1, h), lse.reshape(-1, h),
                     (w_o.reshape(-1, h, 512), w_m.reshape(-1, h), w_l.reshape(-1, h)),
                     empty=empty.reshape(-1, h), abs_tol=abs_tol)


def run(c, sm_scale=None, plan=None, poison=True, **kw):
    d = c["q"].shape[-1]
    sm_scale = sm_scale or d ** -0.5
    if plan is not None and poison:  # any element a kernel fails to write shows up
        for t in (plan.out, plan.lse, plan.out_parts, plan.lse_parts):
            if t is not None:
                t.fill_(math.nan)
    res = mk.sparse_mla_decode(c["q"], c["kv_cache"], c["indices"], sm_scale, 512, c["topk_length"],
                               c["attn_sink"], block_table=c["block_table"], q_bias=c["q_bias"], plan=plan, **kw)
    torch.cuda.synchronize()
    return res[0], res[1], sm_scale  # (+ plan.max_logits with a with_max_logits plan)


def bitwise_across_knob(monkeypatch, c, env, values, make_plan):
    """Run ``c`` once per value of the plan-time knob ``env`` (``make_plan(value)`` makes and
    checks the plan; its outputs and partials are poisoned before the call), assert that out, lse
    and max_logits are bitwise equal across the values and that the last value's match the
    reference."""
    res = {}
    for v in values:
        monkeypatch.setenv(env, v)
        plan = make_plan(v)
        plan.max_logits.fill_(math.nan)
        out, lse, sc = run(c, plan=plan)
        res[v] = (out.clone(), lse.clone(), plan.max_logits.clone())
    for a, b_ in zip(res[values[0]], res[values[-1]]):
        assert torch.equal(a, b_)
    last = res[values[-1]]
    check(last[0], last[1], want_of(c, sc, with_ml=True), c, ml=last[2])


def cluster_repeats_and_separate(monkeypatch, c, plan, make_sep, parts):
    """Run the cluster-merge ``plan`` twice on ``c`` (poisoned outputs; each against the
    reference, the second bitwise the first: each slice merges the peers in split order), then
    the combine kernel's plan ``make_sep()`` (made with MLA_KERNELS_DECODE_COMBINE=separate): the
    two agree to bf16 rounding (float32 staging: the same weights and order, nearly bitwise), the
    same lse.  Returns ``(cluster out, cluster lse, separate out, separate lse)``."""
    first = None
    for rep in range(2):
        plan.max_logits.fill_(math.nan)
        out, lse, sc = run(c, plan=plan)
        check(out, lse, want_of(c, sc, with_ml=True), c, ml=plan.max_logits)
        if first is None:
            first = (out.clone(), lse.clone())
        else:
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1])
    monkeypatch.setenv("MLA_KERNELS_DECODE_COMBINE", "separate")
    o2, l2, _ = run(c, plan=make_sep())
    assert rel_l2(o2.float(), first[0].float()) < (1e-2 if parts == "bf16" else 2e-3)
    fin = torch.isfinite(l2)
    assert torch.equal(fin, torch.isfinite(first[1]))
    assert ((l2[fin] - first[1][fin]).abs() <= 1e-5 * l2[fin].abs().clamp_min(1)).all()
    return first[0], first[1], o2, l2


# ---------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("combine", ["separate", "fused"])
@pytest.mark.parametrize("h", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("b,s_q,topk", [(1, 1, 2048), (3, 2, 512)])
def test_decode_every_option_split(h, b, s_q, topk, combine, monkeypatch):
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")  # no silent fallback
    monkeypatch.setenv("MLA_KERNELS_DECODE_COMBINE", combine)
    c = dcase(b, s_q, h, topk, tl="b", sink=True, bias=True, seed=h + b)
    plan = mk.decode_plan(b, s_q, h, topk, device="cuda", with_max_logits=True)
    assert plan.backend_name == "sm90" and plan.num_splits > 1
    assert (plan.counters is not None) == (combine == "fused")
    first = None
    for rep in range(2):  # the second call finds the counters the first one reset
        plan.max_logits.fill_(math.nan)
        out, lse, sc = run(c, plan=plan)
        check(out, lse, want_of(c, sc, with_ml=True), c, ml=plan.max_logits)
        if plan.counters is not None:
            assert int(plan.counters.abs().sum()) == 0
        if first is None:
            first = (out.clone(), lse.clone())
        else:  # a fixed merge order: bitwise the same whichever CTA arrived last
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1])


@pytest.mark.parametrize("h,b,s_q,topk,d,parts,n_want", [
    (128, 1, 1, 2048, 576, "f32", 16),  # b 1: two clusters of 16 (a non-portable size)
    (64, 1, 1, 2048, 576, "f32", 16),
    (128, 2, 2, 2048, 576, "f32", 16),  # eight clusters of 16
    (128, 3, 2, 512, 576, "f32", 4),
    (128, 2, 1, 512, 512, "f32", 4),  # d_qk 512
    (128, 1, 1, 2048, 576, "bf16", 16),  # the staged partials in bf16
    (64, 3, 2, 512, 576, "bf16", 4),
    (128, 1, 1, 2048, 576, "l2", 16),  # the float32 parts through L2, the cluster merges them
    (128, 2, 2, 2048, 576, "l2", 16),
    (64, 3, 2, 512, 512, "l2", 4),
])
def test_decode_cluster_merge(h, b, s_q, topk, d, parts, n_want, monkeypatch):
    """MLA_KERNELS_DECODE_COMBINE=cluster: the split CTAs of a row run as one cluster and merge
    over DSMEM (one launch, no float32 workspace); every option, empty rows and empty later
    splits (topk_length), poisoned outputs, bitwise-equal repeats."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    monkeypatch.setenv("MLA_KERNELS_DECODE_COMBINE", "cluster")
    monkeypatch.setenv("MLA_KERNELS_DECODE_CLUSTER_PARTS", parts)
    c = dcase(b, s_q, h, topk, d=d, tl="b", sink=True, bias=True, seed=17 + h + b + d)
    plan = mk.decode_plan(b, s_q, h, topk, d_qk=d, device="cuda", with_max_logits=True)
    assert plan.num_splits == n_want and plan.state["cluster"] == n_want
    assert (plan.out_parts is None) == (parts != "l2") and plan.state["cluster_l2"] == (parts == "l2")
    o1, l1, o2, l2 = cluster_repeats_and_separate(
        monkeypatch, c, plan, lambda: mk.decode_plan(b, s_q, h, topk, d_qk=d, device="cuda", with_max_logits=True),
        parts)
    if parts == "l2":  # the same parts merged by the same per-row code, in the same order
        assert torch.equal(o2, o1) and torch.equal(l2, l1)


@pytest.mark.parametrize("h,b,s_q,n_before", [
    (8, 8, 1, 16),  # 8 clusters of 16 do not fit (H100 / H200): 8 splits in clusters of 8
    (24, 9, 1, 11),  # 11 splits is no cluster size: 8 (3 heads per CTA)
    (64, 16, 1, 8),  # the 64-head kernel's 16 rows: 4 splits in clusters of 4
    (64, 24, 1, 5),
    (128, 4, 2, 8),
    (128, 2, 2, 16),  # 8 rows of 64 heads: 8 splits (as the rule before)
])
def test_decode_resplit_fit(h, b, s_q, n_before, monkeypatch):
    """MLA_KERNELS_DECODE_RESPLIT=fit (the default): a split plan whose own clusters do not all
    fit runs with fewer splits, merged in clusters that do (one launch); the result is the
    reference's (every option, poisoned outputs), bitwise the same on a repeat, and the combine
    kernel's to bf16 rounding."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    monkeypatch.delenv("MLA_KERNELS_DECODE_COMBINE", raising=False)
    monkeypatch.delenv("MLA_KERNELS_DECODE_CLUSTER_PARTS", raising=False)
    topk = 2048
    c = dcase(b, s_q, h, topk, tl="b", sink=True, bias=True, seed=7 + h + b, seq_len=2304)
    monkeypatch.setenv("MLA_KERNELS_DECODE_RESPLIT", "8")
    before = mk.decode_plan(b, s_q, h, topk, device="cuda", with_max_logits=True)
    monkeypatch.setenv("MLA_KERNELS_DECODE_RESPLIT", "fit")
    plan = mk.decode_plan(b, s_q, h, topk, device="cuda", with_max_logits=True)
    n = plan.num_splits
    assert 1 < n < n_before and plan.state["cluster"] == n and plan.out_parts is None
    assert before.num_splits in (n_before, n)

    def separate():
        sep = mk.decode_plan(b, s_q, h, topk, device="cuda", with_max_logits=True, num_splits=n)
        assert sep.state["cluster"] == 0 and sep.num_splits == n
        return sep

    cluster_repeats_and_separate(monkeypatch, c, plan, separate, "bf16")


@pytest.mark.parametrize("h,b,s_q,topk,d,parts,n_want,rows,forced", [
    (64, 16, 1, 2048, 576, "bf16", 6, 64, None),  # 64 heads over 6 CTAs: 11, 11, 11, 11, 11, 9
    (64, 20, 1, 2048, 576, "f32", 5, 64, 5),  # 13, 13, 13, 13, 12 (forced: the rule takes 4); float32
    (128, 1, 1, 384, 512, "bf16", 3, 32, None),  # CTAs of 32 heads over 3: 11, 11, 10; d_qk 512
    (16, 16, 1, 2048, 576, "bf16", 6, 64, 6),  # the narrow kernel: 16 heads over 6 CTAs (3 x 5 + 1)
    (32, 36, 1, 2048, 576, "f32", 3, 64, None),  # 32 heads over 3 (11, 11, 10), float32 staging
    (8, 2, 1, 2048, 512, "bf16", 5, 64, 5),  # 8 heads over 5 (2, 2, 2, 2, 0: the last CTA merges none)
])
def test_decode_uneven_cluster_slices(h, b, s_q, topk, d, parts, n_want, rows, forced, monkeypatch):
    """A cluster size that does not divide the CTA's heads (MLA_KERNELS_DECODE_RESPLIT=fit, the
    default): the last CTAs merge fewer heads and the merging threads past the slice store
    nothing -- every option, poisoned outputs, bitwise repeats, the combine kernel's result."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    monkeypatch.delenv("MLA_KERNELS_DECODE_COMBINE", raising=False)
    monkeypatch.delenv("MLA_KERNELS_DECODE_RESPLIT", raising=False)
    monkeypatch.setenv("MLA_KERNELS_DECODE_CLUSTER_PARTS", parts)
    c = dcase(b, s_q, h, topk, d=d, tl="b", sink=True, bias=True, seed=3 + h + b, seq_len=2304)
    plan = mk.decode_plan(b, s_q, h, topk, d_qk=d, device="cuda", with_max_logits=True, num_splits=forced)
    assert (plan.num_splits, plan.state["cluster"], plan.state["rows"]) == (n_want, n_want, rows)

    def separate():
        return mk.decode_plan(b, s_q, h, topk, d_qk=d, device="cuda", with_max_logits=True, num_splits=n_want)

    cluster_repeats_and_separate(monkeypatch, c, plan, separate, parts)


@pytest.mark.parametrize("h,b,s_q,topk,d,parts,splits", [
    (16, 1, 1, 2048, 576, "bf16", None),  # the narrow kernel's b 1: one cluster of 16 (the default rule)
    (16, 1, 1, 2048, 576, "f32", None),
    (32, 1, 2, 640, 576, "bf16", 4),  # an MTP pair, 10 blocks over 4 splits (3, 3, 3, 1)
    (32, 3, 1, 2048, 576, "f32", 16),  # 2 heads merged per CTA
    (8, 2, 1, 512, 512, "bf16", 8),  # d_qk 512, one head per CTA
    (24, 1, 1, 200, 576, "f32", 8),  # 3 heads per CTA, a partial last block
    (8, 2, 2, 256, 576, "bf16", 2),
    (8, 1, 1, 2048, 576, "bf16", None),  # 16 CTAs over 8 heads: each merges half of a head's columns
    (8, 1, 2, 1024, 512, "f32", 16),  # the same in float32, one block per split, d_qk 512
])
def test_decode_narrow_cluster_merge(h, b, s_q, topk, d, parts, splits, monkeypatch):
    """h_q 8..32 (heads on the MMA's N side): the split CTAs of a token run as one cluster and
    merge over DSMEM (one launch, no float32 workspace, no combine kernel) -- with topk_length
    (empty rows and splits), sink, q_bias, max_logits, invalid / duplicate slots, poisoned
    outputs; bitwise-equal repeats, and the combine kernel's result to bf16 rounding."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    monkeypatch.delenv("MLA_KERNELS_DECODE_COMBINE", raising=False)  # auto picks the cluster
    monkeypatch.setenv("MLA_KERNELS_DECODE_CLUSTER_PARTS", parts)
    c = dcase(b, s_q, h, topk, d=d, tl="b", sink=True, bias=True, seed=41 + h + b + d)
    plan = mk.decode_plan(b, s_q, h, topk, d_qk=d, device="cuda", with_max_logits=True, num_splits=splits)
    assert plan.num_splits > 1 and plan.state["cluster"] == plan.num_splits and plan.out_parts is None

    def separate():
        sep = mk.decode_plan(b, s_q, h, topk, d_qk=d, device="cuda", with_max_logits=True, num_splits=splits)
        assert sep.state["cluster"] == 0
        return sep

    cluster_repeats_and_separate(monkeypatch, c, plan, separate, parts)


@pytest.mark.parametrize("h,b,s_q,topk,d,parts,splits", [
    (128, 1, 1, 2048, 576, "bf16", None),  # b 1: 4 rows of 32 heads, clusters of 16
    (64, 1, 2, 640, 576, "f32", 4),  # an MTP pair at h 64, float32 staging, clusters of 4
    (128, 2, 1, 512, 512, "bf16", 4),  # d_qk 512, clusters of 4 (8 heads per CTA to merge)
    (128, 1, 1, 2048, 576, "bf16", 8),  # clusters of 8
])
def test_decode_cluster_rows32_is_bitwise_rows64(h, b, s_q, topk, d, parts, splits, monkeypatch):
    """MLA_KERNELS_DECODE_CLUSTER_ROWS=32: CTAs of 32 heads (the wgmma tile's other 32 rows zeros)
    merge over DSMEM; each head's partial is computed by the same per-row arithmetic and merged in
    the same order as with 64-head CTAs, so out, lse and max_logits are bitwise equal -- with
    topk_length (empty rows and splits), sink, q_bias, invalid / duplicate slots, poisoned outputs --
    and match the reference."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    monkeypatch.setenv("MLA_KERNELS_DECODE_COMBINE", "cluster")
    monkeypatch.setenv("MLA_KERNELS_DECODE_CLUSTER_PARTS", parts)
    c = dcase(b, s_q, h, topk, d=d, tl="b", sink=True, bias=True, seed=29 + h + b + d)

    def make_plan(rows):
        plan = mk.decode_plan(b, s_q, h, topk, d_qk=d, device="cuda", with_max_logits=True, num_splits=splits)
        assert plan.state["cluster"] == plan.num_splits and plan.state["rows"] == int(rows)
        return plan

    bitwise_across_knob(monkeypatch, c, "MLA_KERNELS_DECODE_CLUSTER_ROWS", ("64", "32"), make_plan)
    monkeypatch.setenv("MLA_KERNELS_DECODE_CLUSTER_ROWS", "48")
    with pytest.raises(ValueError, match="MLA_KERNELS_DECODE_CLUSTER_ROWS"):
        mk.decode_plan(b, s_q, h, topk, d_qk=d, device="cuda", num_splits=splits)


@pytest.mark.parametrize("h,num_splits,parts", [(128, 2, "f32"), (64, 8, "f32"), (128, 8, "f32"), (128, 8, "l2"),
                                                (64, 2, "l2")])
def test_decode_cluster_forced_splits(h, num_splits, parts, monkeypatch):
    # forced cluster sizes 2 and 8 (MLA_KERNELS_DECODE_CLUSTER_MAX=8), topk 200 (later splits
    # empty, a partial last block)
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    monkeypatch.setenv("MLA_KERNELS_DECODE_COMBINE", "cluster")
    monkeypatch.setenv("MLA_KERNELS_DECODE_CLUSTER_MAX", "8")
    monkeypatch.setenv("MLA_KERNELS_DECODE_CLUSTER_PARTS", parts)
    for topk in (2048, 200):
        c = dcase(2, 1, h, topk, tl="b", sink=True, seed=topk + h + num_splits)
        plan = mk.decode_plan(2, 1, h, topk, device="cuda", num_splits=num_splits)
        assert plan.state["cluster"] == plan.num_splits
        out, lse, sc = run(c, plan=plan)
        check(out, lse, want_of(c, sc), c)


@pytest.mark.parametrize("h", [16, 128])
@pytest.mark.parametrize("b,s_q,topk", [(1, 1, 2048), (3, 2, 512)])
def test_decode_bf16_parts(h, b, s_q, topk, monkeypatch):
    # MLA_KERNELS_DECODE_PARTS=bf16: the split kernels write bf16 partials, the combine reads them
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    monkeypatch.setenv("MLA_KERNELS_DECODE_PARTS", "bf16")
    monkeypatch.setenv("MLA_KERNELS_DECODE_COMBINE", "separate")
    c = dcase(b, s_q, h, topk, tl="b", sink=True, bias=True, seed=5 + h + b)
    plan = mk.decode_plan(b, s_q, h, topk, device="cuda", with_max_logits=True)
    assert plan.num_splits > 1 and plan.out_parts.dtype == torch.bfloat16
    plan.max_logits.fill_(math.nan)
    out, lse, sc = run(c, plan=plan)
    check(out, lse, want_of(c, sc, with_ml=True), c, ml=plan.max_logits)


@pytest.mark.parametrize("h,b,s_q", [(16, 140, 1), (64, 140, 1), (128, 35, 2), (32, 70, 2)])
def test_decode_direct_mode(h, b, s_q, monkeypatch):
    # b * s_q * head blocks >= SMs: one split, bf16 written by the decode kernel (no combine)
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    c = dcase(b, s_q, h, 256, seq_len=1024, tl="bs", sink=True, bias=h == 64, seed=h)
    plan = mk.decode_plan(b, s_q, h, 256, device="cuda", with_max_logits=True)
    assert plan.num_splits == 1
    plan.max_logits.fill_(math.nan)
    out, lse, sc = run(c, plan=plan)
    check(out, lse, want_of(c, sc, with_ml=True), c, ml=plan.max_logits)


@pytest.mark.parametrize("h,b,s_q,topk,page_size,seq_len,block_table,combine", [
    (64, 140, 1, 2048, 64, 4096, True, "auto"),  # direct: the b 128 h 64 kernel
    (128, 67, 2, 640, 64, 4096, False, "auto"),  # direct, physical ids (the division's result unused)
    (128, 2, 2, 2048, 1000, 4096, True, "auto"),  # split, merged in clusters; a page size of 1000
    (16, 3, 2, 512, 7, 2048, True, "separate"),  # narrow kernel, split + the combine kernel; page 7
    (32, 140, 1, 512, 1, 1024, True, "auto"),  # narrow kernel, direct; page 1 through a block table
])
def test_decode_page_division_magic_is_bitwise_generic(h, b, s_q, topk, page_size, seq_len, block_table, combine,
                                                       monkeypatch):
    """The gather's division by the page size with the host's constants (MLA_KERNELS_DECODE_PAGEDIV=
    magic) reads the same rows as the compiler's division (generic, the default): outputs, lse and
    max_logits equal bit for bit (invalid, duplicate, past-the-end and empty rows, positions up to
    2^31 - 1, topk_length, sink and bias included), and both match the reference."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    monkeypatch.setenv("MLA_KERNELS_DECODE_COMBINE", combine)
    c = dcase(b, s_q, h, topk, page_size=page_size, seq_len=seq_len, block_table=block_table, tl="bs", sink=True,
              bias=h == 64, seed=11 * h + b)
    if block_table:  # huge positions: past every block table (invalid), through both divisions
        c["indices"][-1, -1, :4] = torch.tensor([2**31 - 1, 2**31 - 2, 2**31 - page_size, 2**30], dtype=torch.int32)
    res = {}
    for mode in ("generic", "magic"):
        monkeypatch.setenv("MLA_KERNELS_DECODE_PAGEDIV", mode)
        plan = mk.decode_plan(b, s_q, h, topk, device="cuda", with_max_logits=True)
        assert plan.state["pagediv"] == mode
        plan.max_logits.fill_(math.nan)
        out, lse, sc = run(c, plan=plan)
        res[mode] = (out.clone(), lse.clone(), plan.max_logits.clone(), plan.num_splits)
    o0, l0, m0, n0 = res["generic"]
    o1, l1, m1, n1 = res["magic"]
    assert n0 == n1 and (n0 == 1) == (b * s_q * max(1, h // 64) >= 132)
    assert torch.equal(o0, o1) and torch.equal(l0, l1) and torch.equal(m0, m1)
    check(o1, l1, want_of(c, sc, with_ml=True), c, ml=m1)


@pytest.mark.parametrize("h,b,s_q,d,topk,splits,combine", [
    (64, 140, 1, 576, 640, 1, "separate"),  # direct, 5 block pairs (odd: the loop ends in an even body)
    (128, 67, 2, 576, 512, 1, "separate"),  # direct h 128, 4 pairs
    (128, 33, 1, 512, 128, 1, "separate"),  # d_qk 512 (P0 outside the RoPE tile), one pair
    (128, 5, 1, 576, 2048, 4, "separate"),  # split: 4 pairs per CTA, the combine kernel
    (64, 3, 2, 576, 1024, 4, "cluster"),  # split CTAs of a row as one cluster, merged over DSMEM
])
def test_decode_rings_are_bitwise_equal(h, b, s_q, d, topk, splits, combine, monkeypatch):
    """The alternating KV ring (MLA_KERNELS_DECODE_RING=alt; direct mode's default) and the fixed
    ring (split mode's default) give bit for bit the same out, lse and max_logits -- with
    topk_length (empty rows among them), sink, bias, invalid / duplicate slots, a block table -- and
    match the reference; outputs poisoned before each call."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    monkeypatch.setenv("MLA_KERNELS_DECODE_COMBINE", combine)
    c = dcase(b, s_q, h, topk, d=d, block_table=True, tl="bs", sink=True, bias=True, seed=29 * h + d + topk)

    def make_plan(ring):
        plan = mk.decode_plan(b, s_q, h, topk, d_qk=d, device="cuda", with_max_logits=True,
                              num_splits=None if splits == 1 else splits)
        assert plan.state["ring"] == ring and plan.num_splits == splits
        return plan

    bitwise_across_knob(monkeypatch, c, "MLA_KERNELS_DECODE_RING", ("fixed", "alt"), make_plan)
    monkeypatch.delenv("MLA_KERNELS_DECODE_RING")
    assert mk.decode_plan(b, s_q, h, topk, d_qk=d, device="cuda",
                          num_splits=None if splits == 1 else splits).state["ring"] == (
        "alt" if splits == 1 else "fixed")


@pytest.mark.parametrize("h,b,s_q,d,block_table,splits,parts", [
    (64, 140, 1, 576, True, 1, "f32"),  # direct: the b 128 h 64 kernel, positions through a block table
    (128, 67, 2, 576, False, 1, "f32"),  # direct h 128, physical ids
    (128, 70, 1, 512, True, 1, "f32"),  # d_qk 512: the staged rows run past Q's smem into KV buffer 0
    (128, 5, 1, 576, True, 4, "f32"),  # split + the combine kernel: the knob leaves the partials' stores
    (64, 6, 2, 512, True, 3, "bf16"),  # split, bf16 partials, d_qk 512 (likewise)
])
def test_decode_o_bulk_is_bitwise_regs(h, b, s_q, d, block_table, splits, parts, monkeypatch):
    """O of direct mode staged in smem and written by one bulk copy per head row
    (MLA_KERNELS_DECODE_O=bulk, the default) gives bit for bit the outputs of the register stores
    (regs; split mode's partials are register stores either way), with topk_length, sink, bias, max_logits, invalid /
    duplicate slots and an empty row, and both match the reference; outputs and partials are
    poisoned before each call."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    monkeypatch.setenv("MLA_KERNELS_DECODE_COMBINE", "separate")
    monkeypatch.setenv("MLA_KERNELS_DECODE_PARTS", parts)
    c = dcase(b, s_q, h, 640, d=d, block_table=block_table, tl="bs", sink=True, bias=h == 64, seed=17 * h + d)

    def make_plan(mode):
        plan = mk.decode_plan(b, s_q, h, 640, d_qk=d, device="cuda", with_max_logits=True,
                              num_splits=None if splits == 1 else splits)
        assert plan.state["o_mode"] == mode and plan.num_splits == splits
        return plan

    bitwise_across_knob(monkeypatch, c, "MLA_KERNELS_DECODE_O", ("regs", "bulk"), make_plan)
    monkeypatch.setenv("MLA_KERNELS_DECODE_O", "bogus")
    with pytest.raises(ValueError, match="MLA_KERNELS_DECODE_O"):
        mk.decode_plan(b, s_q, h, 640, d_qk=d, device="cuda")


@pytest.mark.parametrize("h,b,s_q,d", [(128, 67, 2, 576), (256, 21, 1, 512)])
def test_decode_pair_cluster_is_bitwise(h, b, s_q, d, monkeypatch):
    """Direct mode's token pairs of 64-head CTAs launched as 2-CTA clusters
    (MLA_KERNELS_DECODE_PAIR=1, the default for h_q a multiple of 128) give bit for bit the outputs
    of the plain launch (topk_length, sink, bias, max_logits, invalid / duplicate slots, an empty
    row; poisoned outputs), and both match the reference."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    c = dcase(b, s_q, h, 640, d=d, block_table=True, tl="bs", sink=True, bias=True, seed=h + b)

    def make_plan(mode):
        plan = mk.decode_plan(b, s_q, h, 640, d_qk=d, device="cuda", with_max_logits=True)
        assert plan.num_splits == 1 and plan.state["pair"] is (mode == "1")
        return plan

    bitwise_across_knob(monkeypatch, c, "MLA_KERNELS_DECODE_PAIR", ("0", "1"), make_plan)


@pytest.mark.parametrize("h", [32, 128])
def test_decode_page_size_1_physical_ids(h, monkeypatch):
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    c = dcase(2, 2, h, 768, page_size=1, seq_len=3000, block_table=False, tl="bs", seed=3)
    out, lse, sc = run(c)  # no plan: made per call
    check(out, lse, want_of(c, sc), c)


def test_decode_flat_cache_and_block_table_page_64(monkeypatch):
    """A flat cache, ``[n, d_qk]`` or ``[n, 1, d_qk]`` (the forward's kv shape; a planned call
    takes both on the fast path), gives what the paged cache of the same rows gives."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    c = dcase(2, 1, 64, 512, block_table=False, seed=4)
    flat = dict(c, kv_cache=c["kv_cache"].reshape(-1, 576))
    out, lse, sc = run(flat)
    check(out, lse, want_of(c, sc), c)
    plan = mk.decode_plan(2, 1, 64, 512, device="cuda")
    got = [tuple(t.clone() for t in run(dict(c, kv_cache=kv), plan=plan)[:2])
           for kv in (flat["kv_cache"], flat["kv_cache"].view(-1, 1, 576), c["kv_cache"])]
    for o, l in got:
        assert torch.equal(o, got[0][0]) and torch.equal(l, got[0][1])
    check(got[0][0], got[0][1], want_of(c, sc), c)


@pytest.mark.parametrize("h,num_splits,combine", [(16, 32, "separate"), (128, 32, "separate"), (64, 3, "separate"),
                                                  (16, 32, "fused"), (128, 32, "fused"), (24, 5, "fused")])
def test_decode_forced_splits_and_odd_topk(h, num_splits, combine, monkeypatch):
    # 32 splits of topk 2048: one block per split (the pair's padding block is masked at the
    # split's end); topk 200 is not a multiple of 64 (and leaves later splits empty)
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    monkeypatch.setenv("MLA_KERNELS_DECODE_COMBINE", combine)
    for topk in (2048, 200):
        c = dcase(2, 1, h, topk, tl="b", sink=True, seed=topk + h)
        plan = mk.decode_plan(2, 1, h, topk, device="cuda", num_splits=num_splits)
        out, lse, sc = run(c, plan=plan)
        check(out, lse, want_of(c, sc), c)


@pytest.mark.parametrize("h,split", [(32, False), (128, True)])
def test_decode_d512(h, split, monkeypatch):
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    b = 2 if split else 140
    c = dcase(b, 1, h, 512, d=512, seq_len=1024, tl="b", bias=True, sink=True, seed=5)
    plan = mk.decode_plan(b, 1, h, 512, d_qk=512, device="cuda")
    assert plan.split == split
    out, lse, sc = run(c, plan=plan)
    check(out, lse, want_of(c, sc), c)


def test_decode_unit_scale_values(monkeypatch):
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    c = dcase(2, 2, 128, 1024, scale=1.0, seed=9)
    out, lse, sc = run(c)
    check(out, lse, want_of(c, sc), c, abs_tol=8e-3)


@pytest.mark.parametrize("combine,h", [("separate", 128), ("fused", 128), ("fused", 16), ("cluster", 128),
                                       ("auto", 128), ("auto", 64), ("auto", 16), ("auto-mid", 64)])
def test_decode_matches_unsplit_and_graph_capture(combine, h, monkeypatch):
    """A planned step captured in a CUDA graph, replayed with new q / indices / topk_length /
    block_table contents; split and unsplit plans agree to bf16 rounding.  ``auto-mid``: b 8 s_q 2
    h_q 64, whose 8 splits the fit rule re-splits into 6 in clusters of 6 (132 SMs): its captured
    step runs the graph plan (its own 8 splits and the combine kernel)."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    mid = combine == "auto-mid"
    combine = "auto" if mid else combine
    monkeypatch.setenv("MLA_KERNELS_DECODE_COMBINE", combine)
    b, s_q, topk = (8 if mid else 2), 2, 2048
    c = dcase(b, s_q, h, topk, tl="b", sink=True, bias=True, seed=11)
    sc = 576 ** -0.5
    plan = mk.decode_plan(b, s_q, h, topk, device="cuda")
    one = mk.decode_plan(b, s_q, h, topk, device="cuda", num_splits=1)
    o1, l1, _ = run(c, sc, plan=one)
    o1, l1 = o1.clone(), l1.clone()
    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
    call = lambda: mk.sparse_mla_decode(static["q"], static["kv_cache"], static["indices"], sc, 512,
                                        static["topk_length"], static["attn_sink"], block_table=static["block_table"],
                                        q_bias=static["q_bias"], plan=plan)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()  # warm-up off the default stream, before capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = call()
    graph.replay()
    torch.cuda.synchronize()
    if mid:
        assert 1 < plan.state["cluster"] < plan.state["own_splits"] == 8, plan.state["cluster"]
    elif combine == "auto":
        # the default rule: clusters of 16 if the rows' clusters fit at once (the driver's answer),
        # else 8 splits in clusters of 8 (b 2, s_q 2, h_q 128 on an H100 / H200: 8 rows, 7 fit)
        from mla_kernels.common import decode_host

        rows = b * s_q * h // 64
        cap = {n: decode_host.max_active_clusters(torch.device("cuda"), n) for n in (8, 16)}
        assert all(v is not None and v >= 1 for v in cap.values()), cap  # the driver answers on a GPU
        want_n = 16 if rows <= cap[16] else 8 if rows <= cap[8] else 0
        assert plan.state["cluster"] == want_n and plan.num_splits == (want_n or 16)
        assert plan.out_parts is None
    else:
        assert plan.state["cluster"] == (16 if combine == "cluster" else 0)
    # auto plans with clusters of 8+ CTAs: the captured step ran the graph plan (own 16 splits + the
    # combine kernel; MLA_KERNELS_DECODE_GRAPH=separate, the default) into the plan's own buffers; a
    # forced combine mode runs as forced
    gp, cl = plan.state["graph_plan"], plan.state["cluster"]
    assert (gp is not None) == (combine == "auto" and (cl >= 8 or 0 < cl < plan.state["own_splits"]))
    assert gp is None or (gp.num_splits == plan.state["own_splits"] and not gp.state["cluster"]
                          and gp.out is plan.out and g_out is plan.out)
    assert rel_l2(g_out.float(), o1.float()) < 1e-2  # split vs unsplit
    fin = torch.isfinite(l1)
    assert torch.equal(fin, torch.isfinite(g_lse))
    assert ((g_lse[fin] - l1[fin]).abs() <= 1e-5 * l1[fin].abs().clamp_min(1)).all()
    for seed in (12, 13):
        c2 = dcase(b, s_q, h, topk, tl="b", sink=True, bias=True, seed=seed)
        for k in ("q", "indices", "topk_length", "block_table", "q_bias"):
            static[k].copy_(c2[k])
        c2["kv_cache"] = static["kv_cache"]  # same cache shape; its pages are c's
        c2["attn_sink"] = static["attn_sink"]
        graph.replay()
        torch.cuda.synchronize()
        check(g_out, g_lse, want_of(c2, sc), c2)


@pytest.mark.parametrize("combine,shapes", [("auto", ((1, 512), (3, 512))), ("separate", ((1, 512), (3, 1024)))])
def test_decode_no_recompile_across_batch_sizes(combine, shapes, monkeypatch):
    """One compiled kernel serves every batch size (and top-k) of a configuration.  A plan's
    cluster size is part of its configuration, so the auto case keeps it: b 1 and b 3 at topk 512
    both run 4 splits in clusters of 4; with the combine kernel, topk 512 and 1024 (4 / 8 splits)
    share the split and combine kernels."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    monkeypatch.setenv("MLA_KERNELS_DECODE_COMBINE", combine)
    (b0, k0), (b1, k1) = shapes
    run(dcase(b0, 1, 16, k0, seed=1))
    n = _compile.cache_info()["entries"]
    c = dcase(b1, 1, 16, k1, seed=2)
    out, lse, sc = run(c)
    check(out, lse, want_of(c, sc), c)
    assert _compile.cache_info()["entries"] == n


# ---------------------------------------------------------------------------------------------
# The forward's small-s_q rows through the decode
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("s_q,h_q", [(8, 128), (300, 16), (5, 32), (40, 64), (1, 128), (2, 64)])  # the last two: 32-head CTAs in clusters
def test_fwd_routes_small_s_q_through_decode(s_q, h_q, monkeypatch):
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    case = make_case(s_q, h_q, 576, 3000, 512, device="cuda", topk_length=True, sink="finite")
    out, ml, lse = mk.sparse_mla_fwd(case.q, case.kv, case.indices, case.sm_scale, 512, case.topk_length,
                                     case.attn_sink)
    torch.cuda.synchronize()
    want = ref.sparse_mla_fwd_ref(case.q.float(), case.kv.float(), case.indices, case.sm_scale, 512,
                                  case.topk_length, case.attn_sink)
    valid = ref.valid_mask(case.indices, 3000, case.topk_length)
    empty = (~valid.any(dim=-1))[:, None].expand(-1, h_q)
    assert_close_fwd(out, ml, lse, want, empty=empty)


# ---------------------------------------------------------------------------------------------
# The combine kernel / merge_attn_partials
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 16, 17, 37])  # 16 / 17: the combine's prefetched parts and one more
@pytest.mark.parametrize("dt,out_dt", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                       (torch.float32, torch.float32)])
@pytest.mark.parametrize("sink", [False, True])
def test_merge_kernel_vs_reference(n, dt, out_dt, sink, monkeypatch):
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    g = torch.Generator().manual_seed(n)
    R, h = 13, 8  # 104 rows: not a multiple of the CTA's 4 warps
    outs = torch.randn(n, R, h, 512, generator=g).to("cuda", dt)
    lses = (torch.randn(n, R, h, generator=g) * 3 + 5).cuda()
    lses[..., 0] = math.inf  # head 0: every part empty
    if n > 1:
        lses[0, :, 1] = math.inf  # an empty part ...
        outs[0, :, 1] = math.nan  # ... whose out must be ignored
        lses[1, 2, 2] = 80.0  # a dominant part (other weights underflow)
    sk = None
    if sink:
        sk = (torch.randn(h, generator=g) * 3).cuda()
        sk[3] = -math.inf
    out, lse = mk.merge_attn_partials(outs, lses, sk, out_dtype=out_dt)
    torch.cuda.synchronize()
    w_o, w_l = ref.merge_attn_partials_ref(outs.float(), lses, sk, torch.float32)
    assert out.dtype == out_dt and out.shape == (R, h, 512) and lse.shape == (R, h)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[:, 0] == 0).all() and torch.isposinf(lse[:, 0]).all()
    fin = torch.isfinite(w_l)
    assert torch.equal(fin, torch.isfinite(lse))
    assert ((lse[fin] - w_l[fin]).abs() <= 1e-5 * w_l[fin].abs().clamp_min(1)).all()
    tol = 1e-2 if out_dt == torch.bfloat16 else 1e-5
    assert rel_l2(out.float(), w_o) <= tol
    assert ((out.float() - w_o).abs() <= tol * (1 + w_o.abs())).all()


def test_merge_of_forward_partials_equals_unsplit_forward(monkeypatch):
    # two disjoint halves of each row's top-k through the sm90 forward (no sink), merged with
    # the sink on the GPU == the unsplit forward with the sink
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    case = make_case(300, 64, 576, 5000, 1024, device="cuda", sink="finite", empty_rows=3)
    idx = case.indices.reshape(300, 1024)
    half = torch.rand(300, 1024, device="cuda") < 0.5
    parts = [torch.where(m, idx, torch.full_like(idx, -1)) for m in (half, ~half)]
    res = [mk.sparse_mla_fwd(case.q, case.kv, p, case.sm_scale) for p in parts]
    out, lse = mk.merge_attn_partials(torch.stack([r[0] for r in res]), torch.stack([r[2] for r in res]),
                                      case.attn_sink)
    torch.cuda.synchronize()
    want = ref.sparse_mla_fwd_ref(case.q.float(), case.kv.float(), idx, case.sm_scale, 512, None, case.attn_sink)
    valid = ref.valid_mask(idx, 5000)
    empty = (~valid.any(dim=-1))[:, None].expand(-1, 64)
    ml = torch.where(empty, torch.full_like(lse, -math.inf), want[1])  # not produced by the merge
    assert_close_fwd(out, ml, lse, want, empty=empty)
