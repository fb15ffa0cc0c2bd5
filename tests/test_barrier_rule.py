"""The named-barrier rule, checked on the SASS of every kernel (sm_90a, sm_100a, sm_103a; no GPU).

``bar.sync`` is ``barrier.sync.aligned``: all threads taking part in one instance of a named
barrier must execute the *same* instruction.  The sm90 backward once had both consumer
warpgroups ``bar.sync`` one id from two code locations; compute-sanitizer's synccheck reported
"Divergent thread(s) in block" and the kernel died under the tool (issue 12).  The rule enforced
here: every waiting instruction (``BAR.SYNC`` / ``BAR.RED``) of a barrier id sits at one code
address; a producer that only signals uses ``BAR.ARV`` (any number of sites).  An id synced at
two addresses by the *same* threads in the same order is safe, but the SASS cannot show which
threads reach an address: such sites are listed in ``DOCUMENTED`` with the reason they are safe.

Besides: an id's sites all name one thread count (an arrive/sync pair whose counts differ hangs
or releases early), every ``BAR.ARV`` id also has a ``BAR.SYNC`` somewhere, and the
``BAR.SYNC 0x0`` that ptxas emits as the non-cluster fallback of ``barrier.cluster.wait`` appears
once per cluster wait.  The compiled records are shared with the per-kernel SASS tests through
``conftest.compile_records`` (one compile per kernel per session).  See docs/DSL_NOTES.md,
"Named barriers".
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

from conftest import compile_records

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _tool():
    spec = importlib.util.spec_from_file_location("compile_report_rule", os.path.join(ROOT, "tools", "compile_report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cr = _tool()  # stdlib only at import: the parser tests below run without the DSL

# ---------------------------------------------------------------------------------------------
# The SASS parser and the rule, on hand-written SASS
# ---------------------------------------------------------------------------------------------

SASS = """
        /*0170*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;                 /* 0x0000000000007b1d */
        /*0250*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0x100 ;          /* 0x0000400000007b1d */
        /*0260*/                   UTCBAR [UR4], URZ ;
        /*0270*/                   DEPBAR.LE SB0, 0x36 ;
        /*0280*/                   MEMBAR.ALL.CTA ;
        /*0290*/                   UCGABAR_ARV ;
        /*02a0*/               @P2 BAR.SYNC.DEFER_BLOCKING 0x3, 0x100 ;
        /*02b0*/                   BAR.ARV 0x2, 0x100 ;
        /*02c0*/              @!P0 BAR.ARV 0x3, 0x100 ;
        /*02d0*/                   BAR.SYNC.DEFER_BLOCKING R4, 0x80 ;
        /*02e0*/                   BAR.RED.POPC.DEFER_BLOCKING 0x5, 0x80 ;
        /*02f0*/                   BRA.U !UP0, `(.L_x_14) ;
        /*0300*/                   UCGABAR_WAIT ;
        /*0310*/                   CCTL.IVALL ;
        /*0320*/                   BRA `(.L_x_15) ;
.L_x_14:
        /*0330*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_15:
        /*0340*/                   BAR.SYNC.DEFER_BLOCKING 0x2, 0x100 ;
