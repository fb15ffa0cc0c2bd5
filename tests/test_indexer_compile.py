"""The sm90 indexer kernels compile for sm_90a without a GPU (CuTe DSL -> PTX -> cubin -> SASS)
with the instructions they were written for and no spills; the host side's support answers and
workspace sizing (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import compile_report_module

SMEM_LIMIT = 232448


@pytest.fixture(scope="module")
def report():
    cr = compile_report_module()
    only = {"sm90_indexer_score_bf16_h64_d128", "sm90_indexer_score_fp8_h64_d128", "sm90_indexer_topk_logits",
            "sm90_indexer_loss_fwd_d128", "sm90_indexer_loss_bwd_d128", "sm90_indexer_loss_bwd_d128_det_topklen",
            "sm90_indexer_score_bf16_h64_d128_hist", "sm90_indexer_topk_hist", "sm90_indexer_loss_fwd_d128_rotate",
            "sm90_indexer_loss_bwd_d128_rows_bf16", "key_groups_count", "key_groups_place_topklen",
            "fixed_segment_sum_d128"}
    return {r["name"]: r for r in cr.run("sm_90a", only=only, quiet=True)}


def _common(r):
    assert r["arch"] == "sm_90a" and r["spill_bytes"] == 0
    if r["sass"] is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    assert r["sass_base"].get("LDL", 0) == 0 and r["sass_base"].get("STL", 0) == 0
    return r["sass"], r["sass_base"]


@pytest.mark.compile
def test_score_kernels_use_wgmma_and_tma(report):
    sass, base = _common(report["sm90_indexer_score_bf16_h64_d128"])
    assert 0 < report["sm90_indexer_score_bf16_h64_d128"]["smem_bytes"] <= SMEM_LIMIT
    assert sass.get("HGMMA.64x256x16.F32.BF16", 0) == 8  # d 128 = 8 k-steps, keys on M, (query, head) on N
    assert base.get("UTMALDG", 0) >= 2
    sass, base = _common(report["sm90_indexer_score_fp8_h64_d128"])
    assert sass.get("QGMMA.64x256x32.F32.E4M3.E4M3", 0) == 4  # fp8: QGMMA, 4 k-steps of 32


@pytest.mark.compile
def test_score_kernel_options_pingpong_and_packed_head_sum(report):
    """Two opt-ins of the fp8 score kernel (one compile each).  ``pingpong``: each consumer
    warpgroup syncs its own named barrier (id 3 + wg: one ``BAR.SYNC`` site, id in a register)
    before issuing its MMAs and arrives on the other's after committing them (one ``BAR.ARV``
    site, id in a register), WG1 once more before its loop (id 3, an immediate), 256 threads each;
    the default kernels have none of these.  ``head_sum="bf16x2"``: per tile 64 packed ReLUs
    (``F2FP.RELU``, two scores each) and 64 bf16x2 multiply-adds instead of 128 ``FMNMX`` + 128
    ``FFMA``; no spills."""
    from mla_kernels.sm90.indexer_score import compile_score

    cr = compile_report_module()
    nvd = cr.find_nvdisasm()
    for name in ("sm90_indexer_score_bf16_h64_d128", "sm90_indexer_score_fp8_h64_d128"):
        if report[name]["barriers"] is not None:
            assert {st["id"] for st in report[name]["barriers"]} <= {0, 1}, "ping-pong barriers in a default kernel"
    r = cr.report_one("pp", lambda a, **kw: compile_score(True, 64, 128, a, pingpong=True, **kw), "sm_90a", nvd)
    rp = cr.report_one("packed", lambda a, **kw: compile_score(True, 64, 128, a, head_sum="bf16x2", **kw),
                       "sm_90a", nvd)
    sass, base = _common(rp)
    assert sass.get("F2FP.RELU.BF16.F32.PACK_AB", 0) == 64 and base.get("FMNMX", 0) == 0
    assert base.get("HFMA2", 0) + base.get("HMUL2", 0) == 64 and base.get("FFMA", 0) == 0
    assert sass.get("QGMMA.64x256x32.F32.E4M3.E4M3", 0) == 4
    _common(r)
    sites = [st for st in r["barriers"] if st["id"] not in (0, 1)]  # 0: the pipeline's init, 1: weights
    got = sorted((st["op"], -1 if st["id"] is None else st["id"], st["threads"]) for st in sites)
    assert got == sorted([("SYNC", -1, 256), ("ARV", -1, 256), ("ARV", 3, 256)]), sites
    assert cr.bar_sync_repeats(r["barriers"], dynamic_ids=(3, 4)) == {}


@pytest.mark.compile
def test_score_kernel_with_the_fused_histogram(report):
    """``hist`` (its default mode, ``pad``): per key tile two shared atomics per thread (one per
    score it writes), the histograms' two stores; bf16 d 128 fits with 4 key stages; no spills."""
    r = report["sm90_indexer_score_bf16_h64_d128_hist"]
    sass, base = _common(r)
    assert 0 < r["smem_bytes"] <= SMEM_LIMIT
    assert sass.get("HGMMA.64x256x16.F32.BF16", 0) == 8
    assert sass.get("ATOMS.ADD", 0) == 2 and sass.get("MATCH.ANY", 0) == 0
    assert base.get("STG", 0) == _common(report["sm90_indexer_score_bf16_h64_d128"])[1].get("STG", 0) + 2
    sass, base = _common(report["sm90_indexer_topk_hist"])
    assert base.get("HGMMA", 0) == 0


