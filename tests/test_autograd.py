"""The autograd op on the reference backend (CPU): gradcheck, lse gradients, attn_sum holder."""

from __future__ import annotations

import torch

import mla_kernels as mk
from mla_kernels import reference as ref

from conftest import make_case


def _case(tl=True, sink="finite"):
    return make_case(5, 3, 16, 14, 7, d_v=8, dtype=torch.float64, invalid_frac=0.25, dup_frac=0.3,
                     empty_rows=1, topk_length=tl, sink=sink, scale=1.0)


def test_gradcheck_out():
    c = _case()
    q = c.q.clone().requires_grad_()
    kv = c.kv.clone().requires_grad_()
    sink = c.attn_sink.double().clone().requires_grad_()
    f = lambda q, kv, s: mk.sparse_mla(q, kv, c.indices, c.sm_scale, 8, c.topk_length, s)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, kv, sink))


def test_gradcheck_lse_on_nonempty_rows():
    # lse is differentiable too; rows with no valid slot have lse = +inf (no finite derivative)
    c = _case(tl=False, sink=None)
    nonempty = ref.valid_mask(c.indices, 14).any(-1)
    q = c.q.clone().requires_grad_()
    kv = c.kv.clone().requires_grad_()

    def f(q, kv):
        out, lse = mk.sparse_mla(q, kv, c.indices, c.sm_scale, 8, return_lse=True)
        return out, lse[nonempty]

    assert torch.autograd.gradcheck(f, (q, kv))


def test_grads_shapes_dtypes_and_2d_inputs():
    c = make_case(6, 4, 16, 20, 8, d_v=16, dtype=torch.float32)
    q = c.q.clone().requires_grad_()
    kv = c.kv.reshape(20, 16).clone().requires_grad_()  # [s_kv, d_qk] form
    idx = c.indices.reshape(6, 8).long()  # [s_q, topk] int64 form
    sink = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    out = mk.sparse_mla(q, kv, idx, c.sm_scale, 16, attn_sink=sink)
    out.float().square().sum().backward()
    assert q.grad.shape == q.shape and kv.grad.shape == (20, 16)
    assert sink.grad.dtype == torch.bfloat16 and sink.grad.shape == (4,)


def test_attn_sum_holder_matches_attn_dist():
    c = _case(sink=None)
    q = c.q.clone().requires_grad_()
    holder = mk.AttnSum()
    out, lse = mk.sparse_mla(q, c.kv, c.indices, c.sm_scale, 8, c.topk_length, return_lse=True, attn_sum=holder)
    assert holder.value is None
    out.sum().backward()
    want = mk.attn_dist(c.q, c.kv, c.indices, lse.detach(), c.sm_scale, c.topk_length)
    torch.testing.assert_close(holder.value, want)


def test_deterministic_flag_is_accepted_and_reproducible():
    c = _case()
    grads = []
    for _ in range(2):
        q = c.q.clone().requires_grad_()
        kv = c.kv.clone().requires_grad_()
        out = mk.sparse_mla(q, kv, c.indices, c.sm_scale, 8, c.topk_length, deterministic=True)
        out.sum().backward()
        grads.append((q.grad, kv.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_backward_matches_public_bwd():
    c = _case()
    q = c.q.clone().requires_grad_()
    kv = c.kv.clone().requires_grad_()
    sink = c.attn_sink.double().clone().requires_grad_()
    out = mk.sparse_mla(q, kv, c.indices, c.sm_scale, 8, c.topk_length, sink)
    dout = torch.randn_like(out)
    out.backward(dout)
    _, _, lse = mk.sparse_mla_fwd(c.q, c.kv, c.indices, c.sm_scale, 8, c.topk_length, sink.detach())
    dq, dkv, dsink = mk.sparse_mla_bwd(c.q, c.kv, out.detach(), dout, c.indices, lse, c.sm_scale, 8,
                                       c.topk_length, sink.detach())
    torch.testing.assert_close(q.grad, dq)
    torch.testing.assert_close(kv.grad, dkv)
    torch.testing.assert_close(sink.grad, dsink)
