"""The compile pipeline without a GPU: CuTe DSL -> PTX -> cubin -> SASS for sm_90a and sm_100a,
through tools/compile_report.py (what CI can prove about the kernels).  The sm100 kernels' SASS
checks are in test_sm100_attn_dist.py."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed")

ROOT = os.path.join(os.path.dirname(__file__), "..")
spec = importlib.util.spec_from_file_location("compile_report", os.path.join(ROOT, "tools", "compile_report.py"))
compile_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compile_report)

pytestmark = pytest.mark.compile
SMEM_LIMIT = 232448


def bwd_spill_allowance(name: str) -> tuple:
    """``(spill bytes, LDL, STL)`` a backward build may show: none, except the d576 / h_q 128
    atomic builds where WG0 runs the send-first order (``SparseMlaBwdSm90.send_first``: the CUDA 13
    toolchain, the GPU build; 0.96-0.99x the time, docs/PERF.md): ptxas keeps a loop-invariant
    integer in local memory there -- 4 bytes stored once before the warpgroups split, reloaded a
    few times per role (32 bytes counted, 1 ``STL`` and 7 ``LDL``; the timing-trace build, with
    its clock registers, 72).  The other toolchain builds WG0 at lag 0, without spills."""
    from mla_kernels.sm90.bwd import SparseMlaBwdSm90

    if "_d576_h128" in name and "_det" not in name and SparseMlaBwdSm90(576, pair_sum=True).send_first[0]:
        return (96, 24, 8) if "_trace" in name else (48, 8, 2)
    return 0, 0, 0


@pytest.fixture(scope="module")
def sm90_report():
    # shared with tests/test_barrier_rule.py (one compile per kernel per session)
    from conftest import compile_records

    return compile_records("sm_90a", {"sm90_fwd_d576_h128", "sm90_fwd_d576_h128_fixed", "sm90_fwd_d576_h128_rot",
                                      "sm90_attn_dist_d576_h128_heads",
                                      "sm90_attn_dist_d576_h128_heads_persist",
                                      "sm90_attn_dist_d576_h128_heads_persist_qscalar",
                                      "sm90_attn_dist_d576_h128_heads_persist_qring",
                                      "sm90_attn_dist_d576_h64_tokens_persist_qring", "sm90_bwd_d576_h128",
                                      "sm90_bwd_d576_h128_det", "sm90_bwd_d512_h64", "sm90_decode_d512_h128_direct",
                                      "probe"})


def test_compile_report_writes_its_records_as_json(tmp_path):
    path = tmp_path / "sm90.json"
    recs = compile_report.run("sm_90a", only={"probe"}, json_path=str(path), quiet=True)
    assert json.loads(path.read_text()) == recs
    assert [r["name"] for r in recs] == ["probe"] and recs[0]["arch"] == "sm_90a" and recs[0]["spill_bytes"] == 0


def test_sm90_forward_compiles_with_hgmma_and_no_spills(sm90_report):
    r = sm90_report["sm90_fwd_d576_h128"]
    assert r["arch"] == "sm_90a" and r["spill_bytes"] == 0 and r["registers"] is not None
    assert 0 < r["smem_bytes"] <= SMEM_LIMIT
    if r["sass"] is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    base = r["sass_base"]
    assert base.get("HGMMA", 0) >= 100  # QK (36/block/WG) + PV wgmma
    assert any(k.startswith("HGMMA.64x64x16.F32.BF16") for k in r["sass"])
    assert any(k.startswith("HGMMA.64x256x16.F32.BF16") for k in r["sass"])
    assert base.get("LDGSTS", 0) > 0 and base.get("UTMALDG", 0) > 0 and base.get("UTMASTG", 0) > 0
    assert base.get("LDL", 0) == 0 and base.get("STL", 0) == 0
    # epilogue (issue 14): O per 64-column tile (4 TMA stores per WG, one code path), lse and
    # max_logits by two bulk copies instead of scalar stores
    assert r["sass"].get("UTMASTG.3D", 0) == 4 and r["sass"].get("UBLKCP.G.S", 0) == 2


def test_sm90_forward_rings(sm90_report):
    """The alternating KV ring (the default, MLA_KERNELS_FWD_RING=alt) traces the pair loop once per
    parity: twice the fixed ring's loop products (QK 36 per body and warpgroup, WG0's prologue once;
    PV 4 per product) and gather copies, the same registers, smem and epilogue, no spills."""
    from mla_kernels.sm90.fwd import BAR_S0_READY, BAR_S1_READY

    alt, fixed = sm90_report["sm90_fwd_d576_h128"], sm90_report["sm90_fwd_d576_h128_fixed"]
    assert alt["spill_bytes"] == fixed["spill_bytes"] == 0 and alt["smem_bytes"] == fixed["smem_bytes"]
    if alt["sass"] is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    for r, bodies in ((fixed, 1), (alt, 2)):
        assert r["sass"].get("HGMMA.64x64x16.F32.BF16", 0) == 36 * (1 + 2 * bodies)
        assert r["sass"].get("HGMMA.64x256x16.F32.BF16", 0) == 16 * bodies
        assert r["sass_base"].get("LDGSTS", 0) == 72 * bodies
        assert r["sass"].get("UTMASTG.3D", 0) == 4
    rep = compile_report.bar_sync_repeats(alt["barriers"])
    assert set(rep) == {BAR_S0_READY, BAR_S1_READY} and all(len(a) == 2 for a in rep.values())
    assert compile_report.bar_sync_repeats(fixed["barriers"]) == {}


def test_sm90_forward_rotated_pair_order(sm90_report):
    """The rotated pair order (``rotate_shift``, opt-in on band-ordered slots) reads the
    global timer once per CTA and otherwise compiles to the forward's products, gathers and
    epilogue, with no spills; the default kernel reads no timer."""
    from mla_kernels.sm90.fwd import SparseMlaFwdSm90

    with pytest.raises(ValueError, match="rotate_shift"):
        SparseMlaFwdSm90(576, rotate_shift=41)
    rot, base = sm90_report["sm90_fwd_d576_h128_rot"], sm90_report["sm90_fwd_d576_h128"]
    assert rot["spill_bytes"] == 0 and rot["registers"] == base["registers"]
    assert 0 < rot["smem_bytes"] <= SMEM_LIMIT
    if rot["sass"] is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    for k in ("HGMMA.64x64x16.F32.BF16", "HGMMA.64x256x16.F32.BF16", "UTMASTG.3D", "UBLKCP.G.S"):
        assert rot["sass"].get(k, 0) == base["sass"].get(k, 0) > 0, k
    assert rot["sass_base"].get("LDGSTS", 0) == base["sass_base"].get("LDGSTS", 0) > 0
    assert rot["special_regs"].get("SR_GLOBALTIMERLO", 0) == 1
    assert base["special_regs"].get("SR_GLOBALTIMERLO", 0) == 0


@pytest.mark.parametrize("name", ["sm90_attn_dist_d576_h128_heads", "sm90_attn_dist_d576_h128_heads_persist",
                                  "sm90_attn_dist_d576_h128_heads_persist_qscalar",
                                  "sm90_attn_dist_d576_h128_heads_persist_qring"])
def test_sm90_attn_dist_compiles_with_hgmma_and_no_spills(sm90_report, name):
    # _persist: the persistent grid (several items per CTA, the default at h_q 128 with more items
    # than SMs); _qscalar: Q by 4-byte loads (MLA_KERNELS_ATTN_DIST_QVEC=0); _qring: Q through the
    # KV ring (MLA_KERNELS_ATTN_DIST_QRING, the default of the persistent grid)
    r = sm90_report[name]
    assert r["spill_bytes"] == 0 and 0 < r["smem_bytes"] <= SMEM_LIMIT
    if r["sass"] is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    assert r["sass_base"].get("HGMMA", 0) == 36 and r["sass_base"].get("LDGSTS", 0) > 0
    # heads mode (issue 14): the warpgroups hand partials over through mbarriers, no named
    # barrier per block -- the only bar.sync left is the launch's __syncthreads
    assert [b["id"] for b in r["barriers"] if b["op"] == "SYNC"] == [0]


def test_sm90_decode_direct_writes_o_by_bulk_copies(sm90_report):
    """The 64-head decode kernel's direct mode (issue 16) stages O in smem and writes each head row
    by one bulk copy: no 8-byte register stores of O are left (only the 4-byte lse / max_logits
    stores), one bulk copy site, the staging barrier (id 7) synced at one address, no spills."""
    r = sm90_report["sm90_decode_d512_h128_direct"]
    assert r["spill_bytes"] == 0 and 0 < r["smem_bytes"] <= SMEM_LIMIT
    if r["sass"] is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    assert r["sass"].get("UBLKCP.G.S", 0) == 1 and r["sass"].get("STG.E.64", 0) == 0
    assert [b["op"] for b in r["barriers"] if b["id"] == 7] == ["SYNC"]


def test_sm90_attn_dist_tokens_persistent_q_ring_compiles(sm90_report):
    """Tokens mode's persistent grid with Q through the KV ring (the h_q 64 default with more items
    than SMs): no spills, the 36 QK wgmma of a block, the KV copies (9 tiles x 4 rows) plus the Q
    block's (the same count), the Q loaded by ldmatrix."""
    r = sm90_report["sm90_attn_dist_d576_h64_tokens_persist_qring"]
    assert r["spill_bytes"] == 0 and 0 < r["smem_bytes"] <= SMEM_LIMIT
    if r["sass"] is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    base = r["sass_base"]
    assert base.get("HGMMA", 0) == 36 and base.get("LDGSTS", 0) == 72 and base.get("LDSM", 0) > 0
    assert base.get("LDL", 0) == 0 and base.get("STL", 0) == 0


