"""The torch.library custom ops (mla_kernels/ops.py): opcheck on the CPU reference,
torch.compile(fullgraph=True) forward + backward on CPU and GPU, torch.export, the eager fast path,
double backward, and the tracing-time validation errors."""

from __future__ import annotations

import math
import pytest
import torch

import mla_kernels as mk
from mla_kernels import api

from conftest import make_case, rel_l2, skip_unless_sm90

S_Q, H, D, DV, S_KV, TOPK = 6, 4, 16, 8, 20, 7


def _case(dtype=torch.float64, device="cpu", tl=True, sink="finite"):
    return make_case(S_Q, H, D, S_KV, TOPK, d_v=DV, dtype=dtype, device=device, invalid_frac=0.25,
                     dup_frac=0.2, empty_rows=1, topk_length=tl, sink=sink, scale=1.0, seed=3)


def _lse(c):
    # finite lse on every row (attn_dist of an empty row stays 0 either way)
    return mk.sparse_mla_fwd(c.q, c.kv, c.indices, c.sm_scale, DV, c.topk_length)[2].clamp(max=50.0)


def _opcheck_cases():
    c = _case()
    q = c.q.clone().requires_grad_()
    kv = c.kv.clone().requires_grad_()
    sink = c.attn_sink.double().clone().requires_grad_()
    out, _, lse = mk.sparse_mla_fwd(c.q, c.kv, c.indices, c.sm_scale, DV, c.topk_length, c.attn_sink.double())
    dout = torch.randn_like(out)
    lse_f = lse.clamp(max=50.0)
    return {
        "sparse_mla_fwd": (q, kv, c.indices, c.sm_scale, DV, c.topk_length, sink, False),
        "sparse_mla_fwd-int64-2d": (q, kv.reshape(S_KV, D), c.indices.reshape(S_Q, TOPK).long(), c.sm_scale, DV,
                                    None, None, True),
        "attn_dist": (c.q, c.kv, c.indices, lse_f, c.sm_scale, c.topk_length, True),
        "sparse_mla_bwd": (c.q, c.kv, out, dout, c.indices, lse, c.sm_scale, DV, c.topk_length,
                           c.attn_sink.double(), torch.randn_like(lse_f)),
        "sparse_mla_bwd-asum": (c.q, c.kv, out, dout, c.indices, lse, c.sm_scale, DV, None, None, None),
    }


def _decode_case(dtype=torch.float64):
    g = torch.Generator().manual_seed(5)
    b, s_q, h, d, dv, pages, page, topk = 3, 2, 8, 32, 16, 6, 4, 9
    q = torch.randn(b, s_q, h, d, generator=g, dtype=dtype)
    cache = torch.randn(pages, page, 1, d, generator=g, dtype=dtype)
    idx = torch.randint(-2, pages * page + 3, (b, s_q, topk), generator=g).to(torch.int32)
    tl = torch.tensor([9, 0, 5], dtype=torch.int32)
    sink = torch.randn(h, generator=g, dtype=dtype)
    bt = torch.tensor([[5, 4, 3], [0, 1, 2], [2, -1, 1]], dtype=torch.int32)
    bias = torch.randn(b, h, d, generator=g, dtype=dtype)
    return q, cache, idx, 0.3, dv, tl, sink, bt, bias


def _indexer_case(dtype=torch.float64):
    g = torch.Generator().manual_seed(6)
    s_q, s_kv, h, d = 5, 23, 4, 16
    q = torch.randn(s_q, h, d, generator=g, dtype=dtype)
    k = torch.randn(s_kv, d, generator=g, dtype=dtype)
    w = torch.randn(s_q, h, generator=g, dtype=dtype)
    ks = torch.tensor([0, 0, 3, 5, 23])
    ke = torch.tensor([4, 23, 11, 5, 23])
    return q, k, w, ks, ke


