"""The decode and combine kernels compile for sm_90a without a GPU (tools/compile_report.py):
registers, spills, shared memory and the SASS they were written for."""

from __future__ import annotations

import pytest

from conftest import compile_report_module

pytestmark = pytest.mark.compile
SMEM_LIMIT = 232448
NAMES = {"sm90_decode_d576_h128_split", "sm90_decode_d576_h64_direct", "sm90_decode_d576_h64_direct_fixed",
         "sm90_decode_narrow_d576_h16_direct", "combine_f32_bf16_d512",
         "sm90_decode_narrow_d576_h8_fused", "sm90_decode_d576_h128_cluster16",
         "sm90_decode_d576_h128_cluster16_l2", "sm90_decode_d576_h128_cluster16_rows32",
         "sm90_decode_narrow_d576_h16_cluster16", "sm90_decode_narrow_d512_h32_cluster8_f32",
         "sm90_decode_narrow_d576_h8_cluster16", "sm90_decode_d576_h64_cluster6", "sm90_decode_d576_h128_direct",
         "sm90_decode_d576_h128_direct_pair"}


def q_chunks(h: int, d_qk: int = 576) -> int:
    """cp.async copies per consumer thread of the Q tile (16-byte chunks over 256 threads)."""
    return -(-h * d_qk // 8 // 256)


@pytest.fixture(scope="module")
def report():
    cr = compile_report_module()
    texts = []  # each kernel's SASS text, in the order run() disassembles them
    barrier_sites = cr.barrier_sites

    def keep_text(text):
        texts.append(text)
        return barrier_sites(text)

    cr.barrier_sites = keep_text
    recs = cr.run("sm_90a", only=NAMES, quiet=True)
    if len(texts) == len(recs):
        for r, t in zip(recs, texts):
            r["sass_text"] = t
    return {r["name"]: r for r in recs}


def producer_region(sass_text: str):
    """The opcodes of the producer warpgroup's code: after its ``USETMAXREG.DEALLOC``, before the
    consumers' ``USETMAXREG.TRY_ALLOC`` (both decode kernels place the roles so)."""
    import re

    ops, inside = [], False
    for line in sass_text.splitlines():
        m = re.match(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if not m:
            continue
        op = m.group(1)
        if op.startswith("USETMAXREG.DEALLOC"):
            inside = True
        elif op.startswith("USETMAXREG.TRY_ALLOC"):
            break
        elif inside:
            ops.append(op)
    return ops


def _common(r):
    assert r["arch"] == "sm_90a" and r["spill_bytes"] == 0 and r["registers"] is not None
    if r["sass"] is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    base = r["sass_base"]
    assert base.get("LDL", 0) == 0 and base.get("STL", 0) == 0
    return r["sass"], base


def test_decode_head_block_kernel(report):
    r = report["sm90_decode_d576_h128_split"]
    assert 0 < r["smem_bytes"] <= SMEM_LIMIT
    sass, base = _common(r)
    # the forward's schedule and products: QK 64x64x16 (36 per block: WG0's prologue and loop, WG1's
    # loop) + PV 64x256x16 (RS and SS, 4 each per WG)
    assert sass.get("HGMMA.64x64x16.F32.BF16", 0) == 108 and sass.get("HGMMA.64x256x16.F32.BF16", 0) == 16
    # 9 tiles x 4 rows x 2 buffers: the KV gather; + 18: Q by cp.async without a bias (64 x 576 / 8
    # chunks over 256 threads), issued at the kernel's start
    assert base.get("LDGSTS", 0) == 72 + q_chunks(64)
    assert base.get("UTMALDG", 0) == 0  # no TMA: Q (+ q_bias, fused through registers) by the consumers
    assert sass.get("STG.E.128", 0) >= 32  # float32 partial rows as 16-byte stores


def test_decode_alternating_ring(report):
    """Direct mode's default, the alternating KV ring (MLA_KERNELS_DECODE_RING): the pair loop is
    traced once per parity -- twice the fixed ring's products and gather copies, the same 0 spills
    and shared memory -- and the two ids each warpgroup syncs on in the loop (the peer's P landed:
    WG1 on BAR_S0_READY, WG0 on BAR_S1_READY) sit at one address per parity body: both bodies are
    run in turn by the same 128 threads, so every barrier instance completes at one instruction
    (synccheck: tools/sanitize.py --groups F)."""
    from mla_kernels.sm90.decode import BAR_S0_READY, BAR_S1_READY

    cr = compile_report_module()
    alt, fixed = report["sm90_decode_d576_h64_direct"], report["sm90_decode_d576_h64_direct_fixed"]
    sa, ba = _common(alt)
    sf, bf = _common(fixed)
    assert alt["smem_bytes"] == fixed["smem_bytes"]
    assert sf.get("HGMMA.64x64x16.F32.BF16", 0) == 108 and sf.get("HGMMA.64x256x16.F32.BF16", 0) == 16
    # QK: WG0's prologue + its next-pair products in both bodies + WG1's two bodies; PV: 4 per product
    assert sa.get("HGMMA.64x64x16.F32.BF16", 0) == 36 * 5 and sa.get("HGMMA.64x256x16.F32.BF16", 0) == 32
    assert ba.get("LDGSTS", 0) == 2 * 72 + q_chunks(64) and bf.get("LDGSTS", 0) == 72 + q_chunks(64)
    assert cr.bar_sync_repeats(fixed["barriers"]) == {}
    rep = cr.bar_sync_repeats(alt["barriers"])
    assert set(rep) == {BAR_S0_READY, BAR_S1_READY} and all(len(a) == 2 for a in rep.values())


def test_decode_pair_cluster_changes_only_the_launch(report):
    """Direct mode's pair cluster (MLA_KERNELS_DECODE_PAIR, h_q a multiple of 128): the kernel is the
    plain launch's -- the same instructions, registers and shared memory -- only launched as 2-CTA
    clusters."""
    plain, pair = report["sm90_decode_d576_h128_direct"], report["sm90_decode_d576_h128_direct_pair"]
    sp, _ = _common(plain)
    sq, _ = _common(pair)
    assert sp == sq and plain["registers"] == pair["registers"] and plain["smem_bytes"] == pair["smem_bytes"]
    if "sass_text" in plain and "sass_text" in pair:
        import re

        def body(t):  # the instructions without their addresses
            return [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", ln) for ln in t.splitlines()
                    if re.match(r"^\s*/\*[0-9a-f]+\*/", ln)]

        assert body(plain["sass_text"]) == body(pair["sass_text"])


@pytest.mark.parametrize("name,h", [("sm90_decode_narrow_d576_h16_direct", 16)])
def test_decode_narrow_kernel_heads_on_n(report, name, h):
    r = report[name]
    assert 0 < r["smem_bytes"] <= SMEM_LIMIT
    sass, base = _common(r)
    # heads on the MMA's N side: every product is m64 n=h (QK 36 + PV 8 m-tiles x 4 per block,
    # traced once per consumer warpgroup), no 64-row head tile anywhere
    assert sass.get(f"HGMMA.64x{h}x16.F32.BF16", 0) == 2 * (36 + 32)
    assert sum(v for k, v in sass.items() if k.startswith("HGMMA")) == 2 * (36 + 32)
    assert base.get("LDGSTS", 0) == 72 + q_chunks(h)


def test_combine_kernel(report):
    sass, base = _common(report["combine_f32_bf16_d512"])
    assert sass.get("LDG.E.128", 0) >= 8  # 16-byte part loads, several parts in flight
    assert base.get("HGMMA", 0) == 0 and base.get("MUFU", 0) > 0


def test_fused_tail(report):
    """The fused split kernel (MLA_KERNELS_DECODE_COMBINE=fused): one arrival atomic per CTA, the
    last-arrival verdict broadcast by a barrier reduction (no shared flag), the merge's 16-byte
    part loads, and the decode itself unchanged (heads on N, the same gather)."""
    r = report["sm90_decode_narrow_d576_h8_fused"]
    sass, base = _common(r)
    assert sum(v for k, v in sass.items() if k.startswith("ATOMG")) == 1
    assert sum(v for k, v in sass.items() if k.startswith("BAR.RED")) == 1
    assert sass.get("LDG.E.128", 0) >= 1
    assert sass.get("HGMMA.64x8x16.F32.BF16", 0) == 2 * (36 + 32) and base.get("LDGSTS", 0) == 72 + q_chunks(8)


def test_cluster_merge(report):
    """The split kernel whose 16 split CTAs of a row run as one cluster and merge over DSMEM
    (MLA_KERNELS_DECODE_COMBINE=cluster/auto): the decode itself unchanged, the partial staged in
    shared memory (16-byte stores), two cluster barriers on each warp role's path, 16 peers x 2
    16-byte DSMEM loads per merging thread, and no float32 partial rows in global memory."""
    r = report["sm90_decode_d576_h128_cluster16"]
    assert 0 < r["smem_bytes"] <= SMEM_LIMIT
    sass, base = _common(r)
    assert sass.get("HGMMA.64x64x16.F32.BF16", 0) == 108 and sass.get("HGMMA.64x256x16.F32.BF16", 0) == 16
    assert base.get("LDGSTS", 0) == 72 + q_chunks(64)
    assert sass.get("UCGABAR_ARV", 0) == 4 and sass.get("UCGABAR_WAIT", 0) == 4
    assert sass.get("STS.128", 0) >= 32  # the staged partial rows
    assert sass.get("LD.E.128", 0) == 32  # ld.shared::cluster of the peers' rows
    assert sass.get("STG.E.128", 0) == 0  # no float32 parts; the merged bf16 columns are 8-byte stores


@pytest.mark.parametrize("name,ld_range", [("sm90_decode_d576_h128_cluster16_rows32", (16, 32)),
                                             ("sm90_decode_d576_h64_cluster6", (24, 48))])
def test_cluster_merge_smaller_slices(report, name, ld_range):
    """The 64-head kernel's DSMEM merge with other slices than 64 / 16 heads -- the same decode,
    0 spills, two cluster barriers per warp role (ptxas may copy the last wait into both sides of
    the merge's thread gate: up to 6 wait sites), and the merge's DSMEM loads:

    * MLA_KERNELS_DECODE_CLUSTER_ROWS=32 (the default where twice the clusters fit): CTAs of 32
      heads (the wgmma tile's other 32 rows zero-filled by the Q load's cp.async, nothing read for
      them), 2 heads merged per CTA: each of the 128 merging threads reads its 16-byte chunk of
      the row from each of the 16 peers (bf16 staging) -- half the DSMEM bytes of 64-head CTAs
      (ptxas lays the merge out twice: 15 of its 16 loads in each copy, one shared);
    * a cluster of 6 CTAs over 64 heads (the ``fit`` rule's size for 16 rows): up to 11 heads
      per CTA, 16 threads per head, each reading its 4 16-byte chunks of the row from each of the
      6 peers."""
    r = report[name]
    assert 0 < r["smem_bytes"] <= SMEM_LIMIT and r["spill_bytes"] == 0
    sass, base = _common(r)
    assert sass.get("HGMMA.64x64x16.F32.BF16", 0) == 108 and sass.get("HGMMA.64x256x16.F32.BF16", 0) == 16
    assert base.get("LDGSTS", 0) == 72 + q_chunks(64)
    assert sass.get("UCGABAR_ARV", 0) == 4 and 4 <= sass.get("UCGABAR_WAIT", 0) <= 6
    assert ld_range[0] <= sass.get("LD.E.128", 0) <= ld_range[1]


def test_cluster_merge_through_l2(report):
    """MLA_KERNELS_DECODE_CLUSTER_PARTS=l2: the float32 parts go to the workspace as in split mode
    (16-byte stores), one cluster barrier (release: one MEMBAR.GPU), no DSMEM loads; each CTA
    merges its slice with the combine's 16-byte part loads."""
    sass, base = _common(report["sm90_decode_d576_h128_cluster16_l2"])
    assert sass.get("STG.E.128", 0) >= 32 and sass.get("LD.E.128", 0) == 0
    assert sass.get("UCGABAR_ARV", 0) == 2 and sass.get("UCGABAR_WAIT", 0) == 2 and sass.get("MEMBAR.ALL.GPU", 0) == 1
    assert sass.get("LDG.E.128", 0) >= 36 + 16


@pytest.mark.parametrize("name,h,n,d,bf16", [("sm90_decode_narrow_d576_h16_cluster16", 16, 16, 576, True),
                                              ("sm90_decode_narrow_d512_h32_cluster8_f32", 32, 8, 512, False),
                                              ("sm90_decode_narrow_d576_h8_cluster16", 8, 16, 576, True)])
def test_narrow_cluster_merge(report, name, h, n, d, bf16):
    """The narrow (heads-on-N) split kernel whose splits of a token run as one cluster and merge
    over DSMEM: the decode itself unchanged (the same HGMMAs and gather copies as the narrow
    split kernel), 0 spills, two cluster barriers on each warp role's path, one 16-byte DSMEM
    load per peer and chunk of the merging thread's columns, no float32 partial rows in global
    memory."""
    r = report[name]
    assert 0 < r["smem_bytes"] <= SMEM_LIMIT and r["spill_bytes"] == 0
    sass, base = _common(r)
    n_k = d // 64
    assert sass.get(f"HGMMA.64x{h}x16.F32.BF16", 0) == 2 * (4 * n_k + 32)
    assert base.get("LDGSTS", 0) == 8 * n_k + q_chunks(h, d)
    assert sass.get("UCGABAR_ARV", 0) == 4 and 4 <= sass.get("UCGABAR_WAIT", 0) <= 6
    assert sass.get("LD.E.128", 0) >= n  # ld.shared::cluster of the peers' rows: at least one per peer
    # no float32 partial rows: the only 16-byte global stores are the bf16-staged merge's output
    # columns (8 bf16; float32 staging merges 4 columns per chunk: 8-byte stores)
    assert sass.get("STG.E.128", 0) <= (2 if bf16 else 0)


def test_narrow_cluster_refusals():
    """A narrow cluster of more than 16 CTAs, or an L2-staged one, is refused (any size 2..16
    merges: uneven head slices, or column parts of one head)."""
    from mla_kernels.sm90 import compile_decode_narrow

    with pytest.raises(ValueError, match="a size of 2..16"):
        compile_decode_narrow(576, 24, True, "sm_90a", cluster=17)
    with pytest.raises(ValueError, match="over DSMEM only"):
        compile_decode_narrow(576, 16, True, "sm_90a", cluster=16, cluster_l2=True)


def test_producer_divides_by_the_page_size_with_constants():
    """MLA_KERNELS_DECODE_PAGEDIV=magic: the paged gather divides each position by the page size
    with the host's constants -- the producer's code holds no integer-division sequence (its float
    reciprocal ``MUFU.RCP``, the ``I2F`` / ``F2I`` conversions around it) but at least the 9
    multiply-highs of a block pair (8 gathered rows + the validity slot per thread), and fits its
    72 registers (no spills)."""
    from mla_kernels.sm90 import compile_decode

    cr = compile_report_module()
    texts = []
    barrier_sites = cr.barrier_sites
    cr.barrier_sites = lambda text: (texts.append(text), barrier_sites(text))[1]
    r = cr.report_one("sm90_decode_d576_h64_direct_magic",
                      lambda a, **kw: compile_decode(576, 64, False, a, pagediv="magic", **kw), "sm_90a",
                      cr.find_nvdisasm())
    _common(r)
    ops = producer_region(texts[0])
    assert len(ops) > 300  # the region was found: the producer's loop and copies
    assert [o for o in ops if o.startswith(("I2F", "F2I", "MUFU.RCP"))] == []
    assert sum(o.startswith("IMAD.HI") for o in ops) >= 9
    assert base_ldgsts(r) == 2 * 72 + q_chunks(64)  # the same copies (direct mode: two pair bodies)


@pytest.mark.parametrize("name", ["sm90_decode_d576_h128_split", "sm90_decode_narrow_d576_h16_direct"])
def test_default_producer_uses_the_compilers_division(report, name):
    """The default kernels (MLA_KERNELS_DECODE_PAGEDIV=generic): the compiler's division by the
    runtime page size, a float reciprocal, in the producer (what the magic constants remove)."""
    r = report[name]
    _common(r)
    if "sass_text" not in r:
        pytest.skip("SASS text not captured")
    ops = producer_region(r["sass_text"])
    assert len(ops) > 300
    assert sum(o.startswith("MUFU.RCP") for o in ops) >= 1 and sum(o.startswith("I2F") for o in ops) >= 1


def base_ldgsts(r):
    return r["sass_base"].get("LDGSTS", 0)


@pytest.mark.parametrize("kw", [dict(), dict(cluster=16, cluster_l2=True), dict(rows=48, cluster=16)])
def test_32_head_ctas_need_a_dsmem_cluster(kw):
    """rows=32 (or anything but 32 / 64) outside a DSMEM cluster merge is refused before compiling."""
    from mla_kernels.sm90 import compile_decode

    kw = dict(kw)
    kw.setdefault("rows", 32)
    with pytest.raises(ValueError, match=f"rows={kw['rows']}: 64, or 32 with a DSMEM cluster merge"):
        compile_decode(576, 128, bool(kw.get("cluster")), "sm_90a", **kw)
