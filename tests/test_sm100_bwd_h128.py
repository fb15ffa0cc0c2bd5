"""sm100 2-CTA (cta_group::2) h128 sparse backward (``mla_kernels/sm100/bwd_h128.py``).

Served by dispatch for h_q % 128 == 0 (``MLA_KERNELS_SM100_BWD=1cta`` switches back to the 1-CTA
kernel).  Never run: no Blackwell GPU.  What is proven without one:

* plan (no compile): TMEM columns within 512 and disjoint, smem within budget, the dQ tiles and
  the dKV^T rounds store every head dim exactly once (dO^T P on every dim below d_v), the ring's
  generations keep each stage/phase static within a block, the dKV^T buffers' phases advance by
  one per use;
* layout contract (trace only, forced to sm_100a): every operand layout the MMA descriptors are
  built from places each element where its writer puts it (cp.async of Q/dO/K rows, the
  regathered dQ K tiles, the ring loader, the math warps' dS rows and P/dS quadrants, which the
  bulk copies move byte for byte); the TMEM loads give each thread the rows/columns the kernel
  assumes;
* compile report (marked ``compile``): cta_group::2 MMAs and multicast commits only (no
  single-CTA tcgen05 op), the DSMEM bulk copies of the P/dS exchange, TMEM loads, 16-byte float
  atomics (none in the deterministic variant), 0 spills, smem within budget -- sm_100a, sm_103a;
* a CPU emulation of the kernel's decomposition (operand splits, bf16 roundings, the quadrant
  exchange, the 32-head ring steps, the stored rows, attn_sum) against the float32 reference;
* GPU runtime (compute capability 10.x only, skipped elsewhere): through dispatch vs the
  reference (here and in ``test_sm100_bwd.py``, whose h_q 128/256 cases now run this kernel).
"""

from __future__ import annotations


import pytest

from conftest import make_case, rel_l2, skip_unless_sm100
from conftest import compile_records
from conftest import needs_cutlass as _cutlass, sw128 as _sw128, tile_offset as _rowtile_offset

SMEM_LIMIT = 232448




def _sw64(byte_off: int) -> int:
    return byte_off ^ (((byte_off >> 7) & 3) << 4)



# ---------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_qk", [576, 512])
def test_tmem_plan_within_512_no_overlap(d_qk):
    _cutlass()
    from mla_kernels.sm100.bwd_h128 import TMEM_COLUMNS, bwd_h128_plan

    p = bwd_h128_plan(d_qk)
    regs = sorted(p.tmem_regions(), key=lambda r: r[1])
    assert regs[0][1] == 0 and regs[-1][2] <= TMEM_COLUMNS
    for (_, lo0, hi0), (_, lo1, hi1) in zip(regs, regs[1:]):
        assert lo0 < hi0 <= lo1 < hi1
    assert [r[0] for r in regs][:2] == ["S", "dP"]
    assert len(p.dq_cols) == len(p.dq_tile_dims) == (5 if d_qk == 576 else 4)
    assert p.dkv_cols == (384, 448)