def _more_opcheck_cases():
    q, cache, idx, scale, dv, tl, sink, bt, bias = _decode_case()
    outs = torch.randn(3, 2, 5, 4, 16, dtype=torch.float64)
    lses = torch.randn(3, 2, 5, 4, dtype=torch.float64)
    lses[1, 0, 0] = float("inf")  # an empty part
    iq, ik, iw, ks, ke = _indexer_case()
    return {
        "sparse_mla_decode": (q, cache, idx, scale, dv, tl, sink, bt, bias),
        "sparse_mla_decode-flat": (q, cache.view(-1, cache.shape[-1]), idx.long(), scale, dv, None, None, None, None),
        "merge_attn_partials": (outs, lses, torch.randn(4, dtype=torch.float64), torch.float32),
        "merge_attn_partials-plain": (outs.float(), lses.float(), None, None),
        "indexer_logits": (iq, ik, iw, 0.5, ks, ke, None, None),
        "indexer_topk": (iq, ik, iw, 6, 0.5, ks, ke, None, None, True),
        "indexer_topk-nologits": (iq, ik, iw, 30, 1.0, None, None, None, None, False),
    }


OPCHECK_KWARGS = {"sparse_mla_bwd-asum": {"deterministic": True, "return_attn_sum": True}}


@pytest.mark.parametrize("name", list(_more_opcheck_cases()))
def test_opcheck_decode_merge_indexer(name):
    args = _more_opcheck_cases()[name]
    op = getattr(torch.ops.mla_kernels, name.split("-")[0]).default
    torch.library.opcheck(op, args)


def test_decode_merge_indexer_ops_match_the_public_functions():
    q, cache, idx, scale, dv, tl, sink, bt, bias = _decode_case()
    want = mk.sparse_mla_decode(q, cache, idx, scale, dv, tl, sink, block_table=bt, q_bias=bias)
    got = torch.ops.mla_kernels.sparse_mla_decode(q, cache, idx, scale, dv, tl, sink, bt, bias)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    outs, lses = torch.randn(2, 3, 4, 16, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
    for a, b in zip(torch.ops.mla_kernels.merge_attn_partials(outs, lses, None, torch.float32),
                    mk.merge_attn_partials(outs, lses, out_dtype=torch.float32)):
        torch.testing.assert_close(a, b)
    iq, ik, iw, ks, ke = _indexer_case()
    torch.testing.assert_close(torch.ops.mla_kernels.indexer_logits(iq, ik, iw, 0.5, ks, ke),
                               mk.indexer_logits(iq, ik, iw, sm_scale=0.5, k_start=ks, k_end=ke))
    i1, l1, g1 = torch.ops.mla_kernels.indexer_topk(iq, ik, iw, 6, 0.5, ks, ke, None, None, False)
    i2, l2 = mk.indexer_topk(iq, ik, iw, 6, sm_scale=0.5, k_start=ks, k_end=ke)
    assert torch.equal(i1, i2) and torch.equal(l1, l2) and g1.shape == (0,)


def test_compile_fullgraph_decode_merge_indexer_on_cpu():
    q, cache, idx, scale, dv, tl, sink, bt, bias = _decode_case(torch.float32)
    iq, ik, iw, ks, ke = _indexer_case(torch.float32)

    def f(q, cache, iq, ik, iw):
        out, lse = mk.sparse_mla_decode(q, cache, idx, scale, dv, tl, sink, block_table=bt, q_bias=bias)
        m_out, m_lse = mk.merge_attn_partials(torch.stack([out, out]), torch.stack([lse, lse]))
        sel, n, logits = mk.indexer_topk(iq, ik, iw, 6, sm_scale=0.5, k_start=ks, k_end=ke, return_logits=True)
        dense = mk.indexer_logits(iq, ik, iw, sm_scale=0.5, k_start=ks, k_end=ke)
        return out, lse, m_out, m_lse, sel, n, logits, dense

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, cache, iq, ik, iw)
    want = f(q, cache, iq, ik, iw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    # the merge of two equal parts: the same out, lse + log 2
    torch.testing.assert_close(got[2], got[0])
    fin = torch.isfinite(got[1])
    torch.testing.assert_close(got[3][fin], got[1][fin] + math.log(2.0))
    # a plan is ignored while tracing (the graph allocates its outputs)
    plan = mk.decode_plan(3, 2, 8, 9, d_qk=32, d_v=dv, dtype=torch.float32, device="cpu")
    torch._dynamo.reset()
    got_p = torch.compile(lambda q: mk.sparse_mla_decode(q, cache, idx, scale, dv, tl, sink, block_table=bt,
                                                         q_bias=bias, plan=plan), fullgraph=True,
                          backend="aot_eager")(q)
    torch.testing.assert_close(got_p[0], want[0])


def test_decode_merge_indexer_validation_errors_at_trace_time():
    q, cache, idx, scale, dv, tl, sink, bt, bias = _decode_case(torch.float32)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="kv_cache's last dim must equal q's d_qk"):
        torch.compile(lambda c: mk.sparse_mla_decode(q, c, idx, scale, dv), fullgraph=True,
                      backend="aot_eager")(cache[..., :-1].contiguous())
    torch._dynamo.reset()
    with pytest.raises(Exception, match="lses must have shape"):
        torch.compile(lambda o: mk.merge_attn_partials(o, torch.zeros(2, 3)), fullgraph=True,
                      backend="aot_eager")(torch.zeros(2, 3, 4, 8))
    iq, ik, iw, ks, ke = _indexer_case(torch.float32)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="topk must be >= 1"):
        torch.compile(lambda q: mk.indexer_topk(q, ik, iw, 0), fullgraph=True, backend="aot_eager")(iq)


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck(name):
    args = _opcheck_cases()[name]
    op = getattr(torch.ops.mla_kernels, name.split("-")[0]).default
    torch.library.opcheck(op, args, OPCHECK_KWARGS.get(name, {}))


