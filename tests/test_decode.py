"""Decode and merge on the CPU: the reference math (merge of partials == unsplit forward, paged
index translation, split emulation), the split rule, API validation, and the sm90 host side
driven through emulated kernels (tests/decode_emulation.py)."""

from __future__ import annotations

import math

import pytest
import torch

import mla_kernels as mk
from mla_kernels import _compile, dispatch
from mla_kernels import reference as ref
from mla_kernels.common import decode_host
from mla_kernels.decode import DecodePlan, choose_splits

from decode_emulation import Calls, emulated_compilers


def rnd(*shape, g, s=0.3, dtype=torch.float32):
    return (torch.randn(*shape, generator=g) * s).to(dtype)


def paged_case(b, s_q, h, d, topk, *, num_pages=40, page_size=16, max_pages=8, seed=0, dtype=torch.float32,
               with_bt=True, invalid=True):
    g = torch.Generator().manual_seed(seed)
    kv = rnd(num_pages, page_size, 1, d, g=g, dtype=dtype)
    q = rnd(b, s_q, h, d, g=g, dtype=dtype)
    if with_bt:
        bt = torch.randint(0, num_pages, (b, max_pages), generator=g).int()  # pages may be shared
        bt[0, -1] = -1  # an unused page
        if num_pages > 3:
            bt[-1, 0] = num_pages + 3  # out of range page id: invalid slots
        hi = max_pages * page_size
    else:
        bt = None
        hi = num_pages * page_size
    idx = torch.randint(0, hi, (b, s_q, topk), generator=g).int()
    if invalid:
        bad = torch.rand(b, s_q, topk, generator=g) < 0.1
        idx = torch.where(bad, torch.randint(-5, 0, (b, s_q, topk), generator=g).int(), idx)
        idx[..., : topk // 8] = torch.where(bad[..., : topk // 8], torch.full_like(idx[..., : topk // 8], hi + 7),
                                            idx[..., : topk // 8])
    idx[0, 0] = -1  # an empty row
    return q, kv, idx, bt


# ---------------------------------------------------------------------------------------------
# Reference math
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_parts", [1, 2, 5])
@pytest.mark.parametrize("sink", [False, True])
def test_merge_of_disjoint_parts_equals_unsplit(n_parts, sink):
    g = torch.Generator().manual_seed(n_parts)
    s_q, h, d, s_kv, topk = 7, 4, 32, 50, 30
    q, kv = rnd(s_q, h, d, g=g, dtype=torch.float64), rnd(s_kv, d, g=g, dtype=torch.float64)
    idx = torch.randint(-3, s_kv + 3, (s_q, topk), generator=g)
    idx[2] = -1
    sk = torch.randn(h, generator=g, dtype=torch.float64) if sink else None
    if sink:
        sk[0] = -math.inf
    want_o, _, want_l = ref.sparse_mla_fwd_ref(q, kv, idx, 0.2, 16, attn_sink=sk)
    part_of = torch.randint(0, n_parts, (topk,), generator=g)
    outs, lses = [], []
    for i in range(n_parts):
        ii = torch.where(part_of[None] == i, idx, torch.full_like(idx, -1))
        o, _, l_ = ref.sparse_mla_fwd_ref(q, kv, ii, 0.2, 16)  # no sink per part
        outs.append(o)
        lses.append(l_)
    outs, lses = torch.stack(outs), torch.stack(lses)
    # an empty part must be ignored whatever its out holds
    outs = torch.where(torch.isposinf(lses)[..., None], torch.full_like(outs, math.nan), outs)
    out, lse = mk.merge_attn_partials(outs, lses, sk)
    assert lse.dtype == torch.float64 and out.dtype == torch.float64
    torch.testing.assert_close(out, want_o, rtol=1e-10, atol=1e-12)
    fin = torch.isfinite(want_l)
    assert torch.equal(fin, torch.isfinite(lse)) and torch.isposinf(lse[2]).all() and (out[2] == 0).all()
    torch.testing.assert_close(lse[fin], want_l[fin], rtol=1e-12, atol=1e-12)


def test_merge_all_empty_and_out_dtype():
    outs = torch.randn(3, 2, 5, 4, 16)
    lses = torch.full((3, 2, 5, 4), math.inf)
    lses[1, 0, 0, 0] = 0.5
    out, lse = mk.merge_attn_partials(outs, lses, torch.zeros(4), out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 5, 4, 16) and lse.shape == (2, 5, 4)
    assert (out[1] == 0).all() and torch.isposinf(lse[1]).all()
    torch.testing.assert_close(out[0, 0, 0].float(), (outs[1, 0, 0, 0] * torch.sigmoid(torch.tensor(0.5))),
                               rtol=1e-2, atol=1e-2)
    assert lse[0, 0, 0] == 0.5
    out, lse = mk.merge_attn_partials(torch.zeros(0, 2, 4, 8), torch.zeros(0, 2, 4))
    assert (out == 0).all() and torch.isposinf(lse).all()


def test_merge_validation():
    o, l_ = torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="lses must have shape"):
        mk.merge_attn_partials(o, l_[:, :2])
    with pytest.raises(TypeError, match="lses must be float32"):
        mk.merge_attn_partials(o, l_.half())
    with pytest.raises(ValueError, match="at least 3-D"):
        mk.merge_attn_partials(o[0, 0], l_[0, 0])
    with pytest.raises(ValueError, match=r"attn_sink must have shape \[h_q\]=\[4\]"):
        mk.merge_attn_partials(o, l_, torch.zeros(3))
    with pytest.raises(TypeError, match="outs must be a torch.Tensor"):
        mk.merge_attn_partials([o], l_)


def test_physical_indices_through_block_table():
    g = torch.Generator().manual_seed(3)
    page_size, num_pages = 4, 10
    bt = torch.tensor([[3, 7, -1], [9, 12, 0]], dtype=torch.int32)
    idx = torch.tensor([[[0, 5, 11, -1, 12, 8]], [[3, 4, 8, 9, 100, -7]]], dtype=torch.int32)
    got = ref.decode_physical_indices(idx, num_pages * page_size, page_size, bt)
    want = []
    for b in range(2):
        row = []
        for pos in idx[b, 0].tolist():
            p_i = pos // page_size if pos >= 0 else -1
            if pos < 0 or p_i >= bt.shape[1]:
                row.append(-1)
                continue
            page = bt[b, p_i].item()
            row.append(page * page_size + pos % page_size if 0 <= page < num_pages else -1)
        want.append([row])
    assert got.tolist() == want
    phys = ref.decode_physical_indices(torch.tensor([[[0, 39, 40, -2]]]), 40, page_size)
    assert phys.tolist() == [[[0, 39, -1, -1]]]
    del g


@pytest.mark.parametrize("tl_shape", [None, "b", "bs"])
def test_decode_reference_equals_forward_on_flattened_tokens(tl_shape):
    b, s_q, h, d, topk = 3, 2, 8, 48, 40
    q, kv, idx, bt = paged_case(b, s_q, h, d, topk, seed=1)
    g = torch.Generator().manual_seed(5)
    bias = rnd(b, h, d, g=g, s=0.1)
    tl = None
    if tl_shape == "b":
        tl = torch.tensor([40, 7, 0], dtype=torch.int32)
    elif tl_shape == "bs":
        tl = torch.tensor([[40, 3], [0, 17], [39, 40]], dtype=torch.int32)
    sink = torch.randn(h, generator=g)
    out, lse = mk.sparse_mla_decode(q, kv, idx, 0.1, 32, tl, sink, block_table=bt, q_bias=bias)
    # by hand: translate, add the bias, flatten, forward
    phys = ref.decode_physical_indices(idx, kv.shape[0] * kv.shape[1], kv.shape[1], bt)
    qf = (q + bias[:, None]).reshape(b * s_q, h, d)
    tlf = None if tl is None else tl.reshape(b, -1).expand(b, s_q).reshape(-1)
    w_o, _, w_l = ref.sparse_mla_fwd_ref(qf, kv.reshape(-1, d), phys.reshape(b * s_q, topk), 0.1, 32, tlf, sink)
    torch.testing.assert_close(out.reshape(b * s_q, h, 32), w_o, rtol=1e-5, atol=1e-6)
    assert torch.equal(lse.reshape(-1, h).isinf(), w_l.isinf())
    torch.testing.assert_close(lse.reshape(-1, h)[w_l.isfinite()], w_l[w_l.isfinite()])
    assert (out[0, 0] == 0).all() and torch.isposinf(lse[0, 0]).all()


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_emulation_matches_unsplit(num_splits):
    b, s_q, h, d, topk = 2, 2, 16, 40, 300
    q, kv, idx, bt = paged_case(b, s_q, h, d, topk, seed=num_splits, num_pages=64, max_pages=40)
    tl = torch.tensor([[300, 129], [64, 0]], dtype=torch.int32)
    sink = torch.randn(h)
    plan = mk.decode_plan(b, s_q, h, topk, d_qk=d, d_v=32, device="cpu", dtype=torch.float32,
                          num_splits=num_splits, with_max_logits=True)
    assert plan.num_splits > 1 and plan.backend_name == "reference"
    out, lse, ml = mk.sparse_mla_decode(q, kv, idx, 0.1, 32, tl, sink, block_table=bt, plan=plan)
    w_o, w_l, w_m = ref.sparse_mla_decode_ref(q, kv, idx, 0.1, 32, tl, sink, bt, with_max_logits=True)
    torch.testing.assert_close(out, w_o, rtol=1e-5, atol=1e-6)
    fin = w_l.isfinite()
    assert torch.equal(fin, lse.isfinite()) and torch.equal(w_m.isfinite(), ml.isfinite())
    torch.testing.assert_close(lse[fin], w_l[fin])
    torch.testing.assert_close(ml[fin], w_m[fin])
    assert out.data_ptr() == plan.out.data_ptr()  # the plan's buffer


def test_choose_splits_rule():
    # b * s_q * head blocks >= SMs: one split (direct bf16 output, no combine)
    assert choose_splits(64, 2, 128, 2048, 132) == (1, 32)
    assert choose_splits(128, 1, 64, 2048, 132) == (1, 32)
    assert choose_splits(128, 1, 16, 2048, 132) == (1, 32)
    # small batches: one wave, >= 2 blocks per split
    assert choose_splits(1, 1, 128, 2048, 132) == (16, 2)
    assert choose_splits(2, 2, 128, 2048, 132) == (16, 2)
    assert choose_splits(1, 1, 16, 2048, 132) == (16, 2)
    assert choose_splits(1, 1, 16, 512, 132) == (4, 2)
    assert choose_splits(40, 1, 64, 2048, 132) == (3, 11)
    for b, s_q, h, topk in [(1, 1, 8, 100), (3, 2, 64, 777), (5, 4, 32, 64), (70, 1, 16, 2048)]:
        n, bps = choose_splits(b, s_q, h, topk, 132)
        blocks = -(-topk // 64)
        assert n * bps >= blocks and (n - 1) * bps < blocks  # no empty split
        assert n == 1 or bps >= 2


def test_decode_validation():
    b, s_q, h, d, topk = 2, 1, 16, 64, 32
    q, kv, idx, bt = paged_case(b, s_q, h, d, topk)
    call = lambda **kw: mk.sparse_mla_decode(**{**dict(q=q, kv_cache=kv, indices=idx, sm_scale=0.1, d_v=32), **kw})
    with pytest.raises(ValueError, match=r"kv_cache must have shape \[num_pages, page_size, 1, d_qk\]"):
        call(kv_cache=kv.reshape(40, 16, d))
    with pytest.raises(ValueError, match=r"kv_cache must have shape"):
        call(kv_cache=kv.reshape(40, 8, 2, d))
    with pytest.raises(ValueError, match="kv_cache's last dim"):
        call(kv_cache=torch.zeros(10, 1, 1, d + 1))
    with pytest.raises(ValueError, match="kv_cache must be contiguous"):
        call(kv_cache=torch.zeros(d, 40).t())
    with pytest.raises(ValueError, match=r"decode supports h_q 8, 16, 24, 32 or a multiple of 64, got h_q=12"):
        call(q=torch.zeros(b, s_q, 12, d))
    with pytest.raises(ValueError, match=r"block_table must have shape \[b, max_pages\] with b=2"):
        call(block_table=bt[:1])
    with pytest.raises(TypeError, match="block_table must be int32 or int64"):
        call(block_table=bt.float())
    with pytest.raises(ValueError, match=r"q_bias must have shape \[b, h_q, d_qk\]"):
        call(q_bias=torch.zeros(b, h, d - 1))
    with pytest.raises(ValueError, match=r"topk_length must have shape \[b\]=\[2\] or \[b, s_q\]"):
        call(topk_length=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"indices must have shape \[b, s_q, topk\]"):
        call(indices=idx[0])
    with pytest.raises(TypeError, match="indices must be int32 or int64"):
        call(indices=idx.float())
    with pytest.raises(ValueError, match="sm_scale must be > 0"):
        call(sm_scale=0.0)
    with pytest.raises(TypeError, match="kv_cache must have q's dtype"):
        call(kv_cache=kv.double())
    with pytest.raises(ValueError, match=r"attn_sink must have shape \[h_q\]=\[16\]"):
        call(attn_sink=torch.zeros(h + 1))
    plan = mk.decode_plan(b, s_q, h, topk, d_qk=d, d_v=32, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="the plan was made for"):
        call(q=torch.zeros(b + 1, s_q, h, d), indices=torch.zeros(b + 1, s_q, topk, dtype=torch.int32), plan=plan)
    with pytest.raises(ValueError, match="indices has topk=31 but the plan was made for topk=32"):
        call(indices=idx[..., :31].contiguous(), plan=plan)
    with pytest.raises(TypeError, match="plan must be a DecodePlan"):
        call(plan="plan")
    with pytest.raises(ValueError, match="decode supports h_q"):
        mk.decode_plan(1, 1, 48, 64)
    with pytest.raises(ValueError, match="topk must be >= 1"):
        mk.decode_plan(1, 1, 16, 0)
    with pytest.raises(TypeError, match="b must be an int"):
        mk.decode_plan(1.5, 1, 16, 64)
    # int64 inputs are converted; out-of-range values become invalid slots
    o1, l1 = call(indices=idx.long(), block_table=bt.long(), topk_length=torch.tensor([32, 5]))
    o2, l2 = call(block_table=bt, topk_length=torch.tensor([32, 5], dtype=torch.int32))
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(l1, l2)


def test_decode_empty_and_flat_cache():
    q = torch.randn(2, 1, 8, 32)
    kv = torch.randn(50, 32)
    out, lse = mk.sparse_mla_decode(q, kv, torch.zeros(2, 1, 0, dtype=torch.int32), 0.1, 16)
    assert out.shape == (2, 1, 8, 16) and (out == 0).all() and torch.isposinf(lse).all()
    idx = torch.randint(0, 50, (2, 1, 10), dtype=torch.int32)
    o1, _ = mk.sparse_mla_decode(q, kv, idx, 0.1, 16)
    o2, _ = mk.sparse_mla_decode(q, kv.reshape(50, 1, 32), idx, 0.1, 16)
    o3, _ = mk.sparse_mla_decode(q, kv.reshape(5, 10, 1, 32), idx, 0.1, 16)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(o1, o3)


# ---------------------------------------------------------------------------------------------
# The sm90 host side, with emulated kernels
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def emulated_sm90(monkeypatch):
    """A DecodePlan maker whose backend is the real sm90 host code over emulated kernels."""
    from mla_kernels.sm90 import Sm90Backend

    calls = Calls()
    monkeypatch.setattr(_compile, "_cache", {})
    monkeypatch.setattr(_compile, "arch_for_device", lambda d: "sm_90a")
    wide, narrow, combine = emulated_compilers(calls)

    class Emulated(Sm90Backend):
        def prepare_decode(self, plan):
            decode_host.prepare_decode(plan, wide, narrow, combine)

    backend = Emulated()

    def make(b, s_q, h, topk, d_qk=576, num_splits=1, with_max_logits=False):
        assert backend.supports("decode", DecodePlan(b, s_q, h, topk, d_qk, 512, torch.device("cpu"),
                                                     torch.bfloat16, 1, 1)) is None
        n_blocks = -(-topk // 64)
        bps = -(-n_blocks // num_splits)
        plan = DecodePlan(b, s_q, h, topk, d_qk, 512, torch.device("cpu"), torch.bfloat16, -(-n_blocks // bps), bps,
                          with_max_logits=with_max_logits, backend=backend)
        plan.allocate()
        backend.prepare_decode(plan)
        return plan

    make.calls = calls
    return make


@pytest.mark.parametrize("h,num_splits,combine", [(16, 1, "separate"), (16, 3, "separate"), (128, 1, "separate"),
                                                  (64, 4, "separate"), (16, 3, "fused"), (128, 2, "fused"),
                                                  (128, 4, "cluster"), (64, 2, "auto"), (64, 3, "cluster"),
                                                  (16, 2, "cluster"), (128, 4, "cluster-l2"), (16, 4, "auto"),
                                                  (32, 2, "cluster-l2")])
@pytest.mark.parametrize("opts", ["none", "all", "bt_tl2"])
def test_sm90_host_side_with_emulated_kernels(emulated_sm90, h, num_splits, combine, opts, monkeypatch):
    l2 = combine == "cluster-l2"  # the cluster merge with the partials through the workspace
    combine = "cluster" if l2 else combine
    monkeypatch.setenv(decode_host.ENV_COMBINE, combine)
    monkeypatch.setenv(decode_host.ENV_CLUSTER_PARTS, "l2" if l2 else "bf16")
    b, s_q, d, topk = 3, 2, 576, 260
    q, kv, idx, bt = paged_case(b, s_q, h, d, topk, seed=h + num_splits, dtype=torch.bfloat16, num_pages=50,
                                max_pages=20)
    g = torch.Generator().manual_seed(7)
    kw = {}
    if opts in ("all", "bt_tl2"):
        kw["block_table"] = bt
    else:
        idx = torch.where(idx >= 50 * 16, torch.full_like(idx, -1), idx)
    tl = sink = bias = None
    if opts == "all":
        tl = torch.tensor([260, 65, 0], dtype=torch.int32)
        sink = torch.randn(h, generator=g)
        bias = rnd(b, h, d, g=g, s=0.1, dtype=torch.bfloat16)
    if opts == "bt_tl2":
        tl = torch.tensor([[260, 1], [128, 200], [0, 64]], dtype=torch.int32)
    plan = emulated_sm90(b, s_q, h, topk, d, num_splits, with_max_logits=True)
    assert plan.split == (num_splits > 1)
    plan.out.fill_(math.nan)
    plan.lse.fill_(math.nan)
    out, lse, ml = mk.sparse_mla_decode(q, kv, idx, 0.05, 512, tl, sink, q_bias=bias, plan=plan, **kw)
    kinds = [c[0] for c in emulated_sm90.calls.log]
    fused = plan.split and combine == "fused"
    # the cluster merge serves split counts 2..16 by the auto rule (2/4/8/16 in the forced cluster
    # mode, the narrow kernel's there only where they divide h_q), the narrow kernel's with a
    # DSMEM staging only (else: the combine kernel)
    sizes = range(2, 17) if combine == "auto" and not l2 else (2, 4, 8, 16)
    cluster = plan.split and combine in ("cluster", "auto") and plan.num_splits in sizes
    cluster = cluster and (h % 64 == 0 or ((combine == "auto" or h % plan.num_splits == 0) and not l2))
    # auto: only if the rows' clusters fit at once (on the CPU: the documented fallback capacity)
    rows = b * s_q * (h // 64 if h % 64 == 0 else 1)
    cluster = cluster and (combine == "cluster" or rows <= 132 // plan.num_splits // 2)
    assert plan.state["cluster"] == (plan.num_splits if cluster else 0)
    assert (plan.out_parts is None) == ((cluster and not l2) or not plan.split)
    assert plan.state["cluster_l2"] == (cluster and l2)
    one_launch = fused or cluster or not plan.split
    assert kinds == (["decode"] if one_launch else ["decode", "combine"])
    assert (emulated_sm90.calls.log[0][-1] == "fused") == fused
    assert (emulated_sm90.calls.log[0][-1] == f"cluster{plan.num_splits}") == cluster
    assert (plan.counters is not None) == fused
    flags = emulated_sm90.calls.log[0][4]
    assert bool(flags & decode_host.F_BLOCK_TABLE) == ("block_table" in kw)
    assert bool(flags & decode_host.F_TOPK_LENGTH) == (tl is not None)
    assert bool(flags & decode_host.F_BIAS) == (bias is not None)
    # the sink goes to the kernel that writes the merged output: the combine's in split mode
    assert bool(flags & decode_host.F_SINK) == (sink is not None and one_launch)
    assert flags & decode_host.F_MAX_LOGITS
    if not one_launch:
        assert emulated_sm90.calls.log[1][-1] == (1 if sink is not None else 0)
    qr = q.float()
    if bias is not None:
        qr = (qr + bias.float()[:, None]).to(torch.bfloat16).float()
    w_o, w_l, w_m = ref.sparse_mla_decode_ref(qr, kv.float(), idx, 0.05, 512, tl, sink, kw.get("block_table"),
                                              with_max_logits=True)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.float(), w_o, rtol=1e-2, atol=2e-3)
    fin = w_l.isfinite()
    assert torch.equal(fin, lse.isfinite()) and torch.equal(fin, ml.isfinite())
    torch.testing.assert_close(lse[fin], w_l[fin], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ml[fin], w_m[fin], rtol=1e-5, atol=1e-5)
    # a second call allocates nothing new and reuses the buffers
    out2, _, _ = mk.sparse_mla_decode(q, kv, idx, 0.05, 512, tl, sink, q_bias=bias, plan=plan, **kw)
    assert out2.data_ptr() == out.data_ptr()


def test_decode_knobs(monkeypatch):
    monkeypatch.delenv(decode_host.ENV_COMBINE, raising=False)
    assert decode_host.combine_mode() == decode_host.DEFAULT_COMBINE
    monkeypatch.setenv(decode_host.ENV_COMBINE, "fused")
    assert decode_host.combine_mode() == "fused"
    monkeypatch.setenv(decode_host.ENV_COMBINE, "fast")
    with pytest.raises(ValueError, match="MLA_KERNELS_DECODE_COMBINE='fast'"):
        decode_host.combine_mode()
    monkeypatch.delenv(decode_host.ENV_L2_POLICY, raising=False)
    monkeypatch.delenv(decode_host.ENV_PDL, raising=False)
    assert decode_host.decode_knobs() == (False, 128)
    assert [decode_host.l2_evict_first(h) for h in (8, 32, 64, 128)] == [True, True, False, False]  # auto
    monkeypatch.setenv(decode_host.ENV_L2_POLICY, "first")
    assert decode_host.l2_evict_first(128) is True
    monkeypatch.setenv(decode_host.ENV_L2_POLICY, "last")
    assert decode_host.l2_evict_first(16) is False
    monkeypatch.setenv(decode_host.ENV_L2_POLICY, "normal")
    with pytest.raises(ValueError, match="MLA_KERNELS_DECODE_L2_POLICY='normal'"):
        decode_host.l2_evict_first(16)


# ---------------------------------------------------------------------------------------------
# The kernels' division by the page size (decode_host.page_divisor)
# ---------------------------------------------------------------------------------------------


def _check_divisors(ds: torch.Tensor, ns: torch.Tensor) -> None:
    """``page_div_emulated(n, *page_divisor(d)) == n // d`` for every pair of ``ds x ns``
    (int64 tensors; ``n`` in [0, 2^31), ``d`` in [1, 2^31))."""
    consts = [decode_host.page_divisor(int(d)) for d in ds]
    m = torch.tensor([c[0] for c in consts], dtype=torch.int64)[:, None]
    sh = torch.tensor([c[1] for c in consts], dtype=torch.int64)[:, None]
    assert bool(((m & 0xFFFFFFFF) > 0).all()) and bool((sh >= 0).all()) and bool((sh <= 31).all())
    assert bool((m >= -(2**31)).all()) and bool((m < 2**31).all())  # int32 kernel arguments
    n = ns[None, :]
    got = decode_host.page_div_emulated(n, m, sh)  # int64 throughout: n * m' < 2^63
    want = torch.div(n, ds[:, None], rounding_mode="floor")
    bad = (got != want).nonzero()
    assert bad.numel() == 0, [(int(ds[i]), int(ns[j]), int(got[i, j]), int(want[i, j])) for i, j in bad[:5]]


def test_page_divisor_constants():
    # powers of two (1 included): m' = 1, the shift is log2 d
    for k in range(31):
        assert decode_host.page_divisor(2**k) == (1, k)
    assert decode_host.page_divisor(3) == (0x55555556, 2)  # floor(2^32 / 3) + 1
    assert decode_host.page_divisor(2**31 - 1) == (3, 31)
    m, sh = decode_host.page_divisor(2**30 + 1)  # m' = floor(2^32 (2^31 - d) / d) + 1 > 2^31: negative int32
    assert m < 0 and sh == 31 and (m & 0xFFFFFFFF) == (2**32 * (2**31 - 2**30 - 1)) // (2**30 + 1) + 1
    for d in (0, -1, 2**31, 2**40):
        with pytest.raises(ValueError, match=rf"page_divisor: divisor {d} outside \[1, 2\^31 - 1\]"):
            decode_host.page_divisor(d)
    # the Python-int path of the emulation (what the tools print) agrees with //
    for d in (1, 3, 7, 64, 1000, 2**31 - 1):
        for n in (0, 1, d - 1, d, 2**31 - 1):
            assert decode_host.page_div_emulated(n, *decode_host.page_divisor(d)) == n // d


def test_page_divisor_every_small_divisor():
    """Every divisor 1 .. 2^16 (every page size in use, and more) against the dividends where a
    rounding error would show first: 0, 1, the multiples of d and their neighbours up to 64 d,
    the largest multiples of d below 2^31 and their neighbours, 2^31 - 1, and 64 random ones."""
    g = torch.Generator().manual_seed(0)
    top = 2**31 - 1
    for lo in range(1, 2**16 + 1, 4096):
        ds = torch.arange(lo, min(lo + 4096, 2**16 + 1), dtype=torch.int64)
        k = torch.arange(0, 65, dtype=torch.int64)
        near = (ds[:, None] * k[None, :])[..., None] + torch.tensor([-1, 0, 1])  # [d, k, 3]
        kmax = top // ds
        high = ((kmax[:, None] - torch.arange(0, 4))[..., None] * ds[:, None, None]) + torch.tensor([-1, 0, 1])
        rnd_n = torch.randint(0, 2**31, (64,), generator=g, dtype=torch.int64)
        # per divisor its own dividends: check row by row in one broadcast (n differs per row)
        ns = torch.cat([near.reshape(len(ds), -1), high.reshape(len(ds), -1),
                        torch.tensor([0, 1, top], dtype=torch.int64).expand(len(ds), 3),
                        rnd_n.expand(len(ds), 64)], dim=1).clamp(0, top)
        consts = [decode_host.page_divisor(int(d)) for d in ds]
        m = torch.tensor([c[0] for c in consts], dtype=torch.int64)[:, None]
        sh = torch.tensor([c[1] for c in consts], dtype=torch.int64)[:, None]
        got = decode_host.page_div_emulated(ns, m, sh)
        assert torch.equal(got, torch.div(ns, ds[:, None], rounding_mode="floor"))


def test_page_divisor_large_and_random_divisors():
    """Divisors up to 2^31 - 1: every 2^k - 1, 2^k, 2^k + 1, and 2000 random ones (log-uniform),
    against edge and random dividends up to 2^31 - 1."""
    g = torch.Generator().manual_seed(1)
    edge = [2**k + e for k in range(1, 32) for e in (-1, 0, 1) if 1 <= 2**k + e <= 2**31 - 1]
    logs = torch.rand(2000, generator=g, dtype=torch.float64) * 31
    rnd_d = (2.0 ** logs).long().clamp(1, 2**31 - 1)
    ds = torch.unique(torch.cat([torch.tensor(edge, dtype=torch.int64), rnd_d]))
    top = 2**31 - 1
    ns = torch.cat([torch.tensor([0, 1, 2, top - 1, top], dtype=torch.int64),
                    torch.tensor([2**k + e for k in range(31) for e in (-1, 0, 1) if 0 <= 2**k + e <= top]),
                    torch.randint(0, 2**31, (400,), generator=g, dtype=torch.int64)])
    _check_divisors(ds, ns)
    # and each divisor's own worst cases: the largest multiples below 2^31 and their neighbours
    kmax = top // ds
    own = ((kmax[:, None] - torch.arange(0, 3))[..., None] * ds[:, None, None] + torch.tensor([-1, 0, 1]))
    own = own.reshape(len(ds), -1).clamp(0, top)
    consts = [decode_host.page_divisor(int(d)) for d in ds]
    m = torch.tensor([c[0] for c in consts], dtype=torch.int64)[:, None]
    sh = torch.tensor([c[1] for c in consts], dtype=torch.int64)[:, None]
    assert torch.equal(decode_host.page_div_emulated(own, m, sh), torch.div(own, ds[:, None], rounding_mode="floor"))


@pytest.mark.parametrize("d", [1, 3, 64, 1000])
def test_page_divisor_exhaustive_ranges(d):
    """Every dividend in [0, 2^21) and in [2^31 - 2^21, 2^31) for a few page sizes."""
    m, sh = decode_host.page_divisor(d)
    for lo in (0, 2**31 - 2**21):
        n = torch.arange(lo, lo + 2**21, dtype=torch.int64)
        assert torch.equal(decode_host.page_div_emulated(n, m, sh), torch.div(n, d, rounding_mode="floor"))


@pytest.mark.parametrize("env,read,default,other,modes", [
    (decode_host.ENV_PAGEDIV, decode_host.page_div_mode, "generic", "magic", "generic, magic"),  # the division
    (decode_host.ENV_O_MODE, decode_host.decode_o_mode, "bulk", "regs", "bulk, regs"),  # how direct mode writes O
    (decode_host.ENV_RING, decode_host.decode_ring_mode, "auto", "alt", "auto, fixed, alt"),  # the KV ring
])
def test_plan_time_knobs(env, read, default, other, modes, monkeypatch):
    """MLA_KERNELS_DECODE_PAGEDIV / _O / _RING, read when a plan is made: the default
    when unset, the other value (whitespace stripped), a clear error otherwise."""
    monkeypatch.delenv(env, raising=False)
    assert read() == default
    monkeypatch.setenv(env, f" {other} ")
    assert read() == other
    monkeypatch.setenv(env, "fast")
    with pytest.raises(ValueError, match=f"{env}='fast': expected one of {modes}"):
        read()


def test_ring_rule():
    """auto: the alternating ring in direct mode, the fixed one in split mode; explicit modes win."""
    assert decode_host.ring_for("auto", False) == "alt"
    assert decode_host.ring_for("auto", True) == "fixed"
    for split in (False, True):
        assert decode_host.ring_for("fixed", split) == "fixed"
        assert decode_host.ring_for("alt", split) == "alt"


@pytest.mark.parametrize("env,h,num_splits,want", [
    (None, 128, 1, "alt"), (None, 64, 4, "fixed"), ("fixed", 64, 1, "fixed"), ("alt", 128, 2, "alt"),
    (None, 16, 1, None), ("alt", 32, 3, None),  # the narrow kernel has its own loop: no ring option
])
def test_plan_passes_the_ring(env, h, num_splits, want, monkeypatch):
    """prepare_decode hands the 64-head kernel ``ring_alt`` (True exactly when the plan's ring is
    ``alt``), records the ring in ``plan.state``, and never passes the option to the narrow
    kernel."""
    from decode_emulation import Calls, emulated_compilers

    if env is None:
        monkeypatch.delenv(decode_host.ENV_RING, raising=False)
    else:
        monkeypatch.setenv(decode_host.ENV_RING, env)
    monkeypatch.setenv(decode_host.ENV_COMBINE, "separate")
    monkeypatch.setattr(_compile, "_cache", {})
    monkeypatch.setattr(_compile, "arch_for_device", lambda d: "sm_90a")
    wide, narrow, combine = emulated_compilers(Calls())
    seen = []

    def spy(compile_fn):
        def f(*a, **kw):
            seen.append(kw)
            return compile_fn(*a, **kw)
        return f

    n_blocks = -(-256 // 64)
    bps = -(-n_blocks // num_splits)
    plan = DecodePlan(2, 1, h, 256, 576, 512, torch.device("cpu"), torch.bfloat16, -(-n_blocks // bps), bps)
    plan.allocate()
    decode_host.prepare_decode(plan, spy(wide), spy(narrow), combine)
    assert len(seen) == 1
    if want is None:
        assert "ring_alt" not in seen[0]
    else:
        assert seen[0]["ring_alt"] is (want == "alt")
    assert plan.state.get("ring") == want


@pytest.mark.parametrize("kw,opt", [({"pagediv": "magic"}, "pagediv"), ({"o_bulk": True}, "o_bulk"),
                                    ({"ring_alt": True}, "ring_alt")])
def test_compile_options_checked(kw, opt):
    class NoOption:
        pass

    with pytest.raises(ValueError, match=f"NoOption has no {opt} option"):
        decode_host.compile_decode_kernel(NoOption(), 576, 64, False, "sm_90a", **kw)
    with pytest.raises(ValueError, match="pagediv='fast': expected one of generic, magic"):
        decode_host.compile_decode_kernel(NoOption(), 576, 64, False, "sm_90a", pagediv="fast")


@pytest.mark.parametrize("split,want", [(False, True), (True, False)])
def test_compile_default_ring_follows_the_kernels_mode(split, want, monkeypatch):
    """Without a ``ring_alt`` the host applies ``ring_for``'s rule to the kernel's own mode (direct:
    alternating, split / cluster: fixed); the kernel itself defaults to the fixed ring."""
    from mla_kernels import _compile

    class Kernel:
        ring_alt = False

    k = Kernel()
    k.split = split
    monkeypatch.setattr(_compile, "compile_kernel", lambda kernel, *a, **kw: "compiled")
    assert decode_host.compile_decode_kernel(k, 576, 64, split, "sm_90a") == (k, "compiled")
    assert k.ring_alt is want
    decode_host.compile_decode_kernel(k, 576, 64, split, "sm_90a", ring_alt=not want)
    assert k.ring_alt is (not want)


@pytest.mark.parametrize("mode", ["magic", "generic"])
@pytest.mark.parametrize("h", [16, 128])
def test_sm90_host_passes_page_divisor(emulated_sm90, h, mode, monkeypatch):
    """A planned call hands the kernel page_divisor(page_size) next to the page size (recomputed
    when the cache's page size changes, the same tuple otherwise); the emulated kernel translates
    the block table with those constants as the kernel does (decode_emulation.py) and matches the
    reference, for page sizes 1, 7 (not a power of two), 16 and 1000."""
    monkeypatch.setenv(decode_host.ENV_PAGEDIV, mode)
    b, s_q, d, topk = 2, 1, 576, 130
    plan = emulated_sm90(b, s_q, h, topk, d, 1)
    assert plan.state["pagediv"] == mode
    calls = emulated_sm90.calls
    for i, ps in enumerate((16, 16, 7, 1, 1000)):
        q, kv, idx, bt = paged_case(b, s_q, h, d, topk, seed=i, dtype=torch.bfloat16, num_pages=12, page_size=ps,
                                    max_pages=6)
        before = plan.state["pagediv_of"]
        out, lse = mk.sparse_mla_decode(q, kv, idx, 0.05, 512, block_table=bt, plan=plan)
        assert calls.pagediv[-1] == (mode, ps, *decode_host.page_divisor(ps))
        if i == 1:  # same page size: the cached constants, no new tuple
            assert plan.state["pagediv_of"] is before
        w_o, w_l = ref.sparse_mla_decode_ref(q.float(), kv.float(), idx, 0.05, 512, None, None, bt)
        torch.testing.assert_close(out.float(), w_o, rtol=1e-2, atol=2e-3)
        fin = w_l.isfinite()
        assert torch.equal(fin, lse.isfinite())
        torch.testing.assert_close(lse[fin], w_l[fin], rtol=1e-5, atol=1e-5)
    assert len(calls.pagediv) == 5


def test_emulated_translation_equals_reference_for_odd_page_sizes():
    """The kernel's block-table translation with its constant division (decode_emulation) equals
    the reference's for page sizes that are not powers of two, positions up to 2^31 - 1 included."""
    from decode_emulation import emulated_physical_indices

    g = torch.Generator().manual_seed(2)
    for ps, num_pages, max_pages in ((3, 50, 40), (7, 30, 9), (1000, 20, 5), (2**20 + 3, 3, 2)):
        bt = torch.randint(-1, num_pages + 2, (2, max_pages), generator=g).int()
        hi = max_pages * ps
        idx = torch.randint(-3, hi + 3 * ps, (2, 1, 300), generator=g).int()
        idx[0, 0, :3] = torch.tensor([2**31 - 1, 0, hi - 1], dtype=torch.int32)
        n_rows = num_pages * ps
        for mode in ("magic", "generic"):
            got = emulated_physical_indices(idx, n_rows, ps, *decode_host.page_divisor(ps), bt, mode)
            assert torch.equal(got, ref.decode_physical_indices(idx, n_rows, ps, bt))


def test_cluster_rows_rule(monkeypatch):
    """MLA_KERNELS_DECODE_CLUSTER_ROWS (32 default, 64): CTAs of 32 heads for cluster plans that
    merge over DSMEM when the plan's rows of 32 heads fit as clusters at once (on the CPU the
    capacity is half of num_sms // cluster: 4 clusters of 16, 16 of 4); never for the L2 staging,
    plans without a cluster, or with the knob at 64; a clear error for other values."""
    monkeypatch.delenv(decode_host.ENV_CLUSTER_ROWS, raising=False)
    assert decode_host.cluster_rows() == 32

    def plan(h, b=1, s_q=1):
        return DecodePlan(b, s_q, h, 2048, 576, 512, torch.device("cpu"), torch.bfloat16, 16, 2)

    rule = decode_host.cluster_rows_for
    assert rule(plan(128), 16, "bf16") == 32  # b 1: 4 rows of 32 heads, 4 clusters of 16 fit
    assert rule(plan(64), 16, "f32") == 32
    assert rule(plan(128, 1, 2), 16, "bf16") == 64  # 8 rows of 32 heads: more than 4 clusters of 16
    assert rule(plan(128, 2, 2), 4, "bf16") == 32 and rule(plan(128, 3, 2), 4, "bf16") == 64  # 16 / 24 of 4
    assert rule(plan(128), 16, "l2") == 64 and rule(plan(128), 0, "bf16") == 64
    monkeypatch.setenv(decode_host.ENV_CLUSTER_ROWS, " 64 ")
    assert decode_host.cluster_rows() == 64 and rule(plan(128), 16, "bf16") == 64
    monkeypatch.setenv(decode_host.ENV_CLUSTER_ROWS, "16")
    with pytest.raises(ValueError, match="MLA_KERNELS_DECODE_CLUSTER_ROWS='16': expected one of 32, 64"):
        rule(plan(128), 16, "bf16")
    assert rule(plan(128), 0, "bf16") == 64  # (read only for cluster plans)


def test_cluster_knobs_and_size_rule(monkeypatch):
    """The cluster merge (one launch, the splits of a row merged over DSMEM) serves split counts
    2/4/8/16 up to MLA_KERNELS_DECODE_CLUSTER_MAX (the narrow kernel's only where they divide
    h_q); every other plan keeps the combine kernel."""
    for env in (decode_host.ENV_CLUSTER_MAX, decode_host.ENV_CLUSTER_PARTS, decode_host.ENV_RESPLIT):
        monkeypatch.delenv(env, raising=False)
    assert decode_host.cluster_knobs() == (16, "bf16")
    monkeypatch.setenv(decode_host.ENV_CLUSTER_MAX, "8")
    monkeypatch.setenv(decode_host.ENV_CLUSTER_PARTS, "f32")
    assert decode_host.cluster_knobs() == (8, "f32")
    monkeypatch.setenv(decode_host.ENV_CLUSTER_PARTS, "l2")
    assert decode_host.cluster_knobs() == (8, "l2")
    monkeypatch.setenv(decode_host.ENV_CLUSTER_MAX, "12")
    with pytest.raises(ValueError, match="MLA_KERNELS_DECODE_CLUSTER_MAX='12'"):
        decode_host.cluster_knobs()
    monkeypatch.setenv(decode_host.ENV_CLUSTER_MAX, "16")
    monkeypatch.setenv(decode_host.ENV_CLUSTER_PARTS, "fp8")
    with pytest.raises(ValueError, match="MLA_KERNELS_DECODE_CLUSTER_PARTS='fp8'"):
        decode_host.cluster_knobs()

    def plan(h, n, b=1, s_q=1, topk=2048, forced=False):
        nb = -(-topk // 64)
        return DecodePlan(b, s_q, h, topk, 576, 512, torch.device("cpu"), torch.bfloat16, n, -(-nb // n),
                          forced_splits=forced)

    size = decode_host.cluster_size_for
    assert decode_host.resplit_mode() == "fit"
    # first the rule before MLA_KERNELS_DECODE_RESPLIT=fit (the default since): only a 64-head plan
    # of more than 8 splits may become 8 splits in clusters of 8
    monkeypatch.setenv(decode_host.ENV_RESPLIT, "8")
    # on the CPU the driver cannot be asked: the documented fallback, half of num_sms // cluster
    assert decode_host.max_active_clusters(torch.device("cpu"), 16) is None
    assert [decode_host.cluster_capacity(torch.device("cpu"), c, 132) for c in (2, 4, 8, 16)] == [33, 16, 8, 4]
    # b 1 at h_q 128 (2 rows): the split count itself; 32 splits is no cluster size: 8 splits
    assert [size(plan(128, n), "auto", 16) for n in (1, 2, 4, 8, 16, 32)] == [0, 2, 4, 8, 16, 8]
    assert size(plan(128, 32, forced=True), "auto", 16) == 0  # a forced split count is kept
    # 4 rows fit as clusters of 16 (b 1 s_q 2 at h_q 128); 8 rows (b 2 s_q 2) only as clusters of 8
    assert size(plan(128, 16, 1, 2), "auto", 16) == 16
    assert size(plan(128, 16, 2, 2), "auto", 16) == 8 and size(plan(128, 16, 2, 2, forced=True), "auto", 16) == 0
    assert size(plan(64, 16, 9), "auto", 16) == 0  # 9 clusters of 8 do not fit (fallback: 8)
    assert size(plan(128, 16, 2, 2, topk=1152), "auto", 16) == 0  # 18 blocks: 8 splits would leave one empty
    assert size(plan(128, 16, 2, 2), "auto", 8) == 8  # MLA_KERNELS_DECODE_CLUSTER_MAX=8
    assert size(plan(128, 16, 2, 2), "auto", 4) == 0
    # the driver's answer when there is one (an H200's: tools/cluster_occupancy.py)
    h200 = {1: 132, 2: 66, 3: 39, 4: 30, 5: 22, 6: 17, 7: 15, 8: 15, 9: 9, **{c: 7 for c in range(10, 17)}}
    monkeypatch.setattr(decode_host, "max_active_clusters", lambda dev, c, *a, **k: h200[c])
    assert [size(plan(64, 16, b), "auto", 16) for b in (7, 8, 15, 16)] == [16, 8, 8, 0]
    # "cluster" forces it whether or not the clusters fit; never for other sizes or the narrow kernel
    assert size(plan(128, 16, 2, 2), "cluster", 16) == 16 and size(plan(64, 16, 16), "cluster", 16) == 16
    assert [size(plan(64, n), "cluster", 8) for n in (8, 16)] == [8, 0]
    assert size(plan(128, 6), "cluster", 16) == 0  # not a cluster size: the combine kernel
    # the narrow kernel (one row per token): its own split count when it divides h_q (no re-split)
    # and the staging is a DSMEM one
    assert [size(plan(16, n), "auto", 16) for n in (2, 4, 8, 16)] == [2, 4, 8, 16]
    assert [size(plan(8, n), "auto", 16) for n in (8, 16)] == [8, 16]  # 16 CTAs share 8 heads by columns
    assert size(plan(24, 8), "auto", 16) == 8 and size(plan(24, 16), "cluster", 16) == 0
    assert size(plan(32, 16), "auto", 16, "l2") == 0 and size(plan(32, 16), "cluster", 16, "f32") == 16
    assert [size(plan(16, 16, b), "auto", 16) for b in (7, 8)] == [16, 0]  # 7 clusters of 16 fit
    assert size(plan(16, 32), "auto", 16) == 0  # 32 splits: no cluster size, no re-split for h_q < 64
    assert size(plan(128, 16), "separate", 16) == 0 and size(plan(128, 16), "fused", 16) == 0
    # MLA_KERNELS_DECODE_RESPLIT=fit (the default): the largest cluster size below the split count
    # whose clusters all fit, whose splits deal the blocks evenly and hold at most 8 (64-head
    # kernel) / 4 (narrow kernel) blocks -- so that more plans are one launch
    monkeypatch.setenv(decode_host.ENV_RESPLIT, "fit")
    assert decode_host.RESPLIT_MAX_BLOCKS == {"wide": 8, "narrow": 4}
    assert [size(plan(8, 16, b), "auto", 16) for b in (1, 7, 8, 15, 16)] == [16, 16, 8, 8, 0]
    assert size(plan(16, 32), "auto", 16) == 16  # b 1, 32 splits: 16
    assert [size(plan(16, n, b), "auto", 16) for n, b in ((16, 8), (8, 16), (4, 32))] == [8, 0, 0]  # 8 blocks: no
    assert size(plan(24, 16, 8), "auto", 16) == 8 and size(plan(24, 8, 16), "auto", 16) == 0
    # the 64-head kernel takes any size 2..16 (uneven head slices): 16 rows -> 6 splits of 6 blocks
    # (17 clusters of 6 fit, 15 of 7 or 8)
    assert [size(plan(64, n, b), "auto", 16) for n, b in ((8, 16), (5, 24), (4, 32), (2, 66))] == [6, 4, 0, 2]
    assert size(plan(128, 8, 8), "auto", 16) == 6 and size(plan(128, 4, 16), "auto", 16) == 0  # 16 blocks: no
    # 20 rows: 6 splits do not fit (17); 5 splits of 7 blocks take as many block pairs as 4 of 8
    assert size(plan(64, 6, 20), "auto", 16) == 4 and size(plan(64, 7, 17), "auto", 16) == 6
    # a plan's own split count of 3 (11 blocks: the bound is for re-splits) where 39 clusters fit
    assert [size(plan(64, 3, b), "auto", 16) for b in (36, 39, 40)] == [3, 3, 0]
    # the narrow kernel too, with uneven slices (16 heads over 3 CTAs: 6, 5, 5)
    assert size(plan(16, 3, 36), "auto", 16) == 3 and size(plan(24, 16, 5), "auto", 16) == 16
    assert size(plan(128, 16, 2, 2), "auto", 16) == 8 and size(plan(128, 16, 2, 2), "auto", 4) == 4
    # 21 blocks: 8..10 splits would leave one empty; 7 splits of 3 blocks take as many block pairs
    # (2) as 6 of 4: the fewer CTAs, 6
    assert size(plan(128, 11, 3, 2, topk=1344), "auto", 16) == 6
    assert size(plan(128, 16, 2, 2), "auto", 16, "l2") == 8  # the L2 staging: powers of two only
    assert size(plan(64, 8, 16), "cluster", 16) == 8 and size(plan(64, 6, 20), "cluster", 16) == 0
    assert size(plan(16, 16, 8), "auto", 16, "l2") == 0  # the narrow kernel has no L2 staging
    assert size(plan(64, 8, 16, forced=True), "auto", 16) == 0  # a forced split count is kept
    monkeypatch.setenv(decode_host.ENV_RESPLIT, "all")
    with pytest.raises(ValueError, match="MLA_KERNELS_DECODE_RESPLIT='all': expected one of fit, 8"):
        size(plan(64, 8, 16), "auto", 16)


def test_auto_resplits_to_clusters_of_8(emulated_sm90, monkeypatch):
    """b 2, s_q 2, h_q 128 (8 rows): 16 splits' clusters do not all fit, so the auto rule makes
    the plan 8 splits merged in 8-CTA clusters (one launch, no workspace); the result is the
    reference's; a forced split count is kept."""
    monkeypatch.delenv(decode_host.ENV_COMBINE, raising=False)
    monkeypatch.delenv(decode_host.ENV_CLUSTER_MAX, raising=False)
    monkeypatch.delenv(decode_host.ENV_CLUSTER_PARTS, raising=False)
    b, s_q, h, d, topk = 2, 2, 128, 576, 2048
    plan = emulated_sm90(b, s_q, h, topk, d, 16, with_max_logits=True)
    assert (plan.num_splits, plan.blocks_per_split, plan.state["cluster"]) == (8, 4, 8)
    assert plan.out_parts is None and plan.lse_parts is None
    q, kv, idx, bt = paged_case(b, s_q, h, d, topk, seed=5, dtype=torch.bfloat16, num_pages=300, max_pages=140)
    sink = torch.randn(h, generator=torch.Generator().manual_seed(3))
    out, lse, ml = mk.sparse_mla_decode(q, kv, idx, 0.05, 512, None, sink, block_table=bt, plan=plan)
    assert [c[0] for c in emulated_sm90.calls.log] == ["decode"] and emulated_sm90.calls.log[0][-1] == "cluster8"
    w_o, w_l, w_m = ref.sparse_mla_decode_ref(q.float(), kv.float(), idx, 0.05, 512, None, sink, bt,
                                              with_max_logits=True)
    torch.testing.assert_close(out.float(), w_o, rtol=1e-2, atol=2e-3)
    torch.testing.assert_close(lse, w_l, rtol=1e-5, atol=1e-5)
    # forced: 16 splits stay, through the combine kernel (16-CTA clusters would not all fit)
    forced = DecodePlan(b, s_q, h, topk, d, 512, torch.device("cpu"), torch.bfloat16, 16, 2, forced_splits=True,
                        backend=plan.backend)
    forced.allocate()
    forced.backend.prepare_decode(forced)
    assert (forced.num_splits, forced.state["cluster"]) == (16, 0) and forced.out_parts.shape[0] == 16
    # the L2 staging keeps the workspace's first 8 splits
    monkeypatch.setenv(decode_host.ENV_CLUSTER_PARTS, "l2")
    l2 = emulated_sm90(b, s_q, h, topk, d, 16)
    assert (l2.num_splits, l2.state["cluster"], l2.state["cluster_l2"]) == (8, 8, True)
    assert l2.out_parts.shape[0] == 8 and l2.out_parts.is_contiguous() and l2.lse_parts.shape[0] == 8


def test_sm90_supports_decode_configs():
    from mla_kernels.sm90 import Sm90Backend

    be = Sm90Backend()
    mk_plan = lambda h, d=576, dt=torch.bfloat16, dv=512: DecodePlan(1, 1, h, 64, d, dv, torch.device("cpu"), dt, 1, 1)
    for h in (8, 16, 24, 32, 64, 128, 256):
        assert be.supports("decode", mk_plan(h)) is None
    assert "h_q=48" in be.supports("decode", mk_plan(48))
    assert "d_qk=128" in be.supports("decode", mk_plan(64, d=128))
    assert "bfloat16" in be.supports("decode", mk_plan(64, dt=torch.float32))
    from mla_kernels.common.problem import MergeProblem

    mp = lambda dt=torch.float32, od=torch.bfloat16, dv=512: MergeProblem(torch.device("cpu"), dt, od, dv, 8)
    assert be.supports("merge", mp()) is None and be.supports("merge", mp(torch.bfloat16, torch.float32)) is None
    assert "multiple of 256" in be.supports("merge", mp(torch.bfloat16, dv=128))
    assert "float16" in be.supports("merge", mp(torch.float16))


def test_sm100_and_cpu_serve_decode_by_reference(monkeypatch):
    # CPU: the reference, no splits; sm100 has no decode kernel: the reference, with the reason
    plan = mk.decode_plan(1, 1, 16, 64, d_qk=64, d_v=32, device="cpu", dtype=torch.float32)
    assert plan.backend_name == "reference" and plan.num_splits == 1
    from mla_kernels.sm100 import Sm100Backend

    be = Sm100Backend()
    why = be.supports("decode", plan)
    assert why is not None and "decode" in why
    monkeypatch.setattr(dispatch, "_is_cuda", lambda d: True)
    monkeypatch.setattr(dispatch, "_arch_of", lambda d: "sm100")

    class Present(Sm100Backend):
        def unavailable_reason(self, device):
            return None

    dispatch.register_backend("sm100", Present())
    with pytest.warns(RuntimeWarning, match="decode"):
        assert dispatch.select("decode", plan).name == "reference"
    assert dispatch.serving_kernel("decode", plan) is None


@pytest.mark.parametrize("h", [16, 128])
def test_planned_call_takes_every_flat_cache_shape_without_the_full_check(emulated_sm90, h, monkeypatch):
    """A planned call with a flat cache -- ``[n, d_qk]``, ``[n, 1, d_qk]`` (the forward's kv shape)
    or one page ``[1, n, 1, d_qk]`` -- passes the per-call fast check (the full check,
    ``api._decode_inputs``, is ~20 us of host time more per call) and gives the same result for
    all three shapes, equal to the reference's."""
    from mla_kernels import api

    b, s_q, d, topk = 2, 1, 576, 130
    plan = emulated_sm90(b, s_q, h, topk, d, 1)
    q, kv, idx, _ = paged_case(b, s_q, h, d, topk, seed=5, dtype=torch.bfloat16, num_pages=1, page_size=300,
                               with_bt=False)
    flat = kv.view(-1, d)

    def no_full_check(*a, **k):
        raise AssertionError("the planned call took the full check")

    full_check = api._decode_inputs
    monkeypatch.setattr(api, "_decode_inputs", no_full_check)
    got = []
    for cache in (flat, flat.view(-1, 1, d), kv):
        out, lse = mk.sparse_mla_decode(q, cache, idx, 0.05, 512, plan=plan)
        got.append((out.clone(), lse.clone()))
    for out, lse in got[1:]:
        assert torch.equal(out, got[0][0]) and torch.equal(lse, got[0][1])
    w_o, w_l = ref.sparse_mla_decode_ref(q.float(), flat.float(), idx, 0.05, 512)
    torch.testing.assert_close(got[0][0].float(), w_o, rtol=1e-2, atol=2e-3)
    fin = w_l.isfinite()
    assert torch.equal(fin, got[0][1].isfinite())
    torch.testing.assert_close(got[0][1][fin], w_l[fin], rtol=1e-5, atol=1e-5)
    # a cache shape the kernels do not take still gets the full check's error
    monkeypatch.setattr(api, "_decode_inputs", full_check)
    with pytest.raises(ValueError, match="kv_cache must have shape"):
        mk.sparse_mla_decode(q, flat.view(-1, 2, d // 2), idx, 0.05, 512, plan=plan)


def test_pair_cluster_rule(monkeypatch):
    """MLA_KERNELS_DECODE_PAIR ('1' default, '0'): direct-mode plans (one split, no merge cluster)
    of h_q a multiple of 128 launch each token's two 64-head CTAs as a 2-CTA cluster; split plans,
    merge clusters, h_q 64 / 192 and the knob at 0 do not; anything else is a clear error, and so is
    compiling the option where it does not apply."""
    monkeypatch.delenv(decode_host.ENV_PAIR, raising=False)
    assert decode_host.decode_pair_mode() is True

    def plan(h):
        return DecodePlan(128, 2, h, 2048, 576, 512, torch.device("cpu"), torch.bfloat16, 1, 32)

    rule = decode_host.pair_for
    assert rule(plan(128), False, 0, True) and rule(plan(256), False, 0, True)
    assert not rule(plan(128), True, 0, True)  # split
    assert not rule(plan(128), True, 8, True)  # merge cluster
    assert not rule(plan(64), False, 0, True) and not rule(plan(192), False, 0, True)
    assert not rule(plan(128), False, 0, False)
    monkeypatch.setenv(decode_host.ENV_PAIR, "0")
    assert decode_host.decode_pair_mode() is False
    monkeypatch.setenv(decode_host.ENV_PAIR, "yes")
    with pytest.raises(ValueError, match="MLA_KERNELS_DECODE_PAIR='yes': expected one of 1, 0"):
        decode_host.decode_pair_mode()

    class Kernel:
        pair_cluster = False
        cluster = 0

    for split, h in ((True, 128), (False, 64)):
        with pytest.raises(ValueError, match="pair_cluster: direct mode"):
            decode_host.compile_decode_kernel(Kernel(), 576, h, split, "sm_90a", pair_cluster=True)


def test_graph_plan_rule(monkeypatch):
    """Which eager cluster plans get a graph plan (``decode_host.wants_graph_plan``): clusters of
    8+ CTAs, and smaller clusters that the fit rule made of more splits; never a plan without a
    cluster, a forced combine mode, the L2 staging, a CPU plan or ``MLA_KERNELS_DECODE_GRAPH=same``."""
    monkeypatch.delenv(decode_host.ENV_GRAPH, raising=False)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    want = decode_host.wants_graph_plan
    assert want("auto", 16, 16, "f32", cuda) and want("auto", 8, 16, "bf16", cuda) and want("auto", 8, 8, "f32", cuda)
    assert want("auto", 6, 8, "f32", cuda) and want("auto", 4, 6, "f32", cuda)  # re-split by the fit rule
    assert not want("auto", 4, 4, "f32", cuda) and not want("auto", 3, 3, "f32", cuda)  # own small clusters
    assert not want("auto", 0, 16, "f32", cuda)  # the combine kernel already
    assert not want("cluster", 16, 16, "f32", cuda) and not want("cluster", 8, 16, "f32", cuda)
    assert not want("auto", 16, 16, "l2", cuda) and not want("auto", 16, 16, "f32", cpu)
    monkeypatch.setenv(decode_host.ENV_GRAPH, "same")
    assert not want("auto", 16, 16, "f32", cuda) and not want("auto", 6, 8, "f32", cuda)


@pytest.mark.parametrize("h,with_ml", [(128, False), (64, True), (16, True)])
def test_graph_plan_runs_the_own_splits_with_the_combine_kernel(emulated_sm90, h, with_ml, monkeypatch):
    """MLA_KERNELS_DECODE_GRAPH (``separate`` default, ``same``): a plan whose eager calls merge in a
    cluster of 8+ CTAs gets a graph plan -- its own split count (before the cluster rule lowered it),
    the combine kernel, the same out / lse / max_logits buffers -- and a call captured in a CUDA
    graph runs it (here: the capture state monkeypatched, emulated kernels).  Both paths match the
    reference; an eager call does not touch the graph plan; the knob's errors are clear."""
    b, s_q, topk = 2, 2, 2048
    monkeypatch.delenv(decode_host.ENV_GRAPH, raising=False)
    assert decode_host.graph_mode() == "separate"
    plan = emulated_sm90(b, s_q, h, topk, 576, 16, with_max_logits=with_ml)  # 16 splits: 1 block pair each
    monkeypatch.setattr(decode_host, "cluster_capacity", lambda *a: 100)
    plan.num_splits, plan.blocks_per_split = 8, 4  # as if the cluster rule had lowered it to 8
    plan.state.clear()
    decode_host.prepare_decode(plan, *emulated_compilers(emulated_sm90.calls), mode="cluster")
    assert plan.state["cluster"] == 8 and plan.state["graph_plan"] is None  # a CPU plan: no graph plan
    g = decode_host.graph_plan(plan, (16, 2), *emulated_compilers(emulated_sm90.calls))
    assert g.num_splits == 16 and g.blocks_per_split == 2 and not g.state["cluster"] and "combine" in g.state
    assert g.out is plan.out and g.lse is plan.lse and g.max_logits is plan.max_logits
    assert g.out_parts.shape[0] == 16 and g.state["graph_plan"] is None
    plan.state["graph_plan"] = g
    q, kv, idx, bt = paged_case(b, s_q, h, 576, topk, seed=3, dtype=torch.bfloat16, num_pages=300, page_size=64,
                                max_pages=280)
    w_o, w_l = ref.sparse_mla_decode_ref(q.float(), kv.float(), idx, 0.05, 512, None, None, bt)
    fin = w_l.isfinite()
    log = emulated_sm90.calls.log
    for capturing in (False, True):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
        n0 = len(log)
        res = mk.sparse_mla_decode(q, kv, idx, 0.05, 512, block_table=bt, plan=plan)
        assert res[0] is plan.out and res[1] is plan.lse and (not with_ml or res[2] is plan.max_logits)
        tags = [e for e in log[n0:] if e[0] == "decode"]
        assert len(tags) == 1 and tags[0][5] == (16 if capturing else 8)
        assert ("cluster8" in tags[0]) == (not capturing)
        torch.testing.assert_close(res[0].float(), w_o, rtol=1e-2, atol=3e-3)
        assert torch.equal(fin, res[1].isfinite())
        torch.testing.assert_close(res[1][fin], w_l[fin], rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(decode_host.ENV_GRAPH, "always")
    with pytest.raises(ValueError, match="MLA_KERNELS_DECODE_GRAPH='always': expected one of separate, same"):
        decode_host.graph_mode()