def test_fused_histogram_settings(monkeypatch):
    """Where ``indexer_topk`` fuses the first histogram into the score kernel: h_idx 64 and
    ``s_kv < 65536`` (16-bit counters), unless MLA_KERNELS_INDEXER_TOPK_HIST=0."""
    from types import SimpleNamespace as NS

    from mla_kernels.sm90 import indexer_host
    from mla_kernels.sm90.indexer_score import IndexerScoreSm90

    monkeypatch.delenv(indexer_host.ENV_TOPK_HIST, raising=False)
    for fp8, dt in ((False, "bf16"), (True, "fp8")):
        assert indexer_host.topk_hist(NS(h=64, s_kv=65535, is_fp8=fp8)) == indexer_host.HIST_DEFAULT[dt]
        assert indexer_host.topk_hist(NS(h=64, s_kv=65536, is_fp8=fp8)) == ""
        assert indexer_host.topk_hist(NS(h=32, s_kv=1000, is_fp8=fp8)) == ""
        assert indexer_host.topk_hist(NS(h=16, s_kv=1000, is_fp8=fp8)) == ""
    for mode in indexer_host.HIST_MODES:
        monkeypatch.setenv(indexer_host.ENV_TOPK_HIST, mode)
        assert indexer_host.topk_hist(NS(h=64, s_kv=1000, is_fp8=False)) == mode
        assert indexer_host.topk_hist(NS(h=32, s_kv=1000, is_fp8=False)) == ""
    monkeypatch.setenv(indexer_host.ENV_TOPK_HIST, "0")
    assert indexer_host.topk_hist(NS(h=64, s_kv=1000, is_fp8=True)) == ""
    monkeypatch.setenv(indexer_host.ENV_TOPK_HIST, "sometimes")
    with pytest.raises(ValueError, match="plain, pad"):
        indexer_host.topk_hist(NS(h=64, s_kv=1000, is_fp8=True))
    with pytest.raises(ValueError, match="h_idx 64"):
        IndexerScoreSm90(False, 32, 128, hist=True)
    with pytest.raises(ValueError, match="expected one of"):
        IndexerScoreSm90(False, 64, 128, hist="sometimes")
    from mla_kernels.sm90 import indexer_score

    assert indexer_score.HIST_MODES == indexer_host.HIST_MODES and indexer_score.BINS == indexer_host.HIST_BINS
    assert IndexerScoreSm90(False, 64, 128, hist=True).stages == 4  # bf16 d 128: the histograms take a stage
    assert IndexerScoreSm90(True, 64, 128, hist=True).stages == IndexerScoreSm90(True, 64, 128).stages == 8
    assert not IndexerScoreSm90(False, 64, 128, profile="mma", hist=True).hist  # timing copies: never


