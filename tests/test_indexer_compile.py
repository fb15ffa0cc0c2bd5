"""The sm90 indexer kernels compile for sm_90a without a GPU (CuTe DSL -> PTX -> cubin -> SASS)
with the instructions they were written for and no spills; the host side's support answers and
workspace sizing (CPU)."""

from __future__ import annotations

import pytest
import torch

from conftest import compile_report_module

SMEM_LIMIT = 232448


@pytest.fixture(scope="module")
def report():
    cr = compile_report_module()
    only = {"sm90_indexer_score_bf16_h64_d128", "sm90_indexer_score_fp8_h64_d128", "sm90_indexer_topk_logits",
            "sm90_indexer_loss_fwd_d128", "sm90_indexer_loss_bwd_d128"}
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
def test_topk_kernel_is_plain_simt(report):
    sass, base = _common(report["sm90_indexer_topk_logits"])
    assert base.get("ATOMS", 0) > 0 and base.get("HGMMA", 0) == 0


@pytest.mark.compile
def test_loss_kernels(report):
    sass, base = _common(report["sm90_indexer_loss_fwd_d128"])
    assert sass.get("HGMMA.64x64x16.F32.BF16", 0) == 8 and base.get("LDGSTS", 0) > 0
    sass, base = _common(report["sm90_indexer_loss_bwd_d128"])
    # S^T (8 k-steps) + dK (2 chunks x 4) on 64x64; dq on 64x128 (4 k-steps); dK by 16-byte atomics
    assert sass.get("HGMMA.64x64x16.F32.BF16", 0) == 16 and sass.get("HGMMA.64x128x16.F32.BF16", 0) == 4
    assert sass.get("REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU", 0) == 16
    assert base.get("STSM", 0) > 0


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


def test_topk_workspace_rows():
    from mla_kernels.sm90 import indexer_host

    for s_q, s_kv in ((32768, 32768), (65536, 65536), (131072, 131072), (100, 5), (7, 10**9)):
        rows = indexer_host.block_rows(s_q, s_kv)
        assert rows % 32 == 0 and rows >= 32
        assert rows * s_kv * 4 <= indexer_host.WORKSPACE_BYTES or rows == 32
        assert rows <= -(-s_q // 32) * 32
    assert indexer_host.block_rows(32768, 32768) == 4096
