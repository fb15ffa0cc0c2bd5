"""Every input-validation error of the public API names the argument (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

import mla_kernels as mk

S_Q, H, D, S_KV, TOPK, DV = 4, 2, 16, 10, 6, 8


def good():
    q = torch.randn(S_Q, H, D)
    kv = torch.randn(S_KV, 1, D)
    idx = torch.randint(0, S_KV, (S_Q, 1, TOPK), dtype=torch.int32)
    return q, kv, idx


def fwd(**over):
    q, kv, idx = good()
    args = dict(q=q, kv=kv, indices=idx, sm_scale=0.3, d_v=DV, topk_length=None, attn_sink=None)
    args.update(over)
    return mk.sparse_mla_fwd(**args)


@pytest.mark.parametrize(
    "over,exc,words",
    [
        (dict(q=torch.randn(S_Q, D)), ValueError, "q must have shape [s_q, h_q, d_qk]"),
        (dict(q=[1, 2]), TypeError, "q must be a torch.Tensor"),
        (dict(q=torch.randn(S_Q, H, D).to(torch.int32)), TypeError, "q must be bfloat16"),
        (dict(q=torch.randn(S_Q, 0, D)), ValueError, "h_q >= 1"),
        (dict(kv=torch.randn(S_KV, 2, D)), ValueError, "one shared KV head"),
        (dict(kv=torch.randn(S_KV, 1, D + 1)), ValueError, "kv's last dim"),
        (dict(kv=torch.randn(S_KV)), ValueError, "kv must have shape"),
        (dict(kv=torch.randn(S_KV, 1, D, dtype=torch.float64)), TypeError, "kv must have q's dtype"),
        (dict(indices=torch.zeros(S_Q + 1, 1, TOPK, dtype=torch.int32)), ValueError, "indices must have s_q"),
        (dict(indices=torch.zeros(S_Q, 2, TOPK, dtype=torch.int32)), ValueError, "indices must have shape"),
        (dict(indices=torch.zeros(S_Q, 1, TOPK, dtype=torch.float32)), TypeError, "indices must be int32 or int64"),
        (dict(indices=torch.zeros(S_Q, dtype=torch.int32)), ValueError, "indices must have shape"),
        (dict(sm_scale="a"), TypeError, "sm_scale must be a real number"),
        (dict(sm_scale=math.nan), ValueError, "sm_scale must be finite"),
        (dict(sm_scale=True), TypeError, "sm_scale"),
        (dict(d_v=D + 1), ValueError, "d_v must satisfy"),
        (dict(d_v=0), ValueError, "d_v must satisfy"),
        (dict(d_v=8.0), TypeError, "d_v must be an int"),
        (dict(topk_length=torch.zeros(S_Q + 1, dtype=torch.int32)), ValueError, "topk_length must have shape"),
        (dict(topk_length=torch.zeros(S_Q)), TypeError, "topk_length must be int32 or int64"),
        (dict(attn_sink=torch.zeros(H + 1)), ValueError, "attn_sink must have shape [h_q]"),
        (dict(attn_sink=torch.zeros(H, dtype=torch.int32)), TypeError, "attn_sink must be a floating"),
    ],
)
def test_fwd_validation(over, exc, words):
    with pytest.raises(exc) as e:
        fwd(**over)
    assert words in str(e.value)


def test_device_mismatch_is_reported():
    q, kv, idx = good()
    meta_kv = torch.empty(S_KV, 1, D, device="meta")
    with pytest.raises(ValueError, match="kv is on meta but q is on cpu"):
        mk.sparse_mla_fwd(q, meta_kv, idx, 0.3, DV)


def test_noncontiguous_inputs_are_accepted_and_equal():
    q, kv, idx = good()
    qt = torch.randn(H, S_Q, D).transpose(0, 1)  # non-contiguous
    assert not qt.is_contiguous()
    a = mk.sparse_mla_fwd(qt, kv, idx, 0.3, DV)
    b = mk.sparse_mla_fwd(qt.contiguous(), kv, idx, 0.3, DV)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_int64_indices_out_of_int32_range_are_invalid():
    q, kv, idx = good()
    big = idx.long()
    big[0, 0, :] = 2**32 + 3  # would wrap to 3 if cast naively
    out, _, lse = mk.sparse_mla_fwd(q, kv, big, 0.3, DV)
    assert torch.isposinf(lse[0]).all() and (out[0] == 0).all()


def test_empty_sizes():
    q, kv, idx = good()
    out, ml, lse = mk.sparse_mla_fwd(q[:0], kv, idx[:0], 0.3, DV)
    assert out.shape == (0, H, DV) and lse.shape == (0, H)
    out, ml, lse = mk.sparse_mla_fwd(q, kv[:0], idx, 0.3, DV)
    assert (out == 0).all() and torch.isposinf(lse).all() and torch.isneginf(ml).all()
    out, ml, lse = mk.sparse_mla_fwd(q, kv, idx[:, :, :0], 0.3, DV)
    assert (out == 0).all() and torch.isposinf(lse).all()
    assert mk.attn_dist(q, kv, idx[:, :, :0], lse, 0.3).shape == (S_Q, 0)


def test_attn_dist_validation():
    q, kv, idx = good()
    _, _, lse = mk.sparse_mla_fwd(q, kv, idx, 0.3, DV)
    with pytest.raises(ValueError, match=r"lse must have shape \[s_q, h_q\]"):
        mk.attn_dist(q, kv, idx, lse[:, :1], 0.3)
    with pytest.raises(TypeError, match="lse must be float32"):
        mk.attn_dist(q, kv, idx, lse.half(), 0.3)
    with pytest.raises(TypeError, match="normalize must be a bool"):
        mk.attn_dist(q, kv, idx, lse, 0.3, normalize=1)
    assert mk.attn_dist(q, kv, idx, lse, 0.3).shape == (S_Q, TOPK)


def test_bwd_validation():
    q, kv, idx = good()
    out, _, lse = mk.sparse_mla_fwd(q, kv, idx, 0.3, DV)
    dout = torch.randn_like(out)
    with pytest.raises(ValueError, match=r"out must have shape \[s_q, h_q, d_v\]"):
        mk.sparse_mla_bwd(q, kv, out[:, :, :4], dout, idx, lse, 0.3, DV)
    with pytest.raises(TypeError, match="dout must have q's dtype"):
        mk.sparse_mla_bwd(q, kv, out, dout.double(), idx, lse, 0.3, DV)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        mk.sparse_mla_bwd(q, kv, out, dout, idx, lse, 0.3, DV, deterministic="yes")
    dq, dkv, dsink = mk.sparse_mla_bwd(q, kv, out, dout, idx, lse, 0.3, DV)
    assert dq.shape == q.shape and dkv.shape == kv.shape and dsink is None


def test_autograd_op_validation():
    q, kv, idx = good()
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        mk.sparse_mla(q, kv, idx, 0.3, DV, return_lse=None)
    with pytest.raises(TypeError, match="AttnSum holder"):
        mk.sparse_mla(q, kv, idx, 0.3, DV, attn_sum={})


def test_topk_length_is_clamped():
    q, kv, idx = good()
    a = mk.sparse_mla_fwd(q, kv, idx, 0.3, DV, topk_length=torch.full((S_Q,), 100, dtype=torch.int64))
    b = mk.sparse_mla_fwd(q, kv, idx, 0.3, DV)
    torch.testing.assert_close(a[0], b[0])
    c = mk.sparse_mla_fwd(q, kv, idx, 0.3, DV, topk_length=torch.full((S_Q,), -5, dtype=torch.int32))
    assert (c[0] == 0).all() and torch.isposinf(c[2]).all()


@pytest.mark.parametrize("scale", [0.0, -0.3, -math.inf])
def test_nonpositive_sm_scale_is_rejected_by_every_op(scale):
    q, kv, idx = good()
    out, _, lse = mk.sparse_mla_fwd(q, kv, idx, 0.3, DV)
    calls = [
        lambda: mk.sparse_mla_fwd(q, kv, idx, scale, DV),
        lambda: mk.attn_dist(q, kv, idx, lse, scale),
        lambda: mk.sparse_mla_bwd(q, kv, out, out, idx, lse, scale, DV),
        lambda: mk.sparse_mla(q, kv, idx, scale, DV),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="sm_scale must be"):
            call()
    from mla_kernels import reference as ref

    for call in (lambda: ref.sparse_mla_fwd_ref(q, kv, idx, scale, DV),
                 lambda: ref.attn_dist_ref(q, kv, idx, lse, scale),
                 lambda: ref.sparse_mla_bwd_ref(q, kv, out, out, idx, lse, scale, DV)):
        with pytest.raises(ValueError, match="sm_scale must be a finite number > 0"):
            call()


def test_sparse_mla_checks_deterministic_type_before_running():
    q, kv, idx = good()
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        mk.sparse_mla(q.requires_grad_(), kv, idx, 0.3, DV, deterministic="x")