def test_every_public_op_has_a_custom_op_with_its_positional_arguments():
    import inspect

    for public, op in ((mk.sparse_mla_fwd, "sparse_mla_fwd"), (mk.attn_dist, "attn_dist"),
                       (mk.sparse_mla_bwd, "sparse_mla_bwd"), (mk.sparse_mla_decode, "sparse_mla_decode"),
                       (mk.merge_attn_partials, "merge_attn_partials"), (mk.indexer_logits, "indexer_logits"),
                       (mk.indexer_topk, "indexer_topk")):
        schema = getattr(torch.ops.mla_kernels, op).default._schema
        names = [a.name for a in schema.arguments]
        pos = [n for n, p in inspect.signature(public).parameters.items()
               if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
        assert names[: len(pos)] == pos, (op, names, pos)
    assert set(mk.ops.OPS) == {"sparse_mla_fwd", "attn_dist", "sparse_mla_bwd", "sparse_mla_decode",
                               "merge_attn_partials", "indexer_logits", "indexer_topk"}
    # the public keyword-only arguments follow, in order, as the op's positional ones
    for public, op in ((mk.sparse_mla_decode, "sparse_mla_decode"), (mk.indexer_topk, "indexer_topk"),
                       (mk.merge_attn_partials, "merge_attn_partials"), (mk.indexer_logits, "indexer_logits")):
        names = [a.name for a in getattr(torch.ops.mla_kernels, op).default._schema.arguments]
        public_names = [n for n in inspect.signature(public).parameters if n != "plan"]
        assert names == public_names, (op, names, public_names)


def test_bwd_op_maps_absent_outputs_to_empty_tensors_and_public_bwd_back_to_none():
    c = _case(sink=None)
    out, _, lse = mk.sparse_mla_fwd(c.q, c.kv, c.indices, c.sm_scale, DV)
    dout = torch.randn_like(out)
    dq, dkv, dsink, asum = torch.ops.mla_kernels.sparse_mla_bwd(c.q, c.kv, out, dout, c.indices, lse, c.sm_scale, DV)
    assert dsink.shape == (0,) and asum.shape == (0,)
    want = mk.sparse_mla_bwd(c.q, c.kv, out, dout, c.indices, lse, c.sm_scale, DV)
    assert want[2] is None
    torch.testing.assert_close(dq, want[0])
    torch.testing.assert_close(dkv, want[1])


def _train_step(q, kv, sink, c):
    out, lse = mk.sparse_mla(q, kv, c.indices, c.sm_scale, c.d_v, c.topk_length, sink, return_lse=True)
    fin = torch.isfinite(lse)
    return out.float().square().sum() + torch.where(fin, lse, torch.zeros_like(lse)).float().sum() * 0.1


def _compiled_vs_eager(c, dtype_grad):
    leaves = [c.q.clone().requires_grad_(), c.kv.clone().requires_grad_(),
              c.attn_sink.to(dtype_grad).clone().requires_grad_()]
    torch._dynamo.reset()
    step = torch.compile(lambda q, kv, s: _train_step(q, kv, s, c), fullgraph=True, backend="aot_eager")
    loss_c = step(*leaves)
    loss_c.backward()
    grads_c = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    loss_e = _train_step(*leaves, c)
    loss_e.backward()
    return loss_c, loss_e, grads_c, [t.grad for t in leaves]


def test_compile_fullgraph_fwd_bwd_on_cpu():
    c = _case()
    loss_c, loss_e, gc, ge = _compiled_vs_eager(c, torch.float64)
    torch.testing.assert_close(loss_c, loss_e)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)