@pytest.mark.parametrize("d_qk", [576, 512])
def test_dims_covered_once(d_qk):
    _cutlass()
    from mla_kernels.sm100.bwd_h128 import bwd_h128_plan

    p = bwd_h128_plan(d_qk)
    stored = []
    for first, skip in zip(p.dq_tile_dims, p.dq_store_from):
        assert first % 64 == 0 and first + 128 <= d_qk and skip in (0, 64)
        stored += list(range(first + skip, first + 128))
    assert stored == list(range(d_qk))
    # dQ tile j: CTA r supplies K dims 64 (kdq_tiles[r][j]) .. +63 (its N half)
    for r in (0, 1):
        assert p.kdq_tiles[r] == tuple(first // 64 + r for first in p.dq_tile_dims)
        assert all(t < d_qk // 64 for t in p.kdq_tiles[r])
    # dKV^T rounds: CTA r's rows are dims round_dims[j] + 128 r + row, stored from round_store_row
    stored, with_do = [], []
    for j, first in enumerate(p.round_dims):
        assert first % 64 == 0 and first + 256 <= d_qk
        for r in (0, 1):
            lo = p.round_store_row[r][j]
            assert 0 <= lo <= 128
            dims = list(range(first + 128 * r + lo, first + 128 * r + 128))
            stored += dims
            if p.round_has_do[j]:
                with_do += dims
            else:
                assert all(d >= 512 for d in dims), "a round without dO^T P stores a V dim"
    assert sorted(stored) == list(range(d_qk))
    assert sorted(with_do) == list(range(512))
    assert p.round_dims == ((0, 256, 320) if d_qk == 576 else (0, 256))


@pytest.mark.parametrize("d_qk", [576, 512])
def test_ring_and_dkv_buffer_phases(d_qk):
    """The ring's generations per block are a multiple of 4 (so a generation's stage and phase
    do not depend on the block), in the order the MMA consumes them; each dKV^T buffer's phase
    (``uses * b + u``) advances by exactly one per use over consecutive blocks."""
    _cutlass()
    from mla_kernels.sm100.bwd_h128 import RING_K, bwd_h128_plan

    p = bwd_h128_plan(d_qk)
    n_kc = 128 // RING_K
    want = [(j, prod, kc) for j in range(len(p.round_dims)) for prod in range(1 + int(p.round_has_do[j]))
            for kc in range(n_kc)]
    assert list(p.ring_gens) == want and len(want) % 4 == 0
    assert len(want) == (20 if d_qk == 576 else 16)
    seen = {0: [], 1: []}
    for b in range(5):
        for j in range(len(p.round_dims)):
            buf, uses, u = p.round_buffer(j)
            seen[buf].append(uses * b + u)
    for buf, phases in seen.items():
        assert phases == list(range(len(phases))), (buf, phases)


@pytest.mark.parametrize("d_qk", [576, 512])
def test_smem_plan(d_qk):
    _cutlass()
    from mla_kernels.sm100.bwd_h128 import QUAD_BYTES, SMEM_HEADER_BYTES, bwd_h128_plan

    p = bwd_h128_plan(d_qk)
    assert p.smem_bytes == SMEM_HEADER_BYTES + sum(b for _, b in p.smem_regions) <= SMEM_LIMIT
    regions = dict(p.smem_regions)
    # sKh holds the CTA's 32 K rows (S/dP) and then dQ's K tiles (64 tokens x the CTA's dims)
    assert regions["sKh"] == max(32 * d_qk * 2, len(p.dq_tile_dims) * 64 * 64 * 2)
    assert regions["sPY"] == regions["sDSY"] == 2 * QUAD_BYTES and regions["sPX"] == regions["sDSX"] == QUAD_BYTES
    assert regions["sRing"] == 2 * 128 * 32 * 2
    if d_qk == 576:
        assert p.smem_bytes == 231424


def test_plan_rejects_bad_configs_and_kernel_takes_attn_sum():
    _cutlass()
    from mla_kernels.sm100.bwd_h128 import SparseMlaBwdSm100H128, bwd_h128_plan

    with pytest.raises(ValueError):
        bwd_h128_plan(640)
    with pytest.raises(ValueError):
        bwd_h128_plan(576, 256)
    k = SparseMlaBwdSm100H128(576, attn_sum=True, attn_sum_scaled=True)
    assert k.attn_sum and k.attn_sum_scaled and k.ws_row_heads == 128


def test_quad_offset_is_a_permutation_of_16_byte_chunks():
    _cutlass()
    from mla_kernels.sm100.bwd_h128 import quad_offset

    offs = sorted(quad_offset(h, t) for h in range(128) for t in range(32))
    assert offs == list(range(0, 128 * 64, 2))
    # quadrant a (heads 64 a ..) is the contiguous 4 KB block a: what one bulk copy moves
    assert {quad_offset(h, t) // 4096 for h in range(64, 128) for t in range(32)} == {1}


@pytest.mark.parametrize("h_q,two", [(64, False), (128, True), (192, False), (256, True)])
def test_dispatch_picks_the_2cta_kernel_for_h_q_multiple_of_128(h_q, two, monkeypatch):
    _cutlass()
    from mla_kernels import sm100

    monkeypatch.delenv(sm100.ENV_BWD_KERNEL, raising=False)
    assert sm100.bwd_two_cta(h_q) is two
    name_auto = sm100.BACKEND.bwd_name
    monkeypatch.setenv(sm100.ENV_BWD_KERNEL, "1cta")
    assert sm100.bwd_two_cta(h_q) is False
    assert sm100.BACKEND.bwd_name != name_auto  # a separate compile-cache entry
    monkeypatch.setenv(sm100.ENV_BWD_KERNEL, "2cta")
    assert sm100.bwd_two_cta(h_q) is two
    monkeypatch.setenv(sm100.ENV_BWD_KERNEL, "bogus")
    with pytest.raises(ValueError):
        sm100.bwd_two_cta(h_q)
    with pytest.raises(ValueError):
        sm100.compile_bwd(576, 64, False, two_cta=True)


def test_canary_key_tells_the_backward_kernels_apart(monkeypatch):
    _cutlass()
    import torch

    from mla_kernels import sm100
    from mla_kernels.common.problem import Problem

    kv = torch.zeros(16, 576, dtype=torch.bfloat16)
    p = Problem(torch.zeros(2, 128, 576, dtype=torch.bfloat16), kv, torch.zeros(2, 128, dtype=torch.int32), 0.1, 512,
                None, None, kv.shape)
    monkeypatch.delenv(sm100.ENV_BWD_KERNEL, raising=False)
    k2 = sm100.BACKEND.config_key("bwd", p)
    monkeypatch.setenv(sm100.ENV_BWD_KERNEL, "1cta")
    assert sm100.BACKEND.config_key("bwd", p) != k2


def test_host_sizes_the_deterministic_workspace_per_128_heads():
    _cutlass()
    from mla_kernels.common.bwd_host import ws_row_blocks
    from mla_kernels.sm100.bwd import SparseMlaBwdSm100
    from mla_kernels.sm100.bwd_h128 import SparseMlaBwdSm100H128

    assert ws_row_blocks(SparseMlaBwdSm100H128(576), 256) == 2
    assert ws_row_blocks(SparseMlaBwdSm100(576), 256) == 4
    assert ws_row_blocks(object(), 128) == 2  # the sm90 kernel: 64 heads per row block


# ---------------------------------------------------------------------------------------------
# Layout contract
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_qk", [576, 512])
def test_operand_layouts_match_the_writers(d_qk, trace_for_sm100):
    cute = _cutlass()
    from mla_kernels.sm100.bwd_h128 import KDQ_TILE_BYTES, RING_STAGE_BYTES, SparseMlaBwdSm100H128, quad_offset

    k = SparseMlaBwdSm100H128(d_qk)
    slots = tuple(range(k.n_dq))  # a tuple: `range` inside cute.jit becomes a dynamic loop
    got = {}
    swz = {}

    @cute.jit
    def trace():
        sQ, sDO, sKh, sDSa, sKdq, sRing, sY = k.smem_layouts()
        sRing1, sYk = k.step_layouts()
        for m in (0, 5, 64, 127):
            for h in (0, 9, 31):
                got[("RING1", m, h)] = (cute.crd2idx((((m % 64, m // 64), h % 16), 0, h // 16, 0), sRing1.outer),
                                        cute.crd2idx((((m % 64, m // 64), h % 16), 0, h // 16, 0), sRing.outer))
        for kc in (0, 1, 2, 3):
            for h in (0, 9, 31):
                for t in (0, 9, 31):
                    hh = 32 * kc + h
                    got[("YK", kc, h, t)] = (cute.crd2idx(((t, h % 16), 0, h // 16, 0), sYk.outer),
                                             cute.crd2idx(((t, hh % 16), 0, hh // 16, 0), sY.outer))
        swz["RING1"], swz["YK"] = str(sRing1.inner), str(sYk.inner)
        for name, lay in (("Q", sQ), ("DO", sDO), ("KH", sKh), ("DSA", sDSa), ("KDQ", sKdq), ("RING", sRing),
                          ("Y", sY)):
            swz[name] = str(lay.inner)
        for r in (0, 1, 7, 8, 31, 63):
            for c in (0, 8, 17, 63, 64, 100, 511):
                got[("Q", r, c)] = cute.crd2idx(((r, c % 16), 0, (c % 64 // 16, c // 64), 0), sQ.outer)
                got[("DO", r, c)] = cute.crd2idx(((r, c % 16), 0, (c % 64 // 16, c // 64), 0), sDO.outer)
                if r < 32:
                    got[("KH", r, c)] = cute.crd2idx(((r, c % 16), 0, (c % 64 // 16, c // 64), 0), sKh.outer)
        for h in (0, 1, 9, 63):
            for t in (0, 7, 8, 31, 32, 63):
                got[("DSA", h, t)] = cute.crd2idx(((h, t % 16), 0, t // 16, 0), sDSa.outer)
        for h in (0, 1, 2, 5, 9, 63, 64, 66, 100, 127):
            for t in (0, 7, 8, 9, 16, 31):
                # dKV^T's B: (token n of this CTA's 32, head k of 128), MN-major
                got[("Y", h, t)] = cute.crd2idx(((t, h % 16), 0, h // 16, 0), sY.outer)
        for n in (0, 1, 9, 63):
            for t in (0, 7, 8, 31, 32, 63):
                for j in slots:
                    got[("KDQ", n, t, j)] = cute.crd2idx(((n, t % 16), 0, t // 16, j), sKdq.outer)
        for m in (0, 1, 63, 64, 127):
            for h in (0, 7, 8, 31):
                for st in (0, 1):
                    got[("RING", m, h, st)] = cute.crd2idx((((m % 64, m // 64), h % 16), 0, h // 16, st),
                                                           sRing.outer)

    trace()
    assert got
    assert swz == {"Q": "S<3,4,3>", "DO": "S<3,4,3>", "KH": "S<3,4,3>", "DSA": "S<3,4,3>", "KDQ": "S<3,4,3>",
                   "RING": "S<3,4,3>", "Y": "S<2,4,3>", "RING1": "S<3,4,3>", "YK": "S<2,4,3>"}
    for key, elem in got.items():
        kind = key[0]
        if kind == "RING1":  # the rolled loop's one-stage view = stage 0 of the ring
            assert int(elem[0]) == int(elem[1]), key
            continue
        if kind == "YK":  # step kc's view, offset by kc * 32 * 32 elements = heads 32 kc .. of sPY/sDSY
            assert int(elem[0]) + key[1] * 32 * 32 == int(elem[1]), key
            continue
        if kind == "Y":
            # the math warps' quadrant rows (64-byte swizzle), moved byte for byte by the exchange
            assert _sw64(2 * int(elem)) == quad_offset(key[1], key[2]), key
            continue
        phys = _sw128(2 * int(elem))
        if kind in ("Q", "DO"):
            assert phys == _rowtile_offset(key[1], key[2], 64), key
        elif kind == "KH":
            assert phys == _rowtile_offset(key[1], key[2], 32), key
        elif kind == "DSA":
            # the math warps store head h's 64 tokens as one 128-byte swizzled row
            assert phys == _rowtile_offset(key[1], key[2], 64), key
        elif kind == "KDQ":
            # slot j = the KvGather(rows=64) tile of token t, dim n of the CTA's 64 dims
            _, n, t, j = key
            assert phys == j * KDQ_TILE_BYTES + _rowtile_offset(t, n, 64), key
        else:  # RING: (dim m of the CTA's 128, head h of the step's 32) = copy_dense_rows(n_threads=32)'s [32 x 128]
            _, m, h, st = key
            assert phys == st * RING_STAGE_BYTES + _rowtile_offset(h, m, 32), key


def test_tmem_accumulator_folds(trace_for_sm100):
    """32x32b on the cta_group::2 accumulators: M128 (S, dP, dQ) puts this CTA's row i in lane i
    for the first N/2 columns and lane 64 + i for the rest; M256 (dKV^T) puts row i in lane i."""
    cute = _cutlass()
    from cutlass import Float32
    from cutlass.cute.nvgpu import tcgen05

    from mla_kernels.sm100.bwd_h128 import B_H, B_TOPK, DKV_M, DKV_N, DQ_N, SparseMlaBwdSm100H128

    k = SparseMlaBwdSm100H128(576)
    got = {}

    @cute.jit
    def trace():
        tmem = cute.make_ptr(Float32, 0, cute.AddressSpace.tmem, assumed_align=16)
        for name, mma, shp in (("S", k._mma_s(), (B_H, B_TOPK)), ("DQ", k._mma_dq(), (B_H, DQ_N)),
                               ("DKV", k._mma_dkv(), (DKV_M, DKV_N))):
            t = cute.make_tensor(tmem, mma.make_fragment_C(mma.partition_shape_C(shp)).layout)
            c = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), Float32), t)
            crd = mma.get_slice(0).partition_C(cute.make_identity_tensor(shp))
            for th in (0, 5, 63, 64, 100, 127):
                part = c.get_slice(th).partition_D(crd)
                got[(name, th)] = [part[i] for i in range(cute.size(part))]

    trace()
    for (name, th), coords in got.items():
        cs = [tuple(int(x) for x in c) for c in coords]
        if name == "S":
            assert cs == [(th % 64, 32 * (th // 64) + j) for j in range(32)], th
        elif name == "DQ":
            assert cs == [(th % 64, 64 * (th // 64) + j) for j in range(64)], th
        else:
            assert cs == [(th, j) for j in range(64)], th


# ---------------------------------------------------------------------------------------------
# Compile report
# ---------------------------------------------------------------------------------------------



# (the report's sm100_bwd_d512_h128_2cta_topklen_dlse and _asum variants pass the same checks;
# left out here for test time: each compile takes 10-20 s)
NAMES = {"sm100_bwd_d576_h128_2cta": (576, False), "sm100_bwd_d576_h128_2cta_det": (576, True)}


@pytest.fixture(scope="module")
def report_2cta():
    return compile_records("sm_100a", set(NAMES))


def check_sass(r, d_qk, det, asum=False):
    """The 2-CTA backward's compile-report assertions (also used by the compile-report tests of
    the other variants)."""
    from mla_kernels.sm100.bwd_h128 import THREADS, bwd_h128_plan

    p = bwd_h128_plan(d_qk)
    assert r["spill_bytes"] == 0 and r["registers"] is not None and r["registers"] * THREADS <= 65536
    assert r["smem_bytes"] is not None and r["smem_bytes"] <= p.smem_bytes <= SMEM_LIMIT
    if r["sass"] is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    sass, base = r["sass"], r["sass_base"]
    n_k, n_v, n_dq, n_r, n_g = d_qk // 64, 512 // 64, len(p.dq_tile_dims), len(p.round_dims), len(p.ring_gens)
    # no single-CTA tcgen05 op: every MMA and commit is cta_group::2
    for op, n in sass.items():
        if op.startswith(("UTCHMMA", "UTCBAR", "UTCQMMA", "UTCOMMA", "UTCATOMSWS.FIND_AND_SET")):
            assert ".2CTA" in op, op
    assert sass.get("UTCATOMSWS.2CTA.FIND_AND_SET.ALIGN", 0) >= 1  # the cta_group::2 TMEM alloc
    # S/dP: 4 per 64 dims; dQ: 4 per tile; dKV^T: a rolled loop over the four 32-head steps of each
    # (round, product), 2 MMAs in its body
    n_rp = n_g // 4
    assert sass.get("UTCHMMA.2CTA", 0) == 4 * (n_k + n_v) + 4 * n_dq + 2 * n_rp
    # commits: kvh_free, s_full, kdq_free, pds_free, dq_full + ring_empty per loop body + one per round
    assert sass.get("UTCBAR.2CTA.MULTICAST", 0) == 5 + n_rp + n_r == base.get("UTCBAR", 0)
    assert sass.get("UBLKCP.S.S", 0) == 2  # the P and dS quadrants to the peer
    assert base.get("LDTM", 0) >= 2 + 2 * n_dq + 2 * n_r
    assert sass.get("MUFU.EX2", 0) == 32
    if det:
        assert base.get("REDG", 0) == 0 and base.get("ATOMG", 0) == 0
    else:
        assert sass.get("REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU", 0) == 16 * n_r
    if asum:
        assert base.get("SHFL", 0) >= 31  # the 32-lane reduce-scatter of attn_sum
    assert base.get("LDL", 0) == 0 and base.get("STL", 0) == 0 and base.get("HGMMA", 0) == 0


@pytest.mark.compile
@pytest.mark.parametrize("name", sorted(NAMES))
def test_sm100_bwd_h128_sass(report_2cta, name):
    r = report_2cta[name]
    assert r["arch"] == "sm_100a"
    check_sass(r, *NAMES[name])


@pytest.mark.compile
def test_sm103a_bwd_h128_sass():
    recs = list(compile_records("sm_103a", {"sm100_bwd_d576_h128_2cta_topklen_asum_sink"}).values())
    assert len(recs) == 1 and recs[0]["arch"] == "sm_103a"
    check_sass(recs[0], 576, False, asum=True)


# ---------------------------------------------------------------------------------------------
# GPU runtime (compute capability 10.x): the 2-CTA kernel through dispatch
# ---------------------------------------------------------------------------------------------

needs_sm100 = skip_unless_sm100()


@pytest.mark.parametrize("s_q,s_kv,topk", [(1, 128, 128), (62, 592, 128), (213, 1840, 256), (213, 95, 128)])
@pytest.mark.parametrize("h_q", [128, 256])
@pytest.mark.parametrize("d_qk", [576, 512])
@needs_sm100
@pytest.mark.gpu
def test_bwd_h128_shapes(s_q, s_kv, topk, h_q, d_qk, monkeypatch):
    from test_sm100_bwd import run_and_check

    monkeypatch.setenv("MLA_KERNELS_SM100_BWD", "2cta")
    case = make_case(s_q, h_q, d_qk, s_kv, topk, device="cuda", invalid_frac=0.1, empty_rows=2)
    run_and_check(case, monkeypatch, attn_sum=True)


@pytest.mark.parametrize("sink", [None, "finite"])
@needs_sm100
@pytest.mark.gpu
def test_bwd_h128_topk_length_sink_deterministic(sink, monkeypatch):
    import torch

    from test_sm100_bwd import run_and_check

    monkeypatch.setenv("MLA_KERNELS_SM100_BWD", "2cta")
    case = make_case(213, 128, 576, 1840, 256, device="cuda", topk_length=True, sink=sink, dup_frac=0.2)
    run_and_check(case, monkeypatch, attn_sum=True)
    runs = [run_and_check(case, monkeypatch, deterministic=True, attn_sum=True) for _ in range(2)]
    for a, b in zip(*runs):
        if a is not None:
            assert torch.equal(a, b), "deterministic backward differs between runs"


# ---------------------------------------------------------------------------------------------
# The pair decomposition, emulated on the CPU with the plan's index maps (no kernel)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_qk", [576, 512])
def test_pair_decomposition_matches_reference(d_qk):
    """Emulates, per (token, block), exactly the operand splits the kernel issues: S/dP from the
    two CTAs' 32-row K halves; P, dS rounded to bf16 where they become MMA operands; dQ tile j
    from the regathered K tiles (CTA r: dims ``64 kdq_tiles[r][j]``..); the quadrant exchange
    (CTA r keeps P/dS of its heads for its tokens, receives the peer's heads for its tokens);
    dKV^T per round and CTA from the ring's 32-head steps of Q^T / dO^T (all 128 heads) times the
    quadrants, scattered from the round's stored rows; attn_sum from the fp32 P per CTA (two
    64-head partials, summed by the host).  Checks dQ, dKV, attn_sum against the reference."""
    _cutlass()
    import torch

    from mla_kernels import reference as ref
    from mla_kernels.sm100.bwd_h128 import RING_K, bwd_h128_plan

    torch.manual_seed(0)
    p = bwd_h128_plan(d_qk)
    case = make_case(3, 128, d_qk, 300, 192, invalid_frac=0.1, empty_rows=1)
    q, kv = case.q.float(), case.kv.float()
    out, _, lse = ref.sparse_mla_fwd_ref(q, kv, case.indices, case.sm_scale, 512, None, None)
    dout = (torch.randn(out.shape) * 0.1).bfloat16().float()
    want = ref.sparse_mla_bwd_ref(q, kv, out.float(), dout, case.indices, lse, case.sm_scale, 512,
                                  return_attn_sum=True)
    idx2 = case.indices.reshape(case.indices.shape[0], -1)
    valid = ref.valid_mask(case.indices, kv.shape[0])
    lse2 = lse.float() * 1.4426950408889634
    delta = (out.float() * dout).sum(-1)
    kv2 = kv.reshape(kv.shape[0], d_qk)
    dq = torch.zeros_like(q)
    dkv = torch.zeros(kv.shape[0], d_qk)
    asum = torch.zeros(q.shape[0], 2, idx2.shape[1])
    c = case.sm_scale * 1.4426950408889634
    for s in range(q.shape[0]):
        for b in range(idx2.shape[1] // 64):
            slots = torch.arange(64 * b, 64 * b + 64)
            ok = valid[s, slots]
            rows = torch.where(ok, idx2[s, slots], torch.zeros_like(slots)).long()
            kblk = torch.where(ok[:, None], kv2[rows], torch.zeros(64, d_qk))  # zero-filled gather
            kh = [kblk[32 * r:32 * r + 32] for r in (0, 1)]  # sKh of CTA r (its tokens)
            P, dS = [], []
            for r in (0, 1):
                hs = slice(64 * r, 64 * r + 64)
                kfull = torch.cat([kh[0], kh[1]])  # B halves: CTA0 tokens 0..31, CTA1 32..63
                S = q[s, hs] @ kfull.T
                dP = dout[s, hs] @ kfull[:, :512].T
                pr = torch.exp2(S * c - lse2[s, hs, None]) * ok[None, :]
                P.append(pr)
                dS.append(pr * (dP * case.sm_scale - delta[s, hs, None] * case.sm_scale))
                asum[s, r, slots] = pr.sum(0)  # fp32, this CTA's 64 heads
            # the exchange: CTA r's quadrants = [heads 0..63 | heads 64..127] x its 32 tokens, bf16
            quadP = [torch.cat([P[h][:, 32 * r:32 * r + 32] for h in (0, 1)]).bfloat16().float() for r in (0, 1)]
            quadDS = [torch.cat([dS[h][:, 32 * r:32 * r + 32] for h in (0, 1)]).bfloat16().float() for r in (0, 1)]
            for r in (0, 1):
                hs = slice(64 * r, 64 * r + 64)
                dsa = dS[r].bfloat16().float()  # sDS: this CTA's heads x 64 tokens
                for j, first in enumerate(p.dq_tile_dims):
                    # regathered K tiles: CTA t supplies dims 64 kdq_tiles[t][j].. of all 64 tokens
                    B = torch.cat([kblk[:, 64 * p.kdq_tiles[t][j]:64 * p.kdq_tiles[t][j] + 64] for t in (0, 1)], dim=1)
                    tile = dsa @ B
                    keep = slice(p.dq_store_from[j], 128)
                    dq[s, hs, first + p.dq_store_from[j]:first + 128] += tile[:, keep]
            for j, first in enumerate(p.round_dims):
                for r in (0, 1):  # CTA r: dims first + 128 r .., all 64 tokens (N halves of both CTAs)
                    d0 = first + 128 * r
                    acc = torch.zeros(128, 64)
                    for kc in range(128 // RING_K):
                        hk = slice(RING_K * kc, RING_K * kc + RING_K)
                        qt = q[s, hk, d0:d0 + 128].T  # the ring stage (bf16 inputs)
                        acc += qt @ torch.cat([quadDS[0][hk], quadDS[1][hk]], dim=1)
                    if p.round_has_do[j]:
                        for kc in range(128 // RING_K):
                            hk = slice(RING_K * kc, RING_K * kc + RING_K)
                            acc += dout[s, hk, d0:d0 + 128].T @ torch.cat([quadP[0][hk], quadP[1][hk]], dim=1)
                    lo = p.round_store_row[r][j]
                    for t in range(64):
                        if ok[t]:
                            dkv[rows[t], d0 + lo:d0 + 128] += acc[lo:, t]
    assert rel_l2(dq, want[0]) <= 1e-2, rel_l2(dq, want[0])
    assert rel_l2(dkv, want[1].reshape(dkv.shape)) <= 1e-2, rel_l2(dkv, want[1].reshape(dkv.shape))
    got_asum = asum.sum(1)
    assert rel_l2(got_asum, want[3]) <= 1e-3, rel_l2(got_asum, want[3])


# ---------------------------------------------------------------------------------------------
# Synchronisation protocol: a host model of the kernel's mbarrier schedule
# ---------------------------------------------------------------------------------------------
#
# As for the forward (test_sm100_fwd.py, whose simulator this reuses): every role is a generator
# yielding the waits it performs (same barriers and parities as the kernel); cp.async landings
# and bulk copies are asynchronous events at random later times; tcgen05 MMAs and commits
# complete in issue order.  Every read must see the block it expects and no write may land under
# an unfinished reader.  This proves the schedule, not the code: keep the two in step.


class _TxBar:
    """An mbarrier with a transaction count (``arrive.expect_tx`` / ``complete_tx``)."""

    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.phases = count, count, 0, 0

    def _check(self):
        if self.pending == 0 and self.tx == 0:
            self.phases += 1
            self.pending = self.count

    def arrive_expect_tx(self, n: int):
        assert self.pending > 0, "arrival on a phase that has no arrival pending"
        self.tx += n
        self.pending -= 1
        self._check()

    def complete_tx(self, n: int):
        self.tx -= n
        self._check()

    def passed(self, parity: int) -> bool:
        return self.phases % 2 != parity


def _model_bwd_2cta(sim, n: int, d_qk: int = 576, fault: str = ""):
    from test_sm100_fwd import _Bar as B

    from mla_kernels.sm100.bwd_h128 import bwd_h128_plan

    p = bwd_h128_plan(d_qk)
    G = len(p.ring_gens)
    R = len(p.round_dims)
    pair = (0, 1)
    q_local, kvh_local, kdq_local = [B(1), B(1)], [B(1), B(1)], [B(1), B(1)]
    q_peer, kvh_peer, kdq_peer, px_peer = B(1), B(1), B(1), B(1)
    kvh_free, kdq_free, s_full, pds_free, dq_full = ([B(1), B(1)] for _ in range(5))
    s_empty, pds_full = B(2), B(2)  # CTA 0; one arrival per CTA's math warps
    px_full = [_TxBar(1), _TxBar(1)]
    ring_full = [[B(1), B(1)], [B(1), B(1)]]
    ring_peer = [B(1), B(1)]
    ring_empty = [[B(1), B(1)], [B(1), B(1)]]
    dkv_full = [[B(1), B(1)], [B(1), B(1)]]
    dkv_empty = [B(2), B(2)]
    st = dict(kh=[None, None], kh_readers=[0, 0], S=[None, None], S_read=[-1, -1], ds=[None, None],
              quad_own=[None, None], quad_peer=[None, None], stage=[None, None], ds_readers=0, quad_readers=0,
              stage_busy=[0, 0], ring=[[None, None], [None, None]], ring_readers=[[0, 0], [0, 0]],
              dkv=[[None, None], [None, None]], drained=[[None, None], [None, None]], dq=-1)
    uses = []  # the (block, round) sequence of each dKV buffer
    for b in range(n):
        for j in range(R):
            uses.append((p.round_buffer(j)[0], (b, j)))

    def prev_use(buf, bj):
        seq = [x for k, x in uses if k == buf]
        i = seq.index(bj)
        return seq[i - 1] if i else None

    def gather(r):
        if n:
            sim.later(q_local[r].arrive)
        for b in range(n):
            yield sim.wait(kdq_free[r], (b & 1) ^ 1)

            def land_own(b=b):
                assert st["kh_readers"][r] == 0, "sKh overwritten under an MMA"
                st["kh"][r] = ("own", b)
                kvh_local[r].arrive()

            sim.later(land_own)
            yield sim.wait(kvh_free[r], (b & 1) ^ (1 if fault == "kvh_free_parity" else 0))

            def land_kdq(b=b):
                assert st["kh_readers"][r] == 0, "sKh overwritten under an MMA"
                st["kh"][r] = ("kdq", b)
                kdq_local[r].arrive()

            sim.later(land_kdq)

    def ring(r):
        for b in range(n):
            for g in range(G):
                s, ph = g % 2, (g // 2) & 1
                yield sim.wait(ring_empty[r][s], ph ^ (0 if fault == "ring_empty_parity" else 1))

                def land(b=b, g=g, s=s):
                    assert st["ring_readers"][r][s] == 0, "ring stage overwritten under an MMA"
                    st["ring"][r][s] = (b, g)
                    ring_full[r][s].arrive()

                sim.later(land)

    def relay():
        if n:
            yield sim.wait(q_local[1], 0)
            q_peer.arrive()
        for b in range(n):
            yield sim.wait(kvh_local[1], b & 1)
            kvh_peer.arrive()
            yield sim.wait(kdq_local[1], b & 1)
            kdq_peer.arrive()
            if fault != "relay_skips_px":
                yield sim.wait(px_full[1], b & 1)
            px_peer.arrive()
            for g in range(G):
                yield sim.wait(ring_full[1][g % 2], (g // 2) & 1)
                ring_peer[g % 2].arrive()

    def mma():
        if n:
            yield sim.wait(q_local[0], 0)
            yield sim.wait(q_peer, 0)
        for b in range(n):
            yield sim.wait(kvh_local[0], b & 1)
            yield sim.wait(kvh_peer, b & 1)
            yield sim.wait(s_empty, (b & 1) ^ 1)
            assert st["kh"] == [("own", b)] * 2
            for r in pair:
                st["kh_readers"][r] += 1

            def s_done(b=b):
                assert st["kh"] == [("own", b)] * 2 and st["S_read"] == [b - 1] * 2, "S overwritten before read"
                st["S"] = [b, b]
                for r in pair:
                    st["kh_readers"][r] -= 1
                    kvh_free[r].arrive()
                    s_full[r].arrive()

            sim.mma(s_done)
            yield sim.wait(pds_full, b & 1)
            yield sim.wait(kdq_local[0], b & 1)
            yield sim.wait(kdq_peer, b & 1)
            assert st["kh"] == [("kdq", b)] * 2 and st["ds"] == [b, b]
            for r in pair:
                st["kh_readers"][r] += 1
            st["ds_readers"] += 1

            def dq_done(b=b):
                assert st["kh"] == [("kdq", b)] * 2 and st["ds"] == [b, b]
                st["dq"] = b
                for r in pair:
                    st["kh_readers"][r] -= 1
                    kdq_free[r].arrive()

            sim.mma(dq_done)
            yield sim.wait(px_full[0], b & 1)
            yield sim.wait(px_peer, b & 1)
            assert st["quad_own"] == [b, b] and st["quad_peer"] == [b, b], "quadrants not complete"
            st["quad_readers"] += 1
            g = 0
            for j in range(R):
                buf, u_per_b, u = p.round_buffer(j)
                yield sim.wait(dkv_empty[buf], ((u_per_b * b + u) & 1) ^ (0 if fault == "dkv_empty_parity" else 1))
                for _ in range(1 + int(p.round_has_do[j])):
                    for _ in range(4):
                        s, ph = g % 2, (g // 2) & 1
                        yield sim.wait(ring_full[0][s], ph)
                        yield sim.wait(ring_peer[s], ph)
                        assert st["ring"][0][s] == st["ring"][1][s] == (b, g)
                        for r in pair:
                            st["ring_readers"][r][s] += 1

                        def step_done(b=b, g=g, s=s, j=j, buf=buf):
                            assert st["ring"][0][s] == st["ring"][1][s] == (b, g)
                            assert st["quad_own"] == [b, b] and st["quad_peer"] == [b, b]
                            for r in pair:
                                if st["dkv"][r][buf] != (b, j):  # the round's first MMA: buffer drained?
                                    assert st["drained"][r][buf] == prev_use(buf, (b, j)), "dKV buffer not drained"
                                    st["dkv"][r][buf] = (b, j, "partial")
                                st["ring_readers"][r][s] -= 1
                                ring_empty[r][s].arrive()

                        sim.mma(step_done)
                        g += 1

                def round_done(b=b, j=j, buf=buf):
                    for r in pair:
                        st["dkv"][r][buf] = (b, j)
                        dkv_full[r][buf].arrive()

                sim.mma(round_done)

            def block_done(b=b):
                st["ds_readers"] -= 1
                st["quad_readers"] -= 1
                for r in pair:
                    pds_free[r].arrive()

            sim.mma(block_done)

        def last(n=n):
            assert st["dq"] == n - 1
            for r in pair:
                dq_full[r].arrive()

        sim.mma(last)

    def math(r):
        for b in range(n):
            yield sim.wait(s_full[r], b & 1)
            assert st["S"][r] == b
            st["S_read"][r] = b
            s_empty.arrive()
            # (with tcgen05 completing in order, S_FULL(b) already implies PDS_FREE(b-1); the
            # kernel waits anyway -- the model checks the schedule holds either way)
            yield sim.wait(pds_free[r], (b & 1) ^ 1)
            px_full[r].arrive_expect_tx(2)
            assert st["ds_readers"] == 0 and st["quad_readers"] == 0 and st["stage_busy"][r] == 0, \
                "P/dS overwritten under a reader"
            st["ds"][r], st["quad_own"][r], st["stage"][r] = b, b, b
            pds_full.arrive()
            st["stage_busy"][r] += 1

            def land(b=b):
                peer = 1 - r
                assert st["stage"][r] == b
                assert st["quad_readers"] == 0, "peer quadrant overwritten under an MMA"
                st["quad_peer"][peer] = b
                st["stage_busy"][r] -= 1
                px_full[peer].complete_tx(2)

            sim.later(land)
            yield lambda: st["stage_busy"][r] == 0  # cp.async.bulk.wait_group.read
        yield sim.wait(dq_full[r], 0)
        assert st["dq"] == n - 1

    def drain(r):
        for b in range(n):
            for j in range(R):
                buf, u_per_b, u = p.round_buffer(j)
                yield sim.wait(dkv_full[r][buf], (u_per_b * b + u) & 1)
                assert st["dkv"][r][buf] == (b, j)
                st["drained"][r][buf] = (b, j)
                dkv_empty[buf].arrive()

    sim.roles += [gather(0), gather(1), ring(0), ring(1), relay(), mma(), math(0), math(1), drain(0), drain(1)]


@pytest.mark.parametrize("d_qk", [576, 512])
def test_sync_protocol_never_deadlocks_or_races(d_qk):
    _cutlass()
    from test_sm100_fwd import _Sim

    for n in range(0, 5):
        for seed in range(40):
            sim = _Sim(seed * 131 + n)
            _model_bwd_2cta(sim, n, d_qk)
            sim.run()


@pytest.mark.parametrize("fault", ["relay_skips_px", "dkv_empty_parity", "ring_empty_parity", "kvh_free_parity"])
def test_sync_protocol_model_catches_faults(fault):
    """The model is not vacuous: each injected schedule bug fails some interleaving."""
    _cutlass()
    from test_sm100_fwd import _Sim

    failed = False
    for seed in range(300):
        sim = _Sim(seed)
        _model_bwd_2cta(sim, 4, 576, fault=fault)
        try:
            sim.run()
        except AssertionError:
            failed = True
            break
    assert failed, fault


@pytest.mark.parametrize("n_threads,n_rows", [(32, 32), (128, 64)])
def test_copy_dense_rows_writes_the_tile_layout(n_threads, n_rows, monkeypatch):
    """The ring loader (one warp) and the Q/dO loads (a warpgroup) put source byte ``(row, col)``
    at the SW128 tile offset the MMA layouts are checked against (``_rowtile_offset``), each
    16-byte chunk exactly once.  Runs the helper on the host with a recording cp.async."""
    _cutlass()
    from mla_kernels.common import gather

    rec = []
    monkeypatch.setattr(gather.dev, "cp_async_16_zfill", lambda d, s, ok, pol: rec.append((int(d), int(s))))
    row_bytes, n_tiles = 1152, 2
    for t in range(n_threads):
        gather.copy_dense_rows(0, 0, row_bytes, n_rows, n_tiles, t, 0, n_threads=n_threads)
    assert len(rec) == n_rows * n_tiles * 8
    want = {_rowtile_offset(r, c, n_rows): r * row_bytes + 2 * c for r in range(n_rows) for c in range(0, 64 * n_tiles, 8)}
    assert dict(rec) == want
