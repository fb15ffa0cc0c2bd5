"""sm100 attention distribution: what can be proven without a Blackwell GPU, and the GPU checks.

* host logic (no compile): the smem/TMEM plan, grid and head groups, the backend's answers;
* layout contract (trace only): the smem layouts the MMA descriptors are built from place every
  element where the cp.async writers (``KvGather``, ``copy_dense_rows``) put it;
* compile report (slow-ish, marked ``compile``): sm_100a/sm_103a SASS has the 1-CTA tcgen05 MMA,
  TMEM loads, MMA commits, the cp.async gather and ``MUFU.EX2``, no spills, smem within budget;
* GPU runtime (compute capability 10.x only, skipped elsewhere): kernel vs the float32 reference,
  the same cases as ``test_sm90_attn_dist.py``; tolerance relative L2 <= 1e-3, invalid slots and
  empty rows exactly 0, no NaN.
"""

from __future__ import annotations


import pytest
import torch

from mla_kernels.common.problem import Problem

from conftest import make_case, rel_l2, skip_unless_sm100
from conftest import compile_records
from conftest import needs_cutlass as _cutlass, sw128 as _sw128, tile_offset as _writer_offset

SMEM_LIMIT = 232448
CONFIGS = [(d, h) for d in (576, 512) for h in (64, 128)]



# ---------------------------------------------------------------------------------------------
# Host logic
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_qk,heads", CONFIGS)
def test_plan_fits_smem_and_tmem(d_qk, heads):
    _cutlass()
    from mla_kernels.sm100.attn_dist import B_N, K_STAGE_BYTES, SMEM_HEADER_BYTES, TMEM_COLUMNS, attn_dist_plan

    p = attn_dist_plan(d_qk, heads)
    assert p.n_k_tiles * 64 == d_qk and K_STAGE_BYTES == B_N * 64 * 2
    assert p.k_stages >= 2 and p.smem_bytes <= SMEM_LIMIT
    assert p.smem_bytes == SMEM_HEADER_BYTES + heads * d_qk * 2 + p.k_stages * K_STAGE_BYTES
    # one more K stage would not fit: the ring uses the budget (or hits the stage cap)
    assert p.k_stages == 12 or p.smem_bytes + K_STAGE_BYTES > SMEM_LIMIT
    # TMEM: a power-of-two allocation of 32..512 columns; accumulator slots inside it, disjoint
    assert 32 <= p.tmem_cols <= TMEM_COLUMNS and p.tmem_cols & (p.tmem_cols - 1) == 0
    cols = p.acc_columns()
    assert len(cols) == p.acc_stages >= 2
    for a, (lo, hi) in enumerate(cols):
        assert 0 <= lo < hi <= p.tmem_cols and hi - lo == heads
        if a:
            assert lo >= cols[a - 1][1]


def test_plan_rejects_unsupported():
    _cutlass()
    from mla_kernels.sm100.attn_dist import attn_dist_plan

    with pytest.raises(ValueError, match="d_qk"):
        attn_dist_plan(256, 128)
    with pytest.raises(ValueError, match="heads"):
        attn_dist_plan(576, 256)


@pytest.mark.parametrize("h_q,heads,groups", [(64, 64, 1), (128, 128, 1), (192, 64, 3), (256, 128, 2), (320, 64, 5)])
def test_head_groups_and_grid(h_q, heads, groups):
    from mla_kernels.sm100 import attn_dist_heads_per_cta

    assert attn_dist_heads_per_cta(h_q) == heads
    assert h_q // heads == groups  # n_groups; the grid is s_q * n_groups CTAs of 288 threads


def _problem(h_q=128, d_qk=576, dtype=torch.bfloat16, sm_scale=0.1):
    q = torch.zeros(2, h_q, d_qk, dtype=dtype)
    kv = torch.zeros(16, d_qk, dtype=dtype)
    idx = torch.zeros(2, 128, dtype=torch.int32)
    return Problem(q, kv, idx, sm_scale, 512, None, None, kv.shape)


def test_backend_contract():
    from mla_kernels import dispatch
    from mla_kernels.sm100 import BACKEND, TOPK_BLOCK, Sm100Backend

    assert isinstance(BACKEND, Sm100Backend) and BACKEND.name == "sm100"
    assert BACKEND.topk_block == TOPK_BLOCK == 128 and BACKEND.hardware_verified is False
    assert dispatch.get_backend("sm100") is BACKEND  # what dispatch imports (mla_kernels.sm100.BACKEND)
    assert "not a CUDA device" in BACKEND.unavailable_reason(torch.device("cpu"))


@pytest.mark.parametrize(
    "op,kw,reason",
    [
        ("attn_dist", dict(dtype=torch.float16), "dtype"),
        ("attn_dist", dict(d_qk=256), "d_qk=256"),
        ("attn_dist", dict(h_q=96), "h_q=96"),
        ("attn_dist", dict(sm_scale=0.0), "sm_scale"),
    ],
)
def test_backend_supports_reasons(op, kw, reason):
    from mla_kernels.sm100 import BACKEND

    why = BACKEND.supports(op, _problem(**kw))
    assert why is not None and reason in why