@pytest.mark.parametrize("name", ["sm90_bwd_d576_h128", "sm90_bwd_d576_h128_det", "sm90_bwd_d512_h64"])
def test_sm90_backward_compiles_with_hgmma_and_no_spills(sm90_report, name):
    r = sm90_report[name]
    spill, ldl, stl = bwd_spill_allowance(name)
    assert r["spill_bytes"] <= spill and 0 < r["smem_bytes"] <= SMEM_LIMIT
    if r["sass"] is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    sass, base = r["sass"], r["sass_base"]
    h128 = "_h128" in name
    if name.startswith("sm90_bwd_d576"):
        # all four products on wgmma: S 36 + dP 32 + dQ (4 x 64x256 per WG + 4 RoPE) + dKV 68 per block
        assert sass.get("HGMMA.64x64x16.F32.BF16", 0) == 140 and sass.get("HGMMA.64x256x16.F32.BF16", 0) == 8
    assert base.get("LDGSTS", 0) > 0 and base.get("UTMALDG", 0) > 0 and base.get("UTMASTG", 0) > 0
    assert base.get("LDL", 0) <= ldl and base.get("STL", 0) <= stl
    n_chunks = 9 if name.startswith("sm90_bwd_d576") else 8
    # h_q 128: the head-block pair sums each chunk through DSMEM (2 x 16-byte st.async of the
    # peer's half in bf16 per chunk) and scatters 32 of its 64 columns:
    # half the atomics (or deterministic row stores) per CTA.  h_q 64: whole chunks, no exchange.
    per_chunk = 4 if h128 else 8
    assert sass.get("STAS.128", 0) == (2 * n_chunks if h128 else 0)  # bf16 halves: 2 x 16 B
    reds = sass.get("REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU", 0)
    if name.endswith("_det"):
        # deterministic: no float atomics at all; the per-slot rows are bf16, 8-byte stores of 4 values
        assert base.get("REDG", 0) == 0 and base.get("RED", 0) == 0 and base.get("ATOMG", 0) == 0
        assert sass.get("STG.E.64", 0) == per_chunk * n_chunks
    else:
        assert reds == per_chunk * n_chunks  # 16-byte vector float atomics per 64-column chunk


