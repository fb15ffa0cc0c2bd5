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
                               "merge_attn_partials", "indexer_logits", "indexer_topk", "indexer_loss_fwd",
                               "indexer_loss_bwd"}
    # the public keyword-only arguments follow, in order, as the op's positional ones
    for public, op in ((mk.sparse_mla_decode, "sparse_mla_decode"), (mk.indexer_topk, "indexer_topk"),
                       (mk.merge_attn_partials, "merge_attn_partials"), (mk.indexer_logits, "indexer_logits")):
        names = [a.name for a in getattr(torch.ops.mla_kernels, op).default._schema.arguments]
        public_names = [n for n in inspect.signature(public).parameters if n != "plan"]
        assert names == public_names, (op, names, public_names)
    # indexer_loss: every public argument in order but ``reduction`` (the public function reduces the op's rows)
    names = [a.name for a in torch.ops.mla_kernels.indexer_loss_fwd.default._schema.arguments]
    public_names = [n for n in inspect.signature(mk.indexer_loss).parameters if n != "reduction"]
    assert names == public_names, (names, public_names)
    assert [a.name for a in torch.ops.mla_kernels.indexer_loss_bwd.default._schema.arguments] == [
        "q_idx", "k_idx", "weights", "indices", "target", "grad_rows", "lse", "inv_tsum", "sm_scale", "topk_length",
        "deterministic"]


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
                      (api_indexer, "indexer_logits_eager"), (api_indexer, "indexer_topk_eager"),
                      (api_indexer, "indexer_loss_fwd_eager"), (api_indexer, "indexer_loss_bwd_eager")):
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
        lq, lk, lw, lidx, ltgt, ltl = _loss_case()
        mk.indexer_loss(lq, lk, lw, lidx, ltgt, sm_scale=0.5, topk_length=ltl).backward()  # IndexerLoss, not the ops
        assert lq.grad is not None and lk.grad is not None and lw.grad is not None
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


# --------------------------------------------------------------------------------------------
# indexer_loss: mla_kernels::indexer_loss_fwd / indexer_loss_bwd
# --------------------------------------------------------------------------------------------


