"""Every input-validation error of the indexer ops names the argument (CPU), and dispatch of the
indexer ops (CPU -> reference; the sm90 backend's support answers)."""

from __future__ import annotations

import pytest
import torch

import mla_kernels as mk
from mla_kernels.api_indexer import make_indexer_problem

S_Q, H, D, S_KV, TOPK = 4, 2, 8, 10, 3
FP8 = torch.float8_e4m3fn


def good(dtype=torch.float32):
    return dict(q_idx=torch.randn(S_Q, H, D).to(dtype), k_idx=torch.randn(S_KV, D).to(dtype),
                weights=torch.randn(S_Q, H))


def topk_call(**over):
    args = good()
    args.update(topk=TOPK)
    args.update(over)
    return mk.indexer_topk(**args)


def loss_call(**over):
    args = good()
    args.update(indices=torch.randint(0, S_KV, (S_Q, TOPK)), target=torch.rand(S_Q, TOPK))
    args.update(over)
    return mk.indexer_loss(**args)


SHARED = [
    (dict(q_idx=torch.randn(S_Q, D)), ValueError, "q_idx must have shape [s_q, h_idx, d_idx]"),
    (dict(q_idx=[1.0]), TypeError, "q_idx must be a torch.Tensor"),
    (dict(q_idx=torch.zeros(S_Q, H, D, dtype=torch.int32)), TypeError, "q_idx must be bfloat16"),
    (dict(q_idx=torch.randn(S_Q, 0, D)), ValueError, "h_idx >= 1"),
    (dict(k_idx=torch.randn(S_KV, 2, D)), ValueError, "one shared key head"),
    (dict(k_idx=torch.randn(S_KV, D + 1)), ValueError, "k_idx's last dim"),
    (dict(k_idx=torch.randn(S_KV)), ValueError, "k_idx must have shape"),
    (dict(k_idx=torch.randn(S_KV, D, dtype=torch.float64)), TypeError, "k_idx must have q_idx's dtype"),
    (dict(k_idx="k"), TypeError, "k_idx must be a torch.Tensor"),
    (dict(weights=torch.randn(S_Q, H + 1)), ValueError, "weights must have shape [s_q, h_idx]"),
    (dict(weights=torch.randn(S_Q + 1, H)), ValueError, "weights must have shape [s_q, h_idx]"),
    (dict(weights=torch.ones(S_Q, H, dtype=torch.int64)), TypeError, "weights must be a float tensor"),
    (dict(sm_scale="x"), TypeError, "sm_scale must be a real number"),
    (dict(sm_scale=float("inf")), ValueError, "sm_scale must be finite"),
    (dict(q_scale=torch.ones(S_Q, H)), ValueError, "only for float8_e4m3fn"),
]


@pytest.mark.parametrize("over,exc,words", SHARED + [
    (dict(topk=0), ValueError, "topk must be >= 1"),
    (dict(topk=-3), ValueError, "topk must be >= 1"),
    (dict(topk=2.0), TypeError, "topk must be an int"),
    (dict(topk=True), TypeError, "topk must be an int"),
    (dict(return_logits=1), TypeError, "return_logits must be a bool"),
    (dict(k_start=torch.zeros(S_Q + 1, dtype=torch.int32)), ValueError, "k_start must have shape [s_q]"),
    (dict(k_end=torch.zeros(S_Q, dtype=torch.float32)), TypeError, "k_end must be int32 or int64"),
    (dict(k_end=[1, 2, 3, 4]), TypeError, "k_end must be a torch.Tensor"),
])
def test_topk_validation(over, exc, words):
    with pytest.raises(exc) as e:
        topk_call(**over)
    assert words in str(e.value), str(e.value)


def test_logits_validation_shares_the_checks():
    with pytest.raises(ValueError, match="k_idx's last dim"):
        mk.indexer_logits(torch.randn(S_Q, H, D), torch.randn(S_KV, D + 1), torch.randn(S_Q, H))
    with pytest.raises(TypeError, match="unexpected keyword"):
        mk.indexer_logits(**good(), topk=3)