@pytest.mark.compile
def test_topk_kernel_is_plain_simt(report):
    sass, base = _common(report["sm90_indexer_topk_logits"])
    assert base.get("ATOMS", 0) > 0 and base.get("HGMMA", 0) == 0


@pytest.mark.compile
def test_loss_kernels(report):
    # the forward's default variant (online4): the block loop unrolled by two (8 k-steps per block),
    # no logits row in smem, 2 key stages (49 KB: four CTAs per SM)
    for name in ("sm90_indexer_loss_fwd_d128", "sm90_indexer_loss_fwd_d128_rotate"):  # rotated: same MMAs
        sass, base = _common(report[name])
        assert sass.get("HGMMA.64x64x16.F32.BF16", 0) == 16 and base.get("LDGSTS", 0) > 0
        assert report[name]["smem_bytes"] <= 49 * 1024
    sass, base = _common(report["sm90_indexer_loss_bwd_d128"])
    # S^T (8 k-steps) + dK (2 chunks x 4) on 64x64; dq on 64x128 (4 k-steps); dK by 16-byte atomics
    assert sass.get("HGMMA.64x64x16.F32.BF16", 0) == 16 and sass.get("HGMMA.64x128x16.F32.BF16", 0) == 4
    assert sass.get("REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU", 0) == 16
    assert base.get("STSM", 0) > 0
    # deterministic (fixed_bulk64): dk rounded to int64 (64 per thread per block) and added by
    # one 64-column bulk integer reduction per chunk (2 chunks), no float atomics
    sass, base = _common(report["sm90_indexer_loss_bwd_d128_det_topklen"])
    assert sass.get("F2I.S64", 0) == 64 and sass.get("UBLKRED.G.S.ADD.U64", 0) == 2
    assert sass.get("REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU", 0) == 0
    assert report["sm90_indexer_loss_bwd_d128_det_topklen"]["smem_bytes"] <= 113 * 1024  # two CTAs per SM


@pytest.mark.compile
def test_grouped_deterministic_dk_kernels(report):
    """The ``grouped`` deterministic dk (the default deterministic mode): the loss backward stores each valid slot's dK
    row as bf16 (8-byte stores, 8 per thread per 64-column chunk: 16 per block), no atomics; the
    key grouping counts and places with shared-memory atomics only (no global atomics); the
    fixed-point segment sum reads 16-byte bf16 pieces and rounds each value to int64
    (8 per piece, 4 pieces in flight)."""
    sass, base = _common(report["sm90_indexer_loss_bwd_d128_rows_bf16"])
    assert sass.get("STG.E.64", 0) == 16 and base.get("REDG", 0) == 0 and base.get("ATOMG", 0) == 0
    assert report["sm90_indexer_loss_bwd_d128_rows_bf16"]["smem_bytes"] <= 113 * 1024  # two CTAs per SM
    for name in ("key_groups_count", "key_groups_place_topklen"):  # shared counters only
        sass, base = _common(report[name])
        assert base.get("ATOMS", 0) > 0 and base.get("ATOMG", 0) == 0 and base.get("REDG", 0) == 0
    sass, _ = _common(report["fixed_segment_sum_d128"])
    assert sass.get("F2I.S64", 0) == 32 and sass.get("LDG.E.128", 0) == 4


