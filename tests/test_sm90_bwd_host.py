"""Host-side logic of the sm90 backward, on the CPU: the per-row terms, d_attn_sink, the
deterministic mode's fixed-order reduction, and which problems the backend serves."""

from __future__ import annotations

import math

import pytest
import torch

from mla_kernels import reference as ref
from mla_kernels.api import make_problem
from mla_kernels.common import bwd_host
from mla_kernels.sm90 import BACKEND

from conftest import make_case


def _naive_reduce(ws, idx, valid, n_hblk, s_kv, d):
    want = torch.zeros(s_kv, d, dtype=torch.float64)
    n_tok, topk = idx.shape
    for s in range(n_tok):
        for hb in range(n_hblk):
            for t in range(topk):
                if valid[s, t]:
                    want[idx[s, t]] += ws[(s * n_hblk + hb) * topk + t].double()
    return want


@pytest.mark.parametrize("n_hblk", [1, 2])
def test_reduce_slot_rows_matches_naive_sum(n_hblk):
    g = torch.Generator().manual_seed(3)
    n_tok, topk, d, s_kv = 6, 64, 8, 20
    idx = torch.randint(-3, s_kv + 3, (n_tok, topk), generator=g).int()
    idx[0] = 7  # one kv row picked by every slot of a token
    valid = ref.valid_mask(idx, s_kv)
    ws = torch.randn(n_tok * n_hblk * topk, d, generator=g)
    ws[~valid.repeat_interleave(n_hblk, 0).reshape(-1)] = float("nan")  # never written by the kernel
    acc = torch.zeros(s_kv, d)
    bwd_host.reduce_slot_rows(acc, ws, idx, valid, n_hblk)
    want = _naive_reduce(ws, idx, valid, n_hblk, s_kv, d)
    assert not torch.isnan(acc).any()
    assert torch.allclose(acc.double(), want, rtol=1e-5, atol=1e-5)
    again = torch.zeros(s_kv, d)
    bwd_host.reduce_slot_rows(again, ws, idx, valid, n_hblk)
    assert torch.equal(acc, again)


def test_reduce_slot_rows_no_valid_slot_is_a_no_op():
    acc = torch.ones(4, 8)
    idx = torch.full((2, 64), -1, dtype=torch.int32)
    bwd_host.reduce_slot_rows(acc, torch.empty(128, 8), idx, ref.valid_mask(idx, 4), 1)
    assert torch.equal(acc, torch.ones(4, 8))


@pytest.mark.parametrize("sink", [None, "finite", "neginf"])
def test_row_terms_and_d_sink_match_the_reference_formulas(sink):
    case = make_case(9, 64, 576, 50, 64, sink=sink, empty_rows=2)
    p = make_problem(case.q, case.kv, case.indices, case.sm_scale, 512, None, case.attn_sink)
    out, _, lse = ref.sparse_mla_fwd_ref(case.q, case.kv, case.indices, case.sm_scale, 512, None, case.attn_sink)
    dlse = torch.randn(lse.shape)
    lse2, corr, scale, lse_eff = bwd_host.row_terms(p, lse, dlse, need_asum_scale=True)
    want_eff = ref.effective_lse(lse, case.attn_sink)
    assert torch.equal(torch.isposinf(lse2), torch.isposinf(want_eff))
    fin = torch.isfinite(want_eff)
    assert torch.allclose(lse2[fin], want_eff[fin] * math.log2(math.e))
    ratio = torch.ones_like(lse) if sink is None else torch.where(
        torch.isposinf(lse), torch.ones_like(lse), torch.exp(want_eff - lse))
    assert torch.allclose(corr, dlse * ratio)
    assert (scale is None) == (sink is None)
    if sink is not None:
        dout = torch.randn(out.shape)
        delta = (out * dout).sum(-1)
        want = ref.sparse_mla_bwd_ref(case.q, case.kv, out, dout, case.indices, lse, case.sm_scale, 512, None,
                                      case.attn_sink)[2]
        got = bwd_host.d_attn_sink(p, lse_eff, delta)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_backend_serves_bwd_only_for_kernel_shapes():
    def prob(**kw):
        c = make_case(2, kw.get("h_q", 64), kw.get("d_qk", 576), 10, 64, d_v=kw.get("d_v", 512))
        return make_problem(c.q, c.kv, c.indices, kw.get("sm_scale", c.sm_scale), kw.get("d_v", 512))

    assert BACKEND.supports("bwd", prob()) is None
    assert BACKEND.supports("bwd", prob(d_qk=512)) is None
    assert "d_v" in BACKEND.supports("bwd", prob(d_v=256))
    assert "h_q" in BACKEND.supports("bwd", prob(h_q=32))
    assert "d_qk" in BACKEND.supports("bwd", prob(d_qk=256, d_v=256))