def test_sm100_pipeline_compiles():
    # The probe only: the sm100 kernels' own report checks live in test_sm100_attn_dist.py.
    recs = compile_report.run("sm_100a", only={"probe"}, quiet=True)
    assert recs and all(r["arch"] == "sm_100a" and r["spill_bytes"] == 0 for r in recs)
    names = [name for name, _ in compile_report.kernels_for("sm_100a")]
    assert "probe" in names and any(n.startswith("sm100_attn_dist") for n in names)


def test_compile_cache_and_arch_helpers():
    from mla_kernels import _compile

    assert _compile.arch_for_capability(9, 0) == "sm_90a"
    assert _compile.arch_for_capability(10, 0) == "sm_100a"
    assert _compile.arch_for_capability(10, 3) == "sm_103a"
    with pytest.raises(ValueError):
        _compile.arch_for_capability(8, 0)
    calls = []
    f1 = _compile.cached_compile(("test", 1), lambda: calls.append(1) or "compiled")
    f2 = _compile.cached_compile(("test", 1), lambda: calls.append(1) or "again")
    assert f1 == f2 == "compiled" and calls == [1]


def _bwd_d576_h128_build(name: str, stas: int):
    """The compile record ``name`` of a d576/h128 backward build: no spills and the kernel's
    products, atomics and ``stas`` st.async stores (skips when nvdisasm is missing)."""
    from conftest import compile_records

    r = compile_records("sm_90a", {name})[name]
    assert r["spill_bytes"] <= bwd_spill_allowance(name)[0]
    if r["sass"] is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    counts = r["sass"]
    assert counts.get("HGMMA.64x64x16.F32.BF16", 0) == 140 and counts.get("HGMMA.64x256x16.F32.BF16", 0) == 8
    assert counts.get("REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU", 0) == 36 and counts.get("STAS.128", 0) == stas
    return r


