"""sm90 indexer kernels (scores, top-k, loss forward/backward) vs the reference (GPU tests:
skipped without an sm_90 GPU).  Outputs are poisoned before each launch (conftest), so an element
a kernel fails to write shows up."""

from __future__ import annotations

import math

import pytest
import torch

import mla_kernels as mk
from mla_kernels import reference as ref

from conftest import rel_l2, skip_unless_sm90

pytestmark = [skip_unless_sm90(), pytest.mark.gpu]
FP8 = torch.float8_e4m3fn


def rand_inputs(s_q, h, d, s_kv, *, seed=0, fp8=False, integer=False):
    g = torch.Generator().manual_seed(seed)
    if integer:
        q = torch.randint(-2, 3, (s_q, h, d), generator=g).float()
        k = torch.randint(-2, 3, (s_kv, d), generator=g).float()
        w = torch.randint(-1, 3, (s_q, h), generator=g).float()
    else:
        q = torch.randn(s_q, h, d, generator=g)
        k = torch.randn(s_kv, d, generator=g)
        w = torch.randn(s_q, h, generator=g) * 0.5
    qs = ks = None
    dt = FP8 if fp8 else torch.bfloat16
    if fp8:
        if integer:
            qs = torch.full((s_q, h), 0.5)
            ks = torch.full((s_kv,), 2.0)
        else:
            qs = torch.rand(s_q, h, generator=g) + 0.25
            ks = torch.rand(s_kv, generator=g) + 0.25
        qs, ks = qs.cuda(), ks.cuda()
    return q.to(dt).cuda(), k.to(dt).cuda(), w.cuda(), qs, ks


def ranges(s_q, s_kv, kind, seed=0):
    if kind == "causal":
        return None, None
    g = torch.Generator().manual_seed(seed)
    ks = torch.randint(-5, s_kv, (s_q,), generator=g)
    ke = ks + torch.randint(-3, s_kv + 10, (s_q,), generator=g)
    ks[0], ke[0] = 3, 3  # empty
    if s_q > 2:
        ks[1], ke[1] = 0, s_kv
        ks[2], ke[2] = s_kv - 1, s_kv + 50
    return ks.int().cuda(), ke.int().cuda()


def check_logits(got, want, exact=False, rtol=2e-5):
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "-inf pattern (key ranges) differs"
    fin = torch.isfinite(want)
    assert torch.isfinite(got[fin]).all()
    if exact:
        assert torch.equal(got[fin], want[fin].float())
    else:
        err = (got[fin].double() - want[fin].double()).abs().max().item()
        scale = want[fin].abs().max().item() if fin.any() else 1.0
        assert err <= rtol * max(scale, 1.0), f"max abs err {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("s_q,s_kv,h,d,fp8,kind", [
    (1, 1, 64, 128, False, "causal"),
    (37, 300, 64, 128, False, "causal"),
    (300, 37, 64, 128, False, "causal"),
    (130, 777, 16, 64, False, "ranges"),
    (77, 1000, 32, 128, False, "ranges"),
    (260, 1500, 64, 128, True, "causal"),
    (50, 333, 32, 64, True, "ranges"),
])
def test_logits_vs_reference(s_q, s_kv, h, d, fp8, kind, monkeypatch):
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    q, k, w, qs, ksc = rand_inputs(s_q, h, d, s_kv, seed=s_q + s_kv, fp8=fp8)
    kst, ken = ranges(s_q, s_kv, kind, seed=s_q)
    got = mk.indexer_logits(q, k, w, sm_scale=0.3, k_start=kst, k_end=ken, q_scale=qs, k_scale=ksc)
    torch.cuda.synchronize()
    want = ref.indexer_logits_ref(q, k, w, 0.3, kst, ken, qs, ksc)
    # Hopper's FP8 tensor cores accumulate with reduced precision (about 2^-13 of the magnitude,
    # measured 2.1e-4 here; the integer-valued test below is exact)
    check_logits(got, want, rtol=1e-3 if fp8 else 2e-5)


@pytest.mark.parametrize("fp8", [False, True])
def test_logits_integer_exact(fp8, monkeypatch):
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    q, k, w, qs, ksc = rand_inputs(200, 64, 128, 700, seed=3, fp8=fp8, integer=True)
    got = mk.indexer_logits(q, k, w, sm_scale=0.5, q_scale=qs, k_scale=ksc)
    want = ref.indexer_logits_ref(q, k, w, 0.5, None, None, qs, ksc)
    check_logits(got, want, exact=True)


@pytest.mark.parametrize("parts", ["2", "4"])
def test_head_sum_chains(parts, monkeypatch):
    """MLA_KERNELS_INDEXER_SUM_PARTS (the head sums' FMA chains; default 1): any split sums the
    same terms in another order -- logits within float32 rounding of the reference, integer
    inputs exact, the loss rows near the reference."""
    from mla_kernels.sm90 import indexer_host

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    monkeypatch.setenv(indexer_host.ENV_SUM_PARTS, parts)
    q, k, w, _, _ = rand_inputs(77, 64, 128, 1000, seed=21)
    kst, ken = ranges(77, 1000, "ranges", seed=77)
    got = mk.indexer_logits(q, k, w, sm_scale=0.3, k_start=kst, k_end=ken)
    check_logits(got, ref.indexer_logits_ref(q, k, w, 0.3, kst, ken), rtol=2e-5)
    q, k, w, _, _ = rand_inputs(200, 64, 128, 700, seed=3, integer=True)
    check_logits(mk.indexer_logits(q, k, w, sm_scale=0.5), ref.indexer_logits_ref(q, k, w, 0.5), exact=True)
    q, k, w, idx, tgt, lens = loss_case(150, 700, 300, 128, seed=10, tl=True)
    rows = mk.indexer_loss(q, k, w, idx, tgt, sm_scale=128 ** -0.5, topk_length=lens, reduction="none")
    want = ref.indexer_loss_fwd_ref(q.float(), k.float(), w, idx, tgt, 128 ** -0.5, lens)[0]
    assert rel_l2(rows.float(), want) <= 1e-3