def test_compile_fullgraph_inference_ops_on_cpu():
    c = _case(dtype=torch.float32)

    def f(q, kv):
        out, ml, lse = mk.sparse_mla_fwd(q, kv, c.indices, c.sm_scale, DV, c.topk_length)
        a = mk.attn_dist(q, kv, c.indices, lse.clamp(max=50.0), c.sm_scale, c.topk_length, normalize=True)
        return out, a

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(c.q, c.kv)
    want = f(c.q, c.kv)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_torch_export_of_a_module_calling_sparse_mla():
    c = _case(dtype=torch.float32, sink=None)

    class Attn(torch.nn.Module):
        def forward(self, q, kv, indices):
            return mk.sparse_mla(q, kv, indices, c.sm_scale, DV)

    ep = torch.export.export(Attn(), (c.q, c.kv, c.indices))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "mla_kernels.sparse_mla_fwd.default" in targets
    torch.testing.assert_close(ep.module()(c.q, c.kv, c.indices), mk.sparse_mla(c.q, c.kv, c.indices, c.sm_scale, DV))


def test_eager_calls_do_not_go_through_the_dispatcher(monkeypatch):
    # The custom ops are for tracing only: an eager call must run the body directly.
    c = _case()
    seen = []
    from mla_kernels import api_indexer

    for mod, name in ((api, "sparse_mla_fwd_eager"), (api, "attn_dist_eager"), (api, "sparse_mla_bwd_eager"),
                      (api, "sparse_mla_decode_eager"), (api, "merge_attn_partials_eager"),
                      (api_indexer, "indexer_logits_eager"), (api_indexer, "indexer_topk_eager")):
        orig = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _o=orig, _n=name, **k: seen.append(_n) or _o(*a, **k))
    dq, cache, didx, scale, dv = _decode_case()[:5]
    iq, ik, iw = _indexer_case()[:3]
    with torch.profiler.profile() as prof:
        out, _, lse = mk.sparse_mla_fwd(c.q, c.kv, c.indices, c.sm_scale, DV)
        mk.attn_dist(c.q, c.kv, c.indices, lse.clamp(max=50.0), c.sm_scale)
        q = c.q.clone().requires_grad_()
        mk.sparse_mla(q, c.kv, c.indices, c.sm_scale, DV).sum().backward()
        d_out, d_lse = mk.sparse_mla_decode(dq, cache, didx, scale, dv)
        mk.merge_attn_partials(d_out[None], d_lse[None])
        mk.indexer_logits(iq, ik, iw)
        mk.indexer_topk(iq, ik, iw, 4)
    names = {e.name for e in prof.events()}
    assert not any(n.startswith("mla_kernels::") for n in names), sorted(n for n in names if "mla" in n)
    assert seen == ["sparse_mla_fwd_eager", "attn_dist_eager",  # sparse_mla: SparseMLA, not the op
                    "sparse_mla_decode_eager", "merge_attn_partials_eager", "indexer_logits_eager",
                    "indexer_topk_eager"]


def test_validation_errors_are_raised_at_trace_time():
    c = _case(dtype=torch.float32)
    bad_kv = torch.randn(S_KV, 1, D + 1)

    def f(q, kv):
        return mk.sparse_mla(q, kv, c.indices, c.sm_scale, DV)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="kv's last dim must equal q's d_qk"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(c.q, bad_kv)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="sm_scale must be > 0"):
        torch.compile(lambda q: mk.sparse_mla_fwd(q, c.kv, c.indices, -1.0, DV), fullgraph=True,
                      backend="aot_eager")(c.q)


def test_attn_sum_holder_under_compile_says_what_to_use_instead():
    c = _case(dtype=torch.float32)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="mla_kernels.attn_dist"):
        torch.compile(lambda q: mk.sparse_mla(q, c.kv, c.indices, c.sm_scale, DV, attn_sum=mk.AttnSum()),
                      fullgraph=True, backend="aot_eager")(c.q.clone().requires_grad_())