"""


def test_barrier_sites_parses_every_form():
    sites = cr.barrier_sites(SASS)
    got = [(s["addr"], s["op"], s["id"], s["threads"], s["pred"], s["cluster_fallback"]) for s in sites]
    assert got == [
        (0x170, "SYNC", 0, None, "", False),
        (0x250, "SYNC", 1, 0x100, "", False),
        (0x2A0, "SYNC", 3, 0x100, "@P2", False),
        (0x2B0, "ARV", 2, 0x100, "", False),
        (0x2C0, "ARV", 3, 0x100, "@!P0", False),
        (0x2D0, "SYNC", None, 0x80, "", False),
        (0x2E0, "RED", 5, 0x80, "", False),
        (0x330, "SYNC", 0, None, "", True),  # the non-cluster fallback of barrier.cluster.wait
        (0x340, "SYNC", 2, 0x100, "", False),
    ]


def test_bar_sync_repeats_flags_one_id_synced_at_two_addresses():
    sites = cr.barrier_sites(SASS)
    # id 2 (arrive at 0x2b0, sync at 0x340) and id 3 (predicated sync + arrive) keep the rule;
    # the register id is unattributed until its values are given
    assert cr.bar_sync_repeats(sites) == {"register": [0x2D0]}
    assert cr.bar_sync_repeats(sites, dynamic_ids=(6, 7)) == {}
    # a register id that can be 1 (also synced at 0x250) or 5 (the BAR.RED) breaks it
    assert cr.bar_sync_repeats(sites, dynamic_ids=(1, 5)) == {1: [0x250, 0x2D0], 5: [0x2D0, 0x2E0]}
    # the sm90 backward's old BAR_DS: both warpgroups bar.sync id 2 at their own call site
    old = SASS.replace("BAR.ARV 0x2, 0x100", "BAR.SYNC.DEFER_BLOCKING 0x2, 0x100")
    assert cr.bar_sync_repeats(cr.barrier_sites(old), dynamic_ids=(6,)) == {2: [0x2B0, 0x340]}
    # two __syncthreads (no cluster wait before the second) are two addresses of id 0 as well
    plain = SASS.replace("UCGABAR_WAIT", "NOP")
    assert cr.bar_sync_repeats(cr.barrier_sites(plain), dynamic_ids=(6,)) == {0: [0x170, 0x330]}


# ---------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------

#: Kernels whose SASS is checked: the variants the per-kernel SASS tests compile anyway (shared
#: records), plus one per barrier that only a variant contains (attn_sum's BAR_ASUM, the sm90
#: attn_dist's per-warpgroup ids in tokens mode).  The other variants of compile_report.py add no
#: named barrier (sm100 1-CTA backward with attn_sum: shuffles and stores; dlse: one load).
KERNELS = {
    "sm_100a": (
        "sm100_fwd_d576_h64", "sm100_fwd_d576_h128_2cta_topklen_sink", "sm100_fwd_d512_h64", "sm100_fwd_d576_h128_2cta",
        "sm100_fwd_d512_h256_2cta", "sm100_fwd_d576_h128_1cta_topklen_sink",
        "sm100_attn_dist_d576_h128", "sm100_attn_dist_d576_h64_topklen_norm", "sm100_attn_dist_d512_h128",
        "sm100_bwd_d576_h64", "sm100_bwd_d576_h64_det", "sm100_bwd_d512_h64",
        "sm100_bwd_d576_h128_2cta", "sm100_bwd_d576_h128_2cta_det", "sm100_bwd_d576_h128_2cta_topklen_asum_sink",
        "probe",
    ),
    # what the sm_103a SASS tests compile
    "sm_103a": (
        "sm100_fwd_d576_h64", "sm100_fwd_d576_h128_2cta", "sm100_attn_dist_d576_h128", "sm100_bwd_d576_h64",
        "sm100_bwd_d576_h128_2cta_topklen_asum_sink",
    ),
    "sm_90a": (
        "sm90_fwd_d576_h128", "sm90_attn_dist_d576_h128_heads", "sm90_attn_dist_d576_h64_tokens_norm",
        "sm90_bwd_d576_h128", "sm90_bwd_d576_h128_det", "sm90_bwd_d576_h128_topklen_asum_sink", "sm90_bwd_d512_h64",
        "sm90_bwd_d576_h128_rot", "probe",
    ),
}

#: (kernel family, barrier id) -> (most BAR.SYNC addresses, why that is safe).  Only ids synced by
#: the same threads, in the same order, at every address: each barrier instance then completes
#: at one instruction.  The sm100 kernels need none.
_RING = ("the alternating KV ring traces the pair loop once per parity; each body's P-landed "
         "barrier is synced by the same warpgroup (WG1: BAR_S0_READY, WG0: BAR_S1_READY), whose 128 "
         "threads run the bodies in turn, and arrived on by the other at the matching body: every "
         "instance completes at one instruction (synccheck clean: tools/sanitize.py)")
DOCUMENTED = {("sm90_fwd", 3): (2, _RING), ("sm90_fwd", 4): (2, _RING)}


def dynamic_ids(family: str):
    """The values of the register-held barrier ids a kernel family's source can produce."""
    # sm90_fwd: none since issue 14 (its epilogue's per-tile ids are immediates, one per WG branch)
    if family == "sm90_attn_dist":
        from mla_kernels.sm90.attn_dist import BAR_PSUM_WG0, BAR_PSUM_WG1

        return (BAR_PSUM_WG0, BAR_PSUM_WG1)  # BAR_PSUM_WG0 + wg (tokens mode)
    return ()


def family(name: str) -> str:
    """``sm90_bwd_d576_h128_det`` -> ``sm90_bwd`` (the kernel file), ``probe`` -> ``probe``."""
    return re.sub(r"_d\d+_.*$", "", name)