def naive_select(scores, start, end, topk):
    """The top-k definition on a float64 score matrix (rows = queries): (indices, length)."""
    s_q = scores.shape[0]
    idx = torch.full((s_q, topk), -1, dtype=torch.int32)
    ln = torch.zeros(s_q, dtype=torch.int32)
    sc = torch.nan_to_num(scores.double().cpu(), nan=-math.inf)
    sc = torch.where(sc == 0, torch.zeros_like(sc), sc)  # -0 == +0
    for t in range(s_q):
        a, b = int(start[t]), int(end[t])
        if b <= a:
            continue
        row = sc[t, a:b]
        order = sorted(range(b - a), key=lambda i: (-float(row[i]), i))[:topk]
        chosen = sorted(a + i for i in order)
        idx[t, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
        ln[t] = len(chosen)
    return idx, ln


@pytest.mark.parametrize("tmap,variant", [("1", None), ("1", "base"), ("0", "base")])
@pytest.mark.parametrize("topk", [1, 7, 64, 300])
def test_topk_kernel_adversarial_rows(topk, tmap, variant, monkeypatch):
    """The top-k kernel alone on rows with ties, NaN, +-0, +-inf and rows shorter than topk
    (``variant`` None: the default for the row length, rows held in shared memory; ``base``:
    every pass over the global row, the selection written from the bitmap where it applies, or
    always by the third pass)."""
    from mla_kernels.sm90 import indexer_host

    monkeypatch.setenv(indexer_host.ENV_TOPK_MAP, tmap)

    g = torch.Generator().manual_seed(topk)
    s_q, ld = 40, 1500
    sc = torch.randint(-3, 4, (s_q, ld), generator=g).float()  # heavy ties
    sc[1] = 0.0
    sc[1, ::3] = -0.0
    sc[2] = torch.randn(ld, generator=g)
    sc[2, ::7] = float("nan")
    sc[3, 5:50] = float("inf")
    sc[3, 60:70] = float("-inf")
    sc[4] = torch.randn(ld, generator=g) * 1e-30  # denormal-ish magnitudes
    sc[5] = torch.arange(ld).float()  # strictly increasing
    sc[6] = -torch.arange(ld).float()
    sc[7:20] = torch.randn(13, ld, generator=g) * 100
    start = torch.randint(0, ld, (s_q,), generator=g)
    end = (start + torch.randint(0, ld, (s_q,), generator=g)).clamp_max(ld)
    start[:8], end[:8] = 0, ld
    start[8], end[8] = 10, 10  # empty
    start[9], end[9] = 100, 100 + topk  # exactly topk keys
    start[10], end[10] = 100, 101 + topk  # one more than topk
    sc[11] = 1.0
    sc[11, 3 : 3 + topk] = 1000.0  # the threshold bin of the first digit is taken whole
    start[11], end[11] = 0, ld
    idx, ln, lg = indexer_host.select_rows(sc.cuda(), start.int().cuda(), end.int().cuda(), topk, True, variant=variant)
    torch.cuda.synchronize()
    want_idx, want_len = naive_select(sc, start, end, topk)
    assert torch.equal(ln.cpu(), want_len)
    assert torch.equal(idx.cpu(), want_idx)
    safe = want_idx.clamp_min(0).long()
    want_lg = torch.where(want_idx >= 0, sc.gather(1, safe), torch.full(safe.shape, -math.inf))
    assert torch.equal(torch.isnan(lg.cpu()), torch.isnan(want_lg))
    nn = ~torch.isnan(want_lg)
    assert torch.equal(lg.cpu()[nn], want_lg[nn])


@pytest.mark.parametrize("tmap,variant", [("1", None), ("1", "base"), ("0", "base")])
@pytest.mark.parametrize("topk", [100, 3000, 5000])
def test_topk_kernel_long_rows_heavy_ties(topk, tmap, variant, monkeypatch):
    """Rows longer than the shared candidate buffer whose threshold bin overflows it (all equal,
    few distinct values) and ones that fit, through the top-k kernel alone (``variant`` as in
    :func:`test_topk_kernel_adversarial_rows`)."""
    from mla_kernels.sm90 import indexer_host

    monkeypatch.setenv(indexer_host.ENV_TOPK_MAP, tmap)

    g = torch.Generator().manual_seed(topk)
    s_q, ld = 8, 10000
    sc = torch.randn(s_q, ld, generator=g)
    sc[0] = 0.0  # one bin of 10000 > CAP
    sc[1] = torch.randint(0, 3, (ld,), generator=g).float()
    sc[2, :5000] = 7.0
    sc[3] = torch.randint(-50, 50, (ld,), generator=g).float() * 0.25
    sc[4] = torch.rand(ld, generator=g) * 1e-3 + 1.0  # a narrow range: few coarse bins
    start = torch.zeros(s_q, dtype=torch.int64)
    end = torch.full((s_q,), ld)
    start[5], end[5] = 3, ld - 7  # unaligned head and tail
    start[6], end[6] = 1, 9999
    idx, ln, lg = indexer_host.select_rows(sc.cuda(), start.int().cuda(), end.int().cuda(), topk, True, variant=variant)
    torch.cuda.synchronize()
    want_idx, want_len = naive_select(sc, start, end, topk)
    assert torch.equal(ln.cpu(), want_len)
    assert torch.equal(idx.cpu(), want_idx)


@pytest.mark.parametrize("variant", ["base", "b4m3", "b2m4", "s8k"])
def test_topk_candidate_chunks(variant):
    """Pass 2 hands the shared candidate buffer out in chunks of 32 slots per warp: rows whose
    threshold bin holds up to CAP keys laid out so that the warps' last chunks stay partly empty
    -- within the buffer (candidates), past it (the row falls back to the heavy-ties passes), the
    bin at exactly CAP with no empty slot, distinct values and exact ties in the bin -- exactly
    the definition's selection, on the global path and in shared memory (``s8k``: rows of 8,192
    keys), indices, lengths and logits."""
    from mla_kernels.sm90 import indexer_host
    from mla_kernels.sm90.indexer_topk import CAND_BUF, CAP, CHUNK, THREADS, WARPS

    ld, big = 8192, 20
    seg = -(-ld // THREADS) * 32  # each warp's segment of a row of ld keys
    g = torch.Generator().manual_seed(7)

    def row(per_warp, ties=False):
        """bin [1, 1.25) holds per_warp[w] keys of warp w's segment, 20 keys per segment above
        it (> 100), the rest below (< -1)."""
        r = -1.0 - torch.rand(ld, generator=g)
        for w, c in enumerate(per_warp):
            lo = w * seg
            pick = lo + torch.randperm(seg, generator=g)[: c + big]
            r[pick[:c]] = 1.0 if ties else 1.0 + 0.2 * torch.rand(c, generator=g)
            r[pick[c:]] = 100.0 + torch.rand(big, generator=g)
        return r

    def slots(per_warp):
        return sum(-(-c // CHUNK) * CHUNK for c in per_warp)

    over = [257] * (WARPS - 1) + [CAP - 257 * (WARPS - 1)]  # CAP keys, 143 chunks: past the buffer
    exact = [CAP // WARPS] * WARPS  # CAP keys in 128 full chunks
    partial = [7 * CHUNK + 1] * WARPS  # 16 chunks with one key
    near = [245] * WARPS  # 3,920 keys
    rand = torch.randint(150, 250, (WARPS,), generator=g).tolist()
    assert sum(over) == CAP and slots(over) > CAND_BUF
    assert sum(exact) == CAP and slots(exact) == CAP
    assert slots(partial) <= CAND_BUF and slots(near) <= CAND_BUF and slots(rand) <= CAND_BUF
    rows = [over, exact, partial, near, rand, over, near, [CAP // WARPS + 1] * WARPS]
    ties = [False, False, False, False, False, True, True, False]
    sc = torch.stack([row(pw, t) for pw, t in zip(rows, ties)])
    s_q = sc.shape[0]
    start = torch.zeros(s_q, dtype=torch.int64)
    end = torch.full((s_q,), ld)
    for topk in (WARPS * big + 2000, WARPS * big + 1):
        got = indexer_host.select_rows(sc.cuda(), start.int().cuda(), end.int().cuda(), topk, True, variant=variant)
        torch.cuda.synchronize()
        want_idx, want_len = sorted_select(sc, start, end, topk)
        assert_same_selection(got, want_idx, want_len, sc)


def floats_of_keys(keys):
    """The floats whose order-preserving uint32 keys (``indexer_device.ordered_key``) are
    ``keys`` (int64 tensor of values in [0, 2^32))."""
    raw = torch.where(keys >= 2 ** 31, keys ^ 0x80000000, ~keys & 0xFFFFFFFF)
    raw = torch.where(raw >= 2 ** 31, raw - 2 ** 32, raw)  # as int32
    return raw.to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("variant", ["base", "b4m3", "s8k"])
def test_topk_first_digit_bin_edges(variant):
    """Pass 2 tells the scores above / in the threshold bin by float compares against the bin's
    bounds (not by their keys): rows of scores exactly at every first-digit bin edge and one key
    either side of it (negative and positive subnormals, -0 / +0, -inf / +inf, the largest finite
    values), shuffled, with thresholds landing on many bins -- exactly the definition's selection
    (global path and shared memory)."""
    from mla_kernels.sm90 import indexer_host

    g = torch.Generator().manual_seed(11)
    edges = torch.arange(4, 2045, dtype=torch.int64) << 21
    keys = torch.cat([edges - 1, edges, edges + 1, torch.tensor([0x007FFFFF, 0x80000000, 0xFF800000])])
    vals = floats_of_keys(keys)
    vals = vals[~torch.isnan(vals)]
    ld = 7000
    rows = []
    for r in range(6):
        pick = torch.randint(0, vals.numel(), (ld,), generator=g)
        rows.append(vals[pick])
    sc = torch.stack(rows)
    sc[1, ::5] = -0.0
    sc[2, ::9] = float("nan")
    s_q = sc.shape[0]
    start = torch.zeros(s_q, dtype=torch.int64)
    end = torch.full((s_q,), ld)
    start[3], end[3] = 5, ld - 3
    for topk in (1, 2, 7, 300, 2048, 5000):
        got = indexer_host.select_rows(sc.cuda(), start.int().cuda(), end.int().cuda(), topk, True, variant=variant)
        torch.cuda.synchronize()
        want_idx, want_len = sorted_select(sc, start, end, topk)
        assert_same_selection(got, want_idx, want_len, sc)


def sorted_select(sc, start, end, topk):
    """:func:`naive_select` by a stable sort (long rows): ``(indices, lengths)``."""
    x = torch.nan_to_num(sc.double(), nan=-math.inf)
    x = torch.where(x == 0, torch.zeros_like(x), x)
    idx = torch.full((sc.shape[0], topk), -1, dtype=torch.int32)
    ln = torch.zeros(sc.shape[0], dtype=torch.int32)
    for t in range(sc.shape[0]):
        a, b = int(start[t]), int(end[t])
        if b <= a:
            continue
        order = torch.sort(-x[t, a:b], stable=True).indices[:topk]
        chosen = torch.sort(order + a).values.int()
        idx[t, : len(chosen)] = chosen
        ln[t] = len(chosen)
    return idx, ln


def assert_same_selection(got, want_idx, want_len, sc):
    idx, ln, lg = (x.cpu() for x in got)
    assert torch.equal(ln, want_len)
    assert torch.equal(idx, want_idx)
    safe = want_idx.clamp_min(0).long()
    want_lg = torch.where(want_idx >= 0, sc.gather(1, safe), torch.full(safe.shape, -math.inf))
    assert torch.equal(torch.isnan(lg), torch.isnan(want_lg))
    nn = ~torch.isnan(want_lg)
    assert torch.equal(lg[nn], want_lg[nn])


SELECT_VARIANTS = ["base", "b2", "b4m3", "b2m4", "b1m4", "s8k", "s16k", "s32k", "s47k", (4096, 4, 0, 8192, 0, False)]


@pytest.mark.parametrize("variant", SELECT_VARIANTS, ids=str)
def test_topk_select_variants_at_their_limits(variant):
    """Every select variant (``indexer_host.TOPK_VARIANTS``, and a 4,096-key shared-memory one):
    rows of ``cap - 1``, ``cap`` (held in shared memory, at each misalignment of the row in its
    16 bytes) and ``cap + 1`` keys (the global path in the same launch), rows at the bitmap's
    limit +-1, heavy ties (a threshold bin over the candidate buffer: refined by passes over the
    row, in shared memory where it is held; few distinct values: candidates; more ties than
    needed), NaN / +-0 / +-inf, a first-digit bin taken whole, rows of topk + 1, topk and no keys
    -- exactly the definition's selection (indices, lengths, logits), with topk 300 and 2048."""
    from mla_kernels.sm90 import indexer_host

    spec = indexer_host.TOPK_VARIANTS[variant] if isinstance(variant, str) else variant
    cap, map_bits = spec[0] or 8192, 32 * spec[3]
    ld = max(cap, map_bits if map_bits <= 32768 else 0) + 40
    for topk in (300, 2048):
        g = torch.Generator().manual_seed(cap + topk)
        sc = torch.randn(19, ld, generator=g)
        sc[7] = 0.0  # one bin of cap keys > the 4096 candidates
        sc[8] = torch.randint(0, 3, (ld,), generator=g).float()
        sc[9] = torch.randint(-50, 50, (ld,), generator=g).float() * 0.25
        sc[10, ::5] = float("nan")
        sc[10, 1::5] = -0.0
        sc[10, 2::5] = 0.0
        sc[10, 3::11] = float("inf")
        sc[10, 4::13] = float("-inf")
        sc[11] = 1.0
        sc[11, 100: 100 + topk] = 1000.0  # the first digit's threshold bin taken whole
        sc[15] = torch.randint(0, 1000, (ld,), generator=g).float()  # ties at the threshold, need fewer
        m = min(map_bits, ld - 1)
        spans = [(0, cap - 1), (0, cap), (0, cap + 1), (1, cap + 1), (2, cap + 2), (3, cap + 3), (5, cap + 6),
                 (0, cap), (1, cap + 1), (0, cap - 1), (3, cap + 1), (0, cap), (7, 8 + topk), (9, 9 + topk),
                 (20, 20), (0, cap), (0, m - 1), (0, m), (1, m + 1)]
        start = torch.tensor([a for a, _ in spans], dtype=torch.int32)
        end = torch.tensor([min(b, ld) for _, b in spans], dtype=torch.int32)
        want_idx, want_len = sorted_select(sc, start, end, topk)
        got = indexer_host.select_rows(sc.cuda(), start.cuda(), end.cuda(), topk, True, variant=variant)
        torch.cuda.synchronize()
        assert_same_selection(got, want_idx, want_len, sc)


@pytest.mark.parametrize("fp8", [False, True])
def test_topk_shared_memory_rows_end_to_end(fp8, monkeypatch):
    """``indexer_topk`` with its default select variants against the version before them
    (``MLA_KERNELS_INDEXER_TOPK_VARIANT=base``), bitwise: causal at S 18000 (three row blocks of
    different variants), and integer-valued inputs with key ranges (exact: the reference's
    sets)."""
    from mla_kernels.sm90 import indexer_host

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    S, topk = 18000, 2048
    rows = indexer_host.block_rows(S, S)
    causal = type("P", (), dict(causal=True, s_q=S, s_kv=S))
    chosen = [indexer_host.topk_variant(indexer_host.block_longest(causal, q0, min(rows, S - q0)), topk)
              for q0 in range(0, S, rows)]
    assert len(chosen) == 3 and chosen != ["base"] * 3
    q, k, w, qs, ksc = rand_inputs(S, 64, 128, S, seed=21, fp8=fp8)
    runs = []
    for v in ("auto", "base"):
        monkeypatch.setenv(indexer_host.ENV_TOPK_VARIANT, v)
        runs.append(mk.indexer_topk(q, k, w, topk, sm_scale=128 ** -0.5, q_scale=qs, k_scale=ksc,
                                    return_logits=True))
    torch.cuda.synchronize()
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert (runs[0][1] == torch.clamp(torch.arange(S, device="cuda") + 1, max=topk)).all()
    s_q, s_kv, topk = 400, 5000, 300
    q, k, w, qs, ksc = rand_inputs(s_q, 64, 128, s_kv, seed=22, fp8=fp8, integer=True)
    kst, ken = ranges(s_q, s_kv, "ranges", seed=4)
    runs = []
    for v in ("auto", "base"):
        monkeypatch.setenv(indexer_host.ENV_TOPK_VARIANT, v)
        runs.append(mk.indexer_topk(q, k, w, topk, sm_scale=0.5, k_start=kst, k_end=ken, q_scale=qs, k_scale=ksc,
                                    return_logits=True))
    torch.cuda.synchronize()
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    want = ref.indexer_topk_ref(q, k, w, topk, 0.5, kst, ken, qs, ksc, return_logits=True)
    assert torch.equal(runs[0][0], want[0]) and torch.equal(runs[0][1], want[1])
    assert torch.equal(runs[0][2], want[2].float())


def test_topk_kernel_rows_beyond_the_bitmap():
    """Rows of more keys than the selection bitmap holds (MAP_BITS) take the third pass; a row of
    exactly MAP_BITS keys the bitmap; one of MAP_BITS keys with more ties at the threshold than
    needed the third pass again -- all exact."""
    from mla_kernels.sm90 import indexer_host
    from mla_kernels.sm90.indexer_topk import MAP_BITS

    g = torch.Generator().manual_seed(11)
    ld, topk = MAP_BITS + 100, 2048
    sc = torch.randn(3, ld, generator=g)
    sc[2] = torch.randint(0, 1000, (ld,), generator=g).float()  # ~262 ties per value: need < ties
    start = torch.tensor([0, 100, 37])
    end = torch.tensor([ld, ld, 37 + MAP_BITS])
    idx, ln, lg = indexer_host.select_rows(sc.cuda(), start.int().cuda(), end.int().cuda(), topk, True)
    torch.cuda.synchronize()
    for t in range(3):  # the top-k of a row by a stable sort (faster than naive_select here)
        a, b = int(start[t]), int(end[t])
        order = torch.sort(-sc[t, a:b].double(), stable=True).indices[:topk]
        want = torch.sort(order + a).values.int()
        assert int(ln[t]) == topk and torch.equal(idx[t].cpu(), want), f"row {t}"
        assert torch.equal(lg[t].cpu(), sc[t, want.long()])


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("kind", ["causal", "ranges"])
def test_topk_integer_inputs_exact(fp8, kind, monkeypatch):
    """Integer-valued inputs: the scores are exact, so the sets must be exactly the reference's."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    s_q, s_kv, topk = 333, 1200, 100
    q, k, w, qs, ksc = rand_inputs(s_q, 64, 128, s_kv, seed=7, fp8=fp8, integer=True)
    kst, ken = ranges(s_q, s_kv, kind, seed=2)
    got = mk.indexer_topk(q, k, w, topk, sm_scale=0.5, k_start=kst, k_end=ken, q_scale=qs, k_scale=ksc,
                          return_logits=True)
    torch.cuda.synchronize()
    want = ref.indexer_topk_ref(q, k, w, topk, 0.5, kst, ken, qs, ksc, return_logits=True)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[2], want[2].float())


def assert_topk_close(got_idx, got_len, want_idx, want_len, logits_ref, tol):
    """Equal lengths; the sets may differ only where reference scores tie within ``tol`` of the
    row's threshold (the smallest selected reference score)."""
    assert torch.equal(got_len, want_len)
    assert ((got_idx[:, 1:] > got_idx[:, :-1]) | (got_idx[:, 1:] == -1)).all(), "not ascending"
    diff_rows = (got_idx != want_idx).any(dim=1).nonzero().flatten().tolist()
    for t in diff_rows:
        a = set(got_idx[t][got_idx[t] >= 0].tolist())
        b = set(want_idx[t][want_idx[t] >= 0].tolist())
        thr = min(float(logits_ref[t, j]) for j in b)
        for j in a ^ b:
            assert abs(float(logits_ref[t, j]) - thr) <= tol, f"row {t} key {j}: not a near-tie"
    return len(diff_rows)


@pytest.mark.parametrize("h,d", [(64, 128), (16, 64), (32, 128)])
def test_topk_random_vs_reference(h, d, monkeypatch):
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    s_q, s_kv, topk = 700, 3000, 256
    q, k, w, _, _ = rand_inputs(s_q, h, d, s_kv, seed=h + d)
    idx, ln = mk.indexer_topk(q, k, w, topk, sm_scale=d ** -0.5)
    want_idx, want_len = ref.indexer_topk_ref(q, k, w, topk, d ** -0.5)
    logits = ref.indexer_logits_ref(q, k, w, d ** -0.5)
    n = assert_topk_close(idx, ln, want_idx, want_len, logits, 1e-4)
    assert n <= s_q // 10


def test_topk_blocks_and_poison(monkeypatch):
    """Several workspace blocks (a small budget) give what one block gives; rows past the last
    block and slots past topk_length are all written."""
    from mla_kernels.sm90 import indexer_host

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    s_q, s_kv, topk = 1000, 2500, 128
    q, k, w, _, _ = rand_inputs(s_q, 64, 128, s_kv, seed=11)
    one = mk.indexer_topk(q, k, w, topk, return_logits=True)
    monkeypatch.setattr(indexer_host, "WORKSPACE_BYTES", 100 * s_kv * 4)  # 96-row blocks
    assert indexer_host.block_rows(s_q, s_kv) == 96
    many = mk.indexer_topk(q, k, w, topk, return_logits=True)
    for a, b in zip(one, many):
        assert torch.equal(a, b)
    assert (one[0] != -12345).all() and not torch.isnan(one[2][one[0] >= 0]).any()
    assert torch.isneginf(one[2][one[0] < 0]).all()


@pytest.mark.parametrize("fp8", [False, True])
def test_topk_two_streams_match_one_and_capture(fp8, monkeypatch):
    """Row blocks spread over two streams (MLA_KERNELS_INDEXER_TOPK_STREAMS=2, each stream its own
    half-budget workspace) give the bits of one stream, with key ranges and an empty row; a
    CUDA-graph capture of the two-stream call replays correctly with new inputs."""
    from mla_kernels.sm90 import indexer_host

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    s_q, s_kv, topk = 1000, 2500, 128
    monkeypatch.setattr(indexer_host, "WORKSPACE_BYTES", 200 * s_kv * 4)
    assert indexer_host.block_rows(s_q, s_kv, 2) == 96
    sets = []
    for seed in (21, 22):
        q, k, w, qs, ksc = rand_inputs(s_q, 64, 128, s_kv, seed=seed, fp8=fp8)
        kst, ken = ranges(s_q, s_kv, "ranges", seed=seed)
        sets.append((q, k, w, dict(sm_scale=0.5, k_start=kst, k_end=ken, q_scale=qs, k_scale=ksc,
                                   return_logits=True)))
    want = []
    for q, k, w, kw in sets:
        monkeypatch.setenv(indexer_host.ENV_TOPK_STREAMS, "1")
        one = mk.indexer_topk(q, k, w, topk, **kw)
        monkeypatch.setenv(indexer_host.ENV_TOPK_STREAMS, "2")
        two = mk.indexer_topk(q, k, w, topk, **kw)
        torch.cuda.synchronize()
        for a, b in zip(one, two):
            assert torch.equal(a, b)
        assert (one[0] != -12345).all() and not torch.isnan(one[2][one[0] >= 0]).any()
        want.append(one)
    # capture with the first set's tensors, replay on the second set copied into them
    q, k, w, kw = sets[0]
    static = [q.clone(), k.clone(), w.clone()]
    kw = dict(kw)
    for name in ("k_start", "k_end", "q_scale", "k_scale"):
        if kw[name] is not None:
            kw[name] = kw[name].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mk.indexer_topk(*static, topk, **kw)  # warm-up (compiles) off the default stream
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = mk.indexer_topk(*static, topk, **kw)
    q2, k2, w2, kw2 = sets[1]
    for dst, src in zip(static, (q2, k2, w2)):
        dst.copy_(src)
    for name in ("k_start", "k_end", "q_scale", "k_scale"):
        if kw[name] is not None:
            kw[name].copy_(kw2[name])
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(g_out, want[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["plain", "pad"])
@pytest.mark.parametrize("fp8", [False, True])
def test_topk_fused_histogram_matches_the_row_pass(fp8, mode, monkeypatch):
    """The first-digit histogram counted by the score kernel (h_idx 64, s_kv < 65536), in each of
    its counting modes, selects exactly what the top-k kernel's own pass over the row selects (indices,
    lengths, logits bitwise): random inputs, integer-valued ones (heavy ties: rows whose threshold
    bin holds more than the 4096 candidates), key ranges with an empty row, several workspace
    blocks with a partial last one."""
    from mla_kernels.api_indexer import make_indexer_problem
    from mla_kernels.sm90 import indexer_host

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    for integer, kind, s_q, s_kv, topk in ((False, "causal", 900, 3000, 256), (True, "ranges", 300, 6000, 100),
                                           (False, "ranges", 500, 2900, 1000)):
        monkeypatch.setattr(indexer_host, "WORKSPACE_BYTES", 200 * s_kv * 4)  # 192-row blocks
        q, k, w, qs, ksc = rand_inputs(s_q, 64, 128, s_kv, seed=5 + s_q, fp8=fp8, integer=integer)
        kst, ken = ranges(s_q, s_kv, kind, seed=3)
        p = make_indexer_problem(q, k, w, sm_scale=0.5, k_start=kst, k_end=ken, q_scale=qs, k_scale=ksc)
        monkeypatch.delenv(indexer_host.ENV_TOPK_HIST, raising=False)
        assert indexer_host.topk_hist(p) == indexer_host.HIST_DEFAULT["fp8" if fp8 else "bf16"]
        monkeypatch.setenv(indexer_host.ENV_TOPK_HIST, mode)
        assert indexer_host.topk_hist(p) == mode
        fused = mk.indexer_topk(q, k, w, topk, sm_scale=0.5, k_start=kst, k_end=ken, q_scale=qs, k_scale=ksc,
                                return_logits=True)
        monkeypatch.setenv(indexer_host.ENV_TOPK_HIST, "0")
        plain = mk.indexer_topk(q, k, w, topk, sm_scale=0.5, k_start=kst, k_end=ken, q_scale=qs, k_scale=ksc,
                                return_logits=True)
        torch.cuda.synchronize()
        for a, b in zip(fused, plain):
            assert torch.equal(a, b), (integer, kind)
        if integer:  # exact scores: the reference's sets
            want = ref.indexer_topk_ref(q, k, w, topk, 0.5, kst, ken, qs, ksc)
            assert torch.equal(fused[0], want[0]) and torch.equal(fused[1], want[1])


def test_topk_large_causal_sampled_rows(monkeypatch):
    """S = 32768 causal (4 workspace blocks by default... of 4096 rows: 8 blocks); 256 sampled rows
    against the reference; the extra memory stays within the workspace bound."""
    from mla_kernels.sm90 import indexer_host

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    S, topk = 32768, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    q = (torch.randn(S, 64, 128, device="cuda", generator=g) / 4).bfloat16()
    k = (torch.randn(S, 128, device="cuda", generator=g) / 4).bfloat16()
    w = torch.randn(S, 64, device="cuda", generator=g) / 8
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    idx, ln = mk.indexer_topk(q, k, w, topk, sm_scale=128 ** -0.5)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= indexer_host.WORKSPACE_BYTES + 2 * S * topk * 4 + (64 << 20), f"{extra / 2**20:.0f} MiB"
    rows = torch.cat([torch.arange(0, 8), torch.randint(8, S, (240,), generator=torch.Generator().manual_seed(1))])
    rows = rows.cuda()
    kend = rows.int() + 1
    kst = torch.zeros_like(kend)
    want_idx, want_len = ref.indexer_topk_ref(q[rows], k, w[rows], topk, 128 ** -0.5, kst, kend)
    logits = ref.indexer_logits_ref(q[rows], k, w[rows], 128 ** -0.5, kst, kend)
    assert_topk_close(idx[rows], ln[rows], want_idx, want_len, logits, 1e-4)
    assert (ln == torch.clamp(torch.arange(S, device="cuda") + 1, max=topk)).all()


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8", [False, True])
def test_score_pingpong_matches_side_by_side_bitwise(fp8, monkeypatch):
    """The score kernel's warpgroups taking turns at the tensor core (opt-in,
    MLA_KERNELS_INDEXER_SCORE_PINGPONG=1) change only when each MMA is issued, not what any thread
    computes: logits bitwise equal to the default's on random inputs with ranges (an empty one, a
    query tile with few key tiles), at h_idx 64 and 16; the top-k the same."""
    from mla_kernels.sm90 import indexer_host

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    for s_q, s_kv, h, d, kind in ((300, 1500, 64, 128, "ranges"), (130, 777, 16, 64, "ranges"),
                                  (260, 900, 64, 128, "causal")):
        q, k, w, qs, ksc = rand_inputs(s_q, h, d, s_kv, seed=s_q + 5, fp8=fp8)
        kst, ken = ranges(s_q, s_kv, kind, seed=s_q + 1)
        outs = {}
        for pp in ("0", "1"):
            monkeypatch.setenv(indexer_host.ENV_SCORE_PINGPONG, pp)
            lg = mk.indexer_logits(q, k, w, sm_scale=0.3, k_start=kst, k_end=ken, q_scale=qs, k_scale=ksc)
            ti, tl = mk.indexer_topk(q, k, w, 100, sm_scale=0.3, k_start=kst, k_end=ken, q_scale=qs, k_scale=ksc)
            torch.cuda.synchronize()
            outs[pp] = (lg, ti, tl)
        assert torch.equal(outs["0"][0], outs["1"][0]), f"logits differ ({s_q}, {s_kv}, h {h})"
        assert torch.equal(outs["0"][1], outs["1"][1]) and torch.equal(outs["0"][2], outs["1"][2])
        want = ref.indexer_logits_ref(q, k, w, 0.3, kst, ken, qs, ksc)
        check_logits(outs["1"][0], want, rtol=1e-3 if fp8 else 2e-5)
    monkeypatch.setenv(indexer_host.ENV_SCORE_PINGPONG, "sometimes")
    with pytest.raises(ValueError, match="expected 0 or 1"):
        mk.indexer_logits(q, k, w, sm_scale=0.3, q_scale=qs, k_scale=ksc)


@pytest.mark.parametrize("fp8", [False, True])
def test_score_packed_head_sum(fp8, monkeypatch):
    """MLA_KERNELS_INDEXER_SCORE_HEADSUM=bf16x2 (opt-in): the head sum in packed bf16 -- logits
    within bf16 rounding of the reference (ReLU(S), the weights and the running sums rounded to
    bf16: bounded here by 2^-6 of the row's largest |logit| and |w| sum; the measured error is
    printed), the -inf pattern of the ranges exact, and the top-k a valid selection of the
    packed logits themselves."""
    from mla_kernels.sm90 import indexer_host

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    monkeypatch.setenv(indexer_host.ENV_SCORE_HEADSUM, "bf16x2")
    for s_q, s_kv, h, d, kind in ((300, 1500, 64, 128, "ranges"), (130, 777, 16, 64, "ranges"),
                                  (77, 1000, 32, 128, "causal")):
        q, k, w, qs, ksc = rand_inputs(s_q, h, d, s_kv, seed=s_q + 9, fp8=fp8)
        kst, ken = ranges(s_q, s_kv, kind, seed=s_q + 2)
        got = mk.indexer_logits(q, k, w, sm_scale=0.3, k_start=kst, k_end=ken, q_scale=qs, k_scale=ksc)
        want = ref.indexer_logits_ref(q, k, w, 0.3, kst, ken, qs, ksc).float()
        assert torch.equal(torch.isneginf(got), torch.isneginf(want))
        fin = torch.isfinite(want)
        # scale of the terms: sum_j |w_eff| |q . k| per element (the bf16 roundings are relative to it)
        qf = q.float() * (qs[..., None] if fp8 else 1.0)
        kf = k.float() * (ksc[:, None] if fp8 else 1.0)
        terms = torch.einsum("thd,sd->ts", (w.abs()[..., None] * qf.abs()), kf.abs()) * 0.3
        err = torch.where(fin, (got - want).abs(), torch.zeros_like(got))
        ratio = (err / terms.clamp_min(1e-30))[fin]
        print(f"packed head sum ({'fp8' if fp8 else 'bf16'}, {s_q}x{s_kv} h {h}): |err| / sum|terms| max "
              f"{ratio.max().item():.3g}, median {ratio.median().item():.3g}")
        assert ratio.max().item() <= 2.0 ** -6
        idx, ln = mk.indexer_topk(q, k, w, 50, sm_scale=0.3, k_start=kst, k_end=ken, q_scale=qs, k_scale=ksc)
        for t in range(0, s_q, 7):  # each row: the packed logits' own top 50 (ties to the smaller key)
            row = got[t]
            valid = torch.isfinite(row).nonzero().flatten()
            order = sorted(valid.tolist(), key=lambda i: (-float(row[i]), i))[:50]
            assert int(ln[t]) == len(order)
            assert idx[t, : len(order)].tolist() == sorted(order), f"row {t}"


# The loss
# ---------------------------------------------------------------------------------------------


def loss_case(s_q, s_kv, topk, d=128, seed=0, tl=False):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(s_q, 64, d, generator=g) / 4).bfloat16().cuda()
    k = (torch.randn(s_kv, d, generator=g) / 4).bfloat16().cuda()
    w = (torch.randn(s_q, 64, generator=g) / 8).cuda()
    idx = torch.randint(0, s_kv, (s_q, topk), generator=g)
    bad = torch.rand(s_q, topk, generator=g) < 0.05
    idx = torch.where(bad, torch.randint(-3, 0, (s_q, topk), generator=g), idx)
    idx[0] = -1  # empty row
    if topk > 2:
        idx[1, 1] = idx[1, 0]  # duplicate
    tgt = torch.rand(s_q, topk, generator=g)
    tgt[2 % s_q] = 0.0  # zero target sum
    tgt = tgt * (torch.rand(s_q, topk, generator=g) < 0.8)  # p = 0 slots
    lens = None
    if tl:
        lens = torch.randint(0, topk + 1, (s_q,), generator=g).int().cuda()
    return q, k, w, idx.int().cuda(), tgt.cuda(), lens


@pytest.mark.parametrize("s_q,s_kv,topk,d,tl", [
    (5, 100, 64, 128, False),
    (97, 1000, 200, 128, True),
    (300, 4000, 2048, 128, False),
    (64, 500, 4100, 64, True),
])
def test_loss_forward_vs_reference(s_q, s_kv, topk, d, tl, monkeypatch):
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    q, k, w, idx, tgt, lens = loss_case(s_q, s_kv, topk, d, seed=topk, tl=tl)
    got = mk.indexer_loss(q, k, w, idx, tgt, sm_scale=d ** -0.5, topk_length=lens, reduction="none")
    torch.cuda.synchronize()
    want = ref.indexer_loss_fwd_ref(q, k, w, idx, tgt, d ** -0.5, lens)[0]
    assert got.dtype == torch.float32 and not torch.isnan(got).any()
    assert got[0] == 0 and got[2 % s_q] == 0
    err = (got.double() - want.double()).abs()
    assert (err <= 1e-4 * (1 + want.double().abs())).all(), f"max err {err.max().item():.3g}"


def run_loss_grads(q, k, w, idx, tgt, lens, det, g_rows):
    qq, kk, ww = (x.clone().requires_grad_(True) for x in (q, k, w))
    rows = mk.indexer_loss(qq, kk, ww, idx, tgt, sm_scale=q.shape[-1] ** -0.5, topk_length=lens, reduction="none",
                           deterministic=det)
    (rows * g_rows).sum().backward()
    return qq.grad, kk.grad, ww.grad


def loss_rows_and_det_grads(q, k, w, idx, tgt, lens, g_rows):
    """``(rows, dq, dk, dw)``: the loss rows (no autograd) and the deterministic gradients of
    ``sum(rows * g_rows)`` -- what the bitwise comparisons between kernel settings compare."""
    rows = mk.indexer_loss(q, k, w, idx, tgt, sm_scale=q.shape[-1] ** -0.5, topk_length=lens, reduction="none")
    return (rows,) + tuple(run_loss_grads(q, k, w, idx, tgt, lens, True, g_rows))


@pytest.mark.parametrize("s_q,s_kv,topk,d,tl", [
    (9, 100, 64, 128, False),
    (150, 700, 300, 128, True),
    (400, 3000, 1024, 64, False),
])
@pytest.mark.parametrize("det", [False, True])
def test_loss_backward_vs_reference(s_q, s_kv, topk, d, tl, det, monkeypatch):
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    q, k, w, idx, tgt, lens = loss_case(s_q, s_kv, topk, d, seed=s_q, tl=tl)
    g_rows = torch.randn(s_q, generator=torch.Generator().manual_seed(1)).cuda()
    dq, dk, dw = run_loss_grads(q, k, w, idx, tgt, lens, det, g_rows)
    torch.cuda.synchronize()
    _, lse, inv = ref.indexer_loss_fwd_ref(q.float(), k.float(), w, idx, tgt, d ** -0.5, lens)
    wq, wk, ww = ref.indexer_loss_bwd_ref(q.float(), k.float(), w, idx, tgt, g_rows, lse, inv, d ** -0.5, lens)
    assert dq.dtype == torch.bfloat16 and dk.dtype == torch.bfloat16 and dw.dtype == torch.float32
    for name, a, b in (("dq", dq, wq), ("dk", dk, wk), ("dw", dw, ww)):
        assert not torch.isnan(a).any(), f"NaN in {name}"
        assert rel_l2(a.float(), b) <= 1e-2, f"{name} rel L2 {rel_l2(a.float(), b):.3g}"
    assert (dq[0] == 0).all() and (dw[0] == 0).all() and (dq[2 % s_q] == 0).all()
    used = torch.zeros(s_kv, dtype=torch.bool, device="cuda")
    v = ref.valid_mask(idx, s_kv, lens) & (inv > 0)[:, None]
    used[idx[v].long()] = True
    assert (dk[~used] == 0).all(), "keys no active slot selects must get dk == 0"
    if det:
        again = run_loss_grads(q, k, w, idx, tgt, lens, det, g_rows)
        for a, b in zip((dq, dk, dw), again):
            assert torch.equal(a, b), "deterministic gradients differ run to run"


@pytest.mark.parametrize("d", [128, 64])
def test_loss_backward_dk_bulk(d, monkeypatch):
    """dk added by bulk reduce (rows staged in smem) instead of 16-byte atomics."""
    from mla_kernels.sm90 import indexer_host

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    monkeypatch.setenv(indexer_host.ENV_DK, "bulk")
    q, k, w, idx, tgt, lens = loss_case(150, 700, 300, d, seed=4, tl=True)
    g_rows = torch.randn(150, generator=torch.Generator().manual_seed(2)).cuda()
    dq, dk, dw = run_loss_grads(q, k, w, idx, tgt, lens, False, g_rows)
    torch.cuda.synchronize()
    _, lse, inv = ref.indexer_loss_fwd_ref(q.float(), k.float(), w, idx, tgt, d ** -0.5, lens)
    wq, wk, ww = ref.indexer_loss_bwd_ref(q.float(), k.float(), w, idx, tgt, g_rows, lse, inv, d ** -0.5, lens)
    for name, a, b in (("dq", dq, wq), ("dk", dk, wk), ("dw", dw, ww)):
        assert rel_l2(a.float(), b) <= 1e-2, f"{name} rel L2 {rel_l2(a.float(), b):.3g}"


def test_loss_backward_dk_bf16_atomics(monkeypatch):
    """MLA_KERNELS_INDEXER_DK=red_bf16 (opt-in): dk summed by bf16x2 atomics into a bf16 workspace.
    dq and dw do not depend on the dk mode (bitwise equal to the default's); dk is the same sum
    rounded to bf16 at every addition: near the reference within a bf16 accumulation's error (the
    measured error is printed), keys no active slot selects exactly 0."""
    from mla_kernels.sm90 import indexer_host

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    d, s_q, s_kv = 128, 400, 300  # ~270 selections per key: long bf16 sums
    q, k, w, idx, tgt, lens = loss_case(s_q, s_kv, 256, d, seed=12, tl=True)
    g_rows = torch.randn(s_q, generator=torch.Generator().manual_seed(3)).cuda()
    monkeypatch.setenv(indexer_host.ENV_DK, "red")
    dq0, dk0, dw0 = run_loss_grads(q, k, w, idx, tgt, lens, False, g_rows)
    monkeypatch.setenv(indexer_host.ENV_DK, "red_bf16")
    dq, dk, dw = run_loss_grads(q, k, w, idx, tgt, lens, False, g_rows)
    torch.cuda.synchronize()
    assert torch.equal(dq, dq0) and torch.equal(dw, dw0)
    _, lse, inv = ref.indexer_loss_fwd_ref(q.float(), k.float(), w, idx, tgt, d ** -0.5, lens)
    wq, wk, ww = ref.indexer_loss_bwd_ref(q.float(), k.float(), w, idx, tgt, g_rows, lse, inv, d ** -0.5, lens)
    e_bf16, e_f32 = rel_l2(dk.float(), wk), rel_l2(dk0.float(), wk)
    print(f"dk rel L2 vs the reference: red_bf16 {e_bf16:.3g}, red (float32 atomics) {e_f32:.3g}")
    assert not torch.isnan(dk).any() and e_bf16 <= 5e-2, f"dk rel L2 {e_bf16:.3g}"
    used = torch.zeros(s_kv, dtype=torch.bool, device="cuda")
    v = ref.valid_mask(idx, s_kv, lens) & (inv > 0)[:, None]
    used[idx[v].long()] = True
    assert (dk[~used] == 0).all()


def test_loss_backward_deterministic_modes_agree_bitwise(monkeypatch):
    """Every fixed-point dk mode adds the same integers (the per-slot rows are the same float32
    values, rounded the same way), so their dk agree bitwise -- and with the float32 reference."""
    from mla_kernels.sm90 import indexer_host

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    q, k, w, idx, tgt, lens = loss_case(150, 700, 300, 128, seed=6, tl=True)
    g_rows = torch.randn(150, generator=torch.Generator().manual_seed(3)).cuda()
    got = {}
    for mode in indexer_host.DET_MODES:
        monkeypatch.setenv(indexer_host.ENV_DET, mode)
        got[mode] = run_loss_grads(q, k, w, idx, tgt, lens, True, g_rows)
    torch.cuda.synchronize()
    _, lse, inv = ref.indexer_loss_fwd_ref(q.float(), k.float(), w, idx, tgt, 128 ** -0.5, lens)
    wq, wk, ww = ref.indexer_loss_bwd_ref(q.float(), k.float(), w, idx, tgt, g_rows, lse, inv, 128 ** -0.5, lens)
    for mode, (dq, dk, dw) in got.items():
        for name, a, b in (("dq", dq, wq), ("dk", dk, wk), ("dw", dw, ww)):
            assert rel_l2(a.float(), b) <= 1e-2, f"{mode}: {name} rel L2 {rel_l2(a.float(), b):.3g}"
    for mode in indexer_host.DET_MODES:
        if mode.startswith("fixed"):
            assert torch.equal(got[mode][1], got["fixed_bulk"][1]), f"{mode} dk differs from fixed_bulk's"
            assert torch.equal(got[mode][0], got["fixed_bulk"][0]) and torch.equal(got[mode][2], got["fixed_bulk"][2])


@pytest.mark.parametrize("d,tl,s_kv", [(128, True, 700), (64, False, 40000)])
def test_loss_backward_grouped_dk_is_bitwise_stable_across_waves(d, tl, s_kv, monkeypatch):
    """The ``grouped`` deterministic dk (bf16 per-slot rows grouped by key, summed as fixed-point
    integers): bitwise the same on every run and for any wave size of the workspace (integer sums:
    neither the atomic placement's order nor the split into waves changes a bit), near the
    reference and the float32 atomics' dk (one bf16 rounding per slot row), dq and dw bitwise
    those of the other deterministic modes (the kernel's dk path does not touch them); invalid and
    duplicate slots, topk_length, an empty row, a zero target sum and keys nobody selects; one
    key tile of the grouping's shared counters and three (s_kv 40000)."""
    from mla_kernels.sm90 import indexer_host

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    s_q, topk = 150, 300
    q, k, w, idx, tgt, lens = loss_case(s_q, s_kv, topk, d, seed=13, tl=tl)
    idx[5, :] = torch.where(idx[5] >= 0, idx[5] % 7, idx[5])  # many duplicates in one row
    idx[6, 40:] = s_kv + 3  # out of range
    g_rows = torch.randn(s_q, generator=torch.Generator().manual_seed(5)).cuda()
    monkeypatch.setenv(indexer_host.ENV_DET, "grouped")
    got = {}
    for mib in ("", "1", "3"):  # one wave; ~12 and ~4 waves of queries
        monkeypatch.setenv(indexer_host.ENV_DET_WS, mib)
        got[mib] = [run_loss_grads(q, k, w, idx, tgt, lens, True, g_rows) for _ in range(2)]
    monkeypatch.setenv(indexer_host.ENV_DET, "fixed_bulk64")
    fixed = run_loss_grads(q, k, w, idx, tgt, lens, True, g_rows)
    atomic = run_loss_grads(q, k, w, idx, tgt, lens, False, g_rows)
    torch.cuda.synchronize()
    base = got[""][0]
    for mib, runs in got.items():
        for run in runs:
            for name, a, b in zip(("dq", "dk", "dw"), run, base):
                assert torch.equal(a, b), f"{name} differs (workspace {mib or 'default'} MiB)"
    assert torch.equal(base[0], fixed[0]) and torch.equal(base[2], fixed[2])
    _, lse, inv = ref.indexer_loss_fwd_ref(q.float(), k.float(), w, idx, tgt, d ** -0.5, lens)
    wq, wk, ww = ref.indexer_loss_bwd_ref(q.float(), k.float(), w, idx, tgt, g_rows, lse, inv, d ** -0.5, lens)
    dk = base[1]
    assert not torch.isnan(dk).any()
    e_ref, e_atomic = rel_l2(dk.float(), wk), rel_l2(dk.float(), atomic[1].float())
    print(f"grouped dk rel L2: vs the reference {e_ref:.3g}, vs the float32 atomics {e_atomic:.3g}")
    assert e_ref <= 1e-2 and e_atomic <= 4e-3
    used = torch.zeros(s_kv, dtype=torch.bool, device="cuda")
    v = ref.valid_mask(idx, s_kv, lens) & (inv > 0)[:, None]
    used[idx[v].long()] = True
    assert (dk[~used] == 0).all(), "keys no active slot selects must get dk == 0"


@pytest.mark.parametrize("d,tl", [(128, True), (64, False)])
def test_loss_prefetch_matches_the_first_version(d, tl, monkeypatch):
    """The loss kernels' one-block-ahead loads (indices for the gather and the logits, targets)
    change when values arrive, not what is computed: the loss rows and the deterministic
    gradients are bitwise those of MLA_KERNELS_INDEXER_LOSS_PREFETCH=0 (with key-index padding,
    invalid and duplicate slots, topk_length, an empty row)."""
    from mla_kernels.sm90 import indexer_host

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    q, k, w, idx, tgt, lens = loss_case(150, 700, 300, d, seed=9, tl=tl)
    g_rows = torch.randn(150, generator=torch.Generator().manual_seed(5)).cuda()
    out = {}
    for pf in ("1", "0"):
        monkeypatch.setenv(indexer_host.ENV_LOSS_PREFETCH, pf)
        out[pf] = loss_rows_and_det_grads(q, k, w, idx, tgt, lens, g_rows)
    torch.cuda.synchronize()
    for a, b in zip(out["1"], out["0"]):
        assert torch.equal(a, b)
    want = ref.indexer_loss_fwd_ref(q.float(), k.float(), w, idx, tgt, d ** -0.5, lens)[0]
    assert rel_l2(out["1"][0].float(), want) <= 1e-3


@pytest.mark.parametrize("d,tl,topk,pf,var", [(128, True, 300, "1", "smem"), (64, False, 300, "1", "raw"),
                                             (64, True, 4100, "1", "smem"), (128, True, 300, "0", "smem"),
                                             (128, True, 300, "1", "raw")])
def test_loss_forward_rotated_blocks_bitwise(d, tl, topk, pf, var, monkeypatch):
    """MLA_KERNELS_INDEXER_LOSS_ROTATE=1 (each query visits its slot blocks from block
    ``t mod n``) with the forward variants that keep the row's logits in smem (``smem``, ``raw``):
    the logits land in the same slots and every reduction runs after the blocks, so the loss rows
    and (through lse and 1/tsum) the deterministic gradients are bitwise those of the ascending
    visit -- partial last blocks, topk_length, invalid / duplicate slots, an empty row, with and
    without the one-block-ahead loads.  (The ``online`` variants sum in visiting order:
    test_loss_forward_variants.)"""
    from mla_kernels.sm90 import indexer_host

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    monkeypatch.setenv(indexer_host.ENV_LOSS_PREFETCH, pf)
    monkeypatch.setenv(indexer_host.ENV_LOSS_FWD, var)
    s_q = 150 if topk < 1000 else 64
    q, k, w, idx, tgt, lens = loss_case(s_q, 700, topk, d, seed=19, tl=tl)
    g_rows = torch.randn(s_q, generator=torch.Generator().manual_seed(6)).cuda()
    out = {}
    for rot in ("1", "0"):
        monkeypatch.setenv(indexer_host.ENV_LOSS_ROTATE, rot)
        out[rot] = loss_rows_and_det_grads(q, k, w, idx, tgt, lens, g_rows)
    torch.cuda.synchronize()
    for a, b in zip(out["1"], out["0"]):
        assert torch.equal(a, b)
    want = ref.indexer_loss_fwd_ref(q.float(), k.float(), w, idx, tgt, d ** -0.5, lens)[0]
    assert rel_l2(out["1"][0].float(), want) <= 1e-3


@pytest.mark.parametrize("s_q,s_kv,topk,d,tl", [(150, 700, 300, 128, True), (64, 500, 4100, 64, True),
                                              (97, 1000, 200, 128, False)])
def test_loss_forward_variants(s_q, s_kv, topk, d, tl, monkeypatch):
    """Every loss forward variant (MLA_KERNELS_INDEXER_LOSS_FWD) against the float64 reference
    (loss rows, and lse / 1/tsum through the deterministic gradients): ``raw`` (deferred index
    use) bitwise ``smem``; ``online`` / ``online4`` (softmax and KL sums in the block loop) within
    float32 rounding of ``smem``, rotated or not; invalid / duplicate slots, an empty row, a zero
    target sum, topk_length, topk beyond 4096."""
    from mla_kernels.sm90 import indexer_host

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    q, k, w, idx, tgt, lens = loss_case(s_q, s_kv, topk, d, seed=23, tl=tl)
    g_rows = torch.randn(s_q, generator=torch.Generator().manual_seed(7)).cuda()
    want = ref.indexer_loss_fwd_ref(q.double(), k.double(), w.double(), idx, tgt.double(), d ** -0.5, lens)[0]
    out = {}
    for var in indexer_host.LOSS_FWD_VARIANTS:
        for rot in ("1", "0"):
            monkeypatch.setenv(indexer_host.ENV_LOSS_FWD, var)
            monkeypatch.setenv(indexer_host.ENV_LOSS_ROTATE, rot)
            out[var, rot] = loss_rows_and_det_grads(q, k, w, idx, tgt, lens, g_rows)
    torch.cuda.synchronize()
    for rot in ("1", "0"):
        for a, b in zip(out["raw", rot], out["smem", rot]):
            assert torch.equal(a, b), "raw must be bitwise smem"
    for key, (rows, dq, dk, dw) in out.items():
        assert not torch.isnan(rows).any() and rows[0] == 0 and rows[2 % s_q] == 0, key
        err = (rows.double() - want).abs()
        assert (err <= 1e-4 * (1 + want.abs())).all(), f"{key}: max err {err.max().item():.3g}"
        base = out["smem", "0"]
        assert (rows - base[0]).abs().max().item() <= 1e-5 * (1 + base[0].abs().max().item()), key
        for a, b in zip((dq, dk, dw), base[1:]):
            assert rel_l2(a.float(), b.float()) <= 1e-3, key  # lse and 1/tsum agree to rounding


@pytest.mark.parametrize("mag", [2.0 ** -30, 2.0 ** 24])
def test_loss_backward_fixed_point_dk_far_from_one(mag, monkeypatch):
    """The fixed-point scale follows the gradients' magnitude (tiny or huge weights): the
    deterministic dk equals the float-atomic one (same per-slot rows, summed another way) to
    bf16 rounding, nothing overflows or flushes to zero.  (Against the float64 reference only
    at the small magnitude: with logits ~2^24 the softmax is so peaked that float32 logits alone
    move pi by percents.)"""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    q, k, w, idx, tgt, lens = loss_case(120, 900, 256, 64, seed=8, tl=False)
    w = w * mag
    g_rows = torch.rand(120, generator=torch.Generator().manual_seed(4)).cuda() + 0.5
    _, dk, _ = run_loss_grads(q, k, w, idx, tgt, lens, True, g_rows)
    _, dk_atomic, _ = run_loss_grads(q, k, w, idx, tgt, lens, False, g_rows)
    torch.cuda.synchronize()
    assert torch.isfinite(dk).all() and dk.abs().sum() > 0
    assert rel_l2(dk.float(), dk_atomic.float()) <= 4e-3, f"det vs atomic rel L2 {rel_l2(dk.float(), dk_atomic.float()):.3g}"
    if mag < 1:
        _, lse, inv = ref.indexer_loss_fwd_ref(q.double(), k.double(), w.double(), idx, tgt, 64 ** -0.5, lens)
        _, wk, _ = ref.indexer_loss_bwd_ref(q.double(), k.double(), w.double(), idx, tgt, g_rows.double(), lse, inv,
                                            64 ** -0.5, lens)
        assert rel_l2(dk.double(), wk) <= 1e-2, f"dk rel L2 {rel_l2(dk.double(), wk):.3g}"


def test_loss_headline_shape_fwd_bwd(monkeypatch):
    """S = 8192 causal with the kernel's own top-k and the attention-like target."""
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    S, topk = 8192, 2048
    g = torch.Generator(device="cuda").manual_seed(5)
    q = (torch.randn(S, 64, 128, device="cuda", generator=g) / 4).bfloat16()
    k = (torch.randn(S, 128, device="cuda", generator=g) / 4).bfloat16()
    w = torch.randn(S, 64, device="cuda", generator=g) / 8
    idx, ln = mk.indexer_topk(q, k, w, topk, sm_scale=128 ** -0.5)
    tgt = torch.rand(S, topk, device="cuda", generator=g) * (idx >= 0)
    g_rows = torch.ones(S, device="cuda") / S
    dq, dk, dw = run_loss_grads(q, k, w, idx, tgt, ln, False, g_rows)
    rows = torch.arange(0, S, 37, device="cuda")
    _, lse, inv = ref.indexer_loss_fwd_ref(q[rows], k, w[rows], idx[rows], tgt[rows], 128 ** -0.5, ln[rows])
    wq, _, ww = ref.indexer_loss_bwd_ref(q[rows], k, w[rows], idx[rows], tgt[rows], g_rows[rows], lse, inv,
                                         128 ** -0.5, ln[rows])
    assert rel_l2(dq[rows].float(), wq.float()) <= 1e-2
    assert rel_l2(dw[rows].float(), ww.float()) <= 1e-2
    assert not torch.isnan(dk).any() and dk.abs().sum() > 0
