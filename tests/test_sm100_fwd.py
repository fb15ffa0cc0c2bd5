"""sm100 sparse forward: what can be proven without a Blackwell GPU, and the GPU checks.

* host logic (no compile): the smem/TMEM plan, grid and head groups, the backend's answers;
* layout contract (trace only): the smem layouts the MMA descriptors are built from place every
  element where the writers put it (``KvGather``/``copy_dense_rows`` for Q, K and V; the softmax
  warps' swizzled 32-bit stores for P); the 16x256b TMEM loads/stores give each thread the Hopper
  accumulator fragment (rows ``fragment_row``, columns ``8 g + 2 (t%4) + v``) the softmax helpers
  assume; O's two N256 halves sit at TMEM lanes +0 / +16 of the same columns;
* the same for the 2-CTA h128 kernel (``fwd_h128.py``): which K rows / V columns each CTA of the
  pair feeds the MMAs (the DSL's partition of the cta_group::2 operands), the folded TMEM layout
  of its scores and O (thread t: row t % 64, column half t / 64);
* synchronisation protocol: a host model of both kernels' mbarrier schedules (same barriers,
  counts and parities) run under random interleavings: no deadlock, no buffer read before it is
  written or overwritten before its reader finished (and injected schedule bugs are caught);
* compile report (marked ``compile``): sm_100a/sm_103a SASS has the 1-CTA tcgen05 MMAs (or only
  ``.2CTA`` ones and multicast commits for the cluster kernel), TMEM loads/stores, the cp.async
  gather and ``MUFU.EX2``, no spills, smem within budget;
* GPU runtime (compute capability 10.x only, skipped elsewhere): kernel vs the float32 reference,
  the cases of ``test_sm90_fwd.py``.
"""

from __future__ import annotations


import pytest
import torch

from mla_kernels.common.problem import Problem

from conftest import assert_close_fwd, make_case, skip_unless_sm100
from conftest import compile_report_module as _compile_report
from conftest import needs_cutlass as _cutlass, sw128 as _sw128, tile_offset as _writer_offset

SMEM_LIMIT = 232448



# ---------------------------------------------------------------------------------------------
# Host logic
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_qk", [576, 512])
def test_plan_fits_smem(d_qk):
    _cutlass()
    from mla_kernels.sm100.fwd import B_H, B_TOPK, KV_STAGES, SMEM_HEADER_BYTES, fwd_plan

    p = fwd_plan(d_qk)
    assert p.n_k_tiles * 64 == d_qk
    assert p.q_bytes == B_H * d_qk * 2 and p.kv_stage_bytes == B_TOPK * d_qk * 2 and p.p_bytes == B_H * B_TOPK * 2
    assert p.smem_bytes == SMEM_HEADER_BYTES + p.q_bytes + KV_STAGES * p.kv_stage_bytes + p.p_bytes
    assert p.smem_bytes <= SMEM_LIMIT
    # 1024-byte alignment of every swizzled buffer (the struct lays them out in this order)
    assert p.q_bytes % 1024 == 0 and p.kv_stage_bytes % 1024 == 0 and p.p_bytes % 1024 == 0


def test_tmem_plan_within_512_columns_and_disjoint():
    _cutlass()
    from mla_kernels.sm100.fwd import B_TOPK, D_V, LANE16, O_CHUNK, TMEM_ALLOC, V_HALF, FwdPlan, SparseMlaFwdSm100

    regions = FwdPlan.tmem_regions()
    assert TMEM_ALLOC == 512
    for name, l0, l1, c0, c1 in regions:
        assert 0 <= l0 < l1 <= 32 and 0 <= c0 < c1 <= TMEM_ALLOC, name
        assert l1 - l0 == 16, name  # an M64 tile uses 16 lanes of each 32-lane sub-partition
    for i, a in enumerate(regions):
        for b in regions[i + 1:]:
            lanes = a[1] < b[2] and b[1] < a[2]
            cols = a[3] < b[4] and b[3] < a[4]
            assert not (lanes and cols), (a, b)
    # O chunk addressing covers exactly O's two halves, 64 columns at a time
    seen = set()
    for c in range(D_V // O_CHUNK):
        off = SparseMlaFwdSm100._o_chunk_offset(c)
        lane, col = divmod(off, LANE16)
        assert lane in (0, 1) and col % O_CHUNK == 0 and col + O_CHUNK <= V_HALF
        seen.add((lane, col))
    assert len(seen) == D_V // O_CHUNK
    assert ("S0", 0, 16, V_HALF, V_HALF + B_TOPK) in regions


def test_plan_rejects_unsupported():
    _cutlass()
    from mla_kernels.sm100.fwd import SparseMlaFwdSm100, fwd_plan

    with pytest.raises(ValueError, match="d_qk"):
        fwd_plan(256)
    with pytest.raises(ValueError, match="d_v"):
        SparseMlaFwdSm100(576, 256)


@pytest.mark.parametrize("h_q,groups", [(64, 1), (128, 2), (192, 3), (256, 4)])
def test_head_groups_and_grid(h_q, groups):
    from mla_kernels.sm100 import fwd_head_groups

    assert fwd_head_groups(h_q) == groups  # grid = s_q * groups CTAs of 288 threads
    with pytest.raises(ValueError):
        fwd_head_groups(96)


def test_canary_key_names_the_kernel(monkeypatch):
    from mla_kernels.sm100 import BACKEND, ENV_FWD_KERNEL

    p = _problem(h_q=128)
    auto = BACKEND.config_key("fwd", p)
    monkeypatch.setenv(ENV_FWD_KERNEL, "1cta")
    assert BACKEND.config_key("fwd", p) != auto
    assert BACKEND.config_key("attn_dist", p) == BACKEND.config_key("attn_dist", p)


def _problem(h_q=128, d_qk=576, dtype=torch.bfloat16, sm_scale=0.1, d_v=512):
    q = torch.zeros(2, h_q, d_qk, dtype=dtype)
    kv = torch.zeros(16, d_qk, dtype=dtype)
    idx = torch.zeros(2, 128, dtype=torch.int32)
    return Problem(q, kv, idx, sm_scale, d_v, None, None, kv.shape)


@pytest.mark.parametrize("h_q,d_qk", [(64, 576), (128, 512), (256, 576), (192, 512)])
def test_backend_supports_fwd(h_q, d_qk):
    from mla_kernels.sm100 import BACKEND, TOPK_BLOCK
    from mla_kernels.sm100.fwd import B_TOPK

    assert BACKEND.supports("fwd", _problem(h_q=h_q, d_qk=d_qk)) is None
    assert TOPK_BLOCK % B_TOPK == 0  # the API's padding suits the forward's blocks too


@pytest.mark.parametrize(
    "kw,reason",
    [
        (dict(dtype=torch.float16), "dtype"),
        (dict(d_qk=256), "d_qk=256"),
        (dict(h_q=96), "h_q=96"),
        (dict(sm_scale=0.0), "sm_scale"),
        (dict(d_v=256), "d_v=256"),
    ],
)
def test_backend_fwd_reasons(kw, reason):
    from mla_kernels.sm100 import BACKEND

    why = BACKEND.supports("fwd", _problem(**kw))
    assert why is not None and reason in why


# ---------------------------------------------------------------------------------------------
# Layout contract (host-side tracing, no compile)
# ---------------------------------------------------------------------------------------------




def _mmas(cute):
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    qk = sm100_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                            tcgen05.CtaGroup.ONE, (64, 64))
    pv = sm100_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                            tcgen05.CtaGroup.ONE, (64, 256))
    return qk, pv