def test_sm90_indexer_support_answers():
    from mla_kernels.api_indexer import make_indexer_loss_problem, make_indexer_problem
    from mla_kernels.sm90 import indexer_host

    def prob(h=64, d=128, dtype=torch.bfloat16):
        q = torch.randn(4, h, d).to(dtype)
        k = torch.randn(10, d).to(dtype)
        sc = dict(q_scale=torch.ones(4, h), k_scale=torch.ones(10)) if dtype == torch.float8_e4m3fn else {}
        return make_indexer_problem(q, k, torch.randn(4, h), **sc)

    assert indexer_host.supports("indexer_topk", prob()) is None
    assert indexer_host.supports("indexer_topk", prob(16, 64)) is None
    assert indexer_host.supports("indexer_logits", prob(dtype=torch.float8_e4m3fn)) is None
    assert "h_idx=8" in indexer_host.supports("indexer_topk", prob(8))
    assert "d_idx=96" in indexer_host.supports("indexer_topk", prob(64, 96))
    assert "dtype" in indexer_host.supports("indexer_topk", prob(dtype=torch.float32))

    def lprob(h=64, d=128, topk=2048, dtype=torch.bfloat16):
        return make_indexer_loss_problem(torch.randn(4, h, d).to(dtype), torch.randn(10, d).to(dtype),
                                         torch.randn(4, h), torch.zeros(4, topk, dtype=torch.int32),
                                         torch.rand(4, topk))

    assert indexer_host.supports("indexer_loss_bwd", lprob()) is None
    assert "h_idx=32" in indexer_host.supports("indexer_loss_fwd", lprob(h=32))
    assert "topk=9000" in indexer_host.supports("indexer_loss_fwd", lprob(topk=9000))
    assert "dtype" in indexer_host.supports("indexer_loss_fwd", lprob(dtype=torch.float32))


def test_loss_and_sum_settings(monkeypatch):
    """The environment settings of the indexer kernels' variants: validated, default = the
    kernels' own defaults."""
    from mla_kernels.common import indexer_device
    from mla_kernels.sm90 import indexer_host

    monkeypatch.delenv(indexer_host.ENV_SUM_PARTS, raising=False)
    assert indexer_host.sum_parts() == indexer_device.SUM_PARTS == 1
    for v in ("1", "2", "4", "8"):
        monkeypatch.setenv(indexer_host.ENV_SUM_PARTS, v)
        assert indexer_host.sum_parts() == int(v)
    monkeypatch.setenv(indexer_host.ENV_SUM_PARTS, "3")
    with pytest.raises(ValueError, match="1, 2, 4 or 8"):
        indexer_host.sum_parts()
    monkeypatch.delenv(indexer_host.ENV_LOSS_PREFETCH, raising=False)
    assert indexer_host._loss_prefetch() is True
    monkeypatch.setenv(indexer_host.ENV_LOSS_PREFETCH, "0")
    assert indexer_host._loss_prefetch() is False
    monkeypatch.delenv(indexer_host.ENV_LOSS_FWD, raising=False)
    assert indexer_host.loss_fwd_variant() == indexer_host.LOSS_FWD_DEFAULT == "online4"
    from mla_kernels.sm90.indexer_loss_fwd import VARIANTS, IndexerLossFwdSm90

    assert set(indexer_host.LOSS_FWD_VARIANTS) == set(VARIANTS)
    for v in VARIANTS:
        monkeypatch.setenv(indexer_host.ENV_LOSS_FWD, v.upper())
        assert indexer_host.loss_fwd_variant() == v
    monkeypatch.setenv(indexer_host.ENV_LOSS_FWD, "fast")
    with pytest.raises(ValueError, match="expected one of online4, online, raw, smem"):
        indexer_host.loss_fwd_variant()
    with pytest.raises(ValueError, match="expected one of"):
        IndexerLossFwdSm90(128, False, variant="fast")
    monkeypatch.delenv(indexer_host.ENV_LOSS_ROTATE, raising=False)
    assert indexer_host._loss_rotate() is True  # on since measured (docs/PERF.md)
    monkeypatch.setenv(indexer_host.ENV_LOSS_ROTATE, "0")
    assert indexer_host._loss_rotate() is False
    monkeypatch.setenv(indexer_host.ENV_LOSS_ROTATE, "yes")
    with pytest.raises(ValueError, match="0 or 1"):
        indexer_host._loss_rotate()
    monkeypatch.delenv(indexer_host.ENV_SCORE_PINGPONG, raising=False)
    assert indexer_host.score_pingpong() is False  # measured no faster (docs/PERF.md): opt-in
    monkeypatch.setenv(indexer_host.ENV_SCORE_PINGPONG, "1")
    assert indexer_host.score_pingpong() is True
    monkeypatch.delenv(indexer_host.ENV_SCORE_HEADSUM, raising=False)
    assert indexer_host.score_head_sum() == "f32"
    monkeypatch.setenv(indexer_host.ENV_SCORE_HEADSUM, "BF16x2")
    assert indexer_host.score_head_sum() == "bf16x2"
    monkeypatch.setenv(indexer_host.ENV_SCORE_HEADSUM, "fp16")
    with pytest.raises(ValueError, match="f32 or bf16x2"):
        indexer_host.score_head_sum()
    from mla_kernels.sm90.indexer_score import IndexerScoreSm90

    with pytest.raises(ValueError, match="expected one of"):
        IndexerScoreSm90(True, 64, 128, head_sum="f16")
    with pytest.raises(ValueError, match="registers"):
        IndexerScoreSm90(True, 64, 128, w_regs=False, head_sum="bf16x2")
    monkeypatch.setenv(indexer_host.ENV_SCORE_PINGPONG, "on")
    with pytest.raises(ValueError, match="expected 0 or 1"):
        indexer_host.score_pingpong()
    monkeypatch.delenv(indexer_host.ENV_DK, raising=False)
    assert indexer_host.dk_mode(False) == "red"
    monkeypatch.setenv(indexer_host.ENV_DK, "red_bf16")
    assert indexer_host.dk_mode(False) == "red_bf16"
    monkeypatch.delenv(indexer_host.ENV_DET, raising=False)
    assert indexer_host.dk_mode(True) == "grouped"  # deterministic: its own setting, grouped by default
    monkeypatch.setenv(indexer_host.ENV_DK, "bf16")
    with pytest.raises(ValueError, match="red, red_bf16, bulk or none"):
        indexer_host.dk_mode(False)
    monkeypatch.setenv(indexer_host.ENV_DET, "fixed_bulk64")
    assert indexer_host.dk_mode(True) == "fixed_bulk64"
    monkeypatch.setenv(indexer_host.ENV_DET, "sorted")
    with pytest.raises(ValueError, match="expected one of grouped, fixed_bulk64"):
        indexer_host.dk_mode(True)
    monkeypatch.delenv(indexer_host.ENV_DET_WS, raising=False)
    # the attention backward's deterministic workspace bound, one source
    from mla_kernels.common.bwd_host import DET_WORKSPACE_BYTES

    assert indexer_host.grouped_workspace_bytes() == indexer_host.GROUPED_WORKSPACE_BYTES == DET_WORKSPACE_BYTES
    monkeypatch.setenv(indexer_host.ENV_DET_WS, "64")
    assert indexer_host.grouped_workspace_bytes() == 64 << 20
    for bad in ("0", "-5", "1.5", "lots"):
        monkeypatch.setenv(indexer_host.ENV_DET_WS, bad)
        with pytest.raises(ValueError, match="positive number of MiB"):
            indexer_host.grouped_workspace_bytes()
    from mla_kernels.common.key_groups import KeyGroups

    with pytest.raises(ValueError, match="chunk must be >= 1"):
        KeyGroups(True, False, 0)


