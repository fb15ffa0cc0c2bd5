"""sm100 sparse backward: what can be proven without a Blackwell GPU, and the GPU checks.

* host logic (no compile): the TMEM column plan (inside 512 columns, no overlap), the head-dim
  chunks, the smem budget, the backend's answers, the shared host driver;
* layout contract (trace only, forced to sm_100a): the K-major operand layouts and the MN-major
  views the MMA descriptors are built from place every element where the cp.async writers
  (``KvGather``, ``copy_dense_rows``) and the math warps' P/dS stores put it; the TMEM loads give
  each thread the rows/columns the kernel assumes;
* compile report (marked ``compile``): sm_100a/sm_103a SASS has the 1-CTA tcgen05 MMAs, TMEM
  loads, commits, the cp.async gather, ``MUFU.EX2``, 16-byte float atomics (none in the
  deterministic variant), no spills, smem within budget;
* GPU runtime (compute capability 10.x only, skipped elsewhere): kernel vs the float32 reference,
  mirroring ``test_sm90_bwd.py``.
"""

from __future__ import annotations


import pytest
import torch

from mla_kernels.common.problem import Problem

from conftest import make_case, run_bwd_and_check, skip_unless_sm100
from conftest import compile_records
from conftest import needs_cutlass as _cutlass, sw128 as _sw128, tile_offset as _writer_offset

SMEM_LIMIT = 232448



# ---------------------------------------------------------------------------------------------
# Host logic
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_qk", [576, 512])
def test_tmem_plan_within_512_columns_no_overlap(d_qk):
    _cutlass()
    from mla_kernels.sm100.bwd import B_H, B_TOPK, D_CHUNK, TMEM_COLUMNS, bwd_plan

    p = bwd_plan(d_qk)
    regs = sorted(p.tmem_regions(), key=lambda r: r[1])
    assert regs[0][1] == 0 and regs[-1][2] <= TMEM_COLUMNS
    for (_, lo0, hi0), (_, lo1, hi1) in zip(regs, regs[1:]):
        assert lo0 < hi0 <= lo1 < hi1
    names = [r[0] for r in regs]
    assert names[:2] == ["S", "dP"] and len(p.dq_cols) == len(p.chunk_dims)
    assert len(p.dkv_cols) == (1 if d_qk == 576 else 2)
    assert all(hi - lo == 64 for _, lo, hi in regs) and B_H == B_TOPK == 64
    # chunks of 128 dims cover [0, d_qk) exactly once among their stored rows
    covered = []
    for first, store in zip(p.chunk_dims, p.chunk_store_row):
        assert 0 <= first and first + D_CHUNK <= d_qk and first % 64 == 0 and store in (0, 64)
        covered += list(range(first + store, first + D_CHUNK))
    assert covered == list(range(d_qk))


@pytest.mark.parametrize("d_qk", [576, 512])
def test_smem_budget(d_qk):
    _cutlass()
    from mla_kernels.sm100.bwd import SMEM_HEADER_BYTES, bwd_plan

    p = bwd_plan(d_qk)
    operands = 2 * (64 * d_qk + 64 * 512 + 64 * d_qk + 2 * 64 * 64)  # Q, dO, KV tile, P, dS
    assert p.smem_bytes == SMEM_HEADER_BYTES + operands <= SMEM_LIMIT


def test_plan_rejects_unsupported():
    _cutlass()
    from mla_kernels.sm100.bwd import bwd_plan

    with pytest.raises(ValueError, match="d_qk"):
        bwd_plan(256)
    with pytest.raises(ValueError, match="d_v"):
        bwd_plan(576, 256)


@pytest.mark.parametrize("h_q", [64, 128, 192, 256])
def test_grid_is_tokens_times_head_blocks(h_q):
    _cutlass()
    from mla_kernels.sm100.bwd import B_H, THREADS

    assert h_q % B_H == 0 and THREADS == 416  # grid: s_q * h_q / 64 CTAs of 13 warps


def _problem(h_q=128, d_qk=576, dtype=torch.bfloat16, sm_scale=0.1, d_v=512):
    q = torch.zeros(2, h_q, d_qk, dtype=dtype)
    kv = torch.zeros(16, d_qk, dtype=dtype)
    idx = torch.zeros(2, 128, dtype=torch.int32)
    return Problem(q, kv, idx, sm_scale, d_v, None, None, kv.shape)


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
def test_backend_bwd_rejects(kw, reason):
    from mla_kernels.sm100 import BACKEND

    why = BACKEND.supports("bwd", _problem(**kw))
    assert why is not None and reason in why