def test_scatter_workspace_column_order_round_trips():
    """The sm90 backward's scatter (``bwd._Scatter.chunk``), emulated lane by lane for one warp of a
    64 x 64 dKV chunk: the wgmma fragment (lane ``4 r8 + q`` holds columns ``8g + 2q``, ``+1`` of
    rows ``r8``, ``r8 + 8``), the xor-4 shuffle, the two 16-byte stores per (row half, 32-column
    line); every workspace element is written exactly once, each warp store covers 4 whole
    128-byte rows, and ``bwd_host.natural_columns`` with ``WS_COL_PERM`` restores the chunk."""
    pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed")
    from mla_kernels.sm90 import bwd

    chunk = torch.randn(16, 64)  # the 16 rows of one warp, natural column order
    ws = torch.full((16, 64), float("nan"))
    writes = torch.zeros(16, 64, dtype=torch.int32)

    def frag(lane, row, g, v):  # the fragment value of lane at (row half, group, column pair elem)
        r8, q = lane // 4, lane % 4
        return chunk[r8 + 8 * row, 8 * g + 2 * q + v]

    for rh in range(2):
        for ln in range(2):
            sends, a0s, a1s = {}, {}, {}
            for lane in range(32):
                a0s[lane] = [frag(lane, rh, 4 * ln + g, v) for g in (0, 1) for v in (0, 1)]
                a1s[lane] = [frag(lane, rh, 4 * ln + 2 + g, v) for g in (0, 1) for v in (0, 1)]
                odd = (lane // 4) & 1
                sends[lane] = [a0s[lane][e] if odd else a1s[lane][e] for e in range(4)]
            for store in range(2):
                rows_of_instr = {}
                for lane in range(32):
                    r8, q = lane // 4, lane % 4
                    odd = r8 & 1
                    recv = sends[lane ^ 4]
                    data = ([recv[e] if odd else a0s[lane][e] for e in range(4)] if store == 0
                            else [a1s[lane][e] if odd else recv[e] for e in range(4)])
                    row = (r8 & 6) + 8 * rh + store
                    col = 32 * ln + 16 * odd + 4 * q
                    ws[row, col:col + 4] = torch.tensor(data)
                    writes[row, col:col + 4] += 1
                    rows_of_instr.setdefault(row, set()).update(range(col, col + 4))
                # one warp instruction: 4 rows, each a whole 32-float (128-byte) line
                assert len(rows_of_instr) == 4
                assert all(cols == set(range(32 * ln, 32 * ln + 32)) for cols in rows_of_instr.values())
    assert (writes == 1).all()
    assert torch.equal(bwd_host.natural_columns(ws, bwd.WS_COL_PERM), chunk)
    assert bwd.SparseMlaBwdSm90.ws_col_perm == bwd.WS_COL_PERM
    assert sorted(bwd.WS_COL_PERM) == list(range(16))
    assert bwd_host.natural_columns(ws, None) is ws
    assert bwd_host.bit_permutation(bwd.WS_COL_PERM) is not None  # undone by a strided copy
    assert torch.equal(bwd_host.natural_columns(ws, bwd.WS_COL_PERM, torch.bfloat16), chunk.to(torch.bfloat16))


def test_natural_columns_strided_copy_matches_the_gather():
    """``natural_columns`` undoes a bit-permutation column order (the sm90 backward's) with one
    strided copy that also converts to bf16: bitwise the same as a gather followed by ``.to``, for
    the kernel's order, every other permutation of 4 index bits, and a non-bit permutation
    (which takes the gather)."""
    import itertools

    torch.manual_seed(3)
    ws = torch.randn(37, 576)

    def gather(perm):
        n = len(perm)
        return ws.view(37, 576 // n, n)[:, :, list(perm)].reshape(37, 576)

    perms = []
    for order in itertools.permutations(range(4)):  # every bit permutation of 16 columns
        perms.append(tuple(sum(((c >> b) & 1) << order[b] for b in range(4)) for c in range(16)))
    assert len(set(perms)) == 24
    for perm in perms:
        assert bwd_host.bit_permutation(perm) is not None
        got = bwd_host.natural_columns(ws, perm, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and got.is_contiguous()
        assert torch.equal(got, gather(perm).to(torch.bfloat16))
        assert torch.equal(bwd_host.natural_columns(ws, perm), gather(perm))
    odd = (1, 0, 2, 3, 5, 4, 6, 7, 8, 9, 10, 11, 12, 13, 15, 14)  # swaps pairs: not a bit permutation
    assert bwd_host.bit_permutation(odd) is None
    assert torch.equal(bwd_host.natural_columns(ws, odd, torch.bfloat16), gather(odd).to(torch.bfloat16))
    assert bwd_host.bit_permutation((0, 2, 1)) is None  # not a power of two
    assert bwd_host.natural_columns(ws, None, torch.bfloat16).dtype == torch.bfloat16


def test_rotate_shift_only_on_ordered_nondeterministic_calls(monkeypatch):
    """The rotated block order needs band-ordered slots (else the rotation has nothing to align)
    and a fixed order in deterministic mode; MLA_KERNELS_BWD_ROTATE=0 turns it off, anything but
    0 / 1 is an error that names the knob."""
    monkeypatch.delenv(bwd_host.ROTATE_ENV, raising=False)
    assert BACKEND.bwd_rotate_shift == 13
    assert bwd_host.rotate_shift_for(13, True, False) == 13
    assert bwd_host.rotate_shift_for(13, False, False) == 0
    assert bwd_host.rotate_shift_for(13, True, True) == 0
    assert bwd_host.rotate_shift_for(0, True, False) == 0
    monkeypatch.setenv(bwd_host.ROTATE_ENV, "0")
    assert bwd_host.rotate_shift_for(13, True, False) == 0
    monkeypatch.setenv(bwd_host.ROTATE_ENV, "1")
    assert bwd_host.rotate_shift_for(13, True, False) == 13
    monkeypatch.setenv(bwd_host.ROTATE_ENV, "yes")
    with pytest.raises(ValueError, match="MLA_KERNELS_BWD_ROTATE"):
        bwd_host.rotate_shift_for(13, True, False)


def test_deferred_scatter_only_where_the_workspace_fits_l2(monkeypatch):
    """The deferred scatter (``SparseMlaBwdSm90(defer_scatter=True)``) is asked for only at h_q a
    multiple of 128, not deterministic, s_kv up to the backend's bound (sm90: 16k, the float32
    workspace within L2; the variant is slower past it); MLA_KERNELS_BWD_DEFER=0 turns it off,
    anything but 0 / 1 is an error that names the knob."""
    monkeypatch.delenv(bwd_host.DEFER_ENV, raising=False)
    bound = BACKEND.bwd_defer_max_skv
    assert bound == 16384 and bound * 576 * 4 < 50 * 2**20
    assert bwd_host.defer_scatter_for(bound, 8192, 128, False)
    assert bwd_host.defer_scatter_for(bound, bound, 256, False)
    assert not bwd_host.defer_scatter_for(bound, bound + 1, 128, False)
    assert not bwd_host.defer_scatter_for(bound, 8192, 64, False)
    assert not bwd_host.defer_scatter_for(bound, 8192, 192, False)
    assert not bwd_host.defer_scatter_for(bound, 8192, 128, True)
    assert not bwd_host.defer_scatter_for(0, 8192, 128, False)
    monkeypatch.setenv(bwd_host.DEFER_ENV, "0")
    assert not bwd_host.defer_scatter_for(bound, 8192, 128, False)
    monkeypatch.setenv(bwd_host.DEFER_ENV, "2")
    with pytest.raises(ValueError, match="MLA_KERNELS_BWD_DEFER"):
        bwd_host.defer_scatter_for(bound, 8192, 128, False)