def test_family_names():
    assert [family(n) for n in ("sm90_attn_dist_d576_h64_tokens_norm", "sm100_bwd_d576_h128_2cta", "probe")] == [
        "sm90_attn_dist", "sm100_bwd", "probe"]


CASES = [(arch, name) for arch, names in KERNELS.items() for name in names]


@pytest.fixture(scope="module")
def records():
    return {arch: compile_records(arch, names) for arch, names in KERNELS.items()}


@pytest.mark.compile
@pytest.mark.parametrize("arch,name", CASES)
def test_one_bar_sync_address_per_barrier_id(records, arch, name):
    r = records[arch][name]
    if r["barriers"] is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    sites = r["barriers"]
    fam = family(name)
    repeats = cr.bar_sync_repeats(sites, dynamic_ids(fam))
    assert "register" not in repeats, f"{name}: a barrier id in a register; declare its values in dynamic_ids()"
    undocumented = {i: [hex(a) for a in addrs] for i, addrs in repeats.items()
                    if (fam, i) not in DOCUMENTED or len(addrs) > DOCUMENTED[(fam, i)][0]}
    assert not undocumented, (
        f"{name} ({arch}): bar.sync of one id at several code addresses {undocumented} -- use bar.arrive "
        "on the signalling side, or one call site (docs/DSL_NOTES.md, 'Named barriers')")
    if fam.startswith("sm100_"):
        assert repeats == {}, f"{name}: the sm100 kernels keep one bar.sync address per id"

    by_id = {}
    for st in sites:
        if not st["cluster_fallback"] and st["id"] is not None:
            by_id.setdefault(st["id"], []).append(st)
    for bid, group in by_id.items():
        counts = {st["threads"] for st in group}
        assert len(counts) == 1, f"{name}: barrier {bid} used with thread counts {counts}"
        if any(st["op"] == "ARV" for st in group):
            assert any(st["op"] in ("SYNC", "RED") for st in group), f"{name}: barrier {bid} arrived on, never synced"
    n_fallback = sum(st["cluster_fallback"] for st in sites)
    assert n_fallback == (r["sass_base"] or {}).get("UCGABAR_WAIT", 0), f"{name}: cluster-wait fallbacks"


@pytest.mark.compile
def test_the_sm100_fixes_have_their_shape(records):
    """The sm100 backwards' row terms are a one-way hand-off (drain arrives, math syncs) and the
    1-CTA backward's end barrier has one site; the 2-CTA forward's two softmax exchanges and the
    attn_dist epilogue's two syncs have one id each (issue 12's review)."""
    from mla_kernels.sm100 import attn_dist, bwd, bwd_h128, fwd_h128

    recs = records["sm_100a"]
    if recs["sm100_bwd_d576_h64"]["barriers"] is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")

    def ops(name, bid):
        return sorted(st["op"] for st in recs[name]["barriers"] if st["id"] == bid and not st["cluster_fallback"])

    for name in ("sm100_bwd_d576_h64", "sm100_bwd_d576_h64_det", "sm100_bwd_d512_h64"):
        assert ops(name, bwd.BAR_ROWS) == ["ARV", "SYNC"] and ops(name, bwd.BAR_END) == ["SYNC"]
    for name in ("sm100_bwd_d576_h128_2cta", "sm100_bwd_d576_h128_2cta_topklen_asum_sink"):
        assert ops(name, bwd_h128.BAR_ROWS) == ["ARV", "SYNC"] and ops(name, bwd_h128.BAR_XCHG) == ["SYNC"]
    assert ops("sm100_bwd_d576_h128_2cta_topklen_asum_sink", bwd_h128.BAR_ASUM) == ["SYNC"]
    for name in ("sm100_fwd_d576_h128_2cta", "sm100_fwd_d512_h256_2cta"):
        assert ops(name, fwd_h128.BAR_MAX) == ["SYNC"] and ops(name, fwd_h128.BAR_SUM) == ["SYNC"]
    assert ops("sm100_attn_dist_d576_h64_topklen_norm", attn_dist.BAR_LSE) == ["SYNC"]
    assert ops("sm100_attn_dist_d576_h64_topklen_norm", attn_dist.BAR_TOTAL) == ["SYNC"]
    assert ops("sm100_attn_dist_d576_h64_topklen_norm", attn_dist.BAR_EPI) == ["SYNC"]