@pytest.mark.parametrize("h_q,d_qk", [(64, 576), (128, 512), (256, 576), (192, 512)])
def test_backend_supports_attn_dist(h_q, d_qk):
    from mla_kernels.sm100 import BACKEND

    assert BACKEND.supports("attn_dist", _problem(h_q=h_q, d_qk=d_qk)) is None


# ---------------------------------------------------------------------------------------------
# Layout contract (host-side tracing, no compile)
# ---------------------------------------------------------------------------------------------




@pytest.mark.parametrize("d_qk,heads", [(576, 128), (512, 64)])
def test_mma_smem_layouts_match_the_writers(d_qk, heads, trace_for_sm100):
    cute = _cutlass()
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    from mla_kernels.sm100.attn_dist import B_N, K_STAGE_BYTES, attn_dist_plan

    plan = attn_dist_plan(d_qk, heads)
    got = {}

    @cute.jit
    def trace():
        mma = sm100_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K,
                                                 Float32, tcgen05.CtaGroup.ONE, (B_N, heads))
        sK = sm100_utils.make_smem_layout_a(mma, (B_N, heads, 64), BFloat16, plan.k_stages)
        sQ = sm100_utils.make_smem_layout_b(mma, (B_N, heads, d_qk), BFloat16, 1)
        # A (K): ((M, K16), 1, K/16, stage); B (Q): ((N, K16), 1, K/16, 1)
        for s in (0, plan.k_stages - 1):
            for r in (0, 1, 7, 8, 13, 64, 127):
                for c in (0, 8, 17, 40, 63):
                    got[("K", s, r, c)] = cute.crd2idx(((r, c % 16), 0, c // 16, s), sK.outer)
        for r in (0, 1, 9, heads - 1):
            for c in (0, 15, 64, 100, d_qk - 1):
                got[("Q", r, c)] = cute.crd2idx(((r, c % 16), 0, c // 16, 0), sQ.outer)
        assert str(sK.inner) == str(sQ.inner) == "S<3,4,3>"

    trace()
    assert got
    for key, elem in got.items():
        phys = _sw128(2 * int(elem))
        if key[0] == "K":
            _, s, r, c = key
            assert phys == s * K_STAGE_BYTES + _writer_offset(r, c, B_N), key
        else:
            _, r, c = key
            assert phys == _writer_offset(r, c, heads), key


@pytest.mark.parametrize("heads", [64, 128])
def test_tmem_load_gives_thread_t_token_t_all_heads(heads, trace_for_sm100):
    """The epilogue's contract: with 32x32b loads of an accumulator slot, thread t of the
    warpgroup holds row t (token t of the block) and element h of its fragment is column h (head
    h), so ``exp2_head_sum(fragment)`` reduces over heads and the result belongs to slot t."""
    cute = _cutlass()
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    from mla_kernels.sm100.attn_dist import B_N, EPI_THREADS, attn_dist_plan

    plan = attn_dist_plan(576, heads)
    got = {}

    @cute.jit
    def trace():
        mma = sm100_utils.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K,
                                                 Float32, tcgen05.CtaGroup.ONE, (B_N, heads))
        acc_shape = mma.partition_shape_C((B_N, heads))
        layout = mma.make_fragment_C(cute.append(acc_shape, plan.acc_stages)).layout
        tAcc = cute.make_tensor(cute.make_ptr(Float32, 0, cute.AddressSpace.tmem, assumed_align=16), layout)
        atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), Float32)
        copy = tcgen05.make_tmem_copy(atom, tAcc[None, None, None, 0])
        coords = mma.get_slice(0).partition_C(cute.make_identity_tensor((B_N, heads)))
        for t in (0, 1, 31, 32, 77, EPI_THREADS - 1):
            part = copy.get_slice(t).partition_D(coords)
            got[t] = [part[i] for i in range(cute.size(part))]

    trace()
    assert sorted(got) == [0, 1, 31, 32, 77, 127]
    for t, coords in got.items():
        assert [tuple(int(x) for x in c) for c in coords] == [(t, h) for h in range(heads)], t


# ---------------------------------------------------------------------------------------------
# Compile report (no GPU): SASS facts and resource use
# ---------------------------------------------------------------------------------------------



SM100_KERNELS = ("sm100_attn_dist_d576_h128", "sm100_attn_dist_d576_h64_topklen_norm", "sm100_attn_dist_d512_h128")


@pytest.fixture(scope="module")
def sm100_report():
    return compile_records("sm_100a", set(SM100_KERNELS) | {"probe"})


def _check_sass(r, d_qk, heads):
    from mla_kernels.sm100.attn_dist import attn_dist_plan

    plan = attn_dist_plan(d_qk, heads)
    assert r["spill_bytes"] == 0 and r["registers"] is not None and r["registers"] * 288 <= 65536
    assert r["smem_bytes"] == plan.smem_bytes <= SMEM_LIMIT
    if r["sass"] is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    sass, base = r["sass"], r["sass_base"]
    # 1-CTA tcgen05: d_qk/16 MMAs per block (unrolled once), no .2CTA form anywhere
    assert sass.get("UTCHMMA", 0) == d_qk // 16
    assert not any(".2CTA" in k for k in sass), "a 1-CTA kernel must not contain cta_group::2 ops"
    # one commit per K stage + one per accumulator slot
    assert base.get("UTCBAR", 0) == d_qk // 64 + 1
    # the epilogue reads H columns of its lane with 32x32b.x32 loads
    assert sass.get("LDTM.x32", 0) == heads // 32
    # cp.async gather: Q (heads/16 rows x d/64 tiles per thread) + one K block (8 rows x d/64)
    assert sass.get("LDGSTS.E.BYPASS.LTC256B.128", 0) == (heads // 16 + 8) * (d_qk // 64)
    assert base.get("ARRIVES", 0) == d_qk // 64 + 1
    assert sass.get("MUFU.EX2", 0) == heads
    assert base.get("LDL", 0) == 0 and base.get("STL", 0) == 0
    assert base.get("HGMMA", 0) == 0 and base.get("UTMALDG", 0) == 0


@pytest.mark.compile
@pytest.mark.parametrize("name,d_qk,heads", [
    ("sm100_attn_dist_d576_h128", 576, 128),
    ("sm100_attn_dist_d576_h64_topklen_norm", 576, 64),
    ("sm100_attn_dist_d512_h128", 512, 128),
])
def test_sm100_attn_dist_sass(sm100_report, name, d_qk, heads):
    r = sm100_report[name]
    assert r["arch"] == "sm_100a"
    _check_sass(r, d_qk, heads)


@pytest.mark.compile
def test_sm100_probe_still_compiles(sm100_report):
    assert sm100_report["probe"]["spill_bytes"] == 0


@pytest.mark.compile
def test_sm103a_attn_dist_sass():
    recs = list(compile_records("sm_103a", {"sm100_attn_dist_d576_h128"}).values())
    assert len(recs) == 1 and recs[0]["arch"] == "sm_103a"
    _check_sass(recs[0], 576, 128)


# ---------------------------------------------------------------------------------------------
# GPU runtime (compute capability 10.x)
# ---------------------------------------------------------------------------------------------

needs_sm100 = skip_unless_sm100()


def run_and_check(case, normalize, monkeypatch):
    import mla_kernels as mk
    from mla_kernels import reference as ref

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "reference")  # lse from the oracle, not the (unverified) sm100 forward
    _, _, lse = mk.sparse_mla_fwd(case.q, case.kv, case.indices, case.sm_scale, 512, case.topk_length)
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm100")
    got = mk.attn_dist(case.q, case.kv, case.indices, lse, case.sm_scale, case.topk_length, normalize)
    torch.cuda.synchronize()
    want = ref.attn_dist_ref(case.q.float(), case.kv.float(), case.indices, lse, case.sm_scale,
                             case.topk_length, normalize)
    topk = case.indices.shape[-1]
    assert got.shape == (case.q.shape[0], topk) and got.dtype == torch.float32
    assert not torch.isnan(got).any(), "NaN in attn_sum"
    valid = ref.valid_mask(case.indices, case.kv.shape[0], case.topk_length)
    assert (got[~valid] == 0).all(), "invalid slots / empty rows must be exactly 0"
    assert rel_l2(got, want) <= 1e-3, f"rel L2 {rel_l2(got, want):.3g}"


@pytest.mark.parametrize("s_q,s_kv,topk", [(1, 128, 128), (62, 592, 128), (213, 1840, 256),
                                           (62, 1521, 512), (213, 95, 128)])
@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("normalize", [False, True])
@needs_sm100
@pytest.mark.gpu
def test_attn_dist_shapes(s_q, s_kv, topk, h_q, d_qk, normalize, monkeypatch):
    case = make_case(s_q, h_q, d_qk, s_kv, topk, device="cuda", invalid_frac=0.1, empty_rows=2)
    run_and_check(case, normalize, monkeypatch)


@pytest.mark.parametrize("h_q", [64, 128, 256])
@pytest.mark.parametrize("normalize", [False, True])
@needs_sm100
@pytest.mark.gpu
def test_attn_dist_topk_length(h_q, normalize, monkeypatch):
    case = make_case(213, h_q, 576, 1840, 320, device="cuda", topk_length=True)
    run_and_check(case, normalize, monkeypatch)


@needs_sm100
@pytest.mark.gpu
def test_attn_dist_padding_and_unit_scale(monkeypatch):
    for topk in (100, 192):
        case = make_case(37, 128, 576, 777, topk, device="cuda", scale=1.0)
        run_and_check(case, True, monkeypatch)


@needs_sm100
@pytest.mark.gpu
def test_attn_dist_headline(monkeypatch):
    case = make_case(4096, 128, 576, 32768, 2048, device="cuda", invalid_frac=0.02, dup_frac=0.0)
    run_and_check(case, False, monkeypatch)

