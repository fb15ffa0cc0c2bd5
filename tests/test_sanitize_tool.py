"""tools/sanitize.py without a GPU: the configuration list, the log parser, and every group's
workload checks run end to end on the CPU reference (the GPU run puts the same workload under
compute-sanitizer with the sm90 kernels)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

import sanitize  # noqa: E402


def test_groups_cover_every_dispatchable_option():
    gs = sanitize.GROUPS
    assert {g.d_qk for g in gs} == {512, 576}
    assert {64, 128}.issubset({g.h_q for g in gs}) and any(g.h_q % 128 and g.h_q > 64 for g in gs)
    assert {g.topk_length for g in gs} == {True, False} and {g.sink for g in gs} == {True, False}
    assert {g.normalize for g in gs} == {True, False}
    ops = {op for g in gs for op in g.ops}
    assert ops == {"fwd", "fwd_rot", "attn_dist", "attn_dist_persist", "attn_dist_qscalar", "attn_dist_qglobal", "bwd", "bwd_asum",
                   "bwd_det",
                   "bwd_det_asum", "bwd_dlse",
                   "decode_split_h128", "decode_direct_h64", "decode_direct_h128_d512", "decode_direct_h64_oregs",
                   "decode_direct_h64_fixed", "decode_split_h64_d512_ring", "decode_cluster4_h128_ring",
                   "decode_split_h128_d512",
                   "decode_narrow_split_h16",
                   "decode_narrow_direct_h32_d512", "decode_fused_h128", "decode_narrow_fused_h16",
                   "decode_cluster4_h128", "decode_cluster2_h64_bf16", "decode_cluster4_h128_l2",
                   "decode_auto_cluster8_h128", "decode_cluster4_h128_rows32", "decode_cluster16_h64_rows32",
                   "decode_narrow_cluster16_h16", "decode_narrow_cluster4_h32_f32",
                   "decode_narrow_cluster16_h8", "decode_cluster6_h64",
                   "decode_narrow_cluster6_h16", "decode_direct_h128_pair", "merge"}
    # attn_sum scaled (with a sink) and unscaled, deterministic with and without attn_sum
    assert any(g.sink and ("bwd_asum" in g.ops or "bwd_det_asum" in g.ops) for g in gs)
    assert any(not g.sink and ("bwd_asum" in g.ops or "bwd_det_asum" in g.ops) for g in gs)


def test_ops_filter_keeps_the_named_ops():
    g = sanitize.GROUP_BY_NAME["A"]
    assert sanitize.only_ops(g, "") is g
    kept = sanitize.only_ops(g, "attn_dist,attn_dist_persist,bogus")
    assert kept.ops == ("attn_dist", "attn_dist_persist") and kept.d_qk == g.d_qk and kept.h_q == g.h_q
    assert sanitize.only_ops(sanitize.GROUP_BY_NAME["F"], "attn_dist").ops == ()


def test_workload_without_the_forward_takes_the_reference_lse():
    """``--ops`` without ``fwd``: the attn_dist steps run on the reference's lse (CPU, reference backend)."""
    g = sanitize.only_ops(sanitize.GROUP_BY_NAME["E"], "attn_dist,attn_dist_persist")
    assert sanitize.run_workload(g, device="cpu", backend="reference") == 0


LOG = """========= COMPUTE-SANITIZER
@@SANITIZE BEGIN fwd           d576 h128
========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call to cuGetProcAddress_v2.
=========     Saved host backtrace up to driver entry point at error
========= Error: Race reported between Write access at kernel+0x82e0
=========     and Read access at kernel+0x4a80 [12032 hazards]
========= Warning: (Warp Level Programming) Potential WAR hazard detected at __shared__ 0x384b0
=========     Write Thread (160, 0, 0) at kernel+0x86e0
@@SANITIZE END fwd           d576 h128 | check: ok
@@SANITIZE BEGIN bwd           d576 h128
========= Barrier error detected. Divergent thread(s) in block
=========     at kernel+0xc790
@@SANITIZE END bwd           d576 h128 | check: FAILED dq rel err inf > 0.01
========= RACECHECK SUMMARY: 2 hazards displayed (1 errors, 1 warnings)
"""


def test_parse_log_attributes_records_to_configs():
    per, summary, stray, probes = sanitize.parse_log(LOG, "racecheck")
    fwd, bwd = per["fwd           d576 h128"], per["bwd           d576 h128"]
    assert (fwd.errors, fwd.warnings, fwd.api_probe, fwd.check) == (1, 1, 1, "ok") and probes == 1
    assert (bwd.errors, bwd.warnings) == (1, 0) and bwd.check.startswith("FAILED")
    assert "Race reported" in fwd.first[0]
    assert summary.startswith("RACECHECK SUMMARY") and not sanitize.summary_clean(summary)
    assert stray == []
    assert sanitize.summary_clean("ERROR SUMMARY: 0 errors")
    assert sanitize.summary_clean("ERROR SUMMARY: 34 errors", api_probes=34)
    assert not sanitize.summary_clean("ERROR SUMMARY: 35 errors", api_probes=34)
    assert sanitize.summary_clean("RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)")
    assert not sanitize.summary_clean(None)


def test_cli_rejects_unknown_choices(capsys):
    with pytest.raises(SystemExit):
        sanitize.main(["--tools", "bogus"])
    assert "choose from memcheck, racecheck, synccheck" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sanitize.main(["--groups", "Z"])


@pytest.mark.parametrize("name", [g.name for g in sanitize.GROUPS])
def test_workload_checks_pass_on_reference(name, monkeypatch, capsys):
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "reference")
    assert sanitize.run_workload(sanitize.GROUP_BY_NAME[name], device="cpu", backend="reference") == 0
    out = capsys.readouterr().out
    per, _, _, _ = sanitize.parse_log(out, "memcheck")
    assert len(per) == len(sanitize.GROUP_BY_NAME[name].ops)
    assert all(t.check == "ok" for t in per.values()), out