@pytest.mark.parametrize("d_qk", [576, 512])
def test_mma_smem_layouts_match_the_writers(d_qk, trace_for_sm100):
    cute = _cutlass()
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass import BFloat16

    from mla_kernels.sm100.fwd import KV_STAGES, fwd_plan, p_word_offset

    plan = fwd_plan(d_qk)
    got = {}

    @cute.jit
    def trace():
        qk, pv = _mmas(cute)
        sQ = sm100_utils.make_smem_layout_a(qk, (64, 64, d_qk), BFloat16, 1)
        sK = sm100_utils.make_smem_layout_b(qk, (64, 64, d_qk), BFloat16, KV_STAGES)
        sP = sm100_utils.make_smem_layout_a(pv, (64, 256, 64), BFloat16, 1)
        sV = sm100_utils.make_smem_layout_b(pv, (64, 256, 64), BFloat16, 1)
        assert str(sQ.inner) == str(sK.inner) == str(sP.inner) == str(sV.inner) == "S<3,4,3>"
        for r in (0, 1, 7, 9, 33, 63):
            for c in (0, 8, 17, 100, 255, d_qk - 1):
                got[("Q", r, c)] = cute.crd2idx(((r, c % 16), 0, c // 16, 0), sQ.outer)
                for s in (0, KV_STAGES - 1):
                    got[("K", s, r, c)] = cute.crd2idx(((r, c % 16), 0, c // 16, s), sK.outer)
            for c in (0, 2, 9, 18, 40, 62):
                got[("P", r, c)] = cute.crd2idx(((r, c % 16), 0, c // 16, 0), sP.outer)
        # V^T (MN-major B): dim n (0..255 of one half), token k
        for n in (0, 1, 63, 64, 130, 255):
            for k in (0, 1, 15, 16, 47, 63):
                got[("V", n, k)] = cute.crd2idx(((n, k % 16), 0, k // 16, 0), sV.outer)

    trace()
    assert got
    for key, elem in got.items():
        phys = _sw128(2 * int(elem))
        kind = key[0]
        if kind == "Q":
            _, r, c = key
            assert phys == _writer_offset(r, c, 64), key
        elif kind == "K":
            _, s, r, c = key
            assert phys == s * plan.kv_stage_bytes + _writer_offset(r, c, 64), key
        elif kind == "P":
            _, r, c = key
            g, rem = divmod(c, 8)
            assert phys == 4 * p_word_offset(r, g, rem // 2) + 2 * (c % 2), key
        else:
            _, n, k = key
            # token k = KV row k, dim n = column n of the same [64 x d_qk] stage (the V half's
            # pointer offset of 4 tiles adds 4 * 64 * 128 bytes for dims 256..511)
            assert phys == _writer_offset(k, n, 64), key


def test_tmem_16x256b_gives_the_hopper_fragment(trace_for_sm100):
    """Thread t of the softmax warpgroup holds element i = v + 2 row + 4 g at (fragment_row(t,
    row), 8 g + 2 (t % 4) + v) of a 64 x 64 tile, for loads and for stores alike."""
    cute = _cutlass()
    from cutlass import Float32
    from cutlass.cute.nvgpu import tcgen05

    from mla_kernels.common import device as dev

    got = {}

    @cute.jit
    def trace():
        qk, _ = _mmas(cute)
        layout = qk.make_fragment_C(qk.partition_shape_C((64, 64))).layout
        tS = cute.make_tensor(cute.make_ptr(Float32, 0, cute.AddressSpace.tmem, assumed_align=16), layout)
        ld = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld16x256bOp(tcgen05.Repetition.x8), Float32), tS)
        st = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.St16x256bOp(tcgen05.Repetition.x8), Float32), tS)
        coords = qk.get_slice(0).partition_C(cute.make_identity_tensor((64, 64)))
        for t in (0, 1, 5, 31, 32, 77, 127):
            a = ld.get_slice(t).partition_D(coords)
            b = st.get_slice(t).partition_S(coords)
            got[t] = ([a[i] for i in range(cute.size(a))], [b[i] for i in range(cute.size(b))])

    trace()
    assert sorted(got) == [0, 1, 5, 31, 32, 77, 127]
    for t, (ld, st) in got.items():
        want = [None] * 32
        for g in range(8):
            for row in range(2):
                for v in range(2):
                    want[dev.acc_flat(v, row, g)] = ((t // 32) * 16 + (t % 32) // 4 + 8 * row, 8 * g + 2 * (t % 4) + v)
        assert [tuple(int(x) for x in c) for c in ld] == want, t
        assert [tuple(int(x) for x in c) for c in st] == want, t


def test_o_accumulator_halves_at_lane16(trace_for_sm100):
    """PV's (64 x 512) accumulator as the DSL lays it out: N-tile h at TMEM lane offset 16 h of the
    same 256 columns, rows in lanes 16-row groups of each sub-partition -- what the MMA issue
    (``tmem_ptr + h * LANE16``) and the 64-column chunk views (``_o_chunk_offset``) assume."""
    cute = _cutlass()

    from mla_kernels.sm100.fwd import LANE16, SparseMlaFwdSm100

    got = {}

    @cute.jit
    def trace():
        _, pv = _mmas(cute)
        full = pv.make_fragment_C(pv.partition_shape_C((64, 512))).layout
        half = pv.make_fragment_C(pv.partition_shape_C((64, 256))).layout
        for r in (0, 5, 16, 40, 63):
            for n in (0, 63, 64, 255, 256, 300, 511):
                got[("full", r, n)] = cute.crd2idx(((r, n % 256), 0, n // 256), full)
            for n in (0, 100, 255):
                got[("half", r, n)] = cute.crd2idx(((r, n), 0, 0), half)

    trace()
    for key, off in got.items():
        _, r, n = key
        lane = (r % 16) + 32 * (r // 16)
        want = lane * 65536 + (n // 256) * LANE16 + n % 256
        assert int(off) == want, key
        if key[0] == "full":
            c = n // 64
            assert SparseMlaFwdSm100._o_chunk_offset(c) + n % 64 == (n // 256) * LANE16 + n % 256


def test_pack_and_p_offsets_are_conflict_free():
    from mla_kernels.sm100.fwd import p_word_offset

    for g in range(8):
        for w in range(4):
            for row in range(2):
                banks = {p_word_offset(16 * w + lane // 4 + 8 * row, g, lane % 4) % 32 for lane in range(32)}
                assert len(banks) == 32


# ---------------------------------------------------------------------------------------------
# The 2-CTA (h128) kernel: plan and layout contracts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_qk", [576, 512])
def test_h128_plan(d_qk):
    _cutlass()
    from mla_kernels.sm100.fwd_h128 import KV_STAGES, RED_FLOATS, SMEM_HEADER_BYTES, TMEM_ALLOC, FwdH128Plan, fwd_h128_plan

    p = fwd_h128_plan(d_qk)
    assert p.q_bytes == 64 * d_qk * 2 and p.k_stage_bytes == 32 * d_qk * 2 and p.v_stage_bytes == 64 * 256 * 2
    assert p.smem_bytes == SMEM_HEADER_BYTES + 4 * RED_FLOATS + p.q_bytes + KV_STAGES * (
        p.k_stage_bytes + p.v_stage_bytes) + p.p_bytes <= SMEM_LIMIT
    regions = FwdH128Plan.tmem_regions()
    for i, a in enumerate(regions):
        assert 0 <= a[1] < a[2] <= 128 and 0 <= a[3] < a[4] <= TMEM_ALLOC
        for b in regions[i + 1:]:
            assert not (a[1] < b[2] and b[1] < a[2] and a[3] < b[4] and b[3] < a[4]), (a, b)


@pytest.mark.parametrize("h_q,two", [(64, False), (128, True), (192, False), (256, True)])
def test_kernel_choice(h_q, two, monkeypatch):
    from mla_kernels.sm100 import ENV_FWD_KERNEL, fwd_two_cta

    assert fwd_two_cta(h_q) is two
    monkeypatch.setenv(ENV_FWD_KERNEL, "1cta")
    assert fwd_two_cta(h_q) is False
    monkeypatch.setenv(ENV_FWD_KERNEL, "2cta")
    assert fwd_two_cta(h_q) is two
    monkeypatch.setenv(ENV_FWD_KERNEL, "bogus")
    with pytest.raises(ValueError, match="MLA_KERNELS_SM100_FWD"):
        fwd_two_cta(h_q)


def test_h128_operand_split_between_the_pair(trace_for_sm100):
    """CTA v of the pair feeds A rows (heads) 64 v.., QK's B rows (tokens) 32 v.. and PV's B rows
    (dims of each N256 instruction) 128 v..; its accumulator holds its own 64 rows x all N --
    what the gather (``2 b + rank`` K blocks, V tiles ``4 h + 2 rank + c``) and the epilogue's
    ``head0 = 128 g + 64 rank`` assume."""
    cute = _cutlass()
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    got = {}

    @cute.jit
    def trace():
        for name, major, n, k in (("qk", OperandMajorMode.K, 64, 576), ("pv", OperandMajorMode.MN, 256, 64)):
            mma = sm100_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, major, Float32,
                                                     tcgen05.CtaGroup.TWO, (128, n))
            for v in (0, 1):
                thr = mma.get_slice(v)
                pa = thr.partition_A(cute.make_identity_tensor((128, k)))
                pb = thr.partition_B(cute.make_identity_tensor((n, k)))
                pc = thr.partition_C(cute.make_identity_tensor((128, n)))
                got[(name, v)] = [(pa[0], pa[cute.size(pa) - 1]), (pb[0], pb[cute.size(pb) - 1]),
                                  (pc[0], pc[cute.size(pc) - 1])]

    trace()

    def t(c):
        return tuple(int(x) for x in c)

    for v in (0, 1):
        a, b, c = got[("qk", v)]
        assert (t(a[0]), t(a[1])) == ((64 * v, 0), (64 * v + 63, 575))
        assert (t(b[0]), t(b[1])) == ((32 * v, 0), (32 * v + 31, 575))
        assert (t(c[0]), t(c[1])) == ((64 * v, 0), (64 * v + 63, 63))
        a, b, c = got[("pv", v)]
        assert (t(b[0]), t(b[1])) == ((128 * v, 0), (128 * v + 127, 63))
        assert (t(c[0]), t(c[1])) == ((64 * v, 0), (64 * v + 63, 255))


@pytest.mark.parametrize("d_qk", [576, 512])
def test_h128_smem_layouts_match_the_writers(d_qk, trace_for_sm100):
    cute = _cutlass()
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    from mla_kernels.sm100.fwd_h128 import K_ROWS, KV_STAGES, fwd_h128_plan

    plan = fwd_h128_plan(d_qk)
    got = {}

    @cute.jit
    def trace():
        qk = sm100_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                tcgen05.CtaGroup.TWO, (128, 64))
        pv = sm100_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN,
                                                Float32, tcgen05.CtaGroup.TWO, (128, 256))
        sQ = sm100_utils.make_smem_layout_a(qk, (128, 64, d_qk), BFloat16, 1)
        sK = sm100_utils.make_smem_layout_b(qk, (128, 64, d_qk), BFloat16, KV_STAGES)
        sP = sm100_utils.make_smem_layout_a(pv, (128, 256, 64), BFloat16, 1)
        sV = sm100_utils.make_smem_layout_b(pv, (128, 256, 64), BFloat16, 1)
        for r in (0, 1, 9, 31):
            for c in (0, 17, 100, d_qk - 1):
                for s in (0, KV_STAGES - 1):
                    got[("K", s, r, c)] = cute.crd2idx(((r, c % 16), 0, c // 16, s), sK.outer)
        for r in (0, 7, 40, 63):
            for c in (0, 63, 300, d_qk - 1):
                got[("Q", r, c)] = cute.crd2idx(((r, c % 16), 0, c // 16, 0), sQ.outer)
            for c in (0, 8, 33, 63):
                got[("P", r, c)] = cute.crd2idx(((r, c % 16), 0, c // 16, 0), sP.outer)
        for n in (0, 63, 64, 127):  # this CTA's 128 dims of one N256 instruction
            for k in (0, 15, 16, 63):
                got[("V", n, k)] = cute.crd2idx(((n, k % 16), 0, k // 16, 0), sV.outer)

    trace()
    for key, elem in got.items():
        phys = _sw128(2 * int(elem))
        if key[0] == "K":
            _, s, r, c = key
            assert phys == s * plan.k_stage_bytes + _writer_offset(r, c, K_ROWS), key
        elif key[0] == "Q":
            _, r, c = key
            assert phys == _writer_offset(r, c, 64), key
        elif key[0] == "P":
            _, r, c = key
            # the softmax's 16-byte store: row r, chunk c // 8 at (chunk ^ r % 8) * 16
            assert phys == r * 128 + (((c // 8) ^ (r % 8)) * 16) + (c % 8) * 2, key
        else:
            _, n, k = key
            # V tile n // 64 of the instruction (KvGather copy_tile, 64 rows): token k, column n % 64
            assert phys == _writer_offset(k, n, 64), key


def test_h128_tmem_fold(trace_for_sm100):
    """32x32b loads of the 2-CTA accumulators: thread t holds row t % 64 and columns
    32 (t / 64) + i of the score tile; a 32-column view at column offset 32 c of O gives O columns
    256 (c / 4) + 128 (t / 64) + 32 (c % 4) + i (what the rescale and the epilogue assume)."""
    cute = _cutlass()
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    got = {}

    @cute.jit
    def trace():
        qk = sm100_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                tcgen05.CtaGroup.TWO, (128, 64))
        pv = sm100_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN,
                                                Float32, tcgen05.CtaGroup.TWO, (128, 256))
        s_layout = qk.make_fragment_C(qk.partition_shape_C((128, 64))).layout
        o_full = pv.make_fragment_C(pv.partition_shape_C((128, 512))).layout
        tS = cute.make_tensor(cute.make_ptr(Float32, 0, cute.AddressSpace.tmem, assumed_align=16), s_layout)
        ld = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), Float32), tS)
        coords = qk.get_slice(0).partition_C(cute.make_identity_tensor((128, 64)))
        for t in (0, 5, 63, 64, 100, 127):
            part = ld.get_slice(t).partition_D(coords)
            got[("ld", t)] = [part[i] for i in range(cute.size(part))]
        # element (row, col) of the score view -> TMEM offset; O (row, n) -> TMEM offset
        for r in (0, 17, 63):
            for cc in (0, 31, 32, 63):
                got[("s", r, cc)] = cute.crd2idx(((r, cc), 0, 0), s_layout)
            for n in (0, 100, 128, 255, 256, 511):
                got[("o", r, n)] = cute.crd2idx(((r, n % 256), 0, n // 256), o_full)

    trace()
    for key, val in got.items():
        if key[0] == "ld":
            t = key[1]
            assert [tuple(int(x) for x in c) for c in val] == [(t % 64, 32 * (t // 64) + i) for i in range(32)], t
        elif key[0] == "s":
            _, r, cc = key
            assert int(val) == (r + 64 * (cc // 32)) * 65536 + cc % 32, key
        else:
            _, r, n = key
            c, within = divmod(n % 128, 32)  # chunk within the 128-column half, column in chunk
            half = (n % 256) // 128
            chunk = 4 * (n // 256) + c
            # the chunk view = score layout at column 32 * chunk: lane r + 64 * half, column 32 chunk + within
            assert int(val) == (r + 64 * half) * 65536 + 32 * chunk + within, key


# ---------------------------------------------------------------------------------------------
# Synchronisation protocol (a host model of both kernels' mbarrier schedules)
# ---------------------------------------------------------------------------------------------
#
# Each role of the kernels is mirrored as a generator that yields the mbarrier waits it performs
# (same barriers, same parities); cp.async landings and MMA completions are asynchronous events
# fired at random later times (MMAs complete in issue order, commits after them).  Random
# interleavings must never deadlock, and every buffer read must see the block it expects while
# no write lands on a buffer that an unfinished reader still needs.  This proves the schedule
# (phases, arrival counts, who waits for whom), not the kernel code: keep the two in step.


class _Bar:
    """An mbarrier: ``count`` arrivals complete a phase; ``try_wait.parity(p)`` passes once the
    phase of parity ``p`` is complete (a fresh barrier passes parity 1)."""

    def __init__(self, count: int):
        self.count, self.pending, self.phases = count, count, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phases += 1
            self.pending = self.count

    def passed(self, parity: int) -> bool:
        return self.phases % 2 != parity


class _Sim:
    def __init__(self, seed: int):
        import random

        self.rng = random.Random(seed)
        self.roles = []
        self.events = []  # async completions: callables
        self.mma_fifo = []  # tcgen05 ops complete in issue order

    def wait(self, bar, parity):
        return lambda: bar.passed(parity)

    def later(self, fn):
        self.events.append(fn)

    def mma(self, fn):
        self.mma_fifo.append(fn)

    def run(self):
        gens = [[g, None] for g in self.roles]
        steps = 0
        while True:
            steps += 1
            assert steps < 200_000
            runnable = [x for x in gens if x[0] is not None and (x[1] is None or x[1]())]
            choices = len(runnable) + len(self.events) + (1 if self.mma_fifo else 0)
            if choices == 0:
                assert all(x[0] is None for x in gens), "deadlock: every role waits"
                return
            k = self.rng.randrange(choices)
            if k < len(runnable):
                x = runnable[k]
                try:
                    x[1] = next(x[0])
                except StopIteration:
                    x[0] = None
            elif k < len(runnable) + len(self.events):
                self.events.pop(k - len(runnable))()
            else:
                self.mma_fifo.pop(0)()


def _model_1cta(sim: _Sim, n: int, fault: str = ""):
    """fwd.py: gather (warps 4-7), MMA (warp 8), softmax (warps 0-3).  ``fault`` injects a
    schedule bug (for the test that the model can fail)."""
    B = _Bar
    q_full, p_full, o_done = B(1), B(1), B(1)
    kv_full, kv_empty, s_full, s_empty = [B(1), B(1)], [B(1), B(1)], [B(1), B(1)], [B(1), B(1)]
    st = dict(kv=[None, None], kv_readers=[0, 0], S=[None, None], S_read=[-2, -1], P=None, pv_busy=0, O=-1)

    def gather():
        if n:
            sim.later(q_full.arrive)
        for b in range(n):
            s = b % 2
            yield sim.wait(kv_empty[s], ((b // 2) & 1) ^ (0 if fault == "kv_empty_parity" else 1))

            def land(b=b, s=s):
                assert st["kv_readers"][s] == 0, "KV stage overwritten under an MMA"
                st["kv"][s] = b
                kv_full[s].arrive()

            sim.later(land)

    def issue_qk(j):
        s = j % 2
        yield sim.wait(kv_full[s], (j // 2) & 1)
        yield sim.wait(s_empty[s], ((j // 2) & 1) ^ (0 if fault == "s_empty_parity" else 1))
        assert st["kv"][s] == j
        st["kv_readers"][s] += 1

        def done(j=j, s=s):
            assert st["kv"][s] == j and st["S_read"][s] == j - 2, "S overwritten before it was read"
            st["S"][s] = j
            st["kv_readers"][s] -= 1
            s_full[s].arrive()

        sim.mma(done)

    def mma():
        if n:
            yield sim.wait(q_full, 0)
            yield from issue_qk(0)
        for b in range(n):
            if b + 1 < n:
                yield from issue_qk(b + 1)
            yield sim.wait(p_full, b & 1)
            s = b % 2
            assert st["P"] == b and st["O"] == b - 1 and st["kv"][s] == b
            st["kv_readers"][s] += 1
            st["pv_busy"] += 1

            def done(b=b, s=s):
                assert st["P"] == b and st["kv"][s] == b and st["O"] == b - 1
                st["O"] = b
                st["kv_readers"][s] -= 1
                st["pv_busy"] -= 1
                kv_empty[s].arrive()
                o_done.arrive()

            sim.mma(done)

    def softmax():
        for b in range(n):
            buf = b % 2
            yield sim.wait(s_full[buf], (b // 2) & 1)
            assert st["S"][buf] == b
            st["S_read"][buf] = b
            s_empty[buf].arrive()
            if b > 0 and fault != "no_o_done_wait":
                yield sim.wait(o_done, (b - 1) & 1)
            if b > 0:
                assert st["O"] == b - 1 and st["pv_busy"] == 0  # the O rescale / P rewrite are safe
            st["P"] = b
            p_full.arrive()
        if n:
            yield sim.wait(o_done, (n - 1) & 1)
        assert st["O"] == n - 1 and st["pv_busy"] == 0  # epilogue reads the final O

    sim.roles += [gather(), mma(), softmax()]


def _model_2cta(sim: _Sim, n: int):
    """fwd_h128.py: per CTA gather + softmax; CTA 0 MMA; CTA 1 relay.  Barriers the MMA waits on
    live in CTA 0; commits are multicast to both CTAs."""
    B = _Bar
    q_local = [B(1), B(1)]
    kv_local = [[B(1), B(1)], [B(1), B(1)]]
    q_peer, kv_peer = B(1), [B(1), B(1)]
    s_empty, p_full = [B(2), B(2)], B(2)  # CTA 0: one arrival per CTA's softmax warpgroup here
    s_full = [[B(1), B(1)], [B(1), B(1)]]
    o_done = [B(1), B(1)]
    kv_empty = [[B(1), B(1)], [B(1), B(1)]]
    st = dict(kv=[[None, None], [None, None]], kv_readers=[0, 0], S=[[None, None], [None, None]],
              S_read=[[-2, -1], [-2, -1]], P=[None, None], pv_busy=0, O=[-1, -1])

    def gather(r):
        if n:
            sim.later(q_local[r].arrive)
        for b in range(n):
            s = b % 2
            yield sim.wait(kv_empty[r][s], ((b // 2) & 1) ^ 1)

            def land(b=b, s=s):
                assert st["kv_readers"][s] == 0, "KV stage overwritten under an MMA"
                st["kv"][r][s] = b
                kv_local[r][s].arrive()

            sim.later(land)

    def relay():
        if n:
            yield sim.wait(q_local[1], 0)
            q_peer.arrive()
        for b in range(n):
            yield sim.wait(kv_local[1][b % 2], (b // 2) & 1)
            kv_peer[b % 2].arrive()

    def issue_qk(j):
        s = j % 2
        yield sim.wait(kv_local[0][s], (j // 2) & 1)
        yield sim.wait(kv_peer[s], (j // 2) & 1)
        yield sim.wait(s_empty[s], ((j // 2) & 1) ^ 1)
        assert st["kv"][0][s] == j and st["kv"][1][s] == j
        st["kv_readers"][s] += 1

        def done(j=j, s=s):
            for r in (0, 1):
                assert st["kv"][r][s] == j and st["S_read"][r][s] == j - 2
                st["S"][r][s] = j
            st["kv_readers"][s] -= 1
            for r in (0, 1):
                s_full[r][s].arrive()

        sim.mma(done)

    def mma():
        if n:
            yield sim.wait(q_local[0], 0)
            yield sim.wait(q_peer, 0)
            yield from issue_qk(0)
        for b in range(n):
            if b + 1 < n:
                yield from issue_qk(b + 1)
            yield sim.wait(p_full, b & 1)
            s = b % 2
            assert st["P"] == [b, b] and st["O"] == [b - 1, b - 1] and st["kv"][0][s] == st["kv"][1][s] == b
            st["kv_readers"][s] += 1
            st["pv_busy"] += 1

            def done(b=b, s=s):
                assert st["P"] == [b, b] and st["kv"][0][s] == st["kv"][1][s] == b
                st["O"] = [b, b]
                st["kv_readers"][s] -= 1
                st["pv_busy"] -= 1
                for r in (0, 1):
                    kv_empty[r][s].arrive()
                for r in (0, 1):
                    o_done[r].arrive()

            sim.mma(done)

    def softmax(r):
        for b in range(n):
            buf = b % 2
            yield sim.wait(s_full[r][buf], (b // 2) & 1)
            assert st["S"][r][buf] == b
            st["S_read"][r][buf] = b
            s_empty[buf].arrive()
            if b > 0:
                yield sim.wait(o_done[r], (b - 1) & 1)
                assert st["O"][r] == b - 1 and st["pv_busy"] == 0
            st["P"][r] = b
            p_full.arrive()
        if n:
            yield sim.wait(o_done[r], (n - 1) & 1)
        assert st["O"][r] == n - 1 and st["pv_busy"] == 0

    sim.roles += [gather(0), gather(1), relay(), mma(), softmax(0), softmax(1)]


@pytest.mark.parametrize("model", [_model_1cta, _model_2cta])
def test_sync_protocol_never_deadlocks_or_races(model):
    for n in range(0, 7):
        for seed in range(60):
            sim = _Sim(seed * 131 + n)
            model(sim, n)
            sim.run()


@pytest.mark.parametrize("fault", ["no_o_done_wait", "s_empty_parity", "kv_empty_parity"])
def test_sync_protocol_model_catches_faults(fault):
    """The model is not vacuous: each injected schedule bug fails some interleaving."""
    failed = False
    for seed in range(200):
        sim = _Sim(seed)
        _model_1cta(sim, 5, fault=fault)
        try:
            sim.run()
        except AssertionError:
            failed = True
            break
    assert failed, fault


# ---------------------------------------------------------------------------------------------
# Compile report (no GPU): SASS facts and resource use
# ---------------------------------------------------------------------------------------------



FWD_KERNELS = {  # name: (d_qk, sink, 2-CTA)
    "sm100_fwd_d576_h64": (576, False, False),
    "sm100_fwd_d576_h128_2cta_topklen_sink": (576, True, True),
    "sm100_fwd_d512_h64": (512, False, False),
    "sm100_fwd_d576_h128_2cta": (576, False, True),
    "sm100_fwd_d512_h256_2cta": (512, False, True),
    "sm100_fwd_d576_h128_1cta_topklen_sink": (576, True, False),
}


@pytest.fixture(scope="module")
def sm100_fwd_report():
    recs = _compile_report().run("sm_100a", only=set(FWD_KERNELS), quiet=True)
    return {r["name"]: r for r in recs}


def _check_sass(r, d_qk, sink, two_cta):
    if two_cta:
        return _check_sass_2cta(r, d_qk, sink)
    from mla_kernels.sm100.fwd import THREADS, fwd_plan

    plan = fwd_plan(d_qk)
    assert r["spill_bytes"] == 0 and r["registers"] is not None and r["registers"] * THREADS <= 65536
    assert r["smem_bytes"] == plan.smem_bytes <= SMEM_LIMIT
    if r["sass"] is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    sass, base = r["sass"], r["sass_base"]
    # 1-CTA tcgen05: QK (d/16 MMAs) is inlined twice (prologue + loop), PV 2 halves x 4
    assert base.get("UTCHMMA", 0) == 2 * (d_qk // 16) + 8
    assert not any(".2CTA" in k for k in sass), "a 1-CTA kernel must not contain cta_group::2 ops"
    # commits: S full (x2 call sites), KV stage empty, O done
    assert base.get("UTCBAR", 0) == 4
    # 16x256b TMEM traffic: S (1) + O rescale (8) + epilogue (8) loads, 8 rescale stores
    assert sass.get("LDTM.16dp256bit.x8", 0) == 17 and sass.get("STTM.16dp256bit.x8", 0) == 8
    # cp.async gather: Q (4 rows x d/64 tiles per thread) + one KV block (4 rows x d/64)
    assert sass.get("LDGSTS.E.BYPASS.LTC256B.128", 0) == 8 * (d_qk // 64)
    assert base.get("ARRIVES", 0) == 2
    # exp2: 32 scores + 2 rescale factors per thread (+ 2 sink terms)
    assert sass.get("MUFU.EX2", 0) == 34 + (2 if sink else 0)
    assert base.get("LDL", 0) == 0 and base.get("STL", 0) == 0
    assert base.get("HGMMA", 0) == 0 and base.get("UTMALDG", 0) == 0


def _check_sass_2cta(r, d_qk, sink):
    from mla_kernels.sm100.fwd_h128 import THREADS, fwd_h128_plan

    plan = fwd_h128_plan(d_qk)
    assert r["spill_bytes"] == 0 and r["registers"] is not None and r["registers"] * THREADS <= 65536
    assert r["smem_bytes"] == plan.smem_bytes <= SMEM_LIMIT
    if r["sass"] is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    sass, base = r["sass"], r["sass_base"]
    # only cta_group::2 tcgen05 MMAs/commits/allocs (ptxas rejects a mix, SM100_NOTES 0)
    assert sass.get("UTCHMMA.2CTA", 0) == base.get("UTCHMMA", 0) == 2 * (d_qk // 16) + 8
    assert sass.get("UTCBAR.2CTA.MULTICAST", 0) == base.get("UTCBAR", 0) == 4
    assert all(".2CTA" in k for k in sass if k.startswith("UTCATOMSWS.FIND_AND_SET"))
    # 32x32b TMEM traffic: S (1) + O rescale (8) + epilogue (8) loads, 8 rescale stores
    assert sass.get("LDTM.x32", 0) == 17 and sass.get("STTM.x32", 0) == 8
    # cp.async: Q (4 rows x d/64) + K (2 rows x d/64) + V (4 rows x 4 tiles) per thread
    assert sass.get("LDGSTS.E.BYPASS.LTC256B.128", 0) == 6 * (d_qk // 64) + 16
    assert sass.get("MUFU.EX2", 0) == 33 + (1 if sink else 0)
    assert base.get("UCGABAR_ARV", 0) == 2 and base.get("UCGABAR_WAIT", 0) == 2  # cluster syncs
    assert base.get("LDL", 0) == 0 and base.get("STL", 0) == 0


@pytest.mark.compile
@pytest.mark.parametrize("name", sorted(FWD_KERNELS))
def test_sm100_fwd_sass(sm100_fwd_report, name):
    r = sm100_fwd_report[name]
    assert r["arch"] == "sm_100a"
    _check_sass(r, *FWD_KERNELS[name])


@pytest.mark.compile
def test_sm103a_fwd_2cta_sass():
    recs = _compile_report().run("sm_103a", only={"sm100_fwd_d576_h128_2cta"}, quiet=True)
    assert len(recs) == 1 and recs[0]["arch"] == "sm_103a"
    _check_sass(recs[0], 576, False, True)


@pytest.mark.compile
def test_sm103a_fwd_sass():
    recs = _compile_report().run("sm_103a", only={"sm100_fwd_d576_h64"}, quiet=True)
    assert len(recs) == 1 and recs[0]["arch"] == "sm_103a"
    _check_sass(recs[0], 576, False, False)


# ---------------------------------------------------------------------------------------------
# GPU runtime (compute capability 10.x)
# ---------------------------------------------------------------------------------------------

needs_sm100 = skip_unless_sm100()


def run_and_check(case, monkeypatch, abs_tol=8e-4, logit_scale=1.0):
    import mla_kernels as mk
    from mla_kernels import reference as ref

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm100")  # no silent fallback: a miss raises
    out, ml, lse = mk.sparse_mla_fwd(case.q, case.kv, case.indices, case.sm_scale, case.d_v,
                                     case.topk_length, case.attn_sink)
    torch.cuda.synchronize()
    want = ref.sparse_mla_fwd_ref(case.q.float(), case.kv.float(), case.indices, case.sm_scale, case.d_v,
                                  case.topk_length, case.attn_sink)
    valid = ref.valid_mask(case.indices, case.kv.shape[0], case.topk_length)
    empty = (~valid.any(dim=-1))[:, None].expand(-1, case.q.shape[1])
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and ml.dtype == torch.float32
    assert_close_fwd(out, ml, lse, want, empty=empty, abs_tol=abs_tol, logit_scale=logit_scale)


SHAPES = [(1, 128, 128), (62, 592, 128), (213, 1840, 256), (62, 1521, 512), (213, 95, 128), (4096, 32768, 2048)]


@pytest.mark.parametrize("s_q,s_kv,topk", SHAPES)
@pytest.mark.parametrize("h_q,kernel", [(64, "auto"), (128, "auto"), (128, "1cta")])  # auto at 128 = 2-CTA
@pytest.mark.parametrize("d_qk", [576, 512])
@needs_sm100
@pytest.mark.gpu
def test_fwd_shapes(s_q, s_kv, topk, h_q, kernel, d_qk, monkeypatch):
    from mla_kernels.sm100 import ENV_FWD_KERNEL

    if s_q == 4096 and (h_q, d_qk) != (128, 576):
        pytest.skip("headline size runs once per kernel, at h_q 128 / d_qk 576")
    monkeypatch.setenv(ENV_FWD_KERNEL, kernel)
    case = make_case(s_q, h_q, d_qk, s_kv, topk, device="cuda", invalid_frac=0.1, empty_rows=2)
    run_and_check(case, monkeypatch)


@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("sink", [None, "finite", "neginf"])
@pytest.mark.parametrize("kernel", ["auto", "1cta"])
@needs_sm100
@pytest.mark.gpu
def test_fwd_topk_length_and_sink(d_qk, sink, kernel, monkeypatch):
    from mla_kernels.sm100 import ENV_FWD_KERNEL

    monkeypatch.setenv(ENV_FWD_KERNEL, kernel)
    case = make_case(213, 128, d_qk, 1840, 256, device="cuda", topk_length=True, sink=sink)
    run_and_check(case, monkeypatch)


@needs_sm100
@pytest.mark.gpu
def test_fwd_odd_block_count_and_padding(monkeypatch):
    for topk in (192, 100, 64, 1):
        case = make_case(37, 64, 576, 777, topk, device="cuda", topk_length=topk > 1)
        run_and_check(case, monkeypatch)


@needs_sm100
@pytest.mark.gpu
def test_fwd_all_invalid_and_duplicates(monkeypatch):
    case = make_case(50, 128, 576, 300, 128, device="cuda", invalid_frac=0.0, dup_frac=0.0, empty_rows=0)
    case.indices[0] = -1
    case.indices[1] = 5
    case.indices[2, 0, ::2] = 10_000
    run_and_check(case, monkeypatch)


@needs_sm100
@pytest.mark.gpu
def test_fwd_unit_scale_values(monkeypatch):
    case = make_case(64, 128, 576, 4000, 512, device="cuda", scale=1.0)
    run_and_check(case, monkeypatch, abs_tol=8e-3)


@needs_sm100
@pytest.mark.gpu
def test_fwd_large_logits(monkeypatch):
    # logits of std ~48: the lazy rescale (threshold 2^8) fires on many blocks
    case = make_case(64, 128, 576, 4000, 512, device="cuda", scale=1.0, kv_scale=2.0, sm_scale=1.0)
    run_and_check(case, monkeypatch, abs_tol=1.6e-2, logit_scale=150.0)


@pytest.mark.parametrize("h_q", [256, 192])  # 2 clusters (2-CTA kernel); 3 CTAs (1-CTA kernel)
@needs_sm100
@pytest.mark.gpu
def test_fwd_many_heads(h_q, monkeypatch):
    case = make_case(20, h_q, 576, 1000, 256, device="cuda")
    run_and_check(case, monkeypatch)


@needs_sm100
@pytest.mark.gpu
def test_fwd_huge_kv_64bit_offsets(monkeypatch):
    s_kv = (2**31) // (576 * 2) + 5000
    kv = torch.randn(s_kv, 1, 576, dtype=torch.bfloat16, device="cuda")
    case = make_case(16, 64, 576, s_kv, 256, device="cuda", kv=kv)
    case.indices[:, :, :128] = torch.randint(s_kv - 4000, s_kv, (16, 1, 128), device="cuda", dtype=torch.int32)
    run_and_check(case, monkeypatch)
    del kv


@needs_sm100
@pytest.mark.gpu
def test_fwd_more_than_65535_queries(monkeypatch):
    import mla_kernels as mk
    from mla_kernels import reference as ref

    s_q = 70_000
    case = make_case(s_q, 64, 512, 500, 64, device="cuda", invalid_frac=0.1, empty_rows=3)
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm100")
    out, ml, lse = mk.sparse_mla_fwd(case.q, case.kv, case.indices, case.sm_scale, 512)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    for r0 in (0, 65_500, s_q - 100):
        sl = slice(r0, r0 + 100)
        want = ref.sparse_mla_fwd_ref(case.q[sl].float(), case.kv.float(), case.indices[sl], case.sm_scale, 512)
        valid = ref.valid_mask(case.indices[sl], 500)
        empty = (~valid.any(dim=-1))[:, None].expand(-1, 64)
        assert_close_fwd(out[sl], ml[sl], lse[sl], want, empty=empty)


@needs_sm100
@pytest.mark.gpu
def test_fwd_dispatch_auto_uses_kernel():
    import mla_kernels as mk

    assert mk.backend_for("cuda") == "sm100"