@pytest.mark.parametrize("over,exc,words", [
    (dict(q_scale=None, k_scale=torch.ones(S_KV)), ValueError, "need both dequantisation scales"),
    (dict(k_scale=None), ValueError, "need both dequantisation scales"),
    (dict(q_scale=torch.ones(S_Q, H + 1)), ValueError, "q_scale must have shape"),
    (dict(k_scale=torch.ones(S_KV + 1)), ValueError, "k_scale must have shape"),
    (dict(k_scale=torch.ones(S_KV, dtype=torch.int32)), TypeError, "k_scale must be a float tensor"),
    (dict(weights=torch.randn(S_Q, H).to(FP8)), TypeError, "weights must be a float tensor"),
])
def test_fp8_validation(over, exc, words):
    args = good(FP8)
    args.update(topk=TOPK, q_scale=torch.ones(S_Q, H), k_scale=torch.ones(S_KV))
    args.update(over)
    with pytest.raises(exc) as e:
        mk.indexer_topk(**args)
    assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("over,exc,words", SHARED + [
    (dict(indices=torch.zeros(S_Q + 1, TOPK, dtype=torch.int32)), ValueError, "indices must have s_q"),
    (dict(indices=torch.zeros(S_Q, 2, TOPK, dtype=torch.int32)), ValueError, "indices must have shape"),
    (dict(indices=torch.zeros(S_Q, TOPK)), TypeError, "indices must be int32 or int64"),
    (dict(target=torch.rand(S_Q, TOPK + 1)), ValueError, "target must have shape [s_q, topk]"),
    (dict(target=torch.rand(S_Q)), ValueError, "target must have shape [s_q, topk]"),
    (dict(target=torch.ones(S_Q, TOPK, dtype=torch.int32)), TypeError, "target must be a float tensor"),
    (dict(target=None), TypeError, "target must be a torch.Tensor"),
    (dict(topk_length=torch.zeros(S_Q + 2, dtype=torch.int32)), ValueError, "topk_length must have shape"),
    (dict(topk_length=torch.zeros(S_Q)), TypeError, "topk_length must be int32 or int64"),
    (dict(reduction="avg"), ValueError, "reduction must be one of mean, sum, none"),
    (dict(reduction=None), TypeError, "reduction must be a str"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool"),
])
def test_loss_validation(over, exc, words):
    with pytest.raises(exc) as e:
        loss_call(**over)
    assert words in str(e.value), str(e.value)


def test_loss_fp8_requiring_grad_is_refused():
    args = good(FP8)
    args["q_idx"].requires_grad_(True)
    with pytest.raises(ValueError, match="float8_e4m3fn inputs are forward-only, but q_idx require grad"):
        mk.indexer_loss(**args, indices=torch.zeros(S_Q, TOPK, dtype=torch.int32), target=torch.rand(S_Q, TOPK),
                        q_scale=torch.ones(S_Q, H), k_scale=torch.ones(S_KV))


def test_problem_normalisation():
    q, k, w = good(torch.bfloat16).values()
    p = make_indexer_problem(q, k.reshape(S_KV, 1, D), w.to(torch.bfloat16), sm_scale=torch.tensor(0.5),
                             k_start=torch.tensor([-3, 0, 2, 50]), k_end=torch.tensor([4, 20, 1, 60]))
    assert p.k.shape == (S_KV, D) and p.k_shape == (S_KV, 1, D) and p.weights.dtype == torch.float32
    assert p.k_start.tolist() == [0, 0, 2, 10] and p.k_end.tolist() == [4, 10, 1, 10]
    assert p.k_start.dtype == torch.int32 and p.sm_scale == 0.5
    p = make_indexer_problem(q, k, w)
    assert p.k_end.tolist() == [S_KV - S_Q + t + 1 for t in range(S_Q)]


def test_cpu_dispatch_uses_reference(monkeypatch):
    from mla_kernels import dispatch

    p = make_indexer_problem(*good().values())
    for op in ("indexer_logits", "indexer_topk"):
        assert dispatch.select(op, p).name == "reference"
    # a forced kernel backend never falls back silently: CPU tensors raise
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    with pytest.raises(dispatch.BackendUnavailableError):
        dispatch.select("indexer_topk", p)
    with pytest.raises(dispatch.BackendUnavailableError):
        mk.indexer_topk(*good().values(), 3)
    monkeypatch.setenv("MLA_KERNELS_BACKEND", "reference")
    assert dispatch.select("indexer_loss_fwd", p).name == "reference"