@pytest.mark.parametrize("path", ["eager", "custom_op"])
def test_double_backward_raises_a_clear_error(path):
    c = _case()
    q = c.q.clone().requires_grad_()
    kv = c.kv.clone().requires_grad_()
    if path == "eager":
        out = mk.sparse_mla(q, kv, c.indices, c.sm_scale, DV, c.topk_length)
    else:
        out = torch.ops.mla_kernels.sparse_mla_fwd(q, kv, c.indices, c.sm_scale, DV, c.topk_length)[0]
    (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    assert gq.requires_grad  # not a silently detached gradient
    with pytest.raises(RuntimeError, match="does not support double backward"):
        gq.square().sum().backward()
    # create_graph=True alone (no backward through the gradients) is fine
    out = mk.sparse_mla(q, kv, c.indices, c.sm_scale, DV)
    (gq2,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    assert torch.isfinite(gq2).all()


@skip_unless_sm90()
def test_compile_fullgraph_fwd_bwd_on_gpu_matches_eager_and_reference():
    c = make_case(70, 128, 576, 1000, 256, dtype=torch.bfloat16, device="cuda", topk_length=True,
                  sink="finite")
    leaves = [c.q.clone().requires_grad_(), c.kv.clone().requires_grad_(), c.attn_sink.clone().requires_grad_()]
    torch._dynamo.reset()
    step = torch.compile(lambda q, kv, s: _train_step(q, kv, s, c), fullgraph=True)
    loss_c = step(*leaves)
    loss_c.backward()
    gc = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    loss_e = _train_step(*leaves, c)
    loss_e.backward()
    ge = [t.grad for t in leaves]
    assert mk.backend_for("cuda") == "sm90"
    assert abs(loss_c.item() - loss_e.item()) <= 1e-3 * abs(loss_e.item())
    for a, b in zip(gc, ge):
        assert not torch.isnan(a).any()
        assert rel_l2(a.float(), b.float()) <= 1e-2  # dkv atomics: last bits vary between runs
    # and against the float32 reference (CPU math on the same inputs)
    ref_leaves = [t.detach().float().cpu().requires_grad_() for t in leaves]
    cref = type(c)(*[getattr(c, f).cpu() if torch.is_tensor(getattr(c, f)) else getattr(c, f)
                     for f in ("q", "kv", "indices", "sm_scale", "d_v", "topk_length", "attn_sink")])
    _train_step(*ref_leaves, cref).backward()
    for a, b in zip(gc, ref_leaves):
        assert rel_l2(a.float().cpu(), b.grad) <= 2e-2


@skip_unless_sm90()
def test_opcheck_on_gpu():
    c = make_case(9, 64, 576, 300, 128, dtype=torch.bfloat16, device="cuda")
    out, _, lse = mk.sparse_mla_fwd(c.q, c.kv, c.indices, c.sm_scale)
    dout = torch.randn_like(out) * 0.1
    torch.library.opcheck(torch.ops.mla_kernels.sparse_mla_fwd.default,
                          (c.q.clone().requires_grad_(), c.kv.clone().requires_grad_(), c.indices, c.sm_scale),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    torch.library.opcheck(torch.ops.mla_kernels.attn_dist.default, (c.q, c.kv, c.indices, lse, c.sm_scale),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.mla_kernels.sparse_mla_bwd.default,
                          (c.q, c.kv, out, dout, c.indices, lse, c.sm_scale),
                          test_utils=("test_schema", "test_faketensor"))


def _example():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "dsa_attention.py")
    spec = importlib.util.spec_from_file_location("dsa_attention", path)
    mod = importlib.util.module_from_spec(spec)
    import sys

    sys.modules["dsa_attention"] = mod  # dynamo looks the module up by name
    spec.loader.exec_module(mod)
    return mod


def test_readme_dsa_module_trains_under_compile_fullgraph():
    ex = _example()
    torch.manual_seed(0)
    block = ex.DSAAttention(32, h_q=4, d_qk=24, d_v=16, topk=12, h_idx=2, d_idx=8).double()
    x = torch.randn(40, 32, dtype=torch.float64)

    def loss_fn(x):
        y, kl = block(x)
        return y.square().mean() + kl, kl

    torch._dynamo.reset()
    loss_c, kl_c = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")(x)
    loss_c.backward()
    gc = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    loss_e, kl_e = loss_fn(x)
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e)
    assert kl_e.item() > 0 and torch.isfinite(kl_e)
    for a, p in zip(gc, block.parameters()):
        torch.testing.assert_close(a, p.grad)
    assert block.idx_q.weight.grad.abs().sum() > 0  # the indexer learns from the KL target