def test_topk_workspace_rows():
    from mla_kernels.sm90 import indexer_host

    for s_q, s_kv in ((32768, 32768), (65536, 65536), (131072, 131072), (100, 5), (7, 10**9)):
        rows = indexer_host.block_rows(s_q, s_kv)
        assert rows % 32 == 0 and rows >= 32
        assert rows * s_kv * 4 <= indexer_host.WORKSPACE_BYTES or rows == 32
        assert rows <= -(-s_q // 32) * 32
    assert indexer_host.block_rows(32768, 32768) == 4096
    # two streams: two workspaces within the same budget
    for s_q, s_kv in ((32768, 32768), (65536, 65536), (100, 5)):
        rows = indexer_host.block_rows(s_q, s_kv, 2)
        assert rows % 32 == 0 and (2 * rows * s_kv * 4 <= indexer_host.WORKSPACE_BYTES or rows == 32)
    assert indexer_host.block_rows(32768, 32768, 2) == 2048


def test_topk_streams_setting(monkeypatch):
    from mla_kernels.sm90 import indexer_host

    monkeypatch.delenv(indexer_host.ENV_TOPK_STREAMS, raising=False)
    assert indexer_host.topk_streams() == indexer_host.TOPK_STREAMS_DEFAULT == 2
    for v in ("1", "2", " 1 "):
        monkeypatch.setenv(indexer_host.ENV_TOPK_STREAMS, v)
        assert indexer_host.topk_streams() == int(v)
    for v in ("0", "3", "two"):
        monkeypatch.setenv(indexer_host.ENV_TOPK_STREAMS, v)
        with pytest.raises(ValueError, match="MLA_KERNELS_INDEXER_TOPK_STREAMS"):
            indexer_host.topk_streams()


def test_fixed_point_scale_bounds_every_partial_sum():
    """The deterministic loss backward's fixed-point scale (CPU, the host function itself): a power
    of two, every per-key sum of |per-slot dK rows| (dI anywhere in [-|g|, |g|]) stays below 2^62
    after scaling, integer sums do not depend on the order, and they dequantise to the float64 sum
    within half a unit per addition."""
    from mla_kernels.sm90.indexer_host import fixed_point_scale

    g = torch.Generator().manual_seed(0)
    s_q, h, d, s_kv, topk = 40, 64, 32, 50, 24
    q = (torch.randn(s_q, h, d, generator=g) * 3).bfloat16()
    w_eff = torch.randn(s_q, h, generator=g) * 0.2
    grad = torch.randn(s_q, generator=g)
    scale = fixed_point_scale(q, w_eff, grad)
    assert scale.shape == (1,) and scale.dtype == torch.float32
    e = math.log2(scale.item())
    assert e == int(e), "the scale must be a power of two (x * scale exact)"
    idx = torch.randint(0, s_kv, (s_q, topk), generator=g)
    d_i = (torch.rand(s_q, topk, generator=g) * 2 - 1) * grad[:, None]  # |dI| <= |g|
    mask = torch.rand(s_q, topk, h, generator=g) < 0.5  # ReLU' of S^T
    ds = (d_i[:, :, None] * w_eff[:, None, :] * mask).bfloat16().double()  # [s_q, topk, h] as the kernel
    rows = torch.einsum("tih,thc->tic", ds, q.double()).reshape(-1, d)  # per-slot dK rows
    keys = idx.reshape(-1)
    abs_sum = torch.zeros(s_kv, d, dtype=torch.float64).index_add_(0, keys, rows.abs())
    assert (abs_sum * scale.double()).max().item() <= 2.0 ** 62
    # the bound is not loose beyond reason: the scale keeps > 40 bits below the largest sum
    assert (abs_sum * scale.double()).max().item() >= 2.0 ** 40
    fixed = torch.round(rows * scale.double()).long()
    ref_sum = torch.zeros(s_kv, d, dtype=torch.float64).index_add_(0, keys, rows)
    sums = []
    for seed in range(3):
        perm = torch.randperm(keys.numel(), generator=torch.Generator().manual_seed(seed))
        acc = torch.zeros(s_kv, d, dtype=torch.int64)
        for i in perm.tolist():  # one addition at a time, in a different order each time
            acc[keys[i]] += fixed[i]
        sums.append(acc)
    assert all(torch.equal(sums[0], s) for s in sums[1:])
    count = torch.bincount(keys, minlength=s_kv).double()[:, None]
    err = (sums[0].double() / scale.double() - ref_sum).abs()
    assert (err <= 0.5 * count / scale.double() + 1e-300).all()


def test_fixed_point_scale_edge_cases():
    from mla_kernels.sm90.indexer_host import fixed_point_scale

    q = torch.ones(4, 64, 16, dtype=torch.bfloat16)
    w = torch.ones(4, 64)
    assert fixed_point_scale(q, w, torch.zeros(4)).item() == 2.0 ** 126  # nothing to add: any scale
    for bad in (float("inf"), float("nan")):
        s = fixed_point_scale(q, w, torch.tensor([1.0, bad, 0.0, 1.0])).item()
        assert s == 2.0 ** -126  # finite, no error (dk is meaningless with non-finite gradients)
    # 64 heads x |w| 1 x |q| 1 x 4 rows x margin 4 = 2^10 -> 2^52
    assert fixed_point_scale(q, w, torch.ones(4)).item() == 2.0 ** 52


def test_topk_select_variant_dispatch(monkeypatch):
    """The select kernel's variant per row block (CPU, the host's choice): by the block's longest
    row (:data:`TOPK_AUTO`), ``base`` when every row takes all its keys, no shared-memory rows with
    ``MLA_KERNELS_INDEXER_TOPK_SMEM=0``, a forced variant by ``MLA_KERNELS_INDEXER_TOPK_VARIANT``;
    the causal default's per-block bound (ranges given: ``s_kv``); the host's copy of the kernel's
    largest row capacity is the kernel module's, and every variant's options are accepted."""
    from types import SimpleNamespace as NS

    from mla_kernels.api_indexer import make_indexer_problem
    from mla_kernels.sm90 import indexer_host as ih
    from mla_kernels.sm90 import indexer_topk

    assert ih.TOPK_MAX_ROW_CAP == indexer_topk.MAX_ROW_CAP
    for name, (cap, batch, min_ctas, words, unroll, full) in ih.TOPK_VARIANTS.items():
        k = indexer_topk.IndexerTopkSm90(False, batch, True, False, cap, min_ctas, words, unroll, full)
        assert k.row_cap == cap and k.map_words == words and k.full_batches == full, name
    with pytest.raises(ValueError, match="row_cap 0"):
        indexer_topk.IndexerTopkSm90(False, row_cap=8192, full_batches=True)
    assert all(name in ih.TOPK_VARIANTS for _, name in ih.TOPK_AUTO) and ih.TOPK_AUTO[-1][0] is None
    monkeypatch.delenv(ih.ENV_TOPK_SMEM, raising=False)
    monkeypatch.delenv(ih.ENV_TOPK_VARIANT, raising=False)
    assert ih.topk_smem()
    assert ih.topk_variant(2048, 2048) == "base"  # every row takes all its keys
    for longest in (2049, 8192, 8193, 16384, 32768, 32769, 10**6):
        want = next(n for b, n in ih.TOPK_AUTO if b is None or longest <= b)
        assert ih.topk_variant(longest, 2048) == want, longest
    monkeypatch.setenv(ih.ENV_TOPK_SMEM, "0")
    for longest in (2049, 8192, 40000):
        assert ih.TOPK_VARIANTS[ih.topk_variant(longest, 2048)][0] == 0
    monkeypatch.setenv(ih.ENV_TOPK_SMEM, "yes")
    with pytest.raises(ValueError, match="expected 0 or 1"):
        ih.topk_variant(5000, 2048)
    monkeypatch.delenv(ih.ENV_TOPK_SMEM)
    monkeypatch.setenv(ih.ENV_TOPK_VARIANT, "s16k")
    assert ih.topk_variant(100, 2048) == "s16k"  # forced: every block
    monkeypatch.setenv(ih.ENV_TOPK_VARIANT, "fast")
    with pytest.raises(ValueError, match="expected auto or one of base"):
        ih.topk_variant(5000, 2048)
    monkeypatch.setenv(ih.ENV_TOPK_VARIANT, "auto")
    assert ih.topk_variant(2048, 2048) == "base"
    monkeypatch.delenv(ih.ENV_TOPK_VARIANT)

    q, k, w = torch.zeros(100, 16, 64), torch.zeros(300, 64), torch.zeros(100, 16)
    p = make_indexer_problem(q, k, w)
    assert p.causal and ih.block_longest(p, 0, 32) == 232 and ih.block_longest(p, 96, 4) == 300
    p = make_indexer_problem(q, k, w, k_end=torch.full((100,), 7))
    assert not p.causal and ih.block_longest(p, 0, 32) == 300
    p = make_indexer_problem(torch.zeros(300, 16, 64), torch.zeros(100, 64), torch.zeros(300, 16))
    assert ih.block_longest(p, 0, 32) == 0 and ih.block_longest(p, 192, 32) == 24  # more queries than keys
    big = NS(causal=True, s_q=32768, s_kv=32768)  # S 32k, 4096-row blocks: rows of <= 4096 ... 32768 keys
    assert [ih.block_longest(big, q0, 4096) for q0 in range(0, 32768, 4096)] == list(range(4096, 32769, 4096))


def test_topk_kernel_options_are_checked():
    from mla_kernels.sm90.indexer_topk import MAX_ROW_CAP, IndexerTopkSm90

    with pytest.raises(ValueError, match="row_cap"):
        IndexerTopkSm90(False, row_cap=MAX_ROW_CAP + 32)
    with pytest.raises(ValueError, match="row_cap"):
        IndexerTopkSm90(False, row_cap=1000)  # not a multiple of 32
    with pytest.raises(ValueError, match="exclude"):
        IndexerTopkSm90(False, pre_hist=True, row_cap=16384)
    with pytest.raises(ValueError, match="min_ctas"):
        IndexerTopkSm90(False, min_ctas=5)
    with pytest.raises(ValueError, match="map_words"):
        IndexerTopkSm90(False, map_words=1022)
    k = IndexerTopkSm90(False, row_cap=MAX_ROW_CAP)
    assert k.sel_words == MAX_ROW_CAP + 4 and k.row_unroll == 8
    assert IndexerTopkSm90(False, row_cap=16384).row_unroll == 4 and IndexerTopkSm90(False).sel_words == 8192
    assert IndexerTopkSm90(False, map_words=1024).sel_words == 1024
    assert IndexerTopkSm90(False, row_cap=8192, map_words=1024, row_unroll=2).sel_words == 8196
    assert IndexerTopkSm90(False, min_ctas=3)._occupancy() == dict(min_blocks_per_mp=3, preferred_smem_carveout=100)
    assert IndexerTopkSm90(False)._occupancy() == {}


@pytest.mark.compile
def test_topk_kernel_with_shared_memory_rows():
    """The largest shared-memory row variant compiles for sm_90a within the CTA's shared memory
    (one CTA per SM) without spills; its row pass stores 16 bytes of keys to shared memory
    (``STS.128``).  The ``s8k`` variant (the default for rows of <= 8,192 keys) fits three CTAs per
    SM: at most 40 registers, no spills, 3 x its shared memory within an SM's 228 KiB; ``b4m3``
    (the default for longer rows) too, with at most 64 bytes of spills."""
    from mla_kernels.sm90 import indexer_host as ih
    from mla_kernels.sm90.indexer_topk import MAX_ROW_CAP, compile_topk

    cr = compile_report_module()
    nvd = cr.find_nvdisasm()
    r = cr.report_one("topk_smem", lambda a, **kw: compile_topk(False, a, row_cap=MAX_ROW_CAP, **kw), "sm_90a", nvd)
    sass, base = _common(r)
    assert 4 * MAX_ROW_CAP < r["smem_bytes"] <= SMEM_LIMIT
    assert r["registers"] <= 128  # 512 threads on one SM
    assert sass.get("STS.128", 0) >= 1 and base.get("ATOMS", 0) > 0 and base.get("HGMMA", 0) == 0
    cap, batch, min_ctas, words, unroll, full = ih.TOPK_VARIANTS["s8k"]
    assert not full
    r = cr.report_one("topk_s8k", lambda a, **kw: compile_topk(False, a, batch=batch, row_cap=cap, min_ctas=min_ctas,
                                                                map_words=words, row_unroll=unroll, **kw),
                      "sm_90a", nvd)
    _common(r)
    assert r["registers"] <= 40 and 3 * (r["smem_bytes"] + 1024) <= 228 * 1024
    # b4m3 (the default for longer rows): bounded to 40 registers for 3 CTAs per SM (0 spills under
    # the CUDA 13 ptxas since the candidate chunks; the bound allows the few an older ptxas made)
    # and pass 2's whole batches without bounds checks (full_batches: two copies of its loop body)
    cap, batch, min_ctas, words, unroll, full = ih.TOPK_VARIANTS["b4m3"]
    assert full
    r = cr.report_one("topk_b4m3", lambda a, **kw: compile_topk(False, a, batch=batch, min_ctas=min_ctas,
                                                                 map_words=words, full_batches=full, **kw),
                      "sm_90a", nvd)
    assert r["registers"] <= 40 and r["spill_bytes"] <= 64 and 3 * (r["smem_bytes"] + 1024) <= 228 * 1024
