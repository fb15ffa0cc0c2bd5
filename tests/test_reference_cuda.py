"""The reference on a CUDA device (the backend that serves ops without a kernel there):
forward parity with the CPU result, and the deterministic backward bitwise-reproducible."""

from __future__ import annotations

import pytest
import torch

from mla_kernels import reference as ref

from conftest import cuda_capability, make_case

pytestmark = [
    pytest.mark.skipif(cuda_capability() is None, reason="needs a CUDA GPU; none present"),
    pytest.mark.gpu,
]


def test_reference_bwd_deterministic_on_cuda():
    case = make_case(300, 64, 576, 50, 256, device="cuda", dtype=torch.float32, dup_frac=0.3, scale=1.0)
    out, _, lse = ref.sparse_mla_fwd_ref(case.q, case.kv, case.indices, case.sm_scale, 512)
    dout = torch.randn_like(out)
    runs = [ref.sparse_mla_bwd_ref(case.q, case.kv, out, dout, case.indices, lse, case.sm_scale, 512,
                                   deterministic=True) for _ in range(3)]
    assert all(torch.equal(runs[0][1], r[1]) for r in runs[1:]), "dkv not bitwise reproducible"
    plain = ref.sparse_mla_bwd_ref(case.q, case.kv, out, dout, case.indices, lse, case.sm_scale, 512)
    torch.testing.assert_close(runs[0][1], plain[1], rtol=1e-4, atol=1e-4)


def test_reference_fwd_cuda_matches_cpu():
    case = make_case(40, 16, 64, 300, 96, d_v=32, dtype=torch.float64, topk_length=True, sink="finite")
    cpu = ref.sparse_mla_fwd_ref(case.q, case.kv, case.indices, case.sm_scale, 32, case.topk_length,
                                 case.attn_sink.double())
    gpu = ref.sparse_mla_fwd_ref(case.q.cuda(), case.kv.cuda(), case.indices.cuda(), case.sm_scale, 32,
                                 case.topk_length.cuda(), case.attn_sink.double().cuda())
    for a, b in zip(cpu, gpu):
        torch.testing.assert_close(a, b.cpu(), rtol=1e-10, atol=1e-12)