def _loss_case(dtype=torch.float64, grad=True, k3=True, int64=False):
    """q_idx, k_idx, weights (leaves), indices with invalid (-1, >= s_kv) slots, target with a
    zero-sum row, topk_length with an empty row."""
    g = torch.Generator().manual_seed(7)
    s_q, s_kv, h, d, topk = 6, 19, 4, 16, 7
    q = torch.randn(s_q, h, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(s_kv, 1, d, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(s_q, h, generator=g, dtype=torch.float64).to(dtype if dtype != torch.float8_e4m3fn else
                                                                  torch.float32)
    if not k3:
        k = k.reshape(s_kv, d)
    idx = torch.randint(-2, s_kv + 3, (s_q, 1, topk), generator=g)
    idx = idx if int64 else idx.to(torch.int32)
    tgt = torch.rand(s_q, topk, generator=g, dtype=torch.float64)
    tgt[4] = 0.0  # zero target sum: zero loss, no gradient
    tl = torch.tensor([7, 3, 0, 5, 7, 6], dtype=torch.int32)  # row 2: no valid slot
    if grad:
        q, k, w = (t.clone().requires_grad_() for t in (q, k, w))
    return q, k, w, idx, tgt, tl


def _loss_opcheck_cases():
    q, k, w, idx, tgt, tl = _loss_case()
    q2, k2, w2, idx2, tgt2, _ = _loss_case(torch.float32, k3=False, int64=True)
    rows, lse, inv = torch.ops.mla_kernels.indexer_loss_fwd(q.detach(), k.detach(), w.detach(), idx, tgt, 0.5, tl)
    g_rows = torch.randn(rows.shape, dtype=rows.dtype)
    q8 = q.detach().to(torch.float8_e4m3fn)
    k8 = k.detach().to(torch.float8_e4m3fn)
    qs, ks = torch.rand(q8.shape[:2]) + 0.5, torch.rand(k8.shape[0]) + 0.5
    return {
        "indexer_loss_fwd": (q, k, w, idx, tgt, 0.5, tl, False, None, None),
        "indexer_loss_fwd-f32-int64-2d-det": (q2, k2, w2, idx2, tgt2.float(), 1.0, None, True, None, None),
        "indexer_loss_fwd-fp8": (q8, k8, w.detach().float(), idx, tgt, 0.5, tl, False, qs, ks),
        "indexer_loss_bwd": (q.detach(), k.detach(), w.detach(), idx, tgt, g_rows, lse, inv, 0.5, tl, False),
        "indexer_loss_bwd-det": (q.detach(), k.detach().reshape(k.shape[0], -1), w.detach(), idx.long(), tgt, g_rows,
                                 lse, inv, 0.5, None, True),
    }


# torch's SchemaCheckMode (opcheck's test_schema) compares every aten op's float8 arguments before
# and after the call with a multiplication that has no float8 kernel on the CPU: the fp8 case runs
# the other checks.
LOSS_OPCHECK_UTILS = {"indexer_loss_fwd-fp8": ("test_autograd_registration", "test_faketensor",
                                               "test_aot_dispatch_dynamic")}


@pytest.mark.parametrize("name", list(_loss_opcheck_cases()))
def test_opcheck_indexer_loss(name):
    args = _loss_opcheck_cases()[name]
    op = getattr(torch.ops.mla_kernels, name.split("-")[0]).default
    utils = LOSS_OPCHECK_UTILS.get(name)
    if utils is None:
        torch.library.opcheck(op, args)
    else:
        torch.library.opcheck(op, args, test_utils=utils)


def test_indexer_loss_ops_match_the_public_function_and_the_autograd_reference():
    from mla_kernels import reference as ref

    q, k, w, idx, tgt, tl = _loss_case()
    rows, lse, inv = torch.ops.mla_kernels.indexer_loss_fwd(q, k, w, idx, tgt, 0.5, tl)
    want = ref.indexer_loss_ref(q, k, w, idx, tgt, 0.5, tl, reduction="none")
    torch.testing.assert_close(rows, want)
    torch.testing.assert_close(rows, mk.indexer_loss(q, k, w, idx, tgt, sm_scale=0.5, topk_length=tl,
                                                     reduction="none"))
    assert rows[2] == 0 and rows[4] == 0 and (rows[[0, 1, 3, 5]] > 0).all()
    g_rows = torch.randn(rows.shape, dtype=rows.dtype)
    got = torch.autograd.grad((rows * g_rows).sum(), (q, k, w))  # the op's registered autograd formula
    exp = torch.autograd.grad((want * g_rows).sum(), (q, k, w))  # plain torch autograd
    for a, b in zip(got, exp):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b)
    assert got[0][2].abs().sum() == 0 and got[0][4].abs().sum() == 0  # no gradient from inactive rows
    # the backward op directly, deterministic: bitwise equal run to run
    d1 = torch.ops.mla_kernels.indexer_loss_bwd(q.detach(), k.detach(), w.detach(), idx, tgt, g_rows, lse, inv, 0.5,
                                                tl, True)
    d2 = torch.ops.mla_kernels.indexer_loss_bwd(q.detach(), k.detach(), w.detach(), idx, tgt, g_rows, lse, inv, 0.5,
                                                tl, True)
    for a, b, c in zip(d1, d2, exp):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compile_fullgraph_indexer_loss_fwd_bwd_on_cpu(reduction):
    from mla_kernels import reference as ref

    q, k, w, idx, tgt, tl = _loss_case()

    def step(q, k, w):
        # the target comes out of the graph too (a constant to the loss); a reduction, a sum with another term
        loss = mk.indexer_loss(q, k, w, idx, tgt * 2.0, sm_scale=0.5, topk_length=tl, reduction=reduction)
        return (loss if reduction == "mean" else (loss * torch.arange(1.0, 7.0, dtype=loss.dtype)).sum()) \
            + w.square().sum() * 0.01

    torch._dynamo.reset()
    loss_c = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, w)
    gc = torch.autograd.grad(loss_c, (q, k, w))
    loss_e = step(q, k, w)
    ge = torch.autograd.grad(loss_e, (q, k, w))
    torch.testing.assert_close(loss_c, loss_e)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)

    def ref_step(q, k, w):
        loss = ref.indexer_loss_ref(q, k, w, idx, tgt * 2.0, 0.5, tl, reduction=reduction)
        return (loss if reduction == "mean" else (loss * torch.arange(1.0, 7.0, dtype=loss.dtype)).sum()) \
            + w.square().sum() * 0.01

    loss_r = ref_step(q, k, w)
    gr = torch.autograd.grad(loss_r, (q, k, w))
    torch.testing.assert_close(loss_c, loss_r)
    for a, b in zip(gc, gr):
        torch.testing.assert_close(a, b)
    assert all(a.abs().sum() > 0 for a in gc)