def test_sm90_backward_trace_build():
    """The backward's timing-trace build (``trace=True``, tools/trace_bwd.py) compiles to the same
    products, exchange and atomics as the kernel, plus predicated stores of the cycle counter and
    no spills; it takes the attn_sum argument as its buffer, so it refuses attn_sum."""
    from mla_kernels.sm90.bwd import SparseMlaBwdSm90

    with pytest.raises(ValueError, match="trace"):
        SparseMlaBwdSm90(576, attn_sum=True, trace=True)
    with pytest.raises(ValueError, match="trace"):
        SparseMlaBwdSm90(576, deterministic=True, trace=True)
    r = _bwd_d576_h128_build("sm90_bwd_d576_h128_trace", stas=18)
    assert r["special_regs"].get("SR_CLOCKLO", 0) >= 40 and r["sass"].get("STG.E", 0) >= 40


def test_sm90_backward_rotated_block_order_build():
    """The rotated block order (``rotate_shift``, the sm90 default on band-ordered slots) reads
    the global timer once per CTA (pair) and otherwise compiles to the kernel's products, exchange and
    atomics, with no spills; deterministic mode refuses it (dq's block order must be fixed)."""
    from mla_kernels.sm90.bwd import SparseMlaBwdSm90

    with pytest.raises(ValueError, match="deterministic"):
        SparseMlaBwdSm90(576, deterministic=True, rotate_shift=13)
    with pytest.raises(ValueError, match="rotate_shift"):
        SparseMlaBwdSm90(576, rotate_shift=41)
    r = _bwd_d576_h128_build("sm90_bwd_d576_h128_rot", stas=19)  # (+1 st.async: rank 0 sends its tick)
    assert r["special_regs"].get("SR_GLOBALTIMERLO", 0) == 1
