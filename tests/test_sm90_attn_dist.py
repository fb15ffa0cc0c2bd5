"""sm90 attention-distribution kernel vs the float32 reference (GPU tests: skipped without sm_90).

lse comes from our own sm90 forward, as in training; tolerance: relative L2 <= 1e-3, empty rows
exactly 0, no NaN."""

from __future__ import annotations

import pytest
import torch

import mla_kernels as mk
from mla_kernels import reference as ref

from conftest import make_case, rel_l2, skip_unless_sm90

pytestmark = [skip_unless_sm90(), pytest.mark.gpu]


def run_and_check(case, normalize, monkeypatch):
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    _, _, lse = mk.sparse_mla_fwd(case.q, case.kv, case.indices, case.sm_scale, 512, case.topk_length)
    got = mk.attn_dist(case.q, case.kv, case.indices, lse, case.sm_scale, case.topk_length, normalize)
    torch.cuda.synchronize()
    want = ref.attn_dist_ref(case.q.float(), case.kv.float(), case.indices, lse, case.sm_scale,
                             case.topk_length, normalize)
    topk = case.indices.shape[-1]
    assert got.shape == (case.q.shape[0], topk) and got.dtype == torch.float32
    assert not torch.isnan(got).any(), "NaN in attn_sum"
    valid = ref.valid_mask(case.indices, case.kv.shape[0], case.topk_length)
    assert (got[~valid] == 0).all(), "invalid slots / empty rows must be exactly 0"
    assert rel_l2(got, want) <= 1e-3, f"rel L2 {rel_l2(got, want):.3g}"


@pytest.mark.parametrize("s_q,s_kv,topk", [(1, 128, 128), (62, 592, 128), (213, 1840, 256),
                                           (62, 1521, 512), (213, 95, 128)])
@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("normalize", [False, True])
def test_attn_dist_shapes(s_q, s_kv, topk, h_q, d_qk, normalize, monkeypatch):
    case = make_case(s_q, h_q, d_qk, s_kv, topk, device="cuda", invalid_frac=0.1, empty_rows=2)
    run_and_check(case, normalize, monkeypatch)


@pytest.mark.parametrize("h_q", [64, 128, 256])
@pytest.mark.parametrize("normalize", [False, True])
def test_attn_dist_topk_length(h_q, normalize, monkeypatch):
    case = make_case(213, h_q, 576, 1840, 320, device="cuda", topk_length=True)
    run_and_check(case, normalize, monkeypatch)


def test_attn_dist_padding_and_unit_scale(monkeypatch):
    for topk in (100, 192):
        case = make_case(37, 128, 576, 777, topk, device="cuda", scale=1.0)
        run_and_check(case, True, monkeypatch)


def test_attn_dist_headline(monkeypatch):
    case = make_case(4096, 128, 576, 32768, 2048, device="cuda", invalid_frac=0.02, dup_frac=0.0)
    run_and_check(case, False, monkeypatch)


def _attn_dist_with_ctas(case, normalize, ctas, monkeypatch, lse):
    monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_CTAS", str(ctas))
    got = mk.attn_dist(case.q, case.kv, case.indices, lse, case.sm_scale, case.topk_length, normalize)
    torch.cuda.synchronize()
    return got