def test_torch_export_keeps_indexer_loss_by_name():
    q, k, w, idx, tgt, tl = _loss_case(torch.float32, grad=False)

    class Loss(torch.nn.Module):
        def forward(self, q, k, w):
            return mk.indexer_loss(q, k, w, idx, tgt, sm_scale=0.5, topk_length=tl, reduction="sum")

    ep = torch.export.export(Loss(), (q, k, w))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "mla_kernels.indexer_loss_fwd.default" in targets
    torch.testing.assert_close(ep.module()(q, k, w), Loss()(q, k, w))


def test_indexer_loss_validation_errors_at_trace_time_and_in_the_ops():
    q, k, w, idx, tgt, tl = _loss_case(torch.float32, grad=False)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="target must have shape"):
        torch.compile(lambda q: mk.indexer_loss(q, k, w, idx, tgt[:, :-1]), fullgraph=True,
                      backend="aot_eager")(q)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="k_idx's last dim must equal"):
        torch.compile(lambda k: mk.indexer_loss(q, k, w, idx, tgt), fullgraph=True,
                      backend="aot_eager")(k[..., :-1].contiguous())
    rows, lse, inv = torch.ops.mla_kernels.indexer_loss_fwd(q, k, w, idx, tgt)
    with pytest.raises(ValueError, match=r"grad_rows must have shape \[s_q\]=\[6\]"):
        torch.ops.mla_kernels.indexer_loss_bwd(q, k, w, idx, tgt, rows[:-1], lse, inv)
    with pytest.raises(TypeError, match="lse must be a float tensor"):
        torch.ops.mla_kernels.indexer_loss_bwd(q, k, w, idx, tgt, rows, lse.int(), inv)
    from mla_kernels import api_indexer

    with pytest.raises(TypeError, match="deterministic must be a bool"):
        api_indexer.indexer_loss_fwd_eager(q, k, w, idx, tgt, 1.0, None, 1)
    q8, k8 = q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float8_e4m3fn inputs are forward-only"):
        torch.ops.mla_kernels.indexer_loss_bwd(q8, k8, w, idx, tgt, rows, lse, inv)
    # fp8 under compile: the forward-only loss traces (no gradient asked)
    qs, ks = torch.ones(q.shape[:2]), torch.ones(k.shape[0])
    with torch.no_grad():
        torch._dynamo.reset()
        got = torch.compile(lambda q8: mk.indexer_loss(q8, k8, w, idx, tgt, topk_length=tl, q_scale=qs, k_scale=ks),
                            fullgraph=True, backend="aot_eager")(q8)
        torch.testing.assert_close(got, mk.indexer_loss(q8, k8, w, idx, tgt, topk_length=tl, q_scale=qs, k_scale=ks))


@pytest.mark.parametrize("path", ["eager", "custom_op"])
def test_indexer_loss_double_backward_raises_a_clear_error(path):
    q, k, w, idx, tgt, tl = _loss_case()
    if path == "eager":
        rows = mk.indexer_loss(q, k, w, idx, tgt, sm_scale=0.5, topk_length=tl, reduction="none")
    else:
        rows = torch.ops.mla_kernels.indexer_loss_fwd(q, k, w, idx, tgt, 0.5, tl)[0]
    gq, gk, gw = torch.autograd.grad(rows.sum(), (q, k, w), create_graph=True)
    assert gq.requires_grad and gk.requires_grad and gw.requires_grad  # not silently detached
    with pytest.raises(RuntimeError, match="indexer_loss does not support double backward"):
        (gq.square().sum() + gw.sum()).backward()
    # create_graph=True alone is fine, and the gradients are the plain ones
    want = torch.autograd.grad(mk.indexer_loss(q, k, w, idx, tgt, sm_scale=0.5, topk_length=tl,
                                               reduction="none").sum(), (q, k, w))
    for a, b in zip((gq, gk, gw), want):
        torch.testing.assert_close(a.detach(), b)