@pytest.mark.parametrize("h_q,d_qk", [(64, 576), (128, 512), (256, 576), (192, 512)])
def test_backend_supports_bwd(h_q, d_qk):
    from mla_kernels.sm100 import BACKEND

    assert BACKEND.supports("bwd", _problem(h_q=h_q, d_qk=d_qk)) is None


def test_host_driver_is_shared():
    """sm90 and sm100 drive their kernels through the same host code (one argument order)."""
    import inspect

    from mla_kernels.common import bwd_host
    from mla_kernels.sm90 import Sm90Backend
    from mla_kernels.sm100 import Sm100Backend

    assert Sm90Backend.bwd is Sm100Backend.bwd  # one host driver (common.kernel_backend -> bwd_host)
    params = inspect.signature(bwd_host.run_bwd).parameters
    assert "compile_bwd" in params and "name" in params
    from mla_kernels import sm90, sm100

    sig90 = inspect.signature(sm90.compile_bwd).parameters
    sig100 = inspect.signature(sm100.compile_bwd).parameters
    assert list(sig90)[:-2] == list(sig100)[:-2]  # same static configuration arguments


# ---------------------------------------------------------------------------------------------
# Layout contract (host-side tracing, no compile)
# ---------------------------------------------------------------------------------------------




@pytest.mark.parametrize("d_qk", [576, 512])
def test_operand_layouts_match_the_writers(d_qk, trace_for_sm100):
    cute = _cutlass()
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass import BFloat16
    from cutlass.cute.nvgpu import tcgen05

    from mla_kernels.sm100.bwd import B_H, B_TOPK, D_CHUNK, TILE_BYTES, SparseMlaBwdSm100

    k = SparseMlaBwdSm100(d_qk)
    got = {}

    @cute.jit
    def trace():
        mma_s = k._mma_s()
        sK = sm100_utils.make_smem_layout_a(mma_s, (B_TOPK, B_H, d_qk), BFloat16, 1)
        sQ = sm100_utils.make_smem_layout_b(mma_s, (B_TOPK, B_H, d_qk), BFloat16, 1)
        sPK = sm100_utils.make_smem_layout_b(k._mma_dkv(), (D_CHUNK, B_TOPK, B_H), BFloat16, 1)
        atom = tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.MN_SW128, BFloat16)
        sT128 = cute.tile_to_shape(atom, (D_CHUNK, 64), (1, 0))
        sT64 = cute.tile_to_shape(atom, (64, 64), (1, 0))
        for r in (0, 1, 7, 8, 13, 63):
            for c in (0, 8, 17, 40, 63, 64, 100, d_qk - 1):
                got[("K", r, c)] = cute.crd2idx(((r, c % 16), 0, c // 16, 0), sK.outer)
                got[("Q", r, c)] = cute.crd2idx(((r, c % 16), 0, c // 16, 0), sQ.outer)
        for n in (0, 3, 9, 63):
            for h in (0, 7, 8, 31, 32, 63):
                got[("PK", n, h)] = cute.crd2idx(((n, h % 16), 0, h // 16, 0), sPK.outer)
        for m in (0, 1, 9, 63, 64, 100, 127):
            for t in (0, 1, 7, 8, 30, 63):
                got[("T128", m, t)] = cute.crd2idx((m, t), sT128.outer)
        for m in (0, 1, 9, 40, 63):
            for t in (0, 1, 7, 8, 30, 63):
                got[("T64", m, t)] = cute.crd2idx((m, t), sT64.outer)
        for lay in (sK, sQ, sPK, sT128, sT64):
            assert str(lay.inner) == "S<3,4,3>"

    trace()
    assert got
    for key, elem in got.items():
        phys = _sw128(2 * int(elem))
        kind, a, b = key
        if kind in ("K", "Q", "PK"):
            assert phys == _writer_offset(a, b), key
        elif kind == "T128":
            # MN view element (dim m, token t) of a chunk = KV[t, dim0 + m] (dim0 a multiple of
            # 64: the view starts dim0 / 64 tiles in, a multiple of 1024 bytes)
            for dim0 in (0, 448):
                assert phys + (dim0 // 64) * TILE_BYTES == _writer_offset(b, dim0 + a), key
        else:  # dS^T view: (head m, token t) = dS[t, m]
            assert phys == _writer_offset(b, a), key


def test_tmem_loads_give_the_assumed_rows(trace_for_sm100):
    """Math warps: 16x32bx2 on the M=64 S^T/dP^T accumulator gives thread t token
    16 (t // 32) + t % 16 and heads 32 ((t % 32) // 16) + j.  dQ^T/dKV^T (M=128): 32x32b gives
    thread t row t (a head dim) and element j column j (a head / a token)."""
    cute = _cutlass()
    from cutlass import Float32
    from cutlass.cute.nvgpu import tcgen05

    from mla_kernels.sm100.bwd import B_H, B_TOPK, D_CHUNK, SparseMlaBwdSm100

    k = SparseMlaBwdSm100(576)
    got = {}

    @cute.jit
    def trace():
        tmem = cute.make_ptr(Float32, 0, cute.AddressSpace.tmem, assumed_align=16)
        mma_s = k._mma_s()
        tS = cute.make_tensor(tmem, mma_s.make_fragment_C(mma_s.partition_shape_C((B_TOPK, B_H))).layout)
        c16 = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld16x32bx2Op(tcgen05.Repetition.x32), Float32), tS)
        crd = mma_s.get_slice(0).partition_C(cute.make_identity_tensor((B_TOPK, B_H)))
        for t in (0, 5, 15, 16, 31, 32, 77, 127):
            part = c16.get_slice(t).partition_D(crd)
            got[("S", t)] = [part[i] for i in range(cute.size(part))]
        mma_dq = k._mma_dq()
        tQ = cute.make_tensor(tmem, mma_dq.make_fragment_C(mma_dq.partition_shape_C((D_CHUNK, B_H))).layout)
        c32 = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x64), Float32), tQ)
        crd2 = mma_dq.get_slice(0).partition_C(cute.make_identity_tensor((D_CHUNK, B_H)))
        for t in (0, 31, 32, 100, 127):
            part = c32.get_slice(t).partition_D(crd2)
            got[("DQ", t)] = [part[i] for i in range(cute.size(part))]

    trace()
    for (kind, t), coords in got.items():
        cs = [tuple(int(x) for x in c) for c in coords]
        if kind == "S":
            row = 16 * (t // 32) + t % 16
            h0 = 32 * ((t % 32) // 16)
            assert cs == [(row, h0 + j) for j in range(32)], t
        else:
            assert cs == [(t, j) for j in range(64)], t


# ---------------------------------------------------------------------------------------------
# Compile report (no GPU): SASS facts and resource use
# ---------------------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def sm100_bwd_report():
    names = {"sm100_bwd_d576_h64", "sm100_bwd_d576_h64_det", "sm100_bwd_d512_h64"}
    return compile_records("sm_100a", names)


def _check_sass(r, d_qk, deterministic):
    from mla_kernels.sm100.bwd import THREADS, bwd_plan

    plan = bwd_plan(d_qk)
    assert r["spill_bytes"] == 0 and r["registers"] is not None and r["registers"] * THREADS <= 65536
    assert r["smem_bytes"] is not None and r["smem_bytes"] <= plan.smem_bytes <= SMEM_LIMIT
    if r["sass"] is None:
        pytest.skip("nvdisasm not installed: SASS not inspected")
    sass, base = r["sass"], r["sass_base"]
    n_k, n_v, n_ch = d_qk // 64, 512 // 64, len(plan.chunk_dims)
    n_dkv_do = sum(1 for f, s in zip(plan.chunk_dims, plan.chunk_store_row) if f + s < 512)
    # per block (unrolled once): S^T + dP^T (4 per 64-col tile), dQ^T (4 per chunk), dKV^T
    assert sass.get("UTCHMMA", 0) == 4 * (n_k + n_v) + 4 * n_ch + 4 * (n_ch + n_dkv_do)
    assert not any(".2CTA" in k for k in sass), "a 1-CTA kernel must not contain cta_group::2 ops"
    # commits: s_full, kv_free, one per dKV chunk, pds_free, dq_full
    assert sass.get("UTCBAR", 0) == n_ch + 4
    assert base.get("LDTM", 0) >= 4 + 2 * n_ch  # S/dP (16x32bx2: 2 each), dQ^T and dKV^T chunks
    # cp.async: Q (4 rows x d/64 tiles per thread), dO (4 x 8), one KV block (4 x d/64)
    assert sass.get("LDGSTS.E.BYPASS.LTC256B.128", 0) == 4 * (2 * n_k + n_v)
    assert sass.get("MUFU.EX2", 0) == 32  # one per (token, head) of the thread's half row
    atomics = sass.get("REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU", 0)
    if deterministic:
        assert base.get("REDG", 0) == 0 and base.get("ATOMG", 0) == 0
        assert sass.get("STG.E.128", 0) == 16 * n_ch
    else:
        assert atomics == 16 * n_ch  # 16 16-byte atomics per thread per chunk
    assert base.get("LDL", 0) == 0 and base.get("STL", 0) == 0
    assert base.get("HGMMA", 0) == 0


@pytest.mark.compile
@pytest.mark.parametrize("name,d_qk,det", [("sm100_bwd_d576_h64", 576, False), ("sm100_bwd_d576_h64_det", 576, True),
                                          ("sm100_bwd_d512_h64", 512, False)])
def test_sm100_bwd_sass(sm100_bwd_report, name, d_qk, det):
    r = sm100_bwd_report[name]
    assert r["arch"] == "sm_100a"
    _check_sass(r, d_qk, det)


@pytest.mark.compile
def test_sm103a_bwd_sass():
    recs = list(compile_records("sm_103a", {"sm100_bwd_d576_h64"}).values())
    assert len(recs) == 1 and recs[0]["arch"] == "sm_103a"
    _check_sass(recs[0], 576, False)


# ---------------------------------------------------------------------------------------------
# GPU runtime (compute capability 10.x)
# ---------------------------------------------------------------------------------------------

needs_sm100 = skip_unless_sm100()


def run_and_check(case, monkeypatch, **kw):
    return run_bwd_and_check(case, monkeypatch, "sm100", **kw)


SHAPES = [(1, 128, 128), (62, 592, 128), (213, 1840, 256), (62, 1521, 512), (213, 95, 128)]


@pytest.mark.parametrize("s_q,s_kv,topk", SHAPES)
@pytest.mark.parametrize("h_q,kernel", [(64, "auto"), (128, "auto"), (128, "1cta")])  # auto at 128 = 2-CTA
@pytest.mark.parametrize("d_qk", [576, 512])
@needs_sm100
@pytest.mark.gpu
def test_bwd_shapes(s_q, s_kv, topk, h_q, kernel, d_qk, monkeypatch):
    from mla_kernels.sm100 import ENV_BWD_KERNEL

    monkeypatch.setenv(ENV_BWD_KERNEL, kernel)
    case = make_case(s_q, h_q, d_qk, s_kv, topk, device="cuda", invalid_frac=0.1, empty_rows=2)
    run_and_check(case, monkeypatch)


@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("sink", [None, "finite", "neginf"])
@needs_sm100
@pytest.mark.gpu
def test_bwd_topk_length_and_sink(d_qk, sink, monkeypatch):
    case = make_case(213, 128, d_qk, 1840, 256, device="cuda", topk_length=True, sink=sink)
    run_and_check(case, monkeypatch, attn_sum=True)


@needs_sm100
@pytest.mark.gpu
def test_bwd_heavy_collisions_and_duplicates(monkeypatch):
    case = make_case(300, 128, 576, 40, 256, device="cuda", invalid_frac=0.05, dup_frac=0.3)
    run_and_check(case, monkeypatch)
    case = make_case(50, 64, 576, 300, 128, device="cuda", invalid_frac=0.0, dup_frac=0.0, empty_rows=0)
    case.indices[0] = -1
    case.indices[1] = 5
    case.indices[2, 0, ::2] = 10_000
    run_and_check(case, monkeypatch, attn_sum=True)


@needs_sm100
@pytest.mark.gpu
def test_bwd_odd_topk_many_heads_unit_scale(monkeypatch):
    for topk in (192, 100, 64, 1):
        case = make_case(37, 64, 576, 777, topk, device="cuda", topk_length=topk > 1)
        run_and_check(case, monkeypatch, attn_sum=True, dq_abs=1e-6 if topk == 1 else None)
    run_and_check(make_case(20, 256, 576, 1000, 256, device="cuda"), monkeypatch, attn_sum=True)
    run_and_check(make_case(64, 128, 576, 4000, 512, device="cuda", scale=1.0), monkeypatch, dout_scale=1.0)


@pytest.mark.parametrize("h_q,d_qk", [(128, 576), (64, 512)])
@needs_sm100
@pytest.mark.gpu
def test_bwd_deterministic_bitwise(h_q, d_qk, monkeypatch):
    case = make_case(300, h_q, d_qk, 200, 512, device="cuda", topk_length=True, sink="finite", dup_frac=0.2)
    runs = [run_and_check(case, monkeypatch, deterministic=True, attn_sum=True) for _ in range(3)]
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a, b), "deterministic backward differs between runs"


@needs_sm100
@pytest.mark.gpu
def test_bwd_headline_shape(monkeypatch):
    case = make_case(4096, 128, 576, 32768, 2048, device="cuda", invalid_frac=0.02, empty_rows=2)
    run_and_check(case, monkeypatch)