@pytest.mark.parametrize("h_q", [64, 128, 192, 256])
@pytest.mark.parametrize("normalize", [False, True])
def test_attn_dist_persistent_many_items_per_cta(h_q, normalize, monkeypatch):
    """A persistent grid of a few CTAs (each runs many (token, head group) items with its KV ring
    and partial-sum ring running on across them, the next item's Q loaded at its start):
    bitwise the one-CTA-per-item grid, and the reference -- with rows of 0, 1, 63, 64, 65 and all
    slots, so that items without blocks and with an odd block count sit between full ones."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    s_q, topk = 157, 384
    case = make_case(s_q, h_q, 576, 1500, topk, device="cuda", invalid_frac=0.05)
    lengths = torch.tensor([0, 1, 63, 64, 65, topk, 0, 0, 200, topk], dtype=torch.int32)
    case.topk_length = lengths.repeat(s_q // len(lengths) + 1)[:s_q].to("cuda")
    _, _, lse = mk.sparse_mla_fwd(case.q, case.kv, case.indices, case.sm_scale, 512, case.topk_length)
    base = _attn_dist_with_ctas(case, normalize, 0, monkeypatch, lse)
    want = ref.attn_dist_ref(case.q.float(), case.kv.float(), case.indices, lse, case.sm_scale,
                             case.topk_length, normalize)
    assert not torch.isnan(base).any()
    assert rel_l2(base, want) <= 1e-3, f"rel L2 {rel_l2(base, want):.3g}"
    valid = ref.valid_mask(case.indices, case.kv.shape[0], case.topk_length)
    for ctas in (1, 3, 7, 132):
        got = _attn_dist_with_ctas(case, normalize, ctas, monkeypatch, lse)
        assert (got[~valid] == 0).all(), f"ctas={ctas}: invalid slots / empty rows must be exactly 0"
        if normalize and h_q == 64:
            # tokens mode: which warpgroup takes a block follows the CTA's running block count, so
            # the row total's partial sums group differently with the grid (values: bitwise; the
            # normalising total: to rounding)
            torch.testing.assert_close(got, base, rtol=1e-6, atol=0.0)
        else:
            assert torch.equal(got, base), f"ctas={ctas}: differs from the one-CTA-per-item grid"



@pytest.mark.parametrize("h_q,d_qk", [(128, 576), (128, 512), (256, 576), (64, 576), (64, 512), (192, 576)])
@pytest.mark.parametrize("normalize", [False, True])
def test_attn_dist_q_through_the_ring_is_bitwise_the_same(h_q, d_qk, normalize, monkeypatch):
    """MLA_KERNELS_ATTN_DIST_QRING=1 (the default of persistent grids: each item's Q gathered into
    the KV ring ahead of its KV blocks -- two blocks in heads mode, one that both warpgroups read in
    tokens mode (h_q 64, 192) --, ldmatrix into the A registers) puts the same Q values into the
    same registers: bitwise the result of Q from global memory (MLA_KERNELS_ATTN_DIST_QRING=0), for
    grids of 1, 3 and 132 CTAs, with rows of 0, 1, 63-65 and all slots (items without blocks between
    full ones).  Tokens mode normalised in the CTA (h_q 64): which warpgroup takes a block follows the
    CTA's running block count, which the Q blocks shift, so the row total's partial sums group
    differently (to rounding)."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    s_q, topk = 157, 384
    case = make_case(s_q, h_q, d_qk, 1500, topk, device="cuda", invalid_frac=0.05)
    lengths = torch.tensor([0, 1, 63, 64, 65, topk, 0, 0, 200, topk], dtype=torch.int32)
    case.topk_length = lengths.repeat(s_q // len(lengths) + 1)[:s_q].to("cuda")
    _, _, lse = mk.sparse_mla_fwd(case.q, case.kv, case.indices, case.sm_scale, 512, case.topk_length)
    want = ref.attn_dist_ref(case.q.float(), case.kv.float(), case.indices, lse, case.sm_scale,
                             case.topk_length, normalize)
    for ctas in (1, 3, 132):
        monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_QRING", "0")
        base = _attn_dist_with_ctas(case, normalize, ctas, monkeypatch, lse)
        monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_QRING", "1")
        got = _attn_dist_with_ctas(case, normalize, ctas, monkeypatch, lse)
        assert not torch.isnan(got).any()
        assert rel_l2(got, want) <= 1e-3, f"ctas={ctas}: rel L2 {rel_l2(got, want):.3g}"
        if normalize and h_q == 64:
            torch.testing.assert_close(got, base, rtol=1e-6, atol=0.0)
        else:
            assert torch.equal(got, base), f"ctas={ctas}: Q through the ring differs from Q from global memory"


@pytest.mark.parametrize("h_q,d_qk", [(64, 576), (128, 576), (128, 512), (192, 576)])
@pytest.mark.parametrize("ctas", [0, 5])
def test_attn_dist_q_by_vector_loads_is_bitwise_the_same(h_q, d_qk, ctas, monkeypatch):
    """Q by 16-byte loads and a word transpose in each lane quad (the default) puts the same Q
    values into the same registers as 4-byte loads (MLA_KERNELS_ATTN_DIST_QVEC=0, persistent: the
    next item's Q loaded under the last block): the outputs are bitwise the same."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    case = make_case(77, h_q, d_qk, 900, 256, device="cuda", invalid_frac=0.05, empty_rows=2, topk_length=True)
    _, _, lse = mk.sparse_mla_fwd(case.q, case.kv, case.indices, case.sm_scale, 512, case.topk_length)
    monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_CTAS", str(ctas))
    monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_QRING", "0")  # Q from global memory in every grid
    monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_QVEC", "0")
    base = mk.attn_dist(case.q, case.kv, case.indices, lse, case.sm_scale, case.topk_length)
    monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_QVEC", "1")
    got = mk.attn_dist(case.q, case.kv, case.indices, lse, case.sm_scale, case.topk_length)
    torch.cuda.synchronize()
    want = ref.attn_dist_ref(case.q.float(), case.kv.float(), case.indices, lse, case.sm_scale, case.topk_length)
    assert rel_l2(base, want) <= 1e-3
    assert torch.equal(got, base), "Q by vector loads differs from Q by 4-byte loads"


def test_attn_dist_q_by_vector_loads_past_2g_offsets(monkeypatch):
    """The 16-byte Q loads and Q through the KV ring address rows past 2^31 bytes of q (64-bit
    offsets): s_q 16,400 at h_q 128, d_qk 576 is 2.4 GB of q; bitwise the 4-byte loads' result
    (persistent and not), and the persistent grid's Q through the ring bitwise the same."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    s_q, h_q, d_qk, s_kv, topk = 16400, 128, 576, 256, 64
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(s_q, h_q, d_qk, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(s_kv, 1, d_qk, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), device="cuda", dtype=torch.int32, generator=g)
    lse = torch.randn(s_q, h_q, device="cuda", generator=g) + 8.0
    scale = d_qk ** -0.5
    monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_QRING", "0")
    for ctas in ("0", "auto"):
        monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_CTAS", ctas)
        monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_QVEC", "0")
        base = mk.attn_dist(q, kv, idx, lse, scale)
        monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_QVEC", "1")
        got = mk.attn_dist(q, kv, idx, lse, scale)
        torch.cuda.synchronize()
        assert torch.isfinite(base).all() and base[-1].abs().sum() > 0
        assert torch.equal(got, base), f"ctas={ctas}: Q by vector loads differs past 2^31 bytes"
    monkeypatch.setenv("MLA_KERNELS_ATTN_DIST_QRING", "1")  # "auto" is persistent here: 16,400 items
    got = mk.attn_dist(q, kv, idx, lse, scale)
    torch.cuda.synchronize()
    assert torch.equal(got, base), "Q through the ring differs past 2^31 bytes"