def _gpu_loss_case(s_q=150, s_kv=700, topk=300, h=64, d=128, seed=11):
    """bfloat16 q_idx/k_idx, float32 weights (the loss kernels' configuration: h_idx 64), indices
    with -1 / out-of-range / duplicate slots, a zero-target row, topk_length with empty rows."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h, d, generator=g).bfloat16().cuda()
    k = torch.randn(s_kv, d, generator=g).bfloat16().cuda()
    w = (torch.randn(s_q, h, generator=g) * 0.2).cuda()
    idx = torch.randint(-3, s_kv + 3, (s_q, topk), generator=g)
    idx[:, 1] = idx[:, 0]  # a duplicate slot per row
    tgt = torch.rand(s_q, topk, generator=g) * (torch.rand(s_q, topk, generator=g) < 0.8)
    tgt[2] = 0.0
    lens = torch.randint(0, topk + 1, (s_q,), generator=g)
    lens[5] = 0
    return q, k, w, idx.int().cuda(), tgt.cuda(), lens.int().cuda()


@skip_unless_sm90()
def test_compile_fullgraph_indexer_loss_on_gpu_matches_eager_and_reference(monkeypatch):
    from mla_kernels import reference as ref

    monkeypatch.setenv("MLA_KERNELS_BACKEND", "sm90")
    q, k, w, idx, tgt, lens = _gpu_loss_case()
    scale = q.shape[-1] ** -0.5
    g_rows = torch.randn(q.shape[0], generator=torch.Generator().manual_seed(2)).cuda()

    def step(q, k, w):
        rows = mk.indexer_loss(q, k, w, idx, tgt, sm_scale=scale, topk_length=lens, reduction="none")
        return (rows * g_rows).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, w)]
    torch._dynamo.reset()
    loss_c = torch.compile(step, fullgraph=True)(*leaves)
    gc = torch.autograd.grad(loss_c, leaves)
    loss_e = step(*leaves)
    ge = torch.autograd.grad(loss_e, leaves)
    torch.cuda.synchronize()
    assert abs(loss_c.item() - loss_e.item()) <= 1e-5 * (1 + abs(loss_e.item()))
    for a, b in zip(gc, ge):
        assert a.dtype == b.dtype and not torch.isnan(a).any()
        assert rel_l2(a.float(), b.float()) <= 1e-3  # dk float32 atomics: last bits vary between runs
    # the float32 reference on the same (bf16-valued) inputs
    _, lse, inv = ref.indexer_loss_fwd_ref(q.float(), k.float(), w, idx, tgt, scale, lens)
    want = ref.indexer_loss_bwd_ref(q.float(), k.float(), w, idx, tgt, g_rows, lse, inv, scale, lens)
    for name, a, b in zip(("dq", "dk", "dw"), gc, want):
        assert rel_l2(a.float(), b) <= 1e-2, f"{name} rel L2 {rel_l2(a.float(), b):.3g}"
    assert (gc[0][2] == 0).all() and (gc[0][5] == 0).all() and (gc[2][5] == 0).all()  # inactive rows
    # opcheck on the GPU (the kernels' outputs: schema, fake tensor, autograd registration)
    torch.library.opcheck(torch.ops.mla_kernels.indexer_loss_fwd.default,
                          tuple(leaves) + (idx, tgt, scale, lens, False, None, None),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    rows, lse_k, inv_k = torch.ops.mla_kernels.indexer_loss_fwd(q, k, w, idx, tgt, scale, lens)
    torch.library.opcheck(torch.ops.mla_kernels.indexer_loss_bwd.default,
                          (q, k, w, idx, tgt, g_rows, lse_k, inv_k, scale, lens, True),
                          test_utils=("test_schema", "test_faketensor"))
